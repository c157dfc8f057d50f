"""The three ways to run forkbox's MCP server behave as documented: `/mcp` in
`forkbox serve` behind the API keys (one tenant per key), `forkbox mcp --url`
against a remote server, `forkbox mcp` embedded on a data directory whose
sessions outlive the process; and `forkbox mcp install` writes client configs."""

import json
import os
import re
import shutil
import subprocess

import anyio
import httpx
import pytest

from conftest import forkbox_bin
from mcp_helpers import err, http_session, ok, stdio_session


def test_http_mcp_needs_a_valid_key(server):
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    r = httpx.post(f"{server.url}/mcp", json=init, headers=headers, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.post(f"{server.url}/mcp", json=init, headers={**headers, "Authorization": "Bearer fbk_" + "0" * 64}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = httpx.post(f"{server.url}/mcp", json=init, headers={**headers, **server.headers()}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["serverInfo"]["name"] == "forkbox"


def test_http_mcp_acts_with_the_callers_key(server):
    """Sessions made through /mcp belong to the key's tenant: visible in the plain API with that key, not with another's."""
    other = server.create_key("mcp-other-tenant")

    async def main():
        async with http_session(server.url, server.key) as s:
            sid = (await ok(s, "create_session", tags={"via": "mcp"}))["session_id"]
            await ok(s, "exec", session_id=sid, code="secret = 'mine'")
        async with http_session(server.url, other) as s:
            assert sid not in [x["session_id"] for x in (await ok(s, "list_sessions"))["sessions"]]
            code, _, _ = await err(s, "exec", session_id=sid, code="secret")
            assert code == "session_not_found"
        return sid

    sid = anyio.run(main)
    r = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json()["tags"] == {"via": "mcp"} and r.json()["checkpoint"] == 1
    r = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=server.headers(other), timeout=30)
    assert r.status_code == 404
    httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=server.headers(), timeout=30)


def test_stdio_remote_mode_uses_the_server_and_its_key(server, home):
    """`forkbox mcp --url` talks to the server over HTTP with $FORKBOX_API_KEY (its own home stays empty)."""
    async def main(key):
        async with stdio_session(home, "--url", server.url, env={"FORKBOX_API_KEY": key}) as s:
            sid = (await ok(s, "create_session"))["session_id"]
            return sid, await ok(s, "exec", session_id=sid, code="6 * 7")

    sid, r = anyio.run(main, server.key)
    assert r["value"] == "42"
    got = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "_"}, headers=server.headers(), timeout=60)
    assert got.status_code == 200 and got.json()["value"] == "42"  # the same session, seen through the HTTP API
    assert not (home / "sessions").exists()
    httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=server.headers(), timeout=30)

    # A wrong key: every tool call is a tool error carrying the API's 401 code.
    async def bad():
        async with stdio_session(home, "--url", server.url, env={"FORKBOX_API_KEY": "fbk_wrong"}) as s:
            return await err(s, "list_sessions")

    code, _, _ = anyio.run(bad)
    assert code == "unauthorized"


def test_embedded_sessions_outlive_the_process(home):
    async def first():
        async with stdio_session(home) as s:
            sid = (await ok(s, "create_session"))["session_id"]
            await ok(s, "exec", session_id=sid, code="import numpy as np\nm = np.arange(6).reshape(2, 3)")
            return sid

    async def second(sid):
        async with stdio_session(home) as s:
            r = await ok(s, "exec", session_id=sid, code="int(m.sum())")
            assert (r["value"], r["checkpoint"]) == ("15", 2)
            await ok(s, "delete_session", session_id=sid)

    sid = anyio.run(first)
    anyio.run(second, sid)
    # The embedded sessions are the local CLI's: `forkbox session` sees the same store.
    out = subprocess.run([forkbox_bin(), "--home", str(home), "session", "ls"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and sid not in out.stdout, out


@pytest.mark.parametrize("client,rel", [
    ("--claude", ".config/Claude/claude_desktop_config.json"),
    ("--cursor", ".cursor/mcp.json"),
    ("--windsurf", ".codeium/windsurf/mcp_config.json"),
])
def test_install_writes_json_configs_without_clobbering(tmp_path, client, rel):
    user = tmp_path / "user"
    cfg = user / rel
    cfg.parent.mkdir(parents=True)
    mine = {"mcpServers": {"other": {"command": "other-server", "args": []}}, "keep": True}
    cfg.write_text(json.dumps(mine))
    # No installed forkbox on the PATH: the entry names this binary (with a warning, see below).
    env = {**os.environ, "HOME": str(user), "PATH": "/usr/bin:/bin"}
    env.pop("FORKBOX_HOME", None)
    env.pop("FORKBOX_API_KEY", None)
    out = subprocess.run([forkbox_bin(), "mcp", "install", client, "--write"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    now = json.loads(cfg.read_text())
    assert now["keep"] is True and now["mcpServers"]["other"] == mine["mcpServers"]["other"]
    entry = now["mcpServers"]["forkbox"]
    # The data directory is always named: a client launches forkbox without the caller's environment.
    data = os.path.join(os.environ.get("XDG_DATA_HOME") or str(user / ".local/share"), "forkbox")
    assert entry["command"] == os.path.realpath(forkbox_bin()) and entry["args"] == ["--home", data, "mcp"], entry
    assert json.loads((cfg.parent / (cfg.name + ".bak")).read_text()) == mine

    # Printing only (with --url): the snippet, nothing written.
    out = subprocess.run([forkbox_bin(), "mcp", "install", client, "--url", "http://fb.example:8080"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    snippet = json.loads(out.stdout)["mcpServers"]["forkbox"]
    assert snippet["args"] == ["mcp", "--url", "http://fb.example:8080"] and "FORKBOX_API_KEY" in snippet["env"]
    assert json.loads(cfg.read_text()) == now


def test_install_goose_and_bad_usage(tmp_path):
    user = tmp_path / "user"
    cfg = user / ".config/goose/config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("GOOSE_MODEL: some-model\nextensions:\n  developer:\n    enabled: true\n    type: builtin\n    name: developer\n")
    env = {**os.environ, "HOME": str(user)}
    out = subprocess.run([forkbox_bin(), "mcp", "install", "--goose", "--write"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = cfg.read_text()
    assert "GOOSE_MODEL: some-model" in text and "developer:" in text and "forkbox:" in text and "cmd: " in text
    # No client chosen: a usage error, nothing written.
    out = subprocess.run([forkbox_bin(), "mcp", "install"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--claude" in out.stderr


def install(binary, *args, env):
    return subprocess.run([binary, *args], env=env, capture_output=True, text=True, timeout=60)


def test_install_names_a_stable_binary_and_the_real_key(server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env.update(HOME=str(tmp_path), PATH="/usr/bin:/bin")
    built = os.path.realpath(forkbox_bin())
    # A build output (target/release/forkbox): said so, with how to install one.
    out = install(built, "mcp", "install", "--claude", env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["mcpServers"]["forkbox"]["command"] == built
    assert "cargo build output" in out.stderr and "cargo install --path crates/cli" in out.stderr, out.stderr
    # An installed copy: its own path, no warning; and the build output prefers it when it is on the PATH.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    installed = bindir / "forkbox"
    shutil.copy2(built, installed)
    out = install(str(installed), "mcp", "install", "--cursor", env=env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert json.loads(out.stdout)["mcpServers"]["forkbox"]["command"] == str(installed)
    out = install(built, "mcp", "install", "--windsurf", env={**env, "PATH": f"{bindir}:/usr/bin:/bin"})
    assert json.loads(out.stdout)["mcpServers"]["forkbox"]["command"] == str(installed), out.stderr
    assert "using the installed" in out.stderr

    # --url with --api-key: the real key, no placeholder.
    out = install(str(installed), "--url", server.url, "--api-key", "fbk_given", "mcp", "install", "--windsurf", env=env)
    entry = json.loads(out.stdout)["mcpServers"]["forkbox"]
    assert entry["env"] == {"FORKBOX_API_KEY": "fbk_given"} and entry["args"] == ["mcp", "--url", server.url]
    assert "placeholder" not in out.stderr
    out = install(str(installed), "--url", server.url, "mcp", "install", "--claude", env=env)
    assert "placeholder" in out.stderr and "--api-key" in out.stderr

    # --create-key on the server's data directory: a key that the server accepts, in the Claude Code command.
    out = install(str(installed), "--home", str(server.home), "--url", server.url, "mcp", "install", "--claude-code",
                  "--create-key", env=env)
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(rf"claude mcp add --scope user -e FORKBOX_API_KEY=(fbk_[0-9a-f]+) forkbox -- {re.escape(str(installed))} "
                     rf"--home {re.escape(str(server.home))} mcp --url {re.escape(server.url)}\n", out.stdout)
    assert m, out.stdout
    r = httpx.get(f"{server.url}/v1/sessions", headers={"Authorization": f"Bearer {m.group(1)}"}, timeout=30)
    assert r.status_code == 200, r.text
    out = install(str(installed), "mcp", "install", "--claude", "--create-key", env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--url" in out.stderr

    # --claude-code --write runs `claude mcp add` (here a stand-in that records its arguments).
    record = tmp_path / "claude-args"
    fake = bindir / "claude"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\n")
    fake.chmod(0o755)
    out = install(str(installed), "mcp", "install", "--claude-code", "--write", env={**env, "PATH": f"{bindir}:/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    data = os.path.join(os.environ.get("XDG_DATA_HOME") or str(tmp_path / ".local/share"), "forkbox")
    assert record.read_text().splitlines() == ["mcp", "add", "--scope", "user", "forkbox", "--", str(installed),
                                               "--home", data, "mcp"]
    out = install(str(installed), "mcp", "install", "--claude-code", "--write", env=env)  # no claude on the PATH
    assert out.returncode == 2 and "claude mcp add" in out.stderr and out.stderr.count("\n") == 1
