//! Packages at run time through the real HTTP API (KVM): `%pip install` lines in
//! session exec code and `POST /v1/sessions/{id}/packages`, served by the host's
//! pip from an offline wheelhouse written by the test (nothing leaves the
//! machine), mounted from shared read-only layers; the packages stay after
//! eviction + resume and in forks, and a checkpoint holds the layer's
//! reference, not its bytes. Without KVM these FAIL.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::Path;
use std::time::{Duration, Instant};

use forkbox_server_testkit::{Key, TestServer};
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

/// A server of these tests and the wheelhouse its pip reads.
struct Server {
    s: TestServer,
    house: tempfile::TempDir,
}

impl std::ops::Deref for Server {
    type Target = TestServer;
    fn deref(&self) -> &TestServer {
        &self.s
    }
}

async fn start() -> Server {
    start_with(forkbox_server::KeyLimits::unlimited()).await
}

/// A server whose key has `limits`.
async fn start_with(limits: forkbox_server::KeyLimits) -> Server {
    let home = tempfile::Builder::new().prefix("forkbox-packages-test-").tempdir().unwrap();
    let house = tempfile::Builder::new().prefix("forkbox-wheelhouse-").tempdir().unwrap();
    // The confined pip (uid 65534 when the server is root) reads it.
    std::fs::set_permissions(house.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    wheelhouse(house.path());
    let links = house.path().display().to_string();
    let s = TestServer::options()
        .home(home)
        .key("alice", Key::Limits(limits))
        .config(move |cfg| {
            cfg.runtime.pip = forkbox_runtime::PipSource { index_url: None, find_links: vec![links], no_index: true };
            cfg.runtime.packages = forkbox_runtime::PackagePolicy { allow: vec![], deny: vec!["FBXEvil".into()] };
            // Room for the concurrent first installs of one key (the per-key cap is a server setting).
            cfg.key_installs = 8;
            cfg.runtime.sessions.idle_timeout = Duration::from_secs(1);
            cfg.runtime.maintenance_every = Duration::from_millis(200);
        })
        // An engine of its own: an engine keeps the package layers of the first
        // data directory that uses it, and each test here has its own.
        .runtime(|cfg| {
            let shared = forkbox_testkit::shared();
            let engine = std::sync::Arc::new(forkbox_engine::Engine::open(&shared.image_path).expect("engine"));
            forkbox_runtime::Runtime::with_engine(engine, shared.template.clone(), &cfg.home, cfg.runtime.clone())
                .expect("runtime")
        })
        .maintenance()
        .start()
        .await;
    Server { s, house }
}

impl Server {
    /// The package layers on disk (wheel hashes).
    fn layers(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.home().join("packages"))
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
    let a = s.create_session(json!({})).await;

    // A `%pip install` line: served by the host, pip-like output where the line was.
    let r = s
        .exec_ok(
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
    let r = s.exec_ok(&a, "import fbxdep\n(fbxpkg.GREETING, fbxdep.VALUE)").await;
    assert_eq!(r["value"], "('hello from a wheel', 7)");
    let layers = s.layers();
    assert_eq!(layers.len(), 2, "one layer per wheel: {layers:?}");
    for l in &layers {
        let img = s.home().join("packages").join(l).join("layer.img");
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
    let r = s.exec_ok(&b, read_data).await;
    assert_eq!(r["value"], format!("({DATA_BYTES}, '008a19')"));
    // Writing to a package file in the fork copies it there only.
    s.exec_ok(&b, "open(fbxpkg.__file__, 'a').write('\\nFORKED = 1\\n')").await;

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
    let r = s.exec_ok(&a, read_data).await;
    assert_eq!(r["value"], format!("({DATA_BYTES}, '008a19')"));
    let r = s.exec_ok(&a, "import importlib, fbxdep\nimportlib.reload(fbxdep).VALUE + fbxpkg.double(5)").await;
    assert_eq!(r["value"], "17");
    let r = s.exec_ok(&a, "'FORKED' in open(fbxpkg.__file__).read()").await;
    assert_eq!(r["value"], "False", "the fork's write stays in the fork");

    // The API route, in a new session: same layers (no new one), then imports work.
    let c = s.create_session(json!({})).await;
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
    let r = s.exec_ok(&c, "import fbxpkg\nfbxpkg.double(4)").await;
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
    let r = s.exec_ok(&c, "'x' in globals(), fbxpkg.double(1)").await;
    assert_eq!(r["value"], "(False, 2)");
    assert!(s.layers().len() == 2, "refused installs leave no layer: {:?}", s.layers());
}

/// Write `<dir>/<name>-1.0-py3-none-any.whl`: `files` ((member, kind, arg):
/// `text` with its content, `zeros` or `random` with a byte count, streamed so
/// a 3 GiB member never sits in this process or the script's memory), with
/// RECORD hashes.
fn write_wheel(dir: &Path, name: &str, files: &[(&str, &str, &str)]) {
    let script = r#"
import sys, zipfile, hashlib, base64, os
out, name = sys.argv[1], sys.argv[2]
args = sys.argv[3:]
dist = name + '-1.0.dist-info'
members = [(args[i], args[i + 1], args[i + 2]) for i in range(0, len(args), 3)]
members.append((dist + '/METADATA', 'text', 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' % name))
members.append((dist + '/WHEEL', 'text', 'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'))
def chunks(kind, arg):
    if kind == 'text':
        yield arg.encode(); return
    n = int(arg)
    rnd = os.urandom(1 << 20) if kind == 'random' else bytes(1 << 20)
    while n > 0:
        k = min(n, 1 << 20); n -= k
        yield rnd[:k]
rows = []
path = os.path.join(out, name + '-1.0-py3-none-any.whl')
with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as z:
    for m, kind, arg in members:
        h = hashlib.sha256(); size = 0
        zi = zipfile.ZipInfo(m, date_time=(2020, 1, 1, 0, 0, 0))
        zi.compress_type = zipfile.ZIP_DEFLATED
        with z.open(zi, 'w', force_zip64=True) as f:
            for c in chunks(kind, arg):
                h.update(c); size += len(c); f.write(c)
        rows.append('%s,sha256=%s,%d' % (m, base64.urlsafe_b64encode(h.digest()).rstrip(b'=').decode(), size))
    z.writestr(zipfile.ZipInfo(dist + '/RECORD', date_time=(2020, 1, 1, 0, 0, 0)), '\n'.join(rows + [dist + '/RECORD,,']) + '\n')
"#;
    let mut c = std::process::Command::new("python3");
    c.args(["-I", "-c", script]).arg(dir).arg(name);
    for (m, kind, arg) in files {
        c.args([m, kind, arg]);
    }
    assert!(c.status().expect("python3").success(), "writing wheel {name}");
}

/// An sdist `<name>-1.0.tar.gz` in `dir` whose setup.py, and whose in-tree
/// PEP 517 backend, write `marker` if pip ever runs them.
fn write_sdist(dir: &Path, name: &str, marker: &Path) {
    let script = r#"
import sys, tarfile, io, os
out, name, marker = sys.argv[1], sys.argv[2], sys.argv[3]
root = name + '-1.0'
mark = "open(%r, 'a').write('built ' + __name__ + chr(10))\n" % marker
files = {
    root + '/setup.py': mark + "from setuptools import setup\nsetup(name=%r, version='1.0')\n" % name,
    root + '/pyproject.toml': "[build-system]\nrequires = []\nbuild-backend = 'backend'\nbackend-path = ['.']\n",
    root + '/backend.py': mark + "def get_requires_for_build_wheel(c=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(d, c=None):\n    raise SystemExit(1)\n"
        "def build_wheel(d, c=None, m=None):\n    raise SystemExit(1)\n",
    root + '/PKG-INFO': 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' % name,
}
with tarfile.open(os.path.join(out, root + '.tar.gz'), 'w:gz') as t:
    for n, d in files.items():
        b = d.encode(); i = tarfile.TarInfo(n); i.size = len(b); t.addfile(i, io.BytesIO(b))
"#;
    let st = std::process::Command::new("python3")
        .args(["-I", "-c", script])
        .arg(dir)
        .arg(name)
        .arg(marker)
        .status()
        .expect("python3");
    assert!(st.success(), "writing sdist {name}");
}

/// Removes the files a test put in the server's working directory.
struct Cleanup(Vec<std::path::PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A spec that names a file (an sdist or a wheel, relative or absolute) is
/// refused with 400 before any process runs: pip would take it from its
/// working directory (here: the server's) and run an sdist's setup.py on the
/// host. Through every route: the packages route, `%pip` in exec code, and a
/// template's `pip`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_spec_naming_a_local_file_is_refused_and_nothing_runs() {
    let s = start().await;
    let marks = tempfile::tempdir().unwrap();
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let marker = marks.path().join("ran");
    let cwd = std::env::current_dir().unwrap();
    let pid = std::process::id();
    let sdist_name = format!("fbxpwn{pid}");
    let wheel_name = format!("fbxlocal{pid}");
    write_sdist(&cwd, &sdist_name, &marker);
    write_wheel(&cwd, &wheel_name, &[(&format!("{wheel_name}/__init__.py"), "text", "X = 1\n")]);
    let sdist = format!("{sdist_name}-1.0.tar.gz");
    let wheel = format!("{wheel_name}-1.0-py3-none-any.whl");
    let _cleanup = Cleanup(vec![cwd.join(&sdist), cwd.join(&wheel)]);
    let abs_wheel = s.house.path().join("fbxdep-1.0-py3-none-any.whl").display().to_string();
    let bad =
        [sdist.clone(), wheel.clone(), abs_wheel.clone(), format!("./{wheel}"), "./x".into(), "/tmp/x.whl".into()];

    let a = s.create_session(json!({})).await;
    let url = format!("/v1/sessions/{a}/packages");
    for spec in &bad {
        let got = s.post(&url, json!({ "packages": [spec] })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request", "");
        let got = s.post(&format!("/v1/sessions/{a}/exec"), json!({ "code": format!("%pip install {spec}") })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request", "");
        let got = s.post("/v1/templates", json!({ "name": "pwn", "pip": [spec] })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request", "");
    }
    let got = s.post(&url, json!({ "packages": [sdist] })).await;
    assert!(got.1["error"]["message"].as_str().unwrap().contains("names a file"), "{}", got.1);
    // Nothing was installed, nothing was built.
    let r = s.exec_ok(&a, &format!("import importlib.util\nimportlib.util.find_spec('{wheel_name}') is None")).await;
    assert_eq!(r["value"], "True");
    assert!(s.layers().is_empty(), "{:?}", s.layers());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!marker.exists(), "package code ran on the host: {:?}", std::fs::read_to_string(&marker));
}

/// A package the index has only as an sdist is refused without its build
/// backend (setup.py or an in-tree PEP 517 backend) ever running on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sdist_only_package_is_refused_without_building() {
    let s = start().await;
    let marks = tempfile::tempdir().unwrap();
    std::fs::set_permissions(marks.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let marker = marks.path().join("ran");
    write_sdist(s.house.path(), "fbxsdist", &marker);
    let a = s.create_session(json!({})).await;
    for spec in ["fbxsdist", "fbxsdist==1.0"] {
        let got = s.post(&format!("/v1/sessions/{a}/packages"), json!({ "packages": [spec] })).await;
        assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "package_needs_build", "fbxsdist");
    }
    let got = s.post(&format!("/v1/sessions/{a}/exec"), json!({ "code": "%pip install fbxsdist" })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "package_needs_build", "fbxsdist");
    assert!(!marker.exists(), "a build backend ran on the host: {:?}", std::fs::read_to_string(&marker));
}

/// This process' resident set (KiB), from /proc.
fn rss_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A wheel bomb: ~3 MB holding a 3 GiB member of zeros. With a key whose
/// disk quota is 1 GiB it is refused (403), nothing of it stays in the
/// layers, and the API process (this one) does not grow with the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wheel_bomb_is_refused_with_bounded_memory() {
    let limits = forkbox_server::KeyLimits { max_disk_mb: Some(1024), ..forkbox_server::KeyLimits::unlimited() };
    let s = start_with(limits).await;
    let house = s.house.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        write_wheel(
            &house,
            "fbxbomb",
            &[("fbxbomb/__init__.py", "text", ""), ("fbxbomb/zeros.bin", "zeros", "3221225472")],
        )
    })
    .await
    .unwrap();
    let size = std::fs::metadata(s.house.path().join("fbxbomb-1.0-py3-none-any.whl")).unwrap().len();
    assert!(size < 8 << 20, "the bomb is small: {size}");
    let a = s.create_session(json!({})).await;

    let before = rss_kb();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kb());
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };
    let t0 = Instant::now();
    let got = s.post(&format!("/v1/sessions/{a}/packages"), json!({ "packages": ["fbxbomb"] })).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().unwrap();
    eprintln!("bomb: {:?}, API RSS before {before} KiB, peak {peak} KiB, in {:?}", got.0, t0.elapsed());
    assert_error(&got, StatusCode::FORBIDDEN, "quota_exceeded", "fbxbomb");
    assert!(peak < before + (128 << 10), "the API grew from {before} to {peak} KiB");
    assert!(s.layers().is_empty(), "no layer of the bomb: {:?}", s.layers());
    let leftovers: Vec<_> = std::fs::read_dir(s.home().join("tmp"))
        .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "nothing unpacked is left: {leftovers:?}");
}

/// Three concurrent first installs of one new wheel all succeed (each
/// request copies it into the cache under a name of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_installs_of_one_wheel_all_succeed() {
    let s = start().await;
    write_wheel(
        s.house.path(),
        "fbxrace",
        &[("fbxrace/__init__.py", "text", "V = 3\n"), ("fbxrace/blob.bin", "random", "4000000")],
    );
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(s.create_session(json!({})).await);
    }
    let urls: Vec<String> = ids.iter().map(|id| format!("/v1/sessions/{id}/packages")).collect();
    let body = json!({ "packages": ["fbxrace"] });
    let got = tokio::join!(s.post(&urls[0], body.clone()), s.post(&urls[1], body.clone()), s.post(&urls[2], body));
    for g in [&got.0, &got.1, &got.2] {
        assert_eq!(g.0, StatusCode::OK, "{}", g.1);
    }
    for id in &ids {
        assert_eq!(s.exec_ok(id, "import fbxrace\nfbxrace.V").await["value"], "3");
    }
    let wheels = s.home().join("cache/wheels");
    let names: Vec<String> =
        std::fs::read_dir(&wheels).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| n.len() == 64), "no temporary file left: {names:?}");
}

/// A package layer is charged to the key's disk quota: one beyond it is
/// refused with `quota_exceeded` and left out of the layers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_beyond_the_disk_quota_is_refused() {
    let limits = forkbox_server::KeyLimits { max_disk_mb: Some(8), ..forkbox_server::KeyLimits::unlimited() };
    let s = start_with(limits).await;
    write_wheel(
        s.house.path(),
        "fbxbig",
        &[("fbxbig/__init__.py", "text", ""), ("fbxbig/blob.bin", "random", "12000000")],
    );
    let a = s.create_session(json!({})).await;
    let got = s.post(&format!("/v1/sessions/{a}/packages"), json!({ "packages": ["fbxbig"] })).await;
    assert_error(&got, StatusCode::FORBIDDEN, "quota_exceeded", "fbxbig");
    let got = s.post(&format!("/v1/sessions/{a}/exec"), json!({ "code": "%pip install fbxbig" })).await;
    assert_error(&got, StatusCode::FORBIDDEN, "quota_exceeded", "");
    assert!(s.layers().is_empty(), "{:?}", s.layers());
    // A small one fits; counted once however many sessions use it.
    let (st, v) = s.post(&format!("/v1/sessions/{a}/packages"), json!({ "packages": ["fbxdep"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let b = s.create_session(json!({})).await;
    let (st, v) = s.post(&format!("/v1/sessions/{b}/packages"), json!({ "packages": ["fbxdep"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(s.layers().len(), 1);
}

/// The package GC removes a layer nothing refers to any more (its only
/// session deleted) and keeps one a live session mounts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gc_removes_unreferenced_layers_and_keeps_referenced_ones() {
    let s = start().await;
    let a = s.create_session(json!({})).await;
    let b = s.create_session(json!({})).await;
    let (st, v) = s.post(&format!("/v1/sessions/{a}/packages"), json!({ "packages": ["fbxdep"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let kept = v["packages"][0]["sha256"].as_str().unwrap().to_string();
    write_wheel(s.house.path(), "fbxgone", &[("fbxgone/__init__.py", "text", "G = 1\n")]);
    let (st, v) = s.post(&format!("/v1/sessions/{b}/packages"), json!({ "packages": ["fbxgone"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let gone = v["packages"][0]["sha256"].as_str().unwrap().to_string();
    let mut both = vec![kept.clone(), gone.clone()];
    both.sort();
    assert_eq!(s.layers(), both);

    let gc = |st: forkbox_server::AppState| async move {
        tokio::task::spawn_blocking(move || st.runtime.gc_packages(Duration::ZERO).unwrap()).await.unwrap()
    };
    // Both referenced: nothing goes.
    assert!(gc(s.state.clone()).await.is_empty());
    assert_eq!(s.layers(), both);
    let (st, v) = s.delete(&format!("/v1/sessions/{b}")).await;
    assert!(st.is_success(), "{v}");
    assert_eq!(gc(s.state.clone()).await, vec![gone.clone()]);
    assert_eq!(s.layers(), vec![kept.clone()]);
    // The kept one still works, also after the session is evicted and resumed.
    assert_eq!(s.exec_ok(&a, "import fbxdep\nfbxdep.VALUE").await["value"], "7");
}
