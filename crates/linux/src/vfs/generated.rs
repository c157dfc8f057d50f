//! Trees the VMM generates into the file system (/proc): written into the
//! overlay without charging the guest's quota, replaced whole on every refresh.

use std::sync::Arc;

use super::node::{Body, FileData};
use super::{Ino, Vfs};
use crate::Errno;

/// A generated node.
pub enum Gen {
    Dir(Vec<(Vec<u8>, Gen)>),
    /// Bytes and permission bits.
    File(Vec<u8>, u32),
    Symlink(Vec<u8>),
}

impl Vfs {
    /// Make the children of directory `dir` exactly `children` (removing what
    /// was there). Open descriptions of replaced files keep their old bytes.
    pub fn replace_generated(&mut self, dir: Ino, children: Vec<(Vec<u8>, Gen)>) -> Result<(), Errno> {
        for (name, ino) in self.entries(dir)? {
            self.remove_tree(dir, &name, ino)?;
        }
        for (name, g) in children {
            self.build(dir, &name, g)?;
        }
        Ok(())
    }

    fn remove_tree(&mut self, parent: Ino, name: &[u8], ino: Ino) -> Result<(), Errno> {
        if self.is_dir(ino)? {
            for (n, c) in self.entries(ino)? {
                self.remove_tree(ino, &n, c)?;
            }
        }
        self.remove_entry(parent, name)?;
        self.dec_link(ino)
    }

    fn build(&mut self, parent: Ino, name: &[u8], g: Gen) -> Result<Ino, Errno> {
        match g {
            Gen::Dir(children) => {
                let ino = self.create(parent, name, Self::empty_dir(parent), 0o555, false)?;
                for (n, c) in children {
                    self.build(ino, &n, c)?;
                }
                Ok(ino)
            }
            Gen::File(bytes, perm) => {
                self.create(parent, name, Body::File(FileData::Owned(Arc::new(bytes))), perm & 0o7777, false)
            }
            Gen::Symlink(target) => self.create(parent, name, Body::Symlink(Arc::from(target)), 0o777, false),
        }
    }

    /// The inode of the directory at absolute `path` (no symlink at the end followed).
    pub fn lookup_abs(&self, path: &[u8]) -> Result<Ino, Errno> {
        self.walk(super::ROOT_INO, path, true, &mut 0)
    }
}
