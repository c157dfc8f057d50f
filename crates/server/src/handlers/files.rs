//! A session's files, through the engine's VFS (never the host file system):
//! - `PUT /v1/sessions/{id}/files/{*path}` raw body (at most `files_limit`) -> 201 `{path, size, checkpoint}`
//!   (the upload is checkpointed like an exec, code `# upload <path>`)
//! - `GET /v1/sessions/{id}/files/{*path}` -> the bytes (`application/octet-stream`)
//! - `GET /v1/sessions/{id}/files?dir=/output` -> `{files: [{name, path, size, is_dir, mtime_ms}]}` (default dir: the cwd)
//!
//! The URL's path is the guest path without its leading `/`: `files/output/plot.png` is `/output/plot.png`.
//! The engine resolves and checks it (`invalid_path`, `file_not_found`, `is_a_directory`, `file_too_large`).

use axum::extract::{RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::{Extension, Json};
use forkbox_api::ErrorCode;

use super::blocking;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extractors::{query_pairs, ApiPath};
use crate::uploads;
use crate::AppState;
pub use forkbox_api::wire::files::*;

fn guest_path(url_path: &str) -> String {
    format!("/{}", url_path.trim_start_matches('/'))
}

/// 400 `invalid_path` for a `..` component: the URL names the file as it is,
/// never relative to something above it (a proxy or a forward would resolve it differently).
pub(crate) fn check_url_path(url_path: &str) -> Result<(), ApiError> {
    if url_path.split('/').any(|c| c == "..") {
        return Err(ApiError::new(ErrorCode::InvalidPath, "a file path may not contain `..` components"));
    }
    Ok(())
}

/// Write a file into the session (parents created, mode 0644); checkpointed.
/// The body is streamed to a temporary file (the size limit checked as it
/// arrives) and from there into the sandbox, a chunk at a time.
#[utoipa::path(put, path = "/sessions/{id}/files/{*path}", tag = "files",
    params(("id" = String, Path, description = "Session id"), ("path" = String, Path, description = "Guest path without its leading /")),
    request_body(content = String, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 201, body = FileWritten),
              (status = 400, description = "`invalid_path`: `..` in the path, or a path under /proc, /sys or /dev", body = crate::error::ErrorBody),
              (status = 409, description = "An exec is running in the session", body = crate::error::ErrorBody),
              (status = 413, description = "`file_too_large`: over the file size limit", body = crate::error::ErrorBody),
              (status = 429, description = "`rate_limited`: the key has its most uploads in progress", body = crate::error::ErrorBody)))]
pub(crate) async fn put_file(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, path)): ApiPath<(String, String)>,
    req: Request,
) -> Result<(StatusCode, Json<FileWritten>), ApiError> {
    check_url_path(&path)?;
    let path = guest_path(&path);
    let (parts, body) = req.into_parts();
    // Received already by a cluster's forwarding layer, or here.
    let upload = match parts.extensions.get::<uploads::Spooled>().cloned() {
        Some(u) => u,
        None => uploads::receive(&state, &parts.headers, Some(&caller), body).await?,
    };
    let v = blocking(&state, move |rt| {
        let len = upload.len;
        let checkpoint = rt.write_file_from(&caller.tenant, &id, &path, &upload.file, len, &caller.quota())?;
        Ok(FileWritten { path, size: len, checkpoint })
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
    check_url_path(&path)?;
    let path = guest_path(&path);
    let max = state.config.files_limit;
    let data = blocking(&state, move |rt| Ok(rt.read_file(&caller.tenant, &id, &path, max)?)).await?;
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
    let mut dir = ".".to_string();
    for (k, v) in query_pairs(q.as_deref())? {
        match k.as_str() {
            "dir" => dir = v,
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use dir=/path)"))),
        }
    }
    blocking(&state, move |rt| {
        let files = rt
            .list_files(&caller.tenant, &id, &dir)?
            .into_iter()
            .map(|e| FileEntryBody { name: e.name, path: e.path, size: e.size, is_dir: e.is_dir, mtime_ms: e.mtime_ms })
            .collect();
        Ok(Json(FileList { files }))
    })
    .await
}
