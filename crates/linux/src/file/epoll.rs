//! An epoll instance as a file (`ObjKind::Epoll`): not readable or writable;
//! readable for poll when something in its interest set is ready.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{object_poll, refused_write};
use crate::file::counter::anon_stat;
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::Ctx;
use crate::vfs::Stat;

pub struct EpollFile;

impl FileOps for EpollFile {
    fn read(&self, _: &mut Ctx, _: &Open, _: u64, _: u64, pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EINVAL })
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
