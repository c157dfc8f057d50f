//! Ctrl-C for a running exec: an `Interrupter` is handed to an exec
//! (`ExecOptions::interrupt`) and triggered from any other thread. The guest
//! then gets SIGINT, delivered as a kernel would (see `signal.rs`).

use std::sync::Arc;

use forkbox_vmm::InterruptLatch;

#[derive(Clone, Debug, Default)]
pub struct Interrupter {
    latch: Arc<InterruptLatch>,
}

impl Interrupter {
    pub fn new() -> Interrupter {
        Interrupter::default()
    }

    /// Interrupt the exec this was handed to, if one is running (true), else nothing (false).
    pub fn interrupt(&self) -> bool {
        self.latch.interrupt()
    }

    pub(crate) fn latch(&self) -> &Arc<InterruptLatch> {
        &self.latch
    }
}
