"""Sessions that keep running between calls, against a real `forkbox serve` (its
default jailed session workers) over real HTTP: threads and processes an exec
leaves running go on between calls, bounded like an exec; one-shot execs still
end theirs; checkpoints record the agent process with its threads."""

import time

import httpx
import pytest

TIMEOUT = 60


@pytest.fixture
def api(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=TIMEOUT) as c:
        yield c


def session(api) -> str:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def run(api, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/exec", json={"code": code})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.get("error") is None, body
    return body


COUNTER_THREAD = """
import threading, time
n = 0
def tick():
    global n
    while True:
        n += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
"""


def test_a_thread_keeps_counting_between_calls(api):
    sid = session(api)
    run(api, sid, COUNTER_THREAD)
    a = int(run(api, sid, "n")["value"])
    time.sleep(1.0)
    b = int(run(api, sid, "n")["value"])
    # 10 ms a tick: a frozen session would show a handful at most.
    assert b - a >= 30, (a, b)


COUNTER_PROCESS = """
import subprocess
p = subprocess.Popen(["/bin/sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"])
"""


def read_count(api, sid: str) -> int:
    return int(run(api, sid, "int(open('/tmp/count').read() or 0)")["value"])


def test_a_child_process_keeps_counting_between_calls_and_can_be_killed(api):
    sid = session(api)
    out = run(api, sid, COUNTER_PROCESS)
    assert "killed" not in out["stderr"], out
    time.sleep(0.5)
    a = read_count(api, sid)
    time.sleep(1.0)
    b = read_count(api, sid)
    assert b - a >= 8, (a, b)
    assert run(api, sid, "p.poll()")["value"] is None
    # Killed from a later call: it ends, and the count stops.
    assert run(api, sid, "p.kill(); p.wait()")["value"] == "-9"
    c = read_count(api, sid)
    time.sleep(0.5)
    assert read_count(api, sid) == c


def test_one_shot_exec_still_ends_its_children(api):
    r = api.post("/v1/exec", json={"code": "import subprocess\nsubprocess.Popen(['sleep', '5'])"})
    assert r.status_code == 200, r.text
    assert "still running at the end of the exec was killed" in r.json()["stderr"], r.json()


def test_a_flooding_or_allocating_background_process_is_bounded(api):
    sid = session(api)
    run(api, sid, "import subprocess\nflood = subprocess.Popen(['yes'])")
    hog = (
        "import subprocess, sys\n"
        "hog = subprocess.Popen([sys.executable, '-c', 'a = []\\nwhile True: a.append(bytearray(1 << 24))'])"
    )
    run(api, sid, hog)
    time.sleep(1.0)
    # The session answers, its calls' output is their own, and the hog hit the memory limit.
    t0 = time.monotonic()
    out = run(api, sid, "print('mine')\nhog.wait(timeout=30)")
    assert out["stdout"] == "mine\n", out["stdout"][:200]
    assert out["value"] not in (None, "0"), out
    assert time.monotonic() - t0 < 30
    assert run(api, sid, "flood.poll()")["value"] is None
    run(api, sid, "flood.kill(); flood.wait()")


def test_checkpoints_bring_threads_back_running(api):
    sid = session(api)
    run(api, sid, COUNTER_THREAD)
    time.sleep(0.3)
    k = int(run(api, sid, "n")["value"])
    seq = api.get(f"/v1/sessions/{sid}").json()["checkpoint"]
    time.sleep(0.5)
    later = int(run(api, sid, "n")["value"])
    assert later > k
    # Revert: the counter is back near k (where that checkpoint was taken), and counts on.
    r = api.post(f"/v1/sessions/{sid}/revert", json={"checkpoint": seq})
    assert r.status_code == 200, r.text
    back = int(run(api, sid, "n")["value"])
    assert k <= back < later, (k, back, later)
    time.sleep(0.5)
    assert int(run(api, sid, "n")["value"]) >= back + 20
    # A fork counts on its own from the same point.
    r = api.post(f"/v1/sessions/{sid}/fork", json={})
    assert r.status_code == 201, r.text
    fid = r.json()["id"]
    run(api, sid, "n = -1000000")
    time.sleep(0.3)
    assert int(run(api, fid, "n")["value"]) > 0
    assert int(run(api, sid, "n")["value"]) < 0

