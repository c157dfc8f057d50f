//! AF_INET / AF_INET6 sockets as files (`FileKind::Socket`): a host socket
//! the VMM owns (`crate::net`). read and write are a receive and a send; the
//! socket calls themselves are in `crate::syscalls::sys_socket`.

use std::net::{SocketAddr, SocketAddrV6};
use std::time::{Duration, Instant};

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile, SockInfo};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::Ctx;
use crate::net::{Ancillary, Packet};
use crate::vfs::Stat;

/// Bytes copied through the host per sendmsg/recvmsg call (a stream returns a short count beyond).
pub(crate) const MSG_COPY_MAX: usize = 1 << 20;
/// Largest UDP payload.
pub(crate) const DGRAM_MAX: usize = 65507;
pub(crate) fn sock(ctx: &Ctx, fd: u64) -> Result<(SockInfo, bool), Errno> {
    let f = ctx.proc.fds.get(fd as i32)?;
    match f.kind {
        FileKind::Socket(s) => Ok((s, f.flags & libc::O_NONBLOCK != 0)),
        _ => Err(Errno::ENOTSOCK),
    }
}

/// Block the call until socket `fd` is ready for `events` (the engine waits
/// on the host socket and re-runs the handler), or until `deadline` (a socket
/// timeout), when the call returns `on_timeout`.
pub(crate) fn block_on(
    ctx: &mut Ctx,
    fd: u64,
    events: i16,
    deadline: Option<Instant>,
    on_timeout: SysResult,
) -> SysResult {
    if ctx.timed_out {
        return on_timeout;
    }
    let ofd = ctx.proc.fds.ofd(fd as i32)?;
    ctx.block(Block::new(WaitOn::Fd { ofd, events: events as u16 as u32 }).until(deadline, on_timeout))
}

/// A non-blocking call found the socket drained (or full): EAGAIN, and its
/// next readiness is a new edge for EPOLLET watches.
fn drained(ctx: &mut Ctx, fd: u64, events: i16) -> Errno {
    if let Ok(ofd) = ctx.proc.fds.ofd(fd as i32) {
        ctx.proc.fds.objects.et_drained(ofd, events as u16 as u32);
    }
    Errno::EAGAIN
}

pub(crate) fn timeout_deadline(t: Option<Duration>) -> Option<Instant> {
    t.filter(|d| !d.is_zero()).map(|d| Instant::now() + d)
}

pub(crate) fn check_family(info: &SockInfo, a: &SocketAddr) -> Result<(), Errno> {
    if info.domain == libc::AF_INET && a.is_ipv6() {
        return Err(Errno::EAFNOSUPPORT);
    }
    Ok(())
}

/// An address as given by an AF_INET6 socket, the way the host socket takes it.
pub(crate) fn host_addr(info: &SockInfo, a: SocketAddr) -> SocketAddr {
    match (info.domain, a) {
        (libc::AF_INET6, SocketAddr::V4(v4)) => {
            SocketAddr::V6(SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0))
        }
        _ => a,
    }
}

/// Send `data` on a socket, waiting while a blocking socket has no room.
pub(crate) fn send_common(
    ctx: &mut Ctx,
    fd: u64,
    data: Vec<u8>,
    to: Option<SocketAddr>,
    flags: i32,
    pkt: Packet,
) -> SysResult {
    let (info, nonblock) = sock(ctx, fd)?;
    let dontwait = nonblock || flags & libc::MSG_DONTWAIT != 0;
    let to = match to {
        Some(a) if !info.stream => {
            check_family(&info, &a)?;
            Some(host_addr(&info, a))
        }
        // A destination on a stream socket is ignored (as Linux does for a connected one).
        _ => None,
    };
    if !info.stream && data.len() > DGRAM_MAX {
        return Err(Errno::EMSGSIZE);
    }
    let r = ctx.kernel.net.send_with(info.id, &data, to, flags, pkt);
    ctx.kernel.flush_net_notes();
    match r {
        Ok(n) => Ok(n as u64),
        Err(Errno::EAGAIN) if !dontwait => {
            let (_, snd) = ctx.kernel.net.timeouts(info.id);
            block_on(ctx, fd, libc::POLLOUT, timeout_deadline(snd), Err(Errno::EAGAIN))
        }
        Err(Errno::EAGAIN) => Err(drained(ctx, fd, libc::POLLOUT)),
        Err(e) => Err(e),
    }
}

/// What a receive got: the bytes (up to the buffer), the length to report,
/// the source of a datagram, whether it was truncated.
pub(crate) type Received = (Vec<u8>, usize, Option<SocketAddr>, bool, Option<Ancillary>);

/// Receive into a host buffer of up to `len` bytes. `Ok(None)`: a blocking
/// socket has nothing yet and the call blocks (the caller returns at once).
pub(crate) fn recv_common(ctx: &mut Ctx, fd: u64, len: usize, flags: i32) -> Result<Option<Received>, Errno> {
    let (info, nonblock) = sock(ctx, fd)?;
    let dontwait = nonblock || flags & libc::MSG_DONTWAIT != 0;
    let mut buf = vec![0u8; len];
    let mut anc = None;
    let r = ctx.kernel.net.recv_ancillary(info.id, &mut buf, flags, &mut anc);
    ctx.kernel.flush_net_notes();
    match r {
        Ok((n, from, trunc)) => Ok(Some((buf, n, from, trunc, anc))),
        Err(Errno::EAGAIN) if !dontwait => {
            let (rcv, _) = ctx.kernel.net.timeouts(info.id);
            block_on(ctx, fd, libc::POLLIN, timeout_deadline(rcv), Err(Errno::EAGAIN))?;
            Ok(None)
        }
        Err(Errno::EAGAIN) => Err(drained(ctx, fd, libc::POLLIN)),
        Err(e) => Err(e),
    }
}

/// Guest buffer of a plain send: copied (bounded) so guest memory is never aliased by a host call.
pub(crate) fn guest_data(ctx: &Ctx, buf: u64, len: u64, stream: bool) -> Result<Vec<u8>, Errno> {
    let len = if stream { len.min(MSG_COPY_MAX as u64) } else { len.min(DGRAM_MAX as u64 + 1) };
    Ok(ctx.bytes(buf, len)?.to_vec())
}

/// Host bytes (sendfile's) sent on inet socket `fd`, as a write of them
/// would (at most what one send copies).
fn write_host_bytes(ctx: &mut Ctx, fd: i32, data: &[u8]) -> SysResult {
    let (info, _) = sock(ctx, fd as u64)?;
    let cap = if info.stream { MSG_COPY_MAX } else { DGRAM_MAX + 1 };
    send_common(ctx, fd as u64, data[..data.len().min(cap)].to_vec(), None, 0, Packet::default())
}

/// read()/write() on a socket fd.
fn read_fd(ctx: &mut Ctx, fd: i32, buf: u64, len: u64) -> SysResult {
    let len = len.min(MSG_COPY_MAX as u64);
    ctx.user_range(buf, len)?;
    let Some((data, n, _, _, _)) = recv_common(ctx, fd as u64, len as usize, 0)? else { return Ok(0) };
    let k = n.min(data.len());
    ctx.write_bytes(buf, &data[..k])?;
    Ok(k as u64)
}

fn write_fd(ctx: &mut Ctx, fd: i32, buf: u64, len: u64) -> SysResult {
    let (info, _) = sock(ctx, fd as u64)?;
    let data = guest_data(ctx, buf, len, info.stream)?;
    send_common(ctx, fd as u64, data, None, 0, Packet::default())
}

/// ioctl FIONREAD on a socket.
fn pending(ctx: &mut Ctx, info: SockInfo) -> Result<i32, Errno> {
    ctx.kernel.net.pending(info.id)
}

pub struct InetSocketFile;

impl FileOps for InetSocketFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        read_fd(ctx, f.fd, buf, len)
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        write_fd(ctx, f.fd, buf, len)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        write_host_bytes(ctx, f.fd, data)
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        let FileKind::Socket(s) = f.file.kind else { return Err(Errno::EBADF) };
        Ok(pending(ctx, s)?.max(0) as u64)
    }

    /// Asked of the host (POLLHUP/POLLERR included).
    fn poll(&self, p: &PollCtx, f: &OpenFile, _: u32) -> u32 {
        let FileKind::Socket(s) = f.kind else { return libc::POLLNVAL as u32 };
        p.kernel.net.poll(s.id, crate::net::POLL_MASK | libc::POLLRDNORM | libc::POLLWRNORM) as u16 as u32
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        Ok(crate::file::stdio::pipe_stat(f))
    }

    fn release(&self, ctx: &mut Ctx, kind: FileKind) {
        if let FileKind::Socket(s) = kind {
            ctx.kernel.net.close(s.id);
        }
    }
}
