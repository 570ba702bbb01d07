//! What the pieces of keel's request path cost on their own, in process
//! (no sockets, no runtime): the work keel does for every proxied chat
//! completion beyond what the bare HTTP stack does
//! (`examples/bare-proxy.rs`). `scripts/bench-serve` measures the whole
//! path over loopback; this measures its parts, so a change to one of them
//! can be seen to the nanosecond.
//!
//!     cargo bench -p keel-gateway --bench request_path
//!
//! Each piece runs in batches for about half a second; the line gives the
//! median and the fastest batch's nanoseconds per call. With `--quick`
//! (or when run without `--bench`, as `cargo test --benches` does) each
//! piece runs a few thousand times only, to check that it works.

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use keel_gateway::keys::{KeyFile, KeyRing, NewKey, KEY_FILE_VERSION};
use keel_gateway::parts::usage_of_body;
use keel_gateway::parts::{self as request, Route};
use keel_gateway::parts::{Metrics, RequestLabels};

/// A chat completion request as `scripts/bench-serve` sends it.
const REQUEST: &[u8] = br#"{"model":"chat","messages":[{"role":"user","content":"Say something short."}],"max_tokens":16}"#;

/// A chat completion response as `keel-testbackend` answers it.
const RESPONSE: &[u8] = br#"{"choices":[{"finish_reason":"stop","index":0,"message":{"content":"tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok ","role":"assistant"}}],"created":0,"id":"cmpl-0","model":"chat","object":"chat.completion","system_fingerprint":"backend","usage":{"completion_tokens":16,"prompt_tokens":5,"total_tokens":21}}"#;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick");
    let filter = args.iter().skip(1).find(|a| !a.starts_with("--")).cloned();
    let budget = if full {
        Duration::from_millis(500)
    } else {
        Duration::ZERO
    };
    let ran = std::cell::Cell::new(0);
    let run = |name: &str, f: &mut dyn FnMut()| {
        if filter.as_deref().is_some_and(|p| !name.contains(p)) {
            return;
        }
        ran.set(ran.get() + 1);
        let (median, best) = measure(budget, f);
        println!("{name:<40} {median:>9.1} ns/call  (fastest batch {best:.1})");
    };

    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("keys.json");
    let mut file = KeyFile {
        version: KEY_FILE_VERSION,
        keys: Vec::new(),
    };
    let (_, secret) = file.create(
        NewKey {
            name: "bench".into(),
            roles: vec!["user".into()],
            team: None,
        },
        [7; 32],
        0,
    );
    file.store(&path).expect("the key file is written");
    let ring = KeyRing::open(&path).expect("the key file is read");
    run("key lookup (file check, SHA-256, map)", &mut || {
        let id = ring.lookup(black_box(&secret)).expect("the key file reads");
        assert!(id.is_some());
        black_box(id);
    });

    run("route", &mut || {
        black_box(request::route(&Method::POST, black_box("/v1/chat/completions")).ok());
    });

    let body = Bytes::from_static(REQUEST);
    let field = request::prompt_field(&Route::ChatCompletions);
    run("parse the request body", &mut || {
        black_box(request::parse_openai(black_box(&body), field).expect("valid"));
    });

    let (parsed, _) = request::parse_openai(&body, field).expect("valid");
    run("render the backend's body", &mut || {
        black_box(parsed.render(black_box("test"), false, None));
    });

    run("read usage from the response", &mut || {
        assert!(black_box(usage_of_body(black_box(RESPONSE))).is_some());
    });

    let metrics = Metrics::new();
    run("count the request in the metrics", &mut || {
        metrics.request(
            RequestLabels {
                route: "/v1/chat/completions",
                model: "chat",
                deployment: "blue",
                key: "k-0123456789abcdef",
                code: 200,
            },
            black_box(Duration::from_micros(10_400)),
            Some(Duration::from_micros(10_050)),
        );
        metrics.tokens("chat", "blue", "k-0123456789abcdef", 11, 16);
    });

    run("read the clock", &mut || {
        black_box(Instant::now());
    });
    if ran.get() == 0 {
        eprintln!(
            "request_path: no piece's name contains {:?}",
            filter.unwrap_or_default()
        );
        std::process::exit(2);
    }
}

/// Median and fastest nanoseconds per call over batches of `f` lasting
/// about a millisecond each, for `budget` in all (a few batches at least).
fn measure(budget: Duration, f: &mut dyn FnMut()) -> (f64, f64) {
    // Calls per batch: grown until one batch takes about a millisecond.
    let mut n: u64 = 1;
    loop {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        if t.elapsed() >= Duration::from_millis(1) || n >= 1 << 20 {
            break;
        }
        n *= 2;
    }
    let mut per_call = Vec::new();
    let start = Instant::now();
    while per_call.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        per_call.push(t.elapsed().as_nanos() as f64 / n as f64);
    }
    per_call.sort_by(|a, b| a.total_cmp(b));
    (per_call[per_call.len() / 2], per_call[0])
}
