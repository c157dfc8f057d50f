//! The request and response bodies of the `/v1` API. The handlers take and
//! return these types and the OpenAPI document is derived from them, so the
//! two cannot drift apart.

use std::collections::BTreeMap;

use base64::Engine as _;
use forkbox_engine::ExecResult;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A sandbox's outbound network. `"none"`: no network; `"public"`: the
/// public internet, every non-public address (loopback, private, link-local
/// and the metadata endpoints, CGNAT, multicast, the host's own addresses)
/// refused; `{"allow": [...], "deny": [...]}`: only what `allow` names (rules:
/// `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`, `example.com`, `*.example.com:443`,
/// `*:25`). It only narrows the server's policy (the default: the server's,
/// `public` unless `forkbox serve --egress` says otherwise); a host-name rule
/// never opens a non-public address.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum NetworkSetting {
    Mode(NetworkMode),
    Rules {
        allow: Vec<String>,
        #[serde(default)]
        deny: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    None,
    Public,
}

impl NetworkSetting {
    /// The policy layer this setting adds (rule errors name the rule).
    pub fn policy(&self) -> Result<forkbox_engine::NetPolicy, String> {
        use forkbox_engine::{NetMode as Mode, NetPolicy as Policy, NetRule as Rule};
        let parse = |v: &[String]| -> Result<Vec<Rule>, String> {
            if v.len() > 256 {
                return Err("at most 256 network rules".into());
            }
            v.iter().map(|r| r.parse::<Rule>().map_err(|e| e.to_string())).collect()
        };
        Ok(match self {
            NetworkSetting::Mode(NetworkMode::None) => Policy::none(),
            NetworkSetting::Mode(NetworkMode::Public) => Policy::public(),
            NetworkSetting::Rules { allow, deny } => Policy { mode: Mode::Allowlist, allow: parse(allow)?, deny: parse(deny)? },
        })
    }
}

#[derive(Deserialize, ToSchema)]
pub struct ExecRequest {
    /// Python source; the repr of a final expression is the result's `value`.
    pub code: String,
    /// Time limit of this exec (default: the server's; at most its maximum).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
    /// Outbound network of this exec (narrows the server's policy).
    pub network: Option<NetworkSetting>,
}

#[derive(Deserialize, ToSchema)]
pub struct BatchRequest {
    /// 1 to 64 codes, each run in its own fork.
    #[schema(min_items = 1, max_items = 64)]
    pub codes: Vec<String>,
    pub timeout_seconds: Option<f64>,
}

#[derive(Deserialize, ToSchema)]
pub struct CreateSession {
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// 64 up to the server's maximum.
    #[schema(minimum = 64)]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session.
    pub timeout_seconds: Option<f64>,
    /// Outbound network of the session (narrows the server's policy; kept across eviction and forks).
    pub network: Option<NetworkSetting>,
}

#[derive(Deserialize, ToSchema)]
pub struct SessionExec {
    pub code: String,
}

#[derive(Deserialize, ToSchema)]
pub struct RevertRequest {
    /// Seq of the checkpoint to move the session's head back to.
    pub checkpoint: i64,
}

#[derive(Deserialize, ToSchema)]
pub struct ForkRequest {
    /// Seq of the checkpoint to fork from (default: the head).
    pub checkpoint: Option<i64>,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// A Python exception raised by the code (a result, not an HTTP error).
#[derive(Serialize, ToSchema)]
pub struct PyErrorBody {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

/// The result of an exec.
#[derive(Serialize, ToSchema)]
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
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFileBody>,
}

/// A file under `/output` that an exec created or changed.
#[derive(Serialize, ToSchema)]
pub struct OutputFileBody {
    pub path: String,
    pub size: u64,
    pub mime: String,
    /// The bytes, base64 (omitted past 4 MiB per file / 8 MiB per exec: download the file instead).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct Interrupted {
    /// Whether an exec was running (and was interrupted).
    pub interrupted: bool,
}

impl ExecResponse {
    pub fn of(r: &ExecResult) -> ExecResponse {
        ExecResponse {
            value: r.value.clone(),
            stdout: r.stdout.clone(),
            stderr: r.stderr.clone(),
            error: r.error.as_ref().map(|e| PyErrorBody {
                kind: e.kind.clone(),
                message: e.message.clone(),
                traceback: e.traceback.clone(),
            }),
            exit_code: if r.error.is_some() { 1 } else { 0 },
            runtime_ms: r.runtime_ms,
            wall_ms: r.wall_ms,
            syscalls: r.syscalls,
            id: None,
            fork_time_ms: None,
            exec_time_ms: None,
            total_time_ms: None,
            checkpoint: None,
            outputs: r
                .outputs
                .iter()
                .map(|o| OutputFileBody {
                    path: o.path.clone(),
                    size: o.size,
                    mime: o.mime.to_string(),
                    base64: o.data.as_ref().map(|d| base64::engine::general_purpose::STANDARD.encode(d)),
                })
                .collect(),
        }
    }
}

/// A batch item whose exec failed (timeout, crash, ...).
#[derive(Serialize, ToSchema)]
pub struct BatchItemError {
    /// The HTTP status this error would have had alone.
    pub status: u16,
    pub error: crate::error::ErrorDetail,
}

#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum BatchItem {
    Ok(Box<ExecResponse>),
    Failed(BatchItemError),
}

#[derive(Serialize, ToSchema)]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
    pub total_time_ms: f64,
}

#[derive(Serialize, ToSchema)]
pub struct ForkedFrom {
    pub session: String,
    pub checkpoint: i64,
}

#[derive(Serialize, ToSchema)]
pub struct SessionLimits {
    pub memory_mb: u64,
    pub timeout_seconds: f64,
    /// The effective network policy: `mode` (none, public or allowlist) and
    /// the layers (server, then session) that must all allow a destination.
    #[schema(value_type = Object)]
    pub network: serde_json::Value,
}

#[derive(Serialize, ToSchema)]
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
}

#[derive(Serialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<Session>,
}

#[derive(Serialize, ToSchema)]
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

#[derive(Serialize, ToSchema)]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub template: String,
    pub exec_slots: usize,
    pub exec_slots_free: usize,
    pub queued: usize,
    pub resident_sessions: usize,
}
