//! A session's history (`GET /v1/sessions/{id}/history`, `.../checkpoints/{n}`):
//! what each call showed, kept with its checkpoint, read back after the session
//! was evicted and resumed, after a revert, and after the server restarted on the
//! same data directory; bounded per call and per page; another key's tenant
//! cannot read it. The real server (`Server::bind`) over real KVM guests (fails
//! without /dev/kvm).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::Duration;

use forkbox_sessions::output::{OUTPUT_MAX, TEXT_MAX};
use forkbox_sessions::store::Store;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use forkbox_server_testkit::Node;

/// A 2x2 red PNG, base64.
const PNG: &str =
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DAwPCfgeE/AwPDfwAAPdIF+0tdXKsAAAAASUVORK5CYII=";

/// The calls of these tests, with the node's key.
trait Calls {
    async fn exec(&self, id: &str, code: &str) -> Value;
    async fn get(&self, path: &str) -> (StatusCode, Value);
    async fn history(&self, id: &str) -> Value;
}

impl Calls for Node {
    async fn exec(&self, id: &str, code: &str) -> Value {
        let (st, v) = self.call(Method::POST, &format!("/v1/sessions/{id}/exec"), Some(json!({ "code": code }))).await;
        assert_eq!(st, StatusCode::OK, "exec {code:?}: {v}");
        v
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    async fn history(&self, id: &str) -> Value {
        let (st, v) = self.get(&format!("/v1/sessions/{id}/history")).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v
    }
}

fn codes(h: &Value) -> Vec<String> {
    h["calls"].as_array().unwrap().iter().map(|c| c["code"].as_str().unwrap().to_string()).collect()
}

fn assert_error(got: &(StatusCode, Value), status: StatusCode, code: &str) {
    assert_eq!(got.0, status, "expected {status} {code}, got {} {}", got.0, got.1);
    assert_eq!(got.1["error"]["code"], code, "{}", got.1);
}

/// The first two calls as they must read back, wherever from.
fn check_first_calls(h: &Value) {
    let calls = h["calls"].as_array().unwrap();
    let (a, b) = (&calls[0], &calls[1]);
    assert_eq!((a["checkpoint"].clone(), a["parent"].clone()), (json!(1), Value::Null), "{a}");
    assert_eq!(a["output"]["stdout"], "one\n", "{a}");
    assert_eq!(a["output"]["stderr"], "warn\n", "{a}");
    assert_eq!(a["output"]["value"], Value::Null, "{a}");
    assert_eq!((b["checkpoint"].clone(), b["parent"].clone()), (json!(2), json!(1)), "{b}");
    assert_eq!(b["output"]["value"], "2", "{b}");
    assert_eq!(b["output"]["display"][0]["image/png"], PNG, "{b}");
    assert_eq!(b["output"]["truncated"], false, "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_survives_eviction_revert_and_a_restart_is_bounded_and_private() {
    let home = forkbox_testkit::fresh_home("forkbox-history-test-");
    let mut cfg = forkbox_server_testkit::config(home.path());
    cfg.runtime.image = Some(forkbox_testkit::shared().image_path.clone());
    // An unlimited key: the test's requests come faster than a default key's rate.
    let key =
        forkbox_server::create_key_full(home.path(), "alice", &forkbox_server::KeyLimits::unlimited(), true).unwrap();
    let node = Node::start(cfg.clone(), Some(key.clone())).await;
    let (st, v) = node.call(Method::POST, "/v1/sessions", Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();

    // A fresh session has no history.
    let h = node.history(&id).await;
    assert_eq!((h["total"].clone(), h["head"].clone(), h["calls"].clone()), (json!(0), Value::Null, json!([])), "{h}");

    node.exec(&id, "import sys\nprint('one')\nprint('warn', file=sys.stderr)\nx = 1").await;
    node.exec(&id, &format!("display({{'image/png': {PNG:?}}}, raw=True)\nx + 1")).await;
    node.exec(&id, "1/0").await;
    // More than a call keeps: cut (head and tail), marked, within the bound.
    let big = node.exec(&id, "print('y' * 600_000)\n'z' * 400_000").await;
    assert_eq!(big["checkpoint"], 4, "{big}");

    let h = node.history(&id).await;
    assert_eq!((h["total"].clone(), h["head"].clone(), h["before"].clone()), (json!(4), json!(4), Value::Null), "{h}");
    check_first_calls(&h);
    let e = &h["calls"][2]["output"]["error"];
    assert_eq!(e["type"], "ZeroDivisionError", "{e}");
    assert!(e["traceback"].as_str().unwrap().contains("1/0"), "{e}");
    let o = &h["calls"][3]["output"];
    assert_eq!(o["truncated"], true);
    let out = o["stdout"].as_str().unwrap();
    assert!(out.len() <= TEXT_MAX && out.starts_with("yyyy") && out.contains("bytes not kept"), "{}", out.len());
    assert!(serde_json::to_string(o).unwrap().len() <= OUTPUT_MAX);

    // One checkpoint: its full output (also one off the head's path).
    let (st, c) = node.get(&format!("/v1/sessions/{id}/checkpoints/2")).await;
    assert_eq!(st, StatusCode::OK, "{c}");
    assert_eq!(c["output"], h["calls"][1]["output"]);
    assert_eq!(c["code"], h["calls"][1]["code"]);
    assert_error(
        &node.get(&format!("/v1/sessions/{id}/checkpoints/99")).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );

    // Pages from the head back.
    let (st, p) = node.get(&format!("/v1/sessions/{id}/history?limit=3")).await;
    assert_eq!(st, StatusCode::OK, "{p}");
    assert_eq!(
        p["calls"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect::<Vec<_>>(),
        [2, 3, 4]
    );
    assert_eq!(p["before"], 2);
    let (_, p) = node.get(&format!("/v1/sessions/{id}/history?limit=3&before=2")).await;
    assert_eq!(
        p["calls"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(p["before"], Value::Null);
    for q in ["limit=0", "limit=101", "limit=x", "before=99", "nope=1"] {
        assert_error(
            &node.get(&format!("/v1/sessions/{id}/history?{q}")).await,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        );
    }
    assert_error(&node.get("/v1/sessions/nope/history").await, StatusCode::NOT_FOUND, "session_not_found");

    // Another tenant's key sees none of it.
    let bob = forkbox_server::create_key_with(home.path(), "bob", &forkbox_server::KeyLimits::unlimited()).unwrap();
    let http = reqwest::Client::new();
    for path in [format!("/v1/sessions/{id}/history"), format!("/v1/sessions/{id}/checkpoints/2")] {
        let r = http.get(format!("{}{path}", node.url)).bearer_auth(&bob).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "session_not_found", "{v}");
    }

    // Evicted (a revert to its own head drops the sandbox) and resumed by the next exec: all there.
    let (st, v) = node.call(Method::POST, &format!("/v1/sessions/{id}/revert"), Some(json!({ "checkpoint": 4 }))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["resident"], false, "{v}");
    check_first_calls(&node.history(&id).await);
    assert_eq!(node.exec(&id, "x * 10").await["value"], "10");
    let h = node.history(&id).await;
    assert_eq!(h["total"], 5);
    assert_eq!(h["calls"][4]["output"]["value"], "10");

    // A revert: the history is the path to the new head.
    let (st, v) = node.call(Method::POST, &format!("/v1/sessions/{id}/revert"), Some(json!({ "checkpoint": 2 }))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let h = node.history(&id).await;
    assert_eq!((h["total"].clone(), h["head"].clone()), (json!(2), json!(2)), "{h}");
    assert_eq!(codes(&h).len(), 2);
    node.exec(&id, "print('branch')").await;
    let h = node.history(&id).await;
    let seqs: Vec<i64> = h["calls"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 6], "{h}");
    assert_eq!(h["calls"][2]["parent"], 2);
    assert_eq!(h["calls"][2]["output"]["stdout"], "branch\n");
    // The session list names each session's last line of code.
    let (_, v) = node.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(v["last_code"], "print('branch')", "{v}");
    node.stop_within(Duration::from_secs(30)).await;

    // The stored outputs are charged with the checkpoints (what the disk quota counts), each within the bound.
    let db = home.path().join("sessions/sessions.db");
    let (charged, files, outputs, max) = tokio::task::spawn_blocking({
        let (db, id) = (db.clone(), id.clone());
        move || {
            let s = Store::open(&db).unwrap();
            let cps = s.session_checkpoints(&id).unwrap();
            let files: u64 = cps.iter().map(|c| c.bytes).sum();
            let outputs: u64 = cps.iter().map(|c| c.output_bytes).sum();
            let max = cps.iter().map(|c| c.output_bytes).max().unwrap();
            (s.disk_bytes(&id).unwrap(), files, outputs, max)
        }
    })
    .await
    .unwrap();
    assert!(outputs > 250_000, "{outputs}");
    assert!(max <= OUTPUT_MAX as u64, "{max}");
    assert_eq!(charged, files + outputs);

    // A restart on the same data directory: the same history.
    let node = Node::start(cfg, Some(key)).await;
    let h = node.history(&id).await;
    check_first_calls(&h);
    assert_eq!(h["calls"][2]["output"]["stdout"], "branch\n");
    node.stop_within(Duration::from_secs(30)).await;
}
