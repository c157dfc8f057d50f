//! Where the sandboxes of sessions live: a [`SandboxHost`] makes
//! them, a [`Resident`] is one of them (a session's resident sandbox, or a
//! throwaway fork of a checkpoint for the tree of states).
//!
//! The manager opens every file a sandbox reads or writes — the layers, state
//! and packs of a checkpoint to bring back, the temp files of a new checkpoint
//! — and hands them over open: a host never names a path of the sessions
//! directory, and the manager fsyncs, renames and commits what was written.
//! [`InProcess`] runs the sandboxes in this process (`--isolation thread`);
//! `forkbox_worker::SessionWorkers` runs them in jailed worker processes,
//! given the same files as descriptors. The runtime injects one
//! ([`crate::manager::SessionManager::with_host`]); the default is [`InProcess`].

use std::collections::HashMap;
use std::fs::File;
use std::hash::{Hash, Hasher};

use forkbox_catalog::Loaded;
use forkbox_engine::packages::{InstalledPackage, Package};
use forkbox_engine::{
    CapturedOutput, Changes, EngineError, ExecOptions, ExecResult, FileEntry, FileOp, FileOpOutcome, JobChunk, JobInfo,
    Limits, ListeningPort, Sandbox, Stream, Template, Usage,
};
pub use forkbox_engine::{CheckpointFiles, CheckpointSize, CheckpointStats, ResumeAs};
use forkbox_snapshot::{Layer, StateError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

use crate::manager::SessionError;

/// A file the manager opened for a host, and its name in the layers
/// directory (what errors show; never a path).
pub struct NamedFile {
    pub name: String,
    pub file: File,
}

/// Opens the packs a checkpoint's state names: only packs of that
/// checkpoint's lineage (the manager checks; anything else is an error).
pub type PackOpener<'a> = &'a mut dyn FnMut(&[String]) -> Result<Vec<NamedFile>, SessionError>;

/// The files of a checkpoint to bring back.
pub struct CheckpointIn<'a> {
    /// Its layer chain, newest first: its own, then its ancestors' back to a flat layer.
    pub layers: Vec<NamedFile>,
    pub state: NamedFile,
    pub packs: PackOpener<'a>,
}

/// What a new sandbox is made of.
pub struct Start<'a> {
    /// Whose it is (a host may keep tenants apart: one worker process each).
    pub tenant: &'a str,
    pub template: &'a Loaded,
    pub limits: Limits,
    /// Tracked for checkpoints (as the session, or reseeded as a fork of it), or a throwaway.
    pub how: ResumeAs,
    /// None: a fresh fork of the template.
    pub from: Option<CheckpointIn<'a>>,
}

/// Makes sandboxes for sessions.
pub trait SandboxHost: Send + Sync {
    fn start(&self, s: Start<'_>) -> Result<Box<dyn Resident>, SessionError>;

    /// "thread" or "process", for logs.
    fn kind(&self) -> &'static str;
}

/// Most files a diff's walk reports (a guest can create any number).
pub const WALK_MAX_ENTRIES: usize = 5000;
const WALK_MAX_DEPTH: usize = 16;
/// Files up to this size are compared by content, larger ones by size and mtime.
const HASH_MAX: usize = 4 << 20;
/// Parts of the file system that are the image's (read-only system files), not walked.
const WALK_SKIP: &[&str] = &["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/proc", "/sys", "/dev"];

/// A file the walk of a sandbox's file system saw (outside the image's system folders).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalkedFile {
    pub path: String,
    pub size: u64,
    /// Of its content (files up to 4 MiB), else of its size and mtime.
    pub digest: u64,
}

/// What [`Resident::walk`] saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Walk {
    pub files: Vec<WalkedFile>,
    /// The walk stopped at its bound ([`WALK_MAX_ENTRIES`] entries).
    pub truncated: bool,
}

/// Reads a file from offset 0 with `pread`, whatever its descriptor's offset
/// (an upload's temporary file, possibly shared with the process that wrote it).
pub struct ReadAt<'a> {
    file: &'a File,
    at: u64,
}

impl<'a> ReadAt<'a> {
    pub fn new(file: &'a File) -> ReadAt<'a> {
        ReadAt { file, at: 0 }
    }
}

impl std::io::Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = std::os::unix::fs::FileExt::read_at(self.file, buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// A sandbox made by a [`SandboxHost`], parked between calls.
pub trait Resident: Send {
    /// Run code (a Python exception is a result, not an `Err`).
    fn exec(&mut self, code: &str, opts: ExecOptions<'_>) -> Result<ExecResult, EngineError>;
    /// The number the next exec's code is named by in tracebacks (`<exec-N>`).
    fn set_exec_id(&mut self, n: i64);
    /// What the last failed exec wrote before it failed.
    fn take_failed_output(&mut self) -> Option<CapturedOutput>;
    /// Write the file `path` with the `len` bytes of `src` (read from offset 0,
    /// a chunk at a time: an upload's temporary file, never a whole buffer).
    fn write_file(&mut self, path: &str, src: &File, len: u64) -> Result<(), EngineError>;
    fn read_file(&mut self, path: &str, max: usize) -> Result<Vec<u8>, EngineError>;
    fn list_dir(&mut self, path: &str) -> Result<Vec<FileEntry>, EngineError>;
    /// A file-system operation from outside (see `Sandbox::file_op`).
    fn file_op(&mut self, op: &FileOp) -> Result<FileOpOutcome, EngineError>;
    /// Mount the layers of packages the host resolved (see `Sandbox::install_packages`).
    fn install_packages(&mut self, packages: &[Package]) -> Result<Vec<InstalledPackage>, EngineError>;
    /// The files of its file system (a diff's view), bounded.
    fn walk(&mut self) -> Result<Walk, EngineError>;
    /// Write a checkpoint (see `Template::checkpoint_into`): `admit` gets its
    /// size before anything is written, may refuse, and otherwise gives the
    /// files to write it into; the state names its pack `pack_name`.
    fn checkpoint(
        &mut self,
        pack_name: &str,
        admit: &mut dyn FnMut(CheckpointSize) -> Result<CheckpointFiles, SessionError>,
    ) -> Result<CheckpointStats, SessionError>;
    /// Write it as a template of its own (see `Template::snapshot_into`) into two new files.
    fn snapshot_template(
        &mut self,
        id: &str,
        preload: &str,
        memory: &mut File,
        state: &mut File,
    ) -> Result<(), EngineError>;
    /// False once the sandbox is gone by itself (its worker process died): the
    /// session is at its last checkpoint, and comes back from disk.
    fn is_alive(&self) -> bool {
        true
    }
    /// Did its last exec leave threads or processes running between calls
    /// (a host that runs them: a sandbox worker's)?
    fn has_background(&self) -> bool {
        false
    }
    /// Its background jobs (see `Sandbox::jobs`).
    fn jobs(&mut self) -> Result<Vec<JobInfo>, EngineError>;
    /// A slice of a job's stream (see `Sandbox::job_output`).
    fn job_output(&mut self, pid: u32, stream: Stream, offset: u64, max: usize) -> Result<JobChunk, EngineError>;
    /// Signal a job's processes (see `Sandbox::job_signal`).
    fn job_signal(&mut self, pid: u32, signal: i32) -> Result<JobInfo, EngineError>;
    /// Run the sandbox until the job ends or `timeout` passes (see `Sandbox::job_wait`).
    fn job_wait(&mut self, pid: u32, timeout: Duration) -> Result<JobInfo, EngineError>;
    /// Its listening TCP sockets (see `Sandbox::listening_ports`).
    fn listening_ports(&mut self) -> Result<Vec<ListeningPort>, EngineError>;
    /// Hand `conn` (one end of a host stream socket pair) to the sandbox's
    /// listener on `port` (see `Sandbox::connect_port`).
    fn connect_port(&mut self, port: u16, conn: std::os::fd::OwnedFd) -> Result<(), EngineError>;
    /// Run the sandbox until the job writes past `offsets`, ends, or `timeout` passes (see `Sandbox::job_watch`).
    fn job_watch(&mut self, pid: u32, offsets: [u64; 2], timeout: Duration) -> Result<JobInfo, EngineError>;
    /// Write to a job's stdin, then close it if `eof` (see `Sandbox::job_stdin`).
    fn job_stdin(&mut self, pid: u32, data: &[u8], eof: bool) -> Result<JobInfo, EngineError>;
    /// Resize the terminal of a job started on a pty (see `Sandbox::job_resize`).
    fn job_resize(&mut self, pid: u32, rows: u16, cols: u16) -> Result<JobInfo, EngineError>;
    /// Watch its file system's changes from `since` (None: stop), waiting at most
    /// `timeout` for one (see `Sandbox::fs_watch`).
    fn fs_watch(&mut self, since: Option<u64>, timeout: Duration) -> Result<Option<Changes>, EngineError>;
    /// What it uses now (see `Sandbox::usage`).
    fn usage(&mut self) -> Result<Usage, EngineError>;
}

/// How long a write to a job's full stdin waits for its processes to read.
pub const JOB_STDIN_WAIT: Duration = Duration::from_secs(5);

/// The walk of a sandbox's file system behind [`Resident::walk`] (in this
/// process, or in a sandbox worker).
pub fn walk(sb: &Sandbox) -> Walk {
    let mut out = Walk::default();
    let mut stack = vec![("/".to_string(), 0usize)];
    let mut entries = 0usize;
    while let Some((dir, depth)) = stack.pop() {
        let Ok(list) = sb.list_dir(&dir) else { continue };
        for e in list {
            entries += 1;
            if entries > WALK_MAX_ENTRIES {
                out.truncated = true;
                return out;
            }
            if e.is_dir {
                if depth < WALK_MAX_DEPTH && !WALK_SKIP.contains(&e.path.as_str()) {
                    stack.push((e.path, depth + 1));
                }
                continue;
            }
            let mut h = std::collections::hash_map::DefaultHasher::new();
            e.size.hash(&mut h);
            match (e.size as usize <= HASH_MAX).then(|| sb.read_file(&e.path, HASH_MAX)) {
                Some(Ok(bytes)) => bytes.hash(&mut h),
                _ => e.mtime_ms.hash(&mut h),
            }
            out.files.push(WalkedFile { path: e.path, size: e.size, digest: h.finish() });
        }
    }
    out
}

/// Parse the layers and bring the checkpoint back in this process.
pub fn resume_in_process(
    t: &Loaded,
    limits: Limits,
    how: ResumeAs,
    from: CheckpointIn<'_>,
) -> Result<Sandbox, SessionError> {
    let CheckpointIn { layers, state, packs } = from;
    let mut parsed = Vec::with_capacity(layers.len());
    for mut l in layers {
        parsed.push(Layer::read_from(&mut l.file, &l.name)?);
    }
    // The opener's own error is what the caller should see (not its text in an engine error).
    let mut failed: Option<SessionError> = None;
    let mut open = |names: &[String]| -> Result<HashMap<String, File>, EngineError> {
        match packs(names) {
            Ok(files) => Ok(files.into_iter().map(|f| (f.name, f.file)).collect()),
            Err(e) => {
                let message = e.to_string();
                failed = Some(e);
                Err(EngineError::Snapshot(StateError::Corrupt(message)))
            }
        }
    };
    let r = t.template.resume_from(&t.engine, &parsed, &state.file, &state.name, &mut open, limits, how);
    r.map_err(|e| failed.take().unwrap_or_else(|| engine_error(e)))
}

/// An engine error of bringing a sandbox back, as the sessions say it.
pub fn engine_error(e: EngineError) -> SessionError {
    match e {
        EngineError::Snapshot(s) => SessionError::Snapshot(s),
        e => SessionError::Engine(e),
    }
}

/// Sandboxes in this process, on the engine (the exec thread that asks runs them).
pub struct InProcess;

impl SandboxHost for InProcess {
    fn start(&self, s: Start<'_>) -> Result<Box<dyn Resident>, SessionError> {
        start_local(s, false)
    }

    fn kind(&self) -> &'static str {
        "thread"
    }
}

/// [`InProcess`] whose session sandboxes keep the processes and threads an
/// exec leaves running, as a session worker's do, except that nothing runs
/// them between calls: they run during the session's later calls (whenever
/// the agent waits or its slice ends). So checkpoints, reverts, forks and
/// evictions of sessions with running children can be tested without
/// worker processes.
pub struct InProcessKeepingChildren;

impl SandboxHost for InProcessKeepingChildren {
    fn start(&self, s: Start<'_>) -> Result<Box<dyn Resident>, SessionError> {
        start_local(s, true)
    }

    fn kind(&self) -> &'static str {
        "thread"
    }
}

fn start_local(s: Start<'_>, keep_running: bool) -> Result<Box<dyn Resident>, SessionError> {
    let t = s.template;
    let how = s.how;
    let mut sb = match s.from {
        None if how == ResumeAs::Throwaway => t.template.fork(&t.engine, s.limits).map_err(engine_error)?,
        None => t.template.fork_tracked(&t.engine, s.limits).map_err(engine_error)?,
        Some(from) => resume_in_process(t, s.limits, how, from)?,
    };
    let keep_running = keep_running && how != ResumeAs::Throwaway;
    sb.set_keep_running(keep_running);
    Ok(Box::new(Local { sb, template: t.template.clone(), engine: t.engine.clone() }))
}

/// A sandbox of this process.
struct Local {
    sb: Sandbox,
    template: std::sync::Arc<Template>,
    engine: std::sync::Arc<forkbox_engine::Engine>,
}

impl Resident for Local {
    fn exec(&mut self, code: &str, opts: ExecOptions<'_>) -> Result<ExecResult, EngineError> {
        self.sb.exec_with(code, opts)
    }

    fn has_background(&self) -> bool {
        self.sb.keeps_running() && self.sb.has_background()
    }

    fn set_exec_id(&mut self, n: i64) {
        self.sb.set_exec_id(n);
    }

    fn take_failed_output(&mut self) -> Option<CapturedOutput> {
        self.sb.take_failed_output()
    }

    fn write_file(&mut self, path: &str, src: &File, len: u64) -> Result<(), EngineError> {
        self.sb.write_file_from(path, &mut ReadAt::new(src), len)
    }

    fn read_file(&mut self, path: &str, max: usize) -> Result<Vec<u8>, EngineError> {
        self.sb.read_file(path, max)
    }

    fn list_dir(&mut self, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        self.sb.list_dir(path)
    }

    fn file_op(&mut self, op: &FileOp) -> Result<FileOpOutcome, EngineError> {
        self.sb.file_op(op)
    }

    fn install_packages(&mut self, packages: &[Package]) -> Result<Vec<InstalledPackage>, EngineError> {
        self.sb.install_packages(packages)
    }

    fn walk(&mut self) -> Result<Walk, EngineError> {
        Ok(walk(&self.sb))
    }

    fn checkpoint(
        &mut self,
        pack_name: &str,
        admit: &mut dyn FnMut(CheckpointSize) -> Result<CheckpointFiles, SessionError>,
    ) -> Result<CheckpointStats, SessionError> {
        self.template.checkpoint_into(&self.engine, &mut self.sb, pack_name, admit)
    }

    fn snapshot_template(
        &mut self,
        id: &str,
        preload: &str,
        memory: &mut File,
        state: &mut File,
    ) -> Result<(), EngineError> {
        self.template.snapshot_into(&self.engine, &self.sb, memory, state, id, preload)
    }

    fn jobs(&mut self) -> Result<Vec<JobInfo>, EngineError> {
        Ok(self.sb.jobs())
    }

    fn job_output(&mut self, pid: u32, stream: Stream, offset: u64, max: usize) -> Result<JobChunk, EngineError> {
        self.sb.job_output(pid, stream, offset, max)
    }

    fn job_signal(&mut self, pid: u32, signal: i32) -> Result<JobInfo, EngineError> {
        self.sb.job_signal(pid, signal)
    }

    fn job_wait(&mut self, pid: u32, timeout: Duration) -> Result<JobInfo, EngineError> {
        self.sb.job_wait(pid, std::time::Instant::now() + timeout)
    }

    fn listening_ports(&mut self) -> Result<Vec<ListeningPort>, EngineError> {
        Ok(self.sb.listening_ports())
    }

    fn connect_port(&mut self, _port: u16, _conn: std::os::fd::OwnedFd) -> Result<(), EngineError> {
        // Nothing of a sandbox of this process runs between calls, so no server in it could answer.
        Err(EngineError::Unsupported(
            "ports need sandboxes that keep running between calls: serve with --isolation process (the default)".into(),
        ))
    }

    fn job_watch(&mut self, pid: u32, offsets: [u64; 2], timeout: Duration) -> Result<JobInfo, EngineError> {
        self.sb.job_watch(pid, offsets, std::time::Instant::now() + timeout)
    }

    fn job_stdin(&mut self, pid: u32, data: &[u8], eof: bool) -> Result<JobInfo, EngineError> {
        self.sb.job_stdin(pid, data, eof, std::time::Instant::now() + JOB_STDIN_WAIT)
    }

    fn job_resize(&mut self, pid: u32, rows: u16, cols: u16) -> Result<JobInfo, EngineError> {
        self.sb.job_resize(pid, rows, cols)
    }

    fn fs_watch(&mut self, since: Option<u64>, timeout: Duration) -> Result<Option<Changes>, EngineError> {
        self.sb.fs_watch(since, std::time::Instant::now() + timeout)
    }

    fn usage(&mut self) -> Result<Usage, EngineError> {
        Ok(self.sb.usage())
    }
}
