//! x86-64 machine setup for a guest that runs only at CPL 3: the VMM builds the
//! system tables and page tables in guest memory; the only CPL-0 code is a few
//! instructions of entry stubs that report to the VMM with `out`.

pub mod cpu;
pub mod paging;
pub mod tables;

/// Segment selectors (see `tables::build_gdt`).
pub const KERNEL_CS: u16 = 0x08;
pub const KERNEL_SS: u16 = 0x10;
pub const USER_SS: u16 = 0x18 | 3;
pub const USER_CS: u16 = 0x20 | 3;
pub const TSS_SEL: u16 = 0x28;

/// RFLAGS for user code: IF set, IOPL 0, bit 1 reserved-one.
pub const USER_RFLAGS: u64 = 0x202;
