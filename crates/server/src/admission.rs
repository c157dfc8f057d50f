//! Admission: at most one exec per exec thread of the runtime at a time; at
//! most `max_queue` requests wait for a slot, each for at most `queue_wait`;
//! anything past that gets 503 `overloaded` (with `Retry-After`). A permit is
//! handed to the runtime with the exec and released after the sandbox is
//! dropped, so the slot count matches the threads that are really busy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

pub(crate) struct Admission {
    permits: Arc<Semaphore>,
    slots: usize,
    queued: AtomicUsize,
    max_queue: usize,
    wait: Duration,
}

struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    /// `slots` exec slots; `max_queue` 0: 8 × `slots`.
    pub(crate) fn new(slots: usize, max_queue: usize, wait: Duration) -> Admission {
        let slots = slots.max(1);
        Admission {
            permits: Arc::new(Semaphore::new(slots)),
            slots,
            queued: AtomicUsize::new(0),
            max_queue: if max_queue > 0 { max_queue } else { slots * 8 },
            wait,
        }
    }

    /// `n` exec slots, waiting in the bounded queue if need be; 503 past it.
    pub(crate) async fn acquire(&self, n: usize) -> Result<OwnedSemaphorePermit, ApiError> {
        let n = n.clamp(1, self.slots) as u32;
        if let Ok(p) = self.permits.clone().try_acquire_many_owned(n) {
            return Ok(p);
        }
        let ahead = self.queued.fetch_add(1, Ordering::SeqCst);
        let _q = Queued(&self.queued);
        if ahead >= self.max_queue {
            return Err(ApiError::overloaded());
        }
        match tokio::time::timeout(self.wait, self.permits.clone().acquire_many_owned(n)).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(ApiError::overloaded()),
        }
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    pub(crate) fn free(&self) -> usize {
        self.permits.available_permits()
    }

    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }
}
