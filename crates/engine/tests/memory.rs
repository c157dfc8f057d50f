//! Guest memory is what the guest mapped, enforced by the page tables, and
//! host memory follows: real KVM guests (forks of the numpy template) touching
//! what they did not map, syscalls given bad buffers, read-only and PROT_NONE
//! mappings, the mremap wrap, and recycled VMs after large writes.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME`). Without KVM they FAIL: they are never skipped.
//! Host memory is measured with /proc/self/smaps_rollup, so the tests that do
//! hold a lock exclusively (nothing else in this binary runs meanwhile).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::sync::atomic::Ordering;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use forkbox_engine::{Engine, EngineError, Limits, Sandbox, Template};
use forkbox_testkit::guest::{ok, value};

const MIB: u64 = 1 << 20;

/// The shared engine + template of this test binary (KVM checked, never skipped).
fn shared() -> &'static forkbox_testkit::Shared {
    forkbox_testkit::shared()
}

fn engine() -> &'static Engine {
    &shared().engine
}

static GATE: RwLock<()> = RwLock::new(());

fn gate() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|e| e.into_inner())
}

fn gate_exclusive() -> RwLockWriteGuard<'static, ()> {
    GATE.write().unwrap_or_else(|e| e.into_inner())
}

/// A Template of its own (own pool and counters) over the shared template's files.
fn own_template() -> Template {
    Template::load(engine(), &shared().template.dir).unwrap_or_else(|e| panic!("Template::load: {e}"))
}

#[track_caller]
fn fork(t: &Template, limits: Limits) -> Sandbox {
    t.fork(engine(), limits).unwrap_or_else(|e| panic!("fork failed: {e}"))
}

#[track_caller]
fn crash(sb: &mut Sandbox, code: &str) -> String {
    match sb.exec(code) {
        Err(EngineError::GuestCrashed(msg)) => msg,
        other => panic!("expected Err(GuestCrashed), got {other:?}\n--- code ---\n{code}"),
    }
}

/// A field of /proc/self/smaps_rollup, in KiB.
fn rollup(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").expect("smaps_rollup");
    s.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|v| v.strip_prefix(':')))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in smaps_rollup"))
}

struct Mem {
    rss: u64,
    pss: u64,
    anon: u64,
}

fn mem_now() -> Mem {
    Mem { rss: rollup("Rss"), pss: rollup("Pss"), anon: rollup("Anonymous") }
}

const LIBC: &str = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n\
libc.mmap.restype = ctypes.c_void_p\n\
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
libc.mremap.restype = ctypes.c_void_p\n\
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]\n\
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n\
libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]\n\
libc.read.restype = ctypes.c_ssize_t\n\
libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]\n\
libc.write.restype = ctypes.c_ssize_t\n\
MAP_FAILED = 2**64 - 1\n\
def anon(n, prot=3):\n    p = libc.mmap(None, n, prot, 0x22, -1, 0)\n    assert p not in (None, MAP_FAILED), ctypes.get_errno()\n    return p\n";

/// The attack: a 64 MiB guest writes 1 GiB at an address it never mapped.
#[test]
fn wild_write_is_sigsegv_with_its_address_and_host_memory_stays_bounded() {
    let _g = gate_exclusive();
    let t = own_template();
    let limits = Limits { memory_bytes: 64 * MIB, ..Limits::default() };
    // Warm up: the fork path itself (pool VM, first touches) is not the attack.
    drop(fork(&t, limits.clone()).exec("1"));
    let before = mem_now();
    let mut sb = fork(&t, limits.clone());
    let t0 = Instant::now();
    let msg = crash(&mut sb, "import ctypes\nctypes.memset(0x80000000, 0x5A, 1 << 30)");
    let during = mem_now();
    drop(sb);
    eprintln!(
        "wild write: {msg} ({:.0} ms); host RSS {} -> {} KiB, PSS {} -> {} KiB, anonymous {} -> {} KiB",
        t0.elapsed().as_secs_f64() * 1000.0,
        before.rss,
        during.rss,
        before.pss,
        during.pss,
        before.anon,
        during.anon
    );
    assert!(msg.contains("0x80000000"), "the crash report names the address: {msg}");
    assert!(msg.contains("writing") && msg.contains("SIGSEGV"), "{msg}");
    // Not one page of the 1 GiB: a few MiB for the fork's own work at most.
    assert!(during.pss < before.pss + 16 * 1024, "PSS grew {} KiB", during.pss - before.pss);
    assert!(during.anon < before.anon + 16 * 1024, "anonymous memory grew {} KiB", during.anon - before.anon);

    // The strongest form: map all the limit allows, touch every page, then write wild.
    let mut sb = fork(&t, limits.clone());
    let code = format!(
        "{LIBC}\nblocks = []\nwhile True:\n    p = libc.mmap(None, 4 << 20, 3, 0x22, -1, 0)\n    if p in (None, MAP_FAILED):\n        break\n    \
         ctypes.memset(p, 0x5A, 4 << 20)\n    blocks.append(p)\nlen(blocks)"
    );
    let blocks: u64 = value(&mut sb, &code).parse().unwrap();
    let full = mem_now();
    let msg = crash(&mut sb, "ctypes.memset(0x90000000, 0x5A, 1 << 30)");
    let after = mem_now();
    drop(sb);
    let committed_mib = blocks * 4;
    eprintln!(
        "64 MiB guest mapped {committed_mib} MiB more and touched it: PSS {} -> {} KiB; after the wild write {} KiB ({msg})",
        before.pss, full.pss, after.pss
    );
    assert!(msg.contains("0x90000000"), "{msg}");
    // Host memory for this sandbox stays within its limit plus the fixed
    // overhead (system area 2 MiB, page tables <= 8 MiB, VMM state).
    let bound_kib = (64 + 16) * 1024;
    assert!(full.pss < before.pss + bound_kib, "PSS grew {} KiB under a 64 MiB limit", full.pss - before.pss);
    assert!(after.pss <= full.pss + 1024, "the wild write added {} KiB", after.pss.saturating_sub(full.pss));
}

#[test]
fn syscall_buffers_outside_mappings_are_efault() {
    let _g = gate();
    let t = &shared().template;
    let mut sb = fork(t, Limits::default());
    let code = format!(
        "{LIBC}\nopen('/tmp/data', 'wb').write(b'hello world')\nfd = os.open('/tmp/data', os.O_RDONLY)\n\
         def err(r):\n    return -1 if r >= 0 else ctypes.get_errno()\n\
         ro = anon(4096, 1)\nnone = anon(4096, 0)\nrw = anon(8192)\n\
         res = {{\n 'unmapped': err(libc.read(fd, 0x80000000, 4096)),\n 'null': err(libc.read(fd, 0, 16)),\n \
         'system_area': err(libc.read(fd, 0x1000, 16)),\n 'read_only': err(libc.read(fd, ro, 16)),\n 'prot_none': err(libc.read(fd, none, 16)),\n \
         'straddles': err(libc.read(fd, rw + 4096 + 4090, 16)),\n 'write_from_none': err(libc.write(1, none, 4)),\n \
         'write_from_ro': libc.write(1, ro, 4),\n 'path_unmapped': err(libc.open(ctypes.c_void_p(0x80000000), 0)),\n}}\n\
         os.lseek(fd, 0, 0)\nres['rw'] = libc.read(fd, rw, 5)\nres['data'] = ctypes.string_at(rw, 5)\nres"
    );
    let v = value(&mut sb, &code);
    // EFAULT is 14; reading from a read-only mapping is fine (4 bytes written to stdout).
    for key in
        ["unmapped", "null", "system_area", "read_only", "prot_none", "straddles", "write_from_none", "path_unmapped"]
    {
        assert!(v.contains(&format!("'{key}': 14")), "{key} must be EFAULT: {v}");
    }
    assert!(v.contains("'write_from_ro': 4") && v.contains("'rw': 5") && v.contains("b'hello'"), "{v}");
    // Still alive and well.
    assert_eq!(value(&mut sb, "import numpy as np\nint(np.arange(10).sum())"), "45");
}

#[test]
fn protections_are_enforced_by_the_mmu() {
    let _g = gate();
    let t = &shared().template;
    // A write to a PROT_READ mapping faults (SEGV_ACCERR), with the address.
    let mut sb = fork(t, Limits::default());
    let p: u64 = value(&mut sb, &format!("{LIBC}\nro = anon(4096, 1)\nctypes.string_at(ro, 4)\nro")).parse().unwrap();
    let msg = crash(&mut sb, "ctypes.memset(ro, 1, 1)");
    assert!(msg.contains(&format!("writing address {p:#x}")) && msg.contains("SIGSEGV"), "{msg}");

    // Downgrades take effect although the page was written before (the
    // hypervisor's cached writable translation is dropped).
    let mut sb = fork(t, Limits::default());
    let p: u64 = value(
        &mut sb,
        &format!("{LIBC}\nrw = anon(8192)\nctypes.memset(rw, 7, 8192)\nassert libc.mprotect(rw, 4096, 1) == 0\nrw"),
    )
    .parse()
    .unwrap();
    assert_eq!(value(&mut sb, "ctypes.string_at(rw, 2) + ctypes.string_at(rw + 4096, 2)"), "b'\\x07\\x07\\x07\\x07'");
    ok(&mut sb, "ctypes.memset(rw + 4096, 8, 16)");
    let msg = crash(&mut sb, "ctypes.memset(rw + 8, 9, 1)");
    assert!(msg.contains(&format!("writing address {:#x}", p + 8)), "{msg}");

    // PROT_NONE after use: reads fault too; munmap'd memory faults.
    let mut sb = fork(t, Limits::default());
    let p: u64 = value(
        &mut sb,
        &format!("{LIBC}\nrw = anon(4096)\nctypes.memset(rw, 7, 4096)\nassert libc.mprotect(rw, 4096, 0) == 0\nrw"),
    )
    .parse()
    .unwrap();
    let msg = crash(&mut sb, "ctypes.string_at(rw, 1)");
    assert!(msg.contains(&format!("reading address {p:#x}")), "{msg}");
    let mut sb = fork(t, Limits::default());
    let p: u64 = value(&mut sb, &format!("{LIBC}\nrw = anon(1 << 21)\nctypes.memset(rw, 7, 1 << 21)\nassert libc.munmap(ctypes.c_void_p(rw), 1 << 21) == 0\nrw")).parse().unwrap();
    let msg = crash(&mut sb, "ctypes.string_at(rw + 4096, 1)");
    assert!(msg.contains(&format!("reading address {:#x}", p + 4096)), "{msg}");

    // No PROT_EXEC: jumping into written code faults (instruction fetch).
    let mut sb = fork(t, Limits::default());
    let msg = crash(
        &mut sb,
        &format!("{LIBC}\nrw = anon(4096)\nctypes.memmove(rw, b'\\xc3', 1)\nf = ctypes.CFUNCTYPE(None)(rw)\nf()"),
    );
    assert!(
        msg.contains("page fault") && msg.contains("error code 0x15"),
        "an instruction fetch from a no-execute page: {msg}"
    );
    // With PROT_EXEC it runs (ret).
    let mut sb = fork(t, Limits::default());
    ok(&mut sb, &format!("{LIBC}\nrw = anon(4096, 7)\nctypes.memmove(rw, b'\\xc3', 1)\nctypes.CFUNCTYPE(None)(rw)()"));
}

#[test]
fn faulthandler_crash_is_reported_with_the_address() {
    let _g = gate();
    let t = &shared().template;
    let mut sb = fork(t, Limits::default());
    ok(&mut sb, "import faulthandler, ctypes\nfaulthandler.enable()");
    let msg = crash(&mut sb, "def f():\n    return ctypes.string_at(0x80000000, 1)\nf()");
    eprintln!("{msg}");
    // The guest's handler ran (its traceback is in the report) and re-raised SIGSEGV.
    assert!(msg.contains("reading address 0x80000000") && msg.contains("SIGSEGV"), "{msg}");
    assert!(msg.contains("Fatal Python error: Segmentation fault") && msg.contains("in f"), "{msg}");
    // A sibling fork is unaffected.
    let mut sb = fork(t, Limits::default());
    assert_eq!(value(&mut sb, "6 * 7"), "42");
}

#[test]
fn a_handler_gets_siginfo_and_can_recover() {
    let _g = gate();
    let t = &shared().template;
    let mut sb = fork(t, Limits::default());
    // A C-level handler (through ctypes) that records si_addr and si_code and
    // makes the page writable, so the faulting write succeeds when retried.
    let code = format!(
        "{LIBC}\nimport signal\nseen = []\npage = anon(4096, 1)\n\
         HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)\n\
         def on_segv(sig, info, uc):\n    code = ctypes.c_int.from_address(info + 8).value\n    addr = ctypes.c_uint64.from_address(info + 16).value\n    \
         seen.append((sig, code, addr))\n    libc.mprotect(addr & ~4095, 4096, 3)\n\
         h = HANDLER(on_segv)\n\
         libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]\n\
         class KSA(ctypes.Structure):\n    _fields_ = [('handler', ctypes.c_void_p), ('mask', ctypes.c_ulong * 16), ('flags', ctypes.c_int), ('restorer', ctypes.c_void_p)]\n\
         sa = KSA()\nsa.handler = ctypes.cast(h, ctypes.c_void_p).value\nsa.flags = 4 | 0x40000000\n\
         assert libc.sigaction(signal.SIGSEGV, ctypes.byref(sa), None) == 0\n\
         ctypes.memset(page + 100, 0x41, 1)\n(seen, ctypes.string_at(page + 100, 1), page)"
    );
    let r = ok(&mut sb, &code);
    let v = r.value.unwrap();
    let page: u64 = v.rsplit(", ").next().unwrap().trim_end_matches(')').parse().unwrap();
    // SIGSEGV (11), SEGV_ACCERR (2), the faulting address.
    assert!(v.starts_with(&format!("([(11, 2, {})], b'A'", page + 100)), "{v}");
}

/// The observed bug: `mremap(a, 4096, 2**64 + 4096 - committed, 0)` wrapped the
/// committed count, after which far more than the limit could be mapped.
#[test]
fn mremap_length_wrap_is_refused() {
    let _g = gate();
    let t = &shared().template;
    let mut sb = fork(t, Limits { memory_bytes: 128 * MIB, ..Limits::default() });
    let code = format!(
        "{LIBC}\na = anon(4096)\nbad = []\nfor c in range(1 << 20, 4 << 30, 1 << 20):\n    for flags in (0, 1):\n        \
         r = libc.mremap(a, 4096, 2**64 + 4096 - c, flags)\n        if r not in (None, MAP_FAILED):\n            bad.append((c, r))\n\
         (bad, ctypes.get_errno())"
    );
    assert_eq!(value(&mut sb, &code), "([], 12)", "every wrapping length is ENOMEM");
    // The limit still holds: 640 MiB do not map under 128 MiB.
    let v = value(&mut sb, "p = libc.mmap(None, 640 << 20, 3, 0x22, -1, 0)\n(p == MAP_FAILED, ctypes.get_errno())");
    assert_eq!(v, "(True, 12)");
    // Normal mremap growth and moves still work, data intact.
    let v = value(
        &mut sb,
        "b = anon(8192)\nctypes.memset(b, 0x33, 8192)\nc = libc.mremap(b, 8192, 3 << 20, 1)\n\
         (c not in (None, MAP_FAILED), ctypes.string_at(c, 4) + ctypes.string_at(c + 8188, 4))",
    );
    assert_eq!(v, "(True, b'33333333')");
}

/// One-shot execs that each write 1 GiB leave nothing behind once their VMs are recycled.
#[test]
fn recycled_vms_give_large_writes_back() {
    let _g = gate_exclusive();
    let t = own_template();
    let gib_write = "b = b'\\x01' * (1 << 30)\nlen(b)";
    // Warm up the recycling path on this thread.
    for _ in 0..2 {
        let mut sb = fork(&t, Limits::default());
        assert_eq!(value(&mut sb, "1 + 1"), "2");
    }
    let before = mem_now();
    for i in 0..4 {
        let mut sb = fork(&t, Limits::default());
        assert_eq!(value(&mut sb, gib_write), (1u64 << 30).to_string(), "exec {i}");
    }
    let after = mem_now();
    let s = t.pool_stats();
    let (dropped, held, bound) = (
        s.pages_dropped.load(Ordering::SeqCst),
        s.recycled_private_bytes.load(Ordering::SeqCst),
        t.max_recycled_bytes(),
    );
    eprintln!(
        "4 one-shot 1 GiB writes: anonymous {} -> {} KiB, RSS {} -> {} KiB; resets dropped {dropped} pages; \
         recycled VMs hold {} KiB privately (bound {} KiB)",
        before.anon,
        after.anon,
        before.rss,
        after.rss,
        held / 1024,
        bound / 1024
    );
    assert!(dropped >= 4 * (1 << 18), "each reset gave the 1 GiB back ({dropped} pages dropped)");
    assert!(
        after.anon < before.anon + 64 * 1024,
        "anonymous memory grew {} KiB",
        after.anon.saturating_sub(before.anon)
    );
    assert!(held <= bound, "recycled VMs hold {held} bytes, more than the bound {bound}");
    // A recycled VM works and sees none of it.
    let mut sb = fork(&t, Limits::default());
    assert_eq!(value(&mut sb, "'b' in globals()"), "False");
    assert_eq!(value(&mut sb, "import numpy as np\nint(np.ones(1 << 20, dtype=np.int64).sum())"), "1048576");
}

/// A recycled VM faults where its predecessor had mapped memory.
#[test]
fn recycled_vms_do_not_keep_their_predecessors_mappings() {
    let _g = gate_exclusive();
    let t = own_template();
    let mut sb = fork(&t, Limits::default());
    let p: u64 =
        value(&mut sb, &format!("{LIBC}\np = anon(4 << 20)\nctypes.memset(p, 7, 4 << 20)\np")).parse().unwrap();
    drop(sb);
    let recycled = t.pool_stats().recycled_hits.load(Ordering::SeqCst);
    let mut sb = fork(&t, Limits::default());
    assert_eq!(t.pool_stats().recycled_hits.load(Ordering::SeqCst), recycled + 1, "the next fork got the recycled VM");
    let msg = crash(&mut sb, &format!("import ctypes\nctypes.memset({p}, 1, 1)"));
    assert!(msg.contains(&format!("writing address {p:#x}")), "{msg}");
}

#[test]
fn file_mappings_numpy_and_big_arrays_still_work() {
    let _g = gate();
    let t = &shared().template;
    let mut sb = fork(t, Limits::default());
    let v = value(
        &mut sb,
        "import mmap, numpy as np\nwith open('/tmp/m', 'w+b') as f:\n    f.write(b'x' * 10000)\n    f.flush()\n    \
         m = mmap.mmap(f.fileno(), 0)\n    m[5000:5003] = b'abc'\n    m.flush()\n    first = m[:2]\n    m.close()\n\
         a = np.arange(3 << 20, dtype=np.float64)\nb = a.reshape(3, -1).sum(axis=1)\n\
         (first, open('/tmp/m', 'rb').read()[4999:5004], int(b[0]), float(np.linalg.norm(np.eye(50))))",
    );
    assert_eq!(v, "(b'xx', b'xabcx', 549755289600, 7.0710678118654755)");
}

/// What a live fork holds of its own is mostly the guest pages its first exec
/// wrote. The template has run the exec path already (the agent's warm-up
/// before the snapshot), the reseed does not run numpy's SeedSequence, the
/// agent's JSON and a one-expression exec skip Python-level code, and the
/// template's scattered free blocks are used up before the snapshot, so a
/// fork + `print(1+1)` on a VM that is not recycled writes under 220 pages
/// (~160; it wrote ~288 before); and the warm-up leaves nothing an exec sees.
#[test]
fn fork_and_exec_write_few_pages_and_leave_no_warm_up_trace() {
    let _g = gate();
    let t = own_template();
    // This template's first fork: a VM of its pool or a new one, never recycled.
    let mut sb = fork(&t, Limits::default());
    assert_eq!(ok(&mut sb, "print(1+1)").stdout, "2\n");
    let written = sb.memory_footprint().private_pages;
    assert!(written <= 220, "fork + print(1+1) wrote {written} pages (at most 220 expected)");
    // A statement goes the other way (through the AST): it works, and it is cheap too.
    let before = sb.memory_footprint().private_pages;
    assert_eq!(ok(&mut sb, "x = 6 * 7\nprint(x)").stdout, "42\n");
    let more = sb.memory_footprint().private_pages - before;
    assert!(more <= 120, "a second exec, of statements, wrote {more} more pages");
    assert_eq!(
        ok(&mut sb, "print('_' in globals(), sorted(k for k in globals() if not k.startswith('__')))").stdout,
        "False ['numpy', 'x']\n",
        "the user's namespace holds the preload's names only"
    );
    assert_eq!(
        value(&mut sb, "import linecache\nsorted(k for k in linecache.cache if k.startswith('<exec-'))"),
        "['<exec-1>', '<exec-2>', '<exec-3>', '<exec-4>']",
        "exec numbering starts at 1 and no warm-up source is left"
    );
    let e = sb.exec("1/0").unwrap().error.unwrap();
    assert!(e.traceback.contains("<exec-5>"), "{}", e.traceback);
}
