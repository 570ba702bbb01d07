//! The exposition of the recorded machines (tests/fixtures): what a
//! Prometheus scrape of those nodes returns, GPU readings from their
//! recorded NVML snapshot and the rest read under their machine root.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_exporter::readings::{GpuState, Readings};
use keel_exporter::{dcgm, expose, host, jobs};
use keel_topo::Root;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The readings a scrape takes from a fixture, with the probe's answer
/// fresh (age 0).
fn readings(name: &str) -> Readings {
    let root = fixture(name);
    let snap = keel_gpu::recorded::load(&root.join("gpu.json")).ok();
    let r = Root::new(&root);
    let jobs = snap
        .as_ref()
        .map(|s| jobs::from_processes(&r, s))
        .unwrap_or_default();
    Readings {
        gpu: GpuState {
            age_s: snap.as_ref().map(|_| 0.0),
            snapshot: snap.map(Arc::new),
            stale: false,
            error: None,
        },
        hca_ports: host::hca_ports(&r),
        xids: host::XidTail::new(&root).poll(),
        check: None,
        jobs,
        idle: Vec::new(),
        hostname: "node-1".into(),
        expected: None,
        xid_window: None,
    }
}

#[test]
fn ndv4_exposition() {
    insta::assert_snapshot!("nd96asr_v4", expose::render(&readings("nd96asr_v4")));
}

#[test]
fn h100_exposition() {
    insta::assert_snapshot!(
        "nd96isr_h100_v5",
        expose::render(&readings("nd96isr_h100_v5"))
    );
}

/// dcgm-exporter's names, with a reading NVML gave recently (utilisation,
/// memory used, clocks) and a job holding GPU 1.
#[test]
fn h100_dcgm_exposition() {
    let mut r = readings("nd96isr_h100_v5");
    let mut snap = (*r.gpu.snapshot.take().expect("snapshot")).clone();
    for g in &mut snap.gpus {
        g.utilization_gpu_percent = Some(93 + g.index % 3);
        g.utilization_memory_percent = Some(40);
        g.memory_used_bytes = Some(71_000 * 1024 * 1024 + 5);
        g.energy_millijoules = Some(5_000_000_000 + u64::from(g.index));
        g.sm_clock_mhz = Some(1980);
        g.memory_clock_mhz = Some(2619);
        g.power_limit_w = Some(700.0);
        g.memory_temperature_c = Some(45 + g.index);
    }
    r.gpu.snapshot = Some(Arc::new(snap));
    r.jobs.insert(
        1,
        vec![keel_exporter::readings::Job {
            id: "4711".into(),
            user: Some("alice".into()),
            partition: Some("gpu".into()),
        }],
    );
    r.jobs.insert(
        2,
        vec![
            keel_exporter::readings::Job {
                id: "4712".into(),
                user: None,
                partition: None,
            },
            keel_exporter::readings::Job {
                id: "4713".into(),
                user: None,
                partition: None,
            },
        ],
    );
    r.xids = Some(vec![keel_exporter::readings::XidCount {
        pci: "0003:00:00".into(),
        code: 79,
        count: 1,
    }]);
    r.xid_window = Some(keel_exporter::readings::XidWindow {
        window_ms: 300_000,
        counts: r.xids.clone().unwrap_or_default(),
        last: vec![("0003:00:00".into(), 79)],
    });
    insta::assert_snapshot!("nd96isr_h100_v5_dcgm", dcgm::render(&r));
}

/// Jobs by NVML index on a node whose device minors are not its indices
/// (nd96isr_h100_v5-slurm: GPU i is /dev/nvidia(2*(i%4) + i/4)): NVML's
/// processes, the device files they hold and the prolog's mapping
/// directory (named by Slurm's ids, the minors under CycleCloud's
/// gres.conf) all give job 7001 GPUs 0, 1, 4 and 5. Reading the mapping
/// directory's names as indices would give it GPUs 0-3.
#[test]
fn jobs_map_to_nvml_indices_through_device_minors() {
    use keel_exporter::readings::Job;
    use keel_topo::IdKind;
    let root_dir = fixture("nd96isr_h100_v5-slurm");
    let root = Root::new(&root_dir);
    let snap = keel_gpu::recorded::load(&root_dir.join("gpu.json")).expect("snapshot");
    let ids = jobs::gpu_ids(&root, Some(&snap));
    let by_gpu = |m: &std::collections::BTreeMap<u32, Vec<Job>>| -> Vec<(u32, String)> {
        m.iter()
            .flat_map(|(g, js)| js.iter().map(move |j| (*g, j.id.clone())))
            .collect()
    };
    let job_of = |g: u32| {
        if [0, 1, 4, 5].contains(&g) {
            "7001"
        } else {
            "7002"
        }
    };
    let expected: Vec<(u32, String)> = (0..8).map(|g| (g, job_of(g).to_owned())).collect();
    assert_eq!(by_gpu(&jobs::from_processes(&root, &snap)), expected);
    let devices = jobs::device_files("/dev/nvidia{}", &ids);
    assert_eq!(devices.get("/dev/nvidia2"), Some(&1));
    assert_eq!(by_gpu(&jobs::from_device_files(&root, &devices)), expected);
    let mapping = jobs::from_mapping_dir(&root_dir.join("var/lib/dcgm-exporter/job-mapping"));
    assert_eq!(
        by_gpu(&jobs::to_indices(mapping.clone(), &ids, IdKind::Minor)),
        expected
    );
    assert_ne!(
        by_gpu(&jobs::to_indices(mapping, &ids, IdKind::Index)),
        expected,
        "the fixture tells minors from indices"
    );
    // Users from /etc/passwd through the job's processes.
    let users: Vec<Option<String>> = jobs::from_processes(&root, &snap)[&4]
        .iter()
        .map(|j| j.user.clone())
        .collect();
    assert_eq!(users, [Some("alice".to_owned())]);
}

/// The whole exporter on that node with dcgm-exporter's names: `hpc_job`
/// from the mapping directory on the right GPUs, and XIDs as dcgm-exporter
/// gives them: the last XID per GPU, and those of the last five minutes
/// (the kernel log's XID 13 on GPU 5 a minute before `proc/uptime`, not
/// its XID 43 on GPU 1 an hour before).
#[test]
fn dcgm_names_on_a_slurm_node_window_xids_and_label_jobs_by_index() {
    use keel_exporter::{Exporter, ExporterOptions, Naming};
    let root_dir = fixture("nd96isr_h100_v5-slurm");
    let mut opts = ExporterOptions::new(&root_dir);
    opts.naming = Naming::Dcgm;
    opts.jobs_from_processes = false;
    opts.job_mapping_dir = Some(root_dir.join("var/lib/dcgm-exporter/job-mapping"));
    opts.hostname = "h100-0001".into();
    let probe = keel_gpu::recorded::RecordedProbe::new(root_dir.join("gpu.json"));
    let exporter = Exporter::new(opts, Box::new(probe), Arc::new(keel_exporter::SystemClock))
        .expect("exporter");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let text = rt.block_on(exporter.scrape()).to_string();
    let lines = |name: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .map(|l| {
                // gpu, hpc_job, xid and value only.
                let keep = ["gpu=", "hpc_job=", "xid=", "window_size_in_ms="];
                let inner = l.split_once('{').and_then(|(_, r)| r.rsplit_once('}'));
                let (labels, value) = inner.expect("labels");
                let kept: Vec<&str> = labels
                    .split(',')
                    .filter(|kv| keep.iter().any(|k| kv.starts_with(k)))
                    .collect();
                format!("{}{}", kept.join(","), value)
            })
            .collect()
    };
    let gpu_jobs = lines("DCGM_FI_DEV_GPU_TEMP");
    assert!(
        gpu_jobs.contains(&"gpu=\"2\",hpc_job=\"7002\" 36".to_owned()),
        "{gpu_jobs:?}"
    );
    assert!(
        gpu_jobs.contains(&"gpu=\"4\",hpc_job=\"7001\" 35".to_owned()),
        "{gpu_jobs:?}"
    );
    let last = lines("DCGM_FI_DEV_XID_ERRORS");
    assert!(
        last.contains(&"gpu=\"1\",hpc_job=\"7001\" 43".to_owned()),
        "{last:?}"
    );
    assert!(
        last.contains(&"gpu=\"5\",hpc_job=\"7001\" 13".to_owned()),
        "{last:?}"
    );
    assert!(
        last.contains(&"gpu=\"0\",hpc_job=\"7001\" 0".to_owned()),
        "{last:?}"
    );
    let window = lines("DCGM_EXP_XID_ERRORS_COUNT");
    assert_eq!(window.len(), 8, "{window:?}");
    assert!(
        window.contains(&"gpu=\"5\",window_size_in_ms=\"300000\",xid=\"13\" 1".to_owned()),
        "{window:?}"
    );
    assert!(
        window.contains(&"gpu=\"1\",window_size_in_ms=\"300000\" 0".to_owned()),
        "{window:?}"
    );
}

#[test]
fn a_gpu_less_node_exports_host_metrics_and_no_gpu_series() {
    let mut r = readings("cpu-only");
    r.gpu.error = Some(keel_exporter::readings::ProbeFailure::Unavailable);
    let text = expose::render(&r);
    assert!(text.contains("keel_exporter_gpu_up 0\n"), "{text}");
    assert!(
        text.contains("keel_exporter_gpu_probe_error{reason=\"unavailable\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("keel_exporter_hca_readable 1\n"), "{text}");
    assert!(!text.contains("keel_gpu_"), "{text}");
}

#[test]
fn unreadable_values_are_absent_not_zero() {
    let mut r = readings("nd96isr_h100_v5");
    let mut snap = (*r.gpu.snapshot.take().expect("snapshot")).clone();
    snap.gpus[3].temperature_c = None;
    snap.gpus[3].power_w = None;
    snap.gpus[3].ecc = Default::default();
    r.gpu.snapshot = Some(Arc::new(snap));
    let text = expose::render(&r);
    let gpu3 = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains("gpu=\"3\""))
            .count()
    };
    assert_eq!(gpu3("keel_gpu_temperature_celsius{"), 0);
    assert_eq!(gpu3("keel_gpu_power_watts{"), 0);
    assert_eq!(gpu3("keel_gpu_ecc_errors_total{"), 0);
    assert_eq!(gpu3("keel_gpu_memory_total_bytes{"), 1);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("keel_gpu_temperature_celsius{"))
            .count(),
        7
    );
}

#[test]
fn unreadable_sysfs_files_leave_their_readings_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = dir.path().join("sys/class/infiniband/mlx5_0/ports/1");
    std::fs::create_dir_all(port.join("counters")).expect("mkdir");
    std::fs::write(port.join("state"), "4: ACTIVE\n").expect("write");
    // A directory where a file should be: reading it fails.
    std::fs::create_dir_all(port.join("rate")).expect("mkdir");
    std::fs::write(port.join("counters/symbol_error"), "not a number\n").expect("write");
    std::fs::write(port.join("counters/link_downed"), "3\n").expect("write");
    let ports = host::hca_ports(&Root::new(dir.path())).expect("listed");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].state.as_deref(), Some("ACTIVE"));
    assert_eq!(ports[0].rate_gbps, None);
    assert_eq!(ports[0].counters, vec![("link_downed".to_owned(), 3)]);
}

#[test]
fn xids_are_counted_by_gpu_and_code_as_the_log_grows() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("dev")).expect("mkdir");
    let log = dir.path().join("dev/kmsg");
    std::fs::write(&log, "3,100,5000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1, GPU has fallen off the bus.\n6,101,5001,-;eth0: up\n").expect("write");
    let mut tail = host::XidTail::new(dir.path());
    let first = tail.poll().expect("readable");
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].pci.as_str(), first[0].code, first[0].count),
        ("0001:00:00", 79, 1)
    );
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&log)
        .expect("open");
    f.write_all(b"3,102,6000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1, again\n3,103,6001,-;NVRM: Xid (PCI:0002:00:00): 48, DBE\n")
        .expect("append");
    let next = tail.poll().expect("readable");
    let counts: Vec<_> = next
        .iter()
        .map(|x| (x.pci.as_str(), x.code, x.count))
        .collect();
    assert_eq!(counts, vec![("0001:00:00", 79, 2), ("0002:00:00", 48, 1)]);

    let mut r = readings("nd96asr_v4");
    r.xids = Some(next);
    let text = expose::render(&r);
    assert!(
        text.contains("keel_gpu_xid_errors_total{gpu=\"0\",uuid=\"GPU-c32a35fe-9e40-50a0-a66a-4332f1a9a583\",pci=\"0001:00:00\",xid=\"79\"} 2\n"),
        "{text}"
    );
    assert!(host::XidTail::new(Path::new("/nonexistent"))
        .poll()
        .is_none());
}

#[test]
fn keel_check_lines_pass_through_and_nothing_else() {
    let mut r = readings("nd96asr_v4");
    r.check = Some(Ok("# HELP keel_check_overall x\n# TYPE keel_check_overall gauge\nkeel_check_overall{host=\"n\",sku=\"s\"} 2\nother_metric 1\n# HELP other y\nkeel_check_status{check=\"x\" 2\nkeel_check_value{check=\"y\"} lots\n".into()));
    let text = expose::render(&r);
    assert!(
        text.contains("keel_exporter_check_readable 1\n# HELP keel_check_overall"),
        "{text}"
    );
    assert!(text.contains("keel_check_overall{host=\"n\",sku=\"s\"} 2\n"));
    assert!(
        !text.contains("other_metric") && !text.contains("# HELP other "),
        "{text}"
    );
    assert!(
        !text.contains("keel_check_status") && !text.contains("keel_check_value"),
        "damaged lines are left out: {text}"
    );
    r.check = Some(Err("cannot read /x".into()));
    assert!(expose::render(&r).contains("keel_exporter_check_readable 0\n"));
}

/// A machine root with two Slurm jobs' processes: cgroup v2 for job 1001
/// (user from /etc/passwd), the environment for job 1002 (cgroup v1
/// unknown), and a process of no job.
fn procfs_with_jobs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path();
    let proc = |pid: u32, cgroup: &str, environ: &[u8], uid: u32| {
        let d = p.join(format!("proc/{pid}"));
        std::fs::create_dir_all(d.join("fd")).expect("mkdir");
        std::fs::write(d.join("cgroup"), cgroup).expect("write");
        std::fs::write(d.join("environ"), environ).expect("write");
        std::fs::write(
            d.join("status"),
            format!("Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
        )
        .expect("write");
    };
    proc(
        4242,
        "0::/system.slice/slurmstepd.scope/job_1001/step_0/user/task_0\n",
        b"",
        1001,
    );
    proc(
        4243,
        "0::/user.slice\n",
        b"SLURM_JOB_ID=1002\0SLURM_JOB_USER=bob\0SLURM_JOB_PARTITION=gpu\0",
        1002,
    );
    proc(4244, "0::/user.slice/user-0.slice\n", b"HOME=/root\0", 0);
    std::fs::create_dir_all(p.join("etc")).expect("mkdir");
    std::fs::write(
        p.join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\nalice:x:1001:1001::/home/alice:/bin/sh\n",
    )
    .expect("write");
    // 4243 holds GPU 5's device file open as well.
    std::os::unix::fs::symlink("/dev/nvidia5", p.join("proc/4243/fd/7")).expect("symlink");
    std::os::unix::fs::symlink("/dev/null", p.join("proc/4242/fd/0")).expect("symlink");
    dir
}

#[test]
fn gpus_are_labelled_with_the_jobs_of_their_processes() {
    let dir = procfs_with_jobs();
    let mut snap =
        keel_gpu::recorded::load(&fixture("nd96isr_h100_v5").join("gpu.json")).expect("snapshot");
    let procs = |pids: &[u32]| {
        Some(
            pids.iter()
                .map(|pid| keel_gpu::GpuProcess {
                    pid: *pid,
                    used_memory_bytes: None,
                })
                .collect(),
        )
    };
    snap.gpus[0].processes = procs(&[4242]);
    snap.gpus[1].processes = procs(&[4242, 4243]);
    snap.gpus[2].processes = procs(&[4244, 99999]);
    let root = Root::new(dir.path());
    let mut jobs = jobs::from_processes(&root, &snap);
    jobs::merge(
        &mut jobs,
        jobs::from_device_files(
            &root,
            &jobs::device_files("/dev/nvidia{}", &jobs::gpu_ids(&root, Some(&snap))),
        ),
    );
    let mut r = readings("nd96isr_h100_v5");
    r.gpu.snapshot = Some(Arc::new(snap));
    r.jobs = jobs;
    let text = expose::render(&r);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("keel_gpu_job_info{"))
        .collect();
    let uuid = |i: usize| {
        r.gpu
            .snapshot
            .as_ref()
            .and_then(|s| s.gpus[i].uuid.clone())
            .expect("uuid")
    };
    assert_eq!(
        lines,
        vec![
            format!(
                "keel_gpu_job_info{{gpu=\"0\",uuid=\"{}\",slurm_job=\"1001\",user=\"alice\",partition=\"\"}} 1",
                uuid(0)
            ),
            format!(
                "keel_gpu_job_info{{gpu=\"1\",uuid=\"{}\",slurm_job=\"1001\",user=\"alice\",partition=\"\"}} 1",
                uuid(1)
            ),
            format!(
                "keel_gpu_job_info{{gpu=\"1\",uuid=\"{}\",slurm_job=\"1002\",user=\"bob\",partition=\"gpu\"}} 1",
                uuid(1)
            ),
            format!(
                "keel_gpu_job_info{{gpu=\"5\",uuid=\"{}\",slurm_job=\"1002\",user=\"bob\",partition=\"gpu\"}} 1",
                uuid(5)
            ),
        ],
        "{text}"
    );
}

#[test]
fn the_job_mapping_directory_labels_gpus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("0"), "5001\n").expect("write");
    std::fs::write(d.join("3"), "5002\n5003\n").expect("write");
    std::fs::write(d.join("4.1"), "5004\n").expect("write");
    std::fs::write(d.join("7"), "").expect("write");
    std::fs::write(d.join("README"), "5005\n").expect("write");
    std::fs::write(d.join("6"), "$(reboot)\n").expect("write");
    let jobs = jobs::from_mapping_dir(d);
    let ids: Vec<(u32, Vec<&str>)> = jobs
        .iter()
        .map(|(g, j)| (*g, j.iter().map(|j| j.id.as_str()).collect()))
        .collect();
    assert_eq!(
        ids,
        vec![
            (0, vec!["5001"]),
            (3, vec!["5002", "5003"]),
            (4, vec!["5004"])
        ]
    );
    assert!(jobs::from_mapping_dir(&d.join("missing")).is_empty());
}

#[test]
fn the_slurm_prolog_writes_what_the_exporter_reads() {
    let script = fixture("../../deploy/slurm/keel-job-mapping.sh");
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |vars: &[(&str, &str)], arg: &str| {
        let mut c = std::process::Command::new("sh");
        c.arg(&script)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("KEEL_JOB_MAPPING_DIR", dir.path());
        if !arg.is_empty() {
            c.arg(arg);
        }
        for (k, v) in vars {
            c.env(k, v);
        }
        let st = c.status().expect("sh runs");
        assert!(st.success(), "a prolog or epilog must exit 0");
    };
    run(
        &[("SLURM_JOB_ID", "77"), ("GPU_DEVICE_ORDINAL", "1,3")],
        "prolog",
    );
    run(
        &[
            ("SLURM_JOB_ID", "78"),
            ("CUDA_VISIBLE_DEVICES", "3"),
            ("SLURM_SCRIPT_CONTEXT", "prolog_slurmd"),
        ],
        "",
    );
    run(
        &[("SLURM_JOB_ID", "77"), ("GPU_DEVICE_ORDINAL", "1,3")],
        "prolog",
    );
    run(
        &[("SLURM_JOB_ID", "1;reboot"), ("GPU_DEVICE_ORDINAL", "2")],
        "prolog",
    );
    let ids = |m: &std::collections::BTreeMap<u32, Vec<keel_exporter::readings::Job>>| -> Vec<(u32, Vec<String>)> {
        m.iter().map(|(g, j)| (*g, j.iter().map(|j| j.id.clone()).collect())).collect()
    };
    assert_eq!(
        ids(&jobs::from_mapping_dir(dir.path())),
        vec![
            (1, vec!["77".to_owned()]),
            (3, vec!["77".to_owned(), "78".to_owned()])
        ]
    );
    run(
        &[
            ("SLURM_JOB_ID", "77"),
            ("GPU_DEVICE_ORDINAL", "1,3"),
            ("SLURM_SCRIPT_CONTEXT", "epilog_slurmd"),
        ],
        "",
    );
    assert_eq!(
        ids(&jobs::from_mapping_dir(dir.path())),
        vec![(3, vec!["78".to_owned()])]
    );
}

/// Every metric name the exporter can emit is documented.
#[test]
fn every_metric_is_documented() {
    let doc =
        std::fs::read_to_string(fixture("../../docs/monitoring.md")).expect("docs/monitoring.md");
    let sources = [
        include_str!("../src/expose.rs"),
        include_str!("../src/dcgm.rs"),
    ];
    let mut names = Vec::new();
    for src in sources {
        for part in src.split('"').skip(1).step_by(2) {
            if (part.starts_with("keel_") || part.starts_with("DCGM_"))
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                names.push(part.to_owned());
            }
        }
    }
    assert!(names.len() > 50, "{names:?}");
    for n in names.iter().filter(|n| !n.starts_with("keel_check_")) {
        assert!(
            doc.contains(&format!("`{n}`")),
            "docs/monitoring.md does not document {n}"
        );
    }
}
