"""Shared fixtures for the Python integration tests: a real `forkbox serve`
process on loopback, with its own data directory.

The server binary is $FORKBOX_BIN or target/release/forkbox (build it with
`cargo build --release -p forkbox`). The guest image and template come from the
shared data directory ($FORKBOX_HOME or ~/.local/share/forkbox), built there on
first use; each server gets a fresh home whose `templates` is a symlink to the
shared one, so sessions and keys never leak between test runs. These tests need
/dev/kvm and fail without it.
"""

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def forkbox_bin() -> str:
    path = os.environ.get("FORKBOX_BIN") or str(REPO / "target" / "release" / "forkbox")
    if not os.access(path, os.X_OK):
        pytest.fail(f"forkbox binary not found at {path}: run `cargo build --release -p forkbox` (or set FORKBOX_BIN)")
    return path


def shared_home() -> Path:
    return Path(os.environ.get("FORKBOX_HOME") or Path.home() / ".local" / "share" / "forkbox")


def require_kvm():
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as e:
        pytest.fail(f"these tests need KVM: cannot open /dev/kvm read-write ({e}); they are never skipped")


_image = None


def shared_image() -> str:
    """Build (or reuse) the default image in the shared home; return its path."""
    global _image
    if _image is None:
        out = subprocess.run(
            [forkbox_bin(), "--home", str(shared_home()), "image", "build"],
            check=True, capture_output=True, text=True, timeout=900,
        )
        _image = out.stdout.split()[-1]
        # The template too (serve would otherwise build it in every fresh home).
        subprocess.run(
            [forkbox_bin(), "--home", str(shared_home()), "template", "build", "--image", _image],
            check=True, capture_output=True, text=True, timeout=900,
        )
    return _image


@dataclass
class Server:
    url: str
    key: str
    home: Path
    proc: subprocess.Popen
    output: list = field(default_factory=list)

    def create_key(self, tenant: str, *extra: str) -> str:
        out = subprocess.run(
            [forkbox_bin(), "--home", str(self.home), "key", "create", "--tenant", tenant, *extra],
            check=True, capture_output=True, text=True, timeout=60,
        )
        return out.stdout.strip().split()[-1]

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.key}"}


def start_server(home: Path, *extra_args: str, env: dict | None = None, key: str | None = None) -> Server:
    """Start `forkbox serve` on an ephemeral loopback port; wait until it prints its address and key.
    With `key` (a data directory that has keys: the server prints none), its address only, and use that key."""
    image = shared_image()
    fresh_home(home)
    proc = subprocess.Popen(
        [forkbox_bin(), "--home", str(home), "serve", "--listen", "127.0.0.1:0", "--image", image, *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    given = key
    url = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (url is None or key is None):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
        if m := re.search(r"API key .*: (fbk_[0-9a-f]+)", line):
            key = m.group(1)
    if url is None or key is None:
        proc.kill()
        pytest.fail("forkbox serve did not start:\n" + "".join(lines))
    server = Server(url=url, key=key, home=home, proc=proc, output=lines)
    # The key serve made has the default limits (20 requests/s ...); the tests of
    # limits make their own keys, the rest use an unlimited admin key of the same tenant.
    if given is None:
        server.key = server.create_key("default", "--unlimited", "--admin")

    def drain():
        for line in proc.stdout:
            server.output.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return server


def stop_server(server: Server):
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def server():
    """One `forkbox serve` for the whole test run (tests create their own sessions)."""
    with tempfile.TemporaryDirectory(prefix="forkbox-pytest-") as d:
        s = start_server(Path(d) / "home")
        yield s
        stop_server(s)
        assert s.proc.returncode == 0, "forkbox serve did not shut down cleanly:\n" + "".join(s.output[-50:])


def fresh_home(path: Path) -> Path:
    """A new data directory at `path` that shares the built templates (and returns the image to pass as --image)."""
    require_kvm()
    shared_image()
    path.mkdir(parents=True, exist_ok=True)
    templates = path / "templates"
    if not templates.exists():
        templates.symlink_to(shared_home() / "templates")
    return path


def embedded_env(tmp_path: Path) -> dict:
    """The environment of an embedded CLI command: a fresh data directory under `tmp_path` (the
    shared templates linked in) as FORKBOX_HOME, and no other FORKBOX_ variable of the caller's."""
    home = fresh_home(tmp_path / "home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env["FORKBOX_HOME"] = str(home)
    return env


@pytest.fixture
def home(tmp_path) -> Path:
    """A fresh data directory for a process this test starts itself (e.g. `forkbox mcp`)."""
    return fresh_home(tmp_path / "home")


@pytest.fixture
def api(server):
    """An HTTP client of the shared server, with its key."""
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as c:
        yield c


def session(api) -> str:
    """A new session of `api`'s key: its id."""
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def run(api, sid: str, code: str) -> dict:
    """A session exec that must succeed: its answer."""
    r = api.post(f"/v1/sessions/{sid}/exec", json={"code": code})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.get("error") is None, body
    return body
