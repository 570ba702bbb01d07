//! The accept loop over real sockets: places, eviction of unauthenticated
//! slow heads, deadlines, the head size cap, and the drain.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use keel_http::{Authenticated, Limits, ServeOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `GET /` with `Authorization: Bearer good` is 200 and authenticated;
/// anything else is 401.
async fn app(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let good = keel_http::bearer_token(req.headers()) == Some("good");
    let mut r = Response::new(Full::new(Bytes::from(if good {
        "x".repeat(16 << 10)
    } else {
        "no\n".to_owned()
    })));
    if good {
        r.extensions_mut().insert(Authenticated);
    } else {
        *r.status_mut() = StatusCode::UNAUTHORIZED;
    }
    Ok(r)
}

type Svc = tower::util::BoxCloneService<Request<Incoming>, Response<Full<Bytes>>, Infallible>;

fn svc() -> Svc {
    tower::util::BoxCloneService::new(tower::service_fn(app))
}

fn busy(why: &'static str) -> Vec<u8> {
    keel_http::busy_answer("text/plain", why)
}

struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(limits: Limits) -> Running {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let opts = ServeOptions {
        limits,
        busy,
        bad_host: None,
    };
    let server = tokio::spawn(keel_http::serve(l, svc(), opts, async {
        let _ = rx.await;
    }));
    Running {
        addr,
        stop: Some(tx),
        server,
    }
}

impl Running {
    async fn stop(mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        tokio::time::timeout(Duration::from_secs(10), self.server)
            .await
            .expect("stops")
            .expect("join")
            .expect("serve");
    }
}

async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().expect("socket");
    s.bind(SocketAddr::from((source, 0))).expect("bind source");
    s.connect(addr).await.expect("connect")
}

const GOOD: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n\r\n";

/// Everything until the peer closes, or None if it stays open `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match tokio::time::timeout(within, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n.min(4096)]),
            Err(_) => return None,
        }
    }
}

/// One answer: a head and a Content-Length body.
async fn answer(s: &mut TcpStream) -> String {
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
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return text,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("no answer within 10 s: {text}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_cut_after_the_write_timeout() {
    let r = start(Limits {
        max_connections: 1,
        write_timeout: Duration::from_millis(500),
        ..Limits::default()
    })
    .await;
    let deaf = tokio::net::TcpSocket::new_v4().expect("socket");
    deaf.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut deaf = deaf.connect(r.addr).await.expect("connect");
    let flood = GOOD.repeat(1000);
    let writer = tokio::spawn(async move { while deaf.write_all(&flood).await.is_ok() {} });
    tokio::time::timeout(Duration::from_secs(20), writer)
        .await
        .expect("the server closes the connection of a client that reads nothing")
        .expect("join");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_give_way_to_new_connections_and_never_to_authenticated_ones() {
    let r = start(Limits {
        max_connections: 4,
        max_per_client: 2,
        reserved: 1,
        header_timeout: Duration::from_secs(120),
        idle_timeout: Duration::from_secs(120),
        ..Limits::default()
    })
    .await;
    // Three unauthenticated connections that send nothing: all the places
    // they may hold (4 less the reserved one).
    let mut slow = Vec::new();
    for i in 0..3u8 {
        slow.push(connect_from([127, 0, 3, 1 + i], r.addr).await);
    }
    // A fourth client with a token: the oldest slow head is closed for it.
    let mut keyed = connect_from([127, 0, 3, 10], r.addr).await;
    keyed.write_all(GOOD).await.expect("write");
    let a = answer(&mut keyed).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    assert_eq!(
        closed_within(&mut slow[0], Duration::from_secs(10)).await,
        Some(String::new()),
        "the oldest slow head is closed without an answer"
    );
    // A client over its share is refused at once, taking no one's place:
    // 127.0.3.2 holds slow[1] and a second one.
    slow.push(connect_from([127, 0, 3, 2], r.addr).await);
    let mut third = connect_from([127, 0, 3, 2], r.addr).await;
    let a = closed_within(&mut third, Duration::from_secs(10))
        .await
        .expect("closed");
    assert!(a.starts_with("HTTP/1.1 503"), "{a}");
    assert!(a.contains("too many connections from this address"), "{a}");
    // Many more slow heads: they make room among themselves, never by
    // closing the authenticated connection, which is served again.
    for i in 0..20u8 {
        slow.push(connect_from([127, 0, 4, 1 + i], r.addr).await);
    }
    keyed.write_all(GOOD).await.expect("write");
    let a = answer(&mut keyed).await;
    assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    drop(slow);
    drop(keyed);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_place_is_authenticated_a_new_connection_is_refused_at_once() {
    let r = start(Limits {
        max_connections: 2,
        reserved: 0,
        ..Limits::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(r.addr).await.expect("connect");
        s.write_all(GOOD).await.expect("write");
        assert!(answer(&mut s).await.starts_with("HTTP/1.1 200"));
        held.push(s);
    }
    let mut over = TcpStream::connect(r.addr).await.expect("connect");
    let a = closed_within(&mut over, Duration::from_secs(10))
        .await
        .expect("closed");
    assert!(a.starts_with("HTTP/1.1 503"), "{a}");
    assert!(a.contains("Retry-After: 1"), "{a}");
    // One of them closes: its place comes back.
    drop(held.pop());
    let mut again = loop {
        let mut s = TcpStream::connect(r.addr).await.expect("connect");
        s.write_all(GOOD).await.expect("write");
        let a = answer(&mut s).await;
        if a.starts_with("HTTP/1.1 200") {
            break s;
        }
        assert!(a.starts_with("HTTP/1.1 503"), "{a}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    again.write_all(GOOD).await.expect("write");
    assert!(answer(&mut again).await.starts_with("HTTP/1.1 200"));
    drop(held);
    drop(again);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_the_cap_is_431_and_a_silent_connection_ends_at_the_header_timeout() {
    let r = start(Limits {
        max_head_bytes: 8 << 10,
        header_timeout: Duration::from_millis(300),
        ..Limits::default()
    })
    .await;
    let mut s = TcpStream::connect(r.addr).await.expect("connect");
    let long = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(16 << 10)
    );
    let _ = s.write_all(long.as_bytes()).await;
    let a = closed_within(&mut s, Duration::from_secs(10))
        .await
        .expect("closed");
    assert!(a.starts_with("HTTP/1.1 431"), "{a}");
    // A head never finished: closed by the header timeout, not by the
    // test's patience.
    let mut s = TcpStream::connect(r.addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\n").await.expect("write");
    assert!(closed_within(&mut s, Duration::from_secs(10))
        .await
        .is_some());
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_lifetime_a_connection_answers_with_connection_close() {
    let r = start(Limits {
        lifetime: Duration::from_millis(300),
        idle_timeout: Duration::from_secs(60),
        ..Limits::default()
    })
    .await;
    let mut s = TcpStream::connect(r.addr).await.expect("connect");
    s.write_all(GOOD).await.expect("write");
    let a = answer(&mut s).await;
    assert!(!a.to_ascii_lowercase().contains("connection: close"), "{a}");
    // Kept alive past its lifetime: closed.
    assert!(closed_within(&mut s, Duration::from_secs(10))
        .await
        .is_some());
    r.stop().await;
}
