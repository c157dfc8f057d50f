"""Result types of the API, parsed from its JSON."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class PythonError:
    """An exception the code raised (not an API error: the exec itself succeeded)."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> PythonError:
        return cls(type=str(v.get("type", "")), message=str(v.get("message", "")), traceback=str(v.get("traceback", "")))


@dataclass(frozen=True)
class OutputFile:
    """A file the exec wrote under `/output`; `data` is None when it was too large to inline."""

    path: str
    size: int
    mime: str
    data: bytes | None = None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> OutputFile:
        b64 = v.get("base64")
        return cls(
            path=str(v.get("path", "")),
            size=int(v.get("size", 0)),
            mime=str(v.get("mime", "application/octet-stream")),
            data=base64.b64decode(b64) if isinstance(b64, str) else None,
        )


@dataclass(frozen=True)
class MimeBundle:
    """One displayed object (Jupyter's mime bundle): MIME type -> data. Text forms are
    str, images are decoded to bytes, `application/json` is the parsed JSON."""

    data: dict[str, Any]

    @property
    def text(self) -> str | None:
        return self.data.get("text/plain")

    @property
    def html(self) -> str | None:
        return self.data.get("text/html")

    @property
    def png(self) -> bytes | None:
        return self.data.get("image/png")

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> MimeBundle:
        out: dict[str, Any] = {}
        for mime, d in v.items():
            if mime.startswith("image/") and mime != "image/svg+xml" and isinstance(d, str):
                try:
                    out[mime] = base64.b64decode(d)
                except ValueError:
                    continue
            else:
                out[mime] = d
        return cls(data=out)


@dataclass(frozen=True)
class ExecResult:
    """What one exec produced."""

    #: repr() of the last expression, if the code ended with one that is not None.
    value: str | None
    stdout: str
    stderr: str
    error: PythonError | None
    runtime_ms: float
    #: The checkpoint this exec made (session execs only).
    checkpoint: int | None = None
    outputs: list[OutputFile] = field(default_factory=list)
    #: The value's rich forms beside `value` (text/html for a DataFrame, image/png for a PIL image).
    value_data: MimeBundle | None = None
    #: What display() showed and the matplotlib figures left open, in order.
    display: list[MimeBundle] = field(default_factory=list)
    #: The response as the server sent it (timings, counters).
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """True if the code raised no exception."""
        return self.error is None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> ExecResult:
        err = v.get("error")
        cp = v.get("checkpoint")
        return cls(
            value=v.get("value"),
            stdout=str(v.get("stdout") or ""),
            stderr=str(v.get("stderr") or ""),
            error=PythonError.from_json(err) if isinstance(err, dict) else None,
            runtime_ms=float(v.get("runtime_ms") or 0.0),
            checkpoint=int(cp) if isinstance(cp, int) else None,
            outputs=[OutputFile.from_json(o) for o in v.get("outputs") or [] if isinstance(o, dict)],
            value_data=MimeBundle.from_json(v["value_data"]) if isinstance(v.get("value_data"), dict) else None,
            display=[MimeBundle.from_json(d) for d in v.get("display") or [] if isinstance(d, dict)],
            raw=v,
        )


@dataclass(frozen=True)
class CommandResult:
    """What one command produced (`run_command`, `commands.run`)."""

    stdout: str
    stderr: str
    #: 0 success; 128 + N killed by signal N; 127 not found; 126 could not start; 130 interrupted.
    exit_code: int
    runtime_ms: float
    #: The checkpoint it made (session commands only).
    checkpoint: int | None = None
    outputs: list[OutputFile] = field(default_factory=list)
    #: The response as the server sent it (timings).
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """True if the command exited with status 0."""
        return self.exit_code == 0

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> CommandResult:
        cp = v.get("checkpoint")
        code = v.get("exit_code")
        return cls(
            stdout=str(v.get("stdout") or ""),
            stderr=str(v.get("stderr") or ""),
            exit_code=int(code) if isinstance(code, int) else -1,
            runtime_ms=float(v.get("runtime_ms") or 0.0),
            checkpoint=int(cp) if isinstance(cp, int) else None,
            outputs=[OutputFile.from_json(o) for o in v.get("outputs") or [] if isinstance(o, dict)],
            raw=v,
        )


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a session: the state after the exec of `code`."""

    seq: int
    parent: int | None
    code: str
    created_ms: int
    bytes: int
    pages: int
    #: True for the checkpoint the session is at.
    head: bool

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Checkpoint:
        return cls(
            seq=int(v["seq"]),
            parent=v.get("parent"),
            code=str(v.get("code", "")),
            created_ms=int(v.get("created_ms", 0)),
            bytes=int(v.get("bytes", 0)),
            pages=int(v.get("pages", 0)),
            head=bool(v.get("head", False)),
        )


@dataclass(frozen=True)
class FileEntry:
    """An entry of a directory listing in a session."""

    name: str
    path: str
    size: int
    is_dir: bool
    mtime_ms: int

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> FileEntry:
        return cls(
            name=str(v.get("name", "")),
            path=str(v.get("path", "")),
            size=int(v.get("size", 0)),
            is_dir=bool(v.get("is_dir", False)),
            mtime_ms=int(v.get("mtime_ms", 0)),
        )


@dataclass(frozen=True)
class Upload:
    """The answer to an upload: where the file is, its size, and the checkpoint that holds it."""

    path: str
    size: int
    checkpoint: int | None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Upload:
        return cls(path=str(v.get("path", "")), size=int(v.get("size", 0)), checkpoint=v.get("checkpoint"))


@dataclass(frozen=True)
class InstalledPackage:
    """One distribution of an install: `installed` is False when the session had it already."""

    name: str
    version: str
    wheel: str
    sha256: str
    installed: bool
    files: int

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> InstalledPackage:
        return cls(name=str(v.get("name", "")), version=str(v.get("version", "")), wheel=str(v.get("wheel", "")),
                   sha256=str(v.get("sha256", "")), installed=bool(v.get("installed")), files=int(v.get("files", 0)))


@dataclass(frozen=True)
class Packages:
    """The answer to `install_packages`: every distribution (dependencies too), pip-like output,
    and the checkpoint that records the install (None: nothing was new)."""

    packages: list[InstalledPackage]
    output: str
    checkpoint: int | None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Packages:
        return cls(packages=[InstalledPackage.from_json(p) for p in v.get("packages") or []],
                   output=str(v.get("output", "")), checkpoint=v.get("checkpoint"))


@dataclass(frozen=True)
class ProcessInfo:
    """A background process of a session (`Session.start_command`), with the processes it started."""

    pid: int
    #: Its argv after its last execve.
    argv: list[str]
    started_unix_ms: int
    cpu_seconds: float
    #: "running" or "exited".
    state: str
    #: How it ended: its exit status, or the signal that killed it.
    exit_code: int | None = None
    signal: int | None = None
    #: Bytes written so far (the session keeps the last 256 KiB of each stream).
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    @property
    def running(self) -> bool:
        return self.state == "running"

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> ProcessInfo:
        return cls(
            pid=int(v["pid"]),
            argv=[str(a) for a in v.get("argv") or []],
            started_unix_ms=int(v.get("started_unix_ms") or 0),
            cpu_seconds=float(v.get("cpu_seconds") or 0.0),
            state=str(v.get("state") or ""),
            exit_code=v.get("exit_code"),
            signal=v.get("signal"),
            stdout_bytes=int(v.get("stdout_bytes") or 0),
            stderr_bytes=int(v.get("stderr_bytes") or 0),
        )


@dataclass(frozen=True)
class ListeningPort:
    """A listening TCP socket inside a session's sandbox (`Session.ports`)."""

    port: int
    #: The address it is bound to inside the sandbox, e.g. "0.0.0.0", "127.0.0.1" or "::".
    address: str
    #: `Session.port_url(port)` reaches it (it takes connections to 127.0.0.1 or ::1).
    proxied: bool

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> ListeningPort:
        return cls(port=int(v["port"]), address=str(v.get("address") or ""), proxied=bool(v.get("proxied")))


@dataclass(frozen=True)
class PortUrl:
    """A signed, expiring URL of a port of a session (`Session.port_url`): no API key needed to use it."""

    url: str
    #: The `<port>-<session>.<domain>` form when the server has a sandbox domain, else None.
    host_url: str | None
    token: str
    #: RFC 3339.
    expires_at: str

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> PortUrl:
        return cls(url=str(v["url"]), host_url=v.get("host_url"), token=str(v.get("token") or ""),
                   expires_at=str(v.get("expires_at") or ""))


@dataclass(frozen=True)
class ProcessOutput:
    """A slice of a background process' stdout or stderr (`Session.process_output`)."""

    #: The stream offset of `data` (past the one asked for when those bytes were dropped).
    offset: int
    #: Where to read next.
    next_offset: int
    #: The stream's length so far.
    end: int
    #: Bytes dropped between the offset asked for and `offset`.
    dropped: int
    data: str
    #: It still runs: more may come.
    running: bool

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> ProcessOutput:
        return cls(
            offset=int(v["offset"]),
            next_offset=int(v["next_offset"]),
            end=int(v["end"]),
            dropped=int(v.get("dropped") or 0),
            data=str(v.get("data") or ""),
            running=bool(v.get("running")),
        )


@dataclass(frozen=True)
class Stdout:
    """A chunk the code wrote to standard output, as it was written."""

    data: str
    #: Following a background process: the stream offset of `data` (None for an exec's stream).
    offset: int | None = None


@dataclass(frozen=True)
class Stderr:
    """A chunk the code wrote to standard error, as it was written."""

    data: str
    #: Following a background process: the stream offset of `data` (None for an exec's stream).
    offset: int | None = None


@dataclass(frozen=True)
class Result:
    """The final event of a stream: the exec's result (a `CommandResult` for a command's stream)."""

    result: ExecResult | CommandResult


Event = Union[Stdout, Stderr, Result]


@dataclass
class SessionInfo:
    """A session's description as last seen from the server."""

    id: str
    tags: dict[str, str]
    created_ms: int
    last_used_ms: int
    resident: bool
    #: The checkpoint the session is at (None before its first exec).
    checkpoint: int | None
    #: `{"session", "checkpoint"}` it was forked from, until its first exec.
    forked_from: dict[str, Any] | None
    memory_mb: int
    timeout_seconds: float
    #: The effective egress policy: `{"mode", "layers"}` (server, API key, request).
    network: dict[str, Any] | None = None
    #: Its secrets (the key's, the template's and its own): `{"name", "hosts", "ports"?, "tls"?}`, never a value.
    secrets: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> SessionInfo:
        limits = v.get("limits") or {}
        return cls(
            id=str(v["id"]),
            tags=dict(v.get("tags") or {}),
            created_ms=int(v.get("created_ms", 0)),
            last_used_ms=int(v.get("last_used_ms", 0)),
            resident=bool(v.get("resident", False)),
            checkpoint=v.get("checkpoint"),
            forked_from=v.get("forked_from"),
            memory_mb=int(limits.get("memory_mb", 0)),
            timeout_seconds=float(limits.get("timeout_seconds", 0.0)),
            network=limits.get("network"),
            secrets=list(v.get("secrets") or []),
        )
