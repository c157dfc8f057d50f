//! envd's directory watchers: `WatchDir` (a server stream: the async and JS
//! SDKs' `watch_dir`) and `CreateWatcher` / `GetWatcherEvents` /
//! `RemoveWatcher` (the sync SDK's polling `WatchHandle`).
//!
//! The events come from the change journal of the sandbox's file system (see
//! `forkbox_linux::vfs` `journal.rs`): every change made by guest code
//! (`run_code`, commands, background processes) or by the file API
//! (`files.write`, `make_dir`, `rename`, `remove`), as envd's `EventType`
//! with the path relative to the watched directory as `name` (as envd's
//! `filepath.Rel`). Each watcher has a task that reads the journal from its
//! own position, a short wait at a time (the session runs its background work
//! meanwhile; while an exec holds the session the changes wait in the journal
//! and come after it). The journal is on while a watcher of the sandbox lives.
//!
//! Bounds: at most [`WATCHERS_MAX`] watchers per sandbox; a polling watcher
//! keeps at most [`QUEUE_MAX`] events between two `GetWatcherEvents`. A
//! watcher that missed events (its queue or the journal overflowed) fails as
//! envd's does when fsnotify's queue overflows: its next `GetWatcherEvents`
//! (or its stream) ends with `internal` "watcher error: ... overflow".
//!
//! Watchers live in this server process: they are not in checkpoints, a
//! paused sandbox's watchers end (`unavailable`), and a fork or a sandbox
//! brought back has none.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use forkbox_runtime::{ChangeKind, Changes, EntryKind, FileOp, FileOpOutcome};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::connect::{self, end, message};
use super::error::{Code, ConnectError};
use super::SandboxRec;
use crate::AppState;

/// Most watchers of one sandbox.
pub const WATCHERS_MAX: usize = 16;
/// Most events a polling watcher keeps between two reads.
pub const QUEUE_MAX: usize = 4096;
/// How long one read of the journal may hold the session waiting for a change.
const STEP: Duration = Duration::from_millis(50);
/// The pause between two reads that found nothing.
const PAUSE: Duration = Duration::from_millis(100);
/// The pause after the session was busy (an exec holds it).
const BUSY_PAUSE: Duration = Duration::from_millis(25);
/// How many times opening a watcher waits for a busy session (BUSY_PAUSE each: 60 s).
const OPEN_TRIES: u32 = 2400;
/// How often a stream sends a keepalive.
const KEEPALIVE: Duration = Duration::from_secs(30);

/// One watcher: what it watches, and (polling) the events not read yet.
pub struct Watcher {
    id: String,
    /// Absolute guest path of the directory.
    root: String,
    recursive: bool,
    queue: Mutex<Queue>,
    stopped: AtomicBool,
}

#[derive(Default)]
struct Queue {
    events: VecDeque<Value>,
    /// Why it stopped, if it failed (code, message).
    error: Option<(Code, String)>,
}

impl Watcher {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// envd's `FilesystemEvent` of a change, if it is in this watcher's directory.
    fn event(&self, path: &str, kind: ChangeKind) -> Option<Value> {
        let name = relative(&self.root, path, self.recursive)?;
        let t = match kind {
            ChangeKind::Create => "EVENT_TYPE_CREATE",
            ChangeKind::Write => "EVENT_TYPE_WRITE",
            ChangeKind::Remove => "EVENT_TYPE_REMOVE",
            ChangeKind::Rename => "EVENT_TYPE_RENAME",
            ChangeKind::Chmod => "EVENT_TYPE_CHMOD",
        };
        Some(json!({ "name": name, "type": t }))
    }
}

/// `path` relative to the directory `root` if it is inside it (directly, unless `recursive`).
fn relative<'a>(root: &str, path: &'a str, recursive: bool) -> Option<&'a str> {
    let rest = if root == "/" { path.strip_prefix('/')? } else { path.strip_prefix(root)?.strip_prefix('/')? };
    (!rest.is_empty() && (recursive || !rest.contains('/'))).then_some(rest)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherRequest {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

/// Start watching `req.path` of the sandbox: checks it is a directory, turns the
/// journal on and takes its position now (only later changes are reported).
async fn open(
    state: &AppState,
    rec: &Arc<SandboxRec>,
    req: &WatchRequest,
) -> Result<(Arc<Watcher>, u64), ConnectError> {
    super::process::running(rec)?;
    if req.include_entry {
        return Err(ConnectError::invalid("include_entry is not supported by this server (envd 0.6.3)"));
    }
    let root = normalize(&super::guest_path(&req.path)?);
    let caller = rec.caller();
    let (t, i, p) = (caller.tenant.clone(), rec.id.clone(), root.clone());
    let q = caller.quota();
    let stat = crate::handlers::blocking(state, move |rt| {
        rt.resume_session(&t, &i)?;
        Ok(rt.file_op(&t, &i, &FileOp::Stat { path: p }, &q)?)
    })
    .await;
    let entry = match stat {
        Ok((FileOpOutcome::Entry(e), _)) => e,
        Ok(_) => return Err(ConnectError::new(Code::Internal, "stat answered no entry")),
        Err(e) if e.code == forkbox_api::ErrorCode::FileNotFound => {
            return Err(ConnectError::new(Code::NotFound, format!("path {root} not found")))
        }
        Err(e) => return Err(e.into()),
    };
    if entry.target_kind.unwrap_or(entry.kind) != EntryKind::Dir {
        return Err(ConnectError::invalid(format!("path {root} not a directory")));
    }
    let token = super::new_token().map_err(|e| ConnectError::new(Code::Internal, e.message))?;
    let id = format!("w{token}");
    let w = Arc::new(Watcher {
        id: id.clone(),
        root,
        recursive: req.recursive,
        queue: Mutex::new(Queue::default()),
        stopped: AtomicBool::new(false),
    });
    {
        let mut st = rec.lock();
        if st.watchers.len() >= WATCHERS_MAX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("a sandbox has at most {WATCHERS_MAX} watchers: remove one first"),
            ));
        }
        st.watchers.insert(id, w.clone());
    }
    // The position now (an exec running meanwhile: once it is done).
    let mut tries = 0u32;
    let r = loop {
        match read(state, rec, u64::MAX, Duration::ZERO).await {
            Ok(Some(c)) => break Ok(c.next),
            Ok(None) if tries < OPEN_TRIES => {
                tries += 1;
                tokio::time::sleep(BUSY_PAUSE).await;
            }
            Ok(None) => break Err(ConnectError::new(Code::Unavailable, "the sandbox stayed busy: try again")),
            Err(e) => break Err(e),
        }
    };
    match r {
        Ok(at) => Ok((w, at)),
        Err(e) => {
            forget(state, rec, &w).await;
            Err(e)
        }
    }
}

/// `/a/./b//c/` as `/a/b/c` (no `..` resolution: the VFS resolves those).
fn normalize(p: &str) -> String {
    let parts: Vec<&str> = p.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    format!("/{}", parts.join("/"))
}

/// One read of the sandbox's journal from `since`, waiting at most `wait`
/// (None: the session is busy, an exec holds it).
async fn read(state: &AppState, rec: &SandboxRec, since: u64, wait: Duration) -> Result<Option<Changes>, ConnectError> {
    let r = match state.runtime.fs_watch(&rec.tenant, &rec.id, Some(since), wait).await {
        Ok(r) => r,
        Err(e) if e.code() == forkbox_api::ErrorCode::SessionBusy => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    r.map(Some).ok_or_else(|| {
        ConnectError::new(Code::Unavailable, format!("sandbox {} is not running: its watchers ended", rec.id))
    })
}

/// Forget a watcher; the last one of the sandbox turns the journal off.
async fn forget(state: &AppState, rec: &SandboxRec, w: &Watcher) {
    w.stopped.store(true, Ordering::SeqCst);
    let last = {
        let mut st = rec.lock();
        st.watchers.remove(&w.id);
        st.watchers.is_empty()
    };
    if last {
        // Best effort: a sandbox gone or paused has no journal anyway.
        let _ = state.runtime.fs_watch(&rec.tenant, &rec.id, None, Duration::ZERO).await;
    }
}

/// What one step of a watcher found.
enum Step {
    Events(Vec<Value>),
    Failed(Code, String),
}

/// Read the journal from `*at` for watcher `w`: its events, or why it ends.
async fn step(state: &AppState, rec: &SandboxRec, w: &Watcher, at: &mut u64) -> Option<Step> {
    if rec.lock().paused {
        return Some(Step::Failed(Code::Unavailable, format!("sandbox {} was paused: its watchers ended", rec.id)));
    }
    match read(state, rec, *at, STEP).await {
        Ok(None) => {
            tokio::time::sleep(BUSY_PAUSE).await;
            None
        }
        Ok(Some(c)) => {
            if c.lost > 0 {
                let msg = format!("watcher error: fsnotify: queue or buffer overflow ({} events lost)", c.lost);
                return Some(Step::Failed(Code::Internal, msg));
            }
            *at = c.next;
            Some(Step::Events(c.events.iter().filter_map(|e| w.event(&e.path, e.kind)).collect()))
        }
        Err(e) => Some(Step::Failed(e.code, e.message)),
    }
}

/// The task of a polling watcher: read the journal into its queue until it is removed or fails.
async fn pump(state: AppState, rec: Arc<SandboxRec>, w: Arc<Watcher>, mut at: u64) {
    while !w.stopped.load(Ordering::SeqCst) {
        match step(&state, &rec, &w, &mut at).await {
            None => continue,
            Some(Step::Events(evs)) => {
                let none = evs.is_empty();
                {
                    let mut q = w.queue();
                    q.events.extend(evs);
                    if q.events.len() > QUEUE_MAX {
                        q.events.clear();
                        q.error = Some((Code::Internal, "watcher error: fsnotify: queue or buffer overflow".into()));
                        return;
                    }
                }
                if none {
                    tokio::time::sleep(PAUSE).await;
                }
            }
            Some(Step::Failed(code, msg)) => {
                w.queue().error = Some((code, msg));
                return;
            }
        }
    }
}

/// `CreateWatcher {path, recursive}` -> `{watcherId}`.
pub async fn create_watcher(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Value, ConnectError> = async {
        let req: WatchRequest = connect::request(&headers, &body)?;
        let (w, at) = open(&state, &rec, &req).await?;
        tokio::spawn(pump(state.clone(), rec.clone(), w.clone(), at));
        Ok(json!({ "watcherId": w.id }))
    }
    .await;
    super::filesystem::answer(r)
}

fn watcher_of(rec: &SandboxRec, id: &str) -> Result<Arc<Watcher>, ConnectError> {
    rec.lock()
        .watchers
        .get(id)
        .cloned()
        .ok_or_else(|| ConnectError::new(Code::NotFound, format!("watcher with id {id} not found")))
}

/// `GetWatcherEvents {watcherId}` -> `{events}`: what happened since the last call.
pub async fn get_watcher_events(
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Value, ConnectError> = (|| {
        let req: WatcherRequest = connect::request(&headers, &body)?;
        let w = watcher_of(&rec, &req.watcher_id)?;
        let mut q = w.queue();
        if let Some((code, msg)) = &q.error {
            return Err(ConnectError::new(*code, msg.clone()));
        }
        let events: Vec<Value> = q.events.drain(..).collect();
        Ok(json!({ "events": events }))
    })();
    super::filesystem::answer(r)
}

/// `RemoveWatcher {watcherId}` -> `{}`.
pub async fn remove_watcher(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Value, ConnectError> = async {
        let req: WatcherRequest = connect::request(&headers, &body)?;
        let w = watcher_of(&rec, &req.watcher_id)?;
        forget(&state, &rec, &w).await;
        Ok(json!({}))
    }
    .await;
    super::filesystem::answer(r)
}

/// `WatchDir {path, recursive}`: a stream of `start`, then `filesystem` events (the
/// oneof of `WatchDirResponse` itself, so no `event` wrapper as in a process stream)
/// as they happen (keepalives between), until the client leaves or it fails.
pub async fn watch_dir(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let opened = async {
        let req: WatchRequest = connect::request(&headers, &body)?;
        open(&state, &rec, &req).await
    }
    .await;
    let (w, at) = match opened {
        Ok(x) => x,
        Err(e) => return connect::stream_error(e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(crate::handlers::stream::CHANNEL);
    let _ = tx.try_send(message(&json!({ "start": {} })));
    tokio::spawn(stream(state, rec, w, at, tx));
    connect::stream(rx)
}

async fn stream(state: AppState, rec: Arc<SandboxRec>, w: Arc<Watcher>, mut at: u64, tx: mpsc::Sender<Bytes>) {
    let mut keepalive = tokio::time::Instant::now() + KEEPALIVE;
    let failed = loop {
        if tx.is_closed() || w.stopped.load(Ordering::SeqCst) {
            break None;
        }
        if tokio::time::Instant::now() >= keepalive {
            keepalive = tokio::time::Instant::now() + KEEPALIVE;
            if tx.send(message(&json!({ "keepalive": {} }))).await.is_err() {
                break None;
            }
        }
        match step(&state, &rec, &w, &mut at).await {
            None => {}
            Some(Step::Events(evs)) => {
                let none = evs.is_empty();
                for e in evs {
                    if tx.send(message(&json!({ "filesystem": e }))).await.is_err() {
                        break;
                    }
                }
                if none {
                    tokio::time::sleep(PAUSE).await;
                }
            }
            Some(Step::Failed(code, msg)) => break Some(ConnectError::new(code, msg)),
        }
    };
    if let Some(e) = &failed {
        let _ = tx.send(end(Some(e))).await;
    }
    forget(&state, &rec, &w).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_names() {
        assert_eq!(relative("/home/user", "/home/user/a.txt", false), Some("a.txt"));
        assert_eq!(relative("/home/user", "/home/user/d/a.txt", false), None);
        assert_eq!(relative("/home/user", "/home/user/d/a.txt", true), Some("d/a.txt"));
        assert_eq!(relative("/home/user", "/home/username/a", true), None);
        assert_eq!(relative("/home/user", "/home/user", true), None);
        assert_eq!(relative("/", "/tmp", false), Some("tmp"));
        assert_eq!(relative("/", "/tmp/x", false), None);
        assert_eq!(normalize("/a/./b//c/"), "/a/b/c");
        assert_eq!(normalize("/"), "/");
    }
}
