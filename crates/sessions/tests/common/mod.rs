//! Shared harness for the session tests (included by each test binary with
//! `mod common;`).
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
//!
//! One `Engine` and one `Template` (in the shared home) per test binary; every
//! test gives its `SessionManager` a fresh temporary home, so sessions never
//! leak between tests. Temporary homes get a `templates` symlink to the shared
//! home's templates, so the `forkbox` CLI run against them (with `--image`)
//! loads the same template instead of building one.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use forkbox_engine::{ExecResult, Limits};
use forkbox_sessions::manager::{Config, ExecOutcome, SessionError, SessionManager};
use forkbox_sessions::store::SessionRecord;

pub const TENANT: &str = "local";

#[allow(unused_imports)] // each test binary uses some of them
pub use forkbox_testkit::{home as shared_home, raise_fd_limit, require_kvm, shared, Shared};

/// A fresh data directory for one test's sessions (removed when dropped).
pub struct TestHome {
    pub dir: tempfile::TempDir,
}

impl TestHome {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
    pub fn layers(&self) -> PathBuf {
        self.path().join("sessions").join("layers")
    }
}

pub fn fresh_home() -> TestHome {
    let s = shared();
    let dir = tempfile::Builder::new().prefix("forkbox-sessions-test-").tempdir().expect("temp dir");
    // The CLI builds its template under its home: point it at the shared one.
    std::os::unix::fs::symlink(forkbox_engine::template::templates_dir(&s.home), dir.path().join("templates"))
        .expect("symlink templates");
    TestHome { dir }
}

pub fn open(home: &Path, config: Config) -> SessionManager {
    let s = shared();
    SessionManager::open(s.engine.clone(), s.template.clone(), home, config)
        .unwrap_or_else(|e| panic!("SessionManager::open({}): {e}", home.display()))
}

pub fn open_default(home: &Path) -> SessionManager {
    open(home, Config::default())
}

pub fn new_session(m: &SessionManager) -> SessionRecord {
    new_session_with(m, &Limits::default())
}

pub fn new_session_with(m: &SessionManager, limits: &Limits) -> SessionRecord {
    m.create(TENANT, BTreeMap::new(), limits).unwrap_or_else(|e| panic!("create: {e}"))
}

/// Exec that must succeed without a Python exception.
#[track_caller]
pub fn ok(m: &SessionManager, id: &str, code: &str) -> ExecOutcome {
    let out =
        m.exec(TENANT, id, code).unwrap_or_else(|e| panic!("exec in {id} failed: {e} ({e:?})\n--- code ---\n{code}"));
    check_no_exception(&out.result, code);
    out
}

#[track_caller]
pub fn check_no_exception(r: &ExecResult, code: &str) {
    if let Some(err) = &r.error {
        panic!(
            "unexpected Python exception {}: {}\n{}\n--- code ---\n{code}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            err.kind, err.message, err.traceback, r.stdout, r.stderr
        );
    }
}

/// The repr of the trailing expression of `code`.
#[track_caller]
pub fn value(m: &SessionManager, id: &str, code: &str) -> String {
    let out = ok(m, id, code);
    out.result.value.unwrap_or_else(|| panic!("no value for code:\n{code}"))
}

/// Exec that must fail with `ExecFailed`; returns (engine error code, rolled-back-to seq).
#[track_caller]
pub fn exec_failed(m: &SessionManager, id: &str, code: &str) -> (String, Option<i64>, String) {
    match m.exec(TENANT, id, code) {
        Err(e @ SessionError::ExecFailed { .. }) => {
            let msg = e.to_string();
            let SessionError::ExecFailed { source, checkpoint, .. } = e else { unreachable!() };
            (source.code().to_string(), checkpoint, msg)
        }
        Err(e) => panic!("expected ExecFailed, got another error: {e} ({e:?})\n--- code ---\n{code}"),
        Ok(o) => panic!("expected ExecFailed, got a result {:?}\n--- code ---\n{code}", o.result),
    }
}

/// Total size of the regular files under `dir` (recursively), and their count.
pub fn dir_usage(dir: &Path) -> (u64, usize) {
    let mut bytes = 0;
    let mut files = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                let (b, f) = dir_usage(&e.path());
                bytes += b;
                files += f;
            } else if md.is_file() {
                bytes += md.len();
                files += 1;
            }
        }
    }
    (bytes, files)
}

pub fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

// ---------------------------------------------------------------------------
// The `forkbox` CLI, as a separate process
// ---------------------------------------------------------------------------

/// Path of the `forkbox` binary of this workspace, built (once per test
/// binary) in the same target directory and profile as the tests.
/// `FORKBOX_BIN` overrides it.
pub fn forkbox_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("FORKBOX_BIN").filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        // The test binary is <target>/<profile>/deps/<name>-<hash>.
        let exe = std::env::current_exe().expect("current_exe");
        let profile_dir = exe.parent().and_then(Path::parent).expect("test binary is in <target>/<profile>/deps");
        let target = profile_dir.parent().expect("target dir");
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let t0 = Instant::now();
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&workspace)
            .args(["build", "-p", "forkbox", "--bin", "forkbox"])
            .env("CARGO_TARGET_DIR", target);
        if release {
            cmd.arg("--release");
        }
        let out = cmd.output().expect("running cargo build -p forkbox");
        assert!(out.status.success(), "cargo build -p forkbox failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let bin = profile_dir.join("forkbox");
        assert!(bin.is_file(), "{} missing after the build", bin.display());
        eprintln!("forkbox CLI {} ready in {:.1} s", bin.display(), t0.elapsed().as_secs_f64());
        bin
    })
}

/// A `forkbox` command on `home` (FORKBOX_HOME), for the shared image.
pub fn cli(home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(forkbox_bin());
    cmd.env("FORKBOX_HOME", home).env("FORKBOX_LOG", "warn").args(args);
    cmd
}

/// `forkbox session <sub> --image <shared image> <rest...>`.
pub fn session_cmd(home: &Path, sub: &str, rest: &[&str]) -> Command {
    let img = shared().image_path.to_string_lossy().into_owned();
    let mut args = vec!["session", sub, "--image", &img];
    args.extend_from_slice(rest);
    cli(home, &args)
}

/// Run a `forkbox session` command that must succeed; its stdout.
#[track_caller]
pub fn session_ok(home: &Path, sub: &str, rest: &[&str]) -> String {
    let out = session_cmd(home, sub, rest).output().expect("spawn forkbox");
    check_output(&out, sub, rest);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[track_caller]
pub fn check_output(out: &Output, sub: &str, rest: &[&str]) {
    assert!(
        out.status.success(),
        "forkbox session {sub} {rest:?} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `forkbox session exec --json ID CODE` that must succeed without a Python
/// exception: (value, checkpoint seq).
#[track_caller]
pub fn cli_exec(home: &Path, id: &str, code: &str) -> (Option<String>, i64) {
    let out = session_ok(home, "exec", &["--json", id, code]);
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("exec --json output is not JSON ({e}):\n{out}"));
    assert!(v["error"].is_null(), "Python exception in {code:?}: {}", v["error"]);
    let value = v["value"].as_str().map(str::to_string);
    let seq = v["checkpoint"].as_i64().unwrap_or_else(|| panic!("no checkpoint in {out}"));
    (value, seq)
}

/// Checkpoint seqs listed by `forkbox session log ID`, and the current one.
pub fn cli_log(home: &Path, id: &str) -> (Vec<i64>, Option<i64>) {
    let out = session_ok(home, "log", &[id]);
    let mut seqs = Vec::new();
    let mut current = None;
    for line in out.lines() {
        let is_current = line.starts_with('*');
        let seq: i64 = line[1..]
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("unexpected log line {line:?}"));
        if is_current {
            current = Some(seq);
        }
        seqs.push(seq);
    }
    (seqs, current)
}

/// A small xorshift generator seeded from the clock and pid (no rand crate).
pub struct Rng(u64);

impl Rng {
    pub fn new() -> Rng {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
                ^ ((std::process::id() as u64) << 32);
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
