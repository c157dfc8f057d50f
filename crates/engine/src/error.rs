use forkbox_api::ErrorCode;
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
    /// A host-side file operation failed; `code` is one of `FileNotFound`,
    /// `InvalidPath`, `IsADirectory`, `FileTooLarge`, `QuotaExceeded`.
    #[error("{message}")]
    File { code: ErrorCode, message: String },
    /// A package installed at run time could not be (`package_*` codes).
    #[error("{message}")]
    Package { code: ErrorCode, message: String },
    /// A failure a sandbox worker process reported for the exec it ran (its
    /// code, checked by the supervisor to be one an exec can have, and message).
    #[error("{message}")]
    Remote { code: ErrorCode, message: String },
    #[error(transparent)]
    Vmm(#[from] forkbox_vmm::VmmError),
    #[error(transparent)]
    Load(#[from] forkbox_linux::loader::LoadError),
    #[error(transparent)]
    Image(#[from] forkbox_image::ImageError),
    #[error(transparent)]
    Snapshot(#[from] forkbox_snapshot::StateError),
    /// No background job has that leader pid in the sandbox (it may have been
    /// dropped: a revert, a fork or a resume does not bring jobs back).
    #[error("no background process {0} in this sandbox")]
    NoSuchJob(u32),
    /// No listener of the sandbox takes connections to that port (the port proxy).
    #[error("nothing in the sandbox listens on port {0} (a server must listen on 127.0.0.1, ::1, 0.0.0.0 or ::)")]
    PortNotListening(u16),
    /// The listener on that port has its backlog (or the sandbox its sockets) full.
    #[error("the sandbox's server on port {0} takes no more connections now: {1}")]
    PortBusy(u16, String),
    /// What this kind of sandbox host cannot do (e.g. ports with `--isolation thread`).
    #[error("{0}")]
    Unsupported(String),
    #[error("signal {0} is not a signal number (1-64)")]
    BadSignal(i32),
    /// The job's stdin cannot be written: why.
    #[error("{0}")]
    StdinClosed(String),
    /// The job's stdin buffer had no room for the write in time.
    #[error("the stdin of background process {0} is full ({1} bytes unread): retry later")]
    StdinFull(u32, usize),
    /// The job was started without a terminal (a resize needs one).
    #[error("background process {0} was not started with a pty")]
    NotATerminal(u32),
    /// A store the engine was handed failed (a cluster's shared artifacts: a
    /// package layer a state mounts could not be fetched); `code` is
    /// `StorageUnavailable` or `StorageError`.
    #[error("{message}")]
    Storage { code: ErrorCode, message: String },
}

impl EngineError {
    /// The API's error code for this failure (its HTTP status comes with it).
    pub fn error_code(&self) -> ErrorCode {
        match self {
            EngineError::Timeout(_) => ErrorCode::Timeout,
            EngineError::GuestCrashed(_) => ErrorCode::GuestCrashed,
            EngineError::GuestExited(_) => ErrorCode::GuestExited,
            EngineError::GuestSignaled(_) => ErrorCode::GuestKilled,
            EngineError::Deadlock(_) => ErrorCode::Deadlock,
            EngineError::Poisoned(_) => ErrorCode::SandboxUnusable,
            EngineError::Protocol(_) => ErrorCode::ProtocolError,
            EngineError::Boot(_) => ErrorCode::BootFailed,
            EngineError::CodeTooLarge(..) => ErrorCode::CodeTooLarge,
            EngineError::Interrupted(_) => ErrorCode::Interrupted,
            EngineError::NoSuchJob(_) => ErrorCode::ProcessNotFound,
            EngineError::BadSignal(_) | EngineError::NotATerminal(_) => ErrorCode::InvalidRequest,
            EngineError::PortNotListening(_) => ErrorCode::PortNotListening,
            EngineError::PortBusy(..) => ErrorCode::Overloaded,
            EngineError::Unsupported(_) => ErrorCode::InvalidRequest,
            EngineError::StdinClosed(_) => ErrorCode::StdinClosed,
            EngineError::StdinFull(..) => ErrorCode::StdinFull,
            EngineError::File { code, .. }
            | EngineError::Package { code, .. }
            | EngineError::Remote { code, .. }
            | EngineError::Storage { code, .. } => *code,
            EngineError::Snapshot(e @ forkbox_snapshot::StateError::CpuMismatch(_)) => e.error_code(),
            EngineError::Vmm(_) | EngineError::Load(_) | EngineError::Image(_) | EngineError::Snapshot(_) => {
                ErrorCode::Internal
            }
        }
    }

    /// The wire name of [`Self::error_code`] (the CLI's JSON, tests).
    pub fn code(&self) -> &'static str {
        self.error_code().as_str()
    }
}

/// A thread's saved vCPU state that does not go back into the vCPU (its XSAVE
/// area has the wrong size): the guest cannot go on, a crash, not a panic.
impl From<forkbox_vmm::RegsError> for EngineError {
    fn from(e: forkbox_vmm::RegsError) -> EngineError {
        EngineError::GuestCrashed(format!("saved thread state: {e}"))
    }
}

impl From<forkbox_image::packages::PackageError> for EngineError {
    fn from(e: forkbox_image::packages::PackageError) -> EngineError {
        use forkbox_image::packages::PackageError as P;
        let code = match &e {
            P::Invalid(_) => ErrorCode::InvalidRequest,
            P::NotAllowed(_) => ErrorCode::PackageNotAllowed,
            P::NeedsBuild(_) => ErrorCode::PackageNeedsBuild,
            P::NotFound(_) => ErrorCode::PackageNotFound,
            P::Failed(_) => ErrorCode::PackageFailed,
            P::MissingLayer(_) => ErrorCode::StorageError,
            P::OverBudget(_) => ErrorCode::QuotaExceeded,
        };
        EngineError::Package { code, message: e.to_string() }
    }
}
