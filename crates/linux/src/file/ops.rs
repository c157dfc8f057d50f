//! The operations every kind of open file answers (gVisor's
//! `FileDescriptionImpl`): the fd handlers in `crate::syscalls` look up the
//! implementation for a description (`crate::file::ops`) and call it instead
//! of matching on its kind.

use crate::errno::{Errno, SysResult};
use crate::fd::{FdTable, FileKind, OpenFile};
use crate::kernel::{Ctx, Kernel};
use crate::vfs::{Stat, Vfs};

/// An open description as a call sees it: the fd it came through, the
/// description's id (what a `Block` waits on) and a copy of its state.
#[derive(Clone, Copy, Debug)]
pub struct Open {
    pub fd: i32,
    pub ofd: u64,
    pub file: OpenFile,
}

/// What a readiness question may look at. `ready` answers for another
/// description (an epoll instance asks about the ones it watches) one level deeper.
pub struct PollCtx<'a> {
    pub fds: &'a FdTable,
    pub kernel: &'a Kernel,
    /// The file system (an inotify instance's events are its).
    pub vfs: &'a Vfs,
    /// The asking process (a job's stdin is per process).
    pub pid: u32,
    pub ready: fn(&PollCtx, u64, u32) -> u32,
}

/// One kind of open file. Guest buffers are checked by the caller (`buf` of
/// `len` bytes is mapped writable for `read`, readable for `write`, `len`
/// already capped at `MAX_RW`). `pos` is the offset of a positional call
/// (pread/pwrite), `None` for the file offset; kinds without an offset
/// refuse it with ESPIPE.
pub trait FileOps: Sync {
    /// read(2) into guest memory.
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult;

    /// write(2) from guest memory.
    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult;

    /// A write of host bytes (sendfile's source data).
    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult;

    /// Bytes a read would return now (ioctl FIONREAD).
    fn pending(&self, _ctx: &mut Ctx, _f: &Open) -> Result<u64, Errno> {
        Ok(0)
    }

    /// `POLL*` readiness (POLLHUP / POLLERR whatever was asked for, as on Linux).
    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32;

    /// fstat(2).
    fn stat(&self, ctx: &Ctx, f: &Open) -> Result<Stat, Errno>;

    /// ioctl(2) requests of the kind (the generic FIOCLEX, FIONBIO, FIONREAD
    /// are answered before): ENOTTY unless it is a terminal.
    fn ioctl(&self, _ctx: &mut Ctx, _f: &Open, _req: u64, _arg: u64) -> SysResult {
        Err(Errno::ENOTTY)
    }

    /// Give back what the description held once closed for good.
    fn release(&self, _ctx: &mut Ctx, _kind: FileKind) {}
}
