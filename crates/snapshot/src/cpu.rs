//! The CPU a snapshot was taken on, as the guest saw it: every CPUID leaf the
//! VMM gave the vCPU (KVM_SET_CPUID2) and the XCR0 it enabled.
//!
//! A warm guest has already chosen its code paths from these (glibc's and
//! numpy's AVX2/AVX-512 dispatch, XSAVE layout): resuming it where a feature
//! is missing would fault at some later instruction. So the fingerprint's
//! digest is part of the template id (a data directory moved to another CPU
//! builds a new template) and the full fingerprint is in every state file (a
//! checkpoint from another CPU is refused with `StateError::CpuMismatch`).

use forkbox_vmm::Cpu;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One CPUID leaf (`struct kvm_cpuid_entry2` without padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CpuidLeaf {
    pub function: u32,
    pub index: u32,
    pub flags: u32,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuFingerprint {
    pub xcr0: u64,
    /// Sorted by (function, index).
    pub leaves: Vec<CpuidLeaf>,
}

impl CpuFingerprint {
    /// What a guest on `cpu` sees.
    pub fn of(cpu: &Cpu) -> CpuFingerprint {
        let mut leaves: Vec<CpuidLeaf> = cpu
            .cpuid
            .as_slice()
            .iter()
            .map(|e| {
                let mut l = CpuidLeaf {
                    function: e.function,
                    index: e.index,
                    flags: e.flags,
                    eax: e.eax,
                    ebx: e.ebx,
                    ecx: e.ecx,
                    edx: e.edx,
                };
                // Which CPU a thread ran on is not a feature: KVM fills the
                // APIC ids in from it (forkbox-vmm zeroes them for the guest too).
                match l.function {
                    1 => l.ebx &= 0x00FF_FFFF,
                    0xB | 0x1F => l.edx = 0,
                    0x8000_001E => (l.eax, l.ebx, l.ecx) = (0, l.ebx & !0xFF, l.ecx & !0xFF),
                    _ => {}
                }
                l
            })
            .collect();
        leaves.sort();
        CpuFingerprint { xcr0: cpu.xcr0, leaves }
    }

    /// A short stable digest (hex), for template ids.
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"forkbox cpu v1");
        h.update(self.xcr0.to_le_bytes());
        h.update((self.leaves.len() as u64).to_le_bytes());
        for l in &self.leaves {
            for v in [l.function, l.index, l.flags, l.eax, l.ebx, l.ecx, l.edx] {
                h.update(v.to_le_bytes());
            }
        }
        hex::encode(&h.finalize()[..8])
    }

    /// What differs between `self` (the snapshot's) and `host` (at most a few
    /// items), or None if they are the same.
    pub fn differences(&self, host: &CpuFingerprint) -> Option<String> {
        let mut out = Vec::new();
        if self.xcr0 != host.xcr0 {
            out.push(format!("XCR0 {:#x} in the snapshot, {:#x} here", self.xcr0, host.xcr0));
        }
        let key = |l: &CpuidLeaf| (l.function, l.index);
        for l in &self.leaves {
            match host.leaves.iter().find(|h| key(h) == key(l)) {
                None => out.push(format!("CPUID {:#x}.{} missing here", l.function, l.index)),
                Some(h) if h != l => {
                    let regs =
                        [("eax", l.eax, h.eax), ("ebx", l.ebx, h.ebx), ("ecx", l.ecx, h.ecx), ("edx", l.edx, h.edx)];
                    for (name, a, b) in regs {
                        if a != b {
                            out.push(format!(
                                "CPUID {:#x}.{} {name} {a:#x} in the snapshot, {b:#x} here",
                                l.function, l.index
                            ));
                        }
                    }
                    if l.flags != h.flags {
                        out.push(format!("CPUID {:#x}.{} flags differ", l.function, l.index));
                    }
                }
                Some(_) => {}
            }
        }
        for h in &host.leaves {
            if !self.leaves.iter().any(|l| key(l) == key(h)) {
                out.push(format!("CPUID {:#x}.{} only here", h.function, h.index));
            }
        }
        if out.is_empty() {
            return None;
        }
        let more = out.len().saturating_sub(3);
        out.truncate(3);
        let mut s = out.join("; ");
        if more > 0 {
            s.push_str(&format!("; and {more} more"));
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CpuFingerprint {
        let leaf = |function, index, ebx| CpuidLeaf { function, index, flags: 0, eax: 1, ebx, ecx: 2, edx: 3 };
        CpuFingerprint { xcr0: 0xe7, leaves: vec![leaf(0, 0, 0x756e_6547), leaf(7, 0, 0xd19f_4fbb)] }
    }

    #[test]
    fn digest_and_differences() {
        let a = sample();
        assert_eq!(a.digest(), sample().digest());
        assert_eq!(a.differences(&sample()), None);
        let mut b = sample();
        b.xcr0 = 0x7;
        b.leaves[1].ebx &= !(1 << 16); // no AVX-512F
        assert_ne!(a.digest(), b.digest());
        let d = a.differences(&b).unwrap();
        assert!(d.contains("XCR0 0xe7 in the snapshot, 0x7 here"), "{d}");
        assert!(d.contains("CPUID 0x7.0 ebx 0xd19f4fbb in the snapshot, 0xd19e4fbb here"), "{d}");
        b.leaves.pop();
        assert!(a.differences(&b).unwrap().contains("CPUID 0x7.0 missing here"));
    }
}
