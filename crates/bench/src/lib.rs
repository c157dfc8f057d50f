//! `forkbox bench ...`: measurements quoted in docs/performance.md.
//!
//! Place in the flow: a request-layer library beside the CLI (whose `bench`
//! verb parses [`BenchCommand`] and calls [`bench`]). The benchmarks drive
//! the engine, sessions and workers directly (the layers they measure), the
//! API in process through a [`Target`]'s [`Api`], or `forkbox serve`
//! processes (this executable's) over HTTP.

mod cluster;
mod e2b;
mod http;
mod numpy;
mod tree;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Subcommand;
use forkbox_engine::{Engine, Limits, Sandbox};

/// The benchmarks and their flags (`forkbox bench <name> ...`); `I`: the CLI's
/// flags that choose the guest image (flattened into each benchmark that runs
/// guests).
#[derive(Subcommand)]
pub enum BenchCommand<I: clap::Args> {
    /// Cold start: process start to agent ready (python + numpy) in the guest,
    /// beside `python3 -c 'import numpy'` on the host.
    Cold {
        /// Number of runs.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        #[command(flatten)]
        image: I,
    },
    /// Forks of the numpy template: fork only, fork + exec, pages, memory per live
    /// fork, many forks at once; beside a host Python that os.fork()s (no isolation).
    Fork {
        /// Fork-only samples.
        #[arg(long, default_value_t = 1000)]
        forks: usize,
        /// Fork + exec samples (also for the host baseline).
        #[arg(long, default_value_t = 200)]
        execs: usize,
        /// Live forks held at once for the memory measurement.
        #[arg(long, default_value_t = 1000)]
        live: usize,
        /// Forks in the one-exec-each throughput run.
        #[arg(long, default_value_t = 1000)]
        batch: usize,
        #[command(flatten)]
        image: I,
    },
    /// forkd's benchmark: N sandboxes each running `import numpy`, all live at the end:
    /// wall time and host memory (PSS) per sandbox, beside N host `python3 -c "import numpy"`
    /// processes and N os.fork() children of a host python with numpy imported.
    Numpy {
        /// Sandboxes per round.
        #[arg(long, default_value_t = 100)]
        count: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[command(flatten)]
        image: I,
    },
    /// Threads in a forked sandbox: thread start + join, ThreadPoolExecutor(8).map
    /// of 64 trivial tasks, asyncio.run(asyncio.sleep(0)), a 1 MB pipe round trip,
    /// three threads contending for the GIL under a 1 us switch interval, 40
    /// threads doing file I/O and short sleeps (CPython's daemon-threads test);
    /// beside a host Python doing the same in an os.fork() child.
    Threads {
        /// Samples of each measurement.
        #[arg(long, default_value_t = 200)]
        samples: usize,
        #[command(flatten)]
        image: I,
    },
    /// Processes in a forked sandbox: subprocess.run(['true']), subprocess.run([python, '-c', 'pass']),
    /// os.fork() + os._exit(0) + waitpid, multiprocessing.Pool(2).map of 100 trivial tasks;
    /// beside a host Python doing the same in an os.fork() child.
    Procs {
        /// Samples of the fork and `true` measurements (python -c: at most 20, Pool: at most 10).
        #[arg(long, default_value_t = 50)]
        samples: usize,
        #[command(flatten)]
        image: I,
    },
    /// Network: a small HTTP GET (urllib) to a loopback server and a 100 MB
    /// download, from the guest (loopback allowlisted) beside the host's python3;
    /// and a small GET to an http.server inside the sandbox (in an os.fork child:
    /// a listener of the sandbox, never a host port) beside the same on the host.
    Net {
        /// GET samples.
        #[arg(long, default_value_t = 200)]
        requests: usize,
        /// Download size in MB.
        #[arg(long, default_value_t = 100)]
        download_mb: usize,
        #[command(flatten)]
        image: I,
    },
    /// The tree of states: explore of N alternatives vs N sequential session execs,
    /// the source's exec latency during explores, inspect and diff latency.
    Explore {
        #[arg(long, default_value_t = 20)]
        samples: usize,
        /// Alternatives per explore.
        #[arg(long, default_value_t = 16)]
        width: usize,
        #[command(flatten)]
        image: I,
    },
    /// One-shot execs over HTTP on loopback, `serve --isolation thread` beside
    /// `--isolation process` (sandbox worker processes), alternating rounds of
    /// one run: sequential latency and concurrent clients.
    Http {
        /// Sequential samples per round and server.
        #[arg(long, default_value_t = 200)]
        samples: usize,
        /// Concurrent clients of the throughput run.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Seconds of each throughput run.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Exec slots of each server (default: twice the cores, as `serve`).
        #[arg(long)]
        exec_slots: Option<usize>,
        #[command(flatten)]
        image: I,
    },
    /// A running cluster (`scripts/cluster-local`): a session exec sent to the node that has the
    /// session vs. forwarded from another node (interleaved), then concurrent clients all on one
    /// node vs. spread over every node (alternating rounds).
    Cluster {
        /// The nodes' URLs, comma-separated (the first is where the measured session lives).
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// An API key every node knows (`key create --database`); default $FORKBOX_API_KEY.
        #[arg(long, env = "FORKBOX_API_KEY", hide_env_values = true)]
        key: String,
        /// Samples of each kind of exec.
        #[arg(long, default_value_t = 200)]
        samples: usize,
        #[arg(long, default_value_t = 16)]
        clients: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Sessions: checkpoint cost vs pages dirtied, resume of evicted sessions,
    /// forks of checkpoints, disk per session, many sessions at once.
    Sessions {
        /// Samples per measurement.
        #[arg(long, default_value_t = 50)]
        samples: usize,
        /// Sessions kept resident at once (each ran one exec).
        #[arg(long, default_value_t = 1000)]
        resident: usize,
        /// Sessions on disk (forks of one checkpoint, each with one exec of its own).
        #[arg(long, default_value_t = 10000)]
        on_disk: usize,
        #[command(flatten)]
        image: I,
    },
    /// E2B's Python SDK (e2b-code-interpreter) against forkbox's E2B API beside forkbox's own
    /// Python SDK, on one server on loopback: create + first run_code (time to interactive),
    /// run_code in a warm sandbox, commands.run('true'), files.write + read of 1 KB, fork(count).
    E2b {
        /// Samples of each measurement (fork: a fifth of them).
        #[arg(long, default_value_t = 100)]
        samples: usize,
        /// Forks per fork sample.
        #[arg(long, default_value_t = 10)]
        forks: usize,
        /// The Python that runs both SDKs (default $FORKBOX_BENCH_PYTHON, else python3).
        #[arg(long)]
        python: Option<std::path::PathBuf>,
        #[command(flatten)]
        image: I,
    },
    /// Checkpoints in an object store: session exec (with its checkpoint) on the local
    /// directory only vs with `--objects` (same run), and a resume from the bucket with a
    /// cold local cache. Endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
    /// With --database, the same on PostgreSQL metadata too.
    Objects {
        /// The bucket and prefix, `s3://bucket/prefix` (a scratch prefix: the bench writes there).
        #[arg(long, value_name = "URL")]
        objects: String,
        /// Also with session metadata in PostgreSQL: a server (`postgres://user@host:port/db`)
        /// on which the bench may create and drop its scratch databases (forkbox_bench_*).
        #[arg(long, value_name = "URL")]
        database: Option<String>,
        /// Samples per measurement.
        #[arg(long, default_value_t = 200)]
        samples: usize,
        #[command(flatten)]
        image: I,
    },
}

/// What a benchmark asks of the CLI that runs it: the guest image its flags
/// chose, and the API over the local data directory.
pub trait Target {
    /// The guest image (path, id), built if missing (with progress).
    fn image(&self) -> Result<(PathBuf, String)>;
    /// The API over the local data directory: the runtime in this process, or
    /// the server that owns the directory.
    fn api(&self) -> Result<Box<dyn Api>>;
}

/// The API a benchmark calls: a client and the async runtime it runs on.
pub trait Api {
    fn client(&self) -> &forkbox_client::Client;
    /// Where the API is, for people: the URL, or "embedded (<data dir>)".
    fn target(&self) -> &str;
    /// Drive `f` to completion on the API's async runtime.
    fn run(&self, f: Pin<Box<dyn Future<Output = ()> + '_>>);
}

/// `f`'s output, driven on `api`'s async runtime.
pub fn block_on<T>(api: &dyn Api, f: impl Future<Output = T>) -> T {
    let mut out = None;
    api.run(Box::pin(async { out = Some(f.await) }));
    out.expect("Api::run drives its future to completion")
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(crate) fn summary(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.total_cmp(b));
    format!("p50 {:9.3} ms   p99 {:9.3} ms   (n={})", percentile(&v, 0.5), percentile(&v, 0.99), v.len())
}

/// The host Python the baselines run: `$FORKBOX_HOST_PYTHON`, else /usr/bin/python3.
pub(crate) fn host_python() -> std::path::PathBuf {
    std::env::var_os("FORKBOX_HOST_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(|| "/usr/bin/python3".into(), Into::into)
}

/// What the host baseline of `cmd` imports beside the standard library (None: no host baseline).
fn host_needs<I: clap::Args>(cmd: &BenchCommand<I>) -> Option<&'static [&'static str]> {
    match cmd {
        BenchCommand::Cold { .. } | BenchCommand::Fork { .. } | BenchCommand::Numpy { .. } => Some(&["numpy"]),
        BenchCommand::Threads { .. } | BenchCommand::Procs { .. } | BenchCommand::Net { .. } => Some(&[]),
        _ => None,
    }
}

/// Before any guest work: the host baseline's Python and modules are there, or one line
/// saying what to install.
fn preflight<I: clap::Args>(cmd: &BenchCommand<I>) -> Result<()> {
    let Some(modules) = host_needs(cmd) else { return Ok(()) };
    let python = host_python();
    let mut code = String::from("import sys");
    for m in modules {
        code.push_str(&format!("\nimport {m}"));
    }
    let debs: Vec<String> =
        std::iter::once("python3".to_string()).chain(modules.iter().map(|m| format!("python3-{m}"))).collect();
    let ok = std::process::Command::new(&python)
        .args(["-c", &code])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    anyhow::ensure!(
        ok,
        "this benchmark compares with the host's Python, and {} cannot {}: install it (apt-get install {}), or set \
         FORKBOX_HOST_PYTHON to a python3 that has {}",
        python.display(),
        if modules.is_empty() { "run".to_string() } else { format!("import {}", modules.join(", ")) },
        debs.join(" "),
        if modules.is_empty() { "the standard library".to_string() } else { modules.join(", ") }
    );
    Ok(())
}

/// Run the benchmark `cmd` on the data directory `home`, printing its rows;
/// `target` turns the image flags into what the benchmark runs on.
pub fn bench<I: clap::Args>(
    home: &Path,
    cmd: BenchCommand<I>,
    target: &dyn Fn(I) -> Box<dyn Target>,
) -> Result<ExitCode> {
    preflight(&cmd)?;
    match cmd {
        BenchCommand::Cold { runs, image } => cold(runs.max(1), &*target(image)),
        BenchCommand::Fork { forks, execs, live, batch, image } => {
            fork(home, forks, execs, live, batch, &*target(image))
        }
        BenchCommand::Numpy { count, rounds, image } => {
            crate::numpy::numpy(home, count.max(1), rounds.max(1), &*target(image))
        }
        BenchCommand::Threads { samples, image } => threads(home, samples, &*target(image)),
        BenchCommand::Procs { samples, image } => procs(samples.max(1), &*target(image)),
        BenchCommand::Sessions { samples, resident, on_disk, image } => {
            sessions(home, samples, resident, on_disk, &*target(image))
        }
        BenchCommand::Http { samples, clients, seconds, rounds, exec_slots, image } => crate::http::http(
            home,
            (samples.max(1), clients.max(1), seconds.max(0.5), rounds.max(1)),
            exec_slots,
            &*target(image),
        ),
        BenchCommand::Cluster { nodes, key, samples, clients, seconds, rounds } => {
            crate::cluster::cluster(&nodes, &key, samples.max(1), clients.max(1), seconds.max(0.5), rounds.max(1))
        }
        BenchCommand::Net { requests, download_mb, image } => net(home, requests.max(1), download_mb, &*target(image)),
        BenchCommand::E2b { samples, forks, python, image } => {
            crate::e2b::e2b(home, samples.max(1), forks.clamp(1, 20), python.as_deref(), &*target(image))
        }
        BenchCommand::Objects { objects: url, database, samples, image } => {
            objects(home, &url, database.as_deref(), samples.max(2), &*target(image))
        }
        BenchCommand::Explore { samples, width, image } => {
            crate::tree::explore(samples.max(1), width.clamp(1, 64), &*target(image))
        }
    }
}

/// A loopback HTTP/1.0 responder: `/small` is 2 bytes, `/big` is `big` bytes.
fn http_responder(big: usize) -> Result<u16> {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut b = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&b[..n]),
                    }
                }
                let size = if req.starts_with(b"GET /big") { big } else { 2 };
                let _ = c.write_all(format!("HTTP/1.0 200 OK\r\nContent-Length: {size}\r\n\r\n").as_bytes());
                let chunk = vec![b'x'; 1 << 20];
                let mut left = size;
                while left > 0 {
                    let n = left.min(chunk.len());
                    if c.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n;
                }
            });
        }
    });
    Ok(port)
}

fn net(home: &Path, requests: usize, download_mb: usize, target: &dyn Target) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    let engine = Engine::open(&path)?;
    let template = forkbox_engine::Template::ensure(&engine, home)?;
    let big = download_mb << 20;
    let port = http_responder(big)?;
    println!("image {id}, loopback server on port {port} (allowlisted for the guest)");
    let code = format!(
        "import time, urllib.request\n\
         lat = []\n\
         for _ in range({requests}):\n\
         \x20   t = time.perf_counter()\n\
         \x20   urllib.request.urlopen('http://127.0.0.1:{port}/small').read()\n\
         \x20   lat.append((time.perf_counter() - t) * 1000)\n\
         t = time.perf_counter()\n\
         r = urllib.request.urlopen('http://127.0.0.1:{port}/big')\n\
         n = 0\n\
         while True:\n\
         \x20   b = r.read(1 << 20)\n\
         \x20   if not b: break\n\
         \x20   n += len(b)\n\
         secs = time.perf_counter() - t\n\
         print(' '.join(map(str, lat)))\n\
         print(n, secs)\n"
    );
    let parse = |out: &str| -> Result<(Vec<f64>, f64, f64)> {
        let mut lines = out.lines();
        let lat = lines.next().unwrap_or("").split_whitespace().filter_map(|x| x.parse().ok()).collect();
        let mut last = lines.next().unwrap_or("").split_whitespace();
        let n: f64 = last.next().and_then(|x| x.parse().ok()).context("no download size")?;
        let secs: f64 = last.next().and_then(|x| x.parse().ok()).context("no download time")?;
        Ok((lat, n, secs))
    };
    let mut network =
        forkbox_engine::NetConfig::with_policy(forkbox_engine::NetPolicy::allowlist(vec![
            format!("127.0.0.1:{port}").parse()?
        ]));
    network.max_bytes = (big as u64).saturating_mul(2).max(1 << 30);
    let limits = Limits { network, timeout: std::time::Duration::from_secs(600), ..Limits::default() };
    let mut sb = template.fork(&engine, limits)?;
    let r = sb.exec(&code)?;
    anyhow::ensure!(r.error.is_none(), "guest: {:?}\n{}", r.error, r.stderr);
    let (glat, gn, gsecs) = parse(&r.stdout)?;
    let host = std::process::Command::new(host_python()).args(["-c", &code]).output().context("host python3")?;
    anyhow::ensure!(host.status.success(), "host python3: {}", String::from_utf8_lossy(&host.stderr));
    let (hlat, hn, hsecs) = parse(&String::from_utf8_lossy(&host.stdout))?;
    println!("guest: urllib GET of 2 bytes over loopback   {}", summary(glat.clone()));
    println!("host:  urllib GET of 2 bytes over loopback   {}", summary(hlat.clone()));
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, 0.5)
    };
    println!("ratio guest/host p50: {:.2}x", med(glat) / med(hlat));
    println!("guest: {:.0} MB download: {:.0} MB/s ({:.2} s)", gn / 1e6, gn / 1e6 / gsecs, gsecs);
    println!("host:  {:.0} MB download: {:.0} MB/s ({:.2} s)", hn / 1e6, hn / 1e6 / hsecs, hsecs);
    let st = sb.net_stats();
    println!(
        "guest counters: {} connects allowed, {} denied, {} bytes received",
        st.connects_allowed, st.connects_denied, st.bytes_received
    );
    // A server inside the sandbox: http.server in an os.fork child, urllib GETs from the parent.
    let code = format!(
        "import http.server, os, time, urllib.request\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   def do_GET(self):\n\
         \x20       self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers(); self.wfile.write(b'ok')\n\
         \x20   def log_message(self, *a): pass\n\
         srv = http.server.HTTPServer(('127.0.0.1', 0), H)\n\
         port = srv.server_address[1]\n\
         pid = os.fork()\n\
         if pid == 0:\n\
         \x20   try: srv.serve_forever(poll_interval=0.05)\n\
         \x20   finally: os._exit(0)\n\
         srv.socket.close()\n\
         lat = []\n\
         for _ in range({requests}):\n\
         \x20   t = time.perf_counter()\n\
         \x20   assert urllib.request.urlopen(f'http://127.0.0.1:{{port}}/').read() == b'ok'\n\
         \x20   lat.append((time.perf_counter() - t) * 1000)\n\
         os.kill(pid, 9); os.waitpid(pid, 0)\n\
         print(' '.join(map(str, lat)))\n"
    );
    let lat = |out: &str| -> Vec<f64> {
        out.lines().next().unwrap_or("").split_whitespace().filter_map(|x| x.parse().ok()).collect()
    };
    let mut sb =
        template.fork(&engine, Limits { network: forkbox_engine::NetConfig::default(), ..Limits::default() })?;
    let r = sb.exec(&code)?;
    anyhow::ensure!(r.error.is_none(), "guest: {:?}\n{}", r.error, r.stderr);
    let glat = lat(&r.stdout);
    let host = std::process::Command::new(host_python()).args(["-c", &code]).output().context("host python3")?;
    anyhow::ensure!(host.status.success(), "host python3: {}", String::from_utf8_lossy(&host.stderr));
    let hlat = lat(&String::from_utf8_lossy(&host.stdout));
    anyhow::ensure!(!glat.is_empty() && !hlat.is_empty(), "no in-sandbox latencies");
    println!(
        "guest: urllib GET of 2 bytes to a server in the sandbox (os.fork child, network: none)   {}",
        summary(glat.clone())
    );
    println!(
        "host:  urllib GET of 2 bytes to a server in an os.fork child                            {}",
        summary(hlat.clone())
    );
    println!("ratio guest/host p50: {:.2}x", med(glat) / med(hlat));
    Ok(ExitCode::SUCCESS)
}

fn host_python_import_numpy() -> Result<f64> {
    let t = Instant::now();
    let st = std::process::Command::new(host_python())
        .args(["-c", "import numpy"])
        .status()
        .context("running the host python3")?;
    anyhow::ensure!(st.success(), "host python3 -c 'import numpy' failed (is python3-numpy installed on the host?)");
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

fn cold(runs: usize, target: &dyn Target) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    println!("image {id}");
    let mut rows: Vec<(&str, Vec<f64>)> = Vec::new();
    for (label, vdso, preload) in [
        ("guest: python ready, no preload        ", true, ""),
        ("guest: python ready + import numpy     ", true, "import numpy"),
        ("guest: + import numpy, no vDSO         ", false, "import numpy"),
    ] {
        let mut engine = Engine::open(&path)?.with_preload(preload);
        if !vdso {
            engine = engine.without_vdso();
        }
        let mut times = Vec::new();
        let mut syscalls = 0;
        for _ in 0..runs {
            let sb = Sandbox::boot(&engine, Limits::default(), false)?;
            times.push(sb.boot_time.as_secs_f64() * 1000.0);
            syscalls = sb.stats().syscalls;
        }
        println!("{label} {}   syscalls/exits {syscalls}", summary(times.clone()));
        rows.push((label, times));
    }
    let mut host = Vec::new();
    for _ in 0..runs {
        host.push(host_python_import_numpy()?);
    }
    println!("host:  python3 -c 'import numpy'         {}", summary(host.clone()));
    let med = |v: &Vec<f64>| {
        let mut v = v.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, 0.5)
    };
    println!("ratio guest(numpy)/host p50: {:.1}x", med(&rows[1].1) / med(&host));
    Ok(ExitCode::SUCCESS)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn p50(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    percentile(&v, 0.5)
}

/// Proportional set size of this process, in KiB.
pub(crate) fn pss_kib() -> u64 {
    field_kib("/proc/self/smaps_rollup", "Pss:")
}

/// Per mapping of this process (`/proc/self/smaps`): start address, what it
/// maps (a path, `[heap]`, `[anon]`...), and its Pss, Private_Dirty and
/// Anonymous in KiB.
fn smaps() -> Vec<(u64, String, [u64; 3])> {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut out: Vec<(u64, String, [u64; 3])> = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((start, _)) = first.split_once('-').filter(|(a, _)| u64::from_str_radix(a, 16).is_ok()) {
            let name = words.nth(4).map_or("[anon]".to_string(), |n| n.to_string());
            out.push((u64::from_str_radix(start, 16).unwrap_or(0), name, [0; 3]));
            continue;
        }
        let slot = match first {
            "Pss:" => 0,
            "Private_Dirty:" => 1,
            "Anonymous:" => 2,
            _ => continue,
        };
        if let Some(m) = out.last_mut() {
            m.2[slot] += words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    out
}

/// With FORKBOX_BENCH_SMAPS set: where the memory of the live forks went,
/// per kind of mapping (growth of Pss, Private_Dirty, Anonymous in KiB, per fork).
fn smaps_growth(before: &[(u64, String, [u64; 3])], after: &[(u64, String, [u64; 3])], n: usize) {
    let mut by: std::collections::BTreeMap<String, ([i64; 3], i64)> = Default::default();
    let old: std::collections::HashMap<(u64, &str), [u64; 3]> =
        before.iter().map(|(a, name, v)| ((*a, name.as_str()), *v)).collect();
    let mut seen = std::collections::HashSet::new();
    for (a, name, v) in after {
        let key = name.trim_end_matches(" (deleted)").to_string();
        let e = by.entry(key).or_default();
        let o = old.get(&(*a, name.as_str())).copied().unwrap_or([0; 3]);
        if seen.insert((*a, name.as_str())) && !old.contains_key(&(*a, name.as_str())) {
            e.1 += 1;
        }
        for ((d, now), was) in e.0.iter_mut().zip(v).zip(o) {
            *d += *now as i64 - was as i64;
        }
    }
    let new: std::collections::HashSet<(u64, &str)> = after.iter().map(|(a, n, _)| (*a, n.as_str())).collect();
    for (a, name, v) in before {
        if !new.contains(&(*a, name.as_str())) {
            let e = by.entry(name.trim_end_matches(" (deleted)").to_string()).or_default();
            e.1 -= 1;
            for (d, was) in e.0.iter_mut().zip(v) {
                *d -= *was as i64;
            }
        }
    }
    let mut rows: Vec<_> = by.into_iter().filter(|(_, (d, c))| d.iter().any(|&x| x != 0) || *c != 0).collect();
    rows.sort_by_key(|(_, (d, _))| -d[0]);
    println!("  smaps growth per fork (KiB): Pss  Private_Dirty  Anonymous  new mappings, by what they map");
    let n = n.max(1) as f64;
    for (name, (d, c)) in rows.iter().take(25) {
        println!("  {:>8.1} {:>8.1} {:>8.1} {:>+6}  {name}", d[0] as f64 / n, d[1] as f64 / n, d[2] as f64 / n, c);
    }
}

/// With FORKBOX_BENCH_SMAPS set: the private pages of a fork after its exec,
/// by the guest mapping they lie in (its /proc/self/maps, read afterwards) and
/// whether they are the host's zero page (read, never written: no memory).
fn private_pages_by_mapping(sb: &mut Sandbox) -> Result<()> {
    let pages = sb.private_page_list();
    let first_pages: Vec<u64> = pages.iter().map(|(a, _)| *a).collect();
    let maps = sb.exec("print(open('/proc/self/maps').read())")?.stdout;
    let ranges: Vec<(u64, u64, String)> = maps
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (a, b) = w.next()?.split_once('-')?;
            let perms = w.next()?;
            let name = w.nth(3).unwrap_or("[anon]");
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?, format!("{perms} {name}")))
        })
        .collect();
    let mut by: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    for (addr, zero) in pages {
        let what = ranges
            .iter()
            .find(|(a, b, _)| (*a..*b).contains(&addr))
            .map_or_else(|| format!("outside the guest's mappings ({})", addr >> 21 << 21), |r| r.2.clone());
        let e = by.entry(what).or_default();
        if zero {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
    }
    if std::env::var("FORKBOX_BENCH_SMAPS").as_deref() == Ok("2") {
        // What lives on each written page (a diagnostic; the exec writes pages of its own).
        let list: Vec<String> = first_pages.iter().map(|a| a.to_string()).collect();
        let code = PAGE_OWNERS.replace("PAGES", &format!("[{}]", list.join(",")));
        let r = sb.exec(&code)?;
        println!("{}{}{:?}", r.stdout, r.stderr, r.error);
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by_key(|(_, (w, _))| std::cmp::Reverse(*w));
    println!("  private pages of one fork after print(1+1): written, zero page, guest mapping");
    for (what, (w, z)) in rows {
        println!("  {w:>6} {z:>6}  {what}");
    }
    Ok(())
}

/// `FORKBOX_BENCH_SMAPS=2`: for each page a fork's `print(1+1)` wrote, the
/// CPython objects on it (reference counts are writes) and whether it is a
/// pymalloc pool's (3.11: 16 KiB pools, the header on the first page).
const PAGE_OWNERS: &str = r#"
import gc, sys, ctypes, collections
pages = set(PAGES)
gc.unfreeze()
objs = gc.get_objects()
seen = set(map(id, objs))
hits = collections.defaultdict(collections.Counter)
def note(o):
    a = id(o) & ~0xfff
    if a in pages:
        t = type(o).__name__
        if t in ("function", "type", "module", "code"):
            t += ":" + str(getattr(o, "__qualname__", getattr(o, "co_qualname", getattr(o, "__name__", ""))))[:40]
        elif t == "dict":
            t += ":%d" % len(o)
        hits[a][t] += 1
for o in objs:
    note(o)
    for r in gc.get_referents(o):
        if id(r) not in seen:
            seen.add(id(r))
            note(r)
def pool(a):
    base = a & ~0x3fff
    try:
        h = ctypes.string_at(base, 48)
    except Exception:
        return ""
    szidx = int.from_bytes(h[36:40], "little")
    nxt = int.from_bytes(h[40:44], "little")
    mx = int.from_bytes(h[44:48], "little")
    if szidx < 32 and mx == 16384 - (szidx + 1) * 16 and nxt <= mx + (szidx+1)*16:
        return "pool sz%d %s" % ((szidx + 1) * 16, "hdr" if a == base else "+%d" % ((a - base) >> 12))
    return ""
summ = collections.Counter()
for a in sorted(pages):
    p = pool(a)
    h = hits.get(a)
    top = ", ".join("%s x%d" % kv for kv in h.most_common(6)) if h else "-"
    print("%x %-16s %s" % (a, p, top))
    summ[p.split(" hdr")[0].split(" +")[0] or "nonpool"] += 1
print(summ.most_common())
"#;

fn field_kib(path: &str, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

const HOST_FORK_BASELINE: &str = r#"
import json, os, sys, time, io, contextlib
import numpy
n = int(sys.argv[1]); times = []
for _ in range(n):
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec("print(1+1)", {"__name__": "__main__"})
        os.write(w, json.dumps({"stdout": buf.getvalue()}).encode())
        os._exit(0)
    os.close(w)
    out = b""
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        out += b
    os.close(r)
    os.waitpid(pid, 0)
    assert json.loads(out)["stdout"] == "2\n"
    times.append((time.perf_counter() - t) * 1000)
print(json.dumps(times))
"#;

fn host_fork_baseline(n: usize) -> Result<Vec<f64>> {
    let out = std::process::Command::new(host_python())
        .args(["-c", HOST_FORK_BASELINE, &n.to_string()])
        .output()
        .context("running the host python3 baseline")?;
    anyhow::ensure!(out.status.success(), "host baseline failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn fork(home: &Path, forks: usize, execs: usize, live: usize, batch: usize, target: &dyn Target) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    let mut engine = Engine::open(&path)?;
    if let Some(p) = std::env::var_os("FORKBOX_BENCH_PRELOAD") {
        engine = engine.with_preload(p.to_string_lossy());
    }
    let t = Instant::now();
    let template = forkbox_engine::Template::ensure(&engine, home)?;
    println!(
        "image {}  template {} ({} pages, ready in {:.0} ms)",
        &id[..12],
        template.info.id,
        template.info.memory_pages,
        ms(t)
    );
    let limits = Limits::default();
    let mode = forkbox_engine::jail::Mode::from_env()?;
    println!("sandbox threads: seccomp {mode:?} (FORKBOX_SECCOMP), as the server's exec threads");

    let (e2e, resets, touched, written, exits) = on_guest_thread(mode, || -> Result<_> {
        // Warm-up (first forks map the template file's page cache).
        for _ in 0..10 {
            template.fork(&engine, limits.clone())?.exec("print(1+1)")?;
        }

        let mut fork_only = Vec::with_capacity(forks);
        for _ in 0..forks {
            let t = Instant::now();
            let sb = template.fork(&engine, limits.clone())?;
            fork_only.push(ms(t));
            drop(sb);
        }
        println!("fork only, recycled VM (ready to run)   {}", summary(fork_only.clone()));
        // Without recycling: every fork gets a new VM (pre-created by the pool
        // thread when it keeps up, else created inline).
        let mut fresh = Vec::with_capacity(forks.min(200));
        let mut keep = Vec::new();
        for _ in 0..forks.min(200) {
            let t = Instant::now();
            let sb = template.fork(&engine, limits.clone())?;
            fresh.push(ms(t));
            keep.push(sb); // held, so nothing is recycled
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(keep);
        println!("fork only, new VM from the pool         {}", summary(fresh));

        let mut e2e = Vec::with_capacity(execs);
        let mut resets = Vec::with_capacity(execs);
        let (mut touched, mut written, mut exits) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..execs {
            let t = Instant::now();
            let mut sb = template.fork(&engine, limits.clone())?;
            let r = sb.exec("print(1+1)")?;
            e2e.push(ms(t));
            anyhow::ensure!(r.stdout == "2\n", "unexpected output {:?}", r.stdout);
            exits.push(r.syscalls as f64);
            let t = Instant::now();
            drop(sb);
            resets.push(ms(t));
        }
        // Pages of a fork on a new VM (a recycled one keeps its pages mapped).
        {
            let mut cold = Vec::new();
            for _ in 0..3 {
                cold.push(template.fork(&engine, limits.clone())?);
            }
            for (i, mut sb) in cold.into_iter().enumerate() {
                sb.exec("print(1+1)")?;
                let fp = sb.memory_footprint();
                touched.push(fp.touched_pages as f64);
                written.push(fp.private_pages as f64);
                if i == 0 && std::env::var_os("FORKBOX_BENCH_SMAPS").is_some() {
                    private_pages_by_mapping(&mut sb)?;
                }
            }
        }
        println!("fork + exec print(1+1), in-process      {}", summary(e2e.clone()));
        let mut warm = Vec::new();
        let mut sb = template.fork(&engine, limits.clone())?;
        sb.exec("print(1+1)")?;
        for _ in 0..execs {
            let t = Instant::now();
            sb.exec("print(1+1)")?;
            warm.push(ms(t));
        }
        drop(sb);
        println!("exec print(1+1) in a warm sandbox       {}", summary(warm));
        Ok((e2e, resets, touched, written, exits))
    })?;
    let st = template.pool_stats();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "VMs: {} recycled, {} from the pool, {} created inline; {} resets copied {} pages and gave {} back to the host",
        load(&st.recycled_hits),
        load(&st.pooled_hits),
        load(&st.created_inline),
        load(&st.resets),
        load(&st.pages_reset),
        load(&st.pages_dropped)
    );
    let host = host_fork_baseline(execs)?;
    println!("host os.fork() + exec + pipe (no VM)     {}", summary(host.clone()));
    println!("ratio forkbox/host p50: {:.2}x", p50(&e2e) / p50(&host));
    match worker_boundary(home, &path, &template, &engine, mode, execs) {
        Ok([inproc, worker, inside, ping]) => {
            println!("fork + exec, in-process (interleaved)   {}", summary(inproc.clone()));
            println!("fork + exec, in a sandbox worker         {}", summary(worker.clone()));
            println!("  of which inside the worker             {}", summary(inside.clone()));
            println!("socket round trip to the worker (ping)  {}", summary(ping));
            println!(
                "process boundary: +{:.3} ms p50 (round trip minus the worker's own fork + exec: +{:.3} ms); ratio to host p50: {:.2}x in-process, {:.2}x in a worker",
                p50(&worker) - p50(&inproc),
                p50(&worker) - p50(&inside),
                p50(&inproc) / p50(&host),
                p50(&worker) / p50(&host)
            );
        }
        Err(e) => println!("fork + exec in a sandbox worker: not measured ({e:#})"),
    }
    println!("reset of a finished fork for reuse (drop) {}", summary(resets));
    println!(
        "per fork+exec (p50): {:.0} pages touched and {:.0} written (private, {:.0} KiB) on a new VM, {:.0} syscall exits",
        p50(&touched),
        p50(&written),
        p50(&written) * 4.0,
        p50(&exits)
    );

    on_guest_thread(mode, || -> Result<()> {
        let diag = std::env::var_os("FORKBOX_BENCH_SMAPS").is_some();
        let maps_before = if diag { smaps() } else { Vec::new() };
        let before = pss_kib();
        let mut held = Vec::with_capacity(live);
        let t = Instant::now();
        // The first live fork also maps template and binary pages this
        // process had not mapped yet (shared, once per process): the growth
        // after it is what each further fork costs.
        let mut after_first = before;
        for i in 0..live {
            let mut sb = template.fork(&engine, limits.clone())?;
            sb.exec("print(1+1)")?;
            held.push(sb);
            if i == 0 {
                after_first = pss_kib();
            }
        }
        let after = pss_kib();
        let further = match live {
            0 | 1 => String::new(),
            n => format!(", {:.0} KiB per further fork", after.saturating_sub(after_first) as f64 / (n - 1) as f64),
        };
        println!(
            "{live} live forks after print(1+1): {:.0} ms to create, PSS +{:.1} MiB = {:.0} KiB per fork{further}",
            ms(t),
            (after.saturating_sub(before)) as f64 / 1024.0,
            after.saturating_sub(before) as f64 / live.max(1) as f64
        );
        if diag {
            smaps_growth(&maps_before, &smaps(), live);
        }
        drop(held);

        let codes: Vec<String> = (0..batch).map(|i| format!("print({i}+1)")).collect();
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        let t = Instant::now();
        let results = engine.exec_batch(&template, &codes, &limits, workers);
        let wall = ms(t);
        let ok = results
            .iter()
            .enumerate()
            .filter(|(i, r)| matches!(r, Ok(r) if r.stdout == format!("{}\n", i + 1)))
            .count();
        println!(
            "{batch} forks x one exec on {workers} threads: {:.2} s wall, {ok}/{batch} correct, peak RSS {:.0} MiB",
            wall / 1000.0,
            field_kib("/proc/self/status", "VmHWM:") as f64 / 1024.0
        );
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The same session operations in this process (`m`, `--isolation thread`)
/// and through a jailed session worker (`--isolation process`), interleaved
/// sample by sample, same run: exec + checkpoint of a resident session, a
/// resume of an evicted one, resume + exec + checkpoint, a small file read (a
/// bare round trip to the sandbox), a throwaway fork of a checkpoint + exec.
fn session_boundary(
    home: &Path,
    image: &Path,
    m: &forkbox_sessions::manager::SessionManager,
    samples: usize,
) -> Result<()> {
    use forkbox_sessions::manager::{Config, SessionManager};
    let loaded = m.template()?;
    let mut wc = forkbox_worker::Config::new(home);
    wc.seccomp = forkbox_engine::jail::Mode::from_env()?;
    if !image.starts_with(home.join("images")) {
        wc.extra_images.push(image.to_path_buf());
    }
    let tref = wc.template_ref(image, &loaded.template.dir)?;
    let workers = std::sync::Arc::new(forkbox_worker::SessionWorkers::start(wc, 0, 4, Some(tref))?);
    let scratch = tempfile::tempdir_in(home).context("creating a scratch directory")?;
    let config = Config { max_resident: 64, ..Config::default() };
    let w = SessionManager::open(loaded.engine.clone(), loaded.template.clone(), scratch.path(), config)?
        .with_host(workers.clone());
    let t = "bench";
    let limits = Limits::default();
    let (a, b) = (m.create(t, Default::default(), &limits)?, w.create(t, Default::default(), &limits)?);
    for (mm, id) in [(m, &a.id), (&w, &b.id)] {
        mm.exec(t, id, "x = 1")?;
        mm.write_file(t, id, "/data/small.txt", b"0123456789")?;
        for i in 0..10 {
            mm.exec(t, id, &format!("x{i} = {i}"))?;
        }
    }
    /// Samples (ms) in this process and through the worker.
    type Ms = [Vec<f64>; 2];
    let (mut exec, mut resume, mut cold, mut read, mut throw) =
        (Ms::default(), Ms::default(), Ms::default(), Ms::default(), Ms::default());
    let (mut inside, mut ck) = (Vec::new(), [Vec::new(), Vec::new()]);
    for i in 0..samples {
        for (k, (mm, id)) in [(m, &a.id), (&w, &b.id)].into_iter().enumerate() {
            let t0 = Instant::now();
            let out = mm.exec(t, id, &format!("y = {i}"))?;
            exec[k].push(ms(t0));
            ck[k].push(ms(t0) - out.result.wall_ms);
            if k == 1 {
                inside.push(out.result.wall_ms);
            }
            let t0 = Instant::now();
            let got = mm.read_file(t, id, "/data/small.txt", 1 << 10)?;
            read[k].push(ms(t0));
            anyhow::ensure!(got == b"0123456789", "read back {got:?}");
            mm.evict(id);
            let t0 = Instant::now();
            mm.resume(t, id)?;
            resume[k].push(ms(t0));
            mm.evict(id);
            let t0 = Instant::now();
            let out = mm.exec(t, id, "x9")?;
            cold[k].push(ms(t0));
            anyhow::ensure!(out.result.value.as_deref() == Some("9"), "a resumed session lost its state");
            let rec = mm.get(t, id)?;
            let t0 = Instant::now();
            let r = mm.exec_throwaway(&rec, rec.head, "x9 + 1", None, None)?;
            throw[k].push(ms(t0));
            anyhow::ensure!(r.value.as_deref() == Some("10"), "throwaway: {:?}", r.value);
        }
    }
    println!("sessions in this process vs in a jailed session worker, interleaved ({samples} samples each):");
    let rows: [(&str, &Ms); 5] = [
        ("exec + checkpoint of a resident session", &exec),
        ("read a 10-byte file (a round trip)     ", &read),
        ("resume of an evicted session (ready)   ", &resume),
        ("resume + exec + checkpoint             ", &cold),
        ("throwaway fork of a checkpoint + exec  ", &throw),
    ];
    for (what, v) in rows {
        println!("  {what} in-process {}", summary(v[0].clone()));
        println!("  {what} worker     {}", summary(v[1].clone()));
        println!("  {what} boundary   {:+.3} ms p50, ratio {:.2}x", p50(&v[1]) - p50(&v[0]), p50(&v[1]) / p50(&v[0]));
    }
    println!(
        "  of an exec + checkpoint through the worker: {:.3} ms the exec inside it (p50), {:.3} ms checkpoint and the rest (in-process: {:.3} ms)",
        p50(&inside),
        p50(&ck[1]),
        p50(&ck[0])
    );
    m.delete(t, &a.id)?;
    running_child(&w, samples)?;
    drop(w);
    // Reaped before the steps after this one measure this process' memory.
    workers.shutdown();
    Ok(())
}

/// Sessions in session workers (children keep running between calls there)
/// with and without one running Python child, interleaved sample by sample:
/// exec + checkpoint (the checkpoint: its total minus the exec's wall time),
/// what the checkpoint wrote, and a fork of the session resumed (ready).
fn running_child(w: &forkbox_sessions::manager::SessionManager, samples: usize) -> Result<()> {
    let t = "bench";
    let limits = Limits::default();
    let (plain, busy) = (w.create(t, Default::default(), &limits)?, w.create(t, Default::default(), &limits)?);
    w.exec(t, &plain.id, "x = 1")?;
    let started = w.exec(
        t,
        &busy.id,
        "import subprocess, sys, time\n\
         child = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.02)'])\n\
         time.sleep(1)",
    )?;
    anyhow::ensure!(started.result.error.is_none(), "starting the child: {:?}", started.result.error);
    type Ms = [Vec<f64>; 2];
    let (mut ck, mut kib, mut fork) = (Ms::default(), Ms::default(), Ms::default());
    for i in 0..samples {
        for (k, id) in [&plain.id, &busy.id].into_iter().enumerate() {
            let t0 = Instant::now();
            let out = w.exec(t, id, &format!("y = {i}"))?;
            ck[k].push(ms(t0) - out.result.wall_ms);
            kib[k].push(out.checkpoint.bytes as f64 / 1024.0);
            let t0 = Instant::now();
            let f = w.fork(t, id, None, Default::default())?;
            w.resume(t, &f.id)?;
            fork[k].push(ms(t0));
            w.delete(t, &f.id)?;
        }
    }
    let alive = w.exec(t, &busy.id, "child.poll() is None")?;
    anyhow::ensure!(
        alive.result.value.as_deref() == Some("True"),
        "the child is gone: {:?} {:?}",
        alive.result.value,
        alive.result.error
    );
    println!(
        "sessions in session workers with one running Python child vs none, interleaved ({samples} samples each):"
    );
    for (what, v) in [("exec's checkpoint (total - exec wall)", &ck), ("fork of the session, resumed (ready)", &fork)] {
        println!("  {what}  no child   {}", summary(v[0].clone()));
        println!("  {what}  one child  {}", summary(v[1].clone()));
    }
    println!("  checkpoint on disk p50: {:.1} KiB without a child, {:.1} KiB with one", p50(&kib[0]), p50(&kib[1]));
    w.exec(t, &busy.id, "child.kill(); child.wait()")?;
    w.delete(t, &plain.id)?;
    w.delete(t, &busy.id)?;
    Ok(())
}

/// Run `f` on a new thread under the guest-thread seccomp filter in `mode`
/// (what the server's exec threads run under), and wait for it.
/// Fork + exec in-process and through one jailed sandbox worker process
/// (`forkbox_worker`, as `serve --isolation process` runs one-shot execs),
/// interleaved sample by sample: (in-process, worker round trip, the worker's
/// own fork + exec time, a bare socket round trip), ms.
fn worker_boundary(
    home: &Path,
    image: &Path,
    template: &forkbox_engine::Template,
    engine: &Engine,
    mode: forkbox_engine::jail::Mode,
    n: usize,
) -> Result<[Vec<f64>; 4]> {
    let mut wc = forkbox_worker::Config::new(home);
    wc.seccomp = mode;
    if !image.starts_with(home.join("images")) {
        wc.extra_images.push(image.to_path_buf());
    }
    let tref = wc.template_ref(image, &template.dir)?;
    let workers = forkbox_worker::Workers::start(wc, 1, Some(tref.clone()))?;
    let limits = Limits::default();
    let measured = on_guest_thread(mode, || -> Result<_> {
        let remote = |code: &str| -> Result<(f64, f64)> {
            let t = Instant::now();
            let r = workers.exec(0, &tref, code, &limits, None)?;
            let rtt = ms(t);
            let out = r.result.map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
            anyhow::ensure!(out.stdout == "2\n", "unexpected output {:?}", out.stdout);
            Ok((rtt, r.fork_ms + r.exec_ms))
        };
        for _ in 0..10 {
            template.fork(engine, limits.clone())?.exec("print(1+1)")?;
            remote("print(1+1)")?;
        }
        let (mut inproc, mut worker, mut inside, mut ping) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n {
            let t = Instant::now();
            let mut sb = template.fork(engine, limits.clone())?;
            sb.exec("print(1+1)")?;
            inproc.push(ms(t));
            drop(sb);
            // (After the in-process sample: the worker has finished its previous drop.)
            let t = Instant::now();
            workers.ping(0)?;
            ping.push(ms(t));
            let (rtt, own) = remote("print(1+1)")?;
            worker.push(rtt);
            inside.push(own);
        }
        Ok([inproc, worker, inside, ping])
    });
    // Gone before the next step measures this process' PSS: a worker that
    // exits during it hands this process its share of the binary's and the
    // template's pages (~5 MiB here), which read as memory of the live forks.
    workers.shutdown();
    measured
}

pub(crate) fn on_guest_thread<T: Send>(
    mode: forkbox_engine::jail::Mode,
    f: impl FnOnce() -> Result<T> + Send,
) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || -> Result<T> {
            forkbox_engine::jail::enter_guest_thread(mode)?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the bench thread panicked"))?
    })
}

/// Thread start + join, a thread pool map, an empty asyncio.run, a 1 MB pipe
/// round trip, GIL contention and 40 threads doing I/O, timed inside Python (ms per operation); the same code runs
/// in the guest and in a host fork child.
const THREAD_BENCH: &str = r#"
import asyncio, json, os, threading, time
from concurrent.futures import ThreadPoolExecutor
def _pipe_round_trip(data):
    # 1 MB through a pipe and back: a thread echoes what it reads from one pipe into another.
    r1, w1 = os.pipe(); r2, w2 = os.pipe()
    def echo():
        left = len(data)
        while left:
            b = os.read(r1, 1 << 16)
            os.write(w2, b)
            left -= len(b)
    t = threading.Thread(target=echo); t.start()
    got = bytearray()
    view = memoryview(data)
    sent = 0
    while sent < len(data):
        sent += os.write(w1, view[sent:sent + (1 << 16)])
        while len(got) < sent - (1 << 17):
            got += os.read(r2, 1 << 16)
    while len(got) < len(data):
        got += os.read(r2, 1 << 16)
    t.join()
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    assert got == data
def _gil_contention():
    # Three threads counting under a 1 us switch interval (as CPython's own
    # test_lru_cache_threaded runs): the GIL is asked for at every wait.
    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work():
            x = 0
            for i in range(20000):
                x += i
        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts: t.start()
        for t in ts: t.join()
    finally:
        sys.setswitchinterval(old)
def _daemon_io(k):
    # CPython's ThreadJoinOnShutdown.test_4_daemon_threads: k threads looping
    # over open/read/write and random sleeps under 0.5 ms; the time until every
    # one has done a round (they are then stopped and joined, not timed).
    import random
    stop = threading.Event()
    ran = set()
    src = os.__file__
    def loop():
        while not stop.is_set():
            with open(src, "rb") as f:
                stuff = f.read(200)
                with open(os.devnull, "wb") as null:
                    null.write(stuff)
                    time.sleep(random.random() / 1995)
            ran.add(threading.get_ident())
    t0 = time.perf_counter()
    ts = [threading.Thread(target=loop, daemon=True) for _ in range(k)]
    for t in ts: t.start()
    while len(ran) < k:
        time.sleep(0.001)
    took = (time.perf_counter() - t0) * 1000
    stop.set()
    for t in ts: t.join()
    return took
def _thread_bench(n):
    out = {"start_join": [], "pool": [], "asyncio": [], "pipe": [], "gil": [], "daemon": []}
    data = os.urandom(1 << 20)
    for _ in range(n):
        t0 = time.perf_counter()
        asyncio.run(asyncio.sleep(0))
        out["asyncio"].append((time.perf_counter() - t0) * 1000)
    for _ in range(max(1, n // 10)):
        t0 = time.perf_counter()
        _pipe_round_trip(data)
        out["pipe"].append((time.perf_counter() - t0) * 1000)
    for _ in range(max(1, n // 10)):
        t0 = time.perf_counter()
        _gil_contention()
        out["gil"].append((time.perf_counter() - t0) * 1000)
    for _ in range(max(1, n // 40)):
        out["daemon"].append(_daemon_io(40))
    for _ in range(n):
        t0 = time.perf_counter()
        t = threading.Thread(target=lambda: None)
        t.start(); t.join()
        out["start_join"].append((time.perf_counter() - t0) * 1000)
    for _ in range(n):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            r = list(ex.map(lambda x: x + 1, range(64)))
        assert r == list(range(1, 65))
        out["pool"].append((time.perf_counter() - t0) * 1000)
    return json.dumps(out)
"#;

fn host_thread_baseline(n: usize) -> Result<serde_json::Value> {
    let code = format!(
        "{THREAD_BENCH}\nimport os, sys\nr, w = os.pipe()\npid = os.fork()\nif pid == 0:\n    os.close(r)\n    os.write(w, _thread_bench({n}).encode())\n    os._exit(0)\nos.close(w)\nout = b''\nwhile True:\n    b = os.read(r, 1 << 20)\n    if not b: break\n    out += b\nos.waitpid(pid, 0)\nsys.stdout.write(out.decode())\n"
    );
    let out = std::process::Command::new(host_python())
        .args(["-c", &code])
        .output()
        .context("running the host python3 baseline")?;
    anyhow::ensure!(out.status.success(), "host baseline failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn threads(home: &Path, samples: usize, target: &dyn Target) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    let engine = Engine::open(&path)?;
    let template = forkbox_engine::Template::ensure(&engine, home)?;
    println!("image {}  template {}", &id[..12], template.info.id);
    let limits = Limits { timeout: std::time::Duration::from_secs(600), ..Limits::default() };
    let mut sb = template.fork(&engine, limits)?;
    sb.exec(THREAD_BENCH)?;
    // Warm-up.
    sb.exec("_thread_bench(5)")?;
    let r = sb.exec(&format!("_thread_bench({samples})"))?;
    if let Some(e) = &r.error {
        anyhow::bail!("the guest bench failed: {}: {}", e.kind, e.message);
    }
    let repr = r.value.context("no result from the guest bench")?;
    let guest: serde_json::Value = serde_json::from_str(repr.trim_matches('\''))?;
    let host = host_thread_baseline(samples)?;
    let col = |v: &serde_json::Value, k: &str| -> Vec<f64> {
        v[k].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
    };
    for (k, what) in [
        ("start_join", "thread start + join"),
        ("pool", "ThreadPoolExecutor(8).map, 64 tasks"),
        ("asyncio", "asyncio.run(asyncio.sleep(0))"),
        ("pipe", "1 MB pipe round trip (echo thread)"),
        ("gil", "3 threads, switch interval 1 us"),
        ("daemon", "40 threads doing I/O, until each ran"),
    ] {
        let (g, h) = (col(&guest, k), col(&host, k));
        println!("{what:<38} guest {}", summary(g.clone()));
        println!("{:<38} host  {}", "  (host python3, os.fork child)", summary(h.clone()));
        println!("{:<38} ratio guest/host p50: {:.1}x", "", p50(&g) / p50(&h).max(1e-9));
    }
    println!("guest syscalls during the measured exec: {}", r.syscalls);
    Ok(ExitCode::SUCCESS)
}

/// The process measurements, run by the guest and by a forked host Python alike:
/// `_proc_bench(n)` is JSON `{name: [ms, ...] | {"error": "..."}}`.
const PROC_BENCH: &str = r#"
def _proc_task(x):
    return x * x

def _proc_bench(n, which=("true", "python", "fork", "pool")):
    import json, os, subprocess, sys, time
    out = {}
    def measure(name, k, f):
        times = []
        try:
            for _ in range(k):
                t = time.perf_counter()
                f()
                times.append((time.perf_counter() - t) * 1000)
            out[name] = times
        except BaseException as e:
            out[name] = {"error": "%s: %s" % (type(e).__name__, e)}
    def true():
        assert subprocess.run(["true"]).returncode == 0
    def python():
        assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    def fork():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0) == (pid, 0)
    def pool():
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(2) as p:
            assert p.map(_proc_task, range(100)) == [x * x for x in range(100)]
    for name, k, f in (("true", n, true), ("python", min(n, 20), python), ("fork", n, fork), ("pool", min(n, 10), pool)):
        if name in which:
            measure(name, 2, f)  # warm-up: the first children pay their VMs' first touches
            measure(name, k, f)
    return json.dumps(out)
"#;

fn host_proc_baseline(n: usize) -> Result<serde_json::Value> {
    let code = format!(
        "{PROC_BENCH}\nimport os, sys\nr, w = os.pipe()\npid = os.fork()\nif pid == 0:\n    os.close(r)\n    os.write(w, _proc_bench({n}).encode())\n    os._exit(0)\nos.close(w)\nout = b''\nwhile True:\n    b = os.read(r, 1 << 20)\n    if not b: break\n    out += b\nos.waitpid(pid, 0)\nsys.stdout.write(out.decode())\n"
    );
    let out = std::process::Command::new(host_python())
        .args(["-c", &code])
        .output()
        .context("running the host python3 baseline")?;
    anyhow::ensure!(out.status.success(), "host baseline failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn procs(samples: usize, target: &dyn Target) -> Result<ExitCode> {
    // Through the runtime (the path `forkbox run` and the server take: exec workers, the
    // runtime's engine and VM pool), on the local data directory.
    let api = target.api()?;
    println!("{}", api.target());
    // Each measurement in one exec of its own fresh fork: a hang or failure of one (the
    // exec's time limit) is reported as that one's failure, the others still run.
    let mut guest = serde_json::Map::new();
    for (name, secs) in [("true", 300.0), ("python", 300.0), ("fork", 300.0), ("pool", 120.0)] {
        let code = format!("{PROC_BENCH}\n_proc_bench({samples}, ({name:?},))");
        let v = match block_on(&*api, api.client().exec(&code, Some(secs))) {
            Ok(r) => match (&r.error, &r.value) {
                (Some(e), _) => serde_json::json!({ "error": format!("{}: {}", e.kind, e.message) }),
                (None, Some(v)) => serde_json::from_str::<serde_json::Value>(v.trim_matches('\''))?[name].clone(),
                (None, None) => serde_json::json!({ "error": "no result" }),
            },
            Err(e) => serde_json::json!({ "error": format!("the sandbox failed: {e}") }),
        };
        guest.insert(name.to_string(), v);
    }
    let guest = serde_json::Value::Object(guest);
    let host = host_proc_baseline(samples)?;
    let col = |v: &serde_json::Value, k: &str| -> Result<Vec<f64>, String> {
        let v = v.get(k).cloned().unwrap_or_default();
        match v.as_array() {
            Some(a) => Ok(a.iter().filter_map(|x| x.as_f64()).collect()),
            None => Err(v["error"].as_str().unwrap_or("no result").to_string()),
        }
    };
    let mut failed = false;
    for (k, what) in [
        ("true", "subprocess.run(['true'])"),
        ("python", "subprocess.run([python, '-c', 'pass'])"),
        ("fork", "os.fork() + os._exit(0) + waitpid"),
        ("pool", "multiprocessing.Pool(2).map, 100 tasks"),
    ] {
        let (g, h) = (col(&guest, k), col(&host, k));
        match &g {
            Ok(g) => println!("{what:<40} guest {}", summary(g.clone())),
            Err(e) => {
                failed = true;
                println!("{what:<40} guest FAILED: {e}");
            }
        }
        match &h {
            Ok(h) => println!("{:<40} host  {}", "  (host python3, os.fork child)", summary(h.clone())),
            Err(e) => println!("{:<40} host  FAILED: {e}", "  (host python3, os.fork child)"),
        }
        if let (Ok(g), Ok(h)) = (&g, &h) {
            println!("{:<40} ratio guest/host p50: {:.1}x", "", p50(g) / p50(h).max(1e-9));
        }
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// `bench objects`: one session's exec + checkpoint, local directory vs object store
/// (and, with a database, SQLite vs PostgreSQL metadata), interleaved in one run.
fn objects(home: &Path, url: &str, database: Option<&str>, samples: usize, target: &dyn Target) -> Result<ExitCode> {
    use forkbox_sessions::manager::{Config, SessionManager};
    use forkbox_sessions::objects::ObjectsConfig;
    let (path, _) = target.image()?;
    let engine = std::sync::Arc::new(Engine::open(&path)?);
    let template = std::sync::Arc::new(forkbox_engine::Template::ensure(&engine, home)?);
    let t = "bench";
    let limits = Limits::default();
    // (label, database, object store): each its own data directory, database and prefix.
    let mut variants: Vec<(&str, Option<String>, Option<ObjectsConfig>)> = vec![
        ("SQLite + local directory        ", None, None),
        ("SQLite + --objects              ", None, Some(ObjectsConfig::new(url))),
    ];
    let mut scratch_dbs = Vec::new();
    if let Some(db) = database {
        for (label, name, objects) in [
            ("PostgreSQL + local directory    ", "forkbox_bench_local", None),
            (
                "PostgreSQL + --objects          ",
                "forkbox_bench_objects",
                Some(ObjectsConfig::new(format!("{url}/pg"))),
            ),
        ] {
            let scratch = forkbox_sessions::db::scratch_database(db, name).context("--database: a scratch database")?;
            scratch_dbs.push(name);
            variants.push((label, Some(scratch), objects));
        }
    }
    let mut managers = Vec::new();
    for (label, database, objects) in variants {
        let scratch = tempfile::tempdir_in(home).context("creating a scratch directory")?;
        let has_objects = objects.is_some();
        let config = Config { objects, database, ..Config::default() };
        let m = SessionManager::open(engine.clone(), template.clone(), scratch.path(), config)?;
        let s = m.create(t, Default::default(), &limits)?;
        m.exec(t, &s.id, "n = 0\nbuf = bytearray(4096 * 100)")?;
        managers.push((label, has_objects, scratch, m, s.id));
    }
    // Interleaved, so all see the same machine.
    let code = "n += 1\nfor i in range(10):\n    buf[i * 4096] = n % 256\nn";
    let mut times = vec![Vec::new(); managers.len()];
    for _ in 0..samples {
        for (i, (_, _, _, m, id)) in managers.iter().enumerate() {
            let t0 = Instant::now();
            m.exec(t, id, code)?;
            times[i].push(ms(t0));
        }
    }
    println!("session exec + checkpoint (`n += 1`, 10 pages written), same run:");
    for ((label, ..), times) in managers.iter().zip(times) {
        println!("  {label}{}", summary(times));
    }
    // Resume with a cold local cache: every file of the session from the bucket
    // (its chain merged into a flat layer, as the server's upkeep does).
    for (label, has_objects, scratch, m, id) in &managers {
        if !has_objects {
            continue;
        }
        m.compact_session(t, id)?;
        let layers = scratch.path().join("sessions").join("layers");
        let (mut cold, mut warm) = (Vec::new(), Vec::new());
        for _ in 0..samples.min(50) {
            m.evict(id);
            for e in std::fs::read_dir(&layers)?.flatten() {
                std::fs::remove_file(e.path())?;
            }
            let t0 = Instant::now();
            m.resume(t, id)?;
            cold.push(ms(t0));
            m.evict(id);
            let t0 = Instant::now();
            m.resume(t, id)?;
            warm.push(ms(t0));
        }
        let stats = m.object_stats().unwrap_or_default();
        println!("{}:", label.trim_end());
        println!("  resume of an evicted session, cold local cache (from the bucket) {}", summary(cold));
        println!("  resume of an evicted session, warm local cache                  {}", summary(warm));
        println!(
            "  objects: {} uploads ({:.1} MiB), {} fetches ({:.1} MiB)",
            stats.uploads,
            stats.uploaded_bytes as f64 / (1 << 20) as f64,
            stats.fetches,
            stats.fetched_bytes as f64 / (1 << 20) as f64
        );
    }
    for (_, _, _, m, id) in &managers {
        m.delete(t, id)?;
    }
    drop(managers);
    if let Some(db) = database {
        for name in scratch_dbs {
            forkbox_sessions::db::drop_database(db, name).context("dropping a scratch database")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn sessions(home: &Path, samples: usize, resident: usize, on_disk: usize, target: &dyn Target) -> Result<ExitCode> {
    use forkbox_sessions::manager::{Config, SessionManager};
    let (path, _) = target.image()?;
    let engine = std::sync::Arc::new(Engine::open(&path)?);
    let template = std::sync::Arc::new(forkbox_engine::Template::ensure(&engine, home)?);
    // A scratch data directory for the sessions (the template is shared).
    let scratch = tempfile::tempdir_in(home).context("creating a scratch directory")?;
    let config = Config { max_resident: resident + 16, ..Config::default() };
    let m = SessionManager::open(engine, template, scratch.path(), config)?;
    let t = "bench";
    let limits = Limits::default();
    let layers = scratch.path().join("sessions").join("layers");
    match session_boundary(home, &path, &m, samples) {
        Ok(()) => {}
        Err(e) => println!("sessions in session workers: not measured ({e:#})"),
    }

    // Checkpoint cost vs pages dirtied.
    let s = m.create(t, Default::default(), &limits)?;
    m.exec(t, &s.id, "buf = bytearray(4096 * 3000)")?;
    println!("checkpoint cost (exec that writes N pages of a buffer; the interpreter itself dirties ~250 more):");
    for n in [10usize, 100, 1000] {
        let code = format!("for i in range({n}):\n    buf[i * 4096] = (buf[i * 4096] + 1) % 256");
        let (mut ck, mut bytes, mut pages) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..samples {
            let t0 = Instant::now();
            let out = m.exec(t, &s.id, &code)?;
            ck.push(ms(t0) - out.result.wall_ms);
            bytes.push(out.checkpoint.bytes as f64);
            pages.push(out.checkpoint.pages as f64);
            m.compact(out.checkpoint.id)?;
        }
        println!(
            "  N={n:<5} checkpoint {}   {:.0} pages, {:.1} KiB on disk (p50)",
            summary(ck),
            p50(&pages),
            p50(&bytes) / 1024.0
        );
    }

    // Disk per session after 10 small execs.
    let before = dir_bytes(&layers);
    let s2 = m.create(t, Default::default(), &limits)?;
    for i in 0..10 {
        let out = m.exec(t, &s2.id, &format!("x{i} = {i} * 2"))?;
        m.compact(out.checkpoint.id)?;
    }
    println!("disk per session after 10 small execs: {:.0} KiB", (dir_bytes(&layers) - before) as f64 / 1024.0);

    // Resume of an evicted session, and resume + exec.
    let (mut resume, mut resume_exec) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        m.evict(&s2.id);
        let t0 = Instant::now();
        m.resume(t, &s2.id)?;
        resume.push(ms(t0));
        m.evict(&s2.id);
        let t0 = Instant::now();
        let out = m.exec(t, &s2.id, "x9")?;
        resume_exec.push(ms(t0));
        anyhow::ensure!(out.result.value.as_deref() == Some("18"), "resumed session lost its state");
    }
    println!("resume of an evicted session (ready)    {}", summary(resume));
    println!("resume + exec + checkpoint              {}", summary(resume_exec));

    // Fork of an idle session's checkpoint (the source keeps running).
    let mut forks = Vec::new();
    let mut forked = Vec::new();
    for _ in 0..samples {
        let t0 = Instant::now();
        let f = m.fork(t, &s2.id, Some(5), Default::default())?;
        forks.push(ms(t0));
        forked.push(f.id);
    }
    println!("fork of a checkpoint into a new session {}", summary(forks));
    let first = m.exec(t, &forked[0], "x4, 'x9' in globals()")?;
    anyhow::ensure!(
        first.result.value.as_deref() == Some("(8, False)"),
        "fork is not at checkpoint 5: {:?}",
        first.result.value
    );
    for f in &forked {
        m.delete(t, f)?;
    }

    // Many sessions resident at once.
    let pss0 = pss_kib();
    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(resident);
    for i in 0..resident {
        let s = m.create(t, Default::default(), &limits)?;
        m.exec(t, &s.id, &format!("n = {i}"))?;
        ids.push(s.id);
    }
    println!(
        "{resident} resident sessions: created in {:.1} s, PSS +{:.0} MiB ({:.0} KiB each), {} resident",
        ms(t0) / 1000.0,
        pss_kib().saturating_sub(pss0) as f64 / 1024.0,
        pss_kib().saturating_sub(pss0) as f64 / resident.max(1) as f64,
        m.resident_count()
    );
    for id in &ids {
        m.evict(id);
    }

    // Many sessions on disk: forks of one checkpoint, each with an exec of its own.
    let base = m.create(t, Default::default(), &limits)?;
    m.exec(t, &base.id, "import json; data = list(range(1000))")?;
    let disk0 = dir_bytes(&layers);
    let t0 = Instant::now();
    for i in 0..on_disk {
        let f = m.fork(t, &base.id, None, Default::default())?;
        if i < 100 || i % 100 == 0 {
            m.exec(t, &f.id, &format!("k = {i}"))?;
            m.evict(&f.id);
        }
    }
    let execd = on_disk.min(100) + on_disk.saturating_sub(100) / 100;
    println!(
        "{on_disk} sessions on disk ({execd} with an exec of their own): {:.1} s, {:.1} MiB of layers, database {:.1} MiB",
        ms(t0) / 1000.0,
        (dir_bytes(&layers) - disk0) as f64 / (1 << 20) as f64,
        std::fs::metadata(scratch.path().join("sessions").join("sessions.db")).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64
    );
    Ok(ExitCode::SUCCESS)
}
