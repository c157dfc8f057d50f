//! API tests: the real server (axum on 127.0.0.1:0, in this process) driven
//! by a real HTTP client (reqwest).
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped. Every test gets a fresh temporary home whose
//! `templates` is a symlink to the shared home's, so no template is rebuilt.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::{Duration, Instant};

use forkbox_server::{router, Server};
use forkbox_server_testkit::{assert_error, TestServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

use forkbox_testkit::shared;

fn fresh_home() -> tempfile::TempDir {
    forkbox_testkit::fresh_home("forkbox-server-test-")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_exec_results_and_zeroboot_fields() {
    let s = TestServer::start().await;
    let (st, v) = s
        .post("/v1/exec", json!({ "code": "import numpy as np\nx = int(np.arange(4).sum())\nprint('hi', x)\nx * 7" }))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["value"], "42");
    assert_eq!(v["stdout"], "hi 6\n");
    assert_eq!(v["stderr"], "");
    assert_eq!(v["error"], Value::Null);
    assert_eq!(v["exit_code"], 0);
    assert!(v["id"].as_str().unwrap().starts_with("x_"));
    for f in ["runtime_ms", "fork_time_ms", "exec_time_ms", "total_time_ms"] {
        assert!(v[f].as_f64().is_some_and(|t| t >= 0.0), "{f}: {v}");
    }
    assert!(v["total_time_ms"].as_f64() >= v["exec_time_ms"].as_f64());

    // A Python exception is a result, not an HTTP error.
    let (st, v) = s.post("/v1/exec", json!({ "code": "print('before')\n1/0", "timeout_seconds": 5 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["exit_code"], 1);
    assert_eq!(v["stdout"], "before\n");
    assert_eq!(v["error"]["type"], "ZeroDivisionError");
    assert!(v["error"]["traceback"].as_str().unwrap().contains("ZeroDivisionError"), "{v}");

    // One-shots are independent forks.
    let (_, v) = s.post("/v1/exec", json!({ "code": "y = 1" })).await;
    assert_eq!(v["exit_code"], 0);
    let (_, v) = s.post("/v1/exec", json!({ "code": "y" })).await;
    assert_eq!(v["error"]["type"], "NameError", "{v}");
}

/// The exec threads (where KVM_RUN runs and guest syscalls are handled) run
/// under the seccomp allow-list: `Seccomp: 2` and
/// `NoNewPrivs: 1` in /proc for each, while the server's other threads are
/// unfiltered; one-shots, a session's checkpoints (host file I/O), a file
/// upload and a download all work under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_threads_run_under_the_seccomp_filter() {
    let s = TestServer::start().await;
    let (st, v) = s.post("/v1/exec", json!({ "code": "import numpy\nint(numpy.arange(5).sum())" })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["value"], "10");
    let id = s.create_session(json!({})).await;
    assert_eq!(s.sexec(&id, "open('/tmp/a', 'w').write('x' * 300000)\nz = 5").await["checkpoint"], 1);
    assert_eq!(s.sexec(&id, "z * len(open('/tmp/a').read())").await["value"], "1500000");
    let (st, v) = s.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": 1 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(s.sexec(&id, "z").await["value"], "5");
    let field = |status: &str, name: &str| -> String {
        status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
    };
    let (mut exec_threads, mut others) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = t.unwrap().path();
        let (Ok(comm), Ok(status)) =
            (std::fs::read_to_string(dir.join("comm")), std::fs::read_to_string(dir.join("status")))
        else {
            continue; // the thread ended
        };
        if comm.trim().starts_with("forkbox-exec-") {
            exec_threads += 1;
            assert_eq!(field(&status, "Seccomp:"), "2", "{} {}", comm.trim(), dir.display());
            assert_eq!(field(&status, "NoNewPrivs:"), "1", "{} {}", comm.trim(), dir.display());
        } else if !comm.trim().starts_with("forkbox-") && !comm.trim().starts_with("kvm-") {
            // The runtime's async and blocking threads, the test harness: never filtered
            // (the VM pool and reaper threads an exec thread starts inherit its filter, and
            // so do KVM's kernel workers of a VM it created, such as kvm-nx-lpage-recovery).
            others += 1;
            assert_eq!(field(&status, "Seccomp:"), "0", "{} is not a guest thread", comm.trim());
        }
    }
    assert!(exec_threads >= 1 && others >= 1, "{exec_threads} exec threads, {others} other threads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_exec_in_order_with_per_item_failures() {
    let s = TestServer::start().await;
    let codes = json!(["1 + 1", "print('out')", "raise ValueError('v')", "while True: pass", "sum(range(10))"]);
    let (st, v) = s.post("/v1/exec/batch", json!({ "codes": codes, "timeout_seconds": 1 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let r = v["results"].as_array().unwrap();
    assert_eq!(r.len(), 5);
    assert_eq!(r[0]["value"], "2");
    assert_eq!(r[1]["stdout"], "out\n");
    assert_eq!(r[2]["error"]["type"], "ValueError");
    assert_eq!(r[2]["exit_code"], 1);
    assert_eq!(r[3]["status"], 408, "{}", r[3]);
    assert_eq!(r[3]["error"]["code"], "timeout");
    assert_eq!(r[4]["value"], "45");

    assert_error(&s.post("/v1/exec/batch", json!({ "codes": [] })).await, StatusCode::BAD_REQUEST, "invalid_request");
    let many: Vec<String> = (0..65).map(|i| format!("{i}")).collect();
    assert_error(&s.post("/v1/exec/batch", json!({ "codes": many })).await, StatusCode::BAD_REQUEST, "invalid_request");
    let max: Vec<String> = (0..64).map(|i| format!("{i} * 2")).collect();
    let (st, v) = s.post("/v1/exec/batch", json!({ "codes": max })).await;
    assert_eq!(st, StatusCode::OK);
    let r = v["results"].as_array().unwrap();
    assert_eq!(r.len(), 64);
    for (i, x) in r.iter().enumerate() {
        assert_eq!(x["value"], format!("{}", i * 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lifecycle_state_checkpoints_revert_fork_delete() {
    let s = TestServer::start().await;
    let (st, v) = s
        .post(
            "/v1/sessions",
            json!({ "tags": { "user": "ann", "env": "test" }, "memory_mb": 512, "timeout_seconds": 20 }),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["tags"]["user"], "ann");
    assert_eq!(v["limits"]["memory_mb"], 512);
    assert_eq!(v["limits"]["timeout_seconds"], 20.0);
    assert_eq!(v["checkpoint"], Value::Null);

    let v1 = s.sexec(&id, "x = 1\nhist = ['a']").await;
    assert_eq!(v1["checkpoint"], 1);
    assert_eq!(v1["exit_code"], 0);
    let v2 = s.sexec(&id, "x += 1\nhist.append('b')\nx").await;
    assert_eq!(v2["value"], "2");
    assert_eq!(v2["checkpoint"], 2);
    let v3 = s.sexec(&id, "x += 10\nprint(hist)\nx").await;
    assert_eq!(v3["value"], "12");
    assert_eq!(v3["stdout"], "['a', 'b']\n");
    assert_eq!(v3["checkpoint"], 3);
    // A Python error still checkpoints (the session goes on).
    let v4 = s.sexec(&id, "undefined_name").await;
    assert_eq!(v4["exit_code"], 1);
    assert_eq!(v4["error"]["type"], "NameError");
    assert_eq!(v4["checkpoint"], 4);

    let (st, v) = s.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["checkpoint"], 4);
    assert_eq!(v["id"], id.as_str());

    // List with tag filters.
    let other = s.create_session(json!({ "tags": { "user": "bob" } })).await;
    let (_, v) = s.get("/v1/sessions?tag=user:ann").await;
    let ids: Vec<&str> = v["sessions"].as_array().unwrap().iter().map(|x| x["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![id.as_str()]);
    let (_, v) = s.get("/v1/sessions?tag=user:ann&tag=env:test").await;
    assert_eq!(v["sessions"].as_array().unwrap().len(), 1);
    let (_, v) = s.get("/v1/sessions?tag=user:nobody").await;
    assert_eq!(v["sessions"].as_array().unwrap().len(), 0);
    let (_, v) = s.get("/v1/sessions").await;
    assert_eq!(v["sessions"].as_array().unwrap().len(), 2);
    assert_error(&s.get("/v1/sessions?tag=nocolon").await, StatusCode::BAD_REQUEST, "invalid_request");

    // Checkpoints.
    let (st, v) = s.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let cps = v["checkpoints"].as_array().unwrap();
    assert_eq!(cps.iter().map(|c| c["seq"].as_i64().unwrap()).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(cps[1]["code"], "x += 1\nhist.append('b')\nx");
    assert_eq!(cps[1]["parent"], 1);
    assert_eq!(cps[0]["parent"], Value::Null);
    assert_eq!(cps[3]["head"], true);
    assert_eq!(cps[0]["head"], false);

    // Revert to 2: later execs continue from there.
    let (st, v) = s.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": 2 })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["checkpoint"], 2);
    let v = s.sexec(&id, "(x, hist)").await;
    assert_eq!(v["value"], "(2, ['a', 'b'])");
    assert_eq!(v["checkpoint"], 5);

    // Fork from checkpoint 3 and from the head; the source goes on unaffected.
    let (st, f) =
        s.post(&format!("/v1/sessions/{id}/fork"), json!({ "checkpoint": 3, "tags": { "user": "forked" } })).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    let fid = f["id"].as_str().unwrap().to_string();
    assert_ne!(fid, id);
    assert_eq!(f["forked_from"]["session"], id.as_str());
    assert_eq!(f["forked_from"]["checkpoint"], 3);
    assert_eq!(f["tags"]["user"], "forked");
    assert_eq!(s.sexec(&fid, "x += 100\nx").await["value"], "112");
    assert_eq!(s.sexec(&id, "x").await["value"], "2");
    let (st, h) = s.post(&format!("/v1/sessions/{id}/fork"), json!({})).await;
    assert_eq!(st, StatusCode::CREATED, "{h}");
    let hid = h["id"].as_str().unwrap().to_string();
    assert_eq!(s.sexec(&hid, "x").await["value"], "2");

    // Delete.
    let (st, _) = s.delete(&format!("/v1/sessions/{id}")).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    assert_error(&s.get(&format!("/v1/sessions/{id}")).await, StatusCode::NOT_FOUND, "session_not_found");
    assert_error(&s.delete(&format!("/v1/sessions/{id}")).await, StatusCode::NOT_FOUND, "session_not_found");
    // Forks outlive their source.
    assert_eq!(s.sexec(&fid, "x").await["value"], "112");
    let (st, _) = s.delete(&format!("/v1/sessions/{other}")).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_errors_have_statuses_and_the_error_shape() {
    let s = TestServer::start().await;
    // Malformed JSON.
    assert_error(&s.post_raw("/v1/exec", b"{\"code\": ".to_vec()).await, StatusCode::BAD_REQUEST, "malformed_json");
    assert_error(&s.post_raw("/v1/sessions", b"not json".to_vec()).await, StatusCode::BAD_REQUEST, "malformed_json");
    // Wrong shape / invalid arguments.
    assert_error(&s.post("/v1/exec", json!({ "code": 5 })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(&s.post("/v1/exec", json!({})).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.post("/v1/exec", json!({ "code": "1", "timeout_seconds": -1 })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(
        &s.post("/v1/exec", json!({ "code": "1", "timeout_seconds": 1e9 })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(&s.post("/v1/sessions", json!({ "memory_mb": 1 })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.post("/v1/sessions", json!({ "tags": { "a:b": "c" } })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    // Payload too large (body over 2 MiB) and code too large (over 1 MiB, body under 2 MiB).
    let big = format!("{{\"code\": \"{}\"}}", "#".repeat(3 << 20));
    assert_error(&s.post_raw("/v1/exec", big.into_bytes()).await, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    let code = format!("x = 1\n#{}", "a".repeat(3 << 19));
    assert_error(&s.post("/v1/exec", json!({ "code": code })).await, StatusCode::PAYLOAD_TOO_LARGE, "code_too_large");
    // Unknown routes and methods.
    assert_error(&s.get("/v1/nothing").await, StatusCode::NOT_FOUND, "not_found");
    assert_error(&s.get("/v1/exec").await, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    // Unknown session / checkpoint.
    assert_error(&s.get("/v1/sessions/s_nope").await, StatusCode::NOT_FOUND, "session_not_found");
    assert_error(
        &s.post("/v1/sessions/s_nope/exec", json!({ "code": "1" })).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(&s.get("/v1/sessions/s_nope/checkpoints").await, StatusCode::NOT_FOUND, "session_not_found");
    assert_error(&s.post("/v1/sessions/s_nope/fork", json!({})).await, StatusCode::NOT_FOUND, "session_not_found");
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "z = 3").await;
    let sess = format!("/v1/sessions/{id}");
    assert_error(
        &s.post(&format!("{sess}/revert"), json!({ "checkpoint": 99 })).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
    assert_error(
        &s.post(&format!("{sess}/fork"), json!({ "checkpoint": 99 })).await,
        StatusCode::NOT_FOUND,
        "checkpoint_not_found",
    );
    assert_error(&s.post(&format!("{sess}/revert"), json!({})).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(
        &s.post(&format!("{sess}/exec"), json!({ "code": code })).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "code_too_large",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_crashes_and_busy_sessions() {
    let s = TestServer::start().await;
    // One-shot timeout: 408, promptly.
    let t0 = Instant::now();
    let got = s.post("/v1/exec", json!({ "code": "while True: pass", "timeout_seconds": 1 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // The guest exiting: 422.
    assert_error(
        &s.post("/v1/exec", json!({ "code": "import os\nos._exit(3)" })).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        "guest_exited",
    );

    // In a session: 408, rolled back to the last checkpoint, which the error names.
    let id = s.create_session(json!({ "timeout_seconds": 1 })).await;
    s.sexec(&id, "y = 5").await;
    let got = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": "y = 6\nwhile True: pass" })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    assert_eq!(got.1["error"]["checkpoint"], 1, "{}", got.1);
    let v = s.sexec(&id, "y").await;
    assert_eq!(v["value"], "5");
    let got = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": "import os\nos._exit(1)" })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "guest_exited");
    assert_eq!(got.1["error"]["checkpoint"], 2, "{}", got.1);
    assert_eq!(s.sexec(&id, "y").await["value"], "5");

    // Busy: a second exec while one runs gets 409; the first completes.
    let busy = s.create_session(json!({})).await;
    s.sexec(&busy, "import time\nn = 0").await;
    let (url, key, http) = (s.url.clone(), s.key.clone(), s.http.clone());
    let b = busy.clone();
    let long = tokio::spawn(async move {
        let r = http
            .post(format!("{url}/v1/sessions/{b}/exec"))
            .bearer_auth(key)
            .json(&json!({ "code": "time.sleep(2)\nn += 1\nn" }))
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_error(
        &s.post(&format!("/v1/sessions/{busy}/exec"), json!({ "code": "n" })).await,
        StatusCode::CONFLICT,
        "session_busy",
    );
    assert_error(
        &s.post(&format!("/v1/sessions/{busy}/revert"), json!({ "checkpoint": 1 })).await,
        StatusCode::CONFLICT,
        "session_busy",
    );
    let (st, v) = long.await.unwrap();
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["value"], "1");
    assert_eq!(s.sexec(&busy, "n").await["value"], "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_503_not_an_unbounded_queue() {
    let s = TestServer::start_with(|c| {
        c.runtime.concurrency = 1;
        c.max_queue = 1;
        c.queue_wait = Duration::from_millis(300);
    })
    .await;
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let (url, key, http) = (s.url.clone(), s.key.clone(), s.http.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/exec"))
                .bearer_auth(key)
                .json(&json!({ "code": "import time\ntime.sleep(1.5)\n1" }))
                .send()
                .await
                .unwrap();
            let retry = r.headers().get("retry-after").is_some();
            (r.status(), retry, r.json::<Value>().await.unwrap())
        }));
    }
    let (mut ok, mut over) = (0, 0);
    for t in tasks {
        let (st, retry, v) = t.await.unwrap();
        match st {
            StatusCode::OK => {
                assert_eq!(v["value"], "1");
                ok += 1;
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(v["error"]["code"], "overloaded", "{v}");
                assert!(retry, "503 without Retry-After");
                over += 1;
            }
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert!(ok >= 1 && over >= 3, "ok {ok}, overloaded {over}");
    // Capacity comes back.
    let (st, v) = s.post("/v1/exec", json!({ "code": "2" })).await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("2")));
    // (The slot is released just after the reply, once the sandbox is torn down.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, h) = s.call(reqwest::Method::GET, "/healthz", None, None).await;
        assert_eq!(h["exec_slots"], 1);
        assert_eq!(h["queued"], 0);
        if h["exec_slots_free"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the exec slot was never released: {h}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_and_tenant_isolation() {
    let s = TestServer::start().await;
    // No key / bad key: 401. Health and metrics need none.
    assert_error(
        &s.call(reqwest::Method::POST, "/v1/exec", None, Some(json!({ "code": "1" }))).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    assert_error(
        &s.call(reqwest::Method::GET, "/v1/sessions", Some("fbk_wrong"), None).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    let r = s.http.get(format!("{}/v1/sessions", s.url)).header("authorization", "Basic abc").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(s.call(reqwest::Method::GET, "/healthz", None, None).await.0, StatusCode::OK);
    // Only hashes are stored.
    let db = std::fs::read(forkbox_server::keys::keys_path(s.home())).unwrap();
    assert!(!db.windows(s.key.len()).any(|w| w == s.key.as_bytes()), "the key itself is in keys.db");

    let bob = s.new_key("bob");
    let alice_session = s.create_session(json!({ "tags": { "k": "v" } })).await;
    s.sexec(&alice_session, "secret = 41").await;
    let path = format!("/v1/sessions/{alice_session}");
    use reqwest::Method as M;
    assert_error(&s.call(M::GET, &path, Some(&bob), None).await, StatusCode::NOT_FOUND, "session_not_found");
    assert_error(
        &s.call(M::POST, &format!("{path}/exec"), Some(&bob), Some(json!({ "code": "secret" }))).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.call(M::GET, &format!("{path}/checkpoints"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.call(M::POST, &format!("{path}/revert"), Some(&bob), Some(json!({ "checkpoint": 1 }))).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.call(M::POST, &format!("{path}/fork"), Some(&bob), Some(json!({}))).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(&s.call(M::DELETE, &path, Some(&bob), None).await, StatusCode::NOT_FOUND, "session_not_found");
    let (_, v) = s.call(M::GET, "/v1/sessions", Some(&bob), None).await;
    assert_eq!(v["sessions"], json!([]));
    let (_, v) = s.call(M::GET, "/v1/sessions?tag=k:v", Some(&bob), None).await;
    assert_eq!(v["sessions"], json!([]));
    // Bob's own session is his; alice's is untouched.
    let (st, b) = s.call(M::POST, "/v1/sessions", Some(&bob), Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED);
    let (_, v) = s.get("/v1/sessions").await;
    assert_eq!(v["sessions"].as_array().unwrap().len(), 1);
    assert_error(
        &s.get(&format!("/v1/sessions/{}", b["id"].as_str().unwrap())).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_eq!(s.sexec(&alice_session, "secret + 1").await["value"], "42");
    // A second key of the same tenant sees the same sessions.
    let alice2 = s.new_key("alice");
    assert_eq!(s.call(M::GET, &path, Some(&alice2), None).await.0, StatusCode::OK);
    assert!(forkbox_server::create_key(s.home(), "bad tenant!").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health() {
    let s = TestServer::start().await;
    s.post("/v1/exec", json!({ "code": "1" })).await;
    s.post("/v1/exec", json!({ "code": "1/0" })).await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "a = 1").await;
    assert_error(&s.get("/v1/sessions/s_nope").await, StatusCode::NOT_FOUND, "session_not_found");
    let (st, h) = s.call(reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(h["status"], "ok");
    assert_eq!(h["template"], shared().template.info.id.as_str());
    // Nothing about tenants or sessions in the health check.
    let keys: Vec<&str> = h.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["default_template", "exec_slots", "exec_slots_free", "node", "queued", "status", "template"],
        "{h}"
    );
    assert_eq!(h["node"], Value::Null, "not a cluster node");
    let (st, r) = s.call(reqwest::Method::GET, "/readyz", None, None).await;
    assert_eq!((st, r), (StatusCode::OK, json!({ "status": "ready" })));
    // Not a cluster node: no nodes (and an admin route).
    let (st, n) = s.call(reqwest::Method::GET, "/v1/admin/nodes", Some(&s.key), None).await;
    assert_eq!((st, n), (StatusCode::OK, json!({ "node": null, "nodes": [] })));
    // /metrics: an admin key only.
    assert_error(&s.call(reqwest::Method::GET, "/metrics", None, None).await, StatusCode::UNAUTHORIZED, "unauthorized");
    let plain = s.new_key("not-admin");
    assert_error(
        &s.call(reqwest::Method::GET, "/metrics", Some(&plain), None).await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    let r = s.http.get(format!("{}/metrics", s.url)).bearer_auth(&s.key).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = r.text().await.unwrap();
    for needle in [
        "forkbox_exec_total{kind=\"oneshot\",outcome=\"ok\"}",
        "forkbox_exec_total{kind=\"oneshot\",outcome=\"python_error\"}",
        "forkbox_exec_total{kind=\"session\",outcome=\"ok\"}",
        "forkbox_exec_duration_seconds_bucket{kind=\"oneshot\",le=\"0.01\"}",
        "forkbox_exec_duration_seconds_count{kind=\"session\"}",
        "forkbox_fork_duration_seconds_bucket",
        "forkbox_sessions_resident",
        "forkbox_sessions_live",
        "forkbox_checkpoint_bytes_total",
        "forkbox_vm_pool_private_bytes",
        "forkbox_vm_pool_private_bytes_max",
        "forkbox_errors_total{code=\"session_not_found\"}",
    ] {
        assert!(text.contains(needle), "/metrics lacks {needle}:\n{text}");
    }
}

/// The `forkbox serve` path: `Server::bind` opens everything itself, creates
/// a key when there is none, serves until the shutdown future, then returns
/// and releases the data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_bind_run_and_graceful_shutdown() {
    let home = fresh_home();
    let mut cfg = forkbox_server_testkit::config(home.path());
    cfg.runtime.image = Some(shared().image_path.clone());
    cfg.runtime.maintenance_every = Duration::from_millis(200);
    cfg.runtime.sessions.idle_timeout = Duration::from_millis(300);
    let server = Server::bind(cfg.clone()).await.expect("bind");
    let key = server.created_key.clone().expect("a key is created when none exists");
    assert!(key.starts_with("fbk_"));
    let addr = server.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let http = reqwest::Client::new();
    let url = format!("http://{addr}");
    let r: Value = http
        .post(format!("{url}/v1/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "6 * 7" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["value"], "42");
    let sess: Value =
        http.post(format!("{url}/v1/sessions")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    let sid = sess["id"].as_str().unwrap().to_string();
    let r: Value = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q = 9" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["checkpoint"], 1);
    // The maintenance loop evicts the idle session; the next exec resumes it from disk.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let g: Value =
            http.get(format!("{url}/v1/sessions/{sid}")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
        if g["resident"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "session never evicted: {g}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r: Value = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["value"], "9");

    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("shutdown in time").unwrap().expect("run");
    assert!(http.get(format!("{url}/healthz")).send().await.is_err(), "still listening after shutdown");

    // A restart on the same home: no new key, the old one works, the session persists.
    let server = Server::bind(cfg).await.expect("rebind after shutdown");
    assert!(server.created_key.is_none());
    let addr = server.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let r: Value = http
        .post(format!("http://{addr}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q + 1" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["value"], "10");
    tx.send(()).unwrap();
    run.await.unwrap().unwrap();
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Figures, not a pass/fail gate (run alone: `cargo test --release -p
/// forkbox-server -- --ignored --nocapture`): one-shot exec latency in
/// process vs over HTTP on loopback, then throughput with 16 concurrent clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn http_overhead_figures() {
    let s = TestServer::start().await;
    let sh = shared();
    let n = 300;
    let (engine, template) = (sh.engine.clone(), sh.template.clone());
    let mut inproc: Vec<f64> = tokio::task::spawn_blocking(move || {
        (0..n)
            .map(|_| {
                let t = Instant::now();
                engine.exec(&template, "1 + 1", forkbox_engine::Limits::default()).unwrap();
                t.elapsed().as_secs_f64() * 1000.0
            })
            .collect()
    })
    .await
    .unwrap();
    let mut http = Vec::new();
    let (mut in_server, mut outside) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = Instant::now();
        let (st, v) = s.post("/v1/exec", json!({ "code": "1 + 1" })).await;
        assert_eq!(st, StatusCode::OK);
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        http.push(ms);
        let (total, fork, exec) = (
            v["total_time_ms"].as_f64().unwrap(),
            v["fork_time_ms"].as_f64().unwrap(),
            v["exec_time_ms"].as_f64().unwrap(),
        );
        in_server.push(total - fork - exec);
        outside.push(ms - total);
    }
    eprintln!(
        "one-shot p50/p99: in-process {:.3}/{:.3} ms, HTTP {:.3}/{:.3} ms",
        pct(&mut inproc, 0.5),
        pct(&mut inproc, 0.99),
        pct(&mut http, 0.5),
        pct(&mut http, 0.99)
    );
    eprintln!(
        "HTTP overhead p50: in the server around the engine {:.3} ms, client+hyper+JSON {:.3} ms",
        pct(&mut in_server, 0.5),
        pct(&mut outside, 0.5)
    );
    let id = s.create_session(json!({})).await;
    let mut sess = Vec::new();
    for i in 0..100 {
        let t = Instant::now();
        s.sexec(&id, &format!("v = {i}")).await;
        sess.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    eprintln!("session exec p50/p99 over HTTP: {:.3}/{:.3} ms", pct(&mut sess, 0.5), pct(&mut sess, 0.99));

    let dur = Duration::from_secs(5);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (url, key, client) = (s.url.clone(), s.key.clone(), s.http.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut err) = (0u64, 0u64);
            while t0.elapsed() < dur {
                let r = client
                    .post(format!("{url}/v1/exec"))
                    .bearer_auth(&key)
                    .json(&json!({ "code": "1 + 1" }))
                    .send()
                    .await
                    .unwrap();
                if r.status() == StatusCode::OK {
                    ok += 1
                } else {
                    err += 1
                }
                let _ = r.bytes().await;
            }
            (ok, err)
        }));
    }
    let (mut ok, mut err) = (0, 0);
    for t in tasks {
        let (o, e) = t.await.unwrap();
        ok += o;
        err += e;
    }
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("16 clients over HTTP: {:.0} execs/s, {err} errors of {}", ok as f64 / secs, ok + err);
    let (engine, template) = (sh.engine.clone(), sh.template.clone());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let done = tokio::task::spawn_blocking(move || {
        let t0 = Instant::now();
        let count = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|sc| {
            for _ in 0..workers {
                sc.spawn(|| {
                    while t0.elapsed() < dur {
                        engine.exec(&template, "1 + 1", forkbox_engine::Limits::default()).unwrap();
                        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        count.into_inner() as f64 / t0.elapsed().as_secs_f64()
    })
    .await
    .unwrap();
    eprintln!("in-process, {workers} threads: {done:.0} execs/s");
}

// ---------------------------------------------------------------------------
// Embedded router, per-key limits, OpenAPI, ForeverVM
// ---------------------------------------------------------------------------

/// One request through the router in process (tower `oneshot`, no socket).
async fn oneshot(app: &axum::Router, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    use tower::ServiceExt;
    let mut req = axum::http::Request::builder().method(method).uri(path);
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            axum::body::Body::from(b.to_string())
        }
        None => axum::body::Body::empty(),
    };
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap();
    let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await.unwrap();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_router_is_the_same_api_for_a_fixed_tenant() {
    let home = fresh_home();
    let state = forkbox_server_testkit::state(forkbox_server_testkit::config(home.path())).await;
    let app = forkbox_server::embedded_router(state.clone(), "local");
    // No key needed; the tenant is fixed.
    let (st, v) = oneshot(&app, "POST", "/v1/exec", Some(json!({ "code": "print('hi')\n6 * 7" }))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["value"].as_str(), v["stdout"].as_str()), (Some("42"), Some("hi\n")));
    assert_eq!(oneshot(&app, "GET", "/v1/whoami", None).await.1["account"], "local");
    let (st, sess) = oneshot(&app, "POST", "/v1/sessions", Some(json!({ "tags": { "via": "embedded" } }))).await;
    assert_eq!(st, StatusCode::CREATED, "{sess}");
    let id = sess["id"].as_str().unwrap().to_string();
    let (_, v) = oneshot(&app, "POST", &format!("/v1/sessions/{id}/exec"), Some(json!({ "code": "k = 5" }))).await;
    assert_eq!(v["checkpoint"], 1, "{v}");
    let (_, v) = oneshot(&app, "POST", &format!("/v1/sessions/{id}/exec"), Some(json!({ "code": "k * 2" }))).await;
    assert_eq!(v["value"], "10");
    // It fails the way the HTTP API fails.
    let (st, v) = oneshot(&app, "GET", "/v1/sessions/s_nope", None).await;
    assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("session_not_found")));
    let (st, v) = oneshot(&app, "POST", "/v1/exec", Some(json!({ "code": 1 }))).await;
    assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_request")));
    assert_eq!(oneshot(&app, "GET", "/v1/openapi.json", None).await.0, StatusCode::OK);
    // Its sessions are the data directory's sessions of that tenant: the HTTP router shows them to a key of "local".
    let http = router(state);
    let key = forkbox_server::create_key(home.path(), "local").unwrap();
    use tower::ServiceExt;
    let req = axum::http::Request::get(format!("/v1/sessions/{id}"))
        .header("authorization", format!("Bearer {key}"))
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(http.oneshot(req).await.unwrap().status().as_u16(), 200);
}

fn limited_key(s: &TestServer, tenant: &str, limits: forkbox_server::KeyLimits) -> String {
    s.key_with(tenant, &limits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_rate_limit_gets_429_with_retry_after() {
    let s = TestServer::start().await;
    let key = limited_key(&s, "slow", forkbox_server::KeyLimits { rate_limit: Some(3), ..Default::default() });
    let (mut ok, mut limited) = (0, 0);
    for _ in 0..10 {
        let r = s.http.get(format!("{}/v1/sessions", s.url)).bearer_auth(&key).send().await.unwrap();
        match r.status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
                assert!((1..=2).contains(&retry), "Retry-After {retry}");
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["error"]["code"], "rate_limited", "{v}");
                limited += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    // A burst of 3, then (10 requests well within a second) refusals.
    assert!((3..=5).contains(&ok) && limited >= 5, "ok {ok}, limited {limited}");
    // Other keys are not affected; the bucket refills.
    assert_eq!(s.get("/v1/sessions").await.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(s.call(reqwest::Method::GET, "/v1/sessions", Some(&key), None).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_session_and_disk_quotas_get_403() {
    use reqwest::Method as M;
    let s = TestServer::start().await;
    let key = limited_key(
        &s,
        "small",
        forkbox_server::KeyLimits { max_sessions: Some(2), max_disk_mb: Some(1), ..Default::default() },
    );
    let (st, a) = s.call(M::POST, "/v1/sessions", Some(&key), Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    let (st, m) = s.call(M::POST, "/v1/machine/new", Some(&key), Some(json!({}))).await;
    assert_eq!(st, StatusCode::OK, "{m}");
    // Two sessions exist (one a ForeverVM machine): create, fork and machine new are refused.
    assert_error(
        &s.call(M::POST, "/v1/sessions", Some(&key), Some(json!({}))).await,
        StatusCode::FORBIDDEN,
        "quota_exceeded",
    );
    assert_error(
        &s.call(M::POST, &format!("/v1/sessions/{a}/fork"), Some(&key), Some(json!({}))).await,
        StatusCode::FORBIDDEN,
        "quota_exceeded",
    );
    assert_error(
        &s.call(M::POST, "/v1/machine/new", Some(&key), Some(json!({}))).await,
        StatusCode::FORBIDDEN,
        "quota_exceeded",
    );
    // The quota is the tenant's, not the server's: alice (unlimited) is not affected.
    s.create_session(json!({})).await;
    // Disk: 2 MB of random bytes would make a checkpoint over the 1 MiB quota: refused before it
    // is written, with the exec's result; the session stays at its previous checkpoint.
    let (st, v) = s
        .call(
            M::POST,
            &format!("/v1/sessions/{a}/exec"),
            Some(&key),
            Some(json!({ "code": "import os\nblob = os.urandom(2_000_000)\nprint('ran')\nlen(blob)" })),
        )
        .await;
    assert_error(&(st, v.clone()), StatusCode::FORBIDDEN, "quota_exceeded");
    assert_eq!(v["error"]["result"]["value"], "2000000", "{v}");
    assert_eq!(v["error"]["result"]["stdout"], "ran\n", "{v}");
    assert_eq!(v["error"]["checkpoint"], Value::Null, "{v}");
    let (st, v) = s
        .call(M::POST, &format!("/v1/sessions/{a}/exec"), Some(&key), Some(json!({ "code": "'blob' in globals()" })))
        .await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("False")), "{v}");
    // (That was the session's first checkpoint: it is settled after the reply, before any
    // later use of the session, such as this listing.)
    let (st, v) = s.call(M::GET, &format!("/v1/sessions/{a}/checkpoints"), Some(&key), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["checkpoints"].as_array().map(|c| c.len()), Some(1), "{v}");
    assert!(std::fs::read_dir(s.home().join("sessions/layers"))
        .unwrap()
        .flatten()
        .all(|e| !e.file_name().to_string_lossy().ends_with(".tmp")));
    // Deleting frees both quotas.
    assert_eq!(s.call(M::DELETE, &format!("/v1/sessions/{a}"), Some(&key), None).await.0, StatusCode::NO_CONTENT);
    let (st, b) = s.call(M::POST, "/v1/sessions", Some(&key), Some(json!({}))).await;
    assert_eq!(st, StatusCode::CREATED, "{b}");
    let (st, v) = s
        .call(
            M::POST,
            &format!("/v1/sessions/{}/exec", b["id"].as_str().unwrap()),
            Some(&key),
            Some(json!({ "code": "1 + 1" })),
        )
        .await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("2")), "{v}");
}

/// keys.db files from before per-key limits gain the columns in place; their keys keep working, unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_keys_db_is_migrated_in_place() {
    let home = fresh_home();
    let path = forkbox_server::keys::keys_path(home.path());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let old_key = "fbk_0123456789abcdef";
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE api_keys (hash TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_ms INTEGER NOT NULL);",
        )
        .unwrap();
        conn.execute("INSERT INTO api_keys VALUES (?1, 'old', 1)", [forkbox_server::keys::hash_key(old_key)]).unwrap();
    }
    let db = forkbox_runtime::keys::KeyDb::open(home.path(), None).unwrap();
    let store = forkbox_server::keys::KeyStore::new(std::sync::Arc::new(db));
    let info = store.lookup(old_key).unwrap().expect("the old key is still known");
    assert_eq!(info.tenant, "old");
    assert_eq!(info.limits, forkbox_server::KeyLimits::default());
    assert!(info.limiter.is_none());
    let limits = forkbox_server::KeyLimits {
        rate_limit: Some(5),
        max_sessions: Some(3),
        max_disk_mb: Some(7),
        ..Default::default()
    };
    let new_key = forkbox_server::create_key_with(home.path(), "new", &limits).unwrap();
    let info = store.lookup(&new_key).unwrap().unwrap();
    assert_eq!((info.tenant.as_str(), &info.limits), ("new", &limits));
    assert!(forkbox_server::create_key_with(
        home.path(),
        "x",
        &forkbox_server::KeyLimits { max_sessions: Some(0), ..Default::default() }
    )
    .is_err());
    assert_eq!(forkbox_server::keys::count_keys(home.path()).unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_describes_every_route_the_router_serves() {
    let s = TestServer::start().await;
    // No auth needed.
    let (st, doc) = s.call(reqwest::Method::GET, "/v1/openapi.json", None, None).await;
    assert_eq!(st, StatusCode::OK, "{doc}");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{}", doc["openapi"]);
    let paths = doc["paths"].as_object().unwrap();
    // The routes of the API (README / contract): each is in the document with its method.
    let expected = [
        ("post", "/v1/exec"),
        ("post", "/v1/exec/batch"),
        ("post", "/v1/sessions"),
        ("get", "/v1/sessions"),
        ("get", "/v1/sessions/{id}"),
        ("delete", "/v1/sessions/{id}"),
        ("post", "/v1/sessions/{id}/exec"),
        ("get", "/v1/sessions/{id}/checkpoints"),
        ("post", "/v1/sessions/{id}/revert"),
        ("post", "/v1/sessions/{id}/fork"),
        ("post", "/v1/exec/stream"),
        ("post", "/v1/sessions/{id}/exec/stream"),
        ("post", "/v1/sessions/{id}/interrupt"),
        ("post", "/v1/commands"),
        ("post", "/v1/commands/stream"),
        ("post", "/v1/sessions/{id}/commands"),
        ("post", "/v1/sessions/{id}/commands/stream"),
        ("put", "/v1/sessions/{id}/files/{path}"),
        ("get", "/v1/sessions/{id}/files/{path}"),
        ("get", "/v1/sessions/{id}/files"),
        ("get", "/v1/whoami"),
        ("post", "/v1/machine/new"),
        ("get", "/v1/machine/list"),
        ("post", "/v1/machine/list"),
        ("post", "/v1/machine/{name}/exec"),
        ("get", "/v1/machine/{name}/exec/{seq}/result"),
        ("get", "/v1/machine/{name}/repl"),
        ("get", "/v1/openapi.json"),
        ("get", "/healthz"),
        ("get", "/metrics"),
    ];
    for (m, p) in expected {
        assert!(paths.get(p).and_then(|x| x.get(m)).is_some(), "{m} {p} missing from the OpenAPI document");
    }
    // And every operation in the document is served (not the router's fallback), with auth where the document says.
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for (p, item) in paths {
        for (m, op) in item.as_object().unwrap() {
            let url = p
                .replace("{id}", "s_none")
                .replace("{path}", "x.txt")
                .replace("{name}", "s_none")
                .replace("{seq}", "0");
            let method = reqwest::Method::from_bytes(m.to_uppercase().as_bytes()).unwrap();
            let open = op["security"] == json!([{}]);
            let (st, v) = s.call(method.clone(), &url, None, None).await;
            if !open {
                assert_error(&(st, v.clone()), StatusCode::UNAUTHORIZED, "unauthorized");
            }
            let (st, v) = s
                .call(method, &url, Some(&s.key), if m == "get" || m == "delete" { None } else { Some(json!({})) })
                .await;
            assert!(
                !["not_found", "method_not_allowed"].contains(&v["error"]["code"].as_str().unwrap_or("")),
                "{m} {p}: {st} {v}"
            );
            assert!(st.as_u16() < 500, "{m} {p}: {st} {v}");
            // Documented statuses include what it answered.
            let responses = op["responses"].as_object().unwrap();
            assert!(
                responses.contains_key(st.as_str()) || responses.contains_key("default"),
                "{m} {p}: {st} undocumented"
            );
            assert!(op["operationId"].is_string());
        }
    }
    for name in [
        "ExecRequest",
        "ExecResponse",
        "Session",
        "ErrorBody",
        "MachineExec",
        "InstructionResult",
        "FvmResult",
        "SessionCommand",
        "OneShotCommand",
        "CommandResponse",
    ] {
        assert!(schemas.contains_key(name), "schema {name} missing");
    }
    assert_eq!(doc["components"]["schemas"]["ExecResponse"]["properties"]["exit_code"]["type"], "integer");
}

async fn fvm_result(s: &TestServer, machine: &str, seq: i64, key: &str) -> Value {
    let (st, v) =
        s.call(reqwest::Method::GET, &format!("/v1/machine/{machine}/exec/{seq}/result"), Some(key), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["instruction_id"], seq);
    v["result"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forevervm_machines_exec_and_long_poll() {
    use reqwest::Method as M;
    let s = TestServer::start().await;
    let key = s.key.clone();
    assert_eq!(s.get("/v1/whoami").await.1, json!({ "account": "alice" }));
    let (st, m) = s.post("/v1/machine/new", json!({ "tags": { "kind": "fvm" } })).await;
    assert_eq!(st, StatusCode::OK, "{m}");
    let name = m["machine_name"].as_str().unwrap().to_string();
    for method in [M::GET, M::POST] {
        let (st, l) = s.call(method, "/v1/machine/list", Some(&key), None).await;
        assert_eq!(st, StatusCode::OK, "{l}");
        let machines = l["machines"].as_array().unwrap();
        assert_eq!(machines.len(), 1);
        assert_eq!(machines[0]["name"], name.as_str());
        assert_eq!(machines[0]["tags"]["kind"], "fvm");
        assert!(machines[0]["created_at"].as_str().unwrap().ends_with('Z'), "{l}");
        assert_eq!(machines[0]["expires_at"], Value::Null);
    }
    // Exec returns at once; the long poll waits for the result.
    let exec = format!("/v1/machine/{name}/exec");
    let t0 = Instant::now();
    let (st, e) = s
        .post(
            &exec,
            json!({ "instruction": { "code": "import time\ntime.sleep(1)\nx = 20\nx + 1", "timeout_seconds": 10 } }),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{e}");
    assert!(t0.elapsed() < Duration::from_millis(800), "exec did not return at once: {:?}", t0.elapsed());
    assert_eq!(
        (e["instruction_seq"].as_i64(), e["machine"].as_str(), e["interrupted"].as_bool()),
        (Some(0), Some(name.as_str()), Some(false))
    );
    // Queued behind it, in order.
    let (_, e2) = s.post(&exec, json!({ "instruction": { "code": "x * 2" } })).await;
    assert_eq!(e2["instruction_seq"], 1);
    let (_, l) = s.get("/v1/machine/list").await;
    assert_eq!(l["machines"][0]["has_pending_instructions"], true, "{l}");
    let r = fvm_result(&s, &name, 0, &key).await;
    assert!(t0.elapsed() >= Duration::from_secs(1));
    assert_eq!(r["value"], "21", "{r}");
    assert_eq!(r["data"], Value::Null);
    assert!(r["runtime_ms"].as_u64().unwrap() >= 1000, "{r}");
    assert_eq!(fvm_result(&s, &name, 1, &key).await["value"], "40");
    // A Python error: `error` is "<Type>: <message>\n<traceback>".
    let (_, e) = s.post(&exec, json!({ "instruction": { "code": "1 / 0" } })).await;
    let r = fvm_result(&s, &name, e["instruction_seq"].as_i64().unwrap(), &key).await;
    let err = r["error"].as_str().unwrap();
    assert!(err.starts_with("ZeroDivisionError: division by zero\n") && err.contains("Traceback"), "{r}");
    assert!(r.get("value").is_none(), "{r}");
    // State persists; it is the same session as in the sessions API.
    let (_, e) = s.post(&exec, json!({ "instruction": { "code": "x" } })).await;
    assert_eq!(fvm_result(&s, &name, e["instruction_seq"].as_i64().unwrap(), &key).await["value"], "20");
    assert_eq!(s.sexec(&name, "x + 100").await["value"], "120");

    // Errors.
    assert_error(
        &s.get(&format!("/v1/machine/{name}/exec/99/result")).await,
        StatusCode::NOT_FOUND,
        "instruction_not_found",
    );
    assert_error(
        &s.get(&format!("/v1/machine/{name}/exec/-1/result")).await,
        StatusCode::NOT_FOUND,
        "instruction_not_found",
    );
    assert_error(
        &s.post("/v1/machine/s_nope/exec", json!({ "instruction": { "code": "1" } })).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(&s.get("/v1/machine/s_nope/exec/0/result").await, StatusCode::NOT_FOUND, "session_not_found");
    assert_error(&s.post(&exec, json!({ "code": "1" })).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(&s.post_raw(&exec, b"{\"instruction\":".to_vec()).await, StatusCode::BAD_REQUEST, "malformed_json");
    assert_error(
        &s.post(&exec, json!({ "instruction": { "code": "1", "timeout_seconds": 0 } })).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    assert_error(&s.get(&format!("/v1/machine/{name}/repl")).await, StatusCode::UPGRADE_REQUIRED, "upgrade_required");
    // A timeout (the session's time limit applies) is an error result.
    let (_, m2) = s.post("/v1/sessions", json!({ "timeout_seconds": 1 })).await;
    let short = m2["id"].as_str().unwrap().to_string();
    let (_, e) =
        s.post(&format!("/v1/machine/{short}/exec"), json!({ "instruction": { "code": "while True: pass" } })).await;
    let r = fvm_result(&s, &short, e["instruction_seq"].as_i64().unwrap(), &key).await;
    assert!(r["error"].as_str().unwrap().starts_with("timeout: "), "{r}");

    // Tenant isolation: bob sees none of it.
    let bob = s.new_key("bob");
    assert_eq!(s.call(M::GET, "/v1/whoami", Some(&bob), None).await.1["account"], "bob");
    assert_eq!(s.call(M::GET, "/v1/machine/list", Some(&bob), None).await.1["machines"], json!([]));
    assert_error(
        &s.call(M::POST, &exec, Some(&bob), Some(json!({ "instruction": { "code": "x" } }))).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.call(M::GET, &format!("/v1/machine/{name}/exec/0/result"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(&s.call(M::GET, "/v1/whoami", None, None).await, StatusCode::UNAUTHORIZED, "unauthorized");
}

// ---------------------------------------------------------------------------
// Streaming, interrupt, files, outputs
// ---------------------------------------------------------------------------

/// One Server-Sent Event and when it arrived.
#[derive(Debug)]
struct Sse {
    event: String,
    data: Value,
    at: Instant,
}

/// POST and read the SSE response as it arrives; (status, events). A non-SSE reply gives its JSON as one "http" event.
async fn sse(s: &TestServer, path: &str, key: &str, body: Value) -> (StatusCode, Vec<Sse>) {
    let mut resp = s.http.post(format!("{}{path}", s.url)).bearer_auth(key).json(&body).send().await.expect("request");
    let status = resp.status();
    let is_sse =
        resp.headers().get("content-type").is_some_and(|c| c.to_str().unwrap().starts_with("text/event-stream"));
    if !is_sse {
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        return (status, vec![Sse { event: "http".into(), data: v, at: Instant::now() }]);
    }
    let (mut buf, mut events) = (String::new(), Vec::new());
    while let Some(chunk) = resp.chunk().await.expect("body chunk") {
        buf.push_str(std::str::from_utf8(&chunk).expect("SSE is UTF-8"));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let (mut event, mut data) = (String::from("message"), String::new());
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event:") {
                    event = e.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            if !data.is_empty() {
                events.push(Sse {
                    event,
                    data: serde_json::from_str(&data).expect("event data is JSON"),
                    at: Instant::now(),
                });
            }
        }
    }
    (status, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_exec_sends_output_as_it_is_written_then_the_result() {
    let s = TestServer::start().await;
    let key = s.key.clone();
    let code = "import sys, time\nfor i in range(3):\n    print('line', i)\n    time.sleep(0.3)\nprint('oops', file=sys.stderr)\n'done'";
    let t0 = Instant::now();
    let (st, ev) = sse(&s, "/v1/exec/stream", &key, json!({ "code": code, "timeout_seconds": 10 })).await;
    assert_eq!(st, StatusCode::OK);
    let names: Vec<&str> = ev.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(names.last(), Some(&"result"), "{ev:?}");
    assert_eq!(names.iter().filter(|n| **n == "result" || **n == "error").count(), 1, "{names:?}");
    let stdout: String = ev.iter().filter(|e| e.event == "stdout").map(|e| e.data["data"].as_str().unwrap()).collect();
    let stderr: String = ev.iter().filter(|e| e.event == "stderr").map(|e| e.data["data"].as_str().unwrap()).collect();
    assert_eq!(stdout, "line 0\nline 1\nline 2\n");
    assert_eq!(stderr, "oops\n");
    let result = &ev.last().unwrap().data;
    assert_eq!(result["value"], "'done'");
    assert_eq!(result["stdout"], stdout.as_str());
    assert!(result["id"].as_str().unwrap().starts_with("x_"), "{result}");
    // Really streamed: the first line arrived long before the result (the code sleeps 0.9 s after it).
    let first = ev.iter().find(|e| e.event == "stdout").unwrap();
    let last = ev.last().unwrap();
    assert!(
        last.at.duration_since(first.at) >= Duration::from_millis(500),
        "first line at {:?}, result at {:?}",
        first.at - t0,
        last.at - t0
    );
    assert!(ev.iter().filter(|e| e.event == "stdout").count() >= 3, "{names:?}");

    // A sandbox error is the final `error` event; request errors are plain HTTP errors.
    let (st, ev) =
        sse(&s, "/v1/exec/stream", &key, json!({ "code": "print('start')\nwhile True: pass", "timeout_seconds": 1 }))
            .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(ev.first().map(|e| e.event.as_str()), Some("stdout"));
    let last = ev.last().unwrap();
    assert_eq!((last.event.as_str(), last.data["error"]["code"].as_str()), ("error", Some("timeout")), "{ev:?}");
    let (st, ev) = sse(&s, "/v1/exec/stream", &key, json!({ "code": 5 })).await;
    assert_eq!((st, ev[0].data["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_request")));
    let (st, ev) = sse(&s, "/v1/exec/stream", "fbk_nope", json!({ "code": "1" })).await;
    assert_eq!((st, ev[0].data["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));

    // In a session: state, checkpoints, the same result JSON.
    let id = s.create_session(json!({ "timeout_seconds": 2 })).await;
    let path = format!("/v1/sessions/{id}/exec/stream");
    let (_, ev) = sse(&s, &path, &key, json!({ "code": "n = 41\nprint('set')" })).await;
    assert_eq!(ev.iter().map(|e| e.event.as_str()).collect::<Vec<_>>(), vec!["stdout", "result"]);
    assert_eq!(ev[1].data["checkpoint"], 1);
    let (_, ev) = sse(&s, &path, &key, json!({ "code": "n + 1" })).await;
    assert_eq!((ev[0].event.as_str(), ev[0].data["value"].as_str()), ("result", Some("42")));
    let (_, ev) = sse(&s, &path, &key, json!({ "code": "n = 0\nwhile True: pass" })).await;
    assert_eq!((ev[0].event.as_str(), ev[0].data["error"]["code"].as_str()), ("error", Some("timeout")), "{ev:?}");
    assert_eq!(ev[0].data["error"]["checkpoint"], 2);
    assert_eq!(s.sexec(&id, "n").await["value"], "41");
    let (st, ev) = sse(&s, "/v1/sessions/s_nope/exec/stream", &key, json!({ "code": "1" })).await;
    assert_eq!((st, ev[0].data["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("session_not_found")));
    let bob = s.new_key("bob");
    let (st, _) = sse(&s, &path, &bob, json!({ "code": "n" })).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_stops_a_running_loop_and_the_session_goes_on() {
    let s = TestServer::start().await;
    // (A time limit well past the interrupt, short enough that a missed interrupt fails fast.)
    let id = s.create_session(json!({ "timeout_seconds": 8 })).await;
    s.sexec(&id, "import time\nkept = 'state'\ncount = 0").await;
    // Nothing running: false.
    let (st, v) = s.post(&format!("/v1/sessions/{id}/interrupt"), json!({})).await;
    assert_eq!((st, v.clone()), (StatusCode::OK, json!({ "interrupted": false })), "{v}");
    let (url, key, http, sid) = (s.url.clone(), s.key.clone(), s.http.clone(), id.clone());
    let t0 = Instant::now();
    let running = tokio::spawn(async move {
        let r = http
            .post(format!("{url}/v1/sessions/{sid}/exec"))
            .bearer_auth(key)
            .json(&json!({ "code": "while True:\n    count += 1" }))
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (st, v) = s.post(&format!("/v1/sessions/{id}/interrupt"), json!({})).await;
    assert_eq!((st, v.clone()), (StatusCode::OK, json!({ "interrupted": true })), "{v}");
    let (st, r) = running.await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(st, StatusCode::OK, "{r}");
    assert_eq!(r["error"]["type"], "KeyboardInterrupt", "{r}");
    assert_eq!(r["checkpoint"], 2, "{r}");
    // The session kept its state, the loop's progress included.
    let v = s.sexec(&id, "(kept, count > 0)").await;
    assert_eq!(v["value"], "('state', True)");
    assert_error(&s.post("/v1/sessions/s_nope/interrupt", json!({})).await, StatusCode::NOT_FOUND, "session_not_found");
    let bob = s.new_key("bob");
    assert_error(
        &s.call(reqwest::Method::POST, &format!("/v1/sessions/{id}/interrupt"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_upload_download_list_and_outputs() {
    use reqwest::Method as M;
    let s = TestServer::start_with(|c| c.files_limit = 4 << 20).await;
    let id = s.create_session(json!({})).await;
    let files = format!("{}/v1/sessions/{id}/files", s.url);
    // Upload (binary, nested directories created), then Python reads it with open().
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let r =
        s.http.put(format!("{files}/data/in/blob.bin")).bearer_auth(&s.key).body(data.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["path"].as_str(), v["size"].as_u64(), v["checkpoint"].as_i64()),
        (Some("/data/in/blob.bin"), Some(300_000), Some(1)),
        "{v}"
    );
    let v = s
        .sexec(
            &id,
            "import hashlib\nb = open('/data/in/blob.bin', 'rb').read()\n(len(b), hashlib.sha256(b).hexdigest())",
        )
        .await;
    let want = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&data))
    };
    assert_eq!(v["value"], format!("(300000, '{want}')"));
    assert_eq!(v["checkpoint"], 2);
    // The upload is checkpointed: it is in the log and survives a revert to it.
    let (_, cps) = s.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    assert_eq!(cps["checkpoints"][0]["code"], "# upload /data/in/blob.bin");

    // Python writes files; download them; /output files come back in the result.
    let v = s.sexec(&id, "import os\nopen('/output/table.csv', 'w').write('a,b\\n1,2\\n')\nopen('/tmp/notes.txt', 'w').write('héllo')\nos.makedirs('/output/sub', exist_ok=True)").await;
    let outputs = v["outputs"].as_array().unwrap_or_else(|| panic!("no outputs: {v}"));
    assert_eq!(outputs.len(), 1, "{v}");
    assert_eq!(outputs[0]["path"], "/output/table.csv");
    assert_eq!(outputs[0]["mime"], "text/csv");
    assert_eq!(outputs[0]["size"], 8);
    use base64::Engine as _;
    assert_eq!(
        base64::engine::general_purpose::STANDARD.decode(outputs[0]["base64"].as_str().unwrap()).unwrap(),
        b"a,b\n1,2\n"
    );
    assert!(s.sexec(&id, "1").await.get("outputs").is_none(), "an exec that writes no output file has no outputs");
    let r = s.http.get(format!("{files}/tmp/notes.txt")).bearer_auth(&s.key).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "application/octet-stream");
    assert_eq!(r.bytes().await.unwrap().as_ref(), "héllo".as_bytes());
    let r = s.http.get(format!("{files}/data/in/blob.bin")).bearer_auth(&s.key).send().await.unwrap();
    assert_eq!(r.bytes().await.unwrap().as_ref(), &data[..]);
    // Listing.
    let (st, l) = s.get(&format!("/v1/sessions/{id}/files?dir=/output")).await;
    assert_eq!(st, StatusCode::OK, "{l}");
    let mut names: Vec<(String, bool)> = l["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["name"].as_str().unwrap().to_string(), f["is_dir"].as_bool().unwrap()))
        .collect();
    names.sort();
    assert_eq!(names, vec![("sub".to_string(), true), ("table.csv".to_string(), false)], "{l}");
    let table = l["files"].as_array().unwrap().iter().find(|f| f["name"] == "table.csv").unwrap();
    assert_eq!((table["path"].as_str(), table["size"].as_u64()), (Some("/output/table.csv"), Some(8)));
    assert!(table["mtime_ms"].as_i64().unwrap() > 0);

    // Errors.
    assert_error(&s.get(&format!("/v1/sessions/{id}/files/nope.txt")).await, StatusCode::NOT_FOUND, "file_not_found");
    assert_error(&s.get(&format!("/v1/sessions/{id}/files/output")).await, StatusCode::BAD_REQUEST, "is_a_directory");
    assert_error(&s.get(&format!("/v1/sessions/{id}/files?dir=/nope")).await, StatusCode::NOT_FOUND, "file_not_found");
    assert_error(&s.get(&format!("/v1/sessions/{id}/files?what=1")).await, StatusCode::BAD_REQUEST, "invalid_request");
    assert_error(&s.get(&format!("/v1/sessions/{id}/files/a%00b")).await, StatusCode::BAD_REQUEST, "invalid_path");
    assert_error(&s.get("/v1/sessions/s_nope/files/x").await, StatusCode::NOT_FOUND, "session_not_found");
    let big = vec![7u8; 5 << 20];
    let r = s.http.put(format!("{files}/big.bin")).bearer_auth(&s.key).body(big).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // The rest of the body is read and thrown away (so the client sees the
    // 413, not a broken pipe), and the connection is not reused.
    assert_eq!(r.headers().get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]));
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "file_too_large");
    s.sexec(&id, "open('/tmp/big.bin', 'wb').write(b'x' * (5 << 20))").await;
    assert_error(
        &s.get(&format!("/v1/sessions/{id}/files/tmp/big.bin")).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "file_too_large",
    );
    // Other tenants: 404 on every file route.
    let bob = s.new_key("bob");
    assert_error(
        &s.call(M::GET, &format!("/v1/sessions/{id}/files/tmp/notes.txt"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    assert_error(
        &s.call(M::GET, &format!("/v1/sessions/{id}/files?dir=/"), Some(&bob), None).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    let r = s.http.put(format!("{files}/x.txt")).bearer_auth(&bob).body("x").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forevervm_interrupt_flag_stops_the_running_instruction() {
    let s = TestServer::start().await;
    // A machine is a session: one with a short time limit, so a missed interrupt fails fast.
    let name = s.create_session(json!({ "timeout_seconds": 8 })).await;
    let exec = format!("/v1/machine/{name}/exec");
    let (_, a) = s.post(&exec, json!({ "instruction": { "code": "v = 1\nwhile True:\n    pass" } })).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (st, b) = s.post(&exec, json!({ "instruction": { "code": "v + 1" }, "interrupt": true })).await;
    assert_eq!(st, StatusCode::OK, "{b}");
    assert_eq!(b["interrupted"], true, "{b}");
    let r = fvm_result(&s, &name, a["instruction_seq"].as_i64().unwrap(), &s.key).await;
    assert!(r["error"].as_str().unwrap().starts_with("KeyboardInterrupt"), "{r}");
    assert_eq!(fvm_result(&s, &name, b["instruction_seq"].as_i64().unwrap(), &s.key).await["value"], "2");
    let (_, c) = s.post(&exec, json!({ "instruction": { "code": "3" }, "interrupt": true })).await;
    assert_eq!(c["interrupted"], false, "{c}");
}

// ---------------------------------------------------------------------------
// Hard resource bounds: fair slots, batches, disk, errors, streams
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_spinning_guests_of_one_key_do_not_make_another_key_wait() {
    // 4 slots; new keys get half of them. Key A starts four `while True: pass`.
    let s = TestServer::start_with(|c| {
        c.runtime.concurrency = 4;
        c.queue_wait = Duration::from_secs(3);
    })
    .await;
    let a = s.default_key("spinner");
    let b = s.default_key("bystander");
    let mut spinners = Vec::new();
    for _ in 0..4 {
        let (url, key, http) = (s.url.clone(), a.clone(), s.http.clone());
        spinners.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/exec"))
                .bearer_auth(key)
                .json(&json!({ "code": "while True: pass", "timeout_seconds": 6 }))
                .send()
                .await
                .unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap())
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    // While A spins, B's execs go through at once (never 503, never behind A's queue).
    for i in 0..3 {
        let t = Instant::now();
        let (st, v) =
            s.call(reqwest::Method::POST, "/v1/exec", Some(&b), Some(json!({ "code": format!("{i} + 1") }))).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["value"], json!((i + 1).to_string()));
        assert!(t.elapsed() < Duration::from_secs(3), "B waited {:?} behind A", t.elapsed());
    }
    let (mut timeouts, mut limited) = (0, 0);
    for t in spinners {
        let (st, v) = t.await.unwrap();
        match st {
            StatusCode::REQUEST_TIMEOUT => timeouts += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(v["error"]["code"], "rate_limited", "{v}");
                limited += 1;
            }
            other => panic!("A got {other}: {v}"),
        }
    }
    // Two ran (A's share) and timed out; the other two waited in A's own queue and were refused.
    assert_eq!((timeouts, limited), (2, 2));
    let (st, v) = s.call(reqwest::Method::POST, "/v1/exec", Some(&b), Some(json!({ "code": "7" }))).await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("7")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_counts_each_exec_against_the_rate_and_a_cpu_budget_is_enforced() {
    use reqwest::Method as M;
    let s = TestServer::start().await;
    let key = limited_key(&s, "batcher", forkbox_server::KeyLimits { rate_limit: Some(5), ..Default::default() });
    // 8 execs in one request are 8 against a 5/s key.
    let codes: Vec<String> = (0..8).map(|i| i.to_string()).collect();
    assert_error(
        &s.call(M::POST, "/v1/exec/batch", Some(&key), Some(json!({ "codes": codes }))).await,
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (st, v) = s.call(M::POST, "/v1/exec/batch", Some(&key), Some(json!({ "codes": ["1", "2", "3"] }))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["results"].as_array().unwrap().len(), 3);
    // Right after, the bucket has 2 left (plus what 0.6 s would refill): a batch of 5 more is refused.
    assert_error(
        &s.call(M::POST, "/v1/exec/batch", Some(&key), Some(json!({ "codes": ["1", "2", "3", "4", "5"] }))).await,
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
    );
    // CPU seconds: a key with 1 CPU-second per hour spins once, then gets 429 with Retry-After.
    // It spins for 1.5 s of its own CPU time (the vCPU thread's), not of the wall
    // clock: on a loaded host 2 s of wall time can be under 1 s of CPU.
    let cpu = limited_key(&s, "cpu", forkbox_server::KeyLimits { cpu_seconds_per_hour: Some(1), ..Default::default() });
    let (st, v) = s
        .call(
            M::POST,
            "/v1/exec",
            Some(&cpu),
            Some(json!({ "code": "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass" })),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // The exec thread charges the job when it ends, just after the reply (the
    // sandbox's teardown comes first): within a moment the key is refused.
    let mut r =
        s.http.post(format!("{}/v1/exec", s.url)).bearer_auth(&cpu).json(&json!({ "code": "1" })).send().await.unwrap();
    for _ in 0..20 {
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        r = s
            .http
            .post(format!("{}/v1/exec", s.url))
            .bearer_auth(&cpu)
            .json(&json!({ "code": "1" }))
            .send()
            .await
            .unwrap();
    }
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().get("retry-after").is_some());
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "cpu_budget_exceeded", "{v}");
    // Other keys go on; a key's timeout is capped by its own maximum.
    let (st, v) = s.post("/v1/exec", json!({ "code": "1" })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let short =
        limited_key(&s, "short", forkbox_server::KeyLimits { max_timeout_seconds: Some(5), ..Default::default() });
    assert_error(
        &s.call(M::POST, "/v1/exec", Some(&short), Some(json!({ "code": "1", "timeout_seconds": 10 }))).await,
        StatusCode::BAD_REQUEST,
        "invalid_request",
    );
    let (st, _) = s.call(M::POST, "/v1/exec", Some(&short), Some(json!({ "code": "1", "timeout_seconds": 5 }))).await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_results_and_streams_are_bounded_by_the_output_limit() {
    let s = TestServer::start().await;
    let limit = forkbox_engine::Limits::default().output_bytes;
    // 64 execs that each print 4 MiB: the whole response stays within 4x the output limit (+ JSON).
    let codes: Vec<String> = (0..64).map(|_| "import sys\nsys.stdout.write('y' * (4 << 20))".to_string()).collect();
    let r = s
        .http
        .post(format!("{}/v1/exec/batch", s.url))
        .bearer_auth(&s.key)
        .json(&json!({ "codes": codes }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body = r.bytes().await.unwrap();
    assert!(body.len() < 4 * limit + 64 * 1024, "batch response of {} bytes", body.len());
    // The attack on a stream: write(1, buf, 64 MiB) of NULs (each `\u0000` in JSON).
    let code = "import ctypes\nlibc = ctypes.CDLL(None)\nbuf = ctypes.create_string_buffer(64 << 20)\nlibc.syscall(1, 1, ctypes.addressof(buf), 64 << 20)";
    let r = s
        .http
        .post(format!("{}/v1/exec/stream", s.url))
        .bearer_auth(&s.key)
        .json(&json!({ "code": code }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body = r.bytes().await.unwrap();
    // The output limit of raw bytes, twice (events + the result), at most 6x in JSON escapes.
    assert!(body.len() < 2 * 6 * limit + 64 * 1024, "stream response of {} bytes", body.len());
    assert!(String::from_utf8_lossy(&body).contains("output truncated"));
    // Another tenant's exec still runs.
    let other = s.new_key("other");
    let (st, v) = s.call(reqwest::Method::POST, "/v1/exec", Some(&other), Some(json!({ "code": "1 + 1" }))).await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("2")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_507_for_the_writer_and_deletes_still_work() {
    let s = TestServer::start_with(|c| c.runtime.sessions.disk_reserve = u64::MAX / 4).await;
    let id = s.create_session(json!({})).await;
    let got = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": "x = 1" })).await;
    assert_error(&got, StatusCode::INSUFFICIENT_STORAGE, "insufficient_storage");
    let layers = s.home().join("sessions/layers");
    assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 0, "files left by a refused checkpoint");
    // Reads and deletes work; another request that writes nothing works.
    assert_eq!(s.get(&format!("/v1/sessions/{id}")).await.0, StatusCode::OK);
    let (st, v) = s.post("/v1/exec", json!({ "code": "6 * 7" })).await;
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("42")));
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")).await.0, StatusCode::NO_CONTENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_error_body_carries_a_host_path() {
    let s = TestServer::start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "x = 1").await;
    s.sexec(&id, "y = 2").await;
    // Damage the checkpoint files on disk, then make the session come back from them.
    let layers = s.home().join("sessions/layers");
    for e in std::fs::read_dir(&layers).unwrap().flatten() {
        std::fs::write(e.path(), b"garbage").unwrap();
    }
    let (st, _) = s.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": 1 })).await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": "x" })).await;
    assert!(st.is_server_error(), "{st} {v}");
    let text = v.to_string();
    let home = s.home().display().to_string();
    assert!(!text.contains(&home), "host path in {text}");
    assert!(!text.contains("/tmp/") && !text.contains(&shared().home.display().to_string()), "host path in {text}");
    // Guest paths in file errors are not host paths and stay.
    let (st, v) = s.get(&format!("/v1/sessions/{}/files/nope.txt", s.create_session(json!({})).await)).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_setting_narrows_the_server_policy() {
    // A loopback HTTP responder the server allows explicitly (nothing leaves this machine).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut b = [0u8; 1024];
            let _ = std::io::Read::read(&mut c, &mut b);
            let _ = std::io::Write::write_all(&mut c, b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok");
        }
    });
    let s = TestServer::start_with(|cfg| {
        cfg.runtime.limits.network.layers[0].allow.push(format!("127.0.0.1:{port}").parse().unwrap());
    })
    .await;
    let api_port: u16 = s.url.rsplit(':').next().unwrap().parse().unwrap();
    let get =
        |p: u16| format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{p}/', timeout=5).read()");
    // The server's own API port (loopback) is refused by the default policy.
    let (st, v) = s.post("/v1/exec", json!({ "code": get(api_port) })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("refused by the egress policy: loopback address"), "{v}");
    // The explicitly allowed one works; a request can narrow it away but not widen.
    let (_, v) = s.post("/v1/exec", json!({ "code": get(port) })).await;
    assert_eq!(v["value"], "b'ok'", "{v}");
    let (_, v) = s.post("/v1/exec", json!({ "code": get(port), "network": "none" })).await;
    assert_eq!(v["exit_code"], 1, "{v}");
    let (_, v) = s
        .post("/v1/exec", json!({ "code": get(api_port), "network": { "allow": [format!("127.0.0.1:{api_port}")] } }))
        .await;
    assert_eq!(v["exit_code"], 1, "a request widened the server's policy: {v}");
    // Sessions keep their setting and show the effective policy.
    let (st, v) = s
        .post("/v1/sessions", json!({ "network": { "allow": [format!("127.0.0.1:{port}")], "deny": ["*:25"] } }))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["limits"]["network"]["mode"], "allowlist", "{v}");
    assert_eq!(v["limits"]["network"]["layers"].as_array().map(|a| a.len()), Some(2), "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(s.sexec(&id, &get(port)).await["value"], "b'ok'");
    let (_, v) = s.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(v["limits"]["network"]["layers"][1]["deny"][0], "*:25", "{v}");
    let (st, v) = s.post("/v1/sessions", json!({ "network": "none" })).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["limits"]["network"]["mode"], "none", "{v}");
    // Refusals are counted in /metrics.
    let m = s.http.get(format!("{}/metrics", s.url)).bearer_auth(&s.key).send().await.unwrap().text().await.unwrap();
    let denied = m
        .lines()
        .find(|l| l.starts_with("forkbox_net_connects_total{decision=\"denied\"}"))
        .unwrap_or_else(|| panic!("no denial counter in\n{m}"));
    assert!(denied.rsplit(' ').next().unwrap().parse::<f64>().unwrap() >= 3.0, "{denied}");
    // Bad settings are 400s.
    for bad in [json!("everything"), json!({ "allow": ["not a rule"] }), json!({ "allow": ["10.0.0.0/40"] })] {
        let got = s.post("/v1/sessions", json!({ "network": bad })).await;
        assert!(
            got.0 == StatusCode::BAD_REQUEST || got.0 == StatusCode::UNPROCESSABLE_ENTITY,
            "{bad}: {} {}",
            got.0,
            got.1
        );
    }
}

/// A key's egress policy (`forkbox key create --egress`) is a layer every
/// sandbox of the key gets: requests can only narrow it, never widen it, and
/// the session shows it; loopback inside the sandbox needs no egress at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_egress_policy_is_a_layer_requests_cannot_widen() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut b = [0u8; 1024];
            let _ = std::io::Read::read(&mut c, &mut b);
            let _ = std::io::Write::write_all(&mut c, b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok");
        }
    });
    let s = TestServer::start_with(|cfg| {
        cfg.runtime.limits.network.layers[0].allow.push(format!("127.0.0.1:{port}").parse().unwrap());
    })
    .await;
    let allow = format!("127.0.0.1:{port}");
    let key_with = |tenant: &str, egress: forkbox_runtime::NetPolicy| {
        limited_key(
            &s,
            tenant,
            forkbox_server::KeyLimits { egress: Some(egress), ..forkbox_server::KeyLimits::unlimited() },
        )
    };
    let none = key_with("offline", forkbox_runtime::NetPolicy::none());
    let public = key_with("public", forkbox_runtime::NetPolicy::public());
    let listed = key_with("listed", forkbox_runtime::NetPolicy::allowlist(vec![allow.parse().unwrap()]));
    let post = |key: &str, path: &str, body: Value| {
        let req = s.http.post(format!("{}{path}", s.url)).bearer_auth(key).json(&body);
        async move {
            let r = req.send().await.unwrap();
            let st = r.status();
            (st, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let get = format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5).read()");
    // The server's key (no egress of its own) reaches the allowed loopback server.
    let (_, v) = s.post("/v1/exec", json!({ "code": get })).await;
    assert_eq!(v["value"], "b'ok'", "{v}");
    // A key with egress none cannot, even asking for the very rule the server has.
    for body in [
        json!({ "code": get }),
        json!({ "code": get, "network": { "allow": [allow] } }),
        json!({ "code": get, "network": "public" }),
    ] {
        let (st, v) = post(&none, "/v1/exec", body.clone()).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["exit_code"], 1, "a request widened its key's policy ({body}): {v}");
        assert!(
            v["stderr"].as_str().unwrap_or_default().contains("refused by the egress policy: network: none"),
            "{v}"
        );
    }
    // Nor in a batch.
    let (st, v) = post(&none, "/v1/exec/batch", json!({ "codes": [get] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["results"][0]["error"]["type"].as_str().is_some(), "a batch widened its key's policy: {v}");
    // A public key: loopback stays refused (the server's allow rule is not the key's).
    let (_, v) = post(&public, "/v1/exec", json!({ "code": get })).await;
    assert_eq!(v["exit_code"], 1, "{v}");
    // A key that lists the rule gets it; its requests can still narrow it away.
    let (_, v) = post(&listed, "/v1/exec", json!({ "code": get })).await;
    assert_eq!(v["value"], "b'ok'", "{v}");
    let (_, v) = post(&listed, "/v1/exec", json!({ "code": get, "network": "none" })).await;
    assert_eq!(v["exit_code"], 1, "{v}");
    // Sessions of the key: the key's layer is in the effective policy, and a request cannot widen it.
    let (st, v) = post(&none, "/v1/sessions", json!({ "network": "public" })).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["limits"]["network"]["mode"], "none", "{v}");
    assert_eq!(v["limits"]["network"]["layers"].as_array().map(|a| a.len()), Some(3), "server, key, request: {v}");
    assert_eq!(v["limits"]["network"]["layers"][1]["mode"], "none", "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let shown = s
        .http
        .get(format!("{}/v1/sessions/{id}", s.url))
        .bearer_auth(&none)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(shown["limits"]["network"]["mode"], "none", "{shown}");
    let (_, v) = post(&none, &format!("/v1/sessions/{id}/exec"), json!({ "code": get })).await;
    assert!(v["error"]["type"].as_str().is_some() || v["exit_code"] == 1, "{v}");
    // Loopback inside the sandbox is not egress: a server of the exec itself works under `none`.
    let inside = "import socket\nL = socket.socket(); L.bind(('127.0.0.1', 0)); L.listen()\n\
                  c = socket.create_connection(L.getsockname()); s, _ = L.accept()\nc.sendall(b'in'); s.recv(2)";
    let (_, v) = post(&none, &format!("/v1/sessions/{id}/exec"), json!({ "code": inside })).await;
    assert_eq!(v["value"], "b'in'", "{v}");
}

// ---------------------------------------------------------------------------
// Strict bodies, session exec timeouts, PATCH, Retry-After, limits in messages,
// output that comes back with an exec's error
// ---------------------------------------------------------------------------

fn message(got: &(StatusCode, Value)) -> String {
    got.1["error"]["message"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_are_strict_and_errors_name_the_field() {
    let s = TestServer::start_with(|c| c.files_limit = 1024).await;
    let id = s.create_session(json!({})).await;
    let sess = format!("/v1/sessions/{id}");
    // An unknown field is refused on every forkbox route, naming it.
    let unknown: [(reqwest::Method, String, Value, &str); 9] = [
        (reqwest::Method::POST, "/v1/exec".into(), json!({ "code": "1", "timeout": 5 }), "timeout"),
        (reqwest::Method::POST, "/v1/exec/stream".into(), json!({ "code": "1", "templat": "python" }), "templat"),
        (reqwest::Method::POST, "/v1/exec/batch".into(), json!({ "codes": ["1"], "parallel": 2 }), "parallel"),
        (reqwest::Method::POST, "/v1/sessions".into(), json!({ "memroy_mb": 256 }), "memroy_mb"),
        (reqwest::Method::POST, format!("{sess}/exec"), json!({ "code": "1", "timeout": 1 }), "timeout"),
        (reqwest::Method::POST, format!("{sess}/exec/stream"), json!({ "code": "1", "timeout": 1 }), "timeout"),
        (reqwest::Method::POST, format!("{sess}/revert"), json!({ "checkpoint": 1, "force": true }), "force"),
        (reqwest::Method::POST, format!("{sess}/fork"), json!({ "tag": {} }), "tag"),
        (reqwest::Method::PATCH, sess.clone(), json!({ "limits": { "memory_mb": 128 } }), "limits"),
    ];
    for (m, path, body, field) in unknown {
        let got = s.call(m.clone(), &path, Some(&s.key), Some(body)).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        let msg = message(&got);
        assert!(
            msg.starts_with(&format!("invalid request body: unknown field `{field}`, expected")),
            "{m} {path}: {msg}"
        );
    }
    // ... also inside a nested object (the network setting's rules).
    let got = s.post("/v1/exec", json!({ "code": "1", "network": { "allow": ["1.2.3.4"], "denny": [] } })).await;
    assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
    assert!(message(&got).contains("network"), "{}", got.1);
    // A value of the wrong type names its path.
    let got = s.post("/v1/exec", json!({ "code": "1", "timeout_seconds": "x" })).await;
    assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
    assert!(message(&got).contains(r#"timeout_seconds: invalid type: string "x", expected f64"#), "{}", got.1);
    let got = s.post("/v1/sessions", json!({ "tags": { "team": 1 } })).await;
    assert!(message(&got).contains("tags.team: invalid type: integer `1`, expected a string"), "{}", got.1);
    let got = s.post("/v1/exec/batch", json!({ "codes": ["1", 2] })).await;
    assert!(message(&got).contains("codes[1]: invalid type: integer `2`"), "{}", got.1);
    // Nothing ran: the session is still at its start.
    assert_eq!(s.get(&sess).await.1["checkpoint"], Value::Null);
    // ForeverVM's routes take what its SDKs send, extra fields included (the JS SDK sends these).
    let (st, v) = s.post("/v1/machine/new", json!({ "tags": {}, "expires_at": null })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let name = v["machine_name"].as_str().unwrap().to_string();
    let body =
        json!({ "instruction": { "code": "1 + 1", "max_duration_seconds": 5 }, "code": "1 + 1", "interrupt": false });
    let (st, v) = s.post(&format!("/v1/machine/{name}/exec"), body).await;
    assert_eq!(st, StatusCode::OK, "{v}");

    // 413s state the limit.
    let big = format!("{{\"code\": \"{}\"}}", "#".repeat(3 << 20));
    let got = s.post_raw("/v1/exec", big.into_bytes()).await;
    assert_error(&got, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    assert!(message(&got).contains(&(2u64 << 20).to_string()), "{}", got.1);
    let code = format!("#{}", "a".repeat(3 << 19));
    let got = s.post("/v1/exec", json!({ "code": code })).await;
    assert_error(&got, StatusCode::PAYLOAD_TOO_LARGE, "code_too_large");
    assert!(message(&got).contains(&(1u64 << 20).to_string()), "{}", got.1);
    let resp = s
        .http
        .put(format!("{}{sess}/files/tmp/big.bin", s.url))
        .bearer_auth(&s.key)
        .body(vec![7u8; 4096])
        .send()
        .await
        .unwrap();
    let got = (resp.status(), resp.json::<Value>().await.unwrap());
    assert_error(&got, StatusCode::PAYLOAD_TOO_LARGE, "file_too_large");
    assert!(message(&got).contains("1024 bytes"), "{}", got.1);

    // `GET /`: a pointer to the OpenAPI document, without auth.
    let (st, v) = s.call(reqwest::Method::GET, "/", None, None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["openapi"], "/v1/openapi.json");
    assert_eq!(v["name"], "forkbox");
    assert_eq!(v["console"], "/");
    // A browser (Accept prefers text/html) gets the web console instead, under a strict CSP; its assets too.
    let page = s
        .http
        .get(format!("{}/", s.url))
        .header("accept", "text/html,application/xhtml+xml,*/*;q=0.8")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let csp = page.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"), "{csp}");
    assert!(page.text().await.unwrap().contains("/console/console.js"));
    for (file, kind) in [("console.js", "text/javascript"), ("console.css", "text/css")] {
        let r = s.http.get(format!("{}/console/{file}", s.url)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{file}");
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with(kind), "{file}");
        assert_eq!(r.headers()["content-security-policy"].to_str().unwrap(), csp);
    }
    let (st, _) = s.call(reqwest::Method::GET, "/console/../keys.db", None, None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, nf) = s.call(reqwest::Method::GET, "/console/other.js", None, None).await;
    assert_eq!((st, nf["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let (st, doc) = s.call(reqwest::Method::GET, v["openapi"].as_str().unwrap(), None, None).await;
    assert_eq!(st, StatusCode::OK);
    for (m, p) in [("get", "/"), ("patch", "/v1/sessions/{id}")] {
        assert!(doc["paths"][p][m].is_object(), "{m} {p} missing from the OpenAPI document");
    }
    let exec_props = &doc["components"]["schemas"]["SessionExec"]["properties"];
    assert!(exec_props["timeout_seconds"].is_object(), "{exec_props}");
    let detail = &doc["components"]["schemas"]["ErrorDetail"]["properties"];
    assert!(detail["stdout"].is_object() && detail["stderr"].is_object(), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_exec_timeout_is_bounded_by_the_session_and_patch_changes_limits() {
    let s = TestServer::start().await;
    let id = s.create_session(json!({ "timeout_seconds": 20, "tags": { "team": "a" } })).await;
    let sess = format!("/v1/sessions/{id}");
    s.sexec(&id, "kept = 7").await;
    // The exec's own limit applies (the session's is 20 s).
    let t0 = Instant::now();
    let got = s.post(&format!("{sess}/exec"), json!({ "code": "while True: pass", "timeout_seconds": 1 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    assert!(message(&got).contains("1.0 s"), "{}", got.1);
    assert_eq!(got.1["error"]["checkpoint"], 1, "{}", got.1);
    // The streamed exec too (its error event).
    let t0 = Instant::now();
    let (st, ev) =
        sse(&s, &format!("{sess}/exec/stream"), &s.key, json!({ "code": "while True: pass", "timeout_seconds": 1 }))
            .await;
    assert_eq!(st, StatusCode::OK);
    let last = ev.last().expect("events");
    assert_eq!((last.event.as_str(), &last.data["error"]["code"]), ("error", &json!("timeout")), "{ev:?}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // Over the session's limit, or not positive: 400 before anything runs.
    for t in [json!(21), json!(0), json!(-1)] {
        let got = s.post(&format!("{sess}/exec"), json!({ "code": "kept = 0", "timeout_seconds": t })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(message(&got).contains("20"), "{}", got.1);
    }
    let (st, ev) =
        sse(&s, &format!("{sess}/exec/stream"), &s.key, json!({ "code": "kept = 0", "timeout_seconds": 21 })).await;
    assert_eq!(
        (st, ev[0].data["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_request")),
        "{ev:?}"
    );
    assert_eq!(s.sexec(&id, "kept").await["value"], "7");

    // PATCH: tags and limits, validated like a create.
    let (st, v) = s
        .call(
            reqwest::Method::PATCH,
            &sess,
            Some(&s.key),
            Some(json!({ "tags": { "team": "b" }, "timeout_seconds": 2, "memory_mb": 256 })),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["tags"], json!({ "team": "b" }));
    assert_eq!(v["limits"]["timeout_seconds"], 2.0);
    assert_eq!(v["limits"]["memory_mb"], 256);
    // The memory change takes the sandbox out of memory (the next exec resumes under it); the state stays.
    assert_eq!(v["resident"], false, "{v}");
    let g = s.get(&sess).await.1;
    assert_eq!((g["tags"].clone(), g["limits"]["memory_mb"].clone()), (json!({ "team": "b" }), json!(256)), "{g}");
    let listed = s.get("/v1/sessions?tag=team:b").await.1;
    assert_eq!(listed["sessions"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(s.get("/v1/sessions?tag=team:a").await.1["sessions"], json!([]));
    // Only what is given changes.
    let (st, v) = s.call(reqwest::Method::PATCH, &sess, Some(&s.key), Some(json!({}))).await;
    assert_eq!(
        (st, v["limits"]["timeout_seconds"].clone(), v["tags"].clone()),
        (StatusCode::OK, json!(2.0), json!({ "team": "b" }))
    );
    // The new time limit is the session's maximum now, and applies to its execs.
    let got = s.post(&format!("{sess}/exec"), json!({ "code": "1", "timeout_seconds": 3 })).await;
    assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
    let t0 = Instant::now();
    assert_error(
        &s.post(&format!("{sess}/exec"), json!({ "code": "while True: pass" })).await,
        StatusCode::REQUEST_TIMEOUT,
        "timeout",
    );
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    assert_eq!(s.sexec(&id, "kept").await["value"], "7");
    // The memory limit applies: 300 MiB does not fit in 256.
    // (a MemoryError, or a failed exec that rolls the session back: never 'fit').
    let (st, r) = s.post(&format!("{sess}/exec"), json!({ "code": "b = bytearray(300 << 20)\n'fit'" })).await;
    assert!(!(st == StatusCode::OK && r["value"] == "'fit'"), "{st} {r}");
    assert!(st != StatusCode::OK || r["error"]["type"] == "MemoryError", "{st} {r}");
    assert_eq!(s.sexec(&id, "kept").await["value"], "7");
    // Bad values are refused like a create's; an unknown session is 404.
    for bad in [
        json!({ "memory_mb": 1 }),
        json!({ "timeout_seconds": -1 }),
        json!({ "timeout_seconds": 1e9 }),
        json!({ "tags": { "a:b": "c" } }),
    ] {
        let got = s.call(reqwest::Method::PATCH, &sess, Some(&s.key), Some(bad.clone())).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
    }
    let got = s.call(reqwest::Method::PATCH, "/v1/sessions/s_nope", Some(&s.key), Some(json!({ "tags": {} }))).await;
    assert_error(&got, StatusCode::NOT_FOUND, "session_not_found");
    // Another tenant's session is invisible.
    let bob = s.new_key("bob");
    let got = s.call(reqwest::Method::PATCH, &sess, Some(&bob), Some(json!({ "tags": {} }))).await;
    assert_error(&got, StatusCode::NOT_FOUND, "session_not_found");

    // 409 session_busy carries Retry-After; a memory change while an exec runs is busy too.
    let (url, key, http) = (s.url.clone(), s.key.clone(), s.http.clone());
    let p = format!("{sess}/exec");
    let long = tokio::spawn(async move {
        let r = http
            .post(format!("{url}{p}"))
            .bearer_auth(key)
            .json(&json!({ "code": "import time\ntime.sleep(1.5)\n5" }))
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let resp = s
        .http
        .post(format!("{}{sess}/exec", s.url))
        .bearer_auth(&s.key)
        .json(&json!({ "code": "1" }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    let retry = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    assert!(retry.is_some_and(|r| r >= 1), "Retry-After: {:?}", resp.headers());
    assert_eq!(resp.json::<Value>().await.unwrap()["error"]["code"], "session_busy");
    let got = s.call(reqwest::Method::PATCH, &sess, Some(&s.key), Some(json!({ "memory_mb": 512 }))).await;
    assert_error(&got, StatusCode::CONFLICT, "session_busy");
    let (st, v) = long.await.unwrap();
    assert_eq!((st, v["value"].clone()), (StatusCode::OK, json!("5")), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patched_tags_and_limits_survive_a_restart() {
    let home = fresh_home();
    let mut cfg = forkbox_server_testkit::config(home.path());
    cfg.runtime.image = Some(shared().image_path.clone());
    let server = Server::bind(cfg.clone()).await.expect("bind");
    let key = server.created_key.clone().expect("a key");
    let url = format!("http://{}", server.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let http = reqwest::Client::new();
    let sess: Value = http
        .post(format!("{url}/v1/sessions"))
        .bearer_auth(&key)
        .json(&json!({ "tags": { "k": "v" } }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sid = sess["id"].as_str().unwrap().to_string();
    let r: Value = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q = 9" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["checkpoint"], 1, "{r}");
    let patch = json!({ "tags": { "k": "w", "n": "2" }, "memory_mb": 384, "timeout_seconds": 7.5 });
    let resp = http.patch(format!("{url}/v1/sessions/{sid}")).bearer_auth(&key).json(&patch).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("shutdown in time").unwrap().expect("run");

    let server = Server::bind(cfg).await.expect("rebind");
    let url = format!("http://{}", server.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let g: Value =
        http.get(format!("{url}/v1/sessions/{sid}")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    assert_eq!(g["tags"], json!({ "k": "w", "n": "2" }), "{g}");
    assert_eq!(g["limits"]["memory_mb"], 384, "{g}");
    assert_eq!(g["limits"]["timeout_seconds"], 7.5, "{g}");
    // The persisted time limit bounds the exec's; the state is there.
    let resp = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q", "timeout_seconds": 8 }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let r: Value = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&key)
        .json(&json!({ "code": "q", "timeout_seconds": 7 }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["value"], "9", "{r}");
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("shutdown in time").unwrap().expect("run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_written_before_a_failure_comes_back_with_the_error() {
    let s = TestServer::start().await;
    let spin =
        "import sys\nprint('before', flush=True)\nsys.stderr.write('warned\\n'); sys.stderr.flush()\nwhile True: pass";
    let crash = "import ctypes\nprint('pre-crash', flush=True)\nctypes.string_at(0)";
    let exit = "import os\nprint('pre-exit', flush=True)\nos._exit(3)";
    let has = |got: &(StatusCode, Value), stdout: &str| {
        let e = &got.1["error"];
        assert!(e["stdout"].as_str().is_some_and(|o| o.contains(stdout)), "{}", got.1);
    };
    // One-shot: timeout, crash, exit.
    let got = s.post("/v1/exec", json!({ "code": spin, "timeout_seconds": 1 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    has(&got, "before\n");
    assert!(got.1["error"]["stderr"].as_str().is_some_and(|e| e.contains("warned\n")), "{}", got.1);
    let got = s.post("/v1/exec", json!({ "code": crash })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "guest_crashed");
    has(&got, "pre-crash\n");
    let got = s.post("/v1/exec", json!({ "code": exit })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "guest_exited");
    has(&got, "pre-exit\n");
    // Errors that are not an exec's failure carry no output fields.
    let got = s.post("/v1/exec", json!({ "code": "1", "timeout_seconds": -1 })).await;
    assert!(got.1["error"].get("stdout").is_none(), "{}", got.1);
    // Truncated like any output (the output limit, 1 MiB by default).
    let flood = "print('y' * (3 << 20), flush=True)\nwhile True: pass";
    let got = s.post("/v1/exec", json!({ "code": flood, "timeout_seconds": 2 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    let out = got.1["error"]["stdout"].as_str().unwrap_or_default();
    assert!(
        out.len() <= (1 << 20) + 200 && out.contains("output truncated"),
        "{} bytes: {}",
        out.len(),
        &out[out.len().saturating_sub(120)..]
    );

    // Session: the output comes with the rollback.
    let id = s.create_session(json!({ "timeout_seconds": 1 })).await;
    s.sexec(&id, "z = 1").await;
    let got = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": spin })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    has(&got, "before\n");
    assert_eq!(got.1["error"]["checkpoint"], 1, "{}", got.1);
    let got = s.post(&format!("/v1/sessions/{id}/exec"), json!({ "code": crash })).await;
    assert_error(&got, StatusCode::UNPROCESSABLE_ENTITY, "guest_crashed");
    has(&got, "pre-crash\n");

    // Streams: the error event carries it (beside the stdout events already sent).
    for path in ["/v1/exec/stream".to_string(), format!("/v1/sessions/{id}/exec/stream")] {
        let (st, ev) = sse(&s, &path, &s.key, json!({ "code": crash })).await;
        assert_eq!(st, StatusCode::OK, "{path}");
        let last = ev.last().expect("events");
        assert_eq!(last.event, "error", "{path}: {ev:?}");
        assert_eq!(last.data["error"]["code"], "guest_crashed", "{path}: {ev:?}");
        assert!(last.data["error"]["stdout"].as_str().is_some_and(|o| o.contains("pre-crash")), "{path}: {ev:?}");
        assert!(
            ev.iter().any(|e| e.event == "stdout" && e.data["data"].as_str().is_some_and(|d| d.contains("pre-crash"))),
            "{ev:?}"
        );
    }
    let (_, ev) = sse(&s, "/v1/exec/stream", &s.key, json!({ "code": spin, "timeout_seconds": 1 })).await;
    let last = ev.last().expect("events");
    assert_eq!(last.data["error"]["code"], "timeout", "{ev:?}");
    assert_eq!(last.data["error"]["stdout"], "before\n", "{ev:?}");

    // Batch items.
    let (st, v) = s.post("/v1/exec/batch", json!({ "codes": [exit, "print('ok')"] })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["results"][0]["error"]["code"], "guest_exited", "{v}");
    assert_eq!(v["results"][0]["error"]["stdout"], "pre-exit\n", "{v}");
    assert_eq!(v["results"][1]["stdout"], "ok\n", "{v}");
}

// ---------------------------------------------------------------------------
// Commands (`/v1/commands`, `/v1/sessions/{id}/commands`): processes in the guest
// ---------------------------------------------------------------------------

async fn scommand(s: &TestServer, id: &str, body: Value) -> Value {
    let (st, v) = s.post(&format!("/v1/sessions/{id}/commands"), body.clone()).await;
    assert_eq!(st, StatusCode::OK, "command {body}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_in_the_session_file_system_with_exit_codes_cwd_and_env() {
    let s = TestServer::start().await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "import os\nos.makedirs('/tmp/w', exist_ok=True)\nopen('/tmp/w/data.txt', 'w').write('a\\nb\\nc\\n')")
        .await;

    // A shell line with a pipe, in a cwd, on what Python wrote: checkpoint 2.
    let v = scommand(&s, &id, json!({ "cmd": "cat data.txt | wc -l", "cwd": "/tmp/w" })).await;
    assert_eq!(
        (v["stdout"].as_str(), v["stderr"].as_str(), v["exit_code"].as_i64()),
        (Some("3\n"), Some(""), Some(0)),
        "{v}"
    );
    assert_eq!(v["checkpoint"], 2, "{v}");
    assert!(v["runtime_ms"].as_f64().is_some_and(|t| t > 0.0) && v["total_time_ms"].is_number(), "{v}");

    // stdout, stderr and a non-zero exit code, separately.
    let v = scommand(&s, &id, json!({ "cmd": "echo out; echo err >&2; exit 3" })).await;
    assert_eq!(
        (v["stdout"].as_str(), v["stderr"].as_str(), v["exit_code"].as_i64()),
        (Some("out\n"), Some("err\n"), Some(3)),
        "{v}"
    );

    // env is laid over the guest's environment (PATH still there).
    let v =
        scommand(&s, &id, json!({ "cmd": "echo \"$GREETING\" && which ls", "env": { "GREETING": "hi there" } })).await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(v["stdout"].as_str().unwrap().starts_with("hi there\n/"), "{v}");

    // An argv is not run through a shell: arguments arrive as they are.
    let v = scommand(&s, &id, json!({ "cmd": ["printf", "%s|", "a b", "$HOME", "it's"] })).await;
    assert_eq!((v["stdout"].as_str(), v["exit_code"].as_i64()), (Some("a b|$HOME|it's|"), Some(0)), "{v}");
    let v = scommand(&s, &id, json!({ "cmd": ["no-such-program-x"] })).await;
    assert_eq!(v["exit_code"], 127, "{v}");
    assert_eq!(v["stderr"], "forkbox: no-such-program-x: command not found\n", "{v}");
    let v = scommand(&s, &id, json!({ "cmd": "true", "cwd": "/no/such/dir" })).await;
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(v["stderr"].as_str().unwrap().starts_with("forkbox: cannot enter cwd '/no/such/dir'"), "{v}");
    // Killed by a signal: 128 + N.
    let v = scommand(&s, &id, json!({ "cmd": "kill -9 $$" })).await;
    assert_eq!(v["exit_code"], 137, "{v}");

    // What the command writes is the session's: Python sees it, it persists in checkpoints and forks.
    let v = scommand(&s, &id, json!({ "cmd": "echo hello > /tmp/w/from_sh.txt && ls /tmp/w" })).await;
    assert_eq!(v["stdout"], "data.txt\nfrom_sh.txt\n", "{v}");
    let seq = v["checkpoint"].as_i64().unwrap();
    assert_eq!(s.sexec(&id, "open('/tmp/w/from_sh.txt').read()").await["value"], "'hello\\n'");
    let (st, f) = s.post(&format!("/v1/sessions/{id}/fork"), json!({ "checkpoint": seq })).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    let v = scommand(&s, f["id"].as_str().unwrap(), json!({ "cmd": ["cat", "/tmp/w/from_sh.txt"] })).await;
    assert_eq!(v["stdout"], "hello\n", "{v}");
    // The checkpoint log names the command.
    let (_, cps) = s.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    let code = cps["checkpoints"][1]["code"].as_str().unwrap();
    assert!(code.starts_with("# command: cat data.txt | wc -l\n"), "{code}");
    // Files under /output come back like an exec's.
    let v = scommand(&s, &id, json!({ "cmd": "mkdir -p /output && echo 1,2 > /output/t.csv" })).await;
    assert_eq!(v["outputs"][0]["path"], "/output/t.csv", "{v}");

    // One-shot: a fresh fork, nothing persists.
    let (st, v) = s.post("/v1/commands", json!({ "cmd": "echo $((6 * 7)); echo x > /tmp/gone" })).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!((v["stdout"].as_str(), v["exit_code"].as_i64()), (Some("42\n"), Some(0)), "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("x_") && v.get("checkpoint").is_none(), "{v}");
    let (_, v) = s.post("/v1/commands", json!({ "cmd": ["test", "-e", "/tmp/gone"] })).await;
    assert_eq!(v["exit_code"], 1, "{v}");
    let (_, v) =
        s.post("/v1/commands", json!({ "cmd": ["python3", "-c", "import sys; print(sys.argv[1:])", "x"] })).await;
    assert_eq!(v["stdout"], "['x']\n", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_bad_bodies_unknown_sessions_busy_and_timeouts() {
    let s = TestServer::start().await;
    let id = s.create_session(json!({ "timeout_seconds": 10 })).await;
    let path = format!("/v1/sessions/{id}/commands");
    // Strict bodies, in the error table's shape, on both routes.
    for p in [path.as_str(), "/v1/commands"] {
        let got = s.post(p, json!({})).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(message(&got).contains("missing field `cmd`"), "{}", got.1);
        let got = s.post(p, json!({ "cmd": 5 })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(message(&got).contains("cmd") && message(&got).contains("a list of strings"), "{}", got.1);
        let got = s.post(p, json!({ "cmd": ["ls", 1] })).await;
        assert!(message(&got).contains("item 1 is a number"), "{}", got.1);
        let got = s.post(p, json!({ "cmd": "ls", "shell": true })).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(message(&got).contains("unknown field `shell`"), "{}", got.1);
        assert_error(&s.post(p, json!({ "cmd": " " })).await, StatusCode::BAD_REQUEST, "invalid_request");
        assert_error(&s.post(p, json!({ "cmd": [] })).await, StatusCode::BAD_REQUEST, "invalid_request");
        assert_error(
            &s.post(p, json!({ "cmd": "ls", "env": { "A=B": "x" } })).await,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        );
        assert_error(
            &s.post(p, json!({ "cmd": "ls", "env": { "A": 1 } })).await,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        );
        assert_error(&s.post(p, json!({ "cmd": "ls", "cwd": "" })).await, StatusCode::BAD_REQUEST, "invalid_request");
        assert_error(
            &s.post(p, json!({ "cmd": "ls", "timeout_seconds": -1 })).await,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        );
        assert_error(&s.post_raw(p, b"{\"cmd\": ".to_vec()).await, StatusCode::BAD_REQUEST, "malformed_json");
    }
    let got = s.post(&path, json!({ "cmd": "ls", "timeout_seconds": 20 })).await;
    assert!(message(&got).contains("the session's time limit"), "{}", got.1);
    assert_error(
        &s.post("/v1/commands", json!({ "cmd": "ls", "template": "nope" })).await,
        StatusCode::NOT_FOUND,
        "template_not_found",
    );
    // Unknown session, and another tenant's: 404.
    assert_error(
        &s.post("/v1/sessions/s_nope/commands", json!({ "cmd": "ls" })).await,
        StatusCode::NOT_FOUND,
        "session_not_found",
    );
    let bob = s.new_key("bob");
    let got = s.call(reqwest::Method::POST, &path, Some(&bob), Some(json!({ "cmd": "ls" }))).await;
    assert_error(&got, StatusCode::NOT_FOUND, "session_not_found");
    let (st, ev) = sse(&s, "/v1/sessions/s_nope/commands/stream", &s.key, json!({ "cmd": "ls" })).await;
    assert_eq!((st, ev[0].data["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("session_not_found")));

    // Busy: a command while an exec runs, and an exec while a command runs: 409.
    let busy = async |first: Value, first_path: &str, second_path: String, second: Value| {
        let (url, key, http, fp) = (s.url.clone(), s.key.clone(), s.http.clone(), first_path.to_string());
        let long = tokio::spawn(async move {
            let r = http.post(format!("{url}{fp}")).bearer_auth(key).json(&first).send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_error(&s.post(&second_path, second).await, StatusCode::CONFLICT, "session_busy");
        long.await.unwrap()
    };
    let exec = format!("/v1/sessions/{id}/exec");
    let (st, v) =
        busy(json!({ "code": "import time\ntime.sleep(1.5)\n'slept'" }), &exec, path.clone(), json!({ "cmd": "ls" }))
            .await;
    assert_eq!((st, v["value"].as_str()), (StatusCode::OK, Some("'slept'")), "{v}");
    let (st, v) = busy(json!({ "cmd": "sleep 1.5; echo slept" }), &path, exec.clone(), json!({ "code": "1" })).await;
    assert_eq!((st, v["stdout"].as_str(), v["exit_code"].as_i64()), (StatusCode::OK, Some("slept\n"), Some(0)), "{v}");

    // Timeout: 408 like an exec's, the output so far in the error, the session rolled back.
    let head = v["checkpoint"].as_i64().unwrap();
    let t0 = Instant::now();
    let got = s.post(&path, json!({ "cmd": "echo before; touch /tmp/late; sleep 30", "timeout_seconds": 1 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(got.1["error"]["stdout"], "before\n", "{}", got.1);
    assert_eq!(got.1["error"]["checkpoint"], head, "{}", got.1);
    assert_eq!(scommand(&s, &id, json!({ "cmd": ["test", "-e", "/tmp/late"] })).await["exit_code"], 1);
    let got = s.post("/v1/commands", json!({ "cmd": "sleep 30", "timeout_seconds": 1 })).await;
    assert_error(&got, StatusCode::REQUEST_TIMEOUT, "timeout");

    // Streamed: output as it is written, then one `result` with the exit code.
    let code = "for i in 1 2 3; do echo line $i; sleep 0.3; done; echo e >&2; exit 4";
    let (st, ev) = sse(&s, &format!("{path}/stream"), &s.key, json!({ "cmd": code })).await;
    assert_eq!(st, StatusCode::OK);
    let stdout: String = ev.iter().filter(|e| e.event == "stdout").map(|e| e.data["data"].as_str().unwrap()).collect();
    assert_eq!(stdout, "line 1\nline 2\nline 3\n", "{ev:?}");
    let last = ev.last().unwrap();
    assert_eq!(
        (last.event.as_str(), last.data["exit_code"].as_i64(), last.data["stderr"].as_str()),
        ("result", Some(4), Some("e\n")),
        "{ev:?}"
    );
    assert!(last.data["checkpoint"].is_i64(), "{ev:?}");
    let first = ev.iter().find(|e| e.event == "stdout").unwrap();
    assert!(last.at.duration_since(first.at) >= Duration::from_millis(400), "not streamed: {ev:?}");
    let (_, ev) =
        sse(&s, "/v1/commands/stream", &s.key, json!({ "cmd": "echo one; sleep 30", "timeout_seconds": 1 })).await;
    assert_eq!(
        ev.first().map(|e| (e.event.as_str(), e.data["data"].as_str())),
        Some(("stdout", Some("one\n"))),
        "{ev:?}"
    );
    assert_eq!(ev.last().map(|e| e.data["error"]["code"].as_str()), Some(Some("timeout")), "{ev:?}");
}

/// The admin key routes: a new key's limits and egress policy (validated, 400 in the
/// shared error table), the list a page at a time (names of secrets, never a key or a
/// value), revocation (204, then 401 at once; 404 `key_not_found` after), 403 for other keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_keys_limits_list_pages_and_revoke() {
    let s = TestServer::start().await;
    let value = "sk-admin-list-9c1e5b7a3d";
    let (st, made) = s
        .post(
            "/v1/admin/keys",
            json!({
                "tenant": "bob",
                "limits": { "rate_limit": 7, "max_sessions": 2 },
                "egress": { "allow": ["example.com:443"] },
                "secrets": { "TOKEN": { "value": value, "hosts": ["api.example.com"] } },
            }),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{made}");
    let (bob, bob_id) = (made["key"].as_str().unwrap().to_string(), made["id"].as_str().unwrap().to_string());
    // Given limits, the defaults for the rest; the key's own egress layer.
    let l = &made["limits"];
    assert_eq!((l["rate_limit"].as_u64(), l["max_sessions"].as_u64()), (Some(7), Some(2)), "{made}");
    assert_eq!((l["max_disk_mb"].as_u64(), l["max_timeout_seconds"].as_u64()), (Some(1024), Some(60)), "{made}");
    assert_eq!(l["max_concurrency"], Value::Null, "{made}");
    assert_eq!(made["egress"]["mode"], "allowlist", "{made}");
    assert!(!made.to_string().contains(value));
    // They hold: the key's sessions stop at 2.
    for _ in 0..2 {
        let (st, v) = s.call(reqwest::Method::POST, "/v1/sessions", Some(&bob), Some(json!({}))).await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
    }
    let got = s.call(reqwest::Method::POST, "/v1/sessions", Some(&bob), Some(json!({}))).await;
    assert_error(&got, StatusCode::FORBIDDEN, "quota_exceeded");
    // Its capabilities name its secret (never the value) and say its limits.
    let (st, caps) = s.call(reqwest::Method::GET, "/v1/capabilities", Some(&bob), None).await;
    assert_eq!(st, StatusCode::OK, "{caps}");
    assert_eq!(caps["secrets"], json!([{ "name": "TOKEN", "hosts": ["api.example.com"] }]), "{caps}");
    assert_eq!(caps["limits"]["rate_limit"], 7, "{caps}");
    assert!(!caps.to_string().contains(value));

    // Unlimited but for what is given.
    let (st, v) =
        s.post("/v1/admin/keys", json!({ "tenant": "bob", "limits": { "unlimited": true, "max_sessions": 3 } })).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(
        v["limits"],
        json!({ "rate_limit": null, "max_sessions": 3, "max_disk_mb": null, "max_concurrency": 0,
                "cpu_seconds_per_hour": null, "max_timeout_seconds": null }),
        "{v}"
    );
    assert!(v.get("egress").is_none(), "{v}");

    // Bad limits and policies: 400 invalid_request, saying which.
    for (body, says) in [
        (json!({ "limits": { "rate_limit": 0 } }), "rate_limit"),
        (json!({ "limits": { "rate_limit": 5_000_000_000u64 } }), "rate_limit"),
        (json!({ "limits": { "max_sessions": 0 } }), "max_sessions"),
        (json!({ "limits": { "max_concurrency": 2_000_000 } }), "max_concurrency"),
        (json!({ "limits": { "max_timeout_seconds": -1 } }), "max_timeout_seconds"),
        (json!({ "limits": { "sessions": 1 } }), "unknown field"),
        (json!({ "egress": { "allow": ["not a rule!"] } }), "egress"),
        (json!({ "egress": "sometimes" }), ""),
    ] {
        let got = s.post("/v1/admin/keys", body.clone()).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
        assert!(got.1["error"]["message"].as_str().unwrap().contains(says), "{body}: {}", got.1);
    }

    // Non-admin keys: 403 on every admin key route.
    let path = format!("/v1/admin/keys/{bob_id}");
    for (m, p) in [("GET", "/v1/admin/keys"), ("DELETE", path.as_str()), ("GET", path.as_str())] {
        let got = s.call(reqwest::Method::from_bytes(m.as_bytes()).unwrap(), p, Some(&bob), None).await;
        assert_error(&got, StatusCode::FORBIDDEN, "forbidden");
    }

    // The list: every key once, in the order of their ids, a page at a time.
    let (st, all) = s.get("/v1/admin/keys").await;
    assert_eq!(st, StatusCode::OK, "{all}");
    assert_eq!(all["next"], Value::Null);
    let ids: Vec<String> =
        all["keys"].as_array().unwrap().iter().map(|k| k["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 3, "{all}");
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert!(ids.contains(&bob_id));
    let text = all.to_string();
    assert!(!text.contains("fbk_") && !text.contains(value), "{text}");
    let listed = all["keys"].as_array().unwrap().iter().find(|k| k["id"] == bob_id.as_str()).unwrap();
    assert_eq!(listed["secrets"], json!([{ "name": "TOKEN", "hosts": ["api.example.com"] }]));
    let (mut paged, mut after) = (Vec::new(), String::new());
    loop {
        let (st, p) = s.get(&format!("/v1/admin/keys?limit=2&after={after}")).await;
        assert_eq!(st, StatusCode::OK, "{p}");
        assert!(p["keys"].as_array().unwrap().len() <= 2);
        paged.extend(p["keys"].as_array().unwrap().iter().map(|k| k["id"].as_str().unwrap().to_string()));
        match p["next"].as_str() {
            Some(n) => after = n.to_string(),
            None => break,
        }
    }
    assert_eq!(paged, ids);
    let (st, p) = s.get("/v1/admin/keys?tenant=bob").await;
    assert_eq!(st, StatusCode::OK, "{p}");
    assert!(
        p["keys"].as_array().unwrap().iter().all(|k| k["tenant"] == "bob") && p["keys"].as_array().unwrap().len() == 2
    );
    for q in ["limit=0", "limit=1001", "limit=x", "after=zz", "tenant=a/b", "page=2"] {
        let got = s.get(&format!("/v1/admin/keys?{q}")).await;
        assert_error(&got, StatusCode::BAD_REQUEST, "invalid_request");
    }

    // Revoked: 204, and the key (cached by its requests above) is refused at once.
    let (st, _) = s.delete(&path).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let got = s.call(reqwest::Method::GET, "/v1/sessions", Some(&bob), None).await;
    assert_error(&got, StatusCode::UNAUTHORIZED, "unauthorized");
    assert_error(&s.delete(&path).await, StatusCode::NOT_FOUND, "key_not_found");
    assert_error(&s.get(&path).await, StatusCode::NOT_FOUND, "key_not_found");
    // The tenant's sessions stay: another key of it sees them.
    let other = s.new_key("bob");
    let (st, v) = s.call(reqwest::Method::GET, "/v1/sessions", Some(&other), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["sessions"].as_array().unwrap().len(), 2, "{v}");
}

/// A key deleted from the store by another process (`forkbox key revoke`, or another node
/// of a cluster) stops working on a running server within its recheck period; a key's
/// secrets changed there reach it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_in_the_store_stops_working_on_a_running_server() {
    let home = fresh_home();
    let mut cfg = forkbox_server_testkit::config(home.path());
    cfg.runtime.image = Some(shared().image_path.clone());
    let server = Server::bind(cfg).await.expect("bind");
    let admin = server.created_key.clone().expect("a key");
    let url = format!("http://{}", server.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    let http = reqwest::Client::new();
    let status = |key: String| {
        let (http, url) = (http.clone(), url.clone());
        async move { http.get(format!("{url}/v1/sessions")).bearer_auth(key).send().await.unwrap().status() }
    };
    let h = home.path().to_path_buf();
    let key = forkbox_server::create_key_with(&h, "carol", &forkbox_server::KeyLimits::unlimited()).unwrap();
    assert_eq!(status(key.clone()).await, StatusCode::OK);
    // Secrets set in the store by another process reach the cached key.
    let sealed = tokio::task::spawn_blocking({
        let h = h.clone();
        move || forkbox_server::seal_secrets_json(&h, r#"{"ROTATED": {"value": "v-31337", "hosts": ["a.example"]}}"#)
    })
    .await
    .unwrap()
    .unwrap();
    let db = forkbox_runtime::keys::KeyDb::open(&h, None).unwrap();
    let id = forkbox_server::keys::hash_key(&key);
    assert!(db.set_secrets(&id, Some(&serde_json::to_string(&sealed).unwrap())).unwrap());
    let caps = || {
        let (http, url, key) = (http.clone(), url.clone(), key.clone());
        async move {
            let v: Value =
                http.get(format!("{url}/v1/capabilities")).bearer_auth(key).send().await.unwrap().json().await.unwrap();
            v["secrets"].clone()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while caps().await != json!([{ "name": "ROTATED", "hosts": ["a.example"] }]) {
        assert!(Instant::now() < deadline, "the store's secrets did not reach the server: {}", caps().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Deleted there: refused within the recheck period (one second), the admin key still works.
    assert!(forkbox_server::keys::delete_key(&h, &key).unwrap());
    let t0 = Instant::now();
    while status(key.clone()).await != StatusCode::UNAUTHORIZED {
        assert!(t0.elapsed() < Duration::from_secs(5), "a revoked key still works");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(t0.elapsed() < forkbox_server::keys::RECHECK_EVERY * 3, "{:?}", t0.elapsed());
    assert_eq!(status(admin).await, StatusCode::OK);
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("shutdown in time").unwrap().expect("run");
}
