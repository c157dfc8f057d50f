//! API tests of the tree of states: one numbering per lineage (tracebacks, execs,
//! the tree agree), `GET .../tree`, `POST .../explore`, `GET .../checkpoints/{n}/variables`
//! and `GET .../diff`. The real server over real KVM guests (fails without /dev/kvm).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::{Duration, Instant};

use forkbox_server_testkit::{assert_error, TestServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A server of this binary (its data directories named for it).
async fn start() -> TestServer {
    TestServer::options().prefix("forkbox-tree-test-").start().await
}

fn seqs(v: &Value, key: &str) -> Vec<i64> {
    v[key].as_array().unwrap().iter().map(|n| n["checkpoint"].as_i64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_numbering_per_tree_after_revert_and_fork() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    assert_eq!(s.sexec(&id, "x = 1").await["checkpoint"], 1);
    assert_eq!(s.sexec(&id, "x += 1\nx").await["checkpoint"], 2);
    assert_eq!(s.sexec(&id, "x += 1\nx").await["checkpoint"], 3);
    // Revert to 1 and branch: the next number is 4, and its traceback says so.
    let (st, v) = s.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": 1 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let v = s.sexec(&id, "x = 10\n1/0").await;
    assert_eq!(v["checkpoint"], 4);
    assert!(v["error"]["traceback"].as_str().unwrap().contains("File \"<exec-4>\", line 2"), "{v}");
    // A fork of 3 continues the numbering: its first exec is 5 (not 1), traceback included.
    let (st, f) = s.post(&format!("/v1/sessions/{id}/fork"), json!({ "checkpoint": 3 })).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    let fid = f["id"].as_str().unwrap().to_string();
    let v = s.sexec(&fid, "x\nraise ValueError(x)").await;
    assert_eq!(v["checkpoint"], 5);
    assert!(v["error"]["traceback"].as_str().unwrap().contains("<exec-5>"), "{v}");
    // The source goes on at 6; the fork can revert to a checkpoint of the source by its number.
    assert_eq!(s.sexec(&id, "x").await["checkpoint"], 6);
    let (st, v) = s.post(&format!("/v1/sessions/{fid}/revert"), json!({ "checkpoint": 2 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(s.sexec(&fid, "x").await["value"], "2");

    // One tree, seen from either session: all nodes, edges, heads, sessions.
    let (st, t) = s.get(&format!("/v1/sessions/{id}/tree")).await;
    assert_eq!(st, StatusCode::OK, "{t}");
    assert_eq!(seqs(&t, "nodes"), [1, 2, 3, 4, 5, 6, 7]);
    let parent =
        |n: i64| t["nodes"].as_array().unwrap().iter().find(|x| x["checkpoint"] == n).unwrap()["parent"].clone();
    assert_eq!(
        (parent(1), parent(2), parent(4), parent(5), parent(6), parent(7)),
        (Value::Null, json!(1), json!(1), json!(3), json!(4), json!(2))
    );
    assert_eq!(t["head"], 6);
    let node = |n: i64| t["nodes"].as_array().unwrap().iter().find(|x| x["checkpoint"] == n).unwrap().clone();
    assert_eq!(node(6)["head"], true);
    assert_eq!(node(7)["head"], false);
    assert_eq!(node(7)["heads"], json!([fid]));
    assert_eq!(node(2)["summary"], "2");
    assert_eq!(node(4)["summary"], "ZeroDivisionError: division by zero");
    assert_eq!(node(5)["session"], fid.as_str());
    assert!(node(1)["bytes"].as_u64().unwrap() > 0);
    let edges: Vec<(i64, i64)> = t["edges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["parent"].as_i64().unwrap(), e["child"].as_i64().unwrap()))
        .collect();
    assert_eq!(edges, [(1, 2), (2, 3), (1, 4), (3, 5), (4, 6), (2, 7)]);
    let sessions: Vec<(String, Value)> = t["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["id"].as_str().unwrap().to_string(), x["forked_at"].clone()))
        .collect();
    assert_eq!(sessions, [(id.clone(), Value::Null), (fid.clone(), json!(3))]);
    let (_, tf) = s.get(&format!("/v1/sessions/{fid}/tree")).await;
    assert_eq!(seqs(&tf, "nodes"), [1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(tf["head"], 7);
    // The checkpoint list agrees on parents across the fork.
    let (_, cps) = s.get(&format!("/v1/sessions/{fid}/checkpoints")).await;
    let list: Vec<(i64, Value)> = cps["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["seq"].as_i64().unwrap(), c["parent"].clone()))
        .collect();
    assert_eq!(list, [(5, json!(3)), (7, json!(2))]);
    // A new session is a tree of its own; other tenants see nothing.
    let other = s.create_session(json!({})).await;
    assert_eq!(s.sexec(&other, "1").await["checkpoint"], 1);
    let (_, t2) = s.get(&format!("/v1/sessions/{other}/tree")).await;
    assert_eq!(seqs(&t2, "nodes"), [1]);
    // A node's code is cut in the tree (the checkpoint list keeps it whole).
    s.sexec(&other, &format!("#{}\n2", "x".repeat(10_000))).await;
    let (_, t2) = s.get(&format!("/v1/sessions/{other}/tree")).await;
    let code = t2["nodes"][1]["code"].as_str().unwrap();
    assert!(code.len() < 4200 && code.ends_with("# [forkbox: code cut, 10003 bytes in all]"), "{}", code.len());
    let bob = forkbox_server::create_key_with(s.home(), "bob", &forkbox_server::KeyLimits::unlimited()).unwrap();
    assert_error(
        &s.call(reqwest::Method::GET, &format!("/v1/sessions/{id}/tree"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(&s.get("/v1/sessions/s_nope/tree").await, StatusCode::NOT_FOUND, "session_not_found");
    // Checkpoints of another tree are not reachable by number.
    assert_error(
        &s.post(&format!("/v1/sessions/{other}/revert"), json!({ "checkpoint": 3 })).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explore_runs_alternatives_in_order_independently_and_leaves_the_source_alone() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "import random\nacc = [1, 2, 3]\nn = 5").await;
    let head = s.sexec(&id, "n += 1\nn").await;
    assert_eq!(head["checkpoint"], 2);
    let layers = s.home().join("sessions/layers");
    // (An exec's checkpoint is made durable after its reply: a read of the session waits for that.)
    let (st, _) = s.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(st, StatusCode::OK);
    let files_before: Vec<_> = std::fs::read_dir(&layers).unwrap().map(|e| e.unwrap().file_name()).collect();
    // Eight alternatives from the head, none kept: results in order, each from the same state.
    let codes: Vec<String> =
        (0..8).map(|i| format!("acc.append({i})\nprint('b{i}')\n(n, acc, random.random())")).collect();
    let (st, v) = s.post(&format!("/v1/sessions/{id}/explore"), json!({ "codes": codes })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["from"], 2);
    let b = v["branches"].as_array().unwrap();
    assert_eq!(b.len(), 8);
    let mut randoms = std::collections::HashSet::new();
    for (i, br) in b.iter().enumerate() {
        assert_eq!(br["index"], i);
        assert_eq!(br["session"], Value::Null);
        let r = &br["result"];
        let value = r["value"].as_str().unwrap();
        assert!(value.starts_with(&format!("(6, [1, 2, 3, {i}], ")), "branch {i}: {value}");
        assert_eq!(r["stdout"], format!("b{i}\n"));
        assert_eq!(r["checkpoint"], Value::Null);
        assert!(r["runtime_ms"].as_f64().unwrap() >= 0.0);
        randoms.insert(value.rsplit(", ").next().unwrap().to_string());
    }
    // Each branch was reseeded like a fork: no two drew the same number.
    assert_eq!(randoms.len(), 8);
    // Dropped branches leave no files behind.
    let files_after: Vec<_> = std::fs::read_dir(&layers).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files_before, files_after);
    // The source is untouched: same head, same state, and nothing new in its tree.
    let (_, sess) = s.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(sess["checkpoint"], 2);
    assert_eq!(s.sexec(&id, "acc").await["value"], "[1, 2, 3]");
    let (_, t) = s.get(&format!("/v1/sessions/{id}/tree")).await;
    assert_eq!(seqs(&t, "nodes"), [1, 2, 3]);
    assert_eq!(t["sessions"].as_array().unwrap().len(), 1);

    // Keep two of four, from checkpoint 1, with a failing branch and a timed-out one.
    let codes = json!(["n = 100\nn", "raise KeyError('k')", "while True: pass", "acc.pop()\nacc"]);
    let (st, v) = s
        .post(
            &format!("/v1/sessions/{id}/explore"),
            json!({ "checkpoint": 1, "codes": codes, "keep": [0, 3], "timeout_seconds": 1 }),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["from"], 1);
    let b = v["branches"].as_array().unwrap();
    assert_eq!(b[0]["result"]["value"], "100");
    assert_eq!(b[1]["result"]["error"]["type"], "KeyError");
    assert_eq!(b[1]["session"], Value::Null);
    assert_eq!(b[2]["failed"]["status"], 408);
    assert_eq!(b[2]["failed"]["error"]["code"], "timeout");
    assert_eq!(b[3]["result"]["value"], "[1, 2]");
    let (k0, k3) = (b[0]["session"].as_str().unwrap().to_string(), b[3]["session"].as_str().unwrap().to_string());
    let (c0, c3) = (b[0]["result"]["checkpoint"].as_i64().unwrap(), b[3]["result"]["checkpoint"].as_i64().unwrap());
    assert!(c0 > 3 && c3 > 3 && c0 != c3, "{c0} {c3}");
    // Kept branches are sessions tagged with their origin, at their new checkpoint, independent.
    let (_, k) = s.get(&format!("/v1/sessions/{k0}")).await;
    assert_eq!(k["tags"]["explore.from"], id.as_str());
    assert_eq!(k["tags"]["explore.checkpoint"], "1");
    assert_eq!(k["tags"]["explore.index"], "0");
    assert_eq!(k["checkpoint"], c0);
    assert_eq!(s.sexec(&k0, "(n, acc)").await["value"], "(100, [1, 2, 3])");
    assert_eq!(s.sexec(&k3, "(n, acc)").await["value"], "(5, [1, 2])");
    let (_, list) = s.get(&format!("/v1/sessions?tag=explore.from:{id}")).await;
    assert_eq!(list["sessions"].as_array().unwrap().len(), 2);
    // They are in the source's tree, forked at 1.
    let (_, t) = s.get(&format!("/v1/sessions/{id}/tree")).await;
    let forked: Vec<Value> = t["sessions"].as_array().unwrap().iter().map(|x| x["forked_at"].clone()).collect();
    assert_eq!(forked, [Value::Null, json!(1), json!(1)]);

    // Keep "all": every branch becomes a session.
    let (st, v) = s.post(&format!("/v1/sessions/{id}/explore"), json!({ "codes": ["1", "2"], "keep": "all" })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["branches"].as_array().unwrap().iter().all(|b| b["session"].is_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_execs_while_an_explore_runs() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "import time\nk = 0").await;
    let explore = {
        let (url, key, http, id) = (s.url.clone(), s.key.clone(), s.http.clone(), id.clone());
        tokio::spawn(async move {
            let codes: Vec<String> = (0..4).map(|i| format!("time.sleep(1.5)\nk + {i}")).collect();
            let t0 = Instant::now();
            let r = http
                .post(format!("{url}/v1/sessions/{id}/explore"))
                .bearer_auth(key)
                .json(&json!({ "codes": codes }))
                .send()
                .await
                .unwrap();
            (r.status(), r.json::<Value>().await.unwrap(), t0.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile the source runs (not paused, not busy) and moves on.
    let t0 = Instant::now();
    let v = s.sexec(&id, "k = 41\nk").await;
    assert_eq!(v["value"], "41");
    assert!(t0.elapsed() < Duration::from_millis(1200), "the source's exec waited {:?}", t0.elapsed());
    let (st, v, took) = explore.await.unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(took >= Duration::from_millis(1500));
    // The branches saw the checkpoint they started from, not the source's later state.
    let values: Vec<Value> = v["branches"].as_array().unwrap().iter().map(|b| b["result"]["value"].clone()).collect();
    assert_eq!(values, [json!("0"), json!("1"), json!("2"), json!("3")]);
    assert_eq!(s.sexec(&id, "k").await["value"], "41");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explore_limits_and_errors() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "x = 1").await;
    let p = format!("/v1/sessions/{id}/explore");
    assert_error(&s.post(&p, json!({ "codes": [] })).await, StatusCode::BAD_REQUEST, "invalid_request");
    let many: Vec<String> = (0..65).map(|i| i.to_string()).collect();
    assert_error(&s.post(&p, json!({ "codes": many })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(&s.post(&p, json!({ "codes": ["1"], "keep": [1] })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.post(&p, json!({ "codes": ["1", "2"], "keep": [0, 0] })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.post(&p, json!({ "codes": ["1"], "keep": "some" })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(&s.post(&p, json!({ "codes": ["1"], "bogus": 1 })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.post(&p, json!({ "codes": ["1"], "checkpoint": 99 })).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
    assert_error(
        &s.post(&p, json!({ "codes": ["1"], "timeout_seconds": 1e6 })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    let big = format!("#{}", "a".repeat(3 << 19));
    assert_error(&s.post(&p, json!({ "codes": [big] })).await, StatusCode::PAYLOAD_TOO_LARGE, "code_too_large");
    assert_error(
        &s.post("/v1/sessions/s_nope/explore", json!({ "codes": ["1"] })).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    // 64 is allowed.
    let max: Vec<String> = (0..64).map(|i| format!("x + {i}")).collect();
    let (st, v) = s.post(&p, json!({ "codes": max })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["branches"][63]["result"]["value"], "64");
    // Kept branches count against the key's session quota: all or none are created.
    let key = forkbox_server::create_key_with(
        s.home(),
        "small",
        &forkbox_server::KeyLimits { max_sessions: Some(3), ..Default::default() },
    )
    .unwrap();
    let (st, v) = s.call(reqwest::Method::POST, "/v1/sessions", Some(&key), Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let sid = v["id"].as_str().unwrap().to_string();
    let p = format!("/v1/sessions/{sid}/explore");
    let r =
        s.call(reqwest::Method::POST, &p, Some(&key), Some(json!({ "codes": ["1", "2", "3"], "keep": "all" }))).await;
    assert_error(&r, StatusCode::FORBIDDEN, "quota_exceeded");
    let (_, list) = s.call(reqwest::Method::GET, "/v1/sessions", Some(&key), None).await;
    assert_eq!(list["sessions"].as_array().unwrap().len(), 1);
    let (st, v) =
        s.call(reqwest::Method::POST, &p, Some(&key), Some(json!({ "codes": ["1", "2", "3"], "keep": [1, 2] }))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (_, list) = s.call(reqwest::Method::GET, "/v1/sessions", Some(&key), None).await;
    assert_eq!(list["sessions"].as_array().unwrap().len(), 3);
    // Branches are execs: a key with a rate limit of 3/s cannot explore 10 at once.
    let slow = forkbox_server::create_key_with(
        s.home(),
        "slow",
        &forkbox_server::KeyLimits { rate_limit: Some(3), ..Default::default() },
    )
    .unwrap();
    let (_, v) = s.call(reqwest::Method::POST, "/v1/sessions", Some(&slow), Some(json!({}))).await;
    let sid = v["id"].as_str().unwrap().to_string();
    let codes: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    let r = s
        .call(
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/explore"),
            Some(&slow),
            Some(json!({ "codes": codes })),
        )
        .await;
    assert_error(&r, StatusCode::TOO_MANY_REQUESTS, "rate_limited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_diff_checkpoints_without_touching_the_session() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "import numpy as np\na = np.zeros(1000)\nname = 'x' * 5\nlen = 3").await;
    s.sexec(&id, "a[7] = 1.0\nd = {'k': [1, 2]}\ndel name\nopen('/tmp/data.txt', 'w').write('hello')").await;
    s.sexec(&id, "import os\nos.makedirs('/output', exist_ok=True)\nopen('/tmp/data.txt', 'w').write('hello world')\nopen('/output/r.csv', 'w').write('a,b')").await;
    // Variables at 1: names, types, reprs, sizes (the user's rebinding of `len` does not break it).
    let (st, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/1/variables")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["checkpoint"], 1);
    let vars = v["variables"].as_array().unwrap();
    let var = |n: &str| vars.iter().find(|x| x["name"] == n).cloned().unwrap_or(Value::Null);
    assert_eq!(var("a")["type"], "numpy.ndarray");
    assert_eq!(var("a")["size"], 8000);
    assert_eq!(var("a")["len"], 1000);
    assert!(var("a")["repr"].as_str().unwrap().starts_with("array([0., 0.,"), "{}", var("a"));
    assert_eq!(var("name")["type"], "str");
    assert_eq!(var("name")["repr"], "'xxxxx'");
    assert_eq!(var("len")["type"], "int");
    assert_eq!(var("np")["type"], "module");
    assert!(vars.iter().all(|x| !x["name"].as_str().unwrap().starts_with("__")), "{v}");
    assert_eq!(var("_"), Value::Null);
    // Inspecting changed nothing: same head, no new checkpoint, the namespace as it was.
    let (_, sess) = s.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(sess["checkpoint"], 3);
    assert_eq!(s.sexec(&id, "'__forkbox_inspect__' in globals()").await["value"], "False");
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/checkpoints/99/variables")).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );

    // Diff 1 -> 3: added d, removed name, changed a; /tmp/data.txt and /output/r.csv added (neither existed at 1).
    let (st, d) = s.get(&format!("/v1/sessions/{id}/diff?from=1&to=3")).await;
    assert_eq!(st, StatusCode::OK, "{d}");
    let names =
        |k: &str| d[k].as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert!(names("variables_added").contains(&"d".to_string()), "{d}");
    assert!(names("variables_added").contains(&"os".to_string()), "{d}");
    assert_eq!(names("variables_removed"), ["name"]);
    assert_eq!(names("variables_changed"), ["a"]);
    let paths = |k: &str| {
        d[k].as_array()
            .unwrap()
            .iter()
            .map(|x| (x["path"].as_str().unwrap().to_string(), x["size_after"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        paths("files_added"),
        [("/output/r.csv".to_string(), json!(3)), ("/tmp/data.txt".to_string(), json!(11))]
    );
    assert!(paths("files_removed").is_empty() && paths("files_changed").is_empty(), "{d}");
    assert_eq!(d["common"], 1);
    assert_eq!(
        d["calls"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect::<Vec<_>>(),
        [2, 3]
    );
    assert!(d["calls"][0]["code"].as_str().unwrap().starts_with("a[7] = 1.0"));
    // Diff 2 -> head (4, after the check above): a file changed size, nothing undone.
    let (_, d) = s.get(&format!("/v1/sessions/{id}/diff?from=2")).await;
    assert_eq!(d["to"], 4);
    assert!(d["undone"].as_array().unwrap().is_empty(), "{d}");
    assert_eq!(d["files_changed"], json!([{ "path": "/tmp/data.txt", "size_before": 5, "size_after": 11 }]));
    assert!(d["variables_changed"].as_array().unwrap().is_empty(), "{d}");
    // Across branches: revert to 1 and branch; diff from 3 to the new head undoes 3 and 2.
    s.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": 1 })).await;
    let v = s.sexec(&id, "b = 2").await;
    let n = v["checkpoint"].as_i64().unwrap();
    let (_, d) = s.get(&format!("/v1/sessions/{id}/diff?from=3&to={n}")).await;
    assert_eq!(d["common"], 1);
    assert_eq!(
        d["undone"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect::<Vec<_>>(),
        [3, 2]
    );
    let paths = |k: &str| {
        d[k].as_array()
            .unwrap()
            .iter()
            .map(|x| (x["path"].as_str().unwrap().to_string(), x["size_after"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        d["calls"].as_array().unwrap().iter().map(|c| c["checkpoint"].as_i64().unwrap()).collect::<Vec<_>>(),
        [n]
    );
    assert_eq!(paths("files_removed").len(), 2, "{d}");
    // Bad queries.
    assert_error(&s.get(&format!("/v1/sessions/{id}/diff")).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(&s.get(&format!("/v1/sessions/{id}/diff?from=x")).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/diff?from=1&what=2")).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/diff?from=1&to=77")).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
    // A namespace whose reprs raise: the inspection still reports (a placeholder repr), never the session's problem.
    s.sexec(&id, "class Bad:\n    def __repr__(self): raise RuntimeError('no')\nbad = Bad()").await;
    let (_, sess) = s.get(&format!("/v1/sessions/{id}")).await;
    let head = sess["checkpoint"].as_i64().unwrap();
    let (st, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/{head}/variables")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let bad = v["variables"].as_array().unwrap().iter().find(|x| x["name"] == "bad").unwrap().clone();
    assert!(bad["repr"].as_str().unwrap().starts_with("<Bad instance at 0x"), "{bad}");
    assert_eq!(bad["type"], "Bad");
    // One that breaks the inspection itself (print rebound in builtins) is 422 inspect_failed.
    s.sexec(&id, "import builtins\nbuiltins.print = None").await;
    let (_, sess) = s.get(&format!("/v1/sessions/{id}")).await;
    let head = sess["checkpoint"].as_i64().unwrap();
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/checkpoints/{head}/variables")).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "inspect_failed",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variables_with_files_list_a_checkpoints_files_against_the_template() {
    let s = start().await;
    let id = s.create_session(json!({})).await;
    let one = s.sexec(&id, "k = 1\nopen('/tmp/a.txt', 'w').write('abc')").await["checkpoint"].as_i64().unwrap();
    let two = s.sexec(&id, "import os\nos.makedirs('/data', exist_ok=True)\nopen('/data/b.bin', 'wb').write(b'x' * 10)\nopen('/tmp/a.txt', 'a').write('de')").await["checkpoint"]
        .as_i64()
        .unwrap();
    let files = |v: &Value, k: &str| {
        v["files"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x["path"].as_str().unwrap().to_string(), x["size_after"].clone()))
            .collect::<Vec<_>>()
    };
    // Without the parameter the response is as before: no `files`.
    let (st, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/{one}/variables")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v.get("files").is_none(), "{v}");
    // Checkpoint one: its variables and the file it wrote, not the template's files.
    let (st, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/{one}/variables?files=true")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["variables"].as_array().unwrap().iter().any(|x| x["name"] == "k" && x["repr"] == "1"), "{v}");
    assert_eq!(files(&v, "added"), [("/tmp/a.txt".to_string(), json!(3))]);
    assert!(files(&v, "changed").is_empty() && files(&v, "removed").is_empty(), "{v}");
    assert_eq!(v["files"]["truncated"], false);
    // Checkpoint two: both files, as they are there; checkpoint one still reads as it was.
    let (_, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/{two}/variables?files=true")).await;
    assert_eq!(files(&v, "added"), [("/data/b.bin".to_string(), json!(10)), ("/tmp/a.txt".to_string(), json!(5))]);
    let (_, v) = s.get(&format!("/v1/sessions/{id}/checkpoints/{one}/variables?files=true")).await;
    assert_eq!(files(&v, "added"), [("/tmp/a.txt".to_string(), json!(3))]);
    // Nothing changed in the session.
    assert_eq!(s.get(&format!("/v1/sessions/{id}")).await.1["checkpoint"], two);
    // Bad queries.
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/checkpoints/{one}/variables?files=yes")).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/checkpoints/{one}/variables?what=1")).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/checkpoints/99/variables?files=true")).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
}
