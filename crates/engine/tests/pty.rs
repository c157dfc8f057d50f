//! Pseudo-terminals in the guest: os.openpty, pty.fork with a child on the
//! slave, the line discipline seen through real processes (echo, ONLCR,
//! ^C to the foreground group, raw mode), a shell on a pty, and a pty with
//! unread data carried through a checkpoint and a fork.
//!
//! These tests need /dev/kvm and the default image (built on first use).
//! Without KVM they FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use forkbox_engine::EngineError;
use forkbox_testkit::guest::{fork, json, limits, ok, value};

fn shared() -> &'static forkbox_testkit::Shared {
    forkbox_testkit::shared()
}

#[test]
fn openpty_gives_a_terminal_pair_with_termios_and_window_size() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, json, tty, termios, fcntl, struct
m, s = os.openpty()
res = {"isatty": [os.isatty(m), os.isatty(s)], "ttyname": os.ttyname(s)}
attrs = termios.tcgetattr(s)
res["icanon"] = bool(attrs[3] & termios.ICANON)
fcntl.ioctl(m, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
res["size"] = tuple(os.get_terminal_size(s))
os.write(m, b"hello\r")
res["line"] = os.read(s, 100).decode()
res["echo"] = os.read(m, 100).decode()
tty.setraw(s)
os.write(m, b"x\x03y")
res["raw"] = os.read(s, 100).decode()
os.write(s, b"a\nb")
res["out"] = os.read(m, 100).decode()
os.close(s)
try:
    os.read(m, 10)
    res["after"] = "data"
except OSError as e:
    res["after"] = e.errno
json.dumps(res)
"#,
    );
    assert_eq!(v["isatty"], serde_json::json!([true, true]), "{v}");
    assert_eq!(v["icanon"], true, "{v}");
    assert_eq!(v["ttyname"], "/dev/pts/0", "{v}");
    assert_eq!(v["size"], serde_json::json!([101, 33]), "{v}");
    // The JSON came through a str repr: its escapes are still escaped.
    assert_eq!(v["line"], r"hello\n", "{v}");
    assert_eq!(v["echo"], r"hello\r\n", "{v}");
    assert_eq!(v["raw"], r"x\u0003y", "raw mode passes ^C as data: {v}");
    assert_eq!(v["out"], r"a\nb", "raw mode: no \\r\\n: {v}");
    assert_eq!(v["after"], 5, "EIO once the slave closed: {v}");
}

#[test]
fn pty_fork_child_reads_a_line_and_ctrl_c_reaches_the_foreground_group() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, pty, json, signal, time
pid, m = pty.fork()
if pid == 0:
    try:
        os.setsid()
        sid_ok = False
    except OSError:
        sid_ok = True
    print("tty", os.isatty(0), os.isatty(1), sid_ok, os.getsid(0) == os.getpid(), flush=True)
    line = input()
    print("got", line.upper(), flush=True)
    signal.signal(signal.SIGINT, lambda *a: (print("interrupted", flush=True), os._exit(7)))
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
def read_until(word):
    out = b""
    while word not in out:
        out += os.read(m, 1000)
    return out.decode()
first = read_until(b"True\r\n")
os.write(m, b"shout\n")
second = read_until(b"ready")
os.write(m, b"\x03")
third = ""
while True:
    try:
        d = os.read(m, 1000)
    except OSError:
        break
    if not d:
        break
    third += d.decode()
_, st = os.waitpid(pid, 0)
json.dumps({"first": first, "second": second, "third": third, "code": os.waitstatus_to_exitcode(st)})
"#,
    );
    // The JSON came through a str repr: \r\n are still escaped in it.
    assert!(v["first"].as_str().unwrap().contains(r"tty True True True True\r\n"), "{v}");
    let second = v["second"].as_str().unwrap();
    assert!(second.contains(r"shout\r\n"), "the typed line is echoed: {v}");
    assert!(second.contains(r"got SHOUT\r\n"), "{v}");
    assert!(v["third"].as_str().unwrap().contains("interrupted"), "{v}");
    assert_eq!(v["code"], 7, "SIGINT from ^C: {v}");
}

#[test]
fn ctrl_c_typed_by_the_agent_ends_a_shells_foreground_job_not_the_exec() {
    let mut sb = fork();
    let v = value(
        &mut sb,
        r##"
import os, subprocess, fcntl, termios, struct, time
m, s = os.openpty()
p = subprocess.Popen(["bash", "-i"], stdin=s, stdout=s, stderr=s, start_new_session=True,
                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
os.close(s)
def until(word):
    out = b""
    while word not in out:
        out += os.read(m, 1000)
    return out
until(b"# ")
os.write(m, b"sleep 30\n")
until(b"sleep 30\r\n")
time.sleep(0.2)
fg = struct.unpack("i", fcntl.ioctl(m, termios.TIOCGPGRP, b"\0" * 4))[0]
os.write(m, b"\x03")
os.write(m, b"echo after-$((1+1)); exit 4\n")
until(b"after-2")
(fg != os.getpgid(p.pid), p.wait())
"##,
    );
    assert_eq!(v, "(True, 4)", "the shell's job had the terminal and ^C ended it alone");
}

#[test]
fn a_shell_on_a_pty_runs_what_is_typed() {
    let mut sb = fork();
    let v = value(
        &mut sb,
        r#"
import os, pty, subprocess, fcntl, termios
m, s = os.openpty()
p = subprocess.Popen(["sh"], stdin=s, stdout=s, stderr=s, start_new_session=True,
                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
os.close(s)
os.write(m, b"echo $((6*7)); exit 3\n")
out = b""
while True:
    try:
        d = os.read(m, 1000)
    except OSError:
        break
    if not d:
        break
    out += d
(b"42\r\n" in out, p.wait())
"#,
    );
    assert_eq!(v, "(True, 3)");
}

#[test]
fn a_pty_with_unread_data_survives_a_checkpoint_and_a_fork() {
    let s = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut sb = s.template.fork_tracked(&s.engine, limits(60)).unwrap_or_else(|e| panic!("fork_tracked: {e}"));
    ok(&mut sb, "import os, termios\nm, s = os.openpty()\nos.write(s, b'kept\\n')\nos.write(m, b'typed\\r')");
    let layer = dir.path().join("layer");
    let state = dir.path().join("state");
    s.template
        .checkpoint(&s.engine, &mut sb, &layer, &state, |_| Ok::<(), EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    drop(sb);
    let layers = vec![forkbox_snapshot::layer::Layer::read(&layer).unwrap_or_else(|e| panic!("layer: {e}"))];
    for fork in [false, true] {
        let mut b =
            s.template.resume(&s.engine, &layers, &state, limits(60), fork).unwrap_or_else(|e| panic!("resume: {e}"));
        assert_eq!(
            value(&mut b, "(os.read(m, 100), os.read(s, 100), os.isatty(s))"),
            "(b'kept\\r\\ntyped\\r\\n', b'typed\\n', True)"
        );
    }
}
