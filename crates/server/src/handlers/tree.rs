//! The tree of states: `GET /v1/sessions/{id}/tree`, `POST .../explore` (parallel
//! alternatives from a checkpoint), `GET .../checkpoints/{n}/variables` and
//! `GET .../diff?from=a&to=b` (bodies in `forkbox_api::wire::tree`), and the
//! history of calls (bodies defined here, beside their handlers).

use std::time::Instant;

use axum::extract::{RawQuery, State};
use axum::{Extension, Json};
use forkbox_runtime::{Keep, Outcome};
use serde::Serialize;
use utoipa::ToSchema;

use super::blocking;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extractors::{query_pairs, ApiJson, ApiPath};
use crate::fair::{acquire_for, batch_width};
use crate::quota;
use crate::schema::{
    BatchItemError, CheckpointFiles, DiffResponse, ExecResponse, ExecResponseOf, ExploreBranch, ExploreRequest,
    ExploreResponse, FileChangeBody, KeepMode, KeepSetting, PathCallBody, PyErrorBody, Tree, VariableBody,
    VariableChangeBody, VariablesResponse,
};
use crate::{metrics, AppState};

fn variable(v: &forkbox_runtime::Variable) -> VariableBody {
    VariableBody { name: v.name.clone(), kind: v.kind.clone(), repr: v.repr.clone(), size: v.size, len: v.len }
}

fn diff_body(d: &forkbox_runtime::Diff) -> DiffResponse {
    let calls = |v: &[forkbox_runtime::PathCall]| {
        v.iter().map(|c| PathCallBody { checkpoint: c.checkpoint, code: c.code.clone() }).collect()
    };
    DiffResponse {
        from: d.from,
        to: d.to,
        common: d.common,
        undone: calls(&d.undone),
        calls: calls(&d.calls),
        variables_added: d.variables_added.iter().map(variable).collect(),
        variables_removed: d.variables_removed.iter().map(variable).collect(),
        variables_changed: d
            .variables_changed
            .iter()
            .map(|c| VariableChangeBody {
                name: c.name.clone(),
                before: variable(&c.before),
                after: variable(&c.after),
            })
            .collect(),
        files_added: file_changes(&d.files_added),
        files_removed: file_changes(&d.files_removed),
        files_changed: file_changes(&d.files_changed),
        files_truncated: d.files_truncated,
    }
}

/// The session's tree: every checkpoint of its lineage with its code and result summary, the edges, and the sessions in it (the head marked).
#[utoipa::path(get, path = "/sessions/{id}/tree", tag = "sessions", params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = Tree)))]
pub(crate) async fn tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Tree>, ApiError> {
    blocking(&state, move |rt| Ok(Json(rt.tree(&caller.tenant, &id)?))).await
}

/// Run alternatives in parallel: one fork of the checkpoint (default: the head) per code, results in order.
/// Kept branches become sessions (tagged `explore.from`, `explore.checkpoint`, `explore.index`); the others
/// leave nothing behind. The session itself is not paused or changed, and may exec meanwhile.
#[utoipa::path(post, path = "/sessions/{id}/explore", tag = "sessions", request_body = ExploreRequest,
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, description = "One branch per code, in order", body = ExploreResponse),
              (status = 403, description = "Keeping the branches would pass the key's session quota (none is created)", body = ErrorBody)))]
pub(crate) async fn explore(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<ExploreRequest>,
) -> Result<Json<ExploreResponse>, ApiError> {
    let t0 = Instant::now();
    let keep = match req.keep {
        None | Some(KeepSetting::Mode(KeepMode::None)) => Keep::None,
        Some(KeepSetting::Mode(KeepMode::All)) => Keep::All,
        Some(KeepSetting::Indices(v)) => Keep::Some(v),
    };
    let c = caller.clone();
    let xreq = blocking(&state, move |rt| {
        crate::fair::key_timeout_of(rt, &c, req.timeout_seconds)?;
        Ok(rt.explore_request(&c.tenant, &id, req.checkpoint, req.codes, keep, req.timeout_seconds)?)
    })
    .await?;
    // Each branch is an exec: against the key's rate (the request itself already counted) and concurrency.
    if let Some(limiter) = caller.key.as_ref().and_then(|k| k.limiter.as_ref()) {
        limiter.check_n(xreq.len().saturating_sub(1) as u32).map_err(quota::rate_limited)?;
    }
    let width = batch_width(&state, &caller, xreq.len());
    let permit = acquire_for(&state, &caller, width).await?;
    let explored = state.runtime.explore(xreq, caller.quota(), width, permit).await?;
    let secs = t0.elapsed().as_secs_f64();
    let branches = explored
        .branches
        .into_iter()
        .enumerate()
        .map(|(index, b)| {
            metrics::exec("explore", Outcome::of(&b.result).as_str(), secs);
            match b.result {
                Ok(r) => {
                    let mut v = ExecResponse::of(&r);
                    v.checkpoint = b.checkpoint;
                    ExploreBranch { index, session: b.session, result: Some(Box::new(v)), failed: None }
                }
                Err(e) => {
                    let e = ApiError::from(e);
                    metrics::error(e.code.as_str());
                    ExploreBranch {
                        index,
                        session: b.session,
                        result: None,
                        failed: Some(BatchItemError { status: e.code.status(), error: e.detail() }),
                    }
                }
            }
        })
        .collect();
    metrics::sessions(state.runtime.resident_sessions());
    Ok(Json(ExploreResponse { from: explored.from, branches, total_time_ms: t0.elapsed().as_secs_f64() * 1000.0 }))
}

/// The user namespace at a checkpoint of the session's tree: names, types, short reprs, sizes; read in a throwaway fork.
/// With `files=true` also the checkpoint's files that are not the template's (a second throwaway fork, of the template, at once).
#[utoipa::path(get, path = "/sessions/{id}/checkpoints/{n}/variables", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), ("n" = i64, Path, description = "Checkpoint number"),
           ("files" = Option<bool>, Query, description = "Also list the files the calls up to it made (default false)")),
    responses((status = 200, body = VariablesResponse),
              (status = 422, description = "The namespace could not be read (`inspect_failed`)", body = ErrorBody)))]
pub(crate) async fn variables(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, n)): ApiPath<(String, i64)>,
    RawQuery(q): RawQuery,
) -> Result<Json<VariablesResponse>, ApiError> {
    let mut files = false;
    for (k, v) in query_pairs(q.as_deref())? {
        match (k.as_str(), v.as_str()) {
            ("files", "true") => files = true,
            ("files", "false") => files = false,
            ("files", _) => return Err(ApiError::invalid(format!("files: true or false, got {v:?}"))),
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use files=true)"))),
        }
    }
    let vars = |v: &forkbox_runtime::Variables| v.variables.iter().map(variable).collect();
    if !files {
        let permit = acquire_for(&state, &caller, 1).await?;
        let (checkpoint, v) = state.runtime.inspect(&caller.tenant, &id, Some(n), permit).await?;
        return Ok(Json(VariablesResponse { checkpoint, variables: vars(&v), omitted: v.omitted, files: None }));
    }
    let width = batch_width(&state, &caller, 2);
    let permit = acquire_for(&state, &caller, width).await?;
    let c = state.runtime.inspect_with_files(&caller.tenant, &id, Some(n), permit).await?;
    Ok(Json(VariablesResponse {
        checkpoint: c.checkpoint,
        variables: vars(&c.variables),
        omitted: c.variables.omitted,
        files: Some(CheckpointFiles {
            added: file_changes(&c.files_added),
            changed: file_changes(&c.files_changed),
            removed: file_changes(&c.files_removed),
            truncated: c.files_truncated,
        }),
    }))
}

fn file_changes(v: &[forkbox_runtime::FileChange]) -> Vec<FileChangeBody> {
    v.iter()
        .map(|f| FileChangeBody { path: f.path.clone(), size_before: f.size_before, size_after: f.size_after })
        .collect()
}

/// What changed between two checkpoints of the session's tree (`to` default: the head): variables, files and the calls on the path.
#[utoipa::path(get, path = "/sessions/{id}/diff", tag = "sessions",
    params(("id" = String, Path, description = "Session id"),
           ("from" = i64, Query, description = "Checkpoint number"),
           ("to" = Option<i64>, Query, description = "Checkpoint number (default: the head)")),
    responses((status = 200, body = DiffResponse),
              (status = 422, description = "A side could not be read (`inspect_failed`)", body = ErrorBody)))]
pub(crate) async fn diff(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<DiffResponse>, ApiError> {
    let (mut from, mut to) = (None, None);
    for (k, v) in query_pairs(q.as_deref())? {
        let n = v.parse::<i64>().map_err(|_| ApiError::invalid(format!("{k}: a checkpoint number, got {v:?}")))?;
        match k.as_str() {
            "from" => from = Some(n),
            "to" => to = Some(n),
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use from=N&to=M)"))),
        }
    }
    let from = from.ok_or_else(|| ApiError::invalid("from: a checkpoint number is required (diff?from=N[&to=M])"))?;
    // Both sides are read at once, on two exec threads.
    let width = batch_width(&state, &caller, 2);
    let permit = acquire_for(&state, &caller, width).await?;
    let d = state.runtime.diff(&caller.tenant, &id, from, to, permit).await?;
    Ok(Json(diff_body(&d)))
}

/// A file under `/output` a call created or changed (name and size; the bytes are in the session's files).
#[derive(Serialize, ToSchema)]
pub struct OutputFileMetaBody {
    pub path: String,
    pub size: u64,
    pub mime: String,
}

/// What a call showed, as kept with its checkpoint: at most 1 MiB of JSON a call (each text at most
/// 256 KiB, its head and tail; rich outputs in order while they fit), `truncated` when something was cut.
#[derive(Serialize, ToSchema)]
pub struct CallOutputBody {
    pub stdout: String,
    pub stderr: String,
    /// repr() of the last expression, if not None.
    pub value: Option<String>,
    /// The value's rich forms (MIME type -> data, as in an exec's result).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub value_data: Option<forkbox_runtime::MimeBundle>,
    /// What it displayed, in order, as MIME bundles (`image/png` base64, `text/html`, ...).
    #[schema(value_type = Vec<Object>)]
    pub display: Vec<forkbox_runtime::MimeBundle>,
    pub error: Option<PyErrorBody>,
    /// Files under `/output` it wrote.
    pub outputs: Vec<OutputFileMetaBody>,
    pub runtime_ms: f64,
    /// Something was cut or left out to keep within the bound.
    pub truncated: bool,
}

impl CallOutputBody {
    fn of(o: &forkbox_runtime::CallOutput) -> CallOutputBody {
        CallOutputBody {
            stdout: o.stdout.clone(),
            stderr: o.stderr.clone(),
            value: o.value.clone(),
            value_data: o.value_data.clone(),
            display: o.display.clone(),
            error: o.error.as_ref().map(|e| PyErrorBody {
                kind: e.kind.clone(),
                message: e.message.clone(),
                traceback: e.traceback.clone(),
            }),
            outputs: o
                .outputs
                .iter()
                .map(|f| OutputFileMetaBody { path: f.path.clone(), size: f.size, mime: f.mime.clone() })
                .collect(),
            runtime_ms: o.runtime_ms,
            truncated: o.truncated,
        }
    }
}

/// A call: the checkpoint it made and what it showed.
#[derive(Serialize, ToSchema)]
pub struct CallBody {
    pub checkpoint: i64,
    /// The parent's number (null: it ran on the template).
    pub parent: Option<i64>,
    /// The session that made it (it may since have been deleted).
    pub session: String,
    pub code: String,
    pub created_ms: i64,
    /// One line about the result.
    pub summary: Option<String>,
    /// Null: no output was recorded (an upload, a package install, a checkpoint from an older server).
    pub output: Option<CallOutputBody>,
}

impl CallBody {
    fn of(c: &forkbox_runtime::HistoryCall) -> CallBody {
        CallBody {
            checkpoint: c.checkpoint,
            parent: c.parent,
            session: c.session.clone(),
            code: c.code.clone(),
            created_ms: c.created_ms,
            summary: c.summary.clone(),
            output: c.output.as_ref().map(CallOutputBody::of),
        }
    }
}

/// A page of the calls from the template to the session's head.
#[derive(Serialize, ToSchema)]
pub struct HistoryResponse {
    pub session: String,
    /// The session's head (null: the template).
    pub head: Option<i64>,
    /// Calls on the whole path.
    pub total: usize,
    /// This page, oldest first: the newest calls before the cursor.
    pub calls: Vec<CallBody>,
    /// Older calls: pass this as `before` for the page before (null: this page starts at the template).
    pub before: Option<i64>,
}

/// The calls that made the session's current state: from the template to its head, oldest first, each with
/// its code and what it showed (stdout, stderr, value, rich outputs, exception) as kept with its checkpoint.
/// Paged from the head back: the newest `limit` calls (default 20, at most 100; at most 8 MiB of code and
/// output a page) before checkpoint `before`.
#[utoipa::path(get, path = "/sessions/{id}/history", tag = "sessions",
    params(("id" = String, Path, description = "Session id"),
           ("limit" = Option<usize>, Query, description = "Calls of this page (1 to 100, default 20)"),
           ("before" = Option<i64>, Query, description = "A checkpoint on the path: calls before it (the `before` of the previous page)")),
    responses((status = 200, body = HistoryResponse),
              (status = 400, description = "A bad `limit`, or `before` not on the path", body = ErrorBody),
              (status = 404, description = "`session_not_found`", body = ErrorBody)))]
pub(crate) async fn history(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath(id): ApiPath<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<HistoryResponse>, ApiError> {
    let (mut before, mut limit) = (None, None);
    for (k, v) in query_pairs(q.as_deref())? {
        match k.as_str() {
            "before" => {
                before = Some(
                    v.parse::<i64>()
                        .map_err(|_| ApiError::invalid(format!("before: a checkpoint number, got {v:?}")))?,
                )
            }
            "limit" => {
                limit = Some(v.parse::<usize>().map_err(|_| ApiError::invalid(format!("limit: a number, got {v:?}")))?)
            }
            _ => return Err(ApiError::invalid(format!("unknown query parameter {k:?} (use limit=N&before=M)"))),
        }
    }
    blocking(&state, move |rt| {
        let h = rt.history(&caller.tenant, &id, before, limit)?;
        Ok(Json(HistoryResponse {
            session: h.session,
            head: h.head,
            total: h.total,
            calls: h.calls.iter().map(CallBody::of).collect(),
            before: h.before,
        }))
    })
    .await
}

/// One checkpoint of the session's tree: its code and the full output of the call that made it.
#[utoipa::path(get, path = "/sessions/{id}/checkpoints/{n}", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), ("n" = i64, Path, description = "Checkpoint number")),
    responses((status = 200, body = CallBody),
              (status = 404, description = "`session_not_found`, `checkpoint_not_found`", body = ErrorBody)))]
pub(crate) async fn checkpoint(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiPath((id, n)): ApiPath<(String, i64)>,
) -> Result<Json<CallBody>, ApiError> {
    blocking(&state, move |rt| Ok(Json(CallBody::of(&rt.checkpoint_call(&caller.tenant, &id, n)?)))).await
}
