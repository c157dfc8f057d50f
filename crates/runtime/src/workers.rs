//! A fixed set of exec threads (one per exec slot). Engine calls run here
//! rather than on tokio's blocking pool because the engine keeps recycled VMs
//! per thread (and a vCPU that changes threads pays for it in KVM_RUN): on a
//! few long-lived threads nearly every fork reuses a warm VM, while the
//! blocking pool spreads execs over many threads and forks cold.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex};

use forkbox_engine::jail::Mode;

use crate::error::RuntimeError;

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// CPU time of this exec thread when its current job started.
    static JOB_START: std::cell::Cell<Option<f64>> = const { std::cell::Cell::new(None) };
    /// CPU time the current job used in a sandbox worker process (measured from outside).
    static JOB_REMOTE: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
    /// Which exec thread this is (its sandbox worker slot).
    static EXEC_INDEX: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The index of the calling exec thread (0 elsewhere).
pub(crate) fn exec_index() -> usize {
    EXEC_INDEX.with(|i| i.get())
}

/// Charge `seconds` of a sandbox worker's CPU time to the current job.
pub(crate) fn add_remote_cpu(seconds: f64) {
    JOB_REMOTE.with(|c| c.set(c.get() + seconds));
}

pub use forkbox_engine::thread_cpu_seconds;

/// CPU seconds the current exec job has used so far (0 off the exec threads):
/// what a front end charges to a caller's CPU budget when the job's `hold` is
/// dropped (at the end of the job, on its thread).
pub fn job_cpu_seconds() -> f64 {
    let own = JOB_START.with(|s| s.get()).map_or(0.0, |t0| (thread_cpu_seconds() - t0).max(0.0));
    // What session workers used for this job's requests (measured from outside, per worker process).
    add_remote_cpu(forkbox_worker::sessions::take_cpu_seconds());
    own + JOB_REMOTE.with(|c| c.get())
}

/// Jobs waiting for a thread, and the idle threads, most recently idle last.
/// A job goes to the thread that became idle last (LIFO): its caches, its
/// recycled VMs and (with sandbox workers) its worker process are the warmest,
/// where a shared FIFO queue would rotate consecutive execs over every thread.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    idle: Vec<Arc<Handoff>>,
}

/// One idle thread's mailbox.
#[derive(Default)]
struct Handoff {
    job: Mutex<Option<Job>>,
    ready: Condvar,
}

pub(crate) struct ExecWorkers {
    queue: Arc<Mutex<Queue>>,
}

impl ExecWorkers {
    /// `n` threads (at least one), each under the guest-thread seccomp filter
    /// in `seccomp` mode (see `forkbox_engine::jail`), installed before it
    /// takes its first job; fails if a thread cannot install it.
    pub(crate) fn new(n: usize, seccomp: Mode) -> std::io::Result<ExecWorkers> {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let (ready_tx, ready_rx) = channel::<Result<(), String>>();
        let n = n.max(1);
        for i in 0..n {
            let queue = queue.clone();
            let ready = ready_tx.clone();
            std::thread::Builder::new().name(format!("forkbox-exec-{i}")).spawn(move || {
                EXEC_INDEX.with(|x| x.set(i));
                let jailed = forkbox_engine::jail::enter_guest_thread(seccomp).map_err(|e| e.to_string());
                let ok = jailed.is_ok();
                let _ = ready.send(jailed);
                if ok {
                    work(&queue)
                }
            })?;
        }
        for _ in 0..n {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Err(std::io::Error::other("an exec thread ended before it started")),
            }
        }
        Ok(ExecWorkers { queue })
    }

    /// Run `job` on an exec thread. Callers hold an exec slot, so it starts at once.
    pub(crate) fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        match q.idle.pop() {
            Some(h) => {
                drop(q);
                *h.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(job));
                h.ready.notify_one();
            }
            None => q.jobs.push_back(Box::new(job)),
        }
    }

    /// Run `f` on an exec thread and wait for its value.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RuntimeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.spawn(move || {
            let _ = tx.send(f());
        });
        rx.await.map_err(|_| RuntimeError::WorkerGone)
    }
}

/// The next job: a queued one, else wait (as the most recently idle thread) for one.
fn next_job(queue: &Mutex<Queue>, mine: &Arc<Handoff>) -> Job {
    {
        let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = q.jobs.pop_front() {
            return job;
        }
        q.idle.push(mine.clone());
    }
    let mut slot = mine.job.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(job) = slot.take() {
            return job;
        }
        slot = mine.ready.wait(slot).unwrap_or_else(|e| e.into_inner());
    }
}

fn work(queue: &Mutex<Queue>) {
    let mine = Arc::new(Handoff::default());
    forkbox_worker::sessions::charge_jobs_here();
    loop {
        let job = next_job(queue, &mine);
        JOB_START.with(|s| s.set(Some(thread_cpu_seconds())));
        JOB_REMOTE.with(|c| c.set(0.0));
        forkbox_worker::sessions::take_cpu_seconds();
        // A panicking job drops its reply channel (the caller gets `WorkerGone`); the thread goes on.
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("an exec job panicked");
        }
    }
}
