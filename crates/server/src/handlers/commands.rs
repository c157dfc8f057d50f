//! Commands beside exec: `POST /v1/commands`, `POST /v1/sessions/{id}/commands`
//! and their `/stream` forms. A command is an exec of a generated snippet
//! (`forkbox_runtime::command`), so it takes the same path as an exec: the
//! same time limits, exec slots, busy lock, disk quota, checkpoint and errors;
//! only the result is a command's (`stdout`, `stderr`, `exit_code`).

use std::time::Instant;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use forkbox_runtime::{Outcome, RuntimeError};
use tokio::sync::mpsc;

use super::blocking;
use super::stream::{sse, Forward, SseEvent, Streamed, CHANNEL, STREAM_DOC};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{ApiJson, ApiPath};
use crate::schema::*;
use crate::{metrics, AppState};

/// A failed command's error; a checkpoint refused by the disk quota carries the command's result.
fn command_error(e: RuntimeError) -> ApiError {
    let result = e.exec_result().and_then(|r| serde_json::to_value(CommandResponse::of(r)).ok());
    let mut err = ApiError::from(e);
    if result.is_some() {
        err.result = result;
    }
    err
}

/// Run a command in a fresh fork of a template (nothing persists).
#[utoipa::path(post, path = "/commands", tag = "commands", request_body = OneShotCommand,
    responses((status = 200, description = "The command ran (whatever its exit code)", body = CommandResponse),
              (status = 408, description = "It ran past its time limit; error.stdout/stderr: the output so far", body = ErrorBody),
              (status = 422, description = "It took the guest down", body = ErrorBody)))]
pub(crate) async fn command(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<OneShotCommand>,
) -> Result<Json<CommandResponse>, ApiError> {
    let t0 = Instant::now();
    let cmd = command_of(req.cmd, req.cwd, req.env)?;
    let timeout = crate::fair::key_timeout(&state, &caller, req.timeout_seconds)?;
    let run = state.runtime.oneshot(
        &caller.tenant,
        cmd.code(),
        timeout,
        req.template.as_deref(),
        &network_layers(&caller, &req.network)?,
        &caller.key_secrets(),
    )?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let r = state.runtime.exec(run, None, permit).await;
    metrics::exec("command", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
    let o = r.map_err(command_error)?;
    metrics::fork(o.fork_ms / 1000.0);
    Ok(Json(CommandResponse::of_oneshot(&o, t0)))
}

/// [`command`], its output streamed as it is written.
#[utoipa::path(post, path = "/commands/stream", tag = "commands", request_body = OneShotCommand,
    responses((status = 200, description = STREAM_DOC, content_type = "text/event-stream", body = SseEvent)))]
pub(crate) async fn command_stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<OneShotCommand>,
) -> Result<impl IntoResponse, ApiError> {
    let t0 = Instant::now();
    let cmd = command_of(req.cmd, req.cwd, req.env)?;
    let timeout = crate::fair::key_timeout(&state, &caller, req.timeout_seconds)?;
    let run = state.runtime.oneshot(
        &caller.tenant,
        cmd.code(),
        timeout,
        req.template.as_deref(),
        &network_layers(&caller, &req.network)?,
        &caller.key_secrets(),
    )?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let (tx, rx) = mpsc::channel(CHANNEL);
    let fwd = Box::new(Forward::new(tx.clone()));
    state.runtime.spawn_exec(run, Some(fwd), permit, move |r| {
        metrics::exec("command_stream", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
        let r = r.map_err(command_error).map(|o| CommandResponse::of_oneshot(&o, t0));
        let _ = tx.blocking_send(Streamed::Command(Box::new(r)));
    });
    Ok(sse(rx))
}

/// Run a command in the session's file system (its working directory and
/// environment); like an exec it makes a checkpoint. With `"background": true`
/// it is started and answered at once (201): it runs on between calls.
#[utoipa::path(post, path = "/sessions/{id}/commands", tag = "commands", request_body = SessionCommand,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, description = "The command ran (whatever its exit code); `checkpoint` recorded it", body = CommandResponse),
              (status = 400, description = "Bad body, or `timeout_seconds` over the session's time limit", body = ErrorBody),
              (status = 408, description = "Timeout; the session was rolled back (error.checkpoint); error.stdout/stderr: the output so far", body = ErrorBody),
              (status = 201, description = "`background`: started", body = BackgroundStarted),
              (status = 409, description = "An exec or command is running in the session", body = ErrorBody),
              (status = 422, description = "It took the guest down; the session was rolled back", body = ErrorBody)))]
pub(crate) async fn session_command(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SessionCommand>,
) -> Result<axum::response::Response, ApiError> {
    let t0 = Instant::now();
    let cmd = command_of(req.cmd, req.cwd, req.env)?;
    if req.stdin && !req.background {
        return Err(ApiError::invalid("stdin: true is for background commands (a command's stdin is /dev/null)"));
    }
    if req.pty.is_some() && !req.background {
        return Err(ApiError::invalid("pty is for background commands (\"background\": true)"));
    }
    if req.background {
        let code = match req.pty {
            Some(size) => {
                let (rows, cols) = pty_size(size)?;
                cmd.pty_code(rows, cols)
            }
            None => cmd.background_code(req.stdin),
        };
        state.runtime.check_code(&code)?;
        let timeout = super::sessions::exec_timeout(&state, &caller, &id, req.timeout_seconds).await?;
        let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
        let r = state
            .runtime
            .session_background_command(&caller.tenant, &id, code, timeout, caller.quota(), true, permit)
            .await;
        metrics::sessions(state.runtime.resident_sessions());
        let start = r.map_err(command_error)?;
        let Some(checkpoint) = start.checkpoint else {
            return Err(ApiError::new(forkbox_api::ErrorCode::Internal, "the start made no checkpoint"));
        };
        metrics::checkpoint_bytes(checkpoint.bytes);
        let o = forkbox_runtime::ExecOutcome { result: start.result, checkpoint };
        return Ok(match start.started {
            Ok(job) => {
                let body = BackgroundStarted {
                    pid: job.pid,
                    process: super::processes::process_info(job),
                    checkpoint: o.checkpoint.seq,
                    stdout: o.result.stdout.clone(),
                    stderr: o.result.stderr.clone(),
                };
                (axum::http::StatusCode::CREATED, Json(body)).into_response()
            }
            // It could not start: a command's answer with that status.
            Err(status) => {
                let mut body = CommandResponse::of_session(&o, t0);
                body.exit_code = status;
                Json(body).into_response()
            }
        });
    }
    let code = cmd.code();
    state.runtime.check_code(&code)?;
    let timeout = super::sessions::exec_timeout(&state, &caller, &id, req.timeout_seconds).await?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let r = state.runtime.session_exec(&caller.tenant, &id, code, timeout, caller.quota(), None, permit).await;
    metrics::sessions(state.runtime.resident_sessions());
    metrics::exec("session_command", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
    let o = r.map_err(command_error)?;
    metrics::checkpoint_bytes(o.checkpoint.bytes);
    Ok(Json(CommandResponse::of_session(&o, t0)).into_response())
}

/// [`session_command`], its output streamed as it is written.
#[utoipa::path(post, path = "/sessions/{id}/commands/stream", tag = "commands", request_body = SessionCommand,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, description = STREAM_DOC, content_type = "text/event-stream", body = SseEvent)))]
pub(crate) async fn session_command_stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SessionCommand>,
) -> Result<impl IntoResponse, ApiError> {
    let t0 = Instant::now();
    if req.background {
        return Err(ApiError::invalid(
            "a background command is not streamed: start it with POST /v1/sessions/{id}/commands, read its output from /processes/{pid}/output",
        ));
    }
    let code = command_of(req.cmd, req.cwd, req.env)?.code();
    // What can be refused before it starts is an HTTP error, not an event.
    let (c, i, checked) = (caller.clone(), id.clone(), code.clone());
    blocking(&state, move |rt| Ok(rt.check_session_exec(&c.tenant, &i, &checked, &c.quota())?)).await?;
    let timeout = super::sessions::exec_timeout(&state, &caller, &id, req.timeout_seconds).await?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let (tx, rx) = mpsc::channel(CHANNEL);
    let fwd = Box::new(Forward::new(tx.clone()));
    tokio::spawn(async move {
        let r = state.runtime.session_exec(&caller.tenant, &id, code, timeout, caller.quota(), Some(fwd), permit).await;
        metrics::sessions(state.runtime.resident_sessions());
        metrics::exec("session_command_stream", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
        let r = r.map_err(command_error).map(|o| {
            metrics::checkpoint_bytes(o.checkpoint.bytes);
            CommandResponse::of_session(&o, t0)
        });
        let _ = tx.send(Streamed::Command(Box::new(r))).await;
    });
    Ok(sse(rx))
}
