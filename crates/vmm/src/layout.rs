//! Guest-physical layout. Guest virtual addresses equal guest physical ones
//! (identity paging), so every address here is both.
//!
//! ```text
//! 0x0000_0000  page 0: not present (NULL dereferences fault)
//! 0x0000_1000  GDT                      read-only
//! 0x0000_2000  TSS                      read-only
//! 0x0000_3000  IDT (256 gates)          read-only
//! 0x0000_4000  entry stubs              read+exec
//! 0x0000_8000  page tables              read-only
//! 0x0010_0000  kernel stacks            read+write, no-exec
//! 0x001F_0000  vvar page                read-only, no-exec  (vdso.rs)
//! 0x001F_1000  vDSO image               read+exec           (vdso.rs)
//! 0x0020_0000  guest-owned memory: executable, brk, ld.so, mmap area, stack
//! 0xFEC0_0000  page-table pool (PT_POOL_ADDR): one 4 KiB table per 2 MiB
//!              region, never mapped in the guest's address space
//! ```
//!
//! Only the system area is mapped by `paging::build`; every guest page is
//! mapped by the guest's own memory map (`paging::set_region`), with its
//! protections, so a touch of anything else is a page fault.

pub const PAGE_SIZE: u64 = 4096;
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

pub const GDT_ADDR: u64 = 0x1000;
pub const TSS_ADDR: u64 = 0x2000;
pub const IDT_ADDR: u64 = 0x3000;
pub const STUBS_ADDR: u64 = 0x4000;
pub const PML4_ADDR: u64 = 0x8000;
pub const PDPT_ADDR: u64 = 0x9000;
/// Page directories, one per GiB of guest RAM, up to `MAX_RAM_GIB`.
pub const PD_ADDR: u64 = 0xA000;
pub const MAX_RAM_GIB: u64 = 64;
/// The 4 KiB page table for the first 2 MiB (the system area).
pub const PT0_ADDR: u64 = PD_ADDR + MAX_RAM_GIB * PAGE_SIZE;
pub const KERNEL_STACKS_ADDR: u64 = 0x10_0000;
/// Top of the stack the syscall stub returns through (the VMM writes an iretq frame under it).
pub const SYSCALL_STACK_TOP: u64 = 0x10_8000;
/// TSS.RSP0: the CPU pushes exception frames here.
pub const EXCEPTION_STACK_TOP: u64 = 0x11_0000;

/// Where the syscall stub's `out` reports.
pub const PORT_SYSCALL: u16 = 0x12;
/// Exception vector v reports on `PORT_EXCEPTION_BASE + v` (kept below 0x40, see design notes).
pub const PORT_EXCEPTION_BASE: u16 = 0x20;
pub const EXCEPTION_VECTORS: u16 = 32;

/// Version of the guest memory layout (system area, page tables and their
/// pool): part of a template's id, so a template of another layout is never
/// forked. 2: page tables present only for the guest's mappings.
pub const LAYOUT_VERSION: u32 = 2;

/// The guest's virtual address space: the page tables cover 4 GiB (4 page directories).
pub const VIRT_SIZE: u64 = 4 << 30;
/// Page tables of the 2 MiB regions: region `r` (addresses `r * 2 MiB ..`) has
/// its 4 KiB table, when it needs one, at `PT_POOL_ADDR + r * 4 KiB`. Fixed
/// slots: no allocator state to fork, snapshot or recycle; the host backs only
/// the slots in use. Guest-physical pages the guest can never map (the ABI
/// layer keeps its mappings out of `PT_POOL_ADDR..PT_POOL_END`), so the guest
/// can neither read nor write its page tables.
pub const PT_POOL_ADDR: u64 = 0xFEC0_0000;
pub const PT_POOL_END: u64 = PT_POOL_ADDR + (VIRT_SIZE / HUGE_PAGE_SIZE) * PAGE_SIZE;

/// First address the guest process may own.
pub const GUEST_BASE: u64 = 0x20_0000;

pub const fn align_up(v: u64, a: u64) -> u64 {
    (v + a - 1) & !(a - 1)
}

pub const fn align_down(v: u64, a: u64) -> u64 {
    v & !(a - 1)
}

/// vvar page (time data the VMM fills) and the vDSO image after it, see `vdso.rs`.
pub const VVAR_PAGE: u64 = 0x1F_0000;
pub const VDSO_PAGE: u64 = 0x1F_1000;
pub const VDSO_PAGES: u64 = 3;
