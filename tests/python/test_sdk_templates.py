"""Custom templates through the Python SDK against a real `forkbox serve`: a pip
template from an offline wheelhouse this test writes (tests never leave the
machine), a failed build, and a template made of a session's checkpoint."""

import base64
import hashlib
import zipfile

import pytest

import forkbox
from conftest import fresh_home, shared_home, start_server, stop_server


def write_wheel(path, name, module):
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": module.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def h(d):
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()

    rows = [f"{n},{h(d)},{len(d)}" for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(rows) + "\n").encode()
    # Fixed timestamps: the same wheel bytes every run, so its image is reused.
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), d)


@pytest.fixture(scope="module")
def pip_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    house = root / "wheelhouse"
    house.mkdir()
    write_wheel(house, "sdkdemo", "def triple(x):\n    return 3 * x\n")
    (house / "onlysdist-1.0.tar.gz").write_bytes(b"never built")
    home = fresh_home(root / "home")
    for d in ("images", "cache"):
        (shared_home() / d).mkdir(parents=True, exist_ok=True)
        (home / d).symlink_to(shared_home() / d)
    s = start_server(home, "--pip-find-links", str(house), "--pip-no-index")
    yield s
    stop_server(s)


def test_a_pip_template_builds_and_runs(pip_server):
    with forkbox.Forkbox(pip_server.url, pip_server.key) as fb:
        t = fb.create_template("sdkdemo", pip=["sdkdemo"], preload="import sdkdemo", poll=0.5)
        assert t["status"] == "ready" and t["pip"] == ["sdkdemo"] and t["image_bytes"] > 0, t
        assert any(x["name"] == "sdkdemo" for x in fb.templates())
        assert fb.exec("sdkdemo.triple(14)", template="sdkdemo").value == "42"
        s = fb.sessions.create(template="sdkdemo")
        assert s.exec("import sdkdemo\nsdkdemo.triple(2)").value == "6"
        with pytest.raises(forkbox.ForkboxError) as e:
            fb.create_template("nowheel", pip=["onlysdist"], poll=0.5)
        assert "no binary wheel of onlysdist" in str(e.value)
        with pytest.raises(forkbox.TemplateExists):
            fb.create_template("python")


def test_a_checkpoint_becomes_a_template(pip_server):
    with forkbox.Forkbox(pip_server.url, pip_server.key) as fb:
        s = fb.sessions.create()
        r = s.exec("import collections\ncounts = collections.Counter('abracadabra')")
        t = s.to_template(r.checkpoint, "abra")
        assert t["status"] == "ready" and t["source"] == "checkpoint", t
        s.delete()
        assert fb.exec("counts['a']", template="abra").value == "5"
        s2 = fb.sessions.create(template="abra")
        assert s2.exec("counts.most_common(1)").value == "[('a', 5)]"
