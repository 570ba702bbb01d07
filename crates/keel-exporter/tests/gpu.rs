//! On a machine with an NVIDIA GPU and driver: the exporter reads NVML
//! through keel-gpu's probe and exposes every GPU with the readings NVML
//! gives on any data-centre GPU. Run with
//! `cargo nextest run -p keel-exporter --test gpu --run-ignored all`.

use std::sync::Arc;
use std::time::Duration;

use keel_exporter::{Exporter, ExporterOptions, SystemClock};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nvml_readings_are_exposed_for_every_gpu() {
    let probe = keel_gpu::LoadedNvmlProbe::new(
        keel_gpu::NvmlProbe::new().with_timeout(Duration::from_secs(20)),
    );
    let mut opts = ExporterOptions::new("/");
    opts.deadline = Duration::from_secs(20);
    let exporter = Exporter::new(opts, Box::new(probe), Arc::new(SystemClock)).expect("exporter");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _ = rt.block_on(exporter.readings());
    // The second snapshot comes from the NVML handle the first one loaded.
    let readings = rt.block_on(exporter.readings());
    let snap = readings
        .gpu
        .snapshot
        .clone()
        .expect("NVML answered with a snapshot");
    assert!(!snap.gpus.is_empty(), "no GPU opened: {:?}", snap.unopened);
    for g in &snap.gpus {
        assert!(
            g.utilization_gpu_percent.is_some_and(|u| u <= 100),
            "GPU {}: {g:?}",
            g.index
        );
        assert!(
            g.memory_used_bytes.is_some() && g.memory_total_bytes.is_some(),
            "GPU {}",
            g.index
        );
        assert!(g.sm_clock_mhz.is_some_and(|c| c > 0), "GPU {}", g.index);
        assert!(
            g.temperature_c.is_some() && g.power_w.is_some(),
            "GPU {}",
            g.index
        );
    }
    let text = keel_exporter::expose::render(&readings);
    let count = |name: &str| text.lines().filter(|l| l.starts_with(name)).count();
    assert_eq!(
        count("keel_gpu_utilization_ratio{"),
        snap.gpus.len(),
        "{text}"
    );
    assert_eq!(count("keel_gpu_memory_used_bytes{"), snap.gpus.len());
    assert_eq!(count("keel_gpu_sm_clock_hertz{"), snap.gpus.len());
    println!("{text}");
}
