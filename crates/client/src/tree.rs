//! The tree of states: a session's tree, parallel alternatives (explore), the
//! variables at a checkpoint and the difference between two. The bodies are
//! the API's (`forkbox_api::wire::tree`), under the names this client has
//! always used.

pub use forkbox_api::wire::exec::BatchItemError as BranchFailure;
pub use forkbox_api::wire::tree::{
    CheckpointFiles, DiffResponse as Diff, ExploreBranch as Branch, ExploreResponse as Explored,
    FileChangeBody as FileChange, PathCallBody as PathCall, Tree, TreeEdge, TreeNode, TreeSession,
    VariableBody as Variable, VariableChangeBody as VariableChange, VariablesResponse as Variables,
};
use serde_json::{json, Value};

use crate::{seg, Client, ClientError};

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
