//! What a client call can fail with.

pub use forkbox_api::ErrorCode;

use crate::types::ExecOutput;

/// A failed client call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The API answered with an error: its status and `{"error": {code, message}}`, unchanged;
    /// `output`: for an exec that failed after it ran (timeout, crash, ...), what it wrote before.
    #[error("{message} ({code}, HTTP {status})")]
    Api { status: u16, code: String, message: String, output: Option<Box<ExecOutput>> },
    /// The HTTP request could not be made or its body could not be read (connection refused, reset, ...).
    #[error("request to {url} failed: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// Reading an in-process response body failed.
    #[error("reading the response body: {0}")]
    Body(String),
    /// The server answered something that is not the API's JSON (e.g. a proxy's error page).
    #[error("unexpected response (HTTP {status}): {message}")]
    UnexpectedResponse { status: u16, message: String },
    /// The caller passed something the API cannot express (e.g. a relative file path).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An event stream ended before its final `result` or `error` event.
    #[error("the event stream ended before its result")]
    StreamEnded,
}

impl ClientError {
    /// An API error that arrived without a status (an `error` event of a stream):
    /// the status is the one the API gives the code (500 for a code this client does not know).
    pub fn from_code(code: String, message: String) -> ClientError {
        ClientError::from_code_with_output(code, message, None)
    }

    /// [`from_code`](Self::from_code) with the output of the exec that failed.
    pub fn from_code_with_output(code: String, message: String, output: Option<Box<ExecOutput>>) -> ClientError {
        let status = code.parse::<ErrorCode>().map_or(500, ErrorCode::status);
        ClientError::Api { status, code, message, output }
    }

    /// For an exec that failed after it ran (timeout, crash, exit, kill): what it wrote before.
    pub fn output(&self) -> Option<&ExecOutput> {
        match self {
            ClientError::Api { output, .. } => output.as_deref(),
            _ => None,
        }
    }

    /// The API's error code, if this is an API error with a code this client knows.
    pub fn api_code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => code.parse().ok(),
            _ => None,
        }
    }

    /// The API's error code, or a code naming the transport failure
    /// (`connection_failed`, `unexpected_response`, `invalid_argument`, `stream_ended`).
    pub fn code(&self) -> &str {
        match self {
            ClientError::Api { code, .. } => code,
            ClientError::Http { .. } | ClientError::Body(_) => "connection_failed",
            ClientError::UnexpectedResponse { .. } => "unexpected_response",
            ClientError::InvalidArgument(_) => "invalid_argument",
            ClientError::StreamEnded => "stream_ended",
        }
    }

    /// The message without the code and status (the API's message for `Api`).
    pub fn message(&self) -> String {
        match self {
            ClientError::Api { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }
}
