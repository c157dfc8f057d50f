//! The MCP tools (rmcp `#[tool]`s) over a [`forkbox_client::Client`].
//!
//! Every tool is one or two API calls; nothing here touches the engine, so the
//! embedded, remote and `/mcp` deployments behave the same. Over streamable
//! HTTP the API calls carry the key of the MCP request being answered.

use std::collections::BTreeMap;

use forkbox_client::{Client, CreateSession};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorCode, Implementation, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{schemars, tool, tool_router, ErrorData, RoleServer, ServerHandler};
use serde::Deserialize;

use crate::render;

/// Said to the model once, when the client connects.
const INSTRUCTIONS: &str = "forkbox runs Python code in isolated sandboxes (hardware-isolated VMs). \
Python 3.11 with numpy and the standard library only: no network, no pip, nothing else can be installed. \
Use run_python for a one-off computation (nothing persists). For multi-step work, create_session and call exec \
repeatedly: variables, imports and files persist between execs, like a notebook. Every exec in a session is a \
checkpoint: if the state goes bad (an exec broke something, a variable was overwritten), call list_checkpoints and \
revert to an earlier one instead of starting over; to try alternatives from the same state, fork_session. \
Image files (PNG) the code writes under /output are returned as images with the result. \
Delete sessions you no longer need.";

/// The forkbox MCP server: the tools, over one API client.
#[derive(Clone)]
pub struct ForkboxMcp {
    client: Client,
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
    /// Template: "python" (Python 3.11 + numpy, the default) or "data" (adds pandas, scipy, matplotlib, \
    /// scikit-learn, statsmodels, seaborn, sympy, networkx, Pillow, requests, bs4, lxml, openpyxl, pyyaml, tqdm, tabulate).
    #[serde(default)]
    pub template: Option<String>,
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
    /// Template: "python" (Python 3.11 + numpy, the default) or "data" (adds pandas, scipy, matplotlib, \
    /// scikit-learn, statsmodels, seaborn, sympy, networkx, Pillow, requests, bs4, lxml, openpyxl, pyyaml, tqdm, tabulate).
    #[serde(default)]
    pub template: Option<String>,
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
pub struct SessionArgs {
    /// The session's id.
    pub session_id: String,
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

fn check_id(id: &str) -> Result<(), CallToolResult> {
    if id.is_empty() || id.len() > 128 {
        return Err(render::error("invalid_arguments", "session_id must be 1 to 128 characters"));
    }
    Ok(())
}

fn check_timeout(t: Option<f64>) -> Result<(), CallToolResult> {
    match t {
        Some(s) if !(s.is_finite() && s > 0.0) => {
            Err(render::error("invalid_arguments", &format!("timeout_seconds must be a positive number of seconds, got {s}")))
        }
        _ => Ok(()),
    }
}

/// `Ok(result)` either way: a failure is a tool error the model sees, not a protocol error.
fn done(r: Result<CallToolResult, CallToolResult>) -> Result<CallToolResult, ErrorData> {
    Ok(r.unwrap_or_else(|e| e))
}

#[tool_router]
impl ForkboxMcp {
    /// Tools over `client` (its own transport and key).
    pub fn new(client: Client) -> ForkboxMcp {
        ForkboxMcp { client, forward_key: false, tool_router: Self::tool_router() }
    }

    /// Tools over `client`, each API call made with the bearer key of the HTTP
    /// request being answered (streamable HTTP behind the API's keys).
    pub fn forwarding_key(client: Client) -> ForkboxMcp {
        ForkboxMcp { client, forward_key: true, tool_router: Self::tool_router() }
    }

    fn client(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, CallToolResult> {
        if !self.forward_key {
            return Ok(self.client.clone());
        }
        let key = ctx
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.headers.get(axum::http::header::AUTHORIZATION))
            .and_then(|v| v.to_str().ok())
            .and_then(|h| h.trim().strip_prefix("Bearer ").or_else(|| h.trim().strip_prefix("bearer ")))
            .map(str::trim);
        match key {
            Some(k) if !k.is_empty() => Ok(self.client.with_key(k)),
            _ => Err(render::error("unauthorized", "missing API key: send `Authorization: Bearer <key>`")),
        }
    }

    #[tool(description = "Run Python code once in a fresh, isolated sandbox and return its result. Nothing persists: \
        every call starts from a clean interpreter (use create_session + exec for state that carries over). \
        Python 3.11 + numpy + the standard library; no network, no pip. Default time limit 30 s, 2 GiB memory, \
        1 MiB of stdout/stderr. Returns value (repr of the last expression), stdout, stderr, and error \
        {type, message, traceback} if the code raised. PNG files written under /output/ come back as images \
        (e.g. build one with zlib + struct, there is no matplotlib).")]
    async fn run_python(
        &self,
        Parameters(a): Parameters<RunPythonArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_timeout(a.timeout_seconds)?;
                let c = self.client(&ctx)?;
                c.exec_on(&a.code, a.timeout_seconds, a.template.as_deref()).await.map(|r| render::exec_result(&r)).map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Create a session: a persistent Python 3.11 + numpy interpreter in its own sandbox (no \
        network, no pip). Run code in it with exec; variables, imports and files (under / , e.g. /tmp or /output) \
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
                let c = self.client(&ctx)?;
                let opts = CreateSession { tags: a.tags, memory_mb: a.memory_mb, timeout_seconds: a.timeout_seconds, template: a.template };
                c.create_session(&opts).await.map(|s| render::session(&s, "created")).map_err(|e| render::client_error(&e))
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
                let c = self.client(&ctx)?;
                c.session_exec(&a.session_id, &a.code)
                    .await
                    .map(|r| render::exec_result(&r))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "List your sessions: session_id, current checkpoint, limits, tags.")]
    async fn list_sessions(&self, ctx: RequestContext<RoleServer>) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                let c = self.client(&ctx)?;
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
                let c = self.client(&ctx)?;
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
                let c = self.client(&ctx)?;
                c.checkpoints(&a.session_id)
                    .await
                    .map(|l| render::checkpoints(&a.session_id, &l))
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
                let c = self.client(&ctx)?;
                c.revert(&a.session_id, a.checkpoint)
                    .await
                    .map(|s| render::session(&s, "reverted"))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Branch: create a new session that starts from a checkpoint of another session (default: its \
        current state), with all its variables and files. The original session is not changed. Use it to try \
        alternatives from the same state, side by side. Returns the new session_id.")]
    async fn fork_session(
        &self,
        Parameters(a): Parameters<ForkArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx)?;
                c.fork(&a.session_id, a.checkpoint)
                    .await
                    .map(|s| render::session(&s, "forked"))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }
}

impl ServerHandler for ForkboxMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("forkbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
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
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tool_router.list_all()))
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
        "delete_session" | "list_checkpoints" => check::<SessionArgs>(arguments),
        "revert" => check::<RevertArgs>(arguments),
        "fork_session" => check::<ForkArgs>(arguments),
        _ => None,
    }
}
