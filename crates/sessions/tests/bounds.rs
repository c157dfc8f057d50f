//! Disk bounds of sessions, against real guests: a checkpoint's file-system
//! part is incremental (its cost follows what the exec changed), a tenant's
//! disk quota is charged with the checkpoint's size before anything is
//! written, a full disk (below the reserve) refuses the writer cleanly, and a
//! failed checkpoint leaves no file behind.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use common::*;
use forkbox_sessions::manager::{Config, SessionError};

const MIB: u64 = 1 << 20;

fn tmp_files(home: &TestHome) -> Vec<String> {
    file_names(&home.layers()).into_iter().filter(|n| n.ends_with(".tmp")).collect()
}

#[test]
fn a_checkpoint_writes_only_the_file_chunks_an_exec_changed() {
    let home = fresh_home();
    let m = open_default(home.path());
    let s = new_session(&m);
    // One 50 MiB file (not compressible): the first checkpoint stores it.
    let c1 = ok(&m, &s.id, "import os, hashlib\nopen('/tmp/big', 'wb').write(os.urandom(50 << 20))").checkpoint;
    assert!(c1.bytes > 50 * MIB, "first checkpoint {} bytes", c1.bytes);
    let (disk1, _) = dir_usage(&home.layers());
    // Later execs that do not touch it write a few hundred KiB at most (was ~52 MB each).
    for _ in 0..3 {
        let c = ok(&m, &s.id, "1").checkpoint;
        assert!(c.bytes < MIB, "a `1` exec wrote a {}-byte checkpoint", c.bytes);
    }
    let (disk2, _) = dir_usage(&home.layers());
    assert!(disk2 - disk1 < 3 * MIB, "three `1` execs took {} bytes on disk", disk2 - disk1);
    let digest = value(&m, &s.id, "hashlib.sha256(open('/tmp/big', 'rb').read()).hexdigest()");
    // Appending one byte writes one chunk, not the file.
    let c = ok(&m, &s.id, "open('/tmp/big', 'ab').write(b'!')").checkpoint;
    assert!(c.bytes < 2 * MIB, "appending a byte wrote {} bytes", c.bytes);
    // Changing one byte in the middle: one chunk too.
    let c = ok(&m, &s.id, "f = open('/tmp/big', 'r+b'); f.seek(25 << 20); f.write(b'?'); f.close()").checkpoint;
    assert!(c.bytes < 2 * MIB, "changing a byte wrote {} bytes", c.bytes);
    let expect = value(&m, &s.id, "hashlib.sha256(open('/tmp/big', 'rb').read()).hexdigest()");
    assert_ne!(expect, digest);
    // From disk (chunks of several checkpoints' packs), after eviction and in a fork.
    assert!(m.evict(&s.id));
    assert_eq!(value(&m, &s.id, "hashlib.sha256(open('/tmp/big', 'rb').read()).hexdigest()"), expect);
    let c = ok(&m, &s.id, "2").checkpoint;
    assert!(c.bytes < MIB, "after a resume a `2` exec wrote {} bytes", c.bytes);
    let f = m.fork(TENANT, &s.id, None, Default::default()).unwrap();
    assert_eq!(value(&m, &f.id, "import hashlib\nhashlib.sha256(open('/tmp/big', 'rb').read()).hexdigest()"), expect);
    // Reverting to before the append brings the older bytes back.
    m.revert(TENANT, &s.id, 4).unwrap();
    assert_eq!(value(&m, &s.id, "hashlib.sha256(open('/tmp/big', 'rb').read()).hexdigest()"), digest);
    // Deleting the sessions removes every pack.
    m.delete(TENANT, &s.id).unwrap();
    m.delete(TENANT, &f.id).unwrap();
    assert_eq!(file_names(&home.layers()), Vec::<String>::new());
}

#[test]
fn a_checkpoint_over_the_tenant_quota_is_refused_before_it_is_written() {
    let home = fresh_home();
    let m = open_default(home.path());
    m.set_disk_quota(TENANT, Some(50 * MIB));
    let s = new_session(&m);
    let c1 = ok(&m, &s.id, "x = 41").checkpoint;
    let before = file_names(&home.layers());
    let (disk_before, _) = dir_usage(&home.layers());
    // The attack: one exec that would make a 257 MiB checkpoint under a 50 MiB quota.
    let code = "import os\nopen('/tmp/big', 'wb').write(os.urandom(1 << 20) * 257)\nprint('written')\nx = 42\nx";
    match m.exec(TENANT, &s.id, code) {
        Err(e @ SessionError::QuotaExceeded { .. }) => {
            assert_eq!(e.code(), "quota_exceeded");
            let SessionError::QuotaExceeded { result, checkpoint, .. } = e else { unreachable!() };
            let r = result.expect("the exec's result comes back with the error");
            assert_eq!(r.stdout, "written\n");
            assert_eq!(r.value.as_deref(), Some("42"));
            assert_eq!(checkpoint, Some(c1.seq));
        }
        other => panic!("expected quota_exceeded, got {other:?}"),
    }
    // Nothing was written (no temp file either), the session is at its previous checkpoint.
    assert_eq!(file_names(&home.layers()), before);
    let (disk_after, _) = dir_usage(&home.layers());
    assert_eq!(disk_after, disk_before);
    assert!(m.disk_bytes(TENANT).unwrap() < 50 * MIB);
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, Some(c1.id));
    assert_eq!(value(&m, &s.id, "import os\n(x, os.path.exists('/tmp/big'))"), "(41, False)");
    // Small checkpoints still fit.
    ok(&m, &s.id, "y = 1");
    // Without the quota the same exec is checkpointed.
    m.set_disk_quota(TENANT, None);
    let c = ok(&m, &s.id, code).checkpoint;
    assert!(c.bytes > 257 * MIB);
}

#[test]
fn concurrent_checkpoints_of_one_tenant_cannot_pass_its_quota_together() {
    let home = fresh_home();
    let m = std::sync::Arc::new(open_default(home.path()));
    let code = "import os\nopen('/tmp/f', 'wb').write(os.urandom(25 << 20))";
    // What one such checkpoint takes, measured; the quota fits one and a half.
    let probe = new_session(&m);
    let one = ok(&m, &probe.id, code).checkpoint.bytes;
    let used = m.disk_bytes(TENANT).unwrap();
    let quota = used + one * 3 / 2;
    m.set_disk_quota(TENANT, Some(quota));
    let a = new_session(&m);
    let b = new_session(&m);
    let results: Vec<Result<(), String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = [&a.id, &b.id]
            .into_iter()
            .map(|id| {
                let m = m.clone();
                sc.spawn(move || m.exec(TENANT, id, code).map(|_| ()).map_err(|e| e.code().to_string()))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused = results.iter().filter(|r| r.as_ref().err().map(String::as_str) == Some("quota_exceeded")).count();
    assert_eq!(refused, 1, "{results:?}");
    assert!(m.disk_bytes(TENANT).unwrap() <= quota);
}

#[test]
fn below_the_disk_reserve_the_writer_gets_insufficient_storage_and_deletes_work() {
    let home = fresh_home();
    let m = open(home.path(), Config { disk_reserve: u64::MAX / 4, ..Config::default() });
    let s = new_session(&m);
    match m.exec(TENANT, &s.id, "x = 1") {
        Err(e) => assert_eq!(e.code(), "insufficient_storage", "{e}"),
        Ok(o) => panic!("checkpointed on a 'full' disk: {:?}", o.checkpoint),
    }
    // No file, no temp file left; the session is where it was; deleting works.
    assert_eq!(file_names(&home.layers()), Vec::<String>::new());
    assert!(tmp_files(&home).is_empty());
    assert_eq!(m.get(TENANT, &s.id).unwrap().head, None);
    m.delete(TENANT, &s.id).unwrap();
    assert!(m.list(TENANT, &[]).unwrap().is_empty());
}
