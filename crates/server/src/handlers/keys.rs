//! API keys through the API (admin keys only): create one with its limits,
//! egress policy and secrets, list them, see one, replace its secrets, revoke
//! one. A key is named by its id, the SHA-256 of the key (hex), which is not a
//! credential; the key itself is shown once, when it is made. Secrets are
//! sealed before they are stored and shown as names and destinations only.

use std::collections::BTreeMap;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use forkbox_api::keys::{KeyLimitsView, NewKeyLimits, KEYS_PAGE_MAX};
use forkbox_api::ErrorCode;
use forkbox_runtime::keys::KeyRecord;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::health::admin_only;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{query_pairs, ApiJson, ApiPath};
use crate::quota::KeyLimits;
use crate::schema::{policy_of, seal_secrets, secret_infos, NetworkSetting, SecretInfo, SecretSpec};
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
    /// Its limits (as `forkbox key create`): those not given take the defaults.
    #[serde(default)]
    pub limits: NewKeyLimits,
    /// Its egress policy (as `network` of a session; `forkbox key create
    /// --egress`): a layer inside the server's that every sandbox of the key
    /// gets. Absent: the server's policy alone.
    pub egress: Option<NetworkSetting>,
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
    /// When it was made (Unix milliseconds).
    pub created_ms: i64,
    pub limits: KeyLimitsView,
    /// Its egress policy layer (`mode`, `allow`, `deny`); absent: the server's alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub egress: Option<serde_json::Value>,
}

impl KeyBody {
    fn of(rec: KeyRecord) -> KeyBody {
        let secrets: Vec<forkbox_runtime::net_secrets::SealedSecret> =
            rec.secrets.as_deref().and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default();
        let limit = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok());
        KeyBody {
            id: rec.hash,
            tenant: rec.tenant,
            admin: rec.admin,
            secrets: secret_infos(&secrets),
            created_ms: rec.created_ms,
            limits: KeyLimitsView {
                rate_limit: limit(rec.rate_limit).filter(|v| *v > 0),
                max_sessions: limit(rec.max_sessions).filter(|v| *v > 0),
                max_disk_mb: limit(rec.max_disk_mb).filter(|v| *v > 0),
                max_concurrency: limit(rec.max_concurrency),
                cpu_seconds_per_hour: limit(rec.cpu_seconds_per_hour).filter(|v| *v > 0),
                max_timeout_seconds: limit(rec.max_timeout_seconds).filter(|v| *v > 0),
            },
            egress: rec.egress.as_deref().and_then(|j| serde_json::from_str(j).ok()),
        }
    }
}

/// One page of the keys, in the order of their ids.
#[derive(Serialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<KeyBody>,
    /// The id to pass as `after` for the next page (null: this is the last).
    pub next: Option<String>,
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

/// Create an API key with its limits (those not given: the defaults, as
/// `forkbox key create`), egress policy and secrets.
#[utoipa::path(post, path = "/admin/keys", tag = "server", request_body = CreateKey,
    responses((status = 201, body = CreatedKey),
              (status = 400, description = "A bad tenant, limit, egress rule or secret", body = ErrorBody),
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
    let limits = key_limits(&req.limits, req.egress.as_ref())?;
    let secrets = seal_secrets(&req.secrets)?;
    let st = state.clone();
    let (tenant, admin) = (req.tenant, req.admin);
    let made = tokio::task::spawn_blocking(move || {
        let key = crate::keys::create_key_with_secrets(st.keys.db(), &tenant, &limits, admin, &secrets)?;
        let rec = st.keys.db().get(&crate::keys::hash_key(&key))?;
        anyhow::Ok((key, rec))
    })
    .await?
    .map_err(|e| ApiError::internal(format!("key store: {e}")))?;
    let (key, rec) = made;
    let rec = rec.ok_or_else(|| ApiError::internal("key store: the new key is not there"))?;
    Ok((StatusCode::CREATED, Json(CreatedKey { key, info: KeyBody::of(rec) })))
}

/// The limits of a new key from a request (400 if one is out of range).
fn key_limits(req: &NewKeyLimits, egress: Option<&NetworkSetting>) -> Result<KeyLimits, ApiError> {
    let base = if req.unlimited { KeyLimits::unlimited() } else { KeyLimits::defaults() };
    let egress = egress.map(|e| policy_of(e).map_err(|m| ApiError::invalid(format!("egress: {m}")))).transpose()?;
    let limits = KeyLimits {
        rate_limit: req.rate_limit.or(base.rate_limit),
        max_sessions: req.max_sessions.or(base.max_sessions),
        max_disk_mb: req.max_disk_mb.or(base.max_disk_mb),
        max_concurrency: req.max_concurrency.or(base.max_concurrency),
        cpu_seconds_per_hour: req.cpu_seconds_per_hour.or(base.cpu_seconds_per_hour),
        max_timeout_seconds: req.max_timeout_seconds.or(base.max_timeout_seconds),
        egress,
    };
    crate::keys::check_limits(&limits).map_err(|m| ApiError::invalid(format!("limits: {m}")))?;
    Ok(limits)
}

/// The keys, a page at a time in the order of their ids (never a key or a secret's value).
#[utoipa::path(get, path = "/admin/keys", tag = "server",
    params(("limit" = Option<usize>, Query, description = "Keys per page, 1 to 1000 (default 1000)"),
           ("after" = Option<String>, Query, description = "The keys after this id (`next` of the previous page)"),
           ("tenant" = Option<String>, Query, description = "Only the keys of this tenant")),
    responses((status = 200, body = KeyList),
              (status = 400, description = "A bad query parameter", body = ErrorBody),
              (status = 403, description = "Not an admin key", body = ErrorBody)))]
pub(crate) async fn list_keys(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> Result<Json<KeyList>, ApiError> {
    admin_only(&caller, "/v1/admin/keys")?;
    let (mut limit, mut after, mut tenant) = (KEYS_PAGE_MAX, String::new(), None);
    for (k, v) in query_pairs(q.as_deref())? {
        match k.as_str() {
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=KEYS_PAGE_MAX).contains(n))
                    .ok_or_else(|| ApiError::invalid(format!("limit: 1 to {KEYS_PAGE_MAX}")))?;
            }
            "after" if v.len() <= 64 && v.bytes().all(|b| b.is_ascii_hexdigit()) => after = v,
            "after" => return Err(ApiError::invalid("after: a key id (64 hex digits)")),
            "tenant" if crate::keys::valid_tenant(&v) => tenant = Some(v),
            "tenant" => return Err(ApiError::invalid("tenant: letters, digits, '-', '_', '.'; 1 to 64")),
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (limit, after, tenant)"))),
        }
    }
    let st = state.clone();
    let mut page = tokio::task::spawn_blocking(move || st.keys.db().page(&after, limit + 1, tenant.as_deref()))
        .await?
        .map_err(|e| ApiError::internal(format!("key store: {e}")))?;
    let more = page.len() > limit;
    page.truncate(limit);
    let next = if more { page.last().map(|k| k.hash.clone()) } else { None };
    Ok(Json(KeyList { keys: page.into_iter().map(KeyBody::of).collect(), next }))
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
    Ok(Json(KeyBody::of(rec)))
}

/// Replace a key's secrets. Every sandbox the key makes from now on gets the
/// new ones (at once on this server; within a second on the other nodes of a
/// cluster); sessions made before keep theirs.
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
    let st = state.clone();
    let rec = tokio::task::spawn_blocking(move || st.keys.set_secrets(&id, secrets))
        .await?
        .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        .ok_or_else(not_found)?;
    Ok(Json(KeyBody::of(rec)))
}

/// Revoke a key: it stops working at once on this server and within a second
/// on the other servers of its key store (the nodes of a cluster, a server
/// whose data directory `forkbox key revoke` changed). Its tenant's sessions,
/// templates and files stay: other keys of the tenant still reach them.
#[utoipa::path(delete, path = "/admin/keys/{id}", tag = "server",
    params(("id" = String, Path, description = "The key's id (SHA-256 of the key, hex)")),
    responses((status = 204, description = "Revoked"),
              (status = 403, description = "Not an admin key", body = ErrorBody),
              (status = 404, description = "No such key", body = ErrorBody)))]
pub(crate) async fn delete_key(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    admin_only(&caller, "/v1/admin/keys/{id}")?;
    let st = state.clone();
    let gone = tokio::task::spawn_blocking(move || st.keys.revoke(&id))
        .await?
        .map_err(|e| ApiError::internal(format!("key store: {e}")))?;
    if !gone {
        return Err(not_found());
    }
    Ok(StatusCode::NO_CONTENT)
}
