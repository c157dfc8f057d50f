//! Sessions whose execs ran child processes (subprocess, os.fork, a child left
//! running, which the end of the exec kills) keep checkpointing, eviction and
//! resume, forks and reverts: parked state is always the agent's one process.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.

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
    assert_eq!(value(&m, &s.id, "subprocess.run(['cat', '/tmp/a', '/tmp/b'], capture_output=True).stdout"), "b'one\\ntwo\\n'");
    let f = m.fork(TENANT, &s.id, None, BTreeMap::new()).expect("fork");
    assert_eq!(value(&m, &f.id, "q = os.fork()\nif q == 0: os._exit(3)\nos.waitstatus_to_exitcode(os.waitpid(q, 0)[1])"), "3");
    assert!(m.evict(&s.id) && m.evict(&f.id));
    assert_eq!(value(&m, &f.id, "subprocess.run('ls /tmp', shell=True, capture_output=True, text=True).stdout.split()"), "['a', 'b']");
    m.revert(TENANT, &s.id, 1).expect("revert to checkpoint 1");
    assert_eq!(value(&m, &s.id, "subprocess.run('ls /tmp', shell=True, capture_output=True, text=True).stdout.split()"), "['a']");
}
