//! Open files by kind: one `FileOps` implementation per kind of description
//! (VFS node, stdio, the agent channel, inet socket, pipe, AF_UNIX socket,
//! eventfd, timerfd, epoll, pseudo-terminal, inotify), each in its own module. The fd handlers in
//! `crate::syscalls` find the implementation with [`ops`] and call it.

pub mod agent;
pub mod common;
pub mod counter;
pub mod epoll;
pub mod inet;
pub mod inotify;
pub mod node;
pub mod ops;
pub mod pipe;
pub mod pty;
pub mod stdio;
pub mod unix;

use crate::errno::{Errno, SysResult};
use crate::fd::{FileKind, OpenFile};
use crate::kernel::state::Stream;
use crate::kernel::Ctx;
use crate::objects::{ObjKind, Objects};
use crate::vfs::Stat;
use ops::{FileOps, Open, PollCtx};

/// An fd object that is no longer there (never expected: a description
/// keeps its object alive).
struct GoneFile;

impl FileOps for GoneFile {
    fn read(&self, _: &mut Ctx, _: &Open, _: u64, _: u64, pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EBADF })
    }

    fn write(&self, _: &mut Ctx, _: &Open, _: u64, _: u64, pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EBADF })
    }

    fn write_bytes(&self, _: &mut Ctx, _: &Open, _: &[u8], pos: Option<u64>) -> SysResult {
        Err(if pos.is_some() { Errno::ESPIPE } else { Errno::EBADF })
    }

    fn poll(&self, _: &PollCtx, _: &OpenFile, _: u32) -> u32 {
        libc::POLLNVAL as u32
    }

    fn stat(&self, _: &Ctx, _: &Open) -> Result<Stat, Errno> {
        Err(Errno::EBADF)
    }
}

/// The operations of a description of `kind` (`objects`: the fd table's, for fd objects).
pub fn ops(objects: &Objects, kind: FileKind) -> &'static dyn FileOps {
    match kind {
        FileKind::Node(_) => &node::NodeFile,
        FileKind::Stdin => &stdio::StdinFile,
        FileKind::Stdout => &stdio::OutputFile(Stream::Stdout),
        FileKind::Stderr => &stdio::OutputFile(Stream::Stderr),
        FileKind::Agent => &agent::AgentFile,
        FileKind::Socket(_) => &inet::InetSocketFile,
        FileKind::Object(id) => match objects.get(id).map(|o| &o.kind) {
            Ok(ObjKind::Pipe(_)) => &pipe::PipeFile,
            Ok(ObjKind::Socket(_)) => &unix::UnixSocketFile,
            Ok(ObjKind::EventFd(_)) => &counter::EventFdFile,
            Ok(ObjKind::TimerFd(_)) => &counter::TimerFdFile,
            Ok(ObjKind::Epoll(_)) => &epoll::EpollFile,
            Ok(ObjKind::PtyMaster(_)) => &pty::PtyMasterFile,
            Ok(ObjKind::PtySlave(_)) => &pty::PtySlaveFile,
            Ok(ObjKind::Inotify(_)) => &inotify::InotifyFile,
            Err(_) => &GoneFile,
        },
    }
}

/// The open description behind `fd`, with its operations.
pub fn open(ctx: &Ctx, fd: i32) -> Result<(Open, &'static dyn FileOps), Errno> {
    let file = *ctx.proc.fds.get(fd)?;
    let ofd = ctx.proc.fds.ofd(fd)?;
    Ok((Open { fd, ofd, file }, ops(&ctx.proc.fds.objects, file.kind)))
}

/// Give back what a description closed for good held, and what closed with it
/// (descriptors that were in flight on a socket it destroyed).
pub fn released(ctx: &mut Ctx, kind: Option<FileKind>) {
    let mut objects = matches!(kind, Some(FileKind::Object(_)));
    if let Some(k) = kind {
        release(ctx, k);
    }
    for k in ctx.proc.fds.take_gone() {
        objects |= matches!(k, FileKind::Object(_));
        release(ctx, k);
    }
    // An fd object is released before its kind is known here: an inotify
    // instance that went with it leaves its watches behind until told.
    if objects {
        inotify::forget_closed(ctx);
    }
}

fn release(ctx: &mut Ctx, kind: FileKind) {
    ops(&ctx.proc.fds.objects, kind).release(ctx, kind);
}
