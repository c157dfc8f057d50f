//! `forkbox bench ...`: measurements quoted in the README.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Subcommand;
use forkbox_engine::{Engine, Limits, Sandbox};

use crate::ImageArgs;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cold start: process start to agent ready (python + numpy) in the guest,
    /// beside `python3 -c 'import numpy'` on the host.
    Cold {
        /// Number of runs.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        #[command(flatten)]
        image: ImageArgs,
    },
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summary(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.total_cmp(b));
    format!("p50 {:8.1} ms   p99 {:8.1} ms   (n={})", percentile(&v, 0.5), percentile(&v, 0.99), v.len())
}

pub fn bench(home: &Path, cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Cold { runs, image } => cold(home, runs.max(1), &image),
    }
}

fn host_python_import_numpy() -> Result<f64> {
    let t = Instant::now();
    let st = std::process::Command::new("/usr/bin/python3")
        .args(["-c", "import numpy"])
        .status()
        .context("running the host's /usr/bin/python3")?;
    anyhow::ensure!(st.success(), "host python3 -c 'import numpy' failed (is python3-numpy installed on the host?)");
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

fn cold(home: &Path, runs: usize, image: &ImageArgs) -> Result<ExitCode> {
    let (path, id) = crate::run::ensure_image(home, image, false)?;
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
