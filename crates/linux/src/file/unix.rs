//! AF_UNIX sockets as files (`ObjKind::Socket`): read is a receive, write a
//! send on the connected peer. The socket calls themselves are in
//! `crate::syscalls::sys_unix`.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{epipe, object_id, object_poll, object_write, or_block};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{READABLE, WRITABLE};
use crate::kernel::{Ctx, MAX_RW};
use crate::objects::{SockType, SOCKET_CAPACITY};
use crate::vfs::{FileType, Stat};

pub struct UnixSocketFile;

/// `f` as non-blocking when the call passed MSG_DONTWAIT.
pub(crate) fn nonblocking(f: &OpenFile, flags: i32) -> OpenFile {
    let mut f = *f;
    if flags & libc::MSG_DONTWAIT != 0 {
        f.flags |= libc::O_NONBLOCK;
    }
    f
}

/// Write a sockaddr_un for `sun_path` to (`addr`, `*len_ptr`), as accept/getsockname do.
pub(crate) fn put_addr(ctx: &mut Ctx, addr: u64, len_ptr: u64, sun_path: &[u8]) -> Result<(), Errno> {
    if addr == 0 || len_ptr == 0 {
        return Ok(());
    }
    let room = ctx.bytes(len_ptr, 4)?;
    let room = i32::from_le_bytes([room[0], room[1], room[2], room[3]]);
    if room < 0 {
        return Err(Errno::EINVAL);
    }
    let mut full = (libc::AF_UNIX as u16).to_le_bytes().to_vec();
    full.extend_from_slice(sun_path);
    let n = full.len().min(room as usize);
    ctx.write_bytes(addr, &full[..n])?;
    ctx.write_i32(len_ptr, full.len() as i32)
}

/// A sockaddr_nl (`pid` 0: the kernel).
pub(crate) fn netlink_addr(pid: u32) -> Vec<u8> {
    let mut b = (libc::AF_NETLINK as u16).to_le_bytes().to_vec();
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&pid.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b
}

/// Write a sockaddr to (`addr`, `*len_ptr`): value-result, truncated to the buffer.
pub(crate) fn put_raw_addr(ctx: &mut Ctx, addr: u64, len_ptr: u64, full: &[u8]) -> Result<(), Errno> {
    if addr == 0 || len_ptr == 0 {
        return Ok(());
    }
    let room = ctx.bytes(len_ptr, 4)?;
    let room = i32::from_le_bytes([room[0], room[1], room[2], room[3]]);
    if room < 0 {
        return Err(Errno::EINVAL);
    }
    let n = full.len().min(room as usize);
    ctx.write_bytes(addr, &full[..n])?;
    ctx.write_i32(len_ptr, full.len() as i32)
}

pub(crate) fn is_netlink(ctx: &Ctx, id: u64) -> bool {
    ctx.proc.fds.objects.socket(id).is_ok_and(|s| s.ty == SockType::Netlink)
}

/// The source address a receive reports: the kernel for a netlink socket.
pub(crate) fn put_source(ctx: &mut Ctx, id: u64, addr: u64, len_ptr: u64, sun_path: &[u8]) -> Result<(), Errno> {
    if is_netlink(ctx, id) {
        return put_raw_addr(ctx, addr, len_ptr, &netlink_addr(0));
    }
    put_addr(ctx, addr, len_ptr, sun_path)
}

/// Receive into guest memory: shared by read(2) on a socket and recvfrom.
/// `src`: (addr, addrlen pointer) to report the sender in. Descriptors that
/// came with the data are dropped (no control buffer): the dispatcher gives
/// back what they held after the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn recv_into(
    ctx: &mut Ctx,
    f: &OpenFile,
    ofd: u64,
    id: u64,
    buf: u64,
    len: u64,
    flags: i32,
    src: Option<(u64, u64)>,
) -> SysResult {
    let f = nonblocking(f, flags);
    let len = len.min(MAX_RW).min(SOCKET_CAPACITY as u64);
    ctx.user_range(buf, len)?;
    let r = ctx.proc.fds.objects.recv(id, len as usize, flags & libc::MSG_PEEK != 0);
    let (data, full, from) = match r {
        Ok(v) => v,
        Err(e) => return or_block(ctx, &f, ofd, READABLE, Err(e)),
    };
    ctx.write_bytes(buf, &data)?;
    if let Some((addr, alen)) = src {
        put_source(ctx, id, addr, alen, &from)?;
    }
    Ok(if flags & libc::MSG_TRUNC != 0 { full as u64 } else { data.len() as u64 })
}

impl FileOps for UnixSocketFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        recv_into(ctx, &f.file, f.ofd, object_id(&f.file)?, buf, len, 0, None)
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        object_write(self, ctx, f, buf, len, pos)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let r = ctx.proc.fds.objects.send(object_id(&f.file)?, data, None).map(|n| n as u64);
        match r {
            Err(Errno::EPIPE) => Err(epipe(ctx)),
            r => or_block(ctx, &f.file, f.ofd, WRITABLE, r),
        }
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        Ok(ctx.proc.fds.objects.readable_bytes(object_id(&f.file)?))
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
        object_poll(p, f, depth)
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        let mut st = Stat::pipe(2_000_000_000 + object_id(&f.file)?);
        st.kind = FileType::Socket;
        Ok(st)
    }
}
