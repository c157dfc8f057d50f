//! Timers that send signals: alarm, setitimer/getitimer (ITIMER_REAL on the
//! run clock; ITIMER_VIRTUAL and ITIMER_PROF on the CPU time the engine
//! charges to the process, see `Threads::charge_cpu`), and
//! POSIX timers (timer_create/settime/gettime/getoverrun/delete). They run on
//! the session's run clock (`crate::thread::RunClock`): a paused session's
//! timers are paused with it. The engine fires them (`Threads::fire_timers`).

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::kernel::{Args, Ctx};
use crate::thread::{Timer, ITIMER_PROF_ID, ITIMER_VIRTUAL_ID, MAX_TIMERS, NSIG, SIGALRM, SIGPROF, SIGVTALRM};

const ITIMER_REAL: u64 = 0;
const ITIMER_VIRTUAL: u64 = 1;
const ITIMER_PROF: u64 = 2;
const SIGEV_SIGNAL: i32 = 0;
const SIGEV_NONE: i32 = 1;
const SIGEV_THREAD: i32 = 2;
const SIGEV_THREAD_ID: i32 = 4;

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// What is left of a timer, and its interval (nanoseconds).
fn remaining(ctx: &Ctx, t: Option<&Timer>) -> (u64, u64) {
    let now = ctx.proc.threads.clock.now();
    match t {
        Some(t) => (t.expiry.map_or(0, |e| e.saturating_sub(now).max(1)), t.interval_ns),
        None => (0, 0),
    }
}

fn read_pair(ctx: &Ctx, addr: u64, sub_ns: u64) -> Result<(u64, u64), Errno> {
    // (interval, value), each {seconds, sub-second in units of sub_ns}.
    let mut out = [0u64; 2];
    for (i, o) in out.iter_mut().enumerate() {
        let s = ctx.read_i64(addr + 16 * i as u64)?;
        let f = ctx.read_i64(addr + 16 * i as u64 + 8)?;
        if s < 0 || f < 0 || f as u64 >= 1_000_000_000 / sub_ns {
            return Err(Errno::EINVAL);
        }
        *o = (s as u64).saturating_mul(1_000_000_000).saturating_add(f as u64 * sub_ns);
    }
    Ok((out[0], out[1]))
}

fn write_pair(ctx: &mut Ctx, addr: u64, (value, interval): (u64, u64), sub_ns: u64) -> Result<(), Errno> {
    let mut b = [0u8; 32];
    for (i, v) in [interval, value].iter().enumerate() {
        b[i * 16..i * 16 + 8].copy_from_slice(&((v / 1_000_000_000) as i64).to_le_bytes());
        b[i * 16 + 8..i * 16 + 16].copy_from_slice(&(((v % 1_000_000_000) / sub_ns) as i64).to_le_bytes());
    }
    ctx.write_bytes(addr, &b)
}

fn arm(ctx: &Ctx, value: u64) -> Option<u64> {
    (value > 0).then(|| ctx.proc.threads.clock.now().saturating_add(value))
}

fn itimer(signo: i32) -> Timer {
    Timer {
        id: -1,
        clock: libc::CLOCK_REALTIME,
        signo,
        tid: None,
        silent: false,
        value: 0,
        expiry: None,
        interval_ns: 0,
        overrun: 0,
    }
}

/// alarm(seconds): the seconds left of the previous alarm (rounded as Linux).
pub fn alarm(ctx: &mut Ctx, a: &Args) -> SysResult {
    let secs = a[0] as u32 as u64;
    let (left, _) = remaining(ctx, ctx.proc.threads.itimer_real.as_ref());
    let mut t = itimer(SIGALRM);
    t.expiry = arm(ctx, secs.saturating_mul(1_000_000_000));
    ctx.proc.threads.itimer_real = t.expiry.is_some().then_some(t);
    // Linux rounds to the nearest second, and never reports 0 for a pending alarm.
    Ok(if left == 0 { 0 } else { ((left + 500_000_000) / 1_000_000_000).max(1) })
}

/// The timer id and signal of a CPU-time interval timer.
fn cpu_itimer(which: u64) -> Result<(i32, i32), Errno> {
    match which {
        ITIMER_VIRTUAL => Ok((ITIMER_VIRTUAL_ID, SIGVTALRM)),
        ITIMER_PROF => Ok((ITIMER_PROF_ID, SIGPROF)),
        _ => Err(Errno::EINVAL),
    }
}

/// What is left of a CPU-time interval timer, and its interval (nanoseconds).
fn cpu_remaining(ctx: &Ctx, id: i32) -> (u64, u64) {
    ctx.proc.threads.timers.iter().find(|t| t.id == id).map_or((0, 0), |t| (t.expiry.unwrap_or(0), t.interval_ns))
}

pub fn getitimer(ctx: &mut Ctx, a: &Args) -> SysResult {
    let cur = if a[0] == ITIMER_REAL {
        remaining(ctx, ctx.proc.threads.itimer_real.as_ref())
    } else {
        cpu_remaining(ctx, cpu_itimer(a[0])?.0)
    };
    write_pair(ctx, a[1], cur, 1000)?;
    Ok(0)
}

pub fn setitimer(ctx: &mut Ctx, a: &Args) -> SysResult {
    let cpu = if a[0] == ITIMER_REAL { None } else { Some(cpu_itimer(a[0])?) };
    let new = if a[1] != 0 { Some(read_pair(ctx, a[1], 1000)?) } else { None };
    let old = match cpu {
        None => remaining(ctx, ctx.proc.threads.itimer_real.as_ref()),
        Some((id, _)) => cpu_remaining(ctx, id),
    };
    if a[2] != 0 {
        write_pair(ctx, a[2], old, 1000)?;
    }
    let Some((interval, value)) = new else { return Ok(0) };
    match cpu {
        None => {
            let mut t = itimer(SIGALRM);
            t.expiry = arm(ctx, value);
            t.interval_ns = interval;
            ctx.proc.threads.itimer_real = t.expiry.is_some().then_some(t);
        }
        Some((id, signo)) => {
            let timers = &mut ctx.proc.threads.timers;
            timers.retain(|t| t.id != id);
            if value > 0 {
                let mut t = itimer(signo);
                t.id = id;
                t.clock = libc::CLOCK_PROCESS_CPUTIME_ID;
                t.expiry = Some(value);
                t.interval_ns = interval;
                timers.push(t);
            }
        }
    }
    Ok(0)
}

fn timer_index(ctx: &Ctx, id: u64) -> Result<usize, Errno> {
    ctx.proc.threads.timers.iter().position(|t| t.id as u64 == id && id <= i32::MAX as u64).ok_or(Errno::EINVAL)
}

/// timer_create(clock, sigevent *, timer_t *).
pub fn timer_create(ctx: &mut Ctx, a: &Args) -> SysResult {
    let clock = a[0] as i32;
    match clock {
        libc::CLOCK_REALTIME
        | libc::CLOCK_MONOTONIC
        | libc::CLOCK_BOOTTIME
        | libc::CLOCK_REALTIME_ALARM
        | libc::CLOCK_BOOTTIME_ALARM => {}
        libc::CLOCK_PROCESS_CPUTIME_ID | libc::CLOCK_THREAD_CPUTIME_ID => return Err(Errno::EINVAL),
        _ => return Err(Errno::EINVAL),
    }
    if ctx.proc.threads.posix_timers() >= MAX_TIMERS {
        return Err(Errno::EAGAIN);
    }
    let id =
        (0..MAX_TIMERS as i32).find(|i| !ctx.proc.threads.timers.iter().any(|t| t.id == *i)).ok_or(Errno::EAGAIN)?;
    let mut t = Timer {
        id,
        clock,
        signo: SIGALRM,
        tid: None,
        silent: false,
        value: id as u64,
        expiry: None,
        interval_ns: 0,
        overrun: 0,
    };
    if a[1] != 0 {
        let value = ctx.read_u64(a[1])?;
        let b = ctx.bytes(a[1] + 8, 12)?;
        let signo = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let notify = i32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let tid = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        t.value = value;
        match notify {
            SIGEV_NONE => t.silent = true,
            SIGEV_SIGNAL | SIGEV_THREAD_ID => {
                if !(1..=NSIG).contains(&signo) {
                    return Err(Errno::EINVAL);
                }
                t.signo = signo;
                if notify == SIGEV_THREAD_ID {
                    ctx.proc.threads.index_of(tid).ok_or(Errno::EINVAL)?;
                    t.tid = Some(tid);
                }
            }
            // glibc implements SIGEV_THREAD itself with SIGEV_THREAD_ID.
            SIGEV_THREAD => return Err(Errno::EINVAL),
            _ => return Err(Errno::EINVAL),
        }
    }
    ctx.write_bytes(a[2], &id.to_le_bytes())?;
    ctx.proc.threads.timers.push(t);
    Ok(0)
}

/// timer_settime(id, flags, new, old).
pub fn timer_settime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let i = timer_index(ctx, a[0])?;
    if a[2] == 0 {
        return Err(Errno::EINVAL);
    }
    let (interval, mut value) = read_pair(ctx, a[2], 1)?;
    if a[1] as i32 & libc::TIMER_ABSTIME != 0 && value > 0 {
        let clock = ctx.proc.threads.timers[i].clock;
        let host = match clock {
            libc::CLOCK_REALTIME | libc::CLOCK_REALTIME_ALARM => libc::CLOCK_REALTIME,
            _ => libc::CLOCK_MONOTONIC,
        };
        // Already past: fire at once.
        value = ns(super::sys_thread::until_abs(host, Duration::from_nanos(value))).max(1);
    }
    let old = remaining(ctx, ctx.proc.threads.timers.get(i));
    if a[3] != 0 {
        write_pair(ctx, a[3], old, 1)?;
    }
    let expiry = arm(ctx, value);
    let t = &mut ctx.proc.threads.timers[i];
    t.expiry = expiry;
    t.interval_ns = interval;
    t.overrun = 0;
    Ok(0)
}

pub fn timer_gettime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let i = timer_index(ctx, a[0])?;
    let cur = remaining(ctx, ctx.proc.threads.timers.get(i));
    write_pair(ctx, a[1], cur, 1)?;
    Ok(0)
}

pub fn timer_getoverrun(ctx: &mut Ctx, a: &Args) -> SysResult {
    let i = timer_index(ctx, a[0])?;
    Ok(ctx.proc.threads.timers[i].overrun.max(0) as u64)
}

pub fn timer_delete(ctx: &mut Ctx, a: &Args) -> SysResult {
    let i = timer_index(ctx, a[0])?;
    ctx.proc.threads.timers.remove(i);
    Ok(0)
}
