//! The forkbox runtime: one data directory's engine, template and sessions,
//! the threads execs run on, the upkeep, and the typed operations every front
//! end (the HTTP server, the CLI and MCP in process) performs.
//!
//! Place in the flow: request (server / CLI / MCP) -> **runtime** -> sessions
//! -> engine -> vmm/linux -> guest. It depends on the sessions and the engine
//! (and on `forkbox-api` for error codes), never on a front end; the front
//! ends see the sessions only through it (no `Store`, no `SessionManager`).
//!
//! - [`Runtime::open`]: build the image if missing, open the engine, make or
//!   load the template, open the sessions (recovering what a killed process
//!   left), start the exec workers. [`Runtime::embedded`]: the same with the
//!   CLI's bounds plus the upkeep loop, for the CLI and `forkbox mcp` without
//!   a server. [`Runtime::with_engine`]: over an already-open engine (tests).
//! - Exec workers ([`workers`]): a fixed set of threads, one per exec slot, so
//!   the engine's per-thread VM recycling keeps forks warm. Every exec (one-shot,
//!   batch, session) runs there.
//! - One-shot execs ([`exec`]): fork timing and "reply before the sandbox is
//!   dropped" written once, for the plain and the streamed route; batches on
//!   the same workers; [`Outcome`] classifies any exec result.
//! - Sessions ([`session`]): views, checkpoints, files, quotas (the count and
//!   create under one lock), compaction.
//! - Upkeep ([`Runtime::start_maintenance`]): eviction, compaction, gc, off
//!   the request path.
//!
//! Operations that are not execs block (SQLite, files): call them off async threads.

#![forbid(unsafe_code)]

mod error;
pub mod exec;
pub mod session;
mod workers;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use forkbox_engine::{Engine, Template};
use forkbox_sessions::manager::SessionManager;

pub use error::RuntimeError;
pub use exec::{OneShot, OneShotRequest, Outcome, Output, Ran};
pub use forkbox_api::ErrorCode;
pub use forkbox_engine::{ExecResult, FileEntry, Limits, OutputFile, PyError, Stream};
pub use forkbox_sessions::manager::{Config as SessionsConfig, ExecOutcome};
pub use session::{CheckpointView, ForkedFrom, Quota, SessionView};
pub use workers::{job_cpu_seconds, thread_cpu_seconds};

/// What a runtime allows and how it runs.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Image file to use; `None`: the default image, built under the home if missing.
    pub image: Option<PathBuf>,
    /// Exec threads (= concurrent execs); 0: twice the available cores.
    pub concurrency: usize,
    /// Largest `code` (`code_too_large` above it).
    pub code_limit: usize,
    /// Most codes in one batch.
    pub max_batch: usize,
    /// Defaults for one-shot execs and new sessions (timeout, memory, output, disk).
    pub limits: Limits,
    /// Largest `timeout_seconds` a request may ask for.
    pub max_timeout: Duration,
    /// Largest `memory_mb` a session may ask for.
    pub max_memory_mb: u64,
    pub sessions: SessionsConfig,
    /// How often the upkeep runs (see [`Runtime::start_maintenance`]).
    pub maintenance_every: Duration,
}

impl Default for RuntimeConfig {
    /// A public server's bounds.
    fn default() -> Self {
        RuntimeConfig {
            image: None,
            concurrency: 0,
            code_limit: 1 << 20,
            max_batch: 64,
            limits: Limits::default(),
            max_timeout: Duration::from_secs(600),
            max_memory_mb: 4096,
            sessions: SessionsConfig::default(),
            maintenance_every: Duration::from_secs(5),
        }
    }
}

impl RuntimeConfig {
    /// The CLI's own bounds (it checks its flags itself), not a public server's.
    pub fn embedded() -> Self {
        RuntimeConfig { max_timeout: Duration::from_secs(86_400), max_memory_mb: 3072, ..RuntimeConfig::default() }
    }

    fn threads(&self) -> usize {
        if self.concurrency > 0 {
            return self.concurrency;
        }
        std::thread::available_parallelism().map_or(2, |n| n.get()) * 2
    }
}

/// One data directory, open.
pub struct Runtime {
    home: PathBuf,
    engine: Arc<Engine>,
    template: Arc<Template>,
    sessions: SessionManager,
    config: RuntimeConfig,
    concurrency: usize,
    workers: workers::ExecWorkers,
    /// Held while a session is counted against its quota and created.
    create_lock: Mutex<()>,
    /// The upkeep thread: dropping the sender stops it.
    maintenance: Mutex<Option<(mpsc::Sender<()>, std::thread::JoinHandle<()>)>>,
}

/// What one round of upkeep did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Upkeep {
    /// Sessions evicted (their VMs torn down; they stay on disk).
    pub evicted: usize,
    /// Sessions resident afterwards.
    pub resident: usize,
}

impl Runtime {
    /// Open the data directory `home` (created if missing): image (built if
    /// `config.image` is None and it is missing), engine, template, sessions,
    /// exec threads. Blocking (minutes on a first run).
    pub fn open(home: &Path, config: RuntimeConfig) -> Result<Arc<Runtime>, RuntimeError> {
        std::fs::create_dir_all(home)
            .map_err(|e| RuntimeError::Open { what: "creating the data directory", message: format!("{}: {e}", home.display()) })?;
        let image_path = match &config.image {
            Some(p) => p.clone(),
            None => {
                let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
                forkbox_image::build(
                    &forkbox_engine::default_image_spec(),
                    &forkbox_image::BuildOptions { home: home.to_path_buf(), progress },
                )
                .map_err(|e| RuntimeError::Open {
                    what: "building the default image",
                    message: format!("under {}: {e}", home.display()),
                })?
                .path
            }
        };
        let engine = Engine::open(&image_path)
            .map_err(|e| RuntimeError::Open { what: "opening the image", message: format!("{}: {e}", image_path.display()) })?;
        let engine = Arc::new(engine);
        let template = Template::ensure(&engine, home)
            .map_err(|e| RuntimeError::Open { what: "preparing the template", message: e.to_string() })?;
        Runtime::with_engine(engine, Arc::new(template), home, config)
    }

    /// The runtime of the CLI and `forkbox mcp` without a server: [`Runtime::open`]
    /// with [`RuntimeConfig::embedded`] and `image`, its upkeep running.
    pub fn embedded(home: &Path, image: Option<&Path>) -> Result<Arc<Runtime>, RuntimeError> {
        let config = RuntimeConfig { image: image.map(Path::to_path_buf), ..RuntimeConfig::embedded() };
        let rt = Runtime::open(home, config)?;
        rt.start_maintenance(|_| {});
        Ok(rt)
    }

    /// Over an open engine and template; opens the sessions under `home`. Blocking.
    pub fn with_engine(
        engine: Arc<Engine>,
        template: Arc<Template>,
        home: &Path,
        config: RuntimeConfig,
    ) -> Result<Arc<Runtime>, RuntimeError> {
        let sessions = SessionManager::open(engine.clone(), template.clone(), home, config.sessions.clone())?;
        let concurrency = config.threads();
        let workers = workers::ExecWorkers::new(concurrency)
            .map_err(|e| RuntimeError::Open { what: "starting the exec threads", message: e.to_string() })?;
        Ok(Arc::new(Runtime {
            home: home.to_path_buf(),
            engine,
            template,
            sessions,
            config,
            concurrency,
            workers,
            create_lock: Mutex::new(()),
            maintenance: Mutex::new(None),
        }))
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The image file the engine runs (a host path: never put it in an API error).
    pub fn image_path(&self) -> Option<&Path> {
        Some(self.engine.image_path.as_path())
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Exec threads, i.e. how many execs can run at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The id of the template every fork starts from.
    pub fn template_id(&self) -> &str {
        &self.template.info.id
    }

    /// One round of upkeep: evict idle sessions, merge long layer chains, remove
    /// what no session needs. Blocking.
    pub fn maintain(&self) -> Result<Upkeep, RuntimeError> {
        let evicted = self.sessions.evict_idle();
        self.sessions.maintenance()?;
        Ok(Upkeep { evicted, resident: self.sessions.resident_count() })
    }

    /// Run [`Self::maintain`] every `maintenance_every` on a thread of its own
    /// until the runtime is dropped or [`Self::stop_maintenance`]; `report` sees
    /// each round. Starting it again replaces the previous loop.
    pub fn start_maintenance(self: &Arc<Self>, report: impl Fn(Upkeep) + Send + 'static) {
        self.stop_maintenance();
        let (tx, rx) = mpsc::channel::<()>();
        let weak: Weak<Runtime> = Arc::downgrade(self);
        let every = self.config.maintenance_every;
        let spawned = std::thread::Builder::new().name("forkbox-upkeep".into()).spawn(move || loop {
            match rx.recv_timeout(every) {
                Err(RecvTimeoutError::Timeout) => {}
                // The runtime (which holds the sender) is gone, or the loop was replaced.
                _ => return,
            }
            let Some(rt) = weak.upgrade() else { return };
            match rt.maintain() {
                Ok(u) => report(u),
                Err(e) => tracing::warn!("session maintenance: {e}"),
            }
        });
        match spawned {
            Ok(handle) => *self.maintenance.lock().unwrap_or_else(|e| e.into_inner()) = Some((tx, handle)),
            Err(e) => tracing::warn!("starting the session maintenance thread: {e}"),
        }
    }

    /// Stop the upkeep loop and wait for a round in progress to finish.
    pub fn stop_maintenance(&self) {
        let taken = self.maintenance.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((tx, handle)) = taken {
            drop(tx);
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

/// A fresh random id with `prefix` (not a secret: exec ids).
pub(crate) fn random_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS's randomness (and moves on per instance).
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    format!("{prefix}{:016x}", h.finish())
}
