//! The sandbox's own port tables (TCP, UDP, UDP-Lite: ports inside the
//! sandbox, never host ports): bind, ephemeral ports, the address rules
//! (loopback, wildcard, IPv4-mapped) they compare by, and the addresses a
//! socket reports (getsockname, getpeername).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::errno::Errno;

use super::{host_errno, resolver_addr, Backend, NetIo};

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

/// Does a socket bound to `bound` on a socket of `domain` take connections to `dest` (from `loop_dest`)?
pub(super) fn listener_takes(bound: SocketAddr, domain: i32, dest: SocketAddr) -> bool {
    if bound.port() != dest.port() {
        return false;
    }
    let b = loop_dest_ip(bound.ip());
    match (b, dest.ip()) {
        // 0.0.0.0 takes IPv4; :: (an AF_INET6 socket, dual stack) takes both.
        (None, IpAddr::V4(_)) => true,
        (None, IpAddr::V6(_)) => domain == libc::AF_INET6,
        (Some(b), d) => b == d,
    }
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

/// Do two bound addresses overlap (same port, and the same IP or a wildcard)?
pub(super) fn binds_overlap(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && match (loop_dest_ip(a.ip()), loop_dest_ip(b.ip())) {
            (None, _) | (_, None) => true,
            (Some(x), Some(y)) => x == y,
        }
}

impl NetIo {
    /// Is `addr` taken by a TCP socket other than `me`? As Linux: a
    /// listener always holds its port; any other socket holding it (bound, or
    /// an end of a connection) lets another have it only if both set SO_REUSEADDR.
    pub(super) fn port_taken(&self, me: u64, addr: SocketAddr, reuse: bool) -> bool {
        self.socks.iter().any(|(id, s)| {
            *id != me
                && s.stream
                && s.local.is_some_and(|l| binds_overlap(l, addr))
                && (matches!(s.backend, Backend::Listener(_)) || !(reuse && s.reuse))
        })
    }

    /// A free ephemeral port for `ip` (EADDRINUSE when every one is taken).
    pub(super) fn ephemeral(&mut self, me: u64, ip: IpAddr) -> Result<u16, Errno> {
        let span = (EPHEMERAL.1 - EPHEMERAL.0) as u64 + 1;
        let start = (self.nonce >> 32).wrapping_add(self.next.wrapping_mul(7919)) % span;
        for k in 0..span {
            let port = EPHEMERAL.0 + ((start + k) % span) as u16;
            if !self.port_taken(me, SocketAddr::new(ip, port), false) {
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
            let reuse = s.reuse;
            let addr = if addr.port() == 0 { SocketAddr::new(addr.ip(), self.ephemeral(id, addr.ip())?) } else { addr };
            if self.port_taken(id, addr, reuse) {
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
        self.socks.iter().any(|(id, s)| {
            *id != me
                && !s.stream
                && s.lite == lite
                && s.local.is_some_and(|l| binds_overlap(l, addr))
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
