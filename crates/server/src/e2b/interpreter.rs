//! The code interpreter (port 49999): `POST /execute` as NDJSON and code contexts.
//!
//! The default context is the session's own namespace: an execution is a session
//! exec (checkpointed), so state persists across calls, the last expression is the
//! main result (its MIME bundle from forkbox's rich outputs: `text/html` for a
//! DataFrame ...), `display()` calls and the matplotlib figures left open come as
//! results that are not the main one (`image/png`), and any exception, a
//! `BaseException` too, is an `error` event. Lines starting with `!` run in the
//! shell (`!pip install` is forkbox's package install, like `%pip install`).
//! `env_vars` hold for one execution (set by an exec before it, restored after).
//! Other contexts are namespaces of their own in the same guest (same files and
//! process; the last expression is their result too; no top-level `await`).
//! A client that disconnects interrupts the execution.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json, Router};
use forkbox_runtime::{MimeBundle, SessionCode, Stream};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::control::py_str;
use super::error::ConnectError;
use super::{PendingSetup, SandboxRec, HOME};
use crate::handlers::stream::{Forward, Streamed, CHANNEL};
use crate::AppState;

/// The id of the default context (the session's own namespace).
const DEFAULT_CONTEXT: &str = "default";
/// Most contexts a sandbox may have besides the default one.
const MAX_CONTEXTS: usize = 64;
const KEEPALIVE: Duration = Duration::from_secs(30);

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/execute", post(execute))
        .route("/contexts", get(list_contexts).post(create_context))
        .route("/contexts/{id}", delete(delete_context))
        .route("/contexts/{id}/restart", post(restart_context))
        .route("/health", get(super::files::health_route))
}

/// The interpreter's errors: status + JSON (the SDK shows the body; 404 NotFound).
fn http(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "code": status.as_u16(), "message": message.into() }))).into_response()
}

pub(super) fn from_connect(e: ConnectError) -> Response {
    http(e.status(), crate::error::scrub(&e.message))
}

#[derive(Deserialize)]
struct ExecuteRequest {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// An answer for a language other than Python (None: Python).
fn not_python(language: Option<&str>) -> Option<Response> {
    match language {
        None | Some("python" | "python3" | "py" | "") => None,
        Some(other) => {
            Some(http(StatusCode::BAD_REQUEST, format!("language {other:?} is not supported here (python only)")))
        }
    }
}

/// IPython's `!cmd` lines (other than `!pip install`, which forkbox serves itself) as shell runs.
fn shell_escapes(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    for line in code.split_inclusive('\n') {
        let body = line.trim_end_matches(['\n', '\r']);
        let indent = &body[..body.len() - body.trim_start().len()];
        let rest = body.trim_start();
        let pip = forkbox_runtime_pip_line(rest);
        match rest.strip_prefix('!') {
            Some(cmd) if !pip && !cmd.trim().is_empty() => {
                out.push_str(indent);
                out.push_str(&format!("__import__('subprocess').run({}, shell=True) and None", py_str(cmd.trim())));
                out.push_str(&line[body.len()..]);
            }
            _ => out.push_str(line),
        }
    }
    out
}

/// Whether `line` (trimmed) is a pip line forkbox installs itself.
fn forkbox_runtime_pip_line(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('!').or_else(|| line.strip_prefix('%')) else { return false };
    let mut w = rest.split_whitespace();
    match w.next() {
        Some("pip" | "pip3") => true,
        Some("python" | "python3") => w.next() == Some("-m") && w.next() == Some("pip"),
        _ => false,
    }
}

/// The guest side of contexts other than the default one.
const CONTEXTS: &str = r#"
import ast, linecache
spaces = globals().setdefault("spaces", {})
def run(ctx, src):
    ns = spaces.setdefault(ctx, {"__name__": "__main__"})
    fn = "<context %s>" % ctx
    linecache.cache[fn] = (len(src), None, src.splitlines(True), fn)
    tree = ast.parse(src, fn, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        ast.copy_location(last, last.body)
    exec(compile(tree, fn, "exec"), ns)
    if last is not None:
        return eval(compile(last, fn, "eval"), ns)
def reset(ctx):
    spaces.pop(ctx, None)
"#;

fn in_context(ctx: &str, code: &str) -> String {
    format!(
        "# e2b: context {ctx}\nexec({helper}, vars(__import__('sys').modules.setdefault('_e2b_contexts', __import__('types').ModuleType('_e2b_contexts'))))\n\
__import__('sys').modules['_e2b_contexts'].run({ctx_lit}, {code})\n",
        helper = py_str(CONTEXTS),
        ctx_lit = py_str(ctx),
        code = py_str(code),
    )
}

fn timestamp_ns() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

/// A `result` event of a MIME bundle (the fields the SDK maps; other types under `extra`).
fn result_event(bundle: &MimeBundle, main: bool, text: Option<&str>) -> Value {
    let mut r = Map::new();
    r.insert("type".into(), json!("result"));
    r.insert("is_main_result".into(), json!(main));
    let mut extra = Map::new();
    for (mime, v) in bundle {
        let field = match mime.as_str() {
            "text/plain" => "text",
            "text/html" => "html",
            "text/markdown" => "markdown",
            "image/svg+xml" => "svg",
            "image/png" => "png",
            "image/jpeg" => "jpeg",
            "application/pdf" => "pdf",
            "text/latex" => "latex",
            "application/json" => "json",
            "application/javascript" => "javascript",
            other => {
                extra.insert(other.to_string(), v.clone());
                continue;
            }
        };
        r.insert(field.into(), v.clone());
    }
    if let Some(t) = text {
        r.insert("text".into(), json!(t));
    }
    if !extra.is_empty() {
        r.insert("extra".into(), Value::Object(extra));
    }
    Value::Object(r)
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn env_code(env: &BTreeMap<String, String>) -> String {
    let env = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
    format!(
        "# e2b: env_vars for one execution\nimport os as _e2b_os, json as _e2b_json, sys as _e2b_sys\n\
_e2b_env = _e2b_json.loads({env})\n_e2b_sys._e2b_saved_env = {{k: _e2b_os.environ.get(k) for k in _e2b_env}}\n\
_e2b_os.environ.update(_e2b_env)\ndel _e2b_os, _e2b_json, _e2b_sys, _e2b_env\n",
        env = py_str(&env)
    )
}

const RESTORE_ENV: &str = "# e2b: restore the environment\nimport os as _e2b_os, sys as _e2b_sys\n\
for _e2b_k, _e2b_v in getattr(_e2b_sys, '_e2b_saved_env', {}).items():\n    \
if _e2b_v is None:\n        _e2b_os.environ.pop(_e2b_k, None)\n    else:\n        _e2b_os.environ[_e2b_k] = _e2b_v\n\
_e2b_sys._e2b_saved_env = {}\ndel _e2b_os, _e2b_sys\n";

/// `POST /execute`: NDJSON events of one execution.
async fn execute(State(state): State<AppState>, Extension(rec): Extension<Arc<SandboxRec>>, body: Bytes) -> Response {
    let req: ExecuteRequest = match crate::extractors::parse_json(&body) {
        Ok(r) => r,
        Err(e) => return http(StatusCode::BAD_REQUEST, e.message),
    };
    if let Some(r) = not_python(req.language.as_deref()) {
        return r;
    }
    if let Err(e) = super::process::running(&rec) {
        return from_connect(e);
    }
    let ctx = req.context_id.filter(|c| c != DEFAULT_CONTEXT);
    if let Some(c) = &ctx {
        if !rec.lock().contexts.contains_key(c) {
            return http(StatusCode::NOT_FOUND, format!("context {c} not found"));
        }
    }
    let code = shell_escapes(&req.code);
    let code = match &ctx {
        Some(c) => in_context(c, &code),
        None => code,
    };
    let caller = rec.caller();
    let (c, i, checked) = (caller.clone(), rec.id.clone(), code.clone());
    let checked =
        crate::handlers::blocking(&state, move |rt| Ok(rt.check_session_exec(&c.tenant, &i, &checked, &c.quota())?))
            .await;
    if let Err(e) = checked {
        return from_connect(e.into());
    }
    let env = req.env_vars.unwrap_or_default();
    // What the sandbox owes the guest (its setup, the undoing of the previous
    // execution's env_vars), then this execution's env_vars: run by the guest before
    // the code in the same exec. Their undoing is owed to the next call.
    let restore = !env.is_empty();
    let setup = if restore { Some(rec.hold_setup().await) } else { rec.pending_setup().await };
    let mut prelude = setup.as_ref().and_then(PendingSetup::code).map(str::to_string);
    if restore {
        prelude.get_or_insert_with(String::new).push_str(&env_code(&env));
    }
    let permit = match crate::fair::acquire_for(&state, &caller, 1).await {
        Ok(p) => p,
        Err(e) => return from_connect(e.into()),
    };
    let count = {
        let mut st = rec.lock();
        st.executions += 1;
        st.executions
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL);
    let _ = tx.send(line(&json!({ "type": "number_of_executions", "execution_count": count }))).await;
    let (otx, mut orx) = mpsc::channel::<Streamed>(CHANNEL);
    let fwd = Box::new(Forward::new(otx));
    let (st2, rec2) = (state.clone(), rec.clone());
    let exec = tokio::spawn(async move {
        let code = SessionCode { code, prelude };
        let r = st2.runtime.session_exec(&caller.tenant, &rec2.id, code, None, caller.quota(), Some(fwd), permit).await;
        // The guest ran the exec (its prelude too, or the prelude's error is the exec's).
        if let (Ok(_), Some(s)) = (&r, setup) {
            s.done(restore.then(|| RESTORE_ENV.to_string()));
        }
        r
    });
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
        let mut gone = false;
        loop {
            tokio::select! {
                ev = orx.recv() => match ev {
                    Some(Streamed::Output(stream, text)) => {
                        let kind = if stream == Stream::Stdout { "stdout" } else { "stderr" };
                        let ev = json!({ "type": kind, "text": text, "timestamp": timestamp_ns() });
                        gone |= tx.send(line(&ev)).await.is_err();
                    }
                    Some(_) => {}
                    None => break,
                },
                _ = tick.tick() => {
                    gone |= tx.send(line(&json!({ "type": "keepalive" }))).await.is_err();
                }
                _ = tx.closed(), if !gone => gone = true,
            }
            if gone {
                // The client went away: stop the execution (like a kernel interrupt); the
                // session keeps its state.
                let (t, i) = (rec.tenant.clone(), rec.id.clone());
                let _ = crate::handlers::blocking(&state, move |rt| Ok(rt.interrupt(&t, &i)?)).await;
                while orx.recv().await.is_some() {}
                break;
            }
        }
        let r = exec.await;
        let mut events = Vec::new();
        match r {
            Ok(Ok(o)) => {
                let res = &o.result;
                for d in &res.display {
                    events.push(result_event(d, false, None));
                }
                if let Some(v) = &res.value {
                    let empty = MimeBundle::new();
                    events.push(result_event(res.value_data.as_ref().unwrap_or(&empty), true, Some(v)));
                }
                if let Some(e) = &res.error {
                    events
                        .push(json!({ "type": "error", "name": e.kind, "value": e.message, "traceback": e.traceback }));
                }
            }
            Ok(Err(e)) => {
                let e = crate::error::ApiError::from(e);
                let name = match e.code {
                    forkbox_api::ErrorCode::Timeout => "TimeoutError".to_string(),
                    c => c.as_str().to_string(),
                };
                events.push(
                    json!({ "type": "error", "name": name, "value": crate::error::scrub(&e.message), "traceback": "" }),
                );
            }
            Err(e) => {
                events.push(json!({ "type": "error", "name": "internal", "value": e.to_string(), "traceback": "" }))
            }
        }
        events.push(json!({ "type": "end_of_execution" }));
        for ev in events {
            if tx.send(line(&ev)).await.is_err() {
                break;
            }
        }
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    }));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    resp
}

#[derive(Deserialize, Default)]
struct NewContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

fn context_json(id: &str, language: &str, cwd: &str) -> Value {
    json!({ "id": id, "language": language, "cwd": cwd })
}

/// `POST /contexts {language?, cwd?}`: a new namespace.
async fn create_context(Extension(rec): Extension<Arc<SandboxRec>>, body: Bytes) -> Response {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &body };
    let req: NewContext = match crate::extractors::parse_json(body) {
        Ok(r) => r,
        Err(e) => return http(StatusCode::BAD_REQUEST, e.message),
    };
    if let Some(r) = not_python(req.language.as_deref()) {
        return r;
    }
    let cwd = match super::guest_path(req.cwd.as_deref().unwrap_or(HOME)) {
        Ok(c) => c,
        Err(e) => return from_connect(e),
    };
    let id = match super::new_token() {
        Ok(t) => t[..16].to_string(),
        Err(e) => return e.into_response(),
    };
    let mut st = rec.lock();
    if st.contexts.len() >= MAX_CONTEXTS {
        return http(StatusCode::TOO_MANY_REQUESTS, format!("at most {MAX_CONTEXTS} contexts per sandbox"));
    }
    st.contexts.insert(id.clone(), ("python".into(), cwd.clone()));
    Json(context_json(&id, "python", &cwd)).into_response()
}

/// `GET /contexts`.
async fn list_contexts(Extension(rec): Extension<Arc<SandboxRec>>) -> Response {
    let st = rec.lock();
    let mut v = vec![context_json(DEFAULT_CONTEXT, "python", HOME)];
    v.extend(st.contexts.iter().map(|(id, (lang, cwd))| context_json(id, lang, cwd)));
    Json(v).into_response()
}

/// `DELETE /contexts/{id}`: its namespace is dropped.
async fn delete_context(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    Path(id): Path<String>,
) -> Response {
    if id == DEFAULT_CONTEXT {
        return http(StatusCode::BAD_REQUEST, "the default context cannot be removed");
    }
    if rec.lock().contexts.remove(&id).is_none() {
        return http(StatusCode::NOT_FOUND, format!("context {id} not found"));
    }
    match reset(&state, &rec, &id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => from_connect(e),
    }
}

/// `POST /contexts/{id}/restart`: its namespace starts empty (the default context's: every
/// name the code defined is removed; files stay, as with a kernel restart).
async fn restart_context(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    Path(id): Path<String>,
) -> Response {
    if id != DEFAULT_CONTEXT && !rec.lock().contexts.contains_key(&id) {
        return http(StatusCode::NOT_FOUND, format!("context {id} not found"));
    }
    match reset(&state, &rec, &id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => from_connect(e),
    }
}

async fn reset(state: &AppState, rec: &SandboxRec, id: &str) -> Result<(), ConnectError> {
    super::process::running(rec)?;
    let code = if id == DEFAULT_CONTEXT {
        "# e2b: restart the default context\nfor _e2b_k in [k for k in globals() if not k.startswith('__')]:\n    \
globals().pop(_e2b_k, None)\n"
            .to_string()
    } else {
        format!(
            "# e2b: drop context {id}\n__import__('sys').modules.get('_e2b_contexts') and __import__('sys').modules['_e2b_contexts'].reset({})\n",
            py_str(id)
        )
    };
    super::control::run_setup(state, &rec.caller(), &rec.id, code).await.map_err(ConnectError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_escapes_become_subprocess_runs_and_pip_lines_stay() {
        let code = "x = 1\n!ls -l /tmp\n  !echo 'a b'\n!pip install numpy\n%pip install pandas\nx\n";
        let out = shell_escapes(code);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "x = 1");
        assert_eq!(lines[1], "__import__('subprocess').run(\"ls -l /tmp\", shell=True) and None");
        assert_eq!(lines[2], "  __import__('subprocess').run(\"echo 'a b'\", shell=True) and None");
        assert_eq!(lines[3], "!pip install numpy");
        assert_eq!(lines[4], "%pip install pandas");
        assert_eq!(lines[5], "x");
    }

    #[test]
    fn bundles_map_to_the_sdk_fields() {
        let mut b = MimeBundle::new();
        b.insert("text/html".into(), json!("<table/>"));
        b.insert("image/png".into(), json!("iVBO"));
        b.insert("application/vnd.custom".into(), json!({"a": 1}));
        let r = result_event(&b, true, Some("df"));
        assert_eq!(r["html"], "<table/>");
        assert_eq!(r["png"], "iVBO");
        assert_eq!(r["text"], "df");
        assert_eq!(r["is_main_result"], true);
        assert_eq!(r["extra"]["application/vnd.custom"]["a"], 1);
    }
}
