//! The state file: magic, version, length, checksum, then a postcard payload.
//!
//! Versioning: each readable version N has a module `vN` (in `state/`) that
//! holds its persisted shape, reads a payload of that version and upgrades
//! it to the next version's shape; the current version's module (`v10`) also
//! converts its shape to and from the live types ([`Snapshot`]: the memory
//! map, fd table, VFS state... of forkbox-linux). A shape that did not change
//! is defined once, in the version that introduced it, and named by the
//! later ones. The shapes of the file system overlay (`v4::VfsState`, then
//! `v6::VfsState`), the memory map, signals and exec info (`v4`), the
//! threads (`v6`), the credentials (`v7`), the listeners (`v9`) and the
//! other processes (`v10`) are the snapshot crate's own; the fd table and
//! its objects are still the serde form of their live types.
//!
//! When the payload's shape changes (any field of `Snapshot`, `VcpuRecord`,
//! `CpuFingerprint`, `MemoryStats` or the process state it embeds), bump
//! `FORMAT_VERSION`, add a module for the new version with the new shape and
//! the upgrade from the previous one (which stays as it is, frozen), move
//! the live conversions to it, add the version to `READABLE_VERSIONS`, and add
//! a golden file for the new version (`tests/golden.rs` says how): the golden
//! test fails until all of that is done.

use std::path::Path;

use forkbox_linux::process::ProcessState;
use forkbox_vmm::regs::VcpuRecord;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cpu::CpuFingerprint;
use crate::memory::MemoryStats;

pub const MAGIC: &[u8; 8] = b"FBXSNAP\0";
/// 2: maps encoded as sequences of pairs.
/// 3: forkbox's own register/XSAVE records (no kvm-bindings serde types); the CPU fingerprint.
/// 4: fd objects (pipes, AF_UNIX sockets, eventfd, epoll, timerfd) in the fd table,
///    FIFO and socket nodes and atime in the VFS, exec info (/proc) in the process.
///    Version 3 files are not read: their process state has the older shape.
/// 5: threads (per-thread registers, XSAVE, FS base, signal mask, altstack,
///    clear-child-tid, signal frames in flight, blocked calls), pending
///    signals, timers and the run clock in the process state; file bytes of a
///    checkpoint in pack files (`Snapshot::files`); directory entries charged in
///    the VFS's byte count (VfsState 3); AF_INET/AF_INET6 sockets in the fd
///    table (`FileKind::Socket`: id, domain, type; the host socket itself is
///    never in a snapshot).
/// 6: files of package layers in the VFS (`FileState::Layer`: a layer id and an
///    inode, never the bytes). Only an enum variant was added, so a version 5
///    payload decodes as it is.
/// 7: the process' credentials (`ProcessState::creds`: user and group ids,
///    supplementary groups); a pipe's capacity (`ObjKind` variant `SizedPipe`,
///    which replaces `Pipe` in what is written; `Pipe` still reads, with the
///    default capacity). Versions 5 and 6 are read as the frozen `v6` shape.
/// 8: owners of files (`ProcessState::owners`: inode, user, group for each
///    file not owned by 0:0). Version 7 is read as the frozen `v7` shape.
/// 9: listening sockets (`ProcessState::listeners`: id, family, bound address,
///    backlog, options), made again on restore. Version 8 is read as the
///    frozen `v8` shape (no listeners: its sockets read as reset).
/// 10: the sandbox's other processes (`Snapshot::children`: the process
///    table, and each running child's own state, vCPU and memory as an
///    embedded layer). Version 9 is read as the frozen `v9` shape (no children).
pub const FORMAT_VERSION: u32 = 10;
/// Every version `decode` reads (oldest first); the last is `FORMAT_VERSION`.
pub const READABLE_VERSIONS: &[u32] = &[4, 5, 6, 7, 8, 9, 10];
mod v10;
mod v4;
mod v6;
mod v7;
mod v8;
mod v9;

const HEADER_LEN: usize = 8 + 4 + 8 + 32;
/// A state file larger than this is rejected before it is read into memory.
const MAX_PAYLOAD: u64 = 4 << 30;

/// How a snapshot file is named in errors: its file name only (errors reach
/// API clients; the data directory's host path stays in the server's log).
pub fn shown(path: &Path) -> String {
    path.file_name().map_or_else(|| "(unnamed)".to_string(), |n| n.to_string_lossy().into_owned())
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("snapshot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a forkbox snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {0}, this forkbox reads version {FORMAT_VERSION}")]
    BadVersion(u32),
    #[error("snapshot is corrupt: {0}")]
    Corrupt(String),
    /// The snapshot was taken on a CPU whose features (as the guest sees them)
    /// differ from this host's: its guest may use instructions this host lacks.
    #[error("snapshot was taken on a CPU with other features than this host's ({0}); it cannot run here")]
    CpuMismatch(String),
}

impl StateError {
    /// A stable machine-readable code.
    pub fn error_code(&self) -> forkbox_api::ErrorCode {
        match self {
            StateError::CpuMismatch(_) => forkbox_api::ErrorCode::CpuMismatch,
            _ => forkbox_api::ErrorCode::StorageError,
        }
    }

    /// The wire name of [`Self::error_code`].
    pub fn code(&self) -> &'static str {
        self.error_code().as_str()
    }
}

impl StateError {
    /// An I/O error on a snapshot file, naming the file (not its directory).
    pub fn io(what: &'static str, path: &Path, source: std::io::Error) -> StateError {
        StateError::Io { what, path: shown(path), source }
    }

    /// The disk (or the file system's quota) is full.
    pub fn is_no_space(&self) -> bool {
        matches!(self, StateError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

/// Everything a snapshot's state file holds, as the live types the engine
/// saves from and restores into (the persisted shape is `v10::Snapshot`).
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    /// The image the process' file system is layered on.
    pub image_id: String,
    /// The CPU (CPUID leaves and XCR0 the guest saw) it was taken on.
    pub cpu: CpuFingerprint,
    pub vcpu: VcpuRecord,
    pub process: ProcessState,
    pub memory: MemoryStats,
    /// Free-form facts about the snapshot (what the agent reported, the preload...).
    pub info: String,
    /// Overlay files whose bytes are stored in pack files rather than in
    /// `process` (where they appear with no bytes); empty for templates.
    pub files: crate::files::FileTable,
    /// The sandbox's processes besides the agent's (state format 10; none
    /// in a template or an older checkpoint).
    pub children: Children,
}

/// The processes of a checkpointed sandbox besides the agent's, all parked
/// at the same point between two scheduler slices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Children {
    /// The process table (None: there were no other processes; the table is
    /// the agent's process alone).
    pub table: Option<forkbox_linux::procs::ProcTableState>,
    /// The running children, in the scheduler's round-robin order.
    pub processes: Vec<ChildRecord>,
}

impl Children {
    pub fn is_empty(&self) -> bool {
        self.table.is_none() && self.processes.is_empty()
    }
}

/// One running child process: its own kernel state, its vCPU, where its
/// current thread stands, and its memory.
#[derive(Clone, Debug, PartialEq)]
pub struct ChildRecord {
    pub process: forkbox_linux::process::ChildState,
    pub vcpu: VcpuRecord,
    /// The user state its current thread resumes with before the vCPU runs
    /// again (a syscall's return on its way to signal delivery, a thread
    /// loaded onto the vCPU but not run yet).
    pub pending_user: Option<forkbox_vmm::regs::Regs>,
    /// The vCPU stopped at a syscall exit (in the syscall stub).
    pub in_stub: bool,
    /// Its guest memory: layers over its base, newest first (the pages it
    /// changed since the previous checkpoint, then that checkpoint's
    /// layers back to a whole one), each a part of a checkpoint's process
    /// memory file (`<name>.procs`, beside its state), not the bytes.
    pub memory: Vec<MemoryRef>,
    /// The base `memory` is a layer over: the template's memory (a child of
    /// the agent that has not called execve) or zeros (after an execve).
    pub on_template: bool,
}

/// Where one layer of a child process' memory is: `len` bytes at `offset` of
/// `file` (a checkpoint's process memory file, named like its pack: a plain
/// file name of the sessions directory), whose CRC-32 is `crc`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRef {
    pub file: String,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
}

/// Most layers one child's memory is recorded in (a longer chain starts
/// again from a whole layer over its base).
pub const MAX_MEMORY_CHAIN: usize = 32;

impl Children {
    /// The process memory files the records name (sorted, each once),
    /// checked: plain file names, at most [`MAX_MEMORY_CHAIN`] layers a process.
    pub fn memory_files(&self) -> Result<Vec<String>, StateError> {
        let mut out = std::collections::BTreeSet::new();
        for c in &self.processes {
            if c.memory.len() > MAX_MEMORY_CHAIN {
                return Err(StateError::Corrupt(format!(
                    "process {}: {} memory layers",
                    c.process.pid,
                    c.memory.len()
                )));
            }
            for r in &c.memory {
                if !crate::files::valid_pack_name(&r.file) {
                    return Err(StateError::Corrupt(format!("process {}: memory file name", c.process.pid)));
                }
                out.insert(r.file.clone());
            }
        }
        Ok(out.into_iter().collect())
    }
}

pub fn encode(s: &Snapshot) -> Vec<u8> {
    let payload = postcard::to_stdvec(&v10::SnapshotRef::from(s)).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&payload));
    out.extend_from_slice(&payload);
    out
}

pub fn decode(bytes: &[u8]) -> Result<Snapshot, StateError> {
    let header = bytes.get(..HEADER_LEN).ok_or_else(|| StateError::Corrupt("truncated header".into()))?;
    if &header[..8] != MAGIC {
        return Err(StateError::BadMagic);
    }
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if !READABLE_VERSIONS.contains(&version) {
        return Err(StateError::BadVersion(version));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[12..20]);
    let len = u64::from_le_bytes(len);
    let payload = &bytes[HEADER_LEN..];
    if len > MAX_PAYLOAD || payload.len() as u64 != len {
        return Err(StateError::Corrupt(format!("payload is {} bytes, header says {len}", payload.len())));
    }
    if Sha256::digest(payload).as_slice() != &header[20..52] {
        return Err(StateError::Corrupt("checksum mismatch".into()));
    }
    decode_payload(version, payload)
}

/// The reader of each readable version: its own shape, upgraded version by
/// version to the current one, then to the live types.
fn decode_payload(version: u32, payload: &[u8]) -> Result<Snapshot, StateError> {
    let v10 = match version {
        4 => upgrade_v6(v4::read(payload)?.into()),
        // Version 5 is version 6 without package-layer files (no shape changed).
        5 | 6 => upgrade_v6(v6::read(payload, version)?),
        7 => upgrade_v7(v7::read(payload)?),
        8 => upgrade_v8(v8::read(payload)?),
        9 => v9::read(payload)?.into(),
        10 => v10::read(payload)?,
        v => return Err(StateError::BadVersion(v)),
    };
    Ok(v10.into())
}

fn upgrade_v6(s: v6::Snapshot<v6::Process>) -> v10::Snapshot {
    upgrade_v7(s.upgrade())
}

fn upgrade_v7(s: v6::Snapshot<v7::Process>) -> v10::Snapshot {
    upgrade_v8(s.upgrade())
}

fn upgrade_v8(s: v6::Snapshot<v8::Process>) -> v10::Snapshot {
    s.upgrade::<v9::Process>().into()
}

/// Write atomically: temp file, fsync, rename, fsync the directory.
pub fn write_state(path: &Path, s: &Snapshot) -> Result<(), StateError> {
    write_encoded(path, &encode(s))
}

/// `write_state` of bytes from `encode` (whose length is then known before writing).
pub fn write_encoded(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    crate::layer::write_atomically(path, |f| {
        use std::io::Write;
        f.write_all(bytes)
    })?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

pub fn read_state(path: &Path) -> Result<Snapshot, StateError> {
    let f = std::fs::File::open(path).map_err(|source| StateError::io("open", path, source))?;
    read_state_from(&f, &shown(path))
}

/// A state file from an open file (a file descriptor the API process passed a
/// sandbox worker); `shown` names it in errors.
pub fn read_state_from(f: &std::fs::File, shown: &str) -> Result<Snapshot, StateError> {
    use std::io::Read;
    let ioe = |what| move |source| StateError::Io { what, path: shown.to_string(), source };
    let len = f.metadata().map_err(ioe("stat"))?.len();
    if len > MAX_PAYLOAD + HEADER_LEN as u64 {
        return Err(StateError::Corrupt(format!("state file of {len} bytes")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // At most the size checked above (the file could grow meanwhile).
    let r: &std::fs::File = f;
    r.take(MAX_PAYLOAD + HEADER_LEN as u64 + 1).read_to_end(&mut bytes).map_err(ioe("read"))?;
    decode(&bytes)
}

/// `bytes` from [`encode`] into `f`, a new empty file the caller syncs and names.
pub fn write_encoded_into(f: &mut std::fs::File, bytes: &[u8]) -> Result<(), StateError> {
    use std::io::Write;
    f.write_all(bytes).map_err(|source| StateError::Io { what: "write", path: "state".into(), source })
}
