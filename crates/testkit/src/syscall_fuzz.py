import ctypes, random, os
libc = ctypes.CDLL(None, use_errno=True)
sc = libc.syscall
sc.restype = ctypes.c_long
sc.argtypes = [ctypes.c_long] * 7
R = random.Random(SEED)
BUF = 1 << 16
buf = ctypes.create_string_buffer(BUF)
ba = ctypes.addressof(buf)
code = ctypes.cast(libc.syscall, ctypes.c_void_p).value & ~0xfff
M64 = (1 << 64) - 1
PTRS = [0, 1, 8, 0xfff, 0x1000, 0x2000, 0x3000, 0x4000, 0x4010, 0x8000, 0x9000, 0xA000, 0x10_0000,
        0x10_7ff8, 0x1F_0000, 0x1F_1000, 0x1F_3ff0, 0x20_0000 - 8, 0xFEC0_0000, 0xFFFF_F000, 0xFFFF_FFF8,
        1 << 32, (1 << 32) - 1, (1 << 47) - 4096, (1 << 47) - 1, 1 << 47, 0x0000_8000_0000_0000,
        0xffff_8000_0000_0000, 0xffff_ffff_ff60_0000, M64, M64 - 4095, M64 - 7, code, code + 0x10,
        ba, ba + 8, ba + BUF - 1, ba + BUF - 8, ba + BUF - 16, ba + BUF, 0x7fff_0000_0000]
LENS = [0, 1, 2, 7, 8, 16, 64, 4096, 4097, BUF, BUF + 1, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
        1 << 32, (1 << 63) - 1, 1 << 63, M64, M64 - 4095, M64 - ba + 1, -1, -4096]
FDS = [-1, -2, -100, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 63, 64, 1023, 1024, 65535, (1 << 31) - 1,
       -(1 << 31), 1 << 32, M64]
PATHS = [b"/", b"/tmp/f", b"/tmp", b"/proc/self/mem", b"/proc/self/maps", b"/dev/kvm", b"/dev/null",
         b"../../../../../etc/passwd", b"/etc/passwd", b"", b"a" * 300, b"/" + b"x/" * 600, b"/tmp/../..",
         b"/proc/self/fd/3", b"/proc/1/root", b"/sys/kernel", b"\xff\xfe", b"/tmp/f/."]
QUIET = {62: 1, 200: 1, 234: 2, 129: 1, 297: 2, 424: 1}
SAFE_SIGS = [0, 17, 23, 28]
EXCLUDED = {60, 231}
# Calls that end a chunk at once (a deadlock, a crash): drawn again 9 times in 10.
TERMINAL = {15, 34, 130, 158, 61, 247, 128}
# Memory-map calls aim at a scratch mapping of their own or at wild addresses, never at the
# interpreter's heap (which they would only unmap or zero).
MMCALLS = {9, 10, 11, 12, 25, 26, 27, 28, 216, 329, 440, 462, 67}
scratch = sc(9, 0, 1 << 20, 3, 0x22, -1, 0, 0)
SCRATCH = [scratch, scratch + 4096, scratch + (1 << 20) - 4096, scratch + (1 << 20), scratch + 123]
WILD = [p for p in PTRS if not (ba <= p <= ba + BUF) and p not in (code, code + 0x10)]

def word():
    c = R.random()
    if c < 0.4: return R.choice(PTRS)
    if c < 0.7: return R.choice(LENS) & M64
    if c < 0.8: return R.choice(FDS) & M64
    return R.getrandbits(R.choice([8, 16, 32, 64]))

def fill():
    c = R.random()
    if c < 0.3:
        b = R.randbytes(R.choice([16, 256, 4096, BUF]))
    elif c < 0.6:
        b = b"".join(word().to_bytes(8, "little") for _ in range(R.choice([4, 32, 512])))
    elif c < 0.8:
        b = R.choice(PATHS) + b"\0"
    else:
        return
    o = R.randrange(0, BUF - len(b) + 1)
    ctypes.memmove(ba + o, b, len(b))

def arg():
    c = R.random()
    if c < 0.35: return R.choice(PTRS) if R.random() < 0.6 else ba + R.randrange(BUF)
    if c < 0.55: return R.choice(LENS)
    if c < 0.75: return R.choice(FDS)
    if c < 0.9: return R.getrandbits(R.choice([4, 16, 32, 64])) if R.random() < 0.7 else R.choice([0, -1, 1 << 31])
    return R.randrange(0, 16)

def signed(v):
    v &= M64
    return v - (1 << 64) if v >> 63 else v

def number():
    c = R.random()
    if c < 0.75: return R.choice(TABLE)
    if c < 0.9: return R.randrange(0, 1100)
    return R.choice([-1, -2, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 63, 0x4000_0000, 0x4000_0001, 0x4000_0200,
                     512, 547, 1023, 1024, M64, M64 - 1])

import signal
for _s in (signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGPIPE, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGHUP, signal.SIGTERM, signal.SIGIO, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT):
    signal.signal(_s, signal.SIG_IGN)
done = 0
for i in range(CALLS):
    nr = number()
    while nr in TERMINAL and R.random() < 0.9:
        nr = number()
    if nr in EXCLUDED:
        continue
    a = [arg() for _ in range(6)]
    if nr in MMCALLS:
        a[0] = R.choice(SCRATCH) if R.random() < 0.7 else R.choice(WILD)
        if nr == 9 and R.random() < 0.5:
            a[3] &= ~0x10  # not MAP_FIXED
    if nr in QUIET:
        a[QUIET[nr]] = R.choice(SAFE_SIGS)
    if R.random() < 0.3:
        fill()
    if VERBOSE:
        os.write(2, ("@call %d nr=%d args=%s\n" % (i, nr, [hex(x & M64) for x in a])).encode())
    try:
        sc(signed(nr), *[signed(x) for x in a])
    except Exception:
        pass
    done += 1
print("fuzz-done", done)
