"""MCP connections to forkbox made by the official MCP Python SDK (PyPI `mcp`):
over stdio (spawning `forkbox mcp`) and over streamable HTTP (`/mcp` of `forkbox serve`)."""

import base64
import struct
import zlib
from contextlib import asynccontextmanager
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import forkbox_bin, shared_image

TOOLS = {"run_python", "create_session", "exec", "list_sessions", "delete_session", "list_checkpoints", "revert", "fork_session",
         "upload_file", "download_file", "list_files", "interrupt", "run_command",
         "try_alternatives", "inspect_checkpoint", "diff_checkpoints", "save_template", "install_packages",
         "start_process", "read_process_output", "list_processes", "kill_process"}


@asynccontextmanager
async def stdio_session(home: Path, *mcp_args: str, env: dict | None = None):
    """`forkbox --home HOME mcp ARGS` as a subprocess, initialized."""
    args = ["--home", str(home), "mcp", *mcp_args]
    if "--url" not in mcp_args:
        args += ["--image", shared_image()]
    params = StdioServerParameters(command=forkbox_bin(), args=args, env=env)
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


@asynccontextmanager
async def http_session(url: str, key: str | None):
    """The streamable-HTTP endpoint `URL/mcp`, authenticated with `key`, initialized."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with create_mcp_http_client(headers=headers) as http:
        async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


async def call(session: ClientSession, tool: str, **arguments):
    """Call a tool; return (structured content, the whole result)."""
    r = await session.call_tool(tool, arguments)
    return r.structured_content, r


async def ok(session: ClientSession, tool: str, **arguments) -> dict:
    """Call a tool that must succeed; return its structured content."""
    s, r = await call(session, tool, **arguments)
    assert not r.is_error, f"{tool}({arguments}) failed: {r.content}"
    assert isinstance(s, dict), r
    return s


async def err(session: ClientSession, tool: str, **arguments) -> tuple[str, str, str]:
    """Call a tool that must fail with a tool error; return (code, message, text)."""
    s, r = await call(session, tool, **arguments)
    assert r.is_error, f"{tool}({arguments}) should have failed: {r}"
    text = "".join(c.text for c in r.content if c.type == "text")
    return s["error"]["code"], s["error"]["message"], text


# A PNG built in the guest with zlib + struct (there is no imaging library there).
PNG_CODE = r"""
import struct, zlib
def png(w, h, rgb):
    raw = b"".join(b"\x00" + bytes(rgb) * w for _ in range(h))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
with open("/output/square.png", "wb") as f:
    f.write(png(5, 3, (255, 128, 0)))
print("wrote")
"""


def decode_png(b64: str) -> tuple[int, int, bytes]:
    """(width, height, first pixel RGB) of an 8-bit RGB PNG, checking every chunk's CRC."""
    data = base64.b64decode(b64, validate=True)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xffffffff, kind
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    return w, h, raw[1:4]
