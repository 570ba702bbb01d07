//! `scripts/bench-streams`' two halves (never shipped):
//!
//! ```text
//! keel-streams backend --listen ADDR [--ttft-ms 200] [--interval-ms 250-500]
//!                      [--tokens 50-500] [--threads 1] [--seed N]
//! keel-streams load --url http://HOST:PORT/PATH --streams N [--open-rate 1000]
//!                   [--window-s 30] [--sources K] [--max-tokens 100000]
//!                   [--model chat] [-H 'name: value']... [--threads 1]
//!                   [--no-replace] [--idle-s 30]
//! ```
//!
//! `backend` streams chat completions (keel_testbackend::streams) and
//! prints `listening on ADDR` once bound. `load` holds N streams open at
//! once through the URL (each on its own connection, from K loopback
//! source addresses 127.0.1.1... so that no one address holds more than
//! a client's share of a proxy's connections), opening at most
//! `--open-rate` a second, measures for `--window-s` once all are open,
//! and prints one JSON object: streams opened, held at once, completed,
//! failed (no answer, a status other than 200, or a stream that ended
//! without `[DONE]` or with a token missing or out of order) by reason,
//! and the quantiles (µs) of the path's time to first token (the client's
//! wait minus the backend's own; of all streams, and of those opened
//! inside the window), of each token's delay (received minus
//! sent) and of each inter-token gap's excess over the backend's gap.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use keel_testbackend::streams::{self, quantile, BackendOptions, LoadOptions};
use serde_json::json;

fn usage() -> ! {
    eprintln!(
        "usage: keel-streams backend --listen ADDR [--ttft-ms MS] [--interval-ms LO-HI] [--tokens LO-HI] [--threads N] [--seed N]\n       keel-streams load --url URL --streams N [--open-rate R] [--window-s S] [--sources K] [--max-tokens N] [--model M] [-H 'k: v']... [--threads N] [--no-replace] [--idle-s S]"
    );
    std::process::exit(64)
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> T {
    v.parse().unwrap_or_else(|_| {
        eprintln!("keel-streams: {flag} {v:?} is not valid here (a number, a LO-HI range or HOST:PORT, as the flag takes)");
        std::process::exit(64)
    })
}

fn range(flag: &str, v: &str) -> (u64, u64) {
    match v.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (num(flag, a), num(flag, b));
            if a > b {
                eprintln!("keel-streams: {flag} {v:?}: the low end is above the high end");
                std::process::exit(64)
            }
            (a, b)
        }
        None => {
            let x = num(flag, v);
            (x, x)
        }
    }
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    let mut b = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.enable_all().build().unwrap_or_else(|e| {
        eprintln!("keel-streams: cannot start a runtime: {e}");
        std::process::exit(71)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        usage()
    };
    let mut flags: Vec<(String, String)> = Vec::new();
    let mut switches: Vec<String> = Vec::new();
    let mut i = 0;
    while i < rest.len() {
        let f = rest[i].clone();
        if f == "--no-replace" {
            switches.push(f);
            i += 1;
            continue;
        }
        let Some(v) = rest.get(i + 1) else { usage() };
        flags.push((f, v.clone()));
        i += 2;
    }
    let get = |k: &str| {
        flags
            .iter()
            .rev()
            .find(|(f, _)| f == k)
            .map(|(_, v)| v.as_str())
    };
    for (f, _) in &flags {
        let known: &[&str] = match cmd.as_str() {
            "backend" => &[
                "--listen",
                "--ttft-ms",
                "--interval-ms",
                "--tokens",
                "--threads",
                "--seed",
            ],
            "load" => &[
                "--url",
                "--streams",
                "--open-rate",
                "--window-s",
                "--sources",
                "--max-tokens",
                "--model",
                "-H",
                "--threads",
                "--idle-s",
            ],
            _ => usage(),
        };
        if !known.contains(&f.as_str()) {
            eprintln!("keel-streams {cmd}: unknown flag {f}");
            usage()
        }
    }
    let threads = get("--threads").map_or(1, |v| num("--threads", v));
    match cmd.as_str() {
        "backend" => {
            let listen: SocketAddr = num("--listen", get("--listen").unwrap_or("127.0.0.1:0"));
            let ms = |(a, b): (u64, u64)| (Duration::from_millis(a), Duration::from_millis(b));
            let opts = BackendOptions {
                ttft: Duration::from_millis(get("--ttft-ms").map_or(200, |v| num("--ttft-ms", v))),
                interval: ms(range(
                    "--interval-ms",
                    get("--interval-ms").unwrap_or("250-500"),
                )),
                tokens: {
                    let (a, b) = range("--tokens", get("--tokens").unwrap_or("50-500"));
                    (a as u32, b as u32)
                },
                hold_until: None,
                seed: get("--seed").map_or(1, |v| num("--seed", v)),
            };
            runtime(threads).block_on(async move {
                let l = tokio::net::TcpListener::bind(listen)
                    .await
                    .unwrap_or_else(|e| {
                        eprintln!("keel-streams: cannot listen on {listen}: {e}");
                        std::process::exit(71)
                    });
                let addr = l.local_addr().map_or(listen, |a| a);
                println!("listening on {addr}");
                streams::serve_backend(l, streams::Backend::new(opts)).await;
            });
        }
        "load" => {
            let url = get("--url").unwrap_or_else(|| usage());
            let Some(rest) = url.strip_prefix("http://") else {
                eprintln!("keel-streams: --url must be http://HOST:PORT/PATH");
                std::process::exit(64)
            };
            let (hostport, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, "/v1/chat/completions"),
            };
            let addr: SocketAddr = num("--url", hostport);
            let streams_n: usize = num("--streams", get("--streams").unwrap_or_else(|| usage()));
            let sources: u32 = get("--sources").map_or(64, |v| num("--sources", v));
            let sources = (0..sources)
                .map(|i| {
                    IpAddr::V4(Ipv4Addr::new(
                        127,
                        0,
                        1 + (i / 250) as u8,
                        1 + (i % 250) as u8,
                    ))
                })
                .collect();
            let mut headers = Vec::new();
            for (f, v) in &flags {
                if f != "-H" {
                    continue;
                }
                let Some((k, val)) = v.split_once(':') else {
                    eprintln!("keel-streams: -H {v:?} is not 'name: value'");
                    std::process::exit(64)
                };
                match (
                    http::HeaderName::from_bytes(k.trim().as_bytes()),
                    http::HeaderValue::from_str(val.trim()),
                ) {
                    (Ok(k), Ok(v)) => headers.push((k, v)),
                    _ => {
                        eprintln!("keel-streams: -H {v:?} is not a valid header");
                        std::process::exit(64)
                    }
                }
            }
            let model = get("--model").unwrap_or("chat");
            let max_tokens: u64 = get("--max-tokens").map_or(100_000, |v| num("--max-tokens", v));
            let body = json!({
                "model": model,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": max_tokens,
                "stream": true,
            })
            .to_string();
            let opts = LoadOptions {
                addr,
                path: path.to_owned(),
                headers,
                body: body.into(),
                streams: streams_n,
                open_per_s: get("--open-rate").map_or(1000, |v| num("--open-rate", v)),
                window: Duration::from_secs(get("--window-s").map_or(30, |v| num("--window-s", v))),
                replace: !switches.iter().any(|s| s == "--no-replace"),
                sources,
                idle: Duration::from_secs(get("--idle-s").map_or(30, |v| num("--idle-s", v))),
            };
            let started = std::time::Instant::now();
            let mut m = runtime(threads).block_on(streams::run_load(opts));
            m.ttft_path.sort_unstable();
            m.ttft_window.sort_unstable();
            m.delay.sort_unstable();
            m.gap_excess.sort_unstable();
            let q3 = |v: &Vec<u32>| json!({"n": v.len(), "p50": quantile(v, 0.5), "p99": quantile(v, 0.99), "p999": quantile(v, 0.999), "max": v.last()});
            let o = &m.outcomes;
            let by_status = o.iter().filter(|x| !x.open_at_end).fold(
                std::collections::BTreeMap::<String, u64>::new(),
                |mut acc, x| {
                    *acc.entry(x.status.to_string()).or_default() += 1;
                    acc
                },
            );
            let completed = o
                .iter()
                .filter(|x| x.status == 200 && x.done && x.in_order)
                .count();
            let cut = o
                .iter()
                .filter(|x| x.status == 200 && !x.open_at_end && (!x.done || !x.in_order))
                .count();
            let out_of_order = o.iter().filter(|x| x.status == 200 && !x.in_order).count();
            let refused = o
                .iter()
                .filter(|x| !x.open_at_end && x.status != 200)
                .count();
            let report = json!({
                "version": 1,
                "streams": streams_n,
                "opened": o.len(),
                "peak_open": m.peak_open,
                "open_at_end": o.iter().filter(|x| x.open_at_end).count(),
                "completed": completed,
                "cut": cut,
                "out_of_order": out_of_order,
                "refused_or_failed": refused,
                "by_status": by_status,
                "errors": m.errors,
                "window_s": (m.window.1.saturating_sub(m.window.0)) as f64 / 1e6,
                "window_start_us": m.window.0,
                "window_end_us": m.window.1,
                "window_tokens": m.window_tokens,
                "ttft_path_us": q3(&m.ttft_path),
                "ttft_window_us": q3(&m.ttft_window),
                "token_delay_us": q3(&m.delay),
                "gap_excess_us": {"n": m.gap_excess.len(), "p50": quantile(&m.gap_excess, 0.5), "p99": quantile(&m.gap_excess, 0.99), "p999": quantile(&m.gap_excess, 0.999)},
                "elapsed_s": started.elapsed().as_secs_f64(),
            });
            println!("{report}");
        }
        _ => usage(),
    }
}
