//! The floor under `keel serve`, for `scripts/bench-serve`: the HTTP stack
//! (hyper's HTTP/1 server and client, here through hyper-util's pooled
//! client with the gateway's connector settings where keel keeps its own
//! pool of hyper's client connections; a tokio runtime of WORKERS threads,
//! jemalloc, as keel) forwarding every request to one backend as it is, and nothing
//! else: no authentication, limits, routing, metrics or logs. What keel
//! adds over this is what its features cost; what this adds over nginx is
//! what the stack costs.
//!
//!     cargo run --release -p keel-gateway --example bare-proxy -- LISTEN BACKEND [WORKERS]
//!
//! LISTEN is `127.0.0.1:PORT`, BACKEND `http://host:port`. Not a product:
//! it answers 502 when the backend fails and has no timeouts. A streamed
//! answer (`text/event-stream`) is passed on as it comes, hyper's body
//! straight through (`scripts/bench-streams`' floor); any other is read
//! whole first, as keel reads it.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn usage() -> ! {
    eprintln!(
        "usage: bare-proxy LISTEN BACKEND [WORKERS]  (e.g. 127.0.0.1:8080 http://127.0.0.1:8000 1)"
    );
    std::process::exit(64);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(listen), Some(backend)) = (args.first(), args.get(1)) else {
        usage()
    };
    let workers = match args.get(2).map(|w| w.parse::<usize>()) {
        None => 1,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => usage(),
    };
    let backend = backend.trim_end_matches('/').to_owned();
    if !backend.starts_with("http://") || backend.parse::<Uri>().is_err() {
        usage();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("bare-proxy: runtime: {e}");
            std::process::exit(70);
        });
    let listen = listen.clone();
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(&listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("bare-proxy: bind {listen}: {e}");
                std::process::exit(74);
            }
        };
        // The gateway's client settings (keel-gateway's `Upstream`).
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(Duration::from_secs(5)));
        c.set_nodelay(true);
        c.set_keepalive(Some(Duration::from_secs(60)));
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(512)
            .build(c);
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let client = client.clone();
            let backend = backend.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    forward(client.clone(), backend.clone(), req)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

/// A whole body, or a stream passed on as it comes.
type Answer = Either<
    http_body_util::combinators::MapErr<Full<Bytes>, fn(Infallible) -> hyper::Error>,
    Incoming,
>;

fn whole(b: Bytes) -> Answer {
    Either::Left(Full::new(b).map_err((|never| match never {}) as fn(Infallible) -> hyper::Error))
}

/// The request to the backend with its path, headers and body; the
/// backend's answer (status, headers, body) back.
async fn forward(
    client: Client<HttpConnector, Full<Bytes>>,
    backend: String,
    req: Request<Incoming>,
) -> Result<Response<Answer>, Infallible> {
    let bad_gateway = || {
        let mut r = Response::new(whole(Bytes::new()));
        *r.status_mut() = StatusCode::BAD_GATEWAY;
        r
    };
    let (mut parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(bad_gateway());
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("{backend}{path}").parse::<Uri>() else {
        return Ok(bad_gateway());
    };
    parts.uri = uri;
    parts.headers.remove(http::header::HOST);
    let Ok(resp) = client
        .request(Request::from_parts(parts, Full::new(body)))
        .await
    else {
        return Ok(bad_gateway());
    };
    let (parts, body) = resp.into_parts();
    let streamed = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if streamed {
        return Ok(Response::from_parts(parts, Either::Right(body)));
    }
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(bad_gateway());
    };
    Ok(Response::from_parts(parts, whole(body)))
}
