//! Sessions whose execs ran child processes (subprocess, os.fork, a child left
//! running, which the end of the exec kills) keep checkpointing, eviction and
//! resume, forks and reverts: parked state is always the agent's one process.
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
