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

mod config;
mod io;
mod loopback;
mod nameserver;
mod outbound;
mod ports;
mod sockopt;
mod stats;
mod throttle;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use socket2::Socket;

use crate::errno::Errno;
pub use egress::{Direct, Egress, Gate, Opened, Refused, Resolution, Resolved, Verdict};
pub use policy::{Decision, Mode, Policy, Rule};

pub use config::NetConfig;
pub use io::POLL_MASK;
pub use loopback::{Ancillary, InjectError, ListenerRestoreError, ListenerState, Packet};
pub use stats::{GlobalNetStats, NetCounts, NetStats, GLOBAL};
use throttle::Throttle;

/// The nameserver in the guest's /etc/resolv.conf; UDP and TCP port 53 to it
/// are answered by the VMM (nothing is sent to that address on the host).
pub const RESOLVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 11);
pub const DNS_PORT: u16 = 53;

/// The guest's /etc/resolv.conf, /etc/hosts and /etc/nsswitch.conf.
pub const RESOLV_CONF: &[u8] = b"# Answered by the forkbox VMM (names resolved on the host, under the sandbox's egress policy).\nnameserver 127.0.0.11\noptions ndots:0 timeout:5 attempts:1\n";
/// The host name (`uname`'s nodename) resolves to loopback, as Debian's installer writes it.
pub const ETC_HOSTS: &[u8] = b"127.0.0.1\tlocalhost\n127.0.1.1\tforkbox\n::1\tlocalhost ip6-localhost ip6-loopback\n";
pub const NSSWITCH_CONF: &[u8] = b"hosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n";

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

    /// Served inside the sandbox (a listener or an end of a loopback connection).
    fn in_sandbox(&self) -> bool {
        self.loop_peer.is_some() || matches!(self.backend, Backend::Listener(_))
    }
}

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

    pub fn note(&mut self, msg: String) {
        tracing::info!(target: "forkbox::net", "{msg}");
        let msg = format!("forkbox: {msg}\n");
        // The A and AAAA questions of one lookup say the same thing: once.
        if self.notes.len() < 64 && !self.notes.contains(&msg) {
            self.notes.push(msg);
        }
    }
}

fn is_resolver(a: SocketAddr) -> bool {
    let ip = policy::canonical(a.ip()).map(IpAddr::V4).unwrap_or(a.ip());
    ip == IpAddr::V4(RESOLVER) && a.port() == DNS_PORT
}

fn resolver_addr() -> SocketAddr {
    SocketAddr::from((RESOLVER, DNS_PORT))
}

#[cfg(test)]
mod tests;
