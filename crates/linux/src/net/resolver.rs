//! The VMM's upstream resolver: names the VMM cannot answer itself (static
//! map, cache, policy) are looked up by a small fixed pool of threads shared
//! by every sandbox of the process, which ask the host's nameservers
//! directly (UDP, TCP when an answer is truncated), every lookup bounded in
//! time. A sandbox thread never waits on the host's DNS: it gets a [`Lookup`]
//! whose eventfd becomes readable when the outcome is in, and the guest's wait
//! for the answer goes through the engine like any other blocking call, so the
//! exec's deadline and the interrupt end it.
//!
//! The nameservers: [`set_upstream`] (tests, an embedding program), else
//! `FORKBOX_DNS_SERVERS` (`ip`, `ip:port` or `[v6]:port`, comma-separated),
//! else the `nameserver` lines of the host's /etc/resolv.conf. The host's
//! /etc/hosts and nsswitch are not consulted (the sandbox's static host map is
//! the place for local names).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::str::FromStr;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};

use super::dns;

/// A lookup's outcome: the addresses, or the DNS rcode to answer with.
pub type Outcome = Result<Vec<IpAddr>, u8>;

/// Resolver threads per process (the global concurrency cap).
const THREADS: usize = 4;
/// Lookups waiting for a thread, process-wide; beyond, a lookup fails at once.
const QUEUE: usize = 256;
/// A lookup's whole time, queueing included: under the guest's own timeout
/// (`timeout:5` in its resolv.conf), so the guest hears SERVFAIL, not silence.
pub const BUDGET: Duration = Duration::from_secs(4);
/// One nameserver's time before the next is asked.
const PER_SERVER: Duration = Duration::from_secs(2);
/// Nameservers asked per lookup (as glibc's MAXNS).
const MAX_SERVERS: usize = 3;
/// How often a thread waiting on a nameserver looks whether its lookup was cancelled.
const SLICE: Duration = Duration::from_millis(100);
/// Largest answer read over UDP (we send no EDNS; a server may still send more than 512).
const UDP_MAX: usize = 4096;
/// /etc/resolv.conf is read again after this long.
const RESOLV_CONF_TTL: Duration = Duration::from_secs(30);

/// One name being looked up (A and AAAA together): completed once, by a
/// resolver thread or by a cancel; waiters wait on `ready` (an eventfd that
/// stays readable once written).
#[derive(Debug)]
pub struct Lookup {
    pub name: String,
    result: Mutex<Option<Outcome>>,
    ready: OwnedFd,
    /// When the lookup gives up (queueing included).
    expires: Instant,
}

impl Lookup {
    /// A lookup of `name` (lower-case, no trailing dot); None if no eventfd could be made.
    pub fn new(name: &str) -> Option<Arc<Lookup>> {
        // SAFETY: eventfd takes an initial value and flags only.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is a new descriptor that nothing else owns.
        let ready = unsafe { OwnedFd::from_raw_fd(fd) };
        Some(Arc::new(Lookup {
            name: name.to_string(),
            result: Mutex::new(None),
            ready,
            expires: Instant::now() + BUDGET,
        }))
    }

    pub fn outcome(&self) -> Option<Outcome> {
        self.result.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn is_done(&self) -> bool {
        self.result.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The fd that becomes readable when the lookup is done.
    pub fn fd(&self) -> RawFd {
        self.ready.as_raw_fd()
    }

    /// Complete with `r` unless already complete, and wake the waiters.
    pub fn complete(&self, r: Outcome) {
        {
            let mut g = self.result.lock().unwrap_or_else(|e| e.into_inner());
            if g.is_some() {
                return;
            }
            *g = Some(r);
        }
        let one: u64 = 1;
        // SAFETY: an eventfd takes an 8-byte write from a valid buffer.
        let _ = unsafe { libc::write(self.ready.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// End the lookup now with SERVFAIL (an interrupt of the exec).
    pub fn cancel(&self) {
        self.complete(Err(dns::RCODE_SERVFAIL));
    }

    /// Wait until done or `timeout` (for tests and callers that may block).
    pub fn wait(&self, timeout: Duration) -> Option<Outcome> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(r) = self.outcome() {
                return Some(r);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut p = libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, ms) };
        }
    }
}

struct Pool {
    tx: SyncSender<Arc<Lookup>>,
}

fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = sync_channel::<Arc<Lookup>>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..THREADS {
            let rx = Arc::clone(&rx);
            match std::thread::Builder::new().name(format!("forkbox-dns-{i}")).spawn(move || work(&rx)) {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(target: "forkbox::net", "starting a resolver thread: {e}"),
            }
        }
        (started > 0).then_some(Pool { tx })
    })
    .as_ref()
}

fn work(rx: &Mutex<Receiver<Arc<Lookup>>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(l) = next else { return };
        if l.is_done() {
            continue;
        }
        if Instant::now() >= l.expires {
            l.complete(Err(dns::RCODE_SERVFAIL));
            continue;
        }
        let r = lookup(&l, &upstream());
        l.complete(r);
    }
}

/// Hand `l` to the resolver threads; false when the process-wide queue is full.
pub fn submit(l: Arc<Lookup>) -> bool {
    let Some(p) = pool() else { return false };
    match p.tx.try_send(l) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => false,
    }
}

fn override_servers() -> &'static Mutex<Option<Vec<SocketAddr>>> {
    static OVERRIDE: Mutex<Option<Vec<SocketAddr>>> = Mutex::new(None);
    &OVERRIDE
}

/// Ask these nameservers from now on (None: `FORKBOX_DNS_SERVERS`, else /etc/resolv.conf).
pub fn set_upstream(servers: Option<Vec<SocketAddr>>) {
    *override_servers().lock().unwrap_or_else(|e| e.into_inner()) = servers;
}

/// `ip`, `ip:port` or `[v6]:port` (port 53 when none is given).
fn parse_server(s: &str) -> Option<SocketAddr> {
    let s = s.trim();
    SocketAddr::from_str(s).ok().or_else(|| IpAddr::from_str(s).ok().map(|ip| SocketAddr::new(ip, super::DNS_PORT)))
}

/// The `nameserver` lines of a resolv.conf (scoped IPv6 addresses skipped).
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next()).flatten()
        })
        .filter_map(|a| IpAddr::from_str(a).ok())
        .map(|ip| SocketAddr::new(ip, super::DNS_PORT))
        .take(MAX_SERVERS)
        .collect()
}

/// The nameservers to ask now.
pub fn upstream() -> Vec<SocketAddr> {
    if let Some(s) = override_servers().lock().unwrap_or_else(|e| e.into_inner()).clone() {
        return s;
    }
    static ENV: OnceLock<Option<Vec<SocketAddr>>> = OnceLock::new();
    let env = ENV.get_or_init(|| {
        let v = std::env::var("FORKBOX_DNS_SERVERS").ok()?;
        let list: Vec<SocketAddr> = v.split(',').filter(|s| !s.trim().is_empty()).filter_map(parse_server).collect();
        if list.is_empty() {
            tracing::warn!(target: "forkbox::net", "FORKBOX_DNS_SERVERS={v:?} names no nameserver; using /etc/resolv.conf");
            return None;
        }
        Some(list)
    });
    if let Some(s) = env {
        return s.clone();
    }
    static CONF: Mutex<Option<(Instant, Vec<SocketAddr>)>> = Mutex::new(None);
    let mut g = CONF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((t, s)) = g.as_ref() {
        if t.elapsed() < RESOLV_CONF_TTL {
            return s.clone();
        }
    }
    let s = std::fs::read_to_string("/etc/resolv.conf").map(|t| parse_resolv_conf(&t)).unwrap_or_default();
    *g = Some((Instant::now(), s.clone()));
    s
}

/// Look `l`'s name up (A and AAAA) at `servers`, one after another until one
/// answers, within `l`'s budget: the addresses, NXDOMAIN (no such name, or
/// no address), or SERVFAIL (no nameserver answered).
fn lookup(l: &Lookup, servers: &[SocketAddr]) -> Outcome {
    if l.name.is_empty() {
        return Err(dns::RCODE_NXDOMAIN);
    }
    let Ok(name) = Name::from_ascii(format!("{}.", l.name)) else { return Err(dns::RCODE_FORMERR) };
    for server in servers.iter().take(MAX_SERVERS) {
        let now = Instant::now();
        if now >= l.expires || l.is_done() {
            break;
        }
        let until = l.expires.min(now + PER_SERVER);
        match ask(*server, &name, until, l) {
            Ok(r) => return r,
            Err(why) => tracing::debug!(target: "forkbox::net", "nameserver {server} on {}: {why}", l.name),
        }
    }
    Err(dns::RCODE_SERVFAIL)
}

/// What one nameserver said about one record type.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Said {
    Addrs(Vec<IpAddr>),
    /// No such name, or no address of the type (getaddrinfo reads both the same).
    Nothing,
    Truncated,
}

fn query_message(name: &Name, ty: RecordType) -> (u16, Vec<u8>) {
    let mut b = [0u8; 2];
    let _ = crate::random::fill_random(&mut b);
    let id = u16::from_le_bytes(b);
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(name.clone(), ty));
    (id, m.to_vec().unwrap_or_default())
}

/// Read a response to (`id`, `name`, `ty`); None if it is not one (a stray datagram).
fn read_response(buf: &[u8], id: u16, name: &Name, ty: RecordType) -> Option<Result<Said, String>> {
    let m = Message::from_vec(buf).ok()?;
    let q = m.queries.first()?;
    if m.metadata.id != id || m.metadata.message_type != MessageType::Response || q.name != *name || q.query_type != ty
    {
        return None;
    }
    if m.metadata.truncation {
        return Some(Ok(Said::Truncated));
    }
    match m.metadata.response_code {
        ResponseCode::NoError => {}
        ResponseCode::NXDomain => return Some(Ok(Said::Nothing)),
        other => return Some(Err(format!("rcode {other}"))),
    }
    // The asked name and the CNAME chain from it (bounded by the answer count).
    let mut names = vec![name.clone()];
    for _ in 0..m.answers.len() {
        let mut grew = false;
        for r in &m.answers {
            if let RData::CNAME(c) = &r.data {
                if names.contains(&r.name) && !names.contains(&c.0) {
                    names.push(c.0.clone());
                    grew = true;
                }
            }
        }
        if !grew {
            break;
        }
    }
    let mut addrs = Vec::new();
    for r in m.answers.iter().filter(|r| names.contains(&r.name)) {
        let ip = match (&r.data, ty) {
            (RData::A(a), RecordType::A) => IpAddr::V4(a.0),
            (RData::AAAA(a), RecordType::AAAA) => IpAddr::V6(a.0),
            _ => continue,
        };
        if !addrs.contains(&ip) {
            addrs.push(ip);
        }
    }
    Some(Ok(if addrs.is_empty() { Said::Nothing } else { Said::Addrs(addrs) }))
}

/// Ask `server` for A and AAAA of `name` by `until`: the outcome, or why not.
fn ask(server: SocketAddr, name: &Name, until: Instant, l: &Lookup) -> Result<Outcome, String> {
    let local: SocketAddr =
        if server.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(local).map_err(|e| format!("socket: {e}"))?;
    sock.connect(server).map_err(|e| format!("connect: {e}"))?;
    let types = [RecordType::A, RecordType::AAAA];
    let queries: Vec<(u16, Vec<u8>)> = types.iter().map(|t| query_message(name, *t)).collect();
    for (_, q) in &queries {
        sock.send(q).map_err(|e| format!("send: {e}"))?;
    }
    let mut said: [Option<Said>; 2] = [None, None];
    let mut buf = vec![0u8; UDP_MAX];
    while said.iter().any(Option::is_none) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || l.is_done() {
            return Err("no answer in time".into());
        }
        sock.set_read_timeout(Some(left.min(SLICE))).map_err(|e| format!("socket: {e}"))?;
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(format!("recv: {e}")),
        };
        for (i, t) in types.iter().enumerate() {
            if said[i].is_none() {
                if let Some(r) = read_response(&buf[..n], queries[i].0, name, *t) {
                    said[i] = Some(r?);
                    break;
                }
            }
        }
    }
    let mut out = Vec::new();
    for (i, s) in said.into_iter().enumerate() {
        let s = match s {
            Some(Said::Truncated) => ask_tcp(server, name, types[i], until)?,
            Some(s) => s,
            None => return Err("no answer".into()),
        };
        match s {
            Said::Addrs(a) => out.extend(a),
            Said::Nothing => {}
            Said::Truncated => return Err("truncated over TCP".into()),
        }
    }
    if out.is_empty() {
        return Ok(Err(dns::RCODE_NXDOMAIN));
    }
    Ok(Ok(out))
}

/// One question over TCP (a truncated UDP answer), by `until`.
fn ask_tcp(server: SocketAddr, name: &Name, ty: RecordType, until: Instant) -> Result<Said, String> {
    let left = || {
        let d = until.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err("no answer in time".to_string())
        } else {
            Ok(d)
        }
    };
    let mut s = TcpStream::connect_timeout(&server, left()?).map_err(|e| format!("tcp connect: {e}"))?;
    let (id, q) = query_message(name, ty);
    let len = u16::try_from(q.len()).map_err(|_| "query too long".to_string())?;
    s.set_write_timeout(Some(left()?)).map_err(|e| e.to_string())?;
    let mut framed = len.to_be_bytes().to_vec();
    framed.extend_from_slice(&q);
    s.write_all(&framed).map_err(|e| format!("tcp send: {e}"))?;
    s.set_read_timeout(Some(left()?)).map_err(|e| e.to_string())?;
    let mut n = [0u8; 2];
    s.read_exact(&mut n).map_err(|e| format!("tcp recv: {e}"))?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(n))];
    s.set_read_timeout(Some(left()?)).map_err(|e| e.to_string())?;
    s.read_exact(&mut buf).map_err(|e| format!("tcp recv: {e}"))?;
    match read_response(&buf, id, name, ty) {
        Some(r) => r,
        None => Err("tcp: not an answer to the question".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nameservers_from_resolv_conf() {
        let text = "# comment\nsearch example.org\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\nnameserver ::1\n\
                    options ndots:2\nnameserver 1.1.1.1\nnameserver 8.8.8.8\n";
        let s = parse_resolv_conf(text);
        let want: Vec<SocketAddr> =
            vec!["10.0.0.2:53".parse().unwrap(), "[::1]:53".parse().unwrap(), "1.1.1.1:53".parse().unwrap()];
        assert_eq!(s, want, "scoped addresses skipped, at most three");
        assert_eq!(parse_server("127.0.0.1"), Some("127.0.0.1:53".parse().unwrap()));
        assert_eq!(parse_server(" [::1]:5353 "), Some("[::1]:5353".parse().unwrap()));
        assert_eq!(parse_server("nameserver"), None);
    }

    /// A UDP nameserver on loopback sending what `reply` gives for each question (nothing: never answering).
    fn server(reply: impl Fn(&Message) -> Vec<Message> + Send + 'static) -> SocketAddr {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = s.recv_from(&mut buf) {
                let Ok(q) = Message::from_vec(&buf[..n]) else { continue };
                for r in reply(&q) {
                    let _ = s.send_to(&r.to_vec().unwrap(), from);
                }
            }
        });
        addr
    }

    fn answer(q: &Message, rcode: ResponseCode, data: &[RData]) -> Message {
        let mut r = Message::new(q.metadata.id, MessageType::Response, OpCode::Query);
        r.metadata.response_code = rcode;
        let qq = q.queries[0].clone();
        // Behind a CNAME the addresses are the target's (real.test).
        let aliased = data.iter().any(|d| d.record_type() == RecordType::CNAME);
        for d in data {
            if d.record_type() == qq.query_type || d.record_type() == RecordType::CNAME {
                let owner = if aliased && d.record_type() != RecordType::CNAME {
                    Name::from_ascii("real.test.").unwrap()
                } else {
                    qq.name.clone()
                };
                r.add_answer(hickory_proto::rr::Record::from_rdata(owner, 30, d.clone()));
            }
        }
        r.add_query(qq);
        r
    }

    #[test]
    fn resolves_through_a_cname_and_ignores_strays() {
        let up = server(|q| {
            let cname = RData::CNAME(hickory_proto::rr::rdata::CNAME(Name::from_ascii("real.test.").unwrap()));
            let real = answer(
                q,
                ResponseCode::NoError,
                &[
                    cname,
                    RData::A("93.184.215.14".parse::<Ipv4Addr>().unwrap().into()),
                    RData::AAAA("2606:2800::1".parse::<Ipv6Addr>().unwrap().into()),
                ],
            );
            // First a forged answer (another id), then one to another question: both ignored.
            let mut forged =
                answer(q, ResponseCode::NoError, &[RData::A("6.6.6.6".parse::<Ipv4Addr>().unwrap().into())]);
            forged.metadata.id = q.metadata.id.wrapping_add(1);
            let mut other = forged.clone();
            other.metadata.id = q.metadata.id;
            other.queries[0].name = Name::from_ascii("other.test.").unwrap();
            vec![forged, other, real]
        });
        let l = Lookup::new("alias.test").unwrap();
        let r = lookup(&l, &[up]).unwrap();
        assert_eq!(r, vec!["93.184.215.14".parse::<IpAddr>().unwrap(), "2606:2800::1".parse().unwrap()]);
        let nx = server(|q| vec![answer(q, ResponseCode::NXDomain, &[])]);
        assert_eq!(lookup(&Lookup::new("none.test").unwrap(), &[nx]), Err(dns::RCODE_NXDOMAIN));
    }

    #[test]
    fn a_silent_nameserver_costs_the_budget_then_the_next_is_asked() {
        let silent = server(|_| Vec::new());
        let ok = server(|q| {
            vec![answer(q, ResponseCode::NoError, &[RData::A("1.2.3.4".parse::<Ipv4Addr>().unwrap().into())])]
        });
        let l = Lookup::new("x.test").unwrap();
        let t = Instant::now();
        assert_eq!(lookup(&l, &[silent, ok]), Ok(vec!["1.2.3.4".parse::<IpAddr>().unwrap()]));
        let took = t.elapsed();
        assert!(took >= PER_SERVER && took < PER_SERVER + Duration::from_secs(1), "{took:?}");
        // Only silent ones: SERVFAIL within the lookup's budget.
        let l = Lookup::new("y.test").unwrap();
        let t = Instant::now();
        assert_eq!(lookup(&l, &[silent, silent, silent]), Err(dns::RCODE_SERVFAIL));
        assert!(t.elapsed() < BUDGET + Duration::from_millis(500), "{:?}", t.elapsed());
        // A cancel frees the thread within a slice.
        let l = Lookup::new("z.test").unwrap();
        let l2 = Arc::clone(&l);
        let h = std::thread::spawn(move || {
            let t = Instant::now();
            let r = lookup(&l2, &[silent]);
            (r, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        l.cancel();
        assert_eq!(l.wait(Duration::from_secs(1)), Some(Err(dns::RCODE_SERVFAIL)));
        let (_, took) = h.join().unwrap();
        assert!(took < Duration::from_millis(800), "{took:?}");
    }
}
