//! The VMM: one KVM VM with one vCPU for a guest with no guest kernel. The
//! guest runs only at CPL 3; its `syscall`s and faults exit to the VMM through
//! tiny CPL-0 stubs, and the Linux ABI layer (forkbox-linux) answers them.
//!
//! Place in the flow request -> runtime -> sessions -> engine -> **vmm**/linux -> guest:
//! the bottom layer next to forkbox-linux (which depends on it for guest memory
//! access); it depends on no other forkbox crate.

pub mod arch;
pub mod error;
pub mod interrupt;
pub mod layout;
pub mod memory;
pub mod regs;
pub mod vdso;
pub mod vm;

pub use arch::cpu::Cpu;
pub use error::{Result, VmmError};
pub use interrupt::InterruptLatch;
pub use kvm_bindings::{kvm_regs, kvm_xsave};
pub use memory::{GuestMemory, ResetStats};
pub use regs::{after_syscall, Regs, RegsError, Sregs, VcpuRecord, Xcrs, Xsave};
pub use vm::{GuestFault, VcpuState, Vm, VmExit};

/// CPU time of the calling thread, in seconds. KVM counts a vCPU's guest
/// time as its thread's, so on the thread that runs a VM this includes the
/// guest's.
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into a local timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
