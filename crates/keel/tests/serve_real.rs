//! `keel serve` in front of real model servers, started by
//! `scripts/services/` (scripts/test starts both):
//!
//! - llama.cpp's own `llama-server` (C++, built from the tree vendored in
//!   the llama-cpp-python sdist) serving a tiny random-weight Llama: chat
//!   and completions, streamed and not, with and without
//!   `stream_options.include_usage`; every length field of docs/serve.md's
//!   "Limits" table (`n_predict` positive, -1 and absent, `max_tokens`,
//!   `max_completion_tokens`) gives exactly the number of tokens the table
//!   says, counted in the server's own `timings.predicted_n` and in its
//!   `usage`; the usage the client sees is the server's, and so is what
//!   keel charges the key;
//! - MLServer with a scikit-learn model (OIP v2): inference, metadata,
//!   readiness and the server's errors through the gateway.
//!
//! The random model almost never emits its end-of-sequence token (one in
//! 32,000 a step), so every answer runs to its limit.

#[allow(unused_imports)]
mod serve_common;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use serve_common::{create_key, http, keel, sha256, GatewayProcess, ADMIN_TOKEN, METRICS_TOKEN};

/// The completion limit keel sends when a request gives none.
const DEFAULT_MAX: u64 = 9;

fn config(dir: &Path, backend: &str, protocol: &str, model: &str) -> PathBuf {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[metrics]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[auth]
keys_file = "keys.json"
[audit]
path = "audit.jsonl"
[roles.user]
models = ["*"]
operations = ["chat", "completions", "models", "infer", "metadata"]
[limits]
default_max_tokens = {DEFAULT_MAX}
[limits.default]
tokens_per_day = 100000000
[[models]]
name = "m"
protocol = "{protocol}"
[[models.deployments]]
name = "real"
url = "{backend}"
model = "{model}"
[[models]]
name = "missing"
protocol = "{protocol}"
[[models.deployments]]
name = "real"
url = "{backend}"
model = "no-such-model"
"#,
        sha256(ADMIN_TOKEN),
        sha256(METRICS_TOKEN)
    );
    let p = dir.join("gateway.toml");
    std::fs::write(&p, text).expect("write config");
    p
}

struct Gw {
    _t: tempfile::TempDir,
    gw: GatewayProcess,
    key: String,
    key_id: String,
}

fn gateway(backend: &str, protocol: &str, model: &str) -> Gw {
    let t = tempfile::tempdir().expect("tmp");
    let cfg = config(t.path(), backend, protocol, model);
    let (key_id, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    Gw {
        _t: t,
        gw,
        key,
        key_id,
    }
}

impl Gw {
    fn post(&self, path: &str, body: &Value) -> http::HttpResponse {
        http::post_json(self.gw.public, path, &self.key, body).expect("request")
    }

    /// Tokens keel charged the key so far.
    fn charged(&self) -> u64 {
        let u = http::get(
            self.gw.admin.expect("admin"),
            &format!("/admin/usage/key:{}", self.key_id),
            ADMIN_TOKEN,
        )
        .expect("usage")
        .json();
        u["usage"]["tokens"].as_u64().unwrap_or(0)
    }

    /// The key's charge once `done` holds of it (a stream is settled
    /// after its last event reached the client), at most 5 s.
    fn charged_until(&self, done: impl Fn(u64) -> bool) -> u64 {
        let t0 = std::time::Instant::now();
        loop {
            let c = self.charged();
            if done(c) || t0.elapsed() > std::time::Duration::from_secs(5) {
                return c;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// What one answer said about its tokens: the server's `usage` as the
/// client saw it (none in a stream that did not ask), the server's own
/// count of predicted tokens (`timings.predicted_n`), the number of
/// content events of a stream, and whether a stream ended with `[DONE]`.
#[derive(Debug, Default)]
struct Answer {
    usage: Option<Value>,
    predicted: Option<u64>,
    events: u64,
    done: bool,
    finish: Option<String>,
}

fn answer(r: &http::HttpResponse, stream: bool) -> Answer {
    assert_eq!(r.status, 200, "{}", r.text());
    if !stream {
        let v = r.json();
        return Answer {
            usage: v.get("usage").cloned(),
            predicted: v["timings"]["predicted_n"].as_u64(),
            events: 0,
            done: false,
            finish: v["choices"][0]["finish_reason"].as_str().map(str::to_owned),
        };
    }
    assert_eq!(
        r.header("content-type")
            .map(|c| c.starts_with("text/event-stream")),
        Some(true)
    );
    let mut a = Answer::default();
    for line in r.text().lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            a.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("event json");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            assert!(a.usage.is_none(), "two usage chunks");
            a.usage = Some(u.clone());
        }
        if let Some(n) = v["timings"]["predicted_n"].as_u64() {
            a.predicted = Some(n);
        }
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            let text = c["delta"]["content"].as_str().or(c["text"].as_str());
            if text.is_some_and(|t| !t.is_empty()) {
                a.events += 1;
            }
            if let Some(f) = c["finish_reason"].as_str() {
                a.finish = Some(f.to_owned());
            }
        }
    }
    a
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}], "seed": 45});
    b.as_object_mut()
        .expect("object")
        .extend(extra.as_object().expect("object").clone());
    b
}

fn completion(extra: Value) -> Value {
    let mut b = json!({"model": "m", "prompt": "Once upon a time", "seed": 45});
    b.as_object_mut()
        .expect("object")
        .extend(extra.as_object().expect("object").clone());
    b
}

#[test]
#[ignore = "needs llama-server: scripts/test starts it (scripts/services/llama-server)"]
fn llama_server_length_fields_hold_exactly_as_the_limits_table_says() {
    let g = gateway(&keel_testkit::serve::llama_server_url(), "openai", "tiny");
    // (body fields, the tokens the table says the server generates)
    let cases: [(Value, u64); 7] = [
        (json!({"n_predict": 5}), 5),
        // -1 is llama.cpp's "no limit": keel replaces it with the reservation.
        (json!({"n_predict": -1}), DEFAULT_MAX),
        (json!({}), DEFAULT_MAX),
        (json!({"max_tokens": 4}), 4),
        // n_predict wins over max_tokens in the server; keel reserves the larger.
        (json!({"n_predict": 3, "max_tokens": 6}), 3),
        // The server reads max_completion_tokens as an alias of n_predict.
        (json!({"max_completion_tokens": 6}), 6),
        (json!({"n_predict": 2, "max_completion_tokens": 7}), 2),
    ];
    let mut charged = g.charged();
    // The prompt's tokens as the server counted them in the request before
    // (the same prompt and route).
    let mut prompt = 0;
    for (path, make) in [
        ("/v1/chat/completions", chat as fn(Value) -> Value),
        ("/v1/completions", completion),
    ] {
        for (fields, want) in &cases {
            for (stream, usage) in [(false, false), (true, true), (true, false)] {
                let mut extra = fields.clone();
                if stream {
                    extra["stream"] = true.into();
                }
                if usage {
                    extra["stream_options"] = json!({"include_usage": true});
                }
                let what = format!("{path} {extra}");
                let a = answer(&g.post(path, &make(extra)), stream);
                // llama.cpp puts its timings on the usage chunk, which keel
                // takes out of a stream whose client did not ask for usage.
                if !stream || usage {
                    assert_eq!(a.predicted, Some(*want), "{what}: {a:?}");
                }
                assert_eq!(a.finish.as_deref(), Some("length"), "{what}: {a:?}");
                if stream {
                    assert!(a.done, "{what}: no [DONE]");
                    // One event a token, but for a piece of a UTF-8
                    // character, held until the rest of it comes.
                    assert!((1..=*want).contains(&a.events), "{what}: {a:?}");
                }
                match &a.usage {
                    Some(u) => {
                        let total = u["total_tokens"].as_u64().expect("total");
                        let now = g.charged_until(|c| c == charged + total);
                        assert_eq!(u["completion_tokens"], *want, "{what}: {u}");
                        assert_eq!(
                            total,
                            u["prompt_tokens"].as_u64().expect("prompt") + want,
                            "{what}: {u}"
                        );
                        // keel charges what the server counted.
                        assert_eq!(now - charged, total, "{what}: {u}");
                        charged = now;
                        prompt = u["prompt_tokens"].as_u64().expect("prompt");
                    }
                    None => {
                        // Only a stream that did not ask goes without (keel
                        // asked and took the usage chunk out), and it is
                        // charged the server's count all the same: the
                        // prompt and exactly the completion's tokens.
                        assert!(stream && !usage, "{what}: no usage");
                        let now = g.charged_until(|c| c == charged + prompt + *want);
                        assert_eq!(now - charged, prompt + *want, "{what}");
                        charged = now;
                    }
                }
            }
        }
    }
    let version = keel_testkit::serve::llama_server_version();
    eprintln!("tested against llama-server {version}");
}

#[test]
#[ignore = "needs llama-server: scripts/test starts it (scripts/services/llama-server)"]
fn llama_server_errors_and_model_list_pass_through_keel() {
    let g = gateway(&keel_testkit::serve::llama_server_url(), "openai", "tiny");
    // A body the server refuses: its own 400, unchanged.
    let r = g.post(
        "/v1/chat/completions",
        &json!({"model": "m", "messages": "not a list", "max_tokens": 2}),
    );
    assert!((400..500).contains(&r.status), "{} {}", r.status, r.text());
    assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
    // `best_of`: keel reserves for two choices, the server ignores it and
    // generates one; the client sees, and keel charges, that one.
    let r = g.post(
        "/v1/completions",
        &completion(json!({"max_tokens": 2, "best_of": 2})),
    );
    let a = answer(&r, false);
    assert_eq!(
        a.usage.map(|u| u["completion_tokens"].clone()),
        Some(json!(2))
    );
    // A length below -1: the server refuses it...
    let direct = http::post_json(
        keel_testkit::serve::llama_server_url()
            .trim_start_matches("http://")
            .parse()
            .expect("addr"),
        "/v1/completions",
        "",
        &completion(json!({"n_predict": -2})),
    )
    .expect("direct");
    assert_eq!(direct.status, 400, "{}", direct.text());
    assert!(direct.text().contains("n_predict"), "{}", direct.text());
    // ...keel replaces any negative n_predict by its reservation first.
    let a = answer(
        &g.post("/v1/completions", &completion(json!({"n_predict": -2}))),
        false,
    );
    assert_eq!(a.predicted, Some(DEFAULT_MAX), "{a:?}");
    // A negative max_tokens is keel's 400 before the server.
    let r = g.post("/v1/chat/completions", &chat(json!({"max_tokens": -3})));
    assert_eq!(r.status, 400, "{}", r.text());
    let r = http::get(g.gw.public, "/v1/models", &g.key).expect("models");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"m\""), "{}", r.text());
}

fn infer_body(rows: &[[f64; 4]]) -> Value {
    let data: Vec<f64> = rows.iter().flatten().copied().collect();
    json!({"inputs": [{"name": "x", "shape": [rows.len(), 4], "datatype": "FP32", "data": data}]})
}

#[test]
#[ignore = "needs MLServer: scripts/test starts it (scripts/services/oip-server)"]
fn mlserver_inference_metadata_readiness_and_errors_through_keel() {
    let (url, name) = keel_testkit::serve::oip_server();
    let g = gateway(&url, "oip", &name);
    let rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]];
    let direct = http::post_json(
        url.trim_start_matches("http://").parse().expect("addr"),
        &format!("/v2/models/{name}/infer"),
        "",
        &infer_body(&rows),
    )
    .expect("direct");
    assert_eq!(direct.status, 200, "{}", direct.text());
    let r = g.post("/v2/models/m/infer", &infer_body(&rows));
    assert_eq!(r.status, 200, "{}", r.text());
    let (v, d) = (r.json(), direct.json());
    assert_eq!(v["outputs"], d["outputs"], "{v} vs {d}");
    assert_eq!(v["outputs"][0]["data"], json!([0, 2]), "setosa, virginica");
    assert_eq!(v["model_name"], name.as_str());
    assert_eq!(r.header("x-keel-deployment"), Some("real"));
    // The requested output.
    let mut body = infer_body(&rows);
    body["outputs"] = json!([{"name": "predict_proba"}]);
    let p = g.post("/v2/models/m/infer", &body).json();
    assert_eq!(p["outputs"][0]["shape"], json!([2, 3]), "{p}");
    // Metadata and readiness of the model, as the server says.
    let m = http::get(g.gw.public, "/v2/models/m", &g.key).expect("metadata");
    assert_eq!(m.status, 200, "{}", m.text());
    assert_eq!(m.json()["name"], name.as_str());
    let ready = http::get(g.gw.public, "/v2/models/m/ready", &g.key).expect("ready");
    assert_eq!(ready.status, 200, "{}", ready.text());
    let probe = http::get(g.gw.public, "/v2/health/ready", "").expect("probe");
    assert_eq!(probe.status, 200, "{}", probe.text());
    // A model the server does not have: its 404 and its error shape.
    let nf = http::get(g.gw.public, "/v2/models/missing/ready", &g.key).expect("ready");
    assert_eq!(nf.status, 404, "{}", nf.text());
    assert!(
        nf.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("no-such-model")),
        "{}",
        nf.text()
    );
    let nf = g.post("/v2/models/missing/infer", &infer_body(&rows));
    assert_eq!(nf.status, 404, "{}", nf.text());
    // A body that is not OIP: the server's own validation error (422).
    let e = g.post("/v2/models/m/infer", &json!({"inputs": "x"}));
    assert_eq!(e.status, 422, "{}", e.text());
    assert!(e.json()["detail"].is_array(), "{}", e.text());
    // A tensor whose shape does not hold its data: MLServer fails it with
    // a 500 in plain text; the client gets that answer, not a retry loop's.
    let bad = json!({"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]});
    let e = g.post("/v2/models/m/infer", &bad);
    assert_eq!(e.status, 500, "{}", e.text());
}

#[test]
#[ignore = "needs MLServer: scripts/test starts it (scripts/services/oip-server)"]
fn a_rollout_over_mlserver_analyses_its_outputs_and_watches_its_inputs() {
    use serve_common::{model, ok, registry_at};
    let (url, name) = keel_testkit::serve::oip_server();
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let db = dir.join("registry.db");
    // Two registry versions of the same MLServer model: a healthy canary.
    for v in 1..=2 {
        let files = dir.join(format!("v{v}"));
        std::fs::create_dir_all(&files).expect("mkdir");
        std::fs::write(files.join("model.joblib"), format!("version {v}")).expect("write");
        let tag = format!("keel.backend={url}");
        ok(model(
            &db,
            &[
                "register",
                "chat",
                "--path",
                files.to_str().expect("utf8"),
                "--tag",
                &tag,
            ],
        ));
    }
    for (alias, v) in [("production", "1"), ("canary", "2")] {
        ok(model(
            &db,
            &["alias", "set", "chat", alias, v, "--reason", "test"],
        ));
    }
    for (file, who, role) in [
        ("registry.key", "gateway", "read"),
        ("rollouts.key", "rollouts", "write"),
    ] {
        let v: Value = serde_json::from_str(&ok(model(
            &db,
            &["--json", "keys", "create", who, "--role", role],
        )))
        .expect("json");
        std::fs::write(dir.join(file), v["secret"].as_str().expect("secret")).expect("key");
    }
    let (_reg, rurl) = registry_at(&db, "127.0.0.1:0");
    let cfg = serve_common::registry_config(
        dir,
        &rurl,
        "chat",
        "write_key_file = \"rollouts.key\"\ndrift_reference_requests = 50\ndrift_window_requests = 50",
        "",
    );
    let mut text = std::fs::read_to_string(&cfg).expect("read");
    text = text.replace("name = \"chat\"\n", "name = \"chat\"\nprotocol = \"oip\"\n");
    text.push_str(&format!(
        "[[models.deployments]]\nname = \"template\"\nurl = \"http://unused.invalid\"\nmodel = \"{name}\"\n[models.rollout]\nsteps = [50, 100]\ninterval_s = 1\nmin_canary_samples = 50\nmax_intervals = 60\n"
    ));
    std::fs::write(&cfg, text).expect("write");
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    let admin = gw.admin.expect("admin");
    let post = |path: &str| {
        http::request(
            admin,
            "POST",
            path,
            &[("Authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            b"",
        )
        .expect("admin")
    };
    let r = post("/admin/rollouts/chat/start");
    assert_eq!(r.status, 200, "{}", r.text());
    // Iris-like rows: every request's answer is a class per row, so each
    // answer's output mean lies between 0 and 2.
    let mut served = std::collections::BTreeMap::<String, u64>::new();
    let mut status = Value::Null;
    for i in 0..400usize {
        let rows: Vec<[f64; 4]> = (0..3)
            .map(|r| {
                let k = ((i * 3 + r) % 30) as f64 / 10.0;
                [4.5 + k, 3.0, 1.0 + k * 1.8, 0.1 + k * 0.8]
            })
            .collect();
        let body = infer_body(&rows);
        let r = http::post_json(gw.public, "/v2/models/chat/infer", &key, &body).expect("infer");
        assert_eq!(r.status, 200, "{}", r.text());
        let dep = r.header("x-keel-deployment").unwrap_or("-").to_owned();
        *served.entry(dep).or_default() += 1;
        if i % 20 == 19 {
            status = http::get(admin, "/admin/rollouts/chat", ADMIN_TOKEN)
                .expect("status")
                .json();
            if status["phase"] == "promoted" {
                break;
            }
        }
    }
    assert_eq!(status["phase"], "promoted", "{status:#} {served:?}");
    assert!(served.get("v2").is_some_and(|&n| n >= 50), "{served:?}");
    let out = status["verdicts"]
        .as_array()
        .and_then(|v| v.last())
        .and_then(|v| v["checks"].as_array())
        .and_then(|c| c.iter().find(|c| c["check"] == "output_mean"))
        .cloned()
        .expect("output_mean");
    assert_eq!(out["outcome"], "pass", "{out}");
    assert!(out["canary_n"].as_u64().is_some_and(|n| n >= 30), "{out}");
    // The inputs of the version that served them, column by column.
    let d = http::get(admin, "/admin/drift/chat", ADMIN_TOKEN)
        .expect("drift")
        .text();
    for c in 0..4 {
        assert!(d.contains(&format!("input.x.{c}")), "{d}");
    }
}
