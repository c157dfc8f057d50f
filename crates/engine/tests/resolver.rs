//! The VMM's resolver against a nameserver of the test's own on loopback
//! (set as the process' upstream): a lookup the nameserver never answers ends
//! at the exec's deadline or at an interrupt, not when the host's resolver
//! gives up; under an `allowlist`, a name no allow rule could match never
//! reaches the nameserver.
//!
//! These tests need /dev/kvm. Without it they FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::net::{IpAddr, UdpSocket};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, EngineError, ExecOptions, Interrupter, Limits, NetConfig, NetPolicy, Sandbox};
use forkbox_linux::net::{dns, resolver, Rule};
use forkbox_testkit::guest::{run, value};

fn engine() -> &'static Engine {
    &forkbox_testkit::shared().engine
}

fn rules(r: &[&str]) -> Vec<Rule> {
    r.iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{e}"))).collect()
}

/// The public address the test nameserver gives every `*.allowed.test` name.
const ALLOWED_ADDR: &str = "93.184.215.14";

/// A nameserver on 127.0.0.1 that records every question's name: names under
/// `hang.test` are never answered, names under `allowed.test` get
/// `ALLOWED_ADDR` (A), anything else NXDOMAIN.
struct Nameserver {
    asked: Arc<Mutex<Vec<String>>>,
}

impl Nameserver {
    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

/// The test binary's nameserver, made the upstream of the VMM's resolver.
fn nameserver() -> &'static Nameserver {
    static NS: OnceLock<Nameserver> = OnceLock::new();
    NS.get_or_init(|| {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = sock.local_addr().unwrap();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&asked);
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                let Ok(q) = dns::parse_query(&buf[..n]) else { continue };
                log.lock().unwrap().push(q.name.clone());
                let reply = if q.name.ends_with(".hang.test") {
                    continue;
                } else if q.name.ends_with(".allowed.test") {
                    dns::response(&q, dns::RCODE_OK, &[ALLOWED_ADDR.parse::<IpAddr>().unwrap()])
                } else {
                    dns::response(&q, dns::RCODE_NXDOMAIN, &[])
                };
                let _ = sock.send_to(&reply, from);
            }
        });
        // Twice: a lookup it never answers takes the resolver's whole budget
        // (two nameservers' time), longer than any wait in these tests.
        resolver::set_upstream(Some(vec![addr, addr]));
        Nameserver { asked }
    })
}

fn boot(network: NetConfig) -> Sandbox {
    nameserver();
    engine()
        .boot(Limits { network, timeout: Duration::from_secs(20), ..Limits::default() })
        .unwrap_or_else(|e| panic!("boot failed: {e}"))
}

#[test]
fn a_nameserver_that_never_answers_ends_at_the_exec_deadline() {
    let ns = nameserver();
    let mut sb = boot(NetConfig::with_policy(NetPolicy::public()));
    let t = Instant::now();
    let r = sb.exec_with(
        "import socket\nsocket.getaddrinfo('x.hang.test', 80)",
        ExecOptions {
            on_output: None,
            interrupt: None,
            timeout: Some(Duration::from_secs(2)),
            job: false,
            prelude: None,
        },
    );
    let took = t.elapsed();
    assert!(matches!(r, Err(EngineError::Timeout(_))), "{r:?}");
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_millis(3000), "the exec took {took:?}");
    assert!(ns.asked().iter().any(|n| n == "x.hang.test"), "the lookup reached the nameserver: {:?}", ns.asked());
}

#[test]
fn an_interrupt_ends_a_lookup_promptly() {
    let ns = nameserver();
    let mut sb = boot(NetConfig::with_policy(NetPolicy::public()));
    let intr = Interrupter::new();
    let fired = Mutex::new(None);
    let r = std::thread::scope(|s| {
        let i2 = intr.clone();
        let fired = &fired;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            let t = Instant::now();
            let hit = i2.interrupt();
            *fired.lock().unwrap() = Some((hit, t));
        });
        sb.exec_with(
            "import socket\nsocket.getaddrinfo('y.hang.test', 80)",
            ExecOptions { on_output: None, interrupt: Some(intr.clone()), timeout: None, job: false, prelude: None },
        )
    });
    let (hit, at) = fired.into_inner().unwrap().expect("the interrupt thread ran");
    let took = at.elapsed();
    assert!(hit, "the interrupt found the exec running");
    let r = r.expect("an interrupted exec is a result, not an error");
    let kind = r.error.as_ref().map(|e| e.kind.clone());
    assert!(matches!(kind.as_deref(), Some("KeyboardInterrupt" | "gaierror")), "{r:?}");
    // Without the interrupt the lookup would take the resolver's whole budget (4 s).
    eprintln!("the exec ended {took:?} after the interrupt");
    assert!(took < Duration::from_millis(1000), "the exec ended {took:?} after the interrupt");
    assert!(ns.asked().iter().any(|n| n == "y.hang.test"), "{:?}", ns.asked());
    assert_eq!(value(&mut sb, "6 * 7"), "42", "the sandbox is still usable");
}

#[test]
fn an_allowlist_resolves_only_names_its_rules_could_match() {
    let ns = nameserver();
    // An address rule and a rule for another domain: neither names exfil.test.
    let mut sb = boot(NetConfig::with_policy(NetPolicy::allowlist(rules(&["10.213.7.2/32", "*.allowed.test"]))));
    for name in ["sk-allowlist-1234.exfil.test", "secret-token.exfil.test", "allowed.test.exfil.test"] {
        let r = run(&mut sb, &format!("import socket\nsocket.getaddrinfo('{name}', 80)"));
        assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{name}: {r:?}");
        assert!(r.stderr.contains("no allow rule of the egress policy names it"), "{name}: {:?}", r.stderr);
    }
    // A name a rule matches is resolved by the nameserver.
    assert_eq!(
        value(&mut sb, "sorted({a[4][0] for a in socket.getaddrinfo('api.allowed.test', 443)})"),
        format!("['{ALLOWED_ADDR}']")
    );
    assert!(ns.asked().iter().any(|n| n == "api.allowed.test"), "{:?}", ns.asked());
    assert!(sb.net_stats().dns_refused >= 3, "{:?}", sb.net_stats());
    // Address rules only: no name is worth asking about.
    let mut sb = boot(NetConfig::with_policy(NetPolicy::allowlist(rules(&[&format!("{ALLOWED_ADDR}/32")]))));
    let r = run(&mut sb, "import socket\nsocket.getaddrinfo('ip-only.allowed.test', 443)");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{r:?}");
    // An inner layer narrows: a name the outer allowlist names but the inner one does not.
    let cfg = NetConfig::with_policy(NetPolicy::allowlist(rules(&["*.allowed.test"])))
        .narrowed(NetPolicy::allowlist(rules(&["other.test"])));
    let mut sb = boot(cfg);
    let r = run(&mut sb, "import socket\nsocket.getaddrinfo('layered.allowed.test', 443)");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{r:?}");
    // `none` resolves nothing.
    let mut sb = boot(NetConfig::with_policy(NetPolicy::none()));
    let r = run(&mut sb, "import socket\nsocket.getaddrinfo('none.allowed.test', 443)");
    assert_eq!(r.error.as_ref().map(|e| e.kind.as_str()), Some("gaierror"), "{r:?}");
    let asked = ns.asked();
    for leaked in ["exfil", "ip-only", "layered", "none.allowed"] {
        assert!(!asked.iter().any(|n| n.contains(leaked)), "{leaked} reached the nameserver: {asked:?}");
    }
}
