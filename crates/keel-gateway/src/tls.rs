//! TLS with rustls on the aws-lc-rs provider: the client side for HTTPS to
//! backends and JWKS URLs (the system's roots and/or a PEM CA bundle, an
//! optional client certificate), and the listeners' server certificates,
//! which a reload swaps without restarting the listener.
//!
//! It reads PEM files and builds rustls configurations; it does not open
//! sockets (proxy.rs and server.rs do) and has no switch that turns
//! certificate verification off.

use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

use crate::config::UpstreamTlsConfig;
use crate::error::GatewayError;

/// The only ALPN protocol keel offers or accepts: it speaks HTTP/1.1.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// The aws-lc-rs provider, named explicitly so that no process-wide
/// default has to be installed.
pub fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .clone()
}

fn read(path: &Path) -> Result<Vec<u8>, GatewayError> {
    keel_fs::read_regular(path, keel_fs::MAX_CONFIG_BYTES).map_err(|source| GatewayError::Read {
        path: path.to_owned(),
        source,
    })
}

fn malformed(what: &'static str, path: &Path, reason: impl Into<String>) -> GatewayError {
    GatewayError::Malformed {
        what,
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Every certificate in a PEM file's text (at least one).
pub fn certs_from_pem(
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, GatewayError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| malformed("PEM certificate file", path, e.to_string()))?;
    if certs.is_empty() {
        return Err(malformed(
            "PEM certificate file",
            path,
            "no CERTIFICATE block in it",
        ));
    }
    Ok(certs)
}

/// The first private key in a PEM file's text (PKCS#8, PKCS#1 or SEC1).
pub fn key_from_pem(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, GatewayError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => malformed(
            "PEM private key file",
            path,
            "no PRIVATE KEY block (PKCS#8, RSA or EC) in it",
        ),
        e => malformed("PEM private key file", path, e.to_string()),
    })
}

/// A certificate chain and its private key, checked to belong together.
pub fn certified_key(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, GatewayError> {
    let chain = certs_from_pem(cert, &read(cert)?)?;
    let der = key_from_pem(key, &read(key)?)?;
    certified_key_from(cert, chain, key, der).map(Arc::new)
}

fn certified_key_from(
    cert: &Path,
    chain: Vec<CertificateDer<'static>>,
    key: &Path,
    der: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, GatewayError> {
    match CertifiedKey::from_der(chain, der, &provider()) {
        Ok(k) => Ok(k),
        Err(rustls::Error::InconsistentKeys(_)) => Err(malformed(
            "PEM private key file",
            key,
            format!("it is not the key of the certificate in {}", cert.display()),
        )),
        Err(e @ rustls::Error::InvalidCertificate(_)) => {
            Err(malformed("PEM certificate file", cert, e.to_string()))
        }
        Err(e) => Err(malformed("PEM private key file", key, e.to_string())),
    }
}

/// The certificate a listener presents; a reload replaces it in place, so
/// new connections get the new one and open ones keep theirs.
#[derive(Debug)]
struct CertSlot(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

/// A listener's TLS: the acceptor (TLS 1.2 and 1.3, ALPN `http/1.1`, no
/// client certificates) and the slot its certificate is read from.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
    slot: Arc<CertSlot>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").finish_non_exhaustive()
    }
}

impl ServerTls {
    pub fn new(key: Arc<CertifiedKey>) -> Result<Self, GatewayError> {
        let slot = Arc::new(CertSlot(RwLock::new(key)));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| GatewayError::Config(format!("TLS: {e}")))?
            .with_no_client_auth()
            .with_cert_resolver(slot.clone());
        cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(cfg)),
            slot,
        })
    }

    /// Loads `cert` and `key` and serves them.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, GatewayError> {
        Self::new(certified_key(cert, key)?)
    }

    /// Presents `key` to connections from now on.
    pub fn set(&self, key: Arc<CertifiedKey>) {
        *self.slot.0.write().unwrap_or_else(|p| p.into_inner()) = key;
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

/// The files of `[upstream_tls]` as read, and a digest of them that says
/// whether a reload changed anything.
#[derive(Debug)]
pub struct UpstreamTlsFiles {
    cfg: UpstreamTlsConfig,
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
    pub digest: [u8; 32],
}

impl UpstreamTlsFiles {
    pub fn read(cfg: &UpstreamTlsConfig) -> Result<Self, GatewayError> {
        let ca = cfg.ca_file.as_deref().map(read).transpose()?;
        let client = match (&cfg.client_cert, &cfg.client_key) {
            (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
            (None, None) => None,
            _ => {
                return Err(GatewayError::Config(
                    "upstream_tls.client_cert and upstream_tls.client_key go together".into(),
                ))
            }
        };
        let (cert, key) = match &client {
            Some((c, k)) => (Some(c.as_slice()), Some(k.as_slice())),
            None => (None, None),
        };
        let mut h = Sha256::new();
        h.update([u8::from(cfg.system_roots)]);
        for part in [ca.as_deref(), cert, key] {
            match part {
                Some(b) => {
                    h.update([1]);
                    h.update((b.len() as u64).to_le_bytes());
                    h.update(b);
                }
                None => h.update([0]),
            }
        }
        Ok(Self {
            cfg: cfg.clone(),
            ca,
            client,
            digest: h.finalize().into(),
        })
    }

    /// The client configuration (the trusted roots, the client certificate
    /// if any, TLS 1.2 and 1.3, ALPN `http/1.1`) and how many roots it
    /// trusts.
    pub fn client_config(&self) -> Result<(rustls::ClientConfig, usize), GatewayError> {
        let mut roots = rustls::RootCertStore::empty();
        if self.cfg.system_roots {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "could not read some of the system's trusted certificates");
            }
            let (added, ignored) = roots.add_parsable_certificates(found.certs);
            if ignored > 0 {
                tracing::warn!(
                    ignored,
                    added,
                    "some of the system's trusted certificates could not be used"
                );
            }
        }
        if let (Some(path), Some(pem)) = (&self.cfg.ca_file, &self.ca) {
            for cert in certs_from_pem(path, pem)? {
                roots
                    .add(cert)
                    .map_err(|e| malformed("PEM CA file", path, e.to_string()))?;
            }
        }
        let trusted = roots.len();
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| GatewayError::Config(format!("TLS: {e}")))?
            .with_root_certificates(roots);
        let mut cfg = match (&self.cfg.client_cert, &self.cfg.client_key, &self.client) {
            (Some(c), Some(k), Some((cert_pem, key_pem))) => {
                let chain = certs_from_pem(c, cert_pem)?;
                let der = key_from_pem(k, key_pem)?;
                let key = certified_key_from(c, chain, k, der)?;
                builder.with_client_cert_resolver(Arc::new(SingleCertAndKey::from(key)))
            }
            _ => builder.with_no_client_auth(),
        };
        cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        Ok((cfg, trusted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn upstream(
        dir: &Path,
        ca: Option<&str>,
        cert: Option<&str>,
        key: Option<&str>,
    ) -> UpstreamTlsConfig {
        UpstreamTlsConfig {
            system_roots: false,
            ca_file: ca.map(|f| dir.join(f)),
            client_cert: cert.map(|f| dir.join(f)),
            client_key: key.map(|f| dir.join(f)),
        }
    }

    fn err_text(e: GatewayError) -> String {
        let mut s = e.to_string();
        let mut cur = std::error::Error::source(&e);
        while let Some(c) = cur {
            s.push_str(": ");
            s.push_str(&c.to_string());
            cur = c.source();
        }
        s
    }

    #[test]
    fn missing_and_garbage_files_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::write(d.join("garbage.pem"), "this is not PEM\n").expect("write");
        std::fs::write(
            d.join("bad-base64.pem"),
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let check = |e: GatewayError, file: &str, says: &str| {
            let t = err_text(e);
            assert!(t.contains(&d.join(file).display().to_string()), "{t}");
            assert!(t.contains(says), "{t} lacks {says}");
        };
        // The CA bundle.
        let e = UpstreamTlsFiles::read(&upstream(d, Some("nope.pem"), None, None))
            .expect_err("missing");
        assert!(matches!(e, GatewayError::Read { .. }));
        check(e, "nope.pem", "No such file");
        let f =
            UpstreamTlsFiles::read(&upstream(d, Some("garbage.pem"), None, None)).expect("read");
        check(
            f.client_config().expect_err("garbage"),
            "garbage.pem",
            "no CERTIFICATE",
        );
        let f =
            UpstreamTlsFiles::read(&upstream(d, Some("bad-base64.pem"), None, None)).expect("read");
        check(
            f.client_config().expect_err("garbage"),
            "bad-base64.pem",
            "base64",
        );
        // A listener's certificate and key.
        check(
            ServerTls::load(&d.join("garbage.pem"), &d.join("nope.key")).expect_err("garbage"),
            "garbage.pem",
            "no CERTIFICATE",
        );
        let e = certified_key(&d.join("missing.pem"), &d.join("garbage.pem")).expect_err("x");
        check(e, "missing.pem", "failed to read");
        // A client certificate without its key is refused before any file is read.
        let e = UpstreamTlsFiles::read(&upstream(d, None, Some("c.pem"), None)).expect_err("half");
        assert!(e.to_string().contains("go together"), "{e}");
    }

    #[test]
    fn a_key_file_without_a_key_is_an_error_naming_it() {
        let d = PathBuf::from("/etc/keel/server.key");
        let e = key_from_pem(
            &d,
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .expect_err("no key");
        let t = e.to_string();
        assert!(
            t.contains("/etc/keel/server.key") && t.contains("no PRIVATE KEY"),
            "{t}"
        );
    }

    #[test]
    fn real_certificates_load_and_a_foreign_key_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = keel_testkit::tls::TestPki::generate(dir.path());
        ServerTls::load(&pki.server_cert(), &pki.server_key()).expect("server certificate");
        let e = certified_key(&pki.server_cert(), &pki.client_key()).expect_err("wrong key");
        let t = e.to_string();
        assert!(
            t.contains(&pki.client_key().display().to_string())
                && t.contains("not the key of the certificate in")
                && t.contains(&pki.server_cert().display().to_string()),
            "{t}"
        );
        let files = UpstreamTlsFiles::read(&UpstreamTlsConfig {
            system_roots: false,
            ca_file: Some(pki.ca()),
            client_cert: Some(pki.client_cert()),
            client_key: Some(pki.client_key()),
        })
        .expect("read");
        let (_, roots) = files.client_config().expect("client config");
        assert_eq!(roots, 1);
        let swapped = UpstreamTlsFiles::read(&UpstreamTlsConfig {
            system_roots: false,
            ca_file: Some(pki.ca()),
            client_cert: Some(pki.client_cert()),
            client_key: Some(pki.server_key()),
        })
        .expect("read");
        let t = err_text(swapped.client_config().expect_err("mismatch"));
        assert!(t.contains("server.key") && t.contains("client.pem"), "{t}");
        // A private key given as the CA bundle: no certificate in it.
        let f = UpstreamTlsFiles::read(&UpstreamTlsConfig {
            system_roots: false,
            ca_file: Some(pki.server_key()),
            client_cert: None,
            client_key: None,
        })
        .expect("read");
        let t = err_text(f.client_config().expect_err("a key is no CA"));
        assert!(
            t.contains("server.key") && t.contains("no CERTIFICATE"),
            "{t}"
        );
    }

    #[test]
    fn without_files_the_client_config_offers_http11_only() {
        let f = UpstreamTlsFiles::read(&upstream(Path::new("/"), None, None, None)).expect("read");
        let (c, roots) = f.client_config().expect("config");
        assert_eq!(roots, 0, "no system roots asked for, no CA file");
        assert_eq!(c.alpn_protocols, vec![b"http/1.1".to_vec()]);
        let g = UpstreamTlsFiles::read(&UpstreamTlsConfig {
            system_roots: true,
            ..upstream(Path::new("/"), None, None, None)
        })
        .expect("read");
        assert_ne!(f.digest, g.digest, "the digest covers system_roots");
    }
}
