//! `forkbox session tree|explore|vars|diff`: the tree of states from the command
//! line, and the drawing of a tree the REPL's `:checkpoints` shares.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use forkbox_client::tree::{Keep, Tree};

use crate::api::Api;
use crate::term::escape;
use crate::ImageArgs;

#[derive(Subcommand)]
pub enum TreeCommand {
    /// Draw a session's tree: its checkpoints and its forks', the head marked with `*`.
    Tree {
        id: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Run alternatives in parallel, each in its own fork of a checkpoint (default: the head); the session is not touched.
    Explore {
        id: String,
        /// An alternative (repeatable, in order).
        #[arg(long = "code", short = 'c', value_name = "CODE")]
        codes: Vec<String>,
        /// An alternative read from a file (repeatable; after the -c ones).
        #[arg(long = "file", short = 'f', value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
        /// The checkpoint to branch from (default: the head).
        #[arg(long)]
        checkpoint: Option<i64>,
        /// Which branches become sessions: none (default), all, or indices like 0,2.
        #[arg(long, default_value = "none")]
        keep: String,
        /// Each branch's time limit in seconds (default: the session's).
        #[arg(long)]
        timeout: Option<f64>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// The variables (name, type, size, short repr) at a checkpoint, read in a throwaway fork.
    Vars {
        id: String,
        checkpoint: i64,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// What changed from checkpoint FROM to TO (default: the head): variables, files, the calls between.
    Diff {
        id: String,
        from: i64,
        to: Option<i64>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        image: ImageArgs,
    },
}

impl TreeCommand {
    pub fn image(&self) -> &ImageArgs {
        match self {
            TreeCommand::Tree { image, .. }
            | TreeCommand::Explore { image, .. }
            | TreeCommand::Vars { image, .. }
            | TreeCommand::Diff { image, .. } => image,
        }
    }
}

fn parse_keep(s: &str) -> Result<Keep> {
    match s {
        "none" => Ok(Keep::None),
        "all" => Ok(Keep::All),
        list => {
            let v: Result<Vec<usize>, _> = list.split(',').map(|x| x.trim().parse::<usize>()).collect();
            v.map(Keep::Indices).map_err(|_| anyhow::anyhow!("--keep: none, all, or indices like 0,2 (got {list:?})"))
        }
    }
}

/// The first line of `code` (escaped for the terminal), ` ...` if there are more.
fn first_line(code: &str) -> String {
    let first = code.lines().next().unwrap_or("");
    let more = if code.lines().count() > 1 { " ..." } else { "" };
    format!("{}{more}", escape(first))
}

/// The tree as text: one line per checkpoint, children indented under their parent
/// (an only child straight below, several as branches), `*` at the session's head,
/// `[s_...]` where another session's head is.
pub fn draw(t: &Tree) -> String {
    let mut children: BTreeMap<Option<i64>, Vec<usize>> = BTreeMap::new();
    let known: std::collections::HashSet<i64> = t.nodes.iter().map(|n| n.checkpoint).collect();
    for (i, n) in t.nodes.iter().enumerate() {
        // A parent outside the tree (a session from before lineages) hangs at the root.
        let p = n.parent.filter(|p| known.contains(p));
        children.entry(p).or_default().push(i);
    }
    let mut out = String::new();
    if t.head.is_none() {
        out.push_str("* (template)\n");
    }
    fn walk(t: &Tree, children: &BTreeMap<Option<i64>, Vec<usize>>, at: Option<i64>, prefix: &str, out: &mut String) {
        let Some(kids) = children.get(&at) else { return };
        for (k, &i) in kids.iter().enumerate() {
            let n = &t.nodes[i];
            let last = k + 1 == kids.len();
            let (branch, next) = if kids.len() == 1 {
                ("", prefix.to_string())
            } else if last {
                ("└─ ", format!("{prefix}   "))
            } else {
                ("├─ ", format!("{prefix}│  "))
            };
            let mark = if n.head { "*" } else { " " };
            let others: Vec<&str> = n.heads.iter().filter(|h| **h != t.session).map(String::as_str).collect();
            let others = if others.is_empty() { String::new() } else { format!("  [{}]", escape(&others.join(", "))) };
            let summary = n.summary.as_deref().map_or(String::new(), |s| format!("  -> {}", escape(s)));
            out.push_str(&format!(
                "{mark} {prefix}{branch}{:>3}  {}{summary}{others}\n",
                n.checkpoint,
                first_line(&n.code)
            ));
            walk(t, children, Some(n.checkpoint), &next, out);
        }
    }
    walk(t, &children, None, "", &mut out);
    out
}

fn read_codes(codes: Vec<String>, files: Vec<std::path::PathBuf>) -> Result<Vec<String>> {
    let mut all = codes;
    for f in files {
        all.push(std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?);
    }
    if all.is_empty() {
        bail!("no alternatives: give -c CODE or -f FILE (repeatable)");
    }
    Ok(all)
}

fn size(b: Option<u64>) -> String {
    b.map_or("-".to_string(), |b| b.to_string())
}

pub fn run(api: &Api, cmd: TreeCommand) -> Result<ExitCode> {
    let c = &api.client;
    match cmd {
        TreeCommand::Tree { id, json, .. } => {
            let t = api.block_on(c.tree(&id))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                print!("{}", draw(&t));
            }
        }
        TreeCommand::Explore { id, codes, files, checkpoint, keep, timeout, json, .. } => {
            let keep = parse_keep(&keep)?;
            let codes = read_codes(codes, files)?;
            let r = api.block_on(c.explore(&id, &codes, checkpoint, &keep, timeout))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
                return Ok(ExitCode::SUCCESS);
            }
            let from = r.from.map_or("the template".to_string(), |n| format!("checkpoint {n}"));
            println!("{} alternatives from {from} in {:.1} ms", r.branches.len(), r.total_time_ms);
            for b in &r.branches {
                let kept = match (&b.session, b.result.as_ref().and_then(|r| r.checkpoint)) {
                    (Some(s), Some(n)) => format!("  kept: {s} at checkpoint {n}"),
                    (Some(s), None) => format!("  kept: {s}"),
                    _ => String::new(),
                };
                let what = match (&b.result, &b.failed) {
                    (Some(r), _) => match (&r.error, &r.value) {
                        (Some(e), _) => format!("{}: {}", e.kind, e.message),
                        (None, Some(v)) => v.clone(),
                        (None, None) => first_line(r.stdout.trim_end()),
                    },
                    (None, Some(f)) => format!("failed ({}): {}", f.error.code, f.error.message),
                    (None, None) => "no result".into(),
                };
                let ms = b.result.as_ref().map_or(String::new(), |r| format!("  ({:.1} ms)", r.runtime_ms));
                println!("[{}] {}{ms}{}", b.index, escape(&what), escape(&kept));
            }
        }
        TreeCommand::Vars { id, checkpoint, json, .. } => {
            let v = api.block_on(c.variables(&id, checkpoint))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(ExitCode::SUCCESS);
            }
            for x in &v.variables {
                println!("{:<20} {:<22} {:>10}  {}", escape(&x.name), escape(&x.kind), x.size, escape(&x.repr));
            }
            if v.omitted > 0 {
                println!("... and {} more", v.omitted);
            }
        }
        TreeCommand::Diff { id, from, to, json, .. } => {
            let d = api.block_on(c.diff(&id, from, to))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&d)?);
                return Ok(ExitCode::SUCCESS);
            }
            let to = d.to.map_or("the template".to_string(), |n| n.to_string());
            let common = d.common.map_or("the template".to_string(), |n| n.to_string());
            println!("checkpoint {from} -> {to} (common ancestor: {common})");
            for p in &d.undone {
                println!("  undone {:>4}  {}", p.checkpoint, first_line(&p.code));
            }
            for p in &d.calls {
                println!("  ran    {:>4}  {}", p.checkpoint, first_line(&p.code));
            }
            for v in &d.variables_added {
                println!("+ {} ({}) = {}", escape(&v.name), escape(&v.kind), escape(&v.repr));
            }
            for v in &d.variables_removed {
                println!("- {} ({}) = {}", escape(&v.name), escape(&v.kind), escape(&v.repr));
            }
            for v in &d.variables_changed {
                println!("~ {}: {} -> {}", escape(&v.name), escape(&v.before.repr), escape(&v.after.repr));
            }
            for f in &d.files_added {
                println!("+ {} ({} bytes)", escape(&f.path), size(f.size_after));
            }
            for f in &d.files_removed {
                println!("- {} ({} bytes)", escape(&f.path), size(f.size_before));
            }
            for f in &d.files_changed {
                println!("~ {} ({} -> {} bytes)", escape(&f.path), size(f.size_before), size(f.size_after));
            }
            if d.files_truncated {
                println!("(the file walk stopped at its bound: the file lists may be incomplete)");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
