//! flock(2) locks: whole-file advisory locks, shared or exclusive, held by an
//! open file description and seen by every process of the sandbox (the table
//! lives in the per-sandbox `Kernel`).
//!
//! A holder is (pid, description id): description ids are per process, so a
//! forked child's inherited descriptions do not hold the parent's locks (on
//! Linux the description, and so the lock, is shared). A lock goes when its
//! description is closed for good (`release`, after the call that closed it)
//! or its process is gone (checked when the file is locked again). The table
//! lives with the running sandbox: a checkpoint does not record it.

use std::collections::HashMap;

use crate::vfs::Ino;

/// Locks a sandbox may hold at once (past it: ENOLCK).
pub const MAX_LOCKS: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Holder {
    pub pid: u32,
    pub ofd: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granted {
    Yes,
    /// Another holder's lock excludes this one.
    Conflict,
    /// The sandbox holds `MAX_LOCKS` already.
    TableFull,
}

#[derive(Debug, Default)]
pub struct Flocks {
    /// Per file: its holders and whether each lock is exclusive.
    by_ino: HashMap<Ino, Vec<(Holder, bool)>>,
    count: usize,
}

impl Flocks {
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Take a lock on `ino` for `me`, or convert the one it holds (as
    /// Linux, a conversion keeps the old lock when the new one conflicts).
    /// Locks of processes `alive` says are gone are dropped first.
    pub fn lock(&mut self, ino: Ino, me: Holder, exclusive: bool, alive: impl Fn(u32) -> bool) -> Granted {
        let list = self.by_ino.entry(ino).or_default();
        let before = list.len();
        list.retain(|(h, _)| h.pid == me.pid || alive(h.pid));
        self.count -= before - list.len();
        if list.iter().any(|(h, ex)| *h != me && (exclusive || *ex)) {
            return Granted::Conflict;
        }
        if let Some(held) = list.iter_mut().find(|(h, _)| *h == me) {
            held.1 = exclusive;
            return Granted::Yes;
        }
        if self.count >= MAX_LOCKS {
            return Granted::TableFull;
        }
        list.push((me, exclusive));
        self.count += 1;
        Granted::Yes
    }

    /// LOCK_UN: drop `me`'s lock on `ino` (none held: nothing to do).
    pub fn unlock(&mut self, ino: Ino, me: Holder) {
        if let Some(list) = self.by_ino.get_mut(&ino) {
            let before = list.len();
            list.retain(|(h, _)| *h != me);
            self.count -= before - list.len();
            if list.is_empty() {
                self.by_ino.remove(&ino);
            }
        }
    }

    /// Description `ofd` of process `pid` was closed for good: its locks go.
    pub fn release(&mut self, pid: u32, ofd: u64) {
        let me = Holder { pid, ofd };
        let mut emptied = Vec::new();
        for (ino, list) in self.by_ino.iter_mut() {
            let before = list.len();
            list.retain(|(h, _)| *h != me);
            self.count -= before - list.len();
            if list.is_empty() {
                emptied.push(*ino);
            }
        }
        for ino in emptied {
            self.by_ino.remove(&ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Holder = Holder { pid: 2, ofd: 5 };
    const B: Holder = Holder { pid: 3, ofd: 5 };

    #[test]
    fn shared_locks_coexist_and_exclusive_ones_exclude() {
        let mut t = Flocks::default();
        let alive = |_| true;
        assert_eq!(t.lock(1, A, false, alive), Granted::Yes);
        assert_eq!(t.lock(1, B, false, alive), Granted::Yes);
        assert_eq!(t.lock(1, B, true, alive), Granted::Conflict, "A's shared lock excludes B's exclusive one");
        t.unlock(1, A);
        assert_eq!(t.lock(1, B, true, alive), Granted::Yes, "converted once alone");
        assert_eq!(t.lock(1, A, false, alive), Granted::Conflict);
        assert_eq!(t.lock(2, A, true, alive), Granted::Yes, "another file");
        t.release(3, 5);
        assert_eq!(t.lock(1, A, true, alive), Granted::Yes, "B's description was closed");
        t.release(2, 5);
        assert!(t.is_empty());
    }

    #[test]
    fn locks_of_processes_that_are_gone_are_dropped() {
        let mut t = Flocks::default();
        assert_eq!(t.lock(1, B, true, |_| true), Granted::Yes);
        assert_eq!(t.lock(1, A, true, |pid| pid != 3), Granted::Yes);
        assert_eq!(t.count, 1);
    }

    #[test]
    fn the_table_is_bounded() {
        let mut t = Flocks::default();
        for ino in 0..MAX_LOCKS as u64 {
            assert_eq!(t.lock(ino, A, false, |_| true), Granted::Yes);
        }
        assert_eq!(t.lock(u64::MAX, A, false, |_| true), Granted::TableFull);
        assert_eq!(t.lock(0, A, true, |_| true), Granted::Yes, "a conversion takes no entry");
    }
}
