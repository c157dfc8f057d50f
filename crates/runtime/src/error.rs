//! What a runtime operation fails with; each failure knows its API [`ErrorCode`].

use forkbox_api::ErrorCode;
use forkbox_engine::{CapturedOutput, EngineError};
use forkbox_sessions::manager::SessionError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A request argument out of bounds (timeout, memory, tags, batch size).
    #[error("{0}")]
    Invalid(String),
    #[error("code is {len} bytes, more than the {limit}-byte limit")]
    CodeTooLarge { len: usize, limit: usize },
    /// The caller's session or disk quota is used up.
    #[error("{0}")]
    QuotaExceeded(String),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A one-shot exec that failed after it ran (timeout, crash, exit, kill),
    /// with what it wrote before.
    #[error("{source}")]
    ExecFailed { source: EngineError, output: Box<CapturedOutput> },
    #[error(transparent)]
    Template(#[from] forkbox_catalog::CatalogError),
    /// Building or opening the image, template or data directory.
    #[error("{what}: {message}")]
    Open { what: &'static str, message: String },
    /// An exec thread could not be started, or dropped the job (a panic).
    #[error("the exec worker failed")]
    WorkerGone,
    /// A sandbox worker process died, hung or could not be (re)started.
    #[error(transparent)]
    Worker(forkbox_worker::WorkerError),
}

impl RuntimeError {
    /// The failure of an exec that ran: with its output when the sandbox kept it.
    pub fn exec(source: EngineError, output: Option<CapturedOutput>) -> RuntimeError {
        match output {
            Some(output) => RuntimeError::ExecFailed { source, output: Box::new(output) },
            None => RuntimeError::Engine(source),
        }
    }

    /// For a failed exec (one-shot, batch item or session): what it wrote to
    /// stdout/stderr before it failed, truncated like a result's output.
    pub fn captured_output(&self) -> Option<&CapturedOutput> {
        match self {
            RuntimeError::ExecFailed { output, .. } => Some(output),
            RuntimeError::Session(e) => e.captured_output(),
            _ => None,
        }
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::Invalid(_) => ErrorCode::InvalidRequest,
            RuntimeError::CodeTooLarge { .. } => ErrorCode::CodeTooLarge,
            RuntimeError::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
            RuntimeError::Session(e) => e.error_code(),
            RuntimeError::Engine(e) | RuntimeError::ExecFailed { source: e, .. } => e.error_code(),
            RuntimeError::Template(e) => e.error_code(),
            RuntimeError::Open { .. } | RuntimeError::WorkerGone => ErrorCode::Internal,
            RuntimeError::Worker(forkbox_worker::WorkerError::Unreachable) => ErrorCode::TemplateUnavailable,
            RuntimeError::Worker(_) => ErrorCode::SandboxCrashed,
        }
    }

    /// For a session exec whose checkpoint was refused by the disk quota: the exec's result.
    pub fn exec_result(&self) -> Option<&forkbox_engine::ExecResult> {
        match self {
            RuntimeError::Session(SessionError::QuotaExceeded { result, .. }) => result.as_deref(),
            _ => None,
        }
    }

    /// Cluster: the URL of the node that has the session, when the operation
    /// belongs there (a front end forwards it; never shown to a client).
    pub fn moved_to(&self) -> Option<&str> {
        match self {
            RuntimeError::Session(SessionError::Elsewhere { owner, .. }) => Some(&owner.url),
            _ => None,
        }
    }

    /// For a failed session exec: the checkpoint seq the session was rolled back to (None: its initial state).
    pub fn rolled_back_to(&self) -> Option<Option<i64>> {
        match self {
            RuntimeError::Session(e) => e.rolled_back_to(),
            _ => None,
        }
    }
}
