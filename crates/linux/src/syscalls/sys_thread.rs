//! Threads: clone/clone3 (a clone without CLONE_THREAD is a new process:
//! `sys_fork`), exit of one thread, gettid,
//! set_tid_address, futex, sched_yield (tgkill and tkill are in `sys_signal`).
//! The engine schedules the threads (see `crate::thread`).

use std::time::Duration;

use crate::errno::{Errno, SysResult};
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx, Effect};
use crate::thread::WaitKind;

const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_FILES: u64 = 0x400;
const CLONE_SIGHAND: u64 = 0x800;
const CLONE_THREAD: u64 = 0x1_0000;
const CLONE_SYSVSEM: u64 = 0x4_0000;
const CLONE_SETTLS: u64 = 0x8_0000;
const CLONE_PARENT_SETTID: u64 = 0x10_0000;
const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
const CLONE_DETACHED: u64 = 0x40_0000;
const CLONE_CHILD_SETTID: u64 = 0x100_0000;
/// Everything a thread clone may carry.
const THREAD_FLAGS: u64 = CLONE_VM
    | CLONE_FS
    | CLONE_FILES
    | CLONE_SIGHAND
    | CLONE_THREAD
    | CLONE_SYSVSEM
    | CLONE_SETTLS
    | CLONE_PARENT_SETTID
    | CLONE_CHILD_CLEARTID
    | CLONE_DETACHED
    | CLONE_CHILD_SETTID;

struct CloneArgs {
    flags: u64,
    stack: u64,
    parent_tid: u64,
    child_tid: u64,
    tls: u64,
    exit_signal: u64,
}

fn do_clone(ctx: &mut Ctx, c: CloneArgs) -> SysResult {
    let f = c.flags;
    if f & CLONE_THREAD == 0 {
        // A new process (fork, vfork, posix_spawn): its own VM (see `sys_fork`).
        return super::sys_fork::clone_process(ctx, f, c.stack, c.parent_tid, c.child_tid, c.tls);
    }
    if f & CLONE_VM == 0 {
        return Err(Errno::EINVAL);
    }
    if f & CLONE_SIGHAND == 0 || f & !THREAD_FLAGS != 0 || c.exit_signal != 0 {
        return Err(Errno::EINVAL);
    }
    if f & CLONE_SETTLS != 0 && c.tls >= 1 << 47 {
        return Err(Errno::EPERM);
    }
    if c.stack != 0 {
        ctx.user_range(c.stack.saturating_sub(8), 8)?;
    }
    // Check the id pointers before anything exists.
    if f & CLONE_PARENT_SETTID != 0 {
        ctx.bytes(c.parent_tid, 4)?;
    }
    if f & CLONE_CHILD_SETTID != 0 {
        ctx.bytes(c.child_tid, 4)?;
    }
    let fs_base = if f & CLONE_SETTLS != 0 { c.tls } else { ctx.proc.fs_base };
    let clear = if f & CLONE_CHILD_CLEARTID != 0 { c.child_tid } else { 0 };
    let mask = ctx.proc.signals.mask;
    let tid = ctx.proc.threads.spawn(fs_base, mask, clear)?;
    if f & CLONE_PARENT_SETTID != 0 {
        ctx.write_bytes(c.parent_tid, &tid.to_le_bytes())?;
    }
    if f & CLONE_CHILD_SETTID != 0 {
        ctx.write_bytes(c.child_tid, &tid.to_le_bytes())?;
    }
    ctx.effect = Some(Effect::Spawn { tid, stack: c.stack });
    Ok(tid as u64)
}

/// clone(flags, stack, parent_tid, child_tid, tls) (the x86-64 argument order).
pub fn clone(ctx: &mut Ctx, a: &Args) -> SysResult {
    let exit_signal = a[0] & 0xFF;
    do_clone(
        ctx,
        CloneArgs { flags: a[0] & !0xFF, stack: a[1], parent_tid: a[2], child_tid: a[3], tls: a[4], exit_signal },
    )
}

/// clone3(struct clone_args *, size).
pub fn clone3(ctx: &mut Ctx, a: &Args) -> SysResult {
    let size = a[1];
    if !(64..=4096).contains(&size) {
        return Err(Errno::EINVAL);
    }
    let b = ctx.bytes(a[0], size)?;
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    let (flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls) =
        (w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
    // set_tid, set_tid_size, cgroup, and anything a newer kernel added, must be zero.
    if b[64..].iter().any(|&x| x != 0) || pidfd != 0 && flags & 0x1000 != 0 {
        return Err(Errno::EINVAL);
    }
    if (stack == 0) != (stack_size == 0) {
        return Err(Errno::EINVAL);
    }
    let top = stack.checked_add(stack_size).ok_or(Errno::EINVAL)?;
    do_clone(ctx, CloneArgs { flags, stack: top, parent_tid, child_tid, tls, exit_signal })
}

/// exit: this thread only (the last one ends the process). Its
/// clear-child-tid word is zeroed and one futex waiter on it woken (pthread_join).
pub fn exit(ctx: &mut Ctx, a: &Args) -> SysResult {
    if ctx.proc.threads.len() <= 1 {
        ctx.effect = Some(Effect::Exit(a[0] as i32 & 0xFF));
        return Ok(0);
    }
    let addr = ctx.proc.tid_address;
    if addr != 0 && addr.is_multiple_of(4) && ctx.write_bytes(addr, &0u32.to_le_bytes()).is_ok() {
        ctx.proc.threads.futex_wake(addr, u32::MAX, 1);
    }
    ctx.effect = Some(Effect::ThreadExit);
    Ok(0)
}

pub fn gettid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.tid() as u64)
}

pub fn set_tid_address(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.tid_address = a[0];
    Ok(ctx.proc.tid() as u64)
}

pub fn sched_yield(ctx: &mut Ctx, _: &Args) -> SysResult {
    if ctx.proc.threads.len() > 1 {
        ctx.effect = Some(Effect::Yield);
    }
    Ok(0)
}

// ----- futex -------------------------------------------------------------------

const FUTEX_WAIT: u64 = 0;
const FUTEX_WAKE: u64 = 1;
const FUTEX_REQUEUE: u64 = 3;
const FUTEX_CMP_REQUEUE: u64 = 4;
const FUTEX_WAKE_OP: u64 = 5;
const FUTEX_WAIT_BITSET: u64 = 9;
const FUTEX_WAKE_BITSET: u64 = 10;
const FUTEX_PRIVATE_FLAG: u64 = 128;
const FUTEX_CLOCK_REALTIME: u64 = 256;

fn futex_word(ctx: &Ctx, addr: u64) -> Result<u32, Errno> {
    if !addr.is_multiple_of(4) {
        return Err(Errno::EINVAL);
    }
    let b = ctx.bytes(addr, 4)?;
    Ok(u32::from_le_bytes(b.try_into().map_err(|_| Errno::EFAULT)?))
}

/// The host time left until an absolute guest time on `clock`.
pub fn until_abs(clock: libc::clockid_t, at: Duration) -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    at.saturating_sub(Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32))
}

/// Wake up to `n` waiters of `addr` in this process, and queue the rest of the
/// wake for the other processes when `addr` is in memory shared with them
/// (`shm.rs`: keyed by (object, offset); the engine delivers it and adds
/// whom it woke to this call's result).
fn wake(ctx: &mut Ctx, addr: u64, bitset: u32, n: u64) -> u64 {
    let woken = ctx.proc.threads.futex_wake(addr, bitset, n);
    woke(ctx, woken);
    if woken < n {
        if let Some((obj, offset)) = ctx.proc.mm.shared_at(addr) {
            ctx.kernel.shm.wakes.push(crate::shm::SharedWake { obj, offset, bitset, n: n - woken });
        }
    }
    woken
}

/// `woken` threads of this process had their waits ended: the woken run from
/// the caller's next exit on ([`Effect::Woke`]).
fn woke(ctx: &mut Ctx, woken: u64) {
    if woken > 0 {
        ctx.effect = Some(Effect::Woke);
    }
}

/// Within a process private and shared futexes are the same: keyed by
/// address. Across processes, wakes on shared mappings reach the waiters of
/// the other processes that map the same object (`wake`); requeues stay in
/// the process. A call that woke threads of this process says so
/// ([`Effect::Woke`]): the woken run from the caller's next exit on.
pub fn futex(ctx: &mut Ctx, a: &Args) -> SysResult {
    let op = a[1];
    let cmd = op & !(FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME);
    let addr = a[0];
    match cmd {
        FUTEX_WAIT | FUTEX_WAIT_BITSET => {
            let bitset = if cmd == FUTEX_WAIT { u32::MAX } else { a[5] as u32 };
            if bitset == 0 {
                return Err(Errno::EINVAL);
            }
            // A re-run of a blocked wait: woken, timed out, or still waiting.
            if let Some(w) = ctx.proc.threads.current().wait.as_ref() {
                if let WaitKind::Futex { addr: at, bitset } = w.kind {
                    if w.woken {
                        return Ok(0);
                    }
                    if ctx.timed_out {
                        return Err(Errno::ETIMEDOUT);
                    }
                    return ctx.block(Block::new(WaitOn::Futex { addr: at, bitset }));
                }
            }
            if futex_word(ctx, addr)? != a[2] as u32 {
                return Err(Errno::EAGAIN);
            }
            let timeout = if a[3] != 0 {
                let t = super::sys_time::read_timespec(ctx, a[3])?;
                Some(if cmd == FUTEX_WAIT_BITSET {
                    let clock =
                        if op & FUTEX_CLOCK_REALTIME != 0 { libc::CLOCK_REALTIME } else { libc::CLOCK_MONOTONIC };
                    until_abs(clock, t)
                } else {
                    t
                })
            } else {
                None
            };
            if timeout == Some(Duration::ZERO) {
                // Its deadline passed before the call (a timed wait shorter
                // than a VM exit, as CPython's GIL wait under a short switch
                // interval): the thread is polling for what another thread
                // must do, so the others run first (else the poller keeps the
                // vCPU for its whole slice, one exit per round).
                if ctx.proc.threads.len() > 1 {
                    ctx.effect = Some(Effect::Yield);
                }
                return Err(Errno::ETIMEDOUT);
            }
            ctx.block(Block::new(WaitOn::Futex { addr, bitset }).timeout(timeout, Err(Errno::ETIMEDOUT)))
        }
        FUTEX_WAKE | FUTEX_WAKE_BITSET => {
            let bitset = if cmd == FUTEX_WAKE { u32::MAX } else { a[5] as u32 };
            if bitset == 0 {
                return Err(Errno::EINVAL);
            }
            if !addr.is_multiple_of(4) {
                return Err(Errno::EINVAL);
            }
            Ok(wake(ctx, addr, bitset, a[2].min(i32::MAX as u64)))
        }
        FUTEX_REQUEUE | FUTEX_CMP_REQUEUE => {
            let (n, m, to) = (a[2].min(i32::MAX as u64), a[3].min(i32::MAX as u64), a[4]);
            if !addr.is_multiple_of(4) || !to.is_multiple_of(4) {
                return Err(Errno::EINVAL);
            }
            if cmd == FUTEX_CMP_REQUEUE && futex_word(ctx, addr)? != a[5] as u32 {
                return Err(Errno::EAGAIN);
            }
            let (woken, moved) = ctx.proc.threads.futex_requeue(addr, n, to, m);
            woke(ctx, woken);
            Ok(if cmd == FUTEX_CMP_REQUEUE { woken + moved } else { woken })
        }
        FUTEX_WAKE_OP => {
            let (n, n2, addr2, val3) = (a[2].min(i32::MAX as u64), a[3].min(i32::MAX as u64), a[4], a[5] as u32);
            let old = futex_word(ctx, addr2)?;
            let (opc, cmp) = ((val3 >> 28) & 0xF, (val3 >> 24) & 0xF);
            let mut oparg = (val3 >> 12) & 0xFFF;
            let cmparg = val3 & 0xFFF;
            if opc & 8 != 0 {
                oparg = 1u32.checked_shl(oparg).unwrap_or(0);
            }
            let new = match opc & 7 {
                0 => oparg,
                1 => old.wrapping_add(oparg),
                2 => old | oparg,
                3 => old & !oparg,
                4 => old ^ oparg,
                _ => return Err(Errno::ENOSYS),
            };
            ctx.write_bytes(addr2, &new.to_le_bytes())?;
            let woken = wake(ctx, addr, u32::MAX, n);
            let hit = match cmp {
                0 => old == cmparg,
                1 => old != cmparg,
                2 => (old as i32) < cmparg as i32,
                3 => (old as i32) <= cmparg as i32,
                4 => (old as i32) > cmparg as i32,
                5 => (old as i32) >= cmparg as i32,
                _ => return Err(Errno::ENOSYS),
            };
            let woken2 = if hit { wake(ctx, addr2, u32::MAX, n2) } else { 0 };
            Ok(woken + woken2)
        }
        // PI futexes and the rest: not used by glibc's default mutexes.
        _ => Err(Errno::ENOSYS),
    }
}
