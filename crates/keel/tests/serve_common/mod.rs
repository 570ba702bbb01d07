//! Shared by the `keel serve` test binaries: a gateway config around test
//! backends, keys made with the real CLI, `keel serve` as a process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub use keel_testkit::http;
pub use keel_testkit::serve::{GatewayProcess, TestBackend};
use serde_json::{json, Value};

pub const ADMIN_TOKEN: &str = "admin-token-for-cli-tests";
pub const METRICS_TOKEN: &str = "metrics-token-for-cli-tests";

pub fn keel() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keel"))
}

pub fn sha256(s: &str) -> String {
    keel_gateway::keys::sha256_hex(s.as_bytes())
}

/// A config with one model `chat` on `backend`, plus `extra` TOML.
pub fn config(dir: &Path, backend: &str, extra: &str) -> PathBuf {
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
[audit]
path = "audit.jsonl"
[roles.user]
models = ["chat"]
operations = ["chat", "models"]
{extra}
[[models]]
name = "chat"
[[models.deployments]]
name = "blue"
url = "{backend}"
"#,
        sha256(ADMIN_TOKEN),
        sha256(METRICS_TOKEN)
    );
    let p = dir.join("gateway.toml");
    std::fs::write(&p, text).expect("write config");
    p
}

/// The config of the registry-following tests (serve_registry.rs): model
/// `chat` follows `registry_model`'s production and canary aliases, with
/// more `[registry]` keys and more keys in the model's `registry` table
/// (`, key = value`).
pub fn registry_config(
    dir: &Path,
    registry_url: &str,
    registry_model: &str,
    registry_extra: &str,
    model_extra: &str,
) -> PathBuf {
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
operations = ["chat", "models", "infer"]
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

/// Sets `server.workers` in a config file [`config`] wrote (1 serves on
/// a single-threaded runtime, more on a multi-threaded one).
pub fn set_workers(cfg: &Path, workers: usize) {
    let text = std::fs::read_to_string(cfg).expect("read config");
    let text = text.replacen("[server]\n", &format!("[server]\nworkers = {workers}\n"), 1);
    std::fs::write(cfg, text).expect("write config");
}

/// Runs `keel ARGS` and returns (exit code, stdout).
pub fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(keel())
        .args(args)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Creates a key with the CLI; returns (id, secret).
pub fn create_key(cfg: &Path, name: &str, role: &str, team: Option<&str>) -> (String, String) {
    let c = cfg.to_str().expect("utf8");
    let mut args = vec![
        "--json", "serve", "keys", "create", "--config", c, "--name", name, "--role", role,
    ];
    if let Some(t) = team {
        args.extend(["--team", t]);
    }
    let out = Command::new(keel())
        .args(&args)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel");
    assert!(
        out.status.success(),
        "keel serve keys create: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    (
        v["id"].as_str().expect("id").to_owned(),
        v["secret"].as_str().expect("secret").to_owned(),
    )
}

pub fn chat_body() -> Value {
    json!({"model": "chat", "messages": [{"role": "user", "content": "12345678"}], "max_tokens": 8})
}

/// `keel model --db DB ARGS...` as the operator `ops`.
pub fn model(db: &Path, args: &[&str]) -> Output {
    Command::new(keel())
        .args(["model", "--db"])
        .arg(db)
        .args(args)
        .env("KEEL_ACTOR", "ops")
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel model")
}

/// Its stdout, after asserting it succeeded.
pub fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `keel model serve`, killed when dropped.
pub struct Registry(pub std::process::Child);

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `keel model serve` for `db` on `listen` (`127.0.0.1:0`: a free port),
/// and its URL.
pub fn registry_at(db: &Path, listen: &str) -> (Registry, String) {
    let mut child = Command::new(keel())
        .args(["model", "--db"])
        .arg(db)
        .args(["serve", "--listen", listen])
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
