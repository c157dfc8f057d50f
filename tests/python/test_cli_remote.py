"""The `forkbox` CLI against a running server (`--url`, key from $FORKBOX_API_KEY):
run, the session commands, errors as one line and a non-zero exit."""

import os
import re
import subprocess

from conftest import forkbox_bin


def cli(server, *args, key=None, stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env["FORKBOX_API_KEY"] = key if key is not None else server.key
    return subprocess.run([forkbox_bin(), "--url", server.url, *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=120)


def test_run_prints_output_and_exit_codes(server):
    r = cli(server, "run", "import sys; print('hi'); print('oops', file=sys.stderr); 6 * 7")
    assert (r.returncode, r.stdout, r.stderr) == (0, "hi\n42\n", "oops\n")
    r = cli(server, "run", "-", stdin="raise ValueError('bad')")
    assert r.returncode == 1 and "ValueError: bad" in r.stderr
    r = cli(server, "run", "--json", "1 + 1")
    assert r.returncode == 0 and '"value": "2"' in r.stdout
    # Flags that only make sense for the local engine are refused, not ignored.
    r = cli(server, "run", "--cold", "1")
    assert r.returncode == 2 and "--cold" in r.stderr


def test_session_commands(server):
    r = cli(server, "session", "new", "--tag", "cli=remote", "--memory-mb", "512", "--timeout", "10")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    assert re.fullmatch(r"s_[0-9a-f]+", sid)
    assert cli(server, "session", "exec", sid, "x = 5").returncode == 0
    r = cli(server, "session", "exec", sid, "x * 2")
    assert (r.returncode, r.stdout) == (0, "10\n")
    r = cli(server, "session", "exec", sid, "-", stdin="x +")
    assert r.returncode == 1 and "SyntaxError" in r.stderr
    r = cli(server, "session", "ls", "--tag", "cli=remote")
    assert re.search(rf"^{sid}  checkpoint 3  tags \[cli=remote\]  memory 512 MiB  timeout 10 s$", r.stdout, re.M), r.stdout
    r = cli(server, "session", "log", sid)
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("*") and "x +" in lines[-1]
    assert cli(server, "session", "revert", sid, "1").stdout.strip() == f"{sid} is at checkpoint 1"
    fork = cli(server, "session", "fork", sid, "1").stdout.strip()
    assert fork != sid and cli(server, "session", "exec", fork, "x").stdout == "5\n"
    assert cli(server, "session", "rm", fork).stdout.strip() == f"deleted {fork}"
    assert cli(server, "session", "rm", sid).returncode == 0


def test_errors_are_one_line_and_non_zero(server):
    for args, key, code in [
        (("session", "exec", "s_0000000000000000", "1"), None, "session_not_found"),
        (("session", "ls"), "fbk_wrong", "unauthorized"),
        (("session", "revert", "s_0000000000000000", "1"), None, "session_not_found"),
    ]:
        r = cli(server, *args, key=key)
        assert r.returncode == 2, (args, r)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("forkbox: error: ") and code in r.stderr, r.stderr
    r = subprocess.run([forkbox_bin(), "--url", "http://127.0.0.1:9", "session", "ls"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "FORKBOX_API_KEY": "k"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    r = cli(server, "session", "new", "--image", "/nonexistent")
    assert r.returncode == 2 and "--image" in r.stderr


def test_repl_on_an_unknown_session_is_a_one_line_error(server):
    r = cli(server, "repl", "s_0000000000000000")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "session_not_found" in r.stderr, r.stderr


def test_repl_reads_piped_input(server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env.update(FORKBOX_API_KEY=server.key, FORKBOX_HOME=str(tmp_path))
    code = "def f():\n    return 'from f'\n\nf()\nprint('printed')\n"
    r = subprocess.run([forkbox_bin(), "--url", server.url, "repl"], input=code, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "'from f'" in r.stdout and "printed" in r.stdout and "\x1b[" not in r.stdout + r.stderr


def test_fork_with_tags_over_the_api(server):
    sid = cli(server, "session", "new").stdout.strip()
    assert cli(server, "session", "exec", sid, "x = 5").returncode == 0
    r = cli(server, "session", "fork", sid, "--tag", "branch=b1")
    assert r.returncode == 0, r.stderr
    fid = r.stdout.strip()
    listed = cli(server, "session", "ls", "--tag", "branch=b1").stdout
    assert fid in listed and sid not in listed, listed
    assert cli(server, "session", "exec", fid, "print(x * 2)").stdout == "10\n"
    cli(server, "session", "rm", fid)
    cli(server, "session", "rm", sid)
