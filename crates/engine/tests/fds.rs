//! End-to-end tests of the fd objects the VMM owns (pipes, AF_UNIX sockets,
//! eventfd, epoll, timerfd), blocking through `Effect::Block`, asyncio (also
//! top-level `await` in execs), /proc and /dev, and fixes of descriptor corner cases
//! (utime, mkfifo, /dev/tty, chown, openpty, sendfile ...): real Python
//! programs in KVM guests.
//!
//! These tests need /dev/kvm and the default image (built on first use under
//! `$FORKBOX_HOME`). Without KVM they FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use forkbox_engine::{Engine, EngineError, Limits, Sandbox};
use forkbox_testkit::guest::{ok, run, value};

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let image = forkbox_testkit::image_path();
        Engine::open(&image).unwrap_or_else(|e| panic!("Engine::open({}): {e}", image.display()))
    })
}

fn boot_with(limits: Limits) -> Sandbox {
    engine().boot(limits).unwrap_or_else(|e| panic!("boot failed: {e}"))
}

fn boot() -> Sandbox {
    boot_with(Limits::default())
}

// ---------------------------------------------------------------------------
// asyncio
// ---------------------------------------------------------------------------

#[test]
fn asyncio_run_with_gather_wait_for_and_sleep() {
    let mut sb = boot();
    let code = r#"
import asyncio, time
async def work(i, d):
    await asyncio.sleep(d)
    return i * i
async def slow():
    await asyncio.sleep(5)
    return 'never'
async def main():
    t0 = time.monotonic()
    squares = await asyncio.gather(*(work(i, 0.05) for i in range(10)))
    gathered = time.monotonic() - t0
    try:
        await asyncio.wait_for(slow(), timeout=0.1)
        timed_out = False
    except asyncio.TimeoutError:
        timed_out = True
    q = asyncio.Queue()
    async def producer():
        for i in range(5):
            await q.put(i)
            await asyncio.sleep(0)
        await q.put(None)
    async def consumer():
        got = []
        while (x := await q.get()) is not None:
            got.append(x)
        return got
    _, got = await asyncio.gather(producer(), consumer())
    return squares, timed_out, got, round(gathered, 1), time.monotonic() - t0
squares, timed_out, got, gathered, total = asyncio.run(main())
(squares, timed_out, got, gathered <= 0.5, 0.14 <= total < 2.0)
"#;
    assert_eq!(value(&mut sb, code), "([0, 1, 4, 9, 16, 25, 36, 49, 64, 81], True, [0, 1, 2, 3, 4], True, True)");
    // Again in the same sandbox (a fresh loop, the old one's fds closed).
    assert_eq!(value(&mut sb, "import asyncio\nasyncio.run(asyncio.sleep(0, result='again'))"), "'again'");
    let r = ok(&mut sb, "import os\nlen(os.listdir('/proc/self/fd'))");
    let fds: usize = r.value.unwrap().parse().unwrap();
    assert!(fds <= 6, "asyncio.run leaked fds: {fds} open");
}

#[test]
fn top_level_await_across_execs() {
    let mut sb = boot();
    // No asyncio import on the plain path.
    assert_eq!(value(&mut sb, "import sys\n'asyncio' in sys.modules"), "False");
    ok(&mut sb, "import asyncio\nresults = []\nasync def tick(n):\n    for i in range(n):\n        results.append(i)\n        await asyncio.sleep(0.01)\n    return n");
    assert_eq!(value(&mut sb, "await tick(3)"), "3");
    // A task started in one exec runs on in the next one that awaits.
    ok(&mut sb, "bg = asyncio.ensure_future(tick(4))\nx = await asyncio.sleep(0, result=5)");
    assert_eq!(value(&mut sb, "x"), "5");
    assert_eq!(value(&mut sb, "await bg"), "4");
    assert_eq!(value(&mut sb, "results"), "[0, 1, 2, 0, 1, 2, 3]");
    // async for / async with at top level, and a trailing awaited expression.
    let code =
        "class Ctx:\n    async def __aenter__(self): return 'in'\n    async def __aexit__(self, *a): return False\n\
                async def agen():\n    for i in range(3):\n        yield i\n\
                async with Ctx() as c:\n    got = [i async for i in agen()]\n(await asyncio.sleep(0, result=c), got)";
    assert_eq!(value(&mut sb, code), "('in', [0, 1, 2])");
    // Exceptions and timeouts surface as normal Python errors.
    let r = run(&mut sb, "await asyncio.wait_for(asyncio.sleep(10), 0.05)");
    assert_eq!(r.error.map(|e| e.kind), Some("TimeoutError".into()));
    let r = run(&mut sb, "await undefined_name");
    assert_eq!(r.error.map(|e| e.kind), Some("NameError".into()));
    // A real syntax error is still reported as one.
    let r = run(&mut sb, "await (");
    assert_eq!(r.error.map(|e| e.kind), Some("SyntaxError".into()));
    // asyncio.run still works between awaiting execs.
    assert_eq!(value(&mut sb, "asyncio.run(asyncio.sleep(0, result=1))"), "1");
    assert_eq!(value(&mut sb, "await asyncio.sleep(0, result=2)"), "2");
}

#[test]
fn selectors_over_a_socketpair() {
    let mut sb = boot();
    let code = r#"
import selectors, socket
a, b = socket.socketpair()
a.setblocking(False); b.setblocking(False)
sel = selectors.DefaultSelector()
sel.register(b, selectors.EVENT_READ, 'b')
first = sel.select(timeout=0)
a.send(b'ping')
ready = [(k.data, ev) for k, ev in sel.select(timeout=1)]
msg = b.recv(100)
try:
    b.recv(100)
    again = None
except BlockingIOError:
    again = 'EAGAIN'
sel.modify(b, selectors.EVENT_WRITE, 'bw')
writable = [k.data for k, ev in sel.select(timeout=1)]
a.close()
sel.modify(b, selectors.EVENT_READ, 'b')
eof_ready = [k.data for k, ev in sel.select(timeout=1)]
(type(sel).__name__, first, ready, msg, again, writable, eof_ready, b.recv(10))
"#;
    assert_eq!(value(&mut sb, code), "('EpollSelector', [], [('b', 1)], b'ping', 'EAGAIN', ['bw'], ['b'], b'')");
    // select.select and poll over the same kinds of fds.
    let code = r#"
import select, socket, os
a, b = socket.socketpair()
r, w = os.pipe()
os.write(w, b'x')
rl, wl, _ = select.select([a, r], [b, w], [], 1)
p = select.poll(); p.register(r, select.POLLIN); p.register(a, select.POLLIN)
(sorted(x if isinstance(x, int) else 'a' for x in rl) == [r], len(wl), p.poll(0))
"#;
    let v = value(&mut sb, code);
    assert!(v.starts_with("(True, 2, [("), "{v}");
}

#[test]
fn one_megabyte_pipe_round_trip_in_one_thread() {
    let mut sb = boot();
    let code = r#"
import os, hashlib
data = os.urandom(1 << 20)
r, w = os.pipe()
os.set_blocking(r, False); os.set_blocking(w, False)
first = os.write(w, data[:100000])
try:
    os.write(w, b'x'); full = 0
except BlockingIOError:
    full = 1
sent = first; got = []
while sent < len(data) or sum(map(len, got)) < len(data):
    if sent < len(data):
        try:
            sent += os.write(w, data[sent:sent + 100000])
        except BlockingIOError:
            full += 1
    try:
        got.append(os.read(r, 70000))
    except BlockingIOError:
        pass
os.close(w)
tail = os.read(r, 10)
import fcntl, termios, array
(hashlib.sha256(b''.join(got)).digest() == hashlib.sha256(data).digest(), first, full >= 1, tail, os.get_blocking(r))
"#;
    assert_eq!(value(&mut sb, code), "(True, 65536, True, b'', False)");
    // Capacity 64 KiB, FIONREAD, EPIPE with SIGPIPE ignored (CPython's default).
    let code = r#"
import os, fcntl, termios, array, errno
r, w = os.pipe2(os.O_NONBLOCK)
n = 0
try:
    while True:
        n += os.write(w, b'z' * 4096)
except BlockingIOError:
    pass
buf = array.array('i', [0])
fcntl.ioctl(r, termios.FIONREAD, buf)
os.close(r)
try:
    os.write(w, b'x'); e = None
except BrokenPipeError as ex:
    e = ex.errno
(n, buf[0], e == errno.EPIPE, fcntl.fcntl(w, fcntl.F_GETPIPE_SZ))
"#;
    assert_eq!(value(&mut sb, code), "(65536, 65536, True, 65536)");
}

#[test]
fn sigpipe_default_action_kills_the_guest() {
    let mut sb = boot();
    let code = "import os, signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\nr, w = os.pipe()\nos.close(r)\nos.write(w, b'x')";
    match sb.exec(code) {
        Err(EngineError::GuestSignaled(13)) => {}
        other => panic!("expected the guest killed by SIGPIPE, got {other:?}"),
    }
}

#[test]
fn blocking_read_with_no_writer_possible_is_a_deadlock_error() {
    let mut sb = boot_with(Limits { timeout: Duration::from_secs(20), ..Limits::default() });
    let t0 = Instant::now();
    match sb.exec("import os\nr, w = os.pipe()\nos.read(r, 1)") {
        Err(e @ EngineError::Deadlock(_)) => assert_eq!(e.code(), "deadlock"),
        other => panic!("expected a deadlock error, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "the deadlock was detected at once, not at the timeout");
    // A blocking wait with a timeout is no deadlock: it times out like Linux.
    let mut sb = boot();
    let code = "import os, select, time\nr, w = os.pipe()\nt = time.monotonic()\n(select.select([r], [], [], 0.2), round(time.monotonic() - t, 1))";
    assert_eq!(value(&mut sb, code), "(([], [], []), 0.2)");
    // An exec deadline ends a wait with no end.
    let mut sb = boot_with(Limits { timeout: Duration::from_secs(1), ..Limits::default() });
    match sb.exec("import select, os\nr, w = os.pipe()\nselect.select([r], [], [])") {
        Err(EngineError::Deadlock(_)) => {}
        other => panic!("expected a deadlock error for select with no timeout, got {other:?}"),
    }
}

#[test]
fn epoll_on_eventfd_and_timerfd() {
    let mut sb = boot();
    let code = r#"
import os, select, time, struct
efd = os.eventfd(0, os.EFD_NONBLOCK)
ep = select.epoll()
ep.register(efd, select.EPOLLIN)
before = ep.poll(0)
os.eventfd_write(efd, 3); os.eventfd_write(efd, 4)
after = ep.poll(1)
val = os.eventfd_read(efd)
try:
    os.eventfd_read(efd); again = None
except BlockingIOError:
    again = 'EAGAIN'
sem = os.eventfd(2, os.EFD_SEMAPHORE)
sems = (os.eventfd_read(sem), os.eventfd_read(sem))
(before, after == [(efd, select.EPOLLIN)], val, again, sems)
"#;
    assert_eq!(value(&mut sb, code), "([], True, 7, 'EAGAIN', (1, 1))");
    // timerfd through ctypes (Python 3.11 has no os.timerfd_*): epoll wakes when it fires.
    let code = r#"
import ctypes, os, select, struct, time
libc = ctypes.CDLL(None, use_errno=True)
CLOCK_MONOTONIC = 1
tfd = libc.timerfd_create(CLOCK_MONOTONIC, 0)
class ts(ctypes.Structure): _fields_ = [('s', ctypes.c_long), ('ns', ctypes.c_long)]
class its(ctypes.Structure): _fields_ = [('interval', ts), ('value', ts)]
spec = its(ts(0, 50_000_000), ts(0, 150_000_000))
assert libc.timerfd_settime(tfd, 0, ctypes.byref(spec), None) == 0
cur = its(); libc.timerfd_gettime(tfd, ctypes.byref(cur))
ep = select.epoll(); ep.register(tfd, select.EPOLLIN)
t0 = time.monotonic()
ev = ep.poll(2)
waited = time.monotonic() - t0
time.sleep(0.12)
n = struct.unpack('Q', os.read(tfd, 8))[0]
(ev == [(tfd, select.EPOLLIN)], 0.1 < waited < 1.0, n >= 3, 0 < cur.value.ns <= 150_000_000, cur.interval.ns)
"#;
    assert_eq!(value(&mut sb, code), "(True, True, True, True, 50000000)");
}

#[test]
fn af_unix_bind_connect_accept_inside_the_sandbox() {
    let mut sb = boot();
    let code = r#"
import socket, os, stat
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind('/tmp/app.sock')
srv.listen()
mode = stat.S_ISSOCK(os.stat('/tmp/app.sock').st_mode)
cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
cli.connect('/tmp/app.sock')
conn, addr = srv.accept()
cli.sendall(b'hello over a path')
got = conn.recv(100)
conn.sendall(b'reply')
back = cli.recv(100)
names = (srv.getsockname(), cli.getpeername(), addr)
try:
    srv2 = socket.socket(socket.AF_UNIX); srv2.bind('/tmp/app.sock'); inuse = None
except OSError as e:
    inuse = e.errno
# Abstract names and datagrams.
a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); a.bind('\0fb-abstract')
b = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); b.bind('\0fb-other')
b.sendto(b'dgram-1', '\0fb-abstract'); b.sendto(b'dgram-22', '\0fb-abstract')
d1 = a.recvfrom(100); d2 = a.recv(3)
try:
    socket.socket(socket.AF_UNIX).connect('/tmp/nothing-here'); refused = None
except FileNotFoundError:
    refused = 'ENOENT'
cli.close()
eof = conn.recv(10)
(mode, got, back, names, inuse == 98, d1, d2, refused, eof)
"#;
    assert_eq!(
        value(&mut sb, code),
        "(True, b'hello over a path', b'reply', ('/tmp/app.sock', '/tmp/app.sock', ''), True, \
         (b'dgram-1', b'\\x00fb-other'), b'dgr', 'ENOENT', b'')"
    );
    // Host sockets stay out of reach: with no network (Limits::default) an AF_INET
    // socket opens but connects nowhere, and a path name is only ever a file of the overlay.
    let code = "import socket\ns = socket.socket(socket.AF_INET)\ns.settimeout(2)\ntry:\n    s.connect(('127.0.0.1', 22))\n    r = 'connected'\nexcept OSError as e:\n    r = e.errno\nr";
    assert_eq!(value(&mut sb, code), "111", "ECONNREFUSED");
    let code = "import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('/run/docker.sock')\nexcept OSError as e:\n    r = type(e).__name__\nr";
    assert_eq!(value(&mut sb, code), "'FileNotFoundError'");
}

// ---------------------------------------------------------------------------
// /proc and /dev
// ---------------------------------------------------------------------------

#[test]
fn proc_and_dev_are_generated_from_the_sandbox() {
    let limits = Limits { memory_bytes: 1 << 30, ..Limits::default() };
    let mut sb = boot_with(limits);
    let code = r#"
import os, re
status = open('/proc/self/status').read()
meminfo = open('/proc/meminfo').read()
cpuinfo = open('/proc/cpuinfo').read()
memtotal = int(re.search(r'MemTotal:\s+(\d+) kB', meminfo).group(1))
ncpu = cpuinfo.count('processor\t:')
stat = open('/proc/self/stat').read().split()
cmd = open('/proc/self/cmdline', 'rb').read().split(b'\0')
env = open('/proc/self/environ', 'rb').read()
limits = open('/proc/self/limits').read()
maps = open('/proc/self/maps').read()
fds = sorted(int(x) for x in os.listdir('/proc/self/fd'))
r, w = os.pipe()
pipe_link = os.readlink('/proc/self/fd/%d' % r)
(
    re.search(r'Pid:\s+(\d+)', status).group(1) == str(os.getpid()),
    'Threads:\t1' in status,
    memtotal == 1 << 20,
    ncpu, os.cpu_count(), len(os.sched_getaffinity(0)),
    stat[0] == str(os.getpid()), stat[1],
    cmd[0], b'HOME=/root' in env,
    'Max open files            1024' in limits,
    '[stack]' in maps and '[heap]' in maps,
    fds[:4], pipe_link.startswith('pipe:['),
    os.readlink('/proc/self/exe'), os.readlink('/proc/self/cwd') == os.getcwd(),
    len(open('/proc/uptime').read().split()), open('/proc/loadavg').read().split()[3],
    open('/proc/stat').read().startswith('cpu '),
)
"#;
    assert_eq!(
        value(&mut sb, code),
        "(True, True, True, 1, 1, 1, True, '(python3)', b'/usr/bin/python3', True, True, True, [0, 1, 2, 3], True, \
         '/usr/bin/python3', True, 2, '1/1', True)"
    );
    let code = r#"
import os, errno
out = {}
with open('/dev/null', 'rb') as f: out['null'] = f.read()
with open('/dev/zero', 'rb') as f: out['zero'] = f.read(4)
with open('/dev/urandom', 'rb') as f: out['urandom'] = len(set(f.read(64))) > 8
with open('/dev/random', 'rb') as f: out['random'] = len(f.read(16))
try:
    open('/dev/full', 'wb', buffering=0).write(b'x'); out['full'] = 'wrote'
except OSError as e:
    out['full'] = errno.errorcode[e.errno]
try:
    open('/dev/tty', 'rb'); out['tty'] = 'opened'
except OSError as e:
    out['tty'] = errno.errorcode[e.errno]
open('/dev/shm/seg', 'wb').write(b'shared')
out['shm'] = (open('/dev/shm/seg', 'rb').read(), oct(os.stat('/dev/shm').st_mode & 0o7777))
out
"#;
    assert_eq!(
        value(&mut sb, code),
        "{'null': b'', 'zero': b'\\x00\\x00\\x00\\x00', 'urandom': True, 'random': 16, 'full': 'ENOSPC', \
         'tty': 'ENXIO', 'shm': (b'shared', '0o1777')}"
    );
}

// ---------------------------------------------------------------------------
// Descriptor corner cases
// ---------------------------------------------------------------------------

#[test]
fn item_8_file_system_fixes() {
    let mut sb = boot();
    // os.utime keeps atime and mtime apart.
    let code = "import os\nopen('/tmp/t', 'w').close()\nos.utime('/tmp/t', (1000000000, 2000000000))\n\
                st = os.stat('/tmp/t')\nos.utime('/tmp/t', ns=(5, 7_000_000_123))\nst2 = os.stat('/tmp/t')\n\
                (st.st_atime, st.st_mtime, st2.st_atime_ns, st2.st_mtime_ns)";
    assert_eq!(value(&mut sb, code), "(1000000000.0, 2000000000.0, 5, 7000000123)");
    // mkfifo / mknod: a pipe in the overlay.
    let code = r#"
import os, stat
os.mkfifo('/tmp/fifo')
os.mknod('/tmp/fifo2', 0o600 | stat.S_IFIFO)
is_fifo = stat.S_ISFIFO(os.stat('/tmp/fifo').st_mode), stat.S_ISFIFO(os.stat('/tmp/fifo2').st_mode)
r = os.open('/tmp/fifo', os.O_RDONLY | os.O_NONBLOCK)
w = os.open('/tmp/fifo', os.O_WRONLY)
os.write(w, b'through the fifo')
got = os.read(r, 100)
os.close(w)
eof = os.read(r, 100)
try:
    os.open('/tmp/fifo2', os.O_WRONLY | os.O_NONBLOCK); nx = None
except OSError as e:
    nx = e.errno
try:
    os.mknod('/tmp/dev', 0o600 | stat.S_IFCHR, os.makedev(1, 3)); dev = None
except PermissionError:
    dev = 'EPERM'
(is_fifo, got, eof, nx, dev)
"#;
    assert_eq!(value(&mut sb, code), "((True, True), b'through the fifo', b'', 6, 'EPERM')");
    // /dev/tty without a controlling terminal: ENXIO, never a seekable file. chown: only root exists.
    let code = r#"
import os, errno
try:
    os.open('/dev/tty', os.O_RDWR); tty = None
except OSError as e:
    tty = errno.errorcode[e.errno]
open('/tmp/own', 'w').close()
os.chown('/tmp/own', 0, 0); os.chown('/tmp/own', -1, -1)
try:
    os.chown('/tmp/own', 1000, 1000); other = None
except OSError as e:
    other = errno.errorcode[e.errno]
st = os.stat('/tmp/own')
m, s = os.openpty()
pty = (os.isatty(s), os.ttyname(s).startswith('/dev/pts/'))
(tty, other, st.st_uid, st.st_gid, pty)
"#;
    // As root, chown to any ids is allowed and recorded (as on Linux). No
    // controlling terminal, so /dev/tty is ENXIO; os.openpty gives a terminal.
    assert_eq!(value(&mut sb, code), "('ENXIO', None, 1000, 1000, (True, True))");
    // sendfile, copy_file_range, close_range, memfd_create, sigpending, getpriority.
    let code = r#"
import os, shutil, signal
data = os.urandom(300000)
open('/tmp/src', 'wb').write(data)
shutil.copyfile('/tmp/src', '/tmp/dst')
same = open('/tmp/dst', 'rb').read() == data
fi = os.open('/tmp/src', os.O_RDONLY); fo = os.open('/tmp/cfr', os.O_WRONLY | os.O_CREAT)
n = os.copy_file_range(fi, fo, 1000, 10)
os.close(fo)
cfr = open('/tmp/cfr', 'rb').read() == data[10:1010]
r, w = os.pipe()
sent = os.sendfile(w, fi, 0, 100)
piped = os.read(r, 200) == data[:100]
extra = [os.dup(0) for _ in range(3)]
os.closerange(extra[0], extra[-1] + 1)  # close_range(2) in CPython 3.11
closed = all(not os.path.exists('/proc/self/fd/%d' % fd) for fd in extra)
m = os.memfd_create('buf')
os.write(m, b'in memory'); os.lseek(m, 0, 0)
mem = os.read(m, 100)
(same, n, cfr, sent, piped, closed, mem, signal.sigpending(), os.getpriority(os.PRIO_PROCESS, 0))
"#;
    assert_eq!(value(&mut sb, code), "(True, 1000, True, 100, True, True, b'in memory', set(), 0)");
}
