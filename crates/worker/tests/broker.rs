//! The egress broker on real sockets: a `NetIo` whose egress is the broker,
//! served on a thread over a socketpair as the API process serves a worker.
//! The policy that counts is the one registered with the broker, never the
//! one the worker's side holds.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use forkbox_linux::errno::Errno;
use forkbox_linux::net::{dns, resolver, NetConfig, NetIo, Policy, DNS_PORT, RESOLVER};
use forkbox_worker::broker::{serve, BrokerError, Brokered, Link, Policies};

struct Setup {
    policies: Arc<Policies>,
    link: Arc<Link>,
    served: std::thread::JoinHandle<Result<(), BrokerError>>,
}

fn start() -> Setup {
    let (theirs, ours) = UnixStream::pair().unwrap();
    let policies = Arc::new(Policies::default());
    let p = Arc::clone(&policies);
    let served = std::thread::spawn(move || serve(ours, p));
    let link = Link::start(theirs).unwrap();
    Setup { policies, link, served }
}

/// The worker side's NetIo for `sandbox`, holding `claimed` (what a worker
/// could say about its own policy: the broker never asks).
fn net(s: &Setup, sandbox: u64, claimed: NetConfig) -> NetIo {
    NetIo::with_egress(Arc::new(claimed), Arc::new(Brokered::new(Arc::clone(&s.link), sandbox)))
}

fn allow(rules: &[&str]) -> NetConfig {
    NetConfig::with_policy(Policy::allowlist(rules.iter().map(|r| r.parse().unwrap()).collect()))
}

fn wait(n: &mut NetIo, id: u64, events: i16) -> i16 {
    let t = Instant::now();
    loop {
        let r = n.poll(id, events);
        if r != 0 || t.elapsed() > Duration::from_secs(5) {
            return r;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, dns::TYPE_A as u8, 0, 1]);
    q
}

#[test]
fn connections_are_opened_by_the_broker_under_the_registered_policy() {
    let s = start();
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let echo = std::thread::spawn(move || {
        let (mut c, _) = server.accept().unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).unwrap();
        c.write_all(&b).unwrap();
    });
    s.policies.register(1, allow(&[&format!("127.0.0.1:{port}")]));
    // The worker's side claims everything is open: it is not asked.
    let mut n = net(&s, 1, NetConfig::with_policy(Policy::public()));
    let id = n.socket(libc::AF_INET, true).unwrap();
    // An option set before the connect reaches the socket the broker opened.
    n.setsockopt(id, libc::IPPROTO_TCP, libc::TCP_NODELAY, &1i32.to_le_bytes()).unwrap();
    let dest: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    match n.connect(id, Some(dest)) {
        Ok(_) | Err(Errno::EINPROGRESS) => {}
        Err(e) => panic!("connect: {e:?}"),
    }
    assert_ne!(wait(&mut n, id, libc::POLLOUT) & libc::POLLOUT, 0);
    assert_eq!(n.getsockopt(id, libc::IPPROTO_TCP, libc::TCP_NODELAY, 4).unwrap(), 1i32.to_le_bytes());
    assert_eq!(n.peer_addr(id).unwrap(), dest);
    assert_eq!(n.send(id, b"hello", None, 0).unwrap(), 5);
    assert_ne!(wait(&mut n, id, libc::POLLIN) & libc::POLLIN, 0);
    let mut b = [0u8; 16];
    let (k, _, _) = n.recv(id, &mut b, 0).unwrap();
    assert_eq!(&b[..k], b"hello");
    echo.join().unwrap();
    assert_eq!((n.stats.connects_allowed, n.stats.bytes_sent, n.stats.bytes_received), (1, 5, 5));

    // Another port of loopback: the broker's policy refuses, with its reason.
    let id2 = n.socket(libc::AF_INET, true).unwrap();
    let o = other.local_addr().unwrap();
    assert_eq!(n.connect(id2, Some(o)), Err(Errno::ECONNREFUSED));
    assert_eq!(n.stats.connects_denied, 1);
    assert!(
        n.notes.iter().any(|m| m.contains(&format!("connect to {o} refused by the egress policy"))),
        "{:?}",
        n.notes
    );

    // A sandbox id the broker holds no policy for gets nothing, whatever it claims.
    let mut stranger = net(&s, 99, NetConfig::with_policy(Policy::public()));
    let id3 = stranger.socket(libc::AF_INET, true).unwrap();
    assert_eq!(stranger.connect(id3, Some(dest)), Err(Errno::ECONNREFUSED));
    assert!(stranger.notes.iter().any(|m| m.contains("no policy for this sandbox")), "{:?}", stranger.notes);

    // Unregistered: the same sandbox is refused from then on.
    s.policies.unregister(1);
    let id4 = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(id4, Some(dest)), Err(Errno::ECONNREFUSED));
    drop((n, stranger));
    drop(s.link);
    assert!(s.served.join().unwrap().is_ok(), "the broker ends when the worker's end closes");
}

#[test]
fn datagrams_and_names_are_decided_by_the_broker() {
    let s = start();
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = echo.local_addr().unwrap();
    let mut cfg = allow(&[&format!("{to}")]);
    cfg.hosts.insert("echo.test".into(), vec![to.ip()]);
    cfg.hosts.insert("meta.test".into(), vec!["169.254.169.254".parse().unwrap()]);
    s.policies.register(2, cfg);
    // The worker's side has a host map of its own: never used.
    let mut claimed = NetConfig::with_policy(Policy::public());
    claimed.hosts.insert("inside.test".into(), vec!["10.0.0.1".parse().unwrap()]);
    let mut n = net(&s, 2, claimed);
    let u = n.socket(libc::AF_INET, false).unwrap();
    assert_eq!(n.send(u, b"ping", Some(to), 0).unwrap(), 4);
    let mut b = [0u8; 16];
    let (k, from) = echo.recv_from(&mut b).unwrap();
    assert_eq!(&b[..k], b"ping");
    echo.send_to(b"pong", from).unwrap();
    assert_ne!(wait(&mut n, u, libc::POLLIN) & libc::POLLIN, 0);
    assert_eq!(n.recv(u, &mut b, 0).unwrap().0, 4);
    // A loopback port the policy keeps closed: an unconnected datagram is
    // dropped as Linux drops one for a closed port (sendto says it was sent),
    // a connected socket is refused; nothing leaves either way.
    let closed = UdpSocket::bind("127.0.0.1:0").unwrap();
    closed.set_nonblocking(true).unwrap();
    let denied = closed.local_addr().unwrap();
    assert_eq!(n.send(u, b"x", Some(denied), 0), Ok(1));
    let c = n.socket(libc::AF_INET, false).unwrap();
    let _ = n.connect(c, Some(denied));
    assert_eq!(n.send(c, b"x", None, 0), Err(Errno::ECONNREFUSED));
    assert!(closed.recv(&mut b).is_err(), "a datagram reached a port the policy denies");

    // DNS: asked of the broker; the answer comes later, through the eventfd.
    let r = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(r, Some(SocketAddr::from((RESOLVER, DNS_PORT)))).unwrap());
    let ask = |n: &mut NetIo, id: u16, name: &str| -> Vec<u8> {
        n.send(r, &query(id, name), None, 0).unwrap();
        let mut fds = Vec::new();
        n.lookup_pollfds(r, libc::POLLIN, &mut fds);
        assert_ne!(wait(n, r, libc::POLLIN) & libc::POLLIN, 0, "{name}: no answer");
        let mut b = [0u8; 512];
        let (k, _, _) = n.recv(r, &mut b, 0).unwrap();
        b[..k].to_vec()
    };
    let a = ask(&mut n, 1, "echo.test");
    assert_eq!((a[3] & 0xF, &a[a.len() - 4..]), (dns::RCODE_OK, &[127, 0, 0, 1][..]));
    let a = ask(&mut n, 2, "meta.test");
    assert_eq!(a[3] & 0xF, dns::RCODE_REFUSED);
    assert!(n.notes.iter().any(|m| m.contains("DNS lookup of meta.test refused")), "{:?}", n.notes);
    // Not in any allow rule of the broker's policy: nobody is asked.
    let a = ask(&mut n, 3, "inside.test");
    assert_eq!(a[3] & 0xF, dns::RCODE_NXDOMAIN);
    assert_eq!(n.stats.dns_refused, 2);
}

fn silent_nameserver() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let a = s.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut b = [0u8; 1500];
        while s.recv_from(&mut b).is_ok() {}
    });
    a
}

#[test]
fn a_slow_lookup_never_blocks_the_sandbox_and_an_interrupt_ends_it() {
    resolver::set_upstream(Some(vec![silent_nameserver()]));
    let s = start();
    s.policies.register(3, NetConfig::with_policy(Policy::public()));
    let mut n = net(&s, 3, NetConfig::with_policy(Policy::none()));
    let r = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(r, Some(SocketAddr::from((RESOLVER, DNS_PORT)))).unwrap());
    let t = Instant::now();
    n.send(r, &query(5, "slow.silent.test"), None, 0).unwrap();
    assert!(t.elapsed() < Duration::from_millis(500), "the send waited for the lookup");
    let mut b = [0u8; 512];
    assert_eq!(n.recv(r, &mut b, 0).unwrap_err(), Errno::EAGAIN);
    let mut fds = Vec::new();
    n.lookup_pollfds(r, libc::POLLIN, &mut fds);
    assert_eq!(fds.len(), 1);
    // SAFETY: valid pollfds, no wait.
    assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) }, 0, "not answered yet");
    n.cancel_lookups();
    assert_ne!(wait(&mut n, r, libc::POLLIN) & libc::POLLIN, 0);
    let (k, _, _) = n.recv(r, &mut b, 0).unwrap();
    assert!(k >= 12 && b[3] & 0xF == dns::RCODE_SERVFAIL, "{:?}", &b[..k]);
    resolver::set_upstream(None);
}

#[test]
fn a_worker_that_breaks_the_protocol_ends_only_its_broker() {
    let (mut theirs, ours) = UnixStream::pair().unwrap();
    let served = std::thread::spawn(move || serve(ours, Arc::new(Policies::default())));
    // A length far over the cap: refused before anything is allocated.
    theirs.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(matches!(served.join().unwrap(), Err(BrokerError::TooLarge(_))));
    let (mut theirs, ours) = UnixStream::pair().unwrap();
    let served = std::thread::spawn(move || serve(ours, Arc::new(Policies::default())));
    theirs.write_all(&5u32.to_le_bytes()).unwrap();
    theirs.write_all(b"{bad}").unwrap();
    assert!(matches!(served.join().unwrap(), Err(BrokerError::Protocol(_))));
}
