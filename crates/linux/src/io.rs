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

    pub fn push(&mut self, bytes: &[u8]) {
        let room = self.limit.saturating_sub(self.data.len());
        let keep = room.min(bytes.len());
        self.data.extend_from_slice(&bytes[..keep]);
        self.dropped += (bytes.len() - keep) as u64;
    }

    /// Take the captured text, with a marker if output was dropped.
    pub fn take(&mut self) -> (Vec<u8>, u64) {
        let dropped = std::mem::take(&mut self.dropped);
        (std::mem::take(&mut self.data), dropped)
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
pub struct Io {
    /// Bytes of the current request not yet read by the agent.
    pub agent_in: Vec<u8>,
    pub agent_in_pos: usize,
    /// What the agent wrote (its replies).
    pub agent_out: Vec<u8>,
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
    pub streamed: Vec<(Stream, Vec<u8>)>,
    /// Interrupts host-side waits (sleep, poll, select) of the current exec.
    pub interrupt: Option<Arc<InterruptLatch>>,
    /// Host sockets, the resolver and the egress policy of this sandbox.
    pub net: crate::net::NetIo,
}

impl Io {
    pub fn new(output_limit: usize) -> Io {
        Io { stdout: Capture::new(output_limit), stderr: Capture::new(output_limit), ..Default::default() }
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
        match stream {
            Stream::Stdout => self.stdout.push(data),
            Stream::Stderr => self.stderr.push(data),
        }
        if self.streaming && !data.is_empty() {
            self.streamed.push((stream, data.to_vec()));
        }
    }

    /// Queue a request for the agent (replaces anything unread).
    pub fn send_to_agent(&mut self, bytes: Vec<u8>) {
        self.agent_in = bytes;
        self.agent_in_pos = 0;
    }
}
