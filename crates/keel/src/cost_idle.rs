//! `keel cost idle`: idle GPU-hours by job, user and partition, from a
//! Prometheus server that scrapes keel exporters or from one exporter's
//! own accounting; optionally cancels the jobs the idle policy marks idle
//! (a dry run unless `--execute`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use keel_exporter::cost::{self, IdleRow};
use serde::Serialize;

use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::Table;

#[derive(Debug, Subcommand)]
pub enum CostCommand {
    /// Idle GPU-hours by job, user and partition (keel_job_gpu_* metrics).
    Idle(IdleArgs),
}

#[derive(Debug, Args)]
pub struct IdleArgs {
    /// A Prometheus server that scrapes keel exporters (http://HOST:PORT).
    #[arg(
        long,
        value_name = "URL",
        conflicts_with = "exporter",
        required_unless_present = "exporter"
    )]
    prometheus: Option<String>,
    /// One keel exporter (http://HOST:PORT): its own accounting since it
    /// started.
    #[arg(long, value_name = "URL")]
    exporter: Option<String>,
    /// With --prometheus: the window, as a Prometheus duration.
    #[arg(long, default_value = "24h", value_name = "DURATION")]
    range: String,
    /// A file holding the bearer token for --exporter (else
    /// KEEL_EXPORTER_TOKEN).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Leave out jobs with fewer idle GPU-hours than this.
    #[arg(long, default_value_t = 0.0, value_name = "HOURS")]
    min_idle_hours: f64,
    /// List the jobs the idle policy marks idle now, to be cancelled
    /// (`scancel`); nothing is cancelled without --execute.
    #[arg(long)]
    cancel: bool,
    /// With --cancel: run scancel.
    #[arg(long, requires = "cancel")]
    execute: bool,
    /// Seconds each HTTP request may take.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    timeout_s: f64,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    source: &'a str,
    jobs: &'a [IdleRow],
    idle_gpu_hours_by_user: BTreeMap<&'a str, f64>,
    idle_gpu_hours_by_partition: BTreeMap<&'a str, f64>,
    cancel: Vec<Cancel>,
}

#[derive(Debug, Serialize)]
struct Cancel {
    job: String,
    /// `dry-run`, `cancelled`, or the error.
    result: String,
}

fn valid_range(r: &str) -> bool {
    let (n, unit) = r.split_at(r.len().saturating_sub(1));
    !n.is_empty()
        && n.len() <= 6
        && n.bytes().all(|b| b.is_ascii_digit())
        && matches!(unit, "s" | "m" | "h" | "d" | "w")
}

pub fn run(command: &CostCommand, out: &mut Out, json: bool) -> anyhow::Result<Code> {
    let CostCommand::Idle(a) = command;
    crate::config::check_seconds("--timeout-s", a.timeout_s)?;
    if !valid_range(&a.range) {
        return Err(UsageError(format!(
            "--range {:?} is not a duration such as 24h or 7d",
            a.range.chars().take(20).collect::<String>()
        ))
        .into());
    }
    let timeout = Duration::from_secs_f64(a.timeout_s);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (source, mut rows) = rt.block_on(async {
        if let Some(p) = &a.prometheus {
            let base = p.trim_end_matches('/');
            let mut bodies = Vec::new();
            for q in cost::prometheus_queries(&a.range) {
                let url = format!("{base}/api/v1/query?query={}", cost::encode(&q));
                bodies.push(cost::http_get(&url, None, timeout).await?);
            }
            let rows = cost::from_prometheus(base, &bodies[0], &bodies[1], &bodies[2])?;
            anyhow::Ok((format!("prometheus {base} over {}", a.range), rows))
        } else {
            let base = a
                .exporter
                .as_deref()
                .unwrap_or_default()
                .trim_end_matches('/');
            let token = match &a.token_file {
                Some(f) => Some(
                    keel_fs::read_regular_to_string(f, keel_fs::MAX_CONFIG_BYTES)
                        .with_context(|| format!("cannot read the token file {}", f.display()))?
                        .trim()
                        .to_owned(),
                ),
                None => std::env::var("KEEL_EXPORTER_TOKEN").ok(),
            };
            let text =
                cost::http_get(&format!("{base}/metrics"), token.as_deref(), timeout).await?;
            anyhow::Ok((format!("exporter {base}"), cost::from_exposition(&text)))
        }
    })?;
    rows.retain(|r| r.idle_gpu_hours >= a.min_idle_hours);

    let mut cancel = Vec::new();
    if a.cancel {
        let slurm = keel_slurm::Slurm::new(keel_slurm::SlurmConfig {
            bin_dir: None,
            timeout: Duration::from_secs(10),
            env: Vec::new(),
        });
        for r in rows.iter().filter(|r| r.idle_now) {
            let result = if a.execute {
                match slurm.cancel(&r.job) {
                    Ok(()) => "cancelled".to_owned(),
                    Err(e) => format!("error: {e}"),
                }
            } else {
                "dry-run".to_owned()
            };
            cancel.push(Cancel {
                job: r.job.clone(),
                result,
            });
        }
    }
    let mut by_user: BTreeMap<&str, f64> = BTreeMap::new();
    let mut by_partition: BTreeMap<&str, f64> = BTreeMap::new();
    for r in &rows {
        *by_user
            .entry(if r.user.is_empty() { "-" } else { &r.user })
            .or_default() += r.idle_gpu_hours;
        *by_partition
            .entry(if r.partition.is_empty() {
                "-"
            } else {
                &r.partition
            })
            .or_default() += r.idle_gpu_hours;
    }
    let failed = cancel.iter().any(|c| c.result.starts_with("error"));
    if json {
        out.json(
            "cost idle",
            &Report {
                source: &source,
                jobs: &rows,
                idle_gpu_hours_by_user: by_user,
                idle_gpu_hours_by_partition: by_partition,
                cancel,
            },
        )?;
    } else {
        let mut t = Table::new(&[
            "JOB",
            "USER",
            "PARTITION",
            "IDLE GPU-H",
            "OBSERVED GPU-H",
            "IDLE NOW",
        ]);
        let dash = |s: &str| {
            if s.is_empty() {
                "-".to_owned()
            } else {
                s.to_owned()
            }
        };
        for r in &rows {
            t.row(vec![
                r.job.clone(),
                dash(&r.user),
                dash(&r.partition),
                format!("{:.2}", r.idle_gpu_hours),
                format!("{:.2}", r.observed_gpu_hours),
                if r.idle_now {
                    "yes".into()
                } else {
                    "no".into()
                },
            ]);
        }
        let mut s = format!("idle GPU-hours from {source}\n\n{}", t.render());
        let mut u = Table::new(&["USER", "IDLE GPU-H"]);
        for (k, v) in &by_user {
            u.row(vec![(*k).to_owned(), format!("{v:.2}")]);
        }
        let mut p = Table::new(&["PARTITION", "IDLE GPU-H"]);
        for (k, v) in &by_partition {
            p.row(vec![(*k).to_owned(), format!("{v:.2}")]);
        }
        s.push_str(&format!("\n{}\n{}", u.render(), p.render()));
        for c in &cancel {
            s.push_str(&match c.result.as_str() {
                "dry-run" => format!(
                    "would run: scancel {} (dry run; --execute cancels)\n",
                    c.job
                ),
                r => format!("scancel {}: {r}\n", c.job),
            });
        }
        out.text(&s)?;
    }
    Ok(if failed { Code::Failed } else { Code::Ok })
}
