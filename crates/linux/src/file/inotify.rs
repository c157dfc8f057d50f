//! inotify instances (`ObjKind::Inotify`): a read returns whole `struct
//! inotify_event` records from the instance's queue, which the file system
//! fills as it changes (`crate::vfs::Vfs::inotify_add_watch`); readable
//! while the queue holds something.

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::file::common::{object_id, or_block, refused_write};
use crate::file::counter::anon_stat;
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::READABLE;
use crate::kernel::Ctx;
use crate::objects::{ObjKind, Objects};
use crate::vfs::Stat;

pub struct InotifyFile;

/// The instance behind a description: its object id and journal number
/// (EINVAL if it is not an inotify instance, as inotify_add_watch says).
pub(crate) fn instance(objects: &Objects, f: &OpenFile) -> Result<(u64, u64), Errno> {
    let FileKind::Object(id) = f.kind else { return Err(Errno::EINVAL) };
    match objects.get(id).map(|o| &o.kind) {
        Ok(ObjKind::Inotify(i)) => Ok((id, i.epoch)),
        _ => Err(Errno::EINVAL),
    }
}

/// Drop the watches of instances whose last description was closed.
pub(crate) fn forget_closed(ctx: &mut Ctx) {
    let objects = &ctx.proc.fds.objects;
    ctx.proc.vfs.inotify_forget(|id| matches!(objects.get(id).map(|o| &o.kind), Ok(ObjKind::Inotify(_))));
}

impl FileOps for InotifyFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        object_id(&f.file)?;
        let (id, epoch) = instance(&ctx.proc.fds.objects, &f.file)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let r = ctx.proc.vfs.inotify_read(id, epoch, len, |n| ctx.user_range_mut(buf, n as u64)).and_then(|data| {
            ctx.write_bytes(buf, &data)?;
            Ok(data.len() as u64)
        });
        or_block(ctx, &f.file, f.ofd, READABLE, r)
    }

    fn write(&self, ctx: &mut Ctx, _: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        refused_write(ctx, buf, len, pos)
    }

    fn write_bytes(&self, _: &mut Ctx, _: &Open, _: &[u8], pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EINVAL })
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        let (id, epoch) = instance(&ctx.proc.fds.objects, &f.file)?;
        Ok(ctx.proc.vfs.inotify_pending(id, epoch) as u64)
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, _depth: u32) -> u32 {
        match instance(&p.fds.objects, f) {
            Ok((id, epoch)) if p.vfs.inotify_ready(id, epoch) => (libc::POLLIN | libc::POLLRDNORM) as u32,
            Ok(_) => 0,
            Err(_) => libc::POLLNVAL as u32,
        }
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        anon_stat(f)
    }
}
