//! A session's first call: its sandbox is a pooled VM (warm like a one-shot
//! fork's, possibly recycled from other forks), its first checkpoint the pages
//! that differ from the template; that checkpoint may be settled after the
//! answer (`exec_deferred`), and every use of the session waits for it.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::collections::BTreeMap;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use common::*;
use forkbox_engine::{ExecOptions, Limits};

/// Before the session exists, one-shot forks on this thread dirty VMs that go
/// back to the pool (reset): the session's sandbox is likely one of them. What
/// they did must not show in the session, and what the session did must be
/// in its checkpoints: evicted and resumed, forked from checkpoint 1, it has
/// exactly its own state.
#[test]
fn a_session_on_a_recycled_vm_checkpoints_exactly_its_own_state() {
    let home = fresh_home();
    let m = open_default(home.path());
    let sh = shared();
    for i in 0..6 {
        let mut sb = sh.template.fork(&sh.engine, Limits::default()).unwrap();
        let r = sb
            .exec(&format!("leak = {i}\nbuf = bytearray(4096 * 64)\nopen('/tmp/oneshot.txt', 'w').write('x')"))
            .unwrap();
        assert!(r.error.is_none(), "{:?}", r.error);
    }
    let s = new_session(&m);
    let c1 =
        ok(&m, &s.id, "x = 41\nblob = bytes(range(256)) * 4096\nopen('/tmp/mine.txt', 'w').write('first')").checkpoint;
    assert_eq!((c1.seq, c1.parent), (1, None));
    assert!(c1.id > 0, "the first checkpoint is committed when exec returns");
    assert!(c1.pages > 0 && c1.pages < 20_000, "pages of the first layer: {}", c1.pages);
    let c2 = ok(&m, &s.id, "x += 1\nblob = blob[:10]").checkpoint;
    assert_eq!((c2.seq, c2.parent), (2, Some(c1.id)));
    let probe = "(x, len(blob), open('/tmp/mine.txt').read(), 'leak' in globals(), __import__('os').path.exists('/tmp/oneshot.txt'))";
    assert_eq!(value(&m, &s.id, probe), "(42, 10, 'first', False, False)");
    // From disk: the same.
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, probe), "(42, 10, 'first', False, False)");
    // Checkpoint 1 alone (its layer over the template) holds the first call's state.
    let f = m.fork(TENANT, &s.id, Some(1), BTreeMap::new()).unwrap();
    assert_eq!(
        value(&m, &f.id, probe.replace("len(blob)", "len(blob) // 4096").as_str()),
        "(41, 256, 'first', False, False)"
    );
}

/// The first checkpoint, answered for before it is durable: reading the
/// session's checkpoints, its record and running its next call all wait until
/// it is committed, then see it (listed, the head, the parent of the next).
#[test]
fn the_first_checkpoint_is_committed_before_the_session_is_used_again() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let (out, settle) = m.exec_deferred(TENANT, &s.id, "x = 1 + 1\nx", ExecOptions::default(), None).unwrap();
    assert_eq!(out.result.value.as_deref(), Some("2"));
    assert_eq!(out.checkpoint.seq, 1);
    let settle = settle.expect("a first checkpoint is left to the caller");
    // Not committed yet: nothing in the database.
    assert!(m.store().session_checkpoints(&s.id).unwrap().is_empty());
    let held = Duration::from_millis(300);
    let (tx, rx) = channel();
    std::thread::scope(|scope| {
        let (m, id, tx2, tx3) = (&m, s.id.clone(), tx.clone(), tx.clone());
        let id2 = id.clone();
        let id3 = id.clone();
        scope.spawn(move || {
            let list = m.checkpoints(TENANT, &id).unwrap();
            tx.send(("list", Instant::now(), list.iter().map(|c| c.seq).collect::<Vec<_>>())).unwrap();
        });
        scope.spawn(move || {
            let head = m.get(TENANT, &id2).unwrap().head;
            tx2.send(("head", Instant::now(), head.into_iter().collect())).unwrap();
        });
        scope.spawn(move || {
            let o = m.exec(TENANT, &id3, "x * 21").unwrap();
            assert_eq!(o.result.value.as_deref(), Some("42"));
            tx3.send(("next", Instant::now(), vec![o.checkpoint.seq, o.checkpoint.parent.unwrap_or(-1)])).unwrap();
        });
        std::thread::sleep(held);
        assert!(rx.try_recv().is_err(), "a use of the session went ahead of its first checkpoint");
        let settled_at = Instant::now();
        let c1 = settle.finish().unwrap();
        assert!(c1.id > 0);
        let mut seen = BTreeMap::new();
        for _ in 0..3 {
            let (what, at, v) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
            assert!(at >= settled_at, "{what} returned before the checkpoint was committed");
            seen.insert(what, v);
        }
        assert_eq!(seen["list"], vec![1]);
        assert_eq!(seen["head"], vec![c1.id]);
        assert_eq!(seen["next"], vec![2, c1.id]);
    });
    // Durable: its files are there under their final names, no temp file left.
    let names = file_names(&home.layers());
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    let c1 = m.store().checkpoint_by_seq(&s.id, 1).unwrap().unwrap();
    assert!(names.contains(&c1.layer) && names.contains(&c1.state), "{names:?}");
}

/// A settle dropped without `finish` still commits (nothing is left half done).
#[test]
fn a_dropped_settle_still_commits_the_first_checkpoint() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let (_, settle) = m.exec_deferred(TENANT, &s.id, "y = 5", ExecOptions::default(), None).unwrap();
    drop(settle);
    let list = m.checkpoints(TENANT, &s.id).unwrap();
    assert_eq!(list.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![1]);
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "y"), "5");
    // A later checkpoint is left to the caller too, and committed when dropped.
    let (out, later) = m.exec_deferred(TENANT, &s.id, "y += 1", ExecOptions::default(), None).unwrap();
    assert_eq!(out.checkpoint.seq, 3, "(`value` ran an exec: checkpoint 2)");
    assert!(later.is_some());
    drop(later);
    assert_eq!(m.checkpoints(TENANT, &s.id).unwrap().iter().map(|c| c.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "y"), "6");
}

/// A checkpoint answered for that then cannot be stored (its files gone
/// before the settle renames them): the session goes back to the checkpoint
/// before, its next exec fails once saying which was lost and where the
/// session is, and the exec after that runs on the state before.
#[test]
fn a_checkpoint_that_is_not_stored_after_its_reply_is_reported_by_the_next_call() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let c1 = ok(&m, &s.id, "z = 1").checkpoint;
    let (out, settle) = m.exec_deferred(TENANT, &s.id, "z = 2", ExecOptions::default(), None).unwrap();
    assert_eq!(out.checkpoint.seq, 2);
    let settle = settle.expect("the checkpoint is left to the caller");
    let temps: Vec<String> = file_names(&home.layers()).into_iter().filter(|n| n.ends_with(".tmp")).collect();
    assert!(!temps.is_empty(), "the checkpoint's files are written before the settle");
    for t in &temps {
        std::fs::remove_file(home.layers().join(t)).unwrap();
    }
    assert!(settle.finish().is_err(), "a settle whose files are gone fails");
    let e = m.exec(TENANT, &s.id, "z").unwrap_err();
    assert_eq!(e.code(), "storage_error", "{e}");
    assert_eq!(e.rolled_back_to(), Some(Some(1)), "{e}");
    assert!(e.to_string().contains("checkpoint 2 was not stored"), "{e}");
    // Reported once: the session runs on from checkpoint 1.
    let o = m.exec(TENANT, &s.id, "z").unwrap();
    assert_eq!(o.result.value.as_deref(), Some("1"));
    assert_eq!((o.checkpoint.seq, o.checkpoint.parent), (2, Some(c1.id)));
    let names = file_names(&home.layers());
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
}
