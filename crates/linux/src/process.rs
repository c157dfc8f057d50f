//! The state the VMM keeps for the guest process, besides its memory and
//! registers. Cloning it is O(1): every part is a persistent structure.

use std::sync::Arc;

use crate::fd::FdTable;
use crate::mm::MemoryMap;
use crate::vfs::{Ino, Vfs, ROOT_INO};

/// The fd the agent channel appears on in the guest.
pub const AGENT_FD: i32 = 3;

pub const NSIG: usize = 64;
/// `struct sigaction` as the kernel ABI has it (handler, flags, restorer, mask).
pub type SigAction = [u8; 32];

#[derive(Clone)]
pub struct Signals {
    pub actions: Arc<[SigAction; NSIG + 1]>,
    pub mask: u64,
    pub altstack: [u8; 24],
}

impl Default for Signals {
    fn default() -> Self {
        Signals { actions: Arc::new([[0; 32]; NSIG + 1]), mask: 0, altstack: [0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0] }
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
}
