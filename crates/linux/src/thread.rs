//! Threads, pending signals and timers of the guest process.
//!
//! Guest threads are green threads on the one vCPU: the engine switches the
//! vCPU between them (on blocking calls and a preemption tick); this module
//! keeps what each thread is when it is not on the vCPU (user registers, XSAVE
//! image, FS base, signal mask, sigaltstack, clear-child-tid, signal frames in
//! flight, what it waits for) and the decisions that are pure bookkeeping:
//! futex queues, which thread a signal goes to, timers.
//!
//! The thread whose syscall is being handled ("current", `Threads::cur`) has
//! its mask, altstack, FS base and clear-child-tid in `Process` (`signals.mask`,
//! `signals.altstack`, `fs_base`, `tid_address`), like a CPU's registers; its
//! own record holds stale copies. `Process::make_current` swaps them.
//!
//! Time for threads is the session's *run clock* (`RunClock`): nanoseconds the
//! guest has spent running. Between execs a session is paused and so are its
//! threads' sleeps and timers; a snapshot carries the run clock, so a sleeping
//! thread wakes after the same running time whether the session stayed in
//! memory, was evicted and resumed, or was forked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use forkbox_vmm::regs::{Regs, Xsave};

use crate::errno::Errno;

pub type Tid = u32;

/// The main thread's id (= the pid: `sys_process::GUEST_PID`).
pub const MAIN_TID: Tid = 2;
/// Threads a guest may have at once (clone beyond: EAGAIN).
pub const MAX_THREADS: usize = 256;
/// POSIX timers a guest may have at once.
pub const MAX_TIMERS: usize = 64;
/// Signals queued at once (per thread and for the process).
pub const MAX_QUEUED: usize = 64;

pub const SIGKILL: i32 = 9;
pub const SIGSTOP: i32 = 19;
pub const SIGALRM: i32 = 14;
pub const SIGVTALRM: i32 = 26;
pub const SIGPROF: i32 = 27;
/// `Timer::id` of the interval timers that count the process's CPU time
/// (`setitimer(ITIMER_VIRTUAL / ITIMER_PROF)`). They live in `Threads::timers`
/// with the clock `CLOCK_PROCESS_CPUTIME_ID`, and their `expiry` is the CPU
/// time left until they fire: it counts down as the engine charges run time,
/// so a checkpoint carries them without a clock of their own.
pub const ITIMER_VIRTUAL_ID: i32 = -2;
pub const ITIMER_PROF_ID: i32 = -3;
pub const SIGINT: i32 = 2;
pub const SIGRTMIN: i32 = 32;
pub const NSIG: i32 = 64;

/// si_code values.
pub const SI_USER: i32 = 0;
pub const SI_KERNEL: i32 = 0x80;
pub const SI_TIMER: i32 = -2;
pub const SI_TKILL: i32 = -6;

pub const fn sigbit(sig: i32) -> u64 {
    1u64 << ((sig - 1) as u32 & 63)
}

/// Signals no mask can block.
pub const UNBLOCKABLE: u64 = sigbit(SIGKILL) | sigbit(SIGSTOP);

/// The run clock: guest running time in nanoseconds (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunClock {
    base_ns: u64,
    started: Option<Instant>,
}

impl RunClock {
    /// A stopped clock at `ns` of running time (as a checkpoint records it).
    pub fn stopped_at(ns: u64) -> RunClock {
        RunClock { base_ns: ns, started: None }
    }

    /// The running time up to the last stop: what a checkpoint records (a
    /// parked sandbox's clock is stopped).
    pub fn stopped_ns(&self) -> u64 {
        self.base_ns
    }

    pub fn now(&self) -> u64 {
        let run = self.started.map_or(0, |s| s.elapsed().as_nanos().min(u64::MAX as u128) as u64);
        self.base_ns.saturating_add(run)
    }

    /// The guest runs from now on.
    pub fn start(&mut self) {
        if self.started.is_none() {
            self.started = Some(Instant::now());
        }
    }

    /// The guest is paused (parked, or the run ended).
    pub fn stop(&mut self) {
        self.base_ns = self.now();
        self.started = None;
    }

    /// A host deadline as a run-clock time.
    pub fn from_instant(&self, at: Instant) -> u64 {
        self.now().saturating_add(at.saturating_duration_since(Instant::now()).as_nanos().min(u64::MAX as u128) as u64)
    }

    /// A run-clock time as a host deadline (valid while the clock runs).
    pub fn to_instant(&self, at_ns: u64) -> Instant {
        Instant::now() + Duration::from_nanos(at_ns.saturating_sub(self.now()))
    }
}

/// A thread's user-mode CPU state while it is off the vCPU.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedCpu {
    pub regs: Regs,
    /// The KVM_GET_XSAVE image (shared: a fork's clone copies no XSAVE bytes).
    pub xsave: Arc<Xsave>,
}

/// A signal handler frame in flight (the state `rt_sigreturn` restores).
#[derive(Clone, Debug, PartialEq)]
pub struct SigFrame {
    pub cpu: SavedCpu,
    pub mask: u64,
    /// Where the frame is: rt_sigreturn must come with RSP just past its pretcode.
    pub frame: u64,
}

/// What `rt_sigtimedwait` / the frame's siginfo report about a signal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SigInfo {
    pub signo: i32,
    pub code: i32,
    pub pid: i32,
    pub timer_id: i32,
    pub overrun: i32,
    pub value: u64,
}

impl SigInfo {
    pub fn user(signo: i32, code: i32) -> SigInfo {
        SigInfo { signo, code, pid: if code == SI_KERNEL { 0 } else { MAIN_TID as i32 }, ..Default::default() }
    }

    /// The 128-byte `siginfo_t` (x86-64 layout: signo, errno, code, then the union at 16).
    pub fn to_bytes(&self) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&self.signo.to_le_bytes());
        b[8..12].copy_from_slice(&self.code.to_le_bytes());
        if self.code == SI_TIMER {
            b[16..20].copy_from_slice(&self.timer_id.to_le_bytes());
            b[20..24].copy_from_slice(&self.overrun.to_le_bytes());
            b[24..32].copy_from_slice(&self.value.to_le_bytes());
        } else {
            b[16..20].copy_from_slice(&self.pid.to_le_bytes());
            // si_uid = 0
        }
        b
    }
}

/// What a blocked thread waits for.
#[derive(Clone, Debug, PartialEq)]
pub enum WaitKind {
    /// A futex wake on `addr` matching `bitset`.
    Futex { addr: u64, bitset: u32 },
    /// Any signal (pause, rt_sigsuspend, rt_sigtimedwait).
    Signal,
    /// Only time (sleeps).
    Time,
    /// Something the handler re-checks (fd readiness and the like).
    Other,
    /// The agent's main thread, parked on its channel while the sandbox's
    /// other threads and processes run between two calls: only the next call
    /// ends it (never recorded: the main thread is back on the vCPU before a checkpoint).
    Agent,
}

/// A blocked syscall: re-run with the same registers until it completes,
/// `on_timeout` at `deadline`.
#[derive(Clone, Debug)]
pub struct Wait {
    /// The syscall's registers.
    pub regs: Regs,
    /// Run-clock deadline.
    pub deadline: Option<u64>,
    /// Result at the deadline: Ok(value) or Err(errno).
    pub on_timeout: Result<u64, i32>,
    pub kind: WaitKind,
    /// A futex wake (or requeue target's wake) came: the call returns 0.
    pub woken: bool,
    /// When the wait began, in [`WAIT_ORDER`]'s order: futex wakes go to the
    /// longest waiter first. Not state (a checkpoint does not keep it): a
    /// restored wait ranks before every wait begun since.
    pub since: u64,
}

/// The order in which waits begin, across every sandbox of this process (only
/// the order inside one process matters). Linux's futex queues are first in,
/// first out; waking by thread index instead starved the newest threads of a
/// contended lock (CPython's GIL with 40 threads doing I/O: a new thread could
/// not take it to report that it started, for seconds).
static WAIT_ORDER: AtomicU64 = AtomicU64::new(1);

impl Wait {
    pub fn new(regs: Regs, deadline: Option<u64>, on_timeout: Result<u64, i32>, kind: WaitKind) -> Wait {
        Wait { regs, deadline, on_timeout, kind, woken: false, since: WAIT_ORDER.fetch_add(1, Ordering::Relaxed) }
    }
}

/// Equal as state: the arrival order is not part of it (see [`Wait::since`]).
impl PartialEq for Wait {
    fn eq(&self, o: &Wait) -> bool {
        self.regs == o.regs
            && self.deadline == o.deadline
            && self.on_timeout == o.on_timeout
            && self.kind == o.kind
            && self.woken == o.woken
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Thread {
    pub tid: Tid,
    /// None while on the vCPU (or while its state is the vCPU's, e.g. parked).
    pub cpu: Option<SavedCpu>,
    /// Stale while current (see the module docs).
    pub fs_base: u64,
    pub sigmask: u64,
    pub altstack: [u8; 24],
    pub clear_tid: u64,
    /// Signals sent to this thread (tgkill, SIGEV_THREAD_ID timers).
    pub pending: Vec<SigInfo>,
    pub frames: Vec<SigFrame>,
    pub wait: Option<Wait>,
    /// rt_sigsuspend / rt_sigtimedwait changed the mask for the wait: the mask
    /// to go back to (when the call returns, or when the handler that ended it returns).
    pub restore_mask: Option<u64>,
    /// A signal ended this thread's blocked call `nr`: its delivery restarts
    /// it (SA_RESTART and the call allows it: the bool) or makes it EINTR.
    pub restart: Option<(u64, bool)>,
    /// Bytes the blocked call already wrote (a blocking write to a pipe
    /// larger than its room writes what fits, then waits for the rest): a
    /// signal ends the call with this count instead of EINTR. Not state: a
    /// checkpoint ends such a wait with the count (`Threads::for_checkpoint`).
    pub written: u64,
}

impl Thread {
    pub fn pending_set(&self) -> u64 {
        self.pending.iter().fold(0, |m, s| m | sigbit(s.signo))
    }
}

/// A POSIX timer (timer_create) or ITIMER_REAL (id -1).
#[derive(Clone, Debug, PartialEq)]
pub struct Timer {
    pub id: i32,
    pub clock: i32,
    pub signo: i32,
    /// SIGEV_THREAD_ID target, else process-directed.
    pub tid: Option<Tid>,
    /// SIGEV_NONE: never signals.
    pub silent: bool,
    pub value: u64,
    /// Run-clock expiry (for a CPU-time interval timer: the CPU nanoseconds
    /// left); None = disarmed.
    pub expiry: Option<u64>,
    pub interval_ns: u64,
    pub overrun: i32,
}

impl Timer {
    /// A CPU-time interval timer (`expiry` is CPU time left, not a run-clock time).
    pub fn on_cpu_clock(&self) -> bool {
        self.clock == libc::CLOCK_PROCESS_CPUTIME_ID
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Threads {
    pub list: Vec<Thread>,
    /// Index of the thread whose syscall is being handled (and, between
    /// syscalls, the one on the vCPU).
    pub cur: usize,
    pub next_tid: Tid,
    /// Process-directed signals not yet taken by a thread.
    pub pending: Vec<SigInfo>,
    pub timers: Vec<Timer>,
    pub itimer_real: Option<Timer>,
    pub clock: RunClock,
}

impl Default for Threads {
    fn default() -> Self {
        let mut altstack = [0; 24];
        altstack[8] = 2; // SS_DISABLE
        let main = Thread {
            tid: MAIN_TID,
            cpu: None,
            fs_base: 0,
            sigmask: 0,
            altstack,
            clear_tid: 0,
            pending: Vec::new(),
            frames: Vec::new(),
            wait: None,
            restore_mask: None,
            restart: None,
            written: 0,
        };
        Threads {
            list: vec![main],
            cur: 0,
            next_tid: MAIN_TID + 1,
            pending: Vec::new(),
            timers: Vec::new(),
            itimer_real: None,
            clock: RunClock::default(),
        }
    }
}

fn push_signal(q: &mut Vec<SigInfo>, info: SigInfo) {
    // Standard signals do not queue; real-time ones do, up to a limit.
    if info.signo < SIGRTMIN && q.iter().any(|s| s.signo == info.signo) {
        return;
    }
    if q.len() < MAX_QUEUED {
        q.push(info);
    }
}

fn take_signal(q: &mut Vec<SigInfo>, allowed: u64) -> Option<SigInfo> {
    // Lowest signal number first, as Linux (for standard signals).
    let i = q.iter().enumerate().filter(|(_, s)| allowed & sigbit(s.signo) != 0).min_by_key(|(_, s)| s.signo)?.0;
    Some(q.remove(i))
}

impl Threads {
    /// The threads as a checkpoint keeps them: a blocked write that already
    /// wrote part of its bytes returns that count (as when a signal ends it),
    /// since a restored wait would start its bytes over (`Thread::written` is
    /// not state).
    pub fn for_checkpoint(&self) -> Threads {
        let mut t = self.clone();
        for th in t.list.iter_mut().filter(|th| th.written > 0) {
            if let (Some(w), Some(c)) = (th.wait.as_ref(), th.cpu.as_mut()) {
                let u = forkbox_vmm::after_syscall(&forkbox_vmm::kvm_regs::from(&w.regs), th.written);
                c.regs = Regs::from(&u);
                th.wait = None;
                th.written = 0;
            }
        }
        t
    }

    pub fn current(&self) -> &Thread {
        &self.list[self.cur]
    }

    pub fn current_mut(&mut self) -> &mut Thread {
        &mut self.list[self.cur]
    }

    pub fn index_of(&self, tid: Tid) -> Option<usize> {
        self.list.iter().position(|t| t.tid == tid)
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Only the main thread, nothing pending, no timers: the common case costs nothing.
    pub fn is_simple(&self) -> bool {
        self.list.len() == 1 && self.pending.is_empty() && self.timers.is_empty() && self.itimer_real.is_none()
    }

    /// The POSIX timers (`timer_create`), without the CPU-time interval timers.
    pub fn posix_timers(&self) -> usize {
        self.timers.iter().filter(|t| t.id >= 0).count()
    }

    pub fn runnable(&self, i: usize) -> bool {
        self.list.get(i).is_some_and(|t| t.wait.is_none())
    }

    pub fn runnable_count(&self) -> usize {
        self.list.iter().filter(|t| t.wait.is_none()).count()
    }

    /// The next runnable thread after `from`, round robin (may be `from` itself).
    pub fn next_runnable(&self, from: usize) -> Option<usize> {
        let n = self.list.len();
        (1..=n).map(|k| (from + k) % n).find(|&i| self.runnable(i))
    }

    /// A new thread record (its CPU state is filled in by the engine).
    pub fn spawn(&mut self, fs_base: u64, sigmask: u64, clear_tid: u64) -> Result<Tid, Errno> {
        if self.list.len() >= MAX_THREADS {
            return Err(Errno::EAGAIN);
        }
        let tid = self.next_tid;
        self.next_tid = self.next_tid.checked_add(1).filter(|t| *t < (1 << 22)).ok_or(Errno::EAGAIN)?;
        let mut altstack = [0; 24];
        altstack[8] = 2;
        self.list.push(Thread {
            tid,
            cpu: None,
            fs_base,
            sigmask,
            altstack,
            clear_tid,
            pending: Vec::new(),
            frames: Vec::new(),
            wait: None,
            restore_mask: None,
            restart: None,
            written: 0,
        });
        Ok(tid)
    }

    // ----- futexes -------------------------------------------------------------

    /// The threads waiting on `addr` (whose bitset meets `bitset`) and not yet
    /// woken, longest waiter first.
    fn futex_waiters(&self, addr: u64, bitset: u32) -> Vec<usize> {
        let mut v: Vec<(u64, usize)> = self
            .list
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let w = t.wait.as_ref()?;
                match w.kind {
                    WaitKind::Futex { addr: a, bitset: b } if a == addr && b & bitset != 0 && !w.woken => {
                        Some((w.since, i))
                    }
                    _ => None,
                }
            })
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, i)| i).collect()
    }

    /// Wake up to `n` threads waiting on `addr` whose bitset meets `bitset`,
    /// longest waiter first.
    pub fn futex_wake(&mut self, addr: u64, bitset: u32, n: u64) -> u64 {
        let mut woken = 0;
        for i in self.futex_waiters(addr, bitset) {
            if woken >= n {
                break;
            }
            if let Some(w) = &mut self.list[i].wait {
                w.woken = true;
                woken += 1;
            }
        }
        woken
    }

    /// Wake up to `n` waiters of `addr`, move up to `m` more to `to` (longest
    /// waiters first, keeping their place in line). Returns both counts.
    pub fn futex_requeue(&mut self, addr: u64, n: u64, to: u64, m: u64) -> (u64, u64) {
        let woken = self.futex_wake(addr, u32::MAX, n);
        let mut moved = 0;
        for i in self.futex_waiters(addr, u32::MAX) {
            if moved >= m {
                break;
            }
            if let Some(w) = &mut self.list[i].wait {
                if let WaitKind::Futex { addr: a, .. } = &mut w.kind {
                    *a = to;
                    moved += 1;
                }
            }
        }
        (woken, moved)
    }

    // ----- signals -------------------------------------------------------------

    /// Queue a signal for thread `i`.
    pub fn send_thread(&mut self, i: usize, info: SigInfo) {
        if let Some(t) = self.list.get_mut(i) {
            push_signal(&mut t.pending, info);
        }
    }

    /// Queue a process-directed signal.
    pub fn send_process(&mut self, info: SigInfo) {
        push_signal(&mut self.pending, info);
    }

    /// The mask of thread `i` (current's lives in `Process`: pass it as `cur_mask`).
    fn mask_of(&self, i: usize, cur_mask: u64) -> u64 {
        if i == self.cur {
            cur_mask
        } else {
            self.list[i].sigmask
        }
    }

    /// Which thread takes a process-directed signal `sig`: the main thread if it
    /// does not block it (as Linux), else the first thread that does not.
    pub fn process_target(&self, sig: i32, cur_mask: u64) -> Option<usize> {
        let ok = |i: usize| self.mask_of(i, cur_mask) & sigbit(sig) == 0;
        let main = self.index_of(MAIN_TID);
        if let Some(m) = main.filter(|&m| ok(m)) {
            return Some(m);
        }
        (0..self.list.len()).find(|&i| ok(i))
    }

    /// Signals thread `i` could take now (pending for it, or process-directed
    /// ones it is the target of), given its mask `mask`.
    pub fn deliverable(&self, i: usize, mask: u64, cur_mask: u64) -> u64 {
        let Some(t) = self.list.get(i) else { return 0 };
        let mut set = t.pending_set() & !mask;
        for s in &self.pending {
            if mask & sigbit(s.signo) == 0 && self.process_target(s.signo, cur_mask) == Some(i) {
                set |= sigbit(s.signo);
            }
        }
        set
    }

    /// Take one signal in `allowed` for thread `i` (its own first, then the process').
    pub fn take(&mut self, i: usize, allowed: u64) -> Option<SigInfo> {
        if let Some(s) = self.list.get_mut(i).and_then(|t| take_signal(&mut t.pending, allowed)) {
            return Some(s);
        }
        take_signal(&mut self.pending, allowed)
    }

    /// Anything pending anywhere?
    pub fn any_pending(&self) -> bool {
        !self.pending.is_empty() || self.list.iter().any(|t| !t.pending.is_empty())
    }

    // ----- timers --------------------------------------------------------------

    /// The earliest run-clock time something happens by itself (a wait's
    /// deadline or a timer's expiry).
    pub fn next_event(&self) -> Option<u64> {
        let waits = self.list.iter().filter_map(|t| t.wait.as_ref().and_then(|w| w.deadline));
        let timers = self.timers.iter().chain(self.itimer_real.iter()).filter(|t| !t.on_cpu_clock());
        waits.chain(timers.filter_map(|t| t.expiry)).min()
    }

    /// The CPU time (ns) the process may still use before a CPU-time interval timer fires.
    pub fn next_cpu_event(&self) -> Option<u64> {
        self.timers.iter().filter(|t| t.on_cpu_clock()).filter_map(|t| t.expiry).min()
    }

    /// The process ran `ns` of CPU time: its CPU-time interval timers count
    /// down, and those that reach zero send their signal (and re-arm with
    /// their interval, as Linux: the periods missed inside one run are
    /// skipped).
    pub fn charge_cpu(&mut self, ns: u64) {
        let mut fired = Vec::new();
        for t in self.timers.iter_mut().filter(|t| t.on_cpu_clock()) {
            let Some(left) = t.expiry else { continue };
            if left > ns {
                t.expiry = Some(left - ns);
                continue;
            }
            t.expiry = (t.interval_ns > 0).then(|| t.interval_ns - (ns - left) % t.interval_ns);
            fired.push(SigInfo { signo: t.signo, code: SI_KERNEL, ..Default::default() });
        }
        for info in fired {
            self.send_process(info);
        }
    }

    /// Fire the timers due at `now` (run clock): their signals become pending.
    pub fn fire_timers(&mut self, now: u64) {
        let mut fired = Vec::new();
        for t in self.timers.iter_mut().chain(self.itimer_real.iter_mut()).filter(|t| !t.on_cpu_clock()) {
            let Some(exp) = t.expiry else { continue };
            if exp > now {
                continue;
            }
            // A periodic timer skips the periods it missed (counted as overruns);
            // the guest picks the interval, so the next expiry saturates.
            let missed = (now - exp).checked_div(t.interval_ns);
            t.expiry = missed.map(|m| exp.saturating_add(m.saturating_add(1).saturating_mul(t.interval_ns)));
            t.overrun = missed.map_or(0, |m| m.min(i32::MAX as u64) as i32);
            if !t.silent {
                let code = if t.id < 0 { SI_KERNEL } else { SI_TIMER };
                let info =
                    SigInfo { signo: t.signo, code, pid: 0, timer_id: t.id.max(0), overrun: t.overrun, value: t.value };
                fired.push((t.tid, info));
            }
        }
        for (tid, info) in fired {
            match tid.and_then(|tid| self.index_of(tid)) {
                Some(i) => self.send_thread(i, info),
                None => self.send_process(info),
            }
        }
    }

    /// Remove thread `i` (it exited). The current index stays valid.
    pub fn remove(&mut self, i: usize) -> Thread {
        let t = self.list.remove(i);
        if self.cur > i || self.cur >= self.list.len() {
            self.cur = self.cur.saturating_sub(1);
        }
        t
    }

    /// Check a restored table.
    pub fn validate(&self) -> Result<(), String> {
        if self.list.is_empty() || self.list.len() > MAX_THREADS {
            return Err(format!("{} threads", self.list.len()));
        }
        if self.cur >= self.list.len() {
            return Err("current thread out of range".into());
        }
        let mut tids: Vec<Tid> = self.list.iter().map(|t| t.tid).collect();
        tids.sort_unstable();
        tids.dedup();
        if tids.len() != self.list.len() || tids.iter().any(|&t| t >= self.next_tid || t < MAIN_TID) {
            return Err("bad thread ids".into());
        }
        if self.posix_timers() > MAX_TIMERS || self.timers.len() > MAX_TIMERS + 2 {
            return Err("too many timers".into());
        }
        let sig_ok = |s: &SigInfo| (1..=NSIG).contains(&s.signo);
        for (i, t) in self.list.iter().enumerate() {
            // Every thread but the one on the vCPU has its registers saved.
            if (i == self.cur) != t.cpu.is_none() {
                return Err(format!("thread {} has no saved state", t.tid));
            }
            let xsave_ok = |c: &SavedCpu| c.xsave.region.len() == forkbox_vmm::regs::XSAVE_SIZE;
            if t.cpu.as_ref().is_some_and(|c| !xsave_ok(c)) || t.frames.iter().any(|f| !xsave_ok(&f.cpu)) {
                return Err("bad XSAVE image".into());
            }
            if t.pending.len() > MAX_QUEUED || !t.pending.iter().all(sig_ok) || t.frames.len() > 8 {
                return Err("bad signal state".into());
            }
        }
        if self.pending.len() > MAX_QUEUED || !self.pending.iter().all(sig_ok) {
            return Err("bad pending signals".into());
        }
        let timer_ok = |t: &Timer| (1..=NSIG).contains(&t.signo) || t.silent;
        if !self.timers.iter().chain(self.itimer_real.iter()).all(timer_ok) {
            return Err("bad timer".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(t: &mut Threads, i: usize, addr: u64, bitset: u32) {
        t.list[i].wait = Some(Wait::new(Regs::default(), None, Err(libc::ETIMEDOUT), WaitKind::Futex { addr, bitset }));
    }

    #[test]
    fn futex_wakes_go_to_the_longest_waiter_first() {
        let mut t = Threads::default();
        for _ in 0..4 {
            t.spawn(0, 0, 0).unwrap();
        }
        // Waits begin in the order 4, 2, 3, 1 (not the threads' order).
        for i in [4, 2, 3, 1] {
            waiting(&mut t, i, 0x1000, u32::MAX);
        }
        let woken = |t: &Threads| (1..=4).filter(|&i| t.list[i].wait.as_ref().unwrap().woken).collect::<Vec<_>>();
        assert_eq!(t.futex_wake(0x1000, u32::MAX, 1), 1);
        assert_eq!(woken(&t), [4]);
        assert_eq!(t.futex_wake(0x1000, u32::MAX, 2), 2);
        assert_eq!(woken(&t), [2, 3, 4]);
        // A requeue moves the longest waiters left, and they keep their place.
        waiting(&mut t, 2, 0x1000, u32::MAX);
        assert_eq!(t.futex_requeue(0x1000, 0, 0x2000, 1), (0, 1));
        assert!(matches!(t.list[1].wait.as_ref().unwrap().kind, WaitKind::Futex { addr: 0x2000, .. }));
        assert!(matches!(t.list[2].wait.as_ref().unwrap().kind, WaitKind::Futex { addr: 0x1000, .. }));
    }

    #[test]
    fn futex_wake_honours_count_bitset_and_requeue() {
        let mut t = Threads::default();
        for _ in 0..4 {
            t.spawn(0, 0, 0).unwrap();
        }
        waiting(&mut t, 1, 0x1000, u32::MAX);
        waiting(&mut t, 2, 0x1000, 0b10);
        waiting(&mut t, 3, 0x1000, u32::MAX);
        waiting(&mut t, 4, 0x2000, u32::MAX);
        assert_eq!(t.futex_wake(0x1000, 0b01, 10), 2, "bitset 0b10 waiter is not woken");
        assert!(!t.list[2].wait.as_ref().unwrap().woken);
        assert_eq!(t.futex_wake(0x1000, u32::MAX, 0), 0);
        assert_eq!(t.futex_requeue(0x1000, 0, 0x2000, 5), (0, 1));
        assert_eq!(t.futex_wake(0x2000, u32::MAX, 1), 1);
        assert_eq!(t.futex_wake(0x2000, u32::MAX, 1), 1);
        assert_eq!(t.futex_wake(0x2000, u32::MAX, 1), 0);
    }

    #[test]
    fn process_signals_go_to_main_unless_it_blocks_them() {
        let mut t = Threads::default();
        t.spawn(0, 0, 0).unwrap();
        t.send_process(SigInfo::user(10, SI_USER));
        assert_eq!(t.process_target(10, 0), Some(0));
        assert_eq!(t.deliverable(1, 0, 0), 0);
        assert_eq!(t.deliverable(0, 0, 0), sigbit(10));
        // Main (current) blocks it: the other thread takes it.
        assert_eq!(t.deliverable(1, 0, sigbit(10)), sigbit(10));
        assert_eq!(t.take(1, sigbit(10)).map(|s| s.signo), Some(10));
        assert!(!t.any_pending());
    }

    #[test]
    fn timers_fire_with_overruns_and_standard_signals_coalesce() {
        let mut t = Threads::default();
        t.timers.push(Timer {
            id: 0,
            clock: 1,
            signo: 34,
            tid: None,
            silent: false,
            value: 7,
            expiry: Some(100),
            interval_ns: 10,
            overrun: 0,
        });
        t.itimer_real = Some(Timer {
            id: -1,
            clock: 0,
            signo: SIGALRM,
            tid: None,
            silent: false,
            value: 0,
            expiry: Some(50),
            interval_ns: 0,
            overrun: 0,
        });
        t.fire_timers(99);
        assert_eq!(t.pending.len(), 1);
        t.fire_timers(125);
        assert_eq!(t.timers[0].expiry, Some(130));
        assert_eq!(t.timers[0].overrun, 2);
        assert_eq!(t.next_event(), Some(130));
        assert_eq!(t.itimer_real.as_ref().unwrap().expiry, None);
        t.send_process(SigInfo::user(SIGALRM, SI_USER));
        assert_eq!(t.pending.iter().filter(|s| s.signo == SIGALRM).count(), 1);
        assert_eq!(t.take(0, u64::MAX).map(|s| s.signo), Some(SIGALRM), "lowest first");
        assert_eq!(t.take(0, u64::MAX).map(|s| (s.signo, s.value)), Some((34, 7)));
    }

    #[test]
    fn the_run_clock_stops_while_paused() {
        let mut c = RunClock::default();
        c.start();
        std::thread::sleep(Duration::from_millis(5));
        c.stop();
        let a = c.now();
        assert!(a >= 5_000_000);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.now(), a);
    }
}
