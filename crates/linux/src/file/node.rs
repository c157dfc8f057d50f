//! A file, directory or device of the VFS (`FileKind::Node`).

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::Ctx;
use crate::process::Process;
use crate::vfs::{Ino, Stat};

pub struct NodeFile;

fn ino(f: &OpenFile) -> Result<Ino, Errno> {
    match f.kind {
        FileKind::Node(ino) => Ok(ino),
        _ => Err(Errno::EBADF),
    }
}

/// Write `data` at `pos`, at the end (O_APPEND) or at the file offset, which then moves.
fn write_at(proc: &mut Process, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
    let ino = ino(&f.file)?;
    let off = match pos {
        Some(p) => p,
        None if f.file.flags & libc::O_APPEND != 0 => proc.vfs.stat(ino)?.size,
        None => f.file.offset,
    };
    let n = proc.vfs.write(ino, off, data)?;
    if pos.is_none() {
        proc.fds.get_mut(f.fd)?.offset = off + n as u64;
    }
    Ok(n as u64)
}

impl FileOps for NodeFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        let ino = ino(&f.file)?;
        let off = pos.unwrap_or(f.file.offset);
        let n = {
            let dst = ctx.mem.slice_mut(buf, len).map_err(|_| Errno::EFAULT)?;
            ctx.proc.vfs.read(ino, off, dst)?
        };
        if pos.is_none() {
            ctx.proc.fds.get_mut(f.fd)?.offset = off + n as u64;
        }
        Ok(n as u64)
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        let data = ctx.mem.slice(buf, len).map_err(|_| Errno::EFAULT)?;
        write_at(ctx.proc, f, data, pos)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        write_at(ctx.proc, f, data, pos)
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        Ok(ctx.proc.vfs.stat(ino(&f.file)?)?.size.saturating_sub(f.file.offset))
    }

    fn poll(&self, _: &PollCtx, _: &OpenFile, _: u32) -> u32 {
        (libc::POLLIN | libc::POLLRDNORM | libc::POLLOUT | libc::POLLWRNORM) as u32
    }

    fn stat(&self, ctx: &Ctx, f: &Open) -> Result<Stat, Errno> {
        ctx.proc.vfs.stat(ino(&f.file)?)
    }

    fn release(&self, ctx: &mut Ctx, kind: FileKind) {
        if let FileKind::Node(ino) = kind {
            ctx.proc.vfs.release(ino);
        }
    }
}
