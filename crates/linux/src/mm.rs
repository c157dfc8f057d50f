//! The guest's memory map: which address ranges are mapped, how, and how
//! much memory that commits (the guest's memory limit is enforced here).
//!
//! The page tables follow this map (`sync_page_tables` after every change):
//! a page is present for the guest only inside a mapping or the brk heap,
//! with the mapping's protections, so the MMU enforces what the map says and
//! the host never backs a page the guest did not map. Syscall buffers are
//! checked against it too (`accessible`). All size arithmetic is checked:
//! lengths come from the guest.
//!
//! `VmaKind::Shm` mappings are memory shared with the sandbox's other
//! processes (`shm.rs`): the same host pages (a memfd per object) under the
//! mapping's range in every process that maps the object. They count as
//! committed memory here like any mapping, and never reach a saved state
//! (the end of an exec turns them back into `Anon`/`SharedFile`:
//! `unshare_all`; `validate` refuses them).

use forkbox_vmm::arch::paging::{self, REGIONS, REGION_PAGES};
use forkbox_vmm::GuestMemory;
use imbl::OrdMap;

use crate::errno::Errno;
use crate::layout::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmaKind {
    Anon,
    /// A private copy of file content (the bytes were copied in at mmap time).
    File,
    /// MAP_SHARED of a file: the bytes were copied in at mmap time and are
    /// written back to the file on msync and munmap. `offset` is the file
    /// offset of the mapping's first byte.
    SharedFile {
        ino: u64,
        offset: u64,
    },
    Stack,
    /// MAP_SHARED memory shared between the sandbox's processes (`shm.rs`):
    /// shared object `obj` from byte `offset`; `ino`: the file it maps (its
    /// bytes are written back there), None for MAP_SHARED|MAP_ANONYMOUS.
    /// Host-side only: never in a saved state (`shm.rs`, `validate`).
    Shm {
        obj: u32,
        offset: u64,
        ino: Option<u64>,
    },
}

impl Vma {
    /// This mapping's kind for the part that starts `skip` bytes into it.
    fn kind_from(&self, skip: u64) -> VmaKind {
        match self.kind {
            VmaKind::SharedFile { ino, offset } => VmaKind::SharedFile { ino, offset: offset + skip },
            VmaKind::Shm { obj, offset, ino } => VmaKind::Shm { obj, offset: offset + skip, ino },
            k => k,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vma {
    pub end: u64,
    pub prot: u32,
    pub kind: VmaKind,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemoryMap {
    vmas: OrdMap<u64, Vma>,
    pub brk_start: u64,
    pub brk: u64,
    /// Bytes committed: the brk heap and every mapping but PROT_NONE ones
    /// (`charged`). Before state format 5's files were written with this
    /// rule, PROT_NONE mappings counted too; `validate` accepts both and
    /// `recount` applies this rule to a restored map.
    committed: u64,
    limit: u64,
}

/// Bytes of a mapping that count as committed memory. PROT_NONE mappings
/// do not (as on Linux, which accounts a private mapping only once it may be
/// written): the guest cannot touch them, so no page is ever backed behind
/// them, and glibc reserves 64 MiB PROT_NONE per thread arena, which would
/// otherwise make every thread of a process count 64 MiB in every fork of it.
fn charged(prot: u32, len: u64) -> u64 {
    if prot & 7 == 0 {
        0
    } else {
        len
    }
}

impl MemoryMap {
    pub fn new(limit: u64) -> MemoryMap {
        MemoryMap { vmas: OrdMap::new(), brk_start: 0, brk: 0, committed: 0, limit }
    }

    /// A map as a saved state records it: its mappings by start address
    /// (one per start; a later one replaces an earlier one), heap, committed
    /// bytes and limit, unchecked (`validate` checks it, `recount` applies
    /// today's counting rule).
    pub fn from_saved(
        vmas: impl IntoIterator<Item = (u64, Vma)>,
        brk_start: u64,
        brk: u64,
        committed: u64,
        limit: u64,
    ) -> MemoryMap {
        MemoryMap { vmas: vmas.into_iter().collect(), brk_start, brk, committed, limit }
    }

    pub fn committed(&self) -> u64 {
        self.committed
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Change the limit (a fork may get other limits than its template); it
    /// cannot go below what is already committed.
    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit.max(self.committed);
    }

    /// Recompute the committed bytes from the map and check it is well formed
    /// (sorted, non-overlapping, inside guest memory): for state read from disk.
    pub fn validate(&self) -> Result<(), String> {
        let mut last_end = 0;
        let mut sum: u64 = 0;
        let mut sum_all: u64 = 0;
        for (s, v) in self.vmas.iter() {
            if *s < last_end
                || v.end <= *s
                || *s < GUEST_BASE
                || v.end > STACK_TOP
                || s % PAGE_SIZE != 0
                || v.end % PAGE_SIZE != 0
                || (*s < RESERVED.1 && v.end > RESERVED.0)
            {
                return Err(format!("bad mapping {s:#x}..{:#x}", v.end));
            }
            if matches!(v.kind, VmaKind::Shm { .. }) {
                return Err(format!("a shared-memory mapping at {s:#x} in a saved state"));
            }
            last_end = v.end;
            sum = sum.checked_add(charged(v.prot, v.end - s)).ok_or("mapping sizes overflow")?;
            sum_all = sum_all.checked_add(v.end - s).ok_or("mapping sizes overflow")?;
        }
        if self.brk < self.brk_start
            || self.brk > BRK_LIMIT
            || (self.brk > self.brk_start && self.brk_start < GUEST_BASE)
        {
            return Err(format!("bad heap {:#x}..{:#x}", self.brk_start, self.brk));
        }
        // Either rule: PROT_NONE not charged (now) or charged (older files).
        let c = Some(self.committed);
        if sum.checked_add(self.brk_pages()) != c && sum_all.checked_add(self.brk_pages()) != c {
            return Err("committed bytes do not add up".into());
        }
        Ok(())
    }

    /// Recount the committed bytes with today's rule (`charged`), for a map
    /// `validate` accepted (an older state file counted PROT_NONE mappings).
    pub fn recount(&mut self) {
        let vmas: u64 = self.vmas.iter().map(|(s, v)| charged(v.prot, v.end - s)).fold(0, u64::saturating_add);
        self.committed = vmas.saturating_add(self.brk_pages());
        self.limit = self.limit.max(self.committed);
    }

    pub fn set_brk_start(&mut self, at: u64) {
        self.brk_start = align_up(at, PAGE_SIZE);
        self.brk = self.brk_start;
    }

    pub fn vmas(&self) -> impl Iterator<Item = (u64, Vma)> + '_ {
        self.vmas.iter().map(|(s, v)| (*s, *v))
    }

    fn brk_pages(&self) -> u64 {
        align_up(self.brk, PAGE_SIZE) - self.brk_start
    }

    /// Is `[addr, addr+len)` free of mappings (and of the heap)?
    fn is_free(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        if len == 0 {
            return true;
        }
        if addr < align_up(self.brk, PAGE_SIZE) && end > self.brk_start {
            return false;
        }
        if let Some((s, v)) = self.vmas.get_prev(&(end - 1)) {
            if *s < end && v.end > addr {
                return false;
            }
        }
        true
    }

    /// First-fit free range of `len` bytes in the mmap area.
    pub fn find_free(&self, len: u64) -> Option<u64> {
        let mut cursor = MMAP_BASE;
        for (s, v) in self.vmas.range(MMAP_BASE..) {
            if *s >= cursor && *s - cursor >= len {
                break;
            }
            cursor = cursor.max(v.end);
        }
        (cursor.checked_add(len)? <= MMAP_TOP).then_some(cursor)
    }

    /// Valid user range: page-aligned start, inside guest-owned memory, clear
    /// of the reserved addresses (page-table pool, stack guard).
    pub fn check_range(addr: u64, len: u64) -> Result<(), Errno> {
        if !addr.is_multiple_of(PAGE_SIZE) || len == 0 {
            return Err(Errno::EINVAL);
        }
        let end = addr.checked_add(len).ok_or(Errno::ENOMEM)?;
        if addr < GUEST_BASE || end > STACK_TOP || (addr < RESERVED.1 && end > RESERVED.0) {
            return Err(Errno::ENOMEM);
        }
        Ok(())
    }

    /// How many bytes from `addr` (at most `len`) the guest may access:
    /// contiguous mapped pages that are readable (any protection but
    /// PROT_NONE; x86 cannot map write- or execute-only) or, with `write`,
    /// writable. The brk heap is read-write.
    pub fn accessible(&self, addr: u64, len: u64, write: bool) -> u64 {
        let need =
            if write { libc::PROT_WRITE as u32 } else { (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u32 };
        let end = addr.saturating_add(len);
        let heap_end = align_up(self.brk, PAGE_SIZE);
        let mut at = addr;
        while at < end {
            if at >= self.brk_start && at < heap_end {
                at = heap_end;
                continue;
            }
            match self.vmas.get_prev(&at) {
                Some((s, v)) if *s <= at && v.end > at && v.prot & need != 0 => at = v.end,
                _ => break,
            }
        }
        at.min(end) - addr
    }

    /// The protection (PROT_* bits, 0 = unmapped) of each page of 2 MiB region `region`.
    pub fn region_prots(&self, region: u64) -> [u8; REGION_PAGES] {
        let mut out = [0u8; REGION_PAGES];
        let base = region.saturating_mul(HUGE_PAGE_SIZE);
        let end = base.saturating_add(HUGE_PAGE_SIZE);
        let mut fill = |s: u64, e: u64, prot: u8| {
            let (s, e) = (s.max(base), e.min(end));
            if s < e {
                out[((s - base) / PAGE_SIZE) as usize..((e - base) / PAGE_SIZE) as usize].fill(prot);
            }
        };
        fill(self.brk_start, align_up(self.brk, PAGE_SIZE), (libc::PROT_READ | libc::PROT_WRITE) as u8);
        for (s, v) in self.vmas.range(..end).rev().take_while(|(_, v)| v.end > base) {
            fill(*s, v.end, (v.prot & 7) as u8);
        }
        out
    }

    /// Make the page tables in `mem` agree with this map for every 2 MiB
    /// region that `[start, end)` touches (pages that lose a permission are
    /// queued for invalidation on `mem`, done before the vCPU runs again).
    pub fn sync_page_tables(&self, mem: &mut GuestMemory, start: u64, end: u64) -> Result<(), forkbox_vmm::VmmError> {
        if end <= start {
            return Ok(());
        }
        let first = (start / HUGE_PAGE_SIZE).max(1);
        let last = ((end - 1) / HUGE_PAGE_SIZE).min(REGIONS - 1);
        if first > last {
            return Ok(());
        }
        // The regions a mapping or the heap touches get their protections
        // computed; every other one is unmapped, and its directory entry
        // alone says whether it already is (most of the 4 GiB a restore
        // checks: computing each one's protections was most of that check).
        let mut touched = vec![0u64; (last - first + 1).div_ceil(64) as usize];
        let mut mark = |s: u64, e: u64| {
            if s >= e {
                return;
            }
            let (a, b) = ((s / HUGE_PAGE_SIZE).max(first), ((e - 1) / HUGE_PAGE_SIZE).min(last));
            for r in a..=b {
                let i = (r - first) as usize;
                touched[i / 64] |= 1 << (i % 64);
            }
        };
        let (lo, hi) = (first * HUGE_PAGE_SIZE, (last + 1).saturating_mul(HUGE_PAGE_SIZE));
        mark(self.brk_start.max(lo), align_up(self.brk, PAGE_SIZE).min(hi));
        for (s, v) in self.vmas.range(..hi).rev().take_while(|(_, v)| v.end > lo) {
            mark((*s).max(lo), v.end.min(hi));
        }
        for region in first..=last {
            let i = (region - first) as usize;
            if touched[i / 64] & (1 << (i % 64)) != 0 {
                paging::set_region(mem, region, &self.region_prots(region))?;
            } else {
                paging::unmap_region(mem, region)?;
            }
        }
        Ok(())
    }

    /// The whole address space (after a load or a restore).
    pub fn sync_all_page_tables(&self, mem: &mut GuestMemory) -> Result<(), forkbox_vmm::VmmError> {
        self.sync_page_tables(mem, GUEST_BASE, STACK_TOP)
    }

    /// Map `len` bytes (page-rounded by the caller). With `fixed`, exactly at
    /// `addr`, replacing what was there (returned in `replaced`); else anywhere free.
    pub fn map(&mut self, addr: Option<u64>, len: u64, prot: u32, kind: VmaKind) -> Result<u64, Errno> {
        let at = match addr {
            Some(a) => {
                Self::check_range(a, len)?;
                a
            }
            None => self.find_free(len).ok_or(Errno::ENOMEM)?,
        };
        if addr.is_some() {
            self.unmap(at, len)?;
        }
        let committed =
            self.committed.checked_add(charged(prot, len)).filter(|c| *c <= self.limit).ok_or(Errno::ENOMEM)?;
        if !self.is_free(at, len) {
            return Err(Errno::ENOMEM);
        }
        let end = at.checked_add(len).ok_or(Errno::ENOMEM)?;
        self.vmas.insert(at, Vma { end, prot, kind });
        self.committed = committed;
        Ok(at)
    }

    /// Is `[addr, addr+len)` free (for MAP_FIXED_NOREPLACE)?
    pub fn range_is_free(&self, addr: u64, len: u64) -> bool {
        self.is_free(addr, len)
    }

    /// The mappings overlapping `[addr, addr+len)`, clipped to it: (start, length, kind of that part).
    pub fn overlapping(&self, addr: u64, len: u64) -> Vec<(u64, u64, VmaKind)> {
        let end = addr.saturating_add(len);
        let mut out: Vec<(u64, u64, VmaKind)> = self
            .vmas
            .range(..end)
            .rev()
            .take_while(|(_, v)| v.end > addr)
            .map(|(s, v)| {
                let (cs, ce) = ((*s).max(addr), v.end.min(end));
                (cs, ce - cs, v.kind_from(cs - s))
            })
            .collect();
        out.reverse();
        out
    }

    /// Remove mappings in `[addr, addr+len)`, splitting partial ones. Returns
    /// the sub-ranges that were mapped, with their kind (the caller writes
    /// shared ones back and gives the pages back).
    pub fn unmap(&mut self, addr: u64, len: u64) -> Result<Vec<(u64, u64, VmaKind)>, Errno> {
        Self::check_range(addr, len)?;
        let end = addr + len;
        let removed = self.overlapping(addr, len);
        for &(cs, clen, _) in &removed {
            let (s, v) = match self.vmas.get_prev(&cs) {
                Some((s, v)) => (*s, *v),
                None => continue,
            };
            let ce = cs + clen;
            self.vmas.remove(&s);
            if s < cs {
                self.vmas.insert(s, Vma { end: cs, ..v });
            }
            if ce < v.end {
                self.vmas.insert(ce, Vma { kind: v.kind_from(ce - s), ..v });
            }
            self.committed = self.committed.saturating_sub(charged(v.prot, clen));
        }
        debug_assert!(self.overlapping(addr, end - addr).is_empty());
        Ok(removed)
    }

    /// Record new protections (the caller syncs the page tables). Linux
    /// refuses (ENOMEM) a range with unmapped pages in it; so does this.
    pub fn protect(&mut self, addr: u64, len: u64, prot: u32) -> Result<(), Errno> {
        Self::check_range(addr, len)?;
        let end = addr + len;
        let heap = align_up(self.brk, PAGE_SIZE).min(end).saturating_sub(self.brk_start.max(addr));
        if self.overlapping(addr, len).iter().map(|p| p.1).sum::<u64>() + heap != len {
            return Err(Errno::ENOMEM);
        }
        let overlapping: Vec<(u64, Vma)> =
            self.vmas.range(..end).rev().take_while(|(_, v)| v.end > addr).map(|(s, v)| (*s, *v)).collect();
        // PROT_NONE <-> accessible changes what is committed: check the limit first.
        let (mut add, mut sub) = (0u64, 0u64);
        for (s, v) in &overlapping {
            let len = v.end.min(end) - (*s).max(addr);
            add = add.saturating_add(charged(prot, len).saturating_sub(charged(v.prot, len)));
            sub = sub.saturating_add(charged(v.prot, len).saturating_sub(charged(prot, len)));
        }
        let committed = self.committed.checked_add(add).filter(|c| *c <= self.limit).ok_or(Errno::ENOMEM)?;
        self.committed = committed.saturating_sub(sub);
        for (s, v) in overlapping {
            let (cs, ce) = (s.max(addr), v.end.min(end));
            self.vmas.remove(&s);
            if s < cs {
                self.vmas.insert(s, Vma { end: cs, ..v });
            }
            self.vmas.insert(cs, Vma { end: ce, prot, kind: v.kind_from(cs - s) });
            if ce < v.end {
                self.vmas.insert(ce, Vma { kind: v.kind_from(ce - s), ..v });
            }
        }
        Ok(())
    }

    /// The mapping that starts exactly at `addr` and spans `len`, if any.
    pub fn mapping_at(&self, addr: u64) -> Option<Vma> {
        let (s, v) = self.vmas.get_prev(&addr)?;
        (v.end > addr).then_some(*v).filter(|_| *s <= addr)
    }

    /// Try to grow the mapping `[addr, addr+old)` in place to `new` bytes
    /// (`new > old`; every sum checked: the lengths are the guest's).
    pub fn grow_in_place(&mut self, addr: u64, old: u64, new: u64) -> Result<bool, Errno> {
        let Some(v) = self.vmas.get(&addr).copied() else { return Err(Errno::EFAULT) };
        let (Some(old_end), Some(new_end), Some(extra)) =
            (addr.checked_add(old), addr.checked_add(new), new.checked_sub(old))
        else {
            return Err(Errno::ENOMEM);
        };
        if v.end != old_end || extra == 0 {
            return Ok(false);
        }
        if Self::check_range(addr, new).is_err() || new_end > MMAP_TOP.max(v.end) || !self.is_free(old_end, extra) {
            return Ok(false);
        }
        let committed =
            self.committed.checked_add(charged(v.prot, extra)).filter(|c| *c <= self.limit).ok_or(Errno::ENOMEM)?;
        self.vmas.insert(addr, Vma { end: new_end, ..v });
        self.committed = committed;
        Ok(true)
    }

    /// Move the heap end. Returns the new break, or the old one if refused
    /// (Linux's brk never fails with an error code). `Some(range)` = pages to give back.
    pub fn set_brk(&mut self, new: u64) -> (u64, Option<(u64, u64)>) {
        if new < self.brk_start || new > BRK_LIMIT {
            return (self.brk, None);
        }
        // new <= BRK_LIMIT: no overflow below.
        let (old_top, new_top) = (align_up(self.brk, PAGE_SIZE), align_up(new, PAGE_SIZE));
        if new_top > old_top {
            let grow = new_top - old_top;
            let Some(committed) = self.committed.checked_add(grow).filter(|c| *c <= self.limit) else {
                return (self.brk, None);
            };
            if !self.is_free(old_top, grow) {
                return (self.brk, None);
            }
            self.committed = committed;
            self.brk = new;
            (new, None)
        } else {
            self.committed = self.committed.saturating_sub(old_top - new_top);
            self.brk = new;
            (new, (new_top < old_top).then_some((new_top, old_top - new_top)))
        }
    }

    /// Give every mapping of kind `Shm` another kind (`privatize`: the end of
    /// an exec), keeping its range and protection. Returns the changed ranges
    /// with their old kinds.
    pub fn unshare_all(&mut self) -> Vec<(u64, u64, VmaKind)> {
        let hit: Vec<(u64, Vma)> =
            self.vmas.iter().filter(|(_, v)| matches!(v.kind, VmaKind::Shm { .. })).map(|(s, v)| (*s, *v)).collect();
        let mut out = Vec::with_capacity(hit.len());
        for (s, v) in hit {
            let kind = match v.kind {
                VmaKind::Shm { ino: Some(ino), offset, .. } => VmaKind::SharedFile { ino, offset },
                _ => VmaKind::Anon,
            };
            self.vmas.insert(s, Vma { kind, ..v });
            out.push((s, v.end - s, v.kind));
        }
        out
    }

    /// Change the kind of the mapping that starts at `at` (the whole mapping).
    pub fn set_kind(&mut self, at: u64, kind: VmaKind) {
        if let Some(v) = self.vmas.get_mut(&at) {
            v.kind = kind;
        }
    }

    /// The shared object and its offset behind guest address `addr`, if it is in a `Shm` mapping.
    pub fn shared_at(&self, addr: u64) -> Option<(u32, u64)> {
        let (s, v) = self.vmas.get_prev(&addr)?;
        if v.end <= addr {
            return None;
        }
        match v.kind {
            VmaKind::Shm { obj, offset, .. } => Some((obj, offset.checked_add(addr - s)?)),
            _ => None,
        }
    }

    pub fn heap_bytes(&self) -> u64 {
        self.brk_pages()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A sync of the whole address space leaves every region's tables saying
    /// what the map says, whether a mapping, the heap or nothing touches it,
    /// and clears what the tables had where nothing is mapped any more.
    #[test]
    fn sync_all_makes_every_region_agree_with_the_map() {
        let mut mem = GuestMemory::anonymous(RAM_SIZE).unwrap();
        paging::build(&mut mem).unwrap();
        let mut mm = MemoryMap::new(1 << 30);
        let a = mm.map(None, 5 * MIB, 3, VmaKind::Anon).unwrap();
        let b = mm.map(Some(a + 8 * MIB + 3 * PAGE_SIZE), 2 * PAGE_SIZE, 5, VmaKind::File).unwrap();
        mm.map(Some(STACK_TOP - 3 * MIB), 3 * MIB, 1, VmaKind::Anon).unwrap();
        mm.set_brk_start(GUEST_BASE + 40 * MIB + 7 * PAGE_SIZE);
        mm.set_brk(GUEST_BASE + 43 * MIB);
        let agree = |mm: &MemoryMap, mem: &GuestMemory| {
            for region in 1..REGIONS {
                assert_eq!(paging::region_prots(mem, region).unwrap(), mm.region_prots(region), "region {region}");
            }
        };
        mm.sync_all_page_tables(&mut mem).unwrap();
        agree(&mm, &mem);
        // Tables that say more than the map (a mapping gone, stale entries in
        // an untouched region, as a restored memory may hold) are cleared.
        mm.unmap(b, 2 * PAGE_SIZE).unwrap();
        paging::set_region(&mut mem, 700, &[3; REGION_PAGES]).unwrap();
        let mut some = [0u8; REGION_PAGES];
        some[17] = 1;
        paging::set_region(&mut mem, 1500, &some).unwrap();
        mm.sync_all_page_tables(&mut mem).unwrap();
        agree(&mm, &mem);
        assert_eq!(paging::region_prots(&mem, b / HUGE_PAGE_SIZE).unwrap(), [0; REGION_PAGES]);
    }

    #[test]
    fn map_unmap_splits_and_accounts() {
        let mut mm = MemoryMap::new(1 << 30);
        let a = mm.map(None, 4 * PAGE_SIZE, 3, VmaKind::Anon).unwrap();
        assert_eq!(a, MMAP_BASE);
        let b = mm.map(None, PAGE_SIZE, 3, VmaKind::Anon).unwrap();
        assert_eq!(b, a + 4 * PAGE_SIZE);
        assert_eq!(mm.committed(), 5 * PAGE_SIZE);
        let removed = mm.unmap(a + PAGE_SIZE, PAGE_SIZE).unwrap();
        assert_eq!(removed, vec![(a + PAGE_SIZE, PAGE_SIZE, VmaKind::Anon)]);
        assert_eq!(mm.committed(), 4 * PAGE_SIZE);
        // the hole is reused first-fit
        assert_eq!(mm.map(None, PAGE_SIZE, 3, VmaKind::Anon).unwrap(), a + PAGE_SIZE);
        // a range spanning two mappings
        let removed = mm.unmap(a, 5 * PAGE_SIZE).unwrap();
        assert_eq!(removed.iter().map(|r| r.1).sum::<u64>(), 5 * PAGE_SIZE);
        assert_eq!(mm.committed(), 0);
    }

    #[test]
    fn fixed_mapping_replaces() {
        let mut mm = MemoryMap::new(1 << 30);
        let a = mm.map(None, 8 * PAGE_SIZE, 1, VmaKind::File).unwrap();
        mm.map(Some(a + 2 * PAGE_SIZE), 2 * PAGE_SIZE, 3, VmaKind::Anon).unwrap();
        assert_eq!(mm.committed(), 8 * PAGE_SIZE);
        assert_eq!(mm.mapping_at(a + 2 * PAGE_SIZE).unwrap().kind, VmaKind::Anon);
        assert_eq!(mm.mapping_at(a + 5 * PAGE_SIZE).unwrap().kind, VmaKind::File);
        assert_eq!(mm.vmas().count(), 3);
    }

    #[test]
    fn shared_file_offsets_follow_splits() {
        let mut mm = MemoryMap::new(1 << 30);
        let kind = VmaKind::SharedFile { ino: 9, offset: 0x1000 };
        let a = mm.map(None, 4 * PAGE_SIZE, 3, kind).unwrap();
        mm.protect(a + PAGE_SIZE, PAGE_SIZE, 1).unwrap();
        let parts = mm.overlapping(a, 4 * PAGE_SIZE);
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[1].2, VmaKind::SharedFile { ino: 9, offset: 0x2000 });
        assert_eq!(parts[2].2, VmaKind::SharedFile { ino: 9, offset: 0x3000 });
        let removed = mm.unmap(a + 3 * PAGE_SIZE, PAGE_SIZE).unwrap();
        assert_eq!(removed, vec![(a + 3 * PAGE_SIZE, PAGE_SIZE, VmaKind::SharedFile { ino: 9, offset: 0x4000 })]);
        mm.validate().unwrap();
    }

    #[test]
    fn limit_is_enforced() {
        let mut mm = MemoryMap::new(16 * MIB);
        assert_eq!(mm.map(None, 1 << 40, 3, VmaKind::Anon), Err(Errno::ENOMEM));
        mm.map(None, 12 * MIB, 3, VmaKind::Anon).unwrap();
        assert_eq!(mm.map(None, 8 * MIB, 3, VmaKind::Anon), Err(Errno::ENOMEM));
        mm.set_brk_start(0x80_0000);
        let (b, _) = mm.set_brk(0x80_0000 + 8 * MIB);
        assert_eq!(b, 0x80_0000, "brk past the limit is refused");
        let (b, _) = mm.set_brk(0x80_0000 + 2 * MIB);
        assert_eq!(b, 0x80_0000 + 2 * MIB);
        let (b, give_back) = mm.set_brk(0x80_0000 + MIB);
        assert_eq!(b, 0x80_0000 + MIB);
        assert_eq!(give_back, Some((0x80_0000 + MIB, MIB)));
    }

    #[test]
    fn prot_none_mappings_are_not_committed() {
        let mut mm = MemoryMap::new(16 * MIB);
        // A glibc arena: 64 MiB reserved PROT_NONE, then a part made read-write.
        let at = mm.map(None, 64 * MIB, 0, VmaKind::Anon).unwrap();
        assert_eq!(mm.committed(), 0);
        mm.protect(at, 2 * MIB, 3).unwrap();
        assert_eq!(mm.committed(), 2 * MIB);
        assert_eq!(mm.protect(at, 20 * MIB, 3), Err(Errno::ENOMEM), "making it accessible is checked");
        assert_eq!(mm.committed(), 2 * MIB, "a refused mprotect changes nothing");
        mm.protect(at + MIB, MIB, 0).unwrap();
        assert_eq!(mm.committed(), MIB);
        mm.unmap(at, 64 * MIB).unwrap();
        assert_eq!(mm.committed(), 0);
        mm.validate().unwrap();
        // An older state counted PROT_NONE too: it validates, and recount applies today's rule.
        let mut old = MemoryMap::new(1 << 30);
        old.map(None, 4 * MIB, 0, VmaKind::Anon).unwrap();
        old.map(None, MIB, 3, VmaKind::Anon).unwrap();
        old.committed += 4 * MIB;
        old.validate().unwrap();
        old.recount();
        assert_eq!(old.committed(), MIB);
        old.committed += 1;
        assert!(old.validate().is_err());
    }

    #[test]
    fn rejects_system_area_and_wraparound() {
        let mut mm = MemoryMap::new(1 << 30);
        assert_eq!(mm.map(Some(0x1000), PAGE_SIZE, 3, VmaKind::Anon), Err(Errno::ENOMEM));
        assert_eq!(mm.map(Some(u64::MAX - 4095), PAGE_SIZE, 3, VmaKind::Anon), Err(Errno::ENOMEM));
        assert_eq!(mm.map(Some(MMAP_BASE + 1), PAGE_SIZE, 3, VmaKind::Anon), Err(Errno::EINVAL));
        assert_eq!(mm.unmap(STACK_TOP, PAGE_SIZE), Err(Errno::ENOMEM));
    }

    #[test]
    fn grow_in_place_only_into_free_space() {
        let mut mm = MemoryMap::new(1 << 30);
        let a = mm.map(None, PAGE_SIZE, 3, VmaKind::Anon).unwrap();
        assert!(mm.grow_in_place(a, PAGE_SIZE, 3 * PAGE_SIZE).unwrap());
        let _b = mm.map(None, PAGE_SIZE, 3, VmaKind::Anon).unwrap();
        assert!(!mm.grow_in_place(a, 3 * PAGE_SIZE, 5 * PAGE_SIZE).unwrap());
    }
}
