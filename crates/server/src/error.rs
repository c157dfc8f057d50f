//! API errors: every failure is `{"error": {"code", "message"}}` with the
//! status its [`ErrorCode`] names (the table, with each code's meaning, is
//! `forkbox_api::ErrorCode`, exported in the OpenAPI document as the
//! `ErrorCode` schema and its `x-codes` extension). Only internal failures are
//! 5xx (`internal`, `storage_error`, `protocol_error`, `boot_failed`), and 503
//! `overloaded`; 429 and 503 come with `Retry-After`.
//!
//! A Python exception is NOT an error: it is a 200 result with `error` set and `exit_code: 1`.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use forkbox_api::ErrorCode;
use forkbox_runtime::RuntimeError;
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
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
    /// Machine-readable code; its status and meaning are in the `ErrorCode` schema's `x-codes`.
    pub code: ErrorCode,
    pub message: String,
    /// For a failed session exec: the checkpoint the session was rolled back to (null: its initial state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Option<i64>>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), checkpoint: None, retry_after: None }
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Internal, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::Unauthorized, message)
    }
    pub fn overloaded() -> ApiError {
        ApiError::new(ErrorCode::Overloaded, "the server is at capacity; retry shortly")
    }
    /// The HTTP status of the code.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
    /// The `error` object of the response body.
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail { code: self.code, message: self.message.clone(), checkpoint: self.checkpoint }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        ApiError { code: e.code(), checkpoint: e.rolled_back_to(), message: e.to_string(), retry_after: None }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> ApiError {
        ApiError::internal(format!("worker task failed: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::metrics::error(self.code.as_str());
        let status = self.status();
        let mut resp = (status, axum::Json(ErrorBody { error: self.detail() })).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from(self.retry_after.unwrap_or(1)));
        }
        resp
    }
}
