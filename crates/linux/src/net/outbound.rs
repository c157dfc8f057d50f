//! Connections out of the sandbox: TCP connects and UDP destinations the
//! egress decides and opens host sockets for.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use crate::errno::Errno;
use socket2::Socket;

use super::{host_errno, Backend, NetIo, Refused};

const VERDICT_CAP: usize = 256;

/// Destinations one UDP socket has host sockets for.
const FLOWS_CAP: usize = 16;

impl NetIo {
    /// The host socket of UDP socket `id` for `dest`: one it has, else a
    /// new one from the egress (a refusal is remembered: ECONNREFUSED).
    pub(super) fn flow(&mut self, id: u64, dest: SocketAddr) -> Result<&Socket, Errno> {
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

    /// A TCP connect to `addr` out of the sandbox: the egress decides and
    /// opens the host socket (options set before are applied to it).
    pub(super) fn connect_out(&mut self, id: u64, addr: SocketAddr) -> Result<bool, Errno> {
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

    /// The state of a connect in progress: done, failed (its error), or still going.
    pub(super) fn connect_outcome(&mut self, id: u64) -> Result<bool, Errno> {
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
}
