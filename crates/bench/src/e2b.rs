//! `forkbox bench e2b`: E2B's Python SDK against forkbox's E2B API beside forkbox's own
//! Python SDK doing the same, on one `forkbox serve` on loopback, in one run: create +
//! first `run_code("1+1")` (time to interactive), `run_code` in a warm sandbox,
//! `commands.run("true")`, `files.write` + `read` of 1 KB, `fork(count=N)`. The clients
//! are a Python program (e2b.py) run by a Python that has both SDKs.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};

use crate::{summary, Target};

const CLIENT: &str = include_str!("e2b.py");

/// The Python that runs the clients: `--python`, else `$FORKBOX_BENCH_PYTHON`, else python3.
fn python(arg: Option<&Path>) -> PathBuf {
    arg.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("FORKBOX_BENCH_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| "python3".into())
}

pub fn e2b(home: &Path, samples: usize, forks: usize, py: Option<&Path>, target: &dyn Target) -> Result<ExitCode> {
    let py = python(py);
    let ok = Command::new(&py)
        .args(["-c", "import e2b_code_interpreter, forkbox"])
        .output()
        .is_ok_and(|o| o.status.success());
    anyhow::ensure!(
        ok,
        "{} cannot import e2b_code_interpreter and forkbox: pass --python (or set FORKBOX_BENCH_PYTHON) to a Python \
         with both (pip install e2b-code-interpreter==2.11.5 ./sdk/python; the test venv target/pyvenv has them)",
        py.display()
    );
    let (path, id) = target.image()?;
    let engine = forkbox_engine::Engine::open(&path)?;
    forkbox_engine::Template::ensure(&engine, home)?;
    let exe: PathBuf = std::env::current_exe()?;
    let slots = std::thread::available_parallelism().map_or(2, |n| n.get()) * 2;
    let server = crate::http::start(&exe, home, &path, "process", slots)?;
    println!("image {}, one server (isolation process); {samples} samples, forks of {forks}", &id[..12]);
    let out = Command::new(&py)
        .args(["-c", CLIENT, &samples.to_string(), &forks.to_string(), "python"])
        .env("FORKBOX_BENCH_URL", &server.url)
        .env("FORKBOX_BENCH_KEY", &server.key)
        .output()
        .with_context(|| format!("running {}", py.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "the bench's Python clients failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<(String, serde_json::Value)> =
        serde_json::from_str(text.lines().last().unwrap_or_default()).context("reading the clients' figures")?;
    let samples_of = |op: &serde_json::Value, side: &str| -> Vec<f64> {
        op[side].as_array().map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect()).unwrap_or_default()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        crate::percentile(&v, 0.5)
    };
    for (name, op) in &v {
        let (e, f) = (samples_of(op, "e2b"), samples_of(op, "forkbox"));
        let ratio = median(e.clone()) / median(f.clone());
        println!("{name}");
        println!("  E2B SDK      {}", summary(e));
        println!("  forkbox SDK  {}", summary(f));
        println!("  E2B / forkbox p50: {ratio:.2}x");
    }
    Ok(ExitCode::SUCCESS)
}
