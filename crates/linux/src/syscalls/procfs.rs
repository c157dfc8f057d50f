//! /proc, generated from the VMM's state: the calling process (its pid, with
//! /proc/self pointing at it; other processes are not listed) and the machine the sandbox is: one CPU, its
//! memory limit as the machine's memory. The tree is rebuilt in the overlay
//! whenever a path under /proc is looked up (`refresh`), so stat, open, read,
//! getdents and readlink all see current values and nothing else changes.

use super::sys_rlimit::rlimit;
use super::sys_time::cpu_time;
use crate::fd::FileKind;
use crate::kernel::Ctx;
use crate::objects::ObjKind;
use crate::process::NSIG;
use crate::vfs::Gen;

/// CPUs of the sandbox (one vCPU): /proc/cpuinfo, /proc/stat and sched_getaffinity agree.
pub const CPUS: usize = 1;

fn file(s: String) -> Gen {
    Gen::File(s.into_bytes(), 0o444)
}

/// Does a path (as the guest gave it, resolved from `start`) name something under /proc?
pub fn wants_refresh(path: &[u8]) -> bool {
    let p = path.strip_prefix(b"/").unwrap_or(path);
    let trimmed = {
        let mut p = p;
        while let Some(rest) = p.strip_prefix(b"/") {
            p = rest;
        }
        p
    };
    path.first() == Some(&b'/') && (trimmed == b"proc" || trimmed.starts_with(b"proc/"))
}

/// Rebuild /proc if `path` is under it.
pub fn refresh_for(ctx: &mut Ctx, path: &[u8]) {
    if wants_refresh(path) {
        refresh(ctx);
    }
}

pub fn refresh(ctx: &mut Ctx) {
    let Ok(proc_dir) = ctx.proc.vfs.lookup_abs(b"/proc") else { return };
    let tree = build(ctx);
    if let Err(e) = ctx.proc.vfs.replace_generated(proc_dir, tree) {
        tracing::warn!("procfs: could not rebuild /proc: {e}");
    }
}

fn build(ctx: &Ctx) -> Vec<(Vec<u8>, Gen)> {
    let pid = ctx.proc.pid.to_string();
    vec![
        (pid.clone().into_bytes(), Gen::Dir(process_dir(ctx))),
        (b"self".to_vec(), Gen::Symlink(pid.clone().into_bytes())),
        (b"thread-self".to_vec(), Gen::Symlink(format!("{pid}/task/{pid}").into_bytes())),
        (b"cpuinfo".to_vec(), file(cpuinfo())),
        (b"meminfo".to_vec(), file(meminfo(ctx))),
        (b"loadavg".to_vec(), file(format!("0.00 0.00 0.00 1/{} {}\n", ctx.kernel.procs.running(), ctx.proc.pid))),
        (b"uptime".to_vec(), file(uptime())),
        (b"stat".to_vec(), file(stat(ctx))),
        (b"version".to_vec(), file("Linux version 6.1.0-forkbox (forkbox) #1 SMP forkbox\n".into())),
        (b"mounts".to_vec(), Gen::Symlink(b"self/mounts".to_vec())),
        (b"filesystems".to_vec(), file("nodev\ttmpfs\nnodev\tproc\n".into())),
    ]
}

fn process_dir(ctx: &Ctx) -> Vec<(Vec<u8>, Gen)> {
    let info = &ctx.proc.exec_info;
    let cwd = ctx.proc.vfs.dir_path(ctx.proc.cwd).unwrap_or_else(|_| b"/".to_vec());
    let pid = ctx.proc.pid.to_string().into_bytes();
    vec![
        (b"status".to_vec(), file(status(ctx))),
        (b"stat".to_vec(), file(pid_stat(ctx))),
        (b"statm".to_vec(), file(statm(ctx))),
        (b"maps".to_vec(), file(maps(ctx))),
        (b"cmdline".to_vec(), Gen::File(info.cmdline.to_vec(), 0o444)),
        (b"environ".to_vec(), Gen::File(info.environ.to_vec(), 0o400)),
        (b"comm".to_vec(), file(format!("{}\n", comm(ctx)))),
        (b"limits".to_vec(), file(limits(ctx))),
        (
            b"mounts".to_vec(),
            file("overlay / overlay rw 0 0\nproc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n".into()),
        ),
        (b"exe".to_vec(), Gen::Symlink(info.exe.to_vec())),
        (b"cwd".to_vec(), Gen::Symlink(cwd)),
        (b"root".to_vec(), Gen::Symlink(b"/".to_vec())),
        (b"fd".to_vec(), Gen::Dir(fd_links(ctx))),
        (
            b"task".to_vec(),
            Gen::Dir(vec![(
                pid,
                Gen::Dir(vec![(b"stat".to_vec(), file(pid_stat(ctx))), (b"status".to_vec(), file(status(ctx)))]),
            )]),
        ),
    ]
}

fn comm(ctx: &Ctx) -> String {
    let exe = &ctx.proc.exec_info.exe;
    let base = exe.rsplit(|&c| c == b'/').next().unwrap_or(&exe[..]);
    let mut s = String::from_utf8_lossy(base).into_owned();
    s.truncate(15);
    if s.is_empty() {
        s.push_str("python3");
    }
    s
}

fn fd_links(ctx: &Ctx) -> Vec<(Vec<u8>, Gen)> {
    let fds = &ctx.proc.fds;
    fds.entries()
        .filter_map(|(fd, ofd)| {
            let f = fds.description(ofd)?;
            let target = match f.kind {
                FileKind::Node(ino) => match ctx.proc.vfs.dir_path(ino) {
                    Ok(p) => String::from_utf8_lossy(&p).into_owned(),
                    // A file's name is not kept with its description: say which inode.
                    Err(_) => format!("inode:[{ino}]"),
                },
                FileKind::Stdin | FileKind::Stdout | FileKind::Stderr => format!("pipe:[{fd}]"),
                FileKind::Agent => "pipe:[agent]".into(),
                // Inet sockets number apart from the fd objects.
                FileKind::Socket(s) => format!("socket:[{}]", (1u64 << 20) + s.id),
                FileKind::Object(id) => match fds.objects.get(id).map(|o| &o.kind) {
                    Ok(ObjKind::Pipe(_)) => format!("pipe:[{id}]"),
                    Ok(ObjKind::Socket(_)) => format!("socket:[{id}]"),
                    Ok(ObjKind::EventFd(_)) => "anon_inode:[eventfd]".into(),
                    Ok(ObjKind::Epoll(_)) => "anon_inode:[eventpoll]".into(),
                    Ok(ObjKind::TimerFd(_)) => "anon_inode:[timerfd]".into(),
                    Ok(ObjKind::Inotify(_)) => "anon_inode:inotify".into(),
                    Ok(ObjKind::PtyMaster(_)) => "/dev/ptmx".into(),
                    Ok(ObjKind::PtySlave(_)) => match fds.objects.pty(id) {
                        Ok(p) => crate::file::pty::pts_path(p.index),
                        Err(_) => "/dev/pts/(deleted)".into(),
                    },
                    Err(_) => return None,
                },
            };
            Some((fd.to_string().into_bytes(), Gen::Symlink(target.into_bytes())))
        })
        .collect()
}

fn kib(bytes: u64) -> u64 {
    bytes / 1024
}

fn sig_sets(ctx: &Ctx) -> (u64, u64) {
    let (mut ign, mut cgt) = (0u64, 0u64);
    for sig in 1..=NSIG {
        let h = u64::from_le_bytes(ctx.proc.signals.actions[sig][..8].try_into().unwrap_or_default());
        match h {
            0 => {}
            1 => ign |= 1 << (sig - 1),
            _ => cgt |= 1 << (sig - 1),
        }
    }
    (ign, cgt)
}

/// Capabilities of root (CAP_CHOWN..CAP_CHECKPOINT_RESTORE), as CapBnd lists them.
const ALL_CAPS: u64 = 0x1ff_ffff_ffff;

/// Real, effective, saved and fs ids as /proc/PID/status lists them.
fn ids(i: crate::creds::Ids) -> String {
    format!("{}\t{}\t{}\t{}", i.real, i.effective, i.saved, i.fs)
}

fn status(ctx: &Ctx) -> String {
    let mm = &ctx.proc.mm;
    let vm = kib(mm.committed());
    let (ign, cgt) = sig_sets(ctx);
    let pid = ctx.proc.pid;
    let u = ctx.proc.creds.uid;
    format!(
        "Name:\t{name}\nUmask:\t{umask:04o}\nState:\tR (running)\nTgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\nPPid:\t{ppid}\n\
         TracerPid:\t0\nUid:\t{uid}\nGid:\t{gid}\nFDSize:\t{fdsize}\nGroups:\t{groups}\n\
         VmPeak:\t{vm:8} kB\nVmSize:\t{vm:8} kB\nVmLck:\t       0 kB\nVmPin:\t       0 kB\nVmHWM:\t{vm:8} kB\n\
         VmRSS:\t{vm:8} kB\nRssAnon:\t{vm:8} kB\nRssFile:\t       0 kB\nRssShmem:\t       0 kB\n\
         VmData:\t{heap:8} kB\nVmStk:\t{stk:8} kB\nVmExe:\t       0 kB\nVmLib:\t       0 kB\nVmPTE:\t       0 kB\n\
         VmSwap:\t       0 kB\nThreads:\t1\nSigQ:\t0/0\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n\
         SigBlk:\t{blk:016x}\nSigIgn:\t{ign:016x}\nSigCgt:\t{cgt:016x}\nCapInh:\t0000000000000000\n\
         CapPrm:\t{cap_prm:016x}\nCapEff:\t{cap_eff:016x}\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n\
         NoNewPrivs:\t1\nSeccomp:\t0\nCpus_allowed:\t{cpus:x}\nCpus_allowed_list:\t0\nMems_allowed:\t1\n\
         Mems_allowed_list:\t0\nvoluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n",
        name = comm(ctx),
        ppid = ctx.kernel.procs.get(pid).map_or(1, |e| e.ppid),
        umask = ctx.proc.umask,
        uid = ids(ctx.proc.creds.uid),
        gid = ids(ctx.proc.creds.gid),
        groups = ctx.proc.creds.groups.iter().map(|g| format!("{g} ")).collect::<String>(),
        cap_prm = if [u.real, u.effective, u.saved].contains(&0) { ALL_CAPS } else { 0 },
        cap_eff = if u.effective == 0 { ALL_CAPS } else { 0 },
        fdsize = crate::fd::MAX_FDS,
        heap = kib(mm.heap_bytes()),
        stk = kib(crate::layout::STACK_SIZE),
        blk = ctx.proc.signals.mask,
        cpus = (1u64 << CPUS) - 1,
    )
}

fn ticks() -> (u64, u64) {
    let (s, ns) = cpu_time();
    let cpu = (s.max(0) as u64) * 100 + (ns.max(0) as u64) / 10_000_000;
    (cpu, uptime_secs_f64_ticks())
}

fn uptime_secs_f64_ticks() -> u64 {
    crate::objects::clock_ns(libc::CLOCK_BOOTTIME) / 10_000_000
}

fn pid_stat(ctx: &Ctx) -> String {
    let mm = &ctx.proc.mm;
    let (cpu, _) = ticks();
    let pid = ctx.proc.pid;
    let e = ctx.kernel.procs.get(pid).cloned();
    let vsize = mm.committed();
    let rss = vsize / 4096;
    format!(
        "{pid} ({comm}) R {ppid} {pgid} {sid} 0 -1 4194560 0 0 0 0 {cpu} 0 0 0 20 0 1 0 0 {vsize} {rss} {lim} \
         0 0 0 0 0 0 {blk} {ign} {cgt} 0 0 0 17 0 0 0 0 0 0 {brk0} {brk} {brk} 0 0 0 0 0\n",
        ppid = e.as_ref().map_or(1, |e| e.ppid),
        pgid = e.as_ref().map_or(pid, |e| e.pgid),
        sid = e.as_ref().map_or(pid, |e| e.sid),
        comm = comm(ctx),
        lim = u64::MAX,
        blk = ctx.proc.signals.mask,
        ign = sig_sets(ctx).0,
        cgt = sig_sets(ctx).1,
        brk0 = mm.brk_start,
        brk = mm.brk,
    )
}

fn statm(ctx: &Ctx) -> String {
    let pages = ctx.proc.mm.committed() / 4096;
    let data = ctx.proc.mm.heap_bytes() / 4096;
    format!("{pages} {pages} 0 0 0 {data} 0\n")
}

fn maps(ctx: &Ctx) -> String {
    use crate::mm::VmaKind;
    let mm = &ctx.proc.mm;
    let mut out = String::new();
    let mut line = |start: u64, end: u64, prot: u32, shared: bool, off: u64, name: &str| {
        let p = |bit: i32, c: char| if prot & bit as u32 != 0 { c } else { '-' };
        out.push_str(&format!(
            "{start:08x}-{end:08x} {}{}{}{} {off:08x} 00:00 0{}{name}\n",
            p(libc::PROT_READ, 'r'),
            p(libc::PROT_WRITE, 'w'),
            p(libc::PROT_EXEC, 'x'),
            if shared { 's' } else { 'p' },
            if name.is_empty() { "" } else { "                          " },
        ));
    };
    let heap_end = mm.brk.next_multiple_of(4096);
    let mut heap_done = mm.brk_start >= heap_end;
    let rw = (libc::PROT_READ | libc::PROT_WRITE) as u32;
    for (start, v) in mm.vmas() {
        if !heap_done && start >= mm.brk_start {
            line(mm.brk_start, heap_end, rw, false, 0, "[heap]");
            heap_done = true;
        }
        let (shared, off, name) = match v.kind {
            VmaKind::Stack => (false, 0, "[stack]"),
            VmaKind::SharedFile { offset, .. } => (true, offset, ""),
            VmaKind::Shm { offset, ino: Some(_), .. } => (true, offset, ""),
            VmaKind::Shm { offset, ino: None, .. } => (true, offset, "/dev/zero (deleted)"),
            VmaKind::Anon | VmaKind::File => (false, 0, ""),
        };
        line(start, v.end, v.prot, shared, off, name);
    }
    if !heap_done {
        line(mm.brk_start, heap_end, rw, false, 0, "[heap]");
    }
    out
}

fn limits(ctx: &Ctx) -> String {
    let rows: [(&str, u32, &str); 16] = [
        ("Max cpu time", libc::RLIMIT_CPU, "seconds"),
        ("Max file size", libc::RLIMIT_FSIZE, "bytes"),
        ("Max data size", libc::RLIMIT_DATA, "bytes"),
        ("Max stack size", libc::RLIMIT_STACK, "bytes"),
        ("Max core file size", libc::RLIMIT_CORE, "bytes"),
        ("Max resident set", libc::RLIMIT_RSS, "bytes"),
        ("Max processes", libc::RLIMIT_NPROC, "processes"),
        ("Max open files", libc::RLIMIT_NOFILE, "files"),
        ("Max locked memory", libc::RLIMIT_MEMLOCK, "bytes"),
        ("Max address space", libc::RLIMIT_AS, "bytes"),
        ("Max file locks", libc::RLIMIT_LOCKS, "locks"),
        ("Max pending signals", libc::RLIMIT_SIGPENDING, "signals"),
        ("Max msgqueue size", libc::RLIMIT_MSGQUEUE, "bytes"),
        ("Max nice priority", libc::RLIMIT_NICE, ""),
        ("Max realtime priority", libc::RLIMIT_RTPRIO, ""),
        ("Max realtime timeout", libc::RLIMIT_RTTIME, "us"),
    ];
    let mut out = format!("{:<26}{:<21}{:<21}{:<10}\n", "Limit", "Soft Limit", "Hard Limit", "Units");
    let show = |v: u64| if v == u64::MAX { "unlimited".to_string() } else { v.to_string() };
    for (name, res, unit) in rows {
        let (cur, max) = rlimit(res, ctx).unwrap_or((u64::MAX, u64::MAX));
        out.push_str(&format!("{name:<26}{:<21}{:<21}{unit:<10}\n", show(cur), show(max)));
    }
    out
}

fn meminfo(ctx: &Ctx) -> String {
    let total = kib(ctx.proc.mm.limit());
    let free = kib(ctx.proc.mm.limit().saturating_sub(ctx.proc.mm.committed()));
    let shmem = kib(ctx.proc.vfs.overlay_bytes());
    format!(
        "MemTotal:       {total:8} kB\nMemFree:        {free:8} kB\nMemAvailable:   {free:8} kB\n\
         Buffers:               0 kB\nCached:                0 kB\nSwapCached:            0 kB\n\
         Active:                0 kB\nInactive:              0 kB\nShmem:          {shmem:8} kB\n\
         SwapTotal:             0 kB\nSwapFree:              0 kB\nCommitLimit:    {total:8} kB\n\
         Committed_AS:   {used:8} kB\nHugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:       2048 kB\n",
        used = total - free,
    )
}

fn uptime() -> String {
    let ns = crate::objects::clock_ns(libc::CLOCK_BOOTTIME);
    let (s, cs) = (ns / 1_000_000_000, ns % 1_000_000_000 / 10_000_000);
    format!("{s}.{cs:02} 0.00\n")
}

fn stat(_ctx: &Ctx) -> String {
    let (cpu, up) = ticks();
    let idle = up.saturating_sub(cpu);
    let (rs, _) = super::sys_time::realtime();
    let btime = (rs.max(0) as u64).saturating_sub(up / 100);
    let mut out = format!("cpu  {cpu} 0 0 {idle} 0 0 0 0 0 0\n");
    for i in 0..CPUS {
        out.push_str(&format!("cpu{i} {cpu} 0 0 {idle} 0 0 0 0 0 0\n"));
    }
    out.push_str(&format!(
        "intr 0\nctxt 0\nbtime {btime}\nprocesses 1\nprocs_running 1\nprocs_blocked 0\nsoftirq 0 0 0 0 0 0 0 0 0 0 0\n"
    ));
    out
}

/// The host CPU's vendor and brand strings (cpuid), what the guest's own cpuid shows too.
fn cpu_names() -> (String, String) {
    use std::arch::x86_64::__cpuid;
    let l0 = __cpuid(0);
    let mut vendor = Vec::new();
    for r in [l0.ebx, l0.edx, l0.ecx] {
        vendor.extend_from_slice(&r.to_le_bytes());
    }
    let ext = __cpuid(0x8000_0000).eax;
    let mut brand = Vec::new();
    if ext >= 0x8000_0004 {
        for leaf in 0x8000_0002..=0x8000_0004u32 {
            let r = __cpuid(leaf);
            for v in [r.eax, r.ebx, r.ecx, r.edx] {
                brand.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let clean = |b: Vec<u8>| String::from_utf8_lossy(&b).trim_matches(char::from(0)).trim().to_string();
    (clean(vendor), clean(brand))
}

fn cpuinfo() -> String {
    let (vendor, brand) = cpu_names();
    let mut out = String::new();
    for i in 0..CPUS {
        out.push_str(&format!(
            "processor\t: {i}\nvendor_id\t: {vendor}\nmodel name\t: {brand}\nphysical id\t: 0\nsiblings\t: {CPUS}\n\
             core id\t\t: {i}\ncpu cores\t: {CPUS}\napicid\t\t: {i}\nfpu\t\t: yes\nflags\t\t: fpu tsc sse sse2\n\
             bogomips\t: 4000.00\nclflush size\t: 64\ncache_alignment\t: 64\naddress sizes\t: 46 bits physical, 48 bits virtual\n\n"
        ));
    }
    out
}
