//! Memory: brk, mmap, munmap, mprotect, mremap, madvise.

use super::{Args, Ctx};
use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::layout::{align_up, PAGE_SIZE};
use crate::mm::{MemoryMap, VmaKind};

fn page_len(len: u64) -> Result<u64, Errno> {
    if len == 0 {
        return Err(Errno::EINVAL);
    }
    len.checked_add(PAGE_SIZE - 1).map(|l| l & !(PAGE_SIZE - 1)).ok_or(Errno::ENOMEM)
}

/// Give pages back to the host; they read as zeros afterwards.
fn discard(ctx: &mut Ctx, ranges: &[(u64, u64)]) -> Result<(), Errno> {
    for &(a, l) in ranges {
        ctx.mem.discard(a, l).map_err(|_| Errno::ENOMEM)?;
    }
    Ok(())
}

pub fn brk(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (now, give_back) = ctx.proc.mm.set_brk(a[0]);
    if let Some(r) = give_back {
        discard(ctx, &[r])?;
    }
    Ok(now)
}

pub fn mmap(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (addr, prot, flags, fd, off) = (a[0], a[2] as u32, a[3] as i32, a[4] as i32, a[5]);
    let len = page_len(a[1])?;
    if off % PAGE_SIZE != 0 {
        return Err(Errno::EINVAL);
    }
    let map_type = flags & 0xF;
    if map_type != libc::MAP_PRIVATE && map_type != libc::MAP_SHARED {
        return Err(Errno::EINVAL);
    }
    let anonymous = flags & libc::MAP_ANONYMOUS != 0;
    let file = if anonymous {
        None
    } else {
        let f = ctx.proc.fds.get(fd)?;
        if !f.readable() {
            return Err(Errno::EACCES);
        }
        match f.kind {
            FileKind::Node(ino) => Some(ino),
            _ => return Err(Errno::ENODEV),
        }
    };
    let fixed = flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0;
    if flags & libc::MAP_FIXED_NOREPLACE != 0 {
        MemoryMap::check_range(addr, len)?;
        if !ctx.proc.mm.range_is_free(addr, len) {
            return Err(Errno::EEXIST);
        }
    }
    let kind = if anonymous { VmaKind::Anon } else { VmaKind::File };
    let at = if fixed {
        let removed = ctx.proc.mm.unmap(addr, len)?;
        discard(ctx, &removed)?;
        ctx.proc.mm.map(Some(addr), len, prot, kind)?
    } else {
        ctx.proc.mm.map(None, len, prot, kind)?
    };
    if let Some(ino) = file {
        // A private copy of the file's bytes; MAP_SHARED writes do not reach the file.
        let copied = {
            let bytes = ctx.proc.vfs.file_bytes(ino)?;
            let start = (off as usize).min(bytes.len());
            let n = (bytes.len() - start).min(len as usize);
            ctx.mem.write(at, &bytes[start..start + n]).map(|_| n)
        };
        match copied {
            Ok(n) if (n as u64) < len => discard(ctx, &[(at + n as u64, len - n as u64)])?,
            Ok(_) => {}
            Err(_) => return Err(Errno::ENOMEM),
        }
    } else if fixed {
        // Fresh anonymous memory reads as zeros (it may have held older data).
        discard(ctx, &[(at, len)])?;
    }
    Ok(at)
}

pub fn munmap(ctx: &mut Ctx, a: &Args) -> SysResult {
    let len = page_len(a[1])?;
    let removed = ctx.proc.mm.unmap(a[0], len)?;
    discard(ctx, &removed)?;
    Ok(0)
}

pub fn mprotect(ctx: &mut Ctx, a: &Args) -> SysResult {
    let len = page_len(a[1])?;
    ctx.proc.mm.protect(a[0], len, a[2] as u32)?;
    Ok(0)
}

pub fn mremap(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (old_addr, flags) = (a[0], a[3] as i32);
    let old = page_len(a[1])?;
    let new = page_len(a[2])?;
    if flags & !(libc::MREMAP_MAYMOVE) != 0 {
        return Err(Errno::EINVAL);
    }
    MemoryMap::check_range(old_addr, old)?;
    let vma = ctx.proc.mm.mapping_at(old_addr).ok_or(Errno::EFAULT)?;
    if new <= old {
        if new < old {
            let removed = ctx.proc.mm.unmap(old_addr + new, old - new)?;
            discard(ctx, &removed)?;
        }
        return Ok(old_addr);
    }
    if ctx.proc.mm.grow_in_place(old_addr, old, new)? {
        return Ok(old_addr);
    }
    if flags & libc::MREMAP_MAYMOVE == 0 {
        return Err(Errno::ENOMEM);
    }
    let to = ctx.proc.mm.map(None, new, vma.prot, vma.kind)?;
    let data = ctx.mem.slice(old_addr, old).map_err(|_| Errno::EFAULT)?.to_vec();
    ctx.mem.write(to, &data).map_err(|_| Errno::EFAULT)?;
    let removed = ctx.proc.mm.unmap(old_addr, old)?;
    discard(ctx, &removed)?;
    Ok(to)
}

pub fn madvise(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (addr, advice) = (a[0], a[2] as i32);
    if a[1] == 0 {
        return Ok(0);
    }
    let len = align_up(a[1], PAGE_SIZE);
    MemoryMap::check_range(addr, len)?;
    if advice == libc::MADV_DONTNEED || advice == libc::MADV_FREE {
        discard(ctx, &[(addr, len)])?;
    }
    Ok(0)
}
