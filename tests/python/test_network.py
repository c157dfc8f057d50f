"""Egress policy layers through the CLI and the SDK against a real `forkbox serve`:
a key's `--egress` (forkbox key create) that requests cannot widen, the SDK's
`network=` and the effective policy of a session; and a server inside the
sandbox, which needs no egress. Nothing leaves this machine: the only server
outside the sandbox is a loopback responder of this test, allowed explicitly."""

import http.server
import subprocess
import threading

import pytest

from conftest import forkbox_bin, start_server, stop_server
from forkbox import Forkbox


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
