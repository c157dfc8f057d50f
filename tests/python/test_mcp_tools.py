"""Every MCP tool, driven by the official MCP Python SDK as a real client, over
both transports: stdio (`forkbox mcp`, embedded engine on its own data
directory) and streamable HTTP (`/mcp` of the `server` fixture's `forkbox serve`)."""

import anyio
import pytest

from conftest import fresh_home
from mcp_helpers import PNG_CODE, TOOLS, decode_png, err, http_session, ok, stdio_session


@pytest.fixture(scope="module")
def stdio_home(tmp_path_factory):
    return fresh_home(tmp_path_factory.mktemp("mcp-stdio") / "home")


@pytest.fixture(params=["stdio", "http"])
def connect(request, stdio_home):
    """A factory of initialized MCP client sessions over the transport under test."""
    if request.param == "stdio":
        return lambda: stdio_session(stdio_home)
    server = request.getfixturevalue("server")
    return lambda: http_session(server.url, server.key)


def run(scenario, connect):
    async def main():
        async with connect() as session:
            await scenario(session)

    anyio.run(main)


def test_lists_the_tools_with_schemas_and_instructions(connect):
    async def scenario(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert set(tools) == TOOLS
        for t in tools.values():
            assert len(t.description) > 40, t.name
            assert t.input_schema["type"] == "object"
        assert set(tools["exec"].input_schema["required"]) == {"session_id", "code"}
        assert tools["run_python"].input_schema["required"] == ["code"]
        assert set(tools["revert"].input_schema["required"]) == {"session_id", "checkpoint"}
        # What a model needs to know to use them well.
        assert "numpy" in tools["run_python"].description and "/output" in tools["run_python"].description
        assert "persist" in tools["create_session"].description
        assert "checkpoint" in tools["exec"].description

    run(scenario, connect)


def test_run_python_is_one_shot_and_stateless(connect):
    async def scenario(s):
        r = await ok(s, "run_python", code="import numpy as np\nx = 21\nprint('hi', file=__import__('sys').stderr)\nint(np.int64(x) * 2)")
        assert (r["value"], r["stdout"], r["stderr"], r["error"]) == ("42", "", "hi\n", None)
        assert "checkpoint" not in r
        r = await ok(s, "run_python", code="x")
        assert r["error"]["type"] == "NameError", r
        assert "NameError" in r["error"]["traceback"]

    run(scenario, connect)


def test_session_state_persists_and_revert_and_fork_work(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        assert (await ok(s, "exec", session_id=sid, code="a = [1]"))["checkpoint"] == 1
        assert (await ok(s, "exec", session_id=sid, code="a.append(2)"))["checkpoint"] == 2
        r = await ok(s, "exec", session_id=sid, code="print(len(a)); a")
        assert (r["value"], r["stdout"], r["checkpoint"]) == ("[1, 2]", "2\n", 3)
        assert sid in [x["session_id"] for x in (await ok(s, "list_sessions"))["sessions"]]

        cps = (await ok(s, "list_checkpoints", session_id=sid))["checkpoints"]
        assert [c["checkpoint"] for c in cps] == [1, 2, 3]
        assert [c["current"] for c in cps] == [False, False, True]
        assert cps[1]["code"] == "a.append(2)"

        # Undo to checkpoint 1: the list has one element again; the next exec branches from there.
        r = await ok(s, "revert", session_id=sid, checkpoint=1)
        assert r["checkpoint"] == 1
        assert (await ok(s, "exec", session_id=sid, code="a"))["value"] == "[1]"

        # Branch from checkpoint 2 of the original: the fork has its state, the original is untouched.
        fork = await ok(s, "fork_session", session_id=sid, checkpoint=2)
        fid = fork["session_id"]
        assert fid != sid and fork["forked_from"] == {"session": sid, "checkpoint": 2}
        assert (await ok(s, "exec", session_id=fid, code="a.append(3); a"))["value"] == "[1, 2, 3]"
        assert (await ok(s, "exec", session_id=sid, code="a"))["value"] == "[1]"

        for i in (sid, fid):
            assert (await ok(s, "delete_session", session_id=i))["deleted"] is True
        listed = [x["session_id"] for x in (await ok(s, "list_sessions"))["sessions"]]
        assert sid not in listed and fid not in listed

    run(scenario, connect)


def test_a_checkpoint_saved_as_a_template_starts_new_sandboxes(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        cp = (await ok(s, "exec", session_id=sid, code="setup = {'k': 7}"))["checkpoint"]
        name = f"mcp-{sid[-8:]}"
        t = await ok(s, "save_template", session_id=sid, checkpoint=cp, name=name)
        assert t["template"] == name and t["status"] == "ready", t
        await ok(s, "delete_session", session_id=sid)
        assert (await ok(s, "run_python", code="setup['k'] * 6", template=name))["value"] == "42"
        code, _, _ = await err(s, "save_template", session_id=sid, checkpoint=cp, name="other")
        assert code == "session_not_found"

    run(scenario, connect)


def test_errors_are_tool_errors_with_the_api_codes(connect):
    async def scenario(s):
        code, msg, text = await err(s, "exec", session_id="s_doesnotexist", code="1")
        assert code == "session_not_found" and "s_doesnotexist" in msg
        assert "list_sessions" in text  # how to recover
        code, _, _ = await err(s, "delete_session", session_id="s_doesnotexist")
        assert code == "session_not_found"

        # Arguments that do not fit the schema, or values the API refuses.
        code, msg, _ = await err(s, "exec", session_id="x")
        assert code == "invalid_arguments" and "code" in msg, msg
        code, msg, _ = await err(s, "revert", session_id="x", checkpoint="three")
        assert code == "invalid_arguments" and "argument `checkpoint`" in msg, msg
        code, msg, _ = await err(s, "run_python", code="1", timeout=5)
        assert code == "invalid_arguments" and "timeout" in msg, msg
        code, msg, _ = await err(s, "run_python", code="1", timeout_seconds=-1)
        assert code == "invalid_arguments" and "timeout_seconds" in msg
        code, msg, _ = await err(s, "create_session", memory_mb=1)
        assert code == "invalid_request" and "memory_mb" in msg, msg

        # A timeout rolls the session back to its last checkpoint; the session keeps working.
        sid = (await ok(s, "create_session", timeout_seconds=1))["session_id"]
        await ok(s, "exec", session_id=sid, code="kept = 7")
        code, msg, text = await err(s, "exec", session_id=sid, code="kept = 0\nwhile True: pass")
        assert code == "timeout", (code, msg)
        r = await ok(s, "exec", session_id=sid, code="kept")
        assert (r["value"], r["checkpoint"]) == ("7", 2)
        code, _, _ = await err(s, "revert", session_id=sid, checkpoint=99)
        assert code == "checkpoint_not_found"
        code, _, _ = await err(s, "run_python", code="while True: pass", timeout_seconds=0.5)
        assert code == "timeout"
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)


def test_png_written_to_output_comes_back_as_image_content(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        r = await s.call_tool("exec", {"session_id": sid, "code": PNG_CODE})
        assert not r.is_error, r.content
        assert r.structured_content["stdout"] == "wrote\n"
        assert [(o["path"], o["mime"]) for o in r.structured_content["outputs"]] == [("/output/square.png", "image/png")]
        images = [c for c in r.content if c.type == "image"]
        assert len(images) == 1 and images[0].mime_type == "image/png"
        assert decode_png(images[0].data) == (5, 3, bytes([255, 128, 0]))
        # One-shot execs return their images too; an exec that writes nothing returns none.
        r = await s.call_tool("run_python", {"code": PNG_CODE})
        assert [c.type for c in r.content].count("image") == 1
        r = await s.call_tool("exec", {"session_id": sid, "code": "1"})
        assert [c.type for c in r.content] == ["text"]
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)
