//! Sessions: stateful Python REPLs that live forever.
//!
//! A session is resident (a sandbox in memory) or not (only its checkpoints on
//! disk). Every exec that completes ends with a checkpoint: a layer of the
//! pages changed since the previous one plus the full state, written to temp
//! files, fsynced and renamed, then committed to SQLite with the session's head.
//! An exec that fails (timeout, crash, exit) drops the sandbox: the session
//! is back at its last checkpoint. Idle sessions are evicted; the next exec
//! resumes them from disk, also after a restart.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use forkbox_api::ErrorCode;
use forkbox_catalog::{Catalog, CatalogError, Loaded};
use forkbox_engine::packages::Package;
use forkbox_engine::{
    CapturedOutput, Changes, Engine, EngineError, ExecOptions, ExecResult, FileEntry, FileOp, FileOpOutcome,
    Interrupter, JobChunk, JobInfo, Limits, ListeningPort, ResumeAs, Stream, Template, Usage,
};
use forkbox_snapshot::{Layer, StateError};

use crate::host::{CheckpointFiles, CheckpointIn, InProcess, NamedFile, Resident, SandboxHost, Start};
use crate::lease::{Acquired, Lease, NodeRecord, NodeState, Owner};
use crate::node::{ClusterConfig, Node};
use crate::objects::{ObjectError, ObjectStats, Objects, ObjectsConfig};
use crate::output::CallOutput;
use crate::store::{self, CheckpointRecord, NewCheckpoint, SessionRecord, Store, StoreError};

mod cluster;
mod tree;
pub use tree::{diff, Diff, FileChange, FileState, PathCall, StateAt, Variable, VariableChange, Variables};

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0} not found")]
    NotFound(String),
    #[error("checkpoint {1} of session {0} not found")]
    CheckpointNotFound(String, i64),
    #[error("session {0} is busy with another exec")]
    Busy(String),
    #[error("{source}; the session was rolled back to {}", rolled_back(*.checkpoint))]
    ExecFailed {
        #[source]
        source: EngineError,
        /// Seq of the checkpoint the session is at now (None: the template).
        checkpoint: Option<i64>,
        /// What the exec wrote to stdout/stderr before it failed.
        output: Option<Box<CapturedOutput>>,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Reading a checkpoint's namespace failed (it raised, timed out, or its report was unreadable).
    #[error("{0}")]
    InspectFailed(String),
    /// The checkpoint of an exec would take the tenant past its disk quota:
    /// nothing was written, the session stays at its previous checkpoint.
    #[error("{message}; the session stays at {}", rolled_back(*.checkpoint))]
    QuotaExceeded {
        message: String,
        /// The exec's result (it ran; only its checkpoint was refused).
        result: Option<Box<ExecResult>>,
        checkpoint: Option<i64>,
    },
    /// Cluster: another node has the session resident; the request belongs there.
    #[error("session {session} is resident on node {}", owner.node)]
    Elsewhere { session: String, owner: Box<Owner> },
    /// Cluster: the session cannot be served by this node now (it drains, or
    /// its own heartbeat is overdue).
    #[error("{0}")]
    Moving(String),
    /// Cluster: another node took the session while this exec ran (this
    /// node's lease ran out): its checkpoint was not committed.
    #[error("the session was taken over by another node while the exec ran; its checkpoint was not committed, the session stays at {}", rolled_back(*.checkpoint))]
    LeaseLost { checkpoint: Option<i64> },
    /// The disk is full (or down to its reserve): nothing was written.
    #[error("not enough disk space for the checkpoint ({0}); the session stays at its previous checkpoint")]
    NoSpace(String),
    /// A file operation failed: `file_not_found`, `invalid_path`, `is_a_directory`,
    /// `file_too_large` or `quota_exceeded` (see `EngineError::File`).
    #[error("{message}")]
    File { code: ErrorCode, message: String },
    #[error("session storage: {0}")]
    Store(#[from] StoreError),
    /// The object store (`--objects`) failed: reading a file a resume needs, or
    /// anything but an exec's checkpoint (that is [`Self::NotStored`]).
    #[error("checkpoint files: {0}")]
    Objects(Box<ObjectError>),
    /// The checkpoint of an exec could not be uploaded to the object store:
    /// it was not committed (its local files are gone too).
    #[error("{source}; the checkpoint was not committed, the session stays at {}", rolled_back(*.checkpoint))]
    NotStored {
        #[source]
        source: Box<ObjectError>,
        checkpoint: Option<i64>,
    },
    /// The previous call was answered before its checkpoint was durable, and
    /// making it durable then failed: the session went back to the checkpoint
    /// before it (as a crash at that moment would), and this call did not run.
    #[error("the previous call's checkpoint {lost} was not stored ({reason}); the session went back to {}, and this call did not run", rolled_back(*.checkpoint))]
    Unsettled { lost: i64, reason: String, checkpoint: Option<i64> },
    #[error("checkpoint files: {0}")]
    Snapshot(#[from] StateError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The session's template (or the one asked for) cannot be had.
    #[error(transparent)]
    Template(#[from] CatalogError),
}

impl From<ObjectError> for SessionError {
    fn from(e: ObjectError) -> SessionError {
        SessionError::Objects(Box::new(e))
    }
}

impl SessionError {
    /// An engine error of a file operation (or of resuming the session for it).
    fn from_files(e: EngineError) -> SessionError {
        match e {
            EngineError::File { code, message } => SessionError::File { code, message },
            e => SessionError::Engine(e),
        }
    }
}

/// Longest result summary kept with a checkpoint (characters).
const SUMMARY_MAX: usize = 160;

/// One line about an exec's result: the exception, else the value, else the
/// last line it printed; None if it showed nothing.
pub fn summarize(r: &ExecResult) -> Option<String> {
    let text = if let Some(e) = &r.error {
        format!("{}: {}", e.kind, e.message)
    } else if let Some(v) = &r.value {
        v.clone()
    } else if let Some(line) = r.stdout.lines().rev().find(|l| !l.trim().is_empty()) {
        line.to_string()
    } else if !r.display.is_empty() {
        format!("{} displayed", r.display.len())
    } else {
        return None;
    };
    let one_line: String = text.split('\n').next().unwrap_or("").chars().take(SUMMARY_MAX).collect();
    Some(if one_line.len() < text.len() { format!("{one_line}…") } else { one_line })
}

fn rolled_back(seq: Option<i64>) -> String {
    match seq {
        Some(s) => format!("checkpoint {s}"),
        None => "its initial state".into(),
    }
}

impl SessionError {
    /// The API's error code for this failure (its HTTP status comes with it).
    pub fn error_code(&self) -> ErrorCode {
        match self {
            SessionError::NotFound(_) => ErrorCode::SessionNotFound,
            SessionError::CheckpointNotFound(..) => ErrorCode::CheckpointNotFound,
            SessionError::Busy(_) => ErrorCode::SessionBusy,
            SessionError::ExecFailed { source, .. } => source.error_code(),
            SessionError::Invalid(_) => ErrorCode::InvalidRequest,
            SessionError::InspectFailed(_) => ErrorCode::InspectFailed,
            SessionError::QuotaExceeded { .. } => ErrorCode::QuotaExceeded,
            SessionError::NoSpace(_) => ErrorCode::InsufficientStorage,
            SessionError::Elsewhere { .. } | SessionError::Moving(_) | SessionError::LeaseLost { .. } => {
                ErrorCode::SessionMoved
            }
            SessionError::File { code, .. } => *code,
            SessionError::Snapshot(e) => e.error_code(),
            SessionError::Store(e) if e.is_unavailable() => ErrorCode::StorageUnavailable,
            SessionError::Store(_) | SessionError::Unsettled { .. } => ErrorCode::StorageError,
            SessionError::Objects(e) | SessionError::NotStored { source: e, .. } => e.error_code(),
            SessionError::Engine(e) => e.error_code(),
            SessionError::Template(e) => e.error_code(),
        }
    }

    /// The wire name of [`Self::error_code`].
    pub fn code(&self) -> &'static str {
        self.error_code().as_str()
    }

    /// For a failed exec: the checkpoint seq the session was rolled back to (None: its initial state).
    pub fn rolled_back_to(&self) -> Option<Option<i64>> {
        match self {
            SessionError::ExecFailed { checkpoint, .. }
            | SessionError::QuotaExceeded { checkpoint, .. }
            | SessionError::NotStored { checkpoint, .. }
            | SessionError::Unsettled { checkpoint, .. }
            | SessionError::LeaseLost { checkpoint } => Some(*checkpoint),
            _ => None,
        }
    }

    /// For a failed exec: what it wrote to stdout/stderr before it failed.
    pub fn captured_output(&self) -> Option<&CapturedOutput> {
        match self {
            SessionError::ExecFailed { output, .. } => output.as_deref(),
            _ => None,
        }
    }
}

/// The `%pip install` lines of an exec's code with their packages resolved
/// (`Manager::plan_pip`), ready to be mounted by `Manager::exec_planned`.
#[derive(Clone, Debug)]
pub struct PipPlan {
    pub lines: Vec<forkbox_engine::packages::PipLine>,
    /// The packages of each line.
    pub resolved: Vec<Vec<Package>>,
}

/// How often the upkeep removes the package layers nothing refers to any
/// more (its first round after start, then at most this often), and how old
/// such a layer must be (one just built for an install in progress stays).
pub const PACKAGE_GC_EVERY: Duration = Duration::from_secs(600);
pub const PACKAGE_GC_MIN_AGE: Duration = Duration::from_secs(600);

/// What `Manager::install_packages` did.
#[derive(Clone, Debug)]
pub struct PackagesOutcome {
    /// Every distribution of the install (dependencies included), installed now or already.
    pub packages: Vec<forkbox_engine::packages::InstalledPackage>,
    /// What pip would have printed.
    pub output: String,
    /// The checkpoint that records them (None: nothing was new).
    pub checkpoint: Option<CheckpointRecord>,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// A session idle this long is evicted (its VM torn down; it stays on disk).
    pub idle_timeout: Duration,
    /// At most this many sessions resident; the least recently used go first.
    pub max_resident: usize,
    /// Write a flat (merged) layer once a chain has this many layers since the last one.
    pub compact_after: usize,
    /// Free disk kept for deletes and metadata updates: a checkpoint that would
    /// leave less free than this is refused (`insufficient_storage`).
    pub disk_reserve: u64,
    /// Checkpoint files also in an object store, the layers directory a
    /// bounded cache in front of it (None: the local directory only).
    pub objects: Option<ObjectsConfig>,
    /// The metadata in this PostgreSQL database (`postgres://...`), claimed
    /// by this node alone (see `Store::claim`) unless `cluster` is set; None:
    /// SQLite in the sessions directory.
    pub database: Option<String>,
    /// Share `database` and `objects` with other nodes: sessions are leased
    /// to one node at a time (see `crate::lease`). Needs both.
    pub cluster: Option<ClusterConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            idle_timeout: Duration::from_secs(60),
            max_resident: 256,
            compact_after: 8,
            disk_reserve: DEFAULT_DISK_RESERVE,
            objects: None,
            database: None,
            cluster: None,
        }
    }
}

/// Default `Config::disk_reserve`.
pub const DEFAULT_DISK_RESERVE: u64 = 256 << 20;

/// Free bytes (for unprivileged writers) of the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs buffer of ours.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Bytes of checkpoints being written, per tenant, not yet committed (so
/// concurrent execs of one tenant cannot together pass its quota).
#[derive(Default)]
struct Reservations {
    by_tenant: HashMap<String, u64>,
}

/// Gives a reservation back when the checkpoint is committed or failed.
struct Reserved<'a> {
    m: &'a Mutex<Reservations>,
    tenant: String,
    bytes: u64,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut r = self.m.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = r.by_tenant.get_mut(&self.tenant) {
            *v = v.saturating_sub(self.bytes);
            if *v == 0 {
                r.by_tenant.remove(&self.tenant);
            }
        }
    }
}

/// The result of an exec in a session, and the checkpoint that recorded it.
#[derive(Clone, Debug)]
pub struct ExecOutcome {
    pub result: ExecResult,
    pub checkpoint: CheckpointRecord,
}

struct Slot {
    sandbox: Option<Box<dyn Resident>>,
    /// Cluster: this node's lease of the session while it is resident here.
    lease: Option<Lease>,
    /// The checkpoint the resident sandbox is at (its next checkpoint's parent).
    base: Option<i64>,
    /// Its last checkpoint, being settled after the reply (then `base` is it).
    pending: Option<Arc<Settling>>,
    last_used: Instant,
}

pub struct SessionManager {
    /// Exclusive lock on the sessions directory for this manager's life: one
    /// process at a time owns the store, its files and its recovery.
    _lock: std::fs::File,
    /// Every template a session may be on; a session records its template's id.
    catalog: Arc<Catalog>,
    store: Store,
    layers_dir: PathBuf,
    config: Config,
    slots: Mutex<HashMap<String, Arc<Mutex<Slot>>>>,
    /// The interrupter of each session's running exec, outside the slot lock
    /// (which the exec holds) so `interrupt` can reach it.
    running: Mutex<HashMap<String, Interrupter>>,
    /// Checkpoint disk quota per tenant (bytes; absent: unlimited), see `set_disk_quota`.
    quotas: Mutex<HashMap<String, u64>>,
    reserved: Mutex<Reservations>,
    /// When the upkeep last removed unused package layers.
    packages_gc_at: Mutex<Option<Instant>>,
    /// The object store of `config.objects`.
    objects: Option<Objects>,
    /// Where the sandboxes live (this process by default; see [`Self::with_host`]).
    host: Arc<dyn SandboxHost>,
    /// This node, in a cluster (`config.cluster`).
    node: Option<Node>,
    /// Checkpoints answered for and not yet durable, by session id (see
    /// [`Self::exec_deferred`]): every use of such a session waits for its entry.
    settling: Mutex<HashMap<String, Arc<Settling>>>,
}

/// A checkpoint written into temp files by its sandbox and checked, not yet
/// durable nor committed (see [`SessionManager::write_checkpoint_files`]).
struct Written<'a> {
    m: &'a SessionManager,
    session_id: String,
    parent: Option<i64>,
    code: String,
    layer: String,
    state: String,
    pack: String,
    pack_bytes: u64,
    pages: u64,
    bytes: u64,
    checksum: String,
    output: Option<String>,
    summary: Option<String>,
    seq: Option<i64>,
    fence: Option<Lease>,
    /// (temp path, final name, our own handle) of each file made.
    made: Vec<(PathBuf, String, File)>,
    reservation: Option<Reserved<'a>>,
}

impl Written<'_> {
    /// The record the checkpoint will have once committed (`id` 0 until then).
    fn provisional(&self, seq: i64) -> CheckpointRecord {
        CheckpointRecord {
            id: 0,
            session_id: self.session_id.clone(),
            seq,
            parent: self.parent,
            code: self.code.clone(),
            created_ms: now_ms(),
            layer: self.layer.clone(),
            state: self.state.clone(),
            pages: self.pages,
            bytes: self.bytes,
            checksum: self.checksum.clone(),
            flat: None,
            summary: self.summary.clone(),
            output_bytes: self.output.as_ref().map_or(0, |o| o.len() as u64),
        }
    }

    /// Make the files durable (fsync, rename, fsync of the directory), upload
    /// them to the object store if there is one, then commit the record. On
    /// failure nothing of the checkpoint is left.
    fn settle(self) -> Result<CheckpointRecord, SessionError> {
        let Written {
            m,
            session_id,
            parent,
            code,
            layer,
            state,
            pack,
            pack_bytes,
            pages,
            bytes,
            checksum,
            output,
            summary,
            seq,
            fence,
            made,
            reservation,
        } = self;
        let remove_files = || {
            for f in checkpoint_files(&layer, &state, None) {
                let _ = std::fs::remove_file(m.layers_dir.join(f));
            }
        };
        let durable = (|| -> Result<(), SessionError> {
            for (tmp, final_name, f) in &made {
                if *final_name == pack && pack_bytes == 0 {
                    continue;
                }
                f.sync_all().map_err(|e| StateError::io("fsync", tmp, e))?;
            }
            for (tmp, final_name, _) in &made {
                if *final_name == pack && pack_bytes == 0 {
                    let _ = std::fs::remove_file(tmp);
                    continue;
                }
                let to = m.layers_dir.join(final_name);
                std::fs::rename(tmp, &to).map_err(|e| StateError::io("rename", &to, e))?;
            }
            if let Ok(d) = std::fs::File::open(&m.layers_dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })();
        if let Err(e) = durable {
            for (tmp, _, _) in &made {
                let _ = std::fs::remove_file(tmp);
            }
            remove_files();
            return Err(match e {
                SessionError::Snapshot(s) if s.is_no_space() => SessionError::NoSpace(s.to_string()),
                e => e,
            });
        }
        drop(made);
        let c = NewCheckpoint {
            session_id: &session_id,
            parent,
            code: &code,
            layer: &layer,
            state: &state,
            pages,
            bytes,
            checksum: &checksum,
            output: output.as_deref(),
        };
        // With an object store: every file uploaded before the metadata commits.
        let uploaded = match &m.objects {
            None => None,
            Some(o) => {
                let files = checkpoint_files(&layer, &state, None);
                let names: Vec<&str> = files.iter().map(String::as_str).collect();
                match o.upload(&m.store, &names) {
                    Ok(u) => Some(u),
                    Err(source) => {
                        remove_files();
                        return Err(SessionError::NotStored { source: Box::new(source), checkpoint: m.seq_of(parent) });
                    }
                }
            }
        };
        let objects = uploaded.as_ref().map_or(&[][..], |u| u.stored.as_slice());
        let committed =
            m.store.commit_checkpoint_fenced(&c, seq, summary.as_deref(), now_ms(), objects, fence.as_ref());
        drop(reservation);
        match committed {
            Ok(c) => {
                if let (Some(o), Some(u)) = (&m.objects, uploaded) {
                    o.committed(u);
                }
                Ok(c)
            }
            Err(e) => {
                // Not committed: its files go at once (a full disk keeps nothing).
                remove_files();
                if let (Some(o), Some(u)) = (&m.objects, uploaded) {
                    o.abandon(&m.store, u);
                }
                Err(match e {
                    StoreError::LeaseLost(_) => SessionError::LeaseLost { checkpoint: m.seq_of(parent) },
                    e => e.into(),
                })
            }
        }
    }
}

/// A session's checkpoint being made durable after the reply went out (see
/// [`SessionManager::exec_deferred`]): every later use of the session waits
/// for it.
struct Settling {
    /// The checkpoint's number in its session.
    seq: i64,
    /// The committed record, or why it was not committed.
    done: Mutex<Option<Result<CheckpointRecord, String>>>,
    cv: std::sync::Condvar,
}

impl Settling {
    fn new(seq: i64) -> Settling {
        Settling { seq, done: Mutex::new(None), cv: std::sync::Condvar::new() }
    }

    fn wait(&self) -> Result<CheckpointRecord, String> {
        let mut g = self.done.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn set(&self, r: Result<CheckpointRecord, String>) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.cv.notify_all();
    }
}

/// An exec's checkpoint, and its [`Settle`] if it is not committed yet.
type Checkpointed<'a> = (CheckpointRecord, Option<Settle<'a>>);

/// The second half of a deferred exec (see [`SessionManager::exec_deferred`]):
/// its checkpoint made durable and committed. Dropped unfinished, it
/// finishes then.
pub struct Settle<'a> {
    written: Option<Written<'a>>,
    cell: Arc<Settling>,
    /// The session's template, when this is its first checkpoint and its
    /// sandboxes run in this process: a VM is warmed for the next session
    /// once this one is settled.
    warm: Option<Arc<Loaded>>,
}

impl Settle<'_> {
    /// Make the checkpoint durable and commit it; the record committed.
    pub fn finish(mut self) -> Result<CheckpointRecord, SessionError> {
        self.run()
    }

    fn run(&mut self) -> Result<CheckpointRecord, SessionError> {
        let Some(w) = self.written.take() else {
            return Err(SessionError::Invalid("this checkpoint was settled already".into()));
        };
        let (m, id, seq) = (w.m, w.session_id.clone(), w.seq);
        let r = w.settle();
        if let Err(e) = &r {
            tracing::warn!(session = %id, "a checkpoint answered for was not stored; the session is back at the one before it: {e}");
            if let Some(q) = seq {
                let _ = m.store.release_seq(&id, q);
            }
        }
        self.cell.set(r.as_ref().map(|c| c.clone()).map_err(|e| e.to_string()));
        {
            let mut map = m.settling.lock().unwrap_or_else(|e| e.into_inner());
            if map.get(&id).is_some_and(|c| Arc::ptr_eq(c, &self.cell)) {
                map.remove(&id);
            }
        }
        if let Some(t) = self.warm.take() {
            t.template.keep_warm(&t.engine);
        }
        r
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        if self.written.is_some() {
            let _ = self.run();
        }
    }
}

/// Where a request for a session belongs (see [`SessionManager::route`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// This node serves it (it has it, or may take it).
    Here,
    /// Another node: its id and URL.
    Node { node: String, url: String },
}

/// Removes a session's entry from `SessionManager::running` when the exec
/// ends (or never starts: then it also disarms the interrupter).
struct Running<'a> {
    map: &'a Mutex<HashMap<String, Interrupter>>,
    id: &'a str,
    interrupter: Interrupter,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(self.id);
        self.interrupter.disarm();
    }
}

/// A session's slot, or `Busy` if an exec (or revert, delete) holds it.
fn lock_slot<'a>(slot: &'a Mutex<Slot>, id: &str) -> Result<std::sync::MutexGuard<'a, Slot>, SessionError> {
    // A short hold (a background process' output read or follow step, a file
    // read) ends within the grace: only a running exec or a long wait is `Busy`.
    let deadline = Instant::now() + LOCK_GRACE;
    loop {
        match slot.try_lock() {
            Ok(g) => return Ok(g),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => std::thread::sleep(LOCK_POLL),
            Err(TryLockError::WouldBlock) => return Err(SessionError::Busy(id.to_string())),
            Err(TryLockError::Poisoned(p)) => return Ok(p.into_inner()),
        }
    }
}

/// How long a request waits for a session another request holds before `Busy`.
const LOCK_GRACE: Duration = Duration::from_millis(200);
const LOCK_POLL: Duration = Duration::from_millis(1);

/// How long `open` waits for another process to release the sessions directory.
const LOCK_WAIT: Duration = Duration::from_secs(30);

fn lock_dir(dir: &Path) -> Result<std::fs::File, SessionError> {
    let path = dir.join("lock");
    let ioe = |source| StateError::Io { what: "lock", path: path.display().to_string(), source };
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(ioe)?;
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a file we own.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(ioe(err).into());
        }
        if Instant::now() >= deadline {
            return Err(SessionError::Invalid(format!(
                "the sessions in {} are in use by another forkbox process (waited {} s)",
                dir.display(),
                LOCK_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A resident sandbox that is still there (not gone with its worker process).
fn live(sb: &Option<Box<dyn Resident>>) -> bool {
    sb.as_ref().is_some_and(|s| s.is_alive())
}

/// A new temp file of a checkpoint, for this process' user only.
fn create_temp(path: &Path) -> Result<std::fs::File, SessionError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path);
    f.map_err(|e| {
        let e = StateError::io("create", path, e);
        if e.is_no_space() {
            SessionError::NoSpace(e.to_string())
        } else {
            e.into()
        }
    })
}

/// The layer files of checkpoint `head`'s chain (`chain`: its ancestry, root
/// first), newest first back to the nearest flat layer, and its record.
fn layer_names(chain: &[CheckpointRecord], head: i64) -> Result<(Vec<String>, CheckpointRecord), SessionError> {
    let head_rec = chain.last().cloned().ok_or_else(|| SessionError::CheckpointNotFound(String::new(), head))?;
    let mut names = Vec::new();
    for c in chain.iter().rev() {
        if let Some(flat) = &c.flat {
            names.push(flat.clone());
            break;
        }
        names.push(c.layer.clone());
    }
    Ok((names, head_rec))
}

/// The files of a checkpoint: its layer, its state, the pack of its changed
/// file chunks (`<name>.files`, may not exist), the memory layers of its
/// child processes (`<name>.procs`, may not exist) and its flat layer if any.
fn checkpoint_files(layer: &str, state: &str, flat: Option<&str>) -> Vec<String> {
    let pack = Path::new(state).with_extension("files").to_string_lossy().into_owned();
    let procs = forkbox_snapshot::files::procs_name(&pack);
    let mut v = vec![layer.to_string(), state.to_string(), pack, procs];
    v.extend(flat.map(str::to_string));
    v
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A fresh id: `prefix` and 16 hex digits from the host's entropy pool (the
/// ids of sessions, checkpoints, flattened files and one-shot execs; not secrets).
pub fn random_id(prefix: &str) -> String {
    // getrandom(2) cannot fail for 8 bytes once the pool is initialised; fall back to the clock.
    let hex = forkbox_engine::random_hex(8)
        .unwrap_or_else(|_| hex::encode((now_ms() as u64 ^ std::process::id() as u64).to_le_bytes()));
    format!("{prefix}{hex}")
}

/// Limits as stored with a session.
pub fn to_store_limits(l: &Limits) -> store::Limits {
    store::Limits {
        memory_bytes: l.memory_bytes,
        timeout_ms: l.timeout.as_millis() as u64,
        output_bytes: l.output_bytes as u64,
        disk_bytes: l.disk_bytes,
        network: serde_json::to_string(&l.network).ok(),
    }
}

/// The engine limits a stored session record holds.
pub fn from_store_limits(l: &store::Limits) -> Limits {
    Limits {
        memory_bytes: l.memory_bytes,
        timeout: Duration::from_millis(l.timeout_ms),
        output_bytes: l.output_bytes as usize,
        disk_bytes: l.disk_bytes,
        // Unreadable or absent (a session from before networking): no network.
        network: l.network.as_deref().and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default(),
        ..Limits::default()
    }
}

impl SessionManager {
    /// Open (or create) the session store under `home/sessions` and recover
    /// from whatever a previous process left (a kill mid-checkpoint included).
    /// Sessions over one open template (registered as the catalog's default name).
    pub fn open(
        engine: Arc<Engine>,
        template: Arc<Template>,
        home: &Path,
        config: Config,
    ) -> Result<SessionManager, SessionError> {
        let catalog = Arc::new(Catalog::new(home)?);
        catalog.insert(&catalog.default_name(), engine, template);
        SessionManager::open_with_catalog(catalog, home, config)
    }

    /// Sessions on any template of `catalog`.
    pub fn open_with_catalog(
        catalog: Arc<Catalog>,
        home: &Path,
        config: Config,
    ) -> Result<SessionManager, SessionError> {
        let dir = home.join("sessions");
        let layers_dir = dir.join("layers");
        std::fs::create_dir_all(&layers_dir).map_err(|source| StateError::Io {
            what: "create",
            path: layers_dir.display().to_string(),
            source,
        })?;
        let lock = lock_dir(&dir)?;
        let store = match (&config.database, &config.cluster) {
            (None, None) => Store::open(&dir.join("sessions.db"))?,
            (None, Some(_)) => {
                return Err(SessionError::Invalid(
                    "a cluster node needs the shared metadata database (--database postgres://...)".into(),
                ))
            }
            (Some(_), Some(_)) if config.objects.is_none() => {
                return Err(SessionError::Invalid(
                    "a cluster node needs the shared object store (--objects s3://...) for its checkpoints".into(),
                ))
            }
            (Some(url), None) => {
                let s = Store::open_postgres(url)?;
                s.claim()?;
                s
            }
            (Some(url), Some(c)) => {
                if !crate::node::valid_node_id(&c.node_id) {
                    return Err(SessionError::Invalid(format!(
                        "node id {:?}: 1-64 letters, digits, '-', '_', '.', ':'",
                        c.node_id
                    )));
                }
                let s = Store::open_postgres(url)?;
                s.register_node(&c.node_id, &c.url)?;
                s
            }
        };
        let node = config.cluster.clone().map(Node::new);
        let objects = match &config.objects {
            Some(c) => Some(Objects::open(c, &layers_dir, &store.all_objects()?)?),
            None => None,
        };
        let m = SessionManager {
            _lock: lock,
            catalog,
            store,
            layers_dir,
            config,
            slots: Mutex::new(HashMap::new()),
            running: Mutex::new(HashMap::new()),
            quotas: Mutex::new(HashMap::new()),
            reserved: Mutex::new(Reservations::default()),
            packages_gc_at: Mutex::new(None),
            objects,
            node,
            host: Arc::new(InProcess),
            settling: Mutex::new(HashMap::new()),
        };
        m.recover()?;
        Ok(m)
    }

    /// Run the sessions' sandboxes on `host` (e.g. jailed worker processes)
    /// instead of in this process.
    pub fn with_host(mut self, host: Arc<dyn SandboxHost>) -> SessionManager {
        self.host = host;
        self
    }

    /// Where the sessions' sandboxes run ("thread": this process; "process": worker processes).
    pub fn host_kind(&self) -> &'static str {
        self.host.kind()
    }

    /// The metadata store itself, for this crate's tests and offline tools. The
    /// layers above use the typed queries ([`Self::count`], [`Self::head`],
    /// [`Self::disk_bytes`], ...); the runtime does not hand the manager out.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Live sessions of `tenant` (all tenants with None).
    pub fn count(&self, tenant: Option<&str>) -> Result<u64, SessionError> {
        Ok(self.store.count_sessions(tenant)?)
    }

    /// The head checkpoint of a session (None before its first exec unless it was forked;
    /// a head of another session means it was forked from there and has not run yet).
    pub fn head(&self, rec: &SessionRecord) -> Result<Option<CheckpointRecord>, SessionError> {
        match rec.head {
            None => Ok(None),
            Some(h) => Ok(self.store.checkpoint(h)?),
        }
    }

    /// Merge the layer chain of a session's head once it is long (see [`Self::compact`]).
    pub fn compact_session(&self, tenant: &str, id: &str) -> Result<bool, SessionError> {
        match self.record(tenant, id)?.head {
            Some(h) => self.compact(h),
            None => Ok(false),
        }
    }

    /// The default template (built now if it is not open yet).
    pub fn template(&self) -> Result<Arc<Loaded>, SessionError> {
        Ok(self.catalog.get(None)?)
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The template a session is on, by the id it recorded.
    fn loaded(&self, rec: &SessionRecord) -> Result<Arc<Loaded>, SessionError> {
        Ok(self.catalog.by_id(&rec.template_id)?)
    }

    fn slot(&self, id: &str) -> Arc<Mutex<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .entry(id.to_string())
            .or_insert_with(|| {
                Arc::new(Mutex::new(Slot {
                    sandbox: None,
                    lease: None,
                    base: None,
                    pending: None,
                    last_used: Instant::now(),
                }))
            })
            .clone()
    }

    fn record(&self, tenant: &str, id: &str) -> Result<SessionRecord, SessionError> {
        self.wait_settled(Some(id));
        self.store.session(tenant, id)?.ok_or_else(|| SessionError::NotFound(id.to_string()))
    }

    /// Wait until the checkpoint of session `id` (of every session with None)
    /// answered for before it was durable is committed or given up.
    fn wait_settled(&self, id: Option<&str>) {
        let waiting: Vec<Arc<Settling>> = {
            let map = self.settling.lock().unwrap_or_else(|e| e.into_inner());
            match id {
                Some(id) => map.get(id).cloned().into_iter().collect(),
                None => map.values().cloned().collect(),
            }
        };
        for s in waiting {
            let _ = s.wait();
        }
    }

    /// The number of checkpoint `id` in its session (None: no checkpoint, the
    /// template's state, or it cannot be read), for an error's `checkpoint`.
    fn seq_of(&self, id: Option<i64>) -> Option<i64> {
        id.and_then(|c| self.store.checkpoint(c).ok().flatten()).map(|c| c.seq)
    }

    /// Take the outcome of the slot's settled checkpoint: it becomes the
    /// sandbox's base; or, not stored, the sandbox goes (its memory is ahead
    /// of disk) and the caller hears of it ([`SessionError::Unsettled`]): the
    /// session is at `head` (its record's, read after the settle ended).
    fn take_settled(&self, id: &str, slot: &mut Slot, head: Option<i64>) -> Result<(), SessionError> {
        if let Some(p) = slot.pending.take() {
            match p.wait() {
                Ok(c) => slot.base = Some(c.id),
                Err(reason) => {
                    self.drop_resident(id, slot);
                    return Err(SessionError::Unsettled { lost: p.seq, reason, checkpoint: self.seq_of(head) });
                }
            }
        }
        Ok(())
    }

    /// A new session on the default template.
    pub fn create(
        &self,
        tenant: &str,
        tags: BTreeMap<String, String>,
        limits: &Limits,
    ) -> Result<SessionRecord, SessionError> {
        let t = self.template()?;
        self.create_on(tenant, tags, limits, &t)
    }

    /// A new session on `template` (from `catalog().get(..)` / `get_or_start(..)`).
    pub fn create_on(
        &self,
        tenant: &str,
        tags: BTreeMap<String, String>,
        limits: &Limits,
        template: &Loaded,
    ) -> Result<SessionRecord, SessionError> {
        self.create_at(tenant, tags, limits, None, template.id())
    }

    fn create_at(
        &self,
        tenant: &str,
        tags: BTreeMap<String, String>,
        limits: &Limits,
        head: Option<i64>,
        template_id: &str,
    ) -> Result<SessionRecord, SessionError> {
        let now = now_ms();
        let rec = SessionRecord {
            id: random_id("s_"),
            tenant: tenant.to_string(),
            template_id: template_id.to_string(),
            tags,
            limits: to_store_limits(limits),
            head,
            created_ms: now,
            last_used_ms: now,
        };
        self.store.create_session(&rec)?;
        Ok(rec)
    }

    pub fn get(&self, tenant: &str, id: &str) -> Result<SessionRecord, SessionError> {
        self.record(tenant, id)
    }

    pub fn is_resident(&self, id: &str) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.get(id).is_some_and(|s| s.try_lock().map(|s| live(&s.sandbox)).unwrap_or(true))
    }

    pub fn list(&self, tenant: &str, tags: &[(String, String)]) -> Result<Vec<SessionRecord>, SessionError> {
        self.wait_settled(None);
        Ok(self.store.list_sessions(tenant, tags)?)
    }

    pub fn checkpoints(&self, tenant: &str, id: &str) -> Result<Vec<CheckpointRecord>, SessionError> {
        self.record(tenant, id)?;
        Ok(self.store.session_checkpoints(id)?)
    }

    /// The history that leads to the session's current state (root first).
    pub fn history(&self, tenant: &str, id: &str) -> Result<Vec<CheckpointRecord>, SessionError> {
        let rec = self.record(tenant, id)?;
        match rec.head {
            Some(h) => Ok(self.store.ancestry(h)?),
            None => Ok(Vec::new()),
        }
    }

    /// Run code in the session. One exec at a time per session: a concurrent one gets `Busy`.
    pub fn exec(&self, tenant: &str, id: &str, code: &str) -> Result<ExecOutcome, SessionError> {
        self.exec_with(tenant, id, code, ExecOptions::default())
    }

    /// `exec`, with streamed output and/or an interrupter of the caller's
    /// (`interrupt` works in any case). An interrupted exec that ends with
    /// KeyboardInterrupt is checkpointed like any other; one that had to be
    /// killed rolls the session back (`ExecFailed` with code `interrupted`).
    /// `opts.timeout` shortens this exec's time limit; the session's own
    /// (`timeout_ms` of its record, as it is now) is the maximum.
    ///
    /// `%pip install` lines need [`Self::exec_planned`] (pip does not run on an
    /// exec thread): here they are refused.
    pub fn exec_with(
        &self,
        tenant: &str,
        id: &str,
        code: &str,
        opts: ExecOptions<'_>,
    ) -> Result<ExecOutcome, SessionError> {
        self.exec_planned(tenant, id, code, opts, None)
    }

    /// The `%pip install` lines of `code` with their packages resolved and
    /// downloaded by the host (None: there are none). Runs the host's pip:
    /// call it off the (sandboxed) exec threads, then [`Self::exec_planned`].
    pub fn plan_pip(&self, tenant: &str, code: &str) -> Result<Option<PipPlan>, SessionError> {
        let Some(lines) = forkbox_engine::packages::pip_lines(code).map_err(SessionError::Invalid)? else {
            return Ok(None);
        };
        let mut resolved = Vec::with_capacity(lines.len());
        for l in &lines {
            resolved.push(self.resolve_packages_for(tenant, &l.specs)?);
        }
        Ok(Some(PipPlan { lines, resolved }))
    }

    /// `exec_with`, with the packages of the code's `%pip install` lines
    /// (`plan`, from [`Self::plan_pip`] on the same code) mounted first.
    pub fn exec_planned(
        &self,
        tenant: &str,
        id: &str,
        code: &str,
        opts: ExecOptions<'_>,
        plan: Option<&PipPlan>,
    ) -> Result<ExecOutcome, SessionError> {
        let (mut out, settle) = self.exec_deferred(tenant, id, code, opts, plan)?;
        if let Some(s) = settle {
            out.checkpoint = s.finish()?;
        }
        Ok(out)
    }

    /// [`Self::exec_planned`] that may leave the last step of the exec's
    /// checkpoint to the caller, to be done after it answered: the
    /// checkpoint's files are written (page cache) and checked, the outcome
    /// names it (`checkpoint.id` 0 until committed), and the [`Settle`]
    /// makes them durable and commits them (the fsyncs are most of a
    /// checkpoint's time). Until it has, every use of the session waits for
    /// it (the next exec, its record, its checkpoints, a fork, a delete), so
    /// no call sees it missing; if it fails, the session is back at the
    /// checkpoint before (a crash in between does the same) and its next exec
    /// or file operation fails with [`SessionError::Unsettled`] saying so.
    /// With an object store or PostgreSQL the checkpoint is committed before
    /// this returns (None): an upload or a remote commit can fail, and the
    /// client must hear of it with the answer.
    pub fn exec_deferred(
        &self,
        tenant: &str,
        id: &str,
        code: &str,
        opts: ExecOptions<'_>,
        plan: Option<&PipPlan>,
    ) -> Result<(ExecOutcome, Option<Settle<'_>>), SessionError> {
        match self.exec_inner(tenant, id, code, opts, plan, true)? {
            (result, Some((checkpoint, settle))) => Ok((ExecOutcome { result, checkpoint }, settle)),
            (_, None) => Err(SessionError::Invalid("an exec made no checkpoint".into())),
        }
    }

    /// An exec that makes no checkpoint: the code starts background work
    /// (`opts.job`) whose end a later [`Self::checkpoint_now`] records, so a
    /// command run as a job still makes one checkpoint, of its outcome.
    pub fn exec_uncheckpointed(
        &self,
        tenant: &str,
        id: &str,
        code: &str,
        opts: ExecOptions<'_>,
    ) -> Result<ExecResult, SessionError> {
        Ok(self.exec_inner(tenant, id, code, opts, None, false)?.0)
    }

    /// An exec, then (with `checkpoint`) its checkpoint: committed, or for a
    /// session's first one written and left to the returned [`Settle`].
    fn exec_inner(
        &self,
        tenant: &str,
        id: &str,
        code: &str,
        opts: ExecOptions<'_>,
        plan: Option<&PipPlan>,
        checkpoint: bool,
    ) -> Result<(ExecResult, Option<Checkpointed<'_>>), SessionError> {
        let lines = forkbox_engine::packages::pip_lines(code).map_err(SessionError::Invalid)?;
        let plan = match (lines, plan) {
            (None, _) => None,
            (Some(l), Some(p)) if l == p.lines => Some(p),
            (Some(_), _) => {
                return Err(SessionError::Invalid(
                    "`%pip install` lines are served in session execs only (not here)".into(),
                ))
            }
        };
        let rec = self.record(tenant, id)?;
        let slot = self.slot(id);
        let mut guard = lock_slot(&slot, id)?;
        self.take_settled(id, &mut guard, rec.head)?;
        // Interruptible from here on, also while the session is resumed from disk.
        let interrupter = opts.interrupt.clone().unwrap_or_default();
        interrupter.arm();
        self.running.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), interrupter.clone());
        let running = Running { map: &self.running, id, interrupter: interrupter.clone() };
        let limits = from_store_limits(&rec.limits);
        if !live(&guard.sandbox) {
            // (Gone with its worker process: the session is at its last checkpoint.)
            guard.sandbox = None;
        }
        self.hold(id, &mut guard)?;
        if guard.sandbox.is_none() {
            self.make_room(id);
            match self.bring_back(&rec, limits) {
                Ok(sb) => guard.sandbox = Some(sb),
                Err(e) => {
                    self.drop_resident(id, &mut guard);
                    return Err(e);
                }
            }
            guard.base = rec.head;
        }
        let base = guard.base;
        // `%pip install X` lines: their packages mounted before the code runs.
        let run_code = match plan {
            None => std::borrow::Cow::Borrowed(code),
            Some(plan) => {
                let Some(sb) = guard.sandbox.as_mut() else { return Err(SessionError::NotFound(id.into())) };
                let all: Vec<Package> = plan.resolved.iter().flatten().cloned().collect();
                let layers = self.package_layers(&all);
                self.check_package_quota(tenant, &layers)?;
                match Self::mount_planned(sb.as_mut(), code, plan) {
                    Ok(c) => {
                        // Mounted: the lineage refers to them (the GC keeps them, the quota counts them).
                        if let Err(e) = self.store.add_package_refs(id, &layers) {
                            self.drop_resident(id, &mut guard);
                            return Err(e.into());
                        }
                        std::borrow::Cow::Owned(c)
                    }
                    Err(e) => {
                        // Some lines' packages may be mounted already: memory is ahead of disk.
                        self.drop_resident(id, &mut guard);
                        return Err(e);
                    }
                }
            }
        };
        // The checkpoint number this exec will have, so its tracebacks say `<exec-N>` with the same N.
        let seq = self.store.reserve_seq(id)?;
        let Some(sb) = guard.sandbox.as_mut() else { return Err(SessionError::NotFound(id.into())) };
        let max = Duration::from_millis(rec.limits.timeout_ms);
        let timeout = Some(opts.timeout.map_or(max, |t| t.min(max)));
        sb.set_exec_id(seq);
        let result = sb.exec(&run_code, ExecOptions { interrupt: Some(interrupter), timeout, ..opts });
        drop(running);
        let result = match result {
            Ok(r) => r,
            Err(source) => {
                let _ = self.store.release_seq(id, seq);
                let output = sb.take_failed_output().map(Box::new);
                self.drop_resident(id, &mut guard);
                if source.error_code() == ErrorCode::CodeTooLarge {
                    return Err(SessionError::Engine(source));
                }
                return Err(SessionError::ExecFailed { source, checkpoint: self.seq_of(rec.head), output });
            }
        };
        if !checkpoint {
            let _ = self.store.release_seq(id, seq);
            guard.last_used = Instant::now();
            return Ok((result, None));
        }
        let fence = guard.lease.clone();
        let Some(sb) = guard.sandbox.as_mut() else { return Err(SessionError::NotFound(id.into())) };
        let written =
            self.write_checkpoint_files(&rec, sb.as_mut(), code, base, Some(seq), Some(&result), fence.as_ref());
        let (written, settle) = match written {
            // Settled by the caller after it answered. Only on the local disk
            // and SQLite: an object store's upload or a PostgreSQL commit can
            // fail, and the client must hear of it (storage_unavailable) rather
            // than be told of a checkpoint that then goes.
            Ok(w) if self.objects.is_none() && self.store.backend() == crate::db::Backend::Sqlite => {
                let checkpoint = w.provisional(seq);
                let cell = Arc::new(Settling::new(seq));
                self.settling.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), cell.clone());
                guard.pending = Some(cell.clone());
                let first = base.is_none() && rec.head.is_none();
                let warm = if first && self.host.kind() == InProcess.kind() { self.loaded(&rec).ok() } else { None };
                (Ok(checkpoint), Some(Settle { written: Some(w), cell, warm }))
            }
            Ok(w) => (w.settle(), None),
            Err(e) => (Err(e), None),
        };
        let checkpoint = match written {
            Ok(c) => c,
            Err(e) => {
                let _ = self.store.release_seq(id, seq);
                // Memory and disk now disagree: drop the sandbox, the session stays at its head.
                self.drop_resident(id, &mut guard);
                return Err(match e {
                    SessionError::QuotaExceeded { message, .. } => SessionError::QuotaExceeded {
                        message,
                        result: Some(Box::new(result)),
                        checkpoint: self.seq_of(rec.head),
                    },
                    e => e,
                });
            }
        };
        if settle.is_none() {
            guard.base = Some(checkpoint.id);
        }
        guard.last_used = Instant::now();
        drop(guard);
        // (The commit set `last_used_ms` already: no second write.)
        Ok((result, Some((checkpoint, settle))))
    }

    /// Change the session's tags (replaced as a whole) and/or limits (memory,
    /// the time limit of each exec), persisted. A memory change evicts a
    /// resident sandbox so that the next exec resumes under the new limit
    /// (`Busy` while an exec runs); tags and the time limit apply at once.
    pub fn update(
        &self,
        tenant: &str,
        id: &str,
        tags: Option<&BTreeMap<String, String>>,
        memory_bytes: Option<u64>,
        timeout: Option<Duration>,
    ) -> Result<SessionRecord, SessionError> {
        let rec = self.record(tenant, id)?;
        let timeout_ms = timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        let memory_changes = memory_bytes.is_some_and(|m| m != rec.limits.memory_bytes);
        let slot = memory_changes.then(|| self.slot(id));
        let guard = slot.as_ref().map(|s| lock_slot(s, id)).transpose()?;
        let mut guard = guard;
        if let Some(g) = guard.as_mut() {
            // Elsewhere: the owner must drop its sandbox (the request goes there).
            self.take_over(id, g)?;
        }
        let updated = self.store.update_session(tenant, id, tags, memory_bytes, timeout_ms);
        if let Some(g) = guard.as_mut() {
            self.drop_resident(id, g);
        }
        if !updated? {
            return Err(SessionError::NotFound(id.to_string()));
        }
        self.record(tenant, id)
    }

    /// Interrupt the session's running exec (Ctrl-C). False if none runs.
    pub fn interrupt(&self, tenant: &str, id: &str) -> Result<bool, SessionError> {
        self.record(tenant, id)?;
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
        match running {
            Some(i) => Ok(i.interrupt()),
            // Not running here: on the node that has the session, if another has it.
            None => {
                self.not_elsewhere(id)?;
                Ok(false)
            }
        }
    }

    /// The session's sandbox, resumed from disk if it was evicted; `Busy` while an exec runs.
    fn with_sandbox<T>(
        &self,
        tenant: &str,
        id: &str,
        f: impl FnOnce(
            &mut dyn Resident,
            Option<i64>,
            &SessionRecord,
            Option<&Lease>,
        ) -> Result<(T, Option<i64>), SessionError>,
    ) -> Result<T, SessionError> {
        let rec = self.record(tenant, id)?;
        let slot = self.slot(id);
        let mut guard = lock_slot(&slot, id)?;
        self.take_settled(id, &mut guard, rec.head)?;
        if !live(&guard.sandbox) {
            guard.sandbox = None;
        }
        self.hold(id, &mut guard)?;
        if guard.sandbox.is_none() {
            self.make_room(id);
            match self.bring_back(&rec, from_store_limits(&rec.limits)) {
                Ok(sb) => guard.sandbox = Some(sb),
                Err(e) => {
                    self.drop_resident(id, &mut guard);
                    return Err(e);
                }
            }
            guard.base = rec.head;
        }
        let base = guard.base;
        let fence = guard.lease.clone();
        let Some(sb) = guard.sandbox.as_mut() else { return Err(SessionError::NotFound(id.into())) };
        let (out, new_base) = f(sb.as_mut(), base, &rec, fence.as_ref())?;
        guard.base = new_base;
        guard.last_used = Instant::now();
        Ok(out)
    }

    /// Write a file into the session's file system (parents created, mode 0644)
    /// and checkpoint it (code `# upload <path>`), so it survives eviction and forks.
    pub fn write_file(
        &self,
        tenant: &str,
        id: &str,
        path: &str,
        data: &[u8],
    ) -> Result<CheckpointRecord, SessionError> {
        let storage = |e: std::io::Error| SessionError::File {
            code: ErrorCode::StorageError,
            message: format!("buffering an upload: {e}"),
        };
        let mut f = memfd().map_err(storage)?;
        std::io::Write::write_all(&mut f, data).map_err(storage)?;
        self.write_file_from(tenant, id, path, &f, data.len() as u64)
    }

    /// [`Self::write_file`] of the `len` bytes of `src` (an upload's temporary
    /// file, read from offset 0 a chunk at a time into the sandbox's file).
    pub fn write_file_from(
        &self,
        tenant: &str,
        id: &str,
        path: &str,
        src: &File,
        len: u64,
    ) -> Result<CheckpointRecord, SessionError> {
        let ((), c) = self.change_files(tenant, id, &format!("# upload {path}"), |sb| sb.write_file(path, src, len))?;
        Ok(c)
    }

    /// A file-system operation on the session's files from outside (stat, walk, mkdir,
    /// move, remove): no guest code runs. One that changes the files makes a
    /// checkpoint (its record is returned); reading makes none.
    pub fn file_op(
        &self,
        tenant: &str,
        id: &str,
        op: &FileOp,
    ) -> Result<(FileOpOutcome, Option<CheckpointRecord>), SessionError> {
        if !op.changes() {
            return self.with_sandbox(tenant, id, |sb, base, _, _| {
                Ok(((sb.file_op(op).map_err(SessionError::from_files)?, None), base))
            });
        }
        let (out, c) = self.change_files(tenant, id, &format!("# files: {}", op.label()), |sb| sb.file_op(op))?;
        Ok((out, Some(c)))
    }

    /// Change the session's files from outside with `change`, then checkpoint
    /// (named `label`). A refused change (a file error) changes nothing, or only
    /// creates parent directories; a failed checkpoint leaves memory ahead of
    /// disk, so the sandbox is dropped and the session starts over from disk.
    fn change_files<T>(
        &self,
        tenant: &str,
        id: &str,
        label: &str,
        change: impl FnOnce(&mut dyn Resident) -> Result<T, EngineError>,
    ) -> Result<(T, CheckpointRecord), SessionError> {
        let r = self.with_sandbox(tenant, id, |sb, base, rec, fence| {
            let out = change(sb).map_err(SessionError::from_files)?;
            let c = self.write_checkpoint(rec, sb, label, base, fence)?;
            let new_base = Some(c.id);
            Ok(((out, c), new_base))
        });
        match &r {
            Ok(_) => {
                let _ = self.store.touch(id, now_ms());
            }
            Err(SessionError::File { .. }) => {}
            Err(_) => {
                self.evict(id);
            }
        }
        r
    }

    /// Mount the packages of `plan` and give the code to run instead: each
    /// `%pip` line replaced by one that refreshes the guest's imports and
    /// prints pip's output there.
    fn mount_planned(sb: &mut dyn Resident, code: &str, plan: &PipPlan) -> Result<String, SessionError> {
        let mut outputs = Vec::with_capacity(plan.lines.len());
        for pkgs in &plan.resolved {
            let done = sb.install_packages(pkgs)?;
            outputs.push(forkbox_engine::packages::pip_output(&done));
        }
        Ok(forkbox_engine::packages::rewrite(code, &plan.lines, &outputs))
    }

    /// Resolve and download `specs` (and their dependencies) on the host, with
    /// the server's pip source and policy. Runs the host's pip: call it off the
    /// (sandboxed) exec threads, then [`Self::install_resolved`].
    pub fn resolve_packages(&self, specs: &[String]) -> Result<Vec<Package>, SessionError> {
        Ok(self.catalog.resolve_packages(specs)?)
    }

    /// [`Self::resolve_packages`] for `tenant`: a layer built now unpacks to
    /// at most what is left of the tenant's disk quota.
    pub fn resolve_packages_for(&self, tenant: &str, specs: &[String]) -> Result<Vec<Package>, SessionError> {
        let quota = self.quotas.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied();
        let budget = match quota {
            Some(max) => max.saturating_sub(self.charged_bytes(tenant)?),
            None => forkbox_engine::packages::MAX_LAYER_BYTES,
        };
        Ok(self.catalog.resolve_packages_within(specs, budget)?)
    }

    /// The layers of `pkgs` with their sizes on disk, each once.
    fn package_layers(&self, pkgs: &[Package]) -> Vec<(String, u64)> {
        let store = self.catalog.packages();
        let mut layers: Vec<(String, u64)> =
            pkgs.iter().map(|p| (p.sha256.clone(), store.layer_bytes(&p.sha256).unwrap_or(0))).collect();
        layers.sort();
        layers.dedup();
        layers
    }

    /// Refuse to mount `layers` if they take the tenant past its disk quota
    /// (`QuotaExceeded`); a layer its live sessions use already is not
    /// charged again. Once mounted, `Store::add_package_refs` records them.
    fn check_package_quota(&self, tenant: &str, layers: &[(String, u64)]) -> Result<(), SessionError> {
        let quota = self.quotas.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied();
        if let Some(max) = quota {
            let charged = self.store.tenant_package_layers(tenant)?;
            let new: u64 = layers
                .iter()
                .filter(|(l, _)| !charged.iter().any(|(c, _)| c == l))
                .fold(0u64, |a, (_, b)| a.saturating_add(*b));
            let used = charged.iter().fold(self.store.tenant_disk_bytes(tenant)?, |a, (_, b)| a.saturating_add(*b));
            if new > 0 && used.saturating_add(new) > max {
                let mib = |b: u64| b as f64 / (1 << 20) as f64;
                return Err(SessionError::QuotaExceeded {
                    message: format!(
                        "the package layers need {:.1} MiB and the tenant's checkpoints and packages take {:.1} MiB of its {:.1} MiB disk quota",
                        mib(new),
                        mib(used),
                        mib(max)
                    ),
                    result: None,
                    checkpoint: None,
                });
            }
        }
        Ok(())
    }

    /// What the tenant's disk quota counts: its live sessions' checkpoints and
    /// the package layers they use (each once).
    fn charged_bytes(&self, tenant: &str) -> Result<u64, StoreError> {
        let packages = self.store.tenant_package_layers(tenant)?;
        Ok(packages.iter().fold(self.store.tenant_disk_bytes(tenant)?, |a, (_, b)| a.saturating_add(*b)))
    }

    /// Remove the package layers no lineage (live session or checkpoint) and
    /// no template refers to, older than `min_age`; their ids.
    pub fn gc_packages(&self, min_age: Duration) -> Result<Vec<String>, SessionError> {
        let referenced = self.store.referenced_package_layers()?;
        Ok(self.catalog.gc_packages(&referenced, min_age))
    }

    /// Install packages into the session: resolved and downloaded by the host
    /// (the server's pip source and policy), each mounted from its shared,
    /// read-only layer, then checkpointed (code `# pip install SPEC...`) so
    /// the session keeps them across eviction, revert and forks. Nothing new
    /// (all installed already): no checkpoint.
    pub fn install_packages(&self, tenant: &str, id: &str, specs: &[String]) -> Result<PackagesOutcome, SessionError> {
        self.record(tenant, id)?;
        let pkgs = self.resolve_packages_for(tenant, specs)?;
        self.install_resolved(tenant, id, specs, &pkgs)
    }

    /// The second half of [`Self::install_packages`]: mount `pkgs` (resolved
    /// for `specs`), refresh the guest's imports, checkpoint. Runs the guest.
    pub fn install_resolved(
        &self,
        tenant: &str,
        id: &str,
        specs: &[String],
        pkgs: &[Package],
    ) -> Result<PackagesOutcome, SessionError> {
        let layers = self.package_layers(pkgs);
        self.check_package_quota(tenant, &layers)?;
        let r = self.with_sandbox(tenant, id, |sb, base, rec, fence| {
            let done = sb.install_packages(pkgs)?;
            // Mounted: the lineage refers to them (the GC keeps them, the quota counts them).
            self.store.add_package_refs(id, &layers)?;
            let output = forkbox_engine::packages::pip_output(&done);
            if !done.iter().any(|p| p.installed) {
                return Ok((PackagesOutcome { packages: done, output, checkpoint: None }, base));
            }
            // The guest looks again (sys.path, import caches); it prints nothing.
            let r = sb.exec(forkbox_engine::packages::REFRESH, ExecOptions::default())?;
            if let Some(e) = r.error {
                return Err(SessionError::Engine(EngineError::Package {
                    code: ErrorCode::PackageFailed,
                    message: format!("the guest could not refresh its imports: {}: {}", e.kind, e.message),
                }));
            }
            let c = self.write_checkpoint(rec, sb, &format!("# pip install {}", specs.join(" ")), base, fence)?;
            let new_base = Some(c.id);
            Ok((PackagesOutcome { packages: done, output, checkpoint: Some(c) }, new_base))
        });
        match &r {
            Ok(_) => {
                let _ = self.store.touch(id, now_ms());
            }
            // A refused install changes nothing (`install_packages` is all or nothing).
            Err(SessionError::Engine(EngineError::Package { .. })) | Err(SessionError::Busy(_)) => {}
            Err(_) => {
                self.evict(id);
            }
        }
        r
    }

    /// A file of the session's file system, at most `max` bytes.
    pub fn read_file(&self, tenant: &str, id: &str, path: &str, max: usize) -> Result<Vec<u8>, SessionError> {
        self.with_sandbox(tenant, id, |sb, base, _, _| {
            Ok((sb.read_file(path, max).map_err(SessionError::from_files)?, base))
        })
    }

    /// `f` on the session's sandbox if it is resident here; None if it is not
    /// (then it has no background jobs: they are not brought back from disk, so
    /// a job operation never resumes an evicted or paused session).
    fn with_resident<T>(
        &self,
        tenant: &str,
        id: &str,
        f: impl FnOnce(&mut dyn Resident) -> Result<T, SessionError>,
    ) -> Result<Option<T>, SessionError> {
        self.record(tenant, id)?;
        let slot = self.slot(id);
        let mut guard = lock_slot(&slot, id)?;
        if !live(&guard.sandbox) {
            drop(guard);
            // In a cluster it may be resident on another node: the request belongs there.
            self.not_elsewhere(id)?;
            return Ok(None);
        }
        self.hold(id, &mut guard)?;
        let Some(sb) = guard.sandbox.as_mut() else { return Ok(None) };
        let out = f(sb.as_mut())?;
        guard.last_used = Instant::now();
        Ok(Some(out))
    }

    /// The session's background jobs (a session brought back from disk has none).
    pub fn jobs(&self, tenant: &str, id: &str) -> Result<Vec<JobInfo>, SessionError> {
        Ok(self.with_resident(tenant, id, |sb| Ok(sb.jobs()?))?.unwrap_or_default())
    }

    /// The listening TCP sockets of the session's sandbox; `None` when it is
    /// not resident (its listeners come back with it when a request resumes it).
    pub fn listening_ports(&self, tenant: &str, id: &str) -> Result<Option<Vec<ListeningPort>>, SessionError> {
        self.with_resident(tenant, id, |sb| Ok(sb.listening_ports()?))
    }

    /// One background job of the session.
    pub fn job(&self, tenant: &str, id: &str, pid: u32) -> Result<JobInfo, SessionError> {
        let jobs = self.jobs(tenant, id)?;
        Ok(jobs.into_iter().find(|j| j.pid == pid).ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// A slice of a background job's stdout or stderr.
    pub fn job_output(
        &self,
        tenant: &str,
        id: &str,
        pid: u32,
        stream: Stream,
        offset: u64,
        max: usize,
    ) -> Result<JobChunk, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_output(pid, stream, offset, max)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Send a signal to a background job's processes.
    pub fn job_signal(&self, tenant: &str, id: &str, pid: u32, signal: i32) -> Result<JobInfo, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_signal(pid, signal)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Wait (at most `timeout`) for a background job to end.
    pub fn job_wait(&self, tenant: &str, id: &str, pid: u32, timeout: Duration) -> Result<JobInfo, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_wait(pid, timeout)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Wait (at most `timeout`) for a background job to write past `offsets`
    /// (stdout, stderr bytes) or end: a follower's next step.
    pub fn job_watch(
        &self,
        tenant: &str,
        id: &str,
        pid: u32,
        offsets: [u64; 2],
        timeout: Duration,
    ) -> Result<JobInfo, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_watch(pid, offsets, timeout)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Watch the file system's changes of the session's sandbox from `since`
    /// (None: stop watching), waiting at most `timeout` for one. None when it
    /// is not resident (a watch never resumes an evicted or paused session;
    /// its journal did not come back with it).
    pub fn fs_watch(
        &self,
        tenant: &str,
        id: &str,
        since: Option<u64>,
        timeout: Duration,
    ) -> Result<Option<Changes>, SessionError> {
        Ok(self.with_resident(tenant, id, |sb| Ok(sb.fs_watch(since, timeout)?))?.flatten())
    }

    /// What the session's sandbox uses now; None when it is not resident.
    pub fn usage(&self, tenant: &str, id: &str) -> Result<Option<Usage>, SessionError> {
        self.with_resident(tenant, id, |sb| Ok(sb.usage()?))
    }

    /// Write to a background job's stdin, then close it if `eof`.
    pub fn job_stdin(&self, tenant: &str, id: &str, pid: u32, data: &[u8], eof: bool) -> Result<JobInfo, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_stdin(pid, data, eof)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Resize the terminal of a background job started on a pty.
    pub fn job_resize(&self, tenant: &str, id: &str, pid: u32, rows: u16, cols: u16) -> Result<JobInfo, SessionError> {
        let r = self.with_resident(tenant, id, |sb| Ok(sb.job_resize(pid, rows, cols)?))?;
        Ok(r.ok_or(EngineError::NoSuchJob(pid))?)
    }

    /// Checkpoint the session as it is now (named `label`), with no guest
    /// code run: what background work changed since the last checkpoint.
    pub fn checkpoint_now(&self, tenant: &str, id: &str, label: &str) -> Result<CheckpointRecord, SessionError> {
        let r = self.with_sandbox(tenant, id, |sb, base, rec, fence| {
            let c = self.write_checkpoint(rec, sb, label, base, fence)?;
            let new_base = Some(c.id);
            Ok((c, new_base))
        });
        match &r {
            Ok(_) => {
                let _ = self.store.touch(id, now_ms());
            }
            // Nothing was written: the sandbox is as it was.
            Err(SessionError::Busy(_) | SessionError::NotFound(_)) => {}
            // A failed checkpoint may leave memory ahead of what disk can bring back.
            Err(_) => {
                self.evict(id);
            }
        }
        r
    }

    /// A connection to the listener on `port` inside the session's sandbox
    /// (brought back first if it was evicted): the host end of a stream
    /// socket pair whose other end the guest accepts as a TCP connection from
    /// loopback. Only the sandbox's own listeners can take it.
    pub fn connect_port(
        &self,
        tenant: &str,
        id: &str,
        port: u16,
    ) -> Result<std::os::unix::net::UnixStream, SessionError> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| {
            SessionError::Engine(EngineError::Protocol(format!("a socket pair for the connection: {e}")))
        })?;
        self.with_sandbox(tenant, id, |sb, base, _, _| Ok((sb.connect_port(port, theirs.into())?, base)))?;
        Ok(ours)
    }

    /// The entries of a directory of the session's file system.
    pub fn list_files(&self, tenant: &str, id: &str, dir: &str) -> Result<Vec<FileEntry>, SessionError> {
        self.with_sandbox(tenant, id, |sb, base, _, _| Ok((sb.list_dir(dir).map_err(SessionError::from_files)?, base)))
    }

    /// What the tenant's disk quota counts: the checkpoint bytes of all its
    /// sessions and the package layers they use (each once).
    pub fn disk_bytes(&self, tenant: &str) -> Result<u64, SessionError> {
        Ok(self.charged_bytes(tenant)?)
    }

    /// Set (or clear: `None`) the tenant's checkpoint disk quota in bytes: a
    /// checkpoint that would take the tenant's checkpoints past it is refused
    /// before anything is written (`quota_exceeded`).
    pub fn set_disk_quota(&self, tenant: &str, bytes: Option<u64>) {
        let mut q = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        match bytes {
            Some(b) => {
                if q.get(tenant) != Some(&b) {
                    q.insert(tenant.to_string(), b);
                }
            }
            None => {
                q.remove(tenant);
            }
        }
    }

    /// Admit a checkpoint of `bytes` for `tenant`: within its quota (counting
    /// the tenant's other checkpoints being written) and leaving the disk
    /// reserve free. The reservation lasts until the guard is dropped.
    fn admit(&self, tenant: &str, bytes: u64) -> Result<Reserved<'_>, SessionError> {
        if let Some(free) = free_bytes(&self.layers_dir) {
            if free.saturating_sub(bytes) < self.config.disk_reserve || free < bytes {
                return Err(SessionError::NoSpace(format!(
                    "it needs {bytes} bytes, {free} are free and {} are kept in reserve",
                    self.config.disk_reserve
                )));
            }
        }
        let quota = self.quotas.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied();
        let mut r = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(max) = quota {
            let used = self.charged_bytes(tenant)?;
            let pending = r.by_tenant.get(tenant).copied().unwrap_or(0);
            if used.saturating_add(pending).saturating_add(bytes) > max {
                return Err(SessionError::QuotaExceeded {
                    message: format!(
                        "the checkpoint of this exec needs {:.1} MiB and the tenant's checkpoints take {:.1} MiB of its {:.1} MiB disk quota",
                        bytes as f64 / (1 << 20) as f64,
                        used.saturating_add(pending) as f64 / (1 << 20) as f64,
                        max as f64 / (1 << 20) as f64
                    ),
                    result: None,
                    checkpoint: None,
                });
            }
        }
        *r.by_tenant.entry(tenant.to_string()).or_insert(0) += bytes;
        Ok(Reserved { m: &self.reserved, tenant: tenant.to_string(), bytes })
    }

    fn write_checkpoint(
        &self,
        rec: &SessionRecord,
        sb: &mut dyn Resident,
        code: &str,
        parent: Option<i64>,
        fence: Option<&Lease>,
    ) -> Result<CheckpointRecord, SessionError> {
        self.write_checkpoint_as(rec, sb, code, parent, None, None, fence)
    }

    /// `seq`: a number from `Store::reserve_seq` (None: the lineage's next).
    /// `result`: the exec's, whose summary and bounded output (`crate::output`)
    /// are kept with the checkpoint, the output admitted with its files.
    /// `fence`: this node's lease of the session (a cluster): the commit is
    /// refused if another node has taken the session meanwhile.
    ///
    /// The files are temp files this process makes in the layers directory and
    /// hands to the sandbox open (a worker process writes into them and never
    /// names a path); once written they are checked against what the sandbox
    /// announced and was admitted for, fsynced and renamed, then committed.
    #[allow(clippy::too_many_arguments)]
    fn write_checkpoint_as(
        &self,
        rec: &SessionRecord,
        sb: &mut dyn Resident,
        code: &str,
        parent: Option<i64>,
        seq: Option<i64>,
        result: Option<&ExecResult>,
        fence: Option<&Lease>,
    ) -> Result<CheckpointRecord, SessionError> {
        self.write_checkpoint_files(rec, sb, code, parent, seq, result, fence)?.settle()
    }

    /// The first half of [`Self::write_checkpoint_as`]: the sandbox writes
    /// the checkpoint into temp files (page cache, nothing synced). The
    /// second, [`Written::settle`], makes them durable and commits them; the
    /// session must not be used in between (see [`Self::exec_deferred`]).
    #[allow(clippy::too_many_arguments)]
    fn write_checkpoint_files(
        &self,
        rec: &SessionRecord,
        sb: &mut dyn Resident,
        code: &str,
        parent: Option<i64>,
        seq: Option<i64>,
        result: Option<&ExecResult>,
        fence: Option<&Lease>,
    ) -> Result<Written<'_>, SessionError> {
        let summary = result.and_then(summarize);
        let output = result.and_then(|r| match CallOutput::of(r).to_json() {
            Ok(j) => Some(j),
            Err(e) => {
                tracing::warn!(session = %rec.id, "the call's output is not kept: {e}");
                None
            }
        });
        let output_bytes = output.as_ref().map_or(0, |o| o.len() as u64);
        let name = random_id("c_");
        let (layer, state, pack) = (format!("{name}.layer"), format!("{name}.state"), format!("{name}.files"));
        let procs = forkbox_snapshot::files::procs_name(&pack);
        let mut reservation = None;
        // (temp path, final name, our own handle) of each file made.
        let mut made: Vec<(PathBuf, String, std::fs::File)> = Vec::new();
        let mut admitted = 0u64;
        let written = sb.checkpoint(&pack, &mut |size| {
            reservation = Some(self.admit(&rec.tenant, size.bytes.saturating_add(output_bytes))?);
            admitted = size.bytes;
            let mut create = |final_name: &str| -> Result<std::fs::File, SessionError> {
                let tmp = self.layers_dir.join(format!("{final_name}.tmp"));
                let f = create_temp(&tmp)?;
                let ours = f.try_clone().map_err(|e| StateError::io("dup", &tmp, e))?;
                made.push((tmp, final_name.to_string(), ours));
                Ok(f)
            };
            Ok(CheckpointFiles {
                layer: create(&layer)?,
                pack: if size.pack { Some(create(&pack)?) } else { None },
                procs: if size.procs { Some(create(&procs)?) } else { None },
                state: create(&state)?,
            })
        });
        let remove_temps = |made: &[(PathBuf, String, std::fs::File)]| {
            for (tmp, _, _) in made {
                let _ = std::fs::remove_file(tmp);
            }
        };
        let stats = match written {
            Ok(st) => st,
            Err(e) => {
                remove_temps(&made);
                return Err(match e {
                    SessionError::Engine(EngineError::Snapshot(s)) if s.is_no_space() => {
                        SessionError::NoSpace(s.to_string())
                    }
                    SessionError::Engine(EngineError::Snapshot(s)) => SessionError::Snapshot(s),
                    e => e,
                });
            }
        };
        // What the sandbox wrote must be what it said it would (a worker process
        // is not trusted): each file's size, and together what was admitted.
        let settled = (|| -> Result<u64, SessionError> {
            let mut total = 0u64;
            for (tmp, final_name, f) in &made {
                let len = f.metadata().map_err(|e| StateError::io("stat", tmp, e))?.len();
                let said = if *final_name == layer {
                    stats.layer.bytes
                } else if *final_name == pack {
                    stats.pack_bytes
                } else if *final_name == procs {
                    stats.procs_bytes
                } else {
                    stats.state_bytes
                };
                if len != said {
                    return Err(StateError::Corrupt(format!(
                        "checkpoint file {final_name} holds {len} bytes, the sandbox said {said}"
                    ))
                    .into());
                }
                total = total.saturating_add(len);
            }
            if total != admitted || total != stats.bytes() {
                return Err(StateError::Corrupt(format!(
                    "the checkpoint holds {total} bytes, {admitted} were announced and admitted"
                ))
                .into());
            }
            Ok(total)
        })();
        let bytes = match settled {
            Ok(b) => b,
            Err(e) => {
                remove_temps(&made);
                return Err(e);
            }
        };
        Ok(Written {
            m: self,
            session_id: rec.id.clone(),
            parent,
            code: code.to_string(),
            layer,
            state,
            pack,
            pack_bytes: stats.pack_bytes,
            pages: stats.layer.pages,
            bytes,
            checksum: format!("{:08x}", stats.layer.crc),
            output,
            summary,
            seq,
            fence: fence.cloned(),
            made,
            reservation,
        })
    }

    /// The sandbox of a session that is not resident: from its head checkpoint, or a fresh fork.
    /// A head owned by another session means this session was forked from it
    /// and has not run yet: its in-memory RNGs must diverge from the source's.
    fn bring_back(&self, rec: &SessionRecord, limits: Limits) -> Result<Box<dyn Resident>, SessionError> {
        let t = self.loaded(rec)?;
        match rec.head {
            None => self.start_fresh(&rec.tenant, &t, limits, ResumeAs::Same),
            Some(head) => {
                let forked = self.store.checkpoint(head)?.is_some_and(|c| c.session_id != rec.id);
                let how = if forked { ResumeAs::Fork } else { ResumeAs::Same };
                self.resume_as(&rec.tenant, &t, head, limits, how)
            }
        }
    }

    /// A sandbox of a fresh fork of the template. The secrets' placeholders
    /// go into the guest's environment before anything runs (and so into its
    /// checkpoints: only the placeholders, the values never enter the sandbox).
    pub(crate) fn start_fresh(
        &self,
        tenant: &str,
        template: &Loaded,
        limits: Limits,
        how: ResumeAs,
    ) -> Result<Box<dyn Resident>, SessionError> {
        let prelude = forkbox_engine::net_secrets::env_prelude(&limits.network.secrets);
        let mut sb = self.host.start(Start { tenant, template, limits, how, from: None })?;
        if let Some(code) = prelude {
            let r = sb.exec(&code, ExecOptions::default()).map_err(SessionError::Engine)?;
            if let Some(e) = r.error {
                return Err(SessionError::Invalid(format!("setting the secrets' variables failed: {}", e.message)));
            }
        }
        Ok(sb)
    }

    /// Make a session resident (resume it from disk) without running anything.
    pub fn resume(&self, tenant: &str, id: &str) -> Result<(), SessionError> {
        self.with_sandbox(tenant, id, |_, base, _, _| Ok(((), base)))
    }

    /// Layers newest first from `head` back to the nearest flat layer (or the
    /// template), read here (compaction, in this process).
    fn layer_chain(&self, head: i64) -> Result<(Vec<Layer>, CheckpointRecord), SessionError> {
        let chain = self.store.ancestry(head)?;
        let (names, head_rec) = layer_names(&chain, head)?;
        // From the object store first if they are not here (pinned while read).
        let _pinned = match &self.objects {
            Some(o) => Some(o.ensure_local(&self.store, &names)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(names.len());
        for n in &names {
            match Layer::read(&self.layers_dir.join(n)) {
                Ok(l) => layers.push(l),
                Err(e) => return Err(self.missing(n, e)),
            }
        }
        Ok((layers, head_rec))
    }

    /// The error for a checkpoint file that cannot be read here: only in an
    /// object store, and none is configured, says so.
    fn missing(&self, name: &str, e: StateError) -> SessionError {
        if self.objects.is_none() && !self.layers_dir.join(name).is_file() {
            if let Ok(Some(_)) = self.store.object(name) {
                return ObjectError::NotConfigured(name.to_string()).into();
            }
        }
        e.into()
    }

    /// Open a file of the layers directory to hand to a sandbox.
    fn open_named(&self, name: &str) -> Result<NamedFile, SessionError> {
        let path = self.layers_dir.join(name);
        match std::fs::File::open(&path) {
            Ok(file) => Ok(NamedFile { name: name.to_string(), file }),
            Err(e) => Err(self.missing(name, StateError::io("open", &path, e))),
        }
    }

    /// Bring checkpoint `head` back as `how` says, on the sessions' host: its
    /// layer chain, state and (on request) packs opened here and handed over.
    pub(crate) fn resume_as(
        &self,
        tenant: &str,
        t: &Loaded,
        head: i64,
        limits: Limits,
        how: ResumeAs,
    ) -> Result<Box<dyn Resident>, SessionError> {
        let t0 = Instant::now();
        let chain = self.store.ancestry(head)?;
        let (mut names, rec) = layer_names(&chain, head)?;
        names.push(rec.state.clone());
        let pinned = match &self.objects {
            Some(o) => Some(o.ensure_local(&self.store, &names)?),
            None => None,
        };
        let state = names.pop().map(|n| self.open_named(&n)).transpose()?;
        let Some(state) = state else { return Err(SessionError::CheckpointNotFound(String::new(), head)) };
        let layers = names.iter().map(|n| self.open_named(n)).collect::<Result<Vec<_>, _>>()?;
        // Open: the cache may drop them now.
        drop(pinned);
        tracing::debug!(elapsed = ?t0.elapsed(), layers = layers.len(), "opened the layer chain");
        // The state names the packs and process memory files it reads; only
        // its lineage's are handed over.
        let lineage: std::collections::HashSet<String> = chain
            .iter()
            .flat_map(|c| {
                let pack = Path::new(&c.state).with_extension("files").to_string_lossy().into_owned();
                [forkbox_snapshot::files::procs_name(&pack), pack]
            })
            .collect();
        let mut packs = |wanted: &[String]| -> Result<Vec<NamedFile>, SessionError> {
            if wanted.len() > lineage.len() {
                return Err(StateError::Corrupt("the state names more packs than its lineage has".into()).into());
            }
            if let Some(w) = wanted.iter().find(|w| !lineage.contains(*w)) {
                return Err(StateError::Corrupt(format!("the state names pack {w:?}, not one of its lineage's")).into());
            }
            let _pinned = match &self.objects {
                Some(o) => Some(o.ensure_local(&self.store, wanted)?),
                None => None,
            };
            wanted.iter().map(|n| self.open_named(n)).collect()
        };
        let from = CheckpointIn { layers, state, packs: &mut packs };
        self.host.start(Start { tenant, template: t, limits, how, from: Some(from) })
    }

    /// Background upkeep, off the exec path: evict idle sessions, merge long
    /// layer chains of session heads, remove what no session needs. A server
    /// calls it periodically; the CLI after each command.
    pub fn maintenance(&self) -> Result<(), SessionError> {
        self.evict_idle();
        // A cluster: each node merges the chains of the sessions it has (two
        // nodes merging one chain at once would each write a flat layer).
        let mine: Option<std::collections::HashSet<String>> = match self.node_id() {
            Some(me) => Some(self.store.owned_sessions(me)?.into_iter().collect()),
            None => None,
        };
        for s in self.store.all_sessions()? {
            if mine.as_ref().is_some_and(|m| !m.contains(&s.id)) {
                continue;
            }
            if let Some(h) = s.head {
                if let Err(e) = self.compact(h) {
                    tracing::warn!("compacting the layers of session {}: {e}", s.id);
                }
            }
        }
        self.gc()?;
        let due = {
            let mut at = self.packages_gc_at.lock().unwrap_or_else(|e| e.into_inner());
            let due = at.is_none_or(|t| t.elapsed() >= PACKAGE_GC_EVERY);
            if due {
                *at = Some(Instant::now());
            }
            due
        };
        if due {
            self.gc_packages(PACKAGE_GC_MIN_AGE)?;
        }
        Ok(())
    }

    /// Merge a long chain into a flat layer for `checkpoint`.
    pub fn compact(&self, checkpoint: i64) -> Result<bool, SessionError> {
        let chain = self.store.ancestry(checkpoint)?;
        let since_flat = chain.iter().rev().take_while(|c| c.flat.is_none()).count();
        if since_flat < self.config.compact_after {
            return Ok(false);
        }
        let (layers, rec) = self.layer_chain(checkpoint)?;
        let name = format!("{}.flat", random_id("f_"));
        forkbox_snapshot::layer::write_flat(&self.layers_dir.join(&name), &layers)?;
        let Some(o) = &self.objects else {
            self.store.set_flat(rec.id, Some(&name))?;
            return Ok(true);
        };
        let uploaded = match o.upload(&self.store, &[&name]) {
            Ok(u) => u,
            Err(e) => {
                let _ = std::fs::remove_file(self.layers_dir.join(&name));
                return Err(e.into());
            }
        };
        match self.store.set_flat_with(rec.id, Some(&name), uploaded.stored.first()) {
            Ok(()) => {
                o.committed(uploaded);
                Ok(true)
            }
            Err(e) => {
                let _ = std::fs::remove_file(self.layers_dir.join(&name));
                o.abandon(&self.store, uploaded);
                Err(e.into())
            }
        }
    }

    /// A template named `name` of `tenant` (visible to it only) made of checkpoint
    /// `seq` of session `id`: the checkpoint resumed (reseeded, as a fork would be),
    /// then its whole state written as a template of its own (memory, registers,
    /// process state with the files), so deleting the session leaves it working.
    pub fn checkpoint_template(
        &self,
        tenant: &str,
        id: &str,
        seq: i64,
        name: &str,
    ) -> Result<forkbox_catalog::catalog::Listing, SessionError> {
        forkbox_catalog::catalog::validate_name(name)?;
        let rec = self.record(tenant, id)?;
        let target = self.find_checkpoint(&rec, seq)?;
        let t = self.loaded(&rec)?;
        let limits = from_store_limits(&rec.limits);
        // The template carries the session's secrets: their placeholders are in its memory.
        let secrets = limits.network.secrets.clone();
        let mut sb = self.resume_as(tenant, &t, target.id, limits, ResumeAs::Fork)?;
        Ok(self.catalog.add_from_snapshot(
            Some(tenant),
            name,
            &t,
            id,
            seq,
            secrets,
            |tid, preload, memory, state| sb.snapshot_template(tid, preload, memory, state),
        )?)
    }

    /// Point the session at one of its checkpoints (by seq); later execs continue from there.
    pub fn revert(&self, tenant: &str, id: &str, seq: i64) -> Result<CheckpointRecord, SessionError> {
        let rec = self.record(tenant, id)?;
        let target = self.find_checkpoint(&rec, seq)?;
        let slot = self.slot(id);
        let mut guard = lock_slot(&slot, id)?;
        // A cluster: the session is taken (any other holder's commit is refused from now on).
        self.take_over(id, &mut guard)?;
        let moved = self.store.set_head(id, Some(target.id));
        self.drop_resident(id, &mut guard);
        moved?;
        Ok(target)
    }

    /// A checkpoint of this session's history by seq (its own, or one it was forked from).
    fn find_checkpoint(&self, rec: &SessionRecord, seq: i64) -> Result<CheckpointRecord, SessionError> {
        if let Some(c) = self.store.checkpoint_by_seq(&rec.id, seq)? {
            return Ok(c);
        }
        // Another session of the lineage may have it answered for and not committed yet.
        self.wait_settled(None);
        if let Some(c) = self.store.checkpoint_by_seq(&rec.id, seq)? {
            return Ok(c);
        }
        Err(SessionError::CheckpointNotFound(rec.id.clone(), seq))
    }

    /// A new session starting at a checkpoint of `id` (its head by default).
    /// The source is never paused and nothing is copied: the new session's head
    /// is that checkpoint (on disk); it is resumed, reseeded, on its first exec.
    pub fn fork(
        &self,
        tenant: &str,
        id: &str,
        seq: Option<i64>,
        tags: BTreeMap<String, String>,
    ) -> Result<SessionRecord, SessionError> {
        let rec = self.record(tenant, id)?;
        let head = match seq {
            Some(s) => Some(self.find_checkpoint(&rec, s)?.id),
            None => rec.head,
        };
        self.create_at(tenant, tags, &from_store_limits(&rec.limits), head, &rec.template_id)
    }

    pub fn delete(&self, tenant: &str, id: &str) -> Result<(), SessionError> {
        self.record(tenant, id)?;
        // A cluster: where it is resident, so that node drops its sandbox.
        self.not_elsewhere(id)?;
        let slot = self.slot(id);
        let guard = lock_slot(&slot, id)?;
        if !self.store.delete_session(tenant, id)? {
            return Err(SessionError::NotFound(id.to_string()));
        }
        drop(guard);
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        self.gc()?;
        Ok(())
    }

    /// Remove checkpoints (and their files) no live session needs.
    pub fn gc(&self) -> Result<u64, SessionError> {
        let dead = self.store.delete_unreferenced_checkpoints()?;
        Ok(self.remove_files(&dead))
    }

    fn remove_files(&self, dead: &[CheckpointRecord]) -> u64 {
        let mut removed = 0;
        let mut names = Vec::new();
        for c in dead {
            for f in checkpoint_files(&c.layer, &c.state, c.flat.as_deref()) {
                if std::fs::remove_file(self.layers_dir.join(&f)).is_ok() {
                    removed += 1;
                }
                names.push(f);
            }
        }
        self.forget_objects(&names);
        removed
    }

    /// With an object store: the files `names` are gone; delete their objects
    /// unless another file has the same contents.
    fn forget_objects(&self, names: &[String]) {
        let Some(o) = &self.objects else { return };
        o.removed(names);
        match self.store.forget_objects(names) {
            Ok(shas) => {
                o.delete(shas);
            }
            Err(e) => tracing::warn!("forgetting the objects of deleted checkpoints: {e}"),
        }
    }

    /// Counters of the object store (None without one).
    pub fn object_stats(&self) -> Option<ObjectStats> {
        self.objects.as_ref().map(Objects::stats)
    }

    /// With an object store: remove cached files over the bound now (it is
    /// also done after each checkpoint and fetch). Returns how many went.
    pub fn trim_cache(&self) -> usize {
        self.objects.as_ref().map_or(0, Objects::trim)
    }

    /// Evict one session's sandbox (it stays on disk at its head).
    pub fn evict(&self, id: &str) -> bool {
        let Some(slot) = self.slots.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned() else { return false };
        let evicted = match slot.try_lock() {
            Ok(mut g) => {
                let was = g.sandbox.is_some();
                self.drop_resident(id, &mut g);
                was
            }
            Err(_) => false,
        };
        evicted
    }

    /// Evict sessions idle longer than the configured timeout.
    pub fn evict_idle(&self) -> usize {
        let slots: Vec<(String, Arc<Mutex<Slot>>)> =
            self.slots.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut n = 0;
        for (id, s) in slots {
            if let Ok(mut g) = s.try_lock() {
                // Running threads or processes count as use: such a session is not idle.
                let running = g.sandbox.as_ref().is_some_and(|s| s.has_background());
                if g.sandbox.is_some() && !running && g.last_used.elapsed() >= self.config.idle_timeout {
                    self.drop_resident(&id, &mut g);
                    n += 1;
                }
            }
        }
        n
    }

    pub fn resident_count(&self) -> usize {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.values().filter(|s| s.try_lock().map(|g| live(&g.sandbox)).unwrap_or(true)).count()
    }

    /// Keep at most `max_resident - 1` others resident before bringing one back (LRU).
    fn make_room(&self, except: &str) {
        /// (runs background work, last used): the order of eviction.
        type EvictKey = (bool, Instant);
        let slots: Vec<(String, Arc<Mutex<Slot>>)> =
            self.slots.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        // Sessions with running background work go last, least recently used first within each kind.
        let mut resident: Vec<(EvictKey, String, Arc<Mutex<Slot>>)> = slots
            .into_iter()
            .filter(|(k, _)| k != except)
            .filter_map(|(k, s)| {
                let key = s.try_lock().ok().filter(|g| live(&g.sandbox)).map(|g| {
                    let running = g.sandbox.as_ref().is_some_and(|sb| sb.has_background());
                    (running, g.last_used)
                })?;
                Some((key, k, s))
            })
            .collect();
        if resident.len() < self.config.max_resident {
            return;
        }
        resident.sort_by_key(|(key, _, _)| *key);
        let excess = resident.len() + 1 - self.config.max_resident;
        for ((running, _), id, s) in resident.into_iter().take(excess) {
            if let Ok(mut g) = s.try_lock() {
                if running {
                    // Every resident session runs background work: the limit wins, loudly.
                    tracing::warn!(
                        "evicting session {id} with running background processes: {} sessions are resident at most",
                        self.config.max_resident
                    );
                }
                self.drop_resident(&id, &mut g);
            }
        }
    }

    /// After a crash or kill: drop temp files and files no checkpoint names,
    /// and rewind sessions whose head checkpoint lost a file.
    fn recover(&self) -> Result<(), SessionError> {
        let all = self.store.all_checkpoints()?;
        // Files in an object store (only if one was ever used): a file that
        // is not here but there is not lost (the directory is a cache).
        let uploaded: std::collections::HashSet<String> =
            self.store.all_objects()?.into_iter().map(|o| o.name).collect();
        let here = |f: &str| self.layers_dir.join(f).is_file() || uploaded.contains(f);
        let mut named = std::collections::HashSet::new();
        let mut broken = Vec::new();
        for c in &all {
            for f in checkpoint_files(&c.layer, &c.state, c.flat.as_deref()) {
                named.insert(f);
            }
            // Files are renamed into place (after fsync) before their row is
            // committed, so a committed row with a missing file means outside damage.
            // Contents are verified (checksums) when a checkpoint is resumed.
            let ok = [&c.layer, &c.state].iter().all(|f| here(f));
            if !ok {
                broken.push(c.id);
            }
            if let Some(flat) = &c.flat {
                if !here(flat) {
                    self.store.set_flat(c.id, None)?;
                }
            }
        }
        // Objects of files no checkpoint names (a kill between an upload and
        // its commit cannot leave one; a kill in gc can).
        let orphans: Vec<String> = uploaded.iter().filter(|n| !named.contains(*n)).cloned().collect();
        if !orphans.is_empty() && self.objects.is_some() {
            self.forget_objects(&orphans);
        }
        if !broken.is_empty() {
            let rewind = self.store.drop_checkpoints_and_rewind(&broken)?;
            tracing::warn!(
                "recovery: {} checkpoints lost files; {} checkpoints dropped, {} sessions rewound",
                broken.len(),
                rewind.deleted.len(),
                rewind.moved.len()
            );
            self.remove_files(&rewind.deleted);
        }
        if let Ok(rd) = std::fs::read_dir(&self.layers_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !named.contains(&name) {
                    let _ = std::fs::remove_file(e.path());
                    if let Some(o) = &self.objects {
                        o.removed(std::slice::from_ref(&name));
                    }
                }
            }
        }
        self.gc()?;
        self.upload_missing()?;
        Ok(())
    }

    /// With an object store: upload the files of committed checkpoints that are
    /// not in it yet (a home used before `--objects`). Best effort: on a failure
    /// (logged) the rest stay local only, and are never removed from the cache.
    fn upload_missing(&self) -> Result<(), SessionError> {
        let Some(o) = &self.objects else { return Ok(()) };
        let uploaded: std::collections::HashSet<String> =
            self.store.all_objects()?.into_iter().map(|o| o.name).collect();
        let mut todo = Vec::new();
        for c in self.store.all_checkpoints()? {
            for f in checkpoint_files(&c.layer, &c.state, c.flat.as_deref()) {
                if !uploaded.contains(&f) && self.layers_dir.join(&f).is_file() {
                    todo.push(f);
                }
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        for chunk in todo.chunks(16) {
            let names: Vec<&str> = chunk.iter().map(String::as_str).collect();
            match o.upload(&self.store, &names) {
                Ok(up) => {
                    self.store.add_objects(&up.stored)?;
                    o.committed(up);
                }
                Err(e) => {
                    tracing::warn!("uploading the checkpoint files from before --objects: {e}; they stay local only");
                    return Ok(());
                }
            }
        }
        tracing::info!("uploaded {} checkpoint files from before --objects", todo.len());
        Ok(())
    }
}

/// An anonymous in-memory file ([`SessionManager::write_file`]'s bytes, handed over like an upload's file).
fn memfd() -> std::io::Result<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(c"forkbox-upload".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}
