"""Egress policy layers through the CLI and the SDK against a real `forkbox serve`:
a key's `--egress` (forkbox key create) that requests cannot widen, the SDK's
`network=` and the effective policy of a session; and a server inside the
sandbox, which needs no egress. Nothing leaves this machine: the only server
outside the sandbox is a loopback responder of this test, allowed explicitly."""

import http.server
import os
import re
import subprocess
import threading

import anyio
import pytest

from conftest import forkbox_bin, fresh_home, shared_image, start_server, stop_server
from forkbox import Forkbox
from mcp_helpers import err, http_session, ok


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def net_server(tmp_path_factory):
    responder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=responder.serve_forever, daemon=True).start()
    port = responder.server_address[1]
    s = start_server(tmp_path_factory.mktemp("net") / "home", "--egress-allow", f"127.0.0.1:{port}")
    yield s, port
    stop_server(s)
    responder.shutdown()


def _get(port):
    return f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5).read()"


def test_key_egress_none_cannot_be_widened_by_requests(net_server):
    s, port = net_server
    with Forkbox(s.url, s.key) as fb:
        assert fb.exec(_get(port)).value == "b'ok'"
        r = fb.exec(_get(port), network="none")
        assert not r.ok and "refused by the egress policy: network: none" in r.stderr
    offline = s.create_key("offline", "--unlimited", "--egress", "none")
    with Forkbox(s.url, offline) as fb:
        for network in (None, "public", {"allow": [f"127.0.0.1:{port}"]}):
            r = fb.exec(_get(port), network=network)
            assert not r.ok, f"network={network!r} widened the key's policy: {r}"
            assert "refused by the egress policy: network: none" in r.stderr, r.stderr
        sess = fb.sessions.create(network="public")
        assert sess.info.network["mode"] == "none", sess.info.network
        assert [l["mode"] for l in sess.info.network["layers"]] == ["public", "none", "public"]
        assert not sess.exec(_get(port)).ok
        # A server inside the sandbox is no egress: it works under `none`.
        code = (
            "import http.server, threading, urllib.request\n"
            "srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), http.server.SimpleHTTPRequestHandler)\n"
            "threading.Thread(target=srv.serve_forever, daemon=True).start()\n"
            "r = urllib.request.urlopen(f'http://127.0.0.1:{srv.server_address[1]}/', timeout=10)\n"
            "srv.shutdown()\n"
            "r.status"
        )
        assert sess.exec(code).value == "200"


def test_key_allowlist_opens_only_its_rules(net_server):
    s, port = net_server
    listed = s.create_key("listed", "--unlimited", "--egress", "allowlist", "--egress-allow", f"127.0.0.1:{port}")
    public = s.create_key("public", "--unlimited", "--egress", "public", "--egress-deny", "*:25")
    with Forkbox(s.url, listed) as fb:
        assert fb.exec(_get(port)).value == "b'ok'"
        assert not fb.exec(_get(port), network="none").ok
    with Forkbox(s.url, public) as fb:
        # The server's allow rule is not the key's: loopback stays refused for it.
        r = fb.exec(_get(port))
        assert not r.ok and "loopback address" in r.stderr, r.stderr


def test_key_create_rejects_bad_egress_options(net_server):
    s, _ = net_server
    for extra in (["--egress-allow", "10.0.0.0/8"], ["--egress", "allowlist", "--egress-allow", "not a rule"]):
        r = subprocess.run(
            [forkbox_bin(), "--home", str(s.home), "key", "create", "--tenant", "bad", *extra],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode != 0 and r.stdout == "", (extra, r)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _cli(*args, url=None, key=None, home=None, stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    pre = []
    if url:
        env["FORKBOX_API_KEY"] = key
        pre = ["--url", url]
    if home:
        pre += ["--home", str(home)]
    return subprocess.run([forkbox_bin(), *pre, *args], capture_output=True, text=True, env=env, input=stdin,
                          timeout=300)


def test_cli_network_options_remote(net_server):
    """`--network` of `run`, `sh` and `session new` against a server: each narrows its policy."""
    s, port = net_server
    c = lambda *a: _cli(*a, url=s.url, key=s.key)
    r = c("run", _get(port))
    assert (r.returncode, r.stdout) == (0, "b'ok'\n"), r
    r = c("run", "--network", "none", _get(port))
    assert r.returncode == 1 and "refused by the egress policy: network: none" in r.stderr, r
    r = c("run", "--network-allow", f"127.0.0.1:{port}", _get(port))
    assert (r.returncode, r.stdout) == (0, "b'ok'\n"), r
    r = c("run", "--network-allow", "10.0.0.0/8", _get(port))
    assert r.returncode == 1 and "refused by the egress policy" in r.stderr, r
    py = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('connected')"
    r = c("sh", "--network", "none", "python3", "-c", py)
    assert r.returncode == 1 and "ConnectionRefusedError" in r.stderr, r
    r = c("sh", "python3", "-c", py)
    assert (r.returncode, r.stdout) == (0, "connected\n"), r

    r = c("session", "new", "--network", "none", "--tag", "net=cli")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    r = c("session", "ls", "--tag", "net=cli")
    assert re.search(rf"^{sid} .* network none$", r.stdout, re.M), r.stdout
    r = c("session", "exec", sid, _get(port))
    assert r.returncode == 1 and "network: none" in r.stderr, r
    # The session's network is the session's: a command in it cannot ask for another.
    r = c("session", "sh", sid, "--network", "public", "true")
    assert r.returncode == 2 and "--network" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
    r = c("session", "new", "--network-allow", f"127.0.0.1:{port}", "--network-deny", "*:25", "--tag", "net=cli2")
    sid2 = r.stdout.strip()
    assert c("session", "exec", sid2, _get(port)).stdout == "b'ok'\n"
    assert re.search(rf"^{sid2} .* network allowlist$", c("session", "ls", "--tag", "net=cli2").stdout, re.M)
    # Bad settings: one line, exit 2, nothing made.
    for bad in (["--network", "public", "--network-allow", "1.2.3.4"], ["--network", "all"],
                ["--network-allow", "not a rule"]):
        r = c("session", "new", "--tag", "net=bad", *bad)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (bad, r)
    assert c("session", "ls", "--tag", "net=bad").stdout == ""


def test_cli_network_options_embedded(net_server, tmp_path):
    """The embedded `run` and `session new` (public by default) take `--network`. Loopback is
    refused by the default `public` layer already (its refusal is the one named), so what
    shows the narrowing here is the session's effective mode; bad settings fail as one line."""
    _, port = net_server
    home = fresh_home(tmp_path / "home")
    image = shared_image()
    r = _cli("run", "--image", image, _get(port), home=home)
    assert r.returncode == 1 and "loopback address" in r.stderr, r
    r = _cli("run", "--image", image, "--network", "none", "6 * 7", home=home)
    assert (r.returncode, r.stdout) == (0, "42\n"), r
    for bad in (["--network-allow", "not a rule"], ["--network", "public", "--network-deny", "*:25"],
                ["--network-rate", "1000"]):
        r = _cli("run", "--image", image, *bad, "1", home=home)
        assert r.returncode == 2 and "--network" in r.stderr and len(r.stderr.strip().splitlines()) == 1, (bad, r)
    r = _cli("session", "new", "--image", image, "--network", "none", home=home)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    r = _cli("session", "exec", "--image", image, sid, _get(port), home=home)
    assert r.returncode == 1 and "refused by the egress policy" in r.stderr, r
    assert re.search(rf"^{sid} .* network none$", _cli("session", "ls", "--image", image, home=home).stdout, re.M)
    r = _cli("session", "new", "--image", image, "--network-allow", "10.0.0.0/8", "--network-rate", "65536", home=home)
    sid2 = r.stdout.strip()
    assert re.search(rf"^{sid2} .* network allowlist$", _cli("session", "ls", "--image", image, home=home).stdout, re.M)


def test_mcp_network_argument(net_server):
    """`network` of run_python, create_session and run_command over MCP (streamable HTTP)."""
    s, port = net_server

    async def scenario(m):
        tools = {t.name: t for t in (await m.list_tools()).tools}
        for name in ("run_python", "create_session", "run_command"):
            assert "network" in tools[name].input_schema["properties"], name
        assert (await ok(m, "run_python", code=_get(port)))["value"] == "b'ok'"
        r = await ok(m, "run_python", code=_get(port), network="none")
        assert r["error"]["type"] == "URLError" and "network: none" in r["stderr"], r
        r = await ok(m, "run_python", code=_get(port), network={"allow": [f"127.0.0.1:{port}"]})
        assert r["value"] == "b'ok'", r
        r = await ok(m, "run_python", code=_get(port), network={"allow": ["10.0.0.0/8"]})
        assert r["error"]["type"] == "URLError", r
        code, msg, _ = await err(m, "run_python", code="1", network={"allow": ["not a rule"]})
        assert code == "invalid_request" and "network" in msg, (code, msg)
        code, msg, _ = await err(m, "run_python", code="1", network="everything")
        assert "network" in msg, (code, msg)

        sess = await ok(m, "create_session", network="none")
        sid = sess["session_id"]
        assert sess["limits"]["network"]["mode"] == "none", sess
        r = await ok(m, "exec", session_id=sid, code=_get(port))
        assert r["error"]["type"] == "URLError", r
        listed = [x for x in (await ok(m, "list_sessions"))["sessions"] if x["session_id"] == sid]
        assert listed and listed[0]["limits"]["network"]["mode"] == "none", listed
        py = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('up')\""
        r = await ok(m, "run_command", command=py, network="none")
        assert r["exit_code"] != 0 and "ConnectionRefusedError" in r["stderr"], r
        r = await ok(m, "run_command", command=py)
        assert (r["exit_code"], r["stdout"]) == (0, "up\n"), r
        code, _, _ = await err(m, "run_command", command="true", session_id=sid, network="public")
        assert code == "invalid_arguments"
        await ok(m, "delete_session", session_id=sid)

    async def main():
        async with http_session(s.url, s.key) as m:
            await scenario(m)

    anyio.run(main)


def test_sdk_network_of_commands_and_templates(net_server):
    """The SDK's `network=` on one-shot commands and on a template of one's own (a layer of every
    sandbox forked from it, which a request cannot widen)."""
    s, port = net_server
    py = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('up')"
    with Forkbox(s.url, s.key) as fb:
        assert fb.commands.run(["python3", "-c", py]).stdout == "up\n"
        r = fb.commands.run(["python3", "-c", py], network="none")
        assert r.exit_code != 0 and "network: none" in r.stderr, r
        t = fb.create_template("sdk-offline", network="none", timeout=600)
        assert t["status"] == "ready" and t["network"]["mode"] == "none", t
        r = fb.exec(_get(port), template="sdk-offline", network={"allow": [f"127.0.0.1:{port}"]})
        assert not r.ok and "network: none" in r.stderr, r
        sess = fb.sessions.create(template="sdk-offline", network={"mode": "public", "max_bytes_per_second": 65536})
        assert sess.info.network["mode"] == "none" and sess.info.network["max_bytes_per_second"] == 65536, sess.info.network
