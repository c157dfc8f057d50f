//! The CPU budget of a key covers its sandboxes' background work too: what
//! their threads and processes run between requests (in the tenant's session
//! worker) is charged here every [`TICK`] to the key of the tenant's latest
//! request with a budget, and once that key's budget is spent the worker holds
//! the background work (requests are still served, and refused with 429
//! `cpu_budget_exceeded` for that key by [`crate::fair`]) until the budget has
//! refilled. Without this a `while True: pass` left running would use a core
//! for as long as its session lives.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::auth::Caller;
use crate::keys::KeyInfo;
use crate::AppState;

/// How often background CPU is charged (the most a spent budget overruns by is
/// about one tick of one core per tenant).
pub const TICK: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct BackgroundCpu {
    /// Per tenant: the key its background work is charged to.
    keys: Mutex<HashMap<String, Arc<KeyInfo>>>,
    /// Tenants whose background work is held now.
    held: Mutex<HashSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl BackgroundCpu {
    /// A request of `caller` takes an exec slot: its key (if it has a CPU
    /// budget) is the one its tenant's background work is charged to from now.
    pub fn note(&self, caller: &Caller) {
        let Some(key) = caller.key.as_ref().filter(|k| k.cpu.is_some()) else { return };
        let mut keys = lock(&self.keys);
        if !keys.get(&caller.tenant).is_some_and(|k| Arc::ptr_eq(k, key)) {
            keys.insert(caller.tenant.clone(), key.clone());
        }
    }

    /// One round: charge what each tenant's worker used since the last
    /// charge, then hold the work of tenants whose key has no budget left and
    /// let the others' run. Blocking (reads the workers' CPU clocks).
    pub fn tick(&self, rt: &forkbox_runtime::Runtime) {
        let used = rt.take_background_cpu();
        let keys = lock(&self.keys).clone();
        for (tenant, seconds) in used {
            if let Some(budget) = keys.get(&tenant).and_then(|k| k.cpu.as_ref()) {
                budget.charge(seconds);
            }
        }
        let mut held = lock(&self.held);
        for (tenant, key) in &keys {
            let Some(budget) = key.cpu.as_ref() else { continue };
            let spent = budget.check().is_err();
            if spent {
                // Said every round: a worker started since holds nothing yet.
                rt.throttle_background(tenant, true);
                if held.insert(tenant.clone()) {
                    tracing::info!(tenant = %tenant, "CPU budget spent: background work held until it refills");
                }
            } else if held.remove(tenant) {
                rt.throttle_background(tenant, false);
            }
        }
    }
}

/// Run [`BackgroundCpu::tick`] every [`TICK`] while the server's state lives
/// (held weakly: a server that has stopped releases its data directory).
pub fn spawn(state: &AppState) {
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(TICK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Some(s) = weak.upgrade() else { return };
            if tokio::task::spawn_blocking(move || s.background_cpu.tick(&s.runtime)).await.is_err() {
                return;
            }
        }
    });
}
