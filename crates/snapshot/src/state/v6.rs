//! Versions 5 and 6: threads, pending signals, timers and the run clock in
//! the process state; file bytes of a checkpoint in pack files; directory
//! entries charged to the VFS's byte count (its layout 3); files of package
//! layers in the VFS (`FileState::Layer`, new in 6: only a variant was added,
//! so a version 5 payload reads as this shape). No credentials (every
//! process was root). Frozen: never edit these types.

use forkbox_linux::fd::FdTable;
use forkbox_linux::thread::Threads;
use forkbox_vmm::regs::VcpuRecord;
use serde::{Deserialize, Serialize};

pub(super) use super::v4::{DevKind, FileBytes, Ino};
use super::v4::{ExecInfo, MemoryMap, Signals};
use super::{v4, StateError};
use crate::cpu::CpuFingerprint;
use crate::memory::MemoryStats;

/// The state around its process record `P`, as versions 5 to 10 write it
/// (10 adds the children: `v10::Snapshot`).
#[derive(Deserialize)]
pub(super) struct Snapshot<P> {
    pub image_id: String,
    pub cpu: CpuFingerprint,
    pub vcpu: VcpuRecord,
    pub process: P,
    pub memory: MemoryStats,
    pub info: String,
    pub files: crate::files::FileTable,
}

impl<P> Snapshot<P> {
    /// The same state with its process record in the next version's shape.
    pub fn upgrade<Q: From<P>>(self) -> Snapshot<Q> {
        Snapshot {
            image_id: self.image_id,
            cpu: self.cpu,
            vcpu: self.vcpu,
            process: self.process.into(),
            memory: self.memory,
            info: self.info,
            files: self.files,
        }
    }
}

#[derive(Deserialize)]
pub(super) struct Process {
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub vfs: VfsState,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    pub exec_info: ExecInfo,
}

/// The file system overlay: everything but the image (referenced by id).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VfsState {
    pub image_id: String,
    /// The VFS's own layout number (3).
    pub version: u32,
    pub next_ino: Ino,
    pub quota: u64,
    pub overlay_bytes: u64,
    /// Overlay nodes, sorted by inode number.
    pub nodes: Vec<NodeState>,
    /// Open references: (inode, count), sorted by inode number.
    pub refs: Vec<(Ino, u32)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    pub ino: Ino,
    pub perm: u32,
    pub mtime_ns: i128,
    pub atime_ns: i128,
    pub nlink: u32,
    pub body: BodyState,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum BodyState {
    Dir { parent: Ino, entries: Vec<(Vec<u8>, Ino)> },
    File(FileState),
    Symlink(Vec<u8>),
    CharDev(DevKind),
    Fifo,
    Socket,
    Gone,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FileState {
    Image,
    Owned(FileBytes),
    /// File inode `ino` of the package layer whose id is `layer`.
    Layer {
        layer: String,
        ino: u32,
    },
}

pub(super) fn read(payload: &[u8], version: u32) -> Result<Snapshot<Process>, StateError> {
    postcard::from_bytes(payload)
        .map_err(|e| StateError::Corrupt(format!("undecodable version {version} payload: {e}")))
}

/// Layout 2 did not charge directory entries to the byte count (the nodes
/// are the same): add what the VFS charges for each entry. Another layout
/// stays as it is (restoring it fails on its layout number).
impl From<v4::VfsState> for VfsState {
    fn from(s: v4::VfsState) -> VfsState {
        let nodes: Vec<NodeState> = s.nodes.into_iter().map(NodeState::from).collect();
        let (mut version, mut overlay_bytes) = (s.version, s.overlay_bytes);
        if version == 2 {
            let entries = nodes
                .iter()
                .map(|n| match &n.body {
                    BodyState::Dir { entries, .. } => {
                        entries.iter().fold(0u64, |a, (k, _)| a.saturating_add(forkbox_linux::vfs::entry_cost(k)))
                    }
                    _ => 0,
                })
                .fold(0u64, u64::saturating_add);
            overlay_bytes = overlay_bytes.saturating_add(entries);
            version = 3;
        }
        VfsState {
            image_id: s.image_id,
            version,
            next_ino: s.next_ino,
            quota: s.quota,
            overlay_bytes,
            nodes,
            refs: s.refs,
        }
    }
}

impl From<v4::NodeState> for NodeState {
    fn from(n: v4::NodeState) -> NodeState {
        let body = match n.body {
            v4::BodyState::Dir { parent, entries } => BodyState::Dir { parent, entries },
            v4::BodyState::File(v4::FileState::Image) => BodyState::File(FileState::Image),
            v4::BodyState::File(v4::FileState::Owned(b)) => BodyState::File(FileState::Owned(b)),
            v4::BodyState::Symlink(t) => BodyState::Symlink(t),
            v4::BodyState::CharDev(d) => BodyState::CharDev(d),
            v4::BodyState::Fifo => BodyState::Fifo,
            v4::BodyState::Socket => BodyState::Socket,
            v4::BodyState::Gone => BodyState::Gone,
        };
        NodeState { ino: n.ino, perm: n.perm, mtime_ns: n.mtime_ns, atime_ns: n.atime_ns, nlink: n.nlink, body }
    }
}

/// The one thread is the main thread, its per-thread fields those of the
/// process; the file bytes were inline (no pack files).
impl From<v4::Snapshot> for Snapshot<Process> {
    fn from(s: v4::Snapshot) -> Snapshot<Process> {
        let p = s.process;
        let process = Process {
            mm: p.mm,
            fds: p.fds,
            vfs: p.vfs.into(),
            cwd: p.cwd,
            signals: p.signals,
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: Threads::default(),
            exec_info: p.exec_info,
        };
        Snapshot {
            image_id: s.image_id,
            cpu: s.cpu,
            vcpu: s.vcpu,
            process,
            memory: s.memory,
            info: s.info,
            files: Default::default(),
        }
    }
}
