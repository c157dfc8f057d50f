//! The harness of forkbox's KVM tests (a dev-dependency only): "engine +
//! image, fail loudly without /dev/kvm", written once.
//!
//! Place in the flow: beside it; it builds the bottom layers (image, engine,
//! template) and, for the tests of the layers above, a runtime over them.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped. One engine and one template per test binary
//! ([`shared`]); [`fresh_home`] gives a test its own data directory whose
//! `templates` is a symlink to the shared home's, so no template is rebuilt.

pub mod guest;
pub mod postgres;
pub mod s3;
pub mod syscall_fuzz;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use forkbox_engine::{Engine, Template};
use forkbox_runtime::{Runtime, RuntimeConfig};

/// The shared data directory: `$FORKBOX_HOME`, else the default home.
pub fn home() -> PathBuf {
    match std::env::var("FORKBOX_HOME") {
        Ok(h) if !h.is_empty() => PathBuf::from(h),
        _ => forkbox_image::default_home(),
    }
}

/// Panic (never skip) unless /dev/kvm opens read-write.
#[track_caller]
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        panic!(
            "these tests need KVM: cannot open /dev/kvm read-write ({e}). \
             Run them on a host with KVM enabled and access to /dev/kvm (e.g. membership in the `kvm` group). \
             They are deliberately not skipped."
        );
    }
}

/// Raise the soft open-files limit to the hard one (tests that open many VMs and sessions).
pub fn raise_fd_limit() {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

/// KVM checked, then the default image under [`home`] (built if missing); its path.
pub fn image_path() -> PathBuf {
    require_kvm();
    let home = home();
    let t0 = Instant::now();
    let built = forkbox_image::build(
        &forkbox_engine::default_image_spec(),
        &forkbox_image::BuildOptions { home: home.clone(), progress: false, report: None },
    )
    .unwrap_or_else(|e| panic!("building the default image under {}: {e}", home.display()));
    eprintln!(
        "image {} ({}) ready in {:.1} s",
        built.path.display(),
        if built.reused { "reused" } else { "built" },
        t0.elapsed().as_secs_f64()
    );
    built.path
}

/// One engine and template for the whole test binary.
pub struct Shared {
    pub engine: Arc<Engine>,
    pub template: Arc<Template>,
    pub image_path: PathBuf,
    /// Where the image and template live.
    pub home: PathBuf,
}

/// KVM checked, fd limit raised, the default image, an engine over it and the
/// template under [`home`] (made if missing); once per test binary.
pub fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let image_path = image_path();
        raise_fd_limit();
        let home = home();
        let engine = Arc::new(
            Engine::open(&image_path).unwrap_or_else(|e| panic!("Engine::open({}): {e}", image_path.display())),
        );
        let t0 = Instant::now();
        let template = Arc::new(
            Template::ensure(&engine, &home)
                .unwrap_or_else(|e| panic!("Template::ensure under {}: {e}", home.display())),
        );
        eprintln!("template {} ready in {:.2} s", template.info.id, t0.elapsed().as_secs_f64());
        Shared { engine, template, image_path, home }
    })
}

/// A fresh temporary data directory whose `templates` links to the shared home's.
pub fn fresh_home(prefix: &str) -> tempfile::TempDir {
    let s = shared();
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().expect("temp dir");
    link_templates(dir.path(), &s.home);
    dir
}

/// A new data directory for a node of a test cluster (nodes that
/// share templates through a database and a bucket): the shared home's apt
/// resolutions, so that its default image has the shared home's id, and with
/// `with_image` that image file too (hard-linked: as a node that built it
/// earlier has it). No templates: a node builds or fetches its own.
pub fn node_home(prefix: &str, with_image: bool) -> tempfile::TempDir {
    let image = image_path();
    let home = tempfile::Builder::new().prefix(prefix).tempdir().expect("temp dir");
    let to = home.path().join("cache").join("apt");
    std::fs::create_dir_all(&to).expect("cache/apt");
    let from = self::home().join("cache").join("apt");
    for e in std::fs::read_dir(&from).unwrap_or_else(|e| panic!("{}: {e}", from.display())).flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("resolved-") && name.ends_with(".txt") {
            std::fs::copy(e.path(), to.join(&name)).expect("copying an apt resolution");
        }
    }
    if with_image {
        let images = home.path().join("images");
        std::fs::create_dir_all(&images).expect("images");
        let dest = images.join(image.file_name().expect("image file name"));
        if std::fs::hard_link(&image, &dest).is_err() {
            std::fs::copy(&image, &dest).expect("copying the image");
        }
    }
    home
}

/// `home/templates` -> the shared home's templates (so the CLI and runtimes on `home` reuse them).
pub fn link_templates(home: &Path, shared_home: &Path) {
    std::os::unix::fs::symlink(forkbox_engine::template::templates_dir(shared_home), home.join("templates"))
        .expect("symlink templates");
}

/// A runtime on `home` over the shared engine and template. Blocking.
pub fn runtime(home: &Path, config: RuntimeConfig) -> Arc<Runtime> {
    let s = shared();
    Runtime::with_engine(s.engine.clone(), s.template.clone(), home, config)
        .unwrap_or_else(|e| panic!("opening a runtime on {}: {e}", home.display()))
}
