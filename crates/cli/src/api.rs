//! How a CLI command reaches the API: a running server (`--url`, key from
//! `--api-key` / `$FORKBOX_API_KEY`), or the runtime in this process on the local
//! data directory (`forkbox_runtime::Runtime::embedded` behind
//! `forkbox_server::embedded`, no socket, no key). Both are a
//! `forkbox_client::Client`, so the two modes behave and fail the same way.

use std::path::Path;

use anyhow::{Context, Result};
use forkbox_client::{Client, ClientError, ExecResult, StreamEvent, Transport};
use futures_util::StreamExt;

use forkbox_api::handoff::ServerFile;

use crate::{EgressArgs, ImageArgs};

/// The tenant of the embedded mode (the sessions `forkbox session` makes on the local data directory).
pub const LOCAL_TENANT: &str = crate::session::LOCAL_TENANT;

pub struct Api {
    pub client: Client,
    /// Where the API is, for people: the URL, or "embedded (<data dir>)".
    pub target: String,
    /// Embedded: the runtime behind the router (for the upkeep after an exec).
    runtime: Option<std::sync::Arc<forkbox_runtime::Runtime>>,
    rt: tokio::runtime::Runtime,
}

impl Api {
    /// A server at `url`.
    pub fn remote(url: &str, key: Option<String>) -> Result<Api> {
        let base_url = url.trim_end_matches('/').to_string();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            anyhow::bail!("--url must be an http:// or https:// URL, got {url:?}");
        }
        let rt = async_runtime()?;
        let client = Client::new(Transport::Http { base_url: base_url.clone(), key });
        Ok(Api { client, target: base_url, runtime: None, rt })
    }

    /// The API over the engine, template and sessions of the data directory `home`;
    /// or, when `forkbox serve` runs on `home` (its `server.json`), that server,
    /// with the key it made for the CLI's tenant (the same sessions).
    /// `egress`: the operator's policy of the embedded runtime (refused when a server owns `home`).
    pub fn embedded(home: &Path, image: &ImageArgs, egress: &EgressArgs) -> Result<Api> {
        if let Some(f) = running_server(home) {
            if egress.is_set() {
                anyhow::bail!(
                    "{} is served by forkbox (pid {}) at {}: its egress policy is that server's (forkbox serve \
                     --egress-allow ...); --egress flags apply to embedded runs only",
                    home.display(),
                    f.pid,
                    f.url
                );
            }
            return Api::running_server(home, f);
        }
        let mut config = egress.runtime_config()?;
        match &image.template {
            // A named template: the runtime's catalog builds it (with progress) and makes it the default.
            Some(name) => config.template = Some(name.clone()),
            None => config.image = Some(crate::run::ensure_image(home, image, true)?.0),
        }
        let runtime = forkbox_runtime::Runtime::embedded_with(home, config)
            .context("opening the local data directory (if a forkbox server serves it, use --url URL)")?;
        let rt = async_runtime()?;
        let router = {
            let _guard = rt.enter();
            forkbox_server::embedded(runtime.clone(), LOCAL_TENANT)?
        };
        let client = Client::new(Transport::InProcess(router));
        Ok(Api { client, target: format!("embedded ({})", home.display()), runtime: Some(runtime), rt })
    }

    /// The server `file` says runs on `home`, if it answers.
    /// A live server that does not answer is an error at once (no waiting for the directory).
    fn running_server(home: &Path, file: ServerFile) -> Result<Api> {
        let mut api = Api::remote(&file.url, Some(file.key.clone()))?;
        let probe = api.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(5), api.client.list_sessions(&[])).await
        });
        match probe {
            Ok(Ok(_)) => {
                api.target = format!("{} (the server of {})", file.url, home.display());
                Ok(api)
            }
            Ok(Err(e)) => anyhow::bail!(
                "{} is served by forkbox (pid {}) at {}, which refused this CLI ({e}); use --url {} with an API key",
                home.display(),
                file.pid,
                file.url,
                file.url
            ),
            Err(_) => anyhow::bail!(
                "{} is served by forkbox (pid {}) at {}, which does not answer; wait for it, or use --url",
                home.display(),
                file.pid,
                file.url
            ),
        }
    }

    /// Fork `id` at `checkpoint` (its head if None) into a new session with `tags`; its id.
    pub fn fork(
        &self,
        id: &str,
        checkpoint: Option<i64>,
        tags: std::collections::BTreeMap<String, String>,
    ) -> Result<String> {
        Ok(self.block_on(self.client.fork_tagged(id, checkpoint, &tags))?.id)
    }

    /// After an exec in `session`, embedded: merge its layer chain once it is long
    /// (what `forkbox session exec` does, and a server's maintenance loop).
    pub fn after_exec(&self, session: &str) {
        let Some(runtime) = &self.runtime else { return };
        if let Err(e) = runtime.compact_session(LOCAL_TENANT, session) {
            tracing::warn!("compacting the layers of {session}: {e}");
        }
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}

/// The live server whose `server.json` is in `home`, if any (every command without --url
/// hands off to it: `forkbox mcp` too).
pub fn running_server(home: &Path) -> Option<ServerFile> {
    match ServerFile::read(home) {
        Ok(Some(f)) if f.process_alive() => Some(f),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("ignoring {}: {e}", ServerFile::path(home).display());
            None
        }
    }
}

fn async_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Where an exec runs.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    OneShot(&'a forkbox_client::ExecOptions),
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
        Target::OneShot(opts) => client.exec_stream_with(code, opts).await.map(|s| s.boxed()),
        Target::Session(id) => client.session_exec_stream(id, code).await.map(|s| s.boxed()),
    };
    let mut stream = match opened {
        Ok(s) => s,
        // An older server: no streaming route (the route-level 404, not `session_not_found`).
        Err(ClientError::Api { code: c, .. }) if c == "not_found" => {
            let r = match target {
                Target::OneShot(opts) => client.exec_with(code, opts).await?,
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
            StreamEvent::Error { code, message, output } => {
                return Err(ClientError::from_code_with_output(code, message, output));
            }
            ev => on_output(&ev),
        }
    }
    Err(ClientError::StreamEnded)
}
