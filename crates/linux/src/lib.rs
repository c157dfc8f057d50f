//! The Linux system-call ABI for a kernel-less guest: the process state the
//! VMM keeps (memory map, fd table, virtual file system, signals), the
//! syscall table and its handlers, and ELF loading (execve).

pub mod errno;
pub mod fd;
pub mod io;
pub mod layout;
pub mod loader;
pub mod mm;
pub mod objects;
pub mod net;
pub mod process;
mod serde_map;
pub mod syscalls;
pub mod vfs;
pub mod wait;

pub use errno::{Errno, SysResult};
pub use io::Io;
pub use process::Process;
