//! `keel cost` against real Slurm accounting: the test cluster
//! (`scripts/slurm-cluster`) with slurmdbd over MariaDB runs batch jobs
//! with and without GPUs from n3's Gres, and `keel cost` reads them back
//! through the real `sacct`; `keel review` of the cluster's slurm.conf
//! finds its accounting settings. A job run under `keel run --slurm` is
//! marked in its Comment and priced as requeue-safe.
//!
//! Where the cluster runs without accounting (slurmdbd or MariaDB could
//! not be installed or started), the test says so and why, and skips.
//! `scripts/test` starts the cluster and runs it with the other Slurm tests,
//! one at a time (nextest group `slurm`).

use std::process::Command;
use std::time::{Duration, Instant};

use keel_testkit::SlurmCluster;
use serde_json::Value;

fn keel() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.env_remove("KEEL_CONFIG").env("HOME", "/nonexistent");
    c
}

/// The accounting variables scripts/slurm-cluster exports, or why there
/// is no accounting.
fn accounting() -> Result<(), String> {
    match std::env::var("KEEL_TEST_SLURM_ACCOUNTING") {
        Ok(v) if v == "slurmdbd" => Ok(()),
        _ => Err(
            std::env::var("KEEL_TEST_SLURM_ACCOUNTING_OFF").unwrap_or_else(|_| {
                "KEEL_TEST_SLURM_ACCOUNTING is not set (eval \"$(scripts/slurm-cluster start)\")"
                    .to_owned()
            }),
        ),
    }
}

/// Submits a batch job and returns its id.
fn sbatch(cluster: &SlurmCluster, dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new("sbatch")
        .env("SLURM_CONF", cluster.conf())
        .current_dir(dir)
        .args(["--parsable", "-p", "debug", "-o", "/dev/null"])
        .args(args)
        .output()
        .expect("sbatch runs");
    assert!(
        out.status.success(),
        "sbatch {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // `--parsable` prints `id` or `id;cluster`.
    id.split(';').next().unwrap_or("").to_owned()
}

/// `sacct`'s rows for `jobs` once every one of them is COMPLETED in the
/// accounting database, as `JobID|State|ElapsedRaw|AllocTRES`.
fn wait_accounted(cluster: &SlurmCluster, jobs: &[String]) -> Vec<String> {
    let list = jobs.join(",");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let out = cluster
            .command(
                "sacct",
                &[
                    "-X",
                    "-n",
                    "-P",
                    "-j",
                    &list,
                    "--format=JobID,State,ElapsedRaw,AllocTRES",
                ],
            )
            .unwrap_or_default();
        let rows: Vec<String> = out.lines().map(str::to_owned).collect();
        let done = jobs.iter().all(|j| {
            rows.iter()
                .any(|r| r.starts_with(&format!("{j}|COMPLETED|")))
        });
        if done {
            return rows;
        }
        assert!(
            Instant::now() < deadline,
            "jobs {list} not all COMPLETED in sacct after 90 s: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn utc(offset: &str) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", offset, "+%Y-%m-%dT%H:%M:%S"])
        .output()
        .expect("date");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `keel --json cost` over the real sacct (`args` after `cost`), run
/// again until its report lists every one of `jobs`: slurmdbd can answer
/// a query by period without a job for a moment after `sacct -j` shows it
/// COMPLETED.
fn cost_listing(cluster: &SlurmCluster, args: &[&str], jobs: &[&String]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = keel()
            .env("SLURM_CONF", cluster.conf())
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .args(["--json", "cost"])
            .args(args)
            .output()
            .expect("keel cost runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        let listed = v["report"]["jobs"].as_array().is_some_and(|list| {
            jobs.iter()
                .all(|id| list.iter().any(|j| j["job_id"] == id.as_str()))
        });
        if listed {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "keel cost does not list all of {jobs:?} after 30 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn cost_prices_the_gpu_hours_real_sacct_returns_for_real_jobs() {
    if let Err(why) = accounting() {
        eprintln!("skipped: the Slurm test cluster runs without accounting: {why}");
        return;
    }
    let cluster = SlurmCluster::get();
    cluster
        .wait_until_idle(Duration::from_secs(30))
        .expect("idle cluster");
    let dir = tempfile::tempdir().expect("tempdir");
    let since = utc("-1 minute");

    // Two GPU jobs on n3's Gres (one requeue-safe by its name), one
    // without GPUs, which keel cost leaves out.
    let safe = sbatch(
        &cluster,
        dir.path(),
        &["-J", "keel-acct-safe", "--gres=gpu:2", "--wrap", "sleep 3"],
    );
    let whole = sbatch(
        &cluster,
        dir.path(),
        &["-J", "acct-whole", "--gres=gpu:8", "--wrap", "sleep 2"],
    );
    let cpu = sbatch(
        &cluster,
        dir.path(),
        &["-J", "acct-cpu", "--wrap", "sleep 1"],
    );
    let rows = wait_accounted(&cluster, &[safe.clone(), whole.clone(), cpu.clone()]);
    let elapsed = |job: &str| -> u64 {
        rows.iter()
            .find(|r| r.starts_with(&format!("{job}|")))
            .and_then(|r| r.split('|').nth(2))
            .and_then(|e| e.parse().ok())
            .unwrap_or_else(|| panic!("{job} in {rows:?}"))
    };
    assert!(
        rows.iter()
            .any(|r| r.starts_with(&format!("{safe}|")) && r.contains("gres/gpu=2")),
        "AllocTRES records the GPUs (AccountingStorageTRES=gres/gpu): {rows:?}"
    );

    let prices = dir.path().join("prices.toml");
    std::fs::write(
        &prices,
        "source = \"test prices\"\n[[price]]\npartition = \"debug\"\nsku = \"test\"\ngpus_per_node = 8\non_demand = 16.0\nspot = 4.0\n",
    )
    .expect("write");
    let until = utc("+1 minute");
    let prices_arg = prices.display().to_string();
    let v = cost_listing(
        &cluster,
        &[
            "--prices",
            &prices_arg,
            "--since",
            &since,
            "--until",
            &until,
            "--requeue-safe",
            "keel-acct-",
        ],
        &[&safe, &whole],
    );
    let jobs = v["report"]["jobs"].as_array().expect("jobs");
    let job = |id: &str| jobs.iter().find(|j| j["job_id"] == id);
    assert!(job(&cpu).is_none(), "a job without GPUs is left out");
    let user = String::from_utf8_lossy(&Command::new("id").arg("-un").output().expect("id").stdout)
        .trim()
        .to_owned();
    for (id, gpus, name, requeue_safe, sleep) in [
        (&safe, 2u64, "keel-acct-safe", true, 3u64),
        (&whole, 8, "acct-whole", false, 2),
    ] {
        let j = job(id).unwrap_or_else(|| panic!("job {id} in {v}"));
        let secs = elapsed(id);
        assert!(
            (sleep..sleep + 30).contains(&secs),
            "{id}: ElapsedRaw {secs}"
        );
        #[allow(clippy::cast_precision_loss)]
        let hours = (gpus * secs) as f64 / 3600.0;
        assert_eq!(j["gpus"], gpus, "{j}");
        assert_eq!(j["name"], name);
        assert_eq!(j["user"], user.as_str());
        assert_eq!(j["partition"], "debug");
        assert_eq!(j["state"], "COMPLETED");
        assert!(
            (j["gpu_hours"].as_f64().expect("hours") - hours).abs() < 1e-9,
            "{j}"
        );
        // 16.0 a node-hour of 8 GPUs: 2.0 a GPU-hour; spot 0.5.
        assert!((j["cost"].as_f64().expect("cost") - 2.0 * hours).abs() < 1e-9);
        assert_eq!(j["requeue_safe"], requeue_safe);
        if requeue_safe {
            assert!((j["spot_saving"].as_f64().expect("saving") - 1.5 * hours).abs() < 1e-9);
        } else {
            assert!(j["spot_saving"].is_null());
        }
    }
    assert!(v["report"]["idle"].is_null());

    // The live cluster's slurm.conf, reviewed: its accounting passes the
    // accounting rules.
    let out = keel()
        .args(["--json", "review", "--fail-on", "never"])
        .arg(cluster.conf())
        .output()
        .expect("keel review runs");
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    for id in [
        "KEEL-COST-003",
        "KEEL-COST-004",
        "KEEL-COST-005",
        "KEEL-COST-009",
    ] {
        let status = v["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .find(|r| r["rule"] == id)
            .map(|r| r["status"].clone());
        assert_eq!(status, Some("pass".into()), "{id}");
    }
}

/// `keel run --slurm` adds `keel-run` to its job's Comment, keeping the
/// comment the job was submitted with; with `AccountingStoreFlags=job_comment`
/// the real sacct returns it and keel cost counts the job as requeue-safe,
/// with what spot would have saved, while a plain job beside it is not,
/// unless a name prefix says so.
#[test]
#[ignore = "needs Slurm: scripts/test starts one"]
fn cost_counts_a_job_run_under_keel_run_as_requeue_safe() {
    if let Err(why) = accounting() {
        eprintln!("skipped: the Slurm test cluster runs without accounting: {why}");
        return;
    }
    let cluster = SlurmCluster::get();
    let conf = std::fs::read_to_string(cluster.conf()).expect("slurm.conf");
    assert!(
        conf.lines()
            .any(|l| l.trim() == "AccountingStoreFlags=job_comment"),
        "{} lacks AccountingStoreFlags=job_comment (written by an older scripts/slurm-cluster: run `scripts/slurm-cluster start` again)",
        cluster.conf().display()
    );
    cluster
        .wait_until_idle(Duration::from_secs(30))
        .expect("idle cluster");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let since = utc("-1 minute");

    // One GPU each from n3: a toy trainer of ten 0.1 s steps under keel
    // run, and a plain job of about the same length.
    let trainer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/run/toy_trainer.py");
    std::fs::write(
        d.join("job.sh"),
        format!(
            "#!/bin/bash\nexport TOY_STEPS=10\n\
             exec {keel} run --slurm --check-command true --store file://{d}/store --run toy \
             --ckpt-dir {d}/ckpt --state {d}/keel-run.json -- srun python3 {trainer}\n",
            keel = env!("CARGO_BIN_EXE_keel"),
            d = d.display(),
            trainer = trainer.display(),
        ),
    )
    .expect("write job");
    let supervised = sbatch(
        &cluster,
        d,
        &[
            "-J",
            "acct-supervised",
            // Two lines and a `|`: scontrol and sacct's text print it
            // raw.
            "--comment",
            "team=ml\nproject=x|y",
            "--gres=gpu:1",
            &format!("--output={}/job.out", d.display()),
            "job.sh",
        ],
    );
    let plain = sbatch(
        &cluster,
        d,
        &["-J", "acct-plain", "--gres=gpu:1", "--wrap", "sleep 2"],
    );
    let log = || std::fs::read_to_string(d.join("job.out")).unwrap_or_default();
    let _ = wait_accounted(&cluster, &[supervised.clone(), plain.clone()]);
    let answer = cluster
        .command(
            "sacct",
            &["--json", "-X", "-j", &format!("{supervised},{plain}")],
        )
        .expect("sacct --json");
    let answer: Value = serde_json::from_str(&answer).expect("sacct --json");
    let comment = |id: &str| -> Value {
        answer["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .find(|j| j["job_id"].as_u64().is_some_and(|n| n.to_string() == id))
            .map(|j| j["comment"]["job"].clone())
            .unwrap_or_else(|| panic!("job {id} in {answer}"))
    };
    assert_eq!(
        comment(&supervised),
        "team=ml\nproject=x|y keel-run",
        "the submitted comment is kept whole and marked once\n{}",
        log()
    );
    assert!(
        comment(&plain).as_str().unwrap_or("").is_empty(),
        "{answer}"
    );

    let prices = d.join("prices.toml");
    std::fs::write(
        &prices,
        "source = \"test prices\"\n[[price]]\npartition = \"debug\"\nsku = \"test\"\ngpus_per_node = 8\non_demand = 16.0\nspot = 4.0\n",
    )
    .expect("write");
    let until = utc("+1 minute");
    let prices_arg = prices.display().to_string();
    let cost = |extra: &[&str]| -> Value {
        let mut args = vec![
            "--prices",
            &prices_arg,
            "--since",
            &since,
            "--until",
            &until,
        ];
        args.extend_from_slice(extra);
        cost_listing(&cluster, &args, &[&supervised, &plain])
    };
    let v = cost(&[]);
    let job = |v: &Value, id: &str| -> Value {
        v["report"]["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .find(|j| j["job_id"] == id)
            .unwrap_or_else(|| panic!("job {id} in {v}"))
            .clone()
    };
    let j = job(&v, &supervised);
    assert_eq!(j["name"], "acct-supervised");
    assert_eq!(j["state"], "COMPLETED", "{j}\n{}", log());
    assert_eq!(j["gpus"], 1);
    assert_eq!(
        (&j["requeue_safe"], &j["requeue_safe_by"], &j["marker"]),
        (
            &Value::Bool(true),
            &Value::from("marker"),
            &Value::Bool(true)
        ),
        "{j}"
    );
    let hours = j["gpu_hours"].as_f64().expect("hours");
    assert!(hours > 0.0, "{j}");
    // 16.0 a node-hour of 8 GPUs: 2.0 a GPU-hour on demand, 0.5 on spot.
    assert!(
        (j["spot_saving"].as_f64().expect("saving") - 1.5 * hours).abs() < 1e-9,
        "{j}"
    );
    let p = job(&v, &plain);
    assert_eq!(
        (&p["requeue_safe"], &p["requeue_safe_by"], &p["marker"]),
        (&Value::Bool(false), &Value::Null, &Value::Bool(false)),
        "{p}"
    );
    assert!(p["spot_saving"].is_null(), "{p}");

    // A name prefix makes the plain job requeue-safe too, by its name.
    let v = cost(&["--requeue-safe", "acct-plain"]);
    let p = job(&v, &plain);
    assert_eq!(
        (&p["requeue_safe"], &p["requeue_safe_by"]),
        (&Value::Bool(true), &Value::from("name")),
        "{p}"
    );
    assert_eq!(job(&v, &supervised)["requeue_safe_by"], "marker");
}
