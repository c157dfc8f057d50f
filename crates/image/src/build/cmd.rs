//! Running host tools (apt-get, dpkg-deb, python3, ldconfig) with errors that name the
//! step, the command line and the tail of its stderr.

use std::process::{Command, Output, Stdio};

use super::BuildError;

/// How much of a failing command's stderr to keep in the error.
const TAIL_LINES: usize = 15;
const TAIL_BYTES: usize = 2000;

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

pub fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut t = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
    if t.len() > TAIL_BYTES {
        let mut cut = t.len() - TAIL_BYTES;
        while !t.is_char_boundary(cut) {
            cut += 1;
        }
        t = format!("...{}", &t[cut..]);
    }
    t
}

/// Run to completion, capturing stdout and stderr; a non-zero exit is an error.
pub fn run(step: &'static str, cmd: &mut Command) -> Result<Output, BuildError> {
    let out = output(step, cmd)?;
    if !out.status.success() {
        return Err(failed(step, cmd, &out));
    }
    Ok(out)
}

/// Run to completion, capturing output; the caller inspects the status.
pub fn output(step: &'static str, cmd: &mut Command) -> Result<Output, BuildError> {
    tracing::debug!(step, command = %describe(cmd), "running");
    cmd.stdin(Stdio::null()).output().map_err(|source| BuildError::Spawn { step, command: describe(cmd), source })
}

pub fn failed(step: &'static str, cmd: &Command, out: &Output) -> BuildError {
    let mut t = tail(&out.stderr);
    if t.is_empty() {
        t = tail(&out.stdout);
    }
    BuildError::Command { step, command: describe(cmd), status: out.status.to_string(), stderr_tail: t }
}
