//! The manager's side of a cluster: leases around resident
//! sandboxes, the heartbeat, draining, and where a request belongs. Without
//! `Config::cluster` every method here is a no-op that says "here".

use super::*;

impl SessionManager {
    /// This node's id (None: not in a cluster).
    pub fn node_id(&self) -> Option<&str> {
        self.node.as_ref().map(|n| n.id())
    }

    /// This node drains (or stops): it takes no session.
    pub fn is_draining(&self) -> bool {
        self.node.as_ref().is_some_and(|n| n.draining())
    }

    /// The lease time of this node's cluster.
    pub fn lease_time(&self) -> Option<Duration> {
        self.node.as_ref().map(|n| n.config.lease)
    }

    /// Make sure the slot's session may be served by this node: in a cluster,
    /// a resident sandbox's lease must still hold (else the sandbox is stale:
    /// dropped), and a session that is not resident is taken now
    /// (`Elsewhere` if a live node has it, `Moving` while this node drains).
    pub(super) fn hold(&self, id: &str, slot: &mut Slot) -> Result<(), SessionError> {
        let Some(node) = &self.node else { return Ok(()) };
        if slot.sandbox.is_some() {
            if let Some(l) = &slot.lease {
                if node.fresh() || self.store.lease_holds(id, l)? {
                    return Ok(());
                }
            }
            tracing::warn!(session = id, "another node took the session; its sandbox here is dropped");
            slot.sandbox = None;
            slot.lease = None;
        }
        self.take(id, slot)
    }

    /// Take the session's lease for this node (bumping its fencing token).
    fn take(&self, id: &str, slot: &mut Slot) -> Result<(), SessionError> {
        let Some(node) = &self.node else { return Ok(()) };
        if node.draining() {
            self.not_elsewhere(id)?;
            return Err(SessionError::Moving(format!("node {} is draining; retry (another node takes it)", node.id())));
        }
        if node.expired() {
            return Err(SessionError::Moving(format!(
                "node {} cannot reach the session database to keep its leases; retry",
                node.id()
            )));
        }
        match self.store.acquire_lease(id, node.id(), node.config.lease_ms()) {
            Ok(Acquired::Mine(l)) => {
                slot.lease = Some(l);
                Ok(())
            }
            Ok(Acquired::Held(owner)) => Err(SessionError::Elsewhere { session: id.into(), owner: Box::new(owner) }),
            Err(StoreError::NoSuchSession(_)) => Err(SessionError::NotFound(id.into())),
            Err(e) => Err(e.into()),
        }
    }

    /// Drop the slot's sandbox (if any) and give its lease back (if any).
    pub(super) fn drop_resident(&self, id: &str, slot: &mut Slot) {
        // A first checkpoint being settled is committed under the lease first.
        if let Some(p) = slot.pending.take() {
            if let Ok(c) = p.wait() {
                slot.base = Some(c.id);
            }
        }
        slot.sandbox = None;
        if let Some(l) = slot.lease.take() {
            // Not released (the database is away): it runs out with this node's heartbeat.
            if let Err(e) = self.store.release_lease(id, &l) {
                tracing::warn!(session = id, "giving the session's lease back: {e}");
            }
        }
    }

    /// For an operation that changes where the session is (revert, new
    /// limits): the session taken by this node, any sandbox of it here
    /// dropped. The caller drops the lease again when done.
    pub(super) fn take_over(&self, id: &str, slot: &mut Slot) -> Result<(), SessionError> {
        if self.node.is_none() {
            return Ok(());
        }
        self.drop_resident(id, slot);
        self.take(id, slot)
    }

    /// `Elsewhere` if another live node has the session.
    pub(super) fn not_elsewhere(&self, id: &str) -> Result<(), SessionError> {
        let Some(node) = &self.node else { return Ok(()) };
        match self.store.session_owner(id, node.id(), node.config.lease_ms())? {
            Some(owner) => Err(SessionError::Elsewhere { session: id.into(), owner: Box::new(owner) }),
            None => Ok(()),
        }
    }

    /// Where a request for session `id` belongs: here (not in a cluster; it
    /// is resident here; nobody has it, or a node whose lease ran out), the
    /// node that has it, or, while this node drains, another active node.
    pub fn route(&self, id: &str) -> Result<Route, SessionError> {
        let Some(node) = &self.node else { return Ok(Route::Here) };
        let resident_here = self
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .is_some_and(|s| s.try_lock().map(|g| g.sandbox.is_some() && g.lease.is_some()).unwrap_or(true));
        if resident_here && node.fresh() {
            return Ok(Route::Here);
        }
        if let Some(o) = self.store.session_owner(id, node.id(), node.config.lease_ms())? {
            return Ok(Route::Node { node: o.node, url: o.url });
        }
        if !node.draining() {
            return Ok(Route::Here);
        }
        // Draining: an active, live node takes it (the same one for the same session).
        let lease = node.config.lease_ms();
        let mut live: Vec<NodeRecord> = self
            .store
            .nodes()?
            .into_iter()
            .filter(|n| n.id != node.id() && n.state == NodeState::Active && n.heartbeat_age_ms < lease)
            .collect();
        if live.is_empty() {
            return Ok(Route::Here);
        }
        let pick = stable_hash(id) as usize % live.len();
        let n = live.swap_remove(pick);
        Ok(Route::Node { node: n.id, url: n.url })
    }

    /// One heartbeat of this node (the runtime calls it every third of the
    /// lease time). Takes the node's state from the database (an operator
    /// may drain it from any node) and, while draining, evicts what is idle.
    pub fn heartbeat(&self) -> Result<(), SessionError> {
        let Some(node) = &self.node else { return Ok(()) };
        let was_expired = node.expired();
        let sent = Instant::now();
        let state = match self.store.heartbeat(node.id())? {
            Some(s) => s,
            None => {
                // Its row is gone (forgotten as dead): whatever it holds is not its own.
                self.evict_all_resident();
                self.store.register_node(node.id(), &node.config.url)?;
                NodeState::Active
            }
        };
        if was_expired {
            // Other nodes may have taken sessions meanwhile: keep only those still ours.
            self.drop_lost_leases()?;
        }
        node.beat(sent);
        node.set_draining(state == NodeState::Draining);
        if node.draining() {
            self.evict_all_resident();
        }
        Ok(())
    }

    /// Resident sandboxes whose lease no longer holds are dropped.
    fn drop_lost_leases(&self) -> Result<(), SessionError> {
        for (id, s) in self.slot_list() {
            if let Ok(mut g) = s.try_lock() {
                let holds = match &g.lease {
                    Some(l) => self.store.lease_holds(&id, l)?,
                    None => true,
                };
                if !holds {
                    tracing::warn!(session = %id, "another node took the session while this node was cut off");
                    g.sandbox = None;
                    g.lease = None;
                }
            }
        }
        Ok(())
    }

    /// Evict every resident session that no exec holds (giving its lease back).
    pub fn evict_all_resident(&self) -> usize {
        let mut n = 0;
        for (id, s) in self.slot_list() {
            if let Ok(mut g) = s.try_lock() {
                if g.sandbox.is_some() || g.lease.is_some() {
                    self.drop_resident(&id, &mut g);
                    n += 1;
                }
            }
        }
        n
    }

    fn slot_list(&self) -> Vec<(String, Arc<Mutex<Slot>>)> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// The cluster's nodes (empty when not in a cluster).
    pub fn nodes(&self) -> Result<Vec<NodeRecord>, SessionError> {
        if self.node.is_none() {
            return Ok(Vec::new());
        }
        Ok(self.store.nodes()?)
    }

    /// Drain node `id` (`on`) or make it active again. This node acts at once;
    /// another node sees it at its next heartbeat. False: no such node.
    pub fn set_draining(&self, id: &str, on: bool) -> Result<bool, SessionError> {
        let Some(node) = &self.node else {
            return Err(SessionError::Invalid("this server is not a cluster node".into()));
        };
        let state = if on { NodeState::Draining } else { NodeState::Active };
        if !self.store.set_node_state(id, state)? {
            return Ok(false);
        }
        if id == node.id() {
            node.set_draining(on);
            if on {
                self.evict_all_resident();
            }
        }
        Ok(true)
    }

    /// Drop nodes that have not heartbeated for `after` and own nothing.
    pub fn forget_nodes(&self, after: Duration) -> Result<u64, SessionError> {
        if self.node.is_none() {
            return Ok(0);
        }
        Ok(self.store.forget_nodes(i64::try_from(after.as_millis()).unwrap_or(i64::MAX))?)
    }

    /// This node stops: it gives every session back now (rather than when
    /// its lease runs out) and stays registered as draining.
    pub fn leave(&self) {
        let Some(node) = &self.node else { return };
        node.set_draining(true);
        let _ = self.store.set_node_state(node.id(), NodeState::Draining);
        let n = self.evict_all_resident();
        tracing::info!(node = node.id(), sessions = n, "gave the sessions back");
    }
}

/// FNV-1a: the same node for the same session on every node (no randomness).
fn stable_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
