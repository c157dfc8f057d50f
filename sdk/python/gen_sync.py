#!/usr/bin/env python3
"""Writes the blocking client `src/forkbox/_sync.py` from the asyncio one, `_async.py`.

The two clients have one API; only `async`/`await` and a few names differ, so the
blocking one is generated (with unasync's token rewriting, as httpcore does) rather
than kept by hand. Edit `_async.py`, then run this; `--check` exits 1 if `_sync.py`
is not what this would write (the test suite runs it).
"""
import argparse
import os
import sys
import tempfile

import unasync

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "src", "forkbox")

# Names unasync does not know: ours (its default turns `AsyncX` into `SyncX`), httpx's
# awaitable methods, and the sleep of the retry loops.
NAMES = {
    "AsyncForkbox": "Forkbox",
    "AsyncCommands": "Commands",
    "AsyncSessions": "Sessions",
    "AsyncKeys": "Keys",
    "AsyncSession": "Session",
    "AsyncClient": "Client",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "asyncio": "time",
}

DOCSTRING = (
    '"""The blocking client (httpx.Client). Generated from `_async.py` by `sdk/python/gen_sync.py`:'
    ' edit that file, not this one."""\n'
)


def generate() -> str:
    """The text `_sync.py` must have."""
    with tempfile.TemporaryDirectory() as tmp:
        src_dir, out_dir = os.path.join(tmp, "a"), os.path.join(tmp, "s")
        os.makedirs(src_dir)
        src = os.path.join(src_dir, "_async.py")
        with open(os.path.join(PACKAGE, "_async.py"), encoding="utf-8") as f:
            text = f.read()
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        unasync.unasync_files([src], [unasync.Rule(src_dir + "/", out_dir + "/", additional_replacements=NAMES)])
        with open(os.path.join(out_dir, "_async.py"), encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
    if not lines or not lines[0].startswith('"""'):
        sys.exit("gen_sync: _async.py must start with a one-line module docstring")
    return DOCSTRING + "".join(lines[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if _sync.py differs from what would be written")
    args = ap.parse_args()
    want = generate()
    path = os.path.join(PACKAGE, "_sync.py")
    with open(path, encoding="utf-8") as f:
        have = f.read()
    if args.check:
        if have != want:
            print("gen_sync: src/forkbox/_sync.py is out of date; run sdk/python/gen_sync.py", file=sys.stderr)
            return 1
        return 0
    if have != want:
        with open(path, "w", encoding="utf-8") as f:
            f.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
