//! The process and its identity: ids, limits, affinity, thread setup,
//! arch_prctl, exit_group, prctl, rusage (threads and signals: `sys_thread`).

use super::sys_time::cpu_time;
use crate::creds::{Ids, NGROUPS_MAX};
use crate::errno::{Errno, SysResult};
use crate::kernel::{Args, Ctx, Effect};
use crate::random::fill_random;

const PRIO_PROCESS: i32 = 0;
const PRIO_PGRP: i32 = 1;
const PRIO_USER: i32 = 2;

/// The live processes `which`/`who` of get/setpriority name (Linux's
/// rules: 0 is the caller, or its group; PRIO_USER 0 is the caller's real
/// uid, and every process of the sandbox is taken to run as that user, the
/// table keeping no other process' credentials). EINVAL for another
/// `which`, ESRCH when none matches.
fn prio_targets(ctx: &Ctx, which: i32, who: u64) -> Result<Vec<u32>, Errno> {
    let me = ctx.proc.pid;
    let who = u32::try_from(who as i64).map_err(|_| Errno::ESRCH)?;
    let live = ctx.kernel.procs.map.iter().filter(|(_, e)| e.exit.is_none());
    let found: Vec<u32> = match which {
        PRIO_PROCESS => {
            let pid = if who == 0 { me } else { who };
            live.filter(|(&p, _)| p == pid).map(|(&p, _)| p).collect()
        }
        PRIO_PGRP => {
            let pgid = if who == 0 { ctx.kernel.procs.get(me).map_or(me, |e| e.pgid) } else { who };
            live.filter(|(_, e)| e.pgid == pgid).map(|(&p, _)| p).collect()
        }
        PRIO_USER => {
            if who != 0 && who != ctx.proc.creds.uid.real {
                return Err(Errno::ESRCH);
            }
            live.map(|(&p, _)| p).collect()
        }
        _ => return Err(Errno::EINVAL),
    };
    if found.is_empty() {
        return Err(Errno::ESRCH);
    }
    Ok(found)
}

/// getpriority: the raw syscall returns 20 - nice, of the highest-priority
/// (lowest nice) process named.
pub fn getpriority(ctx: &mut Ctx, a: &Args) -> SysResult {
    let targets = prio_targets(ctx, a[0] as i32, a[1])?;
    let nice = targets.iter().filter_map(|p| ctx.kernel.procs.get(*p)).map(|e| e.nice).min().unwrap_or(0);
    Ok((20 - i64::from(nice)) as u64)
}

/// setpriority: the nice value (clamped to -20..=19, as Linux) of every
/// process named. Lowering it needs CAP_SYS_NICE (here: euid 0), else
/// EACCES. The value is reported back; the VMM schedules the sandbox as one
/// (it changes no host priority).
pub fn setpriority(ctx: &mut Ctx, a: &Args) -> SysResult {
    let targets = prio_targets(ctx, a[0] as i32, a[1])?;
    let nice = (a[2] as i32).clamp(-20, 19) as i8;
    let privileged = ctx.proc.creds.privileged();
    for p in &targets {
        if let Some(e) = ctx.kernel.procs.get(*p) {
            if nice < e.nice && !privileged {
                return Err(Errno::EACCES);
            }
        }
    }
    for p in targets {
        if let Some(e) = ctx.kernel.procs.map.get_mut(&p) {
            e.nice = nice;
        }
    }
    Ok(0)
}

// ----- credentials (the model and Linux's rules: `crate::creds`) ----------------

pub fn getuid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.creds.uid.real.into())
}

pub fn geteuid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.creds.uid.effective.into())
}

pub fn getgid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.creds.gid.real.into())
}

pub fn getegid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.creds.gid.effective.into())
}

/// The uid_t/gid_t argument `v` (the upper half of the register is ignored, as Linux).
fn id(v: u64) -> u32 {
    v as u32
}

/// Which ids a set*id call changes.
#[derive(Clone, Copy)]
enum Kind {
    User,
    Group,
}

/// Apply `f` to the user or group ids, with the caller's privilege; on an
/// error nothing changes (`f` works on a copy).
fn change(ctx: &mut Ctx, kind: Kind, f: impl FnOnce(&mut Ids, bool) -> Result<(), Errno>) -> SysResult {
    let privileged = ctx.proc.creds.privileged();
    let creds = &mut ctx.proc.creds;
    let ids = match kind {
        Kind::User => &mut creds.uid,
        Kind::Group => &mut creds.gid,
    };
    let mut new = *ids;
    f(&mut new, privileged)?;
    *ids = new;
    Ok(0)
}

pub fn setuid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::User, |u, p| u.set(id(a[0]), p))
}

pub fn setgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::Group, |g, p| g.set(id(a[0]), p))
}

pub fn setreuid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::User, |u, p| u.set_re(id(a[0]), id(a[1]), p))
}

pub fn setregid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::Group, |g, p| g.set_re(id(a[0]), id(a[1]), p))
}

pub fn setresuid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::User, |u, p| u.set_res(id(a[0]), id(a[1]), id(a[2]), p))
}

pub fn setresgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    change(ctx, Kind::Group, |g, p| g.set_res(id(a[0]), id(a[1]), id(a[2]), p))
}

/// setfsuid/setfsgid return the old id, whether or not it changed.
fn set_fs(ctx: &mut Ctx, kind: Kind, v: u64) -> SysResult {
    let privileged = ctx.proc.creds.privileged();
    let creds = &mut ctx.proc.creds;
    let ids = match kind {
        Kind::User => &mut creds.uid,
        Kind::Group => &mut creds.gid,
    };
    Ok(ids.set_fs(id(v), privileged).into())
}

pub fn setfsuid(ctx: &mut Ctx, a: &Args) -> SysResult {
    set_fs(ctx, Kind::User, a[0])
}

pub fn setfsgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    set_fs(ctx, Kind::Group, a[0])
}

/// Write the three ids to the guest's three pointers (all checked before any write).
fn write_res(ctx: &mut Ctx, a: &Args, ids: Ids) -> SysResult {
    for p in &a[..3] {
        ctx.user_range_mut(*p, 4)?;
    }
    for (p, v) in a[..3].iter().zip([ids.real, ids.effective, ids.saved]) {
        ctx.write_bytes(*p, &v.to_le_bytes())?;
    }
    Ok(0)
}

pub fn getresuid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let ids = ctx.proc.creds.uid;
    write_res(ctx, a, ids)
}

pub fn getresgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let ids = ctx.proc.creds.gid;
    write_res(ctx, a, ids)
}

/// getgroups(size, list): size 0 asks for the count; a smaller buffer than the groups is EINVAL.
pub fn getgroups(ctx: &mut Ctx, a: &Args) -> SysResult {
    let size = a[0] as i32;
    if size < 0 {
        return Err(Errno::EINVAL);
    }
    let groups = ctx.proc.creds.groups.clone();
    if size == 0 {
        return Ok(groups.len() as u64);
    }
    if (size as usize) < groups.len() {
        return Err(Errno::EINVAL);
    }
    let bytes: Vec<u8> = groups.iter().flat_map(|g| g.to_le_bytes()).collect();
    ctx.write_bytes(a[1], &bytes)?;
    Ok(groups.len() as u64)
}

/// setgroups(size, list): privileged only (EPERM first, as Linux), at most
/// NGROUPS_MAX (checked before the list is read, so the copy is bounded).
pub fn setgroups(ctx: &mut Ctx, a: &Args) -> SysResult {
    if !ctx.proc.creds.privileged() {
        return Err(Errno::EPERM);
    }
    let size = a[0] as i32;
    let n = usize::try_from(size).map_err(|_| Errno::EINVAL)?;
    if n > NGROUPS_MAX {
        return Err(Errno::EINVAL);
    }
    let len = u64::try_from(n.checked_mul(4).ok_or(Errno::EINVAL)?).map_err(|_| Errno::EINVAL)?;
    let groups = ctx.bytes(a[1], len)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    ctx.proc.creds.set_groups(groups)?;
    Ok(0)
}

pub fn set_robust_list(_: &mut Ctx, a: &Args) -> SysResult {
    if a[1] != 24 {
        return Err(Errno::EINVAL);
    }
    Ok(0)
}

/// One CPU: the guest has one vCPU.
/// The sandbox's CPUs (as /proc/cpuinfo and /proc/stat list them) as a mask.
fn cpu_mask() -> u64 {
    (1u64 << super::procfs::CPUS) - 1
}

/// The process or thread a scheduling call names: 0 is the caller; else a
/// thread of this process or a live process of the sandbox. ESRCH otherwise
/// (negative ids included), as Linux's `find_process_by_pid`.
fn sched_target(ctx: &Ctx, pid: u64) -> Result<(), Errno> {
    let pid = pid as i32;
    // 0 is the caller; 1 is the parent of the sandbox's first process (what
    // its getppid() reports: the VMM, standing for init), which runs too.
    if pid == 0 || pid == 1 {
        return Ok(());
    }
    let pid = u32::try_from(pid).map_err(|_| Errno::ESRCH)?;
    let thread = ctx.proc.threads.index_of(pid as crate::thread::Tid).is_some();
    if thread || ctx.kernel.procs.get(pid).is_some_and(|e| e.exit.is_none()) {
        Ok(())
    } else {
        Err(Errno::ESRCH)
    }
}

pub fn sched_getaffinity(ctx: &mut Ctx, a: &Args) -> SysResult {
    let size = a[1];
    if size < 8 || !size.is_multiple_of(8) {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    let size = size.min(128);
    let mut mask = vec![0u8; size as usize];
    mask[..8].copy_from_slice(&cpu_mask().to_le_bytes());
    ctx.write_bytes(a[2], &mask)?;
    Ok(size)
}

/// sched_setaffinity: a mask with none of the sandbox's CPUs is EINVAL (as
/// Linux for no online CPU); otherwise it holds every CPU the sandbox has,
/// so there is nothing to restrict.
pub fn sched_setaffinity(ctx: &mut Ctx, a: &Args) -> SysResult {
    sched_target(ctx, a[0])?;
    // Only the first word can name one of the sandbox's CPUs; a shorter mask is zero-extended.
    let len = a[1].min(8);
    let mut word = [0u8; 8];
    word[..len as usize].copy_from_slice(ctx.bytes(a[2], len)?);
    if u64::from_le_bytes(word) & cpu_mask() == 0 {
        return Err(Errno::EINVAL);
    }
    Ok(0)
}

const SCHED_OTHER: i32 = 0;
const SCHED_FIFO: i32 = 1;
const SCHED_RR: i32 = 2;
const SCHED_BATCH: i32 = 3;
const SCHED_IDLE: i32 = 5;
const SCHED_DEADLINE: i32 = 6;

/// sched_get_priority_max / _min: Linux's static priority range of a policy
/// (1..=99 for the real-time ones, 0 for the others), EINVAL for no policy.
fn priority_range(policy: u64) -> Result<(u64, u64), Errno> {
    match policy as i32 {
        SCHED_FIFO | SCHED_RR => Ok((1, 99)),
        SCHED_OTHER | SCHED_BATCH | SCHED_IDLE | SCHED_DEADLINE => Ok((0, 0)),
        _ => Err(Errno::EINVAL),
    }
}

pub fn sched_get_priority_max(_: &mut Ctx, a: &Args) -> SysResult {
    priority_range(a[0]).map(|r| r.1)
}

pub fn sched_get_priority_min(_: &mut Ctx, a: &Args) -> SysResult {
    priority_range(a[0]).map(|r| r.0)
}

/// sched_rr_get_interval: every guest thread runs under SCHED_OTHER; Linux
/// reports its time slice (CFS's default minimum granularity, 4 ms at HZ=250).
pub fn sched_rr_get_interval(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[0] as i32) < 0 {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    let mut b = [0u8; 16];
    b[8..].copy_from_slice(&4_000_000i64.to_le_bytes());
    ctx.write_bytes(a[1], &b)?;
    Ok(0)
}

/// sched_getscheduler: every guest thread runs under SCHED_OTHER.
pub fn sched_getscheduler(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[0] as i32) < 0 {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    Ok(SCHED_OTHER as u64)
}

/// sched_getparam: SCHED_OTHER's only priority, 0.
pub fn sched_getparam(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[0] as i32) < 0 || a[1] == 0 {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    ctx.write_bytes(a[1], &0i32.to_le_bytes())?;
    Ok(0)
}

/// The `sched_param` priority at `ptr` for `policy`: real-time policies need
/// CAP_SYS_NICE (EPERM: the VMM schedules the sandbox as one host thread);
/// the others take only priority 0.
fn check_policy(ctx: &mut Ctx, policy: i32, ptr: u64) -> Result<(), Errno> {
    if ptr == 0 {
        return Err(Errno::EINVAL);
    }
    let prio = i32::from_le_bytes(ctx.bytes(ptr, 4)?.try_into().map_err(|_| Errno::EFAULT)?);
    // SCHED_RESET_ON_FORK may be or-ed into the policy.
    match policy & !0x4000_0000 {
        SCHED_OTHER | SCHED_BATCH | SCHED_IDLE if prio == 0 => Ok(()),
        SCHED_OTHER | SCHED_BATCH | SCHED_IDLE => Err(Errno::EINVAL),
        SCHED_FIFO | SCHED_RR if (1..=99).contains(&prio) => Err(Errno::EPERM),
        _ => Err(Errno::EINVAL),
    }
}

/// sched_setscheduler: accepted for the normal policies with priority 0 (the
/// thread keeps running as SCHED_OTHER; nothing to change in the VMM).
pub fn sched_setscheduler(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[0] as i32) < 0 {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    check_policy(ctx, a[1] as i32, a[2])?;
    Ok(0)
}

/// sched_setparam: the priority under the thread's policy (SCHED_OTHER: 0).
pub fn sched_setparam(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[0] as i32) < 0 {
        return Err(Errno::EINVAL);
    }
    sched_target(ctx, a[0])?;
    check_policy(ctx, SCHED_OTHER, a[1])?;
    Ok(0)
}

/// getcpu: the sandbox runs on one virtual CPU and one NUMA node (either
/// pointer may be NULL).
pub fn getcpu(ctx: &mut Ctx, a: &Args) -> SysResult {
    for ptr in [a[0], a[1]] {
        if ptr != 0 {
            ctx.write_bytes(ptr, &0u32.to_le_bytes())?;
        }
    }
    Ok(0)
}

/// personality: only PER_LINUX, which every guest has; 0xffffffff reads it.
pub fn personality(_: &mut Ctx, a: &Args) -> SysResult {
    match a[0] as u32 {
        0xffff_ffff | 0 => Ok(0),
        _ => Err(Errno::EINVAL),
    }
}

const ARCH_SET_GS: u64 = 0x1001;
const ARCH_SET_FS: u64 = 0x1002;
const ARCH_GET_FS: u64 = 0x1003;
const ARCH_GET_GS: u64 = 0x1004;

pub fn arch_prctl(ctx: &mut Ctx, a: &Args) -> SysResult {
    match a[0] {
        ARCH_SET_FS => {
            if a[1] >= 1 << 47 {
                return Err(Errno::EPERM);
            }
            ctx.proc.fs_base = a[1];
            ctx.effect = Some(Effect::SetFsBase(a[1]));
            Ok(0)
        }
        ARCH_GET_FS => {
            let v = ctx.proc.fs_base;
            ctx.write_u64(a[1], v)?;
            Ok(0)
        }
        ARCH_GET_GS => {
            ctx.write_u64(a[1], 0)?;
            Ok(0)
        }
        ARCH_SET_GS => Err(Errno::EPERM),
        _ => Err(Errno::EINVAL),
    }
}

pub fn exit_group(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.effect = Some(Effect::Exit(a[0] as i32 & 0xFF));
    Ok(0)
}

/// prctl: names and harmless flags succeed; nothing else exists.
pub fn prctl(ctx: &mut Ctx, a: &Args) -> SysResult {
    match a[0] as i32 {
        libc::PR_SET_NAME | libc::PR_SET_DUMPABLE | libc::PR_SET_PDEATHSIG | libc::PR_SET_NO_NEW_PRIVS => Ok(0),
        libc::PR_GET_NAME => {
            ctx.write_bytes(a[1], b"python3\0\0\0\0\0\0\0\0\0")?;
            Ok(0)
        }
        libc::PR_GET_DUMPABLE => Ok(0),
        _ => Err(Errno::EINVAL),
    }
}

pub fn getrusage(ctx: &mut Ctx, a: &Args) -> SysResult {
    let mut b = [0u8; 144];
    let (s, ns) = cpu_time();
    b[..8].copy_from_slice(&s.to_le_bytes());
    b[8..16].copy_from_slice(&(ns / 1000).to_le_bytes());
    // ru_maxrss in KiB
    b[32..40].copy_from_slice(&((ctx.proc.mm.committed() / 1024) as i64).to_le_bytes());
    ctx.write_bytes(a[1], &b)?;
    Ok(0)
}

pub fn times(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (s, ns) = cpu_time();
    let ticks = (s * 100 + ns / 10_000_000) as u64;
    if a[0] != 0 {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&ticks.to_le_bytes());
        ctx.write_bytes(a[0], &b)?;
    }
    let (rs, rns) = super::sys_time::realtime();
    Ok((rs * 100 + rns / 10_000_000) as u64)
}

pub fn uname(ctx: &mut Ctx, a: &Args) -> SysResult {
    let mut b = [0u8; 65 * 6];
    for (i, s) in ["Linux", "forkbox", "6.1.0-forkbox", "#1 SMP forkbox", "x86_64", "(none)"].iter().enumerate() {
        b[i * 65..i * 65 + s.len()].copy_from_slice(s.as_bytes());
    }
    ctx.write_bytes(a[0], &b)?;
    Ok(0)
}

pub fn sysinfo(ctx: &mut Ctx, a: &Args) -> SysResult {
    let total = ctx.proc.mm.limit();
    let free = total.saturating_sub(ctx.proc.mm.committed());
    let info = crate::abi::Sysinfo {
        // The same uptime as /proc/uptime (CLOCK_BOOTTIME).
        uptime: (crate::objects::clock_ns(libc::CLOCK_BOOTTIME) / 1_000_000_000) as i64,
        totalram: total,
        freeram: free,
        procs: ctx.kernel.procs.running() as u16,
        mem_unit: 1,
        ..Default::default()
    };
    ctx.write_bytes(a[0], zerocopy::IntoBytes::as_bytes(&info))?;
    Ok(0)
}

/// Randomness comes from the host, so every fork draws its own.
pub fn getrandom(ctx: &mut Ctx, a: &Args) -> SysResult {
    let len = a[1].min(32 << 20);
    if a[2] as u32 & !(libc::GRND_NONBLOCK | libc::GRND_RANDOM | 0x4) != 0 {
        return Err(Errno::EINVAL);
    }
    let buf = ctx.bytes_mut(a[0], len)?;
    fill_random(buf)?;
    Ok(len)
}
