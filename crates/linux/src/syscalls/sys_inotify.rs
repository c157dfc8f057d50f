//! inotify_init, inotify_init1, inotify_add_watch, inotify_rm_watch. The
//! instance is an fd object (`crate::file::inotify`); its watches and
//! events are the file system's (`crate::vfs::Vfs::inotify_add_watch`).

use crate::errno::{Errno, SysResult};
use crate::file::inotify::{forget_closed, instance};
use crate::kernel::{Args, Ctx};
use crate::objects::{Inotify, ObjKind, MAX_INOTIFY_INSTANCES};
use crate::vfs::inotify::{IN_ALL_EVENTS, IN_DONT_FOLLOW, IN_MASK_ADD, IN_MASK_CREATE, IN_ONLYDIR};

pub fn inotify_init1(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[0] as i32;
    if flags & !(libc::O_CLOEXEC | libc::O_NONBLOCK) != 0 {
        return Err(Errno::EINVAL);
    }
    let objects = &mut ctx.proc.fds.objects;
    let open = objects.map.values().filter(|o| matches!(o.kind, ObjKind::Inotify(_))).count();
    if open >= MAX_INOTIFY_INSTANCES {
        return Err(Errno::EMFILE);
    }
    let id = objects.add(ObjKind::Inotify(Inotify::default()));
    match ctx.proc.fds.open_object(id, libc::O_RDONLY | flags) {
        Ok(fd) => Ok(fd as u64),
        Err(e) => {
            ctx.proc.fds.objects.discard_unused(id);
            Err(e)
        }
    }
}

pub fn inotify_init(ctx: &mut Ctx, _: &Args) -> SysResult {
    inotify_init1(ctx, &[0; 6])
}

pub fn inotify_add_watch(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, mask) = (a[0] as i32, a[2] as u32);
    let (id, epoch) = instance(&ctx.proc.fds.objects, ctx.proc.fds.get(fd)?)?;
    if mask & IN_ALL_EVENTS == 0 || mask & (IN_MASK_ADD | IN_MASK_CREATE) == IN_MASK_ADD | IN_MASK_CREATE {
        return Err(Errno::EINVAL);
    }
    let path = ctx.path(a[1])?;
    let ino = ctx.proc.vfs.resolve(ctx.proc.cwd, &path, mask & IN_DONT_FOLLOW == 0)?;
    if mask & IN_ONLYDIR != 0 && !ctx.proc.vfs.is_dir(ino)? {
        return Err(Errno::ENOTDIR);
    }
    // Watches of instances closed in a way that did not say so yet go first.
    forget_closed(ctx);
    let (wd, now) = ctx.proc.vfs.inotify_add_watch(id, ino, mask)?;
    if now != epoch {
        if let Ok(o) = ctx.proc.fds.objects.get_mut(id) {
            o.kind = ObjKind::Inotify(Inotify { epoch: now });
        }
    }
    Ok(wd as u64)
}

pub fn inotify_rm_watch(ctx: &mut Ctx, a: &Args) -> SysResult {
    let fd = a[0] as i32;
    let (id, epoch) = instance(&ctx.proc.fds.objects, ctx.proc.fds.get(fd)?)?;
    ctx.proc.vfs.inotify_rm_watch(id, epoch, a[1] as i32)?;
    Ok(0)
}
