//! The agent's request/reply channel (`FileKind::Agent`): only the agent's
//! own process talks on it; a read with no request parks the vCPU (the
//! snapshot point).

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::file::stdio::pipe_stat;
use crate::kernel::{Ctx, Effect};
use crate::procs::GUEST_PID;
use crate::vfs::Stat;

pub struct AgentFile;

fn write_reply(ctx: &mut Ctx, data: &[u8]) -> SysResult {
    if ctx.proc.pid != GUEST_PID {
        return Err(Errno::EBADF);
    }
    // Capped before copying: the run loop ends the exec on overflow.
    if !ctx.kernel.agent_write(data) {
        return Err(Errno::EFBIG);
    }
    Ok(data.len() as u64)
}

impl FileOps for AgentFile {
    fn read(&self, ctx: &mut Ctx, _: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if ctx.proc.pid != GUEST_PID {
            return Err(Errno::EBADF);
        }
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let pending = ctx.kernel.agent_pending() as u64;
        if pending == 0 {
            // The agent waits for work: the vCPU parks here (the snapshot point).
            ctx.effect = Some(Effect::Park);
            return Ok(0);
        }
        let n = pending.min(len);
        let start = ctx.kernel.agent_in_pos;
        let chunk = ctx.kernel.agent_in[start..start + n as usize].to_vec();
        ctx.write_bytes(buf, &chunk)?;
        ctx.kernel.agent_in_pos += n as usize;
        Ok(n)
    }

    fn write(&self, ctx: &mut Ctx, _: &Open, buf: u64, len: u64, _pos: Option<u64>) -> SysResult {
        if ctx.proc.pid != GUEST_PID {
            return Err(Errno::EBADF);
        }
        let data = ctx.mem.slice(buf, len).map_err(|_| Errno::EFAULT)?;
        if !ctx.kernel.agent_write(data) {
            return Err(Errno::EFBIG);
        }
        Ok(len)
    }

    fn write_bytes(&self, ctx: &mut Ctx, _: &Open, data: &[u8], _pos: Option<u64>) -> SysResult {
        write_reply(ctx, data)
    }

    fn pending(&self, ctx: &mut Ctx, _: &Open) -> Result<u64, Errno> {
        Ok(ctx.kernel.agent_pending() as u64)
    }

    fn poll(&self, p: &PollCtx, _: &OpenFile, _: u32) -> u32 {
        let (r, w) = ((libc::POLLIN | libc::POLLRDNORM) as u32, (libc::POLLOUT | libc::POLLWRNORM) as u32);
        if p.kernel.agent_pending() > 0 {
            r | w
        } else {
            w
        }
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        Ok(pipe_stat(f))
    }
}
