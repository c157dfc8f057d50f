//! Memory: brk, mmap, munmap, mprotect, mremap, madvise. Every change to the
//! memory map is followed by `sync` over the range it touched, so the page
//! tables (what the MMU lets the guest touch) always say what the map says.

use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::kernel::{Args, Ctx};
use crate::layout::{align_up, MMAP_TOP, PAGE_SIZE};
use crate::mm::{MemoryMap, VmaKind};

fn page_len(len: u64) -> Result<u64, Errno> {
    if len == 0 {
        return Err(Errno::EINVAL);
    }
    len.checked_add(PAGE_SIZE - 1).map(|l| l & !(PAGE_SIZE - 1)).ok_or(Errno::ENOMEM)
}

/// Bring the page tables in step with the memory map over `[start, end)`.
fn sync(ctx: &mut Ctx, start: u64, end: u64) -> Result<(), Errno> {
    ctx.proc.mm.sync_page_tables(ctx.mem, start, end).map_err(|_| Errno::ENOMEM)
}

/// Give pages back to the host; they read as zeros afterwards.
fn discard(ctx: &mut Ctx, ranges: &[(u64, u64)]) -> Result<(), Errno> {
    for &(a, l) in ranges {
        ctx.mem.discard(a, l).map_err(|_| Errno::ENOMEM)?;
    }
    Ok(())
}

/// Write the bytes of a MAP_SHARED file mapping back to its file (within the
/// file's current size, as the kernel does: a mapping never extends a file).
fn write_back(ctx: &mut Ctx, addr: u64, len: u64, kind: VmaKind) {
    let (ino, offset) = match kind {
        VmaKind::SharedFile { ino, offset } | VmaKind::Shm { ino: Some(ino), offset, .. } => (ino, offset),
        _ => return,
    };
    let Ok(size) = ctx.proc.vfs.stat(ino).map(|s| s.size) else { return };
    let n = size.saturating_sub(offset).min(len);
    if n == 0 {
        return;
    }
    if let Ok(bytes) = ctx.mem.slice(addr, n) {
        let _ = ctx.proc.vfs.write(ino, offset, bytes);
    }
}

/// Unmap: shared file parts are written back, then every page is given back
/// and leaves the page tables.
fn unmap_and_discard(ctx: &mut Ctx, addr: u64, len: u64) -> Result<(), Errno> {
    let removed = ctx.proc.mm.unmap(addr, len)?;
    for &(a, l, kind) in &removed {
        write_back(ctx, a, l, kind);
        ctx.mem.discard(a, l).map_err(|_| Errno::ENOMEM)?;
    }
    sync(ctx, addr, addr.saturating_add(len))
}

pub fn brk(ctx: &mut Ctx, a: &Args) -> SysResult {
    let old_top = align_up(ctx.proc.mm.brk, PAGE_SIZE);
    let (now, give_back) = ctx.proc.mm.set_brk(a[0]);
    if let Some(r) = give_back {
        discard(ctx, &[r])?;
    }
    let new_top = align_up(now, PAGE_SIZE);
    sync(ctx, old_top.min(new_top), old_top.max(new_top))?;
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
        if !f.readable() || map_type == libc::MAP_SHARED && prot & libc::PROT_WRITE as u32 != 0 && !f.writable() {
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
    if map_type == libc::MAP_SHARED {
        return map_shared(ctx, addr, len, prot, fixed, file, off);
    }
    let kind = match file {
        None => VmaKind::Anon,
        Some(_) => VmaKind::File,
    };
    let at = if fixed {
        MemoryMap::check_range(addr, len)?;
        unmap_and_discard(ctx, addr, len)?;
        ctx.proc.mm.map(Some(addr), len, prot, kind)?
    } else {
        ctx.proc.mm.map(None, len, prot, kind)?
    };
    sync(ctx, at, at + len)?;
    if let Some(ino) = file {
        // The file's bytes are copied in; for MAP_SHARED, msync and munmap write them back.
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

/// MAP_SHARED: memory shared with the other processes that map the same
/// object (`shm.rs`): the object of file `file` (made from its bytes if no
/// process maps it now), or a new anonymous one, mapped over the range.
fn map_shared(
    ctx: &mut Ctx,
    addr: u64,
    len: u64,
    prot: u32,
    fixed: bool,
    file: Option<crate::vfs::Ino>,
    off: u64,
) -> SysResult {
    if ctx.mem.shared_ranges().count() >= forkbox_vmm::memory::MAX_SHARED_RANGES {
        return Err(Errno::ENOMEM);
    }
    off.checked_add(len).filter(|s| *s <= crate::shm::MAX_OBJECT_BYTES).ok_or(Errno::ENOMEM)?;
    // The object first (it may be refused): nothing is unmapped yet.
    let (obj, host, ino) = match file {
        Some(ino) => {
            let bytes = ctx.proc.vfs.file_bytes(ino)?;
            let (obj, host) = ctx.kernel.shm.for_file(ino, off, len, bytes)?;
            (obj, host, Some(ino))
        }
        None => {
            let (obj, host) = ctx.kernel.shm.anonymous(len)?;
            (obj, host, None)
        }
    };
    let offset = if file.is_some() { off } else { 0 };
    let kind = VmaKind::Shm { obj, offset, ino };
    let at = if fixed {
        MemoryMap::check_range(addr, len)?;
        unmap_and_discard(ctx, addr, len)?;
        ctx.proc.mm.map(Some(addr), len, prot, kind)?
    } else {
        ctx.proc.mm.map(None, len, prot, kind)?
    };
    if ctx.mem.map_shared(at, len, &host, offset).is_err() {
        let _ = ctx.proc.mm.unmap(at, len);
        let _ = ctx.mem.discard(at, len);
        sync(ctx, at, at + len)?;
        return Err(Errno::ENOMEM);
    }
    sync(ctx, at, at + len)?;
    Ok(at)
}

/// The current process lets go of its shared mappings (its end, execve):
/// file ones are written back to their files.
pub fn release_shared(ctx: &mut Ctx) {
    let parts: Vec<(u64, u64, VmaKind)> = ctx
        .proc
        .mm
        .vmas()
        .filter(|(_, v)| matches!(v.kind, VmaKind::Shm { .. }))
        .map(|(s, v)| (s, v.end - s, v.kind))
        .collect();
    for (a, l, kind) in parts {
        write_back(ctx, a, l, kind);
    }
}

/// The end of an exec (the current process is the only one left): its shared
/// mappings become private memory with the same bytes (file ones: write-back
/// file mappings, as before processes shared memory), and the table forgets
/// every object. What a checkpoint then stores is private memory only.
pub fn privatize_shared(ctx: &mut Ctx) -> Result<(), Errno> {
    let changed = ctx.proc.mm.unshare_all();
    ctx.mem.privatize_shared().map_err(|_| Errno::ENOMEM)?;
    for (a, l, _) in changed {
        sync(ctx, a, a + l)?;
    }
    ctx.kernel.shm.clear();
    Ok(())
}

/// The end of an exec that leaves other processes running: the current
/// process' shared file mappings become its own write-back file mappings
/// again (as `privatize_shared` makes them; the objects stay for the others).
/// False, changing nothing, if it maps anonymous shared memory (that only
/// sharing can keep right).
pub fn privatize_own_files(ctx: &mut Ctx) -> Result<bool, Errno> {
    let anonymous = ctx.proc.mm.vmas().any(|(_, v)| matches!(v.kind, VmaKind::Shm { ino: None, .. }));
    if anonymous {
        return Ok(false);
    }
    release_shared(ctx);
    let changed = ctx.proc.mm.unshare_all();
    ctx.mem.privatize_shared().map_err(|_| Errno::ENOMEM)?;
    for (a, l, _) in changed {
        sync(ctx, a, a + l)?;
    }
    Ok(true)
}

/// Before a fork: the process' write-back file mappings (`SharedFile`: those
/// an earlier exec left, see `privatize_shared`) become shared objects again
/// (written back first, so the object starts with the bytes the process
/// sees), so that the child and the parent share them as they would on Linux.
pub fn reshare_files(ctx: &mut Ctx) -> Result<(), Errno> {
    let parts: Vec<(u64, u64, VmaKind)> = ctx
        .proc
        .mm
        .vmas()
        .filter(|(_, v)| matches!(v.kind, VmaKind::SharedFile { .. }))
        .map(|(s, v)| (s, v.end - s, v.kind))
        .collect();
    for (at, len, kind) in parts {
        let VmaKind::SharedFile { ino, offset } = kind else { continue };
        if ctx.mem.shared_ranges().count() >= forkbox_vmm::memory::MAX_SHARED_RANGES {
            return Err(Errno::ENOMEM);
        }
        write_back(ctx, at, len, kind);
        // The mapping's own bytes (the file may be gone, or shorter than the mapping).
        let mine = ctx.mem.slice(at, len).map_err(|_| Errno::EFAULT)?.to_vec();
        let (obj, host) = ctx.kernel.shm.for_file(ino, offset, len, &[])?;
        std::os::unix::fs::FileExt::write_all_at(&*host, &mine, offset).map_err(|_| Errno::ENOMEM)?;
        ctx.mem.map_shared(at, len, &host, offset).map_err(|_| Errno::ENOMEM)?;
        ctx.proc.mm.set_kind(at, VmaKind::Shm { obj, offset, ino: Some(ino) });
    }
    Ok(())
}

pub fn munmap(ctx: &mut Ctx, a: &Args) -> SysResult {
    let len = page_len(a[1])?;
    unmap_and_discard(ctx, a[0], len)?;
    Ok(0)
}

pub fn msync(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (addr, flags) = (a[0], a[2] as i32);
    if flags & !(libc::MS_ASYNC | libc::MS_SYNC | libc::MS_INVALIDATE) != 0
        || flags & (libc::MS_ASYNC | libc::MS_SYNC) == (libc::MS_ASYNC | libc::MS_SYNC)
    {
        return Err(Errno::EINVAL);
    }
    if a[1] == 0 {
        return Ok(0);
    }
    let len = page_len(a[1])?;
    MemoryMap::check_range(addr, len)?;
    let parts = ctx.proc.mm.overlapping(addr, len);
    if parts.iter().map(|p| p.1).sum::<u64>() != len {
        return Err(Errno::ENOMEM);
    }
    for (a, l, kind) in parts {
        write_back(ctx, a, l, kind);
    }
    Ok(0)
}

pub fn mprotect(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[1] == 0 {
        return if a[0].is_multiple_of(PAGE_SIZE) { Ok(0) } else { Err(Errno::EINVAL) };
    }
    let len = page_len(a[1])?;
    let prot = a[2] as u32;
    if prot & !((libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u32) != 0 {
        return Err(Errno::EINVAL);
    }
    ctx.proc.mm.protect(a[0], len, prot)?;
    sync(ctx, a[0], a[0] + len)?;
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
            unmap_and_discard(ctx, old_addr + new, old - new)?;
        }
        return Ok(old_addr);
    }
    // No mapping is larger than the address space: refuse (as Linux does
    // past TASK_SIZE) before any arithmetic on the guest's length.
    if new > MMAP_TOP {
        return Err(Errno::ENOMEM);
    }
    if matches!(vma.kind, VmaKind::SharedFile { .. } | VmaKind::Shm { .. }) {
        return Err(Errno::EINVAL);
    }
    // The old range must lie in one mapping (Linux: EFAULT otherwise).
    if old_addr + old > vma.end {
        return Err(Errno::EFAULT);
    }
    if ctx.proc.mm.grow_in_place(old_addr, old, new)? {
        sync(ctx, old_addr + old, old_addr + new)?;
        return Ok(old_addr);
    }
    if flags & libc::MREMAP_MAYMOVE == 0 {
        return Err(Errno::ENOMEM);
    }
    let to = ctx.proc.mm.map(None, new, vma.prot, vma.kind)?;
    sync(ctx, to, to + new)?;
    // Move chunk by chunk, giving each source chunk back as it is copied: the
    // host never holds both copies of more than one chunk.
    const CHUNK: u64 = 2 << 20;
    let mut done = 0;
    while done < old {
        let n = (old - done).min(CHUNK);
        ctx.mem.copy_within(old_addr + done, to + done, n).map_err(|_| Errno::EFAULT)?;
        ctx.mem.discard(old_addr + done, n).map_err(|_| Errno::ENOMEM)?;
        done += n;
    }
    unmap_and_discard(ctx, old_addr, old)?;
    Ok(to)
}

pub fn madvise(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (addr, advice) = (a[0], a[2] as i32);
    if a[1] == 0 {
        return Ok(0);
    }
    let len = page_len(a[1])?;
    MemoryMap::check_range(addr, len)?;
    if advice == libc::MADV_DONTNEED || advice == libc::MADV_FREE {
        // Shared memory keeps its content (Linux drops only this process' page
        // table entries of it); private memory is given back.
        let parts = ctx.proc.mm.overlapping(addr, len);
        let shared = |p: &(u64, u64, VmaKind)| matches!(p.2, VmaKind::Shm { .. });
        let give_back: Vec<(u64, u64)> = if parts.iter().any(shared) {
            parts.iter().filter(|p| !shared(p)).map(|p| (p.0, p.1)).collect()
        } else {
            vec![(addr, len)]
        };
        discard(ctx, &give_back)?;
    }
    Ok(0)
}

/// mlock / munlock: guest memory is never swapped, so there is nothing to
/// lock; the range must be mapped (ENOMEM), as on Linux.
pub fn mlock(ctx: &mut Ctx, a: &Args) -> SysResult {
    let start = a[0] & !(PAGE_SIZE - 1);
    let len = a[1].checked_add(a[0] - start).ok_or(Errno::ENOMEM)?;
    if len == 0 {
        return Ok(0);
    }
    let len = page_len(len)?;
    if ctx.proc.mm.accessible(start, len, false) < len {
        return Err(Errno::ENOMEM);
    }
    Ok(0)
}

/// mlock2: as mlock; MLOCK_ONFAULT is the only flag.
pub fn mlock2(ctx: &mut Ctx, a: &Args) -> SysResult {
    if a[2] & !(libc::MLOCK_ONFAULT as u64) != 0 {
        return Err(Errno::EINVAL);
    }
    mlock(ctx, a)
}

/// mlockall: MCL_CURRENT and/or MCL_FUTURE (MCL_ONFAULT only with one of
/// them), nothing to record.
pub fn mlockall(_: &mut Ctx, a: &Args) -> SysResult {
    let (cur, fut, onfault) = (libc::MCL_CURRENT as u64, libc::MCL_FUTURE as u64, libc::MCL_ONFAULT as u64);
    let f = a[0];
    if f & !(cur | fut | onfault) != 0 || f & (cur | fut) == 0 {
        return Err(Errno::EINVAL);
    }
    Ok(0)
}

pub fn munlockall(_: &mut Ctx, _: &Args) -> SysResult {
    Ok(0)
}
