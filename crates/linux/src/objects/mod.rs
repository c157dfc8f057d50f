//! File-descriptor objects the VMM owns: pipes (and FIFOs of the overlay),
//! AF_UNIX sockets, eventfds, epoll instances and timerfds.
//!
//! They live in the process state (`FdTable::objects`) as persistent maps with
//! their buffers behind `Arc`s, so a process clone stays O(1) and a snapshot's
//! state file carries them (a pipe with unread data survives a checkpoint,
//! eviction and fork). An open file description of kind `FileKind::Object(id)`
//! refers to one; the object counts those descriptions and goes away with the
//! last one (a pipe counts its readers and writers apart).
//!
//! Operations never block: they return `EAGAIN` where Linux would wait, and
//! the syscall layer turns that into `EAGAIN` (O_NONBLOCK) or an
//! `Effect::Block` (see `crate::wait`). Every buffer has a fixed capacity, so
//! nothing the guest does makes the VMM allocate without bound.
//!
//! Each kind is a module of its own (`pipe`, `unix`, `eventfd`, `epoll`,
//! `timerfd`, `pty`, `inotify`: its type and the `Objects` calls on it).
//! This module keeps what they share: the table (`Objects`) and its
//! reference counts, the persisted `ObjKind` (its serde form, whose variant
//! order is the state format) and readiness across kinds.

mod epoll;
mod eventfd;
mod inotify;
mod pipe;
mod pty;
mod timerfd;
mod unix;

use std::collections::BTreeMap;

use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::errno::Errno;
use crate::vfs::Ino;

pub use epoll::{Epoll, Watch, EPOLLET, EPOLLONESHOT, EPOLL_MAX_NESTS};
pub use eventfd::EventFd;
pub use inotify::{Inotify, MAX_INOTIFY_INSTANCES};
use pipe::valid_pipe_size;
pub use pipe::{Pipe, PipeV6, PIPE_BUF, PIPE_CAPACITY, PIPE_EXTRA_TOTAL, PIPE_MAX_SIZE};
pub use timerfd::{clock_ns, TimerFd};
pub use unix::{
    Dgram, Message, Received, Rights, SockState, SockType, Socket, UnixName, MAX_BACKLOG, MAX_DGRAMS, MAX_IN_FLIGHT,
    SCM_MAX_FD, SOCKET_CAPACITY, UNIX_PATH_MAX,
};

/// Serialized by hand: a pipe is written as the variant `SizedPipe` (index
/// 5, state format 7: with its capacity); variant 0 (`Pipe`, no capacity) is
/// what formats 4 to 6 wrote, and still reads (with the default capacity).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjKind {
    Pipe(Pipe),
    Socket(Socket),
    EventFd(EventFd),
    Epoll(Epoll),
    TimerFd(TimerFd),
    /// A pseudo-terminal's master side: it holds the terminal (`crate::tty`).
    PtyMaster(Box<crate::tty::Pty>),
    /// A pseudo-terminal's slave side: the master's object id (gone: hung up).
    PtySlave(u64),
    /// An inotify instance: its watches and events are the file system's
    /// (`crate::vfs::Vfs::inotify_add_watch`), by this object's id.
    Inotify(Inotify),
}

impl Serialize for ObjKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        const NAME: &str = "ObjKind";
        match self {
            ObjKind::Pipe(p) => s.serialize_newtype_variant(NAME, 5, "SizedPipe", p),
            ObjKind::Socket(x) => s.serialize_newtype_variant(NAME, 1, "Socket", x),
            ObjKind::EventFd(x) => s.serialize_newtype_variant(NAME, 2, "EventFd", x),
            ObjKind::Epoll(x) => s.serialize_newtype_variant(NAME, 3, "Epoll", x),
            ObjKind::TimerFd(x) => s.serialize_newtype_variant(NAME, 4, "TimerFd", x),
            ObjKind::PtyMaster(x) => s.serialize_newtype_variant(NAME, 6, "PtyMaster", x),
            ObjKind::PtySlave(x) => s.serialize_newtype_variant(NAME, 7, "PtySlave", x),
            ObjKind::Inotify(x) => s.serialize_newtype_variant(NAME, 8, "Inotify", x),
        }
    }
}

/// Every shape an `ObjKind` was written in (variant order is the format).
#[derive(Deserialize)]
#[serde(rename = "ObjKind")]
enum ObjKindRepr {
    Pipe(PipeV6),
    Socket(Socket),
    EventFd(EventFd),
    Epoll(Epoll),
    TimerFd(TimerFd),
    SizedPipe(Pipe),
    PtyMaster(Box<crate::tty::Pty>),
    PtySlave(u64),
    Inotify(Inotify),
}

impl<'de> Deserialize<'de> for ObjKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ObjKind, D::Error> {
        Ok(match ObjKindRepr::deserialize(d)? {
            ObjKindRepr::Pipe(p) => ObjKind::Pipe(Pipe {
                buf: p.buf,
                readers: p.readers,
                writers: p.writers,
                fifo: p.fifo,
                capacity: PIPE_CAPACITY as u32,
            }),
            ObjKindRepr::Socket(x) => ObjKind::Socket(x),
            ObjKindRepr::EventFd(x) => ObjKind::EventFd(x),
            ObjKindRepr::Epoll(x) => ObjKind::Epoll(x),
            ObjKindRepr::TimerFd(x) => ObjKind::TimerFd(x),
            ObjKindRepr::SizedPipe(p) => ObjKind::Pipe(p),
            ObjKindRepr::PtyMaster(p) => ObjKind::PtyMaster(p),
            ObjKindRepr::PtySlave(m) => ObjKind::PtySlave(m),
            ObjKindRepr::Inotify(i) => ObjKind::Inotify(i),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Object {
    /// Open file descriptions referring to it.
    pub ofds: u32,
    pub kind: ObjKind,
}

/// All objects of a process, and the names AF_UNIX sockets and FIFOs are found by.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Objects {
    #[serde(with = "crate::serde_map")]
    pub map: OrdMap<u64, Object>,
    pub next_id: u64,
    /// FIFO inode -> its pipe (while some description has it open).
    #[serde(with = "crate::serde_map")]
    pub fifos: OrdMap<Ino, u64>,
    /// Abstract AF_UNIX names -> socket.
    #[serde(with = "crate::serde_map")]
    pub abstract_names: OrdMap<Vec<u8>, u64>,
    /// Socket files of the overlay -> socket bound there.
    #[serde(with = "crate::serde_map")]
    pub socket_files: OrdMap<Ino, u64>,
    /// Receiving socket -> descriptors in flight to it, oldest first. Never in
    /// a state file: `FdTable::without_in_flight` drops them before a save.
    #[serde(skip)]
    pub in_flight: OrdMap<u64, Vec<Rights>>,
    /// Descriptors in `in_flight`, all sockets together (<= MAX_IN_FLIGHT).
    #[serde(skip)]
    pub in_flight_count: usize,
    /// Descriptions whose in-flight reference went away with a destroyed
    /// socket: the `FdTable` releases them (it owns the reference counts).
    #[serde(skip)]
    pub orphans: Vec<u64>,
    /// EPOLLET: the readiness each edge-triggered watch last reported, by
    /// (watched description, epoll object, fd). A watch reports again only once
    /// its readiness differs, or after the guest found the description drained
    /// (EAGAIN), which forgets it. Not in a state file: a restored watch
    /// reports its readiness once more.
    #[serde(skip)]
    pub et_reported: BTreeMap<(u64, u64, i32), u32>,
}

impl Objects {
    pub fn add(&mut self, kind: ObjKind) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.map.insert(id, Object { ofds: 0, kind });
        id
    }

    pub fn get(&self, id: u64) -> Result<&Object, Errno> {
        self.map.get(&id).ok_or(Errno::EBADF)
    }

    pub fn get_mut(&mut self, id: u64) -> Result<&mut Object, Errno> {
        self.map.get_mut(&id).ok_or(Errno::EBADF)
    }

    /// A description of object `id` opened with `flags` (O_ACCMODE decides a pipe end).
    pub fn attach(&mut self, id: u64, flags: i32) {
        if let Some(o) = self.map.get_mut(&id) {
            o.ofds = o.ofds.saturating_add(1);
            if let ObjKind::Pipe(p) = &mut o.kind {
                let acc = flags & libc::O_ACCMODE;
                if acc != libc::O_WRONLY {
                    p.readers += 1;
                }
                if acc != libc::O_RDONLY {
                    p.writers += 1;
                }
            }
        }
    }

    /// The last reference of a description of `id` (opened with `flags`) went away.
    pub fn detach(&mut self, id: u64, flags: i32) {
        let Some(o) = self.map.get_mut(&id) else { return };
        o.ofds = o.ofds.saturating_sub(1);
        if let ObjKind::Pipe(p) = &mut o.kind {
            let acc = flags & libc::O_ACCMODE;
            if acc != libc::O_WRONLY {
                p.readers = p.readers.saturating_sub(1);
            }
            if acc != libc::O_RDONLY {
                p.writers = p.writers.saturating_sub(1);
            }
        }
        if o.ofds == 0 {
            self.destroy(id);
        }
    }

    /// Drop a just-created object no description came to refer to.
    pub fn discard_unused(&mut self, id: u64) {
        if self.map.get(&id).is_some_and(|o| o.ofds == 0) {
            self.destroy(id);
        }
    }

    /// Forget an object no description refers to.
    fn destroy(&mut self, id: u64) {
        let Some(o) = self.map.remove(&id) else { return };
        self.orphan_rights(id);
        match o.kind {
            ObjKind::Pipe(p) => {
                if let Some(ino) = p.fifo {
                    self.fifos.remove(&ino);
                }
            }
            ObjKind::Socket(s) => {
                match &s.name {
                    Some(UnixName::Abstract(n)) if self.abstract_names.get(n) == Some(&id) => {
                        self.abstract_names.remove(n);
                    }
                    Some(UnixName::Path(ino, _)) if self.socket_files.get(ino) == Some(&id) => {
                        self.socket_files.remove(ino);
                    }
                    _ => {}
                }
                match s.state {
                    SockState::Connected { peer } => self.peer_closed(peer),
                    SockState::Listening { queue, .. } => {
                        // Connections never accepted: their clients see the peer gone.
                        for pending in queue {
                            self.orphan_rights(pending);
                            if let Some(Object { kind: ObjKind::Socket(ps), .. }) = self.map.remove(&pending) {
                                if let Some(c) = ps.peer() {
                                    self.peer_closed(c);
                                }
                            }
                        }
                    }
                    SockState::Unconnected => {}
                }
            }
            // The last slave description closed: the master reads EIO once drained.
            ObjKind::PtySlave(master) => {
                if let Ok(p) = self.pty_mut(master) {
                    if p.slave == Some(id) {
                        p.slave = None;
                        p.slave_closed = true;
                    }
                }
            }
            _ => {}
        }
    }

    /// `POLL*` readiness of object `id` through a description with `flags`.
    /// `ofd_ready` answers for other descriptions (an epoll's watches).
    pub fn readiness(&self, id: u64, flags: i32, depth: u32, ofd_ready: &dyn Fn(u64, u32) -> u32) -> u32 {
        let Ok(o) = self.get(id) else { return libc::POLLNVAL as u32 };
        let (pin, pout) = ((libc::POLLIN | libc::POLLRDNORM) as u32, (libc::POLLOUT | libc::POLLWRNORM) as u32);
        let acc = flags & libc::O_ACCMODE;
        match &o.kind {
            ObjKind::Pipe(p) => {
                let mut r = 0;
                if acc != libc::O_WRONLY {
                    if !p.buf.is_empty() {
                        r |= pin;
                    }
                    if p.writers == 0 && p.fifo.is_none() {
                        r |= libc::POLLHUP as u32;
                    }
                }
                if acc != libc::O_RDONLY {
                    if p.room() >= PIPE_BUF {
                        r |= pout;
                    }
                    if p.readers == 0 {
                        r |= libc::POLLERR as u32;
                    }
                }
                r
            }
            ObjKind::Socket(s) => {
                let mut r = 0;
                match &s.state {
                    SockState::Listening { queue, .. } => {
                        if !queue.is_empty() {
                            r |= pin;
                        }
                        return r;
                    }
                    SockState::Unconnected if !s.ty.connectionless() => {
                        return libc::POLLOUT as u32 | libc::POLLHUP as u32
                    }
                    _ => {}
                }
                if s.has_data() || s.shut_rd || s.peer_wr_gone {
                    r |= pin;
                }
                if s.shut_rd || s.peer_wr_gone {
                    r |= libc::POLLRDHUP as u32;
                }
                if (s.shut_rd || s.peer_wr_gone) && (s.shut_wr || s.peer_rd_gone) {
                    r |= libc::POLLHUP as u32;
                }
                let room = match s.peer().and_then(|p| self.socket(p).ok()) {
                    Some(peer) if peer.ty.datagrams() => {
                        peer.msgs.len() < MAX_DGRAMS && peer.msg_bytes < SOCKET_CAPACITY
                    }
                    Some(peer) => peer.rx_len() < SOCKET_CAPACITY,
                    None => true,
                };
                if room || s.peer_rd_gone || s.shut_wr {
                    r |= pout;
                }
                r
            }
            ObjKind::EventFd(e) => {
                let mut r = 0;
                if e.count > 0 {
                    r |= pin;
                }
                if e.count < u64::MAX - 1 {
                    r |= pout;
                }
                r
            }
            // Its readiness is the file system's (`crate::file::inotify`).
            ObjKind::Inotify(_) => 0,
            ObjKind::TimerFd(t) => {
                if t.pending(clock_ns(t.clock)) > 0 {
                    pin
                } else {
                    0
                }
            }
            ObjKind::PtyMaster(p) => {
                let mut r = 0;
                if !p.output.is_empty() {
                    r |= pin;
                }
                if p.slave_closed {
                    r |= pin | libc::POLLHUP as u32;
                }
                if p.master_writable() {
                    r |= pout;
                }
                r
            }
            ObjKind::PtySlave(m) => match self.get(*m).map(|o| &o.kind) {
                Ok(ObjKind::PtyMaster(p)) => {
                    let mut r = 0;
                    if p.slave_readable() {
                        r |= pin;
                    }
                    if p.slave_writable() {
                        r |= pout;
                    }
                    r
                }
                // Hung up: reads end at once, writes fail.
                _ => pin | pout | libc::POLLHUP as u32,
            },
            ObjKind::Epoll(e) => {
                if depth >= EPOLL_MAX_NESTS {
                    return 0;
                }
                let any = e.watches.iter().any(|(&fd, w)| {
                    let r = self.watch_fires(id, fd, w, ofd_ready(w.ofd, depth + 1));
                    r != 0
                });
                if any {
                    pin
                } else {
                    0
                }
            }
        }
    }

    /// Bytes ready to read (FIONREAD).
    pub fn readable_bytes(&self, id: u64) -> u64 {
        match self.get(id).map(|o| &o.kind) {
            Ok(ObjKind::Pipe(p)) => p.buf.len() as u64,
            Ok(ObjKind::Socket(s)) if s.ty.datagrams() => s.msgs.front().map_or(0, |m| m.data.len() as u64),
            Ok(ObjKind::Socket(s)) => s.rx.len() as u64,
            Ok(ObjKind::PtyMaster(p)) => p.output.len() as u64,
            Ok(ObjKind::PtySlave(_)) => self.pty(id).map_or(0, |p| p.slave_pending() as u64),
            _ => 0,
        }
    }

    /// Check a table read from disk (object references are checked by `FdTable::validate`).
    pub fn validate(&self) -> Result<(), String> {
        for (id, o) in self.map.iter() {
            if *id >= self.next_id {
                return Err(format!("object {id} beyond the id counter"));
            }
            match &o.kind {
                ObjKind::Pipe(p) if !valid_pipe_size(p.capacity as usize) || p.buf.len() > p.capacity as usize => {
                    return Err(format!("pipe {id} over capacity"))
                }
                ObjKind::PtyMaster(p) => {
                    let slave_ok = p.slave.is_none_or(
                        |s| matches!(self.map.get(&s), Some(Object { kind: ObjKind::PtySlave(m), .. }) if *m == *id),
                    );
                    if !p.valid() || p.index >= crate::tty::MAX_PTYS || !slave_ok {
                        return Err(format!("pty {id} state"));
                    }
                }
                ObjKind::Socket(s) => {
                    if s.rx.len() > SOCKET_CAPACITY
                        || s.msg_bytes > SOCKET_CAPACITY
                        || s.msgs.len() > MAX_DGRAMS
                        || s.msgs.iter().map(|m| m.data.len()).sum::<usize>() != s.msg_bytes
                    {
                        return Err(format!("socket {id} buffers"));
                    }
                    if let SockState::Listening { queue, backlog } = &s.state {
                        if queue.len() > MAX_BACKLOG as usize || *backlog > MAX_BACKLOG {
                            return Err(format!("socket {id} backlog"));
                        }
                        for q in queue {
                            if !matches!(self.map.get(q), Some(Object { ofds: 0, kind: ObjKind::Socket(_) })) {
                                return Err(format!("socket {id}: bad pending connection"));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        for (what, ids) in [
            ("fifo", self.fifos.values().copied().collect::<Vec<_>>()),
            ("abstract name", self.abstract_names.values().copied().collect()),
            ("socket file", self.socket_files.values().copied().collect()),
        ] {
            if ids.iter().any(|i| !self.map.contains_key(i)) {
                return Err(format!("{what} names a missing object"));
            }
        }
        Ok(())
    }
}

/// Reported by poll whatever was asked for.
pub const ALWAYS: u32 = (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) as u32;

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn eventfd_and_timerfd_counts() {
        let mut o = Objects::default();
        let e = o.add(ObjKind::EventFd(EventFd { count: 0, semaphore: false }));
        assert_eq!(o.eventfd_read(e), Err(Errno::EAGAIN));
        o.eventfd_write(e, 3).unwrap();
        o.eventfd_write(e, 4).unwrap();
        assert_eq!(o.eventfd_read(e), Ok(7));
        assert_eq!(o.eventfd_write(e, u64::MAX - 1), Ok(()));
        assert_eq!(o.eventfd_write(e, 1), Err(Errno::EAGAIN));
        let mut t = TimerFd { clock: libc::CLOCK_MONOTONIC, next_ns: 1000, interval_ns: 100, ticks: 0 };
        assert_eq!(t.pending(999), 0);
        assert_eq!(t.pending(1000), 1);
        t.advance(1250);
        assert_eq!((t.ticks, t.next_ns), (3, 1300));
    }
}
