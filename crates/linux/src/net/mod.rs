//! Guest networking the gVisor-hostinet way: the VMM owns real, non-blocking
//! host sockets and moves bytes between them and guest memory; the guest
//! never holds a host fd. The host sockets come from the sandbox's egress
//! (`egress`: decided and opened in-process, or by a worker's broker): every
//! destination goes through the egress policy (`policy`), at connect time
//! for TCP and on the first datagram to each destination for UDP; the VMM's resolver (`dns`, answering the
//! guest's `/etc/resolv.conf` nameserver `RESOLVER`) resolves names on the
//! host (`resolver`: a bounded pool that never blocks the sandbox's thread)
//! and hands out only addresses the policy allows.
//!
//! Host sockets live here, in the per-sandbox `Kernel`, never in `Process`: the
//! fd table only holds a socket id. A snapshot, a resumed session or a fork
//! therefore never carries a live connection; an id with no host socket
//! behind it reads as reset (ECONNRESET, then EOF; writes EPIPE). Listeners
//! are the exception: a checkpoint records them (`ListenerState`) and a
//! restore makes them again under their ids (`restore_listeners`).
//!
//! Listening sockets are the sandbox's own (see `listen`): a TCP socket bound
//! to 127.0.0.0/8, ::1, 0.0.0.0 or :: takes a port of the sandbox's port
//! table (here, shared by all its processes), never a host port. A connect from
//! the sandbox to a loopback address where one of its listeners waits is
//! served by the VMM: the two ends are a host `socketpair(AF_UNIX)` the VMM
//! owns (so the kernel bounds their buffers and the waits of the engine work
//! on them unchanged) behind TCP's addresses and options. A listener's accept
//! queue is bounded by its backlog; its readiness is one byte per queued
//! connection in another socketpair. Loopback anywhere else (the host's own
//! services) stays under the egress policy, which denies it.

pub mod dns;
pub mod egress;
pub mod host_socket;
pub mod netlink;
pub mod policy;
pub mod resolver;
pub mod rewrite;
pub mod secrets;
pub mod tls;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use socket2::{Domain, Socket, Type};

use crate::errno::Errno;
pub use egress::{Direct, Egress, Gate, Opened, Refused, Resolution, Resolved, Verdict};
pub use policy::{Decision, Mode, Policy, Rule};

/// The nameserver in the guest's /etc/resolv.conf; UDP and TCP port 53 to it
/// are answered by the VMM (nothing is sent to that address on the host).
pub const RESOLVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 11);
pub const DNS_PORT: u16 = 53;

/// The guest's /etc/resolv.conf, /etc/hosts and /etc/nsswitch.conf.
pub const RESOLV_CONF: &[u8] = b"# Answered by the forkbox VMM (names resolved on the host, under the sandbox's egress policy).\nnameserver 127.0.0.11\noptions ndots:0 timeout:5 attempts:1\n";
/// The host name (`uname`'s nodename) resolves to loopback, as Debian's installer writes it.
pub const ETC_HOSTS: &[u8] = b"127.0.0.1\tlocalhost\n127.0.1.1\tforkbox\n::1\tlocalhost ip6-localhost ip6-loopback\n";
pub const NSSWITCH_CONF: &[u8] = b"hosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n";

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

/// A token bucket over the bytes a sandbox moves through its host sockets
/// (both directions together): `rate` bytes per second, at most `burst`
/// saved up. A datagram may overdraw it (it is sent whole); the debt is
/// paid back before anything else moves.
#[derive(Debug)]
struct Throttle {
    rate: u64,
    burst: u64,
    /// May go negative (a datagram's overdraft).
    tokens: i64,
    last: Instant,
}

impl Throttle {
    /// Less than this in the bucket is "empty": no call moves fewer bytes
    /// than it (unless the bucket holds fewer at most).
    const CHUNK: u64 = 16 << 10;

    fn new(rate: u64) -> Throttle {
        let rate = rate.max(1);
        let burst = (rate / 8).clamp(Self::CHUNK, 4 << 20);
        Throttle { rate, burst, tokens: i64::try_from(burst).unwrap_or(i64::MAX), last: Instant::now() }
    }

    fn chunk(&self) -> i64 {
        i64::try_from(Self::CHUNK.min(self.burst)).unwrap_or(i64::MAX)
    }

    /// Tokens earned since `last` (whole bytes).
    fn earned(&self, now: Instant) -> i64 {
        let ns = now.saturating_duration_since(self.last).as_nanos();
        let add = ns.saturating_mul(u128::from(self.rate)) / 1_000_000_000;
        i64::try_from(add).unwrap_or(i64::MAX)
    }

    fn refill(&mut self, now: Instant) {
        let add = self.earned(now);
        if add == 0 {
            return;
        }
        let burst = i64::try_from(self.burst).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(add).min(burst);
        self.last = now;
    }

    /// The bucket holds less than a chunk now (without refilling it).
    fn is_empty(&self) -> bool {
        self.tokens.saturating_add(self.earned(Instant::now())) < self.chunk()
    }

    /// Bytes that may move now (None: the bucket is empty, wait).
    fn available(&mut self) -> Option<u64> {
        self.refill(Instant::now());
        (self.tokens >= self.chunk()).then(|| u64::try_from(self.tokens).unwrap_or(0))
    }

    fn take(&mut self, n: u64) {
        self.tokens = self.tokens.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// When the bucket holds a chunk again (None: it does now).
    fn ready_at(&mut self) -> Option<Instant> {
        let now = Instant::now();
        self.refill(now);
        let missing = self.chunk().saturating_sub(self.tokens);
        if missing <= 0 {
            return None;
        }
        let ns = u128::from(missing.unsigned_abs()).saturating_mul(1_000_000_000) / u128::from(self.rate) + 1;
        let wait = Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX));
        Some(self.last.checked_add(wait).unwrap_or(now + Duration::from_secs(3600)))
    }
}

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

/// What a guest socket is on the host.
#[derive(Debug)]
enum Backend {
    /// A real host socket (non-blocking, close-on-exec).
    Host(Socket),
    /// Before its first way out: no host socket yet (the egress opens one for
    /// the destination; options set before are kept in `opts` and applied then).
    Unopened,
    /// UDP: a host socket per destination, each connect()ed to it (the egress
    /// opened them; at most `FLOWS_CAP`, the oldest goes first).
    Flows(Vec<(SocketAddr, Socket)>),
    /// Connected to the VMM's resolver over TCP: length-prefixed queries in, answers out.
    ResolverStream { input: Vec<u8>, output: VecDeque<u8>, shut_wr: bool },
    /// Listening inside the sandbox (no host socket takes a port).
    Listener(Box<Listener>),
}

/// A listening socket of the sandbox: connections made by `connect` wait in
/// `queue` (sockets of this `NetIo`, at most `backlog`) until accepted; each
/// holds one byte in `ready.1`, read back from `ready.0` by accept, so that
/// `ready.0` is readable exactly when the queue is not empty (the host fd the
/// engine waits on).
#[derive(Debug)]
struct Listener {
    ready: (Socket, Socket),
    queue: VecDeque<u64>,
    backlog: usize,
}

#[derive(Debug)]
struct Sock {
    domain: i32,
    stream: bool,
    backend: Backend,
    /// UDP: connected to the resolver (send/recv without an address go there).
    resolver_peer: bool,
    /// UDP: datagrams waiting for recv that never crossed the host: resolver
    /// answers, and datagrams from sockets of the sandbox (with their source).
    inbox: VecDeque<(Vec<u8>, SocketAddr, Ancillary)>,
    /// Questions to the resolver waiting for a host lookup (UDP or the TCP
    /// stream): answered into `inbox` / the stream's output once it is done.
    pending: VecDeque<(dns::Query, Arc<resolver::Lookup>)>,
    /// UDP: destinations the egress refused (bounded), so a datagram stream costs one check.
    udp_verdicts: HashMap<SocketAddr, bool>,
    /// Set by connect (the destination, for the UDP check of connected sends).
    peer: Option<SocketAddr>,
    /// TCP: a connect to this address is in progress on the host (a re-run or
    /// a repeated connect checks its outcome instead of starting another).
    connecting: Option<SocketAddr>,
    pub rcvtimeo: Option<Duration>,
    pub sndtimeo: Option<Duration>,
    /// TCP: the sandbox address this socket holds (bind, listen, or either
    /// end of a loopback connection inside the sandbox). UDP: its binding in
    /// the sandbox's own UDP port table (a loopback or wildcard address; never a host port).
    local: Option<SocketAddr>,
    /// TCP: the other end of a loopback connection inside the sandbox.
    loop_peer: Option<SocketAddr>,
    /// SO_REUSEADDR (or SO_REUSEPORT) was set.
    reuse: bool,
    /// TCP: a non-blocking connect inside the sandbox completed at once but
    /// was reported as EINPROGRESS; the next connect reports 0 (then EISCONN).
    connect_unreported: bool,
    /// UDP-Lite (IPPROTO_UDPLITE) rather than UDP: its own port table, and
    /// datagrams only between the sandbox's sockets (the egress carries TCP and UDP).
    lite: bool,
    /// Option values of a socket inside the sandbox that its host socket
    /// (AF_UNIX) does not take (TCP_NODELAY ...): kept, not applied (bounded).
    opts: BTreeMap<(i32, i32), Vec<u8>>,
    /// shutdown(SHUT_WR) (or SHUT_RDWR) was called on it.
    shut_wr: bool,
    /// TCP in the sandbox: a send found the peer closed. Linux takes that first
    /// send (the peer answers it with a reset) and fails the next with EPIPE.
    peer_reset: bool,
}

impl Sock {
    /// SO_REUSEADDR or SO_REUSEPORT as set. A socket restored from a checkpoint
    /// that recorded only the shared flag reads it as SO_REUSEADDR.
    fn reuse_opt(&self, name: i32) -> bool {
        let get = |n: i32| self.opts.get(&(libc::SOL_SOCKET, n));
        match get(name) {
            Some(v) => v.iter().any(|b| *b != 0),
            None if get(libc::SO_REUSEADDR).is_none() && get(libc::SO_REUSEPORT).is_none() => {
                name == libc::SO_REUSEADDR && self.reuse
            }
            None => false,
        }
    }

    /// The SO_REUSEADDR / SO_REUSEPORT values as set (what an accepted socket inherits).
    fn reuse_opts(&self) -> Vec<((i32, i32), Vec<u8>)> {
        [libc::SO_REUSEADDR, libc::SO_REUSEPORT]
            .into_iter()
            .filter_map(|n| self.opts.get(&(libc::SOL_SOCKET, n)).map(|v| ((libc::SOL_SOCKET, n), v.clone())))
            .collect()
    }

    /// IPV6_V6ONLY is set (an AF_INET6 socket's `::` binding is IPv6 only).
    fn v6only(&self) -> bool {
        v6only_in(self.domain, self.opts.get(&(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)).map(Vec::as_slice))
    }

    fn new(domain: i32, stream: bool, backend: Backend) -> Sock {
        Sock {
            domain,
            stream,
            backend,
            resolver_peer: false,
            inbox: VecDeque::new(),
            pending: VecDeque::new(),
            udp_verdicts: HashMap::new(),
            peer: None,
            connecting: None,
            rcvtimeo: None,
            sndtimeo: None,
            local: None,
            loop_peer: None,
            reuse: false,
            connect_unreported: false,
            lite: false,
            opts: BTreeMap::new(),
            shut_wr: false,
            peer_reset: false,
        }
    }

    /// A question to the resolver has its host lookup done (recv answers it).
    fn answer_ready(&self) -> bool {
        self.pending.iter().any(|(_, l)| l.is_done())
    }

    /// Queue an answer of the resolver: a stream's output, else the datagram
    /// inbox (full: dropped, as a busy server may).
    fn push_answer(&mut self, a: Vec<u8>) {
        match &mut self.backend {
            Backend::ResolverStream { output, .. } => {
                if output.len() + 2 + a.len() <= RESOLVER_STREAM_CAP {
                    output.extend((a.len() as u16).to_be_bytes());
                    output.extend(a);
                }
            }
            _ => {
                if self.inbox.len() < INBOX_CAP {
                    self.inbox.push_back((a, resolver_addr(), Ancillary::default()));
                }
            }
        }
    }

    /// Served inside the sandbox (a listener or an end of a loopback connection).
    fn in_sandbox(&self) -> bool {
        self.loop_peer.is_some() || matches!(self.backend, Backend::Listener(_))
    }
}

/// Linux's default hop limit / TTL (net.ipv6.conf.*.hop_limit, ip_default_ttl).
const DEFAULT_HOPS: i32 = 64;

/// IP header values of a datagram between the sandbox's sockets (what
/// IPV6_RECVHOPLIMIT / IPV6_RECVTCLASS report to its receiver).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ancillary {
    pub hop_limit: u8,
    pub tclass: u8,
}

/// Per-datagram values a sendmsg gives (-1 or None: the socket's own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Packet {
    pub hop_limit: Option<i32>,
    pub tclass: Option<i32>,
}

impl NetIo {
    /// Whether socket `id` has option `level`/`name` set to a non-zero int
    /// (the flags of RFC 3542 ancillary data a receiver asked for).
    pub fn flag_set(&self, id: u64, level: i32, name: i32) -> bool {
        self.socks
            .get(&id)
            .and_then(|s| s.opts.get(&(level, name)))
            .and_then(|v| v.get(..4)?.try_into().ok())
            .is_some_and(|b| i32::from_le_bytes(b) != 0)
    }
}

/// A listening socket as a checkpoint records it: what re-creates it in the
/// port table of a restored sandbox under the same socket id (the fd table
/// names it by that id). Its queued connections are not recorded: they were
/// host sockets, which read as reset after a restore.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerState {
    pub id: u64,
    /// AF_INET or AF_INET6.
    pub domain: i32,
    /// The bound address in the sandbox (loopback or wildcard).
    pub local: SocketAddr,
    /// The queue bound (listen's backlog + 1, at most `SOMAXCONN + 1`).
    pub backlog: u32,
    /// SO_REUSEADDR / SO_REUSEPORT.
    pub reuse: bool,
    pub rcvtimeo: Option<Duration>,
    pub sndtimeo: Option<Duration>,
    /// Option values kept for the socket (TCP_NODELAY ...), as set.
    pub opts: Vec<((i32, i32), Vec<u8>)>,
}

/// Why listeners of a checkpoint could not be re-created.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ListenerRestoreError {
    #[error("listener {0}: {1}")]
    Invalid(u64, &'static str),
    #[error("listeners: {0}")]
    Host(String),
}

/// Largest option value a recorded listener may carry (any real option is a few bytes).
const OPT_VALUE_CAP: usize = 256;

/// Why a connection from outside could not be handed to a listener of the sandbox.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InjectError {
    #[error("nothing in the sandbox listens on that port")]
    NotListening,
    #[error("the sandbox's server takes no more connections now: {0}")]
    Full(String),
}

/// The ephemeral port range (Linux's default ip_local_port_range).
const EPHEMERAL: (u16, u16) = (32768, 60999);
/// Largest listen backlog (Linux's default somaxconn).
const SOMAXCONN: usize = 4096;
/// Option values kept per in-sandbox socket.
const OPTS_CAP: usize = 32;

/// `ip` as IPv4 if it is one or IPv4-mapped (how an AF_INET6 socket spells IPv4).
fn as_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => v6.to_ipv4_mapped(),
    }
}

/// Is `ip` an address a sandbox TCP socket may bind (loopback or wildcard)?
fn sandbox_local(ip: IpAddr) -> bool {
    match as_v4(ip) {
        Some(v4) => v4.is_loopback() || v4.is_unspecified(),
        None => ip.is_loopback() || ip.is_unspecified(),
    }
}

/// A destination's address with IPv4-mapped forms as IPv4, and the wildcard
/// as loopback (a connect to 0.0.0.0 or :: reaches the local host on Linux).
fn loop_dest(addr: SocketAddr) -> SocketAddr {
    let ip = match as_v4(addr.ip()) {
        Some(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some(v4) => IpAddr::V4(v4),
        None if addr.ip().is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        None => addr.ip(),
    };
    SocketAddr::new(ip, addr.port())
}

/// Does a socket bound to `bound` (`v6only`: IPV6_V6ONLY set on it) take
/// connections to `dest` (from `loop_dest`)?
fn listener_takes(bound: SocketAddr, v6only: bool, dest: SocketAddr) -> bool {
    if bound.port() != dest.port() {
        return false;
    }
    let (v4, v6) = bind_scope(bound.ip(), v6only);
    match dest.ip() {
        IpAddr::V4(d) => v4.is_some_and(|b| b.is_none_or(|b| b == d)),
        IpAddr::V6(d) => v6.is_some_and(|b| b.is_none_or(|b| b == d)),
    }
}

/// The addresses a binding to `ip` holds, of IPv4 and of IPv6: None (none of
/// that family), Some(None) (that family's wildcard) or Some(Some(ip)). As
/// Linux: 0.0.0.0 and IPv4-mapped addresses are IPv4; `::` is both families
/// (an AF_INET6 socket is dual stack, /proc/sys/net/ipv6/bindv6only is 0)
/// unless IPV6_V6ONLY is set; any other IPv6 address is IPv6 only.
#[allow(clippy::type_complexity)]
fn bind_scope(ip: IpAddr, v6only: bool) -> (Option<Option<Ipv4Addr>>, Option<Option<std::net::Ipv6Addr>>) {
    match (as_v4(ip), ip) {
        (Some(v4), _) => (Some(Some(v4).filter(|v| !v.is_unspecified())), None),
        (None, IpAddr::V6(v6)) if v6.is_unspecified() => ((!v6only).then_some(None), Some(None)),
        (None, IpAddr::V6(v6)) => (None, Some(Some(v6))),
        (None, IpAddr::V4(_)) => (None, None),
    }
}

/// Is IPV6_V6ONLY set among a socket's option values (an AF_INET6 socket's only)?
fn v6only_in(domain: i32, val: Option<&[u8]>) -> bool {
    domain == libc::AF_INET6 && val.is_some_and(|v| v.iter().any(|b| *b != 0))
}

/// A bound address's IP as compared with destinations (None: the wildcard).
fn loop_dest_ip(ip: IpAddr) -> Option<IpAddr> {
    match as_v4(ip) {
        Some(v4) if v4.is_unspecified() => None,
        Some(v4) => Some(IpAddr::V4(v4)),
        None if ip.is_unspecified() => None,
        None => Some(ip),
    }
}

/// Do two bound addresses overlap (same port, and in one family the same IP
/// or a wildcard)? `a_v6only`, `b_v6only`: IPV6_V6ONLY is set on the socket (an IPv6-only
/// `::` leaves the IPv4 addresses of its port to others).
fn binds_overlap(a: SocketAddr, a_v6only: bool, b: SocketAddr, b_v6only: bool) -> bool {
    fn meet<T: PartialEq>(x: Option<Option<T>>, y: Option<Option<T>>) -> bool {
        match (x, y) {
            (Some(None), Some(_)) | (Some(_), Some(None)) => true,
            (Some(Some(x)), Some(Some(y))) => x == y,
            _ => false,
        }
    }
    let ((a4, a6), (b4, b6)) = (bind_scope(a.ip(), a_v6only), bind_scope(b.ip(), b_v6only));
    a.port() == b.port() && (meet(a4, b4) || meet(a6, b6))
}

fn unix_pair() -> Result<(Socket, Socket), Errno> {
    Socket::pair(Domain::UNIX, Type::STREAM.nonblocking().cloexec(), None).map_err(|e| host_errno(&e))
}

/// Largest message buffered for the TCP resolver stream, each way.
const RESOLVER_STREAM_CAP: usize = 2 + dns::MAX_MESSAGE;
/// Resolver answers queued on one UDP socket.
const INBOX_CAP: usize = 16;
/// Bytes of datagrams from the sandbox's own sockets one UDP socket holds
/// unread (Linux's default receive buffer); beyond, datagrams are dropped, as UDP may.
const INBOX_BYTES: usize = 212_992;
/// Datagrams one UDP socket holds unread from the sandbox's own sockets.
const LOCAL_INBOX_CAP: usize = 256;
const VERDICT_CAP: usize = 256;
/// Destinations one UDP socket has host sockets for.
const FLOWS_CAP: usize = 16;
/// Questions one sandbox may have waiting for host lookups, over all its
/// sockets (each holds its lookup's eventfd until the guest reads the answer).
const QUESTIONS_WAITING: usize = 64;

/// The host-side network state of one running sandbox (part of `Kernel`, never
/// snapshotted but for its listeners' `ListenerState`).
#[derive(Debug)]
pub struct NetIo {
    pub config: Arc<NetConfig>,
    /// Random per instance, so a socket id from a snapshot never names a socket of this one.
    nonce: u64,
    next: u64,
    socks: HashMap<u64, Sock>,
    /// The way out: decides destinations and names, opens the host connections.
    egress: Arc<dyn Egress>,
    pub stats: NetStats,
    /// One-line notes for the guest's stderr (refusals), drained by the syscall layer.
    pub notes: Vec<String>,
    byte_limit_noted: bool,
    /// The bandwidth limit (None: unlimited). Never snapshotted: a resumed
    /// sandbox starts with a full bucket.
    throttle: Option<Throttle>,
}

impl Default for NetIo {
    fn default() -> Self {
        NetIo::new(Arc::new(NetConfig::default()))
    }
}

fn nonce() -> u64 {
    let mut b = [0u8; 8];
    let _ = crate::random::fill_random(&mut b);
    u64::from_le_bytes(b) & 0xFFFF_FFFF_0000_0000
}

pub fn host_errno(e: &std::io::Error) -> Errno {
    Errno(e.raw_os_error().unwrap_or(libc::EIO))
}

/// What the bandwidth limit holds back while its bucket is empty.
const RATE_HELD: i16 = libc::POLLIN | libc::POLLOUT | libc::POLLRDNORM | libc::POLLWRNORM | libc::POLLPRI;

/// Readiness bits of a socket for poll (POLLIN, POLLOUT, POLLERR, POLLHUP, POLLRDHUP, POLLPRI).
pub const POLL_MASK: i16 =
    libc::POLLIN | libc::POLLOUT | libc::POLLPRI | libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP;

impl NetIo {
    /// Deciding and opening in this process ([`Direct`]).
    pub fn new(config: Arc<NetConfig>) -> NetIo {
        let egress = Arc::new(Direct::new(Arc::clone(&config)));
        NetIo::with_egress(config, egress)
    }

    /// Through `egress` (which holds the policy of `config`; `config` here
    /// gives the limits the VMM enforces: sockets, bytes, bandwidth).
    pub fn with_egress(config: Arc<NetConfig>, egress: Arc<dyn Egress>) -> NetIo {
        let throttle = config.max_bytes_per_second().map(Throttle::new);
        NetIo {
            config,
            nonce: nonce(),
            next: 1,
            socks: HashMap::new(),
            egress,
            stats: NetStats::default(),
            notes: Vec::new(),
            byte_limit_noted: false,
            throttle,
        }
    }

    /// [`Self::with_egress`] for a sandbox whose host-side state starts
    /// afresh (a new way out) but whose listeners stay: `old`'s listening
    /// sockets move here under their ids (their queued connections, host
    /// sockets of `old`, are dropped: their clients read EOF), and socket ids
    /// go on from `old`'s, so none is handed out twice.
    pub fn keeping_listeners(old: &mut NetIo, config: Arc<NetConfig>, egress: Arc<dyn Egress>) -> NetIo {
        let mut n = NetIo::with_egress(config, egress);
        n.nonce = old.nonce;
        n.next = old.next;
        let ids: Vec<u64> =
            old.socks.iter().filter(|(_, s)| matches!(s.backend, Backend::Listener(_))).map(|(id, _)| *id).collect();
        for id in ids {
            if let Some(mut s) = old.socks.remove(&id) {
                if let Backend::Listener(l) = &mut s.backend {
                    for _ in l.queue.drain(..) {
                        let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
                        let _ = l.ready.0.recv(&mut b);
                    }
                }
                n.socks.insert(id, s);
            }
        }
        n
    }

    /// Bytes a host socket may move now under the bandwidth limit (EAGAIN:
    /// the bucket is empty; poll shows the sockets not ready until
    /// [`Self::throttled_until`]).
    fn rate_budget(&mut self) -> Result<u64, Errno> {
        match &mut self.throttle {
            None => Ok(u64::MAX),
            Some(t) => t.available().ok_or(Errno::EAGAIN),
        }
    }

    fn rate_take(&mut self, n: u64) {
        if let Some(t) = &mut self.throttle {
            t.take(n);
        }
    }

    /// While the bandwidth limit holds the host sockets back: when it lets
    /// them move again (the engine re-runs blocked calls then).
    pub fn throttled_until(&mut self) -> Option<Instant> {
        self.throttle.as_mut()?.ready_at()
    }

    /// The host sockets move no bytes now (the bandwidth limit's bucket is empty).
    fn throttled(&self) -> bool {
        self.throttle.as_ref().is_some_and(Throttle::is_empty)
    }

    pub fn open_sockets(&self) -> usize {
        self.socks.len()
    }

    /// socket(): a new non-blocking host socket. Returns the socket id for the fd table.
    pub fn socket(&mut self, domain: i32, stream: bool) -> Result<u64, Errno> {
        if self.socks.len() >= self.config.max_sockets as usize {
            self.note(format!(
                "socket refused: the sandbox's limit of {} open sockets is reached",
                self.config.max_sockets
            ));
            return Err(Errno::EMFILE);
        }
        if domain != libc::AF_INET && domain != libc::AF_INET6 {
            return Err(Errno::EAFNOSUPPORT);
        }
        // The host socket comes from the egress, for a destination: TCP's at
        // connect, UDP's at its first datagram to each destination.
        let id = self.insert(Sock::new(domain, stream, Backend::Unopened));
        self.stats.sockets_opened += 1;
        Ok(id)
    }

    /// socket(AF_INET*, SOCK_DGRAM, IPPROTO_UDPLITE): a datagram socket that
    /// reaches the sandbox's UDP-Lite sockets only (see `Sock::lite`).
    pub fn socket_udplite(&mut self, domain: i32) -> Result<u64, Errno> {
        let id = self.socket(domain, false)?;
        self.sock(id)?.lite = true;
        Ok(id)
    }

    /// Whether TCP socket `id` is one end of a connection inside the sandbox.
    pub fn is_loop_connected(&self, id: u64) -> bool {
        self.socks.get(&id).is_some_and(|s| s.stream && s.loop_peer.is_some())
    }

    /// A non-blocking connect inside the sandbox is done but reported as in
    /// progress (as Linux, whose loopback handshake ends after the call): the
    /// next connect reports it done.
    pub fn defer_connect_report(&mut self, id: u64) {
        if let Some(s) = self.socks.get_mut(&id) {
            s.connect_unreported = true;
        }
    }

    /// Whether socket `id` is a UDP-Lite one.
    pub fn is_udplite(&self, id: u64) -> bool {
        self.socks.get(&id).is_some_and(|s| s.lite)
    }

    fn insert(&mut self, s: Sock) -> u64 {
        let id = self.nonce | self.next;
        self.next += 1;
        self.socks.insert(id, s);
        id
    }

    /// The guest closed the last fd of socket `id`. A listener's connections
    /// not yet accepted go with it (their clients read EOF).
    pub fn close(&mut self, id: u64) {
        if let Some(Sock { backend: Backend::Listener(l), .. }) = self.socks.remove(&id) {
            for q in l.queue {
                self.socks.remove(&q);
            }
        }
    }

    fn sock(&mut self, id: u64) -> Result<&mut Sock, Errno> {
        self.socks.get_mut(&id).ok_or(Errno::ECONNRESET)
    }

    pub fn is_live(&self, id: u64) -> bool {
        self.socks.contains_key(&id)
    }

    fn host(&mut self, id: u64) -> Result<&Socket, Errno> {
        match &self.sock(id)?.backend {
            Backend::Host(s) => Ok(s),
            Backend::Flows(f) => f.first().map(|(_, s)| s).ok_or(Errno::ENOTCONN),
            Backend::ResolverStream { .. } => Err(Errno::EOPNOTSUPP),
            Backend::Listener(_) | Backend::Unopened => Err(Errno::ENOTCONN),
        }
    }

    /// The host fd behind a socket, for waiting on it (never handed to the
    /// guest): a listener's is its readiness socket.
    pub fn host_fd(&self, id: u64) -> Option<i32> {
        match &self.socks.get(&id)?.backend {
            Backend::Host(s) => Some(s.as_raw_fd()),
            Backend::Flows(f) => f.first().map(|(_, s)| s.as_raw_fd()),
            Backend::ResolverStream { .. } | Backend::Unopened => None,
            Backend::Listener(l) => Some(l.ready.0.as_raw_fd()),
        }
    }

    pub fn is_listening(&self, id: u64) -> bool {
        matches!(self.socks.get(&id), Some(Sock { backend: Backend::Listener(_), .. }))
    }

    /// Is `addr` taken by a TCP socket other than `me`? As Linux: a
    /// listener always holds its port; any other socket holding it (bound, or
    /// an end of a connection) lets another have it only if both set SO_REUSEADDR.
    /// `v6only`: IPV6_V6ONLY is set on `me`.
    fn port_taken(&self, me: u64, addr: SocketAddr, reuse: bool, v6only: bool) -> bool {
        self.socks.iter().any(|(id, s)| {
            *id != me
                && s.stream
                && s.local.is_some_and(|l| binds_overlap(l, s.v6only(), addr, v6only))
                && (matches!(s.backend, Backend::Listener(_)) || !(reuse && s.reuse))
        })
    }

    /// A free ephemeral port for `ip` (EADDRINUSE when every one is taken).
    fn ephemeral(&mut self, me: u64, ip: IpAddr) -> Result<u16, Errno> {
        let span = (EPHEMERAL.1 - EPHEMERAL.0) as u64 + 1;
        let start = (self.nonce >> 32).wrapping_add(self.next.wrapping_mul(7919)) % span;
        let v6only = self.socks.get(&me).is_some_and(Sock::v6only);
        for k in 0..span {
            let port = EPHEMERAL.0 + ((start + k) % span) as u16;
            if !self.port_taken(me, SocketAddr::new(ip, port), false, v6only) {
                return Ok(port);
            }
        }
        Err(Errno::EADDRINUSE)
    }

    /// A listener of the sandbox that takes a connect to `dest`.
    fn find_listener(&self, dest: SocketAddr) -> Option<u64> {
        let dest = loop_dest(dest);
        if !sandbox_local(dest.ip()) {
            return None;
        }
        self.socks.iter().find_map(|(id, s)| match (&s.backend, s.local) {
            (Backend::Listener(_), Some(l)) if listener_takes(l, s.v6only(), dest) => Some(*id),
            _ => None,
        })
    }

    /// listen(): the socket becomes a listener of the sandbox (bound to an
    /// ephemeral port of the wildcard first if it was not bound).
    pub fn listen(&mut self, id: u64, backlog: i32) -> Result<(), Errno> {
        let s = self.sock(id)?;
        if !s.stream {
            return Err(Errno::EOPNOTSUPP);
        }
        let backlog = (backlog.max(0) as usize).min(SOMAXCONN) + 1;
        match &mut s.backend {
            Backend::Listener(l) => {
                l.backlog = backlog;
                return Ok(());
            }
            Backend::ResolverStream { .. } => return Err(Errno::EINVAL),
            Backend::Host(_) | Backend::Unopened | Backend::Flows(_) => {}
        }
        if s.loop_peer.is_some() || s.peer.is_some() || s.connecting.is_some() {
            return Err(Errno::EINVAL);
        }
        let (local, reuse, domain, v6only) = (s.local, s.reuse, s.domain, s.v6only());
        let local = match local {
            Some(l) => {
                if self.port_taken(id, l, reuse, v6only) {
                    return Err(Errno::EADDRINUSE);
                }
                l
            }
            None => {
                let any = unspecified(domain).ip();
                let port = self.ephemeral(id, any)?;
                SocketAddr::new(any, port)
            }
        };
        let ready = unix_pair()?;
        let s = self.sock(id)?;
        s.local = Some(local);
        s.backend = Backend::Listener(Box::new(Listener { ready, queue: VecDeque::new(), backlog }));
        Ok(())
    }

    /// Every listening TCP socket of the sandbox: its bound address, and
    /// whether the port proxy reaches it (a connect to 127.0.0.1 or [::1] on
    /// its port lands on it). By port, then address.
    pub fn listening(&self) -> Vec<(SocketAddr, bool)> {
        let mut out: Vec<(SocketAddr, bool)> = self
            .socks
            .values()
            .filter_map(|s| match (&s.backend, s.local) {
                (Backend::Listener(_), Some(l)) => {
                    let proxied = [IpAddr::from(Ipv4Addr::LOCALHOST), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)]
                        .into_iter()
                        .any(|ip| listener_takes(l, s.v6only(), SocketAddr::new(ip, l.port())));
                    Some((l, proxied))
                }
                _ => None,
            })
            .collect();
        out.sort_by_key(|(a, _)| (a.port(), a.to_string()));
        out
    }

    /// The listening sockets among `ids` as a checkpoint records them (the
    /// ids of the recorded process' sockets; others are skipped), by id.
    pub fn listener_states(&self, ids: impl IntoIterator<Item = u64>) -> Vec<ListenerState> {
        let mut out: Vec<ListenerState> = ids
            .into_iter()
            .filter_map(|id| {
                let s = self.socks.get(&id)?;
                let (Backend::Listener(l), Some(local)) = (&s.backend, s.local) else { return None };
                Some(ListenerState {
                    id,
                    domain: s.domain,
                    local,
                    backlog: u32::try_from(l.backlog).unwrap_or(u32::MAX),
                    reuse: s.reuse,
                    rcvtimeo: s.rcvtimeo,
                    sndtimeo: s.sndtimeo,
                    opts: s.opts.iter().map(|(k, v)| (*k, v.clone())).collect(),
                })
            })
            .collect();
        out.sort_by_key(|l| l.id);
        out.dedup_by_key(|l| l.id);
        out
    }

    /// Re-create the listeners of a checkpoint (each under its recorded id,
    /// with an empty queue) in this sandbox's port table. All or none: a
    /// record that is not one `listen` could have made is refused.
    pub fn restore_listeners(&mut self, ls: &[ListenerState]) -> Result<(), ListenerRestoreError> {
        use ListenerRestoreError::Invalid;
        if ls.is_empty() {
            return Ok(());
        }
        if self.socks.len().saturating_add(ls.len()) > self.config.max_sockets as usize {
            return Err(ListenerRestoreError::Host(format!(
                "{} listening sockets exceed the sandbox's limit of {} open sockets",
                ls.len(),
                self.config.max_sockets
            )));
        }
        for (i, l) in ls.iter().enumerate() {
            let bad = |why| Err(Invalid(l.id, why));
            if l.domain != libc::AF_INET && l.domain != libc::AF_INET6 {
                return bad("not an AF_INET or AF_INET6 socket");
            }
            if l.domain == libc::AF_INET && l.local.is_ipv6() {
                return bad("an IPv6 address on an AF_INET socket");
            }
            if !sandbox_local(l.local.ip()) || l.local.port() == 0 {
                return bad("not a loopback or wildcard address with a port");
            }
            if l.backlog == 0 || l.backlog as usize > SOMAXCONN + 1 {
                return bad("backlog out of range");
            }
            if l.opts.len() > OPTS_CAP || l.opts.iter().any(|(_, v)| v.len() > OPT_VALUE_CAP) {
                return bad("too many or too large options");
            }
            if l.id & !0xFFFF_FFFF_0000_0000 == 0 || self.socks.contains_key(&l.id) {
                return bad("socket id not a socket's or taken");
            }
            // Listeners hold their ports (the record holds no two that overlap).
            let v6only = |l: &ListenerState| {
                let opt = l.opts.iter().find(|(k, _)| *k == (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY));
                v6only_in(l.domain, opt.map(|(_, v)| v.as_slice()))
            };
            if ls[..i].iter().any(|o| o.id == l.id || binds_overlap(o.local, v6only(o), l.local, v6only(l))) {
                return bad("its port is taken by another listener");
            }
            if self.port_taken(l.id, l.local, l.reuse, v6only(l)) {
                return bad("its port is taken");
            }
        }
        // New sockets of this instance never take a recorded id (the nonce is random: a
        // collision of its 32 bits with a recorded one is rare, but then draw another).
        let mut draws = 0;
        while ls.iter().any(|l| l.id & 0xFFFF_FFFF_0000_0000 == self.nonce) {
            draws += 1;
            if draws > 16 {
                return Err(ListenerRestoreError::Host("no socket ids apart from the recorded ones".into()));
            }
            self.nonce = nonce();
        }
        let mut made = Vec::with_capacity(ls.len());
        for l in ls {
            let ready = match unix_pair() {
                Ok(r) => r,
                Err(e) => {
                    for id in made {
                        self.socks.remove(&id);
                    }
                    return Err(ListenerRestoreError::Host(format!("a listener's readiness socket: {e}")));
                }
            };
            let mut s = Sock::new(
                l.domain,
                true,
                Backend::Listener(Box::new(Listener { ready, queue: VecDeque::new(), backlog: l.backlog as usize })),
            );
            s.local = Some(l.local);
            s.reuse = l.reuse;
            s.rcvtimeo = l.rcvtimeo;
            s.sndtimeo = l.sndtimeo;
            s.opts = l.opts.iter().cloned().collect();
            self.socks.insert(l.id, s);
            made.push(l.id);
        }
        Ok(())
    }

    /// accept(): the next queued connection (its socket id and the peer's
    /// address); EAGAIN when none waits. A socket with no state behind it
    /// (restored from a snapshot: its listener is gone) is EINVAL.
    pub fn accept(&mut self, id: u64) -> Result<(u64, SocketAddr), Errno> {
        let Some(Sock { backend: Backend::Listener(l), .. }) = self.socks.get_mut(&id) else {
            return Err(Errno::EINVAL);
        };
        let c = l.queue.pop_front().ok_or(Errno::EAGAIN)?;
        let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        let _ = l.ready.0.recv(&mut b);
        let peer = self.socks.get(&c).and_then(|s| s.loop_peer).ok_or(Errno(libc::ECONNABORTED))?;
        Ok((c, peer))
    }

    /// A connect to a listener of the sandbox: both ends made now (the
    /// connection is established at once), the server's end queued.
    fn loop_connect(&mut self, id: u64, lid: u64, dest: SocketAddr) -> Result<bool, Errno> {
        let dest = loop_dest(dest);
        let s = self.sock(id)?;
        if s.loop_peer.is_some() {
            return Err(Errno::EISCONN);
        }
        if s.in_sandbox() {
            return Err(Errno::EINVAL);
        }
        let bound = s.local;
        let Some(Sock { backend: Backend::Listener(l), domain: ldomain, reuse: lreuse, .. }) = self.socks.get(&lid)
        else {
            return Err(Errno::ECONNREFUSED);
        };
        let (ldomain, lreuse) = (*ldomain, *lreuse);
        let lopts = self.socks.get(&lid).map(Sock::reuse_opts).unwrap_or_default();
        if l.queue.len() >= l.backlog {
            self.note(format!("connect to {dest} refused: the listen backlog of the sandbox's server is full"));
            return Err(Errno::ECONNREFUSED);
        }
        if self.socks.len() >= self.config.max_sockets as usize {
            self.note(format!(
                "connect to {dest} refused: the sandbox's limit of {} open sockets is reached",
                self.config.max_sockets
            ));
            return Err(Errno::ECONNREFUSED);
        }
        // The client's address: its bound one (a wildcard becomes the destination's IP), else an ephemeral port.
        let client = match bound {
            Some(b) if loop_dest_ip(b.ip()).is_some() => b,
            Some(b) => SocketAddr::new(dest.ip(), b.port()),
            None => SocketAddr::new(dest.ip(), self.ephemeral(id, dest.ip())?),
        };
        let (a, b) = unix_pair()?;
        let mut server = Sock::new(ldomain, true, Backend::Host(b));
        server.local = Some(dest);
        server.loop_peer = Some(client);
        // An accepted socket inherits the listener's SO_REUSEADDR and SO_REUSEPORT.
        server.reuse = lreuse;
        server.opts.extend(lopts);
        let sid = self.insert(server);
        let s = self.sock(id)?;
        s.backend = Backend::Host(a);
        s.local = Some(client);
        s.loop_peer = Some(dest);
        self.stats.loopback_connects += 1;
        if let Some(Sock { backend: Backend::Listener(l), .. }) = self.socks.get_mut(&lid) {
            l.queue.push_back(sid);
            let _ = l.ready.1.send(&[1]);
        }
        Ok(true)
    }

    /// A connection from outside the sandbox to its listener on `port` (the
    /// port proxy): `conn` (one end of a host `socketpair(AF_UNIX, SOCK_STREAM)`
    /// whose other end the caller keeps) is queued on the listener that takes
    /// a connect to 127.0.0.1:`port` (else [::1]:`port`) as an accepted
    /// connection from 127.0.0.1 (or ::1) and an ephemeral port. Only a
    /// listener of this sandbox can take it: never a host port.
    pub fn inject(&mut self, port: u16, conn: std::os::fd::OwnedFd) -> Result<(), InjectError> {
        let conn = Socket::from(conn);
        if port == 0 {
            return Err(InjectError::NotListening);
        }
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
        let (lid, dest) = match (self.find_listener(v4), self.find_listener(v6)) {
            (Some(l), _) => (l, v4),
            (None, Some(l)) => (l, v6),
            (None, None) => return Err(InjectError::NotListening),
        };
        let Some(Sock { backend: Backend::Listener(l), domain: ldomain, reuse: lreuse, .. }) = self.socks.get(&lid)
        else {
            return Err(InjectError::NotListening);
        };
        let (ldomain, lreuse) = (*ldomain, *lreuse);
        let lopts = self.socks.get(&lid).map(Sock::reuse_opts).unwrap_or_default();
        if l.queue.len() >= l.backlog {
            return Err(InjectError::Full("the listen backlog of the sandbox's server is full".into()));
        }
        if self.socks.len() >= self.config.max_sockets as usize {
            let n = self.config.max_sockets;
            return Err(InjectError::Full(format!("the sandbox's limit of {n} open sockets is reached")));
        }
        conn.set_nonblocking(true).map_err(|e| InjectError::Full(format!("the connection's socket: {e}")))?;
        let client = SocketAddr::new(dest.ip(), self.ephemeral(u64::MAX, dest.ip()).unwrap_or(EPHEMERAL.0));
        let mut server = Sock::new(ldomain, true, Backend::Host(conn));
        server.local = Some(dest);
        server.loop_peer = Some(client);
        server.reuse = lreuse;
        server.opts.extend(lopts);
        let sid = self.insert(server);
        self.stats.injected_connects += 1;
        if let Some(Sock { backend: Backend::Listener(l), .. }) = self.socks.get_mut(&lid) {
            l.queue.push_back(sid);
            // The listener's readiness fd: wakes a thread blocked in accept (or poll) at once.
            let _ = l.ready.1.send(&[1]);
        }
        Ok(())
    }

    pub fn timeouts(&self, id: u64) -> (Option<Duration>, Option<Duration>) {
        self.socks.get(&id).map_or((None, None), |s| (s.rcvtimeo, s.sndtimeo))
    }

    pub fn set_timeout(&mut self, id: u64, rcv: bool, t: Option<Duration>) -> Result<(), Errno> {
        let s = self.sock(id)?;
        if rcv {
            s.rcvtimeo = t;
        } else {
            s.sndtimeo = t;
        }
        Ok(())
    }

    pub fn note(&mut self, msg: String) {
        tracing::info!(target: "forkbox::net", "{msg}");
        let msg = format!("forkbox: {msg}\n");
        // The A and AAAA questions of one lookup say the same thing: once.
        if self.notes.len() < 64 && !self.notes.contains(&msg) {
            self.notes.push(msg);
        }
    }

    /// The host socket of UDP socket `id` for `dest`: one it has, else a
    /// new one from the egress (a refusal is remembered: ECONNREFUSED).
    fn flow(&mut self, id: u64, dest: SocketAddr) -> Result<&Socket, Errno> {
        let s = self.sock(id)?;
        let has = matches!(&s.backend, Backend::Flows(f) if f.iter().any(|(d, _)| *d == dest));
        if !has {
            if s.udp_verdicts.contains_key(&dest) {
                return Err(Errno::ECONNREFUSED);
            }
            let domain = s.domain;
            match self.egress.udp(domain, dest) {
                Ok(sock) => {
                    self.count_allowed(dest, "datagram to");
                    let s = self.sock(id)?;
                    let fd = sock.as_raw_fd();
                    for ((level, name), val) in &s.opts {
                        // SAFETY: val is a readable buffer of its length.
                        unsafe {
                            libc::setsockopt(fd, *level, *name, val.as_ptr().cast(), val.len() as libc::socklen_t)
                        };
                    }
                    match &mut s.backend {
                        Backend::Flows(f) => {
                            if f.len() >= FLOWS_CAP {
                                f.remove(0);
                            }
                            f.push((dest, sock));
                        }
                        b => *b = Backend::Flows(vec![(dest, sock)]),
                    }
                }
                Err(Refused::Policy(v)) => {
                    self.count(dest, "datagram to", &v);
                    let s = self.sock(id)?;
                    if s.udp_verdicts.len() >= VERDICT_CAP {
                        s.udp_verdicts.clear();
                    }
                    s.udp_verdicts.insert(dest, false);
                    return Err(Errno::ECONNREFUSED);
                }
                Err(Refused::Host(e)) => {
                    self.count_allowed(dest, "datagram to");
                    return Err(e);
                }
            }
        }
        match &self.sock(id)?.backend {
            Backend::Flows(f) => f.iter().find(|(d, _)| *d == dest).map(|(_, s)| s).ok_or(Errno::ECONNREFUSED),
            _ => Err(Errno::ECONNREFUSED),
        }
    }

    /// Count, log and (a denial) note a decision of the egress.
    fn count(&mut self, addr: SocketAddr, what: &str, v: &Verdict) {
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

    /// A TCP connect to `addr` out of the sandbox: the egress decides and
    /// opens the host socket (options set before are applied to it).
    fn connect_out(&mut self, id: u64, addr: SocketAddr) -> Result<bool, Errno> {
        let s = self.sock(id)?;
        if let Backend::Host(h) = &s.backend {
            if s.connecting.is_some() {
                return Err(Errno::EALREADY);
            }
            if h.peer_addr().is_ok() {
                return Err(Errno::EISCONN);
            }
        }
        let domain = s.domain;
        let opened = match self.egress.connect(domain, addr) {
            Ok(o) => o,
            Err(Refused::Policy(v)) => {
                self.count(addr, "connect to", &v);
                return Err(Errno::ECONNREFUSED);
            }
            Err(Refused::Host(e)) => {
                self.count_allowed(addr, "connect to");
                return Err(e);
            }
        };
        self.count_allowed(addr, "connect to");
        let s = self.sock(id)?;
        let fd = opened.socket.as_raw_fd();
        for ((level, name), val) in std::mem::take(&mut s.opts) {
            // SAFETY: val is a readable buffer of its length. A refused option was the guest's to get wrong.
            unsafe { libc::setsockopt(fd, level, name, val.as_ptr().cast(), val.len() as libc::socklen_t) };
        }
        s.backend = Backend::Host(opened.socket);
        s.resolver_peer = false;
        s.peer = Some(addr);
        if opened.connected {
            s.connecting = None;
            Ok(true)
        } else {
            s.connecting = Some(addr);
            Ok(false)
        }
    }

    fn count_allowed(&mut self, addr: SocketAddr, what: &str) {
        self.stats.connects_allowed += 1;
        GLOBAL.connects_allowed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: "forkbox::net", "{what} {addr} allowed");
    }

    fn account(&mut self, sent: u64, received: u64) {
        self.stats.bytes_sent += sent;
        self.stats.bytes_received += received;
        GLOBAL.bytes_sent.fetch_add(sent, Ordering::Relaxed);
        GLOBAL.bytes_received.fetch_add(received, Ordering::Relaxed);
    }

    /// Bytes left under the sandbox's byte limit (ENOBUFS once it is spent).
    fn budget(&mut self) -> Result<u64, Errno> {
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

    /// connect(). `Ok(true)`: connected; `Ok(false)`: in progress (wait for
    /// POLLOUT, then SO_ERROR). A denied destination is ECONNREFUSED.
    pub fn connect(&mut self, id: u64, addr: Option<SocketAddr>) -> Result<bool, Errno> {
        let s = self.sock(id)?;
        let stream = s.stream;
        let Some(addr) = addr else {
            // AF_UNSPEC: dissolve a UDP association.
            if stream {
                return Err(Errno::EAFNOSUPPORT);
            }
            // Its host sockets stay, each connected to its own destination.
            s.resolver_peer = false;
            s.peer = None;
            return Ok(true);
        };
        if stream && s.in_sandbox() {
            if s.loop_peer.is_some() && std::mem::take(&mut s.connect_unreported) {
                return Ok(true);
            }
            return Err(if s.loop_peer.is_some() { Errno::EISCONN } else { Errno::EINVAL });
        }
        if is_resolver(addr) {
            if stream {
                if matches!(s.backend, Backend::ResolverStream { .. }) {
                    return Err(Errno::EISCONN);
                }
                s.backend = Backend::ResolverStream { input: Vec::new(), output: VecDeque::new(), shut_wr: false };
            } else {
                s.resolver_peer = true;
                s.peer = Some(addr);
            }
            return Ok(true);
        }
        if stream && s.connecting == Some(addr) {
            return self.connect_outcome(id);
        }
        if stream {
            if let Some(lid) = self.find_listener(addr) {
                return self.loop_connect(id, lid, addr);
            }
        }
        if stream {
            return self.connect_out(id, addr);
        }
        // UDP: connecting sends nothing; the egress decides (and opens the
        // host socket) at the first datagram.
        let s = self.sock(id)?;
        s.resolver_peer = false;
        s.peer = Some(addr);
        Ok(true)
    }

    /// The state of a connect in progress: done, failed (its error), or still going.
    fn connect_outcome(&mut self, id: u64) -> Result<bool, Errno> {
        let fd = self.host(id)?.as_raw_fd();
        let err = self.host(id)?.take_error().map_err(|e| host_errno(&e))?;
        if let Some(e) = err {
            self.sock(id)?.connecting = None;
            return Err(host_errno(&e));
        }
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n > 0 && p.revents & libc::POLLOUT != 0 {
            self.sock(id)?.connecting = None;
            return Ok(true);
        }
        Ok(false)
    }

    /// send/sendto/write. `to`: the destination of an unconnected datagram.
    pub fn send(&mut self, id: u64, data: &[u8], to: Option<SocketAddr>, flags: i32) -> Result<usize, Errno> {
        self.send_with(id, data, to, flags, Packet::default())
    }

    /// `send` with per-datagram IP header values (sendmsg's IPV6_HOPLIMIT /
    /// IPV6_TCLASS ancillary data). They reach the sandbox's own sockets; a
    /// datagram to the outside leaves with the host socket's values.
    pub fn send_with(
        &mut self,
        id: u64,
        data: &[u8],
        to: Option<SocketAddr>,
        flags: i32,
        pkt: Packet,
    ) -> Result<usize, Errno> {
        // A reset socket (restored from a snapshot) takes no more data.
        let s = self.socks.get_mut(&id).ok_or(Errno::EPIPE)?;
        if s.loop_peer.is_some() {
            // Inside the sandbox: no egress, no byte budget (the socketpair's buffer bounds it).
            let Backend::Host(h) = &s.backend else { return Err(Errno::ENOTCONN) };
            let flags = (flags & libc::MSG_MORE) | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
            return match h.send_with_flags(data, flags).map_err(|e| host_errno(&e)) {
                // The peer closed (not our own shutdown): the first send goes
                // out as on Linux and is lost; the next one fails.
                Err(Errno::EPIPE) if !s.shut_wr && !s.peer_reset => {
                    s.peer_reset = true;
                    Ok(data.len())
                }
                r => r,
            };
        }
        if matches!(s.backend, Backend::Listener(_)) {
            return Err(Errno::ENOTCONN);
        }
        if s.stream && matches!(s.backend, Backend::Unopened) {
            // As Linux: a TCP socket that never connected.
            return Err(Errno::EPIPE);
        }
        let budget = self.budget()?;
        let s = self.socks.get_mut(&id).ok_or(Errno::EPIPE)?;
        let stream = s.stream;
        if let Backend::ResolverStream { input, output, shut_wr } = &mut s.backend {
            if *shut_wr {
                return Err(Errno::EPIPE);
            }
            if input.len() + data.len() > RESOLVER_STREAM_CAP {
                return Err(Errno::EMSGSIZE);
            }
            input.extend_from_slice(data);
            let mut answers = Vec::new();
            while input.len() >= 2 {
                let n = u16::from_be_bytes([input[0], input[1]]) as usize;
                if input.len() < 2 + n {
                    break;
                }
                let msg: Vec<u8> = input.drain(..2 + n).skip(2).collect();
                answers.push(msg);
            }
            let _ = output;
            for q in answers {
                let r = self.answer(&q);
                self.reply(id, r);
            }
            return Ok(data.len());
        }
        let dest = if stream { None } else { to.or(s.peer) };
        if !stream && s.lite {
            let dest = dest.ok_or(Errno::EDESTADDRREQ)?;
            if let Some(rid) = self.find_udp_receiver(id, dest) {
                return self.deliver_local(id, rid, data, pkt);
            }
            // Nothing of the sandbox bound there: dropped, as Linux drops a
            // datagram for a closed port; anywhere else is out of reach.
            return if sandbox_local(loop_dest(dest).ip()) { Ok(data.len()) } else { Err(Errno::ENETUNREACH) };
        }
        if !stream {
            let dest = dest.ok_or(Errno::EDESTADDRREQ)?;
            if is_resolver(dest) || (to.is_none() && s.resolver_peer) {
                if data.len() > dns::MAX_MESSAGE {
                    return Err(Errno::EMSGSIZE);
                }
                let r = self.answer(data);
                self.reply(id, r);
                return Ok(data.len());
            }
            // To a UDP socket of the sandbox: delivered by the VMM, never on the host.
            if let Some(rid) = self.find_udp_receiver(id, dest) {
                return self.deliver_local(id, rid, data, pkt);
            }
            match self.flow(id, dest) {
                Ok(_) => {}
                // A loopback port no socket of the sandbox holds and the policy
                // keeps closed: dropped, as Linux drops a datagram for a closed
                // port (an unconnected socket never learns of the ICMP error).
                Err(Errno::ECONNREFUSED) if to.is_some() && sandbox_local(loop_dest(dest).ip()) => {
                    return Ok(data.len())
                }
                Err(e) => return Err(e),
            }
        }
        let rate = self.rate_budget()?;
        let cap = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
        let data = if stream { &data[..data.len().min(cap(budget)).min(cap(rate))] } else { data };
        let host = match dest {
            Some(d) if !stream => self.flow(id, d)?,
            _ => self.host(id)?,
        };
        let flags = (flags & (libc::MSG_MORE | libc::MSG_EOR)) | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        let n = host.send_with_flags(data, flags).map_err(|e| host_errno(&e))?;
        self.account(n as u64, 0);
        self.rate_take(n as u64);
        Ok(n)
    }

    /// recv/recvfrom/read: into `buf`; returns the length (the datagram's full
    /// length with MSG_TRUNC) and the source address of a datagram.
    pub fn recv(&mut self, id: u64, buf: &mut [u8], flags: i32) -> Result<(usize, Option<SocketAddr>, bool), Errno> {
        self.recv_ancillary(id, buf, flags, &mut None)
    }

    /// `recv`, and the IP header values of a datagram from the sandbox's own
    /// sockets into `anc` (None for what came over a host socket).
    pub fn recv_ancillary(
        &mut self,
        id: u64,
        buf: &mut [u8],
        flags: i32,
        anc: &mut Option<Ancillary>,
    ) -> Result<(usize, Option<SocketAddr>, bool), Errno> {
        self.harvest(id);
        let local = self.socks.get(&id).is_some_and(|s| s.in_sandbox());
        if !local {
            self.budget()?;
        }
        let s = self.sock(id)?;
        let peek = flags & libc::MSG_PEEK != 0;
        if let Backend::ResolverStream { output, .. } = &mut s.backend {
            if output.is_empty() {
                return Err(Errno::EAGAIN);
            }
            let n = buf.len().min(output.len());
            for (d, b) in buf.iter_mut().zip(output.iter()) {
                *d = *b;
            }
            if !peek {
                output.drain(..n);
            }
            return Ok((n, Some(resolver_addr()), false));
        }
        if !s.stream && !s.inbox.is_empty() {
            let item = if peek { s.inbox.front().cloned() } else { s.inbox.pop_front() };
            let (msg, src, a) = item.unwrap_or_else(|| (Vec::new(), resolver_addr(), Ancillary::default()));
            *anc = Some(a);
            let n = buf.len().min(msg.len());
            buf[..n].copy_from_slice(&msg[..n]);
            let truncated = msg.len() > n;
            let len = if flags & libc::MSG_TRUNC != 0 { msg.len() } else { n };
            return Ok((len, Some(src), truncated));
        }
        let stream = s.stream;
        // The bandwidth limit: a stream reads at most what the bucket holds
        // (a datagram is read whole and may overdraw it).
        let buf = if local {
            buf
        } else {
            let rate = self.rate_budget()?;
            let n = if stream { buf.len().min(usize::try_from(rate).unwrap_or(usize::MAX)) } else { buf.len() };
            &mut buf[..n]
        };
        let flags = (flags & (libc::MSG_PEEK | libc::MSG_TRUNC | libc::MSG_WAITALL)) | libc::MSG_DONTWAIT;
        // UDP: the first of its destinations' host sockets with a datagram.
        let fds: Vec<i32> = match &self.sock(id)?.backend {
            Backend::Flows(f) => f.iter().map(|(_, s)| s.as_raw_fd()).collect(),
            Backend::Unopened if !stream => return Err(Errno::EAGAIN),
            _ => vec![self.host(id)?.as_raw_fd()],
        };
        let mut got = Err(Errno::EAGAIN);
        for fd in fds {
            got = recv_host(fd, buf, flags & !libc::MSG_WAITALL);
            if !matches!(got, Err(Errno::EAGAIN)) {
                break;
            }
        }
        let (n, from, from_len, truncated) = got?;
        if !peek && !local {
            self.account(0, n.min(buf.len()) as u64);
            self.rate_take(n.min(buf.len()) as u64);
        }
        let src = if stream || from_len == 0 { None } else { from_storage(&from, from_len as usize) };
        Ok((n, src, truncated))
    }

    pub fn shutdown(&mut self, id: u64, how: i32) -> Result<(), Errno> {
        let s = self.sock(id)?;
        if let Backend::Listener(_) = s.backend {
            return Err(Errno::ENOTCONN);
        }
        if let Backend::ResolverStream { shut_wr, .. } = &mut s.backend {
            if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
                *shut_wr = true;
            }
            return Ok(());
        }
        let how = match how {
            libc::SHUT_RD => std::net::Shutdown::Read,
            libc::SHUT_WR => std::net::Shutdown::Write,
            libc::SHUT_RDWR => std::net::Shutdown::Both,
            _ => return Err(Errno::EINVAL),
        };
        self.host(id)?.shutdown(how).map_err(|e| host_errno(&e))?;
        if how != std::net::Shutdown::Read {
            self.sock(id)?.shut_wr = true;
        }
        Ok(())
    }

    /// Readiness for poll: the `POLL*` bits of `events` that hold, plus
    /// POLLERR/POLLHUP. A socket with no host socket behind it (restored from a
    /// snapshot) is reset: readable, writable, hung up, in error.
    pub fn poll(&self, id: u64, events: i16) -> i16 {
        let Some(s) = self.socks.get(&id) else {
            return (events & (libc::POLLIN | libc::POLLOUT | libc::POLLRDNORM | libc::POLLWRNORM))
                | libc::POLLHUP
                | libc::POLLERR;
        };
        let want = events & POLL_MASK | events & (libc::POLLRDNORM | libc::POLLWRNORM);
        match &s.backend {
            // Readable when a connection waits; never writable.
            Backend::Listener(l) => {
                if l.queue.is_empty() {
                    0
                } else {
                    events & (libc::POLLIN | libc::POLLRDNORM)
                }
            }
            // As Linux shows a TCP socket that never connected.
            Backend::Unopened if s.stream => events & (libc::POLLOUT | libc::POLLWRNORM) | libc::POLLHUP,
            Backend::Unopened => {
                let mut r = events & (libc::POLLOUT | libc::POLLWRNORM);
                if !s.inbox.is_empty() || s.answer_ready() {
                    r |= events & (libc::POLLIN | libc::POLLRDNORM);
                }
                r
            }
            Backend::Flows(f) => {
                let mut r = 0;
                if !s.inbox.is_empty() || s.answer_ready() {
                    r |= events & (libc::POLLIN | libc::POLLRDNORM);
                }
                let want = if self.throttled() { want & !RATE_HELD } else { want };
                for (_, h) in f {
                    let mut p = libc::pollfd { fd: h.as_raw_fd(), events: want, revents: 0 };
                    // SAFETY: one valid pollfd, zero timeout.
                    if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
                        r |= p.revents;
                    }
                }
                r
            }
            Backend::ResolverStream { output, .. } => {
                let mut r = events & (libc::POLLOUT | libc::POLLWRNORM);
                if !output.is_empty() || s.answer_ready() {
                    r |= events & (libc::POLLIN | libc::POLLRDNORM);
                }
                r
            }
            Backend::Host(h) => {
                let mut r = 0;
                if !s.stream && (!s.inbox.is_empty() || s.answer_ready()) {
                    r |= events & (libc::POLLIN | libc::POLLRDNORM);
                }
                // Held back by the bandwidth limit: not readable or writable yet.
                let want = if !s.in_sandbox() && self.throttled() { want & !RATE_HELD } else { want };
                let mut p = libc::pollfd { fd: h.as_raw_fd(), events: want, revents: 0 };
                // SAFETY: one valid pollfd, zero timeout.
                if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
                    r |= p.revents;
                }
                r
            }
        }
    }

    /// Host pollfds for the sockets among `ids` that have a host socket, to
    /// wait on them together.
    pub fn pollfd(&self, id: u64, events: i16) -> Option<libc::pollfd> {
        let fd = self.host_fd(id)?;
        if self.is_listening(id) {
            let events = events & (libc::POLLIN | libc::POLLRDNORM);
            return (events != 0).then_some(libc::pollfd { fd, events, revents: 0 });
        }
        let mut events = events & POLL_MASK | events & (libc::POLLRDNORM | libc::POLLWRNORM);
        // Held back by the bandwidth limit: the engine wakes at `throttled_until` instead.
        if !self.socks.get(&id).is_some_and(Sock::in_sandbox) && self.throttled() {
            events &= !RATE_HELD;
        }
        Some(libc::pollfd { fd, events, revents: 0 })
    }

    /// The eventfds of the host lookups that socket `id`'s questions to the
    /// resolver wait for: the engine waits on them with the host sockets, so
    /// an answer coming in ends the guest's wait.
    /// Also a UDP socket's host sockets past its first (`pollfd` gives that one).
    pub fn lookup_pollfds(&self, id: u64, events: i16, out: &mut Vec<libc::pollfd>) {
        let Some(s) = self.socks.get(&id) else { return };
        if let (Backend::Flows(f), Some(first)) = (&s.backend, self.pollfd(id, events)) {
            for (_, h) in f.iter().skip(1) {
                out.push(libc::pollfd { fd: h.as_raw_fd(), events: first.events, revents: 0 });
            }
        }
        if events & (libc::POLLIN | libc::POLLRDNORM) == 0 {
            return;
        }
        for (_, l) in &s.pending {
            let fd = l.fd();
            if !out.iter().any(|p| p.fd == fd) {
                out.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
        }
    }

    /// End every host lookup of this sandbox now with SERVFAIL (the exec was
    /// interrupted: the guest's resolver, which waits out its own timeout
    /// through signals, gets its answer at once).
    pub fn cancel_lookups(&mut self) {
        self.egress.cancel_lookups();
    }

    pub fn local_addr(&mut self, id: u64) -> Result<SocketAddr, Errno> {
        let s = self.sock(id)?;
        let domain = s.domain;
        if matches!(s.backend, Backend::ResolverStream { .. }) || s.resolver_peer {
            return Ok(SocketAddr::from(([127, 0, 0, 1], 40053)));
        }
        // Bound in the sandbox (unless connected out through the host since;
        // a UDP socket keeps its sandbox binding).
        if let Some(l) = s.local.filter(|_| !s.stream || (s.peer.is_none() && s.connecting.is_none())) {
            return Ok(l);
        }
        if matches!(s.backend, Backend::Unopened) {
            // A connected UDP socket with no host socket yet: the source address
            // the route to its peer gives, in the peer's family (an AF_INET6
            // socket connected to an IPv4 peer reports it v4-mapped, which
            // glibc's getaddrinfo asserts when it sorts its answers): loopback
            // for a peer of the sandbox, else unspecified (the host picks it).
            if let Some(p) = s.peer.filter(|_| !s.stream) {
                let local = sandbox_local(loop_dest(p).ip());
                let peer_ip = match p.ip() {
                    IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                    v4 => v4,
                };
                let ip = match (peer_ip, local) {
                    (IpAddr::V4(_), true) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    (IpAddr::V4(_), false) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                    (IpAddr::V6(_), true) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
                    (IpAddr::V6(_), false) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                };
                return Ok(SocketAddr::new(ip, 0));
            }
            return Ok(unspecified(domain));
        }
        let a = self.host(id)?.local_addr().map_err(|e| host_errno(&e))?;
        Ok(a.as_socket().unwrap_or_else(|| unspecified(domain)))
    }

    pub fn peer_addr(&mut self, id: u64) -> Result<SocketAddr, Errno> {
        let s = self.sock(id)?;
        if matches!(s.backend, Backend::ResolverStream { .. }) || s.resolver_peer {
            return Ok(resolver_addr());
        }
        if let Some(p) = s.loop_peer {
            return Ok(p);
        }
        if !s.stream {
            return s.peer.ok_or(Errno::ENOTCONN);
        }
        let a = self.host(id)?.peer_addr().map_err(|e| host_errno(&e))?;
        a.as_socket().ok_or(Errno::ENOTCONN)
    }

    /// bind(). TCP: a loopback or wildcard address of the sandbox (port 0: an
    /// ephemeral one), in the sandbox's port table (EADDRINUSE); the host
    /// socket is never bound. UDP: the same in the sandbox's UDP port table;
    /// a sandbox never takes a host port.
    pub fn bind(&mut self, id: u64, addr: SocketAddr) -> Result<(), Errno> {
        let s = self.sock(id)?;
        if s.stream {
            if s.local.is_some() || s.in_sandbox() || s.peer.is_some() || s.connecting.is_some() {
                return Err(Errno::EINVAL);
            }
            if !matches!(s.backend, Backend::Unopened) {
                return Err(Errno::EINVAL);
            }
            if !sandbox_local(addr.ip()) {
                return Err(Errno::EADDRNOTAVAIL);
            }
            let (reuse, v6only) = (s.reuse, s.v6only());
            let addr = if addr.port() == 0 { SocketAddr::new(addr.ip(), self.ephemeral(id, addr.ip())?) } else { addr };
            if self.port_taken(id, addr, reuse, v6only) {
                return Err(Errno::EADDRINUSE);
            }
            self.sock(id)?.local = Some(addr);
            return Ok(());
        }
        // UDP: a loopback or wildcard address is a binding in the sandbox's
        // own UDP port table (port 0: an ephemeral one), which the sandbox's
        // other sockets send to; never a host port (each destination's host
        // socket has an ephemeral port of its own).
        let ip = addr.ip();
        if s.local.is_some() {
            return Err(Errno::EINVAL);
        }
        if !sandbox_local(ip) {
            return Err(Errno::EADDRNOTAVAIL);
        }
        let reuse = s.reuse;
        let addr = if addr.port() == 0 { SocketAddr::new(ip, self.ephemeral_udp(id, ip)?) } else { addr };
        if self.udp_port_taken(id, addr, reuse) {
            return Err(Errno::EADDRINUSE);
        }
        self.sock(id)?.local = Some(addr);
        Ok(())
    }

    /// Is a UDP port of the sandbox taken (bindings overlap; both with SO_REUSEADDR share it)?
    /// UDP and UDP-Lite have a port table each.
    fn udp_port_taken(&self, me: u64, addr: SocketAddr, reuse: bool) -> bool {
        let lite = self.is_udplite(me);
        let v6only = self.socks.get(&me).is_some_and(Sock::v6only);
        self.socks.iter().any(|(id, s)| {
            *id != me
                && !s.stream
                && s.lite == lite
                && s.local.is_some_and(|l| binds_overlap(l, s.v6only(), addr, v6only))
                && !(reuse && s.reuse)
        })
    }

    /// A free ephemeral UDP port of the sandbox for `ip`.
    fn ephemeral_udp(&mut self, me: u64, ip: IpAddr) -> Result<u16, Errno> {
        let span = (EPHEMERAL.1 - EPHEMERAL.0) as u64 + 1;
        let start = (self.nonce >> 32).wrapping_add(self.next.wrapping_mul(7919)) % span;
        for k in 0..span {
            let port = EPHEMERAL.0 + ((start + k) % span) as u16;
            if !self.udp_port_taken(me, SocketAddr::new(ip, port), false) {
                return Ok(port);
            }
        }
        Err(Errno::EADDRINUSE)
    }

    /// The UDP socket of the sandbox (not `me`) a datagram to `dest` is for.
    fn find_udp_receiver(&self, me: u64, dest: SocketAddr) -> Option<u64> {
        let dest = loop_dest(dest);
        if !sandbox_local(dest.ip()) {
            return None;
        }
        let lite = self.is_udplite(me);
        let mut found: Vec<u64> = self
            .socks
            .iter()
            .filter(|(id, s)| **id != me || s.local.is_some())
            .filter(|(_, s)| {
                !s.stream && s.lite == lite && s.local.is_some_and(|l| listener_takes(l, s.v6only(), dest))
            })
            .map(|(id, _)| *id)
            .collect();
        // Several bound with SO_REUSEADDR: the first bound (lowest id) gets it.
        found.sort_unstable();
        found.first().copied()
    }

    /// Deliver a datagram from `from` to the sandbox's UDP socket `to` (the
    /// sender gets an ephemeral binding on loopback first, so the receiver
    /// can answer). A full receive queue drops it, as UDP may.
    fn deliver_local(&mut self, from: u64, to: u64, data: &[u8], pkt: Packet) -> Result<usize, Errno> {
        let s = self.sock(from)?;
        // What the IP header would carry: the per-packet value, else the
        // sender's option, else Linux's defaults (64 hops, class 0).
        let opt = |s: &Sock, level: i32, name: i32| {
            s.opts.get(&(level, name)).and_then(|v| v.get(..4)?.try_into().ok()).map(i32::from_le_bytes)
        };
        let (hops_opt, class_opt) = if s.domain == libc::AF_INET6 {
            (opt(s, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS), opt(s, libc::IPPROTO_IPV6, libc::IPV6_TCLASS))
        } else {
            (opt(s, libc::IPPROTO_IP, libc::IP_TTL), opt(s, libc::IPPROTO_IP, libc::IP_TOS))
        };
        let pick = |v: Option<i32>| v.filter(|v| (0..=255).contains(v));
        let anc = Ancillary {
            hop_limit: pick(pkt.hop_limit).or(pick(hops_opt)).unwrap_or(DEFAULT_HOPS) as u8,
            tclass: pick(pkt.tclass).or(pick(class_opt)).unwrap_or(0) as u8,
        };
        let src = match s.local {
            Some(l) if !l.ip().is_unspecified() && !policy::canonical(l.ip()).is_some_and(|v| v.is_unspecified()) => l,
            Some(l) => SocketAddr::new(loop_dest(l).ip(), l.port()),
            None => {
                let ip = if s.domain == libc::AF_INET6 {
                    IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
                } else {
                    IpAddr::V4(Ipv4Addr::LOCALHOST)
                };
                let port = self.ephemeral_udp(from, ip)?;
                let a = SocketAddr::new(ip, port);
                self.sock(from)?.local = Some(a);
                a
            }
        };
        let r = self.sock(to)?;
        // The source as the receiver's family spells it (an IPv6 sender seen by
        // an AF_INET socket: its IPv4 form, or 127.0.0.1 for ::1).
        let src = match (r.domain, src) {
            (libc::AF_INET6, SocketAddr::V4(v4)) => SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port()),
            (libc::AF_INET, SocketAddr::V6(v6)) => {
                let v4 = v6.ip().to_ipv4_mapped().unwrap_or(Ipv4Addr::LOCALHOST);
                SocketAddr::new(IpAddr::V4(v4), v6.port())
            }
            _ => src,
        };
        let queued: usize = r.inbox.iter().map(|(m, _, _)| m.len()).sum();
        if r.inbox.len() < LOCAL_INBOX_CAP && queued.saturating_add(data.len()) <= INBOX_BYTES {
            r.inbox.push_back((data.to_vec(), src, anc));
        }
        Ok(data.len())
    }

    /// getsockopt passthrough of an allowed option (value bytes).
    pub fn getsockopt(&mut self, id: u64, level: i32, name: i32, len: usize) -> Result<Vec<u8>, Errno> {
        let s = self.sock(id)?;
        if let Backend::ResolverStream { .. } = s.backend {
            return Ok(vec![0; len.min(4)]);
        }
        if level == libc::SOL_SOCKET && (name == libc::SO_REUSEADDR || name == libc::SO_REUSEPORT) {
            return Ok((s.reuse_opt(name) as i32).to_le_bytes().to_vec());
        }
        if matches!(s.backend, Backend::Unopened) {
            // No host socket yet: what was set, else as a new socket.
            if let Some(v) = s.opts.get(&(level, name)) {
                return Ok(v.clone());
            }
            return Ok(vec![0; len.clamp(1, 4)]);
        }
        if s.in_sandbox() {
            // A listener has no data socket; an in-sandbox connection's is AF_UNIX: socket-level
            // options from it, TCP/IP ones as they were set (else 0).
            if level == libc::SOL_SOCKET && name == libc::SO_ERROR {
                if let Backend::Listener(_) = s.backend {
                    return Ok(0i32.to_le_bytes().to_vec());
                }
            }
            if let Some(v) = s.opts.get(&(level, name)) {
                return Ok(v.clone());
            }
            if level != libc::SOL_SOCKET || matches!(s.backend, Backend::Listener(_)) {
                return Ok(vec![0; len.clamp(1, 4)]);
            }
        }
        let fd = self.host(id)?.as_raw_fd();
        let mut buf = vec![0u8; len.min(256)];
        let mut l = buf.len() as libc::socklen_t;
        // SAFETY: buf is a writable buffer of l bytes.
        if unsafe { libc::getsockopt(fd, level, name, buf.as_mut_ptr().cast(), &mut l) } != 0 {
            return Err(host_errno(&std::io::Error::last_os_error()));
        }
        buf.truncate(l as usize);
        Ok(buf)
    }

    pub fn setsockopt(&mut self, id: u64, level: i32, name: i32, val: &[u8]) -> Result<(), Errno> {
        let s = self.sock(id)?;
        if let Backend::ResolverStream { .. } = s.backend {
            return Ok(());
        }
        if level == libc::SOL_SOCKET && (name == libc::SO_REUSEADDR || name == libc::SO_REUSEPORT) {
            if val.len() < 4 {
                return Err(Errno::EINVAL);
            }
            if s.opts.len() >= OPTS_CAP && !s.opts.contains_key(&(level, name)) {
                return Err(Errno::ENOBUFS);
            }
            // Each option reads back as set; either one lets the port be shared.
            let on = i32::from_le_bytes([val[0], val[1], val[2], val[3]]) != 0;
            s.opts.insert((level, name), (on as i32).to_le_bytes().to_vec());
            s.reuse = s.reuse_opt(libc::SO_REUSEADDR) || s.reuse_opt(libc::SO_REUSEPORT);
            // The sandbox's port tables apply it; a host socket never binds.
            return Ok(());
        } else if matches!(s.backend, Backend::Unopened) {
            // Applied to the host socket the egress opens at connect.
            if s.opts.len() >= OPTS_CAP && !s.opts.contains_key(&(level, name)) {
                return Err(Errno::ENOBUFS);
            }
            s.opts.insert((level, name), val.to_vec());
            return Ok(());
        } else if s.in_sandbox() {
            let host_takes = level == libc::SOL_SOCKET && matches!(s.backend, Backend::Host(_));
            if !host_takes {
                if s.opts.len() >= OPTS_CAP && !s.opts.contains_key(&(level, name)) {
                    return Err(Errno::ENOBUFS);
                }
                s.opts.insert((level, name), val.to_vec());
                return Ok(());
            }
        }
        let fds: Vec<i32> = match &s.backend {
            Backend::Flows(f) => f.iter().map(|(_, h)| h.as_raw_fd()).collect(),
            _ => vec![self.host(id)?.as_raw_fd()],
        };
        for fd in fds {
            // SAFETY: val is a readable buffer of its length.
            if unsafe { libc::setsockopt(fd, level, name, val.as_ptr().cast(), val.len() as libc::socklen_t) } != 0 {
                return Err(host_errno(&std::io::Error::last_os_error()));
            }
        }
        // UDP: the host sockets of destinations to come get it too.
        let s = self.sock(id)?;
        if !s.stream && (s.opts.len() < OPTS_CAP || s.opts.contains_key(&(level, name))) {
            s.opts.insert((level, name), val.to_vec());
        }
        Ok(())
    }

    /// FIONREAD / SIOCINQ.
    pub fn pending(&mut self, id: u64) -> Result<i32, Errno> {
        self.harvest(id);
        let s = self.sock(id)?;
        match &s.backend {
            Backend::ResolverStream { output, .. } => Ok(output.len() as i32),
            Backend::Listener(_) => Err(Errno::EINVAL),
            Backend::Unopened => Ok(s.inbox.front().map_or(0, |(m, _, _)| i32::try_from(m.len()).unwrap_or(i32::MAX))),
            Backend::Flows(f) => {
                if let Some((m, _, _)) = s.inbox.front() {
                    return Ok(i32::try_from(m.len()).unwrap_or(i32::MAX));
                }
                let mut total: libc::c_int = 0;
                for (_, h) in f {
                    let mut n: libc::c_int = 0;
                    // SAFETY: FIONREAD writes one int.
                    if unsafe { libc::ioctl(h.as_raw_fd(), libc::FIONREAD, &mut n) } == 0 && n > 0 {
                        total = n;
                        break;
                    }
                }
                Ok(total)
            }
            Backend::Host(h) => {
                if let Some((m, _, _)) = s.inbox.front() {
                    return Ok(i32::try_from(m.len()).unwrap_or(i32::MAX));
                }
                let mut n: libc::c_int = 0;
                // SAFETY: FIONREAD writes one int.
                if unsafe { libc::ioctl(h.as_raw_fd(), libc::FIONREAD, &mut n) } != 0 {
                    return Err(host_errno(&std::io::Error::last_os_error()));
                }
                Ok(n)
            }
        }
    }

    /// Answer one DNS query to the VMM's resolver: now, once a host lookup
    /// is done, or never (what a server does with what it cannot even parse).
    fn answer(&mut self, msg: &[u8]) -> Reply {
        self.stats.dns_queries += 1;
        GLOBAL.dns_queries.fetch_add(1, Ordering::Relaxed);
        let q = match dns::parse_query(msg) {
            Ok(q) => q,
            Err(_) => return dns::format_error(msg).map_or(Reply::Drop, Reply::Now),
        };
        if q.qclass != dns::CLASS_IN || (q.qtype != dns::TYPE_A && q.qtype != dns::TYPE_AAAA) {
            // Only address lookups are served; other types get an empty answer.
            let rcode = if q.qclass == dns::CLASS_IN { dns::RCODE_OK } else { dns::RCODE_NOTIMP };
            return Reply::Now(dns::response(&q, rcode, &[]));
        }
        match self.egress.lookup(&q.name) {
            Resolution::Done(r) => Reply::Now(self.respond(&q, r)),
            Resolution::Wait(l) => Reply::Later(q, l),
        }
    }

    /// The answer to `q` (and the counts and note of the egress' answer).
    fn respond(&mut self, q: &dns::Query, r: Resolved) -> Vec<u8> {
        if r.rcode == dns::RCODE_REFUSED || r.refused {
            self.stats.dns_refused += 1;
            GLOBAL.dns_refused.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(why) = r.denied {
            *self.stats.denied.entry(why).or_default() += 1;
        }
        if let Some(n) = r.note {
            self.note(n);
        }
        dns::response(q, r.rcode, &r.addrs)
    }

    /// Queue `r` for socket `id`'s recv (a question waiting for a lookup: at
    /// most `INBOX_CAP` per socket and `QUESTIONS_WAITING` in all, beyond it is
    /// dropped).
    fn reply(&mut self, id: u64, r: Reply) {
        let waiting: usize = self.socks.values().map(|s| s.pending.len()).sum();
        let Ok(s) = self.sock(id) else { return };
        match r {
            Reply::Drop => {}
            Reply::Now(a) => s.push_answer(a),
            Reply::Later(q, l) => {
                if s.pending.len() < INBOX_CAP && waiting < QUESTIONS_WAITING {
                    s.pending.push_back((q, l));
                }
            }
        }
    }

    /// Answer socket `id`'s questions whose host lookup is done.
    fn harvest(&mut self, id: u64) {
        let Some(s) = self.socks.get_mut(&id) else { return };
        if !s.answer_ready() {
            return;
        }
        let (done, waiting): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut s.pending).into_iter().partition(|(_, l)| l.is_done());
        s.pending = waiting;
        for (q, l) in done {
            let r = self.egress.finish(&l);
            let a = self.respond(&q, r);
            if let Some(s) = self.socks.get_mut(&id) {
                s.push_answer(a);
            }
        }
    }

    /// Start resolving `name` (tests).
    #[cfg(test)]
    pub fn begin(&mut self, name: &str) -> Resolution {
        self.egress.lookup(name)
    }

    /// Resolve `name`, waiting for a host lookup on this thread (tests only:
    /// the sandbox never waits here).
    #[cfg(test)]
    pub fn resolve(&mut self, name: &str) -> (u8, Vec<IpAddr>) {
        match self.egress.lookup(name) {
            Resolution::Done(r) => (r.rcode, r.addrs),
            Resolution::Wait(l) => {
                let _ = l.wait(resolver::BUDGET + Duration::from_secs(1));
                if !l.is_done() {
                    l.cancel();
                }
                let r = self.egress.finish(&l);
                (r.rcode, r.addrs)
            }
        }
    }
}

/// What the resolver does with a question.
enum Reply {
    Now(Vec<u8>),
    /// Answered once the host lookup is done.
    Later(dns::Query, Arc<resolver::Lookup>),
    Drop,
}

/// One recvmsg on host socket `fd`: the length, the source as the kernel
/// wrote it, and whether the datagram was truncated.
fn recv_host(
    fd: i32,
    buf: &mut [u8],
    flags: i32,
) -> Result<(usize, libc::sockaddr_storage, libc::socklen_t, bool), Errno> {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: zeroed msghdr, then pointers to live locals/the buffer with their sizes.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut from as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: fd is our host socket; msg points to valid memory as set above.
    let n = unsafe { libc::recvmsg(fd, &mut msg, flags) };
    if n < 0 {
        return Err(host_errno(&std::io::Error::last_os_error()));
    }
    Ok((n as usize, from, msg.msg_namelen, msg.msg_flags & libc::MSG_TRUNC != 0))
}

/// A host sockaddr (as the kernel wrote it) as a `SocketAddr`.
fn from_storage(st: &libc::sockaddr_storage, len: usize) -> Option<SocketAddr> {
    match st.ss_family as i32 {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: an AF_INET sockaddr_storage holds a sockaddr_in.
            let sin = unsafe { &*(st as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::from((Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: an AF_INET6 sockaddr_storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(st as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn is_resolver(a: SocketAddr) -> bool {
    let ip = policy::canonical(a.ip()).map(IpAddr::V4).unwrap_or(a.ip());
    ip == IpAddr::V4(RESOLVER) && a.port() == DNS_PORT
}

fn resolver_addr() -> SocketAddr {
    SocketAddr::from((RESOLVER, DNS_PORT))
}

fn unspecified(domain: i32) -> SocketAddr {
    if domain == libc::AF_INET6 {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    } else {
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
    }
}

#[cfg(test)]
mod tests;
