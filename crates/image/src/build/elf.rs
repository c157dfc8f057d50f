//! Check that the guest's dynamic linking will succeed: every DT_NEEDED of python3 and of
//! every Python extension module (and, transitively, of what they load) resolves inside
//! the tree the way ld.so would search it, and the program interpreter exists.
//!
//! Why at build time: nothing else runs the dynamic linker against the tree before the
//! guest does, and a missing library (say, a forgotten alternatives symlink for
//! libblas.so.3) would otherwise surface as an ImportError deep inside a sandbox.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::path::Path;

use goblin::elf::Elf;

use super::tree::{guest_string, host_path, resolve};
use super::BuildError;

/// ld.so's built-in search path on Debian amd64 (`ld.so --help`), used after RPATH /
/// RUNPATH and when the ld.so.cache has no entry.
const SYSTEM_DIRS: &[&str] = &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib"];

#[derive(Debug, Default)]
pub struct LinkReport {
    /// Objects checked (roots and their libraries).
    pub objects: usize,
    /// Distinct libraries loaded by them, as guest paths.
    pub libraries: BTreeSet<String>,
}

fn is_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    fs::File::open(p).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == *b"\x7fELF"
}

/// The programs and extension modules whose loading must succeed: /usr/bin/python3*, and
/// every ELF under /usr/lib/python3*.
fn roots(root: &Path) -> Result<Vec<Vec<OsString>>, BuildError> {
    let mut out = Vec::new();
    let bin = root.join("usr/bin");
    for e in fs::read_dir(&bin).map_err(|e| BuildError::io("link check", &bin, e))? {
        let e = e.map_err(|e| BuildError::io("link check", &bin, e))?;
        let name = e.file_name();
        let p = e.path();
        if name.to_string_lossy().starts_with("python3")
            && fs::symlink_metadata(&p).is_ok_and(|m| m.is_file())
            && is_elf(&p)
        {
            out.push(vec!["usr".into(), "bin".into(), name]);
        }
    }
    // Debian's modules, and the pip wheels' under /usr/local.
    for prefix in [&["usr", "lib"][..], &["usr", "local", "lib"][..]] {
        let lib = host_path(root, &prefix.iter().map(OsString::from).collect::<Vec<_>>());
        if prefix.len() == 3 && !lib.is_dir() {
            continue;
        }
        for e in fs::read_dir(&lib).map_err(|e| BuildError::io("link check", &lib, e))? {
            let e = e.map_err(|e| BuildError::io("link check", &lib, e))?;
            if !e.file_name().to_string_lossy().starts_with("python3") {
                continue;
            }
            let mut rel0: Vec<OsString> = prefix.iter().map(OsString::from).collect();
            rel0.push(e.file_name());
            let mut stack = vec![rel0];
            while let Some(rel) = stack.pop() {
                let hp = host_path(root, &rel);
                let Ok(m) = fs::symlink_metadata(&hp) else {
                    continue;
                };
                if m.is_dir() {
                    for c in fs::read_dir(&hp).map_err(|e| BuildError::io("link check", &hp, e))? {
                        let c = c.map_err(|e| BuildError::io("link check", &hp, e))?;
                        let mut r = rel.clone();
                        r.push(c.file_name());
                        stack.push(r);
                    }
                } else if m.is_file() && is_elf(&hp) {
                    out.push(rel);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Resolve all roots' dependencies; any unresolved DT_NEEDED or missing interpreter is an
/// error listing all of them.
pub fn check(root: &Path) -> Result<LinkReport, BuildError> {
    let mut report = LinkReport::default();
    let mut missing: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seen: BTreeSet<Vec<OsString>> = BTreeSet::new();
    let mut queue: VecDeque<Vec<OsString>> = roots(root)?.into_iter().collect();
    if !queue.iter().any(|r| r.len() == 3 && r[1] == "bin") {
        return Err(BuildError::Invalid { step: "link check", msg: "no /usr/bin/python3* ELF in the tree".into() });
    }
    while let Some(obj) = queue.pop_front() {
        if !seen.insert(obj.clone()) {
            continue;
        }
        report.objects += 1;
        let hp = host_path(root, &obj);
        let bytes = fs::read(&hp).map_err(|e| BuildError::io("link check", &hp, e))?;
        let elf = Elf::parse(&bytes).map_err(|e| BuildError::Invalid {
            step: "link check",
            msg: format!("{}: not a parseable ELF: {e}", guest_string(&obj)),
        })?;
        let who = guest_string(&obj);
        if let Some(interp) = elf.interpreter {
            match resolve(root, interp.as_bytes(), true) {
                Ok(t) if host_path(root, &t).is_file() => {}
                _ => {
                    missing.entry(who.clone()).or_default().insert(format!("interpreter {interp}"));
                }
            }
        }
        let origin = guest_string(&obj[..obj.len().saturating_sub(1)]);
        // DT_RPATH is only used when there is no DT_RUNPATH.
        let extra: Vec<&str> = if elf.runpaths.is_empty() { elf.rpaths.clone() } else { elf.runpaths.clone() };
        let mut dirs: Vec<String> = extra
            .iter()
            .flat_map(|s| s.split(':'))
            .map(|d| d.replace("$ORIGIN", &origin).replace("${ORIGIN}", &origin))
            .collect();
        dirs.extend(SYSTEM_DIRS.iter().map(|s| s.to_string()));
        for lib in &elf.libraries {
            let candidates: Vec<String> = if lib.contains('/') {
                vec![lib.to_string()]
            } else {
                dirs.iter().map(|d| format!("{d}/{lib}")).collect()
            };
            let found = candidates.iter().find_map(|c| match resolve(root, c.as_bytes(), true) {
                Ok(t) if host_path(root, &t).is_file() => Some(t),
                _ => None,
            });
            match found {
                Some(t) => {
                    report.libraries.insert(guest_string(&t));
                    queue.push_back(t);
                }
                None => {
                    missing.entry(who.clone()).or_default().insert(lib.to_string());
                }
            }
        }
    }
    if !missing.is_empty() {
        let list: Vec<String> = missing
            .iter()
            .map(|(o, libs)| format!("{o}: {}", libs.iter().cloned().collect::<Vec<_>>().join(", ")))
            .collect();
        return Err(BuildError::MissingLibraries(list.join("; ")));
    }
    Ok(report)
}
