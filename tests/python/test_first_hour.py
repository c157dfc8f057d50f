"""A new user's first hour, with real parts: `forkbox mcp` beside a running `serve`
(launched as Claude Desktop launches it: the config entry `mcp install` prints, no
caller environment), `initialize` at once on an empty data directory, instructions
that match the tools, an operator's embedded egress rule, the hint of a missing
module, a shipped template prebuilt by `serve` and a create that waits for it, and
`bench`'s host check."""

import http.server
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest
import requests
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from conftest import forkbox_bin, require_kvm, shared_home, shared_image, start_server, stop_server
from mcp_helpers import TOOLS, err, http_session, ok
from test_sdk_templates import write_wheel


def claude_entry(home: Path, user: Path) -> dict:
    """The Claude Desktop entry `forkbox mcp install --claude` prints for data directory `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env.update(HOME=str(user), PATH="/usr/bin:/bin", FORKBOX_HOME=str(home))
    out = subprocess.run([forkbox_bin(), "mcp", "install", "--claude"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["mcpServers"]["forkbox"]


def launch(entry: dict) -> StdioServerParameters:
    """As Claude Desktop does: the entry's command, args and env (the SDK adds only HOME, PATH, ...)."""
    return StdioServerParameters(command=entry["command"], args=entry["args"], env=entry.get("env"))


async def initialize_at_once(session: ClientSession):
    """`initialize`, which must be answered within 2 s whatever state the data directory is in."""
    t0 = time.monotonic()
    with anyio.fail_after(10):
        init = await session.initialize()
    took = time.monotonic() - t0
    assert took < 2, f"initialize took {took:.1f} s"
    return init


def linked_home(path: Path) -> Path:
    """A data directory with the shared images and download cache (nothing to download) but no
    template built: a first start builds them."""
    require_kvm()
    shared_image()
    path.mkdir(parents=True)
    for d in ("images", "cache"):
        (shared_home() / d).mkdir(parents=True, exist_ok=True)
        (path / d).symlink_to(shared_home() / d)
    (path / "templates").mkdir()
    return path


def test_mcp_uses_the_server_running_on_its_data_directory(tmp_path):
    s = start_server(tmp_path / "home")
    try:
        entry = claude_entry(s.home, tmp_path / "user")
        # The data directory is in the entry itself: the client passes no FORKBOX_HOME.
        assert entry["args"] == ["--home", str(s.home), "mcp"], entry

        async def go():
            async with stdio_client(launch(entry)) as (read, write):
                async with ClientSession(read, write) as session:
                    await initialize_at_once(session)
                    r = await ok(session, "run_python", code="6 * 7")
                    assert r["value"] == "42", r
                    sid = (await ok(session, "create_session", tags={"via": "mcp"}))["session_id"]
                    assert (await ok(session, "exec", session_id=sid, code="x = 5\nx + 1"))["value"] == "6"
                    return sid

        sid = anyio.run(go)
        # The session is the server's (the CLI tenant's, through server.json), not a second runtime's.
        handoff = json.loads((s.home / "server.json").read_text())
        listed = requests.get(f"{s.url}/v1/sessions", headers={"Authorization": f"Bearer {handoff['key']}"},
                              timeout=30).json()
        assert any(x["id"] == sid for x in listed["sessions"]), listed
        assert s.proc.poll() is None
    finally:
        stop_server(s)


def test_mcp_initialize_is_immediate_on_an_empty_data_directory(tmp_path):
    require_kvm()
    home = tmp_path / "empty"
    entry = claude_entry(home, tmp_path / "user")
    # No apt-get on its PATH: the first build in the background fails at once (and this test never
    # downloads anything); initialize must not wait for it either way.
    params = launch(entry)
    params.env = {**(params.env or {}), "PATH": str(tmp_path / "no-bin")}

    async def go():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                init = await initialize_at_once(session)
                tools = {t.name for t in (await session.list_tools()).tools}
                failed = await err(session, "run_python", code="1")
                return init.instructions, tools, failed

    instructions, tools, (code, message, _) = anyio.run(go)
    assert tools == TOOLS
    # Said from the configuration while nothing is built: the shipped templates and installs.
    assert "data" in instructions and "pandas" in instructions and "install_packages" in instructions, instructions
    # The failed first build is the tool call's error, said as it is.
    assert code == "template_unavailable" and "cannot run `apt" in message, (code, message)


def test_mcp_tool_call_waits_for_the_first_build_with_progress(tmp_path):
    home = linked_home(tmp_path / "home")
    entry = claude_entry(home, tmp_path / "user")
    seen = []

    async def progress(p, total, message):
        seen.append((p, message))

    async def go():
        async with stdio_client(launch(entry)) as (read, write):
            async with ClientSession(read, write) as session:
                await initialize_at_once(session)
                r = await session.call_tool("run_python", {"code": "import numpy\nint(numpy.arange(4).sum())"},
                                            progress_callback=progress)
                assert not r.is_error, r.content
                return r.structured_content

    r = anyio.run(go)
    assert r["value"] == "6", r
    assert seen, "no progress notification while the template was built"
    assert all("opening the data directory" in (m or "") for _, m in seen), seen
    assert [p for p, _ in seen] == sorted(p for p, _ in seen)


@pytest.fixture(scope="module")
def pip_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("firsthour")
    house = root / "wheelhouse"
    house.mkdir()
    write_wheel(house, "fhdemo", "def double(x):\n    return 2 * x\n")
    s = start_server(root / "home", "--pip-find-links", str(house), "--pip-no-index", "--pip-deny", "evilpkg",
                     "--egress-allow", "10.9.8.7")
    yield s
    stop_server(s)


def test_instructions_match_the_tools_and_the_server(pip_server):
    key = pip_server.create_key("fh", "--max-sessions", "7")

    async def go():
        async with http_session(pip_server.url, key) as session:
            listed = (await session.list_tools()).tools
            instructions = session.instructions
            args = set()
            for t in listed:
                args |= set((t.input_schema or {}).get("properties", {}).keys())
            names = {t.name for t in listed}
            descriptions = {t.name: t.description for t in listed}
            # Every capability the text names works.
            sid = (await ok(session, "create_session"))["session_id"]
            p = await ok(session, "install_packages", session_id=sid, packages=["fhdemo"])
            done = await ok(session, "exec", session_id=sid, code="import fhdemo\nfhdemo.double(21)")
            code, msg, _ = await err(session, "install_packages", session_id=sid, packages=["evilpkg"])
            py = await ok(session, "run_python", code="1 + 1", template="python")
            return instructions, names, args, descriptions, p, done, (code, msg), py

    instructions, names, args, descriptions, p, done, denied, py = anyio.run(go)
    assert instructions, "no instructions"
    # No tool is described as unavailable.
    for text in [instructions, *descriptions.values()]:
        for false in ("no pip", "nothing else can be installed", "there is no matplotlib", "cannot be installed"):
            assert false not in text, (false, text)
    # Every tool-like name in the instructions is a tool (or an argument of one).
    for word in set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", instructions)):
        assert word in names or word in args, f"the instructions name {word!r}, which is no tool: {instructions}"
    assert "install_packages" in instructions and "evilpkg" in instructions, instructions
    assert "wheelhouse" in instructions, instructions
    assert "10.9.8.7" in instructions and "at most 7 sessions" in instructions, instructions
    for t in ("python", "data"):
        assert re.search(rf"^- {t}\b", instructions, re.M), instructions
    assert "pandas" in instructions and "pandas" in descriptions["run_python"], descriptions["run_python"]
    assert "evilpkg" in descriptions["install_packages"], descriptions["install_packages"]
    assert done["value"] == "42" and py["value"] == "2", (done, py)
    assert denied[0] == "package_not_allowed" and "evilpkg" in denied[1], denied


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from the host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_embedded_run_egress_allow_reaches_a_loopback_service(tmp_path):
    require_kvm()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    code = f"import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=10).read().decode())"
    home = str(shared_home())
    try:
        base = [forkbox_bin(), "--home", home, "run", "--image", shared_image()]
        out = subprocess.run([*base, code], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "refused by the egress policy" in out.stderr, out
        out = subprocess.run([*base, "--egress-allow", f"127.0.0.1:{port}", code], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "hello from the host", out
        # Another port of the host stays closed: the rule opens what it names only.
        other = code.replace(f":{port}/", f":{port + 1 if port < 65535 else port - 1}/")
        out = subprocess.run([*base, "--egress-allow", f"127.0.0.1:{port}", other], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode != 0 and "refused by the egress policy" in out.stderr, out
        # A session (embedded, through the in-process API) takes it too.
        shome = tmp_path / "shome"
        shome.mkdir()
        (shome / "templates").symlink_to(shared_home() / "templates")
        sbase = [forkbox_bin(), "--home", str(shome), "session"]
        sid = subprocess.run([*sbase, "new", "--image", shared_image(), "--egress-allow", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=120)
        assert sid.returncode == 0, sid
        out = subprocess.run([*sbase, "exec", sid.stdout.strip(), code, "--image", shared_image()],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "hello from the host" in out.stdout, out
    finally:
        srv.shutdown()


def test_a_missing_module_ends_with_a_hint(pip_server):
    out = subprocess.run([forkbox_bin(), "--home", str(shared_home()), "run", "--image", shared_image(),
                          "import pandas"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("hint: pandas is in the shipped `data` template (--template data"), out.stderr
    assert last.endswith("%pip install pandas"), last
    r = requests.post(f"{pip_server.url}/v1/exec", headers=pip_server.headers(),
                      json={"code": "import sklearn.linear_model"}, timeout=60).json()
    tb = r["error"]["traceback"].strip().splitlines()
    assert r["error"]["type"] == "ModuleNotFoundError" and tb[-1].startswith("hint: sklearn is in the shipped"), r
    assert tb[-1].endswith("%pip install scikit-learn"), tb[-1]
    r = requests.post(f"{pip_server.url}/v1/exec", headers=pip_server.headers(), json={"code": "import fhdemo"},
                      timeout=60).json()
    assert r["error"]["traceback"].strip().splitlines()[-1] == \
        "hint: if fhdemo is a package on PyPI, install it in a session with %pip install fhdemo", r


def test_serve_prebuilds_data_and_a_create_waits_for_it(tmp_path):
    s = start_server(linked_home(tmp_path / "home"), "--prebuild", "data", "--template-wait-seconds", "900")
    try:
        h = s.headers()
        t = requests.get(f"{s.url}/v1/templates/data", headers=h, timeout=30).json()
        assert t["status"] == "building", t
        assert t["progress"] and t["elapsed_seconds"] is not None, t
        ls = subprocess.run([forkbox_bin(), "--home", str(s.home), "template", "ls"], capture_output=True, text=True,
                            timeout=60)
        assert ls.returncode == 0 and re.search(r"^data\s+building \(", ls.stdout, re.M), ls
        show = subprocess.run([forkbox_bin(), "--home", str(s.home), "template", "show", "data"],
                              capture_output=True, text=True, timeout=60)
        assert show.returncode == 0 and "status      building (" in show.stdout, show
        t0 = time.monotonic()
        r = requests.post(f"{s.url}/v1/sessions", headers=h, json={"template": "data"}, timeout=960)
        assert r.status_code == 201, r.text
        assert time.monotonic() - t0 > 0.5
        sid = r.json()["id"]
        r = requests.post(f"{s.url}/v1/sessions/{sid}/exec", headers=h,
                          json={"code": "import pandas\nint(pandas.Series([1, 2, 3]).sum())"}, timeout=120).json()
        assert r["value"] == "6", r
        assert requests.get(f"{s.url}/v1/templates/data", headers=h, timeout=30).json()["status"] == "ready"
    finally:
        stop_server(s)


def test_a_create_past_the_wait_gets_409_with_retry_after(tmp_path):
    s = start_server(linked_home(tmp_path / "home"), "--template-wait-seconds", "1")
    try:
        t0 = time.monotonic()
        r = requests.post(f"{s.url}/v1/sessions", headers=s.headers(), json={"template": "data"}, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "template_not_ready", r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert time.monotonic() - t0 >= 0.9
    finally:
        stop_server(s)


def test_bench_checks_the_host_python_first(tmp_path):
    require_kvm()
    fake = tmp_path / "python3"
    # The host's python3 without its site packages (where Debian's numpy is).
    fake.write_text("#!/bin/sh\nexec /usr/bin/python3 -S \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "FORKBOX_HOST_PYTHON": str(fake)}
    t0 = time.monotonic()
    out = subprocess.run([forkbox_bin(), "--home", str(tmp_path / "never"), "bench", "fork", "--forks", "1"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import numpy" in lines[0] and "apt-get install python3 python3-numpy" in lines[0], \
        out.stderr
    assert not (tmp_path / "never").exists() and out.stdout == "", out
    assert time.monotonic() - t0 < 30
    # The real host Python has numpy (this machine's baseline): the check passes it.
    assert subprocess.run(["/usr/bin/python3", "-c", "import numpy"]).returncode == 0
