//! CPUID, XCR0, MSRs and the control/segment registers of a CPL-3 guest.

use kvm_bindings::{kvm_msr_entry, kvm_segment, kvm_sregs, kvm_xcrs, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd};

use super::{KERNEL_CS, KERNEL_SS, TSS_SEL, USER_CS, USER_SS};
use crate::error::{Result, VmmError};
use crate::layout::*;

pub const MSR_IA32_TSC: u32 = 0x10;
pub const MSR_STAR: u32 = 0xC000_0081;
pub const MSR_LSTAR: u32 = 0xC000_0082;
pub const MSR_SFMASK: u32 = 0xC000_0084;
pub const MSR_FS_BASE: u32 = 0xC000_0100;
pub const MSR_GS_BASE: u32 = 0xC000_0101;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_AM: u64 = 1 << 18;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const CR4_OSXSAVE: u64 = 1 << 18;
const CR4_SMEP: u64 = 1 << 20;
const CR4_SMAP: u64 = 1 << 21;
const EFER_SCE: u64 = 1;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const EFER_NXE: u64 = 1 << 11;

/// XSAVE components the guest may enable: x87, SSE, AVX, AVX-512 (opmask, ZMM hi256, hi16 ZMM).
/// Not PKRU (no protection keys) and not AMX (needs host permission).
const XCR0_ALLOWED: u64 = 0b1110_0111;

/// Process-wide KVM facts, gathered once: the /dev/kvm handle and the CPUID the guest gets.
pub struct Cpu {
    pub kvm: Kvm,
    pub cpuid: CpuId,
    pub xcr0: u64,
    pub smep: bool,
    pub smap: bool,
}

impl Cpu {
    pub fn new() -> Result<Cpu> {
        let kvm = Kvm::new().map_err(VmmError::OpenKvm)?;
        let mut cpuid =
            kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(VmmError::kvm("KVM_GET_SUPPORTED_CPUID"))?;
        let mut xcr0 = 0x3;
        let (mut smep, mut smap) = (false, false);
        for e in cpuid.as_mut_slice() {
            match (e.function, e.index) {
                (1, _) => {
                    e.ecx &= !(1 << 5); // VMX
                    e.ecx &= !(1 << 3); // MONITOR/MWAIT
                                        // Initial APIC ID: KVM reports the host CPU the ioctl ran on; the one vCPU is 0.
                    e.ebx &= 0x00FF_FFFF;
                }
                (0xB, _) | (0x1F, _) => e.edx = 0, // x2APIC ID, as above
                (7, 0) => {
                    smep = e.ebx & (1 << 7) != 0;
                    smap = e.ebx & (1 << 20) != 0;
                    e.ecx &= !((1 << 3) | (1 << 4)); // PKU, OSPKE
                    e.ecx &= !(1 << 5); // WAITPKG
                    e.edx &= !((1 << 22) | (1 << 24) | (1 << 25)); // AMX
                }
                (0xD, 0) => {
                    xcr0 = (e.eax as u64 | ((e.edx as u64) << 32)) & XCR0_ALLOWED;
                    e.eax &= XCR0_ALLOWED as u32;
                    e.edx = 0;
                }
                _ => {}
            }
        }
        Ok(Cpu { kvm, cpuid, xcr0, smep, smap })
    }

    /// Configure a new vCPU: CPUID, XCR0 (must follow CPUID), syscall MSRs.
    pub fn setup_vcpu(&self, vcpu: &VcpuFd) -> Result<()> {
        vcpu.set_cpuid2(&self.cpuid).map_err(VmmError::kvm("KVM_SET_CPUID2"))?;
        let mut xcrs = kvm_xcrs { nr_xcrs: 1, ..Default::default() };
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = self.xcr0;
        vcpu.set_xcrs(&xcrs).map_err(VmmError::kvm("KVM_SET_XCRS"))?;
        // STAR: syscall loads CS=0x08/SS=0x10; sysret's base 0x10 is unused (we return by iretq).
        let star = ((KERNEL_SS as u64) << 48) | ((KERNEL_CS as u64) << 32);
        // SFMASK: clear TF, IF, DF, AC and NT on entry.
        let sfmask = (1 << 8) | (1 << 9) | (1 << 10) | (1 << 18) | (1 << 14);
        set_msrs(vcpu, &[(MSR_STAR, star), (MSR_LSTAR, super::tables::SYSCALL_STUB_ADDR), (MSR_SFMASK, sfmask)])
    }

    /// Control registers, tables and user segments for a guest that starts at CPL 3.
    pub fn user_sregs(&self, mut s: kvm_sregs) -> kvm_sregs {
        s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_AM | CR0_PG;
        s.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT | CR4_OSXSAVE;
        if self.smep {
            s.cr4 |= CR4_SMEP;
        }
        if self.smap {
            s.cr4 |= CR4_SMAP;
        }
        s.cr3 = PML4_ADDR;
        s.efer = EFER_SCE | EFER_LME | EFER_LMA | EFER_NXE;
        s.gdt.base = GDT_ADDR;
        s.gdt.limit = 7 * 8 - 1;
        s.idt.base = IDT_ADDR;
        s.idt.limit = 256 * 16 - 1;
        s.cs = segment(USER_CS, 0xB, true);
        let data = segment(USER_SS, 0x3, false);
        s.ss = data;
        s.ds = data;
        s.es = data;
        s.fs = data;
        s.gs = data;
        s.tr =
            kvm_segment { base: TSS_ADDR, limit: 0x67, selector: TSS_SEL, type_: 11, present: 1, ..Default::default() };
        s
    }
}

fn segment(selector: u16, type_: u8, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_,
        present: 1,
        dpl: (selector & 3) as u8,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

pub fn set_msrs(vcpu: &VcpuFd, entries: &[(u32, u64)]) -> Result<()> {
    let list: Vec<kvm_msr_entry> =
        entries.iter().map(|&(index, data)| kvm_msr_entry { index, data, ..Default::default() }).collect();
    let msrs = Msrs::from_entries(&list).map_err(|_| VmmError::Sys {
        call: "KVM_SET_MSRS (too many entries)",
        source: std::io::Error::from_raw_os_error(libc::E2BIG),
    })?;
    let n = vcpu.set_msrs(&msrs).map_err(VmmError::kvm("KVM_SET_MSRS"))?;
    if n != list.len() {
        return Err(VmmError::Sys {
            call: "KVM_SET_MSRS (partial)",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    Ok(())
}

pub fn get_msr(vcpu: &VcpuFd, index: u32) -> Result<u64> {
    let mut msrs = Msrs::from_entries(&[kvm_msr_entry { index, ..Default::default() }])
        .map_err(|_| VmmError::Sys { call: "KVM_GET_MSRS", source: std::io::Error::from_raw_os_error(libc::EINVAL) })?;
    vcpu.get_msrs(&mut msrs).map_err(VmmError::kvm("KVM_GET_MSRS"))?;
    Ok(msrs.as_slice()[0].data)
}
