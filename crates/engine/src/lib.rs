//! The forkbox engine: boots the guest (CPython + the agent) from an image in a
//! kernel-less KVM VM and runs code in it.
//!
//! Place in the flow request -> runtime -> sessions -> catalog -> **engine** -> vmm/linux -> guest:
//! templates, forks and sandboxes over forkbox-vmm, forkbox-linux, forkbox-image
//! and forkbox-snapshot; its errors name their API code (`forkbox-api`). It
//! knows nothing of sessions, of who calls it, or of HTTP.

#![forbid(unsafe_code)]

pub mod error;
pub mod file_ops;
pub mod files;
mod fsstore;
pub mod hint;
pub mod interrupt;
pub mod jail;
mod jobs;
pub mod limits;
pub mod packages;
pub mod pool;
pub mod protocol;
pub mod sandbox;
mod sched;
mod signal;
pub mod template;
mod vdso;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use forkbox_image::{ExtraFile, Image, ImageSpec};
use forkbox_linux::vfs::Vfs;
use forkbox_vmm::Cpu;

pub use error::EngineError;
pub use file_ops::{EntryInfo, EntryKind, FileOp, FileOpOutcome};
pub use files::{FileEntry, OutputFile};
/// Secrets substituted at the egress boundary (sealing, placeholders).
pub use forkbox_linux::net::secrets as net_secrets;
pub use forkbox_linux::net::tls as net_tls;
pub use forkbox_linux::net::{
    GlobalNetStats, Mode as NetMode, NetConfig, NetStats, Policy as NetPolicy, Rule as NetRule, GLOBAL as NET_GLOBAL,
};
/// Host entropy (getrandom(2)), for ids and secrets made above the engine.
pub use forkbox_linux::random::{fill_random, random_hex};
pub use forkbox_linux::vfs::{Change, ChangeKind, Changes};
pub use forkbox_vmm::thread_cpu_seconds;
pub use interrupt::Interrupter;
pub use jobs::{JobChunk, JobInfo};
pub use limits::Limits;
pub use protocol::{MimeBundle, PyError};
pub use sandbox::{
    BackgroundRun, CapturedOutput, ExecOptions, ExecResult, ListeningPort, RunStats, Sandbox, Stream, Usage,
};
pub use template::{CheckpointFiles, CheckpointSize, CheckpointStats, ResumeAs, Template, TemplateInfo};

/// The agent program, baked into every image.
pub const AGENT_SOURCE: &[u8] = include_bytes!("../../../guest/agent/agent.py");

/// The default image: Debian's python3 + numpy (reference BLAS) and the agent.
pub fn default_image_spec() -> ImageSpec {
    with_agent(ImageSpec::python_numpy())
}

/// Add the agent to an image spec (every forkbox image needs it), and the
/// resolver configuration that points the guest at the VMM's resolver.
pub fn with_agent(mut spec: ImageSpec) -> ImageSpec {
    spec.extra_files.push(ExtraFile {
        guest_path: sandbox::AGENT_PATH.into(),
        data: AGENT_SOURCE.to_vec(),
        perm: 0o644,
    });
    use forkbox_linux::net;
    for (path, data) in [
        ("/etc/resolv.conf", net::RESOLV_CONF),
        ("/etc/hosts", net::ETC_HOSTS),
        ("/etc/nsswitch.conf", net::NSSWITCH_CONF),
    ] {
        if !spec.extra_files.iter().any(|f| f.guest_path == path) {
            spec.extra_files.push(ExtraFile { guest_path: path.into(), data: data.to_vec(), perm: 0o644 });
        }
    }
    spec
}

/// Process-wide state shared by all sandboxes of one image.
pub struct Engine {
    pub cpu: Arc<Cpu>,
    pub image: Arc<Image>,
    pub image_path: PathBuf,
    /// The image's file system before any guest wrote to it (cloned per sandbox).
    pub vfs: Vfs,
    pub hwcap: u64,
    pub vdso: Option<&'static [u8]>,
    /// Code the agent runs before it reports ready (the template's warm state).
    pub preload: String,
    /// Where package layers come from (run-time installs; restoring a state that
    /// mounts them): set once, by `with_packages` or by the first catalog the
    /// engine is inserted into (one per process outside tests).
    pub packages: std::sync::OnceLock<Arc<forkbox_image::packages::PackageStore>>,
    /// In a cluster: where a package layer a state mounts and this node lacks
    /// is fetched from (the template catalog hands its shared artifacts in).
    layers: std::sync::OnceLock<Arc<dyn LayerSource>>,
}

/// Where a package layer a restored state mounts comes from when this node
/// lacks it (a cluster's shared artifacts; implemented above the engine).
pub trait LayerSource: Send + Sync {
    /// Put layer `id` at `path` (its place in the package store): false if
    /// no one has published it. A failure of the source is an
    /// [`EngineError::Storage`].
    fn fetch_layer(&self, id: &str, path: &Path) -> Result<bool, EngineError>;
}

impl Engine {
    pub fn open(image_path: &Path) -> Result<Engine, EngineError> {
        Engine::open_with_cpu(Arc::new(Cpu::new()?), image_path)
    }

    /// `open` with a shared `Cpu` (many images in one process).
    pub fn open_with_cpu(cpu: Arc<Cpu>, image_path: &Path) -> Result<Engine, EngineError> {
        let image = Arc::new(Image::open(image_path)?);
        let vfs = Vfs::new(image.clone());
        let hwcap = std::arch::x86_64::__cpuid(1).edx as u64;
        Ok(Engine {
            cpu,
            image,
            image_path: image_path.to_path_buf(),
            vfs,
            hwcap,
            vdso: Some(forkbox_vmm::vdso::IMAGE),
            preload: "import numpy".into(),
            packages: std::sync::OnceLock::new(),
            layers: std::sync::OnceLock::new(),
        })
    }

    /// Use `cpu` (e.g. a CPUID with fewer features) instead of the host's default.
    pub fn with_cpu(mut self, cpu: Cpu) -> Engine {
        self.cpu = Arc::new(cpu);
        self
    }

    pub fn without_vdso(mut self) -> Engine {
        self.vdso = None;
        self
    }

    pub fn with_preload(mut self, preload: impl Into<String>) -> Engine {
        self.preload = preload.into();
        self
    }

    pub fn with_packages(self, store: Arc<forkbox_image::packages::PackageStore>) -> Engine {
        let _ = self.packages.set(store);
        self
    }

    /// Fetch missing package layers from `source` (a cluster's shared artifacts;
    /// None: not in a cluster).
    pub fn with_layer_source(self, source: Option<Arc<dyn LayerSource>>) -> Engine {
        if let Some(s) = source {
            self.set_layer_source(s);
        }
        self
    }

    /// [`Self::with_layer_source`] on an engine in use (the first source set stays).
    pub fn set_layer_source(&self, source: Arc<dyn LayerSource>) {
        let _ = self.layers.set(source);
    }

    /// A process from a saved state, with the package layers its files refer
    /// to (in a cluster, a layer this node lacks is fetched first).
    pub fn restore_process(
        &self,
        s: forkbox_linux::process::ProcessState,
    ) -> Result<forkbox_linux::Process, EngineError> {
        self.restore_process_sharing(s, &[])
    }

    /// [`Self::restore_process`] for the agent's process of a checkpoint whose
    /// other processes hold the descriptors `others` (see
    /// `Process::restore_state_sharing`).
    pub(crate) fn restore_process_sharing(
        &self,
        s: forkbox_linux::process::ProcessState,
        others: &[&forkbox_linux::fd::FdTable],
    ) -> Result<forkbox_linux::Process, EngineError> {
        use forkbox_snapshot::StateError;
        let mut layers = forkbox_linux::vfs::Layers::new();
        for id in s.vfs.layer_ids() {
            let store = self
                .packages
                .get()
                .ok_or_else(|| StateError::Corrupt(format!("package layer {id} is needed and this server has none")))?;
            let l = match store.open_layer(&id) {
                Ok(l) => l,
                Err(forkbox_image::packages::PackageError::MissingLayer(_)) if self.layers.get().is_some() => {
                    let (Some(source), Some(path)) = (self.layers.get(), store.layer_path(&id)) else {
                        return Err(StateError::Corrupt(format!("package layer {id} is not a layer id")).into());
                    };
                    if !source.fetch_layer(&id, &path)? {
                        return Err(StateError::Corrupt(format!(
                            "package layer {id} is needed, not on this node and not published by another"
                        ))
                        .into());
                    }
                    store.open_layer(&id).map_err(|e| StateError::Corrupt(e.to_string()))?
                }
                Err(e) => return Err(StateError::Corrupt(e.to_string()).into()),
            };
            layers.insert(id, l);
        }
        forkbox_linux::Process::restore_state_sharing(self.image.clone(), s, &layers, others)
            .map_err(|e| StateError::Corrupt(e.to_string()).into())
    }

    pub fn boot(&self, limits: Limits) -> Result<Sandbox, EngineError> {
        Sandbox::boot(self, limits, false)
    }
}
