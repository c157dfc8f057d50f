//! The tree of states, seen from one session: its lineage's checkpoints, throwaway
//! forks of any checkpoint (alternatives that are not kept, inspection), and the
//! variables and files of a checkpoint for inspect and diff. Nothing here pauses
//! or changes the session: every sandbox is a fork of a checkpoint on disk,
//! dropped at the end.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use forkbox_engine::{ExecOptions, ExecResult, ResumeAs};
use serde::{Deserialize, Serialize};

use super::{from_store_limits, SessionError, SessionManager};
use crate::host::Resident;
use crate::store::{CheckpointRecord, LineageTree, SessionRecord};

/// Most variables an inspection reports (the rest are counted).
pub const INSPECT_MAX_VARS: usize = 500;
/// Longest short repr of a variable (characters).
pub const REPR_MAX: usize = 200;
/// An inspection's time limit (at most the session's own).
pub const INSPECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One variable of the user namespace at a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variable {
    pub name: String,
    /// `int`, `numpy.ndarray`, `module`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// A short repr (at most [`REPR_MAX`] characters).
    pub repr: String,
    /// Bytes: `nbytes` of an array, else `sys.getsizeof`.
    pub size: u64,
    /// `len()` where it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// A digest of the value (content of arrays, bytes and strings, else the full repr): what diff compares.
    #[serde(default, skip_serializing)]
    pub digest: String,
}

/// The user namespace at a checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Variables {
    pub variables: Vec<Variable>,
    /// Variables left out past [`INSPECT_MAX_VARS`].
    pub omitted: u64,
}

/// A file of the sandbox's file system (outside the image's system folders).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileState {
    pub path: String,
    pub size: u64,
    #[serde(skip)]
    digest: u64,
}

/// What [`SessionManager::snapshot_at`] saw.
#[derive(Clone, Debug, Default)]
pub struct StateAt {
    pub variables: Variables,
    pub files: Vec<FileState>,
    /// The walk stopped at its bound.
    pub files_truncated: bool,
}

/// Python run in a throwaway fork: prints one marked line of JSON describing the namespace.
/// It reaches builtins through the module (the user may have rebound `len`, `repr`, ...).
const INSPECT_CODE: &str = r#"
def __forkbox_inspect__():
    import builtins as B, sys as S, json as J, hashlib as H, reprlib as R
    ns = B.globals()
    r = R.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxtuple, r.maxset = 3, 160, 160, 12, 8, 12, 12
    out, omitted = [], 0
    names = B.sorted(k for k in B.list(ns) if B.isinstance(k, B.str) and not k.startswith("__") and k != "_")
    for name in names:
        if B.len(out) >= __forkbox_maxv__:
            omitted += 1
            continue
        v = ns[name]
        t = B.type(v)
        mod = B.getattr(t, "__module__", "") or ""
        kind = t.__qualname__ if mod in ("builtins", "", "__main__") else mod + "." + t.__qualname__
        try:
            short = r.repr(v)
        except B.BaseException as e:
            short = "<repr failed: %s>" % B.type(e).__name__
        size, n = 0, None
        try:
            size = B.int(v.nbytes) if mod.startswith("numpy") and B.hasattr(v, "nbytes") else S.getsizeof(v)
        except B.BaseException:
            pass
        try:
            if B.hasattr(t, "__len__") and not B.isinstance(v, B.type):
                n = B.len(v)
        except B.BaseException:
            pass
        try:
            if B.isinstance(v, (B.bytes, B.bytearray)):
                d = H.sha1(v).hexdigest()
            elif B.isinstance(v, B.str):
                d = H.sha1(v.encode("utf-8", "surrogatepass")).hexdigest()
            elif mod.startswith("numpy") and B.hasattr(v, "tobytes"):
                d = H.sha1(B.repr((v.dtype, v.shape)).encode() + v.tobytes()).hexdigest()
            elif B.isinstance(v, B.type(S)):
                d = "module:" + v.__name__
            else:
                d = H.sha1(B.repr(v)[:1 << 20].encode("utf-8", "surrogatepass")).hexdigest()
        except B.BaseException:
            d = "?" + short
        out.append({"name": name, "type": kind, "repr": short, "size": size, "len": n, "digest": d})
    B.print("\x00forkbox-inspect " + J.dumps({"variables": out, "omitted": omitted}))
__forkbox_maxv__ = 0
__forkbox_inspect__()
"#;

const MARKER: &str = "\u{0}forkbox-inspect ";

#[derive(Deserialize)]
struct InspectReply {
    variables: Vec<Variable>,
    omitted: u64,
}

fn clip(s: &mut String, max: usize) {
    if s.chars().count() > max {
        *s = s.chars().take(max).collect::<String>() + "…";
    }
}

/// The inspection's output, validated: it came from the guest.
fn parse_inspection(r: &ExecResult) -> Result<Variables, SessionError> {
    if let Some(e) = &r.error {
        return Err(SessionError::InspectFailed(format!(
            "the checkpoint could not be inspected: {}: {}",
            e.kind, e.message
        )));
    }
    let line = r.stdout.lines().rev().find_map(|l| l.strip_prefix(MARKER)).ok_or_else(|| {
        SessionError::InspectFailed("the checkpoint could not be inspected (no report from the guest)".into())
    })?;
    let reply: InspectReply = serde_json::from_str(line)
        .map_err(|e| SessionError::InspectFailed(format!("the checkpoint could not be inspected (bad report: {e})")))?;
    let mut seen = HashSet::new();
    let mut variables = Vec::new();
    for mut v in reply.variables.into_iter().take(INSPECT_MAX_VARS) {
        clip(&mut v.name, 256);
        clip(&mut v.kind, 256);
        clip(&mut v.repr, REPR_MAX);
        clip(&mut v.digest, 80);
        if seen.insert(v.name.clone()) {
            variables.push(v);
        }
    }
    Ok(Variables { variables, omitted: reply.omitted.min(u32::MAX as u64) })
}

/// A change of one file between two checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileChange {
    pub path: String,
    /// Size at `from` (None: added).
    pub size_before: Option<u64>,
    /// Size at `to` (None: removed).
    pub size_after: Option<u64>,
}

/// A variable that differs between two checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VariableChange {
    pub name: String,
    pub before: Variable,
    pub after: Variable,
}

/// One call on the path between two checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PathCall {
    pub checkpoint: i64,
    pub code: String,
}

/// What changed from one checkpoint to another.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Diff {
    pub from: Option<i64>,
    pub to: Option<i64>,
    /// The nearest checkpoint both descend from (None: the template).
    pub common: Option<i64>,
    /// Calls from `from` back up to `common` (newest first): what going to `to` undoes.
    pub undone: Vec<PathCall>,
    /// Calls from `common` down to `to` (oldest first).
    pub calls: Vec<PathCall>,
    pub variables_added: Vec<Variable>,
    pub variables_removed: Vec<Variable>,
    pub variables_changed: Vec<VariableChange>,
    pub files_added: Vec<FileChange>,
    pub files_removed: Vec<FileChange>,
    pub files_changed: Vec<FileChange>,
    /// A file walk stopped at its bound: the file lists may be incomplete.
    pub files_truncated: bool,
}

/// Compare two states (and name the calls between them).
pub fn diff(
    a: (&Option<CheckpointRecord>, &StateAt, &[CheckpointRecord]),
    b: (&Option<CheckpointRecord>, &StateAt, &[CheckpointRecord]),
) -> Diff {
    let (ca, sa, pa) = a;
    let (cb, sb, pb) = b;
    let ids_a: HashSet<i64> = pa.iter().map(|c| c.id).collect();
    let common = pb.iter().rev().find(|c| ids_a.contains(&c.id)).cloned();
    let common_id = common.as_ref().map(|c| c.id);
    let after = |path: &[CheckpointRecord]| -> Vec<PathCall> {
        let start = match common_id {
            Some(id) => path.iter().position(|c| c.id == id).map_or(0, |i| i + 1),
            None => 0,
        };
        path[start..].iter().map(|c| PathCall { checkpoint: c.seq, code: c.code.clone() }).collect()
    };
    let mut undone = after(pa);
    undone.reverse();
    let va: BTreeMap<&str, &Variable> = sa.variables.variables.iter().map(|v| (v.name.as_str(), v)).collect();
    let vb: BTreeMap<&str, &Variable> = sb.variables.variables.iter().map(|v| (v.name.as_str(), v)).collect();
    let mut d = Diff {
        from: ca.as_ref().map(|c| c.seq),
        to: cb.as_ref().map(|c| c.seq),
        common: common.map(|c| c.seq),
        undone,
        calls: after(pb),
        files_truncated: sa.files_truncated || sb.files_truncated,
        ..Diff::default()
    };
    for (name, v) in &vb {
        match va.get(name) {
            None => d.variables_added.push((*v).clone()),
            Some(old) if old.kind != v.kind || old.digest != v.digest || old.repr != v.repr => d
                .variables_changed
                .push(VariableChange { name: name.to_string(), before: (*old).clone(), after: (*v).clone() }),
            Some(_) => {}
        }
    }
    d.variables_removed = va.iter().filter(|(n, _)| !vb.contains_key(*n)).map(|(_, v)| (*v).clone()).collect();
    let fa: HashMap<&str, &FileState> = sa.files.iter().map(|f| (f.path.as_str(), f)).collect();
    let fb: HashMap<&str, &FileState> = sb.files.iter().map(|f| (f.path.as_str(), f)).collect();
    for f in &sb.files {
        match fa.get(f.path.as_str()) {
            None => {
                d.files_added.push(FileChange { path: f.path.clone(), size_before: None, size_after: Some(f.size) })
            }
            Some(old) if old.digest != f.digest => d.files_changed.push(FileChange {
                path: f.path.clone(),
                size_before: Some(old.size),
                size_after: Some(f.size),
            }),
            Some(_) => {}
        }
    }
    for f in &sa.files {
        if !fb.contains_key(f.path.as_str()) {
            d.files_removed.push(FileChange { path: f.path.clone(), size_before: Some(f.size), size_after: None });
        }
    }
    for v in [&mut d.files_added, &mut d.files_removed, &mut d.files_changed] {
        v.sort_by(|x, y| x.path.cmp(&y.path));
    }
    d
}

impl SessionManager {
    /// The session's record and the tree of its lineage.
    pub fn tree(&self, tenant: &str, id: &str) -> Result<(SessionRecord, LineageTree), SessionError> {
        // The lineage's other sessions may have checkpoints answered for and not committed yet.
        self.wait_settled(None);
        let rec = self.record(tenant, id)?;
        let tree = self.store.lineage_tree(tenant, id)?.ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        Ok((rec, tree))
    }

    /// A checkpoint of the session's lineage by number, or its head (None: the template).
    pub fn checkpoint_or_head(
        &self,
        tenant: &str,
        id: &str,
        seq: Option<i64>,
    ) -> Result<(SessionRecord, Option<CheckpointRecord>), SessionError> {
        let rec = self.record(tenant, id)?;
        let cp = match seq {
            Some(s) => Some(self.find_checkpoint(&rec, s)?),
            None => self.head(&rec)?,
        };
        Ok((rec, cp))
    }

    /// The calls from the template to a checkpoint (root first).
    pub fn path_to(&self, cp: Option<&CheckpointRecord>) -> Result<Vec<CheckpointRecord>, SessionError> {
        match cp {
            Some(c) => Ok(self.store.ancestry(c.id)?),
            None => Ok(Vec::new()),
        }
    }

    /// A new session of `tenant` at checkpoint `cp` of `rec` (None: the template),
    /// with `rec`'s template and limits. Nothing is copied or paused.
    pub fn fork_at(
        &self,
        tenant: &str,
        rec: &SessionRecord,
        cp: Option<i64>,
        tags: BTreeMap<String, String>,
    ) -> Result<SessionRecord, SessionError> {
        self.create_at(tenant, tags, &from_store_limits(&rec.limits), cp, &rec.template_id)
    }

    /// Run `f` on a throwaway fork of checkpoint `cp` of `rec`'s lineage (None: a
    /// fork of its template), reseeded like a fork; dropped after. The session is
    /// not touched (it may exec meanwhile).
    pub fn at_checkpoint<T>(
        &self,
        rec: &SessionRecord,
        cp: Option<i64>,
        output_bytes: Option<usize>,
        f: impl FnOnce(&mut dyn Resident) -> Result<T, SessionError>,
    ) -> Result<T, SessionError> {
        let t = self.loaded(rec)?;
        let mut limits = from_store_limits(&rec.limits);
        if let Some(o) = output_bytes {
            limits.output_bytes = o.min(limits.output_bytes);
        }
        // Never checkpointed: pooled VMs, no dirty tracking.
        let how = ResumeAs::Throwaway;
        let mut sb = match cp {
            None => self.start_fresh(&rec.tenant, &t, limits, how)?,
            Some(c) => self.resume_as(&rec.tenant, &t, c, limits, how)?,
        };
        f(sb.as_mut())
    }

    /// Run `code` on a throwaway fork of a checkpoint (see [`Self::at_checkpoint`]);
    /// `timeout` at most the session's limit.
    pub fn exec_throwaway(
        &self,
        rec: &SessionRecord,
        cp: Option<i64>,
        code: &str,
        timeout: Option<Duration>,
        output_bytes: Option<usize>,
    ) -> Result<ExecResult, SessionError> {
        let max = Duration::from_millis(rec.limits.timeout_ms);
        let timeout = Some(timeout.map_or(max, |t| t.min(max)));
        self.at_checkpoint(rec, cp, output_bytes, |sb| {
            sb.exec(code, ExecOptions { timeout, ..ExecOptions::default() }).map_err(|source| {
                SessionError::ExecFailed { output: sb.take_failed_output().map(Box::new), source, checkpoint: None }
            })
        })
    }

    /// The variables (and, with `files`, the files) at a checkpoint, from a throwaway fork.
    pub fn state_at(&self, rec: &SessionRecord, cp: Option<i64>, files: bool) -> Result<StateAt, SessionError> {
        let max = Duration::from_millis(rec.limits.timeout_ms);
        let timeout = Some(INSPECT_TIMEOUT.min(max));
        let code = INSPECT_CODE.replace("__forkbox_maxv__ = 0", &format!("__forkbox_maxv__ = {INSPECT_MAX_VARS}"));
        self.at_checkpoint(rec, cp, None, |sb| {
            // The files first: nothing the inspection does shows up in them.
            let mut out = StateAt::default();
            if files {
                let w = sb.walk().map_err(|e| SessionError::InspectFailed(format!("the file walk failed: {e}")))?;
                out.files_truncated = w.truncated;
                out.files = w
                    .files
                    .into_iter()
                    .take(crate::host::WALK_MAX_ENTRIES)
                    .map(|f| FileState { path: f.path, size: f.size, digest: f.digest })
                    .collect();
            }
            let r = sb.exec(&code, ExecOptions { timeout, ..ExecOptions::default() }).map_err(|source| {
                SessionError::InspectFailed(format!("the checkpoint could not be inspected: {source}"))
            })?;
            out.variables = parse_inspection(&r)?;
            Ok(out)
        })
    }
}
