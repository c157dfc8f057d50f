"""The blocking client (httpx.Client). Generated from `_async.py` by `sdk/python/gen_sync.py`: edit that file, not this one."""

from __future__ import annotations

import base64
import time
from time import sleep
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from . import _base, _tree
from ._errors import ForkboxError
from ._types import (
    Checkpoint,
    CommandResult,
    Event,
    ExecResult,
    FileEntry,
    ListeningPort,
    Packages,
    PortUrl,
    ProcessInfo,
    ProcessOutput,
    Result,
    SessionInfo,
    Stderr,
    Stdout,
    Upload,
)


class Forkbox:
    """A client of a forkbox server (`AsyncForkbox`: its methods are awaitable; `Forkbox`: they block).

    `url` and `api_key` default to $FORKBOX_URL and $FORKBOX_API_KEY. Use it as a
    context manager (`async with` for `AsyncForkbox`), or call `close()`, to release its connections.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        http_timeout: httpx.Timeout | float | None = None,
        retries: int = 0,
        retry_backoff: float = 0.5,
        retry_max_delay: float = 30.0,
    ):
        self.url, self._key, self._default_url = _base.config(url, api_key)
        self._retry = _base.RetryPolicy(retries, retry_backoff, retry_max_delay)
        self._http = httpx.Client(
            base_url=self.url, headers=_base.headers(self._key), timeout=http_timeout or _base.DEFAULT_HTTP_TIMEOUT
        )
        self.sessions = Sessions(self)
        self.commands = Commands(self)
        self.keys = Keys(self)

    def __enter__(self) -> Forkbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = self._http.request(method, path, **kw)
            except httpx.HTTPError as e:
                raise _base.connection_failed(e, self.url, self._default_url) from e
            delay = self._retry.delay(resp, attempt)
            if delay is None:
                return _base.check(resp)
            attempt += 1
            sleep(delay)

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (self._send(method, path, **kw)).json()

    def exec(
        self, code: str, timeout: float | None = None, network: _base.Network | None = None, template: str | None = None
    ) -> ExecResult:
        """Run `code` in a fresh sandbox forked from the warm template; `network` narrows its egress policy; `template` names the template."""
        return ExecResult.from_json(self._json("POST", "/v1/exec", json=_base.exec_body(code, timeout, network, template)))

    def templates(self) -> list[dict[str, Any]]:
        """The templates this caller may use (shipped, the server's shared ones, its own) and their state."""
        return list(self._json("GET", "/v1/templates")["templates"])

    def template(self, name: str) -> dict[str, Any]:
        """One template: `status` (`building` with `progress`, `ready`, `failed` with `error`), `image_bytes`, `pip`, ..."""
        return dict(self._json("GET", f"/v1/templates/{_base.seg(name)}"))

    def create_template(
        self,
        name: str,
        *,
        apt: Sequence[str] | None = None,
        pip: Sequence[str] | None = None,
        preload: str | None = None,
        blas: str | None = None,
        network: _base.Network | None = None,
        secrets: _base.Secrets | None = None,
        wait: bool = True,
        poll: float = 1.0,
        timeout: float = 1800.0,
    ) -> dict[str, Any]:
        """Build a template of your own (Debian packages, pip binary wheels, a preload, a `network` policy that
        every sandbox forked from it gets, narrowing the server's and the key's; `secrets` every sandbox forked
        from it gets, `{"NAME": {"value", "hosts", "ports"?, "tls"?}}`, shown back as names and destinations only);
        with `wait`, poll until it is ready (raises `ForkboxError` if the build failed or took longer than `timeout`)."""
        body = _base.template_body(name, apt, pip, preload, blas, network, secrets)
        t = dict(self._json("POST", "/v1/templates", json=body))
        deadline = time.monotonic() + timeout
        while wait:
            done = _base.template_done(name, t)
            if done is not None:
                return done
            if time.monotonic() > deadline:
                raise ForkboxError(0, "timeout", f"template {name} still building after {timeout:.0f} s")
            sleep(poll)
            t = self.template(name)
        return t

    def exec_batch(self, codes: Sequence[str], timeout: float | None = None) -> list[ExecResult | ForkboxError]:
        """Run each code in its own sandbox, in parallel; an exec that failed is its error (not raised)."""
        body: dict[str, Any] = {"codes": list(codes)}
        if timeout is not None:
            body["timeout_seconds"] = timeout
        return _base.batch_results(self._json("POST", "/v1/exec/batch", json=body))

    def stream(self, code: str, timeout: float | None = None, network: _base.Network | None = None) -> Iterator[Event]:
        """Run `code` in a fresh sandbox; yields its output as it is produced, then its `Result`."""
        return self._stream("/v1/exec/stream", _base.exec_body(code, timeout, network))

    def _stream(self, path: str, body: dict[str, Any], result: type = ExecResult) -> Iterator[Event]:
        attempt = 0
        try:
            while True:
                with self._http.stream("POST", path, json=body, headers={"Accept": "text/event-stream"}) as resp:
                    if not resp.is_success:
                        resp.read()
                        delay = self._retry.delay(resp, attempt)
                        if delay is not None:
                            attempt += 1
                            sleep(delay)
                            continue
                        _base.check(resp)
                    parser = _base.SseParser()
                    for line in resp.iter_lines():
                        ev = parser.feed(line)
                        if ev is None:
                            continue
                        e = _base.stream_event(*ev, result=result)
                        if e is not None:
                            yield e
                            if isinstance(e, Result):
                                return
                    break
        except httpx.HTTPError as e:
            raise _base.connection_failed(e, self.url, self._default_url) from e
        raise ForkboxError(0, "protocol_error", "the stream ended without a result")


class Commands:
    """`client.commands`: shell commands in a fresh sandbox (nothing persists)."""

    def __init__(self, client: Forkbox):
        self._c = client

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        template: str | None = None,
        network: _base.Network | None = None,
    ) -> CommandResult:
        """Run `cmd` (a str: a shell command line for /bin/sh -c; a list: an argv, no shell) in a fresh sandbox.
        A non-zero exit code is a result (`result.exit_code`), not an exception. `network` narrows its egress policy."""
        body = _base.command_body(cmd, cwd, env, timeout, template, network)
        return CommandResult.from_json(self._c._json("POST", "/v1/commands", json=body))

    def stream(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        template: str | None = None,
        network: _base.Network | None = None,
    ) -> Iterator[Event]:
        """`run`, yielding `Stdout`/`Stderr` chunks as produced, then one `Result` (a `CommandResult`)."""
        return self._c._stream("/v1/commands/stream", _base.command_body(cmd, cwd, env, timeout, template, network), CommandResult)


class Keys:
    """`client.keys`: the server's API keys (for an admin key; another gets `Forbidden`). A key is named by its
    id, the SHA-256 of the key (not a credential); the key itself is returned once, by `create`. Each key is a
    dict: `id`, `tenant`, `admin`, `created_ms`, `limits` (null: none), `egress` (if it has its own policy),
    `secrets` (names and destinations, never values)."""

    def __init__(self, client: Forkbox):
        self._c = client

    def create(
        self,
        tenant: str = "default",
        *,
        admin: bool = False,
        secrets: _base.Secrets | None = None,
        limits: Mapping[str, Any] | None = None,
        egress: _base.Network | None = None,
    ) -> dict[str, Any]:
        """A new key for `tenant`: the returned dict's `key` is the key itself (shown this once). `limits`:
        `rate_limit`, `max_sessions`, `max_disk_mb`, `max_concurrency`, `cpu_seconds_per_hour`,
        `max_timeout_seconds` (those not given: the server's defaults) and `unlimited`; `egress`: its egress
        policy, as a session's `network`; `secrets`: what every sandbox of the key gets."""
        body = _base.key_body(tenant, admin, secrets, limits, egress)
        return dict(self._c._json("POST", "/v1/admin/keys", json=body))

    def get(self, id: str) -> dict[str, Any]:
        """The key with this id (`KeyNotFound` if none)."""
        return dict(self._c._json("GET", f"/v1/admin/keys/{_base.seg(id)}"))

    def patch(self, id: str, *, secrets: _base.Secrets) -> dict[str, Any]:
        """Replace the key's secrets (all of them: `{}` removes every one). New sandboxes of the key get them;
        sessions made before keep theirs."""
        body = {"secrets": _base.secrets_value(secrets)}
        return dict(self._c._json("PATCH", f"/v1/admin/keys/{_base.seg(id)}", json=body))

    def page(self, after: str | None = None, limit: int | None = None, tenant: str | None = None) -> dict[str, Any]:
        """One page of the keys in the order of their ids: `{"keys": [...], "next": id or None}`; pass `next`
        as `after` for the following page. `limit`: 1 to 1000 (default 1000)."""
        return dict(self._c._json("GET", "/v1/admin/keys", params=_base.key_page_params(after, limit, tenant)))

    def list(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every key (of `tenant`, if given), page after page."""
        out: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            p = self.page(after, None, tenant)
            out.extend(p.get("keys") or [])
            after = p.get("next")
            if not after:
                return out

    def delete(self, id: str) -> None:
        """Revoke the key: it stops working at once (within a second on the other nodes of a cluster). Its
        tenant's sessions stay. `KeyNotFound` if there is no such key."""
        self._c._send("DELETE", f"/v1/admin/keys/{_base.seg(id)}")


class Sessions:
    """`client.sessions`: create, list and look up sessions."""

    def __init__(self, client: Forkbox):
        self._c = client

    def create(
        self,
        tags: Mapping[str, str] | None = None,
        memory_mb: int | None = None,
        timeout: float | None = None,
        network: _base.Network | None = None,
        template: str | None = None,
        secrets: _base.Secrets | None = None,
    ) -> Session:
        """A new session; `timeout` is its per-exec time limit in seconds; `network` narrows its egress policy;
        `secrets` (`{"NAME": {"value", "hosts", "ports"?, "tls"?}}`) are placeholders in its environment that the
        server replaces with the values in HTTP headers sent to their hosts."""
        body = _base.session_body(tags, memory_mb, timeout, network, template, secrets)
        v = self._c._json("POST", "/v1/sessions", json=body)
        return Session(self._c, SessionInfo.from_json(v))

    def list(self, tags: Mapping[str, str] | None = None) -> list[Session]:
        """This key's sessions (only those with all of `tags`, if given)."""
        v = self._c._json("GET", "/v1/sessions", params=_base.tag_params(tags))
        return [Session(self._c, SessionInfo.from_json(s)) for s in v.get("sessions") or []]

    def get(self, id: str) -> Session:
        return Session(self._c, SessionInfo.from_json(self._c._json("GET", f"/v1/sessions/{_base.seg(id)}")))


class Session:
    """A stateful Python REPL on the server; every exec makes a checkpoint."""

    def __init__(self, client: Forkbox, info: SessionInfo):
        self._c = client
        #: What the server last said about this session (refreshed by `refresh`, `revert`).
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.info.id!r}, checkpoint={self.info.checkpoint})"

    def _path(self, tail: str = "") -> str:
        return f"/v1/sessions/{_base.seg(self.info.id)}{tail}"

    def refresh(self) -> Session:
        self.info = SessionInfo.from_json(self._c._json("GET", self._path()))
        return self

    def exec(self, code: str, timeout: float | None = None) -> ExecResult:
        """Run `code` in the session; `result.checkpoint` is the checkpoint it made. `timeout`: this exec's
        time limit in seconds (default: the session's; the server bounds it by its maximum)."""
        r = ExecResult.from_json(self._c._json("POST", self._path("/exec"), json=_base.exec_body(code, timeout)))
        self.info.checkpoint = r.checkpoint
        return r

    def stream(self, code: str, timeout: float | None = None) -> Iterator[Event]:
        """Run `code` in the session; yields `Stdout`/`Stderr` chunks as produced, then one `Result`."""
        return self._c._stream(self._path("/exec/stream"), _base.exec_body(code, timeout))

    def run_command(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run `cmd` in the session's file system (a str: a shell command line for /bin/sh -c; a list: an argv,
        no shell); like an exec it makes a checkpoint (`result.checkpoint`). A non-zero exit code is a result."""
        body = _base.command_body(cmd, cwd, env, timeout)
        r = CommandResult.from_json(self._c._json("POST", self._path("/commands"), json=body))
        self.info.checkpoint = r.checkpoint
        return r

    def stream_command(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[Event]:
        """`run_command`, yielding `Stdout`/`Stderr` chunks as produced, then one `Result` (a `CommandResult`)."""
        return self._c._stream(self._path("/commands/stream"), _base.command_body(cmd, cwd, env, timeout), CommandResult)

    def start_command(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        timeout: float | None = None,
    ) -> ProcessInfo:
        """Start `cmd` as a background process of the session and return at once: it runs on between
        calls (`processes`, `process_output`, `follow`, `write_stdin`, `signal`, `wait_process`). With
        `stdin=True` its stdin is what `write_stdin` sends (else /dev/null). A command that cannot start
        (not found, bad cwd) raises `ForkboxError` with code `command_not_started` and its exit status."""
        body = _base.command_body(cmd, cwd, env, timeout)
        body["background"] = True
        if stdin:
            body["stdin"] = True
        v = self._c._json("POST", self._path("/commands"), json=body)
        if "process" not in v:
            r = CommandResult.from_json(v)
            raise ForkboxError(200, "command_not_started", f"exit status {r.exit_code}: {r.stderr.strip()}", body=v)
        return ProcessInfo.from_json(v["process"])

    def processes(self) -> list[ProcessInfo]:
        """The session's background processes, oldest first (ended ones too, until 64 are kept)."""
        v = self._c._json("GET", self._path("/processes"))
        return [ProcessInfo.from_json(p) for p in v.get("processes") or []]

    def ports(self) -> list[ListeningPort]:
        """What listens inside the sandbox now, by port (empty while the session is paused or on disk:
        its listeners come back when a request resumes it)."""
        v = self._c._json("GET", self._path("/ports"))
        return [ListeningPort.from_json(p) for p in v.get("ports") or []]

    def port_url(self, port: int, expires_in: int | None = None) -> PortUrl:
        """A signed URL of `port` inside the sandbox (HTTP, SSE and WebSocket through the server), valid for
        `expires_in` seconds (the server's default when None); anyone holding it reaches that port only."""
        body = {} if expires_in is None else {"expires_in": int(expires_in)}
        return PortUrl.from_json(self._c._json("POST", self._path(f"/ports/{int(port)}/url"), json=body))

    def process(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_json(self._c._json("GET", self._path(f"/processes/{int(pid)}")))

    def process_output(
        self, pid: int, stream: str = "stdout", offset: int = 0, max: int | None = None
    ) -> ProcessOutput:
        """What a background process wrote to `stream` from byte `offset` (the last 256 KiB are kept;
        `dropped` says how much before them is gone); read on from `next_offset`."""
        params: dict[str, Any] = {"stream": stream, "offset": offset}
        if max is not None:
            params["max"] = max
        v = self._c._json("GET", self._path(f"/processes/{int(pid)}/output"), params=params)
        return ProcessOutput.from_json(v)

    def follow(
        self, pid: int, offset: int = 0, stderr_offset: int = 0, stream: str | None = None
    ) -> Iterator[Stdout | Stderr | ProcessInfo]:
        """A background process' output as it is written (`Stdout`/`Stderr` with their stream offsets),
        then its `ProcessInfo` when it ends. `stream`: only "stdout" or "stderr" (from `offset`)."""
        params: dict[str, Any] = {"follow": "true", "offset": offset}
        if stream is not None:
            params["stream"] = stream
        else:
            params["stderr_offset"] = stderr_offset
        try:
            with self._c._http.stream("GET", self._path(f"/processes/{int(pid)}/output"), params=params,
                                            headers={"Accept": "text/event-stream"}) as resp:
                if not resp.is_success:
                    resp.read()
                    _base.check(resp)
                parser = _base.SseParser()
                for line in resp.iter_lines():
                    ev = parser.feed(line)
                    if ev is None:
                        continue
                    name, data = ev
                    if name == "exit":
                        yield ProcessInfo.from_json(_base.json_event(name, data))
                        return
                    if name in ("stdout", "stderr"):
                        v = _base.json_event(name, data)
                        kind = Stdout if name == "stdout" else Stderr
                        yield kind(str(v.get("data", "")), int(v.get("offset") or 0))
                    elif name == "error":
                        raise _base.error_from(0, _base.json_event(name, data))
        except httpx.HTTPError as e:
            raise _base.connection_failed(e, self._c.url, self._c._default_url) from e
        raise ForkboxError(0, "protocol_error", "the stream ended before the process did")

    def write_stdin(self, pid: int, data: bytes | str, eof: bool = False) -> ProcessInfo:
        """Write to a background process' stdin (started with `stdin=True`); `eof` closes it after.
        A process that does not read holds 256 KiB; past that the write waits up to 5 s, then `StdinError`."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        body: dict[str, Any] = {"data_b64": base64.b64encode(content).decode(), "eof": eof}
        return ProcessInfo.from_json(self._c._json("POST", self._path(f"/processes/{int(pid)}/stdin"), json=body))

    def close_stdin(self, pid: int) -> ProcessInfo:
        """End of file for a background process' stdin."""
        return self.write_stdin(pid, b"", eof=True)

    def signal(self, pid: int, signal: int = 15) -> ProcessInfo:
        """Send `signal` (default SIGTERM) to a background process and the processes it started."""
        v = self._c._json("POST", self._path(f"/processes/{int(pid)}/signal"), json={"signal": signal})
        return ProcessInfo.from_json(v)

    def kill(self, pid: int) -> ProcessInfo:
        """SIGKILL to a background process and the processes it started."""
        return self.signal(pid, 9)

    def wait_process(self, pid: int, timeout: float = 10) -> ProcessInfo:
        """Wait at most `timeout` seconds (the server's maximum: 60) for a background process to end;
        it as it is then (`state` says whether it ended)."""
        v = self._c._json("POST", self._path(f"/processes/{int(pid)}/wait"), json={"timeout_seconds": timeout},
                                timeout=timeout + 30)
        return ProcessInfo.from_json(v)

    def interrupt(self) -> bool:
        """Interrupt the running exec (the code gets KeyboardInterrupt); False if none was running."""
        return bool((self._c._json("POST", self._path("/interrupt"))).get("interrupted"))

    def upload(self, path: str, data: bytes | str) -> Upload:
        """Write a file into the session (parents created); makes a checkpoint."""
        content = data.encode() if isinstance(data, str) else data
        v = self._c._json("PUT", self._path(f"/files/{_base.file_path(path)}"), content=content,
                          headers={"Content-Type": "application/octet-stream"})
        return Upload.from_json(v)

    def download(self, path: str) -> bytes:
        """The contents of a file in the session."""
        return (self._c._send("GET", self._path(f"/files/{_base.file_path(path)}"))).content

    def files(self, dir: str = "/output") -> list[FileEntry]:
        """The entries of a directory in the session."""
        v = self._c._json("GET", self._path("/files"), params={"dir": dir})
        return [FileEntry.from_json(f) for f in v.get("files") or []]

    def checkpoints(self) -> list[Checkpoint]:
        v = self._c._json("GET", self._path("/checkpoints"))
        return [Checkpoint.from_json(c) for c in v.get("checkpoints") or []]

    def install_packages(self, *packages: str) -> Packages:
        """`pip install` into the session, served by the server (binary wheels from its index or
        wheelhouse, under its allow/deny list): e.g. `s.install_packages("requests>=2")`. The next
        exec imports them; they stay across eviction and in forks. A line `%pip install X` in exec
        code does the same."""
        return Packages.from_json(self._c._json("POST", self._path("/packages"), json={"packages": list(packages)}))

    def revert(self, n: int) -> Session:
        """Move the session back to checkpoint `n` (its later state is gone from the session)."""
        self.info = SessionInfo.from_json(self._c._json("POST", self._path("/revert"), json={"checkpoint": n}))
        return self

    def fork(self, n: int | None = None, tags: Mapping[str, str] | None = None) -> Session:
        """A new session starting from checkpoint `n` of this one (default: its latest)."""
        body: dict[str, Any] = {}
        if n is not None:
            body["checkpoint"] = n
        if tags:
            body["tags"] = dict(tags)
        return Session(self._c, SessionInfo.from_json(self._c._json("POST", self._path("/fork"), json=body)))

    def to_template(self, n: int, name: str) -> dict[str, Any]:
        """A template of your own from checkpoint `n` of this session (its variables, imports, data, files):
        execs and new sessions on `name` start from that state; it outlives the session."""
        return dict(self._c._json("POST", self._path(f"/checkpoints/{int(n)}/template"), json={"name": name}))

    def tree(self) -> dict[str, Any]:
        """The session's tree: `nodes` (checkpoint, parent, session, code, summary, bytes, head, heads),
        `edges`, `sessions` (its forks and the session it came from, each with head and forked_at), `head`."""
        return self._c._json("GET", self._path("/tree"))

    def explore(
        self,
        codes: Sequence[str],
        checkpoint: int | None = None,
        keep: _tree.Keep = "none",
        timeout: float | None = None,
    ) -> _tree.Explored:
        """Try alternatives in parallel: each code runs in its own fork of `checkpoint` (default: the head).
        Results come back in order; `keep` ("none", "all" or indices) makes branches sessions. This
        session is not paused or changed."""
        body = _tree.explore_body(codes, checkpoint, keep, timeout)
        return _tree.explored(self._c._json("POST", self._path("/explore"), json=body))

    def variables(self, n: int) -> list[_tree.Variable]:
        """The variables at checkpoint `n` (name, type, short repr, size), read in a throwaway fork."""
        return _tree.variables(self._c._json("GET", self._path(f"/checkpoints/{int(n)}/variables")))

    def diff(self, a: int, b: int | None = None) -> dict[str, Any]:
        """What changed from checkpoint `a` to `b` (default: the head): variables_added/removed/changed,
        files_added/removed/changed (with sizes), `calls` (and `undone`) on the path between them."""
        return self._c._json("GET", self._path("/diff"), params=_tree.diff_params(a, b))

    def delete(self) -> None:
        self._c._send("DELETE", self._path())
