//! Package layers: read-only trees of files (packed forkbox images, one per
//! unpacked wheel, content-addressed on the host) merged into a sandbox's file
//! system by reference.
//!
//! Installing a layer creates the directories it needs in the overlay and one
//! overlay node per file whose bytes are the layer's (`FileData::Layer`): no
//! byte is copied, and a saved state names the layer and the inode
//! (`FileState::Layer`), not the bytes, so checkpoints and forks share the
//! layer. Writing such a file copies it into the overlay first, as for image
//! files. Everything is resolved in memory, inside the image, the overlay and
//! the layer's own index: no host path is involved here.

use std::collections::HashMap;
use std::sync::Arc;

use forkbox_image::{Image, NodeKind};

use super::node::{Body, FileData};
use super::{Ino, Vfs, ROOT_INO};
use crate::Errno;

/// Package layers by id (`Image::id`), for `Vfs::restore_state_with`.
pub type Layers = HashMap<String, Arc<Image>>;

/// Most nested directories in a layer (a wheel's tree is shallow).
const MAX_DEPTH: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// A file of the layer is already in the file system (another package's, or the guest's).
    #[error("{path} already exists")]
    Exists { path: String },
    #[error("{path} exists and is not a directory")]
    NotADirectory { path: String },
    /// Layers hold directories and regular files only.
    #[error("package layer has a symlink at {path}")]
    Symlink { path: String },
    #[error("package layer nests directories deeper than {MAX_DEPTH} at {path}")]
    TooDeep { path: String },
    #[error("the sandbox's disk quota is full")]
    NoSpace,
    #[error("{path}: {errno}")]
    Vfs { path: String, errno: Errno },
}

impl Vfs {
    /// Merge `layer` (whose root is the guest's `/`) into the file system:
    /// its directories are created or reused (a symlink to a directory is
    /// followed, inside this VFS), its files become nodes referring to the
    /// layer's bytes. All or nothing: on an error the VFS is unchanged.
    /// Returns the number of files installed.
    pub fn install_layer(&mut self, layer: &Arc<Image>) -> Result<u64, LayerError> {
        let mut next = self.clone();
        let mut files = 0u64;
        let mut stack: Vec<(u32, Ino, String, usize)> = vec![(Image::ROOT, ROOT_INO, String::new(), 0)];
        while let Some((lino, dir, path, depth)) = stack.pop() {
            for (name, child) in layer.children(lino) {
                let cpath = format!("{path}/{}", String::from_utf8_lossy(name));
                let verr = |errno: Errno| match errno {
                    Errno::ENOSPC => LayerError::NoSpace,
                    errno => LayerError::Vfs { path: cpath.clone(), errno },
                };
                let meta = layer.meta(child).ok_or_else(|| verr(Errno::EIO))?;
                let perm = meta.perm & 0o7777;
                match meta.kind {
                    NodeKind::Dir => {
                        if depth >= MAX_DEPTH {
                            return Err(LayerError::TooDeep { path: cpath });
                        }
                        let d = match next.lookup(dir, name).map_err(verr)? {
                            Some(_) => {
                                let ino = next.walk(dir, name, true, &mut 0).map_err(verr)?;
                                if !next.is_dir(ino).map_err(verr)? {
                                    return Err(LayerError::NotADirectory { path: cpath });
                                }
                                ino
                            }
                            None => next.create(dir, name, Vfs::empty_dir(dir), perm, true).map_err(verr)?,
                        };
                        stack.push((child, d, cpath, depth + 1));
                    }
                    NodeKind::File => {
                        if next.lookup(dir, name).map_err(verr)?.is_some() {
                            return Err(LayerError::Exists { path: cpath });
                        }
                        let body = Body::File(FileData::Layer(layer.clone(), child));
                        let ino = next.create(dir, name, body, perm, true).map_err(verr)?;
                        let mtime_ns = i128::from(meta.mtime).saturating_mul(1_000_000_000);
                        let node = next.node_mut(ino).map_err(verr)?;
                        node.mtime_ns = mtime_ns;
                        node.atime_ns = mtime_ns;
                        files += 1;
                    }
                    NodeKind::Symlink => return Err(LayerError::Symlink { path: cpath }),
                }
            }
        }
        *self = next;
        Ok(files)
    }
}
