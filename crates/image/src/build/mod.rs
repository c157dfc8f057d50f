//! `forkbox image build`: Debian packages -> root tree -> image file.
//!
//! Steps: resolve the package closure with apt (empty dpkg status) -> derive the image id
//! from the recipe (reuse `<home>/images/<id>.img` if present, no downloads) -> fetch the
//! .debs into `<home>/cache/debs` (kept for re-use, sha256-checked) -> `dpkg-deb -R` each
//! into a temp tree (no maintainer scripts) -> merged /usr -> alternatives symlinks from
//! the postinsts (libblas.so.3, liblapack.so.3) -> trim -> precompile .pyc -> base dirs and
//! extra files -> ld.so.cache -> check every DT_NEEDED resolves -> pack (mtimes clamped to
//! the newest packaged file, so the same inputs give the same bytes).

mod apt;
mod cmd;
pub mod confine;
mod elf;
pub mod packages;
mod pyc;
mod recipe;
mod tree;
pub mod wheels;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

pub use apt::{parse_print_uris, DebRef};
pub use recipe::{
    recipe_id, recipe_id_with_wheels, Blas, ExtraFile, ImageSpec, BASE_PACKAGES, CPYTHON_TESTSUITE, DATA_PACKAGES,
    DEFAULT_OMIT, RECIPE_VERSION, TRIM_RULES, USERLAND_PACKAGES,
};
pub use tree::TreeStats;
pub use wheels::{PipSource, WheelRef};

use crate::{pack_dir_with, Image, ImageError, PackOptions};

/// Where and how to build.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    /// Data directory: images in `<home>/images`, caches in `<home>/cache`.
    pub home: PathBuf,
    /// Show progress bars on stderr.
    pub progress: bool,
    /// Told each step of a build and, where known, the fraction of it done (a server's
    /// `GET /v1/templates/{name}`).
    pub report: Option<Report>,
}

/// A build's progress callback: (step, fraction of the step done if known).
#[derive(Clone)]
pub struct Report(pub std::sync::Arc<dyn Fn(&'static str, Option<f64>) + Send + Sync>);

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Report")
    }
}

impl BuildOptions {
    fn report(&self, step: &'static str, fraction: Option<f64>) {
        if let Some(r) = &self.report {
            (r.0)(step, fraction.map(|f| f.clamp(0.0, 1.0)));
        }
    }
}

/// Figures from a build that actually ran (not from a reuse).
#[derive(Clone, Debug, Default)]
pub struct BuildStats {
    pub packages: usize,
    pub downloaded_bytes: u64,
    pub unpacked: TreeStats,
    pub trimmed: TreeStats,
    /// Tree as packed (after .pyc, extra files, ...).
    pub final_tree: TreeStats,
    pub pyc_files: u64,
    pub image_bytes: u64,
    pub alternatives: Vec<(String, String)>,
    /// Wheels unpacked (file names).
    pub wheels: Vec<String>,
    /// Certificates in /etc/ssl/certs/ca-certificates.crt.
    pub ca_certificates: usize,
    pub libraries: Vec<String>,
    /// Wall time per step, in order.
    pub steps: Vec<(&'static str, Duration)>,
    pub elapsed: Duration,
}

impl BuildStats {
    fn step(&mut self, name: &'static str, since: &mut Instant) {
        let d = since.elapsed();
        tracing::debug!(step = name, elapsed = ?d, "step done");
        self.steps.push((name, d));
        *since = Instant::now();
    }
}

/// The result of `build`.
#[derive(Clone, Debug)]
pub struct BuiltImage {
    pub path: PathBuf,
    /// The recipe hash (also what `Image::id()` returns for this file).
    pub id: String,
    /// True if an existing image with this id was returned without building.
    pub reused: bool,
    /// Resolved packages (file names), sorted.
    pub packages: Vec<String>,
    /// Present when the image was built now.
    pub stats: Option<BuildStats>,
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{step}: `{command}` exited with {status}: {stderr_tail}")]
    Command { step: &'static str, command: String, status: String, stderr_tail: String },
    #[error("{step}: cannot run `{command}`: {source}")]
    Spawn { step: &'static str, command: String, source: std::io::Error },
    #[error("resolve: apt-get has no candidate for some package; run `apt-get update` first ({detail})")]
    AptNoCandidate { detail: String },
    #[error("{step}: {path}: {source}")]
    Io { step: &'static str, path: PathBuf, source: std::io::Error },
    #[error("download: {file} has sha256 {actual}, apt said {expected}")]
    Checksum { file: PathBuf, expected: String, actual: String },
    #[error("link check: unresolved shared libraries: {0}")]
    MissingLibraries(String),
    #[error("precompile: host python {host} does not match the guest's python {guest} (need /usr/bin/python{guest})")]
    PythonVersion { host: String, guest: String },
    #[error("{step}: {msg}")]
    Invalid { step: &'static str, msg: String },
    /// pip found no binary wheel for `spec` (only an sdist, or no such package or version).
    #[error(
        "pip: no binary wheel of {spec} for CPython 3.11 manylinux x86-64 (only an sdist, or no such package or \
         version; packages are never built from source)"
    )]
    NoWheel { spec: String },
    #[error("pack: {0}")]
    Image(#[from] ImageError),
}

impl BuildError {
    pub(crate) fn io(step: &'static str, path: &Path, source: std::io::Error) -> BuildError {
        BuildError::Io { step, path: path.to_path_buf(), source }
    }
}

/// `$FORKBOX_HOME`, else the user data dir (`~/.local/share/forkbox` on Linux).
pub fn default_home() -> PathBuf {
    if let Some(h) = std::env::var_os("FORKBOX_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    dirs::data_dir()
        .or_else(|| dirs::home_dir().map(|h| h.join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."))
        .join("forkbox")
}

/// Where `build` puts the image with this id.
pub fn image_path(home: &Path, id: &str) -> PathBuf {
    home.join("images").join(format!("{id}.img"))
}

/// What a person sees of one build step on stderr: a bar or spinner on a
/// terminal, plain lines otherwise (a log, CI, `serve` under a supervisor), so
/// a long first build never runs in silence.
enum Progress {
    Hidden,
    Bar(ProgressBar),
    Lines { msg: &'static str, started: Instant, total: u64, pos: u64, next_pct: u64 },
}

impl Progress {
    fn lines(msg: &'static str, total: u64) -> Progress {
        eprintln!("forkbox: {msg} ...");
        Progress::Lines { msg, started: Instant::now(), total, pos: 0, next_pct: 25 }
    }

    fn set_length(&mut self, len: u64) {
        match self {
            Progress::Bar(pb) => pb.set_length(len),
            Progress::Lines { total, .. } => *total = len,
            Progress::Hidden => {}
        }
    }

    /// Position `done` of the length; lines: one at each quarter.
    fn set_position(&mut self, done: u64) {
        match self {
            Progress::Bar(pb) => pb.set_position(done),
            Progress::Lines { msg, total, pos, next_pct, .. } => {
                *pos = done;
                let pct = done.saturating_mul(100).checked_div(*total).unwrap_or(100);
                if pct >= *next_pct && pct < 100 {
                    eprintln!("forkbox: {msg} {pct}%");
                    *next_pct = (pct / 25 + 1) * 25;
                }
            }
            Progress::Hidden => {}
        }
    }

    fn inc(&mut self, n: u64) {
        let pos = match self {
            Progress::Bar(pb) => return pb.inc(n),
            Progress::Lines { pos, .. } => pos.saturating_add(n),
            Progress::Hidden => return,
        };
        self.set_position(pos);
    }

    fn finish(&self) {
        match self {
            Progress::Bar(pb) => pb.finish_and_clear(),
            Progress::Lines { msg, started, .. } => {
                eprintln!("forkbox: {msg} done ({:.1} s)", started.elapsed().as_secs_f64())
            }
            Progress::Hidden => {}
        }
    }
}

const RESOLVING: &str = "resolving packages";

fn bar(show: bool, len: u64, template: &str, msg: &'static str) -> Progress {
    if !show {
        return Progress::Hidden;
    }
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return Progress::lines(msg, len);
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg);
    Progress::Bar(pb)
}

fn spinner(show: bool, msg: &'static str) -> Progress {
    if !show {
        return Progress::Hidden;
    }
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        // Resolving runs on every open, built or not, and is quick: no lines for it.
        return if msg == RESOLVING { Progress::Hidden } else { Progress::lines(msg, 0) };
    }
    let pb = ProgressBar::new_spinner();
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(120));
    Progress::Bar(pb)
}

/// The BLAS packages that are not the reference one.
const OTHER_BLAS_PREFIXES: &[&str] = &["libopenblas", "libblis", "libatlas", "libmkl"];

/// The closure must hold what the BLAS choice asked for: reference BLAS alone (every
/// other BLAS is omitted for it, so one here came in by name), or OpenBLAS.
fn check_blas(spec: &ImageSpec, debs: &[DebRef]) -> Result<(), BuildError> {
    let has = |want: &str| debs.iter().any(|d| d.package == want);
    match spec.blas {
        Blas::Reference => {
            if let Some(d) = debs.iter().find(|d| OTHER_BLAS_PREFIXES.iter().any(|b| d.package.starts_with(b))) {
                return Err(BuildError::Invalid {
                    step: "resolve",
                    msg: format!("reference BLAS was asked for but {} is in the closure (asked for by name?); choose --blas openblas or --blas any", d.filename),
                });
            }
            if spec.packages.iter().any(|p| p == "python3-numpy") {
                for want in ["libblas3", "liblapack3"] {
                    if !has(want) {
                        return Err(BuildError::Invalid {
                            step: "resolve",
                            msg: format!("{want} (reference BLAS) not in the closure"),
                        });
                    }
                }
            }
        }
        Blas::OpenBlas => {
            if !debs.iter().any(|d| d.package.starts_with("libopenblas0")) {
                return Err(BuildError::Invalid {
                    step: "resolve",
                    msg: "OpenBLAS was asked for but is not in the closure".into(),
                });
            }
        }
        Blas::Any => {}
    }
    Ok(())
}

/// Check a spec without building it (package names, paths, pip specs and source).
pub fn check_spec(spec: &ImageSpec) -> Result<(), BuildError> {
    spec.validate()
}

/// The id of `spec`'s image if it is built already under `home` (resolves with apt,
/// from its cache when the package lists did not change; downloads nothing).
pub fn built_id(spec: &ImageSpec, home: &Path) -> Result<Option<String>, BuildError> {
    let id = resolve_id(spec, home)?;
    Ok(image_path(home, &id).exists().then_some(id))
}

/// The id `build` gives `spec`'s image, built or not: the package closure
/// resolved with apt (from its cache when the package lists did not change)
/// and pip's wheels fetched (downloads no .deb). A node of a cluster uses it
/// to look for a published image or template before it builds anything.
pub fn resolve_id(spec: &ImageSpec, home: &Path) -> Result<String, BuildError> {
    spec.validate()?;
    let cache = home.join("cache");
    fs::create_dir_all(&cache).map_err(|e| BuildError::io("setup", &cache, e))?;
    let _lock = lock_cache(&cache)?;
    let debs = apt::resolve(&spec.requested(), &spec.omitted(), &home.join("cache"))?;
    let wheels = if spec.pip.is_empty() {
        Vec::new()
    } else {
        wheels::fetch(&spec.pip, &spec.pip_source, &home.join("cache"), wheels::MAX_BUILD_WHEEL_BYTES)?
    };
    Ok(recipe_id_with_wheels(spec, &debs, &wheels))
}

/// Hold the build cache for this process until the returned file is dropped.
/// apt keeps a lock of its own in the cache and fails rather than waits when
/// another process holds it; and a second builder of the same recipe should
/// find the first one's image instead of building it again.
fn lock_cache(cache: &Path) -> Result<fs::File, BuildError> {
    let path = cache.join("build.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| BuildError::io("setup", &path, e))?;
    f.lock().map_err(|e| BuildError::io("lock", &path, e))?;
    Ok(f)
}

/// Build (or reuse) the image for `spec`. Needs root (dpkg-deb ownership, ldconfig -r),
/// apt-get with up-to-date package lists, and /usr/bin/python3.N matching the guest.
pub fn build(spec: &ImageSpec, opts: &BuildOptions) -> Result<BuiltImage, BuildError> {
    let started = Instant::now();
    spec.validate()?;
    let home = &opts.home;
    let cache = home.join("cache");
    let debs_dir = cache.join("debs");
    let images = home.join("images");
    let tmp_root = home.join("tmp");
    for d in [&cache, &debs_dir, &images, &tmp_root] {
        fs::create_dir_all(d).map_err(|e| BuildError::io("setup", d, e))?;
    }
    let _lock = lock_cache(&cache)?;

    let mut t = Instant::now();
    opts.report("resolving packages", None);
    let sp = spinner(opts.progress, RESOLVING);
    let requested = spec.requested();
    let omitted = spec.omitted();
    let debs = apt::resolve(&requested, &omitted, &cache);
    sp.finish();
    let debs = debs?;
    let resolve_time = t.elapsed();
    check_blas(spec, &debs)?;
    let wheels = if spec.pip.is_empty() {
        Vec::new()
    } else {
        let sp = spinner(opts.progress, "resolving pip wheels");
        let w = wheels::fetch(&spec.pip, &spec.pip_source, &cache, wheels::MAX_BUILD_WHEEL_BYTES);
        sp.finish();
        w?
    };
    let id = recipe_id_with_wheels(spec, &debs, &wheels);
    let mut names: Vec<String> =
        debs.iter().map(|d| d.filename.clone()).chain(wheels.iter().map(|w| w.filename.clone())).collect();
    names.sort();
    tracing::info!(packages = debs.len(), %id, "resolved");

    let out = image_path(home, &id);
    if out.exists() {
        match Image::open(&out) {
            Ok(img) if img.id() == id => {
                tracing::info!(path = %out.display(), "image already built");
                return Ok(BuiltImage { path: out, id, reused: true, packages: names, stats: None });
            }
            Ok(_) => tracing::warn!(path = %out.display(), "image has another id; rebuilding"),
            Err(e) => {
                tracing::warn!(path = %out.display(), error = %e, "existing image unusable; rebuilding")
            }
        }
    }

    let mut stats = BuildStats { packages: debs.len(), steps: vec![("resolve", resolve_time)], ..Default::default() };
    t = Instant::now();
    let total: u64 = debs.iter().map(|d| d.size).sum();
    let pb = std::sync::Mutex::new(bar(
        opts.progress,
        total,
        "{msg:12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}",
        "download",
    ));
    opts.report("downloading packages", Some(0.0));
    stats.downloaded_bytes = apt::download(&requested, &omitted, &debs, &cache, &debs_dir, &|done, total| {
        if total > 0 {
            opts.report("downloading packages", Some(done as f64 / total as f64));
        }
        if let Ok(mut pb) = pb.lock() {
            pb.set_length(total);
            pb.set_position(done);
        }
    })?;
    pb.lock().map(|pb| pb.finish()).ok();
    stats.step("download", &mut t);

    let work = tempfile::Builder::new()
        .prefix("build-")
        .tempdir_in(&tmp_root)
        .map_err(|e| BuildError::io("setup", &tmp_root, e))?;
    let root = work.path().join("root");
    fs::create_dir(&root).map_err(|e| BuildError::io("unpack", &root, e))?;
    fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| BuildError::io("unpack", &root, e))?;

    let pb = std::sync::Mutex::new(bar(opts.progress, debs.len() as u64, "{msg:12} [{bar:40}] {pos}/{len}", "unpack"));
    let jobs: Vec<(PathBuf, String)> = debs.iter().map(|d| (debs_dir.join(&d.filename), d.package.clone())).collect();
    opts.report("unpacking packages", Some(0.0));
    let unpacked = std::sync::atomic::AtomicUsize::new(0);
    let control = tree::unpack_all(&jobs, work.path(), &root, &|| {
        let n = unpacked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        opts.report("unpacking packages", Some(n as f64 / jobs.len().max(1) as f64));
        if let Ok(mut pb) = pb.lock() {
            pb.inc(1)
        }
    });
    pb.lock().map(|pb| pb.finish()).ok();
    let control = control?;
    stats.unpacked = tree::stats(&root)?;
    let epoch = stats.unpacked.max_mtime;
    tracing::info!(files = stats.unpacked.files, bytes = stats.unpacked.bytes, "unpacked");
    stats.step("unpack", &mut t);

    opts.report("shaping the file tree", None);
    let sp = spinner(opts.progress, "shaping tree");
    tree::usrmerge(&root)?;
    let removed = tree::trim(&root, &spec.trim_rules())?;
    stats.trimmed = tree::stats(&root)?;
    tracing::info!(removed, bytes = stats.trimmed.bytes, "trimmed");
    stats.alternatives = tree::apply_alternatives(&root, &control, spec.blas.preferred())?;
    sp.finish();
    stats.step("usrmerge+trim+alternatives", &mut t);

    if !wheels.is_empty() {
        let sp = spinner(opts.progress, "unpacking wheels");
        let r = wheels::install(&root, &wheels, &cache);
        sp.finish();
        r?;
        stats.wheels = wheels.iter().map(|w| w.filename.clone()).collect();
        stats.step("wheels", &mut t);
    }

    opts.report("compiling .pyc", None);
    let sp = spinner(opts.progress, "compiling .pyc");
    stats.pyc_files = pyc::compile(&root)?;
    sp.finish();
    stats.step("precompile", &mut t);

    tree::base_dirs(&root)?;
    tree::timezone(&root)?;
    stats.ca_certificates = tree::ca_bundle(&root)?;
    for f in &spec.extra_files {
        tree::add_file(&root, &f.guest_path, &f.data, f.perm)?;
    }
    tree::ldconfig(&root)?;
    stats.step("extra files+ldconfig", &mut t);
    let links = elf::check(&root)?;
    stats.libraries = links.libraries.into_iter().collect();
    tracing::info!(objects = links.objects, libraries = stats.libraries.len(), "all DT_NEEDED resolve");
    stats.final_tree = tree::stats(&root)?;
    stats.step("link check", &mut t);

    opts.report("packing the image", None);
    let sp = spinner(opts.progress, "packing");
    let packed = pack_dir_with(&root, &out, &PackOptions { id: Some(id.clone()), mtime_clamp: Some(epoch) });
    sp.finish();
    let packed = packed?;
    stats.image_bytes = packed.image_bytes;
    // Re-open what we wrote: the same validation every user of the image will do.
    let img = Image::open(&out)?;
    debug_assert_eq!(img.id(), id);
    stats.step("pack", &mut t);
    stats.elapsed = started.elapsed();
    tracing::info!(path = %out.display(), bytes = stats.image_bytes, inodes = img.inode_count(), elapsed = ?stats.elapsed, "image built");
    Ok(BuiltImage { path: out, id, reused: false, packages: names, stats: Some(stats) })
}
