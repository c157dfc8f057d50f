//! The tree of states: one session's lineage as nodes and edges, parallel
//! alternatives from a checkpoint (explore), and the variables and differences
//! of checkpoints, each computed in throwaway forks so the session never pauses.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use forkbox_api::wire::tree::{Tree, TreeEdge, TreeNode, TreeSession};
use forkbox_engine::ExecOptions;
use forkbox_sessions::manager::{Diff, FileChange, SessionError, Variables};
use forkbox_sessions::output::CallOutput;
use forkbox_sessions::store::CheckpointRecord;

use crate::exec::batch_output_limit;
use crate::{ExecResult, Quota, Runtime, RuntimeError};

/// A checkpoint's variables and the files its lineage's calls made (see [`Runtime::inspect_with_files`]).
#[derive(Debug, Clone)]
pub struct CheckpointContents {
    pub checkpoint: Option<i64>,
    pub variables: Variables,
    /// Files that the template does not have.
    pub files_added: Vec<FileChange>,
    /// Files of the template with other contents here.
    pub files_changed: Vec<FileChange>,
    /// Files of the template that are gone here.
    pub files_removed: Vec<FileChange>,
    /// A walk stopped at its bound: the lists may be incomplete.
    pub files_truncated: bool,
}

/// Which branches of an explore become sessions.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Keep {
    #[default]
    None,
    All,
    Some(Vec<usize>),
}

/// Most codes in one explore.
pub const EXPLORE_MAX: usize = 64;

/// Longest code shown per node of a tree and per call of a diff (bytes; the rest is cut
/// with a note): a tree of many checkpoints, each up to the code limit, stays small.
pub const TREE_CODE_MAX: usize = 4096;

fn cut_code(code: &str) -> String {
    if code.len() <= TREE_CODE_MAX {
        return code.to_string();
    }
    let mut end = TREE_CODE_MAX;
    while !code.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n# [forkbox: code cut, {} bytes in all]", &code[..end], code.len())
}

/// The outcome of one branch of an explore.
#[derive(Debug)]
pub struct Branch {
    pub result: Result<ExecResult, RuntimeError>,
    /// The kept branch's session (None: dropped).
    pub session: Option<String>,
    /// The checkpoint the kept branch's exec made.
    pub checkpoint: Option<i64>,
}

/// An explore's results, in the order of its codes.
#[derive(Debug)]
pub struct Explored {
    /// The checkpoint every branch started from (None: the template).
    pub from: Option<i64>,
    pub branches: Vec<Branch>,
}

/// A validated explore (see [`Runtime::explore_request`]).
pub struct ExploreRequest {
    tenant: String,
    source: forkbox_sessions::store::SessionRecord,
    from: Option<CheckpointRecord>,
    codes: Vec<String>,
    keep: Vec<bool>,
    timeout: Option<Duration>,
}

impl ExploreRequest {
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    pub fn kept(&self) -> usize {
        self.keep.iter().filter(|k| **k).count()
    }
}

impl Runtime {
    /// The tree of the session's lineage, its head marked: the API's body
    /// (`forkbox_api::wire::tree::Tree`), parents before children.
    pub fn tree(&self, tenant: &str, id: &str) -> Result<Tree, RuntimeError> {
        let (rec, tree) = self.sessions.tree(tenant, id)?;
        let seq_of: HashMap<i64, i64> = tree.checkpoints.iter().map(|c| (c.id, c.seq)).collect();
        let mut heads: HashMap<i64, Vec<String>> = HashMap::new();
        for s in &tree.sessions {
            if let Some(h) = s.head {
                heads.entry(h).or_default().push(s.id.clone());
            }
        }
        let nodes: Vec<TreeNode> = tree
            .checkpoints
            .iter()
            .map(|c| {
                let heads = heads.remove(&c.id).unwrap_or_default();
                TreeNode {
                    checkpoint: c.seq,
                    parent: c.parent.and_then(|p| seq_of.get(&p).copied()),
                    session: c.session_id.clone(),
                    code: cut_code(&c.code),
                    created_ms: c.created_ms,
                    summary: c.summary.clone(),
                    bytes: c.bytes,
                    pages: c.pages,
                    head: heads.contains(&rec.id),
                    heads,
                }
            })
            .collect();
        let edges =
            nodes.iter().filter_map(|n| n.parent.map(|p| TreeEdge { parent: p, child: n.checkpoint })).collect();
        let sessions = tree
            .sessions
            .iter()
            .map(|s| TreeSession {
                id: s.id.clone(),
                head: s.head.and_then(|h| seq_of.get(&h).copied()),
                forked_at: s.origin.and_then(|h| seq_of.get(&h).copied()),
                created_ms: s.created_ms,
            })
            .collect();
        Ok(Tree { session: rec.id, head: rec.head.and_then(|h| seq_of.get(&h).copied()), nodes, edges, sessions })
    }

    /// Check an explore: 1 to [`EXPLORE_MAX`] codes (each within the code limit), `keep`
    /// indices in range and distinct, the checkpoint (default: the head) of the session,
    /// `timeout_seconds` within the session's limit. Blocking.
    pub fn explore_request(
        &self,
        tenant: &str,
        id: &str,
        checkpoint: Option<i64>,
        codes: Vec<String>,
        keep: Keep,
        timeout_seconds: Option<f64>,
    ) -> Result<ExploreRequest, RuntimeError> {
        let n = codes.len();
        let max = EXPLORE_MAX.min(self.config.max_batch.max(1));
        if n == 0 || n > max {
            return Err(RuntimeError::Invalid(format!("codes must hold 1 to {max} items, got {n}")));
        }
        for c in &codes {
            self.check_code(c)?;
        }
        let mut kept = vec![false; n];
        match &keep {
            Keep::None => {}
            Keep::All => kept.iter_mut().for_each(|k| *k = true),
            Keep::Some(ix) => {
                for &i in ix {
                    match kept.get_mut(i) {
                        Some(k) if !*k => *k = true,
                        Some(_) => return Err(RuntimeError::Invalid(format!("keep: index {i} is given twice"))),
                        None => {
                            return Err(RuntimeError::Invalid(format!(
                                "keep: index {i} is out of range (there are {n} codes)"
                            )))
                        }
                    }
                }
            }
        }
        let timeout = self.session_exec_timeout(tenant, id, timeout_seconds)?;
        let (source, from) = self.sessions.checkpoint_or_head(tenant, id, checkpoint)?;
        Ok(ExploreRequest { tenant: tenant.to_string(), source, from, codes, keep: kept, timeout })
    }

    /// Run each code of `req` in its own fork of the checkpoint, on `parallel` exec
    /// threads (the caller holds that many slots; `hold` is dropped once all are
    /// done). Kept branches become sessions tagged with their origin
    /// (`explore.from` = source session, `explore.checkpoint`, `explore.index`),
    /// counted against `quota` (all or none are created); the rest are forks that
    /// leave nothing behind. The source session is never paused or changed.
    pub async fn explore(
        self: &Arc<Self>,
        req: ExploreRequest,
        quota: Quota,
        parallel: usize,
        hold: impl Send + Sync + 'static,
    ) -> Result<Explored, RuntimeError> {
        let rt = self.clone();
        let n = req.codes.len();
        // Quotas and the kept sessions first, before anything runs.
        let req = Arc::new(req);
        let prep = {
            let (rt, req) = (rt.clone(), req.clone());
            tokio::task::spawn_blocking(move || -> Result<Vec<Option<String>>, RuntimeError> {
                rt.check_disk(&req.tenant, &quota)?;
                let kept = req.kept();
                if kept == 0 {
                    return Ok(vec![None; n]);
                }
                let _g = rt.create_lock.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(max) = quota.max_sessions {
                    let have = rt.sessions.count(Some(&req.tenant))?;
                    if have.saturating_add(kept as u64) > max {
                        return Err(RuntimeError::QuotaExceeded(format!(
                            "keeping {kept} branches needs {kept} new sessions; this API key allows {max} sessions and {have} exist"
                        )));
                    }
                }
                let from = req.from.as_ref().map(|c| c.id);
                let mut ids = Vec::with_capacity(n);
                for (i, keep) in req.keep.iter().enumerate() {
                    if !keep {
                        ids.push(None);
                        continue;
                    }
                    let mut tags = BTreeMap::new();
                    tags.insert("explore.from".to_string(), req.source.id.clone());
                    tags.insert(
                        "explore.checkpoint".to_string(),
                        req.from.as_ref().map_or("none".into(), |c| c.seq.to_string()),
                    );
                    tags.insert("explore.index".to_string(), i.to_string());
                    match rt.sessions.fork_at(&req.tenant, &req.source, from, tags) {
                        Ok(r) => ids.push(Some(r.id)),
                        Err(e) => {
                            // All or none: drop the ones made so far.
                            for id in ids.into_iter().flatten() {
                                let _ = rt.sessions.delete(&req.tenant, &id);
                            }
                            return Err(e.into());
                        }
                    }
                }
                Ok(ids)
            })
        };
        let ids = prep.await.map_err(|_| RuntimeError::WorkerGone)??;
        let parallel = parallel.clamp(1, self.batch_parallelism(n));
        let output_bytes = batch_output_limit(self.config.limits.output_bytes, n);
        let ids = Arc::new(ids);
        let next = Arc::new(AtomicUsize::new(0));
        let results: Arc<Vec<Mutex<Option<Branch>>>> = Arc::new((0..n).map(|_| Mutex::new(None)).collect());
        let hold = Arc::new(hold);
        let mut done = Vec::with_capacity(parallel);
        for _ in 0..parallel {
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            done.push(rx);
            let (rt, req, ids, next, results, hold) =
                (rt.clone(), req.clone(), ids.clone(), next.clone(), results.clone(), hold.clone());
            self.workers.spawn(move || {
                let _hold = hold;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let (Some(code), Some(kept)) = (req.codes.get(i), ids.get(i)) else { break };
                    let branch = match kept {
                        Some(sid) => {
                            let opts = ExecOptions { timeout: req.timeout, ..ExecOptions::default() };
                            match rt.sessions.exec_with(&req.tenant, sid, code, opts) {
                                Ok(o) => Branch {
                                    result: Ok(o.result),
                                    session: Some(sid.clone()),
                                    checkpoint: Some(o.checkpoint.seq),
                                },
                                Err(e) => {
                                    Branch { result: Err(e.into()), session: Some(sid.clone()), checkpoint: None }
                                }
                            }
                        }
                        None => {
                            let from = req.from.as_ref().map(|c| c.id);
                            let r =
                                rt.sessions.exec_throwaway(&req.source, from, code, req.timeout, Some(output_bytes));
                            Branch { result: r.map_err(RuntimeError::from), session: None, checkpoint: None }
                        }
                    };
                    if let Some(slot) = results.get(i) {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(branch);
                    }
                }
                let _ = tx.send(());
            });
        }
        for rx in done {
            let _ = rx.await;
        }
        let branches = (0..n)
            .map(|i| {
                results.get(i).and_then(|m| m.lock().unwrap_or_else(|e| e.into_inner()).take()).unwrap_or(Branch {
                    result: Err(RuntimeError::WorkerGone),
                    session: ids.get(i).cloned().flatten(),
                    checkpoint: None,
                })
            })
            .collect();
        Ok(Explored { from: req.from.as_ref().map(|c| c.seq), branches })
    }

    /// The user namespace at checkpoint `seq` of the session's lineage (None: its
    /// head): names, types, short reprs, sizes, read in a throwaway fork. Runs on an
    /// exec thread; `hold` is dropped after.
    pub async fn inspect(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        seq: Option<i64>,
        hold: impl Send + 'static,
    ) -> Result<(Option<i64>, Variables), RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        self.workers
            .run(move || {
                let _hold = hold;
                let (rec, cp) = rt.sessions.checkpoint_or_head(&tenant, &id, seq)?;
                let state = rt.sessions.state_at(&rec, cp.as_ref().map(|c| c.id), false)?;
                Ok((cp.map(|c| c.seq), state.variables))
            })
            .await?
    }

    /// The variables at checkpoint `seq` (None: the head), as [`Self::inspect`], and its
    /// files that are not the template's: added, changed or removed by the calls on the
    /// path to it (the walk and bounds of [`Self::diff`], the template's side read in a
    /// throwaway fork of the template at once). What the console shows of a checkpoint.
    pub async fn inspect_with_files(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        seq: Option<i64>,
        hold: impl Send + Sync + 'static,
    ) -> Result<CheckpointContents, RuntimeError> {
        let (rec, cp) = {
            let (rt, t, i) = (self.clone(), tenant.to_string(), id.to_string());
            tokio::task::spawn_blocking(move || rt.sessions.checkpoint_or_head(&t, &i, seq))
                .await
                .map_err(|_| RuntimeError::WorkerGone)??
        };
        let hold = Arc::new(hold);
        let side = |rec: forkbox_sessions::store::SessionRecord, cp: Option<CheckpointRecord>| {
            let (rt, hold) = (self.clone(), hold.clone());
            self.workers.run(move || -> Result<_, RuntimeError> {
                let _hold = hold;
                Ok(rt.sessions.state_at(&rec, cp.as_ref().map(|c| c.id), true)?)
            })
        };
        let (base, at) = tokio::join!(side(rec.clone(), None), side(rec, cp.clone()));
        let (base, at) = (base??, at??);
        let d = forkbox_sessions::manager::diff((&None, &base, &[]), (&cp, &at, &[]));
        Ok(CheckpointContents {
            checkpoint: cp.map(|c| c.seq),
            variables: at.variables,
            files_added: d.files_added,
            files_changed: d.files_changed,
            files_removed: d.files_removed,
            files_truncated: d.files_truncated,
        })
    }

    /// What changed from checkpoint `from` to `to` (None: the head) of the session's
    /// lineage: variables, files (outside the image's system folders) and the calls on
    /// the path between them. Both states are read in throwaway forks, in parallel.
    pub async fn diff(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        from: i64,
        to: Option<i64>,
        hold: impl Send + Sync + 'static,
    ) -> Result<Diff, RuntimeError> {
        let (ra, rb) = {
            let (rt, t, i) = (self.clone(), tenant.to_string(), id.to_string());
            tokio::task::spawn_blocking(move || -> Result<_, RuntimeError> {
                let a = rt.sessions.checkpoint_or_head(&t, &i, Some(from))?;
                let b = rt.sessions.checkpoint_or_head(&t, &i, to)?;
                Ok((a, b))
            })
            .await
            .map_err(|_| RuntimeError::WorkerGone)??
        };
        let hold = Arc::new(hold);
        let side = |rec: forkbox_sessions::store::SessionRecord, cp: Option<CheckpointRecord>| {
            let (rt, hold) = (self.clone(), hold.clone());
            self.workers.run(move || -> Result<_, RuntimeError> {
                let _hold = hold;
                let state = rt.sessions.state_at(&rec, cp.as_ref().map(|c| c.id), true)?;
                let path = rt.sessions.path_to(cp.as_ref())?;
                Ok((cp, state, path))
            })
        };
        let (a, b) = tokio::join!(side(ra.0, ra.1), side(rb.0, rb.1));
        let (ca, sa, pa) = a??;
        let (cb, sb, pb) = b??;
        let mut d = forkbox_sessions::manager::diff((&ca, &sa, &pa), (&cb, &sb, &pb));
        for c in d.calls.iter_mut().chain(d.undone.iter_mut()) {
            c.code = cut_code(&c.code);
        }
        Ok(d)
    }
}

/// Most calls of one page of a history.
pub const HISTORY_MAX_CALLS: usize = 100;
/// Calls of a page when the request names no limit.
pub const HISTORY_DEFAULT_CALLS: usize = 20;
/// Most bytes of code and stored output in one page (at least one call is
/// always returned: one call's output is at most 1 MiB).
pub const HISTORY_MAX_BYTES: u64 = 8 << 20;

/// One call of a session's history: its checkpoint and what it showed.
#[derive(Clone, Debug)]
pub struct HistoryCall {
    pub checkpoint: i64,
    /// Its parent's number (None: it ran on the template).
    pub parent: Option<i64>,
    /// The session that made it (it may since have been deleted).
    pub session: String,
    pub code: String,
    pub created_ms: i64,
    pub summary: Option<String>,
    /// What it showed (None: not recorded, e.g. an upload or a package install).
    pub output: Option<CallOutput>,
}

/// A page of the calls from the template to a session's head, root first.
#[derive(Clone, Debug)]
pub struct History {
    pub session: String,
    /// The session's head (None: the template).
    pub head: Option<i64>,
    /// Calls on the whole path.
    pub total: usize,
    /// This page: the newest calls before the cursor, oldest first.
    pub calls: Vec<HistoryCall>,
    /// The cursor of the page before this one (older calls; None: this page starts at the root).
    pub before: Option<i64>,
}

fn stored_output(c: &CheckpointRecord, json: Option<&str>) -> Option<CallOutput> {
    let json = json?;
    match CallOutput::from_json(json) {
        Ok(o) => Some(o),
        Err(e) => {
            tracing::warn!(checkpoint = c.seq, session = %c.session_id, "stored output not shown: {e}");
            None
        }
    }
}

impl Runtime {
    /// The calls on the path from the template to the session's head (root
    /// first) with what each showed: the newest `limit` (at most
    /// [`HISTORY_MAX_CALLS`], and within [`HISTORY_MAX_BYTES`]) before
    /// checkpoint `before` (a checkpoint on the path; None: the head, included).
    /// Blocking.
    pub fn history(
        &self,
        tenant: &str,
        id: &str,
        before: Option<i64>,
        limit: Option<usize>,
    ) -> Result<History, RuntimeError> {
        let limit = limit.unwrap_or(HISTORY_DEFAULT_CALLS);
        if limit == 0 || limit > HISTORY_MAX_CALLS {
            return Err(RuntimeError::Invalid(format!("limit must be 1 to {HISTORY_MAX_CALLS}, got {limit}")));
        }
        let rec = self.sessions.get(tenant, id)?;
        let path = self.sessions.history(tenant, id)?;
        let end = match before {
            None => path.len(),
            Some(n) => path.iter().position(|c| c.seq == n).ok_or_else(|| {
                RuntimeError::Invalid(format!("before: checkpoint {n} is not on the path to session {id}'s head"))
            })?,
        };
        let mut start = end;
        let mut bytes = 0u64;
        while start > 0 && end - start < limit {
            let c = &path[start - 1];
            let size = c.output_bytes.saturating_add(c.code.len() as u64);
            if start < end && bytes.saturating_add(size) > HISTORY_MAX_BYTES {
                break;
            }
            bytes = bytes.saturating_add(size);
            start -= 1;
        }
        let page = &path[start..end];
        let ids: Vec<i64> = page.iter().filter(|c| c.output_bytes > 0).map(|c| c.id).collect();
        let mut outputs: HashMap<i64, String> =
            self.sessions.store().checkpoint_outputs(&ids).map_err(SessionError::from)?.into_iter().collect();
        let calls = page
            .iter()
            .enumerate()
            .map(|(i, c)| HistoryCall {
                checkpoint: c.seq,
                parent: (start + i).checked_sub(1).map(|p| path[p].seq),
                session: c.session_id.clone(),
                code: c.code.clone(),
                created_ms: c.created_ms,
                summary: c.summary.clone(),
                output: stored_output(c, outputs.remove(&c.id).as_deref()),
            })
            .collect();
        Ok(History {
            session: rec.id,
            head: path.last().map(|c| c.seq),
            total: path.len(),
            calls,
            before: (start > 0).then(|| path[start].seq),
        })
    }

    /// Checkpoint `seq` of the session's tree with what its call showed. Blocking.
    pub fn checkpoint_call(&self, tenant: &str, id: &str, seq: i64) -> Result<HistoryCall, RuntimeError> {
        let (_, cp) = self.sessions.checkpoint_or_head(tenant, id, Some(seq))?;
        let Some(c) = cp else { return Err(SessionError::CheckpointNotFound(id.to_string(), seq).into()) };
        let store = self.sessions.store();
        let parent = match c.parent {
            Some(p) => store.checkpoint(p).map_err(SessionError::from)?.map(|p| p.seq),
            None => None,
        };
        let json = if c.output_bytes > 0 { store.checkpoint_output(c.id).map_err(SessionError::from)? } else { None };
        Ok(HistoryCall {
            checkpoint: c.seq,
            parent,
            session: c.session_id.clone(),
            code: c.code.clone(),
            created_ms: c.created_ms,
            summary: c.summary.clone(),
            output: stored_output(&c, json.as_deref()),
        })
    }
}
