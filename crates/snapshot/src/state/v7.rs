//! Version 7: the process' credentials (user and group ids, supplementary
//! groups); a pipe's capacity (the fd table's objects read both pipe shapes).
//! No file owners (every file was 0:0). Frozen: never edit these types.

use std::sync::Arc;

use forkbox_linux::fd::FdTable;
use serde::{Deserialize, Serialize};

use super::v4::{ExecInfo, MemoryMap, Signals};
use super::v6::Snapshot;
use super::v6::{Ino, Threads, VfsState};
use super::{v6, StateError};

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
}

/// A process' credentials.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Creds {
    pub uid: Ids,
    pub gid: Ids,
    /// Supplementary groups, sorted.
    pub groups: Arc<[u32]>,
}

/// One kind of id (user or group): real, effective, saved set-id, file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ids {
    pub real: u32,
    pub effective: u32,
    pub saved: u32,
    pub fs: u32,
}

/// Root's, which every process of an older version was: all ids 0, no
/// supplementary groups.
impl Default for Creds {
    fn default() -> Creds {
        let root = Ids { real: 0, effective: 0, saved: 0, fs: 0 };
        Creds { uid: root, gid: root, groups: Arc::from(Vec::new()) }
    }
}

pub(super) fn read(payload: &[u8]) -> Result<Snapshot<Process>, StateError> {
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable version 7 payload: {e}")))
}

/// Every process was root: the default credentials.
impl From<v6::Process> for Process {
    fn from(p: v6::Process) -> Process {
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
            creds: Creds::default(),
        }
    }
}
