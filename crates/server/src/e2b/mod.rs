//! E2B's API over forkbox sessions, so E2B's SDKs (`e2b`, `e2b-code-interpreter`)
//! and what is built on them work unchanged against `forkbox serve` with
//! `E2B_API_URL` and `E2B_SANDBOX_URL` set to the server and `E2B_API_KEY` a
//! forkbox API key.
//!
//! An E2B *sandbox* is a forkbox session of the key's tenant (its id is the session
//! id): `metadata` are the session's tags, `envVars` its environment (set in the
//! guest when it is created), `timeout` its lifetime (a timer here kills it at the end,
//! or pauses it with `autoPause` or `serve --e2b-auto-pause`), `pause` evicts it to
//! disk, `connect` resumes it, `fork` forks its current state (the source keeps
//! running), a snapshot is a checkpoint template whose name is accepted later as
//! `templateID`. Template names: `code-interpreter-v1` is the `data` template,
//! `base` and `e2b` the server's default; any forkbox template name works too.
//!
//! Three surfaces, by concern:
//! - the control plane ([`control`]): `X-API-KEY` = a forkbox API key (its tenant,
//!   quotas, egress and rate limits); errors `{"code": <status>, "message"}`;
//! - envd (port 49983): Connect RPC with JSON ([`connect`], [`process`],
//!   [`filesystem`]) and its HTTP routes `/files`, `/health` ([`files`]);
//! - the code interpreter (port 49999): `/execute`, `/contexts` ([`interpreter`]).
//!
//! The data plane is routed by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers the
//! SDKs send (or `Host: <port>-<id>.<domain>`, or a signed `/files` URL), before the
//! forkbox routes are looked at ([`dispatch`]), and checks `X-Access-Token`: a random
//! token per sandbox, returned as `envdAccessToken` and kept in memory here only.
//! None of these routes are in forkbox's OpenAPI document.
//!
//! Sandbox records (token, timer, contexts) live in this process: after a restart a
//! sandbox is still a session, and `connect` gives it a new record and token.

mod connect;
mod control;
mod error;
mod files;
mod filesystem;
mod interpreter;
mod process;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use sha2::{Digest, Sha256};
use tower::ServiceExt;

use crate::auth::Caller;
use crate::keys::KeyInfo;
use crate::{AppState, Inner};

pub use error::{ConnectError, E2bError};

/// The envd version reported for every sandbox: the SDKs gate features on it
/// (`e2b/envd/versions.py`). 0.5.2: `stdin=False`, the default user and
/// `close_stdin`; not the octet-stream/gzip uploads (0.5.7) or file metadata
/// (0.6.2), which this does not serve.
pub const ENVD_VERSION: &str = "0.5.2";
/// envd's port in the routing header.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
pub const INTERPRETER_PORT: u16 = 49999;
/// A sandbox's lifetime when create does not say (E2B's default).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest lifetime a request may ask for (E2B's largest plan: 24 hours).
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// The home and default working directory of E2B's user.
pub const HOME: &str = "/home/user";
/// How often the lifetime timer looks for sandboxes past their end.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// What this server knows of an E2B sandbox beyond its session.
pub struct SandboxRec {
    pub id: String,
    pub tenant: String,
    /// The key that created (or last connected) it: its limits apply on the data plane too.
    pub key: Option<Arc<KeyInfo>>,
    /// `envdAccessToken` (never logged).
    token: String,
    /// The `templateID` it was created with.
    pub template: String,
    pub started_ms: i64,
    /// Pause instead of kill at the end of its lifetime.
    pub auto_pause: bool,
    pub state: Mutex<RecState>,
    /// Guest code owed before the sandbox's next call that needs the guest: E2B's
    /// sandbox setup (home, working directory, `envVars`) until it has run, and
    /// the undoing of an execution's `env_vars`. It rides with the next `/execute`
    /// or command as the start of its exec (so a new sandbox's first call is one
    /// exec and one checkpoint); any other call that needs the guest runs it on
    /// its own first.
    setup: Arc<tokio::sync::Mutex<Option<String>>>,
}

/// A sandbox's owed guest code, held (no other call of the sandbox runs it
/// meanwhile) until [`PendingSetup::done`], or dropped (still owed).
pub struct PendingSetup {
    guard: tokio::sync::OwnedMutexGuard<Option<String>>,
}

impl PendingSetup {
    /// The code owed, if any.
    pub fn code(&self) -> Option<&str> {
        self.guard.as_deref()
    }

    /// The owed code ran in the guest; `then` is owed from now on.
    pub fn done(mut self, then: Option<String>) {
        *self.guard = then;
    }
}

pub struct RecState {
    /// Unix ms at which its lifetime ends.
    pub end_ms: i64,
    pub paused: bool,
    /// Code contexts other than the default one: id -> (language, cwd).
    pub contexts: BTreeMap<String, (String, String)>,
    /// `/execute` calls so far (the interpreter's execution count).
    pub executions: u64,
    /// The config (and tag) of each process `process.Process/Start` started,
    /// by its pid in the session (for `List`; pruned to the session's processes).
    pub processes: BTreeMap<u32, serde_json::Value>,
    /// The processes started on a pty (their output is `pty` data, their input `pty` input).
    pub ptys: std::collections::BTreeSet<u32>,
    /// Its directory watchers, by id (see [`watch`]).
    pub watchers: BTreeMap<String, Arc<watch::Watcher>>,
    /// The last `get_metrics` sample: (unix ms, CPU seconds), for `cpuUsedPct` over the time since.
    pub cpu_sample: Option<(i64, f64)>,
    /// The figures of the last `get_metrics` (CPU %, memory, disk bytes): the answer
    /// while a call holds the sandbox (an exec, a file call).
    pub last_usage: Option<(f64, u64, u64)>,
}

impl SandboxRec {
    /// Who the data plane acts for.
    pub fn caller(&self) -> Caller {
        Caller { tenant: self.tenant.clone(), key: self.key.clone() }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The owed guest code, held, if there is any (waits while another call runs it).
    pub async fn pending_setup(&self) -> Option<PendingSetup> {
        let guard = self.setup.clone().lock_owned().await;
        guard.is_some().then_some(PendingSetup { guard })
    }

    /// The owed guest code, held, whether there is any or not.
    pub async fn hold_setup(&self) -> PendingSetup {
        PendingSetup { guard: self.setup.clone().lock_owned().await }
    }

    /// Run the owed guest code on its own, if there is any.
    pub async fn ensure_setup(&self, state: &AppState) -> Result<(), crate::error::ApiError> {
        if let Some(p) = self.pending_setup().await {
            let code = p.code().unwrap_or_default().to_string();
            control::run_setup(state, &self.caller(), &self.id, code).await?;
            p.done(None);
        }
        Ok(())
    }

    /// Whether `token` is this sandbox's (compared without an early exit).
    fn token_is(&self, token: &str) -> bool {
        let (a, b) = (Sha256::digest(self.token.as_bytes()), Sha256::digest(token.as_bytes()));
        a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// The E2B sandboxes of this server.
#[derive(Default)]
pub struct Sandboxes {
    map: Mutex<HashMap<String, Arc<SandboxRec>>>,
    reaper: AtomicBool,
}

impl Sandboxes {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<SandboxRec>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<SandboxRec>> {
        self.map().get(id).cloned()
    }

    /// The record of `id` if `tenant` owns it.
    pub fn owned(&self, tenant: &str, id: &str) -> Option<Arc<SandboxRec>> {
        self.get(id).filter(|r| r.tenant == tenant)
    }

    fn insert(&self, rec: SandboxRec) -> Arc<SandboxRec> {
        let rec = Arc::new(rec);
        self.map().insert(rec.id.clone(), rec.clone());
        rec
    }

    pub fn forget(&self, id: &str) {
        self.map().remove(id);
    }

    fn all(&self) -> Vec<Arc<SandboxRec>> {
        self.map().values().cloned().collect()
    }

    /// Start the lifetime timer (once per server).
    fn start_reaper(&self, state: &AppState) {
        if self.reaper.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(state);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_EVERY);
            loop {
                tick.tick().await;
                let Some(state) = weak.upgrade() else { return };
                control::reap(&state).await;
            }
        });
    }
}

/// A new random token (hex of 16 bytes from the kernel's CSPRNG).
fn new_token() -> Result<String, E2bError> {
    crate::keys::random_hex(16).map_err(|e| E2bError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The control plane's routes (behind `X-API-KEY`), outside the OpenAPI document.
pub fn control_routes(state: AppState) -> Router {
    control::routes(state)
}

/// The answer to an unknown route under E2B's prefixes (E2B's error shape), if `path` is one.
pub fn unknown_route_at(path: &str) -> Option<Response> {
    control::is_e2b_path(path).then(|| control::not_found().into_response())
}

/// Where a data-plane request goes.
struct Target {
    id: Option<String>,
    port: u16,
}

pub(crate) fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// The sandbox and port a request is for, if it is a data-plane request.
fn target(req: &Request) -> Option<Target> {
    let h = req.headers();
    if let Some(id) = header(h, "e2b-sandbox-id") {
        let port = header(h, "e2b-sandbox-port").and_then(|p| p.parse().ok()).unwrap_or(ENVD_PORT);
        return Some(Target { id: Some(id.to_string()), port });
    }
    // `Host: <port>-<id>.<domain>` (behind a wildcard proxy): envd, the
    // interpreter, or (`get_host(port)`) a server of the sandbox.
    if let Some(host) = header(h, "host") {
        let first = host.split('.').next().unwrap_or("");
        if host.contains('.') {
            if let Some((port, id)) = first.split_once('-') {
                if let (Ok(port @ 1..), false) = (port.parse::<u16>(), id.is_empty()) {
                    return Some(Target { id: Some(id.to_string()), port });
                }
            }
        }
    }
    // A signed download/upload URL carries neither: it is found by its signature.
    if req.uri().path() == "/files" && req.uri().query().is_some_and(|q| q.contains("signature=")) {
        return Some(Target { id: None, port: ENVD_PORT });
    }
    None
}

/// The data plane's routers.
#[derive(Clone)]
pub struct DataPlane {
    state: AppState,
    envd: Router,
    interpreter: Router,
}

impl DataPlane {
    pub fn new(state: AppState) -> DataPlane {
        let files_limit = state.config.files_limit;
        DataPlane {
            envd: Router::new()
                .merge(files::routes(files_limit))
                .merge(process::routes())
                .merge(filesystem::routes())
                .fallback(unknown_rpc)
                .with_state(state.clone()),
            interpreter: interpreter::routes().fallback(unknown_route).with_state(state.clone()),
            state,
        }
    }
}

async fn unknown_rpc() -> ConnectError {
    ConnectError::new(error::Code::Unimplemented, "no such procedure or route in envd here")
}

async fn unknown_route() -> ConnectError {
    ConnectError::new(error::Code::NotFound, "no such route in the code interpreter")
}

/// The middleware in front of every route: data-plane requests go to the
/// sandbox's envd or code interpreter, the rest to the forkbox routes.
pub async fn dispatch(State(dp): State<DataPlane>, mut req: Request, next: Next) -> Response {
    // `serve --sandbox-domain`: `<port>-<session id>.<domain>` is a forkbox session's port
    // (an E2B sandbox's too: it is a session).
    if let Some(domain) = dp.state.config.sandbox_domain.as_deref() {
        if let Some((port, id)) = crate::ports::host_target(req.headers(), domain) {
            if port != ENVD_PORT && port != INTERPRETER_PORT && !req.headers().contains_key("e2b-sandbox-id") {
                return match dp.state.e2b.get(&id) {
                    Some(rec) => e2b_port(&dp.state, rec, port, req).await,
                    None => crate::ports::by_host(dp.state.clone(), port, id, req).await,
                };
            }
        }
    }
    let Some(t) = target(&req) else { return next.run(req).await };
    if t.port != ENVD_PORT && t.port != INTERPRETER_PORT {
        // A server of the sandbox (`get_host(port)`); a Host of that form that is no E2B
        // sandbox of this server is not the data plane's.
        let Some(rec) = t.id.as_deref().and_then(|id| dp.state.e2b.get(id)) else {
            if req.headers().contains_key("e2b-sandbox-id") {
                return ConnectError::sandbox_gone(t.id.as_deref().unwrap_or("")).into_response();
            }
            return next.run(req).await;
        };
        return e2b_port(&dp.state, rec, t.port, req).await;
    }
    let rec = match authorize(&dp.state, &t, &req) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = rec.key.as_ref().map_or(Ok(()), |_| rec.caller().check_rate()) {
        return ConnectError::from(e).into_response();
    }
    // Every call that reads or changes the guest sees it set up. `/execute` and a
    // process start run the setup in their own exec; `/health` does not touch the guest.
    let path = req.uri().path();
    let setup_first = match t.port {
        INTERPRETER_PORT => path != "/execute",
        _ => path != "/process.Process/Start" && path != "/health",
    };
    if setup_first {
        if let Err(e) = rec.ensure_setup(&dp.state).await {
            let e = ConnectError::from(e);
            return if t.port == INTERPRETER_PORT { interpreter::from_connect(e) } else { e.into_response() };
        }
    }
    req.extensions_mut().insert(rec);
    let router = if t.port == INTERPRETER_PORT { dp.interpreter } else { dp.envd };
    match router.oneshot(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    }
}

/// A request for a server inside an E2B sandbox (`get_host(port)`): as an E2B
/// sandbox created with `allow_public_traffic=False`, it must carry the
/// sandbox's `trafficAccessToken` (`e2b-traffic-access-token`, or its envd
/// token as `X-Access-Token`): a sandbox id is not a secret here.
async fn e2b_port(state: &AppState, rec: Arc<SandboxRec>, port: u16, req: Request) -> Response {
    let h = req.headers();
    let token = header(h, "e2b-traffic-access-token").or_else(|| header(h, "x-access-token"));
    if !token.is_some_and(|t| rec.token_is(t)) {
        let msg = "a sandbox's ports need its traffic access token: send `e2b-traffic-access-token: <sandbox.traffic_access_token>`";
        return ConnectError::new(error::Code::Unauthenticated, msg).into_response();
    }
    if let Err(e) = rec.key.as_ref().map_or(Ok(()), |_| rec.caller().check_rate()) {
        return e.into_response();
    }
    crate::ports::for_e2b(state.clone(), rec.tenant.clone(), port, rec.id.clone(), req).await
}

/// The sandbox a data-plane request may act on: its record, with the right token.
fn authorize(state: &AppState, t: &Target, req: &Request) -> Result<Arc<SandboxRec>, ConnectError> {
    let Some(id) = &t.id else { return signed(state, req) };
    let rec = state.e2b.get(id).ok_or_else(|| ConnectError::sandbox_gone(id))?;
    let token = header(req.headers(), "x-access-token");
    // The code interpreter SDKs send no token with their context calls (only with /execute).
    let contexts = t.port == INTERPRETER_PORT && req.uri().path().starts_with("/contexts");
    let tokenless_context = token.is_none() && contexts;
    if !tokenless_context && !rec.token_is(token.unwrap_or("")) {
        return Err(ConnectError::new(
            error::Code::Unauthenticated,
            "missing or wrong X-Access-Token for this sandbox (use the envdAccessToken it was created with)",
        ));
    }
    Ok(rec)
}

/// The sandbox whose token signs this `/files` URL (`download_url` / `upload_url`).
fn signed(state: &AppState, req: &Request) -> Result<Arc<SandboxRec>, ConnectError> {
    let q = crate::extractors::query_pairs(req.uri().query()).map_err(|e| ConnectError::invalid(e.message))?;
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let (Some(path), Some(sig)) = (get("path"), get("signature")) else {
        return Err(ConnectError::invalid("a signed URL needs path and signature"));
    };
    let op = if req.method() == axum::http::Method::GET { "read" } else { "write" };
    let exp = get("signature_expiration");
    if let Some(e) = exp {
        let e: i64 = e.parse().map_err(|_| ConnectError::invalid("signature_expiration is not a number"))?;
        if e * 1000 < now_ms() {
            return Err(ConnectError::new(error::Code::Unauthenticated, "the signed URL has expired"));
        }
    }
    let user = get("username").unwrap_or("");
    state
        .e2b
        .all()
        .into_iter()
        .find(|r| r.sign(path, op, user, exp) == sig)
        .ok_or_else(|| ConnectError::new(error::Code::Unauthenticated, "the URL's signature matches no sandbox"))
}

impl SandboxRec {
    fn sign(&self, path: &str, operation: &str, user: &str, expiration: Option<&str>) -> String {
        let raw = match expiration {
            None => format!("{path}:{operation}:{user}:{}", self.token),
            Some(e) => format!("{path}:{operation}:{user}:{}:{e}", self.token),
        };
        use base64::Engine as _;
        format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes())))
    }
}

/// A guest path as E2B means it: relative paths are under the user's home.
pub fn guest_path(path: &str) -> Result<String, ConnectError> {
    if path.is_empty() {
        return Err(ConnectError::invalid("path is empty"));
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err(ConnectError::invalid("path is over 4096 bytes or holds a NUL byte"));
    }
    Ok(if let Some(rest) = path.strip_prefix("~/") {
        format!("{HOME}/{rest}")
    } else if path == "~" {
        HOME.to_string()
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{HOME}/{path}")
    })
}
