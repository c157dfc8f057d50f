//! Resolving and fetching .debs with the host's apt, without touching the host's
//! installed packages.
//!
//! Resolution runs `apt-get install --print-uris` against an *empty* dpkg status file, so
//! apt computes the full closure as if nothing were installed (what a fresh bookworm
//! chroot would get), without recommends. apt puts its dpkg locks next to the status file
//! (our cache dir), and we disable its binary cache files so the host's
//! /var/cache/apt/*.bin are not rewritten. Downloads go to `<home>/cache/debs` with
//! `--download-only` (apt verifies hashes and skips files it already has); we then check
//! every file's sha256 against what the resolution printed.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::cmd;
use super::BuildError;

/// One resolved package file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebRef {
    pub uri: String,
    /// File name in apt's archive cache (epoch ':' spelled "%3a").
    pub filename: String,
    /// Package name (the file name up to the first '_').
    pub package: String,
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// apt options shared by resolution and download.
fn apt_command(status_file: &Path) -> Command {
    let mut c = Command::new("apt-get");
    c.env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .arg("-qq")
        .arg("-o")
        .arg(format!("Dir::State::status={}", status_file.display()))
        .args(["-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache="])
        .args(["-o", "APT::Install-Recommends=false", "-o", "APT::Install-Suggests=false"])
        .args(["-o", "Acquire::ForceHash=SHA256"])
        .args(["-o", "APT::Sandbox::User=root"]);
    c
}

/// The dpkg status file apt resolves against: empty, except for the `omit` packages,
/// which are listed as installed (at their candidate version, with no dependencies of
/// their own) so that apt neither fetches them nor pulls in what they depend on. That is
/// how build-only dependencies (python3-pythran pulls g++, boost and -dev packages) and
/// packages only maintainer scripts need (debconf, perl) are left out of an image.
/// Omitted names without a candidate are skipped.
fn status_file(cache: &Path, omit: &[String]) -> Result<PathBuf, BuildError> {
    let dir = cache.join("apt");
    fs::create_dir_all(&dir).map_err(|e| BuildError::io("resolve", &dir, e))?;
    let text = if omit.is_empty() { String::new() } else { omitted_stanzas(omit)? };
    let name = if text.is_empty() {
        "status-empty".to_string()
    } else {
        format!("status-omit-{}", &hex::encode(Sha256::digest(text.as_bytes()))[..16])
    };
    let status = dir.join(name);
    fs::write(&status, text.as_bytes()).map_err(|e| BuildError::io("resolve", &status, e))?;
    Ok(status)
}

/// `Package/Status/Architecture/Version` stanzas for the candidates of `omit`.
fn omitted_stanzas(omit: &[String]) -> Result<String, BuildError> {
    let mut c = Command::new("apt-cache");
    c.env("LC_ALL", "C")
        .args(["-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache="])
        .args(["show", "--no-all-versions", "--"])
        .args(omit);
    // apt-cache exits non-zero if any name is unknown but still prints the others.
    let out = cmd::output("resolve", &mut c)?;
    let mut seen = std::collections::BTreeMap::new();
    for stanza in String::from_utf8_lossy(&out.stdout).split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
                .map(|v| v.trim().to_string())
        };
        let (Some(pkg), Some(version), Some(arch)) = (field("Package"), field("Version"), field("Architecture")) else {
            continue;
        };
        let safe = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic());
        if !safe(&pkg) || !safe(&version) || !safe(&arch) || !omit.contains(&pkg) {
            continue;
        }
        seen.entry(pkg).or_insert((version, arch));
    }
    let mut text = String::new();
    for (pkg, (version, arch)) in seen {
        text.push_str(&format!(
            "Package: {pkg}\nStatus: install ok installed\nPriority: optional\nSection: misc\n\
             Maintainer: forkbox\nArchitecture: {arch}\nVersion: {version}\n\
             Description: left out of the image by forkbox\n\n"
        ));
    }
    Ok(text)
}

/// Key for the resolution cache: the requested packages and the name, size and mtime of
/// everything apt reads to resolve (package lists, sources, preferences, config). Any
/// `apt-get update` or configuration change gives a new key.
fn resolution_key(packages: &[String], omit: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(b"forkbox-apt-resolution-v2\0");
    let mut om: Vec<&String> = omit.iter().collect();
    om.sort();
    for p in om {
        h.update(b"omit\0");
        h.update(p.as_bytes());
        h.update(b"\0");
    }
    let mut pkgs: Vec<&String> = packages.iter().collect();
    pkgs.sort();
    for p in pkgs {
        h.update(p.as_bytes());
        h.update(b"\0");
    }
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in ["/var/lib/apt/lists", "/etc/apt/sources.list.d", "/etc/apt/preferences.d", "/etc/apt/apt.conf.d"] {
        if let Ok(rd) = fs::read_dir(dir) {
            files.extend(rd.filter_map(|e| e.ok()).map(|e| e.path()));
        }
    }
    files.extend(
        ["/etc/apt/sources.list", "/etc/apt/preferences", "/etc/apt/apt.conf", "/var/lib/dpkg/arch"].map(PathBuf::from),
    );
    files.sort();
    for f in files {
        if let Ok(m) = fs::metadata(&f) {
            if m.is_file() && f.file_name().is_some_and(|n| n != "lock") {
                use std::os::unix::fs::MetadataExt;
                h.update(f.as_os_str().as_encoded_bytes());
                h.update(format!("\0{} {} {}\0", m.len(), m.mtime(), m.mtime_nsec()).as_bytes());
            }
        }
    }
    hex::encode(h.finalize())
}

/// The dependency closure of `packages` on an empty system, as .deb files. apt takes
/// ~2 s to answer, so answers are cached under `<cache>/apt/` by `resolution_key`.
pub fn resolve(packages: &[String], omit: &[String], cache: &Path) -> Result<Vec<DebRef>, BuildError> {
    let saved = cache.join("apt").join(format!("resolved-{}.txt", resolution_key(packages, omit)));
    if let Ok(text) = fs::read_to_string(&saved) {
        match parse_print_uris(&text) {
            Ok(debs) if !debs.is_empty() => {
                tracing::debug!(file = %saved.display(), "using cached apt resolution");
                return Ok(debs);
            }
            _ => {
                tracing::warn!(file = %saved.display(), "ignoring unreadable cached apt resolution")
            }
        }
    }
    let (text, debs) = resolve_with_apt(packages, omit, cache)?;
    // Best effort: write to a temp name and rename, so a crash never leaves half a file.
    let tmp = saved.with_extension(format!("tmp.{}", std::process::id()));
    if fs::write(&tmp, &text).and_then(|_| fs::rename(&tmp, &saved)).is_err() {
        let _ = fs::remove_file(&tmp);
    }
    Ok(debs)
}

fn resolve_with_apt(packages: &[String], omit: &[String], cache: &Path) -> Result<(String, Vec<DebRef>), BuildError> {
    let status = status_file(cache, omit)?;
    // --print-uris leaves out packages already in the archive cache: point it at an
    // empty one so the answer is always the whole closure.
    let archives = cache.join("apt").join("empty-archives");
    fs::create_dir_all(archives.join("partial")).map_err(|e| BuildError::io("resolve", &archives, e))?;
    let mut c = apt_command(&status);
    c.arg("-o").arg(format!("Dir::Cache::archives={}", archives.display()));
    c.arg("install").arg("--print-uris").arg("--").args(packages);
    let out = cmd::output("resolve", &mut c)?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("Unable to locate package")
            || err.contains("has no installation candidate")
            || err.contains("is not available")
        {
            return Err(BuildError::AptNoCandidate { detail: cmd::tail(&out.stderr) });
        }
        return Err(cmd::failed("resolve", &c, &out));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let debs = parse_print_uris(&text)?;
    if debs.is_empty() {
        return Err(BuildError::AptNoCandidate { detail: "apt-get printed no packages".into() });
    }
    Ok((text, debs))
}

/// Parse `apt-get --print-uris` lines: `'URI' filename size SHA256:hex`.
pub fn parse_print_uris(text: &str) -> Result<Vec<DebRef>, BuildError> {
    let bad = |line: &str, why: &str| BuildError::Invalid {
        step: "resolve",
        msg: format!("unexpected apt-get --print-uris line ({why}): {line}"),
    };
    let mut debs = Vec::new();
    for line in text.lines() {
        let line = line.trim_end();
        let Some(rest) = line.strip_prefix('\'') else {
            continue; // apt may print notes; URI lines always start with a quote
        };
        let Some((uri, rest)) = rest.split_once("' ") else {
            return Err(bad(line, "no closing quote"));
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let [filename, size, hash] = fields[..] else {
            return Err(bad(line, "expected 3 fields"));
        };
        let size: u64 = size.parse().map_err(|_| bad(line, "size"))?;
        let Some(hexhash) = hash.strip_prefix("SHA256:") else {
            return Err(bad(line, "no SHA256 hash"));
        };
        if hexhash.len() != 64 || !hexhash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(line, "malformed sha256"));
        }
        if filename.contains('/') || filename.starts_with('.') || !filename.ends_with(".deb") {
            return Err(bad(line, "file name"));
        }
        let package = filename.split('_').next().unwrap_or_default().to_string();
        debs.push(DebRef {
            uri: uri.to_string(),
            filename: filename.to_string(),
            package,
            size,
            sha256: hexhash.to_ascii_lowercase(),
        });
    }
    Ok(debs)
}

pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// True if `dir/filename` exists with the expected hash; removes it if it has another.
fn cached_ok(dir: &Path, d: &DebRef) -> bool {
    let p = dir.join(&d.filename);
    match sha256_file(&p) {
        Ok(h) if h == d.sha256 => true,
        Ok(h) => {
            tracing::warn!(file = %p.display(), expected = %d.sha256, got = %h, "cached .deb has the wrong hash; fetching again");
            let _ = fs::remove_file(&p);
            false
        }
        Err(_) => false,
    }
}

/// Make sure every deb is in `debs_dir` with the right sha256, downloading what is
/// missing. `on_progress(done_bytes, total_bytes)` is called while downloading.
/// Returns the number of bytes downloaded.
pub fn download(
    packages: &[String],
    omit: &[String],
    debs: &[DebRef],
    cache: &Path,
    debs_dir: &Path,
    on_progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<u64, BuildError> {
    let partial = debs_dir.join("partial");
    fs::create_dir_all(&partial).map_err(|e| BuildError::io("download", &partial, e))?;
    let missing: Vec<&DebRef> = debs.iter().filter(|d| !cached_ok(debs_dir, d)).collect();
    if missing.is_empty() {
        return Ok(0);
    }
    let total: u64 = missing.iter().map(|d| d.size).sum();
    tracing::info!(files = missing.len(), bytes = total, "downloading packages");

    let status = status_file(cache, omit)?;
    let mut c = apt_command(&status);
    c.arg("-o")
        .arg(format!("Dir::Cache::archives={}", debs_dir.display()))
        .arg("install")
        .arg("--download-only")
        .arg("--")
        .args(packages)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());

    // Poll the sizes of the files being fetched while apt runs.
    let stop = Arc::new(AtomicBool::new(false));
    let out = std::thread::scope(|s| {
        let stop2 = stop.clone();
        let missing = &missing;
        s.spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let done: u64 = missing
                    .iter()
                    .map(|d| {
                        let size = |p: PathBuf| fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                        size(debs_dir.join(&d.filename)).max(size(partial.join(&d.filename)))
                    })
                    .sum();
                on_progress(done.min(total), total);
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let r = cmd::output("download", &mut c);
        stop.store(true, Ordering::Relaxed);
        r
    })?;
    if !out.status.success() {
        return Err(cmd::failed("download", &c, &out));
    }
    on_progress(total, total);

    // Verify everything (apt resolved again; if the package lists changed in between,
    // we may be missing exactly the files we asked for).
    for d in debs {
        let p = debs_dir.join(&d.filename);
        let got = sha256_file(&p).map_err(|e| BuildError::io("download", &p, e))?;
        if got != d.sha256 {
            return Err(BuildError::Checksum { file: p, expected: d.sha256.clone(), actual: got });
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
'http://deb.debian.org/debian/pool/main/g/glibc/libc6_2.36-9%2bdeb12u14_amd64.deb' libc6_2.36-9+deb12u14_amd64.deb 2759320 SHA256:ba4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf
'http://deb.debian.org/debian/pool/main/z/zlib/zlib1g_1.2.13.dfsg-1_amd64.deb' zlib1g_1%3a1.2.13.dfsg-1_amd64.deb 86684 SHA256:AB4F88F73DBC3AE9055F3C20F4523BFDBAF1AD13FF95E258924F77D20B4FBEDF
";

    #[test]
    fn parses_print_uris() {
        let d = parse_print_uris(SAMPLE).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].uri, "http://deb.debian.org/debian/pool/main/g/glibc/libc6_2.36-9%2bdeb12u14_amd64.deb");
        assert_eq!(d[0].filename, "libc6_2.36-9+deb12u14_amd64.deb");
        assert_eq!(d[0].package, "libc6");
        assert_eq!(d[0].size, 2759320);
        assert_eq!(d[0].sha256, "ba4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf");
        assert_eq!(d[1].filename, "zlib1g_1%3a1.2.13.dfsg-1_amd64.deb");
        assert_eq!(d[1].package, "zlib1g");
        assert_eq!(d[1].sha256, "ab4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf");
        // notes and blank lines are ignored
        assert_eq!(parse_print_uris("\nNote: something\n").unwrap(), vec![]);
    }

    #[test]
    fn rejects_malformed_lines() {
        for l in [
            "'http://x/a.deb a_1_amd64.deb 1 SHA256:00",
            "'http://x/a.deb' a_1_amd64.deb 12 MD5Sum:8e7e741807b1e1939df8f58323affdcb",
            "'http://x/a.deb' a_1_amd64.deb twelve SHA256:ba4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf",
            "'http://x/a.deb' a_1_amd64.deb 12",
            "'http://x/a.deb' ../a_1_amd64.deb 12 SHA256:ba4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf",
            "'http://x/a.deb' a_1_amd64.deb 12 SHA256:zz4f88f73dbc3ae9055f3c20f4523bfdbaf1ad13ff95e258924f77d20b4fbedf",
        ] {
            assert!(parse_print_uris(l).is_err(), "{l}");
        }
    }
}

/// Talks to the host's apt (no downloads): run with `cargo test -- --ignored`.
#[cfg(test)]
mod host_tests {
    use super::*;

    #[test]
    #[ignore]
    fn unknown_package_says_apt_get_update() {
        let d = tempfile::tempdir().unwrap();
        let e = resolve(&["forkbox-no-such-package".into()], &[], d.path()).unwrap_err();
        assert!(matches!(e, BuildError::AptNoCandidate { .. }), "{e}");
        assert!(e.to_string().contains("apt-get update"), "{e}");
    }

    #[test]
    #[ignore]
    fn numpy_closure_uses_reference_blas() {
        let d = tempfile::tempdir().unwrap();
        let debs = resolve(&["python3".into(), "python3-numpy".into()], &[], d.path()).unwrap();
        let names: Vec<&str> = debs.iter().map(|d| d.package.as_str()).collect();
        assert!(names.contains(&"libblas3") && names.contains(&"liblapack3"), "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("libopenblas")), "{names:?}");
        // the second call is answered from the cache, identically
        assert_eq!(resolve(&["python3-numpy".into(), "python3".into()], &[], d.path()).unwrap(), debs);
    }
}
