"""forkbox: a Python client of the forkbox HTTP API.

    from forkbox import Forkbox
    with Forkbox() as fb:            # $FORKBOX_URL, $FORKBOX_API_KEY
        s = fb.sessions.create()
        s.exec("x = 41")
        print(s.exec("x + 1").value)  # '42'
"""

from ._async import AsyncCommands, AsyncForkbox, AsyncKeys, AsyncSession, AsyncSessions
from ._errors import (
    CheckpointNotFound,
    ConnectionFailed,
    FileExists,
    FileNotFound,
    Forbidden,
    ForkboxError,
    GuestError,
    InsufficientStorage,
    SandboxCrashed,
    InvalidPath,
    InvalidRequest,
    KeyNotFound,
    NotFound,
    Overloaded,
    PackageConflict,
    PackageError,
    PackageFailed,
    PackageNeedsBuild,
    PackageNotAllowed,
    PackageNotFound,
    PayloadTooLarge,
    QuotaExceeded,
    RateLimited,
    ServerError,
    SessionBusy,
    CpuMismatch,
    SessionNotFound,
    StdinError,
    StorageUnavailable,
    SessionMoved,
    TemplateNotFound,
    TemplateNotReady,
    TemplateExists,
    Timeout,
    Unauthorized,
)
from ._sync import Commands, Forkbox, Keys, Session, Sessions
from ._tree import Branch, Explored, Variable
from ._types import (
    Checkpoint,
    CommandResult,
    Event,
    ExecResult,
    FileEntry,
    InstalledPackage,
    ListeningPort,
    MimeBundle,
    OutputFile,
    Packages,
    PortUrl,
    ProcessInfo,
    ProcessOutput,
    PythonError,
    Result,
    SessionInfo,
    Stderr,
    Stdout,
    Upload,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncCommands", "AsyncForkbox", "AsyncKeys", "AsyncSession", "AsyncSessions", "Commands", "Forkbox", "Keys",
    "Session", "Sessions",
    "Checkpoint", "CommandResult", "Event", "ExecResult", "FileEntry", "MimeBundle", "OutputFile", "PythonError", "Result", "SessionInfo",
    "Stderr", "Stdout", "Upload", "Branch", "Explored", "Variable",
    "ForkboxError", "ConnectionFailed", "InvalidRequest", "InvalidPath", "Unauthorized", "QuotaExceeded", "NotFound", "TemplateNotFound", "TemplateNotReady", "TemplateExists",
    "KeyNotFound",
    "SessionNotFound", "CheckpointNotFound", "FileNotFound", "FileExists", "Timeout", "SessionBusy", "CpuMismatch", "PayloadTooLarge",
    "GuestError", "RateLimited", "ServerError", "Overloaded", "Forbidden", "InsufficientStorage", "SandboxCrashed",
    "StorageUnavailable",
    "SessionMoved", "StdinError", "ProcessInfo", "ProcessOutput", "ListeningPort", "PortUrl",
    "InstalledPackage", "Packages", "PackageError", "PackageNotAllowed", "PackageNotFound", "PackageConflict",
    "PackageNeedsBuild", "PackageFailed",
]
