//! Handlers run without KVM: a process over a small packed image, guest RAM
//! from `GuestMemory::anonymous`, one mapped buffer for arguments, and
//! `dispatch` as the engine calls it.

use std::sync::Arc;

use forkbox_image::{pack_dir, Image};
use forkbox_vmm::GuestMemory;

use super::{dispatch, Ctx};
use crate::errno::Errno;
use crate::io::Io;
use crate::layout::RAM_SIZE;
use crate::mm::VmaKind;
use crate::process::Process;
use crate::vfs::Vfs;

const BUF_LEN: u64 = 1 << 20;

struct Guest {
    _dir: tempfile::TempDir,
    mem: GuestMemory,
    proc: Process,
    io: Io,
    /// A readable and writable guest buffer of `BUF_LEN` bytes.
    buf: u64,
}

fn guest() -> Guest {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("tmp")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/hostname"), b"forkbox\n").unwrap();
    let img = dir.path().join("img");
    pack_dir(&root, &img).unwrap();
    let image = Arc::new(Image::open(&img).unwrap());
    let mut proc = Process::new(Vfs::new(image), 1 << 30);
    let buf = proc.mm.map(None, BUF_LEN, (libc::PROT_READ | libc::PROT_WRITE) as u32, VmaKind::Anon).unwrap();
    let mem = GuestMemory::anonymous(RAM_SIZE).unwrap();
    Guest { _dir: dir, mem, proc, io: Io::new(1 << 16), buf }
}

impl Guest {
    fn call(&mut self, nr: i64, args: &[u64]) -> Result<u64, Errno> {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        let mut ctx =
            Ctx { mem: &mut self.mem, proc: &mut self.proc, io: &mut self.io, effect: None, timed_out: false };
        dispatch(&mut ctx, nr as u64, &a)
    }

    fn put(&mut self, off: u64, data: &[u8]) -> u64 {
        let addr = self.buf + off;
        self.mem.write_untracked(addr, data).unwrap();
        addr
    }

    fn get(&self, off: u64, len: u64) -> Vec<u8> {
        self.mem.slice(self.buf + off, len).unwrap().to_vec()
    }

    fn get_i64(&self, off: u64) -> i64 {
        i64::from_le_bytes(self.get(off, 8).try_into().unwrap())
    }

    /// A NUL-terminated path in the buffer (at `off`).
    fn path(&mut self, off: u64, p: &str) -> u64 {
        let mut b = p.as_bytes().to_vec();
        b.push(0);
        self.put(off, &b)
    }

    fn open(&mut self, p: &str, flags: i32) -> i32 {
        let path = self.path(0x8000, p);
        self.call(libc::SYS_open, &[path, flags as u64, 0o644]).unwrap() as i32
    }

    fn size(&mut self, fd: i32) -> i64 {
        let st = self.buf + 0x1000;
        self.call(libc::SYS_fstat, &[fd as u64, st]).unwrap();
        self.get_i64(0x1000 + 48)
    }
}

fn timespec(s: i64, ns: i64) -> Vec<u8> {
    [s.to_le_bytes(), ns.to_le_bytes()].concat()
}

#[test]
fn clock_settime_is_eperm_for_settable_clocks_and_einval_for_the_rest() {
    let mut g = guest();
    let ts = g.put(0, &timespec(1_700_000_000, 0));
    let set = |g: &mut Guest, clock: i32, ts: u64| g.call(libc::SYS_clock_settime, &[clock as u64, ts]);
    assert_eq!(set(&mut g, libc::CLOCK_REALTIME, ts), Err(Errno::EPERM));
    assert_eq!(set(&mut g, libc::CLOCK_PROCESS_CPUTIME_ID, ts), Err(Errno::EPERM));
    for c in [libc::CLOCK_MONOTONIC, libc::CLOCK_BOOTTIME, libc::CLOCK_MONOTONIC_RAW, libc::CLOCK_TAI, 99] {
        assert_eq!(set(&mut g, c, ts), Err(Errno::EINVAL), "clock {c}");
    }
    // The value is checked before the permission, the pointer before the value.
    let bad = g.put(64, &timespec(0, 1_000_000_000));
    assert_eq!(set(&mut g, libc::CLOCK_REALTIME, bad), Err(Errno::EINVAL));
    assert_eq!(set(&mut g, libc::CLOCK_REALTIME, 8), Err(Errno::EFAULT));
}

/// glibc's MAKE_THREAD_CPUCLOCK / MAKE_PROCESS_CPUCLOCK (kind 2: SCHED).
fn cpu_clock(id: u32, thread: bool) -> u64 {
    ((!(id as i32) << 3) | if thread { 4 } else { 0 } | 2) as i64 as u64
}

#[test]
fn cpu_time_clocks_of_a_pid_or_thread_read_like_the_own_ones() {
    let mut g = guest();
    let (pid, tid) = (g.proc.pid, g.proc.tid() as u32);
    let ts = g.buf;
    for clock in [cpu_clock(tid, true), cpu_clock(pid, false), cpu_clock(0, true), cpu_clock(0, false)] {
        assert_eq!(g.call(libc::SYS_clock_gettime, &[clock, ts]), Ok(0), "clock {clock:#x}");
        let (s, ns) = (g.get_i64(0), g.get_i64(8));
        assert!(s >= 0 && (0..1_000_000_000).contains(&ns));
        assert_eq!(g.call(libc::SYS_clock_getres, &[clock, ts]), Ok(0));
    }
    // No such thread or process; a clock fd (kind 3).
    assert_eq!(g.call(libc::SYS_clock_gettime, &[cpu_clock(tid + 1000, true), ts]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_clock_gettime, &[cpu_clock(pid + 1000, false), ts]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_clock_gettime, &[(!3i64 << 3 | 3) as u64, ts]), Err(Errno::EINVAL));
}

#[test]
fn setpriority_is_kept_and_lowering_the_nice_value_needs_privilege() {
    let mut g = guest();
    let pid = g.proc.pid as u64;
    let get = |g: &mut Guest, which: u64, who: u64| g.call(libc::SYS_getpriority, &[which, who]);
    assert_eq!(get(&mut g, 0, 0), Ok(20));
    assert_eq!(g.call(libc::SYS_setpriority, &[0, pid, 5]), Ok(0));
    assert_eq!(get(&mut g, 0, pid), Ok(15));
    assert_eq!(get(&mut g, 1, 0), Ok(15), "the process group's");
    // Clamped to 19, as Linux.
    assert_eq!(g.call(libc::SYS_setpriority, &[0, 0, 100]), Ok(0));
    assert_eq!(get(&mut g, 0, 0), Ok(1));
    assert_eq!(g.call(libc::SYS_setpriority, &[0, 12345, 1]), Err(Errno::ESRCH));
    assert_eq!(g.call(libc::SYS_setpriority, &[7, 0, 1]), Err(Errno::EINVAL));
    // Not root any more: raising the priority is EACCES, lowering it works.
    g.proc.creds.uid.effective = 1000;
    assert_eq!(g.call(libc::SYS_setpriority, &[0, 0, 10]), Err(Errno::EACCES));
    assert_eq!(g.call(libc::SYS_setpriority, &[0, 0, 19]), Ok(0));
    assert_eq!(get(&mut g, 0, 0), Ok(1));
}

#[test]
fn scheduling_policies_ranges_and_time_slices() {
    let mut g = guest();
    assert_eq!(g.call(libc::SYS_sched_get_priority_min, &[libc::SCHED_RR as u64]), Ok(1));
    assert_eq!(g.call(libc::SYS_sched_get_priority_max, &[libc::SCHED_RR as u64]), Ok(99));
    assert_eq!(g.call(libc::SYS_sched_get_priority_max, &[libc::SCHED_OTHER as u64]), Ok(0));
    assert_eq!(g.call(libc::SYS_sched_get_priority_max, &[(-23i64) as u64]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sched_get_priority_min, &[(-23i64) as u64]), Err(Errno::EINVAL));
    let ts = g.buf;
    assert_eq!(g.call(libc::SYS_sched_rr_get_interval, &[0, ts]), Ok(0));
    let (s, ns) = (g.get_i64(0), g.get_i64(8));
    assert!(s == 0 && ns > 0 && ns < 1_000_000_000);
    assert_eq!(g.call(libc::SYS_sched_rr_get_interval, &[(-1i64) as u64, ts]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sched_rr_get_interval, &[4242, ts]), Err(Errno::ESRCH));
}

#[test]
fn affinity_of_no_process_is_esrch_and_an_empty_mask_einval() {
    let mut g = guest();
    let mask = g.buf;
    assert_eq!(g.call(libc::SYS_sched_getaffinity, &[0, 8, mask]), Ok(8));
    assert_eq!(g.get(0, 8), 1u64.to_le_bytes());
    assert_eq!(g.call(libc::SYS_sched_getaffinity, &[(-1i64) as u64, 8, mask]), Err(Errno::ESRCH));
    assert_eq!(g.call(libc::SYS_sched_setaffinity, &[0, 8, mask]), Ok(0));
    assert_eq!(g.call(libc::SYS_sched_setaffinity, &[(-1i64) as u64, 8, mask]), Err(Errno::ESRCH));
    let pid = g.proc.pid as u64;
    assert_eq!(g.call(libc::SYS_sched_setaffinity, &[pid, 8, mask]), Ok(0));
    let empty = g.put(64, &[0u8; 8]);
    assert_eq!(g.call(libc::SYS_sched_setaffinity, &[0, 8, empty]), Err(Errno::EINVAL));
}

#[test]
fn fallocate_grows_files_punches_holes_and_checks_like_linux() {
    let mut g = guest();
    let fd = g.open("/tmp/f", libc::O_CREAT | libc::O_RDWR);
    let fa = |g: &mut Guest, fd: i32, mode: i32, off: i64, len: i64| {
        g.call(libc::SYS_fallocate, &[fd as u64, mode as u64, off as u64, len as u64])
    };
    assert_eq!(fa(&mut g, fd, 0, 0, 10), Ok(0));
    assert_eq!(g.size(fd), 10);
    // Never shrinks; KEEP_SIZE keeps the size.
    assert_eq!(fa(&mut g, fd, 0, 0, 4), Ok(0));
    assert_eq!(fa(&mut g, fd, libc::FALLOC_FL_KEEP_SIZE, 0, 100), Ok(0));
    assert_eq!(g.size(fd), 10);
    let data = g.put(0, b"abcdefghij");
    assert_eq!(g.call(libc::SYS_pwrite64, &[fd as u64, data, 10, 0]), Ok(10));
    let hole = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(fa(&mut g, fd, hole, 2, 3), Ok(0));
    assert_eq!(g.call(libc::SYS_pread64, &[fd as u64, g.buf + 64, 10, 0]), Ok(10));
    assert_eq!(g.get(64, 10), b"ab\0\0\0fghij");
    assert_eq!(fa(&mut g, fd, libc::FALLOC_FL_PUNCH_HOLE, 0, 1), Err(Errno::EOPNOTSUPP));
    assert_eq!(fa(&mut g, fd, 0x10 /* ZERO_RANGE */, 0, 1), Err(Errno::EOPNOTSUPP));
    assert_eq!(fa(&mut g, fd, 0, -1, 10), Err(Errno::EINVAL));
    assert_eq!(fa(&mut g, fd, 0, 0, 0), Err(Errno::EINVAL));
    assert_eq!(fa(&mut g, fd, 0, i64::MAX, 10), Err(Errno::EFBIG));
    assert_eq!(fa(&mut g, -42, 0, 0, 10), Err(Errno::EBADF));
    let ro = g.open("/tmp/f", libc::O_RDONLY);
    assert_eq!(fa(&mut g, ro, 0, 0, 10), Err(Errno::EBADF));
    let dir = g.open("/tmp", libc::O_RDONLY | libc::O_DIRECTORY);
    assert_eq!(fa(&mut g, dir, 0, 0, 10), Err(Errno::EBADF), "a directory is never open for writing");
    // The disk quota holds.
    g.proc.vfs.set_quota(1 << 16);
    assert_eq!(fa(&mut g, fd, 0, 0, 1 << 20), Err(Errno::ENOSPC));
    assert_eq!(g.size(fd), 10);
}

#[test]
fn f_notify_removes_nothing_and_refuses_events() {
    let mut g = guest();
    let dir = g.open("/tmp", libc::O_RDONLY | libc::O_DIRECTORY);
    let file = g.open("/etc/hostname", libc::O_RDONLY);
    let notify = |g: &mut Guest, fd: i32, arg: u64| g.call(libc::SYS_fcntl, &[fd as u64, libc::F_NOTIFY as u64, arg]);
    // DN_MULTISHOT is bit 31: the argument does not fit an int.
    assert_eq!(notify(&mut g, dir, 0x8000_0000), Ok(0));
    assert_eq!(notify(&mut g, dir, 0), Ok(0));
    assert_eq!(notify(&mut g, dir, 0x2 /* DN_MODIFY */), Err(Errno::EINVAL));
    assert_eq!(notify(&mut g, file, 0), Err(Errno::ENOTDIR));
}

#[test]
fn host_and_domain_names_cannot_be_set() {
    let mut g = guest();
    let name = g.put(0, b"new");
    assert_eq!(g.call(libc::SYS_sethostname, &[name, 3]), Err(Errno::EPERM));
    assert_eq!(g.call(libc::SYS_setdomainname, &[name, 3]), Err(Errno::EPERM));
}
