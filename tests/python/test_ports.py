"""Servers inside a session reachable through forkbox's port proxy, against a real
`forkbox serve` (its default jailed session workers) over real HTTP:
`/v1/sessions/{id}/ports/{port}/...` with the key or a signed URL, streamed
responses, WebSocket upgrades, the `Host: <port>-<id>.<domain>` form, and E2B's
`get_host(port)`."""

import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import websocket  # websocket-client

from conftest import run, session, start_server, stop_server

TIMEOUT = 60

HTTP_SERVER = r"""
import http.server, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/sse"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {i}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.6)
            return
        h = self.headers
        body = (f"hello {self.path} host={h.get('Host')} auth={h.get('Authorization')} "
                f"cookie={h.get('Cookie')} peer={self.client_address[0]}").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Guest", "yes")
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(201)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[::-1])
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", PORT), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
"""

# A WebSocket echo server with the standard library only (RFC 6455: handshake, frames).
WS_SERVER = r"""
import base64, hashlib, socket, struct, threading
def ws_conn(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    head = data.split(b"\r\n\r\n")[0].decode()
    key = [l.split(":", 1)[1].strip() for l in head.split("\r\n") if l.lower().startswith("sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Accept: {acc}\r\n\r\n").encode())
    f = c.makefile("rb")
    while True:
        h = f.read(2)
        if len(h) < 2:
            return
        op, n = h[0] & 0x0F, h[1] & 0x7F
        if n == 126:
            n = struct.unpack(">H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4) if h[1] & 0x80 else b"\0\0\0\0"
        p = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            c.sendall(b"\x88\x00")
            return
        out = ("echo: " + p.decode()).encode() if op == 1 else p
        hdr = bytes([0x80 | op]) + (bytes([len(out)]) if len(out) < 126 else b"\x7e" + struct.pack(">H", len(out)))
        c.sendall(hdr + out)
def ws_serve():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", PORT))
    s.listen(8)
    while True:
        c, _ = s.accept()
        threading.Thread(target=ws_conn, args=(c,), daemon=True).start()
threading.Thread(target=ws_serve, daemon=True).start()
"""


def start_http(api, sid: str, port: int = 8000):
    run(api, sid, HTTP_SERVER.replace("PORT", str(port)))


def error_code(r: httpx.Response) -> str:
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.json()["error"]["code"]


def test_a_thread_server_answers_through_the_proxy_after_its_exec_returned(api):
    sid = session(api)
    start_http(api, sid)
    r = api.get(f"/v1/sessions/{sid}/ports/8000/a/b?x=1")
    assert r.status_code == 200, r.text
    assert r.headers["x-guest"] == "yes"
    # The guest sees its own path, Host localhost:<port>, a loopback peer, and never the key.
    assert r.text.startswith("hello /a/b?x=1 host=localhost:8000 auth=None cookie=None peer=127.0.0.1"), r.text
    # The bare prefix is the guest's `/`.
    assert api.get(f"/v1/sessions/{sid}/ports/8000").text.startswith("hello / ")
    # A body goes in and comes back (streamed both ways).
    body = os.urandom(300_000)
    r = api.post(f"/v1/sessions/{sid}/ports/8000/echo", content=body)
    assert r.status_code == 201 and r.content == body[::-1]
    # The session keeps working between proxied requests (and the server through execs).
    assert run(api, sid, "1 + 1")["value"] == "2"
    assert api.get(f"/v1/sessions/{sid}/ports/8000/again").status_code == 200


def test_a_server_of_a_child_process_answers_too(api):
    sid = session(api)
    run(api, sid, "import subprocess, os\nos.makedirs('/tmp/site', exist_ok=True)\n"
                  "open('/tmp/site/index.html', 'w').write('<h1>from a child</h1>')\n"
                  "p = subprocess.Popen(['python3', '-m', 'http.server', '8001', '--bind', '127.0.0.1',"
                  " '--directory', '/tmp/site'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    deadline = time.monotonic() + 30
    while True:
        r = api.get(f"/v1/sessions/{sid}/ports/8001/index.html")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        # Until the child listens.
        assert error_code(r) == "port_not_listening", r.text
        time.sleep(0.2)
    assert r.status_code == 200 and r.text == "<h1>from a child</h1>", r.text


def test_a_streamed_response_arrives_as_it_is_written(api):
    sid = session(api)
    start_http(api, sid)
    t0 = time.monotonic()
    arrivals = []
    with api.stream("GET", f"/v1/sessions/{sid}/ports/8000/sse") as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append((line, time.monotonic() - t0))
    assert [a[0] for a in arrivals] == ["data: 0", "data: 1", "data: 2"]
    # 0.6 s between events in the guest: the first came long before the last.
    assert arrivals[2][1] - arrivals[0][1] > 0.9, arrivals


def test_a_websocket_echo_server_inside_echoes_through_the_proxy(api, server):
    sid = session(api)
    run(api, sid, WS_SERVER.replace("PORT", "8002"))
    ws_url = server.url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ports/8002/chat"
    ws = websocket.create_connection(ws_url, header=[f"Authorization: Bearer {server.key}"], timeout=TIMEOUT)
    try:
        for msg in ["hi", "x" * 5000, "third"]:
            ws.send(msg)
            assert ws.recv() == "echo: " + msg
        ws.send_binary(b"\x00\x01\xff")
        assert ws.recv() == b"\x00\x01\xff"
    finally:
        ws.close()


def test_signed_urls_and_their_errors(api, server):
    sid = session(api)
    start_http(api, sid)
    r = api.post(f"/v1/sessions/{sid}/ports/8000/url", json={"expires_in": 60})
    assert r.status_code == 200, r.text
    url = r.json()["url"]
    assert r.json()["expires_at"]
    with httpx.Client(timeout=TIMEOUT) as anon:
        r = anon.get(url)
        assert r.status_code == 200, r.text
        # Neither the token nor its cookie reach the guest.
        assert r.text.startswith("hello / ") and "fbx_token" not in r.text, r.text
        # The cookie set for the port's prefix lets the page's own links work.
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8000/style.css")
        assert r.status_code == 200 and "hello /style.css" in r.text and "cookie=None" in r.text, r.text
        # ... only there.
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8001/")
        assert r.status_code == 401, r.text
    with httpx.Client(timeout=TIMEOUT) as anon:
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8000/style.css")
        assert r.status_code == 401, r.text
    with httpx.Client(timeout=TIMEOUT) as anon:
        # Another port or session with that token: forged.
        token = url.split("fbx_token=")[1]
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8001/?fbx_token={token}")
        assert r.status_code == 403 and error_code(r) == "forbidden"
        other = session(api)
        r = anon.get(f"{server.url}/v1/sessions/{other}/ports/8000/?fbx_token={token}")
        assert r.status_code == 403 and error_code(r) == "forbidden"
        # A changed signature or expiry: forged.
        exp, tenant, sig = token.split(".")
        forged = f"{exp}.{tenant}.{sig[:-2]}{'00' if sig[-2:] != '00' else '11'}"
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8000/?fbx_token={forged}")
        assert r.status_code == 403 and error_code(r) == "forbidden"
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8000/?fbx_token={int(exp) + 99}.{tenant}.{sig}")
        assert r.status_code == 403 and error_code(r) == "forbidden"
        # No credentials at all.
        r = anon.get(f"{server.url}/v1/sessions/{sid}/ports/8000/")
        assert r.status_code == 401 and error_code(r) == "unauthorized"
    # An expired URL.
    r = api.post(f"/v1/sessions/{sid}/ports/8000/url", json={"expires_in": 1})
    url = r.json()["url"]
    time.sleep(2.1)
    r = httpx.get(url, timeout=TIMEOUT)
    assert r.status_code == 401 and error_code(r) == "unauthorized", r.text
    # Bad requests for a URL.
    for bad in [{"expires_in": 0}, {"expires_in": 10**9}, {"nope": 1}]:
        r = api.post(f"/v1/sessions/{sid}/ports/8000/url", json=bad)
        assert r.status_code == 400, (bad, r.text)


def test_other_tenants_missing_listeners_and_bad_ports_get_clear_errors(api, server):
    sid = session(api)
    start_http(api, sid)
    other_key = server.create_key("ports-other-tenant", "--unlimited")
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/ports/8000/", headers=server.headers(other_key), timeout=TIMEOUT)
    assert r.status_code == 404 and error_code(r) == "session_not_found", r.text
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/ports/8000/url", headers=server.headers(other_key), timeout=TIMEOUT)
    assert r.status_code == 404 and error_code(r) == "session_not_found", r.text
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/ports/8000/", headers={"Authorization": "Bearer fbk_nope"})
    assert r.status_code == 401 and error_code(r) == "unauthorized"
    # Nothing listens on 9000 (the host's own ports are never reached: the server's port either).
    for port in [9000, int(server.url.rsplit(":", 1)[1])]:
        r = api.get(f"/v1/sessions/{sid}/ports/{port}/")
        assert r.status_code == 502 and error_code(r) == "port_not_listening", r.text
    for port in ["0", "65536", "http"]:
        r = api.get(f"/v1/sessions/{sid}/ports/{port}/")
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
    r = api.get("/v1/sessions/s_0000000000000000/ports/8000/")
    assert r.status_code == 404 and error_code(r) == "session_not_found"
    # A body over the server's limit (2 MiB by default).
    r = api.post(f"/v1/sessions/{sid}/ports/8000/", content=b"x" * (3 << 20))
    assert r.status_code == 413 and error_code(r) == "payload_too_large"


TAGGED_SERVER = r"""
import http.server, socket, threading
TAG = "base"
class T(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = TAG.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
tsrv = http.server.ThreadingHTTPServer(("127.0.0.1", 8002), T)
threading.Thread(target=tsrv.serve_forever, daemon=True).start()
# A connection open when the checkpoint is taken (read as reset after a restore).
held = socket.create_connection(("127.0.0.1", 8002))
"""


def tag(api, sid: str) -> str:
    r = api.get(f"/v1/sessions/{sid}/ports/8002/")
    assert r.status_code == 200, r.text
    return r.text


def test_listeners_keep_listening_after_revert_fork_and_explore(api):
    """Checkpoints record listening sockets: a revert, a fork (its own listener) and an
    explore bring the server back answering; connections read as reset."""
    sid = session(api)
    run(api, sid, TAGGED_SERVER)
    assert tag(api, sid) == "base"
    seq = api.get(f"/v1/sessions/{sid}").json()["checkpoint"]
    run(api, sid, "TAG = 'later'")
    assert tag(api, sid) == "later"
    r = api.post(f"/v1/sessions/{sid}/revert", json={"checkpoint": seq})
    assert r.status_code == 200, r.text
    assert tag(api, sid) == "base"
    # The connection that was open reads as reset; the listener takes new ones inside too.
    got = run(api, sid, "try:\n    r = repr(held.recv(10))\nexcept OSError as e:\n    r = type(e).__name__\n"
                        "import urllib.request\n"
                        "(r, urllib.request.urlopen('http://127.0.0.1:8002/', timeout=10).read().decode())")
    assert got["value"] == "('ConnectionResetError', 'base')", got
    # Two forks of one checkpoint: each its own listener (its own server state behind it).
    forks = []
    for name in ["one", "two"]:
        r = api.post(f"/v1/sessions/{sid}/fork", json={})
        assert r.status_code == 201, r.text
        forks.append(r.json()["id"])
        run(api, forks[-1], f"TAG = {name!r}")
    assert [tag(api, f) for f in forks] == ["one", "two"]
    assert tag(api, sid) == "base"
    # The port is still the listener's: binding it again fails as on Linux.
    got = run(api, forks[0], "import socket\ns = socket.socket()\ntry:\n    s.bind(('127.0.0.1', 8002))\n"
                             "    r = 'bound'\nexcept OSError as e:\n    r = e.errno\ns.close()\nr")
    assert got["value"] == "98", got  # EADDRINUSE
    # An explore branch talks to the server from inside.
    r = api.post(f"/v1/sessions/{sid}/explore", json={"codes": [
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:8002/', timeout=10).read().decode()"]})
    assert r.status_code == 200, r.text
    b = r.json()["branches"][0]
    assert b.get("failed") is None and b["result"]["value"] == "'base'", b


@pytest.fixture(scope="module")
def domain_server():
    with tempfile.TemporaryDirectory(prefix="forkbox-pytest-ports-") as d:
        s = start_server(Path(d) / "home", "--sandbox-domain", "sandbox.test")
        yield s
        stop_server(s)


def test_the_host_form_routes_by_sandbox_domain(domain_server):
    s = domain_server
    with httpx.Client(base_url=s.url, headers=s.headers(), timeout=TIMEOUT) as api:
        sid = session(api)
        start_http(api, sid, 8080)
        host = f"8080-{sid}.sandbox.test"
        r = api.get("/page?q=2", headers={"Host": host})
        assert r.status_code == 200 and r.text.startswith("hello /page?q=2 host=localhost:8080"), r.text
        r = api.post(f"/v1/sessions/{sid}/ports/8080/url", json={})
        assert r.json()["host_url"].startswith(f"http://{host}/?fbx_token=")
        token = r.json()["token"]
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as anon:
            assert anon.get("/", headers={"Host": host}).status_code == 401
            r = anon.get(f"/x?fbx_token={token}", headers={"Host": host})
            assert r.status_code == 200 and r.text.startswith("hello /x host="), r.text
            # A token of another port does not open this one.
            r = anon.get(f"/x?fbx_token={token}", headers={"Host": f"8081-{sid}.sandbox.test"})
            assert r.status_code == 403
        # The API itself is still the API.
        assert api.get(f"/v1/sessions/{sid}").status_code == 200


def test_e2b_get_host_reaches_a_server_in_the_sandbox(domain_server):
    import e2b

    s = domain_server
    env = {"E2B_API_URL": s.url, "E2B_SANDBOX_URL": s.url, "E2B_API_KEY": s.key}
    old = {k: os.environ.get(k) for k in [*env, "E2B_DOMAIN", "E2B_DEBUG"]}
    os.environ.update(env)
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    try:
        sbx = e2b.Sandbox.create()
        try:
            # A background command, as E2B's docs start a server; it keeps running between calls.
            handle = sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp", background=True)
            assert sbx.commands.run("echo other calls go on").stdout == "other calls go on\n"
            host = sbx.get_host(8000)
            assert host == f"8000-{sbx.sandbox_id}.sandbox.test"
            token = sbx.traffic_access_token
            assert token
            deadline = time.monotonic() + 30
            while True:
                r = httpx.get(f"{s.url}/", headers={"Host": host, "e2b-traffic-access-token": token}, timeout=TIMEOUT)
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert r.status_code == 200 and "Directory listing for /" in r.text, r.text
            # The same through E2B's routing headers.
            r = httpx.get(f"{s.url}/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000",
                                               "e2b-traffic-access-token": token}, timeout=TIMEOUT)
            assert r.status_code == 200 and "Directory listing" in r.text
            # A sandbox id is not a secret: no token, no port.
            r = httpx.get(f"{s.url}/", headers={"Host": host}, timeout=TIMEOUT)
            assert r.status_code == 401, r.text
            handle.kill()
        finally:
            sbx.kill()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_listening_ports_are_listed_by_the_api_the_cli_and_the_sdk(api, server):
    import subprocess

    import forkbox
    from conftest import forkbox_bin

    sid = session(api)
    run(api, sid, "1")
    assert api.get(f"/v1/sessions/{sid}/ports").json() == {"ports": [], "resident": True}
    start_http(api, sid)  # 127.0.0.1:8000
    # One the proxy reaches (::1), one it cannot (127.0.0.2 takes no connection to 127.0.0.1), and a UDP socket.
    run(api, sid, "import socket\n"
                  "a = socket.socket(socket.AF_INET6); a.bind(('::1', 8003)); a.listen(1)\n"
                  "b = socket.socket(); b.bind(('127.0.0.2', 8004)); b.listen(1)\n"
                  "u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 8005))")
    want = [{"port": 8000, "address": "127.0.0.1", "proxied": True},
            {"port": 8003, "address": "::1", "proxied": True},
            {"port": 8004, "address": "127.0.0.2", "proxied": False}]
    r = api.get(f"/v1/sessions/{sid}/ports")
    assert r.status_code == 200 and r.json() == {"ports": want, "resident": True}, r.text
    # A closed listener is gone from the list.
    run(api, sid, "a.close()")
    assert [p["port"] for p in api.get(f"/v1/sessions/{sid}/ports").json()["ports"]] == [8000, 8004]
    # Another tenant's key: no such session.
    other_key = server.create_key("ports-list-other-tenant", "--unlimited")
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/ports", headers=server.headers(other_key), timeout=TIMEOUT)
    assert r.status_code == 404 and error_code(r) == "session_not_found", r.text
    assert error_code(api.get("/v1/sessions/s_0000000000000000/ports")) == "session_not_found"
    # The CLI.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env["FORKBOX_API_KEY"] = server.key
    out = subprocess.run([forkbox_bin(), "--url", server.url, "session", "ports", sid],
                         capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert rows == [["8000", "127.0.0.1", "yes"], ["8004", "127.0.0.2", "no"]], out.stdout
    # The SDK: the list, and a signed URL that reaches the server without a key.
    with forkbox.Forkbox(server.url, server.key) as fb:
        s = fb.sessions.get(sid)
        assert [(p.port, p.address, p.proxied) for p in s.ports()] == [(8000, "127.0.0.1", True), (8004, "127.0.0.2", False)]
        u = s.port_url(8000, expires_in=60)
        assert u.url.startswith(f"{server.url}/v1/sessions/{sid}/ports/8000/?fbx_token=") and u.expires_at
        r = httpx.get(u.url, timeout=TIMEOUT)
        assert r.status_code == 200 and r.text.startswith("hello / "), r.text
        with pytest.raises(forkbox.InvalidRequest):
            s.port_url(8000, expires_in=0)


def test_the_cli_prints_a_signed_url(api, server):
    import subprocess

    from conftest import forkbox_bin

    sid = session(api)
    start_http(api, sid)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env["FORKBOX_API_KEY"] = server.key
    out = subprocess.run([forkbox_bin(), "--url", server.url, "session", "port", sid, "8000", "--expires-in", "60"],
                         capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url.startswith(f"{server.url}/v1/sessions/{sid}/ports/8000/?fbx_token="), url
    assert "valid until" in out.stderr
    r = httpx.get(url, timeout=TIMEOUT)
    assert r.status_code == 200 and r.text.startswith("hello / "), r.text
    bad = subprocess.run([forkbox_bin(), "--url", server.url, "session", "port", sid, "0"],
                         capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert bad.returncode != 0


def test_a_request_resumes_a_paused_sandbox(domain_server):
    """A paused (evicted) session is brought back by a port request, its listener with it
    (checkpoints record listening sockets): the request is answered."""
    import e2b

    s = domain_server
    env = {"E2B_API_URL": s.url, "E2B_SANDBOX_URL": s.url, "E2B_API_KEY": s.key}
    old = {k: os.environ.get(k) for k in [*env, "E2B_DOMAIN", "E2B_DEBUG"]}
    os.environ.update(env)
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    try:
        sbx = e2b.Sandbox.create()
        try:
            with httpx.Client(base_url=s.url, headers=s.headers(), timeout=TIMEOUT) as api:
                start_http(api, sbx.sandbox_id, 8000)
                url = f"/v1/sessions/{sbx.sandbox_id}/ports/8000/before"
                assert api.get(url).status_code == 200
                sbx.pause()
                assert api.get(f"/v1/sessions/{sbx.sandbox_id}").json()["resident"] is False
                # Listing does not resume it: nothing listens while it is paused.
                assert api.get(f"/v1/sessions/{sbx.sandbox_id}/ports").json() == {"ports": [], "resident": False}
                r = api.get(url)
                assert r.status_code == 200 and r.text.startswith("hello /before"), r.text
                assert api.get(f"/v1/sessions/{sbx.sandbox_id}").json()["resident"] is True
                # Paused again, and back through the API: the server still answers.
                sbx.pause()
                assert run(api, sbx.sandbox_id, "1 + 1")["value"] == "2"
                assert api.get(url).status_code == 200
        finally:
            sbx.kill()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
