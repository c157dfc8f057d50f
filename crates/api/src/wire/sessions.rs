//! Sessions: create, change, fork, revert; what a session and its checkpoints look like.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::network::NetworkSetting;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
    /// 64 up to the server's maximum.
    #[cfg_attr(feature = "openapi", schema(minimum = 64))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template the session starts from and stays on (default: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of the session (narrows the server's policy; kept across eviction and forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSetting>,
    /// Secrets by environment variable name (at most 16): the sandbox's
    /// variable holds an opaque placeholder, replaced by the value in the
    /// header values of HTTP requests to the secret's hosts (see docs/network.md).
    /// Never returned, logged or written in the clear (kept across eviction and forks).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, SecretSpec>,
}

/// A secret of a new session.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The real value (1 to 8192 bytes, no CR, LF or NUL). Read as any JSON
    /// value and checked in [`seal_secrets`], so that an error never quotes it.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub value: serde_json::Value,
    /// Host names it is sent to (`api.example.com`, `*.example.org`): a
    /// connection to an address the sandbox's resolver handed out for one of them.
    pub hosts: Vec<String>,
    /// Ports it is sent to (default: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Also in HTTPS to these hosts (default false): the server terminates
    /// the sandbox's TLS to them with a leaf of its egress CA, which the
    /// session's sandboxes trust (see docs/network.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
}

/// A secret as it is shown: its name and destinations, never its value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
}

/// What `PATCH /v1/sessions/{id}` changes; absent fields stay as they are.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PatchSession {
    /// The session's new tags (they replace the old ones as a whole; `{}` removes them all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<BTreeMap<String, String>>,
    /// 64 up to the server's maximum; applies from the next exec.
    #[cfg_attr(feature = "openapi", schema(minimum = 64))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session (at most the server's maximum, and the key's).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RevertRequest {
    /// Seq of the checkpoint to move the session's head back to.
    pub checkpoint: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Seq of the checkpoint to fork from (default: the head).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkedFrom {
    pub session: String,
    pub checkpoint: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionLimits {
    pub memory_mb: u64,
    pub timeout_seconds: f64,
    /// The effective network policy: `mode` (none, public or allowlist) and
    /// the layers (server, then session) that must all allow a destination.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub network: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Session {
    pub id: String,
    pub tags: BTreeMap<String, String>,
    pub created_ms: i64,
    pub last_used_ms: i64,
    /// Whether its VM is in memory (else it is on disk and resumes on the next exec).
    pub resident: bool,
    /// Seq of the head checkpoint (null: none yet).
    pub checkpoint: Option<i64>,
    /// Until its first exec, a fork names where it was forked from.
    pub forked_from: Option<ForkedFrom>,
    pub limits: SessionLimits,
    /// The template it is on (its name here; null if no name has that template now).
    pub template: Option<String>,
    /// The id of that template (what the session is pinned to).
    pub template_id: String,
    /// The last non-blank line of its head checkpoint's code (at most 120 characters; null: no checkpoint).
    pub last_code: Option<String>,
    /// Its secrets: names and destinations only (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretInfo>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionList {
    pub sessions: Vec<Session>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Checkpoint {
    pub seq: i64,
    /// Seq of the parent checkpoint (null: the template).
    pub parent: Option<i64>,
    pub code: String,
    pub created_ms: i64,
    pub bytes: u64,
    pub pages: u64,
    /// Whether the session's head is here.
    pub head: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

impl SessionLimits {
    /// The effective network mode (`none`, `public`, `allowlist`), if the server said.
    pub fn network_mode(&self) -> Option<&str> {
        self.network.get("mode")?.as_str()
    }
}
