//! Python execs: one-shot (`POST /v1/exec`), batches, session execs, and their results.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::errors::ErrorDetail;
use super::network::NetworkSetting;

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Python source; the repr of a final expression is the result's `value`.
    pub code: String,
    /// Time limit of this exec (default: the server's; at most its maximum).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (see `GET /v1/templates`; default: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of this exec (narrows the server's policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSetting>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to 64 codes, each run in its own fork.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 64))]
    pub codes: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (see `GET /v1/templates`; default: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionExec {
    pub code: String,
    /// Time limit of this exec (default: the session's; at most the session's `limits.timeout_seconds`).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
}

/// A Python exception raised by the code (a result, not an HTTP error).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PyErrorBody {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

/// The result of an exec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResponse {
    /// repr() of the last expression, if the code ended with one that is not None.
    pub value: Option<String>,
    pub stdout: String,
    pub stderr: String,
    pub error: Option<PyErrorBody>,
    /// 0: ok, 1: the code raised a Python exception.
    pub exit_code: i32,
    /// Time inside the guest.
    pub runtime_ms: f64,
    /// Wall time of the exec on the host.
    pub wall_ms: f64,
    /// Syscalls the VMM served during the exec.
    pub syscalls: u64,
    /// One-shot execs: an id for this exec.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fork_time_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exec_time_ms: Option<f64>,
    /// Time in the server, request received to response (not for batch items).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_time_ms: Option<f64>,
    /// Session execs: the seq of the checkpoint that recorded this exec.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<i64>,
    /// Files under `/output` the exec created or changed (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFileBody>,
    /// The value's rich forms beside `value` (its text/plain): MIME type -> data, e.g.
    /// `text/html` for a pandas DataFrame, `image/png` (base64) for a PIL image (omitted when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub value_data: Option<MimeBundle>,
    /// What `display(obj)` showed and the matplotlib figures left open at the end (or
    /// `plt.show()`n), in order, as MIME bundles (`image/png` base64, `text/html`, `text/plain`, ...;
    /// omitted when none). 4 MiB an item, 8 MiB in all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub display: Vec<MimeBundle>,
}

/// A file under `/output` that an exec created or changed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutputFileBody {
    pub path: String,
    pub size: u64,
    pub mime: String,
    /// The bytes, base64 (omitted past 4 MiB per file / 8 MiB per exec: download the file instead).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Interrupted {
    /// Whether an exec was running (and was interrupted).
    pub interrupted: bool,
}

/// A batch item whose exec failed (timeout, crash, ...).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchItemError {
    /// The HTTP status this error would have had alone.
    pub status: u16,
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum BatchItem {
    Ok(Box<ExecResponse>),
    Failed(BatchItemError),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
    pub total_time_ms: f64,
}

/// One displayed object: MIME type -> data (text as strings, images as base64 strings,
/// `application/json` as JSON), Jupyter's mime bundle.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct MimeBundle(pub BTreeMap<String, serde_json::Value>);

impl MimeBundle {
    /// A text form (`text/plain`, `text/html`, `text/markdown`, `text/latex`, `image/svg+xml`).
    pub fn text(&self, mime: &str) -> Option<&str> {
        self.0.get(mime).and_then(serde_json::Value::as_str)
    }

    /// The bytes of a base64 form (`image/png`, `image/jpeg`); None if absent or not base64.
    pub fn bytes(&self, mime: &str) -> Option<Vec<u8>> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.decode(self.text(mime)?).ok()
    }

    /// The first image form: (mime, bytes).
    pub fn image(&self) -> Option<(&'static str, Vec<u8>)> {
        ["image/png", "image/jpeg", "image/gif", "image/webp"].into_iter().find_map(|m| self.bytes(m).map(|b| (m, b)))
    }

    pub fn json(&self) -> Option<&serde_json::Value> {
        self.0.get("application/json")
    }
}

impl From<BTreeMap<String, serde_json::Value>> for MimeBundle {
    fn from(m: BTreeMap<String, serde_json::Value>) -> MimeBundle {
        MimeBundle(m)
    }
}
