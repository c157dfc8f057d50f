//! TLS termination for secrets marked `tls`: the secrets relay
//! ([`super::secrets`]) reads the guest's ClientHello, and when its SNI is a
//! host a TLS secret of the connection names, answers with a leaf for that
//! name signed by this server's egress CA ([`EgressCa`], which sandboxes of
//! such sessions trust), opens TLS to the real server (verified against the
//! host's roots and any `--egress-ca-file` roots), and relays the decrypted
//! stream through the same header rewriter as plain HTTP. Any other
//! ClientHello passes through untouched: the relay never terminates TLS for
//! a host no TLS secret of the sandbox names.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::server::{Accepted, Acceptor};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

use super::rewrite::Rewriter;

/// Longest ClientHello the relay reads before giving up on terminating (the
/// bytes then pass through as they came).
pub const HELLO_MAX: usize = 64 * 1024;
/// How long the guest's ClientHello and both handshakes may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Leaf certificates kept (one per SNI name).
pub const LEAVES_MAX: usize = 256;
/// A cached leaf is made anew after this long (it is valid for a week).
const LEAF_REUSE: Duration = Duration::from_secs(24 * 3600);
const LEAF_VALID_DAYS: i64 = 7;
/// A relayed connection with no byte either way for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
const CHUNK: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("egress CA: {0}")]
    Ca(String),
    #[error("egress CA files: {0}")]
    Io(#[from] std::io::Error),
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The server's egress CA: signs a leaf for each name the relay terminates
/// TLS for. Its key is a server secret (the data directory's
/// `egress-ca.key`, mode 0600); its certificate is public and goes into the
/// trust of the sandboxes of sessions with TLS secrets.
pub struct EgressCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    leaves: Mutex<LeafCache>,
}

impl std::fmt::Debug for EgressCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EgressCa")
    }
}

impl EgressCa {
    /// A CA from its certificate and private key (PEM).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<EgressCa, TlsError> {
        let key = KeyPair::from_pem(key_pem).map_err(|_| TlsError::Ca("the key is not a PEM private key".into()))?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|_| TlsError::Ca("the certificate is not a PEM certificate".into()))?;
        if rcgen::PublicKeyData::subject_public_key_info(&key) != spki_of(&cert_der)? {
            return Err(TlsError::Ca("the key does not belong to the certificate".into()));
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)?;
        Ok(EgressCa {
            issuer,
            cert_pem: cert_pem.to_string(),
            cert_der: cert_der.into_owned(),
            leaves: Mutex::new(LeafCache::new(LEAVES_MAX, LEAF_REUSE)),
        })
    }

    /// A new CA (key and certificate PEM).
    pub fn generate() -> Result<(String, String), TlsError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "forkbox");
        let mut id = [0u8; 4];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id)
            .map_err(|_| TlsError::Ca("no randomness".into()))?;
        dn.push(DnType::CommonName, format!("forkbox egress CA {}", hex::encode(id)));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(3650);
        let cert = params.self_signed(&key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// The CA in `cert` and `key`, made (key mode 0600, certificate 0644) if neither is there.
    pub fn load_or_create(cert: &Path, key: &Path) -> Result<EgressCa, TlsError> {
        use std::os::unix::fs::OpenOptionsExt;
        match (std::fs::read_to_string(cert), std::fs::read_to_string(key)) {
            (Ok(c), Ok(k)) => EgressCa::from_pem(&c, &k),
            (Err(a), Err(b))
                if a.kind() == std::io::ErrorKind::NotFound && b.kind() == std::io::ErrorKind::NotFound =>
            {
                let (c, k) = EgressCa::generate()?;
                let write = |p: &Path, text: &str, mode: u32| -> std::io::Result<()> {
                    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(p)?;
                    f.write_all(text.as_bytes())?;
                    f.sync_all()
                };
                write(key, &k, 0o600)?;
                write(cert, &c, 0o644)?;
                EgressCa::from_pem(&c, &k)
            }
            (Err(e), _) | (_, Err(e)) => Err(TlsError::Io(e)),
        }
    }

    /// The CA certificate (PEM), what sandboxes trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A new leaf for `name` signed by this CA, as a server configuration
    /// offering http/1.1 only.
    fn make_leaf(&self, name: &str) -> Result<Arc<ServerConfig>, TlsError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(LEAF_VALID_DAYS);
        let leaf = params.signed_by(&key, &self.issuer)?;
        let chain = vec![leaf.der().clone(), self.cert_der.clone()];
        let pk = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, pk)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The server configuration for SNI `name` (cached).
    pub fn leaf(&self, name: &str) -> Result<Arc<ServerConfig>, TlsError> {
        let name = super::policy::normalize_name(name);
        let mut cache = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        cache.get_or_make(&name, || self.make_leaf(&name))
    }
}

/// The SubjectPublicKeyInfo of a DER certificate.
fn spki_of(cert: &CertificateDer<'_>) -> Result<Vec<u8>, TlsError> {
    let bad = || TlsError::Ca("the certificate does not parse".into());
    let (_, c) = x509_parser::parse_x509_certificate(cert).map_err(|_| bad())?;
    Ok(c.tbs_certificate.subject_pki.raw.to_vec())
}

/// Server configurations by SNI name: at most `max`, the oldest made goes
/// first; one older than `reuse` is made anew.
pub struct LeafCache {
    max: usize,
    reuse: Duration,
    map: HashMap<String, (Instant, Arc<ServerConfig>)>,
    order: VecDeque<String>,
}

impl LeafCache {
    pub fn new(max: usize, reuse: Duration) -> LeafCache {
        LeafCache { max: max.max(1), reuse, map: HashMap::new(), order: VecDeque::new() }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get_or_make(
        &mut self,
        name: &str,
        make: impl FnOnce() -> Result<Arc<ServerConfig>, TlsError>,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        if let Some((at, cfg)) = self.map.get(name) {
            if at.elapsed() < self.reuse {
                return Ok(Arc::clone(cfg));
            }
        }
        let cfg = make()?;
        if self.map.insert(name.to_string(), (Instant::now(), Arc::clone(&cfg))).is_some() {
            self.order.retain(|n| n != name);
        }
        self.order.push_back(name.to_string());
        while self.map.len() > self.max {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        Ok(cfg)
    }
}

static CA: OnceLock<EgressCa> = OnceLock::new();
static EXTRA_ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
static CLIENT: OnceLock<Option<Arc<ClientConfig>>> = OnceLock::new();

/// Install this process' egress CA (the first one installed stays).
pub fn install_ca(ca: EgressCa) {
    let _ = CA.set(ca);
}

pub fn ca() -> Option<&'static EgressCa> {
    CA.get()
}

/// Trust the certificates of `pem` too for the real servers the relay
/// connects to (`serve --egress-ca-file`): returns how many. Once per process, before any relay.
pub fn install_upstream_roots(pem: &[u8]) -> Result<usize, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|_| TlsError::Ca("the roots file is not PEM certificates".into()))?;
    if certs.is_empty() {
        return Err(TlsError::Ca("the roots file holds no certificate".into()));
    }
    let n = certs.len();
    let _ = EXTRA_ROOTS.set(certs);
    Ok(n)
}

/// How the relay connects to real servers: the host's roots and the installed extra ones.
fn client_config() -> Option<Arc<ClientConfig>> {
    CLIENT
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
            if let Some(extra) = EXTRA_ROOTS.get() {
                roots.add_parsable_certificates(extra.iter().cloned());
            }
            let cfg = ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions();
            match cfg {
                Ok(b) => {
                    let mut c = b.with_root_certificates(roots).with_no_client_auth();
                    c.alpn_protocols = vec![b"http/1.1".to_vec()];
                    Some(Arc::new(c))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no TLS client configuration for the secrets relay");
                    None
                }
            }
        })
        .clone()
}

/// What the guest opened its connection with.
pub enum Hello {
    /// A ClientHello, read whole (`raw`: its bytes as they came).
    Tls { accepted: Box<Accepted>, raw: Vec<u8> },
    /// Anything else, or a ClientHello that did not parse in time or size:
    /// the bytes read so far.
    Other(Vec<u8>),
}

impl Hello {
    pub fn sni(&self) -> Option<String> {
        match self {
            Hello::Tls { accepted, .. } => accepted.client_hello().server_name().map(str::to_string),
            Hello::Other(_) => None,
        }
    }
}

/// Read the guest's first bytes: a ClientHello if they start one. The guest
/// socket is blocking; reads wait at most [`HANDSHAKE_TIMEOUT`] in all.
pub fn read_hello(guest: &TcpStream) -> Hello {
    let mut first = [0u8; 1];
    let _ = guest.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    match guest.peek(&mut first) {
        // 22: a TLS handshake record.
        Ok(1) if first[0] == 22 => {}
        _ => return Hello::Other(Vec::new()),
    }
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let mut raw = Vec::new();
    let mut acceptor = Acceptor::default();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || raw.len() > HELLO_MAX {
            return Hello::Other(raw);
        }
        let _ = guest.set_read_timeout(Some(left));
        let mut tee = Tee { from: guest, raw: &mut raw };
        match acceptor.read_tls(&mut tee) {
            Ok(0) | Err(_) => return Hello::Other(raw),
            Ok(_) => {}
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => return Hello::Tls { accepted: Box::new(accepted), raw },
            Ok(None) => {}
            Err(_) => return Hello::Other(raw),
        }
    }
}

/// A reader that keeps a copy of what it read.
struct Tee<'a> {
    from: &'a TcpStream,
    raw: &'a mut Vec<u8>,
}

impl Read for Tee<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (&mut &*self.from).read(buf)?;
        self.raw.extend_from_slice(&buf[..n]);
        Ok(n)
    }
}

/// Terminate the guest's TLS (its ClientHello `accepted`, for `sni`) with
/// the CA's leaf, open TLS to `sni` over `host`, and relay the plaintext,
/// the guest's through `rw`, until both sides end, fail or are idle.
pub fn terminate(guest: TcpStream, host: TcpStream, accepted: Box<Accepted>, sni: &str, rw: Rewriter) {
    let (Some(ca), Some(client_cfg)) = (ca(), client_config()) else { return };
    let server_cfg = match ca.leaf(sni) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no leaf certificate for a TLS secret's host");
            return;
        }
    };
    let Ok(name) = ServerName::try_from(sni.to_string()) else { return };
    let server = match (*accepted).into_connection(server_cfg) {
        Ok(s) => s,
        Err((_, mut alert)) => {
            let _ = alert.write_all(&mut &guest);
            return;
        }
    };
    let Ok(client) = ClientConnection::new(client_cfg, name) else { return };
    let _ = guest.set_nonblocking(true);
    let _ = host.set_nonblocking(true);
    Pump { guest, host, server, client, rw }.run();
}

struct Pump {
    guest: TcpStream,
    host: TcpStream,
    server: ServerConnection,
    client: ClientConnection,
    rw: Rewriter,
}

/// One direction's state.
#[derive(Default)]
struct Dir {
    /// Plaintext read, not yet taken by the other side's connection.
    pending: Vec<u8>,
    /// The reading side ended (EOF, close_notify).
    eof: bool,
    /// The other side was told (close_notify and a write shutdown).
    closed: bool,
}

fn would_block(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted
}

/// Move plaintext into `conn`'s writer as far as it takes it.
fn push<D>(conn: &mut rustls::ConnectionCommon<D>, pending: &mut Vec<u8>) -> bool {
    if pending.is_empty() {
        return true;
    }
    match conn.writer().write(pending) {
        Ok(n) => {
            pending.drain(..n);
            true
        }
        Err(e) => would_block(&e),
    }
}

/// Write `conn`'s TLS records to `sock` until it would block. False: the socket failed.
fn flush<D>(conn: &mut rustls::ConnectionCommon<D>, sock: &TcpStream) -> bool {
    while conn.wants_write() {
        match conn.write_tls(&mut &*sock) {
            Ok(0) => return false,
            Ok(_) => {}
            Err(e) if would_block(&e) => return true,
            Err(_) => return false,
        }
    }
    true
}

/// Read TLS from `sock` into `conn` and its plaintext out through `f` into
/// `d.pending`. False: the connection failed.
fn pull<D>(
    conn: &mut rustls::ConnectionCommon<D>,
    sock: &TcpStream,
    d: &mut Dir,
    mut f: impl FnMut(&[u8], &mut Vec<u8>),
) -> bool {
    match conn.read_tls(&mut &*sock) {
        Ok(0) => d.eof = true,
        Ok(_) => {}
        Err(e) if would_block(&e) => return true,
        Err(_) => return false,
    }
    if conn.process_new_packets().is_err() {
        // The alert, if any, goes out before the relay ends.
        let _ = flush(conn, sock);
        return false;
    }
    let mut buf = [0u8; CHUNK];
    loop {
        match conn.reader().read(&mut buf) {
            Ok(0) => {
                d.eof = true;
                return true;
            }
            Ok(n) => f(&buf[..n], &mut d.pending),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            // EOF without close_notify: the end of the stream all the same.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                d.eof = true;
                return true;
            }
            Err(_) => return false,
        }
    }
}

impl Pump {
    fn run(mut self) {
        let started = Instant::now();
        // up: guest to host; down: host to guest.
        let mut up = Dir::default();
        let mut down = Dir::default();
        loop {
            if !push(&mut self.client, &mut up.pending) || !push(&mut self.server, &mut down.pending) {
                break;
            }
            for (d, is_up) in [(&mut up, true), (&mut down, false)] {
                if d.eof && d.pending.is_empty() && !d.closed {
                    d.closed = true;
                    if is_up {
                        self.client.send_close_notify();
                    } else {
                        self.server.send_close_notify();
                    }
                }
            }
            if !flush(&mut self.client, &self.host) || !flush(&mut self.server, &self.guest) {
                break;
            }
            if up.closed && !self.client.wants_write() {
                let _ = self.host.shutdown(std::net::Shutdown::Write);
            }
            if down.closed && !self.server.wants_write() {
                let _ = self.guest.shutdown(std::net::Shutdown::Write);
            }
            if up.closed && down.closed && !self.client.wants_write() && !self.server.wants_write() {
                break;
            }
            let handshaking = self.server.is_handshaking() || self.client.is_handshaking();
            let timeout = if handshaking {
                let left = HANDSHAKE_TIMEOUT.saturating_sub(started.elapsed());
                if left.is_zero() {
                    break;
                }
                left
            } else {
                IDLE_TIMEOUT
            };
            // Read a side only when what it sent before has been taken (bounded buffers).
            let ev = |read: bool, write: bool| {
                (if read { libc::POLLIN } else { 0 }) | (if write { libc::POLLOUT } else { 0 })
            };
            // A side nothing is wanted from is left out (fd -1): a hung-up socket would
            // otherwise report POLLHUP at once, round after round.
            let pfd = |sock: &TcpStream, events: libc::c_short| libc::pollfd {
                fd: if events == 0 { -1 } else { sock.as_raw_fd() },
                events,
                revents: 0,
            };
            let mut fds = [
                pfd(&self.guest, ev(!up.eof && up.pending.is_empty(), self.server.wants_write())),
                pfd(&self.host, ev(!down.eof && down.pending.is_empty(), self.client.wants_write())),
            ];
            let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
            // SAFETY: `fds` is a valid array of its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if n == 0 {
                break;
            }
            let bad = libc::POLLERR | libc::POLLNVAL;
            if fds.iter().any(|f| f.revents & bad != 0 && f.revents & libc::POLLIN == 0) {
                break;
            }
            let readable = |f: &libc::pollfd| f.revents & (libc::POLLIN | libc::POLLHUP) != 0;
            if readable(&fds[0]) && !up.eof {
                let rw = &mut self.rw;
                if !pull(&mut self.server, &self.guest, &mut up, |b, out| rw.feed(b, out)) {
                    break;
                }
            }
            if readable(&fds[1])
                && !down.eof
                && !pull(&mut self.client, &self.host, &mut down, |b, out| out.extend_from_slice(b))
            {
                break;
            }
        }
        up.pending.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dummy() -> Result<Arc<ServerConfig>, TlsError> {
        let c = rcgen::generate_simple_self_signed(vec!["x.test".to_string()])?;
        let pk = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(c.signing_key.serialize_der()));
        Ok(Arc::new(
            ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(vec![c.cert.der().clone()], pk)?,
        ))
    }

    #[test]
    fn leaf_cache_reuses_per_name_and_stays_bounded() {
        let mut cache = LeafCache::new(3, Duration::from_secs(3600));
        let made = std::cell::Cell::new(0);
        let get = |c: &mut LeafCache, n: &str| {
            c.get_or_make(n, || {
                made.set(made.get() + 1);
                dummy()
            })
            .unwrap()
        };
        let a = get(&mut cache, "a.test");
        let a2 = get(&mut cache, "a.test");
        assert!(Arc::ptr_eq(&a, &a2));
        for n in ["b.test", "c.test", "d.test"] {
            get(&mut cache, n);
        }
        assert_eq!(cache.len(), 3);
        // The oldest went first: a.test is made anew.
        let a3 = get(&mut cache, "a.test");
        assert!(!Arc::ptr_eq(&a, &a3));
        assert_eq!(cache.len(), 3);
        assert_eq!(made.get(), 5);
    }

    #[test]
    fn leaf_cache_makes_stale_leaves_anew() {
        let mut cache = LeafCache::new(4, Duration::ZERO);
        let a = cache.get_or_make("a.test", dummy).unwrap();
        let b = cache.get_or_make("a.test", dummy).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn ca_is_made_once_with_a_private_key_file_and_signs_leaves() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (c, k) = (d.path().join("ca.pem"), d.path().join("ca.key"));
        let ca = EgressCa::load_or_create(&c, &k).unwrap();
        assert_eq!(std::fs::metadata(&k).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&c).unwrap().permissions().mode() & 0o777, 0o644);
        let again = EgressCa::load_or_create(&c, &k).unwrap();
        assert_eq!(ca.cert_pem(), again.cert_pem());
        assert!(!ca.cert_pem().contains("PRIVATE KEY"));
        // Same name, same configuration; the name is normalized.
        let l = ca.leaf("API.example.com.").unwrap();
        assert!(Arc::ptr_eq(&l, &ca.leaf("api.example.com").unwrap()));
        assert_eq!(l.alpn_protocols, vec![b"http/1.1".to_vec()]);
        // A key of another CA is refused.
        let (_, other_key) = EgressCa::generate().unwrap();
        assert!(EgressCa::from_pem(ca.cert_pem(), &other_key).is_err());
        // Only one of the two files: refused, not overwritten.
        std::fs::remove_file(&k).unwrap();
        assert!(EgressCa::load_or_create(&c, &k).is_err());
        assert!(!k.exists());
    }

    /// A leaf verifies against the CA for its name through a real TLS handshake.
    #[test]
    fn a_leaf_verifies_for_its_name_against_the_ca() {
        let (c, k) = EgressCa::generate().unwrap();
        let ca = EgressCa::from_pem(&c, &k).unwrap();
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(c.as_bytes()).unwrap()).unwrap();
        let client_cfg = Arc::new(
            ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        let handshake = |leaf_for: &str, connect_to: &str| -> Result<(), rustls::Error> {
            let mut server = ServerConnection::new(ca.leaf(leaf_for).unwrap())?;
            let mut client =
                ClientConnection::new(Arc::clone(&client_cfg), ServerName::try_from(connect_to.to_string()).unwrap())?;
            for _ in 0..10 {
                let mut buf = Vec::new();
                client.write_tls(&mut buf).unwrap();
                server.read_tls(&mut &buf[..]).unwrap();
                server.process_new_packets()?;
                let mut buf = Vec::new();
                server.write_tls(&mut buf).unwrap();
                client.read_tls(&mut &buf[..]).unwrap();
                client.process_new_packets()?;
                if !client.is_handshaking() && !server.is_handshaking() {
                    return Ok(());
                }
            }
            Err(rustls::Error::General("no handshake".into()))
        };
        handshake("api.example.com", "api.example.com").unwrap();
        assert!(handshake("api.example.com", "evil.example.com").is_err());
    }
}
