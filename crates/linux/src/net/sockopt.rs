//! Socket options: getsockopt/setsockopt (kept for sockets without a host
//! socket, passed through otherwise), SO_REUSEADDR/SO_REUSEPORT, the receive
//! and send timeouts.

use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::errno::Errno;

use super::{host_errno, Backend, NetIo, Sock};

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
    pub(super) fn reuse_opts(&self) -> Vec<((i32, i32), Vec<u8>)> {
        [libc::SO_REUSEADDR, libc::SO_REUSEPORT]
            .into_iter()
            .filter_map(|n| self.opts.get(&(libc::SOL_SOCKET, n)).map(|v| ((libc::SOL_SOCKET, n), v.clone())))
            .collect()
    }
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

/// Option values kept per in-sandbox socket.
pub(super) const OPTS_CAP: usize = 32;

impl NetIo {
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
}
