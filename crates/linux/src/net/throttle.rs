//! The bandwidth limit: a token bucket over the bytes a sandbox's host
//! sockets move, and what `NetIo` holds back (send, recv, poll readiness)
//! while it is empty.

use std::time::{Duration, Instant};

use crate::errno::Errno;

use super::NetIo;

/// A token bucket over the bytes a sandbox moves through its host sockets
/// (both directions together): `rate` bytes per second, at most `burst`
/// saved up. A datagram may overdraw it (it is sent whole); the debt is
/// paid back before anything else moves.
#[derive(Debug)]
pub(super) struct Throttle {
    rate: u64,
    burst: u64,
    /// May go negative (a datagram's overdraft).
    tokens: i64,
    last: Instant,
}

impl Throttle {
    /// Less than this in the bucket is "empty": no call moves fewer bytes
    /// than it (unless the bucket holds fewer at most).
    const CHUNK: u64 = 16 << 10;

    pub(super) fn new(rate: u64) -> Throttle {
        let rate = rate.max(1);
        let burst = (rate / 8).clamp(Self::CHUNK, 4 << 20);
        Throttle { rate, burst, tokens: i64::try_from(burst).unwrap_or(i64::MAX), last: Instant::now() }
    }

    fn chunk(&self) -> i64 {
        i64::try_from(Self::CHUNK.min(self.burst)).unwrap_or(i64::MAX)
    }

    /// Tokens earned since `last` (whole bytes).
    fn earned(&self, now: Instant) -> i64 {
        let ns = now.saturating_duration_since(self.last).as_nanos();
        let add = ns.saturating_mul(u128::from(self.rate)) / 1_000_000_000;
        i64::try_from(add).unwrap_or(i64::MAX)
    }

    fn refill(&mut self, now: Instant) {
        let add = self.earned(now);
        if add == 0 {
            return;
        }
        let burst = i64::try_from(self.burst).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(add).min(burst);
        self.last = now;
    }

    /// The bucket holds less than a chunk now (without refilling it).
    fn is_empty(&self) -> bool {
        self.tokens.saturating_add(self.earned(Instant::now())) < self.chunk()
    }

    /// Bytes that may move now (None: the bucket is empty, wait).
    fn available(&mut self) -> Option<u64> {
        self.refill(Instant::now());
        (self.tokens >= self.chunk()).then(|| u64::try_from(self.tokens).unwrap_or(0))
    }

    fn take(&mut self, n: u64) {
        self.tokens = self.tokens.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// When the bucket holds a chunk again (None: it does now).
    fn ready_at(&mut self) -> Option<Instant> {
        let now = Instant::now();
        self.refill(now);
        let missing = self.chunk().saturating_sub(self.tokens);
        if missing <= 0 {
            return None;
        }
        let ns = u128::from(missing.unsigned_abs()).saturating_mul(1_000_000_000) / u128::from(self.rate) + 1;
        let wait = Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX));
        Some(self.last.checked_add(wait).unwrap_or(now + Duration::from_secs(3600)))
    }
}

/// What the bandwidth limit holds back while its bucket is empty.
pub(super) const RATE_HELD: i16 = libc::POLLIN | libc::POLLOUT | libc::POLLRDNORM | libc::POLLWRNORM | libc::POLLPRI;

impl NetIo {
    /// Bytes a host socket may move now under the bandwidth limit (EAGAIN:
    /// the bucket is empty; poll shows the sockets not ready until
    /// [`Self::throttled_until`]).
    pub(super) fn rate_budget(&mut self) -> Result<u64, Errno> {
        match &mut self.throttle {
            None => Ok(u64::MAX),
            Some(t) => t.available().ok_or(Errno::EAGAIN),
        }
    }

    pub(super) fn rate_take(&mut self, n: u64) {
        if let Some(t) = &mut self.throttle {
            t.take(n);
        }
    }

    /// While the bandwidth limit holds the host sockets back: when it lets
    /// them move again (the engine re-runs blocked calls then).
    pub fn throttled_until(&mut self) -> Option<Instant> {
        self.throttle.as_mut()?.ready_at()
    }

    /// The host sockets move no bytes now (the bandwidth limit's bucket is empty).
    pub(super) fn throttled(&self) -> bool {
        self.throttle.as_ref().is_some_and(Throttle::is_empty)
    }
}
