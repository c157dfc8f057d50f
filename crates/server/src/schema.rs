//! The server's side of the `/v1` wire types: they are defined once in
//! [`forkbox_api::wire`] (with the `openapi` feature the document is derived
//! from them, so the two cannot drift apart); here is what turns the runtime's
//! results into them and requests into the runtime's typed operations.

use std::collections::BTreeMap;

use base64::Engine as _;
pub use forkbox_api::wire::commands::*;
pub use forkbox_api::wire::exec::*;
pub use forkbox_api::wire::files::*;
pub use forkbox_api::wire::network::*;
pub use forkbox_api::wire::packages::*;
pub use forkbox_api::wire::processes::*;
pub use forkbox_api::wire::server::*;
pub use forkbox_api::wire::sessions::*;
pub use forkbox_api::wire::templates::*;
pub use forkbox_api::wire::tree::*;
use forkbox_runtime::{CheckpointView, ExecOutcome, ExecResult, OneShot, SessionView};

/// The policy layer a request's `network` adds (rule errors name the rule).
pub fn policy_of(setting: &NetworkSetting) -> Result<forkbox_runtime::NetPolicy, String> {
    use forkbox_runtime::{NetPolicy as Policy, NetRule as Rule};
    let parse = |v: &[String]| -> Result<Vec<Rule>, String> {
        if v.len() > 256 {
            return Err("at most 256 network rules".into());
        }
        v.iter().map(|r| r.parse::<Rule>().map_err(|e| e.to_string())).collect()
    };
    let rate = |r: Option<u64>| match r {
        Some(0) => Err("max_bytes_per_second must be at least 1".to_string()),
        r => Ok(r),
    };
    let mode = |m: NetworkMode| match m {
        NetworkMode::None => Policy::none(),
        NetworkMode::Public => Policy::public(),
    };
    Ok(match setting {
        NetworkSetting::Mode(m) => mode(*m),
        NetworkSetting::Rules { allow, deny, max_bytes_per_second } => {
            Policy { deny: parse(deny)?, ..Policy::allowlist(parse(allow)?).with_rate(rate(*max_bytes_per_second)?) }
        }
        NetworkSetting::Limited { mode: m, max_bytes_per_second } => {
            mode(*m).with_rate(rate(Some(*max_bytes_per_second))?)
        }
    })
}

/// A request's `network` as a policy layer (a bad rule is 400 `invalid_request`).
pub fn network_policy(
    n: &Option<NetworkSetting>,
) -> Result<Option<forkbox_runtime::NetPolicy>, crate::error::ApiError> {
    n.as_ref().map(|n| policy_of(n).map_err(|e| crate::error::ApiError::invalid(format!("network: {e}")))).transpose()
}

/// The policy layers a caller's sandbox gets inside the server's: its key's
/// (`forkbox key create --egress`), then the request's `network`. Each only narrows.
pub fn network_layers(
    caller: &crate::auth::Caller,
    n: &Option<NetworkSetting>,
) -> Result<Vec<forkbox_runtime::NetPolicy>, crate::error::ApiError> {
    let mut layers: Vec<_> = caller.limits().and_then(|l| l.egress.clone()).into_iter().collect();
    layers.extend(network_policy(n)?);
    Ok(layers)
}

/// The effective network policy as shown to clients.
pub fn network_view(net: &forkbox_runtime::NetConfig) -> serde_json::Value {
    serde_json::json!({ "mode": net.mode(), "max_bytes_per_second": net.max_bytes_per_second(), "layers": net.layers })
}

/// What is shown of each of `secrets` (names and destinations, never values).
pub fn secret_infos(secrets: &[forkbox_runtime::net_secrets::SealedSecret]) -> Vec<SecretInfo> {
    secrets.iter().map(|s| s.info()).collect()
}

/// A request's secrets, validated and sealed with the server's key (a bad
/// one is 400 `invalid_request`).
pub fn seal_secrets(
    secrets: &BTreeMap<String, SecretSpec>,
) -> Result<Vec<forkbox_runtime::net_secrets::SealedSecret>, crate::error::ApiError> {
    use crate::error::ApiError;
    use forkbox_runtime::net_secrets::{self, SecretError};
    if secrets.len() > net_secrets::SECRETS_MAX {
        return Err(ApiError::invalid(format!(
            "secrets: at most {} (per session, template or key)",
            net_secrets::SECRETS_MAX
        )));
    }
    secrets
        .iter()
        .map(|(name, s)| {
            let Some(value) = s.value.as_str() else {
                return Err(ApiError::invalid(format!("secrets: {name}: the value must be a string")));
            };
            net_secrets::seal_new(name, value, &s.hosts, &s.ports, s.tls).map_err(|e| match e {
                SecretError::Invalid(_) => ApiError::invalid(e.to_string()),
                _ => ApiError::internal(e.to_string()),
            })
        })
        .collect()
}

/// A terminal size if both are in 1..=10000 (else 400 `invalid_request`).
pub fn pty_size(size: PtySize) -> Result<(u16, u16), crate::error::ApiError> {
    if !(1..=10_000).contains(&size.rows) || !(1..=10_000).contains(&size.cols) {
        return Err(crate::error::ApiError::invalid(format!(
            "pty size {}x{} is out of range (rows and cols 1 to 10000)",
            size.rows, size.cols
        )));
    }
    Ok((size.rows, size.cols))
}

/// A command's request as the runtime's validated [`forkbox_runtime::Command`] (400 if bad).
pub fn command_of(
    cmd: CommandLineBody,
    cwd: Option<String>,
    env: BTreeMap<String, String>,
) -> Result<forkbox_runtime::Command, crate::error::ApiError> {
    let line = match cmd {
        CommandLineBody::Shell(s) => forkbox_runtime::CommandLine::Shell(s),
        CommandLineBody::Argv(v) => forkbox_runtime::CommandLine::Argv(v),
    };
    Ok(forkbox_runtime::Command::new(line, cwd, env)?)
}

/// A command's response from the runtime's result.
pub trait CommandResponseOf {
    fn of(r: &ExecResult) -> CommandResponse;
    fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> CommandResponse;
    fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> CommandResponse;
}

impl CommandResponseOf for CommandResponse {
    fn of(r: &ExecResult) -> CommandResponse {
        let c = forkbox_runtime::CommandResult::of(r);
        CommandResponse {
            stdout: c.stdout,
            stderr: c.stderr,
            exit_code: c.exit_code,
            runtime_ms: r.runtime_ms,
            wall_ms: r.wall_ms,
            checkpoint: None,
            id: None,
            total_time_ms: None,
            outputs: ExecResponse::of(r).outputs,
        }
    }

    fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> CommandResponse {
        let mut v = CommandResponse::of(&o.result);
        v.checkpoint = Some(o.checkpoint.seq);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

    fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> CommandResponse {
        let mut v = CommandResponse::of(&o.result);
        v.id = Some(o.id.clone());
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }
}

/// An exec's response from the runtime's result.
pub trait ExecResponseOf {
    /// A one-shot exec's response, with its id and timing (`t0`: when the request came in).
    fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> ExecResponse;
    /// A session exec's response, naming its checkpoint.
    fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> ExecResponse;
    fn of(r: &ExecResult) -> ExecResponse;
}

impl ExecResponseOf for ExecResponse {
    fn of_oneshot(o: &OneShot, t0: std::time::Instant) -> ExecResponse {
        let mut v = ExecResponse::of(&o.result);
        v.id = Some(o.id.clone());
        v.fork_time_ms = Some(o.fork_ms);
        v.exec_time_ms = Some(o.exec_ms);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

    fn of_session(o: &ExecOutcome, t0: std::time::Instant) -> ExecResponse {
        let mut v = ExecResponse::of(&o.result);
        v.checkpoint = Some(o.checkpoint.seq);
        v.total_time_ms = Some(t0.elapsed().as_secs_f64() * 1000.0);
        v
    }

    fn of(r: &ExecResult) -> ExecResponse {
        ExecResponse {
            value: r.value.clone(),
            stdout: r.stdout.clone(),
            stderr: r.stderr.clone(),
            error: r.error.as_ref().map(|e| PyErrorBody {
                kind: e.kind.clone(),
                message: e.message.clone(),
                traceback: e.traceback.clone(),
            }),
            exit_code: if r.error.is_some() { 1 } else { 0 },
            runtime_ms: r.runtime_ms,
            wall_ms: r.wall_ms,
            syscalls: r.syscalls,
            id: None,
            fork_time_ms: None,
            exec_time_ms: None,
            total_time_ms: None,
            checkpoint: None,
            value_data: r.value_data.clone().map(MimeBundle),
            display: r.display.iter().cloned().map(MimeBundle).collect(),
            outputs: r
                .outputs
                .iter()
                .map(|o| OutputFileBody {
                    path: o.path.clone(),
                    size: o.size,
                    mime: o.mime.to_string(),
                    base64: o.data.as_ref().map(|d| base64::engine::general_purpose::STANDARD.encode(d)),
                })
                .collect(),
        }
    }
}

/// A session as the API shows it, from the runtime's view of it.
pub trait SessionOf {
    fn of(v: &SessionView) -> Session;
}

impl SessionOf for Session {
    fn of(v: &SessionView) -> Session {
        let network = v.network();
        Session {
            id: v.record.id.clone(),
            tags: v.record.tags.clone(),
            created_ms: v.record.created_ms,
            last_used_ms: v.record.last_used_ms,
            resident: v.resident,
            checkpoint: v.checkpoint,
            forked_from: v
                .forked_from
                .as_ref()
                .map(|f| ForkedFrom { session: f.session.clone(), checkpoint: f.checkpoint }),
            limits: SessionLimits {
                memory_mb: v.memory_mb(),
                timeout_seconds: v.timeout_seconds(),
                network: network_view(&network),
            },
            template: v.template.clone(),
            template_id: v.record.template_id.clone(),
            last_code: v.last_code.clone(),
            secrets: secret_infos(&network.secrets),
        }
    }
}

/// An install's response from the runtime's outcome.
pub trait InstalledPackagesOf {
    fn of(o: &forkbox_runtime::PackagesOutcome) -> InstalledPackages;
}

impl InstalledPackagesOf for InstalledPackages {
    fn of(o: &forkbox_runtime::PackagesOutcome) -> InstalledPackages {
        InstalledPackages {
            packages: o
                .packages
                .iter()
                .map(|p| InstalledPackage {
                    name: p.name.clone(),
                    version: p.version.clone(),
                    wheel: p.wheel.clone(),
                    sha256: p.sha256.clone(),
                    installed: p.installed,
                    files: p.files,
                })
                .collect(),
            output: o.output.clone(),
            checkpoint: o.checkpoint.as_ref().map(|c| c.seq),
        }
    }
}

/// A checkpoint as the API shows it.
pub trait CheckpointOf {
    fn of(c: &CheckpointView) -> Checkpoint;
}

impl CheckpointOf for Checkpoint {
    fn of(c: &CheckpointView) -> Checkpoint {
        Checkpoint {
            seq: c.seq,
            parent: c.parent,
            code: c.code.clone(),
            created_ms: c.created_ms,
            bytes: c.bytes,
            pages: c.pages,
            head: c.head,
        }
    }
}
