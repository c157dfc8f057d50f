"""Agent frameworks with an E2B back-end (pinned in requirements.txt) against a real
`forkbox serve`, unchanged: only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point
them at the server. The models are scripted (no LLM); nothing leaves the machine."""

import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO
from test_e2b import e2b_server, server  # noqa: F401  (module fixtures: a server of this module's own)

from smolagents import CodeAgent, tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402


class ScriptedModel(Model):
    """A `Model` that answers each step with the next fixed code block and keeps what it was shown."""

    def __init__(self, steps):
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.seen = []

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        self.seen.append(messages)
        if not self.steps:
            raise AssertionError("the agent asked for more steps than the script has")
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.steps.pop(0))


def text_of(messages) -> str:
    out = []
    for m in messages:
        content = m.content if hasattr(m, "content") else m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return "\n".join(out)


@tool
def word_lengths(text: str) -> list:
    """Lengths of the words of a text.

    Args:
        text: the text to split on whitespace.
    """
    return [len(w) for w in text.split()]


def test_smolagents_code_agent_on_e2b_executor(e2b_server):  # noqa: F811
    model = ScriptedModel([
        # Step 1: a tool defined in the sandbox, numpy (installed by `!pip install numpy`), state.
        "Thought: measure the words first.\n<code>\n"
        "import numpy as np\n"
        "lengths = word_lengths('forkbox forks warm python sandboxes')\n"
        "total = int(np.sum(lengths))\n"
        "print('total', total)\n"
        "</code>",
        # Step 2: the variables of step 1 are still there; the final answer is a BaseException in the sandbox.
        "Thought: now answer.\n<code>\n"
        "final_answer({'lengths': lengths, 'total': total, 'mean': total / len(lengths)})\n"
        "</code>",
    ])
    agent = CodeAgent(
        tools=[word_lengths],
        model=model,
        executor_type="e2b",
        additional_authorized_imports=["numpy"],
        max_steps=4,
        verbosity_level=0,
    )
    with agent:
        answer = agent.run("How long are the words of 'forkbox forks warm python sandboxes', and in total?")
        assert answer == {"lengths": [7, 5, 4, 6, 9], "total": 31, "mean": 6.2}
        # The second step saw the first step's output, printed in the sandbox.
        assert len(model.seen) == 2
        assert re.search(r"total 31", text_of(model.seen[1]))
        sandbox_id = agent.python_executor.sandbox.sandbox_id
    # The agent killed its sandbox on exit.
    from e2b_code_interpreter import Sandbox

    assert sandbox_id not in {s.sandbox_id for s in Sandbox.list().next_items()}


def test_smolagents_error_step_then_recovery(e2b_server):  # noqa: F811
    """An exception in a step is fed back to the model as an error, and the agent goes on."""
    model = ScriptedModel([
        "<code>\nvalue = 10\nraise ValueError('not yet: ' + str(value))\n</code>",
        "<code>\nfinal_answer(value * 2)\n</code>",
    ])
    with CodeAgent(tools=[], model=model, executor_type="e2b", max_steps=4, verbosity_level=0) as agent:
        assert agent.run("double ten, eventually") == 20
        shown = text_of(model.seen[1])
        assert "ValueError" in shown and "not yet: 10" in shown


NODE_MODULES = REPO / "target" / "node" / "node_modules"


def test_npm_code_interpreter_sdk_under_node(e2b_server, tmp_path):  # noqa: F811
    """`@e2b/code-interpreter` from npm (installed under target/node by scripts/test) runs
    tests/node/e2b_basic.mjs unchanged."""
    if not (NODE_MODULES / "@e2b" / "code-interpreter").is_dir():
        pytest.fail("npm's @e2b/code-interpreter is missing: run scripts/test (it installs it under target/node)")
    # ESM resolves packages from the script's own directory: put both side by side.
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)
    script = tmp_path / "e2b_basic.mjs"
    shutil.copy(REPO / "tests" / "node" / "e2b_basic.mjs", script)
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_DOMAIN", "E2B_DEBUG")}
    r = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] == "42" and out["stdout"] == ["hello\n"] and out["error"] is None
    assert out["raised"] == ["KeyError", "'k'"]
    assert out["command"] == ["out\n/home/user\n", "err\n", 0]
    assert out["exitError"] == ["CommandExitError", 3]
    assert out["read"] == "from node" and out["listed"] is True
    assert out["python"] == "'from node'"
    assert out["killed"] is True and out["afterKill"] is False


def test_langchain_e2b_backend_commands_and_files(e2b_server):  # noqa: F811
    """langchain-e2b's Deep Agents backend over a core `e2b` sandbox of template `base`."""
    import hashlib

    import e2b
    from langchain_e2b import E2BSandbox

    sbx = e2b.Sandbox.create(template="base")
    try:
        backend = E2BSandbox(sandbox=sbx, timeout=60)
        assert backend.id == sbx.sandbox_id
        r = backend.execute("echo hi && pwd && [[ $0 == /bin/bash ]] && echo bash")
        assert (r.output, r.exit_code) == ("hi\n/home/user\nbash\n", 0)
        r = backend.execute("echo oops >&2; exit 4")
        assert (r.output, r.exit_code) == ("oops\n", 4)

        blob = bytes(range(256)) * 64
        up = backend.upload_files([("/home/user/data.bin", blob), ("/home/user/notes.md", b"# notes\nsome text\n")])
        assert [u.error for u in up] == [None, None]
        assert [u.error for u in backend.upload_files([("/home/user", b"x")])] == ["is_directory"]
        down = backend.download_files(["/home/user/data.bin", "/home/user/missing.txt", "/home/user", "rel.txt"])
        assert down[0].content == blob and down[0].error is None
        assert [d.error for d in down[1:]] == ["file_not_found", "is_directory", "invalid_path"]
        # What was uploaded is the guest's: a command sees the same bytes.
        r = backend.execute("sha256sum data.bin | cut -d' ' -f1")
        assert r.output.strip() == hashlib.sha256(blob).hexdigest()

        # Deep Agents' own file tools run on top of execute/upload/download.
        assert backend.write("/home/user/new/plan.txt", "step 1\nstep 2\n").error is None
        assert backend.write("/home/user/new/plan.txt", "again").error is not None
        assert backend.edit("/home/user/notes.md", "some text", "edited text").occurrences == 1
        assert backend.download_files(["/home/user/notes.md"])[0].content == b"# notes\nedited text\n"
        read = backend.read("/home/user/new/plan.txt")
        assert read.error is None and "step 2" in read.file_data["content"]
        listed = backend.ls("/home/user")
        assert {"/home/user/data.bin", "/home/user/new"} <= {e["path"] for e in listed.entries}
    finally:
        sbx.kill()


OAI_PYTHON = REPO / "target" / "oaivenv" / "bin" / "python"


def test_openai_agents_sdk_e2b_sandbox_client(e2b_server):  # noqa: F811
    """The OpenAI Agents SDK's `E2BSandboxClient` (openai-agents 0.24.0 with the e2b 2.31.0 it pins,
    in target/oaivenv, installed by scripts/test) runs tests/python/openai_agents_e2b.py unchanged.
    That e2b refuses a key not spelt `e2b_<hex>` before sending it: the same forkbox key is given so."""
    if not OAI_PYTHON.exists():
        pytest.fail("target/oaivenv is missing: run scripts/test (it installs openai-agents[e2b] there)")
    key = e2b_server.key
    assert key.startswith("fbk_")
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_DOMAIN", "E2B_DEBUG")}
    env["E2B_API_KEY"] = "e2b_" + key.removeprefix("fbk_")
    r = subprocess.run(
        [str(OAI_PYTHON), str(REPO / "tests" / "python" / "openai_agents_e2b.py")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["exec"] == {"exit": 0, "stdout": ["hello", "/workspace", "42"]}, seen
    assert seen["fail"] == {"exit": 3, "stderr": "oops"}, seen
    assert seen["read"] == "data 123\n" and seen["wc"] == "9", seen
    assert seen["archive_bytes"] > 0, seen
    assert seen["resumed_same_sandbox"] is True, seen
    assert seen["resumed_read"] == "data 123\n", seen
    assert seen["hydrated_read"] == "data 123\n", seen
    # A wrong key in that spelling is refused as any wrong key.
    env["E2B_API_KEY"] = "e2b_" + "0" * 64
    r = subprocess.run(
        [str(OAI_PYTHON), "-c", "from e2b import Sandbox; Sandbox.create(template='base')"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode != 0 and "AuthenticationException" in r.stderr, r.stderr[-2000:]
