//! The guest-thread seccomp filter (`forkbox_engine::jail`) on real KVM guests:
//! a thread that installed it runs forks and execs, shows `Seccomp: 2` and
//! `NoNewPrivs: 1` in /proc, and a guest action that makes the VMM call a host
//! syscall outside the allow-list (the test-only hook
//! `forkbox_linux::syscalls::test_hooks`, compiled only into test builds) kills
//! the process with SIGSYS — checked in a child process (this test binary run
//! again), beside the same child in `eperm` and `off` modes, where it lives.
//!
//! Needs /dev/kvm (fails loudly without it).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use forkbox_engine::jail::{self, Mode};
use forkbox_engine::{Engine, Limits, Template};
use forkbox_linux::syscalls::test_hooks::FORBIDDEN_HOST_SYSCALL;

struct Shared {
    engine: Engine,
    template: Template,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        forkbox_testkit::require_kvm();
        let home = match std::env::var("FORKBOX_HOME") {
            Ok(h) if !h.is_empty() => PathBuf::from(h),
            _ => forkbox_image::default_home(),
        };
        let image = forkbox_testkit::image_path();
        let engine = Engine::open(&image).unwrap_or_else(|e| panic!("Engine::open({}): {e}", image.display()));
        let template = Template::ensure(&engine, &home).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
        Shared { engine, template }
    })
}

fn status_field(path: &str, field: &str) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    s.lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_string()))
        .unwrap_or_else(|| panic!("no {field} in {path}"))
}

fn my_tid() -> String {
    // "/proc/thread-self" -> "<pid>/task/<tid>"
    let link = std::fs::read_link("/proc/thread-self").unwrap();
    link.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
fn a_guest_thread_runs_sandboxes_under_the_filter() {
    let s = shared();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        jail::enter_guest_thread(Mode::Enforce).expect("installing the filter");
        assert_eq!(jail::current(), Some(Mode::Enforce));
        assert!(jail::is_filtered());
        // Forks, execs on recycled and new VMs, numpy, files in the overlay, a thread in the guest.
        for i in 0..20 {
            let mut sb = s.template.fork(&s.engine, Limits::default()).expect("fork under the filter");
            let r = sb.exec(&format!("print({i}*2)")).expect("exec under the filter");
            assert_eq!(r.stdout, format!("{}\n", i * 2));
        }
        let mut sb = s.template.fork(&s.engine, Limits::default()).unwrap();
        let code = "import numpy, threading, os\nopen('/tmp/x','w').write('y'*100000)\n\
                    t = threading.Thread(target=lambda: None); t.start(); t.join()\n\
                    print(int(numpy.arange(10).sum()), os.path.getsize('/tmp/x'))";
        let r = sb.exec(code).expect("exec under the filter");
        assert_eq!(r.stdout, "45 100000\n", "{r:?}");
        // Guest processes sharing memory (a memfd per shared object) under the filter.
        let r = sb
            .exec("import multiprocessing\nwith multiprocessing.Pool(2) as p: print(p.map(abs, [-1, -2, -3]))")
            .expect("a Pool under the filter");
        assert_eq!(r.stdout, "[1, 2, 3]\n", "{r:?}");
        // A template made of a sandbox's state (what a template from a checkpoint
        // does, on an exec thread): its memory writer's mincore is allowed.
        sb.exec("kept = 41").expect("exec under the filter");
        let dir = tempfile::tempdir().unwrap();
        let made = s
            .template
            .snapshot_sandbox(&s.engine, &sb, &dir.path().join("t"), "seccomp-made", "kept = 41")
            .expect("a template made under the filter");
        let mut f = made.fork(&s.engine, Limits::default()).expect("a fork of it under the filter");
        assert_eq!(f.exec("print(kept + 1)").expect("exec in the fork").stdout, "42\n");
        drop(f);
        tid_tx.send(my_tid()).unwrap();
        go_rx.recv().unwrap();
        // Still alive after being looked at; a second install is a no-op.
        jail::enter_guest_thread(Mode::Enforce).unwrap();
        assert_eq!(sb.exec("print('still')").unwrap().stdout, "still\n");
    });
    let tid = tid_rx.recv().expect("the guest thread died");
    let path = format!("/proc/self/task/{tid}/status");
    assert_eq!(status_field(&path, "Seccomp:"), "2", "{path}");
    assert_eq!(status_field(&path, "NoNewPrivs:"), "1", "{path}");
    // Per thread: this (test) thread has none.
    assert_eq!(status_field("/proc/thread-self/status", "Seccomp:"), "0");
    assert!(!jail::is_filtered());
    go_tx.send(()).unwrap();
    t.join().expect("the guest thread panicked");
}

/// The child side of `a_forbidden_host_syscall_made_by_the_vmm_kills_the_process`
/// (does nothing unless FORKBOX_SECCOMP_CHILD is set).
#[test]
fn seccomp_child() {
    if std::env::var_os("FORKBOX_SECCOMP_CHILD").is_none() {
        return;
    }
    let s = shared();
    let mode = Mode::from_env().unwrap();
    std::thread::spawn(move || {
        jail::enter_guest_thread(mode).unwrap();
        let mut sb = s.template.fork(&s.engine, Limits::default()).unwrap();
        assert_eq!(sb.exec("print(1+1)").unwrap().stdout, "2\n");
        println!("child: guest ran under {mode:?}");
        let code = format!(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.syscall(ctypes.c_long({FORBIDDEN_HOST_SYSCALL}))\n\
             print('survived', r, ctypes.get_errno())"
        );
        let r = sb.exec(&code).unwrap();
        println!("child: {}", r.stdout.trim());
    })
    .join()
    .unwrap();
}

fn run_child(mode: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "seccomp_child", "--nocapture", "--test-threads", "1"])
        .env("FORKBOX_SECCOMP_CHILD", "1")
        .env("FORKBOX_SECCOMP", mode)
        .env("FORKBOX_TEST_HOOKS", "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status, text)
}

#[test]
fn a_forbidden_host_syscall_made_by_the_vmm_kills_the_process() {
    shared(); // the image and template exist before the children start
    let (st, out) = run_child("enforce");
    assert_eq!(st.signal(), Some(libc::SIGSYS), "enforce: {st:?}\n{out}");
    assert!(out.contains("child: guest ran under Enforce"), "the guest ran before the forbidden call:\n{out}");
    assert!(!out.contains("survived"), "{out}");

    // Learning mode: the same call fails with EPERM and everything goes on.
    let (st, out) = run_child("eperm");
    assert!(st.success(), "eperm: {st:?}\n{out}");
    assert!(out.contains(&format!("child: survived -1 {}", libc::EPERM)), "{out}");

    // Without the filter the hook's host call succeeds (the persona, >= 0): what kills is the filter.
    let (st, out) = run_child("off");
    assert!(st.success(), "off: {st:?}\n{out}");
    let line = out.lines().find(|l| l.starts_with("child: survived")).unwrap_or_else(|| panic!("{out}"));
    let r: i64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(r >= 0, "{line}");
}

/// A server and its clients inside the sandbox under the filter: the VMM's
/// AF_UNIX socketpairs behind them are allowed (before they were, the first
/// in-sandbox connect killed the process with SIGSYS, taking this test with it).
#[test]
fn loopback_servers_inside_the_sandbox_run_under_the_filter() {
    let s = shared();
    std::thread::spawn(move || {
        jail::enter_guest_thread(Mode::Enforce).expect("installing the filter");
        let mut sb = s.template.fork(&s.engine, Limits::default()).unwrap();
        let code = "import socket, select\nL = socket.socket(); L.bind(('127.0.0.1', 0)); L.listen()\n\
                    c = socket.create_connection(L.getsockname())\nselect.select([L], [], [], 5)\ns, _ = L.accept()\n\
                    c.sendall(b'jailed'); print(s.recv(6).decode())";
        let r = sb.exec(code).expect("exec under the filter");
        assert_eq!(r.stdout, "jailed\n", "{r:?}");
    })
    .join()
    .expect("the guest thread panicked");
}
