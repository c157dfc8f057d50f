//! Routes and handlers.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use forkbox_engine::ExecResult;
use forkbox_sessions::store::SessionRecord;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::OwnedSemaphorePermit;

use crate::error::ApiError;
use crate::{metrics, AppState, Inner};

/// The tenant of the request's API key.
#[derive(Clone, Debug)]
pub struct Tenant(pub String);

/// The API's routes over `state`, and `/mcp` over them.
pub fn router(state: AppState) -> Router {
    with_mcp(state.clone(), api_routes(state))
}

/// `/mcp`: the MCP server (streamable HTTP, `forkbox_mcp`) behind the same API
/// keys; its tool calls go to `api` in process with the caller's key.
fn with_mcp(state: AppState, api: Router) -> Router {
    let mcp = Router::new()
        .fallback_service(forkbox_mcp::http_service(api.clone()))
        .layer(middleware::from_fn_with_state(state, auth));
    api.nest_service("/mcp", mcp)
}

fn api_routes(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/exec", post(exec))
        .route("/exec/batch", post(exec_batch))
        .route("/sessions", post(create_session).get(list_sessions))
        .route("/sessions/{id}", get(get_session).delete(delete_session))
        .route("/sessions/{id}/exec", post(session_exec))
        .route("/sessions/{id}/checkpoints", get(checkpoints))
        .route("/sessions/{id}/revert", post(revert))
        .route("/sessions/{id}/fork", post(fork))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .nest("/v1", v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .with_state(state)
}

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
    let tenant = match state.keys.cached(key) {
        Some(t) => Some(t),
        None => {
            let st = state.clone();
            let k = key.to_string();
            tokio::task::spawn_blocking(move || st.keys.tenant(&k))
                .await?
                .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        }
    };
    let Some(tenant) = tenant else { return Err(ApiError::unauthorized("unknown API key")) };
    req.extensions_mut().insert(Tenant(tenant));
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

struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `n` exec slots, waiting in the bounded queue if need be; 503 past it.
async fn acquire(state: &Inner, n: usize) -> Result<OwnedSemaphorePermit, ApiError> {
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

fn check_code(state: &Inner, code: &str) -> Result<(), ApiError> {
    if code.len() > state.config.code_limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "code_too_large",
            format!("code is {} bytes, more than the {}-byte limit", code.len(), state.config.code_limit),
        ));
    }
    Ok(())
}

fn timeout_of(state: &Inner, seconds: Option<f64>) -> Result<Duration, ApiError> {
    match seconds {
        None => Ok(state.config.limits.timeout),
        Some(s) if s.is_finite() && s > 0.0 && s <= state.config.max_timeout.as_secs_f64() => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(ApiError::invalid(format!(
            "timeout_seconds must be > 0 and <= {}, got {s}",
            state.config.max_timeout.as_secs_f64()
        ))),
    }
}

fn result_json(r: &ExecResult) -> Value {
    let mut v = serde_json::to_value(r).unwrap_or_else(|_| json!({}));
    v["exit_code"] = json!(if r.error.is_some() { 1 } else { 0 });
    v
}

fn outcome_of(r: &Result<ExecResult, impl Sized>) -> &'static str {
    match r {
        Ok(r) if r.error.is_some() => "python_error",
        Ok(_) => "ok",
        Err(_) => "error",
    }
}

fn random_id(prefix: &str) -> String {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    format!("{prefix}{}", hex::encode(b))
}

/// Run a blocking closure on the blocking pool.
async fn blocking<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Inner) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = state.clone();
    tokio::task::spawn_blocking(move || f(&s)).await?
}

// ---------------------------------------------------------------------------
// One-shot exec
// ---------------------------------------------------------------------------

#[derive(Deserialize)]
struct ExecRequest {
    code: String,
    timeout_seconds: Option<f64>,
}

async fn exec(State(state): State<AppState>, ApiJson(req): ApiJson<ExecRequest>) -> Result<Json<Value>, ApiError> {
    let t0 = Instant::now();
    check_code(&state, &req.code)?;
    let mut limits = state.config.limits.clone();
    limits.timeout = timeout_of(&state, req.timeout_seconds)?;
    limits.code_bytes = state.config.code_limit;
    let permit = acquire(&state, 1).await?;
    // The reply is sent before the sandbox is dropped: its teardown (the VM goes
    // back to the pool) happens off the response path, still under the permit.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let s = state.clone();
    tokio::task::spawn_blocking(move || {
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
    let mut v = result_json(&r?);
    v["id"] = json!(random_id("x_"));
    v["fork_time_ms"] = json!(fork_ms);
    v["exec_time_ms"] = json!(exec_ms);
    v["total_time_ms"] = json!(t0.elapsed().as_secs_f64() * 1000.0);
    Ok(Json(v))
}

#[derive(Deserialize)]
struct BatchRequest {
    codes: Vec<String>,
    timeout_seconds: Option<f64>,
}

/// Each code in its own fork, in parallel. `results[i]` is the result of
/// `codes[i]`, or `{"status", "error": {"code", "message"}}` if that exec failed.
async fn exec_batch(State(state): State<AppState>, ApiJson(req): ApiJson<BatchRequest>) -> Result<Json<Value>, ApiError> {
    let t0 = Instant::now();
    let n = req.codes.len();
    if n == 0 || n > state.config.max_batch {
        return Err(ApiError::invalid(format!("codes must hold 1 to {} items, got {n}", state.config.max_batch)));
    }
    for c in &req.codes {
        check_code(&state, c)?;
    }
    let mut limits = state.config.limits.clone();
    limits.timeout = timeout_of(&state, req.timeout_seconds)?;
    limits.code_bytes = state.config.code_limit;
    let workers = n.min((state.concurrency / 2).max(1));
    let permit = acquire(&state, workers).await?;
    let results = blocking(&state, move |s| {
        let _permit = permit;
        Ok(s.engine.exec_batch(&s.template, &req.codes, &limits, workers))
    })
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    let out: Vec<Value> = results
        .into_iter()
        .map(|r| {
            metrics::exec("batch", outcome_of(&r), secs);
            match r {
                Ok(r) => result_json(&r),
                Err(e) => {
                    let e = ApiError::from(e);
                    metrics::error(e.code);
                    json!({ "status": e.status.as_u16(), "error": { "code": e.code, "message": e.message } })
                }
            }
        })
        .collect();
    Ok(Json(json!({ "results": out, "total_time_ms": t0.elapsed().as_secs_f64() * 1000.0 })))
}

// ---------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------

fn session_json(s: &Inner, rec: &SessionRecord) -> Value {
    let head = rec.head.and_then(|h| s.sessions.store().checkpoint(h).ok().flatten());
    let (checkpoint, forked_from) = match &head {
        Some(c) if c.session_id == rec.id => (json!(c.seq), Value::Null),
        Some(c) => (Value::Null, json!({ "session": c.session_id, "checkpoint": c.seq })),
        None => (Value::Null, Value::Null),
    };
    json!({
        "id": rec.id,
        "tags": rec.tags,
        "created_ms": rec.created_ms,
        "last_used_ms": rec.last_used_ms,
        "resident": s.sessions.is_resident(&rec.id),
        "checkpoint": checkpoint,
        "forked_from": forked_from,
        "limits": {
            "memory_mb": rec.limits.memory_bytes >> 20,
            "timeout_seconds": rec.limits.timeout_ms as f64 / 1000.0,
        },
    })
}

#[derive(Deserialize)]
struct CreateSession {
    #[serde(default)]
    tags: BTreeMap<String, String>,
    memory_mb: Option<u64>,
    timeout_seconds: Option<f64>,
}

fn check_tags(tags: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if tags.len() > 32 || tags.iter().any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains(':')) {
        return Err(ApiError::invalid("tags: at most 32, keys 1-128 bytes without ':', values at most 1024 bytes"));
    }
    Ok(())
}

async fn create_session(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    ApiJson(req): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    check_tags(&req.tags)?;
    let mut limits = state.config.limits.clone();
    limits.timeout = timeout_of(&state, req.timeout_seconds)?;
    if let Some(mb) = req.memory_mb {
        if mb < 64 || mb > state.config.max_memory_mb {
            return Err(ApiError::invalid(format!("memory_mb must be 64 to {}, got {mb}", state.config.max_memory_mb)));
        }
        limits.memory_bytes = mb << 20;
    }
    let v = blocking(&state, move |s| {
        let rec = s.sessions.create(&tenant, req.tags, &limits)?;
        Ok(session_json(s, &rec))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

async fn list_sessions(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RawQuery(q): RawQuery,
) -> Result<Json<Value>, ApiError> {
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
        let list = s.sessions.list(&tenant, &tags)?;
        Ok(Json(json!({ "sessions": list.iter().map(|r| session_json(s, r)).collect::<Vec<_>>() })))
    })
    .await
}

async fn get_session(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    blocking(&state, move |s| Ok(Json(session_json(s, &s.sessions.get(&tenant, &id)?)))).await
}

async fn delete_session(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&state, move |s| {
        s.sessions.delete(&tenant, &id)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

#[derive(Deserialize)]
struct SessionExec {
    code: String,
}

async fn session_exec(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SessionExec>,
) -> Result<Json<Value>, ApiError> {
    let t0 = Instant::now();
    check_code(&state, &req.code)?;
    let permit = acquire(&state, 1).await?;
    let r = blocking(&state, move |s| {
        let _permit = permit;
        let r = s.sessions.exec(&tenant, &id, &req.code);
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
    let mut v = result_json(&o.result);
    v["checkpoint"] = json!(o.checkpoint.seq);
    v["total_time_ms"] = json!(t0.elapsed().as_secs_f64() * 1000.0);
    Ok(Json(v))
}

async fn checkpoints(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    blocking(&state, move |s| {
        let rec = s.sessions.get(&tenant, &id)?;
        let list = s.sessions.checkpoints(&tenant, &id)?;
        let seq_of: HashMap<i64, i64> = list.iter().map(|c| (c.id, c.seq)).collect();
        let items: Vec<Value> = list
            .iter()
            .map(|c| {
                json!({
                    "seq": c.seq,
                    "parent": c.parent.and_then(|p| seq_of.get(&p).copied()),
                    "code": c.code,
                    "created_ms": c.created_ms,
                    "bytes": c.bytes,
                    "pages": c.pages,
                    "head": Some(c.id) == rec.head,
                })
            })
            .collect();
        Ok(Json(json!({ "checkpoints": items })))
    })
    .await
}

#[derive(Deserialize)]
struct RevertRequest {
    checkpoint: i64,
}

async fn revert(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RevertRequest>,
) -> Result<Json<Value>, ApiError> {
    blocking(&state, move |s| {
        s.sessions.revert(&tenant, &id, req.checkpoint)?;
        Ok(Json(session_json(s, &s.sessions.get(&tenant, &id)?)))
    })
    .await
}

#[derive(Deserialize)]
struct ForkRequest {
    checkpoint: Option<i64>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
}

async fn fork(
    State(state): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    check_tags(&req.tags)?;
    let v = blocking(&state, move |s| {
        let rec = s.sessions.fork(&tenant, &id, req.checkpoint, req.tags)?;
        Ok(session_json(s, &rec))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

// ---------------------------------------------------------------------------
// Health and metrics
// ---------------------------------------------------------------------------

async fn healthz(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "template": state.template.info.id,
        "exec_slots": state.concurrency,
        "exec_slots_free": state.permits.available_permits(),
        "queued": state.queued.load(Ordering::SeqCst),
        "resident_sessions": state.sessions.resident_count(),
    }))
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    metrics::sessions(state.sessions.resident_count());
    let s = state.clone();
    if let Ok(Ok(n)) = tokio::task::spawn_blocking(move || s.sessions.store().count_sessions(None)).await {
        metrics::sessions_live(n);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::handle().render())
}
