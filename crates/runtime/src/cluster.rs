//! A node of a cluster: several `forkbox serve` on one PostgreSQL
//! database and one object store. The sessions' leases and the heartbeat are
//! the sessions layer's; this module runs the heartbeat on a thread of its own
//! and offers the front ends where a session's request belongs and the nodes.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use forkbox_sessions::manager::Route;

use crate::{Runtime, RuntimeError};

pub use forkbox_sessions::lease::{NodeRecord, NodeState};
pub use forkbox_sessions::node::ClusterConfig;

/// A node that has not heartbeated for this long and owns nothing is dropped from the list.
const FORGET_NODES_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Where a request for a session belongs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionRoute {
    /// This node serves it.
    Here,
    /// Forward it to this node (its id and API URL).
    Node { node: String, url: String },
}

impl Runtime {
    /// This node's id (None: not in a cluster).
    pub fn node_id(&self) -> Option<&str> {
        self.sessions.node_id()
    }

    /// Where a request for session `id` belongs (always `Here` outside a
    /// cluster). A session is served by one node at a time; a request that
    /// reaches another node goes there. Blocking (one query).
    pub fn route_session(&self, id: &str) -> Result<SessionRoute, RuntimeError> {
        Ok(match self.sessions.route(id)? {
            Route::Here => SessionRoute::Here,
            Route::Node { node, url } => SessionRoute::Node { node, url },
        })
    }

    /// The cluster's nodes with their state, heartbeat age and sessions (empty outside a cluster). Blocking.
    pub fn nodes(&self) -> Result<Vec<NodeRecord>, RuntimeError> {
        Ok(self.sessions.nodes()?)
    }

    /// Drain node `id` (it gives its sessions back and takes no new ones) or
    /// make it active again. False: no such node. Blocking.
    pub fn set_draining(&self, id: &str, on: bool) -> Result<bool, RuntimeError> {
        Ok(self.sessions.set_draining(id, on)?)
    }

    /// This node stops: its sessions are given back now (not when its lease runs out). Blocking.
    pub fn leave_cluster(&self) {
        self.sessions.leave();
    }

    /// This cluster node drains (or stops): it takes no session.
    pub fn draining(&self) -> bool {
        self.sessions.is_draining()
    }

    /// The lease time of the cluster (None: not in one).
    pub fn lease_time(&self) -> Option<Duration> {
        self.sessions.lease_time()
    }
}

/// The heartbeat of a cluster node, every third of the lease time, on a
/// thread of its own (not the upkeep's: a long gc must not delay it), until
/// the runtime is dropped.
pub(crate) fn start_heartbeat(rt: &Arc<Runtime>) {
    let Some(lease) = rt.sessions.lease_time() else { return };
    let every = lease / 3;
    let weak: Weak<Runtime> = Arc::downgrade(rt);
    let spawned = std::thread::Builder::new().name("forkbox-heartbeat".into()).spawn(move || {
        let mut failing_since: Option<Instant> = None;
        let mut last_forget = Instant::now();
        loop {
            std::thread::sleep(every);
            let Some(rt) = weak.upgrade() else { return };
            match rt.sessions.heartbeat() {
                Ok(()) => {
                    if let Some(t) = failing_since.take() {
                        tracing::info!("heartbeat back after {:.1} s", t.elapsed().as_secs_f64());
                    }
                }
                Err(e) => {
                    // Once when it starts failing, then every lease time.
                    let first = failing_since.is_none();
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if first || since.elapsed().as_millis() % lease.as_millis().max(1) < every.as_millis() {
                        tracing::warn!("heartbeat: {e}");
                    }
                }
            }
            if last_forget.elapsed() > Duration::from_secs(3600) {
                last_forget = Instant::now();
                if let Err(e) = rt.sessions.forget_nodes(FORGET_NODES_AFTER) {
                    tracing::warn!("forgetting old nodes: {e}");
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!("starting the heartbeat thread: {e}");
    }
}
