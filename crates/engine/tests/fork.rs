//! Templates and copy-on-write forks: randomness per fork, isolation between
//! forks (fresh and recycled VMs), the template files never change, failing
//! forks do not disturb their siblings, state-file round trips and corruption.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
//!
//! One `Engine` and one template (`Template::ensure` under the home) are shared
//! by the whole binary. Tests that assert on pool counters load their OWN
//! `Template` instance from the same directory (its own pool, its own
//! counters), since the tests of this binary run in parallel. Tests that
//! damage template files work on a template created in a temporary home.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_engine::{Engine, EngineError, ExecResult, Limits, Sandbox, Template, TemplateInfo};
use forkbox_snapshot::{read_state, state, write_state, MemoryStats, Snapshot, FORMAT_VERSION, MAGIC};
use forkbox_testkit::guest::ok;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

struct Shared {
    engine: std::sync::Arc<Engine>,
    template: std::sync::Arc<Template>,
    /// sha256 of the whole template memory file when the binary started.
    memory_sha256: String,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let kit = forkbox_testkit::shared();
        let (engine, template) = (kit.engine.clone(), kit.template.clone());
        let t0 = Instant::now();
        let memory_sha256 = file_sha256(&template.dir.join("memory"));
        eprintln!("template memory sha256 {memory_sha256} ({:.1} s)", t0.elapsed().as_secs_f64());
        Shared { engine, template, memory_sha256 }
    })
}

fn engine() -> &'static Engine {
    &shared().engine
}

fn template() -> &'static Template {
    &shared().template
}

/// A Template instance of its own (own pool, own counters) over the shared template's files.
fn own_template() -> Template {
    Template::load(engine(), &template().dir)
        .unwrap_or_else(|e| panic!("Template::load({}): {e}", template().dir.display()))
}

/// Tests hold this shared; a test that counts process-wide resources (fds) holds it exclusively.
static GATE: RwLock<()> = RwLock::new(());

fn gate() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|e| e.into_inner())
}

fn gate_exclusive() -> RwLockWriteGuard<'static, ()> {
    GATE.write().unwrap_or_else(|e| e.into_inner())
}

#[track_caller]
fn fork(t: &Template, limits: Limits) -> Sandbox {
    t.fork(engine(), limits).unwrap_or_else(|e| panic!("fork failed: {e}"))
}

#[track_caller]
fn assert_no_error(r: &ExecResult, code: &str) {
    if let Some(err) = &r.error {
        panic!(
            "unexpected Python exception {}: {}\n{}\n--- code ---\n{code}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            err.kind, err.message, err.traceback, r.stdout, r.stderr
        );
    }
}

/// Run `code` (which prints one JSON document) and parse what it printed.
#[track_caller]
fn json_of(sb: &mut Sandbox, code: &str) -> serde_json::Value {
    let r = ok(sb, code);
    serde_json::from_str(r.stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}\n--- code ---\n{code}", r.stdout))
}

fn host_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

fn stat(t: &Template) -> [u64; 5] {
    let s = t.pool_stats();
    [
        s.recycled_hits.load(Ordering::SeqCst),
        s.pooled_hits.load(Ordering::SeqCst),
        s.created_inline.load(Ordering::SeqCst),
        s.resets.load(Ordering::SeqCst),
        s.pages_reset.load(Ordering::SeqCst),
    ]
}
const RECYCLED: usize = 0;
const RESETS: usize = 3;
const PAGES_RESET: usize = 4;

/// 32 bytes that no earlier run produced (the sandboxes' own randomness is under test, so not from there).
fn unique_secret(tag: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(tag.as_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos().to_le_bytes());
    h.finalize().to_vec()
}

fn seek(f: &File, from: u64, whence: libc::c_int) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on our own fd.
    let r = unsafe { libc::lseek(f.as_raw_fd(), from as libc::off_t, whence) };
    (r >= 0).then_some(r as u64)
}

/// Data extents of a (sparse) file: [start, end) ranges, everything else reads as zeros.
fn data_extents(f: &File) -> Vec<(u64, u64)> {
    let size = f.metadata().unwrap().len();
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < size {
        let Some(data) = seek(f, pos, libc::SEEK_DATA).filter(|&d| d < size) else { break };
        let hole = seek(f, data, libc::SEEK_HOLE).unwrap_or(size).min(size);
        out.push((data, hole));
        pos = hole;
    }
    out
}

/// SHA-256 of every byte of the file (holes are hashed as the zeros they read as,
/// without reading them: same digest as `sha256sum`, much faster on a 4 GiB sparse file).
fn file_sha256(path: &Path) -> String {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = f.metadata().unwrap().len();
    let zeros = vec![0u8; 1 << 20];
    let mut buf = vec![0u8; 1 << 20];
    let mut h = Sha256::new();
    let mut pos = 0u64;
    let feed_zeros = |h: &mut Sha256, mut n: u64| {
        while n > 0 {
            let k = n.min(zeros.len() as u64);
            h.update(&zeros[..k as usize]);
            n -= k;
        }
    };
    for (start, end) in data_extents(&f) {
        feed_zeros(&mut h, start - pos);
        let mut at = start;
        while at < end {
            let k = (end - at).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..k], at).unwrap();
            h.update(&buf[..k]);
            at += k as u64;
        }
        pos = end;
    }
    feed_zeros(&mut h, size - pos);
    hex::encode(h.finalize())
}

/// Copy a sparse file keeping its holes (std::fs::copy may fill them in).
fn sparse_copy(src: &Path, dst: &Path) {
    let _ = std::fs::remove_file(dst);
    let f = File::open(src).unwrap();
    let size = f.metadata().unwrap().len();
    let out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(dst).unwrap();
    out.set_len(size).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for (start, end) in data_extents(&f) {
        let mut at = start;
        while at < end {
            let k = (end - at).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..k], at).unwrap();
            out.write_all_at(&buf[..k], at).unwrap();
            at += k as u64;
        }
    }
    out.sync_all().unwrap();
}

/// Bytes of the template memory file at a guest address (guest RAM is identity-mapped, file offset = address).
fn template_bytes(addr: u64, len: usize) -> Vec<u8> {
    let f = File::open(template().dir.join("memory")).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, addr).unwrap();
    b
}

/// A guest address outside every mapping of the template (in the brk range, far above the heap).
const RAW_ADDR: u64 = 0x3000_0000;
const RAW_LEN: usize = 64 << 10;

// ---------------------------------------------------------------------------
// 1. Randomness and clocks per fork
// ---------------------------------------------------------------------------

const RANDOM_CODE: &str = "import os, uuid, random, numpy, secrets, time, json
print(json.dumps({'urandom': os.urandom(16).hex(), 'uuid4': str(uuid.uuid4()), 'random': repr(random.random()),
                  'numpy': repr(float(numpy.random.random())), 'secrets': secrets.token_hex(16),
                  'time': time.time(), 'monotonic': time.monotonic()}))";

const RANDOM_KEYS: [&str; 5] = ["urandom", "uuid4", "random", "numpy", "secrets"];

#[test]
fn children_of_one_template_get_distinct_randomness_and_live_clocks() {
    let _g = gate();
    let t = own_template();
    let mut samples: Vec<serde_json::Value> = Vec::new();

    // Sequentially on this thread: after the first, every fork is a recycled VM.
    for i in 0..8 {
        let before = stat(&t);
        let mut sb = fork(&t, Limits::default());
        let after = stat(&t);
        if i > 0 {
            assert_eq!(after[RECYCLED], before[RECYCLED] + 1, "fork {i} on one thread did not get a recycled VM");
        }
        let host_before = host_now();
        let v = json_of(&mut sb, RANDOM_CODE);
        let host_after = host_now();
        let guest_time = v["time"].as_f64().unwrap();
        assert!(
            guest_time >= host_before - 2.0 && guest_time <= host_after + 2.0,
            "fork {i}: guest time.time() {guest_time}, host {host_before}..{host_after}"
        );
        let m1 = v["monotonic"].as_f64().unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let m2: f64 = ok(&mut sb, "import time\nprint(repr(time.monotonic()))").stdout.trim().parse().unwrap();
        assert!(m2 > m1, "fork {i}: time.monotonic() did not increase between execs: {m1} then {m2}");
        assert!(m2 - m1 >= 0.025, "fork {i}: monotonic advanced {} s over >= 30 ms of host time", m2 - m1);
        samples.push(v);
    }

    // In parallel: exec_batch on 2 threads (fresh VMs, then recycled ones per worker).
    let codes = vec![RANDOM_CODE.to_string(); 8];
    let host_before = host_now();
    let results = engine().exec_batch(&t, &codes, &Limits::default(), 2);
    let host_after = host_now();
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap_or_else(|e| panic!("batch exec {i}: {e}"));
        assert_no_error(&r, RANDOM_CODE);
        let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
        let guest_time = v["time"].as_f64().unwrap();
        assert!(
            guest_time >= host_before - 2.0 && guest_time <= host_after + 2.0,
            "batch {i}: guest time.time() {guest_time}, host {host_before}..{host_after}"
        );
        samples.push(v);
    }

    assert_eq!(samples.len(), 16);
    for key in RANDOM_KEYS {
        let values: Vec<String> = samples.iter().map(|s| s[key].as_str().unwrap().to_string()).collect();
        let distinct: BTreeSet<&String> = values.iter().collect();
        assert_eq!(distinct.len(), values.len(), "{key}: values repeat across forks of one template: {values:#?}");
    }
    eprintln!("randomness: 16 forks, all distinct; stats {:?}", stat(&t));
}

// ---------------------------------------------------------------------------
// 2. Isolation between consecutive forks (recycled VMs)
// ---------------------------------------------------------------------------

/// What child A does: leave traces everywhere, report where its memory secrets are.
fn polluter_code(secret: &[u8]) -> String {
    let s = hex::encode(secret);
    format!(
        r#"{MEM_HELPERS}import os, sys, ctypes, mmap, json, numpy
secret = bytes.fromhex('{s}')
secret_var = '{s}'
# files: /tmp, the image's stdlib directory (new, overwritten, deleted), a new directory
open('/tmp/fb_iso_secret.txt', 'w').write(secret_var)
os.mkdir('/tmp/fb_iso_dir')
open('/usr/lib/python3.11/fb_iso_secret.py', 'w').write('SECRET = ' + repr(secret_var))
open('/usr/lib/python3.11/this.py', 'w').write('# overwritten ' + secret_var)
os.remove('/usr/lib/python3.11/antigravity.py')
# state that lives in template pages
numpy.FB_ISO_SECRET = secret_var
os.environ['FB_ISO_SECRET'] = secret_var
sys.path.append('/fb_iso_' + secret_var)
import builtins
builtins.FB_ISO_SECRET = secret_var
libm = ctypes.CDLL('libm.so.6')
assert libm.fesetround(0x800) == 0            # FE_UPWARD: in MXCSR and the x87 control word
assert libm.fegetround() == 0x800
# patch libc's code (a page of the template's memory): getpid() -> mov eax, 4242; ret
libc = ctypes.CDLL('libc.so.6')
_code = ctypes.cast(libc.getpid, ctypes.c_void_p).value
assert _libc.mprotect(_code & ~4095, 8192, 7) == 0   # the code is read+exec: make it writable first
ctypes.memmove(_code, b'\xb8\x92\x10\x00\x00\xc3', 6)
assert os.getpid() == 4242
# (a) a numpy array
arr = numpy.frombuffer(secret * (1 << 15), dtype=numpy.uint8).copy()
# (b) an anonymous mmap
m = mmap.mmap(-1, 1 << 20)
m.write(secret * (1 << 15))
mb = ctypes.c_char.from_buffer(m)
m_addr = ctypes.addressof(mb)
# (c) guest memory outside the template's mappings (mapped at a fixed address)
_map({RAW_ADDR}, {RAW_LEN})
ctypes.memmove({RAW_ADDR}, secret * ({RAW_LEN} // 32), {RAW_LEN})
# (e) memory written by the VMM, not the guest: read() into a buffer the guest never touched
open('/tmp/fb_iso_big', 'wb').write(secret * (1 << 15))
m3 = mmap.mmap(-1, 1 << 20)       # (not malloc: the brk heap's free space differs per fork by design)
arr2 = numpy.frombuffer(m3, dtype=numpy.uint8)
with open('/tmp/fb_iso_big', 'rb', buffering=0) as f:
    assert f.readinto(arr2) == 1 << 20
# (d) an mmap that is unmapped again (the VMM discards it), then mapped at the same place and written
m2 = mmap.mmap(-1, 2 << 20)
c2 = ctypes.c_char.from_buffer(m2)
m2_addr = ctypes.addressof(c2)
del c2
m2.write(secret * (1 << 16))
m2.close()
assert _unmapped(m2_addr, 16)
_map(m2_addr, 1 << 20)
ctypes.memmove(m2_addr, secret * (1 << 15), 1 << 20)
print(json.dumps({{'arr': arr.ctypes.data, 'arr_id': id(arr), 'mmap': m_addr, 'mmap2': m2_addr, 'arr2': arr2.ctypes.data,
                  'check': bytes(arr[:32]) == secret and m[:32] == secret and ctypes.string_at({RAW_ADDR}, 32) == secret
                           and bytes(arr2[-32:]) == secret}}))
"#
    )
}

/// What child B (and a pristine fork) runs: hashes of memory at fixed addresses
/// first (allocating as little as possible before), then every other trace.
/// Both run exactly this code, so they must print exactly the same.
fn probe_code(regions: &[(u64, usize)], secret: &[u8]) -> String {
    let regions_py: Vec<String> = regions.iter().map(|(a, n)| format!("({a}, {n})")).collect();
    format!(
        r#"{helpers}import ctypes, hashlib
_h = ['unmapped' if _unmapped(_a, _n) else hashlib.sha256((ctypes.c_char * _n).from_address(_a)).hexdigest() for _a, _n in [{regions}]]
import os, sys, json, numpy
_secret = bytes.fromhex('{secret}')
_found = [-2 if _unmapped(_a, _n) else ctypes.string_at(_a, _n).find(_secret) for _a, _n in [{regions}]]
try:
    secret_var
    _var = 'present'
except NameError:
    _var = 'NameError'
libm = ctypes.CDLL('libm.so.6')
_g = sorted(k for k in globals() if not k.startswith('_') and k not in ('ctypes', 'hashlib', 'os', 'sys', 'json', 'numpy', 'libm'))
print(json.dumps({{
    'hashes': _h, 'found': _found, 'var': _var, 'globals': _g,
    'tmp_file': os.path.exists('/tmp/fb_iso_secret.txt'), 'tmp_dir': os.path.exists('/tmp/fb_iso_dir'),
    'lib_file': os.path.exists('/usr/lib/python3.11/fb_iso_secret.py'),
    'this_py': hashlib.sha256(open('/usr/lib/python3.11/this.py', 'rb').read()).hexdigest(),
    'antigravity': os.path.exists('/usr/lib/python3.11/antigravity.py'),
    'tmp_listing': sorted(os.listdir('/tmp')),
    'numpy_attr': hasattr(numpy, 'FB_ISO_SECRET'), 'environ': 'FB_ISO_SECRET' in os.environ,
    'builtins_attr': hasattr(__builtins__, 'FB_ISO_SECRET') if not isinstance(__builtins__, dict) else 'FB_ISO_SECRET' in __builtins__,
    'getpid': os.getpid(),
    'sys_path': [p for p in sys.path if 'fb_iso' in p],
    'fegetround': libm.fegetround(), 'third': repr(1.0 / 3.0),
}}, sort_keys=True))
"#,
        helpers = MEM_HELPERS,
        regions = regions_py.join(", "),
        secret = hex::encode(secret)
    )
}

/// Run `code` in a fork made on a brand-new thread (no recycled VM there), i.e. a pristine one.
fn pristine_run(t: &Template, code: &str) -> serde_json::Value {
    std::thread::scope(|s| {
        s.spawn(|| {
            let before = stat(t)[RECYCLED];
            let mut sb = fork(t, Limits::default());
            assert_eq!(stat(t)[RECYCLED], before, "a fork on a new thread got a recycled VM");
            json_of(&mut sb, code)
        })
        .join()
        .unwrap()
    })
}

#[test]
fn recycled_forks_see_nothing_of_their_predecessor() {
    let _g = gate();
    let t = own_template();

    // The raw address is not used by the template: zeros in the file and in a fresh fork.
    let file_raw = template_bytes(RAW_ADDR, RAW_LEN);
    assert!(file_raw.iter().all(|&b| b == 0), "the template has data at {RAW_ADDR:#x}: pick another address");
    let fresh =
        pristine_run(&t, &format!("{MEM_HELPERS}import json\nprint(json.dumps(_unmapped({RAW_ADDR}, {RAW_LEN})))"));
    assert_eq!(fresh, serde_json::json!(true), "a fresh fork has memory mapped at {RAW_ADDR:#x}");
    let zero_hash = hex::encode(Sha256::digest(&file_raw));

    // Warm up this thread: one clean fork, so A below is itself recycled from round 0 on.
    drop(fork(&t, Limits::default()));

    for round in 0..4 {
        let secret = unique_secret(&format!("isolation round {round}"));
        // --- A: pollute everything, then end cleanly (its VM is recycled).
        let mut a = fork(&t, Limits::default());
        let layout = json_of(&mut a, &polluter_code(&secret));
        assert_eq!(layout["check"], serde_json::json!(true), "round {round}: A's writes did not land: {layout}");
        let arr = layout["arr"].as_u64().unwrap();
        let mm = layout["mmap"].as_u64().unwrap();
        let mm2 = layout["mmap2"].as_u64().unwrap();
        let arr2 = layout["arr2"].as_u64().unwrap();
        // A itself still sees its own state in a second exec.
        let again =
            ok(&mut a, "print(secret_var, len(arr), m[:4].hex(), open('/tmp/fb_iso_secret.txt').read())").stdout;
        assert!(again.starts_with(&hex::encode(&secret)), "round {round}: A lost its own state: {again}");
        // Negative control: the probe B runs below does see all of it, in A.
        let regions = [(RAW_ADDR, RAW_LEN), (arr, 1 << 20), (mm, 1 << 20), (mm2, 1 << 20), (arr2, 1 << 20)];
        let probe = probe_code(&regions, &secret);
        let in_a = json_of(&mut a, &probe);
        let ctx = format!("round {round}: the probe run in A itself: {in_a:#}");
        assert_eq!(in_a["var"], "present", "{ctx}");
        for k in ["tmp_file", "tmp_dir", "lib_file", "numpy_attr", "environ", "builtins_attr"] {
            assert_eq!(in_a[k], true, "{k}: {ctx}");
        }
        assert_eq!(in_a["antigravity"], false, "{ctx}");
        assert_eq!(in_a["fegetround"], 0x800, "{ctx}");
        assert_eq!(in_a["getpid"], 4242, "{ctx}");
        assert_eq!(in_a["third"], "0.33333333333333337", "{ctx}");
        for (i, f) in in_a["found"].as_array().unwrap().iter().enumerate() {
            assert!(f.as_i64().unwrap() >= 0, "region {i}: {ctx}");
        }
        let before_drop = stat(&t);
        drop(a);
        let after_drop = stat(&t);
        assert_eq!(after_drop[RESETS], before_drop[RESETS] + 1, "round {round}: A's VM was not reset for reuse");
        assert!(after_drop[PAGES_RESET] > before_drop[PAGES_RESET], "round {round}: no pages reset after A wrote MiBs");
        eprintln!(
            "round {round}: A arr@{arr:#x} (id {}) mmap@{mm:#x} mmap2@{mm2:#x} arr2@{arr2:#x}; reset {} pages",
            layout["arr_id"],
            after_drop[PAGES_RESET] - before_drop[PAGES_RESET]
        );

        // --- B: a recycled VM.
        let r0 = stat(&t)[RECYCLED];
        let mut b = fork(&t, Limits::default());
        assert_eq!(stat(&t)[RECYCLED], r0 + 1, "round {round}: B did not get the recycled VM");
        let seen = json_of(&mut b, &probe);
        drop(b);

        // --- A pristine fork (new thread, not recycled) running the same probe.
        let pristine = pristine_run(&t, &probe);

        let ctx = format!("round {round}\nB: {seen:#}\npristine: {pristine:#}");
        assert_eq!(seen["var"], "NameError", "{ctx}");
        assert_eq!(seen["globals"], serde_json::json!([]), "{ctx}");
        for k in ["tmp_file", "tmp_dir", "lib_file", "numpy_attr", "environ", "builtins_attr"] {
            assert_eq!(seen[k], false, "B sees A's {k}: {ctx}");
        }
        assert_ne!(seen["getpid"], 4242, "A's patch of libc's code is visible in B: {ctx}");
        assert_eq!(seen["antigravity"], true, "A's deletion is visible in B: {ctx}");
        assert_eq!(seen["sys_path"], serde_json::json!([]), "{ctx}");
        assert_eq!(seen["fegetround"], 0, "A's FPU rounding mode leaked into B: {ctx}");
        assert_eq!(seen["third"], "0.3333333333333333", "{ctx}");
        for (i, f) in seen["found"].as_array().unwrap().iter().enumerate() {
            assert!(f == -1 || f == -2, "B finds A's secret in region {i} {:#x}: {ctx}", regions[i].0);
        }
        // A's mappings are not B's: the template does not map RAW_ADDR (zeros in its file).
        let _ = &zero_hash;
        assert_eq!(seen["hashes"][0], "unmapped", "memory at {RAW_ADDR:#x} is mapped in B: {ctx}");
        assert_eq!(seen, pristine, "B (recycled) and a pristine fork differ: {ctx}");
        // ... and the probe does tell A's view from a pristine one.
        assert_ne!(in_a["this_py"], pristine["this_py"], "{ctx}");
        for i in 0..regions.len() {
            assert_ne!(in_a["hashes"][i], pristine["hashes"][i], "region {i}: {ctx}");
        }
    }
    eprintln!("isolation stats {:?}", stat(&t));
    drop(t);
    assert_eq!(file_sha256(&template().dir.join("memory")), shared().memory_sha256, "the template memory file changed");
}

// ---------------------------------------------------------------------------
// 3. The memory file never changes (1,000 writing forks)
// ---------------------------------------------------------------------------

#[test]
fn template_memory_file_unchanged_after_1000_writing_forks() {
    let _g = gate();
    let t = own_template();
    let expect_raw = hex::encode(template_bytes(RAW_ADDR, 16));
    let codes: Vec<String> = (0..1000)
        .map(|i| {
            format!(
                "{MEM_HELPERS}import ctypes
_pre = _unmapped({RAW_ADDR}, 16) and '{expect_raw}' == '00' * 16
_had = 'x' in globals()
x = bytearray(10**6)
x[::4096] = b'x' * len(x[::4096])
_map({RAW_ADDR}, 4096)
ctypes.memmove({RAW_ADDR}, b'%016d' % {i}, 16)
print({i}, _had, _pre, x.count(b'x'))"
            )
        })
        .collect();
    let t0 = Instant::now();
    let results = engine().exec_batch(&t, &codes, &Limits::default(), 2);
    let took = t0.elapsed();
    let mut bad = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let want = format!("{i} False True 245\n");
        match r {
            Ok(r) if r.error.is_none() && r.stdout == want => {}
            other => bad.push(format!("fork {i}: {other:?}")),
        }
    }
    assert!(
        bad.is_empty(),
        "{} of 1000 forks wrong, e.g.:\n{}",
        bad.len(),
        bad.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
    );
    let s = stat(&t);
    eprintln!("1000 writing forks in {:.1} s ({:.1} ms each); stats {s:?}", took.as_secs_f64(), took.as_secs_f64());
    assert!(s[RECYCLED] >= 900, "expected nearly all of 1000 batch forks to reuse VMs, stats {s:?}");
    drop(t);
    assert_eq!(file_sha256(&template().dir.join("memory")), shared().memory_sha256, "the template memory file changed");
}

// ---------------------------------------------------------------------------
// 4. Failing forks among siblings
// ---------------------------------------------------------------------------

/// Python helpers: guest memory is only what the guest maps (page tables
/// follow the memory map), so raw addresses are mapped first (`_map`), and
/// whether an address is mapped is asked of the VMM (`_unmapped`: a write()
/// from it is EFAULT) instead of reading it (which would be a SIGSEGV).
const MEM_HELPERS: &str = "import ctypes as _ct, os as _os
_libc = _ct.CDLL(None, use_errno=True)
_libc.mmap.restype = _ct.c_void_p
_libc.mmap.argtypes = [_ct.c_void_p, _ct.c_size_t, _ct.c_int, _ct.c_int, _ct.c_int, _ct.c_long]
_libc.mprotect.argtypes = [_ct.c_void_p, _ct.c_size_t, _ct.c_int]
_libc.write.argtypes = [_ct.c_int, _ct.c_void_p, _ct.c_size_t]
_libc.write.restype = _ct.c_ssize_t
_null = _os.open('/dev/null', _os.O_WRONLY)
def _map(a, n):
    assert _libc.mmap(a, n, 3, 0x32, -1, 0) == a
def _unmapped(a, n):
    return _libc.write(_null, a, n) < 0 and _ct.get_errno() == 14
";

const CRASH_MARK: &[u8] = b"FORKBOX-CRASHED-SIBLING-SECRET";
const CRASH_ADDR: u64 = RAW_ADDR + 0x1_0000;

fn trace_then(tail: &str) -> String {
    format!(
        "{MEM_HELPERS}import ctypes, os
crash_secret = {mark:?}
open('/tmp/fb_crash_secret', 'w').write(crash_secret)
_map({CRASH_ADDR}, 4096)
ctypes.memmove({CRASH_ADDR}, crash_secret.encode(), {n})
{tail}",
        mark = std::str::from_utf8(CRASH_MARK).unwrap(),
        n = CRASH_MARK.len()
    )
}

fn clean_sibling(i: usize) -> String {
    format!(
        "{MEM_HELPERS}import ctypes, os, numpy
print({i}, 'crash_secret' in globals(), os.path.exists('/tmp/fb_crash_secret'), _unmapped({CRASH_ADDR}, {n}), int(numpy.arange({i} + 1).sum()))",
        n = CRASH_MARK.len()
    )
}

fn clean_expect(i: usize) -> String {
    format!("{i} False False True {}\n", i * (i + 1) / 2)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Clean,
    Crash,
    Loop,
    Oom,
    Exit,
    Abort,
}

fn failing_code(kind: Kind) -> String {
    match kind {
        Kind::Crash => trace_then("ctypes.string_at(0)"),
        Kind::Loop => trace_then("while True: pass"),
        // numpy.empty does not touch its pages (bytearray() zero-fills: too slow for a 1 s limit)
        Kind::Oom => trace_then(
            "import numpy\nchunks = []\nwhile True:\n    chunks.append(numpy.empty(16 << 20, dtype=numpy.uint8))",
        ),
        Kind::Exit => trace_then("os._exit(3)"),
        Kind::Abort => trace_then("os.abort()"),
        Kind::Clean => unreachable!(),
    }
}

#[track_caller]
fn check_failure(kind: Kind, r: &Result<ExecResult, EngineError>, timeout: Duration) {
    match (kind, r) {
        (Kind::Crash, Err(EngineError::GuestCrashed(msg))) => {
            assert!(msg.to_lowercase().contains("page fault"), "crash message does not mention the page fault: {msg}")
        }
        (Kind::Loop, Err(EngineError::Timeout(secs))) => {
            assert!((secs - timeout.as_secs_f64()).abs() < 0.01, "Timeout({secs}) for a {timeout:?} limit")
        }
        (Kind::Oom, Ok(r)) => {
            let e = r.error.as_ref().unwrap_or_else(|| panic!("allocation loop ended without an exception: {r:?}"));
            // numpy raises its MemoryError subclass (_ArrayMemoryError)
            assert!(e.kind.contains("MemoryError"), "{}: {}", e.kind, e.message);
        }
        (Kind::Exit, Err(EngineError::GuestExited(3))) => {}
        (Kind::Abort, Err(EngineError::GuestSignaled(6))) => {}
        (k, other) => panic!("{k:?}: unexpected outcome {other:?}"),
    }
}

#[test]
fn failing_forks_do_not_disturb_siblings_and_are_not_recycled() {
    let _g = gate();
    let t = own_template();
    let limits = Limits { timeout: Duration::from_secs(1), memory_bytes: 256 << 20, ..Limits::default() };

    // 50 clean siblings with 3 of each failure mixed in, on 2 workers.
    let mut kinds = Vec::new();
    let failures = [Kind::Crash, Kind::Loop, Kind::Oom, Kind::Exit, Kind::Abort];
    let mut clean = 0;
    for i in 0..65 {
        if i % 4 == 1 && kinds.iter().filter(|k| **k != Kind::Clean).count() < 15 {
            kinds.push(failures[(i / 4) % 5]);
        } else {
            kinds.push(Kind::Clean);
            clean += 1;
        }
    }
    assert_eq!(clean, 50);
    let codes: Vec<String> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| if *k == Kind::Clean { clean_sibling(i) } else { failing_code(*k) })
        .collect();
    let before = stat(&t);
    let t0 = Instant::now();
    let results = engine().exec_batch(&t, &codes, &limits, 2);
    eprintln!("mixed batch of {} in {:.1} s", codes.len(), t0.elapsed().as_secs_f64());
    let after = stat(&t);
    let mut oks = 0;
    for (i, (k, r)) in kinds.iter().zip(&results).enumerate() {
        if r.is_ok() {
            oks += 1;
        }
        if *k == Kind::Clean {
            match r {
                Ok(r) if r.error.is_none() && r.stdout == clean_expect(i) => {}
                other => panic!("clean sibling {i}: expected {:?}, got {other:?}", clean_expect(i)),
            }
        } else {
            check_failure(*k, r, limits.timeout);
        }
    }
    assert_eq!(oks, 50 + 3, "50 clean siblings + 3 MemoryErrors are results");
    assert_eq!(
        after[RESETS] - before[RESETS],
        oks as u64,
        "exactly the VMs of sandboxes that ended cleanly are reset for reuse (stats before {before:?} after {after:?})"
    );

    // One thread, one failing fork at a time: its VM is not recycled, the next fork is clean.
    for kind in failures {
        drop(fork(&t, limits.clone())); // leaves exactly one recycled VM on this thread
        let s0 = stat(&t);
        let mut f = fork(&t, limits.clone());
        assert_eq!(stat(&t)[RECYCLED], s0[RECYCLED] + 1);
        let r = f.exec(&failing_code(kind));
        check_failure(kind, &r, limits.timeout);
        if kind == Kind::Oom {
            assert_eq!(
                ok(&mut f, "del chunks\nprint(1 + 1)").stdout,
                "2\n",
                "the sandbox stays usable after a MemoryError"
            );
        } else {
            match f.exec("1 + 1") {
                Err(EngineError::Poisoned(_)) => {}
                other => panic!("{kind:?}: expected Poisoned after the failure, got {other:?}"),
            }
        }
        let s1 = stat(&t);
        drop(f);
        let s2 = stat(&t);
        let recycled = kind == Kind::Oom;
        assert_eq!(s2[RESETS] - s1[RESETS], recycled as u64, "{kind:?}: resets {s1:?} -> {s2:?}");
        let mut g = fork(&t, limits.clone());
        let s3 = stat(&t);
        assert_eq!(s3[RECYCLED] - s2[RECYCLED], recycled as u64, "{kind:?}: next fork recycled? {s2:?} -> {s3:?}");
        let r = ok(&mut g, &clean_sibling(7));
        assert_eq!(r.stdout, clean_expect(7), "{kind:?}: the fork after a failed one is not clean");
    }

    // Afterwards forks still work and are clean (on a new thread too).
    for i in 0..3 {
        let mut sb = fork(&t, Limits::default());
        assert_eq!(ok(&mut sb, &clean_sibling(i)).stdout, clean_expect(i));
    }
    let after_all = engine().exec_batch(&t, &(0..4).map(clean_sibling).collect::<Vec<_>>(), &Limits::default(), 2);
    for (i, r) in after_all.into_iter().enumerate() {
        assert_eq!(r.unwrap().stdout, clean_expect(i));
    }
}

// ---------------------------------------------------------------------------
// 5. State file round trip
// ---------------------------------------------------------------------------

#[test]
fn state_file_round_trips_byte_for_byte() {
    let _g = gate();
    let dir = &template().dir;
    let bytes = std::fs::read(dir.join("state")).unwrap();
    let snap = state::decode(&bytes).unwrap_or_else(|e| panic!("decode the template state: {e}"));
    assert_eq!(&bytes[..8], MAGIC);
    assert_eq!(snap.image_id, engine().image.id());
    let info: TemplateInfo = serde_json::from_str(&snap.info).unwrap();
    assert_eq!(Some(info.id.as_str()), dir.file_name().and_then(|n| n.to_str()));
    assert_eq!(info.image_id, snap.image_id);
    assert_eq!(info.memory_pages, snap.memory.pages);
    assert_eq!(&snap.memory, &template().memory().stats);
    assert_eq!(state::encode(&snap), bytes, "decode + encode is not byte-identical");

    // The process part: restore_state + save_state is the identity.
    let process = forkbox_linux::Process::restore_state(engine().image.clone(), snap.process.clone())
        .unwrap_or_else(|e| panic!("restore_state: {e}"));
    let saved = process.save_state();
    assert!(saved == snap.process, "Process::restore_state + save_state changed the process state");
    let snap2 = Snapshot { process: saved, ..state::decode(&bytes).unwrap() };
    assert_eq!(state::encode(&snap2), bytes, "restore/save of the process part changed the postcard bytes");

    // And through write_state / read_state.
    let tmp = tempfile::tempdir().unwrap();
    write_state(&tmp.path().join("state"), &snap2).unwrap();
    assert_eq!(std::fs::read(tmp.path().join("state")).unwrap(), bytes);
    let back = read_state(&tmp.path().join("state")).unwrap();
    assert_eq!(state::encode(&back), bytes);
}

// ---------------------------------------------------------------------------
// 6. Corrupt templates are rejected, never used
// ---------------------------------------------------------------------------

const HEADER_LEN: usize = 8 + 4 + 8 + 32;

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(payload);
    out
}

/// `Template::load` must return an error (not panic, not a template).
#[track_caller]
fn assert_rejected(dir: &Path, what: &str) -> String {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Template::load(engine(), dir)));
    match r {
        Err(_) => panic!("{what}: Template::load panicked"),
        Ok(Ok(t)) => {
            // Make the failure obvious: a sandbox from it.
            let sb = t.fork(engine(), Limits::default()).map(|_| "a sandbox was produced").unwrap_or("fork failed");
            panic!("{what}: Template::load accepted a corrupt template ({sb})")
        }
        Ok(Err(e)) => {
            let msg = e.to_string();
            eprintln!("{what}: rejected: {msg}");
            msg
        }
    }
}

/// A template in a temporary home, and a scratch copy of it that each case corrupts.
struct Scratch {
    _home: tempfile::TempDir,
    pristine: PathBuf,
    work: PathBuf,
}

impl Scratch {
    fn new() -> Scratch {
        let home = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let t =
            Template::ensure(engine(), home.path()).unwrap_or_else(|e| panic!("Template::ensure in a temp home: {e}"));
        eprintln!("temp template created in {:.2} s", t0.elapsed().as_secs_f64());
        let pristine = t.dir.clone();
        drop(t);
        let work = home.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        let s = Scratch { _home: home, pristine, work };
        s.restore();
        s
    }

    fn restore(&self) {
        let state = self.work.join("state");
        let _ = std::fs::remove_file(&state);
        std::fs::copy(self.pristine.join("state"), &state).unwrap();
        sparse_copy(&self.pristine.join("memory"), &self.work.join("memory"));
    }

    fn state(&self) -> PathBuf {
        self.work.join("state")
    }

    fn memory(&self) -> PathBuf {
        self.work.join("memory")
    }
}

fn flip_byte(path: &Path, at: u64, xor: u8) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= xor;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

fn truncate(path: &Path, len: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(len).unwrap();
}

/// Non-zero pages of a memory file (first and last found).
fn nonzero_pages(path: &Path) -> (u64, u64, u64) {
    let f = File::open(path).unwrap();
    let mut page = vec![0u8; 4096];
    let (mut first, mut last, mut n) = (None, 0, 0);
    for (start, end) in data_extents(&f) {
        let mut at = start - start % 4096;
        while at < end {
            f.read_exact_at(&mut page, at).unwrap();
            if page.iter().any(|&b| b != 0) {
                first.get_or_insert(at);
                last = at;
                n += 1;
            }
            at += 4096;
        }
    }
    (first.expect("the template memory has no non-zero page"), last, n)
}

/// A zero page that is a hole in the file (well away from any data).
fn a_hole(path: &Path) -> u64 {
    let f = File::open(path).unwrap();
    let size = f.metadata().unwrap().len();
    let mut prev_end = 0;
    for (start, end) in data_extents(&f) {
        if start - prev_end >= 3 * 4096 {
            return prev_end + 4096;
        }
        prev_end = end.div_ceil(4096) * 4096;
    }
    assert!(size - prev_end >= 3 * 4096);
    prev_end + 4096
}

#[test]
fn corrupt_templates_are_rejected() {
    let _g = gate();
    let s = Scratch::new();

    // Positive control: the untouched copy loads and forks.
    {
        let t = Template::load(engine(), &s.work)
            .unwrap_or_else(|e| panic!("the pristine scratch copy does not load: {e}"));
        let mut sb = fork(&t, Limits::default());
        assert_eq!(ok(&mut sb, "print(1 + 1)").stdout, "2\n");
    }

    let state_len = std::fs::metadata(s.state()).unwrap().len();
    // State file: one flipped byte anywhere.
    for (at, what) in [
        (0, "magic"),
        (9, "format version"),
        (13, "payload length"),
        (20, "checksum first byte"),
        (51, "checksum last byte"),
        (HEADER_LEN as u64, "first payload byte"),
        (HEADER_LEN as u64 + 100, "payload byte 100"),
        (state_len / 2, "middle"),
        (state_len - 1, "last byte"),
    ] {
        s.restore();
        flip_byte(&s.state(), at, 0x01);
        assert_rejected(&s.work, &format!("state: flipped {what} (offset {at})"));
    }
    // State file: truncated, extended, empty, missing.
    for len in [0, 7, 12, HEADER_LEN as u64 - 1, HEADER_LEN as u64, HEADER_LEN as u64 + 1, state_len / 2, state_len - 1]
    {
        s.restore();
        truncate(&s.state(), len);
        assert_rejected(&s.work, &format!("state truncated to {len} of {state_len} bytes"));
    }
    s.restore();
    {
        let mut b = std::fs::read(s.state()).unwrap();
        b.push(0);
        std::fs::write(s.state(), b).unwrap();
    }
    assert_rejected(&s.work, "state with a byte appended");
    s.restore();
    std::fs::remove_file(s.state()).unwrap();
    assert_rejected(&s.work, "state missing");

    // Memory file: truncated (by a page, to half, to nothing), missing.
    let mem_len = std::fs::metadata(s.memory()).unwrap().len();
    for len in [mem_len - 4096, mem_len - 1, mem_len / 2, 0] {
        s.restore();
        truncate(&s.memory(), len);
        assert_rejected(&s.work, &format!("memory truncated to {len} of {mem_len} bytes"));
    }
    s.restore();
    std::fs::OpenOptions::new().append(true).open(s.memory()).unwrap().set_len(mem_len + 4096).unwrap();
    assert_rejected(&s.work, "memory extended by a page");
    s.restore();
    std::fs::remove_file(s.memory()).unwrap();
    assert_rejected(&s.work, "memory missing");

    // Memory file: one byte changed inside a non-zero page (first, last, and in the middle of a page).
    s.restore();
    let (first, last, n) = nonzero_pages(&s.memory());
    eprintln!("memory file: {n} non-zero pages, first {first:#x}, last {last:#x}");
    for (at, what) in [
        (first, "first non-zero page, byte 0"),
        (first + 2049, "first non-zero page, byte 2049"),
        (last + 4095, "last non-zero page, last byte"),
    ] {
        for xor in [0x01, 0x80] {
            s.restore();
            flip_byte(&s.memory(), at, xor);
            assert_rejected(&s.work, &format!("memory: {what} xor {xor:#x}"));
        }
    }
    // A zero page (a hole) that became non-zero.
    s.restore();
    let hole = a_hole(&s.memory());
    flip_byte(&s.memory(), hole + 17, 0x5A);
    assert_rejected(&s.work, &format!("memory: byte written into the zero page at {hole:#x}"));

    // Well-formed state files (valid checksum) that do not fit.
    let pristine_state = std::fs::read(s.pristine.join("state")).unwrap();
    type Edit = fn(&mut Snapshot);
    let edits: [(&str, Edit); 6] = [
        ("another image id", |sn| sn.image_id = "0".repeat(64)),
        ("another image id (one char)", |sn| {
            let mut id = sn.image_id.clone().into_bytes();
            id[0] = if id[0] == b'a' { b'b' } else { b'a' };
            sn.image_id = String::from_utf8(id).unwrap();
        }),
        ("another memory checksum", |sn| sn.memory.checksum = "00".repeat(32)),
        ("another page count", |sn| sn.memory.pages += 1),
        ("another memory size", |sn| sn.memory.size /= 2),
        ("info that is not JSON", |sn| sn.info = "{not json".into()),
    ];
    for (what, edit) in edits {
        s.restore();
        let mut sn = state::decode(&pristine_state).unwrap();
        edit(&mut sn);
        std::fs::write(s.state(), state::encode(&sn)).unwrap();
        assert_rejected(&s.work, &format!("state for {what}"));
    }
    s.restore();
    {
        let sn = state::decode(&pristine_state).unwrap();
        let MemoryStats { size, pages, checksum } = sn.memory.clone();
        let other = MemoryStats { size, pages, checksum: checksum.chars().rev().collect() };
        let sn = Snapshot { memory: other, ..sn };
        std::fs::write(s.state(), state::encode(&sn)).unwrap();
        assert_rejected(&s.work, "state with a reversed memory checksum");
    }
    // Another format version with a valid checksum, and garbage with a valid frame.
    s.restore();
    {
        let mut b = pristine_state.clone();
        b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        std::fs::write(s.state(), &b).unwrap();
        let msg = assert_rejected(&s.work, "state of another format version");
        assert!(msg.contains("version"), "{msg}");
        std::fs::write(s.state(), frame(b"\x05garbage that is not postcard")).unwrap();
        assert_rejected(&s.work, "framed garbage");
        std::fs::write(s.state(), frame(&[])).unwrap();
        assert_rejected(&s.work, "framed empty payload");
    }

    // Template::ensure over a corrupt template rebuilds it and works.
    let home = s.pristine.parent().unwrap().parent().unwrap().to_path_buf();
    flip_byte(&s.pristine.join("state"), HEADER_LEN as u64 + 7, 0x01);
    assert_rejected(&s.pristine, "corrupt template before ensure");
    let t =
        Template::ensure(engine(), &home).unwrap_or_else(|e| panic!("Template::ensure over a corrupt template: {e}"));
    assert_eq!(t.dir, s.pristine);
    let mut sb = fork(&t, Limits::default());
    assert_eq!(ok(&mut sb, "print(1 + 1)").stdout, "2\n");
    drop(sb);
    drop(t);
    Template::load(engine(), &s.pristine).unwrap_or_else(|e| panic!("the rebuilt template does not load: {e}"));
}

/// postcard's varint (LEB128) encoding of an unsigned integer.
fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

const CHILD_ENV: &str = "FORKBOX_FORK_TEST_CHILD";

/// The child half of `hostile_state_payloads_are_errors_not_aborts`: decode
/// well-framed (valid checksum) but hostile payloads. Run in its own process,
/// because a failure here may be an abort of the whole process.
fn hostile_payloads_child(dir: &Path, image: &Path, part: &str) {
    let image = std::sync::Arc::new(forkbox_image::Image::open(image).unwrap());
    if part == "crafted" {
        // The memory map's VMA count (the first field of the process state) claims 2^50 entries.
        let hostile = dir.join("hostile-vma-count");
        eprintln!("child: read_state({})", hostile.display());
        match read_state(&hostile) {
            Ok(_) => panic!("a state claiming 2^50 VMAs decoded"),
            Err(e) => eprintln!("child: rejected: {e}"),
        }
        return;
    }
    // Random single-byte changes (and truncations) below the checksum.
    let good = std::fs::read(dir.join("good")).unwrap();
    let payload = &good[HEADER_LEN..];
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (trials, mut rejected) = (2000, 0);
    for trial in 0..trials {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut p = payload.to_vec();
        let at = (seed % p.len() as u64) as usize;
        let xor = ((seed >> 32) as u8) | 1;
        p[at] ^= xor;
        if trial % 4 == 0 {
            p.truncate(at.max(1));
        }
        eprintln!(
            "child: trial {trial}: payload byte {at} ^= {xor:#04x}{}",
            if trial % 4 == 0 { ", truncated there" } else { "" }
        );
        let framed = frame(&p);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match state::decode(&framed) {
            Err(_) => false,
            Ok(sn) => forkbox_linux::Process::restore_state(image.clone(), sn.process).is_ok(),
        }));
        match outcome {
            Err(_) => panic!("decode/restore_state panicked (trial {trial})"),
            Ok(false) => rejected += 1,
            Ok(true) => {}
        }
    }
    eprintln!(
        "child: fuzz: {rejected} of {trials} mutated payloads rejected, the rest decoded to a valid process state"
    );
}

#[test]
fn hostile_state_payloads_are_errors_not_aborts() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        let image = std::env::var("FORKBOX_FORK_TEST_IMAGE").unwrap();
        let part = std::env::var("FORKBOX_FORK_TEST_PART").unwrap();
        return hostile_payloads_child(Path::new(&dir), Path::new(&image), &part);
    }
    let _g = gate();
    let good = std::fs::read(template().dir.join("state")).unwrap();
    let snap = state::decode(&good).unwrap();
    let vmas: Vec<_> = snap.process.mm.vmas().collect();
    let (first, vma) = vmas[0];
    // The map is written as varint(count), then (varint(start), varint(end), varint(prot), ...) per VMA.
    let mut needle = varint(vmas.len() as u64);
    needle.extend(varint(first));
    needle.extend(varint(vma.end));
    needle.extend(varint(vma.prot as u64));
    let payload = &good[HEADER_LEN..];
    let hits: Vec<usize> =
        payload.windows(needle.len()).enumerate().filter(|(_, w)| *w == &needle[..]).map(|(i, _)| i).collect();
    assert_eq!(hits.len(), 1, "cannot locate the VMA map in the state payload (needle {needle:02x?})");
    let count_len = varint(vmas.len() as u64).len();
    let mut hostile = payload[..hits[0]].to_vec();
    hostile.extend(varint(1 << 50));
    hostile.extend_from_slice(&payload[hits[0] + count_len..]);

    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("hostile-vma-count"), frame(&hostile)).unwrap();
    std::fs::write(tmp.path().join("good"), &good).unwrap();
    let mut failed = Vec::new();
    for (part, what) in [
        ("crafted", "a state file whose VMA count says 2^50 (checksum valid)"),
        ("fuzz", "2,000 state files with one payload byte changed (checksum valid)"),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["hostile_state_payloads_are_errors_not_aborts", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, tmp.path())
            .env("FORKBOX_FORK_TEST_IMAGE", &engine().image_path)
            .env("FORKBOX_FORK_TEST_PART", part)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("child:") || l.contains("memory allocation") || l.contains("panicked"))
            .collect();
        let tail = lines[lines.len().saturating_sub(3)..].join("\n");
        eprintln!("{what}: child exited with {}; last lines:\n{tail}", out.status);
        if !out.status.success() {
            failed.push(format!("{what}: the decoding process ended with {}:\n{tail}", out.status));
        }
    }
    assert!(failed.is_empty(), "hostile state files must be rejected with an error:\n{}", failed.join("\n"));
}

// ---------------------------------------------------------------------------
// 6b. Another CPU: a new template, and checkpoints refused with a typed error
// ---------------------------------------------------------------------------

/// This host's CPU with fewer features, as on an older host: SSE only (no
/// AVX, AVX2, FMA, F16C, AVX-512), XCR0 = x87 | SSE.
fn smaller_cpu() -> forkbox_vmm::Cpu {
    let mut cpu = forkbox_vmm::Cpu::new().unwrap();
    let avx512: u32 = (1 << 16) | (1 << 17) | (1 << 21) | (1 << 26) | (1 << 27) | (1 << 28) | (1 << 30) | (1 << 31);
    for e in cpu.cpuid.as_mut_slice() {
        match (e.function, e.index) {
            (1, _) => e.ecx &= !((1 << 12) | (1 << 28) | (1 << 29)),
            (7, 0) => e.ebx &= !((1 << 5) | avx512),
            (0xD, 0) => e.eax &= 0x3,
            _ => {}
        }
    }
    cpu.xcr0 &= 0x3;
    cpu
}

#[test]
fn another_cpu_rebuilds_the_template_and_refuses_its_checkpoints() {
    use forkbox_snapshot::{CpuFingerprint, StateError};
    let _g = gate();
    let host = template();
    // A checkpoint of a session on this host.
    let tmp = tempfile::tempdir().unwrap();
    let (layer, state) = (tmp.path().join("layer"), tmp.path().join("state"));
    let mut sb = host.fork_tracked(engine(), Limits::default()).unwrap();
    ok(&mut sb, "x = 41");
    host.checkpoint(engine(), &mut sb, &layer, &state, |_| Ok::<(), EngineError>(())).unwrap();
    drop(sb);
    assert_eq!(read_state(&state).unwrap().cpu, *host.cpu());
    assert_eq!(*host.cpu(), CpuFingerprint::of(&engine().cpu));

    // The same data directory on a host with fewer CPU features.
    let small = Engine::open(&engine().image_path).unwrap().with_cpu(smaller_cpu());
    let small_fp = CpuFingerprint::of(&small.cpu);
    let diff = host.cpu().differences(&small_fp).expect("the smaller CPU must differ (does this host lack AVX2?)");
    eprintln!("simulated CPU change: {diff}");

    // Loading the host's template there: a typed error naming what differs, not a fault later.
    match Template::load(&small, &host.dir) {
        Err(EngineError::Snapshot(e @ StateError::CpuMismatch(_))) => {
            assert_eq!(e.code(), "cpu_mismatch");
            let m = e.to_string();
            assert!(m.contains("CPUID 0x1.0 ecx") || m.contains("CPUID 0x7.0 ebx") || m.contains("XCR0"), "{m}");
            assert!(!m.contains("CPUID 0xb") && !m.contains("CPUID 0x1.0 ebx"), "APIC ids are not features: {m}");
        }
        Err(e) => panic!("loading a template from another CPU: {e:?}, expected CpuMismatch"),
        Ok(_) => panic!("a template from another CPU loaded"),
    }
    // Its template id differs, so `ensure` on the moved data directory builds a new template.
    let home = tempfile::tempdir().unwrap();
    let rebuilt =
        Template::ensure(&small, home.path()).unwrap_or_else(|e| panic!("Template::ensure on another CPU: {e}"));
    assert_ne!(rebuilt.info.id, host.info.id);
    assert_eq!(*rebuilt.cpu(), small_fp);
    assert_eq!(read_state(&rebuilt.dir.join("state")).unwrap().cpu, small_fp);
    let mut sb = rebuilt.fork(&small, Limits::default()).unwrap();
    let r = ok(&mut sb, "import numpy; print(int(numpy.arange(10).sum()))");
    assert_eq!(r.stdout, "45\n");
    drop(sb);
    // And reopening it there works (same CPU).
    Template::load(&small, &rebuilt.dir).unwrap_or_else(|e| panic!("reloading the rebuilt template: {e}"));

    // The host's checkpoint on the new template: refused with the same typed error.
    let layers = vec![forkbox_snapshot::Layer::read(&layer).unwrap()];
    match rebuilt.resume(&small, &layers, &state, Limits::default(), false) {
        Err(EngineError::Snapshot(StateError::CpuMismatch(why))) => assert!(why.contains("checkpoint"), "{why}"),
        Err(e) => panic!("resuming a checkpoint from another CPU: {e:?}, expected CpuMismatch"),
        Ok(_) => panic!("a checkpoint from another CPU resumed"),
    }
    // While on its own host it resumes as before.
    let mut sb = host.resume(engine(), &layers, &state, Limits::default(), false).unwrap();
    assert_eq!(ok(&mut sb, "print(x + 1)").stdout, "42\n");
}

/// What `forkbox run --trace-syscalls` prints: the partial / refused calls a run made, with their notes.
#[test]
fn run_stats_name_the_partial_and_refused_syscalls_a_run_made() {
    let _g = gate();
    let mut sb = fork(template(), Limits::default());
    let code = "import os, mmap\ntry:\n    os.setxattr('/tmp', 'user.k', b'v')\nexcept OSError as e:\n    print(e.errno)\nm = mmap.mmap(-1, 8192)\nm.close()";
    assert_eq!(ok(&mut sb, code).stdout, format!("{}\n", libc::EOPNOTSUPP));
    let stats = sb.stats();
    let find = |name: &str| stats.unsupported.iter().find(|u| u.name == name);
    let x = find("setxattr").unwrap_or_else(|| panic!("setxattr not reported: {:?}", stats.unsupported));
    assert_eq!((x.nr, x.calls, x.support), (188, 1, "refused"));
    assert!(x.note.starts_with("EOPNOTSUPP"), "{}", x.note);
    let m = find("mmap").unwrap_or_else(|| panic!("mmap not reported: {:?}", stats.unsupported));
    assert_eq!(m.support, "partial");
    assert!(m.calls >= 1 && !m.note.is_empty());
    assert!(find("read").is_none() && find("write").is_none(), "fully supported calls are not listed");
}

// ---------------------------------------------------------------------------
// 7. Many sequential forks
// ---------------------------------------------------------------------------

#[test]
fn two_hundred_sequential_forks() {
    let _g = gate();
    let t = template();
    let t0 = Instant::now();
    for i in 0..200 {
        let mut sb = fork(t, Limits::default());
        let r = ok(&mut sb, "print(1+1)");
        assert_eq!(r.stdout, "2\n", "fork {i}");
        assert_eq!(r.stderr, "", "fork {i}");
        assert_eq!(r.value, None, "fork {i}");
    }
    let took = t0.elapsed();
    eprintln!("200 sequential fork+exec in {:.2} s ({:.2} ms each)", took.as_secs_f64(), took.as_secs_f64() * 5.0);
}

// ---------------------------------------------------------------------------
// 8. Recycled VMs stay bounded
// ---------------------------------------------------------------------------

/// KVM VMs alive in this process (their fds).
fn live_kvm_vms() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).map(|l| l.to_string_lossy() == "anon_inode:kvm-vm").unwrap_or(false))
        .count()
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Recycled VMs are kept per thread. Threads that end (every `exec_batch`
/// call's workers; a thread per request) must not keep VMs alive for ever.
#[test]
fn recycled_vms_of_finished_threads_are_not_stranded() {
    let _g = gate_exclusive(); // counts process-wide fds: nothing else runs meanwhile
    let t = own_template();
    // Each fork dirties a few MiB, as real work would.
    let codes: Vec<String> = (0..4).map(|i| format!("x = bytearray(4 << 20)\nprint({i})")).collect();
    let settle = || std::thread::sleep(Duration::from_millis(500)); // reaper + pool refill
    for r in engine().exec_batch(&t, &codes, &Limits::default(), 2) {
        r.unwrap();
    }
    settle();
    let (vms0, rss0) = (live_kvm_vms(), rss_mib());
    let batches = 25;
    for _ in 0..batches {
        for (i, r) in engine().exec_batch(&t, &codes, &Limits::default(), 2).into_iter().enumerate() {
            assert_eq!(r.unwrap().stdout, format!("{i}\n"));
        }
    }
    settle();
    let (vms1, rss1) = (live_kvm_vms(), rss_mib());
    // One short-lived thread per sandbox.
    let threads = 25;
    for i in 0..threads {
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut sb = fork(&t, Limits::default());
                assert_eq!(ok(&mut sb, &codes[i % 4]).stdout, format!("{}\n", i % 4));
            });
        });
    }
    settle();
    let (vms2, rss2) = (live_kvm_vms(), rss_mib());
    drop(t);
    settle();
    let (vms3, rss3) = (live_kvm_vms(), rss_mib());
    eprintln!(
        "live KVM VMs / RSS: {vms0} / {rss0:.0} MiB at start; {vms1} / {rss1:.0} MiB after {batches} exec_batch calls (2 workers); \
         {vms2} / {rss2:.0} MiB after {threads} sandboxes on short-lived threads; {vms3} / {rss3:.0} MiB once the template is dropped"
    );
    assert!(
        vms1 <= vms0 + 8 && vms2 <= vms1 + 8,
        "VMs pile up: {vms0} -> {vms1} after {batches} exec_batch calls, -> {vms2} after {threads} sandboxes on \
         short-lived threads (RSS {rss0:.0} -> {rss1:.0} -> {rss2:.0} MiB): the recycled VMs of finished threads \
         are never reused nor freed until the template is dropped ({vms3} VMs then)"
    );
}
