//! `forkbox session ...`: sessions through the API client, on the local data
//! directory (embedded: the API router in process) or on a server (`--url`).
//! Each command resumes what it needs from disk.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use crate::api::Api;
use crate::term::{escape, escape_text};
use crate::ImageArgs;

pub const LOCAL_TENANT: &str = forkbox_api::handoff::CLI_TENANT;

#[derive(Subcommand)]
pub enum SessionCommand {
    /// Create a session (prints its id).
    New {
        /// A tag KEY=VALUE (repeatable).
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
        #[arg(long, default_value_t = 2048)]
        memory_mb: u64,
        /// Per-exec time limit, seconds.
        #[arg(long, default_value_t = 30.0)]
        timeout: f64,
        #[command(flatten)]
        network: crate::NetworkArgs,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Run code in a session (`-` reads it from standard input, `-f FILE` from a file).
    Exec {
        id: String,
        #[arg(required_unless_present = "file")]
        code: Option<String>,
        /// Read the code from this file.
        #[arg(long, short = 'f', conflicts_with = "code")]
        file: Option<std::path::PathBuf>,
        /// This exec's time limit in seconds (default: the session's; the server bounds it by its maximum).
        #[arg(long)]
        timeout: Option<f64>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Run a command in a session's file system (its stdout/stderr printed as it runs; exits with its exit code).
    /// With --background: start it as a background process (prints its pid) that runs on between calls
    /// (`session ps`, `session logs`, `session kill`); needs a running server (`forkbox serve`, or --url).
    Sh {
        id: String,
        /// Start it and return at once (prints the pid).
        #[arg(long)]
        background: bool,
        /// With --background: its stdin is this CLI's stdin, copied until end of file
        /// (default: /dev/null).
        #[arg(long, requires = "background")]
        stdin: bool,
        #[command(flatten)]
        args: crate::sh::ShArgs,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// List a session's background processes (pid, state, CPU seconds, output bytes, argv).
    Ps {
        id: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Print a background process' output (the last 256 KiB are kept); --follow prints it as it is
    /// written until the process ends.
    Logs {
        id: String,
        pid: u32,
        /// Keep printing new output until the process ends.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Its stderr instead of its stdout.
        #[arg(long)]
        stderr: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Send a signal to a background process and the processes it started (default SIGTERM).
    Kill {
        id: String,
        pid: u32,
        /// Signal number (e.g. 9) or name (TERM, KILL, INT, HUP, ...).
        #[arg(long, short = 's', default_value = "TERM", value_parser = parse_signal)]
        signal: i32,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// List sessions (optionally only those with all the given tags).
    Ls {
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Show a session's checkpoints with the code that produced each.
    Log {
        id: String,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Move a session back to one of its checkpoints (by number).
    Revert {
        id: String,
        checkpoint: i64,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// pip install packages into a session (served by the server: binary wheels from its index or
    /// wheelhouse, under its --pip-allow/--pip-deny); the next exec imports them.
    Install {
        id: String,
        /// Requirement specs, e.g. `requests` or `tabulate>=0.9`.
        #[arg(required = true)]
        packages: Vec<String>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Start a new session from a checkpoint of this one (default: its latest).
    Fork {
        id: String,
        checkpoint: Option<i64>,
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Make a template of your own from a checkpoint of a session (its variables, imports, data, files):
    /// `forkbox run --template NAME` and `session new --template NAME` start from that state.
    Template {
        id: String,
        /// The checkpoint's number (see `session log`).
        checkpoint: i64,
        /// The new template's name.
        name: String,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Print a signed URL of a server inside the session (its port), for a browser or a
    /// colleague: no key needed until it expires. Needs a server (`--url`, or one running on the data directory).
    Port {
        id: String,
        /// The port the server listens on inside the sandbox (1-65535).
        #[arg(value_parser = clap::value_parser!(u16).range(1..))]
        port: u16,
        /// How long the URL works, seconds (default 3600, at most 7 days).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=604_800))]
        expires_in: Option<u64>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// List what listens inside the session (port, bound address, whether `session port` reaches it).
    Ports {
        id: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Delete a session and the checkpoints only it needed.
    Rm {
        id: String,
        #[command(flatten)]
        image: ImageArgs,
    },
    #[command(flatten)]
    Tree(crate::tree::TreeCommand),
}

/// A signal by number or name (with or without `SIG`).
fn parse_signal(s: &str) -> Result<i32, String> {
    if let Ok(n) = s.parse::<i32>() {
        return if (1..=64).contains(&n) { Ok(n) } else { Err(format!("{n} is not a signal number (1-64)")) };
    }
    let name = s.trim_start_matches("SIG").trim_start_matches("sig").to_ascii_uppercase();
    let n = match name.as_str() {
        "HUP" => 1,
        "INT" => 2,
        "QUIT" => 3,
        "KILL" => 9,
        "USR1" => 10,
        "USR2" => 12,
        "TERM" => 15,
        "CONT" => 18,
        "STOP" => 19,
        _ => return Err(format!("{s:?} is not a signal (a number, or HUP INT QUIT KILL USR1 USR2 TERM CONT STOP)")),
    };
    Ok(n)
}

fn parse_tag(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("tag {s:?} is not KEY=VALUE"))?;
    if k.is_empty() {
        return Err(format!("tag {s:?} has an empty key"));
    }
    Ok((k.to_string(), v.to_string()))
}

fn image_of(cmd: &SessionCommand) -> &ImageArgs {
    match cmd {
        SessionCommand::New { image, .. }
        | SessionCommand::Exec { image, .. }
        | SessionCommand::Sh { image, .. }
        | SessionCommand::Ps { image, .. }
        | SessionCommand::Logs { image, .. }
        | SessionCommand::Kill { image, .. }
        | SessionCommand::Ls { image, .. }
        | SessionCommand::Log { image, .. }
        | SessionCommand::Revert { image, .. }
        | SessionCommand::Install { image, .. }
        | SessionCommand::Fork { image, .. }
        | SessionCommand::Template { image, .. }
        | SessionCommand::Port { image, .. }
        | SessionCommand::Ports { image, .. }
        | SessionCommand::Rm { image, .. } => image,
        SessionCommand::Tree(t) => t.image(),
    }
}

/// `forkbox session ...` embedded on the data directory `home`.
pub fn session(home: &Path, cmd: SessionCommand, egress: &crate::EgressArgs) -> Result<ExitCode> {
    check_new(&cmd)?;
    let api = Api::embedded(home, image_of(&cmd), egress)?;
    run(&api, cmd)
}

/// `forkbox --url URL session ...`: the same commands against a server, printed the same way.
pub fn session_remote(api: &Api, cmd: SessionCommand) -> Result<ExitCode> {
    let image = image_of(&cmd);
    if image.image.is_some() || !image.apt.is_empty() {
        bail!("--image and --apt only apply to the embedded mode (the server has its own image)");
    }
    check_new(&cmd)?;
    run(api, cmd)
}

/// The CLI's own bounds on a new session's limits (before any engine is opened).
fn check_new(cmd: &SessionCommand) -> Result<()> {
    if let SessionCommand::Exec { timeout: Some(t), .. } = cmd {
        if !(*t > 0.0 && *t <= 86_400.0) {
            bail!("--timeout must be between 0 and 86400 seconds");
        }
    }
    if let SessionCommand::New { memory_mb, timeout, network, .. } = cmd {
        network.setting()?;
        if !(*timeout > 0.0 && *timeout <= 86_400.0) {
            bail!("--timeout must be between 0 and 86400 seconds");
        }
        if !(64..=3072).contains(memory_mb) {
            bail!("--memory-mb must be between 64 and 3072");
        }
    }
    Ok(())
}

fn run(api: &Api, cmd: SessionCommand) -> Result<ExitCode> {
    let c = &api.client;
    let print = |s: &forkbox_client::Session| {
        let tags: Vec<String> = s.tags.iter().map(|(k, v)| format!("{}={}", escape(k), escape(v))).collect();
        println!(
            "{}  checkpoint {}  tags [{}]  memory {} MiB  timeout {:.0} s  network {}",
            s.id,
            // A fork before its first exec is at the checkpoint it was forked from.
            s.checkpoint.or(s.forked_from.as_ref().map(|f| f.checkpoint)).map_or("-".to_string(), |n| n.to_string()),
            tags.join(","),
            s.limits.memory_mb,
            s.limits.timeout_seconds,
            s.limits.network_mode().unwrap_or("-")
        );
    };
    match cmd {
        SessionCommand::New { tags, memory_mb, timeout, network, image } => {
            let opts = forkbox_client::CreateSession {
                tags: tags.into_iter().collect(),
                memory_mb: Some(memory_mb),
                timeout_seconds: Some(timeout),
                template: image.template,
                network: network.setting()?,
                ..Default::default()
            };
            println!("{}", api.block_on(c.create_session(&opts))?.id);
        }
        SessionCommand::Exec { id, code, file, timeout, json, .. } => {
            let code = match (file, code) {
                (Some(f), _) => std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?,
                (None, Some(c)) if c == "-" => {
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                        .context("reading code from standard input")?;
                    s
                }
                (None, Some(c)) => c,
                (None, None) => bail!("no code: give CODE, `-` (standard input) or -f FILE"),
            };
            let r = match api.block_on(c.session_exec_with(&id, &code, timeout)) {
                Ok(r) => r,
                Err(e) => {
                    // What the exec wrote before it failed (timeout, crash, ...) comes with the error.
                    let out = e.output().map(|o| (o.stdout.as_str(), o.stderr.as_str()));
                    crate::run::print_failure(e.code(), &e.message(), out, json, false)?;
                    return Err(e.into());
                }
            };
            api.after_exec(&id);
            crate::run::print_remote_result(&r, json, false)?;
            return Ok(if r.error.is_some() { ExitCode::from(1) } else { ExitCode::SUCCESS });
        }
        SessionCommand::Sh { id, background: false, args, .. } => return crate::sh::sh(api, Some(&id), &args, None),
        SessionCommand::Sh { id, background: true, stdin, args, .. } => {
            let req = args.session_request()?;
            match api.block_on(c.start_session_command(&id, &req, stdin))? {
                Ok(p) => {
                    if args.json {
                        println!("{}", serde_json::to_string(&p)?);
                    } else {
                        println!("{}", p.pid);
                    }
                    if stdin {
                        copy_stdin(api, &id, p.pid)?;
                    }
                }
                // It could not start: what it said, and its status as ours.
                Err(r) => {
                    eprint!("{}", escape_text(&r.stderr));
                    return Ok(ExitCode::from(u8::try_from(r.exit_code).unwrap_or(1)));
                }
            }
        }
        SessionCommand::Ps { id, json, .. } => {
            let ps = api.block_on(c.processes(&id))?;
            if json {
                println!("{}", serde_json::to_string(&ps)?);
            } else {
                println!("{:>7}  {:<12} {:>8}  {:>10}  {:>10}  ARGV", "PID", "STATE", "CPU s", "STDOUT", "STDERR");
                for p in ps {
                    let state = match (p.state.as_str(), p.exit_code, p.signal) {
                        ("running", ..) => "running".to_string(),
                        (_, _, Some(s)) => format!("signal {s}"),
                        (_, Some(c), _) => format!("exit {c}"),
                        (s, ..) => s.to_string(),
                    };
                    let argv: Vec<String> = p.argv.iter().map(|a| escape(a).into_owned()).collect();
                    println!(
                        "{:>7}  {:<12} {:>8.2}  {:>10}  {:>10}  {}",
                        p.pid,
                        state,
                        p.cpu_seconds,
                        p.stdout_bytes,
                        p.stderr_bytes,
                        argv.join(" ")
                    );
                }
            }
        }
        SessionCommand::Logs { id, pid, follow, stderr, .. } => return logs(api, &id, pid, follow, stderr),
        SessionCommand::Kill { id, pid, signal, .. } => {
            let p = api.block_on(c.signal_process(&id, pid, signal))?;
            println!("sent signal {signal} to {pid} ({})", p.state);
        }
        SessionCommand::Ls { tags, .. } => {
            for s in api.block_on(c.list_sessions(&tags))? {
                print(&s);
            }
        }
        SessionCommand::Log { id, .. } => {
            for cp in api.block_on(c.checkpoints(&id))? {
                let first = cp.code.lines().next().unwrap_or("");
                let more = if cp.code.lines().count() > 1 { " ..." } else { "" };
                println!(
                    "{} {:>4}  {:>6} pages  {:>8} bytes  {}{}",
                    if cp.head { "*" } else { " " },
                    cp.seq,
                    cp.pages,
                    cp.bytes,
                    escape(first),
                    more
                );
            }
        }
        SessionCommand::Revert { id, checkpoint, .. } => {
            api.block_on(c.revert(&id, checkpoint))?;
            println!("{id} is at checkpoint {checkpoint}");
        }
        SessionCommand::Install { id, packages, .. } => {
            let p = api.block_on(c.install_packages(&id, &packages))?;
            print!("{}", escape_text(&p.output));
            if let Some(cp) = p.checkpoint {
                println!("{id} is at checkpoint {cp}");
            }
        }
        SessionCommand::Fork { id, checkpoint, tags, .. } => {
            println!("{}", api.fork(&id, checkpoint, tags.into_iter().collect())?);
        }
        SessionCommand::Template { id, checkpoint, name, .. } => {
            let t = api.block_on(c.checkpoint_template(&id, checkpoint, &name))?;
            println!("{} {}", escape(&t.name), t.id.as_deref().unwrap_or("-"));
        }
        SessionCommand::Port { id, port, expires_in, .. } => {
            if !matches!(c.transport(), forkbox_client::Transport::Http { .. }) {
                bail!("`session port` needs a server (its port proxy): start `forkbox serve` or pass --url");
            }
            let v = api.block_on(c.port_url(&id, port, expires_in))?;
            let url = v.get("url").and_then(|u| u.as_str()).unwrap_or_default();
            let expires = v.get("expires_at").and_then(|u| u.as_str()).unwrap_or_default();
            println!("{url}");
            eprintln!("valid until {expires}");
        }
        SessionCommand::Ports { id, json, .. } => {
            let v = api.block_on(c.listening_ports(&id))?;
            if json {
                println!("{v}");
            } else {
                if v.get("resident").and_then(|r| r.as_bool()) == Some(false) {
                    eprintln!("{id} is paused: nothing listens until a request resumes it");
                }
                println!("{:>5}  {:<40} PROXIED", "PORT", "ADDRESS");
                for p in v.get("ports").and_then(|p| p.as_array()).map_or(&[][..], |a| a.as_slice()) {
                    let port = p.get("port").and_then(|x| x.as_u64()).unwrap_or_default();
                    let address = p.get("address").and_then(|x| x.as_str()).unwrap_or_default();
                    let proxied = p.get("proxied").and_then(|x| x.as_bool()) == Some(true);
                    println!("{port:>5}  {:<40} {}", escape(address), if proxied { "yes" } else { "no" });
                }
            }
        }
        SessionCommand::Rm { id, .. } => {
            api.block_on(c.delete_session(&id))?;
            println!("deleted {id}");
        }
        SessionCommand::Tree(t) => return crate::tree::run(api, t),
    }
    Ok(ExitCode::SUCCESS)
}

/// `session logs`: what the process wrote (from the oldest byte kept), then with `follow` what it
/// writes until it ends. A terminal gets the text with control characters escaped.
fn logs(api: &Api, id: &str, pid: u32, follow: bool, stderr: bool) -> Result<ExitCode> {
    use futures_util::StreamExt;
    use std::io::Write;
    let c = &api.client;
    let write = |text: &str| {
        let text = if std::io::IsTerminal::is_terminal(&std::io::stdout()) { escape_text(text) } else { text.into() };
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(text.as_bytes());
        let _ = o.flush();
    };
    if !follow {
        let mut offset = 0;
        loop {
            let out = api.block_on(c.process_output(id, pid, stderr, offset, None))?;
            write(&out.data);
            if out.next_offset >= out.end {
                return Ok(ExitCode::SUCCESS);
            }
            offset = out.next_offset;
        }
    }
    let stream = if stderr { "stderr" } else { "stdout" };
    api.block_on(async {
        let mut events = c.follow_process(id, pid, Some(stream), 0).await?.boxed();
        while let Some(ev) = events.next().await {
            match ev? {
                forkbox_client::StreamEvent::Stdout(t) | forkbox_client::StreamEvent::Stderr(t) => write(&t),
                forkbox_client::StreamEvent::Result(_) => return Ok(ExitCode::SUCCESS),
                forkbox_client::StreamEvent::Error { code, message, output } => {
                    return Err(forkbox_client::ClientError::from_code_with_output(code, message, output).into())
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// `session sh --background --stdin`: this CLI's stdin to the process' stdin, then end of file.
fn copy_stdin(api: &Api, id: &str, pid: u32) -> Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    let mut input = std::io::stdin().lock();
    loop {
        let n = std::io::Read::read(&mut input, &mut buf).context("reading standard input")?;
        api.block_on(api.client.write_stdin(id, pid, &buf[..n], n == 0))?;
        if n == 0 {
            return Ok(());
        }
    }
}
