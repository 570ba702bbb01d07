//! TLS end to end, with a throwaway PKI made in each test: HTTPS and
//! mutual-TLS test backends, a JWKS served over HTTPS, and the gateway's
//! own listeners serving HTTPS (certificates swapped by a reload).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keel_gateway::{Gateway, GatewayConfig, GatewayError, GatewayOptions, ManualClock};
use keel_testkit::serve::BackendTls;
use keel_testkit::tls::{TestPki, TlsClient};
use serde_json::{json, Value};

/// The common head with health probes off and a circuit that opens after
/// `min_requests` failures and tries again after 200 ms.
/// No retries or probes, and a circuit that one caller's failures open
/// (`min_identities = 1`: these tests send from one key).
fn head_with_circuit(dir: &Path, min_requests: u32) -> String {
    let h = head(dir);
    let traffic = "[traffic]\nretries = 2\n[traffic.health]\ninterval_ms = 100\n";
    assert!(h.contains(traffic));
    h.replace(
        traffic,
        &format!(
            "[traffic]\nretries = 0\n[traffic.health]\nenabled = false\n[traffic.circuit]\nmin_requests = {min_requests}\nfailure_ratio = 0.5\ntrip_s = 0.2\nwindow_s = 10\nmin_identities = 1\n"
        ),
    )
}

fn upstream_tls(lines: &[String]) -> String {
    format!("\n[upstream_tls]\n{}\n", lines.join("\n"))
}

fn toml_path(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

fn reload(g: &Running) -> HttpResponse {
    http::request(
        g.admin,
        "POST",
        "/admin/reload",
        &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
        b"",
    )
    .expect("reload")
}

fn stream_body() -> Value {
    let mut body = chat_body("chat");
    body["stream"] = json!(true);
    body
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within 5 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn https_backend_with_the_private_ca_serves_plain_and_streamed_chat() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let b = TestBackend::start_tls(&["--tokens", "16"], &pki, BackendTls::Server);
    assert!(b.url().starts_with("https://127.0.0.1:"), "{}", b.url());
    let cfg = format!(
        "{}{}{}",
        head(dir.path()),
        model("chat", "", &[("blue", b.url(), 1)]),
        upstream_tls(&[format!("ca_file = {}", toml_path(&pki.ca()))])
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);

    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["total_tokens"], 10);
    assert_eq!(r.header("x-keel-deployment"), Some("blue"));

    let r = g.chat(&key, stream_body());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert_eq!(text.matches("\"content\":\"tok \"").count(), 8, "{text}");
    assert!(!text.contains("prompt_tokens"), "usage chunk stripped");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(b.count("/v1/chat/completions"), 2);
    assert_eq!(b.count("model:backend-blue"), 2);

    // Health probes go over HTTPS too.
    wait_for("two health probes", || b.count("health") >= 2);
    let m = g.metrics_text();
    assert!(
        m.contains(&format!(
            "keel_backend_healthy{{backend=\"{}\"}} 1",
            b.url()
        )),
        "{m}"
    );
    let audit = g.stop();
    assert_eq!(
        audit
            .iter()
            .filter(|e| e["event"] == "request" && e["status"] == 200)
            .count(),
        2
    );
}

#[test]
fn without_the_ca_an_https_backend_fails_closed_until_a_reload_trusts_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let b = TestBackend::start_tls(&[], &pki, BackendTls::Server);
    let base = format!(
        "{}{}",
        head_with_circuit(dir.path(), 2),
        model("chat", "", &[("blue", b.url(), 1)])
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    // The system's roots only: the private CA is not among them.
    let g = Running::start(dir.path(), &base);
    for _ in 0..2 {
        let r = g.chat(&key, chat_body("chat"));
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(r.header("retry-after").is_some());
        assert_eq!(r.json()["error"]["type"], "service_unavailable");
    }
    let m = g.metrics_text();
    assert!(
        m.contains(&format!(
            "keel_backend_circuit_open{{backend=\"{}\"}} 1",
            b.url()
        )),
        "two failed handshakes open the circuit: {m}"
    );
    assert!(
        m.contains("keel_errors_total{route=\"/v1/chat/completions\",kind=\"upstream\"} 2"),
        "{m}"
    );
    assert_eq!(
        b.count("/v1/chat/completions"),
        0,
        "no request got past the handshake"
    );

    // Trusting only an unrelated CA fails the same way.
    let other = upstream_tls(&[
        "system_roots = false".into(),
        format!("ca_file = {}", toml_path(&pki.other_ca())),
    ]);
    std::fs::write(dir.path().join("gateway.toml"), format!("{base}{other}")).expect("write");
    assert_eq!(reload(&g).status, 200);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(g.chat(&key, chat_body("chat")).status, 503);

    // With the CA the half-open trial succeeds and the circuit closes.
    let right = upstream_tls(&[
        "system_roots = false".into(),
        format!("ca_file = {}", toml_path(&pki.ca())),
    ]);
    std::fs::write(dir.path().join("gateway.toml"), format!("{base}{right}")).expect("write");
    assert_eq!(reload(&g).status, 200);
    std::thread::sleep(Duration::from_millis(300));
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(g.chat(&key, stream_body()).status, 200);
    assert_eq!(b.count("/v1/chat/completions"), 2);

    // A CA file that is not PEM refuses the reload; the running one stays.
    std::fs::write(dir.path().join("garbage.pem"), "not a certificate\n").expect("write");
    let garbage = upstream_tls(&[format!(
        "ca_file = {}",
        toml_path(&dir.path().join("garbage.pem"))
    )]);
    std::fs::write(dir.path().join("gateway.toml"), format!("{base}{garbage}")).expect("write");
    let r = reload(&g);
    assert_eq!(r.status, 422);
    assert!(r.text().contains("garbage.pem"), "{}", r.text());
    assert_eq!(g.chat(&key, chat_body("chat")).status, 200);

    let audit = g.stop();
    let failed: Vec<&Value> = audit
        .iter()
        .filter(|e| e["event"] == "request" && e["status"] == 503)
        .collect();
    assert!(failed.len() >= 3, "{failed:?}");
    assert!(
        failed[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("invalid peer certificate")),
        "the handshake's reason is recorded: {:?}",
        failed[0]
    );
}

#[test]
fn a_backend_that_requires_a_client_certificate_gets_it_from_upstream_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let b = TestBackend::start_tls(&[], &pki, BackendTls::Mutual);
    // The backend itself refuses a client without a certificate...
    let refused = pki.client().request(b.addr, "GET", "/health", &[], b"");
    assert!(refused.is_err(), "{refused:?}");
    // ...and serves one with it.
    assert_eq!(
        pki.mtls_client()
            .request(b.addr, "GET", "/health", &[], b"")
            .expect("mTLS")
            .status,
        200
    );
    let base = format!(
        "{}{}",
        head_with_circuit(dir.path(), 100),
        model("chat", "", &[("blue", b.url(), 1)])
    );
    let ca = format!("ca_file = {}", toml_path(&pki.ca()));
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(
        dir.path(),
        &format!("{base}{}", upstream_tls(std::slice::from_ref(&ca))),
    );
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 503, "no client certificate: {}", r.text());
    assert!(g
        .metrics_text()
        .contains("keel_errors_total{route=\"/v1/chat/completions\",kind=\"upstream\"} 1"));

    let with_cert = upstream_tls(&[
        ca,
        format!("client_cert = {}", toml_path(&pki.client_cert())),
        format!("client_key = {}", toml_path(&pki.client_key())),
    ]);
    std::fs::write(
        dir.path().join("gateway.toml"),
        format!("{base}{with_cert}"),
    )
    .expect("write");
    assert_eq!(reload(&g).status, 200);
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    let text = g.chat(&key, stream_body()).text();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(b.count("/v1/chat/completions"), 2);
    g.stop();
}

/// A JWKS endpoint over HTTPS: a blocking rustls server that answers every
/// request with `body`.
fn https_jwks(pki: &TestPki, body: String) -> SocketAddr {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(pki.server_cert())
        .expect("cert")
        .collect::<Result<Vec<_>, _>>()
        .expect("cert");
    let key = PrivateKeyDer::from_pem_file(pki.server_key()).expect("key");
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("server config");
    let cfg = Arc::new(cfg);
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let Ok(conn) = rustls::ServerConnection::new(cfg.clone()) else {
                continue;
            };
            let mut t = rustls::StreamOwned::new(conn, s);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match t.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            if !head.ends_with(b"\r\n\r\n") {
                continue; // the handshake or the request failed
            }
            let _ = write!(t, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
            t.conn.send_close_notify();
            let _ = t.flush();
        }
    });
    addr
}

#[test]
fn jwks_over_https_with_the_private_ca() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let jwks = std::fs::read_to_string(fx.join("jwks.json")).expect("jwks");
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let idp = https_jwks(&pki, jwks);
    let b = TestBackend::start(&[]);
    let jwt_cfg = format!(
        "[auth.jwt]\njwks_url = \"https://{idp}/jwks.json\"\nissuer = \"iss\"\naudience = \"keel\"\nroles_claim = \"groups\"\nrefresh_s = 1\n"
    );
    let base = format!(
        "{}{}",
        head(dir.path()).replace("[audit]", &format!("{jwt_cfg}[audit]")),
        model("chat", "", &[("blue", b.url(), 1)])
    );
    let cfg = format!(
        "{base}{}",
        upstream_tls(&[format!("ca_file = {}", toml_path(&pki.ca()))])
    );
    let now_s = 1_767_225_600u64;
    let g = Running::start_with_clock(dir.path(), &cfg, Arc::new(ManualClock::new(now_s * 1000)));
    let key = EncodingKey::from_rsa_der(&std::fs::read(fx.join("jwt-test-key.der")).expect("key"));
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some("test-1".into());
    let t = encode(
        &h,
        &json!({"sub": "svc", "iss": "iss", "aud": "keel", "exp": now_s + 10, "groups": "user"}),
        &key,
    )
    .expect("sign");
    let r = g.chat(&t, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    // The refresh (every second) goes through the same client.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(g.chat(&t, chat_body("chat")).status, 200);
    g.stop();

    // Without the CA the JWKS cannot be fetched: the gateway does not start.
    let cfg = GatewayConfig::from_toml(&base, dir.path()).expect("valid");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let e = rt
        .block_on(Gateway::new(
            cfg,
            GatewayOptions {
                clock: Arc::new(ManualClock::new(now_s * 1000)),
                seed: 1,
                reload: None,
                access_sink: None,
                machine: None,
            },
        ))
        .expect_err("untrusted JWKS server");
    match e {
        GatewayError::Jwks { url, reason } => {
            assert!(url.starts_with("https://"), "{url}");
            assert!(reason.contains("invalid peer certificate"), "{reason}");
        }
        other => panic!("expected a JWKS error, got {other}"),
    }
}

#[test]
fn listeners_serve_https_close_other_connections_and_reload_certificates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let (cert, key_file) = (dir.path().join("gw.pem"), dir.path().join("gw.key"));
    std::fs::copy(pki.server_cert(), &cert).expect("copy");
    std::fs::copy(pki.server_key(), &key_file).expect("copy");
    let b = TestBackend::start(&[]);
    let tls = format!(
        "tls_cert = {}\ntls_key = {}\n",
        toml_path(&cert),
        toml_path(&key_file)
    );
    let cfg = format!(
        "{}{}",
        head(dir.path())
            .replace("[server]\n", &format!("[server]\n{tls}"))
            .replace("[admin]\n", &format!("[admin]\n{tls}")),
        model("chat", "", &[("blue", b.url(), 1)])
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let c = pki.client();

    let s = c.connect(g.public).expect("handshake");
    assert_eq!(s.conn.alpn_protocol(), Some(&b"http/1.1"[..]));
    drop(s);
    assert_eq!(
        c.request(g.public, "GET", "/healthz", &[], b"")
            .expect("r")
            .status,
        200
    );
    let r = c
        .post_json(g.public, "/v1/chat/completions", &key, &chat_body("chat"))
        .expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    let r = c
        .post_json(g.public, "/v1/chat/completions", &key, &stream_body())
        .expect("stream");
    assert_eq!(r.status, 200);
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());

    // Plain HTTP to the TLS listener: the connection is closed, promptly,
    // and no HTTP answer comes back.
    let t = Instant::now();
    let mut s = TcpStream::connect(g.public).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(
        !buf.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
    // The plain metrics listener is unaffected.
    assert!(g.metrics_text().contains("keel_requests_total"));

    // A client that never starts its handshake blocks nobody and is
    // dropped at the header timeout (500 ms).
    let mut idle = TcpStream::connect(g.public).expect("connect");
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let t = Instant::now();
    for _ in 0..3 {
        assert_eq!(
            c.request(g.public, "GET", "/healthz", &[], b"")
                .expect("r")
                .status,
            200
        );
    }
    let mut buf = Vec::new();
    let _ = idle.read_to_end(&mut buf);
    assert!(buf.is_empty());
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );

    // A client that does not trust the CA fails the handshake.
    let stranger = TlsClient::new(&pki.other_ca(), None);
    assert!(stranger.connect(g.public).is_err());

    // The admin listener serves HTTPS too, and only HTTPS.
    let admin = |client: &TlsClient, method: &str, path: &str| {
        client.request(
            g.admin,
            method,
            path,
            &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            b"",
        )
    };
    assert_eq!(admin(&c, "GET", "/admin/status").expect("r").status, 200);
    assert!(http::get(g.admin, "/admin/status", ADMIN_TOKEN).is_err());

    // A renewed certificate (from a new CA) written over the same files is
    // served to new connections after a reload.
    let renewed = TestPki::generate(&{
        let d = dir.path().join("renewed");
        std::fs::create_dir(&d).expect("mkdir");
        d
    });
    std::fs::copy(renewed.server_cert(), &cert).expect("copy");
    std::fs::copy(renewed.server_key(), &key_file).expect("copy");
    assert!(renewed.client().connect(g.public).is_err(), "not yet");
    let r = admin(&c, "POST", "/admin/reload").expect("reload");
    assert_eq!(r.status, 200, "{}", r.text());
    let c2 = renewed.client();
    assert_eq!(
        c2.request(g.public, "GET", "/healthz", &[], b"")
            .expect("renewed")
            .status,
        200
    );
    assert!(c.connect(g.public).is_err(), "the old certificate is gone");

    // A key that does not fit refuses the reload; the listener keeps its
    // certificate.
    std::fs::copy(pki.server_key(), &key_file).expect("copy");
    let r = admin(&c2, "POST", "/admin/reload").expect("reload");
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("gw.key"), "{}", r.text());
    assert_eq!(
        c2.request(g.public, "GET", "/healthz", &[], b"")
            .expect("still served")
            .status,
        200
    );
    std::fs::copy(renewed.server_key(), &key_file).expect("copy");
    g.stop();
}

/// On an HTTPS listener, a connection whose handshake has not finished
/// gives up its place like a slow head: the oldest is closed at once for a
/// newer connection, never left running without a place until the header
/// timeout.
#[test]
fn a_handshake_not_finished_gives_its_place_to_a_newer_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let b = TestBackend::start(&[]);
    let tls = format!(
        "tls_cert = {}\ntls_key = {}\nmax_connections = 2\n",
        toml_path(&pki.server_cert()),
        toml_path(&pki.server_key())
    );
    let cfg = format!(
        "{}{}",
        head(dir.path())
            .replace("[server]\n", &format!("[server]\n{tls}"))
            .replace("header_timeout_ms = 500", "header_timeout_ms = 60000"),
        model("chat", "", &[("blue", b.url(), 1)])
    );
    let g = Running::start(dir.path(), &cfg);
    // Two connections that never start a handshake hold both places.
    let mut first = TcpStream::connect(g.public).expect("connect");
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _second = TcpStream::connect(g.public).expect("connect");
    // A client that completes its handshake takes the oldest one's place.
    let c = pki.client();
    let r = c.request(g.public, "GET", "/healthz", &[], b"").expect("r");
    assert_eq!(r.status, 200);
    let mut buf = [0u8; 16];
    match first.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the oldest connection is closed within 10 s, not 60: {other:?}"),
    }
    g.stop();
}
