//! `GET /`, health, metrics, the OpenAPI document (no auth).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use forkbox_api::ErrorCode;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::schema::{Health, NodeBody, NodeList, Ready, RootInfo, WorkerBody, WorkerList};
use crate::{metrics, AppState};

/// The OpenAPI document (JSON), rendered once per router.
#[derive(Clone)]
pub(crate) struct OpenApiDoc(pub(crate) Arc<String>);

/// Where this API is described: the OpenAPI document and the routes table of docs/api.md; to a
/// browser (`Accept` prefers `text/html` to JSON), the web console's page instead.
#[utoipa::path(get, path = "/", tag = "server", security(()),
    responses((status = 200, description = "JSON for API clients; the web console (HTML) when `Accept` prefers text/html",
        content((RootInfo = "application/json"), (String = "text/html")))))]
pub(crate) async fn root(headers: HeaderMap) -> Response {
    if super::console::wants_html(&headers) {
        return super::console::index();
    }
    let mut r = Json(RootInfo {
        name: "forkbox".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        openapi: "/v1/openapi.json".into(),
        health: "/healthz".into(),
        docs: "docs/api.md, section \"HTTP API\" (the routes table)".into(),
        console: "/".into(),
    })
    .into_response();
    r.headers_mut().insert(header::VARY, HeaderValue::from_static("Accept"));
    r
}

#[utoipa::path(get, path = "/healthz", tag = "server", security(()), responses((status = 200, body = Health)))]
pub(crate) async fn healthz(State(state): State<AppState>) -> Json<Health> {
    // Nothing about tenants or their sessions: that the server is up, its template and capacity.
    Json(Health {
        status: "ok".into(),
        template: state.runtime.template_id().to_string(),
        default_template: state.runtime.default_template(),
        exec_slots: state.admission.slots(),
        exec_slots_free: state.admission.free(),
        queued: state.admission.queued(),
        node: state.runtime.node_id().map(str::to_owned),
    })
}

/// Readiness (a load balancer's or Kubernetes' readiness probe): 503 while
/// this cluster node drains, so that no new request is sent to it. `/healthz`
/// is the liveness probe (200 while the process serves).
#[utoipa::path(get, path = "/readyz", tag = "server", security(()),
    responses((status = 200, body = Ready), (status = 503, description = "Draining", body = Ready)))]
pub(crate) async fn readyz(State(state): State<AppState>) -> Response {
    if state.runtime.draining() {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(Ready { status: "draining".into() })).into_response()
    } else {
        Json(Ready { status: "ready".into() }).into_response()
    }
}

pub(crate) fn admin_only(caller: &Caller, route: &str) -> Result<(), ApiError> {
    if caller.key.as_ref().is_some_and(|k| !k.admin) {
        return Err(ApiError::new(ErrorCode::Forbidden, format!("{route} is for admin keys only")));
    }
    Ok(())
}

/// The nodes of the cluster this server belongs to: state, heartbeat age,
/// sessions resident on each (empty when it is not a cluster node).
#[utoipa::path(get, path = "/admin/nodes", tag = "server",
    responses((status = 200, body = NodeList),
              (status = 401, description = "No API key", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody)))]
pub(crate) async fn nodes(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<NodeList>, ApiError> {
    admin_only(&caller, "/v1/admin/nodes")?;
    let rt = state.runtime.clone();
    let (nodes, lease) = tokio::task::spawn_blocking(move || rt.nodes().map(|n| (n, rt.lease_time()))).await??;
    let lease_ms = lease.map_or(0, |l| i64::try_from(l.as_millis()).unwrap_or(i64::MAX));
    let nodes = nodes
        .into_iter()
        .map(|n| NodeBody {
            alive: n.heartbeat_age_ms < lease_ms,
            id: n.id,
            url: n.url,
            state: n.state.as_str().into(),
            heartbeat_age_ms: n.heartbeat_age_ms,
            started_unix_ms: n.started_ms,
            sessions: n.sessions,
        })
        .collect();
    Ok(Json(NodeList { node: state.runtime.node_id().map(str::to_owned), nodes }))
}

async fn set_draining(state: AppState, caller: Caller, id: String, on: bool) -> Result<Json<NodeList>, ApiError> {
    admin_only(&caller, "/v1/admin/nodes/{id}")?;
    let rt = state.runtime.clone();
    let known = tokio::task::spawn_blocking(move || rt.set_draining(&id, on)).await??;
    if !known {
        return Err(ApiError::new(ErrorCode::NotFound, "no such node"));
    }
    nodes(State(state), Extension(caller)).await
}

/// Drain a node of the cluster (any node may be asked): it gives back every
/// session no exec holds (at once if it is this node, else at its next
/// heartbeat), then the ones that finish; it takes no new ones and its
/// `/readyz` says 503. Requests for its sessions go to the other nodes.
#[utoipa::path(post, path = "/admin/nodes/{id}/drain", tag = "server",
    params(("id" = String, Path, description = "The node's id")),
    responses((status = 200, body = NodeList),
              (status = 403, description = "Not an admin key", body = ErrorBody),
              (status = 404, description = "No such node", body = ErrorBody)))]
pub(crate) async fn node_drain(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<NodeList>, ApiError> {
    set_draining(state, caller, id, true).await
}

/// Make a drained node active again.
#[utoipa::path(post, path = "/admin/nodes/{id}/activate", tag = "server",
    params(("id" = String, Path, description = "The node's id")),
    responses((status = 200, body = NodeList),
              (status = 403, description = "Not an admin key", body = ErrorBody),
              (status = 404, description = "No such node", body = ErrorBody)))]
pub(crate) async fn node_activate(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<NodeList>, ApiError> {
    set_draining(state, caller, id, false).await
}

/// The sandbox worker processes: pids, uids, restarts (operators; the tests
/// read each worker's /proc status from these pids).
#[utoipa::path(get, path = "/admin/workers", tag = "server",
    responses((status = 200, body = WorkerList),
              (status = 401, description = "No API key", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody)))]
pub(crate) async fn workers(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<WorkerList>, ApiError> {
    admin_only(&caller, "/v1/admin/workers")?;
    let isolation = match state.runtime.config().isolation {
        forkbox_runtime::Isolation::Thread => "thread",
        forkbox_runtime::Isolation::Process(_) => "process",
    };
    let workers = state
        .runtime
        .worker_list()
        .into_iter()
        .map(|w| WorkerBody {
            index: w.index,
            kind: w.kind.into(),
            tenant: w.tenant,
            sandboxes: w.sandboxes,
            pid: w.pid,
            uid: w.uid,
            busy: w.busy,
            restarts: w.restarts,
            started_unix_ms: w.started_unix_ms,
            last_exit: w.last_exit,
        })
        .collect();
    Ok(Json(WorkerList { isolation: isolation.into(), workers }))
}

/// `/metrics` on the main address: admin keys only (or the embedded router's
/// caller); with `metrics_listen` set it is not served here at all.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, description = "Prometheus text exposition (admin keys only)", content_type = "text/plain", body = String),
              (status = 401, description = "No API key", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody)))]
pub(crate) async fn metrics_admin(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    if state.config.metrics_listen.is_some() {
        return Err(ApiError::new(ErrorCode::NotFound, "metrics are served on their own address"));
    }
    let embedded = req.extensions().get::<Caller>().is_some_and(|c| c.key.is_none());
    if !embedded {
        let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::trim);
        let Some(key) =
            header.and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer "))).map(str::trim)
        else {
            return Err(ApiError::unauthorized("/metrics needs an admin API key"));
        };
        let (st, k) = (state.clone(), key.to_string());
        let info = tokio::task::spawn_blocking(move || st.keys.lookup(&k))
            .await?
            .map_err(|e| ApiError::internal(format!("key store: {e}")))?;
        match info {
            None => return Err(ApiError::unauthorized("unknown API key")),
            Some(i) if !i.admin => return Err(ApiError::new(ErrorCode::Forbidden, "/metrics is for admin keys only")),
            Some(_) => {}
        }
    }
    Ok(metrics_text(State(state)).await.into_response())
}

/// The Prometheus text (the separate metrics listener serves this without auth).
pub(crate) async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    metrics::sessions(state.runtime.resident_sessions());
    metrics::vm_pool(state.runtime.vm_pool_private_bytes());
    metrics::network(state.runtime.net_stats());
    let rt = state.runtime.clone();
    if let Ok(Ok(n)) = tokio::task::spawn_blocking(move || rt.session_count(None)).await {
        metrics::sessions_live(n);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::handle().render())
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object)))]
pub(crate) async fn openapi_json(Extension(OpenApiDoc(doc)): Extension<OpenApiDoc>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], doc.as_str().to_owned())
}
