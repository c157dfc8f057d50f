//! A sandbox: one guest process in one VM, driven through the agent channel.

use std::time::{Duration, Instant};

pub use forkbox_linux::io::Stream;
use forkbox_linux::io::Io;
use forkbox_linux::layout::{RAM_SIZE, STACK_GUARD};
use forkbox_linux::loader;
use forkbox_linux::syscalls::{self, Ctx, Effect};
use forkbox_linux::wait;
use forkbox_linux::Process;
use forkbox_vmm::{kvm_regs, GuestMemory, Vm, VmExit};
use serde::Serialize;

use crate::error::EngineError;
use crate::files::{self, FileEntry, OutputFile, OutputIndex};
use crate::interrupt::Interrupter;
use crate::limits::Limits;
use crate::protocol::{self, ExecReply, ExecRequest, PyError};
use crate::signal::{self, SignalState};
use crate::Engine;

/// The guest program: CPython running the agent.
pub const AGENT_PATH: &str = "/opt/forkbox/agent.py";
const PYTHON: &str = "/usr/bin/python3";

/// The outcome of one exec. A Python exception is a result (`error` set), not an `Err`.
#[derive(Clone, Debug, Serialize)]
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
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFile>,
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
}

/// Counters of one guest run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunStats {
    pub syscalls: u64,
    pub unimplemented: Vec<(String, u64, u64)>,
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
    vm: Option<Vm>,
    proc: Process,
    io: Io,
    state: State,
    limits: Limits,
    /// What the agent reported when it became ready (python/numpy versions).
    pub ready_info: serde_json::Value,
    /// Time from creation to the agent's first park.
    pub boot_time: Duration,
    /// A fork that has not run yet: its first request tells the agent to
    /// reseed what lives in guest memory (random, numpy.random).
    reseed_pending: bool,
    vdso: bool,
    /// Where a forked sandbox's VM goes back to when it ends cleanly.
    pool: Option<std::sync::Arc<crate::pool::VmPool>>,
    /// `/output` as of the last exec (to report what the next one changes).
    outputs: OutputIndex,
    /// SIGINT delivery in the current run (host-side, never snapshotted).
    sig: SignalState,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let Some(vm) = self.vm.take() else { return };
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
        let envp = ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8", "TERM=dumb", env_preload.as_str()];
        let argv = [PYTHON, "-I", "-B", AGENT_PATH];
        let opts = loader::ExecOptions { hwcap: engine.hwcap, vdso: engine.vdso };
        let start = loader::exec(vm.mem_mut(), &mut proc, PYTHON, &argv, &envp, &opts)?;
        vm.boot(&engine.cpu, start.entry, start.rsp, &[STACK_GUARD])?;
        crate::vdso::refresh(&mut vm, engine.vdso.is_some())?;
        let mut io = Io::new(limits.output_bytes);
        io.net = forkbox_linux::net::NetIo::new(std::sync::Arc::new(limits.network.clone()));
        io.trace = trace;
        let mut sb = Sandbox {
            vm: Some(vm),
            proc,
            io,
            state: State::Poisoned("not started".into()),
            limits,
            ready_info: serde_json::Value::Null,
            boot_time: Duration::ZERO,
            reseed_pending: false,
            vdso: engine.vdso.is_some(),
            pool: None,
            outputs: OutputIndex::default(),
            sig: SignalState::default(),
        };
        // Booting python + numpy takes far longer than one exec here: allow a generous deadline.
        let deadline = Instant::now() + sb.limits.timeout.max(Duration::from_secs(120));
        let Stop::Parked(regs) = sb.run(None, deadline, &mut None).map_err(|e| match e {
            EngineError::Timeout(_) => EngineError::Boot("timed out before the agent was ready".into()),
            e => EngineError::Boot(format!("{e}; stderr: {}", String::from_utf8_lossy(&sb.io.stderr.data))),
        })?;
        let (info, _) = protocol::unframe(&std::mem::take(&mut sb.io.agent_out))?;
        if info.get("ready") != Some(&serde_json::Value::Bool(true)) {
            return Err(EngineError::Boot(format!("agent not ready: {info}")));
        }
        sb.io.stdout.take();
        sb.io.stderr.take();
        sb.ready_info = info;
        sb.state = State::Parked(regs);
        sb.boot_time = t0.elapsed();
        Ok(sb)
    }

    /// A sandbox resumed from a snapshot: `vm` already holds its memory and
    /// vCPU state, parked on the agent's read.
    pub(crate) fn resumed(
        vm: Vm,
        mut proc: Process,
        limits: Limits,
        vdso: bool,
        info: serde_json::Value,
        pool: Option<std::sync::Arc<crate::pool::VmPool>>,
        reseed: bool,
    ) -> Result<Sandbox, EngineError> {
        proc.mm.set_limit(limits.memory_bytes);
        proc.vfs.set_quota(limits.disk_bytes);
        let regs = vm.regs()?;
        let mut io = Io::new(limits.output_bytes);
        // Fresh host-side network state: sockets in `proc` from the snapshot read as reset.
        io.net = forkbox_linux::net::NetIo::new(std::sync::Arc::new(limits.network.clone()));
        Ok(Sandbox {
            vm: Some(vm),
            proc,
            io,
            state: State::Parked(regs),
            limits,
            ready_info: info,
            boot_time: Duration::ZERO,
            reseed_pending: reseed,
            vdso,
            pool,
            outputs: OutputIndex::default(),
            sig: SignalState::default(),
        })
    }

    /// The parts of a parked sandbox a snapshot needs.
    pub(crate) fn parked_parts(&self) -> Result<(&Vm, &Process), EngineError> {
        match (&self.state, &self.vm) {
            (State::Parked(_), Some(vm)) => Ok((vm, &self.proc)),
            (State::Poisoned(why), _) => Err(EngineError::Poisoned(why.clone())),
            _ => Err(EngineError::Poisoned("no VM".into())),
        }
    }

    /// Mutable parts of a parked sandbox (for a checkpoint).
    pub(crate) fn parked_parts_mut(&mut self) -> Result<(&mut Vm, &Process), EngineError> {
        match (&self.state, &mut self.vm) {
            (State::Parked(_), Some(vm)) => Ok((vm, &self.proc)),
            (State::Poisoned(why), _) => Err(EngineError::Poisoned(why.clone())),
            _ => Err(EngineError::Poisoned("no VM".into())),
        }
    }

    /// Is the guest parked and usable?
    pub fn is_usable(&self) -> bool {
        matches!(self.state, State::Parked(_)) && self.vm.is_some()
    }

    fn vm(&mut self) -> &mut Vm {
        // Only `drop` takes the VM out.
        self.vm.as_mut().expect("sandbox VM present until drop")
    }

    pub fn stats(&self) -> RunStats {
        let s = &self.io.stats;
        RunStats {
            syscalls: s.total,
            unimplemented: s
                .unimplemented
                .iter()
                .map(|(nr, n)| (syscalls::name(*nr).to_string(), *nr, *n))
                .collect(),
        }
    }

    /// Log every syscall from now on (`--trace-syscalls`).
    pub fn set_trace(&mut self, on: bool) {
        self.io.trace = on;
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Network counters of this sandbox (connects allowed/denied, DNS, bytes).
    pub fn net_stats(&self) -> forkbox_linux::net::NetStats {
        self.io.net.stats.clone()
    }

    /// Run `code` in the session's namespace.
    pub fn exec(&mut self, code: &str) -> Result<ExecResult, EngineError> {
        self.exec_with(code, ExecOptions::default())
    }

    /// Run `code`, streaming its output and/or interruptible (see `ExecOptions`).
    pub fn exec_with(&mut self, code: &str, opts: ExecOptions<'_>) -> Result<ExecResult, EngineError> {
        let regs = match &self.state {
            State::Parked(r) => *r,
            State::Poisoned(why) => return Err(EngineError::Poisoned(why.clone())),
        };
        if code.len() > self.limits.code_bytes {
            return Err(EngineError::CodeTooLarge(code.len(), self.limits.code_bytes));
        }
        let ExecOptions { mut on_output, interrupt } = opts;
        // The vCPU thread is the one to kick while this exec runs.
        let _attached = match &interrupt {
            Some(i) => Some(i.latch().attach()?),
            None => None,
        };
        let t0 = Instant::now();
        let syscalls_before = self.io.stats.total;
        self.outputs.refresh(&self.proc.vfs);
        let stream = on_output.is_some();
        let req = ExecRequest { op: "exec", code, value_limit: self.limits.output_bytes, reseed: self.reseed_pending, stream };
        self.reseed_pending = false;
        self.io.send_to_agent(protocol::frame(&req));
        self.io.agent_out.clear();
        let vdso = self.vdso;
        crate::vdso::refresh(self.vm(), vdso)?;
        let deadline = Instant::now() + self.limits.timeout;
        self.io.streaming = stream;
        self.io.interrupt = interrupt.as_ref().map(|i| i.latch().clone());
        let outcome = self.run(Some(regs), deadline, &mut on_output);
        self.io.streaming = false;
        self.io.streamed.clear();
        self.io.interrupt = None;
        let (stdout, stderr) = (take_text(&mut self.io.stdout), take_text(&mut self.io.stderr));
        let stop = match outcome {
            Ok(stop) => stop,
            Err(e) => {
                self.state = State::Poisoned(e.to_string());
                return Err(e);
            }
        };
        let Stop::Parked(regs) = stop;
        self.state = State::Parked(regs);
        let (reply, _) = protocol::unframe(&std::mem::take(&mut self.io.agent_out))?;
        if let Some(p) = reply.get("protocol_error") {
            return Err(EngineError::Protocol(p.to_string()));
        }
        let reply: ExecReply =
            serde_json::from_value(reply).map_err(|e| EngineError::Protocol(format!("bad exec reply: {e}")))?;
        let outputs = self.outputs.collect(&self.proc.vfs);
        Ok(ExecResult {
            value: reply.value,
            stdout,
            stderr,
            error: reply.error,
            runtime_ms: reply.runtime_ms,
            wall_ms: t0.elapsed().as_secs_f64() * 1000.0,
            syscalls: self.io.stats.total - syscalls_before,
            outputs,
        })
    }

    /// Hand streamed output written since the last call to the sink.
    fn flush_stream(&mut self, sink: &mut Option<OutputSink<'_>>) {
        if self.io.streamed.is_empty() {
            return;
        }
        let chunks = std::mem::take(&mut self.io.streamed);
        if let Some(f) = sink.as_mut() {
            for (stream, data) in &chunks {
                f(*stream, data);
            }
        }
    }

    // ----- files, host side (never the host file system: the guest's VFS) ----------

    fn guest_path(&self, path: &str) -> Result<String, EngineError> {
        let cwd = self.proc.vfs.dir_path(self.proc.cwd).unwrap_or_else(|_| b"/".to_vec());
        files::normalize(path, &cwd)
    }

    /// Write `data` to the guest file `path` (absolute or relative to the guest's cwd),
    /// creating parent directories; the file gets mode 0644.
    pub fn write_file(&mut self, path: &str, data: &[u8]) -> Result<(), EngineError> {
        let p = self.guest_path(path)?;
        if path.ends_with('/') {
            return Err(EngineError::File { code: "is_a_directory", message: format!("{path}: a file name cannot end with '/'") });
        }
        files::write_file(&mut self.proc.vfs, &p, data)
    }

    /// The bytes of the guest file `path`, at most `max` (else `file_too_large`).
    pub fn read_file(&self, path: &str, max: usize) -> Result<Vec<u8>, EngineError> {
        let p = self.guest_path(path)?;
        files::read_file(&self.proc.vfs, &p, max)
    }

    /// The entries of the guest directory `path`.
    pub fn list_dir(&self, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        let p = self.guest_path(path)?;
        files::list_dir(&self.proc.vfs, &p)
    }

    /// Run the guest until the agent parks. `resume`: the parked read to re-issue first.
    fn run(&mut self, resume: Option<kvm_regs>, deadline: Instant, sink: &mut Option<OutputSink<'_>>) -> Result<Stop, EngineError> {
        self.io.deadline = Some(deadline);
        self.sig.reset();
        let latch = self.io.interrupt.clone();
        if let Some(regs) = resume {
            let stop = self.syscall(regs)?;
            self.flush_stream(sink);
            if let Some(stop) = stop {
                return Ok(stop);
            }
        }
        loop {
            self.note_interrupt();
            if self.sig.want && self.io.agent_pending() == 0 {
                self.deliver_outside_syscall()?;
            }
            let run_deadline = self.sig.grace.map_or(deadline, |g| g.min(deadline));
            match self.vm().run(Some(run_deadline), latch.as_deref())? {
                VmExit::Syscall(regs) => {
                    let stop = self.syscall(regs)?;
                    self.flush_stream(sink);
                    if let Some(stop) = stop {
                        return Ok(stop);
                    }
                }
                // Picked up at the top of the loop.
                VmExit::Interrupted => {}
                VmExit::Exception(fault) => return Err(EngineError::GuestCrashed(fault.to_string())),
                VmExit::Shutdown { rip } => {
                    return Err(EngineError::GuestCrashed(format!("triple fault (VM shutdown) near rip {rip:#x}")))
                }
                VmExit::DeadlineExceeded => {
                    if self.sig.grace.is_some_and(|g| g <= deadline && Instant::now() >= g) {
                        return Err(EngineError::Interrupted(format!(
                            "the guest did not get back to the agent within {} s of the interrupt",
                            signal::GRACE.as_secs()
                        )));
                    }
                    return Err(EngineError::Timeout(self.limits.timeout.as_secs_f64()));
                }
                VmExit::Unexpected(why) => return Err(EngineError::GuestCrashed(why)),
            }
        }
    }

    /// Turn a triggered interrupt into a SIGINT to deliver; the first one of
    /// the exec starts the grace period (host-side sleeps end there too).
    fn note_interrupt(&mut self) {
        let Some(latch) = &self.io.interrupt else { return };
        if !latch.take() {
            return;
        }
        self.sig.want = true;
        if self.sig.grace.is_none() {
            let g = Instant::now() + signal::GRACE;
            self.sig.grace = Some(g);
            self.io.deadline = Some(self.io.deadline.map_or(g, |d| d.min(g)));
        }
    }

    /// Deliver a wanted SIGINT to a vCPU stopped outside a syscall: in user
    /// code (CPL 3), or at the syscall stub's iretq (the user state is in its
    /// frame). In the stub before its `out`, the syscall exit comes next and
    /// the signal goes on its way back.
    fn deliver_outside_syscall(&mut self) -> Result<(), EngineError> {
        let vm = self.vm.as_mut().expect("sandbox VM present until drop");
        let regs = vm.regs()?;
        if vm.in_user_mode()? {
            if let Some(h) = self.sig.deliver(vm, &mut self.proc, &regs)? {
                self.sig.want = false;
                vm.set_regs(&h)?;
            }
        } else if let Some(u) = vm.user_regs_at_iretq(&regs)? {
            if let Some(h) = self.sig.deliver(vm, &mut self.proc, &u)? {
                self.sig.want = false;
                vm.enter_user(&h)?;
            }
        }
        Ok(())
    }

    /// Run one syscall handler on the guest's state.
    fn dispatch(&mut self, nr: u64, args: &syscalls::Args, timed_out: bool) -> (forkbox_linux::SysResult, Option<Effect>) {
        let vm = self.vm.as_mut().expect("sandbox VM present until drop");
        let mut ctx = Ctx { mem: vm.mem_mut(), proc: &mut self.proc, io: &mut self.io, effect: None, timed_out };
        let result = syscalls::dispatch(&mut ctx, nr, args);
        (result, ctx.effect)
    }

    /// A call that blocked (`Effect::Block`), single-threaded: nothing but
    /// time (the call's deadline, a timerfd expiring) can change the state it
    /// waits on, so sleep until then and re-run the handler with the same
    /// arguments (see `forkbox_linux::wait`). The exec's deadline and its
    /// interrupt end the wait with EINTR (the run loop then reports the
    /// timeout or delivers the signal); a wait nothing can end is a deadlock.
    fn wait(
        &mut self,
        first: wait::Block,
        nr: u64,
        args: &syscalls::Args,
    ) -> Result<(forkbox_linux::SysResult, Option<Effect>), EngineError> {
        let wait::Block { mut on, deadline, on_timeout } = first;
        loop {
            // Host sockets in the wait set (directly or through an epoll) can
            // wake it too: wait on them on the host.
            let mut host = wait::host_fds(&self.proc, &self.io, &on);
            let wake = [deadline, wait::next_change(&self.proc, &on)].into_iter().flatten().min();
            let wake = match (wake, host.is_empty()) {
                (Some(w), _) => w,
                (None, false) => Instant::now() + Duration::from_secs(24 * 3600),
                (None, true) => {
                    return Err(EngineError::Deadlock(format!(
                        "{}() waits for {} with no timeout, and nothing else in the guest can wake it",
                        syscalls::name(nr),
                        describe_wait(&on)
                    )))
                }
            };
            let until = self.io.deadline.map_or(wake, |d| d.min(wake));
            let interrupted = if host.is_empty() {
                let d = until.saturating_duration_since(Instant::now());
                match &self.io.interrupt {
                    Some(latch) => latch.sleep(d),
                    None => {
                        std::thread::sleep(d);
                        false
                    }
                }
            } else {
                wait_host(&mut host, until, self.io.interrupt.as_deref())
            };
            let host_ready = !host.is_empty() && Instant::now() < until;
            if interrupted || (until < wake && !host_ready) {
                return Ok((Err(forkbox_linux::Errno::EINTR), None));
            }
            let timed_out = deadline.is_some_and(|t| Instant::now() >= t);
            match self.dispatch(nr, args, timed_out) {
                (_, Some(Effect::Block(b))) => {
                    if timed_out {
                        return Ok((on_timeout, None));
                    }
                    on = b.on;
                }
                done => return Ok(done),
            }
        }
    }

    /// Handle one syscall exit; `Some` when the guest stops (parks).
    fn syscall(&mut self, regs: kvm_regs) -> Result<Option<Stop>, EngineError> {
        let args = [regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9];
        let (result, effect) = match self.dispatch(regs.rax, &args, false) {
            (_, Some(Effect::Block(b))) => self.wait(b, regs.rax, &args)?,
            done => done,
        };
        let vm = self.vm.as_mut().expect("sandbox VM present until drop");
        let ret = match result {
            Ok(v) => v,
            Err(e) => e.to_rax(),
        };
        match effect {
            None => {}
            Some(Effect::Park) => {
                // Never snapshot a guest in the middle of a signal delivery.
                if self.sig.in_handler() {
                    return Err(EngineError::GuestCrashed("the agent waited for a request inside a signal handler".into()));
                }
                return Ok(Some(Stop::Parked(regs)));
            }
            Some(Effect::Exit(code)) => return Err(EngineError::GuestExited(code)),
            Some(Effect::Signaled(sig)) => return Err(EngineError::GuestSignaled(sig)),
            Some(Effect::SetFsBase(base)) => vm.set_fs_base(base)?,
            Some(Effect::SigReturn) => {
                let u = self.sig.sigreturn(vm, &mut self.proc, regs.rsp)?;
                vm.enter_user(&u)?;
                return Ok(None);
            }
            // `wait` never hands a Block back.
            Some(Effect::Block(_)) => return Err(EngineError::GuestCrashed("a blocked call was not resolved".into())),
        }
        if self.io.interrupt.is_some() {
            self.note_interrupt();
            if self.sig.want && self.io.agent_pending() == 0 {
                // The signal arrives on the way back from the syscall (an
                // interrupted sleep returns EINTR), as on Linux.
                let mut u = regs;
                u.rax = ret;
                u.rip = regs.rcx;
                u.rflags = regs.r11;
                let vm = self.vm.as_mut().expect("sandbox VM present until drop");
                if let Some(h) = self.sig.deliver(vm, &mut self.proc, &u)? {
                    self.sig.want = false;
                    vm.enter_user(&h)?;
                    return Ok(None);
                }
            }
        }
        let vm = self.vm.as_mut().expect("sandbox VM present until drop");
        vm.complete_syscall(&regs, ret)?;
        Ok(None)
    }
}

/// Wait on host fds until one is ready or `until`, checking for an interrupt
/// every 20 ms. True when interrupted.
fn wait_host(fds: &mut [libc::pollfd], until: Instant, latch: Option<&forkbox_vmm::InterruptLatch>) -> bool {
    loop {
        if latch.is_some_and(|l| l.is_pending()) {
            return true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        let slice = until.saturating_duration_since(now).min(Duration::from_millis(20));
        let ms = slice.as_millis().max(1) as i32;
        // SAFETY: fds is a valid array of pollfd of its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n > 0 {
            return false;
        }
    }
}

/// What a blocked call waits for, for the deadlock error.
fn describe_wait(on: &wait::WaitOn) -> String {
    match on {
        wait::WaitOn::Fd { .. } | wait::WaitOn::Fds(_) => "a file descriptor to become ready".into(),
        wait::WaitOn::Futex { addr, .. } => format!("the futex at {addr:#x}"),
        wait::WaitOn::Signal { .. } => "a signal".into(),
        wait::WaitOn::Child => "a child process".into(),
        wait::WaitOn::Time => "time".into(),
    }
}

fn take_text(c: &mut forkbox_linux::io::Capture) -> String {
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

impl Sandbox {
    /// Read /proc/self/pagemap over the guest's RAM mapping.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let Some(vm) = &self.vm else { return MemoryFootprint::default() };
        let mem = vm.mem();
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
}
