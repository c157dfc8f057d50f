//! The egress policy: which addresses and ports a sandbox may reach. Pure
//! decisions, evaluated by the host on every connect / first datagram to a
//! destination and on every address the VMM's resolver hands out.
//!
//! Order of evaluation (first match wins):
//! 1. `network: none` denies everything.
//! 2. A `deny` rule (CIDR, host name pattern or port) denies.
//! 3. An `allow` rule by CIDR/IP allows, even a non-public address (that is how
//!    a test or an operator opens a private service explicitly).
//! 4. An `allow` rule by host name allows a *public* address that the VMM's
//!    resolver handed out for a matching name. A name never unlocks a
//!    non-public address (DNS rebinding to 127.0.0.1 or 169.254.169.254 stays
//!    denied).
//! 5. In `allowlist` mode, anything else is denied.
//! 6. Non-public classes (loopback, private, link-local with the metadata
//!    endpoints, CGNAT, multicast, broadcast, unspecified, reserved, the
//!    documentation and benchmarking ranges, the same in IPv4-mapped,
//!    -compatible, NAT64 and 6to4 IPv6 forms) and the host's own addresses are
//!    denied; public addresses are allowed.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// The one-flag switch and the base of a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// No network at all (socket() of AF_INET/AF_INET6 still works, connects are refused).
    #[default]
    None,
    /// Public internet; every non-public address denied unless an allow rule names it.
    Public,
    /// Only what an allow rule names.
    Allowlist,
}

/// A host name pattern: `example.com` (exact) or `*.example.com` (any name
/// strictly under it). Compared case-insensitively, without a trailing dot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamePattern {
    Exact(String),
    Suffix(String),
}

impl NamePattern {
    pub fn matches(&self, name: &str) -> bool {
        let name = normalize_name(name);
        match self {
            NamePattern::Exact(n) => name == *n,
            NamePattern::Suffix(s) => {
                name.len() > s.len() + 1
                    && name.ends_with(s.as_str())
                    && name.as_bytes()[name.len() - s.len() - 1] == b'.'
            }
        }
    }
}

pub fn normalize_name(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Any,
    Net(IpNet),
    Name(NamePattern),
}

/// One allow or deny rule: a target and an optional inclusive port range.
/// Text forms: `10.0.0.0/8`, `192.168.1.7`, `fd00::/8`, `[::1]:8080`,
/// `example.com`, `*.example.com:443`, `*:25`, `10.1.2.3:8000-8100`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub target: Target,
    pub ports: Option<(u16, u16)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid network rule {rule:?}: {why}")]
pub struct RuleError {
    pub rule: String,
    pub why: &'static str,
}

fn parse_ports(s: &str) -> Option<(u16, u16)> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b) = (a.parse::<u16>().ok()?, b.parse::<u16>().ok()?);
    (a <= b).then_some((a, b))
}

fn parse_target(s: &str) -> Result<Target, &'static str> {
    if s == "*" {
        return Ok(Target::Any);
    }
    if let Ok(n) = IpNet::from_str(s) {
        return Ok(Target::Net(n.trunc()));
    }
    if let Ok(ip) = IpAddr::from_str(s) {
        return Ok(Target::Net(IpNet::from(ip)));
    }
    let (wild, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let name = normalize_name(name);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        return Err("not an IP address, CIDR or host name");
    }
    // A name made only of digits and dots is a mistyped address, not a host name.
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err("not a valid IP address");
    }
    Ok(Target::Name(if wild { NamePattern::Suffix(name) } else { NamePattern::Exact(name) }))
}

impl FromStr for Rule {
    type Err = RuleError;
    fn from_str(text: &str) -> Result<Rule, RuleError> {
        let err = |why| RuleError { rule: text.to_string(), why };
        let s = text.trim();
        if s.is_empty() || s.len() > 300 {
            return Err(err("empty or too long"));
        }
        // [v6]:port, v6 or v6/len (more than one ':'), else target[:port].
        let (target, ports) = if let Some(rest) = s.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or_else(|| err("unclosed '['"))?;
            let ports = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| err("expected ':port' after ']'"))?),
            };
            (inner, ports)
        } else if s.matches(':').count() > 1 {
            (s, None)
        } else {
            match s.rsplit_once(':') {
                Some((t, p)) => (t, Some(p)),
                None => (s, None),
            }
        };
        let ports = match ports {
            Some(p) => Some(parse_ports(p).ok_or_else(|| err("bad port or port range"))?),
            None => None,
        };
        let target = parse_target(target).map_err(err)?;
        Ok(Rule { target, ports })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = match &self.target {
            Target::Any => "*".to_string(),
            Target::Net(n) if n.prefix_len() == n.max_prefix_len() => n.addr().to_string(),
            Target::Net(n) => n.to_string(),
            Target::Name(NamePattern::Exact(n)) => n.clone(),
            Target::Name(NamePattern::Suffix(s)) => format!("*.{s}"),
        };
        let bracket = matches!(&self.target, Target::Net(n) if n.addr().is_ipv6() && n.prefix_len() == 128)
            && self.ports.is_some();
        match (bracket, self.ports) {
            (true, Some((a, b))) if a == b => write!(f, "[{t}]:{a}"),
            (true, Some((a, b))) => write!(f, "[{t}]:{a}-{b}"),
            (_, Some((a, b))) if a == b => write!(f, "{t}:{a}"),
            (_, Some((a, b))) => write!(f, "{t}:{a}-{b}"),
            (_, None) => write!(f, "{t}"),
        }
    }
}

impl Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Rule, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Rule {
    fn port_ok(&self, port: Option<u16>) -> bool {
        match (self.ports, port) {
            (None, _) => true,
            (Some((a, b)), Some(p)) => (a..=b).contains(&p),
            // Resolver-time check (port not known yet): a port-limited rule may still apply.
            (Some(_), None) => true,
        }
    }

    fn matches(&self, ip: IpAddr, port: Option<u16>, names: &[String]) -> bool {
        self.port_ok(port)
            && match &self.target {
                Target::Any => true,
                Target::Net(n) => n.contains(&ip) || canonical(ip).is_some_and(|v4| n.contains(&IpAddr::V4(v4))),
                Target::Name(p) => names.iter().any(|n| p.matches(n)),
            }
    }
}

/// A sandbox's egress policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub mode: Mode,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<Rule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Rule>,
    /// Bandwidth of this layer: bytes per second through the sandbox's host
    /// sockets, both directions together (None: no limit of its own). The
    /// sandbox gets the smallest of its layers'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes_per_second: Option<u64>,
}

/// Why a destination is not public.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    Unspecified,
    Loopback,
    Private,
    LinkLocal,
    /// 169.254.169.254, fd00:ec2::254, 100.100.100.200 (Alibaba): the cloud metadata services.
    Metadata,
    Cgnat,
    Multicast,
    Broadcast,
    /// Documentation, benchmarking, IETF protocol assignments, 240/4, discard-only, ...
    Reserved,
    /// One of the host's own interface addresses.
    HostAddress,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Unspecified => "unspecified",
            Class::Loopback => "loopback",
            Class::Private => "private",
            Class::LinkLocal => "link-local",
            Class::Metadata => "metadata",
            Class::Cgnat => "cgnat",
            Class::Multicast => "multicast",
            Class::Broadcast => "broadcast",
            Class::Reserved => "reserved",
            Class::HostAddress => "host-address",
        }
    }
}

/// The outcome of a check, with the rule or class that decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Allow(Reason),
    Deny(Reason),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `network: none`.
    NetworkNone,
    /// An explicit rule (its text form).
    Rule(String),
    /// Allowlist mode, no allow rule matched.
    NotAllowlisted,
    /// A non-public class.
    Class(Class),
    /// A public address under the `public` mode.
    Public,
}

impl Decision {
    pub fn allowed(&self) -> bool {
        matches!(self, Decision::Allow(_))
    }

    pub fn reason(&self) -> &Reason {
        match self {
            Decision::Allow(r) | Decision::Deny(r) => r,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::NetworkNone => write!(f, "network: none"),
            Reason::Rule(r) => write!(f, "rule {r}"),
            Reason::NotAllowlisted => write!(f, "not in the allowlist"),
            Reason::Class(c) => write!(f, "{} address", c.name()),
            Reason::Public => write!(f, "public address"),
        }
    }
}

/// The IPv4 address an IPv6 address stands for, if it embeds one the host
/// stack would reach as IPv4 or that a translator would forward: mapped
/// (::ffff:a.b.c.d), SIIT's IPv4-translated (::ffff:0:a.b.c.d, RFC 7915),
/// compatible (::a.b.c.d), NAT64 (64:ff9b::/96), 6to4 (2002::/16).
pub fn canonical(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else { return None };
    let s = v6.segments();
    let o = v6.octets();
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[..6] == [0; 6] && !(s[6] == 0 && s[7] <= 1) {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

fn in_net(ip: IpAddr, nets: &[&str]) -> bool {
    nets.iter().any(|n| IpNet::from_str(n).is_ok_and(|n| n.contains(&ip)))
}

fn class_v4(ip: Ipv4Addr) -> Option<Class> {
    let a = IpAddr::V4(ip);
    if ip.is_unspecified() || in_net(a, &["0.0.0.0/8"]) {
        return Some(Class::Unspecified);
    }
    if ip.is_loopback() {
        return Some(Class::Loopback);
    }
    if ip == Ipv4Addr::new(169, 254, 169, 254) || ip == Ipv4Addr::new(100, 100, 100, 200) {
        return Some(Class::Metadata);
    }
    if ip.is_private() {
        return Some(Class::Private);
    }
    if ip.is_link_local() {
        return Some(Class::LinkLocal);
    }
    if in_net(a, &["100.64.0.0/10"]) {
        return Some(Class::Cgnat);
    }
    if ip.is_multicast() {
        return Some(Class::Multicast);
    }
    if ip.is_broadcast() {
        return Some(Class::Broadcast);
    }
    let reserved = [
        "192.0.0.0/24",    // IETF protocol assignments
        "192.0.2.0/24",    // TEST-NET-1
        "198.51.100.0/24", // TEST-NET-2
        "203.0.113.0/24",  // TEST-NET-3
        "198.18.0.0/15",   // benchmarking
        "192.88.99.0/24",  // 6to4 relay anycast (deprecated)
        "240.0.0.0/4",     // reserved
    ];
    in_net(a, &reserved).then_some(Class::Reserved)
}

fn class_v6(ip: Ipv6Addr) -> Option<Class> {
    let a = IpAddr::V6(ip);
    if ip.is_unspecified() {
        return Some(Class::Unspecified);
    }
    if ip.is_loopback() {
        return Some(Class::Loopback);
    }
    if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        return Some(Class::Metadata);
    }
    // The local-use NAT64 prefix (RFC 8215) goes to a translator of the
    // local network, and where the IPv4 address sits in it depends on the
    // prefix length that network chose: not public, whatever it embeds.
    if in_net(a, &["fc00::/7", "64:ff9b:1::/48"]) {
        return Some(Class::Private);
    }
    if in_net(a, &["fe80::/10", "fec0::/10"]) {
        return Some(Class::LinkLocal);
    }
    if ip.is_multicast() {
        return Some(Class::Multicast);
    }
    let reserved = [
        "2001:db8::/32", // documentation
        "100::/64",      // discard-only
        "2001::/23",     // IETF protocol assignments (Teredo 2001::/32 included)
        "2001:2::/48",   // benchmarking
        "3fff::/20",     // documentation
        "5f00::/16",     // SRv6 SIDs
        "::/96",         // the rest of the old IPv4-compatible block
    ];
    in_net(a, &reserved).then_some(Class::Reserved)
}

/// The non-public class of an address, `None` for a public one. An IPv6
/// address embedding an IPv4 one takes the embedded address's class.
pub fn classify(ip: IpAddr) -> Option<Class> {
    match ip {
        IpAddr::V4(v4) => class_v4(v4),
        IpAddr::V6(v6) => match canonical(ip) {
            Some(v4) => class_v4(v4).or(class_v6(v6).filter(|c| *c != Class::Reserved)),
            None => class_v6(v6),
        },
    }
}

impl Policy {
    pub fn none() -> Policy {
        Policy::default()
    }

    pub fn public() -> Policy {
        Policy { mode: Mode::Public, ..Policy::default() }
    }

    pub fn allowlist(rules: Vec<Rule>) -> Policy {
        Policy { mode: Mode::Allowlist, allow: rules, ..Policy::default() }
    }

    /// This layer with a bandwidth limit (bytes per second).
    pub fn with_rate(mut self, bytes_per_second: Option<u64>) -> Policy {
        self.max_bytes_per_second = bytes_per_second;
        self
    }

    /// May a name be looked up under this layer? `none`: never; `public`:
    /// yes; `allowlist`: only a name an allow rule could match (`*` or a host
    /// name rule): any other could only yield addresses this layer denies, and
    /// asking the host's nameservers about it would carry the name off the host.
    pub fn may_resolve(&self, name: &str) -> bool {
        match self.mode {
            Mode::None => false,
            Mode::Public => true,
            Mode::Allowlist => self.allow.iter().any(|r| match &r.target {
                Target::Any => true,
                Target::Name(p) => p.matches(name),
                Target::Net(_) => false,
            }),
        }
    }

    /// Decide a connection to `ip:port` (`port: None` at resolver time).
    /// `names`: the host names the VMM's resolver handed this address out for.
    /// `host_addrs`: the host's own interface addresses.
    pub fn decide(&self, ip: IpAddr, port: Option<u16>, names: &[String], host_addrs: &[IpAddr]) -> Decision {
        if self.mode == Mode::None {
            return Decision::Deny(Reason::NetworkNone);
        }
        if let Some(r) = self.deny.iter().find(|r| r.matches(ip, port, names)) {
            return Decision::Deny(Reason::Rule(r.to_string()));
        }
        let class = classify(ip).or_else(|| {
            let v4 = canonical(ip).map(IpAddr::V4);
            host_addrs.iter().any(|h| *h == ip || Some(*h) == v4).then_some(Class::HostAddress)
        });
        for r in &self.allow {
            // A host-name rule (or `*`) never opens a non-public address; only an explicit CIDR/IP does.
            let opens_non_public = matches!(r.target, Target::Net(_));
            if r.matches(ip, port, names) && (class.is_none() || opens_non_public) {
                return Decision::Allow(Reason::Rule(r.to_string()));
            }
        }
        if let Some(c) = class {
            return Decision::Deny(Reason::Class(c));
        }
        match self.mode {
            Mode::Allowlist => Decision::Deny(Reason::NotAllowlisted),
            _ => Decision::Allow(Reason::Public),
        }
    }
}

/// Decide against layered policies (server, key, template, session): every
/// layer must allow, so an inner layer only ever narrows. The first denial
/// decides; otherwise the innermost layer's allowance is reported.
pub fn decide_layers(
    layers: &[Policy],
    ip: IpAddr,
    port: Option<u16>,
    names: &[String],
    host_addrs: &[IpAddr],
) -> Decision {
    let mut last = Decision::Deny(Reason::NetworkNone);
    for p in layers {
        let d = p.decide(ip, port, names, host_addrs);
        if !d.allowed() {
            return d;
        }
        last = d;
    }
    last
}

/// The host's own interface addresses (every address of every interface).
pub fn host_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned; ifa_addr may be null.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says its size.
            let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if fam == libc::AF_INET {
                // SAFETY: an AF_INET sockaddr is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            } else if fam == libc::AF_INET6 {
                // SAFETY: an AF_INET6 sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: head came from getifaddrs.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn rule(s: &str) -> Rule {
        s.parse().unwrap()
    }

    fn deny_class(p: &Policy, addr: &str) -> Option<Class> {
        match p.decide(ip(addr), Some(80), &[], &[]) {
            Decision::Deny(Reason::Class(c)) => Some(c),
            _ => None,
        }
    }

    #[test]
    fn default_public_denies_every_non_public_class() {
        let p = Policy::public();
        for (a, c) in [
            ("127.0.0.1", Class::Loopback),
            ("127.255.0.9", Class::Loopback),
            ("::1", Class::Loopback),
            ("10.1.2.3", Class::Private),
            ("172.16.0.1", Class::Private),
            ("172.31.255.255", Class::Private),
            ("192.168.1.1", Class::Private),
            ("fd12:3456::1", Class::Private),
            ("fc00::1", Class::Private),
            ("169.254.1.1", Class::LinkLocal),
            ("169.254.169.254", Class::Metadata),
            ("fd00:ec2::254", Class::Metadata),
            ("100.100.100.200", Class::Metadata),
            ("fe80::1", Class::LinkLocal),
            ("100.64.0.1", Class::Cgnat),
            ("100.127.255.254", Class::Cgnat),
            ("224.0.0.1", Class::Multicast),
            ("239.255.255.250", Class::Multicast),
            ("ff02::1", Class::Multicast),
            ("255.255.255.255", Class::Broadcast),
            ("0.0.0.0", Class::Unspecified),
            ("0.1.2.3", Class::Unspecified),
            ("::", Class::Unspecified),
            ("192.0.2.1", Class::Reserved),
            ("198.18.0.1", Class::Reserved),
            ("240.0.0.1", Class::Reserved),
            ("2001:db8::1", Class::Reserved),
            // IPv6 forms of IPv4 addresses take the IPv4 class.
            ("::ffff:127.0.0.1", Class::Loopback),
            ("::ffff:169.254.169.254", Class::Metadata),
            ("::ffff:10.0.0.1", Class::Private),
            ("::ffff:192.168.0.1", Class::Private),
            ("::ffff:100.64.1.1", Class::Cgnat),
            ("::ffff:0.0.0.0", Class::Unspecified),
            ("::127.0.0.1", Class::Loopback),
            ("64:ff9b::a9fe:a9fe", Class::Metadata),
            ("64:ff9b::7f00:1", Class::Loopback),
            ("2002:7f00:1::1", Class::Loopback),
            ("2002:c0a8:101::1", Class::Private),
            // SIIT's IPv4-translated form takes the embedded address's class.
            ("::ffff:0:7f00:1", Class::Loopback),
            ("::ffff:0:a9fe:a9fe", Class::Metadata),
            ("::ffff:0:a00:1", Class::Private),
            // Local-use NAT64: not public, whatever sits where.
            ("64:ff9b:1::808:808", Class::Private),
            ("64:ff9b:1:ffff::1", Class::Private),
            ("64:ff9b:1:0808:0800::", Class::Private),
        ] {
            assert_eq!(deny_class(&p, a), Some(c), "{a}");
        }
        for a in [
            "93.184.215.14",
            "1.1.1.1",
            "8.8.8.8",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "::ffff:0:808:808",
            "100.63.255.255",
            "172.32.0.1",
            "11.0.0.1",
        ] {
            assert_eq!(p.decide(ip(a), Some(443), &[], &[]), Decision::Allow(Reason::Public), "{a}");
        }
    }

    #[test]
    fn none_denies_even_allowlisted() {
        let p = Policy { mode: Mode::None, allow: vec![rule("127.0.0.1")], ..Policy::default() };
        assert_eq!(p.decide(ip("127.0.0.1"), Some(80), &[], &[]), Decision::Deny(Reason::NetworkNone));
        assert_eq!(p.decide(ip("1.1.1.1"), Some(80), &[], &[]), Decision::Deny(Reason::NetworkNone));
    }

    #[test]
    fn host_addresses_are_denied() {
        let p = Policy::public();
        let host = [ip("93.184.215.14"), ip("2606:4700::1")];
        assert_eq!(
            p.decide(ip("93.184.215.14"), Some(80), &[], &host),
            Decision::Deny(Reason::Class(Class::HostAddress))
        );
        assert_eq!(
            p.decide(ip("::ffff:93.184.215.14"), Some(80), &[], &host),
            Decision::Deny(Reason::Class(Class::HostAddress))
        );
        assert_eq!(
            p.decide(ip("2606:4700::1"), Some(80), &[], &host),
            Decision::Deny(Reason::Class(Class::HostAddress))
        );
        assert!(p.decide(ip("93.184.215.15"), Some(80), &[], &host).allowed());
        // The machine's real interfaces are listed (loopback at least).
        assert!(host_addresses().contains(&ip("127.0.0.1")));
    }

    #[test]
    fn explicit_cidr_opens_a_private_address_names_never_do() {
        let p = Policy {
            mode: Mode::Public,
            allow: vec![rule("10.200.0.0/24"), rule("127.0.0.1:8000-8100"), rule("*.test.example")],
            ..Policy::default()
        };
        assert!(p.decide(ip("10.200.0.2"), Some(80), &[], &[]).allowed());
        assert!(p.decide(ip("::ffff:10.200.0.2"), Some(80), &[], &[]).allowed(), "mapped form of an allowed address");
        assert!(!p.decide(ip("10.200.1.2"), Some(80), &[], &[]).allowed());
        assert!(p.decide(ip("127.0.0.1"), Some(8080), &[], &[]).allowed());
        assert_eq!(p.decide(ip("127.0.0.1"), Some(22), &[], &[]), Decision::Deny(Reason::Class(Class::Loopback)));
        // DNS rebinding: a matching name resolving to a non-public address stays denied.
        let names = vec!["evil.test.example".to_string()];
        assert_eq!(
            p.decide(ip("169.254.169.254"), Some(80), &names, &[]),
            Decision::Deny(Reason::Class(Class::Metadata))
        );
        // Even the explicitly allowed 127.0.0.1 host is open on its ports only; other loopback hosts are not.
        assert!(!p.decide(ip("127.0.0.2"), Some(8080), &names, &[]).allowed());
    }

    #[test]
    fn allowlist_by_name_and_port() {
        let p = Policy::allowlist(vec![rule("*.example.org:443"), rule("api.example.com"), rule("203.0.113.9")]);
        let names = |n: &str| vec![n.to_string()];
        let public = ip("93.184.215.14");
        assert!(p.decide(public, Some(443), &names("www.example.org"), &[]).allowed());
        assert!(p.decide(public, Some(443), &names("A.B.EXAMPLE.ORG."), &[]).allowed(), "case and trailing dot");
        assert!(!p.decide(public, Some(443), &names("example.org"), &[]).allowed(), "*.x does not match x itself");
        assert!(!p.decide(public, Some(443), &names("badexample.org"), &[]).allowed());
        assert!(!p.decide(public, Some(80), &names("www.example.org"), &[]).allowed(), "port rule");
        assert!(p.decide(public, None, &names("www.example.org"), &[]).allowed(), "resolver time: port unknown");
        assert!(p.decide(public, Some(8443), &names("api.example.com"), &[]).allowed());
        assert_eq!(p.decide(public, Some(443), &[], &[]), Decision::Deny(Reason::NotAllowlisted));
        assert!(p.decide(ip("203.0.113.9"), Some(1), &[], &[]).allowed(), "an explicit address opens a reserved one");
    }

    #[test]
    fn deny_rules_win() {
        let p = Policy {
            mode: Mode::Public,
            allow: vec![rule("10.0.0.0/8")],
            deny: vec![rule("10.9.0.0/16"), rule("*:25"), rule("*.bad.example")],
            max_bytes_per_second: None,
        };
        assert!(p.decide(ip("10.1.0.1"), Some(80), &[], &[]).allowed());
        assert_eq!(p.decide(ip("10.9.0.1"), Some(80), &[], &[]), Decision::Deny(Reason::Rule("10.9.0.0/16".into())));
        assert_eq!(p.decide(ip("8.8.8.8"), Some(25), &[], &[]), Decision::Deny(Reason::Rule("*:25".into())));
        assert!(p.decide(ip("8.8.8.8"), Some(26), &[], &[]).allowed());
        assert!(!p.decide(ip("8.8.8.8"), Some(443), &["x.bad.example".into()], &[]).allowed());
    }

    #[test]
    fn rule_text_round_trips_and_rejects_garbage() {
        for s in [
            "10.0.0.0/8",
            "192.168.1.7",
            "fd00::/8",
            "[::1]:8080",
            "example.com",
            "*.example.com:443",
            "*:25",
            "10.1.2.3:8000-8100",
            "::1",
            "*",
        ] {
            assert_eq!(rule(s).to_string(), s, "{s}");
        }
        assert_eq!(rule("10.1.2.3/8").to_string(), "10.0.0.0/8", "host bits truncated");
        assert_eq!(rule("Example.COM.").to_string(), "example.com");
        for bad in [
            "",
            "10.0.0.0/33",
            "1.2.3.4:0x50",
            "1.2.3.4:90-80",
            "[::1",
            "[::1]8080",
            "a..b",
            "-",
            "300.1.1.1",
            "ex ample.com",
            "1.2.3.4:70000",
        ] {
            assert!(bad.parse::<Rule>().is_err(), "{bad:?} parsed");
        }
        let p: Policy =
            serde_json::from_str(r#"{"mode":"allowlist","allow":["*.example.com:443","10.0.0.0/8"]}"#).unwrap();
        assert_eq!(p.allow.len(), 2);
        assert!(serde_json::from_str::<Policy>(r#"{"mode":"allowlist","allow":["nope nope"]}"#).is_err());
    }

    #[test]
    fn layers_only_narrow() {
        let server = Policy::public();
        let key = Policy::allowlist(vec![rule("*.example.com")]);
        let session = Policy::allowlist(vec![rule("10.0.0.0/8"), rule("api.example.com")]);
        let names = vec!["api.example.com".to_string()];
        let public = ip("93.184.215.14");
        assert!(
            decide_layers(&[server.clone(), key.clone(), session.clone()], public, Some(443), &names, &[]).allowed()
        );
        assert!(!decide_layers(
            &[server.clone(), key.clone(), session.clone()],
            public,
            Some(443),
            &["www.example.com".into()],
            &[]
        )
        .allowed());
        // The session's 10/8 does not widen what the key allows.
        assert!(!decide_layers(&[server.clone(), key, session], ip("10.0.0.1"), Some(80), &[], &[]).allowed());
        assert!(!decide_layers(&[server.clone(), Policy::none()], public, Some(80), &[], &[]).allowed());
        assert!(!decide_layers(&[], public, Some(80), &[], &[]).allowed(), "no layers: no network");
        assert!(decide_layers(&[server], public, Some(80), &[], &[]).allowed());
    }
}
