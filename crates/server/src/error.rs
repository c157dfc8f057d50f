//! API errors: every failure is `{"error": {"code", "message"}}` with the
//! status its [`ErrorCode`] names (the table, with each code's meaning, is
//! `forkbox_api::ErrorCode`, exported in the OpenAPI document as the
//! `ErrorCode` schema and its `x-codes` extension). Only internal failures are
//! 5xx (`internal`, `storage_error`, `protocol_error`, `boot_failed`), and 503
//! `overloaded` / `storage_unavailable` / `session_moved`; 429, 503 and 409 `session_busy` /
//! `template_not_ready` come with `Retry-After`.
//!
//! An exec that failed after it ran (timeout, crash, exit, kill, interrupt)
//! carries what it wrote before in `error.stdout` / `error.stderr` (one-shot,
//! session, batch items, the streams' `error` event), truncated like any output.
//!
//! A Python exception is NOT an error: it is a 200 result with `error` set and `exit_code: 1`.
//!
//! `quota_exceeded` of a session exec (its checkpoint would pass the tenant's
//! disk quota) carries the exec's `result`: it ran, the session stays at its
//! previous checkpoint. No message carries a host path: the data directory and
//! the image path are replaced in every error sent (the server's log has the
//! full text).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use forkbox_api::ErrorCode;
use forkbox_runtime::RuntimeError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// For a failed session exec: the checkpoint seq the session is at now.
    pub checkpoint: Option<Option<i64>>,
    /// Seconds for `Retry-After` (429 and 503; 1 if unset).
    pub retry_after: Option<u64>,
    /// `quota_exceeded` of a session exec: the exec's result (an `ExecResponse`).
    pub result: Option<serde_json::Value>,
    /// A failed exec (timeout, crash, exit, kill): what it wrote before.
    pub output: Option<Box<forkbox_runtime::CapturedOutput>>,
    /// Cluster: the URL of the node that has the session (the request is
    /// forwarded there, see `crate::forward`; never sent to the client).
    pub moved_to: Option<Box<String>>,
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

pub use forkbox_api::wire::errors::{ErrorBody, ErrorDetail};

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            checkpoint: None,
            retry_after: None,
            result: None,
            output: None,
            moved_to: None,
        }
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
        ErrorDetail {
            code: self.code,
            message: scrub(&self.message),
            checkpoint: self.checkpoint,
            result: self.result.clone(),
            stdout: self.output.as_ref().map(|o| o.stdout.clone()),
            stderr: self.output.as_ref().map(|o| o.stderr.clone()),
        }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        let result = e.exec_result().and_then(|r| {
            serde_json::to_value(<crate::schema::ExecResponse as crate::schema::ExecResponseOf>::of(r)).ok()
        });
        if e.code().is_server_error() {
            tracing::warn!("{}: {e}", e.code());
        }
        let output = e.captured_output().cloned().map(Box::new);
        ApiError {
            code: e.code(),
            checkpoint: e.rolled_back_to(),
            message: e.to_string(),
            retry_after: None,
            result,
            output,
            moved_to: e.moved_to().map(|u| Box::new(u.to_owned())),
        }
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
        let retry = matches!(self.code, ErrorCode::SessionBusy | ErrorCode::TemplateNotReady);
        if retry || status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(self.retry_after.unwrap_or(if self.code == ErrorCode::TemplateNotReady {
                    5
                } else {
                    1
                })),
            );
        }
        if let Some(url) = self.moved_to {
            resp.extensions_mut().insert(crate::forward::MovedTo(*url));
        }
        resp
    }
}
