//! timerfd: a timer on a host clock whose expirations read counts.

use serde::{Deserialize, Serialize};

use crate::errno::Errno;

use super::epoll::EPOLL_MAX_NESTS;
use super::{ObjKind, Objects};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerFd {
    /// CLOCK_MONOTONIC, CLOCK_REALTIME or CLOCK_BOOTTIME.
    pub clock: i32,
    /// Next expiry in the clock's nanoseconds; 0 = disarmed.
    pub next_ns: u64,
    pub interval_ns: u64,
    /// Expirations counted but not yet read.
    pub ticks: u64,
}

impl TimerFd {
    /// Expirations due at `now` (not yet folded into `ticks`) and the next expiry.
    fn due(&self, now: u64) -> (u64, u64) {
        if self.next_ns == 0 || now < self.next_ns {
            return (0, self.next_ns);
        }
        if self.interval_ns == 0 {
            return (1, 0);
        }
        let n = (now - self.next_ns) / self.interval_ns + 1;
        (n, self.next_ns.saturating_add(n.saturating_mul(self.interval_ns)))
    }

    /// Fold due expirations into `ticks`.
    pub fn advance(&mut self, now: u64) {
        let (n, next) = self.due(now);
        self.ticks = self.ticks.saturating_add(n);
        self.next_ns = next;
    }

    pub fn pending(&self, now: u64) -> u64 {
        self.ticks.saturating_add(self.due(now).0)
    }
}

/// Nanoseconds of a host clock.
pub fn clock_ns(clock: i32) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

impl Objects {
    pub fn timerfd_mut(&mut self, id: u64) -> Result<&mut TimerFd, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::TimerFd(t) => Ok(t),
            _ => Err(Errno::EINVAL),
        }
    }

    /// Expirations since the last read (EAGAIN if none).
    pub fn timerfd_read(&mut self, id: u64) -> Result<u64, Errno> {
        let t = self.timerfd_mut(id)?;
        t.advance(clock_ns(t.clock));
        if t.ticks == 0 {
            return Err(Errno::EAGAIN);
        }
        Ok(std::mem::take(&mut t.ticks))
    }

    /// When a timerfd among `ids` (or watched by an epoll among them) next expires,
    /// in CLOCK_MONOTONIC-relative terms: the nanoseconds from now.
    pub fn next_expiry_in(&self, id: u64, depth: u32, ofd_obj: &dyn Fn(u64) -> Option<u64>) -> Option<u64> {
        match &self.get(id).ok()?.kind {
            ObjKind::TimerFd(t) if t.next_ns != 0 => Some(t.next_ns.saturating_sub(clock_ns(t.clock))),
            ObjKind::Epoll(e) if depth < EPOLL_MAX_NESTS => e
                .watches
                .values()
                .filter_map(|w| ofd_obj(w.ofd).and_then(|o| self.next_expiry_in(o, depth + 1, ofd_obj)))
                .min(),
            _ => None,
        }
    }
}
