//! Drift of registry versions with `keel serve` following `keel model
//! serve` and test backends: a baseline recorded with `keel serve drift
//! baseline save` is the reference of a restarted gateway; a shifted
//! column of an OIP model's input tensor is measured per feature and
//! reported, but moves no alias even under `action = "fallback"`, and so
//! do prompts a hundred times longer with a backend ten times slower
//! (prompt_tokens and latency_ms: the clients' and the load's); the
//! `fallback` action moves the stable alias (and the traffic) to the
//! fallback version, once, recorded under one drift id in the audit log
//! and the alias history, while `notify` moves nothing; a missing or
//! corrupt baseline and a fallback version that cannot serve stop the
//! gateway at start.

mod serve_common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{chat_body, create_key, http, keel, sha256, GatewayProcess, TestBackend};
use serve_common::{model, ok, registry_at, Registry};
use serve_common::{ADMIN_TOKEN, METRICS_TOKEN};

/// A registry with model `name`, one version per backend, `production`
/// on version `stable`, a read key (`registry.key`) and a write key
/// (`write.key`) in `dir`.
fn registry(dir: &Path, name: &str, backends: &[String], stable: u64) -> (Registry, String) {
    let db = dir.join("registry.db");
    for (i, b) in backends.iter().enumerate() {
        let files = dir.join(format!("{name}-v{}", i + 1));
        std::fs::create_dir_all(&files).expect("mkdir");
        std::fs::write(files.join("weights.bin"), format!("version {}", i + 1)).expect("write");
        let tag = format!("keel.backend={b}");
        ok(model(
            &db,
            &[
                "register",
                name,
                "--path",
                files.to_str().expect("utf8"),
                "--tag",
                &tag,
            ],
        ));
    }
    ok(model(
        &db,
        &[
            "alias",
            "set",
            name,
            "production",
            &stable.to_string(),
            "--reason",
            "first",
        ],
    ));
    for (file, who, role) in [
        ("registry.key", "gateway", "read"),
        ("write.key", "drift", "write"),
    ] {
        let v: Value = serde_json::from_str(&ok(model(
            &db,
            &["--json", "keys", "create", who, "--role", role],
        )))
        .expect("json");
        std::fs::write(dir.join(file), v["secret"].as_str().expect("secret")).expect("key");
    }
    registry_at(&db, "127.0.0.1:0")
}

/// A gateway file: model `name` (`protocol`) following registry model
/// `name`, drift windows of 50, an audit log, `[models.drift]` as given.
fn config(dir: &Path, url: &str, name: &str, protocol: &str, drift: &str) -> PathBuf {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace_s = 1
[admin]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[metrics]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[auth]
keys_file = "keys.json"
[roles.user]
models = ["{name}"]
operations = ["chat", "models", "infer"]
[registry]
url = "{url}"
key_file = "registry.key"
write_key_file = "write.key"
drift_reference_requests = 50
drift_window_requests = 50
[audit]
path = "audit.jsonl"
[[models]]
name = "{name}"
protocol = "{protocol}"
registry = {{ model = "{name}", stable = "production" }}
[models.drift]
{drift}
"#,
        sha256(ADMIN_TOKEN),
        sha256(METRICS_TOKEN)
    );
    let p = dir.join("gateway.toml");
    std::fs::write(&p, text).expect("write config");
    p
}

fn start_fails(cfg: &Path) -> (i32, String) {
    let o = Command::new(keel())
        .args(["serve", "--config"])
        .arg(cfg)
        .env_remove("KEEL_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("keel serve");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn drift_cli(gw: &GatewayProcess, dir: &Path, args: &[&str]) -> (i32, String, String) {
    let token = dir.join("admin.token");
    std::fs::write(&token, ADMIN_TOKEN).expect("token");
    let admin = format!("http://{}", gw.admin.expect("admin"));
    let o = Command::new(keel())
        .args(["serve", "drift"])
        .args(args)
        .args(["--admin", &admin, "--token-file"])
        .arg(&token)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("keel serve drift");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn chat(gw: &GatewayProcess, key: &str) -> String {
    let r = http::post_json(gw.public, "/v1/chat/completions", key, &chat_body()).expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["system_fingerprint"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A gauge's value for a series whose labels start with `labels`.
fn gauge(gw: &GatewayProcess, name: &str, labels: &str) -> Option<f64> {
    let m = http::get(gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN)
        .expect("metrics")
        .text();
    let prefix = format!("{name}{{{labels}");
    m.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|x| x.parse().ok())
}

fn audit(dir: &Path, event: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("audit.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

/// Polls `f` every 50 ms until it gives a value, at most `within`.
fn until<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < within, "no {what} after {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sets the flag when dropped: a test's traffic driver stops even when the
/// test panics inside its thread scope (which would otherwise wait for the
/// driver for ever).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn a_recorded_baseline_is_the_reference_of_a_restarted_gateway() {
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let b1 = TestBackend::start(&["--name", "v1"]);
    let (_reg, url) = registry(dir, "chat", &[b1.url()], 1);
    let cfg = config(dir, &url, "chat", "openai", "");
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let base = dir.join("base.json");
    {
        let gw = GatewayProcess::start(&keel(), &cfg);
        for _ in 0..20 {
            chat(&gw, &key);
        }
        // A reference of 20 answers out of 50 is not recorded.
        let (code, _, err) = drift_cli(
            &gw,
            dir,
            &["baseline", "save", "chat", "--model-version", "1", "--out"],
        );
        assert_ne!(code, 0);
        assert!(err.contains("--out"), "{err}");
        let out = base.to_str().expect("utf8");
        let (code, _, err) = drift_cli(
            &gw,
            dir,
            &[
                "baseline",
                "save",
                "chat",
                "--model-version",
                "1",
                "--out",
                out,
            ],
        );
        assert_ne!(code, 0);
        assert!(
            err.contains("has a full reference window yet (20 of 50 observations)")
                && err.contains("HTTP 409"),
            "{err}"
        );
        assert!(!base.exists());
        // The admin route refuses what it cannot read, and models it does
        // not watch.
        let admin = gw.admin.expect("admin");
        for (path, status, want) in [
            (
                "/admin/drift/chat/baseline",
                400,
                "give the registry version",
            ),
            (
                "/admin/drift/chat/baseline?version=1&window=all",
                400,
                "window \"all\": give reference or current",
            ),
            (
                "/admin/drift/other",
                404,
                "model \"other\" is not watched for drift",
            ),
        ] {
            let r = http::get(admin, path, ADMIN_TOKEN).expect("admin");
            assert_eq!(r.status, status, "{path}: {}", r.text());
            let msg = r.json()["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(msg.contains(want), "{path}: {msg}");
        }
        assert_eq!(
            http::get(admin, "/admin/drift/chat", "wrong")
                .expect("admin")
                .status,
            401
        );
        for _ in 0..40 {
            chat(&gw, &key);
        }
        let (code, _, err) = drift_cli(
            &gw,
            dir,
            &[
                "baseline",
                "save",
                "chat",
                "--model-version",
                "7",
                "--out",
                out,
            ],
        );
        assert_ne!(code, 0);
        assert!(err.contains("has served no answer from \"v7\""), "{err}");
        let (code, text, err) = drift_cli(
            &gw,
            dir,
            &[
                "baseline",
                "save",
                "chat",
                "--model-version",
                "1",
                "--out",
                out,
            ],
        );
        assert_eq!(code, 0, "{err}");
        assert!(text.contains("reference window of v1"), "{text}");
        let mode = std::fs::metadata(&base)
            .expect("baseline")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let doc: Value =
            serde_json::from_slice(&std::fs::read(&base).expect("read")).expect("json");
        assert_eq!(
            (doc["version"].as_u64(), doc["model"].as_str()),
            (Some(1), Some("chat"))
        );
        let names: Vec<&str> = doc["features"]
            .as_array()
            .expect("features")
            .iter()
            .filter_map(|f| f["name"].as_str())
            .collect();
        assert!(
            names.contains(&"completion_tokens") && names.contains(&"prompt_tokens"),
            "{names:?}"
        );
        // Each version's first answers: no drift in the same backend's.
        let psi = gauge(
            &gw,
            "keel_drift_psi",
            "model=\"chat\",version=\"v1\",feature=\"completion_tokens\"",
        );
        assert!(psi.is_none_or(|p| p < 0.1), "{psi:?}");
    }
    let o = Command::new(keel())
        .args(["serve", "drift", "baseline", "show"])
        .arg(&base)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("show");
    let text = ok(o);
    assert!(
        text.contains("completion_tokens") && text.contains("prompt_tokens"),
        "{text}"
    );

    // `show` on a file that is not a baseline, or is missing: data error
    // (65) and I/O error (74), each naming the file.
    let not_baseline = dir.join("not-a-baseline.json");
    std::fs::write(&not_baseline, "hello").expect("write");
    for (file, code, want) in [
        (not_baseline.clone(), 65, "is not a baseline file"),
        (
            dir.join("missing.json"),
            74,
            "cannot read the drift baseline",
        ),
    ] {
        let o = Command::new(keel())
            .args(["serve", "drift", "baseline", "show"])
            .arg(&file)
            .env_remove("KEEL_CONFIG")
            .output()
            .expect("show");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{err}");
        assert!(
            err.contains(want) && err.contains(&*file.to_string_lossy()),
            "{err}"
        );
    }

    // A restarted gateway measures against the baseline from its first
    // window: the backend now answers one token where it answered eight.
    let cfg = config(dir, &url, "chat", "openai", "baseline_file = \"base.json\"");
    let gw = GatewayProcess::start(&keel(), &cfg);
    b1.control(json!({"tokens": 1}));
    for _ in 0..50 {
        chat(&gw, &key);
    }
    let psi = gauge(
        &gw,
        "keel_drift_psi",
        "model=\"chat\",version=\"v1\",feature=\"completion_tokens\"",
    )
    .expect("measured against the baseline");
    assert!(psi > 1.0, "{psi}");
    let (code, text, err) = drift_cli(&gw, dir, &["status", "chat"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("baseline  reference window of v1"), "{text}");
    drop(gw);

    // Without the baseline the same answers are their own reference.
    let cfg = config(dir, &url, "chat", "openai", "");
    let gw = GatewayProcess::start(&keel(), &cfg);
    for _ in 0..100 {
        chat(&gw, &key);
    }
    let psi = gauge(
        &gw,
        "keel_drift_psi",
        "model=\"chat\",version=\"v1\",feature=\"completion_tokens\"",
    )
    .expect("measured");
    assert!(psi < 0.1, "{psi}");
}

/// `keel serve drift baseline show FILE` of `doc`: exit code, stdout,
/// stderr.
fn show(dir: &Path, doc: &Value) -> (Option<i32>, String, String) {
    let file = dir.join("shown.json");
    std::fs::write(&file, serde_json::to_vec(doc).expect("json")).expect("write");
    let o = Command::new(keel())
        .args(["serve", "drift", "baseline", "show"])
        .arg(&file)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("show");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn show_refuses_counts_past_the_cap_and_control_characters_without_a_panic() {
    let t = tempfile::tempdir().expect("tmp");
    let good = json!({"version": 1, "model": "chat", "recorded_from": "v1",
        "window": "reference", "recorded_at": "2026-11-26T08:00:00Z",
        "features": [{"name": "completion_tokens", "edges": [1.0], "counts": [3, 97]}]});
    let (code, text, err) = show(t.path(), &good);
    assert_eq!(code, Some(0), "{err}");
    assert!(text.contains("completion_tokens"), "{text}");

    let mut overflow = good.clone();
    overflow["features"][0]["counts"] = json!([u64::MAX, 1]);
    let (code, _, err) = show(t.path(), &overflow);
    assert_eq!(code, Some(65), "{err}");
    assert!(
        err.contains("add up to more than 2^64 observations") && err.contains("shown.json"),
        "{err}"
    );

    for field in ["model", "recorded_from", "recorded_at", "window"] {
        let mut esc = good.clone();
        esc[field] = json!("v1\u{1b}]0;owned\u{7}\u{1b}[2J");
        let (code, text, err) = show(t.path(), &esc);
        assert_eq!(code, Some(65), "{field}: {err}");
        assert!(
            !text.contains('\u{1b}') && !err.contains('\u{1b}'),
            "{field}: {text:?} {err:?}"
        );
        assert!(err.contains("holds control characters"), "{field}: {err}");
    }
}

#[test]
fn bad_baselines_and_fallbacks_stop_the_gateway_at_start() {
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let b1 = TestBackend::start(&["--name", "v1"]);
    let (_reg, url) = registry(dir, "chat", &[b1.url()], 1);
    let cases: Vec<(&str, Option<&str>, &str)> = vec![
        (
            "baseline_file = \"missing.json\"",
            None,
            "drift.baseline_file: cannot read the drift baseline",
        ),
        (
            "baseline_file = \"base.json\"",
            Some("{\"version\": 1, \"model\": \"chat\""),
            "is not a baseline file",
        ),
        (
            "baseline_file = \"base.json\"",
            Some(
                r#"{"version": 1, "model": "other", "recorded_from": "v1", "window": "reference", "recorded_at": "x", "features": [{"name": "latency_ms", "edges": [1.0], "counts": [1, 1]}]}"#,
            ),
            "recorded for model \"other\", not \"chat\"",
        ),
        (
            "baseline_file = \"base.json\"",
            Some(
                r#"{"version": 1, "model": "chat", "recorded_from": "v1", "window": "reference", "recorded_at": "x", "features": [{"name": "latency_ms", "edges": [1.0], "counts": [0, 0]}]}"#,
            ),
            "feature \"latency_ms\": every count is 0",
        ),
        (
            "action = \"fallback\"",
            None,
            "action = \"fallback\" needs fallback_version",
        ),
        (
            "action = \"fallback\"\nfallback_version = 9",
            None,
            "drift.fallback_version 9 of registry model \"chat\" cannot take the traffic",
        ),
        (
            "consecutive = 0",
            None,
            "drift.consecutive 0 must be within",
        ),
    ];
    for (drift, file, want) in cases {
        if let Some(f) = file {
            std::fs::write(dir.join("base.json"), f).expect("write");
        }
        let cfg = config(dir, &url, "chat", "openai", drift);
        let (code, err) = start_fails(&cfg);
        assert_ne!(code, 0, "{drift}");
        assert!(err.contains(want), "{drift}: {err}");
        if want.contains("cannot take the traffic") {
            // The registry's refusal of the version, unclassified: the
            // binary's default, an I/O failure.
            assert_eq!(code, 74, "{drift}: {err}");
        }
    }
}

fn infer(gw: &GatewayProcess, key: &str, shift: f64, i: usize) -> String {
    let data: Vec<f64> = (0..4)
        .flat_map(|r| {
            let x = ((i * 4 + r) % 50) as f64;
            [x, x * 2.0 + shift]
        })
        .collect();
    let body = json!({"inputs": [
        {"name": "features", "shape": [4, 2], "datatype": "FP32", "data": data},
        {"name": "note", "shape": [1], "datatype": "BYTES", "data": ["x"]}
    ]});
    let r = http::post_json(gw.public, "/v2/models/tab/infer", key, &body).expect("infer");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["parameters"]["backend"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn a_shifted_input_column_of_an_oip_model_drifts_and_moves_no_alias_even_under_fallback() {
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);
    let (_reg, url) = registry(dir, "tab", &[b1.url(), b2.url()], 2);
    let cfg = config(
        dir,
        &url,
        "tab",
        "oip",
        "action = \"fallback\"\nfallback_version = 1\ninterval_s = 1\nconsecutive = 2\npsi_threshold = 1.0",
    );
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    // The tensor is watched once 20 requests sent it (the 20th counts),
    // then 13 requests of 4 rows: the reference of 50 values per column.
    for i in 0..19 + 13 {
        assert_eq!(infer(&gw, &key, 0.0, i), "v2");
    }
    assert!(gauge(
        &gw,
        "keel_drift_psi",
        "model=\"tab\",version=\"v2\",feature=\"input.features"
    )
    .is_none());
    // The second column moves up by 500; the first stays.
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| {
            let mut i = 0;
            let mut served = std::collections::BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                served.insert(infer(&gw, &key, 500.0, i));
                i += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            served
        });
        let alarm = until(Duration::from_secs(20), "drift_input_alarm", || {
            audit(dir, "drift_input_alarm").into_iter().next()
        });
        assert_eq!(alarm["model"], "tab");
        assert_eq!(alarm["version"], "v2");
        assert_eq!(alarm["feature"], "input.features.1");
        assert!(alarm["psi"].as_f64().is_some_and(|p| p > 1.0), "{alarm}");
        // Clients' inputs move no alias, `fallback` or not: a few seconds
        // of traffic later, v2 still serves all.
        std::thread::sleep(Duration::from_millis(3000));
        stop.store(true, Ordering::Relaxed);
        let served = d.join().expect("driver");
        assert_eq!(
            served.into_iter().collect::<Vec<_>>(),
            vec!["v2".to_owned()]
        );
    });
    let shifted = gauge(
        &gw,
        "keel_drift_psi",
        "model=\"tab\",version=\"v2\",feature=\"input.features.1\"",
    )
    .expect("shifted column");
    let same = gauge(
        &gw,
        "keel_drift_psi",
        "model=\"tab\",version=\"v2\",feature=\"input.features.0\"",
    )
    .expect("unshifted column");
    assert!(shifted > 1.0 && same < 0.25, "{shifted} {same}");
    assert!(audit(dir, "drift_fallback").is_empty());
    assert!(audit(dir, "drift_alarm").is_empty());
    assert_eq!(
        gauge(
            &gw,
            "keel_drift_actions_total",
            "model=\"tab\",version=\"v2\",action=\"input_notify\""
        ),
        Some(1.0)
    );
    assert!(gauge(
        &gw,
        "keel_drift_input_breaches",
        "model=\"tab\",version=\"v2\""
    )
    .is_some_and(|b| b >= 2.0));
    // The BYTES tensor is no feature.
    let m = http::get(gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN)
        .expect("metrics")
        .text();
    assert!(!m.contains("feature=\"input.note"), "{m}");
}

#[test]
fn the_fallback_action_moves_the_stable_alias_once_and_an_operator_moves_it_back() {
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);
    let (_reg, url) = registry(dir, "chat", &[b1.url(), b2.url()], 2);
    let cfg = config(
        dir,
        &url,
        "chat",
        "openai",
        "action = \"fallback\"\nfallback_version = 1\ninterval_s = 1\nconsecutive = 2\npsi_threshold = 1.0",
    );
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    for _ in 0..50 {
        assert_eq!(chat(&gw, &key), "v2");
    }
    // Steady answers: a few evaluations of a full window, no action
    // (the threshold of 1 is far above what load-dependent latency moves).
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| {
            let mut n = std::collections::BTreeMap::<String, u64>::new();
            while !stop.load(Ordering::Relaxed) {
                *n.entry(chat(&gw, &key)).or_default() += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        });
        std::thread::sleep(Duration::from_millis(3500));
        assert!(audit(dir, "drift_alarm").is_empty());
        // v2 now answers one token where it answered eight.
        b2.control(json!({"tokens": 1}));
        let fb = until(Duration::from_secs(20), "drift_fallback", || {
            audit(dir, "drift_fallback").into_iter().next()
        });
        assert_eq!(fb["ok"], true, "{fb}");
        assert_eq!(
            (fb["from_version"].as_u64(), fb["to_version"].as_u64()),
            (Some(2), Some(1))
        );
        let id = fb["drift_id"].as_str().expect("id").to_owned();
        let alarm = audit(dir, "drift_alarm");
        assert_eq!(alarm[0]["drift_id"], id.as_str());
        // The traffic follows the moved alias within 2 s.
        let t0 = Instant::now();
        until(Duration::from_secs(3), "v1 serving", || {
            (0..5).all(|_| chat(&gw, &key) == "v1").then_some(())
        });
        assert!(t0.elapsed() < Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        let n = d.join().expect("driver");
        assert!(n.contains_key("v2"), "{n:?}");
        // The alias history has the same drift id and the numbers.
        let addr = url.trim_start_matches("http://").parse().expect("addr");
        let rkey = std::fs::read_to_string(dir.join("registry.key")).expect("key");
        let h = http::get(
            addr,
            "/api/v1/history?name=chat&alias=production",
            rkey.trim(),
        )
        .expect("history")
        .json();
        let last = h["events"]
            .as_array()
            .and_then(|e| e.last())
            .cloned()
            .expect("event");
        assert_eq!(last["new_version"], 1);
        let reason = last["reason"].as_str().expect("reason");
        assert!(
            reason.starts_with(&format!("drift {id}: v2 PSI "))
                && reason.contains("above 1 on 2 consecutive evaluations")
                && reason.ends_with("stable traffic moves from version 2 to version 1"),
            "{reason}"
        );
        assert_eq!(
            gauge(
                &gw,
                "keel_drift_actions_total",
                "model=\"chat\",version=\"v2\",action=\"fallback\""
            ),
            Some(1.0)
        );
    });
    // An operator moves the alias back: the gateway follows and does not
    // fall back from v2 again, though it still drifts.
    ok(model(
        &dir.join("registry.db"),
        &[
            "alias",
            "set",
            "chat",
            "production",
            "2",
            "--reason",
            "v2 is fine",
        ],
    ));
    until(Duration::from_secs(3), "v2 serving again", || {
        (0..5).all(|_| chat(&gw, &key) == "v2").then_some(())
    });
    let refused = until(Duration::from_secs(20), "a second alarm", || {
        for _ in 0..20 {
            chat(&gw, &key);
        }
        audit(dir, "drift_fallback").into_iter().nth(1)
    });
    assert_eq!(refused["ok"], false);
    assert!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("already fell back from this version")),
        "{refused}"
    );
    assert!((0..10).all(|_| chat(&gw, &key) == "v2"));
}

/// A chat request with a prompt of `bytes` characters: who served it.
fn chat_sized(gw: &GatewayProcess, key: &str, bytes: usize) -> String {
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(bytes)}], "max_tokens": 8});
    let r = http::post_json(gw.public, "/v1/chat/completions", key, &body).expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["system_fingerprint"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn longer_prompts_and_a_slower_backend_alone_move_no_alias_even_under_fallback() {
    let t = tempfile::tempdir().expect("tmp");
    let dir = t.path();
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);
    let (_reg, url) = registry(dir, "chat", &[b1.url(), b2.url()], 2);
    let cfg = config(
        dir,
        &url,
        "chat",
        "openai",
        "action = \"fallback\"\nfallback_version = 1\ninterval_s = 1\nconsecutive = 2\npsi_threshold = 1.0",
    );
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    // The reference: 50 answers to prompts of 8 to 40 bytes, at once.
    for i in 0..50 {
        assert_eq!(chat_sized(&gw, &key, 8 + i % 33), "v2");
    }
    // Clients now send prompts a hundred times longer and the backend is
    // loaded (50 ms an answer); the answers are the same eight tokens.
    b2.control(json!({"latency_ms": 50}));
    let stop = AtomicBool::new(false);
    // A failed assertion below stops the client too (the scope joins it).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| {
            let mut served = std::collections::BTreeSet::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                served.insert(chat_sized(&gw, &key, 2000 + i % 500));
                i += 1;
            }
            served
        });
        // Reported: prompt_tokens and latency_ms drift far above the threshold.
        let alarm = until(Duration::from_secs(30), "drift_input_alarm", || {
            audit(dir, "drift_input_alarm").into_iter().next()
        });
        assert_eq!(alarm["version"], "v2");
        let feature = alarm["feature"].as_str().unwrap_or_default();
        assert!(
            feature == "prompt_tokens" || feature == "latency_ms",
            "{alarm}"
        );
        assert!(alarm["psi"].as_f64().is_some_and(|p| p > 1.0), "{alarm}");
        // Never acted on: a few more evaluations later v2 still serves all.
        std::thread::sleep(Duration::from_millis(3000));
        stop.store(true, Ordering::Relaxed);
        let served = d.join().expect("driver");
        assert_eq!(
            served.into_iter().collect::<Vec<_>>(),
            vec!["v2".to_owned()]
        );
    });
    for f in ["prompt_tokens", "latency_ms"] {
        let psi = gauge(
            &gw,
            "keel_drift_psi",
            &format!("model=\"chat\",version=\"v2\",feature=\"{f}\""),
        )
        .expect(f);
        assert!(psi > 1.0, "{f}: {psi}");
    }
    assert!(audit(dir, "drift_alarm").is_empty());
    assert!(audit(dir, "drift_fallback").is_empty());
}
