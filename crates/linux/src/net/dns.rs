//! The DNS messages the VMM's resolver reads and writes (RFC 1035): one
//! question in, A/AAAA answers out. Parsing is defensive: the query comes from
//! the guest.

use std::net::IpAddr;

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
pub const CLASS_IN: u16 = 1;

pub const RCODE_OK: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_NOTIMP: u8 = 4;
pub const RCODE_REFUSED: u8 = 5;

/// Largest message we accept or answer (TCP framing allows 65535).
pub const MAX_MESSAGE: usize = 65535;
/// A UDP answer without EDNS must fit 512 bytes; at most this many addresses go in one.
pub const MAX_ANSWERS: usize = 8;
pub const TTL: u32 = 30;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired, echoed back.
    pub rd: bool,
    /// The name as asked (labels joined by '.', no trailing dot), lower-cased.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// The raw question section (echoed in the answer).
    question: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    #[error("DNS message too short")]
    Short,
    #[error("not a standard query")]
    NotQuery,
    #[error("malformed question name")]
    BadName,
}

/// Parse a query: header, exactly one question (answer/authority sections
/// ignored, EDNS in the additional section ignored).
pub fn parse_query(msg: &[u8]) -> Result<Query, DnsError> {
    if msg.len() < 12 {
        return Err(DnsError::Short);
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let flags = u16::from_be_bytes([msg[2], msg[3]]);
    let qdcount = u16::from_be_bytes([msg[4], msg[5]]);
    // QR=0 (query), OPCODE=0 (standard), one question.
    if flags & 0x8000 != 0 || (flags >> 11) & 0xF != 0 || qdcount != 1 {
        return Err(DnsError::NotQuery);
    }
    let mut pos = 12;
    let mut labels: Vec<String> = Vec::new();
    let mut total = 0usize;
    loop {
        let len = *msg.get(pos).ok_or(DnsError::Short)? as usize;
        pos += 1;
        if len == 0 {
            break;
        }
        // No compression pointers in a question we accept (a query has nothing to point at).
        if len > 63 {
            return Err(DnsError::BadName);
        }
        let label = msg.get(pos..pos + len).ok_or(DnsError::Short)?;
        total += len + 1;
        if total > 255 {
            return Err(DnsError::BadName);
        }
        if !label.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(DnsError::BadName);
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        pos += len;
    }
    let tail = msg.get(pos..pos + 4).ok_or(DnsError::Short)?;
    let qtype = u16::from_be_bytes([tail[0], tail[1]]);
    let qclass = u16::from_be_bytes([tail[2], tail[3]]);
    pos += 4;
    Ok(Query { id, rd: flags & 0x0100 != 0, name: labels.join("."), qtype, qclass, question: msg[12..pos].to_vec() })
}

/// A response to `q`: `rcode`, and (for NOERROR) the addresses of the
/// question's type as answers (at most `MAX_ANSWERS`).
pub fn response(q: &Query, rcode: u8, addrs: &[IpAddr]) -> Vec<u8> {
    let answers: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| match q.qtype {
            TYPE_A => a.is_ipv4(),
            TYPE_AAAA => a.is_ipv6(),
            _ => false,
        })
        .take(if rcode == RCODE_OK { MAX_ANSWERS } else { 0 })
        .collect();
    let mut out = Vec::with_capacity(12 + q.question.len() + answers.len() * 28);
    out.extend_from_slice(&q.id.to_be_bytes());
    // QR=1, opcode 0, AA=0, TC=0, RD echoed, RA=1, rcode.
    let flags: u16 = 0x8000 | if q.rd { 0x0100 } else { 0 } | 0x0080 | u16::from(rcode & 0xF);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&q.question);
    for a in answers {
        out.extend_from_slice(&[0xC0, 12]); // pointer to the question's name
        let (ty, rdata) = match a {
            IpAddr::V4(v4) => (TYPE_A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (TYPE_AAAA, v6.octets().to_vec()),
        };
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&TTL.to_be_bytes());
        out.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
        out.extend_from_slice(&rdata);
    }
    out
}

/// A minimal error answer to a message we could not parse as a query (the id
/// echoed when there is one), or nothing for a message too short to answer.
pub fn format_error(msg: &[u8]) -> Option<Vec<u8>> {
    if msg.len() < 12 || msg[2] & 0x80 != 0 {
        return None;
    }
    let mut out = vec![0u8; 12];
    out[..2].copy_from_slice(&msg[..2]);
    out[2] = 0x80 | (msg[2] & 0x01);
    out[3] = 0x80 | RCODE_FORMERR;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query as glibc's res_mkquery builds it.
    fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&id.to_be_bytes());
        m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend_from_slice(l.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&CLASS_IN.to_be_bytes());
        m
    }

    #[test]
    fn answers_a_and_aaaa() {
        let q = parse_query(&query(0x1234, "Web.Test.Example", TYPE_A)).unwrap();
        assert_eq!((q.id, q.name.as_str(), q.qtype, q.rd), (0x1234, "web.test.example", TYPE_A, true));
        let addrs: Vec<IpAddr> = vec!["10.0.0.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        let r = response(&q, RCODE_OK, &addrs);
        assert_eq!(&r[..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0xF, 0);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 1, "one A answer");
        assert_eq!(&r[r.len() - 4..], &[10, 0, 0, 7]);
        let q6 = parse_query(&query(7, "web.test.example", TYPE_AAAA)).unwrap();
        let r6 = response(&q6, RCODE_OK, &addrs);
        assert_eq!(u16::from_be_bytes([r6[6], r6[7]]), 1);
        assert_eq!(r6[r6.len() - 1], 7);
        let many: Vec<IpAddr> = (0..50).map(|i| IpAddr::from([1, 1, 1, i])).collect();
        let r = response(&q, RCODE_OK, &many);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]) as usize, MAX_ANSWERS);
        assert!(r.len() <= 512);
        let r = response(&q, RCODE_REFUSED, &addrs);
        assert_eq!((r[3] & 0xF, u16::from_be_bytes([r[6], r[7]])), (RCODE_REFUSED, 0));
    }

    #[test]
    fn rejects_hostile_queries() {
        assert_eq!(parse_query(&[0; 5]), Err(DnsError::Short));
        let mut m = query(1, "a.b", TYPE_A);
        m[2] |= 0x80;
        assert_eq!(parse_query(&m), Err(DnsError::NotQuery), "a response is not a query");
        let mut m = query(1, "a.b", TYPE_A);
        m[5] = 2;
        assert_eq!(parse_query(&m), Err(DnsError::NotQuery), "two questions");
        let mut m = query(1, "ab", TYPE_A);
        m[12] = 0xC0; // compression pointer
        assert_eq!(parse_query(&m), Err(DnsError::BadName));
        let m = query(1, "a.b", TYPE_A);
        assert_eq!(parse_query(&m[..m.len() - 2]), Err(DnsError::Short), "truncated");
        let long = vec!["a".repeat(60); 5].join(".");
        assert_eq!(parse_query(&query(1, &long, TYPE_A)), Err(DnsError::BadName), "name over 255 bytes");
        assert_eq!(parse_query(&query(1, "a b.c", TYPE_A)), Err(DnsError::BadName));
        let e = format_error(&query(9, "x", TYPE_A)).unwrap();
        assert_eq!((&e[..2], e[3] & 0xF), (&[0, 9][..], RCODE_FORMERR));
    }
}
