//! Per-key limits: requests per second (a token bucket per key, in memory,
//! checked here), sessions per tenant and checkpoint disk per tenant (checked
//! by the runtime, see [`forkbox_runtime::Quota`]). `None` is unlimited.

use std::num::NonZeroU32;
use std::time::Duration;

use forkbox_api::ErrorCode;
use forkbox_runtime::Quota;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota as Rate};

use crate::error::ApiError;

/// A key's limits, as stored in keys.db.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// Requests per second (also the burst).
    pub rate_limit: Option<u64>,
    /// Sessions (ForeverVM machines included) the tenant may have at once.
    pub max_sessions: Option<u64>,
    /// Checkpoint bytes on disk of the tenant's sessions, in MiB; execs and
    /// uploads are refused once it is over.
    pub max_disk_mb: Option<u64>,
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
