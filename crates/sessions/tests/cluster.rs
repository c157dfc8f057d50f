//! Sessions shared by the nodes of a cluster, through two session
//! managers (two "nodes", each with its own data directory) on one real
//! PostgreSQL database and one real S3-compatible bucket: a session resident
//! on one node is refused by the other (`Elsewhere`, forwarded by the server);
//! a node that stops heartbeating loses its sessions to the next node that
//! needs them, which resumes them from the bucket at their last committed
//! checkpoint; the late commit of the node that lost a session is refused by
//! the fencing token and leaves nothing; a draining node hands its sessions
//! over. Heartbeats are called by hand here (the runtime runs them on a
//! thread), so the tests decide when a node's lease runs out.
//!
//! Needs /dev/kvm, PostgreSQL's binaries and the s3s-fs binary (FAILS without them, never skips).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::time::Duration;

use common::*;
use forkbox_sessions::manager::{Config, Route, SessionError, SessionManager};
use forkbox_sessions::node::ClusterConfig;
use forkbox_testkit::postgres::Postgres;
use forkbox_testkit::s3::S3;

const LEASE: Duration = Duration::from_millis(1500);

fn node(home: &std::path::Path, pg: &Postgres, s3: &S3, id: &str) -> SessionManager {
    let config = Config {
        objects: Some(s3.config()),
        database: Some(pg.url()),
        cluster: Some(ClusterConfig { node_id: id.into(), url: format!("http://{id}.invalid"), lease: LEASE }),
        ..Config::default()
    };
    open(home, config)
}

/// The node (by id) the session is resident on, according to `m`'s view.
#[track_caller]
fn elsewhere(r: Result<forkbox_sessions::manager::ExecOutcome, SessionError>) -> String {
    match r {
        Err(SessionError::Elsewhere { owner, .. }) => owner.node,
        Err(e) => panic!("expected Elsewhere, got {e} ({e:?})"),
        Ok(o) => panic!("expected Elsewhere, got a result {:?}", o.result),
    }
}

fn wait_out_the_lease() {
    std::thread::sleep(LEASE + Duration::from_millis(200));
}

#[test]
fn a_session_moves_to_another_node_only_when_its_node_stops_and_a_late_commit_is_fenced() {
    let (pg, s3) = (Postgres::start(), S3::start());
    let (ha, hb) = (fresh_home(), fresh_home());
    let a = node(ha.path(), &pg, &s3, "a");
    let b = node(hb.path(), &pg, &s3, "b");
    let s = new_session(&a);
    ok(&a, &s.id, "x = 1");
    assert!(a.is_resident(&s.id));
    // b refuses: a has it (the server forwards the request to a).
    a.heartbeat().unwrap();
    let e = b.exec(TENANT, &s.id, "x").unwrap_err();
    assert_eq!(e.code(), "session_moved", "{e}");
    assert_eq!(elsewhere(Err(e)), "a");
    assert_eq!(b.route(&s.id).unwrap(), Route::Node { node: "a".into(), url: "http://a.invalid".into() });
    assert_eq!(a.route(&s.id).unwrap(), Route::Here);

    // a stops heartbeating (killed, cut off): after the lease time b takes the
    // session and resumes it from the bucket (b's directory has none of its files).
    wait_out_the_lease();
    b.heartbeat().unwrap();
    assert_eq!(b.route(&s.id).unwrap(), Route::Here);
    assert_eq!(value(&b, &s.id, "x += 1\nx"), "2");
    assert!(b.object_stats().unwrap().fetches >= 1);
    // a, back, finds its sandbox stale: it is dropped, and the session is b's.
    a.heartbeat().unwrap();
    assert_eq!(elsewhere(a.exec(TENANT, &s.id, "x")), "b");
    assert!(!a.is_resident(&s.id));

    // b runs a long exec; meanwhile its lease runs out and a takes the session:
    // b's checkpoint is refused by the fencing token, nothing of it is committed.
    b.heartbeat().unwrap();
    std::thread::scope(|sc| {
        let slow = sc.spawn(|| b.exec(TENANT, &s.id, "import time\ntime.sleep(3)\ny = 'late'"));
        wait_out_the_lease();
        a.heartbeat().unwrap();
        assert_eq!(value(&a, &s.id, "z = 3\n(x, z)"), "(2, 3)");
        match slow.join().unwrap() {
            Err(e @ SessionError::LeaseLost { .. }) => {
                assert_eq!(e.code(), "session_moved");
                // (Its checkpoint number: the one it ran on, 2.)
                assert_eq!(e.rolled_back_to(), Some(Some(2)), "{e}");
            }
            other => panic!("the late commit should be refused: {:?}", other.map(|o| o.result)),
        }
    });
    assert!(!b.is_resident(&s.id), "the node that lost the session dropped its sandbox");
    a.heartbeat().unwrap();
    assert_eq!(value(&a, &s.id, "(x, z, 'y' in dir())"), "(2, 3, False)");
    let codes: Vec<String> = a.checkpoints(TENANT, &s.id).unwrap().into_iter().map(|c| c.code).collect();
    assert_eq!(codes, ["x = 1", "x += 1\nx", "z = 3\n(x, z)", "(x, z, 'y' in dir())"]);
}

#[test]
fn two_nodes_racing_for_one_session_one_wins_and_a_drained_node_hands_sessions_over() {
    let (pg, s3) = (Postgres::start(), S3::start());
    let (ha, hb) = (fresh_home(), fresh_home());
    let a = node(ha.path(), &pg, &s3, "a");
    let b = node(hb.path(), &pg, &s3, "b");
    let s = new_session(&a);
    // Both nodes asked at once for a session nobody has: one runs it, the other is told where it is.
    let (ra, rb) = std::thread::scope(|sc| {
        let ra = sc.spawn(|| a.exec(TENANT, &s.id, "w = 'a'"));
        let rb = sc.spawn(|| b.exec(TENANT, &s.id, "w = 'b'"));
        (ra.join().unwrap(), rb.join().unwrap())
    });
    let winner = match (&ra, &rb) {
        (Ok(_), Err(SessionError::Elsewhere { owner, .. })) if owner.node == "a" => &a,
        (Err(SessionError::Elsewhere { owner, .. }), Ok(_)) if owner.node == "b" => &b,
        _ => panic!("exactly one node should run it: {:?} / {:?}", ra.map(|o| o.result), rb.map(|o| o.result)),
    };
    let loser = if std::ptr::eq(winner, &a) { &b } else { &a };
    assert_eq!(winner.checkpoints(TENANT, &s.id).unwrap().len(), 1);

    // The winner drains: it gives the session back at once; the other node takes it.
    let winner_id = if std::ptr::eq(winner, &a) { "a" } else { "b" };
    assert!(loser.set_draining(winner_id, true).unwrap(), "any node may drain another");
    winner.heartbeat().unwrap();
    assert!(!winner.is_resident(&s.id));
    assert_eq!(winner.nodes().unwrap().iter().find(|n| n.id == winner_id).unwrap().sessions, 0);
    // A request reaching the draining node goes to the active one.
    loser.heartbeat().unwrap();
    let loser_id = if winner_id == "a" { "b" } else { "a" };
    assert!(matches!(winner.route(&s.id).unwrap(), Route::Node { node, .. } if node == loser_id));
    let e = winner.exec(TENANT, &s.id, "w").unwrap_err();
    assert_eq!(e.code(), "session_moved", "{e}");
    let w = value(loser, &s.id, "w");
    assert!(w == "'a'" || w == "'b'", "{w}");
    // Active again: it may take sessions.
    assert!(winner.set_draining(winner_id, false).unwrap());
    let t = new_session(winner);
    ok(winner, &t.id, "v = 1");
    // A node that leaves gives everything back at once (not after its lease).
    winner.leave();
    assert_eq!(value(loser, &t.id, "v"), "1");
}
