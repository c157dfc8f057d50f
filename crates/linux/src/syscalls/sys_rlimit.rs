//! Resource limits: getrlimit, setrlimit, prlimit64 (the VMM's limits; a
//! guest reads them, and may "lower" them without effect).

use crate::errno::{Errno, SysResult};
use crate::kernel::{Args, Ctx};

/// A resource's (soft, hard) limit, as the VMM enforces it.
pub(super) fn rlimit(resource: u32, ctx: &Ctx) -> Option<(u64, u64)> {
    const INF: u64 = u64::MAX;
    Some(match resource {
        libc::RLIMIT_STACK => (crate::layout::STACK_SIZE, crate::layout::STACK_SIZE),
        libc::RLIMIT_NOFILE => (crate::fd::MAX_FDS as u64, crate::fd::MAX_FDS as u64),
        libc::RLIMIT_AS | libc::RLIMIT_DATA => (ctx.proc.mm.limit(), ctx.proc.mm.limit()),
        libc::RLIMIT_NPROC => (crate::procs::MAX_PROCS as u64, crate::procs::MAX_PROCS as u64),
        libc::RLIMIT_CORE => (0, 0),
        r if r < 16 => (INF, INF), // RLIM_NLIMITS
        _ => return None,
    })
}

pub fn getrlimit(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (cur, max) = rlimit(a[0] as u32, ctx).ok_or(Errno::EINVAL)?;
    ctx.write_u64(a[1], cur)?;
    ctx.write_u64(a[1] + 8, max)?;
    Ok(0)
}

/// Limits are the VMM's to set; a guest may "lower" them but nothing changes.
pub fn setrlimit(ctx: &mut Ctx, a: &Args) -> SysResult {
    rlimit(a[0] as u32, ctx).ok_or(Errno::EINVAL)?;
    Ok(0)
}

pub fn prlimit64(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] != 0 && a[0] != ctx.proc.pid as u64 {
        return Err(Errno::ESRCH);
    }
    let (cur, max) = rlimit(a[1] as u32, ctx).ok_or(Errno::EINVAL)?;
    if a[3] != 0 {
        ctx.write_u64(a[3], cur)?;
        ctx.write_u64(a[3] + 8, max)?;
    }
    Ok(0)
}
