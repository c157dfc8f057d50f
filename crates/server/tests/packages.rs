//! Packages at run time through the real HTTP API (KVM): `%pip install` lines in
//! session exec code and `POST /v1/sessions/{id}/packages`, served by the host's
//! pip from an offline wheelhouse written by the test (nothing leaves the
//! machine), mounted from shared read-only layers; the packages stay after
//! eviction + resume and in forks, and a checkpoint holds the layer's
//! reference, not its bytes. Without KVM these FAIL.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::Path;
use std::time::{Duration, Instant};

use forkbox_server::{router, Inner, ServerConfig};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Size of the data file in `fbxpkg` (it must not be in any checkpoint).
const DATA_BYTES: usize = 300_000;

/// Wheels written by hand (RECORD with the files' hashes), as pip would download
/// them: `fbxpkg` (needs `fbxdep`, has a big data file), `fbxdep`, `fbxwrap`
/// (needs the denied `fbxevil`), `fbxevil`; and `onlysdist`, an sdist only.
fn wheelhouse(dir: &Path) {
    let script = r#"
import sys, zipfile, hashlib, base64, os
out = sys.argv[1]
def wheel(name, files, requires=()):
    dist = name + '-1.0.dist-info'
    meta = 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' % name
    meta += ''.join('Requires-Dist: %s\n' % r for r in requires)
    files = dict(files)
    files[dist + '/METADATA'] = meta.encode()
    files[dist + '/WHEEL'] = b'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'
    h = lambda d: 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()
    rows = ['%s,%s,%d' % (n, h(d), len(d)) for n, d in files.items()] + [dist + '/RECORD,,']
    files[dist + '/RECORD'] = ('\n'.join(rows) + '\n').encode()
    with zipfile.ZipFile(os.path.join(out, name + '-1.0-py3-none-any.whl'), 'w', zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), d)
data = bytes((i * 7919) % 251 for i in range(300000))
wheel('fbxpkg', {
    'fbxpkg/__init__.py': b"import fbxdep\nGREETING = 'hello from a wheel'\ndef double(x):\n    return 2 * x\ndef dep_value():\n    return fbxdep.VALUE\n",
    'fbxpkg/data.bin': data,
}, requires=['fbxdep'])
wheel('fbxdep', {'fbxdep/__init__.py': b'VALUE = 7\n'})
wheel('fbxwrap', {'fbxwrap/__init__.py': b'import fbxevil\n'}, requires=['fbxevil'])
wheel('fbxevil', {'fbxevil/__init__.py': b'EVIL = 1\n'})
open(os.path.join(out, 'onlysdist-1.0.tar.gz'), 'wb').write(b'an sdist is never unpacked')
"#;
    let st = std::process::Command::new("python3").args(["-I", "-c", script]).arg(dir).status().expect("python3");
    assert!(st.success(), "writing the wheelhouse");
}

struct TestServer {
    url: String,
    key: String,
    home: tempfile::TempDir,
    _house: tempfile::TempDir,
    http: reqwest::Client,
}

async fn start() -> TestServer {
    let home = tempfile::Builder::new().prefix("forkbox-packages-test-").tempdir().unwrap();
    let house = tempfile::Builder::new().prefix("forkbox-wheelhouse-").tempdir().unwrap();
    wheelhouse(house.path());
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), home.path().to_path_buf());
    cfg.pip = forkbox_runtime::PipSource {
        index_url: None,
        find_links: vec![house.path().display().to_string()],
        no_index: true,
    };
    cfg.packages = forkbox_runtime::PackagePolicy { allow: vec![], deny: vec!["FBXEvil".into()] };
    cfg.sessions.idle_timeout = Duration::from_secs(1);
    cfg.maintenance_every = Duration::from_millis(200);
    let h = home.path().to_path_buf();
    let (state, key) = tokio::task::spawn_blocking(move || {
        let state = Inner::with_runtime(forkbox_testkit::runtime(&cfg.home, cfg.runtime()), cfg).expect("server state");
        state.runtime.start_maintenance(|_| {});
        let key = forkbox_server::create_key_with(&h, "alice", &forkbox_server::KeyLimits::unlimited()).unwrap();
        (state, key)
    })
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router(state)).await.unwrap();
    });
    TestServer { url: format!("http://{addr}"), key, home, _house: house, http: reqwest::Client::new() }
}

impl TestServer {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    async fn session(&self) -> String {
        let (st, v) = self.post("/v1/sessions", json!({})).await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// An exec that must succeed without a Python error.
    async fn exec(&self, id: &str, code: &str) -> Value {
        let (st, v) = self.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": code })).await;
        assert_eq!(st, StatusCode::OK, "{code}: {v}");
        assert!(v["error"].is_null(), "{code}: {v}");
        v
    }

    /// The package layers on disk (wheel hashes).
    fn layers(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.home.path().join("packages"))
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

fn assert_error(got: &(StatusCode, Value), status: StatusCode, code: &str, names: &str) {
    assert_eq!(got.0, status, "{}", got.1);
    assert_eq!(got.1["error"]["code"], code, "{}", got.1);
    let msg = got.1["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(names), "the message names {names}: {}", got.1);
    assert!(!msg.contains("/tmp/"), "no host path in an API error: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pip_install_at_run_time() {
    let s = start().await;
    let a = s.session().await;

    // A `%pip install` line: served by the host, pip-like output where the line was.
    let r = s
        .exec(
            &a,
            "print('before')\n%pip install fbxpkg==1.0 -q\nimport fbxpkg\nprint(fbxpkg.double(21), fbxpkg.dep_value())",
        )
        .await;
    let out = r["stdout"].as_str().unwrap();
    assert!(out.starts_with("before\n"), "{out}");
    assert!(out.contains("Installing collected packages: fbxdep, fbxpkg"), "{out}");
    assert!(out.contains("Successfully installed fbxdep-1.0 fbxpkg-1.0\n42 7\n"), "{out}");
    let seq = r["checkpoint"].as_i64().unwrap();
    // The next exec uses it (a fresh import of the dependency too).
    let r = s.exec(&a, "import fbxdep\n(fbxpkg.GREETING, fbxdep.VALUE)").await;
    assert_eq!(r["value"], "('hello from a wheel', 7)");
    let layers = s.layers();
    assert_eq!(layers.len(), 2, "one layer per wheel: {layers:?}");
    for l in &layers {
        let img = s.home.path().join("packages").join(l).join("layer.img");
        assert!(std::fs::metadata(&img).unwrap().permissions().readonly(), "{l} is read-only");
    }
    // The checkpoint holds a reference to the layer, not its 300 KB file.
    let (_, cps) = s.get(&format!("/v1/sessions/{a}/checkpoints")).await;
    let cp = cps["checkpoints"].as_array().unwrap().iter().find(|c| c["seq"] == seq).cloned().unwrap();
    assert!(cp["bytes"].as_u64().unwrap() < (DATA_BYTES as u64) / 2, "checkpoint is {cp}");
    assert!(cp["code"].as_str().unwrap().contains("%pip install fbxpkg==1.0"), "{cp}");

    // A fork has it (its own file system over the same layer).
    let (st, f) = s.post(&format!("/v1/sessions/{a}/fork"), json!({})).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    let b = f["id"].as_str().unwrap().to_string();
    let read_data = "import fbxpkg, os\nd = open(os.path.join(os.path.dirname(fbxpkg.__file__), 'data.bin'), 'rb').read()\n(len(d), d[:3].hex())";
    let r = s.exec(&b, read_data).await;
    assert_eq!(r["value"], format!("({DATA_BYTES}, '008a19')"));
    // Writing to a package file in the fork copies it there only.
    s.exec(&b, "open(fbxpkg.__file__, 'a').write('\\nFORKED = 1\\n')").await;

    // Eviction + resume: the session comes back from disk with the layer mounted again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, g) = s.get(&format!("/v1/sessions/{a}")).await;
        if g["resident"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "session never evicted: {g}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = s.exec(&a, read_data).await;
    assert_eq!(r["value"], format!("({DATA_BYTES}, '008a19')"));
    let r = s.exec(&a, "import importlib, fbxdep\nimportlib.reload(fbxdep).VALUE + fbxpkg.double(5)").await;
    assert_eq!(r["value"], "17");
    let r = s.exec(&a, "'FORKED' in open(fbxpkg.__file__).read()").await;
    assert_eq!(r["value"], "False", "the fork's write stays in the fork");

    // The API route, in a new session: same layers (no new one), then imports work.
    let c = s.session().await;
    let (st, v) = s.post(&format!("/v1/sessions/{c}/packages"), json!({ "packages": ["fbxpkg"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let names: Vec<&str> = v["packages"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["fbxdep", "fbxpkg"], "{v}");
    assert!(v["packages"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["installed"] == true && p["sha256"].as_str().unwrap().len() == 64));
    assert!(v["output"].as_str().unwrap().contains("Successfully installed fbxdep-1.0 fbxpkg-1.0"), "{v}");
    assert!(v["checkpoint"].is_i64(), "{v}");
    assert_eq!(s.layers(), layers, "the same wheels share their layers");
    let r = s.exec(&c, "import fbxpkg\nfbxpkg.double(4)").await;
    assert_eq!(r["value"], "8");
    // Again: already satisfied, nothing new, no checkpoint.
    let (st, v) = s.post(&format!("/v1/sessions/{c}/packages"), json!({ "packages": ["fbxpkg==1.0"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["packages"].as_array().unwrap().iter().all(|p| p["installed"] == false), "{v}");
    assert!(v["checkpoint"].is_null(), "{v}");
    assert!(v["output"].as_str().unwrap().contains("Requirement already satisfied: fbxpkg"), "{v}");

    // Refusals: clear errors naming the package; the session is unchanged.
    let url = format!("/v1/sessions/{c}/packages");
    assert_error(
        &s.post(&url, json!({ "packages": ["onlysdist"] })).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "package_needs_build",
        "onlysdist",
    );
    assert_error(
        &s.post(&url, json!({ "packages": ["nosuchpkg"] })).await,
        StatusCode::NOT_FOUND,
        "package_not_found",
        "nosuchpkg",
    );
    // Denied by name, and as a dependency of an allowed package.
    assert_error(
        &s.post(&url, json!({ "packages": ["fbxevil"] })).await,
        StatusCode::FORBIDDEN,
        "package_not_allowed",
        "fbxevil",
    );
    assert_error(
        &s.post(&url, json!({ "packages": ["fbxwrap"] })).await,
        StatusCode::FORBIDDEN,
        "package_not_allowed",
        "fbxevil",
    );
    for bad in ["--index-url=http://example.com", "x @ https://example.com/x.whl", "../x"] {
        assert_error(&s.post(&url, json!({ "packages": [bad] })).await, StatusCode::BAD_REQUEST, "invalid_request", "");
    }
    // In exec code: the exec does not run, the session stays where it was.
    let got = s.post(&format!("/v1/sessions/{c}/exec"), json!({ "code": "x = 1\n!pip install onlysdist" })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "package_needs_build", "onlysdist");
    let got = s.post(&format!("/v1/sessions/{c}/exec"), json!({ "code": "%pip install -r requirements.txt" })).await;
    assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request", "-r");
    let r = s.exec(&c, "'x' in globals(), fbxpkg.double(1)").await;
    assert_eq!(r["value"], "(False, 2)");
    assert!(s.layers().len() == 2, "refused installs leave no layer: {:?}", s.layers());
}
