//! The routes, their OpenAPI document, and the layers around them (auth or a
//! fixed tenant, body limits, fallbacks in the API's error shape, `/mcp`).

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::{middleware, Extension, Router};
use forkbox_api::ErrorCode;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{auth, Caller};
use crate::error::{ApiError, ErrorBody, ErrorDetail};
use crate::extractors::BodyLimits;
use crate::handlers::{
    capabilities, commands, console, exec, files, forevervm, health, keys, processes, sessions, stream, templates, tree,
};
use crate::{openapi, AppState};

#[derive(OpenApi)]
#[openapi(
    info(title = "forkbox", description = "Run untrusted Python in hardware-isolated KVM sandboxes: one-shot execs, sessions with checkpoints, ForeverVM-compatible machines."),
    modifiers(&BearerAuth),
    components(schemas(ErrorBody, ErrorDetail, ErrorCode))
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let comps = doc.components.get_or_insert_with(Default::default);
        comps.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The `/v1` routes that act for a caller (auth is layered on by the caller of this).
fn v1_routes() -> OpenApiRouter<AppState> {
    // Uploads stream their bodies and check the file size limit themselves (`uploads`).
    let file_routes = routes!(files::put_file, files::get_file);
    OpenApiRouter::new()
        .routes(routes!(exec::exec))
        .routes(routes!(health::workers))
        .routes(routes!(capabilities::capabilities))
        .routes(routes!(health::nodes))
        .routes(routes!(health::node_drain))
        .routes(routes!(health::node_activate))
        .routes(routes!(keys::create_key, keys::list_keys))
        .routes(routes!(keys::get_key, keys::patch_key, keys::delete_key))
        .routes(routes!(stream::exec_stream))
        .routes(routes!(exec::exec_batch))
        .routes(routes!(commands::command))
        .routes(routes!(commands::command_stream))
        .routes(routes!(templates::templates, templates::create_template))
        .routes(routes!(templates::get_template))
        .routes(routes!(templates::checkpoint_template))
        .routes(routes!(sessions::create_session, sessions::list_sessions))
        .routes(routes!(sessions::get_session, sessions::patch_session, sessions::delete_session))
        .routes(routes!(sessions::session_exec))
        .routes(routes!(stream::session_exec_stream))
        .routes(routes!(commands::session_command))
        .routes(routes!(commands::session_command_stream))
        .routes(routes!(sessions::interrupt))
        .routes(routes!(processes::list_processes))
        .routes(routes!(processes::list_ports))
        .routes(routes!(processes::get_process))
        .routes(routes!(processes::process_output))
        .routes(routes!(processes::signal_process))
        .routes(routes!(processes::wait_process))
        .routes(routes!(processes::process_stdin))
        .routes(routes!(processes::resize_process))
        .routes(file_routes)
        .routes(routes!(files::list_files))
        .routes(routes!(sessions::checkpoints))
        .routes(routes!(sessions::revert))
        .routes(routes!(sessions::fork))
        .routes(routes!(sessions::install_packages))
        .merge(tree_routes())
        .merge(forevervm::routes())
}

/// The tree of states: tree, explore, variables, diff, history, one checkpoint.
fn tree_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(tree::tree))
        .routes(routes!(tree::explore))
        .routes(routes!(tree::variables))
        .routes(routes!(tree::diff))
        .routes(routes!(tree::history))
        .routes(routes!(tree::checkpoint))
}

/// The routes and the OpenAPI document they produce. `caller` adds the layer
/// that puts a [`Caller`] into each `/v1` request (auth, or a fixed tenant).
fn build(state: AppState, caller: impl FnOnce(OpenApiRouter<AppState>) -> OpenApiRouter<AppState>) -> Router {
    let v1 = caller(v1_routes()).routes(routes!(health::openapi_json));
    let (router, mut doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(health::root))
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics_admin))
        .nest("/v1", v1)
        .split_for_parts();
    openapi::finish(&mut doc);
    let doc = Arc::new(doc.to_json().unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")));
    router
        // The web console's assets (its page is `GET /` to a browser); not API routes.
        .route("/console/{file}", axum::routing::get(console::file))
        .layer(Extension(health::OpenApiDoc(doc)))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .layer(Extension(BodyLimits { json: state.config.body_limit }))
        .with_state(state)
}

/// The API's routes over `state`, every `/v1` route but the OpenAPI document
/// behind `Authorization: Bearer <key>`; and `/mcp` over them.
pub fn router(state: AppState) -> Router {
    let st = state.clone();
    let api = build(state.clone(), move |v1| {
        // Auth first (outermost), then a cluster's forwarding of session requests.
        v1.route_layer(middleware::from_fn_with_state(st.clone(), crate::forward::forward))
            .route_layer(middleware::from_fn_with_state(st, auth))
    });
    let api = with_mcp(state.clone(), api)
        .merge(crate::e2b::control_routes(state.clone()))
        // Outside the `/v1` auth layer: a signed port URL carries no key (the proxy authenticates).
        .merge(crate::ports::routes(state.clone()));
    // E2B's data plane goes by its headers, before any path is looked at.
    let data_plane = crate::e2b::DataPlane::new(state);
    api.layer(middleware::from_fn_with_state(data_plane, crate::e2b::dispatch))
        .layer(middleware::map_response(close_after_413))
}

/// A 413 may go out before the rest of the body is read (past the drain bound
/// in `uploads`, or a body limit met mid-stream), so the connection cannot carry
/// another request: say so, whatever API answered, or a client that pools
/// connections sends its next request into a socket the server closes.
async fn close_after_413(mut resp: axum::response::Response) -> axum::response::Response {
    if resp.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        resp.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    resp
}

/// `/mcp`: the MCP server (streamable HTTP, `forkbox_mcp`) behind the same API
/// keys (and rate limits); its tool calls go to `api` in process with the caller's key.
fn with_mcp(state: AppState, api: Router) -> Router {
    let mcp = Router::new()
        .fallback_service(forkbox_mcp::http_service(api.clone()))
        .layer(middleware::from_fn_with_state(state, auth));
    api.nest_service("/mcp", mcp)
}

/// The same routes for one fixed tenant, without keys, rate limits or quotas:
/// what the CLI and `forkbox mcp` drive in process (no socket) when no `--url` is given.
pub fn embedded_router(state: AppState, tenant: &str) -> Router {
    let caller = Caller { tenant: tenant.to_string(), key: None };
    build(state, move |v1| v1.route_layer(Extension(caller)))
}

async fn not_found(uri: axum::http::Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    crate::e2b::unknown_route_at(uri.path())
        .unwrap_or_else(|| ApiError::new(ErrorCode::NotFound, "no such endpoint").into_response())
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(ErrorCode::MethodNotAllowed, "method not allowed on this endpoint")
}
