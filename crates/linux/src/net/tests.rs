//! NetIo against real host sockets on loopback (no guest needed).

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, UdpSocket};
use std::time::{Duration, Instant};

use socket2::{Domain, Type};

use super::egress::{LOOKUPS_IN_FLIGHT, LOOKUP_BURST};
use super::ports::{binds_overlap, listener_takes, loop_dest, sandbox_local, EPHEMERAL};
use super::*;

fn net(p: Policy) -> NetIo {
    NetIo::new(Arc::new(NetConfig::with_policy(p)))
}

/// A NetIo and its in-process egress (to look at the policy state it keeps).
fn direct(cfg: NetConfig) -> (NetIo, Arc<Direct>) {
    let cfg = Arc::new(cfg);
    let d = Arc::new(Direct::new(Arc::clone(&cfg)));
    (NetIo::with_egress(cfg, d.clone()), d)
}

fn loopback_allowed(port: u16) -> Policy {
    Policy { mode: Mode::Public, allow: vec![format!("127.0.0.1:{port}").parse().unwrap()], ..Policy::default() }
}

/// Wait until `id` is ready for `events` (what the syscall layer does for a blocking guest).
fn wait(n: &mut NetIo, id: u64, events: i16) -> i16 {
    let t0 = Instant::now();
    loop {
        let r = n.poll(id, events);
        if r != 0 {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "socket never became ready");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = id.to_be_bytes().to_vec();
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for l in name.split('.') {
        m.push(l.len() as u8);
        m.extend_from_slice(l.as_bytes());
    }
    m.extend_from_slice(&[0, (qtype >> 8) as u8, qtype as u8, 0, 1]);
    m
}

#[test]
fn tcp_to_an_allowlisted_loopback_server() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).unwrap();
        c.write_all(b"pong:").unwrap();
        c.write_all(&b).unwrap();
    });
    let mut n = net(loopback_allowed(port));
    let id = n.socket(libc::AF_INET, true).unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    if !n.connect(id, Some(addr)).unwrap() {
        assert_ne!(wait(&mut n, id, libc::POLLOUT) & libc::POLLOUT, 0);
    }
    assert_eq!(n.getsockopt(id, libc::SOL_SOCKET, libc::SO_ERROR, 4).unwrap(), vec![0; 4]);
    assert_eq!(n.peer_addr(id).unwrap(), addr);
    assert_eq!(n.send(id, b"hello", None, 0).unwrap(), 5);
    let mut got = Vec::new();
    while got.len() < 10 {
        wait(&mut n, id, libc::POLLIN);
        let mut b = [0u8; 64];
        let (k, from, _) = n.recv(id, &mut b, 0).unwrap();
        assert_eq!(from, None);
        got.extend_from_slice(&b[..k]);
    }
    assert_eq!(&got, b"pong:hello");
    server.join().unwrap();
    wait(&mut n, id, libc::POLLIN);
    assert_eq!(n.recv(id, &mut [0u8; 8], 0).unwrap().0, 0, "EOF after the server closed");
    assert_eq!((n.stats.connects_allowed, n.stats.bytes_sent, n.stats.bytes_received), (1, 5, 10));
    n.close(id);
    assert_eq!(n.recv(id, &mut [0u8; 8], 0).unwrap_err(), Errno::ECONNRESET, "a closed/unknown id reads as reset");
}

#[test]
fn default_policies_refuse_loopback_metadata_and_private() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    for p in [Policy::none(), Policy::public(), Policy::allowlist(vec!["*.example.com".parse().unwrap()])] {
        let mut n = net(p.clone());
        for a in [
            format!("127.0.0.1:{port}"),
            "169.254.169.254:80".into(),
            "10.0.0.1:80".into(),
            "[::1]:80".into(),
            format!("[::ffff:127.0.0.1]:{port}"),
            "[fe80::1]:80".into(),
            "192.168.1.1:80".into(),
            "172.16.0.1:80".into(),
        ] {
            let id = n.socket(if a.starts_with('[') { libc::AF_INET6 } else { libc::AF_INET }, true).unwrap();
            assert_eq!(n.connect(id, Some(a.parse().unwrap())), Err(Errno::ECONNREFUSED), "{a} under {p:?}");
            n.close(id);
        }
        assert_eq!(n.stats.connects_denied, 8);
        assert_eq!(n.stats.connects_allowed, 0);
        assert_eq!(n.notes.len(), 8, "one note per refusal");
        assert!(n.notes[0].contains("refused by the egress policy"), "{:?}", n.notes);
    }
    // Nothing reached the listener.
    l.set_nonblocking(true).unwrap();
    assert!(l.accept().is_err());
}

#[test]
fn udp_echo_and_per_destination_checks() {
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = echo.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let mut b = [0u8; 100];
        let (k, from) = echo.recv_from(&mut b).unwrap();
        echo.send_to(&b[..k], from).unwrap();
    });
    let mut n = net(loopback_allowed(port));
    let id = n.socket(libc::AF_INET, false).unwrap();
    let to: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // Another loopback port, closed to the sandbox: dropped, as Linux drops a
    // datagram for a closed port (an unconnected sendto never sees ECONNREFUSED).
    assert_eq!(n.send(id, b"ping", Some("127.0.0.1:9".parse().unwrap()), 0), Ok(4), "another loopback port");
    assert_eq!(n.send(id, b"ping", Some("127.0.0.1:9".parse().unwrap()), 0), Ok(4), "the cached verdict too");
    assert_eq!(n.send(id, b"ping", Some(to), 0).unwrap(), 4);
    wait(&mut n, id, libc::POLLIN);
    let mut b = [0u8; 2];
    let (k, from, trunc) = n.recv(id, &mut b, libc::MSG_TRUNC).unwrap();
    assert_eq!((k, from, trunc, &b), (4, Some(to), true, b"pi"), "truncated datagram, full length with MSG_TRUNC");
    t.join().unwrap();
    assert_eq!((n.stats.connects_allowed, n.stats.connects_denied), (1, 1));
    // A connected UDP socket is checked on its first send, not at connect.
    let id2 = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(id2, Some("10.1.1.1:53".parse().unwrap())).unwrap());
    assert_eq!(n.send(id2, b"x", None, 0), Err(Errno::ECONNREFUSED));
    assert_eq!(n.send(id2, b"x", None, 0), Err(Errno::ECONNREFUSED));
    assert_eq!(n.stats.connects_denied, 2, "the verdict is cached per destination");
}

#[test]
fn resolver_answers_from_the_host_map_under_the_policy() {
    let mut cfg = NetConfig::with_policy(Policy {
        mode: Mode::Public,
        allow: vec!["10.200.0.0/24".parse().unwrap()],
        ..Policy::default()
    });
    cfg.hosts.insert("web.test".into(), vec!["10.200.0.2".parse().unwrap()]);
    cfg.hosts.insert("meta.test".into(), vec!["169.254.169.254".parse().unwrap()]);
    cfg.hosts.insert("mixed.test".into(), vec!["127.0.0.1".parse().unwrap(), "93.184.215.14".parse().unwrap()]);
    let (mut n, d) = direct(cfg);
    let id = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(id, Some(SocketAddr::from((RESOLVER, DNS_PORT)))).unwrap());
    assert_eq!(n.peer_addr(id).unwrap(), SocketAddr::from((RESOLVER, DNS_PORT)));
    let ask = |n: &mut NetIo, name: &str| -> Vec<u8> {
        n.send(id, &query(42, name, dns::TYPE_A), None, 0).unwrap();
        assert_ne!(n.poll(id, libc::POLLIN) & libc::POLLIN, 0);
        let mut b = [0u8; 512];
        let (k, from, _) = n.recv(id, &mut b, 0).unwrap();
        assert_eq!(from, Some(SocketAddr::from((RESOLVER, DNS_PORT))));
        b[..k].to_vec()
    };
    let r = ask(&mut n, "web.test");
    assert_eq!((r[3] & 0xF, &r[r.len() - 4..]), (dns::RCODE_OK, &[10, 200, 0, 2][..]));
    let r = ask(&mut n, "meta.test");
    assert_eq!(r[3] & 0xF, dns::RCODE_REFUSED, "a name resolving only to the metadata address");
    let r = ask(&mut n, "mixed.test");
    assert_eq!(
        (r[3] & 0xF, u16::from_be_bytes([r[6], r[7]]), &r[r.len() - 4..]),
        (dns::RCODE_OK, 1, &[93, 184, 215, 14][..]),
        "denied addresses filtered out"
    );
    assert_eq!((n.stats.dns_queries, n.stats.dns_refused), (3, 1));
    // The name the resolver handed out is what a domain rule matches.
    assert_eq!(d.gate().names.get(&"10.200.0.2".parse::<IpAddr>().unwrap()).unwrap(), &vec!["web.test".to_string()]);
    // TCP to the resolver: length-prefixed.
    let t = n.socket(libc::AF_INET, true).unwrap();
    assert!(n.connect(t, Some(SocketAddr::from((RESOLVER, DNS_PORT)))).unwrap());
    let q = query(7, "web.test", dns::TYPE_A);
    let mut framed = (q.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&q);
    assert_eq!(n.send(t, &framed[..5], None, 0).unwrap(), 5);
    assert_eq!(n.poll(t, libc::POLLIN), 0, "nothing until the whole query is in");
    n.send(t, &framed[5..], None, 0).unwrap();
    let mut b = [0u8; 600];
    let (k, _, _) = n.recv(t, &mut b, 0).unwrap();
    assert_eq!(u16::from_be_bytes([b[0], b[1]]) as usize, k - 2);
    assert_eq!(&b[k - 4..k], &[10, 200, 0, 2]);
}

#[test]
fn domain_rules_match_names_handed_out_by_the_resolver() {
    let mut cfg = NetConfig::with_policy(Policy::allowlist(vec!["*.allowed.test".parse().unwrap()]));
    cfg.hosts.insert("api.allowed.test".into(), vec!["93.184.215.14".parse().unwrap()]);
    cfg.hosts.insert("other.test".into(), vec!["93.184.215.15".parse().unwrap()]);
    let (mut n, g) = direct(cfg);
    assert_eq!(n.resolve("other.test").0, dns::RCODE_REFUSED);
    assert_eq!(n.resolve("API.allowed.test.").1, vec!["93.184.215.14".parse::<IpAddr>().unwrap()]);
    let d = g.gate().decide("93.184.215.14:443".parse().unwrap());
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.names, vec!["api.allowed.test".to_string()]);
    assert!(!g.gate().decide("93.184.215.15:443".parse().unwrap()).allowed);
    let mut off = net(Policy::none());
    assert_eq!(off.resolve("anything.test").0, dns::RCODE_REFUSED);
}

#[test]
fn socket_and_byte_limits() {
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut cfg = NetConfig::with_policy(loopback_allowed(echo.local_addr().unwrap().port()));
    cfg.max_sockets = 3;
    cfg.max_bytes = 4;
    let mut n = NetIo::new(Arc::new(cfg));
    let ids: Vec<u64> = (0..3).map(|_| n.socket(libc::AF_INET, true).unwrap()).collect();
    assert_eq!(n.socket(libc::AF_INET, false), Err(Errno::EMFILE));
    n.close(ids[0]);
    let udp = n.socket(libc::AF_INET, false).unwrap();
    assert_eq!(n.send(udp, b"1234", Some(echo.local_addr().unwrap()), 0).unwrap(), 4);
    assert_eq!(n.send(udp, b"5", Some(echo.local_addr().unwrap()), 0), Err(Errno::ENOBUFS));
    assert!(n.notes.iter().any(|m| m.contains("byte limit")));
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn listeners_take_only_their_addresses() {
    assert!(listener_takes(sa("0.0.0.0:80"), false, sa("127.0.0.2:80")));
    assert!(!listener_takes(sa("0.0.0.0:80"), false, sa("[::1]:80")));
    assert!(listener_takes(sa("[::]:80"), false, sa("[::1]:80")));
    assert!(listener_takes(sa("[::]:80"), false, sa("127.0.0.1:80")));
    // IPV6_V6ONLY: `::` takes IPv6 only.
    assert!(listener_takes(sa("[::]:80"), true, sa("[::1]:80")));
    assert!(!listener_takes(sa("[::]:80"), true, sa("127.0.0.1:80")));
    assert!(listener_takes(sa("127.0.0.1:80"), false, loop_dest(sa("0.0.0.0:80"))));
    assert!(listener_takes(sa("[::ffff:127.0.0.1]:80"), false, loop_dest(sa("[::ffff:127.0.0.1]:80"))));
    assert!(!listener_takes(sa("127.0.0.1:80"), false, sa("127.0.0.1:81")));
    assert!(!listener_takes(sa("127.0.0.1:80"), false, sa("127.0.0.2:80")));
    assert!(!listener_takes(sa("[::1]:80"), false, sa("127.0.0.1:80")));
    assert!(!sandbox_local("10.0.0.1".parse().unwrap()) && sandbox_local("::".parse().unwrap()));
}

/// Which bindings of one port exclude each other, as Linux's bind conflict
/// check: IPv4 and IPv6 addresses apart, `::` both unless IPV6_V6ONLY is set.
#[test]
fn bindings_overlap_by_family_and_v6only() {
    let o = |a: &str, a6: bool, b: &str, b6: bool| {
        let (x, y) = (binds_overlap(sa(a), a6, sa(b), b6), binds_overlap(sa(b), b6, sa(a), a6));
        assert_eq!(x, y, "{a} {b}: symmetric");
        x
    };
    assert!(o("0.0.0.0:5", false, "127.0.0.1:5", false) && !o("127.0.0.1:5", false, "127.0.0.2:5", false));
    assert!(!o("0.0.0.0:5", false, "0.0.0.0:6", false));
    // Dual stack `::` holds the IPv4 wildcard too; an IPv6-only one does not.
    assert!(o("0.0.0.0:5", false, "[::]:5", false) && o("127.0.0.1:5", false, "[::]:5", false));
    assert!(!o("0.0.0.0:5", false, "[::]:5", true) && !o("127.0.0.1:5", false, "[::]:5", true));
    // Two `::` always conflict; `::` and [::1] do, whatever the option.
    assert!(o("[::]:5", true, "[::]:5", false) && o("[::]:5", true, "[::1]:5", false));
    // IPv4-mapped is IPv4.
    assert!(
        o("[::ffff:127.0.0.1]:5", false, "0.0.0.0:5", false) && !o("[::ffff:127.0.0.1]:5", false, "[::1]:5", false)
    );
    assert!(!o("[::1]:5", false, "0.0.0.0:5", false));
}

/// The whole life of an in-sandbox connection on NetIo: no host port, ports
/// in the sandbox's table, backlog, data both ways, close.
#[test]
fn listen_connect_accept_inside_the_sandbox() {
    let mut n = net(Policy::none());
    let l = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.bind(l, sa("10.0.0.1:80")), Err(Errno::EADDRNOTAVAIL));
    n.bind(l, sa("127.0.0.1:0")).unwrap();
    let port = n.local_addr(l).unwrap().port();
    assert!((EPHEMERAL.0..=EPHEMERAL.1).contains(&port));
    n.listen(l, 0).unwrap();
    assert_eq!(n.accept(l), Err(Errno::EAGAIN));
    assert_eq!(n.poll(l, libc::POLLIN | libc::POLLOUT), 0);
    let other = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.bind(other, sa(&format!("0.0.0.0:{port}"))), Err(Errno::EADDRINUSE));
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa(&format!("127.0.0.1:{port}")))), Ok(true));
    // backlog 0 takes one; the next is refused.
    let c2 = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c2, Some(sa(&format!("127.0.0.1:{port}")))), Err(Errno::ECONNREFUSED));
    assert_eq!(n.poll(l, libc::POLLIN | libc::POLLOUT), libc::POLLIN);
    let (s, peer) = n.accept(l).unwrap();
    assert_eq!(peer, n.local_addr(c).unwrap());
    assert_eq!(n.peer_addr(c).unwrap(), sa(&format!("127.0.0.1:{port}")));
    assert_eq!(n.send(c, b"ping", None, 0), Ok(4));
    let mut b = [0u8; 8];
    wait(&mut n, s, libc::POLLIN);
    assert_eq!(n.recv(s, &mut b, 0).map(|r| r.0), Ok(4));
    assert_eq!(&b[..4], b"ping");
    assert_eq!(n.stats.bytes_sent + n.stats.bytes_received, 0, "in-sandbox bytes are not egress");
    n.close(c);
    assert_eq!(n.recv(s, &mut b, 0).map(|r| r.0), Ok(0));
    n.close(l);
    // As on Linux, the accepted end still holds the port (without SO_REUSEADDR); then it is free.
    assert_eq!(n.bind(other, sa(&format!("0.0.0.0:{port}"))), Err(Errno::EADDRINUSE));
    n.close(s);
    n.bind(other, sa(&format!("0.0.0.0:{port}"))).unwrap();
    assert!(n.is_live(other) && !n.is_live(s));
}

/// A dual-stack server as asyncio makes one: 0.0.0.0:P and an IPv6-only
/// [::]:P side by side, each taking its family's connections; without
/// IPV6_V6ONLY the second bind finds the port taken.
#[test]
fn ipv6_only_listener_shares_its_port_with_ipv4() {
    let mut n = net(Policy::none());
    let v4 = n.socket(libc::AF_INET, true).unwrap();
    n.bind(v4, sa("0.0.0.0:0")).unwrap();
    let port = n.local_addr(v4).unwrap().port();
    n.listen(v4, 8).unwrap();
    let dual = n.socket(libc::AF_INET6, true).unwrap();
    assert_eq!(n.bind(dual, sa(&format!("[::]:{port}"))), Err(Errno::EADDRINUSE));
    let v6 = n.socket(libc::AF_INET6, true).unwrap();
    n.setsockopt(v6, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &1i32.to_le_bytes()).unwrap();
    n.bind(v6, sa(&format!("[::]:{port}"))).unwrap();
    n.listen(v6, 8).unwrap();
    for (dest, domain, listener) in [("127.0.0.1", libc::AF_INET, v4), ("[::1]", libc::AF_INET6, v6)] {
        let c = n.socket(domain, true).unwrap();
        assert_eq!(n.connect(c, Some(sa(&format!("{dest}:{port}")))), Ok(true));
        let other = if listener == v4 { v6 } else { v4 };
        assert_eq!(n.accept(other), Err(Errno::EAGAIN), "{dest}");
        n.accept(listener).unwrap();
    }
    let reached: Vec<SocketAddr> = n.listening().into_iter().filter(|(_, p)| *p).map(|(a, _)| a).collect();
    assert_eq!(reached, [sa(&format!("0.0.0.0:{port}")), sa(&format!("[::]:{port}"))]);
    // The IPv6-only listener never takes IPv4: with the IPv4 one gone, 127.0.0.1 is refused.
    n.close(v4);
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa(&format!("127.0.0.1:{port}")))), Err(Errno::ECONNREFUSED));
}

/// A nameserver on loopback that takes questions and never answers them.
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
fn host_lookups_wait_on_an_eventfd_and_are_capped_per_sandbox() {
    resolver::set_upstream(Some(vec![silent_nameserver()]));
    let (mut n, d) = direct(NetConfig::with_policy(Policy::public()));
    let u = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(u, Some(resolver_addr())).unwrap());
    // A question the host must look up: no answer yet, an eventfd to wait on.
    n.send(u, &query(1, "a.silent.test", dns::TYPE_A), None, 0).unwrap();
    n.send(u, &query(2, "a.silent.test", dns::TYPE_AAAA), None, 0).unwrap();
    let mut b = [0u8; 512];
    assert_eq!(n.recv(u, &mut b, 0).unwrap_err(), Errno::EAGAIN);
    assert_eq!(n.poll(u, libc::POLLIN), 0);
    let mut fds = Vec::new();
    n.lookup_pollfds(u, libc::POLLIN, &mut fds);
    assert_eq!(fds.len(), 1, "A and AAAA of one name share a lookup");
    assert_eq!(d.gate().lookups.len(), 1);
    // At most LOOKUPS_IN_FLIGHT names at once: the next fails at once.
    for i in 1..LOOKUPS_IN_FLIGHT {
        assert!(matches!(n.begin(&format!("n{i}.silent.test")), Resolution::Wait(_)));
    }
    let t = Instant::now();
    assert!(matches!(n.begin("over.silent.test"), Resolution::Done(Resolved { rcode: dns::RCODE_SERVFAIL, .. })));
    assert!(t.elapsed() < Duration::from_millis(100));
    // A cancel (the exec's interrupt) answers SERVFAIL now.
    n.cancel_lookups();
    let mut p = fds[0];
    // SAFETY: one valid pollfd, no wait.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 0) }, 1, "the eventfd is readable");
    assert_eq!(wait(&mut n, u, libc::POLLIN), libc::POLLIN);
    for _ in 0..2 {
        let (k, _, _) = n.recv(u, &mut b, 0).unwrap();
        assert!(k >= 12 && b[3] & 0xF == dns::RCODE_SERVFAIL, "{:?}", &b[..k]);
    }
    // A failure is not cached: the name is looked up again.
    d.gate().sweep();
    assert!(d.gate().lookups.is_empty());
    assert!(matches!(n.begin("a.silent.test"), Resolution::Wait(_)));
    n.cancel_lookups();
    // The rate: LOOKUP_BURST lookups, then SERVFAIL until tokens come back.
    let (mut n, d) = direct(NetConfig::with_policy(Policy::public()));
    let mut failed = 0;
    for i in 0..(LOOKUP_BURST as usize + 2) {
        match n.begin(&format!("r{i}.silent.test")) {
            Resolution::Wait(_) => {}
            Resolution::Done(r) => {
                assert_eq!(r.rcode, dns::RCODE_SERVFAIL);
                failed += 1;
            }
        }
        n.cancel_lookups();
        d.gate().sweep();
    }
    assert!(failed >= 2, "{failed}");
    resolver::set_upstream(None);
}

#[test]
fn an_allowlist_answers_names_no_rule_matches_without_a_lookup() {
    let p = Policy::allowlist(vec![
        "10.0.0.7/32".parse().unwrap(),
        "*.ok.test".parse().unwrap(),
        "exact.test".parse().unwrap(),
    ]);
    let (mut n, d) = direct(NetConfig::with_policy(p));
    for name in ["secret.exfil.test", "ok.test", "x.exact.test", ""] {
        match n.begin(name) {
            Resolution::Done(r) => assert_eq!((r.rcode, r.refused), (dns::RCODE_NXDOMAIN, true), "{name}"),
            Resolution::Wait(_) => panic!("{name} was looked up"),
        }
    }
    assert!(d.gate().lookups.is_empty(), "nothing was looked up");
    // Through the resolver socket the refusals are counted.
    let u = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(u, Some(resolver_addr())).unwrap());
    n.send(u, &query(9, "secret.exfil.test", dns::TYPE_A), None, 0).unwrap();
    assert_eq!(n.stats.dns_refused, 1);
    assert!(n.config.may_resolve("a.ok.test") && n.config.may_resolve("EXACT.test."));
    let any = net(Policy::allowlist(vec!["*:443".parse().unwrap()]));
    assert!(any.config.may_resolve("anything.test"), "`*` could match any name");
}

/// An egress that refuses everything and counts what it was asked.
#[derive(Debug, Default)]
struct Refuser {
    asked: std::sync::Mutex<Vec<String>>,
}

impl Egress for Refuser {
    fn connect(&self, domain: i32, dest: SocketAddr) -> Result<Opened, Refused> {
        self.asked.lock().unwrap().push(format!("tcp {domain} {dest}"));
        Err(Refused::Policy(Verdict { allowed: false, reason: "test".into(), names: vec![] }))
    }
    fn udp(&self, domain: i32, dest: SocketAddr) -> Result<Socket, Refused> {
        self.asked.lock().unwrap().push(format!("udp {domain} {dest}"));
        Err(Refused::Host(Errno(libc::ENETUNREACH)))
    }
    fn lookup(&self, name: &str) -> Resolution {
        self.asked.lock().unwrap().push(format!("lookup {name}"));
        Resolution::Done(Resolved { rcode: dns::RCODE_NXDOMAIN, ..Resolved::default() })
    }
    fn finish(&self, _: &resolver::Lookup) -> Resolved {
        Resolved::default()
    }
    fn cancel_lookups(&self) {}
}

#[test]
fn every_way_out_goes_through_the_egress() {
    let e = Arc::new(Refuser::default());
    // The NetIo's own config says public: only the egress decides.
    let mut n = NetIo::with_egress(Arc::new(NetConfig::with_policy(Policy::public())), e.clone());
    let t = n.socket(libc::AF_INET6, true).unwrap();
    // Before a connect there is no host socket: options are kept, the socket reads as unconnected.
    n.setsockopt(t, libc::SOL_SOCKET, libc::SO_KEEPALIVE, &1i32.to_le_bytes()).unwrap();
    assert_eq!(n.getsockopt(t, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 4).unwrap(), 1i32.to_le_bytes());
    assert_eq!(n.host_fd(t), None);
    assert_eq!(n.poll(t, libc::POLLOUT), libc::POLLOUT | libc::POLLHUP);
    assert_eq!(n.send(t, b"x", None, 0), Err(Errno::EPIPE));
    assert_eq!(n.peer_addr(t), Err(Errno::ENOTCONN));
    assert_eq!(n.connect(t, Some(sa("[2001:db8::1]:443"))), Err(Errno::ECONNREFUSED));
    assert!(n.notes.iter().any(|m| m.contains("refused by the egress policy: test")), "{:?}", n.notes);
    let u = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.connect(u, Some(sa("192.0.2.1:53"))).unwrap(), "a UDP connect sends nothing");
    assert_eq!(n.peer_addr(u).unwrap(), sa("192.0.2.1:53"));
    assert_eq!(n.send(u, b"x", None, 0), Err(Errno(libc::ENETUNREACH)));
    assert_eq!(n.send(u, b"y", Some(sa("192.0.2.2:9")), 0), Err(Errno(libc::ENETUNREACH)));
    let mut b = [0u8; 8];
    assert_eq!(n.recv(u, &mut b, 0), Err(Errno::EAGAIN));
    let r = n.socket(libc::AF_INET, false).unwrap();
    n.send(r, &query(1, "x.test", dns::TYPE_A), Some(resolver_addr()), 0).unwrap();
    let mut a = [0u8; 512];
    let (k, _, _) = n.recv(r, &mut a, 0).unwrap();
    assert_eq!(a[3] & 0xF, dns::RCODE_NXDOMAIN, "the egress' answer: {:?}", &a[..k]);
    assert_eq!(
        *e.asked.lock().unwrap(),
        ["tcp 10 [2001:db8::1]:443", "udp 2 192.0.2.1:53", "udp 2 192.0.2.2:9", "lookup x.test"]
    );
    // Loopback inside the sandbox never asks the egress.
    let l = n.socket(libc::AF_INET, true).unwrap();
    n.bind(l, sa("127.0.0.1:8080")).unwrap();
    n.listen(l, 1).unwrap();
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert!(n.connect(c, Some(sa("127.0.0.1:8080"))).unwrap());
    assert_eq!(e.asked.lock().unwrap().len(), 4);
}

#[test]
fn udplite_sockets_reach_each_other_only_with_a_port_table_of_their_own() {
    let mut n = net(Policy::public());
    let (a, b) = (n.socket_udplite(libc::AF_INET).unwrap(), n.socket_udplite(libc::AF_INET).unwrap());
    let plain = n.socket(libc::AF_INET, false).unwrap();
    assert!(n.is_udplite(a) && !n.is_udplite(plain));
    n.bind(a, sa("127.0.0.1:5000")).unwrap();
    assert_eq!(n.bind(b, sa("127.0.0.1:5000")), Err(Errno::EADDRINUSE));
    // A UDP socket on the same port: another protocol, another table.
    let udp = n.socket(libc::AF_INET, false).unwrap();
    n.bind(udp, sa("127.0.0.1:5000")).unwrap();
    assert_eq!(n.send(b, b"lite", Some(sa("127.0.0.1:5000")), 0), Ok(4));
    let mut buf = [0u8; 16];
    let (k, from, _) = n.recv(a, &mut buf, 0).unwrap();
    assert_eq!(&buf[..k], b"lite");
    let from = from.unwrap();
    assert!(from.ip().is_loopback() && from.port() != 0);
    assert_eq!(n.recv(udp, &mut buf, 0).map(|r| r.0), Err(Errno::EAGAIN), "UDP never sees UDP-Lite");
    // The answer goes back to the sender's ephemeral binding.
    assert_eq!(n.send(a, b"back", Some(from), 0), Ok(4));
    assert_eq!(n.recv(b, &mut buf, 0).map(|r| r.0), Ok(4));
    // Nothing bound there: dropped; outside the sandbox: unreachable (never the egress).
    assert_eq!(n.send(b, b"x", Some(sa("127.0.0.1:5001")), 0), Ok(1));
    assert_eq!(n.send(b, b"x", Some(sa("93.184.216.34:5000")), 0), Err(Errno::ENETUNREACH));
    assert_eq!(n.send(b, b"x", None, 0), Err(Errno::EDESTADDRREQ));
}

#[test]
fn a_connected_udp_socket_names_its_source_in_the_peer_family() {
    let mut n = net(Policy::public());
    let u6 = n.socket(libc::AF_INET6, false).unwrap();
    assert_eq!(n.local_addr(u6).unwrap(), sa("[::]:0"));
    // As getaddrinfo's sorting does: an AF_INET6 socket connected to IPv4 addresses.
    n.connect(u6, Some(sa("[::ffff:127.0.0.1]:80"))).unwrap();
    assert_eq!(n.local_addr(u6).unwrap(), sa("127.0.0.1:0"));
    n.connect(u6, Some(sa("[::ffff:93.184.216.34]:80"))).unwrap();
    assert_eq!(n.local_addr(u6).unwrap(), sa("0.0.0.0:0"));
    n.connect(u6, Some(sa("[::1]:80"))).unwrap();
    assert_eq!(n.local_addr(u6).unwrap(), sa("[::1]:0"));
    n.connect(u6, None).unwrap();
    assert_eq!(n.local_addr(u6).unwrap(), sa("[::]:0"));
}

/// A connection from outside (the port proxy) reaches only a listener of the
/// sandbox on that port, as an accepted connection from loopback; bytes go
/// both ways through the host end the caller kept.
#[test]
fn injected_connections_reach_only_the_sandboxs_own_listener() {
    let mut n = net(Policy::none());
    let pair = || {
        let (a, b) = Socket::pair(Domain::UNIX, Type::STREAM.cloexec(), None).unwrap();
        (std::os::unix::net::UnixStream::from(std::os::fd::OwnedFd::from(a)), std::os::fd::OwnedFd::from(b))
    };
    // No listener (and port 0 never is one).
    assert_eq!(n.inject(8000, pair().1), Err(InjectError::NotListening));
    assert_eq!(n.inject(0, pair().1), Err(InjectError::NotListening));
    // A bound socket that does not listen is not a listener either.
    let b = n.socket(libc::AF_INET, true).unwrap();
    n.bind(b, sa("127.0.0.1:8000")).unwrap();
    assert_eq!(n.inject(8000, pair().1), Err(InjectError::NotListening));
    let l = n.socket(libc::AF_INET6, true).unwrap();
    n.bind(l, sa("[::]:8001")).unwrap();
    n.listen(l, 0).unwrap();
    let (mut outside, end) = pair();
    n.inject(8001, end).unwrap();
    assert_eq!(n.poll(l, libc::POLLIN), libc::POLLIN);
    // Backlog 0 takes one; the next finds it full.
    assert!(matches!(n.inject(8001, pair().1), Err(InjectError::Full(_))));
    let (s, peer) = n.accept(l).unwrap();
    assert!(peer.ip().is_loopback() && peer.port() != 0, "{peer}");
    assert_eq!(n.local_addr(s).unwrap(), sa("127.0.0.1:8001"));
    outside.write_all(b"GET").unwrap();
    let mut buf = [0u8; 8];
    wait(&mut n, s, libc::POLLIN);
    assert_eq!(n.recv(s, &mut buf, 0).map(|r| r.0), Ok(3));
    assert_eq!(n.send(s, b"ok", None, 0), Ok(2));
    n.close(s);
    let mut got = Vec::new();
    outside.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"ok");
    assert_eq!(n.stats.injected_connects, 1);
    assert_eq!(n.stats.bytes_sent + n.stats.bytes_received, 0, "in-sandbox bytes are not egress");
}

/// A listener with its options and a queued (un-accepted) connection, recorded.
fn recorded_listener() -> (NetIo, u64, Vec<ListenerState>) {
    let mut n = net(Policy::none());
    let l = n.socket(libc::AF_INET6, true).unwrap();
    n.setsockopt(l, libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32.to_le_bytes()).unwrap();
    n.setsockopt(l, libc::IPPROTO_TCP, libc::TCP_NODELAY, &1i32.to_le_bytes()).unwrap();
    n.set_timeout(l, true, Some(Duration::from_millis(1500))).unwrap();
    n.bind(l, sa("[::]:8000")).unwrap();
    n.listen(l, 3).unwrap();
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:8000"))), Ok(true));
    // Only listening sockets are recorded (the client end is not one).
    let rec = n.listener_states([c, l, l, 12345]);
    assert_eq!(rec.len(), 1, "{rec:?}");
    (n, l, rec)
}

/// A checkpoint's listener listens again in a new NetIo under its id with
/// its address and options, its queue empty (its encoding in the state file
/// is forkbox-snapshot's, tested there with the golden files).
#[test]
fn a_recorded_listener_listens_again_after_a_restore() {
    let (_old, l, rec) = recorded_listener();
    let r = &rec[0];
    assert_eq!((r.id, r.domain, r.local, r.backlog, r.reuse), (l, libc::AF_INET6, sa("[::]:8000"), 4, true));

    let mut n = net(Policy::none());
    assert!(!n.is_listening(l), "a fresh NetIo has no socket of the record");
    n.restore_listeners(&rec).unwrap();
    assert!(n.is_listening(l));
    assert_eq!(n.local_addr(l).unwrap(), sa("[::]:8000"));
    assert_eq!(n.getsockopt(l, libc::SOL_SOCKET, libc::SO_REUSEADDR, 4).unwrap(), 1i32.to_le_bytes());
    assert_eq!(n.getsockopt(l, libc::IPPROTO_TCP, libc::TCP_NODELAY, 4).unwrap(), 1i32.to_le_bytes());
    assert_eq!(n.timeouts(l), (Some(Duration::from_millis(1500)), None));
    // The connection queued before the checkpoint is not there (it was a host socket).
    assert_eq!(n.accept(l), Err(Errno::EAGAIN));
    assert_eq!(n.poll(l, libc::POLLIN), 0);
    // It holds its port, takes connections (IPv4 too: a dual-stack wildcard) and the proxy's.
    let other = n.socket(libc::AF_INET, true).unwrap();
    assert_ne!(other, l, "new sockets never take a recorded id");
    assert_eq!(n.bind(other, sa("127.0.0.1:8000")), Err(Errno::EADDRINUSE));
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:8000"))), Ok(true));
    assert_eq!(n.poll(l, libc::POLLIN), libc::POLLIN);
    let (s, _) = n.accept(l).unwrap();
    assert_eq!(n.send(c, b"hi", None, 0), Ok(2));
    let mut b = [0u8; 4];
    wait(&mut n, s, libc::POLLIN);
    assert_eq!(n.recv(s, &mut b, 0).map(|r| r.0), Ok(2));
    let (_outside, end) = Socket::pair(Domain::UNIX, Type::STREAM.cloexec(), None).unwrap();
    n.inject(8000, std::os::fd::OwnedFd::from(end)).unwrap();
    assert!(n.accept(l).is_ok());
    // Its backlog is the recorded one (listen(3): 4 queued at most).
    for _ in 0..4 {
        let c = n.socket(libc::AF_INET, true).unwrap();
        assert_eq!(n.connect(c, Some(sa("127.0.0.1:8000"))), Ok(true));
    }
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:8000"))), Err(Errno::ECONNREFUSED));
    // Closing it frees the port.
    n.close(l);
    assert!(!n.is_listening(l));
}

/// Two sandboxes restored from one record (two forks of a checkpoint) each
/// have their own listener: a connection to one never queues on the other.
#[test]
fn two_restores_of_one_record_do_not_share_a_queue() {
    let (_old, l, rec) = recorded_listener();
    let (mut a, mut b) = (net(Policy::none()), net(Policy::none()));
    a.restore_listeners(&rec).unwrap();
    b.restore_listeners(&rec).unwrap();
    let c = a.socket(libc::AF_INET6, true).unwrap();
    assert_eq!(a.connect(c, Some(sa("[::1]:8000"))), Ok(true));
    assert_eq!(a.poll(l, libc::POLLIN), libc::POLLIN);
    assert_eq!(b.poll(l, libc::POLLIN), 0);
    assert_eq!(b.accept(l), Err(Errno::EAGAIN));
    assert!(a.accept(l).is_ok());
}

/// A record `listen` could not have made is refused whole (nothing is made).
#[test]
fn invalid_listener_records_are_refused() {
    let (_old, _l, rec) = recorded_listener();
    let good = rec[0].clone();
    let cases: Vec<(&str, ListenerState)> = vec![
        ("family", ListenerState { domain: libc::AF_UNIX, ..good.clone() }),
        ("v6 on AF_INET", ListenerState { domain: libc::AF_INET, ..good.clone() }),
        ("host address", ListenerState { local: sa("10.0.0.1:80"), ..good.clone() }),
        ("port 0", ListenerState { local: sa("127.0.0.1:0"), ..good.clone() }),
        ("backlog 0", ListenerState { backlog: 0, ..good.clone() }),
        ("backlog", ListenerState { backlog: 1 << 20, ..good.clone() }),
        ("id", ListenerState { id: 0xFFFF_FFFF_0000_0000, ..good.clone() }),
        ("options", ListenerState { opts: vec![((6, 1), vec![0; 4096])], ..good.clone() }),
    ];
    for (what, bad) in cases {
        let mut n = net(Policy::none());
        let r = n.restore_listeners(&[good.clone(), bad]);
        assert!(matches!(r, Err(ListenerRestoreError::Invalid(..))), "{what}: {r:?}");
        assert_eq!(n.open_sockets(), 0, "{what}: nothing made");
    }
    // Two listeners on one port, or one id twice.
    let mut n = net(Policy::none());
    let twin = ListenerState { id: good.id + 1, local: sa("127.0.0.1:8000"), ..good.clone() };
    assert!(n.restore_listeners(&[good.clone(), twin]).is_err());
    assert!(n.restore_listeners(&[good.clone(), good.clone()]).is_err());
    // More than the sandbox's socket limit.
    let mut cfg = NetConfig::with_policy(Policy::none());
    cfg.max_sockets = 0;
    let mut n = NetIo::new(Arc::new(cfg));
    assert!(matches!(n.restore_listeners(&[good]), Err(ListenerRestoreError::Host(_))));
}

/// A new way out (a worker's broker) keeps the restored listeners and the ids.
#[test]
fn a_new_egress_keeps_the_listeners() {
    let (mut old, l, _) = recorded_listener();
    let cfg = Arc::new(NetConfig::with_policy(Policy::none()));
    let egress = Arc::new(Direct::new(Arc::clone(&cfg)));
    let mut n = NetIo::keeping_listeners(&mut old, cfg, egress);
    assert!(n.is_listening(l) && !old.is_listening(l));
    // The connection queued on it (a socket of the old state) is gone: none waits.
    assert_eq!(n.poll(l, libc::POLLIN), 0);
    assert_eq!(n.accept(l), Err(Errno::EAGAIN));
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_ne!(c, l);
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:8000"))), Ok(true));
    assert!(n.accept(l).is_ok());
}

#[test]
fn listening_lists_listeners_and_what_the_port_proxy_reaches() {
    let mut n = net(Policy::none());
    assert!(n.listening().is_empty());
    let wild = n.socket(libc::AF_INET6, true).unwrap();
    n.bind(wild, sa("[::]:8080")).unwrap();
    n.listen(wild, 4).unwrap();
    let lo2 = n.socket(libc::AF_INET, true).unwrap();
    n.bind(lo2, sa("127.0.0.2:7000")).unwrap();
    n.listen(lo2, 4).unwrap();
    let lo = n.socket(libc::AF_INET, true).unwrap();
    n.bind(lo, sa("127.0.0.1:7000")).unwrap();
    n.listen(lo, 4).unwrap();
    // Bound but not listening, and a UDP socket: not listed.
    let bound = n.socket(libc::AF_INET, true).unwrap();
    n.bind(bound, sa("127.0.0.1:9000")).unwrap();
    let udp = n.socket(libc::AF_INET, false).unwrap();
    n.bind(udp, sa("127.0.0.1:9001")).unwrap();
    assert_eq!(
        n.listening(),
        vec![(sa("127.0.0.1:7000"), true), (sa("127.0.0.2:7000"), false), (sa("[::]:8080"), true)]
    );
    n.close(lo);
    assert_eq!(n.listening(), vec![(sa("127.0.0.2:7000"), false), (sa("[::]:8080"), true)]);
}

/// As Linux: SO_REUSEADDR and SO_REUSEPORT read back each as set (either one
/// shares a port), and an accepted socket inherits both.
#[test]
fn reuseaddr_and_reuseport_read_back_apart() {
    let mut n = net(Policy::none());
    let get = |n: &mut NetIo, id, name| {
        i32::from_le_bytes(n.getsockopt(id, libc::SOL_SOCKET, name, 4).unwrap().try_into().unwrap())
    };
    let a = n.socket(libc::AF_INET, true).unwrap();
    n.setsockopt(a, libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32.to_le_bytes()).unwrap();
    assert_eq!((get(&mut n, a, libc::SO_REUSEADDR), get(&mut n, a, libc::SO_REUSEPORT)), (1, 0));
    let b = n.socket(libc::AF_INET, true).unwrap();
    n.setsockopt(b, libc::SOL_SOCKET, libc::SO_REUSEPORT, &7i32.to_le_bytes()).unwrap();
    assert_eq!((get(&mut n, b, libc::SO_REUSEADDR), get(&mut n, b, libc::SO_REUSEPORT)), (0, 1));
    n.setsockopt(b, libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32.to_le_bytes()).unwrap();
    n.setsockopt(b, libc::SOL_SOCKET, libc::SO_REUSEPORT, &0i32.to_le_bytes()).unwrap();
    assert_eq!((get(&mut n, b, libc::SO_REUSEADDR), get(&mut n, b, libc::SO_REUSEPORT)), (1, 0));
    // Two UDP sockets with SO_REUSEPORT share a port.
    let (u1, u2) = (n.socket(libc::AF_INET, false).unwrap(), n.socket(libc::AF_INET, false).unwrap());
    for u in [u1, u2] {
        n.setsockopt(u, libc::SOL_SOCKET, libc::SO_REUSEPORT, &1i32.to_le_bytes()).unwrap();
        n.bind(u, sa("127.0.0.1:7000")).unwrap();
    }
    let l = n.socket(libc::AF_INET, true).unwrap();
    n.setsockopt(l, libc::SOL_SOCKET, libc::SO_REUSEPORT, &1i32.to_le_bytes()).unwrap();
    n.bind(l, sa("127.0.0.1:7001")).unwrap();
    n.listen(l, 1).unwrap();
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:7001"))), Ok(true));
    let (s, _) = n.accept(l).unwrap();
    assert_eq!((get(&mut n, s, libc::SO_REUSEADDR), get(&mut n, s, libc::SO_REUSEPORT)), (0, 1));
    assert_eq!((get(&mut n, c, libc::SO_REUSEADDR), get(&mut n, c, libc::SO_REUSEPORT)), (0, 0));
}

/// As Linux TCP: once the peer closed, the first send is taken (the peer
/// answers it with a reset) and the next fails with EPIPE; after our own
/// shutdown(SHUT_WR) every send fails.
#[test]
fn a_send_after_the_peer_closed_is_taken_once() {
    let mut n = net(Policy::none());
    let l = n.socket(libc::AF_INET, true).unwrap();
    n.bind(l, sa("127.0.0.1:7002")).unwrap();
    n.listen(l, 2).unwrap();
    let c = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c, Some(sa("127.0.0.1:7002"))), Ok(true));
    let (s, _) = n.accept(l).unwrap();
    n.close(c);
    let mut b = [0u8; 8];
    assert_eq!(n.recv(s, &mut b, 0).map(|r| r.0), Ok(0));
    assert_eq!(n.send(s, b"", None, 0), Ok(0), "an empty send too");
    assert_eq!(n.send(s, b"late", None, 0), Err(Errno::EPIPE));
    assert_eq!(n.send(s, b"late", None, 0), Err(Errno::EPIPE));
    let c2 = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c2, Some(sa("127.0.0.1:7002"))), Ok(true));
    let (s2, _) = n.accept(l).unwrap();
    n.close(s2);
    assert_eq!(n.send(c2, b"done!", None, 0), Ok(5));
    assert_eq!(n.send(c2, b"done!", None, 0), Err(Errno::EPIPE));
    let c3 = n.socket(libc::AF_INET, true).unwrap();
    assert_eq!(n.connect(c3, Some(sa("127.0.0.1:7002"))), Ok(true));
    n.shutdown(c3, libc::SHUT_WR).unwrap();
    assert_eq!(n.send(c3, b"x", None, 0), Err(Errno::EPIPE));
}
