//! envd's `process.Process` service over forkbox's command runner: a command is
//! an exec of the runtime's command snippet in the sandbox's session (checkpointed
//! like any exec), its output streamed as it is written.
//!
//! The SDK runs every command as `/bin/bash -l -c CMD`, and the images ship bash:
//! the argv runs as given. A command has stdin from `/dev/null`
//! (`SendInput`/`CloseStdin` are refused) and lives only as long as its call: a
//! `background=True` command holds the sandbox until it ends (calls meanwhile get
//! `unavailable`), and `Connect` cannot re-attach to one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use base64::Engine as _;
use forkbox_runtime::{CommandLine, CommandResult, Stream};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;

use super::connect::{self, end, message};
use super::error::{Code, ConnectError};
use super::{SandboxRec, HOME};
use crate::handlers::stream::{Forward, Streamed, CHANNEL};
use crate::AppState;

/// How often a stream sends a keepalive (the SDK asks for at least every 50 s).
const KEEPALIVE: Duration = Duration::from_secs(30);

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(reconnect))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/SendInput", post(stdin))
        .route("/process.Process/StreamInput", post(stdin))
        .route("/process.Process/CloseStdin", post(stdin))
        .route("/process.Process/Update", post(update))
}

#[derive(Deserialize, Serialize, Clone)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cwd: Option<String>,
}

#[derive(Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    #[serde(default)]
    pty: Option<serde_json::Value>,
    #[serde(default)]
    tag: Option<String>,
}

/// A paused sandbox answers nothing until it is connected again.
pub(super) fn running(rec: &SandboxRec) -> Result<(), ConnectError> {
    if rec.lock().paused {
        return Err(ConnectError::new(
            Code::Unavailable,
            format!("sandbox {} is paused: connect to it first (Sandbox.connect)", rec.id),
        ));
    }
    Ok(())
}

/// The command line of a process config: its argv as given (no shell of our own).
fn command_line(p: &ProcessConfig) -> CommandLine {
    CommandLine::Argv(std::iter::once(p.cmd.clone()).chain(p.args.iter().cloned()).collect())
}

/// The `connect-timeout-ms` of a call, as an exec time limit within the session's own.
pub(super) async fn call_timeout(
    state: &AppState,
    rec: &SandboxRec,
    headers: &HeaderMap,
) -> Result<Option<Duration>, ConnectError> {
    let Some(ms) = headers.get("connect-timeout-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    let (t, i) = (rec.tenant.clone(), rec.id.clone());
    let limit = crate::handlers::blocking(state, move |rt| Ok(rt.session(&t, &i)?.timeout_seconds())).await?;
    let want = ms as f64 / 1000.0;
    Ok((want > 0.0 && want < limit).then(|| Duration::from_secs_f64(want)))
}

/// What a data-plane call that runs in the guest has once it may start.
pub(super) struct Admitted {
    pub caller: crate::auth::Caller,
    /// The call's own time limit (`connect-timeout-ms`), within the session's.
    pub timeout: Option<Duration>,
    pub permit: crate::fair::ExecSlot,
}

/// The prologue of every guest exec of envd's calls: the sandbox is running, its session
/// exists and `code` is within the caller's limits (code size, disk), then an exec slot.
pub(super) async fn admit(
    state: &AppState,
    rec: &SandboxRec,
    headers: &HeaderMap,
    code: &str,
) -> Result<Admitted, ConnectError> {
    running(rec)?;
    let caller = rec.caller();
    let (c, i, checked) = (caller.clone(), rec.id.clone(), code.to_string());
    crate::handlers::blocking(state, move |rt| Ok(rt.check_session_exec(&c.tenant, &i, &checked, &c.quota())?)).await?;
    let timeout = call_timeout(state, rec, headers).await?;
    let permit = crate::fair::acquire_for(state, &caller, 1).await?;
    Ok(Admitted { caller, timeout, permit })
}

/// `Start`: run the command; `start {pid}` first, its output as it is written, `end {exitCode}`.
async fn start(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match start_inner(state, rec, headers, body).await {
        Ok(r) => r,
        Err(e) => connect::stream_error(e),
    }
}

async fn start_inner(
    state: AppState,
    rec: Arc<SandboxRec>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConnectError> {
    let req: StartRequest = connect::request(&headers, &body)?;
    running(&rec)?;
    if req.pty.is_some() {
        return Err(ConnectError::new(Code::Unimplemented, "PTYs are not supported by this server"));
    }
    let line = command_line(&req.process);
    let cwd = super::guest_path(req.process.cwd.as_deref().unwrap_or(HOME))?;
    let cmd = forkbox_runtime::Command::new(line, Some(cwd), req.process.envs.clone())?;
    let code = cmd.code();
    let Admitted { caller, timeout, permit } = admit(&state, &rec, &headers, &code).await?;
    let pid = {
        let mut st = rec.lock();
        if st.running.is_some() {
            return Err(ConnectError::new(
                Code::Unavailable,
                "another command or code execution is running in this sandbox (one at a time here)",
            ));
        }
        let pid = st.next_pid;
        st.next_pid = st.next_pid.wrapping_add(1).max(1);
        let mut config = serde_json::to_value(&req.process).unwrap_or_default();
        if let Some(tag) = &req.tag {
            config["tag"] = json!(tag);
        }
        st.running = Some((pid, config));
        pid
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL);
    let _ = tx.send(message(&json!({ "event": { "start": { "pid": pid } } }))).await;
    let (otx, mut orx) = mpsc::channel::<Streamed>(CHANNEL);
    let fwd = Box::new(Forward::new(otx));
    let (st2, rec2) = (state.clone(), rec.clone());
    let exec = tokio::spawn(async move {
        st2.runtime.session_exec(&caller.tenant, &rec2.id, code, timeout, caller.quota(), Some(fwd), permit).await
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
        loop {
            tokio::select! {
                ev = orx.recv() => match ev {
                    Some(Streamed::Output(stream, text)) => {
                        let key = if stream == Stream::Stdout { "stdout" } else { "stderr" };
                        let b64 = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
                        // A client that went away does not stop the command.
                        let _ = tx.send(message(&json!({ "event": { "data": { key: b64 } } }))).await;
                    }
                    Some(_) => {}
                    None => break,
                },
                _ = tick.tick() => {
                    let _ = tx.send(message(&json!({ "event": { "keepalive": {} } }))).await;
                }
            }
        }
        let r = exec.await;
        rec.lock().running = None;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.send(end(Some(&ConnectError::from(e)))).await;
                return;
            }
        };
        let last = match r {
            Ok(o) => {
                let c = CommandResult::of(&o.result);
                let ev = json!({ "event": { "end": {
                    "exitCode": c.exit_code,
                    "exited": true,
                    "status": format!("exit status {}", c.exit_code),
                } } });
                let _ = tx.send(message(&ev)).await;
                end(None)
            }
            Err(e) => end(Some(&ConnectError::from(e))),
        };
        let _ = tx.send(last).await;
    });
    Ok(connect::stream(rx))
}

#[derive(Deserialize)]
struct Selector {
    process: PidSelector,
}

#[derive(Deserialize)]
struct PidSelector {
    pid: Option<u32>,
    tag: Option<String>,
}

/// Whether `sel` names the command running now.
fn is_running(rec: &SandboxRec, sel: &PidSelector) -> bool {
    match &rec.lock().running {
        Some((pid, config)) => {
            sel.pid == Some(*pid)
                || (sel.tag.is_some() && config.get("tag").and_then(|t| t.as_str()) == sel.tag.as_deref())
        }
        None => false,
    }
}

fn no_such(sel: &PidSelector) -> ConnectError {
    match (&sel.pid, &sel.tag) {
        (Some(p), _) => ConnectError::new(Code::NotFound, format!("process with pid {p} not found")),
        (None, Some(t)) => ConnectError::new(Code::NotFound, format!("process with tag {t:?} not found")),
        (None, None) => ConnectError::invalid("a process selector needs pid or tag"),
    }
}

/// `Connect`: re-attaching to a running command is not possible here (its output goes to the call that started it).
async fn reconnect(Extension(rec): Extension<Arc<SandboxRec>>, headers: HeaderMap, body: Bytes) -> Response {
    let r = (|| {
        let req: Selector = connect::request(&headers, &body)?;
        running(&rec)?;
        if is_running(&rec, &req.process) {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "re-attaching to a running command is not supported here: its output streams to the call that started it",
            ));
        }
        Err(no_such(&req.process))
    })();
    match r {
        Ok(()) => connect::stream_error(ConnectError::new(Code::Internal, "unreachable")),
        Err(e) => connect::stream_error(e),
    }
}

/// `List`: the command running now, if any.
async fn list(Extension(rec): Extension<Arc<SandboxRec>>, headers: HeaderMap, body: Bytes) -> Response {
    let r = (|| {
        let _: serde_json::Value = connect::request(&headers, &body)?;
        running(&rec)?;
        let processes: Vec<_> = rec
            .lock()
            .running
            .iter()
            .map(|(pid, config)| {
                let mut p = json!({ "pid": pid, "config": config });
                if let Some(tag) = config.get("tag") {
                    p["tag"] = tag.clone();
                }
                p
            })
            .collect();
        Ok::<_, ConnectError>(connect::unary(json!({ "processes": processes })))
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize)]
struct SignalRequest {
    process: PidSelector,
    #[serde(default)]
    signal: Option<serde_json::Value>,
}

/// `SendSignal` (kill): the running command is interrupted (its child killed).
async fn send_signal(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: SignalRequest = connect::request(&headers, &body)?;
        let _ = req.signal;
        running(&rec)?;
        if !is_running(&rec, &req.process) {
            return Err(no_such(&req.process));
        }
        let (t, i) = (rec.tenant.clone(), rec.id.clone());
        crate::handlers::blocking(&state, move |rt| Ok(rt.interrupt(&t, &i)?)).await?;
        Ok(connect::unary(json!({})))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `SendInput`, `StreamInput`, `CloseStdin`: commands here read `/dev/null`.
async fn stdin(Extension(rec): Extension<Arc<SandboxRec>>, headers: HeaderMap, body: Bytes) -> Response {
    let streaming = connect::is_stream(&headers);
    let e = match connect::request::<Selector>(&headers, &body) {
        Err(e) => e,
        Ok(req) if is_running(&rec, &req.process) => ConnectError::new(
            Code::FailedPrecondition,
            "stdin is not supported here: commands run with stdin from /dev/null",
        ),
        Ok(req) => no_such(&req.process),
    };
    if streaming {
        connect::stream_error(e)
    } else {
        e.into_response()
    }
}

/// `Update` (a PTY's size): no PTYs here.
async fn update() -> ConnectError {
    ConnectError::new(Code::Unimplemented, "PTYs are not supported by this server")
}
