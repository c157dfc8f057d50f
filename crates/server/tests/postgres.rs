//! Session metadata in PostgreSQL (`serve --database postgres://...`), over
//! HTTP against a real PostgreSQL server (Debian's `postgresql`, one private
//! server started here on a loopback port; a missing installation is a
//! failure, never a skip). The real server (`Server::bind`, as `forkbox serve`
//! runs it) over real KVM guests (fails without /dev/kvm).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::Duration;

use forkbox_server::{Server, ServerConfig};
use forkbox_sessions::store::Store;
use forkbox_testkit::postgres::Postgres;
use reqwest::StatusCode;
use serde_json::{json, Value};

use forkbox_server_testkit::Node;

fn config(home: &std::path::Path, database: &str) -> ServerConfig {
    let mut cfg = forkbox_server_testkit::config(home);
    cfg.runtime.image = Some(forkbox_testkit::shared().image_path.clone());
    cfg.runtime.sessions.database = Some(database.to_string());
    cfg
}

/// A session exec with the node's key.
trait Exec {
    async fn exec(&self, id: &str, code: &str) -> (StatusCode, Value);
}

impl Exec for Node {
    async fn exec(&self, id: &str, code: &str) -> (StatusCode, Value) {
        self.call(reqwest::Method::POST, &format!("/v1/sessions/{id}/exec"), Some(json!({ "code": code }))).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_in_postgres_survive_a_restart_and_a_database_outage() {
    let mut pg = Postgres::start();
    let home = forkbox_testkit::fresh_home("forkbox-postgres-test-");
    let node = Node::start(config(home.path(), &pg.url()), None).await;

    let (st, v) = node.call(reqwest::Method::POST, "/v1/sessions", Some(json!({ "tags": { "team": "pg" } }))).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (st, v) = node.exec(&id, "x = 41").await;
    assert_eq!((st, v["checkpoint"].clone()), (StatusCode::OK, json!(1)), "{v}");

    // The metadata is in PostgreSQL, not in a SQLite file of the data directory.
    assert!(!home.path().join("sessions/sessions.db").exists());
    let (session, checkpoints) = tokio::task::spawn_blocking({
        let url = pg.url();
        let id = id.clone();
        move || {
            let store = Store::open_postgres(&url).unwrap();
            let s = store.all_sessions().unwrap().into_iter().find(|s| s.id == id).expect("the session's row");
            (s, store.session_checkpoints(&id).unwrap())
        }
    })
    .await
    .unwrap();
    assert_eq!(session.tags.get("team").map(String::as_str), Some("pg"));
    assert_eq!(checkpoints.iter().map(|c| (c.seq, c.code.as_str())).collect::<Vec<_>>(), [(1, "x = 41")]);
    assert_eq!(session.head, Some(checkpoints[0].id));

    // A second node on the same database is refused at start (one node per database for now).
    let other = forkbox_testkit::fresh_home("forkbox-postgres-test-");
    let e = Server::bind(config(other.path(), &pg.url())).await.err().expect("a second node is refused");
    assert!(format!("{e:#}").contains("in use by another forkbox node"), "{e:#}");

    // The database goes away: a clear 503, nothing half-done; it comes back: the session goes on.
    pg.stop();
    let (st, v) = node.exec(&id, "x = 0").await;
    assert_eq!(
        (st, v["error"]["code"].clone()),
        (StatusCode::SERVICE_UNAVAILABLE, json!("storage_unavailable")),
        "{v}"
    );
    assert!(!v["error"]["message"].as_str().unwrap_or("").contains(&pg.port.to_string()), "{v}");
    pg.restart();
    let (st, v) = node.exec(&id, "x + 1").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["value"].clone(), v["checkpoint"].clone()), (json!("42"), json!(2)), "{v}");

    // A restart of the node: the session resumes from its files and the database's history.
    let key = node.key.clone();
    node.stop_within(Duration::from_secs(20)).await;
    let node = Node::start(config(home.path(), &pg.url()), Some(key)).await;
    let (st, v) = node.exec(&id, "x + 2").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["value"].clone(), v["checkpoint"].clone()), (json!("43"), json!(3)), "{v}");
    let (st, v) = node.call(reqwest::Method::GET, &format!("/v1/sessions/{id}/checkpoints"), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let codes: Vec<&str> = v["checkpoints"].as_array().unwrap().iter().filter_map(|c| c["code"].as_str()).collect();
    assert_eq!(codes, ["x = 41", "x + 1", "x + 2"], "{v}");
    node.stop_within(Duration::from_secs(20)).await;
}
