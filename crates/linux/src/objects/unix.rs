//! AF_UNIX sockets (stream, datagram, seqpacket): socket pairs, names
//! (abstract, or socket files of the overlay), listen/connect/accept, data
//! with the descriptors sent along (SCM_RIGHTS), shutdown.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::errno::Errno;
use crate::vfs::Ino;

use super::{ObjKind, Object, Objects};

/// Bytes queued towards one socket (Linux's default wmem, 212992).
pub const SOCKET_CAPACITY: usize = 212_992;

/// Datagrams queued on one socket.
pub const MAX_DGRAMS: usize = 512;

/// Pending connections of one listening socket (SOMAXCONN).
pub const MAX_BACKLOG: u32 = 4096;

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

    pub(super) fn rx_len(&self) -> usize {
        if self.ty.datagrams() {
            self.msg_bytes
        } else {
            self.rx.len()
        }
    }

    pub(super) fn has_data(&self) -> bool {
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

/// A received message without its descriptors: (data, its full length, the sender's name).
pub type Message = (Vec<u8>, usize, Arc<[u8]>);

impl Objects {
    pub fn new_socket(&mut self, ty: SockType) -> u64 {
        self.add(ObjKind::Socket(Socket::new(ty)))
    }

    /// The descriptors in flight to socket `id` (going away) become orphans.
    pub(super) fn orphan_rights(&mut self, id: u64) {
        if let Some(rights) = self.in_flight.remove(&id) {
            for r in rights {
                self.in_flight_count = self.in_flight_count.saturating_sub(r.ofds.len());
                self.orphans.extend(r.ofds);
            }
        }
    }

    pub(super) fn peer_closed(&mut self, id: u64) {
        if let Some(Object { kind: ObjKind::Socket(s), .. }) = self.map.get_mut(&id) {
            s.peer_wr_gone = true;
            s.peer_rd_gone = true;
            s.was_connected = true;
        }
    }

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

    /// A server-side socket queued on a listener, not yet accepted.
    pub fn is_pending_connection(&self, id: u64) -> bool {
        self.map.values().any(|o| match &o.kind {
            ObjKind::Socket(Socket { state: SockState::Listening { queue, .. }, .. }) => queue.contains(&id),
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
