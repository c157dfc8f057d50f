//! Blocking system calls: the contract between syscall handlers and the
//! engine's scheduler.
//!
//! A handler never sleeps. When a call must wait (a blocking read with nothing
//! to read, a write with no room, poll/select/epoll_wait with nothing ready and
//! a non-zero timeout, a futex wait whose value matches, ...) it describes what
//! it waits for in a [`Block`], sets `ctx.effect = Some(Effect::Block(..))`
//! (see [`block`]) and returns without side effects visible to the guest.
//!
//! The engine then **re-runs the same handler with the same saved arguments**
//! whenever state may have changed, until it returns without blocking:
//! - the deadline of the *first* `Block` of a call is kept: a re-run's `Block`
//!   only refreshes `on` (handlers compute relative timeouts afresh, so their
//!   later deadlines would drift);
//! - once that deadline has passed, the handler is re-run one last time with
//!   `ctx.timed_out` set: it must then complete as at a timeout (poll writes
//!   empty `revents` and returns 0, a futex wait returns ETIMEDOUT); should it
//!   block anyway, the call returns `on_timeout`;
//! - [`next_change`] says when the process state changes by itself (a timerfd
//!   expiring): the engine re-runs the handler then as well;
//! - an interrupt of the exec ends the wait with `EINTR` (the signal is then
//!   delivered on the way back, as on Linux); the exec deadline ends it with
//!   the exec's timeout;
//! - single-threaded, a call with no deadline and no [`next_change`] can never
//!   be woken: the exec ends with a `deadlock` error instead of hanging.
//!   With threads, the scheduler parks the blocked thread with its saved
//!   arguments, runs another, and re-runs blocked handlers when the running
//!   thread blocks, yields, exits or is preempted; every thread blocked with
//!   no deadline and no `next_change` is a deadlock.
//!
//! So a handler that blocks must be idempotent until it completes: it may not
//! consume data, write guest memory or change process state before deciding
//! to block.

use std::time::{Duration, Instant};

use crate::errno::{Errno, SysResult};
use crate::fd::{FdTable, FileKind};
use crate::io::Io;
use crate::process::Process;
use crate::syscalls::{Ctx, Effect};

/// Readiness bits used in `WaitOn::Fd`/`Fds` (poll's `POLL*` values).
pub const READABLE: u32 = libc::POLLIN as u32;
pub const WRITABLE: u32 = libc::POLLOUT as u32;

/// What a blocked call waits for. Informational for the scheduler (which
/// re-runs the handler to find out whether the wait is over), and what
/// deadlock detection and [`next_change`] look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitOn {
    /// One open file description (`fd::FdTable` ofd id) becoming ready for
    /// `events` (`READABLE` | `WRITABLE` | other `POLL*` bits).
    Fd { ofd: u64, events: u32 },
    /// Any of several descriptions (poll, select, epoll_wait: an epoll
    /// instance is itself a description, ready when its interest set is).
    Fds(Vec<(u64, u32)>),
    /// A futex word at guest address `addr` being woken for `bitset`.
    Futex { addr: u64, bitset: u32 },
    /// A signal in `mask` becoming pending (rt_sigtimedwait, sigsuspend, pause).
    Signal { mask: u64 },
    /// A child changing state (wait4, waitid).
    Child,
    /// Nothing but time (nanosleep, clock_nanosleep): needs a deadline.
    Time,
    /// A file lock (flock) another holder has: re-run when others have run.
    Lock,
}

impl WaitOn {
    /// The (ofd, events) pairs this waits on, if it waits on descriptions.
    pub fn fds(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        type FdEvents = (u64, u32);
        let (one, many): (Option<FdEvents>, &[FdEvents]) = match self {
            WaitOn::Fd { ofd, events } => (Some((*ofd, *events)), &[]),
            WaitOn::Fds(v) => (None, v),
            _ => (None, &[]),
        };
        one.into_iter().chain(many.iter().copied())
    }
}

/// A call that must wait. See the module docs for the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub on: WaitOn,
    /// When the call gives up and returns `on_timeout` (None: never).
    pub deadline: Option<Instant>,
    /// What the call returns at the deadline (poll: `Ok(0)`, a futex wait:
    /// `Err(ETIMEDOUT)`, nanosleep: `Ok(0)`).
    pub on_timeout: SysResult,
}

impl Block {
    /// Wait for `on` with no deadline.
    pub fn new(on: WaitOn) -> Block {
        Block { on, deadline: None, on_timeout: Err(Errno::ETIMEDOUT) }
    }

    /// Give up after `timeout` from now (None: never), returning `result`.
    pub fn timeout(mut self, timeout: Option<Duration>, result: SysResult) -> Block {
        self.deadline = timeout.and_then(deadline_after);
        self.on_timeout = result;
        self
    }

    /// Give up at `deadline`, returning `result`.
    pub fn until(mut self, deadline: Option<Instant>, result: SysResult) -> Block {
        self.deadline = deadline;
        self.on_timeout = result;
        self
    }
}

/// `now + d`, or None if that is too far to represent (= never).
pub fn deadline_after(d: Duration) -> Option<Instant> {
    Instant::now().checked_add(d)
}

/// Make the current call block: sets the effect; the return value is ignored
/// by the engine (it re-runs the handler).
pub fn block(ctx: &mut Ctx, b: Block) -> SysResult {
    ctx.effect = Some(Effect::Block(b));
    Ok(0)
}

/// Is the current call blocking (a handler that composes others checks this)?
pub fn is_blocking(ctx: &Ctx) -> bool {
    matches!(ctx.effect, Some(Effect::Block(_)))
}

/// `POLL*` readiness of the open file description `ofd` (POLLNVAL if it is
/// gone). POLLHUP / POLLERR come whatever was asked for, as on Linux.
pub fn ready(proc: &Process, io: &Io, ofd: u64) -> u32 {
    ready_at(&proc.fds, io, ofd, 0, proc.pid)
}

fn ready_at(fds: &FdTable, io: &Io, ofd: u64, depth: u32, pid: u32) -> u32 {
    let Some(f) = fds.description(ofd) else { return libc::POLLNVAL as u32 };
    let (r, w) = ((libc::POLLIN | libc::POLLRDNORM) as u32, (libc::POLLOUT | libc::POLLWRNORM) as u32);
    match f.kind {
        FileKind::Agent if io.agent_pending() > 0 => r | w,
        FileKind::Agent => w,
        // A job's stdin fed by the host (end of file, as anyone else's, is readable).
        FileKind::Stdin if !io.stdin_ready(pid) => 0,
        FileKind::Stdin => r,
        FileKind::Stdout | FileKind::Stderr => w,
        FileKind::Node(_) => r | w,
        FileKind::Object(id) => fds.objects.readiness(id, f.flags, depth, &|o, d| ready_at(fds, io, o, d, pid)),
        // A host socket: asked of the host (POLLHUP/POLLERR included).
        FileKind::Socket(s) => {
            io.net.poll(s.id, crate::net::POLL_MASK | libc::POLLRDNORM | libc::POLLWRNORM) as u16 as u32
        }
    }
}

/// The host fds (host sockets, the resolver's lookups) behind what `on` waits for, directly or
/// through an epoll instance in it: the engine waits on them on the host
/// (`poll(2)`) instead of sleeping, so a socket becoming ready ends the wait.
pub fn host_fds(proc: &Process, io: &Io, on: &WaitOn) -> Vec<libc::pollfd> {
    let mut out = Vec::new();
    for (ofd, events) in on.fds() {
        host_fds_at(&proc.fds, io, ofd, events, 0, &mut out);
    }
    out
}

/// Wait on host fds until one is ready or `until`, checking `interrupted`
/// every 20 ms. True when interrupted.
pub fn poll_host(fds: &mut [libc::pollfd], until: Instant, interrupted: impl Fn() -> bool) -> bool {
    loop {
        if interrupted() {
            return true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        let slice = until.saturating_duration_since(now).min(Duration::from_millis(20));
        let ms = slice.as_millis().max(1) as i32;
        // SAFETY: fds is a valid, exclusively borrowed array of pollfd of its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n > 0 {
            return false;
        }
    }
}

fn host_fds_at(fds: &FdTable, io: &Io, ofd: u64, events: u32, depth: u32, out: &mut Vec<libc::pollfd>) {
    let Some(f) = fds.description(ofd) else { return };
    match f.kind {
        FileKind::Socket(s) if out.len() < crate::fd::MAX_FDS as usize => {
            if let Some(p) = io.net.pollfd(s.id, events as i16) {
                out.push(p);
            }
            // Answers of the resolver waiting for a host lookup.
            io.net.lookup_pollfds(s.id, events as i16, out);
        }
        FileKind::Object(id) if depth < 5 => {
            if let Ok(crate::objects::Object { kind: crate::objects::ObjKind::Epoll(e), .. }) = fds.objects.get(id) {
                for w in e.watches.values() {
                    host_fds_at(fds, io, w.ofd, w.events, depth + 1, out);
                }
            }
        }
        _ => {}
    }
}

/// The earliest time at which process state that `on` depends on changes by
/// itself (a timerfd in the set, or watched by an epoll in it, expires), if
/// any. The engine re-runs the blocked handler then.
/// Host sockets held back by the bandwidth limit count too: the wait is
/// re-run when the limit lets them move again.
pub fn next_change(proc: &Process, io: &mut Io, on: &WaitOn) -> Option<Instant> {
    let fds = &proc.fds;
    let obj = |ofd: u64| match fds.description(ofd)?.kind {
        FileKind::Object(id) => Some(id),
        _ => None,
    };
    let ns = on.fds().filter_map(|(ofd, _)| obj(ofd)).filter_map(|id| fds.objects.next_expiry_in(id, 0, &obj)).min();
    let timer = ns.and_then(|ns| Instant::now().checked_add(Duration::from_nanos(ns)));
    let throttle = io.net.throttled_until().filter(|_| !host_fds(proc, io, on).is_empty());
    timer.into_iter().chain(throttle).min()
}
