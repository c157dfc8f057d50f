//! The guest image: a Debian python3 + numpy tree packed into one read-only file
//! with an index (paths, modes, sizes, symlinks, content).
//!
//! CONTRACT (used by forkbox-linux's VFS; keep these signatures):
//! - inode numbers are dense `u32` in `0..image.inode_count()`, root is `Image::ROOT` (0);
//! - `lookup` resolves ONE name in ONE directory and never follows symlinks;
//! - `content` borrows the file bytes straight out of the mmapped image file; a non-empty
//!   file's bytes start on a 4096-byte boundary of the image file (`content_offset`), so
//!   they are page-aligned in memory too.
//!
//! Layout: `format.rs` (on-disk format), `reader.rs` (`Image`), `pack.rs` (`pack_dir`),
//! `build/` (`forkbox image build`: Debian packages -> tree -> image).
//!
//! Place in the flow request -> runtime -> sessions -> engine -> vmm/linux -> **guest**:
//! the guest's files (what the guest runs); a leaf that the layers above read.

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

pub mod build;
mod format;
mod pack;
mod reader;

pub use build::packages;
pub use build::{
    build, built_id, check_spec, default_home, image_path, resolve_id, Blas, BuildError, BuildOptions, BuildStats,
    BuiltImage, ExtraFile, ImageSpec, PipSource, Report, WheelRef,
};
pub use pack::{pack_dir, pack_dir_with, PackOptions, PackStats};
pub use reader::Image;

#[cfg(test)]
mod tests;
