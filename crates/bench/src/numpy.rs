//! `forkbox bench numpy`: forkd's published benchmark, "N sandboxes each
//! running `import numpy`": the wall time to have all N live (each ran its
//! `import numpy`) and the host memory (PSS) each adds, beside the host in
//! the same run: N `python3 -c "import numpy"` processes one after another,
//! and N `os.fork()` children of a host python that imported numpy, each
//! running `import numpy` and staying alive (no isolation at all).

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use forkbox_engine::{Engine, Limits};

use crate::{host_python, on_guest_thread, pss_kib, summary, Target};

/// The host's forks: `n` children of a python with numpy imported, each
/// running `import numpy` and then waiting; their PSS summed while all live.
const HOST_FORKS: &str = r#"
import json, os, sys, time
import numpy
n = int(sys.argv[1])
t = time.perf_counter()
kids = []
go_r, go_w = os.pipe()
for _ in range(n):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        exec("import numpy", {"__name__": "__main__"})
        os.write(w, b"1")
        os.read(go_r, 1)
        os._exit(0)
    os.close(w)
    kids.append((pid, r))
for pid, r in kids:
    assert os.read(r, 1) == b"1"
wall = (time.perf_counter() - t) * 1000
def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0
total = sum(pss(pid) for pid, _ in kids)
os.close(go_r)
os.close(go_w)
for pid, r in kids:
    os.close(r)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"wall_ms": wall, "pss_kib": total}))
"#;

/// Median, min and max of KiB figures.
fn kib(v: &[f64]) -> String {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    format!(
        "p50 {:7.0} KiB  min {:7.0} KiB  max {:7.0} KiB  (n={})",
        crate::percentile(&v, 0.5),
        v.first().copied().unwrap_or(f64::NAN),
        v.last().copied().unwrap_or(f64::NAN),
        v.len()
    )
}

pub fn numpy(home: &Path, count: usize, rounds: usize, target: &dyn Target) -> Result<ExitCode> {
    let (path, id) = target.image()?;
    let engine = Engine::open(&path)?;
    let template = forkbox_engine::Template::ensure(&engine, home)?;
    println!(
        "image {}  template {} (numpy imported when the template was made, as forkd's warm template); {count} sandboxes, {rounds} rounds",
        &id[..12],
        template.info.id
    );
    let limits = Limits::default();
    let mode = forkbox_engine::jail::Mode::from_env()?;
    let (mut guest_wall, mut guest_kib) = (Vec::new(), Vec::new());
    let (mut host_wall, mut fork_wall, mut fork_kib) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (wall, kib) = on_guest_thread(mode, || -> Result<(f64, f64)> {
            for _ in 0..5 {
                template.fork(&engine, limits.clone())?.exec("import numpy")?;
            }
            let before = pss_kib();
            let t = Instant::now();
            let mut live = Vec::with_capacity(count);
            for _ in 0..count {
                let mut sb = template.fork(&engine, limits.clone())?;
                let r = sb.exec("import numpy")?;
                anyhow::ensure!(r.error.is_none(), "import numpy failed in a sandbox: {:?}", r.error);
                live.push(sb);
            }
            let wall = t.elapsed().as_secs_f64() * 1000.0;
            let kib = pss_kib().saturating_sub(before) as f64 / count.max(1) as f64;
            drop(live);
            Ok((wall, kib))
        })?;
        guest_wall.push(wall);
        guest_kib.push(kib);

        let t = Instant::now();
        for _ in 0..count {
            let st = std::process::Command::new(host_python())
                .args(["-c", "import numpy"])
                .status()
                .context("running the host python3")?;
            anyhow::ensure!(st.success(), "host python3 -c 'import numpy' failed");
        }
        host_wall.push(t.elapsed().as_secs_f64() * 1000.0);

        let out = std::process::Command::new(host_python())
            .args(["-c", HOST_FORKS, &count.to_string()])
            .output()
            .context("running the host python3 fork baseline")?;
        anyhow::ensure!(out.status.success(), "host fork baseline: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        fork_wall.push(v["wall_ms"].as_f64().unwrap_or(0.0));
        fork_kib.push(v["pss_kib"].as_f64().unwrap_or(0.0) / count.max(1) as f64);
        println!(
            "round {round}: forkbox {wall:.0} ms, {kib:.0} KiB each; host python3 -c x{count} {:.0} ms; host forks {:.0} ms, {:.0} KiB each",
            host_wall[round], fork_wall[round], fork_kib[round]
        );
    }
    println!("{count} forkbox sandboxes, each `import numpy`, all live   wall {}", summary(guest_wall.clone()));
    println!("  host memory (PSS) per sandbox                      {}", kib(&guest_kib));
    println!("{count} host `python3 -c \"import numpy\"`, one by one     wall {}", summary(host_wall.clone()));
    println!("{count} host os.fork() children (numpy imported), live wall {}", summary(fork_wall.clone()));
    println!("  PSS per host child                                 {}", kib(&fork_kib));
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        crate::percentile(&v, 0.5)
    };
    println!(
        "wall p50: forkbox / python3 -c = {:.3}x, forkbox / host forks = {:.2}x; memory per sandbox {:.2} MiB (host fork child {:.2} MiB)",
        med(&guest_wall) / med(&host_wall),
        med(&guest_wall) / med(&fork_wall),
        med(&guest_kib) / 1024.0,
        med(&fork_kib) / 1024.0
    );
    Ok(ExitCode::SUCCESS)
}
