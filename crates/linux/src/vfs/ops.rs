//! Namespace operations: open, mkdir, rmdir, unlink, rename, symlink, link, ...

use std::borrow::Cow;
use std::sync::Arc;

use super::node::{Body, FileData};
use super::path::Last;
use super::{FileType, Ino, Vfs, View, MAX_SYMLINKS, PATH_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO};
use crate::Errno;

impl Vfs {
    /// Resolve `path`: absolute paths start at the VFS root, relative ones at `start`
    /// (cwd or a dirfd's inode). ".." of the root is the root; symlink targets are
    /// resolved inside the VFS (absolute ones from the VFS root); more than
    /// MAX_SYMLINKS -> ELOOP; a non-directory in the middle -> ENOTDIR; "" -> ENOENT;
    /// a component > 255 bytes or a path > 4095 -> ENAMETOOLONG; a trailing "/"
    /// requires a directory (and follows a final symlink even if `!follow_last`).
    pub fn resolve(&self, start: Ino, path: &[u8], follow_last: bool) -> Result<Ino, Errno> {
        self.walk(start, path, follow_last, &mut 0)
    }

    /// open(2), the path part. Returns the inode and takes a reference on it (give it
    /// back with `release` when the open file description is closed).
    ///
    /// - O_CREAT creates a regular file with `mode & 0o7777` (apply the umask before);
    ///   O_EXCL -> EEXIST if the name exists, even as a dangling symlink; O_CREAT
    ///   through a dangling symlink creates the symlink's target, as Linux does;
    ///   O_CREAT on a directory or with a trailing '/' -> EISDIR; O_CREAT|O_DIRECTORY
    ///   -> EINVAL (Linux >= 6.4).
    /// - O_TMPFILE -> EOPNOTSUPP (Python's tempfile falls back to create + unlink).
    /// - O_DIRECTORY on a non-directory -> ENOTDIR; O_NOFOLLOW on a symlink -> ELOOP
    ///   (O_PATH|O_NOFOLLOW returns the symlink itself).
    /// - A directory opened for writing or with O_TRUNC -> EISDIR.
    /// - O_TRUNC empties a regular file (like Linux, whatever the access mode, since
    ///   the guest is root); ignored on devices.
    pub fn open(&mut self, start: Ino, path: &[u8], flags: i32, mode: u32) -> Result<Ino, Errno> {
        if flags & libc::O_TMPFILE == libc::O_TMPFILE {
            return Err(Errno::EOPNOTSUPP);
        }
        let acc = flags & libc::O_ACCMODE;
        let writes = acc == libc::O_WRONLY || acc == libc::O_RDWR;
        let (ino, created) = if flags & libc::O_CREAT != 0 && flags & libc::O_PATH == 0 {
            if flags & libc::O_DIRECTORY != 0 {
                return Err(Errno::EINVAL);
            }
            self.open_create(start, path, flags, mode)?
        } else {
            (self.walk(start, path, flags & libc::O_NOFOLLOW == 0, &mut 0)?, false)
        };
        let kind = self.file_type(ino)?;
        if flags & libc::O_PATH != 0 {
            if flags & libc::O_DIRECTORY != 0 && kind != FileType::Dir {
                return Err(Errno::ENOTDIR);
            }
            self.hold(ino);
            return Ok(ino);
        }
        match kind {
            FileType::Symlink => return Err(Errno::ELOOP),
            FileType::Dir => {
                if writes || flags & libc::O_TRUNC != 0 {
                    return Err(Errno::EISDIR);
                }
            }
            FileType::File | FileType::CharDev | FileType::Fifo => {
                if flags & libc::O_DIRECTORY != 0 {
                    return Err(Errno::ENOTDIR);
                }
            }
            // A socket file is only a name to connect to.
            FileType::Socket => return Err(if flags & libc::O_DIRECTORY != 0 { Errno::ENOTDIR } else { Errno::ENXIO }),
        }
        if self.journal.is_some() && !created {
            self.note_name(start, path, ino);
        }
        if flags & libc::O_TRUNC != 0 && kind == FileType::File && !created {
            self.truncate(ino, 0)?;
        }
        self.hold(ino);
        Ok(ino)
    }

    /// The O_CREAT part of `open`: (inode, created?).
    fn open_create(&mut self, start: Ino, path: &[u8], flags: i32, mode: u32) -> Result<(Ino, bool), Errno> {
        let excl = flags & libc::O_EXCL != 0;
        let mut links = 0u32;
        let mut start = start;
        let mut path: Cow<'_, [u8]> = Cow::Borrowed(path);
        loop {
            let p = self.walk_parent(start, &path, &mut links)?;
            let Last::Name(name) = p.last else {
                return Err(if excl { Errno::EEXIST } else { Errno::EISDIR });
            };
            if p.trailing {
                return Err(Errno::EISDIR);
            }
            let Some(ino) = self.lookup(p.dir, &name)? else {
                let body = Body::File(FileData::Owned(Arc::new(Vec::new())));
                let ino = self.create(p.dir, &name, body, mode & 0o7777, true)?;
                return Ok((ino, true));
            };
            if excl {
                return Err(Errno::EEXIST);
            }
            match self.file_type(ino)? {
                FileType::Symlink => {
                    if flags & libc::O_NOFOLLOW != 0 {
                        return Err(Errno::ELOOP);
                    }
                    links += 1;
                    if links > MAX_SYMLINKS {
                        return Err(Errno::ELOOP);
                    }
                    let target = self.link_target(ino)?;
                    if target.is_empty() {
                        return Err(Errno::ENOENT);
                    }
                    // Continue with the target, relative to the link's directory.
                    path = Cow::Owned(target.to_vec());
                    start = p.dir;
                }
                FileType::Dir => return Err(Errno::EISDIR),
                FileType::File | FileType::CharDev | FileType::Fifo => return Ok((ino, false)),
                FileType::Socket => return Err(Errno::ENXIO),
            }
        }
    }

    /// mkdir(2) with `mode & 0o1777`.
    /// mknod(2) of a FIFO or a socket file (bind of an AF_UNIX path): EEXIST if
    /// the name exists. The new inode.
    pub fn mknod(&mut self, start: Ino, path: &[u8], kind: FileType, mode: u32) -> Result<Ino, Errno> {
        let body = match kind {
            FileType::Fifo => Body::Fifo,
            FileType::Socket => Body::Socket,
            _ => return Err(Errno::EPERM),
        };
        let p = self.walk_parent(start, path, &mut 0)?;
        let Last::Name(name) = p.last else { return Err(Errno::EEXIST) };
        if self.lookup(p.dir, &name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        if p.trailing {
            return Err(Errno::ENOENT);
        }
        self.create(p.dir, &name, body, mode & 0o7777, true)
    }

    pub fn mkdir(&mut self, start: Ino, path: &[u8], mode: u32) -> Result<(), Errno> {
        let p = self.walk_parent(start, path, &mut 0)?;
        let Last::Name(name) = p.last else { return Err(Errno::EEXIST) };
        if self.lookup(p.dir, &name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let body = Self::empty_dir(p.dir);
        self.create(p.dir, &name, body, mode & 0o1777, true)?;
        Ok(())
    }

    /// rmdir(2): ENOTEMPTY, ENOTDIR, EINVAL for ".", EBUSY for the root.
    pub fn rmdir(&mut self, start: Ino, path: &[u8]) -> Result<(), Errno> {
        let p = self.walk_parent(start, path, &mut 0)?;
        let name = match p.last {
            Last::Name(n) => n,
            Last::Dot => return Err(Errno::EINVAL),
            Last::DotDot => return Err(Errno::ENOTEMPTY),
            Last::Root => return Err(Errno::EBUSY),
        };
        let ino = self.lookup(p.dir, &name)?.ok_or(Errno::ENOENT)?;
        if !self.is_dir(ino)? {
            return Err(Errno::ENOTDIR);
        }
        if ino == ROOT_INO {
            return Err(Errno::EBUSY);
        }
        if !self.dir_is_empty(ino)? {
            return Err(Errno::ENOTEMPTY);
        }
        self.remove_entry(p.dir, &name)?;
        self.dec_link(ino)
    }

    /// unlink(2): removes a non-directory name (a symlink itself, not its target).
    /// The inode survives while referenced (see `hold`).
    pub fn unlink(&mut self, start: Ino, path: &[u8]) -> Result<(), Errno> {
        let p = self.walk_parent(start, path, &mut 0)?;
        let Last::Name(name) = p.last else { return Err(Errno::EISDIR) };
        let ino = self.lookup(p.dir, &name)?.ok_or(Errno::ENOENT)?;
        if self.is_dir(ino)? {
            return Err(Errno::EISDIR);
        }
        if p.trailing {
            return Err(Errno::ENOTDIR);
        }
        self.remove_entry(p.dir, &name)?;
        self.dec_link(ino)
    }

    /// renameat2(2) with flags 0, RENAME_NOREPLACE or RENAME_EXCHANGE.
    /// Replaces a non-directory atomically, a directory only over an empty directory
    /// (ENOTEMPTY), ENOTDIR / EISDIR on kind mismatches, EINVAL when moving a directory
    /// into its own subtree, EBUSY for "." / ".." / "/" as either name. Renaming a name
    /// onto another name of the same inode does nothing.
    pub fn rename(&mut self, old_start: Ino, old: &[u8], new_start: Ino, new: &[u8], flags: u32) -> Result<(), Errno> {
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0 || flags == RENAME_NOREPLACE | RENAME_EXCHANGE {
            return Err(Errno::EINVAL);
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        let noreplace = flags & RENAME_NOREPLACE != 0;
        let op = self.walk_parent(old_start, old, &mut 0)?;
        let np = self.walk_parent(new_start, new, &mut 0)?;
        let Last::Name(oname) = op.last else { return Err(Errno::EBUSY) };
        let Last::Name(nname) = np.last else {
            return Err(if noreplace { Errno::EEXIST } else { Errno::EBUSY });
        };
        // The checks in the order Linux makes them (do_renameat2, then vfs_rename).
        let src = self.lookup(op.dir, &oname)?.ok_or(Errno::ENOENT)?;
        let target = self.lookup(np.dir, &nname)?;
        if noreplace && target.is_some() {
            return Err(Errno::EEXIST);
        }
        let src_dir = self.is_dir(src)?;
        let target_dir = match target {
            Some(t) => self.is_dir(t)?,
            None => false,
        };
        if exchange {
            if target.is_none() {
                return Err(Errno::ENOENT);
            }
            if !target_dir && np.trailing {
                return Err(Errno::ENOTDIR);
            }
        }
        if !src_dir && (op.trailing || (!exchange && np.trailing)) {
            return Err(Errno::ENOTDIR);
        }
        if self.link_count(np.dir)? == 0 {
            return Err(Errno::ENOENT);
        }
        // The source may not be an ancestor of the destination, nor the target an
        // ancestor of the source.
        if src_dir && self.is_ancestor(src, np.dir)? {
            return Err(Errno::EINVAL);
        }
        if let Some(t) = target {
            if target_dir && self.is_ancestor(t, op.dir)? {
                return Err(if exchange { Errno::EINVAL } else { Errno::ENOTEMPTY });
            }
            if t == src {
                return Ok(());
            }
            if !exchange {
                if src_dir && !target_dir {
                    return Err(Errno::ENOTDIR);
                }
                if !src_dir && target_dir {
                    return Err(Errno::EISDIR);
                }
                if target_dir && !self.dir_is_empty(t)? {
                    return Err(Errno::ENOTEMPTY);
                }
            }
        }

        // A new name costs quota (a replaced or exchanged one keeps its entry).
        let (new_cost, old_cost) = (super::entry_cost(&nname), super::entry_cost(&oname));
        let new_entry = !exchange && target.is_none();
        if new_entry && new_cost > old_cost && self.used.saturating_add(new_cost - old_cost) > self.quota {
            return Err(Errno::ENOSPC);
        }

        // All checks done: from here on nothing can fail halfway for a valid tree.
        let moved = op.dir != np.dir;
        match (exchange, target) {
            (true, Some(t)) => {
                self.dir_entries_mut(op.dir)?.insert(oname.clone(), t);
                self.dir_entries_mut(np.dir)?.insert(nname.clone(), src);
                if moved && target_dir {
                    self.set_parent(t, op.dir)?;
                }
            }
            _ => {
                self.dir_entries_mut(op.dir)?.remove(&oname);
                self.used = self.used.saturating_sub(old_cost);
                let replaced = self.dir_entries_mut(np.dir)?.insert(nname.clone(), src);
                if replaced.is_none() {
                    self.used = self.used.saturating_add(new_cost);
                }
                if let Some(t) = replaced {
                    self.dec_link(t)?;
                }
            }
        }
        if moved && src_dir {
            self.set_parent(src, np.dir)?;
        }
        self.touch(op.dir)?;
        self.touch(np.dir)?;
        self.note_move(op.dir, &oname, np.dir, &nname, src);
        if let (true, Some(t)) = (exchange, target) {
            self.note_move(np.dir, &nname, op.dir, &oname, t);
        }
        Ok(())
    }

    fn set_parent(&mut self, dir: Ino, new_parent: Ino) -> Result<(), Errno> {
        match &mut self.node_mut(dir)?.body {
            Body::Dir { parent, .. } => {
                *parent = new_parent;
                Ok(())
            }
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// symlink(2): a symlink named `path` pointing at `target` (stored as given).
    pub fn symlink(&mut self, target: &[u8], start: Ino, path: &[u8]) -> Result<(), Errno> {
        if target.is_empty() {
            return Err(Errno::ENOENT);
        }
        if target.len() >= PATH_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        if target.contains(&0) {
            return Err(Errno::EINVAL);
        }
        let p = self.walk_parent(start, path, &mut 0)?;
        let Last::Name(name) = p.last else { return Err(Errno::EEXIST) };
        if self.lookup(p.dir, &name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        if p.trailing {
            return Err(Errno::ENOENT);
        }
        self.create(p.dir, &name, Body::Symlink(Arc::from(target)), 0o777, true)?;
        Ok(())
    }

    /// readlink(2): the target of the symlink `path` (EINVAL if it is not one).
    pub fn readlink(&self, start: Ino, path: &[u8]) -> Result<Vec<u8>, Errno> {
        let ino = self.walk(start, path, false, &mut 0)?;
        Ok(self.link_target(ino)?.to_vec())
    }

    /// readlink of an inode already resolved (e.g. an O_PATH|O_NOFOLLOW fd).
    pub fn readlink_ino(&self, ino: Ino) -> Result<Vec<u8>, Errno> {
        Ok(self.link_target(ino)?.to_vec())
    }

    /// linkat(2): a new name `new` for the non-directory `old` (followed if `follow`,
    /// i.e. AT_SYMLINK_FOLLOW). EPERM for directories.
    pub fn link(&mut self, old_start: Ino, old: &[u8], new_start: Ino, new: &[u8], follow: bool) -> Result<(), Errno> {
        let ino = self.walk(old_start, old, follow, &mut 0)?;
        let p = self.walk_parent(new_start, new, &mut 0)?;
        let Last::Name(name) = p.last else { return Err(Errno::EEXIST) };
        if self.lookup(p.dir, &name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        if p.trailing {
            return Err(Errno::ENOENT);
        }
        if self.is_dir(ino)? {
            return Err(Errno::EPERM);
        }
        // Neither an unlinked inode nor a removed directory can gain a name.
        if self.link_count(ino)? == 0 || self.link_count(p.dir)? == 0 {
            return Err(Errno::ENOENT);
        }
        let n = self.link_count(ino)?.saturating_add(1);
        // Every name costs quota: a guest cannot pin host memory with links.
        self.charge(super::entry_cost(&name))?;
        self.dir_entries_mut(p.dir)?.insert(name.clone(), ino);
        self.node_mut(ino)?.nlink = n;
        self.note(super::journal::ChangeKind::Create, p.dir, &name, Some(ino));
        self.touch(p.dir)
    }

    /// access / faccessat: uid 0 may read and write anything; X_OK needs an x bit on
    /// a non-directory.
    pub fn access(&self, start: Ino, path: &[u8], mode: i32, follow: bool) -> Result<(), Errno> {
        if mode & !(libc::R_OK | libc::W_OK | libc::X_OK) != 0 {
            return Err(Errno::EINVAL);
        }
        let ino = self.walk(start, path, follow, &mut 0)?;
        if mode & libc::X_OK != 0 && !self.is_dir(ino)? && self.perm(ino)? & 0o111 == 0 {
            return Err(Errno::EACCES);
        }
        Ok(())
    }

    /// Permission bits of an inode.
    pub fn perm(&self, ino: Ino) -> Result<u32, Errno> {
        Ok(match self.view(ino)? {
            View::Overlay(n) => n.perm,
            View::Image(_, m) => m.perm & 0o7777,
        })
    }
}
