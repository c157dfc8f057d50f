//! AF_UNIX sockets inside the sandbox: socketpair, and sockets bound to
//! abstract names or to socket files in the overlay, connected to each other.
//! Never a host socket: every other address family is EAFNOSUPPORT here,
//! except AF_NETLINK (NETLINK_ROUTE), whose requests the VMM answers
//! (`crate::net::netlink`: the interface list, `lo` only).

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::file::common::{epipe, or_block};
use crate::file::unix::{is_netlink, netlink_addr, nonblocking, put_addr, put_raw_addr, put_source, recv_into};
use crate::kernel::block::{READABLE, WRITABLE};
use crate::kernel::{Args, Ctx};
use crate::objects::{SockType, UnixName, SCM_MAX_FD, SOCKET_CAPACITY, UNIX_PATH_MAX};
use crate::vfs::FileType;

const SOCK_FLAGS: i32 = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;

fn sock_type(ty: u64) -> Result<(SockType, i32), Errno> {
    let ty = ty as i32;
    let flags = ty & SOCK_FLAGS;
    Ok((SockType::from_linux(ty & !SOCK_FLAGS)?, flags))
}

fn check_domain(domain: u64, proto: u64) -> Result<(), Errno> {
    if domain as i32 != libc::AF_UNIX {
        return Err(Errno::EAFNOSUPPORT);
    }
    if proto != 0 && proto as i32 != libc::PF_UNIX {
        return Err(Errno::EPROTONOSUPPORT);
    }
    Ok(())
}

/// AF_NETLINK: NETLINK_ROUTE only, raw or datagram (the same on Linux).
fn netlink_socket(ctx: &mut Ctx, a: &Args) -> SysResult {
    let ty = a[1] as i32;
    let flags = ty & SOCK_FLAGS;
    if !matches!(ty & !SOCK_FLAGS, libc::SOCK_RAW | libc::SOCK_DGRAM) {
        return Err(Errno::ESOCKTNOSUPPORT);
    }
    if a[2] as i32 != libc::NETLINK_ROUTE {
        return Err(Errno::EPROTONOSUPPORT);
    }
    let id = ctx.proc.fds.objects.new_socket(SockType::Netlink);
    Ok(ctx.proc.fds.open_object(id, libc::O_RDWR | flags)? as u64)
}

/// A netlink socket's port id: the process's pid, as Linux gives the first
/// socket of a process (the answers are addressed to it).
fn netlink_pid(ctx: &Ctx) -> u32 {
    ctx.proc.pid
}

/// Check a sockaddr_nl a guest gives (bind, connect, sendto): only the
/// kernel (port 0) is reachable; multicast groups are accepted and never
/// carry anything (no interface ever changes).
fn read_netlink_addr(ctx: &Ctx, ptr: u64, len: u64) -> Result<u32, Errno> {
    if len < 12 {
        return Err(Errno::EINVAL);
    }
    let b = ctx.bytes(ptr, 12)?;
    if u16::from_le_bytes([b[0], b[1]]) as i32 != libc::AF_NETLINK {
        return Err(Errno::EINVAL);
    }
    Ok(u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
}

/// A send on a netlink socket: the request's answers are queued on the socket.
fn netlink_send(ctx: &mut Ctx, id: u64, data: &[u8], dest: Option<(u64, u64)>) -> SysResult {
    if let Some((ptr, len)) = dest.filter(|(p, _)| *p != 0) {
        if read_netlink_addr(ctx, ptr, len)? != 0 {
            // Another socket's port: nothing of the sandbox listens there.
            return Err(Errno::ECONNREFUSED);
        }
    }
    let answers = crate::net::netlink::answer(data, netlink_pid(ctx))?;
    ctx.proc.fds.objects.netlink_deliver(id, answers)?;
    Ok(data.len() as u64)
}

pub fn socket(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] as i32 == libc::AF_NETLINK {
        return netlink_socket(ctx, a);
    }
    check_domain(a[0], a[2])?;
    let (ty, flags) = sock_type(a[1])?;
    let id = ctx.proc.fds.objects.new_socket(ty);
    Ok(ctx.proc.fds.open_object(id, libc::O_RDWR | flags)? as u64)
}

pub fn socketpair(ctx: &mut Ctx, a: &Args) -> SysResult {
    check_domain(a[0], a[2])?;
    let (ty, flags) = sock_type(a[1])?;
    ctx.user_range(a[3], 8)?;
    let (x, y) = ctx.proc.fds.objects.socket_pair(ty);
    let (fx, fy) = ctx.proc.fds.open_two((x, libc::O_RDWR | flags), (y, libc::O_RDWR | flags))?;
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&fx.to_le_bytes());
    b[4..].copy_from_slice(&fy.to_le_bytes());
    ctx.write_bytes(a[3], &b)?;
    Ok(0)
}

/// The socket object behind `fd` (ENOTSOCK for anything else).
fn sock_of(ctx: &Ctx, fd: u64) -> Result<(OpenFile, u64, u64), Errno> {
    let fd = fd as i32;
    let f = *ctx.proc.fds.get(fd)?;
    let ofd = ctx.proc.fds.ofd(fd)?;
    match f.kind {
        FileKind::Object(id) => {
            ctx.proc.fds.objects.socket(id)?;
            Ok((f, ofd, id))
        }
        _ => Err(Errno::ENOTSOCK),
    }
}

/// An address as given: (abstract name) or (path bytes), from a sockaddr_un.
enum Addr {
    Abstract(Vec<u8>),
    Path(Vec<u8>),
    /// Only the family (autobind on bind).
    Unnamed,
}

fn read_addr(ctx: &Ctx, ptr: u64, len: u64) -> Result<Addr, Errno> {
    if len < 2 || len > 2 + UNIX_PATH_MAX as u64 {
        return Err(Errno::EINVAL);
    }
    let b = ctx.bytes(ptr, len)?;
    if u16::from_le_bytes([b[0], b[1]]) as i32 != libc::AF_UNIX {
        return Err(Errno::EINVAL);
    }
    let path = &b[2..];
    Ok(match path.first() {
        None => Addr::Unnamed,
        Some(0) => Addr::Abstract(path[1..].to_vec()),
        Some(_) => {
            let end = path.iter().position(|&c| c == 0).unwrap_or(path.len());
            Addr::Path(path[..end].to_vec())
        }
    })
}

/// The sun_path of a path name as reported (with its NUL).
fn path_sun(p: &[u8]) -> Vec<u8> {
    let mut v = p.to_vec();
    v.push(0);
    v
}

/// The name an address refers to for connect/sendto (a path must be a socket file).
fn resolve(ctx: &Ctx, addr: Addr) -> Result<UnixName, Errno> {
    match addr {
        Addr::Abstract(n) => Ok(UnixName::Abstract(n)),
        Addr::Path(p) => {
            let ino = ctx.proc.vfs.resolve(ctx.proc.cwd, &p, true)?;
            if ctx.proc.vfs.stat(ino)?.kind != FileType::Socket {
                return Err(Errno::ECONNREFUSED);
            }
            Ok(UnixName::Path(ino, path_sun(&p)))
        }
        Addr::Unnamed => Err(Errno::EINVAL),
    }
}

pub fn bind(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    if is_netlink(ctx, id) {
        let pid = read_netlink_addr(ctx, a[1], a[2])?;
        return if pid == 0 || pid == netlink_pid(ctx) { Ok(0) } else { Err(Errno::EADDRINUSE) };
    }
    if ctx.proc.fds.objects.socket(id)?.name.is_some() {
        return Err(Errno::EINVAL);
    }
    let name = match read_addr(ctx, a[1], a[2])? {
        Addr::Abstract(n) => UnixName::Abstract(n),
        // Autobind: an abstract name of five hex digits, as Linux.
        Addr::Unnamed => {
            let mut k = id;
            loop {
                let n = format!("{:05x}", k & 0xFFFFF).into_bytes();
                if !ctx.proc.fds.objects.abstract_names.contains_key(&n) {
                    break UnixName::Abstract(n);
                }
                k = k.wrapping_add(1);
                if k.wrapping_sub(id) > 0xFFFFF {
                    return Err(Errno::ENOSPC);
                }
            }
        }
        Addr::Path(p) => {
            let mode = 0o777 & !ctx.proc.umask;
            let ino = match ctx.proc.vfs.mknod(ctx.proc.cwd, &p, FileType::Socket, mode) {
                Err(Errno::EEXIST) => return Err(Errno::EADDRINUSE),
                r => r?,
            };
            UnixName::Path(ino, path_sun(&p))
        }
    };
    ctx.proc.fds.objects.bind(id, name)?;
    Ok(0)
}

pub fn listen(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    ctx.proc.fds.objects.listen(id, a[1] as i32)?;
    Ok(0)
}

pub fn connect(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (f, ofd, id) = sock_of(ctx, a[0])?;
    if is_netlink(ctx, id) {
        return if read_netlink_addr(ctx, a[1], a[2])? == 0 { Ok(0) } else { Err(Errno::ECONNREFUSED) };
    }
    let name = resolve(ctx, read_addr(ctx, a[1], a[2])?)?;
    let r = ctx.proc.fds.objects.connect(id, &name).map(|_| 0);
    or_block(ctx, &f, ofd, WRITABLE, r)
}

fn accept_common(ctx: &mut Ctx, a: &Args, flags: i32) -> SysResult {
    if flags & !SOCK_FLAGS != 0 {
        return Err(Errno::EINVAL);
    }
    let (f, ofd, id) = sock_of(ctx, a[0])?;
    // Check the address buffer before taking the connection off the queue.
    if a[1] != 0 {
        ctx.user_range(a[2], 4)?;
    }
    let conn = match ctx.proc.fds.objects.accept(id) {
        Ok(c) => c,
        Err(e) => return or_block(ctx, &f, ofd, READABLE, Err(e)),
    };
    let peer_name = ctx
        .proc
        .fds
        .objects
        .socket(conn)?
        .peer()
        .and_then(|p| ctx.proc.fds.objects.socket(p).ok())
        .and_then(|p| p.name.as_ref().map(|n| n.sun_path()))
        .unwrap_or_default();
    let fd = ctx.proc.fds.open_object(conn, libc::O_RDWR | flags)?;
    put_addr(ctx, a[1], a[2], &peer_name)?;
    Ok(fd as u64)
}

pub fn accept(ctx: &mut Ctx, a: &Args) -> SysResult {
    accept_common(ctx, a, 0)
}

pub fn accept4(ctx: &mut Ctx, a: &Args) -> SysResult {
    accept_common(ctx, a, a[3] as i32)
}

pub fn getsockname(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    if is_netlink(ctx, id) {
        ctx.bytes(a[2], 4)?;
        let me = netlink_addr(netlink_pid(ctx));
        return put_raw_addr(ctx, a[1], a[2], &me).map(|_| 0);
    }
    let name = ctx.proc.fds.objects.socket(id)?.name.as_ref().map(|n| n.sun_path()).unwrap_or_default();
    ctx.bytes(a[2], 4)?;
    put_addr(ctx, a[1], a[2], &name)?;
    Ok(0)
}

pub fn getpeername(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    if is_netlink(ctx, id) {
        ctx.bytes(a[2], 4)?;
        return put_raw_addr(ctx, a[1], a[2], &netlink_addr(0)).map(|_| 0);
    }
    let s = ctx.proc.fds.objects.socket(id)?;
    let peer = s.peer().ok_or(Errno::ENOTCONN)?;
    let name = match ctx.proc.fds.objects.socket(peer) {
        Ok(p) => p.name.as_ref().map(|n| n.sun_path()).unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    ctx.bytes(a[2], 4)?;
    put_addr(ctx, a[1], a[2], &name)?;
    Ok(0)
}

fn send_common(ctx: &mut Ctx, fd: u64, data: Vec<u8>, flags: i32, dest: Option<(u64, u64)>) -> SysResult {
    let (f, ofd, id) = sock_of(ctx, fd)?;
    if is_netlink(ctx, id) {
        return netlink_send(ctx, id, &data, dest);
    }
    let f = nonblocking(&f, flags);
    let dest = match dest {
        Some((ptr, len)) if ptr != 0 => Some(resolve(ctx, read_addr(ctx, ptr, len)?)?),
        _ => None,
    };
    match ctx.proc.fds.objects.send(id, &data, dest.as_ref()) {
        Err(Errno::EPIPE) if flags & libc::MSG_NOSIGNAL != 0 => Err(Errno::EPIPE),
        Err(Errno::EPIPE) => Err(epipe(ctx)),
        r => or_block(ctx, &f, ofd, WRITABLE, r.map(|n| n as u64)),
    }
}

pub fn sendto(ctx: &mut Ctx, a: &Args) -> SysResult {
    let len = a[2].min(SOCKET_CAPACITY as u64 + 1);
    let data = ctx.bytes(a[1], len)?.to_vec();
    send_common(ctx, a[0], data, a[3] as i32, Some((a[4], a[5])))
}

pub fn recvfrom(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (f, ofd, id) = sock_of(ctx, a[0])?;
    recv_into(ctx, &f, ofd, id, a[1], a[2], a[3] as i32, Some((a[4], a[5])))
}

/// struct msghdr: (name, namelen, iov, iovlen, control, controllen).
fn msghdr(ctx: &Ctx, ptr: u64) -> Result<[u64; 6], Errno> {
    let b = ctx.bytes(ptr, 56)?;
    let u = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    Ok([u(0), u64::from(u32::from_le_bytes(b[8..12].try_into().unwrap_or_default())), u(16), u(24), u(32), u(40)])
}

fn iovecs(ctx: &Ctx, iov: u64, count: u64) -> Result<Vec<(u64, u64)>, Errno> {
    if count > 1024 {
        return Err(Errno::EMSGSIZE);
    }
    let raw = ctx.bytes(iov, count * 16)?;
    Ok(raw
        .chunks_exact(16)
        .map(|c| {
            (
                u64::from_le_bytes(c[..8].try_into().unwrap_or_default()),
                u64::from_le_bytes(c[8..].try_into().unwrap_or_default()),
            )
        })
        .collect())
}

/// Largest msg_control a sendmsg may give (Linux: optmem_max, 20480).
const MAX_CONTROL: u64 = 20480;
const CMSG_HDR: usize = 16;

fn cmsg_align(n: usize) -> usize {
    (n + 7) & !7
}

/// The fds of the SCM_RIGHTS messages in a sendmsg's control buffer.
/// SCM_CREDENTIALS is refused (EOPNOTSUPP); other levels and types are EINVAL.
fn control_fds(ctx: &Ctx, control: u64, controllen: u64) -> Result<Vec<i32>, Errno> {
    if controllen == 0 {
        return Ok(Vec::new());
    }
    if controllen > MAX_CONTROL {
        return Err(Errno::ENOBUFS);
    }
    let buf = ctx.bytes(control, controllen)?;
    let mut fds = Vec::new();
    let mut off = 0usize;
    while buf.len().saturating_sub(off) >= CMSG_HDR {
        let h = &buf[off..off + CMSG_HDR];
        let len = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
        let level = i32::from_le_bytes(h[8..12].try_into().unwrap_or_default());
        let ty = i32::from_le_bytes(h[12..16].try_into().unwrap_or_default());
        let room = (buf.len() - off) as u64;
        if len < CMSG_HDR as u64 || len > room {
            return Err(Errno::EINVAL);
        }
        let len = len as usize;
        if level != libc::SOL_SOCKET {
            return Err(Errno::EINVAL);
        }
        match ty {
            libc::SCM_RIGHTS => {
                let data = &buf[off + CMSG_HDR..off + len];
                if data.len() % 4 != 0 {
                    return Err(Errno::EINVAL);
                }
                for c in data.chunks_exact(4) {
                    fds.push(i32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                }
                if fds.len() > SCM_MAX_FD {
                    return Err(Errno::EINVAL);
                }
            }
            libc::SCM_CREDENTIALS => return Err(Errno::EOPNOTSUPP),
            _ => return Err(Errno::EINVAL),
        }
        off = off.saturating_add(cmsg_align(len));
    }
    Ok(fds)
}

pub fn sendmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    let [name, namelen, iov, iovlen, control, controllen] = msghdr(ctx, a[1])?;
    let fds = control_fds(ctx, control, controllen)?;
    let mut data = Vec::new();
    for (base, len) in iovecs(ctx, iov, iovlen)? {
        let take = len.min((SOCKET_CAPACITY + 1 - data.len().min(SOCKET_CAPACITY + 1)) as u64);
        data.extend_from_slice(ctx.bytes(base, take)?);
    }
    if fds.is_empty() || sock_of(ctx, a[0]).is_ok_and(|(_, _, id)| is_netlink(ctx, id)) {
        // Descriptors sent to the kernel side go nowhere.
        return send_common(ctx, a[0], data, a[2] as i32, Some((name, namelen)));
    }
    let ofds = ctx.proc.fds.rights_of(&fds)?;
    send_common_rights(ctx, a[0], data, a[2] as i32, Some((name, namelen)), ofds)
}

/// A send with descriptors: they hold a reference each while in flight.
fn send_common_rights(
    ctx: &mut Ctx,
    fd: u64,
    data: Vec<u8>,
    flags: i32,
    dest: Option<(u64, u64)>,
    ofds: Vec<u64>,
) -> SysResult {
    let (f, ofd, id) = sock_of(ctx, fd)?;
    let f = nonblocking(&f, flags);
    let dest = match dest {
        Some((ptr, len)) if ptr != 0 => Some(resolve(ctx, read_addr(ctx, ptr, len)?)?),
        _ => None,
    };
    let before = ctx.proc.fds.objects.in_flight_count;
    let r = ctx.proc.fds.objects.send_rights(id, &data, dest.as_ref(), ofds.clone());
    if ctx.proc.fds.objects.in_flight_count != before {
        ctx.proc.fds.hold(&ofds);
    }
    match r {
        Err(Errno::EPIPE) if flags & libc::MSG_NOSIGNAL != 0 => Err(Errno::EPIPE),
        Err(Errno::EPIPE) => Err(epipe(ctx)),
        r => or_block(ctx, &f, ofd, WRITABLE, r.map(|n| n as u64)),
    }
}

pub fn recvmsg(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (f, ofd, id) = sock_of(ctx, a[0])?;
    let flags = a[2] as i32;
    let [name, _namelen, iov, iovlen, control, controllen] = msghdr(ctx, a[1])?;
    let iovs = iovecs(ctx, iov, iovlen)?;
    let total: u64 = iovs.iter().fold(0u64, |s, &(_, l)| s.saturating_add(l)).min(SOCKET_CAPACITY as u64);
    for &(base, len) in &iovs {
        ctx.user_range(base, len)?;
    }
    let controllen = controllen.min(MAX_CONTROL);
    if control != 0 && controllen != 0 {
        ctx.user_range(control, controllen)?;
    }
    let f = nonblocking(&f, flags);
    let peek = flags & libc::MSG_PEEK != 0;
    let got = match ctx.proc.fds.objects.recv_rights(id, total as usize, peek) {
        Ok(v) => v,
        Err(e) => return or_block(ctx, &f, ofd, READABLE, Err(e)),
    };
    let (data, full, from) = (got.data, got.full, got.from);
    // The descriptors that came: as many as the control buffer holds are
    // installed (MSG_CTRUNC if not all); unless peeking, the trip's references go.
    let mut mflags = if full > data.len() { libc::MSG_TRUNC } else { 0 };
    let mut used_control = 0u64;
    let mut cmsg = Vec::new();
    if !got.rights.is_empty() {
        let room = if control == 0 { 0 } else { controllen as usize };
        let fit = room.saturating_sub(CMSG_HDR) / 4;
        let take = got.rights.len().min(fit);
        if take < got.rights.len() {
            mflags |= libc::MSG_CTRUNC;
        }
        let fds = ctx.proc.fds.install(&got.rights[..take], flags & libc::MSG_CMSG_CLOEXEC != 0);
        if fds.len() < take {
            mflags |= libc::MSG_CTRUNC;
        }
        if !peek {
            ctx.proc.fds.drop_held(&got.rights);
            crate::file::released(ctx, None);
        }
        if !fds.is_empty() {
            let len = CMSG_HDR + 4 * fds.len();
            cmsg.extend_from_slice(&(len as u64).to_le_bytes());
            cmsg.extend_from_slice(&libc::SOL_SOCKET.to_le_bytes());
            cmsg.extend_from_slice(&libc::SCM_RIGHTS.to_le_bytes());
            for fd in &fds {
                cmsg.extend_from_slice(&fd.to_le_bytes());
            }
            cmsg.resize(cmsg_align(len).min(room), 0);
            used_control = cmsg.len() as u64;
        }
    }
    let mut done = 0usize;
    for (base, len) in iovs {
        if done >= data.len() {
            break;
        }
        let n = (len as usize).min(data.len() - done);
        ctx.write_bytes(base, &data[done..done + n])?;
        done += n;
    }
    if !cmsg.is_empty() {
        ctx.write_bytes(control, &cmsg)?;
    }
    // msg_namelen (offset 8) <- the sender's address length; msg_controllen; msg_flags.
    if name != 0 {
        put_source(ctx, id, name, a[1] + 8, &from)?;
    }
    ctx.write_bytes(a[1] + 40, &used_control.to_le_bytes())?;
    ctx.write_i32(a[1] + 48, mflags)?;
    Ok(if flags & libc::MSG_TRUNC != 0 { full as u64 } else { data.len() as u64 })
}

pub fn shutdown(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    ctx.proc.fds.objects.shutdown(id, a[1] as i32)?;
    Ok(0)
}

/// setsockopt: buffer sizes, reuse and credential flags are accepted and
/// change nothing (the buffers have a fixed size).
pub fn setsockopt(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    if a[1] as i32 == libc::SOL_NETLINK && is_netlink(ctx, id) {
        // NETLINK_EXT_ACK, NETLINK_GET_STRICT_CHK, group membership ...: the
        // answers are the same with or without them.
        return Ok(0);
    }
    if a[1] as i32 != libc::SOL_SOCKET {
        return Err(Errno::ENOPROTOOPT);
    }
    match a[2] as i32 {
        libc::SO_REUSEADDR
        | libc::SO_REUSEPORT
        | libc::SO_RCVBUF
        | libc::SO_SNDBUF
        | libc::SO_PASSCRED
        | libc::SO_KEEPALIVE
        | libc::SO_RCVTIMEO
        | libc::SO_SNDTIMEO
        | libc::SO_LINGER
        | libc::SO_RCVLOWAT => Ok(0),
        _ => Err(Errno::ENOPROTOOPT),
    }
}

pub fn getsockopt(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (_, _, id) = sock_of(ctx, a[0])?;
    if a[1] as i32 != libc::SOL_SOCKET {
        return Err(Errno::ENOPROTOOPT);
    }
    let s = ctx.proc.fds.objects.socket(id)?;
    let v: Vec<u8> = match a[2] as i32 {
        libc::SO_ERROR => 0i32.to_le_bytes().to_vec(),
        libc::SO_TYPE => s.ty.to_linux().to_le_bytes().to_vec(),
        libc::SO_DOMAIN if s.ty == SockType::Netlink => libc::AF_NETLINK.to_le_bytes().to_vec(),
        libc::SO_DOMAIN => libc::AF_UNIX.to_le_bytes().to_vec(),
        libc::SO_PROTOCOL => 0i32.to_le_bytes().to_vec(),
        libc::SO_ACCEPTCONN => {
            i32::from(matches!(s.state, crate::objects::SockState::Listening { .. })).to_le_bytes().to_vec()
        }
        libc::SO_RCVBUF | libc::SO_SNDBUF => (SOCKET_CAPACITY as i32).to_le_bytes().to_vec(),
        libc::SO_REUSEADDR | libc::SO_KEEPALIVE | libc::SO_PASSCRED => 0i32.to_le_bytes().to_vec(),
        libc::SO_PEERCRED => {
            // struct ucred of the only process: pid, uid 0, gid 0.
            let mut c = (crate::procs::GUEST_PID as i32).to_le_bytes().to_vec();
            c.extend_from_slice(&[0u8; 8]);
            c
        }
        _ => return Err(Errno::ENOPROTOOPT),
    };
    let room = ctx.bytes(a[4], 4)?;
    let room = i32::from_le_bytes([room[0], room[1], room[2], room[3]]);
    if room < 0 {
        return Err(Errno::EINVAL);
    }
    let n = v.len().min(room as usize);
    ctx.write_bytes(a[3], &v[..n])?;
    ctx.write_i32(a[4], n as i32)?;
    Ok(0)
}
