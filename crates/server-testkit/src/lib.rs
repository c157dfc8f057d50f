//! The harness of forkbox-server's tests (a dev-dependency of the server only):
//! a real server on a loopback port, written once.
//!
//! Place in the flow: beside the server, above [`forkbox_testkit`] (the shared
//! image, engine and template; KVM or a loud failure). Two ways in:
//!
//! - [`TestServer`]: the router over a state opened in this process (axum on
//!   `127.0.0.1:0`), a private data directory, one key of its own (an
//!   unlimited admin key unless told otherwise), the secrets sealing key
//!   installed as `forkbox serve` installs it, and an HTTP client
//!   ([`TestServer::call`] and its shorthands). [`TestServer::options`] changes
//!   the data directory, the config, the key and how the runtime is opened.
//! - [`Node`]: `Server::bind` + `Server::run`, as `forkbox serve` runs it, for
//!   the tests that start and stop whole nodes (restarts, PostgreSQL, clusters).
//!
//! Both execute on this process' threads ([`config`] sets
//! `Isolation::Thread`): the jailed workers have tests of their own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use forkbox_runtime::Runtime;
use forkbox_server::{AppState, Inner, KeyLimits, Server, ServerConfig};
use reqwest::StatusCode;
use serde_json::{json, Value};

pub use forkbox_testkit;

/// A server config for a test: listening on a loopback port, data in `home`,
/// executions on this process' threads.
pub fn config(home: &Path) -> ServerConfig {
    let mut cfg = ServerConfig::new(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), home.to_path_buf());
    // Execs on this test process' threads (the jailed workers have tests of their own).
    cfg.runtime.isolation = forkbox_runtime::Isolation::Thread;
    cfg
}

/// A server state over `cfg` (the shared engine and template), not served:
/// for the tests that call the router in process. Installs nothing.
pub async fn state(cfg: ServerConfig) -> AppState {
    tokio::task::spawn_blocking(move || {
        Inner::with_runtime(forkbox_testkit::runtime(&cfg.home, cfg.runtime.clone()), cfg).expect("server state")
    })
    .await
    .expect("opening the server state")
}

/// Assert an error response: `status` and `{"error": {"code", "message"}}` with a message.
#[track_caller]
pub fn assert_error(got: &(StatusCode, Value), status: StatusCode, code: &str) {
    assert_eq!(got.0, status, "expected {status} {code}, got {} {}", got.0, got.1);
    assert_eq!(got.1["error"]["code"], code, "{}", got.1);
    assert!(got.1["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", got.1);
}

/// One request to the server at `url`: (status, JSON body; a non-JSON body as a string, none as null).
async fn request(
    http: &reqwest::Client,
    url: &str,
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = http.request(method, format!("{url}{path}"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status();
    let text = resp.text().await.expect("the body");
    (status, if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) })
}

/// The key a [`TestServer`] makes for itself.
#[derive(Clone, Debug)]
pub enum Key {
    /// An admin key without limits (reads `/metrics` and the admin routes).
    Admin,
    /// A key (not admin) with these limits.
    Limits(KeyLimits),
    /// A key with the documented defaults for new keys (as `forkbox key create`).
    Defaults,
}

/// Where a [`TestServer`]'s data directory comes from.
enum Home {
    /// [`forkbox_testkit::fresh_home`] with this prefix (templates shared).
    Fresh(&'static str),
    /// A directory the test made, owned by the server from now on.
    Owned(tempfile::TempDir),
    /// A directory the test keeps (a restart on it, say).
    At(PathBuf),
}

impl Home {
    fn path(&self) -> &Path {
        match self {
            Home::Fresh(_) => unreachable!("a fresh home is made before it is used"),
            Home::Owned(d) => d.path(),
            Home::At(p) => p,
        }
    }
}

type Tweak<'a> = Box<dyn FnOnce(&mut ServerConfig) + 'a>;
type OpenRuntime = Box<dyn FnOnce(&ServerConfig) -> Arc<Runtime> + Send>;

/// How [`TestServer::start`] starts a server; from [`TestServer::options`].
pub struct Options<'a> {
    home: Home,
    tweaks: Vec<Tweak<'a>>,
    tenant: String,
    key: Key,
    runtime: Option<OpenRuntime>,
    maintenance: bool,
}

impl<'a> Options<'a> {
    /// A fresh data directory named with `prefix` (templates shared with the test binary's home).
    pub fn prefix(mut self, prefix: &'static str) -> Options<'a> {
        self.home = Home::Fresh(prefix);
        self
    }

    /// This directory as the data directory (removed with the server).
    pub fn home(mut self, home: tempfile::TempDir) -> Options<'a> {
        self.home = Home::Owned(home);
        self
    }

    /// This directory as the data directory; the test keeps it.
    pub fn at(mut self, home: &Path) -> Options<'a> {
        self.home = Home::At(home.to_path_buf());
        self
    }

    /// Adjust the config (after [`config`]'s settings; in call order).
    pub fn config(mut self, tweak: impl FnOnce(&mut ServerConfig) + 'a) -> Options<'a> {
        self.tweaks.push(Box::new(tweak));
        self
    }

    /// The server's own key: of `tenant`, of this kind (default: `alice`, [`Key::Admin`]).
    pub fn key(mut self, tenant: &str, key: Key) -> Options<'a> {
        self.tenant = tenant.to_string();
        self.key = key;
        self
    }

    /// Open the runtime with `open` (blocking; default: [`forkbox_testkit::runtime`],
    /// the shared engine and template).
    pub fn runtime(mut self, open: impl FnOnce(&ServerConfig) -> Arc<Runtime> + Send + 'static) -> Options<'a> {
        self.runtime = Some(Box::new(open));
        self
    }

    /// Run the runtime's maintenance loop (idle eviction, collection), as `serve` does.
    pub fn maintenance(mut self) -> Options<'a> {
        self.maintenance = true;
        self
    }

    /// Open the state, make the key, serve on a loopback port.
    pub async fn start(self) -> TestServer {
        let Options { home, tweaks, tenant, key, runtime, maintenance } = self;
        let home = match home {
            Home::Fresh(prefix) => Home::Owned(forkbox_testkit::fresh_home(prefix)),
            other => other,
        };
        let mut cfg = config(home.path());
        for tweak in tweaks {
            tweak(&mut cfg);
        }
        let h = home.path().to_path_buf();
        let (state, key) = tokio::task::spawn_blocking(move || {
            let rt = match runtime {
                Some(open) => open(&cfg),
                None => forkbox_testkit::runtime(&cfg.home, cfg.runtime.clone()),
            };
            let state = Inner::with_runtime(rt, cfg).expect("server state");
            if maintenance {
                state.runtime.start_maintenance(|_| {});
            }
            // The sealing key `forkbox serve` installs (one per process: the first stays).
            forkbox_server::seal_secrets_json(&h, "{}").expect("the secrets sealing key");
            let key = match key {
                Key::Admin => forkbox_server::create_key_full(&h, &tenant, &KeyLimits::unlimited(), true),
                Key::Limits(limits) => forkbox_server::create_key_with(&h, &tenant, &limits),
                Key::Defaults => forkbox_server::create_key(&h, &tenant),
            }
            .expect("the server's key");
            (state, key)
        })
        .await
        .expect("opening the server state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let addr = listener.local_addr().expect("the bound address");
        let app = forkbox_server::router(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serving");
        });
        TestServer { url: format!("http://{addr}"), key, http: reqwest::Client::new(), state, task, home }
    }
}

/// A server on a loopback port for one test; see the crate's doc.
pub struct TestServer {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The server's own key (see [`Options::key`]).
    pub key: String,
    pub http: reqwest::Client,
    pub state: AppState,
    task: tokio::task::JoinHandle<()>,
    home: Home,
}

impl TestServer {
    /// A server with the defaults: a fresh data directory, an unlimited admin key of `alice`.
    pub async fn start() -> TestServer {
        TestServer::options().start().await
    }

    /// [`TestServer::start`] on a config that `tweak` adjusts.
    pub async fn start_with(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        TestServer::options().config(tweak).start().await
    }

    /// The defaults, to change before [`Options::start`].
    pub fn options<'a>() -> Options<'a> {
        Options {
            home: Home::Fresh("forkbox-server-test-"),
            tweaks: Vec::new(),
            tenant: "alice".into(),
            key: Key::Admin,
            runtime: None,
            maintenance: false,
        }
    }

    /// The data directory.
    pub fn home(&self) -> &Path {
        self.home.path()
    }

    /// Stop serving and let go of the state (a restart on the same data directory follows).
    pub fn stop(self) {
        self.task.abort();
    }

    /// A new key of `tenant` with `limits`.
    pub fn key_with(&self, tenant: &str, limits: &KeyLimits) -> String {
        forkbox_server::create_key_with(self.home(), tenant, limits).expect("create key")
    }

    /// A new key of `tenant` without limits.
    pub fn new_key(&self, tenant: &str) -> String {
        self.key_with(tenant, &KeyLimits::unlimited())
    }

    /// A new key with the documented defaults for new keys.
    pub fn default_key(&self, tenant: &str) -> String {
        forkbox_server::create_key(self.home(), tenant).expect("create key")
    }

    /// A request: (status, JSON body; a non-JSON body as a string, none as null).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        request(&self.http, &self.url, method, path, key, body).await
    }

    /// POST with the server's key.
    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(&self.key), Some(body)).await
    }

    /// GET with the server's key.
    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, Some(&self.key), None).await
    }

    /// DELETE with the server's key.
    pub async fn delete(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::DELETE, path, Some(&self.key), None).await
    }

    /// POST with another key.
    pub async fn post_as(&self, key: &str, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(key), Some(body)).await
    }

    /// GET with another key.
    pub async fn get_as(&self, key: &str, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, Some(key), None).await
    }

    /// A raw body as JSON (malformed JSON, oversized payloads); a body that is not JSON reads as null.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (StatusCode, Value) {
        let resp = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(&self.key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// A new session (`body` as given); its id. Must be 201.
    pub async fn create_session(&self, body: Value) -> String {
        let (st, v) = self.post("/v1/sessions", body).await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        v["id"].as_str().expect("the session's id").to_string()
    }

    /// A session exec: (status, body).
    pub async fn exec(&self, id: &str, code: &str) -> (StatusCode, Value) {
        self.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": code })).await
    }

    /// A session exec that must answer 200 (a Python error is fine); its result.
    pub async fn sexec(&self, id: &str, code: &str) -> Value {
        let (st, v) = self.exec(id, code).await;
        assert_eq!(st, StatusCode::OK, "exec {code:?}: {v}");
        v
    }

    /// A session exec that must answer 200 without a Python error; its result.
    pub async fn exec_ok(&self, id: &str, code: &str) -> Value {
        let v = self.sexec(id, code).await;
        assert!(v["error"].is_null(), "{code}\n-> {v}");
        v
    }
}

/// A running server as `forkbox serve` runs it (`Server::bind`, then
/// `Server::run` until [`Node::stop_within`]).
pub struct Node {
    pub url: String,
    pub key: String,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<anyhow::Result<()>>,
    http: reqwest::Client,
}

impl Node {
    /// `key`: one the node knows already (from its database), else the one the server made.
    pub async fn start(cfg: ServerConfig, key: Option<String>) -> Node {
        let server = Server::bind(cfg).await.expect("bind");
        let key = key.or(server.created_key.clone()).expect("a key");
        let addr = server.local_addr().expect("the bound address");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Node { url: format!("http://{addr}"), key, stop, run, http: reqwest::Client::new() }
    }

    /// A graceful stop, which must end within `limit`.
    pub async fn stop_within(self, limit: Duration) {
        self.stop.send(()).expect("the server is running");
        tokio::time::timeout(limit, self.run).await.expect("shutdown in time").expect("join").expect("run");
    }

    /// A request with the node's key: (status, JSON body; a non-JSON body as a string, none as null).
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        request(&self.http, &self.url, method, path, Some(&self.key), body).await
    }
}
