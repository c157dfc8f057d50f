//! The Linux system-call ABI for a kernel-less guest.

pub mod errno;
pub mod vfs;

pub use errno::{Errno, SysResult};
