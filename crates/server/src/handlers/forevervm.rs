//! ForeverVM's API over forkbox sessions, so ForeverVM's clients (its
//! published SDKs) work unchanged against forkbox. A ForeverVM *machine* is a
//! forkbox session (its name is the session id); an *instruction* is an exec.
//!
//! - `GET /v1/whoami` -> `{account}` (the tenant)
//! - `POST /v1/machine/new {tags?, memory_mb?}` -> `{machine_name}`
//! - `GET|POST /v1/machine/list` -> `{machines: [{name, created_at, running, has_pending_instructions, expires_at, tags}]}`
//! - `POST /v1/machine/{name}/exec {instruction: {code, timeout_seconds?}, interrupt?}` -> `{instruction_seq, machine, interrupted}`:
//!   returns at once; the instruction runs in the background, after the machine's earlier ones (FIFO)
//! - `GET /v1/machine/{name}/exec/{seq}/result` -> `{instruction_id, result}`, waiting up to 60 s for
//!   the instruction to finish (then 202 with `result: null`: poll again)
//! - WebSocket `/v1/machine/{name}/repl` (`new`: a new machine): the server sends
//!   `{type: "connected", machine_name}`, then for each `{type: "exec", instruction, request_id}`:
//!   `exec_received {request_id, seq}`, `output {instruction_id, chunk}`..., then `result {instruction_id, result}`; bad messages get
//!   `error {code, message}`.
//!
//! A result is `{value, data, runtime_ms}` or `{error: "<Type>: <message>\n<traceback>", runtime_ms}`;
//! a sandbox failure (timeout, crash) is an `error` result `"<code>: <message>"` too.
//! Results live in memory (the last [`KEEP_RESULTS`] per machine); instruction numbers restart
//! with the server. `interrupt: true` interrupts the running instruction first (`interrupted`
//! says whether one ran). On the WebSocket, what the code writes arrives as
//! `output {instruction_id, chunk: {stream, data}}` before the result. The instruction's
//! `timeout_seconds` is validated; the session's own time limit applies.
//!
//! Unlike the forkbox routes, these request bodies accept unknown fields:
//! ForeverVM's SDKs send more than these routes read (the JS SDK sends
//! `code` and `max_duration_seconds` beside `instruction`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{OriginalUri, State};
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use forkbox_api::ErrorCode;
use forkbox_runtime::{NewSession, Outcome, Output, Runtime};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::blocking;
use super::stream::{Forward, Streamed};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{ApiJson, ApiPath};
use crate::{metrics, AppState};

/// Finished results kept per machine for the long poll.
pub const KEEP_RESULTS: usize = 64;
/// ... and at most this many bytes of them (the oldest go first; the newest
/// is always kept, and is itself bounded by the output limit).
pub const KEEP_RESULT_BYTES: usize = 8 << 20;
/// Instructions a machine may have queued or running at once.
pub const MAX_PENDING: usize = 16;
/// How long the result long poll waits.
pub const LONG_POLL: Duration = Duration::from_secs(60);

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(whoami))
        .routes(routes!(machine_new))
        .routes(routes!(machine_list, machine_list_post))
        .routes(routes!(machine_exec))
        .routes(routes!(exec_result))
        .routes(routes!(repl))
}

// ---------------------------------------------------------------------------
// Machines: instruction numbering, FIFO order, results
// ---------------------------------------------------------------------------

#[derive(Default)]
struct MachineState {
    next_seq: i64,
    pending: usize,
    results: BTreeMap<i64, FvmResult>,
    /// `FvmResult::bytes` of `results`.
    result_bytes: usize,
}

/// One machine's instruction queue.
#[derive(Default)]
struct Machine {
    /// Held while an instruction runs; tokio's mutex is fair, so instructions run in seq order.
    run: tokio::sync::Mutex<()>,
    state: Mutex<MachineState>,
    /// Bumped whenever a result is stored (wakes long polls).
    done: tokio::sync::watch::Sender<u64>,
}

#[derive(Default)]
pub struct Machines {
    map: Mutex<HashMap<String, Arc<Machine>>>,
}

impl Machines {
    fn get(&self, id: &str) -> Arc<Machine> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).entry(id.to_string()).or_default().clone()
    }

    fn pending(&self, id: &str) -> bool {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .is_some_and(|m| m.state.lock().unwrap_or_else(|e| e.into_inner()).pending > 0)
    }

    /// Drop a deleted session's machine state.
    pub fn forget(&self, id: &str) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }
}

impl Machine {
    /// Number the next instruction, or 409 if too many are queued.
    fn enqueue(&self) -> Result<i64, ApiError> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.pending >= MAX_PENDING {
            return Err(ApiError::new(
                ErrorCode::SessionBusy,
                format!("the machine has {MAX_PENDING} instructions queued or running; wait for their results"),
            ));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        st.pending += 1;
        Ok(seq)
    }

    fn finish(&self, seq: i64, result: FvmResult) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.pending = st.pending.saturating_sub(1);
        st.result_bytes += result.bytes();
        st.results.insert(seq, result);
        while st.results.len() > KEEP_RESULTS || (st.result_bytes > KEEP_RESULT_BYTES && st.results.len() > 1) {
            if let Some((_, old)) = st.results.pop_first() {
                st.result_bytes = st.result_bytes.saturating_sub(old.bytes());
            }
        }
        drop(st);
        self.done.send_modify(|n| *n += 1);
    }
}

/// ForeverVM's result of an instruction.
#[derive(Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum FvmResult {
    Value {
        /// repr() of the final expression, if any.
        #[schema(required)]
        value: Option<String>,
        /// Rich display data (always null here).
        #[schema(required)]
        data: Option<serde_json::Value>,
        runtime_ms: u64,
    },
    Error {
        /// `"<Type>: <message>\n<traceback>"`, or `"<code>: <message>"` for a sandbox failure.
        error: String,
        runtime_ms: u64,
    },
}

impl FvmResult {
    /// Host bytes this result holds.
    fn bytes(&self) -> usize {
        match self {
            FvmResult::Value { value, .. } => value.as_ref().map_or(0, String::len) + 64,
            FvmResult::Error { error, .. } => error.len() + 64,
        }
    }
}

/// Run instruction `seq` on machine `id` after the machine's earlier ones, and record its result.
/// With `output`, what the code writes is sent there as it is written.
async fn run_instruction(
    state: AppState,
    machine: Arc<Machine>,
    caller: Caller,
    id: String,
    seq: i64,
    code: String,
    output: Option<mpsc::Sender<Streamed>>,
) -> FvmResult {
    let _turn = machine.run.lock().await;
    let t0 = Instant::now();
    let r: Result<_, ApiError> = async {
        let permit = crate::fair::acquire_for(&state, &caller, 1).await?;
        let out = output.map(|tx| Box::new(Forward::new(tx)) as Box<dyn Output>);
        Ok(state.runtime.session_exec(&caller.tenant, &id, code, None, caller.quota(), out, permit).await?)
    }
    .await;
    metrics::exec("forevervm", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
    let result = match r {
        Ok(o) => {
            let runtime_ms = o.result.runtime_ms.round() as u64;
            match o.result.error {
                None => FvmResult::Value { value: o.result.value, data: None, runtime_ms },
                Some(e) => {
                    FvmResult::Error { error: format!("{}: {}\n{}", e.kind, e.message, e.traceback), runtime_ms }
                }
            }
        }
        Err(e) => FvmResult::Error {
            error: format!("{}: {}", e.code, crate::error::scrub(&e.message)),
            runtime_ms: t0.elapsed().as_millis() as u64,
        },
    };
    machine.finish(seq, result.clone());
    result
}

/// The session behind machine `name`, if the caller owns it. Blocking.
fn owned(rt: &Runtime, caller: &Caller, name: &str) -> Result<(), ApiError> {
    rt.session(&caller.tenant, name).map(|_| ()).map_err(ApiError::from)
}

fn iso8601(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

// ---------------------------------------------------------------------------
// HTTP routes
// ---------------------------------------------------------------------------

#[derive(Serialize, ToSchema)]
pub struct Whoami {
    /// The tenant of the API key.
    pub account: String,
}

/// ForeverVM: who the API key belongs to.
#[utoipa::path(get, path = "/whoami", tag = "forevervm", responses((status = 200, body = Whoami)))]
async fn whoami(Extension(caller): Extension<Caller>) -> Json<Whoami> {
    Json(Whoami { account: caller.tenant })
}

#[derive(Deserialize, ToSchema)]
pub struct MachineNew {
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    #[schema(minimum = 64)]
    pub memory_mb: Option<u64>,
    /// forkbox extension: the template of the machine (default: the server's default).
    pub template: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct MachineCreated {
    pub machine_name: String,
}

/// ForeverVM: a new machine (a new session).
#[utoipa::path(post, path = "/machine/new", tag = "forevervm", request_body = MachineNew,
    responses((status = 200, body = MachineCreated)))]
async fn machine_new(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<MachineNew>,
) -> Result<Json<MachineCreated>, ApiError> {
    let v = blocking(&state, move |rt| {
        let network = crate::schema::network_layers(&caller, &None)?;
        let key_secrets = caller.key_secrets();
        let new = NewSession {
            tags: req.tags,
            memory_mb: req.memory_mb,
            template: req.template.as_deref(),
            network: &network,
            key_secrets: &key_secrets,
            ..NewSession::default()
        };
        Ok(rt.create_session(&caller.tenant, new, &caller.quota())?)
    })
    .await?;
    Ok(Json(MachineCreated { machine_name: v.record.id }))
}

#[derive(Serialize, ToSchema)]
pub struct MachineInfo {
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
    /// Whether its VM is in memory.
    pub running: bool,
    pub has_pending_instructions: bool,
    /// Machines do not expire (always null).
    pub expires_at: Option<String>,
    pub tags: BTreeMap<String, String>,
}

#[derive(Serialize, ToSchema)]
pub struct MachineList {
    pub machines: Vec<MachineInfo>,
}

async fn list(state: AppState, caller: Caller) -> Result<Json<MachineList>, ApiError> {
    let st = state.clone();
    blocking(&state, move |rt| {
        let machines = rt
            .sessions(&caller.tenant, &[])?
            .into_iter()
            .map(|v| MachineInfo {
                running: v.resident,
                has_pending_instructions: st.machines.pending(&v.record.id),
                created_at: iso8601(v.record.created_ms),
                expires_at: None,
                tags: v.record.tags,
                name: v.record.id,
            })
            .collect();
        Ok(Json(MachineList { machines }))
    })
    .await
}

/// ForeverVM: the caller's machines (all its sessions).
#[utoipa::path(get, path = "/machine/list", tag = "forevervm", responses((status = 200, body = MachineList)))]
async fn machine_list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<MachineList>, ApiError> {
    list(state, caller).await
}

/// ForeverVM: the caller's machines (POST form; a body, if any, is ignored).
#[utoipa::path(post, path = "/machine/list", tag = "forevervm", responses((status = 200, body = MachineList)))]
async fn machine_list_post(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<MachineList>, ApiError> {
    list(state, caller).await
}

#[derive(Deserialize, ToSchema)]
pub struct Instruction {
    pub code: String,
    /// Validated (> 0, at most the server's maximum); the session's own time limit applies.
    pub timeout_seconds: Option<f64>,
}

#[derive(Deserialize, ToSchema)]
pub struct MachineExec {
    pub instruction: Instruction,
    /// Interrupt the machine's running instruction first (it ends with a KeyboardInterrupt error).
    #[serde(default)]
    pub interrupt: bool,
}

#[derive(Serialize, ToSchema)]
pub struct MachineExecAccepted {
    /// Number of the instruction on this machine (poll its result with it).
    pub instruction_seq: i64,
    pub machine: String,
    /// Whether a running instruction was interrupted.
    pub interrupted: bool,
}

fn check_instruction(rt: &Runtime, caller: &Caller, i: &Instruction) -> Result<(), ApiError> {
    rt.check_code(&i.code)?;
    crate::fair::key_timeout_of(rt, caller, i.timeout_seconds)?;
    if i.timeout_seconds.is_some() {
        rt.timeout(i.timeout_seconds)?;
    }
    Ok(())
}

/// ForeverVM: queue an instruction on a machine; returns at once.
#[utoipa::path(post, path = "/machine/{name}/exec", tag = "forevervm", request_body = MachineExec,
    params(("name" = String, Path, description = "Machine name (session id)")),
    responses((status = 200, body = MachineExecAccepted),
              (status = 409, description = "Too many instructions queued on the machine", body = ErrorBody)))]
async fn machine_exec(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<MachineExec>,
) -> Result<Json<MachineExecAccepted>, ApiError> {
    check_instruction(&state.runtime, &caller, &req.instruction)?;
    let (c, n) = (caller.clone(), name.clone());
    blocking(&state, move |rt| {
        owned(rt, &c, &n)?;
        Ok(rt.check_disk(&c.tenant, &c.quota())?)
    })
    .await?;
    let machine = state.machines.get(&name);
    // ForeverVM's `interrupt`: stop the running instruction, then queue this one.
    let interrupted = if req.interrupt {
        let (c, n) = (caller.clone(), name.clone());
        blocking(&state, move |rt| Ok(rt.interrupt(&c.tenant, &n)?)).await?
    } else {
        false
    };
    let seq = machine.enqueue()?;
    tokio::spawn(run_instruction(state.clone(), machine, caller, name.clone(), seq, req.instruction.code, None));
    Ok(Json(MachineExecAccepted { instruction_seq: seq, machine: name, interrupted }))
}

#[derive(Serialize, ToSchema)]
pub struct InstructionResult {
    pub instruction_id: i64,
    /// Null only with status 202 (still running after the long poll: poll again).
    pub result: Option<FvmResult>,
}

/// ForeverVM: an instruction's result, waiting up to 60 s for it.
#[utoipa::path(get, path = "/machine/{name}/exec/{seq}/result", tag = "forevervm",
    params(("name" = String, Path, description = "Machine name (session id)"), ("seq" = i64, Path, description = "instruction_seq")),
    responses((status = 200, body = InstructionResult),
              (status = 202, description = "Still running after the long poll; poll again", body = InstructionResult)))]
async fn exec_result(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((name, seq)): ApiPath<(String, i64)>,
) -> Result<Response, ApiError> {
    let (c, n) = (caller.clone(), name.clone());
    blocking(&state, move |rt| owned(rt, &c, &n)).await?;
    let machine = state.machines.get(&name);
    let mut done = machine.done.subscribe();
    let deadline = tokio::time::Instant::now() + LONG_POLL;
    loop {
        {
            let st = machine.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(r) = st.results.get(&seq) {
                return Ok(Json(InstructionResult { instruction_id: seq, result: Some(r.clone()) }).into_response());
            }
            let evicted = st.results.first_key_value().is_some_and(|(first, _)| seq < *first);
            let running = seq >= 0 && seq < st.next_seq && !evicted && st.pending > 0;
            if !running {
                return Err(ApiError::new(
                    ErrorCode::InstructionNotFound,
                    format!("machine {name} has no instruction {seq} (results are kept for the last {KEEP_RESULTS})"),
                ));
            }
        }
        match tokio::time::timeout_at(deadline, done.changed()).await {
            Ok(Ok(())) => continue,
            Ok(Err(_)) => return Err(ApiError::internal("the machine went away")),
            Err(_) => {
                return Ok((StatusCode::ACCEPTED, Json(InstructionResult { instruction_id: seq, result: None }))
                    .into_response())
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The REPL WebSocket
// ---------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ClientMessage {
    Exec { instruction: Instruction, request_id: i64 },
}

/// ForeverVM: the REPL WebSocket of a machine (`new`: create one first).
#[utoipa::path(get, path = "/machine/{name}/repl", tag = "forevervm",
    params(("name" = String, Path, description = "Machine name (session id), or `new`")),
    responses((status = 101, description = "Switching to the WebSocket protocol"),
              (status = 426, description = "Not a WebSocket upgrade request", body = ErrorBody)))]
async fn repl(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let ws = ws.map_err(|e| ApiError::new(ErrorCode::UpgradeRequired, format!("this route is a WebSocket: {e}")))?;
    if name != "new" {
        let (c, n) = (caller.clone(), name.clone());
        blocking(&state, move |rt| owned(rt, &c, &n)).await?;
        // In a cluster: a machine another node has is served there, through this node.
        match crate::forward::websocket::owner_socket(&state, &name, &uri, &headers).await {
            Ok(Some(owner)) => return Ok(ws.on_upgrade(move |client| crate::forward::websocket::relay(client, owner))),
            Ok(None) => {}
            Err(answer) => return Ok(answer),
        }
    }
    let name = if name == "new" {
        let c = caller.clone();
        blocking(&state, move |rt| {
            let network = crate::schema::network_layers(&c, &None)?;
            let key_secrets = c.key_secrets();
            let new = NewSession { network: &network, key_secrets: &key_secrets, ..NewSession::default() };
            Ok(rt.create_session(&c.tenant, new, &c.quota())?.record.id)
        })
        .await?
    } else {
        name
    };
    Ok(ws.on_upgrade(move |socket| repl_session(socket, state, caller, name)))
}

async fn send(socket: &mut WebSocket, v: serde_json::Value) -> bool {
    socket.send(Message::Text(v.to_string().into())).await.is_ok()
}

async fn repl_session(mut socket: WebSocket, state: AppState, caller: Caller, name: String) {
    if !send(&mut socket, json!({ "type": "connected", "machine_name": name })).await {
        return;
    }
    let machine = state.machines.get(&name);
    while let Some(Ok(msg)) = socket.recv().await {
        let text = match msg {
            Message::Text(t) => t,
            Message::Close(_) => break,
            _ => continue,
        };
        let (instruction, request_id) = match serde_json::from_str::<ClientMessage>(&text) {
            Ok(ClientMessage::Exec { instruction, request_id }) => (instruction, request_id),
            Err(e) => {
                if !send(&mut socket, error_message(ErrorCode::InvalidRequest, &format!("bad message: {e}"))).await {
                    break;
                }
                continue;
            }
        };
        if let Err(e) = repl_checks(&state, &caller, &instruction).await {
            if !send(&mut socket, error_message(e.code, &e.message)).await {
                break;
            }
            continue;
        }
        let seq = match machine.enqueue() {
            Ok(seq) => seq,
            Err(e) => {
                if !send(&mut socket, error_message(e.code, &e.message)).await {
                    break;
                }
                continue;
            }
        };
        if !send(&mut socket, json!({ "type": "exec_received", "request_id": request_id, "seq": seq })).await {
            break;
        }
        // The instruction completes (and is recorded) even if the socket goes away meanwhile.
        let (tx, mut rx) = mpsc::channel(256);
        let (st, m, c, n) = (state.clone(), machine.clone(), caller.clone(), name.clone());
        let task = tokio::spawn(run_instruction(st, m, c, n, seq, instruction.code, Some(tx)));
        // Output until the exec ends (that drops the sender).
        let mut open = true;
        while let Some(ev) = rx.recv().await {
            if let (true, Streamed::Output(stream, data)) = (open, ev) {
                let chunk =
                    json!({ "type": "output", "instruction_id": seq, "chunk": { "stream": stream, "data": data } });
                open = send(&mut socket, chunk).await;
            }
        }
        if !open {
            break;
        }
        let result = match task.await {
            Ok(r) => r,
            Err(e) => FvmResult::Error { error: format!("internal: {e}"), runtime_ms: 0 },
        };
        if !send(&mut socket, json!({ "type": "result", "instruction_id": seq, "result": result })).await {
            break;
        }
    }
}

fn error_message(code: ErrorCode, message: &str) -> serde_json::Value {
    json!({ "type": "error", "code": code, "message": message })
}

/// What the HTTP routes check per request, for one WebSocket message: rate limit, code, disk quota.
async fn repl_checks(state: &AppState, caller: &Caller, i: &Instruction) -> Result<(), ApiError> {
    caller.check_rate()?;
    check_instruction(&state.runtime, caller, i)?;
    let c = caller.clone();
    blocking(state, move |rt| Ok(rt.check_disk(&c.tenant, &c.quota())?)).await
}
