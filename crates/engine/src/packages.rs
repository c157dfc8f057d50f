//! Packages installed at run time into a sandbox: the host resolves them
//! (`forkbox_image::packages::PackageStore`), the sandbox's VFS mounts each
//! distribution's read-only layer by reference (`Sandbox::install_packages`),
//! and the guest is told to look again (`REFRESH`: the site directory on
//! `sys.path`, import caches dropped).
//!
//! In exec code, a line `%pip install ARGS` or `!pip install ARGS` (also
//! `pip3`, `python -m pip`) is served by the host before the code runs
//! (`pip_lines`); the line itself becomes a statement that refreshes the
//! guest's import system and prints pip-like output at that point.

use serde::Serialize;

pub use forkbox_image::packages::{Package, PackageError, PackageStore, Policy, MAX_LAYER_BYTES};

/// Where wheels' files are in the guest (before Debian's dist-packages on `sys.path`).
pub const SITE: &str = "/usr/local/lib/python3.11/dist-packages";

/// Python run in the guest after an install: the site directory on `sys.path`
/// (where Debian's site.py puts it when it exists at start-up) and the import
/// system's caches dropped, so that the next `import` sees the new files.
pub const REFRESH: &str = "import sys, importlib\n\
p = '/usr/local/lib/python3.11/dist-packages'\n\
if p not in sys.path:\n    \
    i = sys.path.index('/usr/lib/python3/dist-packages') if '/usr/lib/python3/dist-packages' in sys.path else len(sys.path)\n    \
    sys.path.insert(i, p)\n\
sys.path_importer_cache.pop(p, None)\n\
importlib.invalidate_caches()\n";

/// One distribution of an install, as the API reports it. (Deserialize: a sandbox worker sends it.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct InstalledPackage {
    pub name: String,
    pub version: String,
    /// The wheel's file name.
    pub wheel: String,
    /// The wheel's sha256: the id of its shared, read-only layer.
    pub sha256: String,
    /// False: it was installed already (same version), nothing changed.
    pub installed: bool,
    /// Files the layer added to the sandbox's file system.
    pub files: u64,
}

/// The `.dist-info` directory a layer puts in `SITE` (its name), if any.
pub(crate) fn dist_info(p: &Package) -> Option<String> {
    let l = &p.layer;
    let mut ino = forkbox_image::Image::ROOT;
    for c in SITE.trim_start_matches('/').split('/') {
        ino = l.lookup(ino, c.as_bytes())?;
    }
    l.children(ino)
        .into_iter()
        .map(|(n, _)| String::from_utf8_lossy(n).into_owned())
        .find(|n| n.ends_with(".dist-info"))
}

/// What pip would print for an install of `specs` that gave `done`.
pub fn pip_output(done: &[InstalledPackage]) -> String {
    let mut out = String::new();
    for p in done.iter().filter(|p| !p.installed) {
        out.push_str(&format!("Requirement already satisfied: {} in {SITE} ({})\n", p.name, p.version));
    }
    let new: Vec<&InstalledPackage> = done.iter().filter(|p| p.installed).collect();
    for p in &new {
        out.push_str(&format!("Collecting {}\n  Using {} (served by the forkbox host)\n", p.name, p.wheel));
    }
    if !new.is_empty() {
        let names: Vec<&str> = new.iter().map(|p| p.name.as_str()).collect();
        out.push_str(&format!("Installing collected packages: {}\n", names.join(", ")));
        let ids: Vec<String> = new.iter().map(|p| format!("{}-{}", p.name, p.version)).collect();
        out.push_str(&format!("Successfully installed {}\n", ids.join(" ")));
    }
    out
}

/// A `%pip install` line of exec code: where it is and what it asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipLine {
    /// 0-based line number.
    pub line: usize,
    /// Leading whitespace, kept so the replacement fits its block.
    pub indent: String,
    pub specs: Vec<String>,
}

/// pip options a `%pip install` line may carry; they change nothing here.
const IGNORED_OPTIONS: &[&str] =
    &["-q", "--quiet", "-qq", "-U", "--upgrade", "--no-cache-dir", "--user", "--disable-pip-version-check", "-v"];

/// The `%pip install` / `!pip install` lines of `code` (None: there are none).
/// Err: such a line asks for something other than package names (`-r FILE`,
/// `-e`, an index URL, a path): a message for the caller.
pub fn pip_lines(code: &str) -> Result<Option<Vec<PipLine>>, String> {
    let mut found = Vec::new();
    for (i, raw) in code.lines().enumerate() {
        let t = raw.trim_start();
        let Some(rest) = t.strip_prefix('%').or_else(|| t.strip_prefix('!')) else { continue };
        let mut words = rest.split_whitespace();
        let cmd = match words.next() {
            Some("pip" | "pip3") => words.next(),
            Some("python" | "python3") => {
                if words.next() != Some("-m") || words.next() != Some("pip") {
                    continue;
                }
                words.next()
            }
            _ => continue,
        };
        if cmd != Some("install") {
            return Err(format!(
                "line {}: only `pip install PACKAGE...` is served in a sandbox (packages come from the host)",
                i + 1
            ));
        }
        let mut specs = Vec::new();
        for w in words {
            let w = w.trim_matches(|c| c == '"' || c == '\'');
            if w.is_empty() || IGNORED_OPTIONS.contains(&w) {
                continue;
            }
            if w.starts_with('-') {
                return Err(format!(
                    "line {}: pip option {w} is not supported here (the server chooses where packages come from)",
                    i + 1
                ));
            }
            forkbox_image::build::wheels::validate_spec(w).map_err(|e| format!("line {}: {e}", i + 1))?;
            specs.push(w.to_string());
        }
        if specs.is_empty() {
            return Err(format!("line {}: pip install of nothing", i + 1));
        }
        let indent = raw[..raw.len() - t.len()].to_string();
        found.push(PipLine { line: i, indent, specs });
    }
    Ok((!found.is_empty()).then_some(found))
}

/// `code` with each of `lines` replaced by one statement that refreshes the
/// guest's import system and prints `outputs[k]` (pip's output for that line).
pub fn rewrite(code: &str, lines: &[PipLine], outputs: &[String]) -> String {
    let mut out: Vec<String> = code.lines().map(str::to_string).collect();
    for (l, text) in lines.iter().zip(outputs) {
        if let Some(slot) = out.get_mut(l.line) {
            *slot = format!(
                "{}exec(compile({}, '<pip>', 'exec'), {{}}); print({}, end='')",
                l.indent,
                py_str(REFRESH),
                py_str(text)
            );
        }
    }
    let mut s = out.join("\n");
    if code.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// A Python string literal of `s` (ASCII-safe, escapes everything else).
fn py_str(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            c if (' '..='~').contains(&c) => out.push(c),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push('\'');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pip_lines_are_found_and_checked() {
        assert_eq!(pip_lines("import os\nprint(1)\n").unwrap(), None);
        let code = "%pip install fbxdemo==1.0 -q\nimport fbxdemo\nif True:\n    !pip3 install 'a>=1' b\n";
        let l = pip_lines(code).unwrap().unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!((l[0].line, l[0].specs.clone()), (0, vec!["fbxdemo==1.0".to_string()]));
        assert_eq!((l[1].line, l[1].indent.as_str(), l[1].specs.clone()), (3, "    ", vec!["a>=1".into(), "b".into()]));
        assert!(pip_lines("!python -m pip install x").unwrap().is_some());
        assert!(pip_lines("!ls -l").unwrap().is_none());
        for bad in [
            "%pip install -r req.txt",
            "%pip install --index-url http://x y",
            "%pip uninstall x",
            "!pip install",
            "%pip install ./x",
        ] {
            assert!(pip_lines(bad).is_err(), "{bad}");
        }
        let r = rewrite(code, &l, &["one\n".into(), "it's \u{e9}\n".into()]);
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("exec(compile(") && lines[0].ends_with("print('one\\n', end='')"), "{}", lines[0]);
        assert_eq!(lines[1], "import fbxdemo");
        assert!(lines[3].starts_with("    exec(") && lines[3].contains("it\\'s \\U000000e9"), "{}", lines[3]);
        assert!(r.ends_with('\n'));
    }

    #[test]
    fn output_looks_like_pip() {
        let p = |name: &str, installed| InstalledPackage {
            name: name.into(),
            version: "1.0".into(),
            wheel: format!("{name}-1.0-py3-none-any.whl"),
            sha256: "0".repeat(64),
            installed,
            files: 3,
        };
        let out = pip_output(&[p("a", false), p("b", true), p("c", true)]);
        assert!(out.contains("Requirement already satisfied: a in /usr/local/lib/python3.11/dist-packages (1.0)"));
        assert!(out.contains("Installing collected packages: b, c\nSuccessfully installed b-1.0 c-1.0\n"), "{out}");
    }
}
