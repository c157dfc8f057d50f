//! Version 4 (the first released shape with fd objects): a single-threaded
//! process with no thread table, file bytes inline (no pack files) and
//! directory entries not charged to the VFS's byte count (its layout 2).
//! Frozen: never edit these types; a later version that changes one of them
//! defines its own copy.

use std::fmt;
use std::sync::Arc;

use forkbox_linux::fd::FdTable;
use forkbox_linux::mm::MemoryMap;
use forkbox_linux::process::{ExecInfo, Signals};
use forkbox_vmm::regs::VcpuRecord;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::StateError;
use crate::cpu::CpuFingerprint;
use crate::memory::MemoryStats;

/// An inode number.
pub type Ino = u64;

#[derive(Deserialize)]
pub(super) struct Snapshot {
    pub image_id: String,
    pub cpu: CpuFingerprint,
    pub vcpu: VcpuRecord,
    pub process: Process,
    pub memory: MemoryStats,
    pub info: String,
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
    pub exec_info: ExecInfo,
}

/// The file system overlay: everything but the image (referenced by id).
#[derive(Deserialize)]
pub(super) struct VfsState {
    pub image_id: String,
    /// The VFS's own layout number (2 in this version's files).
    pub version: u32,
    pub next_ino: Ino,
    pub quota: u64,
    pub overlay_bytes: u64,
    /// Overlay nodes, sorted by inode number.
    pub nodes: Vec<NodeState>,
    /// Open references: (inode, count), sorted by inode number.
    pub refs: Vec<(Ino, u32)>,
}

#[derive(Deserialize)]
pub(super) struct NodeState {
    pub ino: Ino,
    pub perm: u32,
    pub mtime_ns: i128,
    pub atime_ns: i128,
    pub nlink: u32,
    pub body: BodyState,
}

#[derive(Deserialize)]
pub(super) enum BodyState {
    Dir { parent: Ino, entries: Vec<(Vec<u8>, Ino)> },
    File(FileState),
    Symlink(Vec<u8>),
    CharDev(DevKind),
    Fifo,
    Socket,
    Gone,
}

#[derive(Deserialize)]
pub(super) enum FileState {
    Image,
    Owned(FileBytes),
}

/// A character device under /dev (variant order is the format).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DevKind {
    Null,
    Zero,
    Full,
    Urandom,
    Tty,
    Ptmx,
}

/// A file's bytes: one byte string (postcard: length, then the raw bytes),
/// shared (`Arc`) with the VFS it was saved from or is restored into.
#[derive(Clone, PartialEq, Eq)]
pub struct FileBytes(pub Arc<Vec<u8>>);

impl fmt::Debug for FileBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FileBytes({} bytes)", self.0.len())
    }
}

impl Serialize for FileBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for FileBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl serde::de::Visitor<'_> for BytesVisitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        d.deserialize_byte_buf(BytesVisitor).map(|v| FileBytes(Arc::new(v)))
    }
}

pub(super) fn read(payload: &[u8]) -> Result<Snapshot, StateError> {
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable version 4 payload: {e}")))
}
