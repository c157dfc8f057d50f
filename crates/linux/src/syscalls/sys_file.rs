//! File-descriptor I/O: read, write, their vector and positional forms, lseek,
//! close, dup, fcntl, ioctl, poll/select, getdents64, ftruncate, fsync.

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::file;
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx, MAX_RW};
use crate::vfs::FileType;
use crate::wait;

const IOV_MAX: u64 = 1024;

fn fd_arg(v: u64) -> i32 {
    v as i32
}

/// Read into guest memory at `buf` from the description behind `fd`, at
/// `pos` (positional) or the file offset.
fn read_into(ctx: &mut Ctx, fd: i32, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
    let (f, ops) = file::open(ctx, fd)?;
    if !f.file.readable() {
        return Err(Errno::EBADF);
    }
    let len = len.min(MAX_RW);
    ctx.user_range_mut(buf, len)?;
    ops.read(ctx, &f, buf, len, pos)
}

fn write_from(ctx: &mut Ctx, fd: i32, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
    let (f, ops) = file::open(ctx, fd)?;
    if !f.file.writable() {
        return Err(Errno::EBADF);
    }
    let len = len.min(MAX_RW);
    ctx.user_range(buf, len)?;
    ops.write(ctx, &f, buf, len, pos)
}

/// Write host bytes to `fd` (sendfile).
fn write_host(ctx: &mut Ctx, fd: i32, data: &[u8], pos: Option<u64>) -> SysResult {
    let (f, ops) = file::open(ctx, fd)?;
    if !f.file.writable() {
        return Err(Errno::EBADF);
    }
    ops.write_bytes(ctx, &f, data, pos)
}

/// Largest chunk sendfile / copy_file_range move per call (a short count is
/// allowed; callers loop).
const COPY_CHUNK: u64 = 1 << 20;

/// The regular file behind `fd`, readable.
fn readable_file(ctx: &Ctx, fd: i32) -> Result<(OpenFile, crate::vfs::Ino), Errno> {
    let f = *ctx.proc.fds.get(fd)?;
    if !f.readable() {
        return Err(Errno::EBADF);
    }
    match f.kind {
        FileKind::Node(ino) if ctx.proc.vfs.stat(ino)?.kind == crate::vfs::FileType::File => Ok((f, ino)),
        FileKind::Node(_) => Err(Errno::EINVAL),
        _ => Err(Errno::EINVAL),
    }
}

fn read_off(ctx: &Ctx, ptr: u64) -> Result<Option<u64>, Errno> {
    if ptr == 0 {
        return Ok(None);
    }
    let v = ctx.read_i64(ptr)?;
    if v < 0 {
        return Err(Errno::EINVAL);
    }
    Ok(Some(v as u64))
}

/// sendfile: from a regular file (at `*offset`, or its file offset) to any fd.
pub fn sendfile(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (out_fd, in_fd, off_ptr, count) = (fd_arg(a[0]), fd_arg(a[1]), a[2], a[3]);
    let (f, ino) = readable_file(ctx, in_fd)?;
    let out = *ctx.proc.fds.get(out_fd)?;
    if !out.writable() {
        return Err(Errno::EBADF);
    }
    let explicit = read_off(ctx, off_ptr)?;
    let off = explicit.unwrap_or(f.offset);
    let mut buf = vec![0u8; count.min(COPY_CHUNK) as usize];
    let n = ctx.proc.vfs.read(ino, off, &mut buf)?;
    if n == 0 {
        return Ok(0);
    }
    let w = write_host(ctx, out_fd, &buf[..n], None)?;
    if ctx.is_blocking() || ctx.effect.is_some() {
        return Ok(0);
    }
    match explicit {
        Some(_) => ctx.write_u64(off_ptr, off + w)?,
        None => ctx.proc.fds.get_mut(in_fd)?.offset = off + w,
    }
    Ok(w)
}

/// copy_file_range between regular files (flags must be 0).
pub fn copy_file_range(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (in_fd, in_ptr, out_fd, out_ptr, len, flags) = (fd_arg(a[0]), a[1], fd_arg(a[2]), a[3], a[4], a[5]);
    if flags != 0 {
        return Err(Errno::EINVAL);
    }
    let (fin, ino_in) = readable_file(ctx, in_fd)?;
    let fout = *ctx.proc.fds.get(out_fd)?;
    let FileKind::Node(ino_out) = fout.kind else { return Err(Errno::EINVAL) };
    if !fout.writable() || fout.flags & libc::O_APPEND != 0 {
        return Err(Errno::EBADF);
    }
    if ctx.proc.vfs.stat(ino_out)?.kind != crate::vfs::FileType::File {
        return Err(Errno::EINVAL);
    }
    let (ein, eout) = (read_off(ctx, in_ptr)?, read_off(ctx, out_ptr)?);
    let (off_in, off_out) = (ein.unwrap_or(fin.offset), eout.unwrap_or(fout.offset));
    let n = len.min(COPY_CHUNK);
    if ino_in == ino_out && off_in < off_out.saturating_add(n) && off_out < off_in.saturating_add(n) {
        return Err(Errno::EINVAL);
    }
    let mut buf = vec![0u8; n as usize];
    let got = ctx.proc.vfs.read(ino_in, off_in, &mut buf)?;
    if got == 0 {
        return Ok(0);
    }
    let w = ctx.proc.vfs.write(ino_out, off_out, &buf[..got])? as u64;
    match ein {
        Some(_) => ctx.write_u64(in_ptr, off_in + w)?,
        None => ctx.proc.fds.get_mut(in_fd)?.offset = off_in + w,
    }
    match eout {
        Some(_) => ctx.write_u64(out_ptr, off_out + w)?,
        None => ctx.proc.fds.get_mut(out_fd)?.offset = off_out + w,
    }
    Ok(w)
}

/// close_range: close (or, with CLOSE_RANGE_CLOEXEC, mark close-on-exec) every
/// fd in [first, last]. CLOSE_RANGE_UNSHARE changes nothing (one fd table).
pub fn close_range(ctx: &mut Ctx, a: &Args) -> SysResult {
    const UNSHARE: u64 = 2;
    const CLOEXEC: u64 = 4;
    let (first, last, flags) = (a[0] as u32, a[1] as u32, a[2]);
    if flags & !(UNSHARE | CLOEXEC) != 0 || first > last {
        return Err(Errno::EINVAL);
    }
    let fds: Vec<i32> = ctx.proc.fds.fds().filter(|&fd| (first..=last).contains(&(fd as u32))).collect();
    for fd in fds {
        if flags & CLOEXEC != 0 {
            ctx.proc.fds.set_cloexec(fd, true)?;
        } else {
            let gone = ctx.proc.fds.close(fd)?;
            file::released(ctx, gone);
        }
    }
    Ok(0)
}

pub fn read(ctx: &mut Ctx, a: &Args) -> SysResult {
    read_into(ctx, fd_arg(a[0]), a[1], a[2], None)
}

pub fn write(ctx: &mut Ctx, a: &Args) -> SysResult {
    write_from(ctx, fd_arg(a[0]), a[1], a[2], None)
}

fn positional(off: u64) -> Result<Option<u64>, Errno> {
    if (off as i64) < 0 {
        return Err(Errno::EINVAL);
    }
    Ok(Some(off))
}

pub fn pread64(ctx: &mut Ctx, a: &Args) -> SysResult {
    read_into(ctx, fd_arg(a[0]), a[1], a[2], positional(a[3])?)
}

pub fn pwrite64(ctx: &mut Ctx, a: &Args) -> SysResult {
    write_from(ctx, fd_arg(a[0]), a[1], a[2], positional(a[3])?)
}

fn iovecs(ctx: &Ctx, iov: u64, count: u64) -> Result<Vec<(u64, u64)>, Errno> {
    if count > IOV_MAX {
        return Err(Errno::EINVAL);
    }
    let raw = ctx.bytes(iov, count * 16)?;
    let v: Vec<(u64, u64)> = raw
        .chunks_exact(16)
        .map(|c| {
            let base = u64::from_le_bytes(c[..8].try_into().unwrap_or_default());
            let len = u64::from_le_bytes(c[8..].try_into().unwrap_or_default());
            (base, len)
        })
        .collect();
    if v.iter().any(|&(_, l)| (l as i64) < 0) {
        return Err(Errno::EINVAL);
    }
    Ok(v)
}

fn vectored(ctx: &mut Ctx, fd: i32, iov: u64, count: u64, pos: Option<u64>, is_read: bool) -> SysResult {
    let mut total = 0u64;
    for (base, len) in iovecs(ctx, iov, count)? {
        if len == 0 {
            continue;
        }
        let at = pos.map(|p| p + total);
        let n = match if is_read { read_into(ctx, fd, base, len, at) } else { write_from(ctx, fd, base, len, at) } {
            Ok(n) => n,
            // Some bytes moved already: report them (EAGAIN / EPIPE come next time).
            Err(_) if total > 0 => {
                ctx.effect = None;
                return Ok(total);
            }
            Err(e) => return Err(e),
        };
        if ctx.effect.is_some() {
            if total > 0 && ctx.is_blocking() {
                // Earlier buffers moved: return now, with what this one moved before it waited.
                ctx.effect = None;
                total += std::mem::take(&mut ctx.proc.threads.current_mut().written);
            }
            return Ok(total);
        }
        total += n;
        if n < len {
            break;
        }
    }
    Ok(total)
}

pub fn readv(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored(ctx, fd_arg(a[0]), a[1], a[2], None, true)
}

pub fn writev(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored(ctx, fd_arg(a[0]), a[1], a[2], None, false)
}

pub fn preadv(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored(ctx, fd_arg(a[0]), a[1], a[2], positional(a[3])?, true)
}

pub fn pwritev(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored(ctx, fd_arg(a[0]), a[1], a[2], positional(a[3])?, false)
}

/// preadv2 / pwritev2: offset -1 is the file position (as readv/writev).
/// RWF_HIPRI, RWF_DSYNC and RWF_SYNC have nothing to do here (files live in
/// memory); RWF_NOWAIT, RWF_APPEND and unknown flags are EOPNOTSUPP, as a
/// file system without them answers.
fn vectored2(ctx: &mut Ctx, a: &Args, is_read: bool) -> SysResult {
    const NOTHING_TO_DO: u64 = 0x1 | 0x2 | 0x4;
    if a[5] & !NOTHING_TO_DO != 0 {
        return Err(Errno::EOPNOTSUPP);
    }
    let pos = match a[3] as i64 {
        -1 => None,
        off => positional(off as u64)?,
    };
    vectored(ctx, fd_arg(a[0]), a[1], a[2], pos, is_read)
}

pub fn preadv2(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored2(ctx, a, true)
}

pub fn pwritev2(ctx: &mut Ctx, a: &Args) -> SysResult {
    vectored2(ctx, a, false)
}

pub fn lseek(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, off, whence) = (fd_arg(a[0]), a[1] as i64, a[2] as i32);
    let f = *ctx.proc.fds.get(fd)?;
    let FileKind::Node(ino) = f.kind else { return Err(Errno::ESPIPE) };
    let st = ctx.proc.vfs.stat(ino)?;
    if matches!(st.kind, crate::vfs::FileType::CharDev) && st.rdev != 0 {
        // /dev/null, /dev/zero ...: seeking succeeds and stays at 0, as Linux.
        ctx.proc.fds.get_mut(fd)?.offset = 0;
        return Ok(0);
    }
    let size = st.size as i64;
    let new = match whence {
        libc::SEEK_SET => off,
        libc::SEEK_CUR => (f.offset as i64).checked_add(off).ok_or(Errno::EOVERFLOW)?,
        libc::SEEK_END => size.checked_add(off).ok_or(Errno::EOVERFLOW)?,
        libc::SEEK_DATA if off >= size => return Err(Errno::ENXIO),
        libc::SEEK_DATA => off,
        libc::SEEK_HOLE if off >= size => return Err(Errno::ENXIO),
        libc::SEEK_HOLE => size,
        _ => return Err(Errno::EINVAL),
    };
    if new < 0 {
        return Err(Errno::EINVAL);
    }
    ctx.proc.fds.get_mut(fd)?.offset = new as u64;
    Ok(new as u64)
}

/// Give back the VFS reference of a description that was closed for good.
/// Close `fds` of the current process (an exit, an execve's close-on-exec).
pub fn close_fds(ctx: &mut Ctx, fds: &[i32]) {
    for &fd in fds {
        if let Ok(gone) = ctx.proc.fds.close(fd) {
            file::released(ctx, gone);
        }
    }
}

pub fn close(ctx: &mut Ctx, a: &Args) -> SysResult {
    let gone = ctx.proc.fds.close(fd_arg(a[0]))?;
    file::released(ctx, gone);
    Ok(0)
}

pub fn dup(ctx: &mut Ctx, a: &Args) -> SysResult {
    Ok(ctx.proc.fds.dup(fd_arg(a[0]), 0, false)? as u64)
}

pub fn dup2(ctx: &mut Ctx, a: &Args) -> SysResult {
    let gone = ctx.proc.fds.dup_to(fd_arg(a[0]), fd_arg(a[1]), false)?;
    file::released(ctx, gone);
    Ok(a[1] as i32 as u64)
}

pub fn dup3(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[2] as i32;
    if flags & !libc::O_CLOEXEC != 0 || a[0] == a[1] {
        return Err(Errno::EINVAL);
    }
    let gone = ctx.proc.fds.dup_to(fd_arg(a[0]), fd_arg(a[1]), flags & libc::O_CLOEXEC != 0)?;
    file::released(ctx, gone);
    Ok(a[1] as i32 as u64)
}

pub fn fcntl(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, cmd, arg) = (fd_arg(a[0]), a[1] as i32, a[2]);
    match cmd {
        libc::F_DUPFD => Ok(ctx.proc.fds.dup(fd, arg as i32, false)? as u64),
        libc::F_DUPFD_CLOEXEC => Ok(ctx.proc.fds.dup(fd, arg as i32, true)? as u64),
        libc::F_GETFD => Ok(u64::from(ctx.proc.fds.cloexec(fd)?)),
        libc::F_SETFD => {
            ctx.proc.fds.set_cloexec(fd, arg & libc::FD_CLOEXEC as u64 != 0)?;
            Ok(0)
        }
        libc::F_GETFL => Ok(ctx.proc.fds.get(fd)?.flags as u64),
        // The argument is an unsigned int, as Linux's pipe_fcntl takes it.
        libc::F_GETPIPE_SZ | libc::F_SETPIPE_SZ => {
            let FileKind::Object(id) = ctx.proc.fds.get(fd)?.kind else { return Err(Errno::EBADF) };
            let objects = &mut ctx.proc.fds.objects;
            let size = if cmd == libc::F_GETPIPE_SZ {
                objects.pipe_size(id)
            } else {
                objects.set_pipe_size(id, arg as u32 as u64)
            };
            Ok(size?.into())
        }
        libc::F_SETFL => {
            let changeable = libc::O_APPEND | libc::O_NONBLOCK;
            let f = ctx.proc.fds.get_mut(fd)?;
            f.flags = (f.flags & !changeable) | (arg as i32 & changeable);
            Ok(0)
        }
        // dnotify: a request with no event bits (DN_MULTISHOT at most) removes
        // the fd's notifications, and there are none; asking for events is
        // EINVAL, as on a kernel built without dnotify. Directories only.
        libc::F_NOTIFY => {
            let FileKind::Node(ino) = ctx.proc.fds.get(fd)?.kind else { return Err(Errno::ENOTDIR) };
            if ctx.proc.vfs.file_type(ino)? != FileType::Dir {
                return Err(Errno::ENOTDIR);
            }
            if arg & !DN_MULTISHOT & 0xffff_ffff != 0 {
                return Err(Errno::EINVAL);
            }
            Ok(0)
        }
        // One process, no one to conflict with: locks always succeed.
        libc::F_GETLK | libc::F_SETLK | libc::F_SETLKW | libc::F_OFD_GETLK | libc::F_OFD_SETLK | libc::F_OFD_SETLKW => {
            ctx.proc.fds.get(fd)?;
            if cmd == libc::F_GETLK || cmd == libc::F_OFD_GETLK {
                // l_type = F_UNLCK
                ctx.write_bytes(arg, &(libc::F_UNLCK as i16).to_le_bytes())?;
            }
            Ok(0)
        }
        _ => Err(Errno::EINVAL),
    }
}

pub fn ioctl(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, req, arg) = (fd_arg(a[0]), a[1], a[2]);
    ctx.proc.fds.get(fd)?;
    match req {
        0x5451 /* FIOCLEX */ => ctx.proc.fds.set_cloexec(fd, true).map(|_| 0),
        0x5450 /* FIONCLEX */ => ctx.proc.fds.set_cloexec(fd, false).map(|_| 0),
        0x541B /* FIONREAD */ => {
            let (open, ops) = file::open(ctx, fd)?;
            let n = ops.pending(ctx, &open)?;
            ctx.write_i32(arg, n.min(i32::MAX as u64) as i32)?;
            Ok(0)
        }
        0x5421 /* FIONBIO */ => {
            let on = ctx.bytes(arg, 4)? != [0, 0, 0, 0];
            let f = ctx.proc.fds.get_mut(fd)?;
            f.flags = if on { f.flags | libc::O_NONBLOCK } else { f.flags & !libc::O_NONBLOCK };
            Ok(0)
        }
        0x5452 /* FIOASYNC */ => Err(Errno::EINVAL),
        0x8933 /* SIOCGIFINDEX */ | 0x8910 /* SIOCGIFNAME */ => interface_ioctl(ctx, fd, req, arg),
        // TCGETS, TIOCGWINSZ, ...: the kind's (a pseudo-terminal's), else ENOTTY.
        _ => {
            let (open, ops) = file::open(ctx, fd)?;
            ops.ioctl(ctx, &open, req, arg)
        }
    }
}

/// SIOCGIFINDEX / SIOCGIFNAME on any socket (glibc's if_nametoindex and
/// if_indextoname): the sandbox has one interface, `lo` (index 1); any other
/// name or index is ENODEV. `struct ifreq`: the name (IFNAMSIZ bytes), then the index.
fn interface_ioctl(ctx: &mut Ctx, fd: i32, req: u64, arg: u64) -> SysResult {
    use crate::net::netlink;
    const IFNAMSIZ: usize = 16;
    let socket = match ctx.proc.fds.get(fd)?.kind {
        crate::fd::FileKind::Socket(_) => true,
        crate::fd::FileKind::Object(id) => ctx.proc.fds.objects.socket(id).is_ok(),
        _ => false,
    };
    if !socket {
        return Err(Errno::ENOTTY);
    }
    let ifr = ctx.bytes(arg, IFNAMSIZ as u64 + 4)?.to_vec();
    if req == 0x8933 {
        let name = &ifr[..IFNAMSIZ];
        let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(IFNAMSIZ)];
        let index = netlink::index_of(name).ok_or(Errno::ENODEV)?;
        ctx.write_i32(arg + IFNAMSIZ as u64, index)?;
    } else {
        let index = i32::from_le_bytes([ifr[16], ifr[17], ifr[18], ifr[19]]);
        let name = netlink::name_of(index).ok_or(Errno::ENODEV)?;
        let mut out = [0u8; IFNAMSIZ];
        out[..name.len()].copy_from_slice(name);
        ctx.write_bytes(arg, &out)?;
    }
    Ok(0)
}

use crate::objects::ALWAYS;

/// poll/ppoll: report ready fds, or block until one is (`timeout` None = forever).
fn poll_fds(ctx: &mut Ctx, fds: u64, nfds: u64, timeout: Option<Duration>) -> SysResult {
    if nfds > crate::fd::MAX_FDS as u64 {
        return Err(Errno::EINVAL);
    }
    let raw = ctx.bytes(fds, nfds * 8)?.to_vec();
    let mut out = raw.clone();
    let mut count = 0;
    let mut waits = Vec::new();
    for (i, c) in raw.chunks_exact(8).enumerate() {
        let fd = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let events = u16::from_le_bytes([c[4], c[5]]) as u32;
        let mut rev = 0u32;
        if fd >= 0 {
            match ctx.proc.fds.get(fd) {
                Ok(_) => {
                    let ofd = ctx.proc.fds.ofd(fd)?;
                    rev = wait::ready(ctx.proc, ctx.kernel, ofd) & (events | ALWAYS);
                    waits.push((ofd, events | ALWAYS));
                }
                Err(_) => rev = libc::POLLNVAL as u32,
            }
        }
        out[i * 8 + 6..i * 8 + 8].copy_from_slice(&(rev as u16).to_le_bytes());
        count += u64::from(rev != 0);
    }
    if count == 0 && !ctx.timed_out && timeout != Some(Duration::ZERO) {
        return ctx.block(Block::new(WaitOn::Fds(waits)).timeout(timeout, Ok(0)));
    }
    ctx.write_bytes(fds, &out)?;
    Ok(count)
}

pub fn poll(ctx: &mut Ctx, a: &Args) -> SysResult {
    let ms = a[2] as i32;
    let timeout = (ms >= 0).then(|| Duration::from_millis(ms as u64));
    poll_fds(ctx, a[0], a[1], timeout)
}

pub fn ppoll(ctx: &mut Ctx, a: &Args) -> SysResult {
    let timeout = if a[2] != 0 { Some(super::sys_time::read_timespec(ctx, a[2])?) } else { None };
    poll_fds(ctx, a[0], a[1], timeout)
}

/// select/pselect6 over the three fd sets (read, write, except).
fn select_sets(ctx: &mut Ctx, nfds: u64, sets: [u64; 3], timeout: Option<Duration>) -> SysResult {
    if nfds > crate::fd::MAX_FDS as u64 {
        return Err(Errno::EINVAL);
    }
    let bytes = nfds.div_ceil(64) * 8;
    let want = [
        (libc::POLLIN | libc::POLLRDNORM | libc::POLLHUP | libc::POLLERR) as u32,
        (libc::POLLOUT | libc::POLLWRNORM | libc::POLLERR) as u32,
        libc::POLLPRI as u32,
    ];
    let mut count = 0;
    let mut out: [Option<Vec<u8>>; 3] = [None, None, None];
    let mut waits: Vec<(u64, u32)> = Vec::new();
    for (which, &ptr) in sets.iter().enumerate() {
        if ptr == 0 {
            continue;
        }
        let mut set = ctx.bytes(ptr, bytes)?.to_vec();
        for fd in 0..nfds as usize {
            if set[fd / 8] & (1 << (fd % 8)) == 0 {
                continue;
            }
            let ofd = ctx.proc.fds.ofd(fd as i32)?;
            if wait::ready(ctx.proc, ctx.kernel, ofd) & want[which] != 0 {
                count += 1;
            } else {
                set[fd / 8] &= !(1 << (fd % 8));
            }
            waits.push((ofd, want[which]));
        }
        out[which] = Some(set);
    }
    if count == 0 && !ctx.timed_out && timeout != Some(Duration::ZERO) {
        return ctx.block(Block::new(WaitOn::Fds(waits)).timeout(timeout, Ok(0)));
    }
    for (ptr, set) in sets.iter().zip(out) {
        if let Some(set) = set {
            ctx.write_bytes(*ptr, &set)?;
        }
    }
    Ok(count)
}

pub fn select(ctx: &mut Ctx, a: &Args) -> SysResult {
    let timeout = if a[4] != 0 {
        let secs = ctx.read_i64(a[4])?;
        let usecs = ctx.read_i64(a[4] + 8)?;
        if secs < 0 || !(0..1_000_000).contains(&usecs) {
            return Err(Errno::EINVAL);
        }
        Some(Duration::new(secs as u64, usecs as u32 * 1000))
    } else {
        None
    };
    select_sets(ctx, a[0], [a[1], a[2], a[3]], timeout)
}

pub fn pselect6(ctx: &mut Ctx, a: &Args) -> SysResult {
    let timeout = if a[4] != 0 { Some(super::sys_time::read_timespec(ctx, a[4])?) } else { None };
    select_sets(ctx, a[0], [a[1], a[2], a[3]], timeout)
}

pub fn getdents64(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, buf, cap) = (fd_arg(a[0]), a[1], a[2].min(MAX_RW));
    let f = *ctx.proc.fds.get(fd)?;
    let FileKind::Node(ino) = f.kind else { return Err(Errno::ENOTDIR) };
    ctx.user_range_mut(buf, cap)?;
    let entries = ctx.proc.vfs.readdir(ino)?;
    let mut out = Vec::new();
    let mut idx = f.offset as usize;
    while let Some(e) = entries.get(idx) {
        let reclen = (19 + e.name.len() + 1).next_multiple_of(8);
        if out.len() + reclen > cap as usize {
            break;
        }
        out.extend_from_slice(&e.ino.to_le_bytes());
        out.extend_from_slice(&((idx + 1) as i64).to_le_bytes());
        out.extend_from_slice(&(reclen as u16).to_le_bytes());
        out.push(e.kind.dirent_type());
        out.extend_from_slice(&e.name);
        out.resize(out.len() + reclen - 19 - e.name.len(), 0);
        idx += 1;
    }
    if out.is_empty() && idx < entries.len() {
        return Err(Errno::EINVAL);
    }
    ctx.write_bytes(buf, &out)?;
    ctx.proc.fds.get_mut(fd)?.offset = idx as u64;
    Ok(out.len() as u64)
}

pub fn ftruncate(ctx: &mut Ctx, a: &Args) -> SysResult {
    let f = *ctx.proc.fds.get(fd_arg(a[0]))?;
    if (a[1] as i64) < 0 {
        return Err(Errno::EINVAL);
    }
    match f.kind {
        FileKind::Node(ino) if f.writable() => ctx.proc.vfs.truncate(ino, a[1]).map(|_| 0),
        _ => Err(Errno::EINVAL),
    }
}

/// fcntl(F_NOTIFY): keep the notification after it fires (bit 31 of the argument).
const DN_MULTISHOT: u64 = 0x8000_0000;

const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;

/// fallocate, as on tmpfs: mode 0 grows the file to `offset + len` (zeros,
/// charged to the disk quota: ENOSPC past it), FALLOC_FL_KEEP_SIZE reserves
/// nothing (the overlay is memory: a later write allocates),
/// FALLOC_FL_PUNCH_HOLE|FALLOC_FL_KEEP_SIZE zeroes the range inside the file;
/// other modes EOPNOTSUPP. Checks in Linux's order (`vfs_fallocate`).
pub fn fallocate(ctx: &mut Ctx, a: &Args) -> SysResult {
    let f = *ctx.proc.fds.get(fd_arg(a[0]))?;
    let (mode, offset, len) = (a[1] as i32, a[2] as i64, a[3] as i64);
    if offset < 0 || len <= 0 {
        return Err(Errno::EINVAL);
    }
    if mode & !(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE) != 0 {
        return Err(Errno::EOPNOTSUPP);
    }
    if mode & FALLOC_FL_PUNCH_HOLE != 0 && mode & FALLOC_FL_KEEP_SIZE == 0 {
        return Err(Errno::EOPNOTSUPP);
    }
    if !f.writable() {
        return Err(Errno::EBADF);
    }
    let ino = match f.kind {
        FileKind::Node(ino) => ino,
        FileKind::Object(_) => return Err(Errno::ESPIPE),
        _ => return Err(Errno::ENODEV),
    };
    match ctx.proc.vfs.file_type(ino)? {
        FileType::File => {}
        FileType::Dir => return Err(Errno::EISDIR),
        FileType::Fifo => return Err(Errno::ESPIPE),
        _ => return Err(Errno::ENODEV),
    }
    let end = (offset as u64).checked_add(len as u64).filter(|&e| e <= i64::MAX as u64).ok_or(Errno::EFBIG)?;
    let size = ctx.proc.vfs.stat(ino)?.size;
    if mode & FALLOC_FL_PUNCH_HOLE != 0 {
        let zeros = [0u8; 64 << 10];
        let mut at = offset as u64;
        let stop = end.min(size);
        while at < stop {
            let n = (stop - at).min(zeros.len() as u64) as usize;
            ctx.proc.vfs.write(ino, at, &zeros[..n])?;
            at += n as u64;
        }
    } else if mode & FALLOC_FL_KEEP_SIZE == 0 && end > size {
        ctx.proc.vfs.truncate(ino, end)?;
    }
    Ok(0)
}

/// fsync, fdatasync, fadvise64, syncfs: nothing to do for an in-memory file system.
pub fn fsync(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.fds.get(fd_arg(a[0]))?;
    Ok(0)
}
