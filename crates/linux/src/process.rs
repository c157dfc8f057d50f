//! The state the VMM keeps for the guest process, besides its memory and
//! registers. Cloning it is O(1): every part is a persistent structure.

use std::sync::Arc;

use forkbox_image::Image;
use serde::{Deserialize, Serialize};

use crate::fd::FdTable;
use crate::mm::MemoryMap;
use crate::vfs::{Ino, Vfs, VfsState, ROOT_INO};

/// The fd the agent channel appears on in the guest.
pub const AGENT_FD: i32 = 3;

pub const NSIG: usize = 64;
/// `struct sigaction` as the kernel ABI has it (handler, flags, restorer, mask).
pub type SigAction = [u8; 32];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
}

/// A `Process` as written into a snapshot's state file. Its shape (and that
/// of everything in it) is part of the state file format: a change to it
/// bumps `forkbox_snapshot::FORMAT_VERSION` and keeps a reader for the
/// previous version (crates/snapshot/tests/golden.rs fails until then).
/// Register sets it holds use the persisted records of `forkbox_vmm::regs`,
/// never kvm-bindings types.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessState {
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub vfs: VfsState,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
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
        }
    }

    pub fn save_state(&self) -> ProcessState {
        ProcessState {
            mm: self.mm.clone(),
            fds: self.fds.clone(),
            vfs: self.vfs.save_state(),
            cwd: self.cwd,
            signals: self.signals.clone(),
            fs_base: self.fs_base,
            tid_address: self.tid_address,
            umask: self.umask,
        }
    }

    /// Rebuild a process from a state file, validating everything in it.
    pub fn restore_state(image: Arc<Image>, s: ProcessState) -> Result<Process, ProcessStateError> {
        let bad = ProcessStateError::Inconsistent;
        s.mm.validate().map_err(bad)?;
        s.fds.validate().map_err(bad)?;
        if s.signals.actions.len() != NSIG + 1 {
            return Err(bad("signal table size".into()));
        }
        let vfs = Vfs::restore_state(image, s.vfs)?;
        for ino in s.fds.open_nodes().chain([s.cwd]) {
            vfs.stat(ino).map_err(|e| bad(format!("open inode {ino}: {e}")))?;
        }
        Ok(Process {
            mm: s.mm,
            fds: s.fds,
            vfs,
            cwd: s.cwd,
            signals: s.signals,
            fs_base: s.fs_base,
            tid_address: s.tid_address,
            umask: s.umask & 0o777,
        })
    }
}
