//! The guest vDSO and its data page ("vvar").
//!
//! glibc's `clock_gettime`, `gettimeofday`, `time`, `clock_getres` and
//! `getcpu` call into a vDSO when the auxiliary vector carries
//! `AT_SYSINFO_EHDR`. Ours (guest/vdso, built by build.rs) computes the time
//! from `rdtsc` and a page of host clock samples the VMM writes, so those
//! calls take no VM exit. Clocks it does not handle (CPU-time clocks, bad
//! ids) and a page with `enabled == 0` fall back to the real `syscall`
//! (`clock_gettime` 228 / `clock_getres` 229 only).
//!
//! Guest layout (identity mapped):
//! - [`VVAR_ADDR`]: one page, user read-only + no-execute; [`VvarData`] at
//!   offset 0, the rest zero. Written by the VMM only while the vCPU is stopped.
//! - [`VDSO_ADDR`]: [`IMAGE`] copied verbatim (file offset 0 at `VDSO_ADDR`),
//!   user read + execute, at most [`VDSO_MAX_LEN`] bytes.
//!
//! The VMM passes `AT_SYSINFO_EHDR = VDSO_ADDR` in the auxiliary vector.
//! The vDSO is position independent and has no relocations; glibc binds it
//! in place from the ELF header it finds there.
//!
//! Wiring (see `VvarData::sample`): write a fresh sample at VM creation and
//! restore (the guest TSC of a new VM is unrelated to the old one), and
//! whenever the vCPU resumes after being parked for long, from
//! `KVM_GET_MSRS(MSR_IA32_TSC)` and `KVM_GET_TSC_KHZ`. Between samples the
//! guest extrapolates with the TSC, so drift is the TSC-frequency error
//! (kHz resolution: < 1 ppm at GHz rates).

use std::mem::{offset_of, size_of};

use crate::layout::{PAGE_SIZE, VDSO_PAGE, VDSO_PAGES, VVAR_PAGE};

/// Guest address of the vvar page (see `layout`; guest/vdso/vvar.h has the same).
pub const VVAR_ADDR: u64 = VVAR_PAGE;
/// Size of the vvar page.
pub const VVAR_LEN: usize = PAGE_SIZE as usize;
/// Guest address the vDSO image is copied to (file offset 0 lands here).
pub const VDSO_ADDR: u64 = VDSO_PAGE;
/// Space reserved for the vDSO image in the guest.
pub const VDSO_MAX_LEN: usize = (VDSO_PAGES * PAGE_SIZE) as usize;

const IMAGE_BYTES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/vdso.so"));
const _: () = assert!(IMAGE_BYTES.len() <= VDSO_MAX_LEN, "vDSO image too large");
const _: () = assert!(VVAR_ADDR + VVAR_LEN as u64 == VDSO_ADDR);

/// The vDSO image (an ELF shared object linked at 0, soname linux-vdso.so.1).
pub static IMAGE: &[u8] = IMAGE_BYTES;

/// The vvar page contents, mirroring `struct forkbox_vvar` in
/// guest/vdso/vvar.h (same fields, same offsets, no padding).
///
/// The guest computes, with a 128-bit product,
/// `ns = ((tsc_now - tsc_base) * mult) >> shift` (0 if `tsc_now < tsc_base`)
/// and returns `mono_ns + ns` / `real_ns + ns` / `boot_ns + ns`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VvarData {
    /// Reserved (the guest does not read it). `sample` writes 0;
    /// `sample_after` advances it by 2 per refresh, as a generation counter.
    pub seq: u64,
    /// Guest TSC at the sampling instant.
    pub tsc_base: u64,
    /// Host CLOCK_MONOTONIC at that instant, ns.
    pub mono_ns: u64,
    /// Host CLOCK_REALTIME at that instant, ns since the epoch.
    pub real_ns: u64,
    /// Host CLOCK_BOOTTIME at that instant, ns.
    pub boot_ns: u64,
    /// ns per TSC tick, as a fixed-point number with `shift` fraction bits.
    pub mult: u64,
    pub shift: u32,
    /// 0: the guest always uses the real syscall.
    pub enabled: u32,
}

// Pin the layout shared with guest/vdso/vvar.h (which has the same asserts).
const _: () = {
    assert!(offset_of!(VvarData, seq) == 0);
    assert!(offset_of!(VvarData, tsc_base) == 8);
    assert!(offset_of!(VvarData, mono_ns) == 16);
    assert!(offset_of!(VvarData, real_ns) == 24);
    assert!(offset_of!(VvarData, boot_ns) == 32);
    assert!(offset_of!(VvarData, mult) == 40);
    assert!(offset_of!(VvarData, shift) == 48);
    assert!(offset_of!(VvarData, enabled) == 52);
    assert!(size_of::<VvarData>() == 56);
    assert!(size_of::<VvarData>() <= VVAR_LEN);
};

fn host_clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    let r = unsafe { libc::clock_gettime(clock, &mut ts) };
    if r != 0 || ts.tv_sec < 0 || !(0..1_000_000_000).contains(&ts.tv_nsec) {
        return None;
    }
    (ts.tv_sec as u64).checked_mul(1_000_000_000)?.checked_add(ts.tv_nsec as u64)
}

impl VvarData {
    /// A disabled page: the guest falls back to the syscall for everything.
    pub const DISABLED: VvarData =
        VvarData { seq: 0, tsc_base: 0, mono_ns: 0, real_ns: 0, boot_ns: 0, mult: 0, shift: 0, enabled: 0 };

    /// `(mult, shift)` for a TSC of `tsc_khz` kHz: ns per tick (1e6 / kHz)
    /// as a fixed-point number with the largest `shift` that keeps `mult`
    /// below 2^63 (so the conversion adds < 1e-18 relative error; the
    /// guest's 128-bit product cannot overflow). `(0, 0)` for `tsc_khz == 0`.
    pub fn mult_shift_for_khz(tsc_khz: u32) -> (u64, u32) {
        if tsc_khz == 0 {
            return (0, 0);
        }
        let khz = u128::from(tsc_khz);
        let mult_at = |shift: u32| ((1_000_000u128 << shift) + khz / 2) / khz;
        // 1e6 < 2^20 and kHz < 2^32: shift stays below 76, no u128 overflow.
        let mut shift = 0;
        while mult_at(shift + 1) < 1u128 << 63 {
            shift += 1;
        }
        (mult_at(shift) as u64, shift)
    }

    /// Samples the host clocks now and pairs them with `guest_tsc_now`, the
    /// guest's TSC read (KVM_GET_MSRS on MSR_IA32_TSC) just before; `tsc_khz`
    /// from KVM_GET_TSC_KHZ. A zero `tsc_khz` or unreadable host clock gives
    /// a disabled page.
    pub fn sample(guest_tsc_now: u64, tsc_khz: u32) -> VvarData {
        let mono = host_clock_ns(libc::CLOCK_MONOTONIC);
        let real = host_clock_ns(libc::CLOCK_REALTIME);
        let boot = host_clock_ns(libc::CLOCK_BOOTTIME);
        match (mono, real, boot) {
            (Some(mono_ns), Some(real_ns), Some(boot_ns)) if tsc_khz != 0 => {
                let (mult, shift) = Self::mult_shift_for_khz(tsc_khz);
                VvarData { seq: 0, tsc_base: guest_tsc_now, mono_ns, real_ns, boot_ns, mult, shift, enabled: 1 }
            }
            _ => Self::DISABLED,
        }
    }

    /// Like [`sample`](Self::sample), for refreshing a page the guest has
    /// already been reading: CLOCK_MONOTONIC and CLOCK_BOOTTIME never step
    /// back below what `prev` extrapolates to at `guest_tsc_now` (the TSC
    /// rate can be a little off the host clock's). The clamp applies only
    /// when the guest TSC is continuous with `prev` (not after a restore into
    /// a VM whose TSC restarted). `seq` advances by 2.
    pub fn sample_after(prev: &VvarData, guest_tsc_now: u64, tsc_khz: u32) -> VvarData {
        let mut next = Self::sample(guest_tsc_now, tsc_khz);
        next.seq = prev.seq.wrapping_add(2);
        if prev.enabled != 0 && next.enabled != 0 && guest_tsc_now >= prev.tsc_base {
            let (mono, _, boot) = prev.clocks_at(guest_tsc_now);
            next.mono_ns = next.mono_ns.max(mono);
            next.boot_ns = next.boot_ns.max(boot);
        }
        next
    }

    /// Nanoseconds elapsed since the sample at guest TSC `tsc`, exactly as
    /// the guest computes it.
    pub fn ns_since_base(&self, tsc: u64) -> u64 {
        let delta = tsc.wrapping_sub(self.tsc_base);
        let delta = if (delta as i64) < 0 { 0 } else { delta };
        ((u128::from(delta) * u128::from(self.mult)) >> (self.shift & 127)) as u64
    }

    /// (CLOCK_MONOTONIC, CLOCK_REALTIME, CLOCK_BOOTTIME) in ns as the guest
    /// would read them at guest TSC `tsc`.
    pub fn clocks_at(&self, tsc: u64) -> (u64, u64, u64) {
        let ns = self.ns_since_base(tsc);
        (self.mono_ns.wrapping_add(ns), self.real_ns.wrapping_add(ns), self.boot_ns.wrapping_add(ns))
    }

    /// The bytes to write at [`VVAR_ADDR`] (the rest of the page stays zero).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: VvarData is repr(C), all-integer, with no padding (the
        // const asserts above pin 56 bytes of fields in 56 bytes of size).
        unsafe { std::slice::from_raw_parts((self as *const VvarData).cast::<u8>(), size_of::<VvarData>()) }
    }
}

#[cfg(test)]
// SAFETY (every unsafe block below): the test's own mappings of the built vDSO
// and vvar page, its entry points called with their C signatures on stack
// buffers, and host clock calls on stack timespecs.
#[allow(clippy::undocumented_unsafe_blocks)]
mod tests {
    use super::*;
    use goblin::elf::dynamic::{
        DT_GNU_HASH, DT_HASH, DT_JMPREL, DT_NEEDED, DT_PLTRELSZ, DT_REL, DT_RELA, DT_RELASZ, DT_RELSZ, DT_SONAME,
        DT_TEXTREL, DT_VERDEF, DT_VERSYM,
    };
    use goblin::elf::header::ET_DYN;
    use goblin::elf::program_header::{PF_R, PF_W, PF_X, PT_DYNAMIC, PT_INTERP, PT_LOAD, PT_TLS};
    use goblin::elf::sym::{STB_GLOBAL, STB_WEAK, STT_FUNC};
    use goblin::elf::Elf;
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    const EXPORTS: [&str; 5] = ["clock_gettime", "gettimeofday", "time", "clock_getres", "getcpu"];

    fn elf() -> Elf<'static> {
        Elf::parse(IMAGE).expect("vDSO image parses as ELF")
    }

    fn dyn_val(elf: &Elf, tag: u64) -> Option<u64> {
        elf.dynamic.as_ref()?.dyns.iter().find(|d| d.d_tag == tag).map(|d| d.d_val)
    }

    /// The SysV ELF hash, as used for version names in Verdef.vd_hash.
    fn elf_hash(name: &[u8]) -> u32 {
        let mut h: u32 = 0;
        for &c in name {
            h = (h << 4).wrapping_add(u32::from(c));
            let g = h & 0xf000_0000;
            if g != 0 {
                h ^= g >> 24;
            }
            h &= !g;
        }
        h
    }

    fn rd32(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn rd64(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }
    fn cstr(b: &[u8], off: usize) -> &[u8] {
        let end = b[off..].iter().position(|&c| c == 0).unwrap();
        &b[off..off + end]
    }

    /// Looks `name`@`version` up the way ld.so does for a vDSO: through
    /// DT_GNU_HASH in the in-memory image, then checks the symbol's version
    /// against DT_VERDEF by hash and name. Works on raw bytes (address ==
    /// file offset, checked by the layout test). Returns the symbol value.
    fn glibc_style_lookup(image: &[u8], name: &str, version: &str) -> Option<u64> {
        let elf = Elf::parse(image).unwrap();
        let gnu_hash = dyn_val(&elf, DT_GNU_HASH)? as usize;
        let symtab = dyn_val(&elf, goblin::elf::dynamic::DT_SYMTAB)? as usize;
        let strtab = dyn_val(&elf, goblin::elf::dynamic::DT_STRTAB)? as usize;
        let versym = dyn_val(&elf, DT_VERSYM)? as usize;
        let verdef = dyn_val(&elf, DT_VERDEF)? as usize;

        let h = name.bytes().fold(5381u32, |h, c| h.wrapping_mul(33).wrapping_add(u32::from(c)));
        let nbuckets = rd32(image, gnu_hash) as usize;
        let symoffset = rd32(image, gnu_hash + 4) as usize;
        let bloom_size = rd32(image, gnu_hash + 8) as usize;
        let bloom_shift = rd32(image, gnu_hash + 12);
        let bloom = gnu_hash + 16;
        let word = rd64(image, bloom + 8 * ((h as usize / 64) % bloom_size));
        let mask = (1u64 << (h % 64)) | (1u64 << ((h >> bloom_shift) % 64));
        if word & mask != mask {
            return None;
        }
        let buckets = bloom + 8 * bloom_size;
        let chains = buckets + 4 * nbuckets;
        let mut idx = rd32(image, buckets + 4 * (h as usize % nbuckets)) as usize;
        if idx == 0 {
            return None;
        }
        let found = loop {
            let ch = rd32(image, chains + 4 * (idx - symoffset));
            if (ch | 1) == (h | 1) {
                let sym = symtab + 24 * idx;
                let st_name = rd32(image, sym) as usize;
                if cstr(image, strtab + st_name) == name.as_bytes() {
                    break idx;
                }
            }
            if ch & 1 != 0 {
                return None;
            }
            idx += 1;
        };

        // Version check: versym index -> Verdef with that vd_ndx.
        let ndx = u16::from_le_bytes(image[versym + 2 * found..versym + 2 * found + 2].try_into().unwrap()) & 0x7fff;
        let mut vd = verdef;
        loop {
            let vd_ndx = u16::from_le_bytes(image[vd + 4..vd + 6].try_into().unwrap());
            let vd_hash = rd32(image, vd + 8);
            let vd_aux = rd32(image, vd + 12) as usize;
            let vd_next = rd32(image, vd + 16) as usize;
            if vd_ndx == ndx {
                let vda_name = rd32(image, vd + vd_aux) as usize;
                if vd_hash != elf_hash(version.as_bytes()) || cstr(image, strtab + vda_name) != version.as_bytes() {
                    return None;
                }
                break;
            }
            if vd_next == 0 {
                return None;
            }
            vd += vd_next;
        }
        let sym = symtab + 24 * found;
        let st_shndx = u16::from_le_bytes(image[sym + 6..sym + 8].try_into().unwrap());
        if st_shndx == 0 {
            return None;
        }
        Some(rd64(image, sym + 8))
    }

    #[test]
    fn vdso_image_layout() {
        assert!(IMAGE.len() <= VDSO_MAX_LEN, "image is {} bytes", IMAGE.len());
        let elf = elf();
        assert!(elf.is_64 && elf.little_endian);
        assert_eq!(elf.header.e_type, ET_DYN);
        assert_eq!(elf.header.e_machine, goblin::elf::header::EM_X86_64);

        // Exactly one PT_LOAD: R+X, from file offset 0 at address 0, no bss.
        let loads: Vec<_> = elf.program_headers.iter().filter(|p| p.p_type == PT_LOAD).collect();
        assert_eq!(loads.len(), 1, "want exactly one PT_LOAD: {:?}", elf.program_headers);
        let load = loads[0];
        assert_eq!(load.p_offset, 0);
        assert_eq!(load.p_vaddr, 0, "linked at 0");
        assert_eq!(load.p_flags, PF_R | PF_X);
        assert_eq!(load.p_filesz, load.p_memsz, "no bss");
        assert!(load.p_filesz as usize <= IMAGE.len());
        assert!(elf.program_headers.iter().all(|p| p.p_type != PT_INTERP && p.p_type != PT_TLS));

        // PT_DYNAMIC inside it, read-only.
        let dynamic: Vec<_> = elf.program_headers.iter().filter(|p| p.p_type == PT_DYNAMIC).collect();
        assert_eq!(dynamic.len(), 1);
        let d = dynamic[0];
        assert_eq!(d.p_offset, d.p_vaddr, "address == file offset");
        assert!(d.p_vaddr >= load.p_vaddr && d.p_vaddr + d.p_memsz <= load.p_vaddr + load.p_filesz);
        assert_eq!(d.p_flags & PF_W, 0, "PT_DYNAMIC must not be writable");

        // Dynamic tags.
        assert!(dyn_val(&elf, DT_GNU_HASH).is_some(), "DT_GNU_HASH");
        assert!(dyn_val(&elf, DT_HASH).is_some(), "DT_HASH");
        assert!(dyn_val(&elf, DT_VERSYM).is_some(), "DT_VERSYM");
        assert!(dyn_val(&elf, DT_VERDEF).is_some(), "DT_VERDEF");
        assert_eq!(elf.soname, Some("linux-vdso.so.1"));
        assert!(dyn_val(&elf, DT_SONAME).is_some());
        assert!(dyn_val(&elf, DT_NEEDED).is_none(), "no dependencies");
        assert!(dyn_val(&elf, DT_TEXTREL).is_none());
        for (tag, size_tag) in [(DT_RELA, DT_RELASZ), (DT_REL, DT_RELSZ), (DT_JMPREL, DT_PLTRELSZ)] {
            assert!(
                dyn_val(&elf, tag).is_none() || dyn_val(&elf, size_tag) == Some(0),
                "relocation tag {tag:#x} present"
            );
        }
        assert!(elf.dynrelas.is_empty() && elf.dynrels.is_empty() && elf.pltrelocs.is_empty());

        // Version definition LINUX_2.6.
        let verdef = elf.verdef.as_ref().expect("version definitions");
        let mut names: Vec<&str> = Vec::new();
        for vd in verdef.iter() {
            for aux in vd.iter() {
                names.push(elf.dynstrtab.get_at(aux.vda_name).unwrap_or("?"));
            }
        }
        assert!(names.contains(&"LINUX_2.6"), "version names: {names:?}");

        // Exports: __vdso_* global and plain names weak, functions, defined
        // inside the segment, both versioned LINUX_2.6 and found the way
        // ld.so finds them.
        for base in EXPORTS {
            let vdso_name = format!("__vdso_{base}");
            for (name, bind) in [(vdso_name.as_str(), STB_GLOBAL), (base, STB_WEAK)] {
                let sym = elf
                    .dynsyms
                    .iter()
                    .find(|s| elf.dynstrtab.get_at(s.st_name) == Some(name))
                    .unwrap_or_else(|| panic!("{name} not exported"));
                assert_eq!(sym.st_type(), STT_FUNC, "{name}");
                assert_eq!(sym.st_bind(), bind, "{name}");
                assert_ne!(sym.st_shndx, 0, "{name} undefined");
                assert!(sym.st_value > 0 && sym.st_value < load.p_filesz, "{name}");
                assert_eq!(glibc_style_lookup(IMAGE, name, "LINUX_2.6"), Some(sym.st_value), "{name}");
            }
        }
        assert_eq!(glibc_style_lookup(IMAGE, "__vdso_nonexistent", "LINUX_2.6"), None);
    }

    #[test]
    fn vdso_vvar_bytes_match_c_layout() {
        let v = VvarData {
            seq: 0x0101010101010101,
            tsc_base: 0x0202020202020202,
            mono_ns: 0x0303030303030303,
            real_ns: 0x0404040404040404,
            boot_ns: 0x0505050505050505,
            mult: 0x0606060606060606,
            shift: 0x07070707,
            enabled: 0x08080808,
        };
        let b = v.as_bytes();
        assert_eq!(b.len(), 56);
        for (i, chunk) in b[..48].chunks(8).enumerate() {
            assert!(chunk.iter().all(|&x| x == i as u8 + 1), "u64 field {i}");
        }
        assert_eq!(&b[48..52], &[7; 4]);
        assert_eq!(&b[52..56], &[8; 4]);
    }

    #[test]
    fn vdso_vvar_arithmetic() {
        assert_eq!(VvarData::mult_shift_for_khz(0), (0, 0));
        assert!(VvarData::sample(0, 0).enabled == 0);

        let khz = 1_996_249; // this host's TSC
        let v = VvarData::sample(1_000, khz);
        assert_eq!(v.enabled, 1);
        assert_eq!((v.mult, v.shift), VvarData::mult_shift_for_khz(khz));
        assert!(v.mult < 1 << 63 && v.mult >= 1 << 62, "mult uses 63 bits");
        assert_eq!(v.ns_since_base(1_000), 0);
        assert_eq!(v.ns_since_base(999), 0, "TSC behind the sample clamps to 0");
        let one_s = u64::from(khz) * 1000;
        assert!(v.ns_since_base(1_000 + one_s).abs_diff(1_000_000_000) <= 1);
        // A year of ticks: the 128-bit product keeps it exact to a few ns.
        let year_ns: u64 = 365 * 86_400 * 1_000_000_000;
        let year_ticks = u64::from(khz) * 1000 * 365 * 86_400;
        assert!(v.ns_since_base(1_000 + year_ticks).abs_diff(year_ns) <= 2);
        for khz in [1u32, 1_000, 3_000_000, u32::MAX] {
            let v = VvarData::sample(0, khz);
            let ticks = u64::from(khz) * 1000; // one second
            assert!(v.ns_since_base(ticks).abs_diff(1_000_000_000) <= 1, "khz {khz}");
        }

        // sample_after never steps monotonic time back while the TSC is continuous.
        let mut prev = VvarData::sample(0, khz);
        prev.mono_ns += 10_000_000_000; // pretend the guest ran 10 s ahead
        prev.boot_ns += 10_000_000_000;
        let next = VvarData::sample_after(&prev, one_s, khz);
        assert_eq!(next.seq, prev.seq + 2);
        assert!(next.mono_ns >= prev.clocks_at(one_s).0);
        assert!(next.boot_ns >= prev.clocks_at(one_s).2);
        // ... but not across a TSC restart (restore into a fresh VM).
        let mut prev = VvarData::sample(u64::MAX / 2, khz);
        prev.mono_ns += 10_000_000_000;
        let next = VvarData::sample_after(&prev, 5, khz);
        assert!(next.mono_ns < prev.mono_ns);
    }

    // ---- glibc binds the image ----------------------------------------------

    /// Runs a small glibc program under guest/vdso/tools/uexec.c, which
    /// starts the host's ld.so by hand with AT_SYSINFO_EHDR pointing at
    /// IMAGE (mapped at VDSO_ADDR, vvar at VVAR_ADDR), as the VMM does. The
    /// vvar page shifts CLOCK_MONOTONIC by 1e6 s, so the probe's output proves
    /// glibc's clock_gettime went through this vDSO (the glibc this project
    /// targets is the host's: Debian bookworm, 2.36).
    #[test]
    fn vdso_glibc_binds_image() {
        const OFFSET_S: i128 = 1_000_000;
        let tools = concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest/vdso/tools");
        let dir = std::env::temp_dir().join(format!("forkbox-vdso-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let image = dir.join("vdso.so");
        std::fs::write(&image, IMAGE).unwrap();
        let cc = std::env::var("FORKBOX_VDSO_CC").unwrap_or_else(|_| "cc".into());
        for (src, out) in [("uexec.c", "uexec"), ("clockprobe.c", "clockprobe")] {
            let status = std::process::Command::new(&cc)
                .args(["-O2", "-o"])
                .arg(dir.join(out))
                .arg(format!("{tools}/{src}"))
                .status()
                .unwrap_or_else(|e| panic!("cannot run C compiler `{cc}`: {e}"));
            assert!(status.success(), "compiling {src} failed");
        }
        assert!(
            std::path::Path::new("/lib64/ld-linux-x86-64.so.2").exists(),
            "this test needs the host's glibc ld.so at /lib64/ld-linux-x86-64.so.2"
        );

        let before = (host_ns(libc::CLOCK_MONOTONIC), host_ns(libc::CLOCK_REALTIME));
        let out = std::process::Command::new(dir.join("uexec"))
            .arg(&image)
            .arg(OFFSET_S.to_string())
            .arg(dir.join("clockprobe"))
            .output()
            .unwrap();
        let after = (host_ns(libc::CLOCK_MONOTONIC), host_ns(libc::CLOCK_REALTIME));
        let _ = std::fs::remove_dir_all(&dir);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "uexec failed: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let get = |key: &str| -> i128 {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .unwrap_or_else(|| panic!("{key} missing from probe output:\n{stdout}"))
                .parse()
                .unwrap()
        };
        let within = |v: i128, (lo, hi): (i128, i128), what: &str| {
            assert!(
                v >= lo - TOLERANCE_NS && v <= hi + TOLERANCE_NS,
                "{what} = {v} not within [{lo}, {hi}]: glibc did not use the vDSO?\n{stdout}"
            );
        };
        within(get("monotonic_ns") - OFFSET_S * 1_000_000_000, (before.0, after.0), "monotonic - offset");
        within(get("realtime_ns"), (before.1, after.1), "realtime");
        within(get("gettimeofday_us") * 1000, (before.1, after.1), "gettimeofday");
        let time_s = get("time_s");
        assert!(time_s >= before.1 / 1_000_000_000 && time_s <= after.1 / 1_000_000_000, "time {time_s}");
        assert_eq!(get("getres_ns"), 1, "clock_getres from the vDSO");
        assert!(get("cputime_ns") > 0, "CPU-time clock via the syscall fallback");
    }

    // ---- Running the vDSO on the host -------------------------------------

    type ClockGettime = unsafe extern "C" fn(libc::clockid_t, *mut libc::timespec) -> libc::c_int;
    type Gettimeofday = unsafe extern "C" fn(*mut libc::timeval, *mut Timezone) -> libc::c_int;

    /// `struct timezone` (opaque in the libc crate).
    #[repr(C)]
    struct Timezone {
        tz_minuteswest: libc::c_int,
        tz_dsttime: libc::c_int,
    }
    type Time = unsafe extern "C" fn(*mut libc::time_t) -> libc::time_t;
    type Getcpu = unsafe extern "C" fn(*mut libc::c_uint, *mut libc::c_uint, *mut libc::c_void) -> libc::c_long;

    /// The host vvar page at the fixed address, mapped once per process and
    /// shared by the tests under a lock.
    fn vvar_page() -> std::sync::MutexGuard<'static, usize> {
        static PAGE: OnceLock<Mutex<usize>> = OnceLock::new();
        PAGE.get_or_init(|| {
            // SAFETY: a fresh anonymous mapping at an address we check is free.
            let p = unsafe {
                libc::mmap(
                    VVAR_ADDR as *mut libc::c_void,
                    VVAR_LEN,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                panic!(
                    "cannot map the vvar page at its fixed address {VVAR_ADDR:#x} in the test process: {} \
                     (something else is mapped there; the vDSO reads its data from this absolute address)",
                    std::io::Error::last_os_error()
                );
            }
            // Kernels before 4.17 ignore MAP_FIXED_NOREPLACE and may place it elsewhere.
            assert_eq!(p as u64, VVAR_ADDR, "vvar page mapped at {p:?}, not {VVAR_ADDR:#x}");
            Mutex::new(p as usize)
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
    }

    fn write_vvar(page: usize, v: &VvarData) {
        let bytes = v.as_bytes();
        // SAFETY: `page` is our RW mapping of VVAR_LEN bytes, held under the lock.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), page as *mut u8, bytes.len()) };
    }

    /// The vDSO image in an anonymous R+X mapping at an arbitrary address.
    struct Loaded {
        base: *mut libc::c_void,
        len: usize,
    }

    impl Loaded {
        fn new() -> Loaded {
            let len = IMAGE.len().div_ceil(4096) * 4096;
            // SAFETY: fresh anonymous mapping; we copy in and then drop write.
            unsafe {
                let base = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(base, libc::MAP_FAILED);
                std::ptr::copy_nonoverlapping(IMAGE.as_ptr(), base.cast::<u8>(), IMAGE.len());
                assert_eq!(libc::mprotect(base, len, libc::PROT_READ | libc::PROT_EXEC), 0);
                Loaded { base, len }
            }
        }

        fn sym(&self, name: &str) -> usize {
            let off = glibc_style_lookup(IMAGE, name, "LINUX_2.6").unwrap_or_else(|| panic!("{name} not found"));
            // Cross-check against goblin's view of the dynamic symbol table.
            let elf = elf();
            let sym = elf.dynsyms.iter().find(|s| elf.dynstrtab.get_at(s.st_name) == Some(name)).unwrap();
            assert_eq!(sym.st_value, off);
            self.base as usize + off as usize
        }
    }

    impl Drop for Loaded {
        fn drop(&mut self) {
            // SAFETY: our own mapping; no function pointer into it outlives self.
            unsafe { libc::munmap(self.base, self.len) };
        }
    }

    fn host_ns(clock: libc::clockid_t) -> i128 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
        i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
    }

    fn rdtsc() -> u64 {
        // SAFETY: rdtsc is available on every x86_64 CPU this runs on.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    /// The host TSC rate in kHz, calibrated against CLOCK_MONOTONIC over ~20 ms.
    fn calibrate_tsc_khz() -> u32 {
        let (t0, c0) = (host_ns(libc::CLOCK_MONOTONIC), rdtsc());
        std::thread::sleep(Duration::from_millis(20));
        let (t1, c1) = (host_ns(libc::CLOCK_MONOTONIC), rdtsc());
        let khz = (u128::from(c1 - c0) * 1_000_000 / (t1 - t0) as u128) as u32;
        assert!(khz > 100_000, "implausible TSC rate {khz} kHz");
        khz
    }

    fn call_clock(f: ClockGettime, clock: libc::clockid_t) -> (libc::c_int, i128) {
        let mut ts = libc::timespec { tv_sec: -1, tv_nsec: -1 };
        // SAFETY: the vDSO writes one timespec.
        let r = unsafe { f(clock, &mut ts) };
        (r, i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec))
    }

    const TOLERANCE_NS: i128 = 2_000_000;

    /// Compares the vDSO's clocks with the host's. `via_syscall`: the page is
    /// disabled, so the host kernel answers (its _COARSE clocks lag by up to
    /// a tick, its MONOTONIC_RAW is its own clock); the vDSO itself serves
    /// _COARSE precisely and MONOTONIC_RAW from the MONOTONIC base.
    fn check_clocks_agree(f: ClockGettime, round: u32, via_syscall: bool) {
        let coarse_lag_ns = if via_syscall { 20_000_000 } else { 0 };
        for (clock, host_clock, name, lag) in [
            (libc::CLOCK_MONOTONIC, libc::CLOCK_MONOTONIC, "MONOTONIC", 0),
            (libc::CLOCK_REALTIME, libc::CLOCK_REALTIME, "REALTIME", 0),
            (libc::CLOCK_BOOTTIME, libc::CLOCK_BOOTTIME, "BOOTTIME", 0),
            (libc::CLOCK_MONOTONIC_COARSE, libc::CLOCK_MONOTONIC, "MONOTONIC_COARSE", coarse_lag_ns),
            (libc::CLOCK_REALTIME_COARSE, libc::CLOCK_REALTIME, "REALTIME_COARSE", coarse_lag_ns),
        ] {
            let before = host_ns(host_clock);
            let (r, got) = call_clock(f, clock);
            let after = host_ns(host_clock);
            assert_eq!(r, 0, "{name}");
            assert!(
                got >= before - TOLERANCE_NS - lag && got <= after + TOLERANCE_NS,
                "round {round}: vDSO {name} = {got}, host between {before} and {after} (off by {} ns)",
                if got < before { got - before } else { got - after }
            );
        }
        let (r, raw) = call_clock(f, libc::CLOCK_MONOTONIC_RAW);
        assert_eq!(r, 0);
        let host = host_ns(if via_syscall { libc::CLOCK_MONOTONIC_RAW } else { libc::CLOCK_MONOTONIC });
        assert!((raw - host).abs() < TOLERANCE_NS, "round {round}: MONOTONIC_RAW {raw}, host {host}");
    }

    #[test]
    fn vdso_runs_on_host() {
        let page = vvar_page();
        let khz = calibrate_tsc_khz();
        write_vvar(*page, &VvarData::sample(rdtsc(), khz));

        let lib = Loaded::new();
        // SAFETY: these are the vDSO entry points with their C signatures.
        let clock_gettime: ClockGettime = unsafe { std::mem::transmute(lib.sym("__vdso_clock_gettime")) };
        let clock_getres: ClockGettime = unsafe { std::mem::transmute(lib.sym("__vdso_clock_getres")) };
        let gettimeofday: Gettimeofday = unsafe { std::mem::transmute(lib.sym("__vdso_gettimeofday")) };
        let time: Time = unsafe { std::mem::transmute(lib.sym("__vdso_time")) };
        let getcpu: Getcpu = unsafe { std::mem::transmute(lib.sym("__vdso_getcpu")) };
        // The plain names are the same functions.
        assert_eq!(lib.sym("clock_gettime"), clock_gettime as usize);
        assert_eq!(lib.sym("time"), time as usize);

        check_clocks_agree(clock_gettime, 1, false);
        std::thread::sleep(Duration::from_millis(50));
        check_clocks_agree(clock_gettime, 2, false);

        // Monotonic never goes backwards across many calls.
        let mut last = 0;
        for _ in 0..10_000 {
            let (r, t) = call_clock(clock_gettime, libc::CLOCK_MONOTONIC);
            assert_eq!(r, 0);
            assert!(t >= last, "CLOCK_MONOTONIC went back: {last} -> {t}");
            last = t;
        }

        // Unhandled clocks go to the real syscall.
        let (r, cpu) = call_clock(clock_gettime, libc::CLOCK_PROCESS_CPUTIME_ID);
        assert_eq!(r, 0, "CLOCK_PROCESS_CPUTIME_ID via syscall");
        assert!(cpu > 0 && cpu < host_ns(libc::CLOCK_PROCESS_CPUTIME_ID) + 1_000_000);
        let (r, _) = call_clock(clock_gettime, libc::CLOCK_THREAD_CPUTIME_ID);
        assert_eq!(r, 0);
        let (r, _) = call_clock(clock_gettime, 1234);
        assert_eq!(r, -libc::EINVAL, "bad clock id: the syscall's -EINVAL");

        // clock_getres: 1 ns for the handled clocks, the syscall otherwise.
        let mut res = libc::timespec { tv_sec: -1, tv_nsec: -1 };
        assert_eq!(unsafe { clock_getres(libc::CLOCK_MONOTONIC, &mut res) }, 0);
        assert_eq!((res.tv_sec, res.tv_nsec), (0, 1));
        assert_eq!(unsafe { clock_getres(libc::CLOCK_REALTIME, std::ptr::null_mut()) }, 0);
        let mut res = libc::timespec { tv_sec: -1, tv_nsec: -1 };
        assert_eq!(unsafe { clock_getres(libc::CLOCK_PROCESS_CPUTIME_ID, &mut res) }, 0);
        assert!(res.tv_sec == 0 && res.tv_nsec > 0);
        assert_eq!(unsafe { clock_getres(1234, &mut res) }, -libc::EINVAL);

        // time(): return value and out-parameter.
        let host = unsafe { libc::time(std::ptr::null_mut()) };
        let mut out: libc::time_t = 0;
        let t = unsafe { time(&mut out) };
        assert_eq!(t, out);
        assert!((t - host).abs() <= 1, "vDSO time {t}, host {host}");
        assert!((unsafe { time(std::ptr::null_mut()) } - host).abs() <= 1);

        // gettimeofday(): within tolerance of the host, timezone zeroed.
        let mut tv = libc::timeval { tv_sec: 0, tv_usec: -1 };
        let mut tz = Timezone { tz_minuteswest: 99, tz_dsttime: 99 };
        let before = host_ns(libc::CLOCK_REALTIME);
        assert_eq!(unsafe { gettimeofday(&mut tv, &mut tz) }, 0);
        let after = host_ns(libc::CLOCK_REALTIME);
        let got = i128::from(tv.tv_sec) * 1_000_000_000 + i128::from(tv.tv_usec) * 1000;
        assert!((0..1_000_000).contains(&tv.tv_usec));
        assert!(got >= before - TOLERANCE_NS - 1000 && got <= after + TOLERANCE_NS, "gettimeofday {got}");
        assert_eq!((tz.tz_minuteswest, tz.tz_dsttime), (0, 0));
        assert_eq!(unsafe { gettimeofday(std::ptr::null_mut(), std::ptr::null_mut()) }, 0);

        // getcpu(): CPU 0, node 0.
        let (mut cpu, mut node) = (7u32, 7u32);
        assert_eq!(unsafe { getcpu(&mut cpu, &mut node, std::ptr::null_mut()) }, 0);
        assert_eq!((cpu, node), (0, 0));

        // A disabled page: everything goes to the syscall, even with garbage bases.
        write_vvar(*page, &VvarData { mono_ns: 1, real_ns: 1, boot_ns: 1, ..VvarData::DISABLED });
        check_clocks_agree(clock_gettime, 3, true);
        let mut tv = libc::timeval { tv_sec: 0, tv_usec: -1 };
        assert_eq!(unsafe { gettimeofday(&mut tv, std::ptr::null_mut()) }, 0);
        assert!((i128::from(tv.tv_sec) * 1_000_000_000 - host_ns(libc::CLOCK_REALTIME)).abs() < 2_000_000_000);
        assert!((unsafe { time(std::ptr::null_mut()) } - unsafe { libc::time(std::ptr::null_mut()) }).abs() <= 1);
        let mut res = libc::timespec { tv_sec: -1, tv_nsec: -1 };
        assert_eq!(unsafe { clock_getres(libc::CLOCK_MONOTONIC, &mut res) }, 0);
        assert_eq!(res.tv_sec, 0); // the host's answer (1 ns with high-res timers)

        // And a refreshed page picks up again.
        let prev = VvarData::sample(rdtsc(), khz);
        write_vvar(*page, &VvarData::sample_after(&prev, rdtsc(), khz));
        check_clocks_agree(clock_gettime, 4, false);
        drop(lib);
    }
}
