//! The forkbox HTTP API server (axum): HTTP only.
//!
//! Place in the flow: **request** (this crate, beside the CLI and MCP) ->
//! runtime -> sessions -> engine -> vmm/linux -> guest. Every operation is a
//! typed call on [`forkbox_runtime::Runtime`]; this crate adds what is HTTP:
//! routing and the OpenAPI document ([`router`]), keys and rate limits
//! (`auth`, [`keys`], [`quota`]), extractors with the API's error shape,
//! admission to the exec slots (503 `overloaded`), handlers that shape JSON,
//! SSE and WebSocket responses, and [`metrics`]. It never sees the session
//! store or the engine.
//!
//! Entry points:
//! - [`serve`]: what `forkbox serve` runs. Builds (or reuses) the default image
//!   and template under `home`, opens the sessions, creates an API key if none
//!   exists, prints where it listens (and that key), serves until SIGINT/SIGTERM.
//! - [`Server::bind`] + [`Server::run`]: the same, in two steps (the bound
//!   address and the created key are known before serving; any shutdown future).
//! - [`Inner::with_runtime`] + [`router`]: the router over an open
//!   [`Runtime`] (tests, embedding);
//!   [`embedded_router`] / [`embedded`]: the same routes for one fixed tenant
//!   without keys (the CLI and MCP in process, through tower's `oneshot`).
//! - [`create_key`]: `forkbox key create`.
//!
//! Endpoints (all `/v1` ones need `Authorization: Bearer <key>`; errors are
//! `{"error": {"code", "message"}}`, codes and statuses: `forkbox_api::ErrorCode`, see [`error`]):
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
//! - E2B's API (see [`e2b`]): its control plane (`/v2/sandboxes`, `/sandboxes/...`, `/snapshots`,
//!   `/templates/{id}`, behind `X-API-KEY`) and, routed by the `E2b-Sandbox-Id` header, envd and the
//!   code interpreter of each sandbox; not in the OpenAPI document
//! - `GET /`: a JSON pointer to the OpenAPI document; to a browser the web console (`handlers::console`,
//!   assets under `/console/`), which signs in with an API key and calls only these `/v1` routes
//! - `GET /healthz` (`{status, template, exec slot capacity}`, nothing about tenants), `GET /v1/openapi.json`
//!   (OpenAPI 3.1), no auth; `GET /metrics` (Prometheus text): admin keys only, or without auth on
//!   `metrics_listen` when that is set.
//!
//! Per-key limits ([`quota`], defaults for new keys in [`KeyLimits::defaults`]): requests/s (429
//! `rate_limited`; a batch counts each exec), sessions and checkpoint disk (403 `quota_exceeded`),
//! concurrent execs (a share of the slots, in the key's own queue: `fair`), CPU seconds per hour
//! (429 `cpu_budget_exceeded`), the longest timeout.
//!
//! A session is `{id, tags, created_ms, last_used_ms, resident, checkpoint (head seq or null),
//! forked_from ({session, checkpoint} until its first exec, else null), limits {memory_mb, timeout_seconds}}`.
//!
//! Execs run on the runtime's exec threads, at most `max_concurrency` at a
//! time; at most `max_queue` requests wait for a slot, each for at most
//! `queue_wait`; anything past that gets 503 `overloaded`. Other blocking calls
//! (SQLite, files) run on tokio's blocking pool.
#![forbid(unsafe_code)]

mod admission;
mod auth;
mod background_cpu;
mod e2b;
pub mod error;
mod extractors;
mod fair;
pub mod forward;
mod handlers;
pub mod keys;
pub mod metrics;
mod openapi;
pub mod ports;
pub mod quota;
mod router;
pub mod schema;
mod uploads;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use forkbox_runtime::{Runtime, RuntimeConfig};

pub use auth::Caller;
pub use handlers::capabilities::compute as capabilities;
pub use keys::create_key;
pub use keys::{create_key_full, create_key_with, create_key_with_secrets};
pub use quota::KeyLimits;
pub use router::{embedded_router, router};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Data directory (images, templates, sessions, `server/keys.db`).
    pub home: PathBuf,
    /// Largest request body (413 `payload_too_large` above it).
    pub body_limit: usize,
    /// Largest file upload or download (413 `file_too_large` above it).
    pub files_limit: usize,
    /// File uploads one key may have in progress at once (429 `rate_limited`
    /// past it; 0: no cap). Each holds a bounded buffer in this process and
    /// up to `files_limit` bytes in a temporary file until its sandbox has it.
    pub key_uploads: usize,
    /// Package installs one key may have in progress at once (as `key_uploads`).
    pub key_installs: usize,
    /// Requests allowed to wait for an exec slot; 0: 8 × the slots.
    pub max_queue: usize,
    /// Longest wait for an exec slot before 503.
    pub queue_wait: Duration,
    /// Tenant of the key `serve` creates when there is none.
    pub default_tenant: String,
    /// Execs one key may run at once unless its key says otherwise: this
    /// fraction of the exec slots (at least 1).
    pub key_share: f64,
    /// Serve `/metrics` (without auth) on this address instead; `None`:
    /// `/metrics` is on the main address for admin keys only.
    pub metrics_listen: Option<SocketAddr>,
    /// What the runtime enforces (image, templates, exec slots, limits, sessions, pip, isolation);
    /// [`Inner::with_runtime`] ignores it and takes the open runtime's own.
    pub runtime: RuntimeConfig,
    /// Templates to build at start, in the background (`serve --prebuild NAME`).
    pub prebuild: Vec<String>,
    /// How long a request on a template being built waits for it before 409 `template_not_ready`.
    pub template_wait: Duration,
    /// E2B's API: a sandbox whose lifetime ends is paused (evicted, resumable with
    /// `connect`) instead of killed, whatever its `autoPause` (`serve --e2b-auto-pause`).
    pub e2b_auto_pause: bool,
    /// `serve --sandbox-domain`: `Host: <port>-<session id>.<domain>` reaches
    /// that port of the session (wildcard DNS to this server), and E2B
    /// sandboxes report it as their `domain` (`get_host`).
    pub sandbox_domain: Option<String>,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, home: PathBuf) -> ServerConfig {
        ServerConfig {
            listen,
            home,
            body_limit: 2 << 20,
            files_limit: 64 << 20,
            key_uploads: 4,
            key_installs: 2,
            max_queue: 0,
            queue_wait: Duration::from_secs(10),
            default_tenant: "default".into(),
            key_share: 0.5,
            metrics_listen: None,
            runtime: RuntimeConfig::default(),
            prebuild: Vec::new(),
            template_wait: Duration::from_secs(60),
            e2b_auto_pause: false,
            sandbox_domain: None,
        }
    }

    /// Default concurrent execs of one key for `slots` exec slots.
    pub fn key_concurrency(&self, slots: usize) -> usize {
        ((slots as f64 * self.key_share).floor() as usize).clamp(1, slots.max(1))
    }

    /// The configuration of an embedded router (no socket): larger bodies, as the CLI sends them.
    pub fn embedded(home: PathBuf) -> ServerConfig {
        ServerConfig { body_limit: 8 << 20, ..ServerConfig::new(([127, 0, 0, 1], 0).into(), home) }
    }
}

/// Shared by every request.
pub struct Inner {
    pub runtime: Arc<Runtime>,
    pub keys: keys::KeyStore,
    pub config: ServerConfig,
    pub(crate) admission: admission::Admission,
    /// ForeverVM instruction queues and results, per machine (session).
    pub(crate) machines: handlers::forevervm::Machines,
    /// E2B sandboxes: their tokens, lifetimes and code contexts.
    pub(crate) e2b: e2b::Sandboxes,
    /// Cluster: the client requests are forwarded to other nodes with.
    pub(crate) peers: reqwest::Client,
    /// Signs the port URLs this process hands out.
    pub(crate) port_signer: ports::PortSigner,
    /// Charges the sandboxes' background work to CPU budgets.
    pub(crate) background_cpu: background_cpu::BackgroundCpu,
}

pub type AppState = Arc<Inner>;

impl Inner {
    /// State over an open runtime (its own limits apply); opens the keys under `config.home`. Blocking.
    pub fn with_runtime(runtime: Arc<Runtime>, config: ServerConfig) -> anyhow::Result<AppState> {
        let keys = keys::KeyStore::new(Arc::new(runtime.open_keys()?));
        metrics::handle();
        let mut hidden = vec![(config.home.display().to_string(), "$FORKBOX_HOME")];
        if let Ok(c) = config.home.canonicalize() {
            hidden.push((c.display().to_string(), "$FORKBOX_HOME"));
        }
        if let Some(image) = runtime.image_path() {
            hidden.push((image.display().to_string(), "<image>"));
            if let Some(dir) = image.parent() {
                hidden.push((dir.display().to_string(), "<images>"));
            }
        }
        error::hide_paths(hidden);
        Ok(Arc::new(Inner {
            admission: admission::Admission::new(runtime.concurrency(), config.max_queue, config.queue_wait),
            runtime,
            keys,
            machines: handlers::forevervm::Machines::default(),
            e2b: e2b::Sandboxes::default(),
            peers: forward::peers(),
            port_signer: ports::PortSigner::new()?,
            background_cpu: background_cpu::BackgroundCpu::default(),
            config,
        }))
    }
}

/// The API for one fixed tenant over `runtime`, in process (no socket, no key):
/// what the CLI and `forkbox mcp` drive through `forkbox_client`'s in-process transport.
/// Blocking (opens the key store); call it inside a tokio runtime context.
pub fn embedded(runtime: Arc<Runtime>, tenant: &str) -> anyhow::Result<axum::Router> {
    let config = ServerConfig::embedded(runtime.home().to_path_buf());
    Ok(embedded_router(Inner::with_runtime(runtime, config)?, tenant))
}

/// A bound, ready server.
pub struct Server {
    state: AppState,
    listener: tokio::net::TcpListener,
    /// `ServerConfig::metrics_listen`, bound.
    metrics: Option<tokio::net::TcpListener>,
    /// The key created because the data directory had none (show it to the user).
    pub created_key: Option<String>,
}

/// The server's sockets, bound before anything is built (a busy port fails at once).
pub struct Listeners {
    listener: tokio::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
}

impl Listeners {
    /// Bind `config.listen` (and `config.metrics_listen`).
    pub async fn bind(config: &ServerConfig) -> anyhow::Result<Listeners> {
        let listener =
            tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?),
            None => None,
        };
        Ok(Listeners { listener, metrics })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

impl Server {
    /// Bind `config.listen`, then open everything (image, template, sessions, keys).
    pub async fn bind(mut config: ServerConfig) -> anyhow::Result<Server> {
        let listeners = Listeners::bind(&config).await?;
        advertise(&mut config, listeners.local_addr()?)?;
        Server::open(listeners, config).await
    }

    /// Open everything (image, template, sessions, keys; minutes on a first run) behind bound `listeners`.
    pub async fn open(listeners: Listeners, config: ServerConfig) -> anyhow::Result<Server> {
        let cfg = config.clone();
        let (state, created_key) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let runtime = Runtime::open(&cfg.home, cfg.runtime.clone())?;
            install_secrets_key(&cfg.home)?;
            install_egress_ca(&cfg.home)?;
            for name in &cfg.prebuild {
                runtime.prebuild(name).with_context(|| format!("--prebuild {name}"))?;
            }
            let tenant = cfg.default_tenant.clone();
            let state = Inner::with_runtime(runtime, cfg)?;
            let created_key = if keys::count_keys(state.keys.db())? == 0 {
                // The operator's key: an admin key (reads /metrics) with the default limits.
                Some(keys::create_key_full(state.keys.db(), &tenant, &KeyLimits::defaults(), true)?)
            } else {
                None
            };
            Ok((state, created_key))
        })
        .await??;
        Ok(Server { state, listener: listeners.listener, metrics: listeners.metrics, created_key })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Where `/metrics` is served on its own (if configured).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serve until `shutdown` completes, then finish in-flight requests and return.
    /// Runs session maintenance every `maintenance_every` meanwhile.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let runtime = self.state.runtime.clone();
        runtime.start_maintenance(|u| {
            metrics::evicted(u.evicted);
            metrics::sessions(u.resident);
        });
        if let Some(l) = self.metrics {
            let app = axum::Router::new()
                .route("/metrics", axum::routing::get(handlers::health::metrics_text))
                .with_state(self.state.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(l, app).await {
                    tracing::warn!("metrics listener: {e}");
                }
            });
        }
        background_cpu::spawn(&self.state);
        spawn_key_recheck(&self.state);
        let app = router(self.state);
        // A cluster node that is told to stop first drains: sessions asked for
        // meanwhile go to the other nodes, idle ones are given back at once.
        let rt = runtime.clone();
        let shutdown = async move {
            shutdown.await;
            if rt.node_id().is_some() {
                let _ = tokio::task::spawn_blocking(move || rt.leave_cluster()).await;
            }
        };
        // No Nagle: a streamed answer (NDJSON, Connect envelopes, SSE) writes a first small
        // event and the rest later, and Nagle would hold the rest for the client's delayed ACK
        // (40 ms on Linux).
        use axum::serve::ListenerExt as _;
        let listener = self.listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
            }
        });
        let r = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
        // Wait for a round of upkeep in progress, so the data directory is free once this returns;
        // the sessions of execs that were still running are given back now.
        tokio::task::spawn_blocking(move || {
            runtime.stop_maintenance();
            runtime.leave_cluster();
        })
        .await?;
        r.context("serving")
    }
}

/// Checks the cached API keys against the store every [`keys::RECHECK_EVERY`]
/// (a key revoked by the CLI or another node stops working here too). It
/// holds the state weakly: a server that shut down frees its data directory
/// (the sessions' lock) instead of this loop keeping it alive.
fn spawn_key_recheck(state: &AppState) {
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(keys::RECHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            let Some(st) = weak.upgrade() else { return };
            let r = tokio::task::spawn_blocking(move || st.keys.recheck()).await;
            match r {
                Ok(Ok(())) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::warn!("checking the cached API keys against the key store: {e} (retrying)");
                }
                Ok(Err(_)) => {}
                Err(e) => tracing::warn!("checking the cached API keys: {e}"),
            }
        }
    });
}

/// A cluster node without an advertised URL is reached at the address it is bound to.
fn advertise(config: &mut ServerConfig, addr: SocketAddr) -> anyhow::Result<()> {
    if let Some(c) = config.runtime.sessions.cluster.as_mut().filter(|c| c.url.is_empty()) {
        anyhow::ensure!(
            !addr.ip().is_unspecified(),
            "a cluster node listening on {addr} needs --advertise-url (the address the other nodes reach it at)"
        );
        c.url = format!("http://{addr}");
    }
    Ok(())
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
/// existed), serve until SIGINT/SIGTERM, then shut down gracefully. While it
/// serves, `<home>/server.json` ([`forkbox_api::handoff`]) tells CLI commands on
/// the same data directory to use this server.
/// Where the key that seals secrets at rest comes from: `FORKBOX_SECRETS_KEY`
/// (64 hex digits), else `secrets.key` in the data directory (made, mode
/// 0600, on first use).
pub const SECRETS_KEY_ENV: &str = "FORKBOX_SECRETS_KEY";

fn install_secrets_key(home: &std::path::Path) -> anyhow::Result<()> {
    use forkbox_runtime::net_secrets::{install_key, SealKey};
    let key = match std::env::var(SECRETS_KEY_ENV) {
        Ok(t) => SealKey::from_hex(&t).with_context(|| format!("{SECRETS_KEY_ENV}: not 64 hex digits"))?,
        Err(_) => SealKey::load_or_create(&home.join("secrets.key")).context("the secrets key (secrets.key)")?,
    };
    install_key(key);
    Ok(())
}

/// Where the egress CA (TLS secrets) comes from: `FORKBOX_EGRESS_CA_CERT` and
/// `FORKBOX_EGRESS_CA_KEY` (PEM files of an existing CA), else `egress-ca.pem`
/// and `egress-ca.key` (mode 0600) in the data directory, made on first use.
pub const EGRESS_CA_CERT_ENV: &str = "FORKBOX_EGRESS_CA_CERT";
pub const EGRESS_CA_KEY_ENV: &str = "FORKBOX_EGRESS_CA_KEY";

fn install_egress_ca(home: &std::path::Path) -> anyhow::Result<()> {
    use forkbox_runtime::net_tls::{install_ca, EgressCa};
    let ca = match (std::env::var_os(EGRESS_CA_CERT_ENV), std::env::var_os(EGRESS_CA_KEY_ENV)) {
        (Some(c), Some(k)) => {
            let read = |p: &std::ffi::OsStr, what: &str| {
                std::fs::read_to_string(p)
                    .with_context(|| format!("{what}: reading {}", std::path::Path::new(p).display()))
            };
            EgressCa::from_pem(&read(&c, EGRESS_CA_CERT_ENV)?, &read(&k, EGRESS_CA_KEY_ENV)?)
                .with_context(|| format!("{EGRESS_CA_CERT_ENV}, {EGRESS_CA_KEY_ENV}"))?
        }
        (None, None) => EgressCa::load_or_create(&home.join("egress-ca.pem"), &home.join("egress-ca.key"))
            .context("the egress CA (egress-ca.pem, egress-ca.key)")?,
        _ => anyhow::bail!("{EGRESS_CA_CERT_ENV} and {EGRESS_CA_KEY_ENV} go together"),
    };
    install_ca(ca);
    Ok(())
}

/// Secrets given as JSON (an object `{"NAME": {"value", "hosts", "ports"?,
/// "tls"?}}`, as a session's `secrets`), validated and sealed with the
/// secrets key of `home` (or `FORKBOX_SECRETS_KEY`): what `forkbox key create
/// --secrets-file` stores. An error never quotes a value.
pub fn seal_secrets_json(
    home: &std::path::Path,
    json: &str,
) -> anyhow::Result<Vec<forkbox_runtime::net_secrets::SealedSecret>> {
    let map: std::collections::BTreeMap<String, schema::SecretSpec> = serde_json::from_str(json).map_err(|e| {
        anyhow::anyhow!(
            "not a JSON object of secrets ({{\"NAME\": {{\"value\", \"hosts\", \"ports\", \"tls\"}}}}): {:?} error at line {} column {}",
            e.classify(),
            e.line(),
            e.column()
        )
    })?;
    install_secrets_key(home)?;
    if map.values().any(|s| s.tls) {
        install_egress_ca(home)?;
    }
    schema::seal_secrets(&map).map_err(|e| anyhow::anyhow!("{}", e.message))
}

pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    use forkbox_api::handoff::{ServerFile, CLI_TENANT};
    let home = config.home.clone();
    let previous = ServerFile::read(&home).ok().flatten();
    if let Some(p) = previous.as_ref().filter(|p| p.process_alive() && p.pid != std::process::id()) {
        anyhow::bail!(
            "{} is already served by forkbox (pid {}) at {}; stop it first or use another --home",
            home.display(),
            p.pid,
            p.url
        );
    }
    let listeners = Listeners::bind(&config).await?;
    let addr = listeners.local_addr()?;
    let mut config = config;
    advertise(&mut config, addr)?;
    eprintln!(
        "forkbox: bound http://{addr}; opening {} (a first start builds the image and template) ...",
        home.display()
    );
    let server = Server::open(listeners, config.clone()).await?;
    // The CLI's key for this run; a stale one of a server that died goes first.
    let h = home.clone();
    let state = server.state().clone();
    let file = tokio::task::spawn_blocking(move || -> anyhow::Result<ServerFile> {
        if let Some(p) = previous {
            keys::delete_key(state.keys.db(), &p.key)?;
        }
        let key = keys::create_key_full(state.keys.db(), CLI_TENANT, &KeyLimits::unlimited(), false)?;
        let url = if addr.ip().is_unspecified() {
            let local: std::net::IpAddr = if addr.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            };
            SocketAddr::new(local, addr.port())
        } else {
            addr
        };
        let file = ServerFile::new(format!("http://{url}"), std::process::id(), key);
        file.write(&h)?;
        Ok(file)
    })
    .await??;
    // Announced once `server.json` is written: a CLI started on that line finds this server.
    println!("forkbox listening on http://{addr} (data in {})", home.display());
    if let Some(m) = server.metrics_addr() {
        println!("metrics on http://{m}/metrics");
    }
    match &server.created_key {
        Some(k) => println!("API key (tenant {:?}; shown once, only its hash is stored): {k}", config.default_tenant),
        None => println!("API keys: use an existing one, or create one with `forkbox key create`"),
    }
    let state = server.state().clone();
    let r = server.run(shutdown_signal()).await;
    file.remove_if_mine(&home);
    // Blocking (the keys may be in PostgreSQL), and the last reference to the
    // state goes there too: its database connections close off the async threads.
    tokio::task::spawn_blocking(move || {
        if let Err(e) = keys::delete_key(state.keys.db(), &file.key) {
            tracing::warn!("deleting the CLI's key of this run: {e}");
        }
        drop(state);
    })
    .await?;
    r
}
