//! Background jobs: processes an exec started to keep running (with the
//! processes they start in turn, whose output is the job's), as the sandbox's
//! host sees them between calls. Their output rings and stdin buffers are the
//! kernel's (`Kernel::job_out`, `job_in`; which job a process belongs to is
//! `Kernel::jobs`); here is what the host tracks of each job: its argv, when
//! it started, its CPU time and how its leader ended.

use std::collections::BTreeMap;
use std::time::Duration;

use forkbox_linux::kernel::Kernel;
use forkbox_linux::procs::{Exit, GUEST_PID};
use serde::Serialize;

use crate::error::EngineError;

/// A background job: a process an exec started to keep running, with the
/// processes it starts in turn (their output is the job's).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct JobInfo {
    /// The leader's pid (the process the exec started).
    pub pid: u32,
    /// Its argv after its last execve (at most `JOB_ARGV_MAX` arguments, each cut to `JOB_ARG_MAX`).
    pub argv: Vec<String>,
    pub started_unix_ms: i64,
    /// vCPU time of the job's processes.
    pub cpu_seconds: f64,
    pub running: bool,
    /// How the leader ended: its exit status, or the signal that killed it.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// Bytes written so far to each stream (the ring keeps the last `JOB_OUTPUT_BYTES`).
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

/// A slice of a job's stream.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct JobChunk {
    /// The stream offset of `data`'s first byte (past the asked one when those bytes were dropped).
    pub offset: u64,
    /// The offset just past the last byte written so far.
    pub end: u64,
    pub data: Vec<u8>,
    /// The job still runs (more may come).
    pub running: bool,
}

/// Jobs kept (the oldest finished go first past it).
const JOBS_MAX: usize = 64;
const JOB_ARGV_MAX: usize = 64;
const JOB_ARG_MAX: usize = 256;

/// What the host tracks of one job.
pub(crate) struct Job {
    argv: Vec<String>,
    started_unix_ms: i64,
    cpu: Duration,
    pub(crate) exit: Option<Exit>,
}

/// The jobs of a sandbox, by leader pid (host-side: a checkpoint does not record them).
#[derive(Default)]
pub(crate) struct Jobs {
    by_leader: BTreeMap<u32, Job>,
    /// The exec running now starts jobs (`ExecOptions::job`).
    pub(crate) starting: bool,
}

impl Jobs {
    /// Job `pid` (`NoSuchJob` if there is none with that leader pid).
    pub(crate) fn get(&self, pid: u32) -> Result<&Job, EngineError> {
        self.by_leader.get(&pid).ok_or(EngineError::NoSuchJob(pid))
    }

    /// A process forked `child`: it joins its parent's job, or starts one
    /// when the agent forks it in an exec that starts jobs.
    pub(crate) fn join(&mut self, kernel: &mut Kernel, parent: u32, child: u32) {
        if let Some(&leader) = kernel.jobs.get(&parent) {
            kernel.jobs.insert(child, leader);
            return;
        }
        if !(self.starting && parent == GUEST_PID) {
            return;
        }
        let finished: Vec<u32> = self.by_leader.iter().filter(|(_, j)| j.exit.is_some()).map(|(p, _)| *p).collect();
        for p in finished.into_iter().take((self.by_leader.len() + 1).saturating_sub(JOBS_MAX)) {
            self.by_leader.remove(&p);
            kernel.job_out.remove(&p);
            kernel.job_in.remove(&p);
        }
        let started_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let argv = self.by_leader.get(&parent).map(|j| j.argv.clone()).unwrap_or_default();
        self.by_leader.insert(child, Job { argv, started_unix_ms, cpu: Duration::ZERO, exit: None });
        kernel.jobs.insert(child, child);
        kernel.job_out.insert(child, Default::default());
        kernel.job_in.insert(child, Default::default());
    }

    /// Process `pid` ended: if it leads a job, the job has ended that way.
    pub(crate) fn ended(&mut self, pid: u32, how: Exit) {
        if let Some(job) = self.by_leader.get_mut(&pid) {
            job.exit.get_or_insert(how);
        }
    }

    /// Process `pid` ran `spent` on the vCPU: its job's CPU time.
    pub(crate) fn charge(&mut self, kernel: &Kernel, pid: u32, spent: Duration) {
        if let Some(job) = kernel.jobs.get(&pid).and_then(|l| self.by_leader.get_mut(l)) {
            job.cpu = job.cpu.saturating_add(spent);
        }
    }

    /// Process `pid` execve'd `argv`: if it leads a job, the job shows it.
    pub(crate) fn exec(&mut self, pid: u32, argv: &[Vec<u8>]) {
        if let Some(job) = self.by_leader.get_mut(&pid) {
            job.argv = job_argv(argv);
        }
    }

    /// Every job, oldest first.
    pub(crate) fn list(&self, kernel: &Kernel) -> Vec<JobInfo> {
        self.by_leader.iter().map(|(p, j)| info(kernel, *p, j)).collect()
    }

    /// Job `pid` as the API shows it.
    pub(crate) fn info(&self, kernel: &Kernel, pid: u32) -> Result<JobInfo, EngineError> {
        self.get(pid).map(|j| info(kernel, pid, j))
    }
}

fn info(kernel: &Kernel, pid: u32, job: &Job) -> JobInfo {
    let (stdout_bytes, stderr_bytes) = kernel.job_out.get(&pid).map_or((0, 0), |r| (r[0].end(), r[1].end()));
    JobInfo {
        pid,
        argv: job.argv.clone(),
        started_unix_ms: job.started_unix_ms,
        cpu_seconds: job.cpu.as_secs_f64(),
        running: job.exit.is_none(),
        exit_code: match job.exit {
            Some(Exit::Code(c)) => Some(c),
            _ => None,
        },
        signal: match job.exit {
            Some(Exit::Signal(s)) => Some(s),
            _ => None,
        },
        stdout_bytes,
        stderr_bytes,
    }
}

/// A job's argv as shown: bounded, lossy UTF-8.
fn job_argv(argv: &[Vec<u8>]) -> Vec<String> {
    argv.iter()
        .take(JOB_ARGV_MAX)
        .map(|a| String::from_utf8_lossy(&a[..a.len().min(JOB_ARG_MAX)]).into_owned())
        .collect()
}
