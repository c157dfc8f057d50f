"""The `forkbox session` commands embedded on a data directory of their own (no
server): the same API router in process, printed like the remote mode."""

import re
import subprocess

from conftest import embedded_env, forkbox_bin, shared_image


def test_embedded_session_commands(tmp_path):
    env = embedded_env(tmp_path)

    def cli(*args):
        return subprocess.run([forkbox_bin(), "session", *args, "--image", shared_image()], capture_output=True,
                              text=True, env=env, timeout=120)

    sid = cli("new", "--tag", "mode=embedded").stdout.strip()
    assert re.fullmatch(r"s_[0-9a-f]+", sid)
    assert cli("exec", sid, "x = 7").returncode == 0
    assert cli("exec", sid, "x * 6").stdout == "42\n"
    fork = cli("fork", sid, "1", "--tag", "child=yes").stdout.strip()
    ls = cli("ls").stdout
    # A fork before its first exec is shown at the checkpoint it was forked from.
    assert re.search(rf"^{fork}  checkpoint 1  tags \[child=yes\]", ls, re.M), ls
    assert re.search(rf"^{sid}  checkpoint 2  tags \[mode=embedded\]", ls, re.M), ls
    assert cli("exec", fork, "x").stdout == "7\n"
    r = cli("exec", "s_0000000000000000", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not found" in r.stderr
    r = cli("new", "--memory-mb", "9999")
    assert r.returncode == 2 and "--memory-mb" in r.stderr
