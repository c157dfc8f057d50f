//! Precompiling the guest's Python modules with the host's interpreter.
//!
//! Debian's python3 postinst byte-compiles at install time; we do it at build time so the
//! guest never writes __pycache__ (the image is read-only) and never compiles at import.
//! The host interpreter must be the same minor version (same bytecode magic). Pycs use
//! `unchecked-hash` invalidation: they do not depend on source mtimes and are never
//! re-validated, and `-s <tree> -p /` makes the embedded file names guest paths.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::cmd;
use super::BuildError;

/// The guest's Python version "3.N", from its /usr/bin/python3.N binary.
pub fn guest_version(root: &Path) -> Result<String, BuildError> {
    let bin = root.join("usr/bin");
    let mut found: Vec<(u32, String)> = Vec::new();
    for e in fs::read_dir(&bin).map_err(|e| BuildError::io("precompile", &bin, e))? {
        let e = e.map_err(|e| BuildError::io("precompile", &bin, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(minor) = name.strip_prefix("python3.").and_then(|m| m.parse::<u32>().ok()) {
            found.push((minor, format!("3.{minor}")));
        }
    }
    found.sort();
    found
        .pop()
        .map(|(_, v)| v)
        .ok_or_else(|| BuildError::Invalid { step: "precompile", msg: "no /usr/bin/python3.N in the tree".into() })
}

/// Compile every module under the stdlib and dist-packages. Returns the number of .pyc
/// files afterwards.
pub fn compile(root: &Path) -> Result<u64, BuildError> {
    let guest = guest_version(root)?;
    let host = PathBuf::from(format!("/usr/bin/python{guest}"));
    if !host.exists() {
        return Err(BuildError::PythonVersion { host: format!("{} not found", host.display()), guest });
    }
    let out = cmd::run(
        "precompile",
        Command::new(&host).args(["-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]),
    )?;
    let host_version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if host_version != guest {
        return Err(BuildError::PythonVersion { host: host_version, guest });
    }
    let dirs: Vec<PathBuf> = [
        format!("usr/lib/python{guest}"),
        "usr/lib/python3/dist-packages".to_string(),
        format!("usr/local/lib/python{guest}/dist-packages"),
    ]
    .iter()
    .map(|d| root.join(d))
    .filter(|d| d.is_dir())
    .collect();
    let mut c = Command::new(&host);
    c.env("SOURCE_DATE_EPOCH", "0") // irrelevant with hash-based pycs, but keep it pinned
        .args(["-I", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash", "-s"])
        .arg(root)
        .args(["-p", "/"])
        .args(&dirs);
    let out = cmd::output("precompile", &mut c)?;
    if !out.status.success() {
        // Some files may legitimately not compile (test data with bad syntax): the guest
        // then compiles them in memory at import, which is only slower.
        tracing::warn!(output = %cmd::tail(&out.stdout), "compileall reported errors; continuing");
    }
    let mut n = 0;
    let mut stack = dirs;
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(|e| BuildError::io("precompile", &d, e))? {
            let e = e.map_err(|e| BuildError::io("precompile", &d, e))?;
            let ft = e.file_type().map_err(|err| BuildError::io("precompile", &e.path(), err))?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if e.path().extension().is_some_and(|x| x == "pyc") {
                n += 1;
            }
        }
    }
    Ok(n)
}
