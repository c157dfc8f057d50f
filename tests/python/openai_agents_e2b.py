"""The OpenAI Agents SDK's E2B sandbox client (`agents.extensions.sandbox.e2b`) against a
`forkbox serve`, unchanged. Run by test_e2b_frameworks.py with the Python of its own venv
(target/oaivenv: `openai-agents[e2b]` pins `e2b` 2.31, older than the SDK of the main venv),
with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set. Prints one JSON object of what it saw."""

import asyncio
import io
import json
import sys
from pathlib import Path

from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions


def text(b) -> str:
    return b.decode() if isinstance(b, (bytes, bytearray)) else str(b)


async def main() -> dict:
    seen: dict = {}
    client = E2BSandboxClient()
    session = await client.create(
        options=E2BSandboxClientOptions(sandbox_type="e2b", template="base", pause_on_exit=True)
    )
    # start() installs the SDK's runtime helpers (a `sh -c` script of several KiB) and the workspace.
    await session.start()
    r = await session.exec("echo hello; pwd; python3 -c 'print(6 * 7)'")
    seen["exec"] = {"exit": r.exit_code, "stdout": text(r.stdout).split()}
    r = await session.exec("echo oops >&2; exit 3")
    seen["fail"] = {"exit": r.exit_code, "stderr": text(r.stderr).strip()}
    await session.write(Path("notes/a.txt"), io.BytesIO(b"data 123\n"))
    seen["read"] = text((await session.read(Path("notes/a.txt"))).read())
    r = await session.exec("cat notes/a.txt | wc -c")
    seen["wc"] = text(r.stdout).strip()
    archive = (await session.persist_workspace()).read()
    seen["archive_bytes"] = len(archive)
    state = session.state
    seen["sandbox_id"] = state.sandbox_id
    # stop() persists; with pause_on_exit the sandbox is paused, and resume() connects to it.
    await session.stop()
    await session.shutdown()
    again = await client.resume(state)
    await again.start()
    seen["resumed_same_sandbox"] = again.state.sandbox_id == state.sandbox_id
    r = await again.exec("cat notes/a.txt")
    seen["resumed_read"] = text(r.stdout)
    # The archive restores the workspace into a sandbox where the file was changed.
    await again.exec("echo changed > notes/a.txt")
    await again.hydrate_workspace(io.BytesIO(archive))
    seen["hydrated_read"] = text((await again.read(Path("notes/a.txt"))).read())
    await again.shutdown()
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
    sys.stdout.flush()
