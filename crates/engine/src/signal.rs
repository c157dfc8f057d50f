//! Signal delivery, the VM side: signals the guest sends itself or its timers
//! raise, SIGINT for a host interrupt, SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGTRAP
//! for a CPU exception in user code. What a frame holds, where it goes and how
//! the process state changes is the Linux ABI's (`forkbox_linux::signal`);
//! here the frame's bytes are written into guest memory, the interrupted
//! XSAVE state is read and restored, and the vCPU is pointed at the handler.
//!
//! Which signals exist and who takes them is `forkbox_linux::thread`; the
//! host's interrupt (SIGINT) is one of them, with its own rules (`SignalState`).
//! The main thread never parks (gets snapshotted) inside a handler.

use std::time::{Duration, Instant};

use forkbox_linux::signal::{fault_signal, sigbit, FaultInfo, Frame, MAX_NESTED, SA_RESTORER};
use forkbox_linux::thread::{SavedCpu, SigInfo};
use forkbox_linux::Process;
use std::sync::Arc;

use forkbox_vmm::{kvm_regs, GuestFault, Regs, Vm, Xsave};

use crate::error::EngineError;

pub use forkbox_linux::signal::{action, crash_report, default_action, DefaultAction, SA_RESTART, SIG_DFL, SIG_IGN};
pub const SIGINT: usize = forkbox_linux::signal::SIGINT as usize;
/// How long an interrupted exec has to get back to the agent before it is killed.
pub const GRACE: Duration = Duration::from_secs(2);

/// The host interrupt's state in the current run (never snapshotted).
#[derive(Default)]
pub struct SignalState {
    /// An interrupt waits to be queued (once the agent has read its request).
    pub want: bool,
    /// End of the grace period that started with this exec's first interrupt.
    pub grace: Option<Instant>,
    /// The last CPU exception delivered as a signal in this run (signal
    /// number, fault): if the guest then dies of that signal (its handler
    /// re-raised it, as faulthandler does) it is reported as that crash.
    pub fault: Option<(i32, GuestFault)>,
}

fn killed(why: &str) -> EngineError {
    EngineError::Interrupted(why.to_string())
}

impl SignalState {
    /// Forget everything (start of a run).
    pub fn reset(&mut self) {
        *self = SignalState::default();
    }

    /// Can the host's interrupt be taken? Errors end the exec: the guest has
    /// SIGINT's default action (terminate), ignores it, or blocks it outside a handler.
    pub fn check_interrupt(proc: &Process) -> Result<(), EngineError> {
        let act = action(proc, SIGINT);
        match act.handler {
            SIG_DFL => return Err(killed("SIGINT has its default action (terminate)")),
            SIG_IGN => return Err(killed("the guest ignores SIGINT")),
            _ => {}
        }
        let t = &proc.threads;
        let main = t.index_of(forkbox_linux::thread::MAIN_TID);
        let blocked_everywhere = (0..t.len()).all(|i| proc.mask_of(i) & sigbit(SIGINT as i32) != 0);
        let in_handler = main.is_some_and(|m| !t.list[m].frames.is_empty());
        if blocked_everywhere && !in_handler {
            return Err(killed("the guest blocks SIGINT"));
        }
        Ok(())
    }
}

/// Deliver the signal of CPU exception `f` (taken in user mode, the vCPU in
/// its exception stub) to the current thread's handler: the registers that
/// enter it (return with `Vm::enter_user`). A fault the guest cannot take —
/// default or ignored action (Linux then kills), blocked, nested too deep, no
/// room for the frame — is a crash, reported with its address.
pub fn deliver_fault(
    vm: &mut Vm,
    proc: &mut Process,
    st: &mut SignalState,
    f: &GuestFault,
) -> Result<kvm_regs, EngineError> {
    let crashed = |why: &str| EngineError::GuestCrashed(format!("{}{why}", crash_report(f)));
    let Some((info, fault)) = fault_signal(f).filter(|_| f.user_mode) else { return Err(crashed("")) };
    let sig = info.signo as usize;
    let act = action(proc, sig);
    if act.handler == SIG_DFL || act.handler == SIG_IGN {
        return Err(crashed(""));
    }
    let blocked = proc.signals.mask & sigbit(info.signo) != 0;
    if blocked || proc.threads.current().frames.len() >= MAX_NESTED || act.flags & SA_RESTORER == 0 {
        return Err(crashed(", which the guest could not take"));
    }
    let mut u = vm.regs()?;
    u.rip = f.rip;
    u.rsp = f.rsp;
    u.rflags = f.rflags;
    let h = push_frame(vm, proc, &u, &info, Some(&fault), None)
        .map_err(|why| crashed(&format!("; its handler could not run: {why}")))?;
    st.fault = Some((info.signo, f.clone()));
    Ok(h)
}

/// Deliver `info` to the current thread, whose user state is `u` (the
/// registers at the interrupted instruction, or after a completed syscall):
/// returns the registers that enter the handler. `restore_mask`: the mask the
/// handler's return puts back (rt_sigsuspend's caller's), else the current one.
/// Errors end the exec (no restorer, no room for the frame).
pub fn deliver(
    vm: &mut Vm,
    proc: &mut Process,
    u: &kvm_regs,
    info: &SigInfo,
    restore_mask: Option<u64>,
) -> Result<kvm_regs, EngineError> {
    let sig = info.signo as usize;
    let fail = |why: String| if sig == SIGINT { killed(&why) } else { EngineError::GuestSignaled(sig as i32) };
    if proc.threads.current().frames.len() >= MAX_NESTED {
        return Err(fail(format!("signal {sig}: too many nested handlers")));
    }
    push_frame(vm, proc, u, info, None, restore_mask).map_err(fail)
}

/// Build the frame of `info` for user state `u`, write it into guest memory
/// and record it on the current thread: the registers that enter the handler.
fn push_frame(
    vm: &mut Vm,
    proc: &mut Process,
    u: &kvm_regs,
    info: &SigInfo,
    fault: Option<&FaultInfo>,
    restore_mask: Option<u64>,
) -> Result<kvm_regs, String> {
    let frame = Frame::build(proc, u, info, fault, restore_mask)?;
    let xsave = vm.xsave().map_err(|e| e.to_string())?;
    vm.mem_mut().write(frame.addr, &frame.bytes).map_err(|e| e.to_string())?;
    let h = frame.handler;
    let cpu = SavedCpu { regs: Regs::from(u), xsave: Arc::new(Xsave::from(&xsave)) };
    frame.commit(proc, cpu);
    Ok(h)
}

/// rt_sigreturn with RSP `rsp`: the state to return to user mode with (the
/// XSAVE state and signal mask are restored here). A sigreturn that does
/// not match a frame we built kills the guest, as a bad frame does on Linux.
pub fn sigreturn(vm: &mut Vm, proc: &mut Process, rsp: u64) -> Result<kvm_regs, EngineError> {
    let s = forkbox_linux::signal::pop_frame(proc, rsp).ok_or(EngineError::GuestSignaled(libc::SIGSEGV))?;
    vm.set_xsave(&*s.cpu.xsave.to_kvm()?)?;
    Ok(kvm_regs::from(&s.cpu.regs))
}
