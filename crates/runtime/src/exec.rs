//! One-shot execs and batches, on the runtime's exec workers.
//!
//! A one-shot exec forks the template, runs the code and hands the result to
//! its caller *before* the sandbox is dropped: the fork's teardown (its VM goes
//! back to the engine's per-thread pool) happens off the response path, while
//! the caller's `hold` (an admission permit) is still held.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use forkbox_catalog::Loaded;
use forkbox_engine::net_secrets::{self, SealedSecret};
use forkbox_engine::{ExecOptions, ExecResult, Limits, NetPolicy, Stream};
use forkbox_sessions::manager::ExecOutcome;

use crate::{Runtime, RuntimeError};
use forkbox_sessions::manager::random_id;

/// How an exec ended, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The code ran to the end.
    Ok,
    /// The code raised (a result with `error` set; not a failure of the sandbox).
    PythonError,
    /// The exec failed (timeout, crash, quota, ...).
    Error,
}

/// Anything that carries an exec's result.
pub trait Ran {
    fn exec_result(&self) -> &ExecResult;
}

impl Ran for ExecResult {
    fn exec_result(&self) -> &ExecResult {
        self
    }
}

impl Ran for ExecOutcome {
    fn exec_result(&self) -> &ExecResult {
        &self.result
    }
}

impl Ran for OneShot {
    fn exec_result(&self) -> &ExecResult {
        &self.result
    }
}

impl Outcome {
    pub fn of<T: Ran, E>(r: &Result<T, E>) -> Outcome {
        match r {
            Ok(r) if r.exec_result().error.is_some() => Outcome::PythonError,
            Ok(_) => Outcome::Ok,
            Err(_) => Outcome::Error,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::PythonError => "python_error",
            Outcome::Error => "error",
        }
    }
}

/// Where a streamed exec's output goes as the guest writes it (on the exec thread).
pub trait Output: Send {
    fn chunk(&mut self, stream: Stream, bytes: &[u8]);
    /// After the exec, before its result is handed over (flush what is held back).
    fn end(&mut self) {}
}

/// Run `opts`-style output through an optional [`Output`], with `prelude` (see
/// `ExecOptions::prelude`) before the code.
pub(crate) fn with_output<R>(
    output: &mut Option<Box<dyn Output>>,
    prelude: Option<&str>,
    run: impl FnOnce(ExecOptions<'_>) -> R,
) -> R {
    let r = match output.as_mut() {
        Some(out) => {
            let mut sink = |stream: Stream, bytes: &[u8]| out.chunk(stream, bytes);
            run(ExecOptions { on_output: Some(&mut sink), prelude, ..ExecOptions::default() })
        }
        None => run(ExecOptions { prelude, ..ExecOptions::default() }),
    };
    if let Some(out) = output.as_mut() {
        out.end();
    }
    r
}

/// All the items of a batch together capture at most this many times the output limit.
pub const BATCH_OUTPUT_FACTOR: usize = 4;

/// Output limit of each of `n` items of a batch (at least 4 KiB, at most `per_exec`).
/// Add policy layers inside the runtime's: the template's own (`template`,
/// see [`forkbox_catalog::catalog::Recipe::network`]), then `network` (the
/// caller's key's, then the request's). Each can only narrow.
pub(crate) fn narrow_network(limits: &mut Limits, template: &Loaded, network: &[NetPolicy]) {
    for p in template.network.iter().chain(network) {
        limits.network = std::mem::take(&mut limits.network).narrowed(p.clone());
    }
}

/// Set the sandbox's secrets: `key`'s (the caller's API key), then the
/// template's, then `request`'s (a session's), a later one replacing an
/// earlier one of the same name ([`net_secrets::merge`]).
pub(crate) fn set_secrets(limits: &mut Limits, template: &Loaded, key: &[SealedSecret], request: &[SealedSecret]) {
    limits.network.secrets = net_secrets::merge(&[key, &template.secrets, request]);
}

pub fn batch_output_limit(per_exec: usize, n: usize) -> usize {
    (per_exec.saturating_mul(BATCH_OUTPUT_FACTOR) / n.max(1)).clamp(4096.min(per_exec), per_exec)
}

/// A validated one-shot exec (see [`Runtime::oneshot`]).
#[derive(Clone, Debug)]
pub struct OneShotRequest {
    pub(crate) code: String,
    pub(crate) limits: Limits,
    pub(crate) template: Arc<Loaded>,
    /// Run in the fork before `code`: the secrets' placeholders into its environment.
    pub(crate) prelude: Option<String>,
}

impl OneShotRequest {
    fn new(code: String, mut limits: Limits, template: Arc<Loaded>, key_secrets: &[SealedSecret]) -> OneShotRequest {
        set_secrets(&mut limits, &template, key_secrets, &[]);
        let prelude = net_secrets::env_prelude(&limits.network.secrets);
        OneShotRequest { code, limits, template, prelude }
    }
}

/// Run a one-shot's prelude (if any) in its fresh fork: a Python error in it
/// is the exec's result (the code does not run).
fn run_prelude(sb: &mut forkbox_engine::Sandbox, prelude: Option<&str>) -> Result<Option<ExecResult>, RuntimeError> {
    let Some(code) = prelude else { return Ok(None) };
    let r = sb.exec(code).map_err(|e| RuntimeError::exec(e, sb.take_failed_output()))?;
    Ok(r.error.is_some().then_some(r))
}

/// The result of a one-shot exec, with its timing.
#[derive(Clone, Debug)]
pub struct OneShot {
    pub result: ExecResult,
    /// `x_...`, for logs.
    pub id: String,
    /// Forking the template.
    pub fork_ms: f64,
    /// Running the code.
    pub exec_ms: f64,
}

impl Runtime {
    /// Refuse code over the code limit.
    pub fn check_code(&self, code: &str) -> Result<(), RuntimeError> {
        if code.len() > self.config.code_limit {
            return Err(RuntimeError::CodeTooLarge { len: code.len(), limit: self.config.code_limit });
        }
        Ok(())
    }

    /// A request's `timeout_seconds` (the default if None), within the runtime's maximum.
    pub fn timeout(&self, seconds: Option<f64>) -> Result<Duration, RuntimeError> {
        let max = self.config.max_timeout.as_secs_f64();
        match seconds {
            None => Ok(self.config.limits.timeout),
            Some(s) if s.is_finite() && s > 0.0 && s <= max => Ok(Duration::from_secs_f64(s)),
            Some(s) => Err(RuntimeError::Invalid(format!("timeout_seconds must be > 0 and <= {max}, got {s}"))),
        }
    }

    /// Check a one-shot exec's code and timeout (cheap: do it before waiting for a slot).
    /// `template`: its name (None: the default). `network`: policy layers
    /// narrowing the runtime's, outermost first (empty: the runtime's as it is).
    /// `key_secrets`: the caller's key's secrets (the template's win by name).
    #[allow(clippy::too_many_arguments)]
    pub fn oneshot(
        &self,
        tenant: &str,
        code: String,
        timeout_seconds: Option<f64>,
        template: Option<&str>,
        network: &[NetPolicy],
        key_secrets: &[SealedSecret],
    ) -> Result<OneShotRequest, RuntimeError> {
        self.check_code(&code)?;
        let mut limits = self.config.limits.clone();
        limits.timeout = self.timeout(timeout_seconds)?;
        limits.code_bytes = self.config.code_limit;
        let template = self.template(tenant, template)?;
        narrow_network(&mut limits, &template, network);
        Ok(OneShotRequest::new(code, limits, template, key_secrets))
    }

    /// Run a one-shot exec on an exec thread: `reply` gets the result, then the
    /// sandbox is dropped, then `hold`. `output` sees the output as it is written.
    pub fn spawn_exec(
        self: &Arc<Self>,
        req: OneShotRequest,
        mut output: Option<Box<dyn Output>>,
        hold: impl Send + 'static,
        reply: impl FnOnce(Result<OneShot, RuntimeError>) + Send + 'static,
    ) {
        let me = self.clone();
        self.workers.spawn(move || {
            let _hold = hold;
            if let Some(w) = &me.remote {
                reply(crate::remote::exec(w, &req, &mut output));
                return crate::remote::settle(w);
            }
            let t = Instant::now();
            let mut sb = match req.template.template.fork(&req.template.engine, req.limits) {
                Ok(sb) => sb,
                Err(e) => {
                    if let Some(out) = output.as_mut() {
                        out.end();
                    }
                    return reply(Err(e.into()));
                }
            };
            let fork_ms = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let r = match run_prelude(&mut sb, req.prelude.as_deref()) {
                Ok(None) => with_output(&mut output, None, |opts| sb.exec_with(&req.code, opts))
                    .map_err(|e| RuntimeError::exec(e, sb.take_failed_output())),
                Ok(Some(failed)) => {
                    if let Some(out) = output.as_mut() {
                        out.end();
                    }
                    Ok(failed)
                }
                Err(e) => {
                    if let Some(out) = output.as_mut() {
                        out.end();
                    }
                    Err(e)
                }
            };
            let exec_ms = t.elapsed().as_secs_f64() * 1000.0;
            reply(r.map(|result| OneShot { result, id: random_id("x_"), fork_ms, exec_ms }));
            drop(sb);
        });
    }

    /// [`Self::spawn_exec`], awaited.
    pub async fn exec(
        self: &Arc<Self>,
        req: OneShotRequest,
        output: Option<Box<dyn Output>>,
        hold: impl Send + 'static,
    ) -> Result<OneShot, RuntimeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.spawn_exec(req, output, hold, move |r| {
            let _ = tx.send(r);
        });
        rx.await.map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Check a batch (count and each code) and its timeout. `network`,
    /// `key_secrets`: as for [`Runtime::oneshot`].
    #[allow(clippy::too_many_arguments)]
    pub fn batch(
        &self,
        tenant: &str,
        codes: Vec<String>,
        timeout_seconds: Option<f64>,
        template: Option<&str>,
        network: &[NetPolicy],
        key_secrets: &[SealedSecret],
    ) -> Result<Vec<OneShotRequest>, RuntimeError> {
        let n = codes.len();
        if n == 0 || n > self.config.max_batch {
            return Err(RuntimeError::Invalid(format!(
                "codes must hold 1 to {} items, got {n}",
                self.config.max_batch
            )));
        }
        for c in &codes {
            self.check_code(c)?;
        }
        let timeout = self.timeout(timeout_seconds)?;
        let template = self.template(tenant, template)?;
        // The whole batch is bounded: its items share BATCH_OUTPUT_FACTOR x the output limit.
        let output_bytes = batch_output_limit(self.config.limits.output_bytes, n);
        Ok(codes
            .into_iter()
            .map(|code| {
                let mut limits = self.config.limits.clone();
                limits.timeout = timeout;
                limits.code_bytes = self.config.code_limit;
                limits.output_bytes = output_bytes;
                narrow_network(&mut limits, &template, network);
                OneShotRequest::new(code, limits, template.clone(), key_secrets)
            })
            .collect())
    }

    /// How many exec threads a batch of `n` runs on (half the threads at most,
    /// so one batch leaves room for other requests).
    pub fn batch_parallelism(&self, n: usize) -> usize {
        n.clamp(1, (self.concurrency / 2).max(1))
    }

    /// Each exec in its own fork, on `parallel` exec threads (at most
    /// [`Self::batch_parallelism`]; the caller holds that many slots);
    /// `results[i]` is the result of `reqs[i]`. `hold` is dropped once all are done.
    pub async fn exec_batch(
        self: &Arc<Self>,
        reqs: Vec<OneShotRequest>,
        parallel: usize,
        hold: impl Send + Sync + 'static,
    ) -> Vec<Result<ExecResult, RuntimeError>> {
        let n = reqs.len();
        let parallel = parallel.clamp(1, self.batch_parallelism(n));
        let reqs = Arc::new(reqs);
        let next = Arc::new(AtomicUsize::new(0));
        type Slot = Mutex<Option<Result<ExecResult, RuntimeError>>>;
        let results: Arc<Vec<Slot>> = Arc::new((0..n).map(|_| Mutex::new(None)).collect());
        let hold = Arc::new(hold);
        let mut done = Vec::with_capacity(parallel);
        for _ in 0..parallel {
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            done.push(rx);
            let (reqs, next, results, hold) = (reqs.clone(), next.clone(), results.clone(), hold.clone());
            let me = self.clone();
            self.workers.spawn(move || {
                let _hold = hold;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(req) = reqs.get(i) else { break };
                    if let Some(w) = &me.remote {
                        let r = crate::remote::exec(w, req, &mut None).map(|o| o.result);
                        if let Some(slot) = results.get(i) {
                            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                        }
                        continue;
                    }
                    let r = req
                        .template
                        .template
                        .fork(&req.template.engine, req.limits.clone())
                        .map_err(RuntimeError::from)
                        .and_then(|mut sb| match run_prelude(&mut sb, req.prelude.as_deref())? {
                            Some(failed) => Ok(failed),
                            None => sb.exec(&req.code).map_err(|e| RuntimeError::exec(e, sb.take_failed_output())),
                        });
                    if let Some(slot) = results.get(i) {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                    }
                }
                let _ = tx.send(());
            });
        }
        for rx in done {
            let _ = rx.await;
        }
        (0..n)
            .map(|i| {
                results
                    .get(i)
                    .and_then(|m| m.lock().unwrap_or_else(|e| e.into_inner()).take())
                    .unwrap_or(Err(RuntimeError::WorkerGone))
            })
            .collect()
    }
}
