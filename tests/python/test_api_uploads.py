"""File uploads (`PUT /v1/sessions/{id}/files/...`) on the real `forkbox serve`:
the body is streamed to a temporary file as it arrives and from there into the
sandbox, so concurrent uploads do not multiply in the API process's memory
(read from /proc: its peak RSS, reset before the uploads); an upload over the
size limit is refused without reading it all; one key has at most a few
uploads in progress (429 `rate_limited` past them); paths with `..` or under
/proc, /sys, /dev are refused with 400 `invalid_path`.
"""

import concurrent.futures
import hashlib
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import start_server, stop_server

MIB = 1 << 20
UPLOAD = 64 * MIB  # the server's default file size limit
UPLOADS = 8


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_rss(pid: int):
    # "5" resets VmHWM to the current RSS (proc(5), clear_refs).
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def pattern(seed: int) -> bytes:
    return hashlib.sha256(bytes([seed])).digest() * (MIB // 32)


def body(seed: int, size: int):
    chunk = pattern(seed)
    for _ in range(size // MIB):
        yield chunk


def sha_of(seed: int, size: int) -> str:
    h = hashlib.sha256()
    for c in body(seed, size):
        h.update(c)
    return h.hexdigest()


def new_session(s, key: str) -> str:
    r = requests.post(f"{s.url}/v1/sessions", headers=s.headers(key), json={}, timeout=120)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    r = requests.post(f"{s.url}/v1/sessions/{sid}/exec", headers=s.headers(key), json={"code": "1"}, timeout=120)
    assert r.status_code == 200, r.text
    return sid


HASH_CODE = """
import hashlib
h = hashlib.sha256()
with open('/data/big.bin', 'rb') as f:
    for c in iter(lambda: f.read(1 << 20), b''):
        h.update(c)
h.hexdigest()
"""


@pytest.mark.parametrize("isolation,allowance_mib", [
    # Sandboxes in the tenant's worker process: nothing of a file stays here.
    ("process", 160),
    # Sandboxes on the server's own threads: each resident session's file
    # system holds its file (one copy, charged to its disk quota), nothing more.
    ("thread", 160 + UPLOADS * UPLOAD // MIB),
])
def test_concurrent_uploads_keep_the_api_memory_bounded(isolation, allowance_mib):
    with tempfile.TemporaryDirectory(prefix="forkbox-uploads-") as d:
        s = start_server(Path(d) / "home", "--isolation", isolation)
        try:
            # One key per upload (a key has at most 4 in progress), one tenant (one session worker).
            keys = [s.create_key("uploads", "--unlimited") for _ in range(UPLOADS)]
            sessions = [new_session(s, k) for k in keys]
            pid = s.proc.pid
            time.sleep(1)
            before = status_kib(pid, "VmRSS")
            reset_peak_rss(pid)
            peak_seen = [0]
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    peak_seen[0] = max(peak_seen[0], status_kib(pid, "VmRSS"))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()

            def upload(i: int):
                return requests.put(
                    f"{s.url}/v1/sessions/{sessions[i]}/files/data/big.bin",
                    headers=s.headers(keys[i]), data=body(i, UPLOAD), timeout=600,
                )

            with concurrent.futures.ThreadPoolExecutor(UPLOADS) as pool:
                results = list(pool.map(upload, range(UPLOADS)))
            stop.set()
            sampler.join()
            for r in results:
                assert r.status_code == 201, r.text
                assert r.json()["size"] == UPLOAD, r.text
            peak = status_kib(pid, "VmHWM")
            grew_mib = (max(peak, peak_seen[0]) - before) / 1024
            sent_mib = UPLOADS * UPLOAD / MIB
            print(f"{isolation}: RSS before {before / 1024:.0f} MiB, peak +{grew_mib:.0f} MiB for {sent_mib:.0f} MiB sent")
            assert grew_mib < allowance_mib, (
                f"{isolation}: the API process grew by {grew_mib:.0f} MiB (peak) for {UPLOADS} uploads of "
                f"{UPLOAD // MIB} MiB; the bound is {allowance_mib} MiB"
            )
            # Every byte arrived.
            for i in range(UPLOADS):
                r = requests.post(f"{s.url}/v1/sessions/{sessions[i]}/exec", headers=s.headers(keys[i]),
                                  json={"code": HASH_CODE}, timeout=300)
                assert r.status_code == 200, r.text
                assert r.json()["value"] == repr(sha_of(i, UPLOAD)), r.text
            # No temporary file is left behind (they are unnamed; nothing under sessions but what was there).
            assert not list((s.home / "sessions").glob("*.tmp*")), list((s.home / "sessions").iterdir())
        finally:
            stop_server(s)


def raw_put(s, sid: str, path: str, headers: dict, key: str | None = None) -> socket.socket:
    sock = socket.create_connection((s.url.split("//")[1].split(":")[0], int(s.url.rsplit(":", 1)[1])), timeout=30)
    lines = [f"PUT /v1/sessions/{sid}/files/{path} HTTP/1.1", f"Host: {s.url.split('//')[1]}",
             f"Authorization: Bearer {key or s.key}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int, str]:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            break
        data += got
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    # Enough of the body to show the error code (bodies are small JSON).
    try:
        sock.settimeout(2)
        while len(rest) < 4096:
            got = sock.recv(65536)
            if not got:
                break
            rest += got
    except (socket.timeout, ConnectionError):
        pass
    return status, rest.decode(errors="replace")


def test_an_upload_over_the_limit_is_refused_without_reading_it_all(server):
    sid = new_session(server, server.key)
    # Declared too large: refused before any of it is read.
    sock = raw_put(server, sid, "tmp/big.bin", {"Content-Length": str(1 << 30)})
    sock.sendall(b"x" * MIB)
    status, rest = read_response(sock)
    sock.close()
    assert status == 413 and "file_too_large" in rest, (status, rest)
    # Chunked (no length): refused once it passes the limit; the server stops reading.
    sock = raw_put(server, sid, "tmp/big.bin", {"Transfer-Encoding": "chunked"})
    chunk = b"%x\r\n" % MIB + b"y" * MIB + b"\r\n"
    sent = 0
    try:
        while sent < 512 * MIB:
            sock.sendall(chunk)
            sent += MIB
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < 512 * MIB, "the server read 512 MiB of an upload over its 64 MiB limit"
    try:
        status, rest = read_response(sock)
        assert status == 413 and "file_too_large" in rest, (status, rest)
    except (ConnectionError, IndexError):
        pass  # closed before the answer could be read: it still did not take the rest
    sock.close()
    # Nothing was written, the session works.
    r = requests.post(f"{server.url}/v1/sessions/{sid}/exec", headers=server.headers(),
                      json={"code": "import os; os.path.exists('/tmp/big.bin')"}, timeout=60)
    assert r.status_code == 200 and r.json()["value"] == "False", r.text


def test_a_key_has_at_most_four_uploads_in_progress(server):
    key = server.create_key("uploads-cap", "--unlimited")
    sid = new_session(server, key)
    slow = []
    for i in range(4):
        sock = raw_put(server, sid, f"tmp/slow{i}.bin", {"Transfer-Encoding": "chunked"}, key)
        sock.sendall(b"4\r\nslow\r\n")
        slow.append(sock)
    time.sleep(0.5)
    r = requests.put(f"{server.url}/v1/sessions/{sid}/files/tmp/fifth.txt", headers=server.headers(key),
                     data=b"five", timeout=60)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limited", r.text
    assert r.headers.get("Retry-After") == "1", r.headers
    # Another key is not held up by this one's uploads.
    r = requests.put(f"{server.url}/v1/sessions/{new_session(server, server.key)}/files/tmp/other.txt",
                     headers=server.headers(), data=b"other", timeout=60)
    assert r.status_code == 201, r.text
    # One finishes: its slot is free again.
    slow[0].sendall(b"0\r\n\r\n")
    status, rest = read_response(slow[0])
    assert status == 201, rest
    slow[0].close()
    r = requests.put(f"{server.url}/v1/sessions/{sid}/files/tmp/sixth.txt", headers=server.headers(key),
                     data=b"six", timeout=60)
    assert r.status_code == 201, r.text
    for sock in slow[1:]:
        sock.close()
    r = requests.post(f"{server.url}/v1/sessions/{sid}/exec", headers=server.headers(key),
                      json={"code": "open('/tmp/slow0.bin').read(), open('/tmp/sixth.txt').read()"}, timeout=60)
    assert r.status_code == 200 and r.json()["value"] == "('slow', 'six')", r.text


@pytest.mark.parametrize("path", [
    "proc/self/mem", "proc/self/status", "proc/new.txt", "dev/null", "sys/kernel/x",
])
def test_uploads_into_generated_trees_are_refused(server, path):
    sid = new_session(server, server.key)
    r = requests.put(f"{server.url}/v1/sessions/{sid}/files/{path}", headers=server.headers(), data=b"x", timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_path", r.text


def test_file_paths_with_dot_dot_are_refused(server):
    sid = new_session(server, server.key)
    for method in ("PUT", "GET"):
        for path in ("tmp/../etc/x", "a/..", "%2e%2e/tmp/x"):
            sock = raw_put(server, sid, path, {"Content-Length": "1"}) if method == "PUT" else None
            if sock is None:
                sock = socket.create_connection((server.url.split("//")[1].split(":")[0],
                                                 int(server.url.rsplit(":", 1)[1])), timeout=30)
                sock.sendall((f"GET /v1/sessions/{sid}/files/{path} HTTP/1.1\r\nHost: x\r\n"
                              f"Authorization: Bearer {server.key}\r\n\r\n").encode())
            else:
                sock.sendall(b"x")
            status, rest = read_response(sock)
            sock.close()
            assert status == 400 and "invalid_path" in rest, (method, path, status, rest)
