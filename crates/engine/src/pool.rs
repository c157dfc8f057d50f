//! Keeping VM creation and teardown off the request path:
//! - a pool of VMs pre-created with a template's memory mapped copy-on-write;
//! - recycling: a sandbox that ends cleanly gives its VM back, reset to the
//!   template: the pages it changed inside the template's own mappings are
//!   copied back (so KVM's page mappings of them stay warm and the next fork
//!   skips most first touches); every other private page goes back to the
//!   host (MADV_DONTNEED), so a recycled VM never holds more than the
//!   template's mapped pages privately, whatever the previous guest wrote;
//! - a reaper thread that tears other VMs down in the background.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use forkbox_snapshot::MemoryView;
use forkbox_vmm::{Cpu, GuestMemory, VcpuState, Vm, VmmError};

/// Drop `vm` on the reaper thread (closing a VM and unmapping its memory takes
/// a while; the caller should not wait for it).
pub fn reap(vm: Vm) {
    static REAPER: OnceLock<Mutex<Sender<Vm>>> = OnceLock::new();
    let tx = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Vm>();
        let spawned = std::thread::Builder::new().name("forkbox-reaper".into()).spawn(move || {
            for vm in rx {
                drop(vm);
            }
        });
        if spawned.is_err() {
            tracing::warn!("cannot start the VM reaper thread; VMs are torn down inline");
        }
        Mutex::new(tx)
    });
    let leftover = match tx.lock() {
        Ok(tx) => tx.send(vm).err().map(|e| e.0),
        Err(_) => Some(vm),
    };
    drop(leftover);
}

/// Recycled VMs kept per thread (a vCPU that moves to another thread pays
/// for it in KVM_RUN), and in all: the oldest go first, so VMs of threads
/// that ended do not stay around.
const RECYCLED_PER_THREAD: usize = 4;
const RECYCLED_TOTAL: usize = 8;
/// Blank VMs kept ready once a restore asked for one (see `VmPool::blank`).
const BLANK_DEPTH: usize = 2;

#[derive(Debug, Default)]
pub struct PoolStats {
    pub recycled_hits: AtomicU64,
    pub pooled_hits: AtomicU64,
    pub created_inline: AtomicU64,
    pub resets: AtomicU64,
    /// Pages given the template's bytes again by resets.
    pub pages_reset: AtomicU64,
    /// Private pages given back to the host by resets (beyond the template's mappings).
    pub pages_dropped: AtomicU64,
    /// Host memory held privately by the recycled VMs waiting for a fork
    /// (bytes; a gauge). At most `RECYCLED_TOTAL` x the template's mapped
    /// pages (`max_recycled_bytes`).
    pub recycled_private_bytes: AtomicU64,
}

/// VMs of one template: memory a private (copy-on-write) mapping of its memory file.
pub struct VmPool {
    cpu: Arc<Cpu>,
    file: File,
    size: u64,
    ready: Mutex<Option<Receiver<Vm>>>,
    /// Pre-created VMs with KVM's dirty-page log on, for resumed sessions
    /// (turning the log on later changes the memory slot: ms here).
    tracked: Mutex<Option<Receiver<Vm>>>,
    /// Pre-created VMs over blank (anonymous, all-zero) memory with the
    /// dirty-page log on, for the restored children of checkpoints that
    /// called execve (their memory is not the template's). Filled from the
    /// first one taken on (sandboxes without such children make none).
    blank: Mutex<Option<Receiver<Vm>>>,
    /// Oldest first, with the private bytes each holds.
    recycled: Mutex<VecDeque<(ThreadId, Vm, u64)>>,
    /// The template's pristine memory and vCPU, for resets.
    original: MemoryView,
    /// Pages the template maps (one bit per page): what a reset keeps warm.
    keep: Vec<u64>,
    keep_pages: u64,
    vcpu: VcpuState,
    pub stats: PoolStats,
}

impl VmPool {
    /// A pool that keeps up to `depth` fresh VMs ready, and as many with the
    /// dirty-page log on (0: create on demand only).
    pub fn new(
        cpu: Arc<Cpu>,
        file: &File,
        original: MemoryView,
        vcpu: VcpuState,
        depth: usize,
    ) -> Result<Arc<VmPool>, VmmError> {
        let dup = |f: &File| f.try_clone().map_err(|source| VmmError::Sys { call: "dup(memory file)", source });
        let size = original.as_slice().len() as u64;
        let keep = forkbox_vmm::arch::paging::mapped_pages(original.as_slice());
        let keep_pages = keep.iter().map(|w| w.count_ones() as u64).sum();
        let pool = Arc::new(VmPool {
            cpu: cpu.clone(),
            file: dup(file)?,
            size,
            ready: Mutex::new(None),
            tracked: Mutex::new(None),
            blank: Mutex::new(None),
            recycled: Mutex::new(VecDeque::new()),
            original,
            keep,
            keep_pages,
            vcpu,
            stats: PoolStats::default(),
        });
        for (queue, depth, dirty_log) in [(&pool.ready, depth, false), (&pool.tracked, depth, true)] {
            if depth == 0 {
                continue;
            }
            let (tx, rx) = sync_channel(depth);
            let (cpu, file) = (cpu.clone(), dup(file)?);
            let spawned = std::thread::Builder::new()
                .name("forkbox-vm-pool".into())
                .spawn(move || fill(cpu, file, size, dirty_log, tx));
            if spawned.is_ok() {
                if let Ok(mut r) = queue.lock() {
                    *r = Some(rx);
                }
            }
        }
        Ok(pool)
    }

    /// A VM in the template's state: a recycled one of this thread, else a
    /// pre-created one, else one made now. Its vCPU still needs the template's registers
    /// unless it was recycled (`true`).
    pub fn take(&self) -> Result<(Vm, bool), VmmError> {
        let me = std::thread::current().id();
        if let Ok(mut r) = self.recycled.lock() {
            if let Some(i) = r.iter().rposition(|(t, _, _)| *t == me) {
                if let Some((_, vm, bytes)) = r.remove(i) {
                    self.stats.recycled_hits.fetch_add(1, Ordering::Relaxed);
                    self.stats.recycled_private_bytes.fetch_sub(bytes, Ordering::Relaxed);
                    return Ok((vm, true));
                }
            }
        }
        Ok((self.take_fresh(false)?, false))
    }

    /// A pre-created VM (else one made now), never a recycled one; with
    /// KVM's dirty-page log on if `dirty_log` (a session resumed from a
    /// checkpoint: its pages mostly differ from the template's anyway, so
    /// the warm VMs stay for forks).
    pub fn take_fresh(&self, dirty_log: bool) -> Result<Vm, VmmError> {
        let queue = if dirty_log { &self.tracked } else { &self.ready };
        if let Ok(r) = queue.lock() {
            if let Some(vm) = r.as_ref().and_then(|rx| rx.try_recv().ok()) {
                self.stats.pooled_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(vm);
            }
        }
        self.stats.created_inline.fetch_add(1, Ordering::Relaxed);
        create(&self.cpu, &self.file, self.size, dirty_log)
    }

    /// A VM over blank memory (all zeros, `size` bytes) with KVM's
    /// dirty-page log on: a pre-created one, else one made now (the first
    /// call starts keeping `BLANK_DEPTH` ready).
    pub fn take_blank(&self) -> Result<Vm, VmmError> {
        if let Ok(mut r) = self.blank.lock() {
            match r.as_ref() {
                Some(rx) => {
                    if let Ok(vm) = rx.try_recv() {
                        self.stats.pooled_hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(vm);
                    }
                }
                None => {
                    let (tx, rx) = sync_channel(BLANK_DEPTH);
                    let (cpu, size) = (self.cpu.clone(), self.size);
                    let spawned = std::thread::Builder::new()
                        .name("forkbox-vm-pool".into())
                        .spawn(move || fill_with(|| create_blank(&cpu, size), tx));
                    if spawned.is_ok() {
                        *r = Some(rx);
                    }
                }
            }
        }
        self.stats.created_inline.fetch_add(1, Ordering::Relaxed);
        create_blank(&self.cpu, self.size)
    }

    /// [`Self::take`] for a session's sandbox, which keeps its VM for its
    /// life on whatever thread serves it: a recycled VM of another thread
    /// too, before a pre-created one (warm pages matter more than the
    /// vCPU's move to this thread).
    pub fn take_warm(&self) -> Result<(Vm, bool), VmmError> {
        let me = std::thread::current().id();
        if let Ok(mut r) = self.recycled.lock() {
            let i = r.iter().rposition(|(t, _, _)| *t == me).or_else(|| r.len().checked_sub(1));
            if let Some((_, vm, bytes)) = i.and_then(|i| r.remove(i)) {
                self.stats.recycled_hits.fetch_add(1, Ordering::Relaxed);
                self.stats.recycled_private_bytes.fetch_sub(bytes, Ordering::Relaxed);
                return Ok((vm, true));
            }
        }
        self.take()
    }

    /// Recycled VMs waiting, of every thread.
    pub fn recycled_count(&self) -> usize {
        self.recycled.lock().map_or(0, |r| r.len())
    }

    pub fn vcpu(&self) -> &VcpuState {
        &self.vcpu
    }

    /// The template's memory, read-only.
    pub fn original(&self) -> &[u8] {
        self.original.as_slice()
    }

    /// The bound on `recycled_private_bytes`: every recycled VM holding every
    /// page the template maps privately.
    pub fn max_recycled_bytes(&self) -> u64 {
        RECYCLED_TOTAL as u64 * self.keep_pages * forkbox_vmm::layout::PAGE_SIZE
    }

    /// Take back the VM of a sandbox that ended cleanly: reset it to the
    /// template and keep it for the next fork on this thread.
    pub fn recycle(&self, mut vm: Vm) {
        let me = std::thread::current().id();
        let room = self
            .recycled
            .lock()
            .map(|r| r.iter().filter(|(t, _, _)| *t == me).count() < RECYCLED_PER_THREAD)
            .unwrap_or(false);
        if !room {
            return reap(vm);
        }
        match vm.reset(self.original.as_slice(), &self.keep, &self.vcpu) {
            Ok(st) => {
                self.stats.resets.fetch_add(1, Ordering::Relaxed);
                self.stats.pages_reset.fetch_add(st.copied, Ordering::Relaxed);
                self.stats.pages_dropped.fetch_add(st.dropped, Ordering::Relaxed);
                let bytes = (st.copied + st.kept) * forkbox_vmm::layout::PAGE_SIZE;
                match self.recycled.lock() {
                    Ok(mut r) => {
                        self.stats.recycled_private_bytes.fetch_add(bytes, Ordering::Relaxed);
                        r.push_back((me, vm, bytes));
                        while r.len() > RECYCLED_TOTAL {
                            if let Some((_, old, b)) = r.pop_front() {
                                self.stats.recycled_private_bytes.fetch_sub(b, Ordering::Relaxed);
                                reap(old);
                            }
                        }
                    }
                    Err(_) => reap(vm),
                }
            }
            Err(e) => {
                tracing::warn!("VM reset failed, discarding it: {e}");
                reap(vm);
            }
        }
    }
}

fn create(cpu: &Cpu, file: &File, size: u64, dirty_log: bool) -> Result<Vm, VmmError> {
    let mem = GuestMemory::private_file(file, size)?;
    if dirty_log {
        Vm::new_with_dirty_log(cpu, mem)
    } else {
        Vm::new(cpu, mem)
    }
}

fn create_blank(cpu: &Cpu, size: u64) -> Result<Vm, VmmError> {
    Vm::new_with_dirty_log(cpu, GuestMemory::anonymous(size)?)
}

fn fill(cpu: Arc<Cpu>, file: File, size: u64, dirty_log: bool, tx: SyncSender<Vm>) {
    fill_with(|| create(&cpu, &file, size, dirty_log), tx)
}

/// Keep `tx` full of VMs `create` makes, until the pool is dropped.
fn fill_with(create: impl Fn() -> Result<Vm, VmmError>, tx: SyncSender<Vm>) {
    loop {
        match create() {
            // Blocks while the pool is full; ends when the pool is dropped.
            Ok(vm) => {
                if tx.send(vm).is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!("VM pool: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}
