//! The forkbox HTTP API server (axum).
//!
//! Entry points:
//! - [`serve`]: what `forkbox serve` runs. Builds (or reuses) the default image
//!   and template under `home`, opens the sessions, creates an API key if none
//!   exists, prints where it listens (and that key), serves until SIGINT/SIGTERM.
//! - [`Server::bind`] + [`Server::run`]: the same, in two steps (the bound
//!   address and the created key are known before serving; any shutdown future).
//! - [`AppState::new`] + [`router`]: the router over an already-open engine and
//!   template (tests, embedding); [`embedded_router`]: the same routes for one
//!   fixed tenant without keys (the CLI and MCP in process, through tower's `oneshot`).
//! - [`create_key`]: `forkbox key create`.
//!
//! Endpoints (all `/v1` ones need `Authorization: Bearer <key>`; errors are
//! `{"error": {"code", "message"}}`, statuses in [`error`]):
//! - `POST /v1/exec {code, timeout_seconds?}` -> `{value, stdout, stderr, error{type,message,traceback},
//!   runtime_ms, wall_ms, syscalls, id, exit_code (0 ok, 1 Python exception), fork_time_ms, exec_time_ms, total_time_ms}`
//! - `POST /v1/exec/batch {codes: [..] (1..=64), timeout_seconds?}` -> `{results: [result | {status, error{code,message}}], total_time_ms}`
//! - `POST /v1/sessions {tags?, memory_mb?, timeout_seconds?}` -> 201 session;
//!   `GET /v1/sessions?tag=k:v&tag=..` -> `{sessions: [..]}`; `GET`/`DELETE /v1/sessions/{id}` (200 session / 204)
//! - `POST /v1/sessions/{id}/exec {code}` -> result + `checkpoint` (seq)
//! - `POST /v1/exec/stream`, `POST /v1/sessions/{id}/exec/stream`: the same, as Server-Sent Events (see [`stream`])
//! - `POST /v1/sessions/{id}/interrupt` -> `{interrupted}` (Ctrl-C for the running exec)
//! - files: `PUT`/`GET /v1/sessions/{id}/files/{*path}`, `GET /v1/sessions/{id}/files?dir=` (see [`files`])
//! - `GET /v1/sessions/{id}/checkpoints` -> `{checkpoints: [{seq, parent, code, created_ms, bytes, pages, head}]}`
//! - `POST /v1/sessions/{id}/revert {checkpoint}` -> session; `POST /v1/sessions/{id}/fork {checkpoint?, tags?}` -> 201 session
//! - ForeverVM's API (see [`forevervm`]): `GET /v1/whoami`, `POST /v1/machine/new`, `GET|POST /v1/machine/list`,
//!   `POST /v1/machine/{name}/exec`, `GET /v1/machine/{name}/exec/{seq}/result` (long poll), WebSocket `/v1/machine/{name}/repl`
//! - `GET /healthz`, `GET /metrics` (Prometheus text), `GET /v1/openapi.json` (OpenAPI 3.1), no auth.
//!
//! Per-key limits ([`quota`]): requests/s (429 `rate_limited`), sessions and checkpoint disk (403 `quota_exceeded`).
//!
//! A session is `{id, tags, created_ms, last_used_ms, resident, checkpoint (head seq or null),
//! forked_from ({session, checkpoint} until its first exec, else null), limits {memory_mb, timeout_seconds}}`.
//!
//! Engine calls block (KVM): they run on tokio's blocking pool, at most
//! `max_concurrency` at a time; at most `max_queue` requests wait for a slot,
//! each for at most `queue_wait`; anything past that gets 503 `overloaded`.

mod api;
pub mod error;
mod files;
mod forevervm;
pub mod keys;
pub mod metrics;
mod openapi;
pub mod quota;
pub mod schema;
mod stream;
mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use forkbox_engine::{Engine, Limits, Template};
use forkbox_sessions::manager::{Config as SessionsConfig, SessionManager};

pub use api::{embedded_router, router, Caller};
pub use keys::create_key_with;
pub use quota::KeyLimits;
pub use keys::create_key;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Data directory (images, templates, sessions, `server/keys.db`).
    pub home: PathBuf,
    /// Image file to use; `None`: the default image, built under `home` if missing.
    pub image: Option<PathBuf>,
    /// Concurrent engine calls; 0: twice the available cores.
    pub max_concurrency: usize,
    /// Requests allowed to wait for an exec slot; 0: 8 × `max_concurrency`.
    pub max_queue: usize,
    /// Longest wait for an exec slot before 503.
    pub queue_wait: Duration,
    /// Largest request body (413 `payload_too_large` above it).
    pub body_limit: usize,
    /// Largest `code` (413 `code_too_large` above it).
    pub code_limit: usize,
    /// Largest file upload or download (413 `file_too_large` above it).
    pub files_limit: usize,
    /// Most codes in one `/v1/exec/batch`.
    pub max_batch: usize,
    /// Defaults for one-shot execs and new sessions (timeout, memory, output, disk).
    pub limits: Limits,
    /// Largest `timeout_seconds` a request may ask for.
    pub max_timeout: Duration,
    /// Largest `memory_mb` a session may ask for.
    pub max_memory_mb: u64,
    pub sessions: SessionsConfig,
    /// How often session maintenance (eviction, compaction, gc) runs.
    pub maintenance_every: Duration,
    /// Tenant of the key `serve` creates when there is none.
    pub default_tenant: String,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, home: PathBuf) -> ServerConfig {
        ServerConfig {
            listen,
            home,
            image: None,
            max_concurrency: 0,
            max_queue: 0,
            queue_wait: Duration::from_secs(10),
            body_limit: 2 << 20,
            code_limit: 1 << 20,
            files_limit: 64 << 20,
            max_batch: 64,
            // A fresh server: public internet, everything non-public refused (`--egress` to change).
            limits: Limits { network: forkbox_engine::NetConfig::with_policy(forkbox_engine::NetPolicy::public()), ..Limits::default() },
            max_timeout: Duration::from_secs(600),
            max_memory_mb: 4096,
            sessions: SessionsConfig::default(),
            maintenance_every: Duration::from_secs(5),
            default_tenant: "default".into(),
        }
    }

    fn concurrency(&self) -> usize {
        if self.max_concurrency > 0 {
            return self.max_concurrency;
        }
        std::thread::available_parallelism().map_or(2, |n| n.get()) * 2
    }
}

/// Shared by every request.
pub struct Inner {
    pub engine: Arc<Engine>,
    pub template: Arc<Template>,
    pub sessions: Arc<SessionManager>,
    pub keys: keys::KeyStore,
    pub config: ServerConfig,
    pub(crate) permits: Arc<tokio::sync::Semaphore>,
    pub(crate) concurrency: usize,
    pub(crate) queued: AtomicUsize,
    /// Held while a session is counted against its quota and created.
    pub(crate) create_lock: std::sync::Mutex<()>,
    /// ForeverVM instruction queues and results, per machine (session).
    pub(crate) machines: forevervm::Machines,
    /// The threads engine calls run on (one per exec slot).
    pub(crate) workers: workers::ExecWorkers,
}

pub type AppState = Arc<Inner>;

impl Inner {
    /// State over an open engine + template; opens the sessions and keys under `config.home`.
    /// Blocking (SQLite, session recovery): call it off the async threads, or before serving.
    pub fn new(engine: Arc<Engine>, template: Arc<Template>, config: ServerConfig) -> anyhow::Result<AppState> {
        let sessions = SessionManager::open(engine.clone(), template.clone(), &config.home, config.sessions.clone())
            .with_context(|| format!("opening the sessions under {}", config.home.display()))?;
        let keys = keys::KeyStore::open(&config.home)?;
        let concurrency = config.concurrency();
        metrics::handle();
        Ok(Arc::new(Inner {
            engine,
            template,
            sessions: Arc::new(sessions),
            keys,
            permits: Arc::new(tokio::sync::Semaphore::new(concurrency)),
            concurrency,
            queued: AtomicUsize::new(0),
            create_lock: std::sync::Mutex::new(()),
            machines: forevervm::Machines::default(),
            workers: workers::ExecWorkers::new(concurrency).context("starting the exec threads")?,
            config,
        }))
    }
}

/// The engine and template for a data directory (image built if missing). Blocking.
pub fn open_engine(home: &Path, image: Option<&Path>) -> anyhow::Result<(Arc<Engine>, Arc<Template>)> {
    let image_path = match image {
        Some(p) => p.to_path_buf(),
        None => {
            let built = forkbox_image::build(
                &forkbox_engine::default_image_spec(),
                &forkbox_image::BuildOptions { home: home.to_path_buf(), progress: true },
            )
            .with_context(|| format!("building the default image under {}", home.display()))?;
            built.path
        }
    };
    let engine = Arc::new(Engine::open(&image_path).with_context(|| format!("opening {}", image_path.display()))?);
    let template = Arc::new(Template::ensure(&engine, home).context("preparing the template")?);
    Ok((engine, template))
}

/// A bound, ready server.
pub struct Server {
    state: AppState,
    listener: tokio::net::TcpListener,
    /// The key created because the data directory had none (show it to the user).
    pub created_key: Option<String>,
}

impl Server {
    /// Open everything (image, template, sessions, keys) and bind `config.listen`.
    pub async fn bind(config: ServerConfig) -> anyhow::Result<Server> {
        let cfg = config.clone();
        let (state, created_key) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            std::fs::create_dir_all(&cfg.home).with_context(|| format!("creating {}", cfg.home.display()))?;
            let (engine, template) = open_engine(&cfg.home, cfg.image.as_deref())?;
            let created_key = if keys::count_keys(&cfg.home)? == 0 {
                Some(create_key(&cfg.home, &cfg.default_tenant)?)
            } else {
                None
            };
            Ok((Inner::new(engine, template, cfg)?, created_key))
        })
        .await??;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        Ok(Server { state, listener, created_key })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serve until `shutdown` completes, then finish in-flight requests and return.
    /// Runs session maintenance every `maintenance_every` meanwhile.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let maint = tokio::spawn(maintenance_loop(self.state.clone()));
        let app = router(self.state.clone());
        let r = axum::serve(self.listener, app).with_graceful_shutdown(shutdown).await;
        maint.abort();
        let _ = maint.await;
        r.context("serving")
    }
}

/// Session upkeep every `maintenance_every` (eviction of idle sessions,
/// compaction, garbage collection), off the request path; runs until dropped.
pub async fn maintenance_loop(state: AppState) {
    let mut tick = tokio::time::interval(state.config.maintenance_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let s = state.clone();
        let r = tokio::task::spawn_blocking(move || {
            let evicted = s.sessions.evict_idle();
            let r = s.sessions.maintenance();
            metrics::evicted(evicted);
            metrics::sessions(s.sessions.resident_count());
            r
        })
        .await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("session maintenance: {e}"),
            Err(e) => tracing::warn!("session maintenance task: {e}"),
        }
    }
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `forkbox serve`: bind, print the address (and a new API key if none
/// existed), serve until SIGINT/SIGTERM, then shut down gracefully.
pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    let server = Server::bind(config.clone()).await?;
    let addr = server.local_addr()?;
    println!("forkbox listening on http://{addr} (data in {})", config.home.display());
    match &server.created_key {
        Some(k) => println!("API key (tenant {:?}; shown once, only its hash is stored): {k}", config.default_tenant),
        None => println!("API keys: use an existing one, or create one with `forkbox key create`"),
    }
    server.run(shutdown_signal()).await
}
