"""The file and interrupt tools of the MCP server (upload_file, download_file, list_files,
interrupt), driven by the official MCP Python SDK over stdio (`forkbox mcp`, embedded) and
streamable HTTP (`/mcp` of the `server` fixture)."""

import base64

import anyio
import pytest

from conftest import fresh_home
from mcp_helpers import err, http_session, ok, stdio_session


@pytest.fixture(scope="module")
def stdio_home(tmp_path_factory):
    return fresh_home(tmp_path_factory.mktemp("mcp-files") / "home")


@pytest.fixture(params=["stdio", "http"])
def connect(request, stdio_home):
    if request.param == "stdio":
        return lambda: stdio_session(stdio_home)
    server = request.getfixturevalue("server")
    # A key of its own without a request rate: each tool call here is one or two API calls, many in a row.
    key = server.create_key("mcp-files", "--unlimited")
    return lambda: http_session(server.url, key)


def run(scenario, connect):
    async def main():
        async with connect() as session:
            await scenario(session)

    anyio.run(main)


def test_descriptions_tell_a_model_what_the_file_tools_do(connect):
    async def scenario(s):
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert set(tools["upload_file"].input_schema["required"]) == {"session_id", "path", "content"}
        assert set(tools["download_file"].input_schema["required"]) == {"session_id", "path"}
        assert tools["list_files"].input_schema["required"] == ["session_id"]
        assert tools["interrupt"].input_schema["required"] == ["session_id"]
        assert "base64" in tools["upload_file"].description and "exec" in tools["upload_file"].description
        assert "max_bytes" in tools["download_file"].description and "file_too_large" in tools["download_file"].description
        assert "KeyboardInterrupt" in tools["interrupt"].description

    run(scenario, connect)


def test_upload_csv_use_it_in_exec_download_and_list(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        csv = "city,temp\nOslo,4\nLima,19\n"
        up = await ok(s, "upload_file", session_id=sid, path="/data/temps.csv", content=csv)
        assert (up["path"], up["size"], up["checkpoint"]) == ("/data/temps.csv", len(csv), 1)
        code = ("import csv\nrows = list(csv.DictReader(open('/data/temps.csv')))\n"
                "open('/output/hot.txt', 'w').write(max(rows, key=lambda r: int(r['temp']))['city'])\n"
                "open('/output/blob.bin', 'wb').write(bytes([0, 255, 1, 254]))\nlen(rows)")
        assert (await ok(s, "exec", session_id=sid, code=code))["value"] == "2"
        d = await ok(s, "download_file", session_id=sid, path="/output/hot.txt")
        assert (d["encoding"], d["content"], d["size"]) == ("text", "Lima", 4)
        # Binary: base64 by default; text can be asked for only if it is UTF-8.
        d = await ok(s, "download_file", session_id=sid, path="/output/blob.bin")
        assert d["encoding"] == "base64" and base64.b64decode(d["content"]) == bytes([0, 255, 1, 254])
        code_, msg, _ = await err(s, "download_file", session_id=sid, path="/output/blob.bin", encoding="text")
        assert code_ == "invalid_arguments" and "base64" in msg
        d = await ok(s, "download_file", session_id=sid, path="/output/hot.txt", encoding="base64")
        assert base64.b64decode(d["content"]) == b"Lima"
        # A binary upload.
        png = bytes(range(200))
        up = await ok(s, "upload_file", session_id=sid, path="/data/x.bin", content=base64.b64encode(png).decode(),
                      encoding="base64")
        assert up["size"] == 200
        assert (await ok(s, "exec", session_id=sid, code="open('/data/x.bin','rb').read() == bytes(range(200))"))["value"] == "True"
        listed = await ok(s, "list_files", session_id=sid)
        assert listed["dir"] == "/output"
        assert {(f["path"], f["size"], f["is_dir"]) for f in listed["files"]} == {("/output/hot.txt", 4, False),
                                                                                  ("/output/blob.bin", 4, False)}
        listed = await ok(s, "list_files", session_id=sid, dir="/data")
        assert sorted(f["name"] for f in listed["files"]) == ["temps.csv", "x.bin"]
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)


def test_file_tool_errors_are_clear(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        await ok(s, "exec", session_id=sid, code="open('/output/big.txt', 'w').write('x' * 300000)")
        code, msg, text = await err(s, "download_file", session_id=sid, path="/output/big.txt")
        assert code == "file_too_large" and "300000 bytes" in msg and "262144" in msg, msg
        assert "exec" in text
        d = await ok(s, "download_file", session_id=sid, path="/output/big.txt", max_bytes=400000)
        assert d["size"] == 300000
        code, msg, _ = await err(s, "download_file", session_id=sid, path="/output/big.txt", max_bytes=10 << 20)
        assert code == "invalid_arguments" and "max_bytes" in msg
        code, _, text = await err(s, "download_file", session_id=sid, path="/output/nope.txt")
        assert code == "file_not_found" and "list_files" in text
        code, msg, _ = await err(s, "download_file", session_id=sid, path="relative.txt")
        assert code == "invalid_arguments" and "absolute" in msg
        code, msg, _ = await err(s, "upload_file", session_id=sid, path="/data/a", content="***", encoding="base64")
        assert code == "invalid_arguments" and "base64" in msg
        code, msg, _ = await err(s, "upload_file", session_id=sid, path="/data/a", content="x", encoding="utf16")
        assert code == "invalid_arguments" and "encoding" in msg, msg
        code, _, _ = await err(s, "list_files", session_id="s_doesnotexist")
        assert code == "session_not_found"
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)


def test_interrupt_stops_a_running_exec_and_keeps_the_session(connect):
    async def scenario(s):
        sid = (await ok(s, "create_session", timeout_seconds=60))["session_id"]
        await ok(s, "exec", session_id=sid, code="kept = 'yes'")
        assert (await ok(s, "interrupt", session_id=sid))["interrupted"] is False
        result = {}

        async def long_exec():
            result["r"] = await s.call_tool("exec", {"session_id": sid, "code": "import time\nwhile True: time.sleep(0.05)"})

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_exec)
            interrupted = False
            with anyio.fail_after(30):
                while not interrupted:
                    await anyio.sleep(0.5)
                    interrupted = (await ok(s, "interrupt", session_id=sid))["interrupted"]
        r = result["r"]
        assert not r.is_error, r.content
        assert r.structured_content["error"]["type"] == "KeyboardInterrupt"
        assert (await ok(s, "exec", session_id=sid, code="kept"))["value"] == "'yes'"
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)


def test_background_process_tools(connect, request):
    """start_process returns at once; the process runs on between tool calls; its output is read from
    offsets; list_processes and kill_process see and stop it. Embedded (stdio without a server) runs
    sessions on its own threads, where background processes are refused with a clear error."""
    embedded = request.node.callspec.params["connect"] == "stdio"

    async def scenario(s):
        sid = (await ok(s, "create_session"))["session_id"]
        if embedded:
            code, msg, _ = await err(s, "start_process", session_id=sid, command="sleep 1")
            assert code == "invalid_request" and "--isolation" in msg, msg
            return
        started = await ok(s, "start_process", session_id=sid,
                           command="i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.1; done")
        pid = started["pid"]
        assert started["process"]["state"] == "running"
        # Other calls go on meanwhile.
        assert (await ok(s, "exec", session_id=sid, code="6 * 7"))["value"] == "42"
        await anyio.sleep(0.6)
        first = await ok(s, "read_process_output", session_id=sid, pid=pid)
        assert first["running"] and first["stdout"].startswith("tick 1\ntick 2\n"), first
        more = await ok(s, "read_process_output", session_id=sid, pid=pid, stdout_offset=first["stdout_next_offset"])
        assert not more["stdout"].startswith("tick 1\n")
        listed = await ok(s, "list_processes", session_id=sid)
        assert [p["pid"] for p in listed["processes"]] == [pid]
        killed = await ok(s, "kill_process", session_id=sid, pid=pid)
        assert killed["process"]["state"] == "exited" and killed["process"]["signal"] == 15, killed
        # One that ends by itself: wait_seconds waits for its end.
        pid2 = (await ok(s, "start_process", session_id=sid, command="sleep 0.3; echo done; exit 3"))["pid"]
        out = await ok(s, "read_process_output", session_id=sid, pid=pid2, wait_seconds=20)
        assert (out["running"], out["exit_code"], out["stdout"]) == (False, 3, "done\n"), out
        code, _, _ = await err(s, "read_process_output", session_id=sid, pid=4242)
        assert code == "process_not_found"
        await ok(s, "delete_session", session_id=sid)

    run(scenario, connect)
