//! Processes: fork/vfork/clone of a new process, execve/execveat, wait4/waitid,
//! process groups and sessions (kill is in `sys_signal`).
//! The engine makes the child's VM (`Effect::Fork`) and loads a program
//! (`Effect::Exec`); the process table is `crate::procs` (in `Kernel`).

use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx, Effect, ExecSpec, ForkSpec};
use crate::procs::Which;
use crate::vfs::FileType;

const CLONE_VM: u64 = 0x100;
const CLONE_VFORK: u64 = 0x4000;
const CLONE_SETTLS: u64 = 0x8_0000;
const CLONE_PARENT_SETTID: u64 = 0x10_0000;
const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
const CLONE_DETACHED: u64 = 0x40_0000;
const CLONE_CHILD_SETTID: u64 = 0x100_0000;
/// What a process clone may carry (CLONE_VM only with CLONE_VFORK: the child
/// gets a copy of the memory, which is all a vfork child may rely on until it execs).
const PROCESS_FLAGS: u64 = CLONE_VM
    | CLONE_VFORK
    | CLONE_SETTLS
    | CLONE_PARENT_SETTID
    | CLONE_CHILD_CLEARTID
    | CLONE_DETACHED
    | CLONE_CHILD_SETTID;

/// A clone without CLONE_THREAD: a new process.
pub fn clone_process(ctx: &mut Ctx, flags: u64, stack: u64, parent_tid: u64, child_tid: u64, tls: u64) -> SysResult {
    if flags & !PROCESS_FLAGS != 0 || (flags & CLONE_VM != 0 && flags & CLONE_VFORK == 0) {
        return Err(Errno::EINVAL);
    }
    if flags & CLONE_SETTLS != 0 && tls >= 1 << 47 {
        return Err(Errno::EPERM);
    }
    if flags & CLONE_PARENT_SETTID != 0 {
        ctx.user_range_mut(parent_tid, 4)?;
    }
    if flags & CLONE_CHILD_SETTID != 0 {
        ctx.user_range_mut(child_tid, 4)?;
    }
    if stack != 0 {
        ctx.user_range(stack.saturating_sub(8), 8)?;
    }
    // File mappings kept from an earlier exec become shared again, so the child shares them.
    super::sys_mm::reshare_files(ctx)?;
    let pid = ctx.kernel.procs.spawn(ctx.proc.pid)?;
    if flags & CLONE_PARENT_SETTID != 0 {
        ctx.write_bytes(parent_tid, &pid.to_le_bytes())?;
    }
    ctx.effect = Some(Effect::Fork(ForkSpec {
        pid,
        stack,
        set_tid: (flags & CLONE_CHILD_SETTID != 0).then_some(child_tid),
        clear_tid: (flags & CLONE_CHILD_CLEARTID != 0).then_some(child_tid),
        tls: (flags & CLONE_SETTLS != 0).then_some(tls),
    }));
    Ok(pid as u64)
}

pub fn fork(ctx: &mut Ctx, _: &Args) -> SysResult {
    clone_process(ctx, 0, 0, 0, 0, 0)
}

/// vfork: a fork (the child has its own copy of memory; the parent is not suspended).
pub fn vfork(ctx: &mut Ctx, _: &Args) -> SysResult {
    clone_process(ctx, 0, 0, 0, 0, 0)
}

// ----- ids, groups, sessions -------------------------------------------------

pub fn getpid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.proc.pid as u64)
}

pub fn getppid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.kernel.procs.get(ctx.proc.pid).map_or(1, |e| e.ppid) as u64)
}

fn target(ctx: &Ctx, pid: u64) -> Result<u32, Errno> {
    match pid as i32 {
        0 => Ok(ctx.proc.pid),
        p if p > 0 => Ok(p as u32),
        _ => Err(Errno::EINVAL),
    }
}

pub fn getpgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let pid = target(ctx, a[0]).map_err(|_| Errno::ESRCH)?;
    Ok(ctx.kernel.procs.get(pid).ok_or(Errno::ESRCH)?.pgid as u64)
}

pub fn getpgrp(ctx: &mut Ctx, _: &Args) -> SysResult {
    getpgid(ctx, &[0; 6])
}

pub fn getsid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let pid = target(ctx, a[0]).map_err(|_| Errno::ESRCH)?;
    Ok(ctx.kernel.procs.get(pid).ok_or(Errno::ESRCH)?.sid as u64)
}

pub fn setpgid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let pid = target(ctx, a[0])?;
    let pgid = match a[1] as i32 {
        0 => pid,
        g if g > 0 => g as u32,
        _ => return Err(Errno::EINVAL),
    };
    ctx.kernel.procs.setpgid(ctx.proc.pid, pid, pgid)?;
    Ok(0)
}

pub fn setsid(ctx: &mut Ctx, _: &Args) -> SysResult {
    Ok(ctx.kernel.procs.setsid(ctx.proc.pid)? as u64)
}

// ----- wait4 / waitid --------------------------------------------------------

const WNOHANG: u64 = 1;
const WUNTRACED: u64 = 2;
const WEXITED: u64 = 4;
const WCONTINUED: u64 = 8;
const WNOWAIT: u64 = 0x0100_0000;
const WALL: u64 = 0x4000_0000;
const WCLONE: u64 = 0x8000_0000;
const WNOTHREAD: u64 = 0x2000_0000;

pub fn wait4(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (pid, status, options, rusage) = (a[0] as i32, a[1], a[2], a[3]);
    if options & !(WNOHANG | WUNTRACED | WCONTINUED | WALL | WCLONE | WNOTHREAD) != 0 {
        return Err(Errno::EINVAL);
    }
    let me = ctx.proc.pid;
    let which = match pid {
        -1 => Which::Any,
        0 => Which::Group(ctx.kernel.procs.get(me).map_or(me, |e| e.pgid)),
        p if p > 0 => Which::Pid(p as u32),
        p => Which::Group(p.checked_neg().ok_or(Errno::ECHILD)? as u32),
    };
    match ctx.kernel.procs.find_zombie(me, which)? {
        Some((child, how)) => {
            if status != 0 {
                ctx.write_i32(status, how.status())?;
            }
            if rusage != 0 {
                ctx.write_bytes(rusage, &[0u8; 144])?;
            }
            ctx.kernel.procs.reap(child);
            Ok(child as u64)
        }
        None if options & WNOHANG != 0 => Ok(0),
        None => ctx.block(Block::new(WaitOn::Child)),
    }
}

pub fn waitid(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (idtype, id, infop, options) = (a[0], a[1] as u32, a[2], a[3]);
    if options & !(WNOHANG | WUNTRACED | WEXITED | WCONTINUED | WNOWAIT | WALL | WCLONE | WNOTHREAD) != 0
        || options & (WEXITED | WUNTRACED | WCONTINUED) == 0
    {
        return Err(Errno::EINVAL);
    }
    let me = ctx.proc.pid;
    let which = match idtype {
        0 => Which::Any,
        1 if id > 0 => Which::Pid(id),
        2 => Which::Group(if id == 0 { ctx.kernel.procs.get(me).map_or(me, |e| e.pgid) } else { id }),
        _ => return Err(Errno::EINVAL),
    };
    if options & WEXITED == 0 {
        // Only stop/continue events asked for: there are none here.
        ctx.kernel.procs.find_zombie(me, which)?;
        if options & WNOHANG != 0 {
            if infop != 0 {
                ctx.write_bytes(infop, &[0u8; 128])?;
            }
            return Ok(0);
        }
        return ctx.block(Block::new(WaitOn::Child));
    }
    match ctx.kernel.procs.find_zombie(me, which)? {
        Some((child, how)) => {
            if infop != 0 {
                let (code, st) = how.siginfo();
                let mut b = [0u8; 128];
                b[0..4].copy_from_slice(&crate::procs::SIGCHLD.to_le_bytes());
                b[8..12].copy_from_slice(&code.to_le_bytes());
                b[16..20].copy_from_slice(&(child as i32).to_le_bytes());
                b[24..28].copy_from_slice(&st.to_le_bytes());
                ctx.write_bytes(infop, &b)?;
            }
            if options & WNOWAIT == 0 {
                ctx.kernel.procs.reap(child);
            }
            Ok(0)
        }
        None if options & WNOHANG != 0 => {
            if infop != 0 {
                ctx.write_bytes(infop, &[0u8; 128])?;
            }
            Ok(0)
        }
        None => ctx.block(Block::new(WaitOn::Child)),
    }
}

// ----- execve ----------------------------------------------------------------

/// argv + envp together, as Linux bounds them (MAX_ARG_STRLEN-ish); the loader
/// puts them on a 256 KiB budget of the stack.
const ARG_BYTES: usize = 256 << 10;
const ARG_COUNT: usize = 8192;
/// One argument or environment string, with its NUL (Linux's MAX_ARG_STRLEN:
/// `sh -c` scripts of tens of KiB are common).
const ARG_STRLEN: usize = 32 * 4096;
/// Nested `#!` interpreters, as Linux (BINPRM_MAX_RECURSION).
const MAX_INTERP: usize = 4;

/// A NULL-terminated array of strings from the guest.
fn strings(ctx: &Ctx, mut at: u64, budget: &mut usize) -> Result<Vec<Vec<u8>>, Errno> {
    let mut out = Vec::new();
    if at == 0 {
        return Ok(out);
    }
    loop {
        let p = ctx.read_u64(at)?;
        if p == 0 {
            return Ok(out);
        }
        if out.len() >= ARG_COUNT {
            return Err(Errno::E2BIG);
        }
        let s = ctx.c_string(p, ARG_STRLEN).map_err(|e| if e == Errno::ENAMETOOLONG { Errno::E2BIG } else { e })?;
        *budget = budget.checked_sub(s.len() + 1).ok_or(Errno::E2BIG)?;
        out.push(s);
        at = at.checked_add(8).ok_or(Errno::EFAULT)?;
    }
}

fn do_exec(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, argv: u64, envp: u64, flags: u64) -> SysResult {
    const AT_EMPTY_PATH: u64 = 0x1000;
    const AT_SYMLINK_NOFOLLOW: u64 = 0x100;
    if flags & !(AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0 {
        return Err(Errno::EINVAL);
    }
    let path = ctx.path(path_ptr)?;
    let mut budget = ARG_BYTES;
    let mut argv = strings(ctx, argv, &mut budget)?;
    let envp = strings(ctx, envp, &mut budget)?;
    let (mut ino, mut file) = if path.is_empty() {
        if flags & AT_EMPTY_PATH == 0 {
            return Err(Errno::ENOENT);
        }
        // fexecve: the file open on `dirfd` itself. Its name is /dev/fd/N, as
        // Linux gives it (a `#!` script sees that name as its argument, and
        // cannot be run so if the fd closes on exec: ENOENT, as Linux).
        let fd = i32::try_from(dirfd).map_err(|_| Errno::EBADF)?;
        let ino = match ctx.proc.fds.get(fd)?.kind {
            FileKind::Node(ino) => ino,
            _ => return Err(Errno::EACCES),
        };
        (ino, format!("/dev/fd/{fd}"))
    } else {
        let start = ctx.dir_start(dirfd, &path)?;
        (ctx.proc.vfs.resolve(start, &path, flags & AT_SYMLINK_NOFOLLOW == 0)?, absolute(ctx, start, &path)?)
    };
    for depth in 0..=MAX_INTERP {
        let st = ctx.proc.vfs.stat(ino)?;
        match st.kind {
            FileType::Dir => return Err(Errno::EACCES),
            FileType::File => {}
            FileType::Symlink => return Err(Errno::ELOOP),
            _ => return Err(Errno::EACCES),
        }
        if st.perm & 0o111 == 0 {
            return Err(Errno::EACCES);
        }
        let bytes = ctx.proc.vfs.file_bytes(ino)?;
        if bytes.starts_with(b"\x7fELF") {
            if argv.is_empty() {
                // As Linux 6.x: an empty argv gets "" as argv[0].
                argv.push(Vec::new());
            }
            ctx.effect = Some(Effect::Exec(Box::new(ExecSpec { path: file, ino, argv, envp })));
            return Ok(0);
        }
        if !bytes.starts_with(b"#!") || depth == MAX_INTERP {
            return Err(if depth == MAX_INTERP { Errno::ELOOP } else { Errno::ENOEXEC });
        }
        // "#!interpreter [one argument]", on the first line (at most 255 bytes, as Linux).
        let line = &bytes[2..bytes.len().min(256)];
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let (interp, arg) = shebang(line);
        if interp.is_empty() {
            return Err(Errno::ENOEXEC);
        }
        if depth == 0 && path.is_empty() && ctx.proc.fds.cloexec(dirfd as i32)? {
            // The interpreter would open /dev/fd/N after the fd is gone.
            return Err(Errno::ENOENT);
        }
        let mut new_argv = vec![interp.to_vec()];
        if let Some(a) = arg {
            new_argv.push(a.to_vec());
        }
        new_argv.push(file.clone().into_bytes());
        new_argv.extend(argv.into_iter().skip(1));
        argv = new_argv;
        budget = budget.checked_sub(interp.len() + file.len() + 2).ok_or(Errno::E2BIG)?;
        let start = ctx.proc.cwd;
        ino = ctx.proc.vfs.resolve(start, interp, true)?;
        file = absolute(ctx, start, interp)?;
    }
    Err(Errno::ELOOP)
}

/// The interpreter and its one optional argument of a `#!` line (the bytes
/// after `#!`, without the newline): blanks around both trimmed, as Linux.
fn shebang(line: &[u8]) -> (&[u8], Option<&[u8]>) {
    let line = trim_blanks(line);
    match line.iter().position(|b| *b == b' ' || *b == b'\t') {
        Some(i) => {
            let arg = trim_blanks(&line[i..]);
            (&line[..i], (!arg.is_empty()).then_some(arg))
        }
        None => (line, None),
    }
}

/// `s` without leading and trailing spaces, tabs and carriage returns.
fn trim_blanks(s: &[u8]) -> &[u8] {
    let blank = |b: &u8| matches!(b, b' ' | b'\t' | b'\r');
    let start = s.iter().position(|b| !blank(b)).unwrap_or(s.len());
    let end = s.iter().rposition(|b| !blank(b)).map_or(start, |e| e + 1);
    &s[start..end.max(start)]
}

/// `path` from directory `start` as an absolute path (the loader resolves from the root).
fn absolute(ctx: &Ctx, start: crate::vfs::Ino, path: &[u8]) -> Result<String, Errno> {
    let mut p = Vec::new();
    if path.first() != Some(&b'/') {
        p = ctx.proc.vfs.dir_path(start)?;
        if p.last() != Some(&b'/') {
            p.push(b'/');
        }
    }
    p.extend_from_slice(path);
    String::from_utf8(p).map_err(|_| Errno::ENOENT)
}

pub fn execve(ctx: &mut Ctx, a: &Args) -> SysResult {
    do_exec(ctx, libc::AT_FDCWD as u64, a[0], a[1], a[2], 0)
}

pub fn execveat(ctx: &mut Ctx, a: &Args) -> SysResult {
    do_exec(ctx, a[0], a[1], a[2], a[3], a[4])
}

#[cfg(test)]
mod tests {
    use super::shebang;

    #[test]
    fn shebang_lines_are_bytes_with_one_argument() {
        assert_eq!(shebang(b"/bin/sh"), (&b"/bin/sh"[..], None));
        assert_eq!(shebang(b" \t/usr/bin/env  python3 -u \r"), (&b"/usr/bin/env"[..], Some(&b"python3 -u"[..])));
        // Not UTF-8: passed on as it is (it was replaced by U+FFFD before).
        assert_eq!(shebang(b"/bin/t\xff \xfe"), (&b"/bin/t\xff"[..], Some(&b"\xfe"[..])));
        assert_eq!(shebang(b"   "), (&b""[..], None));
        assert_eq!(shebang(b"/x \t "), (&b"/x"[..], None));
    }
}
