//! Routes and handlers.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use forkbox_engine::{ExecResult, Limits};
use forkbox_sessions::store::SessionRecord;
use serde::de::DeserializeOwned;
use tokio::sync::OwnedSemaphorePermit;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ApiError, ErrorBody};
use crate::keys::KeyInfo;
use crate::quota::{self, KeyLimits};
use crate::schema::*;
use crate::{files, metrics, openapi, stream, AppState, Inner};

/// Who a request acts for: the tenant of its API key (and the key's limits),
/// or the fixed tenant of an embedded router (no limits).
#[derive(Clone)]
pub struct Caller {
    pub tenant: String,
    pub key: Option<Arc<KeyInfo>>,
}

impl Caller {
    pub fn limits(&self) -> Option<&KeyLimits> {
        self.key.as_ref().map(|k| &k.limits)
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "forkbox", description = "Run untrusted Python in hardware-isolated KVM sandboxes: one-shot execs, sessions with checkpoints, ForeverVM-compatible machines."),
    modifiers(&BearerAuth),
    components(schemas(ErrorBody))
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let comps = doc.components.get_or_insert_with(Default::default);
        comps.add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
}

/// The `/v1` routes that act for a caller (auth is layered on by the caller of this).
fn v1_routes(files_limit: usize) -> OpenApiRouter<AppState> {
    let (schemas, paths, file_routes) = routes!(files::put_file, files::get_file);
    // Uploads may be larger than JSON bodies.
    let file_routes = (schemas, paths, file_routes.layer(DefaultBodyLimit::max(files_limit)));
    OpenApiRouter::new()
        .routes(routes!(exec))
        .routes(routes!(stream::exec_stream))
        .routes(routes!(exec_batch))
        .routes(routes!(create_session, list_sessions))
        .routes(routes!(get_session, delete_session))
        .routes(routes!(session_exec))
        .routes(routes!(stream::session_exec_stream))
        .routes(routes!(interrupt))
        .routes(file_routes)
        .routes(routes!(files::list_files))
        .routes(routes!(checkpoints))
        .routes(routes!(revert))
        .routes(routes!(fork))
        .merge(crate::forevervm::routes())
}

/// The routes and the OpenAPI document they produce. `caller` adds the layer
/// that puts a [`Caller`] into each `/v1` request (auth, or a fixed tenant).
fn build(state: AppState, caller: impl FnOnce(OpenApiRouter<AppState>) -> OpenApiRouter<AppState>) -> Router {
    let v1 = caller(v1_routes(state.config.files_limit)).routes(routes!(openapi_json));
    let (router, mut doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(metrics_text))
        .nest("/v1", v1)
        .split_for_parts();
    openapi::finish(&mut doc);
    let doc = Arc::new(doc.to_json().unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")));
    router
        .layer(Extension(OpenApiDoc(doc)))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .with_state(state)
}

/// The API's routes over `state`, every `/v1` route but the OpenAPI document
/// behind `Authorization: Bearer <key>`; and `/mcp` over them.
pub fn router(state: AppState) -> Router {
    let st = state.clone();
    let api = build(state.clone(), move |v1| v1.route_layer(middleware::from_fn_with_state(st, auth)));
    with_mcp(state, api)
}

/// `/mcp`: the MCP server (streamable HTTP, `forkbox_mcp`) behind the same API
/// keys (and rate limits); its tool calls go to `api` in process with the caller's key.
fn with_mcp(state: AppState, api: Router) -> Router {
    let mcp = Router::new()
        .fallback_service(forkbox_mcp::http_service(api.clone()))
        .layer(middleware::from_fn_with_state(state, auth));
    api.nest_service("/mcp", mcp)
}

/// The same routes for one fixed tenant, without keys, rate limits or quotas:
/// what the CLI and `forkbox mcp` drive in process (no socket) when no `--url` is given.
pub fn embedded_router(state: AppState, tenant: &str) -> Router {
    let caller = Caller { tenant: tenant.to_string(), key: None };
    build(state, move |v1| v1.route_layer(Extension(caller)))
}

/// The OpenAPI document (JSON), rendered once per router.
#[derive(Clone)]
struct OpenApiDoc(Arc<String>);

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this endpoint")
}

// ---------------------------------------------------------------------------
// Auth, JSON bodies, exec slots
// ---------------------------------------------------------------------------

async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Result<Response, ApiError> {
    let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::trim);
    let Some(key) = header.and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer "))).map(str::trim)
    else {
        return Err(ApiError::unauthorized("missing API key: send `Authorization: Bearer <key>`"));
    };
    let info = match state.keys.cached(key) {
        Some(t) => Some(t),
        None => {
            let st = state.clone();
            let k = key.to_string();
            tokio::task::spawn_blocking(move || st.keys.lookup(&k))
                .await?
                .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        }
    };
    let Some(info) = info else { return Err(ApiError::unauthorized("unknown API key")) };
    if let Some(limiter) = &info.limiter {
        limiter.check().map_err(quota::rate_limited)?;
    }
    req.extensions_mut().insert(Caller { tenant: info.tenant.clone(), key: Some(info) });
    Ok(next.run(req).await)
}

/// A JSON body. Any content type is accepted; an empty body is `{}`. Errors
/// come in the API's shape: 400 `malformed_json`, 400 `invalid_request` (wrong
/// shape), 413 `payload_too_large` (over the body limit).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", "request body is over the size limit")
            } else {
                ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", rej.body_text())
            }
        })?;
        let body: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        serde_json::from_slice(body).map(ApiJson).map_err(|e| match e.classify() {
            serde_json::error::Category::Data => ApiError::invalid(format!("invalid request body: {e}")),
            _ => ApiError::new(StatusCode::BAD_REQUEST, "malformed_json", format!("request body is not valid JSON: {e}")),
        })
    }
}

/// A path parameter; a bad one (e.g. a number out of range) is 400 `invalid_request` in the API's shape.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| ApiPath(v))
            .map_err(|rej| ApiError::invalid(format!("invalid path parameter: {}", rej.body_text())))
    }
}

struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `n` exec slots, waiting in the bounded queue if need be; 503 past it.
pub(crate) async fn acquire(state: &Inner, n: usize) -> Result<OwnedSemaphorePermit, ApiError> {
    let n = n.clamp(1, state.concurrency) as u32;
    if let Ok(p) = state.permits.clone().try_acquire_many_owned(n) {
        return Ok(p);
    }
    let max_queue = if state.config.max_queue > 0 { state.config.max_queue } else { state.concurrency * 8 };
    let ahead = state.queued.fetch_add(1, Ordering::SeqCst);
    let _q = Queued(&state.queued);
    if ahead >= max_queue {
        return Err(ApiError::overloaded());
    }
    match tokio::time::timeout(state.config.queue_wait, state.permits.clone().acquire_many_owned(n)).await {
        Ok(Ok(p)) => Ok(p),
        _ => Err(ApiError::overloaded()),
    }
}

pub(crate) fn check_code(state: &Inner, code: &str) -> Result<(), ApiError> {
    if code.len() > state.config.code_limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "code_too_large",
            format!("code is {} bytes, more than the {}-byte limit", code.len(), state.config.code_limit),
        ));
    }
    Ok(())
}

/// The limits of a one-shot exec: the server's defaults with the request's timeout.
pub(crate) fn oneshot_limits(state: &Inner, timeout_seconds: Option<f64>) -> Result<Limits, ApiError> {
    let mut limits = state.config.limits.clone();
    limits.timeout = timeout_of(state, timeout_seconds)?;
    limits.code_bytes = state.config.code_limit;
    Ok(limits)
}

/// Narrow `limits`' network by a request's setting (a new innermost layer).
pub(crate) fn with_network(mut limits: Limits, network: Option<&crate::schema::NetworkSetting>) -> Result<Limits, ApiError> {
    if let Some(n) = network {
        let p = n.policy().map_err(|e| ApiError::invalid(format!("network: {e}")))?;
        limits.network = limits.network.narrowed(p);
    }
    Ok(limits)
}

/// The effective network policy as shown to clients.
pub(crate) fn network_view(net: &forkbox_engine::NetConfig) -> serde_json::Value {
    serde_json::json!({ "mode": net.mode(), "layers": net.layers })
}

pub(crate) fn timeout_of(state: &Inner, seconds: Option<f64>) -> Result<Duration, ApiError> {
    match seconds {
        None => Ok(state.config.limits.timeout),
        Some(s) if s.is_finite() && s > 0.0 && s <= state.config.max_timeout.as_secs_f64() => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(ApiError::invalid(format!(
            "timeout_seconds must be > 0 and <= {}, got {s}",
            state.config.max_timeout.as_secs_f64()
        ))),
    }
}

pub(crate) fn outcome_of(r: &Result<ExecResult, impl Sized>) -> &'static str {
    match r {
        Ok(r) if r.error.is_some() => "python_error",
        Ok(_) => "ok",
        Err(_) => "error",
    }
}

pub(crate) fn random_id(prefix: &str) -> String {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    format!("{prefix}{}", hex::encode(b))
}

/// Run an engine call on an exec thread (see [`crate::workers`]); the caller holds an exec slot.
pub(crate) async fn on_exec_thread<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Inner) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = state.clone();
    state.workers.run(move || f(&s)).await?
}

/// Run a blocking closure (SQLite, files) on the blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Inner) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = state.clone();
    tokio::task::spawn_blocking(move || f(&s)).await?
}

// ---------------------------------------------------------------------------
// One-shot exec
// ---------------------------------------------------------------------------

/// Fork the template, run the code, drop the fork.
#[utoipa::path(post, path = "/exec", tag = "exec", request_body = ExecRequest,
    responses((status = 200, description = "The result (a Python exception is a result with `error` set)", body = ExecResponse),
              (status = 408, description = "The code ran past its time limit", body = ErrorBody),
              (status = 422, description = "The code took the guest down", body = ErrorBody)))]
async fn exec(State(state): State<AppState>, ApiJson(req): ApiJson<ExecRequest>) -> Result<Json<ExecResponse>, ApiError> {
    let t0 = Instant::now();
    check_code(&state, &req.code)?;
    let limits = with_network(oneshot_limits(&state, req.timeout_seconds)?, req.network.as_ref())?;
    let permit = acquire(&state, 1).await?;
    // The reply is sent before the sandbox is dropped: its teardown (the VM goes
    // back to the pool) happens off the response path, still under the permit.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let s = state.clone();
    state.workers.spawn(move || {
        let _permit = permit;
        let t = Instant::now();
        let mut sb = match s.template.fork(&s.engine, limits) {
            Ok(sb) => sb,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        let fork = t.elapsed();
        metrics::fork(fork.as_secs_f64());
        let t = Instant::now();
        let r = sb.exec(&req.code);
        let exec = t.elapsed();
        let _ = tx.send(Ok((r, fork.as_secs_f64() * 1000.0, exec.as_secs_f64() * 1000.0)));
        drop(sb);
    });
    let (r, fork_ms, exec_ms) = rx.await.map_err(|_| ApiError::internal("the exec worker went away"))??;
    metrics::exec("oneshot", outcome_of(&r), t0.elapsed().as_secs_f64());
    let mut v = ExecResponse::of(&r?);
    v.id = Some(random_id("x_"));
    v.fork_time_ms = Some(fork_ms);
    v.exec_time_ms = Some(exec_ms);
    v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
    Ok(Json(v))
}

/// Each code in its own fork, in parallel. `results[i]` is the result of
/// `codes[i]`, or `{"status", "error": {"code", "message"}}` if that exec failed.
#[utoipa::path(post, path = "/exec/batch", tag = "exec", request_body = BatchRequest,
    responses((status = 200, description = "One item per code, in order", body = BatchResponse)))]
async fn exec_batch(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let t0 = Instant::now();
    let n = req.codes.len();
    if n == 0 || n > state.config.max_batch {
        return Err(ApiError::invalid(format!("codes must hold 1 to {} items, got {n}", state.config.max_batch)));
    }
    for c in &req.codes {
        check_code(&state, c)?;
    }
    let limits = oneshot_limits(&state, req.timeout_seconds)?;
    let workers = n.min((state.concurrency / 2).max(1));
    let permit = acquire(&state, workers).await?;
    let results = blocking(&state, move |s| {
        let _permit = permit;
        Ok(s.engine.exec_batch(&s.template, &req.codes, &limits, workers))
    })
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    let out = results
        .into_iter()
        .map(|r| {
            metrics::exec("batch", outcome_of(&r), secs);
            match r {
                Ok(r) => BatchItem::Ok(Box::new(ExecResponse::of(&r))),
                Err(e) => {
                    let e = ApiError::from(e);
                    metrics::error(e.code);
                    BatchItem::Failed(BatchItemError { status: e.status.as_u16(), error: e.detail() })
                }
            }
        })
        .collect();
    Ok(Json(BatchResponse { results: out, total_time_ms: t0.elapsed().as_secs_f64() * 1000.0 }))
}

// ---------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------

pub(crate) fn session_body(s: &Inner, rec: &SessionRecord) -> Session {
    let head = rec.head.and_then(|h| s.sessions.store().checkpoint(h).ok().flatten());
    let (checkpoint, forked_from) = match head {
        Some(c) if c.session_id == rec.id => (Some(c.seq), None),
        Some(c) => (None, Some(ForkedFrom { session: c.session_id, checkpoint: c.seq })),
        None => (None, None),
    };
    Session {
        id: rec.id.clone(),
        tags: rec.tags.clone(),
        created_ms: rec.created_ms,
        last_used_ms: rec.last_used_ms,
        resident: s.sessions.is_resident(&rec.id),
        checkpoint,
        forked_from,
        limits: SessionLimits {
            memory_mb: rec.limits.memory_bytes >> 20,
            timeout_seconds: rec.limits.timeout_ms as f64 / 1000.0,
            network: network_view(
                &rec.limits.network.as_deref().and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default(),
            ),
        },
    }
}

pub(crate) fn check_tags(tags: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if tags.len() > 32 || tags.iter().any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains(':')) {
        return Err(ApiError::invalid("tags: at most 32, keys 1-128 bytes without ':', values at most 1024 bytes"));
    }
    Ok(())
}

/// The limits of a new session from a request's `memory_mb` / `timeout_seconds`.
pub(crate) fn session_limits(
    state: &Inner,
    memory_mb: Option<u64>,
    timeout_seconds: Option<f64>,
) -> Result<forkbox_engine::Limits, ApiError> {
    let mut limits = state.config.limits.clone();
    limits.timeout = timeout_of(state, timeout_seconds)?;
    if let Some(mb) = memory_mb {
        if mb < 64 || mb > state.config.max_memory_mb {
            return Err(ApiError::invalid(format!("memory_mb must be 64 to {}, got {mb}", state.config.max_memory_mb)));
        }
        limits.memory_bytes = mb << 20;
    }
    Ok(limits)
}

/// Create a session within the caller's session quota. Blocking.
pub(crate) fn create_within_quota(
    s: &Inner,
    caller: &Caller,
    tags: BTreeMap<String, String>,
    limits: &forkbox_engine::Limits,
) -> Result<SessionRecord, ApiError> {
    // Count and create under one lock, so concurrent creates cannot overshoot the quota.
    let _g = s.create_lock.lock().unwrap_or_else(|e| e.into_inner());
    quota::check_sessions(s, &caller.tenant, caller.limits())?;
    Ok(s.sessions.create(&caller.tenant, tags, limits)?)
}

#[utoipa::path(post, path = "/sessions", tag = "sessions", request_body = CreateSession,
    responses((status = 201, description = "The new session", body = Session)))]
async fn create_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    check_tags(&req.tags)?;
    let limits = with_network(session_limits(&state, req.memory_mb, req.timeout_seconds)?, req.network.as_ref())?;
    let v = blocking(&state, move |s| {
        let rec = create_within_quota(s, &caller, req.tags, &limits)?;
        Ok(session_body(s, &rec))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// The caller's sessions, newest last; `tag=key:value` (repeatable) keeps those with all the tags.
#[utoipa::path(get, path = "/sessions", tag = "sessions",
    params(("tag" = Option<Vec<String>>, Query, description = "key:value; repeat for several (all must match)")),
    responses((status = 200, body = SessionList)))]
async fn list_sessions(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Json<SessionList>, ApiError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::invalid(format!("query string: {e}")))?;
    let mut tags = Vec::new();
    for (k, v) in pairs {
        if k != "tag" {
            return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use tag=key:value)")));
        }
        let (tk, tv) = v.split_once(':').ok_or_else(|| ApiError::invalid(format!("tag filter {v:?} is not key:value")))?;
        tags.push((tk.to_string(), tv.to_string()));
    }
    blocking(&state, move |s| {
        let list = s.sessions.list(&caller.tenant, &tags)?;
        Ok(Json(SessionList { sessions: list.iter().map(|r| session_body(s, r)).collect() }))
    })
    .await
}

#[utoipa::path(get, path = "/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Session)))]
async fn get_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Session>, ApiError> {
    blocking(&state, move |s| Ok(Json(session_body(s, &s.sessions.get(&caller.tenant, &id)?)))).await
}

#[utoipa::path(delete, path = "/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 204, description = "Deleted"), (status = 409, description = "An exec is running in it", body = ErrorBody)))]
async fn delete_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&state, move |s| {
        s.sessions.delete(&caller.tenant, &id)?;
        s.machines.forget(&id);
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// Run code in the session; the result names the checkpoint that recorded it.
#[utoipa::path(post, path = "/sessions/{id}/exec", tag = "sessions", request_body = SessionExec,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = ExecResponse),
              (status = 408, description = "Timeout; the session was rolled back (error.checkpoint)", body = ErrorBody),
              (status = 409, description = "Another exec is running in the session", body = ErrorBody),
              (status = 422, description = "The code took the guest down; the session was rolled back", body = ErrorBody)))]
async fn session_exec(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SessionExec>,
) -> Result<Json<ExecResponse>, ApiError> {
    let t0 = Instant::now();
    check_code(&state, &req.code)?;
    let permit = acquire(&state, 1).await?;
    let r = on_exec_thread(&state, move |s| {
        let _permit = permit;
        quota::check_disk(s, &caller.tenant, caller.limits())?;
        let r = s.sessions.exec(&caller.tenant, &id, &req.code);
        metrics::sessions(s.sessions.resident_count());
        Ok(r)
    })
    .await?;
    let outcome = match &r {
        Ok(o) if o.result.error.is_some() => "python_error",
        Ok(_) => "ok",
        Err(_) => "error",
    };
    metrics::exec("session", outcome, t0.elapsed().as_secs_f64());
    let o = r?;
    metrics::checkpoint_bytes(o.checkpoint.bytes);
    let mut v = ExecResponse::of(&o.result);
    v.checkpoint = Some(o.checkpoint.seq);
    v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
    Ok(Json(v))
}

/// Interrupt (Ctrl-C) the exec running in the session: the code gets a KeyboardInterrupt,
/// the session keeps its state. `interrupted` is false if no exec was running.
#[utoipa::path(post, path = "/sessions/{id}/interrupt", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Interrupted)))]
async fn interrupt(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Interrupted>, ApiError> {
    // Not behind an exec slot: it must get through while every slot is busy.
    blocking(&state, move |s| Ok(Json(Interrupted { interrupted: s.sessions.interrupt(&caller.tenant, &id)? }))).await
}

#[utoipa::path(get, path = "/sessions/{id}/checkpoints", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = CheckpointList)))]
async fn checkpoints(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<CheckpointList>, ApiError> {
    blocking(&state, move |s| {
        let rec = s.sessions.get(&caller.tenant, &id)?;
        let list = s.sessions.checkpoints(&caller.tenant, &id)?;
        let seq_of: HashMap<i64, i64> = list.iter().map(|c| (c.id, c.seq)).collect();
        let checkpoints = list
            .iter()
            .map(|c| Checkpoint {
                seq: c.seq,
                parent: c.parent.and_then(|p| seq_of.get(&p).copied()),
                code: c.code.clone(),
                created_ms: c.created_ms,
                bytes: c.bytes,
                pages: c.pages,
                head: Some(c.id) == rec.head,
            })
            .collect();
        Ok(Json(CheckpointList { checkpoints }))
    })
    .await
}

/// Move the session's head back to a checkpoint; the next exec branches from there.
#[utoipa::path(post, path = "/sessions/{id}/revert", tag = "sessions", request_body = RevertRequest,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Session), (status = 409, description = "An exec is running in the session", body = ErrorBody)))]
async fn revert(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<RevertRequest>,
) -> Result<Json<Session>, ApiError> {
    blocking(&state, move |s| {
        s.sessions.revert(&caller.tenant, &id, req.checkpoint)?;
        Ok(Json(session_body(s, &s.sessions.get(&caller.tenant, &id)?)))
    })
    .await
}

/// A new session starting at a checkpoint (default: the head) of this one.
#[utoipa::path(post, path = "/sessions/{id}/fork", tag = "sessions", request_body = ForkRequest,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 201, body = Session)))]
async fn fork(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    check_tags(&req.tags)?;
    let v = blocking(&state, move |s| {
        let _g = s.create_lock.lock().unwrap_or_else(|e| e.into_inner());
        quota::check_sessions(s, &caller.tenant, caller.limits())?;
        let rec = s.sessions.fork(&caller.tenant, &id, req.checkpoint, req.tags)?;
        Ok(session_body(s, &rec))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

// ---------------------------------------------------------------------------
// Health, metrics, the OpenAPI document
// ---------------------------------------------------------------------------

#[utoipa::path(get, path = "/healthz", tag = "server", security(()), responses((status = 200, body = Health)))]
async fn healthz(State(state): State<AppState>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        template: state.template.info.id.clone(),
        exec_slots: state.concurrency,
        exec_slots_free: state.permits.available_permits(),
        queued: state.queued.load(Ordering::SeqCst),
        resident_sessions: state.sessions.resident_count(),
    })
}

#[utoipa::path(get, path = "/metrics", tag = "server", security(()),
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String)))]
async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    metrics::sessions(state.sessions.resident_count());
    metrics::network();
    let s = state.clone();
    if let Ok(Ok(n)) = tokio::task::spawn_blocking(move || s.sessions.store().count_sessions(None)).await {
        metrics::sessions_live(n);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::handle().render())
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object)))]
async fn openapi_json(Extension(OpenApiDoc(doc)): Extension<OpenApiDoc>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], doc.as_str().to_owned())
}
