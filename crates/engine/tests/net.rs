//! Guest networking end to end: real CPython clients in a KVM sandbox against
//! real servers on this machine only (loopback, or a network namespace the
//! test creates), under the egress policy. Nothing here targets an address
//! outside this machine: every "denied" destination is refused by the VMM
//! before any packet leaves.
//!
//! These tests need /dev/kvm (and root for the network-namespace test). Without
//! them they FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, Limits, NetConfig, NetPolicy, Sandbox};
use forkbox_linux::net::{Mode, Rule};
use forkbox_testkit::guest::{ok, run, value};

/// The test binary's shared engine (KVM checked, default image): forkbox_testkit.
fn engine() -> &'static Engine {
    &forkbox_testkit::shared().engine
}

fn rules(r: &[&str]) -> Vec<Rule> {
    r.iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{e}"))).collect()
}

fn public_with(allow: &[&str]) -> NetConfig {
    NetConfig::with_policy(NetPolicy { mode: Mode::Public, allow: rules(allow), ..NetPolicy::default() })
}

fn boot(network: NetConfig) -> Sandbox {
    engine()
        .boot(Limits { network, timeout: Duration::from_secs(20), ..Limits::default() })
        .unwrap_or_else(|e| panic!("boot failed: {e}"))
}

/// A real Python http.server (the host's python3) on 127.0.0.1, serving a
/// directory with `hello.txt`. Killed on drop.
struct HttpServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

const HELLO: &str = "hello from the host http.server\n";

impl HttpServer {
    fn start(netns: Option<&str>, bind: &str) -> HttpServer {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hello.txt"), HELLO).unwrap();
        std::fs::write(dir.path().join("big.bin"), vec![b'x'; 1 << 20]).unwrap();
        let script = format!(
            "import functools, http.server, sys\n\
             http.server.SimpleHTTPRequestHandler.protocol_version = 'HTTP/1.1'\n\
             h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={:?})\n\
             s = http.server.ThreadingHTTPServer(({bind:?}, 0), h)\n\
             print(s.server_address[1], flush=True)\n\
             s.serve_forever()\n",
            dir.path().to_str().unwrap()
        );
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "python3", "-c", &script]);
                c
            }
            None => {
                let mut c = Command::new("python3");
                c.args(["-c", &script]);
                c
            }
        };
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("start python3 http.server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("http.server did not print its port: {line:?}"));
        HttpServer { child, port, _dir: dir }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn urllib_and_http_client_reach_an_allowlisted_loopback_server() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let mut cfg = public_with(&[&format!("127.0.0.1:{}", srv.port)]);
    cfg.hosts.insert("web.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    let mut sb = boot(cfg);
    let p = srv.port;
    // urllib by address and by a name the VMM's resolver answers.
    assert_eq!(value(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{p}/hello.txt', timeout=10).read().decode()")), format!("{HELLO:?}").replace('"', "'"));
    assert_eq!(
        value(&mut sb, &format!("urllib.request.urlopen('http://web.test:{p}/hello.txt').read().decode()")),
        format!("{HELLO:?}").replace('"', "'")
    );
    // getaddrinfo through /etc/resolv.conf -> the VMM.
    assert_eq!(
        value(&mut sb, "import socket\nsorted({a[4][0] for a in socket.getaddrinfo('web.test', 80)})"),
        "['127.0.0.1']"
    );
    assert_eq!(value(&mut sb, "socket.gethostbyname('localhost')"), "'127.0.0.1'");
    // socket.create_connection + http.client, keep-alive with two requests on one connection.
    let code = format!(
        "import http.client\n\
         c = http.client.HTTPConnection('127.0.0.1', {p})\n\
         c.connect()\n\
         c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
         out = []\n\
         for path in ['/hello.txt', '/big.bin']:\n\
         \x20   c.request('GET', path)\n\
         \x20   r = c.getresponse()\n\
         \x20   out.append((r.status, len(r.read())))\n\
         peer = c.sock.getpeername()\n\
         opts = (c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE), c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))\n\
         c.close()\n\
         (out, peer, opts)"
    );
    assert_eq!(
        value(&mut sb, &code),
        format!("([(200, {}), (200, {})], ('127.0.0.1', {p}), (True, 1, 0))", HELLO.len(), 1 << 20)
    );
    let code = format!("s = socket.create_connection(('127.0.0.1', {p}), timeout=5)\ns.sendall(b'GET /hello.txt HTTP/1.0\\r\\n\\r\\n')\nb = b''\nwhile True:\n    d = s.recv(65536)\n    if not d: break\n    b += d\ns.close()\nb.split(b'\\r\\n')[0]");
    assert_eq!(value(&mut sb, &code), "b'HTTP/1.1 200 OK'");
    let st = sb.net_stats();
    assert!(st.connects_allowed >= 4 && st.connects_denied == 0, "{st:?}");
    assert!(st.bytes_received > (1 << 20) && st.dns_queries >= 2, "{st:?}");
}

#[test]
fn default_policy_refuses_loopback_metadata_and_private_addresses() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut cfg = NetConfig::with_policy(NetPolicy::public());
    cfg.hosts.insert("rebind.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    cfg.hosts.insert("meta.test".into(), vec!["169.254.169.254".parse().unwrap()]);
    let mut sb = boot(cfg);
    let targets = [
        format!("('127.0.0.1', {port})"),
        "('169.254.169.254', 80)".into(),
        "('10.0.0.1', 80)".into(),
        "('172.16.0.1', 80)".into(),
        "('192.168.1.1', 80)".into(),
        "('100.64.0.1', 80)".into(),
    ];
    for t in &targets {
        let r = run(&mut sb, &format!("import socket\nsocket.create_connection({t}, timeout=3)"));
        let e = r.error.as_ref().unwrap_or_else(|| panic!("connect to {t} worked"));
        assert_eq!(e.kind, "ConnectionRefusedError", "{t}: {e:?}");
        assert!(r.stderr.contains("refused by the egress policy"), "{t}: no note on stderr: {:?}", r.stderr);
    }
    for t in [format!("('::1', {port})"), "('fe80::1', 80)".into(), format!("('::ffff:127.0.0.1', {port})")] {
        let r = run(&mut sb, &format!("s = socket.socket(socket.AF_INET6)\ns.connect({t})"));
        assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("ConnectionRefusedError"), "{t}: {r:?}");
    }
    let st = sb.net_stats();
    assert_eq!(st.connects_denied, 9, "{st:?}");
    assert_eq!(st.connects_allowed, 0);
    assert!(
        st.denied.contains_key("loopback address")
            && st.denied.contains_key("metadata address")
            && st.denied.contains_key("private address"),
        "{st:?}"
    );
    // A name that resolves only to denied addresses is refused by the resolver.
    for name in ["rebind.test", "meta.test"] {
        let r = run(&mut sb, &format!("socket.getaddrinfo('{name}', {port})"));
        assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{name}: {r:?}");
        assert!(r.stderr.contains("resolves only to addresses the egress policy denies"), "{:?}", r.stderr);
    }
    assert!(sb.net_stats().dns_refused >= 2);
    // A UDP datagram to the host's loopback is refused too: an unconnected
    // sendto says it was sent (Linux drops a datagram for a closed port and
    // never tells an unconnected socket), a connected socket gets ECONNREFUSED.
    let host_udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let uport = host_udp.local_addr().unwrap().port();
    let r = run(
        &mut sb,
        &format!("u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nu.sendto(b'x', ('127.0.0.1', {uport}))"),
    );
    assert_eq!(r.value.as_deref(), Some("1"), "{r:?}");
    let r = run(
        &mut sb,
        &format!(
            "c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nc.connect(('127.0.0.1', {uport}))\nc.send(b'x')"
        ),
    );
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("ConnectionRefusedError"), "{r:?}");
    // Nothing reached the host's loopback listener or UDP socket, and the sandbox is still usable.
    l.set_nonblocking(true).unwrap();
    assert!(l.accept().is_err(), "a connection reached the host's loopback");
    host_udp.set_nonblocking(true).unwrap();
    assert!(host_udp.recv(&mut [0u8; 8]).is_err(), "a datagram reached the host's loopback");
    assert_eq!(value(&mut sb, "6 * 7"), "42");
}

#[test]
fn network_none_refuses_everything_and_dns() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let mut cfg = NetConfig::with_policy(NetPolicy {
        mode: Mode::None,
        allow: rules(&[&format!("127.0.0.1:{}", srv.port)]),
        ..NetPolicy::default()
    });
    cfg.hosts.insert("web.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    let mut sb = boot(cfg);
    let r = run(
        &mut sb,
        &format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{}/hello.txt', timeout=3)", srv.port),
    );
    assert!(r.error.as_ref().is_some_and(|e| e.message.contains("Connection refused")), "{r:?}");
    assert!(r.stderr.contains("network: none"), "{:?}", r.stderr);
    let r = run(&mut sb, "import socket\nsocket.getaddrinfo('web.test', 80)");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"));
    assert_eq!(sb.net_stats().connects_denied, 1);
}

/// What glibc finds without any network: services by name and port
/// (`/etc/services` from netbase), the host name (`/etc/hosts`) and the
/// sandbox's one interface, `lo` (netlink RTM_GETLINK, SIOCGIFINDEX /
/// SIOCGIFNAME), which IPv6 scope ids name; nothing of the host's interfaces.
#[test]
fn services_the_host_name_and_the_interface_list_need_no_network() {
    let mut sb = boot(NetConfig::default());
    assert_eq!(
        value(&mut sb, "import socket\n(socket.getservbyname('http', 'tcp'), socket.getservbyport(443, 'tcp'), socket.getservbyname('domain', 'udp'))"),
        "(80, 'https', 53)"
    );
    assert_eq!(
        value(
            &mut sb,
            "sorted({a[4] for a in socket.getaddrinfo('localhost', 'http', socket.AF_INET, socket.SOCK_STREAM)})"
        ),
        "[('127.0.0.1', 80)]"
    );
    assert_eq!(value(&mut sb, "socket.gethostbyname(socket.gethostname())"), "'127.0.1.1'");
    assert_eq!(value(&mut sb, "socket.if_nameindex()"), "[(1, 'lo')]");
    assert_eq!(value(&mut sb, "(socket.if_nametoindex('lo'), socket.if_indextoname(1))"), "(1, 'lo')");
    assert_eq!(
        value(&mut sb, "out = []\nfor f, a in [(socket.if_nametoindex, 'eth0'), (socket.if_indextoname, 2)]:\n    try:\n        f(a)\n    except OSError as e:\n        out.append(e.errno)\nout"),
        "[None, 6]",
        "no such name (if_nametoindex returns 0); glibc's ENXIO for an index"
    );
    assert_eq!(
        value(&mut sb, "socket.getaddrinfo('ff02::1de:c0:face:8D%lo', 1234, socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_UDP)[0][4]"),
        "('ff02::1de:c0:face:8d', 1234, 0, 1)"
    );
    assert_eq!(
        value(
            &mut sb,
            "socket.getnameinfo(('ff02::1de:c0:face:8D', 1234, 0, 1), socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)"
        ),
        "('ff02::1de:c0:face:8d%lo', '1234')"
    );
}

#[test]
fn udp_echo_through_the_vmm() {
    let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = echo.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut b = [0u8; 2048];
        for _ in 0..3 {
            let Ok((n, from)) = echo.recv_from(&mut b) else { return };
            let mut r = b"echo:".to_vec();
            r.extend_from_slice(&b[..n]);
            let _ = echo.send_to(&r, from);
        }
    });
    let mut sb = boot(public_with(&[&format!("127.0.0.1:{port}")]));
    let code = format!(
        "import socket\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         u.settimeout(5)\n\
         u.sendto(b'one', ('127.0.0.1', {port}))\n\
         a = u.recvfrom(100)\n\
         u.connect(('127.0.0.1', {port}))\n\
         u.send(b'two')\n\
         b = u.recv(100)\n\
         (a[0], a[1][1] == {port}, b)"
    );
    assert_eq!(value(&mut sb, &code), "(b'echo:one', True, b'echo:two')");
}

#[test]
fn nonblocking_connect_select_and_timeouts() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let sp = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        silent.accept().map(|(c, _)| {
            std::thread::sleep(Duration::from_secs(3));
            drop(c)
        })
    });
    let mut sb = boot(public_with(&[&format!("127.0.0.1:{}", srv.port), &format!("127.0.0.1:{sp}")]));
    let code = format!(
        "import socket, select, errno\n\
         s = socket.socket()\n\
         s.setblocking(False)\n\
         rc = s.connect_ex(('127.0.0.1', {}))\n\
         _, w, _ = select.select([], [s], [], 5)\n\
         err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)\n\
         s.send(b'GET /hello.txt HTTP/1.0\\r\\n\\r\\n')\n\
         r, _, _ = select.select([s], [], [], 5)\n\
         first = s.recv(15)\n\
         try:\n\
         \x20   while s.recv(4096): pass\n\
         except BlockingIOError:\n\
         \x20   pass\n\
         (rc in (0, errno.EINPROGRESS), len(w), err, len(r), first)",
        srv.port
    );
    assert_eq!(value(&mut sb, &code), "(True, 1, 0, 1, b'HTTP/1.1 200 OK')");
    // A socket timeout on a server that never answers: socket.timeout after ~0.5 s, not a hang.
    let code = format!("import time\nc = socket.create_connection(('127.0.0.1', {sp}), timeout=0.5)\nt = time.time()\ntry:\n    c.recv(10)\n    res = 'data'\nexcept TimeoutError:\n    res = 'timeout'\n(res, 0.4 < time.time() - t < 2.5)");
    assert_eq!(value(&mut sb, &code), "('timeout', True)");
    held.join().unwrap().unwrap();
    // SO_RCVTIMEO on a blocking socket.
    assert_eq!(value(&mut sb, "import struct\nc.setblocking(True)\nc.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack('ll', 1, 0))\nstruct.unpack('ll', c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))"), "(1, 0)");
}

#[test]
fn socket_limit_bounds_parallel_connections() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut cfg = public_with(&[&format!("127.0.0.1:{port}")]);
    cfg.max_sockets = 20;
    let mut sb = boot(cfg);
    let code = format!(
        "import socket, errno\n\
         socks, err = [], None\n\
         for i in range(100):\n\
         \x20   try:\n\
         \x20       socks.append(socket.create_connection(('127.0.0.1', {port}), timeout=5))\n\
         \x20   except OSError as e:\n\
         \x20       err = e.errno\n\
         \x20       break\n\
         n = len(socks)\n\
         for s in socks: s.close()\n\
         again = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n\
         again.close()\n\
         (n, err == errno.EMFILE)"
    );
    assert_eq!(value(&mut sb, &code), "(20, True)");
    drop(l);
}

/// A network namespace with a veth pair: the host side 10.213.<n>.1, the
/// namespace side 10.213.<n>.2. Removed on drop.
struct Netns {
    name: String,
    host_if: String,
}

fn sh(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).status().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(st.success(), "{args:?} failed (these tests need root)");
}

impl Netns {
    fn create(n: u8) -> Netns {
        let name = format!("fbxnet{}-{n}", std::process::id());
        let host_if = format!("fbh{}{n}", std::process::id() % 100000);
        let ns_if = format!("fbn{}{n}", std::process::id() % 100000);
        let _ = Command::new("ip").args(["netns", "del", &name]).stderr(Stdio::null()).status();
        sh(&["ip", "netns", "add", &name]);
        let ns = Netns { name: name.clone(), host_if: host_if.clone() };
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if]);
        sh(&["ip", "link", "set", &ns_if, "netns", &name]);
        sh(&["ip", "addr", "add", &format!("10.213.{n}.1/24"), "dev", &host_if]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        sh(&["ip", "netns", "exec", &name, "ip", "addr", "add", &format!("10.213.{n}.2/24"), "dev", &ns_if]);
        sh(&["ip", "netns", "exec", &name, "ip", "link", "set", &ns_if, "up"]);
        sh(&["ip", "netns", "exec", &name, "ip", "link", "set", "lo", "up"]);
        ns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

#[test]
fn http_server_in_a_network_namespace_allowlisted_by_cidr_and_name() {
    let ns = Netns::create(7);
    let srv = HttpServer::start(Some(&ns.name), "10.213.7.2");
    let url = format!("http://10.213.7.2:{}/hello.txt", srv.port);
    // The host reaches it (sanity: the namespace works).
    let t0 = Instant::now();
    loop {
        match std::net::TcpStream::connect_timeout(
            &format!("10.213.7.2:{}", srv.port).parse().unwrap(),
            Duration::from_secs(2),
        ) {
            Ok(mut c) => {
                c.write_all(b"GET /hello.txt HTTP/1.0\r\n\r\n").unwrap();
                let mut s = String::new();
                c.read_to_string(&mut s).unwrap();
                assert!(s.ends_with(HELLO));
                break;
            }
            Err(e) if t0.elapsed() < Duration::from_secs(5) => {
                eprintln!("waiting for the namespace server: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the host cannot reach the namespace's server: {e}"),
        }
    }
    // Default public: a private address, refused.
    let mut sb = boot(NetConfig::with_policy(NetPolicy::public()));
    let r = run(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('{url}', timeout=5)"));
    assert!(r.error.as_ref().is_some_and(|e| e.message.contains("Connection refused")), "{r:?}");
    assert!(r.stderr.contains("private address"), "{:?}", r.stderr);
    // Allowlisted by CIDR: reachable; the host side of the veth (a host address) is not.
    let mut cfg = NetConfig::with_policy(NetPolicy::allowlist(rules(&["10.213.7.2/32"])));
    cfg.hosts.insert("svc.ns.test".into(), vec!["10.213.7.2".parse().unwrap()]);
    let mut sb = boot(cfg);
    assert_eq!(
        value(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('{url}', timeout=5).read().decode()")),
        format!("{HELLO:?}").replace('"', "'")
    );
    assert_eq!(
        value(
            &mut sb,
            &format!("urllib.request.urlopen('http://svc.ns.test:{}/hello.txt', timeout=5).status", srv.port)
        ),
        "200"
    );
    let r = run(
        &mut sb,
        &format!("socket = __import__('socket')\nsocket.create_connection(('10.213.7.1', {}), timeout=3)", srv.port),
    );
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("ConnectionRefusedError"), "{r:?}");
    // A name rule alone never opens a private address (DNS rebinding).
    let mut cfg = NetConfig::with_policy(NetPolicy::allowlist(rules(&["*.ns.test"])));
    cfg.hosts.insert("svc.ns.test".into(), vec!["10.213.7.2".parse().unwrap()]);
    let mut sb = boot(cfg);
    let r = run(
        &mut sb,
        &format!(
            "import urllib.request\nurllib.request.urlopen('http://svc.ns.test:{}/hello.txt', timeout=5)",
            srv.port
        ),
    );
    assert!(r.error.is_some(), "{r:?}");
    assert!(r.stderr.contains("resolves only to addresses the egress policy denies"), "{:?}", r.stderr);
}

#[test]
fn a_checkpoint_never_carries_a_live_connection() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let home = forkbox_testkit::home();
    let template =
        forkbox_engine::Template::ensure(engine(), &home).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
    let limits = Limits {
        network: public_with(&[&format!("127.0.0.1:{}", srv.port)]),
        timeout: Duration::from_secs(20),
        ..Limits::default()
    };
    let mut sb = template.fork_tracked(engine(), limits.clone()).unwrap_or_else(|e| panic!("fork: {e}"));
    let code = format!(
        "import socket\n\
         c = socket.create_connection(('127.0.0.1', {}), timeout=5)\n\
         c.sendall(b'GET /hello.txt HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
         c.recv(15)",
        srv.port
    );
    assert_eq!(value(&mut sb, &code), "b'HTTP/1.1 200 OK'");
    let dir = tempfile::tempdir().unwrap();
    let (layer, state) = (dir.path().join("layer"), dir.path().join("state"));
    template
        .checkpoint(engine(), &mut sb, &layer, &state, |_| Ok::<(), forkbox_engine::EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    // The original still has its connection.
    assert_eq!(
        value(&mut sb, "c.sendall(b'GET /hello.txt HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\nlen(c.recv(1 << 16)) > 0"),
        "True"
    );
    // A resumed copy (a fork of the checkpoint, or the session after eviction): the socket reads as reset.
    let layers = vec![forkbox_snapshot::Layer::read(&layer).unwrap()];
    for reseed in [false, true] {
        let mut r = template
            .resume(engine(), &layers, &state, limits.clone(), reseed)
            .unwrap_or_else(|e| panic!("resume: {e}"));
        let got = value(
            &mut r,
            "out = []\n\
             for op in (lambda: c.recv(10), lambda: c.send(b'x'), lambda: c.getpeername()):\n\
             \x20   try:\n\
             \x20       out.append(op())\n\
             \x20   except OSError as e:\n\
             \x20       out.append(e.errno)\n\
             out.append(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))\n\
             out.append(c.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE))\n\
             c.close()\n\
             out",
        );
        assert_eq!(
            got,
            format!("[{}, {}, {}, {}, 1]", libc::ECONNRESET, libc::EPIPE, libc::ENOTCONN, libc::ECONNRESET),
            "reseed={reseed}"
        );
        // New connections work in the resumed sandbox.
        assert_eq!(
            value(
                &mut r,
                &format!(
                    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{}/hello.txt').status",
                    srv.port
                )
            ),
            "200"
        );
    }
}

#[test]
fn asyncio_open_connection_over_epoll() {
    // By address: asyncio resolves names in a thread pool, and the guest has no threads yet.
    let srv = HttpServer::start(None, "127.0.0.1");
    let mut sb = boot(public_with(&[&format!("127.0.0.1:{}", srv.port)]));
    let code = format!(
        "import asyncio\n\
         async def get(host):\n\
         \x20   r, w = await asyncio.open_connection(host, {p})\n\
         \x20   w.write(b'GET /hello.txt HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n\
         \x20   await w.drain()\n\
         \x20   data = await asyncio.wait_for(r.read(), 10)\n\
         \x20   w.close()\n\
         \x20   return data.split(b'\\r\\n')[0], data.endswith({hello:?}.encode())\n\
         async def main():\n\
         \x20   return await asyncio.gather(*[get('127.0.0.1') for _ in range(10)])\n\
         res = asyncio.run(main())\n\
         (len(res), set(res))",
        p = srv.port,
        hello = HELLO
    );
    assert_eq!(value(&mut sb, &code), "(10, {(b'HTTP/1.1 200 OK', True)})");
}

// ----- listening sockets inside the sandbox ---------------------------------

/// An http.server inside the sandbox (a thread of the exec), queried by urllib
/// and by an asyncio client in the same exec, with no network at all: the
/// listener and its connections never touch the host's network.
#[test]
fn in_sandbox_http_server_serves_urllib_and_asyncio_in_the_same_exec() {
    let mut sb = boot(NetConfig::with_policy(NetPolicy::none()));
    let code = r#"
import asyncio, http.server, threading, urllib.request
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ('hello ' + self.path).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
port = srv.server_address[1]
t = threading.Thread(target=srv.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
t.start()
got = [urllib.request.urlopen(f'http://127.0.0.1:{port}/u{i}', timeout=10).read() for i in range(3)]
async def get(path):
    r, w = await asyncio.open_connection('127.0.0.1', port)
    w.write(f'GET {path} HTTP/1.0\r\nHost: x\r\n\r\n'.encode())
    await w.drain()
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    return data.split(b'\r\n\r\n', 1)[1]
async def main():
    return await asyncio.gather(*[get(f'/a{i}') for i in range(5)])
got += asyncio.run(main())
srv.shutdown()
srv.server_close()
(32768 <= port <= 60999, got)
"#;
    assert_eq!(
        value(&mut sb, code),
        "(True, [b'hello /u0', b'hello /u1', b'hello /u2', b'hello /a0', b'hello /a1', b'hello /a2', b'hello /a3', b'hello /a4'])"
    );
    let st = sb.net_stats();
    assert!(st.loopback_connects >= 8, "{st:?}");
    assert_eq!(st.connects_allowed, 0, "nothing went through the egress policy: {st:?}");
}

/// asyncio's own server and client on one loop, over the wildcard and IPv6 loopback.
#[test]
fn asyncio_start_server_and_open_connection() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import asyncio, socket
async def echo(r, w):
    data = await r.readline()
    w.write(data.upper())
    await w.drain()
    w.close()
async def one(host, port):
    r, w = await asyncio.open_connection(host, port)
    w.write(b'ping %s\n' % host.encode())
    await w.drain()
    line = await r.readline()
    w.close()
    return line
async def main():
    out = []
    for bind, host, fam in (('0.0.0.0', '127.0.0.1', socket.AF_INET), ('::1', '::1', socket.AF_INET6), ('::', '::1', socket.AF_INET6)):
        srv = await asyncio.start_server(echo, bind, 0, family=fam)
        port = srv.sockets[0].getsockname()[1]
        out += await asyncio.gather(*[one(host, port) for _ in range(3)])
        if bind == '::':
            # asyncio sets IPV6_V6ONLY on its AF_INET6 servers: as on Linux, IPv4 is refused.
            try:
                await one('127.0.0.1', port)
            except ConnectionRefusedError:
                out.append(b'v6only')
        srv.close()
        await srv.wait_closed()
    return out
sorted(set(asyncio.run(main())))
"#;
    assert_eq!(value(&mut sb, code), "[b'PING 127.0.0.1\\n', b'PING ::1\\n', b'v6only']");
}

/// bind/listen/accept semantics: ephemeral ports and getsockname, EADDRINUSE
/// and SO_REUSEADDR, non-blocking accept (EAGAIN), readiness through
/// select/poll/epoll, SO_ACCEPTCONN, the backlog bound, peer addresses.
#[test]
fn listen_accept_semantics() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import errno, select, socket
out = {}
a = socket.socket()
a.bind(('127.0.0.1', 0))
host, port = a.getsockname()
out['ephemeral'] = host == '127.0.0.1' and 32768 <= port <= 60999
a.listen(2)
out['acceptconn'] = a.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
b = socket.socket()
try:
    b.bind(('0.0.0.0', port))
except OSError as e:
    out['inuse'] = e.errno == errno.EADDRINUSE
b.close()
a.setblocking(False)
try:
    a.accept()
except BlockingIOError as e:
    out['eagain'] = e.errno == errno.EAGAIN
out['select_idle'] = select.select([a], [a], [], 0) == ([], [], [])
c = socket.create_connection(('127.0.0.1', port), timeout=5)
out['select_ready'] = select.select([a], [], [], 5)[0] == [a]
p = select.poll(); p.register(a, select.POLLIN | select.POLLOUT)
out['poll'] = p.poll(0) == [(a.fileno(), select.POLLIN)]
e = select.epoll(); e.register(a, select.EPOLLIN)
out['epoll'] = e.poll(1) == [(a.fileno(), select.EPOLLIN)]
s, peer = a.accept()
out['peer'] = peer == c.getsockname() and s.getsockname() == ('127.0.0.1', port) and c.getpeername() == ('127.0.0.1', port)
c.sendall(b'x' * 100000)
got = b''
s.settimeout(5)
while len(got) < 100000:
    got += s.recv(65536)
s.sendall(b'done'); s.shutdown(socket.SHUT_WR)
out['data'] = len(got) == 100000 and c.recv(10) == b'done' and c.recv(10) == b''
s.close(); c.close()
# backlog 2 (Linux takes backlog + 1 before refusing): the fourth pending connect is refused
pend = [socket.create_connection(('127.0.0.1', port), timeout=5) for _ in range(3)]
try:
    socket.create_connection(('127.0.0.1', port), timeout=5)
except ConnectionRefusedError:
    out['backlog'] = True
for x in pend: x.close()
while True:
    try:
        a.accept()[0].close()
    except BlockingIOError:
        break
a.close()
# the port is free once its listener is closed; SO_REUSEADDR lets two unlistened sockets share one
d = socket.socket(); d.bind(('127.0.0.1', port)); d.close()
x = socket.socket(); x.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); x.bind(('127.0.0.1', port))
y = socket.socket(); y.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); y.bind(('127.0.0.1', port))
x.listen()
try:
    y.listen()
except OSError as e:
    out['listen_inuse'] = e.errno == errno.EADDRINUSE
x.close(); y.close()
# nothing listens: refused; an address the sandbox does not have: EADDRNOTAVAIL
try:
    socket.create_connection(('127.0.0.1', port), timeout=5)
except ConnectionRefusedError:
    out['refused'] = True
try:
    socket.socket().bind(('10.1.2.3', 0))
except OSError as e:
    out['notavail'] = e.errno == errno.EADDRNOTAVAIL
out
"#;
    let got = value(&mut sb, code);
    for k in [
        "ephemeral",
        "inuse",
        "eagain",
        "select_idle",
        "select_ready",
        "poll",
        "epoll",
        "peer",
        "data",
        "backlog",
        "listen_inuse",
        "refused",
        "notavail",
    ] {
        assert!(got.contains(&format!("'{k}': True")), "{k} not True in {got}");
    }
    assert!(got.contains("'acceptconn': 1"), "{got}");
}

/// A server in a subprocess (its own VM), queried by the parent.
#[test]
fn sendfile_to_a_tcp_socket_sends_the_file() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import os, socket
data = bytes(range(256)) * 5000
with open('/tmp/big', 'wb') as f:
    f.write(data)
srv = socket.socket()
srv.bind(('127.0.0.1', 0))
srv.listen(1)
c = socket.create_connection(srv.getsockname())
s, _ = srv.accept()
fd = os.open('/tmp/big', os.O_RDONLY)
sent, off = 0, 100
got = bytearray()
while off < len(data):
    n = os.sendfile(c.fileno(), fd, off, len(data) - off)
    off += n
    sent += n
    while len(got) < sent:
        got += s.recv(1 << 20)
head = os.sendfile(c.fileno(), fd, None, 10)
got += s.recv(100)
(sent, bytes(got) == data[100:] + data[:10], head, os.lseek(fd, 0, os.SEEK_CUR))
"#;
    assert_eq!(value(&mut sb, code), "(1279900, True, 10, 10)");
}

#[test]
fn server_in_a_subprocess_is_reached_by_its_parent() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import subprocess, sys, urllib.request
child = r'''
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'from the child'
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(('0.0.0.0', 0), H)
print(s.server_address[1], flush=True)
s.handle_request()
s.handle_request()
'''
p = subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE)
port = int(p.stdout.readline())
got = [urllib.request.urlopen(f'http://localhost:{port}/', timeout=10).read() for _ in range(2)]
(got, p.wait(timeout=20))
"#;
    let r = ok(&mut sb, code);
    assert_eq!(r.value.as_deref(), Some("([b'from the child', b'from the child'], 0)"), "stderr: {}", r.stderr);
}

/// A listening socket takes no host port: while the sandbox listens on a
/// port, the host cannot connect to it; the sandbox still can.
#[test]
fn a_sandbox_listener_is_not_on_the_host() {
    // A port free on the host right now.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut sb = boot(NetConfig::default());
    assert_eq!(
        value(
            &mut sb,
            &format!("import socket\nL = socket.socket()\nL.bind(('0.0.0.0', {port}))\nL.listen()\nL.getsockname()[1]")
        ),
        port.to_string()
    );
    for host in ["127.0.0.1", "0.0.0.0"] {
        let r =
            std::net::TcpStream::connect_timeout(&format!("{host}:{port}").parse().unwrap(), Duration::from_secs(2));
        assert!(r.is_err(), "the host reached the sandbox's listener at {host}:{port}");
    }
    // The listener lives on in the session: the next exec connects to it.
    assert_eq!(
        value(
            &mut sb,
            &format!(
                "c = socket.create_connection(('127.0.0.1', {port}))\ns, _ = L.accept()\nc.send(b'hi')\ns.recv(2)"
            )
        ),
        "b'hi'"
    );
}

/// A guest that floods a loopback connection nobody reads is stopped by the
/// connection's bounded buffer (EAGAIN), and the session stays usable.
#[test]
fn flooding_a_loopback_connection_is_bounded() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import socket
L = socket.socket(); L.bind(('127.0.0.1', 0)); L.listen()
c = socket.create_connection(L.getsockname())
c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
c.setblocking(False)
sent = 0
try:
    while sent < (64 << 20):
        sent += c.send(b'x' * 65536)
except BlockingIOError:
    pass
c.close(); L.close()
sent < (16 << 20)
"#;
    assert_eq!(value(&mut sb, code), "True");
    assert_eq!(value(&mut sb, "1 + 1"), "2");
}

/// The open-socket limit bounds in-sandbox connections too (each end counts):
/// a clean error, and the session usable afterwards.
#[test]
fn socket_limit_bounds_loopback_connections() {
    let cfg = NetConfig { max_sockets: 21, ..NetConfig::default() };
    let mut sb = boot(cfg);
    let code = r#"
import socket, errno
L = socket.socket(); L.bind(('127.0.0.1', 0)); L.listen(200)
conns, err = [], None
for i in range(100):
    try:
        conns.append(socket.create_connection(L.getsockname(), timeout=5))
    except OSError as e:
        err = e.errno
        break
n = len(conns)
for c in conns: c.close()
while True:
    L.setblocking(False)
    try:
        L.accept()[0].close()
    except BlockingIOError:
        break
again = socket.create_connection(L.getsockname(), timeout=5)
(n, err in (errno.ECONNREFUSED, errno.EMFILE))
"#;
    assert_eq!(value(&mut sb, code), "(10, True)");
}

/// Across a checkpoint, a listener keeps listening: in a resumed copy (the
/// session after eviction, or a fork) it holds its port with its options and
/// takes connections from inside and from the port proxy; what it had queued,
/// and connections, read as reset.
#[test]
fn a_checkpoint_keeps_its_listeners() {
    let home = forkbox_testkit::home();
    let template =
        forkbox_engine::Template::ensure(engine(), &home).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
    let limits = Limits { network: NetConfig::default(), timeout: Duration::from_secs(20), ..Limits::default() };
    let mut sb = template.fork_tracked(engine(), limits.clone()).unwrap_or_else(|e| panic!("fork: {e}"));
    let port = value(
        &mut sb,
        "import socket, errno\nL = socket.socket()\nL.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         L.bind(('127.0.0.1', 0))\nL.listen(2)\nc = socket.create_connection(L.getsockname())\nL.getsockname()[1]",
    );
    let dir = tempfile::tempdir().unwrap();
    let (layer, state) = (dir.path().join("layer"), dir.path().join("state"));
    template
        .checkpoint(engine(), &mut sb, &layer, &state, |_| Ok::<(), forkbox_engine::EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    assert_eq!(value(&mut sb, "s, _ = L.accept()\nc.send(b'ok')\ns.recv(2)"), "b'ok'");
    let layers = vec![forkbox_snapshot::Layer::read(&layer).unwrap()];
    for reseed in [false, true] {
        let mut r = template
            .resume(engine(), &layers, &state, limits.clone(), reseed)
            .unwrap_or_else(|e| panic!("resume: {e}"));
        let got = value(
            &mut r,
            &format!(
                "out = [L.getsockname()[1] == {port}, L.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)]\n\
                 L.setblocking(False)\n\
                 try:\n\
                 \x20   L.accept()\n\
                 except OSError as e:\n\
                 \x20   out.append(e.errno == errno.EAGAIN)\n\
                 try:\n\
                 \x20   c.recv(1)\n\
                 except OSError as e:\n\
                 \x20   out.append(e.errno == errno.ECONNRESET)\n\
                 L2 = socket.socket()\n\
                 try:\n\
                 \x20   L2.bind(('127.0.0.1', {port}))\n\
                 except OSError as e:\n\
                 \x20   out.append(e.errno == errno.EADDRINUSE)\n\
                 L.settimeout(5)\n\
                 c2 = socket.create_connection(('127.0.0.1', {port}))\n\
                 s2, peer = L.accept()\n\
                 c2.send(b'hi')\n\
                 out += [peer == c2.getsockname(), s2.recv(2)]\n\
                 out"
            ),
        );
        assert_eq!(got, "[True, 1, True, True, True, True, b'hi']", "reseed={reseed}");
        // From outside (what the port proxy does).
        let (mut outside, end) = std::os::unix::net::UnixStream::pair().unwrap();
        r.connect_port(u16::try_from(port.parse::<u32>().unwrap()).unwrap(), end.into())
            .unwrap_or_else(|e| panic!("connect_port: {e}"));
        outside.write_all(b"ping").unwrap();
        assert_eq!(value(&mut r, "s3, _ = L.accept()\ns3.sendall(s3.recv(4)[::-1])\ns3.close()\n0"), "0");
        let mut back = Vec::new();
        outside.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"gnip", "reseed={reseed}");
    }
}

/// A loopback server of this test: each connection gets `n` bytes, then EOF
/// (`download`), or is read to EOF and answered with the count (`upload`).
fn bulk_server(n: usize) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut first = [0u8; 1];
                if c.read_exact(&mut first).is_err() {
                    return;
                }
                if first[0] == b'D' {
                    let chunk = vec![b'x'; 64 << 10];
                    let mut left = n;
                    while left > 0 {
                        let k = left.min(chunk.len());
                        if c.write_all(&chunk[..k]).is_err() {
                            return;
                        }
                        left -= k;
                    }
                } else {
                    let mut got = 0usize;
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(k) => got += k,
                        }
                    }
                    let _ = c.write_all(got.to_string().as_bytes());
                }
            });
        }
    });
    port
}

/// Guest code moving `n` bytes through the loopback server (`D`: download,
/// `U`: upload); its value is `(bytes, seconds)` as the guest measured them.
fn bulk_code(port: u16, dir: char, n: usize) -> String {
    format!(
        r#"
import socket, time
s = socket.create_connection(('127.0.0.1', {port}), timeout=30)
t = time.monotonic()
if '{dir}' == 'D':
    s.sendall(b'D')
    got = 0
    while True:
        b = s.recv(1 << 20)
        if not b:
            break
        got += len(b)
else:
    s.sendall(b'U')
    data = b'y' * (256 << 10)
    left = {n}
    while left > 0:
        s.sendall(data[:min(left, len(data))])
        left -= min(left, len(data))
    s.shutdown(socket.SHUT_WR)
    got = int(s.recv(64))
(got, time.monotonic() - t)
"#
    )
}

fn bulk(sb: &mut Sandbox, port: u16, dir: char, n: usize) -> (usize, f64) {
    let v = value(sb, &bulk_code(port, dir, n));
    let inner = v.trim_matches(|c| c == '(' || c == ')');
    let (a, b) = inner.split_once(", ").unwrap_or_else(|| panic!("bad value {v}"));
    (a.parse().unwrap(), b.parse().unwrap())
}

#[test]
fn bandwidth_limit_throttles_both_directions_and_unlimited_is_not() {
    const N: usize = 2 << 20;
    const RATE: u64 = 1 << 20;
    let port = bulk_server(N);
    let allow = format!("127.0.0.1:{port}");
    // Unlimited: the 2 MiB go at loopback speed.
    let mut sb = boot(public_with(&[&allow]));
    for dir in ['D', 'U'] {
        let (got, secs) = bulk(&mut sb, port, dir, N);
        assert_eq!(got, N, "{dir}");
        assert!(secs < 1.0, "unlimited {dir}: {secs:.2} s for 2 MiB");
    }
    assert_eq!(sb.net_stats().bytes_received, (N + 7) as u64, "{:?}", sb.net_stats());

    // 1 MiB/s (the smallest layer's): 2 MiB take about 2 s each way (less the
    // bucket's burst of RATE/8), so well over 1.4 s; the session is usable after.
    let mut cfg = public_with(&[&allow]);
    cfg.layers[0].max_bytes_per_second = Some(RATE * 4);
    let inner = NetPolicy { max_bytes_per_second: Some(RATE), ..cfg.layers[0].clone() };
    cfg = cfg.narrowed(inner);
    assert_eq!(cfg.max_bytes_per_second(), Some(RATE));
    let mut sb = boot(cfg);
    for dir in ['D', 'U'] {
        let t = Instant::now();
        let (got, secs) = bulk(&mut sb, port, dir, N);
        assert_eq!(got, N, "{dir}");
        assert!(secs > 1.4, "throttled {dir}: {secs:.2} s for 2 MiB at 1 MiB/s");
        assert!(t.elapsed() < Duration::from_secs(15), "throttled {dir}: {:?}", t.elapsed());
    }
    assert_eq!(value(&mut sb, "6 * 7"), "42");
}

/// UDP between sockets of the same sandbox (a bound socket on loopback, in the
/// sandbox's own port table): sendto/recvfrom with the sender's address, a
/// reply to it, connected sends, select readiness, a thread blocked in
/// recvfrom woken by another's send, EADDRINUSE, datagram boundaries; all
/// under `network: none` (nothing crosses the host).
#[test]
fn udp_between_sockets_of_the_sandbox() {
    let mut sb = boot(NetConfig::default());
    let code = r#"
import errno, select, socket, threading
a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
a.bind(('127.0.0.1', 0))
port = a.getsockname()[1]
b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
b.sendto(b'ping', ('127.0.0.1', port))
assert select.select([a], [], [], 5)[0] == [a]
data, src = a.recvfrom(100)
assert src[0] == '127.0.0.1' and src[1] == b.getsockname()[1], (src, b.getsockname())
a.sendto(b'pong:' + data, src)
reply, src2 = b.recvfrom(100)
assert src2 == ('127.0.0.1', port), src2
# Boundaries are kept; a short buffer truncates one datagram.
b.sendto(b'one', ('127.0.0.1', port)); b.sendto(b'two-two', ('127.0.0.1', port))
got = [a.recv(100), a.recv(3)]
# Connected sends and the wildcard: a socket bound to 0.0.0.0:P takes 127.0.0.1:P
# (a fixed port: the sandbox's own table, no host port is taken).
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.bind(('0.0.0.0', 47001)); cp = c.getsockname()[1]
assert cp == 47001, c.getsockname()
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
d.connect(('127.0.0.1', cp)); d.send(b'connected')
got.append(c.recv(100))
# EADDRINUSE on a taken port.
e = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    e.bind(('127.0.0.1', port)); inuse = False
except OSError as x:
    inuse = x.errno == errno.EADDRINUSE
# An IPv6 socket sending to the IPv4-mapped address: the AF_INET receiver sees an IPv4 source.
f = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
f.sendto(b'six', ('::ffff:127.0.0.1', port))
six, src6 = a.recvfrom(100)
got.append((six, src6[0]))
# A thread blocked in recvfrom is woken by another thread's send.
out = []
t = threading.Thread(target=lambda: out.append(a.recvfrom(100)[0]))
t.start()
import time; time.sleep(0.2)
b.sendto(b'late', ('127.0.0.1', port))
t.join(10)
(data, reply, got, inuse, out, 32768 <= port <= 60999)
"#;
    assert_eq!(
        value(&mut sb, code),
        "(b'ping', b'pong:ping', [b'one', b'two', b'connected', (b'six', '127.0.0.1')], True, [b'late'], True)"
    );
    // Nothing crossed the host.
    let st = sb.net_stats();
    assert_eq!((st.bytes_sent, st.bytes_received, st.connects_denied), (0, 0, 0), "{st:?}");
}
