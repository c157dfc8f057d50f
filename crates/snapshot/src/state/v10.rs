//! Version 10, the current shape: the sandbox's other processes (the process
//! table, and each running child's own state, vCPU and memory as an
//! embedded layer). The process record is version 9's.
//!
//! This module is where the persisted shape meets the live types: it reads
//! a payload into the owned shape and turns it into a [`crate::Snapshot`],
//! and writes a [`crate::Snapshot`] through the same shape. Of the process
//! state, the file system overlay (`VfsState`, [`super::v6`]), the memory
//! map, signals and exec info ([`super::v4`]), the threads ([`super::v6`]),
//! the credentials ([`super::v7`]), the listeners ([`super::v9`]) and the
//! other processes (here) have their own persisted types and conversions
//! below; the fd table and its objects are still written as the serde form
//! of their live types.

use forkbox_linux::fd::FdTable;
use forkbox_linux::vfs as live;
use forkbox_linux::{creds, mm, net, process, procs, thread};
use forkbox_vmm::regs::{Regs, VcpuRecord};
use serde::{Deserialize, Serialize};

use super::v4::{ExecInfo, MemoryMap, Signals, Vma, VmaKind};
use super::v6::{
    BodyState, DevKind, FileBytes, FileState, Ino, NodeState, RunClock, SavedCpu, SigFrame, SigInfo, Thread, Threads,
    Timer, VfsState, Wait, WaitKind,
};
use super::v7::{Creds, Ids};
use super::v9::{ListenerState, Process, ProcessRef};
use super::{v6, MemoryRef, StateError};
use crate::cpu::CpuFingerprint;
use crate::files::FileTable;
use crate::memory::MemoryStats;

#[derive(Deserialize)]
pub(super) struct Snapshot {
    pub image_id: String,
    pub cpu: CpuFingerprint,
    pub vcpu: VcpuRecord,
    pub process: Process,
    pub memory: MemoryStats,
    pub info: String,
    pub files: FileTable,
    pub children: Children,
}

/// [`Snapshot`] for writing, borrowing from a [`crate::Snapshot`].
#[derive(Serialize)]
pub(super) struct SnapshotRef<'a> {
    pub image_id: &'a str,
    pub cpu: &'a CpuFingerprint,
    pub vcpu: &'a VcpuRecord,
    pub process: ProcessRef<'a>,
    pub memory: &'a MemoryStats,
    pub info: &'a str,
    pub files: &'a FileTable,
    pub children: ChildrenRef<'a>,
}

/// The sandbox's processes besides the agent's.
#[derive(Default, Deserialize)]
pub(super) struct Children {
    /// The process table (None: the agent's process alone).
    pub table: Option<ProcTableState>,
    /// The running children, in the scheduler's round-robin order.
    pub processes: Vec<ChildRecord>,
}

/// [`Children`] for writing.
#[derive(Serialize)]
pub(super) struct ChildrenRef<'a> {
    pub table: Option<ProcTableState>,
    pub processes: Vec<ChildRecordRef<'a>>,
}

/// One running child: its own kernel state, its vCPU, where its current
/// thread stands, and where its memory layers are.
#[derive(Deserialize)]
pub(super) struct ChildRecord {
    pub process: ChildState,
    pub vcpu: VcpuRecord,
    pub pending_user: Option<Regs>,
    pub in_stub: bool,
    pub memory: Vec<MemoryRef>,
    pub on_template: bool,
}

/// [`ChildRecord`] for writing, the vCPU and memory references borrowed.
#[derive(Serialize)]
pub(super) struct ChildRecordRef<'a> {
    pub process: ChildStateRef<'a>,
    pub vcpu: &'a VcpuRecord,
    pub pending_user: Option<Regs>,
    pub in_stub: bool,
    pub memory: &'a [MemoryRef],
    pub on_template: bool,
}

/// What a child process has of its own (the file system, descriptions and
/// run clock are the agent's record's); `fds` names descriptions of the
/// agent's table.
#[derive(Deserialize)]
pub(super) struct ChildState {
    pub pid: u32,
    pub mm: MemoryMap,
    pub fds: FdTable,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    pub exec_info: ExecInfo,
    pub creds: Creds,
}

/// [`ChildState`] for writing, the fd table borrowed.
#[derive(Serialize)]
pub(super) struct ChildStateRef<'a> {
    pub pid: u32,
    pub mm: MemoryMap,
    pub fds: &'a FdTable,
    pub cwd: Ino,
    pub signals: Signals,
    pub fs_base: u64,
    pub tid_address: u64,
    pub umask: u32,
    pub threads: Threads,
    pub exec_info: ExecInfo,
    pub creds: Creds,
}

/// The process table: every entry (zombies not yet waited for included)
/// by pid, and the next pid to give out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcTableState {
    pub entries: Vec<(u32, Entry)>,
    pub next_pid: u32,
}

/// One process of the table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    pub nice: i8,
    /// Set once it ended (a zombie until its parent reaps it).
    pub exit: Option<Exit>,
}

/// How a process ended (variant order is the format).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

pub(super) fn read(payload: &[u8]) -> Result<Snapshot, StateError> {
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable version 10 payload: {e}")))
}

/// There were no other processes.
impl From<v6::Snapshot<Process>> for Snapshot {
    fn from(s: v6::Snapshot<Process>) -> Snapshot {
        Snapshot {
            image_id: s.image_id,
            cpu: s.cpu,
            vcpu: s.vcpu,
            process: s.process,
            memory: s.memory,
            info: s.info,
            files: s.files,
            children: Children::default(),
        }
    }
}

impl From<Snapshot> for crate::Snapshot {
    fn from(s: Snapshot) -> crate::Snapshot {
        let p = s.process;
        let process = process::ProcessState {
            mm: p.mm.into(),
            fds: p.fds,
            vfs: p.vfs.into(),
            cwd: p.cwd,
            signals: p.signals.into(),
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: p.threads.into(),
            exec_info: p.exec_info.into(),
            creds: p.creds.into(),
            owners: p.owners,
            listeners: p.listeners.into_iter().map(net::ListenerState::from).collect(),
        };
        crate::Snapshot {
            image_id: s.image_id,
            cpu: s.cpu,
            vcpu: s.vcpu,
            process,
            memory: s.memory,
            info: s.info,
            files: s.files,
            children: s.children.into(),
        }
    }
}

impl<'a> From<&'a crate::Snapshot> for SnapshotRef<'a> {
    fn from(s: &'a crate::Snapshot) -> SnapshotRef<'a> {
        let p = &s.process;
        let process = ProcessRef {
            mm: MemoryMap::from(&p.mm),
            fds: &p.fds,
            vfs: VfsState::from(&p.vfs),
            cwd: p.cwd,
            signals: Signals::from(&p.signals),
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: Threads::from(&p.threads),
            exec_info: ExecInfo::from(&p.exec_info),
            creds: Creds::from(&p.creds),
            owners: &p.owners,
            listeners: p.listeners.iter().map(ListenerState::from).collect(),
        };
        SnapshotRef {
            image_id: &s.image_id,
            cpu: &s.cpu,
            vcpu: &s.vcpu,
            process,
            memory: &s.memory,
            info: &s.info,
            files: &s.files,
            children: ChildrenRef::from(&s.children),
        }
    }
}

/// The VFS's saved state as persisted. File bytes are shared, not copied.
impl From<&live::VfsState> for VfsState {
    fn from(s: &live::VfsState) -> VfsState {
        VfsState {
            image_id: s.image_id.clone(),
            version: s.version,
            next_ino: s.next_ino,
            quota: s.quota,
            overlay_bytes: s.overlay_bytes,
            nodes: s.nodes.iter().map(NodeState::from).collect(),
            refs: s.refs.clone(),
        }
    }
}

impl From<&live::NodeState> for NodeState {
    fn from(n: &live::NodeState) -> NodeState {
        let body = match &n.body {
            live::BodyState::Dir { parent, entries } => BodyState::Dir { parent: *parent, entries: entries.clone() },
            live::BodyState::File(live::FileState::Image) => BodyState::File(FileState::Image),
            live::BodyState::File(live::FileState::Owned(b)) => {
                BodyState::File(FileState::Owned(FileBytes(b.0.clone())))
            }
            live::BodyState::File(live::FileState::Layer { layer, ino }) => {
                BodyState::File(FileState::Layer { layer: layer.clone(), ino: *ino })
            }
            live::BodyState::Symlink(t) => BodyState::Symlink(t.clone()),
            live::BodyState::CharDev(d) => BodyState::CharDev(DevKind::from(*d)),
            live::BodyState::Fifo => BodyState::Fifo,
            live::BodyState::Socket => BodyState::Socket,
            live::BodyState::Gone => BodyState::Gone,
        };
        NodeState { ino: n.ino, perm: n.perm, mtime_ns: n.mtime_ns, atime_ns: n.atime_ns, nlink: n.nlink, body }
    }
}

impl From<live::DevKind> for DevKind {
    fn from(d: live::DevKind) -> DevKind {
        match d {
            live::DevKind::Null => DevKind::Null,
            live::DevKind::Zero => DevKind::Zero,
            live::DevKind::Full => DevKind::Full,
            live::DevKind::Urandom => DevKind::Urandom,
            live::DevKind::Tty => DevKind::Tty,
            live::DevKind::Ptmx => DevKind::Ptmx,
        }
    }
}

/// The persisted state as the VFS restores it (`Vfs::restore_state`
/// checks it against the image and against itself).
impl From<VfsState> for live::VfsState {
    fn from(s: VfsState) -> live::VfsState {
        live::VfsState {
            image_id: s.image_id,
            version: s.version,
            next_ino: s.next_ino,
            quota: s.quota,
            overlay_bytes: s.overlay_bytes,
            nodes: s.nodes.into_iter().map(live::NodeState::from).collect(),
            refs: s.refs,
        }
    }
}

impl From<NodeState> for live::NodeState {
    fn from(n: NodeState) -> live::NodeState {
        let body = match n.body {
            BodyState::Dir { parent, entries } => live::BodyState::Dir { parent, entries },
            BodyState::File(FileState::Image) => live::BodyState::File(live::FileState::Image),
            BodyState::File(FileState::Owned(b)) => live::BodyState::File(live::FileState::Owned(live::FileBytes(b.0))),
            BodyState::File(FileState::Layer { layer, ino }) => {
                live::BodyState::File(live::FileState::Layer { layer, ino })
            }
            BodyState::Symlink(t) => live::BodyState::Symlink(t),
            BodyState::CharDev(d) => live::BodyState::CharDev(d.into()),
            BodyState::Fifo => live::BodyState::Fifo,
            BodyState::Socket => live::BodyState::Socket,
            BodyState::Gone => live::BodyState::Gone,
        };
        live::NodeState { ino: n.ino, perm: n.perm, mtime_ns: n.mtime_ns, atime_ns: n.atime_ns, nlink: n.nlink, body }
    }
}

impl From<DevKind> for live::DevKind {
    fn from(d: DevKind) -> live::DevKind {
        match d {
            DevKind::Null => live::DevKind::Null,
            DevKind::Zero => live::DevKind::Zero,
            DevKind::Full => live::DevKind::Full,
            DevKind::Urandom => live::DevKind::Urandom,
            DevKind::Tty => live::DevKind::Tty,
            DevKind::Ptmx => live::DevKind::Ptmx,
        }
    }
}

/// The memory map as persisted (its mappings in address order).
impl From<&mm::MemoryMap> for MemoryMap {
    fn from(m: &mm::MemoryMap) -> MemoryMap {
        MemoryMap {
            vmas: m.vmas().map(|(start, v)| (start, Vma::from(v))).collect(),
            brk_start: m.brk_start,
            brk: m.brk,
            committed: m.committed(),
            limit: m.limit(),
        }
    }
}

impl From<mm::Vma> for Vma {
    fn from(v: mm::Vma) -> Vma {
        let kind = match v.kind {
            mm::VmaKind::Anon => VmaKind::Anon,
            mm::VmaKind::File => VmaKind::File,
            mm::VmaKind::SharedFile { ino, offset } => VmaKind::SharedFile { ino, offset },
            mm::VmaKind::Stack => VmaKind::Stack,
            mm::VmaKind::Shm { obj, offset, ino } => VmaKind::Shm { obj, offset, ino },
        };
        Vma { end: v.end, prot: v.prot, kind }
    }
}

/// The map as restored, unchecked (`MemoryMap::validate` checks it).
impl From<MemoryMap> for mm::MemoryMap {
    fn from(m: MemoryMap) -> mm::MemoryMap {
        let vmas = m.vmas.into_iter().map(|(start, v)| (start, mm::Vma::from(v)));
        mm::MemoryMap::from_saved(vmas, m.brk_start, m.brk, m.committed, m.limit)
    }
}

impl From<Vma> for mm::Vma {
    fn from(v: Vma) -> mm::Vma {
        let kind = match v.kind {
            VmaKind::Anon => mm::VmaKind::Anon,
            VmaKind::File => mm::VmaKind::File,
            VmaKind::SharedFile { ino, offset } => mm::VmaKind::SharedFile { ino, offset },
            VmaKind::Stack => mm::VmaKind::Stack,
            VmaKind::Shm { obj, offset, ino } => mm::VmaKind::Shm { obj, offset, ino },
        };
        mm::Vma { end: v.end, prot: v.prot, kind }
    }
}

/// The actions are shared, not copied.
impl From<&process::Signals> for Signals {
    fn from(s: &process::Signals) -> Signals {
        Signals { actions: s.actions.clone(), mask: s.mask, altstack: s.altstack }
    }
}

impl From<Signals> for process::Signals {
    fn from(s: Signals) -> process::Signals {
        process::Signals { actions: s.actions, mask: s.mask, altstack: s.altstack }
    }
}

/// The strings are shared, not copied.
impl From<&process::ExecInfo> for ExecInfo {
    fn from(e: &process::ExecInfo) -> ExecInfo {
        ExecInfo { exe: e.exe.clone(), cmdline: e.cmdline.clone(), environ: e.environ.clone() }
    }
}

impl From<ExecInfo> for process::ExecInfo {
    fn from(e: ExecInfo) -> process::ExecInfo {
        process::ExecInfo { exe: e.exe, cmdline: e.cmdline, environ: e.environ }
    }
}

/// The groups are shared, not copied.
impl From<&creds::Creds> for Creds {
    fn from(c: &creds::Creds) -> Creds {
        Creds { uid: c.uid.into(), gid: c.gid.into(), groups: c.groups.clone() }
    }
}

impl From<creds::Ids> for Ids {
    fn from(i: creds::Ids) -> Ids {
        Ids { real: i.real, effective: i.effective, saved: i.saved, fs: i.fs }
    }
}

/// The credentials as restored, unchecked (`Creds::validate` checks them).
impl From<Creds> for creds::Creds {
    fn from(c: Creds) -> creds::Creds {
        creds::Creds { uid: c.uid.into(), gid: c.gid.into(), groups: c.groups }
    }
}

impl From<Ids> for creds::Ids {
    fn from(i: Ids) -> creds::Ids {
        creds::Ids { real: i.real, effective: i.effective, saved: i.saved, fs: i.fs }
    }
}

impl From<&net::ListenerState> for ListenerState {
    fn from(l: &net::ListenerState) -> ListenerState {
        ListenerState {
            id: l.id,
            domain: l.domain,
            local: l.local,
            backlog: l.backlog,
            reuse: l.reuse,
            rcvtimeo: l.rcvtimeo,
            sndtimeo: l.sndtimeo,
            opts: l.opts.clone(),
        }
    }
}

/// The listener as restored, unchecked (`NetIo::restore_listeners` checks it).
impl From<ListenerState> for net::ListenerState {
    fn from(l: ListenerState) -> net::ListenerState {
        net::ListenerState {
            id: l.id,
            domain: l.domain,
            local: l.local,
            backlog: l.backlog,
            reuse: l.reuse,
            rcvtimeo: l.rcvtimeo,
            sndtimeo: l.sndtimeo,
            opts: l.opts,
        }
    }
}

/// The threads as persisted (XSAVE images shared, not copied).
impl From<&thread::Threads> for Threads {
    fn from(t: &thread::Threads) -> Threads {
        Threads {
            list: t.list.iter().map(Thread::from).collect(),
            cur: t.cur,
            next_tid: t.next_tid,
            pending: t.pending.iter().map(|&s| s.into()).collect(),
            timers: t.timers.iter().map(Timer::from).collect(),
            itimer_real: t.itimer_real.as_ref().map(Timer::from),
            clock: RunClock { ns: t.clock.stopped_ns() },
        }
    }
}

/// What a thread's blocked write had written is not recorded
/// (`Threads::for_checkpoint` ends such a wait first).
impl From<&thread::Thread> for Thread {
    fn from(t: &thread::Thread) -> Thread {
        Thread {
            tid: t.tid,
            cpu: t.cpu.as_ref().map(SavedCpu::from),
            fs_base: t.fs_base,
            sigmask: t.sigmask,
            altstack: t.altstack,
            clear_tid: t.clear_tid,
            pending: t.pending.iter().map(|&s| s.into()).collect(),
            frames: t.frames.iter().map(SigFrame::from).collect(),
            wait: t.wait.as_ref().map(Wait::from),
            restore_mask: t.restore_mask,
            restart: t.restart,
        }
    }
}

impl From<&thread::SavedCpu> for SavedCpu {
    fn from(c: &thread::SavedCpu) -> SavedCpu {
        SavedCpu { regs: c.regs, xsave: c.xsave.clone() }
    }
}

impl From<&thread::SigFrame> for SigFrame {
    fn from(f: &thread::SigFrame) -> SigFrame {
        SigFrame { cpu: SavedCpu::from(&f.cpu), mask: f.mask, frame: f.frame }
    }
}

impl From<thread::SigInfo> for SigInfo {
    fn from(s: thread::SigInfo) -> SigInfo {
        SigInfo { signo: s.signo, code: s.code, pid: s.pid, timer_id: s.timer_id, overrun: s.overrun, value: s.value }
    }
}

/// When the wait began is not recorded (it only orders the waits of one run).
impl From<&thread::Wait> for Wait {
    fn from(w: &thread::Wait) -> Wait {
        let kind = match w.kind {
            thread::WaitKind::Futex { addr, bitset } => WaitKind::Futex { addr, bitset },
            thread::WaitKind::Signal => WaitKind::Signal,
            thread::WaitKind::Time => WaitKind::Time,
            thread::WaitKind::Other => WaitKind::Other,
            thread::WaitKind::Agent => WaitKind::Agent,
        };
        Wait { regs: w.regs, deadline: w.deadline, on_timeout: w.on_timeout, kind, woken: w.woken }
    }
}

impl From<&thread::Timer> for Timer {
    fn from(t: &thread::Timer) -> Timer {
        Timer {
            id: t.id,
            clock: t.clock,
            signo: t.signo,
            tid: t.tid,
            silent: t.silent,
            value: t.value,
            expiry: t.expiry,
            interval_ns: t.interval_ns,
            overrun: t.overrun,
        }
    }
}

/// The threads as restored, unchecked (`Threads::validate` checks them),
/// the run clock stopped.
impl From<Threads> for thread::Threads {
    fn from(t: Threads) -> thread::Threads {
        thread::Threads {
            list: t.list.into_iter().map(thread::Thread::from).collect(),
            cur: t.cur,
            next_tid: t.next_tid,
            pending: t.pending.into_iter().map(thread::SigInfo::from).collect(),
            timers: t.timers.into_iter().map(thread::Timer::from).collect(),
            itimer_real: t.itimer_real.map(thread::Timer::from),
            clock: thread::RunClock::stopped_at(t.clock.ns),
        }
    }
}

/// No blocked write has written part of its bytes.
impl From<Thread> for thread::Thread {
    fn from(t: Thread) -> thread::Thread {
        thread::Thread {
            tid: t.tid,
            cpu: t.cpu.map(thread::SavedCpu::from),
            fs_base: t.fs_base,
            sigmask: t.sigmask,
            altstack: t.altstack,
            clear_tid: t.clear_tid,
            pending: t.pending.into_iter().map(thread::SigInfo::from).collect(),
            frames: t.frames.into_iter().map(thread::SigFrame::from).collect(),
            wait: t.wait.map(thread::Wait::from),
            restore_mask: t.restore_mask,
            restart: t.restart,
            written: 0,
        }
    }
}

impl From<SavedCpu> for thread::SavedCpu {
    fn from(c: SavedCpu) -> thread::SavedCpu {
        thread::SavedCpu { regs: c.regs, xsave: c.xsave }
    }
}

impl From<SigFrame> for thread::SigFrame {
    fn from(f: SigFrame) -> thread::SigFrame {
        thread::SigFrame { cpu: f.cpu.into(), mask: f.mask, frame: f.frame }
    }
}

impl From<SigInfo> for thread::SigInfo {
    fn from(s: SigInfo) -> thread::SigInfo {
        thread::SigInfo {
            signo: s.signo,
            code: s.code,
            pid: s.pid,
            timer_id: s.timer_id,
            overrun: s.overrun,
            value: s.value,
        }
    }
}

/// A restored wait ranks before every wait begun since (it began before them).
impl From<Wait> for thread::Wait {
    fn from(w: Wait) -> thread::Wait {
        let kind = match w.kind {
            WaitKind::Futex { addr, bitset } => thread::WaitKind::Futex { addr, bitset },
            WaitKind::Signal => thread::WaitKind::Signal,
            WaitKind::Time => thread::WaitKind::Time,
            WaitKind::Other => thread::WaitKind::Other,
            WaitKind::Agent => thread::WaitKind::Agent,
        };
        thread::Wait { regs: w.regs, deadline: w.deadline, on_timeout: w.on_timeout, kind, woken: w.woken, since: 0 }
    }
}

impl From<Timer> for thread::Timer {
    fn from(t: Timer) -> thread::Timer {
        thread::Timer {
            id: t.id,
            clock: t.clock,
            signo: t.signo,
            tid: t.tid,
            silent: t.silent,
            value: t.value,
            expiry: t.expiry,
            interval_ns: t.interval_ns,
            overrun: t.overrun,
        }
    }
}

impl<'a> From<&'a super::Children> for ChildrenRef<'a> {
    fn from(c: &'a super::Children) -> ChildrenRef<'a> {
        ChildrenRef {
            table: c.table.as_ref().map(ProcTableState::from),
            processes: c.processes.iter().map(ChildRecordRef::from).collect(),
        }
    }
}

impl<'a> From<&'a super::ChildRecord> for ChildRecordRef<'a> {
    fn from(c: &'a super::ChildRecord) -> ChildRecordRef<'a> {
        ChildRecordRef {
            process: ChildStateRef::from(&c.process),
            vcpu: &c.vcpu,
            pending_user: c.pending_user,
            in_stub: c.in_stub,
            memory: &c.memory,
            on_template: c.on_template,
        }
    }
}

impl<'a> From<&'a process::ChildState> for ChildStateRef<'a> {
    fn from(p: &'a process::ChildState) -> ChildStateRef<'a> {
        ChildStateRef {
            pid: p.pid,
            mm: MemoryMap::from(&p.mm),
            fds: &p.fds,
            cwd: p.cwd,
            signals: Signals::from(&p.signals),
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: Threads::from(&p.threads),
            exec_info: ExecInfo::from(&p.exec_info),
            creds: Creds::from(&p.creds),
        }
    }
}

impl From<&procs::ProcTableState> for ProcTableState {
    fn from(t: &procs::ProcTableState) -> ProcTableState {
        ProcTableState {
            entries: t.entries.iter().map(|(pid, e)| (*pid, Entry::from(e))).collect(),
            next_pid: t.next_pid,
        }
    }
}

impl From<&procs::Entry> for Entry {
    fn from(e: &procs::Entry) -> Entry {
        let exit = e.exit.map(|x| match x {
            procs::Exit::Code(c) => Exit::Code(c),
            procs::Exit::Signal(s) => Exit::Signal(s),
        });
        Entry { ppid: e.ppid, pgid: e.pgid, sid: e.sid, nice: e.nice, exit }
    }
}

impl From<Children> for super::Children {
    fn from(c: Children) -> super::Children {
        super::Children {
            table: c.table.map(procs::ProcTableState::from),
            processes: c.processes.into_iter().map(super::ChildRecord::from).collect(),
        }
    }
}

impl From<ChildRecord> for super::ChildRecord {
    fn from(c: ChildRecord) -> super::ChildRecord {
        super::ChildRecord {
            process: c.process.into(),
            vcpu: c.vcpu,
            pending_user: c.pending_user,
            in_stub: c.in_stub,
            memory: c.memory,
            on_template: c.on_template,
        }
    }
}

/// The child as restored, unchecked (`Process::restore_child` checks it).
impl From<ChildState> for process::ChildState {
    fn from(p: ChildState) -> process::ChildState {
        process::ChildState {
            pid: p.pid,
            mm: p.mm.into(),
            fds: p.fds,
            cwd: p.cwd,
            signals: p.signals.into(),
            fs_base: p.fs_base,
            tid_address: p.tid_address,
            umask: p.umask,
            threads: p.threads.into(),
            exec_info: p.exec_info.into(),
            creds: p.creds.into(),
        }
    }
}

/// The table as restored, unchecked (`ProcTable::restore_state` checks it).
impl From<ProcTableState> for procs::ProcTableState {
    fn from(t: ProcTableState) -> procs::ProcTableState {
        procs::ProcTableState {
            entries: t.entries.into_iter().map(|(pid, e)| (pid, procs::Entry::from(e))).collect(),
            next_pid: t.next_pid,
        }
    }
}

impl From<Entry> for procs::Entry {
    fn from(e: Entry) -> procs::Entry {
        let exit = e.exit.map(|x| match x {
            Exit::Code(c) => procs::Exit::Code(c),
            Exit::Signal(s) => procs::Exit::Signal(s),
        });
        procs::Entry { ppid: e.ppid, pgid: e.pgid, sid: e.sid, nice: e.nice, exit }
    }
}
