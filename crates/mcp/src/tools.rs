//! The MCP tools (rmcp `#[tool]`s) over a [`forkbox_client::Client`].
//!
//! Every tool is one or two API calls; nothing here touches the engine, so the
//! embedded, remote and `/mcp` deployments behave the same. Over streamable
//! HTTP the API calls carry the key of the MCP request being answered.

use std::collections::BTreeMap;
use std::sync::Arc;

use forkbox_client::{Capabilities, Client, CreateSession};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorCode, Implementation, InitializeRequestParams,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{schemars, tool, tool_router, ErrorData, RoleServer, ServerHandler};
use serde::Deserialize;

use crate::render;
use crate::source::ClientSource;

/// Largest file `download_file` returns (the model reads it in its context: keep it small).
pub const DOWNLOAD_DEFAULT_BYTES: u64 = 256 << 10;
/// The most `max_bytes` may ask `download_file` for.
pub const DOWNLOAD_MAX_BYTES: u64 = 4 << 20;
/// Largest decoded content `upload_file` accepts.
pub const UPLOAD_MAX_BYTES: usize = 16 << 20;

/// The forkbox MCP server: the tools, over one API client.
#[derive(Clone)]
pub struct ForkboxMcp {
    client: ClientSource,
    /// What the caller may do when the server cannot be asked yet (a first build in the
    /// background): for the instructions.
    fallback: Option<Arc<Capabilities>>,
    /// Use the `Authorization: Bearer` key of each HTTP request (the `/mcp` mount)
    /// instead of the client's own.
    forward_key: bool,
    tool_router: ToolRouter<ForkboxMcp>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunPythonArgs {
    /// Python source to run. If the last statement is an expression, its repr() is returned as `value`.
    pub code: String,
    /// Time limit in seconds (default 30).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Template to start from (default: the server's default); the templates this server offers and their
    /// packages are listed in the tool's description.
    #[serde(default)]
    pub template: Option<String>,
    /// Outbound network: "none" (no network), "public" (the public internet; private and local
    /// addresses refused) or {"allow": [rules], "deny": [rules]} (only what allow names; rules like
    /// "example.com", "*.example.com:443", "10.0.0.0/8", "1.2.3.4:8080"). Only narrows what the
    /// server allows (default: the server's policy).
    #[serde(default)]
    pub network: Option<NetworkArg>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionArgs {
    /// Time limit of each exec in this session, in seconds (default 30).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Memory of the session's sandbox in MiB (default 2048).
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Labels to find the session by later (e.g. {"task": "plot"}).
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Template to start from (default: the server's default); the templates this server offers and their
    /// packages are listed in the tool's description.
    #[serde(default)]
    pub template: Option<String>,
    /// Outbound network of the session (kept across its execs and forks): "none" (no network), "public" (the public internet; private and local
    /// addresses refused) or {"allow": [rules], "deny": [rules]} (only what allow names; rules like
    /// "example.com", "*.example.com:443", "10.0.0.0/8", "1.2.3.4:8080"). Only narrows what the
    /// server allows (default: the server's policy).
    #[serde(default)]
    pub network: Option<NetworkArg>,
}

/// A sandbox's outbound network, as the API's `network`.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(untagged, deny_unknown_fields)]
pub enum NetworkArg {
    Mode(NetworkModeArg),
    Rules {
        allow: Vec<String>,
        #[serde(default)]
        deny: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkModeArg {
    None,
    Public,
}

impl From<NetworkArg> for forkbox_client::Network {
    fn from(n: NetworkArg) -> Self {
        match n {
            NetworkArg::Mode(NetworkModeArg::None) => forkbox_client::Network::NONE,
            NetworkArg::Mode(NetworkModeArg::Public) => forkbox_client::Network::PUBLIC,
            NetworkArg::Rules { allow, deny } => {
                forkbox_client::Network::Rules { allow, deny, max_bytes_per_second: None }
            }
        }
    }
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// The session to run in (from create_session, fork_session or list_sessions).
    pub session_id: String,
    /// Python source to run in the session's namespace. If the last statement is an expression, its repr() is `value`.
    pub code: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandArgs {
    /// A shell command line, run by /bin/sh -c (pipes, redirects, && and globs work), e.g. "ls -la /data | head".
    pub command: String,
    /// Run it in this session's file system (it sees the files exec and upload_file made there, and what it
    /// writes stays); without one it runs in a fresh sandbox and nothing persists.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Absolute directory to start in (default: the session's working directory, / in a fresh sandbox).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment variables to set for the command (on top of the sandbox's environment).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit in seconds (default: the session's, or 30).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Without session_id only (a session command runs under the session's network): outbound network, "none" (no network), "public" (the public internet; private and local
    /// addresses refused) or {"allow": [rules], "deny": [rules]} (only what allow names; rules like
    /// "example.com", "*.example.com:443", "10.0.0.0/8", "1.2.3.4:8080"). Only narrows what the
    /// server allows (default: the server's policy).
    #[serde(default)]
    pub network: Option<NetworkArg>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StartProcessArgs {
    /// The session to start it in.
    pub session_id: String,
    /// A shell command line, run by /bin/sh -c, e.g. "python3 -m http.server 8000" or "python3 train.py".
    pub command: String,
    /// Absolute directory to start in (default: the session's working directory).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment variables to set for it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProcessOutputArgs {
    /// The session's id.
    pub session_id: String,
    /// The process' pid (from start_process or list_processes).
    pub pid: u32,
    /// Byte offset in its stdout to read from (default 0; pass the last call's stdout_next_offset for what is new).
    #[serde(default)]
    pub stdout_offset: Option<u64>,
    /// Byte offset in its stderr to read from (default 0; the last call's stderr_next_offset).
    #[serde(default)]
    pub stderr_offset: Option<u64>,
    /// Wait up to this many seconds (at most 60) for the process to end before reading (default 0: read now).
    #[serde(default)]
    pub wait_seconds: Option<f64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillProcessArgs {
    /// The session's id.
    pub session_id: String,
    /// The process' pid.
    pub pid: u32,
    /// Signal number (default 15, SIGTERM; 9 is SIGKILL, 2 SIGINT).
    #[serde(default)]
    pub signal: Option<i32>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionArgs {
    /// The session's id.
    pub session_id: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallPackagesArgs {
    /// The session's id.
    pub session_id: String,
    /// pip requirement specs: names with optional version constraints, e.g. ["requests", "tabulate>=0.9"].
    pub packages: Vec<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RevertArgs {
    /// The session's id.
    pub session_id: String,
    /// The checkpoint to go back to (see list_checkpoints; exec results also name their checkpoint).
    pub checkpoint: i64,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// The session to branch from (it is not changed).
    pub session_id: String,
    /// The checkpoint to start from; default: the session's current state.
    #[serde(default)]
    pub checkpoint: Option<i64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveTemplateArgs {
    /// The session whose state to save.
    pub session_id: String,
    /// Its checkpoint to save (see list_checkpoints; exec results name their checkpoint).
    pub checkpoint: i64,
    /// The template's name: 1 to 63 of a-z, 0-9, '.', '_', '-'.
    pub name: String,
}

/// How a file's content is carried in a tool call.
#[derive(Clone, Copy, Debug, Deserialize, schemars::JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text, as it is.
    Text,
    /// Standard base64 (with padding) of the bytes.
    Base64,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadFileArgs {
    /// The session to write into.
    pub session_id: String,
    /// Absolute path in the sandbox, e.g. "/data/sales.csv" (parent directories are created; an existing file is replaced).
    pub path: String,
    /// The file's content: the text itself, or base64 of the bytes with encoding "base64".
    pub content: String,
    /// "text" (default) or "base64" (for binary files: images, spreadsheets, archives).
    #[serde(default)]
    pub encoding: Option<Encoding>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DownloadFileArgs {
    /// The session to read from.
    pub session_id: String,
    /// Absolute path of the file in the sandbox, e.g. "/output/result.csv".
    pub path: String,
    /// "text" or "base64"; default: text if the file is UTF-8, else base64.
    #[serde(default)]
    pub encoding: Option<Encoding>,
    /// Refuse files larger than this many bytes (default 262144 = 256 KiB, at most 4194304 = 4 MiB).
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The session to look in.
    pub session_id: String,
    /// Absolute path of the directory to list (default "/output").
    #[serde(default)]
    pub dir: Option<String>,
}

fn check_path(what: &str, path: &str) -> Result<(), CallToolResult> {
    if !path.starts_with('/') || path.len() > 4096 || path.contains('\0') {
        return Err(render::error(
            "invalid_arguments",
            &format!(
                "{what} must be an absolute path in the sandbox (starting with /, at most 4096 bytes), got {path:?}"
            ),
        ));
    }
    Ok(())
}

pub(crate) fn check_id(id: &str) -> Result<(), CallToolResult> {
    if id.is_empty() || id.len() > 128 {
        return Err(render::error("invalid_arguments", "session_id must be 1 to 128 characters"));
    }
    Ok(())
}

pub(crate) fn check_timeout(t: Option<f64>) -> Result<(), CallToolResult> {
    match t {
        Some(s) if !(s.is_finite() && s > 0.0) => Err(render::error(
            "invalid_arguments",
            &format!("timeout_seconds must be a positive number of seconds, got {s}"),
        )),
        _ => Ok(()),
    }
}

/// `Ok(result)` either way: a failure is a tool error the model sees, not a protocol error.
pub(crate) fn done(r: Result<CallToolResult, CallToolResult>) -> Result<CallToolResult, ErrorData> {
    Ok(r.unwrap_or_else(|e| e))
}

#[tool_router]
impl ForkboxMcp {
    /// Tools over `client` (its own transport and key).
    pub fn new(client: Client) -> ForkboxMcp {
        ForkboxMcp::with_source(ClientSource::Ready(client), None)
    }

    /// Tools over a client that may still be being prepared (see [`crate::source`]); `fallback`:
    /// what the instructions say while the server cannot be asked.
    pub fn with_source(client: ClientSource, fallback: Option<Capabilities>) -> ForkboxMcp {
        ForkboxMcp {
            client,
            fallback: fallback.map(Arc::new),
            forward_key: false,
            tool_router: Self::tool_router() + Self::tree_router(),
        }
    }

    /// Tools over `client`, each API call made with the bearer key of the HTTP
    /// request being answered (streamable HTTP behind the API's keys).
    pub fn forwarding_key(client: Client) -> ForkboxMcp {
        ForkboxMcp {
            client: ClientSource::Ready(client),
            fallback: None,
            forward_key: true,
            tool_router: Self::tool_router() + Self::tree_router(),
        }
    }

    pub(crate) async fn client(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, CallToolResult> {
        let client = self.client.wait(ctx).await.map_err(|why| render::error("template_unavailable", &why))?;
        if !self.forward_key {
            return Ok(client);
        }
        let key = ctx
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.headers.get(axum::http::header::AUTHORIZATION))
            .and_then(|v| v.to_str().ok())
            .and_then(|h| h.trim().strip_prefix("Bearer ").or_else(|| h.trim().strip_prefix("bearer ")))
            .map(str::trim);
        match key {
            Some(k) if !k.is_empty() => Ok(client.with_key(k)),
            _ => Err(render::error("unauthorized", "missing API key: send `Authorization: Bearer <key>`")),
        }
    }

    #[tool(description = "Run Python code once in a fresh, isolated sandbox and return its result. Nothing persists: \
        every call starts from a clean interpreter (use create_session + exec for state that carries over). \
        The argument template picks the interpreter and its packages (this server's templates are listed at the \
        end); outbound network as the server allows (narrow it with network); limits as the instructions say. Returns value (repr of the last expression), stdout, \
        stderr, and error {type, message, traceback} if the code raised. PNG files written under /output/ and \
        matplotlib figures left open come back as images.")]
    async fn run_python(
        &self,
        Parameters(a): Parameters<RunPythonArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_timeout(a.timeout_seconds)?;
                let c = self.client(&ctx).await?;
                let opts = forkbox_client::ExecOptions {
                    timeout_seconds: a.timeout_seconds,
                    template: a.template,
                    network: a.network.map(Into::into),
                };
                c.exec_with(&a.code, &opts).await.map(|r| render::exec_result(&r)).map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Create a session: a persistent Python 3.11 interpreter in its own sandbox, on a template \
        (listed at the end; install_packages adds more packages to the session); outbound network as the server allows, narrowed by \
        network. Run code in it with exec; variables, imports and files (under / , e.g. /tmp or /output) \
        persist between execs and across server restarts, until delete_session. Every exec makes a checkpoint you can \
        revert to or fork from. Returns session_id.")]
    async fn create_session(
        &self,
        Parameters(a): Parameters<CreateSessionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_timeout(a.timeout_seconds)?;
                let c = self.client(&ctx).await?;
                let opts = CreateSession {
                    tags: a.tags,
                    memory_mb: a.memory_mb,
                    timeout_seconds: a.timeout_seconds,
                    template: a.template,
                    network: a.network.map(Into::into),
                    ..CreateSession::default()
                };
                c.create_session(&opts)
                    .await
                    .map(|s| render::session(&s, "created"))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Run Python code in a session (see create_session). State from earlier execs is there: \
        variables, functions, imports, files. Returns value (repr of the last expression), stdout, stderr, error \
        {type, message, traceback} if the code raised (the session keeps any state changed before the exception), \
        and checkpoint: the number of the checkpoint this exec made. PNG files written under /output/ come back as \
        images. If the exec times out or crashes the sandbox, the session is rolled back to its previous checkpoint \
        and the error says so. To undo an exec that succeeded but broke the state, use revert.")]
    async fn exec(
        &self,
        Parameters(a): Parameters<ExecArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.session_exec(&a.session_id, &a.code)
                    .await
                    .map(|r| render::exec_result(&r))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(
        description = "Run a shell command in a sandbox and return its stdout, stderr and exit_code. Use it instead \
        of exec when the job is a command line rather than Python: listing or searching files (ls, find, grep, wc, \
        head, sort), shell pipelines, running a script or program (python3 script.py, sh build.sh), archives (tar, \
        gzip). The shell is dash with coreutils, findutils, grep, sed, gawk, tar, gzip and file; python3 is Python \
        3.11 + numpy; no network tools, no package managers. With session_id it runs in that session's file system \
        (the files that exec and upload_file made are there, and what it writes stays) and makes a checkpoint like \
        an exec; without, it runs in a fresh sandbox and nothing persists. A non-zero exit_code is a result, not a \
        tool error (127: command not found); a time-out is an error and the session is rolled back. Processes it \
        starts in the background are stopped when it ends (start_process runs one that keeps running). Use exec for Python state (variables, imports)."
    )]
    async fn run_command(
        &self,
        Parameters(a): Parameters<RunCommandArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                if let Some(id) = &a.session_id {
                    check_id(id)?;
                }
                if let Some(cwd) = &a.cwd {
                    check_path("cwd", cwd)?;
                }
                check_timeout(a.timeout_seconds)?;
                if a.session_id.is_some() && a.network.is_some() {
                    return Err(render::error(
                        "invalid_arguments",
                        "network is set when a session is created (create_session): a command in a session runs \
                         under the session's network; drop network or session_id",
                    ));
                }
                let c = self.client(&ctx).await?;
                let req = forkbox_client::CommandRequest {
                    cmd: forkbox_client::CommandLine::Shell(a.command),
                    cwd: a.cwd,
                    env: a.env,
                    timeout_seconds: a.timeout_seconds,
                    template: None,
                    network: a.network.map(Into::into),
                };
                let r = match &a.session_id {
                    Some(id) => c.session_command(id, &req).await,
                    None => c.command(&req).await,
                };
                r.map(|r| render::command_result(&r)).map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "List your sessions: session_id, current checkpoint, limits, tags.")]
    async fn list_sessions(&self, ctx: RequestContext<RoleServer>) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                let c = self.client(&ctx).await?;
                c.list_sessions(&[]).await.map(|l| render::sessions(&l)).map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(
        description = "Delete a session and all its checkpoints (cannot be undone). Sessions forked from it are not affected."
    )]
    async fn delete_session(
        &self,
        Parameters(a): Parameters<SessionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.delete_session(&a.session_id)
                    .await
                    .map(|()| render::deleted(&a.session_id))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "List a session's checkpoints: one per exec, with the code that made it, its parent, and \
        which one is current. History is a tree: after a revert, the next exec branches off.")]
    async fn list_checkpoints(
        &self,
        Parameters(a): Parameters<SessionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.checkpoints(&a.session_id)
                    .await
                    .map(|l| render::checkpoints(&a.session_id, &l))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "pip install packages into a session: the server resolves and downloads binary wheels \
        (from its package index or offline wheelhouse, under its allow/deny list) and the next exec can import \
        them; they stay in the session's checkpoints and forks. Packages that need a build from source (only an \
        sdist) are refused with an error naming them. Returns pip-like output and the checkpoint.")]
    async fn install_packages(
        &self,
        Parameters(a): Parameters<InstallPackagesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.install_packages(&a.session_id, &a.packages)
                    .await
                    .map(|p| render::packages(&p))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Undo: move a session back to an earlier checkpoint. Its whole state (variables, imports, \
        files) becomes exactly what it was right after that exec; later checkpoints stay listed and can be reverted \
        to again. Use it to recover when an exec left the session in a bad state.")]
    async fn revert(
        &self,
        Parameters(a): Parameters<RevertArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.revert(&a.session_id, a.checkpoint)
                    .await
                    .map(|s| render::session(&s, "reverted"))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Save a checkpoint of a session as a template of your own: run_python and create_session \
        with template=NAME then start from that state (its variables, imports, loaded data and files), without \
        redoing the setup. The template outlives the session. Returns the template's name and id.")]
    async fn save_template(
        &self,
        Parameters(a): Parameters<SaveTemplateArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.checkpoint_template(&a.session_id, a.checkpoint, &a.name)
                    .await
                    .map(|t| {
                        let mut out = CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
                            "saved template {} (id {}) from checkpoint {} of session {}; use template={:?}",
                            t.name,
                            t.id.as_deref().unwrap_or("-"),
                            a.checkpoint,
                            a.session_id,
                            t.name
                        ))]);
                        out.structured_content =
                            Some(serde_json::json!({ "template": t.name, "id": t.id, "status": t.status }));
                        out
                    })
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(
        description = "Branch: create a new session that starts from a checkpoint of another session (default: its \
        current state), with all its variables and files. The original session is not changed. Use it to try \
        alternatives from the same state, side by side. Returns the new session_id."
    )]
    async fn fork_session(
        &self,
        Parameters(a): Parameters<ForkArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.fork(&a.session_id, a.checkpoint)
                    .await
                    .map(|s| render::session(&s, "forked"))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Write a file into a session's sandbox, e.g. a CSV or JSON document the user gave you, so \
        that code run with exec can open it by its path (open('/data/sales.csv'), pandas.read_csv(...)). content is \
        the text itself (encoding \"text\", the default) or base64 of the bytes (encoding \"base64\", for binary \
        files). Parent directories are created; an existing file is replaced. At most 16 MiB. The upload is a \
        checkpoint of the session (revert to an earlier checkpoint undoes it). Returns path, size and checkpoint.")]
    async fn upload_file(
        &self,
        Parameters(a): Parameters<UploadFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                check_path("path", &a.path)?;
                let data = match a.encoding.unwrap_or(Encoding::Text) {
                    Encoding::Text => a.content.into_bytes(),
                    Encoding::Base64 => {
                        use base64::Engine as _;
                        let cleaned: String = a.content.chars().filter(|c| !c.is_ascii_whitespace()).collect();
                        base64::engine::general_purpose::STANDARD.decode(cleaned.as_bytes()).map_err(|e| {
                            render::error(
                                "invalid_arguments",
                                &format!("content is not valid base64 ({e}); send text with encoding \"text\""),
                            )
                        })?
                    }
                };
                if data.len() > UPLOAD_MAX_BYTES {
                    return Err(render::error(
                        "file_too_large",
                        &format!(
                            "the content is {} bytes, over upload_file's limit of {UPLOAD_MAX_BYTES} bytes",
                            data.len()
                        ),
                    ));
                }
                let c = self.client(&ctx).await?;
                c.put_file(&a.session_id, &a.path, data)
                    .await
                    .map(|w| render::uploaded(&w))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Read a file from a session's sandbox, e.g. a CSV, JSON or text file the code wrote under \
        /output. Returns the content as text if the file is UTF-8 (or with encoding \"text\"), else base64 (or with \
        encoding \"base64\"), with its size. Files over max_bytes (default 256 KiB, at most 4 MiB) are refused \
        with error file_too_large: then read a part or a summary of it with exec instead. Use list_files to see what \
        is there.")]
    async fn download_file(
        &self,
        Parameters(a): Parameters<DownloadFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                check_path("path", &a.path)?;
                let cap = a.max_bytes.unwrap_or(DOWNLOAD_DEFAULT_BYTES);
                if cap == 0 || cap > DOWNLOAD_MAX_BYTES {
                    return Err(render::error(
                        "invalid_arguments",
                        &format!("max_bytes must be between 1 and {DOWNLOAD_MAX_BYTES}, got {cap}"),
                    ));
                }
                let c = self.client(&ctx).await?;
                let too_large = |size: u64| {
                    render::error(
                        "file_too_large",
                        &format!(
                            "{} is {size} bytes, over this download's limit of {cap} bytes (max_bytes; at most \
                             {DOWNLOAD_MAX_BYTES}); read a part or a summary of it with exec instead",
                            a.path
                        ),
                    )
                };
                // The size first, from the directory listing, so a large file is not fetched at all.
                let (dir, _) = a.path.rsplit_once('/').unwrap_or(("/", ""));
                let dir = if dir.is_empty() { "/" } else { dir };
                if let Ok(list) = c.list_files(&a.session_id, dir).await {
                    if let Some(f) = list.iter().find(|f| f.path == a.path && !f.is_dir) {
                        if f.size > cap {
                            return Err(too_large(f.size));
                        }
                    }
                }
                let data = c.get_file(&a.session_id, &a.path).await.map_err(|e| render::client_error(&e))?;
                let size = data.len() as u64;
                if size > cap {
                    return Err(too_large(size));
                }
                render::downloaded(&a.path, data, a.encoding.map(|e| e == Encoding::Base64))
            }
            .await,
        )
    }

    #[tool(description = "List a directory in a session's sandbox (default /output, where code should write the \
        files it produces): each entry's name, absolute path, size in bytes and whether it is a directory.")]
    async fn list_files(
        &self,
        Parameters(a): Parameters<ListFilesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let dir = a.dir.unwrap_or_else(|| "/output".to_string());
                check_path("dir", &dir)?;
                let c = self.client(&ctx).await?;
                c.list_files(&a.session_id, &dir)
                    .await
                    .map(|l| render::files(&dir, &l))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Start a shell command as a background process of a session and return at once with its \
        pid: it keeps running between your calls (a server, a long job, a watcher) while exec and run_command go on \
        in the same session. Read what it prints with read_process_output, see all with list_processes, stop it \
        with kill_process. Its output is kept (the last 256 KiB of stdout and of stderr). A checkpoint does not \
        record it: after revert, fork_session or the session's eviction it is gone.")]
    async fn start_process(
        &self,
        Parameters(a): Parameters<StartProcessArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                if let Some(cwd) = &a.cwd {
                    check_path("cwd", cwd)?;
                }
                let c = self.client(&ctx).await?;
                let req = forkbox_client::CommandRequest {
                    cmd: forkbox_client::CommandLine::Shell(a.command),
                    cwd: a.cwd,
                    env: a.env,
                    timeout_seconds: None,
                    template: None,
                    network: None,
                };
                match c.start_session_command(&a.session_id, &req, false).await {
                    Ok(Ok(p)) => Ok(render::process_started(&a.session_id, &p)),
                    // It could not start: the command's result (exit code 127: not found).
                    Ok(Err(r)) => Ok(render::command_result(&r)),
                    Err(e) => Err(render::client_error(&e)),
                }
            }
            .await,
        )
    }

    #[tool(description = "Read what a background process (start_process) wrote to stdout and stderr from the \
        given byte offsets, and whether it still runs (with its exit code once it ended). Pass the \
        *_next_offset values of the last call to get only what is new; wait_seconds waits for it to end first.")]
    async fn read_process_output(
        &self,
        Parameters(a): Parameters<ProcessOutputArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let wait = a.wait_seconds.unwrap_or(0.0);
                if !(wait.is_finite() && (0.0..=60.0).contains(&wait)) {
                    return Err(render::error("invalid_arguments", "wait_seconds must be between 0 and 60"));
                }
                let c = self.client(&ctx).await?;
                let (id, pid) = (&a.session_id, a.pid);
                let r = async {
                    if wait > 0.0 {
                        c.wait_process(id, pid, wait).await?;
                    }
                    let out = c.process_output(id, pid, false, a.stdout_offset.unwrap_or(0), Some(OUTPUT_READ)).await?;
                    let err = c.process_output(id, pid, true, a.stderr_offset.unwrap_or(0), Some(OUTPUT_READ)).await?;
                    let procs = c.processes(id).await?;
                    Ok::<_, forkbox_client::ClientError>((out, err, procs.into_iter().find(|p| p.pid == pid)))
                }
                .await;
                match r {
                    Ok((out, err, Some(p))) => Ok(render::process_output(id, &p, &out, &err)),
                    Ok((_, _, None)) => Err(render::error("process_not_found", &format!("no process {pid}"))),
                    Err(e) => Err(render::client_error(&e)),
                }
            }
            .await,
        )
    }

    #[tool(description = "List a session's background processes (start_process): pid, state (running, or its exit \
        code or signal), CPU seconds, bytes of output, command.")]
    async fn list_processes(
        &self,
        Parameters(a): Parameters<SessionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.processes(&a.session_id)
                    .await
                    .map(|l| render::processes(&a.session_id, &l))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Stop a background process (start_process) and the processes it started: signal 15 \
        (SIGTERM) by default, 9 (SIGKILL) for one that ignores it.")]
    async fn kill_process(
        &self,
        Parameters(a): Parameters<KillProcessArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let sig = a.signal.unwrap_or(15);
                let c = self.client(&ctx).await?;
                let r = async {
                    c.signal_process(&a.session_id, a.pid, sig).await?;
                    // Acted on at once between calls: a moment for it to end.
                    c.wait_process(&a.session_id, a.pid, 2.0).await
                }
                .await;
                r.map(|p| render::process_info(&a.session_id, &p)).map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Interrupt the exec running in a session (one that takes too long or waits forever): the \
        code gets KeyboardInterrupt, that exec returns it as its error, and the session keeps its state (variables \
        set before the interrupt stay). Returns interrupted: false if nothing was running.")]
    async fn interrupt(
        &self,
        Parameters(a): Parameters<SessionArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.interrupt(&a.session_id)
                    .await
                    .map(|i| render::interrupted(&a.session_id, i))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }
}

/// The most of each stream one read_process_output returns.
const OUTPUT_READ: usize = 64 << 10;

/// How long `initialize` and `tools/list` wait for the server's capabilities.
const CAPABILITIES_WAIT: std::time::Duration = std::time::Duration::from_millis(1500);

impl ForkboxMcp {
    /// What the caller may do: asked of the server if its client is ready (with the caller's
    /// key over HTTP), else the fallback given at start; None if neither is known.
    async fn capabilities(&self, ctx: &RequestContext<RoleServer>) -> Option<Capabilities> {
        let Some(client) = self.client.now() else {
            return self.fallback.as_deref().cloned();
        };
        let client = if self.forward_key {
            match self.client(ctx).await {
                Ok(c) => c,
                Err(_) => return None,
            }
        } else {
            client
        };
        match tokio::time::timeout(CAPABILITIES_WAIT, client.capabilities()).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => {
                tracing::debug!("capabilities: {e}");
                self.fallback.as_deref().cloned()
            }
            Err(_) => self.fallback.as_deref().cloned(),
        }
    }
}

impl ServerHandler for ForkboxMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("forkbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(crate::instructions::instructions(self.fallback.as_deref()))
    }

    /// Answered at once, whatever state the server is in: the instructions say what the caller may do
    /// (asked of the server when it answers quickly, else what is known without it).
    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        context.peer.set_peer_info(request.clone());
        let mut info = self.negotiate_initialize(&request)?;
        if let Some(caps) = self.capabilities(&context).await {
            info.instructions = Some(crate::instructions::instructions(Some(&caps)));
        }
        Ok(info)
    }

    /// The router's dispatch, except that arguments which do not fit a tool's
    /// schema are a tool error with code `invalid_arguments`, like every other
    /// tool error (the model can read and fix it).
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let known = self.tool_router.has_route(&request.name);
        let name = request.name.clone();
        let arguments = request.arguments.clone().unwrap_or_default();
        let invalid = |fallback: &str| {
            let message = argument_error(&name, &arguments).unwrap_or_else(|| fallback.to_string());
            Ok(render::error("invalid_arguments", &format!("{name}: {message}")).into())
        };
        match self.tool_router.call(ToolCallContext::new(self, request, context)).await {
            // rmcp reports arguments that do not deserialize as a bare tool error
            // (all of ours carry structured content): give it our shape and code.
            Ok(CallToolResponse::Complete(r)) if r.is_error == Some(true) && r.structured_content.is_none() => {
                let message = r.content.iter().find_map(|c| c.as_text()).map(|t| t.text.clone()).unwrap_or_default();
                invalid(&message)
            }
            Err(e) if known && e.code == ErrorCode::INVALID_PARAMS => invalid(&e.message),
            r => r,
        }
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut tools = self.tool_router.list_all();
        if let Some(caps) = self.capabilities(&context).await {
            for t in &mut tools {
                if let Some(extra) = crate::instructions::tool_addendum(&t.name, &caps) {
                    let d = t.description.as_deref().unwrap_or("");
                    t.description = Some(format!("{d}\n{extra}").into());
                }
            }
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tool_router.get(name).cloned()
    }
}

/// Which argument of `tool` is wrong and why (serde's own message does not name the field).
fn argument_error(tool: &str, arguments: &rmcp::model::JsonObject) -> Option<String> {
    fn check<T: serde::de::DeserializeOwned>(arguments: &rmcp::model::JsonObject) -> Option<String> {
        let v = serde_json::Value::Object(arguments.clone());
        serde_path_to_error::deserialize::<_, T>(v).err().map(|e| match e.path().to_string().as_str() {
            "." => e.inner().to_string(),
            path => format!("argument `{path}`: {}", e.inner()),
        })
    }
    match tool {
        "run_python" => check::<RunPythonArgs>(arguments),
        "create_session" => check::<CreateSessionArgs>(arguments),
        "exec" => check::<ExecArgs>(arguments),
        "run_command" => check::<RunCommandArgs>(arguments),
        "delete_session" | "list_checkpoints" | "interrupt" | "list_processes" => check::<SessionArgs>(arguments),
        "start_process" => check::<StartProcessArgs>(arguments),
        "read_process_output" => check::<ProcessOutputArgs>(arguments),
        "kill_process" => check::<KillProcessArgs>(arguments),
        "upload_file" => check::<UploadFileArgs>(arguments),
        "download_file" => check::<DownloadFileArgs>(arguments),
        "list_files" => check::<ListFilesArgs>(arguments),
        "revert" => check::<RevertArgs>(arguments),
        "install_packages" => check::<InstallPackagesArgs>(arguments),
        "fork_session" => check::<ForkArgs>(arguments),
        "save_template" => check::<SaveTemplateArgs>(arguments),
        other => crate::tree::argument_check(other).and_then(|f| f(arguments)),
    }
}
