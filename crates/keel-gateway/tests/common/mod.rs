//! An in-process gateway on its own runtime, test backends as processes,
//! and the blocking client from keel-testkit.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_gateway::keys::{sha256_hex, KeyFile, NewKey};
use keel_gateway::{Clock, Gateway, GatewayConfig, GatewayOptions, Listeners, ManualClock};
pub use keel_testkit::http::{self, HttpResponse};
pub use keel_testkit::serve::TestBackend;
use serde_json::{json, Value};

pub const ADMIN_TOKEN: &str = "admin-token-for-tests";
pub const METRICS_TOKEN: &str = "metrics-token-for-tests";

pub struct Running {
    pub rt: tokio::runtime::Runtime,
    pub gw: Gateway,
    pub public: SocketAddr,
    pub admin: SocketAddr,
    pub metrics: SocketAddr,
    pub dir: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

/// The config's common head: listeners on free ports, keys file and audit
/// log in `dir`, roles `user` (models chat, small; chat and models) and
/// `ops` (everything).
pub fn head(dir: &Path) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
header_timeout_ms = 500
body_timeout_ms = 500
shutdown_grace_s = 5
[admin]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[metrics]
listen = "127.0.0.1:0"
token_sha256 = "{}"
[auth]
keys_file = "{}/keys.json"
[audit]
path = "{}/audit.jsonl"
[roles.user]
models = ["chat", "small"]
operations = ["chat", "models"]
[roles.ops]
models = ["*"]
operations = ["*"]
[traffic]
retries = 2
[traffic.health]
interval_ms = 100
"#,
        sha256_hex(ADMIN_TOKEN.as_bytes()),
        sha256_hex(METRICS_TOKEN.as_bytes()),
        dir.display(),
        dir.display()
    )
}

/// A model section with deployments `(name, url, weight)`.
pub fn model(name: &str, extra: &str, deployments: &[(&str, String, u32)]) -> String {
    let mut s = format!("\n[[models]]\nname = \"{name}\"\n{extra}\n");
    for (d, url, w) in deployments {
        s.push_str(&format!("[[models.deployments]]\nname = \"{d}\"\nurl = \"{url}\"\nweight = {w}\nmodel = \"backend-{d}\"\n"));
    }
    s
}

/// Adds a key to `dir/keys.json` and returns (id, secret).
pub fn add_key(dir: &Path, name: &str, roles: &[&str], team: Option<&str>) -> (String, String) {
    let path = dir.join("keys.json");
    let mut f = KeyFile::load(&path).expect("key file");
    // Deterministic per name (tests only): the SHA-256 of the name.
    let digest = sha256_hex(name.as_bytes());
    let mut rnd = [0u8; 32];
    for (i, b) in rnd.iter_mut().enumerate() {
        *b = u8::from_str_radix(&digest[2 * i..2 * i + 2], 16).expect("hex");
    }
    let (rec, secret) = f.create(
        NewKey {
            name: name.into(),
            roles: roles.iter().map(|r| r.to_string()).collect(),
            team: team.map(str::to_owned),
        },
        rnd,
        1,
    );
    f.store(&path).expect("store keys");
    (rec.id, secret)
}

pub fn revoke(dir: &Path, id: &str) {
    let path = dir.join("keys.json");
    let mut f = KeyFile::load(&path).expect("key file");
    f.revoke(id, 2).expect("revoke");
    f.store(&path).expect("store keys");
}

impl Running {
    pub fn start(dir: &Path, config: &str) -> Self {
        Self::start_with_clock(dir, config, Arc::new(ManualClock::new(1_767_225_600_000)))
    }

    pub fn start_with_clock(dir: &Path, config: &str, clock: Arc<dyn Clock>) -> Self {
        let cfg_path = dir.join("gateway.toml");
        std::fs::write(&cfg_path, config).expect("write config");
        if !dir.join("keys.json").exists() {
            KeyFile {
                version: 1,
                keys: vec![],
            }
            .store(&dir.join("keys.json"))
            .expect("keys");
        }
        let cfg = GatewayConfig::load(&cfg_path).expect("valid config");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let reload_path = cfg_path.clone();
        let (gw, listeners, addrs) = rt.block_on(async {
            let bind = || async {
                tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind")
            };
            let (p, a, m) = (bind().await, bind().await, bind().await);
            let addrs = (
                p.local_addr().expect("addr"),
                a.local_addr().expect("addr"),
                m.local_addr().expect("addr"),
            );
            let gw = Gateway::new(
                cfg,
                GatewayOptions {
                    clock,
                    seed: 7,
                    reload: Some(Arc::new(move || Ok(GatewayConfig::load(&reload_path)?))),
                    access_sink: None,
                    machine: None,
                },
            )
            .await
            .expect("gateway starts");
            (
                gw,
                Listeners {
                    public: p,
                    admin: Some(a),
                    metrics: Some(m),
                },
                addrs,
            )
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let done = rt.spawn(keel_gateway::run(gw.clone(), listeners, async move {
            let _ = rx.await;
        }));
        Self {
            rt,
            gw,
            public: addrs.0,
            admin: addrs.1,
            metrics: addrs.2,
            dir: dir.to_owned(),
            stop: Some(tx),
            done: Some(done),
        }
    }

    pub fn chat(&self, key: &str, body: Value) -> HttpResponse {
        http::post_json(self.public, "/v1/chat/completions", key, &body).expect("request")
    }

    pub fn chat_with(&self, key: &str, body: Value, headers: &[(&str, &str)]) -> HttpResponse {
        let auth = format!("Bearer {key}");
        let mut h = vec![
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ];
        h.extend_from_slice(headers);
        http::request(
            self.public,
            "POST",
            "/v1/chat/completions",
            &h,
            body.to_string().as_bytes(),
        )
        .expect("request")
    }

    pub fn usage(&self, scope: &str) -> Value {
        let r =
            http::get(self.admin, &format!("/admin/usage/{scope}"), ADMIN_TOKEN).expect("usage");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"].clone()
    }

    pub fn metrics_text(&self) -> String {
        let r = http::get(self.metrics, "/metrics", METRICS_TOKEN).expect("metrics");
        assert_eq!(r.status, 200);
        r.text()
    }

    /// Stops the gateway (graceful) and returns the audit log's lines.
    pub fn stop(mut self) -> Vec<Value> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(d) = self.done.take() {
            self.rt.block_on(d).expect("join").expect("run");
        }
        let text = std::fs::read_to_string(self.dir.join("audit.jsonl")).unwrap_or_default();
        let report = keel_gateway::audit::verify(text.as_bytes()).expect("audit chain intact");
        assert_eq!(report.entries as usize, text.lines().count());
        text.lines()
            .map(|l| serde_json::from_str(l).expect("audit JSON"))
            .collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

pub fn chat_body(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "12345678"}], "max_tokens": 8})
}
