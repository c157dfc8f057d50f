"""Streaming (Server-Sent Events), interrupt and files against a real `forkbox serve`, with a plain HTTP client."""

import json
import threading
import time

import httpx


def sse_events(response):
    """(event, data, arrival time) for each event of an SSE response, as they arrive."""
    event, data = "message", []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield event, json.loads("\n".join(data)), time.monotonic()
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


def test_stream_sends_stdout_before_the_result(server):
    code = "import time\nfor i in range(3):\n    print(i)\n    time.sleep(0.3)\n'end'"
    with httpx.stream("POST", f"{server.url}/v1/exec/stream", json={"code": code}, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    kinds = [e[0] for e in events]
    assert kinds[-1] == "result" and kinds.count("result") == 1, kinds
    assert set(kinds[:-1]) == {"stdout"}, kinds
    assert "".join(e[1]["data"] for e in events[:-1]) == "0\n1\n2\n"
    assert events[-1][1]["value"] == "'end'" and events[-1][1]["stdout"] == "0\n1\n2\n"
    assert events[-1][2] - events[0][2] >= 0.5, "output was not streamed as it was written"


def test_upload_then_open_and_download_what_python_wrote(server):
    h = server.headers()
    sid = httpx.post(f"{server.url}/v1/sessions", json={}, headers=h, timeout=60).json()["id"]
    payload = bytes(range(256)) * 1000
    r = httpx.put(f"{server.url}/v1/sessions/{sid}/files/work/input.bin", content=payload, headers=h, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["path"] == "/work/input.bin" and r.json()["size"] == len(payload)
    code = "data = open('/work/input.bin', 'rb').read()\nopen('/output/rev.bin', 'wb').write(data[::-1])\nlen(data)"
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": code}, headers=h, timeout=60)
    assert r.json()["value"] == str(len(payload)), r.text
    assert [o["path"] for o in r.json()["outputs"]] == ["/output/rev.bin"]
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/files/output/rev.bin", headers=h, timeout=60)
    assert r.status_code == 200 and r.content == payload[::-1]
    listing = httpx.get(f"{server.url}/v1/sessions/{sid}/files", params={"dir": "/output"}, headers=h, timeout=60).json()
    assert [f["name"] for f in listing["files"]] == ["rev.bin"]
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/files/output/missing", headers=h, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"


def test_interrupt_a_running_loop_over_http(server):
    h = server.headers()
    sid = httpx.post(f"{server.url}/v1/sessions", json={"timeout_seconds": 8}, headers=h, timeout=60).json()["id"]
    httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "keep = 1"}, headers=h, timeout=60)
    result = {}

    def run():
        result["r"] = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "while True: pass"}, headers=h, timeout=60)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.7)
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/interrupt", headers=h, timeout=60)
    assert r.status_code == 200 and r.json() == {"interrupted": True}
    t.join(30)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["error"]["type"] == "KeyboardInterrupt"
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/exec", json={"code": "keep + 1"}, headers=h, timeout=60)
    assert r.json()["value"] == "2"
