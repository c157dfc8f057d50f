"""Sessions that keep running between calls, against a real `forkbox serve` (its
default jailed session workers) over real HTTP: threads and processes an exec
leaves running go on between calls, bounded like an exec; one-shot execs still
end theirs; checkpoints record the agent process with its threads."""

import time

import httpx

from conftest import run, session

TIMEOUT = 60


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
    # A 512 MiB limit: the hog writes every page it allocates (~36 us a page on this
    # nested-KVM host), so the limit it must reach bounds how long the test takes.
    r = api.post("/v1/sessions", json={"memory_mb": 512})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
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


def start(api, sid: str, cmd, **kw) -> dict:
    r = api.post(f"/v1/sessions/{sid}/commands", json={"cmd": cmd, "background": True, **kw})
    assert r.status_code == 201, r.text
    return r.json()


def output(api, sid: str, pid: int, **q) -> dict:
    r = api.get(f"/v1/sessions/{sid}/processes/{pid}/output", params=q)
    assert r.status_code == 200, r.text
    return r.json()


def test_background_commands_list_read_signal_and_wait(api):
    sid = session(api)
    started = start(api, sid, "i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done")
    pid = started["pid"]
    assert started["process"]["state"] == "running" and started["process"]["argv"][0] == "/bin/sh"
    time.sleep(1.0)
    procs = api.get(f"/v1/sessions/{sid}/processes").json()["processes"]
    assert [p["pid"] for p in procs] == [pid]
    assert procs[0]["state"] == "running" and procs[0]["stdout_bytes"] > 50
    # Its output is its own (not a later call's), readable from any offset, reconnectable.
    assert run(api, sid, "print('call')")["stdout"] == "call\n"
    first = output(api, sid, pid)
    lines = first["data"].splitlines()
    assert lines[:3] == ["line 1", "line 2", "line 3"], first
    assert first["offset"] == 0 and first["next_offset"] == len(first["data"].encode())
    time.sleep(0.5)
    more = output(api, sid, pid, offset=first["next_offset"])
    assert more["offset"] == first["next_offset"] and more["data"].startswith(f"line {len(lines) + 1}\n"), more
    assert output(api, sid, pid, offset=3, max=4)["data"] == "e 1\n"
    # SIGTERM ends it; wait says how.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 15})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 10})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json().get("signal")) == ("exited", 15), r.json()
    assert output(api, sid, pid)["running"] is False


def test_wait_returns_the_exit_status_and_stderr_is_separate(api):
    sid = session(api)
    pid = start(api, sid, "sleep 0.3; echo out; echo err >&2; exit 7")["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 20})
    assert (r.json()["state"], r.json().get("exit_code")) == ("exited", 7), r.json()
    assert output(api, sid, pid)["data"] == "out\n"
    assert output(api, sid, pid, stream="stderr")["data"] == "err\n"
    # A wait that times out answers with the process still running.
    pid2 = start(api, sid, ["sleep", "30"])["pid"]
    t0 = time.monotonic()
    r = api.post(f"/v1/sessions/{sid}/processes/{pid2}/wait", json={"timeout_seconds": 0.5})
    assert r.json()["state"] == "running" and time.monotonic() - t0 < 10
    api.post(f"/v1/sessions/{sid}/processes/{pid2}/signal", json={"signal": 9})


def test_process_errors_are_clear(api, server):
    sid = session(api)
    r = api.get(f"/v1/sessions/{sid}/processes/4242/output")
    assert r.status_code == 404 and r.json()["error"]["code"] == "process_not_found", r.text
    pid = start(api, sid, ["sleep", "30"])["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 99})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    r = api.get(f"/v1/sessions/{sid}/processes/{pid}/output", params={"stream": "stdin"})
    assert r.status_code == 400, r.text
    # Another tenant's key sees no such session.
    other = server.create_key("py-bg-other")
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/processes", headers=server.headers(other), timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    # A command that cannot start is a command's answer, not a process.
    r = api.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["no-such-program-x"], "background": True})
    assert r.status_code == 200 and r.json()["exit_code"] == 127, r.text
    # Streaming a background command is refused.
    r = api.post(f"/v1/sessions/{sid}/commands/stream", json={"cmd": "true", "background": True})
    assert r.status_code == 400, r.text
    api.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 9})


def test_a_process_output_ring_keeps_the_last_256_kib_by_offset(api):
    sid = session(api)
    # One write of 400,004 bytes: its head is dropped, the offsets stay the stream's.
    code = "import sys; sys.stdout.write('x' * 400000 + 'end\\n'); sys.stdout.flush()"
    pid = start(api, sid, ["python3", "-c", code])["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 30})
    assert (r.json()["state"], r.json().get("exit_code"), r.json()["stdout_bytes"]) == ("exited", 0, 400004), r.json()
    out = output(api, sid, pid)
    assert (out["offset"], out["dropped"], out["end"], out["next_offset"]) == (400004 - 262144, 400004 - 262144, 400004, 400004), {k: v for k, v in out.items() if k != "data"}
    assert out["data"].endswith("xend\n") and len(out["data"]) == 262144


def sse_events(resp):
    """(event, data) pairs of a Server-Sent Events response, as they arrive."""
    import json

    event, data = None, []
    for line in resp.iter_lines():
        if line.startswith(":"):
            continue
        if line == "":
            if event is not None or data:
                yield event, json.loads("\n".join(data)) if data else None
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def test_stdin_round_trip_with_cat_and_close_ends_it(api):
    sid = session(api)
    pid = start(api, sid, ["cat"], stdin=True)["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "hello\n"})
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    # Raw bytes and base64 too.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", content=b"raw \xc3\xa9\n",
                 headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data_b64": "YjY0Cg=="})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while output(api, sid, pid)["data"] != "hello\nraw é\nb64\n":
        assert time.monotonic() < deadline, output(api, sid, pid)
        time.sleep(0.05)
    # cat still runs (it waits for more) until its stdin is closed.
    assert api.get(f"/v1/sessions/{sid}/processes/{pid}").json()["state"] == "running"
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "last\n", "eof": True})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 20})
    assert (r.json()["state"], r.json().get("exit_code")) == ("exited", 0), r.json()
    assert output(api, sid, pid)["data"] == "hello\nraw é\nb64\nlast\n"
    # Closed, ended: a clear 409.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "more"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stdin_closed", r.text


def test_stdin_errors_are_clear(api):
    sid = session(api)
    # Without stdin: true the process reads /dev/null, and its stdin cannot be written.
    pid = start(api, sid, ["sh", "-c", "cat; echo eof; sleep 30"])["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 0.5})
    assert output(api, sid, pid)["data"] == "eof\n"
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "x"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stdin_closed", r.text
    assert "stdin" in r.json()["error"]["message"]
    api.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 9})
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "x", "data_b64": "eA=="})
    assert r.status_code == 400, r.text
    r = api.post(f"/v1/sessions/{sid}/processes/4242/stdin", json={"data": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "process_not_found", r.text
    # stdin is for background commands.
    r = api.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true", "stdin": True})
    assert r.status_code == 400, r.text
    # A reader that does not read: the stdin buffer (256 KiB) fills, a write past it waits, then 409.
    pid = start(api, sid, ["sleep", "60"], stdin=True)["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", content=b"a" * (256 << 10),
                 headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "b"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stdin_full", r.text
    assert 4 <= time.monotonic() - t0 < 15
    api.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 9})


def test_follow_streams_lines_before_the_process_ends(api):
    sid = session(api)
    pid = start(api, sid, "for i in 1 2 3 4 5; do echo line $i; echo err $i >&2; sleep 0.4; done; exit 3")["pid"]
    t0 = time.monotonic()
    seen, errs, first_at, exit_ev = [], [], None, None
    with api.stream("GET", f"/v1/sessions/{sid}/processes/{pid}/output", params={"follow": "true"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for ev, data in sse_events(r):
            if ev == "stdout":
                if first_at is None:
                    first_at = time.monotonic() - t0
                seen.append(data["data"])
            elif ev == "stderr":
                errs.append(data["data"])
            elif ev == "exit":
                exit_ev = data
                break
            # The session stays usable while a follower is attached.
            if len(seen) == 2 and ev == "stdout":
                assert run(api, sid, "print(6 * 7)")["stdout"] == "42\n"
    total = time.monotonic() - t0
    assert "".join(seen) == "".join(f"line {i}\n" for i in range(1, 6))
    assert "".join(errs) == "".join(f"err {i}\n" for i in range(1, 6))
    assert exit_ev["state"] == "exited" and exit_ev["exit_code"] == 3, exit_ev
    # The first line came well before the end (2 s of sleeps).
    assert first_at < total - 1.0, (first_at, total)
    # Reconnect from an offset: only what follows it.
    with api.stream("GET", f"/v1/sessions/{sid}/processes/{pid}/output",
                    params={"follow": "true", "stream": "stdout", "offset": 14}) as r:
        evs = list(sse_events(r))
    assert [e for e, _ in evs] == ["stdout", "exit"], evs
    assert evs[0][1]["data"] == "line 3\nline 4\nline 5\n" and evs[0][1]["offset"] == 14, evs
    # A follow of an unknown process is an HTTP error, not a stream.
    r = api.get(f"/v1/sessions/{sid}/processes/4242/output", params={"follow": "true"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "process_not_found", r.text


def test_background_commands_are_refused_clearly_with_thread_isolation(tmp_path):
    from conftest import run, session, start_server, stop_server

    s = start_server(tmp_path / "home", "--isolation", "thread")
    try:
        with httpx.Client(base_url=s.url, headers=s.headers(), timeout=TIMEOUT) as c:
            sid = session(c)
            r = c.post(f"/v1/sessions/{sid}/commands", json={"cmd": ["sleep", "5"], "background": True})
            assert r.status_code == 400 and "--isolation" in r.json()["error"]["message"], r.text
            # Foreground commands work as before.
            r = c.post(f"/v1/sessions/{sid}/commands", json={"cmd": "echo fg"})
            assert r.status_code == 200 and r.json()["stdout"] == "fg\n", r.text
    finally:
        stop_server(s)


def test_background_work_stops_when_the_keys_cpu_budget_is_spent(server):
    # A key of its own tenant with a 2-second bucket (refilled at 2 s an hour).
    key = server.create_key("cpuhog", "--cpu-seconds-per-hour", "2")
    with httpx.Client(base_url=server.url, headers=server.headers(key), timeout=TIMEOUT) as hog:
        sid = session(hog)
        pid = start(hog, sid, "python3 -c 'while True: pass'")["pid"]

        def cpu() -> float:
            r = hog.get(f"/v1/sessions/{sid}/processes/{pid}")
            assert r.status_code == 200, r.text
            return r.json()["cpu_seconds"]

        deadline = time.monotonic() + 30
        while cpu() < 2.0:
            assert time.monotonic() < deadline, "the loop never used its budget"
            time.sleep(0.25)
        # Charged within a second, then held: the loop gets (almost) no more CPU.
        time.sleep(2.5)
        a = cpu()
        time.sleep(2.0)
        b = cpu()
        assert b - a < 0.3, (a, b)
        assert a < 5.0, a
        assert cpu() == b
        # The key's calls are refused meanwhile; the process is still there, held.
        r = hog.post(f"/v1/sessions/{sid}/exec", json={"code": "1"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "cpu_budget_exceeded", r.text
        assert hog.get(f"/v1/sessions/{sid}/processes/{pid}").json()["state"] == "running"
        hog.post(f"/v1/sessions/{sid}/processes/{pid}/signal", json={"signal": 9})


def wait_output(api, sid: str, pid: int, needle: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while True:
        data = output(api, sid, pid)["data"]
        if needle in data:
            return data
        assert time.monotonic() < deadline, (needle, data)
        time.sleep(0.05)


def test_a_command_on_a_pty_is_a_terminal_with_echo_resize_and_ctrl_c(api):
    sid = session(api)
    prog = ("import os, sys, signal\n"
            "print('tty', os.isatty(0), os.isatty(1), os.get_terminal_size(), flush=True)\n"
            "signal.signal(signal.SIGWINCH, lambda *a: print('size', os.get_terminal_size(), flush=True))\n"
            "signal.signal(signal.SIGINT, lambda *a: (print('interrupted', flush=True), os._exit(5)))\n"
            "for line in sys.stdin:\n"
            "    print('got', line.strip().upper(), flush=True)\n")
    started = start(api, sid, ["python3", "-c", prog], pty={"rows": 24, "cols": 80})
    pid = started["pid"]
    wait_output(api, sid, pid, "tty True True os.terminal_size(columns=80, lines=24)\r\n")
    # What is typed is echoed by the terminal and read as a line by the program.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "hello\n"})
    assert r.status_code == 200, r.text
    wait_output(api, sid, pid, "hello\r\ngot HELLO\r\n")
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/resize", json={"rows": 40, "cols": 120})
    assert r.status_code == 200, r.text
    wait_output(api, sid, pid, "size os.terminal_size(columns=120, lines=40)")
    # ^C is SIGINT for the terminal's foreground group.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/stdin", json={"data": "\x03"})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", json={"timeout_seconds": 20})
    assert (r.json()["state"], r.json().get("exit_code")) == ("exited", 5), r.json()
    assert "^C" in wait_output(api, sid, pid, "interrupted")
    # Bad sizes and processes without a pty are refused clearly.
    r = api.post(f"/v1/sessions/{sid}/processes/{pid}/resize", json={"rows": 0, "cols": 80})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    other = start(api, sid, ["sleep", "30"])["pid"]
    r = api.post(f"/v1/sessions/{sid}/processes/{other}/resize", json={"rows": 10, "cols": 10})
    assert r.status_code == 400 and "pty" in r.json()["error"]["message"], r.text
    r = api.post(f"/v1/sessions/{sid}/commands", json={"cmd": "true", "pty": {"rows": 2, "cols": 2}})
    assert r.status_code == 400 and "background" in r.json()["error"]["message"], r.text


# A Python child that writes an incrementing number (kept in its own memory,
# never read back from the file) to /tmp/pcount every ~20 ms.
PY_COUNTER = """
import subprocess, sys
counter = subprocess.Popen([sys.executable, '-c', '''
import os, time
n = 0
while True:
    n += 1
    with open("/tmp/pcount.tmp", "w") as f:
        f.write(str(n))
    os.replace("/tmp/pcount.tmp", "/tmp/pcount")
    time.sleep(0.02)
'''])
"""


def pcount(api, sid: str) -> int:
    """The count (0 before the child's Python wrote it first)."""
    code = "import os\nint(open('/tmp/pcount').read()) if os.path.exists('/tmp/pcount') else 0"
    return int(run(api, sid, code)["value"])


def wait_pcount(api, sid: str, above: int) -> int:
    """The count, once it is past `above` (it keeps counting), within a few seconds."""
    deadline = time.monotonic() + 10
    while True:
        n = pcount(api, sid)
        if n > above or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def checkpoint_of(api, sid: str) -> int:
    return api.get(f"/v1/sessions/{sid}").json()["checkpoint"]


def test_checkpoints_bring_a_child_process_back_running_from_where_it_was(api):
    sid = session(api)
    run(api, sid, PY_COUNTER)
    k = wait_pcount(api, sid, 5)
    seq = checkpoint_of(api, sid)
    later = wait_pcount(api, sid, k + 25)
    assert later > k + 25, (k, later)
    # Revert: the child comes back with its memory as it was at that checkpoint,
    # counting on from there (not from 0, not from the later value).
    r = api.post(f"/v1/sessions/{sid}/revert", json={"checkpoint": seq})
    assert r.status_code == 200, r.text
    back = pcount(api, sid)
    assert k <= back < later, (k, back, later)
    on = wait_pcount(api, sid, back + 10)
    assert on > back + 10, (back, on)
    # The agent still has it as its running child.
    assert run(api, sid, "counter.poll()")["value"] is None
    # A fork has its own counter, on its own file system, from the same point.
    r = api.post(f"/v1/sessions/{sid}/fork", json={})
    assert r.status_code == 201, r.text
    fid = r.json()["id"]
    assert run(api, sid, "counter.kill(); counter.wait()")["value"] == "-9"
    stopped = pcount(api, sid)
    f0 = pcount(api, fid)
    assert f0 >= on - 1, (on, f0)
    f1 = wait_pcount(api, fid, f0 + 10)
    assert f1 > f0 + 10, (f0, f1)
    assert run(api, fid, "counter.poll()")["value"] is None
    time.sleep(0.3)
    assert pcount(api, sid) == stopped
    run(api, fid, "counter.kill(); counter.wait()")


def evict(api, server, sid: str) -> None:
    """Pause the session (E2B's pause: it is evicted to disk) and wait until it is not resident."""
    r = httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers={"X-API-KEY": server.key}, timeout=TIMEOUT)
    assert r.status_code == 204, r.text
    deadline = time.monotonic() + 20
    while api.get(f"/v1/sessions/{sid}").json()["resident"]:
        assert time.monotonic() < deadline, "not evicted"
        time.sleep(0.2)


def test_an_evicted_session_comes_back_with_its_child_running(api, server):
    sid = session(api)
    run(api, sid, PY_COUNTER)
    k = wait_pcount(api, sid, 5)
    evict(api, server, sid)
    back = pcount(api, sid)
    assert back >= k, (k, back)
    on = wait_pcount(api, sid, back + 10)
    assert on > back + 10, (back, on)
    assert run(api, sid, "counter.poll()")["value"] is None
    assert run(api, sid, "counter.kill(); counter.wait()")["value"] == "-9"


PIPE_CHILD = """
import subprocess, sys
talker = subprocess.Popen([sys.executable, '-u', '-c', '''
import sys, time
i = 0
while True:
    i += 1
    print(i, flush=True)
    time.sleep(0.02)
'''], stdout=subprocess.PIPE, text=True)
first = int(talker.stdout.readline())
"""


def test_a_pipe_between_the_agent_and_its_child_still_delivers_after_a_revert(api):
    sid = session(api)
    run(api, sid, PIPE_CHILD)
    assert run(api, sid, "first")["value"] == "1"
    a = int(run(api, sid, "int(talker.stdout.readline())")["value"])
    seq = checkpoint_of(api, sid)
    time.sleep(0.3)
    run(api, sid, "x = 1")
    r = api.post(f"/v1/sessions/{sid}/revert", json={"checkpoint": seq})
    assert r.status_code == 200, r.text
    # The agent's read end and the child's write end are one pipe again: lines keep coming, in order.
    got = [int(run(api, sid, "int(talker.stdout.readline())")["value"]) for _ in range(3)]
    assert got[0] > a and got[0] < got[1] < got[2], (a, got)
    assert run(api, sid, "talker.poll()")["value"] is None
    run(api, sid, "talker.kill(); talker.wait()")


def procs_files(server) -> dict:
    """The process memory files (`<checkpoint>.procs`) of the server's sessions: name -> (mtime, size)."""
    d = server.home / "sessions" / "layers"
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in d.glob("*.procs")}


def test_a_childs_memory_is_written_whole_once_then_only_what_it_changed(api, server):
    before = set(procs_files(server))
    sid = session(api)
    run(api, sid, PY_COUNTER)
    wait_pcount(api, sid, 5)
    for i in range(4):
        run(api, sid, f"x = {i}")
    ours = sorted((t, s, n) for n, (t, s) in procs_files(server).items() if n not in before)
    # One file per checkpoint since the child started (an exec of pure Python as well).
    assert len(ours) >= 5, ours
    whole = max(s for _, s, _ in ours)
    assert whole > 256 << 10, f"the child's memory, recorded whole once: {ours}"
    # The last checkpoints (the child idle between its writes) hold only the pages it changed.
    for _, s, n in ours[-3:]:
        assert s * 4 < whole, f"{n}: {s} bytes, the whole child {whole}: {ours}"
    # An evicted session comes back from that chain of layers.
    evict(api, server, sid)
    back = pcount(api, sid)
    assert wait_pcount(api, sid, back + 10) > back + 10
    # The files go with their checkpoints.
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    left = set(procs_files(server)) & {n for _, _, n in ours}
    assert not left, left
