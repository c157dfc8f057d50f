//! The typed protocol between the API process and a sandbox worker, on one
//! Unix stream socket: frames of a little-endian u32 length and that many
//! bytes of JSON. The supervisor reads what a worker sends as hostile (a
//! worker runs guest input): every frame's length is capped before anything is
//! allocated, every value is checked where it is used.

use std::io::{Read, Write};
use std::path::PathBuf;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use forkbox_engine::{CapturedOutput, ExecResult, Limits, Stream};

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

/// A host path made visible in the worker's root, read-only.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Bind {
    pub host: PathBuf,
    /// Absolute path inside the jail.
    pub jail: String,
}

/// The first frame to a new worker: how to jail itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub index: u32,
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
    /// for servers whose egress policy is `none`, where no sandbox may reach
    /// anything. Otherwise the worker shares the host's (its sandboxes' sockets
    /// are host sockets, each connect decided by the egress policy).
    pub own_network: bool,
    /// Honour [`TEST_FORBIDDEN_SYSCALL`] (the server's `FORKBOX_WORKER_TEST_ACTIONS=1`).
    pub test_actions: bool,
}

/// Code that, with `Hello::test_actions`, makes the worker issue a system call
/// its seccomp filter forbids (tests: a filter kill is contained to the worker).
pub const TEST_FORBIDDEN_SYSCALL: &str = "#forkbox-test: forbidden-syscall";

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
    Exec { template: TemplateRef, code: String, limits: Limits, stream: bool },
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

mod b64 {
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
