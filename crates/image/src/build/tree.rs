//! Shaping the unpacked root tree on the host: unpack, merged /usr, alternatives, trim,
//! base directories, extra files.
//!
//! Maintainer scripts are never run (they would run host binaries as root against the
//! tree); instead we emulate the few effects the guest needs. Anything that creates a path
//! inside the tree resolves the parent directory *inside the tree* first (`resolve`), so an
//! absolute symlink in the tree (`/lib64/ld-linux-x86-64.so.2 -> /lib/...`) can never make
//! us write outside of it.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::cmd;
use super::BuildError;

fn io_err<'a>(step: &'static str, p: &'a Path) -> impl FnOnce(io::Error) -> BuildError + 'a {
    move |e| BuildError::io(step, p, e)
}

/// Sizes of a tree (regular file bytes, counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Largest mtime of any file or symlink (directories are excluded: we touch them).
    pub max_mtime: i64,
}

pub fn stats(root: &Path) -> Result<TreeStats, BuildError> {
    let mut s = TreeStats::default();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(io_err("stats", &d))? {
            let e = e.map_err(io_err("stats", &d))?;
            let p = e.path();
            let m = fs::symlink_metadata(&p).map_err(io_err("stats", &p))?;
            if m.is_dir() {
                s.dirs += 1;
                stack.push(p);
                continue;
            }
            if m.is_file() {
                s.files += 1;
                s.bytes += m.len();
            } else if m.file_type().is_symlink() {
                s.symlinks += 1;
            }
            s.max_mtime = s.max_mtime.max(m.mtime());
        }
    }
    Ok(s)
}

/// Maintainer-script facts collected while unpacking.
#[derive(Default, Debug)]
pub struct Control {
    /// (package, postinst text)
    pub postinsts: Vec<(String, String)>,
}

/// Unpack every .deb into `root` (in order: a later package's file replaces an earlier
/// one's, as dpkg would with Replaces) and collect their postinsts. No maintainer script
/// is run. The `dpkg-deb -R` runs (xz decompression, CPU-bound) go in parallel into
/// per-package staging dirs under `work`, which are then merged in order with renames.
pub fn unpack_all(
    debs: &[(PathBuf, String)],
    work: &Path,
    root: &Path,
    on_done: &(dyn Fn() + Sync),
) -> Result<Control, BuildError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    let staging = |i: usize| work.join(format!("pkg-{i:03}"));
    let next = AtomicUsize::new(0);
    let failures: Mutex<Vec<(usize, BuildError)>> = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 4);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((deb, _)) = debs.get(i) else { break };
                let r = cmd::run("unpack", Command::new("dpkg-deb").arg("-R").arg(deb).arg(staging(i)));
                if let Err(e) = r {
                    if let Ok(mut f) = failures.lock() {
                        f.push((i, e));
                    }
                    break;
                }
                on_done();
            });
        }
    });
    let mut failures = failures.into_inner().unwrap_or_default();
    failures.sort_by_key(|(i, _)| *i);
    if let Some((_, e)) = failures.into_iter().next() {
        return Err(e);
    }

    let mut control = Control::default();
    for (i, (_, package)) in debs.iter().enumerate() {
        let dir = staging(i);
        let ctl = dir.join("DEBIAN");
        if let Ok(text) = fs::read(ctl.join("postinst")) {
            control.postinsts.push((package.clone(), String::from_utf8_lossy(&text).into_owned()));
        }
        fs::remove_dir_all(&ctl).map_err(io_err("unpack", &ctl))?;
        merge_into(&dir, root, Conflict::Replace)?;
        fs::remove_dir(&dir).map_err(io_err("unpack", &dir))?;
    }
    Ok(control)
}

/// Bookworm systems have a merged /usr (/bin -> usr/bin, /lib -> usr/lib, ...), but the
/// packages still ship files under /lib etc.: move them under /usr and add the symlinks,
/// as debootstrap/usrmerge would. This also means every library is found in the first
/// directory of ld.so's search path.
pub fn usrmerge(root: &Path) -> Result<(), BuildError> {
    for d in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let top = root.join(d);
        match fs::symlink_metadata(&top) {
            Ok(m) if m.is_dir() => {}
            _ => continue,
        }
        let usr = root.join("usr").join(d);
        merge_into(&top, &usr, Conflict::FailIfDifferent)?;
        fs::remove_dir(&top).map_err(io_err("usrmerge", &top))?;
        symlink(Path::new("usr").join(d), &top).map_err(io_err("usrmerge", &top))?;
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Conflict {
    /// The entry from `src` replaces a non-directory already in `dst`.
    Replace,
    /// Identical entries are merged, different ones are an error.
    FailIfDifferent,
}

/// Move everything in `src` into `dst` (renames; directories are merged recursively and
/// keep `dst`'s metadata). `src` is left empty.
fn merge_into(src: &Path, dst: &Path, conflict: Conflict) -> Result<(), BuildError> {
    let step = if conflict == Conflict::Replace { "unpack" } else { "usrmerge" };
    if fs::symlink_metadata(dst).is_err() {
        fs::create_dir_all(dst).map_err(io_err(step, dst))?;
        let m = fs::metadata(src).map_err(io_err(step, src))?;
        fs::set_permissions(dst, m.permissions()).map_err(io_err(step, dst))?;
    }
    for e in fs::read_dir(src).map_err(io_err(step, src))? {
        let e = e.map_err(io_err(step, src))?;
        let (s, t) = (e.path(), dst.join(e.file_name()));
        let sm = fs::symlink_metadata(&s).map_err(io_err(step, &s))?;
        let clash =
            || BuildError::Invalid { step, msg: format!("{} and {} both exist and differ", s.display(), t.display()) };
        match fs::symlink_metadata(&t) {
            Err(_) => fs::rename(&s, &t).map_err(io_err(step, &s))?,
            Ok(tm) if tm.is_dir() && sm.is_dir() => {
                merge_into(&s, &t, conflict)?;
                fs::remove_dir(&s).map_err(io_err(step, &s))?;
            }
            Ok(tm) if tm.is_dir() || sm.is_dir() => return Err(clash()),
            Ok(_) if same_entry(&s, &t) => fs::remove_file(&s).map_err(io_err(step, &s))?,
            Ok(_) if conflict == Conflict::Replace => {
                tracing::debug!(path = %t.display(), "file replaced by a later package");
                fs::rename(&s, &t).map_err(io_err(step, &s))?
            }
            Ok(_) => return Err(clash()),
        }
    }
    Ok(())
}

fn same_entry(a: &Path, b: &Path) -> bool {
    match (fs::read_link(a), fs::read_link(b)) {
        (Ok(x), Ok(y)) => x == y,
        (Err(_), Err(_)) => matches!((fs::read(a), fs::read(b)), (Ok(x), Ok(y)) if x == y),
        _ => false,
    }
}

/// Resolve a guest path inside `root` the way the guest's kernel would: absolute symlink
/// targets restart at the image root, ".." stops at the root. Returns the guest path as
/// components. The last component is followed only if `follow_last`; a missing last
/// component is returned as is; a missing intermediate one is an error.
pub fn resolve(root: &Path, guest: &[u8], follow_last: bool) -> io::Result<Vec<OsString>> {
    let mut todo: Vec<OsString> = split(guest);
    todo.reverse(); // a stack: next component at the end
    let mut cur: Vec<OsString> = Vec::new();
    let mut hops = 0;
    while let Some(c) = todo.pop() {
        if c == "." {
            continue;
        }
        if c == ".." {
            cur.pop();
            continue;
        }
        let last = todo.is_empty();
        let host = host_path(root, &cur).join(&c);
        match fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() && (!last || follow_last) => {
                hops += 1;
                if hops > 40 {
                    return Err(io::Error::other("too many symlinks"));
                }
                let target = fs::read_link(&host)?.into_os_string().into_vec();
                if target.first() == Some(&b'/') {
                    cur.clear();
                }
                let mut parts = split(&target);
                parts.reverse();
                todo.extend(parts);
            }
            Ok(m) if !last && !m.is_dir() => {
                return Err(io::Error::new(io::ErrorKind::NotADirectory, "not a directory"))
            }
            Ok(_) => cur.push(c),
            Err(e) if last && e.kind() == io::ErrorKind::NotFound => cur.push(c),
            Err(e) => return Err(e),
        }
    }
    Ok(cur)
}

fn split(p: &[u8]) -> Vec<OsString> {
    p.split(|b| *b == b'/').filter(|c| !c.is_empty()).map(|c| OsStr::from_bytes(c).to_os_string()).collect()
}

pub fn host_path(root: &Path, comps: &[OsString]) -> PathBuf {
    let mut p = root.to_path_buf();
    p.extend(comps);
    p
}

pub fn guest_string(comps: &[OsString]) -> String {
    let mut s = String::new();
    for c in comps {
        s.push('/');
        s.push_str(&c.to_string_lossy());
    }
    if s.is_empty() {
        s.push('/');
    }
    s
}

/// Host path for creating `guest` (its parent resolved in the tree, created 0755 if
/// missing, the last component not followed).
fn creatable(root: &Path, guest: &str, step: &'static str) -> Result<PathBuf, BuildError> {
    let (parent, name) = guest.rsplit_once('/').unwrap_or(("", guest));
    let mut comps: Vec<OsString> = Vec::new();
    // Create missing parents one by one, resolving each inside the tree.
    for c in split(parent.as_bytes()) {
        comps.push(c);
        let resolved = resolve(root, guest_string(&comps).as_bytes(), true)
            .map_err(|e| BuildError::io(step, &host_path(root, &comps), e))?;
        let hp = host_path(root, &resolved);
        if fs::symlink_metadata(&hp).is_err() {
            fs::create_dir(&hp).map_err(io_err(step, &hp))?;
            fs::set_permissions(&hp, fs::Permissions::from_mode(0o755)).map_err(io_err(step, &hp))?;
        }
        comps = resolved;
    }
    Ok(host_path(root, &comps).join(name))
}

/// Relative symlink text from directory `from_dir` to `to` (both guest component lists).
fn relative(from_dir: &[OsString], to: &[OsString]) -> PathBuf {
    let common = from_dir.iter().zip(to).take_while(|(a, b)| a == b).count();
    let mut p = PathBuf::new();
    for _ in common..from_dir.len() {
        p.push("..");
    }
    for c in &to[common..] {
        p.push(c);
    }
    p
}

/// One `update-alternatives --install` (or `--slave`) found in a postinst.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alternative {
    pub name: String,
    pub link: String,
    pub path: String,
    pub priority: i64,
    pub package: String,
}

/// Find `update-alternatives --install link name path prio [--slave link name path]...` in
/// shell text. Lines using shell variables are skipped (we cannot evaluate them).
pub fn parse_alternatives(package: &str, script: &str) -> Vec<Alternative> {
    let joined = script.replace("\\\n", " ");
    let mut out = Vec::new();
    for line in joined.lines() {
        let toks: Vec<&str> = line.split_whitespace().collect();
        let Some(i) = toks.iter().position(|t| *t == "update-alternatives") else {
            continue;
        };
        let toks = &toks[i + 1..];
        let Some(j) = toks.iter().position(|t| *t == "--install") else {
            continue;
        };
        if toks.iter().any(|t| t.contains('$') || t.contains('"') || t.contains('\'') || t.contains('`')) {
            tracing::debug!(package, line, "skipping update-alternatives line with shell syntax");
            continue;
        }
        let [link, name, path, prio] = match toks.get(j + 1..j + 5) {
            Some(&[a, b, c, d]) => [a, b, c, d],
            _ => continue,
        };
        let Ok(priority) = prio.parse::<i64>() else {
            continue;
        };
        let mk = |link: &str, name: &str, path: &str| Alternative {
            name: name.into(),
            link: link.into(),
            path: path.into(),
            priority,
            package: package.into(),
        };
        out.push(mk(link, name, path));
        let mut k = j + 5;
        while toks.get(k) == Some(&"--slave") {
            if let Some(&[l, n, p]) = toks.get(k + 1..k + 4) {
                out.push(mk(l, n, p));
            }
            k += 4;
        }
    }
    out
}

/// Create the symlinks `update-alternatives` would, pointing straight at the chosen
/// target (highest priority per name) with a relative link, skipping targets that are not
/// in the tree (e.g. trimmed man pages). Returns the links made, as (link, target).
pub fn apply_alternatives(
    root: &Path,
    control: &Control,
    preferred: &[&str],
) -> Result<Vec<(String, String)>, BuildError> {
    let mut best: BTreeMap<String, Alternative> = BTreeMap::new();
    // A preferred package's alternative beats any priority (forcing a provider, as
    // `update-alternatives --set` would); otherwise the highest priority wins.
    let rank = |a: &Alternative| (preferred.contains(&a.package.as_str()), a.priority);
    for (pkg, script) in &control.postinsts {
        for a in parse_alternatives(pkg, script) {
            match best.get(&a.name) {
                Some(b) if rank(b) >= rank(&a) => {}
                _ => {
                    best.insert(a.name.clone(), a);
                }
            }
        }
    }
    let mut made = Vec::new();
    for a in best.values() {
        if !a.link.starts_with('/') || !a.path.starts_with('/') {
            continue;
        }
        // Link to the path the package names (blas/libblas.so.3, itself a symlink to the
        // versioned file), like the alternatives system does, with its parent resolved.
        let target = match resolve(root, a.path.as_bytes(), false) {
            Ok(t) if host_path(root, &t).exists() => t,
            _ => {
                tracing::debug!(name = %a.name, path = %a.path, "alternative target not in tree; skipped");
                continue;
            }
        };
        let link_host = creatable(root, &a.link, "alternatives")?;
        let link_dir: Vec<OsString> = {
            let parent = a.link.rsplit_once('/').map_or("", |(p, _)| p);
            resolve(root, parent.as_bytes(), true).map_err(|e| BuildError::io("alternatives", &link_host, e))?
        };
        if fs::symlink_metadata(&link_host).is_ok() {
            fs::remove_file(&link_host).map_err(io_err("alternatives", &link_host))?;
        }
        let rel = relative(&link_dir, &target);
        symlink(&rel, &link_host).map_err(io_err("alternatives", &link_host))?;
        tracing::info!(link = %a.link, target = %rel.display(), package = %a.package, "alternative");
        made.push((a.link.clone(), rel.display().to_string()));
    }
    Ok(made)
}

/// Does a relative guest path (components) match a trim rule?
pub fn glob_match(rule: &[&[u8]], path: &[&[u8]]) -> bool {
    match (rule.first(), path.first()) {
        (None, None) => true,
        (Some(&r), _) if r == b"**" => {
            glob_match(&rule[1..], path) || (!path.is_empty() && glob_match(rule, &path[1..]))
        }
        (Some(&r), Some(&p)) => component_match(r, p) && glob_match(&rule[1..], &path[1..]),
        _ => false,
    }
}

/// `*` matches any run of bytes within one component.
fn component_match(pat: &[u8], s: &[u8]) -> bool {
    match pat.iter().position(|b| *b == b'*') {
        None => pat == s,
        Some(i) => {
            let (head, tail) = (&pat[..i], &pat[i + 1..]);
            if !s.starts_with(head) {
                return false;
            }
            let rest = &s[head.len()..];
            (0..=rest.len()).any(|k| component_match(tail, &rest[k..]))
        }
    }
}

/// Remove everything matching `rules`. Symlinked directories are not descended into.
/// Returns the number of removed entries (top-level matches).
pub fn trim(root: &Path, rules: &[&str]) -> Result<u64, BuildError> {
    let rules: Vec<Vec<&[u8]>> =
        rules.iter().map(|r| r.as_bytes().split(|b| *b == b'/').filter(|c| !c.is_empty()).collect()).collect();
    let mut removed = 0;
    let mut stack: Vec<Vec<OsString>> = vec![Vec::new()];
    while let Some(rel) = stack.pop() {
        let dir = host_path(root, &rel);
        let mut entries: Vec<OsString> = Vec::new();
        for e in fs::read_dir(&dir).map_err(io_err("trim", &dir))? {
            entries.push(e.map_err(io_err("trim", &dir))?.file_name());
        }
        for name in entries {
            let mut p = rel.clone();
            p.push(name);
            let comps: Vec<&[u8]> = p.iter().map(|c| c.as_bytes()).collect();
            let host = host_path(root, &p);
            let m = fs::symlink_metadata(&host).map_err(io_err("trim", &host))?;
            if rules.iter().any(|r| glob_match(r, &comps)) {
                if m.is_dir() {
                    fs::remove_dir_all(&host).map_err(io_err("trim", &host))?;
                } else {
                    fs::remove_file(&host).map_err(io_err("trim", &host))?;
                }
                removed += 1;
            } else if m.is_dir() {
                stack.push(p);
            }
        }
    }
    Ok(removed)
}

/// Directories every guest expects: /tmp (1777), /root (0700), /home.
pub fn base_dirs(root: &Path) -> Result<(), BuildError> {
    for (d, mode) in [("tmp", 0o1777), ("root", 0o700), ("home", 0o755), ("etc", 0o755)] {
        let p = root.join(d);
        if fs::symlink_metadata(&p).is_err() {
            fs::create_dir(&p).map_err(io_err("base dirs", &p))?;
        }
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).map_err(io_err("base dirs", &p))?;
    }
    Ok(())
}

/// What tzdata's postinst does with no debconf answer: UTC.
pub fn timezone(root: &Path) -> Result<(), BuildError> {
    if !root.join("usr/share/zoneinfo/Etc/UTC").exists() {
        return Ok(());
    }
    let link = creatable(root, "/etc/localtime", "timezone")?;
    if fs::symlink_metadata(&link).is_ok() {
        fs::remove_file(&link).map_err(io_err("timezone", &link))?;
    }
    symlink("../usr/share/zoneinfo/Etc/UTC", &link).map_err(io_err("timezone", &link))?;
    add_file(root, "/etc/timezone", b"Etc/UTC\n", 0o644)
}

/// What `update-ca-certificates` does: every certificate under
/// /usr/share/ca-certificates, concatenated (sorted by path) into
/// /etc/ssl/certs/ca-certificates.crt. Returns how many there were.
pub fn ca_bundle(root: &Path) -> Result<usize, BuildError> {
    let base = root.join("usr/share/ca-certificates");
    if !base.is_dir() {
        return Ok(0);
    }
    let mut certs: Vec<PathBuf> = Vec::new();
    let mut stack = vec![base];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(io_err("ca bundle", &d))? {
            let p = e.map_err(io_err("ca bundle", &d))?.path();
            let m = fs::symlink_metadata(&p).map_err(io_err("ca bundle", &p))?;
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() && p.extension().is_some_and(|x| x == "crt") {
                certs.push(p);
            }
        }
    }
    certs.sort();
    let mut bundle = Vec::new();
    for c in &certs {
        let mut pem = fs::read(c).map_err(io_err("ca bundle", c))?;
        if !pem.ends_with(b"\n") {
            pem.push(b'\n');
        }
        bundle.extend_from_slice(&pem);
    }
    add_file(root, "/etc/ssl/certs/ca-certificates.crt", &bundle, 0o644)?;
    Ok(certs.len())
}

/// Write one extra file (replacing whatever was at that path).
pub fn add_file(root: &Path, guest: &str, data: &[u8], perm: u32) -> Result<(), BuildError> {
    let host = creatable(root, guest, "extra files")?;
    if let Ok(m) = fs::symlink_metadata(&host) {
        if m.is_dir() {
            return Err(BuildError::Invalid {
                step: "extra files",
                msg: format!("{guest} is a directory in the image"),
            });
        }
        fs::remove_file(&host).map_err(io_err("extra files", &host))?;
    }
    fs::write(&host, data).map_err(io_err("extra files", &host))?;
    fs::set_permissions(&host, fs::Permissions::from_mode(perm)).map_err(io_err("extra files", &host))?;
    Ok(())
}

/// Write /etc/ld.so.cache as libc-bin's trigger would (`ldconfig -r <tree>`, no link
/// updates), so ld.so opens each library directly instead of probing the search path and
/// its hwcaps subdirectories. Best effort: without it the guest still works.
pub fn ldconfig(root: &Path) -> Result<bool, BuildError> {
    let prog = ["/usr/sbin/ldconfig", "/sbin/ldconfig"].into_iter().find(|p| Path::new(p).exists());
    let Some(prog) = prog else {
        tracing::warn!("no ldconfig on the host; the image has no /etc/ld.so.cache");
        return Ok(false);
    };
    let etc = root.join("etc");
    fs::create_dir_all(&etc).map_err(io_err("ldconfig", &etc))?;
    cmd::run("ldconfig", Command::new(prog).arg("-X").arg("-r").arg(root))?;
    // ldconfig also leaves an aux cache behind; it is host bookkeeping.
    let aux = root.join("var/cache/ldconfig");
    if aux.exists() {
        fs::remove_dir_all(&aux).map_err(io_err("ldconfig", &aux))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rule: &str, path: &str) -> bool {
        let r: Vec<&[u8]> = rule.split('/').map(str::as_bytes).collect();
        let p: Vec<&[u8]> = path.split('/').map(str::as_bytes).collect();
        glob_match(&r, &p)
    }

    #[test]
    fn globs() {
        assert!(m("usr/share/doc", "usr/share/doc"));
        assert!(!m("usr/share/doc", "usr/share/doc2"));
        assert!(!m("usr/share/doc", "usr/share"));
        assert!(m("usr/lib/python3.*/test", "usr/lib/python3.11/test"));
        assert!(!m("usr/lib/python3.*/test", "usr/lib/python3/test"));
        assert!(m("a/**/tests", "a/tests"));
        assert!(m("a/**/tests", "a/b/c/tests"));
        assert!(!m("a/**/tests", "a/b/c/tests2"));
        assert!(m("**/*.a", "libx.a"));
        assert!(m("**/*.a", "usr/lib/libx.a"));
        assert!(!m("**/*.a", "usr/lib/libx.so"));
        assert!(m("**/*.a", "usr/lib/.a"));
        assert!(m("x*y*z", "xaaybbz"));
        assert!(!m("x*y*z", "xaaybb"));
    }

    #[test]
    fn alternatives_parsing() {
        let s = "set -e\n\nupdate-alternatives --install /usr/lib/x86_64-linux-gnu/libblas.so.3 \\\n                    libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/blas/libblas.so.3 10\n";
        let a = parse_alternatives("libblas3", s);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].link, "/usr/lib/x86_64-linux-gnu/libblas.so.3");
        assert_eq!(a[0].name, "libblas.so.3-x86_64-linux-gnu");
        assert_eq!(a[0].path, "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3");
        assert_eq!(a[0].priority, 10);
        let s = "\tupdate-alternatives --install /usr/sbin/rmt rmt /usr/sbin/rmt-tar 50 \\\n\t\t--slave /usr/share/man/man8/rmt.8.gz rmt.8.gz \\\n\t\t\t/usr/share/man/man8/rmt-tar.8.gz \n";
        let a = parse_alternatives("tar", s);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].link, "/usr/share/man/man8/rmt.8.gz");
        assert!(parse_alternatives("x", "update-alternatives --install $LINK n /p 1\n").is_empty());
        assert!(parse_alternatives("x", "update-alternatives --remove n /p\n").is_empty());
    }

    #[test]
    fn resolve_stays_in_tree() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("usr/lib/x")).unwrap();
        symlink("usr/lib", r.join("lib")).unwrap();
        symlink("/lib/x", r.join("abs")).unwrap();
        symlink("../../..", r.join("usr/lib/x/up")).unwrap();
        fs::write(r.join("usr/lib/x/f"), b"").unwrap();
        let s = |p: &str, f| guest_string(&resolve(r, p.as_bytes(), f).unwrap());
        assert_eq!(s("/lib/x/f", true), "/usr/lib/x/f");
        assert_eq!(s("/abs/f", true), "/usr/lib/x/f");
        assert_eq!(s("/abs", false), "/abs");
        assert_eq!(s("/abs/up/lib", true), "/usr/lib");
        assert_eq!(s("/abs/up/../../lib", true), "/usr/lib");
        assert_eq!(s("/lib/missing", true), "/usr/lib/missing");
        assert!(resolve(r, b"/missing/x", true).is_err());
        assert!(resolve(r, b"/usr/lib/x/f/g", true).is_err());
        assert_eq!(relative(&split(b"usr/lib/x"), &split(b"usr/lib/x/blas/l.so")), PathBuf::from("blas/l.so"));
        assert_eq!(relative(&split(b"usr/sbin"), &split(b"usr/lib/y")), PathBuf::from("../lib/y"));

        // creating through an absolute symlink stays inside the tree
        add_file(r, "/abs/new/file", b"hi", 0o600).unwrap();
        assert_eq!(fs::read(r.join("usr/lib/x/new/file")).unwrap(), b"hi");
    }

    #[test]
    fn usrmerge_and_trim() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("lib/x86_64-linux-gnu")).unwrap();
        fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        fs::create_dir_all(r.join("bin")).unwrap();
        fs::write(r.join("lib/x86_64-linux-gnu/libc.so.6"), b"c").unwrap();
        fs::write(r.join("usr/lib/x86_64-linux-gnu/libz.so.1"), b"z").unwrap();
        fs::write(r.join("bin/sh"), b"sh").unwrap();
        usrmerge(r).unwrap();
        assert_eq!(fs::read_link(r.join("lib")).unwrap(), PathBuf::from("usr/lib"));
        assert_eq!(fs::read(r.join("lib/x86_64-linux-gnu/libc.so.6")).unwrap(), b"c");
        assert_eq!(fs::read(r.join("usr/bin/sh")).unwrap(), b"sh");

        fs::create_dir_all(r.join("usr/share/doc/x")).unwrap();
        fs::write(r.join("usr/share/doc/x/README"), b"r").unwrap();
        fs::write(r.join("usr/lib/libfoo.a"), b"a").unwrap();
        let n = trim(r, &["usr/share/doc", "**/*.a"]).unwrap();
        assert_eq!(n, 2);
        assert!(!r.join("usr/share/doc").exists());
        assert!(!r.join("usr/lib/libfoo.a").exists());
        assert!(r.join("usr/share").exists());

        // conflicting files are an error, identical ones are merged
        fs::create_dir_all(r.join("sbin")).unwrap();
        fs::create_dir_all(r.join("usr/sbin")).unwrap();
        fs::write(r.join("sbin/a"), b"1").unwrap();
        fs::write(r.join("usr/sbin/a"), b"1").unwrap();
        usrmerge(r).unwrap();
        fs::create_dir_all(r.join("lib32")).unwrap();
        fs::create_dir_all(r.join("usr/lib32")).unwrap();
        fs::write(r.join("lib32/a"), b"1").unwrap();
        fs::write(r.join("usr/lib32/a"), b"2").unwrap();
        assert!(usrmerge(r).is_err());
    }
}
