"""The MCP Inspector CLI (npm @modelcontextprotocol/inspector, `--cli` mode) as a
second, independent client: it lists forkbox's tools and calls one over stdio.

Installed by scripts/test with
`npm install --prefix target/node @modelcontextprotocol/inspector`."""

import json
import subprocess

from conftest import REPO, forkbox_bin, shared_image
from mcp_helpers import TOOLS

INSPECTOR = REPO / "target" / "node" / "node_modules" / ".bin" / "mcp-inspector"


def inspector(home, *args: str) -> dict:
    if not INSPECTOR.exists():
        raise AssertionError(f"MCP Inspector not installed at {INSPECTOR}: "
                             "run `npm install --prefix target/node @modelcontextprotocol/inspector`")
    cmd = [str(INSPECTOR), "--cli", forkbox_bin(), "--home", str(home), "mcp", "--image", shared_image(), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"inspector failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout)


def test_inspector_lists_the_tools_and_calls_one(home):
    tools = inspector(home, "--method", "tools/list")["tools"]
    assert {t["name"] for t in tools} == TOOLS
    assert all(t["inputSchema"]["type"] == "object" for t in tools)

    r = inspector(home, "--method", "tools/call", "--tool-name", "run_python", "--tool-arg", "code=sum(range(10))")
    assert r["isError"] is False
    assert r["structuredContent"]["value"] == "45"
    assert "value: 45" in r["content"][0]["text"]
