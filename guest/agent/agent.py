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
import _signal
import time
import traceback

CHANNEL = 3
MAX_FRAME = 64 << 20
OUTPUT_DIR = "/output"
SIGINT = 2

# SIGINT (the host's interrupt) raises KeyboardInterrupt only while user code
# runs; one that lands in the agent's own code is kept for the exec it belongs
# to (the host delivers it only once the request has been read) and dropped
# when the next request is awaited, so the channel is never torn mid-frame.
user_running = False
interrupt_pending = False


def on_sigint(signum, frame):
    global interrupt_pending
    if user_running:
        raise KeyboardInterrupt
    interrupt_pending = True


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
    global interrupt_pending
    interrupt_pending = False
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
    global exec_count, user_running, interrupt_pending
    exec_count += 1
    filename = "<exec-%d>" % exec_count
    # Register the source so tracebacks can show the failing lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        ast.copy_location(last, last.body)
    user_running = True
    try:
        if interrupt_pending:
            interrupt_pending = False
            raise KeyboardInterrupt
        exec(compile(tree, filename, "exec"), namespace)
        if last is None:
            return None
        value = eval(compile(last, filename, "eval"), namespace)
    finally:
        user_running = False
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
    frames = traceback.extract_tb(tb)
    if isinstance(exc, KeyboardInterrupt) and frames and frames[-1].filename == __file__:
        # Raised by on_sigint: end the traceback where the user's code was interrupted.
        while frames and frames[-1].filename == __file__:
            frames.pop()
        lines = ["Traceback (most recent call last):\n"] if frames else []
        lines += traceback.StackSummary.from_list(frames).format()
        lines += traceback.format_exception_only(type(exc), exc)
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


def line_buffer():
    """Switch stdout/stderr to line buffering; returns what to restore."""
    saved = []
    for stream in (sys.stdout, sys.stderr):
        try:
            was = stream.line_buffering
            stream.reconfigure(line_buffering=True)
            saved.append((stream, was))
        except Exception:
            pass
    return saved


def handle(req):
    op = req.get("op")
    if req.get("reseed"):
        reseed()
    if op == "exec":
        start = time.perf_counter()
        value, error = None, None
        # A streamed exec line-buffers stdout/stderr so output leaves as it is
        # produced; the others keep block buffering (each write is a VM exit).
        buffering = line_buffer() if req.get("stream") else []
        try:
            value = run(req["code"], req.get("value_limit", 1 << 20))
        except BaseException as e:  # noqa: BLE001 - everything the user code raises is a result
            error = describe(e)
            # The host caps replies (and cuts these again): keep them under it.
            limit = req.get("value_limit", 1 << 20)
            for k in ("message", "traceback"):
                if len(error[k]) > limit:
                    error[k] = error[k][:limit] + "... [forkbox: truncated, %d characters]" % len(error[k])
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            for stream, was in buffering:
                try:
                    stream.reconfigure(line_buffering=was)
                except BaseException:
                    pass
            # Between execs SIGINT is the agent's (user code may have replaced it).
            # (_signal, not signal: its wrappers build enums, which costs every exec.)
            if _signal.getsignal(SIGINT) is not on_sigint:
                _signal.signal(SIGINT, on_sigint)
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
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    _signal.signal(SIGINT, on_sigint)
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
