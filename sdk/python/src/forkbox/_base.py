"""What the sync and the async client share: configuration, paths, response and SSE parsing."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, Union
from urllib.parse import quote

import httpx

from ._errors import ConnectionFailed, ForkboxError, error_from
from ._types import Event, ExecResult, Result, Stderr, Stdout

DEFAULT_URL = "http://127.0.0.1:8080"
#: Read timeout of a request: execs may legitimately run for minutes (the server caps them).
DEFAULT_HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)


def config(url: str | None, api_key: str | None) -> tuple[str, str | None, bool]:
    """The base URL and key: the arguments, else $FORKBOX_URL / $FORKBOX_API_KEY, else the local default;
    and whether the URL is that default (nothing configured it)."""
    given = url or os.environ.get("FORKBOX_URL")
    base = (given or DEFAULT_URL).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"forkbox URL must start with http:// or https://, got {base!r}")
    key = api_key if api_key is not None else os.environ.get("FORKBOX_API_KEY")
    return base, key or None, not given


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a request the server refused for load: 429 (`rate_limited`, `cpu_budget_exceeded`) and
    503 (`overloaded`). Such a request did not run, so retrying it (an exec too) is safe. Each wait is the
    response's `Retry-After` if it has one (a wait longer than `max_delay` is not waited for: the error is
    raised), else `backoff * 2**attempt` seconds with jitter, at most `max_delay`."""

    retries: int = 0
    backoff: float = 0.5
    max_delay: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_delay < 0:
            raise ValueError("retries, retry_backoff and retry_max_delay must not be negative")

    def delay(self, resp: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before retrying `resp`'s request (`attempt` retries made so far), or None: do not retry."""
        if resp.status_code not in (429, 503) or attempt >= self.retries:
            return None
        hint = resp.headers.get("retry-after")
        if hint is not None:
            try:
                wait = float(hint)
            except ValueError:
                wait = -1.0
            if wait >= 0:
                return wait if wait <= self.max_delay else None
        return min(self.max_delay, self.backoff * (2 ** attempt) * (0.5 + random.random() / 2))


def headers(api_key: str | None) -> dict[str, str]:
    h = {"User-Agent": "forkbox-python/0.1"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def seg(s: str) -> str:
    """One URL path segment (a session id)."""
    if not s:
        raise ValueError("empty id")
    return quote(s, safe="")


def file_path(path: str) -> str:
    """A guest path as the tail of a files URL (without its leading `/`)."""
    if not path or "\x00" in path:
        raise ValueError(f"invalid guest path {path!r}")
    # Dot segments are percent-encoded so that no URL library folds them away: the
    # server sees the path as given (and rejects what escapes) instead of another one.
    parts = [quote(p, safe="").replace(".", "%2E") if p in (".", "..") else quote(p, safe="") for p in path.lstrip("/").split("/")]
    return "/".join(parts)


# A sandbox's network policy, as the API takes it: "none", "public",
# {"allow": [rule, ...], "deny": [rule, ...]} (an allowlist), or
# {"mode": "none" | "public", "max_bytes_per_second": N} (a mode with a
# bandwidth limit; an allowlist may carry "max_bytes_per_second" too). It only
# narrows the server's and the API key's policy.
Network = Union[str, Mapping[str, Union[str, int, Sequence[str]]]]


def network_value(network: Network | None) -> Any:
    if network is None or isinstance(network, str):
        return network
    return {k: v if isinstance(v, (str, int)) else list(v) for k, v in network.items()}


# Secrets by environment variable name, as the API takes them:
# {"NAME": {"value": "...", "hosts": ["api.example.com"], "ports": [443], "tls": True}}.
# The sandbox's variable holds a placeholder; the server puts the value in the
# headers of HTTP requests to `hosts` (see the server's docs/network.md). The
# server never returns a value: it lists names and destinations.
Secrets = Mapping[str, Mapping[str, Any]]


def secrets_value(secrets: Secrets) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in secrets.items():
        out[name] = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in spec.items()}
    return out


def session_body(
    tags: Mapping[str, str] | None,
    memory_mb: int | None,
    timeout: float | None,
    network: Network | None = None,
    template: str | None = None,
    secrets: Secrets | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if secrets:
        body["secrets"] = secrets_value(secrets)
    if network is not None:
        body["network"] = network_value(network)
    if template is not None:
        body["template"] = template
    if tags:
        body["tags"] = dict(tags)
    if memory_mb is not None:
        body["memory_mb"] = memory_mb
    if timeout is not None:
        body["timeout_seconds"] = timeout
    return body


def exec_body(
    code: str, timeout: float | None, network: Network | None = None, template: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code}
    if network is not None:
        body["network"] = network_value(network)
    if template is not None:
        body["template"] = template
    if timeout is not None:
        body["timeout_seconds"] = timeout
    return body


def command_body(
    cmd: str | Sequence[str],
    cwd: str | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    template: str | None = None,
    network: Network | None = None,
) -> dict[str, Any]:
    """A command's body: a str is a shell command line (/bin/sh -c), a list of str an argv (no shell)."""
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if timeout is not None:
        body["timeout_seconds"] = timeout
    if template is not None:
        body["template"] = template
    if network is not None:
        body["network"] = network_value(network)
    return body


def tag_params(tags: Mapping[str, str] | None) -> list[tuple[str, str]]:
    return [("tag", f"{k}:{v}") for k, v in (tags or {}).items()]


def check(resp: httpx.Response) -> httpx.Response:
    """The response if it succeeded, else its error as an exception."""
    if resp.is_success:
        return resp
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    raise error_from(resp.status_code, body, resp.headers.get("retry-after"))


def batch_results(v: dict[str, Any]) -> list[ExecResult | ForkboxError]:
    """`/v1/exec/batch` results: an ExecResult, or the error of that exec (not raised)."""
    out: list[ExecResult | ForkboxError] = []
    for r in v.get("results") or []:
        if isinstance(r, dict) and "status" in r and isinstance(r.get("error"), dict) and "code" in r["error"]:
            out.append(error_from(int(r["status"]), r))
        else:
            out.append(ExecResult.from_json(r))
    return out


def connection_failed(e: httpx.HTTPError, url: str = "", default_url: bool = False) -> ConnectionFailed:
    if default_url and isinstance(e, httpx.ConnectError):
        return ConnectionFailed(0, "connection_error", (
            f"no forkbox server answers at {url}, the default URL (neither url= nor $FORKBOX_URL is set): "
            f"start one with `forkbox serve`, or pass url= / set FORKBOX_URL (and FORKBOX_API_KEY) ({e})"))
    where = f" to {url}" if url else ""
    return ConnectionFailed(0, "connection_error", f"connection{where} failed: {type(e).__name__}: {e}")


class SseParser:
    """Server-Sent Events from lines (https://html.spec.whatwg.org/multipage/server-sent-events.html)."""

    def __init__(self) -> None:
        self.event = ""
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        """One line (without its end); returns (event, data) when the line ends an event."""
        if line == "":
            if not self.data and not self.event:
                return None
            ev = (self.event or "message", "\n".join(self.data))
            self.event, self.data = "", []
            return ev
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


def json_event(name: str, data: str) -> dict[str, Any]:
    """The JSON data of an SSE event."""
    try:
        v = json.loads(data) if data else {}
    except ValueError as e:
        raise ForkboxError(0, "protocol_error", f"stream event {name!r} is not JSON: {e}") from e
    if not isinstance(v, dict):
        raise ForkboxError(0, "protocol_error", f"stream event {name!r} is not a JSON object")
    return v


def stream_event(name: str, data: str, result: type = ExecResult) -> Event | None:
    """The SDK event for one SSE event; an `error` event is raised."""
    try:
        v = json.loads(data) if data else {}
    except ValueError as e:
        raise ForkboxError(0, "protocol_error", f"stream event {name!r} is not JSON: {e}") from e
    if name == "stdout":
        return Stdout(str(v.get("data", "")))
    if name == "stderr":
        return Stderr(str(v.get("data", "")))
    if name == "result":
        return Result(result.from_json(v))
    if name == "error":
        raise error_from(0, v)
    return None  # unknown events are ignored, as SSE clients do


def template_body(
    name: str,
    apt: Sequence[str] | None,
    pip: Sequence[str] | None,
    preload: str | None,
    blas: str | None,
    network: Network | None = None,
    secrets: Secrets | None = None,
) -> dict[str, Any]:
    """The body of `POST /v1/templates`."""
    body: dict[str, Any] = {"name": name}
    if apt:
        body["apt"] = list(apt)
    if pip:
        body["pip"] = list(pip)
    if preload is not None:
        body["preload"] = preload
    if blas is not None:
        body["blas"] = blas
    if network is not None:
        body["network"] = network_value(network)
    if secrets:
        body["secrets"] = secrets_value(secrets)
    return body


#: The limits `POST /v1/admin/keys` takes (those not given: the server's defaults; `unlimited`: none but these).
KEY_LIMITS = ("rate_limit", "max_sessions", "max_disk_mb", "max_concurrency", "cpu_seconds_per_hour",
              "max_timeout_seconds", "unlimited")


def key_body(
    tenant: str,
    admin: bool,
    secrets: Secrets | None,
    limits: Mapping[str, Any] | None,
    egress: Network | None,
) -> dict[str, Any]:
    """The body of `POST /v1/admin/keys`."""
    body: dict[str, Any] = {"tenant": tenant}
    if admin:
        body["admin"] = True
    if secrets:
        body["secrets"] = secrets_value(secrets)
    if limits:
        unknown = sorted(set(limits) - set(KEY_LIMITS))
        if unknown:
            raise ValueError(f"unknown key limits {unknown} (known: {', '.join(KEY_LIMITS)})")
        body["limits"] = dict(limits)
    if egress is not None:
        body["egress"] = network_value(egress)
    return body


def key_page_params(after: str | None, limit: int | None, tenant: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if after:
        params["after"] = after
    if limit is not None:
        params["limit"] = int(limit)
    if tenant is not None:
        params["tenant"] = tenant
    return params


def template_done(name: str, t: dict[str, Any]) -> dict[str, Any] | None:
    """The template once its build is over (raises if it failed); None while it builds."""
    status = t.get("status")
    if status == "building":
        return None
    if status == "failed":
        raise ForkboxError(500, "template_unavailable", f"template {name} failed to build: {t.get('error')}", body=t)
    return t
