//! One-shot execs: `POST /v1/exec`, `POST /v1/exec/batch`.

use std::time::Instant;

use axum::extract::State;
use axum::{Extension, Json};
use forkbox_runtime::Outcome;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::ApiJson;
use crate::fair::{acquire_for, batch_width, key_timeout};
use crate::quota;
use crate::schema::*;
use crate::{metrics, AppState};

/// Fork the template, run the code, drop the fork.
#[utoipa::path(post, path = "/exec", tag = "exec", request_body = ExecRequest,
    responses((status = 200, description = "The result (a Python exception is a result with `error` set)", body = ExecResponse),
              (status = 408, description = "The code ran past its time limit", body = ErrorBody),
              (status = 422, description = "The code took the guest down", body = ErrorBody)))]
pub(crate) async fn exec(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let t0 = Instant::now();
    let timeout = key_timeout(&state, &caller, req.timeout_seconds)?;
    super::wait_for_template(&state, &caller.tenant, req.template.as_deref()).await?;
    let req = state.runtime.oneshot(
        &caller.tenant,
        req.code,
        timeout,
        req.template.as_deref(),
        &network_layers(&caller, &req.network)?,
        &caller.key_secrets(),
    )?;
    let permit = acquire_for(&state, &caller, 1).await?;
    let r = state.runtime.exec(req, None, permit).await;
    metrics::exec("oneshot", Outcome::of(&r).as_str(), t0.elapsed().as_secs_f64());
    let o = r?;
    metrics::fork(o.fork_ms / 1000.0);
    Ok(Json(ExecResponse::of_oneshot(&o, t0)))
}

/// Each code in its own fork, in parallel. `results[i]` is the result of
/// `codes[i]`, or `{"status", "error": {"code", "message"}}` if that exec failed.
#[utoipa::path(post, path = "/exec/batch", tag = "exec", request_body = BatchRequest,
    responses((status = 200, description = "One item per code, in order", body = BatchResponse)))]
pub(crate) async fn exec_batch(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let t0 = Instant::now();
    let timeout = key_timeout(&state, &caller, req.timeout_seconds)?;
    let reqs = state.runtime.batch(
        &caller.tenant,
        req.codes,
        timeout,
        req.template.as_deref(),
        &network_layers(&caller, &None)?,
        &caller.key_secrets(),
    )?;
    // Each exec of the batch counts against the key's rate (the request itself already did).
    if let Some(limiter) = caller.key.as_ref().and_then(|k| k.limiter.as_ref()) {
        limiter.check_n(reqs.len().saturating_sub(1) as u32).map_err(quota::rate_limited)?;
    }
    // ... and against its concurrency: the batch runs on as many threads as it holds slots.
    let width = batch_width(&state, &caller, reqs.len());
    let permit = acquire_for(&state, &caller, width).await?;
    let results = state.runtime.exec_batch(reqs, width, permit).await;
    let secs = t0.elapsed().as_secs_f64();
    let out = results
        .into_iter()
        .map(|r| {
            metrics::exec("batch", Outcome::of(&r).as_str(), secs);
            match r {
                Ok(r) => BatchItem::Ok(Box::new(ExecResponse::of(&r))),
                Err(e) => {
                    let e = ApiError::from(e);
                    metrics::error(e.code.as_str());
                    BatchItem::Failed(BatchItemError { status: e.code.status(), error: e.detail() })
                }
            }
        })
        .collect();
    Ok(Json(BatchResponse { results: out, total_time_ms: t0.elapsed().as_secs_f64() * 1000.0 }))
}
