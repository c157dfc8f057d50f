//! Templates: what execs and sessions fork from.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::network::NetworkSetting;
use super::sessions::{SecretInfo, SecretSpec};

/// A template execs and sessions can fork from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TemplateBody {
    pub name: String,
    pub description: String,
    /// `ready` (open), `available` (built on first use), `building`, `failed`.
    pub status: String,
    /// Its id once built (what sessions record).
    pub id: Option<String>,
    /// The server's default.
    pub default: bool,
    /// Debian packages asked for (their dependencies come along).
    pub packages: Vec<String>,
    /// Code run before the snapshot.
    pub preload: String,
    pub image_bytes: Option<u64>,
    /// Why the last build failed.
    pub error: Option<String>,
    /// `shipped`, `custom` (built from packages) or `checkpoint` (a session's state).
    pub source: String,
    /// pip requirement specs, installed as binary wheels.
    pub pip: Vec<String>,
    /// While `building`: the step (`queued`, `image: <what the image build does>`, `template`).
    pub progress: Option<String>,
    /// While `building`: the fraction of the step done (0 to 1), where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// While `building`: seconds since the build was asked for.
    pub elapsed_seconds: Option<u64>,
    /// The session and checkpoint a `checkpoint` template was made from.
    pub from_session: Option<String>,
    pub from_checkpoint: Option<i64>,
    /// Its own egress policy layer (`mode`, `allow`, `deny`), which every sandbox
    /// forked from it gets inside the server's and the key's; absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub network: Option<serde_json::Value>,
    /// Its secrets (names and destinations only), which every sandbox forked
    /// from it gets (over the key's, under a session's of the same name); absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretInfo>,
}

/// `POST /v1/templates`: a template of the caller's own.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTemplateRequest {
    /// 1 to 63 of `a-z 0-9 . _ -`; not a shipped or shared template's name.
    pub name: String,
    /// Debian packages beyond the base image (Python 3.11, numpy, the userland).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apt: Vec<String>,
    /// pip requirement specs (`pandas>=2`), installed as binary wheels for CPython 3.11 /
    /// manylinux x86-64; one with only an sdist fails the build.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pip: Vec<String>,
    /// Code run before the snapshot (default `import numpy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preload: Option<String>,
    /// `reference` (default), `openblas` or `any`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blas: Option<String>,
    /// The template's egress policy (as `network` of a session): one-shot execs and
    /// sessions on it get it inside the server's and the key's, so it only narrows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSetting>,
    /// Secrets (as `secrets` of a session, at most 16) every one-shot exec and
    /// session on it gets: over the key's, under a session's of the same name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, SecretSpec>,
}

/// `POST /v1/sessions/{id}/checkpoints/{n}/template`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckpointTemplateRequest {
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TemplateList {
    pub templates: Vec<TemplateBody>,
    /// The default template's name.
    pub default: String,
}
