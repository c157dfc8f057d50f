//! The API's JSON shapes, as typed structs. Every struct keeps the fields it
//! does not name in `extra`, so nothing the server sends is lost.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A Python exception raised by the code (not a sandbox failure).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PyError {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    #[serde(default)]
    pub traceback: String,
}

/// A file the code wrote under `/output` during the exec.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct OutputFile {
    pub path: String,
    pub size: u64,
    pub mime: String,
    /// The content, base64; absent when the file was over the inline limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
}

/// The result of an exec (one-shot or in a session).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExecResult {
    /// `repr()` of the last expression, if the code ended with one that is not None.
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    /// The exception the code raised, if it did (then `exit_code` is 1).
    #[serde(default)]
    pub error: Option<PyError>,
    #[serde(default)]
    pub runtime_ms: f64,
    #[serde(default)]
    pub exit_code: i64,
    /// Session execs: the checkpoint this exec created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFile>,
    /// The value's rich forms beside `value` (text/plain): `text/html` for a DataFrame, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_data: Option<MimeBundle>,
    /// What `display()` showed and the figures left open, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub display: Vec<MimeBundle>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One displayed object: MIME type -> data (text as strings, images as base64 strings,
/// `application/json` as JSON), Jupyter's mime bundle.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct MimeBundle(pub BTreeMap<String, Value>);

impl MimeBundle {
    /// A text form (`text/plain`, `text/html`, `text/markdown`, `text/latex`, `image/svg+xml`).
    pub fn text(&self, mime: &str) -> Option<&str> {
        self.0.get(mime).and_then(Value::as_str)
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

    pub fn json(&self) -> Option<&Value> {
        self.0.get("application/json")
    }
}

/// A template (`GET /v1/templates`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TemplateInfo {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// `ready`, `available` (built on first use), `building`, `failed`.
    pub status: String,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub default: bool,
    #[serde(default)]
    pub packages: Vec<String>,
    #[serde(default)]
    pub image_bytes: Option<u64>,
    #[serde(default)]
    pub error: Option<String>,
    /// `shipped`, `custom` or `checkpoint`.
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub pip: Vec<String>,
    #[serde(default)]
    pub preload: String,
    /// While building: the step (`queued`, `image: <what it does>`, `template`).
    #[serde(default)]
    pub progress: Option<String>,
    /// While building: the fraction of the step done (0 to 1), where known.
    #[serde(default)]
    pub fraction: Option<f64>,
    #[serde(default)]
    pub elapsed_seconds: Option<u64>,
    /// Its own egress policy layer (`mode`, `allow`, `deny`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/templates`: a template of the caller's own, built in the background.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CreateTemplate {
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apt: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pip: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preload: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blas: Option<String>,
    /// The template's egress policy: a layer of every sandbox forked from it (only narrows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Secrets every sandbox forked from it gets, by variable name: `{"value", "hosts", "ports"?, "tls"?}`.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub secrets: Map<String, Value>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TemplateList {
    pub templates: Vec<TemplateInfo>,
    pub default: String,
}

/// Where a forked session came from (until its first exec).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ForkedFrom {
    pub session: String,
    pub checkpoint: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SessionLimits {
    pub memory_mb: u64,
    pub timeout_seconds: f64,
    /// The effective network policy: `mode` (`none`, `public` or `allowlist`) and
    /// every layer (server, key, template, session) that must allow a destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Value>,
}

impl SessionLimits {
    /// The effective network mode (`none`, `public`, `allowlist`), if the server said.
    pub fn network_mode(&self) -> Option<&str> {
        self.network.as_ref()?.get("mode")?.as_str()
    }
}

/// A sandbox's outbound network as a request asks for it (`"network"` of exec,
/// command, session and template requests). It only narrows what the server and
/// the key allow: `None` no network; `Public` the public internet (every
/// non-public address refused); `Rules` only what `allow` names, minus `deny`
/// (rules: `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`, `example.com`,
/// `*.example.com:443`, `*:25`; the server checks them); `Limited` a mode
/// with a bandwidth limit (bytes per second through the sandbox's host
/// sockets, both directions; `Rules` may carry one too).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Network {
    Mode(NetworkMode),
    Rules {
        allow: Vec<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        deny: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes_per_second: Option<u64>,
    },
    Limited {
        mode: NetworkMode,
        max_bytes_per_second: u64,
    },
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    None,
    Public,
}

impl Network {
    pub const NONE: Network = Network::Mode(NetworkMode::None);
    pub const PUBLIC: Network = Network::Mode(NetworkMode::Public);

    /// Only what `allow` names (minus `deny`).
    pub fn allowlist(allow: impl IntoIterator<Item = impl Into<String>>) -> Network {
        Network::Rules {
            allow: allow.into_iter().map(Into::into).collect(),
            deny: Vec::new(),
            max_bytes_per_second: None,
        }
    }

    /// This setting with a bandwidth limit (bytes per second); None: without one.
    pub fn with_rate(self, bytes_per_second: Option<u64>) -> Network {
        match (self, bytes_per_second) {
            (Network::Mode(mode) | Network::Limited { mode, .. }, Some(r)) => {
                Network::Limited { mode, max_bytes_per_second: r }
            }
            (Network::Mode(mode) | Network::Limited { mode, .. }, None) => Network::Mode(mode),
            (Network::Rules { allow, deny, .. }, r) => Network::Rules { allow, deny, max_bytes_per_second: r },
        }
    }

    /// A setting from command-line style parts: `mode` `none`, `public` or
    /// `allowlist`, and rules (which need `allowlist`; rules without a mode
    /// mean `allowlist`). None when nothing is given. Add a bandwidth with
    /// [`Network::with_rate`].
    pub fn from_parts(mode: Option<&str>, allow: &[String], deny: &[String]) -> Result<Option<Network>, String> {
        let rules = !allow.is_empty() || !deny.is_empty();
        match mode {
            None if !rules => Ok(None),
            None | Some("allowlist") => {
                Ok(Some(Network::Rules { allow: allow.to_vec(), deny: deny.to_vec(), max_bytes_per_second: None }))
            }
            Some(m @ ("none" | "public")) if rules => {
                Err(format!("network {m} takes no allow/deny rules (rules mean an allowlist)"))
            }
            Some("none") => Ok(Some(Network::NONE)),
            Some("public") => Ok(Some(Network::PUBLIC)),
            Some(other) => Err(format!("unknown network mode {other:?} (none, public, allowlist)")),
        }
    }
}

/// A session: a Python REPL whose state persists; every exec is a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Session {
    pub id: String,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    #[serde(default)]
    pub created_ms: i64,
    #[serde(default)]
    pub last_used_ms: i64,
    #[serde(default)]
    pub resident: bool,
    /// The head checkpoint's number; None before the first exec.
    #[serde(default)]
    pub checkpoint: Option<i64>,
    #[serde(default)]
    pub forked_from: Option<ForkedFrom>,
    pub limits: SessionLimits,
    /// Its template's name (None if no name has it now).
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub template_id: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One checkpoint of a session's history (a tree: `parent` is the seq it was made from).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Checkpoint {
    pub seq: i64,
    #[serde(default)]
    pub parent: Option<i64>,
    /// The code of the exec that made it.
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub created_ms: i64,
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub pages: u64,
    /// Whether the session is at this checkpoint now.
    #[serde(default)]
    pub head: bool,
}

/// A file or directory in a session's file system.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub name: String,
    pub path: String,
    pub size: u64,
    pub is_dir: bool,
    #[serde(default)]
    pub mtime_ms: i64,
}

/// What a file upload returns.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileWritten {
    pub path: String,
    pub size: u64,
    /// The checkpoint the upload made.
    pub checkpoint: Option<i64>,
}

/// One distribution of a package install (`POST /v1/sessions/{id}/packages`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct InstalledPackage {
    pub name: String,
    pub version: String,
    pub wheel: String,
    /// The wheel's sha256 (the id of the shared layer the session mounts).
    pub sha256: String,
    /// False: the session had it already.
    pub installed: bool,
    #[serde(default)]
    pub files: u64,
}

/// What a package install returns.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Packages {
    pub packages: Vec<InstalledPackage>,
    /// pip-like output.
    pub output: String,
    /// The checkpoint that records the install (None: nothing was new).
    pub checkpoint: Option<i64>,
}

/// Options of a new session (all optional: the server's defaults apply).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CreateSession {
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tags: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to start from (the server's default if None).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of the session (narrows the server's and the key's; kept across eviction and forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

/// Options of a one-shot exec (all optional: the server's defaults apply).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExecOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (the server's default if None).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of this exec (narrows the server's and the key's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

/// The result of a batch: one entry per code, in order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BatchResult {
    pub results: Vec<BatchItem>,
    #[serde(default)]
    pub total_time_ms: f64,
}

/// A batch entry: a result, or the error of that code's exec.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum BatchItem {
    Failed { status: u16, error: ApiErrorBody },
    Ok(Box<ExecResult>),
}

/// `{code, message}` of an API error (with `stdout`/`stderr` for an exec that failed after it ran).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ApiErrorBody {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
}

impl ApiErrorBody {
    /// What the failed exec wrote, if the error carries it.
    pub fn output(&self) -> Option<ExecOutput> {
        (self.stdout.is_some() || self.stderr.is_some()).then(|| ExecOutput {
            stdout: self.stdout.clone().unwrap_or_default(),
            stderr: self.stderr.clone().unwrap_or_default(),
        })
    }
}

/// What an exec wrote to stdout/stderr before it failed (timeout, crash, exit, kill).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: String,
    pub stderr: String,
}

/// What `PATCH /v1/sessions/{id}` changes (None: unchanged).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PatchSession {
    /// The new tags, replacing the old ones as a whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Time limit of each exec in the session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
}

/// What a command runs: a shell command line (`/bin/sh -c`) or an argv (no shell).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum CommandLine {
    Shell(String),
    Argv(Vec<String>),
}

/// A command (`POST /v1/commands`, `POST /v1/sessions/{id}/commands`); None fields take the defaults.
#[derive(Clone, Debug, Serialize)]
pub struct CommandRequest {
    pub cmd: CommandLine,
    /// Directory it starts in (default: the guest's working directory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// One-shot commands only: the template to fork (None: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// One-shot commands only: outbound network (narrows the server's and the key's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

impl CommandRequest {
    pub fn new(cmd: CommandLine) -> CommandRequest {
        CommandRequest { cmd, cwd: None, env: BTreeMap::new(), timeout_seconds: None, template: None, network: None }
    }
}

/// The result of a command.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CommandResult {
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    /// 0 success; 128 + N killed by signal N; 127 not found; 126 could not start; 130 interrupted.
    pub exit_code: i64,
    #[serde(default)]
    pub runtime_ms: f64,
    /// Session commands: the checkpoint that recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFile>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The nodes of a cluster (`GET /v1/admin/nodes`, admin keys only).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeList {
    /// The node that answered (None: not a cluster node; the list is empty).
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub nodes: Vec<Node>,
}

/// One node of a cluster.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Node {
    pub id: String,
    #[serde(default)]
    pub url: String,
    /// `active` or `draining`.
    pub state: String,
    /// Its last heartbeat is younger than the lease time.
    #[serde(default)]
    pub alive: bool,
    #[serde(default)]
    pub heartbeat_age_ms: i64,
    #[serde(default)]
    pub started_unix_ms: i64,
    /// Sessions resident on it now.
    #[serde(default)]
    pub sessions: u64,
}

/// A background process of a session (`GET /v1/sessions/{id}/processes`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Its argv after its last execve.
    #[serde(default)]
    pub argv: Vec<String>,
    #[serde(default)]
    pub started_unix_ms: i64,
    #[serde(default)]
    pub cpu_seconds: f64,
    /// `running` or `exited`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(default)]
    pub stdout_bytes: u64,
    #[serde(default)]
    pub stderr_bytes: u64,
}

/// A slice of a background process' stdout or stderr.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProcessOutput {
    pub offset: u64,
    pub next_offset: u64,
    pub end: u64,
    #[serde(default)]
    pub dropped: u64,
    pub data: String,
    pub running: bool,
}
