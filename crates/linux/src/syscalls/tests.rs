//! Handlers run without KVM: a process over a small packed image, guest RAM
//! from `GuestMemory::anonymous`, one mapped buffer for arguments, and
//! `dispatch` as the engine calls it.

use std::sync::Arc;

use forkbox_image::{pack_dir, Image};
use forkbox_vmm::GuestMemory;

use super::dispatch;
use crate::errno::Errno;
use crate::kernel::Ctx;
use crate::kernel::Kernel;
use crate::layout::RAM_SIZE;
use crate::mm::VmaKind;
use crate::process::Process;
use crate::vfs::Vfs;

const BUF_LEN: u64 = 1 << 20;

struct Guest {
    _dir: tempfile::TempDir,
    mem: GuestMemory,
    proc: Process,
    kernel: Kernel,
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
    Guest { _dir: dir, mem, proc, kernel: Kernel::new(1 << 16), buf }
}

impl Guest {
    fn call(&mut self, nr: i64, args: &[u64]) -> Result<u64, Errno> {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        let mut ctx =
            Ctx { mem: &mut self.mem, proc: &mut self.proc, kernel: &mut self.kernel, effect: None, timed_out: false };
        dispatch(&mut ctx, nr as u64, &a)
    }

    /// `call`, with the effect the handler asked of the engine.
    fn call_effect(&mut self, nr: i64, args: &[u64]) -> (Result<u64, Errno>, Option<crate::kernel::Effect>) {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        let mut ctx =
            Ctx { mem: &mut self.mem, proc: &mut self.proc, kernel: &mut self.kernel, effect: None, timed_out: false };
        let r = dispatch(&mut ctx, nr as u64, &a);
        (r, ctx.effect)
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

#[test]
fn cpu_time_interval_timers_count_down_charged_run_time_and_signal() {
    let mut g = guest();
    // itimerval {interval 0.2 s, value 0.3 s}
    let spec = g.put(0, &[timespec(0, 200_000), timespec(0, 300_000)].concat());
    let out = g.buf + 64;
    for (which, signo) in [(libc::ITIMER_VIRTUAL, libc::SIGVTALRM), (libc::ITIMER_PROF, libc::SIGPROF)] {
        assert_eq!(g.call(libc::SYS_setitimer, &[which as u64, spec, 0]), Ok(0));
        assert_eq!(g.call(libc::SYS_getitimer, &[which as u64, out]), Ok(0));
        assert_eq!((g.get_i64(64), g.get_i64(72), g.get_i64(80), g.get_i64(88)), (0, 200_000, 0, 300_000));
        // Not yet due: the time left shrinks, nothing is sent.
        g.proc.threads.charge_cpu(100_000_000);
        assert!(!g.proc.threads.any_pending());
        assert_eq!(g.call(libc::SYS_getitimer, &[which as u64, out]), Ok(0));
        assert_eq!((g.get_i64(80), g.get_i64(88)), (0, 200_000));
        // Due: the signal is pending for the process and the timer re-arms with its interval.
        g.proc.threads.charge_cpu(250_000_000);
        assert!(g.proc.threads.pending.iter().any(|s| s.signo == signo));
        assert_eq!(g.call(libc::SYS_getitimer, &[which as u64, out]), Ok(0));
        assert_eq!((g.get_i64(80), g.get_i64(88)), (0, 150_000));
        // Disarm: getitimer reads zero; the run clock never fires it.
        let zero = g.put(128, &[0u8; 32]);
        assert_eq!(g.call(libc::SYS_setitimer, &[which as u64, zero, out]), Ok(0));
        assert_eq!((g.get_i64(80), g.get_i64(88)), (0, 150_000), "the old value");
        assert_eq!(g.call(libc::SYS_getitimer, &[which as u64, out]), Ok(0));
        assert_eq!((g.get_i64(64), g.get_i64(72), g.get_i64(80), g.get_i64(88)), (0, 0, 0, 0));
        g.proc.threads.pending.clear();
    }
    assert!(g.proc.threads.timers.is_empty());
    assert_eq!(g.call(libc::SYS_setitimer, &[3, spec, 0]), Err(Errno::EINVAL));
    // A CPU timer is not on the run clock: it never fires by itself.
    assert_eq!(g.call(libc::SYS_setitimer, &[libc::ITIMER_PROF as u64, spec, 0]), Ok(0));
    assert_eq!(g.proc.threads.next_event(), None);
    g.proc.threads.fire_timers(u64::MAX);
    assert!(!g.proc.threads.any_pending());
    assert_eq!(g.proc.threads.next_cpu_event(), Some(300_000_000));
}

/// glibc's MAKE_THREAD_CPUCLOCK / MAKE_PROCESS_CPUCLOCK (kind 2: SCHED).
fn cpu_clock(id: u32, thread: bool) -> u64 {
    ((!(id as i32) << 3) | if thread { 4 } else { 0 } | 2) as i64 as u64
}

#[test]
fn cpu_time_clocks_of_a_pid_or_thread_read_like_the_own_ones() {
    let mut g = guest();
    let (pid, tid) = (g.proc.pid, g.proc.tid());
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

/// struct sockaddr_in6 for [::1]:port.
fn loopback6(port: u16) -> Vec<u8> {
    let mut b = vec![0u8; 28];
    b[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_le_bytes());
    b[2..4].copy_from_slice(&port.to_be_bytes());
    b[23] = 1;
    b
}

fn cmsg(level: i32, ty: i32, data: &[u8]) -> Vec<u8> {
    let mut b = ((16 + data.len()) as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&level.to_le_bytes());
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(data);
    b.resize((b.len() + 7) & !7, 0);
    b
}

impl Guest {
    /// A struct msghdr at `off` (name, one iovec, control) in the buffer.
    fn msghdr(&mut self, off: u64, name: Option<u64>, iov: (u64, u64), control: (u64, u64)) -> u64 {
        let iov_at = self.put(off + 64, &[iov.0.to_le_bytes(), iov.1.to_le_bytes()].concat());
        let mut h = vec![0u8; 56];
        if let Some(n) = name {
            h[..8].copy_from_slice(&n.to_le_bytes());
            h[8..12].copy_from_slice(&28u32.to_le_bytes());
        }
        h[16..24].copy_from_slice(&iov_at.to_le_bytes());
        h[24..32].copy_from_slice(&1u64.to_le_bytes());
        h[32..40].copy_from_slice(&control.0.to_le_bytes());
        h[40..48].copy_from_slice(&control.1.to_le_bytes());
        self.put(off, &h)
    }

    fn set_int(&mut self, fd: u64, level: i32, name: i32, v: i32) {
        let p = self.put(0x7000, &v.to_le_bytes());
        assert_eq!(self.call(libc::SYS_setsockopt, &[fd, level as u64, name as u64, p, 4]), Ok(0));
    }
}

#[test]
fn ipv6_hop_limit_and_traffic_class_reach_the_receiver_as_ancillary_data() {
    let mut g = guest();
    let dgram = libc::SOCK_DGRAM as u64;
    let rx = g.call(libc::SYS_socket, &[libc::AF_INET6 as u64, dgram, 0]).unwrap();
    let tx = g.call(libc::SYS_socket, &[libc::AF_INET6 as u64, dgram, 0]).unwrap();
    let addr = g.put(0x100, &loopback6(4242));
    assert_eq!(g.call(libc::SYS_bind, &[rx, addr, 28]), Ok(0));
    let payload = g.put(0x200, b"hello");
    let (ctl_out, ctl_in, hdr_out, hdr_in, data_in) = (0x300, 0x400, 0x500, 0x600, 0x700);
    let send = |g: &mut Guest, control: &[u8]| {
        let c = g.put(ctl_out, control);
        let m =
            g.msghdr(hdr_out, Some(addr), (payload, 5), (if control.is_empty() { 0 } else { c }, control.len() as u64));
        g.call(libc::SYS_sendmsg, &[tx, m, 0])
    };
    // Returns (control bytes, msg_flags).
    let recv = |g: &mut Guest, room: u64| {
        let m = g.msghdr(hdr_in, None, (g.buf + data_in, 64), (g.buf + ctl_in, room));
        assert_eq!(g.call(libc::SYS_recvmsg, &[rx, m, 0]), Ok(5));
        assert_eq!(g.get(data_in, 5), b"hello");
        let used = g.get_i64(hdr_in + 40) as u64;
        let flags = i32::from_le_bytes(g.get(hdr_in + 48, 4).try_into().unwrap());
        (g.get(ctl_in, used), flags)
    };
    let (v6, hl, tc) = (libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT, libc::IPV6_TCLASS);
    // Nothing asked for: no control data.
    assert_eq!(send(&mut g, &[]), Ok(5));
    assert_eq!(recv(&mut g, 256), (vec![], 0));
    g.set_int(rx, v6, libc::IPV6_RECVHOPLIMIT, 1);
    assert_eq!(send(&mut g, &[]), Ok(5));
    assert_eq!(recv(&mut g, 256), (cmsg(v6, hl, &64i32.to_le_bytes()), 0), "the default hop limit");
    g.set_int(rx, v6, libc::IPV6_RECVTCLASS, 1);
    g.set_int(tx, v6, libc::IPV6_UNICAST_HOPS, 9);
    let per_packet = [cmsg(v6, tc, &0x20i32.to_le_bytes()), cmsg(v6, hl, &2i32.to_le_bytes())].concat();
    assert_eq!(send(&mut g, &per_packet), Ok(5));
    let both = [cmsg(v6, hl, &2i32.to_le_bytes()), cmsg(v6, tc, &0x20i32.to_le_bytes())].concat();
    assert_eq!(recv(&mut g, 256), (both.clone(), 0));
    // The socket's own hop limit, and truncation as Linux's put_cmsg: the
    // second message cut to what is left, then nothing without room for a header.
    assert_eq!(send(&mut g, &[]), Ok(5));
    let (c, f) = recv(&mut g, 24 + 18);
    assert_eq!(f, libc::MSG_CTRUNC);
    assert_eq!(&c[..20], &cmsg(v6, hl, &9i32.to_le_bytes())[..20]);
    assert_eq!(c.len(), 24 + 18);
    assert_eq!(u64::from_le_bytes(c[24..32].try_into().unwrap()), 18, "a truncated cmsg_len");
    assert_eq!(send(&mut g, &[]), Ok(5));
    let (c, f) = recv(&mut g, 20);
    assert_eq!((c.len(), f), (20, libc::MSG_CTRUNC));
    assert_eq!(send(&mut g, &[]), Ok(5));
    assert_eq!(recv(&mut g, 0), (vec![], libc::MSG_CTRUNC));
    // Bad per-packet values are EINVAL, as Linux: out of range, not an int.
    assert_eq!(send(&mut g, &cmsg(v6, hl, &256i32.to_le_bytes())), Err(Errno::EINVAL));
    assert_eq!(send(&mut g, &cmsg(v6, tc, &[0, 0, 0, 0, 0])), Err(Errno::EINVAL));
}

/// struct sockaddr_in for 127.0.0.1:port.
fn loopback4(port: u16) -> Vec<u8> {
    let mut b = vec![0u8; 16];
    b[..2].copy_from_slice(&(libc::AF_INET as u16).to_le_bytes());
    b[2..4].copy_from_slice(&port.to_be_bytes());
    b[4..8].copy_from_slice(&[127, 0, 0, 1]);
    b
}

#[test]
fn a_non_blocking_connect_inside_the_sandbox_reports_einprogress_then_zero_then_eisconn() {
    let mut g = guest();
    let stream = libc::SOCK_STREAM as u64;
    let srv = g.call(libc::SYS_socket, &[libc::AF_INET as u64, stream, 0]).unwrap();
    let addr = g.put(0x100, &loopback4(8080));
    assert_eq!(g.call(libc::SYS_bind, &[srv, addr, 16]), Ok(0));
    assert_eq!(g.call(libc::SYS_listen, &[srv, 8]), Ok(0));
    let nb = (libc::SOCK_STREAM | libc::SOCK_NONBLOCK) as u64;
    let cli = g.call(libc::SYS_socket, &[libc::AF_INET as u64, nb, 0]).unwrap();
    assert_eq!(g.call(libc::SYS_connect, &[cli, addr, 16]), Err(Errno::EINPROGRESS));
    assert_eq!(g.call(libc::SYS_connect, &[cli, addr, 16]), Ok(0));
    assert_eq!(g.call(libc::SYS_connect, &[cli, addr, 16]), Err(Errno::EISCONN));
    assert!(g.call(libc::SYS_accept, &[srv, 0, 0]).is_ok());
    // A blocking connect completes in the call.
    let blocking = g.call(libc::SYS_socket, &[libc::AF_INET as u64, stream, 0]).unwrap();
    assert_eq!(g.call(libc::SYS_connect, &[blocking, addr, 16]), Ok(0));
    assert_eq!(g.call(libc::SYS_connect, &[blocking, addr, 16]), Err(Errno::EISCONN));
}

impl Guest {
    /// (mode, uid, gid) of a path, by stat.
    fn owner_of(&mut self, p: &str) -> (u32, u32, u32) {
        let path = self.path(0x8000, p);
        let st = self.buf + 0x1000;
        self.call(libc::SYS_stat, &[path, st]).unwrap();
        let w = |o: u64| u32::from_le_bytes(self.get(0x1000 + o, 4).try_into().unwrap());
        (w(24), w(28), w(32))
    }

    fn chown(&mut self, p: &str, uid: i64, gid: i64) -> Result<u64, Errno> {
        let path = self.path(0x8000, p);
        self.call(libc::SYS_chown, &[path, uid as u64, gid as u64])
    }
}

#[test]
fn chown_records_owners_with_linux_permission_rules() {
    let mut g = guest();
    let fd = g.open("/tmp/f", libc::O_CREAT | libc::O_RDWR);
    let ids = |g: &mut Guest, p: &str| {
        let (_, u, gr) = g.owner_of(p);
        (u, gr)
    };
    assert_eq!(ids(&mut g, "/tmp/f"), (0, 0));
    // Root: any ids (large ones as they are), -1 keeps one.
    assert_eq!(g.chown("/tmp/f", 1 << 31, 1 << 31), Ok(0));
    assert_eq!(ids(&mut g, "/tmp/f"), (1 << 31, 1 << 31));
    assert_eq!(g.chown("/tmp/f", -1, 7), Ok(0));
    assert_eq!(ids(&mut g, "/tmp/f"), (1 << 31, 7));
    assert_eq!(g.call(libc::SYS_fchown, &[fd as u64, 1000, 1000]), Ok(0));
    assert_eq!(ids(&mut g, "/tmp/f"), (1000, 1000));
    // statx reports them too.
    let (empty, out) = (g.path(0x8100, ""), g.buf + 0x2000);
    let flags = libc::AT_EMPTY_PATH as u64;
    assert_eq!(g.call(libc::SYS_statx, &[fd as u64, empty, flags, 0x7ff, out]), Ok(0));
    assert_eq!(g.get(0x2000 + 20, 8), [1000u32.to_le_bytes(), 1000u32.to_le_bytes()].concat());
    // chown drops set-user-ID (and set-group-ID with group execute) of a file.
    let path = g.path(0x8000, "/tmp/f");
    assert_eq!(g.call(libc::SYS_chmod, &[path, 0o6775]), Ok(0));
    assert_eq!(g.chown("/tmp/f", -1, -1), Ok(0));
    assert_eq!(g.owner_of("/tmp/f").0 & 0o7777, 0o775);
    // Not root (user 1000 in groups 1000 and 27): the user only to its own,
    // the group of its own file only to one of its groups.
    g.proc.creds.set_groups(vec![27]).unwrap();
    g.proc.creds.uid.set_res(1000, 1000, 1000, true).unwrap();
    g.proc.creds.gid.set_res(1000, 1000, 1000, true).unwrap();
    assert_eq!(g.chown("/tmp/f", 0, -1), Err(Errno::EPERM));
    assert_eq!(g.chown("/tmp/f", 1000, 27), Ok(0));
    assert_eq!(g.chown("/tmp/f", -1, 5), Err(Errno::EPERM));
    assert_eq!(g.chown("/etc/hostname", -1, 27), Err(Errno::EPERM), "not its file");
    assert_eq!(ids(&mut g, "/tmp/f"), (1000, 27));
    // Owners survive a save and restore of the process; a removed file's owner goes with it.
    g.proc.creds = Default::default();
    assert_eq!(g.chown("/tmp", 5, 5), Ok(0));
    let state = g.proc.save_state();
    assert_eq!(state.owners.len(), 2);
    let image = g.proc.vfs.image().clone();
    let mut back = Process::restore_state(image, state).unwrap();
    let tmp = back.vfs.resolve(crate::vfs::ROOT_INO, b"/tmp", true).unwrap();
    let f = back.vfs.resolve(crate::vfs::ROOT_INO, b"/tmp/f", true).unwrap();
    assert_eq!((back.vfs.owner(tmp), back.vfs.owner(f)), ((5, 5), (1000, 27)));
    back.vfs.unlink(crate::vfs::ROOT_INO, b"/tmp/f").unwrap();
    back.vfs.release(f);
    assert_eq!(back.vfs.owners_state(), vec![(tmp, 5, 5)]);
}

/// (atime, mtime) of `p` in nanoseconds, from stat(2)'s `st_atim` / `st_mtim`.
fn times_of(g: &mut Guest, p: &str) -> (i128, i128) {
    let path = g.path(0x8000, p);
    let st = g.buf + 0x1000;
    g.call(libc::SYS_stat, &[path, st]).unwrap();
    let t = |g: &Guest, off: u64| {
        i128::from(g.get_i64(0x1000 + off)) * 1_000_000_000 + i128::from(g.get_i64(0x1000 + off + 8))
    };
    (t(g, 72), t(g, 88))
}

#[test]
fn utime_utimes_and_futimesat_set_file_times_like_utimensat() {
    let mut g = guest();
    let fd = g.open("/tmp/t", libc::O_CREAT | libc::O_WRONLY);
    assert!(fd >= 0);
    // utime: whole seconds.
    let buf = g.put(0, &[1_000i64.to_le_bytes(), 2_000i64.to_le_bytes()].concat());
    let path = g.path(0x8000, "/tmp/t");
    assert_eq!(g.call(libc::SYS_utime, &[path, buf]), Ok(0));
    assert_eq!(times_of(&mut g, "/tmp/t"), (1_000_000_000_000, 2_000_000_000_000));
    // utimes: timevals (microseconds).
    let tv = g.put(0, &[timespec(3, 5), timespec(4, 999_999)].concat());
    let path = g.path(0x8000, "/tmp/t");
    assert_eq!(g.call(libc::SYS_utimes, &[path, tv]), Ok(0));
    assert_eq!(times_of(&mut g, "/tmp/t"), (3_000_005_000, 4_999_999_000));
    let bad = g.put(0, &[timespec(3, 0), timespec(4, 1_000_000)].concat());
    assert_eq!(g.call(libc::SYS_utimes, &[path, bad]), Err(Errno::EINVAL));
    // futimesat from a directory fd, and NULL times: now.
    let dir = g.open("/tmp", libc::O_RDONLY | libc::O_DIRECTORY);
    let rel = g.path(0x8000, "t");
    assert_eq!(g.call(libc::SYS_futimesat, &[dir as u64, rel, 0]), Ok(0));
    let (a, m) = times_of(&mut g, "/tmp/t");
    assert!(a > 1_600_000_000 * 1_000_000_000 && a == m, "{a} {m}");
    let missing = g.path(0x8000, "/tmp/nope");
    assert_eq!(g.call(libc::SYS_utime, &[missing, 0]), Err(Errno::ENOENT));
    assert_eq!(g.call(libc::SYS_utimes, &[missing, 0]), Err(Errno::ENOENT));
}

#[test]
fn sync_calls_have_nothing_to_flush_but_check_their_arguments() {
    let mut g = guest();
    assert_eq!(g.call(libc::SYS_sync, &[]), Ok(0));
    let fd = g.open("/tmp/s", libc::O_CREAT | libc::O_RDWR) as u64;
    assert_eq!(g.call(libc::SYS_syncfs, &[fd]), Ok(0));
    assert_eq!(g.call(libc::SYS_syncfs, &[999]), Err(Errno::EBADF));
    assert_eq!(g.call(libc::SYS_sync_file_range, &[fd, 0, 10, libc::SYNC_FILE_RANGE_WRITE as u64]), Ok(0));
    assert_eq!(g.call(libc::SYS_sync_file_range, &[fd, 0, 10, 0x80]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sync_file_range, &[fd, u64::MAX, 10, 0]), Err(Errno::EINVAL));
    let fds = g.buf + 0x2000;
    g.call(libc::SYS_pipe2, &[fds, 0]).unwrap();
    let rd = u64::from(u32::from_le_bytes(g.get(0x2000, 4).try_into().unwrap()));
    assert_eq!(g.call(libc::SYS_sync_file_range, &[rd, 0, 10, 0]), Err(Errno::ESPIPE));
}

#[test]
fn preadv2_and_pwritev2_take_offset_minus_one_as_the_file_position() {
    let mut g = guest();
    let fd = g.open("/tmp/v", libc::O_CREAT | libc::O_RDWR) as u64;
    let data = g.put(0x100, b"hello world");
    let iov = g.put(0, &[data.to_le_bytes(), 5u64.to_le_bytes()].concat());
    // At the position (-1), twice: the position moves.
    assert_eq!(g.call(libc::SYS_pwritev2, &[fd, iov, 1, u64::MAX, 0, 0]), Ok(5));
    assert_eq!(g.call(libc::SYS_pwritev2, &[fd, iov, 1, u64::MAX, 0, 0]), Ok(5));
    assert_eq!(g.size(fd as i32), 10);
    // At an offset, with flags that have nothing to do: the position stays.
    assert_eq!(g.call(libc::SYS_pwritev2, &[fd, iov, 1, 20, 0, 0x2 | 0x4]), Ok(5));
    assert_eq!(g.size(fd as i32), 25);
    let out = g.buf + 0x400;
    let riov = g.put(0x10, &[out.to_le_bytes(), 5u64.to_le_bytes()].concat());
    assert_eq!(g.call(libc::SYS_preadv2, &[fd, riov, 1, 20, 0, 0x1]), Ok(5));
    assert_eq!(g.get(0x400, 5), b"hello");
    assert_eq!(g.call(libc::SYS_preadv2, &[fd, riov, 1, u64::MAX, 0, 0]), Ok(5), "read at the position (10)");
    assert_eq!(g.get(0x400, 5), &[0u8; 5], "the gap between 10 and 20 reads as zeros");
    // RWF_NOWAIT, RWF_APPEND, unknown flags; a negative offset other than -1.
    for flags in [0x8, 0x10, 0x100] {
        assert_eq!(g.call(libc::SYS_preadv2, &[fd, riov, 1, 0, 0, flags]), Err(Errno::EOPNOTSUPP), "{flags:#x}");
    }
    assert_eq!(g.call(libc::SYS_preadv2, &[fd, riov, 1, (-2i64) as u64, 0, 0]), Err(Errno::EINVAL));
}

#[test]
fn scheduler_policy_and_parameters_are_sched_other_priority_zero() {
    let mut g = guest();
    let param = g.put(0, &0i32.to_le_bytes());
    assert_eq!(g.call(libc::SYS_sched_getscheduler, &[0]), Ok(libc::SCHED_OTHER as u64));
    assert_eq!(g.call(libc::SYS_sched_getscheduler, &[99_999]), Err(Errno::ESRCH));
    assert_eq!(g.call(libc::SYS_sched_getscheduler, &[1]), Ok(libc::SCHED_OTHER as u64), "the first process's parent");
    assert_eq!(g.call(libc::SYS_sched_getscheduler, &[u64::MAX]), Err(Errno::EINVAL));
    g.put(0, &7i32.to_le_bytes());
    assert_eq!(g.call(libc::SYS_sched_getparam, &[0, param]), Ok(0));
    assert_eq!(g.get(0, 4), 0i32.to_le_bytes());
    for policy in [libc::SCHED_OTHER, libc::SCHED_BATCH, libc::SCHED_IDLE] {
        assert_eq!(g.call(libc::SYS_sched_setscheduler, &[0, policy as u64, param]), Ok(0));
    }
    g.put(0, &10i32.to_le_bytes());
    assert_eq!(g.call(libc::SYS_sched_setscheduler, &[0, libc::SCHED_FIFO as u64, param]), Err(Errno::EPERM));
    assert_eq!(g.call(libc::SYS_sched_setscheduler, &[0, libc::SCHED_OTHER as u64, param]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sched_setparam, &[0, param]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sched_setscheduler, &[0, 42, param]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_sched_setparam, &[0, 0]), Err(Errno::EINVAL));
}

#[test]
fn getcpu_personality_and_memory_locks() {
    let mut g = guest();
    let (cpu, node) = (g.put(0, &[0xff; 4]), g.put(8, &[0xff; 4]));
    assert_eq!(g.call(libc::SYS_getcpu, &[cpu, node, 0]), Ok(0));
    assert_eq!((g.get(0, 4), g.get(8, 4)), (vec![0; 4], vec![0; 4]));
    assert_eq!(g.call(libc::SYS_getcpu, &[0, 0, 0]), Ok(0));
    assert_eq!(g.call(libc::SYS_getcpu, &[8, 0, 0]), Err(Errno::EFAULT));
    assert_eq!(g.call(libc::SYS_personality, &[0xffff_ffff]), Ok(0));
    assert_eq!(g.call(libc::SYS_personality, &[0]), Ok(0));
    assert_eq!(g.call(libc::SYS_personality, &[0x0040000]), Err(Errno::EINVAL));
    // Locks: a mapped range (unaligned start rounds down), an unmapped one.
    assert_eq!(g.call(libc::SYS_mlock, &[g.buf + 10, 4096]), Ok(0));
    assert_eq!(g.call(libc::SYS_munlock, &[g.buf, BUF_LEN]), Ok(0));
    assert_eq!(g.call(libc::SYS_mlock, &[g.buf + BUF_LEN, 4096]), Err(Errno::ENOMEM));
    assert_eq!(g.call(libc::SYS_mlock2, &[g.buf, 4096, libc::MLOCK_ONFAULT as u64]), Ok(0));
    assert_eq!(g.call(libc::SYS_mlock2, &[g.buf, 4096, 2]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_mlockall, &[libc::MCL_CURRENT as u64]), Ok(0));
    assert_eq!(g.call(libc::SYS_mlockall, &[libc::MCL_ONFAULT as u64]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_mlockall, &[0]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_munlockall, &[]), Ok(0));
}

#[test]
fn refused_calls_fail_with_the_errno_of_their_table_entry() {
    let mut g = guest();
    assert_eq!(g.call(libc::SYS_mount, &[0, 0, 0, 0, 0]), Err(Errno::EPERM));
    assert_eq!(g.call(libc::SYS_ptrace, &[0, 0, 0, 0]), Err(Errno::EPERM));
    assert_eq!(g.call(libc::SYS_shmget, &[0, 4096, 0]), Err(Errno::ENOSYS));
    assert_eq!(g.call(libc::SYS_io_uring_setup, &[8, 0]), Err(Errno::ENOSYS));
    assert_eq!(g.call(libc::SYS_name_to_handle_at, &[0, 0, 0, 0, 0]), Err(Errno::EOPNOTSUPP));
    assert_eq!(g.call(libc::SYS_setxattr, &[0, 0, 0, 0, 0]), Err(Errno::EOPNOTSUPP));
    // Past the table: ENOSYS, counted as unknown.
    assert_eq!(g.call(999, &[]), Err(Errno::ENOSYS));
    assert_eq!(g.kernel.stats.unimplemented.get(&999), Some(&1));
    assert!(!g.kernel.stats.unimplemented.contains_key(&(libc::SYS_mount as u64)), "mount is in the table");
}

#[test]
fn flock_excludes_between_open_descriptions_and_goes_with_the_last_close() {
    let mut g = guest();
    let (sh, ex, un, nb) = (libc::LOCK_SH as u64, libc::LOCK_EX as u64, libc::LOCK_UN as u64, libc::LOCK_NB as u64);
    let a = g.open("/tmp/lock", libc::O_CREAT | libc::O_RDWR) as u64;
    let b = g.open("/tmp/lock", libc::O_RDONLY) as u64;
    assert_eq!(g.call(libc::SYS_flock, &[a, ex]), Ok(0));
    assert_eq!(g.call(libc::SYS_flock, &[a, ex | nb]), Ok(0), "taken again by its holder");
    assert_eq!(g.call(libc::SYS_flock, &[b, sh | nb]), Err(Errno::EAGAIN), "another description");
    // A dup shares the description, and so the lock: closing it keeps the lock.
    let d = g.call(libc::SYS_dup, &[a]).unwrap();
    assert_eq!(g.call(libc::SYS_close, &[d]), Ok(0));
    assert_eq!(g.call(libc::SYS_flock, &[b, ex | nb]), Err(Errno::EAGAIN));
    // Converted to shared: other shared locks join it; closing the last fd drops it.
    assert_eq!(g.call(libc::SYS_flock, &[a, sh]), Ok(0));
    assert_eq!(g.call(libc::SYS_flock, &[b, sh | nb]), Ok(0));
    assert_eq!(g.call(libc::SYS_flock, &[b, un]), Ok(0));
    assert_eq!(g.call(libc::SYS_close, &[a]), Ok(0));
    assert_eq!(g.call(libc::SYS_flock, &[b, ex | nb]), Ok(0), "the closed description's lock is gone");
    // Bad operations and descriptors.
    assert_eq!(g.call(libc::SYS_flock, &[b, 0]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_flock, &[b, sh | ex]), Err(Errno::EINVAL));
    assert_eq!(g.call(libc::SYS_flock, &[999, sh]), Err(Errno::EBADF));
}

impl Guest {
    /// Run `f` with a syscall context over this guest, as a handler would.
    fn with_ctx<R>(&mut self, f: impl FnOnce(&mut Ctx) -> R) -> R {
        let mut ctx =
            Ctx { mem: &mut self.mem, proc: &mut self.proc, kernel: &mut self.kernel, effect: None, timed_out: false };
        f(&mut ctx)
    }

    /// Two fds written by pipe2/socketpair at the buffer's offset `off`.
    fn fd_pair(&self, off: u64) -> (i32, i32) {
        let b = self.get(off, 8);
        (i32::from_le_bytes(b[..4].try_into().unwrap()), i32::from_le_bytes(b[4..].try_into().unwrap()))
    }
}

#[test]
fn a_pipe_reads_and_writes_through_its_file_ops() {
    use crate::kernel::block::{WaitOn, READABLE};
    use crate::kernel::Effect;
    let mut g = guest();
    g.call(libc::SYS_pipe2, &[g.buf, 0]).unwrap();
    let (r, w) = g.fd_pair(0);
    let data = g.put(0x100, b"hello");
    let out = g.buf + 0x200;
    g.with_ctx(|ctx| {
        let (wf, ops) = crate::file::open(ctx, w).unwrap();
        assert_eq!(ops.write(ctx, &wf, data, 5, None), Ok(5));
        assert_eq!(ops.write(ctx, &wf, data, 5, Some(0)), Err(Errno::ESPIPE), "a pipe has no offset");
        let (rf, ops) = crate::file::open(ctx, r).unwrap();
        assert_eq!(ops.pending(ctx, &rf), Ok(5));
        assert_ne!(crate::wait::ready(ctx.proc, ctx.kernel, rf.ofd) & READABLE, 0);
        assert_eq!(ops.stat(ctx, &rf).unwrap().kind, crate::vfs::FileType::Fifo);
        assert_eq!(ops.read(ctx, &rf, out, 64, None), Ok(5));
        // Empty and blocking: the call blocks on the read end instead of returning.
        assert_eq!(ctx.effect, None);
        assert_eq!(ops.read(ctx, &rf, out, 64, None), Ok(0));
        match &ctx.effect {
            Some(Effect::Block(b)) => assert_eq!(b.on, WaitOn::Fd { ofd: rf.ofd, events: READABLE }),
            e => panic!("expected a block, got {e:?}"),
        }
        assert_eq!(crate::wait::ready(ctx.proc, ctx.kernel, rf.ofd) & READABLE, 0);
    });
    assert_eq!(g.get(0x200, 5), b"hello");
}

#[test]
fn an_eventfd_counts_through_its_file_ops() {
    let mut g = guest();
    let fd = g.call(libc::SYS_eventfd2, &[3, libc::EFD_NONBLOCK as u64]).unwrap() as i32;
    let add = g.put(0x100, &4u64.to_le_bytes());
    let out = g.buf + 0x200;
    g.with_ctx(|ctx| {
        let (f, ops) = crate::file::open(ctx, fd).unwrap();
        assert_eq!(ops.read(ctx, &f, out, 4, None), Err(Errno::EINVAL), "shorter than the counter");
        assert_eq!(ops.write(ctx, &f, add, 8, None), Ok(8));
        assert_eq!(ops.read(ctx, &f, out, 8, None), Ok(8));
        assert_eq!(ctx.read_u64(out), Ok(7));
        assert_eq!(ops.read(ctx, &f, out, 8, None), Err(Errno::EAGAIN), "empty and non-blocking");
        assert_eq!(ops.stat(ctx, &f).unwrap().kind, crate::vfs::FileType::File);
    });
}

#[test]
fn a_unix_socket_and_a_file_answer_their_own_file_ops() {
    let mut g = guest();
    g.call(libc::SYS_socketpair, &[libc::AF_UNIX as u64, libc::SOCK_STREAM as u64, 0, g.buf]).unwrap();
    let (a, b) = g.fd_pair(0);
    let file = g.open("/tmp/f", libc::O_CREAT | libc::O_RDWR);
    let data = g.put(0x100, b"abc");
    let out = g.buf + 0x200;
    g.with_ctx(|ctx| {
        let (fa, ops) = crate::file::open(ctx, a).unwrap();
        assert_eq!(ops.stat(ctx, &fa).unwrap().kind, crate::vfs::FileType::Socket);
        assert_eq!(ops.write(ctx, &fa, data, 3, None), Ok(3));
        let (fb, ops) = crate::file::open(ctx, b).unwrap();
        assert_eq!(ops.read(ctx, &fb, out, 2, None), Ok(2));
        assert_eq!(ops.pending(ctx, &fb), Ok(1));
        // A regular file: positional writes, and the offset moves only for plain ones.
        let (ff, ops) = crate::file::open(ctx, file).unwrap();
        assert_eq!(ops.write(ctx, &ff, data, 3, Some(10)), Ok(3));
        assert_eq!(ctx.proc.fds.get(file).unwrap().offset, 0);
        assert_eq!(ops.stat(ctx, &ff).unwrap().size, 13);
        assert_eq!(ops.pending(ctx, &ff), Ok(13));
        assert_eq!(ops.read(ctx, &ff, out, 64, Some(10)), Ok(3));
    });
    assert_eq!(g.get(0x200, 3), b"abc");
}

/// A receive that drops descriptors passed with the data closes them for
/// good after the call: a flock held through such a description goes with it.
#[test]
fn descriptors_dropped_by_a_plain_read_are_released_after_the_call() {
    let mut g = guest();
    g.call(libc::SYS_socketpair, &[libc::AF_UNIX as u64, libc::SOCK_STREAM as u64, 0, g.buf]).unwrap();
    let (a, b) = g.fd_pair(0);
    let locked = g.open("/tmp/lock", libc::O_CREAT | libc::O_RDWR);
    g.call(libc::SYS_flock, &[locked as u64, libc::LOCK_EX as u64]).unwrap();
    // sendmsg(a, {iov: "x", SCM_RIGHTS: [locked]}).
    let byte = g.put(0x100, b"x");
    let iov = g.put(0x110, &[byte.to_le_bytes(), 1u64.to_le_bytes()].concat());
    let mut cmsg = 20u64.to_le_bytes().to_vec();
    cmsg.extend_from_slice(&libc::SOL_SOCKET.to_le_bytes());
    cmsg.extend_from_slice(&libc::SCM_RIGHTS.to_le_bytes());
    cmsg.extend_from_slice(&locked.to_le_bytes());
    cmsg.extend_from_slice(&[0; 4]);
    let control = g.put(0x140, &cmsg);
    let mut msg = vec![0u8; 56];
    msg[16..24].copy_from_slice(&iov.to_le_bytes());
    msg[24..32].copy_from_slice(&1u64.to_le_bytes());
    msg[32..40].copy_from_slice(&control.to_le_bytes());
    msg[40..48].copy_from_slice(&24u64.to_le_bytes());
    let msg = g.put(0x180, &msg);
    assert_eq!(g.call(libc::SYS_sendmsg, &[a as u64, msg, 0]), Ok(1));
    g.call(libc::SYS_close, &[locked as u64]).unwrap();
    // Still in flight: the lock is held.
    let other = g.open("/tmp/lock", libc::O_RDWR);
    let try_lock = (libc::LOCK_EX | libc::LOCK_NB) as u64;
    assert_eq!(g.call(libc::SYS_flock, &[other as u64, try_lock]), Err(Errno::EAGAIN));
    // read(2) has no control buffer: the passed description is dropped, and its lock with it.
    assert_eq!(g.call(libc::SYS_read, &[b as u64, g.buf + 0x300, 8]), Ok(1));
    assert_eq!(g.call(libc::SYS_flock, &[other as u64, try_lock]), Ok(0));
}

#[test]
fn a_futex_wait_already_past_its_deadline_times_out_and_lets_other_threads_run() {
    use crate::kernel::Effect;
    let mut g = guest();
    let word = g.put(0x100, &0u32.to_le_bytes());
    // An absolute CLOCK_MONOTONIC deadline of 0: passed before the call.
    let past = g.put(0x200, &timespec(0, 0));
    let op = (libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG) as u64;
    let wait = |g: &mut Guest| g.call_effect(libc::SYS_futex, &[word, op, 0, past, 0, u32::MAX as u64]);
    // Alone in its process: nothing else could run.
    let (r, effect) = wait(&mut g);
    assert_eq!(r, Err(Errno::ETIMEDOUT));
    assert!(effect.is_none());
    // With another thread, it polls for what that thread must do: the other runs first.
    g.proc.threads.spawn(0, 0, 0).unwrap();
    let (r, effect) = wait(&mut g);
    assert_eq!(r, Err(Errno::ETIMEDOUT));
    assert!(matches!(effect, Some(Effect::Yield)));
    // A deadline in the future blocks as before.
    let later = g.put(0x300, &timespec(i64::MAX / 4, 0));
    let (r, effect) = g.call_effect(libc::SYS_futex, &[word, op, 0, later, 0, u32::MAX as u64]);
    assert!(r.is_ok() && matches!(effect, Some(Effect::Block(_))), "{r:?}");
}

/// glibc's if_nameindex: an AF_NETLINK socket, bound to port 0, asks for a
/// link dump and reads it with recvmsg (peeking at the size first); the
/// answers name the kernel as their source, carry the socket's port id and the
/// request's sequence number, and list `lo` (index 1) only. Other requests fail at send.
#[test]
fn netlink_route_lists_lo_only() {
    let mut g = guest();
    let raw = (libc::SOCK_RAW | libc::SOCK_CLOEXEC) as u64;
    let nl = libc::AF_NETLINK as u64;
    assert_eq!(g.call(libc::SYS_socket, &[nl, raw, 4]), Err(Errno::EPROTONOSUPPORT), "NETLINK_USERSOCK");
    let fd = g.call(libc::SYS_socket, &[nl, raw, libc::NETLINK_ROUTE as u64]).unwrap();
    let mut sa = vec![0u8; 12];
    sa[..2].copy_from_slice(&(libc::AF_NETLINK as u16).to_le_bytes());
    let addr = g.put(0x100, &sa);
    assert_eq!(g.call(libc::SYS_bind, &[fd, addr, 12]), Ok(0));
    let len_at = g.put(0x200, &12u32.to_le_bytes());
    let name_at = g.put(0x300, &[0xFFu8; 12]);
    assert_eq!(g.call(libc::SYS_getsockname, &[fd, name_at, len_at]), Ok(0));
    let got = g.get(0x300, 12);
    assert_eq!(u16::from_le_bytes([got[0], got[1]]) as i32, libc::AF_NETLINK);
    let pid = u32::from_le_bytes(got[4..8].try_into().unwrap());
    assert_eq!(pid, g.proc.pid);
    // nlmsghdr (RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq 1234) + rtgenmsg.
    let mut req = 20u32.to_le_bytes().to_vec();
    req.extend_from_slice(&18u16.to_le_bytes());
    req.extend_from_slice(&0x301u16.to_le_bytes());
    req.extend_from_slice(&1234u32.to_le_bytes());
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(&[libc::AF_PACKET as u8, 0, 0, 0]);
    let req_at = g.put(0x400, &req);
    assert_eq!(g.call(libc::SYS_sendto, &[fd, req_at, 20, 0, addr, 12]), Ok(20));
    let data = g.buf + 0x1000;
    let src = g.buf + 0x600;
    let h = g.msghdr(0x800, Some(src), (data, 4096), (0, 0));
    let peeked = g.call(libc::SYS_recvmsg, &[fd, h, (libc::MSG_PEEK | libc::MSG_TRUNC) as u64]).unwrap();
    let n = g.call(libc::SYS_recvmsg, &[fd, h, 0]).unwrap();
    assert_eq!(peeked, n);
    let msg = g.get(0x1000, n);
    let src_addr = g.get(0x600, 12);
    assert_eq!(u16::from_le_bytes([src_addr[0], src_addr[1]]) as i32, libc::AF_NETLINK);
    assert_eq!(&src_addr[4..8], &[0, 0, 0, 0], "from the kernel");
    assert_eq!(u16::from_le_bytes([msg[4], msg[5]]), 16, "RTM_NEWLINK");
    assert_eq!(u32::from_le_bytes(msg[8..12].try_into().unwrap()), 1234);
    assert_eq!(u32::from_le_bytes(msg[12..16].try_into().unwrap()), pid);
    assert_eq!(i32::from_le_bytes(msg[20..24].try_into().unwrap()), 1, "ifi_index");
    assert!(msg.windows(3).any(|w| w == b"lo\0"));
    let n = g.call(libc::SYS_recvmsg, &[fd, h, 0]).unwrap();
    assert_eq!(u16::from_le_bytes([g.get(0x1000, n)[4], g.get(0x1000, n)[5]]), 3, "NLMSG_DONE");
    assert_eq!(g.call(libc::SYS_recvmsg, &[fd, h, libc::MSG_DONTWAIT as u64]), Err(Errno::EAGAIN));
    // RTM_GETADDR: refused at send (glibc's AI_ADDRCONFIG probe stays pessimistic).
    req[4..6].copy_from_slice(&22u16.to_le_bytes());
    let req_at = g.put(0x400, &req);
    assert_eq!(g.call(libc::SYS_sendto, &[fd, req_at, 20, 0, 0, 0]), Err(Errno::EOPNOTSUPP));
    let opt = g.put(0x700, &[0u8; 4]);
    let optlen = g.put(0x710, &4u32.to_le_bytes());
    assert_eq!(
        g.call(libc::SYS_getsockopt, &[fd, libc::SOL_SOCKET as u64, libc::SO_DOMAIN as u64, opt, optlen]),
        Ok(0)
    );
    assert_eq!(g.get(0x700, 4), libc::AF_NETLINK.to_le_bytes());
}

/// glibc's if_nametoindex / if_indextoname: SIOCGIFINDEX / SIOCGIFNAME on a socket.
#[test]
fn interface_ioctls_know_lo_only() {
    let mut g = guest();
    let unix = g.call(libc::SYS_socket, &[libc::AF_UNIX as u64, libc::SOCK_DGRAM as u64, 0]).unwrap();
    let inet = g.call(libc::SYS_socket, &[libc::AF_INET as u64, libc::SOCK_DGRAM as u64, 0]).unwrap();
    for fd in [unix, inet] {
        let mut ifr = vec![0u8; 40];
        ifr[..2].copy_from_slice(b"lo");
        let at = g.put(0x100, &ifr);
        assert_eq!(g.call(libc::SYS_ioctl, &[fd, 0x8933, at]), Ok(0));
        assert_eq!(g.get(0x110, 4), 1i32.to_le_bytes());
        let mut ifr = vec![0u8; 40];
        ifr[16..20].copy_from_slice(&1i32.to_le_bytes());
        let at = g.put(0x100, &ifr);
        assert_eq!(g.call(libc::SYS_ioctl, &[fd, 0x8910, at]), Ok(0));
        assert_eq!(&g.get(0x100, 3), b"lo\0");
        let mut ifr = vec![0u8; 40];
        ifr[..4].copy_from_slice(b"eth0");
        let at = g.put(0x100, &ifr);
        assert_eq!(g.call(libc::SYS_ioctl, &[fd, 0x8933, at]), Err(Errno::ENODEV));
        ifr[16..20].copy_from_slice(&2i32.to_le_bytes());
        let at = g.put(0x100, &ifr);
        assert_eq!(g.call(libc::SYS_ioctl, &[fd, 0x8910, at]), Err(Errno::ENODEV));
    }
    let file = g.open("/tmp/f", libc::O_CREAT | libc::O_RDWR) as u64;
    let at = g.put(0x100, &[0u8; 40]);
    assert_eq!(g.call(libc::SYS_ioctl, &[file, 0x8933, at]), Err(Errno::ENOTTY));
}

impl Guest {
    /// epoll_wait with a zero timeout: the (events, data) reported.
    fn epoll_events(&mut self, ep: u64) -> Vec<(u32, u64)> {
        let at = self.buf + 0x3000;
        let n = self.call(libc::SYS_epoll_wait, &[ep, at, 8, 0]).unwrap();
        (0..n)
            .map(|i| {
                let b = self.get(0x3000 + i * 12, 12);
                (u32::from_le_bytes(b[..4].try_into().unwrap()), u64::from_le_bytes(b[4..].try_into().unwrap()))
            })
            .collect()
    }

    fn epoll_add(&mut self, ep: u64, op: i32, fd: u64, events: u32) {
        let mut ev = events.to_le_bytes().to_vec();
        ev.extend_from_slice(&fd.to_le_bytes());
        let at = self.put(0x3800, &ev);
        assert_eq!(self.call(libc::SYS_epoll_ctl, &[ep, op as u64, fd, at]), Ok(0));
    }
}

/// EPOLLET reports a readiness once: again only when it changes (new data
/// on a drained socket, the socket re-armed by EPOLL_CTL_MOD), never while
/// it stays as reported. Level-triggered watches keep reporting.
#[test]
fn edge_triggered_epoll_reports_each_edge_once() {
    let mut g = guest();
    let (inn, out, et) = (libc::EPOLLIN as u32, libc::EPOLLOUT as u32, libc::EPOLLET as u32);
    let sv = g.put(0x100, &[0u8; 8]);
    let ty = (libc::SOCK_STREAM | libc::SOCK_NONBLOCK) as u64;
    g.call(libc::SYS_socketpair, &[libc::AF_UNIX as u64, ty, 0, sv]).unwrap();
    let fds = g.get(0x100, 8);
    let a = u32::from_le_bytes(fds[..4].try_into().unwrap()) as u64;
    let b = u32::from_le_bytes(fds[4..].try_into().unwrap()) as u64;
    let ep = g.call(libc::SYS_epoll_create1, &[0]).unwrap();
    g.epoll_add(ep, libc::EPOLL_CTL_ADD, a, inn | out | et);
    g.epoll_add(ep, libc::EPOLL_CTL_ADD, b, inn | out);
    let mut ev = g.epoll_events(ep);
    ev.sort_by_key(|e| e.1);
    assert_eq!(ev, [(out, a), (out, b)]);
    assert_eq!(g.epoll_events(ep), [(out, b)], "the edge of a is reported; b is level-triggered");
    let msg = g.put(0x200, b"hello");
    assert_eq!(g.call(libc::SYS_write, &[b, msg, 5]), Ok(5));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), Some(&(inn | out, a)));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), None, "nothing new");
    // Drained: the next data is a new edge; the drain itself is not one.
    let rd = g.buf + 0x400;
    assert_eq!(g.call(libc::SYS_read, &[a, rd, 64]), Ok(5));
    assert_eq!(g.call(libc::SYS_read, &[a, rd, 64]), Err(Errno::EAGAIN));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), None);
    assert_eq!(g.call(libc::SYS_write, &[b, msg, 5]), Ok(5));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), Some(&(inn | out, a)));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), None);
    // EPOLL_CTL_MOD re-arms: what is ready is reported again.
    g.epoll_add(ep, libc::EPOLL_CTL_MOD, a, out | et);
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), Some(&(out, a)));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), None);
    // One-shot and edge-triggered: once, then disarmed until re-armed.
    g.epoll_add(ep, libc::EPOLL_CTL_MOD, a, inn | et | libc::EPOLLONESHOT as u32);
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), Some(&(inn, a)));
    assert_eq!(g.call(libc::SYS_read, &[a, rd, 64]), Ok(5));
    assert_eq!(g.call(libc::SYS_write, &[b, msg, 5]), Ok(5));
    assert_eq!(g.epoll_events(ep).iter().find(|e| e.1 == a), None, "disarmed");
}

#[test]
fn a_pty_pair_opens_edits_lines_echoes_and_hangs_up() {
    let mut g = guest();
    let flags = libc::O_RDWR | libc::O_NOCTTY;
    let master = g.open("/dev/ptmx", flags | libc::O_NONBLOCK);
    let arg = g.buf + 0x100;
    assert_eq!(g.call(libc::SYS_ioctl, &[master as u64, 0x8004_5430 /* TIOCGPTN */, arg]), Ok(0));
    assert_eq!(g.get(0x100, 4), 0u32.to_le_bytes());
    let path = g.path(0x8000, "/dev/pts/0");
    assert_eq!(g.call(libc::SYS_open, &[path, flags as u64, 0]), Err(Errno::EIO), "locked until unlockpt");
    g.put(0x100, &0u32.to_le_bytes());
    assert_eq!(g.call(libc::SYS_ioctl, &[master as u64, 0x4004_5431 /* TIOCSPTLCK */, arg]), Ok(0));
    let slave = g.open("/dev/pts/0", flags);
    let other = g.path(0x8000, "/dev/pts/1");
    assert_eq!(g.call(libc::SYS_open, &[other, flags as u64, 0]), Err(Errno::ENOENT));
    // Both sides are terminals (isatty is TCGETS); a pipe is not.
    let tio = g.buf + 0x300;
    assert_eq!(g.call(libc::SYS_ioctl, &[slave as u64, 0x5401, tio]), Ok(0));
    assert_eq!(g.call(libc::SYS_ioctl, &[master as u64, 0x5401, tio]), Ok(0));
    g.call(libc::SYS_pipe2, &[g.buf + 0x400, 0]).unwrap();
    let (pr, _pw) = g.fd_pair(0x400);
    assert_eq!(g.call(libc::SYS_ioctl, &[pr as u64, 0x5401, tio]), Err(Errno::ENOTTY));
    // fstat: a character device /dev/pts/0 (major 136).
    let st = g.buf + 0x1000;
    g.call(libc::SYS_fstat, &[slave as u64, st]).unwrap();
    let mode = u32::from_le_bytes(g.get(0x1000 + 24, 4).try_into().unwrap());
    assert_eq!(mode & libc::S_IFMT, libc::S_IFCHR);
    assert_eq!(g.get_i64(0x1000 + 40) as u64, crate::vfs::makedev(136, 0));
    // The terminal types a line with a typo: the slave reads the edited line,
    // the master reads the echo with \r\n.
    let typed = g.put(0x200, b"lz\x7fs\r");
    assert_eq!(g.call(libc::SYS_write, &[master as u64, typed, 5]), Ok(5));
    let out = g.buf + 0x2000;
    assert_eq!(g.call(libc::SYS_read, &[slave as u64, out, 100]), Ok(3));
    assert_eq!(g.get(0x2000, 3), b"ls\n");
    let n = g.call(libc::SYS_read, &[master as u64, out, 100]).unwrap();
    assert_eq!(g.get(0x2000, n), b"lz\x08 \x08s\r\n");
    let said = g.put(0x200, b"ok\n");
    assert_eq!(g.call(libc::SYS_write, &[slave as u64, said, 3]), Ok(3));
    assert_eq!(g.call(libc::SYS_read, &[master as u64, out, 100]), Ok(4));
    assert_eq!(g.get(0x2000, 4), b"ok\r\n");
    assert_eq!(g.call(libc::SYS_read, &[master as u64, out, 100]), Err(Errno::EAGAIN));
    // Window size set on the master is read on the slave.
    let ws = g.put(0x500, &[24u16.to_le_bytes(), 80u16.to_le_bytes(), [0; 2], [0; 2]].concat());
    assert_eq!(g.call(libc::SYS_ioctl, &[master as u64, 0x5414, ws]), Ok(0));
    assert_eq!(g.call(libc::SYS_ioctl, &[slave as u64, 0x5413, g.buf + 0x600]), Ok(0));
    assert_eq!(g.get(0x600, 4), [24, 0, 80, 0]);
    // The slave closed: the master reads EIO, as Linux.
    g.call(libc::SYS_close, &[slave as u64]).unwrap();
    assert_eq!(g.call(libc::SYS_read, &[master as u64, out, 100]), Err(Errno::EIO));
    g.proc.fds.validate().unwrap();
    // The master closed: the pty and its number are free again.
    g.call(libc::SYS_close, &[master as u64]).unwrap();
    assert_eq!(g.proc.fds.objects.ptys().count(), 0);
    g.proc.fds.validate().unwrap();
    // No controlling terminal: /dev/tty is ENXIO.
    let tty = g.path(0x8000, "/dev/tty");
    assert_eq!(g.call(libc::SYS_open, &[tty, libc::O_RDWR as u64, 0]), Err(Errno::ENXIO));
}

// ----- inotify -----------------------------------------------------------------------

/// Decode `struct inotify_event` records: (wd, mask, cookie, name).
fn inotify_events(mut b: &[u8]) -> Vec<(i32, u32, u32, String)> {
    let mut out = Vec::new();
    while b.len() >= 16 {
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let len = word(12) as usize;
        assert_eq!(len % 16, 0, "names are padded to the record size");
        let name: Vec<u8> = b[16..16 + len].iter().take_while(|&&c| c != 0).copied().collect();
        out.push((word(0) as i32, word(4), word(8), String::from_utf8(name).unwrap()));
        b = &b[16 + len..];
    }
    assert!(b.is_empty(), "whole records only");
    out
}

impl Guest {
    fn inotify_watch(&mut self, fd: i32, p: &str, mask: u32) -> Result<u64, Errno> {
        let path = self.path(0x9000, p);
        self.call(libc::SYS_inotify_add_watch, &[fd as u64, path, mask as u64])
    }

    /// Read the instance's events with a buffer of `len` bytes.
    fn inotify_read(&mut self, fd: i32, len: u64) -> Result<Vec<(i32, u32, u32, String)>, Errno> {
        let n = self.call(libc::SYS_read, &[fd as u64, self.buf + 0x10000, len])?;
        Ok(inotify_events(&self.get(0x10000, n)))
    }

    fn sys_path(&mut self, nr: i64, a: &str, extra: &[u64]) -> Result<u64, Errno> {
        let p = self.path(0x8000, a);
        let mut args = vec![p];
        args.extend_from_slice(extra);
        self.call(nr, &args)
    }
}

#[test]
fn inotify_reports_what_the_guest_does_in_a_watched_directory() {
    use crate::vfs::inotify::*;
    let mut g = guest();
    g.sys_path(libc::SYS_mkdir, "/tmp/w", &[0o755]).unwrap();
    let fd = g.call(libc::SYS_inotify_init1, &[libc::IN_NONBLOCK as u64]).unwrap() as i32;
    assert_eq!(g.inotify_watch(fd, "/tmp/w", IN_ALL_EVENTS), Ok(1));
    assert_eq!(g.inotify_watch(fd, "/tmp/w/", IN_CREATE | IN_MASK_ADD), Ok(1), "one inode, one wd");
    let ofd = g.proc.fds.ofd(fd).unwrap();
    assert_eq!(crate::wait::ready(&g.proc, &g.kernel, ofd), 0);
    assert_eq!(g.inotify_read(fd, 4096), Err(Errno::EAGAIN));

    let f = g.open("/tmp/w/a", libc::O_CREAT | libc::O_WRONLY);
    let data = g.put(0x100, b"x");
    g.call(libc::SYS_write, &[f as u64, data, 1]).unwrap();
    g.call(libc::SYS_write, &[f as u64, data, 1]).unwrap();
    g.call(libc::SYS_fchmod, &[f as u64, 0o600]).unwrap();
    let (old, new) = (g.path(0x8000, "/tmp/w/a"), g.path(0x8100, "/tmp/w/b"));
    g.call(libc::SYS_rename, &[old, new]).unwrap();
    // Written through the descriptor opened by the old name: the new one is reported.
    g.call(libc::SYS_write, &[f as u64, data, 1]).unwrap();
    g.sys_path(libc::SYS_mkdir, "/tmp/w/d", &[0o755]).unwrap();
    g.sys_path(libc::SYS_unlink, "/tmp/w/b", &[]).unwrap();
    g.sys_path(libc::SYS_rmdir, "/tmp/w/d", &[]).unwrap();
    // Outside the watched directory: nothing.
    g.sys_path(libc::SYS_mkdir, "/tmp/other", &[0o755]).unwrap();

    assert_eq!(crate::wait::ready(&g.proc, &g.kernel, ofd), (libc::POLLIN | libc::POLLRDNORM) as u32);
    let nread = g.buf + 0x200;
    g.call(libc::SYS_ioctl, &[fd as u64, libc::FIONREAD, nread]).unwrap();
    let pending = i32::from_le_bytes(g.get(0x200, 4).try_into().unwrap());
    assert_eq!(pending, 9 * 32, "nine events with a name (padded to 16 bytes)");
    assert_eq!(g.inotify_read(fd, 20), Err(Errno::EINVAL), "too small for the next record");
    let ev = g.inotify_read(fd, 4096).unwrap();
    let cookie = ev[3].2;
    assert_ne!(cookie, 0);
    let s = |x: &str| x.to_string();
    assert_eq!(
        ev,
        vec![
            (1, IN_CREATE, 0, s("a")),
            (1, IN_MODIFY, 0, s("a")),
            (1, IN_ATTRIB, 0, s("a")),
            (1, IN_MOVED_FROM, cookie, s("a")),
            (1, IN_MOVED_TO, cookie, s("b")),
            (1, IN_MODIFY, 0, s("b")),
            (1, IN_CREATE | IN_ISDIR, 0, s("d")),
            (1, IN_DELETE, 0, s("b")),
            (1, IN_DELETE | IN_ISDIR, 0, s("d")),
        ]
    );
    assert_eq!(g.inotify_read(fd, 4096), Err(Errno::EAGAIN));
    assert_eq!(crate::wait::ready(&g.proc, &g.kernel, ofd), 0);
    // rm_watch: IN_IGNORED, then the descriptor is unknown.
    assert_eq!(g.call(libc::SYS_inotify_rm_watch, &[fd as u64, 1]), Ok(0));
    assert_eq!(g.call(libc::SYS_inotify_rm_watch, &[fd as u64, 1]), Err(Errno::EINVAL));
    assert_eq!(g.inotify_read(fd, 4096).unwrap(), vec![(1, IN_IGNORED, 0, s(""))]);
}

#[test]
fn inotify_watches_a_file_through_a_symlink_and_sees_it_go() {
    use crate::vfs::inotify::*;
    let mut g = guest();
    let f = g.open("/tmp/log", libc::O_CREAT | libc::O_WRONLY);
    g.call(libc::SYS_close, &[f as u64]).unwrap();
    let (target, link) = (g.path(0x8000, "/tmp/log"), g.path(0x8100, "/tmp/link"));
    g.call(libc::SYS_symlink, &[target, link]).unwrap();
    let fd = g.call(libc::SYS_inotify_init, &[]).unwrap() as i32;
    assert_eq!(g.inotify_watch(fd, "/tmp/link", IN_MODIFY | IN_DONT_FOLLOW | IN_ONLYDIR), Err(Errno::ENOTDIR));
    assert_eq!(g.inotify_watch(fd, "/tmp/link", IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF), Ok(1));
    assert_eq!(g.inotify_watch(fd, "/tmp/log", IN_MODIFY | IN_MASK_CREATE), Err(Errno::EEXIST));
    assert_eq!(g.inotify_watch(fd, "/tmp/nope", IN_MODIFY), Err(Errno::ENOENT));
    assert_eq!(g.inotify_watch(fd, "/tmp/log", 0), Err(Errno::EINVAL), "no event asked for");
    let w = g.open("/tmp/log", libc::O_WRONLY | libc::O_APPEND);
    let data = g.put(0x100, b"line\n");
    for _ in 0..3 {
        g.call(libc::SYS_write, &[w as u64, data, 5]).unwrap();
    }
    let (old, new) = (g.path(0x8000, "/tmp/log"), g.path(0x8100, "/tmp/log.1"));
    g.call(libc::SYS_rename, &[old, new]).unwrap();
    g.sys_path(libc::SYS_unlink, "/tmp/log.1", &[]).unwrap();
    let ev = g.inotify_read(fd, 4096).unwrap();
    assert_eq!(
        ev,
        vec![
            (1, IN_MODIFY, 0, String::new()),
            (1, IN_MOVE_SELF, 0, String::new()),
            (1, IN_DELETE_SELF, 0, String::new()),
            (1, IN_IGNORED, 0, String::new()),
        ],
        "identical modifications merge; deletion ends the watch"
    );
    // A blocking instance with nothing queued waits for it to become readable.
    let (r, effect) = g.call_effect(libc::SYS_read, &[fd as u64, g.buf + 0x10000, 4096]);
    assert_eq!(r, Ok(0));
    let ofd = g.proc.fds.ofd(fd).unwrap();
    assert_eq!(
        effect,
        Some(crate::kernel::Effect::Block(crate::kernel::block::Block::new(crate::kernel::block::WaitOn::Fd {
            ofd,
            events: crate::kernel::block::READABLE
        })))
    );
    // Open for reading only (as Linux's), without an offset to read at.
    assert_eq!(g.call(libc::SYS_write, &[fd as u64, data, 5]), Err(Errno::EBADF));
    assert_eq!(g.call(libc::SYS_pread64, &[fd as u64, g.buf, 64, 0]), Err(Errno::ESPIPE));
    // Not an inotify descriptor.
    assert_eq!(g.inotify_watch(w, "/tmp", IN_CREATE), Err(Errno::EINVAL));
    assert_eq!(g.inotify_watch(99, "/tmp", IN_CREATE), Err(Errno::EBADF));
}

#[test]
fn inotify_instances_are_capped_and_closing_one_frees_its_watches() {
    use crate::vfs::inotify::*;
    let mut g = guest();
    assert_eq!(g.call(libc::SYS_inotify_init1, &[libc::O_RDWR as u64]), Err(Errno::EINVAL));
    let mut fds = Vec::new();
    for _ in 0..crate::objects::MAX_INOTIFY_INSTANCES {
        fds.push(g.call(libc::SYS_inotify_init1, &[libc::IN_CLOEXEC as u64]).unwrap() as i32);
    }
    assert_eq!(g.call(libc::SYS_inotify_init1, &[0]), Err(Errno::EMFILE));
    let first = fds[0];
    assert_eq!(g.proc.fds.cloexec(first), Ok(true));
    assert_eq!(g.inotify_watch(first, "/tmp", IN_CREATE), Ok(1));
    assert!(!g.proc.vfs.is_watched(), "inotify alone records no paths");
    g.call(libc::SYS_close, &[first as u64]).unwrap();
    let again = g.call(libc::SYS_inotify_init1, &[0]).unwrap() as i32;
    // The closed instance's watch is gone: a change reaches nobody, and the
    // new instance (maybe the same object id) starts without watches.
    g.sys_path(libc::SYS_mkdir, "/tmp/x", &[0o755]).unwrap();
    let (_, effect) = g.call_effect(libc::SYS_read, &[again as u64, g.buf, 4096]);
    assert!(matches!(effect, Some(crate::kernel::Effect::Block(_))), "nothing queued: it waits");
    assert_eq!(g.proc.vfs.changes(0), None);
}

/// A checkpoint keeps the instance, not its watches (nor the events queued):
/// restored, it is an instance without watches that may add new ones.
#[test]
fn an_inotify_instance_comes_back_from_a_checkpoint_without_watches() {
    use crate::vfs::inotify::*;
    let mut g = guest();
    let fd = g.call(libc::SYS_inotify_init1, &[libc::IN_NONBLOCK as u64]).unwrap() as i32;
    assert_eq!(g.inotify_watch(fd, "/tmp", IN_CREATE), Ok(1));
    g.sys_path(libc::SYS_mkdir, "/tmp/before", &[0o755]).unwrap();
    let image = g.proc.vfs.image().clone();
    let state = g.proc.save_state();
    g.proc = Process::restore_state(image, state).unwrap();
    g.sys_path(libc::SYS_mkdir, "/tmp/after", &[0o755]).unwrap();
    assert_eq!(g.inotify_read(fd, 4096), Err(Errno::EAGAIN));
    assert_eq!(g.call(libc::SYS_inotify_rm_watch, &[fd as u64, 1]), Err(Errno::EINVAL));
    assert_eq!(g.inotify_watch(fd, "/tmp", IN_DELETE), Ok(1));
    g.sys_path(libc::SYS_rmdir, "/tmp/after", &[]).unwrap();
    assert_eq!(g.inotify_read(fd, 4096).unwrap(), vec![(1, IN_DELETE | IN_ISDIR, 0, "after".to_string())]);
}

#[test]
fn inotify_reports_closes_by_access_mode() {
    use crate::vfs::inotify::*;
    let mut g = guest();
    g.sys_path(libc::SYS_mkdir, "/tmp/c", &[0o755]).unwrap();
    let fd = g.call(libc::SYS_inotify_init1, &[libc::IN_NONBLOCK as u64]).unwrap() as i32;
    assert_eq!(g.inotify_watch(fd, "/tmp/c", IN_CLOSE_WRITE | IN_CLOSE_NOWRITE), Ok(1));
    for flags in [libc::O_CREAT | libc::O_WRONLY, libc::O_RDONLY, libc::O_PATH] {
        let f = g.open("/tmp/c/f", flags);
        g.call(libc::SYS_close, &[f as u64]).unwrap();
    }
    let d = g.open("/tmp/c", libc::O_RDONLY | libc::O_DIRECTORY);
    g.call(libc::SYS_close, &[d as u64]).unwrap();
    assert_eq!(
        g.inotify_read(fd, 4096).unwrap(),
        vec![
            (1, IN_CLOSE_WRITE, 0, "f".to_string()),
            (1, IN_CLOSE_NOWRITE, 0, "f".to_string()),
            (1, IN_CLOSE_NOWRITE | IN_ISDIR, 0, String::new()),
        ],
        "an O_PATH descriptor closes without an event"
    );
}

#[test]
fn the_agent_exchange_hands_over_the_reply_once_and_parks_until_a_request() {
    use crate::file::agent::AGENT_XCHG;
    use crate::kernel::Effect;
    let mut g = guest();
    g.proc.fds = crate::fd::FdTable::with_stdio(3);
    let pread = libc::SYS_pread64;
    let stage = |reply_len: u32, data: &[u8], g: &mut Guest| {
        g.put(0, &reply_len.to_le_bytes());
        g.put(4, data);
    };
    // A reply and no request: the reply goes out, reply_len is cleared, the call parks.
    stage(5, b"hello", &mut g);
    let (r, e) = g.call_effect(pread, &[3, g.buf, 4 + 64, AGENT_XCHG]);
    assert_eq!((r, matches!(e, Some(Effect::Park))), (Ok(0), true));
    assert_eq!(g.kernel.agent_out, b"hello");
    assert_eq!(g.get(0, 4), [0; 4], "taken once: reply_len is 0 after the call");
    // Dispatched again once a request is there (as the engine does after a park): the
    // request comes back, the reply is not sent twice.
    g.kernel.send_to_agent(b"request bytes".to_vec());
    let (r, e) = g.call_effect(pread, &[3, g.buf, 4 + 64, AGENT_XCHG]);
    assert_eq!((r, e.is_none()), (Ok(13), true));
    assert_eq!(g.get(4, 13), b"request bytes");
    assert_eq!(g.kernel.agent_out, b"hello");
    // A request longer than the buffer comes in pieces; preadv is the same call.
    g.kernel.send_to_agent(b"0123456789".to_vec());
    stage(0, b"", &mut g);
    assert_eq!(g.call(pread, &[3, g.buf, 4 + 4, AGENT_XCHG]), Ok(4));
    assert_eq!(g.get(4, 4), b"0123");
    let iov = g.put(0x100, &[g.buf, 4 + 64].map(u64::to_le_bytes).concat());
    assert_eq!(g.call(libc::SYS_preadv, &[3, iov, 1, AGENT_XCHG]), Ok(6));
    assert_eq!(g.get(4, 6), b"456789");
    // Bad input: a reply longer than the buffer, a buffer past the guest's mappings,
    // a buffer without room for its header, another offset, another file.
    stage(65, b"", &mut g);
    assert_eq!(g.call(pread, &[3, g.buf, 4 + 64, AGENT_XCHG]), Err(Errno::EINVAL));
    let near_end = g.buf + BUF_LEN - 8;
    g.mem.write_untracked(near_end, &[8, 0, 0, 0]).unwrap();
    assert_eq!(g.call(pread, &[3, near_end, 8, AGENT_XCHG]), Err(Errno::EINVAL));
    assert_eq!(g.call(pread, &[3, near_end, 4 + 8 + 4, AGENT_XCHG]), Err(Errno::EFAULT));
    assert_eq!(g.call(pread, &[3, g.buf, 2, AGENT_XCHG]), Err(Errno::EINVAL));
    assert_eq!(g.call(pread, &[3, g.buf, 64, 0]), Err(Errno::ESPIPE));
    assert_eq!(g.kernel.agent_out, b"hello", "nothing sent by the refused calls");
}

/// A file of `data` at `p` with mode `mode`.
fn file(g: &mut Guest, p: &str, data: &[u8], mode: u32) {
    let fd = g.open(p, libc::O_CREAT | libc::O_WRONLY);
    let d = g.put(0x9000, data);
    assert_eq!(g.call(libc::SYS_write, &[fd as u64, d, data.len() as u64]), Ok(data.len() as u64));
    assert_eq!(g.call(libc::SYS_fchmod, &[fd as u64, mode as u64]), Ok(0));
    assert_eq!(g.call(libc::SYS_close, &[fd as u64]), Ok(0));
}

#[test]
fn execveat_runs_a_file_from_a_directory_fd_or_the_fd_itself() {
    use crate::kernel::Effect;
    const AT_EMPTY_PATH: u64 = 0x1000;
    const AT_SYMLINK_NOFOLLOW: u64 = 0x100;
    let mut g = guest();
    file(&mut g, "/tmp/prog", b"\x7fELF\x02\x01\x01", 0o755);
    file(&mut g, "/tmp/script", b"#!/tmp/prog\n", 0o755);
    file(&mut g, "/tmp/data", b"\x7fELF\x02\x01\x01", 0o644);
    let link = g.path(0x100, "/tmp/prog");
    let name = g.path(0x200, "/tmp/link");
    assert_eq!(g.call(libc::SYS_symlink, &[link, name]), Ok(0));
    // argv = ["x"], envp = [].
    let x = g.path(0x300, "x");
    let argv = g.put(0x400, &[x.to_le_bytes(), 0u64.to_le_bytes()].concat());
    let envp = g.put(0x500, &0u64.to_le_bytes());
    let empty = g.path(0x600, "");
    let rel = g.path(0x700, "prog");
    let exec = |g: &mut Guest, dirfd: i32, path: u64, flags: u64| match g
        .call_effect(libc::SYS_execveat, &[dirfd as u64, path, argv, envp, flags])
    {
        (Ok(0), Some(Effect::Exec(spec))) => Ok((spec.path, spec.ino, spec.argv)),
        (Ok(r), e) => panic!("execveat returned {r} with {e:?}"),
        (Err(e), _) => Err(e),
    };
    let prog_ino = g.proc.vfs.resolve(crate::vfs::ROOT_INO, b"/tmp/prog", true).unwrap();
    // fexecve: the fd's own file, even one that closes on exec (the engine holds the node).
    let fd = g.open("/tmp/prog", libc::O_RDONLY | libc::O_CLOEXEC);
    assert_eq!(exec(&mut g, fd, empty, AT_EMPTY_PATH), Ok((format!("/dev/fd/{fd}"), prog_ino, vec![b"x".to_vec()])));
    let opath = g.open("/tmp/prog", libc::O_PATH);
    assert_eq!(exec(&mut g, opath, empty, AT_EMPTY_PATH).map(|r| r.1), Ok(prog_ino));
    // An empty path without AT_EMPTY_PATH, or on something that is not a file.
    assert_eq!(exec(&mut g, fd, empty, 0), Err(Errno::ENOENT));
    let dir = g.open("/tmp", libc::O_RDONLY | libc::O_DIRECTORY);
    assert_eq!(exec(&mut g, dir, empty, AT_EMPTY_PATH), Err(Errno::EACCES));
    g.call(libc::SYS_pipe, &[g.buf + 0x800]).unwrap();
    let pipe = i32::from_le_bytes(g.get(0x800, 4).try_into().unwrap());
    assert_eq!(exec(&mut g, pipe, empty, AT_EMPTY_PATH), Err(Errno::EACCES));
    assert_eq!(exec(&mut g, 999, empty, AT_EMPTY_PATH), Err(Errno::EBADF));
    let data = g.open("/tmp/data", libc::O_RDONLY);
    assert_eq!(exec(&mut g, data, empty, AT_EMPTY_PATH), Err(Errno::EACCES), "not executable");
    // A script by fd: its interpreter would open /dev/fd/N, gone with a close-on-exec fd.
    let script = g.open("/tmp/script", libc::O_RDONLY | libc::O_CLOEXEC);
    assert_eq!(exec(&mut g, script, empty, AT_EMPTY_PATH), Err(Errno::ENOENT));
    let script = g.open("/tmp/script", libc::O_RDONLY);
    let name = format!("/dev/fd/{script}");
    assert_eq!(
        exec(&mut g, script, empty, AT_EMPTY_PATH),
        Ok(("/tmp/prog".into(), prog_ino, vec![b"/tmp/prog".to_vec(), name.into_bytes()]))
    );
    // Relative to a directory fd; AT_SYMLINK_NOFOLLOW refuses a symlink as the last part.
    assert_eq!(exec(&mut g, dir, rel, 0).map(|r| r.0), Ok("/tmp/prog".into()));
    let link = g.path(0x200, "/tmp/link");
    assert_eq!(exec(&mut g, dir, link, 0).map(|r| r.1), Ok(prog_ino));
    assert_eq!(exec(&mut g, dir, link, AT_SYMLINK_NOFOLLOW), Err(Errno::ELOOP));
    assert_eq!(exec(&mut g, fd, rel, 0), Err(Errno::ENOTDIR));
    assert_eq!(exec(&mut g, dir, rel, 0x8000), Err(Errno::EINVAL));
}

#[test]
fn a_blocking_pipe_write_larger_than_its_room_waits_for_the_rest() {
    use crate::kernel::block::{WaitOn, WRITABLE};
    use crate::kernel::Effect;
    use crate::objects::PIPE_CAPACITY;
    let cap = PIPE_CAPACITY as u64;
    let mut g = guest();
    g.call(libc::SYS_pipe2, &[g.buf, 0]).unwrap();
    let (r, w) = g.fd_pair(0);
    let len = 2 * cap + 100;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let src = g.put(0x1000, &data);
    let out = g.buf + 0x8_0000;
    let write = |g: &mut Guest| g.call_effect(libc::SYS_write, &[w as u64, src, len]);
    let read_all = |g: &mut Guest| g.call(libc::SYS_read, &[r as u64, out, len]).unwrap();
    // What fits goes in, then the call waits (the count so far is the thread's).
    let (res, eff) = write(&mut g);
    assert_eq!(res, Ok(0));
    let Some(Effect::Block(b)) = eff else { panic!("expected a block, got {eff:?}") };
    assert!(matches!(b.on, WaitOn::Fd { events: WRITABLE, .. }));
    assert_eq!(g.proc.threads.current().written, cap);
    // Re-runs go on from there: nothing is written twice.
    assert!(matches!(write(&mut g), (Ok(0), Some(Effect::Block(_)))), "still full");
    assert_eq!(read_all(&mut g), cap);
    assert!(matches!(write(&mut g), (Ok(0), Some(Effect::Block(_)))));
    assert_eq!(g.proc.threads.current().written, 2 * cap);
    assert_eq!(read_all(&mut g), cap);
    assert_eq!(write(&mut g), (Ok(len), None), "every byte is in");
    assert_eq!(g.proc.threads.current().written, 0);
    assert_eq!(read_all(&mut g), 100);
    assert_eq!(g.get(0x8_0000, 100), &data[2 * cap as usize..]);
    // A checkpoint ends such a wait with the count written so far.
    let (res, _) = write(&mut g);
    assert_eq!(res, Ok(0));
    let regs = forkbox_vmm::Regs { rax: libc::SYS_write as u64, rcx: 0x4000, r11: 0x202, ..Default::default() };
    {
        let t = g.proc.threads.current_mut();
        t.wait = Some(crate::thread::Wait::new(regs, None, Ok(0), crate::thread::WaitKind::Other));
        t.cpu = Some(crate::thread::SavedCpu { regs, xsave: Default::default() });
    }
    let saved = g.proc.threads.for_checkpoint();
    let t = saved.current();
    assert_eq!((t.wait.is_none(), t.written), (true, 0));
    let cpu = t.cpu.as_ref().unwrap();
    assert_eq!((cpu.regs.rax, cpu.regs.rip), (cap, 0x4000), "returns the count after the syscall");
    // The reader goes away part-way: the bytes written count, no EPIPE.
    g.proc.threads.current_mut().wait = None;
    assert_eq!(g.call(libc::SYS_close, &[r as u64]), Ok(0));
    assert_eq!(write(&mut g), (Ok(cap), None));
    assert_eq!(g.proc.threads.current().written, 0);
    // Non-blocking: what fits, at once.
    g.call(libc::SYS_pipe2, &[g.buf, libc::O_NONBLOCK as u64]).unwrap();
    let (_, w2) = g.fd_pair(0);
    assert_eq!(g.call_effect(libc::SYS_write, &[w2 as u64, src, len]), (Ok(cap), None));
}

#[test]
fn a_writev_that_waits_after_earlier_buffers_returns_every_byte_it_moved() {
    use crate::objects::PIPE_CAPACITY;
    let cap = PIPE_CAPACITY as u64;
    let mut g = guest();
    g.call(libc::SYS_pipe2, &[g.buf, 0]).unwrap();
    let (_, w) = g.fd_pair(0);
    let src = g.put(0x1000, &vec![1u8; 2 * cap as usize]);
    let iov = g.put(0x100, &[src, 100, src, 2 * cap].map(u64::to_le_bytes).concat());
    let (res, eff) = g.call_effect(libc::SYS_writev, &[w as u64, iov, 2]);
    assert_eq!((res, eff), (Ok(cap), None), "100 bytes, then the pipe's room of the second buffer");
    assert_eq!(g.proc.threads.current().written, 0);
}

#[test]
fn dev_stdin_and_stdout_reopen_the_pipes_of_fds_0_and_1() {
    let mut g = guest();
    g.call(libc::SYS_pipe2, &[g.buf, 0]).unwrap();
    let (r, w) = g.fd_pair(0);
    g.call(libc::SYS_dup2, &[r as u64, 0]).unwrap();
    g.call(libc::SYS_dup2, &[w as u64, 1]).unwrap();
    let link = g.path(0x100, "/dev/stdin");
    let n = g.call(libc::SYS_readlink, &[link, g.buf + 0x200, 64]).unwrap();
    assert_eq!(g.get(0x200, n), b"/proc/self/fd/0");
    let out = g.open("/dev/stdout", libc::O_WRONLY);
    let data = g.put(0x300, b"abc");
    assert_eq!(g.call(libc::SYS_write, &[out as u64, data, 3]), Ok(3));
    let inp = g.open("/dev/stdin", libc::O_RDONLY);
    assert!(inp > 2 && out > 2);
    assert_eq!(g.call(libc::SYS_read, &[inp as u64, g.buf + 0x400, 16]), Ok(3));
    assert_eq!(g.get(0x400, 3), b"abc");
    // As on Linux, O_NOFOLLOW stops at the link.
    let p = g.path(0x100, "/dev/stdin");
    assert_eq!(g.call(libc::SYS_open, &[p, (libc::O_RDONLY | libc::O_NOFOLLOW) as u64, 0]), Err(Errno::ELOOP));
    // A VFS made before /dev had the links (a template's) still opens fd 0's pipe.
    let p = g.path(0x100, "/dev/stdin");
    g.call(libc::SYS_unlink, &[p]).unwrap();
    g.call(libc::SYS_write, &[1, data, 2]).unwrap();
    let again = g.open("/dev/stdin", libc::O_RDONLY);
    assert_eq!(g.call(libc::SYS_read, &[again as u64, g.buf + 0x400, 16]), Ok(2));
    // /dev/fd is the directory of fd links.
    let p = g.path(0x100, "/dev/fd");
    let n = g.call(libc::SYS_readlink, &[p, g.buf + 0x200, 64]).unwrap();
    assert_eq!(g.get(0x200, n), b"/proc/self/fd");
}
