"""The SDK's configuration and resilience: $FORKBOX_URL / $FORKBOX_API_KEY, a clear error when
nothing is configured and nothing listens, per-exec `timeout=` (sessions too), `Timeout` as a
`TimeoutError`, and the optional retries of 429/503 that honour `Retry-After` (a real server's
rate limit, and a stub that answers 503 the way an overloaded server does)."""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import forkbox
from forkbox import AsyncForkbox, Forkbox
from forkbox import _base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env_supplies_url_and_key(server, monkeypatch):
    monkeypatch.setenv("FORKBOX_URL", server.url + "/")
    monkeypatch.setenv("FORKBOX_API_KEY", server.key)
    with Forkbox() as fb:
        assert fb.url == server.url
        assert fb.exec("6 * 7").value == "42"
    monkeypatch.setenv("FORKBOX_API_KEY", "fbk_wrong")
    with Forkbox() as fb, pytest.raises(forkbox.Unauthorized):
        fb.exec("1")


def test_nothing_configured_and_nothing_listening_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("FORKBOX_URL", raising=False)
    monkeypatch.delenv("FORKBOX_API_KEY", raising=False)
    # The default URL, moved to a port where nothing listens (8080 may be taken on this machine).
    monkeypatch.setattr(_base, "DEFAULT_URL", f"http://127.0.0.1:{free_port()}")
    with Forkbox() as fb, pytest.raises(forkbox.ConnectionFailed) as e:
        fb.exec("1")
    msg = str(e.value)
    assert "no forkbox server answers" in msg and "FORKBOX_URL" in msg and "forkbox serve" in msg, msg

    async def main():
        async with AsyncForkbox() as fb:
            with pytest.raises(forkbox.ConnectionFailed) as e:
                await fb.sessions.create()
            assert "FORKBOX_URL" in str(e.value)

    asyncio.run(main())
    # A URL that was given and does not answer names that URL, not the default.
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("FORKBOX_URL", url)
    with Forkbox() as fb, pytest.raises(forkbox.ConnectionFailed) as e:
        fb.exec("1")
    assert url in str(e.value) and "default" not in str(e.value)


def test_timeout_is_a_timeout_error_and_exec_takes_one(server):
    assert issubclass(forkbox.Timeout, TimeoutError) and issubclass(forkbox.Timeout, forkbox.ForkboxError)
    with Forkbox(server.url, server.key) as fb:
        with pytest.raises(TimeoutError) as e:
            fb.exec("while True: pass", timeout=0.5)
        assert isinstance(e.value, forkbox.Timeout) and e.value.code == "timeout" and e.value.status == 408
        with pytest.raises(forkbox.InvalidRequest):
            fb.exec("1", timeout=0)
        s = fb.sessions.create(timeout=30)
        try:
            s.exec("kept = 1")
            t0 = time.monotonic()
            with pytest.raises(forkbox.Timeout):
                s.exec("kept = 2\nwhile True: pass", timeout=1)
            assert time.monotonic() - t0 < 15, "the session's 30 s applied instead of timeout=1"
            assert s.exec("kept").value == "1"  # rolled back to the last checkpoint
            # The stream takes it too.
            with pytest.raises(forkbox.Timeout):
                for _ in s.stream("while True: pass", timeout=1):
                    pass
        finally:
            s.delete()


def test_async_session_exec_timeout(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create(timeout=30)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    await s.exec("while True: pass", timeout=1)
                assert time.monotonic() - t0 < 15
                assert (await s.exec("1 + 1", timeout=10)).value == "2"
            finally:
                await s.delete()

    asyncio.run(main())


def test_retries_honour_the_rate_limits_retry_after(server):
    key = server.create_key("sdk-retry", "--rate-limit", "1")
    with Forkbox(server.url, key) as fb:
        fb.sessions.list()
        with pytest.raises(forkbox.RateLimited) as e:
            fb.sessions.list()  # no retries by default
        assert e.value.retry_after >= 1
    time.sleep(1.1)
    with Forkbox(server.url, key, retries=3) as fb:
        t0 = time.monotonic()
        for _ in range(3):
            fb.sessions.list()
        # The bucket refills one request a second: the retries waited for it.
        assert time.monotonic() - t0 >= 1.5


class Stub:
    """An HTTP server that answers 503 `overloaded` (with `Retry-After`) `fail` times, then an exec result."""

    def __init__(self, fail: int, retry_after: str | None):
        self.fail, self.retry_after, self.hits = fail, retry_after, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                stub.hits.append(time.monotonic())
                if len(stub.hits) <= stub.fail:
                    body = json.dumps({"error": {"code": "overloaded", "message": "every exec slot is busy"}}).encode()
                    self.send_response(503)
                    if stub.retry_after is not None:
                        self.send_header("Retry-After", stub.retry_after)
                else:
                    body = json.dumps({"value": "2", "stdout": "", "stderr": "", "error": None, "runtime_ms": 1}).encode()
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_on_503_wait_retry_after_then_give_up():
    stub = Stub(fail=2, retry_after="0.3")
    try:
        with Forkbox(stub.url, "k", retries=2) as fb:
            assert fb.exec("1 + 1").value == "2"
        assert len(stub.hits) == 3
        assert all(b - a >= 0.28 for a, b in zip(stub.hits, stub.hits[1:])), stub.hits
    finally:
        stub.close()
    # Fewer retries than failures: the last 503 is raised.
    stub = Stub(fail=5, retry_after="0")
    try:
        with Forkbox(stub.url, "k", retries=2) as fb, pytest.raises(forkbox.Overloaded):
            fb.exec("1")
        assert len(stub.hits) == 3
    finally:
        stub.close()
    # A Retry-After longer than retry_max_delay is not waited for.
    stub = Stub(fail=1, retry_after="120")
    try:
        with Forkbox(stub.url, "k", retries=3, retry_max_delay=5) as fb:
            t0 = time.monotonic()
            with pytest.raises(forkbox.Overloaded):
                fb.exec("1")
            assert time.monotonic() - t0 < 2 and len(stub.hits) == 1
    finally:
        stub.close()
    # Without Retry-After: exponential backoff; async too.
    stub = Stub(fail=2, retry_after=None)
    try:
        async def main():
            async with AsyncForkbox(stub.url, "k", retries=2, retry_backoff=0.2) as fb:
                assert (await fb.exec("1 + 1")).value == "2"

        asyncio.run(main())
        assert len(stub.hits) == 3
        gaps = [b - a for a, b in zip(stub.hits, stub.hits[1:])]
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19, gaps  # 0.2 * 2**n, jittered down to half
    finally:
        stub.close()
    with pytest.raises(ValueError):
        Forkbox("http://127.0.0.1:1", retries=-1)
