//! envd's HTTP routes: `GET /files?path=` (the bytes), `POST /files?path=`
//! (multipart with `file` parts, or a raw `application/octet-stream` body), and
//! `GET /health`. Files go through the session's VFS (never the host's file
//! system), within the server's file size limit; an upload is checkpointed.
//! Errors are envd's `{"code": <status>, "message"}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde_json::json;

use super::error::{Code, ConnectError};
use super::SandboxRec;
use crate::handlers::blocking;
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
/// (each named by `path`, or by its file name when there is no `path`).
async fn upload(
    State(state): State<AppState>,
    Extension(rec): Extension<Arc<SandboxRec>>,
    RawQuery(q): RawQuery,
    req: Request,
) -> Result<Response, HttpError> {
    super::process::running(&rec)?;
    let limit = state.config.files_limit;
    let path = params(q.as_deref())?;
    if let Some(enc) = req.headers().get(header::CONTENT_ENCODING) {
        if enc.as_bytes() != b"identity" {
            return Err(ConnectError::invalid("compressed uploads are not accepted (envd 0.4.0)").into());
        }
    }
    let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if ct.starts_with("multipart/") {
        let mut mp = Multipart::from_request(req, &state)
            .await
            .map_err(|e| ConnectError::invalid(format!("multipart body: {}", e.body_text())))?;
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large(limit)),
                Err(e) => return Err(ConnectError::invalid(format!("multipart body: {}", e.body_text())).into()),
            };
            if field.name() != Some("file") {
                continue;
            }
            let name = field.file_name().map(str::to_string);
            let data = match field.bytes().await {
                Ok(d) => d,
                Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large(limit)),
                Err(e) => return Err(ConnectError::invalid(format!("multipart body: {}", e.body_text())).into()),
            };
            let p = match (&path, name) {
                (Some(p), _) => p.clone(),
                (None, Some(n)) if !n.is_empty() => n,
                _ => return Err(ConnectError::invalid("a file part needs a file name, or the request a path").into()),
            };
            if files.len() >= MAX_PARTS {
                return Err(ConnectError::invalid(format!("at most {MAX_PARTS} files per upload")).into());
            }
            files.push((p, data));
        }
    } else {
        let p = path.ok_or_else(|| ConnectError::invalid("path is required"))?;
        let data = Bytes::from_request(req, &state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large(limit)
            } else {
                ConnectError::invalid(format!("reading the body: {}", rej.body_text())).into()
            }
        })?;
        files.push((p, data));
    }
    if files.is_empty() {
        return Err(ConnectError::invalid("no file in the upload").into());
    }
    let mut out = Vec::with_capacity(files.len());
    for (p, data) in files {
        let path = super::guest_path(&p)?;
        let caller = rec.caller();
        let (i, gp) = (rec.id.clone(), path.clone());
        blocking(&state, move |rt| Ok(rt.write_file(&caller.tenant, &i, &gp, &data, &caller.quota())?)).await?;
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
