//! Memory shared between the sandbox's processes: `MAP_SHARED` of a file
//! (a /dev/shm or /tmp file, a memfd: POSIX semaphores, multiprocessing's
//! locks, queues, `Value`/`Array` heaps) and `MAP_SHARED | MAP_ANONYMOUS`
//! inherited over fork.
//!
//! Each guest process is its own VM, so sharing means the same host pages in
//! several VMs: one shared object = one host memfd (`GuestMemory::new_shared_file`,
//! never a path on the host), mapped over the mapping's guest range in every
//! process that maps it (`GuestMemory::map_shared`; a fork maps the parent's
//! again). The object of a file is keyed by its inode, so two processes that
//! map the same file share it; it starts with the file's bytes, and msync,
//! munmap and the mapper's end write its bytes back to the file (there is no
//! page cache: a `write()` to the file while it is mapped is not seen through
//! the mapping). An anonymous object is reachable only through the mappings a
//! fork inherited.
//!
//! Bounds: a shared mapping is committed memory of every process that maps
//! it (the sandbox memory limit counts each: an upper bound of what the host
//! holds), at most `MAX_OBJECTS` objects per sandbox, an object is at most
//! `MAX_OBJECT_BYTES` (offset + length), and one process holds at most
//! `forkbox_vmm::memory::MAX_SHARED_RANGES` shared ranges (each is a host
//! mapping). An object lives while a mapping holds it (the table only keeps a
//! weak reference): the host memfd goes when the last process lets go.
//!
//! Futexes on shared mappings are keyed by (object, offset) across processes
//! (`Kernel::shm` collects the wakes a syscall makes; the engine delivers them to
//! the waiters of the other processes).
//!
//! The table is host-side and never persisted: at the end of an exec the
//! children are gone, and the one process left gets its shared ranges turned
//! into private memory (`privatize`), file ones back into write-back file
//! mappings, so a checkpoint stores only private memory in the v5 format.

use std::collections::{BTreeMap, HashMap};
use std::sync::Weak;

use forkbox_vmm::memory::SharedFile;
use forkbox_vmm::GuestMemory;

use crate::errno::Errno;
use crate::vfs::Ino;

/// Shared objects alive at once in one sandbox.
pub const MAX_OBJECTS: usize = 256;
/// The largest object (offset + length of a mapping into it).
pub const MAX_OBJECT_BYTES: u64 = 4 << 30;

pub type ObjId = u32;

struct Object {
    file: Weak<std::fs::File>,
    ino: Option<Ino>,
    /// For a file's object: the byte ranges that got the file's bytes (only
    /// the windows mappings cover are copied in, so the host holds no more of
    /// a large file than its processes map), sorted, disjoint.
    filled: Vec<(u64, u64)>,
}

/// The parts of `[start, end)` not in `filled` (sorted, disjoint).
fn gaps(filled: &[(u64, u64)], start: u64, end: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    for &(s, e) in filled {
        if e <= at {
            continue;
        }
        if s >= end {
            break;
        }
        if s > at {
            out.push((at, s.min(end)));
        }
        at = at.max(e);
        if at >= end {
            break;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out
}

/// Add `[start, end)` to `filled`, merging.
fn fill(filled: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    filled.push((start, end));
    filled.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(filled.len());
    for &(s, e) in filled.iter() {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    *filled = merged;
}

/// A futex wake on a shared mapping, for the waiters of other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedWake {
    pub obj: ObjId,
    pub offset: u64,
    pub bitset: u32,
    /// How many more waiters may be woken.
    pub n: u64,
}

#[derive(Default)]
pub struct ShmTable {
    objects: BTreeMap<ObjId, Object>,
    by_ino: HashMap<Ino, ObjId>,
    next: ObjId,
    /// Wakes of the last syscall for other processes (drained by the engine).
    pub wakes: Vec<SharedWake>,
}

impl std::fmt::Debug for ShmTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTable").field("objects", &self.objects.len()).field("wakes", &self.wakes).finish()
    }
}

impl ShmTable {
    /// Forget the objects no mapping holds any more.
    fn prune(&mut self) {
        let dead: Vec<ObjId> =
            self.objects.iter().filter(|(_, o)| o.file.strong_count() == 0).map(|(id, _)| *id).collect();
        for id in dead {
            if let Some(o) = self.objects.remove(&id) {
                if let Some(ino) = o.ino {
                    self.by_ino.remove(&ino);
                }
            }
        }
    }

    /// Objects alive now.
    pub fn len(&mut self) -> usize {
        self.prune();
        self.objects.len()
    }

    pub fn is_empty(&mut self) -> bool {
        self.len() == 0
    }

    /// The host file of object `id`, if a mapping still holds it.
    pub fn file(&self, id: ObjId) -> Option<SharedFile> {
        self.objects.get(&id)?.file.upgrade()
    }

    /// The object of file `ino` for a mapping of its bytes `[offset, offset+len)`:
    /// at least that long (grown with zeros), that window holding the file's
    /// bytes (`file_bytes`, copied in for the parts no mapping covered yet).
    /// Made when there is none. Returns (id, host file).
    pub fn for_file(
        &mut self,
        ino: Ino,
        offset: u64,
        len: u64,
        file_bytes: &[u8],
    ) -> Result<(ObjId, SharedFile), Errno> {
        let end = offset.checked_add(len).filter(|e| *e <= MAX_OBJECT_BYTES).ok_or(Errno::ENOMEM)?;
        let existing = self.by_ino.get(&ino).and_then(|&id| Some((id, self.file(id)?)));
        let (id, f) = match existing {
            Some((id, f)) => {
                if f.metadata().map_err(|_| Errno::ENOMEM)?.len() < end {
                    f.set_len(end).map_err(|_| Errno::ENOMEM)?;
                }
                (id, f)
            }
            None => self.create(end, Some(ino))?,
        };
        let Some(o) = self.objects.get_mut(&id) else { return Err(Errno::ENOMEM) };
        for (s, e) in gaps(&o.filled, offset, end) {
            let from = (s as usize).min(file_bytes.len());
            let to = (e as usize).min(file_bytes.len());
            if from < to {
                std::os::unix::fs::FileExt::write_all_at(&*f, &file_bytes[from..to], s).map_err(|_| Errno::ENOMEM)?;
            }
        }
        fill(&mut o.filled, offset, end);
        Ok((id, f))
    }

    /// A new anonymous object of `size` bytes (zeros).
    pub fn anonymous(&mut self, size: u64) -> Result<(ObjId, SharedFile), Errno> {
        if size > MAX_OBJECT_BYTES {
            return Err(Errno::ENOMEM);
        }
        self.create(size, None)
    }

    fn create(&mut self, size: u64, ino: Option<Ino>) -> Result<(ObjId, SharedFile), Errno> {
        self.prune();
        if self.objects.len() >= MAX_OBJECTS {
            return Err(Errno::ENFILE);
        }
        let size = size.checked_next_multiple_of(crate::layout::PAGE_SIZE).ok_or(Errno::ENOMEM)?;
        let f = GuestMemory::new_shared_file(size).map_err(|_| Errno::ENOMEM)?;
        let mut id = self.next;
        while self.objects.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.next = id.wrapping_add(1);
        self.objects.insert(id, Object { file: std::sync::Arc::downgrade(&f), ino, filled: Vec::new() });
        if let Some(ino) = ino {
            self.by_ino.insert(ino, id);
        }
        Ok((id, f))
    }

    /// Forget every object (the end of an exec: no process maps any now).
    pub fn clear(&mut self) {
        self.objects.clear();
        self.by_ino.clear();
        self.wakes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_files_object_holds_only_the_mapped_windows_and_goes_with_its_last_mapping() {
        let mut t = ShmTable::default();
        let bytes: Vec<u8> = (0..5 * 4096u32).map(|i| (i / 4096) as u8 + 1).collect();
        let (id, f) = t.for_file(7, 4096, 4096, &bytes).unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(b[0], 2);
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(b[0], 0, "a window no mapping covers is not copied");
        f.write_all_at(&[9], 4096).unwrap(); // a process wrote through its mapping
        let (id2, f2) = t.for_file(7, 0, 3 * 4096, &bytes).unwrap();
        assert_eq!(id, id2, "the same file maps the same object");
        f2.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(b[0], 1, "the new window gets the file's bytes");
        f2.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(b[0], 9, "the mapped window keeps what was written");
        assert_eq!(t.len(), 1);
        drop((f, f2));
        assert_eq!(t.len(), 0, "no mapping holds it: gone");
        assert!(t.for_file(7, MAX_OBJECT_BYTES, 4096, &bytes).is_err());
        let held: Vec<_> = (0..MAX_OBJECTS).map(|_| t.anonymous(4096).unwrap()).collect();
        assert_eq!(t.anonymous(4096).err(), Some(Errno::ENFILE));
        drop(held);
        assert!(t.anonymous(4096).is_ok());
    }

    #[test]
    fn gaps_and_fill() {
        let mut f = Vec::new();
        fill(&mut f, 10, 20);
        fill(&mut f, 30, 40);
        assert_eq!(gaps(&f, 0, 50), vec![(0, 10), (20, 30), (40, 50)]);
        assert_eq!(gaps(&f, 12, 18), vec![]);
        fill(&mut f, 15, 35);
        assert_eq!(f, vec![(10, 40)]);
    }
}
