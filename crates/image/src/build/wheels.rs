//! pip packages in an image: binary wheels only, resolved and downloaded on the
//! host with the host's pip for the guest's platform (CPython 3.11, manylinux
//! x86-64), kept in a content-addressed cache, and unpacked into the guest's
//! `/usr/local/lib/python3.11/dist-packages` (which Debian's python3 puts before
//! `/usr/lib/python3/dist-packages`) without running any package code: a wheel
//! is a zip archive, and unpacking it is the whole installation.
//!
//! No package code ever runs on the host: a spec is a PEP 508 name (never a
//! URL, a path or a file name: `validate_spec`), pip runs with
//! `--only-binary=:all:` (it never builds an sdist nor prepares its metadata;
//! a spec that has only an sdist fails resolution, and the error names it),
//! and pip and the unpacker run confined (`confine`: an empty working
//! directory of their own, the unprivileged uid, resource limits).

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use super::cmd;
use super::confine::{self, Jail, Limits};
use super::BuildError;

/// Where wheels go in the guest (a guest path without the leading '/').
pub const SITE_PACKAGES: &str = "usr/local/lib/python3.11/dist-packages";

/// The guest's platform as pip sees it. pip expands a `manylinux_2_X` platform to
/// every older manylinux (2_17 = manylinux2014, ...): the guest is Debian 12, glibc 2.36.
pub const PIP_PLATFORMS: &[&str] = &["manylinux_2_36_x86_64", "manylinux2014_x86_64"];

/// Most pip specs in one image, and the longest spec.
pub const MAX_SPECS: usize = 64;
pub const MAX_SPEC_LEN: usize = 200;

/// Largest wheel (download) of a template build (run-time installs have
/// their own, smaller cap: `packages::MAX_WHEEL_BYTES`).
pub const MAX_BUILD_WHEEL_BYTES: u64 = 2 << 30;

/// pip's address space and CPU time (it resolves and downloads; it builds nothing).
const PIP_ADDRESS_SPACE: u64 = 2 << 30;
const PIP_CPU_SECONDS: u64 = 600;
/// The unpacker's address space: it streams every member in 1 MiB chunks, so
/// its memory does not grow with a member's size.
pub const UNPACK_ADDRESS_SPACE: u64 = 512 << 20;
const UNPACK_CPU_SECONDS: u64 = 600;

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

/// The suffixes that make pip take a requirement for a file (its
/// `is_archive_file`), and eggs: a spec ending in one is refused.
const ARCHIVE_SUFFIXES: &[&str] = &[
    ".whl",
    ".zip",
    ".tar.gz",
    ".tgz",
    ".tar",
    ".tar.bz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tlz",
    ".tar.lz",
    ".tar.lzma",
    ".egg",
];

/// PEP 508 environment markers' variables.
const MARKER_VARS: &[&str] = &[
    "python_version",
    "python_full_version",
    "os_name",
    "sys_platform",
    "platform_release",
    "platform_system",
    "platform_version",
    "platform_machine",
    "platform_python_implementation",
    "implementation_name",
    "implementation_version",
    "extra",
];

fn is_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// A version specifier clause: an operator and a PEP 440 version (`*` for `==`/`!=`).
fn is_clause(c: &str) -> bool {
    let c = c.trim();
    let Some(op) = ["~=", "==", "!=", "<=", ">=", "<", ">"].into_iter().find(|op| c.starts_with(op)) else {
        return false;
    };
    let v = c[op.len()..].trim();
    let v = v.strip_prefix(['v', 'V']).unwrap_or(v);
    // `===` (arbitrary equality) would accept any string: not here.
    !v.is_empty()
        && v.as_bytes()[0].is_ascii_digit()
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"._*+!-".contains(&b))
}

/// An environment marker: variables, quoted values, comparisons, `and`/`or`, parentheses.
fn is_marker(m: &str) -> bool {
    let mut rest = m.trim();
    let mut compares = 0;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        if let Some(q) = rest.chars().next().filter(|c| *c == '\'' || *c == '"') {
            let Some(end) = rest[1..].find(q) else { return false };
            let value = &rest[1..1 + end];
            if !value.bytes().all(|b| b.is_ascii_alphanumeric() || b"._*+!- ".contains(&b)) {
                return false;
            }
            rest = &rest[end + 2..];
        } else if let Some(op) =
            ["===", "==", "!=", "<=", ">=", "~=", "<", ">"].into_iter().find(|op| rest.starts_with(op))
        {
            compares += 1;
            rest = &rest[op.len()..];
        } else if rest.starts_with(['(', ')']) {
            rest = &rest[1..];
        } else {
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let word = &rest[..end];
            match word {
                "and" | "or" | "not" => {}
                "in" => compares += 1,
                w if MARKER_VARS.contains(&w) => {}
                _ => return false,
            }
            rest = &rest[end..];
        }
        rest = rest.trim_start();
    }
    compares > 0
}

/// A pip requirement spec we pass to pip: a PEP 508 requirement without a URL
/// — a name, optional `[extras]`, optional version specifiers and optional
/// `; markers` — never an option, a path or a file name (pip would read a
/// spec like `report-1.0.tar.gz` or `x-1.0-py3-none-any.whl` as a file of its
/// working directory, and build an sdist found there).
pub fn validate_spec(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > MAX_SPEC_LEN {
        return Err(format!("pip spec must be 1 to {MAX_SPEC_LEN} characters"));
    }
    let help = "a package name with optional [extras], version constraints and ; markers, e.g. pandas>=2";
    let (req, marker) = match s.split_once(';') {
        Some((r, m)) => (r, Some(m)),
        None => (s, None),
    };
    let req = req.trim_end();
    let lower = req.to_ascii_lowercase();
    if req.contains(['/', '\\']) || lower.starts_with('.') || ARCHIVE_SUFFIXES.iter().any(|x| lower.ends_with(x)) {
        // (Not echoed: it may be a host path.)
        return Err(format!("invalid pip spec: it names a file or a path; packages are given by name only ({help})"));
    }
    let name_end =
        req.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))).unwrap_or(req.len());
    let name = &req[..name_end];
    if !is_name(name) {
        return Err(format!("invalid pip spec {s:?} (must start with a package name: {help})"));
    }
    if ARCHIVE_SUFFIXES.iter().any(|x| name.to_ascii_lowercase().ends_with(x)) {
        return Err(format!("invalid pip spec {s:?}: it names a file; packages are given by name only ({help})"));
    }
    let mut rest = req[name_end..].trim_start();
    if let Some(r) = rest.strip_prefix('[') {
        let Some(close) = r.find(']') else { return Err(format!("invalid pip spec {s:?} ({help})")) };
        if !r[..close].split(',').all(|e| is_name(e.trim())) {
            return Err(format!("invalid pip spec {s:?}: bad extras ({help})"));
        }
        rest = r[close + 1..].trim_start();
    }
    let specifiers = match rest.strip_prefix('(') {
        Some(r) => r.strip_suffix(')').ok_or_else(|| format!("invalid pip spec {s:?} ({help})"))?,
        None => rest,
    };
    if !specifiers.trim().is_empty() && !specifiers.split(',').all(is_clause) {
        return Err(format!("invalid pip spec {s:?}: bad version constraint ({help})"));
    }
    if let Some(m) = marker {
        if !is_marker(m) {
            return Err(format!("invalid pip spec {s:?}: bad environment marker ({help})"));
        }
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

/// The Python that runs pip: `FORKBOX_PIP_PYTHON`, else Debian's (a Python
/// under root's home would be out of the unprivileged uid's reach).
fn pip_python() -> PathBuf {
    std::env::var_os("FORKBOX_PIP_PYTHON").map(PathBuf::from).unwrap_or_else(host_python)
}

/// pip, confined in `jail` (its cache: `<cache>/pip`, bind-mounted writable),
/// with `--only-binary=:all:` for every command that takes it: no sdist is
/// ever built or asked for its metadata. `max_file`: the largest file it may
/// write (the wheel cap).
pub(crate) fn host_pip(jail: &mut Jail, cache: &Path, max_file: u64) -> Result<Command, BuildError> {
    let pip_cache = cache.join("pip");
    fs::create_dir_all(&pip_cache).map_err(|e| BuildError::io("pip", &pip_cache, e))?;
    let pip_cache = jail.bind(&pip_cache, "pip-cache", true)?;
    let limits = Limits { address_space: PIP_ADDRESS_SPACE, cpu_seconds: PIP_CPU_SECONDS, file_bytes: max_file };
    let mut c = jail.command(pip_python(), confine::PIP_ENV, limits);
    c.args(["-I", "-m", "pip"]);
    c.env("PIP_CACHE_DIR", pip_cache);
    Ok(c)
}

/// pip's options for where it looks (`source`: no index, another index,
/// wheelhouses), with the operator's pip configuration (a proxy, a mirror;
/// `confine::PIP_ENV`) applying. A wheelhouse directory of the host is
/// bind-mounted read-only into `jail` (the path to it may pass directories
/// the unprivileged uid cannot enter; the directory itself must be readable).
/// Call before `host_pip`.
pub(crate) fn source_args(jail: &mut Jail, source: &PipSource) -> Result<Vec<std::ffi::OsString>, BuildError> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    if source.no_index {
        args.push("--no-index".into());
    } else if let Some(u) = &source.index_url {
        args.extend(["--index-url".into(), u.into()]);
    }
    for (i, f) in source.find_links.iter().enumerate() {
        let local = f.strip_prefix("file://").unwrap_or(f);
        let arg = if local.starts_with('/') && Path::new(local).is_dir() {
            jail.bind(Path::new(local), &format!("links-{i}"), false)?.into_os_string()
        } else {
            f.into()
        };
        args.extend(["--find-links".into(), arg]);
    }
    Ok(args)
}

/// pip ran into its file-size limit: a wheel over `max` bytes.
fn too_large(name: &str, max: u64) -> BuildError {
    BuildError::Invalid { step: "pip", msg: format!("{name} is over the {max}-byte limit of a wheel") }
}

/// Resolve and download `specs` (and their dependencies) as binary wheels for the
/// guest, into the content-addressed cache under `cache`; the wheels, sorted by
/// name. A wheel over `max_wheel` bytes is refused (pip cannot write it).
pub fn fetch(specs: &[String], source: &PipSource, cache: &Path, max_wheel: u64) -> Result<Vec<WheelRef>, BuildError> {
    let bad = |msg: String| BuildError::Invalid { step: "pip", msg };
    if specs.len() > MAX_SPECS {
        return Err(bad(format!("at most {MAX_SPECS} pip specs")));
    }
    for s in specs {
        validate_spec(s).map_err(bad)?;
    }
    source.validate().map_err(bad)?;
    let mut jail = Jail::new()?;
    let dl = jail.mkdir("dest")?;
    let where_from = source_args(&mut jail, source)?;
    let mut c = host_pip(&mut jail, cache, max_wheel)?;
    c.args(["download", "--only-binary=:all:", "--no-input", "--disable-pip-version-check", "--progress-bar", "off"]);
    for p in PIP_PLATFORMS {
        c.args(["--platform", p]);
    }
    c.args(["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none"]);
    c.arg("--dest").arg(&dl);
    c.args(&where_from);
    c.arg("--");
    c.args(specs);
    let out = cmd::output("pip", &mut c)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // RLIMIT_FSIZE: EFBIG (Python ignores SIGXFSZ), or the signal.
    if out.status.signal() == Some(libc::SIGXFSZ) || (!out.status.success() && stderr.contains("[Errno 27]")) {
        return Err(too_large("a wheel", max_wheel));
    }
    if !out.status.success() {
        if let Some(spec) = unresolvable(&stderr) {
            return Err(BuildError::NoWheel { spec });
        }
        return Err(cmd::failed("pip", &c, &out));
    }
    let mut wheels = Vec::new();
    let rd = fs::read_dir(&dl).map_err(|e| BuildError::io("pip", &dl, e))?;
    for e in rd {
        let e = e.map_err(|e| BuildError::io("pip", &dl, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".whl") {
            // --only-binary=:all: never yields one; refuse rather than build it.
            return Err(bad(format!("{name} is not a wheel (packages are never built from source)")));
        }
        if name.contains('/') || name.starts_with('.') {
            return Err(bad(format!("odd wheel file name {name:?}")));
        }
        wheels.push(store_wheel(&e.path(), name, cache, max_wheel)?);
    }
    wheels.sort_by(|a, b| a.filename.cmp(&b.filename));
    tracing::info!(wheels = wheels.len(), "pip resolved");
    Ok(wheels)
}

/// Copy the wheel pip wrote at `src` into the cache, hashing while copying
/// (never the whole file in memory), at most `max` bytes (checked on its
/// metadata first and while reading): a temporary file of its own in the
/// cache, renamed into place (an identical file there already is fine).
fn store_wheel(src: &Path, filename: String, cache: &Path, max: u64) -> Result<WheelRef, BuildError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| BuildError::io("pip", &p, e)
    };
    // Not a link the confined pip could have left to some other host file.
    let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(src).map_err(io(src))?;
    let meta = f.metadata().map_err(io(src))?;
    if !meta.is_file() {
        return Err(BuildError::Invalid { step: "pip", msg: format!("{filename} is not a file") });
    }
    if meta.len() > max {
        return Err(too_large(&filename, max));
    }
    let dir = cache.join("wheels");
    fs::create_dir_all(&dir).map_err(io(&dir))?;
    let mut tmp = tempfile::Builder::new().prefix(".part-").tempfile_in(&dir).map_err(io(&dir))?;
    let mut h = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    let mut r = f.take(max.saturating_add(1));
    loop {
        let n = r.read(&mut buf).map_err(io(src))?;
        if n == 0 {
            break;
        }
        size = size.saturating_add(n as u64);
        if size > max {
            return Err(too_large(&filename, max));
        }
        h.update(&buf[..n]);
        tmp.write_all(&buf[..n]).map_err(io(&dir))?;
    }
    let w = WheelRef { filename, sha256: hex::encode(h.finalize()), size };
    let dest = w.path(cache);
    let parent = dest.parent().unwrap_or(&dir);
    fs::create_dir_all(parent).map_err(io(parent))?;
    tmp.as_file().set_permissions(fs::Permissions::from_mode(0o644)).map_err(io(&dir))?;
    tmp.persist(&dest).map_err(|e| BuildError::io("pip", &dest, e.error))?;
    Ok(w)
}

/// Unpacks one wheel (read from stdin) into a fresh directory with the
/// host's Python's `zipfile` (the standard library only; no code of a wheel
/// is imported or run). Each member is streamed in 1 MiB chunks, hashed
/// while streaming (RECORD's hashes are checked) and counted against the
/// caps before it is written. Hostile archives are refused: absolute paths,
/// `..`, symlinks, more than the caps of files or bytes. Prints its peak RSS.
const UNPACK: &str = r#"
import sys, os, zipfile, stat, hashlib, base64, csv, io, resource
out, name, site = sys.argv[1], sys.argv[2], sys.argv[3]
MAX_FILES, MAX_BYTES = int(sys.argv[4]), int(sys.argv[5])
CHUNK = 1 << 20
def peak():
    sys.stdout.write("peak_rss_kb=%d\n" % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.stdout.flush()
def fail(msg):
    peak(); sys.stderr.write("%s: %s\n" % (name, msg)); sys.exit(3)
try:
    z = zipfile.ZipFile(os.fdopen(0, 'rb'))
except (zipfile.BadZipFile, OSError, ValueError) as e:
    fail("not a zip archive")
infos = z.infolist()
tops = {i.filename.split('/')[0] for i in infos}
dist = [t for t in tops if t.endswith('.dist-info')]
if len(dist) != 1:
    fail("not one .dist-info directory")
data = dist[0][:-len('.dist-info')] + '.data'
try:
    ri = z.getinfo(dist[0] + '/RECORD')
except KeyError:
    fail("no RECORD")
if ri.file_size > (16 << 20):
    fail("RECORD is too large")
record = {}
for row in csv.reader(io.StringIO(z.read(ri).decode('utf-8', 'replace'))):
    if len(row) >= 2 and row[1]:
        record[row[0]] = row[1]
files = [i for i in infos if not i.filename.endswith('/')]
if len(files) > MAX_FILES or sum(i.file_size for i in files) > MAX_BYTES:
    fail("too large: over %d files or %d bytes unpacked" % (MAX_FILES, MAX_BYTES))
real_out = os.path.realpath(out)
total = 0
for i in files:
    n = i.filename
    parts = n.split('/')
    if n.startswith('/') or '\\' in n or '\0' in n or any(p in ('', '.', '..') for p in parts):
        fail("unsafe path %r" % n)
    mode = (i.external_attr >> 16) & 0o177777
    if stat.S_ISLNK(mode):
        fail("symlink %r" % n)
    if parts[0] == data:
        if len(parts) < 3:
            fail("odd path %r" % n)
        base = {'purelib': site, 'platlib': site, 'scripts': 'usr/local/bin', 'data': 'usr/local'}.get(parts[1])
        if base is None:
            continue  # headers: nothing in the guest compiles
        rest = parts[2:]
    else:
        base, rest = site, parts
    want = record.get(n)
    if want:
        algo, _, digest = want.partition('=')
        if algo != 'sha256':
            fail("RECORD hash %s of %r is not sha256" % (algo, n))
    elif not n.endswith('/RECORD') and not n.endswith('.jws') and not n.endswith('.p7s'):
        fail("%r is not in RECORD" % n)
    dest = os.path.join(out, base, *rest)
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    rp = os.path.realpath(parent)
    if rp != real_out and not rp.startswith(real_out + os.sep):
        fail("%r leads out of the tree" % n)
    if os.path.lexists(dest):
        fail("%r is in the wheel twice" % n)
    h = hashlib.sha256()
    first = True
    with z.open(i) as src, open(dest, 'xb') as f:
        while True:
            chunk = src.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            total += len(chunk)
            if total > MAX_BYTES:
                fail("too large: over %d bytes unpacked" % MAX_BYTES)
            if first and base == 'usr/local/bin' and chunk.startswith(b'#!python'):
                chunk = b'#!/usr/bin/python3' + chunk[len(b'#!python'):]
            first = False
            f.write(chunk)
    if want:
        got = base64.urlsafe_b64encode(h.digest()).rstrip(b'=').decode()
        if got != digest:
            fail("%r does not match its RECORD hash" % n)
    os.chmod(dest, 0o755 if (mode & 0o111 or base == 'usr/local/bin') else 0o644)
with open(os.path.join(out, site, dist[0], 'INSTALLER'), 'w') as f:
    f.write('forkbox\n')
peak()
"#;

/// What unpacking gave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unpacked {
    pub files: u64,
    pub bytes: u64,
    /// The largest peak RSS of the unpacker processes (KiB).
    pub peak_rss_kb: u64,
}

/// Unpack `wheels` (from the cache) into the tree at `root`.
pub fn install(root: &Path, wheels: &[WheelRef], cache: &Path) -> Result<(), BuildError> {
    install_capped(root, wheels, cache, 200_000, 8 << 30).map(|_| ())
}

/// `install` with caps on the files and the unpacked bytes of all the wheels
/// together. Each wheel is unpacked by a confined process into a directory
/// of its own next to `root`, then moved into `root`.
pub fn install_capped(
    root: &Path,
    wheels: &[WheelRef],
    cache: &Path,
    max_files: u64,
    max_bytes: u64,
) -> Result<Unpacked, BuildError> {
    let mut done = Unpacked::default();
    if wheels.is_empty() {
        return Ok(done);
    }
    let site = root.join(SITE_PACKAGES);
    fs::create_dir_all(&site).map_err(|e| BuildError::io("pip", &site, e))?;
    let beside = root.parent().unwrap_or(root);
    for w in wheels {
        let stage = tempfile::Builder::new()
            .prefix(".wheel-")
            .tempdir_in(beside)
            .map_err(|e| BuildError::io("pip", beside, e))?;
        let u = unpack_one(
            &w.path(cache),
            &w.filename,
            stage.path(),
            max_files.saturating_sub(done.files),
            max_bytes.saturating_sub(done.bytes),
        )?;
        let moved = merge(stage.path(), root)?;
        done.files = done.files.saturating_add(moved.0);
        done.bytes = done.bytes.saturating_add(moved.1);
        done.peak_rss_kb = done.peak_rss_kb.max(u);
    }
    Ok(done)
}

/// Run the unpacker on `wheel` into `out`; its peak RSS (KiB).
fn unpack_one(wheel: &Path, filename: &str, out: &Path, max_files: u64, max_bytes: u64) -> Result<u64, BuildError> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(wheel)
        .map_err(|e| BuildError::io("pip", wheel, e))?;
    let mut jail = Jail::new()?;
    let inside = jail.bind(out, "out", true)?;
    let limits = Limits {
        address_space: UNPACK_ADDRESS_SPACE,
        cpu_seconds: UNPACK_CPU_SECONDS,
        // Files up to the cap; above it the unpacker has refused already.
        file_bytes: max_bytes.saturating_add(1),
    };
    let mut c = jail.command(host_python(), &[], limits);
    c.args(["-I", "-S", "-c", UNPACK])
        .arg(&inside)
        .arg(filename)
        .arg(SITE_PACKAGES)
        .arg(max_files.to_string())
        .arg(max_bytes.to_string())
        .stdin(Stdio::from(f));
    tracing::debug!(command = %cmd::describe(&c), "unpacking");
    let o = c.output().map_err(|source| BuildError::Spawn { step: "pip", command: cmd::describe(&c), source })?;
    let peak = String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("peak_rss_kb=").and_then(|n| n.trim().parse::<u64>().ok()))
        .unwrap_or(0);
    tracing::info!(wheel = filename, peak_rss_kb = peak, ok = o.status.success(), "wheel unpacked");
    if !o.status.success() {
        let mut msg = cmd::tail(&o.stderr);
        if msg.is_empty() {
            msg = format!("the unpacker ended with {}", o.status);
        }
        return Err(BuildError::Invalid { step: "pip", msg: format!("unpacking a wheel: {msg}") });
    }
    Ok(peak)
}

/// Move the tree `from` (what the unpacker wrote) into `to`: directories
/// merged, files replaced; never through a symlink of `to`, never a file
/// over a directory or a directory over a file. (Files, bytes) moved.
fn merge(from: &Path, to: &Path) -> Result<(u64, u64), BuildError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| BuildError::io("pip", &p, e)
    };
    let mut moved = (0u64, 0u64);
    let rd = fs::read_dir(from).map_err(io(from))?;
    for e in rd {
        let e = e.map_err(io(from))?;
        let src = e.path();
        let dst = to.join(e.file_name());
        let st = fs::symlink_metadata(&src).map_err(io(&src))?;
        let existing = fs::symlink_metadata(&dst).ok();
        let clash = |what: &str| BuildError::Invalid {
            step: "pip",
            msg: format!("a wheel's {:?} would replace {what}", e.file_name()),
        };
        if st.is_dir() {
            match existing {
                Some(d) if d.is_dir() => {}
                Some(_) => return Err(clash("a file or symlink")),
                None => fs::create_dir(&dst).map_err(io(&dst))?,
            }
            let (f, b) = merge(&src, &dst)?;
            moved = (moved.0 + f, moved.1.saturating_add(b));
        } else if st.is_file() {
            if existing.is_some_and(|d| !d.is_file()) {
                return Err(clash("a directory or symlink"));
            }
            if fs::rename(&src, &dst).is_err() {
                fs::copy(&src, &dst).map_err(io(&dst))?;
            }
            moved = (moved.0 + 1, moved.1.saturating_add(st.len()));
        } else {
            return Err(clash("nothing: it is not a file"));
        }
    }
    Ok(moved)
}

/// A Python for unpacking (the standard library's zipfile) and pip: Debian's, else PATH's.
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
        for ok in [
            "pandas",
            "pandas>=2,<3",
            "requests[socks]",
            "requests[socks, security] >= 2.0",
            "a.b-c_d==1.0.*",
            "x~=1.2",
            "x (>=1, <2)",
            "numpy>=1.24; python_version >= '3.9'",
            "pywin32; sys_platform == \"win32\" and platform_machine != 'x86'",
            "tarpkg",
            "whl",
        ] {
            assert!(validate_spec(ok).is_ok(), "{ok}: {:?}", validate_spec(ok));
        }
        for bad in [
            "",
            "-e",
            "--index-url=x",
            "./local",
            "./x",
            "/abs/x.whl",
            "/tmp/x.whl",
            "pkg @ https://x",
            "a b",
            "x;y",
            "x; os.system('id')",
            &"a".repeat(201),
            // Files pip would take from its working directory.
            "report-1.0.tar.gz",
            "x-1.0-py3-none-any.whl",
            "X-1.0-PY3-NONE-ANY.WHL",
            "x.zip",
            "x.tgz",
            "x-1.0.tar.bz2",
            "x-1.0.tar.xz",
            "x-1.0.tar",
            "x-1.0-py3.11.egg",
            "x[a].whl",
            "x==1.whl",
            "x==1.tar.gz ; python_version > '3'",
            "dir/x",
            "x\\y",
            ".hidden",
            "x===anything",
            "x==",
            "x>=a1",
        ] {
            assert!(validate_spec(bad).is_err(), "{bad}");
        }
        assert!(validate_spec("report-1.0.tar.gz").unwrap_err().contains("names a file"));
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

    /// Let the confined pip (uid 65534 under root) read a test's wheelhouse.
    pub(crate) fn readable_by_all(dirs: &[&Path]) {
        for d in dirs {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
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
        readable_by_all(&[dir.path(), &house]);
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
        let source = PipSource { find_links: vec![house.display().to_string()], no_index: true, index_url: None };

        let w = fetch(&["fbxdemo".into()], &source, &cache, MAX_BUILD_WHEEL_BYTES).expect("fetch fbxdemo");
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].filename, "fbxdemo-1.0-py3-none-any.whl");
        let bytes = std::fs::read(house.join(&w[0].filename)).unwrap();
        assert_eq!(w[0].sha256, hex::encode(Sha256::digest(&bytes)), "cached by content");
        assert_eq!(std::fs::read(w[0].path(&cache)).unwrap(), bytes);

        let e = fetch(&["onlysdist".into()], &source, &cache, MAX_BUILD_WHEEL_BYTES)
            .expect_err("an sdist only")
            .to_string();
        assert!(e.contains("no binary wheel of onlysdist") && !e.contains('\n'), "{e}");
        assert!(
            matches!(fetch(&["onlysdist".into()], &source, &cache, MAX_BUILD_WHEEL_BYTES), Err(BuildError::NoWheel { spec }) if spec == "onlysdist")
        );

        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        install(&root, &w, &cache).expect("install");
        let init = root.join(SITE_PACKAGES).join("fbxdemo/__init__.py");
        assert_eq!(std::fs::read(&init).unwrap(), b"X = 42\n");
        assert!(root.join(SITE_PACKAGES).join("fbxdemo-1.0.dist-info/INSTALLER").exists());

        for bad in ["tampered", "escape"] {
            let w = fetch(&[bad.into()], &source, &cache, MAX_BUILD_WHEEL_BYTES).expect("fetch");
            let e = install(&root, &w, &cache).expect_err(bad).to_string();
            assert!(e.contains("RECORD hash") || e.contains("unsafe path"), "{bad}: {e}");
        }
        assert!(!dir.path().join("etc/evil").exists() && !root.join("etc/evil").exists());
    }

    /// `<dir>/<name>-1.0-py3-none-any.whl` with one member of `zeros` zero
    /// bytes, written streamed (deflate makes 3 GiB ~3 MB), RECORD hashed.
    fn write_zero_wheel(dir: &Path, name: &str, zeros: u64) {
        let script = r#"
import sys, zipfile, hashlib, base64, os
out, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist = name + '-1.0.dist-info'
rows = []
with zipfile.ZipFile(os.path.join(out, name + '-1.0-py3-none-any.whl'), 'w', zipfile.ZIP_DEFLATED) as z:
    def put(m, chunks):
        h = hashlib.sha256(); size = 0
        with z.open(m, 'w', force_zip64=True) as f:
            for c in chunks:
                h.update(c); size += len(c); f.write(c)
        rows.append('%s,sha256=%s,%d' % (m, base64.urlsafe_b64encode(h.digest()).rstrip(b'=').decode(), size))
    def zeros(n):
        z = bytes(1 << 20)
        while n > 0:
            k = min(n, 1 << 20); n -= k; yield z[:k]
    put(name + '/zeros.bin', zeros(n))
    put(dist + '/METADATA', [('Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' % name).encode()])
    put(dist + '/WHEEL', [b'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'])
    z.writestr(dist + '/RECORD', '\n'.join(rows + [dist + '/RECORD,,']) + '\n')
"#;
        let st = Command::new(host_python())
            .args(["-I", "-c", script])
            .arg(dir)
            .arg(name)
            .arg(zeros.to_string())
            .status()
            .expect("python3");
        assert!(st.success());
    }

    /// Members stream: a 600 MiB member unpacks within the unpacker's 512 MiB
    /// address space with a small peak RSS; a 3 GiB one (a 3 MB wheel) is
    /// refused by a 1 GiB cap before anything is written.
    #[test]
    fn members_stream_with_bounded_memory() {
        let dir = tempfile::tempdir().unwrap();
        let house = dir.path().join("house");
        std::fs::create_dir(&house).unwrap();
        readable_by_all(&[dir.path(), &house]);
        write_zero_wheel(&house, "fbxbig", 600 << 20);
        write_zero_wheel(&house, "fbxbomb", 3 << 30);
        assert!(std::fs::metadata(house.join("fbxbomb-1.0-py3-none-any.whl")).unwrap().len() < 8 << 20);
        let cache = dir.path().join("cache");
        let source = PipSource { find_links: vec![house.display().to_string()], no_index: true, index_url: None };

        let w = fetch(&["fbxbig".into()], &source, &cache, MAX_BUILD_WHEEL_BYTES).expect("fetch");
        let root = dir.path().join("big");
        std::fs::create_dir(&root).unwrap();
        let u = install_capped(&root, &w, &cache, 100, 1 << 30).expect("a 600 MiB member streams");
        eprintln!("600 MiB member: {u:?}");
        assert_eq!(std::fs::metadata(root.join(SITE_PACKAGES).join("fbxbig/zeros.bin")).unwrap().len(), 600 << 20);
        assert!(u.peak_rss_kb > 0 && u.peak_rss_kb < 64 << 10, "unpacker peak RSS {} KiB", u.peak_rss_kb);
        std::fs::remove_dir_all(&root).unwrap();

        let w = fetch(&["fbxbomb".into()], &source, &cache, MAX_BUILD_WHEEL_BYTES).expect("fetch");
        let root = dir.path().join("bomb");
        std::fs::create_dir(&root).unwrap();
        let e = install_capped(&root, &w, &cache, 100, 1 << 30).expect_err("the bomb").to_string();
        assert!(e.contains("too large"), "{e}");
        assert!(!root.join(SITE_PACKAGES).join("fbxbomb").exists(), "nothing of it written");
        // Nothing left beside the tree either.
        let left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
        assert!(!left.iter().any(|n| n.starts_with(".wheel-")), "{left:?}");
    }

    /// A wheel over the cap is refused while pip writes it (RLIMIT_FSIZE) or
    /// when it is copied; nothing of it stays in `cache/wheels`.
    #[test]
    fn an_over_cap_wheel_leaves_nothing_in_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let house = dir.path().join("house");
        std::fs::create_dir(&house).unwrap();
        readable_by_all(&[dir.path(), &house]);
        write_zero_wheel(&house, "fbxwide", 1 << 20);
        let size = std::fs::metadata(house.join("fbxwide-1.0-py3-none-any.whl")).unwrap().len();
        let cache = dir.path().join("cache");
        let source = PipSource { find_links: vec![house.display().to_string()], no_index: true, index_url: None };
        let e = fetch(&["fbxwide".into()], &source, &cache, size - 1).expect_err("over the cap").to_string();
        assert!(e.contains("limit of a wheel"), "{e}");
        let left: Vec<_> = std::fs::read_dir(cache.join("wheels"))
            .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");
        let w = fetch(&["fbxwide".into()], &source, &cache, size).expect("at the cap");
        assert_eq!(w[0].size, size);
    }

    #[test]
    fn pip_errors_name_the_spec() {
        let e = "ERROR: Could not find a version that satisfies the requirement onlysdist==1.0 (from versions: none)\n\
                 ERROR: No matching distribution found for onlysdist==1.0\n";
        assert_eq!(unresolvable(e).as_deref(), Some("onlysdist==1.0"));
        assert_eq!(unresolvable("ERROR: something else"), None);
    }
}
