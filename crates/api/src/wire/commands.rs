//! Commands: a shell line or an argv, one-shot or in a session, and their results.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::exec::OutputFileBody;
use super::network::NetworkSetting;
use super::processes::ProcessInfo;

/// What a command runs: a string is a shell command line (`/bin/sh -c`), a list
/// of strings is the argv itself (no shell; the program is looked up on `PATH`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged, try_from = "serde_json::Value")]
pub enum CommandLineBody {
    Shell(String),
    Argv(Vec<String>),
}

impl TryFrom<serde_json::Value> for CommandLineBody {
    type Error = String;
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        const WHAT: &str = "expected a string (a shell command line) or a list of strings (an argv)";
        match v {
            serde_json::Value::String(s) => Ok(CommandLineBody::Shell(s)),
            serde_json::Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, a)| match a {
                    serde_json::Value::String(s) => Ok(s),
                    other => Err(format!("item {i} is {}, {WHAT}", json_kind(&other))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(CommandLineBody::Argv),
            other => Err(format!("invalid type: {}, {WHAT}", json_kind(&other))),
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A command in a session (`POST /v1/sessions/{id}/commands`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionCommand {
    pub cmd: CommandLineBody,
    /// Directory it starts in (default: the session's working directory); relative to that.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Time limit (default: the session's; at most the session's `limits.timeout_seconds`).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Start it and answer at once (201 `BackgroundStarted`): it runs on between
    /// calls as a background process of the session (`/processes/{pid}`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
    /// A background command's stdin is written through
    /// `POST /v1/sessions/{id}/processes/{pid}/stdin` (default: `/dev/null`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin: bool,
    /// Run a background command on a new pseudo-terminal of this size: its
    /// stdin, stdout and stderr are the terminal (output: what the terminal
    /// shows, `\r\n` line ends and echo included; stdin: what is typed, `\x03`
    /// interrupts); resize with `POST .../processes/{pid}/resize`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// A terminal's size in character cells (1 to 10000 each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// A background command started (`"background": true`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackgroundStarted {
    pub pid: u32,
    pub process: ProcessInfo,
    /// The seq of the checkpoint that recorded the start (it does not record the process).
    pub checkpoint: i64,
    /// What the session wrote while starting it (the command's own output is the process').
    pub stdout: String,
    pub stderr: String,
}

/// A one-shot command in a fresh fork of a template (`POST /v1/commands`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct OneShotCommand {
    pub cmd: CommandLineBody,
    /// Directory it starts in (default: the template's working directory, `/`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Time limit (default: the server's; at most its maximum).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (default: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of the command (narrows the server's policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSetting>,
}

/// The result of a command. The exec it rode on made the checkpoint (sessions).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandResponse {
    pub stdout: String,
    pub stderr: String,
    /// The command's exit status: 0 success; 128 + N killed by signal N; 127 not
    /// found; 126 could not be started; 130 interrupted; 1 also for a `cwd` that
    /// cannot be entered (each of the last four with a `forkbox:` line on stderr).
    pub exit_code: i32,
    /// Time inside the guest.
    pub runtime_ms: f64,
    /// Wall time on the host.
    pub wall_ms: f64,
    /// Session commands: the seq of the checkpoint that recorded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<i64>,
    /// One-shot commands: an id for this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Time in the server, request received to response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_time_ms: Option<f64>,
    /// Files under `/output` it created or changed (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFileBody>,
}
