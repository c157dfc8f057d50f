//! Rewriting of HTTP/1.x request heads on their way out: the placeholders of
//! a sandbox's secrets replaced by their values in header values (the relay
//! of [`super::secrets`] and the TLS termination of [`super::tls`] feed it
//! what the guest sends).

/// Longest request head the relay parses; a longer one passes unchanged.
pub const HEAD_MAX: usize = 64 * 1024;
/// Headers of one request the relay parses; more: the rest passes unchanged.
const HEADERS_MAX: usize = 128;

/// Replaces placeholders in the header values of a stream of HTTP/1.x
/// requests. Request lines and bodies pass unchanged (a body is skipped by
/// its Content-Length); a head that does not parse, is longer than
/// [`HEAD_MAX`], or a chunked or upgraded request ends the parsing: the rest
/// of the connection passes unchanged.
pub struct Rewriter {
    subs: Vec<(Vec<u8>, Vec<u8>)>,
    head: Vec<u8>,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Body(u64),
    Raw,
}

impl Drop for Rewriter {
    fn drop(&mut self) {
        for (_, v) in &mut self.subs {
            v.fill(0);
        }
    }
}

fn replace_all(value: &[u8], subs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = value.to_vec();
    for (from, to) in subs {
        if from.is_empty() || out.len() < from.len() {
            continue;
        }
        let mut next = Vec::with_capacity(out.len());
        let mut i = 0;
        while i < out.len() {
            if out[i..].starts_with(from) {
                next.extend_from_slice(to);
                i += from.len();
            } else {
                next.push(out[i]);
                i += 1;
            }
        }
        out = next;
    }
    out
}

impl Rewriter {
    /// Replace each (placeholder, value) of `subs`.
    pub fn new(subs: Vec<(Vec<u8>, Vec<u8>)>) -> Rewriter {
        Rewriter { subs, head: Vec::new(), state: State::Head }
    }

    /// Parsing ended: everything passes unchanged.
    pub fn is_raw(&self) -> bool {
        self.state == State::Raw
    }

    /// Feed bytes from the guest; what to send appended to `out`.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let mut buf = std::borrow::Cow::Borrowed(input);
        let mut pos = 0;
        while pos < buf.len() {
            match self.state {
                State::Raw => {
                    out.extend_from_slice(&buf[pos..]);
                    return;
                }
                State::Body(n) => {
                    let k = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len() - pos);
                    out.extend_from_slice(&buf[pos..pos + k]);
                    pos += k;
                    let left = n - k as u64;
                    self.state = if left == 0 { State::Head } else { State::Body(left) };
                }
                State::Head => {
                    // Take at most what the head may still grow by: the rest is looked at after it.
                    let room = (HEAD_MAX + 1).saturating_sub(self.head.len());
                    let k = room.min(buf.len() - pos);
                    self.head.extend_from_slice(&buf[pos..pos + k]);
                    pos += k;
                    if let Some(rest) = self.parse_head(out) {
                        // The bytes after the head go round again, ahead of the rest of the input.
                        if !rest.is_empty() {
                            buf = std::borrow::Cow::Owned([&rest[..], &buf[pos..]].concat());
                            pos = 0;
                        }
                    }
                }
            }
        }
    }

    /// Parse the buffered head: on a complete one, write it (rewritten) to
    /// `out`, set the body state and return the bytes after it. None: need
    /// more, or gave up (`State::Raw`, the buffer written unchanged).
    fn parse_head(&mut self, out: &mut Vec<u8>) -> Option<Vec<u8>> {
        let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
        let mut req = httparse::Request::new(&mut headers);
        let give_up = |me: &mut Rewriter, out: &mut Vec<u8>| {
            out.append(&mut me.head);
            me.state = State::Raw;
            None
        };
        let n = match req.parse(&self.head) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if self.head.len() <= HEAD_MAX => return None,
            _ => return give_up(self, out),
        };
        let mut body: u64 = 0;
        let mut raw_after = false;
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                match std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse::<u64>().ok()) {
                    Some(v) => body = v,
                    None => raw_after = true,
                }
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") || h.name.eq_ignore_ascii_case("upgrade") {
                raw_after = true;
            }
        }
        if req.method.is_some_and(|m| m.eq_ignore_ascii_case("CONNECT")) {
            raw_after = true;
        }
        // The request line as it came, then each header with its value rewritten.
        let line_end = self.head.iter().position(|&b| b == b'\n').map_or(0, |p| p + 1);
        let mut head = self.head[..line_end].to_vec();
        for h in req.headers.iter() {
            head.extend_from_slice(h.name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(&replace_all(h.value, &self.subs));
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        out.append(&mut head);
        let rest = self.head.split_off(n);
        self.head.clear();
        self.state = if raw_after {
            State::Raw
        } else if body > 0 {
            State::Body(body)
        } else {
            State::Head
        };
        Some(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "fbx_secret_00112233445566778899aabbccddeeff";

    fn rw() -> Rewriter {
        Rewriter::new(vec![(P.as_bytes().to_vec(), b"sk-REAL".to_vec())])
    }

    fn run(r: &mut Rewriter, parts: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts {
            r.feed(p, &mut out);
        }
        out
    }

    #[test]
    fn header_values_are_substituted_and_bodies_are_not() {
        let body = format!("token={P}");
        let req = format!(
            "POST /x?{P} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {P}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let out = run(&mut rw(), &[req.as_bytes()]);
        let want = format!(
            "POST /x?{P} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer sk-REAL\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    #[test]
    fn a_head_split_across_reads_byte_by_byte() {
        let req = format!("GET / HTTP/1.1\r\nX-Api-Key: {P}\r\n\r\n");
        let parts: Vec<&[u8]> = req.as_bytes().chunks(1).collect();
        let out = run(&mut rw(), &parts);
        assert_eq!(String::from_utf8(out).unwrap(), "GET / HTTP/1.1\r\nX-Api-Key: sk-REAL\r\n\r\n");
    }

    #[test]
    fn several_requests_on_one_connection() {
        let one = format!("GET /1 HTTP/1.1\r\nX-Api-Key: {P}\r\nContent-Length: 3\r\n\r\nabc");
        let two = format!("GET /2 HTTP/1.1\r\nAuthorization: Bearer {P}{P}\r\n\r\n");
        let all = format!("{one}{two}");
        // In one read, and split in the middle of the first body and the second head.
        for split in [all.len(), one.len() - 2, one.len() + 20] {
            let (a, b) = all.as_bytes().split_at(split);
            let out = String::from_utf8(run(&mut rw(), &[a, b])).unwrap();
            assert_eq!(
                out,
                "GET /1 HTTP/1.1\r\nX-Api-Key: sk-REAL\r\nContent-Length: 3\r\n\r\nabc\
                 GET /2 HTTP/1.1\r\nAuthorization: Bearer sk-REALsk-REAL\r\n\r\n",
                "split at {split}"
            );
        }
    }

    #[test]
    fn a_body_holding_a_head_is_not_parsed() {
        let inner = format!("GET / HTTP/1.1\r\nX: {P}\r\n\r\n");
        let req = format!("PUT / HTTP/1.1\r\nContent-Length: {}\r\n\r\n{inner}", inner.len());
        let out = run(&mut rw(), &[req.as_bytes()]);
        assert_eq!(out, req.as_bytes());
    }

    #[test]
    fn oversized_and_malformed_heads_pass_unchanged() {
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\nY: {P}\r\n\r\n", "a".repeat(HEAD_MAX));
        let mut r = rw();
        let parts: Vec<&[u8]> = big.as_bytes().chunks(1000).collect();
        let out = run(&mut r, &parts);
        assert_eq!(out, big.as_bytes());
        assert!(r.is_raw());
        let bad = format!("\x01\x02 nonsense {P}\r\n\r\nGET / HTTP/1.1\r\nX: {P}\r\n\r\n");
        let mut r = rw();
        assert_eq!(run(&mut r, &[bad.as_bytes()]), bad.as_bytes());
        assert!(r.is_raw());
        // Chunked: parsing ends after the head (its header still substituted).
        let ch = format!("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX: {P}\r\n\r\n3\r\n{P}\r\n");
        let out = String::from_utf8(run(&mut rw(), &[ch.as_bytes()])).unwrap();
        assert_eq!(out, format!("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX: sk-REAL\r\n\r\n3\r\n{P}\r\n"));
    }
}
