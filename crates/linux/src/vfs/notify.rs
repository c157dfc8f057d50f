//! inotify's side of the change journal: the watches of the guest's inotify
//! instances and the events queued for each, fed by the same calls that feed
//! the journal (`journal.rs`), by inode (a watch follows its inode across
//! renames, and a watch made through a symlink watches what it points to).
//!
//! An instance is the fd object that holds it (`objects::ObjKind::Inotify`),
//! known here by its object id. Everything is bounded: at most
//! [`MAX_WATCHES`] watches in a sandbox, at most [`MAX_QUEUED`] events and
//! [`MAX_QUEUED_BYTES`] of records queued per instance (then one
//! `IN_Q_OVERFLOW` and nothing more until the guest reads), identical
//! consecutive events merged as Linux merges them.
//!
//! Like the journal, none of this is in a saved state: an instance restored
//! from a checkpoint (a resume, a revert, a fork) has no watches any more
//! (its reads wait, as an instance without watches does on Linux) and the
//! guest may add new ones.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::errno::Errno;

use super::Ino;

pub const IN_ACCESS: u32 = 0x1;
pub const IN_MODIFY: u32 = 0x2;
pub const IN_ATTRIB: u32 = 0x4;
pub const IN_CLOSE_WRITE: u32 = 0x8;
pub const IN_CLOSE_NOWRITE: u32 = 0x10;
pub const IN_OPEN: u32 = 0x20;
pub const IN_MOVED_FROM: u32 = 0x40;
pub const IN_MOVED_TO: u32 = 0x80;
pub const IN_CREATE: u32 = 0x100;
pub const IN_DELETE: u32 = 0x200;
pub const IN_DELETE_SELF: u32 = 0x400;
pub const IN_MOVE_SELF: u32 = 0x800;
pub const IN_UNMOUNT: u32 = 0x2000;
pub const IN_Q_OVERFLOW: u32 = 0x4000;
pub const IN_IGNORED: u32 = 0x8000;
pub const IN_ONLYDIR: u32 = 0x0100_0000;
pub const IN_DONT_FOLLOW: u32 = 0x0200_0000;
pub const IN_EXCL_UNLINK: u32 = 0x0400_0000;
pub const IN_MASK_CREATE: u32 = 0x1000_0000;
pub const IN_MASK_ADD: u32 = 0x2000_0000;
pub const IN_ISDIR: u32 = 0x4000_0000;
pub const IN_ONESHOT: u32 = 0x8000_0000;
/// Every event a watch may ask for.
pub const IN_ALL_EVENTS: u32 = 0xfff;
/// Every bit `inotify_add_watch` accepts.
pub const IN_VALID: u32 =
    IN_ALL_EVENTS | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK | IN_MASK_CREATE | IN_MASK_ADD | IN_ONESHOT;

/// Watches in a sandbox, all instances together (Linux's max_user_watches is
/// at least 8192): ENOSPC past it.
pub const MAX_WATCHES: usize = 8192;
/// Events queued per instance (Linux's max_queued_events default).
pub const MAX_QUEUED: usize = 16384;
/// Bytes of `struct inotify_event` records queued per instance: with names
/// of up to 255 bytes, [`MAX_QUEUED`] alone would let one instance hold 4 MiB.
pub const MAX_QUEUED_BYTES: usize = 256 << 10;
/// The size of `struct inotify_event` without its name.
pub const EVENT_SIZE: usize = 16;

/// One queued `struct inotify_event`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub wd: i32,
    pub mask: u32,
    pub cookie: u32,
    pub name: Vec<u8>,
}

impl Event {
    /// The name's field: NUL-terminated, padded to a multiple of the record
    /// size as Linux pads it (0 without a name).
    fn name_len(&self) -> usize {
        if self.name.is_empty() {
            0
        } else {
            (self.name.len() + 1).div_ceil(EVENT_SIZE) * EVENT_SIZE
        }
    }

    /// Bytes of the record a read returns.
    pub fn size(&self) -> usize {
        EVENT_SIZE + self.name_len()
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.wd.to_le_bytes());
        out.extend_from_slice(&self.mask.to_le_bytes());
        out.extend_from_slice(&self.cookie.to_le_bytes());
        out.extend_from_slice(&(self.name_len() as u32).to_le_bytes());
        let start = out.len();
        out.extend_from_slice(&self.name);
        out.resize(start + self.name_len(), 0);
    }
}

#[derive(Clone, Copy, Debug)]
struct Watch {
    ino: Ino,
    mask: u32,
}

#[derive(Debug)]
struct Instance {
    watches: BTreeMap<i32, Watch>,
    /// Linux hands watch descriptors out in increasing order, from 1.
    next_wd: i32,
    queue: VecDeque<Event>,
    /// Bytes of the records in `queue`.
    bytes: usize,
}

impl Default for Instance {
    fn default() -> Instance {
        Instance { watches: BTreeMap::new(), next_wd: 1, queue: VecDeque::new(), bytes: 0 }
    }
}

impl Instance {
    fn push(&mut self, e: Event) {
        if self.queue.back() == Some(&e) {
            return;
        }
        let overflowed = self.queue.back().is_some_and(|b| b.mask == IN_Q_OVERFLOW);
        if self.queue.len() >= MAX_QUEUED || self.bytes.saturating_add(e.size()) > MAX_QUEUED_BYTES {
            if !overflowed {
                // Past the caps by this one record, as Linux's overflow event.
                let o = Event { wd: -1, mask: IN_Q_OVERFLOW, cookie: 0, name: Vec::new() };
                self.bytes = self.bytes.saturating_add(o.size());
                self.queue.push_back(o);
            }
            return;
        }
        if overflowed {
            return;
        }
        self.bytes = self.bytes.saturating_add(e.size());
        self.queue.push_back(e);
    }
}

/// The watches and queues of every instance of a sandbox.
#[derive(Debug, Default)]
pub(super) struct Notify {
    instances: HashMap<u64, Instance>,
    /// Inode -> the (instance, watch descriptor) pairs that watch it.
    by_ino: HashMap<Ino, Vec<(u64, i32)>>,
    watches: usize,
    cookie: u32,
}

impl Notify {
    pub(super) fn is_empty(&self) -> bool {
        self.instances.is_empty()
    }

    pub(super) fn watches_ino(&self, ino: Ino) -> bool {
        self.by_ino.contains_key(&ino)
    }

    /// A new cookie pairing an `IN_MOVED_FROM` with its `IN_MOVED_TO`.
    pub(super) fn cookie(&mut self) -> u32 {
        self.cookie = self.cookie.wrapping_add(1).max(1);
        self.cookie
    }

    /// Watch `ino` for `mask` in instance `inst` (flags checked by the caller):
    /// the watch descriptor it already has for that inode (its mask replaced,
    /// or widened with `IN_MASK_ADD`), or a new one.
    pub(super) fn add_watch(&mut self, inst: u64, ino: Ino, mask: u32) -> Result<i32, Errno> {
        let events = mask & (IN_ALL_EVENTS | IN_ONESHOT | IN_EXCL_UNLINK);
        let existing = self.by_ino.get(&ino).and_then(|v| v.iter().find(|(i, _)| *i == inst)).map(|&(_, wd)| wd);
        let me = self.instances.entry(inst).or_default();
        if let Some(wd) = existing {
            if mask & IN_MASK_CREATE != 0 {
                return Err(Errno::EEXIST);
            }
            if let Some(w) = me.watches.get_mut(&wd) {
                w.mask = if mask & IN_MASK_ADD != 0 { w.mask | events } else { events };
            }
            return Ok(wd);
        }
        if self.watches >= MAX_WATCHES {
            return Err(Errno::ENOSPC);
        }
        let wd = me.next_wd;
        me.next_wd = wd.checked_add(1).ok_or(Errno::ENOSPC)?;
        me.watches.insert(wd, Watch { ino, mask: events });
        self.by_ino.entry(ino).or_default().push((inst, wd));
        self.watches += 1;
        Ok(wd)
    }

    /// inotify_rm_watch: EINVAL for a descriptor the instance does not have.
    pub(super) fn rm_watch(&mut self, inst: u64, wd: i32) -> Result<(), Errno> {
        let w = self.instances.get_mut(&inst).and_then(|i| i.watches.remove(&wd)).ok_or(Errno::EINVAL)?;
        self.unindex(inst, wd, w.ino);
        self.ignored(inst, wd);
        Ok(())
    }

    fn unindex(&mut self, inst: u64, wd: i32, ino: Ino) {
        if let Some(v) = self.by_ino.get_mut(&ino) {
            v.retain(|&(i, w)| (i, w) != (inst, wd));
            if v.is_empty() {
                self.by_ino.remove(&ino);
            }
        }
        self.watches = self.watches.saturating_sub(1);
    }

    fn ignored(&mut self, inst: u64, wd: i32) {
        if let Some(i) = self.instances.get_mut(&inst) {
            i.push(Event { wd, mask: IN_IGNORED, cookie: 0, name: Vec::new() });
        }
    }

    /// An event `mask` (with `IN_ISDIR` if it names a directory) on inode
    /// `ino` (`name`: the entry's, for an event of a directory's entry).
    pub(super) fn deliver(&mut self, ino: Ino, mask: u32, cookie: u32, name: &[u8]) {
        let Some(targets) = self.by_ino.get(&ino) else { return };
        let mut oneshots = Vec::new();
        for &(inst, wd) in targets {
            let Some(i) = self.instances.get_mut(&inst) else { continue };
            let Some(w) = i.watches.get(&wd) else { continue };
            if w.mask & mask & IN_ALL_EVENTS == 0 {
                continue;
            }
            let oneshot = w.mask & IN_ONESHOT != 0;
            i.push(Event { wd, mask, cookie, name: name.to_vec() });
            if oneshot {
                oneshots.push((inst, wd));
            }
        }
        for (inst, wd) in oneshots {
            let _ = self.rm_watch(inst, wd);
        }
    }

    /// Inode `ino` is gone (its last name removed): `IN_DELETE_SELF` to its
    /// watches, which end (`IN_IGNORED`).
    pub(super) fn gone(&mut self, ino: Ino) {
        self.deliver(ino, IN_DELETE_SELF, 0, b"");
        for (inst, wd) in self.by_ino.get(&ino).cloned().unwrap_or_default() {
            if let Some(i) = self.instances.get_mut(&inst) {
                i.watches.remove(&wd);
            }
            self.unindex(inst, wd, ino);
            self.ignored(inst, wd);
        }
    }

    /// Take the events that fit in `len` bytes, encoded. EAGAIN if there are
    /// none, EINVAL if the first does not fit. `check` sees the byte count
    /// before anything is taken (a bad guest buffer leaves the queue as it was).
    pub(super) fn read(
        &mut self,
        inst: u64,
        len: usize,
        check: impl FnOnce(usize) -> Result<(), Errno>,
    ) -> Result<Vec<u8>, Errno> {
        let i = self.instances.get_mut(&inst).ok_or(Errno::EAGAIN)?;
        let first = i.queue.front().ok_or(Errno::EAGAIN)?;
        if first.size() > len {
            return Err(Errno::EINVAL);
        }
        let mut n = 0;
        let mut total = 0usize;
        for e in &i.queue {
            if total + e.size() > len {
                break;
            }
            total += e.size();
            n += 1;
        }
        check(total)?;
        let mut out = Vec::with_capacity(total);
        for e in i.queue.drain(..n) {
            e.encode(&mut out);
        }
        i.bytes = i.bytes.saturating_sub(total);
        Ok(out)
    }

    /// Bytes a read would find (FIONREAD).
    pub(super) fn pending(&self, inst: u64) -> usize {
        self.instances.get(&inst).map_or(0, |i| i.bytes)
    }

    pub(super) fn has_events(&self, inst: u64) -> bool {
        self.instances.get(&inst).is_some_and(|i| !i.queue.is_empty())
    }

    /// Instance `inst` was closed for good: its watches go.
    pub(super) fn forget(&mut self, inst: u64) {
        let Some(i) = self.instances.remove(&inst) else { return };
        for (wd, w) in i.watches {
            self.unindex(inst, wd, w.ino);
        }
    }

    /// Every instance with watches or events.
    pub(super) fn instances(&self) -> Vec<u64> {
        self.instances.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(n: &mut Notify, inst: u64) -> Vec<(i32, u32, u32, Vec<u8>)> {
        let bytes = n.read(inst, 1 << 20, |_| Ok(())).unwrap_or_default();
        decode(&bytes)
    }

    pub(crate) fn decode(mut b: &[u8]) -> Vec<(i32, u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while b.len() >= EVENT_SIZE {
            let wd = i32::from_le_bytes(b[0..4].try_into().unwrap());
            let mask = u32::from_le_bytes(b[4..8].try_into().unwrap());
            let cookie = u32::from_le_bytes(b[8..12].try_into().unwrap());
            let len = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
            let name = b[16..16 + len].iter().take_while(|&&c| c != 0).copied().collect();
            out.push((wd, mask, cookie, name));
            b = &b[16 + len..];
        }
        out
    }

    #[test]
    fn watch_descriptors_are_per_inode_and_masks_replace_or_add() {
        let mut n = Notify::default();
        assert_eq!(n.add_watch(1, 100, IN_CREATE), Ok(1));
        assert_eq!(n.add_watch(1, 200, IN_MODIFY), Ok(2));
        assert_eq!(n.add_watch(1, 100, IN_DELETE), Ok(1), "same inode, same wd");
        assert_eq!(n.add_watch(2, 100, IN_CREATE), Ok(1), "another instance numbers its own");
        n.deliver(100, IN_CREATE, 0, b"a");
        assert!(read_all(&mut n, 1).is_empty(), "the mask was replaced");
        assert_eq!(n.add_watch(1, 100, IN_CREATE | IN_MASK_ADD), Ok(1));
        assert_eq!(n.add_watch(1, 100, IN_CREATE | IN_MASK_CREATE), Err(Errno::EEXIST));
        n.deliver(100, IN_CREATE, 0, b"a");
        n.deliver(100, IN_DELETE | IN_ISDIR, 0, b"b");
        assert_eq!(
            read_all(&mut n, 1),
            vec![(1, IN_CREATE, 0, b"a".to_vec()), (1, IN_DELETE | IN_ISDIR, 0, b"b".to_vec())]
        );
        // The same event twice in a row is queued once.
        assert_eq!(read_all(&mut n, 2), vec![(1, IN_CREATE, 0, b"a".to_vec())]);
        assert_eq!(n.rm_watch(1, 1), Ok(()));
        assert_eq!(n.rm_watch(1, 1), Err(Errno::EINVAL));
        assert_eq!(read_all(&mut n, 1), vec![(1, IN_IGNORED, 0, vec![])]);
        // A new watch of the same inode gets a new number, as on Linux.
        assert_eq!(n.add_watch(1, 100, IN_CREATE), Ok(3));
        n.forget(1);
        n.forget(2);
        assert_eq!((n.watches, n.by_ino.len()), (0, 0));
    }

    #[test]
    fn reads_take_whole_records_and_refuse_a_short_buffer() {
        let mut n = Notify::default();
        n.add_watch(7, 1, IN_ALL_EVENTS).unwrap();
        n.deliver(1, IN_CREATE, 0, b"abc");
        n.deliver(1, IN_MODIFY, 0, b"");
        assert_eq!(n.pending(7), 32 + 16);
        assert_eq!(n.read(7, 31, |_| Ok(())), Err(Errno::EINVAL));
        assert_eq!(n.read(7, 40, |_| Err(Errno::EFAULT)), Err(Errno::EFAULT));
        assert_eq!(n.pending(7), 48, "a failed read takes nothing");
        let one = n.read(7, 40, |_| Ok(())).unwrap();
        assert_eq!(one.len(), 32);
        assert_eq!(decode(&one), vec![(1, IN_CREATE, 0, b"abc".to_vec())]);
        assert_eq!(&one[16..20], b"abc\0");
        assert_eq!(n.read(7, 16, |_| Ok(())).map(|b| b.len()), Ok(16));
        assert_eq!(n.read(7, 16, |_| Ok(())), Err(Errno::EAGAIN));
    }

    #[test]
    fn identical_events_merge_and_a_full_queue_overflows_once() {
        let mut n = Notify::default();
        n.add_watch(1, 5, IN_MODIFY | IN_CREATE).unwrap();
        for _ in 0..100 {
            n.deliver(5, IN_MODIFY, 0, b"f");
        }
        assert_eq!(read_all(&mut n, 1).len(), 1);
        for i in 0..MAX_QUEUED + 10 {
            n.deliver(5, IN_CREATE, 0, format!("{i}").as_bytes());
        }
        let i = &n.instances[&1];
        assert!(i.bytes <= MAX_QUEUED_BYTES + EVENT_SIZE);
        assert_eq!(i.queue.back().map(|e| e.mask), Some(IN_Q_OVERFLOW));
        assert_eq!(i.queue.iter().filter(|e| e.mask == IN_Q_OVERFLOW).count(), 1);
        let queued = i.queue.len();
        n.deliver(5, IN_CREATE, 0, b"more");
        assert_eq!(n.instances[&1].queue.len(), queued, "nothing more after the overflow");
        assert_eq!(decode(&n.read(1, 320, |_| Ok(())).unwrap()).len(), 10, "a read takes what fits its buffer");
        let rest = read_all(&mut n, 1);
        assert_eq!(rest.len(), queued - 10);
        assert_eq!(rest.last().map(|e| e.1), Some(IN_Q_OVERFLOW));
        n.deliver(5, IN_CREATE, 0, b"again");
        assert_eq!(read_all(&mut n, 1), vec![(1, IN_CREATE, 0, b"again".to_vec())], "drained: events queue again");
    }

    #[test]
    fn deletion_ends_the_watch_and_oneshot_fires_once() {
        let mut n = Notify::default();
        n.add_watch(1, 9, IN_DELETE_SELF).unwrap();
        n.add_watch(1, 10, IN_ATTRIB | IN_ONESHOT).unwrap();
        n.gone(9);
        n.deliver(10, IN_ATTRIB, 0, b"");
        n.deliver(10, IN_ATTRIB | IN_ISDIR, 0, b"");
        assert_eq!(
            read_all(&mut n, 1),
            vec![
                (1, IN_DELETE_SELF, 0, vec![]),
                (1, IN_IGNORED, 0, vec![]),
                (2, IN_ATTRIB, 0, vec![]),
                (2, IN_IGNORED, 0, vec![])
            ]
        );
        assert_eq!(n.watches, 0);
        assert!(n.by_ino.is_empty());
    }

    #[test]
    fn the_sandbox_has_a_watch_budget() {
        let mut n = Notify::default();
        for ino in 0..MAX_WATCHES as u64 {
            n.add_watch(ino % 3, ino, IN_CREATE).unwrap();
        }
        assert_eq!(n.add_watch(4, u64::MAX, IN_CREATE), Err(Errno::ENOSPC));
        assert_eq!(n.add_watch(0, 0, IN_DELETE), Ok(1), "changing a watch costs nothing");
        n.forget(0);
        assert!(n.add_watch(4, u64::MAX, IN_CREATE).is_ok());
    }
}
