//! fd 0, 1 and 2 as the agent has them: stdin at end of file (or a
//! background job's stdin the host feeds), stdout and stderr captured.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::{Block, WaitOn, READABLE};
use crate::kernel::state::Stream;
use crate::kernel::Ctx;
use crate::vfs::Stat;

const R: u32 = (libc::POLLIN | libc::POLLRDNORM) as u32;
const W: u32 = (libc::POLLOUT | libc::POLLWRNORM) as u32;

/// Stdio and the agent channel look like pipes to fstat.
pub(crate) fn pipe_stat(f: &Open) -> Stat {
    Stat::pipe(1_000_000 + f.fd as u64)
}

pub struct StdinFile;

impl FileOps for StdinFile {
    /// End of file, except in a background job with a stdin the host feeds
    /// (then it reads like a pipe's read end).
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, _pos: Option<u64>) -> SysResult {
        let pid = ctx.proc.pid;
        let Some(stdin) = ctx.kernel.stdin_of(pid) else { return Ok(0) };
        if stdin.buf.is_empty() {
            if stdin.closed || len == 0 {
                return Ok(0);
            }
            if f.file.flags & libc::O_NONBLOCK != 0 {
                return Err(Errno::EAGAIN);
            }
            return ctx.block(Block::new(WaitOn::Fd { ofd: f.ofd, events: READABLE }));
        }
        let n = stdin.buf.len().min(usize::try_from(len).unwrap_or(usize::MAX));
        let chunk: Vec<u8> = stdin.buf.iter().take(n).copied().collect();
        ctx.write_bytes(buf, &chunk)?;
        // Consumed only once the guest has the bytes (a fault leaves them for the next read).
        if let Some(stdin) = ctx.kernel.stdin_of(pid) {
            stdin.buf.drain(..n);
        }
        Ok(n as u64)
    }

    fn write(&self, _: &mut Ctx, _: &Open, _: u64, _: u64, _: Option<u64>) -> SysResult {
        Err(Errno::EBADF)
    }

    fn write_bytes(&self, _: &mut Ctx, _: &Open, _: &[u8], _: Option<u64>) -> SysResult {
        Err(Errno::EBADF)
    }

    fn poll(&self, p: &PollCtx, _: &OpenFile, _: u32) -> u32 {
        // A job's stdin fed by the host (end of file, as anyone else's, is readable).
        if p.kernel.stdin_ready(p.pid) {
            R
        } else {
            0
        }
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        Ok(pipe_stat(f))
    }
}

/// fd 1 or fd 2: the call's capture, or a background job's ring.
pub struct OutputFile(pub Stream);

impl FileOps for OutputFile {
    fn read(&self, _: &mut Ctx, _: &Open, _: u64, _: u64, _: Option<u64>) -> SysResult {
        Err(Errno::EBADF)
    }

    fn write(&self, ctx: &mut Ctx, _: &Open, buf: u64, len: u64, _pos: Option<u64>) -> SysResult {
        let data = ctx.mem.slice(buf, len).map_err(|_| Errno::EFAULT)?;
        ctx.kernel.output_from(ctx.proc.pid, self.0, data);
        Ok(len)
    }

    fn write_bytes(&self, ctx: &mut Ctx, _: &Open, data: &[u8], _pos: Option<u64>) -> SysResult {
        ctx.kernel.output_from(ctx.proc.pid, self.0, data);
        Ok(data.len() as u64)
    }

    fn poll(&self, _: &PollCtx, _: &OpenFile, _: u32) -> u32 {
        W
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        Ok(pipe_stat(f))
    }
}
