//! A pseudo-terminal's state and its line discipline (Linux's N_TTY, the
//! common subset): what the master writes goes through input processing
//! (ICRNL, ISIG, ICANON line editing, ECHO) to the slave's read queue; what
//! the slave writes goes through output processing (OPOST/ONLCR) to the
//! master's read queue.
//!
//! The state is plain data kept in the master's fd object
//! (`objects::ObjKind::PtyMaster`), so it is cloned with a fork and saved in
//! a checkpoint like a pipe's buffer. Nothing here blocks: a full queue is
//! EAGAIN and the file layer (`file::pty`) turns it into a wait. Every queue
//! has a fixed capacity, so a guest that never reads only blocks its writer.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::errno::Errno;

/// Bytes queued towards the master (slave output and echoes) at most.
pub const OUTPUT_CAPACITY: usize = 64 << 10;
/// Bytes queued towards the slave (complete lines, or raw input) at most.
pub const INPUT_CAPACITY: usize = 64 << 10;
/// Longest line being edited in canonical mode (Linux's N_TTY_BUF_SIZE - 1):
/// further characters but the line's end are dropped, as there.
pub const MAX_CANON: usize = 4095;
/// Pseudo-terminals a sandbox may have open at once.
pub const MAX_PTYS: u32 = 256;

// termios flags (Linux x86-64 values).
pub const IGNCR: u32 = 0o200;
pub const ICRNL: u32 = 0o400;
pub const INLCR: u32 = 0o100;
pub const ISTRIP: u32 = 0o40;
pub const IXON: u32 = 0o2000;
pub const IUTF8: u32 = 0o40000;
pub const OPOST: u32 = 0o1;
pub const ONLCR: u32 = 0o4;
pub const OCRNL: u32 = 0o10;
pub const ISIG: u32 = 0o1;
pub const ICANON: u32 = 0o2;
pub const ECHO: u32 = 0o10;
pub const ECHOE: u32 = 0o20;
pub const ECHOK: u32 = 0o40;
pub const ECHONL: u32 = 0o100;
pub const NOFLSH: u32 = 0o200;
pub const ECHOCTL: u32 = 0o1000;
pub const ECHOKE: u32 = 0o4000;
pub const IEXTEN: u32 = 0o100000;

// c_cc indices.
pub const VINTR: usize = 0;
pub const VQUIT: usize = 1;
pub const VERASE: usize = 2;
pub const VKILL: usize = 3;
pub const VEOF: usize = 4;
pub const VTIME: usize = 5;
pub const VMIN: usize = 6;
pub const VSUSP: usize = 10;
pub const VEOL: usize = 11;
pub const VWERASE: usize = 14;
pub const VEOL2: usize = 16;
/// Control characters in the kernel's `struct termios`.
pub const NCCS: usize = 19;
/// Size of the kernel's `struct termios` (TCGETS) and `struct termios2` (TCGETS2).
pub const TERMIOS_SIZE: usize = 36;
pub const TERMIOS2_SIZE: usize = 44;

/// The kernel's `struct termios` (what TCGETS/TCSETS carry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Termios {
    pub iflag: u32,
    pub oflag: u32,
    pub cflag: u32,
    pub lflag: u32,
    pub line: u8,
    pub cc: [u8; NCCS],
}

impl Default for Termios {
    /// Linux's `tty_std_termios`: cooked mode with echo, 38400 baud, 8 bits.
    fn default() -> Termios {
        let mut cc = [0u8; NCCS];
        for (i, v) in [
            (VINTR, 3),
            (VQUIT, 0x1c),
            (VERASE, 0x7f),
            (VKILL, 0x15),
            (VEOF, 4),
            (VMIN, 1),
            (8, 0x11),
            (9, 0x13),
            (VSUSP, 0x1a),
            (12, 0x12),
            (13, 0x0f),
            (VWERASE, 0x17),
            (15, 0x16),
        ] {
            cc[i] = v;
        }
        Termios {
            iflag: ICRNL | IXON | IUTF8,
            oflag: OPOST | ONLCR,
            cflag: 0o17 | 0o60 | 0o200 | 0o2000, // B38400 | CS8 | CREAD | HUPCL
            lflag: ISIG | ICANON | ECHO | ECHOE | ECHOK | ECHOCTL | ECHOKE | IEXTEN,
            line: 0,
            cc,
        }
    }
}

impl Termios {
    /// The kernel layout (36 bytes; `termios2` adds the two speeds).
    pub fn to_bytes(&self, termios2: bool) -> Vec<u8> {
        let mut b = Vec::with_capacity(TERMIOS2_SIZE);
        for v in [self.iflag, self.oflag, self.cflag, self.lflag] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(self.line);
        b.extend_from_slice(&self.cc);
        if termios2 {
            let speed = 38400u32.to_le_bytes();
            b.extend_from_slice(&speed);
            b.extend_from_slice(&speed);
        }
        b
    }

    /// From the kernel layout (at least `TERMIOS_SIZE` bytes; speeds ignored).
    pub fn from_bytes(b: &[u8]) -> Result<Termios, Errno> {
        let word = |i: usize| -> Result<u32, Errno> {
            let s = b.get(i * 4..i * 4 + 4).ok_or(Errno::EFAULT)?;
            Ok(u32::from_le_bytes(s.try_into().map_err(|_| Errno::EFAULT)?))
        };
        let cc: [u8; NCCS] = b.get(17..17 + NCCS).ok_or(Errno::EFAULT)?.try_into().map_err(|_| Errno::EFAULT)?;
        Ok(Termios { iflag: word(0)?, oflag: word(1)?, cflag: word(2)?, lflag: word(3)?, line: b[16], cc })
    }

    fn canonical(&self) -> bool {
        self.lflag & ICANON != 0
    }

    /// Is `c` the (enabled: not `_POSIX_VDISABLE`) control character at `i`?
    fn is(&self, i: usize, c: u8) -> bool {
        self.cc[i] != 0 && self.cc[i] == c
    }
}

/// Window size (TIOCGWINSZ/TIOCSWINSZ): rows, columns, pixel width, pixel height.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WinSize {
    pub rows: u16,
    pub cols: u16,
    pub xpixel: u16,
    pub ypixel: u16,
}

impl WinSize {
    pub fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        for (i, v) in [self.rows, self.cols, self.xpixel, self.ypixel].into_iter().enumerate() {
            b[i * 2..i * 2 + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<WinSize, Errno> {
        let h = |i: usize| -> Result<u16, Errno> {
            let s = b.get(i * 2..i * 2 + 2).ok_or(Errno::EFAULT)?;
            Ok(u16::from_le_bytes([s[0], s[1]]))
        };
        Ok(WinSize { rows: h(0)?, cols: h(1)?, xpixel: h(2)?, ypixel: h(3)? })
    }
}

/// One pseudo-terminal: the master's object holds it (the slave's object
/// only names the master).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pty {
    /// N of /dev/pts/N.
    pub index: u32,
    /// TIOCSPTLCK: the slave cannot be opened while locked (a new pty is).
    pub locked: bool,
    pub termios: Termios,
    pub winsize: WinSize,
    /// The slave's object while some description has it open.
    pub slave: Option<u64>,
    /// The slave was opened and every description of it closed since: a
    /// master read with nothing queued is EIO, as Linux (until it is reopened).
    pub slave_closed: bool,
    /// The session this is the controlling terminal of, and its foreground
    /// process group.
    pub session: Option<u32>,
    pub pgrp: Option<u32>,
    /// Towards the slave: complete lines (canonical mode; an empty one is an
    /// end of file) or runs of raw input.
    pub input: VecDeque<Vec<u8>>,
    /// Bytes in `input`.
    pub input_len: usize,
    /// The line being edited (canonical mode).
    pub line: Vec<u8>,
    /// Towards the master: slave output and echoes.
    pub output: VecDeque<u8>,
    /// The background job (leader pid) whose stdout this terminal's output
    /// goes to instead of the master (a command the API started on a pty):
    /// host-side, never in a state file (jobs are not).
    #[serde(skip)]
    pub job: Option<u32>,
}

/// A signal input processing raised for the foreground process group.
pub type TtySignal = i32;

impl Pty {
    pub fn new(index: u32) -> Pty {
        Pty {
            index,
            locked: true,
            termios: Termios::default(),
            winsize: WinSize::default(),
            slave: None,
            slave_closed: false,
            session: None,
            pgrp: None,
            input: VecDeque::new(),
            input_len: 0,
            line: Vec::new(),
            output: VecDeque::new(),
            job: None,
        }
    }

    /// Room for input before a master write waits.
    fn input_room(&self) -> usize {
        INPUT_CAPACITY.saturating_sub(self.input_len.saturating_add(self.line.len()))
    }

    /// Output processing of one byte into the master's queue (if it fits:
    /// echoes that do not are dropped, as Linux drops them).
    fn put_output(&mut self, c: u8) -> bool {
        let t = &self.termios;
        let post = t.oflag & OPOST != 0;
        let bytes: &[u8] = match c {
            b'\n' if post && t.oflag & ONLCR != 0 => b"\r\n",
            b'\r' if post && t.oflag & OCRNL != 0 => b"\n",
            _ => std::slice::from_ref(&c),
        };
        if OUTPUT_CAPACITY - self.output.len().min(OUTPUT_CAPACITY) < bytes.len() {
            return false;
        }
        self.output.extend(bytes);
        true
    }

    fn echo(&mut self, c: u8) {
        let t = &self.termios;
        if t.lflag & ECHO == 0 {
            if c == b'\n' && t.lflag & ECHONL != 0 {
                self.put_output(c);
            }
            return;
        }
        // Control characters as ^X (ECHOCTL), but tab and newline as themselves.
        if t.lflag & ECHOCTL != 0 && (c < 0x20 || c == 0x7f) && c != b'\t' && c != b'\n' {
            self.put_output(b'^');
            self.put_output(c ^ 0x40);
        } else {
            self.put_output(c);
        }
    }

    /// Visually erase `n` characters of the line being edited.
    fn echo_erase(&mut self, n: usize) {
        if self.termios.lflag & ECHO == 0 {
            return;
        }
        for _ in 0..n {
            for b in *b"\x08 \x08" {
                self.put_output(b);
            }
        }
    }

    fn push_input(&mut self, chunk: Vec<u8>) {
        self.input_len = self.input_len.saturating_add(chunk.len());
        self.input.push_back(chunk);
    }

    fn flush_input(&mut self) {
        self.input.clear();
        self.input_len = 0;
        self.line.clear();
    }

    /// A master write: input processing of as much of `data` as fits.
    /// Returns the bytes taken (EAGAIN if none fit) and the signals to send
    /// to the foreground process group.
    pub fn master_write(&mut self, data: &[u8]) -> Result<(usize, Vec<TtySignal>), Errno> {
        let mut sigs = Vec::new();
        if data.is_empty() {
            return Ok((0, sigs));
        }
        let mut raw_run = Vec::new();
        let mut taken = 0;
        for &byte in data {
            if self.input_room() <= raw_run.len() {
                break;
            }
            taken += 1;
            let t = self.termios;
            let mut c = byte;
            if t.iflag & ISTRIP != 0 {
                c &= 0x7f;
            }
            if c == b'\r' {
                if t.iflag & IGNCR != 0 {
                    continue;
                }
                if t.iflag & ICRNL != 0 {
                    c = b'\n';
                }
            } else if c == b'\n' && t.iflag & INLCR != 0 {
                c = b'\r';
            }
            if t.lflag & ISIG != 0 {
                let sig = if t.is(VINTR, c) {
                    Some(libc::SIGINT)
                } else if t.is(VQUIT, c) {
                    Some(libc::SIGQUIT)
                } else if t.is(VSUSP, c) {
                    Some(libc::SIGTSTP)
                } else {
                    None
                };
                if let Some(sig) = sig {
                    if t.lflag & NOFLSH == 0 {
                        raw_run.clear();
                        self.flush_input();
                    }
                    self.echo(c);
                    sigs.push(sig);
                    continue;
                }
            }
            if !t.canonical() {
                raw_run.push(c);
                self.echo(c);
                continue;
            }
            if t.is(VERASE, c) || (t.lflag & IEXTEN != 0 && t.is(VWERASE, c)) {
                let keep = if t.is(VERASE, c) {
                    // A whole UTF-8 character goes (its continuation bytes first).
                    let mut n = self.line.len();
                    while n > 0 {
                        n -= 1;
                        if t.iflag & IUTF8 == 0 || self.line[n] & 0xc0 != 0x80 {
                            break;
                        }
                    }
                    n
                } else {
                    let trimmed = self.line.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
                    self.line[..trimmed].iter().rposition(|b| b.is_ascii_whitespace()).map_or(0, |i| i + 1)
                };
                let gone = self.line.len() - keep;
                let chars = self.line[keep..].iter().filter(|b| t.iflag & IUTF8 == 0 || *b & 0xc0 != 0x80).count();
                self.line.truncate(keep);
                if gone > 0 && t.lflag & ECHOE != 0 {
                    self.echo_erase(chars);
                }
                continue;
            }
            if t.is(VKILL, c) {
                let chars = self.line.iter().filter(|b| t.iflag & IUTF8 == 0 || *b & 0xc0 != 0x80).count();
                self.line.clear();
                if t.lflag & ECHOKE != 0 {
                    self.echo_erase(chars);
                } else if t.lflag & ECHOK != 0 {
                    self.echo(c);
                    self.put_output(b'\n');
                }
                continue;
            }
            if t.is(VEOF, c) {
                let line = std::mem::take(&mut self.line);
                self.push_input(line);
                continue;
            }
            let ends = c == b'\n' || t.is(VEOL, c) || t.is(VEOL2, c);
            if ends {
                self.echo(c);
                let mut line = std::mem::take(&mut self.line);
                line.push(c);
                self.push_input(line);
            } else if self.line.len() < MAX_CANON {
                self.echo(c);
                self.line.push(c);
            }
        }
        if !raw_run.is_empty() {
            self.push_input(raw_run);
        }
        if taken == 0 {
            return Err(Errno::EAGAIN);
        }
        Ok((taken, sigs))
    }

    /// Would a slave read return now (data, or an end of file)?
    pub fn slave_readable(&self) -> bool {
        if self.termios.canonical() {
            return !self.input.is_empty();
        }
        self.input_len > 0 || self.termios.cc[VMIN] == 0
    }

    /// A slave read of at most `len` bytes: one line at most in canonical
    /// mode (an empty result is an end of file); EAGAIN if it would wait.
    pub fn slave_read(&mut self, len: usize) -> Result<Vec<u8>, Errno> {
        if len == 0 {
            return Ok(Vec::new());
        }
        if self.termios.canonical() {
            let Some(front) = self.input.front_mut() else { return Err(Errno::EAGAIN) };
            if front.is_empty() {
                self.input.pop_front();
                return Ok(Vec::new());
            }
            let n = len.min(front.len());
            let out: Vec<u8> = front.drain(..n).collect();
            if front.is_empty() {
                self.input.pop_front();
            }
            self.input_len -= n;
            return Ok(out);
        }
        if self.input_len == 0 {
            // VMIN 0 (and VTIME, not modelled as a timer): return at once.
            return if self.termios.cc[VMIN] == 0 { Ok(Vec::new()) } else { Err(Errno::EAGAIN) };
        }
        let mut out = Vec::with_capacity(len.min(self.input_len));
        while out.len() < len {
            let Some(front) = self.input.front_mut() else { break };
            let n = (len - out.len()).min(front.len());
            out.extend(front.drain(..n));
            if front.is_empty() {
                self.input.pop_front();
            }
        }
        self.input_len -= out.len();
        Ok(out)
    }

    /// A slave write: output processing of as much of `data` as fits (EAGAIN if nothing does).
    pub fn slave_write(&mut self, data: &[u8]) -> Result<usize, Errno> {
        let mut n = 0;
        for &c in data {
            if !self.put_output(c) {
                break;
            }
            n += 1;
        }
        if n == 0 && !data.is_empty() {
            return Err(Errno::EAGAIN);
        }
        Ok(n)
    }

    /// A master read of at most `len` bytes: EAGAIN with nothing queued, EIO
    /// once the slave was closed (Linux's answer, which pty readers expect).
    pub fn master_read(&mut self, len: usize) -> Result<Vec<u8>, Errno> {
        if self.output.is_empty() {
            if self.slave_closed {
                return Err(Errno::EIO);
            }
            return if len == 0 { Ok(Vec::new()) } else { Err(Errno::EAGAIN) };
        }
        let n = len.min(self.output.len());
        Ok(self.output.drain(..n).collect())
    }

    pub fn master_writable(&self) -> bool {
        self.input_room() > 0
    }

    pub fn slave_writable(&self) -> bool {
        self.output.len() + 2 <= OUTPUT_CAPACITY
    }

    /// TCSETS*: a switch out of canonical mode hands the line being edited
    /// to the reader; TCSETSF flushes pending input first.
    pub fn set_termios(&mut self, t: Termios, flush: bool) {
        if flush {
            self.flush_input();
        }
        let was_canon = self.termios.canonical();
        self.termios = t;
        if was_canon && !t.canonical() && !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.push_input(line);
        }
    }

    /// Bytes a slave read could return (FIONREAD on the slave).
    pub fn slave_pending(&self) -> usize {
        if self.termios.canonical() {
            self.input.front().map_or(0, Vec::len)
        } else {
            self.input_len
        }
    }

    /// Consistency of a pty read from a state file.
    pub fn valid(&self) -> bool {
        self.output.len() <= OUTPUT_CAPACITY
            && self.line.len() <= MAX_CANON
            && self.input_len <= INPUT_CAPACITY
            && self.input.iter().map(Vec::len).sum::<usize>() == self.input_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pty() -> Pty {
        Pty::new(0)
    }

    #[test]
    fn cooked_line_with_echo_and_onlcr() {
        let mut p = pty();
        assert_eq!(p.slave_read(10), Err(Errno::EAGAIN));
        let (n, sigs) = p.master_write(b"ab\x7fc\r").unwrap();
        assert_eq!((n, sigs), (5, vec![]));
        // Echo: a, b, erase, c, then \r became \n and echoes as \r\n.
        assert_eq!(p.master_read(100).unwrap(), b"ab\x08 \x08c\r\n");
        assert_eq!(p.slave_read(100).unwrap(), b"ac\n");
        assert_eq!(p.slave_read(100), Err(Errno::EAGAIN));
        assert_eq!(p.slave_write(b"hi\nthere").unwrap(), 8);
        assert_eq!(p.master_read(100).unwrap(), b"hi\r\nthere");
    }

    #[test]
    fn a_read_gets_one_line_and_eof_is_an_empty_read() {
        let mut p = pty();
        p.master_write(b"one\ntwo\n\x04").unwrap();
        assert_eq!(p.slave_read(100).unwrap(), b"one\n");
        assert_eq!(p.slave_read(2).unwrap(), b"tw");
        assert_eq!(p.slave_read(100).unwrap(), b"o\n");
        assert_eq!(p.slave_read(100).unwrap(), b"", "^D on an empty line");
        assert_eq!(p.slave_read(100), Err(Errno::EAGAIN));
        // ^D after text ends the line without a newline.
        p.master_write(b"abc\x04").unwrap();
        assert_eq!(p.slave_read(100).unwrap(), b"abc");
    }

    #[test]
    fn kill_and_word_erase() {
        let mut p = pty();
        p.master_write(b"hello world\x17there\x15again\n").unwrap();
        assert_eq!(p.slave_read(100).unwrap(), b"again\n");
        p.master_write(b"hello world\x17there\n").unwrap();
        assert_eq!(p.slave_read(100).unwrap(), b"hello there\n");
    }

    #[test]
    fn signals_flush_and_echo() {
        let mut p = pty();
        let (_, sigs) = p.master_write(b"partial\x03").unwrap();
        assert_eq!(sigs, vec![libc::SIGINT]);
        assert!(p.line.is_empty(), "^C flushes the line");
        assert!(p.master_read(100).unwrap().ends_with(b"^C"));
        let (_, sigs) = p.master_write(b"\x1c\x1a").unwrap();
        assert_eq!(sigs, vec![libc::SIGQUIT, libc::SIGTSTP]);
        // Without ISIG they are data.
        let mut t = p.termios;
        t.lflag &= !ISIG;
        p.set_termios(t, false);
        let (_, sigs) = p.master_write(b"\x03\n").unwrap();
        assert!(sigs.is_empty());
        assert_eq!(p.slave_read(100).unwrap(), b"\x03\n");
    }

    #[test]
    fn raw_mode_passes_bytes_without_echo() {
        let mut p = pty();
        let mut t = p.termios;
        t.lflag &= !(ICANON | ECHO | ISIG);
        t.iflag &= !ICRNL;
        t.oflag &= !OPOST;
        p.set_termios(t, false);
        p.master_write(b"a\rb\x03").unwrap();
        p.master_write(b"c").unwrap();
        assert_eq!(p.master_read(100), Err(Errno::EAGAIN), "no echo");
        assert_eq!(p.slave_read(100).unwrap(), b"a\rb\x03c");
        p.slave_write(b"x\n").unwrap();
        assert_eq!(p.master_read(100).unwrap(), b"x\n", "no ONLCR without OPOST");
        // Leaving canonical mode hands the pending line to the reader.
        let mut q = pty();
        q.master_write(b"half").unwrap();
        assert_eq!(q.slave_read(10), Err(Errno::EAGAIN));
        q.set_termios(t, false);
        assert_eq!(q.slave_read(10).unwrap(), b"half");
    }

    #[test]
    fn queues_are_bounded() {
        let mut p = pty();
        let big = vec![b'x'; OUTPUT_CAPACITY + 10];
        assert_eq!(p.slave_write(&big).unwrap(), OUTPUT_CAPACITY);
        assert_eq!(p.slave_write(b"y"), Err(Errno::EAGAIN));
        assert!(!p.slave_writable());
        // A long canonical line stops growing; the newline still ends it.
        let mut q = pty();
        let mut t = q.termios;
        t.lflag &= !ECHO;
        q.set_termios(t, false);
        q.master_write(&vec![b'a'; MAX_CANON + 100]).unwrap();
        q.master_write(b"\n").unwrap();
        assert_eq!(q.slave_read(1 << 20).unwrap().len(), MAX_CANON + 1);
        // Raw input stops at the input capacity: the writer must wait.
        t.lflag &= !ICANON;
        q.set_termios(t, false);
        let (n, _) = q.master_write(&vec![b'b'; INPUT_CAPACITY + 5]).unwrap();
        assert_eq!(n, INPUT_CAPACITY);
        assert_eq!(q.master_write(b"c"), Err(Errno::EAGAIN));
        assert!(q.valid());
    }

    #[test]
    fn master_read_after_slave_close_is_eio_once_drained() {
        let mut p = pty();
        p.slave_write(b"bye").unwrap();
        p.slave_closed = true;
        assert_eq!(p.master_read(10).unwrap(), b"bye");
        assert_eq!(p.master_read(10), Err(Errno::EIO));
    }

    #[test]
    fn termios_round_trips_through_the_kernel_layout() {
        let t = Termios::default();
        let b = t.to_bytes(false);
        assert_eq!(b.len(), TERMIOS_SIZE);
        assert_eq!(Termios::from_bytes(&b).unwrap(), t);
        assert_eq!(t.to_bytes(true).len(), TERMIOS2_SIZE);
        assert_eq!(Termios::from_bytes(&b[..20]), Err(Errno::EFAULT));
        let w = WinSize { rows: 24, cols: 80, xpixel: 1, ypixel: 2 };
        assert_eq!(WinSize::from_bytes(&w.to_bytes()).unwrap(), w);
    }
}
