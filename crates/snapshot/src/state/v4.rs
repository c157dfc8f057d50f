//! Version 4 (the first released shape with fd objects): a single-threaded
//! process with no thread table, file bytes inline (no pack files) and
//! directory entries not charged to the VFS's byte count (its layout 2).
//! Frozen: never edit these types; a later version that changes one of them
//! defines its own copy.

use std::fmt;
use std::sync::Arc;

use forkbox_linux::fd::FdTable;
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

/// The guest's memory map.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryMap {
    /// Mappings by start address, in address order; a start appears once.
    #[serde(deserialize_with = "unique_starts")]
    pub vmas: Vec<(u64, Vma)>,
    pub brk_start: u64,
    pub brk: u64,
    /// Bytes committed (the heap and the mappings; files of versions 4 and
    /// earlier counted PROT_NONE mappings too, later ones do not).
    pub committed: u64,
    pub limit: u64,
}

/// One mapping: it ends at `end` (exclusive), with protections `prot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vma {
    pub end: u64,
    pub prot: u32,
    pub kind: VmaKind,
}

/// What a mapping maps (variant order is the format).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmaKind {
    Anon,
    /// A private copy of file content.
    File,
    /// MAP_SHARED of file `ino` from byte `offset` (written back to the file).
    SharedFile {
        ino: u64,
        offset: u64,
    },
    Stack,
    /// Memory shared with the sandbox's other processes. Never written: the
    /// engine turns such mappings into the others or refuses to save first.
    /// It decodes (in a file of any version) only so that the memory map's
    /// own check refuses it on restore, as it always has.
    Shm {
        obj: u32,
        offset: u64,
        ino: Option<u64>,
    },
}

/// The mappings of a map, refusing a start address seen twice (a map holds
/// one mapping per start; a crafted file must not make one disappear).
fn unique_starts<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u64, Vma)>, D::Error> {
    let vmas: Vec<(u64, Vma)> = Vec::deserialize(d)?;
    let mut starts: Vec<u64> = vmas.iter().map(|(s, _)| *s).collect();
    starts.sort_unstable();
    if starts.windows(2).any(|w| w[0] == w[1]) {
        return Err(serde::de::Error::custom("duplicate keys in a map"));
    }
    Ok(vmas)
}

/// The signal dispositions, mask and alternate stack of a process (its
/// current thread's, in versions with threads).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Signals {
    /// `struct sigaction` as the kernel ABI has it, by signal number (0 unused).
    pub actions: Arc<Vec<[u8; 32]>>,
    pub mask: u64,
    /// `stack_t` as the kernel ABI has it.
    pub altstack: [u8; 24],
}

/// The program a process runs, as execve got it (/proc/self/{exe,cmdline,environ}).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecInfo {
    pub exe: Arc<[u8]>,
    /// argv, NUL-terminated strings back to back.
    pub cmdline: Arc<[u8]>,
    pub environ: Arc<[u8]>,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A map that names one start twice is refused (collected into the live
    /// map, the second mapping would silently replace the first).
    #[test]
    fn a_memory_map_with_a_start_twice_does_not_decode() {
        let vma = Vma { end: 0x2000, prot: 3, kind: VmaKind::Anon };
        let map = |vmas| MemoryMap { vmas, brk_start: 0, brk: 0, committed: 0x1000, limit: 1 << 20 };
        let ok = postcard::to_stdvec(&map(vec![(0x1000, vma), (0x3000, Vma { end: 0x4000, ..vma })])).unwrap();
        assert!(postcard::from_bytes::<MemoryMap>(&ok).is_ok());
        let twice = postcard::to_stdvec(&map(vec![(0x1000, vma), (0x1000, vma)])).unwrap();
        let err = postcard::from_bytes::<MemoryMap>(&twice).unwrap_err();
        assert_eq!(err, postcard::Error::SerdeDeCustom);
    }
}
