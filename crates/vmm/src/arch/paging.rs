//! Identity-mapped 4-level page tables built by the VMM, present only for
//! what the guest mapped.
//!
//! `build` lays out the fixed part: PML4, PDPT, the four page directories of
//! the 4 GiB address space, and the system area (the first 2 MiB, 4 KiB
//! pages): page 0 absent, the tables and stubs read-only, the kernel stacks
//! writable, the vvar page read-only and no-execute, the vDSO read+execute.
//! Every other 2 MiB region starts not present. The ABI layer then maps the
//! guest's own mappings with `set_region`, with their protections (PROT_NONE
//! not present, read-only, no-execute without PROT_EXEC): one 2 MiB entry
//! when the whole region agrees, else a 4 KiB table in the region's fixed slot
//! of the page-table pool (`PT_POOL_ADDR`, never mapped for the guest). A
//! touch of anything else is a #PF. The tables live in guest memory, so
//! forks, recycling and checkpoints carry them like every other page.
//!
//! Why the system area has the U/S bit set: on this host's KVM (kvm_pvm) the
//! CPL-0 stubs' own accesses are checked as user accesses (a supervisor-only
//! stub page faults with error code 0x15 on its first fetch). Read-only is the
//! protection that works on both kinds of host: the guest can neither patch
//! the stubs, the IDT/GDT/TSS nor its page tables.
//!
//! The hypervisor caches translations (shadow page tables here, the TLB with
//! EPT) and does not see the VMM writing the tables through its own mapping.
//! Adding a permission needs nothing (the next fault re-reads the tables);
//! whenever a page loses one, `set_region` queues it on the guest memory
//! (`GuestMemory::invalidate`), which drops KVM's translations of it before
//! the vCPU runs again. Translations are identity, so dropping every mapping
//! of guest-physical page P drops every translation of virtual page P.

use crate::error::{Result, VmmError};
use crate::layout::*;
use crate::memory::GuestMemory;

pub const PRESENT: u64 = 1 << 0;
pub const WRITABLE: u64 = 1 << 1;
pub const USER: u64 = 1 << 2;
pub const ACCESSED: u64 = 1 << 5;
pub const DIRTY: u64 = 1 << 6;
pub const HUGE: u64 = 1 << 7;
pub const NO_EXECUTE: u64 = 1 << 63;

/// Protections of a guest page, the bits of mmap's PROT_* (0: not present).
pub const PROT_READ: u8 = 1;
pub const PROT_WRITE: u8 = 2;
pub const PROT_EXEC: u8 = 4;

/// 2 MiB regions of the address space; region 0 is the system area.
pub const REGIONS: u64 = VIRT_SIZE / HUGE_PAGE_SIZE;
/// 4 KiB pages per region.
pub const REGION_PAGES: usize = 512;

const GIB: u64 = 1 << 30;
const TABLE: u64 = PRESENT | WRITABLE | USER | ACCESSED;
const ADDR_MASK: u64 = 0x000F_FFFF_FFFF_F000;

/// The fixed part of the tables; every guest region not present.
pub fn build(mem: &mut GuestMemory) -> Result<()> {
    let ram = mem.size();
    if ram < PT_POOL_END || !ram.is_multiple_of(GIB) || ram / GIB > MAX_RAM_GIB {
        return Err(VmmError::BadRamSize(ram));
    }
    mem.slice_mut(PML4_ADDR, PAGE_SIZE)?.fill(0);
    mem.slice_mut(PDPT_ADDR, PAGE_SIZE)?.fill(0);
    mem.write_u64(PML4_ADDR, PDPT_ADDR | TABLE)?;
    for g in 0..VIRT_SIZE / GIB {
        let pd = PD_ADDR + g * PAGE_SIZE;
        mem.slice_mut(pd, PAGE_SIZE)?.fill(0);
        mem.write_u64(PDPT_ADDR + 8 * g, pd | TABLE)?;
    }
    // The system area: 4 KiB pages.
    mem.write_u64(PD_ADDR, PT0_ADDR | TABLE)?;
    for i in 0..512u64 {
        let addr = i * PAGE_SIZE;
        let entry = if i == 0 {
            0
        } else if (KERNEL_STACKS_ADDR..EXCEPTION_STACK_TOP).contains(&addr) {
            addr | PRESENT | WRITABLE | USER | ACCESSED | DIRTY | NO_EXECUTE
        } else if addr == VVAR_PAGE {
            addr | PRESENT | USER | ACCESSED | NO_EXECUTE
        } else {
            addr | PRESENT | USER | ACCESSED
        };
        mem.write_u64(PT0_ADDR + 8 * i, entry)?;
    }
    Ok(())
}

/// The page-table slot of `region` (a guest-physical page of the pool).
pub fn slot(region: u64) -> u64 {
    PT_POOL_ADDR + region * PAGE_SIZE
}

fn pde_addr(region: u64) -> u64 {
    PD_ADDR + 8 * region
}

/// PROT_* bits as the MMU enforces them: anything present is readable.
fn normalize(prot: u8) -> u8 {
    if prot & 7 == 0 {
        0
    } else {
        (prot & 7) | PROT_READ
    }
}

/// A leaf entry mapping `addr` with `prot` (0 when not present). Accessed and
/// dirty are preset: the MMU never has to write the tables.
fn leaf(addr: u64, prot: u8, huge: bool) -> u64 {
    if prot & 7 == 0 {
        return 0;
    }
    let mut e = addr | PRESENT | USER | ACCESSED | DIRTY;
    if prot & PROT_WRITE != 0 {
        e |= WRITABLE;
    }
    if prot & PROT_EXEC == 0 {
        e |= NO_EXECUTE;
    }
    if huge {
        e |= HUGE;
    }
    e
}

fn prot_of(entry: u64) -> u8 {
    if entry & PRESENT == 0 {
        return 0;
    }
    let mut p = PROT_READ;
    if entry & WRITABLE != 0 {
        p |= PROT_WRITE;
    }
    if entry & NO_EXECUTE == 0 {
        p |= PROT_EXEC;
    }
    p
}

/// The protections a region's directory entry gives its pages; `table` is the
/// 4 KiB table it points to (when it points to one).
fn decode(pde: u64, table: Option<&[u8]>) -> [u8; REGION_PAGES] {
    let mut out = [0u8; REGION_PAGES];
    if pde & PRESENT == 0 {
        return out;
    }
    if pde & HUGE != 0 {
        out.fill(prot_of(pde));
        return out;
    }
    if let Some(t) = table {
        for (o, e) in out.iter_mut().zip(t.chunks_exact(8)) {
            *o = prot_of(u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]));
        }
    }
    out
}

fn check_region(region: u64) -> Result<()> {
    if region == 0 || region >= REGIONS {
        return Err(VmmError::OutOfRange { addr: region.saturating_mul(HUGE_PAGE_SIZE), len: HUGE_PAGE_SIZE });
    }
    Ok(())
}

/// The protection of every page of `region` as the tables have it now.
pub fn region_prots(mem: &GuestMemory, region: u64) -> Result<[u8; REGION_PAGES]> {
    check_region(region)?;
    let pde = mem.read_u64(pde_addr(region))?;
    let table = if pde & (PRESENT | HUGE) == PRESENT { Some(mem.slice(pde & ADDR_MASK, PAGE_SIZE)?) } else { None };
    Ok(decode(pde, table))
}

/// Map `region` (addresses `region * 2 MiB ..`) with `prots`, one PROT_* set
/// per 4 KiB page (0: not present). Pages losing a permission are queued for
/// invalidation on `mem`. Writes only what changes.
pub fn set_region(mem: &mut GuestMemory, region: u64, prots: &[u8; REGION_PAGES]) -> Result<()> {
    let base = region * HUGE_PAGE_SIZE;
    let new = prots.map(normalize);
    // Most regions are one protection throughout (most of all: unmapped) and
    // already say so: nothing to decode, compare or invalidate. (A restore
    // checks every region of the address space.)
    if new.iter().all(|&p| p == new[0]) && mem.read_u64(pde_addr(region))? == leaf(base, new[0], true) {
        return Ok(());
    }
    let old = region_prots(mem, region)?;
    let mut i = 0;
    while i < REGION_PAGES {
        if old[i] & !new[i] == 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i < REGION_PAGES && old[i] & !new[i] != 0 {
            i += 1;
        }
        mem.invalidate(base + start as u64 * PAGE_SIZE, (i - start) as u64 * PAGE_SIZE);
    }
    let pde = mem.read_u64(pde_addr(region))?;
    let new_pde = if new.iter().all(|&p| p == new[0]) {
        leaf(base, new[0], true)
    } else {
        let slot = slot(region);
        let mut table = [0u8; PAGE_SIZE as usize];
        for (i, &p) in new.iter().enumerate() {
            table[i * 8..i * 8 + 8].copy_from_slice(&leaf(base + i as u64 * PAGE_SIZE, p, false).to_le_bytes());
        }
        if mem.slice(slot, PAGE_SIZE)? != &table[..] {
            mem.write(slot, &table)?;
        }
        slot | TABLE
    };
    if new_pde != pde {
        mem.write_u64(pde_addr(region), new_pde)?;
    }
    Ok(())
}

/// [`set_region`] with every page not present, reading only the region's
/// directory entry when it already says so (most regions of the address
/// space, at a restore's check of all of them).
pub fn unmap_region(mem: &mut GuestMemory, region: u64) -> Result<()> {
    check_region(region)?;
    if mem.read_u64(pde_addr(region))? == leaf(region * HUGE_PAGE_SIZE, 0, true) {
        return Ok(());
    }
    set_region(mem, region, &[0; REGION_PAGES])
}

fn view_slice(view: &[u8], addr: u64, len: u64) -> Option<&[u8]> {
    let end = addr.checked_add(len)?;
    view.get(usize::try_from(addr).ok()?..usize::try_from(end).ok()?)
}

fn view_u64(view: &[u8], addr: u64) -> Option<u64> {
    let b = view_slice(view, addr, 8)?;
    Some(u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}

fn view_prots(view: &[u8], region: u64) -> [u8; REGION_PAGES] {
    let pde = view_u64(view, pde_addr(region)).unwrap_or(0);
    let table = if pde & (PRESENT | HUGE) == PRESENT { view_slice(view, pde & ADDR_MASK, PAGE_SIZE) } else { None };
    decode(pde, table)
}

/// Pages of a memory image (e.g. a template's) that its tables map, plus the
/// whole system area: one bit per 4 KiB page.
pub fn mapped_pages(view: &[u8]) -> Vec<u64> {
    let pages = view.len() as u64 / PAGE_SIZE;
    let mut bits = vec![0u64; pages.div_ceil(64) as usize];
    let mut set = |page: u64| {
        if let Some(w) = bits.get_mut((page / 64) as usize) {
            *w |= 1 << (page % 64);
        }
    };
    for page in 0..REGION_PAGES as u64 {
        set(page);
    }
    for region in 1..REGIONS {
        for (i, p) in view_prots(view, region).iter().enumerate() {
            if *p != 0 {
                set(region * REGION_PAGES as u64 + i as u64);
            }
        }
    }
    bits
}

/// Guest ranges whose translation in `mem` differs from the one in
/// `original` (the image `mem` is being reset to). `private`: one bit per page
/// of `mem` that is private (a table page that is not cannot differ).
pub fn changed_translations(mem: &GuestMemory, original: &[u8], private: &[u64]) -> Result<Vec<(u64, u64)>> {
    let is_private = |addr: u64| {
        let page = addr / PAGE_SIZE;
        private.get((page / 64) as usize).is_some_and(|w| w & (1 << (page % 64)) != 0)
    };
    let mut out: Vec<(u64, u64)> = Vec::new();
    // Only a private directory page or a private table slot can differ.
    for region in 1..REGIONS {
        if !is_private(pde_addr(region)) && !is_private(slot(region)) {
            continue;
        }
        let now = mem.read_u64(pde_addr(region))?;
        let then = view_u64(original, pde_addr(region)).unwrap_or(0);
        let is_table = now & (PRESENT | HUGE) == PRESENT;
        if now == then && (!is_table || !is_private(now & ADDR_MASK)) {
            continue;
        }
        let (a, b) = (region_prots(mem, region)?, view_prots(original, region));
        let base = region * HUGE_PAGE_SIZE;
        for i in 0..REGION_PAGES {
            if a[i] != b[i] {
                let at = base + i as u64 * PAGE_SIZE;
                match out.last_mut() {
                    Some((s, l)) if *s + *l == at => *l += PAGE_SIZE,
                    _ => out.push((at, PAGE_SIZE)),
                }
            }
        }
    }
    Ok(out)
}

/// Walk the tables like the MMU would: the leaf entry's flags for `addr`, if mapped.
pub fn translate(mem: &GuestMemory, addr: u64) -> Option<(u64, u64)> {
    let flags_mask = 0xFFF | NO_EXECUTE;
    let pml4e = mem.read_u64(PML4_ADDR + 8 * ((addr >> 39) & 511)).ok()?;
    if pml4e & PRESENT == 0 {
        return None;
    }
    let pdpte = mem.read_u64((pml4e & !flags_mask) + 8 * ((addr >> 30) & 511)).ok()?;
    if pdpte & PRESENT == 0 {
        return None;
    }
    let pde = mem.read_u64((pdpte & !flags_mask) + 8 * ((addr >> 21) & 511)).ok()?;
    if pde & PRESENT == 0 {
        return None;
    }
    if pde & HUGE != 0 {
        let phys = (pde & !flags_mask & !(HUGE_PAGE_SIZE - 1)) | (addr & (HUGE_PAGE_SIZE - 1));
        return Some((phys, pde & flags_mask));
    }
    let pte = mem.read_u64((pde & !flags_mask) + 8 * ((addr >> 12) & 511)).ok()?;
    if pte & PRESENT == 0 {
        return None;
    }
    Some(((pte & !flags_mask) | (addr & 0xFFF), pte & flags_mask))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built() -> GuestMemory {
        let mut m = GuestMemory::anonymous(VIRT_SIZE).unwrap();
        build(&mut m).unwrap();
        m
    }

    fn uniform(p: u8) -> [u8; REGION_PAGES] {
        [p; REGION_PAGES]
    }

    #[test]
    fn guest_memory_starts_unmapped() {
        let m = built();
        for addr in [GUEST_BASE, 0x40_0123, GIB - 1, 0x1234_5678, VIRT_SIZE - 1, PT_POOL_ADDR] {
            assert!(translate(&m, addr).is_none(), "{addr:#x}");
        }
    }

    #[test]
    fn null_page_absent_and_system_area_read_only() {
        let m = built();
        assert!(translate(&m, 0).is_none());
        assert!(translate(&m, 0xFFF).is_none());
        for addr in [GDT_ADDR, TSS_ADDR, IDT_ADDR, STUBS_ADDR, PML4_ADDR, PDPT_ADDR, PD_ADDR, PT0_ADDR, 0x1F_F000] {
            let (_, flags) = translate(&m, addr).unwrap();
            assert_eq!(flags & WRITABLE, 0, "{addr:#x} must not be writable");
        }
        let (_, stack) = translate(&m, SYSCALL_STACK_TOP - 8).unwrap();
        assert_eq!(stack & (WRITABLE | NO_EXECUTE), WRITABLE | NO_EXECUTE);
    }

    #[test]
    fn vdso_and_vvar_permissions() {
        let m = built();
        let (_, vvar) = translate(&m, VVAR_PAGE).unwrap();
        assert_eq!(vvar & (USER | WRITABLE | NO_EXECUTE), USER | NO_EXECUTE);
        let (_, vdso) = translate(&m, VDSO_PAGE + PAGE_SIZE).unwrap();
        assert_eq!(vdso & (USER | WRITABLE | NO_EXECUTE), USER);
        let (_, after) = translate(&m, VDSO_PAGE + VDSO_PAGES * PAGE_SIZE).unwrap();
        assert_eq!(after & WRITABLE, 0);
    }

    #[test]
    fn uniform_regions_use_2mib_pages_with_their_protections() {
        let mut m = built();
        set_region(&mut m, 3, &uniform(PROT_READ | PROT_WRITE)).unwrap();
        let (phys, flags) = translate(&m, 3 * HUGE_PAGE_SIZE + 0x1234).unwrap();
        assert_eq!(phys, 3 * HUGE_PAGE_SIZE + 0x1234);
        assert_eq!(flags & (HUGE | WRITABLE | USER | PRESENT), HUGE | WRITABLE | USER | PRESENT);
        assert!(flags & NO_EXECUTE != 0, "no PROT_EXEC: no-execute");
        set_region(&mut m, 4, &uniform(PROT_READ | PROT_EXEC)).unwrap();
        let (_, flags) = translate(&m, 4 * HUGE_PAGE_SIZE).unwrap();
        assert_eq!(flags & (WRITABLE | NO_EXECUTE), 0, "read+exec");
        assert!(m.take_invalidations().is_empty(), "adding permissions needs no invalidation");
        // The slot of a 2 MiB region is not used.
        assert!(m.slice(slot(3), PAGE_SIZE).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn mixed_regions_use_a_table_in_their_slot() {
        let mut m = built();
        let r = 0x100;
        let mut p = uniform(PROT_READ | PROT_WRITE);
        p[0] = 0;
        p[1] = PROT_READ;
        p[511] = PROT_READ | PROT_EXEC;
        set_region(&mut m, r, &p).unwrap();
        let base = r * HUGE_PAGE_SIZE;
        assert!(translate(&m, base).is_none(), "PROT_NONE / unmapped page not present");
        let (_, ro) = translate(&m, base + PAGE_SIZE).unwrap();
        assert_eq!(ro & (WRITABLE | NO_EXECUTE | HUGE), NO_EXECUTE);
        let (_, rw) = translate(&m, base + 2 * PAGE_SIZE).unwrap();
        assert_eq!(rw & (WRITABLE | NO_EXECUTE), WRITABLE | NO_EXECUTE);
        let (_, rx) = translate(&m, base + 511 * PAGE_SIZE).unwrap();
        assert_eq!(rx & (WRITABLE | NO_EXECUTE), 0);
        assert_eq!(region_prots(&m, r).unwrap(), p.map(normalize));
        // Read back through the PDE: it points into the pool.
        assert_eq!(m.read_u64(pde_addr(r)).unwrap() & ADDR_MASK, slot(r));
    }

    #[test]
    fn lost_permissions_are_queued_for_invalidation() {
        let mut m = built();
        let r = 0x200;
        set_region(&mut m, r, &uniform(PROT_READ | PROT_WRITE)).unwrap();
        let mut p = uniform(PROT_READ | PROT_WRITE);
        p[10] = PROT_READ;
        p[11] = 0;
        p[12] = 0;
        set_region(&mut m, r, &p).unwrap();
        let base = r * HUGE_PAGE_SIZE;
        assert_eq!(m.take_invalidations(), vec![(base + 10 * PAGE_SIZE, 3 * PAGE_SIZE)]);
        set_region(&mut m, r, &uniform(0)).unwrap();
        assert_eq!(m.read_u64(pde_addr(r)).unwrap(), 0);
        assert_eq!(m.take_invalidations(), vec![(base, 11 * PAGE_SIZE), (base + 13 * PAGE_SIZE, 499 * PAGE_SIZE)]);
    }

    #[test]
    fn system_area_and_out_of_range_regions_are_refused() {
        let mut m = built();
        assert!(set_region(&mut m, 0, &uniform(PROT_READ)).is_err());
        assert!(set_region(&mut m, REGIONS, &uniform(PROT_READ)).is_err());
    }

    #[test]
    fn mapped_pages_and_changes_against_an_image() {
        let mut m = built();
        set_region(&mut m, 5, &uniform(PROT_READ)).unwrap();
        let mut p = uniform(0);
        p[7] = PROT_READ | PROT_WRITE;
        set_region(&mut m, 6, &p).unwrap();
        // The image: a sparse file with the table pages copied in, viewed through a mapping.
        use std::os::unix::fs::FileExt;
        let f = tempfile::tempfile().unwrap();
        f.set_len(VIRT_SIZE).unwrap();
        for page in [PML4_ADDR, PDPT_ADDR, PD_ADDR, PT0_ADDR, slot(6)] {
            f.write_all_at(m.slice(page, PAGE_SIZE).unwrap(), page).unwrap();
        }
        let view = GuestMemory::private_file(&f, VIRT_SIZE).unwrap();
        let image = view.slice(0, VIRT_SIZE).unwrap();
        let bits = mapped_pages(image);
        let has = |page: u64| bits[(page / 64) as usize] & (1 << (page % 64)) != 0;
        assert!(has(1) && has(511), "system area");
        assert!(has(5 * 512) && has(5 * 512 + 511));
        assert!(has(6 * 512 + 7) && !has(6 * 512 + 6) && !has(7 * 512));
        let all = vec![u64::MAX; bits.len()];
        assert!(changed_translations(&m, image, &all).unwrap().is_empty());
        p[7] = PROT_READ;
        p[8] = PROT_READ;
        set_region(&mut m, 6, &p).unwrap();
        set_region(&mut m, 9, &uniform(PROT_READ)).unwrap();
        let changed = changed_translations(&m, image, &all).unwrap();
        assert_eq!(
            changed,
            vec![(6 * HUGE_PAGE_SIZE + 7 * PAGE_SIZE, 2 * PAGE_SIZE), (9 * HUGE_PAGE_SIZE, HUGE_PAGE_SIZE)]
        );
    }

    #[test]
    fn rejects_bad_ram_sizes() {
        let mut m = GuestMemory::anonymous(GIB).unwrap();
        assert!(matches!(build(&mut m), Err(VmmError::BadRamSize(_))));
    }
}
