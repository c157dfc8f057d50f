//! A session's background processes and listening ports.

use serde::{Deserialize, Serialize};

/// A background process of a session (with the processes it started).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub pid: u32,
    /// Its argv after its last execve.
    pub argv: Vec<String>,
    /// When it started (ms since the Unix epoch).
    pub started_unix_ms: i64,
    /// vCPU seconds its processes used.
    pub cpu_seconds: f64,
    /// `running` or `exited`.
    pub state: String,
    /// How it ended: its exit status ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// ... or the signal that killed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Bytes it wrote so far to stdout and stderr (the session keeps the last 256 KiB of each).
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// A listening TCP socket inside the sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListeningPortInfo {
    pub port: u16,
    /// The address it is bound to inside the sandbox, e.g. `0.0.0.0`, `127.0.0.1` or `::`.
    pub address: String,
    /// `/v1/sessions/{id}/ports/{port}/` reaches it (it takes connections to 127.0.0.1 or ::1).
    pub proxied: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListeningPorts {
    /// By port.
    pub ports: Vec<ListeningPortInfo>,
    /// False: the session is paused or on disk, so nothing listens now; its
    /// listeners come back with it when a request (e.g. one to a port) resumes it.
    pub resident: bool,
}

/// A slice of a background process' stdout or stderr.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessOutput {
    /// The byte offset in the stream of `data`'s start: past the one asked for
    /// when those bytes were dropped (only the last 256 KiB are kept).
    pub offset: u64,
    /// Where to read next (`offset` + the bytes of `data`).
    pub next_offset: u64,
    /// The stream's length so far.
    pub end: u64,
    /// Bytes between the offset asked for and `offset` that were dropped.
    pub dropped: u64,
    /// The bytes, as UTF-8 (invalid sequences replaced).
    pub data: String,
    /// It still runs: more may come.
    pub running: bool,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// Signal number (1-64), e.g. 15 (SIGTERM) or 9 (SIGKILL); sent to each of its processes.
    pub signal: i32,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    /// How long to wait at most (default 10, at most 60): the process as it is then.
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
}

/// Input for a background process' stdin.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// Text to write (UTF-8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// Bytes to write, base64 (instead of `data`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_b64: Option<String>,
    /// Close its stdin after the write (end of file for its reader).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eof: bool,
}
