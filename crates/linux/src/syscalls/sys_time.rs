//! Time: always the host's true clock. Sleeps are real but never outlast the
//! exec's deadline (the run loop then reports the timeout).

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx};

fn host_clock(id: libc::clockid_t) -> Result<(i64, i64), Errno> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    if unsafe { libc::clock_gettime(id, &mut ts) } != 0 {
        return Err(Errno::EINVAL);
    }
    Ok((ts.tv_sec, ts.tv_nsec))
}

pub fn realtime() -> (i64, i64) {
    host_clock(libc::CLOCK_REALTIME).unwrap_or((0, 0))
}

/// Linux's encoding of a CPU-time clock of a given process or thread (what
/// `clock_getcpuclockid` and `pthread_getcpuclockid` return): the bitwise
/// complement of the pid/tid shifted left by 3, bit 2 for a thread's clock,
/// bits 0-1 the kind (0 PROF, 1 VIRT, 2 SCHED; 3 is a clock fd, EINVAL here).
const CPUCLOCK_PERTHREAD: i32 = 4;
const CPUCLOCK_KIND_MASK: i32 = 3;
const CPUCLOCK_FD: i32 = 3;

/// Whether CPU-time clock `id` (negative) names this process or one of its
/// threads (pid/tid 0 is the caller's own): EINVAL for any other, as Linux
/// for a pid with no process (a clock of another process of the sandbox is
/// not readable here: each process runs on its own vCPU thread).
fn own_cpu_clock(ctx: &Ctx, id: i32) -> Result<(), Errno> {
    if id & CPUCLOCK_KIND_MASK == CPUCLOCK_FD {
        return Err(Errno::EINVAL);
    }
    let who = !(id >> 3);
    if who == 0 {
        return Ok(());
    }
    let who = u32::try_from(who).map_err(|_| Errno::EINVAL)?;
    let ours = if id & CPUCLOCK_PERTHREAD != 0 {
        ctx.proc.threads.index_of(who as crate::thread::Tid).is_some()
    } else {
        who == ctx.proc.pid
    };
    if ours {
        Ok(())
    } else {
        Err(Errno::EINVAL)
    }
}

/// The clocks a guest may read. CPU-time clocks (the named ones and those of
/// `own_cpu_clock`) report the vCPU thread's time.
fn guest_clock(ctx: &Ctx, id: u64) -> Result<libc::clockid_t, Errno> {
    match id as i32 {
        libc::CLOCK_REALTIME
        | libc::CLOCK_MONOTONIC
        | libc::CLOCK_MONOTONIC_RAW
        | libc::CLOCK_REALTIME_COARSE
        | libc::CLOCK_MONOTONIC_COARSE
        | libc::CLOCK_BOOTTIME => Ok(id as i32),
        libc::CLOCK_PROCESS_CPUTIME_ID | libc::CLOCK_THREAD_CPUTIME_ID => Ok(libc::CLOCK_THREAD_CPUTIME_ID),
        c if c < 0 => own_cpu_clock(ctx, c).map(|_| libc::CLOCK_THREAD_CPUTIME_ID),
        _ => Err(Errno::EINVAL),
    }
}

fn write_timespec(ctx: &mut Ctx, addr: u64, (s, ns): (i64, i64)) -> Result<(), Errno> {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&s.to_le_bytes());
    b[8..].copy_from_slice(&ns.to_le_bytes());
    ctx.write_bytes(addr, &b)
}

pub fn read_timespec(ctx: &Ctx, addr: u64) -> Result<Duration, Errno> {
    let s = ctx.read_i64(addr)?;
    let ns = ctx.read_i64(addr + 8)?;
    if s < 0 || !(0..1_000_000_000).contains(&ns) {
        return Err(Errno::EINVAL);
    }
    Ok(Duration::new(s as u64, ns as u32))
}

pub fn clock_gettime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let t = host_clock(guest_clock(ctx, a[0])?)?;
    write_timespec(ctx, a[1], t)?;
    Ok(0)
}

pub fn clock_getres(ctx: &mut Ctx, a: &Args) -> SysResult {
    guest_clock(ctx, a[0])?;
    if a[1] != 0 {
        write_timespec(ctx, a[1], (0, 1))?;
    }
    Ok(0)
}

/// clock_settime: the sandbox has no CAP_SYS_TIME (the clock is the host's),
/// so a valid time for a settable clock (CLOCK_REALTIME, the CPU-time clocks)
/// is EPERM, as for an unprivileged caller; the other clocks cannot be set
/// (EINVAL). Checks in Linux's order: clock, pointer, value, permission.
pub fn clock_settime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let id = a[0] as i32;
    let realtime = id == libc::CLOCK_REALTIME;
    match id {
        libc::CLOCK_REALTIME | libc::CLOCK_PROCESS_CPUTIME_ID | libc::CLOCK_THREAD_CPUTIME_ID => {}
        c if c < 0 => own_cpu_clock(ctx, c)?,
        _ => return Err(Errno::EINVAL),
    }
    let s = ctx.read_i64(a[1])?;
    let ns = ctx.read_i64(a[1].checked_add(8).ok_or(Errno::EFAULT)?)?;
    if realtime && (s < 0 || !(0..1_000_000_000).contains(&ns)) {
        return Err(Errno::EINVAL);
    }
    Err(Errno::EPERM)
}

pub fn gettimeofday(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] != 0 {
        let (s, ns) = realtime();
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&s.to_le_bytes());
        b[8..].copy_from_slice(&(ns / 1000).to_le_bytes());
        ctx.write_bytes(a[0], &b)?;
    }
    if a[1] != 0 {
        ctx.write_bytes(a[1], &[0u8; 8])?;
    }
    Ok(0)
}

pub fn time(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (s, _) = realtime();
    if a[0] != 0 {
        ctx.write_u64(a[0], s as u64)?;
    }
    Ok(s as u64)
}

/// A sleep blocks the thread (`Effect::Block` on time only): the engine runs
/// other threads meanwhile, and a signal ends it with EINTR.
fn sleep(ctx: &mut Ctx, d: Duration) -> SysResult {
    if ctx.timed_out {
        return Ok(0);
    }
    if ctx.proc.threads.current().wait.is_some() {
        return ctx.block(Block::new(WaitOn::Time));
    }
    if d.is_zero() {
        return Ok(0);
    }
    ctx.block(Block::new(WaitOn::Time).timeout(Some(d), Ok(0)))
}

pub fn nanosleep(ctx: &mut Ctx, a: &Args) -> SysResult {
    let d = read_timespec(ctx, a[0])?;
    sleep(ctx, d)
}

pub fn clock_nanosleep(ctx: &mut Ctx, a: &Args) -> SysResult {
    let clock = guest_clock(ctx, a[0])?;
    if clock == libc::CLOCK_THREAD_CPUTIME_ID {
        return Err(Errno::EINVAL);
    }
    let req = read_timespec(ctx, a[2])?;
    let d = if a[1] as i32 & libc::TIMER_ABSTIME != 0 {
        let (s, ns) = host_clock(clock)?;
        req.saturating_sub(Duration::new(s.max(0) as u64, ns as u32))
    } else {
        req
    };
    sleep(ctx, d)
}

/// CPU time of the calling host thread (the sandbox's whole guest runs on it).
pub(super) fn cpu_time() -> (i64, i64) {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (ts.tv_sec, ts.tv_nsec)
}
