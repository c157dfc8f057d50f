//! Per-key limits: requests per second (a token bucket per key, in memory,
//! checked here; a batch counts each exec), CPU seconds per hour (a bucket per
//! key, charged after each exec), concurrent execs (see `admission`), the
//! longest timeout, sessions per tenant and checkpoint disk per tenant
//! (checked by the runtime, see [`forkbox_runtime::Quota`]). `None` is unlimited.

use std::num::NonZeroU32;
use std::time::Duration;

use forkbox_api::ErrorCode;
use forkbox_runtime::Quota;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota as Rate};

use crate::error::ApiError;

/// A key's limits, as stored in keys.db. `None` is unlimited, except
/// `max_concurrency` (see there). New keys get [`KeyLimits::defaults`] unless
/// created `--unlimited` ([`KeyLimits::unlimited`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// Requests per second (also the burst); a batch counts one per exec.
    pub rate_limit: Option<u64>,
    /// Sessions (ForeverVM machines included) the tenant may have at once.
    pub max_sessions: Option<u64>,
    /// Checkpoint bytes on disk of the tenant's sessions, in MiB: a checkpoint
    /// that would pass it is refused (403 `quota_exceeded`, the session stays
    /// at its previous checkpoint).
    pub max_disk_mb: Option<u64>,
    /// Execs of this key running at once (a batch counts each of its parallel
    /// execs). `None`: the server's default share of its exec slots
    /// (`ServerConfig::key_concurrency`); `Some(0)`: every slot.
    pub max_concurrency: Option<u64>,
    /// CPU seconds of guest time per hour (a bucket that refills continuously,
    /// up to this much); once spent, execs get 429 `cpu_budget_exceeded`.
    pub cpu_seconds_per_hour: Option<u64>,
    /// Largest `timeout_seconds` this key may ask for (the server's maximum still applies).
    pub max_timeout_seconds: Option<u64>,
    /// The key's egress policy: a layer under the server's that every sandbox
    /// of the key gets (requests and templates can only narrow it). `None`: the server's alone.
    pub egress: Option<forkbox_runtime::NetPolicy>,
}

impl KeyLimits {
    /// What a new key gets unless created unlimited (documented in docs/api.md):
    /// 20 requests/s, 100 sessions, 1 GiB of checkpoints, the default share of
    /// the exec slots, one CPU-hour per hour, execs of at most 60 s.
    pub fn defaults() -> KeyLimits {
        KeyLimits {
            rate_limit: Some(20),
            max_sessions: Some(100),
            max_disk_mb: Some(1024),
            max_concurrency: None,
            cpu_seconds_per_hour: Some(3600),
            max_timeout_seconds: Some(60),
            egress: None,
        }
    }

    /// No limits at all (`forkbox key create --unlimited`): every exec slot too.
    pub fn unlimited() -> KeyLimits {
        KeyLimits { max_concurrency: Some(0), ..KeyLimits::default() }
    }
}

/// A bucket of CPU seconds: holds at most `per_hour`, refills at `per_hour`
/// per hour; an exec takes what it used after the fact (so the balance can go
/// below zero by one exec's time, bounded by the key's timeout).
pub struct CpuBudget {
    per_hour: f64,
    state: std::sync::Mutex<(f64, std::time::Instant)>,
}

impl CpuBudget {
    pub fn new(per_hour: u64) -> CpuBudget {
        CpuBudget {
            per_hour: per_hour as f64,
            state: std::sync::Mutex::new((per_hour as f64, std::time::Instant::now())),
        }
    }

    fn refill(&self, st: &mut (f64, std::time::Instant)) {
        let now = std::time::Instant::now();
        st.0 = (st.0 + now.duration_since(st.1).as_secs_f64() * self.per_hour / 3600.0).min(self.per_hour);
        st.1 = now;
    }

    /// Ok while there is budget left, else how long until there is.
    pub fn check(&self) -> Result<(), Duration> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut st);
        if st.0 > 0.0 {
            return Ok(());
        }
        let rate = self.per_hour / 3600.0;
        Err(Duration::from_secs_f64(if rate > 0.0 { (-st.0 + 0.001) / rate } else { 3600.0 }))
    }

    /// Take `seconds` of CPU time spent by an exec.
    pub fn charge(&self, seconds: f64) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut st);
        st.0 -= seconds.max(0.0);
    }

    /// Seconds left now.
    pub fn left(&self) -> f64 {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut st);
        st.0
    }
}

impl KeyLimits {
    /// What the runtime enforces.
    pub fn quota(&self) -> Quota {
        Quota { max_sessions: self.max_sessions, max_disk_mb: self.max_disk_mb }
    }
}

/// A GCRA token bucket: `n` requests per second, bursts of up to `n`.
pub struct RateLimiter(DefaultDirectRateLimiter);

impl RateLimiter {
    pub fn per_second(n: u64) -> Option<RateLimiter> {
        let n = NonZeroU32::new(u32::try_from(n).ok()?)?;
        Some(RateLimiter(DefaultDirectRateLimiter::direct(Rate::per_second(n))))
    }

    /// Ok, or how long until the next request would be allowed.
    pub fn check(&self) -> Result<(), Duration> {
        self.0.check().map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }

    /// `n` more requests at once (a batch of `n` execs; its request itself was
    /// already counted): Ok, or how long to wait. More than the burst can ever
    /// allow waits a second (the caller's batch is too large for the key).
    pub fn check_n(&self, n: u32) -> Result<(), Duration> {
        let Some(n) = NonZeroU32::new(n) else { return Ok(()) };
        match self.0.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(DefaultClock::default().now())),
            Err(_) => Err(Duration::from_secs(1)),
        }
    }
}

/// 429 `rate_limited` with a Retry-After of whole seconds (at least 1).
pub fn rate_limited(wait: Duration) -> ApiError {
    let mut e = ApiError::new(
        ErrorCode::RateLimited,
        format!("this API key is over its request rate; retry in {} ms", wait.as_millis().max(1)),
    );
    e.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
    e
}
