//! The gateway end to end: an in-process gateway in front of test
//! backends running as separate processes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use keel_gateway::parts::ROUTES;
use keel_gateway::ManualClock;
use serde_json::{json, Value};

fn one_backend(dir: &std::path::Path, b: &TestBackend, extra_head: &str) -> String {
    format!(
        "{}{extra_head}{}",
        head(dir),
        model("chat", "", &[("blue", b.url(), 1)])
    )
}

#[test]
fn every_route_rejects_missing_wrong_and_revoked_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--name", "b"]);
    let cfg = format!(
        "{}{}",
        one_backend(dir.path(), &b, ""),
        model("resnet", "protocol = \"oip\"", &[("r", b.url(), 1)])
    );
    let (id, secret) = add_key(dir.path(), "ops", &["ops"], None);
    let (revoked_id, revoked) = add_key(dir.path(), "gone", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    revoke(dir.path(), &revoked_id);
    let body = json!({"model": "resnet", "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).to_string();
    let mut checked = 0;
    for (method, path, public) in ROUTES {
        let path = path.replace("{name}", "resnet").replace("{version}", "1");
        let body: &[u8] = if *method == "POST" {
            body.as_bytes()
        } else {
            b""
        };
        let send =
            |h: &[(&str, &str)]| http::request(g.public, method, &path, h, body).expect("request");
        let missing = send(&[]);
        if *public {
            assert_eq!(
                missing.status,
                200,
                "{method} {path} is a probe: {}",
                missing.text()
            );
            continue;
        }
        assert_eq!(missing.status, 401, "{method} {path} without a key");
        assert_eq!(missing.json()["error"]["type"], "authentication_error");
        for bad in [
            "Bearer sk-keel-wrong",
            "Bearer ",
            "Basic Zm9vOmJhcg==",
            &format!("Bearer {revoked}"),
        ] {
            let r = send(&[("Authorization", bad)]);
            assert_eq!(r.status, 401, "{method} {path} with {bad:?}");
        }
        assert_eq!(send(&[("api-key", "sk-keel-wrong")]).status, 401);
        assert_eq!(
            send(&[("api-key", &revoked)]).status,
            401,
            "revoked at once, without a reload"
        );
        let auth = format!("Bearer {secret}");
        let ok = send(&[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ]);
        assert_ne!(ok.status, 401, "{method} {path} with a good key");
        checked += 1;
    }
    assert_eq!(checked, ROUTES.iter().filter(|r| !r.2).count());
    // Unknown paths need a key too, then are 404.
    assert_eq!(
        http::request(g.public, "GET", "/admin/reload", &[], b"")
            .expect("r")
            .status,
        401
    );
    assert_eq!(
        http::get(g.public, "/nope", &secret).expect("r").status,
        404
    );
    // The admin and metrics listeners take their own tokens only.
    for (addr, path, method, token) in [
        (g.admin, "/admin/status", "GET", ADMIN_TOKEN),
        (g.admin, "/admin/reload", "POST", ADMIN_TOKEN),
        (g.metrics, "/metrics", "GET", METRICS_TOKEN),
    ] {
        assert_eq!(
            http::request(addr, method, path, &[], b"")
                .expect("r")
                .status,
            401
        );
        for wrong in [
            secret.as_str(),
            "nope",
            if token == ADMIN_TOKEN {
                METRICS_TOKEN
            } else {
                ADMIN_TOKEN
            },
        ] {
            let a = format!("Bearer {wrong}");
            assert_eq!(
                http::request(addr, method, path, &[("Authorization", &a)], b"")
                    .expect("r")
                    .status,
                401,
                "{path} with {wrong}"
            );
        }
        let a = format!("Bearer {token}");
        assert_eq!(
            http::request(addr, method, path, &[("Authorization", &a)], b"")
                .expect("r")
                .status,
            200,
            "{path}"
        );
    }
    revoke(dir.path(), &id);
    assert_eq!(g.chat(&secret, chat_body("chat")).status, 401);
    let audit = g.stop();
    assert!(audit
        .iter()
        .any(|e| e["event"] == "denied" && e["reason"] == "unauthenticated"));
    let text = serde_json::to_string(&audit).expect("json");
    assert!(
        !text.contains(&secret) && !text.contains(&revoked),
        "no secret in the audit log"
    );
}

#[test]
fn bad_requests_are_4xx_slow_clients_time_out_and_the_gateway_stays_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let g = Running::start(
        dir.path(),
        &one_backend(dir.path(), &b, "").replace("[server]", "[server]\nmax_body_bytes = 1000"),
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let auth = format!("Bearer {key}");
    let h = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    let post = |body: &[u8]| {
        http::request(g.public, "POST", "/v1/chat/completions", &h, body).expect("request")
    };
    assert_eq!(post(&vec![b'x'; 5000]).status, 413);
    assert_eq!(post(b"{\"model\": ").status, 400);
    assert_eq!(post(b"[1,2]").status, 400);
    assert_eq!(post(b"{\"model\": 3}").status, 400);
    assert_eq!(
        post(b"{\"model\": \"chat\", \"max_tokens\": \"many\"}").status,
        400
    );
    assert_eq!(post(b"\xff\xfe").status, 400);
    assert_eq!(
        post(json!({"model": "nope"}).to_string().as_bytes()).status,
        403,
        "roles first: no telling what exists"
    );
    let (_, ops) = add_key(dir.path(), "ops", &["ops"], None);
    assert_eq!(
        http::post_json(
            g.public,
            "/v1/chat/completions",
            &ops,
            &json!({"model": "nope"})
        )
        .expect("r")
        .status,
        404
    );
    // A name the client makes up is no metrics label: series stay bounded.
    let m = g.metrics_text();
    assert!(!m.contains("model=\"nope\""), "{m}");
    assert!(m.contains("model=\"unknown\""), "{m}");
    assert_eq!(
        http::request(g.public, "GET", "/v1/chat/completions", &h, b"")
            .expect("r")
            .status,
        405
    );

    // Chunked body over the limit (no Content-Length to refuse early).
    let mut s = TcpStream::connect(g.public).expect("connect");
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").expect("w");
    for _ in 0..3 {
        let _ = write!(s, "400\r\n{}\r\n", "x".repeat(1024));
    }
    let _ = write!(s, "0\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");

    // A client that never finishes its head is cut off (header_timeout 500 ms).
    let t = Instant::now();
    let mut s = TcpStream::connect(g.public).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .expect("w");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "slow head not cut off"
    );
    // A body that stalls gets 408 (body_timeout 500 ms).
    let t = Instant::now();
    let mut s = TcpStream::connect(g.public).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nContent-Length: 100\r\n\r\n{{\"model\"").expect("w");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // Garbage instead of HTTP.
    let mut s = TcpStream::connect(g.public).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"\x00\x01\x02 garbage\r\n\r\n").expect("w");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(
        out.is_empty() || out.starts_with(b"HTTP/1.1 4"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // Still serving.
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    g.stop();
}

#[test]
fn refusals_count_against_the_request_limit_and_reflected_input_is_cut_short() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "[limits.default]\nrequests_per_minute = 4\n",
    )
    .replace("[server]", "[server]\nmax_body_bytes = 5000000");
    let (_, user) = add_key(dir.path(), "u", &["user"], None);
    let (_, ops) = add_key(dir.path(), "o", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    // A 4 MiB model name: 400, repeating 256 bytes of it and its length.
    let huge = "m".repeat(4 << 20);
    let r = g.chat(&user, json!({"model": huge, "messages": []}));
    assert_eq!(r.status, 400);
    assert!(r.body.len() < 1024, "{} bytes", r.body.len());
    assert!(r.text().contains("… (4194304 bytes)"), "{}", r.text());
    // A pin header naming no deployment is cut short too.
    let pin = "d".repeat(8000);
    let r = g.chat_with(&ops, chat_body("chat"), &[("x-keel-deployment", &pin)]);
    assert_eq!(r.status, 400);
    assert!(r.body.len() < 1024, "{} bytes", r.body.len());
    // Refusals count one request each: the 400 above and two denials use
    // three of the user's four.
    for left in ["2", "1"] {
        let r = g.chat(&user, chat_body("nope"));
        assert_eq!(r.status, 403, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some(left));
    }
    assert_eq!(g.chat(&user, chat_body("chat")).status, 200);
    for body in [chat_body("chat"), chat_body("nope")] {
        let r = g.chat(&user, body);
        assert_eq!(
            r.status,
            429,
            "refused once the budget is used: {}",
            r.text()
        );
    }
    // Unknown models and routes count too: the pin's 400 and three more.
    for _ in 0..2 {
        assert_eq!(g.chat(&ops, chat_body("nope")).status, 404);
    }
    assert_eq!(
        http::get(g.public, "/v1/nope", &ops).expect("r").status,
        404
    );
    assert_eq!(g.chat(&ops, chat_body("chat")).status, 429);
    assert_eq!(b.count("/v1/chat/completions"), 1);
    let audit = g.stop();
    for e in &audit {
        let line = e.to_string();
        assert!(line.len() < 4096, "{} bytes: {:.200}", line.len(), line);
    }
    assert_eq!(
        audit
            .iter()
            .filter(|e| e["reason"] == "rate_limited")
            .count(),
        3
    );
}

#[test]
fn chat_plain_and_streaming_with_exact_token_accounting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--tokens", "16"]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "[limits.default]\ntokens_per_minute = 100000\nrequests_per_minute = 1000\n",
    );
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);

    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["total_tokens"], 10, "2 prompt + 8 completion");
    assert_eq!(r.header("x-keel-deployment"), Some("blue"));
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("1000"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("999"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("99990"));
    assert!(r.header("x-ratelimit-reset-tokens").is_some());
    assert_eq!(
        b.count("model:backend-blue"),
        1,
        "the model name is rewritten for the backend"
    );

    // Streaming without asking for usage: keel asks, reads it, strips it.
    let mut body = chat_body("chat");
    body["stream"] = json!(true);
    let r = g.chat(&key, body.clone());
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert_eq!(text.matches("\"content\":\"tok \"").count(), 8, "{text}");
    assert!(
        !text.contains("prompt_tokens"),
        "usage chunk stripped: {text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(b.count("include_usage"), 1);
    // Asking for it: passed through.
    body["stream_options"] = json!({"include_usage": true});
    let text = g.chat(&key, body).text();
    assert!(text.contains("\"total_tokens\":10"), "{text}");
    // Embeddings: prompt tokens only.
    let r = http::post_json(
        g.public,
        "/v1/embeddings",
        &key,
        &json!({"model": "chat", "input": "abcdefgh"}),
    )
    .expect("r");
    assert_eq!(r.status, 403, "role user may not embed");
    std::thread::sleep(Duration::from_millis(200));
    let u = g.usage(&format!("key:{id}"));
    assert_eq!(u["requests"], 4, "three served, and the refused embedding");
    assert_eq!(u["tokens"], 30, "every request settled to its usage");
    let m = g.metrics_text();
    assert!(m.contains(&format!("keel_tokens_total{{direction=\"out\",model=\"chat\",deployment=\"blue\",key=\"{id}\"}} 24")), "{m}");
    assert!(m.contains("keel_gateway_overhead_seconds_bucket{route=\"/v1/chat/completions\""));
    let audit = g.stop();
    let req: Vec<&Value> = audit.iter().filter(|e| e["event"] == "request").collect();
    assert_eq!(req.len(), 3);
    assert!(
        req.iter()
            .all(|e| e["completion_tokens"] == 8 && e["prompt_tokens"] == 2),
        "{req:?}"
    );
    assert!(audit.iter().any(|e| e["event"] == "denied"
        && e["reason"] == "forbidden"
        && e["route"] == "/v1/embeddings"));
    assert!(
        !serde_json::to_string(&audit)
            .expect("json")
            .contains("12345678"),
        "no prompt content by default"
    );
}

#[test]
fn a_stream_without_a_usage_chunk_is_charged_its_prompt_and_the_text_sent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--tokens", "5", "--usage", "never"]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "[limits.default]\ntokens_per_minute = 100000\n",
    );
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let mut body = chat_body("chat");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(100);
    let text = g.chat(&key, body).text();
    assert_eq!(text.matches("\"content\":\"tok \"").count(), 5, "{text}");
    assert!(!text.contains("usage"), "{text}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        g.usage(&format!("key:{id}"))["tokens"],
        7,
        "2 prompt + 5 sent (of the 102 reserved)"
    );
    let audit = g.stop();
    let e = audit
        .iter()
        .find(|e| e["event"] == "request")
        .expect("request line");
    assert_eq!(
        (
            &e["prompt_tokens"],
            &e["completion_tokens"],
            &e["usage_estimated"]
        ),
        (&json!(2), &json!(5), &json!(true))
    );
}

fn hammer(g: &Running, key: &str, clients: usize, each: usize) -> (usize, usize) {
    let ok = std::sync::atomic::AtomicUsize::new(0);
    let limited = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| {
                for _ in 0..each {
                    let r = g.chat(key, chat_body("chat"));
                    match r.status {
                        200 => ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                        429 => {
                            assert!(r.header("retry-after").is_some());
                            assert_eq!(r.json()["error"]["type"], "rate_limit_exceeded");
                            limited.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        }
                        s => panic!("unexpected {s}: {}", r.text()),
                    };
                }
            });
        }
    });
    (ok.into_inner(), limited.into_inner())
}

#[test]
fn concurrent_clients_never_exceed_request_or_token_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--latency-ms", "5"]);
    let (rid, rkey) = add_key(dir.path(), "r", &["user"], None);
    let (tid, tkey) = add_key(dir.path(), "t", &["user"], Some("ml"));
    let limits = format!(
        "[limits.keys.{rid}]\nrequests_per_minute = 37\n[limits.keys.{tid}]\ntokens_per_minute = 100000\n[limits.teams.ml]\ntokens_per_minute = 255\n"
    );
    let g = Running::start(dir.path(), &one_backend(dir.path(), &b, &limits));
    assert_eq!(hammer(&g, &rkey, 12, 5), (37, 23));
    // 10 tokens each (2 prompt + 8 completion, reserved and settled): 25 fit in 255.
    assert_eq!(hammer(&g, &tkey, 12, 4), (25, 23));
    assert_eq!(g.usage("team:ml")["tokens"], 250);
    assert_eq!(g.usage(&format!("key:{rid}"))["requests"], 37);
    g.stop();
}

#[test]
fn reservations_bound_what_the_backend_generates_and_metadata_calls_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The backend would generate 2000 tokens a choice if nothing bounded it.
    let b = TestBackend::start(&["--tokens", "2000", "--latency-ms", "50"]);
    let cfg = format!(
        "{}[limits]\ndefault_max_tokens = 256\n[limits.default]\ntokens_per_minute = 3000\nrequests_per_minute = 14\n{}{}",
        head(dir.path()),
        model("chat", "", &[("blue", b.url(), 1)]),
        model("resnet", "protocol = \"oip\"", &[("r1", b.url(), 1)]),
    );
    let (id, key) = add_key(dir.path(), "o", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    let no_limit = json!({"model": "chat", "messages": [{"role": "user", "content": "12345678"}]});
    // Ten at once without max_tokens: 258 reserved each (2 prompt + the
    // default 256), and the backend is told to stop there.
    let completions: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..10)
            .map(|_| s.spawn(|| g.chat(&key, no_limit.clone())))
            .collect();
        hs.into_iter()
            .map(|h| {
                let r = h.join().expect("client");
                assert_eq!(r.status, 200, "{}", r.text());
                r.json()["usage"]["completion_tokens"].clone()
            })
            .collect()
    });
    assert!(completions.iter().all(|c| *c == 256), "{completions:?}");
    assert_eq!(g.usage(&format!("key:{id}"))["tokens"], 2580);
    // n multiplies: 2 + 3 x 100 reserved, 300 generated.
    let mut three = chat_body("chat");
    three["n"] = json!(3);
    three["max_tokens"] = json!(100);
    let r = g.chat(&key, three.clone());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 300);
    assert_eq!(g.usage(&format!("key:{id}"))["tokens"], 2882);
    // 118 tokens are left: a second n=3 request (302) does not fit.
    let r = g.chat(&key, three);
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(g.usage(&format!("key:{id}"))["tokens"].as_u64() <= Some(3000));
    // OIP metadata and readiness calls count against requests_per_minute:
    // 11 admitted so far, 3 more fit in 14.
    for path in [
        "/v2/models/resnet",
        "/v2/models/resnet/ready",
        "/v2/models/resnet/versions/2",
    ] {
        let r = http::get(g.public, path, &key).expect("r");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    let r = http::get(g.public, "/v2/models/resnet/ready", &key).expect("r");
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(g.usage(&format!("key:{id}"))["requests"], 14);
    g.stop();
}

#[test]
fn every_length_field_a_backend_reads_is_bound_by_the_reservation() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Unbounded, each would generate 5000 tokens: llama.cpp's server reads
    // n_predict (-1: no limit), then max_completion_tokens, then
    // max_tokens (its aliases, in the order the real server has them); a
    // TGI-style one reads max_new_tokens first.
    let llama = TestBackend::start(&[
        "--tokens",
        "5000",
        "--length-fields",
        "n_predict,max_completion_tokens,max_tokens",
    ]);
    let tgi = TestBackend::start(&[
        "--tokens",
        "5000",
        "--length-fields",
        "max_new_tokens,max_tokens",
    ]);
    let cfg = format!(
        "{}[limits]\ndefault_max_tokens = 16\n[limits.default]\ntokens_per_minute = 1000\n{}{}",
        head(dir.path()),
        model("chat", "", &[("llama", llama.url(), 1)]),
        model("small", "", &[("tgi", tgi.url(), 1)]),
    );
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let send = |model: &str, extra: Value| {
        let mut body =
            json!({"model": model, "messages": [{"role": "user", "content": "12345678"}]});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        g.chat(&key, body)
    };
    let completion = |r: HttpResponse| {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["completion_tokens"].as_u64()
    };
    // No limit for llama.cpp: keel sends the 16 it reserved instead.
    assert_eq!(completion(send("chat", json!({"n_predict": -1}))), Some(16));
    // max_completion_tokens alone: read by llama.cpp, and max_tokens goes
    // with it for servers that do not.
    assert_eq!(
        completion(send("chat", json!({"max_completion_tokens": 20}))),
        Some(20)
    );
    assert_eq!(
        completion(send("small", json!({"max_new_tokens": 30}))),
        Some(30)
    );
    // Whichever field asks for more than the key has left, it is reserved
    // and refused, not generated.
    for (model, field) in [("chat", "n_predict"), ("small", "max_new_tokens")] {
        let r = send(model, json!({field: 2000, "max_tokens": 10}));
        assert_eq!(r.status, 429, "{field}: {}", r.text());
    }
    // vLLM's min_tokens above the limit is refused.
    let r = send("chat", json!({"max_tokens": 10, "min_tokens": 100}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("min_tokens")));
    let r = send("small", json!({"max_new_tokens": -1}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(
        g.usage(&format!("key:{id}"))["tokens"],
        (2 + 16) + (2 + 20) + (2 + 30),
        "charged what was generated, never more than reserved"
    );
    g.stop();
}

#[test]
fn every_string_a_chat_template_renders_is_reserved() {
    // 100 KB outside content and text: reserved at 1 byte a token, so a
    // key with 50,000 tokens a minute is refused before the backend
    // renders it.
    let big = "x".repeat(100_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--tokens", "8"]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "[limits]\nprompt_bytes_per_token = 1\n[limits.default]\ntokens_per_minute = 50000\n",
    )
    .replace("[server]", "[server]\nmax_body_bytes = 1000000");
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    for messages in [
        json!([{"role": "user", "content": "hi", "name": big}]),
        json!([{"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": big}}
        ]}]),
        json!([{"role": "tool", "tool_call_id": big, "content": "hi"}]),
        json!([{"role": big, "content": "hi"}]),
    ] {
        let r = g.chat(
            &key,
            json!({"model": "chat", "messages": messages, "max_tokens": 8}),
        );
        let shown: String = messages.to_string().chars().take(80).collect();
        assert_eq!(r.status, 429, "{shown}: {}", r.text());
    }
    assert_eq!(b.count("/v1/chat/completions"), 0, "none forwarded");
    // A small one is admitted and settled to what the backend counts by
    // the same rule at its 4 bytes a token: (2 content + 10 name) / 4,
    // and 8.
    let r = g.chat(
        &key,
        json!({"model": "chat", "messages": [{"role": "user", "content": "hi", "name": "abcdefghij"}], "max_tokens": 8}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
    assert_eq!(g.usage(&format!("key:{id}"))["tokens"], 11);
    g.stop();
}

#[test]
fn the_prompt_reservation_follows_bytes_per_token_and_tokens_per_message() {
    // One 200-byte message with max_tokens 10: 50 + 10 reserved at 4 bytes
    // a token, 200 + 10 at 1; with 4 tokens a message (one message, and
    // once for the reply's header) 8 more.
    let body = json!({
        "model": "chat",
        "messages": [{"role": "user", "content": "x".repeat(200)}],
        "max_tokens": 10,
    });
    let template = "prompt_bytes_per_token = 1\nprompt_tokens_per_message = 4";
    for (limits, per_minute, status) in [
        ("prompt_bytes_per_token = 4", 120, 200),
        ("prompt_bytes_per_token = 1", 120, 429),
        ("prompt_bytes_per_token = 1", 215, 200),
        (template, 215, 429),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = TestBackend::start(&["--tokens", "10"]);
        let cfg = one_backend(
            dir.path(),
            &b,
            &format!("[limits]\n{limits}\n[limits.default]\ntokens_per_minute = {per_minute}\n"),
        );
        let (id, key) = add_key(dir.path(), "u", &["user"], None);
        let g = Running::start(dir.path(), &cfg);
        let r = g.chat(&key, body.clone());
        assert_eq!(r.status, status, "{limits}, {per_minute}: {}", r.text());
        let charged = g.usage(&format!("key:{id}"))["tokens"].as_u64();
        if status == 200 {
            // Settled to what the backend reported (its own quarter rule).
            assert_eq!(charged, Some(60), "{limits}");
        } else {
            assert_eq!(charged.unwrap_or(0), 0, "a refused request is not charged");
            assert_eq!(b.count("/v1/chat/completions"), 0, "nor forwarded");
        }
        g.stop();
    }
}

#[test]
fn a_client_that_goes_away_mid_request_is_audited_and_stays_charged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--latency-ms", "400"]);
    let cfg = one_backend(
        dir.path(),
        &b,
        "[limits.default]\ntokens_per_minute = 1000\n",
    );
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let body = chat_body("chat").to_string();
    let mut c = TcpStream::connect(g.public).expect("connect");
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    // Gone while the backend is still working.
    std::thread::sleep(Duration::from_millis(100));
    drop(c);
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(
        b.count("/v1/chat/completions"),
        1,
        "the request was forwarded"
    );
    assert_eq!(
        g.usage(&format!("key:{id}"))["tokens"],
        10,
        "the reservation (2 prompt + 8) stays charged"
    );
    let m = g.metrics_text();
    assert!(
        m.contains("route=\"/v1/chat/completions\",model=\"chat\"") && m.contains("code=\"499\""),
        "{m}"
    );
    let audit = g.stop();
    let e = audit
        .iter()
        .find(|e| e["event"] == "request")
        .expect("an audit line for the abandoned request");
    assert_eq!(e["status"], 499, "{e}");
    assert_eq!(e["key"], id.as_str());
    assert!(
        e["error"]
            .as_str()
            .is_some_and(|s| s.contains("client closed")),
        "{e}"
    );
}

#[test]
fn quotas_reset_at_the_period_boundary_by_the_injected_clock() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let (_, key) = add_key(dir.path(), "q", &["user"], None);
    // 2026-01-31T23:59:00Z
    let clock = Arc::new(ManualClock::new(1_769_903_940_000));
    let g = Running::start_with_clock(
        dir.path(),
        &one_backend(dir.path(), &b, "[limits.default]\ntokens_per_day = 30\n"),
        clock.clone(),
    );
    for _ in 0..3 {
        assert_eq!(g.chat(&key, chat_body("chat")).status, 200);
    }
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "insufficient_quota");
    assert_eq!(r.header("retry-after"), Some("60"));
    clock.advance(60_000);
    assert_eq!(g.chat(&key, chat_body("chat")).status, 200, "a new day");
    g.stop();
}

#[test]
fn weights_hold_within_tolerance_and_the_pin_header_is_honoured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blue = TestBackend::start(&["--name", "blue"]);
    let green = TestBackend::start(&["--name", "green"]);
    let cfg = format!(
        "{}{}",
        head(dir.path()),
        model(
            "chat",
            "",
            &[("blue", blue.url(), 80), ("green", green.url(), 20)]
        )
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let n = 400;
    let mut greens = 0;
    for _ in 0..n {
        let r = g.chat(&key, chat_body("chat"));
        assert_eq!(r.status, 200);
        if r.header("x-keel-deployment") == Some("green") {
            greens += 1;
        }
    }
    // Binomial(400, 0.2): mean 80, sd 8; allow 4 sd.
    assert!(
        (48..=112).contains(&greens),
        "{greens} of {n} went to green"
    );
    assert_eq!(green.count("/v1/chat/completions"), greens);
    for _ in 0..20 {
        let r = g.chat_with(&key, chat_body("chat"), &[("x-keel-deployment", "green")]);
        assert_eq!(r.header("x-keel-deployment"), Some("green"));
    }
    // A name outside the split needs the pin operation: 403 for the user
    // role, whether or not it exists.
    assert_eq!(
        g.chat_with(&key, chat_body("chat"), &[("x-keel-deployment", "nope")])
            .status,
        403
    );
    g.stop();
}

#[test]
fn pinning_a_deployment_outside_the_split_needs_the_pin_operation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blue = TestBackend::start(&["--name", "blue"]);
    let dark = TestBackend::start(&["--name", "dark"]);
    let shadow = TestBackend::start(&["--name", "shadow"]);
    let cfg = format!(
        "{}[roles.tester]\nmodels = [\"chat\"]\noperations = [\"chat\", \"pin\"]\n{}",
        head(dir.path()),
        model(
            "chat",
            "mirror = { deployment = \"shadow\", percent = 0 }",
            &[
                ("blue", blue.url(), 1),
                ("dark", dark.url(), 0),
                ("shadow", shadow.url(), 1)
            ]
        )
    );
    let (_, user) = add_key(dir.path(), "u", &["user"], None);
    let (_, tester) = add_key(dir.path(), "t", &["tester"], None);
    let (_, ops) = add_key(dir.path(), "o", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    let pin = |key: &str, d: &str| g.chat_with(key, chat_body("chat"), &[("x-keel-deployment", d)]);
    // A deployment in the split: anyone who may use the model.
    let r = pin(&user, "blue");
    assert_eq!(
        (r.status, r.header("x-keel-deployment")),
        (200, Some("blue"))
    );
    // Weight 0, the mirror target, or no such name: 403 without `pin`, and
    // the same answer for each, so nothing is learnt about what exists.
    let mut messages = Vec::new();
    for d in ["dark", "shadow", "nope"] {
        let r = pin(&user, d);
        assert_eq!(r.status, 403, "{d}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], "permission_error");
        let m = r.json()["error"]["message"]
            .as_str()
            .expect("message")
            .to_owned();
        assert!(m.contains("`pin`"), "{m}");
        messages.push(m.replace(&format!("{d:?}"), "D"));
    }
    assert!(messages.windows(2).all(|w| w[0] == w[1]), "{messages:?}");
    assert_eq!(dark.count("/v1/chat/completions"), 0);
    // With `pin` (or "*"): served there; an unknown name is then 400.
    for key in [&tester, &ops] {
        let r = pin(key, "dark");
        assert_eq!(
            (r.status, r.header("x-keel-deployment")),
            (200, Some("dark"))
        );
        assert_eq!(pin(key, "nope").status, 400);
    }
    assert_eq!(dark.count("/v1/chat/completions"), 2);
    let audit = g.stop();
    assert_eq!(
        audit
            .iter()
            .filter(|e| e["event"] == "denied" && e["reason"] == "forbidden")
            .count(),
        3
    );
}

#[test]
fn fallback_skips_models_the_callers_roles_do_not_allow() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = TestBackend::start(&["--name", "primary"]);
    let secret = TestBackend::start(&["--name", "secret"]);
    let cfg = format!(
        "{}{}{}",
        head(dir.path()),
        model(
            "chat",
            "fallback = [\"secret\"]",
            &[("big", primary.url(), 1)]
        ),
        model("secret", "", &[("s", secret.url(), 1)])
    );
    let (_, user) = add_key(dir.path(), "u", &["user"], None);
    let (_, ops) = add_key(dir.path(), "o", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    primary.kill();
    // The user role may use chat, not secret: no fallback, and no header
    // naming it.
    let r = g.chat(&user, chat_body("chat"));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-keel-model"), None);
    assert!(!r.text().contains("secret"), "{}", r.text());
    assert_eq!(secret.count("/v1/chat/completions"), 0);
    // A caller allowed both is served by the fallback.
    let r = g.chat(&ops, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-keel-model"), Some("secret"));
    g.stop();
}

#[test]
fn fallback_serves_when_the_primary_is_killed_and_503_when_nothing_can() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = TestBackend::start(&["--name", "primary"]);
    let mut small = TestBackend::start(&["--name", "small"]);
    let cfg = format!(
        "{}{}{}",
        head(dir.path()),
        model(
            "chat",
            "fallback = [\"small\"]",
            &[("big", primary.url(), 1)]
        ),
        model("small", "", &[("tiny", small.url(), 1)])
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    assert_eq!(
        g.chat(&key, chat_body("chat")).header("x-keel-model"),
        Some("chat")
    );
    primary.kill();
    for _ in 0..10 {
        let r = g.chat(&key, chat_body("chat"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-keel-model"), Some("small"));
        assert_eq!(r.header("x-keel-deployment"), Some("tiny"));
    }
    assert_eq!(small.count("model:backend-tiny"), 10);
    small.kill();
    let r = g.chat(&key, chat_body("chat"));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    let m = g.metrics_text();
    assert!(
        m.contains("keel_fallbacks_total{model=\"chat\",fallback=\"small\"} 10"),
        "{m}"
    );
    g.stop();
}

#[test]
fn circuit_opens_on_unavailable_from_two_callers_for_a_capped_retry_after_and_closes_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--mode", "error"]);
    let cfg = one_backend(dir.path(), &b, "").replace(
        "[traffic]\nretries = 2",
        "[traffic]\nretries = 0\n[traffic.circuit]\nmin_requests = 3\nfailure_ratio = 0.5\ntrip_s = 1\nwindow_s = 10\nmax_retry_after_s = 2",
    );
    let (_, mallory) = add_key(dir.path(), "mallory", &["user"], None);
    let (_, alice) = add_key(dir.path(), "alice", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    // Answers of 500 (input the backend chokes on) show the backend is
    // up: however many, they do not open the circuit for anyone.
    for key in [&mallory, &mallory, &mallory, &mallory, &alice] {
        assert_eq!(
            g.chat(key, chat_body("chat")).status,
            500,
            "the backend's own error passed on"
        );
    }
    assert_eq!(b.count("/v1/chat/completions"), 5, "all sent");
    // 503 with Retry-After: 120 counts; one caller's alone opens nothing.
    b.control(json!({"mode": "unavailable"}));
    for _ in 0..4 {
        let r = g.chat(&mallory, chat_body("chat"));
        assert_eq!(r.status, 503);
        assert_eq!(r.header("retry-after"), Some("120"), "the backend's own");
    }
    assert_eq!(b.count("/v1/chat/completions"), 9, "still sent");
    // A second caller's failure opens it, for 2 s (the cap), not 120.
    assert_eq!(g.chat(&alice, chat_body("chat")).status, 503);
    let sent = b.count("/v1/chat/completions");
    let r = g.chat(&alice, chat_body("chat"));
    assert_eq!(r.status, 503, "circuit open: {}", r.text());
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(
        b.count("/v1/chat/completions"),
        sent,
        "nothing sent while open"
    );
    assert!(g
        .metrics_text()
        .contains("keel_backend_circuit_open{backend=\"http://"));
    b.control(json!({"mode": "ok"}));
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(
        g.chat(&mallory, chat_body("chat")).status,
        200,
        "half-open trial succeeds"
    );
    for _ in 0..5 {
        assert_eq!(
            g.chat(&alice, chat_body("chat")).status,
            200,
            "closed again"
        );
    }
    // A 429 with Retry-After is not a failure by default either.
    b.control(json!({"mode": "ratelimit"}));
    assert_eq!(g.chat(&mallory, chat_body("chat")).status, 429);
    assert_eq!(g.chat(&alice, chat_body("chat")).status, 429);
    b.control(json!({"mode": "ok"}));
    assert_eq!(g.chat(&alice, chat_body("chat")).status, 200);
    g.stop();
}

#[test]
fn retries_go_to_another_deployment_and_unhealthy_backends_are_skipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = TestBackend::start(&["--mode", "error"]);
    let good = TestBackend::start(&[]);
    let cfg = format!(
        "{}{}",
        head(dir.path()),
        model(
            "chat",
            "",
            &[("bad", bad.url(), 50), ("good", good.url(), 50)]
        )
    );
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    bad.control(json!({"healthy": false}));
    for _ in 0..20 {
        let r = g.chat(&key, chat_body("chat"));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-keel-deployment"), Some("good"));
    }
    // Health probes (every 100 ms, down after 2 failures) take it out.
    std::thread::sleep(Duration::from_millis(400));
    let before = bad.count("/v1/chat/completions");
    assert!(before > 0, "some requests were retried away from it");
    for _ in 0..20 {
        assert_eq!(g.chat(&key, chat_body("chat")).status, 200);
    }
    assert_eq!(
        bad.count("/v1/chat/completions"),
        before,
        "unhealthy: not tried"
    );
    assert!(g
        .metrics_text()
        .contains("keel_retries_total{model=\"chat\"}"));
    g.stop();
}

#[test]
fn mirrored_traffic_is_sent_but_never_charged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let main = TestBackend::start(&[]);
    let shadow = TestBackend::start(&["--tokens", "100"]);
    let cfg = format!(
        "{}[limits.default]\ntokens_per_minute = 1000000\n{}",
        head(dir.path()),
        model(
            "chat",
            "mirror = { deployment = \"shadow\", percent = 100 }",
            &[("main", main.url(), 1), ("shadow", shadow.url(), 0)]
        )
    );
    let (id, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    for _ in 0..10 {
        let r = g.chat(&key, chat_body("chat"));
        assert_eq!(r.header("x-keel-deployment"), Some("main"));
    }
    let t = Instant::now();
    while shadow.count("/v1/chat/completions") < 10 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(shadow.count("/v1/chat/completions"), 10);
    assert_eq!(main.count("/v1/chat/completions"), 10);
    let u = g.usage(&format!("key:{id}"));
    assert_eq!(
        (u["requests"].as_u64(), u["tokens"].as_u64()),
        (Some(10), Some(100)),
        "only the served requests are charged"
    );
    assert!(g.metrics_text().contains(
        "keel_mirrored_requests_total{model=\"chat\",deployment=\"shadow\",outcome=\"ok\"} 10"
    ));
    g.stop();
}

#[test]
fn oip_infer_metadata_and_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = format!(
        "{}{}",
        head(dir.path()),
        model("resnet", "protocol = \"oip\"", &[("r1", b.url(), 1)])
    );
    let (_, key) = add_key(dir.path(), "o", &["ops"], None);
    let (_, user) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &cfg);
    let body = json!({"id": "42", "inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]});
    let r =
        http::post_json(g.public, "/v2/models/resnet/versions/3/infer", &key, &body).expect("r");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model_name"], "backend-r1");
    assert_eq!(b.count("/v2/models/backend-r1/versions/3/infer"), 1);
    assert_eq!(
        http::get(g.public, "/v2/models/resnet/ready", &key)
            .expect("r")
            .status,
        200
    );
    assert_eq!(
        http::get(g.public, "/v2/models/resnet", &key)
            .expect("r")
            .json()["name"],
        "backend-r1"
    );
    assert_eq!(
        http::post_json(g.public, "/v2/models/resnet/infer", &user, &body)
            .expect("r")
            .status,
        403
    );
    assert_eq!(
        http::post_json(g.public, "/v2/models/resnet/infer", &key, &json!([1]))
            .expect("r")
            .status,
        400
    );
    assert_eq!(
        http::post_json(g.public, "/v2/models/nope/infer", &key, &body)
            .expect("r")
            .status,
        404
    );
    // /v1/models lists what the caller's roles allow.
    let list = http::get(g.public, "/v1/models", &key).expect("r").json();
    assert_eq!(list["data"][0]["id"], "resnet");
    assert_eq!(
        http::get(g.public, "/v1/models", &user).expect("r").json()["data"],
        json!([])
    );
    g.stop();
}

#[test]
fn jwt_from_a_jwks_file_with_issuer_audience_expiry_and_roles() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let fx = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let jwt_cfg = format!(
        "[auth.jwt]\njwks_file = \"{}\"\nissuer = \"https://login.example\"\naudience = \"keel\"\n",
        fx.join("jwks.json").display()
    );
    let cfg = one_backend(dir.path(), &b, "").replace("[audit]", &format!("{jwt_cfg}[audit]"));
    let now_s = 1_767_225_600u64;
    let g = Running::start_with_clock(dir.path(), &cfg, Arc::new(ManualClock::new(now_s * 1000)));
    let key = EncodingKey::from_rsa_der(&std::fs::read(fx.join("jwt-test-key.der")).expect("key"));
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some("test-1".into());
    let token = |claims: Value| encode(&h, &claims, &key).expect("sign");
    let good = json!({"sub": "alice", "iss": "https://login.example", "aud": "keel", "exp": now_s + 60, "roles": ["user"], "team": "ml"});
    let r = g.chat(&token(good.clone()), chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    let bad = |k: &str, v: Value| {
        let mut c = good.clone();
        c[k] = v;
        g.chat(&token(c), chat_body("chat")).status
    };
    assert_eq!(bad("exp", json!(now_s - 120)), 401, "expired");
    assert_eq!(bad("iss", json!("https://evil.example")), 401);
    assert_eq!(bad("aud", json!("other")), 401);
    assert_eq!(bad("roles", json!(["nobody"])), 403);
    let forged = token(good.clone()).replace('.', ".x");
    assert_eq!(g.chat(&forged, chat_body("chat")).status, 401);
    // The JWK says RS256: a signature by the same key with another
    // algorithm does not verify.
    for alg in [Algorithm::PS256, Algorithm::RS384] {
        let mut other = Header::new(alg);
        other.kid = Some("test-1".into());
        let t = encode(&other, &good, &key).expect("sign");
        assert_eq!(g.chat(&t, chat_body("chat")).status, 401, "{alg:?}");
    }
    let audit = g.stop();
    assert!(audit
        .iter()
        .any(|e| e["key"] == "jwt:alice" && e["team"] == "ml" && e["status"] == 200));
}

#[test]
fn reload_swaps_weights_without_dropping_a_stream_in_flight() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blue = TestBackend::start(&["--chunk-delay-ms", "50"]);
    let green = TestBackend::start(&[]);
    let make = |wb: u32, wg: u32| {
        format!(
            "{}{}",
            head(dir.path()),
            model(
                "chat",
                "",
                &[("blue", blue.url(), wb), ("green", green.url(), wg)]
            )
        )
    };
    let (_, key) = add_key(dir.path(), "u", &["user"], None);
    let g = Running::start(dir.path(), &make(1, 0));
    let mut body = chat_body("chat");
    body["stream"] = json!(true);
    std::thread::scope(|s| {
        let stream = s.spawn(|| g.chat(&key, body.clone()));
        std::thread::sleep(Duration::from_millis(100));
        std::fs::write(dir.path().join("gateway.toml"), make(0, 1)).expect("write");
        let r = http::request(
            g.admin,
            "POST",
            "/admin/reload",
            &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            b"",
        )
        .expect("reload");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            g.chat(&key, chat_body("chat")).header("x-keel-deployment"),
            Some("green")
        );
        let r = stream.join().expect("thread");
        assert_eq!(r.status, 200);
        assert_eq!(
            r.text().matches("tok ").count(),
            8,
            "the stream finished on the old configuration"
        );
    });
    // A broken file is refused and the running configuration stays.
    std::fs::write(dir.path().join("gateway.toml"), "[server]\nbogus = 1\n").expect("write");
    let r = http::request(
        g.admin,
        "POST",
        "/admin/reload",
        &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
        b"",
    )
    .expect("reload");
    assert_eq!(r.status, 422);
    assert_eq!(g.chat(&key, chat_body("chat")).status, 200);
    let audit = g.stop();
    assert_eq!(audit.iter().filter(|e| e["event"] == "reload").count(), 2);
}

#[test]
fn jwks_from_a_url() {
    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    use std::net::TcpListener;
    let fx = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let jwks = std::fs::read_to_string(fx.join("jwks.json")).expect("jwks");
    // An identity provider's JWKS endpoint: answers every request with the set.
    let idp = TcpListener::bind("127.0.0.1:0").expect("bind");
    let idp_addr = idp.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in idp.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(s, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{jwks}", jwks.len());
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let jwt_cfg = format!("[auth.jwt]\njwks_url = \"http://{idp_addr}/jwks.json\"\nissuer = \"iss\"\naudience = \"keel\"\nroles_claim = \"groups\"\n");
    let cfg = one_backend(dir.path(), &b, "").replace("[audit]", &format!("{jwt_cfg}[audit]"));
    let now_s = 1_767_225_600u64;
    let g = Running::start_with_clock(dir.path(), &cfg, Arc::new(ManualClock::new(now_s * 1000)));
    let key = EncodingKey::from_rsa_der(&std::fs::read(fx.join("jwt-test-key.der")).expect("key"));
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some("test-1".into());
    let t = encode(&h, &json!({"sub": "svc", "iss": "iss", "aud": "keel", "exp": now_s + 10, "groups": "user ops"}), &key).expect("sign");
    assert_eq!(g.chat(&t, chat_body("chat")).status, 200);
    h.kid = Some("other".into());
    let t = encode(
        &h,
        &json!({"sub": "svc", "iss": "iss", "aud": "keel", "exp": now_s + 10}),
        &key,
    )
    .expect("sign");
    assert_eq!(g.chat(&t, chat_body("chat")).status, 401, "unknown key id");
    g.stop();
}

#[test]
fn a_watched_model_records_each_request_per_deployment() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A tenth of `b`'s answers are empty, a quarter (another run of them)
    // ends with `length`, a fifth answers 500.
    let a = TestBackend::start(&["--tokens", "6"]);
    let b = TestBackend::start(&[
        "--tokens",
        "6",
        "--empty-percent",
        "10",
        "--length-percent",
        "25",
        "--error-percent",
        "20",
    ]);
    let cfg = format!(
        "{}{}",
        head(dir.path()).replace("retries = 2", "retries = 0"),
        model("chat", "", &[("v1", a.url(), 1), ("v2", b.url(), 1)])
    );
    let (_, key) = add_key(dir.path(), "ops", &["ops"], None);
    let g = Running::start(dir.path(), &cfg);
    // Not watched: nothing kept.
    g.chat(&key, chat_body("chat"));
    assert_eq!(g.gw.samples().take("chat"), None);
    g.gw.samples().watch("chat");
    let pin = |d: &str, stream: bool| {
        let mut body = chat_body("chat");
        if stream {
            body["stream"] = true.into();
        }
        g.chat_with(&key, body, &[("x-keel-deployment", d)])
    };
    for _ in 0..40 {
        pin("v1", false);
    }
    for _ in 0..100 {
        pin("v2", false);
    }
    for _ in 0..20 {
        assert_eq!(pin("v1", true).status, 200);
    }
    let w = g.gw.samples().take("chat").expect("watched");
    let v1 = &w["v1"].samples;
    let v2 = &w["v2"].samples;
    assert_eq!((v1.len(), v2.len()), (60, 100));
    use keel_canary::analysis::FinishReason;
    assert!(v1.iter().all(|s| !s.error && s.latency_ms.is_some()));
    assert!(v1[..40].iter().all(|s| s.completion_tokens == Some(6)
        && s.finish_reason == Some(FinishReason::Stop)
        && s.answer_chars.is_some_and(|c| c > 3)
        && !s.streamed));
    assert!(v1[40..].iter().all(|s| s.streamed
        && !s.stream_aborted
        && s.finish_reason == Some(FinishReason::Stop)
        && s.answer_chars.is_some_and(|c| c > 3)));
    let count =
        |f: &dyn Fn(&keel_canary::analysis::Sample) -> bool| v2.iter().filter(|s| f(s)).count();
    assert_eq!(count(&|s| s.error), 20);
    assert_eq!(count(&|s| s.answer_chars == Some(0)), 10);
    assert_eq!(
        count(&|s| s.finish_reason == Some(FinishReason::Length)),
        25
    );
    g.stop();
}
