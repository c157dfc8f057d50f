#!/usr/bin/env python3
"""Tool-call latency of a session `exec` through MCP vs the plain HTTP API, same run.

Starts one `forkbox serve` on a fresh data directory (sharing the built
templates), then times N execs of the same small statement in a session each way:
  http-api     POST /v1/sessions/{id}/exec (httpx, keep-alive)
  mcp-http     the `exec` tool over streamable HTTP (/mcp of that server)
  mcp-stdio    the `exec` tool over stdio, `forkbox mcp --url` (MCP -> HTTP API)
  mcp-embedded the `exec` tool over stdio, `forkbox mcp` on its own data directory (in process)
and prints p50/p99/mean in ms. The MCP clients are the official MCP Python SDK.

Run: target/pyvenv/bin/python scripts/bench_mcp.py [-n 300]  (after cargo build --release -p forkbox)
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from conftest import fresh_home, forkbox_bin, shared_image  # noqa: E402
from mcp_helpers import http_session, stdio_session  # noqa: E402

CODE = "x += 1"


def start_server(home: Path):
    proc = subprocess.Popen([forkbox_bin(), "--home", str(home), "serve", "--listen", "127.0.0.1:0", "--image", shared_image()],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = key = None
    while url is None or key is None:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("forkbox serve did not start")
        url = url or (m.group(1) if (m := re.search(r"listening on (http://\S+)", line)) else None)
        key = key or (m.group(1) if (m := re.search(r"API key .*: (fbk_[0-9a-f]+)", line)) else None)
    return proc, url, key


def summary(name: str, samples: list[float]) -> str:
    s = sorted(samples)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"{name:<13} n={len(s):<4} p50 {p(0.50):6.2f} ms   p99 {p(0.99):6.2f} ms   mean {statistics.mean(s):6.2f} ms"


async def mcp_loop(session, n: int, warmup: int) -> list[float]:
    sid = (await session.call_tool("create_session", {})).structured_content["session_id"]
    await session.call_tool("exec", {"session_id": sid, "code": "x = 0"})
    out = []
    for i in range(warmup + n):
        t = time.perf_counter()
        r = await session.call_tool("exec", {"session_id": sid, "code": CODE})
        dt = (time.perf_counter() - t) * 1000
        assert not r.is_error, r.content
        if i >= warmup:
            out.append(dt)
    await session.call_tool("delete_session", {"session_id": sid})
    return out


def http_loop(url: str, key: str, n: int, warmup: int) -> list[float]:
    h = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=h, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        c.post(f"/v1/sessions/{sid}/exec", json={"code": "x = 0"}).raise_for_status()
        out = []
        for i in range(warmup + n):
            t = time.perf_counter()
            r = c.post(f"/v1/sessions/{sid}/exec", json={"code": CODE})
            dt = (time.perf_counter() - t) * 1000
            r.raise_for_status()
            if i >= warmup:
                out.append(dt)
        c.delete(f"/v1/sessions/{sid}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="forkbox-bench-mcp-") as d:
        proc, url, key = start_server(fresh_home(Path(d) / "serve"))
        embedded_home = fresh_home(Path(d) / "embedded")
        try:
            results = {}
            # Interleaved rounds, so drift on the shared machine hits every path alike.
            rounds = 3
            per = max(1, a.n // rounds)
            for _ in range(rounds):
                results.setdefault("http-api", []).extend(http_loop(url, key, per, a.warmup))

                async def mcp_http():
                    async with http_session(url, key) as s:
                        return await mcp_loop(s, per, a.warmup)

                async def mcp_stdio():
                    async with stdio_session(Path(d) / "serve", "--url", url, env={"FORKBOX_API_KEY": key}) as s:
                        return await mcp_loop(s, per, a.warmup)

                async def mcp_embedded():
                    async with stdio_session(embedded_home) as s:
                        return await mcp_loop(s, per, a.warmup)

                results.setdefault("mcp-http", []).extend(anyio.run(mcp_http))
                results.setdefault("mcp-stdio", []).extend(anyio.run(mcp_stdio))
                results.setdefault("mcp-embedded", []).extend(anyio.run(mcp_embedded))
            print(f"session exec of {CODE!r}, {per * rounds} calls each ({rounds} interleaved rounds, {a.warmup} warm-up calls per round):")
            for name, s in results.items():
                print(summary(name, s))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    os.environ.setdefault("FORKBOX_BIN", str(Path(__file__).resolve().parents[1] / "target" / "release" / "forkbox"))
    main()
