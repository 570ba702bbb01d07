//! Deployments from the registry: a real registry (keel-registry's HTTP
//! API over a socket, SQLite) read with an API key, its aliases resolved to
//! backends by the `keel.backend` version tag, and every bad input refused
//! with an error that says what to fix.

use std::sync::Arc;

use keel_control::registry_source::{
    ModelSource, RegistryClient, RegistrySourceError, Routing, VersionRoute, BACKEND_TAG,
};
use keel_registry::http::{router, serve, ServeOptions};
use keel_registry::{FixedClock, NewVersion, Registry, Role};

struct Server {
    url: String,
    reader: String,
    writer: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
    }
}

fn version(reg: &mut Registry, model: &str) -> u64 {
    let new = NewVersion {
        model: model.into(),
        source: format!("s3://b/{model}"),
        create_model: true,
        ..Default::default()
    };
    reg.register_version("ci", &new, None)
        .expect("version")
        .version
}

/// Model `chat`: v1 (`production`, backend a), v2 (`canary`, backend b),
/// v3 (no backend tag, alias `nobackend`); model `bare` with no aliases.
/// (The registry itself refuses to point an alias at a version that is not
/// READY.)
async fn start() -> Server {
    let mut reg = Registry::open_in_memory(Arc::new(FixedClock(1_700_000_000_000))).expect("reg");
    let reader = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "gateway", Role::Read, &reader)
        .expect("key");
    let writer = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "rollouts", Role::Write, &writer)
        .expect("key");
    for (i, backend) in [
        Some("http://127.0.0.1:9001"),
        Some("http://127.0.0.1:9002/v"),
        None,
    ]
    .into_iter()
    .enumerate()
    {
        let v = version(&mut reg, "chat");
        assert_eq!(v, i as u64 + 1);
        if let Some(b) = backend {
            reg.set_version_tag("ci", "chat", v, BACKEND_TAG, Some(b))
                .expect("tag");
        }
    }
    reg.set_alias("ci", "chat", "production", 1, "first")
        .expect("alias");
    reg.set_alias("ci", "chat", "canary", 2, "try")
        .expect("alias");
    reg.set_alias("ci", "chat", "nobackend", 3, "x")
        .expect("alias");
    version(&mut reg, "bare");
    let app = router(reg, ServeOptions::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, app, async {
        let _ = rx.await;
    }));
    Server {
        url: format!("http://{addr}"),
        reader,
        writer,
        stop: Some(tx),
        task,
    }
}

fn source(model: &str, stable: &str, canary: Option<&str>) -> ModelSource {
    ModelSource {
        model: model.into(),
        stable_alias: stable.into(),
        canary_alias: canary.map(Into::into),
        require_signature: false,
        allowed_backends: Vec::new(),
    }
}

/// Issue 44 (E3): the backend a version names must be one the gateway's
/// configuration allows, whatever the registry says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_outside_allowed_backends_is_refused() {
    let s = start().await;
    let c = RegistryClient::new(&s.url, &s.reader).expect("client");
    let mut src = source("chat", "production", Some("canary"));
    src.allowed_backends = vec!["http://127.0.0.1:9001".into()];
    let e = c
        .resolve(&src)
        .await
        .expect_err("canary's backend is not allowed");
    assert!(
        matches!(&e, RegistrySourceError::BackendNotAllowed { version: 2, backend, .. } if backend == "http://127.0.0.1:9002/v"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("not one of the model's allowed_backends"),
        "{e}"
    );
    src.allowed_backends.push("http://127.0.0.1:9002/v/".into());
    let r = c.resolve(&src).await.expect("both allowed");
    assert_eq!(r.canary.map(|v| v.version), Some(2));
    s.stop().await;
}

/// A server that answers every request with 200 and a JSON body of
/// `len` bytes (spaces after `{}`), however long.
async fn huge_answers(len: usize) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{{}}"
                );
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 1 << 20];
                let mut left = len - 2;
                while left > 0 {
                    let n = left.min(chunk.len());
                    if s.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n;
                }
            });
        }
    });
    (url, task)
}

/// Issue 44 (E8): an answer over the cap is an error, read no further
/// than the cap; one under it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_answer_over_the_cap_is_refused() {
    use keel_control::registry_source::MAX_ANSWER_BYTES;
    let (url, task) = huge_answers(MAX_ANSWER_BYTES + 1).await;
    let c = RegistryClient::new(&url, "k").expect("client");
    let e = c
        .resolve(&source("chat", "production", None))
        .await
        .expect_err("too large");
    assert!(
        matches!(&e, RegistrySourceError::TooLarge { path } if path == "/api/v1/models/get"),
        "{e}"
    );
    task.abort();
    let (url, task) = huge_answers(MAX_ANSWER_BYTES).await;
    let c = RegistryClient::new(&url, "k").expect("client");
    let e = c
        .resolve(&source("chat", "production", None))
        .await
        .expect_err("read, then not a model document");
    assert!(matches!(e, RegistrySourceError::BadResponse { .. }), "{e}");
    task.abort();
}

/// A TLS front for `upstream` (the registry's plain listener) with the
/// test PKI's server certificate: `https://127.0.0.1:PORT`.
async fn tls_front(
    pki: &keel_testkit::tls::TestPki,
    upstream: &str,
) -> (String, tokio::task::JoinHandle<()>) {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<rustls::pki_types::CertificateDer<'static>> =
        rustls::pki_types::CertificateDer::pem_file_iter(pki.server_cert())
            .expect("cert")
            .collect::<Result<_, _>>()
            .expect("certs");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(pki.server_key()).expect("key");
    let cfg = rustls::ServerConfig::builder_with_provider(keel_gateway::tls_provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("https://{}", l.local_addr().expect("addr"));
    let upstream = upstream.trim_start_matches("http://").to_owned();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (url, task)
}

/// Issue 44 (E3): the registry over HTTPS, its certificate checked
/// against `registry.ca_file`; a certificate from another CA is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_registry_is_read_with_its_ca_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let pki = keel_testkit::tls::TestPki::generate(dir.path());
    let s = start().await;
    let (url, task) = tls_front(&pki, &s.url).await;
    let c = RegistryClient::with_ca(&url, &s.reader, Some(&pki.ca())).expect("client");
    let r = c
        .resolve(&source("chat", "production", None))
        .await
        .expect("resolve over https");
    assert_eq!(r.stable.version, 1);
    let other = RegistryClient::with_ca(&url, &s.reader, Some(&pki.other_ca())).expect("client");
    let e = other
        .resolve(&source("chat", "production", None))
        .await
        .expect_err("a certificate of another CA");
    assert!(matches!(e, RegistrySourceError::Unreachable { .. }), "{e}");
    let e = RegistryClient::new("ftp://registry:1", "k").expect_err("scheme");
    assert!(e.to_string().contains("https://host:port"), "{e}");
    task.abort();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_resolve_to_the_backends_their_versions_name() {
    let s = start().await;
    let c = RegistryClient::new(&s.url, &s.reader).expect("client");
    let r = c
        .resolve(&source("chat", "production", Some("canary")))
        .await
        .expect("resolve");
    assert_eq!(
        r,
        Routing {
            stable: VersionRoute {
                alias: "production".into(),
                version: 1,
                backend: "http://127.0.0.1:9001".into(),
            },
            canary: Some(VersionRoute {
                alias: "canary".into(),
                version: 2,
                backend: "http://127.0.0.1:9002/v".into(),
            }),
        }
    );
    // A canary alias that is not set is no canary, not an error.
    let r = c
        .resolve(&source("chat", "production", Some("challenger")))
        .await
        .expect("resolve");
    assert_eq!(r.canary, None);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_what_to_fix() {
    let s = start().await;
    let c = RegistryClient::new(&s.url, &s.reader).expect("client");
    let err = |e: RegistrySourceError| e.to_string();

    let e = c
        .resolve(&source("nope", "production", None))
        .await
        .expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::ModelNotFound { .. }),
        "{e}"
    );
    assert_eq!(err(e), r#"the registry has no model "nope""#);

    let e = c
        .resolve(&source("bare", "production", None))
        .await
        .expect_err("refused");
    assert_eq!(
        err(e),
        r#"registry model "bare" has no alias "production" (set it with `keel model alias set bare production VERSION`)"#
    );

    let e = c
        .resolve(&source("chat", "production", Some("nobackend")))
        .await
        .expect_err("refused");
    assert_eq!(
        err(e),
        r#"registry model "chat" version 3 (alias "nobackend") names no backend: give it the tag keel.backend=http://host:port"#
    );

    let mut signed = source("chat", "production", None);
    signed.require_signature = true;
    let e = c.resolve(&signed).await.expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::Unsigned { version: 1, .. }),
        "{e}"
    );

    // A key the registry does not know.
    let stranger = RegistryClient::new(&s.url, "keel_not-a-key").expect("client");
    let e = stranger
        .resolve(&source("chat", "production", None))
        .await
        .expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::Unauthorized { status: 401 }),
        "{e}"
    );
    assert!(!format!("{e:?}").contains("not-a-key"));
    assert!(!format!("{stranger:?}").contains("not-a-key"));

    assert!(matches!(
        RegistryClient::new("ftp://x", "k"),
        Err(RegistrySourceError::BadUrl { .. })
    ));

    // Down: a clear error, nothing else.
    let url = s.url.clone();
    s.stop().await;
    let c = RegistryClient::new(&url, "k").expect("client");
    let e = c
        .resolve(&source("chat", "production", None))
        .await
        .expect_err("refused");
    assert!(matches!(e, RegistrySourceError::Unreachable { .. }), "{e}");
}

/// The alias history of `chat`'s `alias`, as the registry's API shows it.
async fn history(s: &Server, alias: &str) -> Vec<serde_json::Value> {
    let addr: std::net::SocketAddr = s.url.trim_start_matches("http://").parse().expect("addr");
    let auth = format!("Bearer {}", s.reader);
    let path = format!("/api/v1/history?name=chat&alias={alias}");
    let r = tokio::task::spawn_blocking(move || {
        keel_testkit::http::request(addr, "GET", &path, &[("authorization", &auth)], b"")
    })
    .await
    .expect("join")
    .expect("history");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["events"].as_array().expect("events").clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_are_set_and_deleted_with_their_reason_by_a_writer_only() {
    let s = start().await;
    let w = RegistryClient::new(&s.url, &s.writer).expect("client");
    w.set_alias("chat", "production", 2, "rollout r-1: promoted")
        .await
        .expect("set");
    w.delete_alias(
        "chat",
        "canary",
        "rollout r-2: aborted at 1%: empty_answer fail",
    )
    .await
    .expect("delete");
    let r = w
        .resolve(&source("chat", "production", Some("canary")))
        .await
        .expect("resolve");
    assert_eq!((r.stable.version, r.canary), (2, None));
    let p = history(&s, "production").await;
    let last = p.last().expect("event");
    assert_eq!(
        (last["new_version"].as_u64(), last["reason"].as_str()),
        (Some(2), Some("rollout r-1: promoted"))
    );
    let c = history(&s, "canary").await;
    let last = c.last().expect("event");
    assert_eq!(last["new_version"], serde_json::Value::Null);
    assert_eq!(
        last["reason"],
        "rollout r-2: aborted at 1%: empty_answer fail"
    );
    // A read key cannot; a missing alias or version is the registry's
    // error, said.
    let r = RegistryClient::new(&s.url, &s.reader).expect("client");
    let e = r
        .set_alias("chat", "canary", 1, "x")
        .await
        .expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::NoWriteRights { status: 403 }),
        "{e}"
    );
    assert!(e.to_string().contains("write rights"), "{e}");
    let e = w
        .delete_alias("chat", "canary", "again")
        .await
        .expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::Status { status: 404, .. }),
        "{e}"
    );
    let e = w
        .set_alias("chat", "canary", 99, "x")
        .await
        .expect_err("refused");
    assert!(
        matches!(e, RegistrySourceError::Status { status: 404, .. }),
        "{e}"
    );
    s.stop().await;
}
