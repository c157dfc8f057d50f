//! The MCP server's instructions and the state-dependent part of its tool
//! descriptions, written from what the server really allows the caller
//! ([`Capabilities`], `GET /v1/capabilities`): its templates and their packages,
//! run-time installs, its egress policy, its key's secrets (names only), its limits.

use forkbox_client::Capabilities;

/// What every deployment says, whatever the server's state: the tools and how they fit together.
const USAGE: &str = "Use run_python for a one-off computation (nothing persists); run_command runs a shell command \
line (ls, grep, a pipeline, python3 script.py) in a session's files or a fresh sandbox. For multi-step work, \
create_session and call exec repeatedly: variables, imports and files persist between execs, like a notebook. Every \
exec in a session is a checkpoint: if the state goes bad (an exec broke something, a variable was overwritten), call \
list_checkpoints and revert to an earlier one instead of starting over. To try several approaches from the same state, \
try_alternatives runs them in parallel and returns every result (keep the best as a new session); fork_session \
branches one by hand; inspect_checkpoint and diff_checkpoints show a checkpoint's variables and what changed; \
save_template keeps a checkpoint as a template of your own. Image files (PNG) the code writes under /output, and \
matplotlib figures it leaves open, are returned as images with the result. To give the code a user's file (a CSV, a \
JSON document, an image), upload_file it into a session and open it by that path in exec; download_file and \
list_files read what the code wrote. If an exec runs too long, interrupt it. start_process runs a command in the \
background of a session (a server, a long job) while you go on; read_process_output, list_processes and \
kill_process follow and stop it. Delete sessions you no longer need.";

/// The instructions for a caller with `caps`; None: the server could not be asked
/// (then nothing about templates, packages or network is claimed).
pub fn instructions(caps: Option<&Capabilities>) -> String {
    let mut s = String::from("forkbox runs Python 3.11 code in isolated sandboxes (hardware-isolated VMs).\n");
    match caps {
        Some(c) => {
            s.push_str(&templates(c));
            s.push('\n');
            s.push_str(&packages(c));
            s.push('\n');
            s.push_str(&network(c));
            s.push('\n');
            if let Some(secrets) = secrets(c) {
                s.push_str(&secrets);
                s.push('\n');
            }
            s.push_str(&limits(c));
            s.push('\n');
        }
        None => s.push_str(
            "Call list_sessions or run_python to reach the server; the templates it offers are named in \
             run_python's description.\n",
        ),
    }
    s.push_str(USAGE);
    s
}

/// The templates, one per line, with their packages.
pub fn templates(c: &Capabilities) -> String {
    let mut s = format!(
        "Templates you may use (argument template of run_python and create_session; default {:?}):\n",
        c.default_template
    );
    for t in &c.templates {
        let state = match t.status.as_str() {
            "ready" => String::new(),
            "available" => " [built on first use: the first call may take a minute or two]".into(),
            "building" => " [being built: a call may wait for it]".into(),
            other => format!(" [{other}]"),
        };
        let what = if t.source == "custom" {
            let mut parts = Vec::new();
            if !t.packages.is_empty() {
                parts.push(format!("Debian packages {}", t.packages.join(", ")));
            }
            if !t.pip.is_empty() {
                parts.push(format!("pip {}", t.pip.join(", ")));
            }
            if parts.is_empty() {
                t.description.clone()
            } else {
                format!("Python 3.11 + numpy + {}", parts.join("; "))
            }
        } else {
            t.description.clone()
        };
        let default = if t.name == c.default_template { " (default)" } else { "" };
        let secrets =
            if t.secrets.is_empty() { String::new() } else { format!("; secrets in ${}", t.secrets.join(", $")) };
        s.push_str(&format!("- {}{default}: {what}{secrets}{state}\n", t.name));
    }
    s.trim_end().to_string()
}

/// Whether and what may be installed at run time.
pub fn packages(c: &Capabilities) -> String {
    let p = &c.packages;
    if !p.allowed {
        return "Installing packages at run time is not allowed on this server: use a template that has them.".into();
    }
    let mut s = format!(
        "Other packages: install_packages installs pip packages (binary wheels, from {}) into a session, which \
         keeps them in its checkpoints and forks (in a session's code, %pip install NAME does the same)",
        p.source
    );
    if !p.allow.is_empty() {
        s.push_str(&format!("; only these may be installed (with their dependencies): {}", p.allow.join(", ")));
    }
    if !p.deny.is_empty() {
        s.push_str(&format!("; never these: {}", p.deny.join(", ")));
    }
    s.push('.');
    s
}

/// The caller's egress policy.
pub fn network(c: &Capabilities) -> String {
    let n = &c.network;
    let what = match n.mode.as_str() {
        "none" => "no outbound network at all".to_string(),
        "allowlist" => "only the destinations the rules below allow".to_string(),
        _ => "the public internet (private and local addresses refused unless a rule below allows them)".to_string(),
    };
    let mut s = format!("Outbound network: {what}");
    if !n.layers.is_empty() {
        s.push_str(&format!(" ({})", n.layers.join("; ")));
    }
    if n.mode != "none" {
        s.push_str(". The argument network only narrows it (network: \"none\" turns it off)");
    }
    s.push('.');
    s
}

/// The key's secrets, by name and destination (never a value); None: it has none.
pub fn secrets(c: &Capabilities) -> Option<String> {
    if c.secrets.is_empty() {
        return None;
    }
    let each: Vec<String> = c
        .secrets
        .iter()
        .map(|x| {
            let ports = if x.ports.is_empty() {
                String::new()
            } else {
                format!(" port {}", x.ports.iter().map(u16::to_string).collect::<Vec<_>>().join("/"))
            };
            let tls = if x.tls { ", HTTPS too" } else { "" };
            format!("${} (for {}{ports}{tls})", x.name, x.hosts.join(", "))
        })
        .collect();
    Some(format!(
        "Secrets: every sandbox has these environment variables, whose values are placeholders the server replaces \
         with the real credential in the headers of HTTP requests to the hosts named: {}. Send them as they are \
         (e.g. an Authorization header); printing one shows only its placeholder.",
        each.join("; ")
    ))
}

/// The limits.
pub fn limits(c: &Capabilities) -> String {
    let l = &c.limits;
    let mut s = format!(
        "Limits: an exec runs at most {} s unless timeout_seconds says otherwise (up to {} s); a sandbox has {} MiB of \
         memory (create_session memory_mb up to {}); {} KiB of stdout/stderr are kept per exec",
        l.timeout_seconds, l.max_timeout_seconds, l.memory_mb, l.max_memory_mb, l.output_bytes >> 10
    );
    if let Some(n) = l.max_sessions {
        s.push_str(&format!("; at most {n} sessions at once"));
    }
    if let Some(n) = l.rate_limit {
        s.push_str(&format!("; {n} requests per second"));
    }
    if let Some(n) = l.cpu_seconds_per_hour {
        s.push_str(&format!("; {n} CPU seconds per hour"));
    }
    s.push('.');
    s
}

/// The state-dependent sentence appended to a tool's description (None: nothing to add).
pub fn tool_addendum(tool: &str, c: &Capabilities) -> Option<String> {
    match tool {
        "run_python" | "create_session" => Some(templates(c)),
        "install_packages" => Some(packages(c)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use forkbox_api::capabilities::*;

    use super::*;

    fn caps() -> Capabilities {
        Capabilities {
            templates: vec![
                TemplateCapability {
                    name: "python".into(),
                    description: "Python 3.11 + numpy".into(),
                    status: "ready".into(),
                    source: "shipped".into(),
                    ..Default::default()
                },
                TemplateCapability {
                    name: "data".into(),
                    description: "Python 3.11 + numpy, pandas".into(),
                    status: "available".into(),
                    source: "shipped".into(),
                    ..Default::default()
                },
            ],
            default_template: "python".into(),
            packages: PackagesCapability {
                allowed: true,
                allow: vec![],
                deny: vec!["evil".into()],
                source: "PyPI".into(),
            },
            network: NetworkCapability { mode: "public".into(), layers: vec!["server: public".into()] },
            secrets: vec![],
            limits: LimitsCapability {
                timeout_seconds: 30.0,
                max_timeout_seconds: 600.0,
                memory_mb: 2048,
                max_memory_mb: 4096,
                output_bytes: 1 << 20,
                ..Default::default()
            },
        }
    }

    #[test]
    fn says_what_the_state_allows() {
        let s = instructions(Some(&caps()));
        assert!(s.contains("- data: Python 3.11 + numpy, pandas [built on first use"), "{s}");
        assert!(s.contains("install_packages installs pip packages") && s.contains("never these: evil"), "{s}");
        assert!(!s.contains("no pip") && !s.contains("cannot be installed"), "{s}");
        let mut c = caps();
        c.packages.allowed = false;
        c.network.mode = "none".into();
        let s = instructions(Some(&c));
        assert!(s.contains("not allowed") && s.contains("no outbound network"), "{s}");
        assert!(!s.contains("Secrets"), "{s}");
    }

    #[test]
    fn names_the_keys_and_the_templates_secrets() {
        let mut c = caps();
        c.secrets = vec![
            SecretCapability {
                name: "OPENAI_API_KEY".into(),
                hosts: vec!["api.openai.com".into()],
                ports: vec![443],
                tls: true,
            },
            SecretCapability {
                name: "GH".into(),
                hosts: vec!["api.github.com".into(), "*.github.com".into()],
                ..Default::default()
            },
        ];
        c.templates[1].secrets = vec!["DB_URL".into()];
        let s = instructions(Some(&c));
        assert!(
            s.contains(
                "$OPENAI_API_KEY (for api.openai.com port 443, HTTPS too); $GH (for api.github.com, *.github.com)"
            ),
            "{s}"
        );
        assert!(s.contains("- data: Python 3.11 + numpy, pandas; secrets in $DB_URL [built on first use"), "{s}");
    }
}
