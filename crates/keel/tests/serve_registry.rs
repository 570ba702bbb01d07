//! `keel serve` following the registry served by `keel model serve`: two
//! test backends serve versions 1 and 2 of `chat` (their `keel.backend`
//! tags); `keel model alias set` and `keel model rollback` reach the
//! gateway within 2 s; a reload keeps the registry's routing; with the
//! registry down the gateway keeps its last routing; a missing registry model, a version with no backend and a
//! revoked key stop `keel serve` at start with an error.

mod serve_common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serve_common::{chat_body, create_key, http, keel, sha256, GatewayProcess, TestBackend};
use serve_common::{ADMIN_TOKEN, METRICS_TOKEN};

fn model(db: &Path, args: &[&str]) -> Output {
    Command::new(keel())
        .args(["model", "--db"])
        .arg(db)
        .args(args)
        .env("KEEL_ACTOR", "ops")
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel model")
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `keel model serve`, killed when dropped.
struct Registry(std::process::Child);

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn registry(db: &Path) -> (Registry, String) {
    let mut child = Command::new(keel())
        .args(["model", "--db"])
        .arg(db)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_remove("KEEL_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("keel model serve");
    let stdout = child.stdout.take().expect("stdout");
    let server = Registry(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let url = line.trim().rsplit(' ').next().expect("url").to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    (server, url)
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
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace_s = 10
[admin]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[metrics]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[auth]
keys_file = "keys.json"
[roles.user]
models = ["chat"]
operations = ["chat", "models"]
[registry]
url = "{registry_url}"
key_file = "registry.key"
{registry_extra}
[[models]]
name = "chat"
registry = {{ model = "{registry_model}", stable = "production", canary = "canary"{model_extra} }}
"#,
        sha256(ADMIN_TOKEN),
        sha256(METRICS_TOKEN)
    );
    let p = dir.join("gateway.toml");
    std::fs::write(&p, text).expect("write config");
    p
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
}
