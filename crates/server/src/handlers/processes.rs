//! A session's background processes (jobs): what `POST /v1/sessions/{id}/commands`
//! with `"background": true` started, running on between calls in the session.
//! - `GET /v1/sessions/{id}/processes` -> `{processes: [ProcessInfo]}`
//! - `GET /v1/sessions/{id}/processes/{pid}` -> `ProcessInfo`
//! - `GET /v1/sessions/{id}/processes/{pid}/output?stream=stdout&offset=N&max=M` -> `ProcessOutput`
//! - `POST /v1/sessions/{id}/processes/{pid}/signal` `{signal}` -> `ProcessInfo`
//! - `POST /v1/sessions/{id}/processes/{pid}/wait` `{timeout_seconds}` -> `ProcessInfo`
//!
//! None of them makes a checkpoint; a session brought back from disk (revert,
//! fork, eviction) has no background processes (`process_not_found`).

use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::{Extension, Json};
use forkbox_runtime::{JobInfo, Stream};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{query_pairs, ApiJson, ApiPath};
use crate::AppState;

/// The most of a stream one read returns (and the default).
pub const OUTPUT_READ_MAX: usize = 1 << 20;
/// The longest one wait runs.
pub const WAIT_MAX_SECONDS: f64 = 60.0;

/// A background process of a session (with the processes it started).
#[derive(Serialize, ToSchema)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Its argv after its last execve.
    pub argv: Vec<String>,
    /// When it started (ms since the Unix epoch).
    pub started_unix_ms: i64,
    /// vCPU seconds its processes used.
    pub cpu_seconds: f64,
    /// `running` or `exited`.
    pub state: String,
    /// How it ended: its exit status ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// ... or the signal that killed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Bytes it wrote so far to stdout and stderr (the session keeps the last 256 KiB of each).
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

impl ProcessInfo {
    pub fn of(j: JobInfo) -> ProcessInfo {
        ProcessInfo {
            pid: j.pid,
            argv: j.argv,
            started_unix_ms: j.started_unix_ms,
            cpu_seconds: j.cpu_seconds,
            state: if j.running { "running" } else { "exited" }.into(),
            exit_code: j.exit_code,
            signal: j.signal,
            stdout_bytes: j.stdout_bytes,
            stderr_bytes: j.stderr_bytes,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// A slice of a background process' stdout or stderr.
#[derive(Serialize, ToSchema)]
pub struct ProcessOutput {
    /// The byte offset in the stream of `data`'s start: past the one asked for
    /// when those bytes were dropped (only the last 256 KiB are kept).
    pub offset: u64,
    /// Where to read next (`offset` + the bytes of `data`).
    pub next_offset: u64,
    /// The stream's length so far.
    pub end: u64,
    /// Bytes between the offset asked for and `offset` that were dropped.
    pub dropped: u64,
    /// The bytes, as UTF-8 (invalid sequences replaced).
    pub data: String,
    /// It still runs: more may come.
    pub running: bool,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// Signal number (1-64), e.g. 15 (SIGTERM) or 9 (SIGKILL); sent to each of its processes.
    pub signal: i32,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    /// How long to wait at most (default 10, at most 60): the process as it is then.
    #[schema(exclusive_minimum = 0.0)]
    pub timeout_seconds: Option<f64>,
}

#[utoipa::path(get, path = "/sessions/{id}/processes", tag = "processes",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = ProcessList),
              (status = 404, description = "No such session", body = ErrorBody),
              (status = 409, description = "An exec is running in the session", body = ErrorBody)))]
pub(crate) async fn list_processes(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<ProcessList>, ApiError> {
    blocking(&state, move |rt| {
        let processes = rt.session_jobs(&caller.tenant, &id)?.into_iter().map(ProcessInfo::of).collect();
        Ok(Json(ProcessList { processes }))
    })
    .await
}

#[utoipa::path(get, path = "/sessions/{id}/processes/{pid}", tag = "processes",
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid")),
    responses((status = 200, body = ProcessInfo),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn get_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
) -> Result<Json<ProcessInfo>, ApiError> {
    blocking(&state, move |rt| {
        let jobs = rt.session_jobs(&caller.tenant, &id)?;
        let j = jobs.into_iter().find(|j| j.pid == pid).ok_or_else(|| not_found(pid))?;
        Ok(Json(ProcessInfo::of(j)))
    })
    .await
}

fn not_found(pid: u32) -> ApiError {
    ApiError::new(forkbox_api::ErrorCode::ProcessNotFound, format!("no background process {pid} in this session"))
}

#[utoipa::path(get, path = "/sessions/{id}/processes/{pid}/output", tag = "processes",
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid"),
           ("stream" = Option<String>, Query, description = "stdout (default) or stderr"),
           ("offset" = Option<u64>, Query, description = "Byte offset to read from (default 0)"),
           ("max" = Option<usize>, Query, description = "At most this many bytes (default and maximum 1 MiB)")),
    responses((status = 200, body = ProcessOutput),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn process_output(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    RawQuery(q): RawQuery,
) -> Result<Json<ProcessOutput>, ApiError> {
    let (mut stream, mut offset, mut max) = (Stream::Stdout, 0u64, OUTPUT_READ_MAX);
    for (k, v) in query_pairs(q.as_deref())? {
        let bad = |what: &str| ApiError::invalid(format!("{k}={v:?} is not {what}"));
        match k.as_str() {
            "stream" => {
                stream = match v.as_str() {
                    "stdout" => Stream::Stdout,
                    "stderr" => Stream::Stderr,
                    _ => return Err(bad("stdout or stderr")),
                }
            }
            "offset" => offset = v.parse().map_err(|_| bad("a byte offset"))?,
            "max" => max = v.parse::<usize>().map_err(|_| bad("a byte count"))?.min(OUTPUT_READ_MAX),
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (stream, offset, max)"))),
        }
    }
    blocking(&state, move |rt| {
        let c = rt.job_output(&caller.tenant, &id, pid, stream, offset, max)?;
        let next_offset = c.offset.saturating_add(c.data.len() as u64);
        Ok(Json(ProcessOutput {
            dropped: c.offset.saturating_sub(offset),
            offset: c.offset,
            next_offset,
            end: c.end,
            data: String::from_utf8_lossy(&c.data).into_owned(),
            running: c.running,
        }))
    })
    .await
}

#[utoipa::path(post, path = "/sessions/{id}/processes/{pid}/signal", tag = "processes", request_body = SignalRequest,
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid")),
    responses((status = 200, description = "Sent (acted on when its processes next run: at once between calls)", body = ProcessInfo),
              (status = 400, description = "Not a signal number", body = ErrorBody),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn signal_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> Result<Json<ProcessInfo>, ApiError> {
    blocking(&state, move |rt| Ok(Json(ProcessInfo::of(rt.job_signal(&caller.tenant, &id, pid, req.signal)?)))).await
}

#[utoipa::path(post, path = "/sessions/{id}/processes/{pid}/wait", tag = "processes", request_body = WaitRequest,
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid")),
    responses((status = 200, description = "It ended, or the time is up (see `state`)", body = ProcessInfo),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn wait_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    ApiJson(req): ApiJson<WaitRequest>,
) -> Result<Json<ProcessInfo>, ApiError> {
    let secs = req.timeout_seconds.unwrap_or(10.0);
    if !secs.is_finite() || secs <= 0.0 {
        return Err(ApiError::invalid("timeout_seconds must be > 0"));
    }
    let timeout = Duration::from_secs_f64(secs.min(WAIT_MAX_SECONDS));
    let j = state.runtime.job_wait(&caller.tenant, &id, pid, timeout).await?;
    Ok(Json(ProcessInfo::of(j)))
}
