//! The API's JSON shapes: the wire types of [`forkbox_api::wire`] (the ones
//! the server takes and returns), under the names this client has always used,
//! and the client's own options types that build requests from them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use forkbox_api::wire::commands::{
    CommandLineBody as CommandLine, CommandResponse as CommandResult, OneShotCommand, SessionCommand,
};
pub use forkbox_api::wire::errors::ErrorDetail;
pub use forkbox_api::wire::exec::{
    BatchItem, BatchItemError, BatchRequest, BatchResponse as BatchResult, ExecRequest, ExecResponse as ExecResult,
    MimeBundle, OutputFileBody as OutputFile, PyErrorBody as PyError, SessionExec,
};
pub use forkbox_api::wire::files::{FileEntryBody as FileEntry, FileWritten};
pub use forkbox_api::wire::network::{NetworkMode, NetworkSetting as Network};
pub use forkbox_api::wire::packages::{InstallPackages, InstalledPackage, InstalledPackages as Packages};
pub use forkbox_api::wire::processes::{ProcessInfo, ProcessOutput, SignalRequest, StdinRequest, WaitRequest};
pub use forkbox_api::wire::server::{NodeBody as Node, NodeList};
pub use forkbox_api::wire::sessions::{
    Checkpoint, CreateSession, ForkRequest, ForkedFrom, PatchSession, RevertRequest, SecretInfo, SecretSpec, Session,
    SessionLimits,
};
pub use forkbox_api::wire::templates::{
    CheckpointTemplateRequest, CreateTemplateRequest as CreateTemplate, TemplateBody as TemplateInfo, TemplateList,
};

/// Options of a one-shot exec (all optional: the server's defaults apply).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExecOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Template to fork (the server's default if None).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Outbound network of this exec (narrows the server's and the key's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

impl ExecOptions {
    /// The body of `POST /v1/exec` (and `/exec/stream`) running `code` with these options.
    pub fn request(&self, code: &str) -> ExecRequest {
        ExecRequest {
            code: code.to_string(),
            timeout_seconds: self.timeout_seconds,
            template: self.template.clone(),
            network: self.network.clone(),
        }
    }
}

/// A command (`POST /v1/commands`, `POST /v1/sessions/{id}/commands`); None fields take the defaults.
#[derive(Clone, Debug, Serialize)]
pub struct CommandRequest {
    pub cmd: CommandLine,
    /// Directory it starts in (default: the guest's working directory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Variables laid over the guest's environment.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// One-shot commands only: the template to fork (None: the server's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// One-shot commands only: outbound network (narrows the server's and the key's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

impl CommandRequest {
    pub fn new(cmd: CommandLine) -> CommandRequest {
        CommandRequest { cmd, cwd: None, env: BTreeMap::new(), timeout_seconds: None, template: None, network: None }
    }
}

impl CommandRequest {
    /// The body of `POST /v1/commands`.
    pub fn one_shot(&self) -> OneShotCommand {
        OneShotCommand {
            cmd: self.cmd.clone(),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
            timeout_seconds: self.timeout_seconds,
            template: self.template.clone(),
            network: self.network.clone(),
        }
    }

    /// The body of `POST /v1/sessions/{id}/commands` (a session has its
    /// template and network policy: the caller refuses those first).
    pub fn in_session(&self, background: bool, stdin: bool) -> SessionCommand {
        SessionCommand {
            cmd: self.cmd.clone(),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
            timeout_seconds: self.timeout_seconds,
            background,
            stdin,
            pty: None,
        }
    }
}

/// `{code, message}` of an API error (with `stdout`/`stderr` for an exec that failed after it ran),
/// read leniently: the code stays a string, so that one this client does not know still reads
/// (the server's full shape is [`ErrorDetail`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ApiErrorBody {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
}

impl ApiErrorBody {
    /// What the failed exec wrote, if the error carries it.
    pub fn output(&self) -> Option<ExecOutput> {
        (self.stdout.is_some() || self.stderr.is_some()).then(|| ExecOutput {
            stdout: self.stdout.clone().unwrap_or_default(),
            stderr: self.stderr.clone().unwrap_or_default(),
        })
    }
}

/// What an exec wrote to stdout/stderr before it failed (timeout, crash, exit, kill).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: String,
    pub stderr: String,
}
