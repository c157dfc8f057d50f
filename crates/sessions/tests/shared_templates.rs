//! Templates shared by the nodes of a cluster: several data
//! directories ("nodes") on one PostgreSQL database and one S3-compatible
//! bucket, both real (`forkbox_testkit::postgres`, `forkbox_testkit::s3`),
//! over real KVM guests. A node that lacks a template fetches the one another
//! node published (the same bytes) instead of building it; sessions
//! checkpointed on one node resume on another, also on a checkpoint template
//! and with a package installed at run time; two nodes starting at once build
//! a template once; a node's own copy that differs is replaced by the
//! published one; a corrupted object is refused by its hash and a bucket that
//! is down is `storage_unavailable`, with nothing partial left on disk.
//!
//! Needs /dev/kvm, PostgreSQL and the s3s-fs binary (FAILS without them,
//! never skips). Nodes get the shared home's apt resolutions (so their image
//! id is the shared home's); "seeded" nodes also get its image file (as a
//! node that built it earlier would have it), the others must fetch it.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use common::*;
use forkbox_catalog::catalog::PipSource;
use forkbox_catalog::shared::SharedStats;
use forkbox_catalog::Catalog;
use forkbox_engine::Limits;
use forkbox_sessions::artifacts::BucketArtifacts;
use forkbox_sessions::manager::{Config, SessionManager};
use forkbox_sessions::store::Store;
use forkbox_testkit::postgres::Postgres;
use forkbox_testkit::s3::{BUCKET, PREFIX, S3};

/// These tests boot templates and run two nodes each: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// One database and one bucket, as a cluster's nodes share them.
struct Cluster {
    pg: Postgres,
    s3: S3,
}

impl Cluster {
    fn start() -> Cluster {
        require_kvm();
        raise_fd_limit();
        Cluster { pg: Postgres::start(), s3: S3::start() }
    }

    fn config(&self) -> Config {
        Config { database: Some(self.pg.url()), objects: Some(self.s3.config()), ..Config::default() }
    }

    /// The artifacts' objects in the bucket: (SHA-256, bytes).
    fn artifact_objects(&self) -> Vec<(String, u64)> {
        let dir = self.s3.root.path().join(BUCKET).join(PREFIX).join("artifacts");
        let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().len() == 64)
                    .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    fn object_path(&self, sha: &str) -> PathBuf {
        self.s3.root.path().join(BUCKET).join(PREFIX).join("artifacts").join(sha)
    }
}

/// A node: its own data directory, its catalog sharing templates through the cluster.
struct Node {
    home: tempfile::TempDir,
    catalog: Arc<Catalog>,
}

/// A new data directory with the shared home's apt resolutions (and its image file if `with_image`).
fn node_home(with_image: bool) -> tempfile::TempDir {
    forkbox_testkit::node_home("forkbox-node-", with_image)
}

fn node_on(cluster: &Cluster, home: tempfile::TempDir) -> Node {
    let catalog = Arc::new(Catalog::new(home.path()).unwrap());
    let shared = BucketArtifacts::shared(&cluster.s3.config(), &cluster.pg.url(), home.path()).unwrap();
    catalog.set_shared(shared);
    Node { home, catalog }
}

fn node(cluster: &Cluster, with_image: bool) -> Node {
    node_on(cluster, node_home(with_image))
}

impl Node {
    fn stats(&self) -> SharedStats {
        self.catalog.shared_stats().unwrap()
    }

    fn sessions(&self, cluster: &Cluster) -> SessionManager {
        SessionManager::open_with_catalog(self.catalog.clone(), self.home.path(), cluster.config())
            .unwrap_or_else(|e| panic!("opening the sessions of {}: {e}", self.home.path().display()))
    }

    fn template_dir(&self, id: &str) -> PathBuf {
        self.home.path().join("templates").join(id)
    }

    /// The SHA-256 of the template as a bundle (its state and its memory's data pages).
    fn template_sha(&self, id: &str) -> String {
        let out = tempfile::NamedTempFile::new().unwrap();
        forkbox_snapshot::bundle::pack(&self.template_dir(id), out.path()).unwrap().sha256
    }
}

/// A wheelhouse with one pure-Python wheel, `fbxshared` (pip runs offline).
fn wheelhouse(dir: &Path) -> PipSource {
    // The confined pip (uid 65534 under root) lists it.
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let script = r#"
import sys, zipfile, hashlib, base64, os
out, name, dist = sys.argv[1], 'fbxshared', 'fbxshared-1.0.dist-info'
files = {'fbxshared/__init__.py': b"VALUE = 'from a shared layer'\n",
         dist + '/METADATA': b'Metadata-Version: 2.1\nName: fbxshared\nVersion: 1.0\n',
         dist + '/WHEEL': b'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'}
h = lambda d: 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()
rows = ['%s,%s,%d' % (n, h(d), len(d)) for n, d in files.items()] + [dist + '/RECORD,,']
files[dist + '/RECORD'] = ('\n'.join(rows) + '\n').encode()
with zipfile.ZipFile(os.path.join(out, 'fbxshared-1.0-py3-none-any.whl'), 'w') as z:
    for n, d in files.items():
        z.writestr(zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0)), d)
"#;
    let st = std::process::Command::new("python3").args(["-I", "-c", script]).arg(dir).status().unwrap();
    assert!(st.success(), "writing the wheelhouse");
    PipSource { index_url: None, find_links: vec![dir.display().to_string()], no_index: true }
}

fn no_entries(dir: &Path) -> Vec<String> {
    file_names(dir)
}

#[test]
fn a_second_node_fetches_the_template_and_resumes_the_first_nodes_sessions() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start();
    let house = tempfile::tempdir().unwrap();
    let pip = wheelhouse(house.path());

    // Node A: builds the template (its image is on disk already) and publishes it.
    let a = node(&cluster, true);
    a.catalog.set_pip_source(pip.clone()).unwrap();
    let t0 = Instant::now();
    let template = a.catalog.get(None).unwrap();
    let a_start = t0.elapsed();
    let tid = template.id().to_string();
    let st = a.stats();
    assert_eq!((st.templates_built, st.templates_published, st.images_published), (1, 1, 1), "{st:?}");
    assert_eq!((st.templates_fetched, st.images_built, st.images_fetched), (0, 0, 0), "{st:?}");
    let (s1, s2, snap_id) = {
        let m = a.sessions(&cluster);
        let s1 = m.create(TENANT, BTreeMap::new(), &Limits::default()).unwrap().id;
        ok(&m, &s1, "x = 41\nopen('/tmp/note.txt', 'w').write('written on node A')");
        let installed = m.install_packages(TENANT, &s1, &["fbxshared".into()]).unwrap();
        assert!(installed.checkpoint.is_some());
        let seq = ok(&m, &s1, "import fbxshared\nz = fbxshared.VALUE").checkpoint.seq;
        // A template of that checkpoint, and a session on it.
        let listing = m.checkpoint_template(TENANT, &s1, seq, "snap").unwrap();
        let snap_id = listing.id.clone().unwrap();
        let key = a.catalog.key_for(Some(TENANT), "snap").unwrap();
        let snap = a.catalog.get(Some(&key)).unwrap();
        let s2 = m.create_on(TENANT, BTreeMap::new(), &Limits::default(), &snap).unwrap().id;
        ok(&m, &s2, "y = x * 2");
        (s1, s2, snap_id)
    };
    let st = a.stats();
    assert_eq!((st.templates_published, st.packages_published), (2, 1), "{st:?}");
    let published = Store::open_postgres(&cluster.pg.url()).unwrap().all_artifacts().unwrap();
    let objects = cluster.artifact_objects();
    eprintln!("published: {published:#?}\nobjects: {objects:?}\nnode A started in {a_start:?}");
    assert_eq!(published.len(), 4, "two templates, their image, one package layer: {published:#?}");
    for p in &published {
        assert!(objects.iter().any(|(sha, n)| *sha == p.sha256 && *n == p.bytes), "object of {p:?}");
    }
    // The memory file is gigabytes apparent; its bundle carries the data pages only.
    let bundle = published.iter().find(|p| p.id == tid).unwrap();
    assert!(bundle.bytes < 256 << 20, "the template's bundle is {} bytes", bundle.bytes);

    // Node B: no image, no template. It builds nothing: it fetches both.
    let b = node(&cluster, false);
    b.catalog.set_pip_source(pip).unwrap();
    let t0 = Instant::now();
    let got = b.catalog.get(None).unwrap();
    eprintln!("node B started (fetching) in {:?}", t0.elapsed());
    assert_eq!(got.id(), tid);
    let st = b.stats();
    assert_eq!((st.templates_built, st.images_built), (0, 0), "B built something: {st:?}");
    assert_eq!((st.templates_fetched, st.images_fetched), (1, 1), "{st:?}");
    assert_eq!(b.template_sha(&tid), a.template_sha(&tid), "B's template is not A's bytes");
    assert_eq!(
        std::fs::read(b.template_dir(&tid).join("state")).unwrap(),
        std::fs::read(a.template_dir(&tid).join("state")).unwrap()
    );
    // Node A has stopped (its claim on the database with it); B resumes its sessions.
    drop(a.catalog);
    let m = b.sessions(&cluster);
    // On the checkpoint template, fetched on demand, with the package layer its state mounts.
    assert!(!b.template_dir(&snap_id).exists());
    assert_eq!(value(&m, &s2, "(x, y, z)"), "(41, 82, 'from a shared layer')");
    assert!(b.template_dir(&snap_id).join("state").exists());
    let st = b.stats();
    assert_eq!((st.templates_fetched, st.packages_fetched, st.templates_built), (2, 1, 0), "{st:?}");
    // The first session: variables, the file it wrote, the package.
    assert_eq!(
        value(&m, &s1, "import fbxshared\n(x + 1, open('/tmp/note.txt').read(), fbxshared.VALUE)"),
        "(42, 'written on node A', 'from a shared layer')"
    );
    // And it goes on here.
    assert_eq!(value(&m, &s1, "x = x + 1\nx"), "42");
}

#[test]
fn two_nodes_starting_at_once_build_the_template_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start();
    let nodes = [node(&cluster, true), node(&cluster, true)];
    let go = Barrier::new(2);
    let ids: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .map(|n| {
                let go = &go;
                s.spawn(move || {
                    go.wait();
                    n.catalog.get(None).unwrap().id().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(ids[0], ids[1]);
    let (x, y) = (nodes[0].stats(), nodes[1].stats());
    eprintln!("node 1: {x:?}\nnode 2: {y:?}");
    assert_eq!(x.templates_built + y.templates_built, 1, "built twice");
    assert_eq!(x.templates_fetched + y.templates_fetched, 1);
    assert_eq!(x.templates_published + y.templates_published, 1);
    assert_eq!(nodes[0].template_sha(&ids[0]), nodes[1].template_sha(&ids[0]));
    let published = Store::open_postgres(&cluster.pg.url()).unwrap().all_artifacts().unwrap();
    assert_eq!(published.len(), 2, "one template and its image: {published:#?}");
}

#[test]
fn corrupt_objects_are_refused_a_bucket_down_is_unavailable_and_local_copies_are_replaced() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut cluster = Cluster::start();
    let first = node(&cluster, true);
    let tid = first.catalog.get(None).unwrap().id().to_string();
    let published = Store::open_postgres(&cluster.pg.url()).unwrap().all_artifacts().unwrap();
    let bundle = published.iter().find(|p| p.id == tid).unwrap().clone();

    // The bucket down: storage_unavailable, and nothing of the template or its image here.
    let n = node(&cluster, false);
    cluster.s3.stop();
    let e = n.catalog.get(None).unwrap_err();
    assert_eq!(e.code(), "storage_unavailable", "{e}");
    let nothing_here = |n: &Node| {
        assert_eq!(no_entries(&n.home.path().join("templates")), Vec::<String>::new());
        assert!(no_entries(&n.home.path().join("images")).iter().all(|f| !f.ends_with(".img")));
        assert_eq!(no_entries(&n.home.path().join("tmp").join("shared")), Vec::<String>::new(), "scratch left");
    };
    nothing_here(&n);

    // Back, with the template's object corrupted: refused by its hash (storage_error), nothing in place.
    cluster.s3.restart();
    let object = cluster.object_path(&bundle.sha256);
    let good = std::fs::read(&object).unwrap();
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    std::fs::write(&object, &bad).unwrap();
    let e = n.catalog.get(None).unwrap_err();
    assert_eq!(e.code(), "storage_error", "{e}");
    assert!(e.to_string().contains("does not match its SHA-256"), "{e}");
    assert_eq!(no_entries(&n.home.path().join("templates")), Vec::<String>::new());
    assert_eq!(no_entries(&n.home.path().join("tmp").join("shared")), Vec::<String>::new(), "scratch left");

    // Repaired: fetched.
    std::fs::write(&object, &good).unwrap();
    assert_eq!(n.catalog.get(None).unwrap().id(), tid);
    assert_eq!(n.template_sha(&tid), first.template_sha(&tid));

    // A data directory used alone before it joins: its own template of the same id
    // (booted separately: other memory) is replaced by the published one before it is opened.
    let home = node_home(true);
    {
        let alone = Catalog::new(home.path()).unwrap();
        assert_eq!(alone.get(None).unwrap().id(), tid);
    }
    let joined = node_on(&cluster, home);
    assert_ne!(joined.template_sha(&tid), first.template_sha(&tid), "two boots gave the same memory");
    assert_eq!(joined.catalog.get(None).unwrap().id(), tid);
    let st = joined.stats();
    assert_eq!((st.replaced, st.templates_fetched, st.templates_built), (1, 1, 0), "{st:?}");
    assert_eq!(joined.template_sha(&tid), first.template_sha(&tid));
}

/// Start-up of a node of a cluster, building vs fetching its default template,
/// on a real PostgreSQL and s3s-fs on loopback (the figures of the README):
///
/// ```text
/// FORKBOX_SAMPLES=5 cargo test --release -p forkbox-sessions --test shared_templates -- \
///     --ignored --nocapture node_start_up_figures
/// ```
///
/// Each sample is a new database and bucket prefix (a new cluster): its first
/// node has the image on disk and boots, snapshots and publishes the template;
/// a second node with nothing on disk fetches image and template; a third with
/// the image fetches the template only; a single node (no cluster) boots it.
/// Once: the image itself built with apt from cached .debs (a node that has
/// neither image nor cluster also downloads ~32 MB of .debs first).
#[test]
#[ignore]
fn node_start_up_figures() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start();
    let samples: usize = std::env::var("FORKBOX_SAMPLES").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let secs = |t: Instant| t.elapsed().as_secs_f64();
    let (mut first, mut fetch_all, mut fetch_template, mut alone) = (vec![], vec![], vec![], vec![]);
    let mut sizes = Vec::new();
    for i in 0..samples {
        let db = forkbox_sessions::db::scratch_database(&cluster.pg.url(), &format!("forkbox_start_{i}")).unwrap();
        let objects = forkbox_sessions::objects::ObjectsConfig {
            url: format!("s3://{BUCKET}/{PREFIX}/start{i}"),
            ..cluster.s3.config()
        };
        let on = |home: tempfile::TempDir| {
            let catalog = Arc::new(Catalog::new(home.path()).unwrap());
            catalog.set_shared(BucketArtifacts::shared(&objects, &db, home.path()).unwrap());
            Node { home, catalog }
        };
        for (with_image, out) in [(true, &mut first), (false, &mut fetch_all), (true, &mut fetch_template)] {
            let n = on(node_home(with_image));
            let t0 = Instant::now();
            n.catalog.get(None).unwrap();
            out.push(secs(t0));
            if i == 0 {
                eprintln!("{:?}", n.stats());
            }
        }
        let single = node_home(true);
        let c = Catalog::new(single.path()).unwrap();
        let t0 = Instant::now();
        c.get(None).unwrap();
        alone.push(secs(t0));
        if i == 0 {
            sizes = Store::open_postgres(&db).unwrap().all_artifacts().unwrap();
        }
    }
    // The image built with apt (.debs from the shared home's cache: no download).
    let cold = tempfile::Builder::new().prefix("forkbox-node-").tempdir().unwrap();
    let cache = cold.path().join("cache");
    std::fs::create_dir_all(cache.join("debs")).unwrap();
    for e in std::fs::read_dir(forkbox_testkit::home().join("cache").join("debs")).unwrap().flatten() {
        if !e.file_type().unwrap().is_file() {
            continue;
        }
        let to = cache.join("debs").join(e.file_name());
        std::fs::hard_link(e.path(), &to).or_else(|_| std::fs::copy(e.path(), &to).map(|_| ())).unwrap();
    }
    let t0 = Instant::now();
    let built = forkbox_image::build(
        &forkbox_engine::default_image_spec(),
        &forkbox_image::BuildOptions { home: cold.path().to_path_buf(), progress: false, report: None },
    )
    .unwrap();
    let apt = secs(t0);
    assert!(!built.reused);
    let p50 = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        format!("p50 {:6.2} s  (min {:.2}, max {:.2}, n={})", v[v.len() / 2], v[0], v[v.len() - 1], v.len())
    };
    println!("node start-up (catalog.get of the default template), {samples} clusters:");
    println!("  first node, image on disk: boot + snapshot + publish  {}", p50(&mut first));
    println!("  second node, nothing on disk: fetch image + template  {}", p50(&mut fetch_all));
    println!("  third node, image on disk: fetch template             {}", p50(&mut fetch_template));
    println!("  single node (no cluster), image on disk: boot          {}", p50(&mut alone));
    println!("  the image built with apt (cached .debs), once:         {apt:.2} s");
    for a in &sizes {
        println!("  uploaded {} {}: {:.1} MiB", a.kind.as_str(), &a.id[..12], a.bytes as f64 / (1 << 20) as f64);
    }
}
