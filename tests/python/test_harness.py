"""The harness itself: a real server process answers with its API key and refuses without it."""

import httpx


def test_server_process_serves_health_and_enforces_keys(server):
    r = httpx.get(f"{server.url}/healthz", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.post(f"{server.url}/v1/exec", json={"code": "1+1"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.post(f"{server.url}/v1/exec", json={"code": "print(6*7)"}, headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["stdout"] == "42\n"


def test_an_over_size_body_is_refused_and_its_connection_closed(server):
    # The server never reads the rest of such a body, so the connection cannot
    # carry another request: the 413 must say `Connection: close`, or a pooling
    # client sends its next request into a connection that is going away.
    with httpx.Client(headers=server.headers(), timeout=60) as c:
        r = c.post(f"{server.url}/v1/exec", content=b'{"code": "' + b"#" * (3 << 20) + b'"}')
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.headers.get("connection") == "close"
        r = c.post(f"{server.url}/v1/exec", json={"code": "1 + 1"})
        assert r.status_code == 200 and r.json()["value"] == "2"
