//! Templates: list them, build one (asynchronous), make one of a checkpoint.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{ApiJson, ApiPath};
use crate::schema::*;
use crate::AppState;

/// The templates the caller may use: shipped ones (built on first use: a request
/// naming one that is not built yet gets 409 `template_not_ready` while it
/// builds), the server's shared ones and the caller's own.
#[utoipa::path(get, path = "/templates", tag = "templates",
    responses((status = 200, description = "Every template the caller may use and its state", body = TemplateList)))]
pub(crate) async fn templates(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Json<TemplateList> {
    let rt = state.runtime.clone();
    let list = tokio::task::spawn_blocking(move || rt.templates(&caller.tenant)).await.unwrap_or_default();
    Json(TemplateList {
        default: state.runtime.default_template(),
        templates: list.into_iter().map(TemplateBody::from).collect(),
    })
}

/// Build a template of the caller's own (visible to it only) from Debian packages,
/// pip packages (binary wheels, from the server's index or wheelhouse) and a
/// preload. Asynchronous: 202 with `status: building`; poll `GET /v1/templates/{name}`.
#[utoipa::path(post, path = "/templates", tag = "templates", request_body = CreateTemplateRequest,
    responses((status = 202, description = "The build started", body = TemplateBody),
              (status = 400, description = "A bad name, package or pip spec", body = ErrorBody),
              (status = 409, description = "The name exists (`template_exists`)", body = ErrorBody),
              (status = 429, description = "Too many builds pending (`too_many_builds`)", body = ErrorBody)))]
pub(crate) async fn create_template(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<CreateTemplateRequest>,
) -> Result<(StatusCode, Json<TemplateBody>), ApiError> {
    let blas = match req.blas.as_deref() {
        None => forkbox_runtime::Blas::Reference,
        Some(b) => forkbox_runtime::Blas::parse(b).ok_or_else(|| {
            ApiError::new(
                forkbox_api::ErrorCode::InvalidRequest,
                format!("unknown blas {b:?} (reference, openblas, any)"),
            )
        })?,
    };
    let network = crate::schema::network_policy(&req.network)?;
    let secrets = crate::schema::seal_secrets(&req.secrets)?;
    let t = forkbox_runtime::CustomTemplate {
        name: req.name,
        apt: req.apt,
        pip: req.pip,
        preload: req.preload,
        blas,
        network,
        secrets,
    };
    let v = blocking(&state, move |rt| Ok(TemplateBody::from(rt.create_template(&caller.tenant, &t)?))).await?;
    Ok((StatusCode::ACCEPTED, Json(v)))
}

/// One template and its state (`building` with its step and seconds, `ready`, `failed` with why).
#[utoipa::path(get, path = "/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 200, body = TemplateBody), (status = 404, description = "No such template for this caller", body = ErrorBody)))]
pub(crate) async fn get_template(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<TemplateBody>, ApiError> {
    blocking(&state, move |rt| Ok(Json(TemplateBody::from(rt.template_listing(&caller.tenant, &name)?)))).await
}

/// A template of the caller's own made of a checkpoint of one of its sessions:
/// one-shot execs and new sessions on it start with that state (variables,
/// imports, loaded data, files). Self-contained: it outlives the session.
#[utoipa::path(post, path = "/sessions/{id}/checkpoints/{n}/template", tag = "templates", request_body = CheckpointTemplateRequest,
    params(("id" = String, Path, description = "Session id"), ("n" = i64, Path, description = "Checkpoint seq")),
    responses((status = 201, body = TemplateBody),
              (status = 404, description = "No such session or checkpoint", body = ErrorBody),
              (status = 409, description = "The name exists (`template_exists`)", body = ErrorBody)))]
pub(crate) async fn checkpoint_template(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, n)): ApiPath<(String, i64)>,
    ApiJson(req): ApiJson<CheckpointTemplateRequest>,
) -> Result<(StatusCode, Json<TemplateBody>), ApiError> {
    let v = blocking(&state, move |rt| {
        Ok(TemplateBody::from(rt.checkpoint_template(&caller.tenant, &id, n, &req.name)?))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}
