//! The worker's jail, entered before it reads any guest input.
//!
//! In order, in the worker (which starts as the server's child, host root):
//! 1. [`join_cgroup`]: its own cgroup (v2 where the memory controller is on
//!    v2, else v1 `memory` + `pids`), bounding its memory and tasks;
//! 2. [`unshare_outer`]: new mount, IPC, UTS, pid and network namespaces; mounts made
//!    private; [`build_root`]: a small tmpfs with only the read-only binds
//!    the VMM needs (the images, templates and package layers; the resolver's
//!    files) — never `keys.db`, never the sessions directory;
//! 3. a fork: the child is pid 1 of the new pid namespace (the parent only
//!    waits for it); [`enter_root`] in the child: a fresh `/proc`, `pivot_root`,
//!    the old root detached, the root remounted read-only, its own hostname;
//! 4. [`drop_privileges`]: supplementary groups dropped, a new user namespace
//!    whose root is the unprivileged host uid `Hello::uid` (a helper still in
//!    the host's user namespace writes the maps), every capability dropped
//!    (effective, permitted, inheritable, ambient, bounding), NO_NEW_PRIVS,
//!    rlimits (files, tasks, no core, the size of a file it writes);
//! 5. the seccomp allow-list (`forkbox_engine::jail::enter_worker`).
//!
//! The network namespace is empty (a loopback interface, down): a guest's
//! TCP/UDP sockets are host sockets the egress broker in the API process
//! opens, once the sandbox's policy (held there) allows the destination, and
//! passes over the worker's AF_UNIX socket to it (`crate::broker`); the
//! filter lets the worker make no socket of its own.

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::protocol::Hello;

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{call}: {err}")]
    Sys { call: String, err: std::io::Error },
    #[error("{0}")]
    Setup(String),
}

fn last(call: impl Into<String>) -> JailError {
    JailError::Sys { call: call.into(), err: std::io::Error::last_os_error() }
}

fn check(r: libc::c_int, call: impl Into<String>) -> Result<(), JailError> {
    if r < 0 {
        return Err(last(call));
    }
    Ok(())
}

fn cstr(p: impl AsRef<Path>) -> Result<CString, JailError> {
    CString::new(p.as_ref().as_os_str().as_bytes()).map_err(|_| JailError::Setup("a path with a NUL byte".into()))
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), JailError> {
    let src_c = src.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let fstype_c = fstype.map(|f| CString::new(f).unwrap_or_default());
    let data_c = data.map(|d| CString::new(d).unwrap_or_default());
    // SAFETY: every pointer is NULL or a NUL-terminated string that outlives the call.
    let r = unsafe {
        libc::mount(
            src_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            target_c.as_ptr(),
            fstype_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            flags,
            data_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr() as *const libc::c_void),
        )
    };
    check(r, format!("mount {}", target.display()))
}

fn write_file(path: &str, data: &str) -> Result<(), JailError> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(data.as_bytes()))
        .map_err(|err| JailError::Sys { call: format!("writing {path}"), err })
}

/// Close every fd above `keep` (what the server process had open and did not
/// mark close-on-exec must not reach guest input).
pub fn close_fds_above(keep: i32) {
    // SAFETY: close_range takes integers; fds above `keep` belong to no Rust object yet.
    let r = unsafe { libc::syscall(libc::SYS_close_range, (keep + 1) as libc::c_uint, libc::c_uint::MAX, 0) };
    if r < 0 {
        for fd in (keep + 1)..1024 {
            // SAFETY: as above.
            unsafe { libc::close(fd) };
        }
    }
}

/// The launcher (which only waits for the worker): the worker's unprivileged
/// uid in the host's user namespace, so no capability (a uid change from 0 clears them).
pub fn drop_launcher(uid: u32) -> Result<(), JailError> {
    // SAFETY: plain id calls and prctl with integer arguments.
    unsafe {
        check(libc::setgroups(0, std::ptr::null()), "setgroups")?;
        check(libc::setresgid(uid, uid, uid), "setresgid")?;
        check(libc::setresuid(uid, uid, uid), "setresuid")?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    }
}

/// The cgroup directories of worker `index` of server `server_pid`.
pub fn cgroup_dirs(server_pid: u32, index: u32) -> Vec<std::path::PathBuf> {
    let name = format!("forkbox-worker-{server_pid}-{index}");
    let base = Path::new("/sys/fs/cgroup");
    vec![
        base.join("forkbox").join(&name),
        base.join("memory/forkbox").join(&name),
        base.join("pids/forkbox").join(&name),
    ]
}

/// Remove the cgroups of workers whose server is gone (an empty cgroup
/// directory is removed with rmdir; one still holding a process stays).
pub fn remove_stale_cgroups() {
    for parent in ["/sys/fs/cgroup/forkbox", "/sys/fs/cgroup/memory/forkbox", "/sys/fs/cgroup/pids/forkbox"] {
        let Ok(rd) = std::fs::read_dir(parent) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(pid) = name.strip_prefix("forkbox-worker-").and_then(|r| r.split('-').next()) else { continue };
            if !Path::new("/proc").join(pid).exists() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// Which cgroup hierarchy bounds the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cgroup {
    V2,
    V1,
    /// Neither is writable here (the bounds are then the rlimits alone).
    None,
}

/// Put this process in a cgroup of its own bounding memory and tasks. Best
/// effort: a host without a writable cgroup file system gets `Cgroup::None`.
pub fn join_cgroup(h: &Hello) -> Cgroup {
    let pid = std::process::id().to_string();
    let dirs = cgroup_dirs(std::os::unix::process::parent_id(), h.index);
    let v2 = Path::new("/sys/fs/cgroup");
    let has_memory = std::fs::read_to_string(v2.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
    if has_memory {
        let parent = v2.join("forkbox");
        let dir = &dirs[0];
        let ok = (|| -> std::io::Result<()> {
            std::fs::create_dir_all(dir)?;
            // Controllers must be enabled in the parent for its children.
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+memory +pids");
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids");
            if h.memory_bytes > 0 {
                std::fs::write(dir.join("memory.max"), h.memory_bytes.to_string())?;
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            }
            let _ = std::fs::write(dir.join("pids.max"), h.max_tasks.to_string());
            std::fs::write(dir.join("cgroup.procs"), &pid)
        })();
        match ok {
            Ok(()) => return Cgroup::V2,
            Err(e) => tracing::debug!("cgroup v2: {e}"),
        }
    }
    let v1 = |dir: &Path, files: &[(&str, String)]| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (f, v) in files {
            std::fs::write(dir.join(f), v)?;
        }
        std::fs::write(dir.join("cgroup.procs"), &pid)
    };
    let mem = if h.memory_bytes > 0 { vec![("memory.limit_in_bytes", h.memory_bytes.to_string())] } else { vec![] };
    match v1(&dirs[1], &mem).and_then(|_| v1(&dirs[2], &[("pids.max", h.max_tasks.to_string())])) {
        Ok(()) => Cgroup::V1,
        Err(e) => {
            tracing::warn!("the worker has no cgroup of its own ({e}): its bounds are its rlimits");
            Cgroup::None
        }
    }
}

/// New mount, IPC, UTS, cgroup and pid namespaces (the pid one for this
/// process' next child), and with `own_network` a new, empty network
/// namespace; every mount private, so nothing here reaches the host.
pub fn unshare_outer(own_network: bool) -> Result<(), JailError> {
    let flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP | libc::CLONE_NEWPID;
    // SAFETY: unshare takes flags only.
    check(unsafe { libc::unshare(flags) }, "unshare(CLONE_NEWNS|NEWIPC|NEWUTS|NEWCGROUP|NEWPID)")?;
    if own_network {
        // SAFETY: as above.
        check(unsafe { libc::unshare(libc::CLONE_NEWNET) }, "unshare(CLONE_NEWNET)")?;
    }
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)
}

/// A tmpfs at `h.root` holding the read-only binds and mount points for `/proc`.
pub fn build_root(h: &Hello) -> Result<(), JailError> {
    let root = h.root.as_path();
    mount(Some(Path::new("tmpfs")), root, Some("tmpfs"), libc::MS_NOSUID | libc::MS_NODEV, Some("size=1m,mode=0755"))?;
    let inside = |jail: &str| root.join(jail.trim_start_matches('/'));
    // No /etc/resolv.conf: the guest's names are resolved by the egress broker outside.
    let binds: Vec<(std::path::PathBuf, String)> = h.binds.iter().map(|b| (b.host.clone(), b.jail.clone())).collect();
    for (host, jail) in &binds {
        let target = inside(jail);
        let made = if host.is_dir() {
            std::fs::create_dir_all(&target)
        } else {
            target.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::write(&target, b""))
        };
        made.map_err(|err| JailError::Sys { call: format!("creating the mount point {jail}"), err })?;
        mount(Some(host), &target, None, libc::MS_BIND | libc::MS_REC, None)?;
        let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
        mount(None, &target, None, ro, None)?;
    }
    for d in ["proc", "old"] {
        std::fs::create_dir_all(root.join(d)).map_err(|err| JailError::Sys { call: format!("creating /{d}"), err })?;
    }
    Ok(())
}

/// In pid 1 of the new pid namespace: `/proc` of that namespace, then the root
/// becomes `h.root` (the host's file system detached), read-only.
pub fn enter_root(h: &Hello) -> Result<(), JailError> {
    let root = h.root.as_path();
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(Some(Path::new("proc")), &root.join("proc"), Some("proc"), nosuid, None)?;
    let root_c = cstr(root)?;
    let old_c = cstr(root.join("old"))?;
    // SAFETY: NUL-terminated paths that outlive the calls.
    unsafe {
        check(libc::chdir(root_c.as_ptr()), "chdir to the new root")?;
        check(libc::syscall(libc::SYS_pivot_root, root_c.as_ptr(), old_c.as_ptr()) as libc::c_int, "pivot_root")?;
        check(libc::chdir(c"/".as_ptr()), "chdir /")?;
        check(libc::umount2(c"/old".as_ptr(), libc::MNT_DETACH), "umount2 /old")?;
        check(libc::rmdir(c"/old".as_ptr()), "rmdir /old")?;
    }
    mount(None, Path::new("/"), None, libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV, None)?;
    let name = b"forkbox-worker";
    // SAFETY: a buffer and its length.
    check(unsafe { libc::sethostname(name.as_ptr() as *const libc::c_char, name.len()) }, "sethostname")
}

/// Become root of a new user namespace mapped to the unprivileged host
/// `h.uid`/`h.uid`, with no capability left and NO_NEW_PRIVS; rlimits.
pub fn drop_privileges(h: &Hello) -> Result<(), JailError> {
    // Host root's supplementary groups would stay in the credentials (unmapped) otherwise.
    // SAFETY: an empty list.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    let mut pipe = [0; 2];
    // SAFETY: a 2-int array.
    check(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) }, "pipe2")?;
    let me = std::process::id();
    // The maps of a user namespace can only name other host uids if written
    // from the parent namespace with CAP_SETUID: a helper child stays there.
    // SAFETY: the child only reads a pipe, writes three /proc files and exits.
    let helper = unsafe { libc::fork() };
    if helper < 0 {
        return Err(last("fork (the uid-map helper)"));
    }
    if helper == 0 {
        let mut b = [0u8; 1];
        // SAFETY: a one-byte buffer.
        let got = unsafe { libc::read(pipe[0], b.as_mut_ptr() as *mut libc::c_void, 1) };
        let ok = got == 1
            && write_file(&format!("/proc/{me}/setgroups"), "deny").is_ok()
            && write_file(&format!("/proc/{me}/uid_map"), &format!("0 {} 1\n", h.uid)).is_ok()
            && write_file(&format!("/proc/{me}/gid_map"), &format!("0 {} 1\n", h.uid)).is_ok();
        // SAFETY: ends the helper without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) }
    }
    // SAFETY: flags only; then a one-byte write to our own pipe.
    let unshared = unsafe { libc::unshare(libc::CLONE_NEWUSER) };
    let err = (unshared < 0).then(|| last("unshare(CLONE_NEWUSER)"));
    // SAFETY: a one-byte buffer; closing our pipe ends.
    unsafe {
        libc::write(pipe[1], b"x".as_ptr() as *const libc::c_void, if err.is_some() { 0 } else { 1 });
        libc::close(pipe[1]);
        libc::close(pipe[0]);
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(helper, &mut status, 0) };
    if let Some(e) = err {
        return Err(e);
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        return Err(JailError::Setup("writing the user namespace's uid/gid maps failed".into()));
    }
    // SAFETY: plain id calls (uid/gid 0 of the new namespace = h.uid on the host).
    unsafe {
        check(libc::setresgid(0, 0, 0), "setresgid")?;
        check(libc::setresuid(0, 0, 0), "setresuid")?;
    }
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_ulong>().ok())
        .unwrap_or(63);
    // SAFETY: prctl with integer arguments.
    unsafe {
        for cap in 0..=last_cap {
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        check(libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")?;
    }
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let hdr = CapHeader { version: 0x2008_0522, pid: 0 }; // _LINUX_CAPABILITY_VERSION_3
    let data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: a v3 header and the two data words it names.
    check(unsafe { libc::syscall(libc::SYS_capset, &hdr, data.as_ptr()) as libc::c_int }, "capset")?;
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "PR_SET_NO_NEW_PRIVS")?;
    // The uid change made the process non-dumpable, which gives its /proc/self
    // files to host root: the VMM reads /proc/self/pagemap to reset VMs for
    // reuse. Dumpable again (no core: RLIMIT_CORE 0; ptrace is not in the filter).
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) }, "PR_SET_DUMPABLE")?;
    let fsize = if h.max_file_bytes == 0 { libc::RLIM_INFINITY } else { h.max_file_bytes };
    let limits: [(libc::__rlimit_resource_t, u64, &str); 4] = [
        (libc::RLIMIT_NOFILE, 4096, "RLIMIT_NOFILE"),
        (libc::RLIMIT_NPROC, h.max_tasks, "RLIMIT_NPROC"),
        (libc::RLIMIT_CORE, 0, "RLIMIT_CORE"),
        // What it can write into a file it was given (a checkpoint's temp files), and its memfds.
        (libc::RLIMIT_FSIZE, fsize, "RLIMIT_FSIZE"),
    ];
    for (res, n, name) in limits {
        let l = libc::rlimit { rlim_cur: n, rlim_max: n };
        // SAFETY: a local rlimit.
        check(unsafe { libc::setrlimit(res, &l) }, format!("setrlimit {name}"))?;
    }
    Ok(())
}

/// Die with SIGKILL when the parent (the launcher waiting for us) does.
pub fn die_with_parent() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
}
