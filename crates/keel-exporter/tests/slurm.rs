//! Job mapping on the real Slurm test cluster (scripts/slurm-cluster): a
//! batch job on the GPU node that holds the node's stand-in GPU device
//! files open is attributed to its job id and user. The GPUs' NVML readings
//! are a recorded snapshot (the probe boundary); processes, device files
//! and job ids are real.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_exporter::replay::ReplayProbe;
use keel_exporter::{Exporter, ExporterOptions, SystemClock};
use keel_testkit::SlurmCluster;

struct Cancel<'a>(&'a SlurmCluster, String);

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        let _ = self.0.command("scancel", &[&self.1]);
    }
}

#[test]
fn a_job_holding_gpu_device_files_is_attributed_to_its_job_id() {
    let cluster = SlurmCluster::get();
    let dir = cluster
        .conf()
        .parent()
        .expect("the cluster's directory")
        .to_path_buf();
    let gpu_node = cluster.node(cluster.nodes().len() - 1).to_owned();
    let out = dir.join("exporter-job-%j.out");
    // The job opens each of its GPUs' device files (SLURM_JOB_GPUS holds
    // Slurm's ids, the device files' numbers under gres.conf's File=
    // lines) and says which, then holds them. The stand-in files have the
    // NVIDIA driver's numbers and no driver behind them, so they are
    // opened with O_PATH (a descriptor /proc shows like any other), as
    // reading them would fail with ENXIO.
    let script = format!(
        "set -- $(echo \"$SLURM_JOB_GPUS\" | tr , ' '); echo \"gpus=$SLURM_JOB_GPUS\"; exec python3 -c 'import os, sys, time; fds = [os.open(p, os.O_PATH) for p in sys.argv[1:]]; time.sleep(120)' {dev}/gpu$1 {dev}/gpu$2",
        dev = dir.join("dev").display()
    );
    let id = cluster
        .command(
            "sbatch",
            &[
                "--parsable",
                "-w",
                &gpu_node,
                "--gres=gpu:2",
                "-o",
                &out.display().to_string(),
                "--wrap",
                &script,
            ],
        )
        .expect("sbatch")
        .trim()
        .split(';')
        .next()
        .expect("a job id")
        .to_owned();
    let _cancel = Cancel(&cluster, id.clone());
    let out = dir.join(format!("exporter-job-{id}.out"));

    let snap = keel_gpu::recorded::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/nd96asr_v4/gpu.json"),
    )
    .expect("fixture");
    let mut opts = ExporterOptions::new("/");
    opts.jobs_from_processes = false;
    opts.device_file_pattern = Some(format!("{}/gpu{{}}", dir.join("dev").display()));
    let clock = Arc::new(SystemClock);
    let probe = ReplayProbe::new(vec![snap], Duration::from_secs(15), clock.clone());
    let exporter = Exporter::new(opts, Box::new(probe), clock).expect("exporter");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");

    let deadline = Instant::now() + Duration::from_secs(60);
    let (gpus, jobs) = loop {
        let gpus = std::fs::read_to_string(&out).ok().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("gpus=").map(str::to_owned))
        });
        let readings = rt.block_on(exporter.readings());
        if let Some(gpus) = gpus {
            if !readings.jobs.is_empty() {
                break (gpus, readings.jobs);
            }
        }
        assert!(
            Instant::now() < deadline,
            "job {id} was not attributed within 60 s (its output: {:?})",
            std::fs::read_to_string(&out)
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let held: Vec<u32> = gpus
        .split(',')
        .map(|g| g.trim().parse().expect("a Slurm GPU id"))
        .collect();
    assert_eq!(held.len(), 2, "{gpus}");
    // The snapshot's GPUs (nd96asr_v4) have device minors that are not
    // their NVML indices: the jobs are keyed by the index whose minor is
    // the file's number.
    let snap = keel_gpu::recorded::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/nd96asr_v4/gpu.json"),
    )
    .expect("fixture");
    let mut expected: Vec<u32> = held
        .iter()
        .map(|m| {
            snap.gpus
                .iter()
                .find(|g| g.minor_number == Some(*m))
                .map(|g| g.index)
                .expect("a GPU with that minor")
        })
        .collect();
    expected.sort_unstable();
    assert_ne!(expected, held, "the fixture's minors are not its indices");
    let attributed: Vec<u32> = jobs.keys().copied().collect();
    assert_eq!(attributed, expected, "{jobs:?}");
    for list in jobs.values() {
        assert_eq!(list.len(), 1, "{jobs:?}");
        assert_eq!(list[0].id, id);
        assert_eq!(list[0].user.as_deref(), Some(whoami().as_str()));
    }
    let _ = std::fs::remove_file(&out);

    // What `keel cost idle --cancel --execute` runs: the job ends.
    let slurm = cluster.slurm(Duration::from_secs(10));
    assert!(slurm.cancel("1;reboot").is_err());
    slurm.cancel(&id).expect("scancel");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = cluster
            .command("squeue", &["-h", "-j", &id, "-o", "%T"])
            .unwrap_or_default();
        if !state.contains("RUNNING") && !state.contains("PENDING") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} still {state} 30 s after scancel"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn whoami() -> String {
    let out = std::process::Command::new("id")
        .arg("-un")
        .output()
        .expect("id");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
