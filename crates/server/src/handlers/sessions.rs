//! Sessions: create, list, get, change (PATCH), delete, exec, interrupt, checkpoints, revert, fork.

use std::time::Instant;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use forkbox_runtime::{NewSession, Outcome};

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{query_pairs, ApiJson, ApiPath};
use crate::schema::*;
use crate::{metrics, AppState};

#[utoipa::path(post, path = "/sessions", tag = "sessions", request_body = CreateSession,
    responses((status = 201, description = "The new session", body = Session)))]
pub(crate) async fn create_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<CreateSession>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let network = network_layers(&caller, &req.network)?;
    let secrets = seal_secrets(&req.secrets)?;
    super::wait_for_template(&state, &caller.tenant, req.template.as_deref()).await?;
    let v = blocking(&state, move |rt| {
        let timeout = crate::fair::key_timeout_of(rt, &caller, req.timeout_seconds)?;
        let key_secrets = caller.key_secrets();
        let new = NewSession {
            tags: req.tags,
            memory_mb: req.memory_mb,
            timeout_seconds: timeout,
            template: req.template.as_deref(),
            network: &network,
            secrets,
            key_secrets: &key_secrets,
        };
        let v = rt.create_session(&caller.tenant, new, &caller.quota())?;
        Ok(Session::of(&v))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// The caller's sessions, newest last; `tag=key:value` (repeatable) keeps those with all the tags.
#[utoipa::path(get, path = "/sessions", tag = "sessions",
    params(("tag" = Option<Vec<String>>, Query, description = "key:value; repeat for several (all must match)")),
    responses((status = 200, body = SessionList)))]
pub(crate) async fn list_sessions(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Json<SessionList>, ApiError> {
    let mut tags = Vec::new();
    for (k, v) in query_pairs(q.as_deref())? {
        if k != "tag" {
            return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use tag=key:value)")));
        }
        let (tk, tv) =
            v.split_once(':').ok_or_else(|| ApiError::invalid(format!("tag filter {v:?} is not key:value")))?;
        tags.push((tk.to_string(), tv.to_string()));
    }
    blocking(&state, move |rt| {
        let list = rt.sessions(&caller.tenant, &tags)?;
        Ok(Json(SessionList { sessions: list.iter().map(Session::of).collect() }))
    })
    .await
}

#[utoipa::path(get, path = "/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Session)))]
pub(crate) async fn get_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Session>, ApiError> {
    blocking(&state, move |rt| Ok(Json(Session::of(&rt.session(&caller.tenant, &id)?)))).await
}

#[utoipa::path(delete, path = "/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 204, description = "Deleted"), (status = 409, description = "An exec is running in it", body = ErrorBody)))]
pub(crate) async fn delete_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let st = state.clone();
    blocking(&state, move |rt| {
        rt.delete_session(&caller.tenant, &id)?;
        st.machines.forget(&id);
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// A session exec's `timeout_seconds`, checked against the key's maximum and the session's own limit.
pub(crate) async fn exec_timeout(
    state: &AppState,
    caller: &Caller,
    id: &str,
    seconds: Option<f64>,
) -> Result<Option<std::time::Duration>, ApiError> {
    if seconds.is_none() {
        return Ok(None);
    }
    let (c, i) = (caller.clone(), id.to_string());
    blocking(state, move |rt| {
        // The session's own limit first (its message names it), then the key's.
        let t = rt.session_exec_timeout(&c.tenant, &i, seconds)?;
        crate::fair::key_timeout_of(rt, &c, seconds)?;
        Ok(t)
    })
    .await
}

/// Change the session's tags (replaced as a whole) and/or its limits (`memory_mb`,
/// `timeout_seconds`), validated like a new session's and persisted; absent fields stay.
#[utoipa::path(patch, path = "/sessions/{id}", tag = "sessions", request_body = PatchSession,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, description = "The session as it is now", body = Session),
              (status = 409, description = "A memory change while an exec runs in the session", body = ErrorBody)))]
pub(crate) async fn patch_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<PatchSession>,
) -> Result<Json<Session>, ApiError> {
    blocking(&state, move |rt| {
        let timeout = match req.timeout_seconds {
            // Bounded by the key like a new session's (None stays None: unchanged).
            Some(_) => crate::fair::key_timeout_of(rt, &caller, req.timeout_seconds)?,
            None => None,
        };
        let v = rt.update_session(&caller.tenant, &id, req.tags.as_ref(), req.memory_mb, timeout)?;
        Ok(Json(Session::of(&v)))
    })
    .await
}

/// Run code in the session; the result names the checkpoint that recorded it.
#[utoipa::path(post, path = "/sessions/{id}/exec", tag = "sessions", request_body = SessionExec,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = ExecResponse),
              (status = 400, description = "Bad body, or `timeout_seconds` over the session's time limit", body = ErrorBody),
              (status = 408, description = "Timeout; the session was rolled back (error.checkpoint); error.stdout/stderr: the output so far", body = ErrorBody),
              (status = 409, description = "Another exec is running in the session", body = ErrorBody),
              (status = 422, description = "The code took the guest down; the session was rolled back", body = ErrorBody)))]
pub(crate) async fn session_exec(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SessionExec>,
) -> Result<Json<ExecResponse>, ApiError> {
    let t0 = Instant::now();
    state.runtime.check_code(&req.code)?;
    let timeout = exec_timeout(&state, &caller, &id, req.timeout_seconds).await?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let r = state.runtime.session_exec(&caller.tenant, &id, req.code, timeout, caller.quota(), None, permit).await;
    metrics::sessions(state.runtime.resident_sessions());
    metrics::exec("session", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
    let o = r?;
    metrics::checkpoint_bytes(o.checkpoint.bytes);
    Ok(Json(ExecResponse::of_session(&o, t0)))
}

/// Interrupt (Ctrl-C) the exec running in the session: the code gets a KeyboardInterrupt,
/// the session keeps its state. `interrupted` is false if no exec was running.
#[utoipa::path(post, path = "/sessions/{id}/interrupt", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Interrupted)))]
pub(crate) async fn interrupt(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Interrupted>, ApiError> {
    // Not behind an exec slot: it must get through while every slot is busy.
    blocking(&state, move |rt| Ok(Json(Interrupted { interrupted: rt.interrupt(&caller.tenant, &id)? }))).await
}

#[utoipa::path(get, path = "/sessions/{id}/checkpoints", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = CheckpointList)))]
pub(crate) async fn checkpoints(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<CheckpointList>, ApiError> {
    blocking(&state, move |rt| {
        let list = rt.checkpoints(&caller.tenant, &id)?;
        Ok(Json(CheckpointList { checkpoints: list.iter().map(Checkpoint::of).collect() }))
    })
    .await
}

/// Move the session's head back to a checkpoint; the next exec branches from there.
#[utoipa::path(post, path = "/sessions/{id}/revert", tag = "sessions", request_body = RevertRequest,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Session), (status = 409, description = "An exec is running in the session", body = ErrorBody)))]
pub(crate) async fn revert(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<RevertRequest>,
) -> Result<Json<Session>, ApiError> {
    blocking(&state, move |rt| Ok(Json(Session::of(&rt.revert(&caller.tenant, &id, req.checkpoint)?)))).await
}

/// Install packages into the session, like `pip install` (also a line
/// `%pip install X` in exec code): binary wheels resolved and downloaded by the
/// server (its package index or wheelhouse, its allow/deny list), each mounted
/// read-only from a layer shared by every session that installs it, and
/// checkpointed (code `# pip install ...`); the next exec imports them.
#[utoipa::path(post, path = "/sessions/{id}/packages", tag = "sessions", request_body = InstallPackages,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = InstalledPackages),
        (status = 403, description = "`package_not_allowed`: the server's policy refuses a package", body = ErrorBody),
        (status = 404, description = "`package_not_found`, `session_not_found`", body = ErrorBody),
        (status = 409, description = "`package_conflict`: a file of the package exists in the session; `session_busy`", body = ErrorBody),
        (status = 422, description = "`package_needs_build`: only an sdist (the message names the package)", body = ErrorBody),
        (status = 429, description = "`rate_limited`: the key has its most package installs in progress", body = ErrorBody),
        (status = 502, description = "`package_failed`: the server's pip failed", body = ErrorBody)))]
pub(crate) async fn install_packages(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<InstallPackages>,
) -> Result<Json<InstalledPackages>, ApiError> {
    let _held = crate::uploads::hold(&caller, crate::uploads::Transfer::Install, state.config.key_installs)?;
    let o = state.runtime.install_packages(&caller.tenant, &id, req.packages, caller.quota()).await?;
    Ok(Json(InstalledPackages::of(&o)))
}

/// A new session starting at a checkpoint (default: the head) of this one.
#[utoipa::path(post, path = "/sessions/{id}/fork", tag = "sessions", request_body = ForkRequest,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 201, body = Session)))]
pub(crate) async fn fork(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<Session>), ApiError> {
    let v = blocking(&state, move |rt| {
        let v = rt.fork_session(&caller.tenant, &id, req.checkpoint, req.tags, &caller.quota())?;
        Ok(Session::of(&v))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}
