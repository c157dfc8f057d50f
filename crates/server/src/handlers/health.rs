//! `GET /`, health, metrics, the OpenAPI document (no auth).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use forkbox_api::ErrorCode;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::schema::{Health, RootInfo, WorkerBody, WorkerList};
use crate::{metrics, AppState};

/// The OpenAPI document (JSON), rendered once per router.
#[derive(Clone)]
pub(crate) struct OpenApiDoc(pub(crate) Arc<String>);

/// Where this API is described: the OpenAPI document and the README's routes table; to a
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
        docs: "README.md, section \"HTTP API\" (the routes table)".into(),
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
    })
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
    if caller.key.as_ref().is_some_and(|k| !k.admin) {
        return Err(ApiError::new(ErrorCode::Forbidden, "/v1/admin/workers is for admin keys only"));
    }
    let isolation = match state.config.isolation {
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
