//! Long streams at the shape LLM traffic has: many open at once, mostly
//! idle between tokens. The backend and the load generator are
//! keel-testbackend's (`keel_testbackend::streams`, the ones
//! `scripts/bench-streams` runs), in this process.

#[allow(unused_imports)]
mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use keel_testbackend::streams::{self, Backend, BackendOptions, LoadOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Raises this process's open-file limit to what the test needs (the soft
/// limit up to the hard one), or says why it cannot run.
fn need_files(n: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    if l.current.is_some_and(|c| c >= n) {
        return;
    }
    let hard = l.maximum;
    assert!(
        hard.is_none_or(|h| h >= n),
        "this test holds {n} sockets; the hard open-file limit is {hard:?} (raise it: ulimit -Hn)"
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(n.max(l.current.unwrap_or(0))),
            maximum: hard,
        },
    )
    .expect("raise the open-file limit");
}

/// A backend on a runtime of its own thread.
fn start_backend(opts: BackendOptions) -> (Arc<Backend>, SocketAddr, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = Backend::new(opts);
    let l = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    rt.spawn(streams::serve_backend(l, backend.clone()));
    (backend, addr, rt)
}

#[test]
fn a_thousand_concurrent_streams_all_complete_in_order_and_are_charged_exactly() {
    const STREAMS: usize = 1000;
    const TOKENS: u32 = 20;
    // Each stream: the client's socket, the gateway's two, the backend's.
    need_files(4 * STREAMS as u64 + 512);
    // Every stream waits after its first token until all 1,000 have sent
    // theirs: none can end before all are open at once.
    let (backend, baddr, _brt) = start_backend(BackendOptions {
        ttft: Duration::ZERO,
        interval: (Duration::ZERO, Duration::ZERO),
        tokens: (TOKENS, TOKENS),
        hold_until: Some(STREAMS),
        seed: 5,
    });
    let dir = tempfile::tempdir().expect("tempdir");
    // The defaults but for generous head and body timeouts (1,000
    // connections open in a burst on a shared machine) and limits that
    // every stream is charged against.
    let cfg = format!(
        "{}[limits.default]\nrequests_per_minute = 100000\ntokens_per_minute = 1000000000\ntokens_per_day = 1000000000\n{}",
        head(dir.path())
            .replace("header_timeout_ms = 500", "header_timeout_ms = 60000")
            .replace("body_timeout_ms = 500", "body_timeout_ms = 60000"),
        model("chat", "", &[("blue", format!("http://{baddr}"), 1)])
    );
    let (id, key) = add_key(dir.path(), "streamer", &["user"], None);
    let g = Running::start(dir.path(), &cfg);

    // Eight client addresses (125 connections each, under the default
    // 256 a client).
    let sources = (1..=8)
        .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 2, i)))
        .collect();
    let body = json!({
        "model": "chat",
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 64,
        "stream": true,
    });
    let load = LoadOptions {
        addr: g.public,
        path: "/v1/chat/completions".into(),
        headers: vec![(
            ::http::header::AUTHORIZATION,
            ::http::HeaderValue::from_str(&format!("Bearer {key}")).expect("header"),
        )],
        body: body.to_string().into(),
        streams: STREAMS,
        open_per_s: 2000,
        window: Duration::ZERO,
        replace: false,
        sources,
        idle: Duration::from_secs(120),
    };
    let crt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let m = crt.block_on(streams::run_load(load));

    assert!(m.errors.is_empty(), "connections failed: {:?}", m.errors);
    assert_eq!(m.outcomes.len(), STREAMS);
    for (i, o) in m.outcomes.iter().enumerate() {
        assert_eq!(o.status, 200, "stream {i}: {o:?}");
        assert!(
            o.in_order,
            "stream {i}: a token missing or out of order: {o:?}"
        );
        assert_eq!(o.tokens, TOKENS, "stream {i}: {o:?}");
        assert!(o.done, "stream {i} ended without [DONE]: {o:?}");
        assert!(
            !o.usage,
            "stream {i}: the usage chunk the gateway asked for reached the client"
        );
    }
    assert_eq!(backend.started(), STREAMS as u64);
    assert_eq!(backend.finished(), STREAMS as u64);
    assert_eq!(backend.tokens_sent(), STREAMS as u64 * u64::from(TOKENS));

    // Every stream's body ends after it is settled: the counters are
    // final now, and hold exactly what the backend reported.
    let reported = backend.usage_reported();
    let u = g.usage(&format!("key:{id}"));
    assert_eq!(u["requests"], STREAMS as u64);
    assert_eq!(u["tokens"], reported, "{u}");
    assert_eq!(u["day_tokens"], reported, "{u}");
    let audit = g.stop();
    let lines: Vec<_> = audit.iter().filter(|e| e["event"] == "request").collect();
    assert_eq!(lines.len(), STREAMS);
    let mut charged = 0;
    for e in &lines {
        assert_eq!(e["status"], 200, "{e}");
        assert_eq!(e["completion_tokens"], TOKENS, "{e}");
        assert!(e.get("usage_estimated").is_none(), "{e}");
        assert!(e.get("error").is_none(), "{e}");
        charged += e["prompt_tokens"].as_u64().expect("prompt tokens") + u64::from(TOKENS);
    }
    assert_eq!(charged, reported);
}

/// Reads from `s` until `needle` has come.
async fn read_until(s: &mut tokio::net::TcpStream, seen: &mut Vec<u8>, needle: &[u8]) {
    let mut buf = [0u8; 4096];
    while !seen.windows(needle.len()).any(|w| w == needle) {
        let n = s.read(&mut buf).await.expect("read");
        assert!(n > 0, "closed before {:?}", String::from_utf8_lossy(needle));
        seen.extend_from_slice(&buf[..n]);
    }
}

/// Opens `streams` streams 1.37 s apart (so that per-stream timers of
/// whole seconds would not fire together) on a runtime whose clock is
/// paused, then waits for the first stream's second token, ten minutes
/// after its first: returns how often the runtime parked meanwhile and how
/// long the wait was. With the clock paused the runtime only wakes when
/// some timer is due (or a socket is ready), so the parks count the timers
/// that fired while every stream was idle.
fn idle_parks(streams: usize) -> (u64, Duration) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, key) = add_key(dir.path(), "idle", &["user"], None);
    rt.block_on(async {
        // Two tokens, ten minutes apart.
        let backend = Backend::new(BackendOptions {
            ttft: Duration::ZERO,
            interval: (Duration::from_secs(600), Duration::from_secs(600)),
            tokens: (2, 2),
            hold_until: None,
            seed: 1,
        });
        let bl = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let baddr = bl.local_addr().expect("addr");
        tokio::spawn(streams::serve_backend(bl, backend));
        // Every deadline an hour, so that none passes while the clock
        // jumps; no health probes.
        let cfg = format!(
            "{}{}",
            head(dir.path())
                .replace("header_timeout_ms = 500", "header_timeout_ms = 3600000")
                .replace("body_timeout_ms = 500", "body_timeout_ms = 3600000")
                .replace("[traffic]\n", "[traffic]\nconnect_timeout_ms = 3600000\ntimeout_ms = 3600000\nstream_idle_timeout_ms = 3600000\n")
                .replace("interval_ms = 100", "enabled = false"),
            model("chat", "", &[("blue", format!("http://{baddr}"), 1)])
        );
        std::fs::write(dir.path().join("gateway.toml"), &cfg).expect("config");
        let cfg = keel_gateway::GatewayConfig::load(&dir.path().join("gateway.toml"))
            .expect("valid config");
        let public = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = public.local_addr().expect("addr");
        let gw = keel_gateway::Gateway::new(
            cfg,
            keel_gateway::GatewayOptions {
                clock: Arc::new(keel_gateway::ManualClock::new(1_767_225_600_000)),
                seed: 1,
                reload: None,
                access_sink: None,
                machine: None,
            },
        )
        .await
        .expect("gateway");
        tokio::spawn(keel_gateway::run(
            gw,
            keel_gateway::Listeners {
                public,
                admin: None,
                metrics: None,
            },
            std::future::pending(),
        ));
        let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true}).to_string();
        let mut conns = Vec::new();
        for _ in 0..streams {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).await.expect("write");
            let mut seen = Vec::new();
            read_until(&mut s, &mut seen, b"\"content\":\"0@").await;
            conns.push((s, seen));
            tokio::time::sleep(Duration::from_millis(1370)).await;
        }
        // Every stream is open and waits for its second token.
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.worker_park_count(0);
        let t0 = tokio::time::Instant::now();
        let (s, seen) = &mut conns[0];
        read_until(s, seen, b"\"content\":\"1@").await;
        let parks = metrics.worker_park_count(0) - before;
        (parks, t0.elapsed())
    })
}

/// An open stream waiting for its next token arms no timer that fires
/// before the stream's idle timeout: twenty idle streams wake the runtime
/// no more often over ten minutes than one does, but for at most one
/// write deadline each that was set and never reached (it is not taken
/// out of the timer wheel when disarmed). A timer per stream firing once
/// a second would add over 11,000 wake-ups.
#[test]
fn an_idle_stream_wakes_no_timer_before_its_idle_timeout() {
    let (one, one_for) = idle_parks(1);
    let (many, many_for) = idle_parks(20);
    for w in [one_for, many_for] {
        assert!(w >= Duration::from_secs(600 - 29), "{w:?}");
    }
    let allowed = one + 20 + 4;
    assert!(
        many <= allowed,
        "the runtime woke {many} times over {many_for:?} of 20 idle streams against {one} over {one_for:?} for one (at most {allowed}): some stream's timer fires before its idle timeout"
    );
}
