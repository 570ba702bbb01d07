//! `/metrics` over real HTTP: authentication, the probe deadline (a hung
//! probe), a node without GPUs, a replay whose readings change, and a
//! connection flood. The GPU is faked only at the probe boundary.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_exporter::replay::ReplayProbe;
use keel_exporter::server::{serve, sha256_hex, Auth, ServeOptions};
use keel_exporter::{Exporter, ExporterOptions, Monotonic};
use keel_gpu::{GpuError, GpuProbe, GpuSnapshot};
use keel_testkit::http;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn snapshot(name: &str) -> GpuSnapshot {
    keel_gpu::recorded::load(&fixture(name).join("gpu.json")).expect("fixture snapshot")
}

/// A clock the test moves.
#[derive(Debug)]
struct ManualClock(Mutex<Instant>);

impl ManualClock {
    fn new() -> Arc<Self> {
        Arc::new(Self(Mutex::new(Instant::now())))
    }
    fn advance(&self, d: Duration) {
        *self.0.lock().expect("lock") += d;
    }
}

impl Monotonic for ManualClock {
    fn now(&self) -> Instant {
        *self.0.lock().expect("lock")
    }
}

/// Answers the fixture's snapshot on its first call and hangs (for the
/// test's lifetime) on every later one.
struct HangsAfterFirst {
    snap: GpuSnapshot,
    calls: Arc<AtomicU32>,
}

impl GpuProbe for HangsAfterFirst {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Ok(self.snap.clone());
        }
        std::thread::sleep(Duration::from_secs(3600));
        Err(GpuError::Timeout { seconds: 3600.0 })
    }
}

struct NoDriver;

impl GpuProbe for NoDriver {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        Err(GpuError::Unavailable {
            reason: "libnvidia-ml.so.1: cannot open shared object file".into(),
        })
    }
}

struct Server {
    addr: SocketAddr,
    // Keeps the server running until the test ends.
    _rt: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn start(
    root: &str,
    probe: Box<dyn GpuProbe + Send>,
    clock: Arc<dyn Monotonic>,
    serve_opts: ServeOptions,
    tweak: impl FnOnce(&mut ExporterOptions),
) -> Server {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut opts = ExporterOptions::new(fixture(root));
    opts.deadline = Duration::from_millis(300);
    opts.min_interval = Duration::ZERO;
    tweak(&mut opts);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let exporter = Exporter::new(opts, probe, clock).expect("exporter");
        tokio::spawn(serve(l, exporter, serve_opts, async move {
            let _ = rx.await;
        }));
        addr
    });
    Server {
        addr,
        _rt: rt,
        stop: Some(tx),
    }
}

const TOKEN: &str = "scrape-token-for-tests";

fn token_opts() -> ServeOptions {
    ServeOptions {
        auth: Auth::Token {
            sha256: sha256_hex(TOKEN.as_bytes()),
        },
        ..ServeOptions::default()
    }
}

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn metrics_need_the_right_bearer_token() {
    let s = start(
        "nd96asr_v4",
        Box::new(ReplayProbe::new(
            vec![snapshot("nd96asr_v4")],
            Duration::from_secs(15),
            ManualClock::new(),
        )),
        ManualClock::new(),
        token_opts(),
        |_| {},
    );
    let ok = http::get(s.addr, "/metrics", TOKEN).expect("scrape");
    assert_eq!(ok.status, 200);
    assert_eq!(
        ok.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert!(ok.text().contains("keel_gpu_devices 8\n"));
    for bad in ["wrong", "", "scrape-token-for-test"] {
        let r = http::get(s.addr, "/metrics", bad).expect("scrape");
        assert_eq!(r.status, 401, "{bad:?}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert!(!r.text().contains("keel_gpu"));
    }
    let auth = format!("Bearer {TOKEN}");
    let om = http::request(
        s.addr,
        "GET",
        "/metrics",
        &[
            ("Authorization", &auth),
            (
                "Accept",
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            ),
        ],
        b"",
    )
    .expect("scrape");
    assert_eq!(om.status, 200);
    assert_eq!(
        om.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(om.text().ends_with("# EOF\n"));
    assert!(
        om.text()
            .contains("# TYPE keel_gpu_pcie_replays counter\nkeel_gpu_pcie_replays_total{"),
        "{}",
        om.text()
    );
    let none = http::request(s.addr, "GET", "/metrics", &[], b"").expect("scrape");
    assert_eq!(none.status, 401);
    let basic = http::request(
        s.addr,
        "GET",
        "/metrics",
        &[("Authorization", "Basic c2NyYXBlLXRva2VuLWZvci10ZXN0cw==")],
        b"",
    )
    .expect("scrape");
    assert_eq!(basic.status, 401);
    assert_eq!(
        http::request(s.addr, "GET", "/health", &[], b"")
            .expect("health")
            .status,
        200
    );
    assert_eq!(
        http::request(s.addr, "POST", "/metrics", &[], b"")
            .expect("post")
            .status,
        405
    );
    assert_eq!(
        http::request(s.addr, "GET", "/nope", &[], b"")
            .expect("404")
            .status,
        404
    );
}

#[test]
fn a_hung_probe_does_not_block_metrics_past_the_deadline() {
    let clock = ManualClock::new();
    let calls = Arc::new(AtomicU32::new(0));
    let probe = HangsAfterFirst {
        snap: snapshot("nd96isr_h100_v5"),
        calls: calls.clone(),
    };
    let s = start(
        "nd96isr_h100_v5",
        Box::new(probe),
        clock.clone(),
        ServeOptions::default(),
        |o| o.deadline = Duration::from_secs(1),
    );
    let first = http::get(s.addr, "/metrics", "").expect("scrape").text();
    assert_eq!(
        value(&first, "keel_exporter_gpu_stale"),
        Some(0.0),
        "{first}"
    );
    let temps = |t: &str| {
        t.lines()
            .filter(|l| l.starts_with("keel_gpu_temperature_celsius{"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(temps(&first).len(), 8);

    clock.advance(Duration::from_secs(42));
    for i in 0..3 {
        let started = Instant::now();
        let r = http::get(s.addr, "/metrics", "").expect("scrape");
        let took = started.elapsed();
        assert_eq!(r.status, 200);
        // The deadline is 1 s: the first scrape waits it out, later ones
        // see the same call still hanging and do not wait again.
        if i == 0 {
            assert!(took >= Duration::from_millis(900), "a scrape took {took:?}");
            assert!(took < Duration::from_secs(3), "a scrape took {took:?}");
        } else {
            assert!(
                took < Duration::from_millis(900),
                "a later scrape took {took:?}"
            );
        }
        let t = r.text();
        assert_eq!(value(&t, "keel_exporter_gpu_stale"), Some(1.0), "{t}");
        assert_eq!(value(&t, "keel_exporter_gpu_up"), Some(1.0));
        assert_eq!(
            value(&t, "keel_exporter_gpu_readings_age_seconds"),
            Some(42.0)
        );
        assert_eq!(
            value(&t, "keel_exporter_gpu_probe_error{reason=\"timeout\"}"),
            Some(1.0)
        );
        assert_eq!(
            temps(&t),
            temps(&first),
            "the last good readings are served"
        );
    }
    // One call hangs; no more were started behind it.
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn a_node_without_gpus_serves_host_metrics() {
    let s = start(
        "cpu-only",
        Box::new(NoDriver),
        ManualClock::new(),
        ServeOptions::default(),
        |_| {},
    );
    for _ in 0..2 {
        let r = http::get(s.addr, "/metrics", "").expect("scrape");
        assert_eq!(r.status, 200);
        let t = r.text();
        assert_eq!(value(&t, "keel_exporter_gpu_up"), Some(0.0), "{t}");
        assert_eq!(
            value(&t, "keel_exporter_gpu_probe_error{reason=\"unavailable\"}"),
            Some(1.0)
        );
        assert_eq!(value(&t, "keel_exporter_kernel_log_readable"), Some(1.0));
        assert!(!t.contains("keel_gpu_"), "{t}");
    }
}

#[test]
fn a_replay_changes_its_readings_over_time() {
    let clock = ManualClock::new();
    let healthy = snapshot("nd96asr_v4");
    let mut failing = healthy.clone();
    failing.gpus[2].ecc.volatile_dram_uncorrected = Some(4);
    failing.gpus[2].utilization_gpu_percent = Some(0);
    let probe = ReplayProbe::new(
        vec![healthy, failing],
        Duration::from_secs(60),
        clock.clone(),
    );
    let s = start(
        "nd96asr_v4",
        Box::new(probe),
        clock.clone(),
        ServeOptions::default(),
        |_| {},
    );
    let series = "keel_gpu_ecc_errors_total{gpu=\"2\",uuid=\"GPU-3e154644-df6a-5166-9cff-1acbb9374fda\",counter=\"volatile\",location=\"dram\",type=\"uncorrected\"}";
    let t = http::get(s.addr, "/metrics", "").expect("scrape").text();
    assert_eq!(value(&t, series), Some(0.0), "{t}");
    clock.advance(Duration::from_secs(61));
    let t = http::get(s.addr, "/metrics", "").expect("scrape").text();
    assert_eq!(value(&t, series), Some(4.0), "{t}");
    clock.advance(Duration::from_secs(600));
    let t = http::get(s.addr, "/metrics", "").expect("scrape").text();
    assert_eq!(value(&t, series), Some(4.0), "the last snapshot stays");
}

/// A connection from `source`, a loopback address of its own (a client of
/// its own), that gives up reading after 10 s.
fn connect_from(source: [u8; 4], addr: SocketAddr) -> std::net::TcpStream {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::from((source, 0)).into())
        .expect("bind the source address");
    s.connect(&addr.into()).expect("connect");
    let s: std::net::TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s
}

/// Everything the server sends until it closes (or 10 s pass).
fn read_all(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn flood_opts(max_connections: usize) -> ServeOptions {
    ServeOptions {
        max_connections,
        max_per_client: 2,
        // Long past the test: no slow head ends by itself.
        header_timeout: Duration::from_secs(120),
        ..token_opts()
    }
}

#[test]
fn slow_heads_cannot_starve_a_scraper_and_a_client_over_its_share_gets_503_at_once() {
    let s = start(
        "nd96asr_v4",
        Box::new(ReplayProbe::new(
            vec![snapshot("nd96asr_v4")],
            Duration::from_secs(15),
            ManualClock::new(),
        )),
        ManualClock::new(),
        flood_opts(16),
        |_| {},
    );
    // 8 clients hold 2 connections each and send nothing: every place.
    let mut slow = Vec::new();
    for i in 0..8u8 {
        for _ in 0..2 {
            slow.push(connect_from([127, 0, 5, 1 + i], s.addr));
        }
    }
    // A third from the newest of them is refused at once, with the reason
    // (the oldest ones already made room for newer ones: unauthenticated
    // connections hold 12 of the 16 places).
    let mut over = connect_from([127, 0, 5, 8], s.addr);
    let a = read_all(&mut over);
    assert!(a.starts_with("HTTP/1.1 503"), "{a:?}");
    assert!(a.contains("too many connections from this address"), "{a}");
    // The scraper with the token is served: the oldest slow head makes
    // room for it.
    let r = http::get(s.addr, "/metrics", TOKEN).expect("scrape under the flood");
    assert_eq!(r.status, 200);
    assert!(r.text().contains("keel_gpu_devices 8\n"));
    assert_eq!(read_all(&mut slow[0]), "", "the oldest slow head is closed");
    drop(slow);
}

#[test]
fn scrapers_beyond_max_connections_are_answered_503_at_once() {
    let s = start(
        "nd96asr_v4",
        Box::new(ReplayProbe::new(
            vec![snapshot("nd96asr_v4")],
            Duration::from_secs(15),
            ManualClock::new(),
        )),
        ManualClock::new(),
        flood_opts(2),
        |_| {},
    );
    // Two scrapers keep their connections (authenticated, kept alive).
    let mut held = Vec::new();
    for i in 0..2u8 {
        use std::io::Write;
        let mut c = connect_from([127, 0, 6, 1 + i], s.addr);
        write!(
            c,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        )
        .expect("write");
        use std::io::Read;
        let mut buf = [0u8; 12];
        c.read_exact(&mut buf).expect("answer");
        assert_eq!(&buf, b"HTTP/1.1 200");
        held.push(c);
    }
    let mut over = connect_from([127, 0, 6, 9], s.addr);
    let a = read_all(&mut over);
    assert!(a.starts_with("HTTP/1.1 503"), "{a:?}");
    assert!(a.contains("too many connections"), "{a}");
    drop(held);
}

#[test]
fn idle_gpu_time_is_accounted_per_job_and_the_policy_marks_idle_jobs() {
    let clock = ManualClock::new();
    // The mapping directory names GPUs by Slurm's ids, device minors: job
    // 502's GPU is minor 2, which on this machine is NVML's GPU 1.
    let mut snap = snapshot("nd96asr_v4");
    for g in &mut snap.gpus {
        g.utilization_gpu_percent = Some(if g.minor_number == Some(2) { 90 } else { 0 });
    }
    let map = tempfile::tempdir().expect("tempdir");
    std::fs::write(map.path().join("0"), "501\n").expect("write");
    std::fs::write(map.path().join("1"), "501\n").expect("write");
    std::fs::write(map.path().join("2"), "502\n").expect("write");
    let dir = map.path().to_path_buf();
    let probe = ReplayProbe::new(vec![snap], Duration::from_secs(15), clock.clone());
    let s = start(
        "nd96asr_v4",
        Box::new(probe),
        clock.clone(),
        ServeOptions::default(),
        move |o| {
            o.job_mapping_dir = Some(dir);
            o.idle = Some(keel_exporter::IdlePolicy {
                threshold_percent: 5.0,
                idle_minutes: 2.0,
            });
        },
    );
    let mut text = String::new();
    for i in 0..4 {
        if i > 0 {
            clock.advance(Duration::from_secs(60));
        }
        text = http::get(s.addr, "/metrics", "").expect("scrape").text();
        let idle = value(
            &text,
            "keel_job_gpu_idle{slurm_job=\"501\",user=\"\",partition=\"\"}",
        );
        assert_eq!(
            idle,
            Some(if i >= 2 { 1.0 } else { 0.0 }),
            "after {i} minutes: {text}"
        );
    }
    assert_eq!(
        value(
            &text,
            "keel_job_gpu_idle_seconds_total{slurm_job=\"501\",user=\"\",partition=\"\"}"
        ),
        Some(360.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "keel_job_gpu_observed_seconds_total{slurm_job=\"501\",user=\"\",partition=\"\"}"
        ),
        Some(360.0)
    );
    assert_eq!(
        value(
            &text,
            "keel_job_gpu_idle_seconds_total{slurm_job=\"502\",user=\"\",partition=\"\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        value(
            &text,
            "keel_job_gpu_idle{slurm_job=\"502\",user=\"\",partition=\"\"}"
        ),
        Some(0.0)
    );
    let rows = keel_exporter::cost::from_exposition(&text);
    assert_eq!(rows[0].job, "501");
    assert_eq!(rows[0].idle_gpu_hours, 0.1);
    assert!(rows[0].idle_now && !rows[1].idle_now);
}
