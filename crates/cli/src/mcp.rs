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
    /// Embedded mode: the operator's egress policy (as `serve`'s).
    #[command(flatten)]
    egress: crate::EgressArgs,
}

#[derive(Subcommand)]
enum McpCommand {
    /// Print (or with --write, merge into the client's config file) the configuration that runs `forkbox mcp`.
    Install(InstallArgs),
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("client").required(true).args(["claude", "claude_code", "cursor", "windsurf", "goose"]))]
struct InstallArgs {
    /// Claude Desktop (~/.config/Claude/claude_desktop_config.json).
    #[arg(long)]
    claude: bool,
    /// Claude Code: prints the `claude mcp add` command (--write runs it).
    #[arg(long)]
    claude_code: bool,
    /// Cursor (~/.cursor/mcp.json).
    #[arg(long)]
    cursor: bool,
    /// Windsurf (~/.codeium/windsurf/mcp_config.json).
    #[arg(long)]
    windsurf: bool,
    /// Goose (~/.config/goose/config.yaml).
    #[arg(long)]
    goose: bool,
    /// Merge the entry into the client's config file (the old file is backed up; other servers are kept).
    #[arg(long)]
    write: bool,
    /// With --url: create a new API key for the entry in the local data directory (--home), which must be
    /// the one the server at --url serves (the same machine); otherwise pass the server's key with --api-key.
    #[arg(long)]
    create_key: bool,
    /// The tenant of the key --create-key makes.
    #[arg(long, default_value = "default", requires = "create_key")]
    tenant: String,
}

/// `home_flag`: the data directory if the user chose one (--home / $FORKBOX_HOME), for the snippet.
/// `url`: the global `--url` / $FORKBOX_URL (a remote server instead of the local data directory; for
/// `install`, the server the snippet configures).
pub fn mcp(
    home: &Path,
    home_flag: Option<&Path>,
    url: Option<String>,
    api_key: Option<String>,
    args: McpArgs,
) -> anyhow::Result<ExitCode> {
    match args.command {
        Some(McpCommand::Install(i)) => install_cmd(home, home_flag, i, url, api_key),
        None => stdio(home, url, args.image, &args.egress),
    }
}

/// MCP on stdio over `--url`, else the server running on `home` (its `server.json`, as every
/// command without --url), else the data directory in process. `initialize` is answered at once
/// in every case: the embedded runtime is opened (on a first start, the image and template built)
/// in the background, and the tool calls that need it wait for it.
fn stdio(
    home: &Path,
    url: Option<String>,
    image: Option<PathBuf>,
    egress: &crate::EgressArgs,
) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let server = match url {
            Some(_) if egress.is_set() => return Err(crate::remote_egress()),
            Some(base_url) => {
                let key = std::env::var("FORKBOX_API_KEY").ok().filter(|k| !k.is_empty());
                if key.is_none() {
                    tracing::warn!("FORKBOX_API_KEY is not set: the server at {base_url} will refuse the tool calls");
                }
                forkbox_mcp::ForkboxMcp::new(Client::new(Transport::Http { base_url, key }))
            }
            None => match crate::api::running_server(home) {
                Some(f) if egress.is_set() => anyhow::bail!(
                    "{} is served by forkbox (pid {}) at {}: its egress policy is that server's (forkbox serve \
                     --egress-allow ...); --egress flags apply to embedded runs only",
                    home.display(),
                    f.pid,
                    f.url
                ),
                Some(f) => {
                    tracing::info!("using the server of {} at {}", home.display(), f.url);
                    forkbox_mcp::ForkboxMcp::new(Client::new(Transport::Http { base_url: f.url, key: Some(f.key) }))
                }
                None => embedded(home, image, egress)?,
            },
        };
        forkbox_mcp::serve_stdio_with(server).await?;
        anyhow::Ok(())
    })?;
    // Blocking engine work still queued must not keep the process alive once the client has gone.
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(ExitCode::SUCCESS)
}

/// The tools over the local data directory's API, in process: the API's own routes for the
/// local tenant (the one `forkbox session` uses), no key. The runtime opens in the background
/// (a first start builds the image and template); until then the instructions say what the
/// configuration allows, and tool calls wait.
fn embedded(
    home: &Path,
    image: Option<PathBuf>,
    egress: &crate::EgressArgs,
) -> anyhow::Result<forkbox_mcp::ForkboxMcp> {
    let mut config = egress.runtime_config()?;
    config.image = image;
    let fallback = match forkbox_catalog::Catalog::new(home) {
        Ok(c) => Some(forkbox_server::capabilities(
            &config,
            c.list_visible(crate::session::LOCAL_TENANT),
            c.default_name(),
            None,
        )),
        Err(e) => {
            tracing::warn!("listing the templates of {}: {e}", home.display());
            None
        }
    };
    let (prep, source) = forkbox_mcp::source::pending(
        "opening the data directory (a first start builds the guest image and the python template: a minute or two)",
    );
    let home = home.to_path_buf();
    tokio::spawn(async move {
        let opened = tokio::task::spawn_blocking(move || -> anyhow::Result<Client> {
            let runtime = forkbox_runtime::Runtime::embedded_with(&home, config)
                .with_context(|| format!("opening the data directory {}", home.display()))?;
            let router = forkbox_server::embedded(runtime, crate::session::LOCAL_TENANT)?;
            Ok(Client::new(Transport::InProcess(router)))
        })
        .await;
        match opened {
            Ok(Ok(client)) => prep.ready(client),
            Ok(Err(e)) => {
                let why = crate::one_line(&e);
                tracing::error!("{why}");
                prep.failed(why);
            }
            Err(e) => prep.failed(format!("opening the data directory failed: {e}")),
        }
    });
    Ok(forkbox_mcp::ForkboxMcp::with_source(source, fallback))
}

/// The path of the `forkbox` the client should run: this executable, unless it is a cargo build
/// output (`target/...`, gone after `cargo clean`) and a `forkbox` on the PATH is not.
fn stable_program() -> anyhow::Result<PathBuf> {
    let me =
        std::env::current_exe().and_then(|p| p.canonicalize()).context("finding the path of this forkbox binary")?;
    if !install::is_build_output(&me) {
        return Ok(me);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| d.join("forkbox").canonicalize().ok())
        .find(|p| p.is_file() && !install::is_build_output(p));
    match on_path {
        Some(p) => {
            eprintln!("forkbox: using the installed {} (this binary is a cargo build output)", p.display());
            Ok(p)
        }
        None => {
            eprintln!(
                "forkbox: warning: {} is a cargo build output: `cargo clean` or the next build removes or replaces it \
                 and the client then fails to start forkbox; install it with `cargo install --path crates/cli` \
                 (or scripts/install) and run that `forkbox mcp install`",
                me.display()
            );
            Ok(me)
        }
    }
}

fn install_cmd(
    home: &Path,
    home_flag: Option<&Path>,
    args: InstallArgs,
    url: Option<String>,
    api_key: Option<String>,
) -> anyhow::Result<ExitCode> {
    let client = if args.claude {
        McpClient::Claude
    } else if args.claude_code {
        McpClient::ClaudeCode
    } else if args.cursor {
        McpClient::Cursor
    } else if args.windsurf {
        McpClient::Windsurf
    } else {
        McpClient::Goose
    };
    if args.create_key && url.is_none() {
        anyhow::bail!("--create-key makes a key for a server: give its --url (the local data directory needs no key)");
    }
    let key = match (&url, args.create_key) {
        (None, _) => None,
        (Some(_), true) => {
            let key =
                forkbox_server::create_key_full(home, &args.tenant, &forkbox_server::KeyLimits::defaults(), false)
                    .context("creating an API key in the local data directory")?;
            eprintln!("forkbox: created an API key for tenant {} in {}", args.tenant, home.display());
            Some(key)
        }
        (Some(_), false) => api_key.filter(|k| !k.is_empty()),
    };
    let program = stable_program()?;
    // The data directory always, as an absolute path: a client launches `forkbox mcp` without the
    // caller's environment (no $FORKBOX_HOME, $XDG_DATA_HOME), and then the server running on that
    // directory (its server.json) is the one the entry uses.
    let chosen = if url.is_none() { Some(home) } else { home_flag };
    let home = chosen.map(|h| std::path::absolute(h).unwrap_or_else(|_| h.to_path_buf()));
    let launch = Launch { program, home, url: url.clone(), key: key.clone() };
    let placeholder = url.is_some() && key.is_none();
    if !args.write {
        println!("{}", install::snippet(client, &launch).trim_end());
        if placeholder {
            eprintln!(
                "forkbox: replace the FORKBOX_API_KEY placeholder with your API key (or pass --api-key KEY, or \
                 --create-key when the server runs on this data directory)"
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if client == McpClient::ClaudeCode {
        let status = std::process::Command::new("claude").args(launch.claude_code_args()).status();
        return match status {
            Ok(s) if s.success() => {
                println!("added forkbox to Claude Code (`claude mcp list` shows it)");
                Ok(ExitCode::SUCCESS)
            }
            Ok(s) => anyhow::bail!(
                "`claude mcp add` failed ({s}); run it yourself: {}",
                install::snippet(client, &launch).trim_end()
            ),
            Err(e) => anyhow::bail!(
                "cannot run `claude` ({e}): install Claude Code, or run: {}",
                install::snippet(client, &launch).trim_end()
            ),
        };
    }
    let user_home = std::env::var_os("HOME").map(PathBuf::from).ok_or(install::InstallError::NoHome)?;
    let path = client.config_path(&user_home).ok_or(install::InstallError::NoFile)?;
    let w = install::write(client, &path, &launch)?;
    match &w.backup {
        Some(b) => println!("wrote {} (previous version in {})", w.path.display(), b.display()),
        None => println!("wrote {}", w.path.display()),
    }
    if placeholder {
        println!("set FORKBOX_API_KEY in that entry to your API key; then restart the client");
    } else {
        println!("restart the client to load forkbox");
    }
    Ok(ExitCode::SUCCESS)
}
