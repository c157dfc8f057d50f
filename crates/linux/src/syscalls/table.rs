//! The x86-64 syscall table: number, name, handler, support level (with a
//! one-line note for every partial or refused entry). One entry per line.
//! The syscall table of docs/syscalls.md is generated from it (`forkbox syscalls
//! --markdown`; a test checks the document matches).

use std::sync::OnceLock;

use super::{
    sys_file as file, sys_fs as fs, sys_mm as mm, sys_process as process, sys_signal as signal, sys_time as time,
};
use super::{sys_fork as fork, sys_pipe as pipe, sys_unix as unix};
use super::{sys_socket as net, sys_thread as thread, sys_timer as timer};
use super::{Args, Ctx, Handler};
use crate::errno::{Errno, SysResult};

/// Whether syscall `nr`, interrupted by a signal whose handler has
/// SA_RESTART, is restarted (else it fails with EINTR). signal(7): the
/// multiplexing, sleep and signal-wait calls never restart, and neither does
/// a futex wait with a timeout (`arg3`, the fourth argument, non-null).
pub fn restarts_under_sa_restart(nr: u64, arg3: u64) -> bool {
    match nr as i64 {
        libc::SYS_poll
        | libc::SYS_select
        | libc::SYS_pselect6
        | libc::SYS_ppoll
        | libc::SYS_epoll_wait
        | libc::SYS_epoll_pwait
        | libc::SYS_epoll_pwait2
        | libc::SYS_nanosleep
        | libc::SYS_clock_nanosleep
        | libc::SYS_pause
        | libc::SYS_rt_sigsuspend
        | libc::SYS_rt_sigtimedwait
        | libc::SYS_io_getevents
        | libc::SYS_semop
        | libc::SYS_semtimedop
        | libc::SYS_msgrcv
        | libc::SYS_msgsnd => false,
        libc::SYS_futex => arg3 == 0,
        _ => true,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Linux semantics for everything a guest can ask.
    Full,
    /// Works for the common cases; the note says what works and what does not.
    Partial(&'static str),
    /// Deliberately refused (the sandbox has no such thing): the note gives the error and why.
    Refused(&'static str),
}

impl Support {
    pub fn level(&self) -> &'static str {
        match self {
            Support::Full => "full",
            Support::Partial(_) => "partial",
            Support::Refused(_) => "refused",
        }
    }

    pub fn note(&self) -> Option<&'static str> {
        match self {
            Support::Full => None,
            Support::Partial(n) | Support::Refused(n) => Some(n),
        }
    }
}

pub struct Entry {
    pub nr: u64,
    pub name: &'static str,
    pub handler: Handler,
    pub support: Support,
}

fn enosys(_: &mut Ctx, _: &Args) -> SysResult {
    Err(Errno::ENOSYS)
}

use Support::*;

macro_rules! table {
    ($($nr:literal $name:ident => $handler:expr, $support:expr;)*) => {
        pub static TABLE: &[Entry] = &[
            $(Entry { nr: $nr, name: stringify!($name), handler: $handler, support: $support },)*
        ];
    };
}

table! {
    0 read => file::read, Full;
    1 write => file::write, Full;
    2 open => fs::open, Full;
    3 close => file::close, Full;
    4 stat => fs::stat, Full;
    5 fstat => fs::fstat, Full;
    6 lstat => fs::lstat, Full;
    7 poll => file::poll, Partial("readiness of every fd the VMM owns (files, pipes, sockets, eventfd, timerfd, epoll); a wait blocks until an fd is ready, the timeout or an interrupt; POLLPRI never set");
    8 lseek => file::lseek, Full;
    9 mmap => mm::mmap, Partial("private file maps: bytes copied in (no page cache); MAP_SHARED (file, memfd, anonymous) shared between processes, written back on msync/munmap/exit; no MAP_GROWSDOWN/huge pages");
    10 mprotect => mm::mprotect, Partial("enforced by the guest page tables (read-only, no-execute, PROT_NONE not present); no protection keys, no PROT_GROWSDOWN");
    11 munmap => mm::munmap, Full;
    12 brk => mm::brk, Full;
    13 rt_sigaction => signal::rt_sigaction, Partial("handlers run for signals the guest sends itself, its timers, its CPU faults and the host interrupt; no other process exists to send one");
    14 rt_sigprocmask => signal::rt_sigprocmask, Full;
    15 rt_sigreturn => signal::rt_sigreturn, Full;
    16 ioctl => file::ioctl, Partial("FIOCLEX, FIONCLEX, FIONREAD; anything else ENOTTY (no terminals)");
    17 pread64 => file::pread64, Full;
    18 pwrite64 => file::pwrite64, Full;
    19 readv => file::readv, Full;
    20 writev => file::writev, Full;
    21 access => fs::access, Full;
    22 pipe => pipe::pipe, Full;
    23 select => file::select, Partial("readiness of every fd the VMM owns (files, pipes, sockets, eventfd, timerfd, epoll); exceptfds never set");
    24 sched_yield => thread::sched_yield, Full;
    25 mremap => mm::mremap, Full;
    26 msync => mm::msync, Full;
    28 madvise => mm::madvise, Partial("MADV_DONTNEED/MADV_FREE give the pages back (they read as zeros); every other advice is accepted and ignored");
    32 dup => file::dup, Full;
    33 dup2 => file::dup2, Full;
    35 nanosleep => time::nanosleep, Full;
    39 getpid => fork::getpid, Full;
    40 sendfile => file::sendfile, Full;
    41 socket => net::socket, Partial("AF_UNIX inside the sandbox; AF_INET/AF_INET6 TCP and UDP on host sockets under the egress policy, UDP-Lite inside the sandbox; raw EPERM, other families EAFNOSUPPORT");
    42 connect => net::connect, Full;
    43 accept => net::accept, Full;
    44 sendto => net::sendto, Full;
    45 recvfrom => net::recvfrom, Full;
    46 sendmsg => net::sendmsg, Partial("AF_UNIX: data and fd passing (SCM_RIGHTS, at most 253 a message and 1024 in flight per sandbox: ETOOMANYREFS); SCM_CREDENTIALS EOPNOTSUPP; AF_INET*: data, IPV6_HOPLIMIT/TCLASS to the sandbox's sockets");
    47 recvmsg => net::recvmsg, Partial("AF_UNIX: data and SCM_RIGHTS (MSG_CTRUNC, MSG_CMSG_CLOEXEC); no credentials; AF_INET*: data, IPV6_HOPLIMIT/TCLASS (RFC 3542) from the sandbox's sockets");
    48 shutdown => net::shutdown, Full;
    49 bind => net::bind, Partial("AF_UNIX paths; TCP: loopback or the wildcard, in the sandbox's port table (EADDRINUSE, port 0 ephemeral); UDP: loopback or the wildcard, in the sandbox's UDP port table (never a host port)");
    50 listen => net::listen, Partial("AF_UNIX, and TCP on loopback/the wildcard inside the sandbox (never a host port; connects from the sandbox only; a full backlog refuses, where Linux drops the SYN)");
    51 getsockname => net::getsockname, Full;
    52 getpeername => net::getpeername, Full;
    53 socketpair => unix::socketpair, Full;
    54 setsockopt => net::setsockopt, Partial("the options CPython sets; on inet sockets SO_RCVTIMEO/SO_SNDTIMEO bound the waits and the others go to the host socket (buffer sizes capped at 4 MiB); on AF_UNIX buffer sizes are recorded, not applied");
    55 getsockopt => net::getsockopt, Partial("SO_TYPE, SO_DOMAIN, SO_ERROR, SO_RCVBUF/SNDBUF and the recorded options");
    34 pause => signal::pause, Full;
    37 alarm => timer::alarm, Full;
    36 getitimer => timer::getitimer, Partial("ITIMER_REAL only (on the run clock); ITIMER_VIRTUAL/ITIMER_PROF EINVAL");
    38 setitimer => timer::setitimer, Partial("ITIMER_REAL only (on the run clock); ITIMER_VIRTUAL/ITIMER_PROF EINVAL");
    56 clone => thread::clone, Partial("threads as green threads on the one vCPU; without CLONE_THREAD a new process in its own VM (CLONE_VM with CLONE_VFORK: the child gets a copy of memory)");
    57 fork => fork::fork, Partial("the child is its own VM (copy of memory, the calling thread, shared open files); at most 64 processes (EAGAIN); children alive when the exec ends are killed");
    58 vfork => fork::vfork, Partial("a fork: the child gets a copy of memory and the parent is not suspended");
    59 execve => fork::execve, Partial("ELF programs of the file system with ld.so, `#!` scripts (4 levels), close-on-exec; pid, fds, cwd, umask, signal mask kept");
    60 exit => thread::exit, Full;
    61 wait4 => fork::wait4, Partial("exit statuses, WNOHANG, ECHILD, pid/-1/0/-pgid; no stopped/continued children (nothing stops here); rusage zeroed");
    62 kill => fork::kill, Partial("the sandbox's processes (pid, 0, -1, -pgid); a signal for another process is delivered when it next runs");
    63 uname => process::uname, Full;
    72 fcntl => file::fcntl, Partial("record locks always granted (no conflicts are tracked); F_NOTIFY only without events (no dnotify)");
    74 fsync => file::fsync, Full;
    75 fdatasync => file::fsync, Full;
    76 truncate => fs::truncate, Full;
    77 ftruncate => file::ftruncate, Full;
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
    97 getrlimit => process::getrlimit, Full;
    98 getrusage => process::getrusage, Partial("user time = host thread CPU time, maxrss = memory mapped; other fields 0");
    99 sysinfo => process::sysinfo, Partial("total/free RAM from the memory limit and mapped memory, 1 process; uptime and loads are made up");
    100 times => process::times, Partial("user time = host thread CPU time; system and children times 0");
    102 getuid => process::getuid, Full;
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
    127 rt_sigpending => signal::rt_sigpending, Full;
    128 rt_sigtimedwait => signal::rt_sigtimedwait, Full;
    130 rt_sigsuspend => signal::rt_sigsuspend, Full;
    131 sigaltstack => signal::sigaltstack, Full;
    133 mknod => fs::mknod, Partial("FIFOs (pipes in the overlay) and regular files; device nodes EPERM");
    137 statfs => fs::statfs, Partial("one tmpfs-like file system sized by the disk quota, whatever the path");
    138 fstatfs => fs::fstatfs, Partial("one tmpfs-like file system sized by the disk quota, whatever the fd");
    140 getpriority => process::getpriority, Partial("as setpriority: the nice values it keeps");
    141 setpriority => process::setpriority, Partial("nice values kept per process and inherited (lowering one needs euid 0: EACCES); PRIO_USER takes every process as the caller's user; no host priority changes");
    146 sched_get_priority_max => process::sched_get_priority_max, Full;
    147 sched_get_priority_min => process::sched_get_priority_min, Full;
    148 sched_rr_get_interval => process::sched_rr_get_interval, Partial("every thread is SCHED_OTHER: a fixed 4 ms slice");
    157 prctl => process::prctl, Partial("PR_SET_NAME, PR_SET/GET_DUMPABLE, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS succeed (names not kept), PR_GET_NAME says python3; others EINVAL");
    158 arch_prctl => process::arch_prctl, Full;
    160 setrlimit => process::setrlimit, Partial("validates the resource and succeeds; limits do not change");
    170 sethostname => process::sethostname, Refused("EPERM: the host and domain names are fixed (no CAP_SYS_ADMIN in the sandbox)");
    171 setdomainname => process::sethostname, Refused("EPERM: the host and domain names are fixed (no CAP_SYS_ADMIN in the sandbox)");
    186 gettid => thread::gettid, Full;
    188 setxattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    189 lsetxattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    190 fsetxattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    191 getxattr => fs::getxattr, Full;
    192 lgetxattr => fs::lgetxattr, Full;
    193 fgetxattr => fs::fgetxattr, Full;
    194 listxattr => fs::listxattr, Full;
    195 llistxattr => fs::llistxattr, Full;
    196 flistxattr => fs::flistxattr, Full;
    197 removexattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    198 lremovexattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    199 fremovexattr => fs::setxattr, Refused("EOPNOTSUPP: the file system stores no extended attributes");
    200 tkill => thread::tkill, Full;
    201 time => time::time, Full;
    202 futex => thread::futex, Partial("WAIT, WAKE, BITSET forms, REQUEUE, CMP_REQUEUE, WAKE_OP; wakes on MAP_SHARED memory reach other processes (requeues do not); PI and robust-list ops ENOSYS");
    203 sched_setaffinity => process::sched_setaffinity, Partial("a mask must hold the sandbox's one CPU (EINVAL), which is then all it holds; unknown pids ESRCH");
    204 sched_getaffinity => process::sched_getaffinity, Full;
    213 epoll_create => pipe::epoll_create, Full;
    217 getdents64 => file::getdents64, Full;
    218 set_tid_address => thread::set_tid_address, Full;
    222 timer_create => timer::timer_create, Partial("CLOCK_REALTIME/MONOTONIC/BOOTTIME (on the run clock) with SIGEV_SIGNAL, SIGEV_THREAD_ID or SIGEV_NONE; CPU-time clocks EINVAL");
    223 timer_settime => timer::timer_settime, Full;
    224 timer_gettime => timer::timer_gettime, Full;
    225 timer_getoverrun => timer::timer_getoverrun, Full;
    226 timer_delete => timer::timer_delete, Full;
    227 clock_settime => time::clock_settime, Refused("EPERM for CLOCK_REALTIME and CPU-time clocks (no CAP_SYS_TIME: the clock is the host's), EINVAL for clocks that cannot be set");
    221 fadvise64 => file::fsync, Full;
    228 clock_gettime => time::clock_gettime, Partial("host clocks; CPU-time clocks (also of a pid or thread: clock_getcpuclockid) read the vCPU thread's time, EINVAL for another process'");
    229 clock_getres => time::clock_getres, Full;
    230 clock_nanosleep => time::clock_nanosleep, Full;
    231 exit_group => process::exit_group, Full;
    234 tgkill => thread::tgkill, Full;
    232 epoll_wait => pipe::epoll_wait, Partial("level-triggered; EPOLLET is treated as level-triggered, EPOLLONESHOT works");
    233 epoll_ctl => pipe::epoll_ctl, Partial("ADD/MOD/DEL on every fd the VMM owns; EPOLLET is treated as level-triggered");
    257 openat => fs::openat, Full;
    258 mkdirat => fs::mkdirat, Full;
    259 mknodat => fs::mknodat, Partial("FIFOs and regular files, as mknod; device nodes EPERM");
    260 fchownat => fs::fchownat, Partial("Linux's rules (euid 0 sets any ids; others only the group of their own file); owners kept, reported, checkpointed; new files are 0:0; no access checks");
    262 newfstatat => fs::newfstatat, Full;
    263 unlinkat => fs::unlinkat, Full;
    264 renameat => fs::renameat, Full;
    265 linkat => fs::linkat, Full;
    266 symlinkat => fs::symlinkat, Full;
    247 waitid => fork::waitid, Partial("P_ALL, P_PID, P_PGID with WEXITED (WNOHANG, WNOWAIT); no stopped/continued children; no pidfd");
    267 readlinkat => fs::readlinkat, Full;
    268 fchmodat => fs::fchmodat, Full;
    269 faccessat => fs::faccessat, Full;
    270 pselect6 => file::pselect6, Partial("as select; the signal mask argument is ignored");
    271 ppoll => file::ppoll, Partial("as poll; the signal mask argument is ignored");
    273 set_robust_list => process::set_robust_list, Full;
    280 utimensat => fs::utimensat, Full;
    281 epoll_pwait => pipe::epoll_pwait, Partial("as epoll_wait, with the signal mask applied for the call");
    283 timerfd_create => pipe::timerfd_create, Full;
    284 eventfd => pipe::eventfd, Full;
    285 fallocate => file::fallocate, Partial("as tmpfs: mode 0 (grows the file, quota-charged), KEEP_SIZE, PUNCH_HOLE with KEEP_SIZE (zeroes); other modes EOPNOTSUPP");
    286 timerfd_settime => pipe::timerfd_settime, Full;
    287 timerfd_gettime => pipe::timerfd_gettime, Full;
    288 accept4 => net::accept4, Full;
    290 eventfd2 => pipe::eventfd2, Full;
    291 epoll_create1 => pipe::epoll_create1, Full;
    292 dup3 => file::dup3, Full;
    293 pipe2 => pipe::pipe2, Full;
    295 preadv => file::preadv, Full;
    296 pwritev => file::pwritev, Full;
    299 recvmmsg => net::recvmmsg, Partial("up to 64 messages per call on inet sockets (MSG_WAITFORONE); no ancillary data");
    302 prlimit64 => process::prlimit64, Partial("reads its own limits (stack, fds, memory, 64 processes, no core); new limits are ignored");
    307 sendmmsg => net::sendmmsg, Partial("up to 64 messages per call on inet sockets (glibc's resolver uses it); no ancillary data");
    316 renameat2 => fs::renameat2, Partial("flags 0, RENAME_NOREPLACE and RENAME_EXCHANGE; RENAME_WHITEOUT is EINVAL");
    318 getrandom => process::getrandom, Full;
    319 memfd_create => fs::memfd_create, Partial("an unlinked file in the overlay; no sealing (F_ADD_SEALS EINVAL)");
    322 execveat => fork::execveat, Partial("as execve, from a directory fd; AT_EMPTY_PATH (fexecve) is ENOSYS");
    326 copy_file_range => file::copy_file_range, Full;
    332 statx => fs::statx, Full;
    334 rseq => enosys, Refused("ENOSYS: glibc falls back to no restartable sequences");
    435 clone3 => thread::clone3, Partial("as clone (threads, or a new process in its own VM); no set_tid, cgroup or pidfd");
    436 close_range => file::close_range, Full;
    439 faccessat2 => fs::faccessat2, Full;
    441 epoll_pwait2 => pipe::epoll_pwait2, Partial("as epoll_pwait, with a timespec timeout");
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
        "{} system calls: {} full, {} partial, {} refused. Any other number returns ENOSYS (`forkbox run --trace-syscalls` lists the partial, refused and unknown calls a run made).\n\n",
        TABLE.len(),
        count(|s| matches!(s, Full)),
        count(|s| matches!(s, Partial(_))),
        count(|s| matches!(s, Refused(_))),
    );
    s.push_str("| nr | syscall | support | what works, what does not |\n|---:|---|---|---|\n");
    let mut sorted: Vec<&Entry> = TABLE.iter().collect();
    sorted.sort_by_key(|e| e.nr);
    for e in sorted {
        s.push_str(&format!(
            "| {} | `{}` | {} | {} |\n",
            e.nr,
            e.name,
            e.support.level(),
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
        ] {
            assert_eq!(entry(nr as u64).map(|e| e.name), Some(name));
        }
        assert!(entry(1 << 40).is_none());
        assert!(entry(999).is_none());
    }
}
