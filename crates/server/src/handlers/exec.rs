//! One-shot execs: `POST /v1/exec`, `POST /v1/exec/batch`.

use std::time::Instant;

use axum::extract::State;
use axum::Json;
use forkbox_runtime::Outcome;

use crate::error::{ApiError, ErrorBody};
use crate::extractors::ApiJson;
use crate::schema::*;
use crate::{metrics, AppState};

/// Fork the template, run the code, drop the fork.
#[utoipa::path(post, path = "/exec", tag = "exec", request_body = ExecRequest,
    responses((status = 200, description = "The result (a Python exception is a result with `error` set)", body = ExecResponse),
              (status = 408, description = "The code ran past its time limit", body = ErrorBody),
              (status = 422, description = "The code took the guest down", body = ErrorBody)))]
pub(crate) async fn exec(State(state): State<AppState>, ApiJson(req): ApiJson<ExecRequest>) -> Result<Json<ExecResponse>, ApiError> {
    let t0 = Instant::now();
    let req = state.runtime.oneshot(req.code, req.timeout_seconds)?;
    let permit = state.admission.acquire(1).await?;
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
    ApiJson(req): ApiJson<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let t0 = Instant::now();
    let reqs = state.runtime.batch(req.codes, req.timeout_seconds)?;
    let permit = state.admission.acquire(state.runtime.batch_parallelism(reqs.len())).await?;
    let results = state.runtime.exec_batch(reqs, permit).await;
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
