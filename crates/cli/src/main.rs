//! `forkbox`: run AI-generated Python in kernel-less KVM sandboxes.

mod api;
mod bench;
mod mcp;
mod repl;
mod run;
mod session;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "forkbox", version, about = "Run untrusted Python in hardware-isolated KVM sandboxes")]
struct Cli {
    /// Data directory (images, templates, sessions). Default: $FORKBOX_HOME or ~/.local/share/forkbox.
    #[arg(long, global = true, env = "FORKBOX_HOME")]
    home: Option<PathBuf>,
    /// Talk to a running forkbox server at this URL instead of running embedded on the data directory
    /// (run, repl, session and mcp commands).
    #[arg(long, global = true, env = "FORKBOX_URL", value_name = "URL")]
    url: Option<String>,
    /// API key for --url (default: $FORKBOX_API_KEY).
    #[arg(long, global = true, env = "FORKBOX_API_KEY", hide_env_values = true, value_name = "KEY")]
    api_key: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the HTTP API (builds the image and template if missing; prints where it listens and an API key).
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Use this image file instead of the default image.
        #[arg(long, value_name = "FILE")]
        image: Option<PathBuf>,
        /// Outbound network of every sandbox: `public` (the public internet; loopback, private,
        /// link-local/metadata, CGNAT, multicast and this host's addresses refused), `none`, or
        /// `allowlist` (only what --egress-allow names). Requests can only narrow it.
        #[arg(long, value_enum, default_value = "public")]
        egress: EgressMode,
        /// An allow rule (repeatable): `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`, `example.com`, `*.example.com:443`.
        /// An address/CIDR rule opens even a non-public address; a host-name rule only public ones.
        #[arg(long, value_name = "RULE")]
        egress_allow: Vec<String>,
        /// A deny rule (repeatable), same forms (`*:25` denies a port everywhere). Deny rules win.
        #[arg(long, value_name = "RULE")]
        egress_deny: Vec<String>,
    },
    /// API keys for the HTTP API.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Run Python code in a fresh sandbox and print its output.
    Run(run::RunArgs),
    /// Interactive Python prompt on a session (a new one if none is given); state persists across lines.
    Repl {
        /// The session to attach to.
        session: Option<String>,
        #[command(flatten)]
        image: ImageArgs,
    },
    /// Build or inspect guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Sessions: Python REPLs whose state persists; every exec is a checkpoint.
    #[command(subcommand)]
    Session(session::SessionCommand),
    /// Templates: warm, snapshotted interpreters that sandboxes fork from.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// MCP server on stdio for LLM clients (local data directory, or --url); `mcp install` configures a client.
    Mcp(mcp::McpArgs),
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Create an API key for a tenant (only its hash is stored); prints the key. Limits default to unlimited.
    Create {
        #[arg(long, default_value = "default")]
        tenant: String,
        /// Requests per second (token bucket; also the burst); over it: 429 rate_limited.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=u32::MAX as u64))]
        rate_limit: Option<u64>,
        /// Sessions the tenant may have at once; over it: 403 quota_exceeded.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_sessions: Option<u64>,
        /// Checkpoint disk of the tenant's sessions, MiB; over it execs and uploads get 403 quota_exceeded.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_disk_mb: Option<u64>,
    },
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// List the templates in the data directory.
    Ls,
    /// Build (or verify) the template for an image and preload.
    Build {
        #[arg(long, default_value = "import numpy")]
        preload: String,
        #[command(flatten)]
        image: ImageArgs,
    },
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Build the guest image from Debian packages (reused if its inputs did not change).
    Build(ImageArgs),
}

#[derive(Args, Clone, Debug, Default)]
pub struct ImageArgs {
    /// Extra Debian packages to add to the image (e.g. python3-pandas).
    #[arg(long = "apt", value_name = "PACKAGE")]
    pub apt: Vec<String>,
    /// Use this image file instead of building one.
    #[arg(long, value_name = "FILE")]
    pub image: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORKBOX_LOG").unwrap_or_else(|_| "warn,forkbox::syscall=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    raise_fd_limit();
    let home = cli.home.clone().unwrap_or_else(forkbox_image::default_home);
    let result = match cli.command {
        Command::Serve { listen, image, egress, egress_allow, egress_deny } => {
            egress_policy(egress, &egress_allow, &egress_deny).and_then(|policy| serve(&home, listen, image, policy))
        }
        Command::Key(KeyCommand::Create { tenant, rate_limit, max_sessions, max_disk_mb }) => {
            let limits = forkbox_server::KeyLimits { rate_limit, max_sessions, max_disk_mb };
            forkbox_server::create_key_with(&home, &tenant, &limits).map(|k| {
                println!("{k}");
                ExitCode::SUCCESS
            })
        }
        Command::Run(args) => match &cli.url {
            Some(url) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| run::run_remote(&a, args)),
            None => run::run(&home, args),
        },
        Command::Repl { session, image } => match &cli.url {
            Some(url) => api::Api::remote(url, cli.api_key.clone()),
            None => api::Api::embedded(&home, &image),
        }
        .and_then(|a| repl::repl(&a, &home, session)),
        Command::Image(ImageCommand::Build(args)) => {
            run::ensure_image(&home, &args, true).map(|(path, id)| {
                println!("{id} {}", path.display());
                ExitCode::SUCCESS
            })
        }
        Command::Session(cmd) => match &cli.url {
            Some(url) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| session::session_remote(&a, cmd)),
            None => session::session(&home, cmd),
        },
        Command::Template(TemplateCommand::Ls) => template_ls(&home),
        Command::Template(TemplateCommand::Build { preload, image }) => template_build(&home, &preload, &image),
        Command::Bench(cmd) => bench::bench(&home, cmd),
        Command::Mcp(args) => mcp::mcp(&home, cli.home.as_deref(), cli.url.clone(), args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("forkbox: error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum EgressMode {
    None,
    Public,
    Allowlist,
}

fn egress_policy(mode: EgressMode, allow: &[String], deny: &[String]) -> anyhow::Result<forkbox_engine::NetPolicy> {
    let parse = |v: &[String]| -> anyhow::Result<Vec<forkbox_engine::NetRule>> {
        v.iter().map(|r| r.parse::<forkbox_engine::NetRule>().map_err(|e| anyhow::anyhow!("{e}"))).collect()
    };
    let mode = match mode {
        EgressMode::None => forkbox_engine::NetMode::None,
        EgressMode::Public => forkbox_engine::NetMode::Public,
        EgressMode::Allowlist => forkbox_engine::NetMode::Allowlist,
    };
    Ok(forkbox_engine::NetPolicy { mode, allow: parse(allow)?, deny: parse(deny)? })
}

fn serve(home: &std::path::Path, listen: std::net::SocketAddr, image: Option<PathBuf>, egress: forkbox_engine::NetPolicy) -> anyhow::Result<ExitCode> {
    let mut cfg = forkbox_server::ServerConfig::new(listen, home.to_path_buf());
    cfg.image = image;
    cfg.limits.network = forkbox_engine::NetConfig::with_policy(egress);
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(forkbox_server::serve(cfg))?;
    Ok(ExitCode::SUCCESS)
}

fn template_ls(home: &std::path::Path) -> anyhow::Result<ExitCode> {
    let list = forkbox_engine::template::list(home);
    if list.is_empty() {
        println!("no templates in {}", forkbox_engine::template::templates_dir(home).display());
    }
    for (dir, info) in list {
        match info {
            Ok(i) => println!(
                "{}  image {}  preload {:?}  python {}  numpy {}  {} pages  boot {:.0} ms",
                i.id,
                &i.image_id[..12.min(i.image_id.len())],
                i.preload,
                i.agent.get("python").and_then(|v| v.as_str()).unwrap_or("?"),
                i.agent.get("numpy").and_then(|v| v.as_str()).unwrap_or("-"),
                i.memory_pages,
                i.boot_ms
            ),
            Err(e) => println!("{}  unreadable: {e}", dir.display()),
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn template_build(home: &std::path::Path, preload: &str, image: &ImageArgs) -> anyhow::Result<ExitCode> {
    let (path, _) = run::ensure_image(home, image, true)?;
    let engine = forkbox_engine::Engine::open(&path)?.with_preload(preload);
    let t = forkbox_engine::Template::ensure(&engine, home)?;
    println!("{} {}", t.info.id, t.dir.display());
    Ok(ExitCode::SUCCESS)
}

/// Every sandbox holds a few fds (VM, vCPU): allow as many as the hard limit.
fn raise_fd_limit() {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

/// An error chain as one line.
fn one_line(e: &anyhow::Error) -> String {
    e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ").replace('\n', " ")
}

