//! Threads, futexes, timers and signals in the guest: real Python programs
//! (thread pools, queues, timers, the GIL shared by a CPU-bound and a
//! sleeping thread, alarms, self-sent signals), deadlock and timeout
//! reporting, and threads carried by checkpoints, resumes and forks.
//!
//! These tests need /dev/kvm and the default image (built on first use, cached
//! under `$FORKBOX_HOME` or `forkbox_image::default_home()`). Without KVM they
//! FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::time::{Duration, Instant};

use forkbox_engine::{EngineError, Sandbox};
use forkbox_testkit::guest::{fork, fork_with, json, limits, ok, value};
use forkbox_testkit::shared;

// ---------------------------------------------------------------------------
// Threads and futexes
// ---------------------------------------------------------------------------

#[test]
fn thread_ids_start_join_and_exit() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import threading, os, json
ids = []
def work():
    ids.append((threading.get_native_id(), os.getpid()))
ts = [threading.Thread(target=work) for _ in range(5)]
for t in ts: t.start()
for t in ts: t.join()
json.dumps({"ids": ids, "main": threading.get_native_id(), "pid": os.getpid(),
            "alive": [t.is_alive() for t in ts], "active": threading.active_count()})
"#,
    );
    let ids = v["ids"].as_array().unwrap();
    assert_eq!(ids.len(), 5);
    let tids: std::collections::BTreeSet<u64> = ids.iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(tids.len(), 5, "distinct thread ids: {v}");
    assert!(!tids.contains(&v["main"].as_u64().unwrap()), "threads are not the main thread: {v}");
    assert!(ids.iter().all(|p| p[1] == v["pid"]), "one process: {v}");
    assert_eq!(v["main"], v["pid"], "the main thread's id is the pid");
    assert!(v["alive"].as_array().unwrap().iter().all(|a| a == false));
    assert_eq!(v["active"], 1, "joined threads are gone: {v}");
}

#[test]
fn thread_pool_maps_100_tasks() {
    let mut sb = fork();
    let v = value(
        &mut sb,
        r#"
from concurrent.futures import ThreadPoolExecutor
import threading, time
def f(x):
    return x * x
with ThreadPoolExecutor(8) as ex:
    out = list(ex.map(f, range(100)))
# Tasks that wait overlap: 16 sleeps of 50 ms on 8 workers take ~0.1 s, not 0.8 s.
seen = set()
def nap(x):
    seen.add(threading.get_ident())
    time.sleep(0.05)
    return x
t0 = time.monotonic()
with ThreadPoolExecutor(8) as ex:
    naps = list(ex.map(nap, range(16)))
took = time.monotonic() - t0
# The pool starts a worker per submit while none is idle: up to 8 (fewer if
# one finished a nap before the last submit, as under host load).
(sum(out), out[:5], naps == list(range(16)), 1 < len(seen) <= 8, took < 0.5)
"#,
    );
    assert_eq!(v, "(328350, [0, 1, 4, 9, 16], True, True, True)");
}

#[test]
fn producer_consumer_with_a_queue() {
    let mut sb = fork();
    let v = value(
        &mut sb,
        r#"
import queue, threading
q = queue.Queue(maxsize=4)
got = []
def consumer():
    while True:
        item = q.get()
        if item is None:
            return
        got.append(item)
def producer(base):
    for i in range(50):
        q.put(base + i)
cs = [threading.Thread(target=consumer) for _ in range(2)]
ps = [threading.Thread(target=producer, args=(k * 1000,)) for k in range(3)]
for t in cs + ps: t.start()
for t in ps: t.join()
for _ in cs: q.put(None)
for t in cs: t.join()
(len(got), sorted(got) == sorted(k * 1000 + i for k in range(3) for i in range(50)))
"#,
    );
    assert_eq!(v, "(150, True)");
}

#[test]
fn timer_and_event_wait_with_timeout() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import threading, time, json
ev = threading.Event()
t0 = time.monotonic()
timed_out = ev.wait(0.2)
waited = time.monotonic() - t0
fired = threading.Event()
t0 = time.monotonic()
threading.Timer(0.3, fired.set).start()
set_ok = fired.wait(10)
fired_after = time.monotonic() - t0
json.dumps({"timed_out": timed_out, "waited": waited, "set": set_ok, "fired_after": fired_after})
"#,
    );
    assert_eq!(v["timed_out"], false);
    let waited = v["waited"].as_f64().unwrap();
    assert!((0.19..2.0).contains(&waited), "Event.wait(0.2) took {waited}");
    assert_eq!(v["set"], true);
    let fired = v["fired_after"].as_f64().unwrap();
    assert!((0.29..3.0).contains(&fired), "Timer(0.3) fired after {fired}");
}

#[test]
fn a_cpu_bound_thread_and_a_sleeping_thread_share_the_gil() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import threading, time, sys, json
sys.setswitchinterval(0.005)
stop = False
spins = 0
def spin():
    global spins
    while not stop:
        spins += 1
ticks = []
def sleeper():
    for _ in range(10):
        time.sleep(0.02)
        ticks.append(time.monotonic())
a = threading.Thread(target=spin); b = threading.Thread(target=sleeper)
t0 = time.monotonic()
a.start(); b.start()
b.join()
elapsed = time.monotonic() - t0
main_progress = 0
t1 = time.monotonic()
while time.monotonic() - t1 < 0.1:
    main_progress += 1
stop = True
a.join()
json.dumps({"spins": spins, "ticks": len(ticks), "elapsed": elapsed, "main": main_progress})
"#,
    );
    assert_eq!(v["ticks"], 10, "{v}");
    assert!(v["spins"].as_u64().unwrap() > 1000, "the CPU-bound thread ran: {v}");
    assert!(v["main"].as_u64().unwrap() > 100, "the main thread ran beside it: {v}");
    // 10 sleeps of 20 ms; a starved sleeper would take far longer.
    let e = v["elapsed"].as_f64().unwrap();
    assert!(e < 2.0, "the sleeper was starved: 10 x 20 ms sleeps took {e} s");
}

#[test]
fn a_lock_handed_between_threads_and_a_condition() {
    let mut sb = fork();
    let v = value(
        &mut sb,
        r#"
import threading
lock = threading.Lock()
cond = threading.Condition()
n = 0
ready = []
def add():
    global n
    for _ in range(2000):
        with lock:
            n += 1
    with cond:
        ready.append(1)
        cond.notify_all()
ts = [threading.Thread(target=add) for _ in range(4)]
for t in ts: t.start()
with cond:
    cond.wait_for(lambda: len(ready) == 4, timeout=20)
for t in ts: t.join()
(n, len(ready))
"#,
    );
    assert_eq!(v, "(8000, 4)");
}

#[test]
fn a_deadlock_is_reported_cleanly() {
    let mut sb = fork();
    let t0 = Instant::now();
    let r = sb.exec("import threading\nl = threading.Lock()\nl.acquire()\nt = threading.Thread(target=l.acquire)\nt.start()\nt.join()");
    match r {
        Err(EngineError::Deadlock(why)) => assert!(why.contains("futex"), "{why}"),
        other => panic!("expected a deadlock error, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "reported at once, not at the timeout");
    assert_eq!(EngineError::Deadlock(String::new()).code(), "deadlock");
    // A single thread waiting forever too.
    let mut sb = fork();
    match sb.exec("import threading\nthreading.Event().wait()") {
        Err(EngineError::Deadlock(_)) => {}
        other => panic!("expected a deadlock error, got {other:?}"),
    }
}

#[test]
fn a_timeout_stops_a_guest_with_a_spinning_thread() {
    let mut sb = fork_with(limits(2));
    let t0 = Instant::now();
    let r = sb.exec("import threading\ndef spin():\n    while True: pass\nthreading.Thread(target=spin).start()\nimport time\ntime.sleep(100)");
    match r {
        Err(EngineError::Timeout(_)) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    let e = t0.elapsed();
    assert!(e < Duration::from_secs(6), "stopped at the deadline, took {e:?}");
}

#[test]
fn keyboard_interrupt_reaches_the_main_thread_joining_a_worker() {
    let mut sb = fork();
    let intr = forkbox_engine::Interrupter::new();
    let i2 = intr.clone();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        i2.interrupt()
    });
    let code = "import threading, time\nstop = threading.Event()\nt = threading.Thread(target=stop.wait, args=(60,))\nt.start()\ntry:\n    t.join()\nexcept KeyboardInterrupt:\n    stop.set(); t.join(); caught = 'main'\ncaught";
    let r = sb
        .exec_with(code, forkbox_engine::ExecOptions { interrupt: Some(intr), ..Default::default() })
        .unwrap_or_else(|e| panic!("exec: {e}"));
    assert!(h.join().unwrap(), "the interrupt found the exec running");
    assert_eq!(r.value.as_deref(), Some("'main'"), "{r:?}");
    // (CPython 3.11 marks a thread whose join was interrupted as stopped while
    // it still runs: it ends once it gets the CPU, in this next exec.)
    assert_eq!(value(&mut sb, "time.sleep(0.2)\nthreading.active_count()"), "1");
}

// ---------------------------------------------------------------------------
// Timers and signals
// ---------------------------------------------------------------------------

#[test]
fn alarm_interrupts_sleep_and_reports_what_is_left() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import signal, time, json
class Alarm(Exception): pass
def on_alarm(s, f): raise Alarm()
signal.signal(signal.SIGALRM, on_alarm)
first = signal.alarm(5)
left = signal.alarm(1)
t0 = time.monotonic()
try:
    time.sleep(10)
    how = "slept"
except Alarm:
    how = "alarm"
took = time.monotonic() - t0
json.dumps({"first": first, "left": left, "how": how, "took": took, "after": signal.alarm(0)})
"#,
    );
    assert_eq!(v["first"], 0);
    assert_eq!(v["left"], 5, "alarm() returns the previous alarm's seconds: {v}");
    assert_eq!(v["how"], "alarm");
    let took = v["took"].as_f64().unwrap();
    assert!((0.9..3.0).contains(&took), "alarm(1) fired after {took}");
    assert_eq!(v["after"], 0);
}

#[test]
fn a_blocking_pipe_write_waits_for_every_byte_and_a_signal_ends_it_with_the_count() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, signal, threading, json
# A reader thread drains the pipe: a write 16 times its room returns once all is in.
r, w = os.pipe()
size = 16 * 65536
got = []
def drain():
    n = 0
    while n < size:
        n += len(os.read(r, 65536))
    got.append(n)
t = threading.Thread(target=drain)
t.start()
whole = os.write(w, b"x" * size)
t.join()
# Nobody reads: what fits goes in, then SIGALRM ends the wait with that count
# (not EINTR) and its handler runs.
class Alarm(Exception): pass
def on_alarm(s, f): raise Alarm()
signal.signal(signal.SIGALRM, on_alarm)
signal.alarm(1)
try:
    os.write(w, b"y" * size)
    how = "returned"
except Alarm:
    how = "alarm"
signal.alarm(0)
room = 0
os.set_blocking(r, False)
try:
    while True:
        room += len(os.read(r, 65536))
except BlockingIOError:
    pass
json.dumps({"whole": whole, "got": got, "how": how, "room": room})
"#,
    );
    assert_eq!(v["whole"], 16 * 65536, "{v}");
    assert_eq!(v["got"][0], 16 * 65536, "{v}");
    assert_eq!(v["how"], "alarm", "the handler ran when the signal ended the write: {v}");
    assert_eq!(v["room"], 65536, "the interrupted write put in what fitted, once: {v}");
}

#[test]
fn setitimer_and_posix_timers_deliver_signals() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import signal, time, json, threading
hits = []
signal.signal(signal.SIGALRM, lambda s, f: hits.append(s))
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
t0 = time.monotonic()
while len(hits) < 3 and time.monotonic() - t0 < 5:
    time.sleep(0.01)
cur = signal.getitimer(signal.ITIMER_REAL)
signal.setitimer(signal.ITIMER_REAL, 0)
n = len(hits)
time.sleep(0.2)
after = len(hits)
# Waiting for a blocked signal: sigtimedwait takes it from the timer.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
os_ = __import__("os")
os_.kill(os_.getpid(), signal.SIGUSR1)
info = signal.sigtimedwait({signal.SIGUSR1}, 1)
none = signal.sigtimedwait({signal.SIGUSR1}, 0.05)
json.dumps({"n": n, "after": after, "interval": cur[1], "info": info.si_signo, "code": info.si_code, "none": none is None})
"#,
    );
    assert!(v["n"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["n"], v["after"], "disarmed: {v}");
    assert!((v["interval"].as_f64().unwrap() - 0.05).abs() < 0.001, "{v}");
    assert_eq!(v["info"], 10);
    assert_eq!(v["code"], 0, "SI_USER");
    assert_eq!(v["none"], true);
}

#[test]
fn cpu_time_itimers_fire_while_computing_and_not_while_sleeping() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import signal, time, json
hits = {"vt": 0, "prof": 0}
signal.signal(signal.SIGVTALRM, lambda s, f: hits.__setitem__("vt", hits["vt"] + 1))
signal.signal(signal.SIGPROF, lambda s, f: hits.__setitem__("prof", hits["prof"] + 1))
# Sleeping uses no CPU time: neither fires.
signal.setitimer(signal.ITIMER_VIRTUAL, 0.05)
time.sleep(0.3)
slept = dict(hits)
left = signal.getitimer(signal.ITIMER_VIRTUAL)[0]
# Computing does: both fire, the periodic one again and again.
signal.setitimer(signal.ITIMER_PROF, 0.02, 0.02)
t0 = time.monotonic()
while (hits["vt"] < 1 or hits["prof"] < 3) and time.monotonic() - t0 < 10:
    pow(12345, 6789, 10000019)
signal.setitimer(signal.ITIMER_PROF, 0)
json.dumps({"slept": slept, "left": left, "hits": hits, "after": signal.getitimer(signal.ITIMER_PROF)})
"#,
    );
    assert_eq!(v["slept"], serde_json::json!({"vt": 0, "prof": 0}), "{v}");
    assert!(v["left"].as_f64().unwrap() > 0.04, "a sleep used CPU time: {v}");
    assert_eq!(v["hits"]["vt"], 1, "{v}");
    assert!(v["hits"]["prof"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["after"], serde_json::json!([0.0, 0.0]), "{v}");
}

#[test]
fn signals_sent_to_itself_run_python_handlers() {
    let mut sb = fork();
    let v = json(
        &mut sb,
        r#"
import os, signal, threading, json
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(("usr1", threading.current_thread() is threading.main_thread())))
os.kill(os.getpid(), signal.SIGUSR1)
signal.raise_signal(signal.SIGUSR1)
try:
    signal.raise_signal(signal.SIGINT)
    kb = False
except KeyboardInterrupt:
    kb = True
# From another thread: the handler still runs in the main thread.
t = threading.Thread(target=lambda: os.kill(os.getpid(), signal.SIGUSR1))
t.start(); t.join()
signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
import time
time.sleep(0.01)
json.dumps({"got": got, "kb": kb})
"#,
    );
    assert_eq!(v["kb"], true, "{v}");
    let got = v["got"].as_array().unwrap();
    assert_eq!(got.len(), 4, "{v}");
    assert!(got.iter().all(|g| g[1] == true), "{v}");
}

#[test]
fn a_self_sent_fatal_signal_ends_the_guest() {
    let mut sb = fork();
    match sb.exec("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)") {
        Err(EngineError::GuestSignaled(15)) => {}
        other => panic!("expected death by SIGTERM, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// Threads across execs, checkpoints, resumes and forks
// ---------------------------------------------------------------------------

const COUNTER: &str = r#"
import threading, time
count = 0
running = True
def counter():
    global count
    while running:
        count += 1
        time.sleep(0.01)
bg = threading.Thread(target=counter, daemon=True)
bg.start()
time.sleep(0.2)
count > 0
"#;

/// Run for a while and return the background count.
#[track_caller]
fn count_after(sb: &mut Sandbox, secs: f64) -> u64 {
    value(sb, &format!("time.sleep({secs})\ncount")).parse().unwrap()
}

#[test]
fn a_background_thread_is_paused_between_execs_and_runs_during_them() {
    let mut sb = fork();
    assert_eq!(value(&mut sb, COUNTER), "True");
    let a: u64 = value(&mut sb, "count").parse().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let b: u64 = value(&mut sb, "count").parse().unwrap();
    assert!(b <= a + 2, "paused between execs: {a} then {b}");
    let c = count_after(&mut sb, 0.3);
    assert!(c >= b + 5, "it runs during an exec: {b} then {c}");
    assert_eq!(value(&mut sb, "bg.is_alive()"), "True");
}

#[test]
fn a_background_thread_survives_checkpoint_resume_and_fork() {
    let s = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut sb = s.template.fork_tracked(&s.engine, limits(60)).unwrap_or_else(|e| panic!("fork_tracked: {e}"));
    assert_eq!(value(&mut sb, COUNTER), "True");
    let before = count_after(&mut sb, 0.1);
    let layer = dir.path().join("layer");
    let state = dir.path().join("state");
    s.template
        .checkpoint(&s.engine, &mut sb, &layer, &state, |_| Ok::<(), forkbox_engine::EngineError>(()))
        .unwrap_or_else(|e| panic!("checkpoint: {e}"));
    // Evicted: the sandbox goes away; resumed from disk twice (the session and a fork).
    drop(sb);
    let layers = vec![forkbox_snapshot::layer::Layer::read(&layer).unwrap_or_else(|e| panic!("layer: {e}"))];
    let mut a =
        s.template.resume(&s.engine, &layers, &state, limits(60), false).unwrap_or_else(|e| panic!("resume: {e}"));
    let mut b = s.template.resume(&s.engine, &layers, &state, limits(60), true).unwrap_or_else(|e| panic!("fork: {e}"));
    let a0: u64 = value(&mut a, "count").parse().unwrap();
    let b0: u64 = value(&mut b, "count").parse().unwrap();
    assert!(a0 >= before && b0 >= before, "the count came back: {before} -> {a0}, {b0}");
    ok(&mut a, "count += 100000");
    let a1 = count_after(&mut a, 0.3);
    let b1 = count_after(&mut b, 0.3);
    assert!(a1 >= a0 + 100_005, "the resumed session's thread keeps counting: {a0} -> {a1}");
    assert!(b1 >= b0 + 5 && b1 < 100_000, "the fork's thread counts on its own: {b0} -> {b1}");
    assert_eq!(value(&mut a, "bg.is_alive(), threading.active_count()"), "(True, 2)");
    assert_eq!(value(&mut b, "running = False\nbg.join(5)\nbg.is_alive()"), "False");
    assert_eq!(value(&mut a, "bg.is_alive()"), "True");
}
