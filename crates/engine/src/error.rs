use thiserror::Error;

/// Why an exec or a sandbox failed (a Python exception is NOT an error: it is
/// a normal result with `error` set).
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("execution timed out after {0:.1} s")]
    Timeout(f64),
    #[error("the guest crashed: {0}")]
    GuestCrashed(String),
    #[error("the guest exited with status {0}")]
    GuestExited(i32),
    /// Every guest thread waits with no timeout for something only the guest could do.
    #[error("deadlock: {0}")]
    Deadlock(String),
    #[error("the guest was killed by signal {0}")]
    GuestSignaled(i32),
    #[error("the sandbox is no longer usable (an earlier exec failed: {0})")]
    Poisoned(String),
    #[error("agent protocol error: {0}")]
    Protocol(String),
    #[error("the guest failed to start: {0}")]
    Boot(String),
    #[error("code is {0} bytes, more than the {1}-byte limit")]
    CodeTooLarge(usize, usize),
    /// The exec was interrupted and did not get back to the agent in time (or
    /// could not take the signal): it was killed.
    #[error("the exec was interrupted and killed: {0}")]
    Interrupted(String),
    /// A host-side file operation failed; `code` is one of `file_not_found`,
    /// `invalid_path`, `is_a_directory`, `file_too_large`, `quota_exceeded`.
    #[error("{message}")]
    File { code: &'static str, message: String },
    #[error(transparent)]
    Vmm(#[from] forkbox_vmm::VmmError),
    #[error(transparent)]
    Load(#[from] forkbox_linux::loader::LoadError),
    #[error(transparent)]
    Image(#[from] forkbox_image::ImageError),
    #[error(transparent)]
    Snapshot(#[from] forkbox_snapshot::StateError),
}

impl EngineError {
    /// A stable machine-readable code (used by the CLI's JSON and later the API).
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Timeout(_) => "timeout",
            EngineError::GuestCrashed(_) => "guest_crashed",
            EngineError::GuestExited(_) => "guest_exited",
            EngineError::GuestSignaled(_) => "guest_killed",
            EngineError::Deadlock(_) => "deadlock",
            EngineError::Poisoned(_) => "sandbox_unusable",
            EngineError::Protocol(_) => "protocol_error",
            EngineError::Boot(_) => "boot_failed",
            EngineError::CodeTooLarge(..) => "code_too_large",
            EngineError::Interrupted(_) => "interrupted",
            EngineError::File { code, .. } => code,
            EngineError::Vmm(_) | EngineError::Load(_) | EngineError::Image(_) | EngineError::Snapshot(_) => "internal",
        }
    }
}
