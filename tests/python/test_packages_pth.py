"""What a wheel's `.pth` file does after `%pip install` in a session (the
README's statement, tested): the session's running interpreter does not
process it (its `site` ran before the install), an interpreter the guest starts
afterwards does, inside the sandbox."""

import base64
import hashlib
import tempfile
import zipfile
from pathlib import Path

import requests

from conftest import start_server, stop_server


def write_wheel(out: Path, name: str, files: dict):
    dist = f"{name}-1.0.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"

    def h(d: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()

    rows = [f"{n},{h(d)},{len(d)}" for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(out / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for n, d in files.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), d)


CHECK = """
import os, subprocess, sys
child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get("FBX_PTH_RAN"))'],
                       capture_output=True, text=True).stdout.strip()
(os.environ.get('FBX_PTH_RAN'), child)
"""


def test_a_wheels_pth_runs_in_child_interpreters_only():
    with tempfile.TemporaryDirectory(prefix="forkbox-pth-") as d:
        house = Path(d) / "house"
        house.mkdir()
        write_wheel(house, "fbxpth", {
            "fbxpth/__init__.py": b"",
            "fbxpth.pth": b"import os; os.environ['FBX_PTH_RAN'] = 'yes'\n",
        })
        s = start_server(Path(d) / "home", "--pip-find-links", str(house), "--pip-no-index")
        try:
            r = requests.post(f"{s.url}/v1/sessions", headers=s.headers(), json={}, timeout=120)
            sid = r.json()["id"]
            r = requests.post(f"{s.url}/v1/sessions/{sid}/exec", headers=s.headers(),
                              json={"code": "%pip install fbxpth\n" + CHECK}, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["value"] == "(None, 'yes')", r.text
        finally:
            stop_server(s)
