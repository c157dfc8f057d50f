//! Sessions, as the front ends see them: validated requests, views with the
//! head resolved, quotas checked where they apply. Execs run on the exec
//! workers; everything else blocks (SQLite, files): call it off async threads.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use forkbox_engine::{
    ExecOptions, FileEntry, FileOp, FileOpOutcome, JobChunk, JobInfo, Limits, ListeningPort, NetConfig, NetPolicy,
    Stream,
};
use forkbox_sessions::manager::ExecOutcome;
use forkbox_sessions::store::CheckpointRecord;

/// What starting a background command did.
pub struct JobStart {
    /// The exec that started it (its stdout/stderr: a command that could not start says why).
    pub result: forkbox_engine::ExecResult,
    /// Its checkpoint, if it made one.
    pub checkpoint: Option<CheckpointRecord>,
    /// The job, or the exit status of a command that could not start.
    pub started: Result<JobInfo, i32>,
}
use forkbox_sessions::store::SessionRecord;

use crate::exec::{with_output, Output};
use crate::{Runtime, RuntimeError};

/// A caller's limits on sessions; `None` is unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Sessions the tenant may have at once.
    pub max_sessions: Option<u64>,
    /// Checkpoint bytes on disk of the tenant's sessions, in MiB: each
    /// checkpoint is charged against it before it is written (one that would
    /// pass it is refused, the session stays at its previous checkpoint), and
    /// execs and uploads are refused once it is over.
    pub max_disk_mb: Option<u64>,
}

/// Where a forked session came from (until its first exec).
/// What a new session is made of; every field has the server's default when left out.
#[derive(Clone, Debug, Default)]
pub struct NewSession<'a> {
    pub tags: BTreeMap<String, String>,
    pub memory_mb: Option<u64>,
    pub timeout_seconds: Option<f64>,
    /// A template name (default: the server's).
    pub template: Option<&'a str>,
    /// Egress layers narrowing the server's policy (the key's, then the request's).
    pub network: &'a [NetPolicy],
    /// Secrets substituted at the egress boundary (sealed by the caller): the request's own.
    pub secrets: Vec<forkbox_engine::net_secrets::SealedSecret>,
    /// The caller's API key's secrets: under the template's and the request's of the same name.
    pub key_secrets: &'a [forkbox_engine::net_secrets::SealedSecret],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkedFrom {
    pub session: String,
    pub checkpoint: i64,
}

/// A session with its head resolved.
#[derive(Clone, Debug)]
pub struct SessionView {
    pub record: SessionRecord,
    /// Its sandbox is in memory.
    pub resident: bool,
    /// Seq of its head checkpoint (None: the template, or a fork's source checkpoint).
    pub checkpoint: Option<i64>,
    pub forked_from: Option<ForkedFrom>,
    /// The name of its template here (None: no name has that template now).
    pub template: Option<String>,
    /// The last non-blank line of its head's code, cut to [`LAST_CODE_MAX`] characters.
    pub last_code: Option<String>,
}

/// Longest `last_code` of a session (characters).
pub const LAST_CODE_MAX: usize = 120;

fn last_code_line(code: &str) -> Option<String> {
    let line = match crate::command::label_of(code) {
        Some(label) => label,
        None => code.lines().rev().find(|l| !l.trim().is_empty())?.trim_end(),
    };
    let mut out: String = line.chars().take(LAST_CODE_MAX).collect();
    if out.len() < line.len() {
        out.push('…');
    }
    Some(out)
}

impl SessionView {
    pub fn memory_mb(&self) -> u64 {
        self.record.limits.memory_bytes >> 20
    }

    pub fn timeout_seconds(&self) -> f64 {
        self.record.limits.timeout_ms as f64 / 1000.0
    }

    /// The session's effective network configuration (none for a session
    /// from before networking, or an unreadable record).
    pub fn network(&self) -> NetConfig {
        forkbox_sessions::manager::from_store_limits(&self.record.limits).network
    }
}

/// A checkpoint of a session, numbered by seq.
#[derive(Clone, Debug)]
pub struct CheckpointView {
    pub seq: i64,
    /// Seq of its parent (None: over the template or another session's checkpoint).
    pub parent: Option<i64>,
    pub code: String,
    pub created_ms: i64,
    pub bytes: u64,
    pub pages: u64,
    /// The session's head.
    pub head: bool,
}

/// Tags: at most 32, keys 1-128 bytes without ':', values at most 1024 bytes.
pub fn check_tags(tags: &BTreeMap<String, String>) -> Result<(), RuntimeError> {
    if tags.len() > 32 || tags.iter().any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains(':')) {
        return Err(RuntimeError::Invalid(
            "tags: at most 32, keys 1-128 bytes without ':', values at most 1024 bytes".into(),
        ));
    }
    Ok(())
}

impl Runtime {
    fn view(&self, record: SessionRecord) -> Result<SessionView, RuntimeError> {
        let head = self.sessions.head(&record)?;
        let (checkpoint, forked_from) = match head.clone() {
            Some(c) if c.session_id == record.id => (Some(c.seq), None),
            Some(c) => (None, Some(ForkedFrom { session: c.session_id, checkpoint: c.seq })),
            None => (None, None),
        };
        let last_code = head.as_ref().and_then(|c| last_code_line(&c.code));
        let template = self.template_name(&record.template_id);
        Ok(SessionView {
            resident: self.sessions.is_resident(&record.id),
            record,
            checkpoint,
            forked_from,
            template,
            last_code,
        })
    }

    /// The limits of a new session from a request's `memory_mb` / `timeout_seconds`.
    pub fn session_limits(&self, memory_mb: Option<u64>, timeout_seconds: Option<f64>) -> Result<Limits, RuntimeError> {
        let mut limits = self.config.limits.clone();
        limits.timeout = self.timeout(timeout_seconds)?;
        if let Some(mb) = memory_mb {
            if mb < 64 || mb > self.config.max_memory_mb {
                return Err(RuntimeError::Invalid(format!(
                    "memory_mb must be 64 to {}, got {mb}",
                    self.config.max_memory_mb
                )));
            }
            limits.memory_bytes = mb << 20;
        }
        Ok(limits)
    }

    /// Count the tenant's sessions and create one under one lock, so that
    /// concurrent creates cannot overshoot `quota.max_sessions`.
    fn within_session_quota(
        &self,
        tenant: &str,
        quota: &Quota,
        create: impl FnOnce() -> Result<SessionRecord, RuntimeError>,
    ) -> Result<SessionView, RuntimeError> {
        let rec = {
            let _g = self.create_lock.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(max) = quota.max_sessions {
                let n = self.sessions.count(Some(tenant))?;
                if n >= max {
                    return Err(RuntimeError::QuotaExceeded(format!(
                        "this API key allows {max} sessions and {n} exist; delete some first"
                    )));
                }
            }
            create()?
        };
        self.view(rec)
    }

    /// A new session (validated tags and limits), within `quota`.
    pub fn create_session(
        &self,
        tenant: &str,
        new: NewSession<'_>,
        quota: &Quota,
    ) -> Result<SessionView, RuntimeError> {
        check_tags(&new.tags)?;
        let mut limits = self.session_limits(new.memory_mb, new.timeout_seconds)?;
        let template = self.template(tenant, new.template)?;
        // The session records every layer (the template's too): kept across eviction and forks.
        crate::exec::narrow_network(&mut limits, &template, new.network);
        // Its secrets: the key's, the template's, the request's (a later one wins by name).
        crate::exec::set_secrets(&mut limits, &template, new.key_secrets, &new.secrets);
        self.within_session_quota(tenant, quota, || {
            Ok(self.sessions.create_on(tenant, new.tags, &limits, &template)?)
        })
    }

    /// A new session starting at a checkpoint (default: the head) of `id`, within `quota`.
    pub fn fork_session(
        &self,
        tenant: &str,
        id: &str,
        checkpoint: Option<i64>,
        tags: BTreeMap<String, String>,
        quota: &Quota,
    ) -> Result<SessionView, RuntimeError> {
        check_tags(&tags)?;
        self.within_session_quota(tenant, quota, || Ok(self.sessions.fork(tenant, id, checkpoint, tags)?))
    }

    pub fn session(&self, tenant: &str, id: &str) -> Result<SessionView, RuntimeError> {
        self.view(self.sessions.get(tenant, id)?)
    }

    /// The tenant's sessions with all of `tags` (key, value), oldest first.
    pub fn sessions(&self, tenant: &str, tags: &[(String, String)]) -> Result<Vec<SessionView>, RuntimeError> {
        self.sessions.list(tenant, tags)?.into_iter().map(|r| self.view(r)).collect()
    }

    /// Live sessions of `tenant` (of all tenants with None).
    pub fn session_count(&self, tenant: Option<&str>) -> Result<u64, RuntimeError> {
        Ok(self.sessions.count(tenant)?)
    }

    pub fn resident_sessions(&self) -> usize {
        self.sessions.resident_count()
    }

    pub fn is_resident(&self, id: &str) -> bool {
        self.sessions.is_resident(id)
    }

    pub fn delete_session(&self, tenant: &str, id: &str) -> Result<(), RuntimeError> {
        Ok(self.sessions.delete(tenant, id)?)
    }

    /// Remove the package layers that no session, checkpoint or template
    /// refers to and that are at least `min_age` old (the upkeep does it
    /// every `forkbox_sessions::manager::PACKAGE_GC_EVERY`); their ids.
    pub fn gc_packages(&self, min_age: std::time::Duration) -> Result<Vec<String>, RuntimeError> {
        Ok(self.sessions.gc_packages(min_age)?)
    }

    /// Evict the session's sandbox to disk now (it stays at its head and
    /// resumes on its next use); false if it was not resident, or an exec runs in it.
    pub fn evict_session(&self, tenant: &str, id: &str) -> Result<bool, RuntimeError> {
        self.sessions.get(tenant, id)?;
        Ok(self.sessions.evict(id))
    }

    /// Make the session resident (resume it from disk) without running anything.
    pub fn resume_session(&self, tenant: &str, id: &str) -> Result<(), RuntimeError> {
        Ok(self.sessions.resume(tenant, id)?)
    }

    /// Interrupt (Ctrl-C) the session's running exec; false if none runs.
    pub fn interrupt(&self, tenant: &str, id: &str) -> Result<bool, RuntimeError> {
        Ok(self.sessions.interrupt(tenant, id)?)
    }

    pub fn checkpoints(&self, tenant: &str, id: &str) -> Result<Vec<CheckpointView>, RuntimeError> {
        let rec = self.sessions.get(tenant, id)?;
        let list = self.sessions.checkpoints(tenant, id)?;
        // Parents by number across the lineage (a fork's first checkpoint has its source's as parent).
        let (_, tree) = self.sessions.tree(tenant, id)?;
        let seq_of: HashMap<i64, i64> = tree.checkpoints.iter().chain(list.iter()).map(|c| (c.id, c.seq)).collect();
        Ok(list
            .iter()
            .map(|c| CheckpointView {
                seq: c.seq,
                parent: c.parent.and_then(|p| seq_of.get(&p).copied()),
                code: c.code.clone(),
                created_ms: c.created_ms,
                bytes: c.bytes,
                pages: c.pages,
                head: Some(c.id) == rec.head,
            })
            .collect())
    }

    /// Move the session's head back to checkpoint `seq`.
    pub fn revert(&self, tenant: &str, id: &str, seq: i64) -> Result<SessionView, RuntimeError> {
        self.sessions.revert(tenant, id, seq)?;
        self.session(tenant, id)
    }

    /// Merge the session's layer chain once it is long (what the upkeep does for every session).
    pub fn compact_session(&self, tenant: &str, id: &str) -> Result<bool, RuntimeError> {
        Ok(self.sessions.compact_session(tenant, id)?)
    }

    /// Refuse an exec or upload once the tenant's checkpoints are over `quota.max_disk_mb`.
    pub fn check_disk(&self, tenant: &str, quota: &Quota) -> Result<(), RuntimeError> {
        // The sessions charge every checkpoint against it before writing.
        self.sessions.set_disk_quota(tenant, quota.max_disk_mb.map(|mb| mb.saturating_mul(1 << 20)));
        let Some(max_mb) = quota.max_disk_mb else { return Ok(()) };
        let used = self.sessions.disk_bytes(tenant)?;
        if used >= max_mb.saturating_mul(1 << 20) {
            return Err(RuntimeError::QuotaExceeded(format!(
                "the checkpoints and package layers of this tenant's sessions take {:.1} MiB, the key allows {max_mb} MiB; delete sessions first",
                used as f64 / (1 << 20) as f64
            )));
        }
        Ok(())
    }

    /// What can refuse a session exec before it starts: the code, the session, the disk quota.
    pub fn check_session_exec(&self, tenant: &str, id: &str, code: &str, quota: &Quota) -> Result<(), RuntimeError> {
        self.check_code(code)?;
        self.sessions.get(tenant, id)?;
        self.check_disk(tenant, quota)
    }

    /// A session exec's `timeout_seconds`: > 0 and at most the session's own
    /// time limit (None: that limit). Blocks (reads the session's record).
    pub fn session_exec_timeout(
        &self,
        tenant: &str,
        id: &str,
        seconds: Option<f64>,
    ) -> Result<Option<Duration>, RuntimeError> {
        let Some(s) = seconds else { return Ok(None) };
        let max_ms = self.sessions.get(tenant, id)?.limits.timeout_ms;
        let max = max_ms as f64 / 1000.0;
        if !(s.is_finite() && s > 0.0 && s <= max) {
            return Err(RuntimeError::Invalid(format!(
                "timeout_seconds must be > 0 and <= {max} (the session's time limit; PATCH the session to raise it), got {s}"
            )));
        }
        Ok(Some(Duration::from_secs_f64(s)))
    }

    /// Change a session's tags (replaced as a whole) and/or limits, validated
    /// like a new session's (`memory_mb`: 64 to the maximum; `timeout_seconds`:
    /// > 0, at most the runtime's maximum). Persisted; a memory change applies
    /// > from the next exec (409 `session_busy` while one runs).
    pub fn update_session(
        &self,
        tenant: &str,
        id: &str,
        tags: Option<&BTreeMap<String, String>>,
        memory_mb: Option<u64>,
        timeout_seconds: Option<f64>,
    ) -> Result<SessionView, RuntimeError> {
        if let Some(t) = tags {
            check_tags(t)?;
        }
        let limits = self.session_limits(memory_mb, timeout_seconds)?;
        let memory = memory_mb.map(|_| limits.memory_bytes);
        let timeout = timeout_seconds.map(|_| limits.timeout);
        self.view(self.sessions.update(tenant, id, tags, memory, timeout)?)
    }

    /// Run code in a session on an exec thread (within the disk quota); the
    /// result names the checkpoint that recorded it. `timeout`: this exec's
    /// time limit (see [`Self::session_exec_timeout`]; None: the session's).
    /// `hold` is dropped after.
    #[allow(clippy::too_many_arguments)]
    pub async fn session_exec(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        code: impl Into<SessionCode>,
        timeout: Option<Duration>,
        quota: Quota,
        mut output: Option<Box<dyn Output>>,
        hold: impl Send + 'static,
    ) -> Result<ExecOutcome, RuntimeError> {
        let SessionCode { code, prelude } = code.into();
        self.check_code(&code)?;
        if let Some(p) = &prelude {
            self.check_code(p)?;
        }
        // `%pip install` lines: the host's pip runs here, never on an exec thread.
        let plan = if forkbox_engine::packages::pip_lines(&code).map_err(RuntimeError::Invalid)?.is_some() {
            let (rt, code, t) = (self.clone(), code.clone(), tenant.to_string());
            tokio::task::spawn_blocking(move || {
                // The quota first: it bounds what the wheels' new layers may unpack to.
                rt.check_disk(&t, &quota)?;
                Ok::<_, RuntimeError>(rt.sessions.plan_pip(&t, &code)?)
            })
            .await
            .map_err(|_| RuntimeError::WorkerGone)??
        } else {
            None
        };
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.workers.spawn(move || {
            let _hold = hold;
            if let Err(e) = rt.check_disk(&tenant, &quota) {
                if let Some(out) = output.as_mut() {
                    out.end();
                }
                let _ = tx.send(Err(e));
                return;
            }
            let r = with_output(&mut output, prelude.as_deref(), |opts| {
                rt.sessions.exec_deferred(&tenant, &id, &code, ExecOptions { timeout, ..opts }, plan.as_ref())
            });
            match r {
                // The answer first; its checkpoint is made durable after it
                // (the session's next use waits for that).
                Ok((o, settle)) => {
                    let pending = settle.as_ref().map(|_| Settling::begin());
                    let _ = tx.send(Ok(o));
                    if let Some(s) = settle {
                        let _ = s.finish();
                    }
                    drop(pending);
                }
                Err(e) => {
                    let _ = tx.send(Err(e.into()));
                }
            }
        });
        rx.await.map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Write a file into the session (checkpointed like an exec), within the
    /// disk quota; the seq of the checkpoint that recorded it.
    pub fn write_file(
        &self,
        tenant: &str,
        id: &str,
        path: &str,
        data: &[u8],
        quota: &Quota,
    ) -> Result<i64, RuntimeError> {
        self.check_disk(tenant, quota)?;
        Ok(self.sessions.write_file(tenant, id, path, data)?.seq)
    }

    /// [`Self::write_file`] of the `len` bytes of `src` (an upload streamed to
    /// a temporary file: read from offset 0 a chunk at a time into the
    /// sandbox's file, wherever the sandbox runs).
    pub fn write_file_from(
        &self,
        tenant: &str,
        id: &str,
        path: &str,
        src: &std::fs::File,
        len: u64,
        quota: &Quota,
    ) -> Result<i64, RuntimeError> {
        self.check_disk(tenant, quota)?;
        Ok(self.sessions.write_file_from(tenant, id, path, src, len)?.seq)
    }

    /// Install packages into the session (resolved and downloaded on the host,
    /// mounted from shared read-only layers, checkpointed), within the disk
    /// quota. pip runs on a blocking thread, the guest on an exec thread.
    pub async fn install_packages(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        specs: Vec<String>,
        quota: Quota,
    ) -> Result<forkbox_sessions::manager::PackagesOutcome, RuntimeError> {
        let (rt, t, i, sp) = (self.clone(), tenant.to_string(), id.to_string(), specs.clone());
        let pkgs = tokio::task::spawn_blocking(move || -> Result<_, RuntimeError> {
            rt.check_disk(&t, &quota)?;
            // 404 for an unknown session before pip runs.
            rt.sessions.get(&t, &i)?;
            Ok(rt.sessions.resolve_packages_for(&t, &sp)?)
        })
        .await
        .map_err(|_| RuntimeError::WorkerGone)??;
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        self.workers.run(move || Ok(rt.sessions.install_resolved(&tenant, &id, &specs, &pkgs)?)).await?
    }

    /// Start a background command in a session (see
    /// [`crate::command::Command::background_code`]): an exec, after which the
    /// command runs on between calls as a job of the session. With
    /// `checkpoint` the exec checkpoints like any; without, it makes none (the
    /// caller records the command's outcome later with [`Self::checkpoint_now`]).
    /// The job, or the exit status of a command that could not start (with
    /// the exec's result).
    #[allow(clippy::too_many_arguments)]
    pub async fn session_background_command(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        code: String,
        timeout: Option<Duration>,
        quota: Quota,
        checkpoint: bool,
        hold: impl Send + 'static,
    ) -> Result<JobStart, RuntimeError> {
        self.check_code(&code)?;
        if self.sessions.host_kind() == "thread" {
            // There a session's sandbox runs only during a call: a background command would be frozen.
            return Err(RuntimeError::Invalid(
                "background commands need session workers (--isolation process, the default): with --isolation \
                 thread a session runs only during a call"
                    .into(),
            ));
        }
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        self.workers
            .run(move || {
                let _hold = hold;
                rt.check_disk(&tenant, &quota)?;
                let opts = ExecOptions { timeout, job: true, ..Default::default() };
                let (result, checkpoint) = if checkpoint {
                    let o = rt.sessions.exec_with(&tenant, &id, &code, opts)?;
                    (o.result, Some(o.checkpoint))
                } else {
                    (rt.sessions.exec_uncheckpointed(&tenant, &id, &code, opts)?, None)
                };
                let started = match result.value.as_deref().map(str::parse::<i64>) {
                    Some(Ok(pid)) if pid > 0 => {
                        let pid = u32::try_from(pid).map_err(|_| RuntimeError::Invalid("bad pid".into()))?;
                        Ok(rt.sessions.job(&tenant, &id, pid)?)
                    }
                    Some(Ok(status)) if status < 0 => Err(i32::try_from(-status).unwrap_or(126)),
                    _ => Err(crate::command::CommandResult::of(&result).exit_code),
                };
                Ok(JobStart { result, checkpoint, started })
            })
            .await?
    }

    /// The session's background jobs.
    pub fn session_jobs(&self, tenant: &str, id: &str) -> Result<Vec<JobInfo>, RuntimeError> {
        Ok(self.sessions.jobs(tenant, id)?)
    }

    /// The listening TCP sockets of the session's sandbox (`None`: it is not
    /// resident, so nothing listens until a request brings it back).
    pub fn session_listening_ports(&self, tenant: &str, id: &str) -> Result<Option<Vec<ListeningPort>>, RuntimeError> {
        Ok(self.sessions.listening_ports(tenant, id)?)
    }

    /// A slice of a background job's stdout or stderr.
    pub fn job_output(
        &self,
        tenant: &str,
        id: &str,
        pid: u32,
        stream: Stream,
        offset: u64,
        max: usize,
    ) -> Result<JobChunk, RuntimeError> {
        Ok(self.sessions.job_output(tenant, id, pid, stream, offset, max)?)
    }

    /// Send a signal to a background job's processes.
    pub fn job_signal(&self, tenant: &str, id: &str, pid: u32, signal: i32) -> Result<JobInfo, RuntimeError> {
        Ok(self.sessions.job_signal(tenant, id, pid, signal)?)
    }

    /// Wait at most `timeout` for a background job to end (on a blocking thread).
    pub async fn job_wait(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        pid: u32,
        timeout: Duration,
    ) -> Result<JobInfo, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.job_wait(&tenant, &id, pid, timeout)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// A connection to the listener on `port` inside the session's sandbox
    /// (the port proxy; a paused session is resumed first, on a blocking
    /// thread): the host end of a stream socket pair, non-blocking.
    pub async fn connect_port(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        port: u16,
    ) -> Result<std::os::unix::net::UnixStream, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || {
            let s = rt.sessions.connect_port(&tenant, &id, port)?;
            s.set_nonblocking(true)
                .map_err(|e| RuntimeError::Open { what: "the port connection", message: e.to_string() })?;
            Ok(s)
        })
        .await
        .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Wait at most `timeout` for a background job to write past `offsets`
    /// (stdout, stderr) or end (on a blocking thread).
    pub async fn job_watch(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        pid: u32,
        offsets: [u64; 2],
        timeout: Duration,
    ) -> Result<JobInfo, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.job_watch(&tenant, &id, pid, offsets, timeout)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Watch the session's file-system changes from `since` (None: stop
    /// watching), waiting at most `timeout` for one (on a blocking thread).
    /// None when the session is not resident: its journal did not come back with it.
    pub async fn fs_watch(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        since: Option<u64>,
        timeout: Duration,
    ) -> Result<Option<forkbox_engine::Changes>, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.fs_watch(&tenant, &id, since, timeout)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// What the session's sandbox uses now (None when it is not resident).
    pub fn session_usage(&self, tenant: &str, id: &str) -> Result<Option<forkbox_engine::Usage>, RuntimeError> {
        Ok(self.sessions.usage(tenant, id)?)
    }

    /// Resize the terminal of a background job started on a pty.
    pub async fn job_resize(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        pid: u32,
        rows: u16,
        cols: u16,
    ) -> Result<JobInfo, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.job_resize(&tenant, &id, pid, rows, cols)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Write to a background job's stdin (then close it if `eof`), on a
    /// blocking thread: a full stdin waits a few seconds for the job to read.
    pub async fn job_stdin(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        pid: u32,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<JobInfo, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.job_stdin(&tenant, &id, pid, &data, eof)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// Checkpoint the session as it is now (what its background work changed), named `label`.
    pub async fn checkpoint_now(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        label: String,
    ) -> Result<CheckpointRecord, RuntimeError> {
        let (rt, tenant, id) = (self.clone(), tenant.to_string(), id.to_string());
        tokio::task::spawn_blocking(move || Ok(rt.sessions.checkpoint_now(&tenant, &id, &label)?))
            .await
            .map_err(|_| RuntimeError::WorkerGone)?
    }

    /// A file of the session, at most `max` bytes (`file_too_large` above).
    pub fn read_file(&self, tenant: &str, id: &str, path: &str, max: usize) -> Result<Vec<u8>, RuntimeError> {
        Ok(self.sessions.read_file(tenant, id, path, max)?)
    }

    pub fn list_files(&self, tenant: &str, id: &str, dir: &str) -> Result<Vec<FileEntry>, RuntimeError> {
        Ok(self.sessions.list_files(tenant, id, dir)?)
    }

    /// A file-system operation on the session's files (stat, walk, mkdir, move, remove), done by
    /// the host on the guest's file system: reading makes no checkpoint; a change makes one
    /// (its number is returned), within the disk quota.
    pub fn file_op(
        &self,
        tenant: &str,
        id: &str,
        op: &FileOp,
        quota: &Quota,
    ) -> Result<(FileOpOutcome, Option<i64>), RuntimeError> {
        if op.changes() {
            self.check_disk(tenant, quota)?;
        }
        let (out, c) = self.sessions.file_op(tenant, id, op)?;
        Ok((out, c.map(|c| c.seq)))
    }
}

/// What a session exec runs: `code`, and a `prelude` the guest runs just before
/// it in the same call (a caller's setup of the session that must not make a
/// call and a checkpoint of its own; compiled apart, so `code`'s line numbers
/// stay its own).
#[derive(Clone, Debug, Default)]
pub struct SessionCode {
    pub code: String,
    pub prelude: Option<String>,
}

impl From<String> for SessionCode {
    fn from(code: String) -> SessionCode {
        SessionCode { code, prelude: None }
    }
}

/// Checkpoints of this process being made durable after their reply.
static SETTLING: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// One checkpoint being settled (counted until dropped).
struct Settling;

impl Settling {
    fn begin() -> Settling {
        *SETTLING.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Settling
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        let mut n = SETTLING.0.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        SETTLING.1.notify_all();
    }
}

/// Wait at most `timeout` until every checkpoint answered before its
/// commit is durable; false if some still are not. A process that exits right
/// after a reply (an embedded CLI or MCP server whose client went away) calls
/// this first: its exec threads end with the process, and a commit cut short
/// leaves the session as it was before that exec.
pub fn wait_settled(timeout: Duration) -> bool {
    let n = SETTLING.0.lock().unwrap_or_else(|e| e.into_inner());
    let (n, _) = SETTLING.1.wait_timeout_while(n, timeout, |n| *n > 0).unwrap_or_else(|e| e.into_inner());
    *n == 0
}
