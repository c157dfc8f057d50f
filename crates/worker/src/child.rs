//! The worker process itself (`forkbox __worker`, started by the supervisor
//! with its socket as fd 3): jail, then serve — one-shot execs one at a time
//! here, or a tenant's sessions (`session_child`). It never opens a path
//! outside its jail's read-only binds (and those only to read) and writes no
//! file but those whose descriptors the API process gave it.

use std::collections::HashMap;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use forkbox_engine::{Engine, ExecOptions, Stream, Template, NET_GLOBAL};

use crate::broker::{Brokered, Link};
use crate::jail;
use crate::protocol::{
    self, Done, FromWorker, Hello, NetDelta, Role, TemplateRef, ToWorker, WireError, TEST_FORBIDDEN_SYSCALL,
    TEST_INET_SOCKET,
};

/// The fd the supervisor passes the socket on.
pub const SOCKET_FD: i32 = 3;
/// The fd of the socket to the egress broker (the worker's only way out).
pub const EGRESS_FD: i32 = 4;
/// Where the jail shows the data directory's images, templates and package layers.
pub const JAIL_HOME: &str = "/home";
/// Templates a worker keeps open (least recently used closed first).
const OPEN_TEMPLATES: usize = 4;

#[derive(Debug, thiserror::Error)]
enum ChildError {
    #[error(transparent)]
    Protocol(#[from] protocol::ProtocolError),
    #[error("jail: {0}")]
    Jail(#[from] jail::JailError),
    #[error("{0}")]
    Other(String),
}

/// `forkbox __worker`: never returns.
pub fn main() -> ! {
    let code = match run() {
        Ok(()) => 0,
        // The server went away (it stopped, or dropped this worker): nothing to say.
        Err(ChildError::Protocol(e)) if e.is_closed() => 0,
        Err(e) => {
            eprintln!("forkbox worker: {e}");
            1
        }
    };
    std::process::exit(code)
}

fn run() -> Result<(), ChildError> {
    jail::close_fds_above(EGRESS_FD);
    // SAFETY: the supervisor passes its end of a socketpair as fd 3; nothing else owns it.
    let mut sock = unsafe { UnixStream::from_raw_fd(SOCKET_FD) };
    // SAFETY: and the egress broker's as fd 4.
    let egress = unsafe { UnixStream::from_raw_fd(EGRESS_FD) };
    let hello: Hello = protocol::read(&mut sock)?;
    if hello.jail {
        jail::join_cgroup(&hello);
        jail::unshare_outer(hello.own_network)?;
        jail::build_root(&hello)?;
        let mut go = [0; 2];
        // SAFETY: a 2-int array.
        if unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(ChildError::Other(format!("pipe2: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: single-threaded here; the child goes on with this program.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(ChildError::Other(format!("fork: {}", std::io::Error::last_os_error())));
        }
        if pid > 0 {
            // The launcher: report the worker's host pid, then only wait for it.
            let sent = protocol::write(&mut sock, &FromWorker::Started { pid: pid as u32 });
            drop(sock);
            drop(egress);
            if let Err(e) = jail::drop_launcher(hello.uid) {
                eprintln!("forkbox worker launcher: {e}");
            }
            // From here it only reports, waits and exits; failing closed: no worker under an unfiltered launcher.
            if let Err(e) = forkbox_engine::jail::enter_launcher(hello.seccomp) {
                eprintln!("forkbox worker launcher: {e}");
                // SAFETY: a signal to our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                std::process::exit(1);
            }
            let mut status = 0;
            // SAFETY: a one-byte write to our pipe, then a wait for our child.
            unsafe {
                libc::write(go[1], b"x".as_ptr() as *const libc::c_void, usize::from(sent.is_ok()));
                libc::close(go[1]);
                libc::waitpid(pid, &mut status, 0);
            }
            let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
            std::process::exit(code);
        }
        jail::die_with_parent();
        let mut b = [0u8; 1];
        // SAFETY: a one-byte buffer; the launcher writes once it has reported our pid.
        let got = unsafe {
            libc::close(go[1]);
            let got = libc::read(go[0], b.as_mut_ptr() as *mut libc::c_void, 1);
            libc::close(go[0]);
            got
        };
        if got != 1 {
            return Err(ChildError::Other("the launcher did not report the worker".into()));
        }
    } else {
        protocol::write(&mut sock, &FromWorker::Started { pid: std::process::id() })?;
    }
    // /dev/kvm is not in the jail: open it first.
    let cpu = Arc::new(forkbox_vmm::Cpu::new().map_err(|e| ChildError::Other(format!("opening /dev/kvm: {e}")))?);
    if hello.jail {
        jail::enter_root(&hello)?;
        jail::drop_privileges(&hello)?;
    }
    forkbox_engine::jail::enter_worker(hello.seccomp).map_err(|e| ChildError::Other(e.to_string()))?;
    let link = Link::start(egress).map_err(|e| ChildError::Other(format!("the egress link: {e}")))?;
    protocol::write(&mut sock, &FromWorker::Ready)?;
    let templates = Templates { cpu, open: HashMap::new(), tick: 0 };
    match hello.role {
        Role::Exec => Worker { hello, templates, link }.serve(&mut sock),
        Role::Sessions => crate::session_child::serve(hello, templates, link, sock).map_err(ChildError::Protocol),
    }
}

struct Opened {
    engine: Arc<Engine>,
    template: Arc<Template>,
    used: u64,
}

/// The templates a worker has open (at most `OPEN_TEMPLATES`, least recently used closed first).
pub(crate) struct Templates {
    cpu: Arc<forkbox_vmm::Cpu>,
    open: HashMap<TemplateRef, Opened>,
    tick: u64,
}

impl Templates {
    pub(crate) fn get(&mut self, r: &TemplateRef) -> Result<(Arc<Engine>, Arc<Template>), forkbox_engine::EngineError> {
        self.tick += 1;
        if let Some(o) = self.open.get_mut(r) {
            o.used = self.tick;
            return Ok((o.engine.clone(), o.template.clone()));
        }
        let packages = Arc::new(forkbox_image::packages::PackageStore::new(std::path::Path::new(JAIL_HOME)));
        let engine =
            Arc::new(Engine::open_with_cpu(self.cpu.clone(), std::path::Path::new(&r.image))?.with_packages(packages));
        let template = Arc::new(Template::load(&engine, std::path::Path::new(&r.dir))?);
        if self.open.len() >= OPEN_TEMPLATES {
            if let Some(oldest) = self.open.iter().min_by_key(|(_, o)| o.used).map(|(k, _)| k.clone()) {
                self.open.remove(&oldest);
            }
        }
        self.open.insert(r.clone(), Opened { engine: engine.clone(), template: template.clone(), used: self.tick });
        Ok((engine, template))
    }
}

struct Worker {
    hello: Hello,
    templates: Templates,
    link: Arc<Link>,
}

pub(crate) fn wire(e: forkbox_engine::EngineError, output: Option<forkbox_engine::CapturedOutput>) -> WireError {
    WireError { code: e.code().to_string(), message: e.to_string(), output }
}

impl Worker {
    fn serve(mut self, sock: &mut UnixStream) -> Result<(), ChildError> {
        loop {
            let req: ToWorker = match protocol::read(sock) {
                Ok(r) => r,
                // The server closed the socket (it stopped): so do we.
                Err(e) if e.is_closed() => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            match req {
                ToWorker::Ping => protocol::write(sock, &FromWorker::Pong)?,
                ToWorker::Prepare { template } => {
                    let r = self.templates.get(&template).map(|_| ()).map_err(|e| wire(e, None));
                    protocol::write(sock, &FromWorker::Prepared(r))?;
                }
                ToWorker::Exec { template, prelude, code, limits, stream, sandbox } => {
                    self.exec(sock, &template, prelude.as_deref(), &code, limits, stream, sandbox)?
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn exec(
        &mut self,
        sock: &mut UnixStream,
        r: &TemplateRef,
        prelude: Option<&str>,
        code: &str,
        limits: forkbox_engine::Limits,
        stream: bool,
        sandbox: u64,
    ) -> Result<(), ChildError> {
        if self.hello.test_actions && code.trim() == TEST_FORBIDDEN_SYSCALL {
            // Outside the filter's list: the filter kills this process here.
            // SAFETY: a syscall with no pointer arguments.
            unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
        }
        if self.hello.test_actions && code.trim() == TEST_INET_SOCKET {
            // A socket of the worker's own: its filter allows none but AF_UNIX.
            // SAFETY: socket takes no pointers.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            let e = std::io::Error::last_os_error();
            let done = Done {
                result: Err(WireError {
                    code: "internal".into(),
                    message: format!("socket(AF_INET) in the worker returned {fd} ({e})"),
                    output: None,
                }),
                fork_ms: 0.0,
                exec_ms: 0.0,
                net: NetDelta::default(),
            };
            protocol::write(sock, &FromWorker::Done(Box::new(done)))?;
            return Ok(protocol::write(sock, &FromWorker::Idle)?);
        }
        let net0 = NET_GLOBAL.read();
        let t = Instant::now();
        let forked = self.templates.get(r).and_then(|(engine, template)| template.fork(&engine, limits));
        let mut sb = match forked {
            Ok(sb) => sb,
            Err(e) => {
                let done = Done { result: Err(wire(e, None)), fork_ms: 0.0, exec_ms: 0.0, net: NetDelta::default() };
                protocol::write(sock, &FromWorker::Done(Box::new(done)))?;
                // Nothing to tear down, but the supervisor waits for Idle after every Done.
                return Ok(protocol::write(sock, &FromWorker::Idle)?);
            }
        };
        // Its way out is the broker's (no round trip unless the guest opens a socket).
        sb.set_egress(Arc::new(Brokered::new(Arc::clone(&self.link), sandbox)));
        let fork_ms = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        let mut write_err = None;
        // A prelude that raised answers for the exec (the code does not run).
        let failed = match prelude.map(|p| sb.exec(p)) {
            Some(Ok(r)) if r.error.is_some() => Some(Ok(r)),
            Some(Err(e)) => Some(Err(e)),
            _ => None,
        };
        let result = if let Some(r) = failed {
            r
        } else if stream {
            let out = &mut *sock;
            let mut sink = |stream: Stream, bytes: &[u8]| {
                if write_err.is_none() {
                    if let Err(e) = protocol::write(out, &FromWorker::Output { stream, data: bytes.to_vec() }) {
                        write_err = Some(e);
                    }
                }
            };
            sb.exec_with(
                code,
                ExecOptions { on_output: Some(&mut sink), interrupt: None, timeout: None, job: false, prelude: None },
            )
        } else {
            sb.exec(code)
        };
        let exec_ms = t.elapsed().as_secs_f64() * 1000.0;
        if let Some(e) = write_err {
            return Err(e.into());
        }
        let result = result.map_err(|e| wire(e, sb.take_failed_output()));
        let done = Done { result, fork_ms, exec_ms, net: NET_GLOBAL.read().since(net0) };
        protocol::write(sock, &FromWorker::Done(Box::new(done)))?;
        // After the reply: the VM goes back to the pool off the response path.
        drop(sb);
        Ok(protocol::write(sock, &FromWorker::Idle)?)
    }
}
