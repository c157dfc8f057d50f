//! A sandbox: the agent's guest process in its VM, driven through the agent
//! channel, and the processes it forks.
//!
//! Processes: each guest process is its own KVM VM (own guest memory, page
//! tables and vCPU), so processes are isolated from each other by the hardware
//! as sandboxes are. All processes of a sandbox are driven by the sandbox's one
//! host thread: the scheduler that switches green threads on a vCPU switches
//! processes too (`crate::sched`: the current process' VM and state are its
//! `cur` task, the others wait in `others`), so a sandbox uses at most one core and the
//! deadline, the interrupt and the CPU budget cover the whole tree. What all
//! processes share — the file system, open file descriptions (pipes, files,
//! sockets), host network state, the process table — lives once: in `kernel`, or
//! in the fields of `Process` that go with the running process
//! (`Process::swap_shared`). A fork's child memory is the parent's backing file
//! mapped copy-on-write plus a copy of only the parent's private pages
//! (PAGEMAP_SCAN), never a copy of all guest memory. vfork and
//! clone(CLONE_VM|CLONE_VFORK) are forks (the child has a copy of memory; the
//! parent is not suspended). Children still running when an exec ends are
//! killed (one note line on stderr), unless the sandbox keeps them running
//! (`set_keep_running`, a session's): then they, and the agent's own other
//! threads, go on running between calls when its host calls
//! `run_background`, the agent's main thread parked on its channel all along.
//! A checkpoint records every process at the park point (the sandbox between
//! two slices, the agent current): the agent process (all its threads) in
//! the state's `process`, which holds what all share (file system, open file
//! descriptions, the run clock); each other process in its `children`
//! (`Sandbox::children_state`): its own kernel state (`ChildState`: its
//! descriptors naming the shared descriptions, threads, signals, ...), its
//! vCPU, where its current thread stands, and where its memory is: a chain
//! of layers over its base (the template's memory for a child that still
//! maps it, zeros after an execve) in the checkpoints' process memory files
//! (`<name>.procs` beside each state: the pages each child wrote since the
//! previous checkpoint, from its VM's dirty log; the whole of a child's
//! memory only the first time it is recorded); and the process table,
//! zombies included. A restore makes a VM per child over that memory
//! (`Sandbox::restore_children`). A child that maps
//! memory shared with another process is not recorded: the record has it
//! killed by SIGKILL (a zombie of its parent) and the descriptions only it
//! held closed.
//!
//! Memory shared between processes (`forkbox_linux::shm`) is one host memfd
//! per shared object mapped over the same guest range in every process VM
//! that maps it (`GuestMemory::map_shared`; `fork_copy` maps the parent's
//! again). A futex wake on shared memory queues the wake for the other
//! processes; `Scheduler::deliver_shared_wakes` marks their waiters on the same
//! (object, offset) woken right after the syscall (their recheck at the next
//! rotation returns 0). A time slice ends by time (5 ms) whether or not the
//! vCPU ran into its deadline: a thread that makes syscalls all the time
//! (a poll loop) does not starve the others. At the end of an exec, after the
//! children are killed, the agent's shared ranges become private memory
//! (`privatize_shared`), so parked state holds no shared object.

use std::time::{Duration, Instant};

pub use forkbox_linux::kernel::state::Stream;
use forkbox_linux::kernel::Kernel;
use forkbox_linux::kernel::{Ctx, Effect, ExecSpec, ForkSpec};
use forkbox_linux::layout::RAM_SIZE;
use forkbox_linux::loader;
use forkbox_linux::process::ProcessState;
use forkbox_linux::syscalls;
use forkbox_linux::thread::{SavedCpu, SigInfo, Wait, WaitKind, MAIN_TID, SI_KERNEL};
use forkbox_linux::vfs::Changes;
use forkbox_linux::Errno;
use forkbox_linux::Process;
use forkbox_vmm::{after_syscall, kvm_regs, GuestMemory, Regs, Vm, VmExit, Xsave};
use serde::Serialize;

use crate::error::EngineError;
use crate::files::{self, FileEntry, OutputFile, OutputIndex};
use crate::interrupt::Interrupter;
use crate::jobs::{JobChunk, JobInfo, Jobs};
use crate::limits::Limits;
use crate::protocol::{self, ExecReply, ExecRequest, MimeBundle, PyError};
use crate::sched::{wait_kind, HostWait, Scheduler, Task};
use crate::signal::{self, SignalState, SIGINT};
use crate::Engine;
use forkbox_linux::procs::{Exit, GUEST_PID};
use forkbox_vmm::Cpu;
use std::sync::Arc;

/// The guest program: CPython running the agent.
pub const AGENT_PATH: &str = "/opt/forkbox/agent.py";
const PYTHON: &str = "/usr/bin/python3";

/// The guest's environment (besides `FORKBOX_PRELOAD`). The guest has no threads:
/// every BLAS/OpenMP runtime is pinned to one thread here, so none of them ever calls
/// clone (OpenBLAS starts its thread pool only when its thread count is > 1).
/// matplotlib draws with Agg (no display). Part of every template's id.
pub const GUEST_ENV: &[&str] = &[
    "PATH=/usr/local/bin:/usr/bin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    "TERM=dumb",
    "TZ=UTC",
    "OPENBLAS_NUM_THREADS=1",
    "OMP_NUM_THREADS=1",
    "MKL_NUM_THREADS=1",
    "BLIS_NUM_THREADS=1",
    "NUMEXPR_NUM_THREADS=1",
    "MPLBACKEND=Agg",
];

/// The outcome of one exec. A Python exception is a result (`error` set), not an `Err`.
/// (Deserialize: a sandbox worker process sends it to the API process.)
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct ExecResult {
    /// repr() of the last expression, if the code ended with one that is not None.
    pub value: Option<String>,
    pub stdout: String,
    pub stderr: String,
    pub error: Option<PyError>,
    /// Time spent running the code inside the guest.
    pub runtime_ms: f64,
    /// Wall time of the exec as seen by the host (resume to park).
    pub wall_ms: f64,
    /// Syscalls (VM exits for the VMM) during this exec.
    pub syscalls: u64,
    /// Files under `/output` this exec created or changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFile>,
    /// The value's rich forms beside `value` (text/plain): `text/html` for a
    /// DataFrame, `image/png` for a PIL image, ... (`_repr_*_` methods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_data: Option<MimeBundle>,
    /// What `display(obj)` showed and the matplotlib figures left open at the end
    /// (or `plt.show()`n), in order, as MIME bundles.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub display: Vec<MimeBundle>,
}

/// A sink for streamed output: called with each chunk as the guest writes it.
pub type OutputSink<'a> = &'a mut (dyn FnMut(Stream, &[u8]) + Send);

/// How to run one exec (`Sandbox::exec_with`).
#[derive(Default)]
pub struct ExecOptions<'a> {
    /// Called with each chunk the guest writes to fd 1 / fd 2, as it is written
    /// (the agent line-buffers stdout/stderr for such an exec). The full output
    /// is still in the `ExecResult`, with the same limits.
    pub on_output: Option<OutputSink<'a>>,
    /// Triggered from another thread to interrupt the exec (Ctrl-C).
    pub interrupt: Option<Interrupter>,
    /// This exec's time limit instead of the sandbox's `Limits::timeout` (the
    /// caller bounds it: a session's record holds its current maximum).
    pub timeout: Option<Duration>,
    /// Each process the agent forks in this exec starts a background job
    /// (its output goes to the job's rings, see [`Sandbox::jobs`]).
    pub job: bool,
    /// Code the agent runs just before `code`, in the same namespace but
    /// compiled on its own (`<forkbox-prelude>`), so a caller's setup of the
    /// session rides with the call without moving `code`'s line numbers in a
    /// traceback. An exception in it is the exec's error, and `code` does not run.
    pub prelude: Option<&'a str>,
}

/// A listening TCP socket of the sandbox (what the port proxy can reach).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ListeningPort {
    /// The address it is bound to inside the sandbox (loopback or wildcard).
    pub address: std::net::SocketAddr,
    /// A connection to 127.0.0.1 or [::1] on its port lands on it: the port
    /// proxy reaches it.
    pub proxied: bool,
}

/// The job of the processes an earlier call left running that are no job's:
/// what they write is dropped (no job has pid 0).
const DROPPED_OUTPUT: u32 = 0;
/// How long a job wait runs background work before it looks at the job again.
const JOB_WAIT_SLICE: Duration = Duration::from_millis(10);
/// How long a follower's wait sleeps when no background work can run.
const JOB_WATCH_IDLE: Duration = Duration::from_millis(2);
/// What an exec wrote to stdout/stderr before it failed (timeout, crash, exit,
/// kill): the same capture, with the same limits, as a result's output.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct CapturedOutput {
    pub stdout: String,
    pub stderr: String,
}

impl CapturedOutput {
    pub fn is_empty(&self) -> bool {
        self.stdout.is_empty() && self.stderr.is_empty()
    }
}

/// Counters of one guest run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunStats {
    pub syscalls: u64,
    pub unimplemented: Vec<(String, u64, u64)>,
    /// Every partial, refused or unknown syscall the run made, with its support level and note.
    pub unsupported: Vec<syscalls::UnsupportedCall>,
}

#[derive(Debug, Clone)]
enum State {
    /// Parked on the agent's read; `regs` are those of that read syscall.
    Parked(kvm_regs),
    /// An exec failed in a way that leaves the guest unusable.
    Poisoned(String),
}

enum Stop {
    Parked(kvm_regs),
}

pub struct Sandbox {
    /// Its processes and threads, and who is on the vCPU.
    sched: Scheduler,
    kernel: Kernel,
    state: State,
    limits: Limits,
    /// What the agent reported when it became ready (python/numpy versions).
    pub ready_info: serde_json::Value,
    /// Time from creation to the agent's first park.
    pub boot_time: Duration,
    /// A fork that has not run yet: its first request tells the agent to
    /// reseed what lives in guest memory (random, numpy.random).
    reseed_pending: bool,
    /// The number the next exec's code is named by in tracebacks (`<exec-N>`;
    /// None: the agent's own count), see `set_exec_id`.
    exec_id: Option<i64>,
    vdso: bool,
    /// Where a forked sandbox's VM goes back to when it ends cleanly.
    pool: Option<std::sync::Arc<crate::pool::VmPool>>,
    /// `/output` as of the last exec (to report what the next one changes).
    outputs: OutputIndex,
    /// SIGINT delivery in the current run (host-side, never snapshotted).
    sig: SignalState,
    /// The file bytes the latest checkpoint stored (for the next one's diff).
    pub(crate) stored: crate::fsstore::StoredFiles,
    /// The time limit of the exec running now (the Timeout error names it).
    exec_timeout: Duration,
    /// What the last exec wrote before it failed (see [`Sandbox::take_failed_output`]).
    failed_output: Option<CapturedOutput>,
    /// To make VMs for children and execve.
    cpu: Arc<Cpu>,
    exec_opts: loader::ExecOptions,
    /// Children and threads left running by an exec keep running between calls.
    keep_running: bool,
    /// Background jobs (host-side: a checkpoint does not record them).
    jobs: Jobs,
    /// During [`Sandbox::run_background_woken`]: a host fd whose readability
    /// ends the run at once (the channel a request comes on), polled with the
    /// guest's own host fds whenever every thread waits.
    bg_wake: Option<std::os::fd::RawFd>,
    /// Time its vCPUs ran (every process, in calls and between them): its CPU time.
    cpu_total: Duration,
}

/// The memory layers of the children a checkpoint records, planned by
/// [`Sandbox::children_state`] and written by [`Sandbox::write_children_memory`]:
/// for each, its index among the other processes, whether its base is the
/// template's memory, its pages (ascending) and where its record says it is;
/// `bytes` in all.
#[derive(Default)]
pub(crate) struct ChildrenMemory {
    parts: Vec<(usize, bool, Vec<u64>, forkbox_snapshot::MemoryRef)>,
    pub(crate) bytes: u64,
}

/// The base a child's memory layer is over: the template's memory
/// (`original`) or zeros (a read-only view of fresh anonymous memory, made
/// once into `zeros`).
fn child_base<'a>(
    on_template: bool,
    original: &'a [u8],
    zeros: &'a mut Option<GuestMemory>,
) -> Result<&'a [u8], EngineError> {
    if on_template {
        return Ok(original);
    }
    if zeros.is_none() {
        *zeros = Some(GuestMemory::anonymous(RAM_SIZE)?);
    }
    match zeros {
        Some(z) => Ok(z.slice(0, RAM_SIZE)?),
        None => Ok(&[]),
    }
}

/// The pages of a child's memory that differ from `base` (its template's
/// memory, or zeros): among those private to its mapping (PAGEMAP_SCAN:
/// whatever the guest or the VMM wrote), those of its shared file mappings
/// (recorded as its own copy) and, over a file, those discarded.
fn changed_pages(mem: &GuestMemory, base: &[u8]) -> Result<Vec<u64>, EngineError> {
    let page = forkbox_vmm::layout::PAGE_SIZE;
    let mut bits = mem.private_pages()?;
    let shared = mem.shared_ranges().map(|(at, r)| (at, r.len));
    for (at, len) in mem.discarded_ranges().iter().copied().chain(shared) {
        for p in at / page..at.saturating_add(len).div_ceil(page) {
            if let Some(w) = bits.get_mut((p / 64) as usize) {
                *w |= 1 << (p % 64);
            }
        }
    }
    let mut out = Vec::new();
    for p in forkbox_snapshot::layer::pages_of(&bits) {
        let at = p.saturating_mul(page);
        let now = mem.slice(at, page)?;
        let was = usize::try_from(at).ok().and_then(|a| base.get(a..a.saturating_add(page as usize)));
        if was != Some(now) {
            out.push(p);
        }
    }
    Ok(out)
}

/// The pages of a child's memory written since its previous checkpoint: its
/// VM's dirty log (the guest's writes), the VMM's writes, and its shared file
/// mappings (another process may have written their file since).
fn written_pages(vm: &mut Vm) -> Result<Vec<u64>, EngineError> {
    let page = forkbox_vmm::layout::PAGE_SIZE;
    let mut bits = vm.dirty_log()?;
    for (b, v) in bits.iter_mut().zip(vm.mem_mut().take_vmm_dirty()) {
        *b |= v;
    }
    for (at, r) in vm.mem().shared_ranges() {
        for p in at / page..at.saturating_add(r.len).div_ceil(page) {
            if let Some(w) = bits.get_mut((p / 64) as usize) {
                *w |= 1 << (p % 64);
            }
        }
    }
    Ok(forkbox_snapshot::layer::pages_of(&bits))
}

/// What [`Sandbox::run_background`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackgroundRun {
    /// It ran until its time was up: there may be more to do at once.
    Busy,
    /// Nothing could run (every thread waits): call again after a while.
    Idle,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.sched.make_main_current();
        for t in self.sched.others.drain(..) {
            if let Some(vm) = t.vm {
                crate::pool::reap(vm);
            }
        }
        let Some(vm) = self.sched.cur.vm.take() else { return };
        match (&self.state, &self.pool) {
            // Only a guest parked on the agent's read is in a known state worth resetting.
            (State::Parked(_), Some(pool)) => pool.recycle(vm),
            _ => crate::pool::reap(vm),
        }
    }
}

impl Sandbox {
    /// Start CPython + the agent from the image and run it until it waits for
    /// its first request (numpy imported).
    pub fn boot(engine: &Engine, limits: Limits, trace: bool) -> Result<Sandbox, EngineError> {
        let t0 = Instant::now();
        let mem = GuestMemory::anonymous(RAM_SIZE)?;
        let mut vm = Vm::new(&engine.cpu, mem)?;
        let mut vfs = engine.vfs.clone();
        vfs.set_quota(limits.disk_bytes);
        let mut proc = Process::new(vfs, limits.memory_bytes);
        let env_preload = format!("FORKBOX_PRELOAD={}", engine.preload);
        let mut envp: Vec<&str> = GUEST_ENV.to_vec();
        envp.push(env_preload.as_str());
        let argv = [PYTHON, "-I", "-B", AGENT_PATH];
        let opts = loader::ExecOptions { hwcap: engine.hwcap, vdso: engine.vdso };
        let start = loader::exec(vm.mem_mut(), &mut proc, PYTHON, &argv, &envp, &opts)?;
        vm.boot(&engine.cpu, start.entry, start.rsp)?;
        // Only what the guest mapped is present for it, with its protections.
        proc.mm.sync_all_page_tables(vm.mem_mut())?;
        crate::vdso::refresh(&mut vm, engine.vdso.is_some())?;
        let mut kernel = Kernel::new(limits.output_bytes);
        kernel.net = forkbox_linux::net::NetIo::new(std::sync::Arc::new(limits.network.clone()));
        kernel.trace = trace;
        let mut sb = Sandbox {
            sched: Scheduler::new(vm, proc, limits.memory_bytes),
            kernel,
            state: State::Poisoned("not started".into()),
            exec_timeout: limits.timeout,
            failed_output: None,
            limits,
            ready_info: serde_json::Value::Null,
            boot_time: Duration::ZERO,
            reseed_pending: false,
            exec_id: None,
            vdso: engine.vdso.is_some(),
            pool: None,
            outputs: OutputIndex::default(),
            sig: SignalState::default(),
            stored: Default::default(),
            cpu: engine.cpu.clone(),
            exec_opts: opts,
            keep_running: false,
            bg_wake: None,
            cpu_total: Duration::ZERO,
            jobs: Jobs::default(),
        };
        // Booting python + numpy takes far longer than one exec here: allow a generous deadline.
        let deadline = Instant::now() + sb.limits.timeout.max(Duration::from_secs(120));
        let Stop::Parked(regs) = sb.run(None, deadline, &mut None).map_err(|e| match e {
            EngineError::Timeout(_) => EngineError::Boot("timed out before the agent was ready".into()),
            e => EngineError::Boot(format!("{e}; stderr: {}", String::from_utf8_lossy(&sb.kernel.stderr.data))),
        })?;
        // As at the end of an exec: one process, no shared objects in what a template stores
        // (a preload may have made a multiprocessing Lock: its mapping becomes private memory).
        sb.end_children();
        let (info, _) = protocol::unframe(&std::mem::take(&mut sb.kernel.agent_out))?;
        if info.get("ready") != Some(&serde_json::Value::Bool(true)) {
            return Err(EngineError::Boot(format!("agent not ready: {info}")));
        }
        sb.kernel.stdout.take();
        sb.kernel.stderr.take();
        sb.ready_info = info;
        sb.state = State::Parked(regs);
        sb.boot_time = t0.elapsed();
        Ok(sb)
    }

    /// A sandbox resumed from a snapshot: `vm` already holds its memory and
    /// vCPU state, parked on the agent's read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resumed(
        engine: &Engine,
        vm: Vm,
        mut proc: Process,
        limits: Limits,
        vdso: bool,
        info: serde_json::Value,
        pool: Option<std::sync::Arc<crate::pool::VmPool>>,
        reseed: bool,
        listeners: &[forkbox_linux::net::ListenerState],
    ) -> Result<Sandbox, EngineError> {
        proc.mm.set_limit(limits.memory_bytes);
        proc.vfs.set_quota(limits.disk_bytes);
        let regs = vm.regs()?;
        let mut kernel = Kernel::new(limits.output_bytes);
        // Fresh host-side network state: sockets in `proc` from the snapshot read as
        // reset, except its listeners, which are made again (empty queues).
        kernel.net = forkbox_linux::net::NetIo::new(std::sync::Arc::new(limits.network.clone()));
        restore_listeners(&mut kernel.net, &proc, listeners)?;
        Ok(Sandbox {
            sched: Scheduler::new(vm, proc, limits.memory_bytes),
            kernel,
            state: State::Parked(regs),
            exec_timeout: limits.timeout,
            failed_output: None,
            limits,
            ready_info: info,
            boot_time: Duration::ZERO,
            reseed_pending: reseed,
            exec_id: None,
            vdso,
            pool,
            outputs: OutputIndex::default(),
            sig: SignalState::default(),
            stored: Default::default(),
            cpu: engine.cpu.clone(),
            exec_opts: loader::ExecOptions { hwcap: engine.hwcap, vdso: engine.vdso },
            keep_running: false,
            bg_wake: None,
            cpu_total: Duration::ZERO,
            jobs: Jobs::default(),
        })
    }

    /// The parts of a parked sandbox a template needs: its VM and the state
    /// of the agent process alone ([`Sandbox::agent_state`]: processes
    /// running beside it are not in a template).
    pub(crate) fn parked_parts(&self) -> Result<(&Vm, ProcessState), EngineError> {
        match (&self.state, &self.sched.cur.vm) {
            (State::Parked(_), Some(vm)) => Ok((vm, self.agent_state(false))),
            (State::Poisoned(why), _) => Err(EngineError::Poisoned(why.clone())),
            _ => Err(EngineError::Poisoned("no VM".into())),
        }
    }

    /// Mutable parts of a parked sandbox (for a checkpoint): the agent's VM
    /// and process state, with the other processes the checkpoint records
    /// (see [`Sandbox::children_state`]) still holding their descriptions.
    pub(crate) fn parked_parts_mut(&mut self) -> Result<(&mut Vm, ProcessState), EngineError> {
        let state = self.agent_state(true);
        match (&self.state, &mut self.sched.cur.vm) {
            (State::Parked(_), Some(vm)) => Ok((vm, state)),
            (State::Poisoned(why), _) => Err(EngineError::Poisoned(why.clone())),
            _ => Err(EngineError::Poisoned("no VM".into())),
        }
    }

    /// The agent process as a state file records it (parked: it is the
    /// current process). With `children`, the other processes a checkpoint
    /// records ([`recordable`]) keep their references to the open file
    /// descriptions; the descriptions only the others hold (all of them
    /// without `children`) are closed in the record, as if they had ended.
    fn agent_state(&self, children: bool) -> ProcessState {
        let held: Vec<u64> = self
            .sched
            .others
            .iter()
            .filter(|t| !(children && self.child_memory_map(t).is_ok()))
            .flat_map(|t| t.proc.fds.fds().filter_map(|fd| t.proc.fds.ofd(fd).ok()).collect::<Vec<_>>())
            .collect();
        let mut st = self.sched.cur.proc.save_state_without(&held);
        // Listeners the record's fd table still names keep listening after a restore.
        st.listeners = self.kernel.net.listener_states(st.fds.sockets().filter(|s| s.stream).map(|s| s.id));
        st
    }

    /// The sandbox's other processes as a checkpoint records them, at this
    /// park point (the agent is the current process): each running child's
    /// own state, vCPU, where its thread stands and where its memory is, and
    /// the process table. A child's memory is a chain of layers over its
    /// base (`original`, the template's memory, for a child that still maps
    /// it; zeros after an execve) in the checkpoints' process memory files:
    /// this checkpoint's (`procs_file`, whose bytes are returned) holds the
    /// pages each child wrote since the previous checkpoint (KVM's dirty log
    /// of its VM and the VMM's writes; nothing for a child that wrote
    /// nothing), over that checkpoint's layers; a child not recorded before
    /// (or whose chain reached `MAX_MEMORY_CHAIN`) is recorded whole, the
    /// pages that differ from its base, and its log starts. A child that
    /// maps memory shared with another process is not recorded (its state is
    /// split across processes): it reads as killed by SIGKILL after a
    /// restore (a zombie its parent can wait for), and the descriptions only
    /// it held are closed in the record.
    ///
    /// The layers are planned here (sized and checksummed, so the records
    /// say where each is) and written by [`Sandbox::write_children_memory`]
    /// once the checkpoint's files are there, streamed from the children's
    /// memory (no host buffer of a child's pages).
    ///
    /// The children's chains and logs move on here: a checkpoint that is
    /// then not written or not committed leaves the sandbox unusable for the
    /// next one (its caller drops it, as it does for the agent's own log).
    pub(crate) fn children_state(
        &mut self,
        original: &[u8],
        procs_file: &str,
    ) -> Result<(forkbox_snapshot::Children, ChildrenMemory), EngineError> {
        use forkbox_snapshot::{MemoryRef, MAX_MEMORY_CHAIN};
        if self.kernel.procs.map.len() <= 1 && self.sched.others.is_empty() {
            return Ok(Default::default());
        }
        if self.sched.cur.proc.pid != GUEST_PID {
            return Err(EngineError::Poisoned("the agent is not parked on the vCPU".into()));
        }
        let maps: Vec<Option<forkbox_linux::mm::MemoryMap>> = self
            .sched
            .others
            .iter()
            .map(|t| match self.child_memory_map(t) {
                Ok(mm) => Some(mm),
                Err(why) => {
                    let pid = t.proc.pid;
                    tracing::warn!(
                        "process {pid} is not in the checkpoint (it reads as killed after a restore): {why}"
                    );
                    None
                }
            })
            .collect();
        let mut zeros: Option<GuestMemory> = None;
        let mut memory = ChildrenMemory::default();
        let mut processes = Vec::with_capacity(self.sched.others.len());
        let mut recorded = Vec::with_capacity(self.sched.others.len());
        for (task, (t, mm)) in self.sched.others.iter_mut().zip(maps).enumerate() {
            let (Some(mm), Some(vm)) = (mm, t.vm.as_mut()) else { continue };
            let pid = t.proc.pid;
            let on_template = vm.mem().has_backing();
            let base = child_base(on_template, original, &mut zeros)?;
            let incremental = vm.logs_dirty_pages() && !t.mem_chain.is_empty() && t.mem_chain.len() < MAX_MEMORY_CHAIN;
            let pages = if incremental {
                written_pages(vm)?
            } else {
                let pages = changed_pages(vm.mem(), base)?;
                // From here on its VM logs what it writes (what was logged so far is in `pages`).
                if vm.logs_dirty_pages() {
                    vm.dirty_log()?;
                } else {
                    vm.start_dirty_log()?;
                }
                vm.mem_mut().track_writes();
                t.mem_chain.clear();
                pages
            };
            if !(incremental && pages.is_empty()) {
                let plan = forkbox_snapshot::LayerPlan::new(vm.mem(), base, &pages)?;
                let at = MemoryRef {
                    file: procs_file.to_string(),
                    offset: memory.bytes,
                    len: plan.bytes(),
                    crc: plan.bytes_crc(),
                };
                memory.bytes = memory.bytes.saturating_add(plan.bytes());
                memory.parts.push((task, on_template, pages, at.clone()));
                t.mem_chain.insert(0, at);
            }
            let mut process = t.proc.save_child_state();
            process.mm = mm;
            processes.push(forkbox_snapshot::ChildRecord {
                process,
                vcpu: vm.save_vcpu()?.to_record(),
                pending_user: t.pending_user.as_ref().map(Regs::from),
                in_stub: t.in_stub,
                memory: t.mem_chain.clone(),
                on_template,
            });
            recorded.push(pid);
        }
        let table = Some(self.kernel.procs.save_state(&recorded));
        Ok((forkbox_snapshot::Children { table, processes }, memory))
    }

    /// Write the children's memory layers [`Sandbox::children_state`]
    /// planned (`memory`) into `out`, the checkpoint's process memory file,
    /// each encoded straight from the child's memory (the sandbox has not
    /// run since: a layer that would differ from its record is an error).
    pub(crate) fn write_children_memory(
        &self,
        original: &[u8],
        memory: &ChildrenMemory,
        out: &mut impl std::io::Write,
    ) -> Result<(), EngineError> {
        use forkbox_snapshot::StateError;
        let mut zeros: Option<GuestMemory> = None;
        for (task, on_template, pages, at) in &memory.parts {
            let gone = || EngineError::Poisoned("a child planned for a checkpoint is gone".into());
            let vm = self.sched.others.get(*task).and_then(|t| t.vm.as_ref()).ok_or_else(gone)?;
            let base = child_base(*on_template, original, &mut zeros)?;
            let plan = forkbox_snapshot::LayerPlan::new(vm.mem(), base, pages)?;
            if plan.bytes() != at.len || plan.bytes_crc() != at.crc {
                return Err(EngineError::Poisoned("a child's memory changed while it was checkpointed".into()));
            }
            plan.write_into(&mut *out).map_err(|source| StateError::Io {
                what: "write",
                path: "the processes' memory".into(),
                source,
            })?;
        }
        Ok(())
    }

    /// The memory map a checkpoint records for process `t` (not the current
    /// one), or why it cannot record it. Its file mappings shared through
    /// the sandbox's shared objects become its own write-back mappings in the
    /// record (`SharedFile`, as the agent's at the end of each call; their
    /// bytes are in its memory layer), so a restored process has its own
    /// copy of them. Refused: anonymous memory shared between processes
    /// (MAP_SHARED|MAP_ANONYMOUS: a `multiprocessing` lock or queue), and a
    /// writable file mapping another process maps too (their writes would no
    /// longer meet after a restore).
    fn child_memory_map(&self, t: &Task) -> Result<forkbox_linux::mm::MemoryMap, String> {
        use forkbox_linux::mm::VmaKind;
        if t.vm.is_none() {
            return Err("it has no VM".into());
        }
        let maps = |o: &Task, obj: u32| {
            o.proc.mm.vmas().any(|(_, v)| matches!(v.kind, VmaKind::Shm { obj: b, .. } if b == obj))
        };
        for (at, v) in t.proc.mm.vmas() {
            let VmaKind::Shm { obj, ino, .. } = v.kind else { continue };
            if ino.is_none() {
                return Err(format!("it maps anonymous memory shared with other processes at {at:#x}"));
            }
            let others = self.sched.others.iter().chain([&self.sched.cur]).filter(|o| o.proc.pid != t.proc.pid);
            if v.prot & libc::PROT_WRITE as u32 != 0 && others.into_iter().any(|o| maps(o, obj)) {
                return Err(format!("it maps a file writable and shared with another process at {at:#x}"));
            }
        }
        let mut mm = t.proc.mm.clone();
        mm.unshare_all();
        mm.validate()?;
        Ok(mm)
    }

    /// Bring back the other processes of a checkpoint (see
    /// [`Sandbox::children_state`]) beside the agent's, just restored:
    /// `pool` is the template's (a child that maps the template's memory
    /// gets one of its pre-created VMs with the dirty-page log on, a child
    /// that called execve one of its blank ones); `files` the process memory
    /// files the records name, open. Each child's chain of layers is read and
    /// applied straight into its VM's memory (each page once, from its newest
    /// layer; a page the chain does not name keeps its base's bytes, which the
    /// VM's fresh memory already holds). Everything is
    /// checked; the children run again from where they were at the next
    /// scheduler slice, their VMs logging what they write for the next
    /// checkpoint.
    pub(crate) fn restore_children(
        &mut self,
        children: forkbox_snapshot::Children,
        pool: &crate::pool::VmPool,
        files: &std::collections::HashMap<String, std::fs::File>,
    ) -> Result<(), EngineError> {
        use forkbox_snapshot::StateError;
        let forkbox_snapshot::Children { table, processes } = children;
        let Some(table) = table else {
            return match processes.is_empty() {
                true => Ok(()),
                false => Err(StateError::Corrupt("processes without a process table".into()).into()),
            };
        };
        let mut live: Vec<u32> = processes.iter().map(|c| c.process.pid).collect();
        live.sort_unstable();
        if live.windows(2).any(|w| w[0] == w[1]) {
            return Err(StateError::Corrupt("a process recorded twice".into()).into());
        }
        self.kernel.procs = forkbox_linux::procs::ProcTable::restore_state(table, &live)
            .map_err(|e| StateError::Corrupt(format!("process table: {e}")))?;
        for c in processes {
            let t0 = Instant::now();
            let pid = c.process.pid;
            let corrupt =
                |what: &str, e: &dyn std::fmt::Display| StateError::Corrupt(format!("process {pid}: {what}: {e}"));
            if c.memory.len() > forkbox_snapshot::MAX_MEMORY_CHAIN {
                return Err(corrupt("memory", &format!("{} layers", c.memory.len())).into());
            }
            let mut layers = Vec::with_capacity(c.memory.len());
            for r in &c.memory {
                let f = files.get(&r.file).ok_or_else(|| corrupt("memory", &format!("no file {}", r.file)))?;
                layers.push(forkbox_snapshot::Layer::read_part(f, r, &r.file)?);
            }
            let t_read = t0.elapsed();
            let vcpu = forkbox_vmm::VcpuState::from_record(&c.vcpu).map_err(|e| corrupt("vCPU state", &e))?;
            let proc = Process::restore_child(&self.sched.cur.proc, c.process).map_err(|e| corrupt("state", &e))?;
            // Made off the request path, with the log on (turning it on over
            // memory just written takes ms), its memory holding the base's bytes.
            let mut vm = if c.on_template { pool.take_fresh(true)? } else { pool.take_blank()? };
            if vm.mem().size() != RAM_SIZE || vm.mem().has_backing() != c.on_template {
                return Err(EngineError::Poisoned("a pooled VM of the wrong kind for a child".into()));
            }
            let t_vm = t0.elapsed();
            // Either memory holds its base's bytes (the template's, or zeros): only the differing runs are written.
            let pages = forkbox_snapshot::layer::apply_layers_in_place(vm.mem_mut(), &layers)?;
            drop(layers);
            let t_pages = t0.elapsed();
            vm.restore_vcpu(&vcpu)?;
            // What it (and the VMM, from the page tables on) writes from here is its next layer.
            vm.mem_mut().track_writes();
            proc.mm.sync_all_page_tables(vm.mem_mut())?;
            crate::vdso::refresh(&mut vm, self.vdso)?;
            tracing::debug!(pid, layers = c.memory.len(), pages, ?t_read, ?t_vm, ?t_pages, total = ?t0.elapsed(), "restored a child process");
            let mut task = Task::new(vm, proc);
            task.pending_user = c.pending_user.as_ref().map(kvm_regs::from);
            task.in_stub = c.in_stub;
            task.mem_chain = c.memory;
            // What it writes is no later call's output (its job, if it was one, is not restored).
            self.kernel.jobs.insert(pid, DROPPED_OUTPUT);
            self.sched.add(task);
        }
        Ok(())
    }

    /// Keep the children and threads an exec leaves running (a session's
    /// sandbox), instead of killing the children at its end.
    pub fn set_keep_running(&mut self, on: bool) {
        self.keep_running = on;
    }

    /// Does it keep what its calls leave running ([`Sandbox::set_keep_running`])?
    pub fn keeps_running(&self) -> bool {
        self.keep_running
    }

    /// Are there processes or threads besides the parked agent that may run
    /// between calls?
    pub fn has_background(&self) -> bool {
        self.is_usable() && (!self.sched.others.is_empty() || self.sched.agent_threads() > 1)
    }

    /// How many processes the sandbox has besides the agent's.
    pub fn background_processes(&self) -> usize {
        self.sched.others.len()
    }

    /// The VFS invariant check (what a restore of its state checks: link
    /// counts, parents, reachability, byte accounting), on the live overlay.
    pub fn check_invariants(&self) -> Result<(), forkbox_linux::vfs::VfsStateError> {
        self.sched.cur.proc.vfs.check_invariants()
    }

    /// Is the guest parked and usable?
    pub fn is_usable(&self) -> bool {
        matches!(self.state, State::Parked(_)) && self.sched.cur.vm.is_some()
    }

    fn vm(&mut self) -> &mut Vm {
        // Only `drop` takes the VM out.
        self.sched.cur.vm.as_mut().expect("sandbox VM present until drop")
    }

    pub fn stats(&self) -> RunStats {
        let s = &self.kernel.stats;
        RunStats {
            syscalls: s.total,
            unimplemented: s.unimplemented.iter().map(|(nr, n)| (syscalls::name(*nr).to_string(), *nr, *n)).collect(),
            unsupported: syscalls::unsupported_calls(&s.by_nr),
        }
    }

    /// Log every syscall from now on (`--trace-syscalls`).
    pub fn set_trace(&mut self, on: bool) {
        self.kernel.trace = on;
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Let `egress` decide and open this sandbox's way out (a worker's
    /// broker) instead of this process. For a sandbox just made (forked or
    /// resumed), before its first exec: its host-side network state starts
    /// afresh.
    pub fn set_egress(&mut self, egress: std::sync::Arc<dyn forkbox_linux::net::Egress>) {
        let config = std::sync::Arc::new(self.limits.network.clone());
        // Listeners restored from its checkpoint stay.
        self.kernel.net = forkbox_linux::net::NetIo::keeping_listeners(&mut self.kernel.net, config, egress);
    }

    /// Network counters of this sandbox (connects allowed/denied, DNS, bytes).
    pub fn net_stats(&self) -> forkbox_linux::net::NetStats {
        self.kernel.net.stats.clone()
    }

    /// What the last exec wrote to stdout/stderr before it failed (None if it
    /// did not fail, or failed before running: poisoned sandbox, code too large).
    pub fn take_failed_output(&mut self) -> Option<CapturedOutput> {
        self.failed_output.take()
    }

    /// Run `code` in the session's namespace.
    /// Name the next exec's code `<exec-N>` in tracebacks (a session passes the
    /// number its checkpoint will have); applies to that one exec.
    pub fn set_exec_id(&mut self, n: i64) {
        self.exec_id = Some(n);
    }

    pub fn exec(&mut self, code: &str) -> Result<ExecResult, EngineError> {
        self.exec_with(code, ExecOptions::default())
    }

    /// Run `code`, streaming its output and/or interruptible (see `ExecOptions`).
    pub fn exec_with(&mut self, code: &str, opts: ExecOptions<'_>) -> Result<ExecResult, EngineError> {
        let regs = match &self.state {
            State::Parked(r) => *r,
            State::Poisoned(why) => return Err(EngineError::Poisoned(why.clone())),
        };
        let ExecOptions { mut on_output, interrupt, timeout, job, prelude } = opts;
        let len = code.len().saturating_add(prelude.map_or(0, str::len));
        if len > self.limits.code_bytes {
            return Err(EngineError::CodeTooLarge(len, self.limits.code_bytes));
        }
        self.jobs.starting = job;
        self.failed_output = None;
        self.exec_timeout = timeout.unwrap_or(self.limits.timeout);
        // The vCPU thread is the one to kick while this exec runs.
        let _attached = match &interrupt {
            Some(i) => Some(i.latch().attach()?),
            None => None,
        };
        let t0 = Instant::now();
        let syscalls_before = self.kernel.stats.total;
        self.outputs.refresh(&self.sched.cur.proc.vfs);
        let stream = on_output.is_some();
        let exec_id = self.exec_id.take();
        let req = ExecRequest {
            op: "exec",
            code,
            value_limit: self.limits.output_bytes,
            reseed: self.reseed_pending.then(fresh_seed).transpose()?,
            stream,
            exec_id,
            prelude,
        };
        self.reseed_pending = false;
        self.kernel.send_to_agent(protocol::frame(&req));
        self.kernel.agent_out.clear();
        self.kernel.agent_overflow = false;
        self.kernel.stream_marked = [false; 2];
        let vdso = self.vdso;
        crate::vdso::refresh(self.vm(), vdso)?;
        let deadline = Instant::now() + self.exec_timeout;
        self.kernel.streaming = stream;
        self.kernel.interrupt = interrupt.as_ref().map(|i| i.latch().clone());
        let outcome = self.run(Some(regs), deadline, &mut on_output);
        // The reply, and the end-of-exec flush of stdout/stderr that came with
        // it: the guest's last output of the exec (before any note of ours).
        let reply = match &outcome {
            Ok(_) => Some(self.take_reply(&mut on_output)),
            Err(_) => None,
        };
        self.jobs.starting = false;
        let killed = if outcome.is_ok() && self.keep_children() { 0 } else { self.end_children() };
        if killed > 0 && outcome.is_ok() {
            let note = format!(
                "[forkbox: {killed} child process{} still running at the end of the exec {} killed]\n",
                if killed == 1 { "" } else { "es" },
                if killed == 1 { "was" } else { "were" }
            );
            self.kernel.output(Stream::Stderr, note.as_bytes());
        }
        self.kernel.streaming = false;
        self.kernel.streamed.clear();
        self.kernel.interrupt = None;
        let (stdout, stderr) = (take_text(&mut self.kernel.stdout), take_text(&mut self.kernel.stderr));
        let stop = match outcome {
            Ok(stop) => stop,
            Err(e) => {
                self.state = State::Poisoned(e.to_string());
                self.failed_output = Some(CapturedOutput { stdout, stderr });
                return Err(e);
            }
        };
        let Stop::Parked(regs) = stop;
        self.state = State::Parked(regs);
        let mut reply = reply.unwrap_or_else(|| Err(EngineError::Protocol("no reply".into())))?;
        // The agent cuts these to the limit, but it runs in the guest: cut them here too.
        let cap = self.limits.output_bytes;
        if let Some(v) = reply.value.as_mut() {
            protocol::truncate_text(v, cap, "value repr");
        }
        if let Some(e) = reply.error.as_mut() {
            protocol::truncate_text(&mut e.kind, 256, "exception type");
            protocol::truncate_text(&mut e.message, cap, "exception message");
            protocol::truncate_text(&mut e.traceback, cap, "traceback");
            crate::hint::add_to_traceback(&e.kind, &e.message, &mut e.traceback);
        }
        let outputs = self.outputs.collect(&self.sched.cur.proc.vfs);
        let mut shown = 0usize;
        let value_data = reply.value_data.map(|b| protocol::check_bundle(b, &mut shown)).filter(|b| !b.is_empty());
        let display: Vec<MimeBundle> = reply
            .display
            .unwrap_or_default()
            .into_iter()
            .take(protocol::DISPLAY_ITEMS_MAX)
            .map(|b| protocol::check_bundle(b, &mut shown))
            .filter(|b| !b.is_empty())
            .collect();
        Ok(ExecResult {
            value_data,
            display,
            value: reply.value,
            stdout,
            stderr,
            error: reply.error,
            runtime_ms: reply.runtime_ms,
            wall_ms: t0.elapsed().as_secs_f64() * 1000.0,
            syscalls: self.kernel.stats.total - syscalls_before,
            outputs,
        })
    }

    /// Parse the agent's reply frame; the output held with it goes to the
    /// captures (and the sink).
    fn take_reply(&mut self, sink: &mut Option<OutputSink<'_>>) -> Result<ExecReply, EngineError> {
        let out = std::mem::take(&mut self.kernel.agent_out);
        let (reply, used) = protocol::unframe(&out)?;
        if let Some(p) = reply.get("protocol_error") {
            return Err(EngineError::Protocol(p.to_string()));
        }
        let reply: ExecReply =
            serde_json::from_value(reply).map_err(|e| EngineError::Protocol(format!("bad exec reply: {e}")))?;
        let (held_out, held_err) = protocol::held_output(&out[used..], reply.held)?;
        self.kernel.output(Stream::Stdout, held_out);
        self.kernel.output(Stream::Stderr, held_err);
        self.flush_stream(sink);
        Ok(reply)
    }

    /// Hand streamed output written since the last call to the sink.
    fn flush_stream(&mut self, sink: &mut Option<OutputSink<'_>>) {
        if self.kernel.streamed.is_empty() {
            return;
        }
        let chunks = std::mem::take(&mut self.kernel.streamed);
        if let Some(f) = sink.as_mut() {
            for (stream, data) in &chunks {
                f(*stream, data);
            }
        }
    }

    // ----- files, host side (never the host file system: the guest's VFS) ----------

    fn guest_path(&self, path: &str) -> Result<String, EngineError> {
        let cwd = self.sched.cur.proc.vfs.dir_path(self.sched.cur.proc.cwd).unwrap_or_else(|_| b"/".to_vec());
        files::normalize(path, &cwd)
    }

    /// Write `data` to the guest file `path` (absolute or relative to the guest's cwd),
    /// creating parent directories; the file gets mode 0644.
    pub fn write_file(&mut self, path: &str, data: &[u8]) -> Result<(), EngineError> {
        self.write_file_from(path, &mut &data[..], data.len() as u64)
    }

    /// [`Self::write_file`] of `len` bytes read from `src` a chunk at a time
    /// (an upload's temporary file: the guest's file is the only copy made).
    pub fn write_file_from(&mut self, path: &str, src: &mut dyn std::io::Read, len: u64) -> Result<(), EngineError> {
        let p = self.guest_path(path)?;
        if path.ends_with('/') {
            return Err(EngineError::File {
                code: forkbox_api::ErrorCode::IsADirectory,
                message: format!("{path}: a file name cannot end with '/'"),
            });
        }
        files::write_file_from(&mut self.sched.cur.proc.vfs, &p, src, len)
    }

    /// Mount the layers of `packages` (resolved by the host) into the guest's
    /// file system, skipping those installed already (same `.dist-info`). All
    /// or nothing: a conflict (a file of a package exists) changes nothing.
    /// The guest still has to look again (`packages::REFRESH`).
    pub fn install_packages(
        &mut self,
        packages: &[forkbox_image::packages::Package],
    ) -> Result<Vec<crate::packages::InstalledPackage>, EngineError> {
        use forkbox_linux::vfs::LayerError;
        let saved = self.sched.cur.proc.vfs.clone();
        let mut done = Vec::with_capacity(packages.len());
        for p in packages {
            let present = crate::packages::dist_info(p).is_some_and(|d| {
                let path = format!("{}/{d}", crate::packages::SITE);
                self.sched.cur.proc.vfs.resolve(forkbox_linux::vfs::ROOT_INO, path.as_bytes(), true).is_ok()
            });
            let files = if present {
                0
            } else {
                match self.sched.cur.proc.vfs.install_layer(&p.layer) {
                    Ok(n) => n,
                    Err(e) => {
                        self.sched.cur.proc.vfs = saved;
                        let (code, message) = match e {
                            LayerError::Exists { path } | LayerError::NotADirectory { path } => (
                                forkbox_api::ErrorCode::PackageConflict,
                                format!("{}-{}: {path} exists already in the sandbox", p.name, p.version),
                            ),
                            LayerError::NoSpace => (
                                forkbox_api::ErrorCode::QuotaExceeded,
                                format!("{}-{}: the sandbox's disk quota is full", p.name, p.version),
                            ),
                            e => (forkbox_api::ErrorCode::PackageFailed, format!("{}-{}: {e}", p.name, p.version)),
                        };
                        return Err(EngineError::Package { code, message });
                    }
                }
            };
            done.push(crate::packages::InstalledPackage {
                name: p.name.clone(),
                version: p.version.clone(),
                wheel: p.wheel.clone(),
                sha256: p.sha256.clone(),
                installed: !present,
                files,
            });
        }
        Ok(done)
    }

    /// The bytes of the guest file `path`, at most `max` (else `file_too_large`).
    pub fn read_file(&self, path: &str, max: usize) -> Result<Vec<u8>, EngineError> {
        let p = self.guest_path(path)?;
        files::read_file(&self.sched.cur.proc.vfs, &p, max)
    }

    /// The entries of the guest directory `path`.
    pub fn list_dir(&self, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        let p = self.guest_path(path)?;
        files::list_dir(&self.sched.cur.proc.vfs, &p)
    }

    /// A file-system operation from outside (stat, walk, mkdir, move, remove) on the guest's
    /// files, relative paths against the guest's cwd; no guest code runs.
    pub fn file_op(&mut self, op: &crate::FileOp) -> Result<crate::FileOpOutcome, EngineError> {
        let cwd = self.sched.cur.proc.vfs.dir_path(self.sched.cur.proc.cwd).unwrap_or_else(|_| b"/".to_vec());
        crate::file_ops::apply(&mut self.sched.cur.proc.vfs, &op.normalized(&cwd)?)
    }

    /// Hand a connection from outside to the sandbox's listener on `port` (the
    /// port proxy): `conn` is one end of a host `socketpair(AF_UNIX,
    /// SOCK_STREAM)`, the caller keeps the other. The guest accepts it as a
    /// TCP connection from loopback; only the sandbox's own listeners can take
    /// it. A thread blocked in accept (or poll) on that listener wakes at once
    /// (its readiness fd is among the host fds a background run polls).
    pub fn connect_port(&mut self, port: u16, conn: std::os::fd::OwnedFd) -> Result<(), EngineError> {
        if let State::Poisoned(why) = &self.state {
            return Err(EngineError::Poisoned(why.clone()));
        }
        match self.kernel.net.inject(port, conn) {
            Ok(()) => Ok(()),
            Err(forkbox_linux::net::InjectError::NotListening) => Err(EngineError::PortNotListening(port)),
            Err(forkbox_linux::net::InjectError::Full(why)) => Err(EngineError::PortBusy(port, why)),
        }
    }

    /// Run the guest until the agent parks. `resume`: the parked read to re-issue first.
    fn run(
        &mut self,
        resume: Option<kvm_regs>,
        deadline: Instant,
        sink: &mut Option<OutputSink<'_>>,
    ) -> Result<Stop, EngineError> {
        self.kernel.deadline = Some(deadline);
        self.sig.reset();
        self.sched.resched = false;
        self.sched.slice_start = Instant::now();
        self.sched.cur.proc.threads.clock.start();
        let r = self.run_threads(resume, deadline, sink);
        self.sched.cur.proc.threads.clock.stop();
        r
    }

    fn run_threads(
        &mut self,
        resume: Option<kvm_regs>,
        deadline: Instant,
        sink: &mut Option<OutputSink<'_>>,
    ) -> Result<Stop, EngineError> {
        let latch = self.kernel.interrupt.clone();
        if let Some(regs) = resume {
            let stop = self.syscall(regs)?;
            self.flush_stream(sink);
            self.check_agent_overflow()?;
            if let Some(stop) = stop {
                return Ok(stop);
            }
        }
        loop {
            match self.run_once(deadline, sink, latch.as_deref()) {
                Ok(Some(stop)) => return Ok(stop),
                Ok(None) => {}
                // A child's end (exit, a signal, a crash) is its own, not the exec's.
                Err(e) => match self.death_of(&e) {
                    Some(how) => self.end_process(how)?,
                    None => return Err(e),
                },
            }
        }
    }

    /// How the current process ended, if `e` is the end of a child process.
    fn death_of(&self, e: &EngineError) -> Option<Exit> {
        if self.sched.cur.proc.pid == GUEST_PID || self.sched.others.is_empty() {
            return None;
        }
        match e {
            EngineError::GuestExited(c) => Some(Exit::Code(*c)),
            EngineError::GuestSignaled(s) => Some(Exit::Signal(*s)),
            EngineError::GuestCrashed(_) => Some(Exit::Signal(self.sig.fault.as_ref().map_or(11, |(s, _)| *s))),
            _ => None,
        }
    }

    fn run_once(
        &mut self,
        deadline: Instant,
        sink: &mut Option<OutputSink<'_>>,
        latch: Option<&forkbox_vmm::InterruptLatch>,
    ) -> Result<Option<Stop>, EngineError> {
        self.note_interrupt()?;
        self.schedule(deadline)?;
        self.deliver_at_vcpu()?;
        let base = self.sig.grace.map_or(deadline, |g| g.min(deadline));
        let mut run_deadline = self.sched.run_deadline(&mut self.kernel, base);
        let ran = Instant::now();
        if let Some(left) = self.sched.cur.proc.threads.next_cpu_event() {
            // A CPU-time interval timer fires after at most this much run time.
            run_deadline = run_deadline.min(ran + Duration::from_nanos(left));
        }
        let exit = self.vm().run(Some(run_deadline), latch);
        let spent = ran.elapsed();
        self.cpu_total = self.cpu_total.saturating_add(spent);
        self.jobs.charge(&self.kernel, self.sched.cur.proc.pid, spent);
        if !self.sched.cur.proc.threads.timers.is_empty() {
            self.sched.cur.proc.threads.charge_cpu(spent.as_nanos().min(u64::MAX as u128) as u64);
        }
        let exit = exit?;
        self.sched.cur.in_stub = matches!(exit, VmExit::Syscall(_));
        match exit {
            VmExit::Syscall(regs) => {
                let stop = self.syscall(regs)?;
                self.flush_stream(sink);
                self.check_agent_overflow()?;
                if let Some(stop) = stop {
                    return Ok(Some(stop));
                }
            }
            // Picked up at the top of the loop.
            VmExit::Interrupted => {}
            VmExit::Exception(fault) => {
                // A fault in user code is a signal to the guest (SIGSEGV
                // for a page it did not map...); without a handler, a crash.
                let delivered = {
                    let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
                    signal::deliver_fault(vm, &mut self.sched.cur.proc, &mut self.sig, &fault)
                };
                match delivered {
                    Ok(h) => self.vm().enter_user(&h)?,
                    Err(e) => return Err(self.with_stderr(e)),
                }
            }
            VmExit::Shutdown { rip } => {
                return Err(EngineError::GuestCrashed(format!("triple fault (VM shutdown) near rip {rip:#x}")))
            }
            VmExit::DeadlineExceeded => {
                self.check_deadline(deadline)?;
                // A time slice ended, a timer or a wait's deadline is due.
                self.sched.resched = true;
            }
            VmExit::Unexpected(why) => return Err(EngineError::GuestCrashed(why)),
        }
        Ok(None)
    }

    // ----- processes -------------------------------------------------------------

    fn with_ctx<R>(&mut self, f: impl FnOnce(&mut Ctx) -> R) -> R {
        let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
        let mut ctx = Ctx {
            mem: vm.mem_mut(),
            proc: &mut self.sched.cur.proc,
            kernel: &mut self.kernel,
            effect: None,
            timed_out: false,
        };
        f(&mut ctx)
    }

    /// Close every fd of the current process (its end).
    fn close_all_fds(&mut self) {
        let fds: Vec<i32> = self.sched.cur.proc.fds.fds().collect();
        self.with_ctx(|ctx| syscalls::close_fds(ctx, &fds));
    }

    /// The current process (a child) ended: its descriptors close, it becomes
    /// a zombie of its parent (which gets SIGCHLD), its VM goes, another runs.
    fn end_process(&mut self, how: Exit) -> Result<(), EngineError> {
        let pid = self.sched.cur.proc.pid;
        self.with_ctx(syscalls::release_shared);
        self.close_all_fds();
        self.jobs.ended(pid, how);
        self.kernel.jobs.remove(&pid);
        self.kernel.procs.exit(pid, how);
        let dead = self.sched.remove_current();
        if let Some(vm) = dead.vm {
            crate::pool::reap(vm);
        }
        self.sched.deliver_outbox(&mut self.kernel);
        self.sched.resched = true;
        Ok(())
    }

    /// May the children an exec leaves keep running? Only in a sandbox that
    /// keeps them, and only if the agent maps no anonymous memory shared with
    /// them: a checkpoint records the agent's memory as private, so its shared
    /// file mappings become its own write-back mappings again here.
    fn keep_children(&mut self) -> bool {
        if !self.keep_running || self.sched.others.is_empty() || self.sched.cur.proc.pid != GUEST_PID {
            return false;
        }
        match self.with_ctx(syscalls::privatize_own_files) {
            Ok(true) => {
                // What they write from now on is not a later call's output (a job's goes to its rings).
                for t in &self.sched.others {
                    self.kernel.jobs.entry(t.proc.pid).or_insert(DROPPED_OUTPUT);
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!("shared memory at the end of an exec: {e:?}");
                false
            }
        }
    }

    /// Run the sandbox's other threads and processes until `until` or until
    /// none of them can run, the agent's main thread staying parked on its
    /// channel; then the agent is back exactly as it parked (a checkpoint or
    /// the next call may follow). Their output to stdout/stderr is dropped
    /// (bounded like an exec's while they run); the memory and process limits
    /// cover them as they cover an exec. A child's end is its own; the end of
    /// the agent process (a thread of it crashing, `os._exit`) poisons the sandbox.
    pub fn run_background(&mut self, until: Instant) -> Result<BackgroundRun, EngineError> {
        self.run_background_woken(until, None)
    }

    /// [`Sandbox::run_background`] that also ends (`Busy`) as soon as `wake`
    /// is readable, even while every thread waits on the host: a request on
    /// the sandbox's channel is served at once, not at the end of the slice.
    pub fn run_background_woken(
        &mut self,
        until: Instant,
        wake: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<BackgroundRun, EngineError> {
        self.bg_wake = wake.map(|w| std::os::fd::AsRawFd::as_raw_fd(&w));
        let r = self.run_background_at(until);
        self.bg_wake = None;
        r
    }

    fn run_background_at(&mut self, until: Instant) -> Result<BackgroundRun, EngineError> {
        let regs = match &self.state {
            State::Parked(r) => *r,
            State::Poisoned(why) => return Err(EngineError::Poisoned(why.clone())),
        };
        if !self.has_background() {
            return Ok(BackgroundRun::Idle);
        }
        let r = self.run_background_inner(regs, until);
        self.kernel.stdout.take();
        self.kernel.stderr.take();
        self.kernel.agent_overflow = false;
        match r {
            Ok(run) => Ok(run),
            Err(e) => {
                self.state = State::Poisoned(format!("a background thread or process: {e}"));
                Err(e)
            }
        }
    }

    fn run_background_inner(&mut self, regs: kvm_regs, until: Instant) -> Result<BackgroundRun, EngineError> {
        let main = self.sched.cur.proc.threads.index_of(MAIN_TID).filter(|&i| i == self.sched.cur.proc.threads.cur);
        if self.sched.cur.proc.pid != GUEST_PID || main.is_none() {
            return Err(EngineError::Poisoned("the agent is not parked on the vCPU".into()));
        }
        let saved = self.vm().save_vcpu()?;
        let cur = self.sched.cur.proc.threads.cur;
        self.sched.cur.proc.threads.list[cur].wait = Some(Wait::new(Regs::from(&regs), None, Ok(0), WaitKind::Agent));
        let vdso = self.vdso;
        crate::vdso::refresh(self.vm(), vdso)?;
        self.kernel.deadline = Some(until);
        self.sig.reset();
        self.sched.resched = true;
        self.sched.slice_start = Instant::now();
        self.sched.cur.proc.threads.clock.start();
        let mut run = BackgroundRun::Busy;
        let outcome = loop {
            match self.run_once(until, &mut None, None) {
                // Only the main thread parks, and it waits.
                Ok(_) => {}
                Err(EngineError::Timeout(_)) => break Ok(()),
                Err(EngineError::Deadlock(_)) => {
                    run = BackgroundRun::Idle;
                    break Ok(());
                }
                Err(e) => match self.death_of(&e) {
                    Some(how) => self.end_process(how)?,
                    None => break Err(e),
                },
            }
            if Instant::now() >= until {
                break Ok(());
            }
        };
        let back = outcome.and_then(|()| self.back_to_agent(&saved));
        self.sched.cur.proc.threads.clock.stop();
        back?;
        if self.sched.others.is_empty() && self.sched.agent_threads() <= 1 {
            run = BackgroundRun::Idle;
        }
        Ok(run)
    }

    /// Put the agent's main thread back on the vCPU as it parked (`saved`).
    fn back_to_agent(&mut self, saved: &forkbox_vmm::VcpuState) -> Result<(), EngineError> {
        self.sched.make_main_current();
        let main = self
            .sched
            .cur
            .proc
            .threads
            .index_of(MAIN_TID)
            .ok_or_else(|| EngineError::Poisoned("the agent's main thread is gone".into()))?;
        let cur = self.sched.cur.proc.threads.cur;
        if cur != main {
            if self.sched.cur.proc.threads.list[cur].cpu.is_none() {
                // Set the thread on the vCPU aside; inside an entry stub it runs on to the stub's end first.
                let mut tries = 0;
                let regs = loop {
                    let blocked = self.sched.cur.proc.threads.list[cur].wait.as_ref().map(|w| w.regs);
                    match (blocked, self.sched.cur.pending_user.take()) {
                        (Some(w), _) => break w,
                        (None, Some(u)) => break Regs::from(&u),
                        (None, None) => {}
                    }
                    if let Some(u) = self.sched.cur.user_state()? {
                        break Regs::from(&u);
                    }
                    tries += 1;
                    if tries > 64 {
                        return Err(EngineError::Poisoned("a thread did not leave a syscall stub".into()));
                    }
                    let exit = self.vm().run(Some(Instant::now() + Duration::from_micros(200)), None)?;
                    if let VmExit::Syscall(r) = exit {
                        // Handled with the thread's state as a syscall's return (it resumes from there).
                        self.sched.cur.in_stub = true;
                        self.syscall(r)?;
                    }
                };
                let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
                let xsave = Arc::new(Xsave::from(&vm.xsave()?));
                self.sched.cur.proc.threads.list[cur].cpu = Some(SavedCpu { regs, xsave });
            }
            self.sched.cur.proc.make_current(main);
        }
        self.sched.cur.proc.threads.list[main].cpu = None;
        self.sched.cur.proc.threads.list[main].wait = None;
        self.vm().restore_vcpu(saved)?;
        self.sched.cur.pending_user = None;
        self.sched.cur.in_stub = true;
        self.sched.cur.woken = None;
        self.sched.resched = false;
        self.sched.apply_memory_limit();
        Ok(())
    }

    /// The background jobs, oldest first.
    pub fn jobs(&self) -> Vec<JobInfo> {
        self.jobs.list(&self.kernel)
    }

    /// The sandbox's listening TCP sockets, by port (any of its processes').
    pub fn listening_ports(&self) -> Vec<ListeningPort> {
        self.kernel.net.listening().into_iter().map(|(address, proxied)| ListeningPort { address, proxied }).collect()
    }

    /// One job (`NoSuchJob` if there is none with that leader pid).
    pub fn job(&self, pid: u32) -> Result<JobInfo, EngineError> {
        self.jobs.info(&self.kernel, pid)
    }

    /// At most `max` bytes of a job's stream from `offset`.
    pub fn job_output(&self, pid: u32, stream: Stream, offset: u64, max: usize) -> Result<JobChunk, EngineError> {
        let job = self.jobs.get(pid)?;
        let ring = self.kernel.job_out.get(&pid).map(|r| &r[stream as usize]);
        let (offset, data) = ring.map_or((0, Vec::new()), |r| r.read(offset, max));
        let end = ring.map_or(0, |r| r.end());
        Ok(JobChunk { offset, end, data, running: job.exit.is_none() })
    }

    /// Send signal `sig` (1..=64) to every process of a running job; it is
    /// acted on when they next run (between calls, or in the next call).
    pub fn job_signal(&mut self, pid: u32, sig: i32) -> Result<JobInfo, EngineError> {
        let job = self.jobs.get(pid)?;
        if !(1..=64).contains(&sig) {
            return Err(EngineError::BadSignal(sig));
        }
        if job.exit.is_none() {
            let members: Vec<u32> = self.kernel.jobs.iter().filter(|(_, l)| **l == pid).map(|(p, _)| *p).collect();
            for p in members {
                let info = SigInfo::user(sig, forkbox_linux::thread::SI_USER);
                self.kernel.procs.outbox.push((p, info));
            }
            self.sched.deliver_outbox(&mut self.kernel);
        }
        self.job(pid)
    }

    /// Run the sandbox's background work until job `pid` ends or `until`
    /// passes; the job as it is then.
    pub fn job_wait(&mut self, pid: u32, until: Instant) -> Result<JobInfo, EngineError> {
        loop {
            let info = self.job(pid)?;
            let now = Instant::now();
            if !info.running || now >= until {
                return Ok(info);
            }
            if self.run_background(until.min(now + JOB_WAIT_SLICE))? == BackgroundRun::Idle {
                std::thread::sleep(JOB_WAIT_SLICE.min(until.saturating_duration_since(Instant::now())));
            }
        }
    }

    /// Run the sandbox's background work until job `pid` wrote past
    /// `offsets` (stdout, stderr), ended, or `until` passed; the job as it is
    /// then (a follower's wait for what comes next).
    pub fn job_watch(&mut self, pid: u32, offsets: [u64; 2], until: Instant) -> Result<JobInfo, EngineError> {
        loop {
            let info = self.job(pid)?;
            let now = Instant::now();
            let news = info.stdout_bytes > offsets[0] || info.stderr_bytes > offsets[1];
            if news || !info.running || now >= until {
                return Ok(info);
            }
            if self.run_background(until.min(now + JOB_WAIT_SLICE))? == BackgroundRun::Idle {
                std::thread::sleep(JOB_WATCH_IDLE.min(until.saturating_duration_since(Instant::now())));
            }
        }
    }

    /// Turn the file system's change journal on (`since`: None turns it off,
    /// and answers None) and run the sandbox's background work until the
    /// journal has something from `since` on (changes, or news of changes it
    /// lost) or `until` passes; what it has then (see `forkbox_linux::vfs::Changes`).
    pub fn fs_watch(&mut self, since: Option<u64>, until: Instant) -> Result<Option<Changes>, EngineError> {
        let Some(since) = since else {
            self.sched.cur.proc.vfs.stop_watching();
            return Ok(None);
        };
        self.sched.cur.proc.vfs.watch_changes();
        loop {
            let c = self.sched.cur.proc.vfs.changes(since).unwrap_or_default();
            let now = Instant::now();
            if !c.events.is_empty() || c.lost > 0 || now >= until || !self.has_background() {
                return Ok(Some(c));
            }
            if self.run_background(until.min(now + JOB_WAIT_SLICE))? == BackgroundRun::Idle {
                std::thread::sleep(JOB_WATCH_IDLE.min(until.saturating_duration_since(Instant::now())));
            }
        }
    }

    /// What the sandbox uses now: its CPU time so far, its resident guest memory
    /// (the pages of every process' guest memory the host has mapped) and the
    /// bytes of its file system's overlay.
    pub fn usage(&self) -> Usage {
        let vms = self.sched.cur.vm.iter().chain(self.sched.others.iter().filter_map(|t| t.vm.as_ref()));
        let pages: u64 = vms.map(|vm| footprint(vm.mem()).touched_pages).sum();
        Usage {
            cpu_seconds: self.cpu_total.as_secs_f64(),
            memory_bytes: pages.saturating_mul(4096),
            disk_bytes: self.sched.cur.proc.vfs.overlay_bytes(),
        }
    }

    /// Write `data` to the stdin of running job `pid` (its leader reads fd 0
    /// as the agent has it: started with stdin from the API), then close it
    /// if `eof`. All or nothing: with too little room, background work runs
    /// until `until` for its processes to read; then `StdinFull`.
    pub fn job_stdin(&mut self, pid: u32, data: &[u8], eof: bool, until: Instant) -> Result<JobInfo, EngineError> {
        let closed = |why: &str| EngineError::StdinClosed(format!("background process {pid} {why}"));
        if !self.job(pid)?.running {
            return Err(closed("has ended"));
        }
        if self.job_pty(pid).is_some() {
            return self.job_pty_input(pid, data, eof, until);
        }
        let fed = self
            .sched
            .others
            .iter()
            .find(|t| t.proc.pid == pid)
            .is_some_and(|t| t.proc.fds.get(0).is_ok_and(|f| f.kind == forkbox_linux::fd::FileKind::Stdin));
        let open = self.kernel.job_in.get(&pid).is_some_and(|s| !s.closed);
        if !fed || !open {
            return Err(closed(if fed { "has its stdin closed" } else { "was not started with stdin from the API" }));
        }
        if data.len() > forkbox_linux::kernel::state::JOB_STDIN_BYTES {
            return Err(EngineError::StdinFull(pid, data.len()));
        }
        loop {
            let room = self.kernel.job_in.get(&pid).map_or(0, |s| s.room());
            if room >= data.len() {
                break;
            }
            let info = self.job(pid)?;
            let now = Instant::now();
            if !info.running {
                return Err(closed("has ended"));
            }
            if now >= until {
                let unread = forkbox_linux::kernel::state::JOB_STDIN_BYTES - room;
                return Err(EngineError::StdinFull(pid, unread));
            }
            if self.run_background(until.min(now + JOB_WAIT_SLICE))? == BackgroundRun::Idle {
                std::thread::sleep(JOB_WATCH_IDLE.min(until.saturating_duration_since(Instant::now())));
            }
        }
        if let Some(s) = self.kernel.job_in.get_mut(&pid) {
            s.buf.extend(data);
            s.closed |= eof;
        }
        self.job(pid)
    }

    /// The pty (its master's object) a job runs on, if it was started on one.
    fn job_pty(&self, pid: u32) -> Option<u64> {
        self.sched.cur.proc.fds.objects.ptys().find(|(_, p)| p.job == Some(pid)).map(|(id, _)| id)
    }

    /// Type `data` on the terminal of job `pid` (as a master write: the line
    /// discipline edits, echoes and turns ^C into SIGINT for the foreground
    /// group), then end of file (^D) if `eof`. Waits for room as `job_stdin`.
    fn job_pty_input(&mut self, pid: u32, data: &[u8], eof: bool, until: Instant) -> Result<JobInfo, EngineError> {
        let mut rest = data.to_vec();
        if eof {
            rest.push(4);
        }
        while !rest.is_empty() {
            let master = self
                .job_pty(pid)
                .ok_or_else(|| EngineError::StdinClosed(format!("background process {pid} has its terminal closed")))?;
            let p = self
                .sched
                .cur
                .proc
                .fds
                .objects
                .pty_mut(master)
                .map_err(|e| EngineError::Poisoned(format!("pty: {e:?}")))?;
            match p.master_write(&rest) {
                Ok((n, sigs)) => {
                    rest.drain(..n);
                    forkbox_linux::file::pty::flush_to_job(p, &mut self.kernel);
                    if let Some(g) = p.pgrp {
                        self.signal_group(g, &sigs);
                    }
                    continue;
                }
                Err(_) => {
                    let info = self.job(pid)?;
                    let now = Instant::now();
                    if !info.running {
                        return Err(EngineError::StdinClosed(format!("background process {pid} has ended")));
                    }
                    if now >= until {
                        return Err(EngineError::StdinFull(pid, forkbox_linux::tty::INPUT_CAPACITY));
                    }
                    if self.run_background(until.min(now + JOB_WAIT_SLICE))? == BackgroundRun::Idle {
                        std::thread::sleep(JOB_WATCH_IDLE.min(until.saturating_duration_since(Instant::now())));
                    }
                }
            }
        }
        self.job(pid)
    }

    /// Send each of `sigs` to the live processes of group `pgid`.
    fn signal_group(&mut self, pgid: u32, sigs: &[i32]) {
        if sigs.is_empty() {
            return;
        }
        let Ok(targets) = self.kernel.procs.kill_targets(GUEST_PID, -(pgid as i32)) else { return };
        for &sig in sigs {
            for &t in &targets {
                // Not SI_KERNEL: that is the host's interrupt of an exec.
                let info = SigInfo::user(sig, forkbox_linux::thread::SI_USER);
                self.kernel.procs.outbox.push((t, info));
            }
        }
        self.sched.deliver_outbox(&mut self.kernel);
    }

    /// Resize the terminal of job `pid` (SIGWINCH to its foreground group
    /// when the size changes); `NotATerminal` for a job started without one.
    pub fn job_resize(&mut self, pid: u32, rows: u16, cols: u16) -> Result<JobInfo, EngineError> {
        self.job(pid)?;
        let master = self.job_pty(pid).ok_or(EngineError::NotATerminal(pid))?;
        let p = self
            .sched
            .cur
            .proc
            .fds
            .objects
            .pty_mut(master)
            .map_err(|e| EngineError::Poisoned(format!("pty: {e:?}")))?;
        let size = forkbox_linux::tty::WinSize { rows, cols, xpixel: 0, ypixel: 0 };
        if p.winsize != size {
            p.winsize = size;
            if let Some(g) = p.pgrp {
                self.signal_group(g, &[libc::SIGWINCH]);
            }
        }
        self.job(pid)
    }

    /// The end of an exec: children still running are killed (their
    /// descriptors close), unreaped zombies are forgotten. Returns how many were killed.
    fn end_children(&mut self) -> usize {
        self.sched.make_main_current();
        let mut killed = 0;
        while !self.sched.others.is_empty() {
            let pid = self.sched.others[0].proc.pid;
            self.jobs.ended(pid, Exit::Signal(forkbox_linux::thread::SIGKILL));
            self.sched.swap_task(0);
            self.with_ctx(syscalls::release_shared);
            self.close_all_fds();
            self.sched.swap_task(0);
            let t = self.sched.others.remove(0);
            if let Some(vm) = t.vm {
                crate::pool::reap(vm);
            }
            killed += 1;
        }
        self.kernel.procs.keep_only_main();
        self.kernel.jobs.clear();
        self.kernel.job_in.clear();
        self.sched.apply_memory_limit();
        // The one process left keeps its shared mappings as private memory (what a checkpoint stores).
        if let Err(e) = self.with_ctx(syscalls::privatize_shared) {
            tracing::warn!("shared memory at the end of an exec: {e:?}");
        }
        killed
    }

    /// fork: the child is a new VM over a copy of the caller's memory (the
    /// same backing file copy-on-write + its private pages), with its vCPU
    /// state and RAX = 0, and a copy of its process state.
    fn fork_process(&mut self, regs: &kvm_regs, spec: &ForkSpec) -> Result<(), EngineError> {
        let parent = self.sched.cur.vm.as_ref().expect("sandbox VM present until drop");
        let (mem, pages) = parent.mem().fork_copy()?;
        let mut vm = Vm::new(&self.cpu, mem)?;
        let st = parent.save_vcpu()?;
        vm.restore_vcpu(&st)?;
        let mut child = self.sched.cur.proc.fork_child(spec.pid);
        let mut u = after_syscall(regs, 0);
        if spec.stack != 0 {
            u.rsp = spec.stack;
        }
        vm.enter_user(&u)?;
        if let Some(tls) = spec.tls {
            vm.set_fs_base(tls)?;
            child.fs_base = tls;
        }
        if let Some(addr) = spec.set_tid {
            // Checked writable by the handler (the child has the same map).
            vm.mem_mut().write(addr, &spec.pid.to_le_bytes())?;
        }
        if let Some(addr) = spec.clear_tid {
            child.tid_address = addr;
        }
        crate::vdso::refresh(&mut vm, self.vdso)?;
        self.jobs.join(&mut self.kernel, self.sched.cur.proc.pid, spec.pid);
        // What the child holds before it runs: its copy of the parent's private pages
        // (and the page its tid went to), and the shared mappings.
        let shared: u64 = vm.mem().shared_ranges().map(|(_, r)| r.len).fold(0, u64::saturating_add);
        let mut task = Task::new(vm, child);
        let copied = pages.saturating_add(1).saturating_mul(forkbox_vmm::layout::PAGE_SIZE);
        task.held = Some(copied.saturating_add(shared));
        self.sched.add(task);
        Ok(())
    }

    /// execve past its checks: the old address space goes (its VM is torn down
    /// in the background), the program is loaded into a fresh VM.
    fn exec_program(&mut self, spec: ExecSpec) -> Result<(), EngineError> {
        self.with_ctx(syscalls::release_shared);
        // The program's node stays while the close-on-exec fds close (an
        // fexecve of one of them, an unlinked file).
        self.sched.cur.proc.vfs.hold(spec.ino);
        let closes = self.sched.cur.proc.fds.exec_closes();
        self.with_ctx(|ctx| syscalls::close_fds(ctx, &closes));
        self.sched.cur.proc.exec_reset();
        let mut vm = Vm::new(&self.cpu, GuestMemory::anonymous(RAM_SIZE)?)?;
        let (argv, envp) = (&spec.argv, &spec.envp);
        let proc = &mut self.sched.cur.proc;
        let loaded = loader::exec_node(vm.mem_mut(), proc, &spec.path, Some(spec.ino), argv, envp, &self.exec_opts);
        proc.vfs.release(spec.ino);
        let start = match loaded {
            Ok(s) => s,
            Err(e) => {
                // Past the point of no return, as on Linux: the process dies.
                let note = format!("[forkbox: execve of {} failed after the old program was gone: {e}]\n", spec.path);
                self.kernel.output(Stream::Stderr, note.as_bytes());
                crate::pool::reap(vm);
                return Err(EngineError::GuestSignaled(forkbox_linux::thread::SIGKILL));
            }
        };
        vm.boot(&self.cpu, start.entry, start.rsp)?;
        self.sched.cur.proc.mm.sync_all_page_tables(vm.mem_mut())?;
        crate::vdso::refresh(&mut vm, self.vdso)?;
        self.jobs.exec(self.sched.cur.proc.pid, &spec.argv);
        if let Some(old) = self.sched.cur.vm.replace(vm) {
            crate::pool::reap(old);
        }
        self.sched.cur.pending_user = None;
        self.sched.cur.in_stub = false;
        self.sched.cur.wait_on.clear();
        self.sched.cur.woken = None;
        // A new address space: the next checkpoint records it whole.
        self.sched.cur.mem_chain.clear();
        self.sig.fault = None;
        Ok(())
    }

    /// The guest wrote past the agent channel's cap: end the exec (nothing past
    /// the cap was buffered).
    fn check_agent_overflow(&mut self) -> Result<(), EngineError> {
        if !self.kernel.agent_overflow {
            return Ok(());
        }
        self.kernel.agent_out = Vec::new();
        Err(EngineError::Protocol(format!(
            "the guest wrote more than {} bytes to the agent channel in one reply",
            self.kernel.agent_out_limit
        )))
    }

    /// The guest ends by signal `sig`. A handler re-raising the fault it got
    /// (faulthandler does) is that crash, reported with the fault's address.
    fn signaled(&self, sig: i32) -> EngineError {
        match self.sig.fault.as_ref().filter(|(s, _)| *s == sig) {
            Some((_, fault)) => self.with_stderr(EngineError::GuestCrashed(signal::crash_report(fault))),
            None => EngineError::GuestSignaled(sig),
        }
    }

    /// A crash report with what the guest last wrote to stderr (e.g. Python's
    /// faulthandler traceback), at most 1 KiB of it.
    fn with_stderr(&self, e: EngineError) -> EngineError {
        let EngineError::GuestCrashed(why) = e else { return e };
        let data = &self.kernel.stderr.data;
        if data.is_empty() {
            return EngineError::GuestCrashed(why);
        }
        let tail = &data[data.len().saturating_sub(1024)..];
        EngineError::GuestCrashed(format!("{why}; stderr: {}", String::from_utf8_lossy(tail).trim_end()))
    }

    /// The exec's deadline, or the grace period after an interrupt, has passed: end it.
    fn check_deadline(&self, deadline: Instant) -> Result<(), EngineError> {
        let now = Instant::now();
        if self.sig.grace.is_some_and(|g| g <= deadline && now >= g) {
            return Err(EngineError::Interrupted(format!(
                "the guest did not get back to the agent within {} s of the interrupt",
                signal::GRACE.as_secs()
            )));
        }
        if now >= deadline {
            return Err(EngineError::Timeout(self.exec_timeout.as_secs_f64()));
        }
        Ok(())
    }

    /// Turn a triggered interrupt into a SIGINT for the guest (the main thread
    /// takes it unless it blocks it); the first one of the exec starts the
    /// grace period (host-side sleeps end there too). It is queued only once
    /// the agent has read its whole request.
    fn note_interrupt(&mut self) -> Result<(), EngineError> {
        if let Some(latch) = &self.kernel.interrupt {
            if latch.take() {
                self.sig.want = true;
                // The guest's resolver waits out its own timeout through
                // signals: its host lookups answer SERVFAIL now instead.
                self.kernel.net.cancel_lookups();
                if self.sig.grace.is_none() {
                    let g = Instant::now() + signal::GRACE;
                    self.sig.grace = Some(g);
                    self.kernel.deadline = Some(self.kernel.deadline.map_or(g, |d| d.min(g)));
                }
            }
        }
        if self.sig.want && self.kernel.agent_pending() == 0 && self.sched.cur.proc.pid == GUEST_PID {
            SignalState::check_interrupt(&self.sched.cur.proc)?;
            self.sig.want = false;
            self.sched.cur.proc.threads.send_process(SigInfo::user(SIGINT as i32, SI_KERNEL));
        }
        Ok(())
    }

    // ----- threads -------------------------------------------------------------

    /// Between two runs of the vCPU: the scheduler picks who runs (see
    /// [`Scheduler::pick`]); while nobody can, the host waits for the next
    /// event, within the exec's deadline, and a host interrupt becomes a signal.
    fn schedule(&mut self, deadline: Instant) -> Result<(), EngineError> {
        self.sched.end_process_slice(self.sig.want);
        loop {
            match self.sched.pick(&mut self.kernel) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(EngineError::GuestSignaled(sig)) => return Err(self.signaled(sig)),
                Err(e) => return Err(e),
            }
            let until = self.sig.grace.map_or(deadline, |g| g.min(deadline));
            if let HostWait::Woken = self.sched.wait_host(&mut self.kernel, until, self.bg_wake)? {
                // A request for the sandbox came: the background run ends here.
                return Err(EngineError::Timeout(self.exec_timeout.as_secs_f64()));
            }
            self.check_deadline(deadline)?;
            self.note_interrupt()?;
        }
    }

    /// Before the vCPU runs: give the current thread the user state it must
    /// resume with (after a wait or a switch), delivering its pending signals
    /// first; or deliver them where the vCPU stopped (user code, or the syscall
    /// stub's iretq; inside a stub before its exit they wait for the next exit).
    fn deliver_at_vcpu(&mut self) -> Result<(), EngineError> {
        if let Some(u) = self.sched.cur.pending_user.take() {
            let u = self.deliver_signals(u)?;
            let in_stub = self.sched.cur.in_stub;
            let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
            if !in_stub && vm.in_user_mode()? {
                let mut s = u;
                s.rflags = (u.rflags & 0x0000_0000_0020_0CD5) | forkbox_vmm::arch::USER_RFLAGS;
                vm.set_regs(&s)?;
            } else {
                vm.enter_user(&u)?;
            }
            return Ok(());
        }
        let cur = self.sched.cur.proc.threads.cur;
        if self.sched.cur.proc.deliverable(cur) == 0 {
            return Ok(());
        }
        let vm = self.sched.cur.vm.as_ref().expect("sandbox VM present until drop");
        let regs = vm.regs()?;
        if let Some(u) = vm.user_regs_at_iretq(&regs)? {
            let h = self.deliver_signals(u)?;
            self.vm().enter_user(&h)?;
        } else if vm.in_user_mode()? {
            let h = self.deliver_signals(regs)?;
            self.vm().set_regs(&h)?;
        }
        Ok(())
    }

    /// Deliver the current thread's pending signals to user state `u`: the
    /// registers to enter user mode with (a handler's, or `u` when nothing
    /// had a handler). A call a signal ended is restarted or returns EINTR
    /// here, as Linux decides it (SA_RESTART).
    fn deliver_signals(&mut self, mut u: kvm_regs) -> Result<kvm_regs, EngineError> {
        let cur = self.sched.cur.proc.threads.cur;
        let restart = self.sched.cur.proc.threads.list[cur].restart.take();
        loop {
            let set = self.sched.cur.proc.deliverable(cur);
            if set == 0 {
                break;
            }
            let Some(info) = self.sched.cur.proc.threads.take(cur, set) else { break };
            let act = signal::action(&self.sched.cur.proc, info.signo as usize);
            match act.handler {
                signal::SIG_IGN => continue,
                signal::SIG_DFL => match signal::default_action(info.signo) {
                    signal::DefaultAction::Ignore => continue,
                    signal::DefaultAction::Terminate if info.signo as usize == SIGINT && info.code == SI_KERNEL => {
                        return Err(EngineError::Interrupted("SIGINT has its default action (terminate)".into()))
                    }
                    signal::DefaultAction::Terminate => return Err(self.signaled(info.signo)),
                },
                _ => {}
            }
            if let Some((nr, ok)) = restart {
                if ok && act.flags & signal::SA_RESTART != 0 {
                    u.rip = u.rip.wrapping_sub(2);
                    u.rax = nr;
                } else {
                    u.rax = Errno::EINTR.to_rax();
                }
            }
            let restore = self.sched.cur.proc.threads.list[cur].restore_mask.take();
            let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
            return signal::deliver(vm, &mut self.sched.cur.proc, &u, &info, restore);
        }
        if let Some((nr, _)) = restart {
            // Nothing ran a handler: the call goes on as if never interrupted.
            u.rip = u.rip.wrapping_sub(2);
            u.rax = nr;
        }
        Ok(u)
    }

    /// Run one syscall handler on the guest's state.
    fn dispatch(
        &mut self,
        nr: u64,
        args: &forkbox_linux::kernel::Args,
        timed_out: bool,
    ) -> (forkbox_linux::SysResult, Option<Effect>) {
        let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
        let mut ctx = Ctx {
            mem: vm.mem_mut(),
            proc: &mut self.sched.cur.proc,
            kernel: &mut self.kernel,
            effect: None,
            timed_out,
        };
        let result = syscalls::dispatch(&mut ctx, nr, args);
        (result, ctx.effect)
    }

    /// Handle one syscall exit of the current thread; `Some` when the guest stops (parks).
    fn syscall(&mut self, regs: kvm_regs) -> Result<Option<Stop>, EngineError> {
        let args = [regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9];
        let (result, effect) = self.dispatch(regs.rax, &args, false);
        let mut ret = match result {
            Ok(v) => v,
            Err(e) => e.to_rax(),
        };
        let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
        match effect {
            None => {}
            Some(Effect::Park) => {
                if self.sched.cur.proc.pid != GUEST_PID || self.sched.cur.proc.tid() != MAIN_TID {
                    // Only the agent (the main thread) reads requests.
                    ret = Errno::EAGAIN.to_rax();
                } else if !self.sched.cur.proc.threads.current().frames.is_empty() {
                    // Never snapshot a guest in the middle of a signal delivery.
                    return Err(EngineError::GuestCrashed(
                        "the agent waited for a request inside a signal handler".into(),
                    ));
                } else {
                    return Ok(Some(Stop::Parked(regs)));
                }
            }
            Some(Effect::Exit(code)) => return Err(EngineError::GuestExited(code)),
            Some(Effect::Signaled(sig)) => return Err(self.signaled(sig)),
            Some(Effect::SetFsBase(base)) => vm.set_fs_base(base)?,
            Some(Effect::SigReturn) => {
                let u = signal::sigreturn(vm, &mut self.sched.cur.proc, regs.rsp)?;
                // A handler that ended rt_sigsuspend returned: so does the call (EINTR, already in `u`).
                self.sched.cur.pending_user = Some(u);
                return Ok(None);
            }
            Some(Effect::Block(b)) => {
                let clock = &self.sched.cur.proc.threads.clock;
                let deadline = b.deadline.map(|d| clock.from_instant(d));
                let kind = wait_kind(&b.on, &WaitKind::Other);
                if kind == WaitKind::Other {
                    self.sched.cur.wait_on.insert(self.sched.cur.proc.tid(), b.on);
                } else if !self.sched.cur.wait_on.is_empty() {
                    self.sched.cur.wait_on.remove(&self.sched.cur.proc.tid());
                }
                let on_timeout = b.on_timeout.map_err(|e| e.0);
                self.sched.cur.proc.threads.current_mut().wait =
                    Some(Wait::new(Regs::from(&regs), deadline, on_timeout, kind));
                self.sched.resched = true;
                return Ok(None);
            }
            Some(Effect::Spawn { tid, stack }) => {
                let mut u = after_syscall(&regs, 0);
                if stack != 0 {
                    u.rsp = stack;
                }
                let xsave = Arc::new(Xsave::from(&vm.xsave()?));
                if let Some(i) = self.sched.cur.proc.threads.index_of(tid) {
                    self.sched.cur.proc.threads.list[i].cpu = Some(SavedCpu { regs: Regs::from(&u), xsave });
                }
            }
            Some(Effect::ThreadExit) => {
                let cur = self.sched.cur.proc.threads.cur;
                self.sched.cur.proc.threads.remove(cur);
                // The vCPU holds a thread that is gone: load another one
                // (the process' per-thread fields are the gone thread's, so no save).
                let i = self.sched.cur.proc.threads.cur;
                self.sched.cur.proc.load_current(i);
                self.sched.cur.pending_user = None;
                self.sched.resched = true;
                return Ok(None);
            }
            Some(Effect::Yield) => {
                self.sched.yielded = true;
                self.sched.resched = true;
            }
            Some(Effect::Woke) => {
                self.sched.woke = true;
                self.sched.resched = true;
            }
            Some(Effect::Fork(spec)) => {
                if !self.sched.fork_fits() {
                    self.kernel.procs.unspawn(spec.pid);
                    ret = Errno::ENOMEM.to_rax();
                } else if let Err(e) = self.fork_process(&regs, &spec) {
                    tracing::warn!("fork: {e}");
                    self.kernel.procs.unspawn(spec.pid);
                    ret = Errno::ENOMEM.to_rax();
                }
            }
            Some(Effect::Exec(spec)) => {
                self.exec_program(*spec)?;
                return Ok(None);
            }
        }
        self.sched.deliver_outbox(&mut self.kernel);
        let woken = self.sched.deliver_shared_wakes(&mut self.kernel);
        if woken > 0 && (ret as i64) >= 0 {
            ret = ret.saturating_add(woken);
        }
        let vm = self.sched.cur.vm.as_mut().expect("sandbox VM present until drop");
        if self.sched.cur.proc.threads.is_simple() {
            vm.complete_syscall(&regs, ret)?;
            return Ok(None);
        }
        // Signals go on the way back to user mode; a switch may come first.
        self.sched.cur.pending_user = Some(after_syscall(&regs, ret));
        Ok(None)
    }
}

/// 256 fresh bits from the host, in hex, for a fork's first exec to reseed with.
fn fresh_seed() -> Result<String, EngineError> {
    forkbox_linux::random::random_hex(32)
        .map_err(|e| EngineError::Protocol(format!("no randomness for a reseed: {e:?}")))
}

fn take_text(c: &mut forkbox_linux::kernel::state::Capture) -> String {
    let (data, dropped) = c.take();
    let mut s = String::from_utf8_lossy(&data).into_owned();
    if dropped > 0 {
        s.push_str(&format!("\n[forkbox: output truncated, {dropped} more bytes dropped]\n"));
    }
    s
}

/// Host pages behind a sandbox's guest memory.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MemoryFootprint {
    /// Pages the guest touched (mapped in the host page tables).
    pub touched_pages: u64,
    /// Pages it wrote: private copies (copy-on-write or fresh anonymous).
    pub private_pages: u64,
}

/// What a sandbox uses (see [`Sandbox::usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

/// Read /proc/self/pagemap over one guest memory mapping.
fn footprint(mem: &GuestMemory) -> MemoryFootprint {
    let mut fp = MemoryFootprint::default();
    let Ok(f) = std::fs::File::open("/proc/self/pagemap") else { return fp };
    let pages = mem.size() / 4096;
    let first = mem.host_addr() / 4096;
    let mut buf = vec![0u8; 8 * 65536];
    let mut done = 0;
    while done < pages {
        let n = (pages - done).min(65536);
        let bytes = &mut buf[..(n * 8) as usize];
        if std::os::unix::fs::FileExt::read_exact_at(&f, bytes, (first + done) * 8).is_err() {
            break;
        }
        for e in bytes.chunks_exact(8) {
            let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
            if v & (1 << 63) != 0 {
                fp.touched_pages += 1;
                if v & (1 << 61) == 0 {
                    fp.private_pages += 1;
                }
            }
        }
        done += n;
    }
    fp
}

impl Sandbox {
    /// Read /proc/self/pagemap over the guest's RAM mapping.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        self.sched.cur.vm.as_ref().map_or_else(MemoryFootprint::default, |vm| footprint(vm.mem()))
    }

    /// Every private page of the guest memory (see `memory_footprint`), by
    /// guest address, and whether it is the host's shared zero page (a read
    /// of fresh anonymous memory: no host memory of its own). A diagnostic:
    /// page frame numbers and /proc/kpageflags need CAP_SYS_ADMIN; without it
    /// no page reads as zero.
    pub fn private_page_list(&self) -> Vec<(u64, bool)> {
        use std::os::unix::fs::FileExt;
        let Some(vm) = &self.sched.cur.vm else { return Vec::new() };
        let mem = vm.mem();
        let Ok(f) = std::fs::File::open("/proc/self/pagemap") else { return Vec::new() };
        // The zero page's frame: read a fresh anonymous page.
        // /proc/kpageflags: bit 24 marks the zero page.
        let kflags = std::fs::File::open("/proc/kpageflags").ok();
        let is_zero_pfn = |pfn: u64| {
            let mut e = [0u8; 8];
            pfn != 0
                && kflags.as_ref().is_some_and(|k| k.read_exact_at(&mut e, pfn * 8).is_ok())
                && u64::from_le_bytes(e) & (1 << 24) != 0
        };
        let pages = mem.size() / 4096;
        let first = mem.host_addr() / 4096;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 8 * 65536];
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(65536);
            let bytes = &mut buf[..(n * 8) as usize];
            if f.read_exact_at(bytes, (first + done) * 8).is_err() {
                break;
            }
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
                if v & (1 << 63) != 0 && v & (1 << 61) == 0 {
                    let is_zero = is_zero_pfn(v & ((1 << 55) - 1));
                    out.push(((done + i as u64) * 4096, is_zero));
                }
            }
            done += n;
        }
        out
    }
}

/// Make the listeners of a checkpoint again in `net`: only those `proc`'s fd
/// table names as a stream socket of the same family (one it does not name
/// could never be closed).
fn restore_listeners(
    net: &mut forkbox_linux::net::NetIo,
    proc: &Process,
    listeners: &[forkbox_linux::net::ListenerState],
) -> Result<(), EngineError> {
    if listeners.is_empty() {
        return Ok(());
    }
    let named: std::collections::HashSet<(u64, i32)> =
        proc.fds.sockets().filter(|s| s.stream).map(|s| (s.id, s.domain)).collect();
    let keep: Vec<_> = listeners.iter().filter(|l| named.contains(&(l.id, l.domain))).cloned().collect();
    net.restore_listeners(&keep)
        .map_err(|e| forkbox_snapshot::StateError::Corrupt(format!("listening sockets: {e}")).into())
}
