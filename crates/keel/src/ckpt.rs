//! `keel ckpt`: verified, crash-consistent checkpoints on object storage
//! (keel-ckpt over keel-store). This module turns flags into requests,
//! supplies the clock, host name, nonce and storage credentials from the
//! process, draws progress on a terminal, and renders results.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde::Serialize;

use keel_ckpt::watch::{Pace, WatchEvent, Watcher};
use keel_ckpt::{Ckpt, CkptRef, Context, GcPolicy, Order, PushRequest, Selector, TransferSummary};
use keel_store::{Bandwidth, Limiter, Progress, Store, StoreOptions, StoreUrl, TransferOptions};

use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::{self, Table};

#[derive(Debug, Subcommand)]
pub enum CkptCommand {
    /// Upload a checkpoint directory exactly as the framework wrote it and
    /// commit it; it becomes `latest` if it is the newest step.
    Push {
        /// The checkpoint directory (`step-100/`, `iter_0000100/`, ...).
        dir: PathBuf,
        /// Where: file:///path, az://container/prefix, s3://bucket/prefix.
        #[arg(long, value_name = "URL")]
        to: String,
        #[command(flatten)]
        run: RunArg,
        #[arg(long)]
        step: u64,
        /// A metric to record with the checkpoint (for `gc --keep-best`).
        #[arg(long = "metric", value_name = "NAME=VALUE")]
        metrics: Vec<String>,
        #[command(flatten)]
        writer: WriterArg,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Run beside training: push each newly completed checkpoint under DIR
    /// (DCP `.metadata`, Megatron tracker, DeepSpeed `latest`, or --marker).
    Watch {
        dir: PathBuf,
        #[arg(long, value_name = "URL")]
        to: String,
        #[command(flatten)]
        run: RunArg,
        /// A checkpoint directory holding this file is complete.
        #[arg(long, value_name = "NAME")]
        marker: Option<String>,
        /// Seconds between scans.
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        interval: f64,
        /// Scan and push once, then exit.
        #[arg(long)]
        once: bool,
        #[command(flatten)]
        writer: WriterArg,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Print the latest committed checkpoint of a run.
    Latest {
        url: String,
        #[command(flatten)]
        run: RunArg,
    },
    /// List runs, or a run's committed checkpoints.
    Ls {
        url: String,
        #[arg(long)]
        run: Option<String>,
    },
    /// Read every byte of a checkpoint and check it against its manifest.
    Verify {
        url: String,
        #[command(flatten)]
        run: RunArg,
        #[command(flatten)]
        step: StepArg,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Download and verify a checkpoint (default: latest, falling back to
    /// the previous one if it fails verification).
    Pull {
        url: String,
        #[command(flatten)]
        run: RunArg,
        #[command(flatten)]
        step: StepArg,
        /// A new or empty directory.
        #[arg(long, value_name = "DIR")]
        to: PathBuf,
        /// Fail instead of falling back to an older checkpoint.
        #[arg(long)]
        no_fallback: bool,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Delete checkpoints no retention rule keeps (dry run unless --apply)
    /// and data orphaned by crashed pushes.
    Gc {
        url: String,
        #[command(flatten)]
        run: RunArg,
        /// Keep the K newest steps.
        #[arg(long, value_name = "K")]
        keep_last: Option<usize>,
        /// Keep the B best by --by.
        #[arg(long, value_name = "B", requires = "by")]
        keep_best: Option<usize>,
        /// METRIC:min or METRIC:max.
        #[arg(long, value_name = "METRIC:min|max", requires = "keep_best")]
        by: Option<String>,
        /// Keep steps that are multiples of M.
        #[arg(long, value_name = "M")]
        keep_every: Option<u64>,
        /// Leave data of uncommitted pushes younger than this alone
        /// (`30m`, `24h`, `7d`).
        #[arg(long, default_value = "24h", value_name = "DURATION")]
        grace: String,
        /// Delete; without it, only say what would go.
        #[arg(long)]
        apply: bool,
    },
    /// Protect a checkpoint from gc.
    Pin {
        url: String,
        #[command(flatten)]
        run: RunArg,
        #[command(flatten)]
        step: StepArg,
        #[arg(long)]
        reason: String,
    },
    /// Remove a pin (the removal is recorded with its reason).
    Unpin {
        url: String,
        #[command(flatten)]
        run: RunArg,
        #[command(flatten)]
        step: StepArg,
        #[arg(long)]
        reason: String,
    },
    /// Take the run over as this writer (a new job after a requeue):
    /// every older writer is fenced from then on.
    Fence {
        url: String,
        #[command(flatten)]
        run: RunArg,
        #[command(flatten)]
        writer: WriterArg,
    },
}

#[derive(Debug, Args)]
pub struct RunArg {
    /// The training run.
    #[arg(long)]
    run: String,
}

#[derive(Debug, Args)]
pub struct StepArg {
    /// A step number, or `latest`.
    #[arg(long, default_value = "latest", value_name = "N|latest")]
    step: String,
}

#[derive(Debug, Args)]
pub struct WriterArg {
    /// Who writes (default: KEEL_CKPT_WRITER, else slurm-JOBID.RESTARTS
    /// under Slurm, else the host name). A writer superseded by a newer one
    /// is fenced.
    #[arg(long, env = "KEEL_CKPT_WRITER")]
    writer: Option<String>,
}

#[derive(Debug, Args)]
pub struct TransferArgs {
    /// Bandwidth cap shared by all transfers of this process, with units:
    /// `2300Mbit/s` or `2300Mbps` (bits), `280MB/s` or `256MiB/s` (bytes).
    #[arg(long, env = "KEEL_CKPT_CAP", value_name = "RATE")]
    cap: Option<String>,
    /// Files transferred at once.
    #[arg(long, default_value_t = 8, value_name = "N")]
    parallel: usize,
    /// Parts of one file in flight at once.
    #[arg(long, default_value_t = 4, value_name = "N")]
    parts: usize,
    /// Part size in MiB, 1-5120 (multipart uploads, ranged downloads).
    #[arg(long, default_value_t = 8, value_name = "MIB")]
    part_mib: usize,
}

fn parse_step(s: &str) -> anyhow::Result<Selector> {
    if s == "latest" {
        return Ok(Selector::Latest);
    }
    s.parse::<u64>()
        .map(Selector::Step)
        .map_err(|_| UsageError(format!("--step {s:?}: expected a step number or `latest`")).into())
}

fn parse_duration(s: &str) -> anyhow::Result<i64> {
    let bad = || {
        UsageError(format!(
            "{s:?}: expected a duration like 30s, 30m, 24h or 7d"
        ))
    };
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?);
    let too_large = || UsageError(format!("{s:?}: too large (at most {} seconds)", i64::MAX));
    let n: i64 = num.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == std::num::IntErrorKind::PosOverflow {
            too_large()
        } else {
            bad()
        }
    })?;
    let mult: i64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(bad().into()),
    };
    n.checked_mul(mult).ok_or_else(|| too_large().into())
}

fn parse_metrics(ms: &[String]) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for m in ms {
        let (k, v) = m
            .split_once('=')
            .ok_or_else(|| UsageError(format!("--metric {m:?}: expected NAME=VALUE")))?;
        let v: f64 = v
            .trim()
            .parse()
            .ok()
            .filter(|x: &f64| x.is_finite())
            .ok_or_else(|| UsageError(format!("--metric {m:?}: the value is not a number")))?;
        if k.is_empty() {
            return Err(UsageError(format!("--metric {m:?}: empty name")).into());
        }
        out.insert(k.to_owned(), v);
    }
    Ok(out)
}

/// The process's storage credentials, passed to keel-store as data.
fn store_options(create_root: bool) -> StoreOptions {
    StoreOptions {
        create_root,
        env: std::env::vars()
            .filter(|(k, _)| k.starts_with("AZURE_") || k.starts_with("AWS_"))
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn open(url: &str) -> anyhow::Result<Store> {
    let u = StoreUrl::parse(url)?;
    Ok(Store::open(&u, &store_options(false))?)
}

/// Opens a store to write to: a missing `file://` directory is created.
pub(crate) fn open_for_writing(url: &str) -> anyhow::Result<Store> {
    let u = StoreUrl::parse(url)?;
    Ok(Store::open(&u, &store_options(true))?)
}

/// This machine's name, for records of who wrote what.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}

pub(crate) fn context() -> Context {
    use std::hash::{BuildHasher, Hasher};
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    Context {
        now_unix: now.as_secs() as i64,
        host: hostname(),
        nonce: h.finish(),
    }
}

fn writer_name(w: &WriterArg) -> String {
    if let Some(w) = &w.writer {
        return w.clone();
    }
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(job) = var("SLURM_JOB_ID") {
        return format!(
            "slurm-{job}.{}",
            var("SLURM_RESTART_COUNT").unwrap_or("0".into())
        );
    }
    hostname()
}

/// The largest `--part-mib`: 5 GiB, the largest part S3 accepts.
const MAX_PART_MIB: usize = 5120;

fn transfer_options(t: &TransferArgs, limiter: Arc<Limiter>) -> anyhow::Result<TransferOptions> {
    if t.parallel == 0 || t.parts == 0 || t.part_mib == 0 {
        return Err(
            UsageError("--parallel, --parts and --part-mib must be at least 1".into()).into(),
        );
    }
    let part_size = Some(t.part_mib)
        .filter(|&m| m <= MAX_PART_MIB)
        .and_then(|m| m.checked_mul(1 << 20))
        .ok_or_else(|| {
            UsageError(format!(
                "--part-mib {}: at most {MAX_PART_MIB} (5 GiB)",
                t.part_mib
            ))
        })?;
    Ok(TransferOptions {
        files_in_parallel: t.parallel,
        parts_in_flight: t.parts,
        part_size,
        limiter,
        progress: None,
    })
}

fn limiter(t: &TransferArgs) -> anyhow::Result<Arc<Limiter>> {
    Ok(Arc::new(match &t.cap {
        Some(c) => Limiter::new(Bandwidth::parse(c)?),
        None => Limiter::unlimited(),
    }))
}

/// A one-line progress display on stderr, drawn only on a terminal.
struct Bar {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Bar {
    fn start(label: String, total: Option<u64>, json: bool) -> (Self, Option<Progress>) {
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let on_tty = !json && std::io::stderr().is_terminal();
        let progress = {
            let d = done.clone();
            Some(Progress(Arc::new(move |n| {
                d.fetch_add(n, Ordering::Relaxed);
            })))
        };
        let thread = on_tty.then(|| {
            let (d, s) = (done.clone(), stop.clone());
            std::thread::spawn(move || {
                let start = Instant::now();
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(200));
                    let b = d.load(Ordering::Relaxed);
                    let secs = start.elapsed().as_secs_f64().max(1e-3);
                    let rate = b as f64 / secs;
                    let line = match total {
                        Some(t) if t > 0 => {
                            let frac = (b as f64 / t as f64).min(1.0);
                            let width = 24;
                            let filled = (frac * width as f64) as usize;
                            let eta = if rate > 0.0 {
                                format!("{:.0}s", (t.saturating_sub(b)) as f64 / rate)
                            } else {
                                "-".into()
                            };
                            format!(
                                "{label} [{}{}] {} / {}  {}  ETA {eta}",
                                "#".repeat(filled),
                                " ".repeat(width - filled),
                                table::bytes(b),
                                table::bytes(t),
                                rate_text(rate)
                            )
                        }
                        _ => format!("{label} {}  {}", table::bytes(b), rate_text(rate)),
                    };
                    let mut e = std::io::stderr().lock();
                    let _ = write!(e, "\r\x1b[2K{line}");
                    let _ = e.flush();
                }
                let mut e = std::io::stderr().lock();
                let _ = write!(e, "\r\x1b[2K");
                let _ = e.flush();
            })
        });
        (Self { done, stop, thread }, progress)
    }

    fn bytes(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `287.5 MB/s (2.3 Gbit/s)`.
fn rate_text(bytes_per_sec: f64) -> String {
    let mb = bytes_per_sec / 1e6;
    format!("{mb:.1} MB/s ({:.2} Gbit/s)", bytes_per_sec * 8.0 / 1e9)
}

/// `2026-01-02T03:04:05Z` from Unix seconds.
fn utc(t: i64) -> String {
    keel_time::rfc3339_secs(t)
}

fn step_text(c: CkptRef) -> String {
    format!("step {} (epoch {})", c.step, c.epoch)
}

pub fn run(command: &CkptCommand, out: &mut Out) -> anyhow::Result<Code> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(command, out))
}

async fn run_async(command: &CkptCommand, out: &mut Out) -> anyhow::Result<Code> {
    match command {
        CkptCommand::Push {
            dir,
            to,
            run,
            step,
            metrics,
            writer,
            transfer,
        } => {
            let metrics = parse_metrics(metrics)?;
            let store = open_for_writing(to)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let lim = limiter(transfer)?;
            let mut topts = transfer_options(transfer, lim.clone())?;
            let total = keel_ckpt::detect::list_files(dir)
                .ok()
                .map(|f| f.iter().map(|x| x.size).sum());
            let (bar, progress) = Bar::start(format!("push step {step}"), total, out.json);
            topts.progress = progress;
            let req = PushRequest {
                step: *step,
                writer: writer_name(writer),
                metrics,
                ctx: context(),
            };
            let started = Instant::now();
            let r = ck.push(dir, &req, &topts).await;
            let took = started.elapsed();
            drop(bar);
            let r =
                r.with_context(|| format!("cannot push {} to {}", dir.display(), store.url()))?;
            let sum = TransferSummary::new(r.bytes_uploaded, r.files, took, lim.cap());
            if out.json {
                #[derive(Serialize)]
                struct Doc<'a> {
                    url: String,
                    #[serde(flatten)]
                    report: &'a keel_ckpt::PushReport,
                    summary: TransferSummary,
                }
                out.json(
                    "ckpt push",
                    &Doc {
                        url: store.url().to_string(),
                        report: &r,
                        summary: sum,
                    },
                )?;
            } else {
                let what = if r.already_committed {
                    "already committed, uploaded nothing".to_owned()
                } else {
                    format!(
                        "{} in {:.1} s, {}",
                        table::bytes(r.bytes),
                        took.as_secs_f64(),
                        rate_text(sum.throughput_bytes_per_s)
                    )
                };
                let latest = match &r.published {
                    keel_ckpt::Published::Latest { generation } => {
                        format!(
                            "latest -> step {} (generation {generation})",
                            r.checkpoint.step
                        )
                    }
                    keel_ckpt::Published::NotNewer { latest } => {
                        format!("latest stays at {}", latest.map_or("-".into(), step_text))
                    }
                };
                out.text(&format!(
                    "pushed {}/{} {} as writer {}: {} files ({}), {what}\n{latest}\n",
                    store.url(),
                    run.run,
                    step_text(r.checkpoint),
                    r.writer,
                    r.files,
                    r.framework.as_str(),
                ))?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Watch {
            dir,
            to,
            run,
            marker,
            interval,
            once,
            writer,
            transfer,
        } => {
            if !(*interval > 0.0 && interval.is_finite()) {
                return Err(
                    UsageError("--interval must be a positive number of seconds".into()).into(),
                );
            }
            let store = open_for_writing(to)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let lim = limiter(transfer)?;
            let topts = transfer_options(transfer, lim)?;
            let mut w = Watcher::new(ck, dir, marker.clone(), writer_name(writer));
            let pace = if *once {
                Pace::Once
            } else {
                Pace::Every(Duration::from_secs_f64(*interval))
            };
            let mut failed = false;
            let mut rendering = Ok(());
            w.run(pace, context, &topts, |ev| {
                if rendering.is_ok() {
                    rendering = report_watch(&ev, out, &mut failed);
                }
                rendering.is_ok()
            })
            .await
            .with_context(|| format!("watching {}", dir.display()))?;
            rendering?;
            Ok(if failed { Code::Failed } else { Code::Ok })
        }
        CkptCommand::Latest { url, run } => {
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let found = ck.latest_details().await?;
            let latest = found.as_ref().map(|f| f.0);
            let meta = found.and_then(|f| f.1);
            if out.json {
                out.json(
                    "ckpt latest",
                    &serde_json::json!({
                        "url": store.url().to_string(),
                        "run": run.run,
                        "checkpoint": latest,
                        "step": latest.map(|c| c.step),
                        "bytes": meta.as_ref().map(|m| m.bytes),
                        "files": meta.as_ref().map(|m| m.files),
                        "time": meta.as_ref().map(|m| utc(m.meta.time)),
                        "writer": meta.as_ref().map(|m| m.meta.writer.clone()),
                        "metrics": meta.as_ref().map(|m| m.meta.metrics.clone()),
                    }),
                )?;
            } else {
                match (latest, &meta) {
                    (Some(c), Some(d)) => out.text(&format!(
                        "{}\n{} of {}: {} files, {}, written {} by {} on {}\n",
                        c.step,
                        step_text(c),
                        run.run,
                        d.files,
                        table::bytes(d.bytes),
                        utc(d.meta.time),
                        d.meta.writer,
                        d.meta.host
                    ))?,
                    (Some(c), None) => out.text(&format!(
                        "{}\n{}: latest names it but its manifest is gone\n",
                        c.step,
                        step_text(c)
                    ))?,
                    (None, _) => {}
                }
            }
            if latest.is_none() {
                eprintln!(
                    "keel: run {:?} has no checkpoint in {}",
                    run.run,
                    store.url()
                );
                return Ok(Code::Unknown);
            }
            Ok(Code::Ok)
        }
        CkptCommand::Ls { url, run } => {
            let store = open(url)?;
            let Some(run) = run else {
                store.check_access().await?;
                let runs = store.list_dirs("").await?;
                if out.json {
                    out.json(
                        "ckpt ls",
                        &serde_json::json!({"url": store.url().to_string(), "runs": runs}),
                    )?;
                } else {
                    let mut s = String::new();
                    for r in runs {
                        s.push_str(&r);
                        s.push('\n');
                    }
                    out.text(&s)?;
                }
                return Ok(Code::Ok);
            };
            let ck = Ckpt::new(&store, run)?;
            let list = ck.list().await?;
            if out.json {
                out.json(
                    "ckpt ls",
                    &serde_json::json!({"url": store.url().to_string(), "run": run, "checkpoints": list}),
                )?;
            } else {
                let mut t = Table::new(&[
                    "Step",
                    "Epoch",
                    "Writer",
                    "Time",
                    "Files",
                    "Size",
                    "Framework",
                    "Metrics",
                    "Flags",
                ]);
                for c in &list {
                    let mut flags = Vec::new();
                    if c.latest {
                        flags.push("latest".to_owned());
                    }
                    if let Some(r) = &c.pinned {
                        flags.push(format!("pinned ({r})"));
                    }
                    if !c.published {
                        flags.push("unpublished".to_owned());
                    }
                    let metrics: Vec<String> =
                        c.metrics.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    t.row(vec![
                        c.step.to_string(),
                        c.epoch.to_string(),
                        c.writer.clone(),
                        utc(c.time),
                        c.files.to_string(),
                        table::bytes(c.bytes),
                        c.framework.clone(),
                        if metrics.is_empty() {
                            "-".into()
                        } else {
                            metrics.join(",")
                        },
                        if flags.is_empty() {
                            "-".into()
                        } else {
                            flags.join(", ")
                        },
                    ]);
                }
                out.text(&t.render())?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Verify {
            url,
            run,
            step,
            transfer,
        } => {
            let sel = parse_step(&step.step)?;
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let lim = limiter(transfer)?;
            let mut topts = transfer_options(transfer, lim.clone())?;
            let c = ck.resolve(sel).await?[0];
            let total = ck.manifest(c).await?.map(|(m, _)| m.total_bytes());
            let (bar, progress) = Bar::start(format!("verify step {}", c.step), total, out.json);
            topts.progress = progress;
            let started = Instant::now();
            let r = ck.verify_ref(c, &topts).await;
            let took = started.elapsed();
            drop(bar);
            let r = r?;
            let sum = TransferSummary::new(r.bytes, r.files.len(), took, lim.cap());
            if out.json {
                out.json(
                    "ckpt verify",
                    &serde_json::json!({"url": store.url().to_string(), "run": run.run, "checkpoint": r.checkpoint,
                        "ok": r.ok, "files": r.files, "summary": sum}),
                )?;
            } else {
                let bad: Vec<_> = r.files.iter().filter(|f| !f.ok).collect();
                let mut s = String::new();
                for f in &bad {
                    s.push_str(&format!(
                        "FAILED {}: {}\n",
                        f.name,
                        f.error.as_deref().unwrap_or("-")
                    ));
                }
                s.push_str(&format!(
                    "{} of {}: {} of {} files verify ({}, {:.1} s, {})\n",
                    step_text(r.checkpoint),
                    run.run,
                    r.files.len() - bad.len(),
                    r.files.len(),
                    table::bytes(r.bytes),
                    took.as_secs_f64(),
                    rate_text(sum.throughput_bytes_per_s)
                ));
                out.text(&s)?;
            }
            Ok(if r.ok { Code::Ok } else { Code::Failed })
        }
        CkptCommand::Pull {
            url,
            run,
            step,
            to,
            no_fallback,
            transfer,
        } => {
            let sel = parse_step(&step.step)?;
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let lim = limiter(transfer)?;
            let mut topts = transfer_options(transfer, lim.clone())?;
            let (bar, progress) = Bar::start("pull".into(), None, out.json);
            topts.progress = progress;
            let started = Instant::now();
            let r = ck.pull(sel, to, *no_fallback, &context(), &topts).await;
            let took = started.elapsed();
            let moved = bar.bytes();
            drop(bar);
            let r = r.with_context(|| format!("cannot pull from {}", store.url()))?;
            for f in &r.fell_back_from {
                eprintln!(
                    "keel: WARNING: {} of run {} FAILED VERIFICATION and was not used: {}",
                    step_text(f.checkpoint),
                    run.run,
                    f.error
                );
            }
            if !r.fell_back_from.is_empty() {
                eprintln!(
                    "keel: WARNING: fell back to {} of run {}",
                    step_text(r.checkpoint),
                    run.run
                );
            }
            let sum = TransferSummary::new(r.bytes, r.files, took, lim.cap());
            if out.json {
                out.json(
                    "ckpt pull",
                    &serde_json::json!({"url": store.url().to_string(), "run": run.run, "checkpoint": r.checkpoint,
                        "step": r.checkpoint.step, "dir": r.dir, "metrics": r.metrics,
                        "fell_back_from": r.fell_back_from, "bytes_read": moved, "summary": sum}),
                )?;
            } else {
                out.text(&format!(
                    "pulled {} of {} into {}: {} files, {} verified in {:.1} s, {}\n",
                    step_text(r.checkpoint),
                    run.run,
                    r.dir.display(),
                    r.files,
                    table::bytes(r.bytes),
                    took.as_secs_f64(),
                    rate_text(sum.throughput_bytes_per_s)
                ))?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Gc {
            url,
            run,
            keep_last,
            keep_best,
            by,
            keep_every,
            grace,
            apply,
        } => {
            let keep_best = match (keep_best, by) {
                (Some(b), Some(by)) => {
                    let (metric, order) = by.rsplit_once(':').ok_or_else(|| {
                        UsageError(format!("--by {by:?}: expected METRIC:min or METRIC:max"))
                    })?;
                    let order = match order {
                        "min" => Order::Min,
                        "max" => Order::Max,
                        _ => {
                            return Err(UsageError(format!(
                                "--by {by:?}: expected METRIC:min or METRIC:max"
                            ))
                            .into())
                        }
                    };
                    Some((*b, metric.to_owned(), order))
                }
                _ => None,
            };
            if *keep_every == Some(0) {
                return Err(UsageError("--keep-every must be at least 1".into()).into());
            }
            let policy = GcPolicy {
                keep_last: *keep_last,
                keep_best,
                keep_every: *keep_every,
                grace_secs: parse_duration(grace)?,
            };
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let r = ck.gc(&policy, *apply, &context()).await?;
            if out.json {
                out.json(
                    "ckpt gc",
                    &serde_json::json!({"url": store.url().to_string(), "run": run.run, "gc": r}),
                )?;
            } else {
                let mut t = Table::new(&["Step", "Epoch", "Action", "Why"]);
                for k in &r.kept {
                    t.row(vec![
                        k.checkpoint.step.to_string(),
                        k.checkpoint.epoch.to_string(),
                        "keep".into(),
                        k.reasons.join(", "),
                    ]);
                }
                for d in &r.deleted {
                    t.row(vec![
                        d.checkpoint.step.to_string(),
                        d.checkpoint.epoch.to_string(),
                        if *apply { "deleted" } else { "would delete" }.into(),
                        format!("no rule keeps it ({})", table::bytes(d.bytes)),
                    ]);
                }
                let mut s = t.render();
                for o in &r.orphans {
                    s.push_str(&format!(
                        "orphaned data {} ({} objects, {}): {}\n",
                        o.prefix,
                        o.objects,
                        table::bytes(o.bytes),
                        if o.in_grace {
                            "younger than the grace period, left alone"
                        } else if *apply {
                            "deleted"
                        } else {
                            "would delete"
                        }
                    ));
                }
                s.push_str(&if *apply {
                    format!("freed {}\n", table::bytes(r.bytes_freed))
                } else {
                    format!(
                        "dry run: would free {}; rerun with --apply to delete\n",
                        table::bytes(r.bytes_freed)
                    )
                });
                out.text(&s)?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Pin {
            url,
            run,
            step,
            reason,
        } => {
            let sel = parse_step(&step.step)?;
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let p = ck.pin(sel, reason, &context()).await?;
            if out.json {
                out.json("ckpt pin", &serde_json::json!({"run": run.run, "pin": p}))?;
            } else {
                out.text(&format!(
                    "pinned {}: {}\n",
                    step_text(p.checkpoint),
                    p.reason
                ))?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Unpin {
            url,
            run,
            step,
            reason,
        } => {
            let sel = parse_step(&step.step)?;
            let store = open(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let u = ck.unpin(sel, reason, &context()).await?;
            if out.json {
                out.json(
                    "ckpt unpin",
                    &serde_json::json!({"run": run.run, "checkpoint": u.checkpoint, "unpin": u}),
                )?;
            } else {
                out.text(&format!(
                    "unpinned {}: {} (was pinned: {})\n",
                    step_text(u.checkpoint),
                    u.reason,
                    u.pin.reason
                ))?;
            }
            Ok(Code::Ok)
        }
        CkptCommand::Fence { url, run, writer } => {
            let store = open_for_writing(url)?;
            let ck = Ckpt::new(&store, &run.run)?;
            let w = ck.acquire(&writer_name(writer), &context()).await?;
            let latest = ck.latest().await?;
            if out.json {
                out.json(
                    "ckpt fence",
                    &serde_json::json!({"run": run.run, "writer": w.writer, "epoch": w.epoch, "latest": latest}),
                )?;
            } else {
                out.text(&format!(
                    "writer {} holds epoch {} of {}; latest is {}\n",
                    w.writer,
                    w.epoch,
                    run.run,
                    latest.map_or("none".into(), step_text)
                ))?;
            }
            Ok(Code::Ok)
        }
    }
}

fn report_watch(ev: &WatchEvent, out: &mut Out, failed: &mut bool) -> anyhow::Result<()> {
    match ev {
        WatchEvent::Pushed { dir, report } => {
            if out.json {
                out.json(
                    "ckpt watch",
                    &serde_json::json!({"event": "pushed", "dir": dir, "report": report}),
                )?;
            } else {
                out.text(&format!(
                    "pushed {} as {}: {} files, {}\n",
                    dir.display(),
                    step_text(report.checkpoint),
                    report.files,
                    table::bytes(report.bytes)
                ))?;
            }
        }
        WatchEvent::Skipped { dir, step } => {
            if out.json {
                out.json(
                    "ckpt watch",
                    &serde_json::json!({"event": "skipped", "dir": dir, "step": step}),
                )?;
            } else {
                out.text(&format!(
                    "skipped {}: step {step} is already committed\n",
                    dir.display()
                ))?;
            }
        }
        WatchEvent::Failed { dir, step, error } => {
            *failed = true;
            let msg = format!("{:#}", anyhow::Error::msg(error.to_string()));
            eprintln!(
                "keel: push of {} (step {step}) failed, will retry: {msg}",
                dir.display()
            );
            if out.json {
                out.json(
                    "ckpt watch",
                    &serde_json::json!({"event": "failed", "dir": dir, "step": step, "error": msg}),
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn flags() {
        assert_eq!(parse_step("latest").expect("latest"), Selector::Latest);
        assert_eq!(parse_step("12").expect("12"), Selector::Step(12));
        assert!(parse_step("-1").is_err());
        assert_eq!(parse_duration("24h").expect("h"), 86400);
        assert_eq!(parse_duration("30m").expect("m"), 1800);
        assert!(parse_duration("24").is_err());
        let m = parse_metrics(&["loss=0.5".into(), "acc=1e-3".into()]).expect("metrics");
        assert_eq!(m["loss"], 0.5);
        assert!(parse_metrics(&["loss".into()]).is_err());
        assert!(parse_metrics(&["loss=nan".into()]).is_err());
    }

    #[test]
    fn durations_that_do_not_fit_are_refused() {
        assert_eq!(parse_duration("0s").expect("0"), 0);
        assert_eq!(parse_duration("7d").expect("7d"), 7 * 86400);
        assert_eq!(
            parse_duration("106751991167300d").expect("largest day count"),
            106_751_991_167_300 * 86400
        );
        assert_eq!(
            parse_duration("9223372036854775807s").expect("i64::MAX seconds"),
            i64::MAX
        );
        for s in [
            "106751991167301d",
            "9223372036854775807m",
            "153722867280912931h",
        ] {
            let e = parse_duration(s).expect_err(s);
            assert!(e.downcast_ref::<UsageError>().is_some(), "{s}: {e}");
            assert!(e.to_string().contains("too large"), "{s}: {e}");
            assert!(e.to_string().contains(s), "{s}: {e}");
        }
        let e = parse_duration("99999999999999999999s").expect_err("beyond i64");
        assert!(e.to_string().contains("too large"), "{e}");
        assert!(parse_duration("").is_err());
        assert!(parse_duration("d").is_err());
        assert!(parse_duration("\u{20ac}").is_err());
    }

    fn transfer(part_mib: usize) -> TransferArgs {
        TransferArgs {
            cap: None,
            parallel: 8,
            parts: 4,
            part_mib,
        }
    }

    #[test]
    fn part_sizes_are_bounded() {
        let lim = || Arc::new(Limiter::unlimited());
        let t = transfer_options(&transfer(8), lim()).expect("default");
        assert_eq!(t.part_size, 8 << 20);
        let t = transfer_options(&transfer(MAX_PART_MIB), lim()).expect("largest");
        assert_eq!(t.part_size, MAX_PART_MIB << 20);
        for mib in [0, MAX_PART_MIB + 1, 1 << 44, usize::MAX] {
            let e = transfer_options(&transfer(mib), lim()).expect_err("out of range");
            assert!(e.downcast_ref::<UsageError>().is_some(), "{mib}: {e}");
            assert!(e.to_string().contains("--part-mib"), "{mib}: {e}");
        }
    }
}
