//! The two error shapes of E2B's API: the control plane's `{"code": <HTTP status>, "message"}`
//! and envd's Connect errors `{"code": "<connect code>", "message"}` (also used for
//! envd's plain HTTP routes and the code interpreter's, whose SDK reads `message`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use forkbox_api::ErrorCode;
use serde_json::json;

use crate::error::ApiError;

/// A control-plane error: the SDK's generated client parses `{code, message}` and maps the status.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {message}")]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// Seconds for `Retry-After` (429 and 503, which the SDK retries).
    pub retry_after: Option<u64>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError { status, message: message.into(), retry_after: None }
    }
    pub fn bad_request(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::NOT_FOUND, message)
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        let status = match e.code {
            // A template still building: 503 with Retry-After, which the SDK retries (409 it would not).
            ErrorCode::TemplateNotReady => StatusCode::SERVICE_UNAVAILABLE,
            _ => e.status(),
        };
        let retry_after = (status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| e.retry_after.unwrap_or(if e.code == ErrorCode::TemplateNotReady { 5 } else { 1 }));
        crate::metrics::error(e.code.as_str());
        E2bError { status, message: format!("{}: {}", e.code, crate::error::scrub(&e.message)), retry_after }
    }
}

impl From<forkbox_runtime::RuntimeError> for E2bError {
    fn from(e: forkbox_runtime::RuntimeError) -> E2bError {
        ApiError::from(e).into()
    }
}

impl From<tokio::task::JoinError> for E2bError {
    fn from(e: tokio::task::JoinError) -> E2bError {
        ApiError::from(e).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = json!({ "code": self.status.as_u16(), "message": self.message });
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        resp
    }
}

/// The Connect protocol's error codes (connectrpc.com/docs/protocol#error-codes) this server uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT),
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An envd (data-plane) error.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", .code.as_str())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
    /// The HTTP status of the answer, when not the code's own (envd's plain HTTP routes:
    /// 502 for a sandbox that is gone, which the SDK reads as "not running").
    pub status: Option<StatusCode>,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError { code, message: message.into(), status: None }
    }
    pub fn invalid(message: impl Into<String>) -> ConnectError {
        ConnectError::new(Code::InvalidArgument, message)
    }
    /// The sandbox is not there (killed, timed out, never existed): the SDK looks for "was not found".
    pub fn sandbox_gone(id: &str) -> ConnectError {
        ConnectError {
            code: Code::Unavailable,
            message: format!("The sandbox {id} was not found"),
            status: Some(StatusCode::BAD_GATEWAY),
        }
    }
    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or(self.code.status())
    }
    /// The JSON of the error, as a unary body or the `error` of an end-of-stream message.
    pub fn json(&self) -> serde_json::Value {
        json!({ "code": self.code.as_str(), "message": crate::error::scrub(&self.message) })
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> ConnectError {
        use ErrorCode as E;
        crate::metrics::error(e.code.as_str());
        let code = match e.code {
            E::SessionNotFound => return ConnectError::new(Code::Unavailable, format!("The sandbox {}", e.message)),
            E::FileNotFound | E::NotFound | E::ProcessNotFound => Code::NotFound,
            E::StdinClosed | E::StdinFull => Code::FailedPrecondition,
            E::FileExists => Code::AlreadyExists,
            E::Unauthorized => Code::Unauthenticated,
            E::Timeout => Code::DeadlineExceeded,
            E::RateLimited | E::QuotaExceeded | E::CpuBudgetExceeded | E::FileTooLarge | E::PayloadTooLarge => {
                Code::ResourceExhausted
            }
            E::SessionBusy | E::Overloaded => Code::Unavailable,
            E::Interrupted => Code::Canceled,
            _ if e.status().is_client_error() => Code::InvalidArgument,
            _ => Code::Internal,
        };
        ConnectError::new(code, format!("{}: {}", e.code, e.message))
    }
}

impl From<forkbox_runtime::RuntimeError> for ConnectError {
    fn from(e: forkbox_runtime::RuntimeError) -> ConnectError {
        ApiError::from(e).into()
    }
}

impl From<tokio::task::JoinError> for ConnectError {
    fn from(e: tokio::task::JoinError) -> ConnectError {
        ConnectError::new(Code::Internal, format!("worker task failed: {e}"))
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.json())).into_response()
    }
}
