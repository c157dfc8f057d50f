//! `GET /v1/capabilities`: what the caller may do here (the templates it may use,
//! run-time installs, its egress policy, its key's secrets, its limits), from the server's real state.

use axum::extract::State;
use axum::{Extension, Json};
use forkbox_api::capabilities::{
    Capabilities, LimitsCapability, NetworkCapability, PackagesCapability, SecretCapability, TemplateCapability,
};
use forkbox_runtime::net_secrets::SealedSecret;
use forkbox_runtime::{NetMode, NetPolicy, RuntimeConfig, TemplateListing};

use crate::auth::Caller;
use crate::quota::KeyLimits;
use crate::AppState;

/// The templates the caller may use (with the names of their secrets), whether it may install
/// packages (and which, from where), its egress policy (the server's layer and its key's), its
/// key's secrets (names and destinations, never values) and its limits.
#[utoipa::path(get, path = "/capabilities", tag = "server",
    responses((status = 200, description = "What the caller may do here", body = Capabilities)))]
pub(crate) async fn capabilities(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Json<Capabilities> {
    let rt = state.runtime.clone();
    let tenant = caller.tenant.clone();
    let templates = tokio::task::spawn_blocking(move || rt.templates(&tenant)).await.unwrap_or_default();
    let mut caps = compute(state.runtime.config(), templates, state.runtime.default_template(), caller.limits());
    caps.secrets = secret_capabilities(&caller.key_secrets());
    Json(caps)
}

/// What a caller is told of secrets: names and destinations.
pub fn secret_capabilities(secrets: &[SealedSecret]) -> Vec<SecretCapability> {
    secrets
        .iter()
        .map(|s| {
            let i = s.info();
            SecretCapability { name: i.name, hosts: i.hosts, ports: i.ports, tls: i.tls }
        })
        .collect()
}

/// [`Capabilities`] from a runtime's configuration, the templates a caller sees and its key's
/// limits (None: no key, the embedded CLI). One definition for the route and for a front end
/// that has not opened its runtime yet (`forkbox mcp` during a first build).
pub fn compute(
    config: &RuntimeConfig,
    templates: Vec<TemplateListing>,
    default_template: String,
    key: Option<&KeyLimits>,
) -> Capabilities {
    let templates = templates
        .into_iter()
        .filter(|t| t.name != "cpython-tests")
        .map(|t| TemplateCapability {
            name: t.name,
            description: t.description,
            status: t.status,
            source: t.source,
            packages: t.packages,
            pip: t.pip,
            secrets: t.secrets.into_iter().map(|s| s.name).collect(),
        })
        .collect();
    let pip = &config.pip;
    let source = if pip.no_index {
        "the server's wheelhouse (offline)".to_string()
    } else if pip.index_url.is_some() {
        "the server's package index".to_string()
    } else if pip.find_links.is_empty() {
        "PyPI".to_string()
    } else {
        "PyPI and the server's wheelhouse".to_string()
    };
    let packages = PackagesCapability {
        allowed: true,
        allow: config.packages.allow.clone(),
        deny: config.packages.deny.clone(),
        source,
    };
    let mut layers: Vec<(&str, &NetPolicy)> = config.limits.network.layers.iter().map(|p| ("server", p)).collect();
    if let Some(p) = key.and_then(|k| k.egress.as_ref()) {
        layers.push(("key", p));
    }
    let mode = if layers.iter().any(|(_, p)| p.mode == NetMode::None) || layers.is_empty() {
        "none"
    } else if layers.iter().any(|(_, p)| p.mode == NetMode::Allowlist) {
        "allowlist"
    } else {
        "public"
    };
    let network = NetworkCapability { mode: mode.into(), layers: layers.iter().map(|(w, p)| describe(w, p)).collect() };
    let key_timeout = key.and_then(|k| k.max_timeout_seconds).map(|s| s as f64);
    let max_timeout = config.max_timeout.as_secs_f64();
    let limits = LimitsCapability {
        timeout_seconds: config.limits.timeout.as_secs_f64(),
        max_timeout_seconds: key_timeout.map_or(max_timeout, |k| k.min(max_timeout)),
        memory_mb: config.limits.memory_bytes >> 20,
        max_memory_mb: config.max_memory_mb,
        output_bytes: config.limits.output_bytes as u64,
        max_sessions: key.and_then(|k| k.max_sessions),
        rate_limit: key.and_then(|k| k.rate_limit),
        cpu_seconds_per_hour: key.and_then(|k| k.cpu_seconds_per_hour),
    };
    Capabilities { templates, default_template, packages, network, secrets: Vec::new(), limits }
}

/// `server: public, allow 127.0.0.1:8000, deny *:25`.
fn describe(who: &str, p: &NetPolicy) -> String {
    let mode = match p.mode {
        NetMode::None => "none",
        NetMode::Public => "public (private and local addresses refused)",
        NetMode::Allowlist => "allowlist",
    };
    let mut s = format!("{who}: {mode}");
    if !p.allow.is_empty() {
        let r: Vec<String> = p.allow.iter().map(ToString::to_string).collect();
        s.push_str(&format!(", allow {}", r.join(" ")));
    }
    if !p.deny.is_empty() {
        let r: Vec<String> = p.deny.iter().map(ToString::to_string).collect();
        s.push_str(&format!(", deny {}", r.join(" ")));
    }
    if let Some(b) = p.max_bytes_per_second {
        s.push_str(&format!(", {b} bytes/s"));
    }
    s
}
