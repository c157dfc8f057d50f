//! Nodes and session leases in the metadata store: what lets
//! several `forkbox serve` nodes share one database and one bucket.
//!
//! - A **node** has a row in `nodes`: its id, the URL the other nodes reach it
//!   at, its state (`active`, `draining`) and its last heartbeat, written on
//!   the *database's* clock (`NOW_MS()`), so nodes compare ages on one clock.
//! - A session is **resident** on at most one node: `sessions.owner_node`. A
//!   node acquires the session before it brings it back from its checkpoint;
//!   it may do so while the session has no owner, or its owner is itself, or
//!   the owner's heartbeat is older than the lease time (the node is dead or
//!   cut off). Every acquisition bumps `sessions.lease_token`, the **fencing
//!   token**: a checkpoint commits only while the session's owner and token
//!   are still the committing node's (`Store::commit_checkpoint_fenced`), so a
//!   node that lost a session (paused past its lease, partitioned) can never
//!   commit over the node that took it.
//! - A node releases a session when it evicts it (no token bump: the next
//!   acquisition bumps), and every session it owned when it starts again (a
//!   restarted node holds nothing in memory).
//!
//! Acquisitions are writing transactions, serialized with checkpoint commits
//! (see `crate::db`), so the check and the bump are one step for the cluster.

use crate::db::{vals, DbError, Row};
use crate::store::{Op, Store, StoreError};

/// A node's state as other nodes see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Serves and takes sessions.
    Active,
    /// Hands its sessions back (`forkbox node drain`): takes no new ones.
    Draining,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
        }
    }

    fn parse(s: &str) -> NodeState {
        // An unknown state (a newer node's) is treated as not taking sessions.
        if s == "active" {
            NodeState::Active
        } else {
            NodeState::Draining
        }
    }
}

/// A node of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    pub id: String,
    pub url: String,
    pub state: NodeState,
    /// Milliseconds since its last heartbeat, on the database's clock.
    pub heartbeat_age_ms: i64,
    pub started_ms: i64,
    /// Sessions it owns (has resident) now.
    pub sessions: u64,
}

/// A session held by this node: what its checkpoint commits must still match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub node: String,
    pub token: i64,
}

/// The session's owner, if another live node has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub node: String,
    pub url: String,
    /// Until its lease runs out unless it heartbeats again (ms, >= 0).
    pub expires_in_ms: i64,
    pub state: NodeState,
}

/// What [`Store::acquire_lease`] got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// This node has the session now, under a new token.
    Mine(Lease),
    /// Another node has it and its heartbeat is fresh.
    Held(Owner),
}

fn node_row(row: &Row) -> Result<NodeRecord, DbError> {
    Ok(NodeRecord {
        id: row.text(0)?,
        url: row.text(1)?,
        state: NodeState::parse(&row.text(2)?),
        heartbeat_age_ms: row.i64(3)?,
        started_ms: row.i64(4)?,
        sessions: row.u64(5)?,
    })
}

impl Store {
    /// Registers (or re-registers) node `id` reachable at `url` as active, with
    /// a fresh heartbeat, and releases every session it owned: a node that
    /// starts has nothing resident.
    pub fn register_node(&self, id: &str, url: &str) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("register_node: begin")?;
        tx.execute(
            "INSERT INTO nodes (id, url, state, heartbeat_ms, started_ms) VALUES (?1, ?2, 'active', NOW_MS(), NOW_MS()) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, state = excluded.state, \
             heartbeat_ms = excluded.heartbeat_ms, started_ms = excluded.started_ms",
            vals![id, url],
        )
        .op("register_node: upsert")?;
        tx.execute("UPDATE sessions SET owner_node = NULL WHERE owner_node = ?1", vals![id])
            .op("register_node: release")?;
        tx.commit().op("register_node: commit")
    }

    /// The node's heartbeat (now, on the database's clock); its state as
    /// stored (an operator may have set it to draining). `None`: the node's
    /// row is gone (register again).
    pub fn heartbeat(&self, id: &str) -> Result<Option<NodeState>, StoreError> {
        let row = self
            .conn()
            .query_opt("UPDATE nodes SET heartbeat_ms = NOW_MS() WHERE id = ?1 RETURNING state", vals![id])
            .op("heartbeat")?;
        row.map(|r| r.text(0).map(|s| NodeState::parse(&s))).transpose().op("heartbeat")
    }

    /// Sets a node's state; false if there is no such node.
    pub fn set_node_state(&self, id: &str, state: NodeState) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute("UPDATE nodes SET state = ?2 WHERE id = ?1", vals![id, state.as_str()])
            .op("set_node_state")?;
        Ok(n > 0)
    }

    /// Every node that ever registered, with the sessions it owns now.
    pub fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let op = "nodes";
        let rows = self
            .conn()
            .query(
                "SELECT n.id, n.url, n.state, NOW_MS() - n.heartbeat_ms, n.started_ms, \
                 (SELECT COUNT(*) FROM sessions s WHERE s.owner_node = n.id) FROM nodes n ORDER BY n.id",
                &[],
            )
            .op(op)?;
        rows.iter().map(node_row).collect::<Result<_, _>>().op(op)
    }

    /// Forget nodes whose last heartbeat is older than `ms` and that own nothing.
    pub fn forget_nodes(&self, older_than_ms: i64) -> Result<u64, StoreError> {
        self.conn()
            .execute(
                "DELETE FROM nodes WHERE heartbeat_ms < NOW_MS() - ?1 \
                 AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.owner_node = nodes.id)",
                vals![older_than_ms],
            )
            .op("forget_nodes")
    }

    /// The session's owner if it is a node other than `me` whose heartbeat is
    /// younger than `lease_ms` (None: nobody, `me`, or a dead node: free to take).
    pub fn session_owner(&self, session: &str, me: &str, lease_ms: i64) -> Result<Option<Owner>, StoreError> {
        let mut conn = self.conn();
        owner_of(&mut conn, session, me, lease_ms)
    }

    /// Take the session for node `me` unless another live node has it (see
    /// the module doc). [`StoreError::NoSuchSession`] if it does not exist.
    pub fn acquire_lease(&self, session: &str, me: &str, lease_ms: i64) -> Result<Acquired, StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("acquire_lease: begin")?;
        if !tx.exists("SELECT 1 FROM sessions WHERE id = ?1", vals![session]).op("acquire_lease: find")? {
            return Err(StoreError::NoSuchSession(session.to_owned()));
        }
        if let Some(owner) = owner_of(&mut tx, session, me, lease_ms)? {
            return Ok(Acquired::Held(owner));
        }
        let token = tx
            .query_opt(
                "UPDATE sessions SET owner_node = ?2, lease_token = lease_token + 1 WHERE id = ?1 RETURNING lease_token",
                vals![session, me],
            )
            .op("acquire_lease: take")?
            .map(|r| r.i64(0))
            .transpose()
            .op("acquire_lease: take")?
            .ok_or_else(|| StoreError::NoSuchSession(session.to_owned()))?;
        tx.commit().op("acquire_lease: commit")?;
        Ok(Acquired::Mine(Lease { node: me.to_owned(), token }))
    }

    /// Whether `lease` still holds (the session's owner and token are unchanged).
    pub fn lease_holds(&self, session: &str, lease: &Lease) -> Result<bool, StoreError> {
        self.conn()
            .exists(
                "SELECT 1 FROM sessions WHERE id = ?1 AND owner_node = ?2 AND lease_token = ?3",
                vals![session, &lease.node, lease.token],
            )
            .op("lease_holds")
    }

    /// Give the session up (it was evicted here); nothing if the lease no longer holds.
    pub fn release_lease(&self, session: &str, lease: &Lease) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute(
                "UPDATE sessions SET owner_node = NULL WHERE id = ?1 AND owner_node = ?2 AND lease_token = ?3",
                vals![session, &lease.node, lease.token],
            )
            .op("release_lease")?;
        Ok(n > 0)
    }

    /// Sessions node `node` owns now.
    pub fn owned_sessions(&self, node: &str) -> Result<Vec<String>, StoreError> {
        let op = "owned_sessions";
        let rows =
            self.conn().query("SELECT id FROM sessions WHERE owner_node = ?1 ORDER BY id", vals![node]).op(op)?;
        rows.iter().map(|r| r.text(0)).collect::<Result<_, _>>().op(op)
    }
}

/// See [`Store::session_owner`]; inside a transaction or not.
fn owner_of(conn: &mut crate::db::Conn, session: &str, me: &str, lease_ms: i64) -> Result<Option<Owner>, StoreError> {
    let op = "session owner";
    let row = conn
        .query_opt(
            "SELECT n.id, n.url, n.heartbeat_ms + ?3 - NOW_MS(), n.state FROM sessions s \
             JOIN nodes n ON n.id = s.owner_node WHERE s.id = ?1 AND s.owner_node <> ?2",
            vals![session, me, lease_ms],
        )
        .op(op)?;
    let Some(row) = row else { return Ok(None) };
    let left = row.i64(2).op(op)?;
    if left <= 0 {
        return Ok(None);
    }
    Ok(Some(Owner {
        node: row.text(0).op(op)?,
        url: row.text(1).op(op)?,
        expires_in_ms: left,
        state: NodeState::parse(&row.text(3).op(op)?),
    }))
}
