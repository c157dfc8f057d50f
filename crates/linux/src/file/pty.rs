//! Pseudo-terminals (`ObjKind::PtyMaster`, `ObjKind::PtySlave`), as gVisor's
//! devpts: /dev/ptmx makes a master, /dev/pts/N (or TIOCGPTPEER) opens its
//! slave; the terminal and its line discipline are `crate::tty`. Terminal
//! ioctls (termios, window size, the foreground group, the pty number and
//! lock) are answered by both sides, as Linux does for a pty pair.

use crate::errno::{Errno, SysResult};
use crate::fd::OpenFile;
use crate::file::common::{object_id, object_poll, object_read, object_write, or_block};
use crate::file::ops::{FileOps, Open, PollCtx};
use crate::kernel::block::WRITABLE;
use crate::kernel::Ctx;
use crate::objects::ObjKind;
use crate::thread::{SigInfo, SI_USER};
use crate::tty::{Pty, Termios, WinSize, TERMIOS2_SIZE, TERMIOS_SIZE};
use crate::vfs::makedev;
use crate::vfs::{FileType, Stat};

/// Device major of pty slaves (`/dev/pts/N`), as Linux.
pub const PTS_MAJOR: u64 = 136;

const TCGETS: u64 = 0x5401;
const TCSETS: u64 = 0x5402;
const TCSETSW: u64 = 0x5403;
const TCSETSF: u64 = 0x5404;
const TCSBRK: u64 = 0x5409;
const TCXONC: u64 = 0x540A;
const TCFLSH: u64 = 0x540B;
const TIOCSCTTY: u64 = 0x540E;
const TIOCGPGRP: u64 = 0x540F;
const TIOCSPGRP: u64 = 0x5410;
const TIOCOUTQ: u64 = 0x5411;
const TIOCGWINSZ: u64 = 0x5413;
const TIOCSWINSZ: u64 = 0x5414;
const TIOCNOTTY: u64 = 0x5422;
const TIOCGSID: u64 = 0x5429;
const TCGETS2: u64 = 0x802C_542A;
const TCSETS2: u64 = 0x402C_542B;
const TCSETSW2: u64 = 0x402C_542C;
const TCSETSF2: u64 = 0x402C_542D;
const TIOCGPTN: u64 = 0x8004_5430;
const TIOCSPTLCK: u64 = 0x4004_5431;
const TIOCGPTLCK: u64 = 0x8004_5439;
const TIOCGPTPEER: u64 = 0x5441;
/// forkbox's own: send this pty's output to background job `arg` (its leader
/// pid) instead of the master (the command helper's, for `pty` commands).
pub const FORKBOX_TIOCSJOB: u64 = 0x54F0;

/// Move what a terminal attached to a job (`Pty::job`) has for the master
/// into that job's stdout (the host reads it there, as any job's output).
pub fn flush_to_job(p: &mut Pty, kernel: &mut crate::kernel::Kernel) {
    let Some(leader) = p.job else { return };
    let Some(rings) = kernel.job_out.get_mut(&leader) else { return };
    if p.output.is_empty() {
        return;
    }
    let (a, b) = p.output.as_slices();
    let ring = &mut rings[crate::kernel::state::Stream::Stdout as usize];
    ring.push(a, crate::kernel::state::JOB_OUTPUT_BYTES);
    ring.push(b, crate::kernel::state::JOB_OUTPUT_BYTES);
    p.output.clear();
}

/// The path of slave `index`.
pub fn pts_path(index: u32) -> String {
    format!("/dev/pts/{index}")
}

/// Send `sig` to every live process of group `pgid` (the caller's own copy
/// is queued on it directly, as kill(2) does). Linux marks a terminal's
/// signals SI_KERNEL; here that code is the host's interrupt of an exec, so
/// they go as SI_USER from pid 0.
pub fn signal_group(ctx: &mut Ctx, pgid: u32, sig: i32) {
    let Ok(targets) = ctx.kernel.procs.kill_targets(ctx.proc.pid, -(pgid as i32)) else { return };
    let info = SigInfo::user(sig, SI_USER);
    for t in targets {
        if t == ctx.proc.pid {
            ctx.proc.threads.send_process(info);
        } else if ctx.kernel.procs.get(t).is_some_and(|e| e.exit.is_none()) {
            ctx.kernel.procs.outbox.push((t, info));
        }
    }
}

/// open("/dev/ptmx"): a new pty, locked, with its master at the lowest free fd.
pub fn open_master(ctx: &mut Ctx, flags: i32) -> SysResult {
    let id = ctx.proc.fds.objects.new_pty()?;
    Ok(ctx.proc.fds.open_object(id, flags)? as u64)
}

/// open("/dev/pts/N") (and TIOCGPTPEER, /dev/tty): a description of the
/// slave of the pty whose master is `master`. A session leader without a
/// controlling terminal gets this one unless `O_NOCTTY`, as on Linux.
pub fn open_slave(ctx: &mut Ctx, master: u64, flags: i32) -> SysResult {
    let slave = ctx.proc.fds.objects.pty_slave(master)?;
    let fd = ctx.proc.fds.open_object(slave, flags & !libc::O_NOCTTY)?;
    if flags & libc::O_NOCTTY == 0 {
        let pid = ctx.proc.pid;
        if let Some((sid, pgid)) = ctx.kernel.procs.get(pid).map(|e| (e.sid, e.pgid)) {
            let has_ctty = ctx.proc.fds.objects.ptys().any(|(_, p)| p.session == Some(sid));
            if let Ok(p) = ctx.proc.fds.objects.pty_mut(master) {
                if sid == pid && !has_ctty && p.session.is_none() {
                    p.session = Some(sid);
                    p.pgrp = Some(pgid);
                }
            }
        }
    }
    Ok(fd as u64)
}

/// The master of pty N (ENOENT if there is none; EIO while it is locked).
pub fn master_of_index(ctx: &Ctx, index: u32) -> Result<u64, Errno> {
    let (id, p) = ctx.proc.fds.objects.ptys().find(|(_, p)| p.index == index).ok_or(Errno::ENOENT)?;
    if p.locked {
        return Err(Errno::EIO);
    }
    Ok(id)
}

/// The master of the caller's controlling terminal (/dev/tty), ENXIO without one.
pub fn controlling_master(ctx: &Ctx) -> Result<u64, Errno> {
    let sid = ctx.kernel.procs.get(ctx.proc.pid).map(|e| e.sid).ok_or(Errno::ENXIO)?;
    ctx.proc.fds.objects.ptys().find(|(_, p)| p.session == Some(sid)).map(|(id, _)| id).ok_or(Errno::ENXIO)
}

fn pty_of<'a>(ctx: &'a mut Ctx, f: &Open) -> Result<&'a mut Pty, Errno> {
    ctx.proc.fds.objects.pty_mut(object_id(&f.file)?)
}

fn is_master(ctx: &Ctx, f: &Open) -> bool {
    matches!(object_id(&f.file).and_then(|id| ctx.proc.fds.objects.get(id)).map(|o| &o.kind), Ok(ObjKind::PtyMaster(_)))
}

/// The terminal ioctls both sides answer.
fn tty_ioctl(ctx: &mut Ctx, f: &Open, req: u64, arg: u64) -> SysResult {
    let master = is_master(ctx, f);
    match req {
        TCGETS | TCGETS2 => {
            let t = pty_of(ctx, f)?.termios;
            ctx.write_bytes(arg, &t.to_bytes(req == TCGETS2))?;
            Ok(0)
        }
        TCSETS | TCSETSW | TCSETSF | TCSETS2 | TCSETSW2 | TCSETSF2 => {
            let size = if matches!(req, TCSETS | TCSETSW | TCSETSF) { TERMIOS_SIZE } else { TERMIOS2_SIZE };
            let t = Termios::from_bytes(ctx.bytes(arg, size as u64)?)?;
            // Output is handed over at once, so TCSETSW has nothing to drain.
            pty_of(ctx, f)?.set_termios(t, matches!(req, TCSETSF | TCSETSF2));
            Ok(0)
        }
        TIOCGWINSZ => {
            let w = pty_of(ctx, f)?.winsize;
            ctx.write_bytes(arg, &w.to_bytes())?;
            Ok(0)
        }
        TIOCSWINSZ => {
            let w = WinSize::from_bytes(ctx.bytes(arg, 8)?)?;
            let p = pty_of(ctx, f)?;
            let changed = p.winsize != w;
            p.winsize = w;
            if let (true, Some(g)) = (changed, p.pgrp) {
                signal_group(ctx, g, libc::SIGWINCH);
            }
            Ok(0)
        }
        TIOCGPGRP => {
            let p = pty_of(ctx, f)?;
            let g = p.pgrp.ok_or(Errno::ENOTTY)?;
            ctx.write_i32(arg, g as i32)?;
            Ok(0)
        }
        TIOCSPGRP => {
            let g = i32::from_le_bytes(ctx.bytes(arg, 4)?.try_into().map_err(|_| Errno::EFAULT)?);
            let sid = ctx.kernel.procs.get(ctx.proc.pid).map(|e| e.sid);
            let p = pty_of(ctx, f)?;
            if p.session.is_none() || p.session != sid {
                return Err(Errno::ENOTTY);
            }
            if g < 0 {
                return Err(Errno::EINVAL);
            }
            let in_session = ctx
                .kernel
                .procs
                .kill_targets(ctx.proc.pid, -g)
                .is_ok_and(|t| t.iter().any(|pid| ctx.kernel.procs.get(*pid).is_some_and(|e| Some(e.sid) == sid)));
            if !in_session {
                return Err(Errno::EPERM);
            }
            pty_of(ctx, f)?.pgrp = Some(g as u32);
            Ok(0)
        }
        TIOCGSID => {
            let s = pty_of(ctx, f)?.session.ok_or(Errno::ENOTTY)?;
            ctx.write_i32(arg, s as i32)?;
            Ok(0)
        }
        TIOCSCTTY => {
            let pid = ctx.proc.pid;
            let (sid, pgid) = ctx.kernel.procs.get(pid).map(|e| (e.sid, e.pgid)).ok_or(Errno::EPERM)?;
            if sid != pid {
                return Err(Errno::EPERM);
            }
            let id = object_id(&f.file)?;
            let master = match ctx.proc.fds.objects.get(id)?.kind {
                ObjKind::PtySlave(m) => m,
                _ => id,
            };
            let p = ctx.proc.fds.objects.pty(master)?;
            if p.session == Some(pid) {
                return Ok(0);
            }
            // Another session's terminal: only stolen with arg 1 (root may).
            if p.session.is_some() && arg != 1 {
                return Err(Errno::EPERM);
            }
            if ctx.proc.fds.objects.ptys().any(|(m, p)| m != master && p.session == Some(pid)) {
                return Err(Errno::EPERM);
            }
            let p = ctx.proc.fds.objects.pty_mut(master)?;
            p.session = Some(pid);
            p.pgrp = Some(pgid);
            Ok(0)
        }
        TIOCNOTTY => {
            let me = ctx.proc.pid;
            let sid = ctx.kernel.procs.get(me).map(|e| e.sid);
            let p = pty_of(ctx, f)?;
            if p.session.is_none() || p.session != sid {
                return Err(Errno::ENOTTY);
            }
            if sid == Some(me) {
                let g = p.pgrp;
                p.session = None;
                p.pgrp = None;
                if let Some(g) = g {
                    signal_group(ctx, g, libc::SIGHUP);
                    signal_group(ctx, g, libc::SIGCONT);
                }
            }
            Ok(0)
        }
        TCSBRK | TCXONC => {
            pty_of(ctx, f)?;
            Ok(0)
        }
        TCFLSH => {
            let p = pty_of(ctx, f)?;
            // TCIFLUSH 0, TCOFLUSH 1, TCIOFLUSH 2, seen from this side.
            let (input, output) = match (arg, master) {
                (0, false) | (1, true) => (true, false),
                (1, false) | (0, true) => (false, true),
                (2, _) => (true, true),
                _ => return Err(Errno::EINVAL),
            };
            if input {
                p.set_termios(p.termios, true);
            }
            if output {
                p.output.clear();
            }
            Ok(0)
        }
        TIOCOUTQ => {
            let p = pty_of(ctx, f)?;
            let n = if master { p.input_len } else { p.output.len() };
            ctx.write_i32(arg, n.min(i32::MAX as usize) as i32)?;
            Ok(0)
        }
        _ => Err(Errno::ENOTTY),
    }
}

pub struct PtyMasterFile;

impl FileOps for PtyMasterFile {
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        ctx.user_range_mut(buf, len)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(crate::tty::OUTPUT_CAPACITY);
        let r = pty_of(ctx, f)?.master_read(len);
        object_read(ctx, f, buf, r)
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        object_write(self, ctx, f, buf, len, pos)
    }

    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let r = pty_of(ctx, f)?.master_write(data);
        let r = match r {
            Ok((n, sigs)) => {
                let id = object_id(&f.file)?;
                let p = ctx.proc.fds.objects.pty_mut(id)?;
                flush_to_job(p, ctx.kernel);
                let group = p.pgrp;
                if let Some(g) = group {
                    for s in sigs {
                        signal_group(ctx, g, s);
                    }
                }
                Ok(n as u64)
            }
            Err(e) => Err(e),
        };
        or_block(ctx, &f.file, f.ofd, WRITABLE, r)
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        Ok(ctx.proc.fds.objects.readable_bytes(object_id(&f.file)?))
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
        object_poll(p, f, depth)
    }

    fn stat(&self, _: &Ctx, f: &Open) -> Result<Stat, Errno> {
        Ok(tty_stat(3_000_000_000 + object_id(&f.file)?, makedev(5, 2), 0o666))
    }

    fn ioctl(&self, ctx: &mut Ctx, f: &Open, req: u64, arg: u64) -> SysResult {
        match req {
            TIOCGPTN => {
                let n = pty_of(ctx, f)?.index;
                ctx.write_i32(arg, n as i32)?;
                Ok(0)
            }
            TIOCSPTLCK => {
                let lock = ctx.bytes(arg, 4)? != [0, 0, 0, 0];
                pty_of(ctx, f)?.locked = lock;
                Ok(0)
            }
            FORKBOX_TIOCSJOB => {
                let pid = u32::try_from(arg).map_err(|_| Errno::EINVAL)?;
                if ctx.kernel.jobs.get(&pid) != Some(&pid) || !ctx.kernel.job_out.contains_key(&pid) {
                    return Err(Errno::EINVAL);
                }
                let id = object_id(&f.file)?;
                let p = ctx.proc.fds.objects.pty_mut(id)?;
                p.job = Some(pid);
                flush_to_job(p, ctx.kernel);
                Ok(0)
            }
            TIOCGPTLCK => {
                let lock = pty_of(ctx, f)?.locked;
                ctx.write_i32(arg, i32::from(lock))?;
                Ok(0)
            }
            TIOCGPTPEER => {
                let flags = i32::try_from(arg).map_err(|_| Errno::EINVAL)?;
                let allowed = libc::O_ACCMODE | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_CLOEXEC;
                if flags & !allowed != 0 {
                    return Err(Errno::EINVAL);
                }
                let id = object_id(&f.file)?;
                if pty_of(ctx, f)?.locked {
                    return Err(Errno::EIO);
                }
                open_slave(ctx, id, flags)
            }
            _ => tty_ioctl(ctx, f, req, arg),
        }
    }
}

pub struct PtySlaveFile;

impl FileOps for PtySlaveFile {
    /// A hung-up slave (its master closed) reads end of file.
    fn read(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        ctx.user_range_mut(buf, len)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(crate::tty::INPUT_CAPACITY);
        let r = match pty_of(ctx, f) {
            Err(Errno::EIO) => return Ok(0),
            Err(e) => Err(e),
            Ok(p) => p.slave_read(len),
        };
        object_read(ctx, f, buf, r)
    }

    fn write(&self, ctx: &mut Ctx, f: &Open, buf: u64, len: u64, pos: Option<u64>) -> SysResult {
        object_write(self, ctx, f, buf, len, pos)
    }

    /// A hung-up slave's writes are EIO.
    fn write_bytes(&self, ctx: &mut Ctx, f: &Open, data: &[u8], pos: Option<u64>) -> SysResult {
        if pos.is_some() {
            return Err(Errno::ESPIPE);
        }
        let id = object_id(&f.file)?;
        let p = ctx.proc.fds.objects.pty_mut(id)?;
        let r = p.slave_write(data).map(|n| n as u64);
        flush_to_job(p, ctx.kernel);
        or_block(ctx, &f.file, f.ofd, WRITABLE, r)
    }

    fn pending(&self, ctx: &mut Ctx, f: &Open) -> Result<u64, Errno> {
        Ok(ctx.proc.fds.objects.readable_bytes(object_id(&f.file)?))
    }

    fn poll(&self, p: &PollCtx, f: &OpenFile, depth: u32) -> u32 {
        object_poll(p, f, depth)
    }

    fn stat(&self, ctx: &Ctx, f: &Open) -> Result<Stat, Errno> {
        let index = ctx.proc.fds.objects.pty(object_id(&f.file)?).map(|p| p.index).unwrap_or(0);
        Ok(slave_stat(index))
    }

    fn ioctl(&self, ctx: &mut Ctx, f: &Open, req: u64, arg: u64) -> SysResult {
        match req {
            TIOCGPTN | TIOCSPTLCK | TIOCGPTLCK | TIOCGPTPEER => Err(Errno::ENOTTY),
            _ => tty_ioctl(ctx, f, req, arg),
        }
    }
}

/// What stat says of /dev/pts/N.
pub fn slave_stat(index: u32) -> Stat {
    tty_stat(3_100_000_000 + u64::from(index), makedev(PTS_MAJOR, u64::from(index)), 0o620)
}

fn tty_stat(ino: u64, rdev: u64, perm: u32) -> Stat {
    Stat { kind: FileType::CharDev, rdev, perm, ..Stat::pipe(ino) }
}
