//! The tree of states: a session's lineage (`GET /v1/sessions/{id}/tree`),
//! parallel alternatives from a checkpoint (`POST .../explore`), the variables
//! at a checkpoint (`GET .../checkpoints/{n}/variables`) and the difference
//! between two (`GET .../diff?from=a&to=b`). Absent values are sent as null,
//! but for the fields marked `skip_serializing_if` (left out then).

use serde::{Deserialize, Serialize};

use super::exec::{BatchItemError, ExecResponse};

/// One checkpoint of the tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TreeNode {
    /// Its number, unique in the tree (what revert, fork, explore, inspect and diff take).
    pub checkpoint: i64,
    /// The parent's number (null: it ran on the template).
    pub parent: Option<i64>,
    /// The session that made it (it may since have been deleted).
    pub session: String,
    pub code: String,
    pub created_ms: i64,
    /// One line about the result: the exception, the value, or the last line printed.
    pub summary: Option<String>,
    /// Bytes on disk of its layer and state.
    pub bytes: u64,
    pub pages: u64,
    /// This session's head is here.
    pub head: bool,
    /// Live sessions whose head is here.
    pub heads: Vec<String>,
}

/// An edge of the tree: the call that made `child` ran on `parent`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TreeEdge {
    pub parent: i64,
    pub child: i64,
}

/// A live session of the tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TreeSession {
    pub id: String,
    /// Its head's number (null: the template).
    pub head: Option<i64>,
    /// The checkpoint it was forked at (null: made from the template).
    pub forked_at: Option<i64>,
    pub created_ms: i64,
}

/// A session's lineage: the session, every session forked from it (and from
/// those), the session it was forked from, and all their checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Tree {
    pub session: String,
    /// This session's head (null: the template).
    pub head: Option<i64>,
    /// Parents before children.
    pub nodes: Vec<TreeNode>,
    pub edges: Vec<TreeEdge>,
    pub sessions: Vec<TreeSession>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum KeepMode {
    None,
    All,
}

/// Which branches become sessions: `"none"` (default), `"all"`, or a list of indices into `codes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum KeepSetting {
    Mode(KeepMode),
    Indices(Vec<usize>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExploreRequest {
    /// 1 to 64 alternatives, each run in its own fork of the checkpoint.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 64))]
    pub codes: Vec<String>,
    /// The checkpoint to branch from (default: the session's head).
    pub checkpoint: Option<i64>,
    pub keep: Option<KeepSetting>,
    /// Time limit of each branch's exec (default and maximum: the session's).
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    pub timeout_seconds: Option<f64>,
}

/// One branch: the exec's result (with `checkpoint`: the kept branch's new checkpoint) or its error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExploreBranch {
    pub index: usize,
    /// The kept branch's session (null: dropped).
    pub session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Box<ExecResponse>>,
    /// Why the branch's exec failed (timeout, crash...); `result` is absent then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<BatchItemError>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExploreResponse {
    /// The checkpoint every branch started from (null: the template).
    pub from: Option<i64>,
    /// One per code, in order.
    pub branches: Vec<ExploreBranch>,
    pub total_time_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VariableBody {
    pub name: String,
    /// `int`, `numpy.ndarray`, `module`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// A short repr (at most 200 characters).
    pub repr: String,
    /// Bytes (`nbytes` of an array, else `sys.getsizeof`).
    pub size: u64,
    /// `len()` where it has one.
    pub len: Option<u64>,
}

/// The user namespace at a checkpoint, read in a throwaway fork (nothing changes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VariablesResponse {
    pub checkpoint: Option<i64>,
    /// By name (names starting with `__` and `_` itself are left out).
    pub variables: Vec<VariableBody>,
    /// Variables past the first 500, not listed.
    pub omitted: u64,
    /// With `files=true`: the checkpoint's files that are not the template's (added, changed or
    /// removed by the calls on the path to it; the walk of diff), by path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<CheckpointFiles>,
}

/// A checkpoint's files against the template's (sizes: `size_before` the template's, `size_after` the checkpoint's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointFiles {
    pub added: Vec<FileChangeBody>,
    pub changed: Vec<FileChangeBody>,
    pub removed: Vec<FileChangeBody>,
    /// A walk stopped at 5,000 entries: the lists may be incomplete.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VariableChangeBody {
    pub name: String,
    pub before: VariableBody,
    pub after: VariableBody,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileChangeBody {
    pub path: String,
    /// Size at `from` (null: added).
    pub size_before: Option<u64>,
    /// Size at `to` (null: removed).
    pub size_after: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PathCallBody {
    pub checkpoint: i64,
    pub code: String,
}

/// What changed from `from` to `to`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiffResponse {
    pub from: Option<i64>,
    pub to: Option<i64>,
    /// The nearest checkpoint both descend from (null: the template).
    pub common: Option<i64>,
    /// Calls from `from` back to `common`, newest first (what going to `to` leaves behind).
    pub undone: Vec<PathCallBody>,
    /// Calls from `common` to `to`, oldest first.
    pub calls: Vec<PathCallBody>,
    pub variables_added: Vec<VariableBody>,
    pub variables_removed: Vec<VariableBody>,
    pub variables_changed: Vec<VariableChangeBody>,
    /// Files outside the image's system folders (/usr, /lib*, /bin, /sbin, /proc, /sys, /dev).
    pub files_added: Vec<FileChangeBody>,
    pub files_removed: Vec<FileChangeBody>,
    pub files_changed: Vec<FileChangeBody>,
    /// The walk of one side stopped at 5,000 entries: the file lists may be incomplete.
    pub files_truncated: bool,
}
