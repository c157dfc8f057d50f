"""The first five minutes: the README's install path puts a
`forkbox` on the PATH that works; `serve` binds before it builds (a busy port
fails at once) and says what it does without a terminal; CLI commands without
`--url` on a served data directory use that server instead of waiting for the
directory's lock."""

import json
import os
import re
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from conftest import REPO, fresh_home, forkbox_bin, require_kvm, shared_home, shared_image, start_server, stop_server


def cli(home: Path, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("FORKBOX_URL", "FORKBOX_API_KEY")}
    return subprocess.run(
        [forkbox_bin(), "--home", str(home), *args],
        capture_output=True, text=True, timeout=timeout, env={**e, **(env or {})},
    )


def test_install_script_puts_a_working_forkbox_on_the_path(tmp_path):
    require_kvm()
    shared_image()
    prefix = tmp_path / "prefix"
    out = subprocess.run([str(REPO / "scripts" / "install"), "--root", str(prefix)],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    binary = prefix / "bin" / "forkbox"
    assert binary.is_file() and os.access(binary, os.X_OK), out.stderr
    assert f"installed {binary}" in out.stderr
    # From the PATH, as the README's later commands are written.
    env = {k: v for k, v in os.environ.items() if k not in ("FORKBOX_URL", "FORKBOX_API_KEY")}
    env["PATH"] = f"{prefix / 'bin'}:{env['PATH']}"
    env["FORKBOX_HOME"] = str(shared_home())
    run = subprocess.run(["forkbox", "run", "print(6 * 7)"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "42"


def test_serve_on_a_busy_port_fails_before_building_anything(tmp_path):
    require_kvm()
    home = tmp_path / "empty-home"  # nothing built here: a build would take tens of seconds
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        out = cli(home, "serve", "--listen", f"127.0.0.1:{port}", timeout=60)
        took = time.monotonic() - t0
    assert out.returncode != 0
    assert "in use" in out.stderr.lower(), out.stderr
    assert took < 10, f"serve took {took:.1f} s to find its port busy"
    assert not (home / "images").exists(), "serve built an image before binding"


def test_cli_without_url_uses_the_server_of_its_data_directory(tmp_path):
    home = fresh_home(tmp_path / "home")
    server = start_server(home)
    try:
        served = home / "server.json"
        f = json.loads(served.read_text())
        assert f["version"] == 1 and f["url"] == server.url and f["pid"] == server.proc.pid
        assert stat.S_IMODE(served.stat().st_mode) == 0o600, "the file holds a key: owner only"
        # A session command without --url: at once through the server, no wait for the lock.
        t0 = time.monotonic()
        new = cli(home, "session", "new")
        took = time.monotonic() - t0
        assert new.returncode == 0, new.stderr
        sid = new.stdout.strip().split()[-1]
        assert took < 20, f"session new took {took:.1f} s"
        ex = cli(home, "session", "exec", sid, "x = 20; x * 2 + 2")
        assert ex.returncode == 0, ex.stderr
        assert "42" in ex.stdout
        # The same sessions as embedded: the CLI's tenant, through the key in server.json.
        r = json.loads(subprocess.run(
            ["curl", "-sf", f"{server.url}/v1/sessions/{sid}", "-H", f"Authorization: Bearer {f['key']}"],
            capture_output=True, text=True, timeout=30, check=True).stdout)
        assert r["id"] == sid
        # ... which the operator's tenant does not see.
        other = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{server.url}/v1/sessions/{sid}",
             "-H", f"Authorization: Bearer {server.key}"],
            capture_output=True, text=True, timeout=30)
        assert other.stdout == "404"
        # A second serve on the same directory is refused at once.
        t0 = time.monotonic()
        second = cli(home, "serve", "--listen", "127.0.0.1:0", "--image", shared_image(), timeout=60)
        assert second.returncode != 0 and "already served" in second.stderr, second.stderr
        assert time.monotonic() - t0 < 10
    finally:
        stop_server(server)
    assert server.proc.returncode == 0
    assert not (home / "server.json").exists(), "serve left its server.json behind"
    # The run's key is gone with it, and the session is there for the next run.
    again = subprocess.Popen(
        [forkbox_bin(), "--home", str(home), "serve", "--listen", "127.0.0.1:0", "--image", shared_image()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in again.stdout:
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
                break
        assert url, "the second serve did not start"
        gone = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/v1/sessions",
             "-H", f"Authorization: Bearer {f['key']}"],
            capture_output=True, text=True, timeout=30)
        assert gone.stdout == "401"
        ls = cli(home, "session", "ls")
        assert ls.returncode == 0 and sid in ls.stdout, ls.stdout + ls.stderr
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(timeout=60)


def test_a_stale_server_file_is_ignored(tmp_path):
    home = fresh_home(tmp_path / "home")
    (home / "server.json").write_text(json.dumps(
        {"version": 1, "url": "http://127.0.0.1:9", "pid": 999_999_999, "key": "fbk_00"}))
    out = cli(home, "session", "new", "--image", shared_image(), timeout=300)
    assert out.returncode == 0, out.stderr
