//! API keys through the API (admin keys only): create one with its secrets,
//! see one, replace its secrets. A key is named by its id, the SHA-256 of the
//! key (hex), which is not a credential; the key itself is shown once, when
//! it is made. Secrets are sealed before they are stored and shown as names
//! and destinations only.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use forkbox_api::ErrorCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::health::admin_only;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{ApiJson, ApiPath};
use crate::quota::KeyLimits;
use crate::schema::{seal_secrets, secret_infos, SecretInfo, SecretSpec};
use crate::AppState;

/// `POST /v1/admin/keys`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    /// The key's tenant (letters, digits, `-_.`; at most 64; default `default`).
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// An admin key (may read `/metrics` and the admin routes).
    #[serde(default)]
    pub admin: bool,
    /// Secrets every sandbox of the key gets (as `secrets` of a session, at
    /// most 16): one-shot execs, sessions, E2B sandboxes, ForeverVM machines.
    #[serde(default)]
    pub secrets: BTreeMap<String, SecretSpec>,
}

fn default_tenant() -> String {
    "default".into()
}

/// `PATCH /v1/admin/keys/{id}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchKey {
    /// The key's secrets from now on (all of them: `{}` removes every one).
    /// New sandboxes of the key get them; running sessions keep the ones they were made with.
    pub secrets: BTreeMap<String, SecretSpec>,
}

/// A key as the admin routes show it: never its value or its secrets' values.
#[derive(Serialize, ToSchema)]
pub struct KeyBody {
    /// SHA-256 of the key (hex): what the admin routes name it by.
    pub id: String,
    pub tenant: String,
    pub admin: bool,
    pub secrets: Vec<SecretInfo>,
}

/// A new key: the key itself, shown this once.
#[derive(Serialize, ToSchema)]
pub struct CreatedKey {
    /// `fbk_...`: only its SHA-256 is stored.
    pub key: String,
    #[serde(flatten)]
    pub info: KeyBody,
}

fn not_found() -> ApiError {
    ApiError::new(ErrorCode::KeyNotFound, "no such key")
}

/// Create an API key (the default per-key limits, as `forkbox key create`) with its secrets.
#[utoipa::path(post, path = "/admin/keys", tag = "server", request_body = CreateKey,
    responses((status = 201, body = CreatedKey),
              (status = 400, description = "A bad tenant or secret", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody)))]
pub(crate) async fn create_key(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<CreateKey>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    admin_only(&caller, "/v1/admin/keys")?;
    if !crate::keys::valid_tenant(&req.tenant) {
        return Err(ApiError::invalid("tenant: letters, digits, '-', '_', '.'; 1 to 64"));
    }
    let secrets = seal_secrets(&req.secrets)?;
    let st = state.clone();
    let (tenant, admin) = (req.tenant, req.admin);
    let shown = secret_infos(&secrets);
    let key = tokio::task::spawn_blocking(move || {
        crate::keys::create_key_with_secrets(st.keys.db(), &tenant, &KeyLimits::defaults(), admin, &secrets)
            .map(|k| (k, tenant))
    })
    .await?
    .map_err(|e| ApiError::internal(format!("key store: {e}")))?;
    let (key, tenant) = key;
    let info = KeyBody { id: crate::keys::hash_key(&key), tenant, admin, secrets: shown };
    Ok((StatusCode::CREATED, Json(CreatedKey { key, info })))
}

/// A key by its id.
#[utoipa::path(get, path = "/admin/keys/{id}", tag = "server",
    params(("id" = String, Path, description = "The key's id (SHA-256 of the key, hex)")),
    responses((status = 200, body = KeyBody),
              (status = 403, description = "Not an admin key", body = ErrorBody),
              (status = 404, description = "No such key", body = ErrorBody)))]
pub(crate) async fn get_key(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<KeyBody>, ApiError> {
    admin_only(&caller, "/v1/admin/keys/{id}")?;
    let st = state.clone();
    let rec = tokio::task::spawn_blocking(move || st.keys.db().get(&id))
        .await?
        .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        .ok_or_else(not_found)?;
    let secrets: Vec<forkbox_runtime::net_secrets::SealedSecret> =
        rec.secrets.as_deref().and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default();
    Ok(Json(KeyBody { id: rec.hash, tenant: rec.tenant, admin: rec.admin, secrets: secret_infos(&secrets) }))
}

/// Replace a key's secrets. Every sandbox the key makes from now on gets the
/// new ones (at once on this server; another node of a cluster that has the
/// key cached sees them after its restart); sessions made before keep theirs.
#[utoipa::path(patch, path = "/admin/keys/{id}", tag = "server", request_body = PatchKey,
    params(("id" = String, Path, description = "The key's id (SHA-256 of the key, hex)")),
    responses((status = 200, body = KeyBody),
              (status = 400, description = "A bad secret", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody),
              (status = 404, description = "No such key", body = ErrorBody)))]
pub(crate) async fn patch_key(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<PatchKey>,
) -> Result<Json<KeyBody>, ApiError> {
    admin_only(&caller, "/v1/admin/keys/{id}")?;
    let secrets = seal_secrets(&req.secrets)?;
    let shown = secret_infos(&secrets);
    let st = state.clone();
    let rec = tokio::task::spawn_blocking(move || st.keys.set_secrets(&id, secrets))
        .await?
        .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        .ok_or_else(not_found)?;
    Ok(Json(KeyBody { id: rec.hash, tenant: rec.tenant, admin: rec.admin, secrets: shown }))
}
