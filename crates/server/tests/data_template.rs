//! The `data` template through the real HTTP API (KVM, real programs). One test
//! binary so that every test shares one template build: the first run on a fresh
//! machine downloads and builds the data image (~3 min here), then it is cached
//! under `$FORKBOX_HOME`. Without KVM these tests FAIL (never skipped).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use base64::Engine as _;
use forkbox_runtime::Runtime;
use forkbox_server_testkit::{Key, TestServer};
use reqwest::StatusCode;
use serde_json::json;

/// The shared home with the data template built (once per binary).
fn shared_home() -> &'static PathBuf {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    HOME.get_or_init(|| {
        forkbox_testkit::require_kvm();
        forkbox_testkit::raise_fd_limit();
        let home = forkbox_testkit::home();
        let t0 = std::time::Instant::now();
        let catalog = forkbox_catalog::Catalog::new(&home).expect("catalog");
        for name in ["data", "python"] {
            let l = catalog.get(Some(name)).unwrap_or_else(|e| panic!("building template {name}: {e}"));
            eprintln!("template {name} = {} ready after {:.1} s", l.id(), t0.elapsed().as_secs_f64());
        }
        home
    })
}

/// A fresh data directory sharing the images, caches and templates of the shared home.
fn fresh_home() -> tempfile::TempDir {
    let shared = shared_home();
    let dir = tempfile::Builder::new().prefix("forkbox-data-test-").tempdir().expect("temp dir");
    for d in ["templates", "images", "cache"] {
        std::os::unix::fs::symlink(shared.join(d), dir.path().join(d)).expect("symlink");
    }
    dir
}

/// A server on `home` whose default template is `default_template`; its
/// key has the defaults of a new key.
async fn start(home: &Path, default_template: &str) -> TestServer {
    let default_template = default_template.to_string();
    TestServer::options()
        .at(home)
        .key("alice", Key::Defaults)
        .config(move |cfg| cfg.runtime.template = Some(default_template))
        .runtime(|cfg| Runtime::open(&cfg.home, cfg.runtime.clone()).unwrap_or_else(|e| panic!("runtime: {e}")))
        .start()
        .await
}

/// Width, height of a PNG (IHDR, after checking the signature and the chunk's CRC-free layout).
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_template_end_to_end() {
    let home = fresh_home();
    let s = start(home.path(), "data").await;

    // The template list names both; data is the default and ready.
    let (st, t) = s.get("/v1/templates").await;
    assert_eq!(st, StatusCode::OK, "{t}");
    assert_eq!(t["default"], "data");
    let names: Vec<&str> = t["templates"].as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"python") && names.contains(&"data"), "{t}");

    // Unknown template: 404 template_not_found, for one-shot, batch and sessions.
    for (path, body) in [
        ("/v1/exec", json!({"code": "1", "template": "nope"})),
        ("/v1/exec/batch", json!({"codes": ["1"], "template": "nope"})),
        ("/v1/sessions", json!({"template": "nope"})),
        ("/v1/machine/new", json!({"template": "nope"})),
    ] {
        let (st, r) = s.post(path, body).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{path}: {r}");
        assert_eq!(r["error"]["code"], "template_not_found", "{path}: {r}");
    }

    // The preload: pandas, pyplot and scipy are already imported in a fork.
    let (st, r) = s.post("/v1/exec", json!({"code": "import sys; sorted(m for m in ('pandas', 'matplotlib.pyplot', 'scipy') if m in sys.modules)"})).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["value"], "['matplotlib.pyplot', 'pandas', 'scipy']", "{r}");

    // A CSV uploaded through the files API: groupby, merge, pivot.
    let (st, v) = s.post("/v1/sessions", json!({"template": "data"})).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let sid = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["template"], "data", "{v}");
    let data_template_id = v["template_id"].as_str().unwrap().to_string();
    let csv = "city,month,sales\nOslo,1,10\nOslo,2,30\nLima,1,5\nLima,2,7\nOslo,1,2\n";
    let resp = s
        .http
        .put(format!("{}/v1/sessions/{sid}/files/data/sales.csv", s.url))
        .bearer_auth(&s.key)
        .body(csv)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.text().await.unwrap());
    let r = s
        .exec_ok(
            &sid,
            "import pandas as pd\n\
             df = pd.read_csv('/data/sales.csv')\n\
             g = df.groupby('city').sales.sum().to_dict()\n\
             pop = pd.DataFrame({'city': ['Oslo', 'Lima'], 'pop': [700, 10000]})\n\
             m = df.merge(pop, on='city')\n\
             p = df.pivot_table(index='city', columns='month', values='sales', aggfunc='sum')\n\
             (g, int(m['pop'].sum()), p.loc['Oslo', 1], p.loc['Lima', 2])",
        )
        .await;
    assert_eq!(r["value"], "({'Lima': 12, 'Oslo': 42}, 22100, 12, 7)", "{r}");

    // A DataFrame value: HTML table beside the text.
    let r = s.exec_ok(&sid, "df.head(3)").await;
    let html = r["value_data"]["text/html"].as_str().unwrap_or_else(|| panic!("no text/html: {r}"));
    assert!(html.contains("<table") && html.contains("<th>city</th>") && html.contains("Oslo"), "{html}");
    assert!(r["value"].as_str().unwrap().contains("city"), "{r}");

    // A matplotlib line plot left open: a PNG of the figure's size, not blank; closed after.
    let r = s
        .exec_ok(
            &sid,
            "import matplotlib.pyplot as plt, numpy as np\n\
             fig = plt.figure(figsize=(4, 3), dpi=100)\n\
             x = np.linspace(0, 6.3, 100)\n\
             plt.plot(x, np.sin(x), linewidth=3)\n\
             print('plotted')",
        )
        .await;
    assert_eq!(r["stdout"], "plotted\n");
    let shown = r["display"].as_array().unwrap_or_else(|| panic!("no display: {r}"));
    assert_eq!(shown.len(), 1, "{r}");
    let b64 = shown[0]["image/png"].as_str().expect("image/png");
    let png = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
    assert_eq!(png_size(&png), (400, 300));
    // Decode it for real (PIL in the guest, the bytes as the API returned them): not blank.
    let r2 = s
        .exec_ok(
            &sid,
            &format!(
                "import base64, io\nfrom PIL import Image\nim = Image.open(io.BytesIO(base64.b64decode('{b64}'))).convert('L')\n\
                 (im.size, len(set(im.getdata())) > 10, min(im.getdata()) < 100)"
            ),
        )
        .await;
    assert_eq!(r2["value"], "((400, 300), True, True)", "{r2}");
    let r = s.exec_ok(&sid, "len(plt.get_fignums())").await;
    assert_eq!(r["value"], "0", "the figure was closed: {r}");
    // display() and plt.show(), in order; a PIL image value gives PNG.
    let r = s.exec_ok(&sid, "display(pd.DataFrame({'a': [1]}))\nplt.plot([1, 2]); plt.show()\nprint('after')").await;
    let shown = r["display"].as_array().unwrap();
    assert_eq!(shown.len(), 2, "{r}");
    assert!(shown[0]["text/html"].as_str().unwrap().contains("<table"), "{r}");
    assert!(shown[1]["image/png"].is_string(), "{r}");
    let r = s.exec_ok(&sid, "Image.new('RGB', (7, 5), 'red')").await;
    let png =
        base64::engine::general_purpose::STANDARD.decode(r["value_data"]["image/png"].as_str().expect("png")).unwrap();
    assert_eq!(png_size(&png), (7, 5));

    // scipy.optimize and scikit-learn fit/predict with checked results.
    let r = s
        .exec_ok(
            &sid,
            "from scipy.optimize import minimize\n\
             res = minimize(lambda v: (v[0] - 3) ** 2 + (v[1] + 1) ** 2 + 2, [0, 0])\n\
             from sklearn.linear_model import LinearRegression\n\
             X = np.arange(20).reshape(-1, 1); y = 3 * X.ravel() + 5\n\
             lr = LinearRegression().fit(X, y)\n\
             (round(res.x[0], 3), round(res.x[1], 3), round(res.fun, 4), round(lr.coef_[0], 6), round(lr.intercept_, 6), round(float(lr.predict([[100]])[0]), 4))",
        )
        .await;
    assert_eq!(r["value"], "(3.0, -1.0, 2.0, 3.0, 5.0, 305.0)", "{r}");

    // Restart on another default: the data session keeps working, state intact.
    s.stop(); // (and its client's idle connections, which hold the old server's state)
    let s2 = start(home.path(), "python").await;
    let (st, v) = s2.get(&format!("/v1/sessions/{sid}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // The session stays pinned to its template id. (Its name is reported only
    // while that template is loaded by name; after a restart it is opened by id.)
    assert_eq!(v["template_id"], data_template_id.as_str(), "{v}");
    let r = s2.exec_ok(&sid, "(g['Oslo'], type(lr).__name__, round(float(lr.predict([[1]])[0]), 4))").await;
    assert_eq!(r["value"], "(42, 'LinearRegression', 8.0)", "{r}");
    // ... and the new default is python (no pandas), a session on it too.
    let (st, r) =
        s2.post("/v1/exec", json!({"code": "import importlib.util; importlib.util.find_spec('pandas') is None"})).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["value"], "True", "{r}");
    let (st, r) = s2.post("/v1/exec", json!({"code": "import pandas; pandas.__version__", "template": "data"})).await;
    assert_eq!(st, StatusCode::OK, "{r}");
    assert!(r["value"].as_str().unwrap().starts_with("'1."), "{r}");
}
