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
//! - Commands ([`command`]): a shell command or argv run as an exec of a
//!   generated snippet (`subprocess` in the guest), its exit status read back.
//! - Templates ([`templates`]): list and build a data directory's templates.
//!
//! Operations that are not execs block (SQLite, files): call them off async threads.

#![forbid(unsafe_code)]

pub mod cluster;
pub mod command;
/// API key records, where the session metadata lives (the API server gives them meaning).
pub mod keys {
    pub use forkbox_sessions::keys::{keys_path, KeyDb, KeyRecord};
}
mod error;
pub mod exec;
mod remote;
pub mod session;
pub mod templates;
pub mod tree;
mod workers;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use forkbox_catalog::{Catalog, Loaded};
use forkbox_engine::{Engine, Template};
use forkbox_sessions::manager::SessionManager;

pub use cluster::{ClusterConfig, NodeRecord, NodeState, SessionRoute};
pub use command::{Command, CommandLine, CommandResult};
pub use error::RuntimeError;
pub use exec::{OneShot, OneShotRequest, Outcome, Output, Ran};
pub use forkbox_api::ErrorCode;
pub use forkbox_catalog::catalog::Listing as TemplateListing;
pub use forkbox_catalog::catalog::{Blas, CustomTemplate, PipSource};
pub use forkbox_engine::net_secrets;
pub use forkbox_engine::net_tls;
/// Host entropy as hex (getrandom(2)): the one helper for ids and secrets made above the engine.
pub use forkbox_engine::random_hex;
pub use forkbox_engine::{
    CapturedOutput, EntryInfo, EntryKind, ExecResult, FileEntry, FileOp, FileOpOutcome, GlobalNetStats, JobChunk,
    JobInfo, Limits, ListeningPort, MimeBundle, NetConfig, NetMode, NetPolicy, NetRule, OutputFile, PyError, Stream,
    TemplateInfo,
};
pub use forkbox_engine::{Change, ChangeKind, Changes, Usage};
pub use forkbox_image::packages::Policy as PackagePolicy;
pub use forkbox_sessions::manager::{Config as SessionsConfig, ExecOutcome, PackagesOutcome};
pub use forkbox_sessions::manager::{Diff, FileChange, PathCall, Variable, VariableChange, Variables};
pub use forkbox_sessions::objects::ObjectsConfig;
pub use forkbox_sessions::output::{CallOutput, OutputFileMeta, OUTPUT_MAX};
pub use forkbox_worker::child::main as worker_main;
pub use forkbox_worker::WorkerInfo;
pub use remote::{Isolation, ProcessIsolation, DEFAULT_SESSION_WORKERS};
pub use session::SessionCode;
pub use session::{wait_settled, CheckpointView, ForkedFrom, JobStart, NewSession, Quota, SessionView};
pub use tree::{
    Branch, CheckpointContents, ExploreRequest, Explored, History, HistoryCall, Keep, EXPLORE_MAX,
    HISTORY_DEFAULT_CALLS, HISTORY_MAX_BYTES, HISTORY_MAX_CALLS,
};
pub use workers::{job_cpu_seconds, thread_cpu_seconds};

/// What a runtime allows and how it runs.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Image file to use; `None`: the default image, built under the home if missing.
    pub image: Option<PathBuf>,
    /// The default template's name (`python` if None); others are built on first use.
    pub template: Option<String>,
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
    /// Where pip looks for the wheels of templates built by request (`POST /v1/templates`)
    /// and of packages installed at run time.
    pub pip: forkbox_image::PipSource,
    /// Which packages sessions may install at run time (`serve --pip-allow/--pip-deny`).
    pub packages: forkbox_image::packages::Policy,
    /// Where one-shot execs run: in-process threads, or jailed worker processes (`serve --isolation`).
    pub isolation: Isolation,
}

impl Default for RuntimeConfig {
    /// A public server's bounds.
    fn default() -> Self {
        RuntimeConfig {
            image: None,
            template: None,
            concurrency: 0,
            code_limit: 1 << 20,
            max_batch: 64,
            // The public internet; loopback, private, link-local/metadata and
            // this host's addresses refused (`forkbox serve --egress` changes it).
            limits: Limits { network: NetConfig::with_policy(NetPolicy::public()), ..Limits::default() },
            max_timeout: Duration::from_secs(600),
            max_memory_mb: 4096,
            sessions: SessionsConfig::default(),
            maintenance_every: Duration::from_secs(5),
            pip: forkbox_image::PipSource::default(),
            packages: forkbox_image::packages::Policy::default(),
            isolation: Isolation::default(),
        }
    }
}

impl RuntimeConfig {
    /// The CLI's own bounds (it checks its flags itself), not a public server's; execs on
    /// this process' threads (the CLI runs as its user, who cannot jail workers).
    pub fn embedded() -> Self {
        RuntimeConfig {
            max_timeout: Duration::from_secs(86_400),
            max_memory_mb: 3072,
            isolation: Isolation::Thread,
            ..RuntimeConfig::default()
        }
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
    /// Every template execs and sessions may use (the sessions' catalog).
    catalog: Arc<Catalog>,
    /// The default template, open.
    default: Arc<Loaded>,
    sessions: SessionManager,
    config: RuntimeConfig,
    concurrency: usize,
    workers: workers::ExecWorkers,
    /// The sandbox worker processes (`Isolation::Process`), one per exec thread.
    remote: Option<forkbox_worker::Workers>,
    /// The session workers (`Isolation::Process`), one per tenant: the sessions' host.
    session_workers: Option<Arc<forkbox_worker::SessionWorkers>>,
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
        std::fs::create_dir_all(home).map_err(|e| RuntimeError::Open {
            what: "creating the data directory",
            message: format!("{}: {e}", home.display()),
        })?;
        let open_err = |what: &'static str| {
            move |e: forkbox_engine::EngineError| RuntimeError::Open { what, message: e.to_string() }
        };
        // Building is minutes on a first run: say so on stderr (bars on a terminal, else lines).
        let catalog = Arc::new(Catalog::new(home).map_err(open_err("opening /dev/kvm"))?.with_progress(true));
        let name = config.template.clone().unwrap_or_else(|| forkbox_catalog::DEFAULT_TEMPLATE.to_string());
        if share_templates(&catalog, home, &config)? && config.image.is_some() {
            return Err(RuntimeError::Open {
                what: "opening the image",
                message: "an image given by path cannot be shared with a cluster (--cluster): its nodes share \
                          the templates of recipes (--template NAME)"
                    .into(),
            });
        }
        if let Some(image_path) = &config.image {
            // An image given by path is the default template, under the default's name.
            let engine = Engine::open(image_path).map_err(|e| RuntimeError::Open {
                what: "opening the image",
                message: format!("{}: {e}", image_path.display()),
            })?;
            let engine = Arc::new(engine.with_packages(catalog.packages().clone()));
            let template = Template::ensure(&engine, home).map_err(open_err("preparing the template"))?;
            catalog.insert(&name, engine, Arc::new(template));
        }
        catalog.set_default(&name)?;
        // Only the default is built now; the others on first use.
        catalog.get(None)?;
        Runtime::with_catalog(catalog, home, config)
    }

    /// The runtime of the CLI and `forkbox mcp` without a server: [`Runtime::open`]
    /// with [`RuntimeConfig::embedded`] and `image`, its upkeep running.
    pub fn embedded(home: &Path, image: Option<&Path>) -> Result<Arc<Runtime>, RuntimeError> {
        Runtime::embedded_on(home, image, None)
    }

    /// [`Self::embedded`] with `template` as the default template.
    pub fn embedded_on(
        home: &Path,
        image: Option<&Path>,
        template: Option<&str>,
    ) -> Result<Arc<Runtime>, RuntimeError> {
        let config = RuntimeConfig {
            image: image.map(Path::to_path_buf),
            template: template.map(str::to_string),
            ..RuntimeConfig::embedded()
        };
        Runtime::embedded_with(home, config)
    }

    /// [`Self::embedded`] with `config` (an operator's egress policy, say: `RuntimeConfig::embedded()` changed).
    pub fn embedded_with(home: &Path, config: RuntimeConfig) -> Result<Arc<Runtime>, RuntimeError> {
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
        let catalog = Arc::new(Catalog::new(home)?);
        if let Some(name) = &config.template {
            catalog.insert(name, engine, template);
            catalog.set_default(name)?;
        } else {
            catalog.insert(&catalog.default_name(), engine, template);
        }
        Runtime::with_catalog(catalog, home, config)
    }

    /// Over a catalog whose default template opens (built if needed). Blocking.
    pub fn with_catalog(
        catalog: Arc<Catalog>,
        home: &Path,
        config: RuntimeConfig,
    ) -> Result<Arc<Runtime>, RuntimeError> {
        catalog.set_pip_source(config.pip.clone())?;
        catalog.set_owner_rules(Arc::new(tenant_template_rules));
        catalog.packages().set_policy(config.packages.clone());
        share_templates(&catalog, home, &config)?;
        let default = catalog.get(None)?;
        let mut sessions = SessionManager::open_with_catalog(catalog.clone(), home, config.sessions.clone())?;
        let concurrency = config.threads();
        // The exec threads run guests: a seccomp allow-list on each (FORKBOX_SECCOMP=enforce|eperm|off).
        let seccomp = forkbox_engine::jail::Mode::from_env()
            .map_err(|e| RuntimeError::Open { what: "reading FORKBOX_SECCOMP", message: e.to_string() })?;
        let workers = workers::ExecWorkers::new(concurrency, seccomp)
            .map_err(|e| RuntimeError::Open { what: "starting the exec threads", message: e.to_string() })?;
        let (remote, session_workers) = match config.isolation {
            Isolation::Thread => (None, None),
            Isolation::Process(p) => {
                let (w, s) = start_workers(home, &config, p, &default, seccomp, concurrency)?;
                let s = Arc::new(s);
                sessions = sessions.with_host(s.clone());
                (Some(w), Some(s))
            }
        };
        let rt = Arc::new(Runtime {
            remote,
            session_workers,
            home: home.to_path_buf(),
            catalog,
            default,
            sessions,
            config,
            concurrency,
            workers,
            create_lock: Mutex::new(()),
            maintenance: Mutex::new(None),
        });
        cluster::start_heartbeat(&rt);
        Ok(rt)
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The API key records of this data directory, or of the shared database (`sessions.database`). Blocking.
    pub fn open_keys(&self) -> Result<keys::KeyDb, RuntimeError> {
        keys::KeyDb::open(&self.home, self.config.sessions.database.as_deref())
            .map_err(|e| RuntimeError::Open { what: "opening the API keys", message: e.to_string() })
    }

    /// The sandbox worker processes: the exec workers, then the session
    /// workers (one per tenant with sandboxes, and a spare); empty with `Isolation::Thread`.
    pub fn worker_list(&self) -> Vec<WorkerInfo> {
        let mut out = self.remote.as_ref().map(|w| w.list()).unwrap_or_default();
        out.extend(self.session_workers.as_ref().map(|w| w.list()).unwrap_or_default());
        out
    }

    /// The CPU seconds each tenant's session worker used between requests
    /// since it was last charged (its sandboxes' background work), taken: the
    /// front end charges them to the tenant's budget. Empty with `Isolation::Thread`
    /// (nothing runs between requests there).
    pub fn take_background_cpu(&self) -> Vec<(String, f64)> {
        self.session_workers.as_ref().map(|w| w.take_idle_cpu()).unwrap_or_default()
    }

    /// Hold (`on`) or let run again the background work of `tenant`'s sandboxes
    /// (its session worker's) between requests; requests are served either way.
    pub fn throttle_background(&self, tenant: &str, on: bool) {
        if let Some(w) = &self.session_workers {
            w.throttle(tenant, on);
        }
    }

    /// The host pid of `tenant`'s session worker, if it has one now (tests, operators).
    pub fn session_worker_pid(&self, tenant: &str) -> Option<u32> {
        self.session_workers.as_ref().and_then(|w| w.pid_of(tenant))
    }

    /// The network counters of every sandbox of this process (egress decisions, DNS, bytes).
    pub fn net_stats(&self) -> &'static GlobalNetStats {
        &forkbox_engine::NET_GLOBAL
    }

    /// The default template's image file (a host path: never put it in an API error).
    pub fn image_path(&self) -> Option<&Path> {
        Some(self.default.engine.image_path.as_path())
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Exec threads, i.e. how many execs can run at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The id of the default template.
    pub fn template_id(&self) -> &str {
        self.default.id()
    }

    /// The default template's name.
    pub fn default_template(&self) -> String {
        self.catalog.default_name()
    }

    /// The named template (None: the default) as `tenant` sees it (its own first,
    /// then shipped and shared ones), open; one not built yet starts building in
    /// the background (`template_not_ready` until it is done).
    pub fn template(&self, tenant: &str, name: Option<&str>) -> Result<Arc<Loaded>, RuntimeError> {
        match name {
            None => Ok(self.default.clone()),
            Some(n) => {
                let key = self.catalog.key_for(Some(tenant), n)?;
                Ok(self.catalog.get_or_start(Some(&key))?)
            }
        }
    }

    /// Start building the shared or shipped template `name` in the background if it is not
    /// built (`serve --prebuild`); one on disk is opened now (about a second).
    pub fn prebuild(&self, name: &str) -> Result<(), RuntimeError> {
        match self.catalog.get_or_start(Some(name)) {
            Ok(_) | Err(forkbox_catalog::CatalogError::Building { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The named template, built now if needed (blocking: minutes on a first build).
    pub fn template_blocking(&self, name: &str) -> Result<Arc<Loaded>, RuntimeError> {
        Ok(self.catalog.get(Some(name))?)
    }

    /// Every template `tenant` may use and its state (`GET /v1/templates`).
    pub fn templates(&self, tenant: &str) -> Vec<TemplateListing> {
        self.catalog.list_visible(tenant)
    }

    /// One template as `tenant` sees it (`GET /v1/templates/{name}`).
    pub fn template_listing(&self, tenant: &str, name: &str) -> Result<TemplateListing, RuntimeError> {
        self.catalog.key_for(Some(tenant), name)?;
        self.catalog
            .listing(Some(tenant), name)
            .ok_or_else(|| forkbox_catalog::CatalogError::UnknownTemplate(name.into()).into())
    }

    /// A template of `tenant`'s own, built in the background (`POST /v1/templates`).
    pub fn create_template(
        &self,
        tenant: &str,
        t: &forkbox_catalog::catalog::CustomTemplate,
    ) -> Result<TemplateListing, RuntimeError> {
        Ok(self.catalog.create(tenant, t)?)
    }

    /// A template of `tenant`'s own from checkpoint `seq` of its session `id`. Blocking (about a second).
    pub fn checkpoint_template(
        &self,
        tenant: &str,
        id: &str,
        seq: i64,
        name: &str,
    ) -> Result<TemplateListing, RuntimeError> {
        Ok(self.sessions.checkpoint_template(tenant, id, seq, name)?)
    }

    /// The name a template id is known by here (None: not a named template now).
    pub fn template_name(&self, id: &str) -> Option<String> {
        self.catalog
            .list()
            .into_iter()
            .find(|t| t.id.as_deref() == Some(id))
            .map(|t| t.name.rsplit('/').next().unwrap_or(&t.name).to_string())
    }

    /// Host memory the default template's recycled VMs hold in private pages, and its bound (bytes).
    pub fn vm_pool_private_bytes(&self) -> (u64, u64) {
        let t = &self.default.template;
        let held = t.pool_stats().recycled_private_bytes.load(std::sync::atomic::Ordering::Relaxed);
        (held, t.max_recycled_bytes())
    }

    /// One round of upkeep: evict idle sessions, merge long layer chains, remove
    /// what no session needs. Blocking.
    pub fn maintain(&self) -> Result<Upkeep, RuntimeError> {
        let evicted = self.sessions.evict_idle();
        self.sessions.maintenance()?;
        if let Some(w) = &self.session_workers {
            w.stop_idle(forkbox_worker::sessions::IDLE_STOP);
        }
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

/// Most templates of its own one tenant may have, and its builds pending at once.
pub const MAX_TEMPLATES_PER_TENANT: usize = 32;
pub const MAX_PENDING_BUILDS_PER_TENANT: usize = 1;

/// A tenant's templates are the catalog's templates of that owner: one more
/// (a build, a session's checkpoint made a template) is admitted within these limits.
fn tenant_template_rules(mine: forkbox_catalog::catalog::OwnerUsage) -> Result<(), forkbox_catalog::CatalogError> {
    use forkbox_catalog::CatalogError;
    if !mine.replaces && mine.templates >= MAX_TEMPLATES_PER_TENANT {
        return Err(CatalogError::Quota(format!("at most {MAX_TEMPLATES_PER_TENANT} templates per tenant")));
    }
    if mine.pending_builds >= MAX_PENDING_BUILDS_PER_TENANT {
        return Err(CatalogError::TooManyBuilds(format!(
            "this tenant has {} template build(s) pending (at most {MAX_PENDING_BUILDS_PER_TENANT}); retry when it is done",
            mine.pending_builds
        )));
    }
    Ok(())
}

/// In a cluster (`sessions.cluster`: the session metadata in PostgreSQL and
/// the checkpoint files in a bucket, shared by the nodes), templates, their
/// images and package layers are shared by the nodes through the same
/// database and bucket (`forkbox_catalog::shared`): set up on `catalog` once.
/// True if it is. A single node shares nothing.
fn share_templates(catalog: &Catalog, home: &Path, config: &RuntimeConfig) -> Result<bool, RuntimeError> {
    if config.sessions.cluster.is_none() {
        return Ok(false);
    }
    let (Some(objects), Some(db)) = (&config.sessions.objects, &config.sessions.database) else {
        return Err(RuntimeError::Open {
            what: "joining the cluster",
            message: "a cluster node needs --database postgres://... and --objects s3://...".into(),
        });
    };
    if catalog.shared_stats().is_some() {
        return Ok(true);
    }
    let shared = forkbox_sessions::artifacts::BucketArtifacts::shared(objects, db, home)
        .map_err(|e| RuntimeError::Open { what: "sharing templates with the cluster", message: e.to_string() })?;
    catalog.set_shared(shared);
    Ok(true)
}

/// One jailed worker per exec thread, the default template open in each; and
/// the session workers (one per tenant, started on demand; a spare now).
fn start_workers(
    home: &Path,
    config: &RuntimeConfig,
    p: ProcessIsolation,
    default: &Loaded,
    seccomp: forkbox_engine::jail::Mode,
    n: usize,
) -> Result<(forkbox_worker::Workers, forkbox_worker::SessionWorkers), RuntimeError> {
    let open = |message: String| {
        RuntimeError::Open {
        what: "starting the sandbox workers",
        message: format!("{message} (they need root to jail themselves; `--isolation thread` runs execs on the server's own threads)"),
    }
    };
    let mut wc = forkbox_worker::Config::new(home);
    wc.memory_bytes = p.memory_mb.saturating_mul(1 << 20);
    wc.uid_base = p.uid_base;
    wc.seccomp = seccomp;
    wc.test_actions = std::env::var("FORKBOX_WORKER_TEST_ACTIONS").is_ok_and(|v| v == "1");
    if let Some(img) = &config.image {
        if !img.starts_with(home.join("images")) {
            wc.extra_images.push(img.clone());
        }
    }
    let prepare =
        wc.template_ref(&default.engine.image_path, &default.template.dir).map_err(|e| open(e.to_string()))?;
    // A session worker runs a thread per sandbox: room for every resident session and the explores.
    let mut sc = wc.clone();
    sc.max_tasks = (config.sessions.max_resident as u64).saturating_add(4 * n as u64).saturating_add(64).max(256);
    let exec = forkbox_worker::Workers::start(wc, n, Some(prepare.clone())).map_err(|e| open(e.to_string()))?;
    let sessions = forkbox_worker::SessionWorkers::start(sc, n, p.session_workers, Some(prepare))
        .map_err(|e| open(e.to_string()))?;
    Ok((exec, sessions))
}
