//! Keeping VM creation and teardown off the request path: a pool of VMs
//! pre-created with a template's memory mapped (per template), and a reaper
//! thread that tears finished VMs down in the background.

use std::fs::File;
use std::sync::mpsc::{sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};

use forkbox_vmm::{Cpu, GuestMemory, Vm, VmmError};

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

/// VMs whose memory is a private (copy-on-write) mapping of one memory file.
pub struct VmPool {
    cpu: Arc<Cpu>,
    file: File,
    size: u64,
    ready: Mutex<Option<Receiver<Vm>>>,
}

impl VmPool {
    /// A pool that keeps up to `depth` VMs ready (0: create on demand only).
    pub fn new(cpu: Arc<Cpu>, file: &File, size: u64, depth: usize) -> Result<VmPool, VmmError> {
        let dup = |f: &File| f.try_clone().map_err(|source| VmmError::Sys { call: "dup(memory file)", source });
        let pool = VmPool { cpu: cpu.clone(), file: dup(file)?, size, ready: Mutex::new(None) };
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

    /// A VM with the template memory mapped: from the pool if one is ready, else made now.
    pub fn take(&self) -> Result<Vm, VmmError> {
        if let Ok(r) = self.ready.lock() {
            if let Some(vm) = r.as_ref().and_then(|rx| rx.try_recv().ok()) {
                return Ok(vm);
            }
        }
        create(&self.cpu, &self.file, self.size)
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
