//! End-to-end tests of the guest: CPython + numpy running in a kernel-less KVM
//! sandbox, driven through `Engine` / `Sandbox`.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
//!
//! One `Engine` is shared by the whole binary; every test boots its own
//! sandbox(es).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use forkbox_engine::{Engine, EngineError, ExecResult, Limits, Sandbox};
use forkbox_testkit::guest::{ok, run, value};

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

/// An environment variable set in the host test process before any sandbox
/// boots: the guest must never see it.
const HOST_SECRET_VAR: &str = "FORKBOX_GUEST_TEST_HOST_SECRET";

fn host_secret() -> String {
    format!("host-secret-{}-7f3a9c", std::process::id())
}

struct Shared {
    engine: Engine,
    image_path: PathBuf,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        forkbox_testkit::require_kvm();
        // Set before the first sandbox exists (and while every other test is
        // blocked on this OnceLock): the guest environment must not inherit it.
        std::env::set_var(HOST_SECRET_VAR, host_secret());
        let image_path = forkbox_testkit::image_path();
        let engine =
            Engine::open(&image_path).unwrap_or_else(|e| panic!("Engine::open({}): {e}", image_path.display()));
        Shared { engine, image_path }
    })
}

fn engine() -> &'static Engine {
    &shared().engine
}

fn boot_with(limits: Limits) -> Sandbox {
    let t0 = Instant::now();
    let sb = engine().boot(limits).unwrap_or_else(|e| panic!("boot failed: {e}"));
    eprintln!("booted in {:.2} s", t0.elapsed().as_secs_f64());
    sb
}

fn boot() -> Sandbox {
    boot_with(Limits::default())
}

/// Exec that must raise a Python exception of type `kind`; returns the result.
#[track_caller]
fn raises(sb: &mut Sandbox, code: &str, kind: &str) -> ExecResult {
    let r = run(sb, code);
    match &r.error {
        Some(e) if e.kind == kind => r,
        Some(e) => panic!("expected {kind}, got {}: {}\n{}\n--- code ---\n{code}", e.kind, e.message, e.traceback),
        None => panic!(
            "expected {kind}, got no exception (value {:?}, stdout {:?})\n--- code ---\n{code}",
            r.value, r.stdout
        ),
    }
}

/// The sandbox is poisoned: every further exec is `Err(Poisoned)`.
#[track_caller]
fn assert_poisoned(sb: &mut Sandbox) {
    for _ in 0..2 {
        match sb.exec("1 + 1") {
            Err(EngineError::Poisoned(why)) => assert!(!why.is_empty(), "Poisoned with an empty reason"),
            other => panic!("expected Err(Poisoned) after a failed exec, got {other:?}"),
        }
    }
}

/// A new sandbox from the shared engine works (after another one failed).
#[track_caller]
fn fresh_sandbox(limits: Limits) -> Sandbox {
    let mut sb = boot_with(limits);
    assert_eq!(value(&mut sb, "import numpy as np\nint(np.arange(5).sum())"), "10");
    sb
}

fn host_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// A host directory with a file the guest must never be able to reach.
fn host_marker_dir(tag: &str) -> (PathBuf, PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("forkbox-guest-test-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret.txt");
    let content = format!("host-only content {tag} {}", std::process::id());
    std::fs::write(&file, &content).unwrap();
    (dir, file, content)
}

/// A Python string literal for `s`.
fn py_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

// ---------------------------------------------------------------------------
// 1. Python and numpy start
// ---------------------------------------------------------------------------

#[test]
fn python_311_and_numpy_start() {
    let mut sb = boot();
    let info = sb.ready_info.clone();
    assert_eq!(info["ready"], serde_json::Value::Bool(true), "ready_info: {info}");
    let py = info["python"].as_str().unwrap_or_else(|| panic!("ready_info has no python version: {info}"));
    assert!(py.starts_with("3.11"), "python version {py:?}");
    let np_version = info["numpy"].as_str().unwrap_or_else(|| panic!("ready_info has no numpy version: {info}"));
    assert!(
        !np_version.is_empty() && np_version.split('.').take(2).all(|p| p.parse::<u32>().is_ok()),
        "numpy version {np_version:?}"
    );

    let v = value(&mut sb, "import sys\nsys.version");
    assert!(v.starts_with("'3.11"), "sys.version = {v}");
    assert_eq!(value(&mut sb, "sys.version_info[:2]"), "(3, 11)");
    assert_eq!(value(&mut sb, "import numpy\nnumpy.__version__"), format!("'{np_version}'"));
    assert_eq!(value(&mut sb, "import numpy as np\nnp.__name__"), "'numpy'");
    assert_eq!(value(&mut sb, "sys.executable"), "'/usr/bin/python3'");
    // The preload ran in the session namespace.
    assert_eq!(value(&mut sb, "'numpy' in sys.modules"), "True");
}

// ---------------------------------------------------------------------------
// 2. numpy numerics against known values
// ---------------------------------------------------------------------------

#[test]
fn numpy_linear_algebra_known_values() {
    let mut sb = boot();
    ok(
        &mut sb,
        r#"
import numpy as np
def check(name, got, want, tol=1e-9):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.allclose(got, want, rtol=tol, atol=tol), (name, got.tolist(), want.tolist())
    return True
"#,
    );

    assert_eq!(value(&mut sb, "np.linalg.solve([[3, 1], [1, 2]], [9, 8]).round(12).tolist()"), "[2.0, 3.0]");
    assert_eq!(value(&mut sb, "check('solve', np.linalg.solve([[3., 1.], [1., 2.]], [9., 8.]), [2., 3.])"), "True");
    assert_eq!(value(&mut sb, "round(float(np.linalg.det([[1., 2.], [3., 4.]])), 12)"), "-2.0");
    assert_eq!(value(&mut sb, "check('det3', np.linalg.det([[2., 0, 0], [0, 3, 0], [0, 0, 4]]), 24.0)"), "True");
    assert_eq!(value(&mut sb, "check('inv', np.linalg.inv([[4., 7.], [2., 6.]]), [[0.6, -0.7], [-0.2, 0.4]])"), "True");
    assert_eq!(value(&mut sb, "check('eigvalsh', np.linalg.eigvalsh([[2., 1.], [1., 2.]]), [1., 3.])"), "True");
    assert_eq!(
        value(
            &mut sb,
            "w, v = np.linalg.eigh([[2., 1.], [1., 2.]])\ncheck('eigh', np.abs(v), np.full((2, 2), 0.5 ** 0.5))"
        ),
        "True"
    );
    assert_eq!(
        value(&mut sb, "check('eigvals', np.sort(np.linalg.eigvals([[4., 1.], [2., 3.]]).real), [2., 5.])"),
        "True"
    );
    assert_eq!(
        value(&mut sb, "check('svd', np.linalg.svd([[3., 0.], [0., -4.]], compute_uv=False), [4., 3.])"),
        "True"
    );
    assert_eq!(
        value(&mut sb, "check('cholesky', np.linalg.cholesky([[4., 2.], [2., 3.]]), [[2., 0.], [1., 2. ** 0.5]])"),
        "True"
    );
    assert_eq!(value(&mut sb, "check('norm', np.linalg.norm([3., 4.]), 5.)"), "True");
    assert_eq!(
        value(
            &mut sb,
            "check('lstsq', np.linalg.lstsq([[0., 1.], [1., 1.], [2., 1.]], [1., 3., 5.], rcond=None)[0], [2., 1.])"
        ),
        "True"
    );
    assert_eq!(
        value(&mut sb, "q, r = np.linalg.qr([[1., 2.], [3., 4.]])\ncheck('qr', q @ r, [[1., 2.], [3., 4.]])"),
        "True"
    );

    // matmul of arange matrices, hand computed.
    assert_eq!(
        value(&mut sb, "(np.arange(6).reshape(2, 3) @ np.arange(6).reshape(3, 2)).tolist()"),
        "[[10, 13], [28, 40]]"
    );
    assert_eq!(
        value(&mut sb, "a = np.arange(9.).reshape(3, 3)\n(a @ a).tolist()"),
        "[[15.0, 18.0, 21.0], [42.0, 54.0, 66.0], [69.0, 90.0, 111.0]]"
    );
    assert_eq!(value(&mut sb, "int(np.dot(np.arange(4), np.arange(4)))"), "14");
    // A bigger BLAS/LAPACK workout: a diagonally dominant 200x200 system.
    assert_eq!(
        value(
            &mut sb,
            "A = np.eye(200) * 200 + (np.arange(40000.).reshape(200, 200) % 7)\n\
             b = A @ np.ones(200)\n\
             check('solve200', np.linalg.solve(A, b), np.ones(200), 1e-8) and check('inv200', A @ np.linalg.inv(A), np.eye(200), 1e-8)"
        ),
        "True"
    );

    // A singular matrix raises numpy's LinAlgError as a normal result.
    let r = raises(&mut sb, "np.linalg.inv(np.zeros((2, 2)))", "LinAlgError");
    assert!(r.error.unwrap().message.contains("Singular matrix"));

    // Other deterministic numerics.
    assert_eq!(value(&mut sb, "int(np.arange(10**6).sum())"), "499999500000");
    assert_eq!(value(&mut sb, "float(np.arange(1, 101).mean())"), "50.5");
    assert_eq!(value(&mut sb, "float(np.ones(10**7).sum())"), "10000000.0");
    assert_eq!(value(&mut sb, "check('fft', np.fft.fft([1., 0., 0., 0.]), np.ones(4))"), "True");
    assert_eq!(value(&mut sb, "check('fft2', np.fft.fft([1., 1., 1., 1.]), [4., 0., 0., 0.])"), "True");
    assert_eq!(
        value(
            &mut sb,
            "check('trig', [np.sin(np.pi / 2), np.cos(0.), np.exp(0.), np.log(np.e)], [1., 1., 1., 1.], 1e-15)"
        ),
        "True"
    );
    assert_eq!(value(&mut sb, "np.sort(np.array([3, 1, 2])).tolist()"), "[1, 2, 3]");
    assert_eq!(value(&mut sb, "np.unique([3, 1, 3, 2, 1]).tolist()"), "[1, 2, 3]");
    assert_eq!(value(&mut sb, "np.cumsum([1, 2, 3, 4]).tolist()"), "[1, 3, 6, 10]");
    assert_eq!(value(&mut sb, "np.array([[1, 2], [3, 4]]).T.tolist()"), "[[1, 3], [2, 4]]");
    assert_eq!(value(&mut sb, "str(np.array([1.5, 2.0]).dtype)"), "'float64'");
}

// ---------------------------------------------------------------------------
// 3. REPL shapes
// ---------------------------------------------------------------------------

#[test]
fn repl_values_and_output_streams() {
    let mut sb = boot();
    // Trailing expression -> repr.
    let r = ok(&mut sb, "1+1");
    assert_eq!(r.value.as_deref(), Some("2"));
    assert_eq!(r.stdout, "");
    assert_eq!(r.stderr, "");
    assert_eq!(value(&mut sb, "'a'"), "'a'");
    assert_eq!(value(&mut sb, "[1, 'b', None, 2.5]"), "[1, 'b', None, 2.5]");
    assert_eq!(value(&mut sb, "x = 10\ny = 32\nx + y"), "42");
    // Statements only -> None.
    assert_eq!(ok(&mut sb, "z = 1").value, None);
    assert_eq!(ok(&mut sb, "def f():\n    return 5\n").value, None);
    assert_eq!(ok(&mut sb, "for i in range(3):\n    i\n").value, None);
    assert_eq!(ok(&mut sb, "").value, None);
    assert_eq!(ok(&mut sb, "# only a comment\n").value, None);
    // Expressions evaluating to None -> None.
    assert_eq!(ok(&mut sb, "None").value, None);
    assert_eq!(ok(&mut sb, "[].append(1)").value, None);
    // `_` holds the last value.
    assert_eq!(value(&mut sb, "6 * 7"), "42");
    assert_eq!(value(&mut sb, "_ + 1"), "43");

    // print() output is captured, not part of the value.
    let r = ok(&mut sb, "print('hello')");
    assert_eq!(r.value, None);
    assert_eq!(r.stdout, "hello\n");
    assert_eq!(r.stderr, "");

    // stdout and stderr are captured separately and in order within each.
    let r = ok(
        &mut sb,
        "import sys\nprint('out 1')\nprint('err 1', file=sys.stderr)\nsys.stdout.write('out 2\\n')\nsys.stderr.write('err 2\\n')\nprint('out 3', end='')\n'done'",
    );
    assert_eq!(r.stdout, "out 1\nout 2\nout 3");
    assert_eq!(r.stderr, "err 1\nerr 2\n");
    assert_eq!(r.value.as_deref(), Some("'done'"));
    // Output does not leak into the next exec.
    let r = ok(&mut sb, "2");
    assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("", ""));
    // Non-ASCII text round trips.
    let r = ok(&mut sb, "print('héllo wörld € 日本')\n'ünïcode'");
    assert_eq!(r.stdout, "héllo wörld € 日本\n");
    assert_eq!(r.value.as_deref(), Some("'ünïcode'"));
    // Raw writes to fds 1 and 2 are captured like print().
    let r = ok(&mut sb, "import os\nn = os.write(1, b'raw out\\n') + os.write(2, b'raw err\\n')");
    assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("raw out\n", "raw err\n"));
    // stdin is empty: reading it ends at once instead of hanging.
    raises(&mut sb, "input()", "EOFError");
    assert_eq!(value(&mut sb, "sys.stdin.read()"), "''");
    // Bookkeeping fields are sane.
    assert!(r.wall_ms >= 0.0 && r.runtime_ms >= 0.0, "{r:?}");
    assert!(r.runtime_ms <= r.wall_ms + 1.0, "runtime {} > wall {}", r.runtime_ms, r.wall_ms);
}

#[test]
fn exceptions_are_results_with_tracebacks() {
    let mut sb = boot();
    let r = raises(&mut sb, "print('before')\na = 1\nb = a / 0\nprint('after')", "ZeroDivisionError");
    assert_eq!(r.stdout, "before\n", "output before the exception is kept, none after");
    assert_eq!(r.value, None);
    let e = r.error.unwrap();
    assert_eq!(e.message, "division by zero");
    assert!(e.traceback.starts_with("Traceback (most recent call last):"), "{}", e.traceback);
    assert!(e.traceback.contains("File \"<exec-"), "{}", e.traceback);
    assert!(e.traceback.contains("line 3"), "{}", e.traceback);
    assert!(e.traceback.contains("b = a / 0"), "source line missing:\n{}", e.traceback);
    assert!(e.traceback.trim_end().ends_with("ZeroDivisionError: division by zero"), "{}", e.traceback);
    assert!(!e.traceback.contains("agent.py"), "agent frames leak into the traceback:\n{}", e.traceback);

    // The sandbox is fine afterwards and the code before the error ran.
    assert_eq!(value(&mut sb, "a"), "1");

    // A function defined in an earlier exec: the traceback shows both sources.
    ok(&mut sb, "def g(n):\n    return n // (n - n)\n");
    let e = raises(&mut sb, "g(3)", "ZeroDivisionError").error.unwrap();
    assert!(e.traceback.contains("return n // (n - n)"), "{}", e.traceback);
    assert!(e.traceback.contains("g(3)"), "{}", e.traceback);
    assert!(e.traceback.contains("integer division or modulo by zero"), "{}", e.traceback);

    // Other exception types.
    let e = raises(&mut sb, "{}['missing']", "KeyError").error.unwrap();
    assert_eq!(e.message, "'missing'");
    let e = raises(&mut sb, "raise ValueError('custom message')", "ValueError").error.unwrap();
    assert_eq!(e.message, "custom message");
    let e = raises(&mut sb, "undefined_name", "NameError").error.unwrap();
    assert!(e.message.contains("undefined_name"), "{}", e.message);
    let e = raises(&mut sb, "class MyErr(Exception): pass\nraise MyErr('mine')", "MyErr").error.unwrap();
    assert_eq!(e.message, "mine");
    raises(&mut sb, "import no_such_module_xyz", "ModuleNotFoundError");
    // BaseExceptions too: sys.exit() is a result, not the end of the guest.
    let e = raises(&mut sb, "import sys\nsys.exit(3)", "SystemExit").error.unwrap();
    assert_eq!(e.message, "3");
    raises(&mut sb, "raise KeyboardInterrupt", "KeyboardInterrupt");
    // Deep recursion is a RecursionError, not a crash.
    raises(&mut sb, "def r(n):\n    return r(n + 1)\nr(0)", "RecursionError");

    // SyntaxError: nothing of the code runs.
    let r = raises(&mut sb, "syntax_probe = 5\ny = (", "SyntaxError");
    let e = r.error.unwrap();
    assert!(e.traceback.contains("<exec-"), "{}", e.traceback);
    assert!(e.traceback.contains("SyntaxError"), "{}", e.traceback);
    assert!(!e.message.is_empty());
    assert_eq!(value(&mut sb, "'syntax_probe' in dir()"), "False");
    let e = raises(&mut sb, "def f(:\n    pass", "SyntaxError").error.unwrap();
    assert!(e.traceback.contains("def f(:"), "{}", e.traceback);
    raises(&mut sb, "if True:\nprint(1)", "IndentationError");

    // Still usable after all of that.
    assert_eq!(value(&mut sb, "1 + 1"), "2");
}

#[test]
fn state_persists_across_execs() {
    let mut sb = boot();
    ok(&mut sb, "counter = 41");
    ok(&mut sb, "import json as j, collections");
    ok(&mut sb, "def twice(x):\n    return 2 * x\nclass P:\n    def __init__(self, v):\n        self.v = v\n");
    ok(&mut sb, "import numpy as np\narr = np.arange(4)");
    ok(&mut sb, "counter += 1");
    assert_eq!(value(&mut sb, "counter"), "42");
    assert_eq!(value(&mut sb, "j.dumps({'a': 1})"), "'{\"a\": 1}'");
    assert_eq!(value(&mut sb, "collections.Counter('aab')['a']"), "2");
    assert_eq!(value(&mut sb, "twice(21)"), "42");
    assert_eq!(value(&mut sb, "P(7).v"), "7");
    assert_eq!(value(&mut sb, "(arr * 2).tolist()"), "[0, 2, 4, 6]");
    ok(&mut sb, "del counter");
    raises(&mut sb, "counter", "NameError");
    assert_eq!(value(&mut sb, "__name__"), "'__main__'");
}

// ---------------------------------------------------------------------------
// 4. Files
// ---------------------------------------------------------------------------

#[test]
fn files_round_trip_within_and_across_execs() {
    let mut sb = boot();
    assert_eq!(
        value(
            &mut sb,
            "with open('/tmp/a.txt', 'w') as f:\n    f.write('line one\\nline two\\n')\nopen('/tmp/a.txt').read()"
        ),
        "'line one\\nline two\\n'"
    );
    assert_eq!(value(&mut sb, "open('/tmp/a.txt').readlines()"), "['line one\\n', 'line two\\n']");
    ok(&mut sb, "with open('/tmp/a.txt', 'a') as f:\n    f.write('line three\\n')");
    assert_eq!(value(&mut sb, "open('/tmp/a.txt').read().splitlines()[-1]"), "'line three'");
    assert_eq!(value(&mut sb, "import os\nos.stat('/tmp/a.txt').st_size"), "29");
    assert_eq!(value(&mut sb, "os.path.getsize('/tmp/a.txt') == len(open('/tmp/a.txt', 'rb').read())"), "True");

    // Binary data, every byte value, a 3 MB file, seek/tell, r+.
    ok(&mut sb, "data = bytes(range(256)) * 12288\nwith open('/tmp/b.bin', 'wb') as f:\n    f.write(data)");
    assert_eq!(value(&mut sb, "open('/tmp/b.bin', 'rb').read() == data"), "True");
    assert_eq!(value(&mut sb, "len(open('/tmp/b.bin', 'rb').read())"), "3145728");
    assert_eq!(
        value(
            &mut sb,
            "f = open('/tmp/b.bin', 'r+b')\nf.seek(1000)\nf.write(b'XYZ')\nf.seek(998)\nr = f.read(6)\nf.close()\nr"
        ),
        "b'\\xe6\\xe7XYZ\\xeb'"
    );
    assert_eq!(
        value(&mut sb, "f = open('/tmp/b.bin', 'rb')\nf.seek(-2, 2)\n(f.read(), f.tell())"),
        "(b'\\xfe\\xff', 3145728)"
    );
    // Truncation.
    assert_eq!(
        value(&mut sb, "os.truncate('/tmp/b.bin', 10)\nopen('/tmp/b.bin', 'rb').read()"),
        "b'\\x00\\x01\\x02\\x03\\x04\\x05\\x06\\x07\\x08\\t'"
    );
    // The home directory and the working directory are writable too.
    assert_eq!(
        value(&mut sb, "p = os.path.expanduser('~/notes.txt')\nopen(p, 'w').write('hi')\n(p, open(p).read())"),
        "('/root/notes.txt', 'hi')"
    );
    assert_eq!(
        value(
            &mut sb,
            "open('relative.txt', 'w').write('rel')\nopen(os.path.join(os.getcwd(), 'relative.txt')).read()"
        ),
        "'rel'"
    );
    // Exclusive creation, hard links, permissions, timestamps, chdir.
    ok(&mut sb, "open('/tmp/ex', 'x').write('1')");
    raises(&mut sb, "open('/tmp/ex', 'x')", "FileExistsError");
    assert_eq!(
        value(&mut sb, "os.link('/tmp/ex', '/tmp/ex2')\nopen('/tmp/ex2', 'a').write('2')\n(open('/tmp/ex').read(), os.stat('/tmp/ex').st_nlink)"),
        "('12', 2)"
    );
    assert_eq!(value(&mut sb, "os.chmod('/tmp/ex', 0o600)\noct(os.stat('/tmp/ex').st_mode & 0o777)"), "'0o600'");
    assert_eq!(value(&mut sb, "import time\nabs(os.stat('/tmp/ex').st_mtime - time.time()) < 5"), "True");
    assert_eq!(
        value(&mut sb, "os.utime('/tmp/ex', (1000000000, 1000000000))\nos.stat('/tmp/ex').st_mtime"),
        "1000000000.0"
    );
    assert_eq!(
        value(
            &mut sb,
            "os.chdir('/tmp')\nopen('rel2.txt', 'w').write('r')\n(os.getcwd(), open('/tmp/rel2.txt').read())"
        ),
        "('/tmp', 'r')"
    );
    ok(&mut sb, "os.chdir('/')");
    // Libraries that do their own file I/O.
    assert_eq!(
        value(&mut sb, "import sqlite3\nc = sqlite3.connect('/tmp/db.sqlite')\nc.execute('create table t(x)')\nc.executemany('insert into t values (?)', [(i,) for i in range(100)])\nc.commit()\nc.close()\nsqlite3.connect('/tmp/db.sqlite').execute('select sum(x) from t').fetchone()"),
        "(4950,)"
    );
    assert_eq!(
        value(&mut sb, "import gzip, zipfile\nwith gzip.open('/tmp/g.gz', 'wb') as g:\n    g.write(b'x' * 100000)\nwith zipfile.ZipFile('/tmp/z.zip', 'w', zipfile.ZIP_DEFLATED) as z:\n    z.writestr('a.txt', 'zipped')\n(len(gzip.open('/tmp/g.gz').read()), zipfile.ZipFile('/tmp/z.zip').read('a.txt'))"),
        "(100000, b'zipped')"
    );
    assert_eq!(value(&mut sb, "import pickle\npickle.dump({'k': [1, 2]}, open('/tmp/p.pkl', 'wb'))\npickle.load(open('/tmp/p.pkl', 'rb'))"), "{'k': [1, 2]}");
    // Missing files.
    raises(&mut sb, "open('/tmp/does-not-exist.txt')", "FileNotFoundError");
    raises(&mut sb, "open('/tmp/no-such-dir/x.txt', 'w')", "FileNotFoundError");
    raises(&mut sb, "open('/tmp', 'w')", "IsADirectoryError");

    // Read-only and copy-on-write file mappings.
    ok(&mut sb, "import mmap\nwith open('/tmp/m.bin', 'wb') as f:\n    f.write(b'0123456789' * 1000)");
    assert_eq!(value(&mut sb, "with open('/tmp/m.bin', 'rb') as f:\n    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n    r = (len(m), m[:10], m.find(b'89012'))\n    m.close()\nr"), "(10000, b'0123456789', 8)");
    assert_eq!(
        value(&mut sb, "import numpy as np\nnp.array(np.memmap('/tmp/m.bin', dtype=np.uint8, mode='r')[:4]).tolist()"),
        "[48, 49, 50, 51]"
    );
    // Shared, writable file mappings: flush() (msync) works and writes reach the file.
    assert_eq!(
        value(&mut sb, "with open('/tmp/m.bin', 'r+b') as f:\n    m = mmap.mmap(f.fileno(), 0)\n    m[0:5] = b'hello'\n    m.flush()\n    m.close()\nopen('/tmp/m.bin', 'rb').read(10)"),
        "b'hello56789'"
    );
    assert_eq!(
        value(&mut sb, "mm = np.memmap('/tmp/mm.dat', dtype=np.float64, mode='w+', shape=(1000,))\nmm[:] = np.arange(1000)\nmm.flush()\ndel mm\nfloat(np.fromfile('/tmp/mm.dat').sum())"),
        "499500.0"
    );
}

#[test]
fn file_system_operations() {
    let mut sb = boot();
    ok(&mut sb, "import os, shutil, tempfile, pathlib");
    assert_eq!(
        value(&mut sb, "os.makedirs('/tmp/w/sub/deeper')\nos.makedirs('/tmp/w/sub/deeper', exist_ok=True)\nos.path.isdir('/tmp/w/sub/deeper')"),
        "True"
    );
    raises(&mut sb, "os.makedirs('/tmp/w/sub')", "FileExistsError");
    raises(&mut sb, "os.mkdir('/tmp/w')", "FileExistsError");
    ok(&mut sb, "for n in ('c.txt', 'a.txt', 'b.txt'):\n    open('/tmp/w/' + n, 'w').write(n)");
    assert_eq!(value(&mut sb, "sorted(os.listdir('/tmp/w'))"), "['a.txt', 'b.txt', 'c.txt', 'sub']");
    assert_eq!(
        value(&mut sb, "sorted(e.name for e in os.scandir('/tmp/w') if e.is_file())"),
        "['a.txt', 'b.txt', 'c.txt']"
    );

    // rename / replace / remove.
    ok(&mut sb, "os.rename('/tmp/w/a.txt', '/tmp/w/sub/moved.txt')");
    assert_eq!(
        value(&mut sb, "(os.path.exists('/tmp/w/a.txt'), open('/tmp/w/sub/moved.txt').read())"),
        "(False, 'a.txt')"
    );
    ok(&mut sb, "os.replace('/tmp/w/b.txt', '/tmp/w/c.txt')");
    assert_eq!(
        value(&mut sb, "(sorted(os.listdir('/tmp/w')), open('/tmp/w/c.txt').read())"),
        "(['c.txt', 'sub'], 'b.txt')"
    );
    ok(&mut sb, "os.remove('/tmp/w/c.txt')");
    assert_eq!(value(&mut sb, "os.listdir('/tmp/w')"), "['sub']");
    raises(&mut sb, "os.remove('/tmp/w/c.txt')", "FileNotFoundError");
    raises(&mut sb, "os.rmdir('/tmp/w/sub')", "OSError"); // ENOTEMPTY
    ok(&mut sb, "os.rename('/tmp/w/sub/deeper', '/tmp/w/renamed_dir')");
    assert_eq!(value(&mut sb, "sorted(os.listdir('/tmp/w'))"), "['renamed_dir', 'sub']");

    // shutil.
    assert_eq!(
        value(&mut sb, "shutil.copy('/tmp/w/sub/moved.txt', '/tmp/w/copy.txt')\nopen('/tmp/w/copy.txt').read()"),
        "'a.txt'"
    );
    assert_eq!(
        value(&mut sb, "sorted((os.path.relpath(d, '/tmp/w'), sorted(fs)) for d, _, fs in os.walk('/tmp/w'))"),
        "[('.', ['copy.txt']), ('renamed_dir', []), ('sub', ['moved.txt'])]"
    );
    assert_eq!(value(&mut sb, "shutil.move('/tmp/w/sub', '/tmp/w3')\nos.listdir('/tmp/w3')"), "['moved.txt']");
    assert_eq!(value(&mut sb, "shutil.rmtree('/tmp/w')\nos.path.exists('/tmp/w')"), "False");

    // tempfile.
    assert_eq!(
        value(
            &mut sb,
            "with tempfile.NamedTemporaryFile('w+', suffix='.txt', delete=False) as t:\n    t.write('temp data')\n    t.flush()\n    t.seek(0)\n    inside = t.read()\n    name = t.name\n(inside, open(name).read(), name.endswith('.txt'), os.path.dirname(name))"
        ),
        "('temp data', 'temp data', True, '/tmp')"
    );
    assert_eq!(value(&mut sb, "with tempfile.NamedTemporaryFile() as t:\n    n = t.name\n    e = os.path.exists(n)\n(e, os.path.exists(n))"), "(True, False)");
    assert_eq!(value(&mut sb, "with tempfile.TemporaryDirectory() as d:\n    open(d + '/x', 'w').write('1')\n    inside = os.listdir(d)\n(inside, os.path.exists(d))"), "(['x'], False)");
    assert_eq!(value(&mut sb, "tempfile.gettempdir()"), "'/tmp'");

    // pathlib.
    assert_eq!(
        value(&mut sb, "p = pathlib.Path('/tmp/pl/data.txt')\np.parent.mkdir(parents=True)\np.write_text('via pathlib')\n(p.read_text(), p.exists(), p.stat().st_size, [q.name for q in p.parent.iterdir()])"),
        "('via pathlib', True, 11, ['data.txt'])"
    );
    assert_eq!(
        value(
            &mut sb,
            "pathlib.Path('/tmp/pl/b.bin').write_bytes(b'\\x00\\x01')\npathlib.Path('/tmp/pl/b.bin').read_bytes()"
        ),
        "b'\\x00\\x01'"
    );
    assert_eq!(
        value(&mut sb, "sorted(str(x) for x in pathlib.Path('/tmp/pl').glob('*'))"),
        "['/tmp/pl/b.bin', '/tmp/pl/data.txt']"
    );
    assert_eq!(
        value(&mut sb, "pathlib.Path('/tmp/pl/data.txt').unlink()\npathlib.Path('/tmp/pl/data.txt').exists()"),
        "False"
    );

    // Symlinks inside the sandbox.
    assert_eq!(value(&mut sb, "os.symlink('/tmp/pl/b.bin', '/tmp/link')\n(os.readlink('/tmp/link'), open('/tmp/link', 'rb').read(), os.path.islink('/tmp/link'))"), "('/tmp/pl/b.bin', b'\\x00\\x01', True)");

    // numpy save/load goes through the same file system.
    assert_eq!(
        value(
            &mut sb,
            "import numpy as np\nnp.save('/tmp/arr.npy', np.arange(6).reshape(2, 3))\nnp.load('/tmp/arr.npy').tolist()"
        ),
        "[[0, 1, 2], [3, 4, 5]]"
    );
    assert_eq!(
        value(&mut sb, "np.savetxt('/tmp/arr.txt', np.eye(2))\nnp.loadtxt('/tmp/arr.txt').tolist()"),
        "[[1.0, 0.0], [0.0, 1.0]]"
    );

    // copy2 / copytree also copy metadata (stat, extended attributes).
    assert_eq!(
        value(&mut sb, "shutil.copy2('/tmp/w3/moved.txt', '/tmp/copy2.txt')\nopen('/tmp/copy2.txt').read()"),
        "'a.txt'"
    );
    assert_eq!(value(&mut sb, "shutil.copytree('/tmp/w3', '/tmp/w4')\nsorted(os.listdir('/tmp/w4'))"), "['moved.txt']");
}

#[test]
fn image_writes_stay_inside_one_sandbox() {
    let image_path = &shared().image_path;
    let image_meta_before = std::fs::metadata(image_path).unwrap();

    let mut a = boot();
    let mut b = boot(); // alive at the same time as `a`
                        // Write into an image directory, overwrite an image file, delete one.
    ok(
        &mut a,
        "open('/usr/lib/python3.11/forkbox_probe.txt', 'w').write('written by a')\n\
         open('/etc/passwd', 'a').write('intruder:x:0:0::/:/bin/sh\\n')\n\
         import os\nos.remove('/usr/lib/python3.11/this.py')\n\
         a_only = 'a'",
    );
    assert_eq!(value(&mut a, "open('/usr/lib/python3.11/forkbox_probe.txt').read()"), "'written by a'");
    assert_eq!(value(&mut a, "'intruder' in open('/etc/passwd').read()"), "True");
    assert_eq!(value(&mut a, "os.path.exists('/usr/lib/python3.11/this.py')"), "False");

    // `b` (booted before the writes) sees none of it, nor `a`'s variables.
    assert_eq!(value(&mut b, "import os\nos.path.exists('/usr/lib/python3.11/forkbox_probe.txt')"), "False");
    assert_eq!(value(&mut b, "'intruder' in open('/etc/passwd').read()"), "False");
    assert_eq!(value(&mut b, "os.path.exists('/usr/lib/python3.11/this.py')"), "True");
    raises(&mut b, "a_only", "NameError");
    // ... and its own writes do not show up in `a`.
    ok(&mut b, "open('/tmp/shared_name.txt', 'w').write('b')");
    ok(&mut a, "open('/tmp/shared_name.txt', 'w').write('a')");
    assert_eq!(value(&mut b, "open('/tmp/shared_name.txt').read()"), "'b'");
    assert_eq!(value(&mut a, "open('/tmp/shared_name.txt').read()"), "'a'");
    drop(a);
    drop(b);

    // A sandbox booted afterwards starts from the pristine image.
    let mut c = boot();
    assert_eq!(
        value(
            &mut c,
            "import os\n(os.path.exists('/usr/lib/python3.11/forkbox_probe.txt'), 'intruder' in open('/etc/passwd').read(), os.path.exists('/usr/lib/python3.11/this.py'), os.path.exists('/tmp/shared_name.txt'))"
        ),
        "(False, False, True, False)"
    );

    // Nothing was written to the host: not the image file, not the host's own paths.
    let image_meta_after = std::fs::metadata(image_path).unwrap();
    assert_eq!(image_meta_before.len(), image_meta_after.len(), "image file size changed");
    assert_eq!(image_meta_before.modified().unwrap(), image_meta_after.modified().unwrap(), "image file modified");
    assert!(!std::path::Path::new("/usr/lib/python3.11/forkbox_probe.txt").exists(), "guest write reached the host");
    if let Ok(host_passwd) = std::fs::read_to_string("/etc/passwd") {
        assert!(!host_passwd.contains("intruder"), "guest write reached the host's /etc/passwd");
    }
}

// ---------------------------------------------------------------------------
// 5. Host isolation
// ---------------------------------------------------------------------------

#[test]
fn host_file_system_and_environment_are_not_visible() {
    let (dir, host_file, _) = host_marker_dir("fs");
    let host_file_s = host_file.to_str().unwrap().to_string();
    let mut sb = boot();
    ok(&mut sb, "import os, json");

    // Paths that climb above the root stay at the guest's root.
    let e = raises(&mut sb, "open('/etc/../../host/path')", "FileNotFoundError").error.unwrap();
    assert!(e.message.contains("No such file or directory"), "{}", e.message);
    assert_eq!(value(&mut sb, "os.path.realpath('/../../..')"), "'/'");
    assert_eq!(value(&mut sb, "sorted(os.listdir('/../../..')) == sorted(os.listdir('/'))"), "True");

    // A file that exists on the host is not reachable by any spelling.
    for p in [
        host_file_s.clone(),
        format!("/../../..{host_file_s}"),
        format!("/etc/../..{host_file_s}"),
        format!("../../../../../../..{host_file_s}"),
        format!("{}/Cargo.toml", env!("CARGO_MANIFEST_DIR")),
    ] {
        let code = format!("os.path.exists({0}), os.access({0}, os.F_OK)", py_str(&p));
        assert_eq!(value(&mut sb, &code), "(False, False)", "host path {p} visible in the guest");
        raises(&mut sb, &format!("open({})", py_str(&p)), "FileNotFoundError");
    }

    // The root holds only the image's top-level directories (and the agent's /output).
    let top = ok(&mut sb, "print(json.dumps(sorted(os.listdir('/'))))").stdout;
    let top: Vec<String> = serde_json::from_str(&top).unwrap_or_else(|e| panic!("{e}: {top:?}"));
    let allowed: BTreeSet<&str> = [
        "bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt", "opt", "output",
        "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var",
    ]
    .into_iter()
    .collect();
    for d in &top {
        assert!(allowed.contains(d.as_str()), "unexpected top-level entry /{d} in the guest (listing {top:?})");
    }
    assert!(!top.iter().any(|d| d == "work"), "host's /work visible: {top:?}");
    assert!(top.iter().any(|d| d == "usr") && top.iter().any(|d| d == "etc"), "image dirs missing: {top:?}");

    // No host processes in /proc.
    let host_pid = std::process::id();
    let guest_pid: u32 = value(&mut sb, "os.getpid()").parse().unwrap();
    if guest_pid != host_pid {
        assert_eq!(
            value(&mut sb, &format!("os.path.exists('/proc/{host_pid}')")),
            "False",
            "the host test process is in the guest's /proc"
        );
    }
    if let Ok(host_init) = std::fs::read("/proc/1/cmdline") {
        let guest_init = ok(
            &mut sb,
            "try:\n    print(open('/proc/1/cmdline', 'rb').read().hex(), end='')\nexcept OSError:\n    pass",
        );
        let host_hex: String = host_init.iter().map(|b| format!("{b:02x}")).collect();
        assert!(
            guest_init.stdout.is_empty() || guest_init.stdout != host_hex,
            "the guest reads the host's /proc/1/cmdline"
        );
    }
    // No host devices.
    assert_eq!(value(&mut sb, "os.path.exists('/dev/kvm')"), "False");

    // No network: sockets and URL fetches fail with a Python exception.
    let r = run(&mut sb, "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)");
    assert!(r.error.is_some(), "an outbound TCP connection worked: {r:?}");
    // A listener is the sandbox's own (served by the VMM): it never becomes a host port.
    let port: u16 = value(&mut sb, "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.bind(('127.0.0.1', 0))\ns.listen()\ns.getsockname()[1]")
        .parse()
        .expect("an in-sandbox listener's port");
    let host_listeners = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let listening_on_host = host_listeners
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(3) == Some(&"0A")).then(|| f.get(1).and_then(|a| a.rsplit(':').next()).map(str::to_owned)).flatten()
        })
        .any(|p| u16::from_str_radix(&p, 16) == Ok(port));
    assert!(!listening_on_host, "the sandbox's listener on port {port} is a host port");
    let r = run(&mut sb, "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2).read(10)");
    assert!(r.error.is_some(), "an HTTP fetch worked: {r:?}");

    // The host name is not revealed.
    let guest_names = value(&mut sb, "import socket\nlist({os.uname().nodename, socket.gethostname()})");
    let guest_hostname_file =
        ok(&mut sb, "try:\n    print(open('/etc/hostname').read(), end='')\nexcept OSError:\n    pass").stdout;
    if let Ok(h) = std::fs::read_to_string("/etc/hostname") {
        let h = h.trim();
        if !h.is_empty() && h != "forkbox" && h != "localhost" {
            assert!(!guest_names.contains(&format!("'{h}'")), "guest sees the host name {h:?}: {guest_names}");
            assert_ne!(guest_hostname_file.trim(), h, "guest /etc/hostname is the host's");
        }
    }

    // The host's environment does not leak: neither a marker set by this test
    // process nor any other of its variables.
    let secret = host_secret();
    let env_json = ok(&mut sb, "print(json.dumps(dict(os.environ)))").stdout;
    let guest_env: BTreeMap<String, String> = serde_json::from_str(&env_json).unwrap();
    assert!(!guest_env.contains_key(HOST_SECRET_VAR), "host env var visible: {guest_env:?}");
    assert!(!env_json.contains(&secret), "host secret visible: {guest_env:?}");
    for (k, v) in std::env::vars() {
        if ["PATH", "HOME", "LANG", "TERM", "LC_ALL", "LANGUAGE", "SHLVL", "_"].contains(&k.as_str()) || v.len() < 4 {
            continue;
        }
        assert_ne!(guest_env.get(&k), Some(&v), "host environment variable {k} is visible in the guest");
    }
    let proc_environ = ok(
        &mut sb,
        "try:\n    print(open('/proc/self/environ', 'rb').read().hex(), end='')\nexcept OSError:\n    pass",
    )
    .stdout;
    let secret_hex: String = secret.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(!proc_environ.contains(&secret_hex), "host secret in the guest's /proc/self/environ");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn symlinks_and_writes_cannot_escape_the_image() {
    let (dir, host_file, host_content) = host_marker_dir("symlink");
    let host_file_s = host_file.to_str().unwrap().to_string();
    let dir_s = dir.to_str().unwrap().to_string();
    let mut sb = boot();
    ok(&mut sb, "import os");

    // An absolute symlink that climbs above the root resolves inside the image.
    let guest_passwd = value(&mut sb, "open('/etc/passwd').read()");
    assert_eq!(
        value(&mut sb, "os.symlink('/../../../etc/passwd', '/tmp/l')\nos.readlink('/tmp/l')"),
        "'/../../../etc/passwd'"
    );
    assert_eq!(
        value(&mut sb, "open('/tmp/l').read()"),
        guest_passwd,
        "the symlink resolved to something else than the guest's /etc/passwd"
    );
    assert_eq!(value(&mut sb, "os.path.realpath('/tmp/l')"), "'/etc/passwd'");
    if let Ok(host_passwd) = std::fs::read_to_string("/etc/passwd") {
        let host_lit = py_str(&host_passwd);
        if value(&mut sb, &format!("open('/etc/passwd').read() == {host_lit}")) == "False" {
            assert_eq!(
                value(&mut sb, &format!("open('/tmp/l').read() == {host_lit}")),
                "False",
                "the symlink reached the host's /etc/passwd"
            );
        }
    }

    // Symlinks (absolute, relative, chained) to a file that only exists on the host.
    let code = format!(
        "os.symlink({abs}, '/tmp/esc_abs')\n\
         os.symlink({rel}, '/tmp/esc_rel')\n\
         os.symlink('/tmp/esc_abs', '/tmp/esc_chain')\n\
         os.symlink('/../../..', '/tmp/rootlink')",
        abs = py_str(&format!("/../../..{host_file_s}")),
        rel = py_str(&format!("../../../../../../../..{host_file_s}")),
    );
    ok(&mut sb, &code);
    for link in ["/tmp/esc_abs", "/tmp/esc_rel", "/tmp/esc_chain"] {
        raises(&mut sb, &format!("open('{link}')"), "FileNotFoundError");
    }
    raises(&mut sb, &format!("open('/tmp/rootlink{host_file_s}')"), "FileNotFoundError");
    assert_eq!(value(&mut sb, "sorted(os.listdir('/tmp/rootlink/')) == sorted(os.listdir('/'))"), "True");

    // Writes through climbing paths and symlinks land in the guest, not on the host.
    let code = format!(
        "os.makedirs({d}, exist_ok=True)\n\
         open({w1}, 'w').write('guest wrote this')\n\
         os.symlink({w2target}, '/tmp/wlink')\n\
         open('/tmp/wlink', 'w').write('guest wrote this too')\n\
         open({f}).read()",
        d = py_str(&format!("/../..{dir_s}")),
        w1 = py_str(&format!("/../../..{dir_s}/written.txt")),
        w2target = py_str(&format!("/../../..{dir_s}/written2.txt")),
        f = py_str(&format!("{dir_s}/written2.txt")),
    );
    assert_eq!(value(&mut sb, &code), "'guest wrote this too'");
    // Overwrite the guest's copy of the marker path: the host file must not change.
    ok(&mut sb, &format!("open({}, 'w').write('overwritten by the guest')", py_str(&host_file_s)));
    assert!(!dir.join("written.txt").exists(), "a guest write reached the host file system");
    assert!(!dir.join("written2.txt").exists(), "a guest write through a symlink reached the host file system");
    assert_eq!(std::fs::read_to_string(&host_file).unwrap(), host_content, "the guest modified a host file");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// 6. Limits
// ---------------------------------------------------------------------------

/// Run `code`, expect `Err(Timeout)` after about `limit`, then a poisoned sandbox.
#[track_caller]
fn assert_times_out(sb: &mut Sandbox, code: &str, limit: Duration) {
    let t0 = Instant::now();
    let r = sb.exec(code);
    let took = t0.elapsed();
    match r {
        Err(EngineError::Timeout(secs)) => assert!((secs - limit.as_secs_f64()).abs() < 0.01, "Timeout({secs})"),
        other => panic!("expected Err(Timeout) for {code:?}, got {other:?}"),
    }
    assert!(took >= limit - Duration::from_millis(100), "{code:?} timed out too early: {took:?}");
    assert!(took <= limit + Duration::from_secs(3), "{code:?} timed out too late: {took:?}");
    assert_poisoned(sb);
}

#[test]
fn timeouts_busy_loop_and_blocking_sleep() {
    let limits = Limits { timeout: Duration::from_secs(2), ..Limits::default() };
    let mut sb = boot_with(limits.clone());
    assert_eq!(value(&mut sb, "1 + 1"), "2");
    // Pure CPU, no syscalls.
    assert_times_out(&mut sb, "while True: pass", limits.timeout);
    drop(sb);
    // A new sandbox from the same engine works; a blocking syscall times out too.
    let mut sb = fresh_sandbox(limits.clone());
    assert_times_out(&mut sb, "import time\ntime.sleep(100)", limits.timeout);
}

#[test]
fn os_exit_is_guest_exited_and_abort_is_guest_signaled() {
    let mut sb = boot();
    let r = sb.exec("import os\nos._exit(3)");
    match r {
        Err(EngineError::GuestExited(3)) => {}
        other => panic!("expected Err(GuestExited(3)), got {other:?}"),
    }
    assert_poisoned(&mut sb);
    drop(sb);
    let mut sb = fresh_sandbox(Limits::default());
    let r = sb.exec("import os\nos.abort()");
    match r {
        Err(EngineError::GuestSignaled(6)) => {}
        other => panic!("expected Err(GuestSignaled(6)) (SIGABRT), got {other:?}"),
    }
    assert_poisoned(&mut sb);
}

#[test]
fn segfault_and_stack_overflow_are_guest_crashed() {
    let mut sb = boot();
    assert_eq!(value(&mut sb, "import ctypes\nctypes.sizeof(ctypes.c_void_p)"), "8");
    let r = sb.exec("ctypes.string_at(0)");
    match r {
        Err(EngineError::GuestCrashed(msg)) => {
            assert!(msg.to_lowercase().contains("page fault"), "crash message does not mention the page fault: {msg}")
        }
        other => panic!("expected Err(GuestCrashed), got {other:?}"),
    }
    assert_poisoned(&mut sb);
    drop(sb);
    // A new sandbox works; overflowing the C stack hits the guard page.
    let mut sb = fresh_sandbox(Limits::default());
    let r =
        sb.exec("import sys\nsys.setrecursionlimit(10**8)\nl = []\nfor i in range(10**5):\n    l = [l]\nx = repr(l)");
    match r {
        Err(EngineError::GuestCrashed(msg)) => assert!(msg.to_lowercase().contains("page fault"), "{msg}"),
        Err(EngineError::GuestSignaled(11)) => {}
        other => panic!("expected Err(GuestCrashed) from a C stack overflow, got {other:?}"),
    }
    assert_poisoned(&mut sb);
}

#[test]
fn huge_allocation_is_a_memory_error() {
    let mut sb = boot();
    let r = raises(&mut sb, "b = bytearray(10**12)", "MemoryError");
    assert_eq!(r.value, None);
    // numpy raises its own MemoryError subclass.
    assert_eq!(
        value(&mut sb, "import numpy as np\ntry:\n    np.zeros(10**12)\n    r = 'allocated?!'\nexcept MemoryError as e:\n    r = 'MemoryError'\nr"),
        "'MemoryError'"
    );
    raises(&mut sb, "'x' * (10**11)", "MemoryError");
    // Still usable, and normal-sized allocations work.
    assert_eq!(value(&mut sb, "len(bytearray(100 << 20))"), "104857600");
    assert_eq!(value(&mut sb, "int(np.ones(10**7, dtype=np.int64).sum())"), "10000000");
}

#[test]
fn allocation_loop_stops_at_the_memory_limit() {
    let mut sb = boot_with(Limits { memory_bytes: 256 << 20, ..Limits::default() });
    let t0 = Instant::now();
    let r = raises(&mut sb, "chunks = []\nwhile True:\n    chunks.append(b'\\x01' * (16 << 20))", "MemoryError");
    eprintln!("MemoryError after {:.2} s", t0.elapsed().as_secs_f64());
    assert_eq!(r.value, None);
    let n: u64 = value(&mut sb, "len(chunks)").parse().unwrap();
    assert!(n >= 2 && n * (16 << 20) <= 256 << 20, "{n} chunks of 16 MiB under a 256 MiB limit");
    // The memory comes back when freed: almost as much can be allocated again.
    let again = (n - 1) * (16 << 20);
    assert_eq!(
        value(&mut sb, &format!("del chunks\nimport gc\ngc.collect()\nb = b'\\x02' * {again}\nlen(b)")),
        again.to_string()
    );
    // The same with numpy arrays that touch their pages.
    let r = run(&mut sb, "import numpy as np\ndel b\narrs = []\nwhile True:\n    arrs.append(np.ones(2 << 20))");
    let e = r.error.expect("expected a MemoryError from numpy");
    assert!(e.kind.contains("MemoryError"), "{}: {}", e.kind, e.message);
    assert_eq!(value(&mut sb, "del arrs\nfloat(np.ones(1000).sum())"), "1000.0");
}

#[test]
fn one_megabyte_of_output_is_exact() {
    let mut sb = boot();
    let expected: String = b"abcdefghijklmnopqrstuvwxyz".iter().cycle().take(1_000_000).map(|&b| b as char).collect();
    let r = ok(&mut sb, "import string, sys\ns = (string.ascii_lowercase * 40000)[:1000000]\nn = sys.stdout.write(s)");
    assert_eq!(r.stdout.len(), 1_000_000);
    assert!(r.stdout == expected, "1 MB of stdout differs from what was written");
    assert_eq!(r.stderr, "");
    // print() of the same (with its newline), and the same on stderr.
    let r = ok(&mut sb, "print(s[:999999])");
    assert_eq!(r.stdout.len(), 1_000_000);
    assert!(r.stdout.as_bytes()[..999_999] == expected.as_bytes()[..999_999] && r.stdout.ends_with('\n'));
    let r = ok(&mut sb, "n = sys.stderr.write(s)");
    assert_eq!(r.stdout, "");
    assert!(r.stderr == expected, "1 MB of stderr differs (len {})", r.stderr.len());
    // Many small writes.
    let r = ok(&mut sb, "for i in range(100000):\n    print(i)");
    let want: String = (0..100000).map(|i| format!("{i}\n")).collect();
    assert!(r.stdout == want, "100000 prints: got {} bytes, want {}", r.stdout.len(), want.len());
}

#[test]
fn output_code_and_disk_limits() {
    let mut sb =
        boot_with(Limits { output_bytes: 1 << 20, disk_bytes: 8 << 20, code_bytes: 64 << 10, ..Limits::default() });
    let limit = 1usize << 20;
    let expected: String = b"0123456789".iter().cycle().take(3_000_000).map(|&b| b as char).collect();

    // 3 MB on each stream: each truncated to 1 MiB plus a marker.
    let r = ok(
        &mut sb,
        "import sys\ns = '0123456789' * 300000\nn1 = sys.stdout.write(s)\nn2 = sys.stderr.write(s)\n(n1, n2)",
    );
    assert_eq!(
        r.value.as_deref(),
        Some("(3000000, 3000000)"),
        "writes must report success even when output is dropped"
    );
    for (name, text) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
        assert!(text.len() >= limit, "{name} shorter than the limit: {}", text.len());
        assert!(text.as_bytes()[..limit] == expected.as_bytes()[..limit], "{name}: the first MiB differs");
        let tail = &text[limit..];
        assert!(tail.contains("[forkbox: output truncated"), "{name}: no truncation marker in {tail:?}");
        assert!(tail.len() < 200, "{name}: {} bytes after the limit: {:?}", tail.len(), &tail[..tail.len().min(300)]);
        assert!(!tail.contains("0123456789"), "{name}: data past the limit");
    }
    // The next exec starts with a fresh budget.
    let r = ok(&mut sb, "print('small')");
    assert_eq!(r.stdout, "small\n");
    // Exactly the limit is not truncated.
    let r = ok(&mut sb, &format!("n = sys.stdout.write('z' * {limit})"));
    assert_eq!(r.stdout.len(), limit);
    assert!(!r.stdout.contains("forkbox"));

    // A huge trailing value is truncated too.
    let v = value(&mut sb, "'y' * (3 << 20)");
    assert!(v.len() < limit + 200, "value of {} bytes", v.len());
    assert!(v.contains("value repr truncated"), "{}", &v[v.len().saturating_sub(200)..]);

    // Code over the code limit is refused without poisoning the sandbox.
    let big = format!("x = 1\n#{}\n", "c".repeat(64 << 10));
    match sb.exec(&big) {
        Err(EngineError::CodeTooLarge(n, max)) => assert_eq!((n, max), (big.len(), 64 << 10)),
        other => panic!("expected Err(CodeTooLarge), got {other:?}"),
    }
    let fits = format!("fits = 1\n#{}", "c".repeat((64 << 10) - 20));
    assert!(fits.len() <= 64 << 10);
    assert_eq!(value(&mut sb, &(fits + "\nfits")), "1");

    // Disk quota: writing past it is ENOSPC/EDQUOT, and removing the file frees the space.
    let r = value(
        &mut sb,
        "import errno, os\ntry:\n    with open('/tmp/big', 'wb') as f:\n        f.write(b'\\x01' * (16 << 20))\n    r = 'no error'\nexcept OSError as e:\n    r = errno.errorcode.get(e.errno, e.errno)\nr",
    );
    assert!(r == "'ENOSPC'" || r == "'EDQUOT'", "writing 16 MiB under an 8 MiB disk quota: {r}");
    ok(&mut sb, "if os.path.exists('/tmp/big'):\n    os.remove('/tmp/big')");
    assert_eq!(value(&mut sb, "open('/tmp/small', 'wb').write(b'\\x01' * (4 << 20))"), "4194304");
    assert_eq!(value(&mut sb, "1 + 1"), "2");
}

// ---------------------------------------------------------------------------
// 7. Misc ABI
// ---------------------------------------------------------------------------

#[test]
fn process_identity_clock_and_randomness() {
    let mut sb = boot();
    ok(&mut sb, "import os, sys, time, datetime, random, secrets, platform");
    let pid: i64 = value(&mut sb, "os.getpid()").parse().unwrap();
    assert!(pid > 0);
    assert_eq!(value(&mut sb, "os.getpid()"), pid.to_string(), "pid changes between execs");
    let _: i64 = value(&mut sb, "os.getppid()").parse().unwrap();
    assert_eq!(value(&mut sb, "os.uname().sysname"), "'Linux'");
    assert_eq!(value(&mut sb, "os.uname().machine"), "'x86_64'");
    assert_eq!(value(&mut sb, "platform.system()"), "'Linux'");
    assert_eq!(value(&mut sb, "sys.platform"), "'linux'");
    assert_eq!(value(&mut sb, "sys.getfilesystemencoding()"), "'utf-8'");
    let cpus: i64 = value(&mut sb, "os.cpu_count()").parse().unwrap();
    assert!(cpus >= 1);
    assert_eq!(value(&mut sb, "len(os.sched_getaffinity(0)) >= 1"), "True");
    assert_eq!(value(&mut sb, "isinstance(os.getuid(), int) and isinstance(os.getgid(), int)"), "True");

    // Wall clock agrees with the host.
    let before = host_now();
    let guest: f64 = value(&mut sb, "time.time()").parse().unwrap();
    let after = host_now();
    assert!(guest >= before - 2.0 && guest <= after + 2.0, "guest time {guest}, host {before}..{after}");
    let year: i32 = value(&mut sb, "datetime.datetime.now().year").parse().unwrap();
    assert!(year >= 2024);
    let ns: f64 = value(&mut sb, "time.time_ns() / 1e9").parse().unwrap();
    assert!((ns - host_now()).abs() < 3.0, "time_ns {ns}");
    // Monotonic clocks advance.
    assert_eq!(value(&mut sb, "a = time.monotonic(); b = time.perf_counter(); s = sum(range(10**6))\n(time.monotonic() >= a, time.perf_counter() > b)"), "(True, True)");
    let a: f64 = value(&mut sb, "time.monotonic()").parse().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let b: f64 = value(&mut sb, "time.monotonic()").parse().unwrap();
    assert!(b - a >= 0.29, "guest monotonic advanced {} s over 0.3 s of host time", b - a);

    // sleep really sleeps.
    let t0 = Instant::now();
    let r = ok(&mut sb, "t = time.perf_counter(); m = time.monotonic(); w = time.time()\ntime.sleep(0.2)\n(time.perf_counter() - t, time.monotonic() - m, time.time() - w)");
    let host = t0.elapsed();
    let v = r.value.unwrap();
    let parts: Vec<f64> =
        v.trim_matches(|c| c == '(' || c == ')').split(',').map(|p| p.trim().parse().unwrap()).collect();
    for (i, p) in parts.iter().enumerate() {
        assert!(*p >= 0.2, "clock {i} measured {p} s for time.sleep(0.2) ({v})");
        assert!(*p < 5.0, "clock {i} measured {p} s for time.sleep(0.2) ({v})");
    }
    assert!(host >= Duration::from_millis(200), "host saw the sleep take {host:?}");
    assert!(r.wall_ms >= 200.0);

    // Randomness.
    assert_eq!(
        value(&mut sb, "a = os.urandom(16); b = os.urandom(16)\n(len(a), len(b), a != b, a != bytes(16))"),
        "(16, 16, True, True)"
    );
    assert_eq!(value(&mut sb, "len(secrets.token_hex(8))"), "16");
    assert_eq!(value(&mut sb, "0 <= random.random() < 1"), "True");
    assert_eq!(value(&mut sb, "import uuid\nuuid.uuid4() != uuid.uuid4()"), "True");
    assert_eq!(value(&mut sb, "import numpy as np\nrng = np.random.default_rng()\nx = rng.random(1000)\nbool(0 <= x.min() and x.max() < 1 and x.std() > 0)"), "True");
    // Hash randomization / misc stdlib that touches the OS.
    assert_eq!(value(&mut sb, "import hashlib\nhashlib.sha256(b'abc').hexdigest()[:16]"), "'ba7816bf8f01cfea'");
    assert_eq!(value(&mut sb, "import locale\nlocale.getpreferredencoding(False).lower().replace('-', '')"), "'utf8'");
    assert_eq!(value(&mut sb, "os.getcwd() == os.path.realpath('.')"), "True");
}

#[test]
fn processes_and_threads_in_a_booted_guest() {
    let mut sb = boot();
    // A booted guest's memory is anonymous (no template file behind it): forks copy what it wrote.
    let r = run(&mut sb, "import subprocess\nsubprocess.run(['ls', '/'], capture_output=True).returncode");
    assert_eq!(r.value.as_deref(), Some("0"), "subprocess.run(['ls']): {r:?}");
    assert_eq!(value(&mut sb, "subprocess.check_output(['/bin/sh', '-c', 'echo hi'])"), "b'hi\\n'");
    let r = run(
        &mut sb,
        "import os\np = os.fork()\nif p == 0: os._exit(7)\nos.waitstatus_to_exitcode(os.waitpid(p, 0)[1])",
    );
    assert_eq!(r.value.as_deref(), Some("7"), "os.fork: {r:?}");
    let status = run(&mut sb, "os.system('echo hi')");
    assert_eq!(status.value.as_deref(), Some("0"), "os.system: {status:?}");
    assert_eq!(status.stdout, "hi\n", "the shell's output is captured");
    let r = run(&mut sb, "import multiprocessing\np = multiprocessing.Process(target=print, args=('from a child',))\np.start()\np.join()\np.exitcode");
    assert_eq!(r.value.as_deref(), Some("0"), "multiprocessing.Process: {r:?}");
    assert!(r.stdout.contains("from a child"), "{r:?}");
    assert_eq!(value(&mut sb, "1 + 1"), "2");

    // Threads: either they work, or starting one is a clean Python exception.
    let r = run(
        &mut sb,
        "import threading\nres = []\nt = threading.Thread(target=lambda: res.append(6 * 7))\nt.start()\nt.join()\nres",
    );
    match (&r.error, r.value.as_deref()) {
        (None, Some("[42]")) => eprintln!("threading: threads WORK"),
        (Some(e), _) => {
            eprintln!("threading: Thread.start() raises {}: {}", e.kind, e.message);
            assert_eq!(e.kind, "RuntimeError", "{}: {}\n{}", e.kind, e.message, e.traceback);
        }
        (None, v) => panic!("thread ran but result is {v:?}"),
    }
    let r = run(&mut sb, "from concurrent.futures import ThreadPoolExecutor\nwith ThreadPoolExecutor(2) as ex:\n    out = list(ex.map(lambda x: x * x, range(4)))\nout");
    match (&r.error, r.value.as_deref()) {
        (None, Some("[0, 1, 4, 9]")) => eprintln!("ThreadPoolExecutor: works"),
        (Some(e), _) => eprintln!("ThreadPoolExecutor raises {}: {}", e.kind, e.message),
        (None, v) => panic!("ThreadPoolExecutor result {v:?}"),
    }
    // In-process primitives that need no second process (reported, not required).
    let r =
        run(&mut sb, "import asyncio\nasync def f():\n    await asyncio.sleep(0.01)\n    return 5\nasyncio.run(f())");
    match (&r.error, r.value.as_deref()) {
        (None, Some("5")) => eprintln!("asyncio.run: works"),
        (Some(e), _) => eprintln!("asyncio.run raises {}: {}", e.kind, e.message),
        (None, v) => panic!("asyncio.run result {v:?}"),
    }
    let r = run(&mut sb, "r, w = os.pipe()\nos.write(w, b'hi')\nos.read(r, 2)");
    match (&r.error, r.value.as_deref()) {
        (None, Some("b'hi'")) => eprintln!("os.pipe: works"),
        (Some(e), _) => eprintln!("os.pipe raises {}: {}", e.kind, e.message),
        (None, v) => panic!("os.pipe result {v:?}"),
    }
    // Still usable, numpy included.
    assert_eq!(value(&mut sb, "import numpy as np\nint(np.arange(5).sum())"), "10");
}
