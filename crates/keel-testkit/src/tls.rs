//! TLS for tests: a throwaway PKI made with rcgen on aws-lc-rs (a CA, a
//! server certificate for `localhost`, `127.0.0.1` and `::1`, a client
//! certificate, and an unrelated second CA), written as PEM files, and a
//! blocking HTTPS client on rustls that reads responses with
//! [`crate::http`]. The keys protect nothing and live in a test's
//! temporary directory.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::http::{self, HttpResponse};

/// The PEM files of a throwaway PKI, in one directory.
#[derive(Debug, Clone)]
pub struct TestPki {
    pub dir: PathBuf,
}

fn ca_params(name: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn leaf_params(name: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose) -> CertificateParams {
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut p = CertificateParams::new(sans).expect("valid names");
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![usage];
    p
}

impl TestPki {
    /// Makes `ca.pem`, `server.pem`/`server.key`, `client.pem`/`client.key`
    /// and `other-ca.pem` in `dir` (ECDSA P-256 keys).
    pub fn generate(dir: &Path) -> Self {
        let write = |name: &str, text: String| {
            std::fs::write(dir.join(name), text).expect("write a PEM file");
        };
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = ca_params("keel test CA");
        write("ca.pem", ca.self_signed(&ca_key).expect("CA").pem());
        let issuer = Issuer::new(ca, ca_key);

        let key = KeyPair::generate().expect("server key");
        let server = leaf_params(
            "keel test server",
            &["localhost", "127.0.0.1", "::1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
        .signed_by(&key, &issuer)
        .expect("server certificate");
        write("server.pem", server.pem());
        write("server.key", key.serialize_pem());

        let key = KeyPair::generate().expect("client key");
        let client = leaf_params("keel test client", &[], ExtendedKeyUsagePurpose::ClientAuth)
            .signed_by(&key, &issuer)
            .expect("client certificate");
        write("client.pem", client.pem());
        write("client.key", key.serialize_pem());

        let other_key = KeyPair::generate().expect("other CA key");
        let other = ca_params("an unrelated CA")
            .self_signed(&other_key)
            .expect("other CA");
        write("other-ca.pem", other.pem());
        Self {
            dir: dir.to_owned(),
        }
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
    pub fn other_ca(&self) -> PathBuf {
        self.dir.join("other-ca.pem")
    }
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.pem")
    }
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// A client trusting this CA, without a client certificate.
    pub fn client(&self) -> TlsClient {
        TlsClient::new(&self.ca(), None)
    }

    /// A client trusting this CA and presenting the client certificate.
    pub fn mtls_client(&self) -> TlsClient {
        TlsClient::new(&self.ca(), Some((&self.client_cert(), &self.client_key())))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A rustls client configuration (ALPN `http/1.1`) for blocking requests.
#[derive(Debug, Clone)]
pub struct TlsClient {
    config: Arc<rustls::ClientConfig>,
}

impl TlsClient {
    /// Trusts the CAs in `ca`; presents `client` (certificate, key) if given.
    pub fn new(ca: &Path, client: Option<(&Path, &Path)>) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).expect("read the CA file") {
            roots.add(c.expect("a CA certificate")).expect("add the CA");
        }
        let b = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots);
        let mut config = match client {
            Some((cert, key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .expect("read the client certificate")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("client certificate");
                let key = PrivateKeyDer::from_pem_file(key).expect("client key");
                b.with_client_auth_cert(chain, key)
                    .expect("client identity")
            }
            None => b.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Self {
            config: Arc::new(config),
        }
    }

    /// Connects to `addr` and completes the handshake (the server is
    /// checked for the name `127.0.0.1`); returns the stream.
    pub fn connect(
        &self,
        addr: SocketAddr,
    ) -> io::Result<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>> {
        let name = ServerName::IpAddress(addr.ip().into());
        let conn =
            rustls::ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)?;
        let mut s = rustls::StreamOwned::new(conn, http::connect(addr)?);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock)?;
        }
        Ok(s)
    }

    /// Sends one request over TLS and reads the whole response.
    pub fn request(
        &self,
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<HttpResponse> {
        let s = self.connect(addr)?;
        http::exchange(s, &addr.to_string(), method, path, headers, body)
    }

    /// `GET` with a bearer token.
    pub fn get(&self, addr: SocketAddr, path: &str, token: &str) -> io::Result<HttpResponse> {
        let auth = format!("Bearer {token}");
        self.request(addr, "GET", path, &[("Authorization", &auth)], b"")
    }

    /// `POST` a JSON body with a bearer token.
    pub fn post_json(
        &self,
        addr: SocketAddr,
        path: &str,
        token: &str,
        body: &serde_json::Value,
    ) -> io::Result<HttpResponse> {
        let auth = format!("Bearer {token}");
        self.request(
            addr,
            "POST",
            path,
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json"),
            ],
            body.to_string().as_bytes(),
        )
    }
}
