//! The tree of states: a session's tree, parallel alternatives (explore), the
//! variables at a checkpoint and the difference between two.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::{seg, ApiErrorBody, Client, ClientError, ExecResult};

/// One checkpoint of a tree.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TreeNode {
    pub checkpoint: i64,
    #[serde(default)]
    pub parent: Option<i64>,
    #[serde(default)]
    pub session: String,
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub created_ms: i64,
    #[serde(default)]
    pub summary: Option<String>,
    #[serde(default)]
    pub bytes: u64,
    /// The session asked about is here.
    #[serde(default)]
    pub head: bool,
    /// Live sessions whose head is here.
    #[serde(default)]
    pub heads: Vec<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A live session of a tree.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TreeSession {
    pub id: String,
    #[serde(default)]
    pub head: Option<i64>,
    #[serde(default)]
    pub forked_at: Option<i64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `GET /v1/sessions/{id}/tree`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Tree {
    pub session: String,
    #[serde(default)]
    pub head: Option<i64>,
    #[serde(default)]
    pub nodes: Vec<TreeNode>,
    #[serde(default)]
    pub sessions: Vec<TreeSession>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Which branches of an explore become sessions.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Keep {
    #[default]
    None,
    All,
    Indices(Vec<usize>),
}

impl Keep {
    fn json(&self) -> Value {
        match self {
            Keep::None => json!("none"),
            Keep::All => json!("all"),
            Keep::Indices(v) => json!(v),
        }
    }
}

/// A branch's failure (its exec timed out, crashed the guest...).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BranchFailure {
    pub status: u16,
    pub error: ApiErrorBody,
}

/// One branch of an explore, in the order of the codes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Branch {
    pub index: usize,
    /// The kept branch's session.
    #[serde(default)]
    pub session: Option<String>,
    #[serde(default)]
    pub result: Option<ExecResult>,
    #[serde(default)]
    pub failed: Option<BranchFailure>,
}

/// `POST /v1/sessions/{id}/explore`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Explored {
    #[serde(default)]
    pub from: Option<i64>,
    pub branches: Vec<Branch>,
    #[serde(default)]
    pub total_time_ms: f64,
}

/// A variable of the user namespace.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Variable {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub repr: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub len: Option<u64>,
}

/// `GET /v1/sessions/{id}/checkpoints/{n}/variables`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Variables {
    #[serde(default)]
    pub checkpoint: Option<i64>,
    pub variables: Vec<Variable>,
    #[serde(default)]
    pub omitted: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct VariableChange {
    pub name: String,
    pub before: Variable,
    pub after: Variable,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileChange {
    pub path: String,
    #[serde(default)]
    pub size_before: Option<u64>,
    #[serde(default)]
    pub size_after: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PathCall {
    pub checkpoint: i64,
    pub code: String,
}

/// `GET /v1/sessions/{id}/diff?from=a&to=b`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Diff {
    #[serde(default)]
    pub from: Option<i64>,
    #[serde(default)]
    pub to: Option<i64>,
    #[serde(default)]
    pub common: Option<i64>,
    #[serde(default)]
    pub undone: Vec<PathCall>,
    #[serde(default)]
    pub calls: Vec<PathCall>,
    #[serde(default)]
    pub variables_added: Vec<Variable>,
    #[serde(default)]
    pub variables_removed: Vec<Variable>,
    #[serde(default)]
    pub variables_changed: Vec<VariableChange>,
    #[serde(default)]
    pub files_added: Vec<FileChange>,
    #[serde(default)]
    pub files_removed: Vec<FileChange>,
    #[serde(default)]
    pub files_changed: Vec<FileChange>,
    #[serde(default)]
    pub files_truncated: bool,
}

impl Client {
    /// The session's tree: every checkpoint of it and its forks, the head marked.
    pub async fn tree(&self, id: &str) -> Result<Tree, ClientError> {
        self.get(&format!("/v1/sessions/{}/tree", seg(id))).await
    }

    /// Run `codes` in parallel, each in its own fork of `checkpoint` (the head if None).
    pub async fn explore(
        &self,
        id: &str,
        codes: &[String],
        checkpoint: Option<i64>,
        keep: &Keep,
        timeout_seconds: Option<f64>,
    ) -> Result<Explored, ClientError> {
        let mut body = json!({ "codes": codes, "keep": keep.json() });
        if let Some(c) = checkpoint {
            body["checkpoint"] = json!(c);
        }
        if let Some(t) = timeout_seconds {
            body["timeout_seconds"] = json!(t);
        }
        self.post(&format!("/v1/sessions/{}/explore", seg(id)), &body).await
    }

    /// The variables at checkpoint `n`.
    pub async fn variables(&self, id: &str, n: i64) -> Result<Variables, ClientError> {
        self.get(&format!("/v1/sessions/{}/checkpoints/{n}/variables", seg(id))).await
    }

    /// What changed from checkpoint `from` to `to` (the head if None).
    pub async fn diff(&self, id: &str, from: i64, to: Option<i64>) -> Result<Diff, ClientError> {
        let q = match to {
            Some(t) => format!("from={from}&to={t}"),
            None => format!("from={from}"),
        };
        self.get(&format!("/v1/sessions/{}/diff?{q}", seg(id))).await
    }
}
