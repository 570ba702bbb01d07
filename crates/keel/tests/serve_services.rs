//! `keel serve` with real services: two gateway processes sharing exact
//! limits through Redis, and the real `openai` Python client calling
//! through keel (plain and streaming).

mod serve_common;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use serve_common::*;

#[test]
#[ignore = "needs Redis: scripts/test starts one"]
fn two_gateways_sharing_redis_never_exceed_the_limits() {
    let redis = keel_testkit::serve::redis_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--latency-ms", "2"]);
    // A fresh team name per run: the Redis outlives the test.
    let team = format!("t{}", std::process::id());
    let cfg = config(
        dir.path(),
        &b.url(),
        &format!("[limits]\nredis_url = \"{redis}\"\n[limits.teams.{team}]\nrequests_per_minute = 61\ntokens_per_minute = 100000\n"),
    );
    let (_, k1) = create_key(&cfg, "a", "user", Some(&team));
    let (_, k2) = create_key(&cfg, "b", "user", Some(&team));
    let g1 = GatewayProcess::start(&keel(), &cfg);
    let g2 = GatewayProcess::start(&keel(), &cfg);
    let ok = AtomicUsize::new(0);
    let limited = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for i in 0..12 {
            let (addr, key) = if i % 2 == 0 {
                (g1.public, &k1)
            } else {
                (g2.public, &k2)
            };
            let (ok, limited) = (&ok, &limited);
            s.spawn(move || {
                for _ in 0..10 {
                    let r = http::post_json(addr, "/v1/chat/completions", key, &chat_body())
                        .expect("request");
                    match r.status {
                        200 => ok.fetch_add(1, Ordering::Relaxed),
                        429 => limited.fetch_add(1, Ordering::Relaxed),
                        s => panic!("unexpected {s}: {}", r.text()),
                    };
                }
            });
        }
    });
    assert_eq!(
        (ok.into_inner(), limited.into_inner()),
        (61, 59),
        "exactly the team's 61 requests across both replicas"
    );
    let u = http::get(
        g1.admin.expect("admin"),
        &format!("/admin/usage/team:{team}"),
        ADMIN_TOKEN,
    )
    .expect("usage")
    .json();
    assert_eq!(u["usage"]["requests"], 61);
    assert_eq!(u["usage"]["tokens"], 610, "each settled to its 10 tokens");
}

#[test]
#[ignore = "needs Python with openai: scripts/test installs it"]
fn the_openai_python_client_works_through_keel() {
    let python = keel_testkit::serve::python();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--tokens", "5"]);
    let cfg = config(
        dir.path(),
        &b.url(),
        "[limits.default]\ntokens_per_minute = 10000\n",
    );
    let (_, key) = create_key(&cfg, "py", "user", None);
    let g = GatewayProcess::start(&keel(), &cfg);
    let script = r#"
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "12345678"}], max_tokens=5)
raw = c.chat.completions.with_raw_response.create(model="chat", messages=[{"role": "user", "content": "hi"}])
chunks = list(c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "12345678"}], stream=True))
asked = list(c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "12345678"}], stream=True, stream_options={"include_usage": True}))
try:
    OpenAI(base_url=sys.argv[1], api_key="sk-keel-wrong", max_retries=0).models.list()
    denied = None
except Exception as e:
    denied = type(e).__name__
print(json.dumps({
    "content": r.choices[0].message.content,
    "usage": r.usage.total_tokens,
    "remaining": raw.headers.get("x-ratelimit-remaining-requests"),
    "limit_tokens": raw.headers.get("x-ratelimit-limit-tokens"),
    "chunks": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices),
    "usage_chunks": sum(1 for ch in chunks if ch.usage is not None),
    "asked_usage": [ch.usage.total_tokens for ch in asked if ch.usage is not None],
    "models": [m.id for m in c.models.list().data],
    "denied": denied,
}))
"#;
    let base = format!("http://{}/v1", g.public);
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(&base)
        .arg(&key)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["content"], "tok tok tok tok tok ");
    assert_eq!(v["usage"], 7);
    assert_eq!(v["limit_tokens"], "10000");
    assert_eq!(v["chunks"], "tok tok tok tok tok ");
    assert_eq!(
        v["usage_chunks"], 0,
        "the usage chunk keel asked for is not passed on"
    );
    assert_eq!(v["asked_usage"], serde_json::json!([7]));
    assert_eq!(v["models"], serde_json::json!(["chat"]));
    assert_eq!(v["denied"], "AuthenticationError");
}
