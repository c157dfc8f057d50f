//! End-to-end tests of sessions: state that persists across execs, eviction
//! and transparent resume, restart (same and separate processes), revert,
//! fork, failure rollback, busy, scale, disk reclamation and corruption.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use forkbox_engine::Limits;
use forkbox_sessions::manager::{Config, SessionError};

// ---------------------------------------------------------------------------
// 1. State persists across execs
// ---------------------------------------------------------------------------

#[test]
fn state_persists_across_three_execs() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    assert_eq!(s.head, None);

    let c1 = ok(&m, &s.id, "x = 40\nimport json\nopen('/tmp/notes.txt', 'w').write('first')").checkpoint;
    let c2 =
        ok(&m, &s.id, "x += 2\nopen('/tmp/notes.txt', 'a').write(' second')\nenc = json.dumps({'x': x})").checkpoint;
    let out = ok(&m, &s.id, "(x, enc, json.loads(enc)['x'], open('/tmp/notes.txt').read())");
    assert_eq!(out.result.value.as_deref(), Some("(42, '{\"x\": 42}', 42, 'first second')"));

    // Each exec is a checkpoint, chained.
    let c3 = out.checkpoint;
    assert_eq!((c1.seq, c2.seq, c3.seq), (1, 2, 3));
    assert_eq!((c1.parent, c2.parent, c3.parent), (None, Some(c1.id), Some(c2.id)));
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, Some(c3.id));
    let hist: Vec<i64> = m.history(TENANT, &s.id).unwrap().iter().map(|c| c.seq).collect();
    assert_eq!(hist, [1, 2, 3]);
    let codes: Vec<String> = m.checkpoints(TENANT, &s.id).unwrap().into_iter().map(|c| c.code).collect();
    assert!(codes[0].starts_with("x = 40"), "{codes:?}");

    // A Python exception is a result, not a failure: the state stays and goes on.
    let r = m.exec(TENANT, &s.id, "x = 1000\nraise ValueError('boom')").expect("exec with a Python exception");
    assert_eq!(r.result.error.as_ref().map(|e| e.kind.as_str()), Some("ValueError"));
    assert_eq!(value(&m, &s.id, "x"), "1000");
}

// ---------------------------------------------------------------------------
// 2. Eviction and transparent resume
// ---------------------------------------------------------------------------

#[test]
fn evict_then_exec_restores() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    ok(&m, &s.id, "import json\nx = 7\nopen('/tmp/evict.txt', 'w').write('kept')");
    ok(&m, &s.id, "x *= 6\nbig = list(range(100000))");
    assert!(m.is_resident(&s.id));
    assert_eq!(m.resident_count(), 1);

    assert!(m.evict(&s.id), "evict of a resident session returns true");
    assert!(!m.is_resident(&s.id));
    assert_eq!(m.resident_count(), 0);
    assert!(!m.evict(&s.id), "evicting twice returns false");

    let v = value(&m, &s.id, "(x, open('/tmp/evict.txt').read(), sum(big), json.dumps([1]))");
    assert_eq!(v, "(42, 'kept', 4999950000, '[1]')");
    assert!(m.is_resident(&s.id));
    assert_eq!(m.resident_count(), 1);

    // Evict + resume several times in a row: still the same state.
    for i in 0..3 {
        assert!(m.evict(&s.id));
        assert_eq!(value(&m, &s.id, "x += 1\nx"), (43 + i).to_string());
    }
}

#[test]
fn evict_idle_and_lru_bound() {
    // idle_timeout 0: everything resident is idle.
    let home = fresh_home();
    let m = open(home.path(), Config { idle_timeout: Duration::ZERO, ..Config::default() });
    let a = new_session(&m);
    let b = new_session(&m);
    ok(&m, &a.id, "v = 'a'\nopen('/tmp/who', 'w').write('A')");
    ok(&m, &b.id, "v = 'b'\nopen('/tmp/who', 'w').write('B')");
    assert_eq!(m.resident_count(), 2);
    assert_eq!(m.evict_idle(), 2);
    assert_eq!(m.resident_count(), 0);
    assert!(!m.is_resident(&a.id) && !m.is_resident(&b.id));
    assert_eq!(m.evict_idle(), 0);
    assert_eq!(value(&m, &a.id, "(v, open('/tmp/who').read())"), "('a', 'A')");
    assert_eq!(value(&m, &b.id, "(v, open('/tmp/who').read())"), "('b', 'B')");
    assert_eq!(m.resident_count(), 2);
    drop(m);

    // A long idle timeout evicts nothing.
    let home2 = fresh_home();
    let m = open(home2.path(), Config { idle_timeout: Duration::from_secs(3600), ..Config::default() });
    let s = new_session(&m);
    ok(&m, &s.id, "v = 1");
    assert_eq!(m.evict_idle(), 0);
    assert_eq!(m.resident_count(), 1);
    drop(m);

    // LRU: at most 2 resident; the others are evicted, and still correct.
    let home3 = fresh_home();
    let m = open(home3.path(), Config { max_resident: 2, ..Config::default() });
    let ids: Vec<String> = (0..4).map(|_| new_session(&m).id).collect();
    for (i, id) in ids.iter().enumerate() {
        ok(&m, id, &format!("v = {i}"));
        assert!(m.resident_count() <= 2, "resident {} > 2 after {} sessions", m.resident_count(), i + 1);
    }
    // The two most recently used are the resident ones.
    assert!(m.is_resident(&ids[2]) && m.is_resident(&ids[3]));
    assert!(!m.is_resident(&ids[0]) && !m.is_resident(&ids[1]));
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(value(&m, id, "v"), i.to_string());
        assert!(m.resident_count() <= 2);
    }
}

// ---------------------------------------------------------------------------
// 3. Restart
// ---------------------------------------------------------------------------

#[test]
fn restart_in_process_restores_state() {
    let home = fresh_home();
    let id;
    {
        let m = open_default(home.path());
        id = new_session(&m).id;
        ok(&m, &id, "import json\nx = 'persisted'\nopen('/tmp/r.txt', 'w').write('file survives')");
        ok(&m, &id, "y = [x] * 2");
        // Dropped while resident: nothing but disk remains.
    }
    let m = open_default(home.path());
    assert!(!m.is_resident(&id));
    assert_eq!(m.list(TENANT, &[]).unwrap().len(), 1);
    assert_eq!(
        value(&m, &id, "(x, y, open('/tmp/r.txt').read(), json.dumps(1))"),
        "('persisted', ['persisted', 'persisted'], 'file survives', '1')"
    );
    let seqs: Vec<i64> = m.checkpoints(TENANT, &id).unwrap().iter().map(|c| c.seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
}

#[test]
fn restart_across_processes_with_the_cli() {
    let home = fresh_home();
    let h = home.path();
    let t0 = Instant::now();
    let id = session_ok(h, "new", &["--tag", "who=cli"]).trim().to_string();
    assert!(id.starts_with("s_"), "session id {id:?}");
    eprintln!("cli new: {:.2} s", t0.elapsed().as_secs_f64());

    let t0 = Instant::now();
    let (_, seq) = cli_exec(h, &id, "import json\nx = 41\nopen('/tmp/r', 'w').write('hello')");
    assert_eq!(seq, 1);
    eprintln!("cli exec (fresh process): {:.2} s", t0.elapsed().as_secs_f64());
    let (_, seq) = cli_exec(h, &id, "x += 1");
    assert_eq!(seq, 2);
    let (v, seq) = cli_exec(h, &id, "(x, json.dumps({'a': 1}), open('/tmp/r').read())");
    assert_eq!(v.as_deref(), Some("(42, '{\"a\": 1}', 'hello')"));
    assert_eq!(seq, 3);

    // ls (with a tag filter) and log.
    let ls = session_ok(h, "ls", &["--tag", "who=cli"]);
    assert!(ls.contains(&id), "{ls}");
    assert!(session_ok(h, "ls", &["--tag", "who=nobody"]).trim().is_empty());
    let (seqs, current) = cli_log(h, &id);
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(current, Some(3));

    // The library sees the same sessions (this process is yet another "server").
    {
        let m = open_default(h);
        assert_eq!(value(&m, &id, "x"), "42");
    }

    // Revert in one process, exec in the next.
    let out = session_ok(h, "revert", &[&id, "1"]);
    assert!(out.contains("checkpoint 1"), "{out}");
    let (v, seq) = cli_exec(h, &id, "(x, open('/tmp/r').read())");
    assert_eq!(v.as_deref(), Some("(41, 'hello')"));
    assert_eq!(seq, 5);

    // Fork by CLI, diverge, rm.
    let child = session_ok(h, "fork", &[&id, "2"]).trim().to_string();
    assert!(child.starts_with("s_") && child != id);
    let (v, _) = cli_exec(h, &child, "x += 100\nx");
    assert_eq!(v.as_deref(), Some("142"));
    let (v, _) = cli_exec(h, &id, "x");
    assert_eq!(v.as_deref(), Some("41"));
    session_ok(h, "rm", &[&id]);
    let ls = session_ok(h, "ls", &[]);
    assert!(!ls.contains(&id) && ls.contains(&child), "{ls}");
    let (v, _) = cli_exec(h, &child, "x");
    assert_eq!(v.as_deref(), Some("142"));

    // Errors are reported, not panics: unknown session.
    let out = session_cmd(h, "exec", &["s_doesnotexist", "1"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not found"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

// ---------------------------------------------------------------------------
// 4. Revert
// ---------------------------------------------------------------------------

#[test]
fn revert_undoes_later_state_and_log_is_a_tree() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let c1 = ok(&m, &s.id, "x = 1\nopen('/tmp/f', 'w').write('one')").checkpoint;
    let c2 = ok(&m, &s.id, "x = 2\nz = 'later'\nopen('/tmp/f', 'w').write('two')\nopen('/tmp/g', 'w').write('g')")
        .checkpoint;
    let c3 = ok(&m, &s.id, "x = 3\nimport json").checkpoint;
    assert!(m.is_resident(&s.id));

    let target = m.revert(TENANT, &s.id, 1).expect("revert to 1");
    assert_eq!(target.id, c1.id);
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, Some(c1.id));
    assert!(!m.is_resident(&s.id), "revert drops the resident sandbox");

    let out = ok(
        &m,
        &s.id,
        "import os\n(x, open('/tmp/f').read(), 'z' in globals(), os.path.exists('/tmp/g'), 'json' in globals())",
    );
    assert_eq!(out.result.value.as_deref(), Some("(1, 'one', False, False, False)"));
    let c4 = out.checkpoint;
    assert_eq!(c4.seq, 4, "seq numbers are never reused");
    assert_eq!(c4.parent, Some(c1.id), "the checkpoint after a revert hangs off checkpoint 1");

    // The full tree: 1 <- 2 <- 3, and 1 <- 4.
    let all = m.checkpoints(TENANT, &s.id).unwrap();
    let tree: Vec<(i64, Option<i64>)> = all.iter().map(|c| (c.id, c.parent)).collect();
    assert_eq!(tree, [(c1.id, None), (c2.id, Some(c1.id)), (c3.id, Some(c2.id)), (c4.id, Some(c1.id))]);
    let hist: Vec<i64> = m.history(TENANT, &s.id).unwrap().iter().map(|c| c.seq).collect();
    assert_eq!(hist, [1, 4]);

    // Revert forward to 3 (on the other branch): its state is back, files too.
    m.revert(TENANT, &s.id, 3).unwrap();
    assert_eq!(value(&m, &s.id, "(x, z, open('/tmp/f').read(), open('/tmp/g').read())"), "(3, 'later', 'two', 'g')");
    // And the revert survives a restart.
    m.revert(TENANT, &s.id, 2).unwrap();
    drop(m);
    let m = open_default(home.path());
    assert_eq!(value(&m, &s.id, "(x, 'json' in globals())"), "(2, False)");

    // Unknown checkpoint: a clear error; the head does not move.
    let head = m.get(TENANT, &s.id).unwrap().head;
    match m.revert(TENANT, &s.id, 99) {
        Err(SessionError::CheckpointNotFound(id, 99)) => assert_eq!(id, s.id),
        other => panic!("expected CheckpointNotFound, got {other:?}"),
    }
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, head);
    // Another session's checkpoint numbers are not this session's.
    let other = new_session(&m);
    assert!(matches!(m.revert(TENANT, &other.id, 1), Err(SessionError::CheckpointNotFound(..))));
}

// ---------------------------------------------------------------------------
// 5. Fork
// ---------------------------------------------------------------------------

#[test]
fn fork_branches_see_only_their_own_history() {
    let home = fresh_home();
    let m = open_default(home.path());
    let a = new_session(&m);
    let a1 = ok(&m, &a.id, "x = 1\nopen('/tmp/base', 'w').write('base')").checkpoint;
    ok(&m, &a.id, "x = 2\nafter_fork_point = True");

    let b = m.fork(TENANT, &a.id, Some(1), BTreeMap::from([("branch".into(), "b".into())])).expect("fork");
    assert_ne!(b.id, a.id);
    assert_eq!(b.head, Some(a1.id));
    assert_eq!(m.list(TENANT, &[("branch".into(), "b".into())]).unwrap().len(), 1);

    ok(&m, &a.id, "x += 10\nopen('/tmp/who', 'w').write('a')\nonly_a = 1");
    ok(&m, &b.id, "x += 100\nopen('/tmp/who', 'w').write('b')\nonly_b = 1");
    let probe = "(x, open('/tmp/who').read(), open('/tmp/base').read(), \
                 'only_a' in globals(), 'only_b' in globals(), 'after_fork_point' in globals())";
    assert_eq!(value(&m, &a.id, probe), "(12, 'a', 'base', True, False, True)");
    assert_eq!(value(&m, &b.id, probe), "(101, 'b', 'base', False, True, False)");

    // The same from disk, and after a restart.
    assert!(m.evict(&a.id) && m.evict(&b.id));
    assert_eq!(value(&m, &a.id, probe), "(12, 'a', 'base', True, False, True)");
    assert_eq!(value(&m, &b.id, probe), "(101, 'b', 'base', False, True, False)");
    drop(m);
    let m = open_default(home.path());
    assert_eq!(value(&m, &b.id, probe), "(101, 'b', 'base', False, True, False)");
    assert_eq!(value(&m, &a.id, probe), "(12, 'a', 'base', True, False, True)");

    // b's history: a's checkpoint 1, then its own; its own list has only its own.
    let hist: Vec<(String, i64)> =
        m.history(TENANT, &b.id).unwrap().into_iter().map(|c| (c.session_id, c.seq)).collect();
    assert_eq!(hist[0], (a.id.clone(), 1));
    assert!(hist[1..].iter().all(|(s, _)| *s == b.id), "{hist:?}");
    assert!(m.checkpoints(TENANT, &b.id).unwrap().iter().all(|c| c.session_id == b.id));

    // Fork of the head (default) of a non-resident source; the source is not disturbed.
    m.evict(&a.id);
    let c = m.fork(TENANT, &a.id, None, BTreeMap::new()).unwrap();
    assert_eq!(value(&m, &c.id, "x"), "12");
    assert_eq!(value(&m, &a.id, "x"), "12");
    // Unknown checkpoint.
    assert!(matches!(m.fork(TENANT, &a.id, Some(77), BTreeMap::new()), Err(SessionError::CheckpointNotFound(..))));
}

#[test]
fn forks_do_not_share_random_state() {
    let home = fresh_home();
    let m = open_default(home.path());
    let a = new_session(&m);
    ok(&m, &a.id, "import random, numpy\nseed_point = 1");
    let draw = "(random.random(), float(numpy.random.random()))";

    // Source resident at its head; two forks of that head; all continue from the same checkpoint.
    let f1 = m.fork(TENANT, &a.id, None, BTreeMap::new()).unwrap();
    let f2 = m.fork(TENANT, &a.id, Some(1), BTreeMap::new()).unwrap();
    let va = value(&m, &a.id, draw);
    let v1 = value(&m, &f1.id, draw);
    let v2 = value(&m, &f2.id, draw);
    let parse = |s: &str| -> (String, String) {
        let t = s.trim_matches(|c| c == '(' || c == ')');
        let (p, q) = t.split_once(", ").unwrap_or_else(|| panic!("bad draw {s}"));
        (p.to_string(), q.to_string())
    };
    let (ra, na) = parse(&va);
    let (r1, n1) = parse(&v1);
    let (r2, n2) = parse(&v2);
    assert!(ra != r1 && ra != r2 && r1 != r2, "random.random() shared: source {ra}, forks {r1} {r2}");
    assert!(na != n1 && na != n2 && n1 != n2, "numpy.random.random() shared: source {na}, forks {n1} {n2}");

    // Evicted source and a fork of it resumed from disk: still distinct.
    m.evict(&a.id);
    let f3 = m.fork(TENANT, &a.id, None, BTreeMap::new()).unwrap();
    let va = value(&m, &a.id, draw);
    let v3 = value(&m, &f3.id, draw);
    assert_ne!(parse(&va).0, parse(&v3).0, "random.random() shared after eviction: {va} vs {v3}");
    assert_ne!(parse(&va).1, parse(&v3).1, "numpy.random.random() shared after eviction: {va} vs {v3}");
}

// ---------------------------------------------------------------------------
// 6. Failures roll back to the last checkpoint
// ---------------------------------------------------------------------------

#[test]
fn failed_exec_rolls_back_and_session_stays_usable() {
    let home = fresh_home();
    let m = open_default(home.path());
    let limits = Limits { timeout: Duration::from_secs(2), ..Limits::default() };
    let s = new_session_with(&m, &limits);

    // A failure before any checkpoint: back to the initial state.
    let (code, cp, msg) = exec_failed(&m, &s.id, "early = 1\nimport os\nos._exit(5)");
    assert_eq!((code.as_str(), cp), ("guest_exited", None), "{msg}");
    assert!(msg.contains("initial state"), "{msg}");
    assert_eq!(value(&m, &s.id, "'early' in globals()"), "False");

    ok(&m, &s.id, "x = 1\nopen('/tmp/f', 'w').write('good')");
    let mut good_seq = m.checkpoints(TENANT, &s.id).unwrap().last().unwrap().seq;
    let probe = "import os\n(x, 'y' in globals(), open('/tmp/f').read(), os.path.exists('/tmp/partial'))";
    let expect = "(1, False, 'good', False)";

    let failing: [(&str, &[&str]); 3] = [
        // Timeout with partial side effects.
        (
            "y = 1\nx = 99\nopen('/tmp/f', 'w').write('bad')\nopen('/tmp/partial', 'w').write('p')\nwhile True: pass",
            &["timeout"],
        ),
        // A segfault in native code.
        (
            "y = 1\nx = 99\nopen('/tmp/partial', 'w').write('p')\nimport ctypes\nctypes.string_at(0)",
            &["guest_crashed", "guest_killed"],
        ),
        // The interpreter exits.
        ("y = 1\nx = 99\nopen('/tmp/f', 'a').write('bad')\nimport os\nos._exit(3)", &["guest_exited"]),
    ];
    for (code, want) in failing {
        let t0 = Instant::now();
        let (got, cp, msg) = exec_failed(&m, &s.id, code);
        assert!(want.contains(&got.as_str()), "error code {got:?}, wanted one of {want:?}: {msg}\n{code}");
        assert_eq!(cp, Some(good_seq), "rolled back to the wrong checkpoint: {msg}");
        assert!(msg.contains(&format!("checkpoint {good_seq}")), "the error says where it rolled back to: {msg}");
        if got == "timeout" {
            assert!(t0.elapsed() < Duration::from_secs(10), "timeout took {:?}", t0.elapsed());
        }
        // Failed execs leave no checkpoint.
        assert_eq!(m.checkpoints(TENANT, &s.id).unwrap().last().unwrap().seq, good_seq);
        assert!(!m.is_resident(&s.id));
        // Previous state intact, partial effects gone; the session works.
        assert_eq!(value(&m, &s.id, probe), expect, "after {got}");
        // (The probe was itself a checkpoint: the next failure rolls back to it.)
        let after = m.checkpoints(TENANT, &s.id).unwrap().last().unwrap().seq;
        assert!(after > good_seq);
        good_seq = after;
    }
    // A failure in a resumed session rolls back too, then it goes on.
    m.evict(&s.id);
    let head_seq = m.checkpoints(TENANT, &s.id).unwrap().last().unwrap().seq;
    let (_, cp, _) = exec_failed(&m, &s.id, "x = 5\nimport os\nos._exit(1)");
    assert_eq!(cp, Some(head_seq));
    assert_eq!(value(&m, &s.id, "x += 1\nx"), "2");
    // And after a restart.
    drop(m);
    let m = open_default(home.path());
    assert_eq!(value(&m, &s.id, "(x, open('/tmp/f').read())"), "(2, 'good')");
}

// ---------------------------------------------------------------------------
// 7. Busy
// ---------------------------------------------------------------------------

#[test]
fn concurrent_exec_on_one_session_is_busy() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let other = new_session(&m);
    ok(&m, &s.id, "import time\nn = 0");
    ok(&m, &other.id, "v = 'other'");
    std::thread::scope(|scope| {
        let slow = scope.spawn(|| {
            let t0 = Instant::now();
            let r = m.exec(TENANT, &s.id, "time.sleep(1)\nn += 1\nn");
            (r, t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(250));
        let t0 = Instant::now();
        match m.exec(TENANT, &s.id, "n += 100") {
            Err(e @ SessionError::Busy(_)) => {
                assert_eq!(e.code(), "session_busy");
                assert!(e.to_string().contains("busy"), "{e}");
            }
            other => panic!("expected Busy, got {other:?}"),
        }
        let busy_after = t0.elapsed();
        // It waits out only the grace for short holds (200 ms), never the exec (1 s).
        assert!(busy_after < Duration::from_millis(700), "Busy took {busy_after:?} (it must not wait for the exec)");
        // Revert and delete of a busy session are refused too; other sessions run.
        assert!(matches!(m.revert(TENANT, &s.id, 1), Err(SessionError::Busy(_))));
        assert!(matches!(m.delete(TENANT, &s.id), Err(SessionError::Busy(_))));
        assert_eq!(value(&m, &other.id, "v"), "'other'");
        let (r, took) = slow.join().unwrap();
        let r = r.expect("the first exec completes");
        assert_eq!(r.result.value.as_deref(), Some("1"));
        assert!(took >= Duration::from_secs(1));
    });
    // The refused exec left no trace.
    assert_eq!(value(&m, &s.id, "n"), "1");
}

// ---------------------------------------------------------------------------
// 9. Scale: 1,000 sessions created, evicted, resumed
// ---------------------------------------------------------------------------

#[test]
fn thousand_sessions_created_evicted_resumed() {
    let n: usize = std::env::var("FORKBOX_TEST_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let resumes: usize = std::env::var("FORKBOX_TEST_RESUMES").ok().and_then(|v| v.parse().ok()).unwrap_or(n);
    let home = fresh_home();
    let m = open(home.path(), Config { max_resident: 64, ..Config::default() });
    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let s = new_session(&m);
        ok(&m, &s.id, &format!("v = {i} * 3 + 1"));
        assert!(m.evict(&s.id));
        ids.push(s.id);
    }
    let created = t0.elapsed();
    assert_eq!(m.resident_count(), 0);
    assert_eq!(m.list(TENANT, &[]).unwrap().len(), n);
    let (bytes, files) = dir_usage(&home.layers());
    eprintln!(
        "{n} sessions created + 1 exec + evicted in {:.1} s ({:.1} ms each); {} files, {:.1} MiB on disk ({:.0} KiB/session)",
        created.as_secs_f64(),
        created.as_secs_f64() * 1000.0 / n as f64,
        files,
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / 1024.0 / n as f64
    );

    // Resume in a scattered order.
    let t1 = Instant::now();
    let step = 7919 % n.max(1);
    let mut seen = BTreeSet::new();
    for k in 0..resumes {
        let i = if resumes == n { (k * step.max(1)) % n } else { k * n / resumes };
        if !seen.insert(i) {
            continue;
        }
        assert_eq!(value(&m, &ids[i], "v"), (i * 3 + 1).to_string(), "session {i}");
        assert!(m.resident_count() <= 64);
    }
    let resumed = t1.elapsed();
    eprintln!(
        "{} evicted sessions resumed + exec in {:.1} s ({:.1} ms each)",
        seen.len(),
        resumed.as_secs_f64(),
        resumed.as_secs_f64() * 1000.0 / seen.len().max(1) as f64
    );
    assert_eq!(seen.len(), resumes.min(n));
}

// ---------------------------------------------------------------------------
// 10. Delete frees disk
// ---------------------------------------------------------------------------

#[test]
fn delete_frees_disk_but_keeps_what_forks_need() {
    let home = fresh_home();
    let m = open(home.path(), Config { compact_after: 3, ..Config::default() });
    let layers = home.layers();

    let keep = new_session(&m);
    ok(&m, &keep.id, "k = 'kept'");
    let (base_bytes, base_files) = dir_usage(&layers);

    let a = new_session(&m);
    // ~4 MiB of incompressible data per exec: the layers are visibly large.
    ok(&m, &a.id, "import os\nb1 = os.urandom(4 << 20)\nopen('/tmp/a1', 'wb').write(b1[:1 << 20])");
    ok(&m, &a.id, "b2 = os.urandom(4 << 20)");
    ok(&m, &a.id, "b3 = os.urandom(4 << 20)");
    ok(&m, &a.id, "b4 = os.urandom(4 << 20)\nh = hash(b1) ^ hash(b2)");
    m.maintenance().expect("maintenance"); // compacts a's chain (compact_after = 3)
    let (with_a, _) = dir_usage(&layers);
    assert!(with_a - base_bytes > 12 << 20, "4 execs of 4 MiB each wrote only {} bytes", with_a - base_bytes);

    // A fork of a's checkpoint 2: a's checkpoints 1 and 2 must survive a's deletion.
    let b = m.fork(TENANT, &a.id, Some(2), BTreeMap::new()).unwrap();
    let expect_b =
        value(&m, &b.id, "(len(b1), len(b2), 'b3' in globals(), open('/tmp/a1', 'rb').read() == b1[:1 << 20])");
    assert_eq!(expect_b, "(4194304, 4194304, False, True)");
    m.maintenance().expect("maintenance");
    let flats = m.store().all_checkpoints().unwrap().iter().filter(|c| c.flat.is_some()).count();
    assert!(flats >= 1, "no compaction happened");
    let (with_ab, _) = dir_usage(&layers);

    m.delete(TENANT, &a.id).expect("delete a");
    assert!(matches!(m.exec(TENANT, &a.id, "1"), Err(SessionError::NotFound(_))));
    let (after_a, _) = dir_usage(&layers);
    eprintln!("layers: base {base_bytes} B; with a {with_a} B; with a+b {with_ab} B; after deleting a {after_a} B");
    // a's checkpoints 3 and 4 (>= 8 MiB) are gone; 1 and 2 (>= 8 MiB) are not.
    assert!(with_ab - after_a >= 8 << 20, "deleting a freed only {} bytes", with_ab - after_a);
    assert!(
        after_a - base_bytes >= 8 << 20,
        "a's checkpoints that b needs were removed ({} bytes left)",
        after_a - base_bytes
    );

    // b still works, from disk too, and after a restart.
    assert!(m.evict(&b.id));
    assert_eq!(
        value(&m, &b.id, "(len(b1), len(b2), 'b3' in globals(), open('/tmp/a1', 'rb').read() == b1[:1 << 20])"),
        expect_b
    );
    drop(m);
    let m = open(home.path(), Config { compact_after: 3, ..Config::default() });
    assert_eq!(value(&m, &b.id, "len(b1) + len(b2)"), "8388608");

    // Deleting b too leaves only `keep`'s files.
    m.delete(TENANT, &b.id).expect("delete b");
    let (after_b, files_b) = dir_usage(&layers);
    let keep_files: usize = m.store().all_checkpoints().unwrap().iter().map(|c| 2 + c.flat.is_some() as usize).sum();
    assert_eq!(files_b, keep_files, "files left: {:?}", file_names(&layers));
    assert!(
        after_b <= base_bytes + (1 << 20),
        "after deleting everything but `keep`: {after_b} B (base {base_bytes} B, {base_files} files)"
    );
    assert!(m.store().all_checkpoints().unwrap().iter().all(|c| c.session_id == keep.id));
    assert_eq!(value(&m, &keep.id, "k"), "'kept'");
    // Unknown session.
    assert!(matches!(m.delete(TENANT, &b.id), Err(SessionError::NotFound(_))));
}

// ---------------------------------------------------------------------------
// 11. Corruption
// ---------------------------------------------------------------------------

fn flip_byte(path: &std::path::Path, at_fraction: f64) {
    let mut data = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert!(!data.is_empty(), "{} is empty", path.display());
    let i = ((data.len() as f64 * at_fraction) as usize).min(data.len() - 1);
    data[i] ^= 0x5a;
    std::fs::write(path, &data).unwrap();
}

#[test]
fn corrupt_layer_gives_a_storage_error_and_spares_other_sessions() {
    let home = fresh_home();
    let m = open_default(home.path());
    let a = new_session(&m);
    let b = new_session(&m);
    ok(&m, &a.id, "x = 1\nopen('/tmp/f', 'w').write('a1')");
    let a2 = ok(&m, &a.id, "x = 2\ndata = list(range(50000))").checkpoint;
    ok(&m, &b.id, "y = 'b'\nopen('/tmp/f', 'w').write('b1')");
    assert!(m.evict(&a.id) && m.evict(&b.id));

    // Flip one byte in the middle of a's head layer.
    let layer = home.layers().join(&a2.layer);
    flip_byte(&layer, 0.5);
    for _ in 0..2 {
        match m.exec(TENANT, &a.id, "x") {
            Err(e) => {
                assert_eq!(e.code(), "storage_error", "corrupt layer reported as {:?}: {e}", e.code());
                eprintln!("corrupt layer -> {e}");
            }
            Ok(o) => panic!("exec on a corrupt layer succeeded: {:?}", o.result),
        }
    }
    // b is untouched (resumes from disk), and so is a's older checkpoint.
    assert_eq!(value(&m, &b.id, "(y, open('/tmp/f').read())"), "('b', 'b1')");
    m.revert(TENANT, &a.id, 1).unwrap();
    assert_eq!(value(&m, &a.id, "(x, open('/tmp/f').read(), 'data' in globals())"), "(1, 'a1', False)");

    // A restart does not make it worse: still clear errors, the good session still works.
    drop(m);
    let m = open_default(home.path());
    assert_eq!(value(&m, &a.id, "x"), "1");
    assert_eq!(value(&m, &b.id, "y"), "'b'");
    m.revert(TENANT, &a.id, 2).unwrap();
    assert_eq!(m.exec(TENANT, &a.id, "x").map(|_| ()).unwrap_err().code(), "storage_error");
}

#[test]
fn corrupt_state_file_gives_a_storage_error() {
    let home = fresh_home();
    let m = open_default(home.path());
    let a = new_session(&m);
    let b = new_session(&m);
    ok(&m, &a.id, "x = 1");
    let a2 = ok(&m, &a.id, "x = 2").checkpoint;
    ok(&m, &b.id, "y = 'b'");
    assert!(m.evict(&a.id) && m.evict(&b.id));
    flip_byte(&home.layers().join(&a2.state), 0.5);
    for _ in 0..2 {
        match m.exec(TENANT, &a.id, "x") {
            Err(e) => {
                eprintln!("corrupt state -> {e} (code {})", e.code());
                let names_file = e.to_string().contains(&a2.state);
                assert!(
                    e.code() == "storage_error" && names_file,
                    "a corrupt state file must be a storage_error naming the file; got code {:?}, message {:?}",
                    e.code(),
                    e.to_string()
                );
            }
            Ok(o) => panic!("exec on a corrupt state file succeeded: {:?}", o.result),
        }
    }
    assert_eq!(value(&m, &b.id, "y"), "'b'");
    m.revert(TENANT, &a.id, 1).unwrap();
    assert_eq!(value(&m, &a.id, "x"), "1");
}

// ---------------------------------------------------------------------------
// Extra: long chains with compaction, recovery, memory exhaustion, tenants
// ---------------------------------------------------------------------------

#[test]
fn long_chain_with_compaction_resumes_every_checkpoint() {
    let home = fresh_home();
    let m = open(home.path(), Config { compact_after: 3, ..Config::default() });
    let s = new_session(&m);
    let n = 16;
    let probe = |i: usize| -> (String, String) {
        // What checkpoint i (1-based) must contain.
        let vars: Vec<String> = (1..=i).map(|k| format!("v{k}")).collect();
        let code = format!(
            "(sorted((k for k in globals() if k.startswith('v') and k[1:].isdigit()), key=lambda k: int(k[1:])) == {vars:?}, acc, open('/tmp/log').read(), len(blob))"
        );
        let acc: usize = (1..=i).map(|k| k * k).sum();
        let log: String = (1..=i).map(|k| format!("{k};")).collect();
        (code, format!("(True, {acc}, '{log}', {})", i * 100_000))
    };
    for i in 1..=n {
        let init = if i == 1 { "acc = 0\nblob = b''\n" } else { "" };
        ok(
            &m,
            &s.id,
            &format!(
                "{init}v{i} = {i}\nacc += {i} * {i}\nopen('/tmp/log', 'a').write('{i};')\nblob += bytes([{i}]) * 100000"
            ),
        );
        // Compaction runs off the exec path (what a server does periodically).
        m.maintenance().expect("maintenance");
        assert!(m.evict(&s.id));
        let (code, want) = probe(i);
        // (The probe is a checkpoint too; revert to the exec's own so seqs stay simple.)
        assert_eq!(value(&m, &s.id, &code), want, "after exec {i}, resumed from disk");
        m.revert(TENANT, &s.id, (2 * i - 1) as i64).unwrap();
    }
    let flats = m.store().all_checkpoints().unwrap().iter().filter(|c| c.flat.is_some()).count();
    assert!(flats > 0, "no checkpoint was compacted with compact_after = 3");
    // Every exec's checkpoint, in a scattered order, after a restart.
    drop(m);
    let m = open(home.path(), Config { compact_after: 3, ..Config::default() });
    for i in [n, 1, 7, 3, 12, 2, 9, n - 1] {
        m.revert(TENANT, &s.id, (2 * i - 1) as i64).unwrap();
        let (code, want) = probe(i);
        assert_eq!(value(&m, &s.id, &code), want, "checkpoint of exec {i}");
    }
}

#[test]
fn recovery_rewinds_lost_files_and_removes_strays() {
    let home = fresh_home();
    let layers = home.layers();
    let (a, b, c2);
    {
        let m = open_default(home.path());
        a = new_session(&m).id;
        b = new_session(&m).id;
        ok(&m, &a, "x = 1\nopen('/tmp/f', 'w').write('1')");
        c2 = ok(&m, &a, "x = 2\nopen('/tmp/f', 'w').write('2')").checkpoint;
        ok(&m, &b, "y = 'b'");
    }
    // Outside damage: a's head layer is gone. Leftovers of a killed writer: temp and orphan files.
    std::fs::remove_file(layers.join(&c2.layer)).unwrap();
    std::fs::write(layers.join("c_deadbeefdeadbeef.tmp"), b"partial").unwrap();
    std::fs::write(layers.join("c_feedfacefeedface.layer"), b"renamed, never committed").unwrap();
    let m = open_default(home.path());
    let names = file_names(&layers);
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    assert!(!names.contains(&"c_feedfacefeedface.layer".to_string()), "{names:?}");
    assert!(!names.contains(&c2.state), "the state file of the dropped checkpoint is left: {names:?}");
    // a is back at checkpoint 1 and works; b is untouched.
    let head = m.get(TENANT, &a).unwrap().head.and_then(|h| m.store().checkpoint(h).unwrap()).map(|c| c.seq);
    assert_eq!(head, Some(1));
    assert_eq!(value(&m, &a, "(x, open('/tmp/f').read())"), "(1, '1')");
    let seq = m.checkpoints(TENANT, &a).unwrap().last().unwrap().seq;
    assert_eq!(seq, 3, "seq numbers are not reused after a rewind");
    assert_eq!(value(&m, &b, "y"), "'b'");
}

/// A wild write (the attack) is a crash reported with its address; the
/// session rolls back to its checkpoint and goes on. The page tables are part
/// of the checkpoint: a read-only mapping stays read-only after a resume.
#[test]
fn wild_write_crash_rolls_back_and_protections_survive_resume() {
    let home = fresh_home();
    let m = open_default(home.path());
    let limits = Limits { memory_bytes: 64 << 20, ..Limits::default() };
    let s = new_session_with(&m, &limits);
    ok(
        &m,
        &s.id,
        "import ctypes\nx = 1\nlibc = ctypes.CDLL(None)\nlibc.mmap.restype = ctypes.c_void_p\n\
         libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
         ro = libc.mmap(None, 4096, 3, 0x22, -1, 0)\nctypes.memset(ro, 0x41, 4096)\n\
         libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\nassert libc.mprotect(ro, 4096, 1) == 0",
    );
    let good = m.checkpoints(TENANT, &s.id).unwrap().last().unwrap().seq;
    let (code, cp, msg) = exec_failed(
        &m,
        &s.id,
        "import faulthandler\nfaulthandler.enable()\nx = 99\nctypes.memset(0x80000000, 0x5A, 1 << 30)",
    );
    assert_eq!(code, "guest_crashed", "{msg}");
    assert!(msg.contains("writing address 0x80000000") && msg.contains("SIGSEGV"), "{msg}");
    assert!(msg.contains("Fatal Python error"), "faulthandler's report is in the crash: {msg}");
    assert_eq!(cp, Some(good), "{msg}");
    assert_eq!(value(&m, &s.id, "(x, ctypes.string_at(ro, 2))"), "(1, b'AA')");
    // Resumed from its checkpoint (the crash dropped the VM): still read-only.
    for round in 0..2 {
        let (code, _, msg) = exec_failed(&m, &s.id, "ctypes.memset(ro, 0x42, 1)");
        assert_eq!(code, "guest_crashed", "round {round}: {msg}");
        assert!(msg.contains("writing address"), "{msg}");
        assert_eq!(value(&m, &s.id, "x += 1\n(x, ctypes.string_at(ro, 2))"), format!("({}, b'AA')", 2 + round));
        m.evict(&s.id);
    }
}

#[test]
fn memory_exhaustion_leaves_the_session_usable() {
    let home = fresh_home();
    let m = open_default(home.path());
    let limits = Limits { memory_bytes: 256 << 20, ..Limits::default() };
    let s = new_session_with(&m, &limits);
    ok(&m, &s.id, "x = 1\nopen('/tmp/f', 'w').write('good')");
    let code = "x = 99\nopen('/tmp/f', 'w').write('bad')\nhog = bytearray(1 << 30)";
    match m.exec(TENANT, &s.id, code) {
        // Either a Python MemoryError (a result: the session goes on from there)...
        Ok(o) => {
            let kind = o.result.error.as_ref().map(|e| e.kind.clone());
            assert_eq!(kind.as_deref(), Some("MemoryError"), "{:?}", o.result);
            assert_eq!(value(&m, &s.id, "(x, open('/tmp/f').read(), 'hog' in globals())"), "(99, 'bad', False)");
        }
        // ...or a failed exec rolled back to checkpoint 1.
        Err(SessionError::ExecFailed { checkpoint, source, .. }) => {
            assert_eq!(checkpoint, Some(1), "{source}");
            assert_eq!(value(&m, &s.id, "(x, open('/tmp/f').read())"), "(1, 'good')");
        }
        Err(e) => panic!("memory exhaustion gave an unexpected error: {e} ({e:?})"),
    }
    // Still usable, under its limit.
    assert_eq!(value(&m, &s.id, "small = bytearray(64 << 20)\nlen(small)"), (64u64 << 20).to_string());
}

#[test]
fn sessions_are_per_tenant() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = m.create("tenant-a", BTreeMap::new(), &Limits::default()).unwrap();
    m.exec("tenant-a", &s.id, "secret = 1").unwrap();
    assert!(matches!(m.exec("tenant-b", &s.id, "secret"), Err(SessionError::NotFound(_))));
    assert!(matches!(m.fork("tenant-b", &s.id, None, BTreeMap::new()), Err(SessionError::NotFound(_))));
    assert!(matches!(m.revert("tenant-b", &s.id, 1), Err(SessionError::NotFound(_))));
    assert!(matches!(m.delete("tenant-b", &s.id), Err(SessionError::NotFound(_))));
    assert!(matches!(m.checkpoints("tenant-b", &s.id), Err(SessionError::NotFound(_))));
    assert!(m.list("tenant-b", &[]).unwrap().is_empty());
    assert_eq!(m.list("tenant-a", &[]).unwrap().len(), 1);
    assert_eq!(m.exec("tenant-a", &s.id, "secret").unwrap().result.value.as_deref(), Some("1"));
}

/// Throwaway forks of a checkpoint (explore's dropped branches, inspections)
/// run on pooled VMs that go back to the template's pool: the checkpoint's
/// pages must never leak into the next plain fork of the template.
#[test]
fn throwaway_forks_leave_the_template_pristine() {
    let home = fresh_home();
    let m = open_default(home.path());
    let rec = new_session(&m);
    let cp = ok(&m, &rec.id, "secret = 'x' * 100_000 + 'end'\nimport json").checkpoint;
    let rec = m.get(TENANT, &rec.id).expect("record");
    let s = shared();
    let hits = || s.template.pool_stats().recycled_hits.load(std::sync::atomic::Ordering::Relaxed);
    let before = hits();
    for i in 0..6 {
        // Each one on this thread recycles its VM for the next fork here.
        let r = m
            .exec_throwaway(&rec, Some(cp.id), &format!("secret[-3:] + str({i})"), None, None)
            .expect("throwaway exec");
        assert_eq!(r.value.as_deref(), Some(format!("'end{i}'").as_str()), "{r:?}");
        let mut sb = s.template.fork(&s.engine, Limits::default()).expect("template fork");
        let plain = sb.exec("('secret' in globals(), 'json' in globals())").expect("exec in a template fork");
        assert_eq!(
            plain.value.as_deref(),
            Some("(False, False)"),
            "a template fork saw a checkpoint's state: {plain:?}"
        );
    }
    // Most of those forks ran on the VM the throwaway before them gave back (other tests share the pool).
    assert!(hits() - before >= 6, "throwaway VMs were not recycled: {} hits", hits() - before);
    // The session itself is untouched and continues.
    assert_eq!(value(&m, &rec.id, "len(secret)"), "100003");
}
