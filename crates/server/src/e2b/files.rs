//! envd's HTTP routes: `GET /files?path=` (the bytes), `POST /files?path=`
//! (multipart with `file` parts, or a raw `application/octet-stream` body), and
//! `GET /health`. Files go through the session's VFS (never the host's file
//! system), within the server's file size limit; an upload is checkpointed
//! (one checkpoint per file).
//! Errors are envd's `{"code": <status>, "message"}`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde_json::json;

use forkbox_api::ErrorCode;

use super::error::{Code, ConnectError};
use super::SandboxRec;
use crate::error::ApiError;
use crate::handlers::blocking;
use crate::uploads;
use crate::AppState;

/// Most files one multipart upload may carry.
const MAX_PARTS: usize = 1000;

pub fn routes(files_limit: usize) -> Router<AppState> {
    Router::new()
        .route("/files", get(download).post(upload).layer(DefaultBodyLimit::max(files_limit)))
        .route("/health", get(health))
}

/// An error in envd's HTTP shape.
struct HttpError(ConnectError);

impl From<ConnectError> for HttpError {
    fn from(e: ConnectError) -> HttpError {
        HttpError(e)
    }
}

impl From<crate::error::ApiError> for HttpError {
    fn from(e: crate::error::ApiError) -> HttpError {
        HttpError(e.into())
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let body = json!({ "code": status.as_u16(), "message": crate::error::scrub(&self.0.message) });
        (status, Json(body)).into_response()
    }
}

fn params(q: Option<&str>) -> Result<Option<String>, HttpError> {
    let pairs = crate::extractors::query_pairs(q).map_err(|e| ConnectError::invalid(e.message))?;
    Ok(pairs.into_iter().find(|(k, _)| k == "path").map(|(_, v)| v))
}

fn too_large(limit: usize) -> HttpError {
    HttpError(ConnectError {
        code: Code::ResourceExhausted,
        message: format!("the upload is over the file size limit of {limit} bytes"),
        status: Some(StatusCode::PAYLOAD_TOO_LARGE),
    })
}

/// `GET /files?path=P`: the file's bytes.
async fn download(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    RawQuery(q): RawQuery,
) -> Result<Response, HttpError> {
    super::process::running(&rec)?;
    let path = params(q.as_deref())?.ok_or_else(|| ConnectError::invalid("path is required"))?;
    let path = super::guest_path(&path)?;
    let max = state.config.files_limit;
    let (t, i) = (rec.tenant.clone(), rec.id.clone());
    let data = blocking(&state, move |rt| Ok(rt.read_file(&t, &i, &path, max)?)).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

/// `POST /files?path=P`: write one file (octet-stream) or the `file` parts of a multipart body
/// (each named by `path`, or by its file name when there is no `path`). Like forkbox's own
/// uploads: the key's cap on uploads in progress, `Content-Length` checked before anything is
/// read, each file streamed to a temporary file (this process holds one chunk at a time), a
/// refused body read and thrown away before the error goes out.
async fn upload(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    RawQuery(q): RawQuery,
    req: Request,
) -> Result<Response, HttpError> {
    let limit = state.config.files_limit;
    let (parts, body) = req.into_parts();
    let caller = rec.caller();
    let admitted =
        super::process::running(&rec).map_err(HttpError::from).and_then(|()| params(q.as_deref())).and_then(|path| {
            if parts.headers.get(header::CONTENT_ENCODING).is_some_and(|enc| enc.as_bytes() != b"identity") {
                return Err(ConnectError::invalid("compressed uploads are not accepted (envd 0.4.0)").into());
            }
            uploads::check_length(&parts.headers, limit as u64).map_err(|_| too_large(limit))?;
            let held = uploads::hold(&caller, uploads::Transfer::Upload, state.config.key_uploads)?;
            Ok((path, held))
        });
    let (path, _held) = match admitted {
        Ok(a) => a,
        Err(e) => {
            uploads::refuse_body(body);
            return Err(e);
        }
    };
    let spooled = |r: Result<(std::fs::File, u64), ApiError>| match r {
        Err(e) if e.code == ErrorCode::FileTooLarge => Err(too_large(limit)),
        r => r.map_err(HttpError::from),
    };
    let dir = state.runtime.home().join("sessions");
    let ct = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let mut files: Vec<(String, std::fs::File, u64)> = Vec::new();
    if ct.starts_with("multipart/") {
        let mut mp = Multipart::from_request(Request::from_parts(parts, body), &state)
            .await
            .map_err(|e| ConnectError::invalid(format!("multipart body: {}", e.body_text())))?;
        loop {
            let mut field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large(limit)),
                Err(e) => return Err(ConnectError::invalid(format!("multipart body: {}", e.body_text())).into()),
            };
            if field.name() != Some("file") {
                continue;
            }
            let p = match (&path, field.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) if !n.is_empty() => n.to_string(),
                _ => return Err(ConnectError::invalid("a file part needs a file name, or the request a path").into()),
            };
            if files.len() >= MAX_PARTS {
                return Err(ConnectError::invalid(format!("at most {MAX_PARTS} files per upload")).into());
            }
            let (f, len) = spooled(uploads::spool_stream(dir.clone(), &mut field, limit as u64).await)?;
            files.push((p, f, len));
        }
    } else {
        let Some(p) = path else {
            uploads::refuse_body(body);
            return Err(ConnectError::invalid("path is required").into());
        };
        let (f, len) = spooled(uploads::spool(dir, body, limit as u64).await)?;
        files.push((p, f, len));
    }
    if files.is_empty() {
        return Err(ConnectError::invalid("no file in the upload").into());
    }
    let mut out = Vec::with_capacity(files.len());
    for (p, file, len) in files {
        let path = super::guest_path(&p)?;
        let caller = rec.caller();
        let (i, gp) = (rec.id.clone(), path.clone());
        blocking(&state, move |rt| Ok(rt.write_file_from(&caller.tenant, &i, &gp, &file, len, &caller.quota())?))
            .await?;
        let name = path.rsplit('/').next().unwrap_or(&path).to_string();
        out.push(json!({ "name": name, "type": "file", "path": path }));
    }
    Ok(Json(out).into_response())
}

/// `GET /health`: 204 while the sandbox runs; 502 "not found" while it is paused.
async fn health(Extension(rec): Extension<Arc<SandboxRec>>) -> Response {
    if rec.lock().paused {
        return HttpError(ConnectError::sandbox_gone(&rec.id)).into_response();
    }
    StatusCode::NO_CONTENT.into_response()
}

pub(super) async fn health_route(rec: Extension<Arc<SandboxRec>>) -> Response {
    health(rec).await
}
