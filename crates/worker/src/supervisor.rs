//! The API process' side: one jailed worker process per exec thread (slot),
//! started by a launcher thread that has no seccomp filter (the exec threads
//! may not fork or exec), restarted when it dies.
//!
//! Why one worker per exec thread: the engine keeps recycled VMs per thread,
//! so a long-lived worker behind each exec thread keeps forks warm the way the
//! in-process threads did, an exec thread never waits for another's worker,
//! and a worker's death takes only the one exec it was running.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use forkbox_engine::sandbox::OutputSink;
use forkbox_engine::{ExecResult, Limits};

use crate::broker::Policies;
use crate::child::{EGRESS_FD, JAIL_HOME, SOCKET_FD};
use crate::protocol::{
    self, Bind, Done, FromWorker, Hello, NetDelta, Role, TemplateRef, ToSessions, ToWorker, WireError,
};

/// How the supervisor starts workers.
#[derive(Clone, Debug)]
pub struct Config {
    /// The forkbox binary (`/proc/self/exe`): run as `<exe> __worker`.
    pub exe: PathBuf,
    /// The data directory: its `images`, `templates` and `packages` are bound
    /// read-only into each worker; `run/` holds the workers' empty mount points.
    pub home: PathBuf,
    /// Image files outside `home/images` (an `--image PATH`), bound one by one.
    pub extra_images: Vec<PathBuf>,
    /// Worker `i` runs as host uid/gid `uid_base + i`.
    pub uid_base: u32,
    /// Each worker's memory bound (its cgroup), bytes.
    pub memory_bytes: u64,
    /// Each worker's task bound.
    pub max_tasks: u64,
    /// Workers in empty network namespaces (see `protocol::Hello::own_network`).
    pub own_network: bool,
    /// The workers' seccomp filter mode.
    pub seccomp: forkbox_engine::jail::Mode,
    /// False: no namespaces or uid change (protocol tests only).
    pub jail: bool,
    /// See `protocol::TEST_FORBIDDEN_SYSCALL`.
    pub test_actions: bool,
    /// One-shot execs or a tenant's sessions.
    pub role: Role,
    /// Each worker's largest writable file (RLIMIT_FSIZE).
    pub max_file_bytes: u64,
}

impl Config {
    /// What each worker's jail shows, read-only: the data directory's
    /// `images`, `templates` and `packages` under `/home`, extra images under `/extra`.
    pub fn binds(&self) -> Vec<Bind> {
        let mut binds: Vec<Bind> = ["images", "templates", "packages"]
            .into_iter()
            .map(|d| Bind { host: self.home.join(d), jail: format!("{JAIL_HOME}/{d}") })
            .collect();
        for (i, img) in self.extra_images.iter().enumerate() {
            binds.push(Bind { host: img.clone(), jail: format!("/extra/{i}.img") });
        }
        binds
    }

    /// A template as the workers see it (its image and directory must be under a bind).
    pub fn template_ref(&self, image: &Path, dir: &Path) -> Result<TemplateRef, WorkerError> {
        let binds = self.binds();
        let image = jail_path(&binds, image).ok_or(WorkerError::Unreachable)?;
        let dir = jail_path(&binds, dir).ok_or(WorkerError::Unreachable)?;
        Ok(TemplateRef { image, dir })
    }

    pub fn new(home: &Path) -> Config {
        Config {
            exe: PathBuf::from("/proc/self/exe"),
            home: home.to_path_buf(),
            extra_images: Vec::new(),
            uid_base: DEFAULT_UID_BASE,
            memory_bytes: 4 << 30,
            max_tasks: 256,
            own_network: true,
            seccomp: forkbox_engine::jail::Mode::Enforce,
            jail: true,
            test_actions: false,
            role: Role::Exec,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
        }
    }
}

/// A worker writes no file larger than this (RLIMIT_FSIZE): above the largest
/// checkpoint layer of a 4 GiB guest (~5.3 GiB at worst), a 4 GiB shared-memory
/// object and a pack of a 1 GiB overlay.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 8 << 30;

/// Host uids of the workers start here (a range no account of a usual host uses).
pub const DEFAULT_UID_BASE: u32 = 900_000;

/// Streamed bytes beyond twice the output limit a worker may send (truncation notes).
pub(crate) const STREAM_SLACK: usize = 64 << 10;

/// How long a new worker may take to jail itself and open the default template.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Beyond an exec's own time limit, how long a worker may take to answer
/// (opening a template first) before it is declared hung and killed.
pub(crate) const ANSWER_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The worker died or stopped answering; the exec it held is lost.
    #[error("the sandbox worker {0}")]
    Crashed(String),
    #[error("starting a sandbox worker: {0}")]
    Start(String),
    #[error("the template is outside what the workers can see")]
    Unreachable,
}

/// One exec as a worker ran it.
#[derive(Debug)]
pub struct Remote {
    pub result: Result<ExecResult, WireError>,
    pub fork_ms: f64,
    pub exec_ms: f64,
    /// CPU time the worker process used for it, measured from outside.
    pub cpu_seconds: f64,
    pub net: NetDelta,
}

/// A worker as `GET /v1/admin/workers` shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WorkerInfo {
    pub index: usize,
    /// "exec" (one-shot execs, one per exec thread) or "sessions" (one tenant's sessions).
    pub kind: &'static str,
    /// A session worker's tenant (None: a spare, ready for the next tenant).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// A session worker's sandboxes (resident sessions and throwaway forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<usize>,
    /// Host pid of the jailed worker (None: being restarted).
    pub pid: Option<u32>,
    pub uid: u32,
    pub busy: bool,
    pub restarts: u64,
    pub started_unix_ms: Option<u64>,
    /// How the previous worker of this slot ended, if one did.
    pub last_exit: Option<String>,
}

pub(crate) struct Conn {
    pub(crate) sock: UnixStream,
    pub(crate) pid: u32,
    pub(crate) started: SystemTime,
    /// The egress policy of each of the worker's sandboxes, for its broker
    /// (a thread of this process serving the worker's second socket).
    pub(crate) egress: Arc<Policies>,
}

/// A slot's connection, used by its exec thread only.
#[derive(Default)]
struct SlotIo {
    conn: Option<Conn>,
    pending: Option<Receiver<Result<Conn, WorkerError>>>,
    /// The worker answered an exec and has not said `Idle` yet (it is tearing the fork down).
    tearing_down: bool,
}

/// One worker slot: its connection, and what the listing shows without
/// waiting for an exec in progress.
#[derive(Default)]
struct Slot {
    io: Mutex<SlotIo>,
    pid: AtomicU32,
    busy: AtomicBool,
    restarts: AtomicU64,
    started_ms: AtomicU64,
    last_exit: Mutex<Option<String>>,
}

impl Slot {
    fn set_conn(&self, io: &mut SlotIo, conn: Conn) {
        self.pid.store(conn.pid, Ordering::Relaxed);
        let ms = conn.started.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.started_ms.store(ms, Ordering::Relaxed);
        io.conn = Some(conn);
    }

    fn lost(&self, io: &mut SlotIo, exit: Option<String>) {
        io.conn = None;
        self.pid.store(0, Ordering::Relaxed);
        self.restarts.fetch_add(1, Ordering::Relaxed);
        *self.last_exit.lock().unwrap_or_else(|e| e.into_inner()) = exit;
    }
}

pub(crate) enum Job {
    Start {
        index: usize,
        reply: Sender<Result<Conn, WorkerError>>,
    },
    /// Kill the slot's worker (if running) and say how it ended.
    Stop {
        index: usize,
        reply: Sender<Option<String>>,
    },
}

pub struct Workers {
    config: Arc<Config>,
    binds: Arc<Vec<Bind>>,
    slots: Vec<Slot>,
    launcher: Mutex<Sender<Job>>,
    /// The id of the next exec's sandbox at its worker's egress broker.
    next_sandbox: AtomicU64,
}

impl Workers {
    /// Start `n` workers (all jailed and with `prepare` open when this returns).
    /// Call it from a thread without a seccomp filter.
    pub fn start(config: Config, n: usize, prepare: Option<TemplateRef>) -> Result<Workers, WorkerError> {
        crate::jail::remove_stale_cgroups();
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
        let (cfg, b, p) = (config.clone(), binds.clone(), prepare);
        std::thread::Builder::new()
            .name("forkbox-launcher".into())
            .spawn(move || launcher(&cfg, &b, p.as_ref(), rx))
            .map_err(|e| WorkerError::Start(format!("the launcher thread: {e}")))?;
        let workers = Workers {
            config,
            binds,
            slots: (0..n.max(1)).map(|_| Slot::default()).collect(),
            launcher: Mutex::new(tx),
            next_sandbox: AtomicU64::new(1),
        };
        // Start them all at once, then wait for each.
        let pending: Vec<_> = (0..workers.slots.len()).map(|i| workers.request_start(i)).collect();
        for (i, rx) in pending.into_iter().enumerate() {
            let conn = rx.recv().map_err(|_| WorkerError::Start("the launcher thread ended".into()))??;
            let slot = &workers.slots[i];
            slot.set_conn(&mut slot.io.lock().unwrap_or_else(|e| e.into_inner()), conn);
        }
        Ok(workers)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn request_start(&self, index: usize) -> Receiver<Result<Conn, WorkerError>> {
        let (tx, rx) = channel();
        let sent =
            self.launcher.lock().unwrap_or_else(|e| e.into_inner()).send(Job::Start { index, reply: tx.clone() });
        if sent.is_err() {
            let _ = tx.send(Err(WorkerError::Start("the launcher thread ended".into())));
        }
        rx
    }

    fn stop(&self, index: usize) -> Option<String> {
        let (tx, rx) = channel();
        let sent = self.launcher.lock().unwrap_or_else(|e| e.into_inner()).send(Job::Stop { index, reply: tx });
        sent.ok()?;
        rx.recv_timeout(Duration::from_secs(10)).ok().flatten()
    }

    /// Close every worker's socket and wait until each has exited (killed if
    /// it has not within the stop's grace): its memory, and its share of the
    /// binary's and the template's pages, are the host's again when this
    /// returns. Dropping `Workers` lets them exit on their own, later.
    pub fn shutdown(self) {
        for (index, slot) in self.slots.iter().enumerate() {
            let mut io = slot.io.lock().unwrap_or_else(|e| e.into_inner());
            io.conn = None;
            io.pending = None;
            drop(io);
            self.stop(index);
        }
    }

    /// The template as the workers see it.
    pub fn template_ref(&self, image: &Path, dir: &Path) -> Result<TemplateRef, WorkerError> {
        let image = jail_path(&self.binds, image).ok_or(WorkerError::Unreachable)?;
        let dir = jail_path(&self.binds, dir).ok_or(WorkerError::Unreachable)?;
        Ok(TemplateRef { image, dir })
    }

    pub fn list(&self) -> Vec<WorkerInfo> {
        self.slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                // A replacement that is ready but not yet used: show it.
                if let Ok(mut io) = s.io.try_lock() {
                    if io.conn.is_none() {
                        match io.pending.as_ref().map(|rx| rx.try_recv()) {
                            Some(Ok(Ok(conn))) => {
                                io.pending = None;
                                s.set_conn(&mut io, conn);
                            }
                            // It failed to start: the next exec tries again.
                            Some(Ok(Err(_))) => io.pending = None,
                            _ => {}
                        }
                    }
                }
                let pid = s.pid.load(Ordering::Relaxed);
                WorkerInfo {
                    index: i,
                    kind: "exec",
                    tenant: None,
                    sandboxes: None,
                    pid: (pid != 0).then_some(pid),
                    uid: self.config.uid_base.saturating_add(i as u32),
                    busy: s.busy.load(Ordering::Relaxed),
                    restarts: s.restarts.load(Ordering::Relaxed),
                    started_unix_ms: (pid != 0).then(|| s.started_ms.load(Ordering::Relaxed)),
                    last_exit: s.last_exit.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                }
            })
            .collect()
    }

    /// Wait until worker `index` has torn down the fork of its last exec (what
    /// an exec thread does after replying, as it drops an in-process fork: so
    /// the slot stays busy, and the next exec goes to another thread, until then).
    pub fn settle(&self, index: usize) {
        let index = index % self.slots.len();
        let slot = &self.slots[index];
        let mut io = slot.io.lock().unwrap_or_else(|e| e.into_inner());
        self.settle_locked(index, slot, &mut io);
    }

    fn settle_locked(&self, index: usize, slot: &Slot, io: &mut SlotIo) {
        if !io.tearing_down {
            return;
        }
        io.tearing_down = false;
        let Some(conn) = io.conn.as_mut() else { return };
        let _ = conn.sock.set_read_timeout(Some(ANSWER_GRACE));
        match protocol::read::<FromWorker>(&mut conn.sock) {
            Ok(FromWorker::Idle) => {}
            other => {
                let why = match other {
                    Ok(f) => format!("sent {} instead of Idle", f.kind()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(worker = index, "sandbox worker lost after an exec: {why}");
                let exit = self.stop(index);
                slot.lost(io, exit);
                io.pending = Some(self.request_start(index));
            }
        }
    }

    /// A round trip to worker `index` (no guest involved): what the process
    /// boundary costs by itself. Blocking, on exec thread `index`.
    pub fn ping(&self, index: usize) -> Result<(), WorkerError> {
        let index = index % self.slots.len();
        let slot = &self.slots[index];
        let mut io = slot.io.lock().unwrap_or_else(|e| e.into_inner());
        self.settle_locked(index, slot, &mut io);
        let conn = io.conn.as_mut().ok_or_else(|| WorkerError::Crashed("is not running".into()))?;
        let crashed = |e: protocol::ProtocolError| WorkerError::Crashed(e.to_string());
        protocol::write(&mut conn.sock, &ToWorker::Ping).map_err(crashed)?;
        match protocol::read::<FromWorker>(&mut conn.sock).map_err(crashed)? {
            FromWorker::Pong => Ok(()),
            other => Err(WorkerError::Crashed(format!("answered a ping with {}", other.kind()))),
        }
    }

    /// Run one exec on worker `index`'s fork of `template`. Blocking (call it
    /// on exec thread `index`); `on_output` gets streamed output.
    pub fn exec(
        &self,
        index: usize,
        template: &TemplateRef,
        code: &str,
        limits: &Limits,
        on_output: Option<OutputSink<'_>>,
    ) -> Result<Remote, WorkerError> {
        self.exec_after(index, template, None, code, limits, on_output)
    }

    /// [`Self::exec`] with `prelude` run in the fork first (its output not
    /// streamed; a Python error in it is the exec's result, the code does not run).
    pub fn exec_after(
        &self,
        index: usize,
        template: &TemplateRef,
        prelude: Option<&str>,
        code: &str,
        limits: &Limits,
        mut on_output: Option<OutputSink<'_>>,
    ) -> Result<Remote, WorkerError> {
        let index = index % self.slots.len();
        let slot = &self.slots[index];
        let mut io = slot.io.lock().unwrap_or_else(|e| e.into_inner());
        self.settle_locked(index, slot, &mut io);
        // A worker that died while idle is replaced before the exec, not charged to it.
        if io.conn.as_ref().is_some_and(|c| !alive(&c.sock)) {
            let exit = self.stop(index);
            slot.lost(&mut io, exit);
            io.pending = Some(self.request_start(index));
        }
        if io.conn.is_none() {
            let rx = io.pending.take().unwrap_or_else(|| self.request_start(index));
            let conn = rx.recv().map_err(|_| WorkerError::Start("the launcher thread ended".into()))??;
            slot.set_conn(&mut io, conn);
        }
        let Some(conn) = io.conn.as_mut() else { return Err(WorkerError::Start("no worker".into())) };
        let pid = conn.pid;
        let clock = cpu_clock(pid);
        let cpu0 = clock_seconds(clock);
        // The broker gets the policy from here, never from the worker.
        let sandbox = self.next_sandbox.fetch_add(1, Ordering::Relaxed);
        let egress = Arc::clone(&conn.egress);
        egress.register(sandbox, limits.network.clone());
        let req = ToWorker::Exec {
            template: template.clone(),
            prelude: prelude.map(str::to_string),
            code: code.to_string(),
            // The sealed secrets stay here: the broker substitutes them, the worker never sees them.
            limits: Limits { network: limits.network.for_worker(), ..limits.clone() },
            stream: on_output.is_some(),
            sandbox,
        };
        let _ = conn.sock.set_read_timeout(Some(limits.timeout.saturating_add(ANSWER_GRACE)));
        slot.busy.store(true, Ordering::Relaxed);
        // The engine streams at most what it captures (the output limit per
        // stream, plus a truncation note): more is a worker gone wrong.
        let stream_max = limits.output_bytes.saturating_mul(2).saturating_add(STREAM_SLACK);
        let mut streamed = 0usize;
        let answered = (|| -> Result<Box<Done>, protocol::ProtocolError> {
            protocol::write(&mut conn.sock, &req)?;
            loop {
                match protocol::read::<FromWorker>(&mut conn.sock)? {
                    FromWorker::Output { stream, data } => {
                        streamed = streamed.saturating_add(data.len());
                        if streamed > stream_max {
                            return Err(protocol::ProtocolError::Io(std::io::Error::other(format!(
                                "streamed more than the {stream_max} bytes an exec can"
                            ))));
                        }
                        if let Some(f) = on_output.as_mut() {
                            f(stream, &data);
                        }
                    }
                    FromWorker::Done(done) => return Ok(done),
                    other => {
                        return Err(protocol::ProtocolError::Io(std::io::Error::other(format!(
                            "sent an unexpected {} frame",
                            other.kind()
                        ))))
                    }
                }
            }
        })();
        slot.busy.store(false, Ordering::Relaxed);
        egress.unregister(sandbox);
        let cpu_seconds = (clock_seconds(clock) - cpu0).max(0.0);
        match answered {
            Ok(done) => {
                io.tearing_down = true;
                let Done { result, fork_ms, exec_ms, net } = *done;
                Ok(Remote { result, fork_ms, exec_ms, cpu_seconds, net })
            }
            Err(e) => {
                // Dead, hung or speaking nonsense: it goes, a new one starts.
                let exit = self.stop(index);
                // It died by itself: how it ended; else why this side dropped it.
                let how = match &exit {
                    _ if e.is_timeout() => "stopped answering (killed)".to_string(),
                    Some(x) if e.is_closed() => x.clone(),
                    _ => format!("broke the protocol ({e}) and was killed"),
                };
                tracing::warn!(worker = index, pid, "sandbox worker lost: {how}");
                slot.lost(&mut io, exit);
                io.pending = Some(self.request_start(index));
                Err(WorkerError::Crashed(how))
            }
        }
    }
}

/// Where a host path is inside the workers' jail (None: not under a bind).
pub(crate) fn jail_path(binds: &[Bind], host: &Path) -> Option<String> {
    for b in binds {
        if host == b.host {
            return Some(b.jail.clone());
        }
        if let Ok(rest) = host.strip_prefix(&b.host) {
            let rest = rest.to_str()?;
            if rest.split('/').any(|c| c == ".." || c == ".") {
                return None;
            }
            return Some(format!("{}/{rest}", b.jail));
        }
    }
    None
}

/// No hang-up and nothing unasked-for to read on the socket.
pub(crate) fn alive(sock: &UnixStream) -> bool {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
    // SAFETY: one pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0
}

/// The CPU-time clock of process `pid` (clock_getcpuclockid without its
/// validating clock_getres, which the exec threads' filter does not list).
pub(crate) fn cpu_clock(pid: u32) -> libc::clockid_t {
    ((!(pid as libc::clockid_t)) << 3) | 2
}

pub(crate) fn clock_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes a local timespec.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The launcher thread: starts and stops worker processes (it owns their `Child`).
pub(crate) fn launcher(config: &Config, binds: &[Bind], prepare: Option<&TemplateRef>, rx: Receiver<Job>) {
    let mut children: HashMap<usize, Child> = HashMap::new();
    for job in rx {
        match job {
            Job::Start { index, reply } => {
                if let Some(mut old) = children.remove(&index) {
                    let _ = old.kill();
                    let _ = old.wait();
                    remove_cgroups(index);
                }
                match start_one(config, binds, prepare, index) {
                    Ok((child, conn)) => {
                        children.insert(index, child);
                        let _ = reply.send(Ok(conn));
                    }
                    Err(e) => {
                        tracing::error!(worker = index, "{e}");
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Job::Stop { index, reply } => {
                let how = children.remove(&index).map(|mut c| {
                    // The launcher exits with the worker's status (128 + signal when killed).
                    let t0 = Instant::now();
                    let status = loop {
                        match c.try_wait() {
                            Ok(Some(s)) => break Some(s),
                            Ok(None) if t0.elapsed() < Duration::from_millis(500) => {
                                std::thread::sleep(Duration::from_millis(5))
                            }
                            _ => {
                                let _ = c.kill();
                                break c.wait().ok();
                            }
                        }
                    };
                    remove_cgroups(index);
                    describe(status)
                });
                let _ = reply.send(how);
            }
        }
    }
}

/// A worker's stderr (its log lines) into the server's, bounded: a worker runs
/// guest input, so it gets lines of at most `LOG_LINE_MAX` bytes at
/// `LOG_LINES_PER_SECOND` (bursts of `LOG_BURST`); the rest is counted and dropped.
fn relay_log(index: usize, stderr: std::process::ChildStderr) {
    use std::io::Read;
    const LOG_LINE_MAX: usize = 2048;
    const LOG_LINES_PER_SECOND: f64 = 20.0;
    const LOG_BURST: f64 = 200.0;
    let mut tokens = LOG_BURST;
    let mut last = Instant::now();
    let mut dropped = 0u64;
    let mut line = Vec::with_capacity(LOG_LINE_MAX);
    let mut buf = [0u8; 4096];
    let mut reader = stderr;
    let mut emit = |line: &[u8], dropped: &mut u64| {
        let now = Instant::now();
        tokens = (tokens + now.duration_since(last).as_secs_f64() * LOG_LINES_PER_SECOND).min(LOG_BURST);
        last = now;
        if tokens < 1.0 {
            *dropped += 1;
            return;
        }
        tokens -= 1.0;
        if *dropped > 0 {
            eprintln!("[worker {index}] ({} log lines dropped: over the rate limit)", *dropped);
            *dropped = 0;
        }
        eprintln!("[worker {index}] {}", String::from_utf8_lossy(line).trim_end());
    };
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                emit(&line, &mut dropped);
                line.clear();
            } else if line.len() < LOG_LINE_MAX {
                line.push(b);
            }
        }
    }
    if !line.is_empty() {
        emit(&line, &mut dropped);
    }
}

fn remove_cgroups(index: usize) {
    for d in crate::jail::cgroup_dirs(std::process::id(), index as u32) {
        let _ = std::fs::remove_dir(d);
    }
}

fn describe(status: Option<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        None => "ended (status unknown)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) if c > 128 => match c - 128 {
                libc::SIGSYS => "was killed by its seccomp filter (SIGSYS)".into(),
                libc::SIGKILL => "was killed (SIGKILL: killed, or out of memory)".into(),
                n => format!("died of signal {n}"),
            },
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(sig)) => format!("launcher died of signal {sig}"),
            _ => "ended".into(),
        },
    }
}

fn start_one(
    config: &Config,
    binds: &[Bind],
    prepare: Option<&TemplateRef>,
    index: usize,
) -> Result<(Child, Conn), WorkerError> {
    fn err(what: &'static str) -> impl Fn(std::io::Error) -> WorkerError {
        move |e| WorkerError::Start(format!("{what}: {e}"))
    }
    let root = config.home.join("run").join(format!("worker-{index}"));
    std::fs::create_dir_all(&root).map_err(err("creating the worker's mount point"))?;
    let (mut ours, theirs) = UnixStream::pair().map_err(err("socketpair"))?;
    let fd = theirs.as_raw_fd();
    // The worker's way out: a second socket, served by the egress broker here.
    let (broker_end, worker_end) = UnixStream::pair().map_err(err("socketpair"))?;
    let egress_fd = worker_end.as_raw_fd();
    let mut cmd = Command::new(&config.exe);
    cmd.arg("__worker").env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    for k in ["RUST_LOG", "FORKBOX_LOG", "FORKBOX_DNS_SERVERS"] {
        if let Ok(v) = std::env::var(k) {
            cmd.env(k, v);
        }
    }
    // SAFETY: between fork and exec only async-signal-safe calls: dup2 of an
    // fd this process owns (dup2 clears close-on-exec on the copy).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, SOCKET_FD) < 0 || libc::dup2(egress_fd, EGRESS_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(err("spawning the worker"))?;
    drop(theirs);
    drop(worker_end);
    let egress = Arc::new(Policies::default());
    let policies = Arc::clone(&egress);
    let _ = std::thread::Builder::new().name(format!("forkbox-egress-{index}")).spawn(move || {
        if let Err(e) = crate::broker::serve(broker_end, policies) {
            tracing::warn!(worker = index, "egress broker: the worker {e}");
        }
    });
    if let Some(stderr) = child.stderr.take() {
        let _ = std::thread::Builder::new()
            .name(format!("forkbox-worker-log-{index}"))
            .spawn(move || relay_log(index, stderr));
    }
    let started = (|| -> Result<Conn, WorkerError> {
        let perr = |e: protocol::ProtocolError| WorkerError::Start(e.to_string());
        let hello = Hello {
            index: index as u32,
            role: config.role,
            max_file_bytes: config.max_file_bytes,
            jail: config.jail,
            uid: config.uid_base.saturating_add(index as u32),
            root,
            binds: binds.to_vec(),
            seccomp: config.seccomp,
            memory_bytes: config.memory_bytes,
            max_tasks: config.max_tasks,
            own_network: config.own_network,
            test_actions: config.test_actions,
        };
        let _ = ours.set_read_timeout(Some(START_TIMEOUT));
        protocol::write(&mut ours, &hello).map_err(perr)?;
        let pid = match protocol::read::<FromWorker>(&mut ours).map_err(perr)? {
            FromWorker::Started { pid } => pid,
            other => return Err(WorkerError::Start(format!("expected Started, got {}", other.kind()))),
        };
        match protocol::read::<FromWorker>(&mut ours).map_err(perr)? {
            FromWorker::Ready => {}
            other => return Err(WorkerError::Start(format!("expected Ready, got {}", other.kind()))),
        }
        if let Some(t) = prepare {
            match config.role {
                Role::Exec => protocol::write(&mut ours, &ToWorker::Prepare { template: t.clone() }),
                Role::Sessions => protocol::write(&mut ours, &ToSessions::Prepare { template: t.clone() }),
            }
            .map_err(perr)?;
            match protocol::read::<FromWorker>(&mut ours).map_err(perr)? {
                FromWorker::Prepared(Ok(())) => {}
                FromWorker::Prepared(Err(e)) => {
                    return Err(WorkerError::Start(format!("opening the template: {}", e.message)))
                }
                other => return Err(WorkerError::Start(format!("expected Prepared, got {}", other.kind()))),
            }
        }
        Ok(Conn { sock: ours, pid, started: SystemTime::now(), egress })
    })();
    match started {
        Ok(conn) => Ok((child, conn)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}
