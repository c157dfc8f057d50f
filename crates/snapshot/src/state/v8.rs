//! Version 8: owners of files (inode, user, group for each file not owned by
//! 0:0). No listening sockets (they were not recorded: they read as reset
//! after a restore). Frozen: never edit these types.

use forkbox_linux::fd::FdTable;
use serde::Deserialize;

use super::v4::{ExecInfo, MemoryMap, Signals};
use super::v6::Snapshot;
use super::v6::{Ino, Threads, VfsState};
use super::v7::Creds;
use super::{v7, StateError};

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
    pub creds: Creds,
    pub owners: Vec<(Ino, u32, u32)>,
}

pub(super) fn read(payload: &[u8]) -> Result<Snapshot<Process>, StateError> {
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable version 8 payload: {e}")))
}

/// Every file was 0:0: no owners recorded.
impl From<v7::Process> for Process {
    fn from(p: v7::Process) -> Process {
        Process {
            mm: p.mm,
            fds: p.fds,
            vfs: p.vfs,
            cwd: p.cwd,
            signals: p.signals,
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: p.threads,
            exec_info: p.exec_info,
            creds: p.creds,
            owners: Vec::new(),
        }
    }
}
