//! Versions 5 and 6: threads, pending signals, timers and the run clock in
//! the process state; file bytes of a checkpoint in pack files; directory
//! entries charged to the VFS's byte count (its layout 3); files of package
//! layers in the VFS (`FileState::Layer`, new in 6: only a variant was added,
//! so a version 5 payload reads as this shape). No credentials (every
//! process was root). Frozen: never edit these types.

use std::sync::Arc;

use forkbox_linux::fd::FdTable;
use forkbox_vmm::regs::{Regs, VcpuRecord, Xsave};
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

/// The process' threads, its pending signals, timers and run clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Threads {
    pub list: Vec<Thread>,
    /// Index (in `list`) of the thread on the vCPU.
    pub cur: usize,
    pub next_tid: u32,
    /// Process-directed signals not yet taken by a thread.
    pub pending: Vec<SigInfo>,
    /// POSIX timers and the CPU-time interval timers.
    pub timers: Vec<Timer>,
    pub itimer_real: Option<Timer>,
    pub clock: RunClock,
}

/// One thread. The one on the vCPU has no saved CPU state, and its mask,
/// altstack, FS base and clear-child-tid here are stale (the process' are
/// its own).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Thread {
    pub tid: u32,
    pub cpu: Option<SavedCpu>,
    pub fs_base: u64,
    pub sigmask: u64,
    /// `stack_t` as the kernel ABI has it.
    pub altstack: [u8; 24],
    pub clear_tid: u64,
    /// Signals sent to this thread.
    pub pending: Vec<SigInfo>,
    /// Signal handler frames in flight, oldest first.
    pub frames: Vec<SigFrame>,
    /// The blocked call it is in.
    pub wait: Option<Wait>,
    /// The mask to go back to after a wait that changed it.
    pub restore_mask: Option<u64>,
    /// A signal ended its blocked call `nr`: restarted (true) or EINTR.
    pub restart: Option<(u64, bool)>,
}

/// A thread's user-mode CPU state while it is off the vCPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedCpu {
    pub regs: Regs,
    /// Shared with the live thread it was saved from or is restored into.
    pub xsave: Arc<Xsave>,
}

/// A signal handler frame in flight (the state `rt_sigreturn` restores).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SigFrame {
    pub cpu: SavedCpu,
    pub mask: u64,
    /// The guest address of the frame.
    pub frame: u64,
}

/// A queued signal, as `siginfo_t` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigInfo {
    pub signo: i32,
    pub code: i32,
    pub pid: i32,
    pub timer_id: i32,
    pub overrun: i32,
    pub value: u64,
}

/// A blocked syscall: its registers, the run-clock deadline and its result
/// then (Ok(value) or Err(errno)), what it waits for, whether a futex wake
/// came.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Wait {
    pub regs: Regs,
    pub deadline: Option<u64>,
    pub on_timeout: Result<u64, i32>,
    pub kind: WaitKind,
    pub woken: bool,
}

/// What a blocked thread waits for (variant order is the format).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitKind {
    Futex {
        addr: u64,
        bitset: u32,
    },
    Signal,
    Time,
    Other,
    /// The agent's main thread parked between two calls. Never written (the
    /// main thread is back on the vCPU before a checkpoint); it decodes as
    /// it always has.
    Agent,
}

/// A POSIX timer, ITIMER_REAL (id -1) or a CPU-time interval timer (ids -2, -3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timer {
    pub id: i32,
    pub clock: i32,
    pub signo: i32,
    /// SIGEV_THREAD_ID target, else process-directed.
    pub tid: Option<u32>,
    /// SIGEV_NONE: never signals.
    pub silent: bool,
    pub value: u64,
    /// Run-clock expiry (a CPU-time timer: the CPU nanoseconds left); None: disarmed.
    pub expiry: Option<u64>,
    pub interval_ns: u64,
    pub overrun: i32,
}

/// The run clock: nanoseconds the guest has run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunClock {
    pub ns: u64,
}

/// A version 4 process' threads: its main thread alone (tid 2, on the vCPU,
/// no signal stack), no pending signals or timers, the clock at 0.
fn one_thread() -> Threads {
    let mut altstack = [0; 24];
    altstack[8] = 2; // SS_DISABLE
    let main = Thread {
        tid: 2,
        cpu: None,
        fs_base: 0,
        sigmask: 0,
        altstack,
        clear_tid: 0,
        pending: Vec::new(),
        frames: Vec::new(),
        wait: None,
        restore_mask: None,
        restart: None,
    };
    Threads {
        list: vec![main],
        cur: 0,
        next_tid: 3,
        pending: Vec::new(),
        timers: Vec::new(),
        itimer_real: None,
        clock: RunClock { ns: 0 },
    }
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
            threads: one_thread(),
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
