//! A bounded journal of the changes made to the file system, for watchers
//! outside the guest (E2B's `watch_dir`): what was created, written, removed,
//! renamed (the old name; the new one is a create) or had its attributes
//! changed, by absolute path, numbered.
//!
//! Off until [`Vfs::watch_changes`] turns it on: then every change costs the
//! path of its directory (a walk up the tree) and a push. The guest's inotify
//! instances subscribe to the same calls (`notify.rs` holds their watches
//! and queues; their system calls, which lock the journal, are at the end of
//! this file): the journal is there while either a watcher outside or an
//! inotify watch inside needs it, and records paths only for the former. It holds at most
//! [`JOURNAL_EVENTS`] events and [`JOURNAL_BYTES`] of paths: a guest that
//! changes files without end pushes the oldest events out, and a reader that
//! had not read them is told how many it lost ([`Changes::lost`]), as a
//! watcher whose queue overflowed. Repeats of the newest event (a file written
//! a chunk at a time) are one event, as inotify merges identical unread events.
//!
//! Writes and attribute changes name an inode, not a path: the journal learns
//! an inode's name (its directory and entry) when it is created, linked,
//! renamed or opened while the journal is on ([`NAMES_MAX`] of them at most),
//! and a directory's path is always known. When the journal is turned on it
//! looks up the names of the files open then (in the overlay's directories:
//! every file the guest created or changed). A change to a file it has no
//! name for (an image file opened before, never changed, renamed or opened
//! again since) is not recorded.
//!
//! The journal is not part of the saved state and is shared by the clones of
//! a `Vfs` (they are the same file system at different moments: the stale
//! copies the sandbox's other processes hold, a rollback copy): a restored
//! file system starts without one. Its numbers start at the host clock in
//! nanoseconds, so a journal turned on again after a restore numbers past
//! everything an earlier one gave out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::errno::Errno;

use super::node::{Body, Node};
use super::notify::{self, Notify};
use super::path::Last;
use super::{Ino, Vfs, ROOT_INO};

/// Most events kept.
pub const JOURNAL_EVENTS: usize = 4096;
/// Most bytes of paths kept.
pub const JOURNAL_BYTES: usize = 1 << 20;
/// Most inode names kept (past it the table starts over).
pub const NAMES_MAX: usize = 4096;
/// Most events one read returns.
pub const READ_MAX: usize = 1024;

/// What happened to a path (envd's `EventType`, fsnotify's operations).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeKind {
    Create,
    Write,
    Remove,
    /// The path's old name (the new one is a `Create`).
    Rename,
    /// Permissions, owner or times.
    Chmod,
}

/// One change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub seq: u64,
    pub kind: ChangeKind,
    /// Absolute, as the guest names it (lossy UTF-8).
    pub path: String,
}

/// What a read of the journal found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changes {
    /// In order, at most [`READ_MAX`].
    pub events: Vec<Change>,
    /// Where the next read starts.
    pub next: u64,
    /// Events after the reader's position that were pushed out before it read them.
    pub lost: u64,
}

pub(super) struct Journal {
    /// The number of the first event this journal recorded (also what the
    /// guest's inotify objects know it by).
    pub(super) start: u64,
    next: u64,
    /// Every event numbered from here on is still held.
    floor: u64,
    events: VecDeque<Change>,
    bytes: usize,
    /// Inode -> (directory, entry) it was last known by.
    names: HashMap<Ino, (Ino, Vec<u8>)>,
    /// Paths are recorded (a watcher outside reads them).
    pub(super) paths: bool,
    /// The guest's inotify watches and queues.
    pub(super) notify: Notify,
}

/// The shared handle a `Vfs` holds.
pub(super) type Shared = Arc<Mutex<Journal>>;

impl Journal {
    fn new(start: u64, paths: bool) -> Journal {
        Journal {
            start,
            next: start,
            floor: start,
            events: VecDeque::new(),
            bytes: 0,
            names: HashMap::new(),
            paths,
            notify: Notify::default(),
        }
    }

    fn push(&mut self, kind: ChangeKind, path: &[u8]) {
        let path = String::from_utf8_lossy(path).into_owned();
        if matches!(kind, ChangeKind::Write | ChangeKind::Chmod)
            && self.events.back().is_some_and(|e| e.kind == kind && e.path == path)
        {
            return;
        }
        self.bytes = self.bytes.saturating_add(path.len());
        self.events.push_back(Change { seq: self.next, kind, path });
        self.next = self.next.saturating_add(1);
        while self.events.len() > JOURNAL_EVENTS || self.bytes > JOURNAL_BYTES {
            let Some(old) = self.events.pop_front() else { break };
            self.bytes = self.bytes.saturating_sub(old.path.len());
            self.floor = old.seq.saturating_add(1);
        }
    }

    fn name(&mut self, ino: Ino, dir: Ino, name: &[u8]) {
        if self.names.len() >= NAMES_MAX && !self.names.contains_key(&ino) {
            self.names.clear();
        }
        self.names.insert(ino, (dir, name.to_vec()));
    }

    /// The events from `since` on. A position before this journal's start (one a
    /// journal before a restore gave out) reads from its start.
    fn read(&self, since: u64) -> Changes {
        let from = since.clamp(self.start, self.next);
        let lost = self.floor.saturating_sub(from);
        let events: Vec<Change> = self.events.iter().skip_while(|e| e.seq < from).take(READ_MAX).cloned().collect();
        let next = events.last().map_or(from.max(self.floor), |e| e.seq.saturating_add(1));
        Changes { events, next, lost }
    }
}

pub(super) fn lock(j: &Shared) -> std::sync::MutexGuard<'_, Journal> {
    j.lock().unwrap_or_else(|e| e.into_inner())
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(dir.len() + 1 + name.len());
    p.extend_from_slice(dir);
    if dir != b"/" {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

impl Vfs {
    /// Turn the change journal's paths on (it stays on, with what it holds, if it is).
    pub fn watch_changes(&mut self) {
        match &self.journal {
            Some(j) => {
                let mut j = lock(j);
                if !j.paths {
                    j.paths = true;
                    self.learn_open_names(&mut j);
                }
            }
            None => self.start_journal(true),
        }
    }

    /// A journal (none yet): recording paths or not.
    pub(super) fn start_journal(&mut self, paths: bool) {
        let start = u64::try_from(super::now_ns()).unwrap_or(1).max(1);
        let j = Arc::new(Mutex::new(Journal::new(start, paths)));
        self.learn_open_names(&mut lock(&j));
        self.journal = Some(j);
    }

    /// The names of the files open now (held inodes), found in the
    /// overlay's directories: a write through a descriptor opened before the
    /// journal started is then reported too.
    fn learn_open_names(&self, j: &mut Journal) {
        let wanted: HashSet<Ino> = self.refs.keys().copied().filter(|i| !j.names.contains_key(i)).collect();
        if wanted.is_empty() {
            return;
        }
        for (dir, node) in self.nodes.iter() {
            if let Node { body: Body::Dir { entries, .. }, .. } = node {
                for (name, ino) in entries.iter() {
                    if wanted.contains(ino) {
                        j.name(*ino, *dir, name);
                    }
                }
            }
        }
    }

    /// Turn the paths off and forget them (the journal goes while no inotify
    /// watch needs it).
    pub fn stop_watching(&mut self) {
        let Some(j) = &self.journal else { return };
        let mut g = lock(j);
        g.paths = false;
        g.events.clear();
        g.bytes = 0;
        g.floor = g.next;
        if g.notify.is_empty() {
            drop(g);
            self.journal = None;
        }
    }

    /// Are paths recorded (a watcher outside)?
    pub fn is_watched(&self) -> bool {
        self.journal.as_ref().is_some_and(|j| lock(j).paths)
    }

    /// The journal's events from `since` on (see [`Journal`]); None while it is off.
    pub fn changes(&self, since: u64) -> Option<Changes> {
        self.journal.as_ref().map(lock).filter(|j| j.paths).map(|j| j.read(since))
    }

    /// The number the next change will get (None while off).
    pub fn changes_next(&self) -> Option<u64> {
        self.journal.as_ref().map(lock).filter(|j| j.paths).map(|j| j.next)
    }

    /// Record `kind` of the entry `name` in directory `dir` (`ino`: what it names now).
    pub(super) fn note(&self, kind: ChangeKind, dir: Ino, name: &[u8], ino: Option<Ino>) {
        let mask = match kind {
            ChangeKind::Create => notify::IN_CREATE,
            ChangeKind::Remove => notify::IN_DELETE,
            _ => 0,
        };
        self.note_with(kind, dir, name, ino, mask, 0);
    }

    /// `note`, with the inotify event it is for the directory's watches.
    fn note_with(&self, kind: ChangeKind, dir: Ino, name: &[u8], ino: Option<Ino>, mask: u32, cookie: u32) {
        let Some(j) = &self.journal else { return };
        let mut j = lock(j);
        if j.paths {
            if let Ok(d) = self.dir_path(dir) {
                j.push(kind, &join(&d, name));
            }
        }
        match (kind, ino) {
            (ChangeKind::Create, Some(i)) => j.name(i, dir, name),
            (ChangeKind::Remove | ChangeKind::Rename, Some(i))
                if j.names.get(&i).is_some_and(|(d, n)| *d == dir && n == name) =>
            {
                j.names.remove(&i);
            }
            _ => {}
        }
        if mask != 0 && j.notify.watches_ino(dir) {
            let isdir = if ino.is_some_and(|i| self.is_dir(i).unwrap_or(false)) { notify::IN_ISDIR } else { 0 };
            j.notify.deliver(dir, mask | isdir, cookie, name);
        }
    }

    /// `ino` moved from `oname` in `odir` to `nname` in `ndir`: the old name's
    /// `Rename` and the new one's `Create` in the journal, `IN_MOVED_FROM` and
    /// `IN_MOVED_TO` (one cookie) and `IN_MOVE_SELF` for inotify.
    pub(super) fn note_move(&self, odir: Ino, oname: &[u8], ndir: Ino, nname: &[u8], ino: Ino) {
        let Some(j) = &self.journal else { return };
        let cookie = lock(j).notify.cookie();
        self.note_with(ChangeKind::Rename, odir, oname, Some(ino), notify::IN_MOVED_FROM, cookie);
        self.note_with(ChangeKind::Create, ndir, nname, Some(ino), notify::IN_MOVED_TO, cookie);
        lock(j).notify.deliver(ino, notify::IN_MOVE_SELF, 0, b"");
    }

    /// Record `kind` of inode `ino`, if its path is known.
    pub(super) fn note_ino(&self, kind: ChangeKind, ino: Ino) {
        let Some(j) = &self.journal else { return };
        let is_dir = self.is_dir(ino).unwrap_or(false);
        let mut j = lock(j);
        let entry = self.entry_of(&j, ino, is_dir);
        if j.paths {
            let path = match (&entry, is_dir) {
                (_, true) => self.dir_path(ino).ok(),
                (Some((d, n)), false) => self.dir_path(*d).ok().map(|d| join(&d, n)),
                (None, false) => None,
            };
            if let Some(p) = path {
                j.push(kind, &p);
            }
        }
        if j.notify.is_empty() {
            return;
        }
        let mask = match kind {
            ChangeKind::Write => notify::IN_MODIFY,
            _ => notify::IN_ATTRIB,
        };
        Self::deliver_to(&mut j, ino, entry, mask, is_dir);
    }

    /// Where `ino` is, for its directory's journal paths and inotify
    /// watches: a file by the name it was learnt by; a directory by its
    /// parent (looked up only for an inotify watch of that parent).
    fn entry_of(&self, j: &Journal, ino: Ino, is_dir: bool) -> Option<(Ino, Vec<u8>)> {
        if !is_dir {
            return j.names.get(&ino).cloned();
        }
        if ino == ROOT_INO || j.notify.is_empty() {
            return None;
        }
        let parent = self.parent_of(ino).ok().filter(|p| j.notify.watches_ino(*p))?;
        Some((parent, self.name_in(parent, ino).ok()??))
    }

    /// An inotify event `mask` of `ino`: to its directory's watches (by
    /// `entry`) and its own.
    fn deliver_to(j: &mut Journal, ino: Ino, entry: Option<(Ino, Vec<u8>)>, mask: u32, is_dir: bool) {
        let mask = mask | if is_dir { notify::IN_ISDIR } else { 0 };
        if let Some((d, n)) = entry {
            j.notify.deliver(d, mask, 0, &n);
        }
        j.notify.deliver(ino, mask, 0, b"");
    }

    /// Files closed for good, each with whether it was open for writing:
    /// IN_CLOSE_WRITE or IN_CLOSE_NOWRITE for their inotify watches and
    /// their directories' (nothing in the path journal).
    pub fn note_closed(&self, closed: &[(Ino, bool)]) {
        let Some(j) = &self.journal else { return };
        let mut j = lock(j);
        if j.notify.is_empty() {
            return;
        }
        for &(ino, wrote) in closed {
            let is_dir = self.is_dir(ino).unwrap_or(false);
            let entry = self.entry_of(&j, ino, is_dir);
            let mask = if wrote { notify::IN_CLOSE_WRITE } else { notify::IN_CLOSE_NOWRITE };
            Self::deliver_to(&mut j, ino, entry, mask, is_dir);
        }
    }

    /// The last name of `ino` went away: its inotify watches end.
    pub(super) fn note_gone(&self, ino: Ino) {
        if let Some(j) = &self.journal {
            lock(j).notify.gone(ino);
        }
    }

    /// Learn the path `path` (from `start`) names `ino`, for the changes made to it
    /// through a descriptor or by inode later (while the journal is on).
    pub fn note_name(&self, start: Ino, path: &[u8], ino: Ino) {
        let Some(j) = &self.journal else { return };
        let Ok(p) = self.walk_parent(start, path, &mut 0) else { return };
        if let Last::Name(n) = p.last {
            lock(j).name(ino, p.dir, &n);
        }
    }
}

/// The guest's inotify calls on the file system. An instance is known by
/// its fd object's id and the journal it was made in (`epoch`: 0 for none):
/// an instance of an earlier journal (one restored from a checkpoint) has no
/// watches here.
impl Vfs {
    /// Watch `ino` for instance `inst` (see [`Notify::add_watch`]): its watch
    /// descriptor, and the journal the instance belongs to now (an instance
    /// of an earlier journal starts over in this one).
    pub fn inotify_add_watch(&mut self, inst: u64, ino: Ino, mask: u32) -> Result<(i32, u64), Errno> {
        if self.journal.is_none() {
            self.start_journal(false);
        }
        let j = self.journal.as_ref().ok_or(Errno::ENOMEM)?;
        let mut j = lock(j);
        let wd = j.notify.add_watch(inst, ino, mask)?;
        Ok((wd, j.start))
    }

    /// Run `f` on the watches and queues if `epoch` is the journal's.
    fn with_notify<T>(&self, epoch: u64, f: impl FnOnce(&mut Notify) -> T) -> Option<T> {
        let j = self.journal.as_ref()?;
        let mut j = lock(j);
        (j.start == epoch).then(|| f(&mut j.notify))
    }

    /// inotify_rm_watch: EINVAL for a watch descriptor the instance does not have.
    pub fn inotify_rm_watch(&self, inst: u64, epoch: u64, wd: i32) -> Result<(), Errno> {
        self.with_notify(epoch, |n| n.rm_watch(inst, wd)).unwrap_or(Err(Errno::EINVAL))
    }

    /// Take the queued events of `inst` that fit in `len` bytes (see [`Notify::read`]).
    pub fn inotify_read(
        &self,
        inst: u64,
        epoch: u64,
        len: usize,
        check: impl FnOnce(usize) -> Result<(), Errno>,
    ) -> Result<Vec<u8>, Errno> {
        self.with_notify(epoch, |n| n.read(inst, len, check)).unwrap_or(Err(Errno::EAGAIN))
    }

    /// Bytes of the events queued for `inst` (FIONREAD).
    pub fn inotify_pending(&self, inst: u64, epoch: u64) -> usize {
        self.with_notify(epoch, |n| n.pending(inst)).unwrap_or(0)
    }

    /// Has `inst` events to read?
    pub fn inotify_ready(&self, inst: u64, epoch: u64) -> bool {
        self.with_notify(epoch, |n| n.has_events(inst)).unwrap_or(false)
    }

    /// Drop the instances whose fd objects are gone (`alive` says which are
    /// not), and the journal with the last one if no watcher outside reads it.
    pub fn inotify_forget(&mut self, alive: impl Fn(u64) -> bool) {
        let Some(j) = &self.journal else { return };
        let mut g = lock(j);
        if g.notify.is_empty() {
            return;
        }
        for inst in g.notify.instances() {
            if !alive(inst) {
                g.notify.forget(inst);
            }
        }
        if g.notify.is_empty() && !g.paths {
            drop(g);
            self.journal = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{create, fixture, r};
    use super::super::ROOT_INO;
    use super::*;
    use ChangeKind::*;

    fn kinds(c: &Changes) -> Vec<(ChangeKind, &str)> {
        c.events.iter().map(|e| (e.kind, e.path.as_str())).collect()
    }

    #[test]
    fn off_until_turned_on() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        create(&mut v, "/tmp/before", b"x");
        assert_eq!(v.changes(0), None);
        v.watch_changes();
        let start = v.changes(u64::MAX).unwrap().next;
        assert!(v.changes(start).unwrap().events.is_empty());
        v.stop_watching();
        create(&mut v, "/tmp/after", b"x");
        assert_eq!(v.changes(start), None);
    }

    #[test]
    fn records_every_kind_by_path() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        v.mkdir(ROOT_INO, b"/tmp/d", 0o755).unwrap();
        let ino = create(&mut v, "/tmp/d/a.txt", b"hello");
        v.chmod(ino, 0o600).unwrap();
        v.rename(ROOT_INO, b"/tmp/d/a.txt", ROOT_INO, b"/tmp/d/b.txt", 0).unwrap();
        // Written through its new name, by inode.
        v.write(ino, 5, b" world").unwrap();
        v.unlink(ROOT_INO, b"/tmp/d/b.txt").unwrap();
        v.rmdir(ROOT_INO, b"/tmp/d").unwrap();
        let c = v.changes(at).unwrap();
        assert_eq!(
            kinds(&c),
            vec![
                (Create, "/tmp/d"),
                (Create, "/tmp/d/a.txt"),
                (Write, "/tmp/d/a.txt"),
                (Chmod, "/tmp/d/a.txt"),
                (Rename, "/tmp/d/a.txt"),
                (Create, "/tmp/d/b.txt"),
                (Write, "/tmp/d/b.txt"),
                (Remove, "/tmp/d/b.txt"),
                (Remove, "/tmp/d"),
            ]
        );
        assert_eq!(c.lost, 0);
        // Read to the end: nothing more; the numbers go on.
        let next = v.changes(c.next).unwrap();
        assert!(next.events.is_empty());
        assert_eq!(next.next, c.next);
        assert_eq!(c.events.windows(2).filter(|w| w[1].seq != w[0].seq + 1).count(), 0);
    }

    #[test]
    fn a_file_opened_before_is_named_when_opened_again() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        let ino = create(&mut v, "/tmp/log", b"a");
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        // Unknown inode: not recorded.
        v.write(ino, 1, b"b").unwrap();
        assert!(v.changes(at).unwrap().events.is_empty());
        let again = v.open(ROOT_INO, b"/tmp/log", libc::O_WRONLY, 0).unwrap();
        v.write(again, 2, b"c").unwrap();
        v.release(again);
        assert_eq!(kinds(&v.changes(at).unwrap()), vec![(Write, "/tmp/log")]);
        // A path-based attribute change learns the name too.
        let etc = r(&v, "/etc/hostname").unwrap();
        v.note_name(ROOT_INO, b"/etc/hostname", etc);
        v.chmod(etc, 0o600).unwrap();
        assert_eq!(v.changes(at).unwrap().events.last().map(|e| e.path.as_str()), Some("/etc/hostname"));
    }

    #[test]
    fn a_file_held_open_before_the_journal_started_is_named() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        v.mkdir(ROOT_INO, b"/tmp/d", 0o755).unwrap();
        let ino = v.open(ROOT_INO, b"/tmp/d/out.log", libc::O_CREAT | libc::O_WRONLY, 0o644).unwrap();
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        v.write(ino, 0, b"late").unwrap();
        // Its directory renamed since: the path is the current one.
        v.rename(ROOT_INO, b"/tmp/d", ROOT_INO, b"/tmp/e", 0).unwrap();
        v.write(ino, 4, b"r").unwrap();
        let c = v.changes(at).unwrap();
        assert_eq!(
            kinds(&c),
            vec![(Write, "/tmp/d/out.log"), (Rename, "/tmp/d"), (Create, "/tmp/e"), (Write, "/tmp/e/out.log")]
        );
        v.release(ino);
    }

    #[test]
    fn paths_off_keeps_the_journal_for_inotify() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        let (wd, epoch) = v.inotify_add_watch(7, r(&v, "/tmp").unwrap(), super::notify::IN_CREATE).unwrap();
        assert_eq!(wd, 1);
        assert!(!v.is_watched());
        v.watch_changes();
        v.stop_watching();
        assert!(v.journal.is_some(), "an inotify watch still needs it");
        create(&mut v, "/tmp/n", b"");
        assert_eq!(v.inotify_pending(7, epoch), 32);
        v.inotify_forget(|_| false);
        assert!(v.journal.is_none(), "gone with the last instance");
    }

    #[test]
    fn repeated_writes_are_one_event() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        let ino = create(&mut v, "/tmp/big", b"");
        for i in 0..100u64 {
            v.write(ino, i, b"x").unwrap();
        }
        assert_eq!(kinds(&v.changes(at).unwrap()), vec![(Create, "/tmp/big"), (Write, "/tmp/big")]);
    }

    #[test]
    fn bounded_and_a_slow_reader_is_told_what_it_lost() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        let n = JOURNAL_EVENTS + 100;
        for i in 0..n {
            v.mkdir(ROOT_INO, format!("/tmp/d{i}").as_bytes(), 0o755).unwrap();
        }
        {
            let j = lock(v.journal.as_ref().unwrap());
            assert_eq!(j.events.len(), JOURNAL_EVENTS);
            assert!(j.bytes <= JOURNAL_BYTES);
        }
        let c = v.changes(at).unwrap();
        assert_eq!(c.lost, 100);
        assert_eq!(c.events.len(), READ_MAX);
        assert_eq!(c.events[0].path, "/tmp/d100");
        // Read on to the end, a page at a time: no loss past the first page.
        let mut next = c.next;
        let mut seen = c.events.len();
        loop {
            let c = v.changes(next).unwrap();
            assert_eq!(c.lost, 0);
            if c.events.is_empty() {
                break;
            }
            seen += c.events.len();
            next = c.next;
        }
        assert_eq!(seen, JOURNAL_EVENTS);
        // Long paths: the byte bound holds too.
        let long = "x".repeat(250);
        for i in 0..20 {
            v.mkdir(ROOT_INO, format!("/tmp/{long}{i}").as_bytes(), 0o755).unwrap();
        }
        assert!(lock(v.journal.as_ref().unwrap()).bytes <= JOURNAL_BYTES);
    }

    #[test]
    fn clones_share_it_and_a_restore_has_none() {
        let f = fixture();
        let mut v = Vfs::new(f.image.clone());
        v.watch_changes();
        let at = v.changes(u64::MAX).unwrap().next;
        let mut copy = v.clone();
        create(&mut copy, "/tmp/c", b"1");
        assert_eq!(v.changes(at).unwrap().events.len(), 2);
        let restored = Vfs::restore_state(f.image.clone(), v.save_state()).unwrap();
        assert!(!restored.is_watched());
        // A journal turned on later numbers past what the old one gave out.
        let mut again = restored;
        again.watch_changes();
        assert!(again.changes(u64::MAX).unwrap().next > at);
        let old = again.changes(at).unwrap();
        assert_eq!(old.lost, 0);
    }
}
