//! Fair exec slots. An exec first takes its key's own permits (at most
//! `KeyLimits::max_concurrency` execs of one key at once, by default a share
//! of the slots; a key's extra requests wait in that key's own bounded queue),
//! and only then a server slot (FIFO). So one tenant's spinning guests hold at
//! most its share of the slots and never fill the shared queue: another
//! tenant's request waits only behind requests that were there before it and
//! are within their own keys' shares.
//!
//! CPU seconds: every exec thread's CPU time (KVM counts guest time as the
//! thread's) is measured from the moment the slot is [`ExecSlot::started`] on
//! the exec thread until it is dropped there, and charged to the key's
//! [`CpuBudget`](crate::quota::CpuBudget); a key with none left gets 429
//! `cpu_budget_exceeded` (with `Retry-After`) before it takes a slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::Caller;
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
    started: Option<(f64, std::time::Instant)>,
}

/// CPU time of the calling thread, in seconds.
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

impl ExecSlot {
    /// Call on the thread that runs the exec: its CPU time from now on is
    /// charged to the key when the slot is dropped (on that thread).
    pub fn started(mut self) -> ExecSlot {
        self.started = Some((thread_cpu_seconds(), std::time::Instant::now()));
        self
    }
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        let (Some(key), Some((cpu0, wall0))) = (&self.key, self.started) else { return };
        let Some(budget) = &key.cpu else { return };
        let used = if self.width > 1 {
            // A batch runs its execs on threads of its own: charge its wall
            // time for each of them (an upper bound of their CPU time).
            wall0.elapsed().as_secs_f64() * self.width as f64
        } else {
            (thread_cpu_seconds() - cpu0).max(0.0)
        };
        budget.charge(used);
    }
}

/// The key's concurrency limit (at least 1, at most every slot).
pub fn key_limit(state: &Inner, key: &KeyInfo) -> usize {
    let all = state.concurrency;
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
        StatusCode::TOO_MANY_REQUESTS,
        "cpu_budget_exceeded",
        format!("this API key has used its CPU seconds for now; retry in {} s", wait.as_secs_f64().ceil().max(1.0)),
    );
    e.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
    e
}

/// `n` parallel execs for `caller` (clamped to its key's share): the key's
/// permits (429 `rate_limited` once its own queue is full or its wait times
/// out), then server slots (503 `overloaded` as before).
pub async fn acquire_for(state: &Inner, caller: &Caller, n: usize) -> Result<ExecSlot, ApiError> {
    let key = caller.key.clone();
    let mut width = n.clamp(1, state.concurrency);
    let mut key_permit = None;
    if let Some(k) = &key {
        if let Some(budget) = &k.cpu {
            budget.check().map_err(cpu_exceeded)?;
        }
        let limit = key_limit(state, k);
        width = width.min(limit);
        let sem = key_semaphore(state, k);
        let want = width as u32;
        key_permit = Some(match sem.clone().try_acquire_many_owned(want) {
            Ok(p) => p,
            Err(_) => {
                let ahead = k.queued.fetch_add(1, Ordering::SeqCst);
                let _w = Waiting(&k.queued);
                let too_many = || {
                    let mut e = ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limited",
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
        });
    }
    let global = crate::api::acquire(state, width).await?;
    Ok(ExecSlot { _global: global, _key: key_permit, key, width, started: None })
}

/// How many parallel execs a batch of `n` gets for `caller`.
pub fn batch_width(state: &Inner, caller: &Caller, n: usize) -> usize {
    let w = n.min((state.concurrency / 2).max(1));
    match &caller.key {
        Some(k) => w.min(key_limit(state, k)),
        None => w,
    }
}
