//! `keel exporter` as a process: it refuses to serve without a token or an
//! explicit opt-out, and serves the replayed fixture behind the token.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use keel_testkit::http;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn keel() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.env_remove("KEEL_CONFIG").env("HOME", "/nonexistent");
    c
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `keel exporter ARGS --listen 127.0.0.1:0` and reads its address.
fn start(args: &[&str]) -> (Running, SocketAddr) {
    let mut child = keel()
        .args(["--root"])
        .arg(fixture("nd96asr_v4"))
        .args(["exporter", "--listen", "127.0.0.1:0", "--gpu-snapshot"])
        .arg(fixture("nd96asr_v4/gpu.json"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("keel starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .strip_prefix("metrics  http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (Running(child), addr)
}

#[test]
fn exporter_refuses_to_start_without_a_token_or_no_auth() {
    let out = keel()
        .args(["exporter", "--listen", "127.0.0.1:0"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--token-sha256") && err.contains("--no-auth"),
        "{err}"
    );
    let out = keel()
        .args([
            "exporter",
            "--token-sha256",
            "xyz",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(64));
    assert!(!String::from_utf8_lossy(&out.stderr).is_empty());
}

#[test]
fn exporter_serves_the_replayed_gpus_behind_the_token() {
    let token = "t0ken";
    let sha = "b46c09677343261f0b439a472422225e3a230c9c094d6ab16762e2036b597053";
    // The hash is of `token` (printf %s t0ken | sha256sum).
    let (_p, addr) = start(&["--token-sha256", sha]);
    let r = http::get(addr, "/metrics", token).expect("scrape");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("keel_gpu_count 8\n"));
    assert!(r
        .text()
        .contains("keel_hca_port_active{hca=\"mlx5_ib0\",port=\"1\"} 1\n"));
    assert_eq!(
        http::get(addr, "/metrics", "other").expect("scrape").status,
        401
    );

    let (_p, addr) = start(&["--no-auth", "--dcgm-names"]);
    let r = http::request(addr, "GET", "/metrics", &[], b"").expect("scrape");
    assert_eq!(r.status, 200);
}
