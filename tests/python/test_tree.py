"""The tree of states from the clients: the SDK's explore/variables/diff/tree (sync and
asyncio), the CLI's `session explore|diff|tree|vars`, and the MCP tools try_alternatives,
inspect_checkpoint and diff_checkpoints, against a real `forkbox serve`."""

import json
import os
import subprocess

import anyio
import pytest

import forkbox
from forkbox import AsyncForkbox, Forkbox
from conftest import forkbox_bin
from mcp_helpers import err, http_session, ok


def test_sdk_explore_keeps_and_drops_and_the_session_stays(server):
    with Forkbox(server.url, server.key) as fb:
        s = fb.sessions.create()
        s.exec("vals = [3, 1, 2]")
        base = s.exec("len(vals)").checkpoint
        r = s.explore(["sorted(vals)", "max(vals)", "1/0", "vals.append(9)\nvals"], keep=[3])
        assert r.from_checkpoint == base and len(r) == 4
        assert [b.index for b in r] == [0, 1, 2, 3]
        assert r[0].result.value == "[1, 2, 3]" and r[1].result.value == "3"
        assert r[2].result.error.type == "ZeroDivisionError"
        assert r[0].session_id is None and r[0].checkpoint is None
        kept = fb.sessions.get(r[3].session_id)
        assert kept.info.tags["explore.from"] == s.id and r[3].checkpoint > base
        assert kept.exec("vals").value == "[3, 1, 2, 9]"
        assert s.exec("vals").value == "[3, 1, 2]"
        # A timed-out branch is its error, not raised; the others are fine.
        r = s.explore(["while True: pass", "7"], timeout=1)
        assert isinstance(r[0].error, forkbox.Timeout) and r[0].result is None
        assert r[1].result.value == "7"
        with pytest.raises(forkbox.InvalidRequest):
            s.explore([])
        with pytest.raises(TypeError):
            s.explore("1")
        with pytest.raises(forkbox.CheckpointNotFound):
            s.explore(["1"], checkpoint=999)


def test_sdk_variables_diff_and_tree(server):
    with Forkbox(server.url, server.key) as fb:
        s = fb.sessions.create()
        a = s.exec("import numpy as np\nm = np.ones((3, 4))\nword = 'hi'").checkpoint
        b = s.exec("m[0, 0] = 5\ndel word\nn = 7\nopen('/tmp/f.txt', 'w').write('abc')").checkpoint
        vs = {v.name: v for v in s.variables(a)}
        assert vs["m"].type == "numpy.ndarray" and vs["m"].size == 96 and vs["m"].len == 3
        assert vs["word"].repr == "'hi'"
        d = s.diff(a, b)
        assert [v["name"] for v in d["variables_added"]] == ["n"]
        assert [v["name"] for v in d["variables_removed"]] == ["word"]
        assert [v["name"] for v in d["variables_changed"]] == ["m"]
        assert d["files_added"] == [{"path": "/tmp/f.txt", "size_before": None, "size_after": 3}]
        assert [c["checkpoint"] for c in d["calls"]] == [b]
        assert s.diff(a)["to"] == b
        f = s.fork(a)
        c = f.exec("word * 2").checkpoint
        t = s.tree()
        assert [n["checkpoint"] for n in t["nodes"]] == [a, b, c]
        assert t["head"] == b and {x["id"] for x in t["sessions"]} == {s.id, f.id}
        assert [n["head"] for n in t["nodes"]] == [False, True, False]
        with pytest.raises(forkbox.CheckpointNotFound):
            s.variables(12345)


def test_async_sdk_explore_and_diff(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create()
            await s.exec("x = 2")
            r = await s.explore([f"x ** {i}" for i in range(6)], keep="all")
            assert [b.result.value for b in r] == ["1", "2", "4", "8", "16", "32"]
            assert all(b.session_id for b in r)
            one = await s.exec("x = 3")
            vs = await s.variables(one.checkpoint)
            assert ("x", "3") in [(v.name, v.repr) for v in vs]
            d = await s.diff(1, one.checkpoint)
            assert [v["name"] for v in d["variables_changed"]] == ["x"]
            t = await s.tree()
            assert len(t["sessions"]) == 7

    anyio.run(main)


def cli(server, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKBOX_")}
    env["FORKBOX_API_KEY"] = server.key
    return subprocess.run([forkbox_bin(), "--url", server.url, *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_explore_diff_tree_vars(server, tmp_path):
    sid = cli(server, "session", "new").stdout.strip()
    assert cli(server, "session", "exec", sid, "base = 10").returncode == 0
    alt = tmp_path / "alt.py"
    alt.write_text("def f():\n    return base * 3\nf()\n")
    r = cli(server, "session", "explore", sid, "-c", "base + 1", "-c", "base / 0", "-f", str(alt), "--keep", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("3 alternatives from checkpoint 1"), r.stdout
    assert lines[1].startswith("[0] 11") and lines[2].startswith("[1] ZeroDivisionError"), r.stdout
    assert lines[3].startswith("[2] 30") and "kept: s_" in lines[3], r.stdout
    r = cli(server, "session", "explore", sid, "-c", "base", "--json")
    assert json.loads(r.stdout)["branches"][0]["result"]["value"] == "10"
    assert cli(server, "session", "exec", sid, "base = 20\nextra = [1]").returncode == 0
    r = cli(server, "session", "diff", sid, "1")
    assert r.returncode == 0, r.stderr
    assert "+ extra (list) = [1]" in r.stdout and "~ base: 10 -> 20" in r.stdout, r.stdout
    r = cli(server, "session", "vars", sid, "1")
    assert "base" in r.stdout and "int" in r.stdout, r.stdout
    r = cli(server, "session", "tree", sid)
    assert r.returncode == 0, r.stderr
    tree = r.stdout.splitlines()
    assert tree[0].lstrip().startswith("1  base = 10"), r.stdout
    assert any(l.startswith("*") and "base = 20" in l for l in tree), r.stdout
    assert any("[s_" in l for l in tree), r.stdout  # the kept branch's session head
    r = cli(server, "session", "explore", sid, "--keep", "x,y", "-c", "1")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli(server, "session", "explore", sid)
    assert r.returncode != 0 and "no alternatives" in r.stderr
    r = cli(server, "session", "diff", sid, "99")
    assert r.returncode != 0 and "checkpoint" in r.stderr


def test_mcp_tree_tools(server):
    async def main():
        async with http_session(server.url, server.key) as m:
            sid = (await ok(m, "create_session"))["session_id"]
            await ok(m, "exec", session_id=sid, code="data = [5, 3, 8]")
            tools = {t.name: t for t in (await m.list_tools()).tools}
            assert "parallel" in tools["try_alternatives"].description
            r = await ok(m, "try_alternatives", session_id=sid, codes=["sorted(data)", "sum(data)", "data.bad()"], keep=[1])
            b = r["branches"]
            assert b[0]["result"]["value"] == "[3, 5, 8]" and b[1]["result"]["value"] == "16"
            assert b[2]["result"]["error"]["type"] == "AttributeError"
            assert b[1]["session"] and b[0]["session"] is None
            v = await ok(m, "inspect_checkpoint", session_id=sid, checkpoint=1)
            assert {x["name"]: x["repr"] for x in v["variables"]}["data"] == "[5, 3, 8]"
            await ok(m, "exec", session_id=sid, code="data.append(1)")
            d = await ok(m, "diff_checkpoints", session_id=sid, **{"from": 1})
            assert [x["name"] for x in d["variables_changed"]] == ["data"]
            code, _, text = await err(m, "inspect_checkpoint", session_id=sid, checkpoint=404)
            assert code == "checkpoint_not_found" and "list_checkpoints" in text
            code, _, _ = await err(m, "try_alternatives", session_id=sid, codes=[])
            assert code == "invalid_request"
            code, msg, _ = await err(m, "try_alternatives", session_id=sid, codes="x")
            assert code == "invalid_arguments" and "codes" in msg

    anyio.run(main)
