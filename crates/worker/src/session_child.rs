//! A session worker's side (`Role::Sessions`): the sessions of one tenant.
//!
//! Its fd 3 is the control socket: the API process sends `ToSessions`
//! frames there (a new sandbox channel with its socket attached, an
//! interrupt). Each channel is served on a thread of its own (threads are
//! pooled: a thread that served a throwaway fork keeps its recycled VMs for
//! the next), one request at a time ([`ToChannel`]); a resident session's
//! sandbox stays on its thread for its life. Every file it reads or writes
//! comes as a descriptor in a `Files` frame; it never names a path but the
//! read-only template, image and package files of its jail.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use forkbox_engine::{
    BackgroundRun, CheckpointFiles, EngineError, ExecOptions, Interrupter, ResumeAs, Sandbox, Stream, Template,
    NET_GLOBAL,
};
use forkbox_snapshot::{Layer, StateError};

use crate::broker::{Brokered, Link};
use crate::child::{wire, Templates};
use crate::protocol::{
    self, FromChannel, FromWorker, Hello, NetDelta, PackageRef, ProtocolError, SessionDone, StartFrom, ToChannel,
    ToSessions, WireChunk, WireError, B64, FDS_PER_FRAME, TEST_FORBIDDEN_SYSCALL,
};

/// Descriptors a channel may hold between requests.
const MAX_PENDING_FILES: usize = 1024;
/// Threads kept for the channels beside the control thread and the engine's own (pool, reaper).
const RESERVED_TASKS: u64 = 8;

struct Shared {
    hello: Hello,
    /// The egress broker (each sandbox's way out, under its channel's id).
    link: Arc<Link>,
    templates: Mutex<Templates>,
    /// The interrupt latch of each open channel.
    channels: Mutex<HashMap<u64, Arc<ChannelCtl>>>,
    /// The network counters already reported (each exec reports what came since).
    net_reported: Mutex<NetDelta>,
    /// Idle channel threads, most recently idle last.
    idle: Mutex<Vec<Sender<(u64, UnixStream)>>>,
    threads: AtomicU64,
    /// Background work is held (the tenant's CPU budget is spent): sandboxes
    /// run only for requests until the API process lifts it.
    throttled: AtomicBool,
}

#[derive(Default)]
struct ChannelCtl {
    interrupter: Interrupter,
    /// The highest exec number an interrupt was asked for.
    requested: AtomicU64,
}

/// Serve the control socket until the API process closes it.
pub(crate) fn serve(
    hello: Hello,
    templates: Templates,
    link: Arc<Link>,
    control: UnixStream,
) -> Result<(), ProtocolError> {
    let shared = Arc::new(Shared {
        hello,
        link,
        templates: Mutex::new(templates),
        channels: Mutex::new(HashMap::new()),
        net_reported: Mutex::new(NET_GLOBAL.read()),
        idle: Mutex::new(Vec::new()),
        threads: AtomicU64::new(0),
        throttled: AtomicBool::new(false),
    });
    loop {
        let (msg, mut fds) = match protocol::read_fds::<ToSessions>(&control, 1) {
            Ok(m) => m,
            Err(e) if e.is_closed() => return Ok(()),
            Err(e) => return Err(e),
        };
        match msg {
            ToSessions::Prepare { template } => {
                let r = lock(&shared.templates).get(&template).map(|_| ()).map_err(|e| wire(e, None));
                protocol::write(&mut &control, &FromWorker::Prepared(r))?;
            }
            ToSessions::Channel { id } => {
                let Some(fd) = fds.pop() else { continue };
                let sock = UnixStream::from(fd);
                dispatch(&shared, id, sock);
            }
            ToSessions::Interrupt { id, exec } => {
                let ctl = lock(&shared.channels).get(&id).cloned();
                if let Some(ctl) = ctl {
                    ctl.requested.fetch_max(exec, Ordering::SeqCst);
                    ctl.interrupter.interrupt();
                }
            }
            ToSessions::Throttle { on } => shared.throttled.store(on, Ordering::SeqCst),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hand a channel to an idle thread, or a new one (within the task bound).
fn dispatch(shared: &Arc<Shared>, id: u64, sock: UnixStream) {
    let mut job = (id, sock);
    loop {
        let Some(tx) = lock(&shared.idle).pop() else { break };
        match tx.send(job) {
            Ok(()) => return,
            // That thread is gone: try the next.
            Err(e) => job = e.0,
        }
    }
    let max = shared.hello.max_tasks.saturating_sub(RESERVED_TASKS).max(1);
    if shared.threads.load(Ordering::SeqCst) >= max {
        let msg = format!("this worker serves {max} sandboxes at once already");
        let _ = protocol::write(&mut &job.1, &FromChannel::Refused(msg));
        return;
    }
    let (tx, rx) = channel::<(u64, UnixStream)>();
    let me = shared.clone();
    let mine = tx.clone();
    shared.threads.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new().name("forkbox-sandbox".into()).spawn(move || {
        for (id, sock) in rx {
            serve_channel(&me, id, sock);
            lock(&me.idle).push(mine.clone());
        }
    });
    match spawned {
        Ok(_) => {
            let _ = tx.send(job);
        }
        Err(e) => {
            shared.threads.fetch_sub(1, Ordering::SeqCst);
            let _ = protocol::write(&mut &job.1, &FromChannel::Refused(format!("no thread for the sandbox: {e}")));
        }
    }
}

/// One channel: its sandbox, and the files given for its next request.
struct Channel {
    /// The API process' id of the channel (its sandbox's at the egress broker).
    id: u64,
    sb: Option<Sandbox>,
    template: Option<(Arc<forkbox_engine::Engine>, Arc<Template>)>,
    files: HashMap<String, File>,
}

/// Why serving a channel stopped.
enum Stop {
    /// The API process closed it, or broke the protocol.
    Gone,
}

impl From<ProtocolError> for Stop {
    fn from(_: ProtocolError) -> Stop {
        Stop::Gone
    }
}

fn serve_channel(shared: &Shared, id: u64, sock: UnixStream) {
    let ctl = Arc::new(ChannelCtl::default());
    lock(&shared.channels).insert(id, ctl.clone());
    let mut ch = Channel { id, sb: None, template: None, files: HashMap::new() };
    loop {
        // Between requests the sandbox's background threads and processes run
        // here, a slice at a time; a request is taken at the next slice's end.
        if let Some(sb) = ch.sb.as_mut().filter(|sb| sb.has_background()) {
            if shared.throttled.load(Ordering::SeqCst) {
                // Parked as between two slices; a request is served as usual.
                if !readable(&sock, BACKGROUND_IDLE_POLL) {
                    continue;
                }
            } else if !readable(&sock, Duration::ZERO) {
                // A request on the channel (a port connection ...) ends the slice at once.
                let idle = match sb.run_background_woken(Instant::now() + BACKGROUND_SLICE, Some(sock.as_fd())) {
                    Ok(BackgroundRun::Busy) => false,
                    Ok(BackgroundRun::Idle) => true,
                    // The sandbox is poisoned: the next request says so.
                    Err(e) => {
                        tracing::debug!("background run of channel {id}: {e}");
                        true
                    }
                };
                if idle {
                    readable(&sock, BACKGROUND_IDLE_POLL);
                }
                continue;
            }
        }
        if serve_one(shared, &ctl, &mut ch, &sock).is_err() {
            break;
        }
    }
    lock(&shared.channels).remove(&id);
    // The sandbox is dropped here, on its own thread (its VM may be recycled for this thread).
    drop(ch);
}

/// The most of a job's stream one read returns.
const JOB_READ_MAX: usize = 1 << 20;
/// The longest a job wait runs the sandbox.
const JOB_WAIT_MAX_MS: u64 = 60_000;

/// How long a write to a job's full stdin waits for its processes to read.
const JOB_STDIN_WAIT: Duration = Duration::from_secs(5);

/// How long background work runs before the channel is looked at again.
const BACKGROUND_SLICE: Duration = Duration::from_millis(10);
/// With background work that cannot run now (all of it waiting), how long
/// before its timers and waits are looked at again.
const BACKGROUND_IDLE_POLL: Duration = Duration::from_millis(20);

/// Is there something to read on `sock` (a request, or its end) within `wait`?
fn readable(sock: &UnixStream, wait: Duration) -> bool {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 || n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
}

fn take(files: &mut HashMap<String, File>, name: &str) -> Result<File, EngineError> {
    files.remove(name).ok_or_else(|| EngineError::Protocol(format!("the file {name:?} was not given")))
}

fn net_since_last(shared: &Shared) -> NetDelta {
    let now = NET_GLOBAL.read();
    let mut seen = lock(&shared.net_reported);
    let d = now.since(*seen);
    *seen = now;
    d
}

fn no_sandbox() -> WireError {
    wire(EngineError::Protocol("no sandbox on this channel".into()), None)
}

/// Serve one request.
fn serve_one(shared: &Shared, ctl: &ChannelCtl, ch: &mut Channel, sock: &UnixStream) -> Result<(), Stop> {
    let (req, fds) = protocol::read_fds::<ToChannel>(sock, FDS_PER_FRAME)?;
    let reply = |msg: &FromChannel| protocol::write(&mut &*sock, msg);
    match req {
        ToChannel::Files { names } => {
            if names.len() != fds.len() || ch.files.len() + names.len() > MAX_PENDING_FILES {
                return Err(Stop::Gone);
            }
            for (n, fd) in names.into_iter().zip(fds) {
                ch.files.insert(n, File::from(fd));
            }
        }
        ToChannel::Start { template, limits, how, from } => {
            let mut broken = false;
            let r = start(shared, ch, sock, &template, limits, how, from, &mut broken);
            ch.files.clear();
            if broken {
                return Err(Stop::Gone);
            }
            reply(&FromChannel::Started(r.map_err(|e| wire(e, None))))?;
        }
        ToChannel::Exec { code, exec, exec_id, timeout_ms, stream, interrupted, job, prelude } => {
            let Some(sb) = ch.sb.as_mut() else {
                let done = SessionDone { result: Err(no_sandbox()), net: NetDelta::default(), background: false };
                return Ok(reply(&FromChannel::Executed(Box::new(done)))?);
            };
            if shared.hello.test_actions && code.trim() == TEST_FORBIDDEN_SYSCALL {
                // Outside the filter's list: the filter kills this process here.
                // SAFETY: a syscall with no pointer arguments.
                unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
            }
            if let Some(n) = exec_id {
                sb.set_exec_id(n);
            }
            let interrupter = ctl.interrupter.clone();
            interrupter.arm();
            if interrupted || ctl.requested.load(Ordering::SeqCst) >= exec {
                interrupter.interrupt();
            }
            let mut write_err = None;
            let timeout = timeout_ms.map(Duration::from_millis);
            let result = if stream {
                let mut sink = |stream: Stream, bytes: &[u8]| {
                    if write_err.is_none() {
                        if let Err(e) = reply(&FromChannel::Output { stream, data: bytes.to_vec() }) {
                            write_err = Some(e);
                        }
                    }
                };
                let opts = ExecOptions {
                    on_output: Some(&mut sink),
                    interrupt: Some(interrupter.clone()),
                    timeout,
                    job,
                    prelude: prelude.as_deref(),
                };
                sb.exec_with(&code, opts)
            } else {
                let prelude = prelude.as_deref();
                let opts = ExecOptions { on_output: None, interrupt: Some(interrupter.clone()), timeout, job, prelude };
                sb.exec_with(&code, opts)
            };
            interrupter.disarm();
            if write_err.is_some() {
                return Err(Stop::Gone);
            }
            let result = result.map_err(|e| wire(e, sb.take_failed_output()));
            let done = SessionDone { result, net: net_since_last(shared), background: sb.has_background() };
            reply(&FromChannel::Executed(Box::new(done)))?;
        }
        ToChannel::WriteFile { path, len } => {
            let upload = take(&mut ch.files, crate::sessions::UPLOAD_FILE);
            ch.files.clear();
            let r = match (ch.sb.as_mut(), upload) {
                (Some(sb), Ok(f)) => {
                    let mut src = forkbox_sessions::host::ReadAt::new(&f);
                    sb.write_file_from(&path, &mut src, len).map_err(|e| wire(e, None))
                }
                (None, _) => Err(no_sandbox()),
                (_, Err(e)) => Err(wire(e, None)),
            };
            reply(&FromChannel::Done(r))?;
        }
        ToChannel::ReadFile { path, max } => {
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            let r = match ch.sb.as_ref() {
                Some(sb) => sb.read_file(&path, max).map(B64).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::File(r))?;
        }
        ToChannel::ListDir { path } => {
            let r = match ch.sb.as_ref() {
                Some(sb) => sb.list_dir(&path).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Listing(r))?;
        }
        ToChannel::FileOp(op) => {
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.file_op(&op).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::FileOpDone(r))?;
        }
        ToChannel::Install { packages } => {
            let r = install(ch, &packages);
            reply(&FromChannel::Installed(r.map_err(|e| wire(e, None))))?;
        }
        ToChannel::Walk => {
            let r = match ch.sb.as_ref() {
                Some(sb) => Ok(forkbox_sessions::host::walk(sb)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Walked(r))?;
        }
        ToChannel::Checkpoint { pack_name } => {
            let (Some(sb), Some((engine, template))) = (ch.sb.as_mut(), ch.template.as_ref()) else {
                return Ok(reply(&FromChannel::Checkpointed(Err(no_sandbox())))?);
            };
            let files = &mut ch.files;
            let r = template.checkpoint_into(engine, sb, &pack_name, |size| -> Result<CheckpointFiles, Admit> {
                reply(&FromChannel::CheckpointSize(size))?;
                loop {
                    let (msg, fds) = protocol::read_fds::<ToChannel>(sock, FDS_PER_FRAME)?;
                    match msg {
                        ToChannel::Files { names } if names.len() == fds.len() && names.len() <= 4 => {
                            for (n, fd) in names.into_iter().zip(fds) {
                                files.insert(n, File::from(fd));
                            }
                        }
                        ToChannel::CheckpointGo => break,
                        ToChannel::Abort { .. } => return Err(Admit::Refused),
                        _ => return Err(Admit::Broken),
                    }
                }
                let pack = if size.pack { Some(take(files, "pack")?) } else { None };
                let procs = if size.procs { Some(take(files, "procs")?) } else { None };
                Ok(CheckpointFiles { layer: take(files, "layer")?, pack, procs, state: take(files, "state")? })
            });
            ch.files.clear();
            match r {
                Ok(stats) => {
                    reply(&FromChannel::Checkpointed(Ok(stats)))?;
                    // (While the API process makes it durable: the next session starts warm.)
                    template.keep_warm(engine);
                }
                Err(Admit::Engine(e)) => reply(&FromChannel::Checkpointed(Err(wire(e, None))))?,
                // Refused: the API process drops this sandbox; nothing to say.
                Err(Admit::Refused) => {}
                Err(Admit::Broken) => return Err(Stop::Gone),
            }
        }
        ToChannel::Snapshot { id, preload } => {
            let r = (|| -> Result<(), EngineError> {
                let (Some(sb), Some((engine, template))) = (ch.sb.as_ref(), ch.template.as_ref()) else {
                    return Err(EngineError::Protocol("no sandbox on this channel".into()));
                };
                let mut memory = take(&mut ch.files, "memory")?;
                let mut state = take(&mut ch.files, "state")?;
                template.snapshot_into(engine, sb, &mut memory, &mut state, &id, &preload)
            })();
            ch.files.clear();
            reply(&FromChannel::Done(r.map_err(|e| wire(e, None))))?;
        }
        ToChannel::Jobs => {
            let r = ch.sb.as_ref().map(|sb| sb.jobs()).ok_or_else(no_sandbox);
            reply(&FromChannel::Jobs(r))?;
        }
        ToChannel::ListeningPorts => {
            let r = ch.sb.as_ref().map(|sb| sb.listening_ports()).ok_or_else(no_sandbox);
            reply(&FromChannel::ListeningPorts(r))?;
        }
        ToChannel::JobOutput { pid, stream, offset, max } => {
            let max = usize::try_from(max).unwrap_or(usize::MAX).min(JOB_READ_MAX);
            let r = match ch.sb.as_ref() {
                Some(sb) => sb
                    .job_output(pid, stream, offset, max)
                    .map(|c| WireChunk { offset: c.offset, end: c.end, data: c.data, running: c.running })
                    .map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::JobOutput(r))?;
        }
        ToChannel::JobSignal { pid, signal } => {
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.job_signal(pid, signal).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Job(r))?;
        }
        ToChannel::JobWait { pid, timeout_ms } => {
            let until = Instant::now() + Duration::from_millis(timeout_ms.min(JOB_WAIT_MAX_MS));
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.job_wait(pid, until).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Job(r))?;
        }
        ToChannel::ConnectPort { port } => {
            let mut fds = fds;
            let (Some(conn), true) = (fds.pop(), fds.is_empty()) else { return Err(Stop::Gone) };
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.connect_port(port, conn).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::PortConnected(r))?;
        }
        ToChannel::JobWatch { pid, offsets, timeout_ms } => {
            let until = Instant::now() + Duration::from_millis(timeout_ms.min(JOB_WAIT_MAX_MS));
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.job_watch(pid, offsets, until).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Job(r))?;
        }
        ToChannel::JobStdin { pid, data, eof } => {
            let until = Instant::now() + JOB_STDIN_WAIT;
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.job_stdin(pid, &data, eof, until).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Job(r))?;
        }
        ToChannel::FsWatch { since, timeout_ms } => {
            let until = Instant::now() + Duration::from_millis(timeout_ms.min(JOB_WAIT_MAX_MS));
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.fs_watch(since, until).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::FsChanges(r))?;
        }
        ToChannel::Usage => {
            let r = match ch.sb.as_ref() {
                Some(sb) => Ok(sb.usage()),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Usage(r))?;
        }
        ToChannel::JobResize { pid, rows, cols } => {
            let r = match ch.sb.as_mut() {
                Some(sb) => sb.job_resize(pid, rows, cols).map_err(|e| wire(e, None)),
                None => Err(no_sandbox()),
            };
            reply(&FromChannel::Job(r))?;
        }
        // Out of place (they belong inside a request): the API process broke the protocol.
        ToChannel::Packs | ToChannel::Abort { .. } | ToChannel::CheckpointGo => return Err(Stop::Gone),
    }
    Ok(())
}

/// How a checkpoint's admission round trip ended, when not with files.
enum Admit {
    Engine(EngineError),
    Refused,
    Broken,
}

impl From<EngineError> for Admit {
    fn from(e: EngineError) -> Admit {
        Admit::Engine(e)
    }
}

impl From<ProtocolError> for Admit {
    fn from(_: ProtocolError) -> Admit {
        Admit::Broken
    }
}

#[allow(clippy::too_many_arguments)]
fn start(
    shared: &Shared,
    ch: &mut Channel,
    sock: &UnixStream,
    template: &crate::protocol::TemplateRef,
    limits: forkbox_engine::Limits,
    how: ResumeAs,
    from: Option<StartFrom>,
    broken: &mut bool,
) -> Result<(), EngineError> {
    ch.sb = None;
    let t0 = Instant::now();
    let (engine, t) = lock(&shared.templates).get(template)?;
    let sb = match from {
        None if how == ResumeAs::Throwaway => t.fork(&engine, limits)?,
        None => t.fork_tracked(&engine, limits)?,
        Some(StartFrom { layers, state }) => {
            let mut parsed = Vec::with_capacity(layers.len());
            for n in &layers {
                let mut f = take(&mut ch.files, n)?;
                parsed.push(Layer::read_from(&mut f, n)?);
            }
            let state_file = take(&mut ch.files, &state)?;
            tracing::debug!(layers = parsed.len(), elapsed = ?t0.elapsed(), "read the layer chain");
            let files = &mut ch.files;
            let mut packs = |names: &[String]| -> Result<HashMap<String, File>, EngineError> {
                let lost = |e: ProtocolError| EngineError::Protocol(format!("asking for the packs: {e}"));
                if let Err(e) = protocol::write(&mut &*sock, &FromChannel::NeedPacks(names.to_vec())) {
                    *broken = true;
                    return Err(lost(e));
                }
                loop {
                    let (msg, fds) = match protocol::read_fds::<ToChannel>(sock, FDS_PER_FRAME) {
                        Ok(m) => m,
                        Err(e) => {
                            *broken = true;
                            return Err(lost(e));
                        }
                    };
                    match msg {
                        ToChannel::Files { names } if names.len() == fds.len() => {
                            for (n, fd) in names.into_iter().zip(fds) {
                                files.insert(n, File::from(fd));
                            }
                        }
                        ToChannel::Packs => break,
                        ToChannel::Abort { message } => {
                            return Err(EngineError::Snapshot(StateError::Corrupt(message)));
                        }
                        _ => {
                            *broken = true;
                            return Err(EngineError::Protocol("an unexpected frame among the packs".into()));
                        }
                    }
                }
                let mut out = HashMap::with_capacity(names.len());
                for n in names {
                    out.insert(n.clone(), take(files, n)?);
                }
                Ok(out)
            };
            t.resume_from(&engine, &parsed, &state_file, &state, &mut packs, limits, how)?
        }
    };
    let mut sb = sb;
    // A session's sandbox keeps what its calls leave running; a throwaway look does not.
    sb.set_keep_running(how != ResumeAs::Throwaway);
    // Its way out is the broker's (no round trip unless the guest opens a socket).
    sb.set_egress(Arc::new(Brokered::new(Arc::clone(&shared.link), ch.id)));
    ch.sb = Some(sb);
    ch.template = Some((engine, t));
    Ok(())
}

/// Mount packages the API process resolved: each layer from the jail's package store.
fn install(
    ch: &mut Channel,
    packages: &[PackageRef],
) -> Result<Vec<forkbox_engine::packages::InstalledPackage>, EngineError> {
    let (Some(sb), Some((engine, _))) = (ch.sb.as_mut(), ch.template.as_ref()) else {
        return Err(EngineError::Protocol("no sandbox on this channel".into()));
    };
    let store = engine.packages.get().ok_or_else(|| EngineError::Protocol("no package store".into()))?;
    let mut pkgs = Vec::with_capacity(packages.len());
    for p in packages {
        let layer = store.open_layer(&p.sha256)?;
        pkgs.push(forkbox_engine::packages::Package {
            name: p.name.clone(),
            version: p.version.clone(),
            wheel: p.wheel.clone(),
            sha256: p.sha256.clone(),
            size: p.size,
            layer,
        });
    }
    sb.install_packages(&pkgs)
}
