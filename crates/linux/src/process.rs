//! The state the VMM keeps for the guest process, besides its memory and
//! registers. Cloning it is O(1): every part is a persistent structure.

use std::sync::Arc;

use forkbox_image::Image;

use crate::creds::Creds;
use crate::fd::FdTable;
use crate::mm::MemoryMap;
use crate::thread::Threads;
use crate::vfs::{Ino, Vfs, VfsState, ROOT_INO};

/// The fd the agent channel appears on in the guest.
pub const AGENT_FD: i32 = 3;

/// Signal numbers 1..=NSIG (`crate::thread::NSIG`), as an index bound.
pub const NSIG: usize = crate::thread::NSIG as usize;
/// `struct sigaction` as the kernel ABI has it (handler, flags, restorer, mask).
pub type SigAction = [u8; 32];

#[derive(Clone, Debug, PartialEq)]
pub struct Signals {
    /// Index = signal number (0 unused).
    pub actions: Arc<Vec<SigAction>>,
    pub mask: u64,
    pub altstack: [u8; 24],
}

impl Default for Signals {
    fn default() -> Self {
        let mut altstack = [0; 24];
        altstack[8] = 2; // ss_flags = SS_DISABLE
        Signals { actions: Arc::new(vec![[0; 32]; NSIG + 1]), mask: 0, altstack }
    }
}

#[derive(Clone)]
pub struct Process {
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub vfs: Vfs,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    /// What /proc/self/{exe,cmdline,environ} report (set by execve).
    pub exec_info: ExecInfo,
    /// Threads, pending signals, timers (see `thread.rs`). The current thread's
    /// signal mask, altstack, FS base and clear-child-tid are the fields above.
    pub threads: Threads,
    /// This process' id (`procs::GUEST_PID` for the agent's, which a state
    /// file's `ProcessState` is; a child's is in its `ChildState`).
    pub pid: u32,
    /// User and group ids, supplementary groups (inherited by fork, kept by execve).
    pub creds: Creds,
}

/// A `Process` as a snapshot's state file records it. forkbox-snapshot
/// converts it to and from its own persisted shapes; the parts it still
/// writes as their serde form (`fds`) are part of the state file
/// format: a change to one bumps `forkbox_snapshot::FORMAT_VERSION` and keeps
/// a reader for the previous version (crates/snapshot/tests/golden.rs fails
/// until then).
/// Register sets it holds use the persisted records of `forkbox_vmm::regs`,
/// never kvm-bindings types.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessState {
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub vfs: VfsState,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    /// What /proc/self/{exe,cmdline,environ} report (set by execve).
    pub exec_info: ExecInfo,
    /// User and group ids, supplementary groups (state format 7).
    pub creds: Creds,
    /// Owners of the files that are not 0:0, by inode, sorted (state format 8).
    pub owners: Vec<(Ino, u32, u32)>,
    /// The listening sockets among `fds` (their state lives in the sandbox's
    /// `NetIo`, which the caller asks: `save_state` leaves this empty), by id
    /// (state format 9).
    pub listeners: Vec<crate::net::ListenerState>,
}

/// A process of the sandbox other than the agent's, as a checkpoint records
/// it beside the agent's `ProcessState` (state format 10): what is its own.
/// What all processes share (the file system, the open file descriptions and
/// the objects behind them, the run clock) is in the agent's record; `fds`
/// holds only this process' descriptors (fd -> description id), with no
/// descriptions of its own.
#[derive(Clone, Debug, PartialEq)]
pub struct ChildState {
    pub pid: u32,
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    pub exec_info: ExecInfo,
    pub creds: Creds,
}

/// The program a process runs, as execve got it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecInfo {
    pub exe: Arc<[u8]>,
    /// argv, NUL-terminated strings back to back.
    pub cmdline: Arc<[u8]>,
    pub environ: Arc<[u8]>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessStateError {
    #[error("file system state: {0}")]
    Vfs(#[from] crate::vfs::VfsStateError),
    #[error("inconsistent process state: {0}")]
    Inconsistent(String),
}

impl Process {
    pub fn new(vfs: Vfs, memory_limit: u64) -> Process {
        Process {
            mm: MemoryMap::new(memory_limit),
            fds: FdTable::with_stdio(AGENT_FD),
            vfs,
            cwd: ROOT_INO,
            signals: Signals::default(),
            fs_base: 0,
            tid_address: 0,
            umask: 0o022,
            exec_info: ExecInfo::default(),
            threads: Threads::default(),
            pid: crate::procs::GUEST_PID,
            creds: Creds::default(),
        }
    }

    pub fn save_state(&self) -> ProcessState {
        self.save_state_without(&[])
    }

    /// `save_state` as if the references `held` (open file descriptions the
    /// sandbox's other processes hold, which a state file does not record)
    /// were closed: a pipe whose other end only a child held reads as closed
    /// after a restore, as it would once that child is gone.
    pub fn save_state_without(&self, held: &[u64]) -> ProcessState {
        let (mut fds, mut gone) = self.fds.without_in_flight();
        if !held.is_empty() {
            fds.drop_held(held);
            gone.extend(fds.take_gone());
        }
        let vfs = if gone.iter().any(|k| matches!(k, crate::fd::FileKind::Node(_))) {
            let mut vfs = self.vfs.clone();
            for k in gone {
                if let crate::fd::FileKind::Node(ino) = k {
                    vfs.release(ino);
                }
            }
            (vfs.save_state(), vfs.owners_state())
        } else {
            (self.vfs.save_state(), self.vfs.owners_state())
        };
        let (vfs, owners) = vfs;
        ProcessState {
            mm: self.mm.clone(),
            fds,
            vfs,
            cwd: self.cwd,
            signals: self.signals.clone(),
            fs_base: self.fs_base,
            tid_address: self.tid_address,
            umask: self.umask,
            exec_info: self.exec_info.clone(),
            threads: self.threads.for_checkpoint(),
            creds: self.creds.clone(),
            owners,
            listeners: Vec::new(),
        }
    }

    /// Rebuild a process from a state file, validating everything in it.
    pub fn restore_state(image: Arc<Image>, s: ProcessState) -> Result<Process, ProcessStateError> {
        Process::restore_state_with(image, s, &crate::vfs::Layers::new())
    }

    /// `restore_state` for a process whose files may refer to package layers
    /// (`layers`: each by id, see `VfsState::layer_ids`).
    pub fn restore_state_with(
        image: Arc<Image>,
        s: ProcessState,
        layers: &crate::vfs::Layers,
    ) -> Result<Process, ProcessStateError> {
        Process::restore_state_sharing(image, s, layers, &[])
    }

    /// `restore_state_with` for the agent's process of a sandbox whose other
    /// processes (restored next, `restore_child`) hold the descriptors
    /// `others` (`ChildState::fds`): their references to its descriptions count.
    pub fn restore_state_sharing(
        image: Arc<Image>,
        s: ProcessState,
        layers: &crate::vfs::Layers,
        others: &[&FdTable],
    ) -> Result<Process, ProcessStateError> {
        let bad = ProcessStateError::Inconsistent;
        s.mm.validate().map_err(bad)?;
        s.fds.validate_with(others).map_err(bad)?;
        if s.signals.actions.len() != NSIG + 1 {
            return Err(bad("signal table size".into()));
        }
        s.threads.validate().map_err(|e| bad(format!("threads: {e}")))?;
        s.creds.validate().map_err(|e| bad(format!("credentials: {e}")))?;
        let mut vfs = Vfs::restore_state_with(image, s.vfs, layers)?;
        vfs.restore_owners(&s.owners).map_err(bad)?;
        for ino in s.fds.open_nodes().chain([s.cwd]) {
            vfs.stat(ino).map_err(|e| bad(format!("open inode {ino}: {e}")))?;
        }
        let mut mm = s.mm;
        mm.recount();
        Ok(Process {
            mm,
            fds: s.fds,
            vfs,
            cwd: s.cwd,
            signals: s.signals,
            fs_base: s.fs_base,
            tid_address: s.tid_address,
            umask: s.umask & 0o777,
            exec_info: s.exec_info,
            threads: s.threads,
            pid: crate::procs::GUEST_PID,
            creds: s.creds,
        })
    }

    /// This process (not the current one of its sandbox) as a checkpoint
    /// records it (see [`ChildState`]).
    pub fn save_child_state(&self) -> ChildState {
        ChildState {
            pid: self.pid,
            mm: self.mm.clone(),
            fds: self.fds.own_descriptors(),
            cwd: self.cwd,
            signals: self.signals.clone(),
            fs_base: self.fs_base,
            tid_address: self.tid_address,
            umask: self.umask,
            threads: self.threads.clone(),
            exec_info: self.exec_info.clone(),
            creds: self.creds.clone(),
        }
    }

    /// A process of the sandbox whose agent process is `agent` (restored
    /// already, the current one) back from its record, validated. Its fds
    /// must name descriptions of `agent`'s table (never the agent channel),
    /// its cwd a node of `agent`'s file system. The shared parts it holds
    /// until it first runs are placeholders (a copy of `agent`'s file system;
    /// no descriptions): `Process::swap_shared` gives it the real ones.
    pub fn restore_child(agent: &Process, s: ChildState) -> Result<Process, ProcessStateError> {
        let bad = ProcessStateError::Inconsistent;
        if s.pid <= crate::procs::GUEST_PID {
            return Err(bad(format!("child pid {}", s.pid)));
        }
        s.mm.validate().map_err(bad)?;
        agent.fds.check_descriptors_of(&s.fds).map_err(|e| bad(format!("process {}: {e}", s.pid)))?;
        if s.signals.actions.len() != NSIG + 1 {
            return Err(bad("signal table size".into()));
        }
        s.threads.validate().map_err(|e| bad(format!("threads: {e}")))?;
        s.creds.validate().map_err(|e| bad(format!("credentials: {e}")))?;
        agent.vfs.stat(s.cwd).map_err(|e| bad(format!("cwd of process {}: {e}", s.pid)))?;
        let mut mm = s.mm;
        mm.recount();
        Ok(Process {
            mm,
            fds: s.fds,
            vfs: agent.vfs.clone(),
            cwd: s.cwd,
            signals: s.signals,
            fs_base: s.fs_base,
            tid_address: s.tid_address,
            umask: s.umask & 0o777,
            exec_info: s.exec_info,
            threads: s.threads,
            pid: s.pid,
            creds: s.creds,
        })
    }

    /// The child of a fork by the current thread: a copy of this process with
    /// only that thread (now numbered `pid`), no pending signals or timers, and
    /// this process' descriptors (sharing their open file descriptions, whose
    /// reference counts this counts; the agent channel stays the parent's).
    pub fn fork_child(&mut self, pid: u32) -> Process {
        let mut child = self.clone();
        child.fds = self.fds.fork();
        child.pid = pid;
        let mut t = self.threads.current().clone();
        t.tid = pid;
        t.cpu = None;
        t.wait = None;
        t.pending.clear();
        t.restart = None;
        child.threads.list = vec![t];
        child.threads.cur = 0;
        child.threads.pending.clear();
        child.threads.timers.clear();
        child.threads.itimer_real = None;
        child.threads.next_tid = child.threads.next_tid.max(pid + 1);
        child
    }

    /// The state an execve starts from (the caller closed the close-on-exec
    /// descriptors): a fresh memory map, only the calling thread, caught
    /// signals back to their default action (ignored ones stay ignored), no
    /// timers, no altstack; pid, fds, cwd, umask, mask and pending signals kept.
    pub fn exec_reset(&mut self) {
        self.mm = MemoryMap::new(self.mm.limit());
        let mut acts: Vec<SigAction> = self.signals.actions.to_vec();
        for a in acts.iter_mut() {
            let handler = u64::from_le_bytes(a[..8].try_into().unwrap_or([0; 8]));
            if handler != 1 {
                *a = [0; 32];
            }
        }
        self.signals.actions = Arc::new(acts);
        self.signals.altstack = Signals::default().altstack;
        self.fs_base = 0;
        self.tid_address = 0;
        let cur = self.threads.cur;
        let mut t = self.threads.list[cur].clone();
        t.cpu = None;
        t.wait = None;
        t.frames.clear();
        t.restart = None;
        t.restore_mask = None;
        t.fs_base = 0;
        t.clear_tid = 0;
        t.altstack = self.signals.altstack;
        self.threads.list = vec![t];
        self.threads.cur = 0;
        self.threads.timers.clear();
        self.threads.itimer_real = None;
    }

    /// Swap what all processes of a sandbox share — the file system, the open
    /// file descriptions and the objects behind them, the run clock — with
    /// `other`: they go with the process that runs (only one runs at a time).
    pub fn swap_shared(&mut self, other: &mut Process) {
        std::mem::swap(&mut self.vfs, &mut other.vfs);
        self.fds.swap_shared(&mut other.fds);
        std::mem::swap(&mut self.threads.clock, &mut other.threads.clock);
    }

    /// Make thread `i` the current one: the per-thread fields kept in the
    /// process (signal mask, altstack, FS base, clear-child-tid) go back into
    /// the old current's record and come out of `i`'s.
    pub fn make_current(&mut self, i: usize) {
        let cur = self.threads.cur;
        if i == cur || i >= self.threads.list.len() {
            return;
        }
        if let Some(t) = self.threads.list.get_mut(cur) {
            t.sigmask = self.signals.mask;
            t.altstack = self.signals.altstack;
            t.fs_base = self.fs_base;
            t.clear_tid = self.tid_address;
        }
        let t = &self.threads.list[i];
        self.signals.mask = t.sigmask;
        self.signals.altstack = t.altstack;
        self.fs_base = t.fs_base;
        self.tid_address = t.clear_tid;
        self.threads.cur = i;
    }

    /// Make thread `i` current when the old current is gone (exited): its
    /// fields are dropped, not saved.
    pub fn load_current(&mut self, i: usize) {
        self.threads.cur = usize::MAX;
        self.make_current(i);
    }

    /// The current thread's id.
    pub fn tid(&self) -> crate::thread::Tid {
        self.threads.current().tid
    }

    /// The mask of thread `i` (the current one's lives in `signals.mask`).
    pub fn mask_of(&self, i: usize) -> u64 {
        if i == self.threads.cur {
            self.signals.mask
        } else {
            self.threads.list.get(i).map_or(u64::MAX, |t| t.sigmask)
        }
    }

    /// Signals thread `i` can take now.
    pub fn deliverable(&self, i: usize) -> u64 {
        if !self.threads.any_pending() {
            return 0;
        }
        self.threads.deliverable(i, self.mask_of(i), self.signals.mask)
    }
}
