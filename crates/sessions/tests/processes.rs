//! Sessions whose execs ran child processes (subprocess, os.fork, a child left
//! running, which the end of the exec kills) keep checkpointing, eviction and
//! resume, forks and reverts: parked state is always the agent's one process.
//! And sessions whose sandbox keeps its children running between calls (as a
//! session worker's does): checkpoints record them, and eviction, forks,
//! reverts, long chains and deletion of their memory files work with them.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::collections::BTreeMap;

use common::*;

#[test]
fn a_session_with_subprocesses_survives_eviction_fork_and_revert() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let code = "import subprocess, os, time\n\
                out = subprocess.run('echo one > /tmp/a; ls /tmp | wc -l', shell=True, capture_output=True, text=True).stdout.strip()\n\
                p = os.fork()\n\
                if p == 0:\n    while True: time.sleep(0.01)\n\
                out";
    let first = m.exec(TENANT, &s.id, code).expect("exec");
    assert_eq!(first.result.value.as_deref(), Some("'1'"), "{:?}", first.result);
    assert!(first.result.stderr.contains("was killed"), "the running child was killed: {}", first.result.stderr);
    // Checkpoint 2: a second file written by a child.
    ok(&m, &s.id, "subprocess.run(['sh', '-c', 'echo two > /tmp/b'])");
    assert!(m.evict(&s.id));
    assert_eq!(
        value(&m, &s.id, "subprocess.run(['cat', '/tmp/a', '/tmp/b'], capture_output=True).stdout"),
        "b'one\\ntwo\\n'"
    );
    let f = m.fork(TENANT, &s.id, None, BTreeMap::new()).expect("fork");
    assert_eq!(
        value(&m, &f.id, "q = os.fork()\nif q == 0: os._exit(3)\nos.waitstatus_to_exitcode(os.waitpid(q, 0)[1])"),
        "3"
    );
    assert!(m.evict(&s.id) && m.evict(&f.id));
    assert_eq!(
        value(&m, &f.id, "subprocess.run('ls /tmp', shell=True, capture_output=True, text=True).stdout.split()"),
        "['a', 'b']"
    );
    m.revert(TENANT, &s.id, 1).expect("revert to checkpoint 1");
    assert_eq!(
        value(&m, &s.id, "subprocess.run('ls /tmp', shell=True, capture_output=True, text=True).stdout.split()"),
        "['a']"
    );
}

#[test]
fn a_session_whose_exec_used_a_pool_and_shared_memory_survives_eviction_fork_and_revert() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    // An unclosed Pool (its workers are killed at the end of the exec), a Lock and a shared
    // Value the parent keeps, and an anonymous shared mapping written by a child.
    let code = "import multiprocessing as mp, mmap, os\n\
                def sq(x): return x * x\n\
                pool = mp.Pool(2)\n\
                r = pool.map(sq, range(20))\n\
                lock = mp.Lock()\n\
                v = mp.Value('i', 0, lock=False)\n\
                def bump(v, lock, n):\n    for _ in range(n):\n        with lock: v.value += 1\n\
                ps = [mp.Process(target=bump, args=(v, lock, 50)) for _ in range(2)]\n\
                for p in ps: p.start()\n\
                for p in ps: p.join()\n\
                anon = mmap.mmap(-1, 4096)\n\
                c = os.fork()\n\
                if c == 0:\n    anon[:4] = b'kept'\n    os._exit(0)\n\
                os.waitpid(c, 0)\n\
                (sum(r), v.value, anon[:4])";
    let first = m.exec(TENANT, &s.id, code).expect("exec");
    assert_eq!(first.result.value.as_deref(), Some("(2470, 100, b'kept')"), "{:?}", first.result);
    assert!(first.result.stderr.contains("were killed"), "the pool's workers were killed: {}", first.result.stderr);
    assert!(m.evict(&s.id));
    // After resume: the shared memory is the parent's (private) memory with its bytes; the Lock
    // and Value are shared again with new children (the mappings of files come back shared at a fork).
    let again = "ps = [mp.Process(target=bump, args=(v, lock, 50)) for _ in range(3)]\n\
                 for p in ps: p.start()\n\
                 for p in ps: p.join()\n\
                 with mp.Pool(2) as p2: r2 = p2.map(sq, range(20))\n\
                 (v.value, anon[:4], sum(r2))";
    assert_eq!(value(&m, &s.id, again), "(250, b'kept', 2470)");
    let f = m.fork(TENANT, &s.id, None, BTreeMap::new()).expect("fork");
    assert_eq!(value(&m, &f.id, again), "(400, b'kept', 2470)");
    assert!(m.evict(&s.id) && m.evict(&f.id));
    assert_eq!(value(&m, &f.id, again), "(550, b'kept', 2470)");
    assert_eq!(value(&m, &s.id, "with mp.Pool(2) as p3: r3 = p3.map(sq, [3])\n(r3, v.value)"), "([9], 250)");
    m.revert(TENANT, &s.id, 1).expect("revert to checkpoint 1");
    assert_eq!(value(&m, &s.id, again), "(250, b'kept', 2470)");
}

/// A session whose sandbox keeps what its execs leave running (in this
/// process: the children run during later execs, whenever the agent waits).
fn open_keeping_children(home: &std::path::Path) -> forkbox_sessions::manager::SessionManager {
    open_default(home).with_host(std::sync::Arc::new(forkbox_sessions::host::InProcessKeepingChildren))
}

/// Starts a Python child that keeps running: it counts loop turns (`ticks`,
/// every 5 ms of its run time) and answers each request on its stdin with
/// the number of requests so far and its ticks. `ask()` in the agent asks it.
const START_COUNTER: &str = r#"import subprocess, sys, time
CHILD = """
import os, select
n = ticks = 0
kept = []
while True:
    ticks += 1
    if select.select([0], [], [], 0.005)[0]:
        if not os.read(0, 2):
            break
        n += 1
        kept.append(bytes(3000))
        os.write(1, b'%d %d\\n' % (n, ticks))
"""
child = subprocess.Popen([sys.executable, '-c', CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
def ask():
    child.stdin.write(b'+\n'); child.stdin.flush()
    n, ticks = child.stdout.readline().split()
    return int(n), int(ticks)
ask()[0]"#;

/// The `.procs` files (the child processes' memory layers) in the layers directory.
fn procs_files(home: &TestHome) -> Vec<String> {
    file_names(&home.layers()).into_iter().filter(|n| n.ends_with(".procs")).collect()
}

/// The process memory file a checkpoint writes (it exists only if it recorded a child's pages).
fn procs_file_of(c: &forkbox_sessions::store::CheckpointRecord) -> String {
    let pack = std::path::Path::new(&c.state).with_extension("files");
    forkbox_snapshot::files::procs_name(&pack.to_string_lossy())
}

/// Ask the session's child once: its request count.
#[track_caller]
fn ask(m: &forkbox_sessions::manager::SessionManager, id: &str) -> (i64, i64) {
    let out = ok(m, id, "ask()");
    let v = out.result.value.clone().unwrap_or_else(|| panic!("no value: {:?}", out.result));
    let n: i64 = v.trim_matches(['(', ')']).split(',').next().and_then(|x| x.trim().parse().ok()).expect("a count");
    (n, out.checkpoint.seq)
}

#[test]
fn a_running_child_survives_checkpoints_eviction_fork_revert_long_chains_and_deletion() {
    let home = fresh_home();
    let m = open_keeping_children(home.path());
    let s = new_session(&m);
    let first = ok(&m, &s.id, START_COUNTER);
    assert_eq!(first.result.value.as_deref(), Some("1"), "{:?}", first.result);
    assert!(!first.result.stderr.contains("killed"), "the child keeps running: {}", first.result.stderr);
    // It runs while the agent waits: its ticks go on between two requests.
    let running = value(&m, &s.id, "a = ask(); time.sleep(0.1); b = ask(); (a[0], b[0], b[1] - a[1] > 5)");
    assert_eq!(running, "(2, 3, True)");
    let mut at: BTreeMap<i64, i64> = BTreeMap::from([(1, 1), (2, 3)]);
    assert!(!procs_files(&home).is_empty(), "the child's memory is in process memory files");

    // Evict + resume: the child comes back with its count.
    assert!(m.evict(&s.id));
    let (n, seq) = ask(&m, &s.id);
    assert_eq!(n, 4);
    at.insert(seq, n);

    // A fork has its own child, from the same point: the two counts diverge.
    let f = m.fork(TENANT, &s.id, None, BTreeMap::new()).expect("fork");
    assert_eq!(ask(&m, &f.id).0, 5);
    assert_eq!(ask(&m, &f.id).0, 6);
    let (n, seq) = ask(&m, &s.id);
    assert_eq!(n, 5, "the source's child did not see the fork's requests");
    at.insert(seq, n);
    assert_eq!(ask(&m, &f.id).0, 7);

    // Revert to checkpoint 2: the child continues from the count it had there.
    m.revert(TENANT, &s.id, 2).expect("revert");
    let (n, seq) = ask(&m, &s.id);
    assert_eq!(n, 4);
    at.insert(seq, n);

    // A long chain: more checkpoints with the child running than a child's
    // chain of memory layers may have, the agent's layers compacted on the way.
    for i in 0..40 {
        let (n, seq) = ask(&m, &s.id);
        at.insert(seq, n);
        if i % 5 == 4 {
            m.maintenance().expect("maintenance");
        }
    }
    assert_eq!(at.values().max(), Some(&44));
    // Every checkpoint comes back with its child at its count.
    for (&seq, &n) in &at {
        m.revert(TENANT, &s.id, seq).unwrap_or_else(|e| panic!("revert to {seq}: {e}"));
        let out = m.exec(TENANT, &s.id, "ask()").unwrap_or_else(|e| panic!("exec after revert to {seq}: {e}"));
        check_no_exception(&out.result, "ask()");
        let v = out.result.value.unwrap_or_default();
        assert!(v.starts_with(&format!("({}, ", n + 1)), "checkpoint {seq}: {v}, expected the count {}", n + 1);
    }

    // Deleting the session removes the process memory files only it needed:
    // the fork's child still comes back (its chain reads its ancestors' files).
    let mine: Vec<_> = m.checkpoints(TENANT, &s.id).expect("checkpoints");
    let shared: Vec<i64> = m.history(TENANT, &f.id).expect("history").iter().map(|c| c.id).collect();
    m.delete(TENANT, &s.id).expect("delete");
    let left = procs_files(&home);
    for c in &mine {
        let name = procs_file_of(c);
        if !shared.contains(&c.id) {
            assert!(!left.contains(&name), "{name} of checkpoint {} outlived its session", c.seq);
        }
    }
    assert!(!left.is_empty(), "the fork's lineage still needs its process memory files");
    assert!(m.evict(&f.id));
    assert_eq!(ask(&m, &f.id).0, 8);
    m.delete(TENANT, &f.id).expect("delete the fork");
    assert_eq!(procs_files(&home), Vec::<String>::new(), "no process memory file outlives every session");
}
