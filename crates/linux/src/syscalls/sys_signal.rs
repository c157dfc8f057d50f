//! Signals: actions (shared by all threads), the calling thread's mask and
//! alternate stack, waiting for signals. Signals are queued in
//! `crate::thread::Threads`; the engine delivers them with the frames of
//! `crate::signal` and answers rt_sigreturn (`Effect::SigReturn`) from the
//! state kept per thread. Sending: kill (between the sandbox's processes),
//! tkill and tgkill (to a thread of the caller).

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx, Effect};
use crate::process::NSIG;
use crate::thread::{sigbit, SigInfo, SIGKILL, SIGSTOP, SI_TKILL, SI_USER, UNBLOCKABLE};

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

// ----- signals between processes ---------------------------------------------

/// kill(pid, sig): to this process itself, or queued for the engine to deliver
/// to the others (SIGKILL to itself ends it at once).
pub fn kill(ctx: &mut Ctx, a: &Args) -> SysResult {
    let sig = a[1];
    if sig > crate::thread::NSIG as u64 {
        return Err(Errno::EINVAL);
    }
    let targets = ctx.kernel.procs.kill_targets(ctx.proc.pid, a[0] as i32)?;
    if sig == 0 {
        return Ok(0);
    }
    let me = ctx.proc.pid;
    let info = SigInfo { signo: sig as i32, code: SI_USER, pid: me as i32, ..Default::default() };
    for t in targets {
        if t == me {
            continue;
        }
        if ctx.kernel.procs.get(t).is_some_and(|e| e.exit.is_none()) {
            ctx.kernel.procs.outbox.push((t, info));
        }
    }
    if ctx.kernel.procs.kill_targets(ctx.proc.pid, a[0] as i32)?.contains(&me) {
        if sig as i32 == SIGKILL {
            ctx.effect = Some(Effect::Signaled(SIGKILL));
        } else {
            ctx.proc.threads.send_process(info);
        }
    }
    Ok(0)
}

// ----- signals to itself -------------------------------------------------------

/// Queue `sig` for thread `target` (None: the process). SIGKILL ends the guest
/// at once; the rest is delivered by the engine on the target's way back to
/// user mode (a default action that terminates ends the guest then).
fn send(ctx: &mut Ctx, target: Option<usize>, sig: u64, code: i32) -> SysResult {
    if sig == 0 {
        return Ok(0);
    }
    if sig > NSIG as u64 {
        return Err(Errno::EINVAL);
    }
    let sig = sig as i32;
    if sig == SIGKILL {
        ctx.effect = Some(Effect::Signaled(SIGKILL));
        return Ok(0);
    }
    let info = SigInfo::user(sig, code);
    match target {
        Some(i) => ctx.proc.threads.send_thread(i, info),
        None => ctx.proc.threads.send_process(info),
    }
    Ok(0)
}

pub fn tgkill(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] as i32 <= 0 || a[1] as i32 <= 0 {
        return Err(Errno::EINVAL);
    }
    if a[0] != ctx.proc.pid as u64 {
        return Err(Errno::ESRCH);
    }
    let i = ctx.proc.threads.index_of(a[1] as u32).ok_or(Errno::ESRCH)?;
    send(ctx, Some(i), a[2], SI_TKILL)
}

pub fn tkill(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] as i32 <= 0 {
        return Err(Errno::EINVAL);
    }
    let i = ctx.proc.threads.index_of(a[0] as u32).ok_or(Errno::ESRCH)?;
    send(ctx, Some(i), a[1], SI_TKILL)
}
