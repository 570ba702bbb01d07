//! `keel bench copy|gemm|nccl`: GPU benchmarks (keel-bench), rendered as
//! tables or versioned JSON, with pass/fail exit codes where a threshold or
//! a correctness check applies.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use keel_bench::collective::Collective;
use keel_bench::copy::{CopyReport, CopyRequest};
use keel_bench::gemm::{GemmReport, GemmRequest};
use keel_bench::launch::Launch;
use keel_bench::nccl::{Average, Identity, NcclReport, NcclRequest, Ranks};
use keel_bench::sweep::Sweep;
use keel_bench::{size, SystemClock};
use keel_cuda::{Cuda, NcclOp, NcclType, SearchEnv};

use crate::config;
use crate::exit::{Code, UsageError};
use crate::output::Out;
use crate::table::Table;
use crate::Cli;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Host-to-device and device-to-host bandwidth (pinned host memory on
    /// the GPU's NUMA node), device-to-device (HBM) and GPU-to-GPU peer
    /// copies.
    Copy(CopyArgs),
    /// Matrix-multiply throughput (cuBLAS) on random inputs, with a
    /// correctness check and a corruption check between repetitions;
    /// `--duration` makes it a burn test.
    Gemm(GemmArgs),
    /// NCCL collectives with nccl-tests' flags, formulas and table; one
    /// process for all local GPUs, or one rank per task under srun.
    Nccl(NcclArgs),
}

/// Settings every benchmark takes.
#[derive(Debug, Args)]
pub struct Common {
    /// Directory searched first for libcuda.so.1, libcublas and libnccl
    /// (config bench.cuda_lib_dir, env KEEL_CUDA_LIB_DIR).
    #[arg(long, value_name = "DIR")]
    cuda_lib_dir: Option<PathBuf>,
    /// Config file (default: KEEL_CONFIG, then ~/.config/keel/keel.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CopyArgs {
    /// GPUs to measure (CUDA ordinals: `0,2` or `0-3`); default: all.
    #[arg(long, value_name = "LIST")]
    gpus: Option<String>,
    /// Bytes per copy (`256M`, `1G`).
    #[arg(long, value_name = "BYTES", default_value = "256M")]
    size: String,
    /// Timed copies per measurement.
    #[arg(long, value_name = "N", default_value_t = 20)]
    iters: usize,
    /// Untimed copies before them.
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: usize,
    /// Skip the GPU-to-GPU copies.
    #[arg(long)]
    no_peer: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Debug, Args)]
pub struct GemmArgs {
    /// GPUs to run on, all at once (`0,2` or `0-3`); default: all.
    #[arg(long, value_name = "LIST")]
    gpus: Option<String>,
    /// Element type: bf16, fp16, tf32, fp32, fp64 or fp8 (e4m3 inputs, bf16
    /// output).
    #[arg(long, value_name = "TYPE", default_value = "bf16", value_parser = keel_bench::gemm::parse_type)]
    dtype: keel_cuda::GemmType,
    #[arg(long, default_value_t = 8192)]
    m: usize,
    #[arg(long, default_value_t = 8192)]
    n: usize,
    #[arg(long, default_value_t = 8192)]
    k: usize,
    /// Timed repetitions (each about 25 ms of back-to-back products).
    #[arg(long, value_name = "N", default_value_t = 20)]
    iters: usize,
    /// Untimed products first.
    #[arg(long, value_name = "N", default_value_t = 10)]
    warmup: usize,
    /// Burn test: repeat for this many seconds instead of --iters.
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    #[command(flatten)]
    common: Common,
}

#[derive(Debug, Args)]
pub struct NcclArgs {
    /// all-reduce, all-gather, reduce-scatter, broadcast, reduce, alltoall or
    /// sendrecv.
    #[arg(value_parser = |s: &str| s.parse::<Collective>())]
    collective: Collective,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(
        short = 'b',
        long = "minbytes",
        value_name = "BYTES",
        default_value = "32M"
    )]
    min_bytes: String,
    /// Largest message.
    #[arg(
        short = 'e',
        long = "maxbytes",
        value_name = "BYTES",
        default_value = "32M"
    )]
    max_bytes: String,
    /// Multiply the size by this each step (above 1: used instead of -i).
    #[arg(
        short = 'f',
        long = "stepfactor",
        value_name = "N",
        default_value_t = 1
    )]
    step_factor: u64,
    /// Add this many bytes each step.
    #[arg(
        short = 'i',
        long = "stepbytes",
        value_name = "BYTES",
        default_value = "1M"
    )]
    step_bytes: String,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", value_name = "N", default_value_t = 20)]
    iters: usize,
    /// Untimed iterations per size first.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        value_name = "N",
        default_value_t = 1
    )]
    warmup: usize,
    /// Check every result element (1) or not (0).
    #[arg(short = 'c', long = "check", value_name = "0|1", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    check: u8,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", value_name = "OP", default_value = "sum", value_parser = parse_op)]
    op: NcclOp,
    /// Element type: int8, uint8, int32, uint32, int64, uint64, half, float,
    /// double, bfloat16.
    #[arg(short = 'd', long = "datatype", value_name = "TYPE", default_value = "float", value_parser = parse_type)]
    dtype: NcclType,
    /// Root rank of broadcast and reduce (nccl-tests' --root; the long
    /// form here is --root-rank, as --root is keel's machine root).
    #[arg(
        short = 'r',
        long = "root-rank",
        value_name = "RANK",
        default_value_t = 0
    )]
    root_rank: usize,
    /// Time reported across ranks: 0 rank 0, 1 mean, 2 min, 3 max.
    #[arg(short = 'a', long = "average", value_name = "0-3", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=3))]
    average: u8,
    /// GPUs this process drives (the first N; one process only).
    #[arg(short = 'g', long = "ngpus", value_name = "N", conflicts_with = "gpus")]
    ngpus: Option<usize>,
    /// GPUs this process drives (`0,2` or `0-3`; one process only).
    #[arg(long, value_name = "LIST")]
    gpus: Option<String>,
    /// Where rank 0 waits for the other ranks (default under Slurm: the
    /// step's first node, a port derived from the job and step ids).
    #[arg(long, value_name = "HOST:PORT", env = "KEEL_RENDEZVOUS")]
    rendezvous: Option<String>,
    /// How long ranks wait for each other.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    rendezvous_timeout: f64,
    /// Exit 2 unless the average bus bandwidth is at least this (GB/s).
    /// The average covers every size: use one size (-b = -e).
    #[arg(long, value_name = "GB/s")]
    min_busbw: Option<f64>,
    #[command(flatten)]
    common: Common,
}

fn parse_op(s: &str) -> Result<NcclOp, String> {
    Ok(match s {
        "sum" => NcclOp::Sum,
        "prod" => NcclOp::Prod,
        "min" => NcclOp::Min,
        "max" => NcclOp::Max,
        "avg" => NcclOp::Avg,
        _ => return Err(format!("unknown op {s:?}; one of sum, prod, min, max, avg")),
    })
}

fn parse_type(s: &str) -> Result<NcclType, String> {
    Ok(match s {
        "int8" | "char" => NcclType::Int8,
        "uint8" => NcclType::Uint8,
        "int32" | "int" => NcclType::Int32,
        "uint32" => NcclType::Uint32,
        "int64" => NcclType::Int64,
        "uint64" => NcclType::Uint64,
        "half" | "fp16" | "float16" => NcclType::Float16,
        "float" | "fp32" | "float32" => NcclType::Float32,
        "double" | "fp64" | "float64" => NcclType::Float64,
        "bfloat16" | "bf16" => NcclType::Bfloat16,
        _ => {
            return Err(format!(
                "unknown type {s:?}; one of int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16"
            ))
        }
    })
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

fn parse_bytes(flag: &str, v: &str) -> anyhow::Result<u64> {
    size::parse_size(v).map_err(|e| usage(format!("{flag}: {e}")))
}

/// `0,2-3` -> `[0, 2, 3]`.
fn parse_gpus(list: &str) -> anyhow::Result<Vec<usize>> {
    let set =
        keel_topo::IdSet::parse_list(list).map_err(|e| usage(format!("--gpus {list:?}: {e}")))?;
    Ok(set.iter().map(|g| g as usize).collect())
}

fn env_str(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

/// Loads the CUDA driver with the library search built from the config,
/// the environment and `--cuda-lib-dir`.
fn open_cuda(common: &Common) -> anyhow::Result<Cuda> {
    let (cfg, _) = config::load_bench(common.config.as_deref(), &env_str)?;
    let lib_dir = common.cuda_lib_dir.clone().or(cfg.cuda_lib_dir);
    let search = SearchEnv::from_env(&|k: &str| std::env::var_os(k), lib_dir);
    Cuda::open(&search).context("cannot run the benchmark")
}

fn all_or(list: &Option<String>, cuda: &Cuda) -> anyhow::Result<Vec<usize>> {
    match list {
        Some(l) => parse_gpus(l),
        None => Ok((0..cuda.device_count()).collect()),
    }
}

pub fn run(cli: &Cli, command: &BenchCommand, out: &mut Out) -> anyhow::Result<Code> {
    match command {
        BenchCommand::Copy(a) => copy(cli, a, out),
        BenchCommand::Gemm(a) => gemm(a, out),
        BenchCommand::Nccl(a) => nccl(cli, a, out),
    }
}

fn copy(cli: &Cli, a: &CopyArgs, out: &mut Out) -> anyhow::Result<Code> {
    let bytes = parse_bytes("--size", &a.size)?;
    let requested = a.gpus.as_deref().map(parse_gpus).transpose()?;
    let mut req = CopyRequest {
        gpus: requested.clone().unwrap_or_else(|| vec![0]),
        bytes: usize::try_from(bytes).map_err(|_| usage("--size is too large"))?,
        iters: a.iters,
        warmup: a.warmup,
        peer: !a.no_peer,
    };
    // Flag errors before looking for CUDA; GPU ordinals once it counts them.
    keel_bench::copy::validate(&req, usize::MAX)?;
    let cuda = open_cuda(&a.common)?;
    req.gpus = requested.unwrap_or_else(|| (0..cuda.device_count()).collect());
    let machine = keel_topo::read_machine(&keel_topo::Root::new(&cli.root)).ok();
    let report = keel_bench::copy::run(&cuda, machine.as_ref(), &req)?;
    if out.json {
        out.json("bench copy", &report)?;
    } else {
        out.text(&render_copy(&report))?;
    }
    Ok(Code::Ok)
}

fn rate(s: &keel_bench::stats::Summary) -> String {
    format!("{:.1} ±{:.1}%", s.median, s.spread_pct)
}

pub fn render_copy(r: &CopyReport) -> String {
    let mut t = Table::new(&[
        "GPU", "Model", "NUMA", "CPUs", "H2D GB/s", "D2H GB/s", "D2D GB/s",
    ]);
    for g in &r.gpus {
        t.row(vec![
            g.gpu.to_string(),
            g.name.clone(),
            crate::table::opt(g.numa_node),
            if g.pinned {
                g.cpus.clone().unwrap_or_else(|| "-".into())
            } else {
                "not pinned".into()
            },
            rate(&g.h2d_gbs),
            rate(&g.d2h_gbs),
            rate(&g.d2d_gbs),
        ]);
    }
    let mut s = t.render();
    s.push_str(&format!(
        "\n{} per copy; median ±spread of {} runs after {} warm-up; D2D counts bytes read and written\n",
        size::human(r.bytes as u64),
        r.iters,
        r.warmup
    ));
    for g in &r.gpus {
        if let Some(n) = &g.note {
            s.push_str(&format!("note: GPU {}: {n}\n", g.gpu));
        }
    }
    if !r.peer.is_empty() {
        let mut gpus: Vec<usize> = r.peer.iter().flat_map(|p| [p.src, p.dst]).collect();
        gpus.sort_unstable();
        gpus.dedup();
        let mut header = vec!["src\\dst".to_owned()];
        header.extend(gpus.iter().map(|g| g.to_string()));
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        let mut t = Table::new(&header);
        for src in &gpus {
            let mut row = vec![src.to_string()];
            for dst in &gpus {
                row.push(
                    r.peer
                        .iter()
                        .find(|p| p.src == *src && p.dst == *dst)
                        .map_or_else(
                            || "-".to_owned(),
                            |p| format!("{:.1}{}", p.gbs.median, if p.p2p { "" } else { "*" }),
                        ),
                );
            }
            t.row(row);
        }
        s.push_str(
            "\nPeer copies, GB/s (median; * = no direct P2P access, staged by the driver)\n",
        );
        s.push_str(&t.render());
    }
    s
}

fn gemm(a: &GemmArgs, out: &mut Out) -> anyhow::Result<Code> {
    let duration = match a.duration {
        None => None,
        Some(d) if d > 0.0 && d.is_finite() => Some(Duration::from_secs_f64(d)),
        Some(d) => {
            return Err(usage(format!(
                "--duration {d} must be a positive number of seconds"
            )))
        }
    };
    let requested = a.gpus.as_deref().map(parse_gpus).transpose()?;
    let mut req = GemmRequest {
        gpus: requested.clone().unwrap_or_else(|| vec![0]),
        dtype: a.dtype,
        m: a.m,
        n: a.n,
        k: a.k,
        iters: a.iters,
        warmup: a.warmup,
        duration,
    };
    keel_bench::gemm::validate(&req, usize::MAX)?;
    let cuda = open_cuda(&a.common)?;
    req.gpus = requested.unwrap_or_else(|| (0..cuda.device_count()).collect());
    let report = keel_bench::gemm::run(&cuda, &req, &SystemClock)?;
    if out.json {
        out.json("bench gemm", &report)?;
    } else {
        out.text(&render_gemm(&report))?;
    }
    Ok(if report.gpus.iter().all(|g| g.passed) {
        Code::Ok
    } else {
        Code::Failed
    })
}

pub fn render_gemm(r: &GemmReport) -> String {
    let mut t = Table::new(&[
        "GPU",
        "Model",
        "TFLOPS",
        "Spread",
        "Peak",
        "Of peak",
        "Check",
        "Repeats",
        "Mismatches",
        "Result",
    ]);
    for g in &r.gpus {
        t.row(vec![
            g.gpu.to_string(),
            g.name.clone(),
            format!("{:.1}", g.tflops.median),
            format!("{:.1}%", g.tflops.spread_pct),
            g.peak_tflops
                .map_or_else(|| "-".into(), |p| format!("{p:.1}")),
            g.fraction_of_peak
                .map_or_else(|| "-".into(), |f| format!("{:.1}%", f * 100.0)),
            format!(
                "{} ({:.1e} / {:.0e})",
                if g.check.passed { "ok" } else { "WRONG" },
                g.check.relative_error,
                g.check.tolerance
            ),
            format!("{} x {}", g.repetitions, g.products_per_repetition),
            g.mismatched_repetitions.to_string(),
            if g.passed { "pass" } else { "FAIL" }.into(),
        ]);
    }
    let mut s = format!(
        "{} GEMM {}x{}x{} (C = A^T B, cuBLAS); TFLOPS: median of repetitions, peak: datasheet dense\n\n",
        r.dtype, r.m, r.n, r.k
    );
    s.push_str(&t.render());
    s
}

fn nccl(cli: &Cli, a: &NcclArgs, out: &mut Out) -> anyhow::Result<Code> {
    let sweep = Sweep {
        min_bytes: parse_bytes("-b", &a.min_bytes)?,
        max_bytes: parse_bytes("-e", &a.max_bytes)?,
        factor: a.step_factor,
        step_bytes: parse_bytes("-i", &a.step_bytes)?,
    };
    sweep.sizes().map_err(usage)?;
    if !(a.rendezvous_timeout > 0.0 && a.rendezvous_timeout.is_finite()) {
        return Err(usage(
            "--rendezvous-timeout must be a positive number of seconds",
        ));
    }
    let launch = Launch::from_slurm(&env_str)?.filter(|l| l.world > 1);
    if launch.is_some() && (a.gpus.is_some() || a.ngpus.is_some()) {
        return Err(usage(
            "--gpus and -g drive several GPUs from one process; under srun with several tasks each task is one rank (use one task per GPU)",
        ));
    }
    // An empty KEEL_RENDEZVOUS is unset.
    let explicit = a.rendezvous.clone().filter(|r| !r.is_empty());
    let rendezvous = match (&launch, &explicit) {
        (Some(l), r) => Some(l.rendezvous(r.as_deref())?),
        (None, Some(r)) => {
            keel_bench::launch::validate_endpoint(r)?;
            None
        }
        (None, None) => None,
    };
    let req = NcclRequest {
        collective: a.collective,
        sweep,
        iters: a.iters,
        warmup: a.warmup,
        check: a.check == 1,
        op: a.op,
        dtype: a.dtype,
        root: a.root_rank,
        average: Average::from_flag(a.average).map_err(usage)?,
        min_busbw: a.min_busbw,
    };
    // Everything that can be checked before CUDA is: the rank count is
    // known here from Slurm, -g or --gpus, else only once CUDA counts GPUs.
    let known_world = match (&launch, a.ngpus, &a.gpus) {
        (Some(l), _, _) => Some(l.world),
        (None, Some(n), _) => Some(n),
        (None, None, Some(list)) => Some(parse_gpus(list)?.len()),
        (None, None, None) => None,
    };
    keel_bench::nccl::validate(&req, known_world.unwrap_or(usize::MAX))?;
    let cuda = open_cuda(&a.common)?;
    let ranks = match (launch, rendezvous) {
        (Some(launch), Some(endpoint)) => Ranks::Launched {
            launch,
            rendezvous: endpoint,
            timeout: Duration::from_secs_f64(a.rendezvous_timeout),
        },
        _ => {
            let gpus = match a.ngpus {
                Some(0) => return Err(usage("-g must be at least 1")),
                Some(n) => (0..n).collect(),
                None => all_or(&a.gpus, &cuda)?,
            };
            Ranks::Local { gpus }
        }
    };
    let host = std::fs::read_to_string(cli.root.join("proc/sys/kernel/hostname"))
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let ident = Identity {
        host,
        pid: std::process::id(),
    };
    let report = keel_bench::nccl::run(&cuda, &req, &ranks, &ident, &SystemClock)?;
    if report.is_rank0 {
        if out.json {
            out.json("bench nccl", &report)?;
        } else {
            out.text(&keel_bench::table::render(&report))?;
        }
    }
    Ok(nccl_code(&report))
}

pub fn nccl_code(r: &NcclReport) -> Code {
    if r.out_of_bounds > 0 || r.passed == Some(false) {
        Code::Failed
    } else {
        Code::Ok
    }
}

/// What `keel bench --json` prints is read by field name elsewhere:
/// `keel check --bench` (keel-check's active tier, which does not link
/// keel-bench) and `scripts/gpu-compare` / `scripts/gpu-report`. Reports
/// built from keel-bench's own types, printed as the commands print them,
/// must still carry every field those readers use.
#[cfg(test)]
mod json_contract {
    use keel_bench::copy::{GpuCopy, PeerCopy};
    use keel_bench::gemm::{GpuGemm, SmallCheck};
    use keel_bench::nccl::{Placement, RankDevice, Row};
    use keel_bench::stats::Summary;
    use serde_json::Value;

    use super::*;
    use crate::output::Out;

    fn printed<T: serde::Serialize>(command: &str, report: &T) -> Value {
        let (mut out, buf) = Out::buffer();
        out.json(command, report).expect("print");
        let bytes = buf.lock().expect("buffer").clone();
        serde_json::from_slice(&bytes).expect("JSON")
    }

    fn s(m: f64) -> Summary {
        Summary::of(&[m * 0.99, m, m * 1.01]).expect("summary")
    }

    fn has(doc: &Value, pointers: &[&str]) {
        for p in pointers {
            assert!(
                doc.pointer(p).is_some_and(|v| !v.is_null()),
                "{p} missing from {doc}"
            );
        }
    }

    #[test]
    fn bench_json_carries_what_keel_check_and_the_gpu_scripts_read() {
        let profile = keel_check::profile::load("nd96isr_h100_v5", None).expect("profile");
        let copy = CopyReport {
            bytes: 256 << 20,
            iters: 20,
            warmup: 3,
            gpus: vec![GpuCopy {
                gpu: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "0001:00:00.0".into(),
                numa_node: Some(0),
                cpus: Some("0-47".into()),
                pinned: true,
                note: None,
                h2d_gbs: s(54.0),
                d2h_gbs: s(53.0),
                d2d_gbs: s(2900.0),
            }],
            peer: vec![PeerCopy {
                src: 0,
                dst: 1,
                p2p: true,
                gbs: s(370.0),
            }],
        };
        let doc = printed("bench copy", &copy);
        has(
            &doc,
            &[
                "/gpus/0/h2d_gbs/median",
                "/gpus/0/d2h_gbs/median",
                "/gpus/0/d2d_gbs/median",
                "/gpus/0/pinned",
                "/gpus/0/numa_node",
            ],
        );
        let results = keel_check::active::from_bench(&profile, "copy", &doc).expect("copy");
        assert!(results.len() >= 3, "{results:?}");

        let gemm = GemmReport {
            dtype: "bf16",
            m: 8192,
            n: 8192,
            k: 8192,
            gpus: vec![GpuGemm {
                gpu: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "0001:00:00.0".into(),
                cublas_version: 130100,
                tflops: s(700.0),
                peak_tflops: Some(989.4),
                fraction_of_peak: Some(0.71),
                repetitions: 20,
                products_per_repetition: 18,
                mismatched_repetitions: 0,
                check: SmallCheck {
                    m: 320,
                    n: 192,
                    k: 256,
                    relative_error: 2e-3,
                    tolerance: 1e-2,
                    passed: true,
                },
                seconds: 2.5,
                passed: true,
            }],
        };
        let doc = printed("bench gemm", &gemm);
        has(
            &doc,
            &[
                "/gpus/0/tflops/median",
                "/gpus/0/check/relative_error",
                "/gpus/0/check/tolerance",
                "/gpus/0/check/passed",
                "/gpus/0/mismatched_repetitions",
                "/gpus/0/passed",
                "/gpus/0/fraction_of_peak",
                "/gpus/0/cublas_version",
            ],
        );
        let results = keel_check::active::from_bench(&profile, "gemm", &doc).expect("gemm");
        assert!(!results.is_empty());

        let c = Collective::AllReduce;
        let sweep = Sweep {
            min_bytes: 1 << 20,
            max_bytes: 1 << 30,
            factor: 32,
            step_bytes: 0,
        };
        let rows: Vec<Row> = sweep
            .sizes()
            .expect("sweep")
            .into_iter()
            .map(|bytes| {
                let counts = c.counts(bytes, 4, 8);
                let p = |us: f64| {
                    let (algbw, busbw) = c.bandwidth(counts.param, 4, 8, us * 1e-6);
                    Placement {
                        time_us: us,
                        algbw,
                        busbw,
                        wrong: Some(0),
                    }
                };
                Row {
                    bytes: c.bytes_column(&counts, 4),
                    count: counts.param,
                    dtype: "float",
                    redop: keel_bench::nccl::redop_name(c, keel_cuda::NcclOp::Sum),
                    root: keel_bench::nccl::root_column(c, 0),
                    out_of_place: p(bytes as f64 / 200e3),
                    in_place: p(bytes as f64 / 201e3),
                }
            })
            .collect();
        let nccl = NcclReport {
            collective: c,
            nccl_tests_binary: c.nccl_tests_binary(),
            dtype: "float",
            redop: "sum",
            root: -1,
            ranks: 8,
            local_gpus: 8,
            is_rank0: true,
            sweep,
            iters: 20,
            warmup: 1,
            check: true,
            average: Average::Mean,
            nccl_version: "2.27.7".into(),
            nccl_library: "/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
                .into(),
            host: "node01".into(),
            pid: 1,
            devices: vec![RankDevice {
                rank: 0,
                ordinal: 0,
                pci_bus_id: "0001:00:00.0".into(),
                bus: "0x00".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
            }],
            rows,
            out_of_bounds: 0,
            avg_busbw: 300.0,
            min_busbw: None,
            passed: None,
        };
        let doc = printed("bench nccl", &nccl);
        has(
            &doc,
            &[
                "/nccl_version",
                "/nccl_library",
                "/out_of_bounds",
                "/avg_busbw",
                "/rows/0/bytes",
                "/rows/0/in_place/algbw",
                "/rows/0/in_place/time_us",
                "/rows/0/in_place/wrong",
                "/rows/0/out_of_place/wrong",
                "/rows/0/out_of_place/busbw",
            ],
        );
        let results = keel_check::active::from_bench(&profile, "nccl", &doc).expect("nccl");
        assert!(!results.is_empty());
    }
}
