//! Test-only guest actions: compiled only with the `test-hooks` feature (the
//! engine's tests turn it on; no production build has it) and active only when
//! the host sets `FORKBOX_TEST_HOOKS=1`.

use crate::{Errno, SysResult};

/// A guest syscall with this number makes the VMM itself call
/// `personality(0xffffffff)` on the host: a harmless query that is outside the
/// guest-thread seccomp allow-list (`forkbox_engine::jail`), so the filter
/// must kill the process.
pub const FORBIDDEN_HOST_SYSCALL: u64 = 0x0f0b_5ec0;

/// `Some(result)` when `nr` is a test hook and hooks are on.
pub fn dispatch(nr: u64) -> Option<SysResult> {
    if nr != FORBIDDEN_HOST_SYSCALL || std::env::var_os("FORKBOX_TEST_HOOKS").is_none_or(|v| v != "1") {
        return None;
    }
    // SAFETY: personality(0xffffffff) only reads the persona; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffff_u64) };
    Some(if r < 0 { Err(Errno::EPERM) } else { Ok(r as u64) })
}
