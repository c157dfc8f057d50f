//! The egress broker: the way out of a worker's sandboxes, kept in the API
//! process. A worker's VMM does not decide a destination or a name itself:
//! its `NetIo` asks a [`Brokered`] egress, which asks the broker over an
//! AF_UNIX socket; the broker holds the policy of each sandbox of that worker
//! ([`Policies`]: registered by the API process from what it sent the worker,
//! never from anything the worker says), decides, opens the host socket
//! (a TCP connect started, non-blocking) and passes it back with
//! `SCM_RIGHTS`, or refuses with the verdict the guest's note shows. Names are
//! resolved by the broker too ([`Gate`]: the static map, the cache, host
//! lookups under the sandbox's limits), answered when done without blocking
//! anyone: the worker's sandbox thread waits on an eventfd, as for lookups in
//! process.
//!
//! Frames are those of [`crate::protocol`] (a u32 length, JSON), the
//! worker's ones capped at [`REQUEST_MAX`] bytes and read without a control
//! buffer (a descriptor a worker tries to pass is closed by the kernel).

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use forkbox_linux::errno::Errno;
use forkbox_linux::net::resolver::Lookup;
use forkbox_linux::net::{
    dns, egress, secrets, Egress, Gate, NetConfig, Opened, Refused, Resolution, Resolved, Verdict,
};
use serde::{Deserialize, Serialize};
use socket2::Socket;

use crate::protocol::{self, ProtocolError};

/// Largest request a worker may send (a host name is at most 255 bytes).
pub const REQUEST_MAX: usize = 4096;
/// Longest name the broker looks up.
const NAME_MAX: usize = 255;
/// Lookups one worker may have waiting at the broker, over all its sandboxes.
const WAITING_MAX: usize = 256;
/// How long a sandbox thread waits for the broker's answer to a connect.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Answers to lookups a brokered egress keeps for its questions.
const ANSWERS_KEPT: usize = 64;

/// A worker's request.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToBroker {
    /// A TCP connection from a socket of `domain` (AF_INET/AF_INET6).
    Connect {
        req: u64,
        sandbox: u64,
        domain: i32,
        dest: SocketAddr,
    },
    /// A UDP flow: a host socket connected to `dest`.
    Udp {
        req: u64,
        sandbox: u64,
        domain: i32,
        dest: SocketAddr,
    },
    Lookup {
        req: u64,
        sandbox: u64,
        name: String,
    },
    /// End the sandbox's lookups now (SERVFAIL).
    Cancel {
        sandbox: u64,
    },
}

/// The broker's answer to request `req`.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromBroker {
    /// The socket comes with this frame (a TCP connect: done or in progress).
    Opened {
        req: u64,
        connected: bool,
    },
    Refused {
        req: u64,
        verdict: Verdict,
    },
    /// Allowed, but the host failed (its errno).
    Failed {
        req: u64,
        errno: i32,
    },
    Resolved {
        req: u64,
        resolved: Resolved,
    },
}

impl FromBroker {
    fn req(&self) -> u64 {
        match self {
            FromBroker::Opened { req, .. }
            | FromBroker::Refused { req, .. }
            | FromBroker::Failed { req, .. }
            | FromBroker::Resolved { req, .. } => *req,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("a {0}-byte request is over the {REQUEST_MAX}-byte limit")]
    TooLarge(usize),
    #[error("polling the worker's socket: {0}")]
    Poll(std::io::Error),
}

/// The policy of each sandbox of one worker, by the id the API process gave
/// the sandbox (shared by the code that starts the sandbox and the thread
/// serving the worker).
#[derive(Debug, Default)]
pub struct Policies {
    gates: Mutex<HashMap<u64, Arc<Mutex<Gate>>>>,
}

impl Policies {
    /// `sandbox` may go out under `config` (its whole policy: every layer).
    pub fn register(&self, sandbox: u64, config: NetConfig) {
        let gate = Arc::new(Mutex::new(Gate::new(Arc::new(config))));
        self.gates.lock().unwrap_or_else(|e| e.into_inner()).insert(sandbox, gate);
    }

    /// `sandbox` is gone: nothing more goes out for it.
    pub fn unregister(&self, sandbox: u64) {
        if let Some(g) = self.gates.lock().unwrap_or_else(|e| e.into_inner()).remove(&sandbox) {
            lock(&g).cancel_lookups();
        }
    }

    fn gate(&self, sandbox: u64) -> Option<Arc<Mutex<Gate>>> {
        self.gates.lock().unwrap_or_else(|e| e.into_inner()).get(&sandbox).cloned()
    }
}

fn lock(g: &Mutex<Gate>) -> std::sync::MutexGuard<'_, Gate> {
    g.lock().unwrap_or_else(|e| e.into_inner())
}

fn unknown() -> Verdict {
    Verdict { allowed: false, reason: "no policy for this sandbox".into(), names: Vec::new() }
}

/// Read one request: capped before anything is allocated, no descriptors.
fn read_request(sock: &mut &UnixStream) -> Result<ToBroker, BrokerError> {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).map_err(ProtocolError::from)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > REQUEST_MAX {
        return Err(BrokerError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).map_err(ProtocolError::from)?;
    Ok(serde_json::from_slice(&body).map_err(ProtocolError::from)?)
}

/// Serve one worker's requests until it closes its end (or breaks the
/// protocol: the error says how). Runs on a thread of the API process.
pub fn serve(sock: UnixStream, policies: Arc<Policies>) -> Result<(), BrokerError> {
    let _ = sock.set_write_timeout(Some(ANSWER_TIMEOUT));
    // Lookups under way: the request, the sandbox's gate, the lookup.
    let mut waiting: Vec<(u64, Arc<Mutex<Gate>>, Arc<Lookup>)> = Vec::new();
    loop {
        let mut fds = vec![libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        fds.extend(waiting.iter().map(|(_, _, l)| libc::pollfd { fd: l.fd(), events: libc::POLLIN, revents: 0 }));
        // SAFETY: `fds` is a valid array of its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(BrokerError::Poll(e));
        }
        let mut k = 0;
        while k < waiting.len() {
            if waiting[k].2.is_done() {
                let (req, gate, l) = waiting.swap_remove(k);
                let resolved = lock(&gate).finish(&l);
                protocol::write(&mut &sock, &FromBroker::Resolved { req, resolved })?;
            } else {
                k += 1;
            }
        }
        if fds[0].revents == 0 {
            continue;
        }
        let request = match read_request(&mut &sock) {
            Ok(r) => r,
            Err(BrokerError::Protocol(e)) if e.is_closed() => return Ok(()),
            Err(e) => return Err(e),
        };
        match request {
            ToBroker::Connect { req, sandbox, domain, dest } | ToBroker::Udp { req, sandbox, domain, dest } => {
                let tcp = matches!(request, ToBroker::Connect { .. });
                let gate = policies.gate(sandbox);
                let verdict = gate.as_ref().map_or_else(unknown, |g| lock(g).decide(dest));
                if !verdict.allowed {
                    protocol::write(&mut &sock, &FromBroker::Refused { req, verdict })?;
                    continue;
                }
                let opened = if tcp {
                    // A connection a secret is bound to comes back relayed by this process.
                    let config = gate.as_ref().map(|g| Arc::clone(lock(g).config()));
                    let secrets = config.as_ref().map_or(&[][..], |c| &c.secrets[..]);
                    secrets::open_tcp(secrets, &verdict, domain, dest)
                } else {
                    egress::open_udp(domain, dest).map(|socket| Opened { socket, connected: true })
                };
                match opened {
                    Ok(Opened { socket, connected }) => {
                        protocol::write_fds(&sock, &FromBroker::Opened { req, connected }, &[socket.as_fd()])?
                    }
                    Err(e) => protocol::write(&mut &sock, &FromBroker::Failed { req, errno: e.0 })?,
                }
            }
            ToBroker::Lookup { req, sandbox, name } => {
                let resolved = match policies.gate(sandbox) {
                    None => Resolved { rcode: dns::RCODE_REFUSED, note: Some(unknown().reason), ..Resolved::default() },
                    Some(_) if name.len() > NAME_MAX => Resolved { rcode: dns::RCODE_FORMERR, ..Resolved::default() },
                    Some(gate) => {
                        let step = lock(&gate).begin(&name);
                        match step {
                            Resolution::Done(r) => r,
                            Resolution::Wait(_) if waiting.len() >= WAITING_MAX => {
                                Resolved { rcode: dns::RCODE_SERVFAIL, ..Resolved::default() }
                            }
                            Resolution::Wait(l) => {
                                waiting.push((req, gate, l));
                                continue;
                            }
                        }
                    }
                };
                protocol::write(&mut &sock, &FromBroker::Resolved { req, resolved })?;
            }
            ToBroker::Cancel { sandbox } => {
                if let Some(g) = policies.gate(sandbox) {
                    lock(&g).cancel_lookups();
                }
            }
        }
    }
}

/// Where the broker's answer to a lookup goes once it is in.
type Answer = Arc<Mutex<Option<Resolved>>>;

/// A question to the broker a sandbox thread waits for, or a lookup whose
/// answer completes a local [`Lookup`].
enum Waiter {
    Answer(SyncSender<(FromBroker, Option<OwnedFd>)>),
    Lookup(Arc<Lookup>, Answer),
}

/// The worker's end of the broker's socket, shared by its sandboxes: one
/// thread reads the answers and hands each to whoever asked.
pub struct Link {
    sock: Mutex<UnixStream>,
    next: AtomicU64,
    waiters: Mutex<HashMap<u64, Waiter>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").finish_non_exhaustive()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // The reader thread holds a clone: shut the socket down so the broker
        // and that thread both see its end.
        let _ = self.sock.lock().unwrap_or_else(|e| e.into_inner()).shutdown(std::net::Shutdown::Both);
    }
}

impl Link {
    /// Start reading answers on `sock` (a thread of its own).
    pub fn start(sock: UnixStream) -> std::io::Result<Arc<Link>> {
        let reader = sock.try_clone()?;
        let link = Arc::new(Link { sock: Mutex::new(sock), next: AtomicU64::new(1), waiters: Mutex::default() });
        let weak = Arc::downgrade(&link);
        std::thread::Builder::new().name("forkbox-egress-link".into()).spawn(move || loop {
            let Ok((answer, mut fds)) = protocol::read_fds::<FromBroker>(&reader, 1) else {
                // The broker is gone: every question waiting fails.
                if let Some(l) = weak.upgrade() {
                    l.fail_all();
                }
                return;
            };
            let Some(link) = weak.upgrade() else { return };
            link.deliver(answer, fds.pop());
        })?;
        Ok(link)
    }

    fn waiters(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Waiter>> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn deliver(&self, answer: FromBroker, fd: Option<OwnedFd>) {
        let Some(w) = self.waiters().remove(&answer.req()) else { return };
        match w {
            Waiter::Answer(tx) => {
                let _ = tx.try_send((answer, fd));
            }
            Waiter::Lookup(l, slot) => {
                let resolved = match answer {
                    FromBroker::Resolved { resolved, .. } => resolved,
                    _ => Resolved { rcode: dns::RCODE_SERVFAIL, ..Resolved::default() },
                };
                let outcome =
                    if resolved.rcode == dns::RCODE_OK { Ok(resolved.addrs.clone()) } else { Err(resolved.rcode) };
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(resolved);
                l.complete(outcome);
            }
        }
    }

    fn fail_all(&self) {
        for (_, w) in self.waiters().drain() {
            if let Waiter::Lookup(l, _) = w {
                l.cancel();
            }
            // An `Answer` waiter sees its sender dropped.
        }
    }

    fn send(&self, msg: &ToBroker) -> Result<(), ProtocolError> {
        let mut s = self.sock.lock().unwrap_or_else(|e| e.into_inner());
        protocol::write(&mut *s, msg)
    }

    fn req(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Ask and wait for the answer (the broker answers connects and UDP
    /// flows at once: one round trip).
    fn ask(&self, make: impl FnOnce(u64) -> ToBroker) -> Option<(FromBroker, Option<OwnedFd>)> {
        let req = self.req();
        let (tx, rx) = sync_channel(1);
        self.waiters().insert(req, Waiter::Answer(tx));
        if self.send(&make(req)).is_err() {
            self.waiters().remove(&req);
            return None;
        }
        let got = rx.recv_timeout(ANSWER_TIMEOUT).ok();
        self.waiters().remove(&req);
        got
    }
}

/// The egress of one sandbox in a worker: everything goes through the
/// broker under the id the API process gave the sandbox.
#[derive(Debug)]
pub struct Brokered {
    link: Arc<Link>,
    sandbox: u64,
    /// Recent lookups (name, local lookup, the broker's answer once in).
    lookups: Mutex<VecDeque<(String, Arc<Lookup>, Answer)>>,
}

impl Brokered {
    pub fn new(link: Arc<Link>, sandbox: u64) -> Brokered {
        Brokered { link, sandbox, lookups: Mutex::default() }
    }

    fn unavailable() -> Verdict {
        Verdict { allowed: false, reason: "the egress broker did not answer".into(), names: Vec::new() }
    }
}

impl Egress for Brokered {
    fn connect(&self, domain: i32, dest: SocketAddr) -> Result<Opened, Refused> {
        let sandbox = self.sandbox;
        match self.link.ask(|req| ToBroker::Connect { req, sandbox, domain, dest }) {
            Some((FromBroker::Opened { connected, .. }, Some(fd))) => {
                Ok(Opened { socket: Socket::from(fd), connected })
            }
            Some((FromBroker::Refused { verdict, .. }, _)) => Err(Refused::Policy(verdict)),
            Some((FromBroker::Failed { errno, .. }, _)) => Err(Refused::Host(Errno(errno))),
            _ => Err(Refused::Policy(Brokered::unavailable())),
        }
    }

    fn udp(&self, domain: i32, dest: SocketAddr) -> Result<Socket, Refused> {
        let sandbox = self.sandbox;
        match self.link.ask(|req| ToBroker::Udp { req, sandbox, domain, dest }) {
            Some((FromBroker::Opened { .. }, Some(fd))) => Ok(Socket::from(fd)),
            Some((FromBroker::Refused { verdict, .. }, _)) => Err(Refused::Policy(verdict)),
            Some((FromBroker::Failed { errno, .. }, _)) => Err(Refused::Host(Errno(errno))),
            _ => Err(Refused::Policy(Brokered::unavailable())),
        }
    }

    fn lookup(&self, name: &str) -> Resolution {
        let mut lookups = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, l, _)) = lookups.iter().find(|(n, l, _)| n == name && !l.is_done()) {
            return Resolution::Wait(Arc::clone(l));
        }
        let Some(l) = Lookup::new(name) else {
            return Resolution::Done(Resolved { rcode: dns::RCODE_SERVFAIL, ..Resolved::default() });
        };
        let slot = Arc::new(Mutex::new(None));
        let req = self.link.req();
        self.link.waiters().insert(req, Waiter::Lookup(Arc::clone(&l), Arc::clone(&slot)));
        let sandbox = self.sandbox;
        if self.link.send(&ToBroker::Lookup { req, sandbox, name: name.to_string() }).is_err() {
            self.link.waiters().remove(&req);
            return Resolution::Done(Resolved { rcode: dns::RCODE_SERVFAIL, ..Resolved::default() });
        }
        if lookups.len() >= ANSWERS_KEPT {
            lookups.pop_front();
        }
        lookups.push_back((name.to_string(), Arc::clone(&l), slot));
        Resolution::Wait(l)
    }

    fn finish(&self, lookup: &Lookup) -> Resolved {
        let lookups = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let answer = lookups
            .iter()
            .find(|(_, l, _)| std::ptr::eq(Arc::as_ptr(l), lookup))
            .and_then(|(_, _, slot)| slot.lock().unwrap_or_else(|e| e.into_inner()).clone());
        answer.unwrap_or(Resolved { rcode: dns::RCODE_SERVFAIL, ..Resolved::default() })
    }

    fn cancel_lookups(&self) {
        let _ = self.link.send(&ToBroker::Cancel { sandbox: self.sandbox });
        for (_, l, _) in self.lookups.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            l.cancel();
        }
    }
}
