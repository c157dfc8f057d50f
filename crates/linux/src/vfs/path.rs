//! Path resolution, entirely inside the VFS: the root's ".." is the root and an
//! absolute symlink target restarts at the VFS root, so no path can leave the tree
//! (there is nothing outside it to reach anyway: no host paths exist here).

use std::borrow::Cow;

use super::{FileType, Ino, Vfs, MAX_SYMLINKS, NAME_MAX, PATH_MAX, ROOT_INO};
use crate::Errno;

/// The last component of a path, for operations that create or remove a name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Last {
    /// The path was only slashes.
    Root,
    Dot,
    DotDot,
    Name(Vec<u8>),
}

/// Directory + last component of a path (the last component not looked up).
pub(crate) struct Parent {
    pub dir: Ino,
    pub last: Last,
    /// The path ended in '/' (the last component must be a directory).
    pub trailing: bool,
}

/// Checks common to every path argument.
pub(crate) fn check_path(path: &[u8]) -> Result<(), Errno> {
    if path.is_empty() {
        return Err(Errno::ENOENT);
    }
    if path.len() >= PATH_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    // A C string cannot hold one; refuse rather than create an unnameable entry.
    if path.contains(&0) {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

fn only_slashes(b: &[u8]) -> bool {
    b.iter().all(|&c| c == b'/')
}

impl Vfs {
    /// Resolve `path` (see `Vfs::resolve`), counting symlinks followed in `links`
    /// (shared with the caller so that a multi-step operation like `open(O_CREAT)`
    /// through symlinks has one budget).
    pub(crate) fn walk(&self, start: Ino, path: &[u8], follow_last: bool, links: &mut u32) -> Result<Ino, Errno> {
        check_path(path)?;
        let mut cur = if path[0] == b'/' { ROOT_INO } else { start };
        // Stack of path texts still to walk: the path itself, then the target of
        // each symlink being expanded (at most MAX_SYMLINKS + 1 deep).
        let mut frames: Vec<(Cow<'_, [u8]>, usize)> = vec![(Cow::Borrowed(path), 0)];
        let mut comp: Vec<u8> = Vec::with_capacity(64);
        while let Some((buf, pos)) = frames.last_mut() {
            while *pos < buf.len() && buf[*pos] == b'/' {
                *pos += 1;
            }
            if *pos == buf.len() {
                frames.pop();
                continue;
            }
            let begin = *pos;
            let end = buf[begin..].iter().position(|&c| c == b'/').map_or(buf.len(), |i| begin + i);
            *pos = end;
            comp.clear();
            comp.extend_from_slice(&buf[begin..end]);

            // Last component of the whole expansion? Then a slash after it anywhere
            // (in this frame or in the frame of a symlink that led here) means it
            // must be a directory, and forces following a symlink.
            let is_last = frames.iter().all(|(b, p)| only_slashes(&b[*p..]));
            let trailing = is_last && frames.iter().any(|(b, p)| *p < b.len());

            if comp.len() > NAME_MAX {
                return Err(Errno::ENAMETOOLONG);
            }
            if !self.is_dir(cur)? {
                return Err(Errno::ENOTDIR);
            }
            match comp.as_slice() {
                b"." => {}
                b".." => {
                    if cur != ROOT_INO {
                        cur = self.parent_of(cur)?;
                    }
                }
                name => {
                    let next = self.lookup(cur, name)?.ok_or(Errno::ENOENT)?;
                    let kind = self.file_type(next)?;
                    if kind == FileType::Symlink && (!is_last || follow_last || trailing) {
                        *links += 1;
                        if *links > MAX_SYMLINKS {
                            return Err(Errno::ELOOP);
                        }
                        let target = self.link_target(next)?;
                        if target.is_empty() {
                            return Err(Errno::ENOENT);
                        }
                        if target[0] == b'/' {
                            cur = ROOT_INO;
                        }
                        // Relative targets continue from `cur`, the link's directory.
                        frames.push((Cow::Owned(target.to_vec()), 0));
                        continue;
                    }
                    if trailing && kind != FileType::Dir {
                        return Err(Errno::ENOTDIR);
                    }
                    cur = next;
                }
            }
        }
        Ok(cur)
    }

    /// Split `path` into its directory (resolved, following symlinks) and its last
    /// component (not looked up). Trailing slashes are stripped and reported.
    pub(crate) fn walk_parent(&self, start: Ino, path: &[u8], links: &mut u32) -> Result<Parent, Errno> {
        check_path(path)?;
        let Some(end) = path.iter().rposition(|&c| c != b'/').map(|i| i + 1) else {
            return Ok(Parent { dir: ROOT_INO, last: Last::Root, trailing: true });
        };
        let trailing = end < path.len();
        let head = &path[..end];
        let (dir, base) = match head.iter().rposition(|&c| c == b'/') {
            Some(i) => {
                let dpath = if i == 0 { &head[..1] } else { &head[..i] };
                (self.walk(start, dpath, true, links)?, &head[i + 1..])
            }
            None => (start, head),
        };
        if !self.is_dir(dir)? {
            return Err(Errno::ENOTDIR);
        }
        let last = match base {
            b"." => Last::Dot,
            b".." => Last::DotDot,
            n if n.len() > NAME_MAX => return Err(Errno::ENAMETOOLONG),
            n => Last::Name(n.to_vec()),
        };
        Ok(Parent { dir, last, trailing })
    }

    /// Is `anc` the directory `dir` or one of its ancestors?
    pub(crate) fn is_ancestor(&self, anc: Ino, dir: Ino) -> Result<bool, Errno> {
        let mut cur = dir;
        // A parent chain cannot be longer than the number of inodes; the bound only
        // guards against a corrupt chain.
        let bound = self.nodes.len() + self.image.inode_count() as usize + 1;
        for _ in 0..bound {
            if cur == anc {
                return Ok(true);
            }
            if cur == ROOT_INO {
                return Ok(false);
            }
            cur = self.parent_of(cur)?;
        }
        Err(Errno::ELOOP)
    }
}
