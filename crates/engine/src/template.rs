//! Templates: a warm Python (the preload run, e.g. numpy imported) parked on
//! the agent's first read, snapshotted once per image + preload and cached in
//! the data directory. Every sandbox after that is a copy-on-write fork.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use forkbox_linux::layout::RAM_SIZE;
use forkbox_linux::Process;
use forkbox_snapshot::files::PackReader;
use forkbox_snapshot::layer::{apply_layers, apply_layers_in_place, pages_of, Layer, LayerPlan, LayerStats};
use forkbox_snapshot::{
    encode, read_state, write_encoded_into, write_memory, write_state, CpuFingerprint, MemoryFile, Snapshot,
    StateError, FORMAT_VERSION,
};
use forkbox_vmm::{GuestMemory, VcpuState, Vm};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::EngineError;
use crate::limits::Limits;
use crate::pool::VmPool;
use crate::sandbox::Sandbox;
use crate::Engine;

/// What a template records about itself (kept in the state file's `info`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TemplateInfo {
    pub id: String,
    pub image_id: String,
    pub preload: String,
    /// What the agent reported when ready (python and numpy versions).
    pub agent: serde_json::Value,
    pub created_unix: u64,
    pub boot_ms: f64,
    pub memory_pages: u64,
}

pub struct Template {
    pub info: TemplateInfo,
    pub dir: PathBuf,
    /// The CPU it was made on (= this host's: `load` checks).
    cpu: CpuFingerprint,
    process: Process,
    /// Listening sockets of `process` (a template made from a session's sandbox).
    listeners: Vec<forkbox_linux::net::ListenerState>,
    memory: MemoryFile,
    pool: Arc<VmPool>,
}

/// Pre-created VMs kept ready per template (for forks; as many again for resumes).
const POOL_DEPTH: usize = 4;
/// Recycled VMs `keep_warm` keeps for new sessions.
const WARM_SPARES: usize = 2;

pub fn templates_dir(home: &Path) -> PathBuf {
    home.join("templates")
}

/// A template is named by what determines its content: the image, the
/// preload, the state format, the guest memory layout (page tables and their
/// pool: `forkbox_vmm::layout::LAYOUT_VERSION`), this forkbox's version and
/// the CPU the guest sees (`CpuFingerprint::digest`; another CPU means
/// another template).
pub fn template_id(image_id: &str, preload: &str, cpu_digest: &str) -> String {
    let mut h = Sha256::new();
    let version = FORMAT_VERSION.to_le_bytes();
    let layout = forkbox_vmm::layout::LAYOUT_VERSION.to_le_bytes();
    for part in [
        image_id.as_bytes(),
        preload.as_bytes(),
        &version,
        &layout,
        env!("CARGO_PKG_VERSION").as_bytes(),
        cpu_digest.as_bytes(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    for part in crate::sandbox::GUEST_ENV {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// The state of a template (registers, process, the info record) for the
/// guest parked in `vm`/`proc`. `about` is the record's id, preload, agent line
/// and build time in milliseconds.
fn template_state(
    engine: &Engine,
    (vm, process): (&Vm, forkbox_linux::process::ProcessState),
    cpu: CpuFingerprint,
    memory: forkbox_snapshot::MemoryStats,
    about: (&str, &str, serde_json::Value, f64),
) -> Result<Snapshot, EngineError> {
    let (id, preload, agent, boot_ms) = about;
    let info = TemplateInfo {
        id: id.to_string(),
        image_id: engine.image.id().to_string(),
        preload: preload.to_string(),
        agent,
        created_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        boot_ms,
        memory_pages: memory.pages,
    };
    Ok(Snapshot {
        image_id: engine.image.id().to_string(),
        cpu,
        vcpu: vm.save_vcpu()?.to_record(),
        process,
        memory,
        info: serde_json::to_string(&info).unwrap_or_default(),
        files: Default::default(),
        children: Default::default(),
    })
}

impl Template {
    /// Load the template for the engine's image + preload, or create it.
    pub fn ensure(engine: &Engine, home: &Path) -> Result<Template, EngineError> {
        let id = template_id(engine.image.id(), &engine.preload, &CpuFingerprint::of(&engine.cpu).digest());
        let dir = templates_dir(home).join(&id);
        if dir.join("state").exists() {
            match Template::load(engine, &dir) {
                Ok(t) => return Ok(t),
                Err(e) => tracing::warn!("template {id} unusable ({e}); rebuilding it"),
            }
        }
        Template::create(engine, &dir, &id)
    }

    /// Boot the guest, wait for the agent to be ready, and snapshot it into `dir`.
    pub fn create(engine: &Engine, dir: &Path, id: &str) -> Result<Template, EngineError> {
        let t0 = Instant::now();
        let sb = Sandbox::boot(engine, Limits::default(), false)?;
        let boot_ms = t0.elapsed().as_secs_f64() * 1000.0;
        std::fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
        let (vm, proc) = sb.parked_parts()?;
        let memory = write_memory(vm.mem(), &dir.join("memory"))?;
        let cpu = CpuFingerprint::of(&engine.cpu);
        let agent = sb.ready_info.clone();
        let state = template_state(engine, (vm, proc), cpu, memory, (id, &engine.preload, agent, boot_ms))?;
        write_state(&dir.join("state"), &state)?;
        drop(sb);
        Template::load(engine, dir)
    }

    /// A new template in `dir` (id `id`) from a parked sandbox of this template
    /// (a session's checkpoint, resumed): its whole memory (this template's pages
    /// with the sandbox's changes), registers and process state, its files
    /// included in the state. Self-contained: nothing refers to the session's
    /// layers or packs, so deleting the session leaves it working. `preload`
    /// says where it came from (it is not run again).
    pub fn snapshot_sandbox(
        &self,
        engine: &Engine,
        sb: &Sandbox,
        dir: &Path,
        id: &str,
        preload: &str,
    ) -> Result<Template, EngineError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
        let built = (|| {
            let (memory, state) = (dir.join("memory"), dir.join("state"));
            let mut m = std::fs::File::create(&memory).map_err(|e| io_err("create", &memory, e))?;
            let mut st = std::fs::File::create(&state).map_err(|e| io_err("create", &state, e))?;
            self.snapshot_into(engine, sb, &mut m, &mut st, id, preload)?;
            for (f, p) in [(&m, &memory), (&st, &state)] {
                f.sync_all().map_err(|e| io_err("fsync", p, e))?;
            }
            use std::os::unix::fs::PermissionsExt;
            m.set_permissions(std::fs::Permissions::from_mode(0o444)).map_err(|e| io_err("fchmod", &memory, e))?;
            Template::load(engine, dir)
        })();
        if built.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        built
    }

    /// The files of [`Self::snapshot_sandbox`] written into `memory` and
    /// `state`, new empty files the caller made (and syncs and names: a
    /// sandbox worker writes into file descriptors it was given).
    pub fn snapshot_into(
        &self,
        engine: &Engine,
        sb: &Sandbox,
        memory: &mut std::fs::File,
        state: &mut std::fs::File,
        id: &str,
        preload: &str,
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let (vm, proc) = sb.parked_parts()?;
        let stats = forkbox_snapshot::write_memory_over_into(vm.mem(), &self.memory.file, &*memory)?;
        let boot_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let agent = self.info.agent.clone();
        let snap = template_state(engine, (vm, proc), self.cpu.clone(), stats, (id, preload, agent, boot_ms))?;
        write_encoded_into(state, &encode(&snap))?;
        Ok(())
    }

    /// Open a template from disk: every file is verified before anything is
    /// mapped, and the CPU it was made on must be this one (`StateError::CpuMismatch`).
    pub fn load(engine: &Engine, dir: &Path) -> Result<Template, EngineError> {
        let snapshot = read_state(&dir.join("state"))?;
        let cpu = CpuFingerprint::of(&engine.cpu);
        if let Some(diff) = snapshot.cpu.differences(&cpu) {
            return Err(StateError::CpuMismatch(diff).into());
        }
        if snapshot.image_id != engine.image.id() {
            return Err(StateError::Corrupt(format!(
                "template is for image {}, the engine has {}",
                snapshot.image_id,
                engine.image.id()
            ))
            .into());
        }
        if snapshot.memory.size != RAM_SIZE {
            return Err(StateError::Corrupt(format!("memory size {} != {RAM_SIZE}", snapshot.memory.size)).into());
        }
        let info: TemplateInfo =
            serde_json::from_str(&snapshot.info).map_err(|e| StateError::Corrupt(format!("template info: {e}")))?;
        let memory = MemoryFile::open(&dir.join("memory"), &snapshot.memory)?;
        let Snapshot { mut process, vcpu, .. } = snapshot;
        let vcpu = VcpuState::from_record(&vcpu).map_err(|e| StateError::Corrupt(format!("vCPU state: {e}")))?;
        let listeners = std::mem::take(&mut process.listeners);
        let process = engine.restore_process(process)?;
        let pool = VmPool::new(engine.cpu.clone(), &memory.file, memory.view()?, vcpu, POOL_DEPTH)?;
        Ok(Template { info, dir: dir.to_path_buf(), cpu, process, listeners, memory, pool })
    }

    /// A new sandbox: a copy-on-write fork of this template.
    pub fn fork(&self, engine: &Engine, limits: Limits) -> Result<Sandbox, EngineError> {
        let (vm, reset) = self.pool.take()?;
        if !reset {
            vm.restore_vcpu(self.pool.vcpu())?;
        }
        Sandbox::resumed(
            engine,
            vm,
            self.process.clone(),
            limits,
            engine.vdso.is_some(),
            self.info.agent.clone(),
            Some(self.pool.clone()),
            true,
            &self.listeners,
        )
    }

    /// Off the request path (after a session's first call was answered): if
    /// the pool has fewer than two recycled VMs, make one by a fork that runs
    /// `pass` and ends here, so the next session starts warm (a pre-created
    /// VM faults in every page its first call touches: ~10 ms here).
    pub fn keep_warm(&self, engine: &Engine) {
        if self.pool.recycled_count() >= WARM_SPARES {
            return;
        }
        let warmed = self.fork(engine, Limits::default()).and_then(|mut sb| sb.exec("pass").map(|_| ()));
        if let Err(e) = warmed {
            tracing::debug!("warming a VM for the next session: {e}");
        }
    }

    /// A fork whose changes can be checkpointed (a session's first sandbox):
    /// a VM of the pool, warm like a one-shot fork's (a new one would fault
    /// in every page the first call touches), without KVM's dirty log. Its
    /// first checkpoint takes the pages that differ from the template (all
    /// a fork can have changed are private to its mapping) and turns the log
    /// on for the next ones (see [`Self::checkpoint_into`]). It never goes
    /// back to the pool.
    pub fn fork_tracked(&self, engine: &Engine, limits: Limits) -> Result<Sandbox, EngineError> {
        let (mut vm, reset) = self.pool.take_warm()?;
        if !reset {
            vm.restore_vcpu(self.pool.vcpu())?;
        }
        vm.mem_mut().track_writes();
        Sandbox::resumed(
            engine,
            vm,
            self.process.clone(),
            limits,
            engine.vdso.is_some(),
            self.info.agent.clone(),
            None,
            true,
            &self.listeners,
        )
    }

    /// Write a checkpoint of a parked, tracked sandbox: the pages changed since
    /// its previous checkpoint (or since the fork) as a layer at `layer`, the
    /// file chunks changed since then as a pack (`state` with extension
    /// `files`, only if any changed), and its state (registers, process state,
    /// where every file's chunks are) at `state`; each through a temp file,
    /// fsynced and renamed (see [`Self::checkpoint_into`]).
    ///
    /// `admit` gets the total bytes the checkpoint will take on disk and may
    /// refuse (a disk quota, a full disk); nothing is written then. On any
    /// failure no file of the checkpoint is left (temp files included).
    pub fn checkpoint<E: From<EngineError>>(
        &self,
        engine: &Engine,
        sb: &mut Sandbox,
        layer: &Path,
        state: &Path,
        admit: impl FnOnce(u64) -> Result<(), E>,
    ) -> Result<CheckpointStats, E> {
        let pack = state.with_extension("files");
        let procs = state.with_extension("procs");
        let tmp = |p: &Path| {
            let mut os = p.as_os_str().to_owned();
            os.push(".tmp");
            PathBuf::from(os)
        };
        let names =
            [(tmp(layer), layer), (tmp(&pack), pack.as_path()), (tmp(&procs), procs.as_path()), (tmp(state), state)];
        let create = |p: &Path| std::fs::File::create(p).map_err(|e| E::from(io_err("create", p, e)));
        let mut made = false;
        let pack_name = pack.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let stats = self.checkpoint_into(engine, sb, &pack_name, |size| {
            admit(size.bytes)?;
            made = true;
            Ok::<_, E>(CheckpointFiles {
                layer: create(&names[0].0)?,
                pack: if size.pack { Some(create(&names[1].0)?) } else { None },
                procs: if size.procs { Some(create(&names[2].0)?) } else { None },
                state: create(&names[3].0)?,
            })
        });
        let finish = |stats: CheckpointStats| -> Result<CheckpointStats, EngineError> {
            for (t, p) in &names {
                if (p == &pack.as_path() && stats.pack_bytes == 0) || (p == &procs.as_path() && stats.procs_bytes == 0)
                {
                    continue;
                }
                let f = std::fs::File::open(t).map_err(|e| io_err("open", t, e))?;
                f.sync_all().map_err(|e| io_err("fsync", t, e))?;
                std::fs::rename(t, p).map_err(|e| io_err("rename", p, e))?;
            }
            if let Some(dir) = state.parent() {
                if let Ok(d) = std::fs::File::open(dir) {
                    let _ = d.sync_all();
                }
            }
            Ok(stats)
        };
        let done = match stats {
            Ok(st) => finish(st).map_err(E::from),
            Err(e) => Err(e),
        };
        if done.is_err() && made {
            for (t, p) in &names {
                let _ = std::fs::remove_file(t);
                let _ = std::fs::remove_file(p);
            }
        }
        done
    }

    /// Write a checkpoint of a parked, tracked sandbox into files its caller
    /// made: the pages changed since its previous checkpoint (or since the
    /// fork) as a layer, the file chunks changed since then as a pack (only
    /// if any changed), and its state (registers, process state, where every
    /// file's chunks are). The caller fsyncs and names them; this never opens
    /// a path (a sandbox worker gets the files as descriptors).
    ///
    /// Everything is sized before anything is written: `admit` gets what the
    /// checkpoint will take on disk, may refuse (a disk quota, a full disk:
    /// nothing is written then), and otherwise hands over the files (`pack`
    /// only when [`CheckpointSize::pack`], `procs` only when
    /// [`CheckpointSize::procs`]). The layer, the pack and the child
    /// processes' memory layers (the pages they changed since the previous
    /// checkpoint, see `Sandbox::children_state`) stream from guest memory
    /// and the file bytes. A failure after `admit` leaves the files partly
    /// written (the caller removes them).
    pub fn checkpoint_into<E: From<EngineError>>(
        &self,
        engine: &Engine,
        sb: &mut Sandbox,
        pack_name: &str,
        admit: impl FnOnce(CheckpointSize) -> Result<CheckpointFiles, E>,
    ) -> Result<CheckpointStats, E> {
        // The other processes first (the agent's record counts their references).
        let procs_name = forkbox_snapshot::files::procs_name(pack_name);
        let (children, procs) = sb.children_state(self.pool.original(), &procs_name)?;
        let stored = std::mem::take(&mut sb.stored);
        let (vm, mut process) = sb.parked_parts_mut()?;
        let pages = if vm.logs_dirty_pages() {
            let mut bits = vm.dirty_log().map_err(EngineError::from)?;
            for (b, v) in bits.iter_mut().zip(vm.mem_mut().take_vmm_dirty()) {
                *b |= v;
            }
            pages_of(&bits)
        } else {
            // A pooled VM's first checkpoint (see `fork_tracked`); the log is on from here.
            let pages = changed_since_fork(vm.mem_mut(), self.pool.original())?;
            vm.start_dirty_log().map_err(EngineError::from)?;
            pages
        };
        let plan = LayerPlan::new(vm.mem(), self.pool.original(), &pages).map_err(EngineError::from)?;
        let files = crate::fsstore::FilesPlan::new(&mut process, &stored, pack_name);
        let snapshot = Snapshot {
            image_id: engine.image.id().to_string(),
            cpu: self.cpu.clone(),
            vcpu: vm.save_vcpu().map_err(EngineError::from)?.to_record(),
            process,
            memory: self.memory.stats.clone(),
            info: self.info.id.clone(),
            files: files.table.clone(),
            children,
        };
        let encoded = encode(&snapshot);
        drop(snapshot);
        let total = plan
            .bytes()
            .saturating_add(files.pack_bytes())
            .saturating_add(procs.bytes)
            .saturating_add(encoded.len() as u64);
        // (Refused: the caller drops the sandbox; `stored` is simply forgotten.)
        let CheckpointFiles { mut layer, pack, procs: procs_file, mut state } =
            admit(CheckpointSize { bytes: total, pack: files.pack_bytes() > 0, procs: procs.bytes > 0 })?;
        let werr = |what: &'static str| {
            move |source: std::io::Error| {
                E::from(EngineError::Snapshot(StateError::Io { what, path: "layer".into(), source }))
            }
        };
        plan.write_into(&mut layer).map_err(werr("write"))?;
        let layer_stats = plan.stats();
        let pack_bytes = match pack {
            Some(f) => files.write_pack_into(f).map_err(|e| E::from(e.into()))?,
            None if files.pack_bytes() > 0 => {
                return Err(E::from(EngineError::Snapshot(StateError::Corrupt("no file for the pack".into()))))
            }
            None => 0,
        };
        match procs_file {
            Some(mut f) => sb.write_children_memory(self.pool.original(), &procs, &mut f)?,
            None if procs.bytes > 0 => {
                return Err(E::from(EngineError::Snapshot(StateError::Corrupt(
                    "no file for the processes' memory".into(),
                ))))
            }
            None => {}
        }
        write_encoded_into(&mut state, &encoded).map_err(|e| E::from(e.into()))?;
        sb.stored = files.into_stored();
        Ok(CheckpointStats {
            layer: layer_stats,
            pack_bytes,
            procs_bytes: procs.bytes,
            state_bytes: encoded.len() as u64,
        })
    }

    /// Bring a checkpoint back: the template's memory with `layers` (newest
    /// first: the checkpoint's own, then its ancestors') applied, and the
    /// registers and process state of `state`. `reseed`: the checkpoint is
    /// being forked into a new session (its RNGs must diverge).
    pub fn resume(
        &self,
        engine: &Engine,
        layers: &[Layer],
        state: &Path,
        limits: Limits,
        reseed: bool,
    ) -> Result<Sandbox, EngineError> {
        self.resume_path(engine, layers, state, limits, if reseed { ResumeAs::Fork } else { ResumeAs::Same })
    }

    /// [`Self::resume`] for a sandbox that is never checkpointed (an
    /// alternative explored and dropped, an inspection): on a pooled, warm VM
    /// without dirty tracking that goes back to the pool when the sandbox ends
    /// (a tracked VM is made new each time, several ms). Always reseeded.
    pub fn resume_throwaway(
        &self,
        engine: &Engine,
        layers: &[Layer],
        state: &Path,
        limits: Limits,
    ) -> Result<Sandbox, EngineError> {
        self.resume_path(engine, layers, state, limits, ResumeAs::Throwaway)
    }

    /// The state file at `state`, its packs beside it.
    fn resume_path(
        &self,
        engine: &Engine,
        layers: &[Layer],
        state: &Path,
        limits: Limits,
        how: ResumeAs,
    ) -> Result<Sandbox, EngineError> {
        let f = std::fs::File::open(state).map_err(|e| io_err("open", state, e))?;
        let dir = state.parent().unwrap_or(Path::new("."));
        let mut packs = |names: &[String]| -> Result<std::collections::HashMap<String, std::fs::File>, EngineError> {
            let mut m = std::collections::HashMap::new();
            for n in names {
                let p = dir.join(n);
                m.insert(n.clone(), std::fs::File::open(&p).map_err(|e| io_err("open", &p, e))?);
            }
            Ok(m)
        };
        let shown = forkbox_snapshot::state::shown(state);
        self.resume_from(engine, layers, &f, &shown, &mut packs, limits, how)
    }

    /// Bring a checkpoint back from open files (what a sandbox worker gets from
    /// the API process: it never opens a path): `layers` newest first, parsed
    /// already; the state file `state` (named `shown` in errors); `packs` opens
    /// the packs the state's file table names (called once, with their names,
    /// only if it names any). `how`: tracked for the session's next checkpoint,
    /// tracked and reseeded (a fork of it), or a throwaway on a pooled VM.
    #[allow(clippy::too_many_arguments)]
    pub fn resume_from(
        &self,
        engine: &Engine,
        layers: &[Layer],
        state: &std::fs::File,
        shown: &str,
        packs: &mut PackOpener<'_>,
        limits: Limits,
        how: ResumeAs,
    ) -> Result<Sandbox, EngineError> {
        let (reseed, pooled) = match how {
            ResumeAs::Same => (false, false),
            ResumeAs::Fork => (true, false),
            ResumeAs::Throwaway => (true, true),
        };
        let t0 = Instant::now();
        let mut snapshot = forkbox_snapshot::read_state_from(state, shown).map_err(|e| match e {
            StateError::Corrupt(why) => StateError::Corrupt(format!("{shown}: {why}")),
            e => e,
        })?;
        let t_state = t0.elapsed();
        // First: a checkpoint from another CPU is also from another template,
        // but this is the reason to tell.
        if let Some(diff) = snapshot.cpu.differences(&self.cpu) {
            return Err(StateError::CpuMismatch(format!("checkpoint {shown}: {diff}")).into());
        }
        let vcpu = VcpuState::from_record(&snapshot.vcpu)
            .map_err(|e| StateError::Corrupt(format!("{shown}: vCPU state: {e}")))?;
        if snapshot.image_id != engine.image.id()
            || snapshot.info != self.info.id
            || snapshot.memory != self.memory.stats
        {
            return Err(StateError::Corrupt(format!("checkpoint {shown} is not from template {}", self.info.id)).into());
        }
        snapshot.files.validate()?;
        // The packs and the child processes' memory files, asked for at once.
        let children = std::mem::take(&mut snapshot.children);
        let memory_names = children.memory_files()?;
        let mut names = snapshot.files.packs.clone();
        names.extend(memory_names.iter().filter(|n| !snapshot.files.packs.contains(*n)).cloned());
        let mut pack_files = if names.is_empty() { Default::default() } else { packs(&names)? };
        let memory_files: std::collections::HashMap<String, std::fs::File> =
            memory_names.iter().filter_map(|n| pack_files.remove(n).map(|f| (n.clone(), f))).collect();
        // A VM of the pool either way, made off the request path (making one
        // here was most of a resume's time). A tracked one is a pre-created VM
        // with the dirty-page log on (the recycled, warm ones stay for forks),
        // and records what the VMM changes from here on.
        let (mut vm, pool, recycled) = if pooled {
            let (vm, recycled) = self.pool.take()?;
            (vm, Some(self.pool.clone()), recycled)
        } else {
            let mut vm = self.pool.take_fresh(true)?;
            vm.mem_mut().track_writes();
            (vm, None, false)
        };
        let t_vm = t0.elapsed();
        // A pre-created VM's memory is the template's, untouched: only the
        // runs that differ are written into it. A recycled one's is not.
        let pages = match recycled {
            false => apply_layers_in_place(vm.mem_mut(), layers)?,
            true => apply_layers(vm.mem_mut(), self.pool.original(), layers)?,
        };
        let t_pages = t0.elapsed();
        vm.restore_vcpu(&vcpu)?;
        let mut reader = PackReader::with_files(pack_files);
        let stored = crate::fsstore::load(&mut snapshot.process, &snapshot.files, &mut reader)?;
        let listeners = std::mem::take(&mut snapshot.process.listeners);
        let t_files = t0.elapsed();
        let others: Vec<&forkbox_linux::fd::FdTable> = children.processes.iter().map(|c| &c.process.fds).collect();
        let process = engine.restore_process_sharing(snapshot.process, &others)?;
        let t_process = t0.elapsed();
        // The page tables are a function of the memory map: make sure they
        // say exactly what it says (only differences are written).
        process.mm.sync_all_page_tables(vm.mem_mut())?;
        let t_tables = t0.elapsed();
        let mut sb = Sandbox::resumed(
            engine,
            vm,
            process,
            limits,
            engine.vdso.is_some(),
            self.info.agent.clone(),
            pool,
            reseed,
            &listeners,
        )?;
        sb.stored = stored;
        sb.restore_children(children, &self.pool, &memory_files)?;
        tracing::debug!(?t_state, ?t_vm, ?t_pages, ?t_files, ?t_process, ?t_tables, total = ?t0.elapsed(), pages, "resumed a checkpoint");
        Ok(sb)
    }

    /// Fork/recycling counters.
    pub fn pool_stats(&self) -> &crate::pool::PoolStats {
        &self.pool.stats
    }

    /// The bound on the host memory the recycled VMs of this template hold
    /// (`PoolStats::recycled_private_bytes`).
    pub fn max_recycled_bytes(&self) -> u64 {
        self.pool.max_recycled_bytes()
    }

    /// The CPU the template was made on (this host's).
    pub fn cpu(&self) -> &CpuFingerprint {
        &self.cpu
    }

    /// The memory file's size and checksum as recorded.
    pub fn memory(&self) -> &MemoryFile {
        &self.memory
    }
}

/// The pages of a fork's memory that differ from the template's `original`
/// (ascending): among those private to its mapping (whatever the guest or
/// the VMM wrote, pages a recycled VM keeps warm with the template's bytes
/// too), the VMM's writes and discards, and shared ranges (never private).
fn changed_since_fork(mem: &mut GuestMemory, original: &[u8]) -> Result<Vec<u64>, EngineError> {
    let mut bits = mem.private_pages()?;
    for (b, v) in bits.iter_mut().zip(mem.take_vmm_dirty()) {
        *b |= v;
    }
    let page = forkbox_vmm::layout::PAGE_SIZE;
    for (at, r) in mem.shared_ranges() {
        let (first, end) = (at / page, at.saturating_add(r.len).div_ceil(page));
        for p in first..end {
            if let Some(w) = bits.get_mut((p / 64) as usize) {
                *w |= 1 << (p % 64);
            }
        }
    }
    let mut out = Vec::new();
    for p in pages_of(&bits) {
        let at = p.saturating_mul(page);
        let now = mem.slice(at, page).map_err(EngineError::from)?;
        let was = usize::try_from(at).ok().and_then(|a| original.get(a..a.saturating_add(page as usize)));
        if was != Some(now) {
            out.push(p);
        }
    }
    Ok(out)
}

/// The info of the template in `dir` (its state file verified).
pub fn read_info(dir: &Path) -> Result<TemplateInfo, String> {
    read_state(&dir.join("state"))
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str::<TemplateInfo>(&s.info).map_err(|e| e.to_string()))
}

/// Templates present in the data directory.
pub fn list(home: &Path) -> Vec<(PathBuf, Result<TemplateInfo, String>)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(templates_dir(home)) else { return out };
    for e in rd.flatten() {
        let dir = e.path();
        let info = read_state(&dir.join("state"))
            .map_err(|e| e.to_string())
            .and_then(|s| serde_json::from_str::<TemplateInfo>(&s.info).map_err(|e| e.to_string()));
        out.push((dir, info));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn io_err(what: &'static str, path: &Path, source: std::io::Error) -> EngineError {
    EngineError::Snapshot(StateError::io(what, path, source))
}

/// Opens the packs a checkpoint's state names, by name (see [`Template::resume_from`]).
pub type PackOpener<'a> =
    dyn FnMut(&[String]) -> Result<std::collections::HashMap<String, std::fs::File>, EngineError> + 'a;

/// How a checkpoint comes back (see [`Template::resume_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResumeAs {
    /// As the same session: tracked for its next checkpoint, RNGs kept.
    Same,
    /// As a new session forked from it: tracked, RNGs reseeded.
    Fork,
    /// For one look and then dropped (never checkpointed): a pooled, untracked VM, reseeded.
    Throwaway,
}

/// What a checkpoint will take on disk, known before anything is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointSize {
    /// Layer + pack + process memory + state.
    pub bytes: u64,
    /// Some file chunks changed: there is a pack to write.
    pub pack: bool,
    /// Child processes wrote memory: there is a process memory file to
    /// write (`<name>.procs`, named like the pack).
    pub procs: bool,
}

/// The files a checkpoint is written into (see [`Template::checkpoint_into`]):
/// new empty files the caller made and syncs and names afterwards.
pub struct CheckpointFiles {
    pub layer: std::fs::File,
    /// Only when [`CheckpointSize::pack`].
    pub pack: Option<std::fs::File>,
    /// Only when [`CheckpointSize::procs`].
    pub procs: Option<std::fs::File>,
    pub state: std::fs::File,
}

/// What a checkpoint wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointStats {
    pub layer: LayerStats,
    /// The pack of changed file chunks (0: none was written).
    pub pack_bytes: u64,
    /// The child processes' memory layers (0: none was written).
    pub procs_bytes: u64,
    pub state_bytes: u64,
}

impl CheckpointStats {
    /// Bytes on disk of the whole checkpoint.
    pub fn bytes(&self) -> u64 {
        self.layer.bytes + self.pack_bytes + self.procs_bytes + self.state_bytes
    }
}

/// Engine-level conveniences over templates.
impl Engine {
    /// One-shot: fork, exec, discard.
    pub fn exec(&self, template: &Template, code: &str, limits: Limits) -> Result<crate::ExecResult, EngineError> {
        template.fork(self, limits)?.exec(code)
    }

    /// Run each code in its own fork, in parallel across `workers` threads.
    pub fn exec_batch(
        &self,
        template: &Template,
        codes: &[String],
        limits: &Limits,
        workers: usize,
    ) -> Vec<Result<crate::ExecResult, EngineError>> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results: Vec<std::sync::Mutex<Option<Result<crate::ExecResult, EngineError>>>> =
            codes.iter().map(|_| std::sync::Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..workers.max(1).min(codes.len().max(1)) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(code) = codes.get(i) else { break };
                    let r = self.exec(template, code, limits.clone());
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(r);
                    }
                });
            }
        });
        results
            .into_iter()
            .map(|m| {
                m.into_inner().ok().flatten().unwrap_or_else(|| Err(EngineError::Protocol("batch worker lost".into())))
            })
            .collect()
    }
}

/// Shared engine + template, for servers and benches.
pub type SharedTemplate = Arc<Template>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The golden template state files (crates/snapshot/tests/golden) carry a
    /// `TemplateInfo` this code reads, and writes back to the same JSON.
    #[test]
    fn golden_template_states_hold_a_template_info() {
        for v in forkbox_snapshot::READABLE_VERSIONS {
            let path = format!("{}/../snapshot/tests/golden/template-state-v{v}.bin", env!("CARGO_MANIFEST_DIR"));
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let snap = forkbox_snapshot::state::decode(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"));
            let info: TemplateInfo =
                serde_json::from_str(&snap.info).unwrap_or_else(|e| panic!("{path}: template info: {e}"));
            assert_eq!(info.image_id, snap.image_id);
            assert_eq!(info.memory_pages, snap.memory.pages);
            if *v == FORMAT_VERSION {
                assert_eq!(serde_json::to_string(&info).unwrap(), snap.info, "TemplateInfo's JSON changed");
            }
        }
    }

    #[test]
    fn the_template_id_depends_on_the_cpu() {
        let a = template_id("img", "import numpy", "cpu-a");
        assert_eq!(a, template_id("img", "import numpy", "cpu-a"));
        assert_ne!(a, template_id("img", "import numpy", "cpu-b"));
        assert_ne!(a, template_id("img", "import json", "cpu-a"));
    }
}
