//! Ctrl-C for a running exec: an `Interrupter` is handed to an exec
//! (`ExecOptions::interrupt`) and triggered from any other thread. The guest
//! then gets SIGINT, delivered as a kernel would (see `signal.rs`).
//!
//! An exec that runs in another process (a sandbox worker) is reached through
//! a forwarder ([`Interrupter::forward`]): every interrupt that counts is also
//! handed to it, and it tells the worker.

use std::sync::{Arc, Mutex};

use forkbox_vmm::InterruptLatch;

/// Called on every interrupt that counts (see [`Interrupter::forward`]).
pub type Forward = Arc<dyn Fn() + Send + Sync>;

#[derive(Clone, Default)]
pub struct Interrupter {
    latch: Arc<InterruptLatch>,
    forward: Arc<Mutex<Option<Forward>>>,
}

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interrupter").field("pending", &self.latch.is_pending()).finish()
    }
}

impl Interrupter {
    pub fn new() -> Interrupter {
        Interrupter::default()
    }

    /// Interrupt the exec this was handed to, if one is running (true), else nothing (false).
    pub fn interrupt(&self) -> bool {
        let counted = self.latch.interrupt();
        if counted {
            let f = self.forward.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(f) = f {
                f();
            }
        }
        counted
    }

    /// An exec with this interrupter is about to start (e.g. once a session is
    /// resumed): interrupts from now on count and are delivered when it runs.
    pub fn arm(&self) {
        self.latch.arm();
    }

    /// The armed exec will not run after all.
    pub fn disarm(&self) {
        self.latch.disarm();
    }

    /// An interrupt counted (since the exec was armed) and no run took it yet.
    pub fn is_pending(&self) -> bool {
        self.latch.is_pending()
    }

    /// Hand every interrupt that counts from now on to `f` too (None: no
    /// more): how an exec running in another process hears of them.
    pub fn forward(&self, f: Option<Forward>) {
        *self.forward.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    pub(crate) fn latch(&self) -> &Arc<InterruptLatch> {
        &self.latch
    }
}
