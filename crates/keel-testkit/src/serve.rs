//! Services for the gateway tests: Redis and the Python `openai` client
//! from the environment, the test model backend and `keel serve` as
//! processes that are killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use crate::http;
use crate::tls::{TestPki, TlsClient};

/// The variable naming the test Redis (`redis://127.0.0.1:PORT`).
pub const REDIS_VAR: &str = "KEEL_TEST_REDIS_URL";
/// The variable naming a Python that has the `openai` package.
pub const PYTHON_VAR: &str = "KEEL_TEST_PYTHON";

/// The test Redis URL, or a panic saying how to start one.
pub fn redis_url() -> String {
    match std::env::var(REDIS_VAR) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "no test Redis: {REDIS_VAR} is not set; run `eval \"$(scripts/services/redis start)\"` \
             first, or run everything with scripts/test"
        ),
    }
}

/// The Python with `openai`, or a panic saying how to install it.
pub fn python() -> PathBuf {
    match std::env::var_os(PYTHON_VAR) {
        Some(v) if !v.is_empty() => v.into(),
        _ => panic!(
            "no Python with openai: {PYTHON_VAR} is not set; run `eval \"$(scripts/services/python-openai)\"` \
             first, or run everything with scripts/test"
        ),
    }
}

/// The variable naming the running real llama.cpp server
/// (`scripts/services/llama-server start`).
pub const LLAMA_VAR: &str = "KEEL_TEST_LLAMA_SERVER_URL";
/// The variable naming the running MLServer (`scripts/services/oip-server
/// start`).
pub const OIP_VAR: &str = "KEEL_TEST_OIP_URL";

fn service_var(var: &str, script: &str) -> String {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{var} is not set; run `eval \"$(scripts/services/{script} start)\"` first, \
             or run everything with scripts/test"
        ),
    }
}

/// The real llama.cpp server's URL (`http://127.0.0.1:PORT`), or a panic
/// saying how to start it.
pub fn llama_server_url() -> String {
    service_var(LLAMA_VAR, "llama-server")
}

/// The llama.cpp build the server reports (`KEEL_TEST_LLAMA_VERSION`).
pub fn llama_server_version() -> String {
    std::env::var("KEEL_TEST_LLAMA_VERSION").unwrap_or_default()
}

/// The real OIP v2 server's URL (MLServer) and the model it serves, or a
/// panic saying how to start it.
pub fn oip_server() -> (String, String) {
    let url = service_var(OIP_VAR, "oip-server");
    let model = std::env::var("KEEL_TEST_OIP_MODEL").unwrap_or_else(|_| "iris".into());
    (url, model)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `keel-testbackend` binary beside the running test's target
/// directory, built if it is not there or is older than its sources (a
/// test run of other packages does not rebuild it).
pub fn testbackend_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("KEEL_TESTBACKEND") {
            return p.into();
        }
        let exe = std::env::current_exe().expect("current exe");
        // target/debug/deps/test-hash -> target/debug/keel-testbackend
        let dir = exe.parent().and_then(Path::parent).expect("target dir");
        let bin = dir.join("keel-testbackend");
        let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let src = workspace_root().join("crates/keel-testbackend");
        let newest_source = std::fs::read_dir(src.join("src"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .chain([src.join("Cargo.toml")])
            .filter_map(|p| mtime(&p))
            .max();
        let stale = match (mtime(&bin), newest_source) {
            (None, _) => true,
            (Some(b), Some(s)) => b < s,
            (Some(_), None) => false,
        };
        if stale {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let ok = Command::new(cargo)
                .args(["build", "-q", "-p", "keel-testbackend"])
                .current_dir(workspace_root())
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok && bin.exists(),
                "cannot build keel-testbackend into {}",
                bin.display()
            );
        }
        bin
    })
    .clone()
}

/// Reads the child's stdout until a line starting with `prefix`.
fn wait_line(child: &mut Child, prefix: &str) -> Vec<String> {
    let out = child.stdout.take().expect("stdout piped");
    let mut r = BufReader::new(out);
    let mut lines = Vec::new();
    loop {
        let mut l = String::new();
        let n = r.read_line(&mut l).expect("read child stdout");
        assert!(
            n > 0,
            "the process exited before printing {prefix:?}; it printed {lines:?}"
        );
        let l = l.trim_end().to_owned();
        let done = l.starts_with(prefix);
        lines.push(l);
        if done {
            return lines;
        }
    }
}

/// A running test model backend; killed on drop.
#[derive(Debug)]
pub struct TestBackend {
    child: Child,
    pub addr: SocketAddr,
    /// How the test talks to it when it serves HTTPS.
    tls: Option<TlsClient>,
}

/// How a test backend serves HTTPS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendTls {
    /// With the PKI's server certificate.
    Server,
    /// And it requires a client certificate from the PKI's CA.
    Mutual,
}

impl TestBackend {
    /// Starts `keel-testbackend ARGS` on a free port.
    pub fn start(args: &[&str]) -> Self {
        Self::spawn(args, None)
    }

    /// Starts `keel-testbackend ARGS` serving HTTPS with `pki`'s server
    /// certificate (and requiring its client certificate for `Mutual`).
    pub fn start_tls(args: &[&str], pki: &TestPki, mode: BackendTls) -> Self {
        let (cert, key, ca) = (pki.server_cert(), pki.server_key(), pki.ca());
        let mut all: Vec<&str> = args.to_vec();
        all.extend([
            "--tls-cert",
            cert.to_str().expect("utf8"),
            "--tls-key",
            key.to_str().expect("utf8"),
        ]);
        if mode == BackendTls::Mutual {
            all.extend(["--tls-client-ca", ca.to_str().expect("utf8")]);
        }
        Self::spawn(&all, Some(pki.mtls_client()))
    }

    fn spawn(args: &[&str], tls: Option<TlsClient>) -> Self {
        let mut child = Command::new(testbackend_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start keel-testbackend");
        let lines = wait_line(&mut child, "listening on ");
        let addr = lines
            .last()
            .and_then(|l| l.strip_prefix("listening on "))
            .and_then(|a| a.parse().ok())
            .expect("backend address");
        Self { child, addr, tls }
    }

    /// `http://ADDR`, or `https://ADDR` when it serves HTTPS.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// One request to the backend itself (over TLS when it serves HTTPS).
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> http::HttpResponse {
        match &self.tls {
            Some(t) => t.request(self.addr, method, path, &[], body),
            None => http::request(self.addr, method, path, &[], body),
        }
        .expect("request to the test backend")
    }

    /// `POST /_control` (mode, latency_ms, healthy, tokens, reset).
    pub fn control(&self, v: serde_json::Value) {
        let r = self.request("POST", "/_control", v.to_string().as_bytes());
        assert_eq!(r.status, 200);
    }

    /// How many requests it saw on `path` (`GET /_stats`).
    pub fn count(&self, key: &str) -> u64 {
        let r = self.request("GET", "/_stats", b"");
        r.json()["counts"][key].as_u64().unwrap_or(0)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestBackend {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running `keel serve`; killed on drop unless stopped.
#[derive(Debug)]
pub struct GatewayProcess {
    child: Child,
    pub public: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
}

impl GatewayProcess {
    /// Starts `KEEL serve --config CONFIG` and waits until it is ready.
    pub fn start(keel: &Path, config: &Path) -> Self {
        let mut child = Command::new(keel)
            .args(["serve", "--config"])
            .arg(config)
            .env_remove("KEEL_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start keel serve");
        let lines = wait_line(&mut child, "ready");
        let find = |name: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|a| a.trim().parse().ok())
        };
        Self {
            public: find("public").expect("public address"),
            admin: find("admin"),
            metrics: find("metrics"),
            child,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by number (`kill -s`).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args(["-s", sig, &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -s {sig} failed");
    }

    /// Waits for the process to exit and returns its exit code.
    pub fn wait(&mut self) -> Option<i32> {
        self.child.wait().ok().and_then(|s| s.code())
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
