//! Templates shared by the nodes of a cluster: built once, published to a
//! bucket, fetched by every other node.
//!
//! A template's id names its *inputs* (image id, preload, versions, CPU); two
//! nodes that boot "the same" template get the same id with different memory
//! (boot is not deterministic), and image ids are recipe hashes, not content
//! hashes. A session's checkpoints are XOR layers over one template's exact
//! pages and its files refer to one image's inodes and to package layers'. So
//! in a cluster there is one copy of each, the published one, and every node
//! uses exactly it:
//!
//! - **Publish**: a template directory goes up as a bundle
//!   (`forkbox_snapshot::bundle`: the state file and the memory file's data
//!   pages, content-addressed by SHA-256), with the image file it needs and
//!   the package layers its state mounts, each recorded (kind, id -> SHA-256)
//!   by the [`SharedArtifacts`] behind it; the first record of an id wins.
//! - **Build once**: a node about to build a template looks for it first;
//!   otherwise it takes the cluster-wide lock of that id, looks again, builds
//!   (its image likewise: fetched if published, else built and published
//!   under the image's own lock), publishes, releases.
//! - **Fetch on demand**: a template (or image, or package layer) a node needs
//!   and lacks, or whose local copy differs from the published one, is
//!   downloaded (hash-checked), unpacked beside the data directory
//!   (`tmp/shared`), verified, then renamed into place; nothing partial is
//!   ever in `templates/`, `images/` or `packages/`.
//!
//! This crate knows nothing of buckets or databases: the [`SharedArtifacts`]
//! trait is implemented above it (`forkbox_sessions::artifacts`) and handed
//! to the catalog (`Catalog::set_shared`) when the node is in a cluster.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use forkbox_api::ErrorCode;
use sha2::{Digest, Sha256};

use forkbox_engine::template::templates_dir;
use forkbox_engine::{EngineError, LayerSource};

/// What an artifact is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArtifactKind {
    /// A template directory, as a `forkbox_snapshot::bundle`; id: the template id.
    Template,
    /// An image file; id: the image id (a recipe hash).
    Image,
    /// A package layer (`packages/<id>/layer.img`); id: its wheel's SHA-256.
    Package,
}

impl ArtifactKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            ArtifactKind::Template => "template",
            ArtifactKind::Image => "image",
            ArtifactKind::Package => "package",
        }
    }

    pub fn parse(s: &str) -> Option<ArtifactKind> {
        match s {
            "template" => Some(ArtifactKind::Template),
            "image" => Some(ArtifactKind::Image),
            "package" => Some(ArtifactKind::Package),
            _ => None,
        }
    }
}

/// A published artifact (or one about to be).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Artifact {
    pub kind: ArtifactKind,
    pub id: String,
    /// SHA-256 (hex) of the object: the bundle, the image file, the layer file.
    pub sha256: String,
    pub bytes: u64,
    /// A template: the id of the image it needs.
    pub needs: Option<String>,
    /// A template: SHA-256 of its state file (which records its memory's
    /// checksum), to compare a local copy without packing it.
    pub digest: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    /// The bucket or the database cannot be reached now (retry later).
    #[error("shared templates: {0}")]
    Unavailable(String),
    /// What was fetched is not what was published (its hash, its format), or
    /// the records disagree; nothing of it was put in place.
    #[error("shared {kind} {id}: {why}")]
    Corrupt { kind: &'static str, id: String, why: String },
    /// Anything else (the local disk, a refused statement).
    #[error("shared templates: {0}")]
    Failed(String),
}

impl SharedError {
    /// `storage_unavailable` (503, retry later) when the bucket or the
    /// database is down; `storage_error` otherwise.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            SharedError::Unavailable(_) => ErrorCode::StorageUnavailable,
            _ => ErrorCode::StorageError,
        }
    }

    fn corrupt(kind: ArtifactKind, id: &str, why: impl Into<String>) -> SharedError {
        SharedError::Corrupt { kind: kind.as_str(), id: id.to_string(), why: why.into() }
    }
}

/// The engine's form of a shared-artifact failure (same message and code).
impl From<SharedError> for EngineError {
    fn from(e: SharedError) -> EngineError {
        EngineError::Storage { code: e.error_code(), message: e.to_string() }
    }
}

/// The cluster's package layers as an engine fetches them (a layer a restored
/// state mounts and this node lacks).
pub(crate) struct SharedLayers(pub(crate) Arc<Shared>);

impl LayerSource for SharedLayers {
    fn fetch_layer(&self, id: &str, path: &Path) -> Result<bool, EngineError> {
        let (id, path) = (id.to_string(), path.to_path_buf());
        Ok(self.0.off(move |sh| sh.install_layer(&id, &path))?)
    }
}

fn failed(what: &str, path: &Path, e: impl std::fmt::Display) -> SharedError {
    // A path under the data directory: named by its last components only.
    let shown: PathBuf = path.iter().rev().take(2).collect::<Vec<_>>().into_iter().rev().collect();
    SharedError::Failed(format!("{what} {}: {e}", shown.display()))
}

/// A cluster-wide lock, released when dropped.
pub struct BuildLock(#[allow(dead_code)] Box<dyn Send>);

impl BuildLock {
    pub fn new(guard: impl Send + 'static) -> BuildLock {
        BuildLock(Box::new(guard))
    }
}

/// Where a cluster's nodes share templates, images and package layers: a
/// bucket for the bytes (content-addressed), a table of the metadata
/// database for what id is which bytes, and a lock per id. Implemented by
/// `forkbox_sessions::artifacts::BucketArtifacts`.
pub trait SharedArtifacts: Send + Sync {
    /// What is published as (`kind`, `id`), if anything.
    fn lookup(&self, kind: ArtifactKind, id: &str) -> Result<Option<Artifact>, SharedError>;
    /// Download `a`'s object into the new file `dest` (created), its size and
    /// SHA-256 checked against `a` (`Corrupt` otherwise; `dest` is then removed).
    fn download(&self, a: &Artifact, dest: &Path) -> Result<(), SharedError>;
    /// Upload the file `src` (whose SHA-256 and size `a` gives) and record it
    /// as (`a.kind`, `a.id`) unless something is recorded already: what is
    /// recorded afterwards (`a`, or the earlier record, which wins).
    fn publish(&self, a: &Artifact, src: &Path) -> Result<Artifact, SharedError>;
    /// The cluster-wide lock of (`kind`, `id`), waiting for it (another node
    /// building it holds it until it has published or failed).
    fn lock(&self, kind: ArtifactKind, id: &str) -> Result<BuildLock, SharedError>;
    /// Every named template's record: (catalog key, the catalog's record as JSON).
    fn template_records(&self) -> Result<Vec<(String, String)>, SharedError>;
    /// Record the named template `key`: over an existing record if `replace`,
    /// else only if it has none (false: it has one; nothing changed).
    fn put_template_record(&self, key: &str, record: &str, replace: bool) -> Result<bool, SharedError>;
    /// Forget the named template `key`.
    fn delete_template_record(&self, key: &str) -> Result<(), SharedError>;
}

/// What this node did with shared artifacts (tests, bench, logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedStats {
    /// Templates booted and snapshotted here.
    pub templates_built: u64,
    /// Templates downloaded (absent here, or a local copy that differed).
    pub templates_fetched: u64,
    pub templates_published: u64,
    /// Images built here with apt.
    pub images_built: u64,
    pub images_fetched: u64,
    pub images_published: u64,
    pub packages_fetched: u64,
    pub packages_published: u64,
    /// Local copies replaced by the published ones (they differed).
    pub replaced: u64,
    pub uploaded_bytes: u64,
    pub downloaded_bytes: u64,
}

#[derive(Default)]
struct Counters {
    templates_built: AtomicU64,
    templates_fetched: AtomicU64,
    templates_published: AtomicU64,
    images_built: AtomicU64,
    images_fetched: AtomicU64,
    images_published: AtomicU64,
    packages_fetched: AtomicU64,
    packages_published: AtomicU64,
    replaced: AtomicU64,
    uploaded_bytes: AtomicU64,
    downloaded_bytes: AtomicU64,
}

/// A data directory's side of the shared artifacts: where each kind lives
/// locally, and how a local copy is made the published one.
pub struct Shared {
    pub(crate) sh: Arc<dyn SharedArtifacts>,
    home: PathBuf,
    counters: Counters,
    /// One operation per artifact at a time in this process.
    local: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    seq: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("home", &self.home).finish_non_exhaustive()
    }
}

impl Shared {
    /// `f(self)` on a thread no seccomp filter applies to (see [`unfiltered`]).
    pub(crate) fn off<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Shared) -> Result<T, SharedError> + Send + 'static,
    ) -> Result<T, SharedError> {
        let me = self.clone();
        unfiltered(move || f(&me))
    }
}

/// Run `f` on a thread no seccomp filter applies to (an exec thread's filter
/// allows neither sockets nor `mkdir`), waiting for it; inline elsewhere.
pub(crate) fn unfiltered<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SharedError> + Send + 'static,
) -> Result<T, SharedError> {
    if !forkbox_engine::jail::is_filtered() {
        return f();
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    forkbox_engine::jail::spawn_unjailed("forkbox-shared".into(), move || {
        let _ = tx.send(f());
    })
    .map_err(|e| SharedError::Failed(format!("starting a thread: {e}")))?;
    rx.recv().map_err(|_| SharedError::Failed("the shared-artifacts thread stopped".into()))?
}

/// SHA-256 (hex) and size of a file.
fn hash_file(path: &Path) -> Result<(String, u64), SharedError> {
    let mut f = std::fs::File::open(path).map_err(|e| failed("open", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| failed("read", path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

fn sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// What identifies a file's version without reading it: size and mtime.
fn stamp(md: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    format!("{} {}.{}", md.len(), md.mtime(), md.mtime_nsec())
}

/// SHA-256 and size of a large, never-modified file (an image, a layer),
/// cached beside it in `<file>.sha256` with its size and mtime. None: no file.
pub fn file_sha256(path: &Path) -> Result<Option<(String, u64)>, SharedError> {
    let md = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(failed("stat", path, e)),
    };
    let side = sidecar(path);
    if let Ok(text) = std::fs::read_to_string(&side) {
        if let Some((sha, st)) = text.trim_end().split_once(' ') {
            if st == stamp(&md) && sha.len() == 64 {
                return Ok(Some((sha.to_string(), md.len())));
            }
        }
    }
    let (sha, n) = hash_file(path)?;
    // Best effort: without it the file is hashed again next time.
    let _ = std::fs::write(&side, format!("{sha} {}\n", stamp(&md)));
    Ok(Some((sha, n)))
}

fn remember_sha(path: &Path, sha: &str) {
    if let Ok(md) = std::fs::metadata(path) {
        let _ = std::fs::write(sidecar(path), format!("{sha} {}\n", stamp(&md)));
    }
}

impl Shared {
    pub fn new(sh: Arc<dyn SharedArtifacts>, home: &Path) -> Shared {
        let s = Shared {
            sh,
            home: home.to_path_buf(),
            counters: Counters::default(),
            local: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(0),
        };
        s.sweep();
        s
    }

    /// The implementation behind it.
    pub fn artifacts(&self) -> &Arc<dyn SharedArtifacts> {
        &self.sh
    }

    pub fn stats(&self) -> SharedStats {
        let c = &self.counters;
        SharedStats {
            templates_built: c.templates_built.load(Relaxed),
            templates_fetched: c.templates_fetched.load(Relaxed),
            templates_published: c.templates_published.load(Relaxed),
            images_built: c.images_built.load(Relaxed),
            images_fetched: c.images_fetched.load(Relaxed),
            images_published: c.images_published.load(Relaxed),
            packages_fetched: c.packages_fetched.load(Relaxed),
            packages_published: c.packages_published.load(Relaxed),
            replaced: c.replaced.load(Relaxed),
            uploaded_bytes: c.uploaded_bytes.load(Relaxed),
            downloaded_bytes: c.downloaded_bytes.load(Relaxed),
        }
    }

    pub(crate) fn built_template(&self) {
        self.counters.templates_built.fetch_add(1, Relaxed);
    }

    pub(crate) fn built_image(&self) {
        self.counters.images_built.fetch_add(1, Relaxed);
    }

    /// Where fetches and bundles are made (same file system as the data directory).
    fn scratch_dir(&self) -> PathBuf {
        self.home.join("tmp").join("shared")
    }

    /// A new scratch path (`what`, this process, a counter).
    fn scratch(&self, what: &str) -> Result<PathBuf, SharedError> {
        let dir = self.scratch_dir();
        std::fs::create_dir_all(&dir).map_err(|e| failed("create", &dir, e))?;
        let n = self.seq.fetch_add(1, Relaxed);
        Ok(dir.join(format!("{what}.{}.{n}", std::process::id())))
    }

    /// Remove what a killed process left in the scratch directory (entries
    /// of processes that are gone).
    fn sweep(&self) {
        let Ok(rd) = std::fs::read_dir(self.scratch_dir()) else { return };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.rsplit('.').nth(1).and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| p != std::process::id() && !Path::new(&format!("/proc/{p}")).exists()) {
                let p = e.path();
                let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            }
        }
    }

    /// The in-process lock of one artifact (held across a whole install or publish).
    pub(crate) fn local_lock(&self, kind: ArtifactKind, id: &str) -> Arc<Mutex<()>> {
        let mut m = self.local.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(format!("{}/{id}", kind.as_str())).or_default().clone()
    }

    pub(crate) fn lookup(&self, kind: ArtifactKind, id: &str) -> Result<Option<Artifact>, SharedError> {
        self.sh.lookup(kind, id)
    }

    /// Download `a` to a scratch file: its path (the caller moves or removes it).
    fn download(&self, a: &Artifact) -> Result<PathBuf, SharedError> {
        let tmp = self.scratch(&format!("get-{}-{}", a.kind.as_str(), a.id))?;
        if let Err(e) = self.sh.download(a, &tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        self.counters.downloaded_bytes.fetch_add(a.bytes, Relaxed);
        Ok(tmp)
    }

    fn publish(&self, a: &Artifact, src: &Path) -> Result<Artifact, SharedError> {
        let won = self.sh.publish(a, src)?;
        if won == *a {
            self.counters.uploaded_bytes.fetch_add(a.bytes, Relaxed);
            let c = match a.kind {
                ArtifactKind::Template => &self.counters.templates_published,
                ArtifactKind::Image => &self.counters.images_published,
                ArtifactKind::Package => &self.counters.packages_published,
            };
            c.fetch_add(1, Relaxed);
        }
        Ok(won)
    }

    // ------------------------------------------------------------------ images

    pub(crate) fn image_path(&self, id: &str) -> PathBuf {
        forkbox_image::image_path(&self.home, id)
    }

    /// Make the local image `a.id` the published one: downloaded unless the
    /// local file's SHA-256 is `a.sha256`. True if the file was (re)placed;
    /// the local templates made on a replaced image are removed (they are
    /// fetched or built again on the published one).
    pub(crate) fn install_image(&self, a: &Artifact) -> Result<bool, SharedError> {
        let l = self.local_lock(ArtifactKind::Image, &a.id);
        let _g = l.lock().unwrap_or_else(|e| e.into_inner());
        let dest = self.image_path(&a.id);
        let local = file_sha256(&dest)?;
        if local.as_ref().is_some_and(|(sha, _)| *sha == a.sha256) {
            return Ok(false);
        }
        let tmp = self.download(a)?;
        // Opened as an image before it is put in place: it must say it is `a.id`.
        let checked = forkbox_image::Image::open(&tmp)
            .map_err(|e| SharedError::corrupt(ArtifactKind::Image, &a.id, e.to_string()))
            .and_then(|img| {
                if img.id() == a.id {
                    Ok(())
                } else {
                    Err(SharedError::corrupt(ArtifactKind::Image, &a.id, format!("the file is image {}", img.id())))
                }
            });
        let placed = checked.and_then(|()| {
            if let Some(dir) = dest.parent() {
                std::fs::create_dir_all(dir).map_err(|e| failed("create", dir, e))?;
            }
            std::fs::rename(&tmp, &dest).map_err(|e| failed("rename", &dest, e))
        });
        if let Err(e) = placed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        remember_sha(&dest, &a.sha256);
        self.counters.images_fetched.fetch_add(1, Relaxed);
        if local.is_some() {
            self.counters.replaced.fetch_add(1, Relaxed);
            tracing::warn!(image = %a.id, "the local image differed from the cluster's: replaced by the published one");
            self.drop_templates_of(&a.id);
        }
        tracing::info!(image = %a.id, bytes = a.bytes, "image fetched from the shared bucket");
        Ok(true)
    }

    /// Remove the local templates made on image `image_id` (it was replaced).
    fn drop_templates_of(&self, image_id: &str) {
        for (dir, info) in forkbox_engine::template::list(&self.home) {
            if info.is_ok_and(|i| i.image_id == image_id) {
                tracing::warn!(template = %dir.display(), "removing a template made on a replaced image");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    /// Publish the local image `id` (built here) unless one is published:
    /// true if the published one is another (then installed here instead).
    pub(crate) fn publish_image(&self, id: &str) -> Result<bool, SharedError> {
        let path = self.image_path(id);
        let (sha, bytes) =
            file_sha256(&path)?.ok_or_else(|| SharedError::corrupt(ArtifactKind::Image, id, "not on this node"))?;
        let ours =
            Artifact { kind: ArtifactKind::Image, id: id.to_string(), sha256: sha, bytes, needs: None, digest: None };
        let won = self.publish(&ours, &path)?;
        if won.sha256 == ours.sha256 {
            return Ok(false);
        }
        self.install_image(&won)
    }

    // --------------------------------------------------------------- templates

    fn template_dir(&self, id: &str) -> PathBuf {
        templates_dir(&self.home).join(id)
    }

    /// SHA-256 of the local template's state file (None: not here).
    fn template_digest(&self, id: &str) -> Result<Option<String>, SharedError> {
        let state = self.template_dir(id).join(forkbox_snapshot::bundle::STATE_FILE);
        match std::fs::metadata(&state) {
            Ok(_) => Ok(Some(hash_file(&state)?.0)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(failed("stat", &state, e)),
        }
    }

    /// Make the local template `a.id` the published one: downloaded unless its
    /// state file's SHA-256 is `a.digest`. The bundle is unpacked into a
    /// scratch directory, verified (state, memory checksum, id), then renamed
    /// into place (a differing local copy is moved away first). True if it
    /// was (re)placed.
    pub(crate) fn install_template(&self, a: &Artifact) -> Result<bool, SharedError> {
        let l = self.local_lock(ArtifactKind::Template, &a.id);
        let _g = l.lock().unwrap_or_else(|e| e.into_inner());
        let local = self.template_digest(&a.id)?;
        if local.is_some() && local == a.digest {
            return Ok(false);
        }
        let bundle = self.download(a)?;
        let unpacked = self.scratch(&format!("template-{}", a.id));
        let r = unpacked.and_then(|dir| {
            let r = self.unpack_checked(a, &bundle, &dir).and_then(|()| self.put_in_place(&a.id, &dir));
            if r.is_err() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            r
        });
        let _ = std::fs::remove_file(&bundle);
        r?;
        self.counters.templates_fetched.fetch_add(1, Relaxed);
        if local.is_some() {
            self.counters.replaced.fetch_add(1, Relaxed);
            tracing::warn!(template = %a.id, "the local template differed from the cluster's: replaced by the published one");
        }
        tracing::info!(template = %a.id, bytes = a.bytes, "template fetched from the shared bucket");
        Ok(true)
    }

    /// Unpack `bundle` (the object of `a`) into the new directory `dir` and
    /// check it is template `a.id` as published: its state file's digest, the
    /// state decodes, the memory file matches the checksum the state records.
    fn unpack_checked(&self, a: &Artifact, bundle: &Path, dir: &Path) -> Result<(), SharedError> {
        let bad = |why: String| SharedError::corrupt(ArtifactKind::Template, &a.id, why);
        std::fs::create_dir_all(dir).map_err(|e| failed("create", dir, e))?;
        let info = forkbox_snapshot::bundle::unpack(bundle, dir).map_err(|e| bad(e.to_string()))?;
        if a.digest.as_ref().is_some_and(|d| *d != info.state_sha256) {
            return Err(bad("its state file is not the one published".into()));
        }
        let state = dir.join(forkbox_snapshot::bundle::STATE_FILE);
        let snap = forkbox_snapshot::read_state(&state).map_err(|e| bad(e.to_string()))?;
        forkbox_snapshot::MemoryFile::open(&dir.join(forkbox_snapshot::bundle::MEMORY_FILE), &snap.memory)
            .map_err(|e| bad(e.to_string()))?;
        let tinfo: forkbox_engine::TemplateInfo =
            serde_json::from_str(&snap.info).map_err(|e| bad(format!("template info: {e}")))?;
        if tinfo.id != a.id || a.needs.as_ref().is_some_and(|n| *n != tinfo.image_id) {
            return Err(bad(format!("the bundle is template {} of image {}", tinfo.id, tinfo.image_id)));
        }
        Ok(())
    }

    /// Rename the verified directory `dir` to `templates/<id>`, moving a local
    /// copy away first (and removing it after).
    fn put_in_place(&self, id: &str, dir: &Path) -> Result<(), SharedError> {
        let dest = self.template_dir(id);
        std::fs::create_dir_all(templates_dir(&self.home)).map_err(|e| failed("create", &dest, e))?;
        let old = if dest.exists() {
            let old = self.scratch(&format!("old-template-{id}"))?;
            std::fs::rename(&dest, &old).map_err(|e| failed("rename", &dest, e))?;
            Some(old)
        } else {
            None
        };
        if let Err(e) = std::fs::rename(dir, &dest) {
            if let Some(old) = &old {
                let _ = std::fs::rename(old, &dest);
            }
            return Err(failed("rename", &dest, e));
        }
        if let Some(old) = old {
            let _ = std::fs::remove_dir_all(old);
        }
        Ok(())
    }

    /// Publish the local template `id` (made on image `image_id`, which must be
    /// published as the local one) and the package layers its state mounts,
    /// unless it is published already. True if the published template is
    /// another (then installed here instead of the local one: open it again).
    pub(crate) fn publish_template(&self, id: &str, image_id: &str) -> Result<bool, SharedError> {
        let dir = self.template_dir(id);
        let snap = forkbox_snapshot::read_state(&dir.join(forkbox_snapshot::bundle::STATE_FILE))
            .map_err(|e| SharedError::corrupt(ArtifactKind::Template, id, e.to_string()))?;
        let store = forkbox_image::packages::PackageStore::new(&self.home);
        for layer in snap.process.vfs.layer_ids() {
            let path = store
                .layer_path(&layer)
                .ok_or_else(|| SharedError::corrupt(ArtifactKind::Package, &layer, "not a package layer id"))?;
            self.publish_layer(&layer, &path)?;
        }
        drop(snap);
        match (self.lookup(ArtifactKind::Image, image_id)?, file_sha256(&self.image_path(image_id))?) {
            (Some(img), Some((sha, _))) if img.sha256 == sha => {}
            (Some(_), _) => {
                return Err(SharedError::corrupt(
                    ArtifactKind::Template,
                    id,
                    format!("it was made on a local image {image_id} that is not the cluster's"),
                ))
            }
            (None, _) => {
                if self.publish_image(image_id)? {
                    return Err(SharedError::corrupt(
                        ArtifactKind::Template,
                        id,
                        format!("it was made on a local image {image_id} that is not the cluster's"),
                    ));
                }
            }
        }
        let bundle = self.scratch(&format!("put-template-{id}"))?;
        let r = (|| {
            let info = forkbox_snapshot::bundle::pack(&dir, &bundle)
                .map_err(|e| SharedError::corrupt(ArtifactKind::Template, id, e.to_string()))?;
            let ours = Artifact {
                kind: ArtifactKind::Template,
                id: id.to_string(),
                sha256: info.sha256,
                bytes: info.bytes,
                needs: Some(image_id.to_string()),
                digest: Some(info.state_sha256),
            };
            tracing::info!(
                template = %id,
                bytes = info.bytes,
                pages = info.pages,
                memory_size = info.memory_size,
                "publishing the template (bundle: state + data pages only)"
            );
            self.publish(&ours, &bundle)
        })();
        let _ = std::fs::remove_file(&bundle);
        let won = r?;
        if won.digest == self.template_digest(id)? {
            return Ok(false);
        }
        self.install_template(&won)?;
        Ok(true)
    }

    // ---------------------------------------------------------- package layers

    /// Publish the package layer `id` at `path` unless it is published; one
    /// published with other bytes (another forkbox's packer?) is an error:
    /// sessions here would refer to inodes of the local one.
    pub(crate) fn publish_layer(&self, id: &str, path: &Path) -> Result<(), SharedError> {
        let (sha, bytes) = file_sha256(path)?
            .ok_or_else(|| SharedError::corrupt(ArtifactKind::Package, id, "the layer is not on this node"))?;
        let differs = |theirs: &Artifact| {
            SharedError::corrupt(
                ArtifactKind::Package,
                id,
                format!(
                    "this node's layer (sha256 {sha}) is not the one the cluster has ({}): another forkbox version?",
                    theirs.sha256
                ),
            )
        };
        match self.lookup(ArtifactKind::Package, id)? {
            Some(a) if a.sha256 == sha => return Ok(()),
            Some(a) => return Err(differs(&a)),
            None => {}
        }
        let ours = Artifact {
            kind: ArtifactKind::Package,
            id: id.to_string(),
            sha256: sha.clone(),
            bytes,
            needs: None,
            digest: None,
        };
        let won = self.publish(&ours, path)?;
        if won.sha256 != ours.sha256 {
            return Err(differs(&won));
        }
        Ok(())
    }

    /// Fetch the published package layer `id` to `path` (absent here). False if none is published.
    pub(crate) fn install_layer(&self, id: &str, path: &Path) -> Result<bool, SharedError> {
        let l = self.local_lock(ArtifactKind::Package, id);
        let _g = l.lock().unwrap_or_else(|e| e.into_inner());
        if path.exists() {
            return Ok(true);
        }
        let Some(a) = self.lookup(ArtifactKind::Package, id)? else { return Ok(false) };
        let tmp = self.download(&a)?;
        let placed = forkbox_image::Image::open(&tmp)
            .map_err(|e| SharedError::corrupt(ArtifactKind::Package, id, e.to_string()))
            .and_then(|img| {
                if img.id() != id {
                    return Err(SharedError::corrupt(ArtifactKind::Package, id, "the file is another layer"));
                }
                let dir = path.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(dir).map_err(|e| failed("create", dir, e))?;
                std::fs::rename(&tmp, path).map_err(|e| failed("rename", path, e))
            });
        if let Err(e) = placed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        remember_sha(path, &a.sha256);
        self.counters.packages_fetched.fetch_add(1, Relaxed);
        tracing::info!(layer = %id, bytes = a.bytes, "package layer fetched from the shared bucket");
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_errors_have_codes() {
        for k in [ArtifactKind::Template, ArtifactKind::Image, ArtifactKind::Package] {
            assert_eq!(ArtifactKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(ArtifactKind::parse("x"), None);
        assert_eq!(SharedError::Unavailable("down".into()).error_code(), ErrorCode::StorageUnavailable);
        assert_eq!(SharedError::corrupt(ArtifactKind::Image, "x", "bad").error_code(), ErrorCode::StorageError);
    }

    #[test]
    fn file_hashes_are_cached_beside_the_file_and_noticed_stale() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.img");
        std::fs::write(&p, b"one").unwrap();
        let (a, n) = file_sha256(&p).unwrap().unwrap();
        assert_eq!((a.as_str(), n), ("7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add73ff431ed", 3));
        assert!(sidecar(&p).exists());
        // Another file of another size in its place: hashed again.
        std::fs::write(&p, b"other").unwrap();
        assert_ne!(file_sha256(&p).unwrap().unwrap().0, a);
        assert!(file_sha256(&d.path().join("none")).unwrap().is_none());
    }
}
