//! This node's part in a cluster: its identity, its heartbeat and
//! whether it drains. The leases themselves are rows of the store
//! (`crate::lease`); the manager takes one before it brings a session back and
//! checks it when it commits.
//!
//! A node trusts its own leases without asking the database while its last
//! successful heartbeat is younger than half the lease time: no other node can
//! have taken a session before the lease time passed since that heartbeat
//! (ages are on the database's clock, intervals here on this host's monotonic
//! clock; both run at the same rate). Past that it asks the database before it
//! serves a resident session, and the commit's fencing token is the backstop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How a node joins a cluster: several `forkbox serve` on one PostgreSQL
/// database and one object store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This node's name, unique in the cluster and stable across restarts
    /// (a restarted node gives back what it held at once).
    pub node_id: String,
    /// Where the other nodes reach this node's API (`http://host:port`; the
    /// server fills an empty one with the address it is bound to).
    pub url: String,
    /// A node whose last heartbeat is older than this loses its sessions to
    /// the next node that needs them.
    pub lease: Duration,
}

impl ClusterConfig {
    /// The default lease time.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

    /// How often the node heartbeats: three times per lease time.
    pub fn heartbeat_every(&self) -> Duration {
        self.lease / 3
    }

    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A node name: 1-64 letters, digits, `-_.:`.
pub fn valid_node_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// This node, as the manager sees it.
pub(crate) struct Node {
    pub(crate) config: ClusterConfig,
    /// When the last heartbeat succeeded (None: not since start).
    last_beat: Mutex<Option<Instant>>,
    draining: AtomicBool,
}

impl Node {
    pub(crate) fn new(config: ClusterConfig) -> Node {
        Node { config, last_beat: Mutex::new(Some(Instant::now())), draining: AtomicBool::new(false) }
    }

    pub(crate) fn id(&self) -> &str {
        &self.config.node_id
    }

    /// A heartbeat sent at `sent` succeeded (the time it was sent, not
    /// answered: the database's timestamp is no earlier than that).
    pub(crate) fn beat(&self, sent: Instant) {
        *self.last_beat.lock().unwrap_or_else(|e| e.into_inner()) = Some(sent);
    }

    /// The leases this node holds are certainly still its own (see the module doc).
    pub(crate) fn fresh(&self) -> bool {
        let last = *self.last_beat.lock().unwrap_or_else(|e| e.into_inner());
        last.is_some_and(|t| t.elapsed() < self.config.lease / 2)
    }

    /// Its last heartbeat is older than the lease time: other nodes may have taken everything.
    pub(crate) fn expired(&self) -> bool {
        let last = *self.last_beat.lock().unwrap_or_else(|e| e.into_inner());
        last.is_none_or(|t| t.elapsed() >= self.config.lease)
    }

    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub(crate) fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }
}
