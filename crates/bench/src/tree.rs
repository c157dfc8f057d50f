//! `forkbox bench explore`: the tree of states through the API (embedded, in
//! process): explore of N alternatives vs N sequential session execs, the source
//! session's exec latency while an explore runs, inspect and diff latency.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use forkbox_client::tree::Keep;

use crate::{block_on, Target};

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

fn pct(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| v[(((v.len() as f64 - 1.0) * p).round() as usize).min(v.len() - 1)];
    (at(0.5), at(0.99))
}

fn line(what: &str, v: Vec<f64>) -> (f64, f64) {
    let n = v.len();
    let (p50, p99) = pct(v);
    println!("{what:<58} p50 {p50:9.2} ms   p99 {p99:9.2} ms   (n={n})");
    (p50, p99)
}

pub fn explore(samples: usize, width: usize, target: &dyn Target) -> Result<ExitCode> {
    let api = target.api()?;
    let c = api.client();
    let s = block_on(&*api, c.create_session(&forkbox_client::CreateSession::default()))?;
    block_on(&*api, c.session_exec(&s.id, "xs = list(range(2000))\nimport math"))?;
    let codes: Vec<String> = (0..width).map(|i| format!("sum(math.sqrt(x + {i}) for x in xs)")).collect();
    // Warm up the exec threads' VMs.
    block_on(&*api, c.explore(&s.id, &codes, None, &Keep::None, None))?;
    let mut created = Vec::new();

    println!("explore of {width} alternatives (each `sum(math.sqrt(x + i) for x in xs)` over 2,000 numbers) from a session checkpoint:");
    let (mut ex, mut seq) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let t0 = Instant::now();
        let r = block_on(&*api, c.explore(&s.id, &codes, None, &Keep::None, None))?;
        ex.push(ms(t0));
        anyhow::ensure!(r.branches.iter().all(|b| b.result.is_some()), "a branch failed");
        // The same work as session execs one after another (each checkpointed), in a fork of the same checkpoint.
        let f = block_on(&*api, c.fork(&s.id, None))?;
        created.push(f.id.clone());
        let t0 = Instant::now();
        for code in &codes {
            block_on(&*api, c.session_exec(&f.id, code))?;
        }
        seq.push(ms(t0));
    }
    let (e50, e99) = line(&format!("explore, {width} branches, none kept (wall)"), ex);
    let (s50, s99) = line(&format!("{width} sequential session execs (wall)"), seq);
    println!("ratio explore / sequential: p50 {:.2}   p99 {:.2}", e50 / s50, e99 / s99);
    let mut kept = Vec::new();
    for _ in 0..samples.min(10) {
        let t0 = Instant::now();
        let r = block_on(&*api, c.explore(&s.id, &codes, None, &Keep::All, None))?;
        kept.push(ms(t0));
        created.extend(r.branches.iter().filter_map(|b| b.session.clone()));
    }
    line(&format!("explore, {width} branches, all kept (sessions + checkpoints)"), kept);

    // The source's own execs, idle and while explores run.
    let mut idle = Vec::new();
    for _ in 0..samples {
        let t0 = Instant::now();
        block_on(&*api, c.session_exec(&s.id, "k = 1"))?;
        idle.push(ms(t0));
    }
    line("source session exec, idle", idle);
    let busy = block_on(&*api, async {
        let bg = {
            let (c, id, codes) = (c.clone(), s.id.clone(), codes.clone());
            tokio::spawn(async move {
                for _ in 0..samples.max(3) {
                    if c.explore(&id, &codes, None, &Keep::None, None).await.is_err() {
                        break;
                    }
                }
            })
        };
        let mut v = Vec::new();
        while !bg.is_finished() {
            let t0 = Instant::now();
            c.session_exec(&s.id, "k = 1").await?;
            v.push(ms(t0));
        }
        let _ = bg.await;
        Ok::<_, anyhow::Error>(v)
    })?;
    line("source session exec while explores of it run", busy);

    // Inspect and diff.
    block_on(
        &*api,
        c.session_exec(&s.id, "import numpy as np\na = np.arange(10000)\nd = {i: str(i) for i in range(100)}"),
    )?;
    let head = block_on(&*api, c.get_session(&s.id))?.checkpoint.unwrap_or(1);
    let mut ins = Vec::new();
    for _ in 0..samples {
        let t0 = Instant::now();
        block_on(&*api, c.variables(&s.id, head))?;
        ins.push(ms(t0));
    }
    line("inspect (variables of a checkpoint, throwaway fork)", ins);
    let mut df = Vec::new();
    for _ in 0..samples {
        let t0 = Instant::now();
        block_on(&*api, c.diff(&s.id, 1, Some(head)))?;
        df.push(ms(t0));
    }
    line("diff (two throwaway forks: variables + file walk)", df);
    for id in created.iter().chain(std::iter::once(&s.id)) {
        let _ = block_on(&*api, c.delete_session(id));
    }
    Ok(ExitCode::SUCCESS)
}
