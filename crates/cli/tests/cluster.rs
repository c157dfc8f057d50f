//! A cluster of three real `forkbox serve --cluster` processes on loopback
//! ports, sharing one real PostgreSQL (Debian's binaries, a private server)
//! and one real S3-compatible bucket (`s3s-fs`), asserted from the
//! outside: a session made on one node is exec'd through the others with its
//! state intact (requests forwarded to the node that has it, also a streamed
//! exec and files); a key made with `key create --database` works on every
//! node; the node that has the session killed with SIGKILL mid-exec: within
//! the lease time the session answers from another node at its last
//! checkpoint, the exec that was running left nothing; `forkbox node drain`
//! moves a node's sessions away (its /readyz says 503, requests that reach
//! it are served elsewhere); the bucket down for a while gives 503
//! `storage_unavailable` and nothing half-written, and execs work again once
//! it is back; a node stopped with SIGTERM gives its sessions back at once.
//!
//! Needs /dev/kvm, root, PostgreSQL's binaries and s3s-fs (FAILS without them, never skips).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use forkbox_testkit::postgres::Postgres;
use forkbox_testkit::s3::{BUCKET, KEY_ID, PREFIX, S3, SECRET};
use serde_json::{json, Value};

const LEASE_SECONDS: u64 = 3;

struct Node {
    id: String,
    url: String,
    home: tempfile::TempDir,
    proc: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

fn forkbox() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkbox"))
}

fn s3_env(cmd: &mut Command, s3: &S3) {
    cmd.env("AWS_ENDPOINT_URL", s3.endpoint())
        .env("AWS_ACCESS_KEY_ID", KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1");
}

/// `forkbox serve --cluster` as node `id` on a fresh home: the first node has
/// the guest image (it boots the template and publishes both), the others
/// have nothing and fetch them from the bucket.
fn start_node(id: &str, pg: &Postgres, s3: &S3, with_image: bool) -> Node {
    let home = forkbox_testkit::node_home("fbx-cluster-", with_image);
    let mut cmd = forkbox();
    cmd.arg("--home")
        .arg(home.path())
        .args(["serve", "--listen", "127.0.0.1:0", "--exec-slots", "2"])
        .args(["--cluster", "--node-id", id, "--lease-seconds", &LEASE_SECONDS.to_string()])
        .arg("--objects")
        .arg(format!("s3://{BUCKET}/{PREFIX}"))
        .env("FORKBOX_DATABASE_URL", pg.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    s3_env(&mut cmd, s3);
    let mut proc = cmd.spawn().unwrap();
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    let t0 = Instant::now();
    let url = loop {
        let line = lines.next().expect("serve ended before it listened").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "serve did not start");
    };
    std::thread::spawn(move || for _ in lines {});
    Node { id: id.into(), url, home, proc }
}

/// One instruction over ForeverVM's REPL WebSocket of machine `id` at `node`:
/// (what it printed, its result).
async fn repl_exec(node: &Node, key: &str, id: &str, code: &str) -> (String, Value) {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::{client::IntoClientRequest, Message};
    let url = format!("{}/v1/machine/{id}/repl", node.url.replacen("http://", "ws://", 1));
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let hello = loop {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next()).await.unwrap().unwrap().unwrap();
        if let Message::Text(t) = m {
            break serde_json::from_str::<Value>(t.as_str()).unwrap();
        }
    };
    assert_eq!((&hello["type"], &hello["machine_name"]), (&json!("connected"), &json!(id)), "{hello}");
    let msg = json!({ "type": "exec", "instruction": { "code": code }, "request_id": 7 });
    ws.send(Message::text(msg.to_string())).await.unwrap();
    let mut output = String::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next()).await.unwrap().unwrap().unwrap();
        let Message::Text(t) = m else { continue };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        match v["type"].as_str().unwrap() {
            "exec_received" => assert_eq!(v["request_id"], 7, "{v}"),
            "output" => output.push_str(v["chunk"]["data"].as_str().unwrap()),
            "result" => {
                let _ = ws.close(None).await;
                return (output, v["result"].clone());
            }
            _ => panic!("unexpected REPL message {v}"),
        }
    }
}

struct Client {
    http: reqwest::Client,
    key: String,
}

impl Client {
    async fn call(&self, node: &Node, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self.http.request(method, format!("{}{path}", node.url)).bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let st = r.status().as_u16();
        let text = r.text().await.unwrap();
        (st, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn exec(&self, node: &Node, id: &str, code: &str) -> (u16, Value) {
        self.call(node, reqwest::Method::POST, &format!("/v1/sessions/{id}/exec"), Some(json!({ "code": code }))).await
    }

    /// The node that has session `id` resident (None: none), and every node's state.
    async fn owner(&self, via: &Node) -> (Vec<(String, u64)>, Vec<Value>) {
        let (st, v) = self.call(via, reqwest::Method::GET, "/v1/admin/nodes", None).await;
        assert_eq!(st, 200, "{v}");
        let nodes = v["nodes"].as_array().unwrap().clone();
        let with: Vec<(String, u64)> = nodes
            .iter()
            .filter(|n| n["sessions"].as_u64().unwrap() > 0)
            .map(|n| (n["id"].as_str().unwrap().to_string(), n["sessions"].as_u64().unwrap()))
            .collect();
        (with, nodes)
    }
}

/// An unlimited admin key of tenant `t`, created in the shared database (every node knows it).
fn admin_key(pg: &Postgres) -> String {
    let out = forkbox()
        .args(["key", "create", "--tenant", "t", "--unlimited", "--admin"])
        .env("FORKBOX_DATABASE_URL", pg.url())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn three_nodes_share_sessions_survive_a_killed_node_drain_and_a_bucket_outage() {
    let pg = Postgres::start();
    let mut s3 = S3::start();
    let mut nodes: Vec<Node> = ["a", "b", "c"].iter().map(|id| start_node(id, &pg, &s3, *id == "a")).collect();
    // One template, published by a and fetched by the others (see shared_templates).
    let templates = |n: &Node| std::fs::read_dir(n.home.path().join("templates")).unwrap().count();
    assert!(nodes.iter().all(|n| templates(n) == 1));
    // A key in the shared database: every node knows it.
    let key = admin_key(&pg);
    let c = Client { http: reqwest::Client::new(), key };
    for n in &nodes {
        let (st, v) = c.call(n, reqwest::Method::GET, "/v1/admin/nodes", None).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["node"], n.id.as_str());
        let alive: Vec<&str> = v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["alive"] == true)
            .map(|n| n["id"].as_str().unwrap())
            .collect();
        assert_eq!(alive, ["a", "b", "c"], "{v}");
    }

    // Made on a, exec'd through b (b takes it: nobody had it), then through c and a (forwarded to b).
    let (st, v) = c.call(&nodes[0], reqwest::Method::POST, "/v1/sessions", Some(json!({}))).await;
    assert_eq!(st, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (st, v) = c.exec(&nodes[1], &id, "x = 1").await;
    assert_eq!((st, v["checkpoint"].clone()), (200, json!(1)), "{v}");
    let (st, v) = c.exec(&nodes[2], &id, "x += 1\nx").await;
    assert_eq!((st, v["value"].clone()), (200, json!("2")), "{v}");
    let (st, v) = c.exec(&nodes[0], &id, "x += 1\nx").await;
    assert_eq!((st, v["value"].clone(), v["checkpoint"].clone()), (200, json!("3"), json!(3)), "{v}");
    assert_eq!(c.owner(&nodes[0]).await.0, [("b".to_string(), 1)]);
    // Its view says resident (the owner answers it), from any node.
    let (st, v) = c.call(&nodes[2], reqwest::Method::GET, &format!("/v1/sessions/{id}"), None).await;
    assert_eq!((st, v["resident"].clone()), (200, json!(true)), "{v}");
    // A streamed exec and files, through nodes that do not have it.
    let r = c
        .http
        .post(format!("{}/v1/sessions/{id}/exec/stream", nodes[2].url))
        .bearer_auth(&c.key)
        .json(&json!({ "code": "print('streamed', x)" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let body = r.text().await.unwrap();
    assert!(body.contains("streamed 3"), "{body}");
    let put = c
        .http
        .put(format!("{}/v1/sessions/{id}/files/data/in.txt", nodes[0].url))
        .bearer_auth(&c.key)
        .body("hello cluster")
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{}", put.text().await.unwrap());
    let got = c
        .http
        .get(format!("{}/v1/sessions/{id}/files/data/in.txt", nodes[2].url))
        .bearer_auth(&c.key)
        .send()
        .await
        .unwrap();
    assert_eq!(got.text().await.unwrap(), "hello cluster");
    // ForeverVM's REPL WebSocket, opened on c: relayed to b, which runs the instruction.
    let (output, result) = repl_exec(&nodes[2], &c.key, &id, "print('over the relay')\nx * 10").await;
    assert_eq!(output, "over the relay\n");
    assert_eq!(result["value"], "30", "{result}");
    assert_eq!(c.owner(&nodes[0]).await.0, [("b".to_string(), 1)], "relayed, not moved");
    let (_, v) = c.call(&nodes[0], reqwest::Method::GET, &format!("/v1/sessions/{id}/checkpoints"), None).await;
    let committed = v["checkpoints"].as_array().unwrap().len();
    assert_eq!(committed, 6, "{v}");

    // b (which has the session) is killed with SIGKILL in the middle of an exec.
    let slow = {
        let (http, key, url, id) = (c.http.clone(), c.key.clone(), nodes[1].url.clone(), id.clone());
        tokio::spawn(async move {
            http.post(format!("{url}/v1/sessions/{id}/exec"))
                .bearer_auth(key)
                .json(&json!({ "code": "y = 'uncommitted'\nimport time\ntime.sleep(60)" }))
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // (Drop sends SIGKILL and reaps it.)
    drop(nodes.remove(1));
    assert!(slow.await.unwrap().is_err(), "the exec on the killed node got no answer");
    // Through c: within the lease time c (or a) takes the session, at its last checkpoint.
    let t0 = Instant::now();
    let (st, v) = c.exec(&nodes[1], &id, "(x, 'y' in dir(), open('/data/in.txt').read())").await;
    assert_eq!((st, v["value"].clone()), (200, json!("(3, False, 'hello cluster')")), "{v}");
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(LEASE_SECONDS + 6), "took {waited:?}");
    let (_, v) = c.call(&nodes[0], reqwest::Method::GET, &format!("/v1/sessions/{id}/checkpoints"), None).await;
    let codes: Vec<&str> = v["checkpoints"].as_array().unwrap().iter().map(|c| c["code"].as_str().unwrap()).collect();
    assert_eq!(codes.len(), committed + 1, "{codes:?}");
    assert!(!codes.iter().any(|c| c.contains("uncommitted")), "{codes:?}");
    let (owners, all) = c.owner(&nodes[0]).await;
    assert_eq!(owners.len(), 1, "{all:?}");
    let (owner_id, _) = owners[0].clone();
    assert!(all.iter().any(|n| n["id"] == "b" && n["alive"] == false), "{all:?}");

    // Drain the node that has it now: the CLI waits until it holds nothing.
    let owner_ix = nodes.iter().position(|n| n.id == owner_id).unwrap();
    let other_ix = 1 - owner_ix;
    let out = forkbox()
        .args(["--url", &nodes[other_ix].url, "node", "drain", &owner_id, "--timeout", "30"])
        .env("FORKBOX_API_KEY", &c.key)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is drained"));
    let ready = c.http.get(format!("{}/readyz", nodes[owner_ix].url)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    let ready = c.http.get(format!("{}/readyz", nodes[other_ix].url)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    // A request that reaches the drained node is served by the other one.
    let (st, v) = c.exec(&nodes[owner_ix], &id, "x").await;
    assert_eq!((st, v["value"].clone()), (200, json!("3")), "{v}");
    assert_eq!(c.owner(&nodes[0]).await.0, [(nodes[other_ix].id.clone(), 1)]);
    let out = forkbox()
        .args(["--url", &nodes[owner_ix].url, "node", "activate"])
        .env("FORKBOX_API_KEY", &c.key)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The bucket goes away for a while: a checkpoint cannot be stored (503,
    // nothing committed), reading the session still works; then it is back.
    s3.stop();
    let (st, v) = c.exec(&nodes[0], &id, "w = 'while the bucket is down'").await;
    assert_eq!((st, v["error"]["code"].clone()), (503, json!("storage_unavailable")), "{v}");
    s3.restart();
    let (st, v) = c.exec(&nodes[1], &id, "(x, 'w' in dir())").await;
    assert_eq!((st, v["value"].clone()), (200, json!("(3, False)")), "{v}");

    // SIGTERM: the node gives its sessions back at once (no waiting for its lease).
    let (owners, _) = c.owner(&nodes[0]).await;
    let holder = nodes.iter().position(|n| n.id == owners[0].0).unwrap();
    let term = Command::new("kill").args(["-TERM", &nodes[holder].proc.id().to_string()]).status().unwrap();
    assert!(term.success());
    let exit = nodes[holder].proc.wait().unwrap();
    assert!(exit.success(), "a node stopped with SIGTERM exits cleanly: {exit:?}");
    let survivor = &nodes[1 - holder];
    let t0 = Instant::now();
    let (st, v) = c.exec(survivor, &id, "x + 1").await;
    assert_eq!((st, v["value"].clone()), (200, json!("4")), "{v}");
    assert!(t0.elapsed() < Duration::from_secs(LEASE_SECONDS), "waited {:?} for a node that left", t0.elapsed());
}

/// A raw HTTP/1.1 request (no client-side URL normalisation): (status, body).
async fn raw_request(node: &Node, key: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = node.url.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string()))
}

/// A request forwarded to the session's node is exactly the route that was
/// checked where it arrived: `files/../../../../v1/...` (plain or
/// percent-encoded) is 400 `invalid_path` there, never resolved by the
/// forward into another route of the owner; a file name with characters a URL
/// encodes arrives as it was sent; an upload through the other node is
/// streamed on to the owner and lands whole.
#[tokio::test(flavor = "multi_thread")]
async fn forwards_send_the_checked_route_and_stream_uploads() {
    let pg = Postgres::start();
    let s3 = S3::start();
    let nodes: Vec<Node> = ["a", "b"].iter().map(|id| start_node(id, &pg, &s3, *id == "a")).collect();
    let key = admin_key(&pg);
    let c = Client { http: reqwest::Client::new(), key: key.clone() };
    let (st, v) = c.call(&nodes[0], reqwest::Method::POST, "/v1/sessions", Some(json!({}))).await;
    assert_eq!(st, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (st, v) = c.exec(&nodes[0], &id, "x = 1").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(c.owner(&nodes[1]).await.0, [("a".to_string(), 1)]);
    let via = &nodes[1];
    for path in [
        format!("/v1/sessions/{id}/files/../../../../v1/sessions"),
        format!("/v1/sessions/{id}/files/%2e%2e/%2E%2E/%2e%2e/%2e%2e/v1/sessions"),
        format!("/v1/sessions/{id}/files/tmp/../../../../../v1/whoami"),
    ] {
        let (st, body) = raw_request(via, &key, "GET", &path, b"").await;
        assert_eq!(st, 400, "{path}: {body}");
        assert!(body.contains("invalid_path"), "{path}: {body}");
    }
    // Uploads through b: forwarded (streamed) to a; names with spaces and percent signs kept.
    let data: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
    let (st, body) = raw_request(via, &key, "PUT", &format!("/v1/sessions/{id}/files/data/a%20b%25c.bin"), &data).await;
    assert_eq!(st, 201, "{body}");
    let code = "open('/data/a b%c.bin', 'rb').read() == bytes(i % 251 for i in range(5 << 20))";
    let (st, v) = c.exec(via, &id, code).await;
    assert_eq!((st, v["value"].clone()), (200, json!("True")), "{v}");
    let (st, body) = raw_request(via, &key, "PUT", &format!("/v1/sessions/{id}/files/proc/self/mem"), b"x").await;
    assert_eq!(st, 400, "{body}");
    assert_eq!(c.owner(&nodes[1]).await.0, [("a".to_string(), 1)], "the session stayed on a");
}
