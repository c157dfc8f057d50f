"""ForeverVM compatibility: ForeverVM's own published Python SDK (PyPI
`forevervm-sdk`, unmodified) pointed at a real `forkbox serve`."""

import httpx
import pytest
from forevervm_sdk import ForeverVM
from httpx_ws import WebSocketUpgradeError


@pytest.fixture
def fvm(server):
    return ForeverVM(server.key, base_url=server.url)


def test_whoami_is_the_keys_tenant(server, fvm):
    assert fvm.whoami() == {"account": "default"}
    other = server.create_key("fvm-other")
    assert ForeverVM(other, base_url=server.url).whoami() == {"account": "fvm-other"}


def test_create_and_list_machines(server, fvm):
    # A tenant of its own, so other tests' sessions do not show up.
    client = ForeverVM(server.create_key("fvm-list"), base_url=server.url)
    assert client.list_machines() == {"machines": []}
    a = client.create_machine(tags={"team": "x"})["machine_name"]
    b = client.create_machine(memory_mb=256)["machine_name"]
    machines = {m["name"]: m for m in client.list_machines()["machines"]}
    assert set(machines) == {a, b}
    assert machines[a]["tags"] == {"team": "x"}
    assert machines[b]["tags"] == {}
    for m in machines.values():
        assert m["created_at"].endswith("Z") and m["expires_at"] is None
        assert m["has_pending_instructions"] is False
    # The machines are forkbox sessions of that tenant, invisible to others.
    sessions = httpx.get(f"{server.url}/v1/sessions", headers=server.headers(client._token), timeout=30).json()["sessions"]
    assert {s["id"] for s in sessions} == {a, b}
    assert machines[b]["name"] not in {m["name"] for m in fvm.list_machines()["machines"]}


def test_exec_and_result_value_error_and_state(fvm):
    machine = fvm.create_machine()["machine_name"]
    r = fvm.exec("import numpy as np\nx = int(np.arange(5).sum())\nx * 2", machine_name=machine)
    assert r["machine"] == machine and r["interrupted"] is False
    first = r["instruction_seq"]
    res = fvm.exec_result(machine, first)
    assert res["instruction_id"] == first
    assert res["result"]["value"] == "20"
    assert res["result"]["data"] is None
    assert isinstance(res["result"]["runtime_ms"], int)

    # State persists across instructions; a Python exception is an error result.
    r = fvm.exec("x + 1", machine_name=machine)
    assert r["instruction_seq"] == first + 1
    assert fvm.exec_result(machine, r["instruction_seq"])["result"]["value"] == "11"
    r = fvm.exec("raise ValueError('nope')", machine_name=machine)
    err = fvm.exec_result(machine, r["instruction_seq"])["result"]
    assert err["error"].startswith("ValueError: nope\n"), err
    assert "Traceback" in err["error"] and "value" not in err
    r = fvm.exec("x", machine_name=machine)
    assert fvm.exec_result(machine, r["instruction_seq"])["result"]["value"] == "10"

    # Without a machine name the SDK creates one.
    r = fvm.exec("40 + 2")
    assert r["machine"] != machine
    assert fvm.exec_result(r["machine"], r["instruction_seq"])["result"]["value"] == "42"

    # Unknown machine / instruction: HTTP errors the SDK raises.
    with pytest.raises(httpx.HTTPStatusError) as e:
        fvm.exec("1", machine_name="s_does_not_exist")
    assert e.value.response.status_code == 404
    with pytest.raises(httpx.HTTPStatusError) as e:
        fvm.exec_result(machine, 10_000)
    assert e.value.response.json()["error"]["code"] == "instruction_not_found"


def test_exec_returns_at_once_and_result_long_polls(fvm):
    import time

    machine = fvm.create_machine()["machine_name"]
    t0 = time.monotonic()
    r = fvm.exec("import time\ntime.sleep(1.5)\n'slept'", machine_name=machine)
    assert time.monotonic() - t0 < 1.0
    assert fvm.exec_result(machine, r["instruction_seq"])["result"]["value"] == "'slept'"
    assert time.monotonic() - t0 >= 1.5


def test_repl_websocket(server, fvm):
    with fvm.repl() as repl:  # machine "new": the server creates one
        res = repl.exec("import sys, time\nprint('hello')\ntime.sleep(0.2)\nprint('oops', file=sys.stderr)\ny = 6\ny * 7")
        # Output arrives as it is written, before the result.
        chunks = list(res.output)
        assert "".join(c["data"] for c in chunks if c["stream"] == "stdout") == "hello\n"
        assert "".join(c["data"] for c in chunks if c["stream"] == "stderr") == "oops\n"
        assert [c["stream"] for c in chunks][0] == "stdout"
        assert res.result["value"] == "42"
        res = repl.exec("y + 1")
        assert res.result["value"] == "7"
        res = repl.exec("1 / 0")
        assert res.result["error"].startswith("ZeroDivisionError: division by zero")
        res = repl.exec("y")
        assert res.result["value"] == "6"

    # An existing machine keeps its state between the HTTP API and the REPL.
    machine = fvm.create_machine()["machine_name"]
    fvm.exec_result(machine, fvm.exec("z = 'from http'", machine_name=machine)["instruction_seq"])
    with fvm.repl(machine) as repl:
        assert repl.exec("z").result["value"] == "'from http'"

    # Another tenant cannot open it; a bad key cannot open any.
    other = ForeverVM(server.create_key("fvm-intruder"), base_url=server.url)
    with pytest.raises(WebSocketUpgradeError) as e:
        other.repl(machine)
    assert e.value.response.status_code == 404
    with pytest.raises(WebSocketUpgradeError) as e:
        ForeverVM("fbk_bad", base_url=server.url).repl()
    assert e.value.response.status_code == 401
