"""scripts/cpython-tests itself: real CPython regression tests on the host and in a
real sandbox (the `cpython-tests` template), and its check mode against a
failure list: a sandbox-only failure not on the list fails the check, a listed
test that passes is reported as fixed, --update rewrites the list."""

import json
import os
import subprocess

from conftest import REPO, forkbox_bin, require_kvm, shared_home

SCRIPT = REPO / "scripts" / "cpython-tests"
# One class of test_asyncio.test_sendfile: a peer that closes in the middle of a sendfile is not
# seen in the sandbox (test_sendfile_close_peer_in_the_middle_of_receiving: a sandbox-only failure).
MODULE = "test_asyncio.test_sendfile.SelectEventLoopTests"
TOOL = "test." + MODULE + "."
FAILING = "test_sendfile_close_peer_in_the_middle_of_receiving"
BISECT = "test.test_bisect.TestBisectC.test_insort"


def run(tmp_path, *args):
    env = dict(os.environ, FORKBOX_BIN=forkbox_bin(), FORKBOX_HOME=str(shared_home()))
    return subprocess.run(
        ["python3", str(SCRIPT), MODULE, "test_bisect", "--results", str(tmp_path / "res"),
         "--failures", str(tmp_path / "list.txt"), *args],
        capture_output=True, text=True, env=env, timeout=900,
    )


def test_check_update_and_results(tmp_path):
    require_kvm()
    listed = tmp_path / "list.txt"
    # FAILING is not on the list: a regression; test_insort is, but passes: fixed.
    listed.write_text(f"# test list\n## wrongly listed\n{BISECT}\n")
    r = run(tmp_path, "--check")
    assert r.returncode == 1, r.stderr
    regressions = [l for l in r.stderr.splitlines() if l.startswith("REGRESSION")]
    assert any(TOOL + FAILING + ":" in l for l in regressions), r.stderr
    assert not any("test_bisect" in l for l in regressions), r.stderr
    assert f"FIXED (passes in the sandbox now; remove it from the list): {BISECT}" in r.stderr

    res = json.loads((tmp_path / "res" / "results.json").read_text())
    bisect = res["modules"]["test_bisect"]
    assert bisect["host"]["counts"]["pass"] >= 40 and bisect["host"]["counts"] == bisect["sandbox"]["counts"], bisect
    tool = res["modules"][MODULE]
    assert tool["host"]["counts"]["fail"] == 0 and tool["host"]["counts"]["pass"] >= 5, tool["host"]["counts"]
    assert tool["host"]["tests"][TOOL + FAILING][0] == "pass"
    assert tool["sandbox"]["tests"][TOOL + FAILING][0] in ("fail", "error")
    assert TOOL + FAILING in tool["sandbox_only"]
    md = (tmp_path / "res" / "summary.md").read_text()
    assert "| test_bisect | " in md and f"| {MODULE} | " in md

    r = run(tmp_path, "--update")
    assert r.returncode == 0, r.stderr
    text = listed.read_text()
    assert BISECT not in text and "## wrongly listed" not in text
    assert TOOL + FAILING in text
    r = run(tmp_path, "--check")
    assert r.returncode == 0, r.stderr
    assert "REGRESSION" not in r.stderr and "FIXED" not in r.stderr
