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
//! (`Io::shm` collects the wakes a syscall makes; the engine delivers them to
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
        let dead: Vec<ObjId> = self.objects.iter().filter(|(_, o)| o.file.strong_count() == 0).map(|(id, _)| *id).collect();
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

    /// The object of file `ino`, at least `size` bytes long (grown with zeros),
    /// made with `init` (the file's bytes) when there is none. Returns
    /// (id, host file, whether it was just made).
    pub fn for_file(&mut self, ino: Ino, size: u64, init: &[u8]) -> Result<(ObjId, SharedFile, bool), Errno> {
        if size > MAX_OBJECT_BYTES {
            return Err(Errno::ENOMEM);
        }
        if let Some(&id) = self.by_ino.get(&ino) {
            if let Some(f) = self.file(id) {
                let len = f.metadata().map_err(|_| Errno::ENOMEM)?.len();
                if len < size {
                    f.set_len(size).map_err(|_| Errno::ENOMEM)?;
                }
                return Ok((id, f, false));
            }
        }
        let (id, f) = self.create(size.max(init.len() as u64), Some(ino))?;
        std::os::unix::fs::FileExt::write_all_at(&*f, init, 0).map_err(|_| Errno::ENOMEM)?;
        Ok((id, f, true))
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
        self.objects.insert(id, Object { file: std::sync::Arc::downgrade(&f), ino });
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
