//! The sandbox's own port tables (TCP, UDP, UDP-Lite: ports inside the
//! sandbox, never host ports): bind, ephemeral ports, the address rules
//! (loopback, wildcard, IPv4-mapped) they compare by, and the addresses a
//! socket reports (getsockname, getpeername).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::errno::Errno;

use super::{host_errno, resolver_addr, Backend, NetIo, Sock};

impl Sock {
    /// IPV6_V6ONLY is set (an AF_INET6 socket's `::` binding is IPv6 only).
    pub(super) fn v6only(&self) -> bool {
        v6only_in(self.domain, self.opts.get(&(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)).map(Vec::as_slice))
    }
}

/// The ephemeral port range (Linux's default ip_local_port_range).
pub(super) const EPHEMERAL: (u16, u16) = (32768, 60999);

/// `ip` as IPv4 if it is one or IPv4-mapped (how an AF_INET6 socket spells IPv4).
fn as_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => v6.to_ipv4_mapped(),
    }
}

/// Is `ip` an address a sandbox TCP socket may bind (loopback or wildcard)?
pub(super) fn sandbox_local(ip: IpAddr) -> bool {
    match as_v4(ip) {
        Some(v4) => v4.is_loopback() || v4.is_unspecified(),
        None => ip.is_loopback() || ip.is_unspecified(),
    }
}

/// A destination's address with IPv4-mapped forms as IPv4, and the wildcard
/// as loopback (a connect to 0.0.0.0 or :: reaches the local host on Linux).
pub(super) fn loop_dest(addr: SocketAddr) -> SocketAddr {
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
pub(super) fn listener_takes(bound: SocketAddr, v6only: bool, dest: SocketAddr) -> bool {
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
pub(super) fn v6only_in(domain: i32, val: Option<&[u8]>) -> bool {
    domain == libc::AF_INET6 && val.is_some_and(|v| v.iter().any(|b| *b != 0))
}

/// A bound address's IP as compared with destinations (None: the wildcard).
pub(super) fn loop_dest_ip(ip: IpAddr) -> Option<IpAddr> {
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
pub(super) fn binds_overlap(a: SocketAddr, a_v6only: bool, b: SocketAddr, b_v6only: bool) -> bool {
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

impl NetIo {
    /// Is `addr` taken by a TCP socket other than `me`? As Linux: a
    /// listener always holds its port; any other socket holding it (bound, or
    /// an end of a connection) lets another have it only if both set SO_REUSEADDR.
    /// `v6only`: IPV6_V6ONLY is set on `me`.
    pub(super) fn port_taken(&self, me: u64, addr: SocketAddr, reuse: bool, v6only: bool) -> bool {
        self.socks.iter().any(|(id, s)| {
            *id != me
                && s.stream
                && s.local.is_some_and(|l| binds_overlap(l, s.v6only(), addr, v6only))
                && (matches!(s.backend, Backend::Listener(_)) || !(reuse && s.reuse))
        })
    }

    /// A free ephemeral port for `ip` (EADDRINUSE when every one is taken).
    pub(super) fn ephemeral(&mut self, me: u64, ip: IpAddr) -> Result<u16, Errno> {
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
    pub(super) fn ephemeral_udp(&mut self, me: u64, ip: IpAddr) -> Result<u16, Errno> {
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
}

pub(super) fn unspecified(domain: i32) -> SocketAddr {
    if domain == libc::AF_INET6 {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    } else {
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
    }
}
