//! `keel scratch plan|apply|verify`: local NVMe drives as one RAID0 with
//! XFS, and its sequential throughput against the SKU profile's figure.

use std::path::PathBuf;

use clap::Subcommand;
use serde::Serialize;

use keel_tune::scratch::{self, Plan, Request, Verdict, VerifyOptions};

use crate::exit::Code;
use crate::output::Out;
use crate::table::{bytes, opt, Table};
use crate::Cli;

#[derive(Debug, Subcommand)]
pub enum ScratchCommand {
    /// Find the local NVMe drives, refuse any in use, and print the exact
    /// mdadm/mkfs.xfs/mount steps for a RAID0 with XFS at the mount point.
    Plan(PlanArgs),
    /// Run the plan's steps (root). Dry run unless --apply.
    Apply {
        #[command(flatten)]
        plan: PlanArgs,
        /// Run the steps; without it keel prints them.
        #[arg(long)]
        apply: bool,
    },
    /// Measure sequential write and read throughput under PATH with direct
    /// I/O and parallel streams, and compare with the SKU profile's figure.
    Verify(VerifyArgs),
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Where to mount the scratch filesystem; default: the profile's
    /// `scratch.mount` (/mnt/resource_nvme).
    #[arg(long, value_name = "DIR")]
    mount: Option<PathBuf>,
    /// The md device to create for two or more drives.
    #[arg(long, value_name = "DEV", default_value = "/dev/md128")]
    array: PathBuf,
    /// Use these block devices instead of the NVMe drives keel finds.
    #[arg(long = "device", value_name = "DEV")]
    devices: Vec<PathBuf>,
    /// Wipe filesystem, array and partition-table signatures on drives that
    /// are otherwise unused (never a mounted drive or an array member).
    #[arg(long)]
    force: bool,
    /// The XFS label and the md array's name, by which keel knows its
    /// array again after a reboot.
    #[arg(long, default_value = "keel-scratch")]
    label: String,
    /// Build or mount an array of fewer drives than the SKU profile's NVMe
    /// count (a drive missing or kept for something else).
    #[arg(long)]
    allow_fewer_drives: bool,
    /// SKU profile; default: from the GPUs on an Azure VM, else `generic`.
    #[arg(long, env = "KEEL_SKU")]
    sku: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// A directory on the scratch filesystem.
    path: PathBuf,
    /// Parallel streams (one file each).
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// MiB each stream writes and reads.
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    size_mib: u64,
    /// KiB per request.
    #[arg(long, value_name = "KIB", default_value_t = 1024)]
    block_kib: usize,
    /// SKU profile; default: from the GPUs on an Azure VM, else `generic`.
    #[arg(long, env = "KEEL_SKU")]
    sku: Option<String>,
    /// TOML file whose values override the profile's.
    #[arg(long, value_name = "FILE", env = "KEEL_PROFILE_FILE")]
    profile_file: Option<PathBuf>,
}

pub fn run(cli: &Cli, cmd: &ScratchCommand, out: &mut Out) -> anyhow::Result<Code> {
    match cmd {
        ScratchCommand::Plan(a) => {
            let (plan, _) = make_plan(cli, a)?;
            show_plan(out, "scratch plan", &plan, false, &[])
        }
        ScratchCommand::Apply { plan: a, apply } => {
            let (plan, _) = make_plan(cli, a)?;
            if !apply {
                return show_plan(out, "scratch apply", &plan, false, &[]);
            }
            // The steps act on this machine's devices, whatever --root says.
            if cli.root != std::path::Path::new("/") {
                return Err(crate::exit::UsageError(
                    "keel scratch apply --apply acts on this machine: --root must be /".into(),
                )
                .into());
            }
            let mut say = |l: &str| eprintln!("keel scratch apply: {l}");
            let runs = scratch::apply(&plan, &mut say)?;
            let done: Vec<String> = runs.into_iter().map(|r| r.command).collect();
            show_plan(out, "scratch apply", &plan, true, &done)
        }
        ScratchCommand::Verify(a) => verify(cli, a, out),
    }
}

fn profile_for(
    cli: &Cli,
    sku: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<(keel_check::profile::Profile, Option<keel_topo::Machine>)> {
    let root = keel_topo::Root::new(&cli.root);
    let m = keel_topo::read_machine(&root)?;
    let (name, _) = crate::tune::choose_sku(sku, &m)?;
    Ok((keel_check::profile::load(&name, file)?, Some(m)))
}

fn make_plan(cli: &Cli, a: &PlanArgs) -> anyhow::Result<(Plan, keel_check::profile::Profile)> {
    let (profile, m) = profile_for(cli, a.sku.as_deref(), None)?;
    let req = Request {
        mount: a
            .mount
            .clone()
            .unwrap_or_else(|| PathBuf::from(&profile.scratch.mount)),
        array: a.array.clone(),
        force: a.force,
        devices: a.devices.clone(),
        label: a.label.clone(),
        // Only for the NVMe drives keel finds: devices named explicitly are
        // the operator's choice.
        min_drives: (a.devices.is_empty() && !a.allow_fewer_drives)
            .then_some(profile.host.nvme.map(|n| n as usize))
            .flatten(),
    };
    let root = keel_topo::Root::new(&cli.root);
    let drives = scratch::drives(&root, m.as_ref(), &req)?;
    Ok((scratch::plan(&root, drives, &req)?, profile))
}

#[derive(Serialize)]
struct PlanJson<'a> {
    applied: bool,
    #[serde(flatten)]
    plan: &'a Plan,
    commands: Vec<String>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    done: &'a [String],
}

fn show_plan(
    out: &mut Out,
    command: &str,
    plan: &Plan,
    applied: bool,
    done: &[String],
) -> anyhow::Result<Code> {
    if out.json {
        out.json(
            command,
            &PlanJson {
                applied,
                plan,
                commands: plan.steps.iter().map(|s| s.line()).collect(),
                done,
            },
        )?;
        return Ok(Code::Ok);
    }
    let mut t = Table::new(&["Drive", "Size", "Model", "Use"]);
    for d in &plan.drives {
        let use_ = match &d.refused {
            Some(why) => format!("refused: {why}"),
            None if plan.used.contains(&d.dev) => "used".to_owned(),
            None => "-".to_owned(),
        };
        t.row(vec![
            d.dev.clone(),
            d.size_bytes.map_or("-".to_owned(), bytes),
            opt(d.model.clone()),
            use_,
        ]);
    }
    let mut s = t.render();
    s.push_str(&format!(
        "\n{} {} drive(s) as {} at {}:\n",
        if applied { "Made" } else { "Steps for" },
        plan.used.len(),
        plan.device,
        plan.mount.display()
    ));
    for st in &plan.steps {
        s.push_str(&format!("  {}    # {}\n", st.line(), st.why));
    }
    if plan.steps.is_empty() {
        s = s.replace("Steps for", "Nothing to do for");
    }
    s.push_str("To keep it across reboots:\n");
    for p in &plan.persist {
        s.push_str(&format!("  {p}\n"));
    }
    for n in &plan.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    if !applied {
        s.push_str("(dry run: keel scratch apply --apply runs these steps as root)\n");
    }
    out.text(&s)?;
    Ok(Code::Ok)
}

#[derive(Serialize)]
struct VerifyJson<'a> {
    status: Verdict,
    path: &'a std::path::Path,
    sku: &'a str,
    #[serde(flatten)]
    measured: &'a scratch::Throughput,
    write: Verdict,
    read: Verdict,
    expected_write_gbps: Option<f64>,
    expected_read_gbps: Option<f64>,
    source: Option<&'a str>,
}

fn verify(cli: &Cli, a: &VerifyArgs, out: &mut Out) -> anyhow::Result<Code> {
    let (profile, _) = profile_for(cli, a.sku.as_deref(), a.profile_file.as_deref())?;
    if a.streams == 0 || a.size_mib == 0 || a.block_kib < 4 {
        return Err(crate::exit::UsageError(
            "--streams and --size-mib must be at least 1, --block-kib at least 4".into(),
        )
        .into());
    }
    let opts = VerifyOptions {
        streams: a.streams,
        bytes_per_stream: a.size_mib << 20,
        block: a.block_kib << 10,
    };
    let mut say = |l: &str| eprintln!("keel scratch verify: {l}");
    let t = scratch::measure(&a.path, opts, &mut say)?;
    let sc = &profile.scratch;
    let j = |m, e| scratch::judge(m, e, sc.warn_factor, sc.fail_factor);
    let (w, r) = (j(t.write_gbps, sc.write_gbps), j(t.read_gbps, sc.read_gbps));
    let worst = [w, r]
        .into_iter()
        .max_by_key(|v| match v {
            Verdict::Fail => 3,
            Verdict::Warn => 2,
            Verdict::Pass => 1,
            Verdict::Unjudged => 0,
        })
        .unwrap_or(Verdict::Unjudged);
    let code = match worst {
        Verdict::Fail => Code::Failed,
        Verdict::Warn => Code::Warning,
        Verdict::Pass | Verdict::Unjudged => Code::Ok,
    };
    if out.json {
        out.json(
            "scratch verify",
            &VerifyJson {
                status: worst,
                path: &a.path,
                sku: &profile.name,
                measured: &t,
                write: w,
                read: r,
                expected_write_gbps: sc.write_gbps,
                expected_read_gbps: sc.read_gbps,
                source: sc.source.as_deref(),
            },
        )?;
    } else {
        let fig = |e: Option<f64>, v: Verdict| match e {
            Some(e) => {
                format!("{v:?} (expected {e:.1} GB/s, profile {})", profile.name).to_lowercase()
            }
            None => format!("not judged: profile {} has no figure", profile.name),
        };
        out.text(&format!(
            "{}: {} streams x {} MiB, {} KiB direct I/O\n  write {:.2} GB/s: {}\n  read  {:.2} GB/s: {}\n",
            a.path.display(),
            t.streams,
            (t.bytes / t.streams as u64) >> 20,
            t.block_bytes >> 10,
            t.write_gbps,
            fig(sc.write_gbps, w),
            t.read_gbps,
            fig(sc.read_gbps, r),
        ))?;
    }
    Ok(code)
}
