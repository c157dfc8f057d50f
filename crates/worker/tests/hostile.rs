//! The supervisor against a hostile worker: a fake worker (a Python script
//! speaking the protocol on fd 3, no jail) that floods streamed output or
//! sends an oversized frame. Each exec fails as `Crashed`, with a message that
//! carries no frame contents, and the slot gets a new worker. And a shutdown
//! that returns only once each worker has exited and been reaped. No KVM needed.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::os::unix::fs::PermissionsExt;

use forkbox_worker::{Config, TemplateRef, WorkerError, Workers};

const FAKE: &str = r#"#!/usr/bin/env python3
import base64, json, os, struct, sys
sock = os.fdopen(3, "r+b", buffering=0)
def read():
    n = struct.unpack("<I", sock.read(4))[0]
    return json.loads(sock.read(n))
def write(msg):
    b = json.dumps(msg).encode()
    sock.write(struct.pack("<I", len(b)) + b)
hello = read()
write({"Started": {"pid": os.getpid()}})
write("Ready")
while True:
    req = read()
    if "Exec" not in req:
        continue
    if hello["index"] == 0:
        chunk = base64.b64encode(b"x" * (128 << 10)).decode()
        for _ in range(40):
            write({"Output": {"stream": "stdout", "data": chunk}})
    else:
        sock.write(struct.pack("<I", 200 << 20) + b"{")
"#;

/// `n` workers that are the fake above (no jail), their data directory `dir`.
fn fake_workers(dir: &std::path::Path, n: usize) -> Workers {
    let exe = dir.join("fake-worker");
    std::fs::write(&exe, FAKE).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = Config::new(dir);
    config.exe = exe;
    config.jail = false;
    Workers::start(config, n, None).unwrap()
}

#[test]
fn a_worker_that_floods_or_sends_an_oversized_frame_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let workers = fake_workers(dir.path(), 2);
    let t = TemplateRef { image: "/x.img".into(), dir: "/t".into() };
    let limits = forkbox_engine::Limits::default();
    let mut got = 0usize;
    let mut sink = |_: forkbox_engine::Stream, b: &[u8]| got += b.len();
    match workers.exec(0, &t, "print(1)", &limits, Some(&mut sink)) {
        Err(WorkerError::Crashed(m)) => assert!(m.contains("streamed more than"), "{m}"),
        other => panic!("expected Crashed, got {other:?}"),
    }
    assert!(got <= 2 * limits.output_bytes + (64 << 10), "{got} bytes reached the sink");
    match workers.exec(1, &t, "print(1)", &limits, None) {
        Err(WorkerError::Crashed(m)) => {
            assert!(m.contains("over the") && m.len() < 200, "{m}")
        }
        other => panic!("expected Crashed, got {other:?}"),
    }
    // Both slots were given new workers (the same fake, answering again).
    let list = workers.list();
    assert!(list.iter().all(|w| w.restarts == 1), "{list:?}");
}

#[test]
fn shutdown_returns_once_every_worker_has_exited_and_been_reaped() {
    let dir = tempfile::tempdir().unwrap();
    let workers = fake_workers(dir.path(), 2);
    let pids: Vec<u32> = workers.list().iter().filter_map(|w| w.pid).collect();
    assert_eq!(pids.len(), 2, "{:?}", workers.list());
    for pid in &pids {
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "worker {pid} is not running");
    }
    workers.shutdown();
    // Gone, not a zombie waiting to be reaped (a zombie keeps its /proc entry).
    for pid in &pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "worker {pid} is still there");
    }
}
