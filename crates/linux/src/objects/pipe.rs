//! Pipes and FIFOs: a bounded byte buffer with its readers and writers
//! counted apart (EOF once no writer is left, EPIPE once no reader is), and
//! the capacity F_SETPIPE_SZ sets.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::errno::Errno;
use crate::vfs::Ino;

use super::{ObjKind, Objects};

/// A new pipe's capacity (Linux default: 16 pages).
pub const PIPE_CAPACITY: usize = 65536;

/// The largest capacity F_SETPIPE_SZ gives (Linux's /proc/sys/fs/pipe-max-size;
/// the sandbox's root has no CAP_SYS_RESOURCE to go beyond it).
pub const PIPE_MAX_SIZE: usize = 1 << 20;

/// Capacity beyond the default that all pipes of a sandbox may have together
/// (host memory the memory limit does not count; Linux's pipe-user-pages-soft
/// plays this part, at 64 MiB): F_SETPIPE_SZ past it is EPERM, as there.
pub const PIPE_EXTRA_TOTAL: usize = 16 << 20;

/// A capacity a pipe may have: a power of two from one page to `PIPE_MAX_SIZE`.
pub(super) fn valid_pipe_size(size: usize) -> bool {
    size.is_power_of_two() && (crate::layout::PAGE_SIZE as usize..=PIPE_MAX_SIZE).contains(&size)
}

/// Writes up to this size are atomic (all or EAGAIN).
pub const PIPE_BUF: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipe {
    pub buf: Arc<VecDeque<u8>>,
    pub readers: u32,
    pub writers: u32,
    /// The FIFO inode this pipe serves, if it is one.
    pub fifo: Option<Ino>,
    /// Bytes it holds at most (F_GETPIPE_SZ/F_SETPIPE_SZ): a power of two
    /// from one page to `PIPE_MAX_SIZE`.
    pub capacity: u32,
}

impl Pipe {
    /// Bytes a write may add now.
    pub fn room(&self) -> usize {
        (self.capacity as usize).saturating_sub(self.buf.len())
    }
}

/// A pipe as state format 6 and older have it (no capacity: the default).
/// Frozen: never edit.
#[derive(Deserialize)]
pub struct PipeV6 {
    pub(super) buf: Arc<VecDeque<u8>>,
    pub(super) readers: u32,
    pub(super) writers: u32,
    pub(super) fifo: Option<Ino>,
}

impl Objects {
    pub fn new_pipe(&mut self, fifo: Option<Ino>) -> u64 {
        let capacity = PIPE_CAPACITY as u32;
        self.add(ObjKind::Pipe(Pipe { buf: Arc::new(VecDeque::new()), readers: 0, writers: 0, fifo, capacity }))
    }

    fn pipe_mut(&mut self, id: u64) -> Result<&mut Pipe, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::Pipe(p) => Ok(p),
            _ => Err(Errno::EBADF),
        }
    }

    /// Up to `len` bytes; empty at EOF (no writers left); EAGAIN if it would block.
    pub fn pipe_read(&mut self, id: u64, len: usize) -> Result<Vec<u8>, Errno> {
        let p = self.pipe_mut(id)?;
        if p.buf.is_empty() {
            return if p.writers == 0 || len == 0 { Ok(Vec::new()) } else { Err(Errno::EAGAIN) };
        }
        let buf = Arc::make_mut(&mut p.buf);
        let n = len.min(buf.len());
        Ok(buf.drain(..n).collect())
    }

    /// F_GETPIPE_SZ.
    pub fn pipe_size(&self, id: u64) -> Result<u32, Errno> {
        match &self.get(id)?.kind {
            ObjKind::Pipe(p) => Ok(p.capacity),
            _ => Err(Errno::EBADF),
        }
    }

    /// F_SETPIPE_SZ: the capacity becomes `size` rounded up to a power of two
    /// pages (at least one page); EPERM beyond `PIPE_MAX_SIZE` or past the
    /// sandbox's `PIPE_EXTRA_TOTAL`, EBUSY if it holds more than that. Returns it.
    pub fn set_pipe_size(&mut self, id: u64, size: u64) -> Result<u32, Errno> {
        let size = usize::try_from(size).map_err(|_| Errno::EINVAL)?;
        if size > 1 << 31 {
            return Err(Errno::EINVAL);
        }
        let size = size.max(crate::layout::PAGE_SIZE as usize).next_power_of_two();
        if size > PIPE_MAX_SIZE {
            return Err(Errno::EPERM);
        }
        let extra = |p: &Pipe| (p.capacity as usize).saturating_sub(PIPE_CAPACITY);
        let others: usize = self
            .map
            .iter()
            .filter(|(other, _)| **other != id)
            .map(|(_, o)| if let ObjKind::Pipe(p) = &o.kind { extra(p) } else { 0 })
            .sum();
        let p = self.pipe_mut(id)?;
        if size > p.capacity as usize && others.saturating_add(size.saturating_sub(PIPE_CAPACITY)) > PIPE_EXTRA_TOTAL {
            return Err(Errno::EPERM);
        }
        if p.buf.len() > size {
            return Err(Errno::EBUSY);
        }
        p.capacity = size as u32;
        Ok(p.capacity)
    }

    /// Bytes written (maybe fewer than given); EPIPE with no reader; EAGAIN if
    /// nothing fits (or an atomic write does not fit whole).
    pub fn pipe_write(&mut self, id: u64, data: &[u8]) -> Result<usize, Errno> {
        let p = self.pipe_mut(id)?;
        if p.readers == 0 {
            return Err(Errno::EPIPE);
        }
        let room = p.room();
        if data.is_empty() {
            return Ok(0);
        }
        if room == 0 || (data.len() <= PIPE_BUF && room < data.len()) {
            return Err(Errno::EAGAIN);
        }
        let n = room.min(data.len());
        Arc::make_mut(&mut p.buf).extend(&data[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::EventFd;
    #[test]
    fn pipe_size_bounds_writes_and_is_bounded() {
        let mut o = Objects::default();
        let p = o.new_pipe(None);
        o.attach(p, libc::O_RDONLY);
        o.attach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_size(p), Ok(PIPE_CAPACITY as u32));
        assert_eq!(o.set_pipe_size(p, 1), Ok(4096), "at least a page");
        assert_eq!(o.pipe_write(p, &[1; 5000]), Ok(4096));
        assert_eq!(o.pipe_write(p, &[1; 10]), Err(Errno::EAGAIN));
        assert_eq!(o.set_pipe_size(p, 0), Ok(4096), "0 is one page too");
        assert_eq!(o.set_pipe_size(p, 5000), Ok(8192), "a power of two");
        assert_eq!(o.pipe_write(p, &[1; 5000]), Ok(4096));
        assert_eq!(o.set_pipe_size(p, 4096), Err(Errno::EBUSY), "holds more than that");
        assert_eq!(o.set_pipe_size(p, PIPE_MAX_SIZE as u64 + 1), Err(Errno::EPERM));
        assert_eq!(o.set_pipe_size(p, 1 << 31), Err(Errno::EPERM));
        assert_eq!(o.set_pipe_size(p, (1 << 31) + 1), Err(Errno::EINVAL));
        assert_eq!(o.pipe_size(p), Ok(8192), "refused changes change nothing");
        // The sandbox-wide budget of extra capacity.
        let extra = PIPE_MAX_SIZE - PIPE_CAPACITY;
        let mut fit = 0;
        for _ in 0..PIPE_EXTRA_TOTAL / extra + 2 {
            let q = o.new_pipe(None);
            if o.set_pipe_size(q, PIPE_MAX_SIZE as u64).is_ok() {
                fit += 1;
            }
        }
        assert_eq!(fit, PIPE_EXTRA_TOTAL / extra);
        assert_eq!(o.set_pipe_size(p, 16384), Ok(16384), "up to the default size costs nothing of the budget");
        o.validate().unwrap();
    }

    /// State formats 4 to 6 wrote a pipe as variant 0 with no capacity: it
    /// reads with the default one; what is written now reads back as it was.
    #[test]
    fn pipes_of_older_state_files_read_with_the_default_capacity() {
        #[derive(Serialize)]
        enum OldKind {
            Pipe(OldPipe),
        }
        #[derive(Serialize)]
        struct OldPipe {
            buf: Arc<VecDeque<u8>>,
            readers: u32,
            writers: u32,
            fifo: Option<Ino>,
        }
        let old = OldKind::Pipe(OldPipe {
            buf: Arc::new(b"abc".iter().copied().collect()),
            readers: 1,
            writers: 2,
            fifo: Some(9),
        });
        let bytes = postcard::to_stdvec(&old).unwrap();
        let ObjKind::Pipe(p) = postcard::from_bytes::<ObjKind>(&bytes).unwrap() else { panic!("not a pipe") };
        assert_eq!((p.buf.len(), p.readers, p.writers, p.fifo, p.capacity), (3, 1, 2, Some(9), PIPE_CAPACITY as u32));
        let sized = ObjKind::Pipe(Pipe { capacity: 8192, ..p });
        let bytes = postcard::to_stdvec(&sized).unwrap();
        assert_eq!(bytes[0], 5, "written as the SizedPipe variant");
        assert_eq!(postcard::from_bytes::<ObjKind>(&bytes).unwrap(), sized);
        let json = serde_json::to_string(&sized).unwrap();
        assert_eq!(serde_json::from_str::<ObjKind>(&json).unwrap(), sized);
        let e = ObjKind::EventFd(EventFd { count: 3, semaphore: false });
        assert_eq!(postcard::from_bytes::<ObjKind>(&postcard::to_stdvec(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn pipe_capacity_eof_and_epipe() {
        let mut o = Objects::default();
        let p = o.new_pipe(None);
        o.attach(p, libc::O_RDONLY);
        o.attach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_read(p, 10), Err(Errno::EAGAIN));
        let big = vec![7u8; PIPE_CAPACITY + 10];
        assert_eq!(o.pipe_write(p, &big), Ok(PIPE_CAPACITY));
        assert_eq!(o.pipe_write(p, b"x"), Err(Errno::EAGAIN));
        assert_eq!(o.pipe_read(p, 100).unwrap().len(), 100);
        // 100 bytes free: a small write that does not fit whole is refused (atomic).
        assert_eq!(o.pipe_write(p, &[1u8; 200]), Err(Errno::EAGAIN));
        assert_eq!(o.pipe_write(p, &[1u8; 50]), Ok(50));
        let snapshot = o.clone();
        o.detach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_read(p, PIPE_CAPACITY - 100).unwrap(), vec![7u8; PIPE_CAPACITY - 100]);
        assert_eq!(o.pipe_read(p, 10).unwrap(), vec![1u8; 10]);
        assert_eq!(o.pipe_read(p, 100).unwrap().len(), 40);
        assert_eq!(o.pipe_read(p, 100), Ok(vec![]), "EOF once the writer is gone");
        // The clone taken before is untouched.
        assert_eq!(snapshot.readable_bytes(p), (PIPE_CAPACITY - 50) as u64);
        let mut o2 = snapshot;
        o2.detach(p, libc::O_RDONLY);
        assert_eq!(o2.pipe_write(p, b"x"), Err(Errno::EPIPE));
        o2.detach(p, libc::O_WRONLY);
        assert!(o2.map.is_empty());
    }
}
