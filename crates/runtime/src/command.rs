//! Commands beside exec: a shell command line or an argv run in the guest, as
//! an ordinary exec of a small, generated Python snippet (so checkpoints,
//! quotas, busy locks, time limits, interrupts, streaming and errors are
//! exactly an exec's).
//!
//! The snippet starts `cmd` with `subprocess.Popen` in the guest: a string runs
//! as `/bin/sh -c cmd`, a list is the argv itself (no shell; the program is
//! looked up on `PATH`). The child inherits the guest's stdout and stderr, so
//! its output is captured (and streamed) by the VMM like the exec's own; stdin
//! is `/dev/null`; `env` is laid over the guest's environment; `cwd` is where it
//! starts (default: the guest's working directory). The exec's value is the
//! exit status, which [`CommandResult::of`] reads back: a child killed by
//! signal N is 128 + N, a program that is not found 127, one that cannot be
//! started 126 (with a `forkbox:` line on stderr), a `cwd` that cannot be
//! entered 1 (also with a line), an interrupted command 130. The checkpoint's
//! code is `# command: <cmd>` followed by the snippet.

use std::collections::BTreeMap;

use crate::RuntimeError;

/// What to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandLine {
    /// Run by `/bin/sh -c`.
    Shell(String),
    /// The argv itself, no shell.
    Argv(Vec<String>),
}

/// A validated command (see [`Command::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    cmd: CommandLine,
    cwd: Option<String>,
    env: BTreeMap<String, String>,
}

/// Bounds on a command's parts (the generated code is also within the code limit).
pub const MAX_ARGS: usize = 4096;
pub const MAX_ENV: usize = 1024;
pub const MAX_PATH: usize = 4096;

/// The guest side: read the request, start the child, wait, return its status.
const HELPER: &str = r#"import json, os, subprocess, sys
def run(text):
    req = json.loads(text)
    cmd, cwd, env = req["cmd"], req.get("cwd"), req.get("env")
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
    if env:
        merged = dict(os.environ)
        merged.update(env)
        env = merged
    else:
        env = None
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    pty = req.get("pty")
    try:
        if pty:
            p = start_on_pty(argv, cwd, env, pty)
        else:
            # A background command with stdin reads the agent's fd 0: the job's stdin, fed by the API.
            stdin = None if req.get("background") and req.get("stdin") else subprocess.DEVNULL
            p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin)
    except OSError as e:
        rc = None
        reason = e.strerror or str(e)
        if cwd is not None and e.filename == cwd:
            msg, rc = "cannot enter cwd %r: %s" % (cwd, reason), 1
        elif isinstance(e, FileNotFoundError):
            msg, rc = "%s: command not found" % (argv[0],), 127
        else:
            msg, rc = "cannot run %s: %s" % (argv[0], reason), 126
        os.write(2, ("forkbox: %s\n" % msg).encode("utf-8", "replace"))
        return -rc if req.get("background") else rc
    if req.get("background"):
        return p.pid
    try:
        rc = p.wait()
    except BaseException:
        p.kill()
        p.wait()
        raise
    return 128 - rc if rc < 0 else rc
def start_on_pty(argv, cwd, env, size):
    # The command's stdin, stdout and stderr are a new pty's slave and it leads
    # a session with it as controlling terminal; the VMM sends the terminal's
    # output to the job's stdout and the API's stdin to the terminal.
    import builtins, fcntl, struct, termios
    held = builtins.__dict__.setdefault("_forkbox_ptys", [])
    for old in list(held):
        try:
            os.read(old, 0)
        except OSError:
            # Hung up (its command ended): the master goes.
            os.close(old)
            held.remove(old)
    env = dict(env if env is not None else os.environ)
    env.setdefault("TERM", "xterm-256color")
    m, s = os.openpty()
    try:
        fcntl.ioctl(m, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=s, stdout=s, stderr=s, start_new_session=True,
                             preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    except BaseException:
        os.close(m)
        raise
    finally:
        os.close(s)
    fcntl.ioctl(m, 0x54F0, p.pid)
    held.append(m)
    return p
"#;

fn no_nul(what: &str, s: &str) -> Result<(), RuntimeError> {
    if s.contains('\0') {
        return Err(RuntimeError::Invalid(format!("{what} contains a NUL byte")));
    }
    Ok(())
}

impl Command {
    /// Check a command: `cmd` non-empty (a list: 1 to 4096 strings, the first
    /// non-empty), `cwd` 1 to 4096 bytes, `env` at most 1024 names (non-empty,
    /// no `=`), nothing with a NUL byte.
    pub fn new(cmd: CommandLine, cwd: Option<String>, env: BTreeMap<String, String>) -> Result<Command, RuntimeError> {
        match &cmd {
            CommandLine::Shell(s) => {
                if s.trim().is_empty() {
                    return Err(RuntimeError::Invalid("cmd is empty".into()));
                }
                no_nul("cmd", s)?;
            }
            CommandLine::Argv(v) => {
                if v.is_empty() || v.len() > MAX_ARGS {
                    return Err(RuntimeError::Invalid(format!(
                        "cmd must hold 1 to {MAX_ARGS} arguments, got {}",
                        v.len()
                    )));
                }
                if v[0].is_empty() {
                    return Err(RuntimeError::Invalid("cmd[0] (the program) is empty".into()));
                }
                for (i, a) in v.iter().enumerate() {
                    no_nul(&format!("cmd[{i}]"), a)?;
                }
            }
        }
        if let Some(c) = &cwd {
            if c.is_empty() || c.len() > MAX_PATH {
                return Err(RuntimeError::Invalid(format!("cwd must be 1 to {MAX_PATH} bytes, got {}", c.len())));
            }
            no_nul("cwd", c)?;
        }
        if env.len() > MAX_ENV {
            return Err(RuntimeError::Invalid(format!("env may hold at most {MAX_ENV} variables, got {}", env.len())));
        }
        for (k, v) in &env {
            if k.is_empty() || k.contains('=') {
                return Err(RuntimeError::Invalid(format!("env: {k:?} is not a variable name (non-empty, no '=')")));
            }
            no_nul(&format!("env name {k:?}"), k)?;
            no_nul(&format!("env[{k:?}]"), v)?;
        }
        Ok(Command { cmd, cwd, env })
    }

    pub fn cmd(&self) -> &CommandLine {
        &self.cmd
    }

    /// The command as one line, for the checkpoint's label (at most ~200 characters).
    pub fn label(&self) -> String {
        let line = match &self.cmd {
            CommandLine::Shell(s) => s.clone(),
            CommandLine::Argv(v) => v.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "),
        };
        let mut line: String = line.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        if line.len() > 200 {
            let mut end = 200;
            while !line.is_char_boundary(end) {
                end -= 1;
            }
            line.truncate(end);
            line.push_str(" ...");
        }
        line
    }

    /// The Python the exec runs: one expression whose value is the exit status
    /// (it binds no name in the session but `_`, as any expression's value does).
    pub fn code(&self) -> String {
        self.snippet(false, false, None)
    }

    /// The Python of a background command: it starts the command and returns
    /// its pid at once (run with `ExecOptions::job`, the command is a
    /// background job of the session); a command that cannot start is
    /// `-status` (127 not found, 126 cannot run, 1 bad cwd) with a line on stderr.
    /// With `stdin`, its stdin is the job's, written through the API
    /// (`Sandbox::job_stdin`); without, `/dev/null`.
    pub fn background_code(&self, stdin: bool) -> String {
        self.snippet(true, stdin, None)
    }

    /// The Python of a background command on a new pseudo-terminal of
    /// `rows` x `cols`: its stdin, stdout and stderr are the terminal (the
    /// job's stdout is what the terminal shows, its stdin what is typed on it);
    /// it leads a session with the terminal as its controlling one; `TERM`
    /// is `xterm-256color` unless `env` says otherwise.
    pub fn pty_code(&self, rows: u16, cols: u16) -> String {
        self.snippet(true, true, Some((rows, cols)))
    }

    fn snippet(&self, background: bool, stdin: bool, pty: Option<(u16, u16)>) -> String {
        let cmd = match &self.cmd {
            CommandLine::Shell(s) => serde_json::Value::String(s.clone()),
            CommandLine::Argv(v) => serde_json::Value::from(v.clone()),
        };
        let mut req = serde_json::Map::new();
        req.insert("cmd".into(), cmd);
        if let Some(c) = &self.cwd {
            req.insert("cwd".into(), c.clone().into());
        }
        if !self.env.is_empty() {
            let env: serde_json::Map<String, serde_json::Value> =
                self.env.iter().map(|(k, v)| (k.clone(), v.clone().into())).collect();
            req.insert("env".into(), env.into());
        }
        if background {
            req.insert("background".into(), true.into());
        }
        if stdin {
            req.insert("stdin".into(), true.into());
        }
        if let Some((rows, cols)) = pty {
            req.insert("pty".into(), serde_json::json!([rows, cols]));
        }
        // A JSON string literal is a Python string literal (serde_json escapes only
        // `"`, `\` and control characters, all with escapes Python reads alike).
        let lit = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let req = serde_json::Value::Object(req).to_string();
        format!(
            "# command{}: {}\n(lambda g: (exec({}, g), g[\"run\"]({}))[1])({{}})\n",
            if background { " (background)" } else { "" },
            self.label(),
            lit(HELPER),
            lit(&req)
        )
    }
}

/// The label line of a session call that ran a command (`# command: ls -l`),
/// or None for any other code: what a listing shows of such a call instead of
/// the helper program it runs.
pub fn label_of(code: &str) -> Option<&str> {
    let mut lines = code.lines();
    let first = lines.next()?;
    let wrapper = lines.next()?.starts_with("(lambda g: (exec(");
    (first.starts_with("# command") && wrapper).then_some(first)
}

/// `a` quoted for a POSIX shell when it needs it (for labels only).
fn quote(a: &str) -> String {
    if !a.is_empty() && a.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

/// What a command did: its output and exit status.
#[derive(Clone, Debug, PartialEq)]
pub struct CommandResult {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

impl CommandResult {
    /// Read a command's exit status back from the exec that ran it. An exec
    /// interrupted while the command ran is 130 (the child is killed); one
    /// whose snippet failed otherwise (the session's own code broke
    /// `subprocess`, say) is 126; both with a `forkbox:` line on stderr.
    pub fn of(r: &forkbox_engine::ExecResult) -> CommandResult {
        let (mut stdout, mut stderr) = (r.stdout.clone(), r.stderr.clone());
        let exit_code = match (&r.error, r.value.as_deref().map(str::parse::<i32>)) {
            (None, Some(Ok(code))) => code,
            (Some(e), _) if e.kind == "KeyboardInterrupt" => {
                note(&mut stderr, "forkbox: the command was interrupted");
                130
            }
            (Some(e), _) => {
                note(&mut stderr, &format!("forkbox: the command could not run: {}: {}", e.kind, e.message));
                126
            }
            (None, v) => {
                note(&mut stderr, &format!("forkbox: the command's exit status did not come back (got {v:?})"));
                126
            }
        };
        stdout.shrink_to_fit();
        CommandResult { stdout, stderr, exit_code }
    }
}

fn note(stderr: &mut String, line: &str) {
    if !stderr.is_empty() && !stderr.ends_with('\n') {
        stderr.push('\n');
    }
    stderr.push_str(line);
    stderr.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(v: &[&str]) -> CommandLine {
        CommandLine::Argv(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn bad_commands_are_refused_with_what_is_wrong() {
        let e = |c: CommandLine, cwd: Option<&str>, env: &[(&str, &str)]| {
            let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Command::new(c, cwd.map(str::to_string), env).unwrap_err().to_string()
        };
        assert!(e(CommandLine::Shell("  ".into()), None, &[]).contains("cmd is empty"));
        assert!(e(argv(&[]), None, &[]).contains("1 to 4096"));
        assert!(e(argv(&[""]), None, &[]).contains("cmd[0]"));
        assert!(e(argv(&["ls", "a\0b"]), None, &[]).contains("cmd[1] contains a NUL"));
        assert!(e(CommandLine::Shell("ls".into()), Some(""), &[]).contains("cwd must be"));
        assert!(e(CommandLine::Shell("ls".into()), None, &[("A=B", "x")]).contains("not a variable name"));
        assert!(e(CommandLine::Shell("ls".into()), None, &[("A", "x\0")]).contains("NUL"));
        assert!(Command::new(CommandLine::Shell("ls".into()), Some("/tmp".into()), BTreeMap::new()).is_ok());
    }

    #[test]
    fn the_code_carries_the_request_as_a_python_literal() {
        let env = [("K".to_string(), "v \"q\" \\ \n é".to_string())].into_iter().collect();
        let c = Command::new(argv(&["echo", "it's", "a\nb"]), Some("/tmp".into()), env).unwrap();
        let code = c.code();
        let first = code.lines().next().unwrap();
        assert_eq!(first, "# command: echo 'it'\\''s' 'a b'");
        assert_eq!(label_of(&code), Some(first));
        assert_eq!(label_of("# command: not one\nprint(1)"), None);
        assert_eq!(label_of("print(1)"), None);
        assert_eq!(code.lines().count(), 2, "{code}");
        // The embedded request is the JSON of the command, as a string literal.
        let lit = code.rsplit_once("g[\"run\"](").unwrap().1.strip_suffix("))[1])({})\n").unwrap();
        let text: String = serde_json::from_str(lit).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["cmd"], serde_json::json!(["echo", "it's", "a\nb"]));
        assert_eq!(v["cwd"], "/tmp");
        assert_eq!(v["env"]["K"], "v \"q\" \\ \n é");
    }

    #[test]
    fn labels_are_one_short_line() {
        let c =
            Command::new(CommandLine::Shell(format!("echo {}\nls", "x".repeat(300))), None, BTreeMap::new()).unwrap();
        let l = c.label();
        assert!(!l.contains('\n') && l.len() <= 204 && l.ends_with(" ..."), "{l}");
    }

    /// The snippet on the host's Python (real Linux processes): status, cwd, env, errors.
    #[test]
    fn the_snippet_runs_commands_on_a_real_python() {
        let run = |c: Command| {
            let out = std::process::Command::new("python3")
                .args(["-c", "import sys\nsrc = sys.stdin.read()\nsys.stdout.flush()\nprint('rc=%d' % eval(src.split('\\n', 1)[1]))"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut ch| {
                    use std::io::Write;
                    ch.stdin.take().unwrap().write_all(c.code().as_bytes())?;
                    ch.wait_with_output()
                })
                .expect("python3 runs");
            (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
        };
        let env = [("FB_X".to_string(), "y z".to_string())].into_iter().collect();
        let (out, _) =
            run(Command::new(CommandLine::Shell("cd .; pwd; echo $FB_X; exit 3".into()), Some("/tmp".into()), env)
                .unwrap());
        assert_eq!(out, "/tmp\ny z\nrc=3\n");
        let (out, err) = run(Command::new(argv(&["no-such-program-x"]), None, BTreeMap::new()).unwrap());
        assert_eq!((out.as_str(), err.as_str()), ("rc=127\n", "forkbox: no-such-program-x: command not found\n"));
        let (out, err) = run(Command::new(argv(&["true"]), Some("/no/such/dir".into()), BTreeMap::new()).unwrap());
        assert_eq!(out, "rc=1\n");
        assert!(err.starts_with("forkbox: cannot enter cwd '/no/such/dir'"), "{err}");
        let (out, _) = run(Command::new(CommandLine::Shell("kill -9 $$".into()), None, BTreeMap::new()).unwrap());
        assert_eq!(out, "rc=137\n");
        let (out, _) =
            run(Command::new(argv(&["sh", "-c", "echo \"$0\" \"$1\"", "a b", "it's"]), None, BTreeMap::new()).unwrap());
        assert_eq!(out, "a b it's\nrc=0\n");
    }

    fn result(value: Option<&str>, error: Option<&str>) -> forkbox_engine::ExecResult {
        forkbox_engine::ExecResult {
            value: value.map(str::to_string),
            stdout: "out".into(),
            stderr: "err".into(),
            error: error.map(|k| forkbox_engine::PyError {
                kind: k.into(),
                message: "m".into(),
                traceback: String::new(),
            }),
            runtime_ms: 1.0,
            wall_ms: 1.0,
            syscalls: 1,
            outputs: Vec::new(),
            value_data: None,
            display: Vec::new(),
        }
    }

    #[test]
    fn exit_statuses_come_back_from_the_value() {
        assert_eq!(CommandResult::of(&result(Some("3"), None)).exit_code, 3);
        let r = CommandResult::of(&result(None, Some("KeyboardInterrupt")));
        assert_eq!((r.exit_code, r.stderr.as_str()), (130, "err\nforkbox: the command was interrupted\n"));
        let r = CommandResult::of(&result(None, Some("NameError")));
        assert_eq!(r.exit_code, 126);
        assert!(r.stderr.contains("NameError: m"));
        let r = CommandResult::of(&result(Some("'x'"), None));
        assert_eq!(r.exit_code, 126);
        assert!(r.stderr.contains("did not come back"));
    }
}
