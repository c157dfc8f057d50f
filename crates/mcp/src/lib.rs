//! forkbox as an MCP server (on `rmcp`, the official Rust SDK): sandboxes and
//! sessions as tools for LLM clients (Claude Desktop, Claude Code, Cursor, Goose, ...).
//!
//! - [`serve_stdio`]: `forkbox mcp` — MCP over stdin/stdout, over any
//!   [`forkbox_client::Client`] (an embedded engine through the in-process router,
//!   or a remote server over HTTP).
//! - [`http_service`]: the streamable-HTTP transport, mounted at `/mcp` by
//!   `forkbox serve` behind the API's keys; each tool call uses the key of the
//!   MCP request it answers.
//! - [`install`]: the client configuration snippets of `forkbox mcp install`.
//!
//! Tools: `run_python`, `create_session`, `exec`, `list_sessions`, `delete_session`,
//! `list_checkpoints`, `revert`, `install_packages`, `fork_session`, `save_template`, `upload_file`, `download_file`, `list_files`,
//! `interrupt` (see [`tools`]).
//!
//! Place in the flow: a **request** front end beside the server and the CLI; every
//! tool call goes through `forkbox-client` (the server's routes over HTTP or in
//! process), never below it.

#![forbid(unsafe_code)]

pub mod install;
pub mod instructions;
mod render;
pub mod source;
pub mod tools;
mod tree;

use std::sync::Arc;

use forkbox_client::{Client, Transport};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;

pub use tools::ForkboxMcp;

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("starting the MCP session on stdio: {0}")]
    Start(String),
    #[error("the MCP session on stdio ended abnormally: {0}")]
    Run(String),
}

/// Serve MCP on stdin/stdout until the client closes stdin.
pub async fn serve_stdio(client: Client) -> Result<(), McpError> {
    serve_stdio_with(ForkboxMcp::new(client)).await
}

/// Serve `server` on stdin/stdout until the client closes stdin (its client may still be
/// being prepared: see [`source`]).
pub async fn serve_stdio_with(server: ForkboxMcp) -> Result<(), McpError> {
    let running = server.serve(rmcp::transport::stdio()).await.map_err(|e| McpError::Start(e.to_string()))?;
    running.waiting().await.map_err(|e| McpError::Run(e.to_string()))?;
    Ok(())
}

/// The streamable-HTTP MCP endpoint over `api`, the API's router (with its key
/// check): mount it with `Router::nest_service("/mcp", ...)` behind the same
/// auth middleware as `/v1`. Tool calls are served by `api` in process with the
/// `Authorization: Bearer` key of the MCP request, so a key sees exactly its
/// tenant's sessions. The Host check of rmcp (a defence against DNS rebinding of
/// unauthenticated local servers) is off: every request must carry an API key.
/// Stateless mode: any instance can answer any request.
pub fn http_service(api: axum::Router) -> StreamableHttpService<ForkboxMcp, LocalSessionManager> {
    // Built once (the tool schemas), cloned per MCP request.
    let server = ForkboxMcp::forwarding_key(Client::new(Transport::InProcess(api)));
    // Stateless, JSON responses: no MCP session lives in the server between
    // requests and no event stream stays open (graceful shutdown stays quick).
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_legacy_session_mode(false)
        .with_json_response(true);
    StreamableHttpService::new(move || Ok(server.clone()), Arc::new(LocalSessionManager::default()), config)
}
