//! Signals: actions, mask and alternate stack are recorded so the guest sees
//! consistent answers. The only signal ever delivered is the host's SIGINT
//! (an interrupt); the engine builds its frame and answers rt_sigreturn
//! (`Effect::SigReturn`), from the state it kept host-side. Faults end the guest.

use super::{Args, Ctx, Effect};
use crate::errno::{Errno, SysResult};
use crate::process::NSIG;

const SIGKILL: u64 = 9;
const SIGSTOP: u64 = 19;

pub fn rt_sigaction(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (sig, act, old, size) = (a[0], a[1], a[2], a[3]);
    if size != 8 || sig == 0 || sig > NSIG as u64 {
        return Err(Errno::EINVAL);
    }
    if act != 0 && (sig == SIGKILL || sig == SIGSTOP) {
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
        let unblockable = (1 << (SIGKILL - 1)) | (1 << (SIGSTOP - 1));
        let m = &mut ctx.proc.signals.mask;
        *m = match how {
            libc::SIG_BLOCK => *m | s,
            libc::SIG_UNBLOCK => *m & !s,
            libc::SIG_SETMASK => s,
            _ => return Err(Errno::EINVAL),
        } & !unblockable;
    }
    Ok(0)
}

pub fn sigaltstack(ctx: &mut Ctx, a: &Args) -> SysResult {
    let new = if a[0] != 0 { Some(<[u8; 24]>::try_from(ctx.bytes(a[0], 24)?).map_err(|_| Errno::EFAULT)?) } else { None };
    if a[1] != 0 {
        let cur = ctx.proc.signals.altstack;
        ctx.write_bytes(a[1], &cur)?;
    }
    if let Some(n) = new {
        ctx.proc.signals.altstack = n;
    }
    Ok(0)
}

/// rt_sigpending: nothing is ever left pending (the interrupt's SIGINT is
/// delivered when it arrives; a signal the guest sends itself acts at once).
pub fn rt_sigpending(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[1] != 8 {
        return Err(Errno::EINVAL);
    }
    ctx.write_u64(a[0], 0)?;
    Ok(0)
}

/// The return of a signal handler: the engine restores the interrupted state.
pub fn rt_sigreturn(ctx: &mut Ctx, _a: &Args) -> SysResult {
    ctx.effect = Some(Effect::SigReturn);
    Ok(0)
}
