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
    assert!(r.text().contains("keel_gpu_devices 8\n"));
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
        // Busy: the GPU the mapping directory's file "3" names, Slurm's id
        // 3, its device minor (NVML's GPU 0 on this machine).
        g["utilization_gpu_percent"] = if g["minor_number"] == 3 { 80 } else { 0 }.into();
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

fn cost_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/cost")
        .join(name)
}

/// `keel cost` over the recorded accounting, for the period of the
/// recorded rows.
fn cost_report(extra: &[&str], token: &str) -> (i32, String, String) {
    let out = keel()
        .args(["cost", "--prices"])
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(cost_fixture("sacct.txt"))
        .args(["--since", "2026-09-01", "--until", "2026-10-01"])
        .args(extra)
        .env("KEEL_EXPORTER_TOKEN", token)
        .output()
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The main `keel cost` report with the idle GPU-hours of a real exporter:
/// two idle GPUs of job 1001 (alice's, partition gpu in the accounting),
/// a busy one of job 1002, an idle one of job 777 that the period's
/// accounting does not have. Without a source, or with one that cannot be
/// reached, the idle GPU-hours are unknown, never 0.
#[test]
fn cost_report_adds_the_exporters_idle_gpu_hours_priced_by_the_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut snap: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("nd96asr_v4/gpu.json")).expect("read"),
    )
    .expect("json");
    for g in snap["gpus"].as_array_mut().expect("gpus") {
        // Busy: the GPU the mapping directory's file "3" names, Slurm's id
        // 3, its device minor (NVML's GPU 0 on this machine).
        g["utilization_gpu_percent"] = if g["minor_number"] == 3 { 80 } else { 0 }.into();
    }
    let snap_file = dir.path().join("gpu.json");
    std::fs::write(&snap_file, snap.to_string()).expect("write");
    let map = dir.path().join("map");
    std::fs::create_dir(&map).expect("mkdir");
    for (gpu, job) in [("0", "1001"), ("1", "1001"), ("3", "1002"), ("4", "777")] {
        std::fs::write(map.join(gpu), format!("{job}\n")).expect("write");
    }
    let token = "t0ken";
    let sha = "b46c09677343261f0b439a472422225e3a230c9c094d6ab16762e2036b597053";
    let (_p, addr) = start_with(
        &snap_file,
        &[
            "--token-sha256",
            sha,
            "--job-mapping-dir",
            map.to_str().expect("utf-8"),
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

    let (code, out, err) = cost_report(&["--json", "--exporter", &url], token);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let r = &v["report"];
    assert!(r["idle_unknown"].is_null(), "{r}");
    let idle = &r["idle"];
    assert_eq!(
        idle["source"],
        format!("exporter {url}, since it started"),
        "{idle}"
    );
    let job = |id: &str| {
        idle["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .find(|j| j["job_id"] == id)
            .unwrap_or_else(|| panic!("job {id} in {idle}"))
            .clone()
    };
    let j1001 = job("1001");
    let hours = j1001["idle_gpu_hours"].as_f64().expect("hours");
    // Two GPUs idle between the two scrapes (1.2 s and more).
    assert!(
        hours > 2.0 * 1.1 / 3600.0 && hours < 2.0 * 30.0 / 3600.0,
        "{hours}"
    );
    // User and partition from the accounting row of the same job; priced
    // at the gpu partition's on-demand 98.32 / 8 a GPU-hour.
    assert_eq!(
        (&j1001["user"], &j1001["partition"], &j1001["in_accounting"]),
        (&"alice".into(), &"gpu".into(), &true.into())
    );
    let cost = j1001["cost"].as_f64().expect("priced");
    assert!((cost - hours * 98.32 / 8.0).abs() < 1e-9, "{cost} {hours}");
    assert_eq!(job("1002")["idle_gpu_hours"], 0.0);
    let j777 = job("777");
    assert_eq!(j777["in_accounting"], false);
    assert!(
        j777["cost"].is_null(),
        "no partition, no price: unknown, not 0: {j777}"
    );
    assert!(j777["idle_gpu_hours"].as_f64().expect("hours") > 1.0 / 3600.0);
    let total = idle["total"]["idle_gpu_hours"].as_f64().expect("total");
    assert!((total - hours - j777["idle_gpu_hours"].as_f64().expect("h")).abs() < 1e-9);
    assert!((idle["total"]["cost"].as_f64().expect("cost") - cost).abs() < 1e-9);
    let users: Vec<&str> = idle["by_user"]
        .as_array()
        .expect("by_user")
        .iter()
        .map(|g| g["key"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(users, vec!["alice", "-", "bob"]);

    let (code, out, err) = cost_report(&["--format", "csv", "--exporter", &url], token);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].ends_with(",spot_saving,idle_gpu_hours,idle_cost,currency"));
    let row1001 = lines.iter().find(|l| l.starts_with("1001,")).expect("1001");
    let cells: Vec<&str> = row1001.split(',').collect();
    let column = |name: &str| {
        lines[0]
            .split(',')
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no column {name}: {}", lines[0]))
    };
    assert_eq!(
        cells[column("idle_gpu_hours")],
        format!("{hours:.4}"),
        "{row1001}"
    );
    assert_eq!(
        cells[column("idle_cost")],
        format!("{cost:.4}"),
        "{row1001}"
    );
    let row1004 = lines.iter().find(|l| l.starts_with("1004,")).expect("1004");
    assert!(
        row1004.ends_with(",,,USD"),
        "not seen by the exporter: unknown, not 0: {row1004}"
    );
    assert!(lines.iter().any(|l| l.starts_with("777,,,,,")), "{out}");

    let (code, out, err) = cost_report(&["--exporter", &url], token);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("\nidle: ")
            && out.contains(&format!("(from exporter {url}, since it started)")),
        "{out}"
    );

    // The source from the config file's [cost], its token from a file.
    let config = dir.path().join("keel.toml");
    let token_file = dir.path().join("exporter.token");
    std::fs::write(&token_file, format!("{token}\n")).expect("write");
    std::fs::write(
        &config,
        format!(
            "[cost]\nexporter = \"{url}\"\nexporter_token_file = \"{}\"\n",
            token_file.display()
        ),
    )
    .expect("write");
    let out = keel()
        .env("KEEL_CONFIG", &config)
        .args(["--json", "cost", "--prices"])
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(cost_fixture("sacct.txt"))
        .output()
        .expect("runs");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(v["report"]["idle"]["total"]["idle_gpu_hours"]
        .as_f64()
        .is_some_and(|h| h > 0.0));

    // No source: unknown, and said why.
    let (code, out, err) = cost_report(&["--json"], token);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v["report"]["idle"].is_null());
    assert_eq!(
        v["report"]["idle_unknown"],
        "no exporter or Prometheus source given"
    );
    let (_, out, _) = cost_report(&[], token);
    assert!(
        out.contains("idle GPU-hours: unknown (no exporter or Prometheus source given)"),
        "{out}"
    );

    // A source that cannot be read: a warning, the report without idle
    // GPU-hours, exit 0.
    drop(_p);
    for (extra, why) in [
        (vec!["--json", "--exporter", url.as_str()], "cannot reach"),
        (
            vec!["--json", "--exporter", "http://127.0.0.1:1"],
            "cannot reach",
        ),
    ] {
        let (code, out, err) = cost_report(&extra, token);
        assert_eq!(code, 0, "{err}");
        assert!(
            err.contains("warning: idle GPU-hours unknown") && err.contains(why),
            "{err}"
        );
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert!(v["report"]["idle"].is_null());
        assert!(v["report"]["idle_unknown"]
            .as_str()
            .is_some_and(|s| s.contains(why)));
        assert!(v["report"]["total"]["gpu_hours"].as_f64().expect("hours") > 0.0);
    }
    // A wrong token is a source that cannot be read too.
    let (_p2, addr2) = start_with(&snap_file, &["--token-sha256", sha]);
    let (code, _, err) = cost_report(
        &["--json", "--exporter", &format!("http://{addr2}")],
        "wrong",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("401"), "{err}");
    // A URL that is not http:// is a usage error.
    let (code, out, err) = cost_report(&["--exporter", "https://x"], token);
    assert_eq!(code, 64, "{err}");
    assert!(out.is_empty() && err.contains("--exporter"), "{err}");
}

fn utc(offset: &str) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", offset, "+%Y-%m-%dT%H:%M:%S"])
        .output()
        .expect("date");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A source without keel's job series (Prometheus over a period before any
/// exporter was scraped; Prometheus's own /metrics read as an exporter's)
/// leaves the idle GPU-hours unknown, not 0.
#[test]
fn cost_idle_is_unknown_where_the_source_has_no_keel_series() {
    let base = std::env::var("KEEL_TEST_PROMETHEUS_URL").unwrap_or_else(|_| {
        panic!("KEEL_TEST_PROMETHEUS_URL is not set: run `eval \"$(scripts/services/prometheus start)\"` first")
    });
    for source in ["--prometheus", "--exporter"] {
        let out = keel()
            .args(["--json", "cost", "--prices"])
            .arg(cost_fixture("prices.toml"))
            .arg("--sacct-file")
            .arg(cost_fixture("sacct.txt"))
            .args([
                "--since",
                "2020-01-01",
                "--until",
                "2020-01-02",
                source,
                &base,
            ])
            .output()
            .expect("runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert!(v["report"]["idle"].is_null(), "{source}: {v}");
        assert!(
            v["report"]["idle_unknown"]
                .as_str()
                .is_some_and(|s| s.contains("no keel series at")),
            "{source}: {v}"
        );
        assert!(
            err.contains("warning: idle GPU-hours unknown: no keel series at"),
            "{err}"
        );
    }
}

/// The main `keel cost` report with idle GPU-hours from the real Prometheus
/// of the tests (scripts/services/prometheus), scraping a real exporter:
/// the `increase` over the report's period, joined to the accounting row
/// of the job.
#[test]
fn cost_report_adds_idle_gpu_hours_from_prometheus_over_the_period() {
    let base = std::env::var("KEEL_TEST_PROMETHEUS_URL").unwrap_or_else(|_| {
        panic!("KEEL_TEST_PROMETHEUS_URL is not set: run `eval \"$(scripts/services/prometheus start)\"` first")
    });
    let targets = PathBuf::from(std::env::var("KEEL_TEST_PROMETHEUS_TARGETS").expect("targets"));
    let token = std::fs::read_to_string(
        std::env::var("KEEL_TEST_PROMETHEUS_TOKEN_FILE").expect("token file"),
    )
    .expect("token")
    .trim()
    .to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut snap: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("nd96asr_v4/gpu.json")).expect("read"),
    )
    .expect("json");
    for g in snap["gpus"].as_array_mut().expect("gpus") {
        g["utilization_gpu_percent"] = 0.into();
    }
    let snap_file = dir.path().join("gpu.json");
    std::fs::write(&snap_file, snap.to_string()).expect("write");
    // A job id of this run only: Prometheus keeps other runs' series.
    let job = format!("8{}", std::process::id());
    let map = dir.path().join("map");
    std::fs::create_dir(&map).expect("mkdir");
    for gpu in ["0", "1"] {
        std::fs::write(map.join(gpu), format!("{job}\n")).expect("write");
    }
    let sha = {
        use std::io::Write;
        let mut c = Command::new("sha256sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sha256sum");
        c.stdin
            .take()
            .expect("stdin")
            .write_all(token.as_bytes())
            .expect("write");
        let out = c.wait_with_output().expect("sha256sum");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .expect("hash")
            .to_owned()
    };
    let (_p, addr) = start_with(
        &snap_file,
        &[
            "--token-sha256",
            &sha,
            "--job-mapping-dir",
            map.to_str().expect("utf-8"),
        ],
    );
    let id = format!("cost{}-{}", std::process::id(), addr.port());
    let file = targets.join(format!("{id}.json"));
    std::fs::write(
        &file,
        format!(r#"[{{"targets":["{addr}"],"labels":{{"keel_test":"{id}"}}}}]"#),
    )
    .expect("targets");
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _target = Remove(file);

    let since = utc("-10 minutes");
    let sacct = dir.path().join("sacct.txt");
    std::fs::write(
        &sacct,
        format!("{job}|train|erin|ml|gpu|billing=96,cpu=96,gres/gpu=2,node=1|600|RUNNING|{since}|Unknown\n"),
    )
    .expect("write");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let until = utc("now");
        let out = keel()
            .args(["--json", "cost", "--prices"])
            .arg(cost_fixture("prices.toml"))
            .arg("--sacct-file")
            .arg(&sacct)
            .args(["--since", &since, "--until", &until, "--prometheus", &base])
            .output()
            .expect("runs");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let idle = &v["report"]["idle"];
        // Until Prometheus has scraped the exporter, the period holds no
        // keel series: unknown, never 0.
        if idle.is_null() {
            let why = v["report"]["idle_unknown"].as_str().unwrap_or("");
            assert!(why.starts_with("no keel series at"), "{v}");
            assert!(
                std::time::Instant::now() < deadline,
                "Prometheus had no keel series within 60 s: {v}"
            );
            std::thread::sleep(std::time::Duration::from_millis(500));
            continue;
        }
        assert!(idle.is_object(), "{v}");
        assert_eq!(
            idle["source"],
            format!("prometheus {base} over {since}..{until} UTC")
        );
        let row = idle["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .find(|j| j["job_id"] == job.as_str())
            .cloned();
        if let Some(row) = row.filter(|r| r["idle_gpu_hours"].as_f64().is_some_and(|h| h > 0.0)) {
            let hours = row["idle_gpu_hours"].as_f64().expect("hours");
            // Two GPUs idle for at most the time this test ran.
            assert!(hours < 2.0 * 70.0 / 3600.0, "{row}");
            assert_eq!(row["user"], "erin", "from the accounting row: {row}");
            assert_eq!(row["partition"], "gpu");
            assert_eq!(row["in_accounting"], true);
            let cost = row["cost"].as_f64().expect("priced");
            assert!((cost - hours * 98.32 / 8.0).abs() < 1e-9, "{row}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no idle GPU-hours for job {job} from Prometheus within 60 s: {idle}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}
