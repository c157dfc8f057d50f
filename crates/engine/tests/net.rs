//! Guest networking end to end: real CPython clients in a KVM sandbox against
//! real servers on this machine only (loopback, or a network namespace the
//! test creates), under the egress policy. Nothing here targets an address
//! outside this machine: every "denied" destination is refused by the VMM
//! before any packet leaves.
//!
//! These tests need /dev/kvm (and root for the network-namespace test). Without
//! them they FAIL: they are never skipped.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, ExecResult, Limits, NetConfig, NetPolicy, Sandbox};
use forkbox_linux::net::{Mode, Rule};

fn home() -> PathBuf {
    match std::env::var("FORKBOX_HOME") {
        Ok(h) if !h.is_empty() => PathBuf::from(h),
        _ => forkbox_image::default_home(),
    }
}

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
            panic!("these tests need KVM: cannot open /dev/kvm read-write ({e}); they are deliberately not skipped");
        }
        let home = home();
        let built = forkbox_image::build(&forkbox_engine::default_image_spec(), &forkbox_image::BuildOptions { home: home.clone(), progress: false })
            .unwrap_or_else(|e| panic!("building the default image under {}: {e}", home.display()));
        Engine::open(&built.path).unwrap_or_else(|e| panic!("Engine::open: {e}"))
    })
}

fn rules(r: &[&str]) -> Vec<Rule> {
    r.iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{e}"))).collect()
}

fn public_with(allow: &[&str]) -> NetConfig {
    NetConfig::with_policy(NetPolicy { mode: Mode::Public, allow: rules(allow), deny: vec![] })
}

fn boot(network: NetConfig) -> Sandbox {
    engine().boot(Limits { network, timeout: Duration::from_secs(20), ..Limits::default() }).unwrap_or_else(|e| panic!("boot failed: {e}"))
}

#[track_caller]
fn run(sb: &mut Sandbox, code: &str) -> ExecResult {
    sb.exec(code).unwrap_or_else(|e| panic!("engine error {e:?}\n--- code ---\n{code}"))
}

#[track_caller]
fn ok(sb: &mut Sandbox, code: &str) -> ExecResult {
    let r = run(sb, code);
    if let Some(e) = &r.error {
        panic!("unexpected {}: {}\n{}\n--- code ---\n{code}\n--- stderr ---\n{}", e.kind, e.message, e.traceback, r.stderr);
    }
    r
}

#[track_caller]
fn value(sb: &mut Sandbox, code: &str) -> String {
    ok(sb, code).value.unwrap_or_else(|| panic!("no value for\n{code}"))
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
    assert_eq!(value(&mut sb, &format!("urllib.request.urlopen('http://web.test:{p}/hello.txt').read().decode()")), format!("{HELLO:?}").replace('"', "'"));
    // getaddrinfo through /etc/resolv.conf -> the VMM.
    assert_eq!(value(&mut sb, "import socket\nsorted({a[4][0] for a in socket.getaddrinfo('web.test', 80)})"), "['127.0.0.1']");
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
    assert_eq!(value(&mut sb, &code), format!("([(200, {}), (200, {})], ('127.0.0.1', {p}), (True, 1, 0))", HELLO.len(), 1 << 20));
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
    assert!(st.denied.contains_key("loopback address") && st.denied.contains_key("metadata address") && st.denied.contains_key("private address"), "{st:?}");
    // A name that resolves only to denied addresses is refused by the resolver.
    for name in ["rebind.test", "meta.test"] {
        let r = run(&mut sb, &format!("socket.getaddrinfo('{name}', {port})"));
        assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{name}: {r:?}");
        assert!(r.stderr.contains("resolves only to addresses the egress policy denies"), "{:?}", r.stderr);
    }
    assert!(sb.net_stats().dns_refused >= 2);
    // A UDP datagram to the loopback is refused too.
    let r = run(&mut sb, &format!("u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nu.sendto(b'x', ('127.0.0.1', {port}))"));
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("ConnectionRefusedError"), "{r:?}");
    // Nothing reached the host's loopback listener, and the sandbox is still usable.
    l.set_nonblocking(true).unwrap();
    assert!(l.accept().is_err(), "a connection reached the host's loopback");
    assert_eq!(value(&mut sb, "6 * 7"), "42");
}

#[test]
fn network_none_refuses_everything_and_dns() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let mut cfg = NetConfig::with_policy(NetPolicy { mode: Mode::None, allow: rules(&[&format!("127.0.0.1:{}", srv.port)]), deny: vec![] });
    cfg.hosts.insert("web.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    let mut sb = boot(cfg);
    let r = run(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{}/hello.txt', timeout=3)", srv.port));
    assert!(r.error.as_ref().is_some_and(|e| e.message.contains("Connection refused")), "{r:?}");
    assert!(r.stderr.contains("network: none"), "{:?}", r.stderr);
    let r = run(&mut sb, "import socket\nsocket.getaddrinfo('web.test', 80)");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"));
    assert_eq!(sb.net_stats().connects_denied, 1);
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
    let held = std::thread::spawn(move || silent.accept().map(|(c, _)| {
        std::thread::sleep(Duration::from_secs(3));
        drop(c)
    }));
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
        match std::net::TcpStream::connect_timeout(&format!("10.213.7.2:{}", srv.port).parse().unwrap(), Duration::from_secs(2)) {
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
    assert_eq!(value(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('{url}', timeout=5).read().decode()")), format!("{HELLO:?}").replace('"', "'"));
    assert_eq!(value(&mut sb, &format!("urllib.request.urlopen('http://svc.ns.test:{}/hello.txt', timeout=5).status", srv.port)), "200");
    let r = run(&mut sb, &format!("socket = __import__('socket')\nsocket.create_connection(('10.213.7.1', {}), timeout=3)", srv.port));
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("ConnectionRefusedError"), "{r:?}");
    // A name rule alone never opens a private address (DNS rebinding).
    let mut cfg = NetConfig::with_policy(NetPolicy::allowlist(rules(&["*.ns.test"])));
    cfg.hosts.insert("svc.ns.test".into(), vec!["10.213.7.2".parse().unwrap()]);
    let mut sb = boot(cfg);
    let r = run(&mut sb, &format!("import urllib.request\nurllib.request.urlopen('http://svc.ns.test:{}/hello.txt', timeout=5)", srv.port));
    assert!(r.error.is_some(), "{r:?}");
    assert!(r.stderr.contains("resolves only to addresses the egress policy denies"), "{:?}", r.stderr);
}

#[test]
fn a_checkpoint_never_carries_a_live_connection() {
    let srv = HttpServer::start(None, "127.0.0.1");
    let home = home();
    let template = forkbox_engine::Template::ensure(engine(), &home).unwrap_or_else(|e| panic!("Template::ensure: {e}"));
    let limits = Limits { network: public_with(&[&format!("127.0.0.1:{}", srv.port)]), timeout: Duration::from_secs(20), ..Limits::default() };
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
    template.checkpoint(engine(), &mut sb, &layer, &state, |_| Ok::<(), forkbox_engine::EngineError>(())).unwrap_or_else(|e| panic!("checkpoint: {e}"));
    // The original still has its connection.
    assert_eq!(value(&mut sb, "c.sendall(b'GET /hello.txt HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\nlen(c.recv(1 << 16)) > 0"), "True");
    // A resumed copy (a fork of the checkpoint, or the session after eviction): the socket reads as reset.
    let layers = vec![forkbox_snapshot::Layer::read(&layer).unwrap()];
    for reseed in [false, true] {
        let mut r = template.resume(engine(), &layers, &state, limits.clone(), reseed).unwrap_or_else(|e| panic!("resume: {e}"));
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
        assert_eq!(got, format!("[{}, {}, {}, {}, 1]", libc::ECONNRESET, libc::EPIPE, libc::ENOTCONN, libc::ECONNRESET), "reseed={reseed}");
        // New connections work in the resumed sandbox.
        assert_eq!(value(&mut r, &format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{}/hello.txt').status", srv.port)), "200");
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
