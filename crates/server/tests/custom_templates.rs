//! Custom templates through the real HTTP API (KVM): `POST /v1/templates` with pip
//! packages from an offline wheelhouse written by the test (tests never leave the
//! machine), status building -> ready / failed, per-tenant visibility, limits, and
//! templates made of a session's checkpoint. The image builds reuse the shared
//! home's .deb cache and images (a symlink), so only the custom image is built
//! (about a minute the first time; reused afterwards). Without KVM these FAIL.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::Path;
use std::time::{Duration, Instant};

use forkbox_server::ServerConfig;
use forkbox_server_testkit::{assert_error, Key, TestServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A wheel zip written by hand (RECORD with the files' hashes), as pip would download it.
fn write_wheel(dir: &Path, name: &str, module: &str) {
    let script = r#"
import sys, zipfile, hashlib, base64
path, name, module = sys.argv[1], sys.argv[2], sys.argv[3]
dist = name + '-1.0.dist-info'
files = {
    name + '/__init__.py': module.encode(),
    dist + '/METADATA': ('Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' % name).encode(),
    dist + '/WHEEL': b'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
}
def h(d):
    return 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()
rows = ['%s,%s,%d' % (n, h(d), len(d)) for n, d in files.items()] + [dist + '/RECORD,,']
files[dist + '/RECORD'] = ('\n'.join(rows) + '\n').encode()
# Fixed timestamps: the same wheel bytes every run, so its image is reused.
with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
    for n, d in files.items():
        z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), d)
"#;
    let st = std::process::Command::new("python3")
        .args(["-I", "-c", script])
        .arg(dir.join(format!("{name}-1.0-py3-none-any.whl")))
        .arg(name)
        .arg(module)
        .status()
        .expect("python3");
    assert!(st.success(), "writing the wheel");
}

/// A fixed wheelhouse (same bytes every run, so the image is reused across runs).
fn wheelhouse() -> std::path::PathBuf {
    let dir = forkbox_testkit::home().join("test-wheelhouse");
    std::fs::create_dir_all(&dir).unwrap();
    if !dir.join("fbxdemo-1.0-py3-none-any.whl").exists() {
        write_wheel(&dir, "fbxdemo", "GREETING = 'hello from a wheel'\ndef double(x):\n    return 2 * x\n");
    }
    // Only an sdist: pip with --only-binary=:all: must refuse it (nothing is built).
    std::fs::write(dir.join("onlysdist-1.0.tar.gz"), b"an sdist is never unpacked").unwrap();
    dir
}

async fn start() -> TestServer {
    start_with(|_| {}).await
}

/// [`start`] on a server whose config `f` adjusts. The server's key is alice's
/// (no limits, not an admin key).
async fn start_with(f: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let shared = forkbox_testkit::shared();
    let home = tempfile::Builder::new().prefix("forkbox-custom-test-").tempdir().unwrap();
    for d in ["templates", "images", "cache"] {
        std::fs::create_dir_all(shared.home.join(d)).unwrap();
        std::os::unix::fs::symlink(shared.home.join(d), home.path().join(d)).expect("symlink");
    }
    let wheels = wheelhouse().display().to_string();
    TestServer::options()
        .home(home)
        .key("alice", Key::Limits(forkbox_server::KeyLimits::unlimited()))
        .config(move |cfg| {
            cfg.runtime.pip = forkbox_runtime::PipSource { index_url: None, find_links: vec![wheels], no_index: true };
            // A request on a template being built is answered at once (409 template_not_ready):
            // these tests look at the build's states, not at the wait a server may grant.
            cfg.template_wait = Duration::ZERO;
        })
        .config(f)
        .start()
        .await
}

/// Polling a template's build.
trait Builds {
    async fn wait_built(&self, key: &str, name: &str) -> (Value, Vec<String>);
}

impl Builds for TestServer {
    /// Poll a template until it is no longer building; the states seen on the way.
    async fn wait_built(&self, key: &str, name: &str) -> (Value, Vec<String>) {
        let t0 = Instant::now();
        let mut seen = Vec::new();
        loop {
            let (st, v) = self.get_as(key, &format!("/v1/templates/{name}")).await;
            assert_eq!(st, StatusCode::OK, "{v}");
            let status = v["status"].as_str().unwrap().to_string();
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
            if status != "building" {
                return (v, seen);
            }
            assert!(v["progress"].is_string() && v["elapsed_seconds"].is_u64(), "{v}");
            assert!(t0.elapsed() < Duration::from_secs(1200), "template {name} still building: {v}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pip_templates_build_asynchronously_per_tenant() {
    let s = start().await;
    let (a, b) = (s.key.clone(), s.new_key("bob"));

    // Names are checked, shipped names are not shadowed.
    for bad in ["", "Has-Caps", "a/b", "-x", &"x".repeat(64)] {
        let r = s.post_as(&a, "/v1/templates", json!({ "name": bad, "pip": ["fbxdemo"] })).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request");
    }
    assert_error(
        &s.post_as(&a, "/v1/templates", json!({ "name": "python" })).await,
        StatusCode::CONFLICT,
        "template_exists",
    );
    let r = s.post_as(&a, "/v1/templates", json!({ "name": "x", "pip": ["--index-url=http://evil"] })).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request");

    let r = s
        .post_as(&a, "/v1/templates", json!({ "name": "demo", "pip": ["fbxdemo"], "preload": "import fbxdemo" }))
        .await;
    assert_eq!(r.0, StatusCode::ACCEPTED, "{}", r.1);
    assert_eq!(r.1["status"], "building", "{}", r.1);
    assert_eq!(r.1["pip"], json!(["fbxdemo"]));
    // One build per tenant at a time; the same name again is a conflict.
    assert_error(
        &s.post_as(&a, "/v1/templates", json!({ "name": "demo2" })).await,
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_builds",
    );
    assert_error(
        &s.post_as(&a, "/v1/templates", json!({ "name": "demo" })).await,
        StatusCode::CONFLICT,
        "template_exists",
    );
    // Using it while it builds: 409 template_not_ready.
    let r = s.post_as(&a, "/v1/exec", json!({ "code": "1", "template": "demo" })).await;
    assert_error(&r, StatusCode::CONFLICT, "template_not_ready");

    let (v, seen) = s.wait_built(&a, "demo").await;
    assert_eq!(v["status"], "ready", "{v} (seen {seen:?})");
    assert_eq!(seen.first().map(String::as_str), Some("building"), "{seen:?}");
    assert_eq!(v["source"], "custom");
    assert!(v["image_bytes"].as_u64().is_some_and(|n| n > 10 << 20), "{v}");

    // A one-shot exec and a session on it import the wheel's package.
    let r =
        s.post_as(&a, "/v1/exec", json!({ "code": "import fbxdemo\nfbxdemo.double(21)", "template": "demo" })).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(r.1["value"], "42", "{}", r.1);
    let r = s.post_as(&a, "/v1/sessions", json!({ "template": "demo" })).await;
    assert_eq!(r.0, StatusCode::CREATED, "{}", r.1);
    let sid = r.1["id"].as_str().unwrap().to_string();
    let r = s
        .post_as(&a, &format!("/v1/sessions/{sid}/exec"), json!({ "code": "fbxdemo.GREETING, fbxdemo.__file__" }))
        .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let val = r.1["value"].as_str().unwrap();
    assert!(
        val.contains("hello from a wheel") && val.contains("/usr/local/lib/python3.11/dist-packages/fbxdemo"),
        "{val}"
    );

    // Alice lists it; Bob neither sees nor uses it (404, as for a name that does not exist).
    let (_, list) = s.get_as(&a, "/v1/templates").await;
    assert!(list["templates"].as_array().unwrap().iter().any(|t| t["name"] == "demo"), "{list}");
    let (_, list) = s.get_as(&b, "/v1/templates").await;
    let names: Vec<&str> = list["templates"].as_array().unwrap().iter().filter_map(|t| t["name"].as_str()).collect();
    assert!(!names.contains(&"demo") && names.contains(&"python"), "{names:?}");
    assert_error(&s.get_as(&b, "/v1/templates/demo").await, StatusCode::NOT_FOUND, "template_not_found");
    assert_error(
        &s.post_as(&b, "/v1/exec", json!({ "code": "1", "template": "demo" })).await,
        StatusCode::NOT_FOUND,
        "template_not_found",
    );
    assert_error(
        &s.post_as(&b, "/v1/sessions", json!({ "template": "demo" })).await,
        StatusCode::NOT_FOUND,
        "template_not_found",
    );
    assert_error(
        &s.post_as(&b, "/v1/exec", json!({ "code": "1", "template": "alice/demo" })).await,
        StatusCode::NOT_FOUND,
        "template_not_found",
    );

    // An sdist-only spec: the build fails, the message names it.
    let r = s.post_as(&a, "/v1/templates", json!({ "name": "bad", "pip": ["onlysdist"] })).await;
    assert_eq!(r.0, StatusCode::ACCEPTED, "{}", r.1);
    let (v, _) = s.wait_built(&a, "bad").await;
    assert_eq!(v["status"], "failed", "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(
        msg.contains("no binary wheel of onlysdist") && !msg.contains(&wheelhouse().display().to_string()),
        "{msg}"
    );
    let r = s.post_as(&a, "/v1/exec", json!({ "code": "1", "template": "bad" })).await;
    assert!(r.0.is_client_error() || r.0.is_server_error(), "{}", r.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_becomes_a_template_that_outlives_its_session() {
    let s = start().await;
    let (a, b) = (s.key.clone(), s.new_key("bob"));
    let r = s.post_as(&a, "/v1/sessions", json!({})).await;
    assert_eq!(r.0, StatusCode::CREATED, "{}", r.1);
    let sid = r.1["id"].as_str().unwrap().to_string();
    let code = "import json, statistics\nx = 41\ndata = list(range(1000))\nopen('/tmp/note.txt', 'w').write('kept')";
    let r = s.post_as(&a, &format!("/v1/sessions/{sid}/exec"), json!({ "code": code })).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let n = r.1["checkpoint"].as_i64().expect("checkpoint seq");
    // A later state must not leak into the template of checkpoint n.
    let r = s.post_as(&a, &format!("/v1/sessions/{sid}/exec"), json!({ "code": "x = -1" })).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);

    assert_error(
        &s.post_as(&a, &format!("/v1/sessions/{sid}/checkpoints/999/template"), json!({ "name": "snap" })).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
    assert_error(
        &s.post_as(&b, &format!("/v1/sessions/{sid}/checkpoints/{n}/template"), json!({ "name": "snap" })).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.post_as(&a, &format!("/v1/sessions/{sid}/checkpoints/{n}/template"), json!({ "name": "Bad Name" })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );

    let r = s.post_as(&a, &format!("/v1/sessions/{sid}/checkpoints/{n}/template"), json!({ "name": "snap" })).await;
    assert_eq!(r.0, StatusCode::CREATED, "{}", r.1);
    assert_eq!(r.1["status"], "ready", "{}", r.1);
    assert_eq!(r.1["source"], "checkpoint");
    assert_eq!(r.1["from_checkpoint"], n);
    assert_error(
        &s.post_as(&a, &format!("/v1/sessions/{sid}/checkpoints/{n}/template"), json!({ "name": "snap" })).await,
        StatusCode::CONFLICT,
        "template_exists",
    );

    // The session goes; the template stays whole.
    let r = s.call(reqwest::Method::DELETE, &format!("/v1/sessions/{sid}"), Some(&a), None).await;
    assert!(r.0.is_success(), "{}", r.1);
    let probe = "x + 1 + len(data) + len(open('/tmp/note.txt').read()) + statistics.mean([1, 3])";
    for _ in 0..3 {
        let r = s.post_as(&a, "/v1/exec", json!({ "code": probe, "template": "snap" })).await;
        assert_eq!(r.0, StatusCode::OK, "{}", r.1);
        assert_eq!(r.1["value"], "1048", "{}", r.1);
    }
    let r = s.post_as(&a, "/v1/sessions", json!({ "template": "snap" })).await;
    assert_eq!(r.0, StatusCode::CREATED, "{}", r.1);
    let s2 = r.1["id"].as_str().unwrap().to_string();
    assert_eq!(r.1["template"], "snap", "{}", r.1);
    let r = s.post_as(&a, &format!("/v1/sessions/{s2}/exec"), json!({ "code": "x += 1\nx" })).await;
    assert_eq!(r.1["value"], "42", "{}", r.1);
    let r = s.post_as(&a, &format!("/v1/sessions/{s2}/exec"), json!({ "code": "x, json.dumps(data[:2])" })).await;
    assert_eq!(r.1["value"], "(42, '[0, 1]')", "{}", r.1);
    // Forks of it do not share randomness with each other.
    let rnd = "import os\nos.urandom(8).hex()";
    let r1 = s.post_as(&a, "/v1/exec", json!({ "code": rnd, "template": "snap" })).await;
    let r2 = s.post_as(&a, "/v1/exec", json!({ "code": rnd, "template": "snap" })).await;
    assert_ne!(r1.1["value"], r2.1["value"]);

    // Bob cannot use it.
    assert_error(
        &s.post_as(&b, "/v1/exec", json!({ "code": "1", "template": "snap" })).await,
        StatusCode::NOT_FOUND,
        "template_not_found",
    );
}

/// A loopback responder (nothing leaves this machine) that writes `ok` to every connection; its port.
fn ok_responder() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let _ = std::io::Write::write_all(&mut c, b"ok");
        }
    });
    port
}

/// A template's `network` is a policy layer of every sandbox forked from it:
/// one-shot execs, commands, sessions (recorded: forks keep it), inside the
/// server's and the key's; a request on it can only narrow further, and the
/// template cannot open what the key does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_network_policy_narrows_its_sandboxes() {
    let port = ok_responder();
    let s =
        start_with(|cfg| cfg.runtime.limits.network.layers[0].allow.push(format!("127.0.0.1:{port}").parse().unwrap()))
            .await;
    let a = s.key.clone();
    let get = format!("import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\ns.recv(2)");
    let refused = |v: &Value, why: &str| {
        assert_eq!(v["error"]["type"], "ConnectionRefusedError", "{v}");
        assert!(v["stderr"].as_str().is_some_and(|e| e.contains(why)), "{why}: {v}");
    };
    assert_error(
        &s.post_as(&a, "/v1/templates", json!({ "name": "badnet", "network": { "allow": ["not a rule"] } })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.post_as(&a, "/v1/templates", json!({ "name": "badnet", "network": "everything" })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );

    // No packages: the default image (reused), a template of its own with network none.
    let r = s.post_as(&a, "/v1/templates", json!({ "name": "offline", "network": "none" })).await;
    assert_eq!(r.0, StatusCode::ACCEPTED, "{}", r.1);
    let (v, _) = s.wait_built(&a, "offline").await;
    assert_eq!((v["status"].as_str(), v["network"]["mode"].as_str()), (Some("ready"), Some("none")), "{v}");
    let (_, list) = s.get_as(&a, "/v1/templates").await;
    let listed = list["templates"].as_array().unwrap().iter().find(|t| t["name"] == "offline").cloned();
    assert_eq!(listed.map(|t| t["network"]["mode"].clone()), Some(json!("none")), "{list}");
    assert!(list["templates"].as_array().unwrap().iter().all(|t| t["name"] == "offline" || t["network"].is_null()));

    // The default template reaches the server's allowed port; the offline one does not,
    // whatever the request asks for.
    assert_eq!(s.post_as(&a, "/v1/exec", json!({ "code": get })).await.1["value"], "b'ok'");
    let rule = json!({ "allow": [format!("127.0.0.1:{port}")] });
    for network in [Value::Null, json!("public"), rule.clone()] {
        let r = s.post_as(&a, "/v1/exec", json!({ "code": get, "template": "offline", "network": network })).await;
        assert_eq!(r.0, StatusCode::OK, "{}", r.1);
        refused(&r.1, "network: none");
    }
    let py = format!("{get}\nprint('connected')");
    let r = s.post_as(&a, "/v1/commands", json!({ "cmd": ["python3", "-c", py], "template": "offline" })).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert!(r.1["exit_code"] != 0 && r.1["stderr"].as_str().unwrap().contains("ConnectionRefusedError"), "{}", r.1);

    // A session on it records the layer (server, template, request), and its forks keep it.
    let r = s.post_as(&a, "/v1/sessions", json!({ "template": "offline", "network": "public" })).await;
    assert_eq!(r.0, StatusCode::CREATED, "{}", r.1);
    assert_eq!(r.1["limits"]["network"]["mode"], "none", "{}", r.1);
    let layers: Vec<Value> =
        r.1["limits"]["network"]["layers"].as_array().unwrap().iter().map(|l| l["mode"].clone()).collect();
    assert_eq!(layers, vec![json!("public"), json!("none"), json!("public")], "{}", r.1);
    let sid = r.1["id"].as_str().unwrap().to_string();
    refused(&s.post_as(&a, &format!("/v1/sessions/{sid}/exec"), json!({ "code": get })).await.1, "network: none");
    let r = s.post_as(&a, &format!("/v1/sessions/{sid}/fork"), json!({})).await;
    assert!(r.0.is_success(), "{}", r.1);
    let fid = r.1["id"].as_str().unwrap().to_string();
    refused(&s.post_as(&a, &format!("/v1/sessions/{fid}/exec"), json!({ "code": get })).await.1, "network: none");

    // An allowlist template opens only what the server allows too; requests narrow it.
    let r = s.post_as(&a, "/v1/templates", json!({ "name": "listed", "network": rule })).await;
    assert_eq!(r.0, StatusCode::ACCEPTED, "{}", r.1);
    let (v, _) = s.wait_built(&a, "listed").await;
    assert_eq!(v["network"]["allow"], json!([format!("127.0.0.1:{port}")]), "{v}");
    assert_eq!(s.post_as(&a, "/v1/exec", json!({ "code": get, "template": "listed" })).await.1["value"], "b'ok'");
    let r = s.post_as(&a, "/v1/exec", json!({ "code": get, "template": "listed", "network": "none" })).await;
    refused(&r.1, "network: none");
    // A key with egress none: the template's rule does not widen it.
    let home = s.home().to_path_buf();
    let offline_key = tokio::task::spawn_blocking(move || {
        let lim = forkbox_server::KeyLimits {
            egress: Some(forkbox_runtime::NetPolicy::none()),
            ..forkbox_server::KeyLimits::unlimited()
        };
        forkbox_server::create_key_with(&home, "alice", &lim).unwrap()
    })
    .await
    .unwrap();
    let r = s.post_as(&offline_key, "/v1/exec", json!({ "code": get, "template": "listed" })).await;
    refused(&r.1, "network: none");
}
