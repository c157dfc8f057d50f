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

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::errno::Errno;
use crate::vfs::Ino;

/// A new pipe's capacity (Linux default: 16 pages).
pub const PIPE_CAPACITY: usize = 65536;
/// The largest capacity F_SETPIPE_SZ gives (Linux's /proc/sys/fs/pipe-max-size;
/// the sandbox's root has no CAP_SYS_RESOURCE to go beyond it).
pub const PIPE_MAX_SIZE: usize = 1 << 20;
/// Capacity beyond the default that all pipes of a sandbox may have together
/// (host memory the memory limit does not count; Linux's pipe-user-pages-soft
/// plays this part, at 64 MiB): F_SETPIPE_SZ past it is EPERM, as there.
pub const PIPE_EXTRA_TOTAL: usize = 16 << 20;
/// A capacity a pipe may have: a power of two from one page to `PIPE_MAX_SIZE`.
fn valid_pipe_size(size: usize) -> bool {
    size.is_power_of_two() && (crate::layout::PAGE_SIZE as usize..=PIPE_MAX_SIZE).contains(&size)
}

/// Writes up to this size are atomic (all or EAGAIN).
pub const PIPE_BUF: usize = 4096;
/// Bytes queued towards one socket (Linux's default wmem, 212992).
pub const SOCKET_CAPACITY: usize = 212_992;
/// Datagrams queued on one socket.
pub const MAX_DGRAMS: usize = 512;
/// Pending connections of one listening socket (SOMAXCONN).
pub const MAX_BACKLOG: u32 = 4096;
/// Nesting of epoll instances looked through for readiness (Linux: 5).
pub const EPOLL_MAX_NESTS: u32 = 5;
/// Largest AF_UNIX address (sun_path).
pub const UNIX_PATH_MAX: usize = 108;
/// Descriptors one SCM_RIGHTS message may carry (Linux's SCM_MAX_FD).
pub const SCM_MAX_FD: usize = 253;
/// Descriptors in flight (sent with SCM_RIGHTS, not yet received) in a whole
/// sandbox: ETOOMANYREFS beyond. Bounds what sockets that hold each other in
/// flight (a cycle nothing can receive any more) can keep alive.
pub const MAX_IN_FLIGHT: usize = 1024;

/// Open file descriptions sent with SCM_RIGHTS to a socket and not yet received.
/// Each holds one reference to its descriptions (`FdTable` counts it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rights {
    /// Stream: bytes queued ahead of the data they came with; datagram and
    /// seqpacket: messages ahead of theirs.
    pub at: usize,
    /// Stream: bytes of the data they came with (a read ends there).
    pub len: usize,
    pub ofds: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipe {
    pub buf: Arc<VecDeque<u8>>,
    pub readers: u32,
    pub writers: u32,
    /// The FIFO inode this pipe serves, if it is one.
    pub fifo: Option<Ino>,
    /// Bytes it holds at most (F_GETPIPE_SZ/F_SETPIPE_SZ): a power of two
    /// from one page to `PIPE_MAX_SIZE`.
    pub capacity: u32,
}

impl Pipe {
    /// Bytes a write may add now.
    pub fn room(&self) -> usize {
        (self.capacity as usize).saturating_sub(self.buf.len())
    }
}

/// A pipe as state format 6 and older have it (no capacity: the default).
/// Frozen: never edit.
#[derive(Deserialize)]
pub struct PipeV6 {
    buf: Arc<VecDeque<u8>>,
    readers: u32,
    writers: u32,
    fifo: Option<Ino>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SockType {
    Stream,
    Dgram,
    SeqPacket,
    /// AF_NETLINK (NETLINK_ROUTE): a send is a request the VMM answers into
    /// the socket's own queue (`crate::net::netlink`).
    Netlink,
}

impl SockType {
    pub fn from_linux(ty: i32) -> Result<SockType, Errno> {
        match ty {
            libc::SOCK_STREAM => Ok(SockType::Stream),
            libc::SOCK_DGRAM => Ok(SockType::Dgram),
            libc::SOCK_SEQPACKET => Ok(SockType::SeqPacket),
            _ => Err(Errno::EINVAL),
        }
    }
    pub fn to_linux(self) -> i32 {
        match self {
            SockType::Stream => libc::SOCK_STREAM,
            SockType::Dgram => libc::SOCK_DGRAM,
            SockType::SeqPacket => libc::SOCK_SEQPACKET,
            SockType::Netlink => libc::SOCK_RAW,
        }
    }
    /// Without a connection: sends name their destination (or the kernel).
    pub fn connectionless(self) -> bool {
        matches!(self, SockType::Dgram | SockType::Netlink)
    }
    /// Message boundaries kept?
    pub fn datagrams(self) -> bool {
        self != SockType::Stream
    }
}

/// What a receive got (see `Objects::recv_rights`).
#[derive(Debug)]
pub struct Received {
    pub data: Vec<u8>,
    /// The whole message's length (a datagram longer than the buffer).
    pub full: usize,
    /// The sender's bound name (empty: unnamed).
    pub from: Arc<[u8]>,
    /// Descriptions that came with the data.
    pub rights: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dgram {
    pub data: Arc<[u8]>,
    /// The sender's bound name (empty: unnamed).
    pub from: Arc<[u8]>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SockState {
    Unconnected,
    Listening { backlog: u32, queue: VecDeque<u64> },
    Connected { peer: u64 },
}

/// Where a bound AF_UNIX socket's name lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UnixName {
    /// Abstract (sun_path starts with NUL): the bytes after the NUL.
    Abstract(Vec<u8>),
    /// A socket file in the overlay (its inode), with the path it was bound as.
    Path(Ino, Vec<u8>),
}

impl UnixName {
    /// The sun_path bytes to report (getsockname, recvfrom).
    pub fn sun_path(&self) -> Vec<u8> {
        match self {
            UnixName::Abstract(n) => {
                let mut v = vec![0];
                v.extend_from_slice(n);
                v
            }
            UnixName::Path(_, p) => p.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Socket {
    pub ty: SockType,
    pub name: Option<UnixName>,
    pub state: SockState,
    /// Stream: received bytes.
    pub rx: Arc<VecDeque<u8>>,
    /// Datagram / seqpacket: received messages and their total size.
    pub msgs: VecDeque<Dgram>,
    pub msg_bytes: usize,
    /// shutdown(SHUT_RD) / (SHUT_WR) on this side.
    pub shut_rd: bool,
    pub shut_wr: bool,
    /// The peer closed or shut its writing side: reads end at EOF once drained.
    pub peer_wr_gone: bool,
    /// The peer closed or shut its reading side: writes are EPIPE.
    pub peer_rd_gone: bool,
    /// A connected socket whose peer was closed (for a later connect's ECONNREFUSED etc.).
    pub was_connected: bool,
}

impl Socket {
    fn new(ty: SockType) -> Socket {
        Socket {
            ty,
            name: None,
            state: SockState::Unconnected,
            rx: Arc::new(VecDeque::new()),
            msgs: VecDeque::new(),
            msg_bytes: 0,
            shut_rd: false,
            shut_wr: false,
            peer_wr_gone: false,
            peer_rd_gone: false,
            was_connected: false,
        }
    }

    fn rx_len(&self) -> usize {
        if self.ty.datagrams() {
            self.msg_bytes
        } else {
            self.rx.len()
        }
    }

    fn has_data(&self) -> bool {
        if self.ty.datagrams() {
            !self.msgs.is_empty()
        } else {
            !self.rx.is_empty()
        }
    }

    pub fn peer(&self) -> Option<u64> {
        match self.state {
            SockState::Connected { peer } => Some(peer),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventFd {
    pub count: u64,
    pub semaphore: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watch {
    pub ofd: u64,
    pub events: u32,
    pub data: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Epoll {
    /// By fd number (as registered).
    #[serde(with = "crate::serde_map")]
    pub watches: OrdMap<i32, Watch>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerFd {
    /// CLOCK_MONOTONIC, CLOCK_REALTIME or CLOCK_BOOTTIME.
    pub clock: i32,
    /// Next expiry in the clock's nanoseconds; 0 = disarmed.
    pub next_ns: u64,
    pub interval_ns: u64,
    /// Expirations counted but not yet read.
    pub ticks: u64,
}

impl TimerFd {
    /// Expirations due at `now` (not yet folded into `ticks`) and the next expiry.
    fn due(&self, now: u64) -> (u64, u64) {
        if self.next_ns == 0 || now < self.next_ns {
            return (0, self.next_ns);
        }
        if self.interval_ns == 0 {
            return (1, 0);
        }
        let n = (now - self.next_ns) / self.interval_ns + 1;
        (n, self.next_ns.saturating_add(n.saturating_mul(self.interval_ns)))
    }

    /// Fold due expirations into `ticks`.
    pub fn advance(&mut self, now: u64) {
        let (n, next) = self.due(now);
        self.ticks = self.ticks.saturating_add(n);
        self.next_ns = next;
    }

    pub fn pending(&self, now: u64) -> u64 {
        self.ticks.saturating_add(self.due(now).0)
    }
}

/// Nanoseconds of a host clock.
pub fn clock_ns(clock: i32) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

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

/// An inotify instance's object: which change journal holds its watches
/// (the journal's number; 0: none yet). A state file keeps only this, so an
/// instance restored from a checkpoint has no watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inotify {
    pub epoch: u64,
}

/// Open inotify instances in a sandbox (Linux's max_user_instances default): EMFILE past it.
pub const MAX_INOTIFY_INSTANCES: usize = 128;

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

/// A received message without its descriptors: (data, its full length, the sender's name).
pub type Message = (Vec<u8>, usize, Arc<[u8]>);

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

    pub fn new_pipe(&mut self, fifo: Option<Ino>) -> u64 {
        let capacity = PIPE_CAPACITY as u32;
        self.add(ObjKind::Pipe(Pipe { buf: Arc::new(VecDeque::new()), readers: 0, writers: 0, fifo, capacity }))
    }

    pub fn new_socket(&mut self, ty: SockType) -> u64 {
        self.add(ObjKind::Socket(Socket::new(ty)))
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

    /// The descriptors in flight to socket `id` (going away) become orphans.
    fn orphan_rights(&mut self, id: u64) {
        if let Some(rights) = self.in_flight.remove(&id) {
            for r in rights {
                self.in_flight_count = self.in_flight_count.saturating_sub(r.ofds.len());
                self.orphans.extend(r.ofds);
            }
        }
    }

    fn peer_closed(&mut self, id: u64) {
        if let Some(Object { kind: ObjKind::Socket(s), .. }) = self.map.get_mut(&id) {
            s.peer_wr_gone = true;
            s.peer_rd_gone = true;
            s.was_connected = true;
        }
    }

    // ----- pipes -----------------------------------------------------------------

    fn pipe_mut(&mut self, id: u64) -> Result<&mut Pipe, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::Pipe(p) => Ok(p),
            _ => Err(Errno::EBADF),
        }
    }

    /// Up to `len` bytes; empty at EOF (no writers left); EAGAIN if it would block.
    pub fn pipe_read(&mut self, id: u64, len: usize) -> Result<Vec<u8>, Errno> {
        let p = self.pipe_mut(id)?;
        if p.buf.is_empty() {
            return if p.writers == 0 || len == 0 { Ok(Vec::new()) } else { Err(Errno::EAGAIN) };
        }
        let buf = Arc::make_mut(&mut p.buf);
        let n = len.min(buf.len());
        Ok(buf.drain(..n).collect())
    }

    /// F_GETPIPE_SZ.
    pub fn pipe_size(&self, id: u64) -> Result<u32, Errno> {
        match &self.get(id)?.kind {
            ObjKind::Pipe(p) => Ok(p.capacity),
            _ => Err(Errno::EBADF),
        }
    }

    /// F_SETPIPE_SZ: the capacity becomes `size` rounded up to a power of two
    /// pages (at least one page); EPERM beyond `PIPE_MAX_SIZE` or past the
    /// sandbox's `PIPE_EXTRA_TOTAL`, EBUSY if it holds more than that. Returns it.
    pub fn set_pipe_size(&mut self, id: u64, size: u64) -> Result<u32, Errno> {
        let size = usize::try_from(size).map_err(|_| Errno::EINVAL)?;
        if size > 1 << 31 {
            return Err(Errno::EINVAL);
        }
        let size = size.max(crate::layout::PAGE_SIZE as usize).next_power_of_two();
        if size > PIPE_MAX_SIZE {
            return Err(Errno::EPERM);
        }
        let extra = |p: &Pipe| (p.capacity as usize).saturating_sub(PIPE_CAPACITY);
        let others: usize = self
            .map
            .iter()
            .filter(|(other, _)| **other != id)
            .map(|(_, o)| if let ObjKind::Pipe(p) = &o.kind { extra(p) } else { 0 })
            .sum();
        let p = self.pipe_mut(id)?;
        if size > p.capacity as usize && others.saturating_add(size.saturating_sub(PIPE_CAPACITY)) > PIPE_EXTRA_TOTAL {
            return Err(Errno::EPERM);
        }
        if p.buf.len() > size {
            return Err(Errno::EBUSY);
        }
        p.capacity = size as u32;
        Ok(p.capacity)
    }

    /// Bytes written (maybe fewer than given); EPIPE with no reader; EAGAIN if
    /// nothing fits (or an atomic write does not fit whole).
    pub fn pipe_write(&mut self, id: u64, data: &[u8]) -> Result<usize, Errno> {
        let p = self.pipe_mut(id)?;
        if p.readers == 0 {
            return Err(Errno::EPIPE);
        }
        let room = p.room();
        if data.is_empty() {
            return Ok(0);
        }
        if room == 0 || (data.len() <= PIPE_BUF && room < data.len()) {
            return Err(Errno::EAGAIN);
        }
        let n = room.min(data.len());
        Arc::make_mut(&mut p.buf).extend(&data[..n]);
        Ok(n)
    }

    // ----- sockets ---------------------------------------------------------------

    pub fn socket(&self, id: u64) -> Result<&Socket, Errno> {
        match &self.get(id)?.kind {
            ObjKind::Socket(s) => Ok(s),
            _ => Err(Errno::ENOTSOCK),
        }
    }

    pub fn socket_mut(&mut self, id: u64) -> Result<&mut Socket, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::Socket(s) => Ok(s),
            _ => Err(Errno::ENOTSOCK),
        }
    }

    /// Two connected sockets (socketpair).
    pub fn socket_pair(&mut self, ty: SockType) -> (u64, u64) {
        let a = self.new_socket(ty);
        let b = self.new_socket(ty);
        if let Ok(s) = self.socket_mut(a) {
            s.state = SockState::Connected { peer: b };
        }
        if let Ok(s) = self.socket_mut(b) {
            s.state = SockState::Connected { peer: a };
        }
        (a, b)
    }

    /// Bind socket `id` to `name` (taken names: EADDRINUSE).
    pub fn bind(&mut self, id: u64, name: UnixName) -> Result<(), Errno> {
        if self.socket(id)?.name.is_some() {
            return Err(Errno::EINVAL);
        }
        match &name {
            UnixName::Abstract(n) => {
                if self.abstract_names.contains_key(n) {
                    return Err(Errno::EADDRINUSE);
                }
                self.abstract_names.insert(n.clone(), id);
            }
            UnixName::Path(ino, _) => {
                self.socket_files.insert(*ino, id);
            }
        }
        self.socket_mut(id)?.name = Some(name);
        Ok(())
    }

    /// The socket a name refers to (ECONNREFUSED if nothing is bound there).
    pub fn lookup_name(&self, name: &UnixName) -> Result<u64, Errno> {
        let id = match name {
            UnixName::Abstract(n) => self.abstract_names.get(n),
            UnixName::Path(ino, _) => self.socket_files.get(ino),
        };
        id.copied().ok_or(Errno::ECONNREFUSED)
    }

    pub fn listen(&mut self, id: u64, backlog: i32) -> Result<(), Errno> {
        let s = self.socket_mut(id)?;
        if s.ty.connectionless() {
            return Err(Errno::EOPNOTSUPP);
        }
        let backlog = backlog.clamp(1, MAX_BACKLOG as i32) as u32;
        match &mut s.state {
            SockState::Connected { .. } => Err(Errno::EINVAL),
            SockState::Listening { backlog: b, .. } => {
                *b = backlog;
                Ok(())
            }
            SockState::Unconnected if s.name.is_none() => Err(Errno::EINVAL),
            SockState::Unconnected => {
                s.state = SockState::Listening { backlog, queue: VecDeque::new() };
                Ok(())
            }
        }
    }

    /// Connect `id` to the socket bound at `name`. Stream/seqpacket: queue a new
    /// server-side socket on the listener (EAGAIN when its backlog is full).
    /// Datagram: set the default destination.
    pub fn connect(&mut self, id: u64, name: &UnixName) -> Result<(), Errno> {
        let target = self.lookup_name(name)?;
        let me = self.socket(id)?;
        let ty = me.ty;
        if target != id && self.socket(target)?.ty != ty {
            return Err(Errno::EPROTOTYPE);
        }
        if ty == SockType::Dgram {
            self.socket_mut(id)?.state = SockState::Connected { peer: target };
            return Ok(());
        }
        match me.state {
            SockState::Connected { .. } => return Err(Errno::EISCONN),
            SockState::Listening { .. } => return Err(Errno::EINVAL),
            SockState::Unconnected => {}
        }
        let (full, listening) = match &self.socket(target)?.state {
            SockState::Listening { backlog, queue } => (queue.len() >= *backlog as usize, true),
            _ => (false, false),
        };
        if !listening {
            return Err(Errno::ECONNREFUSED);
        }
        if full {
            return Err(Errno::EAGAIN);
        }
        let server = self.new_socket(ty);
        let target_name = self.socket(target)?.name.clone();
        {
            let s = self.socket_mut(server)?;
            s.state = SockState::Connected { peer: id };
            s.name = target_name;
        }
        self.socket_mut(id)?.state = SockState::Connected { peer: server };
        if let SockState::Listening { queue, .. } = &mut self.socket_mut(target)?.state {
            queue.push_back(server);
        }
        Ok(())
    }

    /// The next pending connection of a listening socket (EAGAIN if none).
    pub fn accept(&mut self, id: u64) -> Result<u64, Errno> {
        match &mut self.socket_mut(id)?.state {
            SockState::Listening { queue, .. } => queue.pop_front().ok_or(Errno::EAGAIN),
            _ => Err(Errno::EINVAL),
        }
    }

    /// Queue `msgs` for a netlink socket to receive (the kernel side's
    /// answers). ENOBUFS when they do not fit, as a netlink socket whose
    /// receive buffer overflows.
    pub fn netlink_deliver(&mut self, id: u64, msgs: Vec<Vec<u8>>) -> Result<(), Errno> {
        let s = self.socket_mut(id)?;
        if s.ty != SockType::Netlink {
            return Err(Errno::ENOTSOCK);
        }
        let bytes: usize = msgs.iter().map(Vec::len).sum();
        if s.msgs.len() + msgs.len() > MAX_DGRAMS || s.msg_bytes.saturating_add(bytes) > SOCKET_CAPACITY {
            return Err(Errno::ENOBUFS);
        }
        for m in msgs {
            s.msg_bytes += m.len();
            s.msgs.push_back(Dgram { data: Arc::from(m), from: Arc::from(&[][..]) });
        }
        Ok(())
    }

    /// Send on socket `id` (to `dest`, or its peer). Bytes sent.
    pub fn send(&mut self, id: u64, data: &[u8], dest: Option<&UnixName>) -> Result<usize, Errno> {
        self.send_to(id, data, dest).map(|(n, _, _)| n)
    }

    /// Send `data` with descriptors (SCM_RIGHTS): they travel with the data's
    /// first byte (a stream) or with the message. The caller gives each of
    /// `ofds` one reference for the trip once this succeeds (`FdTable::send_rights`);
    /// none travel if no byte was sent.
    pub fn send_rights(
        &mut self,
        id: u64,
        data: &[u8],
        dest: Option<&UnixName>,
        ofds: Vec<u64>,
    ) -> Result<usize, Errno> {
        if ofds.len() > SCM_MAX_FD {
            return Err(Errno::EINVAL);
        }
        if self.in_flight_count.saturating_add(ofds.len()) > MAX_IN_FLIGHT {
            return Err(Errno::ETOOMANYREFS);
        }
        let datagrams = self.socket(id)?.ty.datagrams();
        let (n, target, at) = self.send_to(id, data, dest)?;
        // An empty datagram carries its descriptors; an empty stream write sends nothing.
        if ofds.is_empty() || (n == 0 && !datagrams) {
            return Ok(n);
        }
        self.in_flight_count += ofds.len();
        let mut list = self.in_flight.get(&target).cloned().unwrap_or_default();
        list.push(Rights { at, len: n, ofds });
        self.in_flight.insert(target, list);
        Ok(n)
    }

    /// Send: (bytes sent, the receiving socket, the bytes or messages queued
    /// there ahead of these).
    fn send_to(&mut self, id: u64, data: &[u8], dest: Option<&UnixName>) -> Result<(usize, u64, usize), Errno> {
        let me = self.socket(id)?;
        let ty = me.ty;
        if me.shut_wr {
            return Err(Errno::EPIPE);
        }
        let target = match (dest, me.peer()) {
            (Some(name), _) if ty == SockType::Dgram => self.lookup_name(name)?,
            (Some(_), Some(_)) => return Err(Errno::EISCONN),
            (_, Some(peer)) => peer,
            (_, None) if ty == SockType::Dgram => return Err(Errno::ENOTCONN),
            (_, None) => return Err(if me.was_connected { Errno::EPIPE } else { Errno::ENOTCONN }),
        };
        if me.peer_rd_gone && dest.is_none() {
            return Err(if ty == SockType::Dgram { Errno::ECONNREFUSED } else { Errno::EPIPE });
        }
        let from: Arc<[u8]> = me.name.as_ref().map(|n| n.sun_path()).unwrap_or_default().into();
        let Ok(peer) = self.socket_mut(target) else {
            return Err(if ty == SockType::Dgram { Errno::ECONNREFUSED } else { Errno::EPIPE });
        };
        if peer.shut_rd {
            return Err(Errno::EPIPE);
        }
        if ty.datagrams() {
            if data.len() > SOCKET_CAPACITY {
                return Err(Errno::EMSGSIZE);
            }
            if peer.msgs.len() >= MAX_DGRAMS || peer.msg_bytes + data.len() > SOCKET_CAPACITY {
                return Err(Errno::EAGAIN);
            }
            let at = peer.msgs.len();
            peer.msgs.push_back(Dgram { data: Arc::from(data), from });
            peer.msg_bytes += data.len();
            return Ok((data.len(), target, at));
        }
        if data.is_empty() {
            return Ok((0, target, 0));
        }
        let room = SOCKET_CAPACITY - peer.rx.len().min(SOCKET_CAPACITY);
        if room == 0 {
            return Err(Errno::EAGAIN);
        }
        let n = room.min(data.len());
        let at = peer.rx.len();
        Arc::make_mut(&mut peer.rx).extend(&data[..n]);
        Ok((n, target, at))
    }

    /// Receive up to `len` bytes: (data, full message length, sender name).
    /// Empty data at EOF; EAGAIN if it would block. Descriptors in flight
    /// with the data are dropped (orphaned for the `FdTable` to release), as a
    /// read without a control buffer drops them on Linux: see `recv_rights`.
    pub fn recv(&mut self, id: u64, len: usize, peek: bool) -> Result<Message, Errno> {
        let r = self.recv_rights(id, len, peek)?;
        if !peek {
            self.orphans.extend(r.rights);
        }
        Ok((r.data, r.full, r.from))
    }

    /// Receive up to `len` bytes and the descriptors in flight with them. A
    /// stream read stops before data that came with descriptors, and at the
    /// end of it (so they arrive with their first byte, as on Linux). Unless
    /// `peek`, the in-flight references of `rights` pass to the caller (which
    /// installs them and releases each once).
    pub fn recv_rights(&mut self, id: u64, len: usize, peek: bool) -> Result<Received, Errno> {
        let s = self.socket_mut(id)?;
        let none = |data: Vec<u8>, full: usize, from: Arc<[u8]>| Received { data, full, from, rights: Vec::new() };
        if !s.has_data() {
            let eof = s.shut_rd || s.peer_wr_gone;
            // An empty datagram may carry descriptors: it is data here.
            return match (&s.state, s.ty) {
                _ if eof => Ok(none(Vec::new(), 0, Arc::from(&[][..]))),
                (SockState::Listening { .. }, _) => Err(Errno::EINVAL),
                (SockState::Unconnected, SockType::Stream | SockType::SeqPacket) => Err(Errno::EINVAL),
                _ if len == 0 && s.ty == SockType::Stream => Ok(none(Vec::new(), 0, Arc::from(&[][..]))),
                _ => Err(Errno::EAGAIN),
            };
        }
        if s.ty.datagrams() {
            let m = if peek {
                s.msgs.front().cloned()
            } else {
                let m = s.msgs.pop_front();
                if let Some(m) = &m {
                    s.msg_bytes -= m.data.len();
                }
                m
            };
            let Some(m) = m else { return Err(Errno::EAGAIN) };
            let n = len.min(m.data.len());
            let rights = self.take_rights(id, 1, peek, |r| r.at == 0);
            return Ok(Received { data: m.data[..n].to_vec(), full: m.data.len(), from: m.from, rights });
        }
        let mut n = len.min(s.rx.len());
        let first = self.in_flight.get(&id).and_then(|l| l.first()).map(|r| (r.at, r.len));
        let mut with_rights = false;
        match first {
            Some((at, _)) if at > 0 && at < n => n = at,
            Some((0, seg)) if n > 0 => {
                n = n.min(seg.max(1));
                with_rights = true;
            }
            _ => {}
        }
        let s = self.socket_mut(id)?;
        let data: Vec<u8> =
            if peek { s.rx.iter().take(n).copied().collect() } else { Arc::make_mut(&mut s.rx).drain(..n).collect() };
        let rights =
            if with_rights || !peek { self.take_rights(id, n, peek, |r| with_rights && r.at == 0) } else { Vec::new() };
        Ok(Received { data, full: n, from: Arc::from(&[][..]), rights })
    }

    /// The descriptors of the first in-flight entry of socket `id` if `pick`
    /// chooses it; unless `peek`, that entry goes and the others move up by
    /// `consumed` (bytes or messages read).
    fn take_rights(&mut self, id: u64, consumed: usize, peek: bool, pick: impl Fn(&Rights) -> bool) -> Vec<u64> {
        let Some(list) = self.in_flight.get(&id) else { return Vec::new() };
        let picked = list.first().filter(|r| pick(r)).map(|r| r.ofds.clone()).unwrap_or_default();
        if peek {
            return picked;
        }
        let mut list = list.clone();
        if !picked.is_empty() || list.first().is_some_and(&pick) {
            list.remove(0);
            self.in_flight_count = self.in_flight_count.saturating_sub(picked.len());
        }
        for r in list.iter_mut() {
            if r.at >= consumed {
                r.at -= consumed;
            } else {
                // Part of its data was read (a stream read that began before it
                // cannot, but keep the entry consistent): it comes next.
                r.len = r.len.saturating_sub(consumed - r.at);
                r.at = 0;
            }
        }
        if list.is_empty() {
            self.in_flight.remove(&id);
        } else {
            self.in_flight.insert(id, list);
        }
        picked
    }

    /// shutdown(2): `how` is SHUT_RD, SHUT_WR or SHUT_RDWR.
    pub fn shutdown(&mut self, id: u64, how: i32) -> Result<(), Errno> {
        let s = self.socket_mut(id)?;
        let (rd, wr) = match how {
            libc::SHUT_RD => (true, false),
            libc::SHUT_WR => (false, true),
            libc::SHUT_RDWR => (true, true),
            _ => return Err(Errno::EINVAL),
        };
        let Some(peer) = s.peer() else { return Err(Errno::ENOTCONN) };
        s.shut_rd |= rd;
        s.shut_wr |= wr;
        if s.ty == SockType::Dgram {
            return Ok(());
        }
        if let Ok(p) = self.socket_mut(peer) {
            p.peer_wr_gone |= wr;
            p.peer_rd_gone |= rd;
        }
        Ok(())
    }

    // ----- eventfd, timerfd --------------------------------------------------------

    pub fn eventfd_mut(&mut self, id: u64) -> Result<&mut EventFd, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::EventFd(e) => Ok(e),
            _ => Err(Errno::EINVAL),
        }
    }

    pub fn eventfd_read(&mut self, id: u64) -> Result<u64, Errno> {
        let e = self.eventfd_mut(id)?;
        if e.count == 0 {
            return Err(Errno::EAGAIN);
        }
        if e.semaphore {
            e.count -= 1;
            Ok(1)
        } else {
            Ok(std::mem::take(&mut e.count))
        }
    }

    pub fn eventfd_write(&mut self, id: u64, v: u64) -> Result<(), Errno> {
        if v == u64::MAX {
            return Err(Errno::EINVAL);
        }
        let e = self.eventfd_mut(id)?;
        if u64::MAX - 1 - e.count < v {
            return Err(Errno::EAGAIN);
        }
        e.count += v;
        Ok(())
    }

    pub fn timerfd_mut(&mut self, id: u64) -> Result<&mut TimerFd, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::TimerFd(t) => Ok(t),
            _ => Err(Errno::EINVAL),
        }
    }

    /// Expirations since the last read (EAGAIN if none).
    pub fn timerfd_read(&mut self, id: u64) -> Result<u64, Errno> {
        let t = self.timerfd_mut(id)?;
        t.advance(clock_ns(t.clock));
        if t.ticks == 0 {
            return Err(Errno::EAGAIN);
        }
        Ok(std::mem::take(&mut t.ticks))
    }

    pub fn epoll_mut(&mut self, id: u64) -> Result<&mut Epoll, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::Epoll(e) => Ok(e),
            _ => Err(Errno::EINVAL),
        }
    }

    // ----- pseudo-terminals -----------------------------------------------------------

    /// The terminal behind a master or slave object (EIO: the master is gone).
    pub fn pty_mut(&mut self, id: u64) -> Result<&mut crate::tty::Pty, Errno> {
        let master = match self.get(id)?.kind {
            ObjKind::PtySlave(m) => m,
            _ => id,
        };
        match self.map.get_mut(&master).map(|o| &mut o.kind) {
            Some(ObjKind::PtyMaster(p)) => Ok(p),
            Some(_) => Err(Errno::ENOTTY),
            None => Err(Errno::EIO),
        }
    }

    pub fn pty(&self, id: u64) -> Result<&crate::tty::Pty, Errno> {
        let master = match self.get(id)?.kind {
            ObjKind::PtySlave(m) => m,
            _ => id,
        };
        match self.map.get(&master).map(|o| &o.kind) {
            Some(ObjKind::PtyMaster(p)) => Ok(p),
            Some(_) => Err(Errno::ENOTTY),
            None => Err(Errno::EIO),
        }
    }

    /// A new pseudo-terminal (the lowest free index): its master's object.
    pub fn new_pty(&mut self) -> Result<u64, Errno> {
        let used: std::collections::BTreeSet<u32> = self.ptys().map(|(_, p)| p.index).collect();
        let index = (0..crate::tty::MAX_PTYS).find(|i| !used.contains(i)).ok_or(Errno::ENOSPC)?;
        Ok(self.add(ObjKind::PtyMaster(Box::new(crate::tty::Pty::new(index)))))
    }

    /// Every open pseudo-terminal: (master object, terminal).
    pub fn ptys(&self) -> impl Iterator<Item = (u64, &crate::tty::Pty)> + '_ {
        self.map.iter().filter_map(|(id, o)| match &o.kind {
            ObjKind::PtyMaster(p) => Some((*id, &**p)),
            _ => None,
        })
    }

    /// The slave object of pty `master` (made on its first open).
    pub fn pty_slave(&mut self, master: u64) -> Result<u64, Errno> {
        if let Some(s) = self.pty(master)?.slave {
            return Ok(s);
        }
        let s = self.add(ObjKind::PtySlave(master));
        let p = self.pty_mut(master)?;
        p.slave = Some(s);
        p.slave_closed = false;
        Ok(s)
    }

    // ----- readiness -----------------------------------------------------------------

    /// What watch `fd` of epoll `ep` reports given its description's readiness
    /// `ready` (0: nothing). A disarmed one-shot watch reports nothing; an
    /// edge-triggered one only what it has not reported yet.
    pub fn watch_fires(&self, ep: u64, fd: i32, w: &Watch, ready: u32) -> u32 {
        let asked = w.events & !(EPOLLONESHOT | EPOLLET);
        if asked == 0 {
            return 0;
        }
        let r = ready & (asked | ALWAYS);
        if r != 0 && w.events & EPOLLET != 0 && self.et_reported.get(&(w.ofd, ep, fd)) == Some(&r) {
            return 0;
        }
        r
    }

    /// Record what an edge-triggered watch reported (`r`; 0 forgets it).
    pub fn et_note(&mut self, ep: u64, fd: i32, ofd: u64, r: u32) {
        if r == 0 {
            self.et_reported.remove(&(ofd, ep, fd));
        } else {
            self.et_reported.insert((ofd, ep, fd), r);
        }
    }

    /// The guest found description `ofd` drained (a read's EAGAIN: `events`
    /// POLLIN) or full (a write's: POLLOUT): that readiness, when it comes
    /// back, is a new edge for every edge-triggered watch on it.
    pub fn et_drained(&mut self, ofd: u64, events: u32) {
        if self.et_reported.is_empty() {
            return;
        }
        let mut bits = 0;
        if events & libc::POLLIN as u32 != 0 {
            bits |= (libc::POLLIN | libc::POLLRDNORM) as u32;
        }
        if events & libc::POLLOUT as u32 != 0 {
            bits |= (libc::POLLOUT | libc::POLLWRNORM) as u32;
        }
        for (_, r) in self.et_reported.range_mut((ofd, 0, i32::MIN)..=(ofd, u64::MAX, i32::MAX)) {
            *r &= !bits;
        }
    }

    /// A watch was added, changed or removed: it reports its readiness afresh (as Linux re-checks).
    pub fn et_forget_watch(&mut self, ep: u64, fd: i32) {
        self.et_reported.retain(|&(_, e, f), _| !(e == ep && f == fd));
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

    /// When a timerfd among `ids` (or watched by an epoll among them) next expires,
    /// in CLOCK_MONOTONIC-relative terms: the nanoseconds from now.
    pub fn next_expiry_in(&self, id: u64, depth: u32, ofd_obj: &dyn Fn(u64) -> Option<u64>) -> Option<u64> {
        match &self.get(id).ok()?.kind {
            ObjKind::TimerFd(t) if t.next_ns != 0 => Some(t.next_ns.saturating_sub(clock_ns(t.clock))),
            ObjKind::Epoll(e) if depth < EPOLL_MAX_NESTS => e
                .watches
                .values()
                .filter_map(|w| ofd_obj(w.ofd).and_then(|o| self.next_expiry_in(o, depth + 1, ofd_obj)))
                .min(),
            _ => None,
        }
    }

    /// A server-side socket queued on a listener, not yet accepted.
    pub fn is_pending_connection(&self, id: u64) -> bool {
        self.map.values().any(|o| match &o.kind {
            ObjKind::Socket(Socket { state: SockState::Listening { queue, .. }, .. }) => queue.contains(&id),
            _ => false,
        })
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
pub const EPOLLONESHOT: u32 = 1 << 30;
pub const EPOLLET: u32 = 1 << 31;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipe_size_bounds_writes_and_is_bounded() {
        let mut o = Objects::default();
        let p = o.new_pipe(None);
        o.attach(p, libc::O_RDONLY);
        o.attach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_size(p), Ok(PIPE_CAPACITY as u32));
        assert_eq!(o.set_pipe_size(p, 1), Ok(4096), "at least a page");
        assert_eq!(o.pipe_write(p, &[1; 5000]), Ok(4096));
        assert_eq!(o.pipe_write(p, &[1; 10]), Err(Errno::EAGAIN));
        assert_eq!(o.set_pipe_size(p, 0), Ok(4096), "0 is one page too");
        assert_eq!(o.set_pipe_size(p, 5000), Ok(8192), "a power of two");
        assert_eq!(o.pipe_write(p, &[1; 5000]), Ok(4096));
        assert_eq!(o.set_pipe_size(p, 4096), Err(Errno::EBUSY), "holds more than that");
        assert_eq!(o.set_pipe_size(p, PIPE_MAX_SIZE as u64 + 1), Err(Errno::EPERM));
        assert_eq!(o.set_pipe_size(p, 1 << 31), Err(Errno::EPERM));
        assert_eq!(o.set_pipe_size(p, (1 << 31) + 1), Err(Errno::EINVAL));
        assert_eq!(o.pipe_size(p), Ok(8192), "refused changes change nothing");
        // The sandbox-wide budget of extra capacity.
        let extra = PIPE_MAX_SIZE - PIPE_CAPACITY;
        let mut fit = 0;
        for _ in 0..PIPE_EXTRA_TOTAL / extra + 2 {
            let q = o.new_pipe(None);
            if o.set_pipe_size(q, PIPE_MAX_SIZE as u64).is_ok() {
                fit += 1;
            }
        }
        assert_eq!(fit, PIPE_EXTRA_TOTAL / extra);
        assert_eq!(o.set_pipe_size(p, 16384), Ok(16384), "up to the default size costs nothing of the budget");
        o.validate().unwrap();
    }

    /// State formats 4 to 6 wrote a pipe as variant 0 with no capacity: it
    /// reads with the default one; what is written now reads back as it was.
    #[test]
    fn pipes_of_older_state_files_read_with_the_default_capacity() {
        #[derive(Serialize)]
        enum OldKind {
            Pipe(OldPipe),
        }
        #[derive(Serialize)]
        struct OldPipe {
            buf: Arc<VecDeque<u8>>,
            readers: u32,
            writers: u32,
            fifo: Option<Ino>,
        }
        let old = OldKind::Pipe(OldPipe {
            buf: Arc::new(b"abc".iter().copied().collect()),
            readers: 1,
            writers: 2,
            fifo: Some(9),
        });
        let bytes = postcard::to_stdvec(&old).unwrap();
        let ObjKind::Pipe(p) = postcard::from_bytes::<ObjKind>(&bytes).unwrap() else { panic!("not a pipe") };
        assert_eq!((p.buf.len(), p.readers, p.writers, p.fifo, p.capacity), (3, 1, 2, Some(9), PIPE_CAPACITY as u32));
        let sized = ObjKind::Pipe(Pipe { capacity: 8192, ..p });
        let bytes = postcard::to_stdvec(&sized).unwrap();
        assert_eq!(bytes[0], 5, "written as the SizedPipe variant");
        assert_eq!(postcard::from_bytes::<ObjKind>(&bytes).unwrap(), sized);
        let json = serde_json::to_string(&sized).unwrap();
        assert_eq!(serde_json::from_str::<ObjKind>(&json).unwrap(), sized);
        let e = ObjKind::EventFd(EventFd { count: 3, semaphore: false });
        assert_eq!(postcard::from_bytes::<ObjKind>(&postcard::to_stdvec(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn pipe_capacity_eof_and_epipe() {
        let mut o = Objects::default();
        let p = o.new_pipe(None);
        o.attach(p, libc::O_RDONLY);
        o.attach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_read(p, 10), Err(Errno::EAGAIN));
        let big = vec![7u8; PIPE_CAPACITY + 10];
        assert_eq!(o.pipe_write(p, &big), Ok(PIPE_CAPACITY));
        assert_eq!(o.pipe_write(p, b"x"), Err(Errno::EAGAIN));
        assert_eq!(o.pipe_read(p, 100).unwrap().len(), 100);
        // 100 bytes free: a small write that does not fit whole is refused (atomic).
        assert_eq!(o.pipe_write(p, &[1u8; 200]), Err(Errno::EAGAIN));
        assert_eq!(o.pipe_write(p, &[1u8; 50]), Ok(50));
        let snapshot = o.clone();
        o.detach(p, libc::O_WRONLY);
        assert_eq!(o.pipe_read(p, PIPE_CAPACITY - 100).unwrap(), vec![7u8; PIPE_CAPACITY - 100]);
        assert_eq!(o.pipe_read(p, 10).unwrap(), vec![1u8; 10]);
        assert_eq!(o.pipe_read(p, 100).unwrap().len(), 40);
        assert_eq!(o.pipe_read(p, 100), Ok(vec![]), "EOF once the writer is gone");
        // The clone taken before is untouched.
        assert_eq!(snapshot.readable_bytes(p), (PIPE_CAPACITY - 50) as u64);
        let mut o2 = snapshot;
        o2.detach(p, libc::O_RDONLY);
        assert_eq!(o2.pipe_write(p, b"x"), Err(Errno::EPIPE));
        o2.detach(p, libc::O_WRONLY);
        assert!(o2.map.is_empty());
    }

    #[test]
    fn socketpair_stream_and_dgram() {
        let mut o = Objects::default();
        let (a, b) = o.socket_pair(SockType::Stream);
        o.attach(a, libc::O_RDWR);
        o.attach(b, libc::O_RDWR);
        assert_eq!(o.send(a, b"hello", None), Ok(5));
        assert_eq!(o.recv(b, 3, true).unwrap().0, b"hel");
        assert_eq!(o.recv(b, 100, false).unwrap().0, b"hello");
        assert_eq!(o.recv(b, 100, false), Err(Errno::EAGAIN));
        o.shutdown(a, libc::SHUT_WR).unwrap();
        assert_eq!(o.recv(b, 100, false).unwrap().0, b"");
        o.detach(b, libc::O_RDWR);
        assert_eq!(o.send(a, b"x", None), Err(Errno::EPIPE));

        let (c, d) = o.socket_pair(SockType::Dgram);
        o.attach(c, libc::O_RDWR);
        o.attach(d, libc::O_RDWR);
        o.send(c, b"one", None).unwrap();
        o.send(c, b"three", None).unwrap();
        let (data, full, _) = o.recv(d, 2, false).unwrap();
        assert_eq!((data.as_slice(), full), (&b"on"[..], 3), "a datagram is truncated, not split");
        assert_eq!(o.recv(d, 100, false).unwrap().0, b"three");
    }

    #[test]
    fn listen_connect_accept_by_abstract_name() {
        let mut o = Objects::default();
        let srv = o.new_socket(SockType::Stream);
        o.attach(srv, libc::O_RDWR);
        let name = UnixName::Abstract(b"srv".to_vec());
        o.bind(srv, name.clone()).unwrap();
        let other = o.new_socket(SockType::Stream);
        assert_eq!(o.bind(other, name.clone()), Err(Errno::EADDRINUSE));
        let cli = o.new_socket(SockType::Stream);
        o.attach(cli, libc::O_RDWR);
        assert_eq!(o.connect(cli, &name), Err(Errno::ECONNREFUSED), "not listening yet");
        o.listen(srv, 1).unwrap();
        o.connect(cli, &name).unwrap();
        let conn = o.accept(srv).unwrap();
        o.attach(conn, libc::O_RDWR);
        assert_eq!(o.accept(srv), Err(Errno::EAGAIN));
        o.send(cli, b"ping", None).unwrap();
        assert_eq!(o.recv(conn, 10, false).unwrap().0, b"ping");
        o.detach(srv, libc::O_RDWR);
        let late = o.new_socket(SockType::Stream);
        assert_eq!(o.connect(late, &name), Err(Errno::ECONNREFUSED));
        o.discard_unused(late);
        o.validate().unwrap();
    }

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
