#!/usr/bin/env python3
"""The relay's cost for secrets: latency of a small GET from a sandbox to a
loopback server, plain HTTP and HTTPS, with no secret, with a secret applied
(plain: the header relay; HTTPS: TLS termination), a new connection per
request and on one keep-alive connection. Uses the test harness
(tests/python/conftest.py): run with the pyvenv's python and FORKBOX_BIN set.

    FORKBOX_BIN=target/release/forkbox target/pyvenv/bin/python scripts/bench_secrets.py [N]
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))

import httpx  # noqa: E402
from conftest import start_server, stop_server  # noqa: E402
from test_secrets import _https_responder, _responder, _test_ca  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200

GUEST = """
import http.client, os, ssl, time, json
ph = os.environ.get("TOK", "none")
def conn(tls):
    if tls:
        return http.client.HTTPSConnection("api.secret.test", {port}, timeout=10, context=CTX)
    return http.client.HTTPConnection("api.secret.test", {port}, timeout=10)
CTX = ssl.create_default_context(cadata={cadata!r}) if {tls} and {cadata!r} else ssl.create_default_context()
def one(c):
    c.request("GET", "/", headers={{"Authorization": "Bearer " + ph}})
    c.getresponse().read()
def p50(xs):
    xs = sorted(xs); return xs[len(xs) // 2] * 1000
new, keep = [], []
for _ in range(5):
    c = conn({tls}); one(c); c.close()
for _ in range({n}):
    t = time.perf_counter(); c = conn({tls}); one(c); c.close(); new.append(time.perf_counter() - t)
c = conn({tls}); one(c)
for _ in range({n}):
    t = time.perf_counter(); one(c); keep.append(time.perf_counter() - t)
c.close()
json.dumps({{"new_p50_ms": round(p50(new), 3), "keepalive_p50_ms": round(p50(keep), 3)}})
"""


def main():
    d = tempfile.mkdtemp()
    paths = _test_ca(d)
    with open(paths["ca.pem"]) as f:
        test_ca = f.read()
    plain, tls = _responder("127.0.0.1"), _https_responder("127.0.0.1", paths)
    pp, tp = plain.server_address[1], tls.server_address[1]
    s = start_server(
        Path(d) / "home", "--egress-host", "api.secret.test=127.0.0.1",
        "--egress-allow", f"127.0.0.1:{pp}", "--egress-allow", f"127.0.0.1:{tp}",
        "--egress-ca-file", paths["ca.pem"],
    )
    try:
        cases = [
            ("http, no secret", None, False),
            ("http, secret applied", {"value": "sk-bench", "hosts": ["api.secret.test"]}, False),
            ("https, no secret", None, True),
            ("https, tls secret (terminated)", {"value": "sk-bench", "hosts": ["api.secret.test"], "tls": True}, True),
        ]
        for name, secret, is_tls in cases:
            body = {"secrets": {"TOK": secret}} if secret else {}
            r = httpx.post(f"{s.url}/v1/sessions", json=body, headers=s.headers(), timeout=60)
            r.raise_for_status()
            sid = r.json()["id"]
            # Without the egress CA (no TLS secret) the guest trusts the test CA explicitly;
            # with it, its default context (the forkbox bundle) is what it uses.
            cadata = test_ca if is_tls and not (secret and secret.get("tls")) else ""
            code = GUEST.format(port=tp if is_tls else pp, tls=is_tls, n=N, cadata=cadata)
            r = httpx.post(f"{s.url}/v1/sessions/{sid}/exec", json={"code": code}, headers=s.headers(), timeout=600)
            out = r.json()
            if out.get("error"):
                raise SystemExit(f"{name}: {out['error']}")
            print(f"{name:34} {json.loads(eval(out['value']))}", flush=True)
    finally:
        stop_server(s)
        plain.shutdown()
        tls.shutdown()


if __name__ == "__main__":
    main()
