//! Prometheus metrics (the `metrics` facade with the Prometheus exporter as
//! the process's global recorder; installed once per process).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];

/// Install the recorder (first call) and return its handle. If another
/// recorder is already global (an embedding program installed one), the
/// handle renders an empty registry.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = || PrometheusBuilder::new().set_buckets(LATENCY_BUCKETS).expect("non-empty buckets");
        match builder().install_recorder() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("metrics recorder not installed ({e}); /metrics will be empty");
                builder().build_recorder().handle()
            }
        }
    })
}

/// One exec finished: `kind` is oneshot | batch | session; `outcome` ok | python_error | error.
pub fn exec(kind: &'static str, outcome: &'static str, seconds: f64) {
    metrics::counter!("forkbox_exec_total", "kind" => kind, "outcome" => outcome).increment(1);
    metrics::histogram!("forkbox_exec_duration_seconds", "kind" => kind).record(seconds);
}

pub fn fork(seconds: f64) {
    metrics::histogram!("forkbox_fork_duration_seconds").record(seconds);
}

pub fn error(code: &'static str) {
    metrics::counter!("forkbox_errors_total", "code" => code).increment(1);
}

pub fn sessions(resident: usize) {
    metrics::gauge!("forkbox_sessions_resident").set(resident as f64);
}

/// A request about a session was forwarded to the node that has it (a cluster).
pub fn forwarded() {
    metrics::counter!("forkbox_forwarded_total").increment(1);
}

pub fn evicted(n: usize) {
    metrics::counter!("forkbox_sessions_evicted_total").increment(n as u64);
}

/// The process-wide network counters of every sandbox (egress decisions, DNS, bytes).
pub fn network(g: &forkbox_runtime::GlobalNetStats) {
    use std::sync::atomic::Ordering::Relaxed;
    metrics::counter!("forkbox_net_connects_total", "decision" => "allowed").absolute(g.connects_allowed.load(Relaxed));
    metrics::counter!("forkbox_net_connects_total", "decision" => "denied").absolute(g.connects_denied.load(Relaxed));
    metrics::counter!("forkbox_net_dns_queries_total").absolute(g.dns_queries.load(Relaxed));
    metrics::counter!("forkbox_net_dns_refused_total").absolute(g.dns_refused.load(Relaxed));
    metrics::counter!("forkbox_net_bytes_total", "direction" => "sent").absolute(g.bytes_sent.load(Relaxed));
    metrics::counter!("forkbox_net_bytes_total", "direction" => "received").absolute(g.bytes_received.load(Relaxed));
}

pub fn sessions_live(n: u64) {
    metrics::gauge!("forkbox_sessions_live").set(n as f64);
}

pub fn checkpoint_bytes(n: u64) {
    metrics::counter!("forkbox_checkpoint_bytes_total").increment(n);
}

/// Host memory the template's recycled VMs hold privately (a gauge), and its bound.
pub fn vm_pool((held, max): (u64, u64)) {
    metrics::gauge!("forkbox_vm_pool_private_bytes").set(held as f64);
    metrics::gauge!("forkbox_vm_pool_private_bytes_max").set(max as f64);
}
