//! Health, metrics, the OpenAPI document (no auth).

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::{Extension, Json};

use crate::schema::Health;
use crate::{metrics, AppState};

/// The OpenAPI document (JSON), rendered once per router.
#[derive(Clone)]
pub(crate) struct OpenApiDoc(pub(crate) Arc<String>);

#[utoipa::path(get, path = "/healthz", tag = "server", security(()), responses((status = 200, body = Health)))]
pub(crate) async fn healthz(State(state): State<AppState>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        template: state.runtime.template_id().to_string(),
        exec_slots: state.admission.slots(),
        exec_slots_free: state.admission.free(),
        queued: state.admission.queued(),
        resident_sessions: state.runtime.resident_sessions(),
    })
}

#[utoipa::path(get, path = "/metrics", tag = "server", security(()),
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String)))]
pub(crate) async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    metrics::sessions(state.runtime.resident_sessions());
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
