//! Processes in the guest: os.fork + waitpid, subprocess of the image's
//! programs and shell, execve, pipes shared with children, signals between
//! processes, the process limit (a fork bomb), the end-of-exec rule, the
//! deadline over the tree, and sessions whose execs ran children.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::{Duration, Instant};

use forkbox_engine::{EngineError, Limits};
use forkbox_testkit::guest::{fork, fork_with, json, limits, ok, value};

/// The engine and template of this test binary: `forkbox_testkit` checks KVM (loudly) and builds both once.
fn shared() -> &'static forkbox_testkit::Shared {
    forkbox_testkit::shared()
}

// ---------------------------------------------------------------------------
// fork, wait, exit statuses, signals
// ---------------------------------------------------------------------------

#[test]
fn fork_waitpid_exit_codes_and_ids() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json
res = []
for code in (0, 3, 77):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps([os.getpid(), os.getppid(), os.getpgrp(), int(os.readlink("/proc/self"))]).encode())
        os._exit(code)
    os.close(w)
    got = json.loads(os.read(r, 1000))
    os.close(r)
    wpid, st = os.waitpid(pid, 0)
    res.append({"pid": pid, "wpid": wpid, "child": got, "exited": os.WIFEXITED(st), "code": os.WEXITSTATUS(st)})
try:
    os.waitpid(-1, 0)
    echild = False
except ChildProcessError:
    echild = True
json.dumps({"res": res, "me": os.getpid(), "echild": echild})
"#,
    );
    let me = v["me"].as_u64().unwrap();
    for (r, code) in v["res"].as_array().unwrap().iter().zip([0, 3, 77]) {
        let pid = r["pid"].as_u64().unwrap();
        assert_ne!(pid, me);
        assert_eq!(r["wpid"], pid);
        assert_eq!(r["child"][0], pid, "getpid in the child: {v}");
        assert_eq!(r["child"][1], me, "getppid in the child: {v}");
        assert_eq!(r["child"][3], pid, "/proc/self in the child: {v}");
        assert_eq!(r["exited"], true);
        assert_eq!(r["code"], code);
    }
    assert_eq!(v["echild"], true, "{v}");
    // The sandbox goes on as before.
    assert_eq!(value(&mut sb, "1+1"), "2");
}

#[test]
fn child_memory_is_a_copy_and_wnohang() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, time
data = bytearray(b"x" * 3_000_000)
pid = os.fork()
if pid == 0:
    data[0:5] = b"child"
    time.sleep(0.05)
    os._exit(0 if bytes(data[0:5]) == b"child" else 1)
early = os.waitpid(pid, os.WNOHANG)
data[0:6] = b"parent"
_, st = os.waitpid(pid, 0)
json.dumps({"early": early, "code": os.waitstatus_to_exitcode(st), "mine": bytes(data[0:6]).decode()})
"#,
    );
    assert_eq!(v["early"], serde_json::json!([0, 0]), "WNOHANG while it runs: {v}");
    assert_eq!(v["code"], 0, "the child saw its own write: {v}");
    assert_eq!(v["mine"], "parent");
}

#[test]
fn a_child_killed_by_a_signal_and_sigchld() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, signal, time
got = []
signal.signal(signal.SIGCHLD, lambda s, f: got.append(s))
pid = os.fork()
if pid == 0:
    while True:
        time.sleep(0.01)
time.sleep(0.05)
os.kill(pid, signal.SIGTERM)
_, st = os.waitpid(pid, 0)
pid2 = os.fork()
if pid2 == 0:
    os.kill(os.getpid(), signal.SIGKILL)
_, st2 = os.waitpid(pid2, 0)
json.dumps({"sig": os.WIFSIGNALED(st) and os.WTERMSIG(st), "sig2": os.WTERMSIG(st2), "chld": len(got) > 0})
"#,
    );
    assert_eq!(v["sig"], 15, "{v}");
    assert_eq!(v["sig2"], 9, "{v}");
    assert_eq!(v["chld"], true, "SIGCHLD reached the parent: {v}");
}

#[test]
fn children_share_a_pipe_and_stdout_is_captured() {
    let mut sb = fork();
    let r = ok(
        &mut sb,
        r#"
import os, sys
r, w = os.pipe()
pids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, b"child%d;" % i)
        print("hello from child", i, flush=True)
        os._exit(0)
    pids.append(pid)
os.close(w)
chunks = b""
while True:
    b = os.read(r, 100)
    if not b:
        break
    chunks += b
for p in pids:
    os.waitpid(p, 0)
print("parent got", sorted(chunks.decode().split(";")))
"#,
    );
    for i in 0..3 {
        assert!(r.stdout.contains(&format!("hello from child {i}")), "child stdout captured: {}", r.stdout);
    }
    assert!(r.stdout.contains("parent got ['', 'child0', 'child1', 'child2']"), "{}", r.stdout);
}

#[test]
fn a_fork_bomb_is_bounded_and_the_sandbox_survives() {
    let mut sb = fork_with(limits(120));
    let v = json(
        &mut sb,
        r#"
import os, json, errno
pids, err = [], None
for i in range(200):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        os.read(os.open("/dev/null", os.O_RDONLY), 1)  # returns at once
        import time
        time.sleep(30)
        os._exit(0)
    pids.append(pid)
n = len(pids)
for p in pids:
    os.kill(p, 9)
codes = set()
for p in pids:
    codes.add(os.WTERMSIG(os.waitpid(p, 0)[1]))
json.dumps({"n": n, "err": err, "codes": sorted(codes)})
"#,
    );
    let n = v["n"].as_u64().unwrap();
    assert!((8..=127).contains(&n), "forks before the limit: {v}");
    let err = v["err"].as_i64().unwrap();
    assert!(err == libc::EAGAIN as i64 || err == libc::ENOMEM as i64, "a clean EAGAIN/ENOMEM: {v}");
    assert_eq!(v["codes"], serde_json::json!([9]));
    // Usable after, and forks again.
    assert_eq!(
        value(
            &mut sb,
            "import os\np = os.fork()\nif p == 0: os._exit(5)\nos.waitstatus_to_exitcode(os.waitpid(p, 0)[1])"
        ),
        "5"
    );
}

#[test]
fn an_exec_ending_with_a_running_child_kills_it_with_a_note() {
    let mut sb = fork();
    let r = ok(&mut sb, "import os, time\npid = os.fork()\nif pid == 0:\n    while True: time.sleep(0.01)\npid > 0");
    assert_eq!(r.value.as_deref(), Some("True"));
    assert!(r.stderr.contains("1 child process still running at the end of the exec was killed"), "{}", r.stderr);
    // The child is gone: no such process, no child to wait for.
    let v = json(&mut sb, "import json\ntry:\n    os.kill(pid, 0); alive = True\nexcept ProcessLookupError:\n    alive = False\ntry:\n    os.waitpid(-1, os.WNOHANG); ech = False\nexcept ChildProcessError:\n    ech = True\njson.dumps([alive, ech])");
    assert_eq!(v, serde_json::json!([false, true]));
}

#[test]
fn the_deadline_stops_a_looping_child() {
    let mut sb = fork_with(limits(3));
    let t0 = Instant::now();
    let e = sb.exec("import os\npid = os.fork()\nif pid == 0:\n    while True: pass\nos.waitpid(pid, 0)").unwrap_err();
    assert!(matches!(e, EngineError::Timeout(_)), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn a_forked_child_cannot_talk_on_the_agent_channel() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json
pid = os.fork()
if pid == 0:
    try:
        os.write(3, b"\x00\x00\x00\x10{\"value\":\"evil\"}")
        os._exit(1)
    except OSError as e:
        os._exit(2 if e.errno == 9 else 3)
json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"#,
    );
    assert_eq!(v, 2, "EBADF on the agent fd in the child");
}

// ---------------------------------------------------------------------------
// execve, subprocess, the shell
// ---------------------------------------------------------------------------

#[test]
fn subprocess_runs_the_images_programs() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import subprocess, shutil, json, sys
a = subprocess.run(["ls", "/"], capture_output=True, text=True)
b = subprocess.run("ls -la / | wc -l > /tmp/n.txt; cat /tmp/n.txt; echo err >&2; exit 4", shell=True, capture_output=True, text=True)
c = subprocess.run([sys.executable, "-c", "import sys; print(*sys.argv[1:], 6*7)", "x"], capture_output=True, text=True)
d = subprocess.run(["sh", "-c", "printf 'b\\na\\nc\\n' | sort | head -n 2 | tr a-z A-Z"], capture_output=True, text=True)
e = subprocess.run(["grep", "-c", "root", "/etc/passwd"], capture_output=True, text=True)
try:
    subprocess.run(["/no/such/program"])
    missing = None
except FileNotFoundError as x:
    missing = x.errno
json.dumps({"which": shutil.which("ls"), "a": [a.returncode, a.stdout.split()],
            "b": [b.returncode, b.stdout.strip(), b.stderr.strip()],
            "c": [c.returncode, c.stdout.strip()], "d": d.stdout.split(), "e": e.stdout.strip(), "missing": missing})
"#,
    );
    assert_eq!(v["which"], "/usr/bin/ls", "{v}");
    assert_eq!(v["a"][0], 0, "{v}");
    for d in ["bin", "etc", "usr", "tmp"] {
        assert!(v["a"][1].as_array().unwrap().iter().any(|x| x == d), "ls / lists {d}: {v}");
    }
    assert_eq!(v["b"][0], 4, "{v}");
    let n: u64 = v["b"][1].as_str().unwrap().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!(n > 10, "{v}");
    assert_eq!(v["b"][2], "err");
    assert_eq!(v["c"], serde_json::json!([0, "x 42"]), "{v}");
    assert_eq!(v["d"], serde_json::json!(["A", "B"]), "{v}");
    assert_eq!(v["e"], "1");
    assert_eq!(v["missing"], 2);
}

#[test]
fn dev_fd_links_open_what_the_fd_refers_to() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import json, os, subprocess
out = {}
# bash's process substitution hands paste /dev/fd/63 and /dev/fd/62, the read ends of pipes.
p = subprocess.run(["bash", "-c", "paste -d, <(printf '1\\n2\\n') <(printf 'a\\nb\\n')"], capture_output=True, text=True)
out["procsub"] = [p.returncode, p.stdout.split("\n"), p.stderr]
r, w = os.pipe()
os.write(w, b"through the link")
os.close(w)
fd = os.open("/dev/fd/%d" % r, os.O_RDONLY)
out["pipe"] = os.read(fd, 100).decode()
os.close(fd)
os.close(r)
with open("/tmp/f", "w") as f:
    f.write("file body")
fd = os.open("/tmp/f", os.O_RDONLY)
os.lseek(fd, 5, 0)
again = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY)
out["file"] = os.read(again, 100).decode()
out["pos"] = os.lseek(fd, 0, 1)
os.close(again)
again = os.open("/proc/%d/fd/%d" % (os.getpid(), fd), os.O_WRONLY | os.O_TRUNC)
out["truncated"] = os.path.getsize("/tmp/f")
os.close(again)
os.close(fd)
errs = []
for path in ("/dev/fd/999", "/dev/fd/1x", "/proc/1/fd/0" if os.getpid() != 1 else "/proc/2/fd/0"):
    try:
        os.close(os.open(path, os.O_RDONLY))
        errs.append(None)
    except OSError as e:
        errs.append(e.errno)
out["errs"] = errs
json.dumps(out)
"#,
    );
    assert_eq!(v["procsub"], serde_json::json!([0, ["1,a", "2,b", ""], ""]), "{v}");
    assert_eq!(v["pipe"], "through the link", "{v}");
    // A new description: its own offset, the first one's unmoved.
    assert_eq!(v["file"], "file body", "{v}");
    assert_eq!(v["pos"], 5, "{v}");
    assert_eq!(v["truncated"], 0, "{v}");
    // No such fd, not an fd number, another process's fd: not magic, so ENOENT.
    assert_eq!(v["errs"], serde_json::json!([2, 2, 2]), "{v}");
}

#[test]
fn os_system_popen_and_scripts() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r##"
import os, json, stat
with open("/tmp/s.sh", "w") as f:
    f.write("#!/bin/sh\necho script $1 $$\nexit 3\n")
os.chmod("/tmp/s.sh", 0o755)
st = os.system("/tmp/s.sh arg > /tmp/out.txt")
out = open("/tmp/out.txt").read().split()
p = os.popen("echo popen; pwd")
txt = p.read()
rc = p.close()
os.chdir("/tmp")
cwd = os.popen("pwd").read().strip()
json.dumps({"st": os.waitstatus_to_exitcode(st), "out": out[:2], "popen": txt.split(), "rc": rc, "cwd": cwd})
"##,
    );
    assert_eq!(v["st"], 3, "{v}");
    assert_eq!(v["out"], serde_json::json!(["script", "arg"]), "{v}");
    assert_eq!(v["popen"], serde_json::json!(["popen", "/"]), "{v}");
    assert_eq!(v["rc"], serde_json::Value::Null);
    assert_eq!(v["cwd"], "/tmp", "the cwd is inherited: {v}");
}

#[test]
fn close_on_exec_and_inherited_fds() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, subprocess
r, w = os.pipe()
os.set_inheritable(w, True)
keep = os.open("/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd", os.O_RDONLY)
os.set_inheritable(keep, False)
p = subprocess.run(["sh", "-c", f"echo via-inherited >&{w}; ls /proc/self/fd >/dev/null; test -e /dev/fd/{keep} && echo leaked || echo closed"], pass_fds=(w,), capture_output=True, text=True)
os.close(w)
got = os.read(r, 100).decode().strip()
json.dumps({"got": got, "cloexec": p.stdout.strip(), "rc": p.returncode})
"#,
    );
    assert_eq!(v["got"], "via-inherited", "{v}");
    assert_eq!(v["cloexec"], "closed", "{v}");
}

// ---------------------------------------------------------------------------
// Sessions: checkpoint / evict / resume / fork after children
// ---------------------------------------------------------------------------

#[test]
fn a_session_that_ran_subprocesses_checkpoints_resumes_and_forks() {
    let s = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut sb = s.template.fork_tracked(&s.engine, limits(60)).unwrap_or_else(|e| panic!("fork_tracked: {e}"));
    let r = ok(&mut sb, "import subprocess, os\nout = subprocess.run(['sh', '-c', 'echo hi > /tmp/f; cat /tmp/f'], capture_output=True, text=True).stdout\np = os.fork()\nif p == 0: os._exit(9)\ncode = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])\n(out, code)");
    assert_eq!(r.value.as_deref(), Some("('hi\\n', 9)"));
    let layer = dir.path().join("layer");
    let state = dir.path().join("state");
    s.template
        .checkpoint(&s.engine, &mut sb, &layer, &state, |_| Ok::<(), EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    drop(sb);
    let layers = vec![forkbox_snapshot::layer::Layer::read(&layer).unwrap_or_else(|e| panic!("layer: {e}"))];
    let mut a =
        s.template.resume(&s.engine, &layers, &state, limits(60), false).unwrap_or_else(|e| panic!("resume: {e}"));
    let mut b = s.template.resume(&s.engine, &layers, &state, limits(60), true).unwrap_or_else(|e| panic!("fork: {e}"));
    for sbx in [&mut a, &mut b] {
        assert_eq!(value(sbx, "out, code"), "('hi\\n', 9)");
        assert_eq!(
            value(
                sbx,
                "subprocess.run('cat /tmp/f; echo $((6*7))', shell=True, capture_output=True, text=True).stdout"
            ),
            "'hi\\n42\\n'"
        );
    }
}

// ---------------------------------------------------------------------------
// Memory shared between processes, futexes across them, multiprocessing
// ---------------------------------------------------------------------------

#[test]
fn shared_memory_written_by_a_child_is_seen_by_the_parent() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, mmap, json, tempfile
out = {}
# MAP_SHARED|MAP_ANONYMOUS inherited over fork
anon = mmap.mmap(-1, 3 * 4096)
anon[0:5] = b"start"
pid = os.fork()
if pid == 0:
    anon[0:5] = b"child"
    anon[3 * 4096 - 3:] = b"end"
    os._exit(0)
os.waitpid(pid, 0)
out["anon"] = [anon[0:5].decode(), anon[3 * 4096 - 3:].decode()]
anon.madvise(mmap.MADV_DONTNEED)
out["dontneed"] = anon[0:5].decode()
# a /dev/shm file mapped in both (the parent maps it after the fork: the object is the file's)
fd = os.open("/dev/shm/fbx-test", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 8192)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    m = mmap.mmap(fd, 8192)
    m[4096:4100] = b"shm!"
    os.write(w, b"x")
    os.read(r, 1) if False else None
    os._exit(0)
os.read(r, 1)
m = mmap.mmap(fd, 8192)
out["shm_live"] = m[4096:4100].decode()
os.waitpid(pid, 0)
out["file"] = os.pread(fd, 4, 4096).decode()
# a memfd, mapped before the fork; the child writes after the parent read once
mfd = os.memfd_create("x")
os.ftruncate(mfd, 4096)
mm = mmap.mmap(mfd, 4096)
pid = os.fork()
if pid == 0:
    mm[0:2] = b"mf"
    os._exit(0)
os.waitpid(pid, 0)
out["memfd"] = mm[0:2].decode()
# a private mapping stays private
priv = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
pid = os.fork()
if pid == 0:
    priv[0:4] = b"gone"
    os._exit(0)
os.waitpid(pid, 0)
out["private"] = priv[0:4].hex()
json.dumps(out)
"#,
    );
    assert_eq!(v["anon"], serde_json::json!(["child", "end"]), "{v}");
    assert_eq!(v["dontneed"], "child", "MADV_DONTNEED keeps shared memory's content: {v}");
    assert_eq!(v["shm_live"], "shm!", "{v}");
    assert_eq!(v["file"], "shm!", "written back to the file at the child's end: {v}");
    assert_eq!(v["memfd"], "mf", "{v}");
    assert_eq!(v["private"], "00000000", "{v}");
}

#[test]
fn multiprocessing_pool_and_process_pool_executor_return_real_results() {
    let mut sb = fork_with(limits(60));
    let v = json(
        &mut sb,
        r#"
import json, multiprocessing, concurrent.futures as cf
def f(x):
    return x * x + 1
items = list(range(20))
out = {"serial": [f(x) for x in items]}
with multiprocessing.Pool(2) as p:
    out["pool"] = p.map(f, items)
    out["pool_async"] = p.apply_async(f, (7,)).get(timeout=30)
with cf.ProcessPoolExecutor(2) as ex:
    out["ppe"] = list(ex.map(f, items))
    out["ppe_submit"] = ex.submit(f, 9).result(timeout=30)
json.dumps(out)
"#,
    );
    assert_eq!(v["pool"], v["serial"], "{v}");
    assert_eq!(v["ppe"], v["serial"], "{v}");
    assert_eq!(v["pool_async"], 50, "{v}");
    assert_eq!(v["ppe_submit"], 82, "{v}");
    // Again in the same session (the children of the first exec are gone; new ones share again).
    assert_eq!(value(&mut sb, "with multiprocessing.Pool(2) as p: r = p.map(f, range(5))\nr"), "[1, 2, 5, 10, 17]");
}

#[test]
fn multiprocessing_queue_value_array_and_lock_between_processes() {
    let mut sb = fork_with(limits(60));
    let v = json(
        &mut sb,
        r#"
import json, multiprocessing as mp
def producer(q, n):
    for i in range(n):
        q.put(("item", i, "x" * (i * 100)))
    q.put(None)
def bump(v, arr, lock, n):
    for _ in range(n):
        with lock:
            v.value += 1
    with lock:
        arr[0] += 1
out = {}
q = mp.Queue()
p = mp.Process(target=producer, args=(q, 50))
p.start()
got = []
while (x := q.get(timeout=30)) is not None:
    got.append(x[1])
p.join(30)
out["queue"] = got == list(range(50))
out["exitcode"] = p.exitcode
v = mp.Value("i", 0, lock=False)
arr = mp.Array("i", 4, lock=False)
lock = mp.Lock()
ps = [mp.Process(target=bump, args=(v, arr, lock, 200)) for _ in range(4)]
for p in ps: p.start()
for p in ps: p.join(60)
out["value"] = v.value
out["array"] = arr[0]
out["exitcodes"] = [p.exitcode for p in ps]
# a Lock held by a child: the parent's acquire with a timeout times out, then gets it once the child lets go
ev = mp.Event()
def hold(lock, ev):
    with lock:
        ev.set()
        import time; time.sleep(0.3)
p = mp.Process(target=hold, args=(lock, ev)); p.start()
ev.wait(30)
out["busy"] = lock.acquire(timeout=0.05)
out["later"] = lock.acquire(timeout=30)
lock.release()
p.join(30)
json.dumps(out)
"#,
    );
    assert_eq!(v["queue"], true, "{v}");
    assert_eq!(v["exitcode"], 0, "{v}");
    assert_eq!(v["value"], 800, "4 processes x 200 increments under one Lock: {v}");
    assert_eq!(v["array"], 4, "{v}");
    assert_eq!(v["exitcodes"], serde_json::json!([0, 0, 0, 0]), "{v}");
    assert_eq!(v["busy"], false, "the child holds the lock: {v}");
    assert_eq!(v["later"], true, "{v}");
}

#[test]
fn a_pool_never_closed_does_not_hang_the_exec() {
    let mut sb = fork_with(limits(20));
    let t0 = Instant::now();
    let r = ok(&mut sb, "import multiprocessing\np = multiprocessing.Pool(2)\np.map(abs, [-1, -2, -3])");
    assert_eq!(r.value.as_deref(), Some("[1, 2, 3]"));
    assert!(t0.elapsed() < Duration::from_secs(15), "took {:?}", t0.elapsed());
    assert!(r.stderr.contains("killed"), "the pool's workers are killed at the end of the exec: {}", r.stderr);
    // The session goes on; the old pool object is unusable but a new one works.
    assert_eq!(value(&mut sb, "with multiprocessing.Pool(2) as q: r = q.map(abs, [-4])\nr"), "[4]");
}

#[test]
fn other_start_methods_work() {
    let mut sb = fork_with(limits(60));
    let v = json(
        &mut sb,
        r#"
import json, multiprocessing as mp, concurrent.futures as cf
out = {}
for method in ("forkserver", "spawn"):
    try:
        with mp.get_context(method).Pool(2) as p:
            out[method] = p.map(abs, [-1, -2, -3])
    except Exception as e:
        out[method] = type(e).__name__ + ": " + str(e)
ctx = mp.get_context("forkserver")
p = ctx.Process(target=abs, args=(-1,))
p.start(); p.join(30)
out["fs_exitcode"] = p.exitcode
with cf.ProcessPoolExecutor(2, mp_context=ctx) as ex:
    out["fs_executor"] = list(ex.map(abs, [-4, -5]))
json.dumps(out)
"#,
    );
    // spawn: a fresh `python3 -c` per worker (fork + exec), over pipes and semaphores.
    assert_eq!(v["spawn"], serde_json::json!([1, 2, 3]), "{v}");
    // forkserver: the server gets each request's fds over an AF_UNIX socket (SCM_RIGHTS).
    assert_eq!(v["forkserver"], serde_json::json!([1, 2, 3]), "{v}");
    assert_eq!(v["fs_exitcode"], 0, "{v}");
    assert_eq!(v["fs_executor"], serde_json::json!([4, 5]), "{v}");
}

#[test]
fn fds_pass_between_processes_with_scm_rights() {
    let mut sb = fork_with(limits(60));
    let v = json(
        &mut sb,
        r#"
import os, socket, json, array
out = {}
# a pipe's write end goes from a child to the parent over a socketpair (stream)
a, b = socket.socketpair()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    a.close()
    cr, cw = os.pipe()
    socket.send_fds(b, [b"P"], [cw])
    os.close(cw)
    out_child = os.read(cr, 100)
    b.sendall(out_child)
    os._exit(0)
b.close()
msg, fds, flags, _ = socket.recv_fds(a, 10, 4)
out["stream"] = [msg.decode(), len(fds), flags]
os.write(fds[0], b"through the passed fd")
os.close(fds[0])
out["child_read"] = a.recv(100).decode()
os.waitpid(pid, 0)
# datagrams: each message keeps its own fds; peek does not consume them
c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(c, [b"one"], [r])
socket.send_fds(c, [b"two"], [w, w])
c.send(b"three")
m1 = d.recvmsg(10, socket.CMSG_SPACE(16), socket.MSG_PEEK)
m1b = socket.recv_fds(d, 10, 4)
m2 = socket.recv_fds(d, 10, 4)
m3 = socket.recv_fds(d, 10, 4)
out["dgram"] = [[m1[0].decode(), len(m1[1])], [m1b[0].decode(), len(m1b[1])], [m2[0].decode(), len(m2[1])], [m3[0].decode(), len(m3[1])]]
os.write(m2[1][0], b"dg")
out["dgram_pipe"] = os.read(m1b[1][0], 2).decode()
# a control buffer too small for all fds: MSG_CTRUNC, the rest are closed
socket.send_fds(c, [b"x"], [w, w, w])
msg, anc, flags, _ = d.recvmsg(10, socket.CMSG_LEN(4))
out["ctrunc"] = [bool(flags & socket.MSG_CTRUNC), sum(len(x[2]) // 4 for x in anc)]
# a plain recv drops the fds that came with the data
socket.send_fds(c, [b"y"], [w])
out["plain_recv"] = d.recv(10).decode()
# bad fds, and a stream read stops before data that brings fds
e, f = socket.socketpair()
try:
    socket.send_fds(e, [b"z"], [999])
except OSError as ex:
    out["ebadf"] = ex.errno
e.send(b"ab")
socket.send_fds(e, [b"cd"], [r])
first = socket.recv_fds(f, 10, 4)
second = socket.recv_fds(f, 10, 4)
out["boundary"] = [first[0].decode(), len(first[1]), second[0].decode(), len(second[1])]
json.dumps(out)
"#,
    );
    assert_eq!(v["stream"], serde_json::json!(["P", 1, 0]), "{v}");
    assert_eq!(v["child_read"], "through the passed fd", "{v}");
    assert_eq!(v["dgram"], serde_json::json!([["one", 1], ["one", 1], ["two", 2], ["three", 0]]), "{v}");
    assert_eq!(v["dgram_pipe"], "dg", "{v}");
    assert_eq!(v["ctrunc"], serde_json::json!([true, 1]), "{v}");
    assert_eq!(v["plain_recv"], "y", "{v}");
    assert_eq!(v["ebadf"], libc::EBADF, "{v}");
    assert_eq!(v["boundary"], serde_json::json!(["ab", 0, "cd", 1]), "{v}");
}

#[test]
fn fds_in_flight_are_closed_with_their_socket_and_bounded() {
    let mut sb = fork_with(limits(60));
    let v = json(
        &mut sb,
        r#"
import os, socket, json
out = {}
# the only write end of a pipe is in flight when both sockets close: the reader sees EOF
r, w = os.pipe()
a, b = socket.socketpair()
socket.send_fds(a, [b"w"], [w])
os.close(w)
a.close(); b.close()
out["eof"] = os.read(r, 10).decode()
# a listener closed with a connection (and its fds) never accepted
r2, w2 = os.pipe()
srv = socket.socket(socket.AF_UNIX)
srv.bind("\0fbx-scm"); srv.listen()
cli = socket.socket(socket.AF_UNIX); cli.connect("\0fbx-scm")
socket.send_fds(cli, [b"w"], [w2])
os.close(w2)
srv.close(); cli.close()
out["eof_pending"] = os.read(r2, 10).decode()
# fds in flight are capped for the sandbox (sockets holding each other could never be freed)
c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
c.setblocking(False)
n = 0
try:
    for i in range(2000):
        socket.send_fds(c, [b"."], [r] * 4)
        n += 1
except OSError as e:
    out["cap"] = [n, e.errno]
c.close(); d.close()
# ... and given back when the socket goes: sending works again
e, f = socket.socketpair()
socket.send_fds(e, [b"k"], [r])
out["after"] = len(socket.recv_fds(f, 10, 1)[1])
json.dumps(out)
"#,
    );
    assert_eq!(v["eof"], "", "the in-flight write end was closed with the sockets: {v}");
    assert_eq!(v["eof_pending"], "", "{v}");
    assert_eq!(v["cap"], serde_json::json!([256, libc::ETOOMANYREFS]), "1024 fds in flight, 4 a message: {v}");
    assert_eq!(v["after"], 1, "{v}");
}

#[test]
fn a_session_with_fds_in_flight_checkpoints_and_resumes() {
    let s = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut sb = s.template.fork_tracked(&s.engine, limits(60)).unwrap_or_else(|e| panic!("fork_tracked: {e}"));
    let code = "import os, socket
r, w = os.pipe()
a, b = socket.socketpair()
socket.send_fds(a, [b'x'], [w])
os.close(w)
'sent'";
    assert_eq!(value(&mut sb, code), "'sent'");
    let layer = dir.path().join("layer");
    let state = dir.path().join("state");
    s.template
        .checkpoint(&s.engine, &mut sb, &layer, &state, |_| Ok::<(), EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    // The live sandbox still has them in flight.
    assert_eq!(
        value(
            &mut sb,
            "fds = socket.recv_fds(b, 10, 1)[1]
os.write(fds[0], b'live')
os.read(r, 4)"
        ),
        "b'live'"
    );
    drop(sb);
    let layers = vec![forkbox_snapshot::layer::Layer::read(&layer).unwrap_or_else(|e| panic!("layer: {e}"))];
    let mut a =
        s.template.resume(&s.engine, &layers, &state, limits(60), false).unwrap_or_else(|e| panic!("resume: {e}"));
    // A state file cannot hold fds in flight: they were dropped (closed) in it, so the data
    // arrives without them and the pipe, whose only write end that was, reads EOF.
    assert_eq!(
        value(
            &mut a,
            "msg, fds, _, _ = socket.recv_fds(b, 10, 1)
(msg, fds, os.read(r, 4))"
        ),
        "(b'x', [], b'')"
    );
}

#[test]
fn the_memory_limit_bounds_shared_memory() {
    let mut sb = fork_with(Limits { memory_bytes: 256 << 20, ..limits(30) });
    let v = json(
        &mut sb,
        r#"
import mmap, os, json
out = {}
try:
    m = mmap.mmap(-1, 512 << 20)
    out["big"] = "mapped"
except OSError as e:
    out["big"] = e.errno
# shared maps count in every process that maps them: 2 x 100 MiB + the template does not fit
m = mmap.mmap(-1, 100 << 20)
m[-1:] = b"x"
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out["fork"] = "forked"
except OSError as e:
    out["fork"] = e.errno
objs = []
try:
    for i in range(1000):
        objs.append(mmap.mmap(-1, 4096))
except OSError as e:
    out["many"] = [len(objs), e.errno]
json.dumps(out)
"#,
    );
    assert_eq!(v["big"], libc::ENOMEM, "{v}");
    assert_eq!(v["fork"], libc::ENOMEM, "{v}");
    let n = v["many"][0].as_u64().unwrap_or(0);
    assert!((100..=256).contains(&n), "shared objects are capped: {v}");
}

#[test]
fn the_memory_limit_counts_what_each_process_holds() {
    // 256 MiB for the tree; the template maps ~60 MiB. Children that only read what
    // they inherited hold a few MiB each (the parent's written pages they got a copy
    // of): 20 of them fit, as on Linux (counting each child's mappings in full let 3).
    let mut sb = fork_with(Limits { memory_bytes: 256 << 20, ..limits(60) });
    let v = json(
        &mut sb,
        r#"
import os, json
pids, err = [], None
for i in range(20):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        os.read(os.pipe()[0], 1)
    pids.append(pid)
n = len(pids)
for p in pids:
    os.kill(p, 9)
    os.waitpid(p, 0)
json.dumps({"n": n, "err": err})
"#,
    );
    assert_eq!(v["n"], 20, "{v}");
    assert_eq!(v["err"], serde_json::Value::Null, "{v}");
}

#[test]
fn children_writing_inherited_memory_past_the_limit_are_killed() {
    // The bound stays real: a 60 MiB mapping the parent never touched costs a child
    // little at fork, but a child that writes all of it holds 60 MiB more. In 256 MiB
    // beside the parent at most four such children can hold it; the others are killed
    // (SIGKILL) once what the tree holds is over the limit, as Linux's OOM killer
    // would (or their fork is refused). The parent (the agent's process) lives and
    // can still fork.
    let mut sb = fork_with(Limits { memory_bytes: 256 << 20, ..limits(90) });
    let v = json(
        &mut sb,
        r#"
import os, json, mmap, time
m = mmap.mmap(-1, 60 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
r, w = os.pipe()
pids, err = [], None
for i in range(6):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        os.close(r)
        for off in range(0, len(m), 4096):
            m[off] = 1
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
os.close(w)
os.set_blocking(r, False)
finished, ended = 0, {}
deadline = time.time() + 60
while finished + len(ended) < len(pids) and time.time() < deadline:
    try:
        finished += len(os.read(r, 16))
    except BlockingIOError:
        pass
    for p in pids:
        if p not in ended:
            q, st = os.waitpid(p, os.WNOHANG)
            if q:
                ended[p] = os.WTERMSIG(st) if os.WIFSIGNALED(st) else -1
    time.sleep(0.05)
for p in pids:
    if p not in ended:
        os.kill(p, 15)
        ended[p] = os.WTERMSIG(os.waitpid(p, 0)[1])
p = os.fork()
if p == 0:
    os._exit(3)
after = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
json.dumps({"forked": len(pids), "err": err, "finished": finished, "sigs": sorted(ended.values()), "after": after})
"#,
    );
    let forked = v["forked"].as_u64().unwrap();
    let finished = v["finished"].as_u64().unwrap();
    let killed = v["sigs"].as_array().unwrap().iter().filter(|s| s.as_i64() == Some(9)).count() as u64;
    assert!(forked >= 2, "{v}");
    assert!(finished <= 4, "no more children hold their 60 MiB than the limit has room for: {v}");
    assert_eq!(finished + killed, forked, "each child wrote its memory or was killed: {v}");
    assert!(killed >= 1 || v["err"] == libc::ENOMEM, "the limit held: {v}");
    assert_eq!(v["after"], 3, "{v}");
}

#[test]
fn threads_reserved_arenas_do_not_count_in_every_fork() {
    // glibc reserves a 64 MiB PROT_NONE arena per thread: counted, 4 threads made a
    // process ~350 MiB, so one fork filled 768 MiB (a multiprocessing manager test
    // with 3 threads and 3 children failed with ENOMEM). Only accessible memory counts.
    let mut sb = fork_with(Limits { memory_bytes: 768 << 20, ..limits(60) });
    let v = json(
        &mut sb,
        r#"
import os, json, threading
ev = threading.Event()
ts = [threading.Thread(target=ev.wait) for _ in range(4)]
for t in ts: t.start()
pids, err = [], None
for i in range(3):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        os._exit(7)
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
ev.set()
for t in ts: t.join()
json.dumps({"forks": len(pids), "err": err, "codes": codes})
"#,
    );
    assert_eq!(v["forks"], 3, "{v}");
    assert_eq!(v["err"], serde_json::Value::Null, "{v}");
    assert_eq!(v["codes"], serde_json::json!([7, 7, 7]), "{v}");
}

#[test]
fn a_cpu_bound_thread_does_not_starve_its_process_siblings_with_children() {
    // With another process running, every slice end rotated processes and the
    // parent came back to the same (spinning) thread: its other threads (an
    // mp.Queue feeder, the GIL handoff) never ran and the exec hung
    // (test_concurrent_futures' test_hang_global_shutdown_lock).
    let mut sb = fork_with(limits(60));
    let t0 = Instant::now();
    let v = json(
        &mut sb,
        r#"
import json, threading, multiprocessing as mp
from concurrent import futures
stop = False
def spin():
    while not stop:
        pass
t = threading.Thread(target=spin, daemon=True)
t.start()
out = {}
q, rq = mp.Queue(), mp.SimpleQueue()
def child(q, rq):
    rq.put(q.get())
p = mp.Process(target=child, args=(q, rq))
p.start()
q.put(7)
out["queue"] = rq.get()
p.join(30)
with futures.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as ex:
    out["ppe"] = ex.submit(abs, -3).result(timeout=30)
stop = True
t.join()
json.dumps(out)
"#,
    );
    assert_eq!(v["queue"], 7, "{v}");
    assert_eq!(v["ppe"], 3, "{v}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

// ---------------------------------------------------------------------------
// Credentials, pipe sizes, the bytes of argv and envp
// ---------------------------------------------------------------------------

#[test]
fn credentials_follow_linux_rules_through_fork_and_exec() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, subprocess, sys
out = {}
child = "import os, json; print(json.dumps([os.getresuid(), os.getresgid(), sorted(os.getgroups()), [l.split() for l in open('/proc/self/status') if l.startswith(('Uid', 'Gid', 'Groups', 'CapEff'))]]))"
p = subprocess.run([sys.executable, "-c", child], user=65534, group=65533, extra_groups=[7, 5], capture_output=True, text=True)
out["child"] = json.loads(p.stdout) if p.returncode == 0 else p.stderr
# In a fork: root keeps its saved uid 0 through seteuid, so it can come back;
# after setuid as root (all three ids) it cannot.
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    steps = []
    os.seteuid(1000)
    steps.append(os.getresuid())
    try:
        os.setgroups([1])
        steps.append("setgroups allowed")
    except PermissionError:
        steps.append("setgroups EPERM")
    os.seteuid(0)
    steps.append(os.getresuid())
    os.setuid(2000)
    steps.append(os.getresuid())
    try:
        os.setuid(0)
        steps.append("setuid(0) allowed")
    except PermissionError:
        steps.append("setuid(0) EPERM")
    try:
        os.setresuid(-1, 3000, -1)
        steps.append("setresuid allowed")
    except PermissionError:
        steps.append("setresuid EPERM")
    os.write(w, json.dumps(steps).encode())
    os._exit(0)
os.close(w)
out["steps"] = json.loads(os.read(r, 4000))
os.waitpid(pid, 0)
out["parent"] = [os.getresuid(), os.getresgid(), os.getgroups()]
json.dumps(out)
"#,
    );
    let child = &v["child"];
    assert_eq!(child[0], serde_json::json!([65534, 65534, 65534]), "user= set all three uids in the child: {v}");
    assert_eq!(child[1], serde_json::json!([65533, 65533, 65533]), "group=: {v}");
    assert_eq!(child[2], serde_json::json!([5, 7]), "extra_groups=: {v}");
    assert_eq!(
        child[3],
        serde_json::json!([
            ["Uid:", "65534", "65534", "65534", "65534"],
            ["Gid:", "65533", "65533", "65533", "65533"],
            ["Groups:", "5", "7"],
            ["CapEff:", "0000000000000000"]
        ]),
        "/proc/self/status: {v}"
    );
    // glibc's seteuid is setresuid(-1, euid, -1): the saved uid stays 0.
    assert_eq!(
        v["steps"],
        serde_json::json!([
            [0, 1000, 0],
            "setgroups EPERM",
            [0, 0, 0],
            [2000, 2000, 2000],
            "setuid(0) EPERM",
            "setresuid EPERM"
        ]),
        "{v}"
    );
    assert_eq!(v["parent"], serde_json::json!([[0, 0, 0], [0, 0, 0], []]), "the parent is untouched: {v}");
}

#[test]
fn pipe_sizes_are_capacities_that_writes_honour() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, fcntl, errno
out = {}
def fill(w):
    n = 0
    try:
        while True:
            n += os.write(w, b"x" * 512)
    except BlockingIOError:
        return n
r, w = os.pipe()
os.set_blocking(w, False)
out["default"] = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
out["set_small"] = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 100)
out["small_holds"] = fill(w)
out["grown"] = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 8192)
out["grown_holds"] = fill(w)
try:
    fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 4096)
    out["ebusy"] = None
except OSError as e:
    out["ebusy"] = e.errno
os.read(r, 1 << 20)
out["set_big"] = fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 1000000)
pid = os.fork()
if pid == 0:
    os._exit(0 if fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == 1 << 20 else 1)
out["child_sees"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["big_holds"] = fill(w)
out["read_back"] = len(os.read(r, 2 << 20))
errs = []
for size in ((1 << 20) + 1, -1):
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
        errs.append(None)
    except OSError as e:
        errs.append(e.errno)
out["errs"] = errs
# The sandbox-wide budget: 16 pipes of 1 MiB is past it.
got = []
for _ in range(20):
    a, b = os.pipe()
    try:
        fcntl.fcntl(a, fcntl.F_SETPIPE_SZ, 1 << 20)
        got.append(1)
    except PermissionError:
        got.append(0)
out["budget"] = sum(got)
f = open("/tmp/plain", "w")
try:
    fcntl.fcntl(f.fileno(), fcntl.F_GETPIPE_SZ)
    out["file"] = None
except OSError as e:
    out["file"] = e.errno
json.dumps(out)
"#,
    );
    assert_eq!(v["default"], 65536, "{v}");
    assert_eq!(v["set_small"], 4096, "rounded up to a page: {v}");
    assert_eq!(v["small_holds"], 4096, "a non-blocking writer fills exactly the capacity: {v}");
    assert_eq!((&v["grown"], &v["grown_holds"]), (&8192.into(), &4096.into()), "{v}");
    assert_eq!(v["ebusy"], libc::EBUSY, "smaller than what it holds: {v}");
    assert_eq!(v["set_big"], 1 << 20, "rounded up to a power of two: {v}");
    assert_eq!(v["child_sees"], 0, "the size is the pipe's, shared with a fork's child: {v}");
    assert_eq!(v["big_holds"], 1 << 20, "{v}");
    assert_eq!(v["read_back"], 1 << 20, "{v}");
    assert_eq!(v["errs"], serde_json::json!([libc::EPERM, libc::EINVAL]), "past pipe-max-size; 2^32-1: {v}");
    // 16 MiB of capacity beyond the default: 17 pipes of 1 MiB, one of them the pipe above.
    let fit = (16 << 20) / ((1 << 20) - 65536) - 1;
    assert_eq!(v["budget"], fit, "the sandbox-wide budget: {v}");
    assert_eq!(v["file"], libc::EBADF, "{v}");
}

#[test]
fn argv_and_environment_bytes_reach_the_program_unchanged() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, subprocess, sys
env = {b"PATH": b"/usr/bin:/bin", b"K\xff": b"v\xfe\x80", b"LC_ALL": b"C"}
script = "import os, sys; print(os.environb[b'K\\xff'].hex(), os.fsencode(sys.argv[1]).hex(), open('/proc/self/environ', 'rb').read().count(b'K\\xff=v\\xfe\\x80\\0'))"
p = subprocess.run([sys.executable, "-c", script, b"a\xc3\x28"], env=env, capture_output=True)
sh = subprocess.run(["sh", "-c", 'printf %s "$X" | od -An -tx1'], env={b"X": b"\xffz"}, capture_output=True)
json.dumps({"out": p.stdout.decode().split(), "err": p.stderr.decode("ascii", "replace").splitlines()[-1:], "sh": sh.stdout.decode().split()})
"#,
    );
    assert_eq!(
        v["out"],
        serde_json::json!(["76fe80", "61c328", "1"]),
        "non-UTF-8 environment and argv, and /proc/self/environ: {v}"
    );
    assert_eq!(v["sh"], serde_json::json!(["ff", "7a"]), "{v}");
}

/// One argument may be as long as Linux's MAX_ARG_STRLEN (128 KiB with its
/// NUL), not just a path: `sh -c` scripts of tens of KiB (an SDK installing a
/// helper by heredoc) run; one byte more is E2BIG, as on Linux.
#[test]
fn one_argument_may_be_as_long_as_max_arg_strlen() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import json, subprocess, errno
script = "cat <<'EOF' | wc -c\n" + "x" * 60000 + "\nEOF"
ok = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
def run(n):
    try:
        return subprocess.run(["true", "y" * n]).returncode
    except OSError as e:
        return errno.errorcode[e.errno]
json.dumps({"wc": ok.stdout.strip(), "err": ok.stderr, "max": run(131071), "over": run(131072)})
"#,
    );
    assert_eq!(v["wc"], "60001", "{v}");
    assert_eq!(v["max"], 0, "a 128 KiB argument (with its NUL) runs: {v}");
    assert_eq!(v["over"], "E2BIG", "{v}");
}

/// flock(2) between two processes of the sandbox: the child's LOCK_NB attempt
/// fails while the parent holds the lock, and its blocking attempt waits until
/// the parent unlocks.
#[test]
fn flock_excludes_between_processes_and_a_blocked_waiter_gets_the_lock_on_unlock() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import fcntl, json, os, time
path = "/tmp/flock-test"
open(path, "w").close()
events = os.open("/tmp/flock-events", os.O_CREAT | os.O_WRONLY | os.O_APPEND)
fd = os.open(path, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    mine = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(events, b"child got it at once\n")
    except BlockingIOError:
        os.write(events, b"child would block\n")
    os.write(w, b"x")
    fcntl.flock(mine, fcntl.LOCK_EX)
    os.write(events, b"child locked\n")
    os._exit(0)
os.read(r, 1)
time.sleep(0.2)
os.write(events, b"parent unlocks\n")
fcntl.flock(fd, fcntl.LOCK_UN)
_, status = os.waitpid(pid, 0)
json.dumps({"events": open("/tmp/flock-events").read().splitlines(), "status": status})
"#,
    );
    assert_eq!(v["events"], serde_json::json!(["child would block", "parent unlocks", "child locked"]), "{v}");
    assert_eq!(v["status"], 0, "{v}");
}

// ---------------------------------------------------------------------------
// checkpoints of a sandbox whose children keep running
// ---------------------------------------------------------------------------

/// Children of a session left running: a Python counter (subprocess, after an
/// execve: its memory is over zeros), a counter forked with os.fork (its
/// memory over the template's), a talker on a pipe to the agent, and a
/// zombie not yet waited for. Each counter keeps its count in its own memory.
const RUNNING_CHILDREN: &str = r#"
import os, subprocess, sys, time
COUNT = '''
import os, sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
'''
counter = subprocess.Popen([sys.executable, "-c", COUNT, "/tmp/pcount"])
talker = subprocess.Popen([sys.executable, "-u", "-c", "import time\nfor i in range(1, 10**9):\n    print(i, flush=True)\n    time.sleep(0.02)"], stdout=subprocess.PIPE, text=True)
forked = os.fork()
if forked == 0:
    sys.argv = ["", "/tmp/fcount"]
    exec(COUNT)
zombie = os.fork()
if zombie == 0:
    os._exit(7)
first = int(talker.stdout.readline())
"#;

/// Run the sandbox's background work for `d`.
fn run_background_for(sb: &mut forkbox_engine::Sandbox, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if sb.run_background(until).unwrap() == forkbox_engine::BackgroundRun::Idle {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn count(sb: &mut forkbox_engine::Sandbox, file: &str) -> u64 {
    value(sb, &format!("int(open('{file}').read())")).parse().unwrap()
}

/// A checkpoint of `sb` as number `n` in `dir`: its state file, and what it wrote.
fn checkpoint_stats(
    sb: &mut forkbox_engine::Sandbox,
    dir: &std::path::Path,
    n: u32,
) -> (std::path::PathBuf, forkbox_engine::CheckpointStats) {
    let kit = shared();
    let (layer, state) = (dir.join(format!("layer{n}")), dir.join(format!("state{n}")));
    let stats = kit.template.checkpoint(&kit.engine, sb, &layer, &state, |_| Ok::<(), EngineError>(())).unwrap();
    (state, stats)
}

/// Checkpoint `n` back (its layers: its own and its ancestors', newest first).
fn resume(dir: &std::path::Path, n: u32, fork: bool) -> forkbox_engine::Sandbox {
    let kit = shared();
    let layers: Vec<_> =
        (1..=n).rev().map(|i| forkbox_snapshot::Layer::read(&dir.join(format!("layer{i}"))).unwrap()).collect();
    let mut sb = kit.template.resume(&kit.engine, &layers, &dir.join(format!("state{n}")), limits(60), fork).unwrap();
    sb.set_keep_running(true);
    sb
}

#[test]
fn checkpoints_bring_running_children_back_from_where_they_were() {
    let kit = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut sb = kit.template.fork_tracked(&kit.engine, limits(60)).unwrap();
    sb.set_keep_running(true);
    ok(&mut sb, RUNNING_CHILDREN);
    assert_eq!(value(&mut sb, "first"), "1");
    assert_eq!(sb.background_processes(), 3);
    run_background_for(&mut sb, Duration::from_millis(400));
    let (k, fk) = (count(&mut sb, "/tmp/pcount"), count(&mut sb, "/tmp/fcount"));
    let said = value(&mut sb, "int(talker.stdout.readline())").parse::<u64>().unwrap();
    assert!(k > 2 && fk > 2 && said > 1, "{k} {fk} {said}");
    let (s1, first) = checkpoint_stats(&mut sb, dir.path(), 1);
    run_background_for(&mut sb, Duration::from_millis(600));
    let later = count(&mut sb, "/tmp/pcount");
    assert!(later > k + 5, "{k} -> {later}");
    ok(&mut sb, "x = 1");
    let (s2, second) = checkpoint_stats(&mut sb, dir.path(), 2);
    drop(sb);
    let recorded = forkbox_snapshot::read_state(&s1).unwrap().children;
    assert_eq!(recorded.processes.len(), 3, "the checkpoint records the running children");
    assert_eq!(recorded.table.map(|t| t.entries.len()), Some(5), "the agent, 3 children and a zombie");
    // The children's memory is in the process memory file beside the state,
    // not in it: whole at the first checkpoint, then only what they wrote since.
    let procs1 = std::fs::metadata(dir.path().join("state1.procs")).unwrap().len();
    assert_eq!(procs1, first.procs_bytes);
    assert!(recorded.processes.iter().all(|c| c.memory.len() == 1 && c.memory[0].file == "state1.procs"));
    assert!(first.state_bytes < 256 << 10, "state of {} bytes", first.state_bytes);
    let again = forkbox_snapshot::read_state(&s2).unwrap().children;
    for c in &again.processes {
        // Its layer of checkpoint 1, and one of checkpoint 2 if it wrote anything since.
        let was = recorded.processes.iter().find(|r| r.process.pid == c.process.pid).unwrap();
        assert_eq!(c.memory.last(), was.memory.first(), "process {}: {:?}", c.process.pid, c.memory);
        assert!(c.memory.len() == 1 || (c.memory.len() == 2 && c.memory[0].file == "state2.procs"), "{:?}", c.memory);
    }
    assert!(
        second.procs_bytes * 4 < first.procs_bytes,
        "the second checkpoint wrote {} bytes of the children's memory, the first {}",
        second.procs_bytes,
        first.procs_bytes
    );

    // Back at checkpoint 1: every child is there, running on from where it was.
    let mut a = resume(dir.path(), 1, false);
    assert_eq!(a.background_processes(), 3);
    let back = count(&mut a, "/tmp/pcount");
    assert!(k <= back && back < later, "checkpoint at {k}, later {later}, back at {back}");
    run_background_for(&mut a, Duration::from_millis(400));
    let (on, fon) = (count(&mut a, "/tmp/pcount"), count(&mut a, "/tmp/fcount"));
    assert!(on > back + 5 && fon > fk + 5, "pcount {back} -> {on}, fcount {fk} -> {fon}");
    // The pipe between the agent and the talker still connects, in order.
    let next: u64 = value(&mut a, "int(talker.stdout.readline())").parse().unwrap();
    assert_eq!(next, said + 1, "the line after the last one read before the checkpoint");
    // The agent still has its children: running ones poll None, the zombie waits.
    assert_eq!(value(&mut a, "(counter.poll(), talker.poll())"), "(None, None)");
    assert_eq!(value(&mut a, "os.waitpid(zombie, 0)[1] >> 8"), "7");
    assert_eq!(value(&mut a, "os.waitpid(forked, os.WNOHANG)"), "(0, 0)");

    // Two forks of checkpoint 2 count on their own, each in its own file system.
    let mut f1 = resume(dir.path(), 2, true);
    let mut f2 = resume(dir.path(), 2, true);
    assert_eq!(value(&mut f1, "counter.kill(); counter.wait()"), "-9");
    let stopped = count(&mut f1, "/tmp/pcount");
    let f2a = count(&mut f2, "/tmp/pcount");
    run_background_for(&mut f1, Duration::from_millis(300));
    run_background_for(&mut f2, Duration::from_millis(300));
    assert_eq!(count(&mut f1, "/tmp/pcount"), stopped);
    assert!(count(&mut f2, "/tmp/pcount") > f2a + 5);
    assert_eq!(value(&mut f2, "counter.poll() is None"), "True");
    for sb in [&mut a, &mut f2] {
        ok(sb, "for p in (counter, talker): p.kill(); p.wait()\nos.kill(forked, 9); os.waitpid(forked, 0)");
    }
    assert_eq!(a.background_processes(), 0);
}

/// Measurement, not a check (run with `--ignored --nocapture`): the p50 of a
/// checkpoint and of a fork of it (a resume as a new session), for a session
/// with one running Python child and for one without, alternating in one run.
#[test]
#[ignore]
fn measure_checkpoints_and_forks_with_a_running_child() {
    const N: u32 = 20;
    let kit = shared();
    let p50 = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut sessions = Vec::new();
    let mut written: [Vec<f64>; 2] = Default::default();
    for child in [false, true] {
        let mut sb = kit.template.fork_tracked(&kit.engine, limits(60)).unwrap();
        sb.set_keep_running(true);
        if child {
            ok(&mut sb, "import subprocess, sys\ncounter = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.02)'])");
        }
        ok(&mut sb, "import time; time.sleep(0.3)");
        sessions.push((sb, tempfile::tempdir().unwrap(), Vec::new(), Vec::new(), 0u32));
    }
    for i in 1..=N {
        for (k, (sb, dir, ckpt, fork, _)) in sessions.iter_mut().enumerate() {
            ok(sb, &format!("x = {i}"));
            let t0 = Instant::now();
            let (_, stats) = checkpoint_stats(sb, dir.path(), i);
            ckpt.push(t0.elapsed().as_secs_f64() * 1000.0);
            written[k].push(stats.bytes() as f64 / 1024.0);
            let t0 = Instant::now();
            let f = resume(dir.path(), i, true);
            fork.push(t0.elapsed().as_secs_f64() * 1000.0);
            drop(f);
        }
    }
    for ((child, (sb, dir, ckpt, fork, _)), written) in [false, true].into_iter().zip(sessions).zip(written) {
        let state = std::fs::metadata(dir.path().join(format!("state{N}"))).unwrap().len();
        eprintln!(
            "{}: checkpoint p50 {:.2} ms ({:.1} KiB written p50, the first {:.1} KiB), fork of the checkpoint p50 {:.2} ms, state file {} KiB, background processes {}",
            if child { "one running child" } else { "no child" },
            p50(ckpt),
            p50(written.clone()),
            written[0],
            p50(fork),
            state / 1024,
            sb.background_processes()
        );
    }
}
