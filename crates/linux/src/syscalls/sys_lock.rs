//! File locks: flock(2) (the lock table is `crate::flock`).

use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::flock::{Granted, Holder};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx};

pub fn flock(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, op) = (a[0] as i32, a[1] as i32);
    let f = *ctx.proc.fds.get(fd)?;
    if f.flags & libc::O_PATH != 0 {
        return Err(Errno::EBADF);
    }
    let non_blocking = op & libc::LOCK_NB != 0;
    let exclusive = match op & !libc::LOCK_NB {
        libc::LOCK_SH => false,
        libc::LOCK_EX => true,
        libc::LOCK_UN => {
            if let FileKind::Node(ino) = f.kind {
                let me = Holder { pid: ctx.proc.pid, ofd: ctx.proc.fds.ofd(fd)? };
                ctx.kernel.flocks.unlock(ino, me);
            }
            return Ok(0);
        }
        _ => return Err(Errno::EINVAL),
    };
    // Pipes, sockets and the like are never shared by path: nobody else can contend.
    let FileKind::Node(ino) = f.kind else { return Ok(0) };
    let me = Holder { pid: ctx.proc.pid, ofd: ctx.proc.fds.ofd(fd)? };
    let procs = &ctx.kernel.procs;
    let alive = |pid: u32| procs.get(pid).is_some_and(|p| p.exit.is_none());
    match ctx.kernel.flocks.lock(ino, me, exclusive, alive) {
        Granted::Yes => Ok(0),
        Granted::TableFull => Err(Errno(libc::ENOLCK)),
        Granted::Conflict if non_blocking => Err(Errno::EAGAIN),
        Granted::Conflict => ctx.block(Block::new(WaitOn::Lock)),
    }
}
