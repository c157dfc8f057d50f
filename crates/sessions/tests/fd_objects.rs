//! Sessions hold the fd objects the VMM owns (pipes, socketpairs, eventfd,
//! epoll, the top-level-await event loop) across execs, checkpoints, eviction
//! and resume, restarts, reverts and forks: they are process state.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::collections::BTreeMap;

use common::*;

#[test]
fn a_pipe_with_unread_data_survives_checkpoint_eviction_and_fork() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    ok(&m, &s.id, "import os, socket\nr, w = os.pipe()\nos.write(w, b'first part ')\na, b = socket.socketpair()\na.send(b'queued')\nefd = os.eventfd(5)");
    // Across an exec boundary (a checkpoint) and an eviction + resume from disk.
    ok(&m, &s.id, "os.write(w, b'second part')");
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "os.read(r, 5)"), "b'first'");

    // A fork of the head continues from the same unread bytes; each branch on its own.
    let f = m.fork(TENANT, &s.id, None, BTreeMap::new()).expect("fork");
    assert_eq!(
        value(&m, &f.id, "(os.read(r, 100), b.recv(100), os.eventfd_read(efd))"),
        "(b' part second part', b'queued', 5)"
    );
    assert_eq!(value(&m, &s.id, "os.read(r, 6)"), "b' part '");
    assert!(m.evict(&s.id) && m.evict(&f.id));
    assert_eq!(value(&m, &s.id, "(os.read(r, 100), b.recv(100))"), "(b'second part', b'queued')");
    let probe =
        "import fcntl, termios, array\nbuf = array.array('i', [0])\nfcntl.ioctl(r, termios.FIONREAD, buf)\nbuf[0]";
    assert_eq!(value(&m, &f.id, probe), "0");

    // After a restart of the whole manager, and a revert to the checkpoint with data left.
    drop(m);
    let m = open_default(home.path());
    assert_eq!(value(&m, &s.id, "os.write(w, b'again'); os.read(r, 100)"), "b'again'");
    m.revert(TENANT, &s.id, 2).expect("revert to checkpoint 2");
    assert_eq!(value(&m, &s.id, "os.read(r, 100)"), "b'first part second part'");
}

#[test]
fn the_session_event_loop_survives_eviction() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    ok(&m, &s.id, "import asyncio\nq = asyncio.Queue()\nasync def put(n):\n    for i in range(n):\n        await q.put(i)\n        await asyncio.sleep(0.01)\n");
    ok(&m, &s.id, "task = asyncio.ensure_future(put(3))\nawait asyncio.sleep(0)");
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "await task\n[q.get_nowait() for _ in range(q.qsize())]"), "[0, 1, 2]");
    assert_eq!(value(&m, &s.id, "await asyncio.wait_for(asyncio.sleep(0, result='ok'), 1)"), "'ok'");
}
