//! The request and response bodies of the `/v1` API. The handlers take and
//! return these types and the OpenAPI document is derived from them, so the
//! two cannot drift apart.

use std::collections::BTreeMap;

use base64::Engine as _;
use forkbox_runtime::{CheckpointView, ExecOutcome, ExecResult, OneShot, SessionView};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A sandbox's outbound network. `"none"`: no network; `"public"`: the
/// public internet, every non-public address (loopback, private, link-local
/// and the metadata endpoints, CGNAT, multicast, the host's own addresses)
/// refused; `{"allow": [...], "deny": [...]}`: only what `allow` names (rules:
/// `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`, `example.com`, `*.example.com:443`,
/// `*:25`); `{"mode": "none" | "public", "max_bytes_per_second": N}`: a mode
/// with a bandwidth limit (`max_bytes_per_second` also goes with `allow`): bytes
/// per second through the sandbox's host sockets, both directions together.
/// It only narrows the server's policy (the default: the server's,
/// `public` unless `forkbox serve --egress` says otherwise); a host-name rule
/// never opens a non-public address; the smallest bandwidth of all layers holds.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
#[serde(untagged, deny_unknown_fields)]
pub enum NetworkSetting {
    Mode(NetworkMode),
    Rules {
        allow: Vec<String>,
        #[serde(default)]
        deny: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes_per_second: Option<u64>,
    },
    Limited {
        mode: NetworkMode,
        max_bytes_per_second: u64,
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
    pub fn policy(&self) -> Result<forkbox_runtime::NetPolicy, String> {
        use forkbox_runtime::{NetPolicy as Policy, NetRule as Rule};
        let parse = |v: &[String]| -> Result<Vec<Rule>, String> {
            if v.len() > 256 {
                return Err("at most 256 network rules".into());
            }
            v.iter().map(|r| r.parse::<Rule>().map_err(|e| e.to_string())).collect()
        };
        let rate = |r: Option<u64>| match r {
            Some(0) => Err("max_bytes_per_second must be at least 1".to_string()),
            r => Ok(r),
        };
        let mode = |m: NetworkMode| match m {
            NetworkMode::None => Policy::none(),
            NetworkMode::Public => Policy::public(),
        };
        Ok(match self {
            NetworkSetting::Mode(m) => mode(*m),
            NetworkSetting::Rules { allow, deny, max_bytes_per_second } => Policy {
                deny: parse(deny)?,
                ..Policy::allowlist(parse(allow)?).with_rate(rate(*max_bytes_per_second)?)
            },
            NetworkSetting::Limited { mode: m, max_bytes_per_second } => {
                mode(*m).with_rate(rate(Some(*max_bytes_per_second))?)
            }
        })
    }
}

/// A request's `network` as a policy layer (a bad rule is 400 `invalid_request`).
pub fn network_policy(
    n: &Option<NetworkSetting>,
) -> Result<Option<forkbox_runtime::NetPolicy>, crate::error::ApiError> {
    n.as_ref().map(|n| n.policy().map_err(|e| crate::error::ApiError::invalid(format!("network: {e}")))).transpose()
}

/// The policy layers a caller's sandbox gets inside the server's: its key's
/// (`forkbox key create --egress`), then the request's `network`. Each only narrows.
pub fn network_layers(
    caller: &crate::auth::Caller,
    n: &Option<NetworkSetting>,
) -> Result<Vec<forkbox_runtime::NetPolicy>, crate::error::ApiError> {
    let mut layers: Vec<_> = caller.limits().and_then(|l| l.egress.clone()).into_iter().collect();
    layers.extend(network_policy(n)?);
    Ok(layers)
}

/// The effective network policy as shown to clients.
pub fn network_view(net: &forkbox_runtime::NetConfig) -> serde_json::Value {
    serde_json::json!({ "mode": net.mode(), "max_bytes_per_second": net.max_bytes_per_second(), "layers": net.layers })
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Python source; the repr of a final expression is the result's `value`.
    pub code: String,
    /// Time limit of this exec (default: the server's; at most its maximum).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (see `GET /v1/templates`; default: the server's default).
    pub template: Option<String>,
    /// Outbound network of this exec (narrows the server's policy).
    pub network: Option<NetworkSetting>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to 64 codes, each run in its own fork.
    #[schema(min_items = 1, max_items = 64)]
    pub codes: Vec<String>,
    pub timeout_seconds: Option<f64>,
    /// Template to fork (see `GET /v1/templates`; default: the server's default).
    pub template: Option<String>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// 64 up to the server's maximum.
    #[schema(minimum = 64)]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session.
    pub timeout_seconds: Option<f64>,
    /// Template the session starts from and stays on (default: the server's default).
    pub template: Option<String>,
    /// Outbound network of the session (narrows the server's policy; kept across eviction and forks).
    pub network: Option<NetworkSetting>,
    /// Secrets by environment variable name (at most 16): the sandbox's
    /// variable holds an opaque placeholder, replaced by the value in the
    /// header values of HTTP requests to the secret's hosts (see docs/network.md).
    /// Never returned, logged or written in the clear (kept across eviction and forks).
    #[serde(default)]
    pub secrets: BTreeMap<String, SecretSpec>,
}

/// A secret of a new session.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The real value (1 to 8192 bytes, no CR, LF or NUL). Read as any JSON
    /// value and checked in [`seal_secrets`], so that an error never quotes it.
    #[schema(value_type = String)]
    pub value: serde_json::Value,
    /// Host names it is sent to (`api.example.com`, `*.example.org`): a
    /// connection to an address the sandbox's resolver handed out for one of them.
    pub hosts: Vec<String>,
    /// Ports it is sent to (default: any).
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Also in HTTPS to these hosts (default false): the server terminates
    /// the sandbox's TLS to them with a leaf of its egress CA, which the
    /// session's sandboxes trust (see docs/network.md).
    #[serde(default)]
    pub tls: bool,
}

/// A secret as it is shown: its name and destinations, never its value.
#[derive(Serialize, ToSchema)]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
}

impl From<forkbox_runtime::net_secrets::SecretInfo> for SecretInfo {
    fn from(s: forkbox_runtime::net_secrets::SecretInfo) -> SecretInfo {
        SecretInfo { name: s.name, hosts: s.hosts, ports: s.ports, tls: s.tls }
    }
}

impl SecretInfo {
    /// What is shown of each of `secrets`.
    pub fn list(secrets: &[forkbox_runtime::net_secrets::SealedSecret]) -> Vec<SecretInfo> {
        secrets.iter().map(|s| SecretInfo::from(s.info())).collect()
    }
}

/// A request's secrets, validated and sealed with the server's key (a bad
/// one is 400 `invalid_request`).
pub fn seal_secrets(
    secrets: &BTreeMap<String, SecretSpec>,
) -> Result<Vec<forkbox_runtime::net_secrets::SealedSecret>, crate::error::ApiError> {
    use crate::error::ApiError;
    use forkbox_runtime::net_secrets::{self, SecretError};
    if secrets.len() > net_secrets::SECRETS_MAX {
        return Err(ApiError::invalid(format!(
            "secrets: at most {} (per session, template or key)",
            net_secrets::SECRETS_MAX
        )));
    }
    secrets
        .iter()
        .map(|(name, s)| {
            let Some(value) = s.value.as_str() else {
                return Err(ApiError::invalid(format!("secrets: {name}: the value must be a string")));
            };
            net_secrets::seal_new(name, value, &s.hosts, &s.ports, s.tls).map_err(|e| match e {
                SecretError::Invalid(_) => ApiError::invalid(e.to_string()),
                _ => ApiError::internal(e.to_string()),
            })
        })
        .collect()
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionExec {
    pub code: String,
    /// Time limit of this exec (default: the session's; at most the session's `limits.timeout_seconds`).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
}

/// What a command runs: a string is a shell command line (`/bin/sh -c`), a list
/// of strings is the argv itself (no shell; the program is looked up on `PATH`).
#[derive(Clone, Debug, Deserialize, ToSchema)]
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
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionCommand {
    pub cmd: CommandLineBody,
    /// Directory it starts in (default: the session's working directory); relative to that.
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit (default: the session's; at most the session's `limits.timeout_seconds`).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
    /// Start it and answer at once (201 `BackgroundStarted`): it runs on between
    /// calls as a background process of the session (`/processes/{pid}`).
    #[serde(default)]
    pub background: bool,
    /// A background command's stdin is written through
    /// `POST /v1/sessions/{id}/processes/{pid}/stdin` (default: `/dev/null`).
    #[serde(default)]
    pub stdin: bool,
    /// Run a background command on a new pseudo-terminal of this size: its
    /// stdin, stdout and stderr are the terminal (output: what the terminal
    /// shows, `\r\n` line ends and echo included; stdin: what is typed, `\x03`
    /// interrupts); resize with `POST .../processes/{pid}/resize`.
    pub pty: Option<PtySize>,
}

/// A terminal's size in character cells (1 to 10000 each).
#[derive(Clone, Copy, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

impl PtySize {
    /// The size if both are in 1..=10000.
    pub fn checked(self) -> Result<(u16, u16), crate::error::ApiError> {
        if !(1..=10_000).contains(&self.rows) || !(1..=10_000).contains(&self.cols) {
            return Err(crate::error::ApiError::invalid(format!(
                "pty size {}x{} is out of range (rows and cols 1 to 10000)",
                self.rows, self.cols
            )));
        }
        Ok((self.rows, self.cols))
    }
}

/// A background command started (`"background": true`).
#[derive(Serialize, ToSchema)]
pub struct BackgroundStarted {
    pub pid: u32,
    pub process: crate::handlers::processes::ProcessInfo,
    /// The seq of the checkpoint that recorded the start (it does not record the process).
    pub checkpoint: i64,
    /// What the session wrote while starting it (the command's own output is the process').
    pub stdout: String,
    pub stderr: String,
}

/// A one-shot command in a fresh fork of a template (`POST /v1/commands`).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OneShotCommand {
    pub cmd: CommandLineBody,
    /// Directory it starts in (default: the template's working directory, `/`).
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit (default: the server's; at most its maximum).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (default: the server's default).
    pub template: Option<String>,
    /// Outbound network of the command (narrows the server's policy).
    pub network: Option<NetworkSetting>,
}

/// A command's request as the runtime's validated [`forkbox_runtime::Command`] (400 if bad).
pub fn command_of(
    cmd: CommandLineBody,
    cwd: Option<String>,
    env: BTreeMap<String, String>,
) -> Result<forkbox_runtime::Command, crate::error::ApiError> {
    let line = match cmd {
        CommandLineBody::Shell(s) => forkbox_runtime::CommandLine::Shell(s),
        CommandLineBody::Argv(v) => forkbox_runtime::CommandLine::Argv(v),
    };
    Ok(forkbox_runtime::Command::new(line, cwd, env)?)
}

/// The result of a command. The exec it rode on made the checkpoint (sessions).
#[derive(Serialize, ToSchema)]
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
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFileBody>,
}

impl CommandResponse {
    pub fn of(r: &ExecResult) -> CommandResponse {
        let c = forkbox_runtime::CommandResult::of(r);
        CommandResponse {
            stdout: c.stdout,
            stderr: c.stderr,
            exit_code: c.exit_code,
            runtime_ms: r.runtime_ms,
            wall_ms: r.wall_ms,
            checkpoint: None,
            id: None,
            total_time_ms: None,
            outputs: ExecResponse::of(r).outputs,
        }
    }

    pub fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> CommandResponse {
        let mut v = CommandResponse::of(&o.result);
        v.checkpoint = Some(o.checkpoint.seq);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

    pub fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> CommandResponse {
        let mut v = CommandResponse::of(&o.result);
        v.id = Some(o.id.clone());
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }
}

/// What `PATCH /v1/sessions/{id}` changes; absent fields stay as they are.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchSession {
    /// The session's new tags (they replace the old ones as a whole; `{}` removes them all).
    pub tags: Option<BTreeMap<String, String>>,
    /// 64 up to the server's maximum; applies from the next exec.
    #[schema(minimum = 64)]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session (at most the server's maximum, and the key's).
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
}

/// `GET /`: where the API is described.
#[derive(Serialize, ToSchema)]
pub struct RootInfo {
    pub name: String,
    pub version: String,
    /// The OpenAPI document of every route.
    pub openapi: String,
    pub health: String,
    /// The routes table of docs/api.md.
    pub docs: String,
    /// Where the web console is: this path, opened in a browser.
    pub console: String,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevertRequest {
    /// Seq of the checkpoint to move the session's head back to.
    pub checkpoint: i64,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
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
    /// The value's rich forms beside `value` (its text/plain): MIME type -> data, e.g.
    /// `text/html` for a pandas DataFrame, `image/png` (base64) for a PIL image (omitted when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub value_data: Option<forkbox_runtime::MimeBundle>,
    /// What `display(obj)` showed and the matplotlib figures left open at the end (or
    /// `plt.show()`n), in order, as MIME bundles (`image/png` base64, `text/html`, `text/plain`, ...;
    /// omitted when none). 4 MiB an item, 8 MiB in all.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub display: Vec<forkbox_runtime::MimeBundle>,
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
    /// A one-shot exec's response, with its id and timing (`t0`: when the request came in).
    pub fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> ExecResponse {
        let mut v = ExecResponse::of(&o.result);
        v.id = Some(o.id.clone());
        v.fork_time_ms = Some(o.fork_ms);
        v.exec_time_ms = Some(o.exec_ms);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

    /// A session exec's response, naming its checkpoint.
    pub fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> ExecResponse {
        let mut v = ExecResponse::of(&o.result);
        v.checkpoint = Some(o.checkpoint.seq);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

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
            value_data: r.value_data.clone(),
            display: r.display.clone(),
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
    /// The template it is on (its name here; null if no name has that template now).
    pub template: Option<String>,
    /// The id of that template (what the session is pinned to).
    pub template_id: String,
    /// The last non-blank line of its head checkpoint's code (at most 120 characters; null: no checkpoint).
    pub last_code: Option<String>,
    /// Its secrets: names and destinations only (absent: none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretInfo>,
}

impl Session {
    pub fn of(v: &SessionView) -> Session {
        let network = v.network();
        Session {
            id: v.record.id.clone(),
            tags: v.record.tags.clone(),
            created_ms: v.record.created_ms,
            last_used_ms: v.record.last_used_ms,
            resident: v.resident,
            checkpoint: v.checkpoint,
            forked_from: v
                .forked_from
                .as_ref()
                .map(|f| ForkedFrom { session: f.session.clone(), checkpoint: f.checkpoint }),
            limits: SessionLimits {
                memory_mb: v.memory_mb(),
                timeout_seconds: v.timeout_seconds(),
                network: network_view(&network),
            },
            template: v.template.clone(),
            template_id: v.record.template_id.clone(),
            last_code: v.last_code.clone(),
            secrets: network
                .secrets
                .iter()
                .map(|s| SecretInfo {
                    name: s.name.clone(),
                    hosts: s.hosts.clone(),
                    ports: s.ports.clone(),
                    tls: s.tls,
                })
                .collect(),
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<Session>,
}

/// `POST /v1/sessions/{id}/packages`: packages to install into the session.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallPackages {
    /// pip requirement specs: a name with optional extras and version
    /// constraints (`fbxdemo==1.0`, `requests[socks]>=2`); no options, paths or URLs.
    /// Binary wheels only, from the server's package index or wheelhouse.
    pub packages: Vec<String>,
}

/// One distribution of an install (the requested ones and their dependencies).
#[derive(Serialize, ToSchema)]
pub struct InstalledPackage {
    pub name: String,
    pub version: String,
    /// The wheel's file name.
    pub wheel: String,
    /// The wheel's sha256: the id of the shared, read-only layer the session mounts.
    pub sha256: String,
    /// False: the session had it already (same version).
    pub installed: bool,
    /// Files the package added to the session's file system.
    pub files: u64,
}

#[derive(Serialize, ToSchema)]
pub struct InstalledPackages {
    pub packages: Vec<InstalledPackage>,
    /// What pip would have printed.
    pub output: String,
    /// Seq of the checkpoint that records the install (null: nothing was new).
    pub checkpoint: Option<i64>,
}

impl InstalledPackages {
    pub fn of(o: &forkbox_runtime::PackagesOutcome) -> InstalledPackages {
        InstalledPackages {
            packages: o
                .packages
                .iter()
                .map(|p| InstalledPackage {
                    name: p.name.clone(),
                    version: p.version.clone(),
                    wheel: p.wheel.clone(),
                    sha256: p.sha256.clone(),
                    installed: p.installed,
                    files: p.files,
                })
                .collect(),
            output: o.output.clone(),
            checkpoint: o.checkpoint.as_ref().map(|c| c.seq),
        }
    }
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

impl Checkpoint {
    pub fn of(c: &CheckpointView) -> Checkpoint {
        Checkpoint {
            seq: c.seq,
            parent: c.parent,
            code: c.code.clone(),
            created_ms: c.created_ms,
            bytes: c.bytes,
            pages: c.pages,
            head: c.head,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    /// The default template's id.
    pub template: String,
    /// The default template's name.
    pub default_template: String,
    /// Server capacity (no tenant, session or key is named or counted here).
    pub exec_slots: usize,
    pub exec_slots_free: usize,
    pub queued: usize,
    /// In a cluster: this node's id (null otherwise).
    pub node: Option<String>,
}

/// `GET /readyz`: whether this server takes requests (a cluster node that
/// drains does not: `draining`, 503).
#[derive(Serialize, ToSchema)]
pub struct Ready {
    /// `ready` or `draining`.
    pub status: String,
}

/// The nodes of a cluster (`GET /v1/admin/nodes`, admin keys only).
#[derive(Serialize, ToSchema)]
pub struct NodeList {
    /// The node that answered (null: this server is not a cluster node, and the list is empty).
    pub node: Option<String>,
    pub nodes: Vec<NodeBody>,
}

/// One node of a cluster.
#[derive(Serialize, ToSchema)]
pub struct NodeBody {
    pub id: String,
    /// Where the other nodes reach its API.
    pub url: String,
    /// `active` or `draining` (gives its sessions back, takes no new ones).
    pub state: String,
    /// Its last heartbeat is younger than the lease time.
    pub alive: bool,
    /// Milliseconds since its last heartbeat (the database's clock).
    pub heartbeat_age_ms: i64,
    pub started_unix_ms: i64,
    /// Sessions resident on it now.
    pub sessions: u64,
}

/// The sandbox worker processes (`GET /v1/admin/workers`, admin keys only).
#[derive(Serialize, ToSchema)]
pub struct WorkerList {
    /// `process` (execs and sessions in jailed workers) or `thread` (no workers).
    pub isolation: String,
    pub workers: Vec<WorkerBody>,
}

/// One sandbox worker process.
#[derive(Serialize, ToSchema)]
pub struct WorkerBody {
    pub index: usize,
    /// `exec` (one-shot execs: one per exec slot) or `sessions` (one tenant's sessions and tree of states).
    pub kind: String,
    /// A session worker's tenant (absent: the exec workers, and the spare session worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// A session worker's sandboxes now (resident sessions and throwaway forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<usize>,
    /// Host pid of the jailed worker (null while it is being restarted).
    pub pid: Option<u32>,
    /// The unprivileged host uid it runs as.
    pub uid: u32,
    /// Running an exec now.
    pub busy: bool,
    /// Workers of this slot (or this tenant) that died (or hung) and were replaced.
    pub restarts: u64,
    pub started_unix_ms: Option<u64>,
    /// How the previous worker of this slot (or this tenant) ended.
    pub last_exit: Option<String>,
}

/// A template execs and sessions can fork from.
#[derive(Serialize, ToSchema)]
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
    #[schema(value_type = Option<Object>)]
    pub network: Option<serde_json::Value>,
    /// Its secrets (names and destinations only), which every sandbox forked
    /// from it gets (over the key's, under a session's of the same name); absent: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretInfo>,
}

/// `POST /v1/templates`: a template of the caller's own.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplateRequest {
    /// 1 to 63 of `a-z 0-9 . _ -`; not a shipped or shared template's name.
    pub name: String,
    /// Debian packages beyond the base image (Python 3.11, numpy, the userland).
    #[serde(default)]
    pub apt: Vec<String>,
    /// pip requirement specs (`pandas>=2`), installed as binary wheels for CPython 3.11 /
    /// manylinux x86-64; one with only an sdist fails the build.
    #[serde(default)]
    pub pip: Vec<String>,
    /// Code run before the snapshot (default `import numpy`).
    pub preload: Option<String>,
    /// `reference` (default), `openblas` or `any`.
    pub blas: Option<String>,
    /// The template's egress policy (as `network` of a session): one-shot execs and
    /// sessions on it get it inside the server's and the key's, so it only narrows.
    pub network: Option<NetworkSetting>,
    /// Secrets (as `secrets` of a session, at most 16) every one-shot exec and
    /// session on it gets: over the key's, under a session's of the same name.
    #[serde(default)]
    pub secrets: BTreeMap<String, SecretSpec>,
}

/// `POST /v1/sessions/{id}/checkpoints/{n}/template`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointTemplateRequest {
    pub name: String,
}

#[derive(Serialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<TemplateBody>,
    /// The default template's name.
    pub default: String,
}

impl TemplateBody {
    pub fn of(t: forkbox_runtime::TemplateListing) -> TemplateBody {
        TemplateBody {
            name: t.name,
            description: t.description,
            status: t.status,
            id: t.id,
            default: t.default,
            packages: t.packages,
            preload: t.preload,
            image_bytes: t.image_bytes,
            error: t.error,
            source: t.source,
            pip: t.pip,
            progress: t.progress,
            fraction: t.fraction,
            elapsed_seconds: t.elapsed_seconds,
            from_session: t.from_session,
            from_checkpoint: t.from_checkpoint,
            network: t.network.as_ref().and_then(|p| serde_json::to_value(p).ok()),
            secrets: t.secrets.into_iter().map(SecretInfo::from).collect(),
        }
    }
}
