//! envd's `filesystem.Filesystem` service: `Stat`, `ListDir` (with depth, at most
//! 10,000 entries), `MakeDir`, `Move`, `Remove`: the runtime's file operations on
//! the session's file system (no guest code runs; reading makes no checkpoint, a
//! change makes one). The watcher calls are [`super::watch`]'s.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use forkbox_runtime::{EntryInfo, EntryKind, FileOp, FileOpOutcome};
use serde::Deserialize;
use serde_json::{json, Value};

use super::connect;
use super::error::ConnectError;
use super::SandboxRec;
use crate::handlers::blocking;
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .route("/filesystem.Filesystem/WatchDir", post(super::watch::watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(super::watch::create_watcher))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(super::watch::get_watcher_events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(super::watch::remove_watcher))
}

/// An entry as envd's `EntryInfo` (JSON names of its proto): a symlink is typed by what it
/// points at (a dangling one as a file), `isSymlink` and `symlinkTarget` say it is one.
fn entry_json(e: &EntryInfo) -> Value {
    let shown = e.target_kind.unwrap_or(e.kind);
    let kind = if shown == EntryKind::Dir { "FILE_TYPE_DIRECTORY" } else { "FILE_TYPE_FILE" };
    let type_char = match e.kind {
        EntryKind::Dir => 'd',
        EntryKind::Symlink => 'l',
        EntryKind::File => '-',
        EntryKind::Other => '?',
    };
    let mut v = json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.perm,
        "permissions": permissions(type_char, e.perm),
        "owner": e.owner,
        "group": e.group,
        "modifiedTime": super::control::rfc3339(e.mtime_ms),
        "isSymlink": e.kind == EntryKind::Symlink,
    });
    if let Some(t) = &e.link_target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

/// `ls -l`'s mode string (Python's `stat.filemode`).
fn permissions(type_char: char, perm: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(type_char);
    for (shift, special, upper, lower) in [(6, 0o4000, 'S', 's'), (3, 0o2000, 'S', 's'), (0, 0o1000, 'T', 't')] {
        let bits = (perm >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        let x = bits & 1 != 0;
        s.push(match (perm & special != 0, x) {
            (true, true) => lower,
            (true, false) => upper,
            (false, true) => 'x',
            (false, false) => '-',
        });
    }
    s
}

/// Run `op` on the sandbox's files (the host reads and changes the guest's file system; no
/// guest code runs, and only a change makes a checkpoint); its answer in envd's shape.
async fn run(state: &AppState, rec: &SandboxRec, op: FileOp) -> Result<Value, ConnectError> {
    super::process::running(rec)?;
    let caller = rec.caller();
    let id = rec.id.clone();
    let (out, _) = blocking(state, move |rt| Ok(rt.file_op(&caller.tenant, &id, &op, &caller.quota())?)).await?;
    Ok(match out {
        FileOpOutcome::Entry(e) => json!({ "entry": entry_json(&e) }),
        FileOpOutcome::Entries(es) => json!({ "entries": es.iter().map(entry_json).collect::<Vec<_>>() }),
        FileOpOutcome::Removed => json!({}),
    })
}

#[derive(Deserialize)]
struct PathRequest {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Deserialize)]
struct MoveRequest {
    source: String,
    destination: String,
}

pub(super) fn answer(r: Result<Value, ConnectError>) -> Response {
    match r {
        Ok(v) => connect::unary(v),
        Err(e) => e.into_response(),
    }
}

async fn path_op(state: AppState, rec: Arc<SandboxRec>, headers: HeaderMap, body: Bytes, op: Op) -> Response {
    let r: Result<Value, ConnectError> = async {
        let req: PathRequest = connect::request(&headers, &body)?;
        let path = super::guest_path(&req.path)?;
        let op = match op {
            Op::Stat => FileOp::Stat { path },
            Op::List => FileOp::Walk { path, depth: req.depth.unwrap_or(1) },
            Op::MakeDir => FileOp::MakeDir { path },
            Op::Remove => FileOp::Remove { path },
        };
        run(&state, &rec, op).await
    }
    .await;
    answer(r)
}

/// The operations of one path.
enum Op {
    Stat,
    List,
    MakeDir,
    Remove,
}

async fn stat(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, Op::Stat).await
}

async fn list_dir(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, Op::List).await
}

async fn make_dir(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, Op::MakeDir).await
}

async fn remove(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, Op::Remove).await
}

async fn move_entry(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r: Result<Value, ConnectError> = async {
        let req: MoveRequest = connect::request(&headers, &body)?;
        let (a, b) = (super::guest_path(&req.source)?, super::guest_path(&req.destination)?);
        run(&state, &rec, FileOp::Move { from: a, to: b }).await
    }
    .await;
    answer(r)
}
