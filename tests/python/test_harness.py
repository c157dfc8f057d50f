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
