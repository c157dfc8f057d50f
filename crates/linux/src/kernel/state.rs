//! What a running guest exchanges with the host: captured stdout/stderr, the
//! agent channel, the deadline, and syscall statistics. Unlike `Process`, this
//! is not part of the guest's state and is never snapshotted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use forkbox_vmm::InterruptLatch;

/// Which output stream a guest write went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A captured output stream, truncated past `limit` bytes (the rest is counted, not kept).
#[derive(Clone, Debug, Default)]
pub struct Capture {
    pub data: Vec<u8>,
    pub limit: usize,
    pub dropped: u64,
}

impl Capture {
    pub fn new(limit: usize) -> Capture {
        Capture { data: Vec::new(), limit, dropped: 0 }
    }

    /// Keep what fits under the limit; returns how many bytes of `bytes` were kept.
    pub fn push(&mut self, bytes: &[u8]) -> usize {
        let room = self.limit.saturating_sub(self.data.len());
        let keep = room.min(bytes.len());
        self.data.extend_from_slice(&bytes[..keep]);
        self.dropped = self.dropped.saturating_add((bytes.len() - keep) as u64);
        keep
    }

    /// Take the captured text, with a marker if output was dropped.
    pub fn take(&mut self) -> (Vec<u8>, u64) {
        let dropped = std::mem::take(&mut self.dropped);
        (std::mem::take(&mut self.data), dropped)
    }
}

/// The most of each stream a background job keeps (the oldest bytes go first).
pub const JOB_OUTPUT_BYTES: usize = 256 << 10;

/// The last bytes of a stream, by offset from the stream's start: a reader
/// asks from where it stopped and learns what was dropped meanwhile.
#[derive(Clone, Debug, Default)]
pub struct Ring {
    data: std::collections::VecDeque<u8>,
    /// The offset of `data[0]` in the stream.
    start: u64,
}

impl Ring {
    /// Append `bytes`, keeping the last `cap` bytes of the stream.
    pub fn push(&mut self, bytes: &[u8], cap: usize) {
        // A write longer than the ring: only its tail is kept, its head counts as dropped.
        let skip = bytes.len().saturating_sub(cap);
        let bytes = &bytes[skip..];
        let over = (self.data.len() + bytes.len()).saturating_sub(cap);
        self.data.drain(..over.min(self.data.len()));
        self.start = self.start.saturating_add(over as u64).saturating_add(skip as u64);
        self.data.extend(bytes);
    }

    /// The offset just past the last byte written.
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.data.len() as u64)
    }

    /// At most `max` bytes from offset `from` (or from the oldest kept byte
    /// when `from` was dropped): the offset they start at, and the bytes.
    pub fn read(&self, from: u64, max: usize) -> (u64, Vec<u8>) {
        let at = from.clamp(self.start, self.end());
        let skip = usize::try_from(at - self.start).unwrap_or(usize::MAX);
        (at, self.data.iter().skip(skip).take(max).copied().collect())
    }
}

/// Which syscalls a guest made, and which it asked for that we do not implement.
#[derive(Clone, Debug, Default)]
pub struct SyscallStats {
    pub total: u64,
    pub by_nr: BTreeMap<u64, u64>,
    pub unimplemented: BTreeMap<u64, u64>,
}

#[derive(Debug, Default)]
pub struct Kernel {
    /// Bytes of the current request not yet read by the agent.
    pub agent_in: Vec<u8>,
    pub agent_in_pos: usize,
    /// What the agent wrote (its replies), at most `agent_out_limit` bytes.
    pub agent_out: Vec<u8>,
    /// Cap on `agent_out` (a reply frame is bounded by the output limits; see
    /// `agent_frame_limit`). A write past it is refused and `agent_overflow` set.
    pub agent_out_limit: usize,
    /// The guest wrote more to the agent channel than `agent_out_limit`: the
    /// run loop ends the exec with a protocol error.
    pub agent_overflow: bool,
    pub stdout: Capture,
    pub stderr: Capture,
    pub deadline: Option<Instant>,
    pub stats: SyscallStats,
    /// Log every syscall (`forkbox run --trace-syscalls`).
    pub trace: bool,
    /// Forward every write to fd 1 / fd 2 into `streamed` as well (besides the
    /// captures, whose limits still apply), for the run loop to hand on.
    pub streaming: bool,
    /// Writes not yet handed on (drained by the run loop after each syscall).
    /// Only what the captures kept is streamed (the output limit applies to
    /// streams exactly as to results), then one truncation marker per stream.
    pub streamed: Vec<(Stream, Vec<u8>)>,
    /// A truncation marker was streamed for (stdout, stderr) in this exec.
    pub stream_marked: [bool; 2],
    /// Interrupts host-side waits (sleep, poll, select) of the current exec.
    pub interrupt: Option<Arc<InterruptLatch>>,
    /// Host sockets, the resolver and the egress policy of this sandbox.
    pub net: crate::net::NetIo,
    /// The sandbox's processes (pids, groups, zombies): shared by all of them.
    pub procs: crate::procs::ProcTable,
    /// Memory shared between the sandbox's processes (`shm.rs`).
    pub shm: crate::shm::ShmTable,
    /// flock(2) locks of the sandbox's processes (`flock.rs`).
    pub flocks: crate::flock::Flocks,
    /// The processes of background jobs, each with its job's leader pid:
    /// their writes to stdout/stderr go to the job's rings (none: dropped), not to a call's capture.
    pub jobs: BTreeMap<u32, u32>,
    /// Each job's (stdout, stderr), by leader pid.
    pub job_out: BTreeMap<u32, [Ring; 2]>,
    /// Each job's stdin, by leader pid: what its processes read from fd 0
    /// (the agent's `Stdin`, inherited) instead of end of file.
    pub job_in: BTreeMap<u32, JobStdin>,
}

/// The most bytes a job's stdin holds unread (a writer waits or is refused past it).
pub const JOB_STDIN_BYTES: usize = 256 << 10;

/// A job's stdin: bytes the host wrote that its processes have not read yet.
#[derive(Clone, Debug, Default)]
pub struct JobStdin {
    pub buf: std::collections::VecDeque<u8>,
    /// No more will come: a read of an empty buffer is end of file.
    pub closed: bool,
}

impl JobStdin {
    /// Room left before `JOB_STDIN_BYTES`.
    pub fn room(&self) -> usize {
        JOB_STDIN_BYTES.saturating_sub(self.buf.len())
    }
}

/// The marker streamed once a stream's output goes past the output limit
/// (the result's text ends with a marker that also counts the dropped bytes).
pub const STREAM_TRUNCATED: &[u8] = b"\n[forkbox: output truncated at the output limit; further output dropped]\n";

/// The largest reply frame the agent may write for `output_limit`: the value
/// repr, the exception message and the traceback are each cut to the output
/// limit (in characters) by the agent and by the host, and JSON can spell one
/// character in up to 6 bytes (`\u0000`), plus room for the framing.
pub fn agent_frame_limit(output_limit: usize) -> usize {
    output_limit.max(1 << 16).saturating_mul(3 * 6).saturating_add(1 << 16)
}

impl Kernel {
    pub fn new(output_limit: usize) -> Kernel {
        Kernel {
            stdout: Capture::new(output_limit),
            stderr: Capture::new(output_limit),
            agent_out_limit: agent_frame_limit(output_limit),
            ..Default::default()
        }
    }

    /// A guest write to the agent channel: kept if the reply stays under its
    /// cap, else refused (nothing is buffered past the cap).
    pub fn agent_write(&mut self, data: &[u8]) -> bool {
        if self.agent_overflow || self.agent_out.len().saturating_add(data.len()) > self.agent_out_limit {
            self.agent_overflow = true;
            return false;
        }
        self.agent_out.extend_from_slice(data);
        true
    }

    pub fn agent_pending(&self) -> usize {
        self.agent_in.len() - self.agent_in_pos
    }

    /// Move the network layer's notes (refused connects ...) to the guest's stderr.
    pub fn flush_net_notes(&mut self) {
        if self.net.notes.is_empty() {
            return;
        }
        for n in std::mem::take(&mut self.net.notes) {
            self.output(Stream::Stderr, n.as_bytes());
        }
    }

    /// Record a guest write to stdout or stderr.
    pub fn output(&mut self, stream: Stream, data: &[u8]) {
        let (kept, i) = match stream {
            Stream::Stdout => (self.stdout.push(data), 0),
            Stream::Stderr => (self.stderr.push(data), 1),
        };
        if !self.streaming {
            return;
        }
        if kept > 0 {
            self.streamed.push((stream, data[..kept].to_vec()));
        }
        if kept < data.len() && !self.stream_marked[i] {
            self.stream_marked[i] = true;
            self.streamed.push((stream, STREAM_TRUNCATED.to_vec()));
        }
    }

    /// A write to stdout/stderr by process `pid`: its job's (dropped if that
    /// job keeps no output), or the call's.
    pub fn output_from(&mut self, pid: u32, stream: Stream, data: &[u8]) {
        if let Some(leader) = self.jobs.get(&pid) {
            if let Some(rings) = self.job_out.get_mut(leader) {
                rings[stream as usize].push(data, JOB_OUTPUT_BYTES);
            }
            return;
        }
        self.output(stream, data);
    }

    /// The stdin process `pid` reads from fd 0 (the agent's `Stdin`): its
    /// job's, or none (end of file at once).
    pub fn stdin_of(&mut self, pid: u32) -> Option<&mut JobStdin> {
        let leader = *self.jobs.get(&pid)?;
        self.job_in.get_mut(&leader)
    }

    /// Is there something to read (or end of file) on process `pid`'s fd 0?
    pub fn stdin_ready(&self, pid: u32) -> bool {
        match self.jobs.get(&pid).and_then(|l| self.job_in.get(l)) {
            Some(s) => s.closed || !s.buf.is_empty(),
            None => true,
        }
    }

    /// Queue a request for the agent (replaces anything unread).
    pub fn send_to_agent(&mut self, bytes: Vec<u8>) {
        self.agent_in = bytes;
        self.agent_in_pos = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::Ring;

    #[test]
    fn a_ring_keeps_the_last_bytes_by_stream_offset() {
        let mut r = Ring::default();
        r.push(b"hello ", 8);
        r.push(b"world", 8);
        assert_eq!(r.end(), 11);
        // "hel" was dropped: a read from 0 starts at the oldest byte kept.
        assert_eq!(r.read(0, 100), (3, b"lo world".to_vec()));
        assert_eq!(r.read(9, 100), (9, b"ld".to_vec()));
        assert_eq!(r.read(5, 2), (5, b" w".to_vec()));
        assert_eq!(r.read(50, 10), (11, Vec::new()));
        // One write larger than the ring keeps its tail.
        r.push(b"0123456789abc", 8);
        assert_eq!(r.read(0, 100), (16, b"56789abc".to_vec()));
        assert_eq!(r.end(), 24);
    }
}
