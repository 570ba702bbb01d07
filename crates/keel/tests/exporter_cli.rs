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
    start_with(&fixture("nd96asr_v4/gpu.json"), args)
}

fn start_with(snapshot: &Path, args: &[&str]) -> (Running, SocketAddr) {
    let mut child = keel()
        .args(["--root"])
        .arg(fixture("nd96asr_v4"))
        .args(["exporter", "--listen", "127.0.0.1:0", "--gpu-snapshot"])
        .arg(snapshot)
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

#[test]
fn cost_idle_reports_idle_gpu_hours_and_cancels_only_when_told() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut snap: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("nd96asr_v4/gpu.json")).expect("read"),
    )
    .expect("json");
    for g in snap["gpus"].as_array_mut().expect("gpus") {
        g["utilization_gpu_percent"] = if g["index"] == 3 { 80 } else { 0 }.into();
    }
    let snap_file = dir.path().join("gpu.json");
    std::fs::write(&snap_file, snap.to_string()).expect("write");
    let map = dir.path().join("map");
    std::fs::create_dir(&map).expect("mkdir");
    std::fs::write(map.join("0"), "501\n").expect("write");
    std::fs::write(map.join("1"), "501\n").expect("write");
    std::fs::write(map.join("3"), "502\n").expect("write");
    let token = "t0ken";
    let sha = "b46c09677343261f0b439a472422225e3a230c9c094d6ab16762e2036b597053";
    let (_p, addr) = start_with(
        &snap_file,
        &[
            "--token-sha256",
            sha,
            "--job-mapping-dir",
            map.to_str().expect("utf-8"),
            "--idle-minutes",
            "0.01",
        ],
    );
    assert_eq!(
        http::get(addr, "/metrics", token)
            .expect("first scrape")
            .status,
        200
    );
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let url = format!("http://{addr}");
    let out = keel()
        .args(["--json", "cost", "idle", "--exporter", &url, "--cancel"])
        .env("KEEL_EXPORTER_TOKEN", token)
        .output()
        .expect("runs");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["command"], "cost idle");
    assert_eq!(v["jobs"][0]["job"], "501");
    assert_eq!(v["jobs"][0]["idle_now"], true);
    let idle = v["jobs"][0]["idle_gpu_hours"].as_f64().expect("hours");
    // Two GPUs idle for the time between the two scrapes (1.2 s and more).
    assert!(
        idle > 2.0 * 1.1 / 3600.0 && idle < 2.0 * 30.0 / 3600.0,
        "{idle}"
    );
    assert_eq!(v["jobs"][1]["job"], "502");
    assert_eq!(v["jobs"][1]["idle_gpu_hours"], 0.0);
    assert_eq!(
        v["cancel"],
        serde_json::json!([{"job": "501", "result": "dry-run"}])
    );

    let out = keel()
        .args(["cost", "idle", "--exporter", &url])
        .env("KEEL_EXPORTER_TOKEN", token)
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("JOB") && text.contains("501") && !text.contains("would run"),
        "{text}"
    );

    let out = keel()
        .args(["cost", "idle", "--exporter", &url])
        .env("KEEL_EXPORTER_TOKEN", "wrong")
        .output()
        .expect("runs");
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
    let out = keel()
        .args(["cost", "idle", "--exporter", "https://x"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(64));
    let out = keel()
        .args(["cost", "idle", "--prometheus", &url, "--range", "1 day"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(64));
}

/// The real NVML probe on a machine without the driver (a missing library
/// stands for it where one is installed): host metrics, no GPU series.
#[test]
fn exporter_without_a_gpu_driver_serves_host_metrics() {
    let mut child = keel()
        .args([
            "exporter",
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("keel starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let _p = Running(child);
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("metrics  http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    for _ in 0..2 {
        let r = http::request(addr, "GET", "/metrics", &[], b"").expect("scrape");
        assert_eq!(r.status, 200);
        let t = r.text();
        assert!(t.contains("keel_exporter_gpu_up 0\n"), "{t}");
        assert!(
            t.contains("keel_exporter_gpu_probe_error{reason=\"unavailable\"} 1\n"),
            "{t}"
        );
        assert!(!t.contains("keel_gpu_"), "{t}");
        std::thread::sleep(std::time::Duration::from_millis(600));
    }
}
