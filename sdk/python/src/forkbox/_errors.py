"""Exceptions that mirror the API's errors (`{"error": {"code", "message"}}`).

Every error is a `ForkboxError` carrying the HTTP status, the API's machine
code and its message; the subclass is chosen by the code, so callers can catch
what they can handle (`except SessionBusy`) and let the rest propagate.
"""

from __future__ import annotations

from typing import Any


class ForkboxError(Exception):
    """An error returned by the forkbox API (or, with status 0, no answer from it)."""

    def __init__(self, status: int, code: str, message: str, *, body: dict[str, Any] | None = None):
        super().__init__(f"{code}: {message}" if code else message)
        self.status = status
        self.code = code
        self.message = message
        #: The whole `error` object of the response (may hold more fields, e.g. `checkpoint`).
        self.body = body or {}
        #: What a failed exec (timeout, crash, exit, ...) wrote before it failed; None for other errors.
        self.stdout: str | None = self.body.get("stdout")
        self.stderr: str | None = self.body.get("stderr")


class ConnectionFailed(ForkboxError):
    """The server could not be reached or the connection broke (status 0)."""


class InvalidRequest(ForkboxError):
    """400: malformed JSON or a request of the wrong shape or with bad values."""


class InvalidPath(InvalidRequest):
    """400 `invalid_path`: a file path that is not acceptable in the guest."""


class Unauthorized(ForkboxError):
    """401: no API key, or an unknown one."""


class Forbidden(ForkboxError):
    """403 `forbidden`: the key may not do this (e.g. read /metrics without being an admin key);
    also the base of `QuotaExceeded`."""


class QuotaExceeded(Forbidden):
    """403: the key's session or disk quota is used up (a session exec's `result` is in `body`)."""


class NotFound(ForkboxError):
    """404: no such endpoint (also the base of the other not-found errors)."""


class SessionNotFound(NotFound):
    """404: no such session for this key's tenant."""


class CheckpointNotFound(NotFound):
    """404: the session has no checkpoint with that number."""


class FileNotFound(NotFound):
    """404: no such file in the session."""


class TemplateNotFound(NotFound):
    """404: no template of that name (see the server's /v1/templates)."""


class KeyNotFound(NotFound):
    """404 `key_not_found`: no API key with that id (the admin key routes, `client.keys`)."""


class Timeout(ForkboxError, TimeoutError):
    """408: the code ran past its time limit (a session is rolled back to its last checkpoint).
    Also a `TimeoutError`, so `except TimeoutError` catches it."""


class SessionBusy(ForkboxError):
    """409: another exec is running in that session."""


class TemplateNotReady(SessionBusy):
    """409: the template is being built on first use; retry in a while (a 409 like `SessionBusy`)."""


class TemplateExists(SessionBusy):
    """409: a template of that name exists already (this tenant's, shipped, or shared by the server; a 409 like `SessionBusy`)."""


class FileExists(SessionBusy):
    """409: a file or directory of that name exists already in the session (a 409 like `SessionBusy`)."""


class PayloadTooLarge(ForkboxError):
    """413: the request body, the code or a file is over its size limit."""


class GuestError(ForkboxError):
    """422: the code took the sandbox down (crash, `os._exit`, killed after an interrupt)."""


class RateLimited(ForkboxError):
    """429: over the key's request rate; `retry_after` is the server's hint in seconds."""

    retry_after: float | None = None


class ServerError(ForkboxError):
    """5xx other than 503: a failure inside the server."""


class CpuMismatch(ServerError):
    """500: the template or checkpoint was made on a host with other CPU features."""


class Overloaded(ServerError):
    """503: every exec slot is busy and the wait queue is full; retry shortly."""


class StorageUnavailable(Overloaded):
    """503: the server's object store (where checkpoints live) is unreachable; a session exec's checkpoint
    was not committed (the session stays at its last checkpoint). Retry when it is back."""


class SessionMoved(Overloaded):
    """503: cluster: the session is moving between nodes (its node stopped or is draining, or lost the
    session while the exec ran: nothing was committed, the session stays at its last checkpoint); retry."""


class InsufficientStorage(ServerError):
    """507: the server's disk is full; nothing was written (the session stays at its last checkpoint)."""


class SandboxCrashed(ServerError):
    """502: the sandbox worker process running the exec died or hung; only that exec failed: retry."""


class StdinError(SessionBusy):
    """A background process' stdin cannot take the write: not started with `stdin=True`, closed,
    ended (`stdin_closed`), or 256 KiB unread for 5 s (`stdin_full`: nothing was written)."""


class PackageError(ForkboxError):
    """A package could not be installed into a session (`package_*` codes)."""


class PackageNotAllowed(PackageError, Forbidden):
    """403: the server's package policy refuses the package (or one of its dependencies)."""


class PackageNotFound(PackageError, NotFound):
    """404: no such package or version in the server's index or wheelhouse."""


class PackageConflict(PackageError, SessionBusy):
    """409: a file of the package is already in the session (nothing was installed; a 409 like `SessionBusy`)."""


class PackageNeedsBuild(PackageError, GuestError):
    """422: the package has no binary wheel for the guest, only an sdist (never built; a 422 like `GuestError`)."""


class PackageFailed(PackageError, ServerError):
    """502: the server's pip could not download or unpack the package."""


_BY_CODE: dict[str, type[ForkboxError]] = {
    "malformed_json": InvalidRequest,
    "invalid_request": InvalidRequest,
    "invalid_path": InvalidPath,
    "is_a_directory": InvalidPath,
    "unauthorized": Unauthorized,
    "quota_exceeded": QuotaExceeded,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "session_not_found": SessionNotFound,
    "checkpoint_not_found": CheckpointNotFound,
    "file_not_found": FileNotFound,
    "file_exists": FileExists,
    "process_not_found": NotFound,
    "stdin_closed": StdinError,
    "stdin_full": StdinError,
    "template_not_found": TemplateNotFound,
    "template_not_ready": TemplateNotReady,
    "template_exists": TemplateExists,
    "too_many_builds": RateLimited,
    "template_unavailable": ServerError,
    "package_not_allowed": PackageNotAllowed,
    "package_not_found": PackageNotFound,
    "key_not_found": KeyNotFound,
    "package_conflict": PackageConflict,
    "package_needs_build": PackageNeedsBuild,
    "package_failed": PackageFailed,
    "timeout": Timeout,
    "session_busy": SessionBusy,
    "cpu_mismatch": CpuMismatch,
    "payload_too_large": PayloadTooLarge,
    "code_too_large": PayloadTooLarge,
    "file_too_large": PayloadTooLarge,
    "instruction_not_found": NotFound,
    "method_not_allowed": InvalidRequest,
    "guest_crashed": GuestError,
    "guest_exited": GuestError,
    "guest_killed": GuestError,
    "sandbox_unusable": GuestError,
    "interrupted": GuestError,
    "deadlock": GuestError,
    "inspect_failed": GuestError,
    "upgrade_required": InvalidRequest,
    "rate_limited": RateLimited,
    "cpu_budget_exceeded": RateLimited,
    "internal": ServerError,
    "storage_error": ServerError,
    "protocol_error": ServerError,
    "boot_failed": ServerError,
    "sandbox_crashed": SandboxCrashed,
    "port_not_listening": ServerError,
    "overloaded": Overloaded,
    "storage_unavailable": StorageUnavailable,
    "session_moved": SessionMoved,
    "insufficient_storage": InsufficientStorage,
}

_BY_STATUS: dict[int, type[ForkboxError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    408: Timeout,
    409: SessionBusy,
    413: PayloadTooLarge,
    422: GuestError,
    429: RateLimited,
    503: Overloaded,
    507: InsufficientStorage,
}


#: The status the server sends with a code (for errors that arrive without one, in a stream).
#: The server's table is `forkbox_api::ErrorCode` (the `ErrorCode` schema of /v1/openapi.json,
#: `x-codes`); tests/python/test_sdk_errors.py checks that this one matches it.
STATUS_OF_CODE: dict[str, int] = {
    "malformed_json": 400, "invalid_request": 400, "invalid_path": 400, "is_a_directory": 400,
    "unauthorized": 401, "forbidden": 403, "quota_exceeded": 403, "not_found": 404, "session_not_found": 404,
    "checkpoint_not_found": 404, "instruction_not_found": 404, "file_not_found": 404, "process_not_found": 404,
    "file_exists": 409, "stdin_closed": 409, "stdin_full": 409,
    "template_not_found": 404, "template_not_ready": 409, "template_exists": 409,
    "template_unavailable": 500, "too_many_builds": 429,
    "package_not_allowed": 403, "package_not_found": 404, "key_not_found": 404, "package_conflict": 409, "package_needs_build": 422,
    "package_failed": 502, "sandbox_crashed": 502, "port_not_listening": 502,
    "method_not_allowed": 405, "timeout": 408, "session_busy": 409,
    "payload_too_large": 413, "code_too_large": 413, "file_too_large": 413, "guest_crashed": 422,
    "guest_exited": 422, "guest_killed": 422, "sandbox_unusable": 422, "interrupted": 422, "deadlock": 422,
    "inspect_failed": 422,
    "upgrade_required": 426, "rate_limited": 429, "cpu_budget_exceeded": 429, "internal": 500, "storage_error": 500,
    "protocol_error": 500, "boot_failed": 500, "cpu_mismatch": 500, "overloaded": 503,
    "storage_unavailable": 503, "session_moved": 503, "insufficient_storage": 507,
}


def error_from(status: int, body: Any, retry_after: str | None = None) -> ForkboxError:
    """The exception for an error response: by its code, else by its status (0: taken from the code)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = str(err.get("code") or "")
        message = str(err.get("message") or "")
    else:
        err, code, message = {}, "", (str(body)[:500] if body else f"HTTP {status}")
    if not status:
        status = STATUS_OF_CODE.get(code, 500)
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or (ServerError if status >= 500 else ForkboxError)
    e = cls(status, code, message, body=err)
    if isinstance(e, RateLimited) and retry_after:
        try:
            e.retry_after = float(retry_after)
        except ValueError:
            pass
    return e
