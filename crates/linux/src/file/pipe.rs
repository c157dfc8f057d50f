//! Pipes and FIFOs (`ObjKind::Pipe`).

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{epipe, object_id, object_poll, object_read, object_write, or_block};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::WRITABLE;
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

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        object_write(self, ctx, f, buf, len, pos)
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
