//! Sandbox worker processes, asserted from the outside on the real
//! `forkbox serve` binary: each worker — exec workers and session workers — is
//! jailed (an unprivileged uid, no capabilities, NO_NEW_PRIVS, seccomp, its own
//! namespaces, a root without keys.db or the sessions), a worker killed by its
//! seccomp filter or by SIGKILL mid-exec fails only what it held
//! (`sandbox_crashed`; a session is back at its last checkpoint) and is
//! replaced, sessions run in their tenant's worker (never in the server
//! process), and the workers' CPU time is charged to the key.
//!
//! Needs /dev/kvm and root (the server jails its workers); fails loudly without.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// `forkbox_worker::TEST_FORBIDDEN_SYSCALL`: honoured only with FORKBOX_WORKER_TEST_ACTIONS=1.
const FORBIDDEN_SYSCALL: &str = "#forkbox-test: forbidden-syscall";

struct Server {
    url: String,
    key: String,
    home: tempfile::TempDir,
    proc: Child,
    http: reqwest::Client,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

fn forkbox() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkbox"))
}

/// `forkbox serve` on a fresh home (templates linked to the shared one), with
/// the test-only worker actions on; an unlimited admin key.
fn start(extra: &[&str]) -> Server {
    let shared = forkbox_testkit::shared();
    let home = forkbox_testkit::fresh_home("fbx-workers-");
    let mut proc = forkbox()
        .arg("--home")
        .arg(home.path())
        .args(["serve", "--listen", "127.0.0.1:0", "--image"])
        .arg(&shared.image_path)
        .args(extra)
        .env("FORKBOX_WORKER_TEST_ACTIONS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    let mut url = None;
    let t0 = Instant::now();
    while url.is_none() {
        let line = lines.next().expect("serve ended before it listened").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            url = rest.split_whitespace().next().map(str::to_string);
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "serve did not start");
    }
    std::thread::spawn(move || for _ in lines {});
    let out = forkbox()
        .arg("--home")
        .arg(home.path())
        .args(["key", "create", "--tenant", "t", "--unlimited", "--admin"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().split_whitespace().last().unwrap().to_string();
    Server { url: url.unwrap(), key, home, proc, http: reqwest::Client::new() }
}

impl Server {
    async fn call(&self, method: reqwest::Method, path: &str, key: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    async fn exec(&self, code: &str) -> (u16, Value) {
        self.call(reqwest::Method::POST, "/v1/exec", &self.key, Some(json!({ "code": code }))).await
    }

    /// A new session of `key`'s tenant.
    async fn session(&self, key: &str) -> String {
        let (st, v) = self.call(reqwest::Method::POST, "/v1/sessions", key, Some(json!({}))).await;
        assert_eq!(st, 201, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    async fn session_exec(&self, key: &str, id: &str, code: &str) -> (u16, Value) {
        let path = format!("/v1/sessions/{id}/exec");
        self.call(reqwest::Method::POST, &path, key, Some(json!({ "code": code }))).await
    }

    /// A key of another tenant.
    fn key_of(&self, tenant: &str) -> String {
        let out = forkbox()
            .arg("--home")
            .arg(self.home.path())
            .args(["key", "create", "--tenant", tenant, "--unlimited"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().split_whitespace().last().unwrap().to_string()
    }

    /// The session worker of `tenant` (its listing entry), if it has one.
    async fn session_worker(&self, tenant: &str) -> Option<Value> {
        self.workers().await.into_iter().find(|w| w["kind"] == "sessions" && w["tenant"] == tenant)
    }

    async fn workers(&self) -> Vec<Value> {
        let (st, v) = self.call(reqwest::Method::GET, "/v1/admin/workers", &self.key, None).await;
        assert_eq!(st, 200, "{v}");
        v["workers"].as_array().unwrap().clone()
    }

    /// The exec workers once every slot has a live one again.
    async fn settled_workers(&self) -> Vec<Value> {
        for _ in 0..200 {
            let w: Vec<Value> = self.workers().await.into_iter().filter(|w| w["kind"] == "exec").collect();
            if w.iter().all(|w| w["pid"].is_u64()) {
                return w;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("a worker was not replaced: {:?}", self.workers().await);
    }
}

fn status_field(pid: u64, name: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")).map(|v| v.trim().to_string()))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

fn ns(pid: u32, which: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{which}")).unwrap().display().to_string()
}

/// What a process has open (the targets of /proc/PID/fd).
fn open_files(pid: u64) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .map(|fd| std::fs::read_link(fd.unwrap().path()).map(|p| p.display().to_string()).unwrap_or_default())
        .collect()
}

/// CPU seconds (user + system, all threads) process `pid` used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf with a constant name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / hz
}

/// The jail of worker `pid` (uid `uid`), as the first test asserts it for every worker.
fn assert_jailed(pid: u64, uid: u64, server: u32) {
    assert_ne!(uid, 0);
    assert_eq!(status_field(pid, "Uid"), format!("{uid}\t{uid}\t{uid}\t{uid}"), "worker {pid}");
    assert_eq!(status_field(pid, "Gid"), format!("{uid}\t{uid}\t{uid}\t{uid}"), "worker {pid}");
    assert_eq!(status_field(pid, "Groups"), "");
    for cap in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, cap), "0000000000000000", "{cap} of worker {pid}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2");
    // Its launcher (its parent, outside its pid namespace, which only waits for it): the same
    // unprivileged uid, and a seccomp filter of its own.
    let launcher: u64 = status_field(pid, "PPid").parse().unwrap();
    assert_ne!(launcher as u32, server, "worker {pid} has a launcher");
    assert_eq!(status_field(launcher, "Uid"), format!("{uid}\t{uid}\t{uid}\t{uid}"), "launcher {launcher}");
    assert_eq!(status_field(launcher, "NoNewPrivs"), "1", "launcher {launcher}");
    assert_eq!(status_field(launcher, "Seccomp"), "2", "launcher {launcher}");
    for n in ["user", "mnt", "pid", "ipc", "uts", "cgroup"] {
        assert_ne!(ns(pid as u32, n), ns(server, n), "{n} namespace of worker {pid}");
    }
    // Its open files: no keys.db, nothing of the sessions.
    for target in open_files(pid) {
        assert!(!target.contains("keys.db") && !target.contains("sessions"), "worker {pid} has {target} open");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_are_jailed_and_see_no_keys_or_sessions() {
    let s = start(&["--exec-slots", "2"]);
    // A session exists (on the server's side), so there is a sessions directory to not see.
    let (st, v) = s.call(reqwest::Method::POST, "/v1/sessions", &s.key, Some(json!({}))).await;
    assert_eq!(st, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (st, v) = s
        .call(reqwest::Method::POST, &format!("/v1/sessions/{id}/exec"), &s.key, Some(json!({"code": "x = 41"})))
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(s.home.path().join("server/keys.db").exists());

    let (st, v) = s.exec("import os\n(os.getuid(), 6 * 7)").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["value"], "(0, 42)", "{v}");
    let (st, v) = s.call(reqwest::Method::GET, "/v1/admin/workers", &s.key, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["isolation"], "process");
    let all = v["workers"].as_array().unwrap();
    let workers: Vec<&Value> = all.iter().filter(|w| w["kind"] == "exec").collect();
    assert_eq!(workers.len(), 2, "{v}");
    // The session's exec ran in its tenant's session worker (beside a spare for the next tenant).
    let sessions: Vec<&Value> = all.iter().filter(|w| w["kind"] == "sessions").collect();
    assert!(sessions.iter().any(|w| w["tenant"] == "t" && w["sandboxes"] == 1), "{v}");
    let server = s.proc.id();
    let mut uids = Vec::new();
    for w in all {
        let pid = w["pid"].as_u64().unwrap();
        let uid = w["uid"].as_u64().unwrap();
        uids.push(uid);
        assert_jailed(pid, uid, server);
        // No network of its own, whatever the egress policy: the broker in the server opens its sandboxes' sockets.
        assert_ne!(ns(pid as u32, "net"), ns(server, "net"), "worker {pid}");
        // Its root: the data directory's images, templates and packages, read-only; no keys, no sessions.
        let root = Path::new("/proc").join(pid.to_string()).join("root");
        let mut home: Vec<String> = std::fs::read_dir(root.join("home"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        home.sort();
        assert_eq!(home, ["images", "packages", "templates"]);
        assert!(!root.join("home/server").exists() && !root.join("home/sessions").exists());
        let err = std::fs::write(root.join("home/templates/probe"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        let err = std::fs::write(root.join("probe"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    }
    let n = uids.len();
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), n, "each worker has a uid of its own");
    // Operators only.
    let out = forkbox().arg("--home").arg(s.home.path()).args(["key", "create", "--tenant", "u"]).output().unwrap();
    let plain = String::from_utf8(out.stdout).unwrap().split_whitespace().last().unwrap().to_string();
    let (st, v) = s.call(reqwest::Method::GET, "/v1/admin/workers", &plain, None).await;
    assert_eq!((st, v["error"]["code"].clone()), (403, json!("forbidden")), "{v}");
    // The session (in its worker) is unaffected.
    let (st, v) =
        s.call(reqwest::Method::POST, &format!("/v1/sessions/{id}/exec"), &s.key, Some(json!({"code": "x + 1"}))).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["value"], "42", "{v}");
}

/// Exec and session workers have no network: an empty network namespace of
/// their own (only `lo`), and a filter that lets them open no socket (the
/// test-only action's socket(AF_INET) kills the worker). Their sandboxes'
/// connections, datagrams and lookups go through the egress broker in the
/// server, under the policy the server holds: an allowlisted loopback service
/// is reached, anything else on loopback is refused with the usual note.
#[tokio::test(flavor = "multi_thread")]
async fn workers_have_no_network_and_their_egress_goes_through_the_broker() {
    let service = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = service.local_addr().unwrap().port();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let uport = udp.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in service.incoming() {
            let Ok(mut c) = c else { return };
            use std::io::{Read, Write};
            let mut b = [0u8; 5];
            if c.read_exact(&mut b).is_ok() {
                let _ = c.write_all(&b);
            }
        }
    });
    std::thread::spawn(move || {
        let mut b = [0u8; 64];
        while let Ok((n, from)) = udp.recv_from(&mut b) {
            let _ = udp.send_to(&b[..n], from);
        }
    });
    let allow = [format!("127.0.0.1:{port}"), format!("127.0.0.1:{uport}")];
    let s = start(&["--exec-slots", "1", "--egress-allow", &allow[0], "--egress-allow", &allow[1]]);
    let code = format!(
        "import socket\n\
         c = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n\
         c.sendall(b'hello')\n\
         got = c.recv(5)\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         u.settimeout(10)\n\
         u.sendto(b'ping', ('127.0.0.1', {uport}))\n\
         back = u.recv(16)\n\
         try:\n\
         \x20   socket.create_connection(('127.0.0.1', {other}), timeout=10)\n\
         \x20   r = 'connected'\n\
         except OSError as e:\n\
         \x20   r = type(e).__name__\n\
         (got, back, r)",
        other = port.wrapping_add(1).max(1)
    );
    let (st, v) = s.exec(&code).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["value"], "(b'hello', b'ping', 'ConnectionRefusedError')", "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("refused by the egress policy: loopback"), "{v}");
    let workers = s.settled_workers().await;
    assert_eq!(workers.len(), 1);
    let pid = workers[0]["pid"].as_u64().unwrap() as u32;
    assert_ne!(ns(pid, "net"), ns(s.proc.id(), "net"));
    // Nothing but a loopback interface.
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "{dev}");
    // A session worker too.
    let (st, v) = s.call(reqwest::Method::POST, "/v1/sessions", &s.key, Some(json!({}))).await;
    assert_eq!(st, 201, "{v}");
    let sid = v["id"].as_str().unwrap().to_string();
    let (st, v) =
        s.call(reqwest::Method::POST, &format!("/v1/sessions/{sid}/exec"), &s.key, Some(json!({ "code": code }))).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["value"], "(b'hello', b'ping', 'ConnectionRefusedError')", "{v}");
    let workers = s.workers().await;
    let session_pid = workers
        .iter()
        .find(|w| w["kind"] == "sessions")
        .and_then(|w| w["pid"].as_u64())
        .unwrap_or_else(|| panic!("no session worker: {workers:?}")) as u32;
    assert_ne!(ns(session_pid, "net"), ns(s.proc.id(), "net"));
    // The worker's own AF_INET socket: its filter kills it, only that exec fails.
    let (st, v) = s.exec("#forkbox-test: inet-socket").await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "sandbox_crashed", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("seccomp"), "{v}");
    let (st, v) = s.exec("6 * 7").await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_killed_by_its_filter_or_by_sigkill_fails_only_its_exec() {
    let s = start(&["--exec-slots", "2"]);
    let before = s.settled_workers().await;
    // 1. A forbidden system call in the worker (a test-only action): its
    //    filter kills it; the exec gets sandbox_crashed; the next one works.
    let (st, v) = s.exec(FORBIDDEN_SYSCALL).await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "sandbox_crashed", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("seccomp"), "{v}");
    for _ in 0..4 {
        let (st, v) = s.exec("sum(range(10))").await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["value"], "45");
    }
    let after = s.settled_workers().await;
    let restarts: u64 = after.iter().map(|w| w["restarts"].as_u64().unwrap()).sum();
    assert_eq!(restarts, 1, "{after:?}");
    let survivors = before.iter().filter(|b| after.iter().any(|a| a["pid"] == b["pid"])).count();
    assert_eq!(survivors, 1, "only the killed worker was replaced: {before:?} -> {after:?}");
    assert!(after.iter().any(|w| w["last_exit"].as_str().is_some_and(|x| x.contains("SIGSYS"))), "{after:?}");

    // 2. kill -9 of a worker in the middle of an exec.
    let spin = {
        let (http, url, key) = (s.http.clone(), s.url.clone(), s.key.clone());
        tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/exec"))
                .bearer_auth(key)
                .json(&json!({ "code": "while True: pass", "timeout_seconds": 60 }))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    let mut busy = None;
    for _ in 0..200 {
        busy = s.workers().await.into_iter().find(|w| w["busy"] == true).and_then(|w| w["pid"].as_u64());
        if busy.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let pid = busy.expect("no worker became busy");
    tokio::time::sleep(Duration::from_millis(200)).await;
    // SAFETY: a signal to the worker process this test found.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let t0 = Instant::now();
    let (st, v) = tokio::time::timeout(Duration::from_secs(20), spin).await.expect("the exec did not end").unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "sandbox_crashed", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("SIGKILL"), "{v}");
    let (st, v) = s.exec("'still serving'").await;
    assert_eq!(st, 200, "{v}");
    let after = s.settled_workers().await;
    assert!(after.iter().all(|w| w["pid"].as_u64() != Some(pid)));
    let restarts: u64 = after.iter().map(|w| w["restarts"].as_u64().unwrap()).sum();
    assert_eq!(restarts, 2, "{after:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workers_cpu_time_is_charged_to_the_key_and_thread_isolation_has_no_workers() {
    let s = start(&["--exec-slots", "2"]);
    let out = forkbox()
        .arg("--home")
        .arg(s.home.path())
        .args(["key", "create", "--tenant", "cpu", "--cpu-seconds-per-hour", "1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let cpu = String::from_utf8(out.stdout).unwrap().split_whitespace().last().unwrap().to_string();
    let spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass";
    let (st, v) = s.call(reqwest::Method::POST, "/v1/exec", &cpu, Some(json!({ "code": spin }))).await;
    assert_eq!(st, 200, "{v}");
    let mut last = (0, Value::Null);
    for _ in 0..20 {
        last = s.call(reqwest::Method::POST, "/v1/exec", &cpu, Some(json!({ "code": "1" }))).await;
        if last.0 == 429 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(last.0, 429, "{:?}", last.1);
    assert_eq!(last.1["error"]["code"], "cpu_budget_exceeded");
    // The same for a session exec, whose guest ran in the tenant's session worker.
    let out = forkbox()
        .arg("--home")
        .arg(s.home.path())
        .args(["key", "create", "--tenant", "cpu2", "--cpu-seconds-per-hour", "1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let cpu2 = String::from_utf8(out.stdout).unwrap().split_whitespace().last().unwrap().to_string();
    let id = s.session(&cpu2).await;
    let (st, v) = s.session_exec(&cpu2, &id, spin).await;
    assert_eq!(st, 200, "{v}");
    let mut last = (0, Value::Null);
    for _ in 0..20 {
        last = s.session_exec(&cpu2, &id, "1").await;
        if last.0 == 429 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(last.0, 429, "{:?}", last.1);
    assert_eq!(last.1["error"]["code"], "cpu_budget_exceeded");

    let t = start(&["--exec-slots", "2", "--isolation", "thread"]);
    let (st, v) = t.call(reqwest::Method::GET, "/v1/admin/workers", &t.key, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v, json!({ "isolation": "thread", "workers": [] }));
    let (st, v) = t.exec("6 * 7").await;
    assert_eq!((st, v["value"].clone()), (200, json!("42")));
}

#[test]
fn a_template_the_worker_cannot_open_fails_that_exec_only() {
    // The supervisor of `serve`, driven directly: after any `Done`, failed or
    // not, the worker says `Idle`, so the next exec starts at once on the same worker.
    let shared = forkbox_testkit::shared();
    let home = forkbox_testkit::fresh_home("fbx-workers-");
    let mut config = forkbox_worker::Config::new(home.path());
    config.exe = env!("CARGO_BIN_EXE_forkbox").into();
    config.extra_images.push(shared.image_path.clone());
    let dir = home.path().join("templates").join(&shared.template.info.id);
    let good = config.template_ref(&shared.image_path, &dir).unwrap();
    let workers = forkbox_worker::Workers::start(config, 1, None).unwrap();
    let bad = forkbox_worker::TemplateRef { image: good.image.clone(), dir: "/home/templates/missing".into() };
    let limits = forkbox_engine::Limits::default();
    let t0 = Instant::now();
    let r = workers.exec(0, &bad, "1", &limits, None).unwrap();
    assert!(r.result.is_err(), "{:?}", r.result);
    let r = workers.exec(0, &good, "6 * 7", &limits, None).unwrap();
    assert_eq!(r.result.unwrap().value.as_deref(), Some("42"));
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert_eq!(workers.list()[0].restarts, 0);
}

/// Poll `f` until it gives a value (or panic after `what`).
async fn until<T, F: std::future::Future<Output = Option<T>>>(what: &str, mut f: impl FnMut() -> F) -> T {
    for _ in 0..400 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{what} did not happen");
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_run_in_their_tenants_worker_and_its_death_fails_only_what_it_held() {
    let s = start(&["--exec-slots", "2"]);
    let server = s.proc.id();
    let u = s.key_of("u");
    let a = s.session(&s.key).await;
    let b = s.session(&u).await;
    // State persists across execs, in the worker.
    let (st, v) = s.session_exec(&s.key, &a, "x = 41").await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.session_exec(&s.key, &a, "x + 1").await;
    assert_eq!((st, v["value"].clone()), (200, json!("42")), "{v}");
    let (st, v) = s.session_exec(&u, &b, "y = 'u'").await;
    assert_eq!(st, 200, "{v}");
    let wt = s.session_worker("t").await.expect("tenant t has no session worker");
    let wu = s.session_worker("u").await.expect("tenant u has no session worker");
    let (pt, pu) = (wt["pid"].as_u64().unwrap(), wu["pid"].as_u64().unwrap());
    assert_ne!(pt, pu, "one worker per tenant");
    assert_ne!(pt, server as u64);
    assert_ne!(wt["uid"], wu["uid"]);
    assert_jailed(pt, wt["uid"].as_u64().unwrap(), server);
    assert_jailed(pu, wu["uid"].as_u64().unwrap(), server);
    assert_eq!(wt["sandboxes"], 1, "{wt}");
    // The guest runs in the worker, not in the server process: the CPU time of
    // a session exec that spins 1.5 s is the worker's, and the worker holds the VM.
    let spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass";
    let (srv0, w0) = (cpu_seconds(server), cpu_seconds(pt as u32));
    let (st, v) = s.session_exec(&s.key, &a, spin).await;
    assert_eq!(st, 200, "{v}");
    let (srv, w) = (cpu_seconds(server) - srv0, cpu_seconds(pt as u32) - w0);
    assert!(w >= 1.2, "the worker used {w:.2} s of CPU for a 1.5 s spin");
    assert!(srv < 0.5, "the server process used {srv:.2} s of CPU while its session's guest spun 1.5 s");
    let files = open_files(pt);
    assert!(files.iter().any(|f| f.contains("kvm-vcpu")), "the worker holds no vCPU: {files:?}");
    // (and, between operations, no file of the sessions: assert_jailed)
    assert_jailed(pt, wt["uid"].as_u64().unwrap(), server);

    // 1. kill -9 of the worker holding the session, in the middle of `while True: pass`.
    let spin = {
        let (http, url, key, a) = (s.http.clone(), s.url.clone(), s.key.clone(), a.clone());
        tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/sessions/{a}/exec"))
                .bearer_auth(key)
                .json(&json!({ "code": "while True: pass", "timeout_seconds": 25 }))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    until("the session worker became busy", || async {
        s.session_worker("t").await.filter(|w| w["busy"] == true).map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // SAFETY: a signal to the worker process this test found.
    assert_eq!(unsafe { libc::kill(pt as i32, libc::SIGKILL) }, 0);
    let t0 = Instant::now();
    let (st, v) = tokio::time::timeout(Duration::from_secs(20), spin).await.expect("the exec did not end").unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "sandbox_crashed", "{v}");
    assert_eq!(v["error"]["checkpoint"], 3, "rolled back to the spin's checkpoint: {v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("SIGKILL"), "{v}");
    // The session is intact at its previous checkpoint; it comes back in a new worker.
    let (st, v) = s.session_exec(&s.key, &a, "x").await;
    assert_eq!((st, v["value"].clone()), (200, json!("41")), "{v}");
    let wt2 = s.session_worker("t").await.unwrap();
    assert_ne!(wt2["pid"].as_u64().unwrap(), pt);
    assert_eq!(wt2["restarts"], 1, "{wt2}");
    assert!(wt2["last_exit"].as_str().unwrap().contains("SIGKILL"), "{wt2}");
    // The other tenant's worker and its resident session went on.
    assert_eq!(s.session_worker("u").await.unwrap()["pid"].as_u64(), Some(pu));
    let (st, v) = s.call(reqwest::Method::GET, &format!("/v1/sessions/{b}"), &u, None).await;
    assert_eq!((st, v["resident"].clone()), (200, json!(true)), "{v}");
    let (st, v) = s.session_exec(&u, &b, "y").await;
    assert_eq!((st, v["value"].clone()), (200, json!("'u'")), "{v}");

    // 2. A forbidden system call in a session exec (a test-only action): the
    //    worker's filter kills it, and only it.
    let exec_pids: Vec<Value> = s.settled_workers().await.iter().map(|w| w["pid"].clone()).collect();
    let (st, v) = s.session_exec(&s.key, &a, FORBIDDEN_SYSCALL).await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "sandbox_crashed", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("seccomp"), "{v}");
    assert_eq!(v["error"]["checkpoint"], 4, "{v}");
    let (st, v) = s.session_exec(&s.key, &a, "x + 1").await;
    assert_eq!((st, v["value"].clone()), (200, json!("42")), "{v}");
    let wt3 = s.session_worker("t").await.unwrap();
    assert_eq!(wt3["restarts"], 2, "{wt3}");
    assert!(wt3["last_exit"].as_str().unwrap().contains("SIGSYS"), "{wt3}");
    assert_eq!(s.session_worker("u").await.unwrap()["pid"].as_u64(), Some(pu));
    let after: Vec<Value> = s.settled_workers().await.iter().map(|w| w["pid"].clone()).collect();
    assert_eq!(after, exec_pids, "the exec workers were not touched");
    let (st, v) = s.exec("'still serving'").await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn files_and_the_tree_of_states_work_in_session_workers() {
    let s = start(&["--exec-slots", "2"]);
    let a = s.session(&s.key).await;
    let put = s
        .http
        .put(format!("{}/v1/sessions/{a}/files/data/in.txt", s.url))
        .bearer_auth(&s.key)
        .body("hello")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status().as_u16(), 201);
    let got = s.http.get(format!("{}/v1/sessions/{a}/files/data/in.txt", s.url)).bearer_auth(&s.key).send().await;
    assert_eq!(got.unwrap().bytes().await.unwrap().as_ref(), b"hello");
    let (st, v) = s.call(reqwest::Method::GET, &format!("/v1/sessions/{a}/files?dir=/data"), &s.key, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["files"][0]["name"], "in.txt", "{v}");
    assert_eq!(v["files"][0]["size"], 5, "{v}");
    let (st, v) =
        s.session_exec(&s.key, &a, "a = open('/data/in.txt').read()\nopen('/data/out.txt', 'w').write('xyz')").await;
    assert_eq!((st, v["checkpoint"].clone()), (200, json!(2)), "{v}");
    // Variables and a diff, each read in throwaway forks in the tenant's worker.
    let (st, v) =
        s.call(reqwest::Method::GET, &format!("/v1/sessions/{a}/checkpoints/2/variables"), &s.key, None).await;
    assert_eq!(st, 200, "{v}");
    assert!(v["variables"].as_array().unwrap().iter().any(|x| x["name"] == "a" && x["repr"] == "'hello'"), "{v}");
    let (st, v) = s.call(reqwest::Method::GET, &format!("/v1/sessions/{a}/diff?from=1&to=2"), &s.key, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["variables_added"][0]["name"], "a", "{v}");
    assert_eq!(v["files_added"][0]["path"], "/data/out.txt", "{v}");
    // Explore: one branch dropped, one kept as a session.
    let body = json!({ "codes": ["a.upper()", "len(a)"], "keep": [1] });
    let (st, v) = s.call(reqwest::Method::POST, &format!("/v1/sessions/{a}/explore"), &s.key, Some(body)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["branches"][0]["result"]["value"], "'HELLO'", "{v}");
    assert_eq!(v["branches"][1]["result"]["value"], "5", "{v}");
    let kept = v["branches"][1]["session"].as_str().unwrap().to_string();
    let (st, v) = s.session_exec(&s.key, &kept, "a").await;
    assert_eq!((st, v["value"].clone()), (200, json!("'hello'")), "{v}");
    // A template made of a checkpoint (written by the worker into files the server made).
    let body = json!({ "name": "from-a" });
    let (st, v) =
        s.call(reqwest::Method::POST, &format!("/v1/sessions/{a}/checkpoints/2/template"), &s.key, Some(body)).await;
    assert_eq!((st, v["status"].clone()), (201, json!("ready")), "{v}");
    let body = json!({ "code": "a + '!'", "template": "from-a" });
    let (st, v) = s.call(reqwest::Method::POST, "/v1/exec", &s.key, Some(body)).await;
    assert_eq!((st, v["value"].clone()), (200, json!("'hello!'")), "{v}");
    let w = s.session_worker("t").await.expect("no session worker");
    assert_jailed(w["pid"].as_u64().unwrap(), w["uid"].as_u64().unwrap(), s.proc.id());
}

/// The guest-side syscall fuzzer on the real server: random
/// system calls with adversarial arguments, in exec workers and in a tenant's
/// session worker. Every exec ends with a result or a guest-level error, never
/// with `sandbox_crashed` (a worker killed by its own filter would mean the
/// VMM reached a host syscall outside its allow-list) or a server error; no
/// worker is restarted; the server and the session keep serving.
/// `FORKBOX_FUZZ_SEEDS` / `FORKBOX_FUZZ_CHUNKS` / `FORKBOX_FUZZ_CALLS` make it longer.
#[tokio::test(flavor = "multi_thread")]
async fn random_syscalls_in_the_workers_end_only_their_own_exec() {
    use forkbox_testkit::syscall_fuzz::env_num;
    let (seeds, chunks, calls) =
        (env_num("FORKBOX_FUZZ_SEEDS", 6), env_num("FORKBOX_FUZZ_CHUNKS", 8), env_num("FORKBOX_FUZZ_CALLS", 1000));
    let s = start(&["--exec-slots", "2"]);
    let before = s.settled_workers().await;
    let guest_level = ["timeout", "guest_crashed", "guest_exited", "guest_killed", "deadlock", "interrupted"];
    let mut endings = std::collections::BTreeMap::<String, u64>::new();
    for seed in 1..=seeds {
        // Two chunks at a time: both exec workers are busy.
        for pair in (0..chunks).collect::<Vec<_>>().chunks(2) {
            let mut runs = Vec::new();
            for &chunk in pair {
                let code = forkbox_testkit::syscall_fuzz::program(seed * 1_000_003 + chunk, calls, false);
                let (http, url, key) = (s.http.clone(), s.url.clone(), s.key.clone());
                runs.push(tokio::spawn(async move {
                    // Long enough for a chunk that forks a few times to end on a busy 2-core machine.
                    let body = json!({ "code": code, "timeout_seconds": 5 });
                    let r = http.post(format!("{url}/v1/exec")).bearer_auth(key).json(&body).send().await.unwrap();
                    (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
                }));
            }
            for (run, &chunk) in runs.into_iter().zip(pair) {
                let (st, v) = run.await.unwrap();
                let how =
                    if st == 200 { "ok".to_string() } else { v["error"]["code"].as_str().unwrap_or("?").to_string() };
                assert!(
                    how == "ok" || guest_level.contains(&how.as_str()),
                    "seed {seed} chunk {chunk} (chunk seed {}): {st} {v}",
                    seed * 1_000_003 + chunk
                );
                *endings.entry(how).or_default() += 1;
            }
        }
        let (st, v) = s.exec("6 * 7").await;
        assert_eq!((st, &v["value"]), (200, &json!("42")), "after seed {seed}: {v}");
    }
    let after = s.settled_workers().await;
    assert_eq!(
        before.iter().map(|w| &w["pid"]).collect::<Vec<_>>(),
        after.iter().map(|w| &w["pid"]).collect::<Vec<_>>(),
        "no exec worker died: {after:?}"
    );
    assert!(after.iter().all(|w| w["restarts"] == 0), "{after:?}");
    assert!(endings.get("ok").copied().unwrap_or(0) > 0, "no chunk survived its calls: {endings:?}");

    // A session: every fuzz exec is rolled back or committed; the session and its worker go on.
    let id = s.session(&s.key).await;
    let (st, v) = s.session_exec(&s.key, &id, "kept = 'before the fuzz'").await;
    assert_eq!(st, 200, "{v}");
    let worker = s.session_worker("t").await.expect("the tenant's session worker")["pid"].clone();
    for chunk in 0..chunks {
        let code = forkbox_testkit::syscall_fuzz::program(7_000_001 + chunk, calls, false);
        let path = format!("/v1/sessions/{id}/exec");
        let body = json!({ "code": code, "timeout_seconds": 2 });
        let (st, v) = s.call(reqwest::Method::POST, &path, &s.key, Some(body)).await;
        let how = if st == 200 { "ok" } else { v["error"]["code"].as_str().unwrap_or("?") };
        assert!(
            how == "ok" || guest_level.contains(&how) || how == "sandbox_unusable",
            "session chunk {chunk}: {st} {v}"
        );
        // A session whose guest was broken by the fuzz is back at its previous checkpoint.
        let (st, v) = s.session_exec(&s.key, &id, "kept").await;
        assert_eq!((st, &v["value"]), (200, &json!("'before the fuzz'")), "session after chunk {chunk}: {v}");
    }
    let w = s.session_worker("t").await.expect("the tenant's session worker");
    assert_eq!(w["pid"], worker, "the session worker did not die: {w}");
    eprintln!("worker syscall fuzz: {seeds} seeds x {chunks} chunks x {calls} calls; endings {endings:?}");
}
