//! Templates shared by the nodes of a cluster (`serve --database postgres://...
//! --objects s3://...`), over HTTP: the real server (`Server::bind`, as
//! `forkbox serve` runs it) on a real PostgreSQL and a real S3-compatible
//! server (s3s-fs) on loopback, over real KVM guests. The first node builds
//! and publishes its default template at start; a second node with an empty
//! data directory fetches it (and its image) instead, then resumes the first
//! node's sessions, one of them on a checkpoint template that it fetches on
//! demand from an exec thread (under its seccomp filter). Template names are
//! the cluster's: a custom template and a checkpoint template made on the
//! first node are listed and used by name on the second (built once,
//! fetched there), and the second cannot take a name the first has.
//!
//! Needs /dev/kvm, PostgreSQL and s3s-fs (FAILS without them, never skips).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::Duration;

use forkbox_server::ServerConfig;
use forkbox_sessions::store::Store;
use forkbox_testkit::postgres::Postgres;
use forkbox_testkit::s3::S3;
use reqwest::StatusCode;
use serde_json::{json, Value};

use forkbox_server_testkit::Node;

fn config(home: &std::path::Path, pg: &Postgres, s3: &S3, node: &str) -> ServerConfig {
    let mut cfg = forkbox_server_testkit::config(home);
    cfg.runtime.sessions.database = Some(pg.url());
    cfg.runtime.sessions.objects = Some(s3.config());
    // (The URL: the address it binds.)
    cfg.runtime.sessions.cluster = Some(forkbox_runtime::ClusterConfig {
        node_id: node.into(),
        url: String::new(),
        lease: std::time::Duration::from_secs(10),
    });
    cfg
}

/// The calls of these tests, with the node's key; they must succeed.
trait Calls {
    async fn post(&self, path: &str, body: Value) -> Value;
    async fn value(&self, id: &str, code: &str) -> Value;
}

impl Calls for Node {
    async fn post(&self, path: &str, body: Value) -> Value {
        let (st, v) = self.call(reqwest::Method::POST, path, Some(body.clone())).await;
        assert!(st.is_success(), "POST {path} {body}: {st} {v}");
        v
    }

    async fn value(&self, id: &str, code: &str) -> Value {
        let v = self.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": code })).await;
        assert!(v["error"].is_null(), "{code}: {v}");
        v["value"].clone()
    }
}

/// Wait until `node` says the caller's template `name` is ready (asking it to open it).
async fn wait_ready(node: &Node, name: &str) {
    for _ in 0..600 {
        let (st, v) =
            node.call(reqwest::Method::POST, "/v1/exec", Some(json!({ "template": name, "code": "1" }))).await;
        if st.is_success() {
            return;
        }
        assert_eq!(v["error"]["code"], "template_not_ready", "{name}: {st} {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("template {name} was not ready within 2 minutes");
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_fetches_the_templates_and_resumes_the_first_nodes_sessions() {
    forkbox_testkit::require_kvm();
    forkbox_testkit::raise_fd_limit();
    let pg = Postgres::start();
    let s3 = S3::start();
    let (a_home, b_home) = tokio::task::spawn_blocking(|| {
        (forkbox_testkit::node_home("forkbox-node-a-", true), forkbox_testkit::node_home("forkbox-node-b-", false))
    })
    .await
    .unwrap();

    // Node A: builds the default template at start and publishes it.
    let a = Node::start(config(a_home.path(), &pg, &s3, "a"), None).await;
    let key = a.key.clone();
    let published = || {
        let url = pg.url();
        async move {
            tokio::task::spawn_blocking(move || Store::open_postgres(&url).unwrap().all_artifacts().unwrap())
                .await
                .unwrap()
        }
    };
    let at_start = published().await;
    assert_eq!(at_start.len(), 2, "the default template and its image: {at_start:#?}");
    let s1 = a.post("/v1/sessions", json!({})).await["id"].as_str().unwrap().to_string();
    let v = a
        .post(&format!("/v1/sessions/{s1}/exec"), json!({ "code": "x = 41\nopen('/tmp/a.txt', 'w').write('from A')" }))
        .await;
    let seq = v["checkpoint"].as_i64().unwrap();
    a.post(&format!("/v1/sessions/{s1}/checkpoints/{seq}/template"), json!({ "name": "snap" })).await;
    let s2 = a.post("/v1/sessions", json!({ "template": "snap" })).await["id"].as_str().unwrap().to_string();
    a.value(&s2, "y = x * 2").await;
    assert_eq!(published().await.len(), 3, "the checkpoint template is published when it is made");
    // A custom template of the tenant's own (a preload over the default image: one boot).
    a.post("/v1/templates", json!({ "name": "pre", "preload": "import json\nZ = json.loads('[5]')[0]" })).await;
    wait_ready(&a, "pre").await;
    assert_eq!(published().await.len(), 4, "the custom template is published when it is built");

    // Node B, while A still runs: an empty data directory; it fetches what A
    // published, builds nothing. (No key is made: the cluster has one, and A's works here.)
    let b = Node::start(config(b_home.path(), &pg, &s3, "b"), Some(key)).await;
    assert_eq!(files(&b_home.path().join("templates")).len(), 1, "the default template, fetched");
    // The names A made are B's too: listed, and used by name.
    let (st, list) = b.call(reqwest::Method::GET, "/v1/templates", None).await;
    assert_eq!(st, StatusCode::OK, "{list}");
    let names: Vec<&str> = list["templates"].as_array().unwrap().iter().filter_map(|t| t["name"].as_str()).collect();
    assert!(names.contains(&"snap") && names.contains(&"pre"), "{list}");
    let (st, one) = b.call(reqwest::Method::GET, "/v1/templates/snap", None).await;
    assert_eq!(st, StatusCode::OK, "{one}");
    assert_eq!(one["from_session"], json!(s1), "{one}");
    // (Not on B's disk yet: fetched in the background, `template_not_ready` meanwhile.)
    wait_ready(&b, "snap").await;
    let s3_id = b.post("/v1/sessions", json!({ "template": "snap" })).await["id"].as_str().unwrap().to_string();
    assert_eq!(b.value(&s3_id, "x").await, json!("41"));
    wait_ready(&b, "pre").await;
    assert_eq!(b.post("/v1/exec", json!({ "template": "pre", "code": "Z * 2" })).await["value"], json!("10"));
    // A name A has is taken on B as well.
    let v = b.post(&format!("/v1/sessions/{s3_id}/exec"), json!({ "code": "w = 1" })).await;
    let seq = v["checkpoint"].as_i64().unwrap();
    let path = format!("/v1/sessions/{s3_id}/checkpoints/{seq}/template");
    let (st, v) = b.call(reqwest::Method::POST, &path, Some(json!({ "name": "pre" }))).await;
    assert_eq!((st, &v["error"]["code"]), (StatusCode::CONFLICT, &json!("template_exists")), "{v}");
    assert_eq!(published().await.len(), 4, "B built and published nothing");
    a.stop_within(Duration::from_secs(30)).await;
    assert_eq!(b.value(&s1, "(x + 1, open('/tmp/a.txt').read())").await, json!("(42, 'from A')"));
    // The checkpoint template: fetched on demand when its session resumes (on an exec thread).
    assert_eq!(b.value(&s2, "(x, y)").await, json!("(41, 82)"));
    let mut ids: Vec<String> = published().await.into_iter().filter(|p| p.needs.is_some()).map(|p| p.id).collect();
    ids.sort();
    assert_eq!(files(&b_home.path().join("templates")), ids, "B has exactly the published templates");
    assert_eq!(published().await.len(), 4, "B published nothing new");
    b.stop_within(Duration::from_secs(30)).await;
}
