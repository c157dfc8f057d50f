//! The session API the HTTP server, REPL and MCP build on: files uploaded and
//! read host-side (across eviction, resume and forks), streamed execs,
//! interrupts of a running exec from another thread, disk usage per tenant.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::time::{Duration, Instant};

use common::*;
use forkbox_engine::{ExecOptions, FileOp, FileOpOutcome, Limits, Stream};
use forkbox_sessions::manager::SessionError;

#[test]
fn uploaded_files_are_checkpointed_and_survive_eviction_and_forks() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    ok(&m, &s.id, "x = 1");
    let c = m.write_file(TENANT, &s.id, "/data/input.csv", b"a,b\n1,2\n").expect("upload");
    assert_eq!(c.seq, 2);
    assert_eq!(c.code, "# upload /data/input.csv");
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, Some(c.id));
    assert_eq!(value(&m, &s.id, "open('/data/input.csv').read()"), "'a,b\\n1,2\\n'");
    // Evicted: the upload comes back from the checkpoint, for Python and for read_file.
    assert!(m.evict(&s.id));
    assert_eq!(m.read_file(TENANT, &s.id, "/data/input.csv", 1 << 20).unwrap(), b"a,b\n1,2\n");
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "open('/data/input.csv').read().count(',')"), "2");
    // Python writes, the host reads and lists (after an eviction too).
    ok(&m, &s.id, "import os\nos.makedirs('/output', exist_ok=True)\nopen('/output/r.txt', 'w').write('result')");
    assert!(m.evict(&s.id));
    let list = m.list_files(TENANT, &s.id, "/output").unwrap();
    assert_eq!(list.iter().map(|e| (e.name.as_str(), e.size)).collect::<Vec<_>>(), [("r.txt", 6)]);
    assert_eq!(m.read_file(TENANT, &s.id, "/output/r.txt", 100).unwrap(), b"result");
    // A fork sees the files of the checkpoint it starts from; its own uploads stay its own.
    let f = m.fork(TENANT, &s.id, None, Default::default()).unwrap();
    assert_eq!(m.read_file(TENANT, &f.id, "/data/input.csv", 100).unwrap(), b"a,b\n1,2\n");
    m.write_file(TENANT, &f.id, "/data/input.csv", b"forked").unwrap();
    assert_eq!(value(&m, &f.id, "open('/data/input.csv').read(), x"), "('forked', 1)");
    assert_eq!(m.read_file(TENANT, &s.id, "/data/input.csv", 100).unwrap(), b"a,b\n1,2\n");
    // Reverting to before the upload removes the file.
    m.revert(TENANT, &s.id, 1).unwrap();
    assert_eq!(m.read_file(TENANT, &s.id, "/data/input.csv", 100).unwrap_err().code(), "file_not_found");
}

#[test]
fn file_operations_from_outside_checkpoint_only_what_they_change() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    // The guest's own names play no part: a shadowed `os` does not change what the host sees.
    ok(&m, &s.id, "import os\nos.makedirs('/work/src')\nopen('/work/src/a.py', 'w').write('x = 1')\nos = None");
    let seqs = |m: &forkbox_sessions::manager::SessionManager| m.checkpoints(TENANT, &s.id).unwrap().len();
    let n = seqs(&m);
    let (out, c) = m.file_op(TENANT, &s.id, &FileOp::Walk { path: "/work".into(), depth: 2 }).unwrap();
    let FileOpOutcome::Entries(es) = out else { panic!("{out:?}") };
    assert_eq!(es.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(), ["/work/src", "/work/src/a.py"]);
    assert!(c.is_none());
    let (out, _) = m.file_op(TENANT, &s.id, &FileOp::Stat { path: "/work/src/a.py".into() }).unwrap();
    assert!(matches!(out, FileOpOutcome::Entry(ref e) if e.size == 5), "{out:?}");
    assert_eq!(seqs(&m), n, "reading made no checkpoint");
    // A change is a checkpoint, kept across eviction and visible to the guest.
    let (_, c) = m.file_op(TENANT, &s.id, &FileOp::Move { from: "/work/src".into(), to: "/work/lib".into() }).unwrap();
    assert_eq!(c.expect("a checkpoint").code, "# files: move /work/src /work/lib");
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "open('/work/lib/a.py').read()"), "'x = 1'");
    m.file_op(TENANT, &s.id, &FileOp::Remove { path: "/work".into() }).unwrap();
    assert_eq!(value(&m, &s.id, "__import__('os').path.exists('/work')"), "False");
    let e = m.file_op(TENANT, &s.id, &FileOp::MakeDir { path: "/tmp".into() }).unwrap_err();
    assert_eq!(e.code(), "file_exists");
    assert_eq!(
        m.file_op("other-tenant", &s.id, &FileOp::Stat { path: "/".into() }).unwrap_err().code(),
        "session_not_found"
    );
}

#[test]
fn file_errors_carry_their_codes() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session_with(&m, &Limits { disk_bytes: 1 << 20, ..Limits::default() });
    let code = |e: SessionError| e.code();
    assert_eq!(code(m.write_file(TENANT, &s.id, "../../etc/x", b"1").unwrap_err()), "invalid_path");
    assert_eq!(code(m.write_file(TENANT, &s.id, "/tmp/a\0b", b"1").unwrap_err()), "invalid_path");
    assert_eq!(code(m.write_file(TENANT, &s.id, "/tmp/big", &vec![0u8; 10 << 20]).unwrap_err()), "quota_exceeded");
    assert_eq!(code(m.read_file(TENANT, &s.id, "/nope", 10).unwrap_err()), "file_not_found");
    assert_eq!(code(m.read_file(TENANT, &s.id, "/tmp", 10).unwrap_err()), "is_a_directory");
    m.write_file(TENANT, &s.id, "/tmp/ten", b"0123456789").unwrap();
    assert_eq!(code(m.read_file(TENANT, &s.id, "/tmp/ten", 5).unwrap_err()), "file_too_large");
    assert_eq!(code(m.read_file(TENANT, "s_nope", "/tmp/ten", 5).unwrap_err()), "session_not_found");
    assert_eq!(code(m.read_file("other-tenant", &s.id, "/tmp/ten", 50).unwrap_err()), "session_not_found");
    // Nothing refused reached a checkpoint; the session works.
    let codes: Vec<String> = m.checkpoints(TENANT, &s.id).unwrap().into_iter().map(|c| c.code).collect();
    assert_eq!(codes, ["# upload /tmp/ten"]);
    assert_eq!(value(&m, &s.id, "open('/tmp/ten').read()"), "'0123456789'");
}

#[test]
fn streamed_session_exec_and_disk_bytes() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let mut chunks = Vec::new();
    let mut sink = |st: Stream, d: &[u8]| chunks.push((st, String::from_utf8_lossy(d).into_owned()));
    let out = m
        .exec_with(
            TENANT,
            &s.id,
            "for i in range(3): print(i)",
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
        .unwrap();
    assert_eq!(
        chunks,
        [(Stream::Stdout, "0\n".into()), (Stream::Stdout, "1\n".into()), (Stream::Stdout, "2\n".into())]
    );
    assert_eq!(out.result.stdout, "0\n1\n2\n");
    assert_eq!(out.checkpoint.seq, 1);
    // The checkpoint's files and the call's kept output are charged.
    let bytes = m.disk_bytes(TENANT).unwrap();
    assert!(out.checkpoint.output_bytes > 0);
    let charged = out.checkpoint.bytes + out.checkpoint.output_bytes;
    assert!(bytes > 0 && bytes == charged, "{bytes} vs {charged}");
    let s2 = new_session(&m);
    let out2 = ok(&m, &s2.id, "y = 2");
    assert_eq!(m.disk_bytes(TENANT).unwrap(), bytes + out2.checkpoint.bytes + out2.checkpoint.output_bytes);
    assert_eq!(m.disk_bytes("nobody").unwrap(), 0);
}

/// Run `code` in a session on another thread and interrupt it through the manager after `after`.
fn interrupted_exec(
    m: &forkbox_sessions::manager::SessionManager,
    id: &str,
    code: &str,
    after: Duration,
) -> (Result<forkbox_sessions::manager::ExecOutcome, SessionError>, Duration) {
    std::thread::scope(|sc| {
        let h = sc.spawn(|| m.exec(TENANT, id, code));
        std::thread::sleep(after);
        // While the exec holds the busy lock, interrupt still reaches it.
        assert_eq!(m.exec(TENANT, id, "1").unwrap_err().code(), "session_busy");
        let t = Instant::now();
        assert!(m.interrupt(TENANT, id).unwrap(), "an exec was running");
        let r = h.join().unwrap();
        (r, t.elapsed())
    })
}

#[test]
fn interrupt_reaches_a_running_exec_and_the_session_goes_on() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    assert!(!m.interrupt(TENANT, &s.id).unwrap(), "nothing runs");
    assert_eq!(m.interrupt("other", &s.id).unwrap_err().code(), "session_not_found");
    ok(&m, &s.id, "kept = 'before'");
    for code in ["while True: pass", "import time\ntime.sleep(100)"] {
        let (r, took) = interrupted_exec(&m, &s.id, code, Duration::from_millis(500));
        let out = r.expect("interrupted exec is a result");
        assert_eq!(out.result.error.as_ref().map(|e| e.kind.as_str()), Some("KeyboardInterrupt"), "{code}");
        assert!(took < Duration::from_secs(1), "{code}: {took:?}");
        assert_eq!(out.checkpoint.code, code, "the interrupted exec was checkpointed");
        assert_eq!(value(&m, &s.id, "kept"), "'before'");
    }
    assert!(!m.interrupt(TENANT, &s.id).unwrap(), "nothing runs any more");
    // Survives eviction after an interrupt.
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "kept + '!'"), "'before!'");
}

#[test]
fn an_exec_that_swallows_the_interrupt_is_killed_and_rolled_back() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    let c = ok(&m, &s.id, "kept = 5").checkpoint;
    let code = "kept = 6\ndef spin():\n    while True: pass\nwhile True:\n    try:\n        spin()\n    except KeyboardInterrupt:\n        kept += 1";
    let (r, took) = interrupted_exec(&m, &s.id, code, Duration::from_millis(400));
    match r {
        Err(e @ SessionError::ExecFailed { checkpoint: Some(1), .. }) => assert_eq!(e.code(), "interrupted"),
        other => panic!("expected an interrupted ExecFailed, got {other:?}"),
    }
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(4), "{took:?}");
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, Some(c.id));
    assert_eq!(value(&m, &s.id, "kept"), "5", "rolled back to the last checkpoint");
}

#[test]
fn interrupting_an_exec_as_its_session_resumes_from_disk() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session_with(&m, &Limits { timeout: Duration::from_secs(10), ..Limits::default() });
    ok(&m, &s.id, "kept = 'x' * 3\nbig = list(range(200000))");
    for _ in 0..3 {
        assert!(m.evict(&s.id));
        let t0 = Instant::now();
        let r = std::thread::scope(|sc| {
            let h = sc.spawn(|| m.exec(TENANT, &s.id, "while True: pass"));
            // The first interrupt that counts lands while the session is still
            // being resumed from disk (or just after): it must not be lost.
            while !m.interrupt(TENANT, &s.id).unwrap() {
                std::thread::yield_now();
            }
            h.join().unwrap()
        });
        let out = r.expect("result");
        assert_eq!(out.result.error.as_ref().map(|e| e.kind.as_str()), Some("KeyboardInterrupt"));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(value(&m, &s.id, "kept, len(big)"), "('xxx', 200000)");
    }
}
