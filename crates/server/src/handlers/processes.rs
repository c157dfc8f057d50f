//! A session's background processes (jobs): what `POST /v1/sessions/{id}/commands`
//! with `"background": true` started, running on between calls in the session.
//! - `GET /v1/sessions/{id}/processes` -> `{processes: [ProcessInfo]}`
//! - `GET /v1/sessions/{id}/processes/{pid}` -> `ProcessInfo`
//! - `GET /v1/sessions/{id}/processes/{pid}/output?stream=stdout&offset=N&max=M` -> `ProcessOutput`
//! - `POST /v1/sessions/{id}/processes/{pid}/signal` `{signal}` -> `ProcessInfo`
//! - `POST /v1/sessions/{id}/processes/{pid}/wait` `{timeout_seconds}` -> `ProcessInfo`
//! - `POST /v1/sessions/{id}/processes/{pid}/stdin` `{data|data_b64, eof}` or raw bytes -> `ProcessInfo`
//! - `POST /v1/sessions/{id}/processes/{pid}/resize` `{rows, cols}` (a `pty` command) -> `ProcessInfo`
//! - `GET .../output?follow=true`: Server-Sent Events of its output as it is written, until it ends
//! - `GET /v1/sessions/{id}/ports` -> `{ports: [ListeningPortInfo], resident}`: what listens in it
//!
//! None of them makes a checkpoint; a session brought back from disk (revert,
//! fork, eviction) has no background processes (`process_not_found`).

use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::response::IntoResponse;
use axum::{Extension, Json};
pub use forkbox_api::wire::processes::*;
use forkbox_runtime::{JobInfo, Stream};

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{query_pairs, ApiJson, ApiPath};
use crate::AppState;

/// The most of a stream one read returns (and the default).
pub const OUTPUT_READ_MAX: usize = 1 << 20;
/// The longest one wait runs.
pub const WAIT_MAX_SECONDS: f64 = 60.0;

/// A background process as the API shows it.
pub fn process_info(j: JobInfo) -> ProcessInfo {
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
        let processes = rt.session_jobs(&caller.tenant, &id)?.into_iter().map(process_info).collect();
        Ok(Json(ProcessList { processes }))
    })
    .await
}

#[utoipa::path(get, path = "/sessions/{id}/ports", tag = "processes",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = ListeningPorts),
              (status = 404, description = "No such session", body = ErrorBody),
              (status = 409, description = "An exec is running in the session", body = ErrorBody)))]
pub(crate) async fn list_ports(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<ListeningPorts>, ApiError> {
    blocking(&state, move |rt| {
        let found = rt.session_listening_ports(&caller.tenant, &id)?;
        let resident = found.is_some();
        let ports = found
            .unwrap_or_default()
            .into_iter()
            .map(|p| ListeningPortInfo {
                port: p.address.port(),
                address: p.address.ip().to_string(),
                proxied: p.proxied,
            })
            .collect();
        Ok(Json(ListeningPorts { ports, resident }))
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
        Ok(Json(process_info(j)))
    })
    .await
}

fn not_found(pid: u32) -> ApiError {
    ApiError::new(forkbox_api::ErrorCode::ProcessNotFound, format!("no background process {pid} in this session"))
}

#[utoipa::path(get, path = "/sessions/{id}/processes/{pid}/output", tag = "processes",
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid"),
           ("stream" = Option<String>, Query, description = "stdout (default; with follow: both) or stderr"),
           ("offset" = Option<u64>, Query, description = "Byte offset to read from (default 0)"),
           ("stderr_offset" = Option<u64>, Query, description = "follow of both streams: stderr's byte offset (default 0)"),
           ("max" = Option<usize>, Query, description = "At most this many bytes (default and maximum 1 MiB)"),
           ("follow" = Option<bool>, Query, description = FOLLOW_DOC)),
    responses((status = 200, body = ProcessOutput),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn process_output(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    RawQuery(q): RawQuery,
) -> Result<axum::response::Response, ApiError> {
    let (mut stream, mut offset, mut max) = (None, 0u64, OUTPUT_READ_MAX);
    let (mut follow_on, mut stderr_offset) = (false, None);
    for (k, v) in query_pairs(q.as_deref())? {
        let bad = |what: &str| ApiError::invalid(format!("{k}={v:?} is not {what}"));
        match k.as_str() {
            "stream" => {
                stream = Some(match v.as_str() {
                    "stdout" => Stream::Stdout,
                    "stderr" => Stream::Stderr,
                    _ => return Err(bad("stdout or stderr")),
                })
            }
            "offset" => offset = v.parse().map_err(|_| bad("a byte offset"))?,
            "stderr_offset" => stderr_offset = Some(v.parse().map_err(|_| bad("a byte offset"))?),
            "max" => max = v.parse::<usize>().map_err(|_| bad("a byte count"))?.min(OUTPUT_READ_MAX),
            "follow" => follow_on = v.parse().map_err(|_| bad("true or false"))?,
            _ => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {k:?} (stream, offset, stderr_offset, max, follow)"
                )))
            }
        }
    }
    if follow_on {
        let offsets = match stream {
            Some(Stream::Stdout) => [Some(offset), None],
            Some(Stream::Stderr) => [None, Some(offset)],
            None => [Some(offset), Some(stderr_offset.unwrap_or(0))],
        };
        // Unknown session or process: an HTTP error, not an event.
        let (t, i) = (caller.tenant.clone(), id.clone());
        blocking(&state, move |rt| {
            rt.session_jobs(&t, &i)?.into_iter().find(|j| j.pid == pid).map(drop).ok_or_else(|| not_found(pid))
        })
        .await?;
        return Ok(follow_sse(state, caller.tenant, id, pid, offsets).into_response());
    }
    if stderr_offset.is_some() {
        return Err(ApiError::invalid("stderr_offset is for follow=true of both streams"));
    }
    let stream = stream.unwrap_or(Stream::Stdout);
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
        })
        .into_response())
    })
    .await
}

const FOLLOW_DOC: &str = "Stream the output as Server-Sent Events as it is written, until the process ends: \
`stdout` / `stderr` events with data `{\"data\": text, \"offset\": n, \"next_offset\": n, \"dropped\": n}` \
(`offset`: the stream offset of `data`, `dropped`: bytes lost from the 256 KiB ring before they were read), \
then one `exit` event (data: `ProcessInfo`) or one `error` event (`{\"error\": {code, message}}`). \
Reconnect with the last `next_offset` of each stream (`offset`, `stderr_offset`).";

/// The SSE response of a follow.
fn follow_sse(
    state: AppState,
    tenant: String,
    id: String,
    pid: u32,
    offsets: [Option<u64>; 2],
) -> axum::response::sse::Sse<
    impl futures_util::Stream<Item = Result<axum::response::sse::Event, std::convert::Infallible>>,
> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    let (tx, rx) = tokio::sync::mpsc::channel(super::stream::CHANNEL);
    tokio::spawn(follow(state, tenant, id, pid, offsets, tx));
    let events = futures_util::stream::unfold(
        (rx, [super::stream::Utf8Chunks::default(), Default::default()], false),
        |(mut rx, mut text, done)| async move {
            if done {
                return None;
            }
            let (ev, last) = match rx.recv().await? {
                Followed::Output { stream, offset, dropped, data } => {
                    let name = if stream == Stream::Stdout { "stdout" } else { "stderr" };
                    let next_offset = offset.saturating_add(data.len() as u64);
                    let data = text[stream as usize].push(&data);
                    let body = serde_json::json!({ "data": data, "offset": offset, "next_offset": next_offset, "dropped": dropped });
                    (Event::default().event(name).data(body.to_string()), false)
                }
                Followed::End(info) => (
                    Event::default().event("exit").data(serde_json::to_string(&process_info(info)).unwrap_or_default()),
                    true,
                ),
                Followed::Failed(e) => {
                    let e = ApiError::from(e);
                    let body = serde_json::to_string(&ErrorBody { error: e.detail() }).unwrap_or_default();
                    (Event::default().event("error").data(body), true)
                }
            };
            Some((Ok(ev), (rx, text, last)))
        },
    );
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The most one stdin write takes (the process holds at most this much unread).
pub const STDIN_WRITE_MAX: usize = 256 << 10;

#[utoipa::path(post, path = "/sessions/{id}/processes/{pid}/stdin", tag = "processes", request_body = StdinRequest,
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid")),
    responses((status = 200, description = "Written (all of it), and closed with `eof`. A body that is not JSON is written as raw bytes.", body = ProcessInfo),
              (status = 400, description = "Both `data` and `data_b64`, or bad base64", body = ErrorBody),
              (status = 404, description = "No such session or process", body = ErrorBody),
              (status = 409, description = "`stdin_closed`: not started with `stdin: true`, closed, or ended; `stdin_full`: 256 KiB unread for 5 s (nothing written)", body = ErrorBody),
              (status = 413, description = "Over 256 KiB in one write", body = ErrorBody)))]
pub(crate) async fn process_stdin(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<ProcessInfo>, ApiError> {
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    let (data, eof) = if json {
        let req: StdinRequest = serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid(format!("a stdin request is {{data|data_b64, eof}}: {e}")))?;
        let data = match (req.data, req.data_b64) {
            (Some(_), Some(_)) => return Err(ApiError::invalid("give data or data_b64, not both")),
            (Some(t), None) => t.into_bytes(),
            (None, Some(b)) => {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(b.as_bytes())
                    .map_err(|e| ApiError::invalid(format!("data_b64 is not base64: {e}")))?
            }
            (None, None) => Vec::new(),
        };
        (data, req.eof)
    } else {
        (body.to_vec(), false)
    };
    if data.len() > STDIN_WRITE_MAX {
        return Err(ApiError::new(
            forkbox_api::ErrorCode::PayloadTooLarge,
            format!("{} bytes in one stdin write: at most {STDIN_WRITE_MAX}", data.len()),
        ));
    }
    let j = state.runtime.job_stdin(&caller.tenant, &id, pid, data, eof).await?;
    Ok(Json(process_info(j)))
}

#[utoipa::path(post, path = "/sessions/{id}/processes/{pid}/resize", tag = "processes", request_body = crate::schema::PtySize,
    params(("id" = String, Path, description = "Session id"), ("pid" = u32, Path, description = "Its pid")),
    responses((status = 200, description = "Resized (SIGWINCH to its foreground process group when the size changed)", body = ProcessInfo),
              (status = 400, description = "A size out of range, or a process started without a pty", body = ErrorBody),
              (status = 404, description = "No such session or process", body = ErrorBody)))]
pub(crate) async fn resize_process(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, pid)): ApiPath<(String, u32)>,
    ApiJson(req): ApiJson<crate::schema::PtySize>,
) -> Result<Json<ProcessInfo>, ApiError> {
    let (rows, cols) = crate::schema::pty_size(req)?;
    let j = state.runtime.job_resize(&caller.tenant, &id, pid, rows, cols).await?;
    Ok(Json(process_info(j)))
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
    blocking(&state, move |rt| Ok(Json(process_info(rt.job_signal(&caller.tenant, &id, pid, req.signal)?)))).await
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
    Ok(Json(process_info(j)))
}

/// What a follower of a background process sees, in order.
pub(crate) enum Followed {
    /// New bytes of a stream, from `offset`; `dropped` bytes before them were
    /// lost from the ring before they could be read.
    Output { stream: Stream, offset: u64, dropped: u64, data: Vec<u8> },
    /// It ended (all its output was sent before).
    End(JobInfo),
    /// The follow could not go on (the session went away, the process is gone).
    Failed(forkbox_runtime::RuntimeError),
}

/// How long one follow step may hold the session waiting for output: short,
/// so that a call of the session's waits for it within the session lock's grace.
const FOLLOW_STEP: Duration = Duration::from_millis(50);
/// The pause between two follow steps that found nothing (the process runs
/// on meanwhile) and after the session was busy (an exec holds it).
const FOLLOW_PAUSE: Duration = Duration::from_millis(3);
const FOLLOW_BUSY_PAUSE: Duration = Duration::from_millis(25);
/// The most of a stream one step reads.
const FOLLOW_CHUNK: usize = 64 << 10;

/// Follow background process `pid` of a session from `offsets` (stdout,
/// stderr; None: that stream is not followed), sending its output to `tx` as
/// it is written, then `End`. Stops when `tx` is closed (the client left).
pub(crate) async fn follow(
    state: AppState,
    tenant: String,
    id: String,
    pid: u32,
    mut offsets: [Option<u64>; 2],
    tx: tokio::sync::mpsc::Sender<Followed>,
) {
    let rt = state.runtime.clone();
    let busy = |e: &forkbox_runtime::RuntimeError| e.code() == forkbox_api::ErrorCode::SessionBusy;
    loop {
        if tx.is_closed() {
            return;
        }
        // A stream not followed never has news.
        let watched = [offsets[0].unwrap_or(u64::MAX), offsets[1].unwrap_or(u64::MAX)];
        let info = match rt.job_watch(&tenant, &id, pid, watched, FOLLOW_STEP).await {
            Ok(info) => info,
            Err(e) if busy(&e) => {
                tokio::time::sleep(FOLLOW_BUSY_PAUSE).await;
                continue;
            }
            Err(e) => {
                let _ = tx.send(Followed::Failed(e)).await;
                return;
            }
        };
        let ends = [info.stdout_bytes, info.stderr_bytes];
        let mut news = false;
        for (i, stream) in [(0, Stream::Stdout), (1, Stream::Stderr)] {
            let Some(at) = offsets[i] else { continue };
            if ends[i] <= at {
                continue;
            }
            let (t, s) = (tenant.clone(), id.clone());
            let read = tokio::task::spawn_blocking({
                let rt = rt.clone();
                move || rt.job_output(&t, &s, pid, stream, at, FOLLOW_CHUNK)
            })
            .await;
            let chunk = match read {
                Ok(Ok(c)) => c,
                Ok(Err(e)) if busy(&e) => continue,
                Ok(Err(e)) => {
                    let _ = tx.send(Followed::Failed(e)).await;
                    return;
                }
                Err(_) => {
                    let _ = tx.send(Followed::Failed(forkbox_runtime::RuntimeError::WorkerGone)).await;
                    return;
                }
            };
            let next = chunk.offset.saturating_add(chunk.data.len() as u64);
            offsets[i] = Some(next);
            if !chunk.data.is_empty() || chunk.offset > at {
                news = true;
                let ev = Followed::Output {
                    stream,
                    offset: chunk.offset,
                    dropped: chunk.offset.saturating_sub(at),
                    data: chunk.data,
                };
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        }
        let drained = (0..2).all(|i| offsets[i].is_none_or(|o| o >= ends[i]));
        if !info.running && drained {
            let _ = tx.send(Followed::End(info)).await;
            return;
        }
        if !news {
            tokio::time::sleep(FOLLOW_PAUSE).await;
        }
    }
}
