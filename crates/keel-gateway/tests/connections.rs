//! What a client connection may hold and for how long: the connection cap,
//! the body budget, the request checks made before a body is read, the
//! head's size, the write and idle timeouts, and the `Host` rule.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn one_backend(dir: &std::path::Path, b: &TestBackend, server: &str, extra: &str) -> String {
    format!(
        "{}{extra}{}",
        head(dir).replace("[server]\n", &format!("[server]\n{server}\n")),
        model("chat", "", &[("blue", b.url(), 1)])
    )
}

/// A raw connection that gives up reading after 5 s.
fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

/// Everything the server sends until it closes (or 5 s pass).
fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `request` on a new connection and returns what comes back.
fn send(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = raw(addr);
    s.write_all(request).expect("write");
    read_all(&mut s)
}

/// A chat request of exactly `len` bytes.
fn chat_of(len: usize) -> Vec<u8> {
    let empty =
        json!({"model": "chat", "messages": [{"role": "user", "content": ""}], "max_tokens": 8})
            .to_string();
    let v = json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(len - empty.len())}], "max_tokens": 8});
    let b = v.to_string().into_bytes();
    assert_eq!(b.len(), len);
    b
}

fn post_head(path: &str, key: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    )
}

#[test]
fn http11_requests_without_exactly_one_host_are_400() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let g = Running::start(dir.path(), &one_backend(dir.path(), &b, "", ""));
    let status = |addr, req: &str| {
        let out = send(addr, req.as_bytes());
        out.lines().next().unwrap_or("").to_owned()
    };
    let public = g.public;
    assert_eq!(
        status(
            public,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        ),
        "HTTP/1.1 200 OK"
    );
    assert_eq!(
        status(public, "GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"),
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(
        status(
            public,
            "GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n"
        ),
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(
        status(public, "GET /healthz HTTP/1.0\r\n\r\n"),
        "HTTP/1.0 200 OK",
        "HTTP/1.0 has no Host requirement"
    );
    let admin = format!(
        "GET /admin/status HTTP/1.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(status(g.admin, &admin), "HTTP/1.1 400 Bad Request");
    g.stop();
}

#[test]
fn a_request_head_longer_than_max_header_bytes_is_431() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    // The default, 32 KiB.
    let g = Running::start(dir.path(), &one_backend(dir.path(), &b, "", ""));
    let fits = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nx-pad: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(16 << 10)
    );
    assert!(send(g.public, fits.as_bytes()).starts_with("HTTP/1.1 200"));
    // A head not finished within the buffer: exactly 32 KiB of it, so
    // that the gateway has read all that was sent when it answers.
    let mut long = b"GET /healthz HTTP/1.1\r\nHost: x\r\nx-pad: ".to_vec();
    long.resize(32 << 10, b'a');
    let out = send(g.public, &long);
    assert!(out.starts_with("HTTP/1.1 431"), "{out:?}");
    g.stop();
}

#[test]
fn connections_beyond_max_connections_are_answered_503_and_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = one_backend(dir.path(), &b, "max_connections = 3", "")
        .replace("header_timeout_ms = 500", "header_timeout_ms = 20000");
    let g = Running::start(dir.path(), &cfg);
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    // Three clients with a key keep their connections alive: a connection
    // without a key would be closed to make room for a new one.
    let models =
        format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n");
    let mut held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = raw(g.public);
            s.write_all(models.as_bytes()).expect("write");
            let a = one_answer(&mut s);
            assert!(a.starts_with("HTTP/1.1 200"), "{a}");
            s
        })
        .collect();
    let mut over = raw(g.public);
    let out = read_all(&mut over);
    assert!(out.starts_with("HTTP/1.1 503"), "{out:?}");
    assert!(out.contains("retry-after: 1"), "{out:?}");
    // The held connections are served; one that closes frees its place.
    held[0]
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("write");
    assert!(read_all(&mut held[0]).starts_with("HTTP/1.1 200"));
    held.remove(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = send(
            g.public,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        if out.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(out.starts_with("HTTP/1.1 503"), "{out:?}");
        assert!(
            Instant::now() < deadline,
            "the closed connection's place never came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Each listener has its own places: admin still answers.
    assert_eq!(
        http::get(g.admin, "/admin/status", ADMIN_TOKEN)
            .expect("admin")
            .status,
        200
    );
    drop(held);
    g.stop();
}

/// A connection from `source` (a loopback address of its own: a client of
/// its own) that gives up reading after 5 s.
fn raw_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.bind(&SocketAddr::from((source, 0)).into())
        .expect("bind the source address");
    sock.connect(&addr.into()).expect("connect");
    let s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

/// One answer's head and Content-Length body from a kept-alive connection.
fn one_answer(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .and_then(|v| v.trim().parse::<usize>().ok())
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return text,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn clients_without_a_key_cannot_take_every_place_from_a_client_with_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = one_backend(dir.path(), &b, "max_connections = 8", "")
        .replace("header_timeout_ms = 500", "header_timeout_ms = 60000");
    let g = Running::start(dir.path(), &cfg);
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    // 8 clients without a key hold every place with heads never sent.
    let mut slow: Vec<TcpStream> = (0..8u8)
        .map(|i| raw_from([127, 0, 7, 1 + i], g.public))
        .collect();
    // A client with a key is served: the oldest slow head made room.
    let models =
        format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n");
    let mut keyed = raw_from([127, 0, 0, 1], g.public);
    keyed.write_all(models.as_bytes()).expect("write");
    let a = one_answer(&mut keyed);
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(read_all(&mut slow[0]), "", "the oldest slow head is closed");
    // More slow heads never close the connection with a key.
    slow.extend((0..12u8).map(|i| raw_from([127, 0, 8, 1 + i], g.public)));
    keyed.write_all(models.as_bytes()).expect("write");
    let a = one_answer(&mut keyed);
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    drop(slow);
    g.stop();
}

#[test]
fn connections_beyond_max_connections_per_client_are_answered_503() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = one_backend(dir.path(), &b, "max_connections_per_client = 2", "")
        .replace("header_timeout_ms = 500", "header_timeout_ms = 60000");
    let g = Running::start(dir.path(), &cfg);
    let _held: Vec<TcpStream> = (0..2).map(|_| raw_from([127, 0, 9, 1], g.public)).collect();
    let mut over = raw_from([127, 0, 9, 1], g.public);
    let out = read_all(&mut over);
    assert!(out.starts_with("HTTP/1.1 503"), "{out:?}");
    assert!(out.contains("from this address"), "{out:?}");
    // Another client is served.
    let out = send(
        g.public,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(out.starts_with("HTTP/1.1 200"), "{out:?}");
    g.stop();
}

#[test]
fn bodies_beyond_max_body_bytes_in_flight_are_503() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--tokens", "50000"]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "max_body_bytes = 100000\nmax_body_bytes_in_flight = 150000",
        "",
    )
    .replace("body_timeout_ms = 500", "body_timeout_ms = 20000");
    let g = Running::start(dir.path(), &cfg);
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let post = |body: &[u8]| {
        let mut r = post_head("/v1/chat/completions", &key, body.len()).into_bytes();
        r.extend_from_slice(body);
        send(g.public, &r)
    };
    // One client declares 100,000 bytes and sends a few: they are counted
    // from before the first byte is read.
    let mut slow = raw(g.public);
    slow.write_all(post_head("/v1/chat/completions", &key, 100_000).as_bytes())
        .expect("write");
    let body = chat_of(100_000);
    slow.write_all(&body[..1000]).expect("write");
    let in_flight = || {
        g.metrics_text()
            .lines()
            .find_map(|l| l.strip_prefix("keel_body_bytes_in_flight "))
            .map(|v| v.parse::<u64>().expect("a number"))
            .expect("the gauge")
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight() != 100_000 {
        assert!(Instant::now() < deadline, "the slow body was never counted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = post(&chat_of(60_000));
    assert!(out.starts_with("HTTP/1.1 503"), "{out}");
    assert!(out.contains("retry-after: 1"), "{out}");
    assert!(out.contains("service_unavailable"), "{out}");
    assert!(
        post(&chat_of(40_000)).starts_with("HTTP/1.1 200"),
        "40,000 more fit"
    );
    // The slow body arrives; its bytes are given back.
    slow.write_all(&body[1000..]).expect("write");
    assert!(read_all(&mut slow).starts_with("HTTP/1.1 200"));
    assert!(post(&chat_of(60_000)).starts_with("HTTP/1.1 200"));
    // A body without a length is counted as it arrives.
    let mut s = raw(g.public);
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").expect("w");
    let chunked = chat_of(99_000);
    for piece in chunked.chunks(10_000) {
        write!(s, "{:x}\r\n", piece.len()).expect("w");
        s.write_all(piece).expect("w");
        s.write_all(b"\r\n").expect("w");
    }
    s.write_all(b"0\r\n\r\n").expect("w");
    assert!(read_all(&mut s).starts_with("HTTP/1.1 200"));
    // A backend response is counted too: 200,000 bytes do not fit.
    let big = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50000});
    let out = post(big.to_string().as_bytes());
    assert!(
        out.starts_with("HTTP/1.1 503"),
        "{}",
        &out[..out.len().min(300)]
    );
    assert!(post(&chat_of(1000)).starts_with("HTTP/1.1 200"));
    assert_eq!(in_flight(), 0, "every byte is given back");
    g.stop();
}

#[test]
fn a_key_out_of_requests_or_without_the_operation_is_refused_before_its_body() {
    refused_before_the_body("limited", "");
}

#[test]
#[ignore = "needs Redis: scripts/test starts one"]
fn a_key_out_of_requests_is_refused_before_its_body_with_redis() {
    // A key of its own each run: Redis keeps the counters for a minute.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_nanos();
    refused_before_the_body(
        &format!("limited-{t}"),
        &format!(
            "[limits]\nredis_url = \"{}\"\n",
            keel_testkit::serve::redis_url()
        ),
    );
}

fn refused_before_the_body(name: &str, limits: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let (id, key) = add_key(dir.path(), name, &["user"], None);
    let cfg = one_backend(
        dir.path(),
        &b,
        "",
        &format!("{limits}[limits.keys.{id}]\nrequests_per_minute = 1\n"),
    )
    .replace("body_timeout_ms = 500", "body_timeout_ms = 20000");
    let g = Running::start(dir.path(), &cfg);
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    // 4 MB announced, 64 KiB sent: the answer comes without the rest.
    let started = Instant::now();
    let mut s = raw(g.public);
    s.write_all(post_head("/v1/chat/completions", &key, 4_000_000).as_bytes())
        .expect("write");
    s.write_all(&vec![b' '; 64 << 10]).expect("write");
    let r = http::read_response(&mut BufReader::new(&mut s)).expect("an answer before the body");
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // The rest of the body is never read: the answer says the connection
    // closes, so that a pooling client does not send its next request on it.
    assert_eq!(r.header("connection"), Some("close"));
    assert!(started.elapsed() < Duration::from_secs(5));
    // The same for a body without a length.
    let mut s = raw(g.public);
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n8000\r\n{}", " ".repeat(0x8000)).expect("w");
    let r = http::read_response(&mut BufReader::new(&mut s)).expect("an answer before the body");
    assert_eq!(r.status, 429, "{}", r.text());
    // A small body is read and admission refuses it as before.
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 429, "{}", r.text());
    // Roles that do not allow the operation at all: 403 before the body.
    let (_, other) = add_key(dir.path(), "other", &["user"], None);
    let mut s = raw(g.public);
    s.write_all(post_head("/v1/embeddings", &other, 4_000_000).as_bytes())
        .expect("write");
    s.write_all(&vec![b' '; 64 << 10]).expect("write");
    let r = http::read_response(&mut BufReader::new(&mut s)).expect("an answer before the body");
    assert_eq!(r.status, 403, "{}", r.text());
    let audit = g.stop();
    let refused: Vec<_> = audit
        .iter()
        .filter(|e| e["status"] == 429)
        .map(|e| e["key"].clone())
        .collect();
    assert_eq!(refused.len(), 3, "{audit:?}");
    assert!(refused.iter().all(|k| *k == json!(id)), "{refused:?}");
}

#[test]
fn a_client_that_does_not_read_its_response_is_cut_off_after_write_timeout_ms() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 16 MB of completion: more than the sockets' buffers hold.
    let b = TestBackend::start(&["--tokens", "4000000"]);
    let cfg = one_backend(dir.path(), &b, "write_timeout_ms = 300", "");
    let g = Running::start(dir.path(), &cfg);
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000000}).to_string();
    // A small receive buffer, set before connecting: with the kernel's
    // autotuning (tcp_rmem up to 32 MiB) a default socket could take the
    // whole answer unread and the write timeout would never start.
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    sock.connect(&g.public.into()).expect("connect");
    let mut s: TcpStream = sock.into();
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut req = post_head("/v1/chat/completions", &key, body.len()).into_bytes();
    req.extend_from_slice(body.as_bytes());
    s.write_all(&req).expect("write");
    // A non-streamed answer is recorded in the audit log once the gateway
    // holds all of it, before it is written: from that line on, only the
    // client's reading can move the write. Waiting for the line, not a
    // fixed time, keeps a slow backend on a loaded machine from being
    // mistaken for a gateway that waits.
    let audit = dir.path().join("audit.jsonl");
    let t = Instant::now();
    while !std::fs::read_to_string(&audit)
        .unwrap_or_default()
        .contains("/v1/chat/completions")
    {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no audit line for the request"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The write timeout is 300 ms; the client still reads nothing.
    std::thread::sleep(Duration::from_secs(3));
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let head = String::from_utf8_lossy(&got[..got.len().min(400)]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        got.len() < 16_000_000,
        "the whole response waited for the client ({} bytes)",
        got.len()
    );
    // The next client is served as usual.
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200);
    g.stop();
}

#[test]
fn a_kept_alive_connection_is_closed_after_idle_timeout_ms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = one_backend(dir.path(), &b, "idle_timeout_ms = 300", "")
        .replace("header_timeout_ms = 500", "header_timeout_ms = 5000");
    let g = Running::start(dir.path(), &cfg);
    // A new connection waits for its first request as long as a head may
    // take (header_timeout_ms), not the idle timeout.
    let mut s = raw(g.public);
    std::thread::sleep(Duration::from_millis(900));
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    assert_eq!(http::read_response(&mut r).expect("served").status, 200);
    // Kept alive after it, the connection is closed once idle for 300 ms.
    let t = Instant::now();
    let mut rest = Vec::new();
    let n = r.read_to_end(&mut rest).expect("closed, not timed out");
    assert_eq!(n, 0);
    let idle = t.elapsed();
    assert!(
        idle >= Duration::from_millis(250) && idle < Duration::from_secs(3),
        "closed after {idle:?}"
    );
    g.stop();
}
