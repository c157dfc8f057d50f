//! The agent's request/reply channel (`FileKind::Agent`): only the agent's
//! own process talks on it; a read with no request parks the vCPU (the
//! snapshot point).
//!
//! The exchange call (a positional read at offset [`AGENT_XCHG`]: the agent's
//! `os.preadv`, which releases the GIL while it waits, unlike an ioctl on a
//! buffer) hands over the agent's reply and waits for the next request in one
//! syscall, so a warm exec costs one VM exit instead of two (a write, then a
//! read). Its buffer is `struct { u32 reply_len; u8 data[]; }`: the reply is
//! `data[..reply_len]`; the request's next bytes come back in `data`, their
//! count the call's result. The call sets `reply_len` to 0 once the reply is
//! taken: a parked call is dispatched again when the next request comes (the
//! snapshot point is the call itself), and must not send the reply twice. Any
//! other offset is ESPIPE, as for a pipe.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::file::stdio::pipe_stat;
use crate::kernel::{Ctx, Effect};
use crate::procs::GUEST_PID;
use crate::vfs::Stat;

pub struct AgentFile;

/// The file offset that makes a positional read of the channel the exchange
/// call (`'F' 'B'` and 1).
pub const AGENT_XCHG: u64 = 0x4642_0001;

/// The exchange call: hand over the reply at `buf` (see the module doc), then read.
fn exchange(ctx: &mut Ctx, f: &Open, buf: u64, len: u64) -> SysResult {
    let head = ctx.bytes(buf, 4)?;
    let reply_len = u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]]));
    let (data, cap) = (buf + 4, len.checked_sub(4).ok_or(Errno::EINVAL)?);
    if reply_len > cap {
        return Err(Errno::EINVAL);
    }
    if reply_len > 0 {
        // Taken once: a dispatch again of this call (after a park) sends nothing.
        ctx.write_bytes(buf, &0u32.to_le_bytes())?;
        reply_from_guest(ctx, data, reply_len)?;
    }
    AgentFile.read(ctx, f, data, cap, None)
}

/// Reply bytes at `buf` in the agent's memory, checked against its user range.
fn reply_from_guest(ctx: &mut Ctx, buf: u64, len: u64) -> SysResult {
    ctx.user_range(buf, len)?;
    let data = ctx.mem.slice(buf, len).map_err(|_| Errno::EFAULT)?;
    // Capped before copying: the run loop ends the exec on overflow.
    if !ctx.kernel.agent_write(data) {
        return Err(Errno::EFBIG);
    }
    Ok(len)
}

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
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if ctx.proc.pid != GUEST_PID {
            return Err(Errno::EBADF);
        }
        match pos {
            None => {}
            Some(AGENT_XCHG) => return exchange(ctx, f, buf, len),
            Some(_) => return Err(Errno::ESPIPE),
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
        reply_from_guest(ctx, buf, len)
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
