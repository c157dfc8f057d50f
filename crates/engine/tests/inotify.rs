//! The guest's inotify, end to end: real Python programs in KVM guests
//! watching directories through ctypes (CPython has no inotify module), read
//! with `os.read`, waited for with `select`, blocking reads woken by another
//! thread and by another process, the queue's overflow, and an instance in a
//! sandbox made from a snapshot (no watches any more, new ones work).
//!
//! These tests need /dev/kvm and the default image (built on first use under
//! `$FORKBOX_HOME`). Without KVM they FAIL: they are never skipped.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use forkbox_engine::{EngineError, Limits, Sandbox};
use forkbox_testkit::guest::{ok, value};

fn boot() -> Sandbox {
    forkbox_testkit::guest::fork()
}

/// ctypes bindings and an event decoder, as a watcher written in Python has them.
const PRELUDE: &str = r#"
import ctypes, os, select, struct, threading, time, subprocess, fcntl, termios, errno
libc = ctypes.CDLL(None, use_errno=True)
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_ISDIR, IN_ONLYDIR, IN_MASK_ADD, IN_ALL_EVENTS = 0x40000000, 0x01000000, 0x20000000, 0xfff
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
NAMES = {IN_MODIFY: 'modify', IN_ATTRIB: 'attrib', IN_MOVED_FROM: 'moved_from', IN_MOVED_TO: 'moved_to',
         IN_CREATE: 'create', IN_DELETE: 'delete', IN_DELETE_SELF: 'delete_self', IN_MOVE_SELF: 'move_self',
         IN_Q_OVERFLOW: 'overflow', IN_IGNORED: 'ignored', IN_CLOSE_WRITE: 'close_write', 0x10: 'close_nowrite'}
def add_watch(fd, path, mask):
    wd = libc.inotify_add_watch(fd, path.encode(), mask)
    if wd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return wd
def decode(buf):
    out, i = [], 0
    while i < len(buf):
        wd, mask, cookie, n = struct.unpack_from('iIII', buf, i)
        name = buf[i + 16:i + 16 + n].rstrip(b'\0').decode()
        kind = NAMES.get(mask & ~IN_ISDIR, hex(mask))
        out.append((wd, kind + ('/dir' if mask & IN_ISDIR else ''), cookie, name))
        i += 16 + n
    return out
"#;

#[test]
fn a_watched_directory_reports_what_python_does_in_it() {
    let mut sb = boot();
    let code = format!(
        r#"{PRELUDE}
os.makedirs('/tmp/w', exist_ok=True)
fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
wd = add_watch(fd, '/tmp/w', IN_ALL_EVENTS)
same = add_watch(fd, '/tmp/w/.', IN_CREATE | IN_MASK_ADD)
try:
    os.read(fd, 4096); empty = None
except BlockingIOError:
    empty = 'EAGAIN'
with open('/tmp/w/a.txt', 'w') as f:
    f.write('hello')
    f.flush()
os.chmod('/tmp/w/a.txt', 0o600)
os.rename('/tmp/w/a.txt', '/tmp/w/b.txt')
os.mkdir('/tmp/w/sub')
os.remove('/tmp/w/b.txt')
os.rmdir('/tmp/w/sub')
ep = select.epoll()
ep.register(fd, select.EPOLLIN)
ready = select.select([fd], [], [], 0)[0] == [fd] and ep.poll(0) == [(fd, select.EPOLLIN)]
n = fcntl.ioctl(fd, termios.FIONREAD, struct.pack('i', 0))
pending = struct.unpack('i', n)[0]
try:
    os.read(fd, 20); small = None
except OSError as e:
    small = errno.errorcode[e.errno]
events = decode(os.read(fd, 65536))
cookies = {{c for (_, k, c, _) in events if k.startswith('moved')}}
events = [(w, k, name) for (w, k, c, name) in events]
(wd, same, empty, ready, pending, small, len(cookies) == 1 and 0 not in cookies, events)
"#
    );
    assert_eq!(
        value(&mut sb, &code),
        "(1, 1, 'EAGAIN', True, 288, 'EINVAL', True, [(1, 'create', 'a.txt'), (1, 'modify', 'a.txt'), \
         (1, 'close_write', 'a.txt'), (1, 'attrib', 'a.txt'), (1, 'moved_from', 'a.txt'), (1, 'moved_to', 'b.txt'), (1, 'create/dir', 'sub'), \
         (1, 'delete', 'b.txt'), (1, 'delete/dir', 'sub')])"
    );
    // rm_watch: IN_IGNORED; the descriptor is then unknown (EINVAL), as is a bad one.
    let code = r#"
r1 = libc.inotify_rm_watch(fd, wd)
r2 = libc.inotify_rm_watch(fd, wd); e2 = ctypes.get_errno()
(r1, r2, errno.errorcode[e2], decode(os.read(fd, 4096)))
"#;
    assert_eq!(value(&mut sb, code), "(0, -1, 'EINVAL', [(1, 'ignored', 0, '')])");
    // A file watched through a symlink, written by a descriptor opened before the watch.
    let code = r#"
log = open('/tmp/app.log', 'a')
os.symlink('/tmp/app.log', '/tmp/current.log')
fd2 = libc.inotify_init()
try:
    add_watch(fd2, '/tmp/current.log', IN_MODIFY | IN_ONLYDIR); onlydir = None
except OSError as e:
    onlydir = errno.errorcode[e.errno]
w2 = add_watch(fd2, '/tmp/current.log', IN_MODIFY | IN_DELETE_SELF)
for i in range(100):
    log.write(f'line {i}\n'); log.flush()
os.remove('/tmp/app.log')
log.close()
(onlydir, decode(os.read(fd2, 4096)))
"#;
    assert_eq!(
        value(&mut sb, code),
        "('ENOTDIR', [(1, 'modify', 0, ''), (1, 'delete_self', 0, ''), (1, 'ignored', 0, '')])"
    );
}

/// A blocking read and a `select` wait until an event arrives: from another
/// thread of the process, then from another process (a shell the guest runs).
#[test]
fn blocked_readers_wake_when_an_event_arrives() {
    let mut sb = boot();
    let code = format!(
        r#"{PRELUDE}
os.makedirs('/tmp/in', exist_ok=True)
fd = libc.inotify_init()
add_watch(fd, '/tmp/in', IN_CREATE)
def later():
    time.sleep(0.2)
    open('/tmp/in/from-thread', 'w').close()
t = threading.Thread(target=later); t.start()
t0 = time.monotonic()
got = decode(os.read(fd, 4096))
waited = time.monotonic() - t0
t.join()
p = subprocess.Popen(['sh', '-c', 'sleep 0.2; : > /tmp/in/from-shell'])
t0 = time.monotonic()
r, _, _ = select.select([fd], [], [], 10)
waited2 = time.monotonic() - t0
got2 = decode(os.read(fd, 4096))
p.wait()
(got, 0.15 < waited < 5, r == [fd], 0.15 < waited2 < 5, got2)
"#
    );
    assert_eq!(
        value(&mut sb, &code),
        "([(1, 'create', 0, 'from-thread')], True, True, True, [(1, 'create', 0, 'from-shell')])"
    );
    // Alone, with nothing that could ever write: a deadlock, not a hang.
    let code = "os.read(libc.inotify_init(), 4096)";
    match sb.exec(code) {
        Err(EngineError::Deadlock(_)) => {}
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

/// A guest that changes files faster than it reads gets one IN_Q_OVERFLOW
/// and a bounded queue, and reads on afterwards.
#[test]
fn a_flood_overflows_the_queue_once() {
    let mut sb = boot();
    let code = format!(
        r#"{PRELUDE}
os.makedirs('/tmp/flood', exist_ok=True)
fd = libc.inotify_init1(IN_NONBLOCK)
add_watch(fd, '/tmp/flood', IN_CREATE | IN_DELETE | IN_MODIFY)
for i in range(12000):
    open('/tmp/flood/f', 'w').close()
    os.remove('/tmp/flood/f')
with open('/tmp/flood/big', 'w') as f:
    for i in range(2000):
        f.write('x'); f.flush()
n = struct.unpack('i', fcntl.ioctl(fd, termios.FIONREAD, struct.pack('i', 0)))[0]
events = []
while True:
    try:
        events += decode(os.read(fd, 65536))
    except BlockingIOError:
        break
kinds = [k for (_, k, _, _) in events]
open('/tmp/flood/after', 'w').close()
after = decode(os.read(fd, 4096))
(n <= 256 * 1024 + 16, kinds.count('overflow'), kinds[-1], len(events) < 16384, after)
"#
    );
    assert_eq!(value(&mut sb, &code), "(True, 1, 'overflow', True, [(1, 'create', 0, 'after')])");
}

/// A sandbox made from a snapshot has the instance but not its watches: a
/// read finds nothing, and a watch added again works.
#[test]
fn a_snapshot_keeps_the_instance_not_its_watches() {
    let mut sb = boot();
    ok(
        &mut sb,
        &format!(
            r#"{PRELUDE}
os.makedirs('/tmp/snap', exist_ok=True)
fd = libc.inotify_init1(IN_NONBLOCK)
add_watch(fd, '/tmp/snap', IN_CREATE)
open('/tmp/snap/before', 'w').close()
"#
        ),
    );
    let dir = tempfile::tempdir().unwrap();
    let s = forkbox_testkit::shared();
    let t = s.template.snapshot_sandbox(&s.engine, &sb, &dir.path().join("t"), "inotify", "").unwrap();
    let mut fork = t.fork(&s.engine, Limits::default()).unwrap();
    let code = r#"
open('/tmp/snap/in-fork', 'w').close()
try:
    os.read(fd, 4096); lost = None
except BlockingIOError:
    lost = 'EAGAIN'
wd = add_watch(fd, '/tmp/snap', IN_DELETE)
os.remove('/tmp/snap/in-fork')
(lost, wd, decode(os.read(fd, 4096)))
"#;
    assert_eq!(value(&mut fork, code), "('EAGAIN', 1, [(1, 'delete', 0, 'in-fork')])");
    // The source kept its watch and its queued event.
    assert_eq!(value(&mut sb, "decode(os.read(fd, 4096))"), "[(1, 'create', 0, 'before')]");
}
