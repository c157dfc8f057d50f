//! `forkbox session ...`: sessions on the local data directory, through the
//! same library the server uses. Each command resumes what it needs from disk.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use forkbox_engine::{Engine, Limits, Template};
use forkbox_sessions::manager::{Config, SessionManager};
use forkbox_sessions::store::{CheckpointRecord, SessionRecord};

use crate::ImageArgs;

pub const LOCAL_TENANT: &str = "local";

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
        image: ImageArgs,
    },
    /// Run code in a session (`-` reads it from standard input).
    Exec {
        id: String,
        code: String,
        #[arg(long)]
        json: bool,
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
    /// Start a new session from a checkpoint of this one (default: its latest).
    Fork {
        id: String,
        checkpoint: Option<i64>,
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Delete a session and the checkpoints only it needed.
    Rm {
        id: String,
        #[command(flatten)]
        image: ImageArgs,
    },
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
        | SessionCommand::Ls { image, .. }
        | SessionCommand::Log { image, .. }
        | SessionCommand::Revert { image, .. }
        | SessionCommand::Fork { image, .. }
        | SessionCommand::Rm { image, .. } => image,
    }
}

/// Engine, template and session manager for the data directory.
pub fn open_manager(home: &Path, image: &ImageArgs) -> Result<SessionManager> {
    let (path, _) = crate::run::ensure_image(home, image, std::io::IsTerminal::is_terminal(&std::io::stderr()))?;
    let engine = Arc::new(Engine::open(&path).context("opening the engine")?);
    let template = Arc::new(Template::ensure(&engine, home).context("preparing the template")?);
    SessionManager::open(engine, template, home, Config::default()).context("opening the session store")
}

fn print_session(s: &SessionRecord, head_seq: Option<i64>) {
    let tags: Vec<String> = s.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "{}  checkpoint {}  tags [{}]  memory {} MiB  timeout {:.0} s",
        s.id,
        head_seq.map_or("-".to_string(), |n| n.to_string()),
        tags.join(","),
        s.limits.memory_bytes >> 20,
        s.limits.timeout_ms as f64 / 1000.0
    );
}

fn head_seq(m: &SessionManager, s: &SessionRecord) -> Option<i64> {
    s.head.and_then(|h| m.store().checkpoint(h).ok().flatten()).map(|c| c.seq)
}

fn print_checkpoint(c: &CheckpointRecord, current: bool) {
    let first = c.code.lines().next().unwrap_or("");
    let more = if c.code.lines().count() > 1 { " ..." } else { "" };
    println!(
        "{} {:>4}  {:>6} pages  {:>8} bytes  {}{}",
        if current { "*" } else { " " },
        c.seq,
        c.pages,
        c.bytes,
        first,
        more
    );
}

pub fn session(home: &Path, cmd: SessionCommand) -> Result<ExitCode> {
    let m = open_manager(home, image_of(&cmd))?;
    match cmd {
        SessionCommand::New { tags, memory_mb, timeout, .. } => {
            if !(timeout > 0.0 && timeout <= 86_400.0) {
                bail!("--timeout must be between 0 and 86400 seconds");
            }
            if !(64..=3072).contains(&memory_mb) {
                bail!("--memory-mb must be between 64 and 3072");
            }
            let limits = Limits { memory_bytes: memory_mb << 20, timeout: Duration::from_secs_f64(timeout), ..Limits::default() };
            let s = m.create(LOCAL_TENANT, tags.into_iter().collect::<BTreeMap<_, _>>(), &limits)?;
            println!("{}", s.id);
        }
        SessionCommand::Exec { id, code, json, .. } => {
            let code = if code == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                s
            } else {
                code
            };
            let out = m.exec(LOCAL_TENANT, &id, &code)?;
            if let Err(e) = m.compact(out.checkpoint.id) {
                tracing::warn!("compacting the layers of {id}: {e}");
            }
            if json {
                let mut v = serde_json::to_value(&out.result)?;
                v["checkpoint"] = out.checkpoint.seq.into();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                crate::run::print_result(&out.result, false)?;
            }
            return Ok(if out.result.error.is_some() { ExitCode::from(1) } else { ExitCode::SUCCESS });
        }
        SessionCommand::Ls { tags, .. } => {
            for s in m.list(LOCAL_TENANT, &tags)? {
                print_session(&s, head_seq(&m, &s));
            }
        }
        SessionCommand::Log { id, .. } => {
            let s = m.get(LOCAL_TENANT, &id)?;
            for c in m.checkpoints(LOCAL_TENANT, &id)? {
                print_checkpoint(&c, Some(c.id) == s.head);
            }
        }
        SessionCommand::Revert { id, checkpoint, .. } => {
            let c = m.revert(LOCAL_TENANT, &id, checkpoint)?;
            println!("{id} is at checkpoint {}", c.seq);
        }
        SessionCommand::Fork { id, checkpoint, tags, .. } => {
            let s = m.fork(LOCAL_TENANT, &id, checkpoint, tags.into_iter().collect())?;
            println!("{}", s.id);
        }
        SessionCommand::Rm { id, .. } => {
            m.delete(LOCAL_TENANT, &id)?;
            println!("deleted {id}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `forkbox --url URL session ...`: the same commands against a server, printed the same way.
pub fn session_remote(api: &crate::api::Api, cmd: SessionCommand) -> Result<ExitCode> {
    let image = image_of(&cmd);
    if image.image.is_some() || !image.apt.is_empty() {
        bail!("--image and --apt only apply to the embedded mode (the server has its own image)");
    }
    let c = &api.client;
    let print = |s: &forkbox_client::Session| {
        let tags: Vec<String> = s.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{}  checkpoint {}  tags [{}]  memory {} MiB  timeout {:.0} s",
            s.id,
            s.checkpoint.map_or("-".to_string(), |n| n.to_string()),
            tags.join(","),
            s.limits.memory_mb,
            s.limits.timeout_seconds
        );
    };
    match cmd {
        SessionCommand::New { tags, memory_mb, timeout, .. } => {
            let opts = forkbox_client::CreateSession {
                tags: tags.into_iter().collect(),
                memory_mb: Some(memory_mb),
                timeout_seconds: Some(timeout),
            };
            println!("{}", api.block_on(c.create_session(&opts))?.id);
        }
        SessionCommand::Exec { id, code, json, .. } => {
            let code = if code == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                s
            } else {
                code
            };
            let r = api.block_on(c.session_exec(&id, &code))?;
            crate::run::print_remote_result(&r, json, false)?;
            return Ok(if r.error.is_some() { ExitCode::from(1) } else { ExitCode::SUCCESS });
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
                    first,
                    more
                );
            }
        }
        SessionCommand::Revert { id, checkpoint, .. } => {
            api.block_on(c.revert(&id, checkpoint))?;
            println!("{id} is at checkpoint {checkpoint}");
        }
        SessionCommand::Fork { id, checkpoint, tags, .. } => {
            if !tags.is_empty() {
                bail!("--tag on fork is not supported with --url yet (the client's fork takes no tags)");
            }
            println!("{}", api.block_on(c.fork(&id, checkpoint))?.id);
        }
        SessionCommand::Rm { id, .. } => {
            api.block_on(c.delete_session(&id))?;
            println!("deleted {id}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
