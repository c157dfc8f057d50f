//! `forkbox-client`: a typed async client of the forkbox HTTP API.
//!
//! ```no_run
//! # async fn demo() -> Result<(), forkbox_client::ClientError> {
//! use forkbox_client::{Client, CreateSession, Transport};
//! let client = Client::new(Transport::Http { base_url: "http://127.0.0.1:8080".into(), key: Some("fbk_...".into()) });
//! let s = client.create_session(&CreateSession::default()).await?;
//! client.session_exec(&s.id, "x = 41").await?;
//! let r = client.session_exec(&s.id, "x + 1").await?;
//! assert_eq!(r.value.as_deref(), Some("42"));
//! # Ok(()) }
//! ```
//!
//! Over [`Transport::InProcess`] the same calls are served by an axum router in
//! this process (`forkbox_server::embedded_router`), without a socket, so an
//! embedded engine and a remote server behave — and fail — the same way.
//! API errors come back unchanged as [`ClientError::Api`]`{status, code, message, output}`
//! (`output`: what a failed exec wrote before, see [`ClientError::output`]);
//! [`ClientError::api_code`] reads the code as a [`ErrorCode`] (the API's one table).
//!
//! Place in the flow: a front end's way to the **request** layer (the server's
//! routes, over HTTP or in process); it depends on no other forkbox layer
//! (only `forkbox-api`, the shared error codes).

#![forbid(unsafe_code)]

pub mod error;
mod sse;
pub mod transport;
pub mod tree;
pub mod types;

use std::collections::BTreeMap;

use axum::http::Method;
use futures_util::Stream;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

pub use error::{ClientError, ErrorCode};
pub use forkbox_api::capabilities::Capabilities;
pub use sse::StreamEvent;
pub use transport::Transport;
pub use types::*;

use transport::{Payload, RawResponse, Sender};

/// Characters left as they are in a path segment (everything else is percent-encoded).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// A client of one forkbox API. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    sender: std::sync::Arc<Sender>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("transport", &self.sender.transport).finish()
    }
}

impl Client {
    pub fn new(transport: Transport) -> Client {
        Client { sender: std::sync::Arc::new(Sender { transport, key: None, http: reqwest::Client::new() }) }
    }

    /// The same API with another bearer key (e.g. the key of the request an MCP
    /// server is answering, over the API's own router in process).
    pub fn with_key(&self, key: impl Into<String>) -> Client {
        let s = &self.sender;
        Client {
            sender: std::sync::Arc::new(Sender {
                transport: s.transport.clone(),
                key: Some(key.into()),
                http: s.http.clone(),
            }),
        }
    }

    pub fn transport(&self) -> &Transport {
        &self.sender.transport
    }

    // -- one-shot ----------------------------------------------------------

    /// Run `code` in a fresh sandbox (nothing persists). `timeout_seconds`: the server's default if None.
    pub async fn exec(&self, code: &str, timeout_seconds: Option<f64>) -> Result<ExecResult, ClientError> {
        self.exec_on(code, timeout_seconds, None).await
    }

    /// [`exec`](Self::exec) on a named template (None: the server's default).
    pub async fn exec_on(
        &self,
        code: &str,
        timeout_seconds: Option<f64>,
        template: Option<&str>,
    ) -> Result<ExecResult, ClientError> {
        let opts = ExecOptions { timeout_seconds, template: template.map(str::to_string), network: None };
        self.exec_with(code, &opts).await
    }

    /// [`exec`](Self::exec) with every option (time limit, template, network).
    pub async fn exec_with(&self, code: &str, opts: &ExecOptions) -> Result<ExecResult, ClientError> {
        self.post("/v1/exec", &opts.request(code)).await
    }

    /// The nodes of the cluster the server belongs to (admin keys only).
    pub async fn nodes(&self) -> Result<NodeList, ClientError> {
        self.get("/v1/admin/nodes").await
    }

    /// Drain node `id` (it gives its sessions back, takes no new ones) or make it active again (admin keys only).
    pub async fn set_draining(&self, id: &str, drain: bool) -> Result<NodeList, ClientError> {
        let action = if drain { "drain" } else { "activate" };
        self.post(&format!("/v1/admin/nodes/{}/{action}", seg(id)), &json!({})).await
    }

    /// What this key may do on the server: its templates (with their packages), run-time
    /// installs, its egress policy, its limits.
    pub async fn capabilities(&self) -> Result<Capabilities, ClientError> {
        self.get("/v1/capabilities").await
    }

    /// The server's templates and their state.
    pub async fn templates(&self) -> Result<TemplateList, ClientError> {
        self.get("/v1/templates").await
    }

    /// One template and its state (`building` with its step, `ready`, `failed` with why).
    pub async fn template(&self, name: &str) -> Result<TemplateInfo, ClientError> {
        self.get(&format!("/v1/templates/{}", seg(name))).await
    }

    /// Start building a template of the caller's own (poll [`template`](Self::template)).
    pub async fn create_template(&self, req: &CreateTemplate) -> Result<TemplateInfo, ClientError> {
        self.post("/v1/templates", req).await
    }

    /// A template of the caller's own made of checkpoint `checkpoint` of session `id`.
    pub async fn checkpoint_template(
        &self,
        id: &str,
        checkpoint: i64,
        name: &str,
    ) -> Result<TemplateInfo, ClientError> {
        self.post(
            &format!("/v1/sessions/{}/checkpoints/{checkpoint}/template", seg(id)),
            &CheckpointTemplateRequest { name: name.to_string() },
        )
        .await
    }

    /// Run each code in its own fresh sandbox, in parallel; results in order.
    pub async fn exec_batch(&self, codes: &[String], timeout_seconds: Option<f64>) -> Result<BatchResult, ClientError> {
        let body = BatchRequest { codes: codes.to_vec(), timeout_seconds, template: None };
        self.post("/v1/exec/batch", &body).await
    }

    /// [`exec`](Self::exec), streaming the output as it is written.
    pub async fn exec_stream(
        &self,
        code: &str,
        timeout_seconds: Option<f64>,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.exec_stream_on(code, timeout_seconds, None).await
    }

    /// [`exec_stream`](Self::exec_stream) on a named template (None: the server's default).
    pub async fn exec_stream_on(
        &self,
        code: &str,
        timeout_seconds: Option<f64>,
        template: Option<&str>,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        let opts = ExecOptions { timeout_seconds, template: template.map(str::to_string), network: None };
        self.exec_stream_with(code, &opts).await
    }

    /// [`exec_stream`](Self::exec_stream) with every option (time limit, template, network).
    pub async fn exec_stream_with(
        &self,
        code: &str,
        opts: &ExecOptions,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.stream("/v1/exec/stream", &to_value(&opts.request(code))?).await
    }

    // -- sessions ----------------------------------------------------------

    pub async fn create_session(&self, opts: &CreateSession) -> Result<Session, ClientError> {
        self.post("/v1/sessions", opts).await
    }

    pub async fn get_session(&self, id: &str) -> Result<Session, ClientError> {
        self.get(&format!("/v1/sessions/{}", seg(id))).await
    }

    /// The sessions of this key's tenant, optionally only those with all the given tags.
    pub async fn list_sessions(&self, tags: &[(String, String)]) -> Result<Vec<Session>, ClientError> {
        let q: Vec<(&str, String)> = tags.iter().map(|(k, v)| ("tag", format!("{k}:{v}"))).collect();
        let q = serde_urlencoded::to_string(&q).map_err(|e| ClientError::InvalidArgument(format!("tags: {e}")))?;
        let path = if q.is_empty() { "/v1/sessions".to_string() } else { format!("/v1/sessions?{q}") };
        let v: Value = self.get(&path).await?;
        field(v, "sessions")
    }

    pub async fn delete_session(&self, id: &str) -> Result<(), ClientError> {
        let r = self.sender.send(Method::DELETE, &format!("/v1/sessions/{}", seg(id)), Payload::None).await?;
        check(r).await.map(drop)
    }

    /// Change a session's tags (replaced as a whole) and/or limits; the session as it is now.
    pub async fn patch_session(&self, id: &str, patch: &PatchSession) -> Result<Session, ClientError> {
        let body = serde_json::to_vec(patch)
            .map_err(|e| ClientError::InvalidArgument(format!("encoding the request: {e}")))?;
        json_of(self.sender.send(Method::PATCH, &format!("/v1/sessions/{}", seg(id)), Payload::Json(body)).await?).await
    }

    /// Run `code` in the session (its variables, imports and files persist); the result names the new checkpoint.
    pub async fn session_exec(&self, id: &str, code: &str) -> Result<ExecResult, ClientError> {
        self.session_exec_with(id, code, None).await
    }

    /// [`session_exec`](Self::session_exec) with this exec's time limit (at most the session's; None: the session's).
    pub async fn session_exec_with(
        &self,
        id: &str,
        code: &str,
        timeout_seconds: Option<f64>,
    ) -> Result<ExecResult, ClientError> {
        self.post(&format!("/v1/sessions/{}/exec", seg(id)), &SessionExec { code: code.to_string(), timeout_seconds })
            .await
    }

    /// [`session_exec`](Self::session_exec), streaming the output as it is written.
    pub async fn session_exec_stream(
        &self,
        id: &str,
        code: &str,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.session_exec_stream_with(id, code, None).await
    }

    /// [`session_exec_stream`](Self::session_exec_stream) with this exec's time limit.
    pub async fn session_exec_stream_with(
        &self,
        id: &str,
        code: &str,
        timeout_seconds: Option<f64>,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.stream(
            &format!("/v1/sessions/{}/exec/stream", seg(id)),
            &to_value(&SessionExec { code: code.to_string(), timeout_seconds })?,
        )
        .await
    }

    /// Interrupt the session's running exec (KeyboardInterrupt in the code); false if none was running.
    pub async fn interrupt(&self, id: &str) -> Result<bool, ClientError> {
        let v: Value = self.post(&format!("/v1/sessions/{}/interrupt", seg(id)), &json!({})).await?;
        field(v, "interrupted")
    }

    /// A signed URL of port `port` of session `id` (the server's port proxy),
    /// valid `expires_in` seconds (the server's default: 1 h): `{url, host_url, token, expires_at}`.
    pub async fn port_url(&self, id: &str, port: u16, expires_in: Option<u64>) -> Result<Value, ClientError> {
        let body = match expires_in {
            Some(s) => json!({ "expires_in": s }),
            None => json!({}),
        };
        self.post(&format!("/v1/sessions/{}/ports/{port}/url", seg(id)), &body).await
    }

    /// What listens inside session `id`'s sandbox: `{ports: [{port, address, proxied}], resident}`.
    pub async fn listening_ports(&self, id: &str) -> Result<Value, ClientError> {
        self.get(&format!("/v1/sessions/{}/ports", seg(id))).await
    }

    pub async fn checkpoints(&self, id: &str) -> Result<Vec<Checkpoint>, ClientError> {
        let v: Value = self.get(&format!("/v1/sessions/{}/checkpoints", seg(id))).await?;
        field(v, "checkpoints")
    }

    /// Move the session back to `checkpoint` (its state is exactly as right after that exec).
    pub async fn revert(&self, id: &str, checkpoint: i64) -> Result<Session, ClientError> {
        self.post(&format!("/v1/sessions/{}/revert", seg(id)), &RevertRequest { checkpoint }).await
    }

    /// Install packages into session `id` (`pip install`, served by the server:
    /// binary wheels from its index or wheelhouse, under its allow/deny list).
    pub async fn install_packages(&self, id: &str, packages: &[String]) -> Result<Packages, ClientError> {
        self.post(&format!("/v1/sessions/{}/packages", seg(id)), &InstallPackages { packages: packages.to_vec() }).await
    }

    /// A new session starting at `checkpoint` of `id` (its head if None); `id` is not touched.
    pub async fn fork(&self, id: &str, checkpoint: Option<i64>) -> Result<Session, ClientError> {
        self.fork_tagged(id, checkpoint, &BTreeMap::new()).await
    }

    /// `fork`, with tags for the new session.
    pub async fn fork_tagged(
        &self,
        id: &str,
        checkpoint: Option<i64>,
        tags: &BTreeMap<String, String>,
    ) -> Result<Session, ClientError> {
        self.post(&format!("/v1/sessions/{}/fork", seg(id)), &ForkRequest { checkpoint, tags: tags.clone() }).await
    }

    // -- commands ----------------------------------------------------------

    /// Run a command in a fresh sandbox (nothing persists); `req.template` picks the template.
    pub async fn command(&self, req: &CommandRequest) -> Result<CommandResult, ClientError> {
        self.post("/v1/commands", &req.one_shot()).await
    }

    /// [`command`](Self::command), streaming the output as it is written (the `result` event is a [`CommandResult`]).
    pub async fn command_stream(
        &self,
        req: &CommandRequest,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.stream("/v1/commands/stream", &to_value(&req.one_shot())?).await
    }

    /// Run a command in the session's file system; the result names the new checkpoint.
    pub async fn session_command(&self, id: &str, req: &CommandRequest) -> Result<CommandResult, ClientError> {
        self.post(&format!("/v1/sessions/{}/commands", seg(id)), &session_command_body(req, false, false)?).await
    }

    /// [`session_command`](Self::session_command), streaming the output as it is written.
    pub async fn session_command_stream(
        &self,
        id: &str,
        req: &CommandRequest,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        self.stream(
            &format!("/v1/sessions/{}/commands/stream", seg(id)),
            &to_value(&session_command_body(req, false, false)?)?,
        )
        .await
    }

    /// Start a command as a background process of the session (it runs on between calls; with
    /// `stdin` its stdin is what [`write_stdin`](Self::write_stdin) sends). `Err(result)`: it could
    /// not start (not found, bad cwd), with its exit status.
    pub async fn start_session_command(
        &self,
        id: &str,
        req: &CommandRequest,
        stdin: bool,
    ) -> Result<Result<ProcessInfo, CommandResult>, ClientError> {
        let body = session_command_body(req, true, stdin)?;
        let v: Value = self.post(&format!("/v1/sessions/{}/commands", seg(id)), &body).await?;
        if v.get("process").is_some() {
            Ok(Ok(field(v, "process")?))
        } else {
            Ok(Err(serde_json::from_value(v).map_err(|e| ClientError::UnexpectedResponse {
                status: 200,
                message: format!("neither a process nor a command result: {e}"),
            })?))
        }
    }

    /// The session's background processes, oldest first.
    pub async fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ClientError> {
        let v: Value = self.get(&format!("/v1/sessions/{}/processes", seg(id))).await?;
        field(v, "processes")
    }

    /// At most `max` bytes (None: the server's maximum) of a background process' `stderr` or stdout from `offset`.
    pub async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stderr: bool,
        offset: u64,
        max: Option<usize>,
    ) -> Result<ProcessOutput, ClientError> {
        let stream = if stderr { "stderr" } else { "stdout" };
        let mut q = format!("stream={stream}&offset={offset}");
        if let Some(m) = max {
            q.push_str(&format!("&max={m}"));
        }
        self.get(&format!("/v1/sessions/{}/processes/{pid}/output?{q}", seg(id))).await
    }

    /// A background process' output as it is written (`Stdout`/`Stderr` events; `stream`: one
    /// stream only, from `offset`), ending with `Result` (its process info) when it ends.
    pub async fn follow_process(
        &self,
        id: &str,
        pid: u32,
        stream: Option<&str>,
        offset: u64,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        let mut q = format!("follow=true&offset={offset}");
        if let Some(s) = stream {
            q.push_str(&format!("&stream={s}"));
        }
        let r = self
            .sender
            .send(Method::GET, &format!("/v1/sessions/{}/processes/{pid}/output?{q}", seg(id)), Payload::None)
            .await?;
        event_stream(r).await
    }

    /// Send signal `signal` (1-64) to a background process and the processes it started.
    pub async fn signal_process(&self, id: &str, pid: u32, signal: i32) -> Result<ProcessInfo, ClientError> {
        self.post(&format!("/v1/sessions/{}/processes/{pid}/signal", seg(id)), &SignalRequest { signal }).await
    }

    /// Write `data` to a background process' stdin (started with stdin), then close it if `eof`.
    pub async fn write_stdin(&self, id: &str, pid: u32, data: &[u8], eof: bool) -> Result<ProcessInfo, ClientError> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
        self.post(
            &format!("/v1/sessions/{}/processes/{pid}/stdin", seg(id)),
            &StdinRequest { data: None, data_b64: Some(b64), eof },
        )
        .await
    }

    /// Wait at most `timeout_seconds` (at most 60) for a background process to end.
    pub async fn wait_process(&self, id: &str, pid: u32, timeout_seconds: f64) -> Result<ProcessInfo, ClientError> {
        let body = WaitRequest { timeout_seconds: Some(timeout_seconds) };
        self.post(&format!("/v1/sessions/{}/processes/{pid}/wait", seg(id)), &body).await
    }

    // -- files -------------------------------------------------------------

    /// Write `data` to the absolute guest path `path` (parents created); makes a checkpoint.
    pub async fn put_file(&self, id: &str, path: &str, data: Vec<u8>) -> Result<FileWritten, ClientError> {
        let url = format!("/v1/sessions/{}/files/{}", seg(id), guest_path(path)?);
        json_of(self.sender.send(Method::PUT, &url, Payload::Raw(data)).await?).await
    }

    /// The content of the absolute guest path `path`.
    pub async fn get_file(&self, id: &str, path: &str) -> Result<Vec<u8>, ClientError> {
        let url = format!("/v1/sessions/{}/files/{}", seg(id), guest_path(path)?);
        check(self.sender.send(Method::GET, &url, Payload::None).await?).await
    }

    /// The entries of the guest directory `dir`.
    pub async fn list_files(&self, id: &str, dir: &str) -> Result<Vec<FileEntry>, ClientError> {
        let q = serde_urlencoded::to_string([("dir", dir)])
            .map_err(|e| ClientError::InvalidArgument(format!("dir: {e}")))?;
        let v: Value = self.get(&format!("/v1/sessions/{}/files?{q}", seg(id))).await?;
        field(v, "files")
    }

    // -- plumbing ----------------------------------------------------------

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        json_of(self.sender.send(Method::GET, path, Payload::None).await?).await
    }

    async fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Result<T, ClientError> {
        let body =
            serde_json::to_vec(body).map_err(|e| ClientError::InvalidArgument(format!("encoding the request: {e}")))?;
        json_of(self.sender.send(Method::POST, path, Payload::Json(body)).await?).await
    }

    async fn stream(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
        let body =
            serde_json::to_vec(body).map_err(|e| ClientError::InvalidArgument(format!("encoding the request: {e}")))?;
        let r = self.sender.send(Method::POST, path, Payload::Json(body)).await?;
        event_stream(r).await
    }
}

/// The events of a 2xx event-stream response; an API error otherwise.
async fn event_stream(
    r: RawResponse,
) -> Result<impl Stream<Item = Result<StreamEvent, ClientError>> + Send, ClientError> {
    if !(200..300).contains(&r.status) {
        return Err(error_of(r).await);
    }
    if !r.content_type.starts_with("text/event-stream") {
        return Err(ClientError::UnexpectedResponse {
            status: r.status,
            message: format!("expected an event stream, got content type {:?}", r.content_type),
        });
    }
    Ok(sse::events(r.body))
}

fn to_value(v: &impl Serialize) -> Result<Value, ClientError> {
    serde_json::to_value(v).map_err(|e| ClientError::InvalidArgument(format!("encoding the request: {e}")))
}

/// A session command's body: a session has its template and network policy, so `template` and
/// `network` are refused here rather than by the server.
fn session_command_body(req: &CommandRequest, background: bool, stdin: bool) -> Result<SessionCommand, ClientError> {
    if req.template.is_some() {
        return Err(ClientError::InvalidArgument(
            "a session command runs on the session's template: no template".into(),
        ));
    }
    if req.network.is_some() {
        return Err(ClientError::InvalidArgument(
            "a session command runs under the session's network policy: no network".into(),
        ));
    }
    Ok(req.in_session(background, stdin))
}

/// A path segment, percent-encoded.
fn seg(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// An absolute guest path as the URL tail the files routes expect (no leading `/`, each segment encoded).
fn guest_path(path: &str) -> Result<String, ClientError> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(ClientError::InvalidArgument(format!("guest path {path:?} is not absolute")));
    };
    if rest.is_empty() {
        return Err(ClientError::InvalidArgument("guest path \"/\" names no file".into()));
    }
    Ok(rest.split('/').map(seg).collect::<Vec<_>>().join("/"))
}

fn field<T: DeserializeOwned>(mut v: Value, name: &str) -> Result<T, ClientError> {
    let f = v.get_mut(name).map(Value::take).ok_or_else(|| ClientError::UnexpectedResponse {
        status: 200,
        message: format!("response has no `{name}` field"),
    })?;
    serde_json::from_value(f).map_err(|e| ClientError::UnexpectedResponse {
        status: 200,
        message: format!("`{name}` is not what the API returns: {e}"),
    })
}

/// The body of a 2xx response; an API error otherwise.
async fn check(r: RawResponse) -> Result<Vec<u8>, ClientError> {
    if (200..300).contains(&r.status) {
        r.bytes().await
    } else {
        Err(error_of(r).await)
    }
}

async fn json_of<T: DeserializeOwned>(r: RawResponse) -> Result<T, ClientError> {
    let status = r.status;
    let body = check(r).await?;
    serde_json::from_slice(&body).map_err(|e| ClientError::UnexpectedResponse {
        status,
        message: format!("response is not the API's JSON: {e}: {}", preview(&body)),
    })
}

/// The API error of a non-2xx response (`{"error": {code, message}}`), passed through unchanged.
async fn error_of(r: RawResponse) -> ClientError {
    let status = r.status;
    let body = match r.bytes().await {
        Ok(b) => b,
        Err(e) => return e,
    };
    let parsed: Option<ApiErrorBody> = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|mut v| v.get_mut("error").map(Value::take))
        .and_then(|e| serde_json::from_value(e).ok());
    match parsed {
        Some(e) => ClientError::Api { status, output: e.output().map(Box::new), code: e.code, message: e.message },
        None => ClientError::UnexpectedResponse { status, message: preview(&body) },
    }
}

fn preview(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
    if s.is_empty() {
        "(empty body)".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_become_encoded_url_tails() {
        assert_eq!(guest_path("/output/plot.png").ok().as_deref(), Some("output/plot.png"));
        assert_eq!(guest_path("/a b/c?d#e").ok().as_deref(), Some("a%20b/c%3Fd%23e"));
        assert!(matches!(guest_path("relative.txt"), Err(ClientError::InvalidArgument(_))));
        assert!(matches!(guest_path("/"), Err(ClientError::InvalidArgument(_))));
        assert_eq!(seg("../x"), "..%2Fx");
    }
}
