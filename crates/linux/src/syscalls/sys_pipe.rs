//! Pipes, eventfds, timerfds and epoll: making and controlling the fd objects
//! of `crate::objects` (their reads and writes are their `crate::file` kinds).

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::kernel::block::{Block, WaitOn, READABLE};
use crate::kernel::{Args, Ctx};
use crate::objects::{clock_ns, EventFd, ObjKind, TimerFd, Watch, ALWAYS};
use crate::wait;

// ----- pipe ------------------------------------------------------------------------

fn pipe_common(ctx: &mut Ctx, fds_ptr: u64, flags: i32) -> SysResult {
    if flags & !(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_DIRECT) != 0 {
        return Err(Errno::EINVAL);
    }
    ctx.user_range(fds_ptr, 8)?;
    let keep = flags & (libc::O_CLOEXEC | libc::O_NONBLOCK);
    let id = ctx.proc.fds.objects.new_pipe(None);
    let (r, w) = ctx.proc.fds.open_two((id, libc::O_RDONLY | keep), (id, libc::O_WRONLY | keep))?;
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&r.to_le_bytes());
    b[4..].copy_from_slice(&w.to_le_bytes());
    ctx.write_bytes(fds_ptr, &b)?;
    Ok(0)
}

pub fn pipe(ctx: &mut Ctx, a: &Args) -> SysResult {
    pipe_common(ctx, a[0], 0)
}

pub fn pipe2(ctx: &mut Ctx, a: &Args) -> SysResult {
    pipe_common(ctx, a[0], a[1] as i32)
}

// ----- eventfd ---------------------------------------------------------------------

const EFD_SEMAPHORE: i32 = 1;

pub fn eventfd2(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (initval, flags) = (a[0] as u32, a[1] as i32);
    if flags & !(libc::O_CLOEXEC | libc::O_NONBLOCK | EFD_SEMAPHORE) != 0 {
        return Err(Errno::EINVAL);
    }
    let id = ctx
        .proc
        .fds
        .objects
        .add(ObjKind::EventFd(EventFd { count: initval.into(), semaphore: flags & EFD_SEMAPHORE != 0 }));
    let fd = ctx.proc.fds.open_object(id, libc::O_RDWR | (flags & (libc::O_CLOEXEC | libc::O_NONBLOCK)))?;
    Ok(fd as u64)
}

pub fn eventfd(ctx: &mut Ctx, a: &Args) -> SysResult {
    eventfd2(ctx, &[a[0], 0, 0, 0, 0, 0])
}

// ----- timerfd ---------------------------------------------------------------------

const TFD_TIMER_ABSTIME: i32 = 1;
const TFD_TIMER_CANCEL_ON_SET: i32 = 2;

fn timer_clock(c: u64) -> Result<i32, Errno> {
    match c as i32 {
        libc::CLOCK_REALTIME | libc::CLOCK_MONOTONIC | libc::CLOCK_BOOTTIME => Ok(c as i32),
        libc::CLOCK_REALTIME_ALARM | libc::CLOCK_BOOTTIME_ALARM => Err(Errno::EPERM),
        _ => Err(Errno::EINVAL),
    }
}

pub fn timerfd_create(ctx: &mut Ctx, a: &Args) -> SysResult {
    let clock = timer_clock(a[0])?;
    let flags = a[1] as i32;
    if flags & !(libc::O_CLOEXEC | libc::O_NONBLOCK) != 0 {
        return Err(Errno::EINVAL);
    }
    let id = ctx.proc.fds.objects.add(ObjKind::TimerFd(TimerFd { clock, next_ns: 0, interval_ns: 0, ticks: 0 }));
    let fd = ctx.proc.fds.open_object(id, libc::O_RDWR | flags)?;
    Ok(fd as u64)
}

fn timer_of(ctx: &Ctx, fd: i32) -> Result<u64, Errno> {
    match ctx.proc.fds.get(fd)?.kind {
        FileKind::Object(id) if matches!(ctx.proc.fds.objects.get(id)?.kind, ObjKind::TimerFd(_)) => Ok(id),
        _ => Err(Errno::EINVAL),
    }
}

fn timespec_ns(ctx: &Ctx, addr: u64) -> Result<u64, Errno> {
    let d = super::sys_time::read_timespec(ctx, addr)?;
    u64::try_from(d.as_nanos()).map_err(|_| Errno::EINVAL)
}

fn put_itimerspec(ctx: &mut Ctx, addr: u64, t: &TimerFd) -> Result<(), Errno> {
    let now = clock_ns(t.clock);
    let value = if t.next_ns == 0 { 0 } else { t.next_ns.saturating_sub(now).max(1) };
    let mut b = [0u8; 32];
    for (i, ns) in [t.interval_ns, value].into_iter().enumerate() {
        b[i * 16..i * 16 + 8].copy_from_slice(&((ns / 1_000_000_000) as i64).to_le_bytes());
        b[i * 16 + 8..i * 16 + 16].copy_from_slice(&((ns % 1_000_000_000) as i64).to_le_bytes());
    }
    ctx.write_bytes(addr, &b)
}

pub fn timerfd_settime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (fd, flags, new, old) = (a[0] as i32, a[1] as i32, a[2], a[3]);
    if flags & !(TFD_TIMER_ABSTIME | TFD_TIMER_CANCEL_ON_SET) != 0 {
        return Err(Errno::EINVAL);
    }
    let id = timer_of(ctx, fd)?;
    let interval = timespec_ns(ctx, new)?;
    let value = timespec_ns(ctx, new + 16)?;
    let cur = *ctx.proc.fds.objects.timerfd_mut(id)?;
    if old != 0 {
        put_itimerspec(ctx, old, &cur)?;
    }
    let now = clock_ns(cur.clock);
    let next = match (value, flags & TFD_TIMER_ABSTIME != 0) {
        (0, _) => 0,
        (v, true) => v.max(1),
        (v, false) => now.saturating_add(v),
    };
    let t = ctx.proc.fds.objects.timerfd_mut(id)?;
    *t = TimerFd { clock: cur.clock, next_ns: next, interval_ns: if next == 0 { 0 } else { interval }, ticks: 0 };
    Ok(0)
}

pub fn timerfd_gettime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let id = timer_of(ctx, a[0] as i32)?;
    let t = ctx.proc.fds.objects.timerfd_mut(id)?;
    t.advance(clock_ns(t.clock));
    let t = *t;
    put_itimerspec(ctx, a[1], &t)?;
    Ok(0)
}

// ----- epoll -----------------------------------------------------------------------

/// Largest maxevents (Linux: INT_MAX / sizeof(struct epoll_event)); we also cap the
/// reply at the number of fds.
const EP_MAX_EVENTS: i32 = i32::MAX / 12;
const EPOLLEXCLUSIVE: u32 = 1 << 28;
const EPOLLWAKEUP: u32 = 1 << 29;
use crate::objects::{EPOLLET, EPOLLONESHOT};

pub fn epoll_create1(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[0] as i32;
    if flags & !libc::O_CLOEXEC != 0 {
        return Err(Errno::EINVAL);
    }
    let id = ctx.proc.fds.objects.add(ObjKind::Epoll(Default::default()));
    Ok(ctx.proc.fds.open_object(id, libc::O_RDWR | flags)? as u64)
}

pub fn epoll_create(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[0] as i32 <= 0 {
        return Err(Errno::EINVAL);
    }
    epoll_create1(ctx, &[0; 6])
}

fn epoll_of(ctx: &Ctx, fd: i32) -> Result<u64, Errno> {
    match ctx.proc.fds.get(fd)?.kind {
        FileKind::Object(id) if matches!(ctx.proc.fds.objects.get(id)?.kind, ObjKind::Epoll(_)) => Ok(id),
        _ => Err(Errno::EINVAL),
    }
}

/// Does epoll `ep` (through any depth) watch epoll `target`? (loops are ELOOP)
fn epoll_reaches(ctx: &Ctx, from: u64, target: u64, depth: u32) -> bool {
    if from == target {
        return true;
    }
    if depth > crate::objects::EPOLL_MAX_NESTS {
        return true;
    }
    let Ok(o) = ctx.proc.fds.objects.get(from) else { return false };
    let ObjKind::Epoll(e) = &o.kind else { return false };
    e.watches.values().any(|w| match ctx.proc.fds.description(w.ofd).map(|f| f.kind) {
        Some(FileKind::Object(id)) => epoll_reaches(ctx, id, target, depth + 1),
        _ => false,
    })
}

pub fn epoll_ctl(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (epfd, op, fd, ev) = (a[0] as i32, a[1] as i32, a[2] as i32, a[3]);
    let ep = epoll_of(ctx, epfd)?;
    let target = *ctx.proc.fds.get(fd)?;
    let ofd = ctx.proc.fds.ofd(fd)?;
    if fd == epfd {
        return Err(Errno::EINVAL);
    }
    // Regular files and directories cannot be watched (as Linux).
    if matches!(target.kind, FileKind::Node(_)) {
        return Err(Errno::EPERM);
    }
    let event = if op != libc::EPOLL_CTL_DEL {
        let b = ctx.bytes(ev, 12)?;
        let events = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let data = u64::from_le_bytes(b[4..12].try_into().map_err(|_| Errno::EFAULT)?);
        Some((events & !(EPOLLWAKEUP | EPOLLEXCLUSIVE), data))
    } else {
        None
    };
    if let FileKind::Object(id) = target.kind {
        if op == libc::EPOLL_CTL_ADD && epoll_reaches(ctx, id, ep, 0) {
            return Err(Errno::ELOOP);
        }
    }
    ctx.proc.fds.objects.et_forget_watch(ep, fd);
    let e = ctx.proc.fds.objects.epoll_mut(ep)?;
    // A watch whose description was closed meanwhile is gone (as Linux).
    let existing = e.watches.get(&fd).is_some_and(|w| w.ofd == ofd);
    match (op, event) {
        (libc::EPOLL_CTL_ADD, Some((events, data))) => {
            if existing {
                return Err(Errno::EEXIST);
            }
            e.watches.insert(fd, Watch { ofd, events, data });
        }
        (libc::EPOLL_CTL_MOD, Some((events, data))) => {
            if !existing {
                return Err(Errno::ENOENT);
            }
            e.watches.insert(fd, Watch { ofd, events, data });
        }
        (libc::EPOLL_CTL_DEL, _) => {
            if !existing {
                return Err(Errno::ENOENT);
            }
            e.watches.remove(&fd);
        }
        _ => return Err(Errno::EINVAL),
    }
    Ok(0)
}

fn epoll_wait_common(ctx: &mut Ctx, epfd: i32, events_ptr: u64, max: i32, timeout: Option<Duration>) -> SysResult {
    if max <= 0 || max > EP_MAX_EVENTS {
        return Err(Errno::EINVAL);
    }
    let ep = epoll_of(ctx, epfd)?;
    let ep_ofd = ctx.proc.fds.ofd(epfd)?;
    let max = (max as usize).min(crate::fd::MAX_FDS as usize);
    ctx.user_range(events_ptr, max as u64 * 12)?;
    let objects = &ctx.proc.fds.objects;
    let ObjKind::Epoll(e) = &objects.get(ep)?.kind else { return Err(Errno::EINVAL) };
    let mut out = Vec::new();
    let mut fired_oneshot = Vec::new();
    let mut stale = Vec::new();
    let mut edges = Vec::new();
    for (&fd, w) in e.watches.iter() {
        if out.len() >= max * 12 {
            break;
        }
        if ctx.proc.fds.description(w.ofd).is_none() {
            stale.push(fd);
            continue;
        }
        // A disarmed one-shot watch keeps only EPOLLONESHOT and the flags.
        let asked = w.events & !(EPOLLONESHOT | EPOLLET);
        if asked == 0 {
            continue;
        }
        let ready = wait::ready(ctx.proc, ctx.kernel, w.ofd);
        let rev = objects.watch_fires(ep, fd, w, ready);
        if w.events & EPOLLET != 0 {
            // Reported now, or not ready (so readiness to come is an edge).
            let now = ready & (asked | ALWAYS);
            if rev != 0 || now == 0 {
                edges.push((fd, w.ofd, now));
            }
        }
        if rev != 0 {
            out.extend_from_slice(&rev.to_le_bytes());
            out.extend_from_slice(&w.data.to_le_bytes());
            if w.events & EPOLLONESHOT != 0 {
                fired_oneshot.push(fd);
            }
        }
    }
    if out.is_empty() && !ctx.timed_out && timeout != Some(Duration::ZERO) {
        return ctx.block(Block::new(WaitOn::Fd { ofd: ep_ofd, events: READABLE }).timeout(timeout, Ok(0)));
    }
    ctx.write_bytes(events_ptr, &out)?;
    for (fd, ofd, r) in edges {
        ctx.proc.fds.objects.et_note(ep, fd, ofd, r);
    }
    let e = ctx.proc.fds.objects.epoll_mut(ep)?;
    for fd in stale {
        e.watches.remove(&fd);
    }
    for fd in fired_oneshot {
        if let Some(w) = e.watches.get_mut(&fd) {
            w.events &= EPOLLONESHOT | EPOLLET;
        }
    }
    Ok(out.len() as u64 / 12)
}

fn ms_timeout(ms: i32) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

pub fn epoll_wait(ctx: &mut Ctx, a: &Args) -> SysResult {
    epoll_wait_common(ctx, a[0] as i32, a[1], a[2] as i32, ms_timeout(a[3] as i32))
}

/// epoll_pwait: the signal mask argument is accepted (only the interrupt's
/// SIGINT is ever delivered, and it ends the wait with EINTR either way).
pub fn epoll_pwait(ctx: &mut Ctx, a: &Args) -> SysResult {
    epoll_wait_common(ctx, a[0] as i32, a[1], a[2] as i32, ms_timeout(a[3] as i32))
}

pub fn epoll_pwait2(ctx: &mut Ctx, a: &Args) -> SysResult {
    let timeout = if a[3] != 0 { Some(super::sys_time::read_timespec(ctx, a[3])?) } else { None };
    epoll_wait_common(ctx, a[0] as i32, a[1], a[2] as i32, timeout)
}
