//! Host memory bounds against hostile guests, measured as this process's RSS:
//! the tests run one at a time (a lock), alone in this binary, so that the
//! figure is theirs.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::sync::{Mutex, MutexGuard};

use forkbox_engine::{ExecOptions, Limits, Sandbox, Stream};
use forkbox_testkit::guest::{fork_with, ok};

/// One test at a time: RSS is per process.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[track_caller]
fn fork() -> Sandbox {
    fork_with(Limits::default())
}

/// Resident set of this (host) process, in bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn a_64_mib_raw_write_to_a_stream_is_capped_at_the_output_limit() {
    // The attack: one write(1, buf, 64 MiB) on a streamed exec.
    let _serial = serial();
    let limit = 1 << 20;
    let mut sb = fork_with(Limits { output_bytes: limit, ..Limits::default() });
    let before = rss();
    let mut streamed = 0usize;
    let mut chunks = 0usize;
    let mut sink = |_: Stream, d: &[u8]| {
        streamed += d.len();
        chunks += 1;
    };
    let code = "import ctypes\nlibc = ctypes.CDLL(None)\nbuf = ctypes.create_string_buffer(64 << 20)\n\
                libc.syscall(1, 1, ctypes.addressof(buf), 64 << 20)";
    let r = sb
        .exec_with(
            code,
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
        .unwrap();
    assert!(r.error.is_none(), "{:?}", r.error);
    let marker = forkbox_linux::kernel::state::STREAM_TRUNCATED.len();
    assert!(streamed <= limit + marker, "streamed {streamed} bytes past a {limit}-byte limit");
    assert!(r.stdout.len() <= limit + 200, "result stdout of {} bytes", r.stdout.len());
    assert!(r.stdout.contains("more bytes dropped"), "no truncation marker in the result");
    // The guest's own 64 MiB buffer is guest memory; the host side adds at most a few MiB.
    let grew = rss().saturating_sub(before);
    assert!(grew < 64 * (1 << 20) + 40 * (1 << 20), "host RSS grew by {} MiB", grew >> 20);
    // Another sandbox still runs.
    assert_eq!(ok(&mut fork(), "1 + 1").value.as_deref(), Some("2"));
}

#[test]
fn agent_channel_writes_past_the_frame_cap_are_a_protocol_error_without_buffering() {
    let _serial = serial();
    let mut sb = fork();
    let cap = forkbox_linux::kernel::state::agent_frame_limit(Limits::default().output_bytes) as u64;
    let before = rss();
    // Four 128 MiB writes to the agent's fd (3) from user code.
    let code = "import os\nb = bytes(128 << 20)\nfor _ in range(4):\n    os.write(3, b)";
    let e = sb.exec(code).unwrap_err();
    assert_eq!(e.code(), "protocol_error", "{e}");
    let grew = rss().saturating_sub(before);
    // 128 MiB of guest memory for `b`, and nothing of the 512 MiB written.
    assert!(grew < (128 << 20) + cap + (48 << 20), "host RSS grew by {} MiB", grew >> 20);
    assert!(!sb.is_usable());
    assert_eq!(ok(&mut fork(), "1 + 1").value.as_deref(), Some("2"));
}
