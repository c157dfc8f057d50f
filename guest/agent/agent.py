"""forkbox guest agent: a Python REPL served over the VMM's agent channel.

Runs inside the sandbox as /opt/forkbox/agent.py. Requests and replies are
frames on fd 3: a 4-byte little-endian length, then that many bytes of JSON.
A read with no request pending parks the vCPU: that is where templates are
snapshotted and where every fork resumes.
"""

import ast
import builtins
import gc
import json
import linecache
import os
import random
import sys
import time
import traceback

CHANNEL = 3
MAX_FRAME = 64 << 20


def read_exact(n):
    chunks = []
    while n:
        b = os.read(CHANNEL, n)
        if not b:
            raise EOFError("agent channel closed")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def recv():
    n = int.from_bytes(read_exact(4), "little")
    if n > MAX_FRAME:
        raise ValueError("request frame too large")
    return json.loads(read_exact(n))


def send(obj):
    body = json.dumps(obj, ensure_ascii=False, default=repr).encode("utf-8", "surrogatepass")
    data = memoryview(len(body).to_bytes(4, "little") + body)
    while data:
        n = os.write(CHANNEL, data)
        data = data[n:]


namespace = {"__name__": "__main__", "__builtins__": builtins}
exec_count = 0


def short_repr(value, limit):
    r = repr(value)
    if limit and len(r) > limit:
        r = r[:limit] + "... [forkbox: value repr truncated, %d characters]" % len(r)
    return r


def run(code, value_limit):
    """Exec `code` in the session namespace; return the repr of a trailing expression."""
    global exec_count
    exec_count += 1
    filename = "<exec-%d>" % exec_count
    # Register the source so tracebacks can show the failing lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        ast.copy_location(last, last.body)
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), namespace)
    if value is None:
        return None
    namespace["_"] = value
    return short_repr(value, value_limit)


def describe(exc):
    """type, message and traceback of a user exception, without the agent's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(lines)}


def reseed():
    """A fork shares its template's memory, so every RNG that lives in guest
    memory starts from the same state: draw fresh seeds (os.urandom and
    getrandom come from the host, so they differ per fork)."""
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None


def handle(req):
    op = req.get("op")
    if req.get("reseed"):
        reseed()
    if op == "exec":
        start = time.perf_counter()
        value, error = None, None
        try:
            value = run(req["code"], req.get("value_limit", 1 << 20))
        except BaseException as e:  # noqa: BLE001 - everything the user code raises is a result
            error = describe(e)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        return {"value": value, "error": error, "runtime_ms": (time.perf_counter() - start) * 1000.0}
    if op == "ping":
        return {"pong": True}
    return {"protocol_error": "unknown op %r" % (op,)}


def main():
    preload = os.environ.get("FORKBOX_PRELOAD", "import numpy")
    info = {"ready": True, "python": sys.version.split()[0]}
    try:
        if preload:
            exec(compile(preload, "<preload>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001
        info = {"ready": False, "error": describe(e)}
    if "numpy" in sys.modules:
        info["numpy"] = sys.modules["numpy"].__version__
    # Everything allocated so far belongs to the template: keep the collector
    # from walking (and so writing to) those pages in every fork.
    gc.collect()
    gc.freeze()
    send(info)
    while True:
        try:
            req = recv()
        except (EOFError, ValueError) as e:
            send({"protocol_error": str(e)})
            continue
        send(handle(req))


if __name__ == "__main__":
    main()
