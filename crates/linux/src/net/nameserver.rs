//! The VMM's DNS server at `RESOLVER` as a guest socket sees it: questions
//! over UDP or a TCP stream, answered now or once the egress' host lookup is
//! done (queued on the asking socket).

use std::collections::VecDeque;
#[cfg(test)]
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
#[cfg(test)]
use std::time::Duration;

use super::loopback::Ancillary;
use super::stats::GLOBAL;
use super::{dns, resolver, resolver_addr, Backend, NetIo, Resolution, Resolved, Sock};

impl Sock {
    /// A question to the resolver has its host lookup done (recv answers it).
    pub(super) fn answer_ready(&self) -> bool {
        self.pending.iter().any(|(_, l)| l.is_done())
    }

    /// Queue an answer of the resolver: a stream's output, else the datagram
    /// inbox (full: dropped, as a busy server may).
    fn push_answer(&mut self, a: Vec<u8>) {
        match &mut self.backend {
            Backend::ResolverStream { output, .. } => {
                if output.len() + 2 + a.len() <= RESOLVER_STREAM_CAP {
                    output.extend((a.len() as u16).to_be_bytes());
                    output.extend(a);
                }
            }
            _ => {
                if self.inbox.len() < INBOX_CAP {
                    self.inbox.push_back((a, resolver_addr(), Ancillary::default()));
                }
            }
        }
    }
}

/// Largest message buffered for the TCP resolver stream, each way.
pub(super) const RESOLVER_STREAM_CAP: usize = 2 + dns::MAX_MESSAGE;

/// Resolver answers queued on one UDP socket.
const INBOX_CAP: usize = 16;

/// Questions one sandbox may have waiting for host lookups, over all its
/// sockets (each holds its lookup's eventfd until the guest reads the answer).
const QUESTIONS_WAITING: usize = 64;

impl NetIo {
    /// End every host lookup of this sandbox now with SERVFAIL (the exec was
    /// interrupted: the guest's resolver, which waits out its own timeout
    /// through signals, gets its answer at once).
    pub fn cancel_lookups(&mut self) {
        self.egress.cancel_lookups();
    }

    /// Answer one DNS query to the VMM's resolver: now, once a host lookup
    /// is done, or never (what a server does with what it cannot even parse).
    pub(super) fn answer(&mut self, msg: &[u8]) -> Reply {
        self.stats.dns_queries += 1;
        GLOBAL.dns_queries.fetch_add(1, Ordering::Relaxed);
        let q = match dns::parse_query(msg) {
            Ok(q) => q,
            Err(_) => return dns::format_error(msg).map_or(Reply::Drop, Reply::Now),
        };
        if q.qclass != dns::CLASS_IN || (q.qtype != dns::TYPE_A && q.qtype != dns::TYPE_AAAA) {
            // Only address lookups are served; other types get an empty answer.
            let rcode = if q.qclass == dns::CLASS_IN { dns::RCODE_OK } else { dns::RCODE_NOTIMP };
            return Reply::Now(dns::response(&q, rcode, &[]));
        }
        match self.egress.lookup(&q.name) {
            Resolution::Done(r) => Reply::Now(self.respond(&q, r)),
            Resolution::Wait(l) => Reply::Later(q, l),
        }
    }

    /// The answer to `q` (and the counts and note of the egress' answer).
    fn respond(&mut self, q: &dns::Query, r: Resolved) -> Vec<u8> {
        if r.rcode == dns::RCODE_REFUSED || r.refused {
            self.stats.dns_refused += 1;
            GLOBAL.dns_refused.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(why) = r.denied {
            *self.stats.denied.entry(why).or_default() += 1;
        }
        if let Some(n) = r.note {
            self.note(n);
        }
        dns::response(q, r.rcode, &r.addrs)
    }

    /// Queue `r` for socket `id`'s recv (a question waiting for a lookup: at
    /// most `INBOX_CAP` per socket and `QUESTIONS_WAITING` in all, beyond it is
    /// dropped).
    pub(super) fn reply(&mut self, id: u64, r: Reply) {
        let waiting: usize = self.socks.values().map(|s| s.pending.len()).sum();
        let Ok(s) = self.sock(id) else { return };
        match r {
            Reply::Drop => {}
            Reply::Now(a) => s.push_answer(a),
            Reply::Later(q, l) => {
                if s.pending.len() < INBOX_CAP && waiting < QUESTIONS_WAITING {
                    s.pending.push_back((q, l));
                }
            }
        }
    }

    /// Answer socket `id`'s questions whose host lookup is done.
    pub(super) fn harvest(&mut self, id: u64) {
        let Some(s) = self.socks.get_mut(&id) else { return };
        if !s.answer_ready() {
            return;
        }
        let (done, waiting): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut s.pending).into_iter().partition(|(_, l)| l.is_done());
        s.pending = waiting;
        for (q, l) in done {
            let r = self.egress.finish(&l);
            let a = self.respond(&q, r);
            if let Some(s) = self.socks.get_mut(&id) {
                s.push_answer(a);
            }
        }
    }

    /// Start resolving `name` (tests).
    #[cfg(test)]
    pub fn begin(&mut self, name: &str) -> Resolution {
        self.egress.lookup(name)
    }

    /// Resolve `name`, waiting for a host lookup on this thread (tests only:
    /// the sandbox never waits here).
    #[cfg(test)]
    pub fn resolve(&mut self, name: &str) -> (u8, Vec<IpAddr>) {
        match self.egress.lookup(name) {
            Resolution::Done(r) => (r.rcode, r.addrs),
            Resolution::Wait(l) => {
                let _ = l.wait(resolver::BUDGET + Duration::from_secs(1));
                if !l.is_done() {
                    l.cancel();
                }
                let r = self.egress.finish(&l);
                (r.rcode, r.addrs)
            }
        }
    }
}

/// What the resolver does with a question.
pub(super) enum Reply {
    Now(Vec<u8>),
    /// Answered once the host lookup is done.
    Later(dns::Query, Arc<resolver::Lookup>),
    Drop,
}
