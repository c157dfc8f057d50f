//! A guest-side syscall fuzzer (issue 16, item 4): a Python program in the
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

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The guest program: `SEED`, `CALLS`, `TABLE`, `VERBOSE` are prepended.
const FUZZER: &str = r#"
import ctypes, random, os
libc = ctypes.CDLL(None, use_errno=True)
sc = libc.syscall
sc.restype = ctypes.c_long
sc.argtypes = [ctypes.c_long] * 7
R = random.Random(SEED)
BUF = 1 << 16
buf = ctypes.create_string_buffer(BUF)
ba = ctypes.addressof(buf)
code = ctypes.cast(libc.syscall, ctypes.c_void_p).value & ~0xfff
M64 = (1 << 64) - 1
PTRS = [0, 1, 8, 0xfff, 0x1000, 0x2000, 0x3000, 0x4000, 0x4010, 0x8000, 0x9000, 0xA000, 0x10_0000,
        0x10_7ff8, 0x1F_0000, 0x1F_1000, 0x1F_3ff0, 0x20_0000 - 8, 0xFEC0_0000, 0xFFFF_F000, 0xFFFF_FFF8,
        1 << 32, (1 << 32) - 1, (1 << 47) - 4096, (1 << 47) - 1, 1 << 47, 0x0000_8000_0000_0000,
        0xffff_8000_0000_0000, 0xffff_ffff_ff60_0000, M64, M64 - 4095, M64 - 7, code, code + 0x10,
        ba, ba + 8, ba + BUF - 1, ba + BUF - 8, ba + BUF - 16, ba + BUF, 0x7fff_0000_0000]
LENS = [0, 1, 2, 7, 8, 16, 64, 4096, 4097, BUF, BUF + 1, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
        1 << 32, (1 << 63) - 1, 1 << 63, M64, M64 - 4095, M64 - ba + 1, -1, -4096]
FDS = [-1, -2, -100, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 63, 64, 1023, 1024, 65535, (1 << 31) - 1,
       -(1 << 31), 1 << 32, M64]
PATHS = [b"/", b"/tmp/f", b"/tmp", b"/proc/self/mem", b"/proc/self/maps", b"/dev/kvm", b"/dev/null",
         b"../../../../../etc/passwd", b"/etc/passwd", b"", b"a" * 300, b"/" + b"x/" * 600, b"/tmp/../..",
         b"/proc/self/fd/3", b"/proc/1/root", b"/sys/kernel", b"\xff\xfe", b"/tmp/f/."]
QUIET = {62: 1, 200: 1, 234: 2, 129: 1, 297: 2, 424: 1}
SAFE_SIGS = [0, 17, 23, 28]
EXCLUDED = {60, 231}
# Calls that end a chunk at once (a deadlock, a crash): drawn again 9 times in 10.
TERMINAL = {15, 34, 130, 158, 61, 247, 128}
# Memory-map calls aim at a scratch mapping of their own or at wild addresses, never at the
# interpreter's heap (which they would only unmap or zero).
MMCALLS = {9, 10, 11, 12, 25, 26, 27, 28, 216, 329, 440, 462, 67}
scratch = sc(9, 0, 1 << 20, 3, 0x22, -1, 0, 0)
SCRATCH = [scratch, scratch + 4096, scratch + (1 << 20) - 4096, scratch + (1 << 20), scratch + 123]
WILD = [p for p in PTRS if not (ba <= p <= ba + BUF) and p not in (code, code + 0x10)]

def word():
    c = R.random()
    if c < 0.4: return R.choice(PTRS)
    if c < 0.7: return R.choice(LENS) & M64
    if c < 0.8: return R.choice(FDS) & M64
    return R.getrandbits(R.choice([8, 16, 32, 64]))

def fill():
    c = R.random()
    if c < 0.3:
        b = R.randbytes(R.choice([16, 256, 4096, BUF]))
    elif c < 0.6:
        b = b"".join(word().to_bytes(8, "little") for _ in range(R.choice([4, 32, 512])))
    elif c < 0.8:
        b = R.choice(PATHS) + b"\0"
    else:
        return
    o = R.randrange(0, BUF - len(b) + 1)
    ctypes.memmove(ba + o, b, len(b))

def arg():
    c = R.random()
    if c < 0.35: return R.choice(PTRS) if R.random() < 0.6 else ba + R.randrange(BUF)
    if c < 0.55: return R.choice(LENS)
    if c < 0.75: return R.choice(FDS)
    if c < 0.9: return R.getrandbits(R.choice([4, 16, 32, 64])) if R.random() < 0.7 else R.choice([0, -1, 1 << 31])
    return R.randrange(0, 16)

def signed(v):
    v &= M64
    return v - (1 << 64) if v >> 63 else v

def number():
    c = R.random()
    if c < 0.75: return R.choice(TABLE)
    if c < 0.9: return R.randrange(0, 1100)
    return R.choice([-1, -2, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 63, 0x4000_0000, 0x4000_0001, 0x4000_0200,
                     512, 547, 1023, 1024, M64, M64 - 1])

import signal
for _s in (signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGPIPE, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGHUP, signal.SIGTERM, signal.SIGIO, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT):
    signal.signal(_s, signal.SIG_IGN)
done = 0
for i in range(CALLS):
    nr = number()
    while nr in TERMINAL and R.random() < 0.9:
        nr = number()
    if nr in EXCLUDED:
        continue
    a = [arg() for _ in range(6)]
    if nr in MMCALLS:
        a[0] = R.choice(SCRATCH) if R.random() < 0.7 else R.choice(WILD)
        if nr == 9 and R.random() < 0.5:
            a[3] &= ~0x10  # not MAP_FIXED
    if nr in QUIET:
        a[QUIET[nr]] = R.choice(SAFE_SIGS)
    if R.random() < 0.3:
        fill()
    if VERBOSE:
        os.write(2, ("@call %d nr=%d args=%s\n" % (i, nr, [hex(x & M64) for x in a])).encode())
    try:
        sc(signed(nr), *[signed(x) for x in a])
    except Exception:
        pass
    done += 1
print("fuzz-done", done)
"#;

fn program(seed: u64, calls: u64, verbose: bool) -> String {
    let table: Vec<String> = forkbox_linux::syscalls::TABLE.iter().map(|e| e.nr.to_string()).collect();
    format!(
        "SEED = {seed}\nCALLS = {calls}\nVERBOSE = {}\nTABLE = [{}]\n{FUZZER}",
        if verbose { "True" } else { "False" },
        table.join(", ")
    )
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
    let code = program(seed, calls, true);
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        sb.exec_with(&code, ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None })
    }));
    last
}

fn run_seed(seed: u64, chunks: u64, calls: u64, witness: &mut Sandbox, tally: &mut Tally) {
    let s = shared();
    for chunk in 0..chunks {
        let chunk_seed = seed * 1_000_003 + chunk;
        let mut sb = s.template.fork(&s.engine, limits()).unwrap_or_else(|e| panic!("fork failed: {e}"));
        let before = sb.stats().syscalls;
        let code = program(chunk_seed, calls, false);
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
