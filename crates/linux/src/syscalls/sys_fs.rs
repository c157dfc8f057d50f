//! Path-based file-system calls: open, stat family, access, readlink, getcwd,
//! chdir, mkdir, rmdir, unlink, rename, symlink, truncate, chmod, utimensat, statfs.
//! Every path is resolved inside the guest's VFS; none ever reaches the host.

use zerocopy::IntoBytes;

use crate::abi;
use crate::errno::{Errno, SysResult};
use crate::fd::FileKind;
use crate::kernel::block::{Block, WaitOn};
use crate::kernel::{Args, Ctx};
use crate::vfs::{FileType, Ino, Stat};

const AT_FDCWD: u64 = libc::AT_FDCWD as u32 as u64;

/// Start directory and path for an *at() call.
fn at(ctx: &mut Ctx, dirfd: u64, path_ptr: u64) -> Result<(Ino, Vec<u8>), Errno> {
    let path = ctx.path(path_ptr)?;
    super::procfs::refresh_for(ctx, &path);
    let start = ctx.dir_start(dirfd, &path)?;
    Ok((start, path))
}

fn open_common(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, flags: i32, mode: u32) -> SysResult {
    let (start, path) = at(ctx, dirfd, path_ptr)?;
    if flags & libc::O_PATH == 0 {
        if let Some(fd) = fd_named(ctx, start, &path, flags) {
            return reopen(ctx, fd, flags);
        }
    }
    if let Some(index) = pts_index(&path) {
        if flags & libc::O_PATH == 0 {
            let master = crate::file::pty::master_of_index(ctx, index)?;
            return crate::file::pty::open_slave(ctx, master, open_flags(flags));
        }
    }
    let mode = mode & !ctx.proc.umask & 0o7777;
    let ino = ctx.proc.vfs.open(start, &path, flags, mode)?;
    if flags & libc::O_PATH == 0 {
        use crate::vfs::DevKind;
        match ctx.proc.vfs.device(ino) {
            Ok(Some(DevKind::Ptmx)) => {
                ctx.proc.vfs.release(ino);
                return crate::file::pty::open_master(ctx, open_flags(flags));
            }
            Ok(Some(DevKind::Tty)) => {
                ctx.proc.vfs.release(ino);
                let master = crate::file::pty::controlling_master(ctx)?;
                return crate::file::pty::open_slave(ctx, master, open_flags(flags) | libc::O_NOCTTY);
            }
            _ => {}
        }
    }
    let keep = flags
        & (libc::O_ACCMODE | libc::O_APPEND | libc::O_NONBLOCK | libc::O_PATH | libc::O_CLOEXEC | libc::O_DIRECTORY);
    if flags & libc::O_PATH == 0 && ctx.proc.vfs.stat(ino).map(|s| s.kind) == Ok(FileType::Fifo) {
        ctx.proc.vfs.release(ino);
        return open_fifo(ctx, ino, keep);
    }
    match ctx.proc.fds.open(FileKind::Node(ino), keep) {
        Ok(fd) => Ok(fd as u64),
        Err(e) => {
            ctx.proc.vfs.release(ino);
            Err(e)
        }
    }
}

/// The flags a terminal's description keeps (O_NOCTTY only matters to the open).
fn open_flags(flags: i32) -> i32 {
    flags & (libc::O_ACCMODE | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
}

/// N of `/dev/pts/N`: pty slaves are found by number, not in the VFS.
fn pts_index(path: &[u8]) -> Option<u32> {
    let n = path.strip_prefix(b"/dev/pts/")?;
    if n.is_empty() || n.len() > 4 || !n.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(n).ok()?.parse().ok()
}

/// The fd that `path` names as `/dev/fd/N`, `/proc/self/fd/N` or `/proc/<own pid>/fd/N`: on
/// Linux these are magic links, and opening one opens what the fd refers to (bash's process
/// substitution `<(cmd)` hands a program `/dev/fd/63`, the read end of a pipe).
fn fd_link(pid: u32, path: &[u8]) -> Option<i32> {
    let n = match path.strip_prefix(b"/dev/fd/") {
        Some(n) => n,
        None => {
            let rest = path.strip_prefix(b"/proc/")?;
            let slash = rest.iter().position(|&c| c == b'/')?;
            let (who, tail) = rest.split_at(slash);
            if who != b"self" && who != pid.to_string().as_bytes() {
                return None;
            }
            tail.strip_prefix(b"/fd/")?
        }
    };
    if n.is_empty() || n.len() > 9 || !n.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(n).ok()?.parse().ok()
}

/// The fd `path` opens through a magic link: named as one (`fd_link`), or, under /dev/,
/// through symlinks to one (/dev/stdin -> /proc/self/fd/0, as udev makes them; absolute
/// targets only, at most MAX_SYMLINKS). A VFS made before /dev had these links (a template's)
/// lacks them: there /dev/stdin, /dev/stdout and /dev/stderr name fds 0, 1 and 2 still.
fn fd_named(ctx: &Ctx, start: Ino, path: &[u8], flags: i32) -> Option<i32> {
    if let Some(fd) = fd_link(ctx.proc.pid, path) {
        return Some(fd);
    }
    if !path.starts_with(b"/dev/") || flags & libc::O_NOFOLLOW != 0 {
        return None;
    }
    let mut at = path.to_vec();
    for _ in 0..crate::vfs::MAX_SYMLINKS {
        let ino = match ctx.proc.vfs.resolve(start, &at, false) {
            Ok(ino) => ino,
            Err(Errno::ENOENT) => {
                let std = [&b"/dev/stdin"[..], b"/dev/stdout", b"/dev/stderr"];
                return std.iter().position(|s| *s == at).map(|i| i as i32);
            }
            Err(_) => return None,
        };
        let target = ctx.proc.vfs.readlink_ino(ino).ok()?;
        if let Some(fd) = fd_link(ctx.proc.pid, &target) {
            return Some(fd);
        }
        if target.first() != Some(&b'/') {
            return None;
        }
        at = target;
    }
    None
}

/// Open what `fd` refers to, as opening its `/proc/self/fd` link does on Linux: a new
/// description of the same pipe or file (its own offset and flags); stdio (host-side) is
/// duplicated; sockets, the agent channel and other objects are ENXIO.
fn reopen(ctx: &mut Ctx, fd: i32, flags: i32) -> SysResult {
    use crate::objects::ObjKind;
    let kind = ctx.proc.fds.get(fd).map_err(|_| Errno::ENOENT)?.kind;
    let keep = flags & (libc::O_ACCMODE | libc::O_APPEND | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_DIRECTORY);
    match kind {
        FileKind::Object(id) => match ctx.proc.fds.objects.get(id)?.kind {
            ObjKind::Pipe(_) => {
                if flags & libc::O_DIRECTORY != 0 {
                    return Err(Errno::ENOTDIR);
                }
                Ok(ctx.proc.fds.open_object(id, keep)? as u64)
            }
            _ => Err(Errno::ENXIO),
        },
        FileKind::Node(ino) => {
            let st = ctx.proc.vfs.stat(ino)?;
            let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
            if st.kind == FileType::Dir && writes {
                return Err(Errno::EISDIR);
            }
            if st.kind != FileType::Dir && flags & libc::O_DIRECTORY != 0 {
                return Err(Errno::ENOTDIR);
            }
            if writes && flags & libc::O_TRUNC != 0 && st.kind == FileType::File {
                ctx.proc.vfs.truncate(ino, 0)?;
            }
            ctx.proc.vfs.hold(ino);
            ctx.proc.fds.open(FileKind::Node(ino), keep).map(|fd| fd as u64).inspect_err(|_| ctx.proc.vfs.release(ino))
        }
        FileKind::Socket(_) | FileKind::Agent => Err(Errno::ENXIO),
        FileKind::Stdin | FileKind::Stdout | FileKind::Stderr => {
            Ok(ctx.proc.fds.dup(fd, 0, flags & libc::O_CLOEXEC != 0)? as u64)
        }
    }
}

/// Open a FIFO: a description of the pipe the inode stands for (created by
/// its first opener). As Linux: a blocking open for reading waits for a
/// writer and one for writing waits for a reader; a non-blocking open for
/// writing with no reader is ENXIO; O_RDWR never waits.
fn open_fifo(ctx: &mut Ctx, ino: Ino, flags: i32) -> SysResult {
    use crate::objects::ObjKind;
    let acc = flags & libc::O_ACCMODE;
    let existing = ctx.proc.fds.objects.fifos.get(&ino).copied();
    let (readers, writers) = match existing.map(|id| ctx.proc.fds.objects.get(id).map(|o| &o.kind)) {
        Some(Ok(ObjKind::Pipe(p))) => (p.readers, p.writers),
        _ => (0, 0),
    };
    let nonblock = flags & libc::O_NONBLOCK != 0;
    match acc {
        libc::O_WRONLY if readers == 0 && nonblock => return Err(Errno::ENXIO),
        libc::O_WRONLY if readers == 0 => return ctx.block(Block::new(WaitOn::Fds(Vec::new()))),
        libc::O_RDONLY if writers == 0 && !nonblock => return ctx.block(Block::new(WaitOn::Fds(Vec::new()))),
        _ => {}
    }
    let id = match existing {
        Some(id) => id,
        None => {
            let id = ctx.proc.fds.objects.new_pipe(Some(ino));
            ctx.proc.fds.objects.fifos.insert(ino, id);
            id
        }
    };
    Ok(ctx.proc.fds.open_object(id, flags)? as u64)
}

pub fn open(ctx: &mut Ctx, a: &Args) -> SysResult {
    open_common(ctx, AT_FDCWD, a[0], a[1] as i32, a[2] as u32)
}

pub fn openat(ctx: &mut Ctx, a: &Args) -> SysResult {
    open_common(ctx, a[0], a[1], a[2] as i32, a[3] as u32)
}

pub fn creat(ctx: &mut Ctx, a: &Args) -> SysResult {
    open_common(ctx, AT_FDCWD, a[0], libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, a[1] as u32)
}

/// Metadata of what an fd refers to (stdio and the agent channel look like pipes).
fn fd_stat(ctx: &Ctx, fd: i32) -> Result<Stat, Errno> {
    let (f, ops) = crate::file::open(ctx, fd)?;
    ops.stat(ctx, &f)
}

/// Linux x86-64 `struct stat` for `st` (ctime is the mtime).
fn encode_stat(st: &Stat) -> abi::Stat {
    let (sec, nsec) = st.mtime();
    let (asec, ansec) = st.atime();
    abi::Stat {
        dev: 1,
        ino: st.ino,
        nlink: st.nlink as u64,
        mode: st.mode(),
        uid: st.uid,
        gid: st.gid,
        rdev: st.rdev,
        size: st.size as i64,
        blksize: 4096,
        blocks: st.size.div_ceil(512) as i64,
        atime: asec,
        atime_nsec: ansec,
        mtime: sec,
        mtime_nsec: nsec,
        ctime: sec,
        ctime_nsec: nsec,
        ..Default::default()
    }
}

fn stat_path(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, flags: i32) -> Result<Stat, Errno> {
    let path = ctx.path(path_ptr)?;
    super::procfs::refresh_for(ctx, &path);
    if path.is_empty() {
        if flags & libc::AT_EMPTY_PATH != 0 {
            return if dirfd == AT_FDCWD { ctx.proc.vfs.stat(ctx.proc.cwd) } else { fd_stat(ctx, dirfd as i32) };
        }
        return Err(Errno::ENOENT);
    }
    if let Some(index) = pts_index(&path) {
        // As an open slave's fstat says (ttyname compares the two).
        ctx.proc.fds.objects.ptys().find(|(_, p)| p.index == index).ok_or(Errno::ENOENT)?;
        return Ok(crate::file::pty::slave_stat(index));
    }
    let start = ctx.dir_start(dirfd, &path)?;
    let ino = ctx.proc.vfs.resolve(start, &path, flags & libc::AT_SYMLINK_NOFOLLOW == 0)?;
    ctx.proc.vfs.stat(ino)
}

pub fn stat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let st = stat_path(ctx, AT_FDCWD, a[0], 0)?;
    ctx.write_bytes(a[1], encode_stat(&st).as_bytes())?;
    Ok(0)
}

pub fn lstat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let st = stat_path(ctx, AT_FDCWD, a[0], libc::AT_SYMLINK_NOFOLLOW)?;
    ctx.write_bytes(a[1], encode_stat(&st).as_bytes())?;
    Ok(0)
}

pub fn fstat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let st = fd_stat(ctx, a[0] as i32)?;
    ctx.write_bytes(a[1], encode_stat(&st).as_bytes())?;
    Ok(0)
}

pub fn newfstatat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let st = stat_path(ctx, a[0], a[1], a[3] as i32)?;
    ctx.write_bytes(a[2], encode_stat(&st).as_bytes())?;
    Ok(0)
}

pub fn statx(ctx: &mut Ctx, a: &Args) -> SysResult {
    let st = stat_path(ctx, a[0], a[1], a[2] as i32)?;
    let mut b = [0u8; 256];
    let (sec, nsec) = st.mtime();
    let (asec, ansec) = st.atime();
    let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
    put(0, &0x7FFu32.to_le_bytes()); // STATX_BASIC_STATS
    put(4, &4096u32.to_le_bytes());
    put(16, &st.nlink.to_le_bytes());
    put(20, &st.uid.to_le_bytes());
    put(24, &st.gid.to_le_bytes());
    put(28, &(st.mode() as u16).to_le_bytes());
    put(32, &st.ino.to_le_bytes());
    put(40, &st.size.to_le_bytes());
    put(48, &st.size.div_ceil(512).to_le_bytes());
    put(0x40, &asec.to_le_bytes());
    put(0x48, &(ansec as u32).to_le_bytes());
    for off in [0x50, 0x60, 0x70] {
        put(off, &sec.to_le_bytes());
        put(off + 8, &(nsec as u32).to_le_bytes());
    }
    put(0x80, &((st.rdev >> 8) as u32).to_le_bytes());
    put(0x84, &((st.rdev & 0xFF) as u32).to_le_bytes());
    ctx.write_bytes(a[4], &b)?;
    Ok(0)
}

fn access_common(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, mode: i32, flags: i32) -> SysResult {
    if mode & !(libc::R_OK | libc::W_OK | libc::X_OK) != 0 {
        return Err(Errno::EINVAL);
    }
    let (start, path) = at(ctx, dirfd, path_ptr)?;
    ctx.proc.vfs.access(start, &path, mode, flags & libc::AT_SYMLINK_NOFOLLOW == 0)?;
    Ok(0)
}

pub fn access(ctx: &mut Ctx, a: &Args) -> SysResult {
    access_common(ctx, AT_FDCWD, a[0], a[1] as i32, 0)
}

pub fn faccessat(ctx: &mut Ctx, a: &Args) -> SysResult {
    access_common(ctx, a[0], a[1], a[2] as i32, 0)
}

pub fn faccessat2(ctx: &mut Ctx, a: &Args) -> SysResult {
    access_common(ctx, a[0], a[1], a[2] as i32, a[3] as i32)
}

fn readlink_common(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, buf: u64, size: u64) -> SysResult {
    if size as i64 <= 0 {
        return Err(Errno::EINVAL);
    }
    let (start, path) = at(ctx, dirfd, path_ptr)?;
    let target = ctx.proc.vfs.readlink(start, &path)?;
    let n = target.len().min(size as usize);
    ctx.write_bytes(buf, &target[..n])?;
    Ok(n as u64)
}

pub fn readlink(ctx: &mut Ctx, a: &Args) -> SysResult {
    readlink_common(ctx, AT_FDCWD, a[0], a[1], a[2])
}

pub fn readlinkat(ctx: &mut Ctx, a: &Args) -> SysResult {
    readlink_common(ctx, a[0], a[1], a[2], a[3])
}

pub fn getcwd(ctx: &mut Ctx, a: &Args) -> SysResult {
    let mut p = ctx.proc.vfs.dir_path(ctx.proc.cwd)?;
    p.push(0);
    if (p.len() as u64) > a[1] {
        return Err(Errno::ERANGE);
    }
    ctx.write_bytes(a[0], &p)?;
    Ok(p.len() as u64)
}

fn change_dir(ctx: &mut Ctx, ino: Ino) -> SysResult {
    if ctx.proc.vfs.stat(ino)?.kind != FileType::Dir {
        return Err(Errno::ENOTDIR);
    }
    ctx.proc.vfs.hold(ino);
    let old = std::mem::replace(&mut ctx.proc.cwd, ino);
    ctx.proc.vfs.release(old);
    Ok(0)
}

pub fn chdir(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    change_dir(ctx, ino)
}

pub fn fchdir(ctx: &mut Ctx, a: &Args) -> SysResult {
    match ctx.proc.fds.get(a[0] as i32)?.kind {
        FileKind::Node(ino) => change_dir(ctx, ino),
        _ => Err(Errno::ENOTDIR),
    }
}

pub fn mkdir(ctx: &mut Ctx, a: &Args) -> SysResult {
    mkdir_common(ctx, AT_FDCWD, a[0], a[1] as u32)
}

pub fn mkdirat(ctx: &mut Ctx, a: &Args) -> SysResult {
    mkdir_common(ctx, a[0], a[1], a[2] as u32)
}

fn mkdir_common(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, mode: u32) -> SysResult {
    let (start, path) = at(ctx, dirfd, path_ptr)?;
    let mode = mode & !ctx.proc.umask & 0o7777;
    ctx.proc.vfs.mkdir(start, &path, mode)?;
    Ok(0)
}

pub fn rmdir(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    ctx.proc.vfs.rmdir(start, &path)?;
    Ok(0)
}

pub fn unlink(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    ctx.proc.vfs.unlink(start, &path)?;
    Ok(0)
}

pub fn unlinkat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[2] as i32;
    if flags & !libc::AT_REMOVEDIR != 0 {
        return Err(Errno::EINVAL);
    }
    let (start, path) = at(ctx, a[0], a[1])?;
    if flags & libc::AT_REMOVEDIR != 0 {
        ctx.proc.vfs.rmdir(start, &path)?;
    } else {
        ctx.proc.vfs.unlink(start, &path)?;
    }
    Ok(0)
}

fn rename_common(ctx: &mut Ctx, olddir: u64, old: u64, newdir: u64, new: u64, flags: u32) -> SysResult {
    let (os, op) = at(ctx, olddir, old)?;
    let (ns, np) = at(ctx, newdir, new)?;
    ctx.proc.vfs.rename(os, &op, ns, &np, flags)?;
    Ok(0)
}

pub fn rename(ctx: &mut Ctx, a: &Args) -> SysResult {
    rename_common(ctx, AT_FDCWD, a[0], AT_FDCWD, a[1], 0)
}

pub fn renameat(ctx: &mut Ctx, a: &Args) -> SysResult {
    rename_common(ctx, a[0], a[1], a[2], a[3], 0)
}

pub fn renameat2(ctx: &mut Ctx, a: &Args) -> SysResult {
    rename_common(ctx, a[0], a[1], a[2], a[3], a[4] as u32)
}

pub fn symlink(ctx: &mut Ctx, a: &Args) -> SysResult {
    let target = ctx.path(a[0])?;
    let (start, path) = at(ctx, AT_FDCWD, a[1])?;
    ctx.proc.vfs.symlink(&target, start, &path)?;
    Ok(0)
}

pub fn symlinkat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let target = ctx.path(a[0])?;
    let (start, path) = at(ctx, a[1], a[2])?;
    ctx.proc.vfs.symlink(&target, start, &path)?;
    Ok(0)
}

pub fn link(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (os, op) = at(ctx, libc::AT_FDCWD as u32 as u64, a[0])?;
    let (ns, np) = at(ctx, libc::AT_FDCWD as u32 as u64, a[1])?;
    ctx.proc.vfs.link(os, &op, ns, &np, false)?;
    Ok(0)
}

pub fn linkat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[4] as i32;
    if flags & !libc::AT_SYMLINK_FOLLOW != 0 {
        return Err(Errno::EINVAL);
    }
    let (os, op) = at(ctx, a[0], a[1])?;
    let (ns, np) = at(ctx, a[2], a[3])?;
    ctx.proc.vfs.link(os, &op, ns, &np, flags & libc::AT_SYMLINK_FOLLOW != 0)?;
    Ok(0)
}

pub fn truncate(ctx: &mut Ctx, a: &Args) -> SysResult {
    if (a[1] as i64) < 0 {
        return Err(Errno::EINVAL);
    }
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    ctx.proc.vfs.truncate(ino, a[1])?;
    Ok(0)
}

pub fn chmod(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    ctx.proc.vfs.chmod(ino, a[1] as u32 & 0o7777)?;
    Ok(0)
}

pub fn fchmod(ctx: &mut Ctx, a: &Args) -> SysResult {
    match ctx.proc.fds.get(a[0] as i32)?.kind {
        FileKind::Node(ino) => ctx.proc.vfs.chmod(ino, a[1] as u32 & 0o7777).map(|_| 0),
        _ => Ok(0),
    }
}

pub fn fchmodat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, a[0], a[1])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    ctx.proc.vfs.chmod(ino, a[2] as u32 & 0o7777)?;
    Ok(0)
}

/// chown family, with Linux's rules (`chown_common`, `chown_ok`,
/// `chgrp_ok`): -1 keeps an id; a privileged caller (CAP_CHOWN: euid 0 in
/// the sandbox's model, `crate::creds`) sets any ids; another may only
/// "change" the user to the file's own, and the group of a file it owns (by
/// its fs uid) to its fs gid or one of its supplementary groups: EPERM
/// otherwise.
fn chown_ino(ctx: &mut Ctx, ino: Ino, uid: u64, gid: u64) -> SysResult {
    let id = |v: u64| Some(v as u32).filter(|&v| v != crate::creds::KEEP);
    let (uid, gid) = (id(uid), id(gid));
    let c = &ctx.proc.creds;
    if !c.privileged() {
        let (owner, group) = ctx.proc.vfs.owner(ino);
        let user_ok = uid.is_none_or(|u| u == owner && c.uid.fs == owner);
        let group_ok = gid.is_none_or(|g| c.uid.fs == owner && (g == group || g == c.gid.fs || c.groups.contains(&g)));
        if !user_ok || !group_ok {
            return Err(Errno::EPERM);
        }
    }
    ctx.proc.vfs.chown(ino, uid, gid)?;
    Ok(0)
}

pub fn chown(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    chown_ino(ctx, ino, a[1], a[2])
}

pub fn lchown(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, false)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    chown_ino(ctx, ino, a[1], a[2])
}

pub fn fchownat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[4] as i32;
    if flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return Err(Errno::EINVAL);
    }
    let path = ctx.path(a[1])?;
    if path.is_empty() && flags & libc::AT_EMPTY_PATH != 0 {
        if a[0] as i32 == libc::AT_FDCWD {
            let cwd = ctx.proc.cwd;
            return chown_ino(ctx, cwd, a[2], a[3]);
        }
        return fchown(ctx, &[a[0], a[2], a[3], 0, 0, 0]);
    }
    let (start, path) = at(ctx, a[0], a[1])?;
    let ino = ctx.proc.vfs.resolve(start, &path, flags & libc::AT_SYMLINK_NOFOLLOW == 0)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    chown_ino(ctx, ino, a[2], a[3])
}

/// fchown: a file of the file system gets the new owner; a pipe, socket or
/// other object reports 0:0 whatever is asked, so only ids that leave it so
/// (0, -1) are accepted, any other EINVAL (no id to record it with).
pub fn fchown(ctx: &mut Ctx, a: &Args) -> SysResult {
    match ctx.proc.fds.get(a[0] as i32)?.kind {
        FileKind::Node(ino) => chown_ino(ctx, ino, a[1], a[2]),
        _ => {
            let ok = |id: u64| id as u32 == 0 || id as u32 == crate::creds::KEEP;
            if ok(a[1]) && ok(a[2]) {
                Ok(0)
            } else {
                Err(Errno::EINVAL)
            }
        }
    }
}

/// mknod / mknodat: FIFOs (a pipe in the overlay), regular files and socket
/// files. Device nodes are EPERM (no CAP_MKNOD in the sandbox's namespace).
fn mknod_common(ctx: &mut Ctx, dirfd: u64, path_ptr: u64, mode: u32) -> SysResult {
    let (start, path) = at(ctx, dirfd, path_ptr)?;
    let perm = mode & !ctx.proc.umask & 0o7777;
    let kind = match mode & libc::S_IFMT {
        libc::S_IFIFO => FileType::Fifo,
        libc::S_IFSOCK => FileType::Socket,
        0 | libc::S_IFREG => {
            let flags = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY;
            let ino = ctx.proc.vfs.open(start, &path, flags, perm)?;
            ctx.proc.vfs.release(ino);
            return Ok(0);
        }
        libc::S_IFCHR | libc::S_IFBLK => return Err(Errno::EPERM),
        _ => return Err(Errno::EINVAL),
    };
    ctx.proc.vfs.mknod(start, &path, kind, perm)?;
    Ok(0)
}

pub fn mknod(ctx: &mut Ctx, a: &Args) -> SysResult {
    mknod_common(ctx, AT_FDCWD, a[0], a[1] as u32)
}

pub fn mknodat(ctx: &mut Ctx, a: &Args) -> SysResult {
    mknod_common(ctx, a[0], a[1], a[2] as u32)
}

/// memfd_create: an anonymous file in the overlay (charged to the quota like
/// any file), gone with its last descriptor. Sealing is not supported.
pub fn memfd_create(ctx: &mut Ctx, a: &Args) -> SysResult {
    const MFD_CLOEXEC: u32 = 1;
    const MFD_ALLOW_SEALING: u32 = 2;
    let flags = a[1] as u32;
    if flags & !(MFD_CLOEXEC | MFD_ALLOW_SEALING) != 0 {
        return Err(Errno::EINVAL);
    }
    let name = ctx.path(a[0])?;
    if name.len() > 249 || name.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    let shm = ctx.proc.vfs.lookup_abs(b"/dev/shm")?;
    // A unique hidden name, removed at once: only the descriptor holds the file.
    let mut n = 0u64;
    let ino = loop {
        let tmp = format!(".memfd-{n}");
        match ctx.proc.vfs.open(shm, tmp.as_bytes(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) {
            Ok(ino) => {
                ctx.proc.vfs.unlink(shm, tmp.as_bytes())?;
                break ino;
            }
            Err(Errno::EEXIST) if n < 1024 => n += 1,
            Err(e) => return Err(e),
        }
    };
    let cloexec = if flags & MFD_CLOEXEC != 0 { libc::O_CLOEXEC } else { 0 };
    match ctx.proc.fds.open(FileKind::Node(ino), libc::O_RDWR | cloexec) {
        Ok(fd) => Ok(fd as u64),
        Err(e) => {
            ctx.proc.vfs.release(ino);
            Err(e)
        }
    }
}

pub fn utimensat(ctx: &mut Ctx, a: &Args) -> SysResult {
    let flags = a[3] as i32;
    let ino = if a[1] == 0 {
        match ctx.proc.fds.get(a[0] as i32)?.kind {
            FileKind::Node(ino) => ino,
            _ => return Ok(0),
        }
    } else {
        let (start, path) = at(ctx, a[0], a[1])?;
        let ino = ctx.proc.vfs.resolve(start, &path, flags & libc::AT_SYMLINK_NOFOLLOW == 0)?;
        ctx.proc.vfs.note_name(start, &path, ino);
        ino
    };
    let now = now_ns();
    // times[0] is the access time, times[1] the modification time.
    let mut t = [Some(now), Some(now)];
    if a[2] != 0 {
        for (i, slot) in t.iter_mut().enumerate() {
            let sec = ctx.read_i64(a[2] + 16 * i as u64)?;
            let nsec = ctx.read_i64(a[2] + 16 * i as u64 + 8)?;
            *slot = match nsec {
                n if n == libc::UTIME_OMIT => None,
                n if n == libc::UTIME_NOW => Some(now),
                0..=999_999_999 => Some(i128::from(sec) * 1_000_000_000 + i128::from(nsec)),
                _ => return Err(Errno::EINVAL),
            };
        }
    }
    if t == [None, None] {
        return Ok(0);
    }
    ctx.proc.vfs.set_atime_mtime(ino, t[0], t[1])?;
    Ok(0)
}

/// The real-time clock in nanoseconds (file times are kept so).
fn now_ns() -> i128 {
    let (now_s, now_ns) = super::sys_time::realtime();
    i128::from(now_s) * 1_000_000_000 + i128::from(now_ns)
}

/// utimes/futimesat: `struct timeval[2]` (access, modification), NULL for now;
/// microseconds outside 0..1,000,000 are EINVAL.
fn set_timevals(ctx: &mut Ctx, dirfd: u64, path: u64, times: u64) -> SysResult {
    let (start, path) = at(ctx, dirfd, path)?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    let now = now_ns();
    let mut t = [now, now];
    if times != 0 {
        for (i, slot) in t.iter_mut().enumerate() {
            let sec = ctx.read_i64(times + 16 * i as u64)?;
            let usec = ctx.read_i64(times + 16 * i as u64 + 8)?;
            if !(0..1_000_000).contains(&usec) {
                return Err(Errno::EINVAL);
            }
            *slot = i128::from(sec) * 1_000_000_000 + i128::from(usec) * 1_000;
        }
    }
    ctx.proc.vfs.set_atime_mtime(ino, Some(t[0]), Some(t[1]))?;
    Ok(0)
}

pub fn utimes(ctx: &mut Ctx, a: &Args) -> SysResult {
    set_timevals(ctx, libc::AT_FDCWD as u64, a[0], a[1])
}

pub fn futimesat(ctx: &mut Ctx, a: &Args) -> SysResult {
    set_timevals(ctx, a[0], a[1], a[2])
}

/// utime: `struct utimbuf` (access, modification seconds), NULL for now.
pub fn utime(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, libc::AT_FDCWD as u64, a[0])?;
    let ino = ctx.proc.vfs.resolve(start, &path, true)?;
    ctx.proc.vfs.note_name(start, &path, ino);
    let (atime, mtime) = if a[1] == 0 {
        (now_ns(), now_ns())
    } else {
        (i128::from(ctx.read_i64(a[1])?) * 1_000_000_000, i128::from(ctx.read_i64(a[1] + 8)?) * 1_000_000_000)
    };
    ctx.proc.vfs.set_atime_mtime(ino, Some(atime), Some(mtime))?;
    Ok(0)
}

/// sync: the file system is the sandbox's memory (made durable by
/// checkpoints), so there is nothing to flush.
pub fn sync(_: &mut Ctx, _: &Args) -> SysResult {
    Ok(0)
}

/// syncfs: as sync, for the file system of an open fd (EBADF otherwise).
pub fn syncfs(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.fds.get(a[0] as i32)?;
    Ok(0)
}

/// sync_file_range: nothing to flush (see sync); the arguments are checked as Linux does.
pub fn sync_file_range(ctx: &mut Ctx, a: &Args) -> SysResult {
    const VALID: u64 =
        (libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER) as u64;
    let (off, len) = (a[1] as i64, a[2] as i64);
    if a[3] & !VALID != 0 || off < 0 || len < 0 || off.checked_add(len).is_none() {
        return Err(Errno::EINVAL);
    }
    match ctx.proc.fds.get(a[0] as i32)?.kind {
        FileKind::Node(_) => Ok(0),
        _ => Err(Errno::ESPIPE),
    }
}

pub fn umask(ctx: &mut Ctx, a: &Args) -> SysResult {
    let old = ctx.proc.umask;
    ctx.proc.umask = a[0] as u32 & 0o777;
    Ok(old as u64)
}

/// `struct statfs` of a tmpfs-like file system whose size is the overlay quota.
fn encode_statfs(ctx: &Ctx) -> abi::Statfs {
    let total_blocks = ctx.proc.vfs.quota() / 4096;
    let used = ctx.proc.vfs.overlay_bytes() / 4096;
    let free = total_blocks.saturating_sub(used);
    abi::Statfs {
        fs_type: 0x0102_1994, // TMPFS_MAGIC
        bsize: 4096,
        blocks: total_blocks,
        bfree: free,
        bavail: free,
        files: 1 << 20,
        ffree: 1 << 20,
        namelen: 255,
        frsize: 4096,
        ..Default::default()
    }
}

pub fn statfs(ctx: &mut Ctx, a: &Args) -> SysResult {
    let (start, path) = at(ctx, AT_FDCWD, a[0])?;
    ctx.proc.vfs.resolve(start, &path, true)?;
    let b = encode_statfs(ctx);
    ctx.write_bytes(a[1], b.as_bytes())?;
    Ok(0)
}

pub fn fstatfs(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.fds.get(a[0] as i32)?;
    let b = encode_statfs(ctx);
    ctx.write_bytes(a[1], b.as_bytes())?;
    Ok(0)
}

/// Extended attributes: the file system has none and stores none.
fn xattr_target(ctx: &mut Ctx, path_ptr: u64, follow: bool) -> Result<(), Errno> {
    let (start, path) = at(ctx, AT_FDCWD, path_ptr)?;
    ctx.proc.vfs.resolve(start, &path, follow)?;
    Ok(())
}

/// listxattr, llistxattr: an empty list.
pub fn listxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    xattr_target(ctx, a[0], true).map(|_| 0)
}

pub fn llistxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    xattr_target(ctx, a[0], false).map(|_| 0)
}

pub fn flistxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.fds.get(a[0] as i32)?;
    Ok(0)
}

/// getxattr family: no such attribute.
pub fn getxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    xattr_target(ctx, a[0], true)?;
    Err(Errno::ENODATA)
}

pub fn lgetxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    xattr_target(ctx, a[0], false)?;
    Err(Errno::ENODATA)
}

pub fn fgetxattr(ctx: &mut Ctx, a: &Args) -> SysResult {
    ctx.proc.fds.get(a[0] as i32)?;
    Err(Errno::ENODATA)
}
