//! What several file kinds share: blocking on EAGAIN, SIGPIPE on EPIPE, the
//! readiness and metadata of fd objects.

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Ctx, Effect};

/// Turn an EAGAIN of a blocking description into a wait for `events` on it.
pub(crate) fn or_block(ctx: &mut Ctx, f: &OpenFile, ofd: u64, events: u32, r: SysResult) -> SysResult {
    match r {
        Err(Errno::EAGAIN) if f.flags & libc::O_NONBLOCK == 0 => ctx.block(Block::new(WaitOn::Fd { ofd, events })),
        Err(Errno::EAGAIN) => {
            ctx.proc.fds.objects.et_drained(ofd, events);
            Err(Errno::EAGAIN)
        }
        r => r,
    }
}

/// read(2) from an fd object: the bytes it gave go to the guest's `buf`; an
/// EAGAIN of a blocking description waits for it to become readable.
pub(crate) fn object_read(ctx: &mut Ctx, f: &Open, buf: u64, r: Result<Vec<u8>, Errno>) -> SysResult {
    let r = r.and_then(|data| {
        ctx.write_bytes(buf, &data)?;
        Ok(data.len() as u64)
    });
    or_block(ctx, &f.file, f.ofd, crate::kernel::block::READABLE, r)
}

/// EPIPE, and SIGPIPE's default action (the guest dies) unless it is ignored,
/// caught or blocked: then the call just fails with EPIPE.
pub(crate) fn epipe(ctx: &mut Ctx) -> Errno {
    let sig = libc::SIGPIPE as usize;
    let handler = u64::from_le_bytes(ctx.proc.signals.actions[sig][..8].try_into().unwrap_or_default());
    let blocked = ctx.proc.signals.mask & (1 << (sig - 1)) != 0;
    if handler == libc::SIG_DFL as u64 && !blocked {
        ctx.effect = Some(Effect::Signaled(libc::SIGPIPE));
    } else if handler != libc::SIG_IGN as u64 {
        // Caught (or blocked): the calling thread gets it on its way back.
        let cur = ctx.proc.threads.cur;
        ctx.proc.threads.send_thread(cur, crate::thread::SigInfo::user(libc::SIGPIPE, crate::thread::SI_KERNEL));
    }
    Errno::EPIPE
}

/// Readiness of an fd object (pipe, AF_UNIX socket, eventfd, timerfd, epoll).
pub(crate) fn object_poll(p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
    let FileKind::Object(id) = f.kind else { return libc::POLLNVAL as u32 };
    p.fds.objects.readiness(id, f.flags, depth, &|o, d| (p.ready)(p, o, d))
}

/// The object id behind a description of an fd object.
pub(crate) fn object_id(f: &OpenFile) -> Result<u64, Errno> {
    match f.kind {
        FileKind::Object(id) => Ok(id),
        _ => Err(Errno::EBADF),
    }
}

/// Guest bytes of a write to an fd object: nothing takes more than a socket
/// buffer at once, so at most that is copied.
pub(crate) fn object_data(ctx: &Ctx, buf: u64, len: u64) -> Result<Vec<u8>, Errno> {
    let len = len.min(crate::objects::SOCKET_CAPACITY as u64);
    Ok(ctx.mem.slice(buf, len).map_err(|_| Errno::EFAULT)?.to_vec())
}

/// write(2) to an fd object without an offset: its guest bytes (capped by
/// [`object_data`]) go to the kind's `write_bytes`.
pub(crate) fn object_write(
    ops: &dyn FileOps,
    ctx: &mut Ctx,
    f: &Open,
    buf: u64,
    len: u64,
    pos: Option<u64>,
) -> SysResult {
    if pos.is_some() {
        return Err(Errno::ESPIPE);
    }
    let data = object_data(ctx, buf, len)?;
    ops.write_bytes(ctx, f, &data, None)
}

/// write(2) to an fd object that takes no writes (timerfd, epoll): EINVAL once
/// the buffer is known to be readable, as Linux checks it first.
pub(crate) fn refused_write(ctx: &Ctx, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
    if pos.is_some() {
        return Err(Errno::ESPIPE);
    }
    object_data(ctx, buf, len)?;
    Err(Errno::EINVAL)
}
