//! Blocking system calls: the contract between syscall handlers and the
//! engine's scheduler.
//!
//! A handler never sleeps. When a call must wait (a blocking read with nothing
//! to read, a write with no room, poll/select/epoll_wait with nothing ready and
//! a non-zero timeout, a futex wait whose value matches, ...) it describes what
//! it waits for in a [`Block`], sets `ctx.effect = Some(Effect::Block(..))`
//! (`Ctx::block`) and returns without side effects visible to the guest.
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
//! - `crate::wait::next_change` says when the process state changes by itself (a timerfd
//!   expiring): the engine re-runs the handler then as well;
//! - an interrupt of the exec ends the wait with `EINTR` (the signal is then
//!   delivered on the way back, as on Linux); the exec deadline ends it with
//!   the exec's timeout;
//! - single-threaded, a call with no deadline and no `crate::wait::next_change` can never
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

/// Readiness bits used in `WaitOn::Fd`/`Fds` (poll's `POLL*` values).
pub const READABLE: u32 = libc::POLLIN as u32;
pub const WRITABLE: u32 = libc::POLLOUT as u32;

/// What a blocked call waits for. Informational for the scheduler (which
/// re-runs the handler to find out whether the wait is over), and what
/// deadlock detection and `crate::wait::next_change` look at.
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
