//! Per-key limits: requests per second (a token bucket per key, in memory),
//! sessions per tenant, checkpoint disk per tenant. `None` is unlimited.

use std::num::NonZeroU32;
use std::time::Duration;

use axum::http::StatusCode;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota};

use crate::error::ApiError;
use crate::Inner;

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

/// A GCRA token bucket: `n` requests per second, bursts of up to `n`.
pub struct RateLimiter(DefaultDirectRateLimiter);

impl RateLimiter {
    pub fn per_second(n: u64) -> Option<RateLimiter> {
        let n = NonZeroU32::new(u32::try_from(n).ok()?)?;
        Some(RateLimiter(DefaultDirectRateLimiter::direct(Quota::per_second(n))))
    }

    /// Ok, or how long until the next request would be allowed.
    pub fn check(&self) -> Result<(), Duration> {
        self.0.check().map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }
}

/// 429 `rate_limited` with a Retry-After of whole seconds (at least 1).
pub fn rate_limited(wait: Duration) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        format!("this API key is over its request rate; retry in {} ms", wait.as_millis().max(1)),
    );
    e.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
    e
}

fn quota_exceeded(message: String) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "quota_exceeded", message)
}

/// Before creating a session: 403 if the tenant is at its session quota. Blocking (SQLite).
pub fn check_sessions(state: &Inner, tenant: &str, limits: Option<&KeyLimits>) -> Result<(), ApiError> {
    let Some(max) = limits.and_then(|l| l.max_sessions) else { return Ok(()) };
    let n = state
        .sessions
        .store()
        .count_sessions(Some(tenant))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "storage_error", e.to_string()))?;
    if n >= max {
        return Err(quota_exceeded(format!("this API key allows {max} sessions and {n} exist; delete some first")));
    }
    Ok(())
}

/// Before an exec or upload in a session: 403 if the tenant's checkpoints are over its disk quota. Blocking (SQLite).
pub fn check_disk(state: &Inner, tenant: &str, limits: Option<&KeyLimits>) -> Result<(), ApiError> {
    let Some(max_mb) = limits.and_then(|l| l.max_disk_mb) else { return Ok(()) };
    let used = state.sessions.disk_bytes(tenant)?;
    if used >= max_mb.saturating_mul(1 << 20) {
        return Err(quota_exceeded(format!(
            "the checkpoints of this tenant's sessions take {:.1} MiB, the key allows {max_mb} MiB; delete sessions first",
            used as f64 / (1 << 20) as f64
        )));
    }
    Ok(())
}
