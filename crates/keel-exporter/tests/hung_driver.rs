//! A driver that never answers, behind the same deadline NVML's probes use
//! (keel-gpu's `CallGate`): a hundred scrapes leave the thread count
//! bounded, and every one of them says the GPUs are unreadable.

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_exporter::{Exporter, ExporterOptions, Monotonic};
use keel_gpu::{CallGate, GpuError, GpuProbe, GpuSnapshot};

/// What `LoadedNvmlProbe::snapshot` does, with a driver call that never
/// returns: the work runs through the process's NVML gate under a
/// deadline.
struct NeverAnswers {
    /// Kept so the hung calls wait for as long as the test runs.
    hang: Arc<Mutex<mpsc::Receiver<()>>>,
}

impl GpuProbe for NeverAnswers {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        let hang = self.hang.clone();
        CallGate::nvml().run(Duration::from_millis(5), move || {
            let _ = hang.lock().map(|rx| rx.recv());
            Err(GpuError::Nvml {
                call: "nvmlDeviceGetCount",
                message: "returned after the test".into(),
            })
        })
    }
}

#[derive(Debug)]
struct Wall;

impl Monotonic for Wall {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

#[test]
fn a_hundred_scrapes_of_a_hung_driver_leave_the_thread_count_bounded() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (_release, hang) = mpsc::channel::<()>();
    let probe = NeverAnswers {
        hang: Arc::new(Mutex::new(hang)),
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cpu-only");
    let mut opts = ExporterOptions::new(root);
    opts.deadline = Duration::from_millis(20);
    opts.min_interval = Duration::ZERO;
    let exporter = Exporter::new(opts, Box::new(probe), Arc::new(Wall)).expect("exporter");
    // The runtime's and the sampler's threads exist after the first scrape.
    let first = rt.block_on(exporter.scrape());
    assert!(first.contains("keel_exporter_gpu_up 0\n"), "{first}");
    let before = threads();
    let mut last = String::new();
    for _ in 0..100 {
        last = rt.block_on(exporter.scrape()).to_string();
    }
    let after = threads();
    assert!(
        after <= before + 2,
        "threads grew from {before} to {after} over 100 scrapes of a hung driver"
    );
    assert!(CallGate::nvml().is_busy(), "the first call still hangs");
    assert!(last.contains("keel_exporter_gpu_up 0\n"), "{last}");
    assert!(
        last.contains("keel_exporter_gpu_probe_error{reason=\"timeout\"} 1\n"),
        "{last}"
    );
}
