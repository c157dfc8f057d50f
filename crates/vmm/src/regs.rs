//! forkbox's own records of vCPU state: what a snapshot, a checkpoint or a
//! saved thread persists, with conversions from and to the kvm-bindings types
//! the ioctls take.
//!
//! These types are part of the persisted formats (the state file of
//! forkbox-snapshot, and any process state that embeds them): their fields
//! and field order ARE the format. Change them only together with the format
//! version of every file that holds them (the golden-file tests fail until
//! then). kvm-bindings' own types are never serialized: a dependency bump must
//! not change what is on disk.

use kvm_bindings::{kvm_dtable, kvm_regs, kvm_segment, kvm_sregs, kvm_xcrs, kvm_xsave};
use serde::{Deserialize, Serialize};

/// Size of the legacy XSAVE area KVM_GET_XSAVE / KVM_SET_XSAVE move.
pub const XSAVE_SIZE: usize = 4096;
/// Most XCRs KVM_SET_XCRS takes.
pub const MAX_XCRS: usize = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegsError {
    #[error("XSAVE area of {0} bytes (must be {XSAVE_SIZE})")]
    XsaveSize(usize),
    #[error("{0} XCRs (at most {MAX_XCRS})")]
    TooManyXcrs(usize),
}

/// General-purpose registers, RIP and RFLAGS (`struct kvm_regs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Regs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rsp: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rip: u64,
    pub rflags: u64,
}

/// The user state after the syscall the vCPU stopped at (`regs`, at the
/// syscall instruction's exit) returns `ret`: the result in RAX, RIP and
/// RFLAGS back from RCX and R11 where SYSCALL saved them (as SYSRET does).
pub fn after_syscall(regs: &kvm_regs, ret: u64) -> kvm_regs {
    let mut u = *regs;
    u.rax = ret;
    u.rip = regs.rcx;
    u.rflags = regs.r11;
    u
}

impl From<&kvm_regs> for Regs {
    fn from(r: &kvm_regs) -> Regs {
        Regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

impl From<&Regs> for kvm_regs {
    fn from(r: &Regs) -> kvm_regs {
        kvm_regs {
            rax: r.rax,
            rbx: r.rbx,
            rcx: r.rcx,
            rdx: r.rdx,
            rsi: r.rsi,
            rdi: r.rdi,
            rsp: r.rsp,
            rbp: r.rbp,
            r8: r.r8,
            r9: r.r9,
            r10: r.r10,
            r11: r.r11,
            r12: r.r12,
            r13: r.r13,
            r14: r.r14,
            r15: r.r15,
            rip: r.rip,
            rflags: r.rflags,
        }
    }
}

/// A segment register's hidden part (`struct kvm_segment`, without padding).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    pub type_: u8,
    pub present: u8,
    pub dpl: u8,
    pub db: u8,
    pub s: u8,
    pub l: u8,
    pub g: u8,
    pub avl: u8,
    pub unusable: u8,
}

impl From<&kvm_segment> for Segment {
    fn from(s: &kvm_segment) -> Segment {
        Segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
        }
    }
}

impl From<&Segment> for kvm_segment {
    fn from(s: &Segment) -> kvm_segment {
        kvm_segment {
            base: s.base,
            limit: s.limit,
            selector: s.selector,
            type_: s.type_,
            present: s.present,
            dpl: s.dpl,
            db: s.db,
            s: s.s,
            l: s.l,
            g: s.g,
            avl: s.avl,
            unusable: s.unusable,
            padding: 0,
        }
    }
}

/// GDTR / IDTR (`struct kvm_dtable`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DTable {
    pub base: u64,
    pub limit: u16,
}

impl From<&kvm_dtable> for DTable {
    fn from(d: &kvm_dtable) -> DTable {
        DTable { base: d.base, limit: d.limit }
    }
}

impl From<&DTable> for kvm_dtable {
    fn from(d: &DTable) -> kvm_dtable {
        kvm_dtable { base: d.base, limit: d.limit, padding: [0; 3] }
    }
}

/// Segment, descriptor-table and control registers (`struct kvm_sregs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sregs {
    pub cs: Segment,
    pub ds: Segment,
    pub es: Segment,
    pub fs: Segment,
    pub gs: Segment,
    pub ss: Segment,
    pub tr: Segment,
    pub ldt: Segment,
    pub gdt: DTable,
    pub idt: DTable,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub cr8: u64,
    pub efer: u64,
    pub apic_base: u64,
    pub interrupt_bitmap: [u64; 4],
}

impl From<&kvm_sregs> for Sregs {
    fn from(s: &kvm_sregs) -> Sregs {
        Sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: (&s.gdt).into(),
            idt: (&s.idt).into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

impl From<&Sregs> for kvm_sregs {
    fn from(s: &Sregs) -> kvm_sregs {
        kvm_sregs {
            cs: (&s.cs).into(),
            ds: (&s.ds).into(),
            es: (&s.es).into(),
            fs: (&s.fs).into(),
            gs: (&s.gs).into(),
            ss: (&s.ss).into(),
            tr: (&s.tr).into(),
            ldt: (&s.ldt).into(),
            gdt: (&s.gdt).into(),
            idt: (&s.idt).into(),
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            cr8: s.cr8,
            efer: s.efer,
            apic_base: s.apic_base,
            interrupt_bitmap: s.interrupt_bitmap,
        }
    }
}

/// One extended control register (XCR0 is the only one there is today).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xcr {
    pub index: u32,
    pub value: u64,
}

/// The XCRs KVM reported (`struct kvm_xcrs`: only its `nr_xcrs` used entries).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xcrs(pub Vec<Xcr>);

impl From<&kvm_xcrs> for Xcrs {
    fn from(x: &kvm_xcrs) -> Xcrs {
        let n = (x.nr_xcrs as usize).min(MAX_XCRS);
        Xcrs(x.xcrs[..n].iter().map(|e| Xcr { index: e.xcr, value: e.value }).collect())
    }
}

impl TryFrom<&Xcrs> for kvm_xcrs {
    type Error = RegsError;
    fn try_from(x: &Xcrs) -> Result<kvm_xcrs, RegsError> {
        if x.0.len() > MAX_XCRS {
            return Err(RegsError::TooManyXcrs(x.0.len()));
        }
        let mut out = kvm_xcrs { nr_xcrs: x.0.len() as u32, ..Default::default() };
        for (slot, e) in out.xcrs.iter_mut().zip(&x.0) {
            slot.xcr = e.index;
            slot.value = e.value;
        }
        Ok(out)
    }
}

impl Xcrs {
    /// XCR0 (the enabled XSAVE components), if recorded.
    pub fn xcr0(&self) -> Option<u64> {
        self.0.iter().find(|x| x.index == 0).map(|x| x.value)
    }
}

/// The 4 KiB legacy XSAVE area (x87, SSE, AVX, AVX-512 state), as the bytes
/// KVM_GET_XSAVE wrote (little-endian, the XSAVE layout of the CPU).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xsave {
    pub region: Vec<u8>,
}

impl std::fmt::Debug for Xsave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nonzero = self.region.iter().filter(|&&b| b != 0).count();
        write!(f, "Xsave({} bytes, {nonzero} non-zero)", self.region.len())
    }
}

impl Default for Xsave {
    fn default() -> Xsave {
        Xsave { region: vec![0; XSAVE_SIZE] }
    }
}

impl From<&kvm_xsave> for Xsave {
    fn from(x: &kvm_xsave) -> Xsave {
        let mut region = Vec::with_capacity(XSAVE_SIZE);
        for w in &x.region {
            region.extend_from_slice(&w.to_le_bytes());
        }
        Xsave { region }
    }
}

impl Xsave {
    /// Into the ioctl's struct, boxed (it is 4 KiB).
    pub fn to_kvm(&self) -> Result<Box<kvm_xsave>, RegsError> {
        if self.region.len() != XSAVE_SIZE {
            return Err(RegsError::XsaveSize(self.region.len()));
        }
        let mut out = Box::<kvm_xsave>::default();
        for (w, b) in out.region.iter_mut().zip(self.region.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(out)
    }
}

/// Everything of one vCPU a snapshot records (see `VcpuState` for the live form).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuRecord {
    pub regs: Regs,
    pub sregs: Sregs,
    pub xcrs: Xcrs,
    pub xsave: Xsave,
    pub fs_base: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct values in every field, so a swapped or dropped field shows.
    fn kvm_sample() -> (kvm_regs, kvm_sregs, kvm_xcrs, Box<kvm_xsave>) {
        let mut n = 0x1000u64;
        let mut next = || {
            n += 0x111;
            n
        };
        let regs = kvm_regs {
            rax: next(),
            rbx: next(),
            rcx: next(),
            rdx: next(),
            rsi: next(),
            rdi: next(),
            rsp: next(),
            rbp: next(),
            r8: next(),
            r9: next(),
            r10: next(),
            r11: next(),
            r12: next(),
            r13: next(),
            r14: next(),
            r15: next(),
            rip: next(),
            rflags: next(),
        };
        let mut seg = |sel: u16| kvm_segment {
            base: next(),
            limit: next() as u32,
            selector: sel,
            type_: 0xB,
            present: 1,
            dpl: 3,
            db: 0,
            s: 1,
            l: 1,
            g: 1,
            avl: 1,
            unusable: 0,
            padding: 0,
        };
        let (cs, ds, es, fs, gs, ss, tr, ldt) =
            (seg(0x2b), seg(0x33), seg(3), seg(4), seg(5), seg(6), seg(0x38), seg(0));
        let sregs = kvm_sregs {
            cs,
            ds,
            es,
            fs,
            gs,
            ss,
            tr,
            ldt,
            gdt: kvm_dtable { base: next(), limit: 55, padding: [0; 3] },
            idt: kvm_dtable { base: next(), limit: 4095, padding: [0; 3] },
            cr0: next(),
            cr2: next(),
            cr3: next(),
            cr4: next(),
            cr8: next(),
            efer: next(),
            apic_base: next(),
            interrupt_bitmap: [next(), next(), next(), next()],
        };
        let mut xcrs = kvm_xcrs { nr_xcrs: 1, ..Default::default() };
        xcrs.xcrs[0].value = 0xe7;
        let mut xsave = Box::<kvm_xsave>::default();
        for (i, w) in xsave.region.iter_mut().enumerate() {
            *w = (i as u32).wrapping_mul(0x9E37_79B9);
        }
        (regs, sregs, xcrs, xsave)
    }

    #[test]
    fn conversions_round_trip() {
        let (regs, sregs, xcrs, xsave) = kvm_sample();
        let r = Regs::from(&regs);
        assert_eq!(r.rip, regs.rip);
        assert_eq!(r.r11, regs.r11);
        assert_eq!(kvm_regs::from(&r), regs);
        let s = Sregs::from(&sregs);
        assert_eq!(s.cs.selector, 0x2b);
        assert_eq!(kvm_sregs::from(&s), sregs);
        let x = Xcrs::from(&xcrs);
        assert_eq!(x.xcr0(), Some(0xe7));
        let back = kvm_xcrs::try_from(&x).unwrap();
        assert_eq!((back.nr_xcrs, back.xcrs[0].xcr, back.xcrs[0].value), (1, 0, 0xe7));
        let xs = Xsave::from(&*xsave);
        assert_eq!(xs.region.len(), XSAVE_SIZE);
        assert_eq!(&xs.region[4..8], &1u32.wrapping_mul(0x9E37_79B9).to_le_bytes());
        assert_eq!(xs.to_kvm().unwrap().region, xsave.region);
    }

    #[test]
    fn malformed_records_are_refused() {
        assert_eq!(Xsave { region: vec![0; 100] }.to_kvm().unwrap_err(), RegsError::XsaveSize(100));
        let many = Xcrs(vec![Xcr::default(); MAX_XCRS + 1]);
        assert_eq!(kvm_xcrs::try_from(&many).unwrap_err(), RegsError::TooManyXcrs(MAX_XCRS + 1));
        // nr_xcrs from KVM is trusted only up to the array's size.
        let huge = kvm_xcrs { nr_xcrs: 1000, ..Default::default() };
        assert_eq!(Xcrs::from(&huge).0.len(), MAX_XCRS);
    }
}
