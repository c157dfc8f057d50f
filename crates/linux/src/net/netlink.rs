//! NETLINK_ROUTE as far as glibc needs it to list interfaces
//! (`if_nameindex`, `getifaddrs`' link part): an RTM_GETLINK request is
//! answered with the sandbox's only interface, `lo` (index 1), never one of
//! the host. Every other request is refused at send (EOPNOTSUPP), so glibc's
//! address-family probe for `AI_ADDRCONFIG` (RTM_GETADDR) fails as it did
//! without netlink and stays pessimistic (both families), instead of reading
//! "loopback only" and refusing lookups the egress could serve.
//!
//! Pure functions over the request bytes; the socket is an `objects::Socket`
//! of type `SockType::Netlink` (see `crate::syscalls::sys_unix`).

use crate::errno::Errno;

/// The one interface of a sandbox.
pub const LO_INDEX: i32 = 1;
pub const LO_NAME: &[u8] = b"lo";

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_MULTI: u16 = 0x2;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const IFINFOMSG_LEN: usize = 16;
const ARPHRD_LOOPBACK: u16 = 772;
const IFLA_ADDRESS: u16 = 1;
const IFLA_BROADCAST: u16 = 2;
const IFLA_IFNAME: u16 = 3;
const IFLA_MTU: u16 = 4;
const IFLA_TXQLEN: u16 = 13;
const IFLA_OPERSTATE: u16 = 16;
/// IF_OPER_UNKNOWN: what Linux reports for lo.
const OPER_UNKNOWN: u8 = 0;
const LO_MTU: u32 = 65536;
/// Requests in one send answered at most (a real caller sends one).
const MAX_REQUESTS: usize = 16;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn header(len: usize, ty: u16, flags: u16, seq: u32, pid: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_le_bytes());
    m.extend_from_slice(&ty.to_le_bytes());
    m.extend_from_slice(&flags.to_le_bytes());
    m.extend_from_slice(&seq.to_le_bytes());
    m.extend_from_slice(&pid.to_le_bytes());
    m
}

fn attr(m: &mut Vec<u8>, ty: u16, data: &[u8]) {
    let len = 4 + data.len();
    m.extend_from_slice(&(len as u16).to_le_bytes());
    m.extend_from_slice(&ty.to_le_bytes());
    m.extend_from_slice(data);
    m.resize(align4(m.len()), 0);
}

/// RTM_NEWLINK for lo.
fn lo_link(flags: u16, seq: u32, pid: u32) -> Vec<u8> {
    let mut body = Vec::new();
    body.push(libc::AF_UNSPEC as u8);
    body.push(0);
    body.extend_from_slice(&ARPHRD_LOOPBACK.to_le_bytes());
    body.extend_from_slice(&LO_INDEX.to_le_bytes());
    let iff = (libc::IFF_UP | libc::IFF_LOOPBACK | libc::IFF_RUNNING | libc::IFF_LOWER_UP) as u32;
    body.extend_from_slice(&iff.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    let mut name = LO_NAME.to_vec();
    name.push(0);
    attr(&mut body, IFLA_IFNAME, &name);
    attr(&mut body, IFLA_MTU, &LO_MTU.to_le_bytes());
    attr(&mut body, IFLA_TXQLEN, &1000u32.to_le_bytes());
    attr(&mut body, IFLA_OPERSTATE, &[OPER_UNKNOWN]);
    attr(&mut body, IFLA_ADDRESS, &[0; 6]);
    attr(&mut body, IFLA_BROADCAST, &[0; 6]);
    let mut m = header(NLMSG_HDRLEN + body.len(), RTM_NEWLINK, flags, seq, pid);
    m.extend_from_slice(&body);
    m
}

/// NLMSG_ERROR carrying `errno` (0: an acknowledgement) and the request's header.
fn error(req: &[u8], errno: i32, seq: u32, pid: u32) -> Vec<u8> {
    let mut m = header(NLMSG_HDRLEN + 4 + NLMSG_HDRLEN, NLMSG_ERROR, 0, seq, pid);
    m.extend_from_slice(&(-errno).to_le_bytes());
    m.extend_from_slice(&req[..NLMSG_HDRLEN]);
    m
}

/// The datagrams the kernel side sends back for `data` (one send on a
/// NETLINK_ROUTE socket whose port id is `pid`), in order. EOPNOTSUPP for a
/// request this layer does not serve, EINVAL for a malformed one.
pub fn answer(data: &[u8], pid: u32) -> Result<Vec<Vec<u8>>, Errno> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while data.len().saturating_sub(off) >= NLMSG_HDRLEN {
        if out.len() >= MAX_REQUESTS {
            return Err(Errno::EINVAL);
        }
        let h = &data[off..off + NLMSG_HDRLEN];
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let ty = u16::from_le_bytes([h[4], h[5]]);
        let flags = u16::from_le_bytes([h[6], h[7]]);
        let seq = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if len < NLMSG_HDRLEN || len > data.len() - off {
            return Err(Errno::EINVAL);
        }
        let body = &data[off + NLMSG_HDRLEN..off + len];
        if flags & NLM_F_REQUEST == 0 || ty != RTM_GETLINK {
            return Err(Errno::EOPNOTSUPP);
        }
        if flags & NLM_F_DUMP == NLM_F_DUMP {
            // One datagram with the dump's parts, then the end of the dump.
            out.push(lo_link(NLM_F_MULTI, seq, pid));
            let mut done = header(NLMSG_HDRLEN + 4, NLMSG_DONE, NLM_F_MULTI, seq, pid);
            done.extend_from_slice(&0i32.to_le_bytes());
            out.push(done);
        } else {
            // One link, by index (ifinfomsg) or by IFLA_IFNAME.
            let index = body.get(4..8).map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let name = body.get(IFINFOMSG_LEN..).and_then(ifname);
            let lo = match (index, name) {
                (0, Some(n)) => n == LO_NAME,
                (0, None) => false,
                (i, _) => i == LO_INDEX,
            };
            if lo {
                out.push(lo_link(0, seq, pid));
                if flags & NLM_F_ACK != 0 {
                    out.push(error(h, 0, seq, pid));
                }
            } else {
                out.push(error(h, libc::ENODEV, seq, pid));
            }
        }
        off = off.saturating_add(align4(len));
    }
    if out.is_empty() {
        return Err(Errno::EINVAL);
    }
    Ok(out)
}

/// The IFLA_IFNAME attribute's name (without its NUL) in `attrs`.
fn ifname(attrs: &[u8]) -> Option<&[u8]> {
    let mut off = 0usize;
    while attrs.len().saturating_sub(off) >= 4 {
        let len = u16::from_le_bytes([attrs[off], attrs[off + 1]]) as usize;
        let ty = u16::from_le_bytes([attrs[off + 2], attrs[off + 3]]);
        if len < 4 || len > attrs.len() - off {
            return None;
        }
        if ty == IFLA_IFNAME {
            let v = &attrs[off + 4..off + len];
            return Some(&v[..v.iter().position(|&c| c == 0).unwrap_or(v.len())]);
        }
        off = off.saturating_add(align4(len));
    }
    None
}

/// An interface's index by name (ioctl SIOCGIFINDEX): lo only.
pub fn index_of(name: &[u8]) -> Option<i32> {
    (name == LO_NAME).then_some(LO_INDEX)
}

/// An interface's name by index (ioctl SIOCGIFNAME): lo only.
pub fn name_of(index: i32) -> Option<&'static [u8]> {
    (index == LO_INDEX).then_some(LO_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(ty: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut m = header(NLMSG_HDRLEN + body.len(), ty, flags, seq, 0);
        m.extend_from_slice(body);
        m
    }

    /// A message's (type, flags, seq, pid), and the index and name of a link.
    type Parsed = (u16, u16, u32, u32, Option<(i32, Vec<u8>)>);

    /// Each message in `d`.
    fn parse(d: &[u8]) -> Vec<Parsed> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + NLMSG_HDRLEN <= d.len() {
            let len = u32::from_le_bytes(d[off..off + 4].try_into().unwrap()) as usize;
            let ty = u16::from_le_bytes([d[off + 4], d[off + 5]]);
            let flags = u16::from_le_bytes([d[off + 6], d[off + 7]]);
            let seq = u32::from_le_bytes(d[off + 8..off + 12].try_into().unwrap());
            let pid = u32::from_le_bytes(d[off + 12..off + 16].try_into().unwrap());
            let link = (ty == RTM_NEWLINK).then(|| {
                let b = &d[off + NLMSG_HDRLEN..off + len];
                (i32::from_le_bytes(b[4..8].try_into().unwrap()), ifname(&b[IFINFOMSG_LEN..]).unwrap().to_vec())
            });
            out.push((ty, flags, seq, pid, link));
            off += align4(len);
        }
        out
    }

    #[test]
    fn a_link_dump_lists_lo_then_ends() {
        // As glibc's if_nameindex sends it: RTM_GETLINK, a dump, rtgenmsg AF_PACKET.
        let r = answer(&request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 77, &[17, 0, 0, 0]), 42).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(parse(&r[0]), [(RTM_NEWLINK, NLM_F_MULTI, 77, 42, Some((1, b"lo".to_vec())))]);
        assert_eq!(parse(&r[1]), [(NLMSG_DONE, NLM_F_MULTI, 77, 42, None)]);
    }

    #[test]
    fn one_link_by_index_or_name() {
        let mut by_index = vec![0u8; IFINFOMSG_LEN];
        by_index[4..8].copy_from_slice(&1i32.to_le_bytes());
        let r = answer(&request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK, 5, &by_index), 9).unwrap();
        assert_eq!(parse(&r[0]), [(RTM_NEWLINK, 0, 5, 9, Some((1, b"lo".to_vec())))]);
        assert_eq!(parse(&r[1])[0].0, NLMSG_ERROR, "the acknowledgement");
        by_index[4..8].copy_from_slice(&2i32.to_le_bytes());
        let r = answer(&request(RTM_GETLINK, NLM_F_REQUEST, 6, &by_index), 9).unwrap();
        assert_eq!(parse(&r[0])[0].0, NLMSG_ERROR);
        assert_eq!(i32::from_le_bytes(r[0][16..20].try_into().unwrap()), -libc::ENODEV);
        let mut by_name = vec![0u8; IFINFOMSG_LEN];
        attr(&mut by_name, IFLA_IFNAME, b"lo\0");
        let r = answer(&request(RTM_GETLINK, NLM_F_REQUEST, 7, &by_name), 9).unwrap();
        assert_eq!(parse(&r[0])[0].4, Some((1, b"lo".to_vec())));
        assert_eq!(index_of(b"lo"), Some(1));
        assert_eq!((index_of(b"eth0"), name_of(1), name_of(2)), (None, Some(&b"lo"[..]), None));
    }

    #[test]
    fn other_requests_and_garbage_are_refused() {
        const RTM_GETADDR: u16 = 22;
        assert_eq!(answer(&request(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, &[0; 8]), 1), Err(Errno::EOPNOTSUPP));
        assert_eq!(answer(&request(RTM_GETLINK, NLM_F_DUMP, 1, &[]), 1), Err(Errno::EOPNOTSUPP), "not a request");
        assert_eq!(answer(&[1, 2, 3], 1), Err(Errno::EINVAL));
        let mut bad = request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, &[]);
        bad[..4].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(answer(&bad, 1), Err(Errno::EINVAL), "a length past the data");
        let many: Vec<u8> = (0..20).flat_map(|_| request(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, &[])).collect();
        assert_eq!(answer(&many, 1), Err(Errno::EINVAL));
    }
}
