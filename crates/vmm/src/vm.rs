//! One KVM VM with one vCPU and one memslot, and its run loop.

use std::time::Instant;

use kvm_bindings::{kvm_regs, kvm_userspace_memory_region};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use crate::arch::cpu::{self, Cpu};
use crate::arch::{paging, tables, USER_CS, USER_RFLAGS, USER_SS};
use crate::error::{Result, VmmError};
use crate::interrupt::{Armed, InterruptLatch};
use crate::layout::*;
use crate::memory::GuestMemory;
use crate::regs::{RegsError, VcpuRecord};

/// Why the vCPU stopped.
#[derive(Debug)]
pub enum VmExit {
    /// The guest executed `syscall`; `regs` hold its number and arguments.
    Syscall(kvm_regs),
    /// A CPU exception (the vCPU sits in its exception stub; the guest may
    /// take it as a signal: `enter_user` from there).
    Exception(GuestFault),
    /// Triple fault: the VM shut down.
    Shutdown { rip: u64 },
    /// The deadline passed while the guest ran.
    DeadlineExceeded,
    /// An `InterruptLatch` was triggered: the vCPU stopped wherever it was
    /// (user code or an entry stub; read the registers to know).
    Interrupted,
    /// Anything else (an `out` from user code, an emulation failure...): the guest is broken.
    Unexpected(String),
}

/// A guest fault, as reported to the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestFault {
    pub vector: u16,
    pub error_code: u64,
    pub rip: u64,
    pub rsp: u64,
    pub rflags: u64,
    /// Faulting address for #PF.
    pub cr2: u64,
    pub user_mode: bool,
}

impl std::fmt::Display for GuestFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at rip {:#x}", tables::exception_name(self.vector), self.rip)?;
        if self.vector == 14 {
            let what = if self.error_code & 2 != 0 { "writing" } else { "reading" };
            write!(f, " {what} address {:#x}", self.cr2)?;
        }
        if self.error_code != 0 {
            write!(f, " (error code {:#x})", self.error_code)?;
        }
        if !self.user_mode {
            write!(f, " [in an entry stub]")?;
        }
        Ok(())
    }
}

pub struct Vm {
    // Field order matters for drop: the vCPU before the VM.
    vcpu: VcpuFd,
    _vm: VmFd,
    mem: GuestMemory,
    tsc_khz: u32,
    dirty_log: bool,
}

impl Vm {
    /// A new VM whose single memslot is `mem` (guest-physical 0).
    pub fn new(cpu: &Cpu, mem: GuestMemory) -> Result<Vm> {
        Self::create(cpu, mem, false)
    }

    /// A VM with KVM's dirty-page log on (for checkpoints of what changed).
    pub fn new_with_dirty_log(cpu: &Cpu, mem: GuestMemory) -> Result<Vm> {
        Self::create(cpu, mem, true)
    }

    fn create(cpu: &Cpu, mem: GuestMemory, dirty_log: bool) -> Result<Vm> {
        let vm = cpu.kvm.create_vm().map_err(VmmError::kvm("KVM_CREATE_VM"))?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: if dirty_log { kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
            guest_phys_addr: 0,
            memory_size: mem.size(),
            userspace_addr: mem.host_addr(),
        };
        // SAFETY: the region is our own live mapping, which outlives the VM (field order).
        unsafe { vm.set_user_memory_region(region) }.map_err(VmmError::kvm("KVM_SET_USER_MEMORY_REGION"))?;
        let vcpu = vm.create_vcpu(0).map_err(VmmError::kvm("KVM_CREATE_VCPU"))?;
        cpu.setup_vcpu(&vcpu)?;
        let tsc_khz = vcpu.get_tsc_khz().map_err(VmmError::kvm("KVM_GET_TSC_KHZ"))?;
        Ok(Vm { vcpu, _vm: vm, mem, tsc_khz, dirty_log })
    }

    pub fn mem(&self) -> &GuestMemory {
        &self.mem
    }

    pub fn mem_mut(&mut self) -> &mut GuestMemory {
        &mut self.mem
    }

    pub fn tsc_khz(&self) -> u32 {
        self.tsc_khz
    }

    /// Lay out the system area and the fixed page tables (no guest page
    /// mapped yet: see `paging::set_region`), and point the vCPU at `entry` in
    /// user mode with stack `rsp`.
    pub fn boot(&mut self, cpu: &Cpu, entry: u64, rsp: u64) -> Result<()> {
        tables::build(&mut self.mem)?;
        paging::build(&mut self.mem)?;
        let sregs = self.vcpu.get_sregs().map_err(VmmError::kvm("KVM_GET_SREGS"))?;
        self.vcpu.set_sregs(&cpu.user_sregs(sregs)).map_err(VmmError::kvm("KVM_SET_SREGS"))?;
        let regs = kvm_regs { rip: entry, rsp, rflags: USER_RFLAGS, ..Default::default() };
        self.set_regs(&regs)
    }

    pub fn regs(&self) -> Result<kvm_regs> {
        self.vcpu.get_regs().map_err(VmmError::kvm("KVM_GET_REGS"))
    }

    pub fn set_regs(&self, regs: &kvm_regs) -> Result<()> {
        self.vcpu.set_regs(regs).map_err(VmmError::kvm("KVM_SET_REGS"))
    }

    pub fn vcpu(&self) -> &VcpuFd {
        &self.vcpu
    }

    pub fn fs_base(&self) -> Result<u64> {
        cpu::get_msr(&self.vcpu, cpu::MSR_FS_BASE)
    }

    pub fn set_fs_base(&self, base: u64) -> Result<()> {
        cpu::set_msrs(&self.vcpu, &[(cpu::MSR_FS_BASE, base)])
    }

    pub fn set_gs_base(&self, base: u64) -> Result<()> {
        cpu::set_msrs(&self.vcpu, &[(cpu::MSR_GS_BASE, base)])
    }

    /// The guest's current TSC (for the vDSO's time base).
    pub fn guest_tsc(&self) -> Result<u64> {
        cpu::get_msr(&self.vcpu, cpu::MSR_IA32_TSC)
    }

    /// Return from the syscall whose exit produced `regs`: RAX = `ret`, back to
    /// the user RIP (RCX) and RFLAGS (R11) through an iretq frame on the syscall stack.
    pub fn complete_syscall(&mut self, regs: &kvm_regs, ret: u64) -> Result<()> {
        let frame = SYSCALL_STACK_TOP - 40;
        // Only the arithmetic/control flags the user could set; never IOPL/NT/VM.
        let rflags = (regs.r11 & 0x0000_0000_0020_0CD5) | USER_RFLAGS;
        let words = [regs.rcx, USER_CS as u64, rflags, regs.rsp, USER_SS as u64];
        for (i, w) in words.iter().enumerate() {
            self.mem.write_u64(frame + 8 * i as u64, *w)?;
        }
        let mut r = *regs;
        r.rax = ret;
        r.rsp = frame;
        r.rip = tables::SYSCALL_EXIT_RIP;
        self.set_regs(&r)
    }

    /// Return to user mode with exactly `user`'s registers (RIP, RSP, RFLAGS
    /// included), through an iretq frame on the syscall stack. Only valid while
    /// the vCPU sits in an entry stub at CPL 0 (after a syscall or exception
    /// exit, or at the syscall stub's iretq).
    pub fn enter_user(&mut self, user: &kvm_regs) -> Result<()> {
        let frame = SYSCALL_STACK_TOP - 40;
        let rflags = (user.rflags & 0x0000_0000_0020_0CD5) | USER_RFLAGS;
        let words = [user.rip, USER_CS as u64, rflags, user.rsp, USER_SS as u64];
        for (i, w) in words.iter().enumerate() {
            self.mem.write_u64(frame + 8 * i as u64, *w)?;
        }
        let mut r = *user;
        r.rsp = frame;
        r.rip = tables::SYSCALL_EXIT_RIP;
        self.set_regs(&r)
    }

    /// The user-mode registers of a vCPU stopped at the syscall stub's iretq
    /// (RIP, RSP, RFLAGS from its frame), or None if it is not there.
    pub fn user_regs_at_iretq(&self, regs: &kvm_regs) -> Result<Option<kvm_regs>> {
        if regs.rip != tables::SYSCALL_EXIT_RIP || regs.rsp != SYSCALL_STACK_TOP - 40 {
            return Ok(None);
        }
        let mut u = *regs;
        u.rip = self.mem.read_u64(regs.rsp)?;
        u.rflags = self.mem.read_u64(regs.rsp + 16)?;
        u.rsp = self.mem.read_u64(regs.rsp + 24)?;
        Ok(Some(u))
    }

    /// Is the vCPU in user mode (CPL 3)?
    pub fn in_user_mode(&self) -> Result<bool> {
        Ok(self.vcpu.get_sregs().map_err(VmmError::kvm("KVM_GET_SREGS"))?.cs.selector & 3 == 3)
    }

    pub fn xsave(&self) -> Result<kvm_bindings::kvm_xsave> {
        self.vcpu.get_xsave().map_err(VmmError::kvm("KVM_GET_XSAVE"))
    }

    pub fn set_xsave(&self, x: &kvm_bindings::kvm_xsave) -> Result<()> {
        // SAFETY: kvm_xsave is the fixed 4 KiB legacy layout KVM_SET_XSAVE reads.
        unsafe { self.vcpu.set_xsave(x) }.map_err(VmmError::kvm("KVM_SET_XSAVE"))
    }

    /// Run until the guest needs the VMM (or `deadline` passes, or `latch` is triggered).
    pub fn run(&mut self, deadline: Option<Instant>, latch: Option<&InterruptLatch>) -> Result<VmExit> {
        // Page-table entries that lost a permission: KVM's cached translations go first.
        self.mem.flush_invalidations()?;
        let run_ptr = self.vcpu.get_kvm_run() as *mut kvm_bindings::kvm_run;
        let _armed = Armed::new(run_ptr, deadline)?;
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(VmExit::DeadlineExceeded);
            }
            // After `Armed` published the kvm_run pointer: a kick from now on sets immediate_exit.
            if latch.is_some_and(|l| l.is_pending()) {
                return Ok(VmExit::Interrupted);
            }
            let exit = match self.vcpu.run() {
                Ok(exit) => exit,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.vcpu.set_kvm_immediate_exit(0);
                    continue;
                }
                Err(e) => return Err(VmmError::Kvm { ioctl: "KVM_RUN", source: e }),
            };
            return match exit {
                VcpuExit::IoOut(port, _) => self.decode_out(port),
                VcpuExit::Shutdown => Ok(VmExit::Shutdown { rip: self.regs()?.rip }),
                VcpuExit::Hlt => Ok(VmExit::Unexpected(format!("hlt at rip {:#x}", self.regs()?.rip))),
                VcpuExit::InternalError => Ok(VmExit::Unexpected(format!(
                    "KVM internal error (emulation failure?) at rip {:#x}",
                    self.regs()?.rip
                ))),
                VcpuExit::FailEntry(reason, _) => {
                    Ok(VmExit::Unexpected(format!("VM entry failed (reason {reason:#x})")))
                }
                other => Ok(VmExit::Unexpected(format!("unexpected exit {other:?}"))),
            };
        }
    }

    fn decode_out(&mut self, port: u16) -> Result<VmExit> {
        let regs = self.regs()?;
        if port == PORT_SYSCALL && regs.rip == tables::SYSCALL_EXIT_RIP {
            return Ok(VmExit::Syscall(regs));
        }
        if (PORT_EXCEPTION_BASE..PORT_EXCEPTION_BASE + EXCEPTION_VECTORS).contains(&port) {
            let vector = port - PORT_EXCEPTION_BASE;
            if regs.rip == tables::exception_exit_rip(vector) {
                return self.decode_exception(vector, &regs).map(VmExit::Exception);
            }
        }
        Ok(VmExit::Unexpected(format!("port I/O to {port:#x} from rip {:#x} (not an entry stub)", regs.rip)))
    }

    fn decode_exception(&self, vector: u16, regs: &kvm_regs) -> Result<GuestFault> {
        let mut at = regs.rsp;
        let error_code = if tables::has_error_code(vector) {
            at += 8;
            self.mem.read_u64(regs.rsp)?
        } else {
            0
        };
        let rip = self.mem.read_u64(at)?;
        let cs = self.mem.read_u64(at + 8)?;
        let rflags = self.mem.read_u64(at + 16)?;
        let rsp = self.mem.read_u64(at + 24)?;
        let cr2 = self.vcpu.get_sregs().map_err(VmmError::kvm("KVM_GET_SREGS"))?.cr2;
        Ok(GuestFault { vector, error_code, rip, rsp, rflags, cr2, user_mode: cs & 3 == 3 })
    }
}

/// Everything of the vCPU a snapshot needs (no LAPIC, no MSR soup: the guest
/// never runs at CPL 0 and has no interrupt controller), in the form the
/// ioctls take. What is persisted is its `VcpuRecord` (crate::regs).
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_bindings::kvm_sregs,
    pub xcrs: kvm_bindings::kvm_xcrs,
    pub xsave: kvm_bindings::kvm_xsave,
    pub fs_base: u64,
}

impl VcpuState {
    /// The persisted form.
    pub fn to_record(&self) -> VcpuRecord {
        VcpuRecord {
            regs: (&self.regs).into(),
            sregs: (&self.sregs).into(),
            xcrs: (&self.xcrs).into(),
            xsave: (&self.xsave).into(),
            fs_base: self.fs_base,
        }
    }

    /// Back from the persisted form (sizes checked; KVM checks the values when they are set).
    pub fn from_record(r: &VcpuRecord) -> std::result::Result<VcpuState, RegsError> {
        Ok(VcpuState {
            regs: (&r.regs).into(),
            sregs: (&r.sregs).into(),
            xcrs: kvm_bindings::kvm_xcrs::try_from(&r.xcrs)?,
            xsave: *r.xsave.to_kvm()?,
            fs_base: r.fs_base,
        })
    }
}

impl Vm {
    pub fn save_vcpu(&self) -> Result<VcpuState> {
        Ok(VcpuState {
            regs: self.regs()?,
            sregs: self.vcpu.get_sregs().map_err(VmmError::kvm("KVM_GET_SREGS"))?,
            xcrs: self.vcpu.get_xcrs().map_err(VmmError::kvm("KVM_GET_XCRS"))?,
            xsave: self.vcpu.get_xsave().map_err(VmmError::kvm("KVM_GET_XSAVE"))?,
            fs_base: self.fs_base()?,
        })
    }

    /// Is KVM's dirty-page log on (`new_with_dirty_log` or `start_dirty_log`)?
    pub fn logs_dirty_pages(&self) -> bool {
        self.dirty_log
    }

    /// Turn KVM's dirty-page log on for a VM made without it (a pooled, warm
    /// VM that became a session's): from now on `dirty_log` reports the pages
    /// the guest writes. Without an in-kernel irqchip this is a flags-only
    /// change of the memslot (~0.1 ms; KVM write-protects its mappings).
    pub fn start_dirty_log(&mut self) -> Result<()> {
        if self.dirty_log {
            return Ok(());
        }
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES,
            guest_phys_addr: 0,
            memory_size: self.mem.size(),
            userspace_addr: self.mem.host_addr(),
        };
        // SAFETY: the same live mapping as the slot already has (only its flags change).
        unsafe { self._vm.set_user_memory_region(region) }.map_err(VmmError::kvm("KVM_SET_USER_MEMORY_REGION"))?;
        self.dirty_log = true;
        Ok(())
    }

    /// Pages the guest wrote since the last call (needs `new_with_dirty_log`).
    pub fn dirty_log(&self) -> Result<Vec<u64>> {
        if !self.dirty_log {
            return Err(VmmError::Sys {
                call: "KVM_GET_DIRTY_LOG (log off)",
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        self._vm.get_dirty_log(0, self.mem.size() as usize).map_err(VmmError::kvm("KVM_GET_DIRTY_LOG"))
    }

    /// Put a VM whose memory is a snapshot mapping back into the state of its
    /// snapshot: memory and vCPU. Private pages inside `keep` (the snapshot's
    /// own mappings, `paging::mapped_pages`) get the snapshot's bytes back and
    /// stay warm; the others go back to the host; translations KVM cached from
    /// page-table entries that differ from the snapshot's are dropped.
    pub fn reset(&mut self, original: &[u8], keep: &[u64], vcpu: &VcpuState) -> Result<crate::memory::ResetStats> {
        let private = self.mem.private_pages()?;
        let changed = paging::changed_translations(&self.mem, original, &private)?;
        let stats = self.mem.reset_to_backing(original, keep, &changed, Some(private))?;
        self.restore_vcpu(vcpu)?;
        Ok(stats)
    }

    /// Restore a saved vCPU. XCR0 goes before XSAVE (the XSAVE image is checked against it).
    pub fn restore_vcpu(&self, s: &VcpuState) -> Result<()> {
        self.vcpu.set_sregs(&s.sregs).map_err(VmmError::kvm("KVM_SET_SREGS"))?;
        self.vcpu.set_xcrs(&s.xcrs).map_err(VmmError::kvm("KVM_SET_XCRS"))?;
        // SAFETY: kvm_xsave is the fixed 4 KiB legacy layout KVM_SET_XSAVE reads.
        unsafe { self.vcpu.set_xsave(&s.xsave) }.map_err(VmmError::kvm("KVM_SET_XSAVE"))?;
        self.set_regs(&s.regs)?;
        self.set_fs_base(s.fs_base)
    }
}
