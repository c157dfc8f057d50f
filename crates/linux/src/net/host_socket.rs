//! The host sockets a sandbox's connections to the outside use, and the
//! verdict they were opened under: made here and nowhere else (the egress
//! gate decides, the secrets relay may sit in between).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::host_errno;
use crate::errno::Errno;

/// A destination's verdict, with what a refusal note names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub allowed: bool,
    /// The rule or class that decided (`policy::Reason`'s text).
    pub reason: String,
    /// The names the sandbox's resolver handed the address out for.
    pub names: Vec<String>,
}

/// A host socket opened for the sandbox.
#[derive(Debug)]
pub struct Opened {
    pub socket: Socket,
    /// The connect completed at once (else it is in progress: POLLOUT, then SO_ERROR).
    pub connected: bool,
}

fn host_socket(domain: i32, stream: bool) -> Result<Socket, Errno> {
    let d = match domain {
        libc::AF_INET => Domain::IPV4,
        libc::AF_INET6 => Domain::IPV6,
        _ => return Err(Errno::EAFNOSUPPORT),
    };
    let (t, p) = if stream { (Type::STREAM, Protocol::TCP) } else { (Type::DGRAM, Protocol::UDP) };
    let s = Socket::new(d, t.nonblocking().cloexec(), Some(p)).map_err(|e| host_errno(&e))?;
    if domain == libc::AF_INET6 {
        // Linux's default (dual stack), whatever the host's sysctl says.
        let _ = s.set_only_v6(false);
    }
    Ok(s)
}

/// A new non-blocking host UDP socket of `domain` connected to `dest` (the
/// one place a host UDP socket to the outside is made).
pub fn open_udp(domain: i32, dest: SocketAddr) -> Result<Socket, Errno> {
    let s = host_socket(domain, false)?;
    s.connect(&SockAddr::from(dest)).map_err(|e| host_errno(&e))?;
    Ok(s)
}

/// A new non-blocking host TCP socket of `domain` with its connect to `dest`
/// started (the one place a host TCP socket to the outside is made).
pub fn open_tcp(domain: i32, dest: SocketAddr) -> Result<Opened, Errno> {
    let s = host_socket(domain, true)?;
    match s.connect(&SockAddr::from(dest)) {
        Ok(()) => Ok(Opened { socket: s, connected: true }),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(Opened { socket: s, connected: false }),
        Err(e) => Err(host_errno(&e)),
    }
}
