//! Signal delivery — signals the guest sends itself or its timers raise, SIGINT
//! for a host interrupt, SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGTRAP for a CPU
//! exception in user code (a #PF on a page the guest did not map, or mapped
//! without the access it tried) — as Linux does it on x86-64 for a handler
//! installed with rt_sigaction (with SA_RESTORER): the interrupted user state is
//! kept host-side, per thread (registers and XSAVE, `forkbox_linux::thread::SigFrame`,
//! part of the process state so a snapshot can hold a thread inside a
//! handler), a minimal `rt_sigframe` is built on the guest stack (below the
//! 128-byte red zone, aligned like a call), the vCPU enters the handler with
//! rdi = signo, rsi = &siginfo, rdx = &ucontext, and the handler's return
//! through the restorer (rt_sigreturn) puts the saved state back. The host
//! copy is the truth: nothing is read back from the guest frame, which the
//! guest may have overwritten.
//!
//! Which signals exist and who takes them is `forkbox_linux::thread`; the
//! host's interrupt (SIGINT) is one of them, with its own rules (`SignalState`).
//! The main thread never parks (gets snapshotted) inside a handler.

use std::time::{Duration, Instant};

use forkbox_linux::layout::{GUEST_BASE, RAM_SIZE};
use forkbox_linux::thread::{SavedCpu, SigFrame, SigInfo, SI_KERNEL};
use forkbox_linux::Process;
use forkbox_vmm::{kvm_regs, GuestFault, Vm};

use crate::error::EngineError;

pub const SIGINT: usize = 2;
pub const SIG_DFL: u64 = 0;
pub const SIG_IGN: u64 = 1;
pub const SA_RESTART: u64 = 0x1000_0000;
/// How long an interrupted exec has to get back to the agent before it is killed.
pub const GRACE: Duration = Duration::from_secs(2);

const SA_ONSTACK: u64 = 0x0800_0000;
const SA_RESTORER: u64 = 0x0400_0000;
const SA_NODEFER: u64 = 0x4000_0000;
const SA_RESETHAND: u64 = 0x8000_0000;
const SS_DISABLE: i32 = 2;
const SS_ONSTACK: i32 = 1;
const SEGV_MAPERR: i32 = 1;
const SEGV_ACCERR: i32 = 2;
const ILL_ILLOPN: i32 = 2;
const FPE_INTDIV: i32 = 1;
const FPE_FLTINV: i32 = 7;
const TRAP_BRKPT: i32 = 1;
const BUS_ADRALN: i32 = 1;
const SIGKILL_STOP: u64 = (1 << 8) | (1 << 18);
const RED_ZONE: u64 = 128;
/// Handlers that may be in flight at once per thread.
const MAX_NESTED: usize = 8;

/// `struct rt_sigframe` (x86-64): pretcode, ucontext (uc_flags, uc_link,
/// uc_stack, uc_mcontext = sigcontext, uc_sigmask), siginfo. No FPU state is
/// written (sigcontext.fpstate = NULL); the host keeps it.
const FRAME_SIZE: u64 = 440;
const UC_OFF: usize = 8;
const UC_STACK_OFF: usize = UC_OFF + 16;
const MCONTEXT_OFF: usize = UC_OFF + 40;
const SIGMASK_OFF: usize = UC_OFF + 296;
const SIGINFO_OFF: usize = 312;

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

/// What a CPU exception adds to a delivery: siginfo's si_addr and
/// sigcontext's err, trapno and cr2.
pub struct FaultInfo {
    pub addr: u64,
    pub err: u64,
    pub trapno: u64,
}

/// The signal Linux raises for a CPU exception in user mode (signal, si_code,
/// fault details); None for vectors a user program cannot cause (those crash).
fn fault_signal(f: &GuestFault) -> Option<(SigInfo, FaultInfo)> {
    let (signo, code, addr) = match f.vector {
        // #PF: error code bit 0 = the page was present (a protection violation).
        14 => (libc::SIGSEGV, if f.error_code & 1 != 0 { SEGV_ACCERR } else { SEGV_MAPERR }, f.cr2),
        13 | 12 | 11 | 10 => (libc::SIGSEGV, SI_KERNEL, 0),
        6 => (libc::SIGILL, ILL_ILLOPN, f.rip),
        0 => (libc::SIGFPE, FPE_INTDIV, f.rip),
        16 | 19 => (libc::SIGFPE, FPE_FLTINV, f.rip),
        1 | 3 => (libc::SIGTRAP, TRAP_BRKPT, f.rip),
        17 => (libc::SIGBUS, BUS_ADRALN, f.cr2),
        _ => return None,
    };
    let info = SigInfo { signo, code, pid: 0, ..Default::default() };
    Some((info, FaultInfo { addr, err: f.error_code, trapno: f.vector as u64 }))
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTRAP => "SIGTRAP",
        _ => "signal",
    }
}

/// How a fault the guest cannot take (or did not handle) is reported.
pub fn crash_report(f: &GuestFault) -> String {
    match fault_signal(f) {
        Some((i, _)) => format!("{f} ({})", signal_name(i.signo)),
        None => f.to_string(),
    }
}

/// rt_sigaction's record for one signal (kernel `struct sigaction`).
pub struct Action {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

pub fn action(proc: &Process, sig: usize) -> Action {
    let a = proc.signals.actions.get(sig).copied().unwrap_or([0; 32]);
    let w = |i: usize| u64::from_le_bytes(a[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    Action { handler: w(0), flags: w(1), restorer: w(2), mask: w(3) }
}

fn killed(why: &str) -> EngineError {
    EngineError::Interrupted(why.to_string())
}

/// The interrupted state goes into the frame as a kernel's sigcontext would have it.
fn sigcontext(u: &kvm_regs, mask: u64, fault: Option<&FaultInfo>) -> [u8; 256] {
    let mut b = [0u8; 256];
    let words = [
        u.r8, u.r9, u.r10, u.r11, u.r12, u.r13, u.r14, u.r15, u.rdi, u.rsi, u.rbp, u.rbx, u.rdx, u.rax, u.rcx, u.rsp,
        u.rip, u.rflags,
    ];
    for (i, w) in words.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    b[144..146].copy_from_slice(&forkbox_vmm::arch::USER_CS.to_le_bytes());
    b[150..152].copy_from_slice(&forkbox_vmm::arch::USER_SS.to_le_bytes());
    // err, trapno (of a fault), oldmask, cr2 (a page fault's address); fpstate = NULL.
    if let Some(f) = fault {
        b[152..160].copy_from_slice(&f.err.to_le_bytes());
        b[160..168].copy_from_slice(&f.trapno.to_le_bytes());
        if f.trapno == 14 {
            b[176..184].copy_from_slice(&f.addr.to_le_bytes());
        }
    }
    b[168..176].copy_from_slice(&mask.to_le_bytes());
    b
}

/// What a signal's default action does.
pub enum DefaultAction {
    Ignore,
    Terminate,
}

pub fn default_action(sig: i32) -> DefaultAction {
    match sig {
        // SIGCHLD, SIGCONT, SIGURG, SIGWINCH are ignored; the stop signals
        // (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) have nothing to stop here.
        17 | 18 | 23 | 28 | 19 | 20 | 21 | 22 => DefaultAction::Ignore,
        _ => DefaultAction::Terminate,
    }
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
        let blocked_everywhere = (0..t.len()).all(|i| proc.mask_of(i) & (1 << (SIGINT - 1)) != 0);
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
pub fn deliver_fault(vm: &mut Vm, proc: &mut Process, st: &mut SignalState, f: &GuestFault) -> Result<kvm_regs, EngineError> {
    let crashed = |why: &str| EngineError::GuestCrashed(format!("{}{why}", crash_report(f)));
    let Some((info, fault)) = fault_signal(f).filter(|_| f.user_mode) else { return Err(crashed("")) };
    let sig = info.signo as usize;
    let act = action(proc, sig);
    if act.handler == SIG_DFL || act.handler == SIG_IGN {
        return Err(crashed(""));
    }
    let blocked = proc.signals.mask & (1 << (sig - 1)) != 0;
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

/// Build the frame of `info` for user state `u` on the current thread and
/// return the registers that enter its handler; Err(why) if it cannot be built.
fn push_frame(
    vm: &mut Vm,
    proc: &mut Process,
    u: &kvm_regs,
    info: &SigInfo,
    fault: Option<&FaultInfo>,
    restore_mask: Option<u64>,
) -> Result<kvm_regs, String> {
    let sig = info.signo as usize;
    let act = action(proc, sig);
    if act.flags & SA_RESTORER == 0 {
        return Err(format!("the signal {sig} handler has no restorer"));
    }
    let alt = proc.signals.altstack;
    let ss_sp = u64::from_le_bytes(alt[0..8].try_into().unwrap_or([0; 8]));
    let ss_flags = i32::from_le_bytes(alt[8..12].try_into().unwrap_or([0; 4]));
    let ss_size = u64::from_le_bytes(alt[16..24].try_into().unwrap_or([0; 8]));
    let on_alt = ss_flags & SS_DISABLE == 0 && u.rsp > ss_sp && u.rsp <= ss_sp.saturating_add(ss_size);
    let sp = if act.flags & SA_ONSTACK != 0 && ss_flags & SS_DISABLE == 0 && ss_size > 0 && !on_alt {
        ss_sp.saturating_add(ss_size)
    } else {
        u.rsp.wrapping_sub(RED_ZONE)
    };
    let frame = (sp.wrapping_sub(FRAME_SIZE) & !15).wrapping_sub(8);
    let end = frame.checked_add(FRAME_SIZE).ok_or("no room for the signal frame")?;
    if frame < GUEST_BASE || end > RAM_SIZE || sp > RAM_SIZE || proc.mm.accessible(frame, FRAME_SIZE, true) != FRAME_SIZE {
        return Err(format!("no room for the signal frame at {frame:#x} (stack pointer {:#x})", u.rsp));
    }
    let xsave = vm.xsave().map_err(|e| e.to_string())?;
    let mask = restore_mask.unwrap_or(proc.signals.mask);
    let mut f = [0u8; FRAME_SIZE as usize];
    f[0..8].copy_from_slice(&act.restorer.to_le_bytes());
    f[UC_STACK_OFF..UC_STACK_OFF + 8].copy_from_slice(&ss_sp.to_le_bytes());
    let cur_flags = if on_alt { SS_ONSTACK } else { ss_flags };
    f[UC_STACK_OFF + 8..UC_STACK_OFF + 12].copy_from_slice(&cur_flags.to_le_bytes());
    f[UC_STACK_OFF + 16..UC_STACK_OFF + 24].copy_from_slice(&ss_size.to_le_bytes());
    f[MCONTEXT_OFF..MCONTEXT_OFF + 256].copy_from_slice(&sigcontext(u, mask, fault));
    f[SIGMASK_OFF..SIGMASK_OFF + 8].copy_from_slice(&mask.to_le_bytes());
    f[SIGINFO_OFF..SIGINFO_OFF + 128].copy_from_slice(&info.to_bytes());
    if let Some(fi) = fault {
        // si_addr (the union's first word) for a fault.
        f[SIGINFO_OFF + 16..SIGINFO_OFF + 24].copy_from_slice(&fi.addr.to_le_bytes());
    }
    vm.mem_mut().write(frame, &f).map_err(|e| e.to_string())?;
    let mut new_mask = proc.signals.mask | act.mask;
    if act.flags & SA_NODEFER == 0 {
        new_mask |= 1 << (sig - 1);
    }
    proc.signals.mask = new_mask & !SIGKILL_STOP;
    if act.flags & SA_RESETHAND != 0 {
        std::sync::Arc::make_mut(&mut proc.signals.actions)[sig] = [0; 32];
    }
    let cpu = SavedCpu { regs: crate::sandbox::regs_to_words(u), xsave: crate::sandbox::xsave_to_words(&xsave) };
    proc.threads.current_mut().frames.push(SigFrame { cpu, mask, frame });
    let mut h = *u;
    h.rip = act.handler;
    h.rsp = frame;
    h.rdi = sig as u64;
    h.rsi = frame + SIGINFO_OFF as u64;
    h.rdx = frame + UC_OFF as u64;
    h.rax = 0;
    // As Linux: no direction flag, trap or resume flag into the handler.
    h.rflags = u.rflags & !(0x400 | 0x100 | 0x1_0000);
    Ok(h)
}

/// rt_sigreturn with RSP `rsp`: the state to return to user mode with (the
/// XSAVE state and signal mask are restored here). A sigreturn that does
/// not match a frame we built kills the guest, as a bad frame does on Linux.
pub fn sigreturn(vm: &mut Vm, proc: &mut Process, rsp: u64) -> Result<kvm_regs, EngineError> {
    let frames = &mut proc.threads.current_mut().frames;
    match frames.last() {
        Some(s) if s.frame.wrapping_add(8) == rsp => {}
        _ => return Err(EngineError::GuestSignaled(libc::SIGSEGV)),
    }
    let Some(s) = frames.pop() else { return Err(EngineError::GuestSignaled(libc::SIGSEGV)) };
    vm.set_xsave(&*crate::sandbox::words_to_xsave(&s.cpu.xsave)?)?;
    proc.signals.mask = s.mask & !SIGKILL_STOP;
    Ok(crate::sandbox::words_to_regs(&s.cpu.regs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigcontext_layout_matches_the_kernel() {
        let u = kvm_regs { r8: 8, rdi: 0xd1, rsp: 0x5a, rip: 0x1234, rflags: 0x246, rcx: 0xc, ..Default::default() };
        let fault = FaultInfo { addr: 0x8000_0000, err: 6, trapno: 14 };
        let b = sigcontext(&u, 0x10, Some(&fault));
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        assert_eq!(at(0), 8, "r8 first");
        assert_eq!(at(64), 0xd1, "rdi at 64");
        assert_eq!(at(112), 0xc, "rcx at 112");
        assert_eq!(at(120), 0x5a, "rsp at 120");
        assert_eq!(at(128), 0x1234, "rip at 128");
        assert_eq!(at(136), 0x246, "eflags at 136");
        assert_eq!(u16::from_le_bytes([b[144], b[145]]), forkbox_vmm::arch::USER_CS);
        assert_eq!(at(168), 0x10, "oldmask");
        assert_eq!(at(152), 6, "err");
        assert_eq!(at(160), 14, "trapno");
        assert_eq!(at(176), 0x8000_0000, "cr2");
        assert_eq!(at(184), 0, "fpstate NULL");
        assert_eq!(SIGINFO_OFF as u64 + 128, FRAME_SIZE);
    }
}
