//! The egress boundary: where a sandbox's way out is decided and its host
//! connections are opened. `NetIo` moves bytes; for everything that reaches
//! past the sandbox it asks an [`Egress`]:
//!
//! - a TCP connection to an address ([`Egress::connect`]): decided by the
//!   policy, and if allowed a new non-blocking host socket with its connect
//!   started comes back;
//! - a UDP flow to an address ([`Egress::udp`]): decided, and if allowed a
//!   new host UDP socket connect()ed to that one destination comes back (a
//!   datagram to another destination asks again);
//! - a name ([`Egress::lookup`], [`Egress::finish`]): answered at once
//!   (policy, static map, cache) or later through a [`resolver::Lookup`]
//!   whose eventfd the engine waits on, so the sandbox thread never blocks;
//!   only addresses the policy allows are handed out, and the names they were
//!   handed out for are what domain rules match.
//!
//! [`Direct`] decides and opens in this process ([`Gate`] holds the policy
//! state of one sandbox). A worker that has no network of its own uses an
//! implementation that asks the API process instead (the broker of
//! `forkbox-worker`, which holds a [`Gate`] per sandbox): the policy state
//! then never lives where the guest runs.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use socket2::Socket;

pub use super::host_socket::{open_tcp, open_udp, Opened, Verdict};
use super::policy::{self, Mode};
use super::{dns, resolver, NetConfig};
use crate::errno::Errno;

/// Why no socket came back.
#[derive(Debug)]
pub enum Refused {
    /// The policy denied the destination (the guest sees ECONNREFUSED).
    Policy(Verdict),
    /// Allowed, but the host failed (its errno).
    Host(Errno),
}

/// An answer of the resolver: the rcode and the addresses handed out, and
/// what to tell the guest and count.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    pub rcode: u8,
    pub addrs: Vec<IpAddr>,
    /// A one-line note for the guest's stderr.
    pub note: Option<String>,
    /// A denial to count under this reason.
    pub denied: Option<String>,
    /// Counted as refused by the policy (a name no allow rule matches).
    pub refused: bool,
}

impl Resolved {
    fn done(rcode: u8) -> Resolved {
        Resolved { rcode, ..Resolved::default() }
    }
}

/// A name's lookup: answered now, or once the lookup's eventfd is readable.
#[derive(Debug)]
pub enum Resolution {
    Done(Resolved),
    Wait(Arc<resolver::Lookup>),
}

/// What a sandbox asks of the way out. Implementations hold the sandbox's
/// policy: `NetIo` never decides a destination itself.
pub trait Egress: Send + Sync + fmt::Debug {
    /// A TCP connection to `dest` from a socket of `domain` (AF_INET/AF_INET6).
    fn connect(&self, domain: i32, dest: SocketAddr) -> Result<Opened, Refused>;
    /// A UDP flow to `dest` from a socket of `domain`: a host socket connected to it.
    fn udp(&self, domain: i32, dest: SocketAddr) -> Result<Socket, Refused>;
    /// Start resolving `name` (A and AAAA).
    fn lookup(&self, name: &str) -> Resolution;
    /// The answer to a lookup `Self::lookup` returned as `Wait`, once it is done.
    fn finish(&self, lookup: &resolver::Lookup) -> Resolved;
    /// End every lookup under way now with SERVFAIL (the exec was interrupted).
    fn cancel_lookups(&self);
}

/// Names one sandbox may have in lookup on the host at once.
pub(crate) const LOOKUPS_IN_FLIGHT: usize = 4;
/// Host lookups one sandbox may start per second, and in a burst.
pub(crate) const LOOKUP_RATE: f64 = 10.0;
pub(crate) const LOOKUP_BURST: f64 = 20.0;
const NAMES_CAP: usize = 4096;
const DNS_CACHE_CAP: usize = 1024;
const HOST_ADDRS_TTL: Duration = Duration::from_secs(10);

/// The egress policy state of one sandbox: its configuration, the names its
/// resolver handed out (what domain rules match), the lookup cache and the
/// lookups under way with their limits.
#[derive(Debug)]
pub struct Gate {
    config: Arc<NetConfig>,
    /// Address -> the names the resolver handed it out for.
    pub(crate) names: HashMap<IpAddr, Vec<String>>,
    dns_cache: HashMap<String, (Instant, Result<Vec<IpAddr>, u8>)>,
    /// Host lookups under way, by name (at most `LOOKUPS_IN_FLIGHT` not done).
    pub(crate) lookups: HashMap<String, Arc<resolver::Lookup>>,
    /// Token bucket over the host lookups started (`LOOKUP_RATE`, `LOOKUP_BURST`).
    lookup_tokens: (f64, Instant),
    host_addrs: (Option<Instant>, Vec<IpAddr>),
}

impl Gate {
    pub fn new(config: Arc<NetConfig>) -> Gate {
        Gate {
            config,
            names: HashMap::new(),
            dns_cache: HashMap::new(),
            lookups: HashMap::new(),
            lookup_tokens: (LOOKUP_BURST, Instant::now()),
            host_addrs: (None, Vec::new()),
        }
    }

    pub fn config(&self) -> &Arc<NetConfig> {
        &self.config
    }

    fn host_addrs(&mut self) -> Vec<IpAddr> {
        let fresh = self.host_addrs.0.is_some_and(|t| t.elapsed() < HOST_ADDRS_TTL);
        if !fresh {
            self.host_addrs = (Some(Instant::now()), policy::host_addresses());
        }
        self.host_addrs.1.clone()
    }

    /// Decide `addr` under every layer of the policy.
    pub fn decide(&mut self, addr: SocketAddr) -> Verdict {
        let ip = addr.ip();
        let key = policy::canonical(ip).map(IpAddr::V4).unwrap_or(ip);
        let names = self.names.get(&key).or_else(|| self.names.get(&ip)).cloned().unwrap_or_default();
        let host = self.host_addrs();
        let d = policy::decide_layers(&self.config.layers, ip, Some(addr.port()), &names, &host);
        Verdict { allowed: d.allowed(), reason: d.reason().to_string(), names }
    }

    /// Move the finished host lookups into the cache (a failure is not kept:
    /// asking again may work).
    pub(crate) fn sweep(&mut self) {
        let done: Vec<String> = self.lookups.iter().filter(|(_, l)| l.is_done()).map(|(n, _)| n.clone()).collect();
        for name in done {
            let Some(l) = self.lookups.remove(&name) else { continue };
            match l.outcome() {
                Some(r) if r != Err(dns::RCODE_SERVFAIL) => {
                    if self.dns_cache.len() >= DNS_CACHE_CAP {
                        self.dns_cache.clear();
                    }
                    self.dns_cache.insert(name, (Instant::now(), r));
                }
                _ => {}
            }
        }
    }

    /// A host lookup may start now (the per-sandbox rate).
    fn lookup_token(&mut self) -> bool {
        let now = Instant::now();
        let (t, last) = self.lookup_tokens;
        let t = (t + now.saturating_duration_since(last).as_secs_f64() * LOOKUP_RATE).min(LOOKUP_BURST);
        let ok = t >= 1.0;
        self.lookup_tokens = (if ok { t - 1.0 } else { t }, now);
        ok
    }

    /// Resolve `name`: at once from the policy, the static map or the cache,
    /// else by a host lookup (`Resolution::Wait`). REFUSED when the network is
    /// off; NXDOMAIN, without asking any nameserver, for a name no allow rule
    /// of an `allowlist` could match; SERVFAIL when the sandbox's or the
    /// process' lookup limits are reached.
    pub fn begin(&mut self, name: &str) -> Resolution {
        let name = policy::normalize_name(name);
        if self.config.mode() == Mode::None {
            let note = Some(format!("DNS lookup of {name} refused: network: none"));
            return Resolution::Done(Resolved { note, ..Resolved::done(dns::RCODE_REFUSED) });
        }
        if let Some(a) = self.config.hosts.get(&name).cloned() {
            return Resolution::Done(self.filter(&name, Ok(a)));
        }
        if !self.config.may_resolve(&name) {
            return Resolution::Done(Resolved {
                note: Some(format!(
                    "DNS lookup of {name} answered NXDOMAIN: no allow rule of the egress policy names it (no nameserver was asked)"
                )),
                denied: Some("name not in the allowlist".to_string()),
                refused: true,
                ..Resolved::done(dns::RCODE_NXDOMAIN)
            });
        }
        self.sweep();
        let cached = self
            .dns_cache
            .get(&name)
            .filter(|(t, _)| t.elapsed() < Duration::from_secs(dns::TTL as u64))
            .map(|(_, r)| r.clone());
        if let Some(r) = cached {
            return Resolution::Done(self.filter(&name, r));
        }
        if let Some(l) = self.lookups.get(&name) {
            return Resolution::Wait(Arc::clone(l));
        }
        let why = if self.lookups.len() >= LOOKUPS_IN_FLIGHT {
            format!("the sandbox has {LOOKUPS_IN_FLIGHT} lookups under way")
        } else if !self.lookup_token() {
            format!("the sandbox's limit of {LOOKUP_RATE} lookups a second is reached")
        } else {
            match resolver::Lookup::new(&name) {
                Some(l) if resolver::submit(Arc::clone(&l)) => {
                    self.lookups.insert(name, Arc::clone(&l));
                    return Resolution::Wait(l);
                }
                _ => "the host's resolver is busy".to_string(),
            }
        };
        let note = Some(format!("DNS lookup of {name} failed: {why}"));
        Resolution::Done(Resolved { note, ..Resolved::done(dns::RCODE_SERVFAIL) })
    }

    /// The answer to a finished host lookup.
    pub fn finish(&mut self, l: &resolver::Lookup) -> Resolved {
        self.sweep();
        let outcome = l.outcome().unwrap_or(Err(dns::RCODE_SERVFAIL));
        self.filter(&l.name, outcome)
    }

    /// Keep only the addresses of a lookup's outcome that the policy allows
    /// (and remember the name they were handed out for). REFUSED when it had
    /// addresses and every one is denied.
    pub fn filter(&mut self, name: &str, found: resolver::Outcome) -> Resolved {
        let all = match found {
            Ok(a) => a,
            Err(rcode) => return Resolved::done(rcode),
        };
        let host = self.host_addrs();
        let names = vec![name.to_string()];
        let mut kept = Vec::new();
        let mut why = None;
        for ip in &all {
            let d = policy::decide_layers(&self.config.layers, *ip, None, &names, &host);
            if d.allowed() {
                kept.push(*ip);
            } else if why.is_none() {
                why = Some(d.reason().to_string());
            }
        }
        if kept.is_empty() {
            if let Some(why) = why {
                return Resolved {
                    note: Some(format!(
                        "DNS lookup of {name} refused: it resolves only to addresses the egress policy denies ({why})"
                    )),
                    denied: Some(why),
                    ..Resolved::done(dns::RCODE_REFUSED)
                };
            }
            return Resolved::done(dns::RCODE_NXDOMAIN);
        }
        if self.names.len() >= NAMES_CAP {
            self.names.clear();
        }
        for ip in &kept {
            let v = self.names.entry(*ip).or_default();
            if !v.iter().any(|n| n == name) && v.len() < 8 {
                v.push(name.to_string());
            }
        }
        Resolved { addrs: kept, ..Resolved::done(dns::RCODE_OK) }
    }

    pub fn cancel_lookups(&self) {
        for l in self.lookups.values() {
            l.cancel();
        }
    }
}

/// Decides and opens in this process (thread isolation, the embedded CLI,
/// tests): one per sandbox.
#[derive(Debug)]
pub struct Direct {
    gate: Mutex<Gate>,
}

impl Direct {
    pub fn new(config: Arc<NetConfig>) -> Direct {
        Direct { gate: Mutex::new(Gate::new(config)) }
    }

    pub fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Egress for Direct {
    fn connect(&self, domain: i32, dest: SocketAddr) -> Result<Opened, Refused> {
        let (v, config) = {
            let mut g = self.gate();
            (g.decide(dest), Arc::clone(g.config()))
        };
        if !v.allowed {
            return Err(Refused::Policy(v));
        }
        super::secrets::open_tcp(&config.secrets, &v, domain, dest).map_err(Refused::Host)
    }

    fn udp(&self, domain: i32, dest: SocketAddr) -> Result<Socket, Refused> {
        let v = self.gate().decide(dest);
        if !v.allowed {
            return Err(Refused::Policy(v));
        }
        open_udp(domain, dest).map_err(Refused::Host)
    }

    fn lookup(&self, name: &str) -> Resolution {
        self.gate().begin(name)
    }

    fn finish(&self, lookup: &resolver::Lookup) -> Resolved {
        self.gate().finish(lookup)
    }

    fn cancel_lookups(&self) {
        self.gate().cancel_lookups();
    }
}
