//! `forkbox bench cluster --nodes URL,URL,...`: against a running cluster
//! (`scripts/cluster-local` starts one on loopback), over HTTP, in one run:
//! a session exec sent to the node that has the session vs. one sent to
//! another node (forwarded), interleaved sample by sample; then the execs per
//! second of `clients` concurrent clients, each with a session of its own,
//! all sent to one node vs. spread over every node (each client's session
//! resident on the node it talks to), in alternating rounds.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::summary;

struct Bench {
    http: reqwest::Client,
    key: String,
    nodes: Vec<String>,
}

impl Bench {
    async fn new_session(&self, node: &str) -> Result<String> {
        let r = self.http.post(format!("{node}/v1/sessions")).bearer_auth(&self.key).json(&json!({})).send().await?;
        anyhow::ensure!(r.status().is_success(), "creating a session on {node}: HTTP {}", r.status());
        let v: Value = r.json().await?;
        v["id"].as_str().map(str::to_owned).context("no session id")
    }

    async fn exec(&self, node: &str, id: &str, code: &str) -> Result<()> {
        let r = self
            .http
            .post(format!("{node}/v1/sessions/{id}/exec"))
            .bearer_auth(&self.key)
            .json(&json!({ "code": code }))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "exec on {node}: HTTP {}: {}", r.status(), r.text().await?);
        Ok(())
    }

    /// Execs per second of one client per (node, session).
    async fn throughput(&self, sessions: &[(String, String)], secs: f64) -> Result<(f64, usize)> {
        let targets = sessions
            .iter()
            .map(|(node, id)| (format!("{node}/v1/sessions/{id}/exec"), self.key.clone(), json!({ "code": "n = 1" })))
            .collect();
        crate::http::concurrent(&self.http, targets, secs).await
    }
}

pub fn cluster(
    nodes: &[String],
    key: &str,
    samples: usize,
    clients: usize,
    secs: f64,
    rounds: usize,
) -> Result<ExitCode> {
    anyhow::ensure!(nodes.len() >= 2, "--nodes needs at least two node URLs");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let b = Bench {
            http: reqwest::Client::new(),
            key: key.to_string(),
            nodes: nodes.iter().map(|n| n.trim_end_matches('/').to_string()).collect(),
        };
        let (home, away) = (&b.nodes[0], &b.nodes[1]);
        // One session, resident on the first node (its first exec is there).
        let id = b.new_session(home).await?;
        b.exec(home, &id, "n = 0").await?;
        let (mut local, mut forwarded) = (Vec::new(), Vec::new());
        for i in 0..samples * 2 {
            let (node, out) = if i % 2 == 0 { (home, &mut local) } else { (away, &mut forwarded) };
            let t0 = Instant::now();
            b.exec(node, &id, "n += 1").await?;
            out.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
        let p50 = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(|a, b| a.total_cmp(b));
            crate::percentile(&s, 0.5)
        };
        println!("session exec + checkpoint `n += 1`, {} nodes, same run, interleaved:", b.nodes.len());
        println!("  sent to the node that has it   {}", summary(local.clone()));
        println!("  sent to another node (forward) {}", summary(forwarded.clone()));
        println!("  the forward costs {:+.3} ms at p50", p50(&forwarded) - p50(&local));

        // Throughput: each client's session made and first run on the node it talks to.
        let mut one = Vec::new();
        let mut spread = Vec::new();
        for i in 0..clients {
            let id = b.new_session(home).await?;
            b.exec(home, &id, "n = 0").await?;
            one.push((home.clone(), id));
            let node = b.nodes[i % b.nodes.len()].clone();
            let id = b.new_session(&node).await?;
            b.exec(&node, &id, "n = 0").await?;
            spread.push((node, id));
        }
        println!("{clients} clients, each on a session of its own, {secs} s per round:");
        for round in 1..=rounds {
            let (r1, f1) = b.throughput(&one, secs).await?;
            let (rn, fnn) = b.throughput(&spread, secs).await?;
            println!(
                "  round {round}: all on one node {r1:8.1} execs/s ({f1} failed)   spread over {} nodes {rn:8.1} execs/s ({fnn} failed)   ratio {:.2}",
                b.nodes.len(),
                rn / r1.max(f64::MIN_POSITIVE)
            );
        }
        Ok(ExitCode::SUCCESS)
    })
}
