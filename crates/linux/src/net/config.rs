//! A sandbox's network configuration (`NetConfig`): the egress policy layers,
//! the static host map, the secrets, and the limits `NetIo` enforces.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{secrets, Mode, Policy};

/// A sandbox's network configuration: the policy layers (server, key,
/// template, session: each must allow), a static host map the resolver
/// answers first, and limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    pub layers: Vec<Policy>,
    /// Names the resolver answers from this map instead of the host's resolver
    /// (lower-case, no trailing dot). The addresses still go through the policy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hosts: BTreeMap<String, Vec<IpAddr>>,
    /// Open AF_INET/AF_INET6 sockets at once.
    pub max_sockets: u32,
    /// Bytes sent plus received over the sandbox's life.
    pub max_bytes: u64,
    /// Secrets substituted on the way out (sealed: the values are never
    /// here in the clear; see [`secrets`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<secrets::SealedSecret>,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig::with_policy(Policy::none())
    }
}

impl NetConfig {
    pub const DEFAULT_MAX_SOCKETS: u32 = 128;
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

    pub fn with_policy(p: Policy) -> NetConfig {
        NetConfig {
            layers: vec![p],
            hosts: BTreeMap::new(),
            max_sockets: Self::DEFAULT_MAX_SOCKETS,
            max_bytes: Self::DEFAULT_MAX_BYTES,
            secrets: Vec::new(),
        }
    }

    /// The configuration as a worker gets it: without the sealed secrets
    /// (only the API process substitutes them).
    pub fn for_worker(&self) -> NetConfig {
        NetConfig { secrets: Vec::new(), ..self.clone() }
    }

    /// `none` if any layer is, else the narrowest mode (allowlist over public).
    pub fn mode(&self) -> Mode {
        let modes = self.layers.iter().map(|p| p.mode);
        if self.layers.is_empty() || modes.clone().any(|m| m == Mode::None) {
            Mode::None
        } else if modes.clone().any(|m| m == Mode::Allowlist) {
            Mode::Allowlist
        } else {
            Mode::Public
        }
    }

    /// May `name` be looked up at all (every layer: [`Policy::may_resolve`])?
    pub fn may_resolve(&self, name: &str) -> bool {
        !self.layers.is_empty() && self.layers.iter().all(|p| p.may_resolve(name))
    }

    /// One more, inner layer (it can only narrow).
    pub fn narrowed(mut self, p: Policy) -> NetConfig {
        self.layers.push(p);
        self
    }

    /// The sandbox's bandwidth: the smallest of its layers' (None: unlimited).
    pub fn max_bytes_per_second(&self) -> Option<u64> {
        self.layers.iter().filter_map(|p| p.max_bytes_per_second).min()
    }
}
