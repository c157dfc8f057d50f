//! `forkbox`: run AI-generated Python in kernel-less KVM sandboxes.

mod bench;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "forkbox", version, about = "Run untrusted Python in hardware-isolated KVM sandboxes")]
struct Cli {
    /// Data directory (images, templates, sessions). Default: $FORKBOX_HOME or ~/.local/share/forkbox.
    #[arg(long, global = true, env = "FORKBOX_HOME")]
    home: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run Python code in a fresh sandbox and print its output.
    Run(run::RunArgs),
    /// Build or inspect guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
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
    let home = cli.home.clone().unwrap_or_else(forkbox_image::default_home);
    let result = match cli.command {
        Command::Run(args) => run::run(&home, args),
        Command::Image(ImageCommand::Build(args)) => {
            run::ensure_image(&home, &args, true).map(|(path, id)| {
                println!("{id} {}", path.display());
                ExitCode::SUCCESS
            })
        }
        Command::Bench(cmd) => bench::bench(&home, cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("forkbox: error: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

/// An error chain as one line.
fn one_line(e: &anyhow::Error) -> String {
    e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ").replace('\n', " ")
}
