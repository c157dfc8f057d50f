"""The `forkbox` CLI against a running server (`--url`, key from $FORKBOX_API_KEY):
run, the session commands, errors as one line and a non-zero exit."""

import json
import os
import re
import subprocess
import time

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
    assert re.search(rf"^{sid}  checkpoint 3  tags \[cli=remote\]  memory 512 MiB  timeout 10 s  network public$", r.stdout, re.M), r.stdout
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


def test_session_exec_reads_a_file_and_takes_a_timeout(server, tmp_path):
    sid = cli(server, "session", "new", "--timeout", "30").stdout.strip()
    code = tmp_path / "step.py"
    code.write_text("def f(x):\n    return x * 3\n\ny = f(14)\nprint('from file')\ny\n")
    r = cli(server, "session", "exec", sid, "-f", str(code))
    assert (r.returncode, r.stdout) == (0, "from file\n42\n"), r.stderr
    # This exec's own limit (the session's is 30 s): a timeout after about a second, the state kept.
    loop = tmp_path / "loop.py"
    loop.write_text("y = 0\nwhile True: pass\n")
    t0 = time.monotonic()
    r = cli(server, "session", "exec", sid, "-f", str(loop), "--timeout", "1")
    took = time.monotonic() - t0
    assert r.returncode == 2 and "timeout" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert took < 15, f"--timeout 1 took {took:.1f} s"
    assert cli(server, "session", "exec", sid, "y").stdout == "42\n"
    # Bad arguments: one line, non-zero, nothing sent.
    for args, what in [(("-f", str(tmp_path / "missing.py")), "missing.py"), (("--timeout", "0", "1"), "--timeout"),
                       (("x", "-f", str(code)), "cannot be used with")]:
        r = cli(server, "session", "exec", sid, *args)
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
    cli(server, "session", "rm", sid)


OUTPUTS_CODE = r"""
import os
os.makedirs('/output/sub', exist_ok=True)
open('/output/table.csv', 'w').write('a,b\n1,2\n')
open('/output/sub/raw.bin', 'wb').write(bytes(range(256)))
print('done')
"""


def test_run_lists_and_saves_output_files(server, tmp_path):
    r = cli(server, "run", OUTPUTS_CODE)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr
    assert re.search(r"^output: /output/table\.csv  8 bytes  text/csv$", r.stderr, re.M), r.stderr
    assert re.search(r"^output: /output/sub/raw\.bin  256 bytes  \S+$", r.stderr, re.M), r.stderr
    dest = tmp_path / "saved"
    r = cli(server, "run", "--save-outputs", str(dest), OUTPUTS_CODE)
    assert r.returncode == 0, r.stderr
    assert (dest / "table.csv").read_text() == "a,b\n1,2\n"
    assert (dest / "sub" / "raw.bin").read_bytes() == bytes(range(256))
    assert f"saved /output/table.csv to {dest}/table.csv" in r.stderr
    # --json keeps stdout pure JSON and still saves.
    dest2 = tmp_path / "saved2"
    r = cli(server, "run", "--json", "--save-outputs", str(dest2), OUTPUTS_CODE)
    assert r.returncode == 0 and json.loads(r.stdout)["stdout"] == "done\n"
    assert (dest2 / "table.csv").exists()
    # A symlink planted in DIR is not followed out of it.
    outside = tmp_path / "outside"
    outside.mkdir()
    dest3 = tmp_path / "saved3"
    dest3.mkdir()
    (dest3 / "sub").symlink_to(outside)
    r = cli(server, "run", "--save-outputs", str(dest3), OUTPUTS_CODE)
    assert r.returncode == 0 and "/output/sub/raw.bin not saved" in r.stderr, r.stderr
    assert list(outside.iterdir()) == [] and (dest3 / "table.csv").exists()


def test_usage_errors_are_one_line_too(server):
    for args, what in [(("session", "exec"), "<ID>"), (("run", "--timeout", "x", "1"), "--timeout"),
                       (("bogus",), "bogus"), (("mcp", "install"), "--claude")]:
        r = cli(server, *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert r.stderr.startswith("forkbox: error: ") and what in r.stderr, (args, r.stderr)
    r = cli(server, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout


def test_session_background_ps_logs_kill(server):
    sid = cli(server, "session", "new").stdout.strip()
    r = cli(server, "session", "sh", sid, "--background", "for i in 1 2 3; do echo out $i; echo err $i >&2; sleep 0.3; done")
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.strip())
    # --follow prints the lines as they come and ends with the process.
    r = cli(server, "session", "logs", sid, str(pid), "--follow")
    assert (r.returncode, r.stdout) == (0, "out 1\nout 2\nout 3\n"), r.stderr
    r = cli(server, "session", "logs", sid, str(pid), "--stderr")
    assert (r.returncode, r.stdout) == (0, "err 1\nerr 2\nerr 3\n"), r.stderr
    # stdin from the CLI's own, then end of file.
    r = cli(server, "session", "sh", sid, "--background", "--stdin", "tr a-z A-Z", stdin="shout\n")
    assert r.returncode == 0, r.stderr
    upper = int(r.stdout.strip())
    assert cli(server, "session", "logs", sid, str(upper), "-f").stdout == "SHOUT\n"
    r = cli(server, "session", "sh", sid, "--background", "sleep", "60")
    sleeper = int(r.stdout.strip())
    r = cli(server, "session", "ps", sid)
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["PID", "STATE"], r.stdout
    rows = {int(l.split()[0]): l for l in lines[1:]}
    assert "exit 0" in rows[pid] and "running" in rows[sleeper] and rows[sleeper].endswith("sleep 60"), r.stdout
    r = cli(server, "session", "kill", sid, str(sleeper), "--signal", "KILL")
    assert r.returncode == 0 and f"sent signal 9 to {sleeper}" in r.stdout, r.stderr
    ps = json.loads(cli(server, "session", "ps", sid, "--json").stdout)
    deadline = time.monotonic() + 20
    while next(p for p in ps if p["pid"] == sleeper)["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
        ps = json.loads(cli(server, "session", "ps", sid, "--json").stdout)
    assert next(p for p in ps if p["pid"] == sleeper)["signal"] == 9
    # Errors: an unknown process, a bad signal, a command that cannot start.
    r = cli(server, "session", "logs", sid, "4242")
    assert r.returncode != 0 and "process_not_found" in r.stderr, r.stderr
    r = cli(server, "session", "kill", sid, str(pid), "--signal", "NOPE")
    assert r.returncode == 2 and "NOPE" in r.stderr
    r = cli(server, "session", "sh", sid, "--background", "no-such-program-x", "arg")
    assert r.returncode == 127 and "not found" in r.stderr, (r.returncode, r.stderr)
    cli(server, "session", "rm", sid)
