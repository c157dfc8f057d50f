//! `forkbox sh CMD` (a fresh sandbox) and `forkbox session sh ID CMD` (in a
//! session's file system): a command through the API's command routes, its
//! stdout/stderr printed as it writes them, the CLI exiting with its exit code.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use anyhow::{bail, Result};
use forkbox_client::{ClientError, CommandLine, CommandRequest, CommandResult, StreamEvent};
use futures_util::StreamExt;

use crate::api::Api;

#[derive(clap::Args, Clone, Debug)]
pub struct ShArgs {
    /// One argument is a shell command line (run by `/bin/sh -c`); several are an argv, run without a shell.
    #[arg(required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    pub cmd: Vec<String>,
    /// Directory the command starts in (default: the guest's working directory).
    #[arg(long)]
    pub cwd: Option<String>,
    /// A variable NAME=VALUE laid over the guest's environment (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Time limit in seconds (default: the session's or the server's).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Print the result as JSON instead of the command's output.
    #[arg(long)]
    pub json: bool,
    /// One-shot only (a session command runs under the session's network).
    #[command(flatten)]
    pub network: crate::NetworkArgs,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has an empty name"));
    }
    Ok((k.to_string(), v.to_string()))
}

impl ShArgs {
    /// The request of a session command.
    pub fn session_request(&self) -> Result<CommandRequest> {
        self.request(None, true)
    }

    fn request(&self, template: Option<String>, session: bool) -> Result<CommandRequest> {
        if session && self.network.is_set() {
            bail!("--network is the session's (forkbox session new --network): a session command runs under it");
        }
        if let Some(t) = self.timeout {
            if !(t > 0.0 && t <= 86_400.0) {
                bail!("--timeout must be between 0 and 86400 seconds");
            }
        }
        let cmd = match self.cmd.as_slice() {
            [line] => CommandLine::Shell(line.clone()),
            argv => CommandLine::Argv(argv.to_vec()),
        };
        let env: BTreeMap<String, String> = self.env.iter().cloned().collect();
        let network = self.network.setting()?;
        Ok(CommandRequest { cmd, cwd: self.cwd.clone(), env, timeout_seconds: self.timeout, template, network })
    }
}

/// Run the command (in `session`, or one-shot on `template`) and exit as it did.
pub fn sh(api: &Api, session: Option<&str>, args: &ShArgs, template: Option<String>) -> Result<ExitCode> {
    let req = args.request(if session.is_some() { None } else { template }, session.is_some())?;
    let json = args.json;
    let r = api.block_on(async {
        let opened = match session {
            Some(id) => api.client.session_command_stream(id, &req).await.map(|s| s.boxed()),
            None => api.client.command_stream(&req).await.map(|s| s.boxed()),
        };
        let mut stream = opened?;
        while let Some(ev) = stream.next().await {
            match ev? {
                StreamEvent::Stdout(s) if !json => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(s.as_bytes());
                    let _ = o.flush();
                }
                StreamEvent::Stderr(s) if !json => {
                    let _ = std::io::stderr().lock().write_all(s.as_bytes());
                }
                StreamEvent::Result(v) => {
                    return serde_json::from_value::<CommandResult>(v).map_err(|e| ClientError::UnexpectedResponse {
                        status: 200,
                        message: format!("the stream's result is not a command result: {e}"),
                    })
                }
                StreamEvent::Error { code, message, output } => {
                    return Err(ClientError::from_code_with_output(code, message, output))
                }
                _ => {}
            }
        }
        Err(ClientError::StreamEnded)
    });
    if let Some(id) = session {
        api.after_exec(id);
    }
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            let out = e.output().map(|o| (o.stdout.as_str(), o.stderr.as_str()));
            crate::run::print_failure(e.code(), &e.message(), out, json, true)?;
            return Err(anyhow::Error::new(e).context("running the command"));
        }
    };
    if json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
    }
    Ok(match r.exit_code {
        0 => ExitCode::SUCCESS,
        c => ExitCode::from(u8::try_from(c).unwrap_or(255)),
    })
}
