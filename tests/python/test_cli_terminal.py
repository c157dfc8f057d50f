"""Guest-controlled text on the user's terminal (the real binary, embedded): in
forkbox's own lines (the `/output` listing, saved paths, values, `session
log`/`tree`/`ls`) control characters are shown escaped, so an OSC 52
(clipboard write), OSC 0 (title) or CSI sequence never reaches the terminal
from there; the program's own stdout stays as it wrote it."""

import subprocess

from conftest import embedded_env, forkbox_bin, shared_image

OSC52 = "\x1b]52;c;aGVsbG8=\x07"  # would set the clipboard to "hello"
TITLE = "\x1b]0;pwned\x07"


def run(env, *args, timeout=180):
    return subprocess.run([forkbox_bin(), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_run_lists_output_files_and_values_escaped(tmp_path):
    env = embedded_env(tmp_path)
    code = (
        "import os\n"
        f"open('/output/a{OSC52}.txt', 'w').write('x')\n"
        f"print('\\x1b[31mred\\x1b[0m')\n"  # the program's own stdout: raw
        "class R:\n"
        "    def __repr__(self): return 'v\\x1b]0;pwned\\x07\\x1b[2K\\r'\n"
        "R()\n"
    )
    save = tmp_path / "saved"
    r = run(env, "run", "--image", shared_image(), "--save-outputs", str(save), code)
    assert r.returncode == 0, r.stderr
    # The program's stdout is untouched ...
    assert "\x1b[31mred\x1b[0m\n" in r.stdout, repr(r.stdout)
    # ... forkbox's own lines are not raw.
    assert "output: /output/a\\x1b]52;c;aGVsbG8=\\x07.txt  1 bytes" in r.stderr, repr(r.stderr)
    assert "saved /output/a\\x1b]52;c;aGVsbG8=\\x07.txt to " in r.stderr, repr(r.stderr)
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr, repr(r.stderr)
    assert r.stdout.endswith("v\\x1b]0;pwned\\x07\\x1b[2K\\x0d\n"), repr(r.stdout)
    # The file itself is saved under its real name.
    assert (save / f"a{OSC52}.txt").read_text() == "x"


def test_session_log_tree_and_ls_show_guest_text_escaped(tmp_path):
    env = embedded_env(tmp_path)

    def session(*args):
        r = run(env, "session", *args, "--image", shared_image())
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    sid = session("new", "--tag", f"k=v{TITLE}").strip()
    session("exec", sid, f"x = 1  # {OSC52}")
    session("exec", sid, f"y = '{TITLE}'\ny")
    out = session("log", sid) + session("tree", sid) + session("ls")
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert f"x = 1  # \\x1b]52;c;aGVsbG8=\\x07" in out, repr(out)
    assert "k=v\\x1b]0;pwned\\x07" in out, repr(out)
    assert "y = '\\x1b]0;pwned\\x07' ..." in out, repr(out)
