//! A seccomp-BPF allow-list for the host threads that run guests:
//! the runtime's exec threads, where KVM_RUN runs and every guest
//! syscall is handled, install it when they start, before any guest input.
//! A filter is per thread (no TSYNC) and is inherited by the threads such a
//! thread starts (the VM pool and reaper threads a template load starts there).
//!
//! What such a thread does on the host, and so what the list holds (found with
//! `strace -f` of `forkbox serve` under the Python SDK tests and of the engine's
//! network tests, and from the code):
//! - KVM: `ioctl` with one of the KVM request numbers the VMM uses (exactly
//!   those, by number), `PAGEMAP_SCAN` on `/proc/self/pagemap`, `FIONREAD` on
//!   the guest's host sockets; memory: mmap/munmap/mremap/mprotect/madvise/brk,
//!   and `memfd_create` for the memory the guest's processes share (one
//!   memfd per shared object, `forkbox_linux::shm`; never a path);
//! - the wall-clock timer (timer_create/settime/delete with a thread-directed
//!   signal), the interrupt (tgkill), futexes, clocks, getrandom;
//! - host sockets for the guest's AF_INET/AF_INET6 (socket with only those
//!   families, plus AF_NETLINK for `getifaddrs` and AF_UNIX refused with
//!   EACCES so glibc's resolver skips nscd), connect/send/recv/poll/...;
//! - file I/O for checkpoints and template loads: the session store (SQLite:
//!   pwrite64, fcntl locks, fsync), layer and state files (openat, rename,
//!   unlink, statfs for the free-disk reserve).
//!
//! Residual risk, documented in docs/security.md: the exec threads (`--isolation
//! thread`, the embedded CLI) still do that host file I/O (the checkpoint
//! writer and the session store run on them), so `openat`, `rename`,
//! `unlink`... are allowed on any path there; what the filter removes is
//! everything else — no execve, no fork (clone only with CLONE_THREAD), no
//! ptrace, mount, namespaces, bpf, io_uring, keyctl, perf_event_open,
//! setuid/capset, kexec, module loading, process_vm_*, chroot, personality ...
//! — and any ioctl but the listed ones. A forbidden call kills the process
//! (SECCOMP_RET_KILL_PROCESS). Sandbox worker processes (`forkbox_worker`,
//! the default isolation) get the narrower [`enter_worker`] list: no host file
//! call that names a path for writing, `openat` only to read, and no network
//! (`socket` only for AF_UNIX, refused with EACCES; no connect, bind, listen,
//! accept): their sandboxes' host sockets come from the egress broker.
//!
//! Modes (`FORKBOX_SECCOMP`): `enforce` (the default), `eperm` (a learning
//! phase: a forbidden call fails with EPERM, nothing is killed), `off`.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("FORKBOX_SECCOMP={0:?}: expected enforce, eperm or off")]
    BadMode(String),
    #[error("building the seccomp filter: {0}")]
    Build(String),
    #[error("installing the seccomp filter on this thread: {0}")]
    Install(String),
}

/// (Serde: lowercase, as `FORKBOX_SECCOMP` spells it; a sandbox worker gets it in its `Hello`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A call outside the list kills the process.
    Enforce,
    /// A call outside the list fails with EPERM (learning).
    Eperm,
    /// No filter.
    Off,
}

impl Mode {
    /// From `FORKBOX_SECCOMP` (unset or empty: enforce).
    pub fn from_env() -> Result<Mode, JailError> {
        match std::env::var("FORKBOX_SECCOMP").unwrap_or_default().as_str() {
            "" | "enforce" | "on" => Ok(Mode::Enforce),
            "eperm" | "learn" => Ok(Mode::Eperm),
            "off" => Ok(Mode::Off),
            other => Err(JailError::BadMode(other.to_string())),
        }
    }
}

// ioctl request numbers (asm-generic/ioctl.h).
const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const NONE: u64 = 0;
const W: u64 = 1;
const R: u64 = 2;
const KVM: u64 = 0xAE;

/// Every KVM ioctl the VMM makes (crates/vmm), by number.
pub fn kvm_ioctls() -> Vec<(&'static str, u64)> {
    use kvm_bindings::*;
    use std::mem::size_of;
    vec![
        ("KVM_GET_API_VERSION", ioc(NONE, KVM, 0x00, 0)),
        ("KVM_CREATE_VM", ioc(NONE, KVM, 0x01, 0)),
        ("KVM_CHECK_EXTENSION", ioc(NONE, KVM, 0x03, 0)),
        ("KVM_GET_VCPU_MMAP_SIZE", ioc(NONE, KVM, 0x04, 0)),
        ("KVM_GET_SUPPORTED_CPUID", ioc(R | W, KVM, 0x05, size_of::<kvm_cpuid2>())),
        ("KVM_CREATE_VCPU", ioc(NONE, KVM, 0x41, 0)),
        ("KVM_GET_DIRTY_LOG", ioc(W, KVM, 0x42, size_of::<kvm_dirty_log>())),
        ("KVM_SET_USER_MEMORY_REGION", ioc(W, KVM, 0x46, size_of::<kvm_userspace_memory_region>())),
        ("KVM_RUN", ioc(NONE, KVM, 0x80, 0)),
        ("KVM_GET_REGS", ioc(R, KVM, 0x81, size_of::<kvm_regs>())),
        ("KVM_SET_REGS", ioc(W, KVM, 0x82, size_of::<kvm_regs>())),
        ("KVM_GET_SREGS", ioc(R, KVM, 0x83, size_of::<kvm_sregs>())),
        ("KVM_SET_SREGS", ioc(W, KVM, 0x84, size_of::<kvm_sregs>())),
        ("KVM_GET_MSRS", ioc(R | W, KVM, 0x88, size_of::<kvm_msrs>())),
        ("KVM_SET_MSRS", ioc(W, KVM, 0x89, size_of::<kvm_msrs>())),
        ("KVM_SET_CPUID2", ioc(W, KVM, 0x90, size_of::<kvm_cpuid2>())),
        ("KVM_GET_TSC_KHZ", ioc(NONE, KVM, 0xa3, 0)),
        ("KVM_GET_XSAVE", ioc(R, KVM, 0xa4, size_of::<kvm_xsave>())),
        ("KVM_SET_XSAVE", ioc(W, KVM, 0xa5, size_of::<kvm_xsave>())),
        ("KVM_GET_XCRS", ioc(R, KVM, 0xa6, size_of::<kvm_xcrs>())),
        ("KVM_SET_XCRS", ioc(W, KVM, 0xa7, size_of::<kvm_xcrs>())),
        ("KVM_GET_XSAVE2", ioc(R, KVM, 0xcf, size_of::<kvm_xsave>())),
    ]
}

/// PAGEMAP_SCAN on /proc/self/pagemap (what a reset and a checkpoint use).
const PAGEMAP_SCAN: u64 = ioc(R | W, b'f' as u64, 16, 96);

/// Syscalls allowed with any arguments.
const ALLOWED: &[i64] = &[
    // memory
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_msync,
    libc::SYS_memfd_create,
    // Which pages of our own mappings are backed: the memory writer of a
    // template made of a sandbox (on an exec thread) skips the others.
    libc::SYS_mincore,
    // threads, signals, time
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_time,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_timer_create,
    libc::SYS_timer_settime,
    libc::SYS_timer_gettime,
    libc::SYS_timer_delete,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_sched_getparam,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_setscheduler,
    libc::SYS_getrusage,
    libc::SYS_prlimit64,
    libc::SYS_sysinfo,
    libc::SYS_uname,
    libc::SYS_restart_syscall,
    // files (checkpoints, the session store, template loads)
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fadvise64,
    libc::SYS_flock,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_getcwd,
    libc::SYS_fchmod,
    // SQLite running as root gives a new journal file its database's owner
    libc::SYS_fchown,
    libc::SYS_dup,
    libc::SYS_copy_file_range,
    // host sockets of the guest (egress under the policy) and the resolver
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
    libc::SYS_shutdown,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
];

fn eq32(arg: u8, v: u64) -> Result<Cond, seccompiler::BackendError> {
    Cond::new(arg, Len::Dword, Op::Eq, v)
}

/// Calls of the guest-thread list a sandbox worker process never makes: it
/// writes no file it names (checkpoints go into descriptors the API process
/// gave it, which that process syncs and renames), holds no lock and no
/// session store, and opens paths read-only (below).
const NOT_IN_WORKERS: &[i64] = &[
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_flock,
    libc::SYS_fchmod,
    libc::SYS_fchown,
    libc::SYS_statfs,
    libc::SYS_copy_file_range,
    libc::SYS_openat,
    // A worker has no network: its sandboxes' host sockets come from the
    // egress broker (already connected, over its AF_UNIX socket to the API process).
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
];

/// `openat` flags that create, truncate or open for writing (`O_TMPFILE`'s own bit included).
const OPEN_FOR_WRITING: u64 =
    (libc::O_WRONLY | libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND | 0o20_000_000) as u64;

/// Everything a sandbox worker's launcher does once the worker runs: it
/// reports the worker (a pipe write), closes descriptors, waits for the
/// worker and exits with its status (the exit's own clean-up: the signal
/// stack unmapped, stdio flushed). Nothing else, whatever its arguments.
const LAUNCHER: &[i64] = &[
    libc::SYS_write,
    libc::SYS_close,
    libc::SYS_wait4,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_munmap,
    libc::SYS_madvise,
    libc::SYS_futex,
    libc::SYS_brk,
    libc::SYS_restart_syscall,
];

/// Which threads a filter is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Profile {
    /// The API process' exec threads (`--isolation thread`, sessions there): they also do the
    /// host file I/O of checkpoints and the session store.
    GuestThread,
    /// A sandbox worker process: no host file I/O but reading, and writing into descriptors it was given.
    Worker,
    /// A sandbox worker's launcher (its parent outside its pid namespace): waits, then exits ([`LAUNCHER`]).
    Launcher,
}

fn rules(profile: Profile) -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    if profile == Profile::Launcher {
        return Ok(LAUNCHER.iter().map(|&nr| (nr, Vec::new())).collect());
    }
    let mut m: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED
        .iter()
        .filter(|nr| profile == Profile::GuestThread || !NOT_IN_WORKERS.contains(nr))
        .map(|&nr| (nr, Vec::new()))
        .collect();
    if profile == Profile::Worker {
        // openat only to read (the template, the image, package layers, the
        // resolver's files, /proc/self): none of the flags that write or create.
        m.insert(
            libc::SYS_openat,
            vec![SeccompRule::new(vec![Cond::new(2, Len::Dword, Op::MaskedEq(OPEN_FOR_WRITING), 0)?])?],
        );
    }
    // ioctl: the KVM requests, PAGEMAP_SCAN, FIONREAD, FIONBIO, FIOCLEX.
    let mut ioctls: Vec<u64> = kvm_ioctls().into_iter().map(|(_, n)| n).collect();
    ioctls.extend([PAGEMAP_SCAN, libc::FIONREAD, libc::FIONBIO, libc::FIOCLEX]);
    m.insert(
        libc::SYS_ioctl,
        ioctls.into_iter().map(|n| SeccompRule::new(vec![eq32(1, n)?])).collect::<Result<_, _>>()?,
    );
    // fcntl: descriptor flags, status flags, record locks (SQLite), dup with CLOEXEC.
    let fcntls = [
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_GETFL,
        libc::F_SETFL,
        libc::F_GETLK,
        libc::F_SETLK,
        libc::F_SETLKW,
        libc::F_OFD_GETLK,
        libc::F_OFD_SETLK,
        libc::F_OFD_SETLKW,
        libc::F_DUPFD_CLOEXEC,
        libc::F_GET_SEALS,
        libc::F_ADD_SEALS,
    ];
    m.insert(
        libc::SYS_fcntl,
        fcntls.iter().map(|&c| SeccompRule::new(vec![eq32(1, c as u64)?])).collect::<Result<_, _>>()?,
    );
    // socket: only the families the VMM serves on the host (AF_UNIX: see
    // `unix_sockets_eacces`); in a worker none but AF_UNIX (which fails with
    // EACCES): it opens no socket, the egress broker does.
    let families: &[i32] = match profile {
        Profile::Worker => &[libc::AF_UNIX],
        _ => &[libc::AF_INET, libc::AF_INET6, libc::AF_NETLINK, libc::AF_UNIX],
    };
    m.insert(
        libc::SYS_socket,
        families.iter().map(|&f| SeccompRule::new(vec![eq32(0, f as u64)?])).collect::<Result<_, _>>()?,
    );
    // socketpair: AF_UNIX only (anonymous pairs, named by nothing on the host): the ends of
    // connections inside the sandbox and listeners' readiness (see forkbox_linux::net).
    m.insert(libc::SYS_socketpair, vec![SeccompRule::new(vec![eq32(0, libc::AF_UNIX as u64)?])?]);
    // clone: threads only (never a new process); clone3 is refused below (its flags are in memory).
    let thread = libc::CLONE_THREAD as u64;
    m.insert(libc::SYS_clone, vec![SeccompRule::new(vec![Cond::new(0, Len::Qword, Op::MaskedEq(thread), thread)?])?]);
    // Signals only to this process's own threads (the interrupt, the wall-clock timer).
    m.insert(libc::SYS_tgkill, vec![SeccompRule::new(vec![eq32(0, std::process::id() as u64)?])?]);
    // Answered with ENOSYS by the next filter.
    m.insert(libc::SYS_clone3, Vec::new());
    // rt_sigaction: installing handlers (std does for its own thread guards).
    m.insert(libc::SYS_rt_sigaction, Vec::new());
    // prctl: thread names, and PR_SET_NO_NEW_PRIVS + seccomp(SECCOMP_SET_MODE_FILTER)
    // for a thread that adds a filter of its own (both can only restrict).
    let prctls = [libc::PR_SET_NAME, libc::PR_GET_NAME, libc::PR_SET_NO_NEW_PRIVS];
    m.insert(
        libc::SYS_prctl,
        prctls.iter().map(|&c| SeccompRule::new(vec![eq32(0, c as u64)?])).collect::<Result<_, _>>()?,
    );
    m.insert(libc::SYS_seccomp, vec![SeccompRule::new(vec![eq32(0, libc::SECCOMP_SET_MODE_FILTER as u64)?])?]);
    Ok(m)
}

/// Calls the allow-list lets through but that fail with an errno (more
/// filters; the kernel takes the strictest answer of all): AF_UNIX sockets
/// (EACCES: glibc's resolver tries nscd; the guest's AF_UNIX sockets never
/// reach the host) and clone3 (ENOSYS, so glibc falls back to clone, whose
/// flags the allow-list checks: clone3's are in memory).
fn unix_sockets_eacces() -> Result<SeccompFilter, seccompiler::BackendError> {
    let mut m: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    m.insert(libc::SYS_socket, vec![SeccompRule::new(vec![eq32(0, libc::AF_UNIX as u64)?])?]);
    SeccompFilter::new(m, SeccompAction::Allow, SeccompAction::Errno(libc::EACCES as u32), arch())
}

fn clone3_enosys() -> Result<SeccompFilter, seccompiler::BackendError> {
    let mut m: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    m.insert(libc::SYS_clone3, Vec::new());
    SeccompFilter::new(m, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch())
}

fn arch() -> TargetArch {
    TargetArch::x86_64
}

/// The compiled programs for `mode` and `profile` (built once each).
fn programs(mode: Mode, profile: Profile) -> Result<&'static [BpfProgram], JailError> {
    type Built = OnceLock<Result<Vec<BpfProgram>, String>>;
    static ENFORCE: Built = OnceLock::new();
    static EPERM: Built = OnceLock::new();
    static WORKER_ENFORCE: Built = OnceLock::new();
    static WORKER_EPERM: Built = OnceLock::new();
    static LAUNCHER_ENFORCE: Built = OnceLock::new();
    static LAUNCHER_EPERM: Built = OnceLock::new();
    let (cell, mismatch) = match (mode, profile) {
        (Mode::Enforce, Profile::Launcher) => (&LAUNCHER_ENFORCE, SeccompAction::KillProcess),
        (Mode::Eperm, Profile::Launcher) => (&LAUNCHER_EPERM, SeccompAction::Errno(libc::EPERM as u32)),
        (Mode::Enforce, Profile::GuestThread) => (&ENFORCE, SeccompAction::KillProcess),
        (Mode::Eperm, Profile::GuestThread) => (&EPERM, SeccompAction::Errno(libc::EPERM as u32)),
        (Mode::Enforce, Profile::Worker) => (&WORKER_ENFORCE, SeccompAction::KillProcess),
        (Mode::Eperm, Profile::Worker) => (&WORKER_EPERM, SeccompAction::Errno(libc::EPERM as u32)),
        (Mode::Off, _) => return Ok(&[]),
    };
    let built = cell.get_or_init(|| {
        let build = || -> Result<Vec<BpfProgram>, seccompiler::BackendError> {
            let allow = SeccompFilter::new(rules(profile)?, mismatch, SeccompAction::Allow, arch())?;
            if profile == Profile::Launcher {
                return Ok(vec![BpfProgram::try_from(allow)?]);
            }
            // The allow-list last: the calls that install it need nothing from it.
            let progs = vec![
                BpfProgram::try_from(unix_sockets_eacces()?)?,
                BpfProgram::try_from(clone3_enosys()?)?,
                BpfProgram::try_from(allow)?,
            ];
            Ok(progs)
        };
        build().map_err(|e| e.to_string())
    });
    built.as_ref().map(|v| v.as_slice()).map_err(|e| JailError::Build(e.clone()))
}

thread_local! {
    static JAILED: std::cell::Cell<Option<Mode>> = const { std::cell::Cell::new(None) };
}

/// The mode this thread's filter was installed with (None: no filter).
pub fn current() -> Option<Mode> {
    JAILED.with(|j| j.get())
}

/// Does a seccomp filter apply to the calling thread (its own or inherited)?
pub fn is_filtered() -> bool {
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Seccomp:").map(|v| v.trim() != "0")))
        .unwrap_or(false)
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread started before any filter, that starts threads for filtered ones.
fn spawner() -> Option<&'static Mutex<Sender<Job>>> {
    static SPAWNER: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            let started = std::thread::Builder::new().name("forkbox-spawner".into()).spawn(move || {
                for job in rx {
                    job();
                }
            });
            started.ok().map(|_| Mutex::new(tx))
        })
        .as_ref()
}

/// Start a thread named `name` running `f`, without the calling thread's
/// seccomp filter (a template build runs apt-get, dpkg and ldconfig, which the
/// guest-thread filter forbids). From an unfiltered thread: a plain spawn.
pub fn spawn_unjailed(name: String, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    if !is_filtered() {
        return std::thread::Builder::new().name(name).spawn(f).map(|_| ());
    }
    let gone = || std::io::Error::other("the unfiltered spawner thread is not running");
    let tx = spawner().ok_or_else(gone)?;
    let (done_tx, done_rx) = channel::<std::io::Result<()>>();
    let job: Job = Box::new(move || {
        let _ = done_tx.send(std::thread::Builder::new().name(name).spawn(f).map(|_| ()));
    });
    tx.lock().map_err(|_| gone())?.send(job).map_err(|_| gone())?;
    done_rx.recv().map_err(|_| gone())?
}

/// Install the guest-thread filter on the calling thread (and the threads it
/// starts from now on), in `mode`. Also sets PR_SET_NO_NEW_PRIVS on it.
pub fn enter_guest_thread(mode: Mode) -> Result<(), JailError> {
    install(mode, Profile::GuestThread)
}

/// The filter of a sandbox worker process (`forkbox_worker`), on its only
/// thread: every thread it ever has inherits it. The guest-thread list
/// without the host file calls a worker never makes ([`NOT_IN_WORKERS`]) and
/// with `openat` only for reading. No unfiltered spawner thread is started
/// (a worker never builds templates).
pub fn enter_worker(mode: Mode) -> Result<(), JailError> {
    install(mode, Profile::Worker)
}

/// The filter of a sandbox worker's launcher, the process that started the
/// worker in its namespaces and now only waits for it ([`LAUNCHER`]): a
/// worker's compromise that reached it (it is outside the worker's pid
/// namespace, as the worker's unprivileged uid) finds nothing to call.
pub fn enter_launcher(mode: Mode) -> Result<(), JailError> {
    install(mode, Profile::Launcher)
}

fn install(mode: Mode, profile: Profile) -> Result<(), JailError> {
    if mode == Mode::Off || current().is_some() {
        return Ok(());
    }
    let with_spawner = profile == Profile::GuestThread;
    let progs = programs(mode, profile)?;
    // Start the spawner while this thread is still unfiltered.
    if with_spawner && !is_filtered() {
        let _ = spawner();
    }
    // Filters are evaluated last-installed first; all of them run and the
    // strictest answer wins, so the order does not change the outcome.
    for p in progs {
        seccompiler::apply_filter(p).map_err(|e| JailError::Install(e.to_string()))?;
    }
    JAILED.with(|j| j.set(Some(mode)));
    tracing::debug!(?mode, "seccomp filter installed on a guest thread");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_request_numbers_match_the_kernel_headers() {
        let n: BTreeMap<_, _> = kvm_ioctls().into_iter().collect();
        assert_eq!(n["KVM_RUN"], 0xAE80);
        assert_eq!(n["KVM_CREATE_VM"], 0xAE01);
        assert_eq!(n["KVM_GET_REGS"], 0x8090_AE81);
        assert_eq!(n["KVM_SET_REGS"], 0x4090_AE82);
        assert_eq!(n["KVM_GET_SREGS"], 0x8138_AE83);
        assert_eq!(n["KVM_SET_USER_MEMORY_REGION"], 0x4020_AE46);
        assert_eq!(n["KVM_GET_XSAVE"], 0x9000_AEA4);
        assert_eq!(n["KVM_SET_CPUID2"], 0x4008_AE90);
        assert_eq!(PAGEMAP_SCAN, 0xC060_6610);
    }

    #[test]
    fn the_filters_compile() {
        for p in [Profile::GuestThread, Profile::Worker] {
            assert_eq!(programs(Mode::Enforce, p).unwrap().len(), 3);
            assert_eq!(programs(Mode::Eperm, p).unwrap().len(), 3);
            assert!(programs(Mode::Off, p).unwrap().is_empty());
        }
        assert_eq!(programs(Mode::Enforce, Profile::Launcher).unwrap().len(), 1);
        let launcher = rules(Profile::Launcher).unwrap();
        for nr in
            [libc::SYS_openat, libc::SYS_socket, libc::SYS_ioctl, libc::SYS_clone, libc::SYS_execve, libc::SYS_kill]
        {
            assert!(!launcher.contains_key(&nr), "the launcher may not call {nr}");
        }
        let worker = rules(Profile::Worker).unwrap();
        assert!(!worker.contains_key(&libc::SYS_rename) && !worker.contains_key(&libc::SYS_unlink));
        assert_eq!(worker[&libc::SYS_openat].len(), 1, "openat is conditional in workers");
        // No network in a worker: socket only for AF_UNIX, no connect, bind, listen or accept.
        assert_eq!(worker[&libc::SYS_socket].len(), 1, "socket: AF_UNIX only in workers");
        for nr in [libc::SYS_connect, libc::SYS_bind, libc::SYS_listen, libc::SYS_accept4] {
            assert!(!worker.contains_key(&nr), "a worker may not call {nr}");
        }
        let threads = rules(Profile::GuestThread).unwrap();
        assert_eq!(threads[&libc::SYS_socket].len(), 4);
        assert!(threads.contains_key(&libc::SYS_connect));
    }
}
