//! `keel cost`: GPU-hours by job, user and partition from Slurm
//! accounting, priced by a user's table; `keel cost idle` is in
//! `cost_idle.rs`.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use keel_review::cost::{
    add_idle, cost, drop_repeated, join_sacct_json, parse_sacct, parse_sacct_json, parse_time,
    CostOptions, IdleJob, PriceTable, SACCT_FORMAT,
};
use serde_json::json;

use crate::exit::{Code, DataError, UsageError};

/// The largest `sacct` output `keel cost` reads, recorded (`--sacct-file`,
/// `--sacct-json`) or live: a year of a busy cluster's `-P` rows is some
/// tens of megabytes, its `--json` some hundreds.
const MAX_SACCT_BYTES: u64 = 1024 * 1024 * 1024;
use crate::output::Out;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Text,
    Json,
    Csv,
}

#[derive(Debug, Args)]
pub struct CostArgs {
    #[command(subcommand)]
    command: Option<crate::cost_idle::CostCommand>,
    /// The price table (TOML: currency, source, [[price]] partition, sku,
    /// gpus_per_node, on_demand, spot; docs/review.md).
    /// Needed unless a subcommand (`idle`) is given.
    #[arg(long, value_name = "FILE")]
    prices: Option<PathBuf>,
    /// Read recorded `sacct -a -X -P -n --noconvert
    /// --format=JobID,JobName,User,Account,Partition,AllocTRES,ElapsedRaw,State,Start,End`
    /// output instead of running sacct. It carries no comments: without
    /// --sacct-json every job's keel-run marker is unknown.
    #[arg(long, value_name = "FILE")]
    sacct_file: Option<PathBuf>,
    /// With --sacct-file: the same period's recorded `sacct --json -a -X`
    /// output, for each job's comment (the keel-run marker) and to confirm
    /// each row's job id and name.
    #[arg(long, value_name = "FILE", requires = "sacct_file")]
    sacct_json: Option<PathBuf>,
    /// Start of the period (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS, UTC: sacct
    /// runs with TZ=UTC); allocations are clipped to it. Default: midnight
    /// UTC today.
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// End of the period (exclusive, UTC). Default: now.
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
    /// Jobs whose name starts with PREFIX are requeue-safe (they
    /// checkpoint and are requeued on failure): the report says what
    /// running them on spot would have saved. Repeatable. Jobs that ran
    /// under `keel run --slurm` (`keel-run` in their Comment) are
    /// requeue-safe without it.
    #[arg(long = "requeue-safe", value_name = "PREFIX")]
    requeue_safe: Vec<String>,
    /// Output format (`--json` is `--format json`).
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Seconds sacct may take.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    sacct_timeout: u64,
    /// Idle GPU-hours of the period from a Prometheus server that scrapes
    /// keel exporters (http://HOST:PORT; else `cost.prometheus`).
    #[arg(long, value_name = "URL", conflicts_with = "exporter")]
    prometheus: Option<String>,
    /// Idle GPU-hours from one keel exporter's own accounting, since it
    /// started (http://HOST:PORT; else `cost.exporter`).
    #[arg(long, value_name = "URL")]
    exporter: Option<String>,
    /// A file holding the bearer token for --exporter (else
    /// `cost.exporter_token_file`, else KEEL_EXPORTER_TOKEN).
    #[arg(long, value_name = "FILE")]
    exporter_token_file: Option<PathBuf>,
    /// Seconds each request for idle GPU-hours may take.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    idle_timeout_s: f64,
}

/// Where idle GPU-hours come from.
enum IdleSource {
    Prometheus(String),
    Exporter { url: String, token: Option<String> },
}

/// The period's idle rows from `source`: Prometheus answers for the
/// period (`increase` over it, evaluated at its end); an exporter for its
/// own lifetime.
fn read_idle(
    source: &IdleSource,
    since: i64,
    until: i64,
    timeout: Duration,
) -> anyhow::Result<(String, Vec<IdleJob>)> {
    use keel_exporter::cost as ec;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (label, rows) = rt.block_on(async {
        match source {
            IdleSource::Prometheus(p) => {
                let base = p.trim_end_matches('/');
                let range = format!("{}s", (until - since).max(1));
                let mut bodies = Vec::new();
                for q in ec::prometheus_queries(&range) {
                    let url = format!("{base}/api/v1/query?query={}&time={until}", ec::encode(&q));
                    bodies.push(ec::http_get(&url, None, timeout).await?);
                }
                let rows = ec::from_prometheus(base, &bodies[0], &bodies[1], &bodies[2])?;
                // An empty answer is no keel exporter scraped, not 0.
                if rows.is_empty() {
                    anyhow::bail!("no keel series at {base} over the period");
                }
                anyhow::Ok((
                    format!(
                        "prometheus {base} over {}..{} UTC",
                        keel_time::date_time(since),
                        keel_time::date_time(until)
                    ),
                    rows,
                ))
            }
            IdleSource::Exporter { url, token } => {
                let base = url.trim_end_matches('/');
                let text =
                    ec::http_get(&format!("{base}/metrics"), token.as_deref(), timeout).await?;
                let rows = ec::from_exposition(&text);
                // No keel_job_gpu_* series: not a keel exporter, or one
                // without job accounting; unknown, not 0.
                if rows.is_empty() {
                    anyhow::bail!("no keel series at {base}/metrics");
                }
                anyhow::Ok((format!("exporter {base}, since it started"), rows))
            }
        }
    })?;
    Ok((
        label,
        rows.into_iter()
            .map(|r| IdleJob {
                job_id: r.job,
                user: r.user,
                partition: r.partition,
                idle_gpu_hours: r.idle_gpu_hours,
            })
            .collect(),
    ))
}

/// The idle source from the flags, else `[cost]` of the config file.
fn idle_source(args: &CostArgs) -> anyhow::Result<Option<IdleSource>> {
    let env = |k: &str| std::env::var(k).ok();
    let file = crate::config::load_cost(None, &env)?;
    let check_url = |flag: &str, url: &str| -> anyhow::Result<()> {
        if url.starts_with("http://") && url.len() > "http://".len() {
            Ok(())
        } else {
            Err(UsageError(format!(
                "{flag}: expected http://HOST:PORT, not {:?}",
                url.chars().take(64).collect::<String>()
            ))
            .into())
        }
    };
    let (prometheus, exporter) = match (&args.prometheus, &args.exporter) {
        (None, None) => (file.prometheus, file.exporter),
        (p, e) => (p.clone(), e.clone()),
    };
    if let Some(p) = prometheus {
        check_url("--prometheus", &p)?;
        return Ok(Some(IdleSource::Prometheus(p)));
    }
    let Some(url) = exporter else {
        return Ok(None);
    };
    check_url("--exporter", &url)?;
    let token_file = args
        .exporter_token_file
        .clone()
        .or(file.exporter_token_file);
    let token = match token_file {
        Some(f) => Some(
            keel_fs::read_regular_to_string(&f, keel_fs::MAX_CONFIG_BYTES)
                .with_context(|| format!("cannot read the token file {}", f.display()))?
                .trim()
                .to_owned(),
        ),
        None => env("KEEL_EXPORTER_TOKEN"),
    };
    Ok(Some(IdleSource::Exporter { url, token }))
}

/// Now, in seconds since the epoch.
fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn time_arg(flag: &str, s: &str) -> anyhow::Result<i64> {
    let full = if s.len() == 10 {
        format!("{s}T00:00:00")
    } else {
        s.to_owned()
    };
    parse_time(&full).ok_or_else(|| {
        UsageError(format!(
            "{flag}: expected YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS"
        ))
        .into()
    })
}

/// `sacct`'s rows as text (`json` false) or its `--json` answer, for the
/// same jobs: `-a -X` and the period.
fn run_sacct(args: &CostArgs, json: bool) -> anyhow::Result<String> {
    let mut cmd = Command::new("sacct");
    // Start and End as YYYY-MM-DDTHH:MM:SS whatever the caller's setting,
    // and in UTC, as -S and -E are read: the period of the rows (by
    // default from midnight today) is the idle GPU-hours' period.
    cmd.env("SLURM_TIME_FORMAT", "standard").env("TZ", "UTC");
    if json {
        cmd.args(["--json", "-a", "-X"]);
    } else {
        cmd.args(["-a", "-X", "-P", "-n", "--noconvert"])
            .arg(format!("--format={SACCT_FORMAT}"));
    }
    if let Some(s) = &args.since {
        cmd.arg("-S").arg(s);
    }
    if let Some(u) = &args.until {
        cmd.arg("-E").arg(u);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context(
            "cannot run sacct (is Slurm's client installed? --sacct-file reads recorded output)",
        )?;
    let mut stdout = child.stdout.take().context("sacct stdout")?;
    let mut stderr = child.stderr.take().context("sacct stderr")?;
    // sacct's answer is bounded like a recorded one: past the bound the
    // rest is drained unread and the run is an error.
    let reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        (&mut stdout)
            .take(MAX_SACCT_BYTES + 1)
            .read_to_end(&mut bytes)?;
        if bytes.len() as u64 > MAX_SACCT_BYTES {
            let _ = std::io::copy(&mut stdout, &mut std::io::sink());
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("sacct printed more than {} MiB", MAX_SACCT_BYTES >> 20),
            ));
        }
        String::from_utf8(bytes)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
    });
    let err_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = (&mut stderr).take(64 * 1024).read_to_end(&mut bytes);
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let deadline = Instant::now() + Duration::from_secs(args.sacct_timeout);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("sacct did not finish within {} s", args.sacct_timeout);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = reader
        .join()
        .map_err(|_| anyhow::anyhow!("sacct reader failed"))?
        .context("cannot read sacct's output")?;
    let err = err_reader.join().unwrap_or_default();
    if !status.success() {
        let first = err
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(256)
            .collect::<String>();
        anyhow::bail!("sacct failed ({status}): {first}");
    }
    Ok(text)
}

pub fn run(json_flag: bool, args: &CostArgs, out: &mut Out) -> anyhow::Result<Code> {
    if let Some(command) = &args.command {
        return crate::cost_idle::run(command, out, json_flag);
    }
    let format = if json_flag { Format::Json } else { args.format };
    let opts = CostOptions {
        since: args
            .since
            .as_deref()
            .map(|s| time_arg("--since", s))
            .transpose()?,
        until: args
            .until
            .as_deref()
            .map(|s| time_arg("--until", s))
            .transpose()?,
        requeue_safe_prefixes: args.requeue_safe.clone(),
    };
    let Some(prices_file) = &args.prices else {
        return Err(UsageError(
            "keel cost needs --prices FILE (a price table: docs/review.md), or a subcommand: keel cost idle"
                .into(),
        )
        .into());
    };
    let price_text = keel_fs::read_regular_to_string(prices_file, keel_fs::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read {}", prices_file.display()))?;
    let prices = PriceTable::parse(&price_text)
        .map_err(|e| DataError(format!("{}: {e}", prices_file.display())))?;
    crate::config::check_seconds("--idle-timeout-s", args.idle_timeout_s)?;
    let idle_from = idle_source(args)?;
    let (file, text) = match &args.sacct_file {
        Some(p) => (
            p.display().to_string(),
            keel_fs::read_regular_to_string(p, MAX_SACCT_BYTES)
                .with_context(|| format!("cannot read {}", p.display()))?,
        ),
        None => ("sacct".to_owned(), run_sacct(args, false)?),
    };
    let (jobs, mut diags) = parse_sacct(&file, &text);
    // The comments (keel run's marker) come from sacct --json, never from
    // the text, where sacct prints them raw.
    let json = match (&args.sacct_file, &args.sacct_json) {
        (Some(_), None) => None,
        (Some(_), Some(p)) => {
            let text = keel_fs::read_regular_to_string(p, MAX_SACCT_BYTES)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Some((
                p.display().to_string(),
                parse_sacct_json(&text).map_err(|e| {
                    DataError(format!("{}: not sacct --json output: {e}", p.display()))
                })?,
            ))
        }
        (None, _) => match run_sacct(args, true).and_then(|t| {
            parse_sacct_json(&t).map_err(|e| anyhow::anyhow!("unreadable answer: {e}"))
        }) {
            Ok(m) => Some(("sacct --json".to_owned(), m)),
            Err(e) => {
                eprintln!(
                    "keel: warning: sacct --json: {e:#}: every job's keel-run marker is unknown (--requeue-safe prefixes still apply)"
                );
                None
            }
        },
    };
    let jobs = match &json {
        Some((jfile, map)) => {
            let (jobs, more) = join_sacct_json(jfile, jobs, map);
            diags.extend(more);
            jobs
        }
        None => jobs,
    };
    let (jobs, more) = drop_repeated(&file, jobs);
    diags.extend(more);
    for d in &diags {
        if d.location.line == 0 {
            eprintln!("keel: warning: {}: {}", d.location.file, d.message);
        } else {
            eprintln!(
                "keel: warning: {}:{}: {}",
                d.location.file, d.location.line, d.message
            );
        }
    }
    if jobs.is_empty() && !diags.is_empty() {
        return Err(DataError(format!("{file}: no sacct row could be read")).into());
    }
    let mut report = cost(&jobs, &prices, &opts);
    if let Some(source) = &idle_from {
        // sacct's default period (TZ=UTC): from midnight UTC today to now.
        let until = opts.until.unwrap_or_else(now);
        let since = opts.since.unwrap_or(until - until.rem_euclid(86_400));
        let timeout = Duration::from_secs_f64(args.idle_timeout_s);
        match read_idle(source, since, until, timeout) {
            Ok((label, rows)) => add_idle(&mut report, label, &rows, &jobs, &prices),
            Err(e) => {
                let why = format!("{e:#}");
                eprintln!("keel: warning: idle GPU-hours unknown: {why}");
                report.idle_unknown = Some(why);
            }
        }
    }
    match format {
        Format::Text => out.text(&report.text())?,
        Format::Csv => out.text(&report.csv())?,
        Format::Json => out.json("cost", &json!({ "report": report, "skipped_lines": diags }))?,
    }
    Ok(Code::Ok)
}
