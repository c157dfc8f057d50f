//! The scheduler of a sandbox: its processes and their threads share one host
//! thread (one vCPU at a time), by time slices.
//!
//! Each guest process is a [`Task`] (its own VM, process state and where its
//! current thread stands on the vCPU); the [`Scheduler`] holds the one running
//! now and the others in round-robin order. It decides who runs next (a thread
//! whose wait just ended first, from its waker's next exit on when a futex wake
//! ended it; else round robin inside the process, and the processes by 5 ms slices), re-checks blocked threads (their handlers run
//! again; deadlines, wakes and signals end their waits), switches threads on
//! the vCPU (saving and loading their user state) and, when nobody can run,
//! waits on the host for the next event. What a syscall does, how signals are
//! delivered and what the agent is told are the sandbox's (`crate::sandbox`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use forkbox_linux::kernel::block::WaitOn;
use forkbox_linux::kernel::{Ctx, Effect, Kernel};
use forkbox_linux::procs::GUEST_PID;
use forkbox_linux::thread::{SavedCpu, SigInfo, Tid, WaitKind, SIGKILL, SI_KERNEL};
use forkbox_linux::{syscalls, wait, Errno, Process};
use forkbox_vmm::{after_syscall, kvm_regs, Regs, Vm, Xsave};

use crate::error::EngineError;

/// An internal errno (Linux's ERESTARTSYS): a signal ended a wait; the
/// delivery restarts the call or makes it EINTR.
pub(crate) const ERESTARTSYS: Errno = Errno(512);
/// A thread that may run alone on the vCPU before another runnable one gets it.
const SLICE: Duration = Duration::from_millis(5);
/// With other processes, how long the host waits at most when none can run
/// before their waits and timers are looked at again.
const PROCESS_POLL: Duration = Duration::from_millis(2);

/// A process of the sandbox: its VM and state, and where its current thread
/// stands on the vCPU.
pub(crate) struct Task {
    pub(crate) vm: Option<Vm>,
    pub(crate) proc: Process,
    /// The user state the current thread resumes with before the vCPU runs
    /// again (a syscall's return on the way to signal delivery, a loaded thread).
    pub(crate) pending_user: Option<kvm_regs>,
    /// The vCPU stopped at a syscall exit (so it is in the syscall stub).
    pub(crate) in_stub: bool,
    /// A thread whose wait just ended (it runs next).
    pub(crate) woken: Option<Tid>,
    /// What blocked fd waits wait on, by thread (for `wait::next_change`, a
    /// timerfd expiring; host-side: after a resume a re-run fills it again).
    pub(crate) wait_on: HashMap<Tid, WaitOn>,
    /// This process lost the vCPU at the end of a time slice: when it gets it
    /// back, its next runnable thread runs (round robin inside it too, so a
    /// CPU-bound thread does not keep every slice of its process).
    pub(crate) rr_due: bool,
    /// Where the last checkpoint recorded this process' memory (its layers,
    /// newest first), while its VM has logged the pages written since
    /// (empty: not recorded, or its memory was replaced: the next checkpoint
    /// records it whole over its base).
    pub(crate) mem_chain: Vec<forkbox_snapshot::MemoryRef>,
    /// Bytes of memory this process holds on the host, measured since it last
    /// ran (None: not measured, or it ran since: it may have written any of its
    /// mappings). A process that does not run writes no page, so the value
    /// holds until it runs again.
    pub(crate) held: Option<u64>,
    /// The memory limit's OOM kill sent it SIGKILL (it is not picked again).
    oom_killed: bool,
}

impl Task {
    /// A process whose vCPU stands at a syscall exit, nothing pending.
    pub(crate) fn new(vm: Vm, proc: Process) -> Task {
        Task {
            vm: Some(vm),
            proc,
            pending_user: None,
            in_stub: true,
            woken: None,
            wait_on: HashMap::new(),
            rr_due: false,
            mem_chain: Vec::new(),
            held: None,
            oom_killed: false,
        }
    }

    /// What the memory limit counts for this process: what it was measured to
    /// hold since it last ran, else all it has committed (it may write any of it).
    pub(crate) fn charge(&self) -> u64 {
        let committed = self.proc.mm.committed();
        self.held.map_or(committed, |h| h.min(committed))
    }

    /// Measure what the process holds (unless measured since it last ran): the
    /// pages it wrote privately (copy-on-write copies, fresh memory) and its
    /// shared mappings (counted in every process that maps them, an upper
    /// bound); file pages of the template it only read are shared by all and not counted.
    pub(crate) fn measure(&mut self) {
        if self.held.is_some() {
            return;
        }
        let mem = self.vm().mem();
        let shared: u64 = mem.shared_ranges().map(|(_, r)| r.len).fold(0, u64::saturating_add);
        // A host that cannot say (no pagemap) leaves the upper bound.
        self.held = match mem.private_pages() {
            Ok(bits) => {
                let pages: u64 = bits.iter().map(|w| u64::from(w.count_ones())).sum();
                Some(pages.saturating_mul(forkbox_vmm::layout::PAGE_SIZE).saturating_add(shared))
            }
            Err(e) => {
                tracing::warn!("memory limit: the private pages of a process: {e}");
                None
            }
        };
    }

    fn vm(&self) -> &Vm {
        // Only the sandbox's `drop` takes the VM out.
        self.vm.as_ref().expect("sandbox VM present until drop")
    }

    fn vm_mut(&mut self) -> &mut Vm {
        self.vm.as_mut().expect("sandbox VM present until drop")
    }

    /// The user-mode registers of the vCPU, if it is in user mode or at the
    /// syscall stub's iretq (None: inside an entry stub).
    pub(crate) fn user_state(&self) -> Result<Option<kvm_regs>, EngineError> {
        let vm = self.vm();
        let regs = vm.regs()?;
        if let Some(u) = vm.user_regs_at_iretq(&regs)? {
            return Ok(Some(u));
        }
        Ok(vm.in_user_mode()?.then_some(regs))
    }
}

/// What the host waited for when no thread could run.
pub(crate) enum HostWait {
    /// Time passed or an event came: look at the threads again.
    Waited,
    /// The sandbox's own wake-up fd (a request for it) became readable.
    Woken,
}

/// The processes of a sandbox and who runs on the vCPU.
pub(crate) struct Scheduler {
    /// The process on the host thread now.
    pub(crate) cur: Task,
    /// The sandbox's other processes (forked children), round robin.
    pub(crate) others: Vec<Task>,
    /// A time slice ended (or the current thread blocked): pick who runs.
    pub(crate) resched: bool,
    /// The current thread yielded (sched_yield): another runnable one goes first.
    pub(crate) yielded: bool,
    /// The current thread's last call woke others by a futex: they go first
    /// from its next exit on, not this one (it may still hold their lock;
    /// switching at once made a woken GIL waiter block on the GIL's mutex and
    /// cost two more exits and switches per hand-off).
    pub(crate) woke: bool,
    /// When the current thread got the vCPU.
    pub(crate) slice_start: Instant,
    /// Thread switches so far (for statistics).
    pub(crate) switches: u64,
    /// The memory limit of the whole process tree.
    memory_limit: u64,
}

impl Scheduler {
    /// One process (the agent's), on the vCPU.
    pub(crate) fn new(vm: Vm, proc: Process, memory_limit: u64) -> Scheduler {
        Scheduler {
            cur: Task::new(vm, proc),
            others: Vec::new(),
            resched: false,
            yielded: false,
            woke: false,
            slice_start: Instant::now(),
            switches: 0,
            memory_limit,
        }
    }

    /// How many threads the agent's process has.
    pub(crate) fn agent_threads(&self) -> usize {
        if self.cur.proc.pid == GUEST_PID {
            self.cur.proc.threads.len()
        } else {
            self.others.iter().find(|t| t.proc.pid == GUEST_PID).map_or(1, |t| t.proc.threads.len())
        }
    }

    /// A new process (a fork's child) joins the round robin.
    pub(crate) fn add(&mut self, task: Task) {
        self.others.push(task);
        self.apply_memory_limit();
    }

    /// Exchange the current process with `others[i]` (the shared state goes
    /// with the one that runs now).
    pub(crate) fn swap_task(&mut self, i: usize) {
        let t = &mut self.others[i];
        std::mem::swap(&mut self.cur, t);
        // The one that runs now may write: it counts all it committed until measured again.
        self.cur.held = None;
        self.cur.proc.swap_shared(&mut t.proc);
        self.slice_start = Instant::now();
        self.switches += 1;
        self.apply_memory_limit();
    }

    /// The current process ended (its state is released): the next one in
    /// round-robin order runs; the ended one is returned.
    pub(crate) fn remove_current(&mut self) -> Task {
        self.swap_task(0);
        self.others.remove(0)
    }

    /// The memory limit covers the whole tree: the current process may commit
    /// what the others leave of it. The others count what they hold (`Task::charge`):
    /// all they committed while that leaves room, else (past a quarter of the
    /// limit) what they were measured to hold; if what they really hold is over
    /// the limit (a process wrote more of its inherited mappings than the limit
    /// leaves), the largest child is killed (SIGKILL), as Linux's OOM killer would.
    pub(crate) fn apply_memory_limit(&mut self) {
        let others = self.held_by_others(self.memory_limit / 4);
        if others > self.memory_limit {
            // What is already killed goes when it next runs.
            let dying = self.others.iter().filter(|t| t.oom_killed).map(Task::charge).fold(0u64, u64::saturating_add);
            self.oom_kill(others.saturating_sub(dying));
        }
        self.cur.proc.mm.set_limit(self.memory_limit.saturating_sub(others));
    }

    /// Memory the processes other than the current one hold (`Task::charge`); past
    /// `measure_past` (an upper bound each while not measured) they are measured.
    pub(crate) fn held_by_others(&mut self, measure_past: u64) -> u64 {
        let sum = |ts: &[Task]| ts.iter().map(Task::charge).fold(0u64, u64::saturating_add);
        let bound = sum(&self.others);
        if bound <= measure_past {
            return bound;
        }
        self.others.iter_mut().for_each(Task::measure);
        sum(&self.others)
    }

    /// May the current process fork? The child starts holding a copy of the
    /// parent's private pages (at most all it committed) and may come to write
    /// all of its mappings; the parent may write all of its own. While all that
    /// fits beside the others' upper bounds nothing is measured; else the others
    /// and the parent are measured (the child counts what the parent holds).
    pub(crate) fn fork_fits(&mut self) -> bool {
        let mine = self.cur.proc.mm.committed();
        let room = self.memory_limit.saturating_sub(mine);
        let others = self.held_by_others(room.saturating_sub(mine));
        if others.saturating_add(mine) <= room {
            return true;
        }
        // The others are measured now; the child counts what the parent holds.
        self.cur.measure();
        let child = self.cur.charge();
        self.cur.held = None;
        others.saturating_add(child) <= room
    }

    /// SIGKILL the largest children (not the agent's process) until the others
    /// hold no more than the limit; `held` is what they hold now.
    fn oom_kill(&mut self, mut held: u64) {
        while held > self.memory_limit {
            let victim =
                self.others.iter_mut().filter(|t| t.proc.pid != GUEST_PID && !t.oom_killed).max_by_key(|t| t.charge());
            let Some(t) = victim else { return };
            tracing::info!("memory limit: process {} holds {} bytes; killed (SIGKILL)", t.proc.pid, t.charge());
            t.oom_killed = true;
            t.proc.threads.send_process(SigInfo::user(SIGKILL, SI_KERNEL));
            held = held.saturating_sub(t.charge());
        }
    }

    /// The next process in round-robin order becomes the current one.
    fn rotate(&mut self) {
        if self.others.is_empty() {
            return;
        }
        self.swap_task(0);
        let t = self.others.remove(0);
        self.others.push(t);
    }

    /// Make the agent's process the current one.
    pub(crate) fn make_main_current(&mut self) {
        if self.cur.proc.pid == GUEST_PID {
            return;
        }
        if let Some(i) = self.others.iter().position(|t| t.proc.pid == GUEST_PID) {
            self.swap_task(i);
        }
    }

    /// Processes share the vCPU thread by time slices; an interrupt goes to the
    /// agent's (`interrupt`: one waits to be delivered). A slice ends by time
    /// whether or not the vCPU ran into its deadline: a thread making syscalls
    /// all the time (a poll loop) never does.
    pub(crate) fn end_process_slice(&mut self, interrupt: bool) {
        if !self.others.is_empty() && (interrupt && self.cur.proc.pid != GUEST_PID || self.slice_over()) {
            if interrupt {
                self.make_main_current();
            } else {
                // Its slice is over: another of its threads goes first next time.
                self.cur.rr_due = true;
                self.rotate();
            }
        }
    }

    fn slice_over(&self) -> bool {
        self.slice_start.elapsed() >= SLICE
    }

    /// When the vCPU must stop at the latest to let the scheduler look again
    /// (the end of a slice, a timer or a wait's deadline), given `deadline`.
    pub(crate) fn run_deadline(&mut self, kernel: &mut Kernel, mut deadline: Instant) -> Instant {
        if !self.cur.proc.threads.is_simple() {
            if let Some(at) = self.next_wake(kernel) {
                deadline = deadline.min(at);
            }
            if self.cur.proc.threads.runnable_count() > 1 {
                deadline = deadline.min(self.slice_start + SLICE);
            }
        }
        if !self.others.is_empty() {
            deadline = deadline.min(self.slice_start + SLICE);
        }
        deadline
    }

    /// Between two runs of the vCPU: fire due timers, re-check blocked threads,
    /// and make sure the current thread is loaded and runnable (switching to
    /// another one, or another process). False if nobody can run.
    pub(crate) fn pick(&mut self, kernel: &mut Kernel) -> Result<bool, EngineError> {
        loop {
            let t = &self.cur.proc.threads;
            let cur = t.cur;
            let loaded = t.list[cur].cpu.is_none();
            if t.is_simple() && loaded && t.list[cur].wait.is_none() && !self.resched {
                return Ok(true);
            }
            let now = t.clock.now();
            self.cur.proc.threads.fire_timers(now);
            self.recheck_waits(kernel, now)?;
            let t = &self.cur.proc.threads;
            let cur_runnable = loaded && t.runnable(cur);
            // A thread whose wait just ended goes first (so a lock or the GIL
            // handed to it is taken at once), else round robin.
            let woken_tid = self.cur.woken.take();
            let mut woken = woken_tid.and_then(|tid| t.index_of(tid)).filter(|&i| i != cur && t.runnable(i));
            if std::mem::take(&mut self.woke) && cur_runnable && woken.is_some() {
                // The waker goes on to its next exit; the woken thread still goes first then.
                self.cur.woken = woken_tid;
                self.resched = true;
                woken = None;
            }
            let other = woken.or_else(|| t.next_runnable(cur).filter(|&i| i != cur));
            let switch = match other {
                Some(_) if !cur_runnable => true,
                Some(_) => woken.is_some() || self.yielded || self.cur.rr_due || self.slice_over(),
                None => false,
            };
            self.yielded = false;
            self.cur.rr_due = false;
            if switch {
                if let Some(next) = other {
                    if self.switch_to(next)? {
                        self.resched = false;
                        return Ok(true);
                    }
                }
            }
            if cur_runnable {
                self.resched = false;
                return Ok(true);
            }
            if !loaded {
                if let Some(i) = self.cur.proc.threads.next_runnable(cur) {
                    self.load(i)?;
                    self.resched = false;
                    return Ok(true);
                }
            }
            // Nobody here can run: another process may.
            if !self.others.is_empty() && self.rotate_to_runnable(kernel)? {
                continue;
            }
            return Ok(false);
        }
    }

    /// Nobody can run: wait on the host for the next event, until `until` at
    /// the latest. Host sockets a blocked call waits on (directly or through
    /// an epoll) end the wait too, and so does `wake` (the sandbox's request
    /// channel) becoming readable; the next [`Self::pick`] sees what changed.
    /// Every thread waiting with nothing that can end its wait is a deadlock.
    pub(crate) fn wait_host(
        &mut self,
        kernel: &mut Kernel,
        until: Instant,
        wake: Option<std::os::fd::RawFd>,
    ) -> Result<HostWait, EngineError> {
        let mut host = self.host_wait_fds(kernel);
        let next = match (self.next_wake(kernel), host.is_empty()) {
            (Some(w), _) => w,
            (None, false) => Instant::now() + Duration::from_secs(24 * 3600),
            (None, true) if self.others.is_empty() => return Err(EngineError::Deadlock(self.describe_deadlock())),
            (None, true) => Instant::now() + PROCESS_POLL,
        };
        // Other processes' timers and waits are looked at again soon.
        let next = if self.others.is_empty() { next } else { next.min(Instant::now() + PROCESS_POLL) };
        let until = until.min(next);
        let guest_fds = host.len();
        if let Some(fd) = wake {
            host.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
        if host.is_empty() {
            let d = until.saturating_duration_since(Instant::now());
            match &kernel.interrupt {
                Some(latch) => {
                    latch.sleep(d);
                }
                None => std::thread::sleep(d),
            }
        } else {
            let latch = kernel.interrupt.clone();
            wait::poll_host(&mut host, until, || latch.as_ref().is_some_and(|l| l.is_pending()));
        }
        if host.get(guest_fds).is_some_and(|p| p.revents != 0) {
            return Ok(HostWait::Woken);
        }
        Ok(HostWait::Waited)
    }

    /// Switch to the next process (round robin) that can run after its timers
    /// fired and its waits were re-checked; false if none can.
    fn rotate_to_runnable(&mut self, kernel: &mut Kernel) -> Result<bool, EngineError> {
        for _ in 0..self.others.len() {
            self.rotate();
            let now = self.cur.proc.threads.clock.now();
            self.cur.proc.threads.fire_timers(now);
            self.recheck_waits(kernel, now)?;
            if self.cur.proc.threads.runnable_count() > 0 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Signals the last syscall sent to other processes.
    pub(crate) fn deliver_outbox(&mut self, kernel: &mut Kernel) {
        if kernel.procs.outbox.is_empty() {
            return;
        }
        for (pid, info) in std::mem::take(&mut kernel.procs.outbox) {
            if pid == self.cur.proc.pid {
                self.cur.proc.threads.send_process(info);
            } else if let Some(t) = self.others.iter_mut().find(|t| t.proc.pid == pid) {
                t.proc.threads.send_process(info);
            }
        }
    }

    /// Deliver the futex wakes the last syscall made on shared memory to the
    /// waiters of the other processes that map the same object at the same
    /// offset; returns how many it woke.
    pub(crate) fn deliver_shared_wakes(&mut self, kernel: &mut Kernel) -> u64 {
        if kernel.shm.wakes.is_empty() {
            return 0;
        }
        let mut total = 0;
        for w in std::mem::take(&mut kernel.shm.wakes) {
            let mut left = w.n;
            for t in self.others.iter_mut() {
                if left == 0 {
                    break;
                }
                let mm = &t.proc.mm;
                for th in t.proc.threads.list.iter_mut() {
                    if left == 0 {
                        break;
                    }
                    let Some(wait) = th.wait.as_mut() else { continue };
                    let WaitKind::Futex { addr, bitset } = wait.kind else { continue };
                    if wait.woken || bitset & w.bitset == 0 || mm.shared_at(addr) != Some((w.obj, w.offset)) {
                        continue;
                    }
                    wait.woken = true;
                    left -= 1;
                    total += 1;
                }
            }
        }
        total
    }

    /// When something happens by itself: a wait's deadline, a timer, a
    /// timerfd that a blocked fd wait watches.
    fn next_wake(&mut self, kernel: &mut Kernel) -> Option<Instant> {
        let proc = &self.cur.proc;
        let t = &proc.threads;
        let own = t.next_event().map(|at| t.clock.to_instant(at));
        let fds = self.cur.wait_on.iter().filter_map(|(tid, on)| {
            let waiting = t.index_of(*tid).is_some_and(|i| t.list[i].wait.is_some());
            if waiting {
                wait::next_change(proc, kernel, on)
            } else {
                None
            }
        });
        own.into_iter().chain(fds).min()
    }

    /// The host sockets behind the fd waits of the blocked threads.
    fn host_wait_fds(&self, kernel: &Kernel) -> Vec<libc::pollfd> {
        let t = &self.cur.proc.threads;
        let mut out = Vec::new();
        for (tid, on) in &self.cur.wait_on {
            if t.index_of(*tid).is_some_and(|i| t.list[i].wait.is_some()) {
                out.extend(wait::host_fds(&self.cur.proc, kernel, on));
            }
        }
        out
    }

    fn describe_deadlock(&self) -> String {
        let waits: Vec<String> = self
            .cur
            .proc
            .threads
            .list
            .iter()
            .filter_map(|t| {
                let w = t.wait.as_ref()?;
                let what = match &w.kind {
                    WaitKind::Futex { addr, .. } => format!("the futex at {addr:#x}"),
                    WaitKind::Signal => "a signal".into(),
                    WaitKind::Time => "time".into(),
                    WaitKind::Other => "a file descriptor".into(),
                    WaitKind::Agent => "a request".into(),
                };
                Some(format!("thread {} in {}() waits for {what}", t.tid, syscalls::name(w.regs.rax)))
            })
            .collect();
        format!("every thread waits with no timeout and nothing can wake them ({})", waits.join("; "))
    }

    /// Re-run the handlers of blocked threads (state may have changed), end
    /// the waits whose deadline passed, interrupt those a signal is for. A
    /// handler that ends the process is `GuestExited` or `GuestSignaled`.
    fn recheck_waits(&mut self, kernel: &mut Kernel, now: u64) -> Result<(), EngineError> {
        let cur = self.cur.proc.threads.cur;
        for i in 0..self.cur.proc.threads.len() {
            let Some(w) = self.cur.proc.threads.list[i].wait.as_ref() else { continue };
            if w.kind == WaitKind::Agent {
                continue;
            }
            let timed_out = w.deadline.is_some_and(|d| d <= now);
            // Futex waits and sleeps change only by a wake or their deadline;
            // a signal for them is looked at without re-running them.
            let quiet = match w.kind {
                WaitKind::Futex { .. } => !w.woken,
                WaitKind::Time => true,
                _ => false,
            };
            if quiet && !timed_out && !self.cur.proc.threads.any_pending() {
                continue;
            }
            let w = w.clone();
            let regs = kvm_regs::from(&w.regs);
            let args = [regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9];
            self.cur.proc.make_current(i);
            let (result, effect) = self.dispatch_again(kernel, regs.rax, &args, timed_out);
            let outcome = match effect {
                Some(Effect::Block(b)) if !timed_out => {
                    if let Some(w) = self.cur.proc.threads.list[i].wait.as_mut() {
                        w.kind = wait_kind(&b.on, &w.kind);
                    }
                    if w.kind == WaitKind::Other {
                        self.cur.wait_on.insert(self.cur.proc.threads.list[i].tid, b.on);
                    }
                    // Still waiting: a signal for it ends the wait.
                    if self.cur.proc.deliverable(i) != 0 {
                        Some(Err(ERESTARTSYS))
                    } else {
                        None
                    }
                }
                Some(Effect::Block(_)) => Some(w.on_timeout.map_err(Errno)),
                Some(Effect::Exit(code)) => return Err(EngineError::GuestExited(code)),
                Some(Effect::Signaled(sig)) => return Err(EngineError::GuestSignaled(sig)),
                _ => Some(result),
            };
            if let Some(r) = outcome {
                self.end_wait(i, &regs, r);
                if i != cur {
                    self.cur.woken = Some(self.cur.proc.threads.list[i].tid);
                }
            }
            self.cur.proc.make_current(cur);
        }
        Ok(())
    }

    /// Re-run a blocked call's handler.
    fn dispatch_again(
        &mut self,
        kernel: &mut Kernel,
        nr: u64,
        args: &forkbox_linux::kernel::Args,
        timed_out: bool,
    ) -> (forkbox_linux::SysResult, Option<Effect>) {
        let Task { vm, proc, .. } = &mut self.cur;
        let vm = vm.as_mut().expect("sandbox VM present until drop");
        let mut ctx = Ctx { mem: vm.mem_mut(), proc, kernel, effect: None, timed_out };
        let result = syscalls::redispatch(&mut ctx, nr, args);
        (result, ctx.effect)
    }

    /// Thread `i`'s blocked call returns `r` (ERESTARTSYS: a signal ended it).
    fn end_wait(&mut self, i: usize, regs: &kvm_regs, r: forkbox_linux::SysResult) {
        let t = &mut self.cur.proc.threads.list[i];
        t.wait = None;
        let written = std::mem::take(&mut t.written);
        let ret = match r {
            Ok(v) => v,
            // A write that moved bytes before the signal returns their count (no restart).
            Err(e) if e == ERESTARTSYS && written > 0 => written,
            Err(e) if e == ERESTARTSYS => {
                let nr = regs.rax;
                t.restart = Some((nr, forkbox_linux::syscalls::restarts_under_sa_restart(nr, regs.r10)));
                Errno::EINTR.to_rax()
            }
            Err(e) => e.to_rax(),
        };
        // A wait that narrowed the mask (sigtimedwait) and ends by itself gives
        // it back (thread `i` is current here: its mask is the process').
        if t.restart.is_none() {
            if let Some(m) = t.restore_mask.take() {
                self.cur.proc.signals.mask = m;
            }
        }
        let t = &mut self.cur.proc.threads.list[i];
        let u = after_syscall(regs, ret);
        match &mut t.cpu {
            // Off the vCPU: it resumes from these registers when loaded.
            Some(c) => c.regs = Regs::from(&u),
            // On the vCPU (stopped at its syscall exit): resume it in place.
            None => self.cur.pending_user = Some(u),
        }
    }

    /// Put the current thread's user state aside and load thread `next`.
    /// False if the vCPU cannot be switched right now (in an entry stub).
    fn switch_to(&mut self, next: usize) -> Result<bool, EngineError> {
        let cur = self.cur.proc.threads.cur;
        if self.cur.proc.threads.list[cur].cpu.is_none() {
            let blocked = self.cur.proc.threads.list[cur].wait.as_ref().map(|w| w.regs);
            let regs = match (blocked, self.cur.pending_user.take()) {
                (Some(w), _) => w,
                (None, Some(u)) => Regs::from(&u),
                (None, None) => match self.cur.user_state()? {
                    Some(u) => Regs::from(&u),
                    None => return Ok(false),
                },
            };
            let xsave = Arc::new(Xsave::from(&self.cur.vm().xsave()?));
            self.cur.proc.threads.list[cur].cpu = Some(SavedCpu { regs, xsave });
        }
        self.load(next)?;
        Ok(true)
    }

    /// Load saved thread `i` onto the vCPU (the current one is saved or gone).
    pub(crate) fn load(&mut self, i: usize) -> Result<(), EngineError> {
        self.cur.proc.make_current(i);
        let Some(c) = self.cur.proc.threads.list[i].cpu.take() else { return Ok(()) };
        let fs_base = self.cur.proc.fs_base;
        let vm = self.cur.vm_mut();
        vm.set_xsave(&*c.xsave.to_kvm()?)?;
        vm.set_fs_base(fs_base)?;
        self.cur.pending_user = Some(kvm_regs::from(&c.regs));
        self.slice_start = Instant::now();
        self.switches += 1;
        Ok(())
    }
}

/// How a blocked call waits, from what its handler blocks on (`old`: how it
/// waited so far).
pub(crate) fn wait_kind(on: &WaitOn, old: &WaitKind) -> WaitKind {
    match on {
        // A requeue moved the waiter: keep where it is now.
        WaitOn::Futex { addr, bitset } => match old {
            WaitKind::Futex { addr: a, bitset: b } => WaitKind::Futex { addr: *a, bitset: *b },
            _ => WaitKind::Futex { addr: *addr, bitset: *bitset },
        },
        WaitOn::Signal { .. } => WaitKind::Signal,
        WaitOn::Time => WaitKind::Time,
        _ => WaitKind::Other,
    }
}
