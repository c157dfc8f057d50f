"""The synchronous SDK (`forkbox.Forkbox`) against a real `forkbox serve`."""

import threading
import time

import pytest

import forkbox
from forkbox import Forkbox, Result, Stderr, Stdout


@pytest.fixture
def fb(server):
    with Forkbox(server.url, server.key) as c:
        yield c


def test_defaults_come_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("FORKBOX_URL", server.url)
    monkeypatch.setenv("FORKBOX_API_KEY", server.key)
    with Forkbox() as c:
        assert c.url == server.url
        assert c.exec("6 * 7").value == "42"


def test_exec_one_shot_value_stdout_stderr_error(fb):
    r = fb.exec("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7", timeout=20)
    assert (r.value, r.stdout, r.stderr, r.error, r.ok) == ("42", "out\n", "err\n", None, True)
    assert r.runtime_ms > 0 and r.checkpoint is None
    r = fb.exec("1 / 0")
    assert not r.ok and r.value is None
    assert r.error.type == "ZeroDivisionError" and "division by zero" in r.error.message
    assert "Traceback" in r.error.traceback and "ZeroDivisionError" in r.error.traceback
    # One-shot execs share nothing.
    fb.exec("leak = 1")
    assert fb.exec("'leak' in globals()").value == "False"


def test_exec_batch_keeps_order_and_reports_each_exec(fb):
    rs = fb.exec_batch(["1 + 1", "raise KeyError('k')", "print('x' * 3)"])
    assert len(rs) == 3
    assert rs[0].value == "2"
    assert rs[1].error.type == "KeyError"
    assert rs[2].stdout == "xxx\n"
    with pytest.raises(forkbox.InvalidRequest):
        fb.exec_batch([])


def test_session_lifecycle_state_checkpoints_revert_fork_delete(fb):
    s = fb.sessions.create(tags={"suite": "sdk-sync", "n": "1"}, memory_mb=512, timeout=15)
    assert s.id and s.info.tags == {"suite": "sdk-sync", "n": "1"}
    assert (s.info.memory_mb, s.info.timeout_seconds, s.info.checkpoint) == (512, 15.0, None)
    r1 = s.exec("x = 10")
    r2 = s.exec("x += 5\nx")
    assert (r1.checkpoint, r2.checkpoint, r2.value) == (1, 2, "15")
    assert s.info.checkpoint == 2
    cps = s.checkpoints()
    assert [(c.seq, c.code, c.head) for c in cps] == [(1, "x = 10", False), (2, "x += 5\nx", True)]
    assert cps[1].parent == 1 and cps[0].bytes >= 0

    got = fb.sessions.get(s.id)
    assert got.id == s.id and got.info.checkpoint == 2
    assert s.id in [x.id for x in fb.sessions.list(tags={"suite": "sdk-sync"})]
    assert s.id not in [x.id for x in fb.sessions.list(tags={"suite": "other"})]

    t = s.fork(1, tags={"suite": "sdk-sync-fork"})
    assert t.id != s.id and t.info.forked_from == {"session": s.id, "checkpoint": 1}
    assert t.exec("x").value == "10"
    assert s.exec("x").value == "15"  # the fork did not touch its parent

    s.revert(1)
    assert s.info.checkpoint == 1
    assert s.exec("x").value == "10"
    assert s.refresh().info.checkpoint == s.checkpoints()[-1].seq

    s.delete()
    with pytest.raises(forkbox.SessionNotFound) as e:
        fb.sessions.get(s.id)
    assert (e.value.status, e.value.code) == (404, "session_not_found")
    assert t.exec("x * 2").value == "20"  # a fork outlives its parent
    t.delete()


def test_session_errors_map_to_exceptions(fb, server):
    s = fb.sessions.create(timeout=2)
    s.exec("kept = 'yes'")
    with pytest.raises(forkbox.CheckpointNotFound) as e:
        s.revert(99)
    assert e.value.status == 404
    with pytest.raises(forkbox.CheckpointNotFound):
        s.fork(99)
    with pytest.raises(forkbox.Timeout) as e:
        s.exec("while True: pass")
    assert (e.value.status, e.value.code) == (408, "timeout")
    assert s.exec("kept").value == "'yes'"  # rolled back to its last checkpoint
    with pytest.raises(forkbox.GuestError) as e:
        s.exec("import os; os._exit(3)")
    assert e.value.status == 422
    assert s.exec("kept").value == "'yes'"
    with pytest.raises(forkbox.PayloadTooLarge) as e:
        s.exec("#" * (1 << 20) + "x")  # over the 1 MiB code limit
    assert e.value.code == "code_too_large"
    # Over the 2 MiB body limit (its own client: the server drops that connection unread).
    with Forkbox(server.url, server.key) as c, pytest.raises(forkbox.PayloadTooLarge) as e:
        forkbox.Session(c, s.info).exec("#" * (3 << 20))
    assert e.value.status == 413
    with pytest.raises(forkbox.InvalidRequest) as e:
        fb.sessions.create(memory_mb=1)
    assert e.value.code == "invalid_request"
    with pytest.raises(forkbox.InvalidRequest):
        fb.exec("1", timeout=-1)
    with pytest.raises(forkbox.SessionNotFound):
        fb.sessions.get("s_doesnotexist")
    s.delete()
    with pytest.raises(forkbox.SessionNotFound):
        s.exec("1")
    with pytest.raises(forkbox.SessionNotFound):
        s.delete()


def test_busy_session_raises_session_busy(fb):
    s = fb.sessions.create()
    s.exec("import time")
    errors, results = [], []

    def slow():
        results.append(s.exec("time.sleep(3); 'slept'"))

    th = threading.Thread(target=slow)
    th.start()
    time.sleep(1.0)
    try:
        s.exec("1")
    except forkbox.SessionBusy as e:
        errors.append(e)
    th.join()
    assert len(errors) == 1 and errors[0].status == 409 and errors[0].code == "session_busy"
    assert results[0].value == "'slept'"
    s.delete()


def test_unauthorized_without_or_with_a_wrong_key(server):
    for key in ("", "fbk_" + "0" * 32):
        with Forkbox(server.url, key) as c:
            with pytest.raises(forkbox.Unauthorized) as e:
                c.exec("1")
            assert (e.value.status, e.value.code) == (401, "unauthorized")
            with pytest.raises(forkbox.Unauthorized):
                c.sessions.list()


def test_connection_failure_is_a_forkbox_error():
    with Forkbox("http://127.0.0.1:9", "k") as c:
        with pytest.raises(forkbox.ConnectionFailed) as e:
            c.exec("1")
    assert e.value.status == 0 and isinstance(e.value, forkbox.ForkboxError)
    with pytest.raises(ValueError):
        Forkbox("ftp://example.org")


def test_tenants_are_isolated(server, fb):
    other_key = server.create_key("sdk-other-tenant")
    mine = fb.sessions.create(tags={"owner": "me"})
    mine.exec("secret = 1")
    with Forkbox(server.url, other_key) as other:
        theirs = other.sessions.create(tags={"owner": "them"})
        assert mine.id not in [s.id for s in other.sessions.list()]
        assert theirs.id not in [s.id for s in fb.sessions.list()]
        with pytest.raises(forkbox.SessionNotFound):
            other.sessions.get(mine.id)
        intruder = forkbox.Session(other, mine.info)  # a handle to someone else's session id
        for call in (lambda: intruder.exec("secret"), intruder.checkpoints, lambda: intruder.revert(1),
                     lambda: intruder.fork(), intruder.delete):
            with pytest.raises(forkbox.SessionNotFound):
                call()
        theirs.delete()
    assert mine.exec("secret").value == "1"
    mine.delete()


def test_stream_yields_output_in_order_then_the_result(fb):
    s = fb.sessions.create()
    code = "import sys, time\nfor i in range(3):\n    print('out', i, flush=True)\n    time.sleep(0.3)\nprint('bad', file=sys.stderr)\n'done'"
    seen = []
    t0 = time.monotonic()
    for ev in s.stream(code):
        seen.append((time.monotonic() - t0, ev))
    events = [ev for _, ev in seen]
    assert isinstance(events[-1], Result) and sum(isinstance(e, Result) for e in events) == 1
    res = events[-1].result
    assert res.value == "'done'" and res.checkpoint == 1
    out = "".join(e.data for e in events if isinstance(e, Stdout))
    err = "".join(e.data for e in events if isinstance(e, Stderr))
    assert out == "out 0\nout 1\nout 2\n" == res.stdout
    assert err == "bad\n" == res.stderr
    # Streamed as produced: the first line arrives well before the result.
    first = next(t for t, e in seen if isinstance(e, Stdout))
    assert seen[-1][0] - first >= 0.5
    # A one-shot stream too; an exception is in the result, not raised.
    evs = list(fb.stream("print('hi')\n1/0"))
    assert evs[0] == Stdout("hi\n") and evs[-1].result.error.type == "ZeroDivisionError"
    s.delete()


def test_stream_errors_are_raised(fb):
    s = fb.sessions.create(timeout=1)
    with pytest.raises(forkbox.Timeout):
        for _ in s.stream("print('x', flush=True)\nwhile True: pass"):
            pass
    s.delete()
    with pytest.raises(forkbox.SessionNotFound):
        list(s.stream("1"))


def test_interrupt_stops_the_exec_and_keeps_the_session(fb):
    s = fb.sessions.create(timeout=30)
    s.exec("state = [1, 2, 3]")
    assert s.interrupt() is False  # nothing running
    out = []
    th = threading.Thread(target=lambda: out.append(s.exec("import time\nwhile True: time.sleep(0.01)")))
    th.start()
    time.sleep(1.5)
    assert s.interrupt() is True
    th.join(timeout=20)
    assert not th.is_alive()
    assert out[0].error.type == "KeyboardInterrupt"
    assert s.exec("state").value == "[1, 2, 3]"
    s.delete()


def test_files_upload_download_list(fb):
    s = fb.sessions.create()
    up = s.upload("/data/in.csv", "a,b\n1,2\n")
    assert (up.path, up.size) == ("/data/in.csv", 8) and up.checkpoint == 1
    assert s.exec("open('/data/in.csv').read()").value == repr("a,b\n1,2\n")
    blob = bytes(range(256)) * 100
    s.upload("/data/blob.bin", blob)
    assert s.download("/data/blob.bin") == blob
    s.exec("open('/output/r.txt', 'w').write('result')")
    entries = {e.name: e for e in s.files("/output")}
    assert entries["r.txt"].size == 6 and not entries["r.txt"].is_dir and entries["r.txt"].path == "/output/r.txt"
    assert {e.name for e in s.files("/data")} == {"in.csv", "blob.bin"}
    assert s.download("/output/r.txt") == b"result"
    with pytest.raises(forkbox.FileNotFound) as e:
        s.download("/data/missing")
    assert e.value.status == 404
    with pytest.raises(forkbox.InvalidPath) as e:
        s.upload("/data/../../etc/x", b"no")
    assert (e.value.status, e.value.code) == (400, "invalid_path")
    s.delete()


def test_outputs_are_returned_with_the_result(fb):
    s = fb.sessions.create()
    r = s.exec("open('/output/plot.svg', 'w').write('<svg/>')")
    (o,) = r.outputs
    assert (o.path, o.size, o.mime, o.data) == ("/output/plot.svg", 6, "image/svg+xml", b"<svg/>")
    assert s.exec("1").outputs == []
    s.delete()


def test_the_blocking_client_is_generated_from_the_asyncio_one():
    # One source for both clients: `_sync.py` must be exactly what gen_sync.py writes from `_async.py`.
    import os
    import subprocess
    import sys

    gen = os.path.join(os.path.dirname(__file__), "..", "..", "sdk", "python", "gen_sync.py")
    r = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_background_processes_start_follow_stdin_signal_wait(fb):
    s = fb.sessions.create()
    try:
        p = s.start_command(["cat"], stdin=True)
        assert p.running and p.argv == ["cat"]
        assert s.write_stdin(p.pid, "one\n").running
        s.write_stdin(p.pid, b"two\n", eof=True)
        done = s.wait_process(p.pid, timeout=20)
        assert (done.state, done.exit_code) == ("exited", 0)
        out = s.process_output(p.pid)
        assert (out.data, out.offset, out.next_offset, out.running) == ("one\ntwo\n", 0, 8, False)
        with pytest.raises(forkbox.StdinError) as e:
            s.write_stdin(p.pid, "late")
        assert e.value.code == "stdin_closed"

        # follow: output as it comes, then the process as it ended.
        q = s.start_command("for i in 1 2 3; do echo n$i; sleep 0.3; done; echo bad >&2; exit 2")
        assert [x.pid for x in s.processes()] == [p.pid, q.pid]
        events = list(s.follow(q.pid))
        assert "".join(e.data for e in events if isinstance(e, Stdout)) == "n1\nn2\nn3\n"
        assert [e.data for e in events if isinstance(e, Stderr)] == ["bad\n"]
        assert isinstance(events[-1], forkbox.ProcessInfo) and events[-1].exit_code == 2
        # From an offset, one stream only.
        assert [e.data for e in s.follow(q.pid, offset=3, stream="stdout") if isinstance(e, Stdout)] == ["n2\nn3\n"]

        # signal, and the errors of a missing process / a command that cannot start.
        r = s.start_command(["sleep", "60"])
        assert s.signal(r.pid).pid == r.pid
        assert s.wait_process(r.pid, timeout=20).signal == 15
        with pytest.raises(forkbox.NotFound):
            s.process(4242)
        with pytest.raises(forkbox.ForkboxError) as e:
            s.start_command(["no-such-program-x"])
        assert e.value.code == "command_not_started" and "127" in e.value.message
        assert s.process(q.pid).exit_code == 2
    finally:
        s.delete()
