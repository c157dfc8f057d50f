//! AF_INET / AF_INET6 sockets, served by the VMM on host sockets it owns
//! (`crate::net`): socket, connect, send*/recv*, shutdown, get/setsockopt,
//! getsockname/getpeername, bind; listen/accept inside the sandbox (TCP on
//! loopback or the wildcard, never a host port: see `crate::net`). A blocking
//! guest socket waits on the host socket, bounded by SO_RCVTIMEO/SO_SNDTIMEO,
//! the exec's deadline and interrupts (EINTR).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use super::sys_unix as unix;
use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, SockInfo};
use crate::file::inet::{
    block_on, check_family, guest_data, host_addr, recv_common, send_common, sock, timeout_deadline, DGRAM_MAX,
    MSG_COPY_MAX,
};
use crate::kernel::{Args, Ctx};
use crate::net::Packet;

/// Largest sockaddr a guest may pass.
const SOCKADDR_MAX: u64 = 128;
/// Largest option value copied either way.
const OPT_MAX: u64 = 64;
const IOV_MAX: u64 = 1024;
const MMSG_MAX: u64 = 64;

/// Whether `fd` is one of ours (AF_INET/AF_INET6); anything else goes to
/// sys_unix, which answers for AF_UNIX sockets and ENOTSOCK/EBADF otherwise.
fn is_inet(ctx: &Ctx, fd: u64) -> bool {
    matches!(ctx.proc.fds.get(fd as i32).map(|f| f.kind), Ok(FileKind::Socket(_)))
}

/// A guest sockaddr: `None` for AF_UNSPEC.
fn read_sockaddr(ctx: &Ctx, addr: u64, len: u64) -> Result<Option<SocketAddr>, Errno> {
    if !(2..=SOCKADDR_MAX).contains(&len) {
        return Err(Errno::EINVAL);
    }
    let b = ctx.bytes(addr, len)?;
    let family = u16::from_le_bytes([b[0], b[1]]) as i32;
    match family {
        libc::AF_UNSPEC => Ok(None),
        libc::AF_INET => {
            if b.len() < 16 {
                return Err(Errno::EINVAL);
            }
            let port = u16::from_be_bytes([b[2], b[3]]);
            Ok(Some(SocketAddr::from((Ipv4Addr::new(b[4], b[5], b[6], b[7]), port))))
        }
        libc::AF_INET6 => {
            if b.len() < 24 {
                return Err(Errno::EINVAL);
            }
            let port = u16::from_be_bytes([b[2], b[3]]);
            let flow = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[8..24]);
            let scope = if b.len() >= 28 { u32::from_le_bytes([b[24], b[25], b[26], b[27]]) } else { 0 };
            Ok(Some(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, flow, scope))))
        }
        _ => Err(Errno::EAFNOSUPPORT),
    }
}

/// Encode `a` as the guest sees it on a socket of `domain` (IPv4 peers of an
/// AF_INET6 socket appear v4-mapped, as on Linux).
fn encode_sockaddr(a: SocketAddr, domain: i32) -> Vec<u8> {
    let a = match (a, domain) {
        (SocketAddr::V4(v4), libc::AF_INET6) => {
            SocketAddr::V6(SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0))
        }
        (SocketAddr::V6(v6), libc::AF_INET) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => SocketAddr::V6(v6),
        },
        _ => a,
    };
    match a {
        SocketAddr::V4(v4) => {
            let mut b = vec![0u8; 16];
            b[..2].copy_from_slice(&(libc::AF_INET as u16).to_le_bytes());
            b[2..4].copy_from_slice(&v4.port().to_be_bytes());
            b[4..8].copy_from_slice(&v4.ip().octets());
            b
        }
        SocketAddr::V6(v6) => {
            let mut b = vec![0u8; 28];
            b[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_le_bytes());
            b[2..4].copy_from_slice(&v6.port().to_be_bytes());
            b[4..8].copy_from_slice(&v6.flowinfo().to_be_bytes());
            b[8..24].copy_from_slice(&v6.ip().octets());
            b[24..28].copy_from_slice(&v6.scope_id().to_le_bytes());
            b
        }
    }
}

/// Write a sockaddr to `addr` with its length at `len_ptr` (value-result, as Linux: truncated to the buffer).
fn write_sockaddr(ctx: &mut Ctx, addr: u64, len_ptr: u64, a: SocketAddr, domain: i32) -> Result<(), Errno> {
    if addr == 0 || len_ptr == 0 {
        return Ok(());
    }
    let cap = i32::from_le_bytes(ctx.bytes(len_ptr, 4)?.try_into().map_err(|_| Errno::EFAULT)?);
    if cap < 0 {
        return Err(Errno::EINVAL);
    }
    let b = encode_sockaddr(a, domain);
    let n = b.len().min(cap as usize);
    ctx.write_bytes(addr, &b[..n])?;
    ctx.write_i32(len_ptr, b.len() as i32)
}

pub fn socket(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (domain, ty, proto) = (a[0] as i32, a[1] as i32, a[2] as i32);
    let flags = ty & (libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    let kind = ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    if domain != libc::AF_INET && domain != libc::AF_INET6 {
        // AF_UNIX (and the refusal of every other family) is sys_unix's.
        return unix::socket(ctx, a);
    }
    let stream = match (kind, proto) {
        (libc::SOCK_STREAM, 0 | libc::IPPROTO_TCP) => true,
        (libc::SOCK_DGRAM, 0 | libc::IPPROTO_UDP | libc::IPPROTO_UDPLITE) => false,
        (libc::SOCK_STREAM | libc::SOCK_DGRAM, _) => return Err(Errno::EPROTONOSUPPORT),
        // Raw and packet sockets need privileges a sandbox does not have.
        (libc::SOCK_RAW, _) => return Err(Errno::EPERM),
        _ => return Err(Errno::ESOCKTNOSUPPORT),
    };
    // The fd slot first, so a full table does not leave a host socket behind.
    if ctx.proc.fds.len() >= crate::fd::MAX_FDS as usize {
        return Err(Errno::EMFILE);
    }
    let id = if proto == libc::IPPROTO_UDPLITE {
        ctx.kernel.net.socket_udplite(domain)
    } else {
        ctx.kernel.net.socket(domain, stream)
    };
    ctx.kernel.flush_net_notes();
    let id = id?;
    let mut oflags = libc::O_RDWR;
    if flags & libc::SOCK_NONBLOCK != 0 {
        oflags |= libc::O_NONBLOCK;
    }
    if flags & libc::SOCK_CLOEXEC != 0 {
        oflags |= libc::O_CLOEXEC;
    }
    match ctx.proc.fds.open(FileKind::Socket(SockInfo { id, domain, stream }), oflags) {
        Ok(fd) => Ok(fd as u64),
        Err(e) => {
            ctx.kernel.net.close(id);
            Err(e)
        }
    }
}

pub fn connect(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::connect(ctx, a);
    }
    let (info, nonblock) = sock(ctx, a[0])?;
    let addr = read_sockaddr(ctx, a[1], a[2])?;
    if let Some(addr) = &addr {
        check_family(&info, addr)?;
    }
    let was_connected = ctx.kernel.net.is_loop_connected(info.id);
    let r = ctx.kernel.net.connect(info.id, addr.map(|x| host_addr(&info, x)));
    ctx.kernel.flush_net_notes();
    if r? {
        // Connected inside the sandbox at once; a non-blocking caller is told
        // EINPROGRESS as on Linux (the socket is writable already).
        if nonblock && !was_connected && ctx.kernel.net.is_loop_connected(info.id) {
            ctx.kernel.net.defer_connect_report(info.id);
            return Err(Errno::EINPROGRESS);
        }
        return Ok(0);
    }
    if nonblock {
        return Err(Errno::EINPROGRESS);
    }
    // A blocking connect: wait for the handshake (bounded by SO_SNDTIMEO, as
    // Linux); the re-run finds the connection done (or failed) on the host.
    let (_, snd) = ctx.kernel.net.timeouts(info.id);
    block_on(ctx, a[0], libc::POLLOUT, timeout_deadline(snd), Err(Errno::EINPROGRESS))
}

pub fn sendto(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::sendto(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let data = guest_data(ctx, a[1], a[2], info.stream)?;
    let to = if a[4] != 0 { read_sockaddr(ctx, a[4], a[5])? } else { None };
    send_common(ctx, a[0], data, to, a[3] as i32, Packet::default())
}

pub fn recvfrom(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::recvfrom(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let len = a[2].min(MSG_COPY_MAX as u64);
    ctx.user_range(a[1], len)?;
    let Some((data, n, from, _, _)) = recv_common(ctx, a[0], len as usize, a[3] as i32)? else { return Ok(0) };
    ctx.write_bytes(a[1], &data[..n.min(data.len())])?;
    if let Some(from) = from {
        write_sockaddr(ctx, a[4], a[5], from, info.domain)?;
    } else if a[4] != 0 && a[5] != 0 {
        ctx.write_i32(a[5], 0)?;
    }
    Ok(n as u64)
}

/// A guest `struct msghdr` (x86-64 layout, 56 bytes).
struct MsgHdr {
    name: u64,
    namelen: u32,
    iov: Vec<(u64, u64)>,
    control: u64,
    controllen: u64,
}

fn read_msghdr(ctx: &Ctx, p: u64) -> Result<MsgHdr, Errno> {
    let b = ctx.bytes(p, 56)?;
    let u = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    let (name, namelen, iov, iovlen) =
        (u(0), u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()), u(16), u(24));
    if iovlen > IOV_MAX {
        return Err(Errno::EMSGSIZE);
    }
    let raw = ctx.bytes(iov, iovlen * 16)?;
    let mut v = Vec::with_capacity(iovlen as usize);
    let mut total = 0u64;
    for c in raw.chunks_exact(16) {
        let base = u64::from_le_bytes(c[..8].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(c[8..].try_into().unwrap_or_default());
        total = total.checked_add(len).ok_or(Errno::EINVAL)?;
        if (len as i64) < 0 || (total as i64) < 0 {
            return Err(Errno::EINVAL);
        }
        v.push((base, len));
    }
    Ok(MsgHdr { name, namelen, iov: v, control: u(32), controllen: u(40) })
}

fn gather(ctx: &Ctx, iov: &[(u64, u64)], cap: usize) -> Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    for &(base, len) in iov {
        let room = cap.saturating_sub(out.len()) as u64;
        if room == 0 {
            break;
        }
        out.extend_from_slice(ctx.bytes(base, len.min(room))?);
    }
    Ok(out)
}

fn scatter(ctx: &mut Ctx, iov: &[(u64, u64)], mut data: &[u8]) -> Result<(), Errno> {
    for &(base, len) in iov {
        if data.is_empty() {
            break;
        }
        let n = (len as usize).min(data.len());
        ctx.write_bytes(base, &data[..n])?;
        data = &data[n..];
    }
    Ok(())
}

/// Largest msg_control a sendmsg may give (Linux: optmem_max).
const MAX_CONTROL: u64 = 20480;
const CMSG_HDR: usize = 16;

fn cmsg_align(n: usize) -> usize {
    (n + 7) & !7
}

/// The IPV6_HOPLIMIT / IPV6_TCLASS messages of an AF_INET6 datagram
/// socket's sendmsg control buffer, checked as Linux's
/// `ip6_datagram_send_ctl` checks them (an int each, -1..=255, else EINVAL;
/// a malformed header EINVAL). Other messages are not looked at.
fn packet_options(ctx: &Ctx, info: SockInfo, control: u64, controllen: u64) -> Result<Packet, Errno> {
    let mut pkt = Packet::default();
    if info.stream || info.domain != libc::AF_INET6 || control == 0 || controllen == 0 {
        return Ok(pkt);
    }
    if controllen > MAX_CONTROL {
        return Err(Errno::ENOBUFS);
    }
    let buf = ctx.bytes(control, controllen)?;
    let mut off = 0usize;
    while buf.len().saturating_sub(off) >= CMSG_HDR {
        let h = &buf[off..off + CMSG_HDR];
        let len = u64::from_le_bytes(h[..8].try_into().map_err(|_| Errno::EINVAL)?);
        let level = i32::from_le_bytes(h[8..12].try_into().map_err(|_| Errno::EINVAL)?);
        let ty = i32::from_le_bytes(h[12..16].try_into().map_err(|_| Errno::EINVAL)?);
        if len < CMSG_HDR as u64 || len > (buf.len() - off) as u64 {
            return Err(Errno::EINVAL);
        }
        let data = &buf[off + CMSG_HDR..off + len as usize];
        if level == libc::IPPROTO_IPV6 && (ty == libc::IPV6_HOPLIMIT || ty == libc::IPV6_TCLASS) {
            let v: [u8; 4] = data.try_into().map_err(|_| Errno::EINVAL)?;
            let v = i32::from_le_bytes(v);
            if !(-1..=255).contains(&v) {
                return Err(Errno::EINVAL);
            }
            let v = (v >= 0).then_some(v);
            if ty == libc::IPV6_HOPLIMIT {
                pkt.hop_limit = v;
            } else {
                pkt.tclass = v;
            }
        }
        off = off.saturating_add(cmsg_align(len as usize));
    }
    Ok(pkt)
}

/// Append one control message to `out`, as Linux's `put_cmsg` does with
/// `room` bytes of control buffer left: nothing (MSG_CTRUNC) without room
/// for a header, a truncated message (MSG_CTRUNC) without room for all of
/// it, and the alignment padding only where it fits.
fn put_cmsg(out: &mut Vec<u8>, room: usize, level: i32, ty: i32, data: &[u8], mflags: &mut i32) {
    let left = room.saturating_sub(out.len());
    if left < CMSG_HDR {
        *mflags |= libc::MSG_CTRUNC;
        return;
    }
    let mut len = CMSG_HDR + data.len();
    if left < len {
        *mflags |= libc::MSG_CTRUNC;
        len = left;
    }
    let start = out.len();
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(&level.to_le_bytes());
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(&data[..len - CMSG_HDR]);
    out.resize(start + cmsg_align(CMSG_HDR + data.len()).min(left), 0);
}

fn sendmsg_one(ctx: &mut Ctx, fd: u64, msg: u64, flags: i32) -> SysResult {
    let (info, _) = sock(ctx, fd)?;
    let h = read_msghdr(ctx, msg)?;
    for &(base, len) in &h.iov {
        ctx.user_range(base, len)?;
    }
    let pkt = packet_options(ctx, info, h.control, h.controllen)?;
    let data = gather(ctx, &h.iov, if info.stream { MSG_COPY_MAX } else { DGRAM_MAX + 1 })?;
    let to = if h.name != 0 && h.namelen != 0 { read_sockaddr(ctx, h.name, h.namelen as u64)? } else { None };
    send_common(ctx, fd, data, to, flags, pkt)
}

fn recvmsg_one(ctx: &mut Ctx, fd: u64, msg: u64, flags: i32) -> SysResult {
    let (info, _) = sock(ctx, fd)?;
    let h = read_msghdr(ctx, msg)?;
    for &(base, len) in &h.iov {
        ctx.user_range(base, len)?;
    }
    let want: u64 = h.iov.iter().map(|&(_, l)| l).sum();
    let room = if h.control == 0 { 0 } else { h.controllen.min(MAX_CONTROL) as usize };
    ctx.user_range_mut(h.control, room as u64)?;
    let Some((data, n, from, trunc, anc)) = recv_common(ctx, fd, want.min(MSG_COPY_MAX as u64) as usize, flags)? else {
        return Ok(0);
    };
    scatter(ctx, &h.iov, &data[..n.min(data.len())])?;
    // RFC 3542 ancillary data the socket asked for (IPv6 datagrams from the
    // sandbox's own sockets), in Linux's order: hop limit, traffic class.
    let mut mflags = if trunc { libc::MSG_TRUNC } else { 0 };
    let mut cmsg = Vec::new();
    if let Some(a) = anc.filter(|_| info.domain == libc::AF_INET6) {
        let net = &ctx.kernel.net;
        if net.flag_set(info.id, libc::IPPROTO_IPV6, libc::IPV6_RECVHOPLIMIT) {
            let v = i32::from(a.hop_limit).to_le_bytes();
            put_cmsg(&mut cmsg, room, libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT, &v, &mut mflags);
        }
        if net.flag_set(info.id, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS) {
            let v = i32::from(a.tclass).to_le_bytes();
            put_cmsg(&mut cmsg, room, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, &v, &mut mflags);
        }
    }
    if !cmsg.is_empty() {
        ctx.write_bytes(h.control, &cmsg)?;
    }
    // msg_namelen (value-result), msg_controllen (what was written), msg_flags.
    if h.name != 0 {
        match from {
            Some(from) => {
                let b = encode_sockaddr(from, info.domain);
                let k = b.len().min(h.namelen as usize);
                ctx.write_bytes(h.name, &b[..k])?;
                ctx.write_bytes(msg + 8, &(b.len() as u32).to_le_bytes())?;
            }
            None => ctx.write_bytes(msg + 8, &0u32.to_le_bytes())?,
        }
    }
    ctx.write_u64(msg + 40, cmsg.len() as u64)?;
    ctx.write_i32(msg + 48, mflags)?;
    Ok(n as u64)
}

pub fn sendmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::sendmsg(ctx, a);
    }
    sendmsg_one(ctx, a[0], a[1], a[2] as i32)
}

pub fn recvmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::recvmsg(ctx, a);
    }
    recvmsg_one(ctx, a[0], a[1], a[2] as i32)
}

/// sendmmsg (glibc's resolver sends its A and AAAA queries together with it).
pub fn sendmmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (vec, vlen, flags) = (a[1], a[2].min(MMSG_MAX), a[3] as i32);
    sock(ctx, a[0])?;
    let mut done = 0u64;
    for i in 0..vlen {
        let m = vec.checked_add(i * 64).ok_or(Errno::EFAULT)?;
        let r = sendmsg_one(ctx, a[0], m, flags);
        if ctx.is_blocking() {
            if done == 0 {
                return Ok(0);
            }
            // Already sent some: report those instead of blocking.
            ctx.effect = None;
            break;
        }
        match r {
            Ok(n) => {
                ctx.write_bytes(m + 56, &(n as u32).to_le_bytes())?;
                done += 1;
            }
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

pub fn recvmmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (vec, vlen, flags) = (a[1], a[2].min(MMSG_MAX), a[3] as i32);
    sock(ctx, a[0])?;
    let mut done = 0u64;
    for i in 0..vlen {
        let m = vec.checked_add(i * 64).ok_or(Errno::EFAULT)?;
        // Only the first waits; the rest take what is already there.
        let f = if done == 0 { flags } else { flags | libc::MSG_DONTWAIT };
        let r = recvmsg_one(ctx, a[0], m, f);
        if ctx.is_blocking() {
            return Ok(0);
        }
        match r {
            Ok(n) => {
                ctx.write_bytes(m + 56, &(n as u32).to_le_bytes())?;
                done += 1;
            }
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
        if flags & 0x10000 /* MSG_WAITFORONE */ != 0 {
            break;
        }
    }
    Ok(done)
}

pub fn shutdown(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::shutdown(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    ctx.kernel.net.shutdown(info.id, a[1] as i32).map(|()| 0)
}

pub fn bind(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::bind(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let addr = read_sockaddr(ctx, a[1], a[2])?.ok_or(Errno::EAFNOSUPPORT)?;
    check_family(&info, &addr)?;
    let r = ctx.kernel.net.bind(info.id, host_addr(&info, addr));
    ctx.kernel.flush_net_notes();
    r.map(|()| 0)
}

/// listen(): a listener of the sandbox (its port is in the sandbox's port
/// table; connects from the sandbox's processes reach it, nothing from the host).
pub fn listen(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::listen(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    ctx.kernel.net.listen(info.id, a[1] as i32).map(|()| 0)
}

fn accept_common(ctx: &mut Ctx, fd: u64, addr: u64, len_ptr: u64, flags: i32) -> SysResult {
    if flags & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) != 0 {
        return Err(Errno::EINVAL);
    }
    let (info, nonblock) = sock(ctx, fd)?;
    if addr != 0 && len_ptr != 0 {
        ctx.user_range_mut(len_ptr, 4)?;
    }
    // The fd slot first: a full table leaves the connection queued.
    if ctx.proc.fds.len() >= crate::fd::MAX_FDS as usize {
        return Err(Errno::EMFILE);
    }
    match ctx.kernel.net.accept(info.id) {
        Ok((id, peer)) => {
            let mut oflags = libc::O_RDWR;
            if flags & libc::SOCK_NONBLOCK != 0 {
                oflags |= libc::O_NONBLOCK;
            }
            if flags & libc::SOCK_CLOEXEC != 0 {
                oflags |= libc::O_CLOEXEC;
            }
            let nfd =
                match ctx.proc.fds.open(FileKind::Socket(SockInfo { id, domain: info.domain, stream: true }), oflags) {
                    Ok(nfd) => nfd,
                    Err(e) => {
                        ctx.kernel.net.close(id);
                        return Err(e);
                    }
                };
            write_sockaddr(ctx, addr, len_ptr, peer, info.domain)?;
            Ok(nfd as u64)
        }
        Err(Errno::EAGAIN) if !nonblock => {
            let (rcv, _) = ctx.kernel.net.timeouts(info.id);
            block_on(ctx, fd, libc::POLLIN, timeout_deadline(rcv), Err(Errno::EAGAIN))
        }
        Err(e) => Err(e),
    }
}

pub fn accept4(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::accept4(ctx, a);
    }
    accept_common(ctx, a[0], a[1], a[2], a[3] as i32)
}

pub fn accept(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::accept(ctx, a);
    }
    accept_common(ctx, a[0], a[1], a[2], 0)
}

pub fn getsockname(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::getsockname(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let addr = ctx.kernel.net.local_addr(info.id)?;
    write_sockaddr(ctx, a[1], a[2], addr, info.domain)?;
    Ok(0)
}

pub fn getpeername(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::getpeername(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let addr =
        ctx.kernel.net.peer_addr(info.id).map_err(|e| if e == Errno::ECONNRESET { Errno::ENOTCONN } else { e })?;
    write_sockaddr(ctx, a[1], a[2], addr, info.domain)?;
    Ok(0)
}

/// Options passed to the host socket as they are (level, name).
fn passthrough(level: i32, name: i32) -> bool {
    match level {
        libc::SOL_SOCKET => matches!(
            name,
            libc::SO_REUSEADDR
                | libc::SO_REUSEPORT
                | libc::SO_KEEPALIVE
                | libc::SO_SNDBUF
                | libc::SO_RCVBUF
                | libc::SO_LINGER
                | libc::SO_OOBINLINE
                | libc::SO_ERROR
                | libc::SO_RCVLOWAT
                | libc::SO_BROADCAST
                | libc::SO_PRIORITY
        ),
        libc::IPPROTO_TCP => matches!(
            name,
            libc::TCP_NODELAY
                | libc::TCP_MAXSEG
                | libc::TCP_KEEPIDLE
                | libc::TCP_KEEPINTVL
                | libc::TCP_KEEPCNT
                | libc::TCP_QUICKACK
                | libc::TCP_USER_TIMEOUT
                | libc::TCP_NOTSENT_LOWAT
                | libc::TCP_INFO
        ),
        libc::IPPROTO_IP => {
            matches!(name, libc::IP_TOS | libc::IP_TTL | libc::IP_RECVERR | libc::IP_MTU_DISCOVER | libc::IP_MTU)
        }
        libc::IPPROTO_IPV6 => matches!(
            name,
            libc::IPV6_V6ONLY
                | libc::IPV6_TCLASS
                | libc::IPV6_UNICAST_HOPS
                | libc::IPV6_RECVERR
                | libc::IPV6_MTU_DISCOVER
                | libc::IPV6_MTU
                | libc::IPV6_RECVHOPLIMIT
                | libc::IPV6_RECVTCLASS
        ),
        _ => false,
    }
}

fn timeval(d: Option<Duration>) -> [u8; 16] {
    let d = d.unwrap_or_default();
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&(d.as_secs() as i64).to_le_bytes());
    b[8..].copy_from_slice(&(d.subsec_micros() as i64).to_le_bytes());
    b
}

pub fn setsockopt(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::setsockopt(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let (level, name, val, len) = (a[1] as i32, a[2] as i32, a[3], a[4]);
    if len > OPT_MAX {
        return Err(Errno::EINVAL);
    }
    let mut v = ctx.bytes(val, len)?.to_vec();
    if level == libc::SOL_SOCKET && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO) {
        if v.len() < 16 {
            return Err(Errno::EINVAL);
        }
        let s = i64::from_le_bytes(v[..8].try_into().map_err(|_| Errno::EINVAL)?);
        let us = i64::from_le_bytes(v[8..16].try_into().map_err(|_| Errno::EINVAL)?);
        if !(0..1_000_000).contains(&us) {
            return Err(Errno(libc::EDOM));
        }
        let t = if s < 0 { None } else { Some(Duration::new(s as u64, us as u32 * 1000)) };
        ctx.kernel.net.set_timeout(info.id, name == libc::SO_RCVTIMEO, t.filter(|d| !d.is_zero()))?;
        return Ok(0);
    }
    if level == libc::IPPROTO_UDPLITE {
        let cov = udplite_coverage(ctx, info, name, &v)?;
        return ctx.kernel.net.setsockopt(info.id, level, name, &cov.to_le_bytes()).map(|()| 0);
    }
    if !passthrough(level, name) || (level == libc::SOL_SOCKET && name == libc::SO_ERROR) {
        return Err(Errno::ENOPROTOOPT);
    }
    if level == libc::SOL_SOCKET && (name == libc::SO_SNDBUF || name == libc::SO_RCVBUF) && v.len() >= 4 {
        // Host kernel memory the guest asks for: capped at 4 MiB.
        let want = i32::from_le_bytes([v[0], v[1], v[2], v[3]]).clamp(0, 4 << 20);
        v[..4].copy_from_slice(&want.to_le_bytes());
    }
    ctx.kernel.net.setsockopt(info.id, level, name, &v).map(|()| 0)
}

const UDPLITE_SEND_CSCOV: i32 = 10;
const UDPLITE_RECV_CSCOV: i32 = 11;

/// A UDP-Lite checksum coverage option (SOL_UDPLITE) as Linux stores it:
/// ENOPROTOOPT on other sockets and names, EINVAL for a short value, any
/// other value below 8 but 0 raised to 8 (the header), at most 0xffff. The coverage is kept and
/// reported; datagrams never leave the sandbox, so it guards no checksum.
fn udplite_coverage(ctx: &Ctx, info: SockInfo, name: i32, v: &[u8]) -> Result<i32, Errno> {
    if info.stream || !ctx.kernel.net.is_udplite(info.id) || !matches!(name, UDPLITE_SEND_CSCOV | UDPLITE_RECV_CSCOV) {
        return Err(Errno::ENOPROTOOPT);
    }
    let b: [u8; 4] = v.get(..4).and_then(|b| b.try_into().ok()).ok_or(Errno::EINVAL)?;
    let cov = i32::from_le_bytes(b);
    Ok(if cov != 0 && cov < 8 { 8 } else { cov.min(0xffff) })
}

pub fn getsockopt(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !is_inet(ctx, a[0]) {
        return unix::getsockopt(ctx, a);
    }
    let (info, _) = sock(ctx, a[0])?;
    let (level, name, val, len_ptr) = (a[1] as i32, a[2] as i32, a[3], a[4]);
    let cap = i32::from_le_bytes(ctx.bytes(len_ptr, 4)?.try_into().map_err(|_| Errno::EFAULT)?);
    if cap < 0 {
        return Err(Errno::EINVAL);
    }
    let int = |v: i32| v.to_le_bytes().to_vec();
    let live = ctx.kernel.net.is_live(info.id);
    let value: Vec<u8> = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_TYPE) => int(if info.stream { libc::SOCK_STREAM } else { libc::SOCK_DGRAM }),
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => int(info.domain),
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => int(if info.stream {
            libc::IPPROTO_TCP
        } else if ctx.kernel.net.is_udplite(info.id) {
            libc::IPPROTO_UDPLITE
        } else {
            libc::IPPROTO_UDP
        }),
        (libc::IPPROTO_UDPLITE, n) => {
            udplite_coverage(ctx, info, n, &[0; 4])?;
            let v = ctx.kernel.net.getsockopt(info.id, libc::IPPROTO_UDPLITE, n, 4)?;
            int(v.get(..4).and_then(|b| b.try_into().ok()).map_or(0, i32::from_le_bytes))
        }
        (libc::SOL_SOCKET, libc::SO_ACCEPTCONN) => int(ctx.kernel.net.is_listening(info.id) as i32),
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO) => timeval(ctx.kernel.net.timeouts(info.id).0).to_vec(),
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO) => timeval(ctx.kernel.net.timeouts(info.id).1).to_vec(),
        // A socket restored from a snapshot: its connection was reset.
        (libc::SOL_SOCKET, libc::SO_ERROR) if !live => int(libc::ECONNRESET),
        (l, n) if passthrough(l, n) => {
            ctx.kernel.net.getsockopt(info.id, l, n, (cap as u64).min(OPT_MAX * 4) as usize)?
        }
        _ => return Err(Errno::ENOPROTOOPT),
    };
    let n = value.len().min(cap as usize);
    ctx.write_bytes(val, &value[..n])?;
    ctx.write_i32(len_ptr, n as i32)?;
    Ok(0)
}
