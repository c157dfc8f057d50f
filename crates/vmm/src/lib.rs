//! The VMM: one KVM VM with one vCPU for a guest with no guest kernel. The
//! guest runs only at CPL 3; its `syscall`s and faults exit to the VMM through
//! tiny CPL-0 stubs, and the Linux ABI layer (forkbox-linux) answers them.

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
pub use memory::GuestMemory;
pub use regs::{Regs, RegsError, Sregs, VcpuRecord, Xcrs, Xsave};
pub use vm::{GuestFault, VcpuState, Vm, VmExit};
