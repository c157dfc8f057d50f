//! The body of every error response.

use serde::{Deserialize, Serialize};

use crate::ErrorCode;

/// The body of every error response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Machine-readable code; its status and meaning are in the `ErrorCode` schema's `x-codes`.
    pub code: ErrorCode,
    pub message: String,
    /// For a failed session exec: the checkpoint the session was rolled back to (null: its initial state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Option<i64>>,
    /// For `quota_exceeded` of a session exec: the exec's result (same shape as a successful exec's).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub result: Option<serde_json::Value>,
    /// For an exec that failed after it ran (timeout, crash, exit, kill, interrupt): what it
    /// wrote to stdout before, truncated like a result's output (omitted for other errors).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    /// ... and to stderr.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
}
