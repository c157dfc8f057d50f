//! `forkbox bench http`: one-shot execs over HTTP on loopback against two real
//! `forkbox serve` processes, one with `--isolation thread` and one with
//! `--isolation process` (jailed sandbox workers), measured in alternating
//! rounds of the same run: sequential latency, then `clients` concurrent
//! clients for a few seconds. The clients run in this process, on the same cores.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::{percentile, summary, Target};

pub(crate) struct Served {
    isolation: &'static str,
    pub(crate) url: String,
    pub(crate) key: String,
    proc: Child,
    _home: tempfile::TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

pub(crate) fn start(exe: &Path, home: &Path, image: &Path, isolation: &'static str, slots: usize) -> Result<Served> {
    let dir = tempfile::Builder::new().prefix("fbx-bench-http-").tempdir()?;
    std::os::unix::fs::symlink(forkbox_engine::template::templates_dir(home), dir.path().join("templates"))?;
    let out = Command::new(exe)
        .arg("--home")
        .arg(dir.path())
        .args(["key", "create", "--tenant", "bench", "--unlimited"])
        .output()?;
    anyhow::ensure!(out.status.success(), "key create: {}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8_lossy(&out.stdout).split_whitespace().last().context("no key")?.to_string();
    let mut proc = Command::new(exe)
        .arg("--home")
        .arg(dir.path())
        .args(["serve", "--listen", "127.0.0.1:0", "--isolation", isolation, "--exec-slots", &slots.to_string()])
        .arg("--image")
        .arg(image)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut lines = BufReader::new(proc.stdout.take().context("no stdout")?).lines();
    let url = loop {
        let line = lines.next().context("serve ended before it listened")??;
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap_or_default().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok(Served { isolation, url, key, proc, _home: dir })
}

async fn exec(http: &reqwest::Client, s: &Served) -> Result<()> {
    let r = http
        .post(format!("{}/v1/exec", s.url))
        .bearer_auth(&s.key)
        .json(&serde_json::json!({ "code": "print(1+1)" }))
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "HTTP {}", r.status());
    let v: serde_json::Value = r.json().await?;
    anyhow::ensure!(v["stdout"] == "2\n", "unexpected {v}");
    Ok(())
}

/// `POST /v1/sessions` with `body`: the new session's id.
async fn create_session(http: &reqwest::Client, s: &Served, body: &serde_json::Value) -> Result<String> {
    let r = http.post(format!("{}/v1/sessions", s.url)).bearer_auth(&s.key).json(body).send().await?;
    anyhow::ensure!(r.status().is_success(), "create: HTTP {} {}", r.status(), r.text().await.unwrap_or_default());
    let v: serde_json::Value = r.json().await?;
    Ok(v["id"].as_str().context("no session id")?.to_string())
}

async fn delete_session(http: &reqwest::Client, s: &Served, id: &str) -> Result<()> {
    let r = http.delete(format!("{}/v1/sessions/{id}", s.url)).bearer_auth(&s.key).send().await?;
    anyhow::ensure!(r.status().is_success(), "delete: HTTP {}", r.status());
    Ok(())
}

/// `POST /v1/sessions/{id}/exec` of `code`: the answer.
async fn session_exec(http: &reqwest::Client, s: &Served, id: &str, code: &str) -> Result<serde_json::Value> {
    let r = http
        .post(format!("{}/v1/sessions/{id}/exec", s.url))
        .bearer_auth(&s.key)
        .json(&serde_json::json!({ "code": code }))
        .send()
        .await?;
    anyhow::ensure!(
        r.status().is_success(),
        "session exec: HTTP {} {}",
        r.status(),
        r.text().await.unwrap_or_default()
    );
    Ok(r.json().await?)
}

/// Time to interactive: `POST /v1/sessions` (on `template`, None: the default)
/// then the new session's first `POST .../exec` of `1 + 1`, on one keep-alive
/// connection; ms. The session is deleted after (not timed).
async fn first_call(http: &reqwest::Client, s: &Served, template: Option<&str>) -> Result<f64> {
    let body = match template {
        Some(t) => serde_json::json!({ "template": t }),
        None => serde_json::json!({}),
    };
    let t = Instant::now();
    let id = create_session(http, s, &body).await?;
    let v = session_exec(http, s, &id, "1 + 1").await?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(v["value"] == "2", "unexpected {v}");
    delete_session(http, s, &id).await?;
    Ok(took)
}

/// One `POST /v1/sessions/{id}/exec` of `code` in a live session; ms.
async fn session_call(http: &reqwest::Client, s: &Served, id: &str, code: &str) -> Result<f64> {
    let t = Instant::now();
    let v = session_exec(http, s, id, code).await?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(v["error"].is_null(), "unexpected {v}");
    Ok(took)
}

/// Calls in a live session (its sandbox resident), each its own checkpoint:
/// (a call 20 ms after the last, as an agent's calls come; a call right after
/// the last, which waits for the last one's checkpoint to be durable), ms.
async fn session_calls(http: &reqwest::Client, s: &Served, samples: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let id = create_session(http, s, &serde_json::json!({})).await?;
    let (mut spaced, mut back) = (Vec::new(), Vec::new());
    for i in 0..samples + 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let a = session_call(http, s, &id, &format!("y = {i}")).await?;
        let b = session_call(http, s, &id, "y += 1").await?;
        if i >= 3 {
            spaced.push(a);
            back.push(b);
        }
    }
    delete_session(http, s, &id).await?;
    Ok((spaced, back))
}

/// Wait until `template` is built on `s` (a first use builds it; 409 until then).
async fn template_ready(http: &reqwest::Client, s: &Served, template: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let r = http
            .post(format!("{}/v1/sessions", s.url))
            .bearer_auth(&s.key)
            .json(&serde_json::json!({ "template": template }))
            .send()
            .await?;
        let status = r.status();
        if status.is_success() {
            return Ok(());
        }
        let text = r.text().await.unwrap_or_default();
        anyhow::ensure!(
            status.as_u16() == 409 && text.contains("template_not_ready") && Instant::now() < deadline,
            "template {template}: HTTP {status} {text}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// The host's `python3 -c 1+1` (process start to exit), ms.
fn host_python_start() -> Result<f64> {
    let t = Instant::now();
    let st = Command::new(crate::host_python()).args(["-c", "1+1"]).status()?;
    anyhow::ensure!(st.success(), "host python3 -c 1+1 failed");
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

/// Execs per second of `clients` concurrent clients over `secs`.
async fn throughput(http: &reqwest::Client, s: &Served, clients: usize, secs: f64) -> Result<(f64, usize)> {
    let target = (format!("{}/v1/exec", s.url), s.key.clone(), serde_json::json!({ "code": "print(1+1)" }));
    concurrent(http, vec![target; clients], secs).await
}

/// One client per target (URL, key, JSON body), each posting it again and
/// again for `secs`: successful requests per second of them all, and failures.
pub(crate) async fn concurrent(
    http: &reqwest::Client,
    targets: Vec<(String, String, serde_json::Value)>,
    secs: f64,
) -> Result<(f64, usize)> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (url, key, body) in targets {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, 0usize);
            while Instant::now() < end {
                match http.post(&url).bearer_auth(&key).json(&body).send().await {
                    Ok(r) if r.status().is_success() => ok += 1,
                    _ => failed += 1,
                }
            }
            (ok, failed)
        }));
    }
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let (o, f) = t.await?;
        ok += o;
        failed += f;
    }
    Ok((ok as f64 / t0.elapsed().as_secs_f64(), failed))
}

/// `(samples, clients, seconds, rounds)` as `forkbox bench http` names them.
pub fn http(
    home: &Path,
    (samples, clients, secs, rounds): (usize, usize, f64, usize),
    exec_slots: Option<usize>,
    target: &dyn Target,
) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    let engine = forkbox_engine::Engine::open(&path)?;
    forkbox_engine::Template::ensure(&engine, home)?;
    let exe: PathBuf = std::env::current_exe()?;
    let slots = exec_slots.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()) * 2).max(1);
    let servers = [start(&exe, home, &path, "thread", slots)?, start(&exe, home, &path, "process", slots)?];
    println!("image {}, {slots} exec slots each; {rounds} rounds alternating thread / process", &id[..12]);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let http = reqwest::Client::new();
    let mut lat: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut tput: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    rt.block_on(async {
        for s in &servers {
            for _ in 0..20 {
                exec(&http, s).await?;
            }
        }
        for round in 0..rounds {
            for (i, s) in servers.iter().enumerate() {
                for _ in 0..samples {
                    let t = Instant::now();
                    exec(&http, s).await?;
                    lat[i].push(t.elapsed().as_secs_f64() * 1000.0);
                }
                let (rate, failed) = throughput(&http, s, clients, secs).await?;
                println!("round {round}: {:7}  {clients} clients: {rate:7.0} execs/s ({failed} failed)", s.isolation);
                tput[i].push(rate);
            }
        }
        Ok::<(), anyhow::Error>(())
    })?;
    // Time to interactive, alternating servers and templates sample by sample.
    let templates: [(&str, Option<&str>); 2] = [("default", None), ("data", Some("data"))];
    let mut tti: Vec<Vec<f64>> = vec![Vec::new(); servers.len() * templates.len()];
    let mut host = Vec::new();
    rt.block_on(async {
        for s in &servers {
            for (_, t) in templates {
                if let Some(t) = t {
                    template_ready(&http, s, t).await?;
                }
                for _ in 0..3 {
                    first_call(&http, s, t).await?;
                }
            }
        }
        for _ in 0..samples.min(100) {
            for (i, s) in servers.iter().enumerate() {
                for (j, (_, t)) in templates.iter().enumerate() {
                    tti[i * templates.len() + j].push(first_call(&http, s, *t).await?);
                    // (The first checkpoint settles after the reply: not into the next sample.)
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            host.push(host_python_start()?);
        }
        Ok::<(), anyhow::Error>(())
    })?;
    let mut calls = Vec::new();
    for s in &servers {
        calls.push(rt.block_on(session_calls(&http, s, samples.min(100)))?);
    }
    for (i, s) in servers.iter().enumerate() {
        println!("one-shot exec over HTTP, isolation {:7}  {}", s.isolation, summary(lat[i].clone()));
    }
    for (s, (spaced, back)) in servers.iter().zip(calls) {
        println!("session exec `y = i`, 20 ms after the last call, isolation {:7}  {}", s.isolation, summary(spaced));
        println!("session exec `y += 1`, right after the last call, isolation {:7}  {}", s.isolation, summary(back));
    }
    for (i, s) in servers.iter().enumerate() {
        for (j, (name, _)) in templates.iter().enumerate() {
            println!(
                "time to interactive (create session + first exec `1 + 1`), {name:7} template, isolation {:7}  {}",
                s.isolation,
                summary(tti[i * templates.len() + j].clone())
            );
        }
    }
    println!("host `python3 -c 1+1` (process start to exit)       {}", summary(host));
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, 0.5)
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "process - thread: {:+.3} ms p50; {clients} clients: {:.0} vs {:.0} execs/s = {:.1}%",
        med(&lat[1]) - med(&lat[0]),
        mean(&tput[1]),
        mean(&tput[0]),
        100.0 * mean(&tput[1]) / mean(&tput[0]).max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
