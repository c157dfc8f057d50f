//! Where the guest process lives in its 4 GiB address space (see forkbox-vmm's
//! `layout` for the system area below `GUEST_BASE`).

pub use forkbox_vmm::layout::{align_down, align_up, GUEST_BASE, HUGE_PAGE_SIZE, PAGE_SIZE, PT_POOL_ADDR, PT_POOL_END};

/// Guest RAM: one memslot, identity-mapped.
pub const RAM_SIZE: u64 = 4 << 30;
/// A position-independent executable is loaded here; non-PIE ones (Debian's
/// python3) sit at their link address (0x400000).
pub const PIE_BASE: u64 = 0x1000_0000;
/// The program interpreter (ld-linux-x86-64.so.2).
pub const INTERP_BASE: u64 = 0x4000_0000;
/// brk may grow up to the interpreter.
pub const BRK_LIMIT: u64 = INTERP_BASE;
/// mmap area.
pub const MMAP_BASE: u64 = 0x4800_0000;
/// The stack: its top, and its fixed size (RLIMIT_STACK).
pub const STACK_TOP: u64 = 0xFFFF_F000;
pub const STACK_SIZE: u64 = 8 << 20;
pub const STACK_BOTTOM: u64 = STACK_TOP - STACK_SIZE;
/// A 2 MiB region below the stack no mapping may use: a stack overflow
/// faults instead of running into other memory.
pub const STACK_GUARD: (u64, u64) =
    (align_down(STACK_BOTTOM, HUGE_PAGE_SIZE) - HUGE_PAGE_SIZE, align_down(STACK_BOTTOM, HUGE_PAGE_SIZE));
/// Addresses no guest mapping may use: the page-table pool (guest-physical
/// pages holding the page tables, see forkbox-vmm's layout) and the stack guard.
pub const RESERVED: (u64, u64) = (PT_POOL_ADDR, STACK_GUARD.1);
pub const MMAP_TOP: u64 = RESERVED.0;
const _: () = assert!(PT_POOL_END <= STACK_GUARD.0 && MMAP_BASE < MMAP_TOP && STACK_GUARD.1 <= STACK_BOTTOM);
