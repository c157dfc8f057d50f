"""Secrets at the egress boundary against a real `forkbox serve` (process and
thread isolation): a session's secret is only a placeholder inside the
sandbox; an HTTP request to a host the secret is bound to carries the real
value in its headers when it arrives, to any other host the placeholder.
The value is never in the guest's environment or files, in an API response,
in the server's data directory (database, checkpoints) or its log. Loopback
responders only: `api.secret.test` (`serve --egress-host`) is the bound name, 127.0.0.2 another allowed
host with no name."""

import datetime
import http.server
import json
import os
import ssl
import subprocess
import threading
import time

import httpx
import pytest

from conftest import forkbox_bin, fresh_home, shared_image, start_server, stop_server

VALUE = "sk-live-7f3e9c0d1b2a4f6e8d7c5b3a1928374655647382"


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Keeps each request (headers, body, path) in its server's `seen` and
    answers with its index only: what arrived is checked here, and nothing
    of it goes back into the sandbox (an echo would hand the value to the
    guest, see docs/security.md)."""

    protocol_version = "HTTP/1.1"
    # Head and body are two writes: without this, Nagle and delayed ACKs add 40 ms to each.
    disable_nagle_algorithm = True

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


def _no_value_anywhere(s, values):
    for root, _, files in os.walk(s.home):
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as fh:
                data = fh.read()
            for v in values:
                assert v.encode() not in data, f"{p} holds a secret's value"
    log = "".join(s.output)
    assert not any(v in log for v in values)


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
    _no_value_anywhere(s, [VALUE])
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
    ({"K": {"value": "v", "hosts": ["a.example"], "insecure": True}}, "unknown field"),
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



# --- HTTPS: TLS termination at the relay for secrets with "tls": true ---


def _test_ca(d):
    """A test CA and a server certificate for api.secret.test and
    other.secret.test it signed (files in `d`): the loopback HTTPS
    responders' identity, trusted by the server through --egress-ca-file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "forkbox test upstream CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.secret.test")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("api.secret.test"), x509.DNSName("other.secret.test")]),
                       critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {n: os.path.join(d, n) for n in ("ca.pem", "cert.pem", "key.pem")}
    with open(paths["ca.pem"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths["cert.pem"], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths["key.pem"], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths


def _https_responder(host, paths):
    srv = _responder(host)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(paths["cert.pem"], paths["key.pem"])
    # The handshake happens in the handler's thread, not the accept loop.
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    return srv


@pytest.fixture(scope="module", params=["process", "thread"])
def tls_server(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    paths = _test_ca(str(d))
    bound, other = _https_responder("127.0.0.1", paths), _https_responder("127.0.0.2", paths)
    p1, p2 = bound.server_address[1], other.server_address[1]
    s = start_server(
        d / "home",
        "--isolation", request.param,
        "--egress-host", "api.secret.test=127.0.0.1",
        "--egress-host", "other.secret.test=127.0.0.2",
        "--egress-allow", f"127.0.0.1:{p1}",
        "--egress-allow", f"127.0.0.2:{p2}",
        "--egress-ca-file", paths["ca.pem"],
    )
    with open(paths["ca.pem"]) as f:
        test_ca = f.read()
    yield s, bound, other, test_ca
    stop_server(s)
    bound.shutdown()
    other.shutdown()


# HTTPS from the guest with urllib (the default context: SSL_CERT_FILE), and
# with an explicit context trusting only the test CA, which succeeds only if
# the bytes reached the real server untouched.
_TLS_CLIENT = """
import json, os, ssl, urllib.request
ph = os.environ["API_TOKEN"]
def get(url, ctx=None):
    req = urllib.request.Request(url, headers={{"Authorization": "Bearer " + ph}})
    with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
        return int(r.read())
only_test_ca = ssl.create_default_context(cadata={test_ca!r})
def refused(url, ctx=None):
    try:
        get(url, ctx)
    except Exception as e:
        return "CERTIFICATE_VERIFY_FAILED" in str(e)
    return False
res = {{
    "ph": ph,
    "env": {{k: os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}},
    "bundle": open(os.environ["SSL_CERT_FILE"]).read(),
    "terminated": get("https://api.secret.test:{p1}/t"),
    # The relay's leaf is not the test CA's: a guest trusting only that CA refuses it.
    "terminated_refused_by_test_ca": refused("https://api.secret.test:{p1}/t", only_test_ca),
    # Not a TLS secret's host: passed through, the real server's certificate verifies.
    "other": get("https://other.secret.test:{p2}/o", only_test_ca),
    "other_refused_by_default": refused("https://other.secret.test:{p2}/o"),
}}
json.dumps(res)
"""


def test_https_to_a_tls_secret_host_carries_the_value(tls_server):
    s, bound, other, test_ca = tls_server
    p1, p2 = bound.server_address[1], other.server_address[1]
    r = _create(s, {"secrets": {"API_TOKEN": {"value": VALUE, "hosts": ["api.secret.test"], "tls": True}}})
    assert r.status_code == 201, r.text
    sess = r.json()
    assert sess["secrets"] == [{"name": "API_TOKEN", "hosts": ["api.secret.test"], "tls": True}]
    out = _exec(s, sess["id"], _TLS_CLIENT.format(p1=p1, p2=p2, test_ca=test_ca))
    assert out["error"] is None, out
    res = json.loads(eval(out["value"]))
    ph = res["ph"]
    assert ph.startswith("fbx_secret_") and VALUE not in out["value"]
    assert res["env"] == {"SSL_CERT_FILE": "/etc/ssl/forkbox-ca-bundle.pem",
                          "REQUESTS_CA_BUNDLE": "/etc/ssl/forkbox-ca-bundle.pem"}
    # The bundle: the image's roots and this server's egress CA (its certificate, never its key).
    with open(os.path.join(s.home, "egress-ca.pem")) as f:
        ca_pem = f.read()
    assert ca_pem.strip() in res["bundle"] and res["bundle"].count("BEGIN CERTIFICATE") > 10
    assert "PRIVATE KEY" not in res["bundle"]
    assert os.stat(os.path.join(s.home, "egress-ca.key")).st_mode & 0o777 == 0o600

    assert bound.seen[res["terminated"]]["headers"]["Authorization"] == f"Bearer {VALUE}"
    assert res["terminated_refused_by_test_ca"] is True
    assert other.seen[res["other"]]["headers"]["Authorization"] == f"Bearer {ph}"
    assert res["other_refused_by_default"] is True

    # Nothing holds the value: API responses, the data directory, the log.
    for path in (f"/v1/sessions/{sess['id']}", "/v1/sessions"):
        r = httpx.get(f"{s.url}{path}", headers=s.headers(), timeout=60)
        assert r.status_code == 200 and VALUE not in r.text
    _no_value_anywhere(s, [VALUE])


def test_sni_not_named_by_the_secret_passes_through(tls_server):
    """A connection to the address of a TLS secret's host whose ClientHello
    names another host is not terminated: the real server answers, and the
    placeholder arrives as it is."""
    s, bound, _, test_ca = tls_server
    p1 = bound.server_address[1]
    r = _create(s, {"secrets": {"API_TOKEN": {"value": VALUE, "hosts": ["api.secret.test"], "tls": True}}})
    assert r.status_code == 201, r.text
    code = (
        "import http.client, os, ssl, socket\n"
        f"ctx = ssl.create_default_context(cadata={test_ca!r})\n"
        f"raw = socket.create_connection(('api.secret.test', {p1}), timeout=10)\n"
        f"c = http.client.HTTPConnection('other.secret.test', {p1}, timeout=10)\n"
        # The SNI and the verified name: other.secret.test, over api.secret.test's address.
        "c.sock = ctx.wrap_socket(raw, server_hostname='other.secret.test')\n"
        "c.request('GET', '/sni', headers={'Host': 'other.secret.test', 'X-Api-Key': os.environ['API_TOKEN']})\n"
        "(os.environ['API_TOKEN'], c.getresponse().read().decode())"
    )
    out = _exec(s, r.json()["id"], code)
    assert out["error"] is None, out
    ph, i = eval(out["value"])
    assert bound.seen[int(i)]["headers"]["X-Api-Key"] == ph


def test_a_secret_without_tls_leaves_https_alone(tls_server):
    s, bound, _, test_ca = tls_server
    p1 = bound.server_address[1]
    r = _create(s, {"secrets": {"API_TOKEN": {"value": VALUE, "hosts": ["api.secret.test"]}}})
    assert r.status_code == 201, r.text
    code = (
        "import os, ssl, urllib.request\n"
        f"ctx = ssl.create_default_context(cadata={test_ca!r})\n"
        f"req = urllib.request.Request('https://api.secret.test:{p1}/', headers={{'X-Api-Key': os.environ['API_TOKEN']}})\n"
        "(os.environ['API_TOKEN'], os.environ.get('SSL_CERT_FILE'), urllib.request.urlopen(req, timeout=10, context=ctx).read().decode())"
    )
    out = _exec(s, r.json()["id"], code)
    assert out["error"] is None, out
    ph, cert_file, i = eval(out["value"])
    assert cert_file is None
    assert bound.seen[int(i)]["headers"]["X-Api-Key"] == ph


def test_an_existing_egress_ca_from_the_environment(tmp_path):
    """FORKBOX_EGRESS_CA_CERT and FORKBOX_EGRESS_CA_KEY: the server signs with
    that CA (none is made in the data directory) and the guest trusts it; only one of them is refused."""
    paths = _test_ca(str(tmp_path))
    # The test CA's key is not written by _test_ca: make a CA pair of our own with cryptography.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator egress CA")])
    ca = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    (tmp_path / "op-ca.pem").write_text(cert_pem)
    (tmp_path / "op-ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    bound = _https_responder("127.0.0.1", paths)
    port = bound.server_address[1]
    env = {"FORKBOX_EGRESS_CA_CERT": str(tmp_path / "op-ca.pem"), "FORKBOX_EGRESS_CA_KEY": str(tmp_path / "op-ca.key")}
    s = start_server(tmp_path / "home", "--egress-host", "api.secret.test=127.0.0.1",
                     "--egress-allow", f"127.0.0.1:{port}", "--egress-ca-file", paths["ca.pem"], env=env)
    try:
        r = _create(s, {"secrets": {"K": {"value": VALUE, "hosts": ["api.secret.test"], "tls": True}}})
        assert r.status_code == 201, r.text
        code = (
            "import os, ssl, urllib.request\n"
            f"req = urllib.request.Request('https://api.secret.test:{port}/', headers={{'X-Api-Key': os.environ['K']}})\n"
            "i = urllib.request.urlopen(req, timeout=10).read().decode()\n"
            # The leaf the guest got verifies against the operator's CA alone.
            f"only = ssl.create_default_context(cadata={cert_pem!r})\n"
            "j = urllib.request.urlopen(req, timeout=10, context=only).read().decode()\n"
            "(i, j, open(os.environ['SSL_CERT_FILE']).read())"
        )
        out = _exec(s, r.json()["id"], code)
        assert out["error"] is None, out
        i, j, bundle = eval(out["value"])
        assert bound.seen[int(i)]["headers"]["X-Api-Key"] == VALUE
        assert bound.seen[int(j)]["headers"]["X-Api-Key"] == VALUE
        assert cert_pem.strip() in bundle
        assert not (s.home / "egress-ca.key").exists() and not (s.home / "egress-ca.pem").exists()
    finally:
        stop_server(s)
        bound.shutdown()
    # One of the two alone: the server does not start.
    home2 = fresh_home(tmp_path / "home2")
    proc = subprocess.run(
        [forkbox_bin(), "--home", str(home2), "serve", "--listen", "127.0.0.1:0", "--image", shared_image()],
        env={**os.environ, "FORKBOX_EGRESS_CA_CERT": env["FORKBOX_EGRESS_CA_CERT"]},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0 and "go together" in proc.stdout + proc.stderr, proc.stderr[-2000:]


# --- Secrets of API keys and templates ---

KEY_VALUE = "sk-key-0d9c8b7a6f5e4d3c2b1a09f8e7d6c5b4a3928170"
TEMPLATE_VALUE = "sk-tpl-5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a61"
SESSION_VALUE = "sk-ses-9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6"
ALL_VALUES = (VALUE, KEY_VALUE, TEMPLATE_VALUE, SESSION_VALUE)


def _admin_key(s, secrets, tenant="default"):
    r = httpx.post(f"{s.url}/v1/admin/keys", json={"tenant": tenant, "secrets": secrets}, headers=s.headers(), timeout=60)
    assert r.status_code == 201, r.text
    assert not any(v in r.text for v in ALL_VALUES), r.text
    return r.json()


# Sends each named variable's placeholder in a header of its own to the
# bound host and to the other host; what the two responders' indexes are.
_SEND = """
import http.client, json, os
names = {names!r}
def send(host, port):
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/s", headers={{"X-" + n: os.environ.get(n, "unset") for n in names}})
    i = int(c.getresponse().read())
    c.close()
    return i
json.dumps({{"ph": {{n: os.environ.get(n) for n in names}}, "bound": send("api.secret.test", {p1}), "other": send("127.0.0.2", {p2})}})
"""


def _send_code(names, bound, other):
    return _SEND.format(names=list(names), p1=bound.server_address[1], p2=other.server_address[1])


def _arrived(res, bound, other, name):
    """What the bound and the other host got for `name`, and its placeholder."""
    b, o = bound.seen[res["bound"]]["headers"], other.seen[res["other"]]["headers"]
    return b.get(f"X-{name}"), o.get(f"X-{name}"), res["ph"][name]


def test_a_keys_secret_reaches_its_host_from_every_kind_of_sandbox(secret_server, monkeypatch, request):
    s, bound, other = secret_server
    made = _admin_key(s, {"KEY_TOKEN": {"value": KEY_VALUE, "hosts": ["api.secret.test"]}}, tenant="keysecrets")
    key, kid = made["key"], made["id"]
    assert made["secrets"] == [{"name": "KEY_TOKEN", "hosts": ["api.secret.test"]}] and made["tenant"] == "keysecrets"
    code = _send_code(["KEY_TOKEN"], bound, other)

    def check(res):
        at_bound, at_other, ph = _arrived(res, bound, other, "KEY_TOKEN")
        assert ph.startswith("fbx_secret_") and at_bound == KEY_VALUE and at_other == ph

    # A one-shot exec, a batch and a one-shot command.
    r = httpx.post(f"{s.url}/v1/exec", json={"code": code}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    check(json.loads(eval(r.json()["value"])))
    r = httpx.post(f"{s.url}/v1/exec/batch", json={"codes": [code]}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200, r.text
    check(json.loads(eval(r.json()["results"][0]["value"])))
    r = httpx.post(f"{s.url}/v1/commands", json={"cmd": "echo $KEY_TOKEN"}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["stdout"].startswith("fbx_secret_"), r.text
    # Another key of the server: none of it.
    r = httpx.post(f"{s.url}/v1/exec", json={"code": "import os\nos.environ.get('KEY_TOKEN')"}, headers=s.headers(), timeout=120)
    assert r.status_code == 200 and r.json()["value"] is None, r.text

    # A session: it lists the key's secret, and its execs send the value.
    r = httpx.post(f"{s.url}/v1/sessions", json={}, headers=s.headers(key), timeout=60)
    assert r.status_code == 201, r.text
    sess = r.json()
    assert sess["secrets"] == [{"name": "KEY_TOKEN", "hosts": ["api.secret.test"]}]
    r = httpx.post(f"{s.url}/v1/sessions/{sess['id']}/exec", json={"code": code}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    check(json.loads(eval(r.json()["value"])))

    # An E2B sandbox, through E2B's own SDK.
    import e2b

    monkeypatch.setenv("E2B_API_URL", s.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", s.url)
    monkeypatch.setenv("E2B_API_KEY", key)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    sbx = e2b.Sandbox.create()
    try:
        # The sandbox is a session of the key: its own execs, and (with session
        # workers: process isolation) a command through E2B's envd.
        r = httpx.post(f"{s.url}/v1/sessions/{sbx.sandbox_id}/exec", json={"code": code}, headers=s.headers(key), timeout=120)
        assert r.status_code == 200 and r.json()["error"] is None, r.text
        check(json.loads(eval(r.json()["value"])))
        if request.node.callspec.params["secret_server"] == "process":
            sbx.files.write("/tmp/send.py", code.replace("json.dumps(", "print(json.dumps(") + ")\n")
            out = sbx.commands.run("python3 /tmp/send.py")
            check(json.loads(out.stdout))
    finally:
        sbx.kill()

    # The admin routes show names and destinations only; the value is nowhere.
    r = httpx.get(f"{s.url}/v1/admin/keys/{kid}", headers=s.headers(), timeout=60)
    assert r.status_code == 200 and r.json()["secrets"] == made["secrets"] and KEY_VALUE not in r.text
    for path in (f"/v1/sessions/{sess['id']}", "/v1/sessions", "/v1/capabilities"):
        r = httpx.get(f"{s.url}{path}", headers=s.headers(key), timeout=60)
        assert r.status_code == 200 and KEY_VALUE not in r.text, path
    _no_value_anywhere(s, [KEY_VALUE])


def test_changing_a_keys_secrets_applies_to_new_sandboxes(secret_server):
    s, bound, other = secret_server
    made = _admin_key(s, {"ROTATED": {"value": KEY_VALUE, "hosts": ["api.secret.test"]}}, tenant="rotate")
    key, kid = made["key"], made["id"]
    code = _send_code(["ROTATED"], bound, other)
    r = httpx.post(f"{s.url}/v1/sessions", json={}, headers=s.headers(key), timeout=60)
    assert r.status_code == 201, r.text
    before = r.json()["id"]
    # Admin keys only; an unknown id is 404; a bad secret 400 (the value never quoted).
    r = httpx.patch(f"{s.url}/v1/admin/keys/{kid}", json={"secrets": {}}, headers=s.headers(key), timeout=60)
    assert r.status_code == 403, r.text
    r = httpx.patch(f"{s.url}/v1/admin/keys/{'0' * 64}", json={"secrets": {}}, headers=s.headers(), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found", r.text
    r = httpx.patch(f"{s.url}/v1/admin/keys/{kid}", headers=s.headers(), timeout=60,
                    json={"secrets": {"ROTATED": {"value": "bad\nvalue-77123", "hosts": ["api.secret.test"]}}})
    assert r.status_code == 400 and "no CR, LF or NUL" in r.text and "77123" not in r.text, r.text

    r = httpx.patch(f"{s.url}/v1/admin/keys/{kid}", headers=s.headers(), timeout=60,
                    json={"secrets": {"ROTATED": {"value": TEMPLATE_VALUE, "hosts": ["api.secret.test"], "ports": [bound.server_address[1]]}}})
    assert r.status_code == 200, r.text
    assert r.json()["secrets"] == [{"name": "ROTATED", "hosts": ["api.secret.test"], "ports": [bound.server_address[1]]}]
    assert TEMPLATE_VALUE not in r.text
    # A new sandbox of the key gets the new value at once ...
    r = httpx.post(f"{s.url}/v1/exec", json={"code": code}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert _arrived(json.loads(eval(r.json()["value"])), bound, other, "ROTATED")[0] == TEMPLATE_VALUE
    # ... a session made before keeps the secret it was made with.
    r = httpx.post(f"{s.url}/v1/sessions/{before}/exec", json={"code": code}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert _arrived(json.loads(eval(r.json()["value"])), bound, other, "ROTATED")[0] == KEY_VALUE
    # Removed: new sandboxes have no such variable.
    r = httpx.patch(f"{s.url}/v1/admin/keys/{kid}", json={"secrets": {}}, headers=s.headers(), timeout=60)
    assert r.status_code == 200 and r.json()["secrets"] == [], r.text
    r = httpx.post(f"{s.url}/v1/exec", json={"code": "import os\nos.environ.get('ROTATED')"}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["value"] is None, r.text


def _template(s, key, body):
    r = httpx.post(f"{s.url}/v1/templates", json=body, headers=s.headers(key), timeout=60)
    assert r.status_code == 202, r.text
    assert not any(v in r.text for v in ALL_VALUES)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        r = httpx.get(f"{s.url}/v1/templates/{body['name']}", headers=s.headers(key), timeout=60)
        assert r.status_code == 200, r.text
        if r.json()["status"] == "ready":
            return r.json()
        assert r.json()["status"] != "failed", r.text
        time.sleep(0.5)
    pytest.fail(f"template {body['name']} not ready: {r.text}")


def test_precedence_session_over_template_over_key(secret_server):
    s, bound, other = secret_server
    host = ["api.secret.test"]
    made = _admin_key(s, {"A": {"value": KEY_VALUE, "hosts": host}, "B": {"value": KEY_VALUE, "hosts": host}},
                      tenant="layers")
    key = made["key"]
    t = _template(s, key, {"name": "with-secrets", "secrets": {
        "A": {"value": TEMPLATE_VALUE, "hosts": host}, "C": {"value": TEMPLATE_VALUE, "hosts": host}}})
    assert t["secrets"] == [{"name": "A", "hosts": host}, {"name": "C", "hosts": host}]
    code = _send_code(["A", "B", "C"], bound, other)

    def arrived(res):
        return {n: _arrived(res, bound, other, n)[0] for n in "ABC"}

    # A one-shot exec on the template: the key's B, the template's A and C.
    r = httpx.post(f"{s.url}/v1/exec", json={"code": code, "template": "with-secrets"}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert arrived(json.loads(eval(r.json()["value"]))) == {"A": TEMPLATE_VALUE, "B": KEY_VALUE, "C": TEMPLATE_VALUE}
    # A session on it with a C of its own.
    r = httpx.post(f"{s.url}/v1/sessions", headers=s.headers(key), timeout=60,
                   json={"template": "with-secrets", "secrets": {"C": {"value": SESSION_VALUE, "hosts": host}}})
    assert r.status_code == 201, r.text
    sess = r.json()
    assert [x["name"] for x in sess["secrets"]] == ["A", "B", "C"]
    r = httpx.post(f"{s.url}/v1/sessions/{sess['id']}/exec", json={"code": code}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert arrived(json.loads(eval(r.json()["value"]))) == {"A": TEMPLATE_VALUE, "B": KEY_VALUE, "C": SESSION_VALUE}

    # A template made of that session's checkpoint carries its secrets (its
    # memory holds their placeholders): an exec on it sends the same values.
    r = httpx.post(f"{s.url}/v1/sessions/{sess['id']}/checkpoints/1/template", json={"name": "from-session"},
                   headers=s.headers(key), timeout=120)
    assert r.status_code == 201, r.text
    assert [x["name"] for x in r.json()["secrets"]] == ["A", "B", "C"]
    r = httpx.post(f"{s.url}/v1/exec", json={"code": code, "template": "from-session"}, headers=s.headers(key), timeout=120)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert arrived(json.loads(eval(r.json()["value"]))) == {"A": TEMPLATE_VALUE, "B": KEY_VALUE, "C": SESSION_VALUE}

    r = httpx.get(f"{s.url}/v1/templates", headers=s.headers(key), timeout=60)
    assert r.status_code == 200 and not any(v in r.text for v in ALL_VALUES)
    _no_value_anywhere(s, [KEY_VALUE, TEMPLATE_VALUE, SESSION_VALUE])


@pytest.mark.parametrize("path, body, says", [
    ("/v1/admin/keys", {"secrets": {"K": {"value": "v-55123", "hosts": ["10.0.0.1"]}}}, "not a host name"),
    ("/v1/admin/keys", {"tenant": "no/slash", "secrets": {}}, "tenant"),
    ("/v1/admin/keys", {"secrets": {f"K{i}": {"value": "v", "hosts": ["a.example"]} for i in range(17)}}, "at most 16"),
    ("/v1/templates", {"name": "bad-secrets", "secrets": {"K": {"value": "a\r\nX: 55123", "hosts": ["a.example"]}}},
     "no CR, LF or NUL"),
    ("/v1/templates", {"name": "bad-secrets", "secrets": {"K": {"value": 55123, "hosts": ["a.example"]}}},
     "must be a string"),
])
def test_bad_key_and_template_secrets_are_400(secret_server, path, body, says):
    s, _, _ = secret_server
    r = httpx.post(f"{s.url}{path}", json=body, headers=s.headers(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request" and says in r.json()["error"]["message"], r.text
    assert "55123" not in r.text


def test_key_and_template_secrets_survive_a_restart(tmp_path):
    """A key made by `forkbox key create --secrets-file` and a template's
    secrets are stored sealed (keys.db, the template's record): a new server
    process on the data directory still substitutes them."""
    bound = _responder("127.0.0.1")
    port = bound.server_address[1]
    home = tmp_path / "home"
    args = ("--egress-host", "api.secret.test=127.0.0.1", "--egress-allow", f"127.0.0.1:{port}")
    s = start_server(home, *args)
    try:
        spec = tmp_path / "secrets.json"
        spec.write_text(json.dumps({"K": {"value": KEY_VALUE, "hosts": ["api.secret.test"], "ports": [port]}}))
        key = s.create_key("restart", "--secrets-file", str(spec))
        _template(s, key, {"name": "kept", "secrets": {"T": {"value": TEMPLATE_VALUE, "hosts": ["api.secret.test"]}}})
        # A bad file: the CLI says why without quoting the value.
        spec.write_text(json.dumps({"K": {"value": "x-66123\n", "hosts": ["api.secret.test"]}}))
        bad = subprocess.run([forkbox_bin(), "--home", str(home), "key", "create", "--secrets-file", str(spec)],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "no CR, LF or NUL" in bad.stderr and "66123" not in bad.stderr + bad.stdout
    finally:
        stop_server(s)
    # (A server that has keys prints none: it is given the key to use.)
    s2 = start_server(home, *args, key=key)
    try:
        code = (
            "import http.client, os\n"
            f"c = http.client.HTTPConnection('api.secret.test', {port}, timeout=10)\n"
            "c.request('GET', '/', headers={'X-K': os.environ['K'], 'X-T': os.environ['T']})\n"
            "c.getresponse().read().decode()"
        )
        r = httpx.post(f"{s2.url}/v1/exec", json={"code": code, "template": "kept"}, headers=s2.headers(), timeout=120)
        assert r.status_code == 200 and r.json()["error"] is None, r.text
        got = bound.seen[int(eval(r.json()["value"]))]["headers"]
        assert (got["X-K"], got["X-T"]) == (KEY_VALUE, TEMPLATE_VALUE)
        _no_value_anywhere(s2, [KEY_VALUE, TEMPLATE_VALUE])
        _no_value_anywhere(s, [KEY_VALUE, TEMPLATE_VALUE])
    finally:
        stop_server(s2)
        bound.shutdown()


# --- The Python SDK's admin key routes and secrets; the CLI's key list / revoke and template secrets ---


def test_sdk_admin_keys_template_and_session_secrets(secret_server):
    """`client.keys` (create with limits, get, page, list, patch, delete), template and
    session secrets through the SDK, capabilities naming the key's secrets; the SDK's
    errors for the admin routes (Forbidden, KeyNotFound, InvalidRequest, Unauthorized)."""
    import asyncio

    import forkbox

    s, bound, other = secret_server
    host = ["api.secret.test"]
    with forkbox.Forkbox(s.url, s.key) as fb:
        made = fb.keys.create("sdkkeys", secrets={"SDK_TOKEN": {"value": KEY_VALUE, "hosts": host}},
                              limits={"max_sessions": 5, "rate_limit": 1000})
        assert made["key"].startswith("fbk_") and made["tenant"] == "sdkkeys" and made["admin"] is False
        assert made["limits"]["max_sessions"] == 5 and made["limits"]["max_disk_mb"] == 1024
        assert made["secrets"] == [{"name": "SDK_TOKEN", "hosts": host}]
        kid = made["id"]
        got = fb.keys.get(kid)
        assert got["id"] == kid and "key" not in got and got["secrets"] == made["secrets"]
        assert kid in [k["id"] for k in fb.keys.list(tenant="sdkkeys")]
        every = fb.keys.list()
        assert kid in [k["id"] for k in every] and len(every) >= 2
        first = fb.keys.page(limit=1)
        assert len(first["keys"]) == 1 and first["next"] == first["keys"][0]["id"]
        assert not any(v in json.dumps(every) for v in ALL_VALUES) and "fbk_" not in json.dumps(every)
        with pytest.raises(forkbox.InvalidRequest) as e:
            fb.keys.create("sdkkeys", limits={"rate_limit": 0})
        assert e.value.code == "invalid_request" and "rate_limit" in e.value.message
        with pytest.raises(ValueError):
            fb.keys.create("sdkkeys", limits={"rate": 1})
        with pytest.raises(forkbox.KeyNotFound) as e:
            fb.keys.get("0" * 64)
        assert e.value.status == 404 and e.value.code == "key_not_found"
        assert isinstance(e.value, forkbox.NotFound)

        with forkbox.Forkbox(s.url, made["key"]) as kc:
            with pytest.raises(forkbox.Forbidden):
                kc.keys.list()
            # The key's capabilities name its secret, never the value.
            caps = httpx.get(f"{s.url}/v1/capabilities", headers=s.headers(made["key"]), timeout=60)
            assert caps.status_code == 200 and caps.json()["secrets"] == made["secrets"], caps.text
            assert KEY_VALUE not in caps.text
            # A template of the key's tenant with a secret of its own, through the SDK.
            t = kc.create_template("sdk-secrets", secrets={"SDK_TPL": {"value": TEMPLATE_VALUE, "hosts": host}},
                                   timeout=300, poll=0.5)
            assert t["status"] == "ready" and t["secrets"] == [{"name": "SDK_TPL", "hosts": host}]
            caps = httpx.get(f"{s.url}/v1/capabilities", headers=s.headers(made["key"]), timeout=60).json()
            assert [x["secrets"] for x in caps["templates"] if x["name"] == "sdk-secrets"] == [["SDK_TPL"]], caps
            r = kc.exec(_send_code(["SDK_TOKEN", "SDK_TPL"], bound, other), template="sdk-secrets")
            assert r.error is None, r
            res = json.loads(eval(r.value))
            assert _arrived(res, bound, other, "SDK_TOKEN")[0] == KEY_VALUE
            assert _arrived(res, bound, other, "SDK_TPL")[0] == TEMPLATE_VALUE
            # A session's own secret, through the SDK; its info lists names only.
            sess = kc.sessions.create(secrets={"SDK_SES": {"value": SESSION_VALUE, "hosts": host, "ports": [bound.server_address[1]]}})
            assert [x["name"] for x in sess.info.secrets] == ["SDK_SES", "SDK_TOKEN"]
            r = sess.exec(_send_code(["SDK_SES"], bound, other))
            assert r.error is None, r
            assert _arrived(json.loads(eval(r.value)), bound, other, "SDK_SES")[0] == SESSION_VALUE
            # Secrets replaced, then the key revoked: refused at once.
            assert fb.keys.patch(kid, secrets={})["secrets"] == []
            fb.keys.delete(kid)
            with pytest.raises(forkbox.Unauthorized):
                kc.sessions.list()
        with pytest.raises(forkbox.KeyNotFound):
            fb.keys.delete(kid)

    async def async_round():
        async with forkbox.AsyncForkbox(s.url, s.key) as afb:
            k = await afb.keys.create("sdkasync", admin=True, limits={"unlimited": True},
                                      egress={"allow": ["api.secret.test"]})
            assert k["admin"] is True and k["limits"]["rate_limit"] is None and k["egress"]["mode"] == "allowlist"
            assert [x["id"] for x in await afb.keys.list(tenant="sdkasync")] == [k["id"]]
            await afb.keys.delete(k["id"])
            assert await afb.keys.list(tenant="sdkasync") == []

    asyncio.run(async_round())
    _no_value_anywhere(s, ALL_VALUES)


def _cli(home, *args, env=None, stdin=None):
    return subprocess.run([forkbox_bin(), "--home", str(home), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, input=stdin)


def test_cli_key_list_revoke_and_template_secrets_file(tmp_path):
    """`forkbox key list` shows ids, tenants, limits and secret names (never a key or a
    value); `forkbox key revoke` by key or id makes the running server refuse the key
    within a second; `forkbox template build NAME --secrets-file` against a server; the
    CLI's errors are one line and never quote a value."""
    import hashlib

    bound = _responder("127.0.0.1")
    port = bound.server_address[1]
    home = tmp_path / "home"
    s = start_server(home, "--egress-host", "api.secret.test=127.0.0.1", "--egress-allow", f"127.0.0.1:{port}")
    try:
        spec = tmp_path / "secrets.json"
        spec.write_text(json.dumps({"CLI_K": {"value": KEY_VALUE, "hosts": ["api.secret.test"]}}))
        key = s.create_key("clitenant", "--secrets-file", str(spec), "--max-sessions", "7")
        kid = hashlib.sha256(key.encode()).hexdigest()
        out = _cli(home, "key", "list")
        assert out.returncode == 0, out.stderr
        line = [ln for ln in out.stdout.splitlines() if ln.startswith(kid)]
        assert len(line) == 1 and "tenant=clitenant" in line[0] and "sessions=7" in line[0], out.stdout
        assert "secrets=CLI_K" in line[0] and "admin=false" in line[0], line
        assert "fbk_" not in out.stdout and KEY_VALUE not in out.stdout
        assert all(len(ln.split()[0]) == 64 for ln in out.stdout.splitlines()), out.stdout
        only = _cli(home, "key", "list", "--tenant", "clitenant")
        assert only.returncode == 0 and only.stdout.splitlines() == line, only.stdout

        # The template of the key's tenant from a secrets file (stdin), built by the server.
        spec.write_text(json.dumps({"CLI_T": {"value": TEMPLATE_VALUE, "hosts": ["api.secret.test"], "ports": [port]}}))
        env = {"FORKBOX_URL": s.url, "FORKBOX_API_KEY": key}
        out = _cli(home, "template", "build", "cli-secrets", "--secrets-file", "-", env=env, stdin=spec.read_text())
        assert out.returncode == 0, out.stderr
        assert TEMPLATE_VALUE not in out.stdout + out.stderr
        t = httpx.get(f"{s.url}/v1/templates/cli-secrets", headers=s.headers(key), timeout=60).json()
        assert t["secrets"] == [{"name": "CLI_T", "hosts": ["api.secret.test"], "ports": [port]}], t
        code = (
            "import http.client, os\n"
            f"c = http.client.HTTPConnection('api.secret.test', {port}, timeout=10)\n"
            "c.request('GET', '/', headers={'X-K': os.environ['CLI_K'], 'X-T': os.environ['CLI_T']})\n"
            "c.getresponse().read().decode()"
        )
        r = httpx.post(f"{s.url}/v1/exec", json={"code": code, "template": "cli-secrets"}, headers=s.headers(key), timeout=120)
        assert r.status_code == 200 and r.json()["error"] is None, r.text
        got = bound.seen[int(eval(r.json()["value"]))]["headers"]
        assert (got["X-K"], got["X-T"]) == (KEY_VALUE, TEMPLATE_VALUE)
        # Bad files: one line, where not what.
        for text, says in [('{"CLI_T": {"value": "x-44123", "hosts": ["10.0.0.1"]}}', "not a host name"),
                           ('{"CLI_T": {"value": "x-44123", ', "not a JSON object of secrets")]:
            spec.write_text(text)
            bad = _cli(home, "template", "build", "cli-bad", "--secrets-file", str(spec), env=env)
            assert bad.returncode != 0 and says in bad.stderr, bad.stderr
            assert len(bad.stderr.strip().splitlines()) == 1 and "44123" not in bad.stderr + bad.stdout, bad.stderr
            bad = _cli(home, "template", "build", "cli-bad", "--secrets-file", str(spec))
            assert bad.returncode != 0 and says in bad.stderr, bad.stderr
            assert len(bad.stderr.strip().splitlines()) == 1 and "44123" not in bad.stderr + bad.stdout, bad.stderr
        bad = _cli(home, "template", "build", "--secrets-file", str(spec))
        assert bad.returncode != 0 and "needs a template name" in bad.stderr

        # Revoked by the key itself: the server refuses it within a second.
        assert httpx.get(f"{s.url}/v1/sessions", headers=s.headers(key), timeout=60).status_code == 200
        out = _cli(home, "key", "revoke", key)
        assert out.returncode == 0 and out.stdout.strip() == f"revoked {kid}", out.stdout + out.stderr
        t0 = time.monotonic()
        while httpx.get(f"{s.url}/v1/sessions", headers=s.headers(key), timeout=60).status_code != 401:
            assert time.monotonic() - t0 < 5, "a revoked key still works"
            time.sleep(0.05)
        assert time.monotonic() - t0 < 3
        assert httpx.get(f"{s.url}/v1/sessions", headers=s.headers(), timeout=60).status_code == 200
        for arg, says in [(kid, "no API key with id"), ("nonsense", "not a key id")]:
            bad = _cli(home, "key", "revoke", arg)
            assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        # The template stays for the tenant's other keys.
        other = s.create_key("clitenant")
        r = httpx.get(f"{s.url}/v1/templates/cli-secrets", headers=s.headers(other), timeout=60)
        assert r.status_code == 200, r.text
        _no_value_anywhere(s, [KEY_VALUE, TEMPLATE_VALUE])
    finally:
        stop_server(s)
        bound.shutdown()
