//! Who a request acts for: `Authorization: Bearer <key>` on the `/v1` routes
//! (and `/mcp`), looked up in the key store (cached), its rate limit checked;
//! or the fixed tenant of an embedded router.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use forkbox_runtime::Quota;

use crate::error::ApiError;
use crate::keys::KeyInfo;
use crate::quota::{self, KeyLimits};
use crate::AppState;

/// Who a request acts for: the tenant of its API key (and the key's limits),
/// or the fixed tenant of an embedded router (no limits).
#[derive(Clone)]
pub struct Caller {
    pub tenant: String,
    pub key: Option<Arc<KeyInfo>>,
}

impl Caller {
    pub fn limits(&self) -> Option<&KeyLimits> {
        self.key.as_ref().map(|k| &k.limits)
    }

    /// The secrets of the caller's key (none for an embedded router's caller).
    pub fn key_secrets(&self) -> std::sync::Arc<Vec<forkbox_runtime::net_secrets::SealedSecret>> {
        self.key.as_ref().map(|k| k.secrets()).unwrap_or_default()
    }

    /// The session and disk quota the runtime enforces for this caller.
    pub fn quota(&self) -> Quota {
        self.limits().map(KeyLimits::quota).unwrap_or_default()
    }

    /// 429 if the caller's key is over its requests/s (what the middleware checks per request).
    pub fn check_rate(&self) -> Result<(), ApiError> {
        match self.key.as_ref().and_then(|k| k.limiter.as_ref()) {
            Some(limiter) => limiter.check().map_err(quota::rate_limited),
            None => Ok(()),
        }
    }
}

/// The middleware: a [`Caller`] into the request's extensions, or 401 / 429.
pub(crate) async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Result<Response, ApiError> {
    let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::trim);
    let Some(key) = header.and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer "))).map(str::trim)
    else {
        return Err(ApiError::unauthorized("missing API key: send `Authorization: Bearer <key>`"));
    };
    let caller = caller_for_key(&state, key).await?;
    req.extensions_mut().insert(caller);
    Ok(next.run(req).await)
}

/// The caller an API key stands for (401 if unknown), its rate limit checked (429).
pub(crate) async fn caller_for_key(state: &AppState, key: &str) -> Result<Caller, ApiError> {
    let info = match state.keys.cached(key) {
        Some(t) => Some(t),
        None => {
            let st = state.clone();
            let k = key.to_string();
            tokio::task::spawn_blocking(move || st.keys.lookup(&k))
                .await?
                .map_err(|e| ApiError::internal(format!("key store: {e}")))?
        }
    };
    let Some(info) = info else { return Err(ApiError::unauthorized("unknown API key")) };
    let caller = Caller { tenant: info.tenant.clone(), key: Some(info) };
    caller.check_rate()?;
    Ok(caller)
}
