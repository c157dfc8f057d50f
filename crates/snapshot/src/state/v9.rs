//! Version 9: listening sockets (id, family, bound address, backlog,
//! options), made again on restore. No other processes (they were not
//! recorded: the descriptions only they held were closed in the record).
//! Frozen: never edit these types.

use forkbox_linux::creds::Creds;
use forkbox_linux::fd::FdTable;
use forkbox_linux::mm::MemoryMap;
use forkbox_linux::net::ListenerState;
use forkbox_linux::process::{ExecInfo, Signals};
use forkbox_linux::thread::Threads;
use serde::{Deserialize, Serialize};

use super::v6::Snapshot;
use super::v6::{Ino, VfsState};
use super::{v8, StateError};

/// The process record (also version 10's).
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
    pub listeners: Vec<ListenerState>,
}

/// [`Process`] for writing: the live parts borrowed, the VFS as its owned
/// shape (the same fields, so the same bytes).
#[derive(Serialize)]
pub(super) struct ProcessRef<'a> {
    pub mm: &'a MemoryMap,
    pub fds: &'a FdTable,
    pub vfs: VfsState,
    pub cwd: Ino,
    pub signals: &'a Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: &'a Threads,
    pub exec_info: &'a ExecInfo,
    pub creds: &'a Creds,
    pub owners: &'a [(Ino, u32, u32)],
    pub listeners: &'a [ListenerState],
}

pub(super) fn read(payload: &[u8]) -> Result<Snapshot<Process>, StateError> {
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable version 9 payload: {e}")))
}

/// No listeners recorded: the sockets read as reset.
impl From<v8::Process> for Process {
    fn from(p: v8::Process) -> Process {
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
            owners: p.owners,
            listeners: Vec::new(),
        }
    }
}
