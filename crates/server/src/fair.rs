//! Fair exec slots. An exec first takes its key's own permits (at most
//! `KeyLimits::max_concurrency` execs of one key at once, by default a share
//! of the slots; a key's extra requests wait in that key's own bounded queue),
//! and only then a server slot (FIFO). So one tenant's spinning guests hold at
//! most its share of the slots and never fill the shared queue: another
//! tenant's request waits only behind requests that were there before it and
//! are within their own keys' shares.
//!
//! CPU seconds: the slot is handed to the runtime as the exec's `hold` and
//! dropped on the exec thread at the end of the job; it charges the job's CPU
//! time there ([`forkbox_runtime::job_cpu_seconds`]; KVM counts guest time as
//! the thread's) to the key's [`CpuBudget`](crate::quota::CpuBudget). A key
//! with none left gets 429 `cpu_budget_exceeded` (with `Retry-After`) before it
//! takes a slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use forkbox_api::ErrorCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::keys::KeyInfo;
use crate::Inner;

/// A server slot and the key's permits; see the module documentation.
pub struct ExecSlot {
    _global: OwnedSemaphorePermit,
    _key: Option<OwnedSemaphorePermit>,
    key: Option<Arc<KeyInfo>>,
    /// Parallel execs this slot stands for (a batch's workers), for charging.
    width: usize,
    since: std::time::Instant,
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        let Some(budget) = self.key.as_ref().and_then(|k| k.cpu.as_ref()) else { return };
        let used = if self.width > 1 {
            // A batch runs on several exec threads and the slot is dropped on
            // the last: charge its wall time for each (an upper bound of their CPU).
            self.since.elapsed().as_secs_f64() * self.width as f64
        } else {
            // Dropped on the exec thread at the end of the job (0 elsewhere).
            forkbox_runtime::job_cpu_seconds()
        };
        budget.charge(used);
    }
}

/// The key's concurrency limit (at least 1, at most every slot).
pub fn key_limit(state: &Inner, key: &KeyInfo) -> usize {
    let all = state.admission.slots();
    match key.limits.max_concurrency {
        None => state.config.key_concurrency(all),
        Some(0) => all,
        Some(n) => (n as usize).clamp(1, all),
    }
}

fn key_semaphore(state: &Inner, key: &KeyInfo) -> Arc<Semaphore> {
    key.running.get_or_init(|| Arc::new(Semaphore::new(key_limit(state, key)))).clone()
}

struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn cpu_exceeded(wait: Duration) -> ApiError {
    let mut e = ApiError::new(
        ErrorCode::CpuBudgetExceeded,
        format!("this API key has used its CPU seconds for now; retry in {} s", wait.as_secs_f64().ceil().max(1.0)),
    );
    e.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
    e
}

/// A request's `timeout_seconds` within the caller key's maximum (the
/// runtime's maximum applies on top): 400 past it; no timeout asked and a
/// server default above the key's maximum gives the key's maximum.
pub fn key_timeout(state: &Inner, caller: &Caller, seconds: Option<f64>) -> Result<Option<f64>, ApiError> {
    key_timeout_of(&state.runtime, caller, seconds)
}

/// [`key_timeout`] over the runtime (also checks the value against the runtime's own maximum).
pub fn key_timeout_of(
    rt: &forkbox_runtime::Runtime,
    caller: &Caller,
    seconds: Option<f64>,
) -> Result<Option<f64>, ApiError> {
    if seconds.is_some() {
        rt.timeout(seconds)?;
    }
    let Some(max) = caller.limits().and_then(|l| l.max_timeout_seconds) else { return Ok(seconds) };
    let max = max as f64;
    match seconds {
        Some(s) if s.is_finite() && s > max => {
            Err(ApiError::invalid(format!("timeout_seconds must be > 0 and <= {max} for this API key, got {s}")))
        }
        Some(s) => Ok(Some(s)),
        None if rt.config().limits.timeout.as_secs_f64() > max => Ok(Some(max)),
        None => Ok(None),
    }
}

/// `n` parallel execs for `caller` (clamped to its key's share): the key's
/// permits (429 `rate_limited` once its own queue is full or its wait times
/// out), then server slots (503 `overloaded` as before).
pub async fn acquire_for(state: &Inner, caller: &Caller, n: usize) -> Result<ExecSlot, ApiError> {
    let key = caller.key.clone();
    let mut width = n.clamp(1, state.admission.slots());
    let mut key_permit = None;
    if let Some(k) = &key {
        if let Some(budget) = &k.cpu {
            budget.check().map_err(cpu_exceeded)?;
            state.background_cpu.note(caller);
        }
        let limit = key_limit(state, k);
        width = width.min(limit);
        // A key that may use every slot has no queue of its own: past the
        // server's capacity it is overload (503), as for everyone.
        if limit < state.admission.slots() {
            key_permit = Some(key_permits(state, k, limit, width).await?);
        }
    }
    let global = state.admission.acquire(width).await?;
    Ok(ExecSlot { _global: global, _key: key_permit, key, width, since: std::time::Instant::now() })
}

/// `width` of key `k`'s own permits (its limit is `limit`): 429 once its queue is full or the wait times out.
async fn key_permits(
    state: &Inner,
    k: &Arc<KeyInfo>,
    limit: usize,
    width: usize,
) -> Result<OwnedSemaphorePermit, ApiError> {
    let sem = key_semaphore(state, k);
    let want = width as u32;
    Ok(match sem.clone().try_acquire_many_owned(want) {
        Ok(p) => p,
        Err(_) => {
            let ahead = k.queued.fetch_add(1, Ordering::SeqCst);
            let _w = Waiting(&k.queued);
            let too_many = || {
                let mut e = ApiError::new(
                    ErrorCode::RateLimited,
                    format!("this API key may run {limit} execs at once and has more waiting; retry shortly"),
                );
                e.retry_after = Some(1);
                e
            };
            if ahead >= limit * 8 {
                return Err(too_many());
            }
            match tokio::time::timeout(state.config.queue_wait, sem.acquire_many_owned(want)).await {
                Ok(Ok(p)) => p,
                _ => return Err(too_many()),
            }
        }
    })
}

/// How many parallel execs a batch of `n` gets for `caller`.
pub fn batch_width(state: &Inner, caller: &Caller, n: usize) -> usize {
    let w = state.runtime.batch_parallelism(n);
    match &caller.key {
        Some(k) => w.min(key_limit(state, k)),
        None => w,
    }
}
