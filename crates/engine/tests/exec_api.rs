//! What the HTTP API, the REPL and MCP need from a sandbox, against real
//! guests: streamed output, host-side files, the `/output` folder, and
//! interrupts (SIGINT delivered to the guest like a kernel would).
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::sync::Mutex;
use std::time::{Duration, Instant};

use forkbox_engine::{EngineError, ExecOptions, ExecResult, Interrupter, Limits, Sandbox, Stream};
use forkbox_testkit::guest::{fork_with, ok};

#[track_caller]
fn fork() -> Sandbox {
    fork_with(Limits::default())
}

// ---------------------------------------------------------------------------
// The user's `__main__`
// ---------------------------------------------------------------------------

#[test]
fn a_class_the_user_defines_pickles_and_copies_by_reference() {
    let mut sb = fork();
    ok(&mut sb, "import pickle, copy\nclass A:\n    def __init__(self, x):\n        self.x = x\n    def twice(self):\n        return 2 * self.x\n");
    // Across execs: the class lives in the user's __main__, where pickle looks it up.
    let r = ok(&mut sb, "b = pickle.loads(pickle.dumps(A(21)))\n(type(b) is A, b.twice(), A.__module__)");
    assert_eq!(r.value.as_deref(), Some("(True, 42, '__main__')"), "{r:?}");
    let r = ok(
        &mut sb,
        "c = copy.deepcopy(A([1, 2]))\n(type(c) is A, c.x, pickle.loads(pickle.dumps(A.twice)) is A.twice)",
    );
    assert_eq!(r.value.as_deref(), Some("(True, [1, 2], True)"), "{r:?}");
    // A function by reference, and an instance of a class defined in the same exec.
    let r = ok(&mut sb, "def f(v):\n    return v + 1\nclass B:\n    pass\n(pickle.loads(pickle.dumps(f))(1), type(pickle.loads(pickle.dumps(B()))).__name__)");
    assert_eq!(r.value.as_deref(), Some("(2, 'B')"), "{r:?}");
}

#[test]
fn dataclasses_of_the_user_work_with_their_module() {
    let mut sb = fork();
    let code = "from __future__ import annotations\n\
                import dataclasses, pickle, typing\n\
                @dataclasses.dataclass(frozen=True)\n\
                class P:\n    x: int\n    y: int = 0\n    tags: typing.ClassVar[list] = []\n\
                p = P(1, 2)\n\
                q = pickle.loads(pickle.dumps(p))\n\
                (q == p, q, [f.name for f in dataclasses.fields(P)], dataclasses.replace(p, y=5))";
    let r = ok(&mut sb, code);
    assert_eq!(r.value.as_deref(), Some("(True, P(x=1, y=2), ['x', 'y'], P(x=1, y=5))"), "{r:?}");
}

#[test]
fn import_main_is_the_users_module_not_the_agent() {
    let mut sb = fork();
    ok(&mut sb, "secret = 7");
    let r = ok(&mut sb, "import __main__, sys\n(__main__.secret, __main__ is sys.modules['__main__'], __name__, type(__main__).__name__)");
    assert_eq!(r.value.as_deref(), Some("(7, True, '__main__', 'module')"), "{r:?}");
    // None of the agent's globals is there, and the agent is under no other name either.
    let r = ok(
        &mut sb,
        "import __main__, sys\n\
         agent_names = {'recv', 'send', 'handle', 'run', 'namespace', 'CHANNEL', 'on_sigint', 'main'}\n\
         (sorted(agent_names & set(vars(__main__))), sorted(n for n, m in sys.modules.items() if getattr(m, 'CHANNEL', None) == 3))",
    );
    assert_eq!(r.value.as_deref(), Some("([], [])"), "{r:?}");
    // `globals()` is the module's namespace, so names defined at top level are module attributes.
    let r =
        ok(&mut sb, "def g():\n    return 1\n(globals() is vars(__import__('__main__')), __import__('__main__').g())");
    assert_eq!(r.value.as_deref(), Some("(True, 1)"), "{r:?}");
}

// ---------------------------------------------------------------------------
// Exits per exec
// ---------------------------------------------------------------------------

/// A fork's first exec is two syscalls, one of them a VM exit: the exchange
/// call it resumes in (which returns the request) and the exchange call that
/// hands over the reply (which carries the exec's last stdout/stderr bytes)
/// and parks. The reseed takes its seed from the request, not from
/// getrandom. Output keeps its order and bytes as separate writes gave them.
#[test]
fn an_exec_is_two_syscalls_and_its_output_comes_with_the_reply() {
    let mut sb = fork();
    let r = ok(&mut sb, "print(1+1)");
    assert_eq!(r.stdout, "2\n");
    assert!(r.syscalls <= 2, "a fork's first print(1+1) made {} syscalls", r.syscalls);
    let r = ok(&mut sb, "40 + 2");
    assert_eq!((r.value.as_deref(), r.syscalls), (Some("42"), 2));
    // print() is buffered, os.write is not, the bytes written below the text
    // layer go before its pending text (as in CPython anywhere), stderr is kept.
    let r = ok(
        &mut sb,
        "import os, sys\nprint('a')\nos.write(1, b'b\\n')\nsys.stderr.write('e')\n\
         sys.stdout.buffer.write(b'\\xff')\nprint('c', end='')",
    );
    assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("b\n\u{fffd}a\nc", "e"));
    // Buffering and file numbers as CPython sets them up (stderr line-buffered).
    let r = ok(
        &mut sb,
        "import sys\n(sys.stdout.line_buffering, sys.stderr.line_buffering, sys.stdout.fileno(), \
         sys.stderr.fileno(), sys.__stdout__ is sys.stdout, sys.stdout.encoding)",
    );
    assert_eq!(r.value.as_deref(), Some("(False, True, 1, 2, True, 'utf-8')"), "{r:?}");
    // Past the buffer: the first part goes out as it fills, the rest with the reply.
    let r = ok(&mut sb, "for i in range(3000): print(i)");
    let want: String = (0..3000).map(|i| format!("{i}\n")).collect();
    assert!(r.stdout == want, "{} bytes of stdout, {} expected", r.stdout.len(), want.len());
    // A user's bigger text buffer: what does not fit in a reply is written as usual.
    let r = ok(&mut sb, "sys.stdout._CHUNK_SIZE = 1 << 20\nprint('x' * 150000)\nprint('y', end='')");
    assert!(r.stdout.len() == 150_002 && r.stdout.ends_with("x\ny"), "{} bytes of stdout", r.stdout.len());
    // A user's own sys.stdout is flushed to its file, and the agent's still works after.
    let r = ok(
        &mut sb,
        "import io, sys\nold = sys.stdout\nsys.stdout = io.TextIOWrapper(open(1, 'wb', closefd=False))\nprint('mine')",
    );
    assert_eq!(r.stdout, "mine\n");
    let r = ok(&mut sb, "sys.stdout = old\nprint('back')");
    assert_eq!(r.stdout, "back\n");
}

/// A prelude runs in the same exec and namespace just before the code, but
/// compiled apart: the code's traceback keeps its own line numbers; an error
/// in the prelude is the exec's, and the code does not run.
#[test]
fn a_prelude_runs_before_the_code_without_moving_its_lines() {
    let mut sb = fork();
    let with = |prelude| ExecOptions { prelude: Some(prelude), ..Default::default() };
    let r = sb.exec_with("x = base + 1\n1/0", with("import os\nos.chdir('/tmp')\nbase = 41\n")).unwrap();
    let e = r.error.expect("the code's ZeroDivisionError");
    assert_eq!(e.kind, "ZeroDivisionError");
    assert!(e.traceback.contains("line 2") && !e.traceback.contains("prelude"), "{}", e.traceback);
    assert_eq!(ok(&mut sb, "(x, os.getcwd())").value.as_deref(), Some("(42, '/tmp')"));
    // The prelude fails: that is the error, and the code did not run.
    let r = sb.exec_with("ran = True", with("raise ValueError('setup')")).unwrap();
    assert_eq!(r.error.map(|e| (e.kind, e.message)), Some(("ValueError".into(), "setup".into())));
    assert_eq!(ok(&mut sb, "'ran' in globals()").value.as_deref(), Some("False"));
    // Prelude and code together within the code limit.
    let big = "#".repeat(Limits::default().code_bytes);
    assert!(matches!(sb.exec_with("1", with(&big)), Err(EngineError::CodeTooLarge(..))));
}

// ---------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------

#[test]
fn streamed_output_arrives_in_order_as_it_is_written_and_equals_the_capture() {
    let mut sb = fork();
    let code = "import sys, time\n\
                for i in range(4):\n    print('line', i)\n    time.sleep(0.15)\n\
                print('oops', file=sys.stderr)\n\
                print('tail without newline', end='')\n";
    let t0 = Instant::now();
    let mut chunks: Vec<(Duration, Stream, Vec<u8>)> = Vec::new();
    let mut sink = |s: Stream, d: &[u8]| chunks.push((t0.elapsed(), s, d.to_vec()));
    let r = sb
        .exec_with(
            code,
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
        .expect("streamed exec");
    let done = t0.elapsed();
    assert!(r.error.is_none(), "{:?}", r.error);
    assert_eq!(r.stdout, "line 0\nline 1\nline 2\nline 3\ntail without newline");
    assert_eq!(r.stderr, "oops\n");
    let out: Vec<u8> = chunks.iter().filter(|c| c.1 == Stream::Stdout).flat_map(|c| c.2.clone()).collect();
    let err: Vec<u8> = chunks.iter().filter(|c| c.1 == Stream::Stderr).flat_map(|c| c.2.clone()).collect();
    assert_eq!(String::from_utf8(out).unwrap(), r.stdout, "streamed stdout equals the captured stdout");
    assert_eq!(String::from_utf8(err).unwrap(), r.stderr);
    // Line-buffered: each line is its own write, and they are spread over the run.
    let lines: Vec<&(Duration, Stream, Vec<u8>)> = chunks.iter().filter(|c| c.2.starts_with(b"line")).collect();
    assert_eq!(lines.len(), 4, "one chunk per line: {chunks:?}");
    assert!(lines[3].0 - lines[0].0 >= Duration::from_millis(400), "chunks arrived as produced: {chunks:?}");
    assert!(lines[0].0 + Duration::from_millis(400) <= done, "the first line arrived long before the result");
    // stderr's chunk comes after the 4 lines and before the tail.
    let order: Vec<Stream> = chunks.iter().map(|c| c.1).collect();
    assert_eq!(order, [Stream::Stdout, Stream::Stdout, Stream::Stdout, Stream::Stdout, Stream::Stderr, Stream::Stdout]);
}

#[test]
fn a_streamed_exec_restores_block_buffering_for_the_next_one() {
    let mut sb = fork();
    let mut n = 0;
    let mut sink = |_: Stream, _: &[u8]| n += 1;
    let r = sb
        .exec_with(
            "import sys; sys.stdout.line_buffering",
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
        .unwrap();
    assert_eq!(r.value.as_deref(), Some("True"));
    let r = ok(&mut sb, "sys.stdout.line_buffering");
    assert_eq!(r.value.as_deref(), Some("False"), "non-streamed execs keep block buffering");
    // Block-buffered: 50 prints are one write (one VM exit), not 50.
    let r = ok(&mut sb, "for i in range(50): print(i)");
    assert_eq!(r.stdout.lines().count(), 50);
    assert!(r.syscalls < 20, "{} syscalls for 50 buffered prints", r.syscalls);
}

#[test]
fn streamed_output_stops_at_the_output_limit_with_a_marker() {
    let mut sb = fork_with(Limits { output_bytes: 100, ..Limits::default() });
    let mut streamed = Vec::new();
    let mut sink = |_: Stream, d: &[u8]| streamed.extend_from_slice(d);
    let r = sb
        .exec_with(
            "for i in range(100): print('x' * 9)",
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
        .unwrap();
    let marker = forkbox_linux::kernel::state::STREAM_TRUNCATED;
    assert_eq!(streamed.len(), 100 + marker.len(), "{}", String::from_utf8_lossy(&streamed));
    assert_eq!(&streamed[..100], "xxxxxxxxx\n".repeat(10).as_bytes());
    assert!(streamed.ends_with(marker));
    assert!(r.stdout.starts_with(&"xxxxxxxxx\n".repeat(10)));
    assert!(r.stdout.contains("output truncated, 900 more bytes dropped"), "{}", r.stdout);
}

#[test]
fn a_forged_reply_from_user_code_is_cut_to_the_limits() {
    // User code can write its own reply frame to fd 3 and then hang in the agent's read:
    // the host still cuts the value to the output limit.
    let mut sb = fork_with(Limits { output_bytes: 1000, ..Limits::default() });
    let code =
        "import os, json\nbody = json.dumps({'value': 'v' * 50000, 'error': None, 'runtime_ms': 1.0}).encode()\n\
                os.write(3, len(body).to_bytes(4, 'little') + body)\nos.read(3, 4)";
    match sb.exec(code) {
        Ok(r) => {
            let v = r.value.unwrap_or_default();
            assert!(v.len() < 1100, "value of {} bytes", v.len());
        }
        Err(e) => assert_eq!(e.code(), "protocol_error", "{e}"),
    }
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

#[test]
fn files_written_by_the_host_are_seen_by_python_and_back() {
    let mut sb = fork();
    sb.write_file("/data/in/numbers.txt", b"1 2 3\n").unwrap();
    let r = ok(&mut sb, "import os\nopen('/data/in/numbers.txt').read(), oct(os.stat('/data/in/numbers.txt').st_mode & 0o777), os.path.isdir('/data/in')");
    assert_eq!(r.value.as_deref(), Some("('1 2 3\\n', '0o644', True)"));
    ok(&mut sb, "os.makedirs('/data/out', exist_ok=True)\nopen('/data/out/sum.txt', 'w').write(str(sum(map(int, open('/data/in/numbers.txt').read().split()))))");
    assert_eq!(sb.read_file("/data/out/sum.txt", 100).unwrap(), b"6");
    // Overwrite replaces the content; relative paths start at the guest's cwd.
    ok(&mut sb, "os.chdir('/data')");
    sb.write_file("in/numbers.txt", b"7").unwrap();
    assert_eq!(sb.read_file("/data/in/numbers.txt", 100).unwrap(), b"7");
    assert_eq!(sb.read_file("./in/../in/numbers.txt", 100).unwrap(), b"7");
    let list = sb.list_dir("/data").unwrap();
    let names: Vec<(&str, bool)> = list.iter().map(|e| (e.name.as_str(), e.is_dir)).collect();
    assert_eq!(names, [("in", true), ("out", true)]);
    let list = sb.list_dir("out").unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].path.as_str(), list[0].size, list[0].is_dir), ("/data/out/sum.txt", 1, false));
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    assert!((now_ms - list[0].mtime_ms).abs() < 60_000, "mtime {} vs now {now_ms}", list[0].mtime_ms);
    // Binary content survives untouched.
    let bytes: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    sb.write_file("/tmp/blob.bin", &bytes).unwrap();
    let r = ok(&mut sb, "import hashlib; hashlib.sha256(open('/tmp/blob.bin','rb').read()).hexdigest()");
    let want = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    assert_eq!(r.value.unwrap(), format!("'{want}'"));
    assert_eq!(sb.read_file("/tmp/blob.bin", bytes.len()).unwrap(), bytes);
}

#[test]
fn hostile_and_wrong_paths_get_the_right_codes() {
    let mut sb = fork_with(Limits { disk_bytes: 1 << 20, ..Limits::default() });
    let code = |r: Result<(), EngineError>| r.map_err(|e| e.code()).err();
    for bad in ["../../etc/passwd", "/../../x", "/tmp/../../x", "a\0b", ""] {
        assert_eq!(code(sb.write_file(bad, b"x")), Some("invalid_path"), "write {bad:?}");
        assert_eq!(sb.read_file(bad, 10).map_err(|e| e.code()).err(), Some("invalid_path"), "read {bad:?}");
    }
    assert_eq!(code(sb.write_file(&format!("/tmp/{}", "a/".repeat(2100)), b"x")), Some("invalid_path"));
    assert_eq!(sb.read_file("/nope/nothing", 10).unwrap_err().code(), "file_not_found");
    assert_eq!(sb.list_dir("/nope").unwrap_err().code(), "file_not_found");
    assert_eq!(sb.read_file("/tmp", 10).unwrap_err().code(), "is_a_directory");
    assert_eq!(code(sb.write_file("/tmp", b"x")), Some("is_a_directory"));
    assert_eq!(code(sb.write_file("/", b"x")), Some("is_a_directory"));
    assert_eq!(code(sb.write_file("/tmp/newdir/", b"x")), Some("is_a_directory"));
    assert_eq!(sb.read_file("/tmp/newdir", 10).unwrap_err().code(), "file_not_found");
    sb.write_file("/tmp/f", b"0123456789").unwrap();
    assert_eq!(sb.read_file("/tmp/f", 9).unwrap_err().code(), "file_too_large");
    assert_eq!(sb.read_file("/tmp/f", 10).unwrap(), b"0123456789");
    assert_eq!(code(sb.write_file("/tmp/f/under", b"x")), Some("invalid_path"), "a file as a parent directory");
    // The guest cannot escape either: a symlink to / resolves inside the VFS.
    ok(&mut sb, "import os; os.symlink('/', '/tmp/root')");
    assert!(sb.read_file("/tmp/root/opt/forkbox/agent.py", 1 << 20).unwrap().starts_with(b"\"\"\"forkbox guest agent"));
    assert!(sb.read_file("/tmp/root/../../tmp/f", 10).is_ok(), "\"..\" after a symlink stays inside the guest");
    // 10 MiB over a 1 MiB quota: refused, nothing left behind.
    let big = vec![7u8; 10 << 20];
    assert_eq!(code(sb.write_file("/tmp/big.bin", &big)), Some("quota_exceeded"));
    assert_eq!(sb.read_file("/tmp/big.bin", 1).unwrap_err().code(), "file_not_found");
    // The sandbox still works.
    assert_eq!(ok(&mut sb, "open('/tmp/f').read()").value.as_deref(), Some("'0123456789'"));
}

#[test]
fn uploads_into_proc_sys_and_dev_are_refused() {
    let mut sb = fork();
    let code = |r: Result<(), EngineError>| r.map_err(|e| e.code()).err();
    // Symlinks into those trees count as the trees.
    ok(&mut sb, "import os; os.symlink('/proc/self', '/tmp/me'); os.symlink('/dev', '/tmp/d'); os.symlink('/dev/null', '/tmp/n')");
    for bad in [
        "/proc/self/mem",
        "/proc/new.txt",
        "/proc/1/x/y",
        "/dev/null",
        "/dev/shm/x",
        "/sys/kernel/x",
        "/tmp/me/mem",
        "/tmp/d/x",
        "/tmp/n",
    ] {
        assert_eq!(code(sb.write_file(bad, b"x")), Some("invalid_path"), "write {bad:?}");
    }
    // Nothing was made there; elsewhere uploads still work.
    let r =
        ok(&mut sb, "import os; os.path.exists('/proc/new.txt'), os.path.exists('/sys/kernel'), os.readlink('/tmp/n')");
    assert_eq!(r.value.as_deref(), Some("(False, False, '/dev/null')"));
    sb.write_file("/tmp/d2/x", b"ok").unwrap();
    assert_eq!(ok(&mut sb, "open('/tmp/d2/x').read()").value.as_deref(), Some("'ok'"));
}

// ---------------------------------------------------------------------------
// /output
// ---------------------------------------------------------------------------

const PNG_CODE: &str = r#"
import struct, zlib
def chunk(kind, data):
    c = struct.pack('>I', len(data)) + kind + data
    return c + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff)
w, h = 4, 3
rows = b''.join(b'\x00' + b''.join(bytes([x * 60, y * 80, 200]) for x in range(w)) for y in range(h))
png = b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0)) + chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b'')
open('/output/plot.png', 'wb').write(png)
png.hex()
"#;

#[test]
fn files_an_exec_writes_under_output_come_back_once() {
    let mut sb = fork();
    assert!(sb.list_dir("/output").unwrap().is_empty(), "/output exists and is empty in the template");
    let r = ok(&mut sb, PNG_CODE);
    let want = hex::decode(r.value.as_deref().unwrap().trim_matches('\'')).unwrap();
    assert!(want.starts_with(b"\x89PNG"));
    assert_eq!(r.outputs.len(), 1, "{:?}", r.outputs);
    let o = &r.outputs[0];
    assert_eq!((o.path.as_str(), o.mime, o.size), ("/output/plot.png", "image/png", want.len() as u64));
    assert_eq!(o.data.as_deref(), Some(&want[..]));
    let json = serde_json::to_value(&r).unwrap();
    use base64::Engine as _;
    assert_eq!(json["outputs"][0]["base64"], base64::engine::general_purpose::STANDARD.encode(&want));
    // The next exec does not touch /output: nothing comes back (and the JSON has no `outputs`).
    let r = ok(&mut sb, "x = 1\nopen('/tmp/other.txt', 'w').write('not an output')");
    assert!(r.outputs.is_empty(), "{:?}", r.outputs);
    assert!(serde_json::to_value(&r).unwrap().get("outputs").is_none());
    // Changing the file, and a new one in a subfolder, come back; the unchanged file does not.
    let r = ok(&mut sb, "import os\nos.makedirs('/output/sub')\nopen('/output/sub/t.csv','w').write('a,b\\n1,2\\n')\nopen('/output/plot.png','ab').write(b'!')");
    let got: Vec<(&str, &str, u64)> = r.outputs.iter().map(|o| (o.path.as_str(), o.mime, o.size)).collect();
    assert_eq!(got, [("/output/plot.png", "image/png", want.len() as u64 + 1), ("/output/sub/t.csv", "text/csv", 8)]);
    // A host upload into /output is not reported as the next exec's output.
    sb.write_file("/output/uploaded.txt", b"from the host").unwrap();
    assert!(ok(&mut sb, "1").outputs.is_empty());
}

#[test]
fn large_outputs_come_back_without_their_bytes() {
    let mut sb = fork();
    let r =
        ok(&mut sb, "open('/output/big.bin','wb').write(b'x' * (5 << 20))\nopen('/output/small.json','w').write('{}')");
    let got: Vec<(&str, u64, bool)> = r.outputs.iter().map(|o| (o.path.as_str(), o.size, o.data.is_some())).collect();
    assert_eq!(got, [("/output/big.bin", 5 << 20, false), ("/output/small.json", 2, true)]);
}

// ---------------------------------------------------------------------------
// Interrupt
// ---------------------------------------------------------------------------

/// Run `code` with an interrupter fired `after` from another thread.
fn exec_interrupted(
    sb: &mut Sandbox,
    code: &str,
    after: Duration,
) -> (Result<ExecResult, EngineError>, bool, Duration) {
    let intr = Interrupter::new();
    let fired = Mutex::new(None);
    let r = std::thread::scope(|s| {
        let i2 = intr.clone();
        let fired = &fired;
        s.spawn(move || {
            std::thread::sleep(after);
            let t = Instant::now();
            let hit = i2.interrupt();
            *fired.lock().unwrap() = Some((hit, t));
        });
        sb.exec_with(
            code,
            ExecOptions { on_output: None, interrupt: Some(intr.clone()), timeout: None, job: false, prelude: None },
        )
    });
    let end = Instant::now();
    let (hit, at) = fired.into_inner().unwrap().expect("interrupt thread ran");
    (r, hit, end.saturating_duration_since(at))
}

#[test]
fn interrupt_when_nothing_runs_returns_false() {
    let mut sb = fork();
    let i = Interrupter::new();
    assert!(!i.interrupt());
    ok(&mut sb, "y = 2");
    let r = sb
        .exec_with(
            "y + 1",
            ExecOptions { on_output: None, interrupt: Some(i.clone()), timeout: None, job: false, prelude: None },
        )
        .unwrap();
    assert_eq!(r.value.as_deref(), Some("3"));
    assert!(!i.interrupt(), "the exec is over");
    assert_eq!(ok(&mut sb, "y").value.as_deref(), Some("2"));
}

#[test]
fn interrupting_a_busy_loop_raises_keyboard_interrupt_and_keeps_the_namespace() {
    let mut sb = fork();
    ok(&mut sb, "before = 41");
    let (r, hit, took) = exec_interrupted(&mut sb, "n = 0\nwhile True:\n    n += 1", Duration::from_millis(300));
    assert!(hit, "an exec was running");
    let r = r.expect("an interrupted exec is a result, not an error");
    let e = r.error.expect("KeyboardInterrupt");
    assert_eq!(e.kind, "KeyboardInterrupt", "{e:?}");
    assert!(e.traceback.contains("<exec-"), "{}", e.traceback);
    assert!(!e.traceback.contains("agent.py"), "{}", e.traceback);
    assert!(took < Duration::from_secs(1), "interrupt took {took:?}");
    let r = ok(&mut sb, "before + 1, n > 1000");
    assert_eq!(r.value.as_deref(), Some("(42, True)"));
}

#[test]
fn interrupting_a_sleep_wakes_it() {
    let mut sb = fork();
    ok(&mut sb, "import time; before = 'kept'");
    let (r, hit, took) = exec_interrupted(&mut sb, "time.sleep(100)", Duration::from_millis(300));
    assert!(hit);
    let r = r.expect("result");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("KeyboardInterrupt"), "{r:?}");
    assert!(took < Duration::from_secs(1), "interrupt took {took:?}");
    assert_eq!(ok(&mut sb, "before").value.as_deref(), Some("'kept'"));
    // The handler ran with the registers it was interrupted with: numpy (SIMD state) still agrees.
    let r = ok(&mut sb, "import numpy as np\na = np.arange(1000.0)\nfloat((a * 1.5).sum())");
    assert_eq!(r.value.as_deref(), Some("749250.0"));
}

#[test]
fn interrupting_a_numpy_loop_preserves_floating_point_state() {
    let mut sb = fork();
    let code = "import numpy as np\nacc = []\nx = np.linspace(0, 1, 4096)\nwhile True:\n    acc.append(float((x * x).sum()))\n    if len(acc) > 1000: acc.clear()";
    let (r, _, _) = exec_interrupted(&mut sb, code, Duration::from_millis(400));
    let r = r.expect("result");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("KeyboardInterrupt"), "{r:?}");
    let r = ok(&mut sb, "len(set(acc)), acc[0] if acc else None");
    let v = r.value.unwrap();
    assert!(v.starts_with("(1, 1365.") || v == "(0, None)", "every sum agrees: {v}");
}

#[test]
fn a_guest_that_swallows_interrupts_is_killed_after_the_grace_period() {
    let mut sb = fork();
    // (A bare `while True: pass` directly in the `try` would not catch it: a
    // CPython 3.11 quirk, on Linux too. A call does.)
    let code = "def spin():\n    while True: pass\nwhile True:\n    try:\n        spin()\n    except KeyboardInterrupt:\n        pass";
    let (r, hit, took) = exec_interrupted(&mut sb, code, Duration::from_millis(200));
    assert!(hit);
    match r {
        Err(EngineError::Interrupted(_)) => {}
        other => panic!("expected Interrupted, got {other:?}"),
    }
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(4), "killed after {took:?}");
    assert_eq!(sb.exec("1").unwrap_err().code(), "sandbox_unusable");
}

#[test]
fn a_guest_that_ignores_sigint_is_killed() {
    let mut sb = fork();
    let code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass";
    let (r, _, took) = exec_interrupted(&mut sb, code, Duration::from_millis(300));
    match r {
        Err(e @ EngineError::Interrupted(_)) => assert_eq!(e.code(), "interrupted"),
        other => panic!("expected Interrupted, got {other:?}"),
    }
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn a_guest_that_blocks_sigint_is_killed() {
    let mut sb = fork();
    let code = "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\nwhile True: pass";
    let (r, _, took) = exec_interrupted(&mut sb, code, Duration::from_millis(300));
    match r {
        Err(EngineError::Interrupted(why)) => assert!(why.contains("blocks SIGINT"), "{why}"),
        other => panic!("expected Interrupted, got {other:?}"),
    }
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn a_python_handler_sees_sane_registers_and_the_exec_goes_on() {
    let mut sb = fork();
    // A handler of the user's own: the exec continues after it (no exception), state intact.
    let code = "import signal, time\ngot = []\nsignal.signal(signal.SIGINT, lambda s, f: got.append((s, f.f_code.co_name)))\n\
                def spin():\n    t = time.time()\n    while not got and time.time() - t < 5: pass\n    return sum(range(1000))\n\
                r = spin()\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n(got, r)";
    let (r, _, _) = exec_interrupted(&mut sb, code, Duration::from_millis(300));
    let r = r.expect("result");
    assert!(r.error.is_none(), "{:?}", r.error);
    assert_eq!(r.value.as_deref(), Some("([(2, 'spin')], 499500)"));
}

#[test]
fn many_interrupts_into_a_computation_leave_its_result_exact() {
    let mut sb = fork();
    // A handler of the user's that only counts: every delivery and rt_sigreturn
    // must restore integer, float (SSE) and flag state exactly.
    let code = "import signal\nhits = []\nsignal.signal(signal.SIGINT, lambda s, f: hits.append(s))\nprint('ready')\n\
                def work():\n    t = 0\n    f = 0.0\n    for i in range(1_000_000):\n        t = (t * 31 + i) % 1000003\n        f += i * 0.5\n    return t, f\n\
                r = work()\n(r, len(hits))";
    // (No restore of the default handler: interrupts keep coming until the exec
    // is over, and the agent takes SIGINT back after each exec anyway.)
    let intr = Interrupter::new();
    let fired = std::sync::atomic::AtomicUsize::new(0);
    // Fire only once the handler is in place (the guest says so on its streamed stdout).
    let ready = std::sync::atomic::AtomicBool::new(false);
    let r = std::thread::scope(|s| {
        let i2 = intr.clone();
        let (fired, ready) = (&fired, &ready);
        s.spawn(move || {
            while !ready.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            // At most ~20: the handler returns without ending the exec, so the
            // 2 s grace period that started with the first one still runs.
            while fired.load(std::sync::atomic::Ordering::Relaxed) < 20 && i2.interrupt() {
                fired.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let mut sink = |_: Stream, d: &[u8]| {
            if d == b"ready\n" {
                ready.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        };
        let r = sb.exec_with(
            code,
            ExecOptions {
                on_output: Some(&mut sink),
                interrupt: Some(intr.clone()),
                timeout: None,
                job: false,
                prelude: None,
            },
        );
        ready.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    let r = r.expect("the computation finished within the grace period");
    assert!(r.error.is_none(), "{:?}", r.error);
    let v = r.value.unwrap();
    let fired = fired.into_inner();
    assert!(v.starts_with("((256782, 249999750000.0), "), "{v}");
    let hits: usize = v.trim_start_matches("((256782, 249999750000.0), ").trim_end_matches(')').parse().unwrap();
    eprintln!("{hits} deliveries for {fired} interrupts");
    assert!(hits >= 5, "only {hits} deliveries ({fired} interrupts)");
    assert!(hits <= fired, "{hits} deliveries for {fired} interrupts");
    assert_eq!(ok(&mut sb, "sum(range(10))").value.as_deref(), Some("45"));
    // The agent took SIGINT back from the user's handler after that exec.
    let (r, _, _) = exec_interrupted(&mut sb, "while True: pass", Duration::from_millis(200));
    assert_eq!(r.expect("result").error.map(|e| e.kind), Some("KeyboardInterrupt".to_string()));
}

#[test]
fn an_armed_interrupter_keeps_an_interrupt_for_the_exec_about_to_start() {
    let mut sb = fork();
    ok(&mut sb, "n = 7");
    let i = Interrupter::new();
    i.arm();
    assert!(i.interrupt(), "armed: an exec is about to start");
    let t0 = Instant::now();
    let r = sb
        .exec_with(
            "while True: n += 1",
            ExecOptions { on_output: None, interrupt: Some(i.clone()), timeout: None, job: false, prelude: None },
        )
        .unwrap();
    assert_eq!(r.error.map(|e| e.kind).as_deref(), Some("KeyboardInterrupt"));
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert_eq!(ok(&mut sb, "n").value.as_deref(), Some("7"), "interrupted before any user code ran");
    // Once that exec is over, the interrupter is disarmed; a disarmed one counts nothing.
    assert!(!i.interrupt());
    i.arm();
    i.disarm();
    assert!(!i.interrupt());
    assert_eq!(ok(&mut sb, "n + 1").value.as_deref(), Some("8"));
}

#[test]
fn a_c_level_handler_reads_siginfo_and_the_interrupted_registers() {
    let mut sb = fork();
    // A SA_SIGINFO handler through ctypes: it reads siginfo and the ucontext's
    // registers as a C handler would (uc_mcontext at 40, gregs REG_RSP 15, REG_RIP 16, REG_EFL 17).
    let code = r#"
import ctypes, signal, time
libc = ctypes.CDLL(None)
seen = []
HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
def h(sig, info, uc):
    si = ctypes.cast(info, ctypes.POINTER(ctypes.c_int * 4)).contents
    g = ctypes.cast(uc + 40, ctypes.POINTER(ctypes.c_uint64 * 18)).contents
    mask = ctypes.cast(uc + 296, ctypes.POINTER(ctypes.c_uint64)).contents.value
    seen.append((sig, si[0], si[2], g[15], g[16], g[17], mask))
cb = HANDLER(h)
class SA(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_uint64 * 16), ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]
sa = SA()
sa.handler = ctypes.cast(cb, ctypes.c_void_p).value
sa.flags = 4  # SA_SIGINFO (glibc adds SA_RESTORER)
assert libc.sigaction(2, ctypes.byref(sa), None) == 0
print('ready', flush=True)
t = time.time()
while not seen and time.time() - t < 5: pass
signal.signal(signal.SIGINT, signal.default_int_handler)
seen
"#;
    let i = Interrupter::new();
    let ready = std::sync::atomic::AtomicBool::new(false);
    let r = std::thread::scope(|s| {
        let (i2, ready) = (i.clone(), &ready);
        s.spawn(move || {
            while !ready.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(50));
            i2.interrupt();
        });
        let mut sink = |_: Stream, d: &[u8]| {
            if d.starts_with(b"ready") {
                ready.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        };
        let r = sb.exec_with(
            code,
            ExecOptions {
                on_output: Some(&mut sink),
                interrupt: Some(i.clone()),
                timeout: None,
                job: false,
                prelude: None,
            },
        );
        ready.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    let r = r.expect("result");
    assert!(r.error.is_none(), "{:?}", r.error);
    let v = r.value.unwrap();
    let nums: Vec<u64> = v.trim_matches(|c| "[]() ".contains(c)).split(", ").map(|x| x.parse().unwrap()).collect();
    let [sig, signo, code, rsp, rip, eflags, mask] = nums[..] else { panic!("one delivery expected: {v}") };
    assert_eq!((sig, signo, code), (2, 2, 0x80), "signo and SI_KERNEL");
    assert!((0x8000_0000..0x1_0000_0000).contains(&rsp), "interrupted rsp {rsp:#x} on the stack");
    // In the interpreter, or in the vDSO's clock_gettime (time.time() in the loop).
    let vdso = forkbox_vmm::layout::VDSO_PAGE..forkbox_vmm::layout::VDSO_PAGE + 4096 * forkbox_vmm::layout::VDSO_PAGES;
    assert!((0x40_0000..0x4000_0000).contains(&rip) || vdso.contains(&rip), "interrupted rip {rip:#x} in user code");
    // Bit 1 is always set; no trap flag. (IF as KVM reports it for CPL 3 differs by host: not checked.)
    assert_eq!(eflags & 0x102, 0x2, "eflags {eflags:#x}");
    assert_eq!(mask & 2, 0, "SIGINT was not blocked when interrupted");
    // The agent has SIGINT back: the next interrupt raises KeyboardInterrupt.
    let (r, _, _) = exec_interrupted(&mut sb, "while True: pass", Duration::from_millis(200));
    assert_eq!(r.expect("result").error.map(|e| e.kind).as_deref(), Some("KeyboardInterrupt"));
}

#[test]
fn hard_links_and_names_are_charged_to_the_disk_quota() {
    // The attack: 200,000 hard links of one file cost nothing. Now
    // each name costs quota, so a 4 MiB quota stops them early with ENOSPC.
    let quota = 4u64 << 20;
    let mut sb = fork_with(Limits { disk_bytes: quota, ..Limits::default() });
    let code = "import os, errno\nos.makedirs('/tmp/l')\nopen('/tmp/l/f', 'w').write('x')\nn, err = 0, None\n\
                try:\n    for n in range(200000):\n        os.link('/tmp/l/f', '/tmp/l/%d' % n)\n    n = 200000\n\
                except OSError as e:\n    err = e.errno\n(n, err)";
    let r = ok(&mut sb, code);
    let v = r.value.unwrap();
    let (n, err) = v.trim_matches(|c| c == '(' || c == ')').split_once(", ").unwrap();
    let n: u64 = n.parse().unwrap();
    assert_eq!(err, "28", "links stopped by ENOSPC: {v}");
    assert!(n < 200_000, "{n} links made under a {quota}-byte quota");
    // Each link was charged at least its entry cost.
    assert!(n * forkbox_linux::vfs::ENTRY_COST <= quota, "{n} links");
    assert!(n * (forkbox_linux::vfs::ENTRY_COST + 6) >= quota / 2, "only {n} links before ENOSPC");
    // Symlinks and new names are charged too; deleting gives the quota back.
    let r = ok(&mut sb, "try:\n    os.symlink('/tmp/l/f', '/tmp/l/s' + 'y' * 200)\n    r = 'made'\nexcept OSError as e:\n    r = e.errno\nr");
    assert_eq!(r.value.as_deref(), Some("28"));
    ok(&mut sb, "import shutil\nshutil.rmtree('/tmp/l')");
    let r = ok(&mut sb, "os.symlink('/x', '/tmp/s')\nos.readlink('/tmp/s')");
    assert_eq!(r.value.as_deref(), Some("'/x'"));
}

#[test]
fn an_exec_s_own_time_limit_and_the_output_of_a_failed_exec() {
    // The exec's limit replaces the sandbox's (30 s) for that exec only.
    let mut sb = fork();
    let code =
        "import sys\nprint('so far', flush=True)\nsys.stderr.write('err\\n'); sys.stderr.flush()\nwhile True: pass";
    let t0 = Instant::now();
    let opts = ExecOptions { timeout: Some(Duration::from_millis(700)), ..Default::default() };
    match sb.exec_with(code, opts) {
        Err(EngineError::Timeout(secs)) => assert!((secs - 0.7).abs() < 0.01, "Timeout({secs})"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let out = sb.take_failed_output().expect("the output before the timeout");
    assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("so far\n", "err\n"));
    assert_eq!(sb.take_failed_output(), None, "taken once");
    // A poisoned sandbox refuses before running: no output.
    assert!(matches!(sb.exec("1"), Err(EngineError::Poisoned(_))));
    assert_eq!(sb.take_failed_output(), None);

    // A crash and an exit keep what was written, cut to the output limit like a result's.
    let mut sb = fork_with(Limits { output_bytes: 4096, ..Limits::default() });
    assert!(matches!(
        sb.exec("print('x' * 10000, flush=True)\nimport os\nos._exit(3)"),
        Err(EngineError::GuestExited(3))
    ));
    let out = sb.take_failed_output().expect("output");
    assert!(
        out.stdout.starts_with("xxxx") && out.stdout.contains("output truncated") && out.stdout.len() < 4096 + 100,
        "{}",
        out.stdout.len()
    );
    let mut sb = fork();
    assert!(matches!(
        sb.exec("import ctypes\nprint('pre', flush=True)\nctypes.string_at(0)"),
        Err(EngineError::GuestCrashed(_))
    ));
    assert_eq!(sb.take_failed_output().map(|o| o.stdout), Some("pre\n".into()));
    // A successful exec leaves none.
    let mut sb = fork();
    ok(&mut sb, "print('fine')");
    assert_eq!(sb.take_failed_output(), None);
}
