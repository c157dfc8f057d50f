//! Networking inside the sandbox: listeners (listen, accept, their checkpoint
//! record `ListenerState` and its restore), TCP connections from the sandbox
//! to its own listeners, connections from outside handed in by the port
//! proxy (`inject`), and UDP datagrams between the sandbox's own sockets.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::errno::Errno;
use socket2::{Domain, Socket, Type};

use super::ports::{
    binds_overlap, listener_takes, loop_dest, loop_dest_ip, sandbox_local, unspecified, v6only_in, EPHEMERAL,
};
use super::sockopt::OPTS_CAP;
use super::{host_errno, nonce, policy, Backend, Listener, NetIo, Sock};

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

/// A listening socket as a checkpoint records it: what re-creates it in the
/// port table of a restored sandbox under the same socket id (the fd table
/// names it by that id). Its queued connections are not recorded: they were
/// host sockets, which read as reset after a restore.
#[derive(Clone, Debug, PartialEq, Eq)]
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

/// Largest listen backlog (Linux's default somaxconn).
const SOMAXCONN: usize = 4096;

fn unix_pair() -> Result<(Socket, Socket), Errno> {
    Socket::pair(Domain::UNIX, Type::STREAM.nonblocking().cloexec(), None).map_err(|e| host_errno(&e))
}

/// Bytes of datagrams from the sandbox's own sockets one UDP socket holds
/// unread (Linux's default receive buffer); beyond, datagrams are dropped, as UDP may.
const INBOX_BYTES: usize = 212_992;

/// Datagrams one UDP socket holds unread from the sandbox's own sockets.
const LOCAL_INBOX_CAP: usize = 256;

impl NetIo {
    /// A listener of the sandbox that takes a connect to `dest`.
    pub(super) fn find_listener(&self, dest: SocketAddr) -> Option<u64> {
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
    pub(super) fn loop_connect(&mut self, id: u64, lid: u64, dest: SocketAddr) -> Result<bool, Errno> {
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

    /// The UDP socket of the sandbox (not `me`) a datagram to `dest` is for.
    pub(super) fn find_udp_receiver(&self, me: u64, dest: SocketAddr) -> Option<u64> {
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
    pub(super) fn deliver_local(&mut self, from: u64, to: u64, data: &[u8], pkt: Packet) -> Result<usize, Errno> {
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
}
