//! The client against the real API (real KVM guests): over HTTP to a server on
//! 127.0.0.1:0 with a key, and in process over `embedded_router` for the same
//! tenant, on the same state — so each transport sees what the other did.
//!
//! Needs /dev/kvm and the default image (built on first use under
//! `$FORKBOX_HOME` or the default home); without KVM these tests FAIL, never skip.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::Duration;

use forkbox_client::{
    BatchItem, BatchItemError, Client, ClientError, CommandLine, CommandRequest, CreateSession, ExecOptions, Network,
    StreamEvent, Transport,
};
use forkbox_server::{embedded_router, router, AppState, Inner, ServerConfig};
use futures_util::StreamExt;

/// A fresh state (own home, shared templates), an HTTP client with a key of
/// tenant `alice`, and an in-process client for `alice`.
async fn clients() -> (tempfile::TempDir, Client, Client, String) {
    clients_with(|_| {}).await
}

/// [`clients`] on a server whose config `f` adjusts.
async fn clients_with(f: impl FnOnce(&mut ServerConfig)) -> (tempfile::TempDir, Client, Client, String) {
    let home = forkbox_testkit::fresh_home("forkbox-client-test-");
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), home.path().to_path_buf());
    // Execs on this test process' threads (the jailed workers have tests of their own).
    cfg.runtime.isolation = forkbox_runtime::Isolation::Thread;
    f(&mut cfg);
    let h = home.path().to_path_buf();
    let (state, key): (AppState, String) = tokio::task::spawn_blocking(move || {
        let state =
            Inner::with_runtime(forkbox_testkit::runtime(&cfg.home, cfg.runtime.clone()), cfg).expect("server state");
        (state, forkbox_server::create_key(&h, "alice").expect("key"))
    })
    .await
    .expect("join");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = router(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    let http = Client::new(Transport::Http { base_url: url.clone(), key: Some(key) });
    let local = Client::new(Transport::InProcess(embedded_router(state, "alice")));
    (home, http, local, url)
}

fn api_code(r: Result<impl std::fmt::Debug, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api { status, code, .. }) => (status, code),
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn collect(s: impl futures_util::Stream<Item = Result<StreamEvent, ClientError>>) -> Vec<StreamEvent> {
    s.map(|e| e.expect("stream event")).collect().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_checkpoints_revert_fork_over_both_transports() {
    let (_home, http, local, _) = clients().await;
    let s = http
        .create_session(&CreateSession { tags: [("k".into(), "v".into())].into(), ..Default::default() })
        .await
        .expect("create");
    assert_eq!(s.checkpoint, None);
    // Made over HTTP, used in process (same tenant, same state), and back.
    assert_eq!(local.session_exec(&s.id, "x = [1]").await.expect("exec").checkpoint, Some(1));
    let r = http.session_exec(&s.id, "x.append(2); print(len(x)); x").await.expect("exec");
    assert_eq!((r.value.as_deref(), r.stdout.as_str(), r.checkpoint, r.exit_code), (Some("[1, 2]"), "2\n", Some(2), 0));
    let r = local.session_exec(&s.id, "1/0").await.expect("a Python exception is a result");
    assert_eq!((r.error.as_ref().map(|e| e.kind.as_str()), r.exit_code), (Some("ZeroDivisionError"), 1));

    for c in [&http, &local] {
        let listed = c.list_sessions(&[("k".into(), "v".into())]).await.expect("list");
        assert_eq!(listed.iter().map(|x| x.id.as_str()).collect::<Vec<_>>(), vec![s.id.as_str()]);
        assert!(c.list_sessions(&[("k".into(), "other".into())]).await.expect("list").is_empty());
        assert_eq!(c.get_session(&s.id).await.expect("get").checkpoint, Some(3));
    }
    let cps = local.checkpoints(&s.id).await.expect("checkpoints");
    assert_eq!(
        cps.iter().map(|c| (c.seq, c.parent, c.head)).collect::<Vec<_>>(),
        vec![(1, None, false), (2, Some(1), false), (3, Some(2), true)]
    );

    assert_eq!(http.revert(&s.id, 1).await.expect("revert").checkpoint, Some(1));
    assert_eq!(local.session_exec(&s.id, "x").await.expect("exec").value.as_deref(), Some("[1]"));
    let f = local.fork(&s.id, Some(2)).await.expect("fork");
    assert_eq!(f.forked_from.as_ref().map(|o| (o.session.as_str(), o.checkpoint)), Some((s.id.as_str(), 2)));
    assert_eq!(http.session_exec(&f.id, "x").await.expect("exec").value.as_deref(), Some("[1, 2]"));

    for c in [&http, &local] {
        assert_eq!(api_code(c.get_session("s_nope").await), (404, "session_not_found".into()));
        assert_eq!(api_code(c.revert(&s.id, 99).await), (404, "checkpoint_not_found".into()));
    }
    http.delete_session(&f.id).await.expect("delete");
    local.delete_session(&s.id).await.expect("delete");
    assert_eq!(api_code(http.delete_session(&s.id).await), (404, "session_not_found".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_batch_and_streams() {
    let (_home, http, local, _) = clients().await;
    for c in [&http, &local] {
        let r = c.exec("import numpy as np\nint(np.arange(5).sum())", None).await.expect("exec");
        assert_eq!(r.value.as_deref(), Some("10"));
        assert!(r.fork_time_ms.is_some(), "{r:?}");
        assert_eq!(api_code(c.exec("1", Some(-1.0)).await), (400, "invalid_request".into()));
        assert_eq!(api_code(c.exec("while True: pass", Some(0.5)).await), (408, "timeout".into()));

        let b = c.exec_batch(&["1+1".into(), "import os; os._exit(3)".into()], None).await.expect("batch");
        assert!(matches!(&b.results[0], BatchItem::Ok(r) if r.value.as_deref() == Some("2")), "{:?}", b.results[0]);
        assert!(
            matches!(&b.results[1], BatchItem::Failed(BatchItemError { status: 422, error }) if error.code.as_str() == "guest_exited"),
            "{:?}",
            b.results[1]
        );

        // Output arrives as events before the result.
        let ev = collect(
            c.exec_stream("print('a')\nimport sys; print('b', file=sys.stderr)\n7", None).await.expect("stream"),
        )
        .await;
        assert_eq!(ev.len(), 3, "{ev:?}");
        assert_eq!(ev[0], StreamEvent::Stdout("a\n".into()));
        assert_eq!(ev[1], StreamEvent::Stderr("b\n".into()));
        assert!(matches!(&ev[2], StreamEvent::Result(v) if v["value"] == "7" && v["stdout"] == "a\n"), "{:?}", ev[2]);
        let ev = collect(c.exec_stream("print('x')\nwhile True: pass", Some(0.5)).await.expect("stream")).await;
        assert!(matches!(ev.last(), Some(StreamEvent::Error { code, .. }) if code == "timeout"), "{ev:?}");
    }
    let s = local.create_session(&CreateSession::default()).await.expect("create");
    let ev = collect(http.session_exec_stream(&s.id, "for i in range(3): print(i)").await.expect("stream")).await;
    let out: String =
        ev.iter().filter_map(|e| if let StreamEvent::Stdout(t) = e { Some(t.as_str()) } else { None }).collect();
    assert_eq!(out, "0\n1\n2\n");
    assert!(matches!(ev.last(), Some(StreamEvent::Result(v)) if v["checkpoint"] == 1), "{ev:?}");
    // Errors before the stream starts are plain API errors.
    assert_eq!(api_code(local.session_exec_stream("s_nope", "1").await.map(|_| ())), (404, "session_not_found".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_transport_errors() {
    let (_home, http, local, url) = clients().await;
    let s = http.create_session(&CreateSession::default()).await.expect("create");
    let data: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let w = local.put_file(&s.id, "/data/in put.bin", data.clone()).await.expect("put");
    assert_eq!((w.path.as_str(), w.size), ("/data/in put.bin", 70_000));
    assert_eq!(http.get_file(&s.id, "/data/in put.bin").await.expect("get"), data);
    let r = http.session_exec(&s.id, "len(open('/data/in put.bin', 'rb').read())").await.expect("exec");
    assert_eq!(r.value.as_deref(), Some("70000"));
    let files = local.list_files(&s.id, "/data").await.expect("list");
    assert_eq!(
        files.iter().map(|f| (f.name.as_str(), f.size, f.is_dir)).collect::<Vec<_>>(),
        vec![("in put.bin", 70_000, false)]
    );
    assert_eq!(api_code(http.get_file(&s.id, "/data/missing").await).1, "file_not_found");
    assert!(matches!(http.get_file(&s.id, "relative").await, Err(ClientError::InvalidArgument(_))));

    // Transport failures are their own variants, not API errors.
    let bad_key = Client::new(Transport::Http { base_url: url.clone(), key: Some("fbk_wrong".into()) });
    assert_eq!(api_code(bad_key.list_sessions(&[]).await), (401, "unauthorized".into()));
    assert_eq!(api_code(http.with_key("fbk_other").list_sessions(&[]).await), (401, "unauthorized".into()));
    let nobody = Client::new(Transport::Http { base_url: "http://127.0.0.1:1".into(), key: None });
    let e = nobody.list_sessions(&[]).await.expect_err("nothing listens there");
    assert_eq!(e.code(), "connection_failed", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_stops_the_running_exec() {
    let (_home, http, local, _) = clients().await;
    // (A time limit well past the interrupt, short enough that a missed interrupt fails fast.)
    let s =
        http.create_session(&CreateSession { timeout_seconds: Some(8.0), ..Default::default() }).await.expect("create");
    // Ctrl-C: the running exec gets KeyboardInterrupt, the session keeps its state.
    assert!(!http.interrupt(&s.id).await.expect("interrupt"), "nothing was running");
    local.session_exec(&s.id, "kept = 5").await.expect("exec");
    let (c, id) = (local.clone(), s.id.clone());
    let running = tokio::spawn(async move { c.session_exec(&id, "while True:\n    pass").await });
    // Interrupt as soon as the exec counts as running (an interrupt counts from the moment the exec starts).
    let mut interrupted = false;
    for _ in 0..200 {
        if http.interrupt(&s.id).await.expect("interrupt") {
            interrupted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(interrupted, "the exec never showed up as running");
    let r = running.await.expect("join").expect("an interrupted exec is a result");
    assert_eq!(r.error.map(|e| e.kind), Some("KeyboardInterrupt".into()));
    assert_eq!(http.session_exec(&s.id, "kept").await.expect("exec").value.as_deref(), Some("5"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_session_exec_timeouts_and_output_with_errors() {
    use forkbox_client::{ExecOutput, PatchSession};
    let (_home, http, local, _) = clients().await;
    let spin = "print('so far', flush=True)\nwhile True: pass";
    for c in [&http, &local] {
        // A one-shot timeout brings back what the code wrote before.
        let e = c.exec(spin, Some(0.5)).await.expect_err("timeout");
        assert_eq!((e.code(), e.output().map(|o| o.stdout.as_str())), ("timeout", Some("so far\n")), "{e:?}");
        let ev = collect(c.exec_stream(spin, Some(0.5)).await.expect("stream")).await;
        let want = Some(Box::new(ExecOutput { stdout: "so far\n".into(), stderr: String::new() }));
        assert!(
            matches!(ev.last(), Some(StreamEvent::Error { code, output, .. }) if code == "timeout" && *output == want),
            "{ev:?}"
        );
        // Other errors carry none.
        assert!(c.exec("1", Some(-1.0)).await.expect_err("bad timeout").output().is_none());

        let s = c
            .create_session(&CreateSession { timeout_seconds: Some(10.0), ..Default::default() })
            .await
            .expect("create");
        let e = c.session_exec_with(&s.id, spin, Some(0.5)).await.expect_err("timeout");
        assert_eq!((e.code(), e.output().map(|o| o.stdout.as_str())), ("timeout", Some("so far\n")), "{e:?}");
        assert_eq!(api_code(c.session_exec_with(&s.id, "1", Some(11.0)).await), (400, "invalid_request".into()));
        let ev = collect(c.session_exec_stream_with(&s.id, spin, Some(0.5)).await.expect("stream")).await;
        assert!(matches!(ev.last(), Some(StreamEvent::Error { code, .. }) if code == "timeout"), "{ev:?}");

        let patch =
            PatchSession { tags: Some([("t".into(), "1".into())].into()), timeout_seconds: Some(2.0), memory_mb: None };
        let v = c.patch_session(&s.id, &patch).await.expect("patch");
        assert_eq!((v.tags.get("t").map(String::as_str), v.limits.timeout_seconds), (Some("1"), 2.0));
        assert_eq!(api_code(c.session_exec_with(&s.id, "1", Some(3.0)).await), (400, "invalid_request".into()));
        let bad = PatchSession { memory_mb: Some(1), ..Default::default() };
        assert_eq!(api_code(c.patch_session(&s.id, &bad).await), (400, "invalid_request".into()));
        assert_eq!(api_code(c.patch_session("s_nope", &patch).await), (404, "session_not_found".into()));
    }
}

/// A loopback responder (nothing leaves this machine) that answers `ok` to every connection; its port.
fn ok_responder() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let _ = std::io::Write::write_all(&mut c, b"ok");
        }
    });
    port
}

/// `network` of one-shot execs, streams, commands and sessions: the server
/// allows one loopback port; a request narrows that away, never widens it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_setting_narrows_execs_commands_and_sessions() {
    let port = ok_responder();
    let closed = ok_responder(); // another loopback port, not allowed by the server
    let (_home, http, local, _) = clients_with(|cfg| {
        cfg.runtime.limits.network.layers[0].allow.push(format!("127.0.0.1:{port}").parse().expect("rule"));
    })
    .await;
    let get = |p: u16| format!("import socket\ns = socket.create_connection(('127.0.0.1', {p}), timeout=5)\ns.recv(2)");
    let with = |network: Option<Network>| ExecOptions { network, ..Default::default() };
    for c in [&http, &local] {
        // The server's policy alone, then narrowed: an allowlist naming the port keeps it, none or
        // another rule takes it away, and no request opens the port the server does not.
        assert_eq!(c.exec_with(&get(port), &with(None)).await.expect("exec").value.as_deref(), Some("b'ok'"));
        let keep = Network::allowlist([format!("127.0.0.1:{port}")]);
        assert_eq!(c.exec_with(&get(port), &with(Some(keep))).await.expect("exec").value.as_deref(), Some("b'ok'"));
        for narrowed in [Network::NONE, Network::allowlist(["10.0.0.0/8"]), Network::PUBLIC] {
            let r = c.exec_with(&get(port), &with(Some(narrowed.clone()))).await.expect("exec");
            let kind = r.error.as_ref().map(|e| e.kind.as_str());
            assert_eq!(kind, Some("ConnectionRefusedError"), "{narrowed:?}: {r:?}");
            assert!(r.stderr.contains("refused by the egress policy"), "{narrowed:?}: {}", r.stderr);
        }
        let widen = Network::allowlist([format!("127.0.0.1:{closed}")]);
        let r = c.exec_with(&get(closed), &with(Some(widen))).await.expect("exec");
        assert!(r.error.is_some(), "a request widened the server's policy: {r:?}");
        // Streams carry it too.
        let events = collect(c.exec_stream_with(&get(port), &with(Some(Network::NONE))).await.expect("stream")).await;
        let result = events.iter().find_map(|e| match e {
            StreamEvent::Result(v) => Some(v.clone()),
            _ => None,
        });
        let result = result.expect("a result event");
        assert_eq!(result["error"]["type"], "ConnectionRefusedError", "{result}");
        // A bad rule is the server's 400, named.
        let bad = c.exec_with("1", &with(Some(Network::allowlist(["not a rule"])))).await;
        assert_eq!(api_code(bad), (400, "invalid_request".into()));

        // One-shot commands.
        let py = |p: u16| CommandLine::Argv(vec!["python3".into(), "-c".into(), format!("{}\nprint('got')", get(p))]);
        let req = CommandRequest { network: Some(Network::NONE), ..CommandRequest::new(py(port)) };
        let r = c.command(&req).await.expect("command");
        assert!(r.exit_code != 0 && r.stderr.contains("ConnectionRefusedError"), "{r:?}");
        let r = c.command(&CommandRequest::new(py(port))).await.expect("command");
        assert_eq!((r.exit_code, r.stdout.as_str()), (0, "got\n"), "{r:?}");

        // Sessions keep theirs and show the effective policy.
        let s = c.create_session(&CreateSession { network: Some(Network::NONE), ..Default::default() }).await;
        let s = s.expect("create");
        assert_eq!(s.limits.network_mode(), Some("none"), "{:?}", s.limits);
        let r = c.session_exec(&s.id, &get(port)).await.expect("exec");
        assert!(r.error.is_some(), "{r:?}");
        let got = c.get_session(&s.id).await.expect("get");
        assert_eq!(got.limits.network_mode(), Some("none"));
        // A session command runs under the session's network: asking for one is the client's error.
        let req = CommandRequest { network: Some(Network::PUBLIC), ..CommandRequest::new(py(port)) };
        assert!(matches!(c.session_command(&s.id, &req).await, Err(ClientError::InvalidArgument(_))));
        let open = c.create_session(&CreateSession::default()).await.expect("create");
        assert_eq!(open.limits.network_mode(), Some("public"), "{:?}", open.limits);
        assert_eq!(c.session_exec(&open.id, &get(port)).await.expect("exec").value.as_deref(), Some("b'ok'"));
        for id in [&s.id, &open.id] {
            c.delete_session(id).await.expect("delete");
        }
    }
}

#[test]
fn network_from_command_line_parts() {
    let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(Network::from_parts(None, &[], &[]), Ok(None));
    assert_eq!(Network::from_parts(Some("none"), &[], &[]), Ok(Some(Network::NONE)));
    assert_eq!(Network::from_parts(Some("public"), &[], &[]), Ok(Some(Network::PUBLIC)));
    assert_eq!(
        Network::from_parts(None, &v(&["a.com"]), &v(&["*:25"])),
        Ok(Some(Network::Rules { allow: v(&["a.com"]), deny: v(&["*:25"]), max_bytes_per_second: None }))
    );
    assert_eq!(Network::from_parts(Some("allowlist"), &[], &[]), Ok(Some(Network::allowlist(Vec::<String>::new()))));
    assert!(Network::from_parts(Some("public"), &v(&["a.com"]), &[]).is_err());
    assert!(Network::from_parts(Some("all"), &[], &[]).is_err());
    // The wire forms are the API's.
    assert_eq!(serde_json::to_value(Network::NONE).expect("json"), serde_json::json!("none"));
    assert_eq!(
        serde_json::to_value(Network::allowlist(["a.com"])).expect("json"),
        serde_json::json!({ "allow": ["a.com"] })
    );
    assert_eq!(
        serde_json::to_value(Network::PUBLIC.with_rate(Some(4096))).expect("json"),
        serde_json::json!({ "mode": "public", "max_bytes_per_second": 4096 })
    );
    assert_eq!(
        serde_json::to_value(Network::allowlist(["a.com"]).with_rate(Some(10))).expect("json"),
        serde_json::json!({ "allow": ["a.com"], "max_bytes_per_second": 10 })
    );
    assert_eq!(Network::NONE.with_rate(Some(1)).with_rate(None), Network::NONE);
}
