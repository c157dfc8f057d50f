//! The x86-64 syscall table: number, name, handler, support level (with a
//! one-line note for every partial or refused entry). One entry per line.
//! The syscall table of docs/syscalls.md is generated from it (`forkbox syscalls
//! --markdown`; a test checks the document matches).

use std::sync::OnceLock;

use super::{
    sys_file as file, sys_fs as fs, sys_mm as mm, sys_process as process, sys_signal as signal, sys_time as time,
};
use super::{sys_fork as fork, sys_inotify as inotify, sys_lock as lock, sys_pipe as pipe, sys_unix as unix};
use super::{sys_rlimit as rlimit, sys_socket as net, sys_thread as thread, sys_timer as timer};
use crate::errno::{Errno, SysResult};
use crate::kernel::{Args, Ctx, Handler};

/// Whether syscall `nr`, interrupted by a signal whose handler has
/// SA_RESTART, is restarted (else it fails with EINTR): the table's restart
/// column, with a futex wait's timeout (`arg3`, the fourth argument) looked at.
pub fn restarts_under_sa_restart(nr: u64, arg3: u64) -> bool {
    match entry(nr).map_or(Restart::Always, |e| e.restart) {
        Restart::Always => true,
        Restart::Never => false,
        Restart::UnlessTimed => arg3 == 0,
    }
}

/// What SA_RESTART does to a call a signal handler interrupted (signal(7)):
/// the multiplexing, sleep and signal-wait calls never restart, and neither
/// does a futex wait with a timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    Always,
    Never,
    UnlessTimed,
}

impl Restart {
    pub fn describe(&self) -> &'static str {
        match self {
            Restart::Always => "yes",
            Restart::Never => "no",
            Restart::UnlessTimed => "without a timeout",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Linux semantics for everything a guest can ask.
    Full,
    /// Works for the common cases; the note says what works and what does not.
    Partial(&'static str),
    /// Refused with this errno, by the dispatcher (no handler runs): the
    /// sandbox has no such thing, or it is not implemented; the note starts
    /// with the errno's name and says why.
    Refused(Errno, &'static str),
}

impl Support {
    pub fn level(&self) -> &'static str {
        match self {
            Support::Full => "full",
            Support::Partial(_) => "partial",
            Support::Refused(..) => "refused",
        }
    }

    pub fn note(&self) -> Option<&'static str> {
        match self {
            Support::Full => None,
            Support::Partial(n) | Support::Refused(_, n) => Some(n),
        }
    }
}

pub struct Entry {
    pub nr: u64,
    pub name: &'static str,
    /// None exactly for refused entries.
    pub handler: Option<Handler>,
    pub support: Support,
    pub restart: Restart,
}

impl Entry {
    /// Run the call: a refused one fails with its errno.
    pub fn run(&self, ctx: &mut Ctx, args: &Args) -> SysResult {
        match (self.support, self.handler) {
            (Support::Refused(errno, _), _) => Err(errno),
            (_, Some(h)) => h(ctx, args),
            // Not in the table as built (a test checks every other entry has a handler).
            (_, None) => Err(Errno::ENOSYS),
        }
    }
}

use Support::*;

/// `NR name => handler, support[, restart];`, or `NR name, Refused(..);`
/// for a call refused without a handler.
macro_rules! table {
    ($($nr:literal $name:ident $(=> $handler:path)?, $support:expr $(, $restart:ident)?;)*) => {
        pub static TABLE: &[Entry] = &[
            $(Entry {
                nr: $nr,
                name: stringify!($name),
                handler: table!(@handler $($handler)?),
                support: $support,
                restart: table!(@restart $($restart)?),
            },)*
        ];
    };
    (@handler) => { None };
    (@handler $h:path) => { Some($h) };
    (@restart) => { Restart::Always };
    (@restart $r:ident) => { Restart::$r };
}

table! {
    0 read => file::read, Full;
    1 write => file::write, Full;
    2 open => fs::open, Full;
    3 close => file::close, Full;
    4 stat => fs::stat, Full;
    5 fstat => fs::fstat, Full;
    6 lstat => fs::lstat, Full;
    7 poll => file::poll, Partial("readiness of every fd the VMM owns (files, pipes, sockets, eventfd, timerfd, epoll, inotify); a wait blocks until an fd is ready, the timeout or an interrupt; POLLPRI never set"), Never;
    8 lseek => file::lseek, Full;
    9 mmap => mm::mmap, Partial("private file maps: bytes copied in (no page cache); MAP_SHARED (file, memfd, anonymous) shared between processes, written back on msync/munmap/exit; no MAP_GROWSDOWN/huge pages");
    10 mprotect => mm::mprotect, Partial("enforced by the guest page tables (read-only, no-execute, PROT_NONE not present); no protection keys, no PROT_GROWSDOWN");
    11 munmap => mm::munmap, Full;
    12 brk => mm::brk, Full;
    13 rt_sigaction => signal::rt_sigaction, Partial("handlers run for signals from the sandbox's own processes and threads, its timers, its CPU faults and the host interrupt; SA_RESTART as the restart column says");
    14 rt_sigprocmask => signal::rt_sigprocmask, Full;
    15 rt_sigreturn => signal::rt_sigreturn, Full;
    16 ioctl => file::ioctl, Partial("FIOCLEX, FIONCLEX, FIONBIO, FIONREAD; SIOCGIFINDEX/SIOCGIFNAME know lo only; ptys: termios, window size, controlling tty, foreground group, pty number, lock, peer, TCFLSH; else ENOTTY");
    17 pread64 => file::pread64, Full;
    18 pwrite64 => file::pwrite64, Full;
    19 readv => file::readv, Full;
    20 writev => file::writev, Full;
    21 access => fs::access, Full;
    22 pipe => pipe::pipe, Full;
    23 select => file::select, Partial("readiness of every fd the VMM owns (files, pipes, sockets, eventfd, timerfd, epoll, inotify); exceptfds never set"), Never;
    24 sched_yield => thread::sched_yield, Full;
    25 mremap => mm::mremap, Full;
    26 msync => mm::msync, Full;
    27 mincore, Refused(Errno::ENOSYS, "ENOSYS: not implemented (page residency is the host's business)");
    28 madvise => mm::madvise, Partial("MADV_DONTNEED/MADV_FREE give the pages back (they read as zeros); every other advice is accepted and ignored");
    29 shmget, Refused(Errno::ENOSYS, "ENOSYS: System V shared memory is not implemented (mmap MAP_SHARED and memfd are)");
    30 shmat, Refused(Errno::ENOSYS, "ENOSYS: System V shared memory is not implemented (mmap MAP_SHARED and memfd are)");
    31 shmctl, Refused(Errno::ENOSYS, "ENOSYS: System V shared memory is not implemented (mmap MAP_SHARED and memfd are)");
    32 dup => file::dup, Full;
    33 dup2 => file::dup2, Full;
    34 pause => signal::pause, Full, Never;
    35 nanosleep => time::nanosleep, Full, Never;
    36 getitimer => timer::getitimer, Partial("ITIMER_REAL on the run clock; ITIMER_VIRTUAL and ITIMER_PROF both on the process's vCPU run time (user and system time are not told apart)");
    37 alarm => timer::alarm, Full;
    38 setitimer => timer::setitimer, Partial("ITIMER_REAL on the run clock; ITIMER_VIRTUAL and ITIMER_PROF both on the process's vCPU run time (user and system time are not told apart)");
    39 getpid => fork::getpid, Full;
    40 sendfile => file::sendfile, Full;
    41 socket => net::socket, Partial("AF_UNIX in the sandbox; AF_INET/6 TCP, UDP under the egress policy, UDP-Lite in the sandbox; raw EPERM; NETLINK_ROUTE lists lo only (RTM_GETLINK); other families EAFNOSUPPORT");
    42 connect => net::connect, Full;
    43 accept => net::accept, Full;
    44 sendto => net::sendto, Full;
    45 recvfrom => net::recvfrom, Full;
    46 sendmsg => net::sendmsg, Partial("AF_UNIX: data and fd passing (SCM_RIGHTS, at most 253 a message and 1024 in flight per sandbox: ETOOMANYREFS); SCM_CREDENTIALS EOPNOTSUPP; AF_INET*: data, IPV6_HOPLIMIT/TCLASS to the sandbox's sockets");
    47 recvmsg => net::recvmsg, Partial("AF_UNIX: data and SCM_RIGHTS (MSG_CTRUNC, MSG_CMSG_CLOEXEC); no credentials; AF_INET*: data, IPV6_HOPLIMIT/TCLASS (RFC 3542) from the sandbox's sockets");
    48 shutdown => net::shutdown, Full;
    49 bind => net::bind, Partial("AF_UNIX paths; TCP, UDP: loopback or the wildcard, in the sandbox's port tables (EADDRINUSE, port 0 ephemeral, never a host port); AF_INET6 `::` holds IPv4 too unless IPV6_V6ONLY");
    50 listen => net::listen, Partial("AF_UNIX, and TCP on loopback/the wildcard inside the sandbox (never a host port; connects from the sandbox only; a full backlog refuses, where Linux drops the SYN)");
    51 getsockname => net::getsockname, Full;
    52 getpeername => net::getpeername, Full;
    53 socketpair => unix::socketpair, Full;
    54 setsockopt => net::setsockopt, Partial("the options CPython sets; on inet sockets SO_RCVTIMEO/SO_SNDTIMEO bound the waits and the others go to the host socket (buffer sizes capped at 4 MiB); on AF_UNIX buffer sizes are recorded, not applied");
    55 getsockopt => net::getsockopt, Partial("SO_TYPE, SO_DOMAIN, SO_ERROR, SO_RCVBUF/SNDBUF and the recorded options");
    56 clone => thread::clone, Partial("threads as green threads on the one vCPU; without CLONE_THREAD a new process in its own VM (CLONE_VM with CLONE_VFORK: the child gets a copy of memory)");
    57 fork => fork::fork, Partial("the child is its own VM (copy of memory, the calling thread, shared open files); at most 128 processes (EAGAIN); ENOMEM past the memory limit; children alive when the exec ends are killed");
    58 vfork => fork::vfork, Partial("a fork: the child gets a copy of memory and the parent is not suspended");
    59 execve => fork::execve, Partial("ELF programs of the file system with ld.so, `#!` scripts (4 levels), close-on-exec; pid, fds, cwd, umask, signal mask kept");
    60 exit => thread::exit, Full;
    61 wait4 => fork::wait4, Partial("exit statuses, WNOHANG, ECHILD, pid/-1/0/-pgid; no stopped/continued children (nothing stops here); rusage zeroed");
    62 kill => signal::kill, Partial("the sandbox's processes (pid, 0, -1, -pgid); a signal for another process is delivered when it next runs");
    63 uname => process::uname, Full;
    64 semget, Refused(Errno::ENOSYS, "ENOSYS: System V semaphores are not implemented (futex-based POSIX semaphores work)");
    65 semop, Refused(Errno::ENOSYS, "ENOSYS: System V semaphores are not implemented (futex-based POSIX semaphores work)"), Never;
    66 semctl, Refused(Errno::ENOSYS, "ENOSYS: System V semaphores are not implemented (futex-based POSIX semaphores work)");
    67 shmdt, Refused(Errno::ENOSYS, "ENOSYS: System V shared memory is not implemented (mmap MAP_SHARED and memfd are)");
    68 msgget, Refused(Errno::ENOSYS, "ENOSYS: System V message queues are not implemented");
    69 msgsnd, Refused(Errno::ENOSYS, "ENOSYS: System V message queues are not implemented"), Never;
    70 msgrcv, Refused(Errno::ENOSYS, "ENOSYS: System V message queues are not implemented"), Never;
    71 msgctl, Refused(Errno::ENOSYS, "ENOSYS: System V message queues are not implemented");
    72 fcntl => file::fcntl, Partial("record locks always granted (no conflicts are tracked); F_NOTIFY only without events (no dnotify)");
    73 flock => lock::flock, Partial("locks of open descriptions, between all the sandbox's processes (LOCK_NB: EWOULDBLOCK); a forked child does not share its parent's locks; not in checkpoints");
    74 fsync => file::fsync, Full;
    75 fdatasync => file::fsync, Full;
    76 truncate => fs::truncate, Full;
    77 ftruncate => file::ftruncate, Full;
    78 getdents, Refused(Errno::ENOSYS, "ENOSYS: the old 32-bit-inode form is not implemented (getdents64 is; glibc uses it)");
    79 getcwd => fs::getcwd, Full;
    80 chdir => fs::chdir, Full;
    81 fchdir => fs::fchdir, Full;
    82 rename => fs::rename, Full;
    83 mkdir => fs::mkdir, Full;
    84 rmdir => fs::rmdir, Full;
    85 creat => fs::creat, Full;
    86 link => fs::link, Full;
    87 unlink => fs::unlink, Full;
    88 symlink => fs::symlink, Full;
    89 readlink => fs::readlink, Full;
    90 chmod => fs::chmod, Full;
    91 fchmod => fs::fchmod, Full;
    92 chown => fs::chown, Partial("Linux's rules (euid 0 sets any ids; others only the group of their own file); owners kept, reported, checkpointed; new files are 0:0; no access checks");
    93 fchown => fs::fchown, Partial("Linux's rules (euid 0 sets any ids; others only the group of their own file); owners kept, reported, checkpointed; new files are 0:0; no access checks");
    94 lchown => fs::lchown, Partial("Linux's rules (euid 0 sets any ids; others only the group of their own file); owners kept, reported, checkpointed; new files are 0:0; no access checks");
    95 umask => fs::umask, Full;
    96 gettimeofday => time::gettimeofday, Full;
    97 getrlimit => rlimit::getrlimit, Full;
    98 getrusage => process::getrusage, Partial("user time = host thread CPU time, maxrss = memory mapped; other fields 0");
    99 sysinfo => process::sysinfo, Partial("total/free RAM from the memory limit and mapped memory, the sandbox's running processes, the uptime of /proc/uptime; load averages are 0");
    100 times => process::times, Partial("user time = host thread CPU time; system and children times 0");
    101 ptrace, Refused(Errno::EPERM, "EPERM: no process of the sandbox can trace another");
    102 getuid => process::getuid, Full;
    103 syslog, Refused(Errno::EPERM, "EPERM: there is no kernel log to read");
    104 getgid => process::getgid, Full;
    105 setuid => process::setuid, Partial("Linux's rules (privileged while the euid is 0); ids are kept, inherited and reported; new files are 0:0 and no access is checked against them");
    106 setgid => process::setgid, Partial("Linux's rules (privileged while the euid is 0); ids are kept, inherited and reported; new files are 0:0 and no access is checked against them");
    107 geteuid => process::geteuid, Full;
    108 getegid => process::getegid, Full;
    109 setpgid => fork::setpgid, Full;
    110 getppid => fork::getppid, Full;
    111 getpgrp => fork::getpgrp, Full;
    112 setsid => fork::setsid, Full;
    113 setreuid => process::setreuid, Partial("as setuid: Linux's rules for real, effective and saved ids; no access is checked against them");
    114 setregid => process::setregid, Partial("as setgid: Linux's rules for real, effective and saved ids; no access is checked against them");
    115 getgroups => process::getgroups, Full;
    116 setgroups => process::setgroups, Partial("privileged only (euid 0), at most 65536, kept sorted and inherited; no access is checked against them");
    117 setresuid => process::setresuid, Partial("as setuid: Linux's rules for real, effective and saved ids; no access is checked against them");
    118 getresuid => process::getresuid, Full;
    119 setresgid => process::setresgid, Partial("as setgid: Linux's rules for real, effective and saved ids; no access is checked against them");
    120 getresgid => process::getresgid, Full;
    121 getpgid => fork::getpgid, Full;
    122 setfsuid => process::setfsuid, Partial("the fs uid is kept (returns the old one) and set by every uid change; no access is checked against it");
    123 setfsgid => process::setfsgid, Partial("the fs gid is kept (returns the old one) and set by every gid change; no access is checked against it");
    124 getsid => fork::getsid, Full;
    125 capget, Refused(Errno::ENOSYS, "ENOSYS: capability sets are not modelled (the sandbox's root has uid 0 rules only)");
    126 capset, Refused(Errno::EPERM, "EPERM: capability sets are not modelled");
    127 rt_sigpending => signal::rt_sigpending, Full;
    128 rt_sigtimedwait => signal::rt_sigtimedwait, Full, Never;
    129 rt_sigqueueinfo, Refused(Errno::ENOSYS, "ENOSYS: not implemented (kill and tgkill are)");
    130 rt_sigsuspend => signal::rt_sigsuspend, Full, Never;
    131 sigaltstack => signal::sigaltstack, Full;
    132 utime => fs::utime, Full;
    133 mknod => fs::mknod, Partial("FIFOs (pipes in the overlay) and regular files; device nodes EPERM");
    134 uselib, Refused(Errno::ENOSYS, "ENOSYS: an a.out interface Linux no longer builds");
    135 personality => process::personality, Partial("PER_LINUX only: 0xffffffff reads it, PER_LINUX sets it; any other persona EINVAL");
    136 ustat, Refused(Errno::ENOSYS, "ENOSYS: obsolete (statfs is implemented)");
    137 statfs => fs::statfs, Partial("one tmpfs-like file system sized by the disk quota, whatever the path");
    138 fstatfs => fs::fstatfs, Partial("one tmpfs-like file system sized by the disk quota, whatever the fd");
    139 sysfs, Refused(Errno::ENOSYS, "ENOSYS: obsolete (/proc/filesystems is not provided either)");
    140 getpriority => process::getpriority, Partial("as setpriority: the nice values it keeps");
    141 setpriority => process::setpriority, Partial("nice values kept per process and inherited (lowering one needs euid 0: EACCES); PRIO_USER takes every process as the caller's user; no host priority changes");
    142 sched_setparam => process::sched_setparam, Partial("every thread runs under SCHED_OTHER: priority 0 is accepted, any other EINVAL");
    143 sched_getparam => process::sched_getparam, Partial("every thread runs under SCHED_OTHER: priority 0");
    144 sched_setscheduler => process::sched_setscheduler, Partial("SCHED_OTHER, SCHED_BATCH and SCHED_IDLE with priority 0 accepted (the VMM schedules the sandbox as one); real-time policies EPERM");
    145 sched_getscheduler => process::sched_getscheduler, Partial("every thread runs under SCHED_OTHER");
    146 sched_get_priority_max => process::sched_get_priority_max, Full;
    147 sched_get_priority_min => process::sched_get_priority_min, Full;
    148 sched_rr_get_interval => process::sched_rr_get_interval, Partial("every thread is SCHED_OTHER: a fixed 4 ms slice");
    149 mlock => mm::mlock, Partial("accepted, nothing recorded: guest memory is never swapped (/proc/self/status shows no locked pages)");
    150 munlock => mm::mlock, Partial("accepted, nothing recorded: guest memory is never swapped");
    151 mlockall => mm::mlockall, Partial("flags checked (EINVAL), nothing recorded: guest memory is never swapped");
    152 munlockall => mm::munlockall, Partial("accepted, nothing recorded: guest memory is never swapped");
    153 vhangup, Refused(Errno::EPERM, "EPERM: there are no terminals to hang up");
    154 modify_ldt, Refused(Errno::ENOSYS, "ENOSYS: no local descriptor tables (as a kernel built without them)");
    155 pivot_root, Refused(Errno::EPERM, "EPERM: the sandbox's root is fixed (no CAP_SYS_ADMIN)");
    156 _sysctl, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 5.5");
    157 prctl => process::prctl, Partial("PR_SET_NAME, PR_SET/GET_DUMPABLE, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS succeed (names not kept), PR_GET_NAME says python3; others EINVAL");
    158 arch_prctl => process::arch_prctl, Full;
    159 adjtimex, Refused(Errno::ENOSYS, "ENOSYS: not implemented: the clock is the host's");
    160 setrlimit => rlimit::setrlimit, Partial("validates the resource and succeeds; limits do not change");
    161 chroot, Refused(Errno::EPERM, "EPERM: the sandbox's root is fixed (no CAP_SYS_CHROOT)");
    162 sync => fs::sync, Full;
    163 acct, Refused(Errno::EPERM, "EPERM: no process accounting (no CAP_SYS_PACCT)");
    164 settimeofday, Refused(Errno::EPERM, "EPERM: the clock is the host's (no CAP_SYS_TIME)");
    165 mount, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    166 umount2, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    167 swapon, Refused(Errno::EPERM, "EPERM: no swap (no CAP_SYS_ADMIN)");
    168 swapoff, Refused(Errno::EPERM, "EPERM: no swap (no CAP_SYS_ADMIN)");
    169 reboot, Refused(Errno::EPERM, "EPERM: a sandbox ends when its session does (no CAP_SYS_BOOT)");
    170 sethostname, Refused(Errno::EPERM, "EPERM: the host and domain names are fixed (no CAP_SYS_ADMIN in the sandbox)");
    171 setdomainname, Refused(Errno::EPERM, "EPERM: the host and domain names are fixed (no CAP_SYS_ADMIN in the sandbox)");
    172 iopl, Refused(Errno::EPERM, "EPERM: no I/O ports (no CAP_SYS_RAWIO)");
    173 ioperm, Refused(Errno::EPERM, "EPERM: no I/O ports (no CAP_SYS_RAWIO)");
    174 create_module, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 2.6");
    175 init_module, Refused(Errno::EPERM, "EPERM: no kernel to load modules into (no CAP_SYS_MODULE)");
    176 delete_module, Refused(Errno::EPERM, "EPERM: no kernel modules (no CAP_SYS_MODULE)");
    177 get_kernel_syms, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 2.6");
    178 query_module, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 2.6");
    179 quotactl, Refused(Errno::EPERM, "EPERM: quotas are the overlay quota, set by the host");
    180 nfsservctl, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 3.1");
    181 getpmsg, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux (STREAMS)");
    182 putpmsg, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux (STREAMS)");
    183 afs_syscall, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux");
    184 tuxcall, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux");
    185 security, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux");
    186 gettid => thread::gettid, Full;
    187 readahead, Refused(Errno::ENOSYS, "ENOSYS: not implemented (files are read from memory; posix_fadvise is accepted)");
    188 setxattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    189 lsetxattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    190 fsetxattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    191 getxattr => fs::getxattr, Full;
    192 lgetxattr => fs::lgetxattr, Full;
    193 fgetxattr => fs::fgetxattr, Full;
    194 listxattr => fs::listxattr, Full;
    195 llistxattr => fs::llistxattr, Full;
    196 flistxattr => fs::flistxattr, Full;
    197 removexattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    198 lremovexattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    199 fremovexattr, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system stores no extended attributes");
    200 tkill => signal::tkill, Full;
    201 time => time::time, Full;
    202 futex => thread::futex, Partial("WAIT, WAKE, BITSET forms, REQUEUE, CMP_REQUEUE, WAKE_OP; wakes on MAP_SHARED memory reach other processes (requeues do not); PI and robust-list ops ENOSYS"), UnlessTimed;
    203 sched_setaffinity => process::sched_setaffinity, Partial("a mask must hold the sandbox's one CPU (EINVAL), which is then all it holds; unknown pids ESRCH");
    204 sched_getaffinity => process::sched_getaffinity, Full;
    205 set_thread_area, Refused(Errno::ENOSYS, "ENOSYS: a 32-bit TLS interface; 64-bit guests use arch_prctl");
    206 io_setup, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)");
    207 io_destroy, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)");
    208 io_getevents, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)"), Never;
    209 io_submit, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)");
    210 io_cancel, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)");
    211 get_thread_area, Refused(Errno::ENOSYS, "ENOSYS: a 32-bit TLS interface; 64-bit guests use arch_prctl");
    212 lookup_dcookie, Refused(Errno::ENOSYS, "ENOSYS: removed from Linux 6.8");
    213 epoll_create => pipe::epoll_create, Full;
    214 epoll_ctl_old, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux on x86-64");
    215 epoll_wait_old, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux on x86-64");
    216 remap_file_pages, Refused(Errno::ENOSYS, "ENOSYS: not implemented (deprecated by Linux)");
    217 getdents64 => file::getdents64, Full;
    218 set_tid_address => thread::set_tid_address, Full;
    219 restart_syscall, Refused(Errno::ENOSYS, "ENOSYS: the VMM restarts interrupted calls itself; a guest never needs it");
    220 semtimedop, Refused(Errno::ENOSYS, "ENOSYS: System V semaphores are not implemented (futex-based POSIX semaphores work)"), Never;
    221 fadvise64 => file::fsync, Full;
    222 timer_create => timer::timer_create, Partial("CLOCK_REALTIME/MONOTONIC/BOOTTIME (on the run clock) with SIGEV_SIGNAL, SIGEV_THREAD_ID or SIGEV_NONE; CPU-time clocks EINVAL");
    223 timer_settime => timer::timer_settime, Full;
    224 timer_gettime => timer::timer_gettime, Full;
    225 timer_getoverrun => timer::timer_getoverrun, Full;
    226 timer_delete => timer::timer_delete, Full;
    227 clock_settime => time::clock_settime, Partial("nothing can be set: EPERM for CLOCK_REALTIME and CPU-time clocks (no CAP_SYS_TIME: the clock is the host's), EINVAL for the others");
    228 clock_gettime => time::clock_gettime, Partial("host clocks; CPU-time clocks (also of a pid or thread: clock_getcpuclockid) read the vCPU thread's time, EINVAL for another process'");
    229 clock_getres => time::clock_getres, Full;
    230 clock_nanosleep => time::clock_nanosleep, Full, Never;
    231 exit_group => process::exit_group, Full;
    232 epoll_wait => pipe::epoll_wait, Partial("EPOLLET reports a readiness once, again when it changes or after EAGAIN (not per arrival); EPOLLONESHOT works"), Never;
    233 epoll_ctl => pipe::epoll_ctl, Partial("ADD/MOD/DEL on every fd the VMM owns (ADD and MOD re-arm an EPOLLET watch)");
    234 tgkill => signal::tgkill, Full;
    235 utimes => fs::utimes, Full;
    236 vserver, Refused(Errno::ENOSYS, "ENOSYS: never implemented by Linux");
    237 mbind, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
    238 set_mempolicy, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
    239 get_mempolicy, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
    240 mq_open, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    241 mq_unlink, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    242 mq_timedsend, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    243 mq_timedreceive, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    244 mq_notify, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    245 mq_getsetattr, Refused(Errno::ENOSYS, "ENOSYS: POSIX message queues are not implemented");
    246 kexec_load, Refused(Errno::EPERM, "EPERM: no kernel to replace (no CAP_SYS_BOOT)");
    247 waitid => fork::waitid, Partial("P_ALL, P_PID, P_PGID with WEXITED (WNOHANG, WNOWAIT); no stopped/continued children; no pidfd");
    248 add_key, Refused(Errno::ENOSYS, "ENOSYS: no kernel keyrings");
    249 request_key, Refused(Errno::ENOSYS, "ENOSYS: no kernel keyrings");
    250 keyctl, Refused(Errno::ENOSYS, "ENOSYS: no kernel keyrings");
    251 ioprio_set, Refused(Errno::ENOSYS, "ENOSYS: not implemented (setpriority is)");
    252 ioprio_get, Refused(Errno::ENOSYS, "ENOSYS: not implemented (getpriority is)");
    253 inotify_init => inotify::inotify_init, Partial("events: create, delete, modify, attrib, moves (cookie), move_self, delete_self (at the last unlink), close_write/nowrite; no access/open; 128 per sandbox; no watches after a restore");
    254 inotify_add_watch => inotify::inotify_add_watch, Partial("by inode, through symlinks unless IN_DONT_FOLLOW; IN_ONLYDIR, IN_MASK_ADD, IN_MASK_CREATE, IN_ONESHOT; 8192 watches per sandbox (ENOSPC)");
    255 inotify_rm_watch => inotify::inotify_rm_watch, Full;
    256 migrate_pages, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
    257 openat => fs::openat, Full;
    258 mkdirat => fs::mkdirat, Full;
    259 mknodat => fs::mknodat, Partial("FIFOs and regular files, as mknod; device nodes EPERM");
    260 fchownat => fs::fchownat, Partial("Linux's rules (euid 0 sets any ids; others only the group of their own file); owners kept, reported, checkpointed; new files are 0:0; no access checks");
    261 futimesat => fs::futimesat, Full;
    262 newfstatat => fs::newfstatat, Full;
    263 unlinkat => fs::unlinkat, Full;
    264 renameat => fs::renameat, Full;
    265 linkat => fs::linkat, Full;
    266 symlinkat => fs::symlinkat, Full;
    267 readlinkat => fs::readlinkat, Full;
    268 fchmodat => fs::fchmodat, Full;
    269 faccessat => fs::faccessat, Full;
    270 pselect6 => file::pselect6, Partial("as select; the signal mask argument is ignored"), Never;
    271 ppoll => file::ppoll, Partial("as poll; the signal mask argument is ignored"), Never;
    272 unshare, Refused(Errno::EPERM, "EPERM: the sandbox is one set of namespaces (no CAP_SYS_ADMIN)");
    273 set_robust_list => process::set_robust_list, Full;
    274 get_robust_list, Refused(Errno::ENOSYS, "ENOSYS: not implemented (set_robust_list is recorded)");
    275 splice, Refused(Errno::ENOSYS, "ENOSYS: not implemented (sendfile and copy_file_range are)");
    276 tee, Refused(Errno::ENOSYS, "ENOSYS: not implemented (sendfile and copy_file_range are)");
    277 sync_file_range => fs::sync_file_range, Full;
    278 vmsplice, Refused(Errno::ENOSYS, "ENOSYS: not implemented (sendfile and copy_file_range are)");
    279 move_pages, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
    280 utimensat => fs::utimensat, Full;
    281 epoll_pwait => pipe::epoll_pwait, Partial("as epoll_wait, with the signal mask applied for the call"), Never;
    282 signalfd, Refused(Errno::ENOSYS, "ENOSYS: not implemented (handlers, sigwait and sigtimedwait are)");
    283 timerfd_create => pipe::timerfd_create, Full;
    284 eventfd => pipe::eventfd, Full;
    285 fallocate => file::fallocate, Partial("as tmpfs: mode 0 (grows the file, quota-charged), KEEP_SIZE, PUNCH_HOLE with KEEP_SIZE (zeroes); other modes EOPNOTSUPP");
    286 timerfd_settime => pipe::timerfd_settime, Full;
    287 timerfd_gettime => pipe::timerfd_gettime, Full;
    288 accept4 => net::accept4, Full;
    289 signalfd4, Refused(Errno::ENOSYS, "ENOSYS: not implemented (handlers, sigwait and sigtimedwait are)");
    290 eventfd2 => pipe::eventfd2, Full;
    291 epoll_create1 => pipe::epoll_create1, Full;
    292 dup3 => file::dup3, Full;
    293 pipe2 => pipe::pipe2, Full;
    294 inotify_init1 => inotify::inotify_init1, Partial("events: create, delete, modify, attrib, moves (cookie), move_self, delete_self (at the last unlink), close_write/nowrite; no access/open; 128 per sandbox; no watches after a restore");
    295 preadv => file::preadv, Full;
    296 pwritev => file::pwritev, Full;
    297 rt_tgsigqueueinfo, Refused(Errno::ENOSYS, "ENOSYS: not implemented (kill and tgkill are)");
    298 perf_event_open, Refused(Errno::EPERM, "EPERM: no performance counters in the sandbox");
    299 recvmmsg => net::recvmmsg, Partial("up to 64 messages per call on inet sockets (MSG_WAITFORONE); no ancillary data");
    300 fanotify_init, Refused(Errno::EPERM, "EPERM: no file system notification (no CAP_SYS_ADMIN)");
    301 fanotify_mark, Refused(Errno::EPERM, "EPERM: no file system notification (no CAP_SYS_ADMIN)");
    302 prlimit64 => rlimit::prlimit64, Partial("reads its own limits (stack, fds, memory, 128 processes, no core); new limits are ignored");
    303 name_to_handle_at, Refused(Errno::EOPNOTSUPP, "EOPNOTSUPP: the file system has no file handles");
    304 open_by_handle_at, Refused(Errno::EPERM, "EPERM: the file system has no file handles (no CAP_DAC_READ_SEARCH)");
    305 clock_adjtime, Refused(Errno::ENOSYS, "ENOSYS: not implemented: the clock is the host's");
    306 syncfs => fs::syncfs, Full;
    307 sendmmsg => net::sendmmsg, Partial("up to 64 messages per call on inet sockets (glibc's resolver uses it); no ancillary data");
    308 setns, Refused(Errno::EPERM, "EPERM: the sandbox is one set of namespaces (no CAP_SYS_ADMIN)");
    309 getcpu => process::getcpu, Full;
    310 process_vm_readv, Refused(Errno::EPERM, "EPERM: no process of the sandbox can read another's memory");
    311 process_vm_writev, Refused(Errno::EPERM, "EPERM: no process of the sandbox can write another's memory");
    312 kcmp, Refused(Errno::ENOSYS, "ENOSYS: not implemented");
    313 finit_module, Refused(Errno::EPERM, "EPERM: no kernel to load modules into (no CAP_SYS_MODULE)");
    314 sched_setattr, Refused(Errno::ENOSYS, "ENOSYS: not implemented (sched_setscheduler is)");
    315 sched_getattr, Refused(Errno::ENOSYS, "ENOSYS: not implemented (sched_getscheduler is)");
    316 renameat2 => fs::renameat2, Partial("flags 0, RENAME_NOREPLACE and RENAME_EXCHANGE; RENAME_WHITEOUT is EINVAL");
    317 seccomp, Refused(Errno::ENOSYS, "ENOSYS: filters are not applied inside the sandbox (the VMM is the filter)");
    318 getrandom => process::getrandom, Full;
    319 memfd_create => fs::memfd_create, Partial("an unlinked file in the overlay; no sealing (F_ADD_SEALS EINVAL)");
    320 kexec_file_load, Refused(Errno::EPERM, "EPERM: no kernel to replace (no CAP_SYS_BOOT)");
    321 bpf, Refused(Errno::EPERM, "EPERM: no BPF in the sandbox");
    322 execveat => fork::execveat, Partial("as execve, from a directory fd; AT_EMPTY_PATH runs the fd's own file (fexecve, named /dev/fd/N); AT_SYMLINK_NOFOLLOW");
    323 userfaultfd, Refused(Errno::EPERM, "EPERM: page faults are the VMM's");
    324 membarrier, Refused(Errno::ENOSYS, "ENOSYS: not implemented (CPython and glibc do not need it)");
    325 mlock2 => mm::mlock2, Partial("flags checked (EINVAL), nothing recorded: guest memory is never swapped");
    326 copy_file_range => file::copy_file_range, Full;
    327 preadv2 => file::preadv2, Partial("as preadv (offset -1: the file position); RWF_HIPRI, RWF_DSYNC and RWF_SYNC have nothing to do; RWF_NOWAIT, RWF_APPEND and unknown flags EOPNOTSUPP");
    328 pwritev2 => file::pwritev2, Partial("as pwritev (offset -1: the file position); RWF_HIPRI, RWF_DSYNC and RWF_SYNC have nothing to do; RWF_NOWAIT, RWF_APPEND and unknown flags EOPNOTSUPP");
    329 pkey_mprotect, Refused(Errno::ENOSYS, "ENOSYS: no memory protection keys");
    330 pkey_alloc, Refused(Errno::ENOSYS, "ENOSYS: no memory protection keys");
    331 pkey_free, Refused(Errno::ENOSYS, "ENOSYS: no memory protection keys");
    332 statx => fs::statx, Full;
    333 io_pgetevents, Refused(Errno::ENOSYS, "ENOSYS: Linux AIO is not implemented (glibc's POSIX AIO uses threads and works)"), Never;
    334 rseq, Refused(Errno::ENOSYS, "ENOSYS: glibc falls back to no restartable sequences");
    424 pidfd_send_signal, Refused(Errno::ENOSYS, "ENOSYS: no pidfds (callers fall back to kill)");
    425 io_uring_setup, Refused(Errno::ENOSYS, "ENOSYS: io_uring is not implemented (callers fall back to read/write)");
    426 io_uring_enter, Refused(Errno::ENOSYS, "ENOSYS: io_uring is not implemented (callers fall back to read/write)");
    427 io_uring_register, Refused(Errno::ENOSYS, "ENOSYS: io_uring is not implemented (callers fall back to read/write)");
    428 open_tree, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    429 move_mount, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    430 fsopen, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    431 fsconfig, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    432 fsmount, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    433 fspick, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    434 pidfd_open, Refused(Errno::ENOSYS, "ENOSYS: no pidfds (callers fall back to wait4)");
    435 clone3 => thread::clone3, Partial("as clone (threads, or a new process in its own VM); no set_tid, cgroup or pidfd");
    436 close_range => file::close_range, Full;
    437 openat2, Refused(Errno::ENOSYS, "ENOSYS: not implemented (callers fall back to openat)");
    438 pidfd_getfd, Refused(Errno::ENOSYS, "ENOSYS: no pidfds");
    439 faccessat2 => fs::faccessat2, Full;
    440 process_madvise, Refused(Errno::ENOSYS, "ENOSYS: not implemented");
    441 epoll_pwait2 => pipe::epoll_pwait2, Partial("as epoll_pwait, with a timespec timeout"), Never;
    442 mount_setattr, Refused(Errno::EPERM, "EPERM: the file system tree is fixed (no CAP_SYS_ADMIN)");
    443 quotactl_fd, Refused(Errno::EPERM, "EPERM: quotas are the overlay quota, set by the host");
    444 landlock_create_ruleset, Refused(Errno::ENOSYS, "ENOSYS: no Landlock (as a kernel built without it)");
    445 landlock_add_rule, Refused(Errno::ENOSYS, "ENOSYS: no Landlock (as a kernel built without it)");
    446 landlock_restrict_self, Refused(Errno::ENOSYS, "ENOSYS: no Landlock (as a kernel built without it)");
    447 memfd_secret, Refused(Errno::ENOSYS, "ENOSYS: not implemented (memfd_create is)");
    448 process_mrelease, Refused(Errno::ENOSYS, "ENOSYS: not implemented");
    449 futex_waitv, Refused(Errno::ENOSYS, "ENOSYS: not implemented (futex is)");
    450 set_mempolicy_home_node, Refused(Errno::ENOSYS, "ENOSYS: no NUMA: the sandbox has one node");
}

/// Table entry by number (a dense index built on first use).
pub fn entry(nr: u64) -> Option<&'static Entry> {
    static INDEX: OnceLock<Vec<Option<&'static Entry>>> = OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let max = TABLE.iter().map(|e| e.nr).max().unwrap_or(0) as usize;
        let mut v = vec![None; max + 1];
        for e in TABLE {
            v[e.nr as usize] = Some(e);
        }
        v
    });
    index.get(usize::try_from(nr).ok()?).copied().flatten()
}

/// Where the generated table sits in docs/syscalls.md.
pub const README_BEGIN: &str =
    "<!-- syscall table: generated from crates/linux/src/syscalls/table.rs by `forkbox syscalls --markdown`; do not edit -->";
pub const README_END: &str = "<!-- end of syscall table -->";

/// The syscall table as Markdown: one row per entry, in number order.
pub fn markdown() -> String {
    let count = |f: fn(&Support) -> bool| TABLE.iter().filter(|e| f(&e.support)).count();
    let mut s = format!(
        "Every x86-64 system call number, {} in all: {} full, {} partial, {} refused (with the errno the guest gets). A number past the table returns ENOSYS (`forkbox run --trace-syscalls` lists the partial, refused and unknown calls a run made). The restart column says whether a call a signal handler with SA_RESTART interrupted is restarted (else EINTR).\n\n",
        TABLE.len(),
        count(|s| matches!(s, Full)),
        count(|s| matches!(s, Partial(_))),
        count(|s| matches!(s, Refused(..))),
    );
    s.push_str("| nr | syscall | support | restart | what works, what does not |\n|---:|---|---|---|---|\n");
    let mut sorted: Vec<&Entry> = TABLE.iter().collect();
    sorted.sort_by_key(|e| e.nr);
    for e in sorted {
        s.push_str(&format!(
            "| {} | `{}` | {} | {} | {} |\n",
            e.nr,
            e.name,
            e.support.level(),
            e.restart.describe(),
            e.support.note().unwrap_or("")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_calls_report_level_and_note() {
        let by_nr = [(0, 5), (9, 2), (188, 1), (999, 3)].into_iter().collect();
        let r = super::super::unsupported_calls(&by_nr);
        let got: Vec<_> = r.iter().map(|u| (u.nr, u.name, u.calls, u.support)).collect();
        assert_eq!(
            got,
            [(9, "mmap", 2, "partial"), (188, "setxattr", 1, "refused"), (999, "unknown", 3, "unimplemented")]
        );
        assert_eq!(Some(r[0].note), entry(9).and_then(|e| e.support.note()));
        assert!(r[1].note.starts_with("EOPNOTSUPP"), "{}", r[1].note);
    }

    #[test]
    fn multiplexing_sleeping_and_timed_futex_waits_do_not_restart() {
        let never = [libc::SYS_poll, libc::SYS_ppoll, libc::SYS_epoll_pwait2, libc::SYS_nanosleep, libc::SYS_pause];
        for nr in never {
            assert!(!restarts_under_sa_restart(nr as u64, 0), "{nr}");
        }
        assert!(restarts_under_sa_restart(libc::SYS_read as u64, 0));
        assert!(restarts_under_sa_restart(libc::SYS_wait4 as u64, 0));
        assert!(restarts_under_sa_restart(libc::SYS_futex as u64, 0), "a futex wait without a timeout restarts");
        assert!(!restarts_under_sa_restart(libc::SYS_futex as u64, 0x7fff_0000), "one with a timeout does not");
    }

    #[test]
    fn partial_and_refused_entries_say_what_works() {
        for e in TABLE {
            if let Some(note) = e.support.note() {
                assert!(note.len() >= 10, "{}: note {note:?} says nothing", e.name);
                assert!(note.len() <= 200, "{}: the note is one line, not {} characters", e.name, note.len());
                assert!(
                    !note.contains('|') && !note.contains('\n'),
                    "{}: the note must fit a Markdown table cell",
                    e.name
                );
            }
        }
    }

    /// The documented table (docs/syscalls.md) is `markdown()`: regenerate it with
    /// `forkbox syscalls --markdown` (or copy the text this test prints) when the table changes.
    #[test]
    fn readme_syscall_table_matches_the_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/syscalls.md");
        let readme = std::fs::read_to_string(path).unwrap();
        let expected = markdown();
        let section = readme
            .split_once(README_BEGIN)
            .and_then(|(_, rest)| rest.split_once(README_END))
            .map(|(inside, _)| inside.trim_matches('\n'));
        match section {
            Some(s) if s == expected.trim_matches('\n') => {}
            found => panic!(
                "docs/syscalls.md's syscall table is {}. Replace everything between\n{README_BEGIN}\nand\n{README_END}\nwith the output of `forkbox syscalls --markdown`:\n\n{expected}",
                if found.is_some() { "out of date" } else { "missing" }
            ),
        }
    }

    /// Every x86-64 number (0 to 334, then 424 on, as the kernel numbers them)
    /// has an entry, so "refused on purpose" and "never looked at" differ.
    #[test]
    fn every_x86_64_number_is_in_the_table() {
        let last = TABLE.iter().map(|e| e.nr).max().unwrap();
        assert!(last >= libc::SYS_set_mempolicy_home_node as u64);
        for nr in (0..=334).chain(424..=last) {
            assert!(entry(nr).is_some(), "syscall {nr} is not in the table");
        }
        assert_eq!(TABLE.len(), 335 + (last - 424 + 1) as usize);
    }

    /// A refused entry's errno is in the table (no handler runs), and its note
    /// starts with that errno's name; every other entry has a handler.
    #[test]
    fn refused_entries_carry_their_errno_and_the_others_a_handler() {
        let names = [
            (Errno::EPERM, "EPERM"),
            (Errno::ENOSYS, "ENOSYS"),
            (Errno::EOPNOTSUPP, "EOPNOTSUPP"),
            (Errno::EACCES, "EACCES"),
        ];
        for e in TABLE {
            match e.support {
                Refused(errno, note) => {
                    assert!(e.handler.is_none(), "{}: a refused call has no handler", e.name);
                    let name = names.iter().find(|(n, _)| *n == errno).map(|(_, s)| *s);
                    let name = name.unwrap_or_else(|| panic!("{}: add {errno:?} to this test", e.name));
                    assert!(note.starts_with(&format!("{name}: ")), "{}: {note:?} must start with {name}", e.name);
                }
                _ => assert!(e.handler.is_some(), "{} has no handler", e.name),
            }
        }
    }

    #[test]
    fn numbers_are_unique_and_match_libc() {
        let mut seen = std::collections::HashSet::new();
        for e in TABLE {
            assert!(seen.insert(e.nr), "duplicate {}", e.nr);
        }
        for (nr, name) in [
            (libc::SYS_read, "read"),
            (libc::SYS_openat, "openat"),
            (libc::SYS_newfstatat, "newfstatat"),
            (libc::SYS_getdents64, "getdents64"),
            (libc::SYS_clock_gettime, "clock_gettime"),
            (libc::SYS_getrandom, "getrandom"),
            (libc::SYS_statx, "statx"),
            (libc::SYS_exit_group, "exit_group"),
            (libc::SYS_faccessat2, "faccessat2"),
            (libc::SYS_mremap, "mremap"),
            (libc::SYS_prlimit64, "prlimit64"),
            (libc::SYS_mount, "mount"),
            (libc::SYS_io_uring_setup, "io_uring_setup"),
            (libc::SYS_futex_waitv, "futex_waitv"),
        ] {
            assert_eq!(entry(nr as u64).map(|e| e.name), Some(name));
        }
        assert!(entry(1 << 40).is_none());
        assert!(entry(999).is_none());
    }
}
