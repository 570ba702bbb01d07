//! `keel cost`: GPU-hours by job, user and partition from Slurm
//! accounting, priced by a user's table; `keel cost idle` is in
//! `cost_idle.rs`.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use keel_review::cost::{cost, parse_sacct, parse_time, CostOptions, PriceTable, SACCT_FORMAT};
use serde_json::json;

use crate::exit::{Code, DataError, UsageError};
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
    /// output instead of running sacct.
    #[arg(long, value_name = "FILE")]
    sacct_file: Option<PathBuf>,
    /// Start of the period (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS, the
    /// cluster's time); allocations are clipped to it.
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// End of the period (exclusive).
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
    /// Jobs whose name starts with PREFIX are requeue-safe (they
    /// checkpoint and are requeued on failure): the report says what
    /// running them on spot would have saved. Repeatable.
    #[arg(long = "requeue-safe", value_name = "PREFIX")]
    requeue_safe: Vec<String>,
    /// Output format (`--json` is `--format json`).
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Seconds sacct may take.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    sacct_timeout: u64,
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

fn run_sacct(args: &CostArgs) -> anyhow::Result<String> {
    let mut cmd = Command::new("sacct");
    // Start and End as YYYY-MM-DDTHH:MM:SS whatever the caller's setting.
    cmd.env("SLURM_TIME_FORMAT", "standard")
        .args(["-a", "-X", "-P", "-n", "--noconvert"])
        .arg(format!("--format={SACCT_FORMAT}"));
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
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let r = stdout.read_to_string(&mut s);
        r.map(|_| s)
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
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
    let price_text = std::fs::read_to_string(prices_file)
        .with_context(|| format!("cannot read {}", prices_file.display()))?;
    let prices = PriceTable::parse(&price_text)
        .map_err(|e| DataError(format!("{}: {e}", prices_file.display())))?;
    let (file, text) = match &args.sacct_file {
        Some(p) => (
            p.display().to_string(),
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
        ),
        None => ("sacct".to_owned(), run_sacct(args)?),
    };
    let (jobs, diags) = parse_sacct(&file, &text);
    for d in &diags {
        eprintln!(
            "keel: warning: {}:{}: {}",
            d.location.file, d.location.line, d.message
        );
    }
    if jobs.is_empty() && !diags.is_empty() {
        return Err(DataError(format!("{file}: no sacct row could be read")).into());
    }
    let report = cost(&jobs, &prices, &opts);
    match format {
        Format::Text => out.text(&report.text())?,
        Format::Csv => out.text(&report.csv())?,
        Format::Json => out.json("cost", &json!({ "report": report, "skipped_lines": diags }))?,
    }
    Ok(Code::Ok)
}
