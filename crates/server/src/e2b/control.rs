//! E2B's control plane (`e2b/api/client/api/sandboxes/*.py` in the SDK): create,
//! connect/resume, kill, timeout, info, list, pause, fork, snapshots, metrics;
//! behind `X-API-KEY` (a forkbox API key). Sandbox = forkbox session.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json, Router};
use forkbox_runtime::{NewSession, SessionView};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::E2bError;
use super::{
    new_token, now_ms, PendingSetup, RecState, SandboxRec, DEFAULT_TIMEOUT_S, ENVD_VERSION, HOME, MAX_TIMEOUT_S,
};
use crate::auth::Caller;
use crate::handlers::blocking;
use crate::AppState;

/// The `clientID` of every sandbox (E2B's field names the cluster node; there is one here).
const CLIENT_ID: &str = "forkbox";
/// Most sandboxes one fork call makes (the SDK checks 1-20 too).
const MAX_FORKS: u64 = 20;
/// Largest page of a list.
const MAX_PAGE: usize = 1000;

pub fn routes(state: AppState) -> Router {
    let st = state.clone();
    Router::new()
        .route("/sandboxes", post(create).get(list_v1).fallback(method_not_allowed))
        .route("/v2/sandboxes", post(create).get(list_v2).fallback(method_not_allowed))
        .route("/sandboxes/{id}", get(info).delete(kill).fallback(method_not_allowed))
        .route("/sandboxes/{id}/timeout", post(set_timeout).fallback(method_not_allowed))
        .route("/sandboxes/{id}/connect", post(connect).fallback(method_not_allowed))
        .route("/v2/sandboxes/{id}/connect", post(connect).fallback(method_not_allowed))
        .route("/sandboxes/{id}/resume", post(connect).fallback(method_not_allowed))
        .route("/sandboxes/{id}/pause", post(pause).fallback(method_not_allowed))
        .route("/sandboxes/{id}/fork", post(fork).fallback(method_not_allowed))
        .route("/sandboxes/{id}/snapshots", post(snapshot).fallback(method_not_allowed))
        .route("/sandboxes/{id}/metrics", get(metrics).fallback(method_not_allowed))
        .route("/snapshots", get(snapshots).fallback(method_not_allowed))
        .route("/templates/{id}", delete(delete_snapshot).fallback(method_not_allowed))
        .route_layer(middleware::from_fn_with_state(st, auth))
        .with_state(state)
}

/// Whether `path` is under one of E2B's control-plane prefixes (its unknown routes answer in E2B's shape).
pub fn is_e2b_path(path: &str) -> bool {
    ["/sandboxes", "/v2/", "/snapshots", "/templates/"].iter().any(|p| path.starts_with(p))
}

pub fn not_found() -> E2bError {
    E2bError::not_found("no such E2B endpoint here")
}

async fn method_not_allowed() -> E2bError {
    E2bError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this endpoint")
}

/// `X-API-KEY`: a forkbox API key (its tenant, limits and rate limit).
async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Result<Response, E2bError> {
    let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim).unwrap_or("");
    if key.is_empty() {
        return Err(E2bError::new(StatusCode::UNAUTHORIZED, "missing X-API-KEY (a forkbox API key)"));
    }
    let key = forkbox_key(key);
    let caller = crate::auth::caller_for_key(&state, &key).await?;
    req.extensions_mut().insert(caller);
    Ok(next.run(req).await)
}

/// The forkbox key an `X-API-KEY` names. Some E2B SDKs (the Python `e2b`
/// 2.31 that the OpenAI Agents SDK pins) refuse, before sending it, any key
/// that is not `e2b_` + hex: such users spell their forkbox key `e2b_<hex>`
/// for `fbk_<hex>`, and the same key is meant.
fn forkbox_key(key: &str) -> std::borrow::Cow<'_, str> {
    match key.strip_prefix("e2b_") {
        Some(hex) => format!("fbk_{hex}").into(),
        None => key.into(),
    }
}

/// A JSON body (any content type; empty is `{}`), unknown fields ignored: the SDK sends more than this reads.
struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Body<T> {
    type Rejection = E2bError;
    async fn from_request(req: Request, state: &S) -> Result<Self, E2bError> {
        let crate::extractors::ApiJson(v) =
            crate::extractors::ApiJson::<T>::from_request(req, state).await.map_err(E2bError::from)?;
        Ok(Body(v))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    auto_pause: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// The forkbox template of an E2B `templateID`.
fn template_of(id: &str) -> Option<&str> {
    match id {
        "code-interpreter-v1" | "code-interpreter" => Some("data"),
        "base" | "e2b" | "" => None,
        other => Some(other),
    }
}

/// A lifetime in seconds, checked.
fn lifetime(t: Option<u64>) -> Result<u64, E2bError> {
    match t.unwrap_or(DEFAULT_TIMEOUT_S) {
        0 => Err(E2bError::bad_request("timeout must be at least 1 second")),
        t if t > MAX_TIMEOUT_S => {
            Err(E2bError::bad_request(format!("timeout must be at most {MAX_TIMEOUT_S} seconds")))
        }
        t => Ok(t),
    }
}

/// Each exec's time limit in an E2B sandbox: the code interpreter's 300 s, within the server's and the key's maximum.
fn exec_limit(state: &AppState, caller: &Caller) -> f64 {
    let max = state.runtime.config().max_timeout.as_secs_f64().min(300.0);
    caller.limits().and_then(|l| l.max_timeout_seconds).map_or(max, |k| max.min(k as f64))
}

/// A Python string literal holding `s` (a JSON string literal is one).
pub(super) fn py_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "''".into())
}

/// The guest side of a new sandbox: E2B's home as the working directory, its environment.
fn init_code(env: &BTreeMap<String, String>) -> String {
    let env = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
    format!(
        "# e2b: sandbox setup\nimport os as _e2b_os, json as _e2b_json\n_e2b_os.makedirs({home}, exist_ok=True)\n\
_e2b_os.chdir({home})\n_e2b_os.environ['HOME'] = {home}\n_e2b_os.environ.update(_e2b_json.loads({env}))\ndel _e2b_os, _e2b_json\n",
        home = py_str(HOME),
        env = py_str(&env),
    )
}

/// Run `code` in the session as the caller (an exec slot, the key's share).
pub(super) async fn run_setup(
    state: &AppState,
    caller: &Caller,
    id: &str,
    code: String,
) -> Result<(), crate::error::ApiError> {
    let permit = crate::fair::acquire_for(state, caller, 1).await?;
    let o = state.runtime.session_exec(&caller.tenant, id, code, None, caller.quota(), None, permit).await?;
    if let Some(e) = o.result.error {
        return Err(crate::error::ApiError::internal(format!("setting the sandbox up: {}: {}", e.kind, e.message)));
    }
    Ok(())
}

fn sandbox_json(rec: &SandboxRec, domain: Option<&str>) -> Value {
    json!({
        "templateID": rec.template,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": rec.token,
        // What `get_host(port)` requests carry (`e2b-traffic-access-token`): forkbox ports are never public.
        "trafficAccessToken": rec.token,
        "alias": rec.template,
        // `get_host(port)` is `<port>-<id>.<domain>` (`serve --sandbox-domain`).
        "domain": domain,
    })
}

pub(super) fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// A sandbox as `get_info` and `list` show it (SandboxDetail / ListedSandbox).
fn detail_json(v: &SessionView, rec: Option<&SandboxRec>, with_token: bool) -> Value {
    // A session without an E2B record here (made through /v1, or before a restart) has no
    // timer and no token: it is shown paused, and `connect` gives it both.
    let (state, end_ms, template, started) = match rec {
        Some(r) => {
            let st = r.lock();
            (if st.paused { "paused" } else { "running" }, st.end_ms, r.template.clone(), r.started_ms)
        }
        None => ("paused", v.record.last_used_ms, v.template.clone().unwrap_or_default(), v.record.created_ms),
    };
    let mut d = json!({
        "templateID": template,
        "alias": template,
        "sandboxID": v.record.id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(started),
        "endAt": rfc3339(end_ms),
        "envdVersion": ENVD_VERSION,
        "cpuCount": 1,
        "memoryMB": v.memory_mb(),
        "diskSizeMB": 0,
        "state": state,
        "metadata": v.record.tags,
    });
    if let (true, Some(r)) = (with_token, rec) {
        d["envdAccessToken"] = Value::String(r.token.clone());
    }
    d
}

/// `POST /v2/sandboxes` (and the older `POST /sandboxes`): a new session, set up as E2B's sandbox; 201.
async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Body(req): Body<NewSandbox>,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let life = lifetime(req.timeout)?;
    let env = req.env_vars.unwrap_or_default();
    // Checked now: the setup runs with the sandbox's first call.
    let setup = init_code(&env);
    state.runtime.check_code(&setup).map_err(|e| E2bError::bad_request(format!("envVars: {e}")))?;
    let template = req.template_id.clone();
    let limit = exec_limit(&state, &caller);
    let network = if req.allow_internet_access == Some(false) {
        Some(crate::schema::NetworkSetting::Mode(crate::schema::NetworkMode::None))
    } else {
        None
    };
    let layers = crate::schema::network_layers(&caller, &network)?;
    let c = caller.clone();
    let tags = req.metadata.unwrap_or_default();
    let v = blocking(&state, move |rt| {
        let key_secrets = c.key_secrets();
        let new = NewSession {
            tags,
            memory_mb: None,
            timeout_seconds: Some(limit),
            template: template_of(&template),
            network: &layers,
            secrets: Vec::new(),
            key_secrets: &key_secrets,
        };
        Ok(rt.create_session(&c.tenant, new, &c.quota())?)
    })
    .await?;
    let id = v.record.id.clone();
    let now = now_ms();
    let rec = state.e2b.insert(SandboxRec {
        id,
        tenant: caller.tenant.clone(),
        key: caller.key.clone(),
        token: new_token()?,
        template: req.template_id,
        started_ms: now,
        auto_pause: req.auto_pause.unwrap_or(false),
        state: std::sync::Mutex::new(RecState {
            end_ms: now + (life as i64) * 1000,
            paused: false,
            contexts: BTreeMap::new(),
            executions: 0,
            processes: Default::default(),
            ptys: Default::default(),
            watchers: Default::default(),
            cpu_sample: None,
            last_usage: None,
        }),
        // Run by the sandbox's first call that needs the guest (the first `/execute` as its prelude).
        setup: Arc::new(tokio::sync::Mutex::new(Some(setup))),
    });
    state.e2b.start_reaper(&state);
    Ok((StatusCode::CREATED, Json(sandbox_json(&rec, state.config.sandbox_domain.as_deref()))))
}

/// The caller's session `id` (404 in E2B's shape if it has none such).
async fn session_of(state: &AppState, caller: &Caller, id: &str) -> Result<SessionView, E2bError> {
    let (c, i) = (caller.clone(), id.to_string());
    blocking(state, move |rt| Ok(rt.session(&c.tenant, &i)?))
        .await
        .map_err(|_| E2bError::not_found(format!("sandbox {id} not found")))
}

/// `GET /sandboxes/{id}`.
async fn info(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let v = session_of(&state, &caller, &id).await?;
    let rec = state.e2b.owned(&caller.tenant, &id);
    Ok(Json(detail_json(&v, rec.as_deref(), true)))
}

/// `DELETE /sandboxes/{id}`: the session is deleted (an exec running in it is interrupted first); 204.
async fn kill(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    session_of(&state, &caller, &id).await?;
    delete_sandbox(&state, &caller.tenant, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Delete a sandbox's session, interrupting what runs in it (a few tries).
async fn delete_sandbox(state: &AppState, tenant: &str, id: &str) -> Result<(), E2bError> {
    for attempt in 0..20 {
        let (t, i) = (tenant.to_string(), id.to_string());
        let r = blocking(state, move |rt| Ok(rt.delete_session(&t, &i)?)).await;
        match r {
            Ok(()) => break,
            Err(e) if e.code == forkbox_api::ErrorCode::SessionBusy && attempt < 19 => {
                let (t, i) = (tenant.to_string(), id.to_string());
                let _ = blocking(state, move |rt| Ok(rt.interrupt(&t, &i)?)).await;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    state.e2b.forget(id);
    state.machines.forget(id);
    Ok(())
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

/// `POST /sandboxes/{id}/timeout`: the lifetime ends `timeout` seconds from now; 204.
async fn set_timeout(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<TimeoutBody>,
) -> Result<StatusCode, E2bError> {
    let life = lifetime(Some(req.timeout))?;
    let v = session_of(&state, &caller, &id).await?;
    let rec = record(&state, &caller, &v, false).await?;
    rec.lock().end_ms = now_ms() + life as i64 * 1000;
    Ok(StatusCode::NO_CONTENT)
}

/// The record of a session (a new one, with a new token, if it has none here: made
/// through /v1 or before a restart). `resumed`: a new record starts running.
async fn record(
    state: &AppState,
    caller: &Caller,
    v: &SessionView,
    resumed: bool,
) -> Result<std::sync::Arc<SandboxRec>, E2bError> {
    if let Some(r) = state.e2b.owned(&caller.tenant, &v.record.id) {
        return Ok(r);
    }
    let now = now_ms();
    let rec = state.e2b.insert(SandboxRec {
        id: v.record.id.clone(),
        tenant: caller.tenant.clone(),
        key: caller.key.clone(),
        token: new_token()?,
        template: v.template.clone().unwrap_or_default(),
        started_ms: v.record.created_ms,
        auto_pause: false,
        state: std::sync::Mutex::new(RecState {
            end_ms: now + DEFAULT_TIMEOUT_S as i64 * 1000,
            paused: !resumed,
            contexts: BTreeMap::new(),
            executions: 0,
            processes: Default::default(),
            ptys: Default::default(),
            watchers: Default::default(),
            cpu_sample: None,
            last_usage: None,
        }),
        // Set up before (or made through /v1, which has no E2B setup).
        setup: Default::default(),
    });
    state.e2b.start_reaper(state);
    Ok(rec)
}

#[derive(Deserialize, Default)]
struct ConnectBody {
    timeout: Option<u64>,
}

/// `POST /v2/sandboxes/{id}/connect` (and `/sandboxes/{id}/connect|resume`): resume a
/// paused sandbox (its session is made resident), or extend a running one's lifetime;
/// 201 after a resume, 200 for a running one.
async fn connect(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<ConnectBody>,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let v = session_of(&state, &caller, &id).await?;
    let rec = record(&state, &caller, &v, false).await?;
    let was_paused = rec.lock().paused;
    if was_paused {
        let (c, i) = (caller.clone(), id.clone());
        blocking(&state, move |rt| Ok(rt.resume_session(&c.tenant, &i)?)).await?;
    }
    let life = req.timeout.map(|t| lifetime(Some(t))).transpose()?;
    {
        let mut st = rec.lock();
        let now = now_ms();
        let want = now + life.unwrap_or(DEFAULT_TIMEOUT_S) as i64 * 1000;
        // A running sandbox's lifetime only grows; a resumed one starts a new one.
        st.end_ms = if st.paused {
            want
        } else if life.is_some() {
            st.end_ms.max(want)
        } else {
            st.end_ms
        };
        st.paused = false;
    }
    let status = if was_paused { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_json(&rec, state.config.sandbox_domain.as_deref()))))
}

/// `POST /sandboxes/{id}/pause`: the session is evicted to disk (it is at its last
/// checkpoint already); 204, 409 if it is paused already.
async fn pause(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let v = session_of(&state, &caller, &id).await?;
    let rec = record(&state, &caller, &v, true).await?;
    if rec.lock().paused {
        return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox {id} is already paused")));
    }
    pause_rec(&state, &rec).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause_rec(state: &AppState, rec: &SandboxRec) -> Result<(), E2bError> {
    rec.lock().paused = true;
    let (t, i) = (rec.tenant.clone(), rec.id.clone());
    // An exec running now keeps it resident until it ends; the maintenance evicts it later.
    blocking(state, move |rt| Ok(rt.evict_session(&t, &i)?)).await?;
    Ok(())
}

#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

/// `POST /sandboxes/{id}/fork`: `count` new sandboxes at the source's current state
/// (the source keeps running, untouched); 201 `[{sandbox} | {error}]`.
async fn fork(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<ForkBody>,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(E2bError::bad_request(format!("count must be 1 to {MAX_FORKS}")));
    }
    let life = lifetime(req.timeout)?;
    let src = session_of(&state, &caller, &id).await?;
    let src_rec = state.e2b.owned(&caller.tenant, &id);
    let template = src_rec.as_ref().map_or_else(|| src.template.clone().unwrap_or_default(), |r| r.template.clone());
    let auto_pause = src_rec.as_ref().is_some_and(|r| r.auto_pause);
    // Held while the forks are made: the source's owed guest code does not run meanwhile.
    let setup = match &src_rec {
        Some(r) => r.pending_setup().await,
        None => None,
    };
    let owed = setup.as_ref().and_then(PendingSetup::code).map(str::to_string);
    let mut out = Vec::new();
    for _ in 0..count {
        let (c, i, tags) = (caller.clone(), id.clone(), src.record.tags.clone());
        let r = blocking(&state, move |rt| Ok(rt.fork_session(&c.tenant, &i, None, tags, &c.quota())?)).await;
        match r {
            Ok(v) => {
                let now = now_ms();
                let rec = state.e2b.insert(SandboxRec {
                    id: v.record.id.clone(),
                    tenant: caller.tenant.clone(),
                    key: caller.key.clone(),
                    token: new_token()?,
                    template: template.clone(),
                    started_ms: now,
                    auto_pause,
                    state: std::sync::Mutex::new(RecState {
                        end_ms: now + life as i64 * 1000,
                        paused: false,
                        contexts: BTreeMap::new(),
                        executions: 0,
                        processes: Default::default(),
                        ptys: Default::default(),
                        watchers: Default::default(),
                        cpu_sample: None,
                        last_usage: None,
                    }),
                    // A fork owes the guest code its source owes: each runs it on its first call.
                    setup: Arc::new(tokio::sync::Mutex::new(owed.clone())),
                });
                out.push(json!({ "sandbox": sandbox_json(&rec, state.config.sandbox_domain.as_deref()) }));
            }
            Err(e) => {
                let e = E2bError::from(e);
                out.push(json!({ "error": { "code": e.status.as_u16(), "message": e.message } }));
            }
        }
    }
    state.e2b.start_reaper(&state);
    Ok((StatusCode::CREATED, Json(Value::Array(out))))
}

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
}

/// `POST /sandboxes/{id}/snapshots`: a checkpoint template of the sandbox's current
/// state (its name is the snapshot id, accepted later as `templateID`); 201 `{snapshotID, names}`.
async fn snapshot(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(req): Body<SnapshotBody>,
) -> Result<(StatusCode, Json<Value>), E2bError> {
    if let Some(rec) = state.e2b.owned(&caller.tenant, &id) {
        rec.ensure_setup(&state).await?;
    }
    let v = session_of(&state, &caller, &id).await?;
    let name = match req.name {
        Some(n) => n,
        None => format!("snapshot-{}", &new_token()?[..16]),
    };
    let seq = match v.checkpoint {
        Some(s) => s,
        None => {
            // A fresh fork has no checkpoint of its own yet: make one.
            let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
            let code = "# e2b: snapshot\nNone\n".to_string();
            let o = state.runtime.session_exec(&caller.tenant, &id, code, None, caller.quota(), None, permit).await;
            o.map_err(crate::error::ApiError::from)?.checkpoint.seq
        }
    };
    let (c, i, n) = (caller.clone(), id.clone(), name.clone());
    blocking(&state, move |rt| Ok(rt.checkpoint_template(&c.tenant, &i, seq, &n)?)).await?;
    Ok((StatusCode::CREATED, Json(json!({ "snapshotID": name, "names": [name] }))))
}

/// `GET /snapshots?sandboxID=&limit=&nextToken=`: the caller's checkpoint templates.
async fn snapshots(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    let q = crate::extractors::query_pairs(q.as_deref())?;
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let sandbox = get("sandboxID");
    let t = caller.tenant.clone();
    let list = blocking(&state, move |rt| Ok(rt.templates(&t))).await?;
    let items: Vec<Value> = list
        .into_iter()
        .filter(|t| t.source == "checkpoint")
        .filter(|t| sandbox.as_deref().is_none_or(|s| t.from_session.as_deref() == Some(s)))
        .map(|t| json!({ "snapshotID": t.name, "names": [t.name] }))
        .collect();
    page(items, get("limit"), get("nextToken"))
}

/// `DELETE /templates/{id}`: not served (forkbox keeps a checkpoint template for the
/// sessions made of it); 404 for one the caller does not have.
async fn delete_snapshot(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let t = caller.tenant.clone();
    let i = id.clone();
    let known = blocking(&state, move |rt| Ok(rt.template_listing(&t, &i).is_ok())).await?;
    if !known {
        return Err(E2bError::not_found(format!("snapshot {id} not found")));
    }
    Err(E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        "deleting a snapshot is not supported by this server: forkbox keeps checkpoint templates",
    ))
}

/// A page of `items` from `nextToken` (an offset), the next one's token in `x-next-token`.
fn page(items: Vec<Value>, limit: Option<String>, next: Option<String>) -> Result<Response, E2bError> {
    let limit = match limit {
        None => 100,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_PAGE).contains(l))
            .ok_or_else(|| E2bError::bad_request(format!("limit must be 1 to {MAX_PAGE}")))?,
    };
    let start = match next {
        None => 0,
        Some(t) => t.parse::<usize>().map_err(|_| E2bError::bad_request("nextToken is not one this server gave"))?,
    };
    let end = start.saturating_add(limit).min(items.len());
    let page: Vec<Value> = items.get(start.min(items.len())..end).map(<[Value]>::to_vec).unwrap_or_default();
    let mut resp = Json(Value::Array(page)).into_response();
    if end < items.len() {
        if let Ok(v) = HeaderValue::from_str(&end.to_string()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

/// `GET /v2/sandboxes?metadata=&state=&limit=&nextToken=&order=`.
async fn list_v2(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    list(state, caller, q, true).await
}

/// `GET /sandboxes` (older SDKs): running ones, every one in one answer.
async fn list_v1(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    list(state, caller, q, false).await
}

async fn list(state: AppState, caller: Caller, q: Option<String>, v2: bool) -> Result<Response, E2bError> {
    let q = crate::extractors::query_pairs(q.as_deref())?;
    let mut tags = Vec::new();
    let mut states: Vec<String> = Vec::new();
    let (mut limit, mut next, mut desc, mut template) = (None, None, false, None);
    for (k, v) in &q {
        match k.as_str() {
            // `k=v&k2=v2`, its keys and values quoted once more by the SDK.
            "metadata" | "query" => {
                for (mk, mv) in crate::extractors::query_pairs(Some(v))? {
                    tags.push((mk, mv));
                }
            }
            "state" => states.extend(v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty())),
            "limit" => limit = Some(v.clone()),
            "nextToken" => next = Some(v.clone()),
            "order" => desc = v == "desc",
            "template" => template = Some(v.clone()),
            _ => {}
        }
    }
    for s in &states {
        if s != "running" && s != "paused" {
            return Err(E2bError::bad_request(format!("unknown state {s:?} (running, paused)")));
        }
    }
    if states.is_empty() {
        states = if v2 { vec!["running".into(), "paused".into()] } else { vec!["running".into()] };
    }
    let t = caller.tenant.clone();
    let views = blocking(&state, move |rt| Ok(rt.sessions(&t, &tags)?)).await?;
    let mut items: Vec<Value> = views
        .iter()
        .map(|v| detail_json(v, state.e2b.owned(&caller.tenant, &v.record.id).as_deref(), false))
        .filter(|d| states.iter().any(|s| d["state"] == s.as_str()))
        .filter(|d| template.as_deref().is_none_or(|t| d["templateID"] == t))
        .collect();
    if desc {
        items.reverse();
    }
    if !v2 {
        return Ok(Json(Value::Array(items)).into_response());
    }
    page(items, limit, next)
}

/// `GET /sandboxes/{id}/metrics`: one sample of the sandbox now. `cpuUsedPct`:
/// the CPU time its vCPUs ran (every process) over the wall time since the
/// previous sample (the first: since it started), of its one CPU; `memUsed`:
/// its resident guest memory (the pages of its processes' guest memory the
/// host has mapped); `diskUsed`: the bytes of its file system's overlay;
/// `memTotal` / `diskTotal`: its memory limit and disk quota. A paused
/// sandbox (not resident) uses no CPU or memory; its disk is its checkpoints'.
/// While a call holds the sandbox (a long `run_code`), the last sample's figures.
async fn metrics(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let v = session_of(&state, &caller, &id).await?;
    let (c, i) = (caller.clone(), id.clone());
    let usage = match blocking(&state, move |rt| Ok(rt.session_usage(&c.tenant, &i)?)).await {
        Ok(u) => Ok(u),
        Err(e) if e.code == forkbox_api::ErrorCode::SessionBusy => Err(()),
        Err(e) => return Err(e.into()),
    };
    let now = now_ms();
    let rec = state.e2b.owned(&caller.tenant, &id);
    let (cpu_pct, mem_used, disk_used) = match usage {
        // A call holds it (an exec): the last figures.
        Err(()) => rec.as_ref().and_then(|r| r.lock().last_usage).unwrap_or_default(),
        Ok(Some(u)) => {
            let since = rec.as_ref().and_then(|r| r.lock().cpu_sample);
            let started = rec.as_ref().map_or(now, |r| r.started_ms);
            // A sandbox brought back from disk counts its CPU time from zero again.
            let (t0, cpu0) = since.filter(|&(_, c)| c <= u.cpu_seconds).unwrap_or((started, 0.0));
            let wall = (now - t0).max(1) as f64 / 1000.0;
            let figures = (((u.cpu_seconds - cpu0) / wall * 100.0).clamp(0.0, 100.0), u.memory_bytes, u.disk_bytes);
            if let Some(r) = &rec {
                let mut st = r.lock();
                st.cpu_sample = Some((now, u.cpu_seconds));
                st.last_usage = Some(figures);
            }
            figures
        }
        Ok(None) => {
            let (c, i) = (caller.clone(), id.clone());
            let disk: u64 =
                blocking(&state, move |rt| Ok(rt.checkpoints(&c.tenant, &i)?.iter().map(|c| c.bytes).sum())).await?;
            (0.0, 0, disk)
        }
    };
    Ok(Json(json!([{
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": 1,
        "cpuUsedPct": (cpu_pct * 100.0).round() / 100.0,
        "memUsed": mem_used,
        "memTotal": v.memory_mb() << 20,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": v.record.limits.disk_bytes,
    }])))
}

/// The lifetime timer: sandboxes past their end are killed, or paused with
/// `autoPause` (or `serve --e2b-auto-pause`).
pub(super) async fn reap(state: &AppState) {
    let now = now_ms();
    let due: Vec<_> = state
        .e2b
        .all()
        .into_iter()
        .filter(|r| {
            let st = r.lock();
            !st.paused && st.end_ms <= now
        })
        .collect();
    for rec in due {
        let r = if rec.auto_pause || state.config.e2b_auto_pause {
            pause_rec(state, &rec).await
        } else {
            delete_sandbox(state, &rec.tenant, &rec.id).await
        };
        match r {
            Ok(()) => {}
            // Gone already (killed through /v1): forget it.
            Err(e) if e.status == StatusCode::NOT_FOUND => state.e2b.forget(&rec.id),
            Err(e) => tracing::warn!(sandbox = %rec.id, "ending an E2B sandbox's lifetime: {e}"),
        }
    }
}
