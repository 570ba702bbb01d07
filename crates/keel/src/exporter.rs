//! `keel exporter`: serves GPU and node metrics for Prometheus (the
//! keel-exporter library); this file turns flags and config into its
//! options, binds the listener and waits for SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use keel_exporter::server::{Auth, ServeOptions};
use keel_exporter::{Exporter, ExporterOptions, IdlePolicy, Naming, SystemClock};
use keel_gpu::GpuProbe;

use crate::config::{self, ExporterConfig};
use crate::exit::Code;
use crate::output::Out;
use crate::Cli;

#[derive(Debug, Args)]
pub struct ExporterArgs {
    /// Config file (default: KEEL_CONFIG, else ~/.config/keel/keel.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to serve /metrics on [default: 127.0.0.1:9400].
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<SocketAddr>,
    /// SHA-256 (hex) of the bearer token scrapers must send
    /// (`keel serve token` makes one).
    #[arg(long, value_name = "HEX")]
    token_sha256: Option<String>,
    /// Serve without authentication: only on a trusted scrape network.
    #[arg(long)]
    no_auth: bool,
    /// Replay recorded GPU snapshots (`keel check record`) instead of
    /// reading NVML, each for --replay-step seconds, the last from then on.
    #[arg(long = "gpu-snapshot", value_name = "FILE")]
    gpu_snapshots: Vec<PathBuf>,
    /// Seconds each replayed snapshot is shown.
    #[arg(long, value_name = "SECONDS")]
    replay_step_s: Option<f64>,
    /// The NVML library to load.
    #[arg(long, value_name = "PATH")]
    nvml_library: Option<PathBuf>,
    /// How long a scrape waits for the GPUs before it shows the last good
    /// readings, marked stale.
    #[arg(long, value_name = "SECONDS")]
    deadline_s: Option<f64>,
    /// keel check's Prometheus textfile, passed through.
    #[arg(long, value_name = "FILE")]
    check_textfile: Option<PathBuf>,
    /// dcgm-exporter's job-mapping directory (a file per GPU index holding
    /// job ids).
    #[arg(long, value_name = "DIR")]
    job_mapping_dir: Option<PathBuf>,
    /// Also attribute GPUs to the jobs of processes holding their device
    /// files open; `{}` stands for the GPU's device minor (`/dev/nvidia{}`).
    #[arg(long, value_name = "PATTERN")]
    device_file_pattern: Option<String>,
    /// What the GPU ids in the job-mapping directory are: `minor` (Slurm's
    /// ids under gres.conf File=/dev/nvidiaN lines, as CycleCloud writes
    /// them) or `index` (NVML indices; Slurm with AutoDetect=nvml).
    #[arg(long, value_name = "minor|index")]
    slurm_gpu_ids: Option<String>,
    /// The node's SKU profile: its GPU count is exposed as
    /// keel_gpu_devices_expected [default: Azure IMDS's vmSize].
    #[arg(long, value_name = "SKU")]
    sku: Option<String>,
    /// The GPUs this node must have (overrides the profile's count).
    #[arg(long, value_name = "N")]
    gpus: Option<u32>,
    /// Do not look up the Slurm jobs of the GPUs' processes.
    #[arg(long)]
    no_process_jobs: bool,
    /// Expose dcgm-exporter's metric names and labels instead of keel's.
    #[arg(long)]
    dcgm_names: bool,
    /// Most connections served at once.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Idle accounting: a GPU below this utilisation (percent) is idle.
    #[arg(long, value_name = "PERCENT")]
    idle_threshold_percent: Option<f64>,
    /// Idle accounting: a job whose GPUs were all idle this long is idle.
    #[arg(long, value_name = "MINUTES")]
    idle_minutes: Option<f64>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
}

fn effective(args: &ExporterArgs) -> anyhow::Result<ExporterConfig> {
    let env = |k: &str| std::env::var(k).ok();
    let mut c = config::load_exporter(args.config.as_deref(), &env)?;
    if let Some(v) = args.listen {
        c.listen = v;
    }
    if let Some(v) = &args.token_sha256 {
        c.token_sha256 = Some(v.clone());
    }
    if args.no_auth {
        c.no_auth = true;
    }
    if !args.gpu_snapshots.is_empty() {
        c.gpu_snapshots = args.gpu_snapshots.clone();
    }
    macro_rules! flag {
        ($($f:ident),*) => { $( if let Some(v) = args.$f { c.$f = v; } )* };
    }
    flag!(
        replay_step_s,
        deadline_s,
        max_connections,
        idle_threshold_percent,
        idle_minutes
    );
    if let Some(v) = &args.nvml_library {
        c.nvml_library = Some(v.clone());
    }
    if let Some(v) = &args.check_textfile {
        c.check_textfile = Some(v.clone());
    }
    if let Some(v) = &args.job_mapping_dir {
        c.job_mapping_dir = Some(v.clone());
    }
    if let Some(v) = &args.device_file_pattern {
        c.device_file_pattern = Some(v.clone());
    }
    if let Some(v) = &args.slurm_gpu_ids {
        c.slurm_gpu_ids = v.clone();
    }
    if let Some(v) = &args.sku {
        c.sku = Some(v.clone());
    }
    if let Some(v) = args.gpus {
        c.gpus = Some(v);
    }
    if args.no_process_jobs {
        c.jobs_from_processes = false;
    }
    if args.dcgm_names {
        c.dcgm_names = true;
    }
    config::validate_exporter(&mut c)?;
    Ok(c)
}

fn probe(cli: &Cli, c: &ExporterConfig) -> anyhow::Result<Box<dyn GpuProbe + Send>> {
    if !c.gpu_snapshots.is_empty() {
        let replay = keel_exporter::replay::ReplayProbe::load(
            &c.gpu_snapshots,
            Duration::from_secs_f64(c.replay_step_s),
            Arc::new(SystemClock),
        )
        .map_err(|e| crate::exit::DataError(e.to_string()))?;
        return Ok(Box::new(replay));
    }
    if cli.root != Path::new("/") {
        return Ok(Box::new(crate::gpu::Unavailable(format!(
            "NVML reads this machine's GPUs, not those under --root {}; pass --gpu-snapshot FILE",
            cli.root.display()
        ))));
    }
    // NVML's own timeout is longer than the scrape deadline: a scrape shows
    // the last readings while a slow call finishes.
    let probe = match &c.nvml_library {
        Some(l) => keel_gpu::NvmlProbe::with_library(l),
        None => keel_gpu::NvmlProbe::new(),
    };
    // NVML stays loaded between scrapes.
    Ok(Box::new(keel_gpu::LoadedNvmlProbe::new(
        probe.with_timeout(Duration::from_secs(10)),
    )))
}

/// The GPU count the node should have: `gpus`, else the SKU profile's
/// (`sku`, else the profile of Azure IMDS's vmSize when the exporter reads
/// this machine, not a root given with --root).
fn expected(
    cli: &Cli,
    c: &ExporterConfig,
) -> anyhow::Result<Option<keel_exporter::readings::ExpectedGpus>> {
    use keel_check::profile;
    let sku = match &c.sku {
        Some(s) => Some(s.clone()),
        None if cli.root == Path::new("/") => keel_check::imds::vm_size(
            keel_check::imds::DEFAULT_ENDPOINT,
            Duration::from_millis(1000),
        )
        .and_then(|size| profile::for_vm_size(&size).map(str::to_owned)),
        None => None,
    };
    let from_profile = match &sku {
        Some(s) => profile::load(s, None)?.gpu.count,
        None => None,
    };
    Ok(c.gpus
        .or(from_profile)
        .map(|gpus| keel_exporter::readings::ExpectedGpus {
            sku: sku.unwrap_or_else(|| "configured".into()),
            gpus,
        }))
}

pub fn run(cli: &Cli, args: &ExporterArgs, out: &mut Out) -> anyhow::Result<Code> {
    let c = effective(args)?;
    if args.print_config {
        if cli.json {
            out.json("exporter", &c)?;
        } else {
            out.text(&toml::to_string(&c)?)?;
        }
        return Ok(Code::Ok);
    }
    let hostname = std::fs::read_to_string(cli.root.join("proc/sys/kernel/hostname"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let opts = ExporterOptions {
        root: cli.root.clone(),
        deadline: Duration::from_secs_f64(c.deadline_s),
        check_textfile: c.check_textfile.clone(),
        job_mapping_dir: c.job_mapping_dir.clone(),
        jobs_from_processes: c.jobs_from_processes,
        device_file_pattern: c.device_file_pattern.clone(),
        naming: if c.dcgm_names {
            Naming::Dcgm
        } else {
            Naming::Keel
        },
        hostname,
        min_interval: Duration::from_millis(500),
        idle: Some(IdlePolicy {
            threshold_percent: c.idle_threshold_percent,
            idle_minutes: c.idle_minutes,
        }),
        expected: expected(cli, &c)?,
        xid_window: Duration::from_secs_f64(c.xid_window_s),
        slurm_gpu_ids: c.slurm_gpu_ids.parse().map_err(crate::exit::UsageError)?,
    };
    let serve_opts = ServeOptions {
        auth: match &c.token_sha256 {
            Some(t) => Auth::Token { sha256: t.clone() },
            None => Auth::None,
        },
        max_connections: c.max_connections,
        ..ServeOptions::default()
    };
    let probe = probe(cli, &c)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(c.listen)
            .await
            .with_context(|| format!("cannot listen on {}", c.listen))?;
        let exporter = Exporter::new(opts, probe, Arc::new(SystemClock))
            .context("cannot start the GPU probe's thread")?;
        out.text(&format!(
            "metrics  http://{}/metrics\nready\n",
            listener.local_addr()?
        ))?;
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        keel_exporter::server::serve(listener, exporter, serve_opts, shutdown).await?;
        anyhow::Ok(())
    })?;
    Ok(Code::Ok)
}
