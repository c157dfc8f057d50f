"""Commands beside exec (`/v1/commands`, `/v1/sessions/{id}/commands`) through every
front end: the sync and async SDK, the CLI (`forkbox sh`, `forkbox session sh`) and
the MCP tool `run_command` (stdio and streamable HTTP), against a real `forkbox serve`.
They need processes in the guest (fork/execve/wait4, a shell and coreutils in the image)."""

import asyncio
import time

import anyio
import pytest

import forkbox
from forkbox import AsyncForkbox, CommandResult, Forkbox, Result, Stderr, Stdout

from conftest import fresh_home
from mcp_helpers import err, http_session, ok, stdio_session
from test_cli_remote import cli


@pytest.fixture
def fb(server):
    with Forkbox(server.url, server.key) as c:
        yield c


def test_sdk_session_run_command_in_the_session_file_system(fb):
    s = fb.sessions.create(timeout=20)
    s.exec("open('/tmp/nums.txt', 'w').write('3\\n1\\n2\\n')")
    r = s.run_command("sort -n nums.txt | head -2", cwd="/tmp")
    assert isinstance(r, CommandResult)
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("1\n2\n", "", 0, True)
    assert r.checkpoint == 2 and s.info.checkpoint == 2
    r = s.run_command("echo $A-$B >&2; exit 5", env={"A": "x", "B": "y z"})
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("", "x-y z\n", 5, False)
    r = s.run_command(["python3", "-c", "import sys; print(sys.argv[1])", "$NOT_EXPANDED"])
    assert r.stdout == "$NOT_EXPANDED\n"
    # What the command wrote is the session's, for Python too.
    s.run_command("printf done > /tmp/flag")
    assert s.exec("open('/tmp/flag').read()").value == "'done'"
    # Streamed: chunks, then one Result carrying a CommandResult.
    events = list(s.stream_command("for i in 1 2; do echo $i; sleep 0.2; done; echo warn >&2; exit 3"))
    assert "".join(e.data for e in events if isinstance(e, Stdout)) == "1\n2\n"
    assert "".join(e.data for e in events if isinstance(e, Stderr)) == "warn\n"
    assert isinstance(events[-1], Result) and events[-1].result.exit_code == 3
    # Errors are the API's: a time-out rolls back, bad arguments are InvalidRequest.
    with pytest.raises(forkbox.Timeout):
        s.run_command("sleep 30", timeout=1)
    with pytest.raises(forkbox.InvalidRequest):
        s.run_command([])
    with pytest.raises(forkbox.SessionNotFound):
        fb.sessions.get(s.id).delete() or s.run_command("true")


def test_sdk_one_shot_commands_share_nothing(fb):
    r = fb.commands.run("echo hi > /tmp/x; cat /tmp/x; ls /bin/sh")
    assert (r.stdout, r.exit_code, r.checkpoint) == ("hi\n/bin/sh\n", 0, None)
    assert fb.commands.run(["test", "-e", "/tmp/x"]).exit_code == 1
    assert fb.commands.run(["no-such-program-x"]).exit_code == 127
    events = list(fb.commands.stream("echo a; echo b >&2"))
    assert isinstance(events[-1], Result) and events[-1].result.stdout == "a\n"


def test_async_sdk_commands(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create(timeout=20)
            r = await s.run_command("mkdir -p /w && cd /w && echo hello > f && wc -c < f")
            assert (r.stdout.strip(), r.exit_code, r.checkpoint) == ("6", 0, 1)
            r = await s.run_command(["cat", "f"], cwd="/w")
            assert r.stdout == "hello\n"
            events = [e async for e in s.stream_command("echo x; exit 2")]
            assert events[-1].result.exit_code == 2
            one = await fb.commands.run("uname -s")
            assert one.stdout == "Linux\n"
            # Two sessions' commands at once.
            a, b = await fb.sessions.create(), await fb.sessions.create()
            ra, rb = await asyncio.gather(a.run_command("sleep 0.5; echo a"), b.run_command("sleep 0.5; echo b"))
            assert (ra.stdout, rb.stdout) == ("a\n", "b\n")
            await s.delete()

    asyncio.run(main())


def test_cli_session_sh_and_one_shot_sh(server):
    sid = cli(server, "session", "new", "--timeout", "20").stdout.strip()
    r = cli(server, "session", "sh", sid, "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    # Several arguments are an argv (no shell); --cwd and --env.
    r = cli(server, "session", "sh", sid, "--cwd", "/tmp", "--env", "K=v w", "sh", "-c", 'pwd; echo "$K"')
    assert (r.returncode, r.stdout) == (0, "/tmp\nv w\n"), r.stderr
    r = cli(server, "session", "sh", "--json", sid, "true")
    assert r.returncode == 0 and '"exit_code": 0' in r.stdout and '"checkpoint": 3' in r.stdout, r.stdout
    log = cli(server, "session", "log", sid).stdout
    assert "# command: echo out; echo err >&2; exit 3" in log, log
    # A failure of the request is one line and exit 2; the command's own exit code otherwise.
    r = cli(server, "session", "sh", "s_0000000000000000", "true")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "session_not_found" in r.stderr, r.stderr
    r = cli(server, "session", "sh", sid, "--timeout", "1", "echo started; sleep 30")
    assert r.returncode == 2 and "started\n" in r.stdout and "timeout" in r.stderr, (r.stdout, r.stderr)
    r = cli(server, "sh", "ls / | grep -c bin; exit 7")
    assert (r.returncode, r.stdout) == (7, "2\n") or (r.returncode == 7 and r.stdout.strip().isdigit()), (r.stdout, r.stderr)
    r = cli(server, "sh", "no-such-program-x")
    assert r.returncode == 127 and "not found" in r.stderr


@pytest.fixture(params=["stdio", "http"])
def connect(request, tmp_path_factory):
    if request.param == "stdio":
        home = fresh_home(tmp_path_factory.mktemp("mcp-cmd") / "home")
        return lambda: stdio_session(home)
    server = request.getfixturevalue("server")
    return lambda: http_session(server.url, server.key)


def test_mcp_run_command(connect):
    async def scenario(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        d = tools["run_command"].description
        assert "instead of exec" in d and "exit_code" in d and "session_id" in d, d
        assert tools["run_command"].input_schema["required"] == ["command"]
        # One-shot.
        r = await ok(s, "run_command", command="echo $((6 * 7)); echo e >&2; exit 4")
        assert (r["stdout"], r["stderr"], r["exit_code"]) == ("42\n", "e\n", 4)
        assert "checkpoint" not in r
        # In a session: sees exec's files, makes a checkpoint.
        sid = (await ok(s, "create_session"))["session_id"]
        await ok(s, "exec", session_id=sid, code="open('/tmp/t.txt', 'w').write('a b c\\n')")
        r = await ok(s, "run_command", session_id=sid, command="wc -w < t.txt", cwd="/tmp", env={"X": "1"})
        assert (r["stdout"].strip(), r["exit_code"], r["checkpoint"]) == ("3", 0, 2)
        code, _, text = await err(s, "run_command", session_id=sid, command="sleep 30", timeout_seconds=1)
        assert code == "timeout", text
        code, message, _ = await err(s, "run_command", command="true", cwd="relative")
        assert code == "invalid_arguments" and "cwd" in message
        code, message, _ = await err(s, "run_command", cmd="true")
        assert code == "invalid_arguments" and "command" in message, message
        await ok(s, "delete_session", session_id=sid)

    async def main():
        async with connect() as session:
            await scenario(session)

    anyio.run(main)
