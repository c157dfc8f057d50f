//! `forkbox run`: build the image if needed, boot a sandbox, exec, print.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use forkbox_engine::{Engine, ExecOptions, ExecResult, Limits, Sandbox, Stream, Template};
use forkbox_image::BuildOptions;

use crate::ImageArgs;

#[derive(Args)]
pub struct RunArgs {
    /// Python code to run; `-` reads it from standard input.
    pub code: Option<String>,
    /// Read the code from this file.
    #[arg(long, short = 'f', conflicts_with = "code")]
    pub file: Option<PathBuf>,
    /// Wall-clock limit for the code, in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
    /// Guest memory limit, in MiB.
    #[arg(long, default_value_t = 2048)]
    pub memory_mb: u64,
    /// Captured output limit per stream, in KiB.
    #[arg(long, default_value_t = 1024)]
    pub output_kb: usize,
    /// Code the guest runs before it is ready (the template's warm state).
    #[arg(long, default_value = "import numpy")]
    pub preload: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Log every syscall the code makes (with --cold: also the interpreter's start-up) and list the partial,
    /// refused and unimplemented ones it made, with what works and what does not.
    #[arg(long)]
    pub trace_syscalls: bool,
    /// Run without the vDSO (every clock read becomes a VM exit).
    #[arg(long)]
    pub no_vdso: bool,
    /// Boot a fresh interpreter instead of forking the cached template.
    #[arg(long)]
    pub cold: bool,
    #[command(flatten)]
    pub image: ImageArgs,
}

/// The image to use: `--image`, else the default image (plus `--apt` packages), built if missing.
pub fn ensure_image(home: &Path, args: &ImageArgs, progress: bool) -> Result<(PathBuf, String)> {
    if let Some(p) = &args.image {
        let img = forkbox_image::Image::open(p).with_context(|| format!("opening image {}", p.display()))?;
        return Ok((p.clone(), img.id().to_string()));
    }
    let mut spec = forkbox_engine::default_image_spec();
    spec.packages.extend(args.apt.iter().cloned());
    spec.blas = args.blas;
    let built = forkbox_image::build(&spec, &BuildOptions { home: home.to_path_buf(), progress })
        .context("building the guest image")?;
    Ok((built.path, built.id))
}

fn read_code(args: &RunArgs) -> Result<String> {
    if let Some(f) = &args.file {
        return std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()));
    }
    match args.code.as_deref() {
        Some("-") | None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("reading code from standard input")?;
            Ok(s)
        }
        Some(c) => Ok(c.to_string()),
    }
}

pub fn limits(args: &RunArgs) -> Result<Limits> {
    if !(args.timeout > 0.0 && args.timeout <= 86_400.0) {
        bail!("--timeout must be between 0 and 86400 seconds");
    }
    if args.memory_mb < 64 || args.memory_mb > 3072 {
        bail!("--memory-mb must be between 64 and 3072");
    }
    Ok(Limits {
        timeout: Duration::from_secs_f64(args.timeout),
        memory_bytes: args.memory_mb << 20,
        output_bytes: args.output_kb << 10,
        ..Limits::default()
    })
}

pub fn run(home: &Path, args: RunArgs) -> Result<ExitCode> {
    let code = read_code(&args)?;
    let limits = limits(&args)?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut sb = if let Some(name) = &args.image.template {
        let catalog = forkbox_engine::Catalog::new(home)?.with_progress(tty);
        let l = catalog.get(Some(name))?;
        if args.cold || args.no_vdso {
            let engine = Engine::open(&l.engine.image_path).context("opening the engine")?.with_preload(l.engine.preload.clone());
            let engine = if args.no_vdso { engine.without_vdso() } else { engine };
            Sandbox::boot(&engine, limits, args.trace_syscalls).context("starting the sandbox")?
        } else {
            l.template.fork(&l.engine, limits).context("forking the template")?
        }
    } else {
        let (image, _) = ensure_image(home, &args.image, tty)?;
        let mut engine = Engine::open(&image).context("opening the engine")?.with_preload(args.preload.clone());
        if args.no_vdso {
            engine = engine.without_vdso();
        }
        if args.cold || args.no_vdso {
            Sandbox::boot(&engine, limits, args.trace_syscalls).context("starting the sandbox")?
        } else {
            let template = Template::ensure(&engine, home).context("preparing the template")?;
            template.fork(&engine, limits).context("forking the template")?
        }
    };
    sb.set_trace(args.trace_syscalls);
    // Without --json the output is printed as it is written (as the remote mode streams
    // it), so what ran before a crash, a deadlock or the deadline is not lost.
    let result = if args.json {
        sb.exec(&code)
    } else {
        let mut sink = |stream: Stream, bytes: &[u8]| {
            let _ = match stream {
                Stream::Stdout => std::io::stdout().lock().write_all(bytes).and_then(|()| std::io::stdout().flush()),
                Stream::Stderr => std::io::stderr().lock().write_all(bytes),
            };
        };
        sb.exec_with(&code, ExecOptions { on_output: Some(&mut sink), interrupt: None })
    };
    if args.trace_syscalls {
        let stats = sb.stats();
        eprintln!("forkbox: {} syscalls", stats.syscalls);
        for u in &stats.unsupported {
            eprintln!("forkbox: {} syscall {} ({}) called {} times: {}", u.support, u.name, u.nr, u.calls, u.note);
        }
    }
    let result = result.context("running the code")?;
    if args.json {
        print_result(&result, true)?;
    } else {
        let traceback = result.error.as_ref().map(|e| e.traceback.as_str());
        print_parts(&result, false, None, traceback, result.value.as_deref())?;
        let bundles: Vec<forkbox_client::MimeBundle> =
            result.display.iter().map(|b| forkbox_client::MimeBundle(b.clone().into_iter().collect())).collect();
        show_display(&bundles)?;
    }
    Ok(if result.error.is_some() { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

pub fn print_result(r: &ExecResult, json: bool) -> Result<()> {
    let traceback = r.error.as_ref().map(|e| e.traceback.as_str());
    print_parts(r, json, Some((&r.stdout, &r.stderr)), traceback, r.value.as_deref())?;
    if !json {
        let bundles: Vec<forkbox_client::MimeBundle> =
            r.display.iter().map(|b| forkbox_client::MimeBundle(b.clone().into_iter().collect())).collect();
        show_display(&bundles)?;
    }
    Ok(())
}

/// Displayed objects on a terminal: images are written to files (their paths printed),
/// everything else as its text/plain.
pub fn show_display(items: &[forkbox_client::MimeBundle]) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    let dir = std::env::temp_dir().join("forkbox-display");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let mut out = std::io::stdout().lock();
    for (i, b) in items.iter().enumerate() {
        if let Some((mime, bytes)) = b.image() {
            let ext = mime.trim_start_matches("image/");
            let path = dir.join(format!("{stamp}-{i}.{ext}"));
            std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
            writeln!(out, "[{mime}, {} bytes, written to {}]", bytes.len(), path.display())?;
        } else if let Some(t) = b.text("text/plain") {
            writeln!(out, "{t}")?;
        }
    }
    Ok(())
}

/// A result as JSON, or as its stdout and stderr (`output`, None when already
/// shown as it was streamed), the traceback on stderr and the value on stdout.
fn print_parts(r: &impl serde::Serialize, json: bool, output: Option<(&str, &str)>, traceback: Option<&str>, value: Option<&str>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, r)?;
        writeln!(out)?;
        return Ok(());
    }
    if let Some((stdout, _)) = output {
        out.write_all(stdout.as_bytes())?;
    }
    out.flush()?;
    let mut err = std::io::stderr().lock();
    if let Some((_, stderr)) = output {
        err.write_all(stderr.as_bytes())?;
    }
    if let Some(tb) = traceback {
        err.write_all(tb.as_bytes())?;
    }
    if let Some(v) = value {
        writeln!(out, "{v}")?;
    }
    Ok(())
}

/// `forkbox --url URL run`: the one-shot exec of the server, output streamed as it is produced.
pub fn run_remote(api: &crate::api::Api, args: RunArgs) -> Result<ExitCode> {
    let local_only = [
        (args.memory_mb != 2048, "--memory-mb"),
        (args.output_kb != 1024, "--output-kb"),
        (args.preload != "import numpy", "--preload"),
        (args.trace_syscalls, "--trace-syscalls"),
        (args.no_vdso, "--no-vdso"),
        (args.cold, "--cold"),
        (!args.image.apt.is_empty(), "--apt"),
        (args.image.image.is_some(), "--image"),
    ];
    if let Some((_, flag)) = local_only.iter().find(|(set, _)| *set) {
        bail!("{flag} only applies to the embedded mode (the server decides it): drop it or --url");
    }
    if !(args.timeout > 0.0 && args.timeout <= 86_400.0) {
        bail!("--timeout must be between 0 and 86400 seconds");
    }
    let code = read_code(&args)?;
    let json = args.json;
    let mut show = |ev: &forkbox_client::StreamEvent| {
        if json {
            return;
        }
        match ev {
            forkbox_client::StreamEvent::Stdout(s) => {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(s.as_bytes());
                let _ = o.flush();
            }
            forkbox_client::StreamEvent::Stderr(s) => {
                let _ = std::io::stderr().lock().write_all(s.as_bytes());
            }
            _ => {}
        }
    };
    let target = crate::api::Target::OneShot { timeout_seconds: Some(args.timeout), template: args.image.template.as_deref() };
    let r = api.block_on(crate::api::exec_streaming(&api.client, target, &code, &mut show)).context("running the code")?;
    print_remote_result(&r, json, true)?;
    Ok(if r.error.is_some() { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

/// A result from the API, printed like [`print_result`] (`streamed`: stdout/stderr were already shown).
pub fn print_remote_result(r: &forkbox_client::ExecResult, json: bool, streamed: bool) -> Result<()> {
    let traceback = r.error.as_ref().map(|e| e.traceback.as_str());
    print_parts(r, json, (!streamed).then_some((r.stdout.as_str(), r.stderr.as_str())), traceback, r.value.as_deref())?;
    if !json {
        show_display(&r.display)?;
    }
    Ok(())
}
