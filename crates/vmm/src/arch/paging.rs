//! Identity-mapped 4-level page tables built by the VMM.
//!
//! Guest RAM is mapped with 2 MiB pages, user-accessible and writable; the
//! first 2 MiB (system area) uses 4 KiB pages: page 0 absent, the tables and
//! stubs read-only, the kernel stacks writable, the vvar page read-only and
//! no-execute, the vDSO read+execute. `holes` (2 MiB-aligned ranges) are left
//! not present, e.g. a guard below the stack.
//!
//! Why the system area has the U/S bit set: on this host's KVM (kvm_pvm) the
//! CPL-0 stubs' own accesses are checked as user accesses (a supervisor-only
//! stub page faults with error code 0x15 on its first fetch). Read-only is the
//! protection that works on both kinds of host: the guest can neither patch
//! the stubs, the IDT/GDT/TSS nor its page tables.

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

const GIB: u64 = 1 << 30;

pub fn build(mem: &mut GuestMemory, holes: &[(u64, u64)]) -> Result<()> {
    let ram = mem.size();
    if ram == 0 || !ram.is_multiple_of(GIB) || ram / GIB > MAX_RAM_GIB {
        return Err(VmmError::BadRamSize(ram));
    }
    let gibs = ram / GIB;
    let table = PRESENT | WRITABLE | USER | ACCESSED;
    mem.slice_mut(PML4_ADDR, PAGE_SIZE)?.fill(0);
    mem.slice_mut(PDPT_ADDR, PAGE_SIZE)?.fill(0);
    mem.write_u64(PML4_ADDR, PDPT_ADDR | table)?;
    for g in 0..gibs {
        let pd = PD_ADDR + g * PAGE_SIZE;
        mem.write_u64(PDPT_ADDR + 8 * g, pd | table)?;
        for j in 0..512u64 {
            let addr = g * GIB + j * HUGE_PAGE_SIZE;
            let in_hole = holes.iter().any(|&(s, e)| addr >= s && addr < e);
            let entry = if in_hole { 0 } else { addr | PRESENT | WRITABLE | USER | ACCESSED | DIRTY | HUGE };
            mem.write_u64(pd + 8 * j, entry)?;
        }
    }
    // The system area: 4 KiB pages.
    mem.write_u64(PD_ADDR, PT0_ADDR | table)?;
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

    fn built(holes: &[(u64, u64)]) -> GuestMemory {
        let mut m = GuestMemory::anonymous(GIB).unwrap();
        build(&mut m, holes).unwrap();
        m
    }

    #[test]
    fn identity_maps_guest_ram_for_user() {
        let m = built(&[]);
        for addr in [GUEST_BASE, 0x40_0123, GIB - 1, 0x1234_5678] {
            let (phys, flags) = translate(&m, addr).unwrap();
            assert_eq!(phys, addr);
            assert_eq!(flags & (PRESENT | WRITABLE | USER), PRESENT | WRITABLE | USER, "{addr:#x}");
        }
    }

    #[test]
    fn null_page_absent_and_system_area_read_only() {
        let m = built(&[]);
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
        let m = built(&[]);
        let (_, vvar) = translate(&m, VVAR_PAGE).unwrap();
        assert_eq!(vvar & (USER | WRITABLE | NO_EXECUTE), USER | NO_EXECUTE);
        let (_, vdso) = translate(&m, VDSO_PAGE + PAGE_SIZE).unwrap();
        assert_eq!(vdso & (USER | WRITABLE | NO_EXECUTE), USER);
        let (_, after) = translate(&m, VDSO_PAGE + VDSO_PAGES * PAGE_SIZE).unwrap();
        assert_eq!(after & WRITABLE, 0);
    }

    #[test]
    fn holes_are_not_present() {
        let m = built(&[(0x800_0000, 0x820_0000)]);
        assert!(translate(&m, 0x800_0000).is_none());
        assert!(translate(&m, 0x81F_FFFF).is_none());
        assert!(translate(&m, 0x820_0000).is_some());
        assert!(translate(&m, 0x7FF_FFFF).is_some());
    }

    #[test]
    fn rejects_bad_ram_sizes() {
        let mut m = GuestMemory::anonymous(GIB / 2).unwrap();
        assert!(matches!(build(&mut m, &[]), Err(VmmError::BadRamSize(_))));
    }
}
