//! Signals: actions (shared by all threads), the calling thread's mask and
//! alternate stack, waiting for signals. Signals are queued in
//! `crate::thread::Threads`; the engine delivers them with the frames of
//! `crate::signal` and answers rt_sigreturn (`Effect::SigReturn`) from the
//! state kept per thread.

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx, Effect};
use crate::process::NSIG;
use crate::thread::{sigbit, SIGKILL, SIGSTOP, UNBLOCKABLE};

pub fn rt_sigaction(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (sig, act, old, size) = (a[0], a[1], a[2], a[3]);
    if size != 8 || sig == 0 || sig > NSIG as u64 {
        return Err(Errno::EINVAL);
    }
    if act != 0 && (sig == SIGKILL as u64 || sig == SIGSTOP as u64) {
        return Err(Errno::EINVAL);
    }
    let new = if act != 0 { Some(<[u8; 32]>::try_from(ctx.bytes(act, 32)?).map_err(|_| Errno::EFAULT)?) } else { None };
    if old != 0 {
        let cur = ctx.proc.signals.actions[sig as usize];
        ctx.write_bytes(old, &cur)?;
    }
    if let Some(n) = new {
        std::sync::Arc::make_mut(&mut ctx.proc.signals.actions)[sig as usize] = n;
    }
    Ok(0)
}

pub fn rt_sigprocmask(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (how, set, old, size) = (a[0] as i32, a[1], a[2], a[3]);
    if size != 8 {
        return Err(Errno::EINVAL);
    }
    let new = if set != 0 { Some(ctx.read_u64(set)?) } else { None };
    if old != 0 {
        let m = ctx.proc.signals.mask;
        ctx.write_u64(old, m)?;
    }
    if let Some(s) = new {
        let m = &mut ctx.proc.signals.mask;
        *m = match how {
            libc::SIG_BLOCK => *m | s,
            libc::SIG_UNBLOCK => *m & !s,
            libc::SIG_SETMASK => s,
            _ => return Err(Errno::EINVAL),
        } & !UNBLOCKABLE;
    }
    Ok(0)
}

pub fn sigaltstack(ctx: &mut Ctx, a: &Args) -> SysResult {
    let new =
        if a[0] != 0 { Some(<[u8; 24]>::try_from(ctx.bytes(a[0], 24)?).map_err(|_| Errno::EFAULT)?) } else { None };
    if a[1] != 0 {
        let cur = ctx.proc.signals.altstack;
        ctx.write_bytes(a[1], &cur)?;
    }
    if let Some(n) = new {
        ctx.proc.signals.altstack = n;
    }
    Ok(0)
}

/// The return of a signal handler: the engine restores the interrupted state.
pub fn rt_sigreturn(ctx: &mut Ctx, _a: &Args) -> SysResult {
    ctx.effect = Some(Effect::SigReturn);
    Ok(0)
}

/// Signals pending for the calling thread (its own and the process') that it blocks.
pub fn rt_sigpending(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[1] != 8 {
        return Err(Errno::EINVAL);
    }
    let t = &ctx.proc.threads;
    let set = t.current().pending_set() | t.pending.iter().fold(0, |m, s| m | sigbit(s.signo));
    let v = set & ctx.proc.signals.mask;
    ctx.write_u64(a[0], v)?;
    Ok(0)
}

/// Is this call a re-run of one that blocked?
fn rerun(ctx: &Ctx) -> bool {
    ctx.proc.threads.current().wait.is_some()
}

/// rt_sigtimedwait(set, info, timeout, size): take a pending signal of `set`,
/// or wait for one. While it waits the set is unblocked for this thread (as
/// Linux does), so a process-directed signal of the set comes here.
pub fn rt_sigtimedwait(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[3] != 8 {
        return Err(Errno::EINVAL);
    }
    let set = ctx.read_u64(a[0])? & !UNBLOCKABLE;
    let cur = ctx.proc.threads.cur;
    if let Some(info) = ctx.proc.threads.take(cur, set) {
        if a[1] != 0 {
            ctx.write_bytes(a[1], &info.to_bytes())?;
        }
        // The thread's own mask comes back (it was narrowed while waiting).
        if let Some(m) = ctx.proc.threads.current_mut().restore_mask.take() {
            ctx.proc.signals.mask = m;
        }
        return Ok(info.signo as u64);
    }
    if rerun(ctx) {
        if ctx.timed_out {
            if let Some(m) = ctx.proc.threads.current_mut().restore_mask.take() {
                ctx.proc.signals.mask = m;
            }
            return Err(Errno::EAGAIN);
        }
        return ctx.block(Block::new(WaitOn::Signal { mask: set }));
    }
    let timeout = if a[2] != 0 { Some(super::sys_time::read_timespec(ctx, a[2])?) } else { None };
    if timeout == Some(Duration::ZERO) {
        return Err(Errno::EAGAIN);
    }
    let old = ctx.proc.signals.mask;
    ctx.proc.threads.current_mut().restore_mask = Some(old);
    ctx.proc.signals.mask = old & !set;
    ctx.block(Block::new(WaitOn::Signal { mask: set }).timeout(timeout, Err(Errno::EAGAIN)))
}

/// rt_sigsuspend(mask, size): wait with `mask` until a handler runs (EINTR);
/// the handler's return restores the old mask.
pub fn rt_sigsuspend(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[1] != 8 {
        return Err(Errno::EINVAL);
    }
    if !rerun(ctx) && ctx.proc.threads.current().restore_mask.is_none() {
        let new = ctx.read_u64(a[0])? & !UNBLOCKABLE;
        let old = ctx.proc.signals.mask;
        ctx.proc.threads.current_mut().restore_mask = Some(old);
        ctx.proc.signals.mask = new;
    }
    let mask = !ctx.proc.signals.mask;
    ctx.block(Block::new(WaitOn::Signal { mask }))
}

/// pause(): wait until a handler runs (EINTR).
pub fn pause(ctx: &mut Ctx, _: &Args) -> SysResult {
    let mask = !ctx.proc.signals.mask;
    ctx.block(Block::new(WaitOn::Signal { mask }))
}
