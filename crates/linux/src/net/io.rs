//! The socket calls that move bytes and report readiness: connect (which
//! picks the resolver, a listener of the sandbox or the egress), send, recv,
//! shutdown, poll and its host pollfds, FIONREAD.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;

use crate::errno::Errno;

use super::loopback::{Ancillary, Packet};
use super::nameserver::RESOLVER_STREAM_CAP;
use super::ports::{loop_dest, sandbox_local};
use super::throttle::RATE_HELD;
use super::{dns, host_errno, is_resolver, resolver_addr, Backend, NetIo, Sock};

/// Readiness bits of a socket for poll (POLLIN, POLLOUT, POLLERR, POLLHUP, POLLRDHUP, POLLPRI).
pub const POLL_MASK: i16 =
    libc::POLLIN | libc::POLLOUT | libc::POLLPRI | libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP;

impl NetIo {
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
