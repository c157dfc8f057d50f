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
//!   `interrupted`: an interrupted exec did not stop within the grace period and was killed;
//!   `deadlock`: the code waited (a blocking read, poll, futex ...) for something nothing could ever do
//! - 429 `rate_limited`: the key is over its requests/s (with `Retry-After`)
//! - 503 `overloaded`: every exec slot is busy and the bounded wait queue is full or the wait timed out
//!   (with `Retry-After: 1`)
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
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), checkpoint: None, retry_after: None }
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
        ErrorDetail { code: self.code.to_string(), message: self.message.clone(), checkpoint: self.checkpoint }
    }
    pub fn overloaded() -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", "the server is at capacity; retry shortly")
    }
}

/// The HTTP status for a machine-readable error code from the engine or the sessions.
pub fn status_for(code: &str) -> StatusCode {
    match code {
        "timeout" => StatusCode::REQUEST_TIMEOUT,
        "guest_crashed" | "guest_exited" | "guest_killed" | "sandbox_unusable" | "interrupted" | "deadlock" => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        "code_too_large" | "file_too_large" | "payload_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
        "session_not_found" | "checkpoint_not_found" | "file_not_found" | "instruction_not_found" | "not_found" => {
            StatusCode::NOT_FOUND
        }
        "session_busy" => StatusCode::CONFLICT,
        "invalid_request" | "invalid_path" | "is_a_directory" | "malformed_json" => StatusCode::BAD_REQUEST,
        "quota_exceeded" => StatusCode::FORBIDDEN,
        "rate_limited" => StatusCode::TOO_MANY_REQUESTS,
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
        let checkpoint = match &e {
            SessionError::ExecFailed { checkpoint, .. } => Some(*checkpoint),
            _ => None,
        };
        ApiError { status: status_for(code), code, message: e.to_string(), checkpoint, retry_after: None }
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
