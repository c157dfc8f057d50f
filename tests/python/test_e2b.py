"""E2B's own Python SDKs (`e2b`, `e2b-code-interpreter`, pinned in requirements.txt)
against a real `forkbox serve`: E2B_API_URL and E2B_SANDBOX_URL point at the server,
E2B_API_KEY is a forkbox API key. Nothing here leaves the machine."""

import asyncio
import base64
import json
import os
import struct
import subprocess
import time
import uuid

import httpx
import pytest

from conftest import forkbox_bin, shared_home, start_server, stop_server

import e2b  # noqa: E402
from e2b import AsyncSandbox, SandboxQuery, SandboxState  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SandboxNotFoundException,
)
import e2b_code_interpreter as ci  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

E2B_VARS = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own, whose home shares the built images too: `code-interpreter-v1` is
    forkbox's `data` template, built once in the shared data directory."""
    subprocess.run(
        [forkbox_bin(), "--home", str(shared_home()), "template", "build", "data"],
        check=True, capture_output=True, text=True, timeout=1800,
    )
    home = tmp_path_factory.mktemp("e2b") / "home"
    home.mkdir()
    (home / "images").symlink_to(shared_home() / "images")
    s = start_server(home)
    yield s
    stop_server(s)
    assert s.proc.returncode == 0, "forkbox serve did not shut down cleanly:\n" + "".join(s.output[-50:])


@pytest.fixture(scope="module")
def e2b_server(server):
    """The server, with the E2B SDKs pointed at it."""
    old = {k: os.environ.get(k) for k in E2B_VARS}
    for k in ("E2B_DOMAIN", "E2B_DEBUG"):
        os.environ.pop(k, None)
    os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=server.key)
    yield server
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_code_interpreter_state_rich_results_and_errors(e2b_server):
    with ci.Sandbox.create() as sbx:
        assert sbx.sandbox_id
        sbx.run_code("x = 41")
        ex = sbx.run_code("print('hello'); x + 1")
        assert ex.error is None
        assert ex.logs.stdout == ["hello\n"]
        assert ex.text == "42"
        assert [r.is_main_result for r in ex.results] == [True]

        # An open matplotlib figure: a display result with a PNG, not the main result.
        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\n")
        assert ex.error is None, ex.error
        pngs = [r for r in ex.results if r.png]
        assert len(pngs) == 1 and not pngs[0].is_main_result
        assert base64.b64decode(pngs[0].png)[:8] == b"\x89PNG\r\n\x1a\n"

        # A DataFrame as the last expression: the main result, with HTML.
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
        main = [r for r in ex.results if r.is_main_result]
        assert len(main) == 1 and "<table" in main[0].html and "a" in main[0].text

        ex = sbx.run_code("def f():\n    return 1 / 0\nf()")
        assert ex.error.name == "ZeroDivisionError"
        assert ex.error.value == "division by zero"
        assert "f()" in ex.error.traceback and "ZeroDivisionError" in ex.error.traceback
        # State survives an exception.
        assert sbx.run_code("x").text == "41"

        # A BaseException subclass (smolagents' final answer is one) is an error with its name and message.
        ex = sbx.run_code("class FinalAnswerException(BaseException):\n    pass\nraise FinalAnswerException('the answer')")
        assert (ex.error.name, ex.error.value) == ("FinalAnswerException", "the answer")

        # stdout/stderr chunks arrive through the callbacks as they are written.
        seen = []
        sbx.run_code("import sys\nprint('a')\nprint('b', file=sys.stderr)", on_stdout=lambda m: seen.append(("o", m.line)),
                     on_stderr=lambda m: seen.append(("e", m.line)))
        assert ("o", "a\n") in seen and ("e", "b\n") in seen

        # env_vars hold for one execution only.
        ex = sbx.run_code("import os\nos.environ.get('E2B_T')", envs={"E2B_T": "v1"})
        assert ex.text == "'v1'"
        assert sbx.run_code("os.environ.get('E2B_T')").text is None

        # IPython's shell escapes.
        ex = sbx.run_code("!echo from-the-shell")
        assert "from-the-shell\n" in "".join(ex.logs.stdout)

        # Contexts: namespaces of their own.
        ctx = sbx.create_code_context()
        sbx.run_code("y = 5", context=ctx)
        assert sbx.run_code("'y' in globals()").text == "False"
        assert sbx.run_code("y * 2", context=ctx).text == "10"
        assert ctx.id in [c.id for c in sbx.list_code_contexts()]
        sbx.restart_code_context(ctx)
        assert sbx.run_code("'y' in globals()", context=ctx).text == "False"
        sbx.remove_code_context(ctx)
        with pytest.raises(NotFoundException):
            sbx.run_code("1", context=ctx)
        sid = sbx.sandbox_id
    # The context manager killed it.
    with pytest.raises(SandboxNotFoundException):
        ci.Sandbox.get_info(sid)
    assert not ci.Sandbox.kill(sid)


def test_files_and_commands(e2b_server):
    sbx = e2b.Sandbox.create(envs={"SANDBOX_VAR": "from-create"})
    try:
        assert sbx.is_running()
        info = sbx.files.write("/home/user/a.txt", "hello e2b")
        assert info.path == "/home/user/a.txt"
        assert sbx.files.read("/home/user/a.txt") == "hello e2b"
        # Relative paths are under the user's home.
        assert sbx.files.read("a.txt", format="bytes") == b"hello e2b"
        names = {e.name: e for e in sbx.files.list("/home/user")}
        assert names["a.txt"].type.value == "file" and names["a.txt"].size == 9
        assert sbx.files.exists("/home/user/a.txt")
        assert not sbx.files.exists("/home/user/nope.txt")
        assert sbx.files.make_dir("/home/user/d/e")
        assert not sbx.files.make_dir("/home/user/d/e")
        deep = [e.path for e in sbx.files.list("/home/user", depth=2)]
        assert "/home/user/d/e" in deep
        moved = sbx.files.rename("/home/user/a.txt", "/home/user/d/b.txt")
        assert moved.path == "/home/user/d/b.txt"
        assert sbx.files.read("/home/user/d/b.txt") == "hello e2b"
        assert sbx.files.get_info("/home/user/d").type.value == "dir"
        sbx.files.remove("/home/user/d")
        assert not sbx.files.exists("/home/user/d/b.txt")
        with pytest.raises(NotFoundException):
            sbx.files.read("/home/user/d/b.txt")
        # Reading the file system runs no guest code and makes no checkpoint; a change makes one.
        http = httpx.Client(base_url=e2b_server.url, headers={"Authorization": f"Bearer {e2b_server.key}"})
        seqs = lambda: [c["seq"] for c in http.get(f"/v1/sessions/{sbx.sandbox_id}/checkpoints").json()["checkpoints"]]
        before = seqs()
        sbx.files.list("/home/user", depth=3)
        sbx.files.exists("/home/user")
        sbx.files.get_info("/home/user")
        assert seqs() == before
        sbx.files.make_dir("/home/user/z")
        assert len(seqs()) == len(before) + 1
        # Several files in one multipart upload.
        sbx.files.write_files([{"path": "/tmp/m1", "data": b"1"}, {"path": "/tmp/m2", "data": "2"}])
        assert (sbx.files.read("/tmp/m1"), sbx.files.read("/tmp/m2")) == ("1", "2")

        r = sbx.commands.run("echo out; echo err >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
        assert sbx.commands.run("pwd").stdout == "/home/user\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sbx.commands.run("echo $FOO-$SANDBOX_VAR", envs={"FOO": "bar"}).stdout == "bar-from-create\n"
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("echo partial; exit 3")
        assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
        chunks = []
        sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=chunks.append)
        assert "".join(chunks) == "1\n2\n3\n"
        # A file a command wrote is there for the files API.
        sbx.commands.run("echo made > /tmp/by-cmd")
        assert sbx.files.read("/tmp/by-cmd") == "made\n"
    finally:
        assert sbx.kill()
    assert not sbx.kill()


# Bash features and what each prints, run as the E2B SDK runs commands (`/bin/bash -l -c`).
BASH_CASES = [
    ('shopt -q login_shell && echo login; echo "$0" ${BASH_VERSINFO[0]}', "login\n/bin/bash 5\n"),
    ("printf 'b\\na\\nc\\n' | sort | head -2 | tr '\\n' ,", "a,b,"),
    ("false; echo $?; (exit 7); echo $?; true; echo $?", "1\n7\n0\n"),
    ("cd /tmp && pwd; cd - >/dev/null; pwd", "/tmp\n/home/user\n"),
    ("export V=x; bash -c 'echo $V$HOME'; unset V; echo ${V:-unset}", "x/home/user\nunset\n"),
    ("x=1; (x=2; echo $x); echo $x; echo $(echo sub $((6 * 7)))", "2\n1\nsub 42\n"),
    ("a=(one two three); echo ${#a[@]} ${a[1]} {1..3}; [[ abc == a* ]] && echo glob", "3 two 1 2 3\nglob\n"),
    ("f() { local n=$1; echo $((n * 2)); }; f 21; cat <<< 'here string'; cat <<EOF\nheredoc $((1 + 1))\nEOF",
     "42\nhere string\nheredoc 2\n"),
    ("paste -d, <(printf '1\\n2\\n') <(printf 'a\\nb\\n')", "1,a\n2,b\n"),
    ("set -o pipefail; false | true; echo $?; echo ${PIPESTATUS[@]}", "1\n0\n"),
    ("for i in 1 2 3; do [[ $i == 2 ]] && continue; echo -n $i; done; echo; case x in x) echo case;; esac", "13\ncase\n"),
]


def test_commands_run_under_a_real_bash(e2b_server):
    sbx = e2b.Sandbox.create()
    try:
        for cmd, want in BASH_CASES:
            r = sbx.commands.run(cmd)
            assert (r.stdout, r.stderr, r.exit_code) == (want, "", 0), cmd
        assert sbx.commands.run("echo $A ${B:-none}", envs={"A": "from-envs"}).stdout == "from-envs none\n"
        # Exit codes: `exit N`, `set -e` stopping at the first failure, a missing program.
        for cmd, code, out in [
            ("echo before; exit 42", 42, "before\n"),
            ("set -e; echo one; false; echo never", 1, "one\n"),
            ("no-such-program-x", 127, ""),
        ]:
            with pytest.raises(CommandExitException) as e:
                sbx.commands.run(cmd)
            assert (e.value.exit_code, e.value.stdout) == (code, out), cmd
        assert "no-such-program-x: command not found" in e.value.stderr
    finally:
        sbx.kill()


def test_forkbox_commands_route_runs_bash(server):
    """The same bash through forkbox's own commands route (an argv, no shell of forkbox's)."""
    import forkbox

    with forkbox.Forkbox(server.url, server.key) as fb:
        s = fb.sessions.create(timeout=60)
        try:
            s.exec("import os; os.makedirs('/home/user', exist_ok=True); os.environ['HOME'] = '/home/user'")
            for cmd, want in BASH_CASES:
                r = s.run_command(["/bin/bash", "-l", "-c", cmd], cwd="/home/user")
                assert (r.stdout, r.stderr, r.exit_code) == (want, "", 0), cmd
            r = s.run_command(["bash", "-c", "set -e; echo a; (exit 5); echo b"])
            assert (r.stdout, r.exit_code) == ("a\n", 5)
            assert fb.commands.run(["bash", "-c", "echo $((1 << 4))"]).stdout == "16\n"
        finally:
            s.delete()


def test_streamed_answers_are_not_held_back(e2b_server):
    """`/execute` writes its first event at once and the rest when the code ends: with Nagle on
    the server's socket the rest waited for the client's delayed ACK, 40 ms a call."""
    with ci.Sandbox.create(template="base") as sbx:
        for _ in range(3):
            sbx.run_code("1+1")
        took = []
        for _ in range(15):
            t = time.perf_counter()
            assert sbx.run_code("1+1").text == "2"
            took.append(time.perf_counter() - t)
        assert sorted(took)[len(took) // 2] < 0.035, took


def test_list_metadata_pause_connect_and_timeout(e2b_server):
    tag = uuid.uuid4().hex
    a = ci.Sandbox.create(metadata={"suite": tag, "n": "a"})
    b = ci.Sandbox.create(metadata={"suite": tag, "n": "b"}, timeout=120)
    try:
        a.run_code("state = [1, 2, 3]")
        listed = ci.Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert {s.sandbox_id for s in listed} == {a.sandbox_id, b.sandbox_id}
        assert {s.metadata["n"] for s in listed} == {"a", "b"}
        only_b = ci.Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "n": "b"})).next_items()
        assert [s.sandbox_id for s in only_b] == [b.sandbox_id]
        # Paging: one a page, the next page's token in x-next-token.
        p = ci.Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
        first = p.next_items()
        assert len(first) == 1 and p.has_next
        second = p.next_items()
        assert len(second) == 1 and second[0].sandbox_id != first[0].sandbox_id and not p.has_next

        info = a.get_info()
        assert info.state == SandboxState.RUNNING and info.metadata == {"suite": tag, "n": "a"}
        assert info.end_at > info.started_at

        assert a.pause()
        assert ci.Sandbox.get_info(a.sandbox_id).state == SandboxState.PAUSED
        assert not a.pause()
        paused = ci.Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [a.sandbox_id]
        assert not a.is_running()

        again = ci.Sandbox.connect(a.sandbox_id)
        assert again.run_code("sum(state)").text == "6"
        assert ci.Sandbox.get_info(a.sandbox_id).state == SandboxState.RUNNING

        # set_timeout: the lifetime ends that many seconds from now; then the sandbox is killed.
        b.set_timeout(2)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                ci.Sandbox.get_info(b.sandbox_id)
            except SandboxNotFoundException:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the sandbox outlived its timeout")
        assert not b.kill()
    finally:
        a.kill()
        b.kill()


def test_auto_pause_at_the_end_of_the_lifetime(e2b_server):
    # autoPause: the end of the lifetime pauses instead of killing.
    sbx = ci.Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        sbx.run_code("kept = 'yes'")
        deadline = time.monotonic() + 20
        while ci.Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused at the end of its lifetime"
            time.sleep(0.5)
        assert ci.Sandbox.connect(sbx.sandbox_id).run_code("kept").text == "'yes'"
    finally:
        sbx.kill()


def test_a_new_sandboxs_setup_rides_with_its_first_call(e2b_server):
    """E2B's setup (home, working directory, envVars) is no call of its own: the first
    `run_code` carries it (one checkpoint, the code's own line numbers), and a first call
    of another kind, or a fork made before any call, still sees the sandbox set up."""
    import forkbox

    probe = "import os\nx = (os.getcwd(), os.environ['HOME'], os.environ['FIRST'])\n1/0"
    a = ci.Sandbox.create(envs={"FIRST": "one"})
    b = ci.Sandbox.create(envs={"FIRST": "two"})
    c = ci.Sandbox.create(envs={"FIRST": "three"})
    forks = []
    try:
        ex = a.run_code(probe)
        assert ex.error is not None and ex.error.name == "ZeroDivisionError", ex.error
        assert "line 3" in ex.error.traceback and "forkbox-prelude" not in ex.error.traceback, ex.error.traceback
        assert a.run_code("x").text == "('/home/user', '/home/user', 'one')"
        with forkbox.Forkbox(e2b_server.url, e2b_server.key) as fb:
            cps = fb.sessions.get(a.sandbox_id).checkpoints()
        assert [cp.code for cp in cps] == [probe, "x"], [cp.code for cp in cps]

        # A command first: the same setup, in the command's own exec.
        assert b.commands.run("pwd; echo $HOME $FIRST").stdout == "/home/user\n/home/user two\n"
        # An execution's env_vars are undone before the next call, whatever it is.
        assert b.run_code("import os; os.environ['FIRST'], os.environ['ONE']", envs={"FIRST": "x", "ONE": "1"}).text == "('x', '1')"
        assert b.commands.run("echo $FIRST ${ONE:-unset}").stdout == "two unset\n"
        b.run_code("1", envs={"ONE": "2"})
        assert b.files.write("f.txt", "x").path == "/home/user/f.txt"
        assert b.run_code("os.environ.get('ONE')").text is None
        # One checkpoint a call; the upload, which runs no guest code, ran the owed undo first.
        with forkbox.Forkbox(e2b_server.url, e2b_server.key) as fb:
            firsts = [cp.code.split("\n")[0] for cp in fb.sessions.get(b.sandbox_id).checkpoints()]
        assert len(firsts) == 7 and firsts[4] == "# e2b: restore the environment", firsts

        # Forks of a sandbox that has not run anything: each is set up on its first call,
        # like the source.
        forks = c.fork(count=2)
        assert forks[0].run_code("import os; os.getcwd(), os.environ['FIRST']").text == "('/home/user', 'three')"
        assert forks[1].files.write("rel.txt", "x").path == "/home/user/rel.txt"
        assert forks[1].commands.run("echo $FIRST").stdout == "three\n"
        assert c.run_code("import os; os.environ['FIRST']").text == "'three'"
    finally:
        for s in [a, b, c, *forks]:
            s.kill()


def test_fork_count_and_snapshot_as_template(e2b_server):
    src = ci.Sandbox.create()
    forks = []
    try:
        src.run_code("v = 'source'")
        forks = src.fork(count=3)
        assert len(forks) == 3 and all(isinstance(f, ci.Sandbox) for f in forks), forks
        assert len({f.sandbox_id for f in forks} | {src.sandbox_id}) == 4
        for i, f in enumerate(forks):
            assert f.run_code("v").text == "'source'"
            f.run_code(f"v = 'fork{i}'")
        # The source kept running, unchanged.
        assert src.run_code("v").text == "'source'"

        snap = src.create_snapshot()
        assert snap.snapshot_id
        assert snap.snapshot_id in [s.snapshot_id for s in ci.Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        from_snap = ci.Sandbox.create(template=snap.snapshot_id)
        forks.append(from_snap)
        assert from_snap.run_code("v").text == "'source'"
    finally:
        for f in forks:
            if isinstance(f, ci.Sandbox):
                f.kill()
        src.kill()


def test_async_sandbox(e2b_server):
    async def go():
        sbx = await ci.AsyncSandbox.create()
        try:
            await sbx.run_code("a = 20")
            ex = await sbx.run_code("a * 2 + 2")
            assert ex.text == "42"
            await sbx.files.write("/tmp/x.txt", "async")
            assert await sbx.files.read("/tmp/x.txt") == "async"
            r = await sbx.commands.run("cat /tmp/x.txt")
            assert r.stdout == "async"
        finally:
            await sbx.kill()
        core = await AsyncSandbox.create()
        try:
            assert (await core.commands.run("echo core")).stdout == "core\n"
        finally:
            await core.kill()

    asyncio.run(go())


def test_bad_input_gets_the_sdks_errors(e2b_server, server):
    # An unknown sandbox.
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.connect("s_0000000000000000")
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.get_info("s_0000000000000000")
    assert not e2b.Sandbox.kill("s_0000000000000000")
    # A bad API key.
    with pytest.raises(AuthenticationException):
        e2b.Sandbox.create(api_key="fbk_not_a_key")

    sbx = e2b.Sandbox.create()
    try:
        # Another tenant's key sees nothing of it.
        other = server.create_key("e2b-other-tenant", "--unlimited")
        with pytest.raises(SandboxNotFoundException):
            e2b.Sandbox.connect(sbx.sandbox_id, api_key=other)
        assert not e2b.Sandbox.kill(sbx.sandbox_id, api_key=other)

        base = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        # A connection per request: a refusal answered before its body is read closes the
        # connection (hyper does not drain it), and a pooled client could race that close.
        with httpx.Client(base_url=server.url, timeout=30,
                          limits=httpx.Limits(max_keepalive_connections=0)) as http:
            # A wrong access token: 401 with a Connect error, for RPCs and envd's HTTP routes alike.
            r = http.post("/filesystem.Filesystem/Stat", json={"path": "/"},
                          headers={**base, "X-Access-Token": "wrong", "Connect-Protocol-Version": "1"})
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
            r = http.get("/files", params={"path": "/etc/hostname"}, headers={**base, "X-Access-Token": "wrong"})
            assert r.status_code == 401
            # Through the SDK: the token is its sandbox's, so swap it.
            good = sbx._envd_access_token
            headers = {**base, "X-Access-Token": good}
            # A malformed Connect envelope (announces more bytes than it has): an end-of-stream error.
            r = http.post("/process.Process/Start", content=b"\x00\x00\x00\x00\x50{}",
                          headers={**headers, "Content-Type": "application/connect+json"})
            assert r.status_code == 200
            flag, n = struct.unpack(">BI", r.content[:5])
            assert flag == 2 and json.loads(r.content[5:5 + n])["error"]["code"] == "invalid_argument"
            # A malformed unary body.
            r = http.post("/filesystem.Filesystem/Stat", content=b"{not json",
                          headers={**headers, "Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
            # An unknown sandbox on the data plane: 502, which the SDK reads as "not running".
            r = http.get("/health", headers={"E2b-Sandbox-Id": "s_0000000000000000", "E2b-Sandbox-Port": "49983"})
            assert r.status_code == 502 and "was not found" in r.json()["message"]
            # The control plane's errors are E2B's JSON.
            r = http.get("/sandboxes/s_0000000000000000", headers={"X-API-KEY": server.key})
            assert r.status_code == 404 and isinstance(r.json()["code"], int)
            r = http.post("/v2/sandboxes", content=b"[", headers={"X-API-KEY": server.key})
            assert r.status_code == 400 and isinstance(r.json()["message"], str)
            # The forkbox routes are untouched by E2B's.
            assert http.get("/healthz").status_code == 200

        # An upload over the server's file size limit (64 MiB by default) loses nothing.
        sbx.files.write("/tmp/keep.txt", "kept")
        with pytest.raises(SandboxException) as e:
            sbx.files.write("/tmp/big.bin", b"\0" * (65 << 20))
        assert "413" in str(e.value) or "limit" in str(e.value)
        assert sbx.files.read("/tmp/keep.txt") == "kept"
        assert not sbx.files.exists("/tmp/big.bin")
        # Listing what is not there, or not a directory.
        with pytest.raises(NotFoundException):
            sbx.files.list("/home/user/nope")
        with pytest.raises(InvalidArgumentException):
            sbx.files.list("/tmp/keep.txt")
    finally:
        sbx.kill()


def _envd_post(server, sbx, path, headers):
    """An envd `POST /files` on a raw socket (the body is the caller's to send)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(server.url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    lines = [f"POST /files?path={path} HTTP/1.1", f"Host: {u.hostname}:{u.port}",
             f"E2b-Sandbox-Id: {sbx.sandbox_id}", "E2b-Sandbox-Port: 49983",
             f"X-Access-Token: {sbx._envd_access_token}", "Content-Type: application/octet-stream"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _response(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode(errors="replace"), rest.decode(errors="replace")


def test_envd_uploads_are_bounded_like_forkbox_uploads(e2b_server):
    server = e2b_server
    key = server.create_key("e2b-uploads-cap", "--unlimited")
    sbx = e2b.Sandbox.create(api_key=key)
    try:
        # Declared over the limit: 413 in envd's shape before the body is read, and the
        # connection is closed.
        sock = _envd_post(server, sbx, "/tmp/big.bin", {"Content-Length": str(1 << 30)})
        sock.sendall(b"\0" * (1 << 20))
        status, head, body = _response(sock)
        sock.close()
        assert status == 413 and json.loads(body)["code"] == 413, (status, body)
        assert "connection: close" in head.lower(), head
        # A key has at most four uploads in progress, envd's as forkbox's: the fifth is 429.
        slow = []
        for i in range(4):
            sock = _envd_post(server, sbx, f"/tmp/slow{i}", {"Transfer-Encoding": "chunked"})
            sock.sendall(b"4\r\nslow\r\n")
            slow.append(sock)
        time.sleep(0.5)
        with pytest.raises(SandboxException) as e:
            sbx.files.write("/tmp/fifth", "five")
        assert "429" in str(e.value) or "rate" in str(e.value).lower(), str(e.value)
        slow[0].sendall(b"0\r\n\r\n")
        status, _, body = _response(slow[0])
        assert status == 200, body
        for sock in slow:
            sock.close()
        sbx.files.write("/tmp/sixth", "six")
        assert (sbx.files.read("/tmp/slow0"), sbx.files.read("/tmp/sixth")) == ("slow", "six")
        assert not sbx.files.exists("/tmp/big.bin")
    finally:
        sbx.kill()


def test_background_commands_list_kill_connect_and_stdin(e2b_server):
    """`commands.run(background=True)` returns a handle at once and the sandbox stays usable;
    the handle waits for the output and exit code; list, kill, connect and stdin act on the
    session's background processes (E2B's pid is forkbox's)."""
    http = httpx.Client(base_url=e2b_server.url, headers={"Authorization": f"Bearer {e2b_server.key}"})
    with ci.Sandbox.create(template="base") as sbx:
        seqs = lambda: [c["seq"] for c in http.get(f"/v1/sessions/{sbx.sandbox_id}/checkpoints").json()["checkpoints"]]
        t0 = time.monotonic()
        h = sbx.commands.run("echo start; sleep 1.5; echo done > /tmp/bg-done; echo finished; exit 4", background=True)
        assert time.monotonic() - t0 < 1.0
        # The sandbox answers other calls meanwhile.
        assert sbx.run_code("6 * 7").text == "42"
        assert sbx.commands.run("echo meanwhile").stdout == "meanwhile\n"
        listed = {p.pid: p for p in sbx.commands.list()}
        assert h.pid in listed and listed[h.pid].cmd == "/bin/bash" and listed[h.pid].args[-1].startswith("echo start")
        forkbox_pids = [p["pid"] for p in http.get(f"/v1/sessions/{sbx.sandbox_id}/processes").json()["processes"]]
        assert h.pid in forkbox_pids
        with pytest.raises(CommandExitException) as e:
            h.wait()
        assert (e.value.exit_code, e.value.stdout) == (4, "start\nfinished\n")
        assert sbx.files.read("/tmp/bg-done") == "done\n"
        assert h.pid not in {p.pid for p in sbx.commands.list()}

        # A foreground command makes one checkpoint, of its outcome: a fork has its file.
        before = seqs()
        sbx.commands.run("echo kept > /tmp/fg")
        assert len(seqs()) == len(before) + 1
        fork = http.post(f"/v1/sessions/{sbx.sandbox_id}/fork", json={})
        assert fork.status_code == 201, fork.text
        fid = fork.json()["id"]
        r = http.post(f"/v1/sessions/{fid}/exec", json={"code": "print(open('/tmp/fg').read(), end='')"})
        assert r.json()["stdout"] == "kept\n", r.text

        # Kill: the handle ends by the signal, the process is gone from the list.
        h = sbx.commands.run("sleep 60", background=True)
        assert h.kill()
        with pytest.raises(CommandExitException) as e:
            h.wait()
        assert e.value.exit_code == -1 and "signal" in e.value.error
        assert h.pid not in {p.pid for p in sbx.commands.list()}
        h2 = sbx.commands.run("sleep 60", background=True)
        assert sbx.commands.kill(h2.pid)
        assert not sbx.commands.kill(h2.pid)
        assert not sbx.commands.kill(987654)

        # Connect re-attaches: the output from then on, and the end.
        h = sbx.commands.run("for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.3; done", background=True)
        time.sleep(0.5)
        again = sbx.commands.connect(h.pid)
        r = again.wait()
        assert r.exit_code == 0 and r.stdout.endswith("tick 6\n") and "tick 1\n" not in r.stdout, r.stdout

        # stdin: send_stdin and close_stdin on a `cat`.
        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "hello ")
        sbx.commands.send_stdin(h.pid, b"stdin\n")
        h.send_stdin("more\n")
        sbx.commands.close_stdin(h.pid)
        r = h.wait()
        assert (r.exit_code, r.stdout) == (0, "hello stdin\nmore\n")
        # Without stdin=True a command reads /dev/null, and sending to it fails.
        h = sbx.commands.run("sleep 30", background=True)
        with pytest.raises(SandboxException):
            sbx.commands.send_stdin(h.pid, "x")
        h.kill()


def test_stream_input_writes_in_order(e2b_server):
    """`StreamInput` (a Connect client stream) writes each chunk to the process' stdin in order."""
    with e2b.Sandbox.create() as sbx:
        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.stream_input(h.pid, ["a", "b", b"c\n"])
        sbx.commands.close_stdin(h.pid)
        assert h.wait().stdout == "abc\n"


def test_pty_runs_bash_types_resizes_interrupts_and_kills(e2b_server):
    import threading
    from e2b.sandbox.commands.command_handle import PtySize

    with e2b.Sandbox.create() as sbx:
        out = bytearray()
        ended = []
        h = sbx.pty.create(PtySize(rows=24, cols=80))

        def follow():
            try:
                ended.append(h.wait(on_pty=out.extend))
            except Exception as e:  # noqa: BLE001 - a killed pty ends the wait with an error
                ended.append(e)

        t = threading.Thread(target=follow, daemon=True)
        t.start()

        def until(needle: bytes, timeout: float = 30) -> None:
            deadline = time.monotonic() + timeout
            while needle not in out:
                assert time.monotonic() < deadline, (needle, bytes(out))
                time.sleep(0.05)

        sbx.pty.send_stdin(h.pid, b"echo hi-$((6*7))\n")
        until(b"hi-42\r\n")
        sbx.pty.send_stdin(h.pid, b"python3 -c 'import os; print(\"size\", *os.get_terminal_size())'\n")
        until(b"size 80 24")
        sbx.pty.resize(h.pid, PtySize(rows=40, cols=100))
        sbx.pty.send_stdin(h.pid, b"python3 -c 'import os; print(\"size\", *os.get_terminal_size())'\n")
        until(b"size 100 40")
        # ^C interrupts what runs in the foreground; the shell goes on.
        sbx.pty.send_stdin(h.pid, b"sleep 30\n")
        time.sleep(0.5)
        sbx.pty.send_stdin(h.pid, b"\x03")
        sbx.pty.send_stdin(h.pid, b"echo after-$((1+1))\n")
        until(b"after-2\r\n", timeout=10)
        assert h.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.pty.kill(h.pid)
        t.join(20)
        assert ended, "the pty's stream did not end after kill"


def _events(handle, until, timeout=20.0):
    """Poll a sync `WatchHandle` until `until(events)` holds; every event as (type, name)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += [(e.type.value, e.name) for e in handle.get_new_events()]
        if until(seen):
            return seen
        time.sleep(0.1)
    pytest.fail(f"watch events never matched; saw {seen}")


def test_watch_dir_polling_sees_commands_files_api_and_background_processes(e2b_server):
    from e2b.exceptions import FileNotFoundException, InvalidArgumentException, SandboxException

    sbx = e2b.Sandbox.create()
    try:
        sbx.files.make_dir("/home/user/w/sub")
        flat = sbx.files.watch_dir("/home/user/w")
        deep = sbx.files.watch_dir("w", recursive=True)  # relative: under /home/user

        # The file API.
        sbx.files.write("/home/user/w/api.txt", "from the api")
        sbx.files.rename("/home/user/w/api.txt", "/home/user/w/api2.txt")
        sbx.files.make_dir("/home/user/w/made")
        # A command: create + write, chmod, rename, a nested file, remove.
        sbx.commands.run(
            "cd /home/user/w && echo hi > cmd.txt && chmod 600 cmd.txt && mv cmd.txt moved.txt"
            " && echo deep > sub/deep.txt && rm api2.txt"
        )
        sbx.files.remove("/home/user/w/made")
        want = [
            ("create", "api.txt"), ("write", "api.txt"), ("rename", "api.txt"), ("create", "api2.txt"),
            ("create", "made"), ("create", "cmd.txt"), ("write", "cmd.txt"), ("chmod", "cmd.txt"),
            ("rename", "cmd.txt"), ("create", "moved.txt"), ("remove", "api2.txt"), ("remove", "made"),
        ]
        got = _events(flat, lambda s: ("remove", "made") in s)
        assert [e for e in got if e in want] == want, got
        # Not recursive: nothing from sub/, but sub/ itself is in the directory.
        assert not [n for _, n in got if n.startswith("sub/")], got
        got_deep = _events(deep, lambda s: ("remove", "made") in s)
        assert ("create", "sub/deep.txt") in got_deep and ("write", "sub/deep.txt") in got_deep
        assert ("create", "moved.txt") in got_deep

        # A background process writing between calls: its writes come while nothing else is called.
        sbx.commands.run(
            "for i in 1 2 3 4; do echo $i >> /home/user/w/bg.log; sleep 0.3; done; touch /home/user/w/bg.done",
            background=True,
        )
        got = _events(flat, lambda s: ("create", "bg.done") in s)
        assert got[0] == ("create", "bg.log") and ("write", "bg.log") in got, got

        # Another program of the guest (CPython's open() and write()).
        sbx.commands.run("python3 -c \"open('/home/user/w/py.txt', 'w').write('x')\"")
        assert ("create", "py.txt") in _events(flat, lambda s: ("write", "py.txt") in s)

        # stop(): the watcher is gone (the SDK refuses a read; envd answers not_found).
        flat.stop()
        with pytest.raises(SandboxException):
            flat.get_new_events()
        deep.stop()

        # Errors as envd gives them.
        with pytest.raises(FileNotFoundException):
            sbx.files.watch_dir("/home/user/nope")
        sbx.files.write("/home/user/file.txt", "x")
        with pytest.raises(InvalidArgumentException):
            sbx.files.watch_dir("/home/user/file.txt")
    finally:
        sbx.kill()


def test_watch_dir_sees_writes_through_a_file_opened_before_it(e2b_server):
    """A log the guest opened (and keeps open) before the watcher started: its
    later writes are reported under its name."""
    sbx = ci.Sandbox.create()
    try:
        sbx.files.make_dir("/home/user/logs")
        sbx.run_code("log = open('/home/user/logs/app.log', 'a'); log.write('start\\n'); log.flush()")
        handle = sbx.files.watch_dir("/home/user/logs")
        sbx.run_code("log.write('more\\n'); log.flush()")
        assert ("write", "app.log") in _events(handle, lambda s: ("write", "app.log") in s)
        handle.stop()
    finally:
        sbx.kill()


def test_watch_dir_stream_with_async_sdk_and_run_code(e2b_server):
    async def go():
        sbx = await ci.AsyncSandbox.create()
        try:
            await sbx.files.make_dir("/home/user/s/inner")
            seen, recursive = [], []
            flat = await sbx.files.watch_dir("/home/user/s", lambda e: seen.append((e.type.value, e.name)))
            deep = await sbx.files.watch_dir(
                "/home/user/s", lambda e: recursive.append((e.type.value, e.name)), recursive=True
            )
            await sbx.run_code("open('/home/user/s/code.txt', 'w').write('from run_code')")
            await sbx.run_code("open('/home/user/s/inner/x.txt', 'w').write('deep')")
            await sbx.files.write("/home/user/s/api.txt", "api")
            for _ in range(200):
                if ("write", "api.txt") in seen and ("create", "inner/x.txt") in recursive:
                    break
                await asyncio.sleep(0.1)
            assert ("create", "code.txt") in seen and ("write", "code.txt") in seen, seen
            assert ("create", "api.txt") in seen, seen
            assert not [n for _, n in seen if n.startswith("inner/")], seen
            assert ("create", "inner/x.txt") in recursive and ("write", "inner/x.txt") in recursive, recursive
            await flat.stop()
            n = len(seen)
            await sbx.files.write("/home/user/s/after.txt", "x")
            for _ in range(30):
                if ("create", "after.txt") in recursive:
                    break
                await asyncio.sleep(0.1)
            assert ("create", "after.txt") in recursive
            assert len(seen) == n, "a stopped watcher got events"
            await deep.stop()
        finally:
            await sbx.kill()

    asyncio.run(go())


def test_metrics_follow_cpu_memory_and_disk(e2b_server):
    sbx = ci.Sandbox.create()
    try:
        sbx.run_code("x = 1")
        time.sleep(1.0)
        idle = sbx.get_metrics()[-1]
        assert idle.cpu_count == 1 and idle.mem_total > 0 and idle.disk_total > 0
        assert 0 < idle.mem_used < idle.mem_total

        sbx.run_code("import time\nt = time.time()\nwhile time.time() - t < 1.5: pass")
        busy = sbx.get_metrics()[-1]
        assert busy.cpu_used_pct > 40, busy
        time.sleep(1.5)
        assert sbx.get_metrics()[-1].cpu_used_pct < 20
        # A background process burning CPU between calls counts too.
        burn = sbx.commands.run(
            "python3 -c 'import time\nt = time.time()\nwhile time.time() - t < 3.5: pass'", background=True
        )
        time.sleep(2.0)
        # (Its start-up is mostly system calls, answered by the VMM outside the vCPU's run time.)
        assert sbx.get_metrics()[-1].cpu_used_pct > 25
        burn.wait()

        sbx.run_code("big = bytearray(96 << 20)\nbig[::4096] = b'x' * len(range(0, len(big), 4096))")
        after = sbx.get_metrics()[-1]
        assert after.mem_used >= idle.mem_used + (80 << 20), (idle.mem_used, after.mem_used)

        sbx.files.write("/home/user/blob.bin", b"\x01" * (4 << 20))
        disk = sbx.get_metrics()[-1]
        assert disk.disk_used >= after.disk_used + (4 << 20), (after.disk_used, disk.disk_used)
    finally:
        sbx.kill()


def test_a_watcher_that_falls_behind_fails_as_envds_overflow(e2b_server):
    from e2b.exceptions import SandboxException

    sbx = e2b.Sandbox.create()
    try:
        sbx.files.make_dir("/home/user/flood")
        slow = sbx.files.watch_dir("/home/user/flood")
        # More changes than a watcher keeps between two reads (4,096), never read meanwhile.
        sbx.commands.run("cd /home/user/flood && for i in $(seq 5000); do : > f$i; done", timeout=300)
        deadline = time.monotonic() + 30
        while True:
            try:
                evs = slow.get_new_events()
            except SandboxException as e:
                assert "overflow" in str(e), e
                break
            assert len(evs) <= 4096
            assert time.monotonic() < deadline, "the flooded watcher never failed"
            time.sleep(0.2)
        # The sandbox and a new watcher are fine.
        fresh = sbx.files.watch_dir("/home/user/flood")
        sbx.files.write("/home/user/flood/after.txt", "x")
        assert ("create", "after.txt") in _events(fresh, lambda s: ("create", "after.txt") in s)
        fresh.stop()
        slow.stop()
    finally:
        sbx.kill()
