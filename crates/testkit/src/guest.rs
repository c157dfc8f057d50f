//! Running code in a sandbox from a test: an exec that must not fail at the
//! engine level ([`run`]), nor raise ([`ok`]), its value ([`value`]) or a
//! JSON document it returns as a str ([`json`]); forks of the shared template.
//! Each panics with the code, the exception and the output, at the caller.

use std::time::Duration;

use forkbox_engine::{ExecResult, Limits, Sandbox};

/// Default limits with a timeout of `timeout_s` seconds.
pub fn limits(timeout_s: u64) -> Limits {
    Limits { timeout: Duration::from_secs(timeout_s), ..Limits::default() }
}

/// A fork of the shared template with `limits`.
#[track_caller]
pub fn fork_with(limits: Limits) -> Sandbox {
    let s = crate::shared();
    s.template.fork(&s.engine, limits).unwrap_or_else(|e| panic!("fork failed: {e}"))
}

/// A fork of the shared template with a 60 s timeout.
#[track_caller]
pub fn fork() -> Sandbox {
    fork_with(limits(60))
}

/// Exec that must not fail with an engine error (a Python exception is fine).
#[track_caller]
pub fn run(sb: &mut Sandbox, code: &str) -> ExecResult {
    match sb.exec(code) {
        Ok(r) => r,
        Err(e) => panic!("exec failed with an engine error {e:?} ({e})\n--- code ---\n{code}"),
    }
}

/// Exec that must succeed without a Python exception.
#[track_caller]
pub fn ok(sb: &mut Sandbox, code: &str) -> ExecResult {
    let r = run(sb, code);
    if let Some(err) = &r.error {
        panic!(
            "unexpected Python exception {}: {}\n{}\n--- code ---\n{code}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            err.kind, err.message, err.traceback, r.stdout, r.stderr
        );
    }
    r
}

/// The repr of the trailing expression of `code` (which must succeed).
#[track_caller]
pub fn value(sb: &mut Sandbox, code: &str) -> String {
    let r = ok(sb, code);
    r.value.unwrap_or_else(|| panic!("no value for code:\n{code}"))
}

/// `code` ends in an expression that is a JSON document as a str (e.g.
/// `json.dumps(x)`); its parsed value. The JSON must need no escaping in a
/// Python str repr (no quotes or backslashes), which `json.dumps` of numbers,
/// lists and plain strings satisfies.
#[track_caller]
pub fn json(sb: &mut Sandbox, code: &str) -> serde_json::Value {
    let v = value(sb, code);
    let s = v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')).unwrap_or_else(|| panic!("not a str repr: {v}"));
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON {s}: {e}"))
}
