//! GDT, TSS, IDT and the CPL-0 entry stubs.

use crate::error::Result;
use crate::layout::*;
use crate::memory::GuestMemory;

/// `out PORT_SYSCALL, al ; iretq` — the LSTAR target. The VMM handles the call
/// while the vCPU sits after the `out`, then points RSP at an iretq frame it wrote.
const SYSCALL_STUB: [u8; 4] = [0xE6, PORT_SYSCALL as u8, 0x48, 0xCF];
pub const SYSCALL_STUB_ADDR: u64 = STUBS_ADDR;
/// RIP after the syscall stub's `out`: the only place a legitimate syscall exit comes from.
pub const SYSCALL_EXIT_RIP: u64 = STUBS_ADDR + 2;
/// Exception stubs: vector v at `EXC_STUBS_ADDR + 16 * v`: `out PORT_EXCEPTION_BASE+v, al ; hlt ; jmp .`
pub const EXC_STUBS_ADDR: u64 = STUBS_ADDR + 0x100;
const EXC_STUB_LEN: u64 = 16;

/// RIP after the `out` of exception stub `v`.
pub fn exception_exit_rip(vector: u16) -> u64 {
    EXC_STUBS_ADDR + EXC_STUB_LEN * vector as u64 + 2
}

pub fn build(mem: &mut GuestMemory) -> Result<()> {
    build_gdt(mem)?;
    build_tss(mem)?;
    build_stubs(mem)?;
    build_idt(mem)
}

fn build_gdt(mem: &mut GuestMemory) -> Result<()> {
    let tss_lo = 0x67u64 | ((TSS_ADDR & 0xFF_FFFF) << 16) | (0x89u64 << 40) | (((TSS_ADDR >> 24) & 0xFF) << 56);
    let gdt: [u64; 7] = [
        0,
        // Accessed bits preset: the GDT page is read-only, the CPU must never need to write it.
        0x0020_9B00_0000_0000, // 0x08 kernel code, 64-bit
        0x0000_9300_0000_0000, // 0x10 kernel data
        0x0000_F300_0000_0000, // 0x18 user data (DPL 3)
        0x0020_FB00_0000_0000, // 0x20 user code, 64-bit (DPL 3)
        tss_lo,                // 0x28 TSS (16 bytes)
        TSS_ADDR >> 32,
    ];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_u64(GDT_ADDR + 8 * i as u64, *e)?;
    }
    Ok(())
}

fn build_tss(mem: &mut GuestMemory) -> Result<()> {
    mem.slice_mut(TSS_ADDR, 0x68)?.fill(0);
    // RSP0: where the CPU pushes the frame of an exception taken at CPL 3.
    mem.write_u64(TSS_ADDR + 4, EXCEPTION_STACK_TOP)?;
    // I/O-bitmap base 0 (inside the TSS): on this host a base past the TSS
    // limit made the stub's own `out` fault. A user-mode `out` is therefore not
    // blocked by the CPU; the VMM rejects any exit whose RIP is not a stub's.
    Ok(())
}

fn build_stubs(mem: &mut GuestMemory) -> Result<()> {
    mem.slice_mut(STUBS_ADDR, PAGE_SIZE)?.fill(0xF4); // hlt everywhere else
    mem.write(SYSCALL_STUB_ADDR, &SYSCALL_STUB)?;
    for v in 0..EXCEPTION_VECTORS {
        let stub = [0xE6, (PORT_EXCEPTION_BASE + v) as u8, 0xF4, 0xEB, 0xFD];
        mem.write(EXC_STUBS_ADDR + EXC_STUB_LEN * v as u64, &stub)?;
    }
    Ok(())
}

fn build_idt(mem: &mut GuestMemory) -> Result<()> {
    mem.slice_mut(IDT_ADDR, 256 * 16)?.fill(0);
    for v in 0..EXCEPTION_VECTORS as u64 {
        let h = EXC_STUBS_ADDR + EXC_STUB_LEN * v;
        // 64-bit interrupt gate, DPL 0 (so user `int n` raises #GP), present, IST 0.
        let lo = (h & 0xFFFF) | ((super::KERNEL_CS as u64) << 16) | (0x8Eu64 << 40) | (((h >> 16) & 0xFFFF) << 48);
        mem.write_u64(IDT_ADDR + 16 * v, lo)?;
        mem.write_u64(IDT_ADDR + 16 * v + 8, h >> 32)?;
    }
    Ok(())
}

/// Vectors that push an error code.
pub fn has_error_code(vector: u16) -> bool {
    matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30)
}

pub fn exception_name(vector: u16) -> &'static str {
    match vector {
        0 => "divide error (#DE)",
        1 => "debug (#DB)",
        3 => "breakpoint (#BP)",
        4 => "overflow (#OF)",
        5 => "bound range (#BR)",
        6 => "invalid opcode (#UD)",
        7 => "device not available (#NM)",
        8 => "double fault (#DF)",
        10 => "invalid TSS (#TS)",
        11 => "segment not present (#NP)",
        12 => "stack fault (#SS)",
        13 => "general protection (#GP)",
        14 => "page fault (#PF)",
        16 => "x87 floating point (#MF)",
        17 => "alignment check (#AC)",
        18 => "machine check (#MC)",
        19 => "SIMD floating point (#XM)",
        _ => "exception",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idt_gates_point_at_their_stubs() {
        let mut m = GuestMemory::anonymous(4 << 20).unwrap();
        build(&mut m).unwrap();
        for v in 0..EXCEPTION_VECTORS as u64 {
            let lo = m.read_u64(IDT_ADDR + 16 * v).unwrap();
            let hi = m.read_u64(IDT_ADDR + 16 * v + 8).unwrap();
            let target = (lo & 0xFFFF) | (((lo >> 48) & 0xFFFF) << 16) | (hi << 32);
            assert_eq!(target, EXC_STUBS_ADDR + 16 * v);
            assert_eq!((lo >> 40) & 0xFF, 0x8E, "present DPL0 interrupt gate");
            let stub = m.slice(target, 2).unwrap();
            assert_eq!(stub, &[0xE6, (PORT_EXCEPTION_BASE as u64 + v) as u8]);
        }
        assert_eq!(m.read_u64(TSS_ADDR + 4).unwrap(), EXCEPTION_STACK_TOP);
        assert_eq!(m.slice(SYSCALL_STUB_ADDR, 4).unwrap(), &SYSCALL_STUB);
    }
}
