//! File contents: read, write, truncate, and the character devices.

use std::sync::Arc;

use super::node::{Body, DevKind, FileData, Node};
use super::{now_ns, Ino, Vfs, View, MAX_FILE_SIZE};
use crate::Errno;

impl Vfs {
    /// All bytes of a regular file, contiguous (the image's mapped bytes or the
    /// overlay's): for mmap of files and fast reads. EISDIR on a directory, EINVAL on
    /// anything else.
    pub fn file_bytes(&self, ino: Ino) -> Result<&[u8], Errno> {
        match self.view(ino)? {
            View::Overlay(n) => match &n.body {
                Body::File(FileData::Owned(v)) => Ok(v.as_slice()),
                Body::File(FileData::Image(i)) => self.image.content(*i).ok_or(Errno::EIO),
                Body::File(FileData::Layer(l, i)) => l.content(*i).ok_or(Errno::EIO),
                Body::Dir { .. } => Err(Errno::EISDIR),
                _ => Err(Errno::EINVAL),
            },
            View::Image(i, m) => match m.kind {
                forkbox_image::NodeKind::File => self.image.content(i).ok_or(Errno::EIO),
                forkbox_image::NodeKind::Dir => Err(Errno::EISDIR),
                forkbox_image::NodeKind::Symlink => Err(Errno::EINVAL),
            },
        }
    }

    /// The device `ino` is, if a character device (/dev/ptmx and /dev/tty
    /// open a terminal instead of the node: see the open call).
    pub fn device(&self, ino: Ino) -> Result<Option<DevKind>, Errno> {
        Ok(match self.view(ino)? {
            View::Overlay(Node { body: Body::CharDev(d), .. }) => Some(*d),
            _ => None,
        })
    }

    /// pread: bytes of `ino` from `offset` into `buf`. 0 at or past the end.
    pub fn read(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> Result<usize, Errno> {
        if let Some(dev) = self.device(ino)? {
            return match dev {
                DevKind::Null => Ok(0),
                DevKind::Zero | DevKind::Full => {
                    buf.fill(0);
                    Ok(buf.len())
                }
                DevKind::Urandom => {
                    crate::random::fill_random(buf)?;
                    Ok(buf.len())
                }
                DevKind::Tty | DevKind::Ptmx => Err(Errno::ENXIO),
            };
        }
        let bytes = self.file_bytes(ino)?;
        let Ok(off) = usize::try_from(offset) else { return Ok(0) };
        if off >= bytes.len() {
            return Ok(0);
        }
        let n = buf.len().min(bytes.len() - off);
        buf[..n].copy_from_slice(&bytes[off..off + n]);
        Ok(n)
    }

    /// pwrite: `data` at `offset` (writing past the end zero-fills the gap). Updates
    /// mtime. ENOSPC if the file's overlay bytes would exceed the quota, EFBIG past
    /// MAX_FILE_SIZE. All or nothing.
    pub fn write(&mut self, ino: Ino, offset: u64, data: &[u8]) -> Result<usize, Errno> {
        if let Some(dev) = self.device(ino)? {
            return match dev {
                DevKind::Full => Err(Errno::ENOSPC),
                DevKind::Null | DevKind::Zero | DevKind::Urandom => Ok(data.len()),
                DevKind::Tty | DevKind::Ptmx => Err(Errno::ENXIO),
            };
        }
        let cur_len = self.file_bytes(ino)?.len() as u64;
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= MAX_FILE_SIZE).ok_or(Errno::EFBIG)?;
        let new_len = cur_len.max(end);
        self.reserve(ino, new_len)?;
        let (off, end) = (to_usize(offset)?, to_usize(end)?);
        let v = self.file_vec_mut(ino, usize::MAX)?;
        if v.len() < end {
            grow(v, end)?;
        }
        v[off..end].copy_from_slice(data);
        let grown = (v.len() as u64).saturating_sub(cur_len);
        self.used = self.used.saturating_add(grown);
        self.node_mut(ino)?.mtime_ns = now_ns();
        self.note_ino(super::ChangeKind::Write, ino);
        Ok(data.len())
    }

    /// ftruncate / truncate: set the size of a regular file (zero-filling when it
    /// grows). EISDIR on a directory, EINVAL on other non-files.
    pub fn truncate(&mut self, ino: Ino, len: u64) -> Result<(), Errno> {
        if self.device(ino)?.is_some() {
            return Err(Errno::EINVAL);
        }
        self.file_bytes(ino)?; // EISDIR / EINVAL on non-files
        if len > MAX_FILE_SIZE {
            return Err(Errno::EFBIG);
        }
        self.reserve(ino, len)?;
        let n = to_usize(len)?;
        // Only the bytes that survive are copied up / unshared.
        let v = self.file_vec_mut(ino, n)?;
        let before = v.len() as u64;
        if v.len() < n {
            grow(v, n)?;
        } else {
            v.truncate(n);
        }
        self.used = self.used.saturating_add(len).saturating_sub(before);
        self.node_mut(ino)?.mtime_ns = now_ns();
        self.note_ino(super::ChangeKind::Write, ino);
        Ok(())
    }

    /// Quota check before `ino`'s overlay bytes become `new_len`.
    fn reserve(&self, ino: Ino, new_len: u64) -> Result<(), Errno> {
        let owned = match self.view(ino)? {
            View::Overlay(Node { body: Body::File(FileData::Owned(v)), .. }) => v.len() as u64,
            _ => 0,
        };
        if new_len > owned && self.used.saturating_add(new_len - owned) > self.quota {
            return Err(Errno::ENOSPC);
        }
        Ok(())
    }

    /// The file's own, unshared bytes, ready to modify. When they are the image's or
    /// shared with a clone of this `Vfs`, the first `keep` bytes are copied first (the
    /// copy is charged to `used`; the caller charges what it adds after that).
    fn file_vec_mut(&mut self, ino: Ino, keep: usize) -> Result<&mut Vec<u8>, Errno> {
        self.ensure_overlay(ino)?;
        let node = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        let data = match &mut node.body {
            Body::File(data) => data,
            Body::Dir { .. } => return Err(Errno::EISDIR),
            _ => return Err(Errno::EINVAL),
        };
        match data {
            FileData::Image(i) => {
                let src = self.image.content(*i).ok_or(Errno::EIO)?;
                let n = keep.min(src.len());
                let copy = try_copy(&src[..n])?;
                self.used = self.used.saturating_add(n as u64);
                *data = FileData::Owned(Arc::new(copy));
            }
            FileData::Layer(l, i) => {
                let src = l.content(*i).ok_or(Errno::EIO)?;
                let n = keep.min(src.len());
                let copy = try_copy(&src[..n])?;
                self.used = self.used.saturating_add(n as u64);
                *data = FileData::Owned(Arc::new(copy));
            }
            FileData::Owned(arc) => {
                if Arc::get_mut(arc).is_none() {
                    let n = keep.min(arc.len());
                    let copy = try_copy(&arc[..n])?;
                    self.used = self.used.saturating_sub((arc.len() - n) as u64);
                    *arc = Arc::new(copy);
                }
            }
        }
        match data {
            FileData::Owned(arc) => Arc::get_mut(arc).ok_or(Errno::EIO),
            FileData::Image(_) | FileData::Layer(..) => Err(Errno::EIO),
        }
    }
}

fn to_usize(x: u64) -> Result<usize, Errno> {
    usize::try_from(x).map_err(|_| Errno::EFBIG)
}

fn try_copy(src: &[u8]) -> Result<Vec<u8>, Errno> {
    let mut v = Vec::new();
    v.try_reserve_exact(src.len()).map_err(|_| Errno::ENOSPC)?;
    v.extend_from_slice(src);
    Ok(v)
}

/// Zero-extend `v` to `n` bytes, failing (not aborting) if memory runs out.
fn grow(v: &mut Vec<u8>, n: usize) -> Result<(), Errno> {
    v.try_reserve(n - v.len()).map_err(|_| Errno::ENOSPC)?;
    v.resize(n, 0);
    Ok(())
}
