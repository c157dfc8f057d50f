//! Streamed execs (Server-Sent Events): `POST /v1/exec/stream` and
//! `POST /v1/sessions/{id}/exec/stream`. Events, in order: `stdout` / `stderr`
//! with data `{"data": "<text>"}` as the guest writes (line-buffered), then
//! exactly one `result` (the JSON the non-streaming route returns) or `error`
//! (`{"error": {code, message, stdout?, stderr?}}`, the body of the non-streaming route's error). Request errors found before the exec starts
//! (bad body, unknown session, quota, overload) are ordinary HTTP errors.

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use axum::Extension;
use forkbox_runtime::{Outcome, Output, Stream};
use futures_util::stream::Stream as FutStream;
use serde_json::json;
use tokio::sync::mpsc;
use utoipa::ToSchema;

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{ApiJson, ApiPath};
use crate::schema::{ExecRequest, ExecResponse, ExecResponseOf, SessionExec};
use crate::{metrics, AppState};

/// One event of a streamed exec, as documented (in OpenAPI 3.1 the schema of an
/// event stream describes each event).
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only: the events are written by `event_of`
pub struct SseEvent {
    event: SseEventKind,
    /// JSON text: `{"data": "<text>"}` for stdout/stderr, the exec result for `result`,
    /// `{"error": {code, message}}` for `error`.
    data: String,
}

#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum SseEventKind {
    Stdout,
    Stderr,
    Result,
    Error,
}

/// Chunks in flight between the exec thread and the response; a slow reader
/// slows the guest's writes down instead of growing memory.
pub(crate) const CHANNEL: usize = 256;

/// Bytes to text without splitting a UTF-8 sequence across two events.
#[derive(Default)]
pub struct Utf8Chunks {
    carry: Vec<u8>,
}

impl Utf8Chunks {
    /// The text of `bytes` (with what was held back before), holding back an incomplete trailing sequence.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.carry.extend_from_slice(bytes);
        let complete = match std::str::from_utf8(&self.carry) {
            Ok(_) => self.carry.len(),
            // Incomplete at the end: keep the tail (at most 3 bytes) for the next chunk.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid bytes: replaced, like the result's stdout.
            Err(_) => self.carry.len(),
        };
        let rest = self.carry.split_off(complete);
        let text = String::from_utf8_lossy(&self.carry).into_owned();
        self.carry = rest;
        text
    }

    /// Whatever is held back, replaced if incomplete.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.carry).into_owned();
        self.carry.clear();
        text
    }
}

/// What the exec thread sends to the response.
pub(crate) enum Streamed {
    Output(Stream, String),
    Done(Box<Result<ExecResponse, ApiError>>),
    /// The final event of a streamed command.
    Command(Box<Result<crate::schema::CommandResponse, ApiError>>),
}

/// An output callback for `ExecOptions` that forwards text to `tx`.
pub(crate) struct Forward {
    tx: mpsc::Sender<Streamed>,
    out: Utf8Chunks,
    err: Utf8Chunks,
}

impl Forward {
    pub(crate) fn new(tx: mpsc::Sender<Streamed>) -> Forward {
        Forward { tx, out: Utf8Chunks::default(), err: Utf8Chunks::default() }
    }

    fn send_chunk(&mut self, stream: Stream, bytes: &[u8]) {
        let text = match stream {
            Stream::Stdout => self.out.push(bytes),
            Stream::Stderr => self.err.push(bytes),
        };
        if !text.is_empty() {
            // A client that went away does not stop the exec.
            let _ = self.tx.blocking_send(Streamed::Output(stream, text));
        }
    }

    /// Send what is held back.
    fn flush(&mut self) {
        for (stream, text) in [(Stream::Stdout, self.out.finish()), (Stream::Stderr, self.err.finish())] {
            if !text.is_empty() {
                let _ = self.tx.blocking_send(Streamed::Output(stream, text));
            }
        }
    }
}

impl Output for Forward {
    fn chunk(&mut self, stream: Stream, bytes: &[u8]) {
        self.send_chunk(stream, bytes);
    }

    /// The runtime calls it after the exec, before the result: held-back bytes go first.
    fn end(&mut self) {
        self.flush();
    }
}

/// Send the final event (on the exec thread, after the output).
fn done(tx: &mpsc::Sender<Streamed>, r: Result<ExecResponse, ApiError>) {
    let _ = tx.blocking_send(Streamed::Done(Box::new(r)));
}

fn event_of(ev: Streamed) -> Event {
    match ev {
        Streamed::Output(Stream::Stdout, text) => {
            Event::default().event("stdout").data(json!({ "data": text }).to_string())
        }
        Streamed::Output(Stream::Stderr, text) => {
            Event::default().event("stderr").data(json!({ "data": text }).to_string())
        }
        Streamed::Done(r) => final_event(*r),
        Streamed::Command(r) => final_event(*r),
    }
}

/// The `result` or `error` event.
fn final_event<T: serde::Serialize>(r: Result<T, ApiError>) -> Event {
    match r {
        Ok(r) => Event::default().event("result").data(serde_json::to_string(&r).unwrap_or_default()),
        Err(e) => {
            crate::metrics::error(e.code.as_str());
            Event::default()
                .event("error")
                .data(serde_json::to_string(&ErrorBody { error: e.detail() }).unwrap_or_default())
        }
    }
}

/// The SSE response over what the exec thread sends; it ends after the final event.
pub(crate) fn sse(rx: mpsc::Receiver<Streamed>) -> Sse<impl FutStream<Item = Result<Event, Infallible>>> {
    let events = futures_util::stream::unfold((rx, false), |(mut rx, done)| async move {
        if done {
            return None;
        }
        let ev = rx.recv().await?;
        let last = matches!(ev, Streamed::Done(_) | Streamed::Command(_));
        Some((Ok(event_of(ev)), (rx, last)))
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

pub(crate) const STREAM_DOC: &str =
    "Server-Sent Events: `stdout` / `stderr` events with data `{\"data\": text}` as the code writes, \
then one `result` event (data: the same JSON as the non-streaming route) or one `error` event (data: the non-streaming \
route's error body, `{\"error\": {code, message, stdout?, stderr?}}`)";

/// A one-shot exec whose output is streamed as it is written.
#[utoipa::path(post, path = "/exec/stream", tag = "exec", request_body = ExecRequest,
    responses((status = 200, description = STREAM_DOC, content_type = "text/event-stream", body = SseEvent)))]
pub(crate) async fn exec_stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let t0 = Instant::now();
    let timeout = crate::fair::key_timeout(&state, &caller, req.timeout_seconds)?;
    super::wait_for_template(&state, &caller.tenant, req.template.as_deref()).await?;
    let req = state.runtime.oneshot(
        &caller.tenant,
        req.code,
        timeout,
        req.template.as_deref(),
        &crate::schema::network_layers(&caller, &req.network)?,
        &caller.key_secrets(),
    )?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let (tx, rx) = mpsc::channel(CHANNEL);
    let fwd = Box::new(Forward::new(tx.clone()));
    state.runtime.spawn_exec(req, Some(fwd), permit, move |r| {
        metrics::exec("stream", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
        let r = r.map_err(ApiError::from).map(|o| {
            metrics::fork(o.fork_ms / 1000.0);
            ExecResponse::of_oneshot(&o, t0)
        });
        done(&tx, r);
    });
    Ok(sse(rx))
}

/// An exec in a session whose output is streamed as it is written.
#[utoipa::path(post, path = "/sessions/{id}/exec/stream", tag = "sessions", request_body = SessionExec,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, description = STREAM_DOC, content_type = "text/event-stream", body = SseEvent)))]
pub(crate) async fn session_exec_stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SessionExec>,
) -> Result<impl IntoResponse, ApiError> {
    let t0 = Instant::now();
    state.runtime.check_code(&req.code)?;
    // What can be refused before the exec starts is an HTTP error, not an event.
    let (c, i, code) = (caller.clone(), id.clone(), req.code.clone());
    blocking(&state, move |rt| Ok(rt.check_session_exec(&c.tenant, &i, &code, &c.quota())?)).await?;
    let timeout = super::sessions::exec_timeout(&state, &caller, &id, req.timeout_seconds).await?;
    let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
    let (tx, rx) = mpsc::channel(CHANNEL);
    let fwd = Box::new(Forward::new(tx.clone()));
    tokio::spawn(async move {
        let r =
            state.runtime.session_exec(&caller.tenant, &id, req.code, timeout, caller.quota(), Some(fwd), permit).await;
        metrics::sessions(state.runtime.resident_sessions());
        metrics::exec("session_stream", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
        let r = r.map_err(ApiError::from).map(|o| {
            metrics::checkpoint_bytes(o.checkpoint.bytes);
            ExecResponse::of_session(&o, t0)
        });
        let _ = tx.send(Streamed::Done(Box::new(r))).await;
    });
    Ok(sse(rx))
}

#[cfg(test)]
mod tests {
    use super::Utf8Chunks;

    #[test]
    fn utf8_sequences_are_not_split_across_chunks() {
        let mut d = Utf8Chunks::default();
        let s = "aé€😀".as_bytes();
        // a = 0, é = 1..3 (c3 a9), € = 3..6 (e2 82 ac), 😀 = 6..10 (f0 9f 98 80)
        assert_eq!(d.push(&s[..2]), "a");
        assert_eq!(d.push(&s[2..4]), "é");
        assert_eq!(d.push(&s[4..5]), "");
        assert_eq!(d.push(&s[5..8]), "€");
        assert_eq!(d.push(&s[8..9]), "");
        assert_eq!(d.push(&s[9..]), "😀");
        assert_eq!(d.finish(), "");
        // Invalid bytes are replaced, an incomplete tail at the end too.
        assert_eq!(d.push(b"x\xffy"), "x\u{fffd}y");
        assert_eq!(d.push(b"z\xe2\x82"), "z");
        assert_eq!(d.finish(), "\u{fffd}");
    }
}
