"""`forkbox repl` driven as a person would: under a pseudo-terminal, typing lines,
Ctrl-C and Ctrl-D, against the real `server` fixture (--url) and embedded on a
local data directory."""

import os
import pty
import re
import select
import signal
import time
from pathlib import Path

import pytest

from conftest import forkbox_bin, require_kvm, shared_home, shared_image

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RED = "\x1b[31m"


class Pty:
    """A process on the child side of a pseudo-terminal (its controlling terminal)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            os.execve(argv[0], argv, env)
        self.raw = ""  # everything read, with escapes
        self.pos = 0  # how far expect() has consumed (in the escape-free text)

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw).replace("\r", "")

    def _read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data.decode(errors="replace")
        return bool(data)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """Wait until `pattern` appears after what was already matched; consume up to its end."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read(min(left, 0.5)) and self.exited()):
                m = rx.search(self.text, self.pos)
                if m:
                    self.pos = m.end()
                    return m
                raise AssertionError(f"no {pattern!r} in the REPL's output:\n{self.text[self.pos - 2000 if self.pos > 2000 else 0:]}")

    def prompt(self, timeout: float = 60):
        return self.expect(r"^>>> ", timeout)

    def send(self, s: str):
        os.write(self.fd, s.encode())

    def line(self, s: str, wait_prompt: bool = True):
        self.send(s + "\r")

    def exited(self) -> bool:
        pid, _ = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = _
        return pid != 0 or hasattr(self, "status")

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while not hasattr(self, "status") and time.monotonic() < deadline:
            self._read(0.2)
            self.exited()
        if not hasattr(self, "status"):
            self.kill()
            raise AssertionError("the REPL did not exit:\n" + self.text[-2000:])
        return os.waitstatus_to_exitcode(self.status)

    def kill(self):
        if not hasattr(self, "status"):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = 9


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env.update(FORKBOX_HOME=str(home), FORKBOX_LOG="warn", TERM="xterm")
    return env


@pytest.fixture(params=["remote", "embedded"])
def repl(request, server, tmp_path):
    """A fresh REPL on a new session: on the server (--url) or embedded on a data directory of its own."""
    home = tmp_path / "home"
    home.mkdir()
    env = base_env(home)
    if request.param == "remote":
        env["FORKBOX_API_KEY"] = server.key
        argv = [forkbox_bin(), "--url", server.url, "repl"]
    else:
        require_kvm()
        (home / "templates").symlink_to(shared_home() / "templates")
        argv = [forkbox_bin(), "repl", "--image", shared_image()]
    p = Pty(argv, env)
    p.home = home
    p.env = env
    p.mode = request.param
    m = p.expect(r"session (s_[0-9a-f]+) on (\S+)", timeout=180)
    p.session = m.group(1)
    p.prompt()
    yield p
    p.kill()


def run(p: Pty, code: str):
    """Type a line and wait for the next prompt; the output in between (escape-free)."""
    start = len(p.text)
    p.line(code)
    p.pos = max(p.pos, start)
    p.prompt()
    return p.text[start:p.pos]


def test_multiline_state_output_exception_and_history(repl):
    p = repl
    p.line("def f(x):")
    p.expect(r"^\.\.\. ")
    p.line("    y = x * 2")
    p.expect(r"^\.\.\. ")
    p.line("    return y")
    p.expect(r"^\.\.\. ")
    p.line("")
    p.prompt()
    # An open bracket continues too; a blank line inside it does not end it.
    p.line("z = f(")
    p.expect(r"^\.\.\. ")
    p.line("")
    p.expect(r"^\.\.\. ")
    p.line("  21)")
    p.prompt()
    assert "42" in run(p, "z")
    out = run(p, "import sys; print('to-out'); print('to-err', file=sys.stderr)")
    assert "to-out" in out and "to-err" in out
    assert RED + "to-err" in p.raw  # stderr in red on a terminal
    out = run(p, "1/0")
    assert "Traceback" in out and "ZeroDivisionError: division by zero" in out
    assert re.search(re.escape(RED) + r"Traceback", p.raw)
    assert "42" in run(p, "z")  # the exception kept the state
    # History is kept on disk as lines are entered (not only at exit).
    assert "    y = x * 2" in (p.home / "repl_history").read_text()
    # Ctrl-C at the prompt clears the line; the REPL stays.
    p.send("half typed")
    p.expect("half typed")
    p.send("\x03")
    p.expect("KeyboardInterrupt")
    p.prompt()
    assert "42" in run(p, "z")
    p.send("\x04")  # Ctrl-D
    assert p.wait() == 0
    hist = (p.home / "repl_history").read_text()
    assert "def f(x):" in hist and "1/0" in hist


def test_meta_commands_revert_fork_session(repl):
    p = repl
    run(p, "a = 1")
    run(p, "a = 2")
    out = run(p, ":checkpoints")
    assert re.search(r"^\s+1\s+a = 1$", out, re.M) and re.search(r"^\*\s+2\s+a = 2$", out, re.M), out
    assert "is at checkpoint 1" in run(p, ":revert 1")
    assert re.search(r"^1$", run(p, "a"), re.M)
    out = run(p, ":fork")
    m = re.search(r"into session (s_[0-9a-f]+); now in", out)
    assert m and m.group(1) != p.session, out
    assert m.group(1) in run(p, ":session")
    assert re.search(r"^1$", run(p, "a"), re.M)  # the fork starts from the state it was forked at
    assert "unknown command" in run(p, ":nonsense")
    assert "revert" in run(p, ":help")
    err = run(p, ":revert 99")
    assert "checkpoint_not_found" in err
    p.line(":quit")
    assert p.wait() == 0


def test_streams_output_as_it_is_produced(repl):
    p = repl
    p.line("import time")
    p.prompt()
    start = len(p.text)
    p.line("for i in range(3): print('tick', i, flush=True); time.sleep(1.0)")
    p.expect(r"^\.\.\. ")
    p.line("")
    p.pos = max(p.pos, start)
    p.expect(r"tick 0", timeout=30)
    t0 = time.monotonic()
    assert "tick 2" not in p.text[start:]  # not all at the end
    p.expect(r"tick 2", timeout=30)
    assert time.monotonic() - t0 >= 1.5
    p.prompt()


def test_ctrl_c_interrupts_running_code_and_keeps_the_session(repl):
    p = repl
    run(p, "kept = 'still here'")
    start = len(p.text)
    p.line("while True: pass")
    p.expect(r"^\.\.\. ")
    p.line("")
    time.sleep(2.0)
    p.send("\x03")
    p.pos = max(p.pos, start)
    p.expect("KeyboardInterrupt", timeout=30)
    p.prompt(timeout=30)
    assert "still here" in run(p, "kept")
    p.send("\x04")
    assert p.wait() == 0


def test_type_ahead_unbracketed_paste_help_and_quit(repl):
    p = repl
    # Lines typed while an exec runs wait and then run, in order.
    start = len(p.text)
    p.line("import time; time.sleep(2); print('slept')")
    time.sleep(0.3)
    p.send("ahead = 20\r")
    p.send("print('ahead', ahead + 1)\r")
    p.pos = max(p.pos, start)
    p.expect(r"^slept$", timeout=30)
    p.expect(r"^ahead 21$", timeout=30)
    p.prompt()
    assert "NameError" not in p.text[start:], p.text[start:]
    # A paste without bracketed-paste mode: every line, with its indentation, in one write (as at
    # CPython's prompt, a blank line ends a block: the paste has none inside one).
    start = len(p.text)
    p.send("def g(x):\r    if x:\r        return x * 3\r    return 0\r\rprint('g', g(5), g(0))\r")
    p.pos = max(p.pos, start)
    p.expect(r"^g 15 0$", timeout=30)
    p.prompt()
    assert "Error" not in p.text[start:], p.text[start:]
    # Tabs in a paste indent too (no completion here).
    start = len(p.text)
    p.send("for i in range(2):\r\tprint('tab', i)\r\r")
    p.pos = max(p.pos, start)
    p.expect(r"^tab 1$", timeout=30)
    p.prompt()
    # help() prints (no pager in the sandbox).
    out = run(p, "help(len)")
    assert "len(obj, /)" in out and "Return the number of items" in out, out
    assert "Error" not in out, out
    # quit() leaves (no SystemExit traceback) and says how to come back.
    p.line("quit()")
    m = p.expect(rf"session {p.session} is kept at checkpoint \d+; come back to it with: forkbox (.*)repl {p.session}$")
    assert p.wait() == 0
    assert "SystemExit" not in p.text


def test_exit_leaves_and_the_printed_command_comes_back(repl):
    p = repl
    run(p, "kept = 'here'")
    p.line("exit()")
    m = p.expect(rf"come back to it with: forkbox (.*)repl ({p.session})$")
    assert p.wait() == 0 and "SystemExit" not in p.text
    if p.mode == "remote":
        assert m.group(1).startswith("--url http://")
    # Come back the way it said (plus what the fixture passes to every embedded REPL).
    argv = [forkbox_bin(), *m.group(1).split(), "repl", m.group(2)]
    if p.mode == "embedded":
        argv += ["--image", shared_image()]
    q = Pty(argv, p.env)
    try:
        q.expect(rf"session {p.session} on", timeout=120)
        q.prompt()
        assert "'here'" in run(q, "kept")
        q.send("\x04")  # Ctrl-D says it too
        q.expect(rf"session {p.session} is kept at checkpoint 3; come back to it with: ")  # 1: kept, 2: exit(), 3: kept
        assert q.wait() == 0
    finally:
        q.kill()
