//! A session's files, through the engine's VFS (never the host file system):
//! - `PUT /v1/sessions/{id}/files/{*path}` raw body (at most `files_limit`) -> 201 `{path, size, checkpoint}`
//!   (the upload is checkpointed like an exec, code `# upload <path>`)
//! - `GET /v1/sessions/{id}/files/{*path}` -> the bytes (`application/octet-stream`)
//! - `GET /v1/sessions/{id}/files?dir=/output` -> `{files: [{name, path, size, is_dir, mtime_ms}]}` (default dir: the cwd)
//!
//! The URL's path is the guest path without its leading `/`: `files/output/plot.png` is `/output/plot.png`.
//! The engine resolves and checks it (`invalid_path`, `file_not_found`, `is_a_directory`, `file_too_large`).

use axum::body::Bytes;
use axum::extract::{FromRequest, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::{blocking, ApiPath, Caller};
use crate::error::ApiError;
use crate::{quota, AppState};

#[derive(Serialize, ToSchema)]
pub struct FileWritten {
    /// The guest path written.
    pub path: String,
    pub size: u64,
    /// Seq of the checkpoint that recorded the upload.
    pub checkpoint: i64,
}

#[derive(Serialize, ToSchema)]
pub struct FileEntryBody {
    pub name: String,
    /// Absolute guest path.
    pub path: String,
    pub size: u64,
    pub is_dir: bool,
    pub mtime_ms: i64,
}

#[derive(Serialize, ToSchema)]
pub struct FileList {
    pub files: Vec<FileEntryBody>,
}

/// A raw request body; over the route's limit is 413 `file_too_large`.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(req, state).await.map(RawBody).map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "file_too_large", "the upload is over the file size limit")
            } else {
                ApiError::invalid(format!("reading the request body: {}", rej.body_text()))
            }
        })
    }
}

fn guest_path(url_path: &str) -> String {
    format!("/{}", url_path.trim_start_matches('/'))
}

/// Write a file into the session (parents created, mode 0644); checkpointed.
#[utoipa::path(put, path = "/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = String, Path, description = "Session id"), ("path" = String, Path, description = "Guest path without its leading /")),
    request_body(content = String, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 201, body = FileWritten),
              (status = 409, description = "An exec is running in the session", body = crate::error::ErrorBody)))]
pub(crate) async fn put_file(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, path)): ApiPath<(String, String)>,
    RawBody(body): RawBody,
) -> Result<(StatusCode, Json<FileWritten>), ApiError> {
    let path = guest_path(&path);
    let v = blocking(&state, move |s| {
        quota::check_disk(s, &caller.tenant, caller.limits())?;
        let c = s.sessions.write_file(&caller.tenant, &id, &path, &body)?;
        Ok(FileWritten { path, size: body.len() as u64, checkpoint: c.seq })
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// A file of the session (at most the server's file size limit).
#[utoipa::path(get, path = "/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = String, Path, description = "Session id"), ("path" = String, Path, description = "Guest path without its leading /")),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream", body = String),
              (status = 409, description = "An exec is running in the session", body = crate::error::ErrorBody)))]
pub(crate) async fn get_file(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, path)): ApiPath<(String, String)>,
) -> Result<impl IntoResponse, ApiError> {
    let path = guest_path(&path);
    let data =
        blocking(&state, move |s| Ok(s.sessions.read_file(&caller.tenant, &id, &path, s.config.files_limit)?)).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data))
}

/// The entries of a directory of the session (`dir`, default: the guest's cwd).
#[utoipa::path(get, path = "/sessions/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Session id"), ("dir" = Option<String>, Query, description = "Guest directory, e.g. /output")),
    responses((status = 200, body = FileList),
              (status = 409, description = "An exec is running in the session", body = crate::error::ErrorBody)))]
pub(crate) async fn list_files(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<FileList>, ApiError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::invalid(format!("query string: {e}")))?;
    let mut dir = ".".to_string();
    for (k, v) in pairs {
        match k.as_str() {
            "dir" => dir = v,
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use dir=/path)"))),
        }
    }
    blocking(&state, move |s| {
        let files = s
            .sessions
            .list_files(&caller.tenant, &id, &dir)?
            .into_iter()
            .map(|e| FileEntryBody { name: e.name, path: e.path, size: e.size, is_dir: e.is_dir, mtime_ms: e.mtime_ms })
            .collect();
        Ok(Json(FileList { files }))
    })
    .await
}
