//! Secrets substituted at the egress boundary. A sandbox only ever holds a
//! placeholder (an opaque `fbx_secret_<hex>` token in an environment
//! variable); a TCP connection to a destination one of its secrets is bound
//! to (a host name the sandbox's resolver handed the address out for, and a
//! port) is relayed by this process, which replaces the placeholder by the
//! real value in HTTP/1.x request header values on the way out. Anywhere
//! else the placeholder goes out as it is.
//!
//! The values are sealed (AES-256-GCM, the name and placeholder as
//! associated data) with the server's key ([`install_key`]) as soon as they
//! are accepted; a [`SealedSecret`] is what the configuration, the session
//! record and the database hold. A value is opened only for a connection
//! that needs it, in the relay's thread.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use socket2::Socket;

use super::host_errno;
use super::host_socket::{Opened, Verdict};
use super::policy::NamePattern;
use super::rewrite::Rewriter;
use crate::errno::Errno;

/// What every placeholder starts with.
pub const PLACEHOLDER_PREFIX: &str = "fbx_secret_";
/// Secrets one sandbox may carry.
pub const SECRETS_MAX: usize = 16;
/// Longest secret value (bytes).
pub const VALUE_MAX: usize = 8192;
/// Longest secret name.
pub const NAME_MAX: usize = 64;
/// Host patterns one secret may name.
pub const HOSTS_MAX: usize = 32;
/// A relayed connection with no byte either way for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the relay waits for the real destination to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Relayed connections of this process at once.
const RELAYS_MAX: usize = 1024;
/// Read size of a relay direction.
const CHUNK: usize = 16 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("secrets: {0}")]
    Invalid(String),
    #[error("secrets need the server's sealing key, and none is installed")]
    NoKey,
    #[error("a sealed secret could not be opened (another server key?)")]
    Unseal,
}

/// A secret as it is stored and configured: its value sealed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedSecret {
    /// The environment variable the sandbox finds the placeholder in.
    pub name: String,
    pub placeholder: String,
    /// Host name patterns (`api.example.com`, `*.example.org`).
    pub hosts: Vec<String>,
    /// Ports (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Base64 of nonce and ciphertext.
    pub sealed: String,
    /// Also substituted in HTTPS to these hosts: the relay terminates the
    /// guest's TLS when its SNI is one of `hosts` (see [`super::tls`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
}

impl std::fmt::Debug for SealedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedSecret")
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .field("ports", &self.ports)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// A secret as it may be shown: its name and destinations, never its value
/// or its sealed form (the API's wire type, shown as it is).
pub use forkbox_api::wire::sessions::SecretInfo;

impl SealedSecret {
    /// What may be shown of it.
    pub fn info(&self) -> SecretInfo {
        SecretInfo { name: self.name.clone(), hosts: self.hosts.clone(), ports: self.ports.clone(), tls: self.tls }
    }
}

fn pattern(p: &str) -> Result<NamePattern, SecretError> {
    let bad = || SecretError::Invalid(format!("host {p:?} is not a host name or *.name pattern"));
    match p.parse::<super::policy::Rule>() {
        Ok(super::policy::Rule { target: super::policy::Target::Name(n), ports: None }) => Ok(n),
        _ => Err(bad()),
    }
}

impl SealedSecret {
    /// Bound to a connection to `port` of an address handed out for `names`.
    pub fn applies(&self, names: &[String], port: u16) -> bool {
        (self.ports.is_empty() || self.ports.contains(&port))
            && self.hosts.iter().filter_map(|h| pattern(h).ok()).any(|p| names.iter().any(|n| p.matches(n)))
    }

    /// One of its host patterns matches `sni` (a TLS ClientHello's server name).
    pub fn names_host(&self, sni: &str) -> bool {
        self.hosts.iter().filter_map(|h| pattern(h).ok()).any(|p| p.matches(sni))
    }
}

/// An environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, at most [`NAME_MAX`].
fn check_name(name: &str) -> Result<(), SecretError> {
    let ok = !name.is_empty()
        && name.len() <= NAME_MAX
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(SecretError::Invalid(format!(
            "name {name:?} is not an environment variable name (letters, digits, '_', not starting with a digit, at most {NAME_MAX})"
        )))
    }
}

/// The server's sealing key.
pub struct SealKey(LessSafeKey);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey")
    }
}

impl SealKey {
    pub fn from_bytes(bytes: &[u8; 32]) -> SealKey {
        // AES_256_GCM takes exactly 32 bytes: cannot fail.
        let k = UnboundKey::new(&AES_256_GCM, bytes).unwrap_or_else(|_| unreachable!());
        SealKey(LessSafeKey::new(k))
    }

    /// 64 hex digits.
    pub fn from_hex(text: &str) -> Option<SealKey> {
        let mut b = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut b).ok()?;
        Some(SealKey::from_bytes(&b))
    }

    /// The key in `path` (64 hex digits), made (random, mode 0600) if it is not there.
    pub fn load_or_create(path: &std::path::Path) -> std::io::Result<SealKey> {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::read_to_string(path) {
            Ok(t) => SealKey::from_hex(&t)
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not 64 hex digits")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut b = [0u8; 32];
                SystemRandom::new().fill(&mut b).map_err(|_| std::io::Error::other("no randomness"))?;
                let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
                f.write_all(hex::encode(b).as_bytes())?;
                f.sync_all()?;
                Ok(SealKey::from_bytes(&b))
            }
            Err(e) => Err(e),
        }
    }

    fn aad(name: &str, placeholder: &str) -> Vec<u8> {
        [name.as_bytes(), b"\0", placeholder.as_bytes()].concat()
    }

    /// Seal `value` for the secret `name` with `placeholder`.
    pub fn seal(&self, name: &str, placeholder: &str, value: &[u8]) -> Result<String, SecretError> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new().fill(&mut nonce).map_err(|_| SecretError::Unseal)?;
        let mut data = value.to_vec();
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(Self::aad(name, placeholder)),
                &mut data,
            )
            .map_err(|_| SecretError::Unseal)?;
        let out = [&nonce[..], &data].concat();
        data.fill(0);
        Ok(base64::engine::general_purpose::STANDARD.encode(out))
    }

    /// The value of a sealed secret.
    pub fn open(&self, s: &SealedSecret) -> Result<Vec<u8>, SecretError> {
        let raw = base64::engine::general_purpose::STANDARD.decode(&s.sealed).map_err(|_| SecretError::Unseal)?;
        if raw.len() < NONCE_LEN {
            return Err(SecretError::Unseal);
        }
        let (n, ct) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(n).map_err(|_| SecretError::Unseal)?;
        let mut data = ct.to_vec();
        let plain = self
            .0
            .open_in_place(nonce, Aad::from(Self::aad(&s.name, &s.placeholder)), &mut data)
            .map_err(|_| SecretError::Unseal)?;
        Ok(plain.to_vec())
    }
}

static KEY: OnceLock<SealKey> = OnceLock::new();

/// Install this process' sealing key (the first one installed stays).
pub fn install_key(k: SealKey) {
    let _ = KEY.set(k);
}

pub fn key() -> Option<&'static SealKey> {
    KEY.get()
}

/// A new placeholder: the prefix and 128 random bits in hex.
pub fn placeholder() -> Result<String, SecretError> {
    let mut b = [0u8; 16];
    SystemRandom::new().fill(&mut b).map_err(|_| SecretError::NoKey)?;
    Ok(format!("{PLACEHOLDER_PREFIX}{}", hex::encode(b)))
}

/// Validate and seal one secret of a request with the installed key.
pub fn seal_new(
    name: &str,
    value: &str,
    hosts: &[String],
    ports: &[u16],
    tls: bool,
) -> Result<SealedSecret, SecretError> {
    check_name(name)?;
    let invalid = |m: String| Err(SecretError::Invalid(format!("{name}: {m}")));
    if value.is_empty() || value.len() > VALUE_MAX {
        return invalid(format!("the value must be 1 to {VALUE_MAX} bytes"));
    }
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return invalid("the value goes into HTTP headers: no CR, LF or NUL".into());
    }
    if hosts.is_empty() || hosts.len() > HOSTS_MAX {
        return invalid(format!("hosts must name 1 to {HOSTS_MAX} host names"));
    }
    for h in hosts {
        pattern(h)
            .map_err(|e| SecretError::Invalid(format!("{name}: {}", e.to_string().trim_start_matches("secrets: "))))?;
    }
    if ports.len() > 64 || ports.contains(&0) {
        return invalid("ports: at most 64, each 1 to 65535".into());
    }
    if tls && super::tls::ca().is_none() {
        return invalid("tls: this server has no egress CA".into());
    }
    let key = key().ok_or(SecretError::NoKey)?;
    let placeholder = placeholder()?;
    let sealed = key.seal(name, &placeholder, value.as_bytes())?;
    Ok(SealedSecret {
        name: name.to_string(),
        placeholder,
        hosts: hosts.iter().map(|h| super::policy::normalize_name(h)).collect(),
        ports: ports.to_vec(),
        sealed,
        tls,
    })
}

/// The secrets a sandbox gets from its layers, outermost first (an API
/// key's, then its template's, then its session's): a secret of a later
/// layer replaces one of the same name of an earlier layer, so the session
/// wins over the template and the template over the key. Sorted by name.
pub fn merge(layers: &[&[SealedSecret]]) -> Vec<SealedSecret> {
    let mut by_name = std::collections::BTreeMap::new();
    for s in layers.iter().flat_map(|l| l.iter()) {
        by_name.insert(s.name.as_str(), s);
    }
    by_name.into_values().cloned().collect()
}

/// The guest's trust for sessions with a TLS secret: its system roots and
/// the server's egress CA, written here by [`env_prelude`].
pub const CA_BUNDLE_PATH: &str = "/etc/ssl/forkbox-ca-bundle.pem";
/// The system roots of the guest image.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Python that sets each secret's variable to its placeholder in the guest;
/// with a TLS secret it also writes [`CA_BUNDLE_PATH`] and points
/// `SSL_CERT_FILE` (OpenSSL, so Python's `ssl` and `urllib`),
/// `REQUESTS_CA_BUNDLE` (requests) and `CURL_CA_BUNDLE` at it.
pub fn env_prelude(secrets: &[SealedSecret]) -> Option<String> {
    if secrets.is_empty() {
        return None;
    }
    // Names are identifiers and placeholders [a-z0-9_]: plain literals.
    let pairs: Vec<String> = secrets.iter().map(|s| format!("{:?}: {:?}", s.name, s.placeholder)).collect();
    let mut code = format!("import os as _fbx_os\n_fbx_os.environ.update({{{}}})\n", pairs.join(", "));
    if let Some(ca) = secrets.iter().any(|s| s.tls).then(super::tls::ca).flatten() {
        // The CA's PEM is base64 lines and dashes: a plain literal too.
        code.push_str(&format!(
            "try:\n    with open({SYSTEM_ROOTS:?}) as _fbx_f:\n        _fbx_roots = _fbx_f.read()\n\
             except OSError:\n    _fbx_roots = ''\n\
             with open({CA_BUNDLE_PATH:?}, 'w') as _fbx_f:\n    _fbx_f.write(_fbx_roots.rstrip('\\n') + '\\n' + {:?})\n\
             _fbx_os.environ.update({{'SSL_CERT_FILE': {p:?}, 'REQUESTS_CA_BUNDLE': {p:?}, 'CURL_CA_BUNDLE': {p:?}}})\n\
             del _fbx_f, _fbx_roots\n",
            ca.cert_pem(),
            p = CA_BUNDLE_PATH,
        ));
    }
    code.push_str("del _fbx_os\n");
    Some(code)
}

static RELAYS: AtomicUsize = AtomicUsize::new(0);

struct RelaySlot;

impl Drop for RelaySlot {
    fn drop(&mut self) {
        RELAYS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A secret bound to a relayed connection, its value opened.
struct Applied<'a> {
    secret: &'a SealedSecret,
    value: Vec<u8>,
}

impl Drop for Applied<'_> {
    fn drop(&mut self) {
        self.value.fill(0);
    }
}

impl Applied<'_> {
    fn pair(&self) -> (Vec<u8>, Vec<u8>) {
        (self.secret.placeholder.clone().into_bytes(), self.value.clone())
    }
}

/// The secrets of `config_secrets` bound to a connection to `dest` whose
/// address was handed out for `verdict.names`, their values opened.
/// Empty: no secret applies (the connection goes out directly). A secret
/// whose value cannot be opened is left out (its placeholder goes out as it is).
fn substitutions<'a>(secrets: &'a [SealedSecret], verdict: &Verdict, dest: SocketAddr) -> Vec<Applied<'a>> {
    let applying: Vec<&SealedSecret> = secrets.iter().filter(|s| s.applies(&verdict.names, dest.port())).collect();
    if applying.is_empty() {
        return Vec::new();
    }
    let Some(key) = key() else {
        tracing::warn!("secrets apply to a connection but no sealing key is installed: sent without substitution");
        return Vec::new();
    };
    applying
        .into_iter()
        .filter_map(|s| match key.open(s) {
            Ok(value) => Some(Applied { secret: s, value }),
            Err(_) => {
                tracing::warn!(secret = %s.name, "a secret could not be opened: sent without substitution");
                None
            }
        })
        .collect()
}

/// A TCP connection to `dest` for a sandbox: straight to the host when no
/// secret of `secrets` applies (the fast path, unchanged), else one end of
/// a loopback TCP pair whose other end a relay of this process serves,
/// substituting the secrets on the way to `dest`.
pub fn open_tcp(secrets: &[SealedSecret], verdict: &Verdict, domain: i32, dest: SocketAddr) -> Result<Opened, Errno> {
    let applied = if secrets.is_empty() { Vec::new() } else { substitutions(secrets, verdict, dest) };
    if applied.is_empty() {
        return super::host_socket::open_tcp(domain, dest);
    }
    let plan = Plan::new(&applied);
    if RELAYS.fetch_add(1, Ordering::Relaxed) >= RELAYS_MAX {
        RELAYS.fetch_sub(1, Ordering::Relaxed);
        return Err(Errno::EAGAIN);
    }
    let slot = RelaySlot;
    let io = |e: std::io::Error| host_errno(&e);
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io)?;
    let inner = TcpStream::connect(listener.local_addr().map_err(io)?).map_err(io)?;
    let (outer, _) = listener.accept().map_err(io)?;
    drop(listener);
    // Both ends: a relay writes what it has as it has it (TLS records, a head
    // then a body); Nagle against the guest's delayed ACKs would add 40 ms.
    let _ = inner.set_nodelay(true);
    let _ = outer.set_nodelay(true);
    inner.set_nonblocking(true).map_err(io)?;
    std::thread::Builder::new()
        .name("forkbox-secret-relay".into())
        .spawn(move || {
            let _slot = slot;
            relay(outer, dest, plan);
        })
        .map_err(|_| Errno::EAGAIN)?;
    Ok(Opened { socket: Socket::from(inner), connected: true })
}

/// A placeholder and its value.
type Sub = (Vec<u8>, Vec<u8>);

/// What a relay substitutes: in plain HTTP every applying secret; in TLS
/// it terminates, the TLS secrets whose hosts name the SNI.
struct Plan {
    plain: Vec<(Vec<u8>, Vec<u8>)>,
    /// The TLS secrets (their hosts) and their (placeholder, value).
    tls: Vec<(SealedSecret, Sub)>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        for (_, v) in self.plain.iter_mut().chain(self.tls.iter_mut().map(|(_, p)| p)) {
            v.fill(0);
        }
    }
}

impl Plan {
    fn new(applied: &[Applied<'_>]) -> Plan {
        let tls = if super::tls::ca().is_some() {
            applied
                .iter()
                .filter(|a| a.secret.tls)
                .map(|a| (SealedSecret { sealed: String::new(), ..a.secret.clone() }, a.pair()))
                .collect()
        } else {
            Vec::new()
        };
        Plan { plain: applied.iter().map(Applied::pair).collect(), tls }
    }

    /// The substitutions for a TLS connection to `sni`: empty, do not terminate.
    fn for_sni(&self, sni: Option<&str>) -> Vec<(Vec<u8>, Vec<u8>)> {
        let Some(sni) = sni else { return Vec::new() };
        self.tls.iter().filter(|(s, _)| s.names_host(sni)).map(|(_, p)| p.clone()).collect()
    }
}

/// Serve one relayed connection: connect to `dest`; when a TLS secret
/// applies and the guest opens with a ClientHello for one of its hosts,
/// terminate ([`super::tls::terminate`]); else copy both ways (the guest's
/// side through the rewriter, or untouched after a ClientHello) until either
/// side ends or is idle.
fn relay(guest: TcpStream, dest: SocketAddr, mut plan: Plan) {
    let Ok(host) = TcpStream::connect_timeout(&dest, CONNECT_TIMEOUT) else {
        // The guest sees its connection reset.
        let _ = guest.shutdown(std::net::Shutdown::Both);
        return;
    };
    let _ = host.set_nodelay(true);
    let mut rw = Rewriter::new(std::mem::take(&mut plan.plain));
    if !plan.tls.is_empty() {
        match super::tls::read_hello(&guest) {
            hello @ super::tls::Hello::Tls { .. } => {
                let subs = plan.for_sni(hello.sni().as_deref());
                let super::tls::Hello::Tls { accepted, raw } = hello else { return };
                if !subs.is_empty() {
                    let sni = accepted.client_hello().server_name().unwrap_or_default().to_string();
                    drop(plan);
                    drop(rw);
                    super::tls::terminate(guest, host, accepted, &sni, Rewriter::new(subs));
                    return;
                }
                // TLS to a host no TLS secret names: its bytes pass untouched.
                if (&host).write_all(&raw).is_err() {
                    return;
                }
                rw = Rewriter::new(Vec::new());
            }
            super::tls::Hello::Other(raw) => {
                // Not TLS (or not a ClientHello that parsed): what was read goes through the rewriter.
                let mut out = Vec::new();
                rw.feed(&raw, &mut out);
                if (&host).write_all(&out).is_err() {
                    return;
                }
            }
        }
    }
    drop(plan);
    for s in [&guest, &host] {
        let _ = s.set_read_timeout(Some(IDLE_TIMEOUT));
        let _ = s.set_write_timeout(Some(IDLE_TIMEOUT));
    }
    let (Ok(guest2), Ok(host2)) = (guest.try_clone(), host.try_clone()) else { return };
    let back = std::thread::Builder::new().name("forkbox-secret-relay".into()).spawn(move || {
        copy(&host2, &guest2, |b, out| out.extend_from_slice(b));
    });
    copy(&guest, &host, |b, out| rw.feed(b, out));
    drop(rw);
    if let Ok(b) = back {
        let _ = b.join();
    }
}

/// Copy `from` to `to` through `f` until EOF, an error or the idle timeout;
/// then end `to`'s writing and `from`'s reading.
fn copy(mut from: &TcpStream, mut to: &TcpStream, mut f: impl FnMut(&[u8], &mut Vec<u8>)) {
    let mut buf = vec![0u8; CHUNK];
    let mut out = Vec::with_capacity(CHUNK);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        out.clear();
        f(&buf[..n], &mut out);
        if to.write_all(&out).is_err() {
            break;
        }
    }
    out.fill(0);
    let _ = to.shutdown(std::net::Shutdown::Write);
    let _ = from.shutdown(std::net::Shutdown::Read);
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "fbx_secret_00112233445566778899aabbccddeeff";

    fn sealed(name: &str, tag: &str) -> SealedSecret {
        SealedSecret {
            name: name.into(),
            placeholder: format!("{PLACEHOLDER_PREFIX}{tag}"),
            hosts: vec![format!("{tag}.example")],
            ports: Vec::new(),
            sealed: String::new(),
            tls: false,
        }
    }

    #[test]
    fn later_layers_win_by_name() {
        let key = [sealed("A", "key"), sealed("B", "key"), sealed("K", "key")];
        let template = [sealed("B", "template"), sealed("C", "template")];
        let session = [sealed("C", "session"), sealed("A", "session")];
        let got = merge(&[&key, &template, &session]);
        let names: Vec<_> = got.iter().map(|s| (s.name.as_str(), s.placeholder.as_str())).collect();
        assert_eq!(
            names,
            [
                ("A", "fbx_secret_session"),
                ("B", "fbx_secret_template"),
                ("C", "fbx_secret_session"),
                ("K", "fbx_secret_key")
            ]
        );
        assert_eq!(merge(&[&key, &[], &[]]), merge(&[&key]));
        assert!(merge(&[&[], &[]]).is_empty());
    }

    #[test]
    fn seal_round_trip_and_tamper() {
        let k = SealKey::from_bytes(&[7u8; 32]);
        let s = SealedSecret {
            name: "API_KEY".into(),
            placeholder: P.into(),
            hosts: vec!["api.example.com".into()],
            ports: vec![],
            sealed: k.seal("API_KEY", P, b"sk-REAL").unwrap(),
            tls: false,
        };
        assert!(!s.sealed.contains("sk-REAL"));
        assert_eq!(k.open(&s).unwrap(), b"sk-REAL");
        // Two seals of one value differ (random nonce).
        assert_ne!(k.seal("API_KEY", P, b"sk-REAL").unwrap(), s.sealed);
        // Another key, another name (associated data) or a flipped byte: refused.
        assert_eq!(SealKey::from_bytes(&[8u8; 32]).open(&s), Err(SecretError::Unseal));
        assert_eq!(k.open(&SealedSecret { name: "OTHER".into(), ..s.clone() }), Err(SecretError::Unseal));
        let mut raw = base64::engine::general_purpose::STANDARD.decode(&s.sealed).unwrap();
        raw[NONCE_LEN] ^= 1;
        let flipped = base64::engine::general_purpose::STANDARD.encode(raw);
        assert_eq!(k.open(&SealedSecret { sealed: flipped, ..s.clone() }), Err(SecretError::Unseal));
        assert!(!format!("{s:?}").contains(&s.sealed));
    }

    #[test]
    fn key_file_is_made_0600_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secrets.key");
        let a = SealKey::load_or_create(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let b = SealKey::load_or_create(&p).unwrap();
        let sealed = a.seal("N", P, b"v").unwrap();
        let s =
            SealedSecret { name: "N".into(), placeholder: P.into(), hosts: vec![], ports: vec![], sealed, tls: false };
        assert_eq!(b.open(&s).unwrap(), b"v");
    }

    #[test]
    fn binding_by_name_pattern_and_port() {
        let s = SealedSecret {
            name: "K".into(),
            placeholder: P.into(),
            hosts: vec!["api.example.com".into(), "*.example.org".into()],
            ports: vec![443],
            sealed: String::new(),
            tls: true,
        };
        let n = |v: &str| vec![v.to_string()];
        assert!(s.applies(&n("api.example.com"), 443));
        assert!(s.applies(&n("x.example.org"), 443));
        assert!(!s.applies(&n("example.org"), 443));
        assert!(!s.applies(&n("api.example.com"), 80));
        assert!(!s.applies(&[], 443));
        assert!(s.applies(&n("API.example.com."), 443));
        // SNI matching: the same patterns.
        assert!(s.names_host("api.example.com"));
        assert!(s.names_host("deep.x.example.org"));
        assert!(!s.names_host("example.org"));
        assert!(!s.names_host("api.example.com.evil.test"));
        assert!(!s.names_host("evil.test"));
    }

    #[test]
    fn plan_terminates_only_for_sni_named_by_a_tls_secret() {
        let mk = |name: &str, hosts: &[&str], tls: bool| SealedSecret {
            name: name.into(),
            placeholder: format!("{PLACEHOLDER_PREFIX}{name}"),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ports: vec![],
            sealed: String::new(),
            tls,
        };
        let a = mk("A", &["api.example.com"], true);
        let b = mk("B", &["*.example.org"], true);
        let c = mk("C", &["plain.example.net"], false);
        let plan = Plan {
            plain: vec![],
            tls: [&a, &b].iter().map(|s| ((*s).clone(), (s.placeholder.clone().into_bytes(), b"v".to_vec()))).collect(),
        };
        let names = |subs: Vec<(Vec<u8>, Vec<u8>)>| -> Vec<String> {
            subs.into_iter().map(|(p, _)| String::from_utf8(p).unwrap()).collect()
        };
        assert_eq!(names(plan.for_sni(Some("api.example.com"))), vec![a.placeholder.clone()]);
        assert_eq!(names(plan.for_sni(Some("x.example.org"))), vec![b.placeholder.clone()]);
        assert!(plan.for_sni(Some("plain.example.net")).is_empty());
        assert!(plan.for_sni(Some("evil.test")).is_empty());
        assert!(plan.for_sni(None).is_empty());
        let _ = c;
    }
}
