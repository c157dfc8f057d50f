//! Overlay nodes: the writable upper layer over the read-only image.
//!
//! A `Node` in `Vfs::nodes` overrides the image inode of the same number (copy-up
//! keeps the number, so the parent directory need not change) or is a new inode
//! (numbers from `FIRST_OVERLAY_INO` up). Everything in here is cheap to clone: file
//! bytes are behind an `Arc` and directory entries are a persistent `OrdMap`, so a
//! clone of the whole `Vfs` shares them until one side writes.

use std::sync::Arc;

use imbl::OrdMap;

use super::{FileType, Ino};

/// Bytes charged to the overlay quota for every overlay node, on top of its file or
/// symlink bytes. It bounds what a guest can pin by creating empty files or
/// directories (names are at most 255 bytes, so this also roughly covers the entry).
pub const NODE_COST: u64 = 256;

/// Bytes charged for one directory entry besides its name (the host keeps a
/// name and an inode number in a persistent map per entry): hard links and
/// names cost quota, so a guest cannot pin unbounded host memory with them.
pub const ENTRY_COST: u64 = 64;

/// What one directory entry named `name` costs against the overlay quota.
pub fn entry_cost(name: &[u8]) -> u64 {
    ENTRY_COST + name.len() as u64
}

/// Character devices under `/dev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DevKind {
    /// Reads: EOF. Writes: discarded.
    Null,
    /// Reads: zeros. Writes: discarded.
    Zero,
    /// Reads: zeros. Writes: ENOSPC.
    Full,
    /// Reads: host entropy (getrandom). Writes: discarded. Both /dev/random and /dev/urandom.
    Urandom,
    /// /dev/tty: there is no controlling terminal, so opening it is ENXIO.
    Tty,
    /// /dev/ptmx: the sandbox has no pseudo-terminals; opening it is ENODEV
    /// (so `os.openpty()` fails with "No such device").
    Ptmx,
}

impl DevKind {
    /// Linux device number (major 1, "mem" devices), glibc `makedev` encoding.
    pub fn rdev(self) -> u64 {
        let minor = match self {
            DevKind::Null => 3,
            DevKind::Zero => 5,
            DevKind::Full => 7,
            DevKind::Urandom => 9,
            DevKind::Tty => return makedev(5, 0),
            DevKind::Ptmx => return makedev(5, 2),
        };
        makedev(1, minor)
    }
}

/// glibc's `makedev`.
pub fn makedev(major: u64, minor: u64) -> u64 {
    ((major & 0xffff_f000) << 32) | ((major & 0xfff) << 8) | ((minor & 0xffff_ff00) << 12) | (minor & 0xff)
}

/// Content of a regular file in the overlay.
#[derive(Clone)]
pub(crate) enum FileData {
    /// Still the image's bytes of this image inode (a metadata-only copy-up, e.g. after
    /// chmod, link or unlink-while-open): no bytes copied yet.
    Image(u32),
    /// Our own bytes. Shared with clones of the `Vfs` until one side writes
    /// (`Arc::get_mut` fails -> copy, see `Vfs::file_vec_mut`).
    Owned(Arc<Vec<u8>>),
    /// The bytes of file inode `1` of a read-only package layer (see `layer.rs`):
    /// shared by every sandbox that installed it, copied on the first write.
    Layer(Arc<forkbox_image::Image>, u32),
}

#[derive(Clone)]
pub(crate) enum Body {
    Dir {
        entries: OrdMap<Vec<u8>, Ino>,
        /// ".." (the root's parent is the root).
        parent: Ino,
    },
    File(FileData),
    Symlink(Arc<[u8]>),
    CharDev(DevKind),
    /// A FIFO (mkfifo): opening it gives a pipe (`objects::Objects::fifos`).
    Fifo,
    /// An AF_UNIX socket file (bind): only a name to connect to.
    Socket,
    /// Tombstone of a deleted image inode whose last reference went away: it keeps
    /// the number from falling back to the image's view.
    Gone,
}

#[derive(Clone)]
pub(crate) struct Node {
    pub body: Body,
    /// Permission bits (07777).
    pub perm: u32,
    pub mtime_ns: i128,
    /// Access time (only set by utimensat: reads do not update it, as `noatime`).
    pub atime_ns: i128,
    /// Names referring to the node. Directories: 1 while linked, 0 once removed
    /// (`stat` reports 2 + subdirectories). 0 = unlinked but still held (see `Vfs::hold`).
    pub nlink: u32,
}

impl Node {
    pub fn kind(&self) -> Option<FileType> {
        Some(match self.body {
            Body::Dir { .. } => FileType::Dir,
            Body::File(_) => FileType::File,
            Body::Symlink(_) => FileType::Symlink,
            Body::CharDev(_) => FileType::CharDev,
            Body::Fifo => FileType::Fifo,
            Body::Socket => FileType::Socket,
            Body::Gone => return None,
        })
    }

    /// What this node costs against the overlay quota.
    pub fn cost(&self) -> u64 {
        match &self.body {
            Body::Gone => 0,
            Body::File(FileData::Owned(v)) => NODE_COST + v.len() as u64,
            Body::Symlink(t) => NODE_COST + t.len() as u64,
            Body::Dir { entries, .. } => entries.keys().fold(NODE_COST, |a, k| a.saturating_add(entry_cost(k))),
            _ => NODE_COST,
        }
    }
}
