//! The typed protocol between the API process and a sandbox worker, on one
//! Unix stream socket: frames of a little-endian u32 length and that many
//! bytes of JSON. The supervisor reads what a worker sends as hostile (a
//! worker runs guest input): every frame's length is capped before anything is
//! allocated, every value is checked where it is used.

use std::io::{Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use forkbox_engine::packages::InstalledPackage;
use forkbox_engine::{
    CapturedOutput, CheckpointSize, CheckpointStats, ExecResult, FileEntry, JobInfo, Limits, ListeningPort, ResumeAs,
    Stream,
};
use forkbox_sessions::host::Walk;

/// Largest frame either side accepts: an exec result holds at most the output
/// limits (stdout, stderr, value: a few MiB) plus 8 MiB of `/output` files and
/// 8 MiB of rich outputs, base64 in JSON.
pub const FRAME_MAX: usize = 96 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("the worker socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("a {0}-byte frame is over the {FRAME_MAX}-byte limit")]
    TooLarge(usize),
    #[error("an unreadable frame: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("a frame with {got} file descriptors, at most {max} may come with it")]
    Descriptors { got: usize, max: usize },
}

impl ProtocolError {
    /// The peer closed the socket (or the worker died).
    pub fn is_closed(&self) -> bool {
        matches!(self, ProtocolError::Io(e) if matches!(e.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset))
    }

    /// A read timeout passed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, ProtocolError::Io(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }
}

pub fn write<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), ProtocolError> {
    let body = serde_json::to_vec(msg)?;
    if body.len() > FRAME_MAX {
        return Err(ProtocolError::TooLarge(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| ProtocolError::TooLarge(body.len()))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    Ok(())
}

pub fn read<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, ProtocolError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > FRAME_MAX {
        return Err(ProtocolError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// Most descriptors that come with one frame (a session worker's sockets).
pub const FDS_PER_FRAME: usize = 64;

/// Write a frame with `fds` (SCM_RIGHTS, at most [`FDS_PER_FRAME`]) attached
/// to its first byte: the API process to a session worker, never the other way.
pub fn write_fds<T: Serialize>(sock: &UnixStream, msg: &T, fds: &[BorrowedFd<'_>]) -> Result<(), ProtocolError> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    if fds.len() > FDS_PER_FRAME {
        return Err(ProtocolError::Descriptors { got: fds.len(), max: FDS_PER_FRAME });
    }
    if fds.is_empty() {
        return write(&mut &*sock, msg);
    }
    let body = serde_json::to_vec(msg)?;
    if body.len() > FRAME_MAX {
        return Err(ProtocolError::TooLarge(body.len()));
    }
    let len = u32::try_from(body.len()).map_err(|_| ProtocolError::TooLarge(body.len()))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_FRAME))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(ProtocolError::Descriptors { got: fds.len(), max: FDS_PER_FRAME });
    }
    let sent = sendmsg(sock, &[std::io::IoSlice::new(&frame)], &mut control, SendFlags::NOSIGNAL)
        .map_err(|e| ProtocolError::Io(e.into()))?;
    // The descriptors went with the first byte; the rest (a large frame) plainly.
    (&*sock).write_all(&frame[sent..])?;
    Ok(())
}

/// Read a frame and the descriptors that came with it (at most `max_fds`,
/// which are received close-on-exec; more, or a truncated control message,
/// is an error and the extra ones are closed).
pub fn read_fds<T: DeserializeOwned>(sock: &UnixStream, max_fds: usize) -> Result<(T, Vec<OwnedFd>), ProtocolError> {
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    recv_exact(sock, &mut len, &mut fds, max_fds)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > FRAME_MAX {
        return Err(ProtocolError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    recv_exact(sock, &mut body, &mut fds, max_fds)?;
    Ok((serde_json::from_slice(&body)?, fds))
}

fn recv_exact(sock: &UnixStream, mut buf: &mut [u8], fds: &mut Vec<OwnedFd>, max: usize) -> Result<(), ProtocolError> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    while !buf.is_empty() {
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_FRAME))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = match recvmsg(sock, &mut [std::io::IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(r) => r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(ProtocolError::Io(e.into())),
        };
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if got.flags.contains(ReturnFlags::CTRUNC) || fds.len() > max {
            return Err(ProtocolError::Descriptors { got: fds.len().max(max + 1), max });
        }
        if got.bytes == 0 {
            return Err(ProtocolError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        buf = &mut buf[got.bytes..];
    }
    Ok(())
}

/// A host path made visible in the worker's root, read-only.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Bind {
    pub host: PathBuf,
    /// Absolute path inside the jail.
    pub jail: String,
}

/// What a worker is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// One-shot execs, one at a time ([`ToWorker`]).
    #[default]
    Exec,
    /// The sessions of one tenant: a control socket ([`ToSessions`]) and one
    /// socket and thread per sandbox ([`ToChannel`]).
    Sessions,
}

/// The first frame to a new worker: how to jail itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub index: u32,
    pub role: Role,
    /// The largest file the worker may write (RLIMIT_FSIZE; 0: no bound): what
    /// it can put into a checkpoint file it was given, and its memfds.
    pub max_file_bytes: u64,
    /// Jail (namespaces, pivot_root, an unprivileged uid, no capabilities);
    /// false only for tests of the protocol on hosts that cannot.
    pub jail: bool,
    /// The host uid and gid the worker runs as (root inside its user namespace, with no capabilities).
    pub uid: u32,
    /// An empty directory the worker mounts its root on (in its own mount namespace).
    pub root: PathBuf,
    pub binds: Vec<Bind>,
    /// The seccomp filter's mode.
    pub seccomp: forkbox_engine::jail::Mode,
    /// The worker's memory bound (its cgroup), bytes; 0: none.
    pub memory_bytes: u64,
    /// Tasks (threads) the worker may have (its cgroup and RLIMIT_NPROC).
    pub max_tasks: u64,
    /// An empty network namespace of its own (no interface but a down `lo`):
    /// the worker's sandboxes reach the network only through the egress
    /// broker. False only for protocol tests on hosts that cannot.
    pub own_network: bool,
    /// Honour [`TEST_FORBIDDEN_SYSCALL`] (the server's `FORKBOX_WORKER_TEST_ACTIONS=1`).
    pub test_actions: bool,
}

/// Code that, with `Hello::test_actions`, makes the worker issue a system call
/// its seccomp filter forbids (tests: a filter kill is contained to the worker).
pub const TEST_FORBIDDEN_SYSCALL: &str = "#forkbox-test: forbidden-syscall";

/// Code that, with `Hello::test_actions`, makes the worker open an AF_INET
/// socket of its own (tests: a worker has no network; its filter kills it).
pub const TEST_INET_SOCKET: &str = "#forkbox-test: inet-socket";

/// A template as the worker opens it: paths inside its jail.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct TemplateRef {
    pub image: String,
    pub dir: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    /// Answered at once with `Pong` (a liveness probe; the bench's socket round trip).
    Ping,
    /// Open the template (its VM pool warm) before the first exec needs it.
    Prepare { template: TemplateRef },
    /// Fork the template, run `code`, reply; the fork is dropped after the reply.
    /// `sandbox`: the fork's id at the worker's egress broker.
    /// `prelude`: run in the fork before `code` (a secret's placeholder into its environment).
    Exec { template: TemplateRef, prelude: Option<String>, code: String, limits: Limits, stream: bool, sandbox: u64 },
}

/// An exec's failure as the worker reports it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireError {
    /// An `ErrorCode` name (the supervisor accepts only an exec's codes).
    pub code: String,
    pub message: String,
    pub output: Option<CapturedOutput>,
}

/// What one exec moved on the network (added to the API process' counters).
pub use forkbox_linux::net::NetCounts as NetDelta;

#[derive(Debug, Serialize, Deserialize)]
pub struct Done {
    pub result: Result<ExecResult, WireError>,
    pub fork_ms: f64,
    pub exec_ms: f64,
    pub net: NetDelta,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    /// From the worker's launcher: the host pid of the jailed worker.
    Started {
        pid: u32,
    },
    /// The jail is entered and the filter installed: requests may come.
    Ready,
    Prepared(Result<(), WireError>),
    Pong,
    /// Output as the guest writes it (only for `stream: true`).
    Output {
        stream: Stream,
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    Done(Box<Done>),
    /// After `Done`: the exec's fork is torn down (its VM reset for reuse),
    /// the worker reads the next request.
    Idle,
}

/// The control socket of a session worker (its fd 3 once it is `Ready`).
#[derive(Debug, Serialize, Deserialize)]
pub enum ToSessions {
    /// Open the template (answered with `FromWorker::Prepared`).
    Prepare { template: TemplateRef },
    /// A new sandbox channel: the worker's end of a socket pair comes with this frame.
    Channel { id: u64 },
    /// Ctrl-C for exec number `exec` of channel `id`.
    Interrupt { id: u64, exec: u64 },
    /// Stop (`true`) or let run again (`false`) the background work of every
    /// sandbox of the worker between requests: its tenant's CPU budget is spent.
    /// Requests are still served.
    Throttle { on: bool },
}

/// A package to mount: its layer is the wheel's sha256, a layer of the
/// data directory's `packages` (read-only in the worker's jail).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PackageRef {
    pub name: String,
    pub version: String,
    pub wheel: String,
    pub sha256: String,
    pub size: u64,
}

/// A checkpoint to bring back: its files by the names of a `Files` frame.
#[derive(Debug, Serialize, Deserialize)]
pub struct StartFrom {
    /// Newest first.
    pub layers: Vec<String>,
    pub state: String,
}

/// Requests on a sandbox channel (one sandbox, one at a time).
#[derive(Debug, Serialize, Deserialize)]
pub enum ToChannel {
    /// The descriptors that come with this frame, by name, kept for the next request.
    Files {
        names: Vec<String>,
    },
    /// Make the sandbox (answered `Started`; a resume may first ask `NeedPacks`).
    Start {
        template: TemplateRef,
        limits: Limits,
        how: ResumeAs,
        from: Option<StartFrom>,
    },
    /// The packs asked for came in `Files` frames: go on.
    Packs,
    /// A `NeedPacks` or `CheckpointSize` is refused: stop that request (no answer).
    Abort {
        message: String,
    },
    Exec {
        code: String,
        /// This channel's exec number (what `ToSessions::Interrupt` names).
        exec: u64,
        exec_id: Option<i64>,
        timeout_ms: Option<u64>,
        stream: bool,
        /// An interrupt came before the exec was sent.
        interrupted: bool,
        /// Processes the agent forks start background jobs (`ExecOptions::job`).
        #[serde(default)]
        job: bool,
        /// Run before `code` (`ExecOptions::prelude`).
        #[serde(default)]
        prelude: Option<String>,
    },
    /// The background jobs (answered `Jobs`).
    Jobs,
    /// The sandbox's listening TCP sockets (answered `ListeningPorts`).
    ListeningPorts,
    /// A slice of a job's stream (answered `JobOutput`).
    JobOutput {
        pid: u32,
        stream: Stream,
        offset: u64,
        max: u64,
    },
    /// Signal a job's processes (answered `Job`).
    JobSignal {
        pid: u32,
        signal: i32,
    },
    /// Run the sandbox until the job ends or `timeout_ms` passes (answered `Job`).
    JobWait {
        pid: u32,
        timeout_ms: u64,
    },
    /// Run the sandbox until the job wrote past `offsets` (stdout, stderr),
    /// ended, or `timeout_ms` passed (answered `Job`).
    JobWatch {
        pid: u32,
        offsets: [u64; 2],
        timeout_ms: u64,
    },
    /// Write to a job's stdin, then close it if `eof` (answered `Job`).
    JobStdin {
        pid: u32,
        #[serde(with = "b64")]
        data: Vec<u8>,
        eof: bool,
    },
    /// Resize the terminal of a job started on a pty (answered `Job`).
    JobResize {
        pid: u32,
        rows: u16,
        cols: u16,
    },
    /// Watch the file system's changes from `since` (None: stop), running the
    /// sandbox at most `timeout_ms` for one (answered `FsChanges`).
    FsWatch {
        since: Option<u64>,
        timeout_ms: u64,
    },
    /// What the sandbox uses now (answered `Usage`).
    Usage,
    /// Write the file `path` with the `len` bytes of the file handed over as
    /// "upload" in the `Files` frame before (answered `Done`).
    WriteFile {
        path: String,
        len: u64,
    },
    ReadFile {
        path: String,
        max: u64,
    },
    ListDir {
        path: String,
    },
    /// A file-system operation (stat, walk, mkdir, move, remove).
    FileOp(forkbox_engine::FileOp),
    Install {
        packages: Vec<PackageRef>,
    },
    Walk,
    /// Size a checkpoint (answered `CheckpointSize`, then, after `CheckpointGo`
    /// with the files "layer", "pack" (if any) and "state", `Checkpointed`).
    Checkpoint {
        pack_name: String,
    },
    CheckpointGo,
    /// Write the sandbox as a template into the files "memory" and "state".
    Snapshot {
        id: String,
        preload: String,
    },
    /// Hand the socket that comes with this frame (one end of a stream socket
    /// pair the API process made) to the sandbox's listener on `port` as an
    /// accepted connection (answered `PortConnected`).
    ConnectPort {
        port: u16,
    },
}

/// A session exec as a worker ran it.
#[derive(Debug, Serialize, Deserialize)]
pub struct SessionDone {
    pub result: Result<ExecResult, WireError>,
    pub net: NetDelta,
    /// Threads or processes the exec left running (they run on between calls).
    #[serde(default)]
    pub background: bool,
}

/// Answers on a sandbox channel.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromChannel {
    Started(Result<(), WireError>),
    /// The state names these packs: send them.
    NeedPacks(Vec<String>),
    Output {
        stream: Stream,
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    Executed(Box<SessionDone>),
    Done(Result<(), WireError>),
    File(Result<B64, WireError>),
    Listing(Result<Vec<FileEntry>, WireError>),
    FileOpDone(Result<forkbox_engine::FileOpOutcome, WireError>),
    Installed(Result<Vec<InstalledPackage>, WireError>),
    Walked(Result<Walk, WireError>),
    CheckpointSize(CheckpointSize),
    Checkpointed(Result<CheckpointStats, WireError>),
    /// The worker cannot serve this channel (too many sandboxes at once).
    Refused(String),
    Jobs(Result<Vec<JobInfo>, WireError>),
    Job(Result<JobInfo, WireError>),
    JobOutput(Result<WireChunk, WireError>),
    PortConnected(Result<(), WireError>),
    ListeningPorts(Result<Vec<ListeningPort>, WireError>),
    FsChanges(Result<Option<forkbox_engine::Changes>, WireError>),
    Usage(Result<forkbox_engine::Usage, WireError>),
}

/// A slice of a job's stream (`JobChunk`, its bytes in base64).
#[derive(Debug, Serialize, Deserialize)]
pub struct WireChunk {
    pub offset: u64,
    pub end: u64,
    #[serde(with = "b64")]
    pub data: Vec<u8>,
    pub running: bool,
}

impl FromChannel {
    /// The frame's name (what an error about an unexpected frame shows: never its contents).
    pub fn kind(&self) -> &'static str {
        match self {
            FromChannel::Started(_) => "Started",
            FromChannel::NeedPacks(_) => "NeedPacks",
            FromChannel::Output { .. } => "Output",
            FromChannel::Executed(_) => "Executed",
            FromChannel::Done(_) => "Done",
            FromChannel::File(_) => "File",
            FromChannel::Listing(_) => "Listing",
            FromChannel::FileOpDone(_) => "FileOpDone",
            FromChannel::Installed(_) => "Installed",
            FromChannel::Walked(_) => "Walked",
            FromChannel::CheckpointSize(_) => "CheckpointSize",
            FromChannel::Checkpointed(_) => "Checkpointed",
            FromChannel::Refused(_) => "Refused",
            FromChannel::Jobs(_) => "Jobs",
            FromChannel::Job(_) => "Job",
            FromChannel::JobOutput(_) => "JobOutput",
            FromChannel::PortConnected(_) => "PortConnected",
            FromChannel::ListeningPorts(_) => "ListeningPorts",
            FromChannel::FsChanges(_) => "FsChanges",
            FromChannel::Usage(_) => "Usage",
        }
    }
}

/// Bytes as base64 in JSON.
#[derive(Debug, Serialize, Deserialize)]
pub struct B64(#[serde(with = "b64")] pub Vec<u8>);

impl FromWorker {
    /// The frame's name (what an error about an unexpected frame shows: never its contents).
    pub fn kind(&self) -> &'static str {
        match self {
            FromWorker::Started { .. } => "Started",
            FromWorker::Ready => "Ready",
            FromWorker::Prepared(_) => "Prepared",
            FromWorker::Pong => "Pong",
            FromWorker::Output { .. } => "Output",
            FromWorker::Done(_) => "Done",
            FromWorker::Idle => "Idle",
        }
    }
}

pub(crate) mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD.decode(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let mut buf = Vec::new();
        write(&mut buf, &FromWorker::Output { stream: Stream::Stdout, data: vec![0, 255, 10] }).unwrap();
        match read::<FromWorker>(&mut buf.as_slice()).unwrap() {
            FromWorker::Output { stream, data } => {
                assert_eq!(stream, Stream::Stdout);
                assert_eq!(data, vec![0, 255, 10]);
            }
            other => panic!("{other:?}"),
        }
        let mut huge = ((FRAME_MAX + 1) as u32).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(read::<FromWorker>(&mut huge.as_slice()), Err(ProtocolError::TooLarge(_))));
        let short = 10u32.to_le_bytes();
        assert!(read::<FromWorker>(&mut short.as_slice()).unwrap_err().is_closed());
    }
}
