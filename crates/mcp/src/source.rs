//! Where the tools' API client comes from: ready at once (a server's URL, an open
//! data directory), or being prepared in the background (a first build of the
//! image and template), so that `initialize` never waits for it. A tool call that
//! needs the client waits, with MCP progress notifications when it asked for them.

use std::time::{Duration, Instant};

use forkbox_client::Client;
use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::RequestContext;
use rmcp::RoleServer;
use tokio::sync::watch;

/// How often a waiting tool call reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The state of a client being prepared.
#[derive(Clone)]
pub enum Preparing {
    /// Still working: what it is doing now, for people.
    Step(String),
    Ready(Client),
    Failed(String),
}

/// The sending half: the preparation reports its steps and its outcome here.
pub struct Preparation(watch::Sender<Preparing>);

impl Preparation {
    pub fn step(&self, what: impl Into<String>) {
        self.0.send_replace(Preparing::Step(what.into()));
    }
    pub fn ready(&self, client: Client) {
        self.0.send_replace(Preparing::Ready(client));
    }
    pub fn failed(&self, why: impl Into<String>) {
        self.0.send_replace(Preparing::Failed(why.into()));
    }
}

/// The tools' client: ready, or being prepared.
#[derive(Clone)]
pub enum ClientSource {
    Ready(Client),
    Pending(watch::Receiver<Preparing>),
}

/// A client being prepared: give the [`Preparation`] to the task that makes it.
pub fn pending(first_step: impl Into<String>) -> (Preparation, ClientSource) {
    let (tx, rx) = watch::channel(Preparing::Step(first_step.into()));
    (Preparation(tx), ClientSource::Pending(rx))
}

impl ClientSource {
    /// The client if it is ready now.
    pub fn now(&self) -> Option<Client> {
        match self {
            ClientSource::Ready(c) => Some(c.clone()),
            ClientSource::Pending(rx) => match &*rx.borrow() {
                Preparing::Ready(c) => Some(c.clone()),
                _ => None,
            },
        }
    }

    /// The client, waiting for it if it is being prepared; progress notifications to
    /// the caller of `ctx` while it waits if its request carried a progress token.
    /// `Err`: why it could not be prepared.
    pub async fn wait(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, String> {
        let mut rx = match self {
            ClientSource::Ready(c) => return Ok(c.clone()),
            ClientSource::Pending(rx) => rx.clone(),
        };
        let token: Option<ProgressToken> = ctx.meta.get_progress_token();
        let t0 = Instant::now();
        let mut reported = 0u32;
        loop {
            let step = match &*rx.borrow_and_update() {
                Preparing::Ready(c) => return Ok(c.clone()),
                Preparing::Failed(why) => return Err(why.clone()),
                Preparing::Step(s) => s.clone(),
            };
            if let Some(token) = &token {
                reported += 1;
                let mut p = ProgressNotificationParam::new(token.clone(), f64::from(reported));
                p.message = Some(format!("{step} ({} s)", t0.elapsed().as_secs()));
                if let Err(e) = ctx.peer.notify_progress(p).await {
                    tracing::debug!("progress notification not sent: {e}");
                }
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        // The preparation ended without an outcome (its task panicked).
                        return match &*rx.borrow() {
                            Preparing::Ready(c) => Ok(c.clone()),
                            Preparing::Failed(why) => Err(why.clone()),
                            Preparing::Step(s) => Err(format!("preparing the sandboxes stopped while {s}")),
                        };
                    }
                }
                _ = tokio::time::sleep(PROGRESS_EVERY) => {}
                _ = ctx.ct.cancelled() => return Err("the request was cancelled".into()),
            }
        }
    }
}
