//! What the HTTP API, the REPL and MCP need from a sandbox, against real
//! guests: streamed output, host-side files, the `/output` folder, and
//! interrupts (SIGINT delivered to the guest like a kernel would).
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, EngineError, ExecOptions, ExecResult, Limits, Sandbox, Stream, Template};

fn home() -> PathBuf {
    match std::env::var("FORKBOX_HOME") {
        Ok(h) if !h.is_empty() => PathBuf::from(h),
        _ => forkbox_image::default_home(),
    }
}

struct Shared {
    engine: Engine,
    template: Template,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
            panic!("these tests need KVM: cannot open /dev/kvm read-write ({e}); they are deliberately not skipped");
        }
        let home = home();
        let built = forkbox_image::build(
            &forkbox_engine::default_image_spec(),
            &forkbox_image::BuildOptions { home: home.clone(), progress: false },
        )
        .unwrap_or_else(|e| panic!("building the default image under {}: {e}", home.display()));
        let engine = Engine::open(&built.path).unwrap_or_else(|e| panic!("Engine::open: {e}"));
        let template = Template::ensure(&engine, &home).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
        Shared { engine, template }
    })
}

#[track_caller]
fn fork_with(limits: Limits) -> Sandbox {
    let s = shared();
    s.template.fork(&s.engine, limits).unwrap_or_else(|e| panic!("fork failed: {e}"))
}

#[track_caller]
fn fork() -> Sandbox {
    fork_with(Limits::default())
}

/// Exec that must succeed without a Python exception.
#[track_caller]
fn ok(sb: &mut Sandbox, code: &str) -> ExecResult {
    let r = sb.exec(code).unwrap_or_else(|e| panic!("exec failed: {e:?}\n--- code ---\n{code}"));
    if let Some(err) = &r.error {
        panic!("unexpected Python exception {}: {}\n{}\n--- code ---\n{code}", err.kind, err.message, err.traceback);
    }
    r
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
    let r = sb.exec_with(code, ExecOptions { on_output: Some(&mut sink), interrupt: None }).expect("streamed exec");
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
        .exec_with("import sys; sys.stdout.line_buffering", ExecOptions { on_output: Some(&mut sink), interrupt: None })
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
fn streamed_output_past_the_capture_limit_still_streams() {
    let mut sb = fork_with(Limits { output_bytes: 100, ..Limits::default() });
    let mut streamed = 0usize;
    let mut sink = |_: Stream, d: &[u8]| streamed += d.len();
    let r = sb.exec_with("for i in range(100): print('x' * 9)", ExecOptions { on_output: Some(&mut sink), interrupt: None }).unwrap();
    assert_eq!(streamed, 1000);
    assert!(r.stdout.starts_with(&"xxxxxxxxx\n".repeat(10)));
    assert!(r.stdout.contains("output truncated, 900 more bytes dropped"), "{}", r.stdout);
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
    let r = ok(&mut sb, "open('/output/big.bin','wb').write(b'x' * (5 << 20))\nopen('/output/small.json','w').write('{}')");
    let got: Vec<(&str, u64, bool)> = r.outputs.iter().map(|o| (o.path.as_str(), o.size, o.data.is_some())).collect();
    assert_eq!(got, [("/output/big.bin", 5 << 20, false), ("/output/small.json", 2, true)]);
}
