//! `forkbox run`: build the image if needed, boot a sandbox, exec, print.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use forkbox_engine::{Engine, ExecOptions, ExecResult, Limits, Sandbox, Stream, Template};
use forkbox_image::BuildOptions;

use crate::term::{escape, escape_text};
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
    /// Write the files the code created or changed under /output into this directory (created if missing;
    /// names are kept relative to /output and never leave it).
    #[arg(long, value_name = "DIR")]
    pub save_outputs: Option<PathBuf>,
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
    pub network: crate::NetworkArgs,
    #[command(flatten)]
    pub image: ImageArgs,
    #[command(flatten)]
    pub egress: crate::EgressArgs,
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
    let built = forkbox_image::build(&spec, &BuildOptions { home: home.to_path_buf(), progress, report: None })
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
    // The operator's policy (--egress*, default the public internet, as `forkbox serve`'s),
    // narrowed by --network.
    let mut network = forkbox_engine::NetConfig::with_policy(args.egress.policy()?);
    network.layers.extend(args.network.layer()?);
    Ok(Limits {
        timeout: Duration::from_secs_f64(args.timeout),
        memory_bytes: args.memory_mb << 20,
        output_bytes: args.output_kb << 10,
        network,
        ..Limits::default()
    })
}

/// From here on this thread runs the guest: under the guest-thread seccomp filter
/// (`FORKBOX_SECCOMP`, see `forkbox_engine::jail`), as the server's exec threads.
/// After the image and template are resolved (a build runs apt-get and dpkg).
fn guest_thread() -> Result<()> {
    forkbox_engine::jail::enter_guest_thread(forkbox_engine::jail::Mode::from_env()?)?;
    Ok(())
}

pub fn run(home: &Path, args: RunArgs) -> Result<ExitCode> {
    let code = read_code(&args)?;
    let limits = limits(&args)?;
    // Progress of a first build on stderr: bars on a terminal, plain lines otherwise.
    let progress = true;
    let mut sb = if let Some(name) = &args.image.template {
        let catalog = forkbox_catalog::Catalog::new(home)?.with_progress(progress);
        let l = catalog.get(Some(name))?;
        guest_thread()?;
        if args.cold || args.no_vdso {
            let engine = Engine::open(&l.engine.image_path)
                .context("opening the engine")?
                .with_preload(l.engine.preload.clone());
            let engine = if args.no_vdso { engine.without_vdso() } else { engine };
            Sandbox::boot(&engine, limits, args.trace_syscalls).context("starting the sandbox")?
        } else {
            l.template.fork(&l.engine, limits).context("forking the template")?
        }
    } else {
        let (image, _) = ensure_image(home, &args.image, progress)?;
        let mut engine = Engine::open(&image).context("opening the engine")?.with_preload(args.preload.clone());
        if args.no_vdso {
            engine = engine.without_vdso();
        }
        guest_thread()?;
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
        sb.exec_with(
            &code,
            ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
        )
    };
    if args.trace_syscalls {
        let stats = sb.stats();
        eprintln!("forkbox: {} syscalls", stats.syscalls);
        for u in &stats.unsupported {
            eprintln!("forkbox: {} syscall {} ({}) called {} times: {}", u.support, u.name, u.nr, u.calls, u.note);
        }
    }
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            // Without --json the output was shown as it was written.
            let out = sb.take_failed_output();
            let out = out.as_ref().map(|o| (o.stdout.as_str(), o.stderr.as_str()));
            print_failure(e.code(), &e.to_string(), out, args.json, !args.json)?;
            return Err(anyhow::Error::new(e).context("running the code"));
        }
    };
    if args.json {
        print_result(&result, true)?;
    } else {
        let traceback = result.error.as_ref().map(|e| e.traceback.as_str());
        print_parts(&result, false, None, traceback, result.value.as_deref())?;
        let bundles: Vec<forkbox_client::MimeBundle> =
            result.display.iter().map(|b| forkbox_client::MimeBundle(b.clone().into_iter().collect())).collect();
        show_display(&bundles)?;
    }
    let files: Vec<Output<'_>> = result
        .outputs
        .iter()
        .map(|o| Output { path: &o.path, size: o.size, mime: o.mime, data: o.data.clone() })
        .collect();
    report_outputs(&files, args.save_outputs.as_deref(), args.json)?;
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
            writeln!(out, "{}", escape_text(t))?;
        }
    }
    Ok(())
}

/// An exec that failed after it ran: with `json`, its error as the API's body
/// (`{"error": {code, message, stdout, stderr}}`) on stdout; else the output it
/// wrote before (unless `shown`, already streamed). The caller reports the error.
pub fn print_failure(code: &str, message: &str, output: Option<(&str, &str)>, json: bool, shown: bool) -> Result<()> {
    if json {
        let mut e = serde_json::json!({ "code": code, "message": message });
        if let Some((stdout, stderr)) = output {
            e["stdout"] = stdout.into();
            e["stderr"] = stderr.into();
        }
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "error": e }))?;
        writeln!(out)?;
    } else if let (Some((stdout, stderr)), false) = (output, shown) {
        std::io::stdout().lock().write_all(stdout.as_bytes())?;
        std::io::stdout().lock().flush()?;
        std::io::stderr().lock().write_all(stderr.as_bytes())?;
    }
    Ok(())
}

/// A result as JSON, or as its stdout and stderr (`output`, None when already
/// shown as it was streamed), the traceback on stderr and the value on stdout.
fn print_parts(
    r: &impl serde::Serialize,
    json: bool,
    output: Option<(&str, &str)>,
    traceback: Option<&str>,
    value: Option<&str>,
) -> Result<()> {
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
        // A custom __repr__ may return anything: a value is forkbox's line, not the program's stream.
        writeln!(out, "{}", escape_text(v))?;
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
    let opts = forkbox_client::ExecOptions {
        timeout_seconds: Some(args.timeout),
        template: args.image.template.clone(),
        network: args.network.setting()?,
    };
    let target = crate::api::Target::OneShot(&opts);
    let r = match api.block_on(crate::api::exec_streaming(&api.client, target, &code, &mut show)) {
        Ok(r) => r,
        Err(e) => {
            let out = e.output().map(|o| (o.stdout.as_str(), o.stderr.as_str()));
            print_failure(e.code(), &e.message(), out, json, true)?;
            return Err(anyhow::Error::new(e).context("running the code"));
        }
    };
    print_remote_result(&r, json, true)?;
    let files: Vec<Output<'_>> = r
        .outputs
        .iter()
        .map(|o| Output {
            path: &o.path,
            size: o.size,
            mime: &o.mime,
            data: o.base64.as_deref().and_then(|b| {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD.decode(b).ok()
            }),
        })
        .collect();
    report_outputs(&files, args.save_outputs.as_deref(), json)?;
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

/// A file the code wrote under `/output`, as the engine or the API returned it.
pub struct Output<'a> {
    pub path: &'a str,
    pub size: u64,
    pub mime: &'a str,
    /// Its bytes; None when it was over the inline limits (or, from a server, not valid base64).
    pub data: Option<Vec<u8>>,
}

/// List the `/output` files on stderr (unless `json`: they are in the JSON) and, with `save`, write them there.
pub fn report_outputs(files: &[Output<'_>], save: Option<&Path>, json: bool) -> Result<()> {
    if let Some(dir) = save {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut err = std::io::stderr().lock();
    for f in files {
        let path = escape(f.path);
        if !json {
            writeln!(err, "output: {path}  {} bytes  {}", f.size, escape(f.mime))?;
        }
        let Some(dir) = save else { continue };
        let Some(data) = &f.data else {
            writeln!(
                err,
                "forkbox: {path} not saved: {} bytes is over the inline limit of a result (read it from a session)",
                f.size
            )?;
            continue;
        };
        match save_output(dir, f.path, data) {
            Ok(dest) => writeln!(err, "saved {path} to {}", escape(&dest.display().to_string()))?,
            Err(e) => writeln!(err, "forkbox: {path} not saved: {}", escape(&e.to_string()))?,
        }
    }
    if save.is_some() && files.is_empty() && !json {
        writeln!(err, "forkbox: the code wrote no files under /output")?;
    }
    Ok(())
}

/// Where the guest's `/output/...` file `guest_path` goes under `dir`: its path relative to
/// `/output`, each component a plain name (no `..`, `.`, empty, NUL or backslash).
pub fn output_dest(dir: &Path, guest_path: &str) -> std::result::Result<PathBuf, String> {
    let rel = guest_path.strip_prefix("/output/").ok_or_else(|| "not a path under /output".to_string())?;
    let mut dest = dir.to_path_buf();
    for comp in rel.split('/') {
        if comp.is_empty() || comp == "." || comp == ".." || comp.contains(['\0', '\\']) {
            return Err(format!("unsafe file name {guest_path:?}"));
        }
        dest.push(comp);
    }
    Ok(dest)
}

/// Write `data` to its place under `dir`, through no symbolic link: every directory between `dir`
/// and the file is created or must be a real directory, and the file itself is opened with O_NOFOLLOW.
fn save_output(dir: &Path, guest_path: &str, data: &[u8]) -> Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let dest = output_dest(dir, guest_path).map_err(|e| anyhow::anyhow!(e))?;
    let rel = dest.strip_prefix(dir).context("the destination left the directory")?;
    let mut at = dir.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!("{} exists and is not a directory", at.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&at).with_context(|| format!("creating {}", at.display()))?
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", at.display())),
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&dest)
        .with_context(|| format!("opening {}", dest.display()))?;
    f.write_all(data).with_context(|| format!("writing {}", dest.display()))?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_names_stay_inside_the_directory() {
        let d = Path::new("/save");
        assert_eq!(output_dest(d, "/output/a.csv"), Ok(PathBuf::from("/save/a.csv")));
        assert_eq!(output_dest(d, "/output/sub/b.png"), Ok(PathBuf::from("/save/sub/b.png")));
        for bad in [
            "/output/../etc/passwd",
            "/output/a/../../x",
            "/output/./a",
            "/output//a",
            "/output/",
            "/etc/x",
            "/output/a\\b",
            "/output/a\0",
        ] {
            assert!(output_dest(d, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn saving_refuses_symlinks_and_writes_files() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(outside.path().join("f"), dir.path().join("f")).unwrap_or_else(|e| panic!("{e}"));
        assert!(save_output(dir.path(), "/output/link/x", b"no").is_err());
        assert!(save_output(dir.path(), "/output/f", b"no").is_err());
        assert_eq!(std::fs::read_dir(outside.path()).map(|d| d.count()).unwrap_or(99), 0);
        let p = save_output(dir.path(), "/output/sub/ok.txt", b"yes").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read(p).unwrap_or_default(), b"yes");
    }
}
