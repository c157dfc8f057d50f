//! `forkbox mcp`: the MCP server on stdio, over the local data directory
//! (embedded engine, in-process API router) or a remote server (`--url`);
//! `forkbox mcp install`: the MCP client configuration that runs it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use forkbox_client::{Client, Transport};
use forkbox_mcp::install::{self, Launch, McpClient};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct McpArgs {
    #[command(subcommand)]
    command: Option<McpCommand>,
    /// Embedded mode: use this image file instead of the default image.
    #[arg(long, value_name = "FILE")]
    image: Option<PathBuf>,
}

#[derive(Subcommand)]
enum McpCommand {
    /// Print (or with --write, merge into the client's config file) the configuration that runs `forkbox mcp`.
    Install(InstallArgs),
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("client").required(true).args(["claude", "cursor", "goose"]))]
struct InstallArgs {
    /// Claude Desktop (~/.config/Claude/claude_desktop_config.json).
    #[arg(long)]
    claude: bool,
    /// Cursor (~/.cursor/mcp.json).
    #[arg(long)]
    cursor: bool,
    /// Goose (~/.config/goose/config.yaml).
    #[arg(long)]
    goose: bool,
    /// Merge the entry into the client's config file (the old file is backed up; other servers are kept).
    #[arg(long)]
    write: bool,
}

/// `home_flag`: the data directory if the user chose one (--home / $FORKBOX_HOME), for the snippet.
/// `url`: the global `--url` / $FORKBOX_URL (a remote server instead of the local data directory; for
/// `install`, the server the snippet configures).
pub fn mcp(home: &Path, home_flag: Option<&Path>, url: Option<String>, args: McpArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        Some(McpCommand::Install(i)) => install_cmd(home_flag, i, url),
        None => stdio(home, url, args.image),
    }
}

fn stdio(home: &Path, url: Option<String>, image: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let client = match url {
            Some(base_url) => {
                let key = std::env::var("FORKBOX_API_KEY").ok().filter(|k| !k.is_empty());
                if key.is_none() {
                    tracing::warn!("FORKBOX_API_KEY is not set: the server at {base_url} will refuse the tool calls");
                }
                Client::new(Transport::Http { base_url, key })
            }
            None => embedded(home, image).await?,
        };
        forkbox_mcp::serve_stdio(client).await?;
        anyhow::Ok(())
    })?;
    // Blocking engine work still queued must not keep the process alive once the client has gone.
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(ExitCode::SUCCESS)
}

/// A client of the local data directory's API, in process: the API's own
/// routes for the local tenant (the one `forkbox session` uses), no key.
async fn embedded(home: &Path, image: Option<PathBuf>) -> anyhow::Result<Client> {
    let home = home.to_path_buf();
    let runtime = tokio::task::spawn_blocking(move || forkbox_runtime::Runtime::embedded(&home, image.as_deref()))
        .await?
        .context("opening the local data directory")?;
    let router = forkbox_server::embedded(runtime, crate::session::LOCAL_TENANT)?;
    Ok(Client::new(Transport::InProcess(router)))
}

fn install_cmd(home_flag: Option<&Path>, args: InstallArgs, url: Option<String>) -> anyhow::Result<ExitCode> {
    let client = if args.claude {
        McpClient::Claude
    } else if args.cursor {
        McpClient::Cursor
    } else {
        McpClient::Goose
    };
    let program = std::env::current_exe().and_then(|p| p.canonicalize()).context("finding the path of this forkbox binary")?;
    let home = home_flag.map(|h| std::path::absolute(h).unwrap_or_else(|_| h.to_path_buf()));
    let launch = Launch { program, home, url: url.clone() };
    if !args.write {
        println!("{}", install::snippet(client, &launch).trim_end());
        if url.is_some() {
            eprintln!("forkbox: replace the FORKBOX_API_KEY placeholder with your API key (`forkbox key create` on the server)");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let user_home = std::env::var_os("HOME").map(PathBuf::from).ok_or(install::InstallError::NoHome)?;
    let path = client.config_path(&user_home);
    let w = install::write(client, &path, &launch)?;
    match &w.backup {
        Some(b) => println!("wrote {} (previous version in {})", w.path.display(), b.display()),
        None => println!("wrote {}", w.path.display()),
    }
    if url.is_some() {
        println!("set FORKBOX_API_KEY in that entry to your API key; then restart the client");
    } else {
        println!("restart the client to load forkbox");
    }
    Ok(ExitCode::SUCCESS)
}
