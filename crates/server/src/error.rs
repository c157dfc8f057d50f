//! API errors: every failure is `{"error": {"code", "message"}}` with a proper status.
//!
//! Status choices (documented for clients):
//! - 400 `malformed_json` (body is not JSON), `invalid_request` (JSON of the wrong shape or bad values)
//! - 401 `unauthorized` (no / unknown API key)
//! - 403 `quota_exceeded`: the key's session or disk quota is used up
//! - 404 `not_found` (unknown route), `session_not_found` (also another tenant's session), `checkpoint_not_found`,
//!   `instruction_not_found` (ForeverVM), `file_not_found`
//! - 405 `method_not_allowed`
//! - 408 `timeout`: the code ran past its time limit (the sandbox is dropped; a session is rolled back)
//! - 409 `session_busy`: another exec is running in that session
//! - 400 `invalid_path`, `is_a_directory` (file routes)
//! - 413 `payload_too_large` (request body over the limit), `code_too_large` (code over the code limit), `file_too_large`
//! - 415 `unsupported_media_type` (no `Content-Type: application/json`)
//! - 422 `guest_crashed`, `guest_exited`, `guest_killed`, `sandbox_unusable`: the code took the guest
//!   down (e.g. `os._exit(3)` or a fault); the request was well-formed and the server is fine, so not a 5xx;
//!   `interrupted`: an interrupted exec did not stop within the grace period and was killed
//! - 429 `rate_limited`: the key is over its requests/s (with `Retry-After`)
//! - 429 `cpu_budget_exceeded`: the key has used its CPU seconds for now (with `Retry-After`)
//! - 403 `forbidden`: `/metrics` with a key that is not an admin key
//! - 403 `quota_exceeded` on a session exec also carries the exec's `result` (it ran; its checkpoint
//!   would have passed the tenant's disk quota, so the session stays at its previous checkpoint)
//! - 503 `overloaded`: every exec slot is busy and the bounded wait queue is full or the wait timed out
//!   (with `Retry-After: 1`)
//! - 507 `insufficient_storage`: the disk is full (or down to the reserve kept for deletes and
//!   metadata); nothing was written, the session stays at its previous checkpoint
//!
//! No message carries a host path: the data directory and the image path are replaced in every
//! error sent (the server's log has the full text).
//! - 500 everything else (`internal`, `storage_error`, `protocol_error`, `boot_failed`)
//!
//! A Python exception is NOT an error: it is a 200 result with `error` set and `exit_code: 1`.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use forkbox_engine::EngineError;
use forkbox_sessions::manager::SessionError;
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// For a failed session exec: the checkpoint seq the session is at now.
    pub checkpoint: Option<Option<i64>>,
    /// Seconds for `Retry-After` (429 and 503; 1 if unset).
    pub retry_after: Option<u64>,
    /// `quota_exceeded` of a session exec: the exec's result (an `ExecResponse`).
    pub result: Option<serde_json::Value>,
}

/// Host paths never sent to clients (the data directory, the image), set once by the server.
static HIDDEN_PATHS: std::sync::OnceLock<Vec<(String, &'static str)>> = std::sync::OnceLock::new();

/// Hide `path` (and everything under it) as `shown` in error messages.
pub fn hide_paths(paths: Vec<(String, &'static str)>) {
    let _ = HIDDEN_PATHS.set(paths.into_iter().filter(|(p, _)| p.len() > 1).collect());
}

/// `message` without host paths.
pub fn scrub(message: &str) -> String {
    let mut m = message.to_string();
    if let Some(paths) = HIDDEN_PATHS.get() {
        for (p, shown) in paths {
            if m.contains(p.as_str()) {
                m = m.replace(p.as_str(), shown);
            }
        }
    }
    m
}

/// The body of every error response.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable code (see the module docs for the list).
    pub code: String,
    pub message: String,
    /// For a failed session exec: the checkpoint the session was rolled back to (null: its initial state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Option<i64>>,
    /// For `quota_exceeded` of a session exec: the exec's result (same shape as a successful exec's).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub result: Option<serde_json::Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), checkpoint: None, retry_after: None, result: None }
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    /// The `error` object of the response body.
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code.to_string(),
            message: scrub(&self.message),
            checkpoint: self.checkpoint,
            result: self.result.clone(),
        }
    }
    pub fn overloaded() -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", "the server is at capacity; retry shortly")
    }
}

/// The HTTP status for a machine-readable error code from the engine or the sessions.
pub fn status_for(code: &str) -> StatusCode {
    match code {
        "timeout" => StatusCode::REQUEST_TIMEOUT,
        "guest_crashed" | "guest_exited" | "guest_killed" | "sandbox_unusable" | "interrupted" => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        "code_too_large" | "file_too_large" | "payload_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
        "session_not_found" | "checkpoint_not_found" | "file_not_found" | "instruction_not_found" | "not_found" => {
            StatusCode::NOT_FOUND
        }
        "session_busy" => StatusCode::CONFLICT,
        "invalid_request" | "invalid_path" | "is_a_directory" | "malformed_json" => StatusCode::BAD_REQUEST,
        "quota_exceeded" | "forbidden" => StatusCode::FORBIDDEN,
        "rate_limited" | "cpu_budget_exceeded" => StatusCode::TOO_MANY_REQUESTS,
        "insufficient_storage" => StatusCode::INSUFFICIENT_STORAGE,
        "unauthorized" => StatusCode::UNAUTHORIZED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let code = e.code();
        ApiError::new(status_for(code), code, e.to_string())
    }
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> ApiError {
        let code = e.code();
        let (checkpoint, result) = match &e {
            SessionError::ExecFailed { checkpoint, .. } => (Some(*checkpoint), None),
            SessionError::QuotaExceeded { checkpoint, result, .. } => (
                Some(*checkpoint),
                result.as_ref().and_then(|r| serde_json::to_value(crate::schema::ExecResponse::of(r)).ok()),
            ),
            _ => (None, None),
        };
        if status_for(code).is_server_error() {
            tracing::warn!("{code}: {e}");
        }
        ApiError { status: status_for(code), code, message: e.to_string(), checkpoint, retry_after: None, result }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> ApiError {
        ApiError::internal(format!("worker task failed: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::metrics::error(self.code);
        let mut resp = (self.status, axum::Json(ErrorBody { error: self.detail() })).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE || self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from(self.retry_after.unwrap_or(1)));
        }
        resp
    }
}
