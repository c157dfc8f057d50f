//! Network counters: per sandbox (`NetStats`), process-wide (`GLOBAL`, for
//! `/metrics`), the accounting of the egress' decisions and bytes moved, and
//! the sandbox's byte limit.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::errno::Errno;
use serde::{Deserialize, Serialize};

use super::{NetIo, Verdict};

/// Per-sandbox network counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NetStats {
    pub sockets_opened: u64,
    pub connects_allowed: u64,
    pub connects_denied: u64,
    pub dns_queries: u64,
    pub dns_refused: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Connections made to a listener of the sandbox (inside it, never a host port).
    #[serde(default)]
    pub loopback_connects: u64,
    /// Connections from outside (the port proxy) handed to a listener of the sandbox.
    #[serde(default)]
    pub injected_connects: u64,
    /// Denials by reason (`loopback address`, `rule 10.0.0.0/8`, `network: none` ...).
    pub denied: BTreeMap<String, u64>,
}

/// Process-wide counters over every sandbox (for `/metrics`).
#[derive(Debug, Default)]
pub struct GlobalNetStats {
    pub connects_allowed: AtomicU64,
    pub connects_denied: AtomicU64,
    pub dns_queries: AtomicU64,
    pub dns_refused: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
}

/// A reading of [`GlobalNetStats`], or the difference of two (what one exec
/// in a sandbox worker process moved, added to the API process' counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetCounts {
    pub connects_allowed: u64,
    pub connects_denied: u64,
    pub dns_queries: u64,
    pub dns_refused: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

impl NetCounts {
    /// What moved from `before` to `self` (saturating).
    pub fn since(self, before: NetCounts) -> NetCounts {
        NetCounts {
            connects_allowed: self.connects_allowed.saturating_sub(before.connects_allowed),
            connects_denied: self.connects_denied.saturating_sub(before.connects_denied),
            dns_queries: self.dns_queries.saturating_sub(before.dns_queries),
            dns_refused: self.dns_refused.saturating_sub(before.dns_refused),
            bytes_sent: self.bytes_sent.saturating_sub(before.bytes_sent),
            bytes_received: self.bytes_received.saturating_sub(before.bytes_received),
        }
    }
}

impl GlobalNetStats {
    pub fn read(&self) -> NetCounts {
        NetCounts {
            connects_allowed: self.connects_allowed.load(Ordering::Relaxed),
            connects_denied: self.connects_denied.load(Ordering::Relaxed),
            dns_queries: self.dns_queries.load(Ordering::Relaxed),
            dns_refused: self.dns_refused.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
        }
    }

    pub fn add(&self, c: NetCounts) {
        self.connects_allowed.fetch_add(c.connects_allowed, Ordering::Relaxed);
        self.connects_denied.fetch_add(c.connects_denied, Ordering::Relaxed);
        self.dns_queries.fetch_add(c.dns_queries, Ordering::Relaxed);
        self.dns_refused.fetch_add(c.dns_refused, Ordering::Relaxed);
        self.bytes_sent.fetch_add(c.bytes_sent, Ordering::Relaxed);
        self.bytes_received.fetch_add(c.bytes_received, Ordering::Relaxed);
    }
}

pub static GLOBAL: GlobalNetStats = GlobalNetStats {
    connects_allowed: AtomicU64::new(0),
    connects_denied: AtomicU64::new(0),
    dns_queries: AtomicU64::new(0),
    dns_refused: AtomicU64::new(0),
    bytes_sent: AtomicU64::new(0),
    bytes_received: AtomicU64::new(0),
};

impl NetIo {
    /// Count, log and (a denial) note a decision of the egress.
    pub(super) fn count(&mut self, addr: SocketAddr, what: &str, v: &Verdict) {
        if v.allowed {
            self.stats.connects_allowed += 1;
            GLOBAL.connects_allowed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(target: "forkbox::net", "{what} {addr} allowed ({})", v.reason);
        } else {
            self.stats.connects_denied += 1;
            GLOBAL.connects_denied.fetch_add(1, Ordering::Relaxed);
            *self.stats.denied.entry(v.reason.clone()).or_default() += 1;
            let via = if v.names.is_empty() { String::new() } else { format!(" ({})", v.names.join(", ")) };
            self.note(format!("{what} {addr}{via} refused by the egress policy: {}", v.reason));
        }
    }

    pub(super) fn count_allowed(&mut self, addr: SocketAddr, what: &str) {
        self.stats.connects_allowed += 1;
        GLOBAL.connects_allowed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: "forkbox::net", "{what} {addr} allowed");
    }

    pub(super) fn account(&mut self, sent: u64, received: u64) {
        self.stats.bytes_sent += sent;
        self.stats.bytes_received += received;
        GLOBAL.bytes_sent.fetch_add(sent, Ordering::Relaxed);
        GLOBAL.bytes_received.fetch_add(received, Ordering::Relaxed);
    }

    /// Bytes left under the sandbox's byte limit (ENOBUFS once it is spent).
    pub(super) fn budget(&mut self) -> Result<u64, Errno> {
        let used = self.stats.bytes_sent + self.stats.bytes_received;
        let left = self.config.max_bytes.saturating_sub(used);
        if left == 0 {
            if !self.byte_limit_noted {
                self.byte_limit_noted = true;
                self.note(format!("the sandbox's network byte limit ({} bytes) is spent", self.config.max_bytes));
            }
            return Err(Errno::ENOBUFS);
        }
        Ok(left)
    }
}
