//! The system-call layer, organised like gVisor's: one module per family
//! (`sys_*.rs`), one table whose entries carry name, handler and support level.
//! Anything not in the table returns ENOSYS and is counted by number.

pub mod procfs;
mod sys_file;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
pub use sys_file::close_fds;
mod sys_fork;
mod sys_fs;
mod sys_inotify;
mod sys_lock;
mod sys_mm;
pub use sys_mm::{privatize_own_files, privatize_shared, release_shared};
mod sys_pipe;
mod sys_process;
mod sys_rlimit;
mod sys_signal;
mod sys_socket;
mod sys_thread;
mod sys_time;
mod sys_timer;
mod sys_unix;
mod table;
#[cfg(test)]
mod tests;

use crate::errno::{Errno, SysResult};
use crate::kernel::{Args, Ctx};

pub use table::{entry, markdown, restarts_under_sa_restart, Entry, Restart, Support, README_BEGIN, README_END, TABLE};

/// Run syscall `nr`. `Err(e)` becomes `-e` in RAX.
pub fn dispatch(ctx: &mut Ctx, nr: u64, args: &Args) -> SysResult {
    ctx.kernel.stats.total += 1;
    *ctx.kernel.stats.by_nr.entry(nr).or_default() += 1;
    #[cfg(feature = "test-hooks")]
    if let Some(r) = test_hooks::dispatch(nr) {
        return r;
    }
    let result = match entry(nr) {
        Some(e) => e.run(ctx, args),
        None => {
            *ctx.kernel.stats.unimplemented.entry(nr).or_default() += 1;
            Err(Errno::ENOSYS)
        }
    };
    // Descriptions closed for good as a side effect of the call (descriptors
    // in flight on an AF_UNIX socket a receive dropped) give back what they held.
    crate::file::released(ctx, None);
    let vfs = &ctx.proc.vfs;
    ctx.proc.fds.drain_closed_nodes(|closed| vfs.note_closed(closed));
    if let Some(closed) = ctx.proc.fds.take_closed() {
        if !ctx.kernel.flocks.is_empty() {
            for ofd in closed {
                ctx.kernel.flocks.release(ctx.proc.pid, ofd);
            }
        }
    }
    if ctx.kernel.trace {
        let name = entry(nr).map(|e| e.name).unwrap_or("?");
        // Prefixed by pid/tid as `strace -f` does: threads and processes interleave.
        let (pid, tid) = (ctx.proc.pid, ctx.proc.tid());
        tracing::info!(target: "forkbox::syscall", "[{pid}/{tid}] {name}({nr}) {:x?} -> {:?}", &args[..], result.map(|v| v as i64));
    }
    result
}

/// A syscall a run made that is not fully supported, and how often.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct UnsupportedCall {
    pub nr: u64,
    pub name: &'static str,
    pub calls: u64,
    /// "partial", "refused", or "unimplemented" (not in the table: ENOSYS).
    pub support: &'static str,
    pub note: &'static str,
}

/// The calls among `by_nr` (syscall number -> count) that are partial,
/// refused or not in the table, in number order.
pub fn unsupported_calls(by_nr: &std::collections::BTreeMap<u64, u64>) -> Vec<UnsupportedCall> {
    by_nr
        .iter()
        .filter_map(|(&nr, &calls)| {
            let (name, support, note) = match entry(nr) {
                Some(e) => (e.name, e.support.level(), e.support.note()?),
                None => ("unknown", "unimplemented", "ENOSYS: not in the syscall table"),
            };
            Some(UnsupportedCall { nr, name, calls, support, note })
        })
        .collect()
}

/// Re-run a blocked call's handler (not counted again in the statistics).
pub fn redispatch(ctx: &mut Ctx, nr: u64, args: &Args) -> SysResult {
    let result = match entry(nr) {
        Some(e) => e.run(ctx, args),
        None => Err(Errno::ENOSYS),
    };
    crate::file::released(ctx, None);
    result
}

/// Syscall name by number (for reports).
pub fn name(nr: u64) -> &'static str {
    entry(nr).map(|e| e.name).unwrap_or("unknown")
}
