//! envd's `process.Process` service over the session's background processes:
//! `Start` starts every command as a background process of the sandbox's
//! session (its pid is the session's) and streams its output from the
//! process' rings as it is written, then `end` with its exit code. The
//! sandbox stays usable meanwhile (`commands.run(background=True)` returns at
//! once); `Connect` re-attaches to a process (its output from then on),
//! `List`, `SendSignal`, `SendInput`, `StreamInput` and `CloseStdin` act on
//! the session's processes. A command started with `stdin` reads what
//! `SendInput` writes; without, `/dev/null`.
//!
//! Checkpoints: the start makes none; the end of a command seen by its `Start`
//! stream makes one (named after the command), before its `end` event, so a
//! foreground `commands.run` makes one checkpoint of its outcome as before. A
//! process whose stream went away is recorded by the session's next checkpoint.
//!
//! The SDK runs every command as `/bin/bash -l -c CMD`, and the images ship bash:
//! the argv runs as given.

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
use forkbox_runtime::{CommandLine, JobInfo, Stream};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;

use super::connect::{self, end, message};
use super::error::{Code, ConnectError};
use super::{PendingSetup, SandboxRec, HOME};
use crate::handlers::processes::{follow, Followed};
use crate::handlers::stream::CHANNEL;
use crate::AppState;

/// How often a stream sends a keepalive (the SDK asks for at least every 50 s).
const KEEPALIVE: Duration = Duration::from_secs(30);
const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;
/// Configs kept for `List` (the session keeps at most 64 processes).
const CONFIGS_MAX: usize = 128;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(reconnect))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/StreamInput", post(stream_input))
        .route("/process.Process/CloseStdin", post(close_stdin))
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

/// envd's `PTY` message: `{size: {rows, cols}}`.
#[derive(Deserialize)]
struct PtyRequest {
    #[serde(default)]
    size: Option<PtyRequestSize>,
}

#[derive(Deserialize)]
struct PtyRequestSize {
    #[serde(default)]
    rows: u32,
    #[serde(default)]
    cols: u32,
}

impl PtyRequest {
    /// The size asked for (rows, cols), each 1 to 10000.
    fn size(&self) -> Result<(u16, u16), ConnectError> {
        let s = self.size.as_ref().ok_or_else(|| ConnectError::invalid("pty without a size"))?;
        let ok = |v: u32| u16::try_from(v).ok().filter(|v| (1..=10_000).contains(v));
        match (ok(s.rows), ok(s.cols)) {
            (Some(r), Some(c)) => Ok((r, c)),
            _ => Err(ConnectError::invalid(format!("pty size {}x{} is out of range (1 to 10000)", s.rows, s.cols))),
        }
    }
}

#[derive(Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    #[serde(default)]
    pty: Option<PtyRequest>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
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

/// The `connect-timeout-ms` of a call as it is (a command's lifetime: 0 or none is no limit).
fn header_timeout(headers: &HeaderMap) -> Option<Duration> {
    let ms = headers.get("connect-timeout-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())?;
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// What a data-plane call that runs in the guest has once it may start.
pub(super) struct Admitted {
    pub caller: crate::auth::Caller,
    pub permit: crate::fair::ExecSlot,
}

/// The prologue of a command's start: the sandbox is running, its session exists and
/// `code` is within the caller's limits (code size, disk), then an exec slot.
pub(super) async fn admit(state: &AppState, rec: &SandboxRec, code: &str) -> Result<Admitted, ConnectError> {
    running(rec)?;
    let caller = rec.caller();
    let (c, i, checked) = (caller.clone(), rec.id.clone(), code.to_string());
    crate::handlers::blocking(state, move |rt| Ok(rt.check_session_exec(&c.tenant, &i, &checked, &c.quota())?)).await?;
    let permit = crate::fair::acquire_for(state, &caller, 1).await?;
    Ok(Admitted { caller, permit })
}

/// `Start`: start the command as a background process of the session; `start
/// {pid}` first, its output as it is written, `end {exitCode}`.
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
    let size = req.pty.as_ref().map(PtyRequest::size).transpose()?;
    let line = command_line(&req.process);
    let cwd = super::guest_path(req.process.cwd.as_deref().unwrap_or(HOME))?;
    let cmd = forkbox_runtime::Command::new(line, Some(cwd), req.process.envs.clone())?;
    let label = format!("# command: {}", cmd.label());
    let code = match size {
        Some((rows, cols)) => cmd.pty_code(rows, cols),
        None => cmd.background_code(req.stdin.unwrap_or(false)),
    };
    // What the sandbox owes the guest (its setup, an execution's env_vars to undo) goes first, in the same exec.
    let setup = rec.pending_setup().await;
    let code = match setup.as_ref().and_then(PendingSetup::code) {
        Some(owed) => format!("{owed}{code}"),
        None => code,
    };
    let Admitted { caller, permit } = admit(&state, &rec, &code).await?;
    // The command's lifetime: the call's own timeout (the SDK's, 60 s by default; 0: none).
    let deadline = header_timeout(&headers).map(|t| tokio::time::Instant::now() + t);
    let started = state
        .runtime
        .session_background_command(&caller.tenant, &rec.id, code, None, caller.quota(), false, permit)
        .await?;
    if let Some(p) = setup {
        p.done(None);
    }
    let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL);
    let job = match started.started {
        Ok(job) => job,
        // It could not start: what the start said, and its status.
        Err(status) => {
            let _ = tx.try_send(message(&json!({ "event": { "start": { "pid": 0 } } })));
            for (key, text) in [("stdout", &started.result.stdout), ("stderr", &started.result.stderr)] {
                if !text.is_empty() {
                    let b64 = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
                    let _ = tx.try_send(message(&json!({ "event": { "data": { key: b64 } } })));
                }
            }
            let ev = json!({ "event": { "end": {
                "exitCode": status, "exited": true, "status": format!("exit status {status}"),
            } } });
            let _ = tx.try_send(message(&ev));
            let _ = tx.try_send(end(None));
            return Ok(connect::stream(rx));
        }
    };
    let pid = job.pid;
    {
        let mut config = serde_json::to_value(&req.process).unwrap_or_default();
        if let Some(tag) = &req.tag {
            config["tag"] = json!(tag);
        }
        let mut st = rec.lock();
        st.processes.insert(pid, config);
        while st.processes.len() > CONFIGS_MAX {
            st.processes.pop_first();
        }
        if size.is_some() {
            st.ptys.insert(pid);
        }
        while st.ptys.len() > CONFIGS_MAX {
            st.ptys.pop_first();
        }
    }
    let _ = tx.send(message(&json!({ "event": { "start": { "pid": pid } } }))).await;
    tokio::spawn(stream_process(state, rec, pid, [0, 0], deadline, Some(label), tx));
    Ok(connect::stream(rx))
}

/// Forward process `pid`'s output from `offsets` to a Connect stream until it
/// ends, then (with `checkpoint`, a `Start`'s stream) checkpoint the session
/// named so, then `end`. Past `deadline` the process is killed and the stream
/// ends with `deadline_exceeded`.
async fn stream_process(
    state: AppState,
    rec: Arc<SandboxRec>,
    pid: u32,
    offsets: [u64; 2],
    deadline: Option<tokio::time::Instant>,
    checkpoint: Option<String>,
    tx: mpsc::Sender<Bytes>,
) {
    // A pty's output (its stdout: the terminal's screen) is `pty` data.
    let on_pty = rec.lock().ptys.contains(&pid);
    let (ftx, mut frx) = mpsc::channel::<Followed>(CHANNEL);
    let follower =
        follow(state.clone(), rec.tenant.clone(), rec.id.clone(), pid, [Some(offsets[0]), Some(offsets[1])], ftx);
    tokio::spawn(follower);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let mut timed_out = false;
    let until = async move {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until);
    let last = loop {
        tokio::select! {
            ev = frx.recv() => match ev {
                Some(Followed::Output { stream, data, .. }) => {
                    let key = match stream {
                        Stream::Stdout if on_pty => "pty",
                        Stream::Stdout => "stdout",
                        Stream::Stderr => "stderr",
                    };
                    let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
                    // A client that went away stops the following, not the process.
                    if tx.send(message(&json!({ "event": { "data": { key: b64 } } }))).await.is_err() {
                        return;
                    }
                }
                Some(Followed::End(info)) => break Ok(info),
                Some(Followed::Failed(e)) => break Err(ConnectError::from(e)),
                None => break Err(ConnectError::new(Code::Internal, "the process follower stopped")),
            },
            _ = tick.tick() => {
                if tx.send(message(&json!({ "event": { "keepalive": {} } }))).await.is_err() {
                    return;
                }
            }
            _ = &mut until, if !timed_out => {
                timed_out = true;
                let (t, i) = (rec.tenant.clone(), rec.id.clone());
                let _ = crate::handlers::blocking(&state, move |rt| Ok(rt.job_signal(&t, &i, pid, SIGKILL)?)).await;
            }
        }
    };
    let info = match last {
        Ok(info) => info,
        Err(e) => {
            let _ = tx.send(end(Some(&e))).await;
            return;
        }
    };
    if let Some(label) = checkpoint {
        // Busy: a call of the session runs now; its checkpoint records the command's outcome.
        if let Err(e) = state.runtime.checkpoint_now(&rec.tenant, &rec.id, label).await {
            tracing::debug!("checkpoint after command {pid} of {}: {e}", rec.id);
        }
    }
    let _ = tx.send(message(&end_event(&info))).await;
    let last = if timed_out {
        end(Some(&ConnectError::new(Code::DeadlineExceeded, "the command ran past its timeout and was killed")))
    } else {
        end(None)
    };
    let _ = tx.send(last).await;
}

/// envd's `end` event of a process (a signal's end as Go reports it).
fn end_event(info: &JobInfo) -> serde_json::Value {
    match (info.exit_code, info.signal) {
        (_, Some(sig)) => {
            let name = match sig {
                9 => "killed".to_string(),
                15 => "terminated".to_string(),
                2 => "interrupt".to_string(),
                n => format!("signal {n}"),
            };
            let status = format!("signal: {name}");
            json!({ "event": { "end": { "exitCode": -1, "exited": false, "status": status, "error": status } } })
        }
        (code, None) => {
            let code = code.unwrap_or(-1);
            json!({ "event": { "end": { "exitCode": code, "exited": true, "status": format!("exit status {code}") } } })
        }
    }
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

fn no_such(sel: &PidSelector) -> ConnectError {
    match (&sel.pid, &sel.tag) {
        (Some(p), _) => ConnectError::new(Code::NotFound, format!("process with pid {p} not found")),
        (None, Some(t)) => ConnectError::new(Code::NotFound, format!("process with tag {t:?} not found")),
        (None, None) => ConnectError::invalid("a process selector needs pid or tag"),
    }
}

/// The session's processes, with the configs `Start` recorded (pruned to them).
async fn jobs(state: &AppState, rec: &SandboxRec) -> Result<Vec<JobInfo>, ConnectError> {
    running(rec)?;
    let (t, i) = (rec.tenant.clone(), rec.id.clone());
    let jobs = crate::handlers::blocking(state, move |rt| Ok(rt.session_jobs(&t, &i)?)).await?;
    rec.lock().processes.retain(|pid, _| jobs.iter().any(|j| j.pid == *pid));
    Ok(jobs)
}

/// The session's process `sel` names (by pid, or by the tag `Start` gave it).
async fn select(state: &AppState, rec: &SandboxRec, sel: &PidSelector) -> Result<JobInfo, ConnectError> {
    let jobs = jobs(state, rec).await?;
    let pid = match (sel.pid, &sel.tag) {
        (Some(p), _) => Some(p),
        (None, Some(tag)) => rec
            .lock()
            .processes
            .iter()
            .find(|(_, c)| c.get("tag").and_then(|t| t.as_str()) == Some(tag.as_str()))
            .map(|(p, _)| *p),
        (None, None) => None,
    };
    pid.and_then(|p| jobs.into_iter().find(|j| j.pid == p)).ok_or_else(|| no_such(sel))
}

/// `Connect`: re-attach to a process: `start {pid}`, its output from now on, `end`.
async fn reconnect(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: Selector = connect::request(&headers, &body)?;
        let job = select(&state, &rec, &req.process).await?;
        let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL);
        let _ = tx.send(message(&json!({ "event": { "start": { "pid": job.pid } } }))).await;
        let deadline = header_timeout(&headers).map(|t| tokio::time::Instant::now() + t);
        let from = [job.stdout_bytes, job.stderr_bytes];
        tokio::spawn(stream_process(state, rec, job.pid, from, deadline, None, tx));
        Ok(connect::stream(rx))
    }
    .await;
    r.unwrap_or_else(connect::stream_error)
}

/// `List`: the session's running processes.
async fn list(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let _: serde_json::Value = connect::request(&headers, &body)?;
        let jobs = jobs(&state, &rec).await?;
        let st = rec.lock();
        let processes: Vec<_> = jobs
            .iter()
            .filter(|j| j.running)
            .map(|j| {
                // Started otherwise (the forkbox API): its argv as the config.
                let config = st.processes.get(&j.pid).cloned().unwrap_or_else(|| {
                    let mut argv = j.argv.iter();
                    json!({ "cmd": argv.next().cloned().unwrap_or_default(), "args": argv.collect::<Vec<_>>(), "envs": {} })
                });
                let mut p = json!({ "pid": j.pid, "config": config });
                if let Some(tag) = config.get("tag") {
                    p["tag"] = tag.clone();
                }
                p
            })
            .collect();
        Ok(connect::unary(json!({ "processes": processes })))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize)]
struct SignalRequest {
    process: PidSelector,
    #[serde(default)]
    signal: Option<serde_json::Value>,
}

/// A signal as envd's enum names it (or its number).
fn signal_number(v: Option<&serde_json::Value>) -> Result<i32, ConnectError> {
    match v {
        None => Ok(SIGKILL),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => Ok(SIGKILL),
            "SIGNAL_SIGTERM" => Ok(SIGTERM),
            other => Err(ConnectError::invalid(format!("signal {other:?} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"))),
        },
        Some(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(9) | Some(0) => Ok(SIGKILL),
            Some(15) => Ok(SIGTERM),
            _ => Err(ConnectError::invalid(format!("signal {n} is not SIGKILL (9) or SIGTERM (15)"))),
        },
        Some(other) => Err(ConnectError::invalid(format!("signal {other} is not a signal name"))),
    }
}

/// `SendSignal` (kill): the signal to each of the process' processes.
async fn send_signal(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: SignalRequest = connect::request(&headers, &body)?;
        let sig = signal_number(req.signal.as_ref())?;
        let job = select(&state, &rec, &req.process).await?;
        if !job.running {
            return Err(no_such(&req.process));
        }
        let (t, i, pid) = (rec.tenant.clone(), rec.id.clone(), job.pid);
        crate::handlers::blocking(&state, move |rt| Ok(rt.job_signal(&t, &i, pid, sig)?)).await?;
        Ok(connect::unary(json!({})))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize)]
struct InputRequest {
    process: PidSelector,
    #[serde(default)]
    input: Option<ProcessInput>,
}

#[derive(Deserialize)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

/// The bytes of an input message (base64, as proto3 JSON has bytes): `stdin`
/// or `pty` (what is typed on the terminal of a process started on one; the
/// job's input goes to the terminal either way).
fn input_bytes(input: Option<&ProcessInput>) -> Result<Vec<u8>, ConnectError> {
    let Some(input) = input else { return Ok(Vec::new()) };
    let (what, b64) = match (&input.stdin, &input.pty) {
        (Some(_), Some(_)) => return Err(ConnectError::invalid("input has both stdin and pty")),
        (_, Some(p)) => ("pty", p.as_str()),
        (s, None) => ("stdin", s.as_deref().unwrap_or("")),
    };
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ConnectError::invalid(format!("{what} is not base64: {e}")))
}

/// Write to the stdin of the process `sel` names, then close it if `eof`.
async fn write_stdin(
    state: &AppState,
    rec: &SandboxRec,
    sel: &PidSelector,
    data: Vec<u8>,
    eof: bool,
) -> Result<(), ConnectError> {
    let job = select(state, rec, sel).await?;
    if data.len() > crate::handlers::processes::STDIN_WRITE_MAX {
        return Err(ConnectError::new(Code::ResourceExhausted, "over 256 KiB of stdin in one message"));
    }
    state.runtime.job_stdin(&rec.tenant, &rec.id, job.pid, data, eof).await?;
    Ok(())
}

/// `SendInput`: bytes for the process' stdin.
async fn send_input(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: InputRequest = connect::request(&headers, &body)?;
        let data = input_bytes(req.input.as_ref())?;
        write_stdin(&state, &rec, &req.process, data, false).await?;
        Ok(connect::unary(json!({})))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `CloseStdin`: end of file for the process' stdin.
async fn close_stdin(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: Selector = connect::request(&headers, &body)?;
        write_stdin(&state, &rec, &req.process, Vec::new(), true).await?;
        Ok(connect::unary(json!({})))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize)]
struct StreamInputMessage {
    #[serde(default)]
    start: Option<Selector>,
    #[serde(default)]
    data: Option<StreamInputData>,
}

#[derive(Deserialize)]
struct StreamInputData {
    #[serde(default)]
    input: Option<ProcessInput>,
}

/// `StreamInput` (a client stream): `start {process}`, then `data {input}`
/// messages written in order; answered with one empty message.
async fn stream_input(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    body: Bytes,
) -> Response {
    let r: Result<(), ConnectError> = async {
        let msgs: Vec<StreamInputMessage> = connect::messages(&body)?;
        let mut sel = None;
        for m in &msgs {
            if let Some(s) = &m.start {
                sel = Some(&s.process);
            }
            if let Some(d) = &m.data {
                let sel = sel.ok_or_else(|| ConnectError::invalid("stream input data before its start message"))?;
                let data = input_bytes(d.input.as_ref())?;
                write_stdin(&state, &rec, sel, data, false).await?;
            }
        }
        Ok(())
    }
    .await;
    let (tx, rx) = mpsc::channel::<Bytes>(2);
    match r {
        Ok(()) => {
            let _ = tx.try_send(message(&json!({})));
            let _ = tx.try_send(end(None));
        }
        Err(e) => {
            let _ = tx.try_send(end(Some(&e)));
        }
    }
    connect::stream(rx)
}

#[derive(Deserialize)]
struct UpdateRequest {
    process: PidSelector,
    #[serde(default)]
    pty: Option<PtyRequest>,
}

/// `Update`: a new size for the pty of a process started on one (SIGWINCH
/// to its foreground group); `invalid_argument` for one started without.
async fn update(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Response, ConnectError> = async {
        let req: UpdateRequest = connect::request(&headers, &body)?;
        let job = select(&state, &rec, &req.process).await?;
        let Some(pty) = &req.pty else { return Ok(connect::unary(json!({}))) };
        let (rows, cols) = pty.size()?;
        if !job.running {
            return Err(no_such(&req.process));
        }
        state.runtime.job_resize(&rec.tenant, &rec.id, job.pid, rows, cols).await?;
        Ok(connect::unary(json!({})))
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}
