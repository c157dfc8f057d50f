# The client side of `forkbox bench e2b`: E2B's Python SDK (e2b-code-interpreter) and
# forkbox's own (sdk/python) against one `forkbox serve` on loopback, the same operation
# through both in turn, sample by sample. Prints one JSON list, in the order measured:
# [[op, {"e2b": [ms], "forkbox": [ms]}], ...]. argv: samples, forks per fork sample, template.
import json
import os
import sys
import time

samples, forks, template = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
url, key = os.environ["FORKBOX_BENCH_URL"], os.environ["FORKBOX_BENCH_KEY"]
for k in ("E2B_DOMAIN", "E2B_DEBUG"):
    os.environ.pop(k, None)
os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)

import e2b_code_interpreter as ci  # noqa: E402
import forkbox  # noqa: E402

out = {}
KB = os.urandom(1024)
BASH_TRUE = ["/bin/bash", "-l", "-c", "true"]


def ms(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1000.0


def record(op, side, v):
    out.setdefault(op, {"e2b": [], "forkbox": []})[side].append(v)


def check(ok, what):
    if not ok:
        raise SystemExit(f"bench e2b: unexpected answer from {what}")


with forkbox.Forkbox(url, key) as fb:
    # Warm both paths (connections, the template's first fork) before measuring.
    s = ci.Sandbox.create(template=template)
    s.run_code("1+1")
    s.kill()
    fs = fb.sessions.create(template=template)
    fs.exec("1+1")
    fs.delete()

    for _ in range(samples):
        # Time to interactive: create + the first run_code.
        box = {}

        def e2b_tti():
            box["s"] = ci.Sandbox.create(template=template)
            check(box["s"].run_code("1+1").text == "2", "run_code")

        record("create + first run_code", "e2b", ms(e2b_tti))
        box["s"].kill()

        def fb_tti():
            box["f"] = fb.sessions.create(template=template)
            check(box["f"].exec("1+1").value == "2", "exec")

        record("create + first run_code", "forkbox", ms(fb_tti))
        box["f"].delete()

    sbx = ci.Sandbox.create(template=template)
    ses = fb.sessions.create(template=template)
    try:
        for _ in range(samples):
            record("run_code('1+1'), warm", "e2b", ms(lambda: check(sbx.run_code("1+1").text == "2", "run_code")))
            record("run_code('1+1'), warm", "forkbox", ms(lambda: check(ses.exec("1+1").value == "2", "exec")))
            record("commands.run('true')", "e2b", ms(lambda: check(sbx.commands.run("true").exit_code == 0, "commands.run")))
            # E2B's SDK runs every command as `/bin/bash -l -c CMD`: the same argv through forkbox's.
            record("commands.run('true')", "forkbox", ms(lambda: check(ses.run_command(BASH_TRUE).exit_code == 0, "run_command")))

            def e2b_rw():
                sbx.files.write("/tmp/bench.bin", KB)
                check(bytes(sbx.files.read("/tmp/bench.bin", format="bytes")) == KB, "files.read")

            def fb_rw():
                ses.upload("/tmp/bench.bin", KB)
                check(ses.download("/tmp/bench.bin") == KB, "download")

            record("files.write + read, 1 KB", "e2b", ms(e2b_rw))
            record("files.write + read, 1 KB", "forkbox", ms(fb_rw))

        sbx.run_code("v = 7")
        ses.exec("v = 7")
        label = f"fork(count={forks})"
        for _ in range(max(1, samples // 5)):
            made = []
            record(label, "e2b", ms(lambda: made.extend(sbx.fork(count=forks))))
            check(len(made) == forks and all(isinstance(f, ci.Sandbox) for f in made), "fork")
            for f in made:
                f.kill()
            made = []
            record(label, "forkbox", ms(lambda: made.extend(ses.fork() for _ in range(forks))))
            check(len(made) == forks, "fork")
            for f in made:
                f.delete()
    finally:
        sbx.kill()
        ses.delete()

print(json.dumps(list(out.items())))
