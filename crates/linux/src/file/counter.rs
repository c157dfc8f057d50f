//! eventfd and timerfd (`ObjKind::EventFd`, `ObjKind::TimerFd`): a read
//! returns one 8-byte counter; an eventfd write adds to it.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{object_id, object_poll, object_write, or_block, refused_write};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{READABLE, WRITABLE};
use crate::kernel::Ctx;
use crate::vfs::{FileType, Stat};

pub struct EventFdFile;
pub struct TimerFdFile;

/// Read the 8-byte counter (`take` empties it), blocking while it is 0.
fn read_counter(
    ctx: &mut Ctx,
    f: &Open,
    buf: u64,
    len: u64,
    pos: Option<u64>,
    take: fn(&mut crate::objects::Objects, u64) -> Result<u64, Errno>,
) -> SysResult {
    if pos.is_some() {
        return Err(Errno::ESPIPE);
    }
    let id = object_id(&f.file)?;
    if len < 8 {
        return Err(Errno::EINVAL);
    }
    ctx.user_range(buf, 8)?;
    let r = take(&mut ctx.proc.fds.objects, id).and_then(|v| ctx.write_u64(buf, v).map(|_| 8));
    or_block(ctx, &f.file, f.ofd, READABLE, r)
}

/// eventfd, epoll and timerfd are anonymous inodes (no type bits on Linux; a
/// "file" is the closest we can say).
pub(crate) fn anon_stat(f: &Open) -> Result<Stat, Errno> {
    let mut st = Stat::pipe(2_000_000_000 + object_id(&f.file)?);
    st.kind = FileType::File;
    Ok(st)
}

impl FileOps for EventFdFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        read_counter(ctx, f, buf, len, pos, |o, id| o.eventfd_read(id))
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        object_write(self, ctx, f, buf, len, pos)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let id = object_id(&f.file)?;
        let v = data.get(..8).ok_or(Errno::EINVAL)?;
        let v = u64::from_le_bytes(v.try_into().map_err(|_| Errno::EINVAL)?);
        let r = ctx.proc.fds.objects.eventfd_write(id, v).map(|_| 8);
        or_block(ctx, &f.file, f.ofd, WRITABLE, r)
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
        object_poll(p, f, depth)
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        anon_stat(f)
    }
}

impl FileOps for TimerFdFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        read_counter(ctx, f, buf, len, pos, |o, id| o.timerfd_read(id))
    }

    fn write(&self, ctx: &mut Ctx, _: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        refused_write(ctx, buf, len, pos)
    }

    fn write_bytes(&self, _: &mut Ctx, _: &Open, _: &[u8], pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EINVAL })
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
        object_poll(p, f, depth)
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        anon_stat(f)
    }
}
