//! Host tools that read packages a tenant chose (pip, the wheel unpacker) run
//! confined: in a fresh, empty working directory of their own (so no file
//! name can resolve to something else on the host), with a scrubbed
//! environment, no inherited file descriptors, resource limits (address
//! space, CPU time, the largest file, tasks, no core dumps) and, when the
//! server runs as root, as the unprivileged uid/gid [`NOBODY`] with no
//! supplementary groups and NO_NEW_PRIVS, in a mount namespace of its own
//! where the few host directories it needs (the pip cache, the unpacker's
//! output) are bind-mounted into its working area.
//!
//! The full worker jail (pivot_root, user namespace, seccomp) lives in
//! `forkbox_worker`, above this crate; this is the part a short-lived host
//! tool needs, and the tools never run package code (binary wheels only,
//! unpacked by the standard library's `zipfile`).

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::BuildError;

/// The unprivileged uid and gid the tools run as when the server is root.
pub const NOBODY: u32 = 65534;

/// Environment variables an operator may set for pip that pass into the
/// confined pip (where it finds packages and how it reaches them). Every
/// other variable is dropped.
pub const PIP_ENV: &[&str] = &[
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_CERT",
    "PIP_CLIENT_CERT",
    "PIP_PROXY",
    "PIP_TIMEOUT",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_RETRIES",
    "PIP_CONFIG_FILE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
];

/// Resource limits of one confined process.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// RLIMIT_AS (bytes).
    pub address_space: u64,
    /// RLIMIT_CPU (seconds).
    pub cpu_seconds: u64,
    /// RLIMIT_FSIZE: the largest file it may write (bytes).
    pub file_bytes: u64,
}

/// Tasks (processes and threads) of the unprivileged uid (RLIMIT_NPROC counts
/// them per uid: every confined tool at once). Only set when the uid changes:
/// the server's own uid has its threads.
const MAX_TASKS: u64 = 256;
const MAX_FILES: u64 = 1024;

fn cstr(p: &Path) -> Result<CString, BuildError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| BuildError::Invalid { step: "confine", msg: "a path with a NUL byte".into() })
}

/// A confined working area: `<tmp>/forkbox-jail-XXXX` with `work` (the empty
/// working directory), `home` and `tmp`, owned by the uid the tools run as.
pub struct Jail {
    dir: tempfile::TempDir,
    uid: Option<u32>,
    /// (host source, target in `dir`, writable), mounted in the child.
    binds: Vec<(CString, CString, bool)>,
}

impl Jail {
    /// A new area in the system's temporary directory (reachable by the
    /// unprivileged uid, unlike a data directory under root's home).
    pub fn new() -> Result<Jail, BuildError> {
        // SAFETY: geteuid has no preconditions.
        let uid = (unsafe { libc::geteuid() } == 0).then_some(NOBODY);
        let tmp = std::env::temp_dir();
        let dir = tempfile::Builder::new()
            .prefix("forkbox-jail-")
            .tempdir_in(&tmp)
            .map_err(|e| BuildError::io("confine", &tmp, e))?;
        let j = Jail { dir, uid, binds: Vec::new() };
        j.own(j.dir.path())?;
        for d in ["work", "home", "tmp"] {
            j.mkdir(d)?;
        }
        Ok(j)
    }

    /// The uid the tools run as (None: this process' own).
    pub fn uid(&self) -> Option<u32> {
        self.uid
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Give `p` to the tools' uid (nothing when the uid does not change).
    pub fn own(&self, p: &Path) -> Result<(), BuildError> {
        if let Some(uid) = self.uid {
            std::os::unix::fs::lchown(p, Some(uid), Some(uid)).map_err(|e| BuildError::io("confine", p, e))?;
        }
        Ok(())
    }

    /// A new directory `name` in the area, the tools' own; its path.
    pub fn mkdir(&self, name: &str) -> Result<PathBuf, BuildError> {
        let p = self.dir.path().join(name);
        std::fs::create_dir(&p).map_err(|e| BuildError::io("confine", &p, e))?;
        self.own(&p)?;
        Ok(p)
    }

    /// The host directory `src` as the tools see it: bind-mounted at `name` in
    /// the area when the uid changes (the path to it may pass directories
    /// the uid cannot enter), else `src` itself. A writable one is given to
    /// the tools' uid (not its contents).
    pub fn bind(&mut self, src: &Path, name: &str, writable: bool) -> Result<PathBuf, BuildError> {
        if self.uid.is_none() {
            return Ok(src.to_path_buf());
        }
        if writable {
            self.own(src)?;
        }
        let target = self.mkdir(name)?;
        self.binds.push((cstr(src)?, cstr(&target)?, writable));
        Ok(target)
    }

    /// `program` set up to run confined: scrubbed environment (`keep`, plus
    /// HOME, TMPDIR, PATH and a UTF-8 locale), the empty `work` directory,
    /// the limits, the uid, no inherited descriptors but 0-2.
    pub fn command(&self, program: impl Into<OsString>, keep: &[&str], limits: Limits) -> Command {
        let mut c = Command::new(program.into());
        c.env_clear();
        for k in keep {
            if let Some(v) = std::env::var_os(k) {
                c.env(k, v);
            }
        }
        c.env("HOME", self.dir.path().join("home"))
            .env("TMPDIR", self.dir.path().join("tmp"))
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LC_ALL", "C.UTF-8")
            .env("PYTHONNOUSERSITE", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(self.dir.path().join("work"));
        let uid = self.uid;
        let binds = self.binds.clone();
        // SAFETY: between fork and exec only async-signal-safe system calls on
        // integers and strings built before the fork.
        unsafe {
            c.pre_exec(move || child_setup(uid, &binds, limits));
        }
        c
    }
}

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// In the forked child before exec: async-signal-safe calls only.
fn child_setup(uid: Option<u32>, binds: &[(CString, CString, bool)], limits: Limits) -> std::io::Result<()> {
    // SAFETY: system calls on integers and on NUL-terminated strings that
    // outlive the calls; no allocation.
    unsafe {
        // Every descriptor above stderr closes at exec (std's own error pipe
        // is close-on-exec already and must stay open until then).
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        if libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC) < 0 {
            for fd in 3..65536 {
                let fl = libc::fcntl(fd, libc::F_GETFD);
                if fl >= 0 {
                    libc::fcntl(fd, libc::F_SETFD, fl | libc::FD_CLOEXEC);
                }
            }
        }
        let set = |res: libc::__rlimit_resource_t, n: u64| {
            let l = libc::rlimit { rlim_cur: n, rlim_max: n };
            check(libc::setrlimit(res, &l) as libc::c_long)
        };
        set(libc::RLIMIT_AS, limits.address_space)?;
        set(libc::RLIMIT_CPU, limits.cpu_seconds)?;
        set(libc::RLIMIT_FSIZE, limits.file_bytes)?;
        set(libc::RLIMIT_CORE, 0)?;
        set(libc::RLIMIT_NOFILE, MAX_FILES)?;
        if let Some(uid) = uid {
            set(libc::RLIMIT_NPROC, MAX_TASKS)?;
            check(libc::unshare(libc::CLONE_NEWNS) as libc::c_long)?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) as libc::c_long)?;
            for (src, target, writable) in binds {
                let flags = libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV;
                check(libc::mount(src.as_ptr(), target.as_ptr(), std::ptr::null(), flags, std::ptr::null())
                    as libc::c_long)?;
                let ro = if *writable { 0 } else { libc::MS_RDONLY };
                check(libc::mount(
                    std::ptr::null(),
                    target.as_ptr(),
                    std::ptr::null(),
                    flags | libc::MS_REMOUNT | ro,
                    std::ptr::null(),
                ) as libc::c_long)?;
            }
            check(libc::setgroups(0, std::ptr::null()) as libc::c_long)?;
            check(libc::setresgid(uid, uid, uid) as libc::c_long)?;
            check(libc::setresuid(uid, uid, uid) as libc::c_long)?;
        }
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) as libc::c_long)?;
        // After the uid change (which clears it): die with the server.
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) as libc::c_long)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a confined process is: its uid and groups, its limits, an empty
    /// working directory, no descriptor of ours, a scrubbed environment.
    #[test]
    fn a_confined_process() {
        let leak = std::fs::File::open("/etc/hostname").unwrap();
        let _ = &leak;
        std::env::set_var("FORKBOX_TEST_SECRET", "s3cret");
        std::env::set_var("PIP_INDEX_URL", "http://127.0.0.1:9/simple");
        let j = Jail::new().unwrap();
        let limits = Limits { address_space: 1 << 30, cpu_seconds: 7, file_bytes: 4096 };
        let script = "id -u; id -G; ulimit -c; ulimit -t; ulimit -f; ulimit -v; echo \"cwd=[$(ls -A)]\"; ls /proc/self/fd | wc -l; \
                      env | sort | tr '\\n' ' '; echo; head -c 8192 /dev/zero > big; echo wrote=$?";
        let o = j.command("/bin/sh", PIP_ENV, limits).args(["-c", script]).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = out.lines().collect();
        // SAFETY: no preconditions.
        let me = unsafe { libc::geteuid() };
        let want = if me == 0 { NOBODY } else { me };
        assert_eq!(lines[0], want.to_string(), "{out}");
        if me == 0 {
            assert_eq!(lines[1], NOBODY.to_string(), "no supplementary groups: {out}");
        }
        assert_eq!(&lines[2..6], ["0", "7", "8", "1048576"], "core, cpu, fsize (512-byte blocks), as (KiB): {out}");
        assert_eq!(lines[6], "cwd=[]", "an empty working directory: {out}");
        // 0, 1, 2 and the one ls opens to read the directory.
        assert_eq!(lines[7], "4", "no inherited descriptors: {out}");
        assert!(!lines[8].contains("s3cret") && lines[8].contains("PIP_INDEX_URL="), "{out}");
        assert!(lines[9] != "wrote=0", "RLIMIT_FSIZE: {out}");
        drop(leak);
    }
}
