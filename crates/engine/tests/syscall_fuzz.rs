//! A guest-side syscall fuzzer: a Python program in the
//! sandbox issues random system calls through ctypes' `syscall()` — every
//! number in the syscall table, numbers beyond it (up to 1100, x32 and huge or
//! negative numbers), with random and adversarial arguments: wild pointers
//! (NULL, the system area with the GDT/IDT/stubs/page tables, the vDSO, the
//! page-table pool, non-canonical and kernel-half addresses), pointers to
//! valid buffers full of garbage (or of wild pointers and lengths, or of
//! paths), pointers that straddle the end of a buffer, read-only code pages,
//! huge and overflowing lengths, bad and negative fds, random flags.
//!
//! Every seed is a fixed number: a run is reproducible. Each seed runs in
//! chunks; a chunk is one exec in a fresh fork of the template. Asserted for
//! every chunk (the test thread runs under the enforcing guest-thread seccomp
//! filter, as the server's exec threads: a host syscall outside its allow-list
//! that a guest provokes kills the test with SIGSYS):
//! - the VMM never panics (a panic is caught, the seed and chunk printed, the
//!   chunk replayed with each call logged to find the syscall);
//! - the sandbox either survives or ends with a clean guest-level error
//!   (crash, signal, exit, timeout, deadlock, protocol error), never a host
//!   error (`Vmm`, `Load`, `Image`, `Snapshot`);
//! - the VFS invariant check passes afterwards (`Sandbox::check_invariants`);
//! - another sandbox, live through the whole run, still runs code.
//!
//! Excluded because they would end the fuzzer itself rather than test the
//! VMM: `exit` (60) and `exit_group` (231). `kill`, `tkill`, `tgkill`,
//! `rt_sigqueueinfo`, `rt_tgsigqueueinfo` and `pidfd_send_signal` are issued
//! with random pids but the signal argument is replaced by 0 or one whose
//! default action is to ignore it (a fatal signal to self would end every
//! chunk at once). `rt_sigreturn` with garbage is kept: it must crash cleanly.
//!
//! CI: `FUZZ_SEEDS` seeds x `FUZZ_CHUNKS` chunks x `FUZZ_CALLS` calls (see the
//! defaults below, well under a minute here). A longer run:
//! `FORKBOX_FUZZ_SEEDS=50 FORKBOX_FUZZ_CHUNKS=40 cargo test --release -p forkbox-engine --test syscall_fuzz -- --nocapture`
//! (`FORKBOX_FUZZ_FIRST_SEED=<n>` starts elsewhere, `FORKBOX_FUZZ_SEED=<n>` replays one seed).
//!
//! Needs /dev/kvm (fails loudly without it).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, EngineError, ExecOptions, Limits, Sandbox, Stream, Template};
use forkbox_testkit::syscall_fuzz::env_num;

struct Shared {
    engine: Engine,
    template: Template,
}

fn home() -> PathBuf {
    match std::env::var("FORKBOX_HOME") {
        Ok(h) if !h.is_empty() => PathBuf::from(h),
        _ => forkbox_image::default_home(),
    }
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        forkbox_testkit::require_kvm();
        let image = forkbox_testkit::image_path();
        let engine = Engine::open(&image).unwrap_or_else(|e| panic!("Engine::open({}): {e}", image.display()));
        let template = Template::ensure(&engine, &home()).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
        Shared { engine, template }
    })
}

fn limits() -> Limits {
    Limits {
        memory_bytes: 512 << 20,
        timeout: Duration::from_secs(1),
        output_bytes: 64 << 10,
        disk_bytes: 64 << 20,
        ..Limits::default()
    }
}

#[derive(Default, Debug)]
struct Tally {
    chunks: u64,
    syscalls: u64,
    survived: u64,
    ended: std::collections::BTreeMap<&'static str, u64>,
}

/// How a chunk ended, or why that is a failure.
fn judge(r: &Result<forkbox_engine::ExecResult, EngineError>) -> Result<&'static str, String> {
    match r {
        Ok(_) => Ok("survived"),
        Err(EngineError::Timeout(_)) => Ok("timeout"),
        Err(EngineError::GuestCrashed(_)) => Ok("guest_crashed"),
        Err(EngineError::GuestExited(_)) => Ok("guest_exited"),
        Err(EngineError::GuestSignaled(_)) => Ok("guest_killed"),
        Err(EngineError::Deadlock(_)) => Ok("deadlock"),
        Err(EngineError::Protocol(_)) => Ok("protocol_error"),
        Err(EngineError::Interrupted(_)) => Ok("interrupted"),
        Err(e) => Err(format!("host-level error leaked out of the sandbox: {e:?}")),
    }
}

/// Replay a failing chunk with every call logged, and return the last call seen.
fn last_call(seed: u64, calls: u64) -> String {
    let s = shared();
    let Ok(mut sb) = s.template.fork(&s.engine, limits()) else { return "(fork failed on replay)".into() };
    let mut last = String::from("(none logged)");
    let mut sink = |stream: Stream, bytes: &[u8]| {
        if stream == Stream::Stderr {
            if let Some(l) = String::from_utf8_lossy(bytes).lines().rfind(|l| l.starts_with("@call")) {
                last = l.to_string();
            }
        }
    };
    let code = forkbox_testkit::syscall_fuzz::program(seed, calls, true);
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        sb.exec_with(
            &code,
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
    }));
    last
}

fn run_seed(seed: u64, chunks: u64, calls: u64, witness: &mut Sandbox, tally: &mut Tally) {
    let s = shared();
    for chunk in 0..chunks {
        let chunk_seed = seed * 1_000_003 + chunk;
        let mut sb = s.template.fork(&s.engine, limits()).unwrap_or_else(|e| panic!("fork failed: {e}"));
        let before = sb.stats().syscalls;
        let code = forkbox_testkit::syscall_fuzz::program(chunk_seed, calls, false);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| sb.exec(&code)));
        let r = match r {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!(
                    "VMM PANIC: seed {seed} chunk {chunk} (chunk seed {chunk_seed}): {msg}\nlast call: {}",
                    last_call(chunk_seed, calls)
                );
            }
        };
        if std::env::var_os("FORKBOX_FUZZ_VERBOSE").is_some() {
            let last = if r.is_err() { last_call(chunk_seed, calls) } else { String::new() };
            eprintln!(
                "seed {seed} chunk {chunk}: {} syscalls, {:?} {last}",
                sb.stats().syscalls - before,
                r.as_ref().map(|r| &r.stdout)
            );
        }
        match judge(&r) {
            Ok(how) => *tally.ended.entry(how).or_default() += 1,
            Err(why) => panic!(
                "seed {seed} chunk {chunk} (chunk seed {chunk_seed}): {why}\nlast call: {}",
                last_call(chunk_seed, calls)
            ),
        }
        // A survivor may have closed or redirected its stdout: what counts is that it got back.
        if r.is_ok() {
            tally.survived += 1;
        }
        tally.chunks += 1;
        tally.syscalls += sb.stats().syscalls.saturating_sub(before);
        if let Err(e) = sb.check_invariants() {
            panic!("seed {seed} chunk {chunk} (chunk seed {chunk_seed}): VFS invariants broken: {e}");
        }
        drop(sb);
        if chunk % 4 == 3 {
            let w = witness.exec("print(6*7)").unwrap_or_else(|e| panic!("the witness sandbox failed: {e}"));
            assert_eq!(w.stdout, "42\n", "the witness sandbox after seed {seed} chunk {chunk}");
        }
    }
}

#[test]
fn random_syscalls_never_break_the_vmm() {
    let s = shared();
    // As on the server: this thread runs guests under the enforcing seccomp filter, so a
    // host syscall outside the allow-list that a guest could provoke kills the test.
    let mode = match std::env::var("FORKBOX_SECCOMP") {
        Ok(_) => forkbox_engine::jail::Mode::from_env().unwrap(),
        Err(_) => forkbox_engine::jail::Mode::Enforce,
    };
    forkbox_engine::jail::enter_guest_thread(mode).expect("installing the seccomp filter");
    let t0 = Instant::now();
    let seeds: Vec<u64> = match std::env::var("FORKBOX_FUZZ_SEED").ok().and_then(|v| v.parse().ok()) {
        Some(one) => vec![one],
        None => {
            let first = env_num("FORKBOX_FUZZ_FIRST_SEED", 1);
            (first..first + env_num("FORKBOX_FUZZ_SEEDS", 8)).collect()
        }
    };
    let chunks = env_num("FORKBOX_FUZZ_CHUNKS", 8);
    let calls = env_num("FORKBOX_FUZZ_CALLS", 1000);
    let mut witness = s.template.fork(&s.engine, Limits::default()).unwrap_or_else(|e| panic!("fork: {e}"));
    let mut tally = Tally::default();
    for &seed in &seeds {
        // Straight to stderr (not captured): if the filter kills the process, this names the seed.
        let _ = writeln!(std::io::stderr(), "syscall fuzz: seed {seed} ({chunks} chunks of {calls} calls)");
        run_seed(seed, chunks, calls, &mut witness, &mut tally);
    }
    let w = witness.exec("print(sum(range(10)))").unwrap_or_else(|e| panic!("the witness sandbox failed: {e}"));
    assert_eq!(w.stdout, "45\n");
    // A fresh fork after all of it still works.
    let mut after = s.template.fork(&s.engine, Limits::default()).unwrap_or_else(|e| panic!("fork: {e}"));
    assert_eq!(after.exec("print(1+1)").unwrap().stdout, "2\n");
    eprintln!(
        "syscall fuzz: {} seeds, {} chunks, {} guest syscalls in {:.1} s; {} chunks survived; endings {:?}",
        seeds.len(),
        tally.chunks,
        tally.syscalls,
        t0.elapsed().as_secs_f64(),
        tally.survived,
        tally.ended
    );
    assert!(tally.syscalls > seeds.len() as u64 * chunks * 20, "the fuzzer barely ran: {tally:?}");
}
