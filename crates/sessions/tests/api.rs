//! The session API the HTTP server, REPL and MCP build on: files uploaded and
//! read host-side (across eviction, resume and forks), streamed execs,
//! interrupts of a running exec from another thread, disk usage per tenant.
//!
//! Need /dev/kvm (they FAIL without it, never skip). See `common/mod.rs`.

mod common;

use common::*;
use forkbox_engine::{ExecOptions, Limits, Stream};
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
        .exec_with(TENANT, &s.id, "for i in range(3): print(i)", ExecOptions { on_output: Some(&mut sink), interrupt: None })
        .unwrap();
    assert_eq!(chunks, [(Stream::Stdout, "0\n".into()), (Stream::Stdout, "1\n".into()), (Stream::Stdout, "2\n".into())]);
    assert_eq!(out.result.stdout, "0\n1\n2\n");
    assert_eq!(out.checkpoint.seq, 1);
    let bytes = m.disk_bytes(TENANT).unwrap();
    assert!(bytes > 0 && bytes == out.checkpoint.bytes, "{bytes} vs {}", out.checkpoint.bytes);
    let s2 = new_session(&m);
    let out2 = ok(&m, &s2.id, "y = 2");
    assert_eq!(m.disk_bytes(TENANT).unwrap(), bytes + out2.checkpoint.bytes);
    assert_eq!(m.disk_bytes("nobody").unwrap(), 0);
}
