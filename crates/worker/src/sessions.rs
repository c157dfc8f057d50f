//! The API process' side of session workers: sessions' sandboxes
//! in jailed worker processes, one process per tenant, one socket and one
//! worker thread per sandbox.
//!
//! [`SessionWorkers`] is the sessions' `SandboxHost` under
//! `--isolation process`. Why one process per tenant: a compromised worker
//! then holds only its own tenant's sessions (their memory and files, and the
//! checkpoint files of their lineage it is handed), never another tenant's;
//! and within it every sandbox has a thread and a socket of its own, so a
//! long exec never holds up another session (no head-of-line blocking behind
//! a single-threaded worker), and a resident session keeps its vCPU on one
//! thread for its life. Each worker keeps one channel ahead, already on a
//! thread of its own there (opened after a sandbox starts), so a resume's
//! request goes straight to the thread that serves it, not through the
//! worker's control thread first. A worker is started for a tenant's first sandbox (a
//! spare, jailed and with the default template open, is kept ready: starting
//! one takes ~0.2 s here) and stops once it has held nothing for a while.
//!
//! Every descriptor a worker gets comes from this process, opened here: the
//! layers, state and packs of a checkpoint to bring back (read-only), the
//! temp files of a new checkpoint or template; it never names a path of the
//! sessions directory. What it sends back is treated as hostile: frames are
//! capped before anything is allocated, error codes are checked against
//! what each request can fail with, sizes against what was asked, and a
//! worker that breaks the protocol, stops answering or dies takes only its
//! own sandboxes with it: the requests in flight fail with `sandbox_crashed`,
//! its sessions are at their last checkpoints (every call that changes a
//! session ends with one) and come back from disk in a new worker.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use forkbox_api::ErrorCode;
use forkbox_engine::packages::{InstalledPackage, Package};
use forkbox_engine::{
    CapturedOutput, Changes, CheckpointFiles, CheckpointStats, EngineError, ExecOptions, ExecResult, FileEntry, FileOp,
    FileOpOutcome, JobChunk, JobInfo, ListeningPort, Stream, Usage, NET_GLOBAL,
};
use forkbox_sessions::host::{NamedFile, Resident, SandboxHost, Start, Walk, WALK_MAX_ENTRIES};
use forkbox_sessions::manager::SessionError;

use crate::child::JAIL_HOME;
use crate::protocol::{
    self, Bind, FromChannel, PackageRef, ProtocolError, Role, StartFrom, TemplateRef, ToChannel, ToSessions, WireError,
    FDS_PER_FRAME,
};
use crate::supervisor::{
    alive, clock_seconds, cpu_clock, jail_path, launcher, Config, Conn, Job, WorkerError, WorkerInfo, ANSWER_GRACE,
    STREAM_SLACK,
};

/// Codes a worker may report for an exec (anything else becomes `internal`:
/// a worker runs guest input, it does not get to pick, say, `unauthorized`).
pub const EXEC_CODES: &[ErrorCode] = &[
    ErrorCode::Timeout,
    ErrorCode::GuestCrashed,
    ErrorCode::GuestExited,
    ErrorCode::GuestKilled,
    ErrorCode::SandboxUnusable,
    ErrorCode::Interrupted,
    ErrorCode::Deadlock,
    ErrorCode::CodeTooLarge,
    ErrorCode::ProtocolError,
    ErrorCode::BootFailed,
    ErrorCode::CpuMismatch,
    ErrorCode::TemplateUnavailable,
    ErrorCode::Internal,
];

/// Codes of making a sandbox (a fork, or a checkpoint brought back).
const START_CODES: &[ErrorCode] = &[
    ErrorCode::StorageError,
    ErrorCode::CpuMismatch,
    ErrorCode::BootFailed,
    ErrorCode::TemplateUnavailable,
    ErrorCode::ProtocolError,
    ErrorCode::Internal,
];

/// The name an upload's file is handed over under (a `Files` frame before `WriteFile`).
pub(crate) const UPLOAD_FILE: &str = "upload";

/// Codes of a file operation (`EngineError::File`).
const FILE_CODES: &[ErrorCode] = &[
    ErrorCode::StorageError,
    ErrorCode::FileNotFound,
    ErrorCode::InvalidPath,
    ErrorCode::IsADirectory,
    ErrorCode::FileTooLarge,
    ErrorCode::QuotaExceeded,
    ErrorCode::FileExists,
];

/// Codes of mounting packages (`EngineError::Package`).
const PACKAGE_CODES: &[ErrorCode] =
    &[ErrorCode::PackageConflict, ErrorCode::QuotaExceeded, ErrorCode::PackageFailed, ErrorCode::StorageError];

/// Codes of the background jobs' operations.
const JOB_CODES: &[ErrorCode] = &[
    ErrorCode::ProcessNotFound,
    ErrorCode::StdinClosed,
    ErrorCode::StdinFull,
    ErrorCode::InvalidRequest,
    ErrorCode::SandboxUnusable,
    ErrorCode::ProtocolError,
    ErrorCode::Internal,
];

/// Codes of a connection to a port of the sandbox.
const PORT_CODES: &[ErrorCode] = &[
    ErrorCode::PortNotListening,
    ErrorCode::Overloaded,
    ErrorCode::SandboxUnusable,
    ErrorCode::ProtocolError,
    ErrorCode::Internal,
];

/// How long handing a connection to the sandbox may take (the worker takes
/// the request between two background slices of the sandbox).
const PORT_WAIT: Duration = Duration::from_secs(30);

/// Codes of writing a checkpoint or a template.
const WRITE_CODES: &[ErrorCode] = &[ErrorCode::StorageError, ErrorCode::ProtocolError, ErrorCode::Internal];

/// How long making a sandbox may take (a resume reads and applies its layers).
const START_WAIT: Duration = Duration::from_secs(120);
/// How long a file operation, a walk or a checkpoint may take.
const OP_WAIT: Duration = Duration::from_secs(120);
/// A session worker that has held no sandbox this long is stopped.
pub const IDLE_STOP: Duration = Duration::from_secs(120);

thread_local! {
    /// CPU time of session workers charged to the current job (see [`take_cpu_seconds`]).
    static CHARGED: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
    /// This thread runs jobs that are charged (see [`charge_jobs_here`]).
    static CHARGING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Requests made from the calling thread charge the worker's CPU time to the
/// thread's current job ([`take_cpu_seconds`]). Elsewhere (a read of a
/// process' output on another thread ...) the time is left for
/// [`SessionWorkers::take_idle_cpu`], so that no CPU time is taken where no job
/// would pay for it.
pub fn charge_jobs_here() {
    CHARGING.with(|c| c.set(true));
}

/// The CPU seconds session workers used for this thread's requests since the
/// last call (measured from outside: each worker's process CPU clock, the
/// time since the previous request of that worker charged to this one).
pub fn take_cpu_seconds() -> f64 {
    CHARGED.with(|c| c.replace(0.0))
}

fn remote(code: ErrorCode, message: impl Into<String>) -> EngineError {
    EngineError::Remote { code, message: message.into() }
}

/// A worker's failure report as an engine error: its code if `allowed` for the request, else `internal`.
fn reported(e: WireError, allowed: &[ErrorCode]) -> EngineError {
    let code = e.code.parse::<ErrorCode>().ok().filter(|c| allowed.contains(c)).unwrap_or(ErrorCode::Internal);
    if FILE_CODES.contains(&code) && allowed == FILE_CODES {
        return EngineError::File { code, message: e.message };
    }
    if PACKAGE_CODES.contains(&code) && allowed == PACKAGE_CODES {
        return EngineError::Package { code, message: e.message };
    }
    remote(code, e.message)
}

/// One tenant's worker process.
struct TenantWorker {
    /// Global worker index (its uid is the base + this, its cgroup and mount point are named by it).
    index: usize,
    tenant: String,
    pid: u32,
    control: Mutex<UnixStream>,
    /// The egress policy of each of its sandboxes (by channel id), for its broker.
    egress: Arc<crate::broker::Policies>,
    dead: AtomicBool,
    started: SystemTime,
    /// Open channels (sandboxes) and those with a request in flight.
    channels: AtomicUsize,
    busy: AtomicUsize,
    /// The worker's process CPU time already charged.
    cpu_seen: Mutex<f64>,
    last_used: Mutex<Instant>,
    /// A channel already handed to the worker, whose thread there waits on
    /// it: the next sandbox's requests go straight to that thread, without
    /// the hop through the worker's control thread (see [`Inner::channel`]).
    spare_channel: Mutex<Option<(u64, UnixStream)>>,
}

impl TenantWorker {
    fn is_alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst) && alive(&self.control.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The worker's CPU time since the last charge, taken (charged by the caller).
    fn take_cpu(&self) -> f64 {
        let now = clock_seconds(cpu_clock(self.pid));
        let mut seen = self.cpu_seen.lock().unwrap_or_else(|e| e.into_inner());
        let d = (now - *seen).max(0.0);
        *seen = now.max(*seen);
        d
    }

    /// Charge the worker's CPU time since the last charge to this thread's job.
    fn charge(&self) {
        let d = self.take_cpu();
        CHARGED.with(|c| c.set(c.get() + d));
    }

    fn interrupt(&self, id: u64, exec: u64) {
        let sock = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let _ = protocol::write(&mut &*sock, &ToSessions::Interrupt { id, exec });
    }
}

/// A started worker not yet given to a tenant.
enum Spare {
    Pending(usize, Receiver<Result<Conn, WorkerError>>),
    Ready(usize, Conn),
}

#[derive(Default)]
struct State {
    by_tenant: HashMap<String, Arc<TenantWorker>>,
    /// Local indexes (0..max + 1) not in use.
    free: Vec<usize>,
    spare: Option<Spare>,
    /// Per tenant: its workers that died or misbehaved, and how the last one ended.
    exits: HashMap<String, (u64, Option<String>)>,
}

/// Tenants whose worker deaths are remembered for the listing.
const EXITS_KEPT: usize = 1024;

struct Inner {
    config: Arc<Config>,
    binds: Arc<Vec<Bind>>,
    launcher: Mutex<Sender<Job>>,
    /// Session worker `k` is worker `index_base + k` (after the exec workers).
    index_base: usize,
    max_workers: usize,
    state: Mutex<State>,
    /// Held while a worker is given to a tenant (one at a time: no two for one tenant).
    assigning: Mutex<()>,
    next_channel: AtomicU64,
    /// Shut down: no worker is started any more.
    closed: AtomicBool,
}

/// Session workers: the sessions' [`SandboxHost`] under `--isolation process`.
pub struct SessionWorkers {
    inner: Arc<Inner>,
}

impl SessionWorkers {
    /// A launcher for session workers `index_base..index_base + max_workers`
    /// (plus a spare) with `config` (its role is set to sessions), `prepare`
    /// open in each; starts the spare. Call it from a thread without a seccomp filter.
    pub fn start(
        mut config: Config,
        index_base: usize,
        max_workers: usize,
        prepare: Option<TemplateRef>,
    ) -> Result<SessionWorkers, WorkerError> {
        config.role = Role::Sessions;
        let config = Arc::new(config);
        let binds = config.binds();
        for b in &binds {
            if b.jail.starts_with(JAIL_HOME) {
                std::fs::create_dir_all(&b.host)
                    .map_err(|e| WorkerError::Start(format!("creating {}: {e}", b.jail)))?;
            }
        }
        let binds = Arc::new(binds);
        let (tx, rx) = channel::<Job>();
        let (cfg, b) = (config.clone(), binds.clone());
        std::thread::Builder::new()
            .name("forkbox-session-launcher".into())
            .spawn(move || launcher(&cfg, &b, prepare.as_ref(), rx))
            .map_err(|e| WorkerError::Start(format!("the session launcher thread: {e}")))?;
        let max_workers = max_workers.max(1);
        let state = State { free: (0..=max_workers).rev().collect(), ..State::default() };
        let inner = Arc::new(Inner {
            config,
            binds,
            launcher: Mutex::new(tx),
            index_base,
            max_workers,
            state: Mutex::new(state),
            assigning: Mutex::new(()),
            next_channel: AtomicU64::new(1),
            closed: AtomicBool::new(false),
        });
        inner.ensure_spare();
        Ok(SessionWorkers { inner })
    }

    /// The session workers as `GET /v1/admin/workers` shows them (the spare too).
    pub fn list(&self) -> Vec<WorkerInfo> {
        let inner = &self.inner;
        let mut st = inner.lock();
        inner.poll_spare(&mut st);
        let uid = |index: usize| inner.config.uid_base.saturating_add(index as u32);
        let ms = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut out: Vec<WorkerInfo> = st
            .by_tenant
            .values()
            .filter(|w| !w.dead.load(Ordering::SeqCst))
            .map(|w| {
                let (restarts, last_exit) = st.exits.get(&w.tenant).cloned().unwrap_or_default();
                WorkerInfo {
                    index: w.index,
                    kind: "sessions",
                    tenant: Some(w.tenant.clone()),
                    sandboxes: Some(w.channels.load(Ordering::SeqCst)),
                    pid: Some(w.pid),
                    uid: uid(w.index),
                    busy: w.busy.load(Ordering::SeqCst) > 0,
                    restarts,
                    started_unix_ms: Some(ms(w.started)),
                    last_exit,
                }
            })
            .collect();
        if let Some(Spare::Ready(local, conn)) = &st.spare {
            let index = inner.index_base + local;
            out.push(WorkerInfo {
                index,
                kind: "sessions",
                tenant: None,
                sandboxes: Some(0),
                pid: Some(conn.pid),
                uid: uid(index),
                busy: false,
                restarts: 0,
                started_unix_ms: Some(ms(conn.started)),
                last_exit: None,
            });
        }
        out.sort_by_key(|w| w.index);
        out
    }

    /// Stop the workers that have held no sandbox for `idle` (upkeep).
    pub fn stop_idle(&self, idle: Duration) -> usize {
        let inner = &self.inner;
        // (No worker is handed out meanwhile: a handed-out one counts a sandbox at once.)
        let _one = inner.assigning.lock().unwrap_or_else(|e| e.into_inner());
        let idle_ones: Vec<Arc<TenantWorker>> = inner
            .lock()
            .by_tenant
            .values()
            .filter(|w| {
                w.channels.load(Ordering::SeqCst) == 0
                    && w.last_used.lock().unwrap_or_else(|e| e.into_inner()).elapsed() >= idle
            })
            .cloned()
            .collect();
        let n = idle_ones.len();
        for w in idle_ones {
            inner.retire(&w, false);
        }
        drop(_one);
        inner.ensure_spare();
        n
    }

    /// The CPU seconds each tenant's worker used since it was last charged,
    /// taken: the work its sandboxes did between requests (background threads
    /// and processes). A worker with a request in flight is left to that
    /// request, which charges it when it ends.
    pub fn take_idle_cpu(&self) -> Vec<(String, f64)> {
        let workers: Vec<Arc<TenantWorker>> = self.inner.lock().by_tenant.values().cloned().collect();
        workers
            .into_iter()
            .filter(|w| !w.dead.load(Ordering::SeqCst) && w.busy.load(Ordering::SeqCst) == 0)
            .map(|w| (w.tenant.clone(), w.take_cpu()))
            .filter(|(_, s)| *s > 0.0)
            .collect()
    }

    /// Hold (`on`) or let run again the background work of `tenant`'s worker
    /// between requests; requests are served either way. A worker started later
    /// starts unheld: the caller says it again while it holds.
    pub fn throttle(&self, tenant: &str, on: bool) {
        let Some(w) = self.inner.lock().by_tenant.get(tenant).cloned() else { return };
        let sock = w.control.lock().unwrap_or_else(|e| e.into_inner());
        let _ = protocol::write(&mut &*sock, &ToSessions::Throttle { on });
    }

    /// Stop every worker (the tenants' and the spare, started or starting)
    /// and wait until each has exited (killed if it has not within the stop's
    /// grace) and been reaped: their memory, and their share of the binary's
    /// and the template's pages, are the host's again when this returns.
    /// No worker is started after it (a sandbox asked for fails). Dropping
    /// `SessionWorkers` instead lets them exit on their own, later.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        let _one = inner.assigning.lock().unwrap_or_else(|e| e.into_inner());
        inner.closed.store(true, Ordering::SeqCst);
        let workers: Vec<Arc<TenantWorker>> = inner.lock().by_tenant.values().cloned().collect();
        for w in workers {
            inner.retire(&w, false);
        }
        let spare = inner.lock().spare.take();
        let local = match spare {
            Some(Spare::Ready(i, conn)) => {
                // A closed control socket ends a worker quietly.
                drop(conn);
                i
            }
            Some(Spare::Pending(i, rx)) => {
                // Its start ends first (the launcher does one job at a time); then it is closed as above.
                drop(rx.recv());
                i
            }
            None => return,
        };
        inner.stop(local);
        inner.lock().free.push(local);
    }

    /// The host pid of `tenant`'s worker, if it has one now.
    pub fn pid_of(&self, tenant: &str) -> Option<u32> {
        self.inner.lock().by_tenant.get(tenant).filter(|w| w.is_alive()).map(|w| w.pid)
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request_start(&self, local: usize) -> Receiver<Result<Conn, WorkerError>> {
        let (tx, rx) = channel();
        let job = Job::Start { index: self.index_base + local, reply: tx.clone() };
        if self.launcher.lock().unwrap_or_else(|e| e.into_inner()).send(job).is_err() {
            let _ = tx.send(Err(WorkerError::Start("the session launcher thread ended".into())));
        }
        rx
    }

    /// A started spare becomes ready (no wait).
    fn poll_spare(&self, st: &mut State) {
        if let Some(Spare::Pending(i, rx)) = &st.spare {
            match rx.try_recv() {
                Ok(Ok(conn)) => st.spare = Some(Spare::Ready(*i, conn)),
                Ok(Err(e)) => {
                    tracing::warn!("starting a spare session worker: {e}");
                    st.free.push(*i);
                    st.spare = None;
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    st.free.push(*i);
                    st.spare = None;
                }
            }
        }
    }

    /// Stop session worker `local`'s process and wait for it: how it ended.
    fn stop(&self, local: usize) -> Option<String> {
        let (tx, rx) = channel();
        let job = Job::Stop { index: self.index_base + local, reply: tx };
        self.launcher.lock().unwrap_or_else(|e| e.into_inner()).send(job).ok()?;
        rx.recv_timeout(Duration::from_secs(10)).ok().flatten()
    }

    /// Start a spare if there is none and an index is free.
    fn ensure_spare(&self) {
        let mut st = self.lock();
        if st.spare.is_some() || self.closed.load(Ordering::SeqCst) {
            return;
        }
        if let Some(i) = st.free.pop() {
            let rx = self.request_start(i);
            st.spare = Some(Spare::Pending(i, rx));
        }
    }

    /// `tenant`'s worker: its live one, else the spare (or one started now),
    /// with one more sandbox counted (the caller's: a worker holding one is never stopped as idle).
    fn worker_for(&self, tenant: &str) -> Result<Arc<TenantWorker>, EngineError> {
        let crashed = |m: String| remote(ErrorCode::SandboxCrashed, m);
        let _one = self.assigning.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.load(Ordering::SeqCst) {
            return Err(remote(ErrorCode::Overloaded, "the session workers are shut down"));
        }
        let existing = self.lock().by_tenant.get(tenant).cloned();
        if let Some(w) = existing {
            if w.is_alive() {
                w.channels.fetch_add(1, Ordering::SeqCst);
                return Ok(w);
            }
            // It died while idle: replaced now, not charged to this request.
            self.retire(&w, true);
        }
        let spare = {
            let mut st = self.lock();
            match st.spare.take() {
                Some(s) => Some(s),
                None => st.free.pop().map(|i| Spare::Pending(i, self.request_start(i))),
            }
        };
        let spare = match spare {
            Some(s) => s,
            None => {
                // Every index is in use: stop the least recently used worker holding no request.
                let victim = {
                    let st = self.lock();
                    st.by_tenant
                        .values()
                        .filter(|w| w.busy.load(Ordering::SeqCst) == 0)
                        .min_by_key(|w| {
                            let holds = w.channels.load(Ordering::SeqCst) > 0;
                            (holds, *w.last_used.lock().unwrap_or_else(|e| e.into_inner()))
                        })
                        .cloned()
                };
                let Some(v) = victim else {
                    return Err(remote(
                        ErrorCode::Overloaded,
                        format!("all {} session workers are busy; retry", self.max_workers),
                    ));
                };
                tracing::info!(tenant = %v.tenant, "stopping the least recently used session worker for another tenant");
                self.retire(&v, false);
                let mut st = self.lock();
                let Some(i) = st.free.pop() else {
                    return Err(remote(ErrorCode::Overloaded, "no session worker is free; retry"));
                };
                Spare::Pending(i, self.request_start(i))
            }
        };
        let (local, conn) = match spare {
            Spare::Ready(i, c) => (i, c),
            Spare::Pending(i, rx) => match rx.recv() {
                Ok(Ok(c)) => (i, c),
                Ok(Err(e)) => {
                    self.lock().free.push(i);
                    return Err(crashed(e.to_string()));
                }
                Err(_) => {
                    self.lock().free.push(i);
                    return Err(crashed("could not be started (the launcher thread ended)".into()));
                }
            },
        };
        let cpu = clock_seconds(cpu_clock(conn.pid));
        let w = Arc::new(TenantWorker {
            index: self.index_base + local,
            tenant: tenant.to_string(),
            pid: conn.pid,
            control: Mutex::new(conn.sock),
            egress: conn.egress,
            dead: AtomicBool::new(false),
            started: conn.started,
            channels: AtomicUsize::new(1),
            busy: AtomicUsize::new(0),
            cpu_seen: Mutex::new(cpu),
            last_used: Mutex::new(Instant::now()),
            spare_channel: Mutex::new(None),
        });
        self.lock().by_tenant.insert(tenant.to_string(), w.clone());
        tracing::debug!(tenant, pid = w.pid, index = w.index, "a session worker for a tenant");
        drop(_one);
        self.ensure_spare();
        Ok(w)
    }

    /// The worker goes: marked dead, out of the map, its process stopped
    /// (killed if it does not end by itself) and its index free again.
    /// `crashed`: it died or misbehaved (counted as a restart). How it ended.
    fn retire(&self, w: &TenantWorker, crashed: bool) -> Option<String> {
        if w.dead.swap(true, Ordering::SeqCst) {
            return None;
        }
        {
            let mut st = self.lock();
            if st.by_tenant.get(&w.tenant).is_some_and(|x| std::ptr::eq(Arc::as_ptr(x), w)) {
                st.by_tenant.remove(&w.tenant);
            }
        }
        // A closed control socket ends a worker quietly.
        let _ = w.control.lock().unwrap_or_else(|e| e.into_inner()).shutdown(std::net::Shutdown::Both);
        let how = self.stop(w.index - self.index_base);
        let mut st = self.lock();
        if crashed {
            if st.exits.len() >= EXITS_KEPT && !st.exits.contains_key(&w.tenant) {
                if let Some(k) = st.exits.keys().next().cloned() {
                    st.exits.remove(&k);
                }
            }
            let e = st.exits.entry(w.tenant.clone()).or_default();
            e.0 += 1;
            e.1 = how.clone();
        }
        st.free.push(w.index - self.index_base);
        how
    }

    /// `w` is dead, hung or speaking nonsense (`e`): it goes, with every
    /// sandbox it held (their sessions are at their last checkpoints).
    fn lose(&self, w: &TenantWorker, e: ProtocolError) -> EngineError {
        let how = match self.retire(w, true) {
            _ if e.is_timeout() => "stopped answering (killed)".to_string(),
            Some(x) if e.is_closed() => x,
            _ => format!("broke the protocol ({e}) and was killed"),
        };
        tracing::warn!(pid = w.pid, tenant = %w.tenant, "session worker lost: {how}");
        remote(ErrorCode::SandboxCrashed, format!("the sandbox worker {how}"))
    }

    /// A new channel to `w`: its socket handed over on the control socket
    /// (the worker gives it a thread of its own), and its id.
    fn open_channel(&self, w: &TenantWorker) -> Result<(u64, UnixStream), ProtocolError> {
        let (ours, theirs) = UnixStream::pair()?;
        let id = self.next_channel.fetch_add(1, Ordering::Relaxed);
        let control = w.control.lock().unwrap_or_else(|e| e.into_inner());
        protocol::write_fds(&control, &ToSessions::Channel { id }, &[theirs.as_fd()])?;
        Ok((id, ours))
    }

    /// A channel to `w` for a new sandbox: its spare one (already served by
    /// a thread there), else one opened now.
    fn channel(&self, w: &TenantWorker) -> Result<(u64, UnixStream), ProtocolError> {
        let spare = w.spare_channel.lock().unwrap_or_else(|e| e.into_inner()).take();
        match spare {
            Some(c) => Ok(c),
            None => self.open_channel(w),
        }
    }

    /// Give `w` a spare channel for its next sandbox, if it has none (after a
    /// start, off that start's path: the worker hands it to a thread while
    /// the caller goes on). A failure is left to the next start to find.
    fn refill_channel(&self, w: &TenantWorker) {
        let mut spare = w.spare_channel.lock().unwrap_or_else(|e| e.into_inner());
        if spare.is_none() && !w.dead.load(Ordering::SeqCst) {
            *spare = self.open_channel(w).ok();
        }
    }

    /// A template as the workers see it.
    fn template_ref(&self, image: &Path, dir: &Path) -> Result<TemplateRef, EngineError> {
        let unreachable = || remote(ErrorCode::TemplateUnavailable, "the template is outside what the workers can see");
        let image = jail_path(&self.binds, image).ok_or_else(unreachable)?;
        let dir = jail_path(&self.binds, dir).ok_or_else(unreachable)?;
        Ok(TemplateRef { image, dir })
    }
}

impl SandboxHost for SessionWorkers {
    fn start(&self, s: Start<'_>) -> Result<Box<dyn Resident>, SessionError> {
        let inner = &self.inner;
        let tref = inner.template_ref(&s.template.engine.image_path, &s.template.template.dir)?;
        // (Counts this sandbox: dropping `rs` below gives it back.)
        let worker = inner.worker_for(s.tenant)?;
        let (id, ours) = match inner.channel(&worker) {
            Ok(c) => c,
            Err(e) => {
                worker.channels.fetch_sub(1, Ordering::SeqCst);
                return Err(inner.lose(&worker, e).into());
            }
        };
        *worker.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        let (timeout, output_bytes) = (s.limits.timeout, s.limits.output_bytes);
        let rs = RemoteSandbox {
            inner: inner.clone(),
            worker,
            sock: ours,
            id,
            execs: 0,
            exec_id: None,
            failed_output: None,
            broken: false,
            timeout,
            output_bytes,
            background: false,
        };
        rs.start(tref, s)
    }

    fn kind(&self) -> &'static str {
        "process"
    }
}

/// A sandbox in a session worker: one socket to its thread there.
struct RemoteSandbox {
    inner: Arc<Inner>,
    worker: Arc<TenantWorker>,
    sock: UnixStream,
    id: u64,
    /// Execs sent on this channel (an interrupt names one).
    execs: u64,
    exec_id: Option<i64>,
    failed_output: Option<CapturedOutput>,
    /// The worker broke the protocol or went away: nothing more is sent.
    broken: bool,
    /// The sandbox's own time limit (an exec without one of its own).
    timeout: Duration,
    /// Its output limit per stream (what an exec can stream).
    output_bytes: usize,
    /// Its last exec left threads or processes running (the worker runs them between calls).
    background: bool,
}

impl Drop for RemoteSandbox {
    fn drop(&mut self) {
        // Closing the socket ends the sandbox's thread there (the sandbox is dropped on it).
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.worker.egress.unregister(self.id);
        self.worker.channels.fetch_sub(1, Ordering::SeqCst);
        *self.worker.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }
}

/// Busy while a request is in flight; charges the worker's CPU time after it.
struct InFlight<'a>(&'a TenantWorker);

impl<'a> InFlight<'a> {
    fn new(w: &'a TenantWorker) -> InFlight<'a> {
        w.busy.fetch_add(1, Ordering::SeqCst);
        InFlight(w)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
        *self.0.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if CHARGING.with(|c| c.get()) {
            self.0.charge();
        }
    }
}

fn unexpected(f: &FromChannel) -> ProtocolError {
    ProtocolError::Io(std::io::Error::other(format!("sent an unexpected {} frame", f.kind())))
}

impl RemoteSandbox {
    /// The worker is dead, hung or speaking nonsense: it goes (with every
    /// sandbox it held: their sessions are at their last checkpoints).
    fn lost(&mut self, e: ProtocolError) -> EngineError {
        self.broken = true;
        self.inner.lose(&self.worker, e)
    }

    fn check(&self) -> Result<(), EngineError> {
        if self.broken || self.worker.dead.load(Ordering::SeqCst) {
            return Err(remote(ErrorCode::SandboxCrashed, "the sandbox worker is gone"));
        }
        Ok(())
    }

    fn send(&mut self, msg: &ToChannel) -> Result<(), EngineError> {
        self.check()?;
        protocol::write(&mut &self.sock, msg).map_err(|e| self.lost(e))
    }

    fn recv(&mut self, wait: Duration) -> Result<FromChannel, EngineError> {
        let _ = self.sock.set_read_timeout(Some(wait));
        protocol::read::<FromChannel>(&mut &self.sock).map_err(|e| self.lost(e))
    }

    /// Files for the next request, in frames of at most `FDS_PER_FRAME`.
    fn send_files(&mut self, files: &[NamedFile]) -> Result<(), EngineError> {
        self.check()?;
        for chunk in files.chunks(FDS_PER_FRAME) {
            let names = chunk.iter().map(|f| f.name.clone()).collect();
            let fds: Vec<_> = chunk.iter().map(|f| f.file.as_fd()).collect();
            protocol::write_fds(&self.sock, &ToChannel::Files { names }, &fds).map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// A request answered by one frame.
    fn call(&mut self, msg: &ToChannel, wait: Duration) -> Result<FromChannel, EngineError> {
        let worker = self.worker.clone();
        let _busy = InFlight::new(&worker);
        self.send(msg)?;
        self.recv(wait)
    }

    fn broke(&mut self, f: &FromChannel) -> EngineError {
        let e = unexpected(f);
        self.lost(e)
    }

    fn start(mut self, template: TemplateRef, s: Start<'_>) -> Result<Box<dyn Resident>, SessionError> {
        let worker = self.worker.clone();
        let _busy = InFlight::new(&worker);
        let Start { limits, how, from, .. } = s;
        let (from, mut packs) = match from {
            None => (None, None),
            Some(c) => {
                let mut files = c.layers;
                let layers = files.iter().map(|f| f.name.clone()).collect();
                let state = c.state.name.clone();
                files.push(c.state);
                self.send_files(&files)?;
                (Some(StartFrom { layers, state }), Some(c.packs))
            }
        };
        // The broker gets the policy from here, never from the worker.
        self.worker.egress.register(self.id, limits.network.clone());
        // The sealed secrets stay here: the broker substitutes them, the worker never sees them.
        let limits = forkbox_engine::Limits { network: limits.network.for_worker(), ..limits };
        self.send(&ToChannel::Start { template, limits, how, from })?;
        let mut refused: Option<SessionError> = None;
        loop {
            match self.recv(START_WAIT)? {
                FromChannel::NeedPacks(names) => {
                    let ok_names = names.len() <= 4096
                        && names.iter().all(|n| forkbox_snapshot::files::valid_pack_name(n))
                        && refused.is_none();
                    let opened = match (&mut packs, ok_names) {
                        (Some(open), true) => open(&names),
                        _ => Err(SessionError::Invalid("packs asked for out of place".into())),
                    };
                    match opened {
                        Ok(files) => {
                            self.send_files(&files)?;
                            self.send(&ToChannel::Packs)?;
                        }
                        Err(e) => {
                            self.send(&ToChannel::Abort { message: e.to_string() })?;
                            refused = Some(e);
                        }
                    }
                }
                FromChannel::Started(Ok(())) => {
                    self.inner.refill_channel(&self.worker);
                    return Ok(Box::new(self));
                }
                FromChannel::Started(Err(e)) => {
                    return Err(refused.unwrap_or_else(|| SessionError::Engine(reported(e, START_CODES))));
                }
                FromChannel::Refused(m) => return Err(remote(ErrorCode::Overloaded, m).into()),
                other => return Err(self.broke(&other).into()),
            }
        }
    }
}

impl Resident for RemoteSandbox {
    fn exec(&mut self, code: &str, opts: ExecOptions<'_>) -> Result<ExecResult, EngineError> {
        self.failed_output = None;
        self.execs += 1;
        let exec = self.execs;
        let ExecOptions { mut on_output, interrupt, timeout, job, prelude } = opts;
        let worker = self.worker.clone();
        let _busy = InFlight::new(&worker);
        if let Some(i) = &interrupt {
            let (w, id) = (self.worker.clone(), self.id);
            i.forward(Some(Arc::new(move || w.interrupt(id, exec))));
        }
        let req = ToChannel::Exec {
            code: code.to_string(),
            exec,
            exec_id: self.exec_id.take(),
            timeout_ms: timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            stream: on_output.is_some(),
            interrupted: interrupt.as_ref().is_some_and(|i| i.is_pending()),
            job,
            prelude: prelude.map(str::to_string),
        };
        let wait = timeout.unwrap_or(self.timeout).saturating_add(ANSWER_GRACE);
        // The engine streams at most what it captures (the output limit per
        // stream, plus a truncation note): more is a worker gone wrong.
        let stream_max = self.output_bytes.saturating_mul(2).saturating_add(STREAM_SLACK);
        let mut streamed = 0usize;
        let answered = (|| -> Result<Box<protocol::SessionDone>, EngineError> {
            self.send(&req)?;
            loop {
                match self.recv(wait)? {
                    FromChannel::Output { stream, data } => {
                        streamed = streamed.saturating_add(data.len());
                        if streamed > stream_max {
                            let e = ProtocolError::Io(std::io::Error::other(format!(
                                "streamed more than the {stream_max} bytes an exec can"
                            )));
                            return Err(self.lost(e));
                        }
                        if let Some(f) = on_output.as_mut() {
                            f(stream, &data);
                        }
                    }
                    FromChannel::Executed(done) => return Ok(done),
                    other => return Err(self.broke(&other)),
                }
            }
        })();
        if let Some(i) = &interrupt {
            i.forward(None);
        }
        let done = answered?;
        NET_GLOBAL.add(done.net);
        self.background = done.background;
        match done.result {
            Ok(r) => Ok(r),
            Err(e) => {
                self.failed_output = e.output.clone();
                Err(reported(e, EXEC_CODES))
            }
        }
    }

    fn set_exec_id(&mut self, n: i64) {
        self.exec_id = Some(n);
    }

    fn take_failed_output(&mut self) -> Option<CapturedOutput> {
        self.failed_output.take()
    }

    fn write_file(&mut self, path: &str, src: &std::fs::File, len: u64) -> Result<(), EngineError> {
        // The bytes go as the upload file's descriptor: the worker reads them
        // straight into the sandbox's file (nothing is copied through this process).
        self.check()?;
        let names = vec![UPLOAD_FILE.to_string()];
        protocol::write_fds(&self.sock, &ToChannel::Files { names }, &[src.as_fd()]).map_err(|e| self.lost(e))?;
        match self.call(&ToChannel::WriteFile { path: path.to_string(), len }, OP_WAIT)? {
            FromChannel::Done(r) => r.map_err(|e| reported(e, FILE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn read_file(&mut self, path: &str, max: usize) -> Result<Vec<u8>, EngineError> {
        match self.call(&ToChannel::ReadFile { path: path.to_string(), max: max as u64 }, OP_WAIT)? {
            FromChannel::File(Ok(b)) if b.0.len() <= max => Ok(b.0),
            FromChannel::File(Err(e)) => Err(reported(e, FILE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn list_dir(&mut self, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        match self.call(&ToChannel::ListDir { path: path.to_string() }, OP_WAIT)? {
            FromChannel::Listing(r) => r.map_err(|e| reported(e, FILE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn file_op(&mut self, op: &FileOp) -> Result<FileOpOutcome, EngineError> {
        match self.call(&ToChannel::FileOp(op.clone()), OP_WAIT)? {
            // The worker's walk is bounded as the engine bounds it; a longer one is not its answer.
            FromChannel::FileOpDone(Ok(FileOpOutcome::Entries(es)))
                if es.len() > forkbox_engine::file_ops::WALK_MAX_ENTRIES =>
            {
                Err(self.broke(&FromChannel::FileOpDone(Ok(FileOpOutcome::Entries(es)))))
            }
            FromChannel::FileOpDone(r) => r.map_err(|e| reported(e, FILE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn install_packages(&mut self, packages: &[Package]) -> Result<Vec<InstalledPackage>, EngineError> {
        let refs = packages
            .iter()
            .map(|p| PackageRef {
                name: p.name.clone(),
                version: p.version.clone(),
                wheel: p.wheel.clone(),
                sha256: p.sha256.clone(),
                size: p.size,
            })
            .collect();
        match self.call(&ToChannel::Install { packages: refs }, OP_WAIT)? {
            FromChannel::Installed(Ok(done)) if done.len() == packages.len() => Ok(done),
            FromChannel::Installed(Err(e)) => Err(reported(e, PACKAGE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn walk(&mut self) -> Result<Walk, EngineError> {
        match self.call(&ToChannel::Walk, OP_WAIT)? {
            FromChannel::Walked(Ok(w)) if w.files.len() <= WALK_MAX_ENTRIES => Ok(w),
            FromChannel::Walked(Err(e)) => Err(reported(e, WRITE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn checkpoint(
        &mut self,
        pack_name: &str,
        admit: &mut dyn FnMut(forkbox_engine::CheckpointSize) -> Result<CheckpointFiles, SessionError>,
    ) -> Result<CheckpointStats, SessionError> {
        let size = match self.call(&ToChannel::Checkpoint { pack_name: pack_name.to_string() }, OP_WAIT)? {
            FromChannel::CheckpointSize(size) => size,
            FromChannel::Checkpointed(Err(e)) => return Err(reported(e, WRITE_CODES).into()),
            other => return Err(self.broke(&other).into()),
        };
        let files = match admit(size) {
            Ok(f) => f,
            Err(e) => {
                self.send(&ToChannel::Abort { message: e.to_string() })?;
                return Err(e);
            }
        };
        let CheckpointFiles { layer, pack, procs, state } = files;
        let mut named = vec![NamedFile { name: "layer".into(), file: layer }];
        if let Some(p) = pack {
            named.push(NamedFile { name: "pack".into(), file: p });
        }
        if let Some(p) = procs {
            named.push(NamedFile { name: "procs".into(), file: p });
        }
        named.push(NamedFile { name: "state".into(), file: state });
        let worker = self.worker.clone();
        let _busy = InFlight::new(&worker);
        self.send_files(&named)?;
        // Ours are closed at once: the manager keeps its own handles.
        drop(named);
        self.send(&ToChannel::CheckpointGo)?;
        match self.recv(OP_WAIT)? {
            FromChannel::Checkpointed(Ok(stats)) => Ok(stats),
            FromChannel::Checkpointed(Err(e)) => Err(reported(e, WRITE_CODES).into()),
            other => Err(self.broke(&other).into()),
        }
    }

    fn snapshot_template(
        &mut self,
        id: &str,
        preload: &str,
        memory: &mut std::fs::File,
        state: &mut std::fs::File,
    ) -> Result<(), EngineError> {
        let dup = |f: &std::fs::File| f.try_clone().map_err(|e| remote(ErrorCode::Internal, format!("dup: {e}")));
        let named = vec![
            NamedFile { name: "memory".into(), file: dup(memory)? },
            NamedFile { name: "state".into(), file: dup(state)? },
        ];
        self.send_files(&named)?;
        drop(named);
        match self.call(&ToChannel::Snapshot { id: id.to_string(), preload: preload.to_string() }, OP_WAIT)? {
            FromChannel::Done(r) => r.map_err(|e| reported(e, WRITE_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn is_alive(&self) -> bool {
        !self.broken && self.worker.is_alive()
    }

    fn has_background(&self) -> bool {
        self.background && self.is_alive()
    }

    fn jobs(&mut self) -> Result<Vec<JobInfo>, EngineError> {
        match self.call(&ToChannel::Jobs, OP_WAIT)? {
            FromChannel::Jobs(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn listening_ports(&mut self) -> Result<Vec<ListeningPort>, EngineError> {
        match self.call(&ToChannel::ListeningPorts, OP_WAIT)? {
            FromChannel::ListeningPorts(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_output(&mut self, pid: u32, stream: Stream, offset: u64, max: usize) -> Result<JobChunk, EngineError> {
        let req = ToChannel::JobOutput { pid, stream, offset, max: max as u64 };
        match self.call(&req, OP_WAIT)? {
            FromChannel::JobOutput(Ok(c)) if c.data.len() <= max => {
                Ok(JobChunk { offset: c.offset, end: c.end, data: c.data, running: c.running })
            }
            FromChannel::JobOutput(Err(e)) => Err(reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_signal(&mut self, pid: u32, signal: i32) -> Result<JobInfo, EngineError> {
        match self.call(&ToChannel::JobSignal { pid, signal }, OP_WAIT)? {
            FromChannel::Job(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_wait(&mut self, pid: u32, timeout: Duration) -> Result<JobInfo, EngineError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.call(&ToChannel::JobWait { pid, timeout_ms }, timeout.saturating_add(OP_WAIT))? {
            FromChannel::Job(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn connect_port(&mut self, port: u16, conn: std::os::fd::OwnedFd) -> Result<(), EngineError> {
        self.check()?;
        let worker = self.worker.clone();
        let _busy = InFlight::new(&worker);
        // The worker gets its end of the pair with the request (the API process keeps the other).
        protocol::write_fds(&self.sock, &ToChannel::ConnectPort { port }, &[conn.as_fd()]).map_err(|e| self.lost(e))?;
        drop(conn);
        match self.recv(PORT_WAIT)? {
            FromChannel::PortConnected(r) => r.map_err(|e| reported(e, PORT_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_watch(&mut self, pid: u32, offsets: [u64; 2], timeout: Duration) -> Result<JobInfo, EngineError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.call(&ToChannel::JobWatch { pid, offsets, timeout_ms }, timeout.saturating_add(OP_WAIT))? {
            FromChannel::Job(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_stdin(&mut self, pid: u32, data: &[u8], eof: bool) -> Result<JobInfo, EngineError> {
        match self.call(&ToChannel::JobStdin { pid, data: data.to_vec(), eof }, OP_WAIT)? {
            FromChannel::Job(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn job_resize(&mut self, pid: u32, rows: u16, cols: u16) -> Result<JobInfo, EngineError> {
        match self.call(&ToChannel::JobResize { pid, rows, cols }, OP_WAIT)? {
            FromChannel::Job(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn fs_watch(&mut self, since: Option<u64>, timeout: Duration) -> Result<Option<Changes>, EngineError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.call(&ToChannel::FsWatch { since, timeout_ms }, timeout.saturating_add(OP_WAIT))? {
            FromChannel::FsChanges(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }

    fn usage(&mut self) -> Result<Usage, EngineError> {
        match self.call(&ToChannel::Usage, OP_WAIT)? {
            FromChannel::Usage(r) => r.map_err(|e| reported(e, JOB_CODES)),
            other => Err(self.broke(&other)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A session worker that says it started, then reads control frames until the socket closes.
    const FAKE: &str = r#"#!/usr/bin/env python3
import os, struct
sock = os.fdopen(3, "r+b", buffering=0)
def read():
    head = sock.read(4)
    if len(head) < 4:
        raise SystemExit(0)
    return sock.read(struct.unpack("<I", head)[0])
def write(b):
    sock.write(struct.pack("<I", len(b)) + b)
read()
write(b'{"Started": {"pid": %d}}' % os.getpid())
write(b'"Ready"')
while True:
    read()
"#;

    fn running(pid: u32) -> bool {
        // A zombie keeps its /proc entry until it is reaped.
        Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn shutdown_returns_once_every_worker_has_exited_and_been_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("fake-session-worker");
        std::fs::write(&exe, FAKE).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut config = Config::new(dir.path());
        config.exe = exe;
        config.jail = false;
        let workers = SessionWorkers::start(config, 0, 4, None).unwrap();
        // A tenant's worker (the spare, given away), and the spare started in its place.
        let tenant = workers.inner.worker_for("t").unwrap();
        let t0 = Instant::now();
        let pids = loop {
            let pids: Vec<u32> = workers.list().iter().filter_map(|w| w.pid).collect();
            if pids.len() == 2 || t0.elapsed() > Duration::from_secs(20) {
                break pids;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(pids.len(), 2, "{:?}", workers.list());
        assert!(pids.contains(&tenant.pid));
        for pid in &pids {
            assert!(running(*pid), "worker {pid} is not running");
        }
        workers.shutdown();
        for pid in &pids {
            assert!(!running(*pid), "worker {pid} is still there");
        }
        assert!(workers.list().is_empty(), "{:?}", workers.list());
        // None is started after it.
        assert!(workers.inner.worker_for("u").is_err());
        assert!(workers.list().is_empty(), "{:?}", workers.list());
    }
}
