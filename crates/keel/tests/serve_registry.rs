//! `keel serve` following the registry served by `keel model serve`: two
//! test backends serve versions 1 and 2 of `chat` (their `keel.backend`
//! tags); `keel model alias set` and `keel model rollback` reach the
//! gateway within 2 s; a reload keeps the registry's routing; with the
//! registry down the gateway keeps its last routing; a missing registry model, a version with no backend and a
//! revoked key stop `keel serve` at start with an error. Rollouts through
//! `keel serve rollout`: a healthy canary promoted (the stable alias moved),
//! a canary with 20% empty answers aborted at its first step and its alias
//! rolled back, both recorded under one rollout id in the gateway's audit
//! log and the registry's alias history; a rollout without a canary
//! refused. Rollouts across a restart (`kill -9` of the gateway): one
//! continues at its step and is promoted; one whose canary alias was
//! deleted meanwhile stops with the reason; a corrupt state file stops the
//! gateway. A write key the registry refuses fails `rollout start` with
//! exit code 77 and changes nothing. An OIP canary whose outputs shift is
//! aborted on `output_mean`.

mod serve_common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serve_common::{chat_body, create_key, http, keel, GatewayProcess, TestBackend};
use serve_common::{model, ok, registry_at, Registry};
use serve_common::{ADMIN_TOKEN, METRICS_TOKEN};

fn registry(db: &Path) -> (Registry, String) {
    registry_at(db, "127.0.0.1:0")
}

/// Registers `chat` versions, one per backend URL (`None`: no tag).
fn register(dir: &Path, db: &Path, backends: &[Option<String>]) {
    for (i, b) in backends.iter().enumerate() {
        let files = dir.join(format!("chat-v{}", i + 1));
        std::fs::create_dir_all(&files).expect("mkdir");
        std::fs::write(files.join("weights.bin"), format!("version {}", i + 1)).expect("write");
        let mut args = vec!["register", "chat", "--path", files.to_str().expect("utf8")];
        let tag = b.as_ref().map(|u| format!("keel.backend={u}"));
        if let Some(t) = &tag {
            args.extend(["--tag", t]);
        }
        ok(model(db, &args));
    }
}

fn read_key(db: &Path, name: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(&ok(model(
        db,
        &["--json", "keys", "create", name, "--role", "read"],
    )))
    .expect("json");
    v["secret"].as_str().expect("secret").to_owned()
}

fn config(dir: &Path, registry_url: &str, registry_model: &str) -> std::path::PathBuf {
    config_with(dir, registry_url, registry_model, "", "")
}

/// [`config`] with more `[registry]` keys and more keys in the model's
/// `registry` table (`, key = value`).
fn config_with(
    dir: &Path,
    registry_url: &str,
    registry_model: &str,
    registry_extra: &str,
    model_extra: &str,
) -> std::path::PathBuf {
    serve_common::registry_config(
        dir,
        registry_url,
        registry_model,
        registry_extra,
        model_extra,
    )
}

fn served_by(gw: &GatewayProcess, key: &str) -> String {
    let r = http::post_json(gw.public, "/v1/chat/completions", key, &chat_body()).expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["system_fingerprint"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn wait_for(gw: &GatewayProcess, key: &str, name: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        if (0..5).all(|_| served_by(gw, key) == name) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not served by {name} after 5 s"
        );
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
fn keel_serve_follows_the_registry_and_keeps_routing_when_it_is_down() {
    let t = tempfile::tempdir().expect("tmp");
    let db = t.path().join("registry.db");
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);
    register(t.path(), &db, &[Some(b1.url()), Some(b2.url())]);
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "1",
            "--reason",
            "first release",
        ],
    ));
    std::fs::write(t.path().join("registry.key"), read_key(&db, "gateway")).expect("key");
    let (mut reg, url) = registry(&db);
    let cfg = config(t.path(), &url, "chat");
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    assert_eq!(served_by(&gw, &key), "v1");

    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "2",
            "--reason",
            "v2 is better",
        ],
    ));
    let took = wait_for(&gw, &key, "v2");
    assert!(took < Duration::from_secs(2), "followed after {took:?}");

    // A reload keeps the registry's routing (not the file's template).
    gw.signal("HUP");
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v2");
    }

    ok(model(
        &db,
        &[
            "rollback",
            "chat",
            "production",
            "--reason",
            "v2 answers badly",
        ],
    ));
    let took = wait_for(&gw, &key, "v1");
    assert!(took < Duration::from_secs(2), "followed after {took:?}");

    // The registry goes down: the last known routing stays.
    let _ = reg.0.kill();
    let _ = reg.0.wait();
    std::thread::sleep(Duration::from_millis(2500));
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v1");
    }
    let m = http::get(gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN).expect("metrics");
    assert!(
        m.text()
            .contains("keel_errors_total{route=\"registry\",kind=\"registry_unreachable\"}"),
        "{}",
        m.text()
    );
}

/// `keel serve --config` that must fail: (exit code, stderr).
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

#[test]
fn keel_serve_refuses_bad_registry_input_at_start() {
    let t = tempfile::tempdir().expect("tmp");
    let db = t.path().join("registry.db");
    register(t.path(), &db, &[None]);
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "1",
            "--reason",
            "untagged",
        ],
    ));
    let secret = read_key(&db, "gateway");
    std::fs::write(t.path().join("registry.key"), &secret).expect("key");
    let (_reg, url) = registry(&db);

    let (code, err) = start_fails(&config(t.path(), &url, "missing"));
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("the registry has no model \"missing\""),
        "{err}"
    );

    let (code, err) = start_fails(&config(t.path(), &url, "chat"));
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("version 1 (alias \"production\") names no backend"),
        "{err}"
    );

    ok(model(&db, &["keys", "revoke", "gateway"]));
    let (code, err) = start_fails(&config(t.path(), &url, "chat"));
    assert_eq!(code, 77, "{err}");
    assert!(err.contains("refused the key"), "{err}");
    assert!(!err.contains(&secret));
}

#[test]
fn keel_serve_checks_signatures_against_the_trusted_key() {
    let t = tempfile::tempdir().expect("tmp");
    let db = t.path().join("registry.db");
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);
    register(t.path(), &db, &[Some(b1.url()), Some(b2.url())]);
    let p = |name: &str| t.path().join(name).to_str().expect("utf8").to_owned();
    for k in ["a", "b"] {
        ok(model(
            &db,
            &[
                "keygen",
                "--private-key",
                &p(&format!("{k}.pem")),
                "--public-key",
                &p(&format!("{k}.pub")),
            ],
        ));
    }
    ok(model(&db, &["sign", "chat:1", "--key", &p("a.pem")]));
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "1",
            "--reason",
            "signed",
        ],
    ));
    std::fs::write(t.path().join("registry.key"), read_key(&db, "gateway")).expect("key");
    let (_reg, url) = registry(&db);
    let signed = ", require_signature = true";

    let cfg = config_with(t.path(), &url, "chat", "", signed);
    let (code, err) = start_fails(&cfg);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("require_signature needs registry.public_key_file"),
        "{err}"
    );

    // The signature covers the files, not where requests go: the
    // backends must be named in the gateway's configuration too.
    let cfg = config_with(
        t.path(),
        &url,
        "chat",
        "public_key_file = \"a.pub\"",
        signed,
    );
    let (code, err) = start_fails(&cfg);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("require_signature needs registry.allowed_backends"),
        "{err}"
    );
    let signed = format!(
        ", require_signature = true, allowed_backends = [\"{}\", \"{}/\"]",
        b1.url(),
        b2.url()
    );
    let signed = signed.as_str();

    let cfg = config_with(
        t.path(),
        &url,
        "chat",
        "public_key_file = \"b.pub\"",
        signed,
    );
    let (code, err) = start_fails(&cfg);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("version 1 (alias \"production\"): the signature does not verify"),
        "{err}"
    );

    let cfg = config_with(
        t.path(),
        &url,
        "chat",
        "public_key_file = \"a.pub\"",
        signed,
    );
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    assert_eq!(served_by(&gw, &key), "v1");
    // Version 2 is not signed: the alias moving there is not followed.
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "2",
            "--reason",
            "unsigned",
        ],
    ));
    std::thread::sleep(Duration::from_millis(2500));
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v1");
    }
    let m = http::get(gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN).expect("metrics");
    assert!(
        m.text()
            .contains("keel_errors_total{route=\"registry\",kind=\"registry_refused\"}"),
        "{}",
        m.text()
    );

    // Issue 44 (E3): whoever can write the registry rewrites signed v1's
    // backend to one of theirs, or gives v3 (the same files as v1) v1's
    // signature: neither is followed, and no request reaches theirs.
    let evil = TestBackend::start(&["--name", "evil"]);
    let clock = std::sync::Arc::new(keel_registry::FixedClock(1_800_000_000_000));
    let mut reg = keel_registry::Registry::open(&db, clock).expect("registry db");
    let refused = |gw: &GatewayProcess| -> u64 {
        let m =
            http::get(gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN).expect("metrics");
        m.text()
            .lines()
            .find(|l| {
                l.starts_with("keel_errors_total{route=\"registry\",kind=\"registry_refused\"}")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    let wait_refused = |gw: &GatewayProcess, before: u64| {
        let t0 = Instant::now();
        while refused(gw) < before + 2 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no refused poll");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "1",
            "--reason",
            "back",
        ],
    ));
    reg.set_version_tag("mallory", "chat", 1, "keel.backend", Some(&evil.url()))
        .expect("rewrite the tag");
    let before = refused(&gw);
    wait_refused(&gw, before);
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v1");
    }
    reg.set_version_tag("mallory", "chat", 1, "keel.backend", Some(&b1.url()))
        .expect("tag back");
    let v1_files = t.path().join("chat-v1");
    ok(model(
        &db,
        &[
            "register",
            "chat",
            "--path",
            v1_files.to_str().expect("utf8"),
            "--tag",
            &format!("keel.backend={}", b2.url()),
        ],
    ));
    let sig = reg.signature("chat", 1).expect("read").expect("v1 signed");
    reg.attach_signature(
        "mallory",
        "chat",
        3,
        &sig.bundle,
        &sig.public_key_pem,
        &sig.key_hint,
    )
    .expect("copy v1's signature to v3");
    let v3 = reg.version("chat", 3).expect("v3");
    assert_eq!(
        v3.manifest_digest,
        reg.version("chat", 1).expect("v1").manifest_digest,
        "v3 has v1's files"
    );
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "3",
            "--reason",
            "copied",
        ],
    ));
    let before = refused(&gw);
    wait_refused(&gw, before);
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v1");
    }
    assert_eq!(evil.count("/v1/chat/completions"), 0);
}

/// `keel serve rollout ARGS --admin .. --token-file ..`: (exit code,
/// stdout, stderr).
fn rollout_cli(gw: &GatewayProcess, dir: &Path, args: &[&str]) -> (i32, String, String) {
    let token = dir.join("admin.token");
    std::fs::write(&token, ADMIN_TOKEN).expect("token");
    let admin = format!("http://{}", gw.admin.expect("admin"));
    let o = Command::new(keel())
        .args(["serve", "rollout"])
        .args(args)
        .args(["--admin", &admin, "--token-file"])
        .arg(&token)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("keel serve rollout");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn rollout_status(gw: &GatewayProcess, dir: &Path) -> serde_json::Value {
    let (code, out, err) = rollout_cli(gw, dir, &["--json", "status", "chat"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("json")
}

/// A rollout's setting: registry `chat` v1 (`production`) on backend `v1`,
/// v2 on a backend `v2` started with `v2_args`, a read and a write key,
/// an audit log, `[models.rollout]` as given.
struct RolloutSetup {
    t: tempfile::TempDir,
    db: std::path::PathBuf,
    url: String,
    _reg: Registry,
    _b: (TestBackend, TestBackend),
    gw: GatewayProcess,
    cfg: std::path::PathBuf,
    key: String,
}

fn rollout_setup(v2_args: &[&str], rollout: &str) -> RolloutSetup {
    rollout_setup_with(v2_args, rollout, "write", "openai")
}

/// [`rollout_setup`] with the role of the gateway's write key
/// (`registry.write_key_file`) and the model's protocol.
fn rollout_setup_with(
    v2_args: &[&str],
    rollout: &str,
    write_role: &str,
    protocol: &str,
) -> RolloutSetup {
    let t = tempfile::tempdir().expect("tmp");
    let db = t.path().join("registry.db");
    let b1 = TestBackend::start(&["--name", "v1"]);
    let mut a = vec!["--name", "v2"];
    a.extend_from_slice(v2_args);
    let b2 = TestBackend::start(&a);
    register(t.path(), &db, &[Some(b1.url()), Some(b2.url())]);
    ok(model(
        &db,
        &[
            "alias",
            "set",
            "chat",
            "production",
            "1",
            "--reason",
            "first",
        ],
    ));
    std::fs::write(t.path().join("registry.key"), read_key(&db, "gateway")).expect("key");
    let w: serde_json::Value = serde_json::from_str(&ok(model(
        &db,
        &["--json", "keys", "create", "rollouts", "--role", write_role],
    )))
    .expect("json");
    std::fs::write(
        t.path().join("rollouts.key"),
        w["secret"].as_str().expect("secret"),
    )
    .expect("key");
    let (reg, url) = registry(&db);
    let cfg = config_with(
        t.path(),
        &url,
        "chat",
        "write_key_file = \"rollouts.key\"\ndrift_reference_requests = 50\ndrift_window_requests = 50\n[audit]\npath = \"audit.jsonl\"",
        "",
    );
    let mut text = std::fs::read_to_string(&cfg).expect("read");
    text = text.replace(
        "name = \"chat\"\n",
        &format!("name = \"chat\"\nprotocol = \"{protocol}\"\n"),
    );
    text.push_str(&format!("[models.rollout]\n{rollout}\n"));
    std::fs::write(&cfg, text).expect("write");
    let (_, key) = create_key(&cfg, "alice", "user", None);
    let gw = GatewayProcess::start(&keel(), &cfg);
    RolloutSetup {
        t,
        db,
        url,
        _reg: reg,
        _b: (b1, b2),
        gw,
        cfg,
        key,
    }
}

/// Sends chat requests one after another until `stop`; counts who served.
fn drive(
    gw: &GatewayProcess,
    key: &str,
    stop: &std::sync::atomic::AtomicBool,
) -> std::collections::BTreeMap<String, u64> {
    let mut n = std::collections::BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(r) = http::post_json(gw.public, "/v1/chat/completions", key, &chat_body()) {
            let by = r.json()["system_fingerprint"]
                .as_str()
                .unwrap_or("error")
                .to_owned();
            *n.entry(by).or_default() += 1;
        }
    }
    n
}

/// The events of `chat`'s `alias` in the registry's alias history.
fn alias_history(s: &RolloutSetup, alias: &str) -> Vec<serde_json::Value> {
    let addr = s.url.trim_start_matches("http://").parse().expect("addr");
    let key = std::fs::read_to_string(s.t.path().join("registry.key")).expect("key");
    let r = http::get(
        addr,
        &format!("/api/v1/history?name=chat&alias={alias}"),
        key.trim(),
    )
    .expect("history");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["events"].as_array().expect("events").clone()
}

fn audit_events(s: &RolloutSetup, id: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(s.t.path().join("audit.jsonl"))
        .expect("audit log")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["rollout_id"] == id)
        .collect()
}

/// The rollout's audit events once `event` is among them (the audit log
/// is written by a thread of its own, after the registry answered).
fn audit_until(s: &RolloutSetup, id: &str, event: &str) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let a = audit_events(s, id);
        if a.iter().any(|e| e["event"] == event) {
            return a;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no {event} in the audit log: {a:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_phase(s: &RolloutSetup, phase: &str, within: Duration) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let st = rollout_status(&s.gw, s.t.path());
        if st["phase"] == phase {
            return st;
        }
        assert!(
            t0.elapsed() < within,
            "not {phase} after {within:?}: {st:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_healthy_canary_is_promoted_through_every_step() {
    let s = rollout_setup(
        &[],
        "steps = [50, 100]\ninterval_s = 1\nmin_canary_samples = 50",
    );
    // No canary alias yet: a clear error, nothing started.
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("registry model \"chat\" has no version under its canary alias \"canary\": set it first"),
        "{err}"
    );
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["status", "chat"]);
    assert_ne!(code, 0);
    assert!(err.contains("model \"chat\" has no rollout"), "{err}");

    ok(model(
        &s.db,
        &[
            "alias",
            "set",
            "chat",
            "canary",
            "2",
            "--reason",
            "candidate",
        ],
    ));
    // Output drift needs a version's first 50 answers and its last 50:
    // v1 answers these 100 before the rollout (it serves little during it,
    // and nothing once v2 is promoted).
    const DRIFT_ANSWERS: u64 = 100;
    for _ in 0..DRIFT_ANSWERS {
        assert_eq!(served_by(&s.gw, &s.key), "v1");
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| drive(&s.gw, &s.key, &stop));
        let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("weight    50%"), "{out}");
        let st = wait_phase(&s, "promoted", Duration::from_secs(30));
        // The stable alias moved to the canary's version: all traffic on v2.
        wait_for(&s.gw, &s.key, "v2");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let served = d.join().expect("driver");
        assert!(
            served.contains_key("v1") && served.contains_key("v2"),
            "{served:?}"
        );
        // And v2 as many (how many it got during the rollout depends on
        // how fast the machine answered).
        for _ in served.get("v2").copied().unwrap_or(0)..DRIFT_ANSWERS {
            assert_eq!(served_by(&s.gw, &s.key), "v2");
        }
        let id = st["id"].as_str().expect("id").to_owned();
        let verdicts = st["verdicts"].as_array().expect("verdicts");
        assert_eq!(
            verdicts.last().expect("verdict")["decision"],
            "advance",
            "{st:#}"
        );
        assert_eq!(st["weight"], 100);
        audit_until(&s, &id, "rollout_promote");
        let h = alias_history(&s, "production");
        let last = h.last().expect("event");
        assert_eq!(last["new_version"], 2);
        let reason = last["reason"].as_str().expect("reason");
        assert!(
            reason.starts_with(&format!("rollout {id}: promoted, no check failed (50%: ")),
            "{reason}"
        );
        let audit = audit_until(&s, &id, "rollout_promote");
        let events: Vec<String> = audit
            .iter()
            .map(|e| e["event"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(
            events.first().map(String::as_str),
            Some("rollout_start"),
            "{events:?}"
        );
        assert!(events.contains(&"rollout_verdict".to_owned()), "{events:?}");
        assert_eq!(
            events.last().map(String::as_str),
            Some("rollout_promote"),
            "{events:?}"
        );
        let promote = audit.last().expect("promote");
        assert_eq!(
            (promote["ok"].as_bool(), promote["reason"].as_str()),
            (Some(true), Some(reason))
        );
        // Output drift of each version, its last 50 answers against its
        // first 50: identical backends, no drift. The gauges are computed
        // on an interval after the answers: read until both are there.
        let until = std::time::Instant::now() + Duration::from_secs(15);
        let m = loop {
            let m = http::get(s.gw.metrics.expect("metrics"), "/metrics", METRICS_TOKEN)
                .expect("metrics")
                .text();
            let both = ["v1", "v2"].iter().all(|v| {
                m.contains(&format!(
                    "keel_drift_js{{model=\"chat\",version=\"{v}\",feature=\"finish_reason\"}} "
                ))
            });
            if both || std::time::Instant::now() > until {
                break m;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        for v in ["v1", "v2"] {
            let line = m
                .lines()
                .find(|l| {
                    l.starts_with(&format!(
                        "keel_drift_js{{model=\"chat\",version=\"{v}\",feature=\"finish_reason\"}} "
                    ))
                })
                .unwrap_or_else(|| panic!("no drift gauge of {v}: {m}"));
            let js: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|x| x.parse().ok())
                .expect("value");
            assert!(js < 0.01, "{line}");
        }
        // The text status shows each step's verdict with its numbers.
        let (_, text, _) = rollout_cli(&s.gw, s.t.path(), &["status", "chat"]);
        assert!(text.contains("phase     promoted"), "{text}");
        assert!(
            text.contains("advance") && text.contains("empty_answer pass: canary"),
            "{text}"
        );
    });
}

#[test]
fn a_canary_with_empty_answers_is_aborted_and_rolled_back() {
    let s = rollout_setup(
        &["--empty-percent", "20"],
        "steps = [25, 50, 100]\ninterval_s = 1",
    );
    ok(model(
        &s.db,
        &[
            "alias",
            "set",
            "chat",
            "canary",
            "2",
            "--reason",
            "candidate",
        ],
    ));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| drive(&s.gw, &s.key, &stop));
        let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
        assert_eq!(code, 0, "{err}");
        let st = wait_phase(&s, "aborted", Duration::from_secs(20));
        // Weight 0 within one interval: every answer from v1.
        let took = wait_for(&s.gw, &s.key, "v1");
        assert!(
            took < Duration::from_secs(1),
            "canary still served after {took:?}"
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        d.join().expect("driver");
        let id = st["id"].as_str().expect("id").to_owned();
        assert_eq!(st["weight"], 0);
        // At the first step.
        let verdicts = st["verdicts"].as_array().expect("verdicts");
        let last = verdicts.last().expect("verdict");
        assert_eq!(
            (last["decision"].as_str(), last["weight"].as_u64()),
            (Some("abort"), Some(25)),
            "{st:#}"
        );
        assert!(verdicts.iter().all(|v| v["weight"] == 25), "{st:#}");
        // The registry: the canary alias deleted, with the failed check
        // (the audit log's rollback line follows the registry's answer).
        audit_until(&s, &id, "rollout_rollback");
        let h = alias_history(&s, "canary");
        let ev = h.last().expect("event");
        assert_eq!(ev["new_version"], serde_json::Value::Null, "{ev}");
        let reason = ev["reason"].as_str().expect("reason");
        assert!(
            reason.starts_with(&format!("rollout {id}: aborted at 25% (interval ")),
            "{reason}"
        );
        // The backend answers the first 20 of every 100 requests empty, so
        // the canary's empty share in a window is 0.2 or above, depending
        // on where the window starts in that cycle. Empty answers also
        // lower the canary's completion tokens: with few requests in the
        // first interval (a loaded machine), that check can decide first,
        // and the abort names it instead.
        let figure = |check: &str| -> Option<(f64, f64)> {
            let rest = reason.split(&format!("{check} fail: canary ")).nth(1)?;
            let num = |t: &str| -> Option<f64> {
                let end = t
                    .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .unwrap_or(t.len());
                t[..end].parse().ok()
            };
            let canary = num(rest)?;
            let stable = num(rest.split(" vs stable ").nth(1)?)?;
            Some((canary, stable))
        };
        match (figure("empty_answer"), figure("completion_tokens")) {
            (Some((share, _)), _) => assert!((0.15..=0.5).contains(&share), "{reason}"),
            (None, Some((canary, stable))) => assert!(canary < stable * 0.9, "{reason}"),
            (None, None) => panic!("neither the empty share nor completion tokens in {reason}"),
        }
        // The gateway's audit log: the same id, the same reason.
        let audit = audit_until(&s, &id, "rollout_rollback");
        let abort = audit
            .iter()
            .find(|e| e["event"] == "rollout_abort")
            .expect("abort event");
        assert_eq!(
            (abort["weight"].as_u64(), abort["reason"].as_str()),
            (Some(0), Some(reason))
        );
        let rb = audit
            .iter()
            .find(|e| e["event"] == "rollout_rollback")
            .expect("rollback event");
        assert_eq!(
            (rb["ok"].as_bool(), rb["reason"].as_str()),
            (Some(true), Some(reason))
        );
        // Ended: another abort is refused, clearly.
        let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["abort", "chat"]);
        assert_ne!(code, 0);
        assert!(err.contains("cannot abort"), "{err}");
    });
}

#[test]
fn operators_pause_resume_and_abort_a_rollout() {
    // No traffic: the step holds, giving the operator time.
    let s = rollout_setup(&[], "steps = [10, 100]\ninterval_s = 1");
    ok(model(
        &s.db,
        &[
            "alias",
            "set",
            "chat",
            "canary",
            "2",
            "--reason",
            "candidate",
        ],
    ));
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_ne!(code, 0);
    assert!(err.contains("model \"chat\" has rollout ro-"), "{err}");
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["pause", "chat"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("phase     paused") && out.contains("weight    10%"),
        "{out}"
    );
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("phase     progressing"), "{out}");
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["--json", "abort", "chat"]);
    assert_eq!(code, 0, "{err}");
    let st: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        (st["phase"].as_str(), st["weight"].as_u64()),
        (Some("aborted"), Some(0))
    );
    let id = st["id"].as_str().expect("id").to_owned();
    let audit = audit_until(&s, &id, "rollout_rollback");
    let events: Vec<&str> = audit.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(
        events,
        [
            "rollout_start",
            "rollout_weight",
            "rollout_pause",
            "rollout_resume",
            "rollout_weight",
            "rollout_abort",
            "rollout_rollback"
        ]
    );
    let h = alias_history(&s, "canary");
    let ev = h.last().expect("event");
    assert_eq!(ev["new_version"], serde_json::Value::Null, "{ev}");
    assert_eq!(
        ev["reason"],
        format!("rollout {id}: aborted by an operator at 10%: the canary alias is rolled back")
    );
    // A canary alias on a version with no backend: refused at start.
    let files = s.t.path().join("chat-v3");
    std::fs::create_dir_all(&files).expect("mkdir");
    std::fs::write(files.join("weights.bin"), "version 3").expect("write");
    ok(model(
        &s.db,
        &["register", "chat", "--path", files.to_str().expect("utf8")],
    ));
    ok(model(
        &s.db,
        &[
            "alias", "set", "chat", "canary", "3", "--reason", "untagged",
        ],
    ));
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("version 3 (alias \"canary\") names no backend") && err.contains("HTTP 409"),
        "{err}"
    );
    // A model that does not follow the registry, and a bad admin token.
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["status", "other"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("model \"other\" does not follow the registry"),
        "{err}"
    );
    std::fs::write(s.t.path().join("bad.token"), "wrong").expect("token");
    let o = Command::new(keel())
        .args(["serve", "rollout", "status", "chat", "--admin"])
        .arg(format!("http://{}", s.gw.admin.expect("admin")))
        .arg("--token-file")
        .arg(s.t.path().join("bad.token"))
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("keel");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("the admin token was refused"),
        "{err}"
    );
}

/// Sends chat requests about every `pause` until `stop`; counts who served.
fn drive_slowly(
    gw: &GatewayProcess,
    key: &str,
    stop: &std::sync::atomic::AtomicBool,
    pause: Duration,
) -> std::collections::BTreeMap<String, u64> {
    let mut n = std::collections::BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(r) = http::post_json(gw.public, "/v1/chat/completions", key, &chat_body()) {
            let by = r.json()["system_fingerprint"]
                .as_str()
                .unwrap_or("error")
                .to_owned();
            *n.entry(by).or_default() += 1;
        }
        std::thread::sleep(pause);
    }
    n
}

fn canary_set(s: &RolloutSetup) {
    ok(model(
        &s.db,
        &[
            "alias",
            "set",
            "chat",
            "canary",
            "2",
            "--reason",
            "candidate",
        ],
    ));
}

/// The gateway killed with SIGKILL (no shutdown of any kind), then started
/// again on the same configuration and state file.
fn kill_and_restart(s: &mut RolloutSetup) {
    s.gw.signal("KILL");
    s.gw.wait();
    s.gw = GatewayProcess::start(&keel(), &s.cfg);
}

fn state_file(s: &RolloutSetup) -> serde_json::Value {
    let p = s.t.path().join("rollouts.json");
    let text = std::fs::read_to_string(&p).expect("state file");
    serde_json::from_str(&text).expect("state file json")
}

#[test]
fn a_rollout_survives_a_gateway_restart_and_is_promoted() {
    use std::os::unix::fs::PermissionsExt;
    let mut s = rollout_setup(
        &[],
        "steps = [50, 90, 100]\ninterval_s = 1\nmin_canary_samples = 50",
    );
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    // Traffic until the rollout reaches its second step, then none: the
    // step holds for want of samples.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let before = std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| drive_slowly(&s.gw, &s.key, &stop, Duration::from_millis(10)));
        let t0 = Instant::now();
        let st = loop {
            let st = rollout_status(&s.gw, s.t.path());
            if st["weight"] == 90 || st["phase"] != "progressing" {
                break st;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{st:#}");
            std::thread::sleep(Duration::from_millis(20));
        };
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        d.join().expect("driver");
        st
    });
    assert_eq!(
        (before["phase"].as_str(), before["weight"].as_u64()),
        (Some("progressing"), Some(90)),
        "{before:#}"
    );
    let id = before["id"].as_str().expect("id").to_owned();
    // The state file: the step, its verdicts, mode 0600.
    let p = s.t.path().join("rollouts.json");
    let mode = std::fs::metadata(&p)
        .expect("state file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let f = state_file(&s);
    let rec = &f["rollouts"][0];
    assert_eq!(
        (
            rec["id"].as_str(),
            rec["phase"].as_str(),
            rec["step"].as_u64(),
            rec["weight"].as_u64()
        ),
        (Some(id.as_str()), Some("progressing"), Some(1), Some(90)),
        "{f:#}"
    );
    let verdicts_before = rec["verdicts"].as_array().expect("verdicts").len();
    // The first step's counts, which the second step's rate checks include.
    assert_eq!(rec["earlier"].as_array().map(Vec::len), Some(1), "{f:#}");
    assert!(
        rec["earlier"][0]["error_rate"][1]["trials"].as_u64() >= Some(40),
        "{f:#}"
    );
    assert!(verdicts_before >= 1, "{f:#}");

    kill_and_restart(&mut s);
    // The same rollout, at the same step and weight, with its verdicts.
    let st = rollout_status(&s.gw, s.t.path());
    assert_eq!(
        (
            st["id"].as_str(),
            st["phase"].as_str(),
            st["weight"].as_u64()
        ),
        (Some(id.as_str()), Some("progressing"), Some(90)),
        "{st:#}"
    );
    assert!(st["verdicts"].as_array().expect("verdicts").len() >= verdicts_before);
    // Taken up at step 1, and the canary's weight applied again.
    let t0 = Instant::now();
    loop {
        let audit = audit_events(&s, &id);
        if let Some(i) = audit.iter().position(|e| e["event"] == "rollout_recover") {
            assert_eq!(audit[i]["step"], 1, "{:?}", audit[i]);
            if audit[i..]
                .iter()
                .any(|e| e["event"] == "rollout_weight" && e["weight"] == 90)
            {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not taken up: {audit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Traffic again: the step gets its samples and the canary is promoted.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| drive(&s.gw, &s.key, &stop));
        let st = wait_phase(&s, "promoted", Duration::from_secs(30));
        wait_for(&s.gw, &s.key, "v2");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        d.join().expect("driver");
        assert_eq!(st["id"], id.as_str());
        let verdicts = st["verdicts"].as_array().expect("verdicts");
        // Both steps' verdicts: the first step's from before the restart.
        assert!(
            verdicts
                .iter()
                .any(|v| v["step"] == 0 && v["decision"] == "advance"),
            "{st:#}"
        );
        let last = verdicts.last().expect("verdict");
        assert_eq!(
            (last["step"].as_u64(), last["decision"].as_str()),
            (Some(1), Some("advance")),
            "{st:#}"
        );
    });
    // Written once the registry answered the promotion.
    audit_until(&s, &id, "rollout_promote");
    let h = alias_history(&s, "production");
    let last = h.last().expect("event");
    assert_eq!(last["new_version"], 2);
    let reason = last["reason"].as_str().expect("reason");
    assert!(
        reason.starts_with(&format!("rollout {id}: promoted, no check failed (50%: ")),
        "{reason}"
    );
    let f = state_file(&s);
    assert_eq!(f["rollouts"][0]["phase"], "promoted", "{f:#}");
    assert_eq!(f["rollouts"][0]["registry_pending"], false, "{f:#}");
}

#[test]
fn a_rollout_whose_aliases_changed_while_the_gateway_was_down_stops() {
    // No traffic: the first step holds.
    let mut s = rollout_setup(&[], "steps = [25, 100]\ninterval_s = 1");
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    let id = rollout_status(&s.gw, s.t.path())["id"]
        .as_str()
        .expect("id")
        .to_owned();
    s.gw.signal("KILL");
    s.gw.wait();
    // While the gateway is down, someone deletes the canary alias.
    ok(model(
        &s.db,
        &["alias", "rm", "chat", "canary", "--reason", "by hand"],
    ));
    s.gw = GatewayProcess::start(&keel(), &s.cfg);
    let st = wait_phase(&s, "aborted", Duration::from_secs(10));
    assert_eq!(
        (st["id"].as_str(), st["weight"].as_u64()),
        (Some(id.as_str()), Some(0))
    );
    let reason = st["reason"].as_str().expect("reason");
    assert_eq!(
        reason,
        format!("rollout {id}: stopped at 25%: the registry's aliases changed while the gateway was down: the canary alias \"canary\" was deleted")
    );
    let audit = audit_until(&s, &id, "rollout_stop");
    let stop = audit
        .iter()
        .find(|e| e["event"] == "rollout_stop")
        .expect("stop");
    assert_eq!(stop["reason"].as_str(), Some(reason));
    // No alias was changed by the gateway: the hand deletion is the last
    // event, and every answer comes from the stable version.
    let h = alias_history(&s, "canary");
    assert_eq!(h.last().expect("event")["reason"], "by hand");
    wait_for(&s.gw, &s.key, "v1");
    assert_eq!(state_file(&s)["rollouts"][0]["phase"], "aborted");
    // The stopped rollout is shown by status after another restart, and a
    // new one can start once a canary is set again.
    kill_and_restart(&mut s);
    let st = rollout_status(&s.gw, s.t.path());
    assert_eq!(
        (st["phase"].as_str(), st["reason"].as_str()),
        (Some("aborted"), Some(reason))
    );
    let (_, text, _) = rollout_cli(&s.gw, s.t.path(), &["status", "chat"]);
    assert!(text.contains(&format!("ended     {reason}\n")), "{text}");
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    assert_ne!(rollout_status(&s.gw, s.t.path())["id"], id.as_str());

    // A corrupt state file: keel serve does not start, and says which file.
    s.gw.signal("KILL");
    s.gw.wait();
    let p = s.t.path().join("rollouts.json");
    std::fs::write(&p, "{\"version\": 1, \"rollouts\": [{\"id\": ").expect("write");
    let (code, err) = start_fails(&s.cfg);
    assert_eq!(code, 65, "{err}");
    assert!(
        err.contains(&format!(
            "the rollout state file {} is not what keel writes",
            p.display()
        )) && err.contains("nothing was reset"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&p).expect("read"),
        "{\"version\": 1, \"rollouts\": [{\"id\": "
    );
    // A state file that is a FIFO no one writes: refused at once, naming
    // it, instead of keel serve waiting on it forever before it listens
    // (issue 44, E11).
    std::fs::remove_file(&p).expect("rm");
    let made = Command::new("mkfifo").arg(&p).status().expect("mkfifo");
    assert!(made.success());
    let (code, err) = start_fails(&s.cfg);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn rollout_start_refuses_a_write_key_without_write_rights() {
    // The gateway's "write" key is a read key.
    let s = rollout_setup_with(&[], "steps = [25, 100]\ninterval_s = 1", "read", "openai");
    canary_set(&s);
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 77, "{out}{err}");
    assert!(
        err.contains("the registry refused the gateway's write key (registry.write_key_file) the alias changes of registry model \"chat\": nothing was changed")
            && err.contains("HTTP 403"),
        "{err}"
    );
    // Nothing changed: no rollout, no state file, no weight, the aliases
    // as they were, no audit event.
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["status", "chat"]);
    assert_ne!(code, 0);
    assert!(err.contains("model \"chat\" has no rollout"), "{err}");
    assert!(!s.t.path().join("rollouts.json").exists());
    assert_eq!(alias_history(&s, "canary").len(), 1);
    assert_eq!(alias_history(&s, "production").len(), 1);
    let served: Vec<String> = (0..20).map(|_| served_by(&s.gw, &s.key)).collect();
    assert!(served.iter().all(|b| b == "v1"), "{served:?}");
    let log = std::fs::read_to_string(s.t.path().join("audit.jsonl")).unwrap_or_default();
    assert!(!log.contains("rollout_start"), "{log}");
    // The registry's dry run with a write key answers yes and changes
    // nothing either.
    let w: serde_json::Value = serde_json::from_str(&ok(model(
        &s.db,
        &["--json", "keys", "create", "writer", "--role", "write"],
    )))
    .expect("json");
    let addr = s.url.trim_start_matches("http://").parse().expect("addr");
    let r = http::post_json(
        addr,
        "/api/v1/aliases/delete",
        w["secret"].as_str().expect("secret"),
        &serde_json::json!({"version": 1, "name": "chat", "alias": "canary", "reason": "may I", "dry_run": true}),
    )
    .expect("dry run");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (r.json()["dry_run"].as_bool(), r.json()["allowed"].as_bool()),
        (Some(true), Some(true))
    );
    let r = http::post_json(
        addr,
        "/api/v1/aliases/set",
        w["secret"].as_str().expect("secret"),
        &serde_json::json!({"version": 1, "name": "chat", "alias": "production", "target": 9, "reason": "may I", "dry_run": true}),
    )
    .expect("dry run");
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(alias_history(&s, "canary").len(), 1);
    assert_eq!(alias_history(&s, "production").len(), 1);
}

#[test]
fn an_oip_canary_with_shifted_outputs_is_aborted_on_output_mean() {
    let s = rollout_setup_with(
        &["--oip-shift", "1.0"],
        "steps = [25, 50, 100]\ninterval_s = 1",
        "write",
        "oip",
    );
    canary_set(&s);
    let body = serde_json::json!({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.5]}]});
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        // A failing assertion below still ends the driver thread, so the
        // scope can join it and the test fails at once.
        let _stop = StopOnDrop(&stop);
        let d = sc.spawn(|| {
            let mut n = std::collections::BTreeMap::<String, u64>::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(r) = http::post_json(s.gw.public, "/v2/models/chat/infer", &s.key, &body)
                {
                    let by = r.json()["parameters"]["backend"]
                        .as_str()
                        .unwrap_or("error")
                        .to_owned();
                    *n.entry(by).or_default() += 1;
                }
            }
            n
        });
        let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
        assert_eq!(code, 0, "{err}");
        let st = wait_phase(&s, "aborted", Duration::from_secs(20));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let served = d.join().expect("driver");
        assert!(served.contains_key("v2"), "{served:?}");
        let id = st["id"].as_str().expect("id").to_owned();
        let last = st["verdicts"]
            .as_array()
            .expect("verdicts")
            .last()
            .expect("verdict")
            .clone();
        assert_eq!(
            (last["decision"].as_str(), last["weight"].as_u64()),
            (Some("abort"), Some(25)),
            "{st:#}"
        );
        let failed: Vec<&str> = last["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .filter(|c| c["outcome"] == "fail")
            .filter_map(|c| c["check"].as_str())
            .collect();
        // (Latency on a loaded test machine may fail too.)
        assert!(failed.contains(&"output_mean"), "{st:#}");
        audit_until(&s, &id, "rollout_rollback");
        let h = alias_history(&s, "canary");
        let ev = h.last().expect("event");
        assert_eq!(ev["new_version"], serde_json::Value::Null, "{ev}");
        let reason = ev["reason"].as_str().expect("reason");
        assert!(
            reason.starts_with(&format!("rollout {id}: aborted at 25% (interval "))
                && reason.contains("output_mean fail: canary 2."),
            "{reason}"
        );
    });
}

#[test]
fn a_rollout_whose_state_cannot_be_recorded_does_not_start() {
    let mut s = rollout_setup(&[], "steps = [25, 100]\ninterval_s = 1");
    // A state file in a directory that does not exist: nothing to read at
    // start, nothing can be written.
    let text = std::fs::read_to_string(&s.cfg).expect("read");
    std::fs::write(
        &s.cfg,
        text.replace(
            "write_key_file = \"rollouts.key\"\n",
            "write_key_file = \"rollouts.key\"\nrollout_state_file = \"missing/rollouts.json\"\n",
        ),
    )
    .expect("write");
    kill_and_restart(&mut s);
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!(
            "cannot write the rollout state file {}: the rollout was not started",
            s.t.path().join("missing/rollouts.json").display()
        )) && err.contains("HTTP 500"),
        "{err}"
    );
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["status", "chat"]);
    assert_ne!(code, 0);
    assert!(err.contains("model \"chat\" has no rollout"), "{err}");
    let served: Vec<String> = (0..20).map(|_| served_by(&s.gw, &s.key)).collect();
    assert!(served.iter().all(|b| b == "v1"), "{served:?}");
    let log = std::fs::read_to_string(s.t.path().join("audit.jsonl")).unwrap_or_default();
    assert!(!log.contains("rollout_start"), "{log}");
}

/// Waits until the state file says no alias change is owed.
fn until_answered(s: &RolloutSetup, within: Duration) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let f = state_file(s);
        if f["rollouts"][0]["registry_pending"] == false {
            return f;
        }
        assert!(t0.elapsed() < within, "still owed after {within:?}: {f:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The canary alias's version in the registry (`None`: no such alias).
fn canary_version(s: &RolloutSetup) -> Option<u64> {
    alias_history(s, "canary")
        .last()
        .and_then(|e| e["new_version"].as_u64())
}

#[test]
fn an_abort_the_registry_did_not_answer_is_sent_again_in_process_and_after_a_restart() {
    let mut s = rollout_setup(&[], "steps = [10, 100]\ninterval_s = 60");
    let listen = s.url.trim_start_matches("http://").to_owned();
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");

    // The registry goes down, then an operator aborts: the canary gets no
    // traffic, the alias change fails (exit 3) and stays owed.
    let _ = s._reg.0.kill();
    let _ = s._reg.0.wait();
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["abort", "chat"]);
    assert_eq!(code, 3, "{out}\n{err}");
    assert!(
        out.contains("alias change FAILED, sent again until the registry answers"),
        "{out}"
    );
    assert!(err.contains("sends it again"), "{err}");
    let f = state_file(&s);
    assert_eq!(f["rollouts"][0]["registry_pending"], true, "{f:#}");
    assert_eq!(f["rollouts"][0]["phase"], "aborted", "{f:#}");
    let id = f["rollouts"][0]["id"].as_str().expect("id").to_owned();
    // A new rollout waits for the owed change.
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_ne!(code, 0);
    assert!(err.contains("has not yet made its alias change"), "{err}");

    // The gateway stops before the registry is back; the registry, then
    // the gateway, start again: the restarted gateway makes the change.
    s.gw.signal("KILL");
    s.gw.wait();
    let (reg, _) = registry_at(&s.db, &listen);
    s._reg = reg;
    assert_eq!(canary_version(&s), Some(2));
    s.gw = GatewayProcess::start(&keel(), &s.cfg);
    until_answered(&s, Duration::from_secs(10));
    assert_eq!(canary_version(&s), None);
    let ev = alias_history(&s, "canary").last().cloned().expect("event");
    assert!(
        ev["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with(&format!("rollout {id}: "))),
        "{ev}"
    );
    let st = rollout_status(&s.gw, s.t.path());
    assert_eq!(st["registry"]["ok"], true, "{st:#}");

    // In process: the registry down during an abort, back a moment later;
    // the gateway sends the change again on its own.
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    let _ = s._reg.0.kill();
    let _ = s._reg.0.wait();
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["abort", "chat"]);
    assert_eq!(code, 3, "{err}");
    std::thread::sleep(Duration::from_millis(1500));
    let (reg, _) = registry_at(&s.db, &listen);
    s._reg = reg;
    until_answered(&s, Duration::from_secs(15));
    assert_eq!(canary_version(&s), None);
    let st = rollout_status(&s.gw, s.t.path());
    assert_eq!(
        (
            st["registry"]["ok"].as_bool(),
            st["registry"]["pending"].as_bool()
        ),
        (Some(true), Some(false)),
        "{st:#}"
    );

    // A refusal is the registry's answer: recorded, not sent again (exit 2).
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    ok(model(&s.db, &["keys", "revoke", "rollouts"]));
    let (code, out, err) = rollout_cli(&s.gw, s.t.path(), &["abort", "chat"]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(
        err.contains("the registry refused the alias change"),
        "{err}"
    );
    let f = state_file(&s);
    assert_eq!(f["rollouts"][0]["registry_pending"], false, "{f:#}");
    assert_eq!(f["rollouts"][0]["registry"]["ok"], false, "{f:#}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(canary_version(&s), Some(2));
}

#[test]
fn a_second_gateway_on_the_same_rollout_state_file_does_not_start() {
    let s = rollout_setup(&[], "steps = [10, 100]\ninterval_s = 60");
    let (code, err) = start_fails(&s.cfg);
    let file = s.t.path().join("rollouts.json");
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains(&format!(
            "another process holds the rollout state file {}",
            file.display()
        )),
        "{err}"
    );
    // The first gateway still keeps its rollouts.
    canary_set(&s);
    let (code, _, err) = rollout_cli(&s.gw, s.t.path(), &["start", "chat"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(state_file(&s)["rollouts"][0]["phase"], "progressing");
}
