//! `keel tune`: GPU clocks as a Slurm prolog/epilog pair (`clocks`,
//! `reset`) and the NCCL/UCX/MPI environment for the node (`env`).

use std::path::PathBuf;

use clap::Subcommand;
use serde::Serialize;

use keel_gpu::clocks::{ClockControl, NvmlControl};
use keel_tune::clocks::{self, GpuStatus, Options, Report};

use crate::exit::Code;
use crate::output::Out;
use crate::Cli;

#[derive(Debug, Subcommand)]
pub enum TuneCommand {
    /// Raise every GPU to its maximum supported clocks (a Slurm Prolog):
    /// application clocks where supported, locked clocks otherwise. The
    /// prior state is recorded in the state file first. Dry run unless
    /// --apply.
    Clocks(ClockArgs),
    /// Restore every GPU the prolog changed to its recorded state (a Slurm
    /// Epilog), then remove the state file. Without a state file nothing
    /// changes. Dry run unless --apply.
    Reset(ClockArgs),
    /// Print the NCCL/UCX/MPI environment for this node's SKU and launcher,
    /// each variable with its reason and source, and the InfiniBand HCA for
    /// each local rank.
    Env(EnvArgs),
}

#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// sh: a script to source; json; slurm: `export NAME=value` lines for a
    /// TaskProlog, for the rank in SLURM_LOCALID, skipping variables the
    /// job already sets.
    #[arg(long, value_parser = ["sh", "json", "slurm"], default_value = "sh")]
    format: String,
    /// The launcher the job uses.
    #[arg(long, value_parser = ["srun", "mpirun", "torchrun"], default_value = "srun")]
    launcher: String,
    /// SKU profile (`keel check profiles`); default: from the GPUs on an
    /// Azure VM, else `generic`.
    #[arg(long, env = "KEEL_SKU")]
    sku: Option<String>,
    /// TOML file whose values override the profile's.
    #[arg(long, value_name = "FILE", env = "KEEL_PROFILE_FILE")]
    profile_file: Option<PathBuf>,
    /// The local rank whose HCA --format slurm exports.
    #[arg(long, value_name = "N", env = "SLURM_LOCALID")]
    local_rank: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct ClockArgs {
    /// Change the GPUs (needs root); without it keel prints what would change.
    #[arg(long)]
    apply: bool,
    /// The state file that records the GPUs' prior clocks.
    #[arg(long, value_name = "FILE", env = "KEEL_TUNE_STATE", default_value = clocks::DEFAULT_STATE_FILE)]
    state: PathBuf,
    /// Only these GPUs (NVML indices, PCI bus order), e.g. `0,1`; default all.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        conflicts_with = "slurm_gpus"
    )]
    gpus: Vec<u32>,
    /// Only the GPUs Slurm names so (`"$SLURM_JOB_GPUS"` in a prolog):
    /// device minors, which Slurm's ids are under gres.conf
    /// `File=/dev/nvidiaN` lines (Azure CycleCloud), not NVML indices.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    slurm_gpus: Vec<u32>,
    /// What --slurm-gpus holds: `minor` (gres.conf File= lines) or `index`
    /// (gres.conf AutoDetect=nvml, which numbers GPUs in PCI order).
    #[arg(long, value_name = "minor|index", default_value = "minor")]
    slurm_gpu_ids: String,
    /// The NVML library to load.
    #[arg(long, value_name = "PATH", default_value = keel_gpu::nvml::DEFAULT_LIBRARY)]
    nvml_library: PathBuf,
}

pub fn run(_cli: &Cli, cmd: &TuneCommand, out: &mut Out) -> anyhow::Result<Code> {
    match cmd {
        TuneCommand::Clocks(a) => clocks_cmd(_cli, a, out, "tune clocks", clocks::prolog),
        TuneCommand::Reset(a) => clocks_cmd(_cli, a, out, "tune reset", clocks::epilog),
        TuneCommand::Env(a) => env_cmd(_cli, a, out),
    }
}

/// The SKU: the flag, else the profile for the GPUs' model and count on an
/// Azure VM (a VMBus network device), else `generic`.
pub fn choose_sku(flag: Option<&str>, m: &keel_topo::Machine) -> anyhow::Result<(String, String)> {
    use keel_check::profile;
    if let Some(s) = flag {
        if !profile::builtin_names().contains(&s) {
            return Err(crate::exit::UsageError(format!(
                "unknown SKU {:?}; known: {}",
                s.chars().take(64).collect::<String>(),
                profile::builtin_names().join(", ")
            ))
            .into());
        }
        return Ok((s.to_owned(), "flag".into()));
    }
    let azure = m.nics.iter().any(|n| n.bus == "vmbus");
    if let (true, Some(model)) = (azure, m.gpus.first().and_then(|g| g.model.as_deref())) {
        if let Some(p) = profile::for_gpus(model, m.gpus.len()) {
            return Ok((
                p.to_owned(),
                format!("gpus ({}x {model}, Azure VM)", m.gpus.len()),
            ));
        }
    }
    Ok(("generic".into(), "generic".into()))
}

#[derive(Serialize)]
struct EnvJson<'a> {
    status: &'static str,
    sku_source: &'a str,
    #[serde(flatten)]
    env: &'a keel_tune::env::NodeEnv,
}

fn env_cmd(cli: &Cli, a: &EnvArgs, out: &mut Out) -> anyhow::Result<Code> {
    use keel_tune::env;
    let root = keel_topo::Root::new(&cli.root);
    let m = keel_topo::read_machine(&root)?;
    let (sku, sku_source) = choose_sku(a.sku.as_deref(), &m)?;
    let profile =
        keel_check::profile::load(&sku, a.profile_file.as_deref()).map_err(anyhow::Error::from)?;
    let launcher: keel_topo::Launcher = a.launcher.parse().map_err(crate::exit::UsageError)?;
    let exists = |p: &str| root.exists(p.trim_start_matches('/'));
    let format = if out.json { "json" } else { a.format.as_str() };
    let node =
        match env::node_env(&m, &profile, launcher, &exists) {
            Ok(n) => n,
            Err(e) => {
                match format {
                "json" => out.json(
                    "tune env",
                    &serde_json::json!({"status": "unknown", "sku": sku, "reason": e.to_string()}),
                )?,
                // A TaskProlog that fails cancels the task: on a node with
                // no GPU it exports nothing and succeeds.
                "slurm" => return Ok(Code::Ok),
                _ => out.text(&format!("# keel tune env: {e}
"))?,
            }
                return Ok(Code::Unknown);
            }
        };
    match format {
        "json" => out.json(
            "tune env",
            &EnvJson {
                status: "ok",
                sku_source: &sku_source,
                env: &node,
            },
        )?,
        "slurm" => {
            let set = |name: &str| std::env::var_os(name).is_some();
            out.text(&env::render_slurm(&node, a.local_rank, &set))?
        }
        _ => out.text(&env::render_sh(&node))?,
    }
    Ok(Code::Ok)
}

type Step = fn(&mut dyn ClockControl, &Options) -> Result<Report, clocks::ClocksError>;

#[derive(Serialize)]
struct ClocksJson<'a> {
    status: &'static str,
    #[serde(flatten)]
    report: &'a Report,
}

fn clocks_cmd(
    cli: &Cli,
    a: &ClockArgs,
    out: &mut Out,
    command: &str,
    step: Step,
) -> anyhow::Result<Code> {
    let kind: keel_topo::IdKind = a
        .slurm_gpu_ids
        .parse()
        .map_err(|e: String| crate::exit::UsageError(format!("--slurm-gpu-ids: {e}")))?;
    let mut opts = Options {
        state_file: a.state.clone(),
        apply: a.apply,
        only: a.gpus.clone(),
    };
    // A reset reads its state file before NVML (a damaged one is a data
    // error); without a state file it needs no GPU access at all.
    if command == "tune reset" && clocks::StateFile::load(&opts.state_file)?.is_none() {
        let mut none = NoGpus;
        let report = step(&mut none, &opts)?;
        return finish(out, command, &report);
    }
    let mut ctl = match NvmlControl::open(&a.nvml_library) {
        Ok(c) => c,
        Err(e) => {
            let report = Report {
                applied: a.apply,
                state_file: a.state.clone(),
                state: format!("nothing changed: {e}"),
                gpus: vec![],
            };
            finish(out, command, &report)?;
            return Ok(Code::Unknown);
        }
    };
    if !a.slurm_gpus.is_empty() {
        let procfs = keel_topo::gpu_ids::read_procfs_minors(&keel_topo::Root::new(&cli.root))?;
        opts.only = clocks::slurm_gpus(&ctl, &procfs, &a.slurm_gpus, kind)?;
    }
    let report = step(&mut ctl, &opts)?;
    finish(out, command, &report)
}

fn code_of(r: &Report) -> Code {
    if r.any(GpuStatus::Failed) {
        Code::Failed
    } else if r.any(GpuStatus::Unknown)
        || (r.gpus.is_empty() && r.state.starts_with("nothing changed:"))
    {
        Code::Unknown
    } else {
        Code::Ok
    }
}

fn status_word(c: Code) -> &'static str {
    match c {
        Code::Ok => "ok",
        Code::Failed => "fail",
        Code::Unknown => "unknown",
        _ => "warn",
    }
}

fn finish(out: &mut Out, command: &str, report: &Report) -> anyhow::Result<Code> {
    let code = code_of(report);
    // Every change goes to stderr as well, for the prolog's log.
    if report.applied {
        let mut err = std::io::stderr().lock();
        for g in &report.gpus {
            for c in &g.changes {
                let result = match (c.done, &c.error) {
                    (Some(true), _) => "done".to_owned(),
                    (_, Some(e)) => format!("failed: {e}"),
                    _ => "not attempted".to_owned(),
                };
                let _ = std::io::Write::write_fmt(
                    &mut err,
                    format_args!(
                        "keel {command}: gpu {} ({}): {}: {} -> {}: {result}\n",
                        c.gpu, c.pci_bus_id, c.what, c.before, c.after
                    ),
                );
            }
        }
    }
    if out.json {
        out.json(
            command,
            &ClocksJson {
                status: status_word(code),
                report,
            },
        )?;
    } else {
        out.text(&render(report))?;
    }
    Ok(code)
}

fn render(r: &Report) -> String {
    let mut s = String::new();
    let verb = if r.applied { "" } else { "(dry run) " };
    for g in &r.gpus {
        let method = g.method.map_or("-".to_owned(), |m| {
            serde_json::to_value(m)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        });
        let status = match g.status {
            GpuStatus::Changed if !r.applied => "would change",
            GpuStatus::Changed => "changed",
            GpuStatus::Unchanged => "unchanged",
            GpuStatus::Unknown => "unknown",
            GpuStatus::Failed => "failed",
        };
        s.push_str(&format!(
            "gpu {} {} [{method}] {status}: {}\n",
            g.gpu, g.pci_bus_id, g.detail
        ));
        for c in &g.changes {
            s.push_str(&format!(
                "  {verb}{}: {} -> {}\n",
                c.what, c.before, c.after
            ));
        }
    }
    s.push_str(&format!(
        "state file {}: {}\n",
        r.state_file.display(),
        r.state
    ));
    s
}

/// A machine with no GPU: used only where no GPU is touched.
struct NoGpus;

impl ClockControl for NoGpus {
    fn gpus(&self) -> Result<Vec<keel_gpu::clocks::ControlledGpu>, keel_gpu::clocks::ControlError> {
        Ok(vec![])
    }
    fn caps(
        &self,
        gpu: u32,
    ) -> Result<keel_gpu::clocks::ClockCaps, keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn state(
        &self,
        gpu: u32,
    ) -> Result<keel_gpu::clocks::ClockState, keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn set_applications_clocks(
        &mut self,
        gpu: u32,
        _: keel_gpu::clocks::ClockPair,
    ) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn reset_applications_clocks(
        &mut self,
        gpu: u32,
    ) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn set_locked_gpu_clocks(
        &mut self,
        gpu: u32,
        _: keel_gpu::clocks::Range,
    ) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn reset_locked_gpu_clocks(&mut self, gpu: u32) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn set_locked_memory_clocks(
        &mut self,
        gpu: u32,
        _: keel_gpu::clocks::Range,
    ) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
    fn reset_locked_memory_clocks(
        &mut self,
        gpu: u32,
    ) -> Result<(), keel_gpu::clocks::ControlError> {
        Err(unsupported(gpu))
    }
}

fn unsupported(gpu: u32) -> keel_gpu::clocks::ControlError {
    keel_gpu::clocks::ControlError::NotSupported {
        call: "no GPU",
        gpu,
    }
}
