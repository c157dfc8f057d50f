"""Secrets at the egress boundary against a real `forkbox serve` (process and
thread isolation): a session's secret is only a placeholder inside the
sandbox; an HTTP request to a host the secret is bound to carries the real
value in its headers when it arrives, to any other host the placeholder.
The value is never in the guest's environment or files, in an API response,
in the server's data directory (database, checkpoints) or its log. Loopback
responders only: `api.secret.test` (`serve --egress-host`) is the bound name, 127.0.0.2 another allowed
host with no name."""

import http.server
import json
import os
import threading

import httpx
import pytest

from conftest import start_server, stop_server

VALUE = "sk-live-7f3e9c0d1b2a4f6e8d7c5b3a1928374655647382"


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Keeps each request (headers, body, path) in its server's `seen` and
    answers with its index only: what arrived is checked here, and nothing
    of it goes back into the sandbox (an echo would hand the value to the
    guest, see docs/security.md)."""

    protocol_version = "HTTP/1.1"

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n).decode() if n else ""
        with self.server.lock:
            self.server.seen.append({"headers": dict(self.headers.items()), "body": body, "path": self.path})
            out = str(len(self.server.seen) - 1).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = _answer
    do_POST = _answer

    def log_message(self, *a):
        pass


def _responder(host):
    srv = http.server.ThreadingHTTPServer((host, 0), _Recorder)
    srv.seen, srv.lock = [], threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module", params=["process", "thread"])
def secret_server(request, tmp_path_factory):
    bound, other = _responder("127.0.0.1"), _responder("127.0.0.2")
    p1, p2 = bound.server_address[1], other.server_address[1]
    s = start_server(
        tmp_path_factory.mktemp("secrets") / "home",
        "--isolation", request.param,
        "--egress-host", "api.secret.test=127.0.0.1",
        "--egress-allow", f"127.0.0.1:{p1}",
        "--egress-allow", f"127.0.0.2:{p2}",
    )
    yield s, bound, other
    stop_server(s)
    bound.shutdown()
    other.shutdown()


def _create(s, body):
    return httpx.post(f"{s.url}/v1/sessions", json=body, headers=s.headers(), timeout=60)


def _exec(s, sid, code):
    r = httpx.post(f"{s.url}/v1/sessions/{sid}/exec", json={"code": code}, headers=s.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# Two requests on one keep-alive connection (http.client), then one with the
# placeholder in the body and the query; the indexes the responders gave them.
_CLIENT = """
import http.client, json, os
ph = os.environ["OPENAI_API_KEY"]
def talk(host, port):
    c = http.client.HTTPConnection(host, port, timeout=10)
    out = []
    for h in ({{"Authorization": "Bearer " + ph}}, {{"X-Api-Key": ph, "X-Other": "a" + ph + "b"}}):
        c.request("GET", "/k", headers=h)
        out.append(int(c.getresponse().read()))
    c.request("POST", "/b?q=" + ph, body="token=" + ph, headers={{"X-Api-Key": ph}})
    out.append(int(c.getresponse().read()))
    c.close()
    return out
res = {{"ph": ph, "bound": talk("api.secret.test", {p1}), "other": talk("127.0.0.2", {p2})}}
json.dumps(res)
"""


def test_placeholder_becomes_the_value_only_for_its_hosts(secret_server):
    s, bound, other = secret_server
    p1, p2 = bound.server_address[1], other.server_address[1]
    r = _create(s, {"secrets": {"OPENAI_API_KEY": {"value": VALUE, "hosts": ["api.secret.test"], "ports": [p1]}}})
    assert r.status_code == 201, r.text
    assert VALUE not in r.text
    sess = r.json()
    assert sess["secrets"] == [{"name": "OPENAI_API_KEY", "hosts": ["api.secret.test"], "ports": [p1]}]
    sid = sess["id"]

    out = _exec(s, sid, _CLIENT.format(p1=p1, p2=p2))
    assert out["error"] is None, out
    res = json.loads(eval(out["value"]))
    ph = res["ph"]
    assert ph.startswith("fbx_secret_") and len(ph) == len("fbx_secret_") + 32 and VALUE not in ph
    a, b, post = (bound.seen[i] for i in res["bound"])
    assert a["headers"]["Authorization"] == f"Bearer {VALUE}"
    assert b["headers"]["X-Api-Key"] == VALUE and b["headers"]["X-Other"] == f"a{VALUE}b"
    # Headers only: the body and the request line go out as they are.
    assert post["headers"]["X-Api-Key"] == VALUE
    assert post["body"] == f"token={ph}" and post["path"] == f"/b?q={ph}"
    # Another allowed host gets the placeholder.
    a, b, post = (other.seen[i] for i in res["other"])
    assert VALUE not in json.dumps([a, b, post])
    assert a["headers"]["Authorization"] == f"Bearer {ph}" and b["headers"]["X-Api-Key"] == ph

    # The sandbox never holds the value: its environment, a file it writes, a subprocess's env.
    out = _exec(s, sid, (
        "import os, subprocess\n"
        "open('/tmp/env.txt', 'w').write(repr(dict(os.environ)))\n"
        "env = subprocess.run(['env'], capture_output=True, text=True).stdout\n"
        "(os.environ['OPENAI_API_KEY'], env, open('/tmp/env.txt').read())"
    ))
    assert out["error"] is None, out
    got_ph, env, written = eval(out["value"])
    assert got_ph == ph and f"OPENAI_API_KEY={ph}" in env and ph in written
    assert VALUE not in out["value"]

    # Kept across forks (the placeholder is in the checkpoint's memory, the sealed value in the record).
    again = (
        "import http.client, os\n"
        f"c = http.client.HTTPConnection('api.secret.test', {p1}, timeout=10)\n"
        "c.request('GET', '/', headers={'X-Api-Key': os.environ['OPENAI_API_KEY']})\n"
        "c.getresponse().read().decode()"
    )
    r = httpx.post(f"{s.url}/v1/sessions/{sid}/fork", json={}, headers=s.headers(), timeout=60)
    assert r.status_code in (200, 201), r.text
    fork = r.json()
    assert fork["secrets"] == sess["secrets"]
    out = _exec(s, fork["id"], again)
    assert out["error"] is None, out
    assert bound.seen[int(eval(out["value"]))]["headers"]["X-Api-Key"] == VALUE

    # No API response has the value: the session, the list, its checkpoints.
    for path in (f"/v1/sessions/{sid}", "/v1/sessions", f"/v1/sessions/{sid}/checkpoints"):
        r = httpx.get(f"{s.url}{path}", headers=s.headers(), timeout=60)
        assert r.status_code == 200 and VALUE not in r.text, (path, r.text[:500])

    # Nor the data directory (database, checkpoints, layers) or the server's log.
    needle = VALUE.encode()
    for root, _, files in os.walk(s.home):
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as fh:
                assert needle not in fh.read(), f"{p} holds the secret's value"
    assert VALUE not in "".join(s.output)
    key = os.path.join(s.home, "secrets.key")
    assert os.stat(key).st_mode & 0o777 == 0o600


def test_a_session_without_a_matching_port_sends_the_placeholder(secret_server):
    s, bound, _ = secret_server
    p1 = bound.server_address[1]
    r = _create(s, {"secrets": {"TOKEN": {"value": VALUE, "hosts": ["api.secret.test"], "ports": [p1 + 1 if p1 < 65535 else 1]}}})
    assert r.status_code == 201, r.text
    # A branch explored from the template (no exec yet) has the placeholder too.
    e = httpx.post(f"{s.url}/v1/sessions/{r.json()['id']}/explore", headers=s.headers(), timeout=120,
                   json={"codes": ["import os\nos.environ.get('TOKEN', '')"]})
    assert e.status_code == 200, e.text
    assert e.json()["from"] is None and e.json()["branches"][0]["result"]["value"].startswith("'fbx_secret_"), e.text
    code = (
        "import http.client, os\n"
        f"c = http.client.HTTPConnection('api.secret.test', {p1}, timeout=10)\n"
        "c.request('GET', '/', headers={'X-Api-Key': os.environ['TOKEN']})\n"
        "(os.environ['TOKEN'], c.getresponse().read().decode())"
    )
    out = _exec(s, r.json()["id"], code)
    assert out["error"] is None, out
    ph, i = eval(out["value"])
    assert bound.seen[int(i)]["headers"]["X-Api-Key"] == ph


@pytest.mark.parametrize("secrets, says", [
    ({"1BAD": {"value": "v", "hosts": ["a.example"]}}, "not an environment variable name"),
    ({"K": {"value": "", "hosts": ["a.example"]}}, "1 to 8192 bytes"),
    ({"K": {"value": "a\r\nX-Injected: 1", "hosts": ["a.example"]}}, "no CR, LF or NUL"),
    ({"K": {"value": "v", "hosts": []}}, "hosts must name"),
    ({"K": {"value": "v", "hosts": ["10.0.0.1"]}}, "not a host name"),
    ({"K": {"value": "v", "hosts": ["a.example:443"]}}, "not a host name"),
    ({"K": {"value": "v", "hosts": ["a.example"], "ports": [0]}}, "ports"),
    ({"K": {"value": "v", "hosts": ["a.example"], "tls": True}}, "unknown field"),
    ({f"K{i}": {"value": "v", "hosts": ["a.example"]} for i in range(17)}, "at most 16"),
    ({"K": {"value": 918273645, "hosts": ["a.example"]}}, "must be a string"),
    ({"K": {"value": ["s3cr3t-in-a-list"], "hosts": ["a.example"]}}, "must be a string"),
])
def test_bad_secrets_are_400(secret_server, secrets, says):
    s, _, _ = secret_server
    r = _create(s, {"secrets": secrets})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"]["code"] == "invalid_request" and says in body["error"]["message"], body
    assert "\r\n" not in r.text
    # A value is never quoted back, whatever its type.
    assert "918273645" not in r.text and "s3cr3t-in-a-list" not in r.text


def test_secrets_survive_a_restart(tmp_path):
    """The sealed value is in the session's record and the key in the data
    directory: a new server process on it resumes the session from its
    checkpoint and still substitutes."""
    bound = _responder("127.0.0.1")
    port = bound.server_address[1]
    home = tmp_path / "home"
    s = start_server(home, "--egress-host", "api.secret.test=127.0.0.1", "--egress-allow", f"127.0.0.1:{port}")
    try:
        r = _create(s, {"secrets": {"K": {"value": VALUE, "hosts": ["api.secret.test"]}}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert _exec(s, sid, "import os\nph = os.environ['K']\nph")["value"].startswith("'fbx_secret_")
    finally:
        stop_server(s)
    # (A server prints a new key only when it has none: the keys go, the sessions stay.)
    for f in (home / "server").glob("keys.db*"):
        f.unlink()
    s = start_server(home, "--egress-host", "api.secret.test=127.0.0.1", "--egress-allow", f"127.0.0.1:{port}")
    try:
        code = (
            "import http.client\n"
            f"c = http.client.HTTPConnection('api.secret.test', {port}, timeout=10)\n"
            "c.request('GET', '/', headers={'Authorization': 'Bearer ' + ph})\n"
            "c.getresponse().read().decode()"
        )
        out = _exec(s, sid, code)
        assert out["error"] is None, out
        assert bound.seen[int(eval(out["value"]))]["headers"]["Authorization"] == f"Bearer {VALUE}"
        assert VALUE not in "".join(s.output)
    finally:
        stop_server(s)
        bound.shutdown()
