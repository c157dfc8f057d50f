"""Per-key limits through the real CLI (`forkbox key create --rate-limit/--max-sessions/--max-disk-mb`)
and a real `forkbox serve`: keys created while the server runs work at once, with their limits."""

import os
import subprocess
import time

import httpx
import pytest

from conftest import forkbox_bin


def test_rate_limited_key_gets_429_with_retry_after(server):
    key = server.create_key("py-rate", "--rate-limit", "2")
    with httpx.Client(base_url=server.url, headers=server.headers(key), timeout=30) as c:
        codes = [c.get("/v1/sessions") for _ in range(8)]
    statuses = [r.status_code for r in codes]
    assert statuses[:2] == [200, 200], statuses
    limited = [r for r in codes if r.status_code == 429]
    assert len(limited) >= 5, statuses
    assert limited[0].json()["error"]["code"] == "rate_limited"
    assert int(limited[0].headers["retry-after"]) >= 1
    time.sleep(1.1)
    assert httpx.get(f"{server.url}/v1/sessions", headers=server.headers(key), timeout=30).status_code == 200


def test_session_quota_gets_403_quota_exceeded(server):
    key = server.create_key("py-quota", "--max-sessions", "1")
    h = server.headers(key)
    first = httpx.post(f"{server.url}/v1/sessions", json={}, headers=h, timeout=60)
    assert first.status_code == 201, first.text
    second = httpx.post(f"{server.url}/v1/sessions", json={}, headers=h, timeout=60)
    assert second.status_code == 403 and second.json()["error"]["code"] == "quota_exceeded", second.text
    fork = httpx.post(f"{server.url}/v1/sessions/{first.json()['id']}/fork", json={}, headers=h, timeout=60)
    assert fork.status_code == 403
    assert httpx.delete(f"{server.url}/v1/sessions/{first.json()['id']}", headers=h, timeout=60).status_code == 204
    assert httpx.post(f"{server.url}/v1/sessions", json={}, headers=h, timeout=60).status_code == 201


def test_disk_quota_refuses_a_checkpoint_that_would_pass_it_and_keeps_the_session(server):
    key = server.create_key("py-disk", "--max-disk-mb", "1")
    h = server.headers(key)
    sid = httpx.post(f"{server.url}/v1/sessions", json={}, headers=h, timeout=60).json()["id"]
    # A 3 MB checkpoint does not fit a 1 MiB quota: it is not written, the exec's result comes with the error.
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "import os\nb = os.urandom(3_000_000)\nprint('ran')"}, headers=h, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded", r.text
    err = r.json()["error"]
    assert err["result"]["stdout"] == "ran\n" and err["result"]["exit_code"] == 0, r.text
    assert err["checkpoint"] is None, r.text
    # The session stays at its previous state (nothing of that exec), and small execs go on.
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "'b' in globals()"}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["value"] == "False", r.text
    # An upload that would pass the quota is refused too; a small one is taken.
    r = httpx.put(f"{server.url}/v1/sessions/{sid}/files/tmp/big.bin", content=os.urandom(2_000_000), headers=h, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded", r.text
    r = httpx.put(f"{server.url}/v1/sessions/{sid}/files/tmp/x.txt", content=b"x", headers=h, timeout=60)
    assert r.status_code in (200, 201, 204), r.text


@pytest.mark.parametrize("flag,value", [("--rate-limit", "0"), ("--max-sessions", "-1"), ("--max-disk-mb", "lots")])
def test_key_create_rejects_bad_limits_in_one_line(server, flag, value):
    out = subprocess.run([forkbox_bin(), "--home", str(server.home), "key", "create", flag, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "fbk_" not in out.stdout
