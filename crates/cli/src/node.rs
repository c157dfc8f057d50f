//! `forkbox node`: the nodes of a cluster (several `forkbox serve --cluster`
//! on one database and one bucket), through a server's admin routes.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Subcommand;
use forkbox_client::NodeList;

use crate::api::Api;

#[derive(Subcommand)]
pub enum NodeCommand {
    /// The cluster's nodes: state, whether alive, heartbeat age, sessions resident on each.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Drain a node (default: the one at --url): it gives its sessions back (they resume on the
    /// other nodes at their last checkpoint, on their next request) and takes no new ones; its
    /// /readyz says 503. Waits until it holds no session (or --timeout).
    Drain {
        node: Option<String>,
        /// Seconds to wait for its sessions to go (execs running on it finish first).
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Make a drained node active again (default: the one at --url).
    Activate { node: Option<String> },
}

fn print(list: &NodeList) {
    println!("{:<24} {:<9} {:<6} {:>10} {:>9}  URL", "NODE", "STATE", "ALIVE", "HEARTBEAT", "SESSIONS");
    for n in &list.nodes {
        let me = if list.node.as_deref() == Some(n.id.as_str()) { " (answered)" } else { "" };
        println!(
            "{:<24} {:<9} {:<6} {:>8.1} s {:>9}  {}{me}",
            n.id,
            n.state,
            if n.alive { "yes" } else { "no" },
            n.heartbeat_age_ms as f64 / 1000.0,
            n.sessions,
            n.url
        );
    }
}

pub fn node(api: &Api, cmd: NodeCommand) -> anyhow::Result<ExitCode> {
    let list = api.block_on(api.client.nodes())?;
    let Some(here) = list.node.clone() else {
        anyhow::bail!("{} is not a cluster node (serve --cluster)", api.target);
    };
    match cmd {
        NodeCommand::Ls { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print(&list);
            }
        }
        NodeCommand::Activate { node } => {
            let id = node.unwrap_or(here);
            let list = api.block_on(api.client.set_draining(&id, false)).with_context(|| format!("activating {id}"))?;
            print(&list);
        }
        NodeCommand::Drain { node, timeout } => {
            let id = node.unwrap_or(here);
            api.block_on(api.client.set_draining(&id, true)).with_context(|| format!("draining {id}"))?;
            let deadline = Instant::now() + Duration::from_secs(timeout);
            loop {
                let list = api.block_on(api.client.nodes())?;
                let held = list.nodes.iter().find(|n| n.id == id).map_or(0, |n| n.sessions);
                if held == 0 {
                    eprintln!("forkbox: node {id} is drained (no session resident; it takes none until `forkbox node activate {id}`)");
                    print(&list);
                    break;
                }
                if Instant::now() >= deadline {
                    print(&list);
                    anyhow::bail!("node {id} still holds {held} sessions after {timeout} s (execs still running?)");
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
