//! The file-descriptor table and open file descriptions, as persistent maps
//! so a process clone (fork) is O(1) and fully independent afterwards.
//! `dup`ed descriptors share one open file description (offset, flags), as on Linux.

use imbl::OrdMap;

use crate::errno::Errno;
use crate::objects::Objects;
use crate::vfs::Ino;

pub const MAX_FDS: i32 = 1024;

/// What an open file description refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FileKind {
    /// A file, directory or device in the VFS.
    Node(Ino),
    /// fd 0: always at end of file.
    Stdin,
    /// fd 1 / fd 2: captured by the VMM.
    Stdout,
    Stderr,
    /// The agent's request/reply channel.
    Agent,
    /// A pipe, socket, eventfd, epoll or timerfd (`FdTable::objects`).
    Object(u64),
    /// An AF_INET/AF_INET6 socket. The host socket behind it lives in the
    /// sandbox's `Kernel` (never in a snapshot); an id with none behind it is reset.
    Socket(SockInfo),
}

/// What the fd table knows of a socket (enough for SO_TYPE/SO_DOMAIN after a restore).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SockInfo {
    pub id: u64,
    pub domain: i32,
    pub stream: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OpenFile {
    pub kind: FileKind,
    /// O_ACCMODE | O_APPEND | O_NONBLOCK | ... as given to open.
    pub flags: i32,
    /// Byte offset, or for a directory the index of the next entry.
    pub offset: u64,
    refs: u32,
}

impl OpenFile {
    pub fn readable(&self) -> bool {
        self.flags & libc::O_ACCMODE != libc::O_WRONLY && self.flags & libc::O_PATH == 0
    }
    pub fn writable(&self) -> bool {
        self.flags & libc::O_ACCMODE != libc::O_RDONLY && self.flags & libc::O_PATH == 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct FdEntry {
    ofd: u64,
    cloexec: bool,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FdTable {
    #[serde(with = "crate::serde_map")]
    fds: OrdMap<i32, FdEntry>,
    #[serde(with = "crate::serde_map")]
    files: OrdMap<u64, OpenFile>,
    next_ofd: u64,
    /// What `FileKind::Object` descriptions refer to.
    pub objects: Objects,
    /// Descriptions closed for good as a side effect (descriptors in flight
    /// on a socket that went away) whose resources the caller still has to
    /// give back (`take_gone`). Always drained right after the call that filled it.
    #[serde(skip)]
    gone: Vec<FileKind>,
    /// Ids of descriptions closed for good, for the locks they held to go
    /// (`take_closed`: the dispatcher drains it after every call).
    #[serde(skip)]
    closed: Vec<u64>,
    /// Files and directories closed for good, with whether the description
    /// could write (inotify's IN_CLOSE_WRITE / IN_CLOSE_NOWRITE): drained
    /// after every call like `closed`.
    #[serde(skip)]
    closed_nodes: Vec<(crate::vfs::Ino, bool)>,
}

impl FdTable {
    /// A table with fds 0, 1, 2 and the agent channel at `agent_fd`.
    pub fn with_stdio(agent_fd: i32) -> FdTable {
        let mut t = FdTable::default();
        for (fd, kind, flags) in [
            (0, FileKind::Stdin, libc::O_RDONLY),
            (1, FileKind::Stdout, libc::O_WRONLY),
            (2, FileKind::Stderr, libc::O_WRONLY),
            (agent_fd, FileKind::Agent, libc::O_RDWR),
        ] {
            let ofd = t.new_ofd(kind, flags);
            t.attach(fd, ofd, false);
        }
        t
    }

    fn new_ofd(&mut self, kind: FileKind, flags: i32) -> u64 {
        let id = self.next_ofd;
        self.next_ofd += 1;
        if let FileKind::Object(obj) = kind {
            self.objects.attach(obj, flags);
        }
        self.files.insert(id, OpenFile { kind, flags, offset: 0, refs: 0 });
        id
    }

    fn lowest_free(&self, min: i32) -> Result<i32, Errno> {
        let mut fd = min.max(0);
        for (&used, _) in self.fds.range(fd..) {
            if used != fd {
                break;
            }
            fd += 1;
        }
        if fd >= MAX_FDS {
            Err(Errno::EMFILE)
        } else {
            Ok(fd)
        }
    }

    /// Point `fd` at `ofd`; returns the kind of a description this dropped.
    fn attach(&mut self, fd: i32, ofd: u64, cloexec: bool) -> Option<FileKind> {
        if let Some(f) = self.files.get_mut(&ofd) {
            f.refs += 1;
        }
        let old = self.fds.insert(fd, FdEntry { ofd, cloexec })?;
        self.release(old.ofd)
    }

    /// Drop one reference; returns the kind of the description if that was the last.
    /// Descriptors that were in flight on a socket this destroyed are released
    /// too (their kinds, when closed for good, go to `gone`).
    fn release(&mut self, ofd: u64) -> Option<FileKind> {
        let kind = self.release_one(ofd);
        self.drain_orphans();
        kind
    }

    /// Release the in-flight references of destroyed sockets' descriptors.
    fn drain_orphans(&mut self) {
        while let Some(o) = self.objects.orphans.pop() {
            if let Some(k) = self.release_one(o) {
                self.gone.push(k);
            }
        }
    }

    fn release_one(&mut self, ofd: u64) -> Option<FileKind> {
        let f = self.files.get_mut(&ofd)?;
        f.refs = f.refs.saturating_sub(1);
        if f.refs == 0 {
            let f = self.files.remove(&ofd)?;
            if let FileKind::Node(ino) = f.kind {
                self.closed.push(ofd);
                if f.flags & libc::O_PATH == 0 {
                    self.closed_nodes.push((ino, f.flags & libc::O_ACCMODE != libc::O_RDONLY));
                }
            }
            if let FileKind::Object(obj) = f.kind {
                self.objects.detach(obj, f.flags);
            }
            Some(f.kind)
        } else {
            None
        }
    }

    /// Hand the files closed for good since the last call (see
    /// `closed_nodes`) to `f`, and forget them (the list keeps its room).
    pub fn drain_closed_nodes(&mut self, f: impl FnOnce(&[(crate::vfs::Ino, bool)])) {
        if !self.closed_nodes.is_empty() {
            f(&self.closed_nodes);
            self.closed_nodes.clear();
        }
    }

    /// Descriptions closed for good since the last call (see `closed`).
    pub fn take_closed(&mut self) -> Option<Vec<u64>> {
        (!self.closed.is_empty()).then(|| std::mem::take(&mut self.closed))
    }

    /// Open a new description at the lowest free fd.
    pub fn open(&mut self, kind: FileKind, flags: i32) -> Result<i32, Errno> {
        let fd = self.lowest_free(0)?;
        let ofd = self.new_ofd(kind, flags & !libc::O_CLOEXEC);
        self.attach(fd, ofd, flags & libc::O_CLOEXEC != 0);
        Ok(fd)
    }

    pub fn get(&self, fd: i32) -> Result<&OpenFile, Errno> {
        let e = self.fds.get(&fd).ok_or(Errno::EBADF)?;
        self.files.get(&e.ofd).ok_or(Errno::EBADF)
    }

    /// The id of the open file description behind `fd` (what `kernel::block::WaitOn` names).
    pub fn ofd(&self, fd: i32) -> Result<u64, Errno> {
        Ok(self.fds.get(&fd).ok_or(Errno::EBADF)?.ofd)
    }

    /// An open file description by id.
    pub fn description(&self, ofd: u64) -> Option<&OpenFile> {
        self.files.get(&ofd)
    }

    pub fn get_mut(&mut self, fd: i32) -> Result<&mut OpenFile, Errno> {
        let e = *self.fds.get(&fd).ok_or(Errno::EBADF)?;
        self.files.get_mut(&e.ofd).ok_or(Errno::EBADF)
    }

    /// Close `fd`. Returns the kind of the description if this closed it for good
    /// (the caller then releases what it refers to).
    pub fn close(&mut self, fd: i32) -> Result<Option<FileKind>, Errno> {
        let e = self.fds.remove(&fd).ok_or(Errno::EBADF)?;
        Ok(self.release(e.ofd))
    }

    /// dup / F_DUPFD: the lowest free fd >= `min`.
    pub fn dup(&mut self, fd: i32, min: i32, cloexec: bool) -> Result<i32, Errno> {
        let e = *self.fds.get(&fd).ok_or(Errno::EBADF)?;
        if min >= MAX_FDS {
            return Err(Errno::EINVAL);
        }
        let new = self.lowest_free(min)?; // free, so nothing is replaced
        self.attach(new, e.ofd, cloexec);
        Ok(new)
    }

    /// dup2 / dup3: `new` refers to `fd`'s description, closing what it was
    /// (returned when that closed a description for good).
    pub fn dup_to(&mut self, fd: i32, new: i32, cloexec: bool) -> Result<Option<FileKind>, Errno> {
        let e = *self.fds.get(&fd).ok_or(Errno::EBADF)?;
        if !(0..MAX_FDS).contains(&new) {
            return Err(Errno::EBADF);
        }
        if new == fd {
            return Ok(None);
        }
        Ok(self.attach(new, e.ofd, cloexec))
    }

    pub fn cloexec(&self, fd: i32) -> Result<bool, Errno> {
        Ok(self.fds.get(&fd).ok_or(Errno::EBADF)?.cloexec)
    }

    pub fn set_cloexec(&mut self, fd: i32, on: bool) -> Result<(), Errno> {
        self.fds.get_mut(&fd).ok_or(Errno::EBADF)?.cloexec = on;
        Ok(())
    }

    /// Only this process' descriptors (fd -> description), without the
    /// sandbox-wide descriptions and objects (what a checkpoint records of a
    /// process other than the current one: see `process::ChildState`).
    pub fn own_descriptors(&self) -> FdTable {
        FdTable { fds: self.fds.clone(), ..FdTable::default() }
    }

    /// Check another process' own descriptors (`own_descriptors`, read from
    /// disk) against this table's descriptions: each names one, never the
    /// agent channel, and it has no descriptions of its own.
    pub fn check_descriptors_of(&self, other: &FdTable) -> Result<(), String> {
        if !other.files.is_empty() || !other.objects.map.is_empty() {
            return Err("descriptions in a process' own descriptor table".into());
        }
        for (fd, e) in other.fds.iter() {
            let ok = (0..MAX_FDS).contains(fd) && self.files.get(&e.ofd).is_some_and(|f| f.kind != FileKind::Agent);
            if !ok {
                return Err(format!("bad fd {fd}"));
            }
        }
        Ok(())
    }

    /// Check a table read from disk: every fd names a live description, and
    /// reference counts match.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_with(&[])
    }

    /// `validate` for the table of a sandbox whose other processes' own
    /// descriptors (`own_descriptors`) are `others`: their references count too.
    pub fn validate_with(&self, others: &[&FdTable]) -> Result<(), String> {
        let mut counts = std::collections::BTreeMap::<u64, u32>::new();
        for e in others.iter().flat_map(|o| o.fds.values()) {
            *counts.entry(e.ofd).or_default() += 1;
        }
        for (fd, e) in self.fds.iter() {
            if !(0..MAX_FDS).contains(fd) || !self.files.contains_key(&e.ofd) {
                return Err(format!("bad fd {fd}"));
            }
            *counts.entry(e.ofd).or_default() += 1;
        }
        let mut obj_refs = std::collections::BTreeMap::<u64, u32>::new();
        for (id, f) in self.files.iter() {
            if counts.get(id).copied().unwrap_or(0) != f.refs || *id >= self.next_ofd {
                return Err(format!("bad open file description {id}"));
            }
            if let FileKind::Object(obj) = f.kind {
                if !self.objects.map.contains_key(&obj) {
                    return Err(format!("open file description {id} names a missing object"));
                }
                *obj_refs.entry(obj).or_default() += 1;
            }
        }
        for (id, o) in self.objects.map.iter() {
            let pending = o.ofds == 0 && self.objects.is_pending_connection(*id);
            if obj_refs.get(id).copied().unwrap_or(0) != o.ofds || (o.ofds == 0 && !pending) {
                return Err(format!("bad object reference count {id}"));
            }
            if let crate::objects::ObjKind::Pipe(p) = &o.kind {
                let (mut r, mut w) = (0, 0);
                for f in self.files.values().filter(|f| f.kind == FileKind::Object(*id)) {
                    r += u32::from(f.flags & libc::O_ACCMODE != libc::O_WRONLY);
                    w += u32::from(f.flags & libc::O_ACCMODE != libc::O_RDONLY);
                }
                if (r, w) != (p.readers, p.writers) {
                    return Err(format!("pipe {id}: reader/writer counts"));
                }
            }
        }
        self.objects.validate()
    }

    /// Nodes referenced by open descriptions (each holds one VFS reference).
    pub fn open_nodes(&self) -> impl Iterator<Item = Ino> + '_ {
        self.files.values().filter_map(|f| match f.kind {
            FileKind::Node(ino) => Some(ino),
            _ => None,
        })
    }

    /// AF_INET/AF_INET6 sockets referenced by open descriptions.
    pub fn sockets(&self) -> impl Iterator<Item = SockInfo> + '_ {
        self.files.values().filter_map(|f| match f.kind {
            FileKind::Socket(s) => Some(s),
            _ => None,
        })
    }

    pub fn len(&self) -> usize {
        self.fds.len()
    }

    /// Open a description of a new object `id` at the lowest free fd; the
    /// object is dropped if that fails (EMFILE).
    pub fn open_object(&mut self, id: u64, flags: i32) -> Result<i32, Errno> {
        let r = self.open(FileKind::Object(id), flags);
        if r.is_err() {
            self.objects.discard_unused(id);
        }
        r
    }

    /// Two fds at once (pipe, socketpair): both or neither.
    pub fn open_two(&mut self, a: (u64, i32), b: (u64, i32)) -> Result<(i32, i32), Errno> {
        let fa = self.open_object(a.0, a.1).inspect_err(|_| self.objects.discard_unused(b.0))?;
        match self.open_object(b.0, b.1) {
            Ok(fb) => Ok((fa, fb)),
            Err(e) => {
                let _ = self.close(fa);
                Err(e)
            }
        }
    }

    /// (fd, description id) pairs, ascending by fd.
    pub fn entries(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        self.fds.iter().map(|(fd, e)| (*fd, e.ofd))
    }

    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// The table of a fork's child: the same fds on the same open file
    /// descriptions (counted once more each), but never the agent channel.
    pub fn fork(&mut self) -> FdTable {
        let mut child = self.clone();
        for (fd, e) in self.fds.iter() {
            let kind = self.files.get(&e.ofd).map(|f| f.kind);
            if kind == Some(FileKind::Agent) {
                child.fds.remove(fd);
            }
        }
        for e in child.fds.values() {
            if let Some(f) = self.files.get_mut(&e.ofd) {
                f.refs += 1;
            }
        }
        child
    }

    /// Swap the open file descriptions (and objects) with `other`'s: the
    /// sandbox-wide part of the table goes with the process that runs.
    pub fn swap_shared(&mut self, other: &mut FdTable) {
        std::mem::swap(&mut self.files, &mut other.files);
        std::mem::swap(&mut self.next_ofd, &mut other.next_ofd);
        std::mem::swap(&mut self.objects, &mut other.objects);
    }

    /// The close-on-exec fds, and those of the agent channel (which never
    /// survives an execve).
    pub fn exec_closes(&self) -> Vec<i32> {
        self.fds
            .iter()
            .filter(|(_, e)| e.cloexec || self.files.get(&e.ofd).is_some_and(|f| f.kind == FileKind::Agent))
            .map(|(fd, _)| *fd)
            .collect()
    }

    /// fds in use, ascending.
    pub fn fds(&self) -> impl Iterator<Item = i32> + '_ {
        self.fds.keys().copied()
    }

    /// Descriptions closed for good as a side effect of the last calls (see `gone`).
    pub fn take_gone(&mut self) -> Vec<FileKind> {
        self.drain_orphans();
        std::mem::take(&mut self.gone)
    }

    /// The descriptions behind `fds`, to send with SCM_RIGHTS (EBADF for a
    /// closed fd; the agent channel never leaves its process).
    pub fn rights_of(&self, fds: &[i32]) -> Result<Vec<u64>, Errno> {
        fds.iter()
            .map(|&fd| {
                let ofd = self.ofd(fd)?;
                match self.files.get(&ofd).map(|f| f.kind) {
                    Some(FileKind::Agent) | None => Err(Errno::EBADF),
                    Some(_) => Ok(ofd),
                }
            })
            .collect()
    }

    /// One reference more on each of `ofds` (their trip in flight).
    pub fn hold(&mut self, ofds: &[u64]) {
        for o in ofds {
            if let Some(f) = self.files.get_mut(o) {
                f.refs += 1;
            }
        }
    }

    /// Drop one reference of each of `ofds` (in flight, now received or lost);
    /// kinds closed for good go to `take_gone`.
    pub fn drop_held(&mut self, ofds: &[u64]) {
        for &o in ofds {
            if let Some(k) = self.release(o) {
                self.gone.push(k);
            }
        }
    }

    /// Install received descriptions at the lowest free fds, as many as fit
    /// (until EMFILE): the fds given, in order. Each gets a reference of its own.
    pub fn install(&mut self, ofds: &[u64], cloexec: bool) -> Vec<i32> {
        let mut out = Vec::with_capacity(ofds.len());
        for &o in ofds {
            if !self.files.contains_key(&o) {
                continue;
            }
            let Ok(fd) = self.lowest_free(0) else { break };
            self.attach(fd, o, cloexec);
            out.push(fd);
        }
        out
    }

    /// A copy for a state file: descriptors in flight on sockets cannot be
    /// saved (the receiving process is not), so the copy drops them, as if
    /// read without a control buffer. Returns the kinds that closed for good.
    pub fn without_in_flight(&self) -> (FdTable, Vec<FileKind>) {
        let mut t = self.clone();
        let held: Vec<u64> = t.objects.in_flight.values().flat_map(|l| l.iter().flat_map(|r| r.ofds.clone())).collect();
        t.objects.in_flight.clear();
        t.objects.in_flight_count = 0;
        t.drop_held(&held);
        let gone = t.take_gone();
        (t, gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_free_fd_and_dup_share_offset() {
        let mut t = FdTable::with_stdio(3);
        let a = t.open(FileKind::Node(7), libc::O_RDONLY).unwrap();
        assert_eq!(a, 4);
        let b = t.dup(a, 0, false).unwrap();
        assert_eq!(b, 5);
        t.get_mut(a).unwrap().offset = 42;
        assert_eq!(t.get(b).unwrap().offset, 42, "dups share the description");
        assert_eq!(t.close(a).unwrap(), None, "still open through the dup");
        assert_eq!(t.get(b).unwrap().offset, 42);
        assert_eq!(t.close(b).unwrap(), Some(FileKind::Node(7)));
        assert_eq!(t.get(a), Err(Errno::EBADF));
        assert_eq!(t.open(FileKind::Node(8), 0).unwrap(), 4, "lowest free fd is reused");
        assert_eq!(t.open(FileKind::Node(9), 0).unwrap(), 5);
    }

    #[test]
    fn fresh_table_validates() {
        let mut t = FdTable::with_stdio(3);
        t.validate().unwrap();
        let a = t.open(FileKind::Node(7), 0).unwrap();
        t.dup(a, 10, true).unwrap();
        t.close(0).unwrap();
        t.validate().unwrap();
    }

    #[test]
    fn clone_is_independent() {
        let mut t = FdTable::with_stdio(3);
        let a = t.open(FileKind::Node(7), libc::O_RDONLY).unwrap();
        let mut c = t.clone();
        c.get_mut(a).unwrap().offset = 100;
        c.close(1).unwrap();
        assert_eq!(t.get(a).unwrap().offset, 0);
        assert!(t.get(1).is_ok());
    }

    #[test]
    fn dup2_replaces_and_bounds() {
        let mut t = FdTable::with_stdio(3);
        let a = t.open(FileKind::Node(7), libc::O_WRONLY | libc::O_CLOEXEC).unwrap();
        assert!(t.cloexec(a).unwrap());
        assert_eq!(t.dup_to(a, 1, false).unwrap(), Some(FileKind::Stdout), "stdout's description closed");
        assert_eq!(t.get(1).unwrap().kind, FileKind::Node(7));
        assert_eq!(t.dup_to(a, MAX_FDS, false), Err(Errno::EBADF));
        assert_eq!(t.dup_to(99, 5, false), Err(Errno::EBADF));
        assert_eq!(t.close(-1), Err(Errno::EBADF));
    }
}
