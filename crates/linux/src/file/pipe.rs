//! Pipes and FIFOs (`ObjKind::Pipe`).

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{epipe, object_data, object_id, object_poll, object_read, object_write, or_block};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{Block, WaitOn, WRITABLE};
use crate::kernel::Ctx;
use crate::objects::PIPE_MAX_SIZE;
use crate::vfs::Stat;

pub struct PipeFile;

impl FileOps for PipeFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let id = object_id(&f.file)?;
        let r = ctx.proc.fds.objects.pipe_read(id, len.min(PIPE_MAX_SIZE as u64) as usize);
        object_read(ctx, f, buf, r)
    }

    /// A blocking write of more than the pipe has room for writes what fits
    /// and waits for the rest, as Linux: it returns once every byte is in,
    /// or with the count so far when a signal ends the wait (the thread's
    /// `written` carries the count across re-runs of the blocked call).
    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if f.file.flags & libc::O_NONBLOCK != 0 {
            return object_write(self, ctx, f, buf, len, pos);
        }
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let done = ctx.proc.threads.current().written.min(len);
        let at = buf.checked_add(done).ok_or(Errno::EFAULT)?;
        let data = object_data(ctx, at, len - done)?;
        let r = ctx.proc.fds.objects.pipe_write(object_id(&f.file)?, &data);
        let total = match r {
            Ok(n) => done + n as u64,
            Err(Errno::EAGAIN) => done,
            // The reader went away part-way: what was written counts.
            Err(Errno::EPIPE) if done > 0 => len.min(done),
            Err(Errno::EPIPE) => return Err(epipe(ctx)),
            Err(e) => {
                ctx.proc.threads.current_mut().written = 0;
                return Err(e);
            }
        };
        if total < len && r != Err(Errno::EPIPE) {
            ctx.proc.threads.current_mut().written = total;
            return ctx.block(Block::new(WaitOn::Fd { ofd: f.ofd, events: WRITABLE }));
        }
        ctx.proc.threads.current_mut().written = 0;
        Ok(total)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let r = ctx.proc.fds.objects.pipe_write(object_id(&f.file)?, data).map(|n| n as u64);
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
        Ok(Stat::pipe(2_000_000_000 + object_id(&f.file)?))
    }
}
