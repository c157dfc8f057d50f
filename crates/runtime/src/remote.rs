//! One-shot execs in sandbox worker processes (`Isolation::Process`, see
//! `forkbox_worker`): the exec thread that holds the job hands it to its own
//! worker and waits; the worker's CPU time is charged to the job, its network
//! counters added to this process'.

use forkbox_api::ErrorCode;
use forkbox_engine::{EngineError, NET_GLOBAL};
use forkbox_worker::{WireError, WorkerError, Workers, EXEC_CODES};

use crate::exec::{OneShot, OneShotRequest, Output};
use crate::workers::{add_remote_cpu, exec_index};
use crate::RuntimeError;
use forkbox_sessions::manager::random_id;

/// How execs are isolated from the API process. The default is the jailed
/// worker processes (what `forkbox serve` runs); `Thread` is for a runtime
/// embedded in an unprivileged program (the CLI) and for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// On the exec threads of this process (under their seccomp filter).
    Thread,
    /// One-shot execs and batches in jailed sandbox worker processes, one per
    /// exec thread; sessions (and the tree of states) in jailed session
    /// workers, one per tenant.
    Process(ProcessIsolation),
}

impl Default for Isolation {
    fn default() -> Self {
        Isolation::Process(ProcessIsolation::default())
    }
}

/// The bounds of sandbox worker processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessIsolation {
    /// Each worker's memory bound (its cgroup), MiB.
    pub memory_mb: u64,
    /// Host uid (and gid) of worker 0; worker `i` runs as this + `i` (the
    /// exec workers first, then the session workers).
    pub uid_base: u32,
    /// Most session workers at once (one per tenant with sandboxes; the least
    /// recently used idle one is stopped for a new tenant past it).
    pub session_workers: usize,
}

impl Default for ProcessIsolation {
    fn default() -> Self {
        ProcessIsolation {
            memory_mb: 4096,
            uid_base: forkbox_worker::supervisor::DEFAULT_UID_BASE,
            session_workers: DEFAULT_SESSION_WORKERS,
        }
    }
}

/// Default [`ProcessIsolation::session_workers`].
pub const DEFAULT_SESSION_WORKERS: usize = 64;

fn engine_error(e: WireError) -> RuntimeError {
    // A worker runs guest input: it does not get to pick, say, `unauthorized`.
    let code = e.code.parse::<ErrorCode>().ok().filter(|c| EXEC_CODES.contains(c)).unwrap_or(ErrorCode::Internal);
    RuntimeError::exec(EngineError::Remote { code, message: e.message }, e.output)
}

/// After replying: wait for this exec thread's worker to tear the fork down.
pub(crate) fn settle(w: &Workers) {
    w.settle(exec_index());
}

/// Fork `req`'s template and run its code on this exec thread's worker.
pub(crate) fn exec(
    w: &Workers,
    req: &OneShotRequest,
    output: &mut Option<Box<dyn Output>>,
) -> Result<OneShot, RuntimeError> {
    let ran = (|| {
        let t = w.template_ref(&req.template.engine.image_path, &req.template.template.dir)?;
        match output.as_mut() {
            Some(out) => {
                let mut sink = |s, b: &[u8]| out.chunk(s, b);
                w.exec_after(exec_index(), &t, req.prelude.as_deref(), &req.code, &req.limits, Some(&mut sink))
            }
            None => w.exec_after(exec_index(), &t, req.prelude.as_deref(), &req.code, &req.limits, None),
        }
    })();
    if let Some(out) = output.as_mut() {
        out.end();
    }
    let remote = ran?;
    add_remote_cpu(remote.cpu_seconds);
    NET_GLOBAL.add(remote.net);
    match remote.result {
        Ok(result) => Ok(OneShot { result, id: random_id("x_"), fork_ms: remote.fork_ms, exec_ms: remote.exec_ms }),
        Err(e) => Err(engine_error(e)),
    }
}

impl From<WorkerError> for RuntimeError {
    fn from(e: WorkerError) -> RuntimeError {
        RuntimeError::Worker(e)
    }
}
