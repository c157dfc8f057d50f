//! The Linux system-call ABI for a kernel-less guest: the process state the
//! VMM keeps (memory map, fd table, virtual file system, signals), the
//! syscall table and its handlers, and ELF loading (execve). `kernel` is the
//! core every handler builds on, `file` the operations of each kind of open
//! file, `syscalls` the table and the handlers by family.
//!
//! Place in the flow request -> runtime -> sessions -> engine -> vmm/**linux** -> guest:
//! the guest's kernel, in the host process; it uses forkbox-vmm (guest memory)
//! and forkbox-image (the read-only file tree), and nothing above.

pub mod abi;
pub mod creds;
pub mod errno;
pub mod fd;
pub mod file;
pub mod flock;
pub mod kernel;
pub mod layout;
pub mod loader;
pub mod mm;
pub mod net;
pub mod objects;
pub mod process;
pub mod procs;
pub mod random;
mod serde_map;
pub mod shm;
pub mod signal;
pub mod syscalls;
pub mod thread;
pub mod tty;
pub mod vfs;
pub mod wait;

pub use errno::{Errno, SysResult};
pub use kernel::Kernel;
pub use process::Process;
