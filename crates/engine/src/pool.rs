//! Keeping VM creation and teardown off the request path:
//! - a pool of VMs pre-created with a template's memory mapped copy-on-write;
//! - recycling: a sandbox that ends cleanly gives its VM back, reset to the
//!   template (only the pages that changed are copied back, so KVM's page
//!   mappings of the rest stay warm and the next fork skips most first touches);
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

#[derive(Debug, Default)]
pub struct PoolStats {
    pub recycled_hits: AtomicU64,
    pub pooled_hits: AtomicU64,
    pub created_inline: AtomicU64,
    pub resets: AtomicU64,
    pub pages_reset: AtomicU64,
}

/// VMs of one template: memory a private (copy-on-write) mapping of its memory file.
pub struct VmPool {
    cpu: Arc<Cpu>,
    file: File,
    size: u64,
    ready: Mutex<Option<Receiver<Vm>>>,
    /// Oldest first.
    recycled: Mutex<VecDeque<(ThreadId, Vm)>>,
    /// The template's pristine memory and vCPU, for resets.
    original: MemoryView,
    vcpu: VcpuState,
    pub stats: PoolStats,
}

impl VmPool {
    /// A pool that keeps up to `depth` fresh VMs ready (0: create on demand only).
    pub fn new(cpu: Arc<Cpu>, file: &File, original: MemoryView, vcpu: VcpuState, depth: usize) -> Result<Arc<VmPool>, VmmError> {
        let dup = |f: &File| f.try_clone().map_err(|source| VmmError::Sys { call: "dup(memory file)", source });
        let size = original.as_slice().len() as u64;
        let pool = Arc::new(VmPool {
            cpu: cpu.clone(),
            file: dup(file)?,
            size,
            ready: Mutex::new(None),
            recycled: Mutex::new(VecDeque::new()),
            original,
            vcpu,
            stats: PoolStats::default(),
        });
        if depth > 0 {
            let (tx, rx) = sync_channel(depth);
            let file = dup(file)?;
            let spawned = std::thread::Builder::new()
                .name("forkbox-vm-pool".into())
                .spawn(move || fill(cpu, file, size, tx));
            if spawned.is_ok() {
                if let Ok(mut r) = pool.ready.lock() {
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
            if let Some(i) = r.iter().rposition(|(t, _)| *t == me) {
                if let Some((_, vm)) = r.remove(i) {
                    self.stats.recycled_hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((vm, true));
                }
            }
        }
        if let Ok(r) = self.ready.lock() {
            if let Some(vm) = r.as_ref().and_then(|rx| rx.try_recv().ok()) {
                self.stats.pooled_hits.fetch_add(1, Ordering::Relaxed);
                return Ok((vm, false));
            }
        }
        self.stats.created_inline.fetch_add(1, Ordering::Relaxed);
        Ok((create(&self.cpu, &self.file, self.size)?, false))
    }

    pub fn vcpu(&self) -> &VcpuState {
        &self.vcpu
    }

    /// The template's memory, read-only.
    pub fn original(&self) -> &[u8] {
        self.original.as_slice()
    }

    /// Take back the VM of a sandbox that ended cleanly: reset it to the
    /// template and keep it for the next fork on this thread.
    pub fn recycle(&self, mut vm: Vm) {
        let me = std::thread::current().id();
        let room = self
            .recycled
            .lock()
            .map(|r| r.iter().filter(|(t, _)| *t == me).count() < RECYCLED_PER_THREAD)
            .unwrap_or(false);
        if !room {
            return reap(vm);
        }
        match vm.reset(self.original.as_slice(), &self.vcpu) {
            Ok(pages) => {
                self.stats.resets.fetch_add(1, Ordering::Relaxed);
                self.stats.pages_reset.fetch_add(pages, Ordering::Relaxed);
                match self.recycled.lock() {
                    Ok(mut r) => {
                        r.push_back((me, vm));
                        while r.len() > RECYCLED_TOTAL {
                            if let Some((_, old)) = r.pop_front() {
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

fn create(cpu: &Cpu, file: &File, size: u64) -> Result<Vm, VmmError> {
    Vm::new(cpu, GuestMemory::private_file(file, size)?)
}

fn fill(cpu: Arc<Cpu>, file: File, size: u64, tx: SyncSender<Vm>) {
    loop {
        match create(&cpu, &file, size) {
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
