//! The shipped Prometheus files against the real tools: `promtool check
//! rules` and `promtool test rules` on deploy/prometheus, a real Prometheus
//! (scripts/services/prometheus) scraping an exporter fed by a replayed
//! probe until one of the shipped alerts fires, and every query of the
//! Grafana dashboard parsed by that Prometheus.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_exporter::cost::{encode, http_get};
use keel_exporter::replay::ReplayProbe;
use keel_exporter::server::{serve, sha256_hex, Auth, ServeOptions};
use keel_exporter::{Exporter, ExporterOptions, Monotonic};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run `eval \"$(scripts/services/prometheus start)\"` first")
    })
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool: {e} (scripts/services/prometheus start installs it)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() {
    let text = promtool(&["check", "rules", "deploy/prometheus/keel-alerts.yml"]);
    assert!(text.contains("SUCCESS: 25 rules found"), "{text}");
    let text = promtool(&[
        "test",
        "rules",
        "deploy/prometheus/tests/keel-alerts.test.yml",
    ]);
    assert!(text.contains("SUCCESS"), "{text}");
}

/// A GPU probe for a machine without a driver.
struct NoDriver;

impl keel_gpu::GpuProbe for NoDriver {
    fn snapshot(&self) -> Result<keel_gpu::GpuSnapshot, keel_gpu::GpuError> {
        Err(keel_gpu::GpuError::Unavailable {
            reason: "no libnvidia-ml.so.1".into(),
        })
    }
}

/// Prometheus's own lint (`promtool check metrics`: names, units,
/// suffixes, help) on a scrape of every fixture machine, with everything
/// the exporter can add switched on (jobs, idle accounting, the expected
/// GPU count). dcgm-exporter's names (`--dcgm-names`) are its own and are
/// not linted: they break the conventions as dcgm-exporter does.
#[test]
fn promtool_lints_a_scrape_of_every_fixture() {
    let rt = rt();
    let mut linted = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo().join("tests/fixtures"))
        .expect("fixtures")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        let gpu = dir.join("gpu.json");
        let probe: Box<dyn keel_gpu::GpuProbe + Send> = if gpu.is_file() {
            Box::new(keel_gpu::recorded::RecordedProbe::new(&gpu))
        } else {
            Box::new(NoDriver)
        };
        let mut opts = ExporterOptions::new(&dir);
        opts.min_interval = Duration::ZERO;
        opts.device_file_pattern = Some("/dev/nvidia{}".into());
        let mapping = dir.join("var/lib/dcgm-exporter/job-mapping");
        opts.job_mapping_dir = mapping.is_dir().then_some(mapping);
        opts.idle = Some(keel_exporter::IdlePolicy {
            threshold_percent: 5.0,
            idle_minutes: 30.0,
        });
        opts.expected = Some(keel_exporter::readings::ExpectedGpus {
            sku: "fixture".into(),
            gpus: 8,
        });
        let exporter =
            Exporter::new(opts, probe, Arc::new(keel_exporter::SystemClock)).expect("exporter");
        // Twice: idle accounting exposes its counters from the second scrape.
        rt.block_on(exporter.scrape());
        let text = rt.block_on(exporter.scrape());
        let mut child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("promtool: {e} (scripts/services/prometheus start installs it)")
            });
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write");
        let out = child.wait_with_output().expect("promtool");
        assert!(
            out.status.success(),
            "promtool check metrics on a scrape of {}:\n{}{}",
            dir.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        linted.push(dir.file_name().map(|n| n.to_string_lossy().into_owned()));
    }
    assert!(linted.len() >= 6, "{linted:?}");
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The result vector of an instant query.
fn query(
    rt: &tokio::runtime::Runtime,
    base: &str,
    q: &str,
) -> Result<Vec<serde_json::Value>, String> {
    let url = format!("{base}/api/v1/query?query={}", encode(q));
    let body = rt
        .block_on(http_get(&url, None, Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    if v["status"] != "success" {
        return Err(body);
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// The real clock, moved on by the test: the replay shows its second
/// snapshot only once Prometheus has scraped the first.
#[derive(Debug, Default)]
struct JumpClock(std::sync::Mutex<Duration>);

impl Monotonic for JumpClock {
    fn now(&self) -> Instant {
        Instant::now() + *self.0.lock().expect("lock")
    }
}

struct Target(PathBuf);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn prometheus_scrapes_the_replayed_exporter_and_an_alert_fires() {
    let base = env("KEEL_TEST_PROMETHEUS_URL");
    let targets = PathBuf::from(env("KEEL_TEST_PROMETHEUS_TARGETS"));
    let token =
        std::fs::read_to_string(env("KEEL_TEST_PROMETHEUS_TOKEN_FILE")).expect("token file");
    let fixture = repo().join("tests/fixtures/nd96isr_h100_v5");
    let healthy = keel_gpu::recorded::load(&fixture.join("gpu.json")).expect("fixture");
    let mut healthy = healthy;
    for g in &mut healthy.gpus {
        g.utilization_gpu_percent = Some(if g.index < 2 { 0 } else { 95 });
    }
    let mut failing = healthy.clone();
    failing.gpus[5].ecc.volatile_dram_uncorrected = Some(3);
    // A Slurm job holds GPUs 0 and 1 and leaves them idle.
    let job = format!("9{}", std::process::id());
    let map = tempfile::tempdir().expect("tempdir");
    std::fs::write(map.path().join("0"), format!("{job}\n")).expect("write");
    std::fs::write(map.path().join("1"), format!("{job}\n")).expect("write");

    let rt = rt();
    let clock = Arc::new(JumpClock::default());
    let probe = ReplayProbe::new(
        vec![healthy, failing],
        Duration::from_secs(3600),
        clock.clone(),
    );
    let mut opts = ExporterOptions::new(&fixture);
    opts.job_mapping_dir = Some(map.path().to_path_buf());
    opts.idle = Some(keel_exporter::IdlePolicy {
        threshold_percent: 5.0,
        idle_minutes: 0.05,
    });
    let exporter = Exporter::new(opts, Box::new(probe), clock.clone()).expect("exporter");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let o = ServeOptions {
            auth: Auth::Token {
                sha256: sha256_hex(token.trim().as_bytes()),
            },
            ..ServeOptions::default()
        };
        tokio::spawn(serve(l, exporter, o, async move {
            let _ = stopped.await;
        }));
        addr
    });
    let id = format!("t{}-{}", std::process::id(), addr.port());
    let file = targets.join(format!("{id}.json"));
    std::fs::write(
        &file,
        format!(r#"[{{"targets":["{addr}"],"labels":{{"keel_test":"{id}"}}}}]"#),
    )
    .expect("targets");
    let _target = Target(file);

    let deadline = Instant::now() + Duration::from_secs(60);
    let wait = |what: &str, q: &str, ok: &dyn Fn(&[serde_json::Value]) -> bool| loop {
        let r = query(&rt, &base, q).unwrap_or_else(|e| panic!("{q}: {e}"));
        if ok(&r) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 60 s: {q} = {r:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let r = wait(
        "a scrape",
        &format!("keel_gpu_devices{{keel_test=\"{id}\"}}"),
        &|r| !r.is_empty(),
    );
    assert_eq!(r[0]["value"][1], "8");
    let up = query(&rt, &base, &format!("up{{keel_test=\"{id}\"}}")).expect("up");
    assert_eq!(
        up[0]["value"][1], "1",
        "the scrape authenticates with the token"
    );
    let temps = query(
        &rt,
        &base,
        &format!("count(keel_gpu_temperature_celsius{{keel_test=\"{id}\"}})"),
    )
    .expect("count");
    assert_eq!(temps[0]["value"][1], "8");
    // Two healthy samples of GPU 5's counter, then the failing snapshot.
    wait(
        "two healthy samples",
        &format!(
            "count_over_time(keel_gpu_ecc_errors_total{{keel_test=\"{id}\",gpu=\"5\",type=\"uncorrected\",counter=\"volatile\",location=\"dram\"}}[1m]) >= 2"
        ),
        &|r| !r.is_empty(),
    );
    *clock.0.lock().expect("lock") += Duration::from_secs(3600);
    let r = wait(
        "the uncorrectable-ECC alert",
        &format!("ALERTS{{alertname=\"KeelGpuUncorrectableEcc\",alertstate=\"firing\",keel_test=\"{id}\"}}"),
        &|r| !r.is_empty(),
    );
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["metric"]["gpu"], "5");
    assert_eq!(r[0]["metric"]["severity"], "critical");

    // keel cost idle's queries against this Prometheus.
    wait(
        "the idle verdict",
        &format!("keel_job_gpu_idle{{keel_test=\"{id}\",slurm_job=\"{job}\"}} == 1"),
        &|r| !r.is_empty(),
    );
    wait(
        "two samples of idle time",
        &format!("increase(keel_job_gpu_idle_seconds_total{{keel_test=\"{id}\"}}[1m]) > 0"),
        &|r| !r.is_empty(),
    );
    let bodies: Vec<String> = keel_exporter::cost::prometheus_queries("1m")
        .iter()
        .map(|q| {
            let url = format!("{base}/api/v1/query?query={}", encode(q));
            rt.block_on(http_get(&url, None, Duration::from_secs(10)))
                .expect("query")
        })
        .collect();
    let rows = keel_exporter::cost::from_prometheus(&base, &bodies[0], &bodies[1], &bodies[2])
        .expect("rows");
    let row = rows
        .iter()
        .find(|r| r.job == job)
        .unwrap_or_else(|| panic!("no row for job {job}: {rows:?}"));
    assert!(row.idle_now, "{row:?}");
    assert!(
        row.idle_gpu_hours > 0.0 && row.idle_gpu_hours <= row.observed_gpu_hours,
        "{row:?}"
    );
    let _ = stop.send(());
}

/// `$instance`, `$gpu` and Grafana's interval variables replaced as Grafana
/// would.
fn expand(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "15s")
        .replace("$instance", ".*")
        .replace("$gpu", ".*")
}

#[test]
fn every_dashboard_query_parses() {
    let base = env("KEEL_TEST_PROMETHEUS_URL");
    let text =
        std::fs::read_to_string(repo().join("deploy/grafana/keel-gpu.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dash["uid"], "keel-gpu");
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        assert!(p["title"].is_string() && p["gridPos"].is_object(), "{p}");
        for t in p["targets"].as_array().expect("targets") {
            exprs.push(t["expr"].as_str().expect("an expression").to_owned());
        }
    }
    for v in dash["templating"]["list"].as_array().expect("variables") {
        if let Some(q) = v["query"]["query"].as_str() {
            // label_values(SELECTOR, label): the selector must parse.
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|s| s.rsplit_once(','))
                .map(|(sel, _)| sel);
            exprs.push(inner.expect("a label_values query").to_owned());
        }
    }
    assert!(exprs.len() >= 18, "{exprs:?}");
    let rt = rt();
    for e in &exprs {
        if let Err(err) = query(&rt, &base, &expand(e)) {
            panic!("the dashboard's query {e:?} does not parse: {err}");
        }
    }
    // The check itself can fail: a broken query is refused.
    assert!(query(&rt, &base, "sum by (gpu (keel_gpu_power_watts)").is_err());
}
