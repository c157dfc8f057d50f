//! `forkbox repl [SESSION]`: an interactive Python prompt on a session, embedded
//! or on a server. Input is gathered like CPython's prompt does (see
//! [`complete`]); output streams as the code produces it; Ctrl-C while code
//! runs interrupts it (KeyboardInterrupt in the guest, the session keeps its
//! state); Ctrl-C at the prompt clears the line; Ctrl-D, `:quit`, `exit()` and
//! `quit()` leave, saying how to come back to the session.
//!
//! Input is never lost: lines typed while code runs wait in the terminal and
//! run in order afterwards, and a paste (bracketed or not) keeps every line and
//! its indentation. The line editor keeps what it read past the current line
//! for the next one (rustyline's `buffer-redux`), and a Tab inserts a tab.

pub mod complete;

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use forkbox_client::{ClientError, CreateSession, ExecResult, StreamEvent};
use rustyline::error::ReadlineError;
use rustyline::{Cmd, DefaultEditor, KeyCode, KeyEvent, Modifiers};

use crate::api::{exec_streaming, Api, Target};
use crate::term::{escape, escape_text};

const HELP: &str = "\
Python code runs in the session; every exec is a checkpoint. Meta commands:
  :checkpoints   draw the session's tree of checkpoints, its forks' included (* = where it is)
  :revert N      move the session back to checkpoint N
  :fork [N]      start a new session from checkpoint N (default: the latest) and switch to it
  :session       show the session
  :help          this text
  :quit          leave (also Ctrl-D, exit(), quit()); the session is kept
Ctrl-C interrupts running code (the session keeps its state) or clears the input line.";

/// Terminal styling, only when the stream is a terminal.
struct Style {
    out_tty: bool,
    err_tty: bool,
}

impl Style {
    fn red(&self, s: &str) -> String {
        if self.err_tty && !s.is_empty() {
            format!("\x1b[31m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn bold(&self, s: &str) -> String {
        if self.out_tty {
            format!("\x1b[1m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

struct Repl<'a> {
    api: &'a Api,
    session: String,
    style: Style,
}

pub fn repl(api: &Api, home: &Path, session: Option<String>, template: Option<String>) -> Result<ExitCode> {
    let session = match session {
        Some(id) => api.block_on(api.client.get_session(&id)).with_context(|| format!("session {id}"))?.id,
        None => {
            let opts = CreateSession { template, ..CreateSession::default() };
            let s = api.block_on(api.client.create_session(&opts)).context("creating a session")?;
            s.id
        }
    };
    let style = Style { out_tty: std::io::stdout().is_terminal(), err_tty: std::io::stderr().is_terminal() };
    let mut r = Repl { api, session, style };
    println!("forkbox repl: session {} on {} (:help for commands, Ctrl-D to leave)", r.session, api.target);

    let mut rl = DefaultEditor::new().context("starting the line editor")?;
    // No completion here: a Tab (in a paste, or typed to indent) is part of the code.
    rl.bind_sequence(KeyEvent(KeyCode::Tab, Modifiers::NONE), Cmd::Insert(1, "\t".into()));
    std::fs::create_dir_all(home).ok();
    let history = home.join("repl_history");
    // A missing history file is the normal first run.
    let _ = rl.load_history(&history);
    let mut buf = String::new();
    loop {
        let prompt = if buf.is_empty() { ">>> " } else { "... " };
        match rl.readline(prompt) {
            Ok(line) => {
                // Kept on disk line by line, so a killed REPL loses nothing (and two REPLs share their history).
                if !line.trim().is_empty() && rl.add_history_entry(line.as_str()).unwrap_or(false) {
                    if let Err(e) = rl.append_history(&history) {
                        tracing::debug!("appending to the REPL history {}: {e}", history.display());
                    }
                }
                if buf.is_empty() && line.trim_start().starts_with(':') {
                    if !r.meta(line.trim())? {
                        break;
                    }
                    continue;
                }
                if !buf.is_empty() {
                    buf.push('\n');
                }
                buf.push_str(&line);
                if complete::check(&buf) == complete::Input::Complete {
                    let code = std::mem::take(&mut buf);
                    if !code.trim().is_empty() && r.run(&code) == Ran::Exit {
                        break;
                    }
                }
            }
            Err(ReadlineError::Interrupted) => {
                buf.clear();
                eprintln!("{}", r.style.red("KeyboardInterrupt"));
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading input"),
        }
    }
    r.farewell();
    Ok(ExitCode::SUCCESS)
}

/// What an exec asks of the prompt.
#[derive(Debug, PartialEq, Eq)]
enum Ran {
    Continue,
    /// The code raised SystemExit (`exit()`, `quit()`, `sys.exit()`): leave.
    Exit,
}

impl Repl<'_> {
    /// How to come back to this session, said when the REPL ends.
    fn farewell(&self) {
        let url =
            if self.api.target.starts_with("http") { format!("--url {} ", self.api.target) } else { String::new() };
        let at = match self.api.block_on(self.api.client.get_session(&self.session)) {
            Ok(s) => s.checkpoint.map_or(String::new(), |n| format!(" at checkpoint {n}")),
            Err(_) => String::new(),
        };
        println!("session {} is kept{at}; come back to it with: forkbox {url}repl {}", self.session, self.session);
    }

    /// Run code, streaming its output; Ctrl-C meanwhile interrupts it.
    fn run(&mut self, code: &str) -> Ran {
        let client = &self.api.client;
        let id = self.session.clone();
        let style = &self.style;
        let mut out_ends_line = true;
        let mut show = |ev: &StreamEvent| match ev {
            StreamEvent::Stdout(s) if !s.is_empty() => {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(s.as_bytes());
                let _ = o.flush();
                out_ends_line = s.ends_with('\n');
            }
            StreamEvent::Stderr(s) if !s.is_empty() => {
                let mut e = std::io::stderr().lock();
                let _ = e.write_all(style.red(s).as_bytes());
                let _ = e.flush();
            }
            _ => {}
        };
        let result: Result<ExecResult, ClientError> = self.api.block_on(async {
            let exec = exec_streaming(client, Target::Session(&id), code, &mut show);
            tokio::pin!(exec);
            loop {
                tokio::select! {
                    r = &mut exec => break r,
                    _ = tokio::signal::ctrl_c() => {
                        match client.interrupt(&id).await {
                            Ok(true) => eprintln!("{}", style.red("interrupting...")),
                            Ok(false) => {}
                            Err(e) => eprintln!("{}", style.red(&format!("forkbox: interrupt failed: {e}"))),
                        }
                    }
                }
            }
        });
        self.api.after_exec(&id);
        match result {
            Ok(r) => {
                if !out_ends_line {
                    println!();
                }
                if let Some(e) = &r.error {
                    if e.kind == "SystemExit" {
                        return Ran::Exit;
                    }
                    eprint!("{}", self.style.red(&e.traceback));
                    let _ = std::io::stderr().flush();
                }
                if let Some(v) = &r.value {
                    println!("{}", self.style.bold(&escape_text(v)));
                }
            }
            Err(e) => {
                if !out_ends_line {
                    println!();
                }
                eprintln!("{}", self.style.red(&format!("forkbox: {}", escape(&e.to_string()))));
                if matches!(e.code(), "timeout" | "interrupted" | "guest_crashed" | "guest_exited" | "guest_killed") {
                    if let Ok(s) = self.api.block_on(client.get_session(&id)) {
                        let at = s.checkpoint.map_or("its start".to_string(), |n| format!("checkpoint {n}"));
                        eprintln!("{}", self.style.red(&format!("forkbox: the session is back at {at}")));
                    }
                }
            }
        }
        Ran::Continue
    }

    /// A meta command; false to leave.
    fn meta(&mut self, line: &str) -> Result<bool> {
        let mut words = line.split_whitespace();
        let cmd = words.next().unwrap_or("");
        let arg = words.next();
        let number = |what: &str| -> Option<i64> {
            match arg.map(str::parse::<i64>) {
                Some(Ok(n)) => Some(n),
                Some(Err(_)) => {
                    eprintln!("{}", self.style.red(&format!("{what}: the checkpoint must be a number")));
                    None
                }
                None => None,
            }
        };
        let client = &self.api.client;
        let fail = |e: ClientError| eprintln!("{}", self.style.red(&format!("forkbox: {}", escape(&e.to_string()))));
        match cmd {
            ":quit" | ":q" | ":exit" => return Ok(false),
            ":help" | ":h" | ":?" => println!("{HELP}"),
            ":session" => match self.api.block_on(client.get_session(&self.session)) {
                Ok(s) => {
                    let tags: Vec<String> =
                        s.tags.iter().map(|(k, v)| format!("{}={}", escape(k), escape(v))).collect();
                    let at = match (&s.checkpoint, &s.forked_from) {
                        (Some(n), _) => n.to_string(),
                        (None, Some(f)) => format!("- (forked from {} at checkpoint {})", f.session, f.checkpoint),
                        (None, None) => "-".into(),
                    };
                    println!(
                        "session {}  checkpoint {}  tags [{}]  memory {} MiB  timeout {} s  on {}",
                        s.id,
                        at,
                        tags.join(","),
                        s.limits.memory_mb,
                        s.limits.timeout_seconds,
                        self.api.target
                    );
                }
                Err(e) => fail(e),
            },
            ":checkpoints" | ":log" | ":tree" => match self.api.block_on(client.tree(&self.session)) {
                Ok(t) if t.nodes.is_empty() => println!("no checkpoints yet"),
                Ok(t) => print!("{}", crate::tree::draw(&t)),
                Err(e) => fail(e),
            },
            ":revert" => match number(":revert") {
                None if arg.is_none() => {
                    eprintln!("{}", self.style.red(":revert N: which checkpoint? (see :checkpoints)"))
                }
                None => {}
                Some(n) => match self.api.block_on(client.revert(&self.session, n)) {
                    Ok(_) => println!("session {} is at checkpoint {n}", self.session),
                    Err(e) => fail(e),
                },
            },
            ":fork" => {
                let n = number(":fork");
                if arg.is_some() && n.is_none() {
                    return Ok(true);
                }
                match self.api.block_on(client.fork(&self.session, n)) {
                    Ok(s) => {
                        let from = s
                            .forked_from
                            .as_ref()
                            .map_or(String::new(), |f| format!(" at checkpoint {}", f.checkpoint));
                        println!("forked {}{from} into session {}; now in {}", self.session, s.id, s.id);
                        self.session = s.id;
                    }
                    Err(e) => fail(e),
                }
            }
            other => eprintln!("{}", self.style.red(&format!("unknown command {} (:help lists them)", escape(other)))),
        }
        Ok(true)
    }
}
