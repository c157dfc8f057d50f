//! The guest image: a Debian python3 + numpy tree packed into one read-only file
//! with an index (paths, modes, sizes, symlinks, content).
//!
//! CONTRACT (used by forkbox-linux's VFS; keep these signatures):
//! - inode numbers are dense `u32` in `0..image.inode_count()`, root is `Image::ROOT` (0);
//! - `lookup` resolves ONE name in ONE directory and never follows symlinks;
//! - `content` borrows the file bytes straight out of the mmapped image file.

use std::path::Path;

pub type Ino = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Dir,
    File,
    Symlink,
}

/// Metadata of one image node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeMeta {
    pub kind: NodeKind,
    /// Permission bits only (e.g. 0o755), without the S_IF* type bits.
    pub perm: u32,
    /// File: content length. Symlink: target length. Dir: 4096.
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image I/O on {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a forkbox image (bad magic or version) at {0}")]
    BadHeader(String),
    #[error("image {0} is corrupt: {1}")]
    Corrupt(String, String),
}

/// Pack a host directory tree (files, dirs, symlinks; modes and mtimes kept) into an
/// image file at `out`. Returns the image id (content hash, hex).
pub fn pack_dir(_root: &Path, _out: &Path) -> Result<String, ImageError> {
    todo!()
}

/// A packed, read-only guest image opened from disk (mmapped).
pub struct Image {
    _private: (),
}

impl Image {
    pub const ROOT: Ino = 0;

    pub fn open(_path: &Path) -> Result<Image, ImageError> {
        todo!()
    }
    /// Content hash that names this image (hex).
    pub fn id(&self) -> &str {
        todo!()
    }
    pub fn inode_count(&self) -> u32 {
        todo!()
    }
    pub fn meta(&self, _ino: Ino) -> Option<NodeMeta> {
        todo!()
    }
    /// One directory entry by name (no "." / "..", no symlink following).
    pub fn lookup(&self, _dir: Ino, _name: &[u8]) -> Option<Ino> {
        todo!()
    }
    /// The parent directory of `ino` (root's parent is root).
    pub fn parent(&self, _ino: Ino) -> Ino {
        todo!()
    }
    /// Entries of a directory, sorted by name (no "." / "..").
    pub fn children(&self, _dir: Ino) -> Vec<(&[u8], Ino)> {
        todo!()
    }
    pub fn read_link(&self, _ino: Ino) -> Option<&[u8]> {
        todo!()
    }
    /// File bytes, borrowed from the mapped image.
    pub fn content(&self, _ino: Ino) -> Option<&[u8]> {
        todo!()
    }
}
