//! The `keel` command line. This crate is the only one that knows clap,
//! anyhow, terminals and exit codes; every capability lives in a library
//! crate that returns typed results and errors.

mod bench;
mod check;
mod ckpt;
mod config;
mod cost;
mod cost_idle;
mod exit;
mod exporter;
mod gpu;
mod model;
mod output;
mod review;
mod run;
mod scratch;
mod serve;
mod slurm;
mod table;
mod topo;
mod tune;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::exit::Code;

/// jemalloc instead of glibc's allocator: `keel serve` allocates and frees
/// across threads on every request, where glibc's arenas contend, and
/// holds thousands of long streams, where what an open stream keeps
/// resident depends on the allocator (1,000 streams through `keel serve`:
/// 31.6 KiB a stream with jemalloc, 34.7 with glibc's, 55.2 with mimalloc;
/// docs/results/2026-11-28-streams.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use crate::output::Out;

/// keel keeps GPU AI infrastructure well-architected.
#[derive(Debug, Parser)]
#[command(name = "keel", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Read /sys, /proc and /dev under DIR instead of /: a fixture, or a
    /// machine captured with `keel topo snapshot`.
    #[arg(
        long,
        global = true,
        env = "KEEL_ROOT",
        value_name = "DIR",
        default_value = "/"
    )]
    root: PathBuf,

    /// Print machine-readable JSON (`{"version": 1, ...}`) instead of text.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// GPU benchmarks: host-device copies, GEMM, NCCL collectives
    /// (nccl-tests compatible).
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Node health checks (passive tier): GPUs, ECC, XIDs, PCIe, NVLink,
    /// InfiniBand, topology, host. Usable as Slurm's HealthCheckProgram.
    Check(Box<check::CheckArgs>),
    /// Verified, crash-consistent checkpoints on object storage (file://,
    /// az://, s3://): push, watch, latest, ls, verify, pull, gc, pin.
    Ckpt {
        #[command(subcommand)]
        command: ckpt::CkptCommand,
    },
    /// The model registry: immutable versions with lineage, aliases with
    /// a hash-chained history, signatures (OpenSSF model signing), an
    /// HTTP API with an MLflow-compatible subset.
    Model(Box<model::ModelArgs>),
    /// Review slurm.conf, gres.conf, keel's configs, sbatch scripts and a
    /// job's environment against the well-architected rule catalogue
    /// (text, JSON, SARIF).
    Review(Box<review::ReviewArgs>),
    /// GPU-hours by job, user and partition from Slurm accounting, priced
    /// by a price table, and what spot would have saved; `keel cost idle`:
    /// idle GPU-hours from the exporters' accounting.
    Cost(Box<cost::CostArgs>),
    /// Machine topology: NUMA nodes, GPUs, HCAs, NICs and NVMe; pinning
    /// plans; verification of running processes.
    Topo {
        #[command(subcommand)]
        command: topo::TopoCommand,
    },
    /// The inference gateway: authentication, RBAC, limits, traffic
    /// splitting, fallback, metrics and audit in front of OpenAI-compatible
    /// and OIP v2 model servers.
    Serve(Box<serve::ServeArgs>),
    /// Node tuning for jobs: GPU clocks as a Slurm prolog/epilog pair
    /// (dry run unless --apply) and the NCCL/UCX/MPI environment.
    Tune {
        #[command(subcommand)]
        command: tune::TuneCommand,
    },
    /// Local NVMe scratch: plan a RAID0 with XFS from the unused drives,
    /// make it (root, dry run unless --apply), measure it.
    Scratch {
        #[command(subcommand)]
        command: scratch::ScratchCommand,
    },
    /// GPU and node metrics for Prometheus (/metrics on 127.0.0.1:9400):
    /// NVML readings, HCA ports, XIDs, keel check's verdicts, the Slurm job
    /// holding each GPU, idle-GPU time per job.
    Exporter(Box<exporter::ExporterArgs>),
    /// Supervise a training job: resume from the newest verified
    /// checkpoint, push checkpoints as they complete, detect hangs, turn
    /// preemption notices into a checkpoint and a requeue; `run report`
    /// shows goodput.
    Run(Box<run::RunArgs>),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            let code = match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Code::Ok,
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Code::Usage,
                _ => Code::Usage,
            };
            let _ = e.print();
            return code.into();
        }
    };
    // The supervisor forwards the trainer's output to stdout line by line,
    // so it does not hold stdout's lock.
    if let Command::Run(args) = &cli.command {
        return finish(run::run(args, cli.json)).into();
    }
    let mut out = Out::stdout(cli.json);
    let result = match &cli.command {
        Command::Topo { command } => topo::run(&cli, command, &mut out),
        Command::Check(args) => check::run(&cli, args, &mut out),
        Command::Bench { command } => bench::run(&cli, command, &mut out),
        Command::Ckpt { command } => ckpt::run(command, &mut out),
        Command::Serve(args) => serve::run(args, &mut out),
        Command::Model(args) => model::run(args, &mut out),
        Command::Tune { command } => tune::run(&cli, command, &mut out),
        Command::Scratch { command } => scratch::run(&cli, command, &mut out),
        Command::Review(args) => review::run(&cli, args, &mut out),
        Command::Cost(args) => cost::run(cli.json, args, &mut out),
        Command::Exporter(args) => exporter::run(&cli, args, &mut out),
        Command::Run(_) => unreachable_run(),
    };
    finish(result).into()
}

fn unreachable_run() -> anyhow::Result<Code> {
    Err(exit::UsageError("keel run is dispatched before output is set up".into()).into())
}

fn finish(result: anyhow::Result<Code>) -> Code {
    match result {
        Ok(code) => code,
        Err(err) => {
            if exit::is_broken_pipe(&err) {
                return Code::Ok;
            }
            let code = exit::classify(&err);
            let mut stderr = std::io::stderr().lock();
            let _ = writeln!(stderr, "keel: error: {err:#}");
            code
        }
    }
}
