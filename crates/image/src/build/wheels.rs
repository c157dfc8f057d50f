//! pip packages in an image: binary wheels only, resolved and downloaded on the
//! host with the host's pip for the guest's platform (CPython 3.11, manylinux
//! x86-64), kept in a content-addressed cache, and unpacked into the guest's
//! `/usr/local/lib/python3.11/dist-packages` (which Debian's python3 puts before
//! `/usr/lib/python3/dist-packages`) without running any package code: a wheel
//! is a zip archive, and unpacking it is the whole installation.
//!
//! `pip download --only-binary=:all:` never builds an sdist (no `setup.py` runs);
//! a spec that has only an sdist fails resolution, and the error names it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::cmd;
use super::BuildError;

/// Where wheels go in the guest (a guest path without the leading '/').
pub const SITE_PACKAGES: &str = "usr/local/lib/python3.11/dist-packages";

/// The guest's platform as pip sees it. pip expands a `manylinux_2_X` platform to
/// every older manylinux (2_17 = manylinux2014, ...): the guest is Debian 12, glibc 2.36.
pub const PIP_PLATFORMS: &[&str] = &["manylinux_2_36_x86_64", "manylinux2014_x86_64"];

/// Most pip specs in one image, and the longest spec.
pub const MAX_SPECS: usize = 64;
pub const MAX_SPEC_LEN: usize = 200;

/// Where pip finds packages: an index (default: pip's, i.e. PyPI), and/or
/// directories or URLs of wheels (`--find-links`; with no index: offline).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipSource {
    /// `--index-url` (http, https or file URL).
    pub index_url: Option<String>,
    /// `--find-links`: wheelhouse directories (absolute host paths) or URLs.
    pub find_links: Vec<String>,
    /// `--no-index`: only `find_links` (an air-gapped host).
    pub no_index: bool,
}

/// One wheel as resolved: its file name and content hash (the cache key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WheelRef {
    pub filename: String,
    pub sha256: String,
    pub size: u64,
}

impl WheelRef {
    /// The wheel in the cache: `<cache>/wheels/<sha256>/<filename>`.
    pub fn path(&self, cache: &Path) -> PathBuf {
        cache.join("wheels").join(&self.sha256).join(&self.filename)
    }
}

/// A pip requirement spec we pass to pip: a name with optional extras, version
/// constraints and markers, never an option, a path or a URL (`pkg @ url`).
pub fn validate_spec(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > MAX_SPEC_LEN {
        return Err(format!("pip spec must be 1 to {MAX_SPEC_LEN} characters"));
    }
    let first = s.as_bytes()[0];
    if !first.is_ascii_alphanumeric() {
        return Err(format!("invalid pip spec {s:?} (must start with a package name)"));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-[],<>=!~*+".contains(&b)) {
        return Err(format!(
            "invalid pip spec {s:?} (a name with optional [extras] and version constraints, e.g. pandas>=2)"
        ));
    }
    Ok(())
}

impl PipSource {
    pub fn validate(&self) -> Result<(), String> {
        if let Some(u) = &self.index_url {
            if !(u.starts_with("https://") || u.starts_with("http://") || u.starts_with("file:///")) || u.len() > 2048 {
                return Err(format!("index URL {u:?} must be an http(s) or file URL"));
            }
            if u.bytes().any(|b| b.is_ascii_control() || b == b' ') {
                return Err("index URL has control characters or spaces".into());
            }
        }
        for f in &self.find_links {
            let ok = (f.starts_with('/')
                || f.starts_with("https://")
                || f.starts_with("http://")
                || f.starts_with("file:///"))
                && f.len() <= 4096
                && !f.bytes().any(|b| b.is_ascii_control());
            if !ok {
                return Err(format!("find-links {f:?} must be an absolute directory or an http(s)/file URL"));
            }
        }
        if self.no_index && self.find_links.is_empty() {
            return Err("no index and no find-links: pip has nowhere to look".into());
        }
        Ok(())
    }
}

/// The spec pip could not find a binary wheel for, from its stderr.
fn unresolvable(stderr: &str) -> Option<String> {
    for key in ["No matching distribution found for ", "Could not find a version that satisfies the requirement "] {
        if let Some(i) = stderr.find(key) {
            let rest = &stderr[i + key.len()..];
            let spec: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
            if !spec.is_empty() {
                return Some(spec);
            }
        }
    }
    None
}

pub(crate) fn host_pip() -> Command {
    let py = std::env::var_os("FORKBOX_PIP_PYTHON").unwrap_or_else(|| "python3".into());
    let mut c = Command::new(py);
    c.args(["-m", "pip"]);
    c
}

/// Where pip looks (`source`: no index, another index, wheelhouses), with the host's
/// pip configuration (a proxy, a mirror) applying and a virtualenv requirement not.
pub(crate) fn source_args(c: &mut Command, source: &PipSource) {
    if source.no_index {
        c.arg("--no-index");
    } else if let Some(u) = &source.index_url {
        c.args(["--index-url", u]);
    }
    for f in &source.find_links {
        c.args(["--find-links", f]);
    }
    c.env("PYTHONNOUSERSITE", "1").env_remove("PIP_REQUIRE_VIRTUALENV");
}

/// Resolve and download `specs` (and their dependencies) as binary wheels for the
/// guest, into the content-addressed cache under `cache`; the wheels, sorted by name.
pub fn fetch(specs: &[String], source: &PipSource, cache: &Path, tmp_root: &Path) -> Result<Vec<WheelRef>, BuildError> {
    let bad = |msg: String| BuildError::Invalid { step: "pip", msg };
    if specs.len() > MAX_SPECS {
        return Err(bad(format!("at most {MAX_SPECS} pip specs")));
    }
    for s in specs {
        validate_spec(s).map_err(bad)?;
    }
    source.validate().map_err(bad)?;
    let dl =
        tempfile::Builder::new().prefix("pip-").tempdir_in(tmp_root).map_err(|e| BuildError::io("pip", tmp_root, e))?;
    let mut c = host_pip();
    c.args(["download", "--only-binary=:all:", "--no-input", "--disable-pip-version-check", "--progress-bar", "off"]);
    for p in PIP_PLATFORMS {
        c.args(["--platform", p]);
    }
    c.args(["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none"]);
    c.arg("--cache-dir").arg(cache.join("pip"));
    c.arg("--dest").arg(dl.path());
    source_args(&mut c, source);
    c.arg("--");
    c.args(specs);
    let out = cmd::output("pip", &mut c)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if let Some(spec) = unresolvable(&stderr) {
            return Err(BuildError::NoWheel { spec });
        }
        return Err(cmd::failed("pip", &c, &out));
    }
    let mut wheels = Vec::new();
    let rd = fs::read_dir(dl.path()).map_err(|e| BuildError::io("pip", dl.path(), e))?;
    for e in rd {
        let e = e.map_err(|e| BuildError::io("pip", dl.path(), e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".whl") {
            // --only-binary=:all: never yields one; refuse rather than build it.
            return Err(bad(format!("{name} is not a wheel (packages are never built from source)")));
        }
        if name.contains('/') || name.starts_with('.') {
            return Err(bad(format!("odd wheel file name {name:?}")));
        }
        let bytes = fs::read(e.path()).map_err(|err| BuildError::io("pip", &e.path(), err))?;
        let w = WheelRef { filename: name, sha256: hex::encode(Sha256::digest(&bytes)), size: bytes.len() as u64 };
        let dest = w.path(cache);
        if !dest.exists() {
            let dir = dest.parent().unwrap_or(cache);
            fs::create_dir_all(dir).map_err(|err| BuildError::io("pip", dir, err))?;
            let tmp = dest.with_extension("part");
            fs::write(&tmp, &bytes).map_err(|err| BuildError::io("pip", &tmp, err))?;
            fs::rename(&tmp, &dest).map_err(|err| BuildError::io("pip", &dest, err))?;
        }
        wheels.push(w);
    }
    wheels.sort_by(|a, b| a.filename.cmp(&b.filename));
    tracing::info!(wheels = wheels.len(), "pip resolved");
    Ok(wheels)
}

/// Unpacks wheels into a tree with the host's Python's `zipfile` (the standard
/// library only; no code of a wheel is imported or run). Hostile archives are
/// refused: absolute paths, `..`, symlinks, a path through a symlink of the tree,
/// more than the caps of files or bytes; the hashes in RECORD are checked.
const UNPACK: &str = r#"
import sys, os, zipfile, stat, hashlib, base64, csv, io
root, site = sys.argv[1], sys.argv[2]
MAX_FILES, MAX_BYTES = int(sys.argv[3]), int(sys.argv[4])
total_files = total_bytes = 0
def fail(whl, msg):
    sys.stderr.write("%s: %s\n" % (os.path.basename(whl), msg)); sys.exit(3)
real_root = os.path.realpath(root)
for whl in sys.argv[5:]:
    z = zipfile.ZipFile(whl)
    infos = z.infolist()
    tops = {i.filename.split('/')[0] for i in infos}
    dist = [t for t in tops if t.endswith('.dist-info')]
    if len(dist) != 1:
        fail(whl, "not one .dist-info directory")
    data = dist[0][:-len('.dist-info')] + '.data'
    record = {}
    try:
        for row in csv.reader(io.StringIO(z.read(dist[0] + '/RECORD').decode('utf-8'))):
            if len(row) >= 2 and row[1]:
                record[row[0]] = row[1]
    except KeyError:
        fail(whl, "no RECORD")
    for i in infos:
        n = i.filename
        if n.endswith('/'):
            continue
        parts = n.split('/')
        if n.startswith('/') or '\\' in n or '\0' in n or any(p in ('', '.', '..') for p in parts):
            fail(whl, "unsafe path %r" % n)
        mode = (i.external_attr >> 16) & 0o177777
        if stat.S_ISLNK(mode):
            fail(whl, "symlink %r" % n)
        total_files += 1; total_bytes += i.file_size
        if total_files > MAX_FILES or total_bytes > MAX_BYTES:
            fail(whl, "too large")
        if parts[0] == data:
            if len(parts) < 3:
                fail(whl, "odd path %r" % n)
            base = {'purelib': site, 'platlib': site, 'scripts': 'usr/local/bin', 'data': 'usr/local'}.get(parts[1])
            if base is None:
                continue  # headers: nothing in the guest compiles
            rest = parts[2:]
        else:
            base, rest = site, parts
        body = z.read(i)
        want = record.get(n)
        if want:
            algo, _, digest = want.partition('=')
            if algo != 'sha256':
                fail(whl, "RECORD hash %s of %r is not sha256" % (algo, n))
            got = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b'=').decode()
            if got != digest:
                fail(whl, "%r does not match its RECORD hash" % n)
        elif not n.endswith('/RECORD') and not n.endswith('.jws') and not n.endswith('.p7s'):
            fail(whl, "%r is not in RECORD" % n)
        dest = os.path.join(root, base, *rest)
        parent = os.path.dirname(dest)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        rp = os.path.realpath(parent)
        if rp != real_root and not rp.startswith(real_root + os.sep):
            fail(whl, "%r leads out of the tree" % n)
        if os.path.islink(dest) or os.path.isdir(dest):
            fail(whl, "%r would replace a symlink or directory" % n)
        if base == 'usr/local/bin' and body.startswith(b'#!python'):
            body = b'#!/usr/bin/python3' + body[len(b'#!python'):]
        with open(dest, 'wb') as f:
            f.write(body)
        os.chmod(dest, 0o755 if (mode & 0o111 or base == 'usr/local/bin') else 0o644)
    with open(os.path.join(root, site, dist[0], 'INSTALLER'), 'w') as f:
        f.write('forkbox\n')
"#;

/// Unpack `wheels` (from the cache) into the tree at `root`.
pub fn install(root: &Path, wheels: &[WheelRef], cache: &Path) -> Result<(), BuildError> {
    install_capped(root, wheels, cache, 200_000, 8 << 30)
}

/// `install` with caps on the files and the unpacked bytes of all the wheels together.
pub fn install_capped(
    root: &Path,
    wheels: &[WheelRef],
    cache: &Path,
    max_files: u64,
    max_bytes: u64,
) -> Result<(), BuildError> {
    if wheels.is_empty() {
        return Ok(());
    }
    let site = root.join(SITE_PACKAGES);
    fs::create_dir_all(&site).map_err(|e| BuildError::io("pip", &site, e))?;
    let mut c = Command::new(host_python());
    c.args(["-I", "-S", "-c", UNPACK])
        .arg(root)
        .arg(SITE_PACKAGES)
        .arg(max_files.to_string())
        .arg(max_bytes.to_string());
    for w in wheels {
        c.arg(w.path(cache));
    }
    let out = cmd::output("pip", &mut c)?;
    if !out.status.success() {
        let msg = cmd::tail(&out.stderr);
        return Err(BuildError::Invalid { step: "pip", msg: format!("unpacking a wheel: {msg}") });
    }
    Ok(())
}

/// A Python for unpacking (the standard library's zipfile): Debian's, else PATH's.
pub(crate) fn host_python() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/python3");
    if debian.exists() {
        debian
    } else {
        PathBuf::from("python3")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn specs_are_names_and_constraints_only() {
        for ok in ["pandas", "pandas>=2,<3", "requests[socks]", "a.b-c_d==1.0.*", "x~=1.2"] {
            assert!(validate_spec(ok).is_ok(), "{ok}");
        }
        for bad in
            ["", "-e", "--index-url=x", "./local", "/abs/x.whl", "pkg @ https://x", "a b", "x;y", &"a".repeat(201)]
        {
            assert!(validate_spec(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sources_are_checked() {
        assert!(PipSource::default().validate().is_ok());
        assert!(PipSource { no_index: true, ..Default::default() }.validate().is_err());
        assert!(PipSource { index_url: Some("ftp://x".into()), ..Default::default() }.validate().is_err());
        assert!(PipSource { find_links: vec!["rel/dir".into()], ..Default::default() }.validate().is_err());
        assert!(PipSource { find_links: vec!["/wheels".into()], no_index: true, ..Default::default() }
            .validate()
            .is_ok());
    }

    /// A wheel zip written by hand: `files` plus a RECORD with their hashes (or wrong ones).
    pub(crate) fn write_wheel(path: &Path, name: &str, files: &[(&str, &[u8])], bad_hash: bool) {
        let script = r#"
import sys, zipfile, hashlib, base64
path, dist, bad = sys.argv[1], sys.argv[2], sys.argv[3] == '1'
args = sys.argv[4:]
files = {args[i]: args[i + 1].encode() for i in range(0, len(args), 2)}
files[dist + '/METADATA'] = b'Metadata-Version: 2.1\nName: x\nVersion: 1.0\n'
files[dist + '/WHEEL'] = b'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'
def h(d):
    return 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()
rows = ['%s,%s,%d' % (n, h(b'tampered' if bad else d), len(d)) for n, d in files.items()]
with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
    for n, d in files.items():
        z.writestr(n, d)
    z.writestr(dist + '/RECORD', '\n'.join(rows + [dist + '/RECORD,,']) + '\n')
"#;
        let mut c = Command::new(host_python());
        c.args(["-I", "-c", script]).arg(path).arg(format!("{name}-1.0.dist-info")).arg(if bad_hash {
            "1"
        } else {
            "0"
        });
        for (n, d) in files {
            c.arg(n).arg(String::from_utf8_lossy(d).as_ref());
        }
        assert!(c.status().expect("python3").success());
    }

    /// Offline: a wheelhouse with a pure-Python wheel and an sdist-only package.
    #[test]
    fn fetch_from_a_wheelhouse_and_unpack() {
        let dir = tempfile::tempdir().unwrap();
        let house = dir.path().join("house");
        std::fs::create_dir(&house).unwrap();
        write_wheel(
            &house.join("fbxdemo-1.0-py3-none-any.whl"),
            "fbxdemo",
            &[("fbxdemo/__init__.py", b"X = 42\n")],
            false,
        );
        write_wheel(
            &house.join("tampered-1.0-py3-none-any.whl"),
            "tampered",
            &[("tampered/__init__.py", b"X = 1\n")],
            true,
        );
        write_wheel(&house.join("escape-1.0-py3-none-any.whl"), "escape", &[("../../etc/evil", b"x\n")], false);
        std::fs::write(house.join("onlysdist-1.0.tar.gz"), b"not really a tarball").unwrap();
        let cache = dir.path().join("cache");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let source = PipSource { find_links: vec![house.display().to_string()], no_index: true, index_url: None };

        let w = fetch(&["fbxdemo".into()], &source, &cache, &tmp).expect("fetch fbxdemo");
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].filename, "fbxdemo-1.0-py3-none-any.whl");
        let bytes = std::fs::read(house.join(&w[0].filename)).unwrap();
        assert_eq!(w[0].sha256, hex::encode(Sha256::digest(&bytes)), "cached by content");
        assert_eq!(std::fs::read(w[0].path(&cache)).unwrap(), bytes);

        let e = fetch(&["onlysdist".into()], &source, &cache, &tmp).expect_err("an sdist only").to_string();
        assert!(e.contains("no binary wheel of onlysdist") && !e.contains('\n'), "{e}");
        assert!(
            matches!(fetch(&["onlysdist".into()], &source, &cache, &tmp), Err(BuildError::NoWheel { spec }) if spec == "onlysdist")
        );

        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        install(&root, &w, &cache).expect("install");
        let init = root.join(SITE_PACKAGES).join("fbxdemo/__init__.py");
        assert_eq!(std::fs::read(&init).unwrap(), b"X = 42\n");
        assert!(root.join(SITE_PACKAGES).join("fbxdemo-1.0.dist-info/INSTALLER").exists());

        for bad in ["tampered", "escape"] {
            let w = fetch(&[bad.into()], &source, &cache, &tmp).expect("fetch");
            let e = install(&root, &w, &cache).expect_err(bad).to_string();
            assert!(e.contains("RECORD hash") || e.contains("unsafe path"), "{bad}: {e}");
        }
        assert!(!dir.path().join("etc/evil").exists() && !root.join("etc/evil").exists());
    }

    #[test]
    fn pip_errors_name_the_spec() {
        let e = "ERROR: Could not find a version that satisfies the requirement onlysdist==1.0 (from versions: none)\n\
                 ERROR: No matching distribution found for onlysdist==1.0\n";
        assert_eq!(unresolvable(e).as_deref(), Some("onlysdist==1.0"));
        assert_eq!(unresolvable("ERROR: something else"), None);
    }
}
