//! envd's `filesystem.Filesystem` service: `Stat`, `ListDir` (with depth),
//! `MakeDir`, `Move`, `Remove`, each an exec of a small snippet in the sandbox's
//! session (so the guest's own view of its files answers, and a change is
//! checkpointed like any exec). Watchers are not served (`unimplemented`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::Value;

use super::connect;
use super::control::py_str;
use super::error::{Code, ConnectError};
use super::SandboxRec;
use crate::AppState;

/// Most entries one `ListDir` returns.
const MAX_ENTRIES: usize = 10_000;
/// Deepest `ListDir`.
const MAX_DEPTH: u32 = 64;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .route("/filesystem.Filesystem/WatchDir", post(watch))
        .route("/filesystem.Filesystem/CreateWatcher", post(watch))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(watch))
        .route("/filesystem.Filesystem/RemoveWatcher", post(watch))
}

/// The guest side: one operation, its answer as base64 JSON on stdout.
const HELPER: &str = r#"
def _e2b_fs(op, a, b, depth, max_entries):
    import os, stat, json, base64, shutil, datetime
    def who(f, i):
        try:
            return f(i)
        except Exception:
            return str(i)
    def info(p):
        st = os.lstat(p)
        link = stat.S_ISLNK(st.st_mode)
        target = None
        if link:
            target = os.readlink(p)
            try:
                st = os.stat(p)
            except OSError:
                pass
        t = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(st.st_mode) else "FILE_TYPE_FILE"
        import pwd, grp
        e = {
            "name": os.path.basename(p.rstrip("/")) or "/",
            "type": t,
            "path": p,
            "size": str(st.st_size),
            "mode": st.st_mode & 0o7777,
            "permissions": stat.filemode(st.st_mode),
            "owner": who(lambda i: pwd.getpwuid(i).pw_name, st.st_uid),
            "group": who(lambda i: grp.getgrgid(i).gr_name, st.st_gid),
            "modifiedTime": datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "isSymlink": link,
        }
        if target is not None:
            e["symlinkTarget"] = target
        return e
    try:
        if op == "stat":
            r = {"entry": info(a)}
        elif op == "list":
            if not os.path.isdir(a):
                os.lstat(a)
                raise NotADirectoryError("%s is not a directory" % a)
            out = []
            def walk(d, level):
                for n in sorted(os.listdir(d)):
                    if len(out) >= max_entries:
                        return
                    p = os.path.join(d, n)
                    e = info(p)
                    out.append(e)
                    if level < depth and e["type"] == "FILE_TYPE_DIRECTORY" and not e["isSymlink"]:
                        walk(p, level + 1)
            walk(a, 1)
            r = {"entries": out}
        elif op == "mkdir":
            if os.path.lexists(a):
                raise FileExistsError("%s already exists" % a)
            os.makedirs(a)
            r = {"entry": info(a)}
        elif op == "move":
            os.lstat(a)
            parent = os.path.dirname(b)
            if parent:
                os.makedirs(parent, exist_ok=True)
            os.rename(a, b)
            r = {"entry": info(b)}
        elif op == "remove":
            if os.path.isdir(a) and not os.path.islink(a):
                shutil.rmtree(a)
            else:
                os.remove(a)
            r = {}
        else:
            r = {"error": ["invalid_argument", "unknown operation"]}
    except FileNotFoundError as e:
        r = {"error": ["not_found", "%s: no such file or directory" % (e.filename or a)]}
    except FileExistsError as e:
        r = {"error": ["already_exists", str(e)]}
    except (NotADirectoryError, IsADirectoryError) as e:
        r = {"error": ["invalid_argument", str(e)]}
    except PermissionError as e:
        r = {"error": ["permission_denied", str(e)]}
    except OSError as e:
        r = {"error": ["invalid_argument", "%s: %s" % (e.filename or a, e.strerror or e)]}
    print(base64.b64encode(json.dumps(r).encode()).decode())
"#;

/// Run operation `op` in the sandbox's guest; its answer.
async fn run(
    state: &AppState,
    rec: &SandboxRec,
    headers: &HeaderMap,
    op: &str,
    a: &str,
    b: &str,
    depth: u32,
) -> Result<Value, ConnectError> {
    let code = format!(
        "# e2b: {op} {label}\n{HELPER}\n_e2b_fs({op}, {a}, {b}, {depth}, {MAX_ENTRIES})\ndel _e2b_fs\n",
        label = a.chars().take(200).map(|c| if c.is_control() { ' ' } else { c }).collect::<String>(),
        op = py_str(op),
        a = py_str(a),
        b = py_str(b),
    );
    let super::process::Admitted { caller, timeout, permit } =
        super::process::admit(state, rec, headers, &code).await?;
    let o = state.runtime.session_exec(&caller.tenant, &rec.id, code, timeout, caller.quota(), None, permit).await?;
    if let Some(e) = o.result.error {
        return Err(ConnectError::new(Code::Internal, format!("{}: {}", e.kind, e.message)));
    }
    let line = o.result.stdout.trim();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(line)
        .map_err(|_| ConnectError::new(Code::Internal, "the guest's answer was not readable"))?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|_| ConnectError::new(Code::Internal, "the guest's answer was not readable"))?;
    if let Some(err) = v.get("error").and_then(Value::as_array) {
        let code = match err.first().and_then(Value::as_str) {
            Some("not_found") => Code::NotFound,
            Some("already_exists") => Code::AlreadyExists,
            Some("permission_denied") => Code::PermissionDenied,
            _ => Code::InvalidArgument,
        };
        return Err(ConnectError::new(code, err.get(1).and_then(Value::as_str).unwrap_or("failed").to_string()));
    }
    Ok(v)
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

fn answer(r: Result<Value, ConnectError>) -> Response {
    match r {
        Ok(v) => connect::unary(v),
        Err(e) => e.into_response(),
    }
}

async fn path_op(state: AppState, rec: Arc<SandboxRec>, headers: HeaderMap, body: Bytes, op: &str) -> Response {
    let r: Result<Value, ConnectError> = async {
        let req: PathRequest = connect::request(&headers, &body)?;
        let path = super::guest_path(&req.path)?;
        let depth = req.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
        run(&state, &rec, &headers, op, &path, "", depth).await
    }
    .await;
    answer(r)
}

async fn stat(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, "stat").await
}

async fn list_dir(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, "list").await
}

async fn make_dir(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, "mkdir").await
}

async fn remove(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    path_op(state, rec, headers, body, "remove").await
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
        run(&state, &rec, &headers, "move", &a, &b, 1).await
    }
    .await;
    answer(r)
}

/// Watchers: not served.
async fn watch(headers: HeaderMap) -> Response {
    let e = ConnectError::new(Code::Unimplemented, "directory watchers are not supported by this server");
    if connect::is_stream(&headers) {
        connect::stream_error(e)
    } else {
        e.into_response()
    }
}
