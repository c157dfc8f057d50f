//! The x86-64 syscall table: number, name, handler, support level.

use std::sync::OnceLock;

use super::{sys_file as file, sys_fs as fs, sys_mm as mm, sys_process as process, sys_signal as signal, sys_socket as net, sys_time as time};
use super::{sys_pipe as pipe, sys_unix as unix};
use super::{Args, Ctx, Handler};
use crate::errno::{Errno, SysResult};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Linux semantics for everything a single-threaded guest can ask.
    Full,
    /// Works for the common cases; documented gaps.
    Partial,
    /// Deliberately refused (the sandbox has no such thing); returns an error.
    Refused,
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

fn eagain(_: &mut Ctx, _: &Args) -> SysResult {
    Err(Errno::EAGAIN)
}

fn eperm(_: &mut Ctx, _: &Args) -> SysResult {
    Err(Errno::EPERM)
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
    7 poll => file::poll, Partial;
    8 lseek => file::lseek, Full;
    9 mmap => mm::mmap, Partial;
    10 mprotect => mm::mprotect, Partial;
    11 munmap => mm::munmap, Full;
    12 brk => mm::brk, Full;
    13 rt_sigaction => signal::rt_sigaction, Partial;
    14 rt_sigprocmask => signal::rt_sigprocmask, Partial;
    15 rt_sigreturn => signal::rt_sigreturn, Full;
    16 ioctl => file::ioctl, Partial;
    17 pread64 => file::pread64, Full;
    18 pwrite64 => file::pwrite64, Full;
    19 readv => file::readv, Full;
    20 writev => file::writev, Full;
    21 access => fs::access, Full;
    22 pipe => pipe::pipe, Full;
    23 select => file::select, Partial;
    24 sched_yield => process::sched_yield, Full;
    25 mremap => mm::mremap, Full;
    26 msync => mm::msync, Full;
    28 madvise => mm::madvise, Partial;
    32 dup => file::dup, Full;
    33 dup2 => file::dup2, Full;
    35 nanosleep => time::nanosleep, Full;
    39 getpid => process::getpid, Full;
    41 socket => net::socket, Partial;
    42 connect => net::connect, Full;
    43 accept => net::accept, Full;
    44 sendto => net::sendto, Full;
    45 recvfrom => net::recvfrom, Full;
    46 sendmsg => net::sendmsg, Partial;
    47 recvmsg => net::recvmsg, Partial;
    48 shutdown => net::shutdown, Full;
    49 bind => net::bind, Full;
    50 listen => net::listen, Full;
    51 getsockname => net::getsockname, Full;
    52 getpeername => net::getpeername, Full;
    53 socketpair => unix::socketpair, Full;
    54 setsockopt => net::setsockopt, Partial;
    55 getsockopt => net::getsockopt, Partial;
    56 clone => eagain, Refused;
    57 fork => eagain, Refused;
    58 vfork => eagain, Refused;
    59 execve => eperm, Refused;
    60 exit => process::exit_group, Full;
    62 kill => process::kill, Partial;
    63 uname => process::uname, Full;
    72 fcntl => file::fcntl, Full;
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
    92 chown => fs::chown, Full;
    93 fchown => fs::fchown, Full;
    94 lchown => fs::chown, Full;
    95 umask => fs::umask, Full;
    96 gettimeofday => time::gettimeofday, Full;
    97 getrlimit => process::getrlimit, Full;
    98 getrusage => process::getrusage, Partial;
    99 sysinfo => process::sysinfo, Partial;
    100 times => process::times, Partial;
    102 getuid => process::zero, Full;
    104 getgid => process::zero, Full;
    107 geteuid => process::zero, Full;
    108 getegid => process::zero, Full;
    110 getppid => process::getppid, Full;
    111 getpgrp => process::getpgid, Full;
    115 getgroups => process::getgroups, Full;
    118 getresuid => process::getresuid, Full;
    120 getresgid => process::getresuid, Full;
    121 getpgid => process::getpgid, Full;
    124 getsid => process::getpgid, Full;
    131 sigaltstack => signal::sigaltstack, Partial;
    137 statfs => fs::statfs, Partial;
    138 fstatfs => fs::fstatfs, Partial;
    157 prctl => process::prctl, Partial;
    158 arch_prctl => process::arch_prctl, Full;
    160 setrlimit => process::setrlimit, Partial;
    186 gettid => process::getpid, Full;
    188 setxattr => fs::setxattr, Refused;
    189 lsetxattr => fs::setxattr, Refused;
    190 fsetxattr => fs::setxattr, Refused;
    191 getxattr => fs::getxattr, Full;
    192 lgetxattr => fs::lgetxattr, Full;
    193 fgetxattr => fs::fgetxattr, Full;
    194 listxattr => fs::listxattr, Full;
    195 llistxattr => fs::llistxattr, Full;
    196 flistxattr => fs::flistxattr, Full;
    197 removexattr => fs::setxattr, Refused;
    198 lremovexattr => fs::setxattr, Refused;
    199 fremovexattr => fs::setxattr, Refused;
    200 tkill => process::tkill, Partial;
    201 time => time::time, Full;
    202 futex => process::futex, Partial;
    203 sched_setaffinity => process::sched_setaffinity, Partial;
    204 sched_getaffinity => process::sched_getaffinity, Full;
    213 epoll_create => pipe::epoll_create, Full;
    217 getdents64 => file::getdents64, Full;
    218 set_tid_address => process::set_tid_address, Full;
    221 fadvise64 => file::fsync, Full;
    228 clock_gettime => time::clock_gettime, Full;
    229 clock_getres => time::clock_getres, Full;
    230 clock_nanosleep => time::clock_nanosleep, Full;
    231 exit_group => process::exit_group, Full;
    232 epoll_wait => pipe::epoll_wait, Partial;
    233 epoll_ctl => pipe::epoll_ctl, Partial;
    234 tgkill => process::tgkill, Partial;
    257 openat => fs::openat, Full;
    258 mkdirat => fs::mkdirat, Full;
    260 fchownat => fs::chown, Full;
    262 newfstatat => fs::newfstatat, Full;
    263 unlinkat => fs::unlinkat, Full;
    264 renameat => fs::renameat, Full;
    265 linkat => fs::linkat, Full;
    266 symlinkat => fs::symlinkat, Full;
    267 readlinkat => fs::readlinkat, Full;
    268 fchmodat => fs::fchmodat, Full;
    269 faccessat => fs::faccessat, Full;
    270 pselect6 => file::pselect6, Partial;
    271 ppoll => file::ppoll, Partial;
    273 set_robust_list => process::set_robust_list, Full;
    280 utimensat => fs::utimensat, Full;
    281 epoll_pwait => pipe::epoll_pwait, Partial;
    283 timerfd_create => pipe::timerfd_create, Full;
    284 eventfd => pipe::eventfd, Full;
    286 timerfd_settime => pipe::timerfd_settime, Full;
    287 timerfd_gettime => pipe::timerfd_gettime, Full;
    288 accept4 => net::accept4, Full;
    290 eventfd2 => pipe::eventfd2, Full;
    291 epoll_create1 => pipe::epoll_create1, Full;
    292 dup3 => file::dup3, Full;
    293 pipe2 => pipe::pipe2, Full;
    295 preadv => file::preadv, Full;
    296 pwritev => file::pwritev, Full;
    299 recvmmsg => net::recvmmsg, Partial;
    302 prlimit64 => process::prlimit64, Partial;
    307 sendmmsg => net::sendmmsg, Partial;
    316 renameat2 => fs::renameat2, Partial;
    318 getrandom => process::getrandom, Full;
    332 statx => fs::statx, Full;
    334 rseq => enosys, Refused;
    435 clone3 => enosys, Refused;
    439 faccessat2 => fs::faccessat2, Full;
    441 epoll_pwait2 => pipe::epoll_pwait2, Partial;
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

#[cfg(test)]
mod tests {
    use super::*;

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
