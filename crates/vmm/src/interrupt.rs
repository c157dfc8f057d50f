//! Getting a vCPU out of KVM_RUN: a per-thread POSIX timer sends a real-time
//! signal to the vCPU thread at the deadline; the handler sets `immediate_exit`
//! in that thread's `kvm_run`, so a signal that lands just before KVM_RUN is
//! entered is not lost (the next KVM_RUN returns at once with EINTR).

use std::cell::Cell;
use std::sync::Once;
use std::time::Instant;

use crate::error::{Result, VmmError};

thread_local! {
    static RUN_PTR: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
    static TIMER: Cell<Option<usize>> = const { Cell::new(None) };
}

fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: a thread-local read and a volatile byte store.
    let p = RUN_PTR.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: p is this thread's live kvm_run mapping while set (see `Armed`).
        unsafe { std::ptr::addr_of_mut!((*p).immediate_exit).write_volatile(1) };
    }
}

fn install_handler() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        res = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick).map_err(|e| VmmError::Sys {
            call: "sigaction(vCPU kick signal)",
            source: std::io::Error::from_raw_os_error(e.errno()),
        });
    });
    res
}

/// Linux `struct sigevent` for SIGEV_THREAD_ID (libc does not expose the thread-id member everywhere).
#[repr(C)]
struct SigEvent {
    value: u64,
    signo: libc::c_int,
    notify: libc::c_int,
    thread_id: libc::c_int,
    _pad: [libc::c_int; 11],
}

const SIGEV_THREAD_ID: libc::c_int = 4;

fn thread_timer() -> Result<libc::timer_t> {
    if let Some(t) = TIMER.with(|c| c.get()) {
        return Ok(t as libc::timer_t);
    }
    install_handler()?;
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::c_int;
    let mut ev = SigEvent { value: 0, signo: kick_signal(), notify: SIGEV_THREAD_ID, thread_id: tid, _pad: [0; 11] };
    let mut timer: libc::timer_t = std::ptr::null_mut();
    // SAFETY: ev has the kernel's sigevent layout; timer is a valid out-pointer.
    let rc = unsafe {
        libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev as *mut SigEvent as *mut libc::sigevent, &mut timer)
    };
    if rc != 0 {
        return Err(VmmError::last_os("timer_create"));
    }
    TIMER.with(|c| c.set(Some(timer as usize)));
    Ok(timer)
}

/// While alive, the calling thread's KVM_RUN is interrupted at `deadline`
/// (and every 10 ms after it, so a signal racing with the entry is retried).
pub struct Armed {
    timer: Option<libc::timer_t>,
}

impl Armed {
    pub fn new(run: *mut kvm_bindings::kvm_run, deadline: Option<Instant>) -> Result<Armed> {
        RUN_PTR.with(|c| c.set(run));
        let Some(deadline) = deadline else { return Ok(Armed { timer: None }) };
        let timer = thread_timer()?;
        let left = deadline.saturating_duration_since(Instant::now()).max(std::time::Duration::from_micros(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 10_000_000 },
            it_value: libc::timespec { tv_sec: left.as_secs() as i64, tv_nsec: left.subsec_nanos() as i64 },
        };
        // SAFETY: timer was created by timer_create on this thread.
        if unsafe { libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(VmmError::last_os("timer_settime"));
        }
        Ok(Armed { timer: Some(timer) })
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(t) = self.timer {
            let off = libc::itimerspec {
                it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
                it_value: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            };
            // SAFETY: disarming our own timer.
            unsafe { libc::timer_settime(t, 0, &off, std::ptr::null_mut()) };
        }
        RUN_PTR.with(|c| c.set(std::ptr::null_mut()));
    }
}

/// A request, from any thread, to stop a vCPU thread's current run (Ctrl-C).
///
/// The vCPU thread `attach`es itself for the duration of a run; `interrupt`
/// then sets the pending flag and kicks that thread with the same signal as the
/// deadline timer, so a KVM_RUN in progress returns (`Vm::run` reports
/// `VmExit::Interrupted`), and wakes a host-side sleep (`sleep`). The flag is
/// set under the mutex before the kick: `Vm::run` checks it after publishing its
/// `kvm_run` pointer, so an interrupt is never lost between the check and KVM_RUN.
#[derive(Default)]
pub struct InterruptLatch {
    pending: std::sync::atomic::AtomicBool,
    /// The attached vCPU thread.
    thread: std::sync::Mutex<Option<libc::pthread_t>>,
    wake: std::sync::Condvar,
}

impl InterruptLatch {
    pub fn new() -> std::sync::Arc<InterruptLatch> {
        std::sync::Arc::new(InterruptLatch::default())
    }

    /// Interrupt the attached thread's run. False if no thread is attached (nothing runs).
    pub fn interrupt(&self) -> bool {
        let g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = *g else { return false };
        self.pending.store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake.notify_all();
        // SAFETY: `t` is attached, so it is a live thread (it detaches under this lock before it ends).
        unsafe { libc::pthread_kill(t, kick_signal()) };
        true
    }

    pub fn is_pending(&self) -> bool {
        self.pending.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Consume a pending interrupt.
    pub fn take(&self) -> bool {
        self.pending.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Attach the calling thread until the guard drops (clears any stale request).
    pub fn attach(self: &std::sync::Arc<Self>) -> Result<Attached> {
        install_handler()?;
        let mut g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        self.pending.store(false, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: pthread_self has no preconditions.
        *g = Some(unsafe { libc::pthread_self() });
        Ok(Attached { latch: self.clone() })
    }

    /// Sleep up to `d` on the host; returns early (true) when interrupted.
    pub fn sleep(&self, d: std::time::Duration) -> bool {
        let g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        let (_g, _) = self
            .wake
            .wait_timeout_while(g, d, |_| !self.is_pending())
            .unwrap_or_else(|e| e.into_inner());
        self.is_pending()
    }
}

impl std::fmt::Debug for InterruptLatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterruptLatch").field("pending", &self.is_pending()).finish_non_exhaustive()
    }
}

/// The attachment of a vCPU thread to an `InterruptLatch` (see `InterruptLatch::attach`).
pub struct Attached {
    latch: std::sync::Arc<InterruptLatch>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        let mut g = self.latch.thread.lock().unwrap_or_else(|e| e.into_inner());
        *g = None;
        self.latch.pending.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}
