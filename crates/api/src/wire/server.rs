//! The server itself: root, health, readiness, cluster nodes, sandbox workers.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub status: String,
    /// The default template's id.
    pub template: String,
    /// The default template's name.
    pub default_template: String,
    /// Server capacity (no tenant, session or key is named or counted here).
    pub exec_slots: usize,
    pub exec_slots_free: usize,
    pub queued: usize,
    /// In a cluster: this node's id (null otherwise).
    pub node: Option<String>,
}

/// `GET /readyz`: whether this server takes requests (a cluster node that
/// drains does not: `draining`, 503).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Ready {
    /// `ready` or `draining`.
    pub status: String,
}

/// `GET /`: where the API is described.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RootInfo {
    pub name: String,
    pub version: String,
    /// The OpenAPI document of every route.
    pub openapi: String,
    pub health: String,
    /// The routes table of docs/api.md.
    pub docs: String,
    /// Where the web console is: this path, opened in a browser.
    pub console: String,
}

/// The nodes of a cluster (`GET /v1/admin/nodes`, admin keys only).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeList {
    /// The node that answered (null: this server is not a cluster node, and the list is empty).
    pub node: Option<String>,
    pub nodes: Vec<NodeBody>,
}

/// One node of a cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeBody {
    pub id: String,
    /// Where the other nodes reach its API.
    pub url: String,
    /// `active` or `draining` (gives its sessions back, takes no new ones).
    pub state: String,
    /// Its last heartbeat is younger than the lease time.
    pub alive: bool,
    /// Milliseconds since its last heartbeat (the database's clock).
    pub heartbeat_age_ms: i64,
    pub started_unix_ms: i64,
    /// Sessions resident on it now.
    pub sessions: u64,
}

/// The sandbox worker processes (`GET /v1/admin/workers`, admin keys only).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerList {
    /// `process` (execs and sessions in jailed workers) or `thread` (no workers).
    pub isolation: String,
    pub workers: Vec<WorkerBody>,
}

/// One sandbox worker process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerBody {
    pub index: usize,
    /// `exec` (one-shot execs: one per exec slot) or `sessions` (one tenant's sessions and tree of states).
    pub kind: String,
    /// A session worker's tenant (absent: the exec workers, and the spare session worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// A session worker's sandboxes now (resident sessions and throwaway forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<usize>,
    /// Host pid of the jailed worker (null while it is being restarted).
    pub pid: Option<u32>,
    /// The unprivileged host uid it runs as.
    pub uid: u32,
    /// Running an exec now.
    pub busy: bool,
    /// Workers of this slot (or this tenant) that died (or hung) and were replaced.
    pub restarts: u64,
    pub started_unix_ms: Option<u64>,
    /// How the previous worker of this slot (or this tenant) ended.
    pub last_exit: Option<String>,
}
