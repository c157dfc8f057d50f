//! Packages at run time (`%pip install X` in a session, `POST
//! /v1/sessions/{id}/packages`): binary wheels resolved and downloaded on the
//! host with the host's pip (as for custom templates, `wheels::fetch`), each
//! unpacked once into a **package layer**: a packed, read-only forkbox image
//! of the files the wheel puts under the guest's `/`, stored by the wheel's
//! sha256 at `$FORKBOX_HOME/packages/<sha256>/layer.img` (the image's id is
//! that hash). A sandbox's VFS refers to a layer's files without copying them
//! (`Vfs::install_layer`), so every session that installs the same wheel
//! shares one layer and a checkpoint records only the reference.
//!
//! The server decides where pip looks (`PipSource`) and which distributions
//! may be installed (`Policy`, checked for the requested names and for every
//! dependency pip resolves); a client only names packages.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, SystemTime};

use super::cmd;
use super::confine::Jail;
use super::wheels::{self, PipSource, WheelRef};
use super::BuildError;
use crate::{Image, PackOptions};

/// Most packages in one request.
pub const MAX_SPECS: usize = 32;
/// Largest wheel (download) installed at run time.
pub const MAX_WHEEL_BYTES: u64 = 512 << 20;
/// Caps on what one wheel unpacks to (files, bytes).
pub const MAX_LAYER_FILES: u64 = 100_000;
pub const MAX_LAYER_BYTES: u64 = 4 << 30;
/// The mtime of every file in a layer (layers are a function of their wheel).
const LAYER_MTIME: i64 = 1_600_000_000;

/// Which distributions the server lets sessions install (names compared
/// normalised as pip does: case-insensitive, runs of `-_.` equal).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// If not empty, only these (and no dependency outside them).
    pub allow: Vec<String>,
    /// Never these (wins over `allow`).
    pub deny: Vec<String>,
}

impl Policy {
    pub fn allows(&self, name: &str) -> bool {
        let n = normalize(name);
        if self.deny.iter().any(|d| normalize(d) == n) {
            return false;
        }
        self.allow.is_empty() || self.allow.iter().any(|a| normalize(a) == n)
    }
}

/// A distribution name as pip compares them (PEP 503).
pub fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
            continue;
        }
        if sep && !out.is_empty() {
            out.push('-');
        }
        sep = false;
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The distribution name a spec starts with (`requests[socks]>=2` -> `requests`).
pub fn spec_name(spec: &str) -> &str {
    let end = spec.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))).unwrap_or(spec.len());
    &spec[..end]
}

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("{0}")]
    Invalid(String),
    #[error("package {0} is not allowed on this server")]
    NotAllowed(String),
    /// Only an sdist (or wheels for other platforms): it would need a build.
    #[error(
        "{0} has no binary wheel for CPython 3.11 manylinux x86-64 and would need a build from source \
         (an sdist); packages are never built: use a package with wheels, or a template"
    )]
    NeedsBuild(String),
    #[error("no package {0} in the server's package index or wheelhouse")]
    NotFound(String),
    /// pip or unpacking failed; the details (which may name host paths) are in the server's log.
    #[error("installing packages failed: {0}")]
    Failed(String),
    #[error("package layer {0} is not available on this server")]
    MissingLayer(String),
    /// The layer would take the key past its disk quota.
    #[error("{0}")]
    OverBudget(String),
}

/// One distribution ready to be mounted: what pip resolved and its layer.
#[derive(Clone)]
pub struct Package {
    /// As in the wheel's file name (e.g. `fbxdemo`).
    pub name: String,
    pub version: String,
    pub wheel: String,
    pub sha256: String,
    pub size: u64,
    pub layer: Arc<Image>,
}

impl std::fmt::Debug for Package {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Package").field("wheel", &self.wheel).field("sha256", &self.sha256).finish()
    }
}

/// The package layers of one data directory, and where pip finds wheels.
pub struct PackageStore {
    home: PathBuf,
    source: RwLock<PipSource>,
    policy: RwLock<Policy>,
    /// Layers open in this process (shared by every sandbox that mounts them).
    open: Mutex<HashMap<String, Weak<Image>>>,
    /// One layer build at a time (two sessions installing the same wheel).
    build: Mutex<()>,
}

impl std::fmt::Debug for PackageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackageStore").finish_non_exhaustive()
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `name-version(-build)?-py-abi-platform.whl` -> (name, version).
fn wheel_name_version(filename: &str) -> Option<(String, String)> {
    let stem = filename.strip_suffix(".whl")?;
    let mut parts = stem.split('-');
    let name = parts.next().filter(|n| !n.is_empty())?;
    let version = parts.next().filter(|v| !v.is_empty())?;
    Some((name.to_string(), version.to_string()))
}

impl PackageStore {
    pub fn new(home: &Path) -> PackageStore {
        PackageStore {
            home: home.to_path_buf(),
            source: RwLock::new(PipSource::default()),
            policy: RwLock::new(Policy::default()),
            open: Mutex::new(HashMap::new()),
            build: Mutex::new(()),
        }
    }

    pub fn set_source(&self, source: PipSource) -> Result<(), PackageError> {
        source.validate().map_err(PackageError::Invalid)?;
        *self.source.write().unwrap_or_else(|p| p.into_inner()) = source;
        Ok(())
    }

    pub fn set_policy(&self, policy: Policy) {
        *self.policy.write().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    pub fn policy(&self) -> Policy {
        self.policy.read().map(|p| p.clone()).unwrap_or_default()
    }

    fn layers_dir(&self) -> PathBuf {
        self.home.join("packages")
    }

    /// Where the layer `id` (a wheel's sha256) is kept (None: not a layer id).
    pub fn layer_path(&self, id: &str) -> Option<PathBuf> {
        is_sha256(id).then(|| self.layers_dir().join(id).join("layer.img"))
    }

    /// The size of layer `id` on disk (None: no such layer).
    pub fn layer_bytes(&self, id: &str) -> Option<u64> {
        self.layer_path(id).and_then(|p| fs::metadata(p).ok()).map(|m| m.len())
    }

    /// Remove the layers on disk that are not in `referenced`, not open in
    /// this process and older than `min_age` (a layer just built for an
    /// install whose reference is not recorded yet stays); their ids.
    pub fn gc(&self, referenced: &BTreeSet<String>, min_age: Duration) -> Vec<String> {
        let _one = self.build.lock().unwrap_or_else(|p| p.into_inner());
        let open: BTreeSet<String> = {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.iter().filter(|(_, w)| w.strong_count() > 0).map(|(k, _)| k.clone()).collect()
        };
        let Ok(rd) = fs::read_dir(self.layers_dir()) else { return Vec::new() };
        let mut removed = Vec::new();
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if !is_sha256(&id) || referenced.contains(&id) || open.contains(&id) {
                continue;
            }
            let age = fs::symlink_metadata(e.path())
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .unwrap_or_default();
            if age < min_age {
                continue;
            }
            match fs::remove_dir_all(e.path()) {
                Ok(()) => removed.push(id),
                Err(err) => tracing::warn!(layer = %id, error = %err, "removing an unused package layer"),
            }
        }
        if !removed.is_empty() {
            tracing::info!(removed = removed.len(), "unused package layers removed");
        }
        removed
    }

    /// The layer `id` (a wheel's sha256), from this process' open layers or from disk.
    pub fn open_layer(&self, id: &str) -> Result<Arc<Image>, PackageError> {
        if !is_sha256(id) {
            return Err(PackageError::MissingLayer(id.chars().take(80).collect()));
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = open.get(id).and_then(Weak::upgrade) {
            return Ok(l);
        }
        let path = self.layers_dir().join(id).join("layer.img");
        let image = Image::open(&path).map_err(|e| {
            tracing::warn!(layer = id, error = %e, "package layer unreadable");
            PackageError::MissingLayer(id.to_string())
        })?;
        if image.id() != id {
            tracing::warn!(layer = id, found = image.id(), "package layer has another id");
            return Err(PackageError::MissingLayer(id.to_string()));
        }
        let image = Arc::new(image);
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(id.to_string(), Arc::downgrade(&image));
        Ok(image)
    }

    /// Resolve `specs` (and their dependencies) to binary wheels with the
    /// server's pip source and policy, and make sure each has its layer.
    pub fn resolve(&self, specs: &[String]) -> Result<Vec<Package>, PackageError> {
        self.resolve_within(specs, MAX_LAYER_BYTES)
    }

    /// `resolve`, where a layer built now may unpack to at most `budget`
    /// bytes (what is left of the caller's disk quota; above: `OverBudget`).
    pub fn resolve_within(&self, specs: &[String], budget: u64) -> Result<Vec<Package>, PackageError> {
        if specs.is_empty() || specs.len() > MAX_SPECS {
            return Err(PackageError::Invalid(format!("give 1 to {MAX_SPECS} packages")));
        }
        let policy = self.policy();
        for s in specs {
            wheels::validate_spec(s).map_err(PackageError::Invalid)?;
            let name = spec_name(s);
            if !policy.allows(name) {
                return Err(PackageError::NotAllowed(name.to_string()));
            }
        }
        let source = self.source.read().map(|s| s.clone()).unwrap_or_default();
        let cache = self.home.join("cache");
        let wheels = match wheels::fetch(specs, &source, &cache, MAX_WHEEL_BYTES) {
            Ok(w) => w,
            Err(BuildError::NoWheel { spec }) => return Err(self.classify(&spec, &source)),
            Err(BuildError::Invalid { msg, .. }) => return Err(PackageError::Invalid(msg)),
            Err(e) => return Err(self.failed("pip download", &e.to_string())),
        };
        let mut out = Vec::with_capacity(wheels.len());
        for w in &wheels {
            let (name, version) = wheel_name_version(&w.filename)
                .ok_or_else(|| PackageError::Invalid(format!("odd wheel file name {:?}", w.filename)))?;
            if !policy.allows(&name) {
                return Err(PackageError::NotAllowed(name));
            }
            if w.size > MAX_WHEEL_BYTES {
                return Err(PackageError::Invalid(format!(
                    "{} is {} bytes, over the {MAX_WHEEL_BYTES}-byte limit of a package installed at run time",
                    w.filename, w.size
                )));
            }
            out.push((name, version, w));
        }
        let mut packages = Vec::with_capacity(out.len());
        for (name, version, w) in out {
            let layer = self.layer_of(w, &cache, budget)?;
            packages.push(Package {
                name,
                version,
                wheel: w.filename.clone(),
                sha256: w.sha256.clone(),
                size: w.size,
                layer,
            });
        }
        Ok(packages)
    }

    /// pip found no wheel for `spec`: an sdist only (it needs a build), or nothing.
    /// `pip index versions` lists what the source has in any format without running
    /// any package code.
    fn classify(&self, spec: &str, source: &PipSource) -> PackageError {
        let name = spec_name(spec).to_string();
        let listed = (|| -> Result<bool, BuildError> {
            let mut jail = Jail::new()?;
            let where_from = wheels::source_args(&mut jail, source)?;
            let mut c = wheels::host_pip(&mut jail, &self.home.join("cache"), 64 << 20)?;
            // Every format on purpose: this lists versions from file names and
            // index pages only (it never downloads, builds or prepares a
            // distribution), to tell an sdist-only package from a missing one.
            c.args(["index", "versions", "--no-input", "--disable-pip-version-check"]);
            c.args(&where_from);
            c.arg("--").arg(&name);
            let o = cmd::output("pip", &mut c)?;
            Ok(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("Available versions"))
        })();
        match listed {
            Ok(true) => PackageError::NeedsBuild(spec.to_string()),
            Ok(false) => PackageError::NotFound(spec.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, "pip index versions failed");
                PackageError::NotFound(spec.to_string())
            }
        }
    }

    fn failed(&self, step: &str, detail: &str) -> PackageError {
        tracing::warn!(step, detail, "package install failed");
        PackageError::Failed(format!("{step} failed (details in the server's log)"))
    }

    /// The layer of wheel `w`, unpacked and packed on first use.
    fn layer_of(&self, w: &WheelRef, cache: &Path, budget: u64) -> Result<Arc<Image>, PackageError> {
        if !is_sha256(&w.sha256) {
            return Err(self.failed("pip download", "wheel hash is not a sha256"));
        }
        let _one = self.build.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.layers_dir().join(&w.sha256);
        let path = dir.join("layer.img");
        if !path.exists() {
            let tmp_root = self.home.join("tmp");
            fs::create_dir_all(&tmp_root).map_err(|e| self.failed("setup", &e.to_string()))?;
            let t = tempfile::Builder::new()
                .prefix("layer-")
                .tempdir_in(&tmp_root)
                .map_err(|e| self.failed("unpack", &e.to_string()))?;
            let root = t.path().join("root");
            fs::create_dir_all(&root).map_err(|e| self.failed("unpack", &e.to_string()))?;
            let cap = budget.min(MAX_LAYER_BYTES);
            match wheels::install_capped(&root, std::slice::from_ref(w), cache, MAX_LAYER_FILES, cap) {
                Ok(_) => {}
                Err(BuildError::Invalid { msg, .. }) if cap < MAX_LAYER_BYTES && msg.contains("too large") => {
                    tracing::warn!(wheel = %w.filename, %msg, "wheel over the disk quota");
                    return Err(PackageError::OverBudget(format!(
                        "{} unpacks to more than the {:.1} MiB left of this key's disk quota",
                        w.filename,
                        cap as f64 / (1 << 20) as f64
                    )));
                }
                // The unpacker's message names the wheel and the problem (no host path).
                Err(BuildError::Invalid { msg, .. }) => {
                    tracing::warn!(wheel = %w.filename, %msg, "wheel refused");
                    return Err(PackageError::Invalid(format!("{} is refused: {msg}", w.filename)));
                }
                Err(e) => return Err(self.failed("unpack", &e.to_string())),
            }
            fs::create_dir_all(&dir).map_err(|e| self.failed("layer", &e.to_string()))?;
            let part = dir.join("layer.img.part");
            let opts = PackOptions { id: Some(w.sha256.clone()), mtime_clamp: Some(LAYER_MTIME) };
            crate::pack_dir_with(&root, &part, &opts).map_err(|e| self.failed("pack", &e.to_string()))?;
            let _ = fs::set_permissions(&part, fs::Permissions::from_mode(0o444));
            fs::rename(&part, &path).map_err(|e| self.failed("layer", &e.to_string()))?;
            tracing::info!(wheel = %w.filename, layer = %w.sha256, "package layer built");
        }
        // Opened under the lock: a GC pass keeps the layers open here.
        let l = self.open_layer(&w.sha256);
        drop(_one);
        l
    }
}

#[cfg(test)]
mod tests {
    use super::super::wheels::tests::{readable_by_all, write_wheel};
    use super::*;

    #[test]
    fn names_and_policy() {
        assert_eq!(normalize("Foo__Bar.baz"), "foo-bar-baz");
        assert_eq!(spec_name("requests[socks]>=2"), "requests");
        assert_eq!(spec_name("a.b-c_d==1"), "a.b-c_d");
        let p = Policy { allow: vec![], deny: vec!["Evil_Pkg".into()] };
        assert!(p.allows("ok") && !p.allows("evil-pkg") && !p.allows("EVIL.PKG"));
        let p = Policy { allow: vec!["fbxdemo".into()], deny: vec![] };
        assert!(p.allows("FBXDemo") && !p.allows("other"));
        assert_eq!(wheel_name_version("fbx_demo-1.0-py3-none-any.whl"), Some(("fbx_demo".into(), "1.0".into())));
        assert_eq!(wheel_name_version("x.tar.gz"), None);
    }

    /// Offline: a wheelhouse with a pure-Python wheel, an sdist-only package, a hostile wheel.
    #[test]
    fn layers_from_a_wheelhouse() {
        let dir = tempfile::tempdir().unwrap();
        let house = dir.path().join("house");
        fs::create_dir(&house).unwrap();
        readable_by_all(&[dir.path(), &house]);
        write_wheel(
            &house.join("fbxdemo-1.0-py3-none-any.whl"),
            "fbxdemo",
            &[("fbxdemo/__init__.py", b"X = 42\n")],
            false,
        );
        write_wheel(&house.join("escape-1.0-py3-none-any.whl"), "escape", &[("../../etc/evil", b"x\n")], false);
        fs::write(house.join("onlysdist-1.0.tar.gz"), b"not really a tarball").unwrap();
        let home = dir.path().join("home");
        let store = PackageStore::new(&home);
        store
            .set_source(PipSource { find_links: vec![house.display().to_string()], no_index: true, index_url: None })
            .unwrap();

        let p = store.resolve(&["fbxdemo==1.0".into()]).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].name.as_str(), p[0].version.as_str()), ("fbxdemo", "1.0"));
        let l = &p[0].layer;
        assert_eq!(l.id(), p[0].sha256);
        let mut ino = Image::ROOT;
        for c in ["usr", "local", "lib", "python3.11", "dist-packages", "fbxdemo", "__init__.py"] {
            ino = l.lookup(ino, c.as_bytes()).unwrap_or_else(|| panic!("{c}"));
        }
        assert_eq!(l.content(ino).unwrap(), b"X = 42\n");
        let on_disk = home.join("packages").join(&p[0].sha256).join("layer.img");
        assert!(fs::metadata(&on_disk).unwrap().permissions().readonly());
        // Once: the same layer again, shared in memory.
        let again = store.resolve(&["fbxdemo".into()]).unwrap();
        assert!(Arc::ptr_eq(&again[0].layer, l));
        assert!(Arc::ptr_eq(&store.open_layer(&p[0].sha256).unwrap(), l));

        let e = store.resolve(&["onlysdist".into()]).unwrap_err();
        assert!(matches!(e, PackageError::NeedsBuild(ref s) if s == "onlysdist"), "{e}");
        assert!(e.to_string().contains("onlysdist") && e.to_string().contains("build"), "{e}");
        let e = store.resolve(&["nosuchpkg".into()]).unwrap_err();
        assert!(matches!(e, PackageError::NotFound(_)), "{e}");
        let e = store.resolve(&["escape".into()]).unwrap_err();
        assert!(matches!(e, PackageError::Invalid(ref m) if m.contains("unsafe path")), "{e}");
        assert!(!e.to_string().contains(&dir.path().display().to_string()), "no host path: {e}");
        for bad in ["--index-url=http://x", "pkg @ https://x", "./x"] {
            assert!(matches!(store.resolve(&[bad.into()]), Err(PackageError::Invalid(_))), "{bad}");
        }
        store.set_policy(Policy { allow: vec![], deny: vec!["FBXDEMO".into()] });
        assert!(matches!(store.resolve(&["fbxdemo".into()]), Err(PackageError::NotAllowed(_))));
        for bad in ["../x", "", &"a".repeat(64), &"0".repeat(65)] {
            assert!(matches!(store.open_layer(bad), Err(PackageError::MissingLayer(_))), "{bad}");
        }
    }
}
