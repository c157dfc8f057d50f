//! How a CLI command reaches the API: a running server (`--url`, key from
//! `--api-key` / `$FORKBOX_API_KEY`), or the engine in this process on the local
//! data directory (`forkbox_server::embedded_router`, no socket, no key). Both
//! are a `forkbox_client::Client`, so the two modes behave and fail the same way.

use std::path::Path;

use anyhow::{Context, Result};
use forkbox_client::{Client, ClientError, ExecResult, StreamEvent, Transport};
use futures_util::StreamExt;

use crate::ImageArgs;

/// The tenant of the embedded mode (the sessions `forkbox session` makes on the local data directory).
pub const LOCAL_TENANT: &str = crate::session::LOCAL_TENANT;

pub struct Api {
    pub client: Client,
    /// Where the API is, for people: the URL, or "embedded (<data dir>)".
    pub target: String,
    /// Embedded: the state behind the router (for the upkeep a server's maintenance loop would do).
    state: Option<forkbox_server::AppState>,
    rt: tokio::runtime::Runtime,
}

impl Api {
    /// A server at `url`.
    pub fn remote(url: &str, key: Option<String>) -> Result<Api> {
        let base_url = url.trim_end_matches('/').to_string();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            anyhow::bail!("--url must be an http:// or https:// URL, got {url:?}");
        }
        let rt = runtime()?;
        let client = Client::new(Transport::Http { base_url: base_url.clone(), key });
        Ok(Api { client, target: base_url, state: None, rt })
    }

    /// The API over the engine, template and sessions of the data directory `home`.
    pub fn embedded(home: &Path, image: &ImageArgs) -> Result<Api> {
        let (image_path, _) = crate::run::ensure_image(home, image, std::io::IsTerminal::is_terminal(&std::io::stderr()))?;
        let (engine, template) = forkbox_server::open_engine(home, Some(&image_path))?;
        let mut config = forkbox_server::ServerConfig::new(([127, 0, 0, 1], 0).into(), home.to_path_buf());
        // The CLI's own bounds (it checks them itself), not a public server's.
        config.max_timeout = std::time::Duration::from_secs(86_400);
        config.max_memory_mb = 3072;
        config.body_limit = 8 << 20;
        let state = forkbox_server::Inner::new(engine, template, config).context("opening the local data directory")?;
        let rt = runtime()?;
        let router = {
            let _guard = rt.enter();
            forkbox_server::embedded_router(state.clone(), LOCAL_TENANT)
        };
        let client = Client::new(Transport::InProcess(router));
        Ok(Api { client, target: format!("embedded ({})", home.display()), state: Some(state), rt })
    }

    /// Fork `id` at `checkpoint` (its head if None) into a new session with `tags`; its id.
    pub fn fork(&self, id: &str, checkpoint: Option<i64>, tags: std::collections::BTreeMap<String, String>) -> Result<String> {
        Ok(self.block_on(self.client.fork_tagged(id, checkpoint, &tags))?.id)
    }

    /// After an exec in `session`, embedded: merge its layer chain once it is long
    /// (what `forkbox session exec` does, and a server's maintenance loop).
    pub fn after_exec(&self, session: &str) {
        let Some(state) = &self.state else { return };
        let head = state.sessions.get(LOCAL_TENANT, session).ok().and_then(|r| r.head);
        if let Some(Err(e)) = head.map(|h| state.sessions.compact(h)) {
            tracing::warn!("compacting the layers of {session}: {e}");
        }
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the async runtime")
}

/// Where an exec runs.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    OneShot { timeout_seconds: Option<f64> },
    Session(&'a str),
}

/// Run `code`, calling `on_output` with each stdout/stderr chunk as it is produced
/// (the streaming route; a server without it gets the plain exec, output at the end).
/// `Err` is the API's error (timeout, crash, unknown session...).
pub async fn exec_streaming(
    client: &Client,
    target: Target<'_>,
    code: &str,
    on_output: &mut (dyn FnMut(&StreamEvent) + Send),
) -> Result<ExecResult, ClientError> {
    let opened = match target {
        Target::OneShot { timeout_seconds } => client.exec_stream(code, timeout_seconds).await.map(|s| s.boxed()),
        Target::Session(id) => client.session_exec_stream(id, code).await.map(|s| s.boxed()),
    };
    let mut stream = match opened {
        Ok(s) => s,
        // An older server: no streaming route (the route-level 404, not `session_not_found`).
        Err(ClientError::Api { code: c, .. }) if c == "not_found" => {
            let r = match target {
                Target::OneShot { timeout_seconds } => client.exec(code, timeout_seconds).await?,
                Target::Session(id) => client.session_exec(id, code).await?,
            };
            for ev in [StreamEvent::Stdout(r.stdout.clone()), StreamEvent::Stderr(r.stderr.clone())] {
                on_output(&ev);
            }
            return Ok(r);
        }
        Err(e) => return Err(e),
    };
    while let Some(ev) = stream.next().await {
        match ev? {
            StreamEvent::Result(v) => {
                return serde_json::from_value(v).map_err(|e| ClientError::UnexpectedResponse {
                    status: 200,
                    message: format!("the stream's result is not an exec result: {e}"),
                })
            }
            StreamEvent::Error { code, message } => {
                return Err(ClientError::Api { status: status_of(&code), code, message });
            }
            ev => on_output(&ev),
        }
    }
    Err(ClientError::StreamEnded)
}

/// The status the API gives an error code (an `error` event arrives on a 200 stream without one).
fn status_of(code: &str) -> u16 {
    match code {
        "invalid_request" | "malformed_json" | "invalid_path" => 400,
        "quota_exceeded" => 403,
        "session_not_found" | "checkpoint_not_found" | "file_not_found" => 404,
        "timeout" => 408,
        "session_busy" => 409,
        "payload_too_large" | "code_too_large" | "file_too_large" => 413,
        "guest_crashed" | "guest_exited" | "guest_killed" | "sandbox_unusable" | "interrupted" => 422,
        "rate_limited" => 429,
        "overloaded" => 503,
        _ => 500,
    }
}
