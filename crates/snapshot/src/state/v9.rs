//! Version 9: listening sockets (id, family, bound address, backlog,
//! options), made again on restore. No other processes (they were not
//! recorded: the descriptions only they held were closed in the record).
//! Frozen: never edit these types.

use std::net::SocketAddr;
use std::time::Duration;

use forkbox_linux::fd::FdTable;
use serde::{Deserialize, Serialize};

use super::v4::{ExecInfo, MemoryMap, Signals};
use super::v6::Snapshot;
use super::v6::{Ino, Threads, VfsState};
use super::v7::Creds;
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

/// A listening socket: what re-creates it in the port table of a restored
/// sandbox under the same socket id (its queued connections are not
/// recorded).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerState {
    pub id: u64,
    /// AF_INET or AF_INET6.
    pub domain: i32,
    /// The bound address in the sandbox.
    pub local: SocketAddr,
    /// The queue bound.
    pub backlog: u32,
    /// SO_REUSEADDR / SO_REUSEPORT.
    pub reuse: bool,
    pub rcvtimeo: Option<Duration>,
    pub sndtimeo: Option<Duration>,
    /// Option values kept for the socket ((level, name), value), as set.
    pub opts: Vec<((i32, i32), Vec<u8>)>,
}

/// [`Process`] for writing: the parts that are still live types borrowed,
/// the others as their persisted shapes (the same fields, so the same
/// bytes; file bytes and signal actions shared, not copied).
#[derive(Serialize)]
pub(super) struct ProcessRef<'a> {
    pub mm: MemoryMap,
    pub fds: &'a FdTable,
    pub vfs: VfsState,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    pub exec_info: ExecInfo,
    pub creds: Creds,
    pub owners: &'a [(Ino, u32, u32)],
    pub listeners: Vec<ListenerState>,
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
