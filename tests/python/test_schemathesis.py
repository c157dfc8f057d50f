"""Property-based API tests: schemathesis (PyPI) generates requests from the
server's own /v1/openapi.json and checks the answers: no 5xx, only documented
statuses and content types, bodies that match the documented schemas.
Bounded (`--max-examples`) so it finishes in a few minutes on 2 cores."""

import os
import subprocess
import sys
from pathlib import Path

import httpx

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_openapi_document_is_served_without_auth(server):
    r = httpx.get(f"{server.url}/v1/openapi.json", timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert "/v1/sessions/{id}/exec" in doc["paths"] and "/v1/machine/{name}/exec/{seq}/result" in doc["paths"]


def test_schemathesis_against_the_live_server(server, tmp_path):
    cli = Path(sys.executable).parent / "schemathesis"
    examples = os.environ.get("FORKBOX_SCHEMATHESIS_EXAMPLES", "20")
    cmd = [
        str(cli), "run", f"{server.url}/v1/openapi.json",
        "--url", server.url,
        "-H", f"Authorization: Bearer {server.key}",
        "--checks", CHECKS,
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", examples,
        "--seed", "1",
        "--request-timeout", "90",
        "--generation-database", "none",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]
    # (cwd: schemathesis keeps a cache directory in its working directory)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 0, f"schemathesis found problems:\n{out.stdout[-20000:]}\n{out.stderr[-5000:]}"
    # It really exercised the API (not an empty run).
    assert "passed" in out.stdout.lower(), out.stdout[-5000:]
