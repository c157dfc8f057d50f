//! Several `forkbox` processes on one data directory at once (what a user of
//! the CLI does with two terminals, or a script running execs in parallel).
//!
//! - Concurrent execs on ONE session: each must either run (serialized, so
//!   no update is lost) or fail with a clear "busy" error, and the history
//!   must stay consistent (every acknowledged exec is in the state).
//! - Concurrent execs on DIFFERENT sessions: all must succeed, and none of
//!   them may be lost (one process's start-up recovery must not delete files
//!   another process is writing or has just written).
//!
//! Needs /dev/kvm (FAILS without it, never skips). See `common/mod.rs`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use std::process::{Output, Stdio};

use common::*;

fn spawn_exec(home: &std::path::Path, id: &str, code: &str) -> std::process::Child {
    session_cmd(home, "exec", &[id, code]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn forkbox")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim().to_string()
}

#[test]
fn concurrent_cli_execs_on_one_session_are_busy_or_serialized() {
    let home = fresh_home();
    let h = home.path();
    let id = session_ok(h, "new", &[]).trim().to_string();
    cli_exec(h, &id, "x = 0\nseen = []");
    let mut acknowledged = Vec::new();
    let mut busy = 0;
    let mut other_errors = Vec::new();
    for round in 0..3 {
        let children: Vec<_> =
            (0..6).map(|k| spawn_exec(h, &id, &format!("x += 1\nseen.append({})\nx", round * 10 + k))).collect();
        let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        for (k, o) in outs.iter().enumerate() {
            if o.status.success() {
                acknowledged.push(((round * 10 + k) as i64, text(&o.stdout)));
            } else {
                let err = text(&o.stderr);
                if err.contains("busy") {
                    busy += 1;
                } else {
                    other_errors.push(format!("round {round}, exec {k}: {err}"));
                }
            }
        }
    }
    eprintln!("{} execs acknowledged, {busy} busy, {} other errors", acknowledged.len(), other_errors.len());
    // Every acknowledged exec is in the state, exactly once, and x counts them.
    let (v, _) = cli_exec(h, &id, "(x, sorted(seen))");
    let mut tags: Vec<i64> = acknowledged.iter().map(|(t, _)| *t).collect();
    tags.sort();
    let want = format!("({}, {:?})", tags.len(), tags);
    assert_eq!(
        v.as_deref(),
        Some(want.as_str()),
        "acknowledged execs were lost or merged (values printed: {:?})",
        acknowledged.iter().map(|(_, v)| v.as_str()).collect::<Vec<_>>()
    );
    // Serialized: the values each acknowledged exec printed are 1..=n.
    let mut printed: Vec<i64> = acknowledged.iter().map(|(_, v)| v.parse().unwrap()).collect();
    printed.sort();
    assert_eq!(printed, (1..=tags.len() as i64).collect::<Vec<_>>());
    assert!(other_errors.is_empty(), "concurrent execs failed without a busy error:\n{}", other_errors.join("\n"));
}

#[test]
fn concurrent_cli_processes_never_lose_acknowledged_execs() {
    let home = fresh_home();
    let h = home.path();
    let ids: Vec<String> = (0..4).map(|_| session_ok(h, "new", &[]).trim().to_string()).collect();
    for id in &ids {
        cli_exec(h, id, "x = 0");
    }
    let rounds = 20;
    let mut ok_count = vec![0i64; ids.len()];
    let mut failures = Vec::new();
    for round in 0..rounds {
        let children: Vec<_> = ids.iter().map(|id| spawn_exec(h, id, "x += 1\nx")).collect();
        for (i, c) in children.into_iter().enumerate() {
            let o = c.wait_with_output().unwrap();
            if o.status.success() {
                ok_count[i] += 1;
                assert_eq!(
                    text(&o.stdout),
                    ok_count[i].to_string(),
                    "round {round}, session {i}: unexpected value (an earlier acknowledged exec was lost?)"
                );
            } else {
                failures.push(format!("round {round}, session {i}: {}", text(&o.stderr)));
            }
        }
    }
    let mut finals = Vec::new();
    for id in &ids {
        let (v, _) = cli_exec(h, id, "x");
        finals.push(v.unwrap().parse::<i64>().unwrap());
    }
    eprintln!("acknowledged per session {ok_count:?}, final x {finals:?}, {} failures", failures.len());
    assert!(failures.is_empty(), "execs on distinct sessions failed:\n{}", failures.join("\n"));
    assert_eq!(finals, ok_count, "acknowledged execs were lost");
}
