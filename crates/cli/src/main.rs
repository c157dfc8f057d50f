//! `forkbox`: run AI-generated Python in kernel-less KVM sandboxes.
//!
//! Place in the flow **request** -> runtime -> sessions -> engine -> vmm/linux -> guest:
//! a front end beside the server and MCP. Commands reach the API through
//! `forkbox-client` (a server at `--url`, or `forkbox_server::embedded` over
//! `forkbox_runtime::Runtime::embedded` in process); `serve` runs the server;
//! `run` and `template` drive the engine directly (no sessions, no tenants); `bench`
//! runs `forkbox-bench`'s benchmarks.

mod api;
mod bench;
mod mcp;
mod node;
mod repl;
mod run;
mod session;
mod sh;
mod term;
mod tree;

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
        /// The default template (`python`, `data`; see `forkbox template ls`); requests may name others,
        /// which are built on first use.
        #[arg(long, value_name = "NAME")]
        template: Option<String>,
        /// Serve /metrics (no auth) on this address; without it /metrics is on --listen for admin keys only.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
        /// Execs at once (exec threads); default twice the cores. One key gets half of them unless its key says otherwise.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
        exec_slots: Option<u64>,
        #[command(flatten)]
        egress: EgressArgs,
        /// A name every sandbox's resolver answers with this address (repeatable:
        /// `--egress-host api.test=127.0.0.1`) instead of asking the host; the address still
        /// goes through the egress policy. For local services and tests of name-bound rules and secrets.
        #[arg(long, value_name = "NAME=ADDR")]
        egress_host: Vec<String>,
        /// PEM certificates the relay of TLS secrets trusts too, beside the host's roots, when it
        /// connects to the real server (a private CA; tests with a loopback HTTPS server).
        #[arg(long, value_name = "PEM")]
        egress_ca_file: Option<PathBuf>,
        /// Build these shipped templates at start, in the background (repeatable: `--prebuild data`); a
        /// session or exec on one of them while it builds waits up to --template-wait-seconds.
        #[arg(long, value_name = "NAME")]
        prebuild: Vec<String>,
        /// How long a request on a template being built waits for it before 409 template_not_ready
        /// (with Retry-After).
        #[arg(long, value_name = "S", default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=3600))]
        template_wait_seconds: u64,
        /// pip's index for `POST /v1/templates` builds (default: the host pip's, i.e. PyPI).
        #[arg(long, value_name = "URL")]
        pip_index_url: Option<String>,
        /// A wheelhouse directory or URL for those builds (repeatable).
        #[arg(long, value_name = "DIR")]
        pip_find_links: Vec<String>,
        /// No index: only --pip-find-links (an air-gapped server).
        #[arg(long)]
        pip_no_index: bool,
        /// Sessions may install only these packages at run time (`%pip install`,
        /// POST /v1/sessions/{id}/packages; repeatable; dependencies included). Default: any.
        #[arg(long, value_name = "NAME")]
        pip_allow: Vec<String>,
        /// Sessions may never install this package at run time (repeatable; wins over --pip-allow).
        #[arg(long, value_name = "NAME")]
        pip_deny: Vec<String>,
        /// Where guests run: `process` (jailed sandbox worker processes: one per exec slot for
        /// one-shot execs and batches, one per tenant for sessions and the tree of states; own
        /// namespaces, an unprivileged uid, no capabilities, seccomp) or `thread` (the server's own
        /// exec threads).
        #[arg(long, value_enum, default_value = "process")]
        isolation: IsolationMode,
        /// Each sandbox worker's memory bound (its cgroup), MiB (a session worker's covers all of its tenant's
        /// resident sessions).
        #[arg(long, value_name = "MIB", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(256..))]
        worker_memory_mb: u64,
        /// Most session workers at once (one per tenant with sessions in memory); past it the least recently
        /// used idle one is stopped (its sessions stay on disk).
        #[arg(long, value_name = "N", default_value_t = forkbox_runtime::DEFAULT_SESSION_WORKERS as u64, value_parser = clap::value_parser!(u64).range(1..4096))]
        session_workers: u64,
        /// Host uid and gid of worker 0 (worker N runs as this + N): a range no account uses.
        #[arg(long, value_name = "UID", default_value_t = 900_000, value_parser = clap::value_parser!(u32).range(1..))]
        worker_uid_base: u32,
        /// Checkpoint files also in an S3-compatible object store, `s3://bucket/prefix`: each uploaded
        /// (content-addressed) before its checkpoint commits; the local directory is a cache in front of
        /// it. Endpoint and credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION.
        #[arg(long, value_name = "URL")]
        objects: Option<String>,
        /// With --objects: at most this many MiB of checkpoint files kept locally (least recently used
        /// go first; files in use or not uploaded are kept). Default: no bound.
        #[arg(long, value_name = "N", requires = "objects")]
        object_cache_mb: Option<u64>,
        /// Session metadata (sessions, checkpoints, tags) in this PostgreSQL database,
        /// `postgres://user[:password]@host[:port]/db` (also $FORKBOX_DATABASE_URL, which keeps a
        /// password out of the process list), migrated at start; API keys live there too. Without
        /// --cluster one node claims it. Default: SQLite in the data directory.
        #[arg(long, value_name = "URL", env = "FORKBOX_DATABASE_URL", hide_env_values = true)]
        database: Option<String>,
        /// Join a cluster: several `forkbox serve --cluster` on one --database and one --objects
        /// bucket serve every session. A session is resident on one node at a time (a lease in the
        /// database); a request reaching another node is forwarded to it; a node that stops
        /// heartbeating loses its sessions to the others after --lease-seconds. Also $FORKBOX_CLUSTER.
        #[arg(long, env = "FORKBOX_CLUSTER")]
        cluster: bool,
        /// This node's name in the cluster, stable across restarts (default: the host name).
        #[arg(long, value_name = "ID", env = "FORKBOX_NODE_ID", requires = "cluster")]
        node_id: Option<String>,
        /// Where the other nodes reach this node's API, `http://host:port` (default: http://<--listen>,
        /// which must then not be a wildcard address). Also $FORKBOX_ADVERTISE_URL.
        #[arg(long, value_name = "URL", env = "FORKBOX_ADVERTISE_URL", requires = "cluster")]
        advertise_url: Option<String>,
        /// Lease time: a node whose last heartbeat is older than this loses its sessions.
        #[arg(long, value_name = "S", default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=600))]
        lease_seconds: u64,
        /// E2B's API: a sandbox whose lifetime (`timeout`) ends is paused (evicted to disk,
        /// resumable with `connect`) instead of killed, whatever its `autoPause`.
        #[arg(long)]
        e2b_auto_pause: bool,
        /// Route `Host: <port>-<session id>.<DOMAIN>` to that port of the session (a wildcard
        /// DNS name for this server); E2B sandboxes report it as their `domain` (`get_host`).
        #[arg(long, value_name = "DOMAIN", env = "FORKBOX_SANDBOX_DOMAIN")]
        sandbox_domain: Option<String>,
    },
    /// API keys for the HTTP API.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Run Python code in a fresh sandbox and print its output.
    Run(run::RunArgs),
    /// Run a shell command (one argument) or an argv (several) in a fresh sandbox; exits with its exit code.
    Sh {
        #[command(flatten)]
        args: sh::ShArgs,
        #[command(flatten)]
        image: ImageArgs,
        #[command(flatten)]
        egress: EgressArgs,
    },
    /// Interactive Python prompt on a session (a new one if none is given); state persists across lines.
    Repl {
        /// The session to attach to.
        session: Option<String>,
        #[command(flatten)]
        image: ImageArgs,
        #[command(flatten)]
        egress: EgressArgs,
    },
    /// Build or inspect guest images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Sessions: Python REPLs whose state persists; every exec is a checkpoint.
    Session {
        #[command(subcommand)]
        cmd: session::SessionCommand,
        #[command(flatten)]
        egress: EgressArgs,
    },
    /// Templates: warm, snapshotted interpreters that sandboxes fork from.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(forkbox_bench::BenchCommand<ImageArgs>),
    /// The nodes of a cluster (`serve --cluster`), through the server at --url (an admin key).
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// MCP server on stdio for LLM clients (local data directory, or --url); `mcp install` configures a client.
    Mcp(mcp::McpArgs),
    /// The system calls the sandbox implements: support level and what works, what does not.
    Syscalls {
        /// As the Markdown table in docs/syscalls.md.
        #[arg(long)]
        markdown: bool,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Create an API key for a tenant (only its hash is stored); prints the key. Limits not given
    /// take the documented defaults (20 requests/s, 100 sessions, 1024 MiB of checkpoints, the
    /// server's share of its exec slots, 3600 CPU seconds per hour, 60 s timeouts); --unlimited: none.
    Create {
        #[arg(long, default_value = "default")]
        tenant: String,
        /// Requests per second (token bucket; also the burst); over it: 429 rate_limited.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=u32::MAX as u64))]
        rate_limit: Option<u64>,
        /// Sessions the tenant may have at once; over it: 403 quota_exceeded.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_sessions: Option<u64>,
        /// Checkpoint disk of the tenant's sessions, MiB; a checkpoint past it gets 403 quota_exceeded.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_disk_mb: Option<u64>,
        /// Execs of this key running at once (a batch counts each); 0: every exec slot.
        #[arg(long, value_name = "N")]
        max_concurrency: Option<u64>,
        /// Guest CPU seconds per hour (a continuously refilled bucket); once spent: 429 cpu_budget_exceeded.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        cpu_seconds_per_hour: Option<u64>,
        /// Largest timeout_seconds this key may ask for.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_timeout_seconds: Option<u64>,
        /// No limits at all (only those given explicitly).
        #[arg(long)]
        unlimited: bool,
        /// An admin key: may read /metrics.
        #[arg(long)]
        admin: bool,
        /// The key's egress policy, a layer inside the server's (`forkbox serve --egress`) that every
        /// sandbox of the key gets: `none`, `public` or `allowlist`. Requests can only narrow it.
        /// Without it: the server's policy alone.
        #[arg(long, value_enum)]
        egress: Option<EgressMode>,
        /// An allow rule of the key's policy (repeatable; needs --egress), as for `serve`.
        #[arg(long, value_name = "RULE")]
        egress_allow: Vec<String>,
        /// A deny rule of the key's policy (repeatable; needs --egress), as for `serve`.
        #[arg(long, value_name = "RULE")]
        egress_deny: Vec<String>,
        /// The key's bandwidth per sandbox, bytes per second (needs --egress), as for `serve`.
        #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
        egress_rate: Option<u64>,
        /// Secrets every sandbox of the key gets (one-shot execs, sessions, E2B sandboxes, ForeverVM
        /// machines): a JSON file (`-`: stdin) as a session's `secrets`, `{"NAME": {"value": "...",
        /// "hosts": ["api.example.com"], "ports": [443], "tls": true}}`. Sealed with the data
        /// directory's secrets.key (or $FORKBOX_SECRETS_KEY: the server's) before it is stored.
        #[arg(long, value_name = "FILE")]
        secrets_file: Option<std::path::PathBuf>,
        /// Store the key in this PostgreSQL database (a server's --database; every node of a cluster
        /// sees it) instead of the data directory. Also $FORKBOX_DATABASE_URL.
        #[arg(long, value_name = "URL", env = "FORKBOX_DATABASE_URL", hide_env_values = true)]
        database: Option<String>,
    },
    /// List the API keys: id (SHA-256 of the key), tenant, admin, limits, the names of their secrets
    /// (never a key or a secret's value).
    List {
        /// Only the keys of this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// The keys of this PostgreSQL database (a server's --database). Also $FORKBOX_DATABASE_URL.
        #[arg(long, value_name = "URL", env = "FORKBOX_DATABASE_URL", hide_env_values = true)]
        database: Option<String>,
    },
    /// Revoke an API key, named by its id (`key list`) or the key itself: a server on this data
    /// directory or database stops accepting it within a second. Its tenant's sessions stay.
    Revoke {
        /// The key's id (64 hex digits) or the key (`fbk_...`).
        key: String,
        /// The keys of this PostgreSQL database (a server's --database). Also $FORKBOX_DATABASE_URL.
        #[arg(long, value_name = "URL", env = "FORKBOX_DATABASE_URL", hide_env_values = true)]
        database: Option<String>,
    },
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum TemplateCommand {
    /// List the templates in the data directory (of the server running on it, or --url), with build progress.
    Ls,
    /// One template: its state (a build's step, how far, for how long), packages and preload.
    Show { name: String },
    /// Build (or verify) a template: a shipped one by name (`python`, `data`); a named custom one
    /// from --apt/--pip/--preload (shared by every tenant of this data directory; with --url, the
    /// caller's own, built by the server); or, without a name, one for an image (--apt/--image) and preload.
    Build {
        /// A shipped template, or the name of a custom one (1-63 of a-z 0-9 . _ -).
        name: Option<String>,
        /// Code run before the snapshot (default `import numpy`).
        #[arg(long)]
        preload: Option<String>,
        /// A pip requirement (repeatable): installed as binary wheels for CPython 3.11 / manylinux
        /// x86-64, resolved on this host with its pip (no sdist is ever built).
        #[arg(long = "pip", value_name = "SPEC")]
        pip: Vec<String>,
        /// pip's index (default PyPI).
        #[arg(long, value_name = "URL")]
        index_url: Option<String>,
        /// A wheelhouse directory or URL for pip (repeatable).
        #[arg(long, value_name = "DIR")]
        find_links: Vec<String>,
        /// No index: only --find-links (offline).
        #[arg(long)]
        no_index: bool,
        /// The template's own egress policy (a custom template): every sandbox forked from it gets it
        /// inside the server's and the key's, so it only narrows.
        #[command(flatten)]
        network: NetworkArgs,
        /// Secrets every sandbox forked from the template gets (a custom template): a JSON file (`-`:
        /// stdin) as for `key create --secrets-file`. Embedded: sealed with the data directory's
        /// secrets.key; with --url: sent to the server, which seals them.
        #[arg(long, value_name = "FILE")]
        secrets_file: Option<std::path::PathBuf>,
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
    /// The template to run on (`python`, `data`; see `forkbox template ls`), built on first use.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["apt", "image"])]
    pub template: Option<String>,
    /// BLAS/LAPACK for numpy and scipy: reference (libblas3/liblapack3, forced), openblas
    /// (its threads pinned to one by the guest's environment) or any (apt's choice).
    #[arg(long, value_name = "reference|openblas|any", default_value = "reference", value_parser = parse_blas)]
    pub blas: forkbox_image::Blas,
}

/// `--network ...` of the commands that make a sandbox: a layer inside the
/// server's policy (and the key's), the API's `network` field.
#[derive(Args, Clone, Debug, Default)]
pub struct NetworkArgs {
    /// Outbound network of the sandbox, narrowing the server's (and the key's): `none`, `public` (the
    /// public internet, every non-public address refused) or `allowlist` (only what --network-allow
    /// names). Default: the server's policy (embedded: `public`).
    #[arg(long, value_enum)]
    pub network: Option<EgressMode>,
    /// An allow rule (repeatable; implies `--network allowlist`): `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`,
    /// `example.com`, `*.example.com:443`.
    #[arg(long, value_name = "RULE")]
    pub network_allow: Vec<String>,
    /// A deny rule (repeatable; implies `--network allowlist`), same forms. Deny rules win.
    #[arg(long, value_name = "RULE")]
    pub network_deny: Vec<String>,
    /// Bandwidth of the sandbox: bytes per second through its host sockets, both directions together
    /// (needs --network or a rule; the smallest of the server's, the key's and this one holds).
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub network_rate: Option<u64>,
}

impl NetworkArgs {
    /// The API's `network` (None: not given).
    pub fn setting(&self) -> anyhow::Result<Option<forkbox_client::Network>> {
        let mode = self.network.map(|m| match m {
            EgressMode::None => "none",
            EgressMode::Public => "public",
            EgressMode::Allowlist => "allowlist",
        });
        let n = forkbox_client::Network::from_parts(mode, &self.network_allow, &self.network_deny)
            .map_err(|e| anyhow::anyhow!("--network: {e}"))?;
        match n {
            None if self.network_rate.is_some() => {
                anyhow::bail!("--network-rate needs --network none|public|allowlist (or a --network-allow rule)")
            }
            n => Ok(n.map(|n| n.with_rate(self.network_rate))),
        }
    }

    /// The same as an engine policy layer (the embedded `forkbox run`), rules checked.
    pub fn layer(&self) -> anyhow::Result<Option<forkbox_engine::NetPolicy>> {
        use forkbox_client::{Network, NetworkMode};
        let mode = |m: NetworkMode| match m {
            NetworkMode::None => EgressMode::None,
            NetworkMode::Public => EgressMode::Public,
        };
        Ok(match self.setting()? {
            None => None,
            Some(Network::Mode(m)) => Some(egress_policy(mode(m), &[], &[])?),
            Some(Network::Limited { mode: m, max_bytes_per_second }) => {
                Some(egress_policy(mode(m), &[], &[])?.with_rate(Some(max_bytes_per_second)))
            }
            Some(Network::Rules { allow, deny, max_bytes_per_second }) => Some(
                egress_policy(EgressMode::Allowlist, &allow, &deny)
                    .map_err(|e| e.context("--network"))?
                    .with_rate(max_bytes_per_second),
            ),
        })
    }

    pub fn is_set(&self) -> bool {
        self.network.is_some()
            || !self.network_allow.is_empty()
            || !self.network_deny.is_empty()
            || self.network_rate.is_some()
    }
}

/// The operator's egress policy: the outermost layer, which every sandbox gets and requests,
/// keys and templates only narrow. `serve` takes it; so do the embedded commands (`run`, `sh`,
/// `repl`, `session`, `mcp` without --url), whose user is the operator of their own data directory.
#[derive(Args, Clone, Debug)]
pub struct EgressArgs {
    /// Outbound network of every sandbox: `public` (the public internet; loopback, private,
    /// link-local/metadata, CGNAT, multicast and this host's addresses refused), `none`, or
    /// `allowlist` (only what --egress-allow names). Requests can only narrow it.
    #[arg(long, global = true, value_enum, default_value = "public")]
    pub egress: EgressMode,
    /// An allow rule (repeatable): `10.0.0.0/8`, `1.2.3.4`, `127.0.0.1:8000`, `[::1]:8080`, `example.com`,
    /// `*.example.com:443`. An address/CIDR rule opens even a non-public address (the operator's choice:
    /// a local service); a host-name rule only public ones.
    #[arg(long, global = true, value_name = "RULE")]
    pub egress_allow: Vec<String>,
    /// A deny rule (repeatable), same forms (`*:25` denies a port everywhere). Deny rules win.
    #[arg(long, global = true, value_name = "RULE")]
    pub egress_deny: Vec<String>,
    /// Bandwidth of every sandbox: bytes per second through its host sockets, both directions
    /// together (token bucket; keys and requests can only lower it). Default: unlimited.
    #[arg(long, global = true, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub egress_rate: Option<u64>,
}

impl Default for EgressArgs {
    fn default() -> Self {
        EgressArgs { egress: EgressMode::Public, egress_allow: Vec::new(), egress_deny: Vec::new(), egress_rate: None }
    }
}

impl EgressArgs {
    /// The policy layer (rules checked).
    pub fn policy(&self) -> anyhow::Result<forkbox_engine::NetPolicy> {
        Ok(egress_policy(self.egress, &self.egress_allow, &self.egress_deny)
            .map_err(|e| e.context("--egress"))?
            .with_rate(self.egress_rate))
    }

    /// Whether any flag was given (the default is `public` alone).
    pub fn is_set(&self) -> bool {
        !matches!(self.egress, EgressMode::Public)
            || !self.egress_allow.is_empty()
            || !self.egress_deny.is_empty()
            || self.egress_rate.is_some()
    }

    /// The embedded runtime's configuration: `RuntimeConfig::embedded()` under this policy.
    pub fn runtime_config(&self) -> anyhow::Result<forkbox_runtime::RuntimeConfig> {
        let mut cfg = forkbox_runtime::RuntimeConfig::embedded();
        cfg.limits.network = forkbox_engine::NetConfig::with_policy(self.policy()?);
        Ok(cfg)
    }
}

fn parse_blas(s: &str) -> Result<forkbox_image::Blas, String> {
    forkbox_image::Blas::parse(s).ok_or_else(|| format!("unknown BLAS {s:?} (reference, openblas, any)"))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORKBOX_LOG")
                .unwrap_or_else(|_| "warn,forkbox::syscall=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // A sandbox worker process the server started (`forkbox_worker`): not a user command.
    if std::env::args_os().nth(1).is_some_and(|a| a == "__worker") {
        forkbox_runtime::worker_main();
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        let at = info.location().map_or(String::new(), |l| format!(" (at {}:{})", l.file(), l.line()));
        eprintln!("forkbox: internal error: {}{at}", term::escape(&msg));
    }));
    raise_fd_limit();
    let home = cli.home.clone().unwrap_or_else(forkbox_image::default_home);
    let result = match cli.command {
        Command::Serve {
            listen,
            image,
            template,
            metrics_listen,
            exec_slots,
            egress,
            egress_host,
            egress_ca_file,
            prebuild,
            template_wait_seconds,
            pip_index_url,
            pip_find_links,
            pip_no_index,
            pip_allow,
            pip_deny,
            isolation,
            worker_memory_mb,
            session_workers,
            worker_uid_base,
            objects,
            object_cache_mb,
            database,
            cluster,
            node_id,
            advertise_url,
            lease_seconds,
            e2b_auto_pause,
            sandbox_domain,
        } => {
            let isolation = match isolation {
                IsolationMode::Thread => forkbox_runtime::Isolation::Thread,
                IsolationMode::Process => forkbox_runtime::Isolation::Process(forkbox_runtime::ProcessIsolation {
                    memory_mb: worker_memory_mb,
                    uid_base: worker_uid_base,
                    session_workers: session_workers as usize,
                }),
            };
            let objects = objects.map(|url| forkbox_sessions::objects::ObjectsConfig {
                cache_bytes: object_cache_mb.map(|mb| mb.saturating_mul(1 << 20)),
                ..forkbox_sessions::objects::ObjectsConfig::new(url)
            });
            let pip = forkbox_image::PipSource {
                index_url: pip_index_url,
                find_links: pip_find_links,
                no_index: pip_no_index,
            };
            let packages = forkbox_image::packages::Policy { allow: pip_allow, deny: pip_deny };
            let cluster = cluster
                .then(|| {
                    anyhow::ensure!(
                        database.is_some() && objects.is_some(),
                        "--cluster needs --database postgres://... (or $FORKBOX_DATABASE_URL) and --objects s3://..."
                    );
                    cluster_config(listen, node_id, advertise_url, lease_seconds)
                })
                .transpose();
            let roots = egress_ca_file.map_or(Ok(()), |p| {
                let pem =
                    anyhow::Context::with_context(std::fs::read(&p), || format!("--egress-ca-file {}", p.display()))?;
                anyhow::Context::with_context(forkbox_runtime::net_tls::install_upstream_roots(&pem), || {
                    format!("--egress-ca-file {}", p.display())
                })
                .map(|_| ())
            });
            let policy = roots.and_then(|()| egress.policy()).and_then(|p| Ok((p, egress_hosts(&egress_host)?)));
            policy.and_then(|policy| cluster.map(|c| (policy, c))).and_then(|((policy, hosts), cluster)| {
                serve(
                    &home,
                    listen,
                    image,
                    template,
                    metrics_listen,
                    exec_slots,
                    policy,
                    hosts,
                    pip,
                    packages,
                    isolation,
                    objects,
                    database,
                    cluster,
                    Prebuild { names: prebuild, wait: std::time::Duration::from_secs(template_wait_seconds) },
                    E2bOptions { auto_pause: e2b_auto_pause, sandbox_domain },
                )
            })
        }
        Command::Key(KeyCommand::Create {
            tenant,
            rate_limit,
            max_sessions,
            max_disk_mb,
            max_concurrency,
            cpu_seconds_per_hour,
            max_timeout_seconds,
            unlimited,
            admin,
            egress,
            egress_allow,
            egress_deny,
            egress_rate,
            secrets_file,
            database,
        }) => {
            let egress = match egress {
                Some(mode) => egress_policy(mode, &egress_allow, &egress_deny).map(|p| Some(p.with_rate(egress_rate))),
                None if !egress_allow.is_empty() || !egress_deny.is_empty() || egress_rate.is_some() => {
                    Err(anyhow::anyhow!(
                        "--egress-allow, --egress-deny and --egress-rate need --egress none|public|allowlist"
                    ))
                }
                None => Ok(None),
            };
            egress.and_then(|egress| {
                let base = if unlimited {
                    forkbox_server::KeyLimits::unlimited()
                } else {
                    forkbox_server::KeyLimits::defaults()
                };
                let limits = forkbox_server::KeyLimits {
                    egress,
                    rate_limit: rate_limit.or(base.rate_limit),
                    max_sessions: max_sessions.or(base.max_sessions),
                    max_disk_mb: max_disk_mb.or(base.max_disk_mb),
                    max_concurrency: max_concurrency.or(base.max_concurrency),
                    cpu_seconds_per_hour: cpu_seconds_per_hour.or(base.cpu_seconds_per_hour),
                    max_timeout_seconds: max_timeout_seconds.or(base.max_timeout_seconds),
                };
                let secrets = match &secrets_file {
                    None => Ok(Vec::new()),
                    Some(path) => read_secrets_file(path).and_then(|j| forkbox_server::seal_secrets_json(&home, &j)),
                };
                secrets
                    .and_then(|secrets| {
                        forkbox_runtime::keys::KeyDb::open(&home, database.as_deref())
                            .map_err(|e| anyhow::anyhow!("opening the key store: {e}"))
                            .map(|db| (db, secrets))
                    })
                    .and_then(|(db, secrets)| {
                        forkbox_server::create_key_with_secrets(&db, &tenant, &limits, admin, &secrets)
                    })
                    .map(|k| {
                        println!("{k}");
                        ExitCode::SUCCESS
                    })
            })
        }
        Command::Key(KeyCommand::List { tenant, database }) => key_list(&home, database.as_deref(), tenant.as_deref()),
        Command::Key(KeyCommand::Revoke { key, database }) => key_revoke(&home, database.as_deref(), &key),
        Command::Run(args) => match &cli.url {
            Some(_) if args.egress.is_set() => Err(remote_egress()),
            Some(url) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| run::run_remote(&a, args)),
            None => run::run(&home, args),
        },
        Command::Sh { args, image, egress } => match &cli.url {
            Some(_) if image.image.is_some() || !image.apt.is_empty() => {
                Err(anyhow::anyhow!("--image and --apt only apply to the embedded mode (the server has its own image)"))
            }
            Some(_) if egress.is_set() => Err(remote_egress()),
            Some(url) => api::Api::remote(url, cli.api_key.clone()),
            None => api::Api::embedded(&home, &image, &egress),
        }
        .and_then(|a| sh::sh(&a, None, &args, image.template.clone())),
        Command::Repl { session, image, egress } => match &cli.url {
            Some(_) if egress.is_set() => Err(remote_egress()),
            Some(url) => api::Api::remote(url, cli.api_key.clone()),
            None => api::Api::embedded(&home, &image, &egress),
        }
        .and_then(|a| repl::repl(&a, &home, session, image.template.clone())),
        Command::Image(ImageCommand::Build(args)) => run::ensure_image(&home, &args, true).map(|(path, id)| {
            println!("{id} {}", path.display());
            ExitCode::SUCCESS
        }),
        Command::Session { cmd, egress } => match &cli.url {
            Some(_) if egress.is_set() => Err(remote_egress()),
            Some(url) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| session::session_remote(&a, cmd)),
            None => session::session(&home, cmd, &egress),
        },
        Command::Template(TemplateCommand::Ls) => match template_server(&home, cli.url.as_deref(), cli.api_key.clone())
        {
            Some(api) => api.and_then(|a| template_ls_remote(&a)),
            None => template_ls(&home),
        },
        Command::Template(TemplateCommand::Show { name }) => {
            match template_server(&home, cli.url.as_deref(), cli.api_key.clone()) {
                Some(api) => api.and_then(|a| {
                    let t = a.block_on(a.client.template(&name))?;
                    print_template(&t);
                    Ok(ExitCode::SUCCESS)
                }),
                None => template_show(&home, &name),
            }
        }
        Command::Template(TemplateCommand::Build {
            name,
            preload,
            pip,
            index_url,
            find_links,
            no_index,
            network,
            secrets_file,
            image,
        }) => {
            let custom = !pip.is_empty()
                || !image.apt.is_empty()
                || preload.is_some()
                || network.is_set()
                || secrets_file.is_some();
            match (name, &cli.url) {
                (Some(name), Some(url)) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| {
                    if !find_links.is_empty() || index_url.is_some() {
                        anyhow::bail!(
                            "--index-url/--find-links are the server's (forkbox serve --pip-index-url/--pip-find-links)"
                        );
                    }
                    let secrets = secrets_file.as_deref().map(read_secrets_file).transpose()?;
                    template_build_remote(&a, &name, &image, &pip, preload, &network, secrets.as_deref())
                }),
                (Some(name), None) if custom => {
                    let source = forkbox_image::PipSource { index_url, find_links, no_index };
                    let secrets = match &secrets_file {
                        None => Ok(Vec::new()),
                        Some(path) => {
                            read_secrets_file(path).and_then(|j| forkbox_server::seal_secrets_json(&home, &j))
                        }
                    };
                    secrets.and_then(|secrets| {
                        network.layer().and_then(|policy| {
                            template_build_custom(&home, &name, &image, pip, preload, source, (policy, secrets))
                        })
                    })
                }
                (Some(name), None) => template_build_named(&home, &name),
                (None, _) if !pip.is_empty() => {
                    Err(anyhow::anyhow!("--pip needs a template name (forkbox template build NAME --pip SPEC)"))
                }
                (None, _) if network.is_set() => {
                    Err(anyhow::anyhow!("--network needs a template name (forkbox template build NAME --network ...)"))
                }
                (None, _) if secrets_file.is_some() => Err(anyhow::anyhow!(
                    "--secrets-file needs a template name (forkbox template build NAME --secrets-file FILE)"
                )),
                (None, _) => template_build(&home, preload.as_deref().unwrap_or("import numpy"), &image),
            }
        }
        Command::Bench(cmd) => bench::bench(&home, cmd),
        Command::Node(cmd) => match &cli.url {
            Some(url) => api::Api::remote(url, cli.api_key.clone()).and_then(|a| node::node(&a, cmd)),
            None => Err(anyhow::anyhow!(
                "`forkbox node` asks a cluster node: give --url (or $FORKBOX_URL) and an admin key"
            )),
        },
        Command::Mcp(args) => mcp::mcp(&home, cli.home.as_deref(), cli.url.clone(), cli.api_key.clone(), args),
        Command::Syscalls { markdown } => {
            syscalls(markdown);
            Ok(ExitCode::SUCCESS)
        }
    };
    // A session exec's checkpoint is committed after its reply: an embedded
    // run (CLI, MCP on stdio) must not exit with one half done.
    if !forkbox_runtime::wait_settled(std::time::Duration::from_secs(60)) {
        eprintln!("forkbox: warning: a session's checkpoint was not durable after 60 s; exiting anyway");
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("forkbox: error: {}", term::escape(&one_line(&e)));
            ExitCode::from(2)
        }
    }
}

/// The operator's --egress flags with --url: the server's operator sets its policy.
fn remote_egress() -> anyhow::Error {
    anyhow::anyhow!(
        "--egress, --egress-allow, --egress-deny and --egress-rate are the operator's policy of an embedded run; \
         a server has its own (forkbox serve --egress-allow ...): narrow it with --network"
    )
}

fn syscalls(markdown: bool) {
    use forkbox_linux::syscalls::{markdown as table_markdown, TABLE};
    if markdown {
        print!("{}", table_markdown());
        return;
    }
    for e in TABLE {
        println!(
            "{:>3} {:<24} {:<8} restart {:<17} {}",
            e.nr,
            e.name,
            e.support.level(),
            e.restart.describe(),
            e.support.note().unwrap_or("")
        );
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum IsolationMode {
    Process,
    Thread,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum EgressMode {
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
    Ok(forkbox_engine::NetPolicy { mode, allow: parse(allow)?, deny: parse(deny)?, max_bytes_per_second: None })
}

/// `serve --prebuild NAME --template-wait-seconds S`.
struct Prebuild {
    names: Vec<String>,
    wait: std::time::Duration,
}

/// `serve`'s options of E2B's API and sandbox hosts.
struct E2bOptions {
    auto_pause: bool,
    sandbox_domain: Option<String>,
}

/// `--secrets-file`'s JSON object, to send to a server (which checks and seals each secret); a
/// parse error says where, never what (it could be a value).
fn secrets_object(json: &str) -> anyhow::Result<std::collections::BTreeMap<String, forkbox_client::SecretSpec>> {
    serde_json::from_str(json).map_err(|e| {
        anyhow::anyhow!(
            "--secrets-file: not a JSON object of secrets ({{\"NAME\": {{\"value\", \"hosts\", \"ports\", \"tls\"}}}}): \
             {:?} error at line {} column {}",
            e.classify(),
            e.line(),
            e.column()
        )
    })
}

/// `forkbox key list`: one line per key (never a key or a secret's value).
fn key_list(home: &std::path::Path, database: Option<&str>, tenant: Option<&str>) -> anyhow::Result<ExitCode> {
    let db = forkbox_runtime::keys::KeyDb::open(home, database)
        .map_err(|e| anyhow::anyhow!("opening the key store: {e}"))?;
    let limit = |v: Option<i64>, unit: &str| v.filter(|v| *v > 0).map_or("-".to_string(), |v| format!("{v}{unit}"));
    let mut after = String::new();
    let mut n = 0usize;
    loop {
        let page = db.page(&after, 500, tenant)?;
        for k in &page {
            let secrets: Vec<forkbox_runtime::net_secrets::SealedSecret> =
                k.secrets.as_deref().and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default();
            let names: Vec<String> = secrets.iter().map(|s| s.info().name).collect();
            let conc = match k.max_concurrency {
                None => "share".to_string(),
                Some(0) => "all".to_string(),
                Some(v) => v.to_string(),
            };
            println!(
                "{} tenant={} admin={} rate={} sessions={} disk={} concurrency={conc} cpu={} timeout={} egress={} secrets={}",
                k.hash,
                term::escape(&k.tenant),
                k.admin,
                limit(k.rate_limit, "/s"),
                limit(k.max_sessions, ""),
                limit(k.max_disk_mb, "MiB"),
                limit(k.cpu_seconds_per_hour, "s/h"),
                limit(k.max_timeout_seconds, "s"),
                if k.egress.is_some() { "own" } else { "server" },
                if names.is_empty() { "-".to_string() } else { names.join(",") },
            );
            n += 1;
        }
        match page.last() {
            Some(last) if page.len() == 500 => after = last.hash.clone(),
            _ => break,
        }
    }
    if n == 0 {
        eprintln!("forkbox: no API keys{}", tenant.map(|t| format!(" of tenant {t}")).unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}

/// `forkbox key revoke ID|KEY`.
fn key_revoke(home: &std::path::Path, database: Option<&str>, key: &str) -> anyhow::Result<ExitCode> {
    let key = key.trim();
    let id = if key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()) {
        key.to_ascii_lowercase()
    } else if key.starts_with("fbk_") {
        forkbox_server::keys::hash_key(key)
    } else {
        anyhow::bail!("not a key id (64 hex digits, see `forkbox key list`) nor a key (fbk_...)");
    };
    let db = forkbox_runtime::keys::KeyDb::open(home, database)
        .map_err(|e| anyhow::anyhow!("opening the key store: {e}"))?;
    if !db.delete(&id)? {
        anyhow::bail!("no API key with id {id}");
    }
    println!("revoked {id}");
    Ok(ExitCode::SUCCESS)
}

/// The text of `--secrets-file` (`-`: stdin).
fn read_secrets_file(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    if path.as_os_str() == "-" {
        anyhow::Context::context(std::io::stdin().read_to_string(&mut text), "reading the secrets from stdin")?;
    } else {
        text = anyhow::Context::with_context(std::fs::read_to_string(path), || format!("reading {}", path.display()))?;
    }
    Ok(text)
}

/// `--egress-host NAME=ADDR` options as the resolver's static map (names lower-case, no trailing dot).
fn egress_hosts(opts: &[String]) -> anyhow::Result<std::collections::BTreeMap<String, Vec<std::net::IpAddr>>> {
    let mut map = std::collections::BTreeMap::<String, Vec<std::net::IpAddr>>::new();
    for o in opts {
        let (name, addr) = o.split_once('=').ok_or_else(|| anyhow::anyhow!("--egress-host {o:?}: not NAME=ADDR"))?;
        let addr: std::net::IpAddr =
            addr.trim().parse().map_err(|_| anyhow::anyhow!("--egress-host {o:?}: {addr:?} is not an IP address"))?;
        let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
        let ok = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
        anyhow::ensure!(ok, "--egress-host {o:?}: {name:?} is not a host name");
        map.entry(name).or_default().push(addr);
    }
    Ok(map)
}

#[allow(clippy::too_many_arguments)]
fn serve(
    home: &std::path::Path,
    listen: std::net::SocketAddr,
    image: Option<PathBuf>,
    template: Option<String>,
    metrics_listen: Option<std::net::SocketAddr>,
    exec_slots: Option<u64>,
    egress: forkbox_engine::NetPolicy,
    hosts: std::collections::BTreeMap<String, Vec<std::net::IpAddr>>,
    pip: forkbox_image::PipSource,
    packages: forkbox_image::packages::Policy,
    isolation: forkbox_runtime::Isolation,
    objects: Option<forkbox_sessions::objects::ObjectsConfig>,
    database: Option<String>,
    cluster: Option<forkbox_runtime::ClusterConfig>,
    prebuild: Prebuild,
    e2b: E2bOptions,
) -> anyhow::Result<ExitCode> {
    pip.validate().map_err(|e| anyhow::anyhow!("--pip-*: {e}"))?;
    for n in packages.allow.iter().chain(&packages.deny) {
        if forkbox_image::packages::spec_name(n) != n.as_str() || n.is_empty() {
            anyhow::bail!("--pip-allow/--pip-deny: {n:?} is not a package name");
        }
    }
    if let Some(o) = &objects {
        forkbox_sessions::objects::parse_url(&o.url)?;
    }
    if database.as_deref().is_some_and(|u| !forkbox_sessions::db::is_postgres_url(u)) {
        anyhow::bail!("--database: not a PostgreSQL URL (postgres://user@host:port/db)");
    }
    let mut cfg = forkbox_server::ServerConfig::new(listen, home.to_path_buf());
    cfg.runtime.pip = pip;
    cfg.runtime.packages = packages;
    cfg.runtime.isolation = isolation;
    cfg.runtime.image = image;
    cfg.runtime.template = template;
    cfg.metrics_listen = metrics_listen;
    cfg.runtime.concurrency = exec_slots.map_or(0, |n| n as usize);
    cfg.runtime.limits.network = forkbox_engine::NetConfig::with_policy(egress);
    cfg.runtime.limits.network.hosts = hosts;
    cfg.runtime.sessions.objects = objects;
    cfg.runtime.sessions.database = database;
    cfg.runtime.sessions.cluster = cluster;
    cfg.prebuild = prebuild.names;
    cfg.template_wait = prebuild.wait;
    cfg.e2b_auto_pause = e2b.auto_pause;
    if let Some(d) = &e2b.sandbox_domain {
        let ok = !d.is_empty()
            && d.len() <= 200
            && d.split('.').all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
        anyhow::ensure!(ok, "--sandbox-domain {d:?} is not a DNS name");
    }
    cfg.sandbox_domain = e2b.sandbox_domain.map(|d| d.to_ascii_lowercase());
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(forkbox_server::serve(cfg))?;
    Ok(ExitCode::SUCCESS)
}

/// `serve --cluster`: this node's name (default: the host name), the URL the
/// other nodes reach it at (default: the listen address), the lease time.
fn cluster_config(
    listen: std::net::SocketAddr,
    node_id: Option<String>,
    advertise_url: Option<String>,
    lease_seconds: u64,
) -> anyhow::Result<forkbox_runtime::ClusterConfig> {
    let node_id = match node_id {
        Some(id) => id,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .map_err(|e| anyhow::anyhow!("--node-id: reading the host name: {e}"))?,
    };
    if !forkbox_sessions::node::valid_node_id(&node_id) {
        anyhow::bail!("--node-id {node_id:?}: 1-64 letters, digits, '-', '_', '.', ':'");
    }
    // None: the address `serve` is bound to (its port known once bound).
    let url = match advertise_url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None if listen.ip().is_unspecified() => anyhow::bail!(
            "--cluster with --listen {listen}: give --advertise-url http://<an address of this host the other nodes reach>:{}",
            listen.port()
        ),
        None => String::new(),
    };
    if !url.is_empty() && !url.starts_with("http://") && !url.starts_with("https://") {
        anyhow::bail!("--advertise-url must be an http:// or https:// URL, got {url:?}");
    }
    Ok(forkbox_runtime::ClusterConfig { node_id, url, lease: std::time::Duration::from_secs(lease_seconds) })
}

fn template_build_named(home: &std::path::Path, name: &str) -> anyhow::Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let catalog = forkbox_catalog::Catalog::new(home)?.with_progress(true);
    let l = catalog.get(Some(name))?;
    let size = std::fs::metadata(&l.engine.image_path).map_or(0, |m| m.len());
    println!(
        "{name} {} {} (image {} MiB, {:.1} s)",
        l.id(),
        l.template.dir.display(),
        size >> 20,
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn template_build_custom(
    home: &std::path::Path,
    name: &str,
    image: &ImageArgs,
    pip: Vec<String>,
    preload: Option<String>,
    source: forkbox_image::PipSource,
    // What every sandbox forked from it gets: its egress policy layer and its sealed secrets.
    (network, secrets): (Option<forkbox_engine::NetPolicy>, Vec<forkbox_runtime::net_secrets::SealedSecret>),
) -> anyhow::Result<ExitCode> {
    if image.image.is_some() || image.template.is_some() {
        anyhow::bail!("a custom template is built from --apt/--pip/--preload, not --image or --template");
    }
    let t0 = std::time::Instant::now();
    let catalog = forkbox_catalog::Catalog::new(home)?.with_progress(true);
    let t = forkbox_catalog::catalog::CustomTemplate {
        name: name.into(),
        apt: image.apt.clone(),
        pip,
        preload,
        blas: image.blas,
        network,
        secrets,
    };
    let l = catalog.build_shared(&t, source)?;
    let size = std::fs::metadata(&l.engine.image_path).map_or(0, |m| m.len());
    println!(
        "{name} {} {} (image {:.1} MiB, {:.1} s)",
        l.id(),
        l.template.dir.display(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// `--url`: ask the server to build a template of the caller's own, and wait for it.
fn template_build_remote(
    api: &api::Api,
    name: &str,
    image: &ImageArgs,
    pip: &[String],
    preload: Option<String>,
    network: &NetworkArgs,
    secrets: Option<&str>,
) -> anyhow::Result<ExitCode> {
    if image.image.is_some() || image.template.is_some() {
        anyhow::bail!("a custom template is built from --apt/--pip/--preload, not --image or --template");
    }
    let t0 = std::time::Instant::now();
    let req = forkbox_client::CreateTemplate {
        name: name.into(),
        apt: image.apt.clone(),
        pip: pip.to_vec(),
        preload,
        blas: Some(image.blas.name().into()),
        network: network.setting()?,
        secrets: secrets.map(secrets_object).transpose()?.unwrap_or_default(),
    };
    let mut t = api.block_on(api.client.create_template(&req))?;
    let mut last = String::new();
    while t.status == "building" {
        let step = t.progress.clone().unwrap_or_default();
        if step != last {
            eprintln!("forkbox: template {name}: {step}");
            last = step;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        t = api.block_on(api.client.template(name))?;
    }
    if t.status != "ready" {
        anyhow::bail!("template {name} {}: {}", t.status, t.error.unwrap_or_default());
    }
    println!(
        "{name} {} (image {:.1} MiB, {:.1} s)",
        t.id.as_deref().unwrap_or("-"),
        t.image_bytes.unwrap_or(0) as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// The server `template ls`/`show` ask: --url, else the one running on the data directory (its
/// builds in progress are its own); None: the data directory itself.
fn template_server(home: &std::path::Path, url: Option<&str>, key: Option<String>) -> Option<anyhow::Result<api::Api>> {
    if let Some(url) = url {
        return Some(api::Api::remote(url, key));
    }
    api::running_server(home).map(|f| api::Api::remote(&f.url, Some(f.key)))
}

fn template_ls_remote(api: &api::Api) -> anyhow::Result<ExitCode> {
    let list = api.block_on(api.client.templates())?;
    for t in list.templates {
        let status = status_line(&t.status, t.progress.as_deref(), t.fraction, t.elapsed_seconds);
        print_listing(
            &t.name,
            &status,
            &t.source,
            t.image_bytes,
            &t.packages,
            &t.pip,
            &t.description,
            t.name == list.default,
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `building (image: downloading packages 42%, 35 s)`; other states as they are.
fn status_line(status: &str, progress: Option<&str>, fraction: Option<f64>, elapsed: Option<u64>) -> String {
    if status != "building" {
        return status.to_string();
    }
    let mut s = format!("building ({}", progress.unwrap_or("queued"));
    if let Some(f) = fraction {
        s.push_str(&format!(" {:.0}%", f * 100.0));
    }
    if let Some(e) = elapsed {
        s.push_str(&format!(", {e} s"));
    }
    s.push(')');
    s
}

fn print_template(t: &forkbox_client::TemplateInfo) {
    println!("name        {}", t.name);
    println!("status      {}", status_line(&t.status, t.progress.as_deref(), t.fraction, t.elapsed_seconds));
    if let Some(e) = &t.error {
        println!("error       {e}");
    }
    println!("source      {}", t.source);
    if let Some(id) = &t.id {
        println!("id          {id}");
    }
    println!("description {}", t.description);
    if !t.packages.is_empty() {
        println!("packages    {}", t.packages.join(" "));
    }
    if !t.pip.is_empty() {
        println!("pip         {}", t.pip.join(" "));
    }
    if let Some(b) = t.image_bytes {
        println!("image       {:.0} MiB", b as f64 / (1 << 20) as f64);
    }
    println!("preload     {}", t.preload.replace('\n', "; "));
}

fn template_show(home: &std::path::Path, name: &str) -> anyhow::Result<ExitCode> {
    let catalog = forkbox_catalog::Catalog::new(home)?;
    let l = catalog.listing(None, name).ok_or_else(|| anyhow::anyhow!("no template named {name:?}"))?;
    print_template(&forkbox_client::TemplateInfo::from(l));
    Ok(ExitCode::SUCCESS)
}

#[allow(clippy::too_many_arguments)]
fn print_listing(
    name: &str,
    status: &str,
    source: &str,
    bytes: Option<u64>,
    apt: &[String],
    pip: &[String],
    description: &str,
    default: bool,
) {
    let size = bytes.map_or("-".to_string(), |b| format!("{:.0} MiB", b as f64 / (1 << 20) as f64));
    let mut what = description.to_string();
    if source == "custom" {
        what = format!("apt [{}] pip [{}]", apt.join(" "), pip.join(" "));
    }
    println!("{name:14} {status:9} {source:10} {size:>8}  {what}{}", if default { " (default)" } else { "" });
}

fn template_ls(home: &std::path::Path) -> anyhow::Result<ExitCode> {
    if let Ok(catalog) = forkbox_catalog::Catalog::new(home) {
        for t in catalog.list() {
            print_listing(&t.name, &t.status, &t.source, t.image_bytes, &t.packages, &t.pip, &t.description, t.default);
        }
        println!();
    }
    let list = forkbox_runtime::templates::list(home);
    if list.is_empty() {
        println!("no templates in {}", forkbox_runtime::templates::dir(home).display());
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
    let (info, dir) = forkbox_runtime::templates::ensure(home, &path, preload)?;
    println!("{} {}", info.id, dir.display());
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

/// A command-line mistake as one line on stderr (exit 2); `--help` and `--version` print as usual.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let text = e.render().to_string();
    let body: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let msg = body.join(" ");
    eprintln!("forkbox: error: {} (see --help)", msg.strip_prefix("error: ").unwrap_or(&msg));
    ExitCode::from(2)
}

/// An error chain as one line.
fn one_line(e: &anyhow::Error) -> String {
    // An error whose message already holds its source's is not repeated.
    let mut parts: Vec<String> = Vec::new();
    for c in e.chain() {
        let s = c.to_string();
        if !parts.last().is_some_and(|p| p.ends_with(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ").replace('\n', " ")
}
