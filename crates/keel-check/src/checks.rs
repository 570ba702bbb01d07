//! The passive checks. Each is a pure function of the profile and the
//! inputs, returning one result per device (or one for the node).

use std::collections::{BTreeMap, BTreeSet};

use keel_gpu::{throttle, GpuReading, GpuSnapshot};
use keel_topo::Machine;

use crate::gather::Inputs;
use crate::profile::Profile;
use crate::{CheckResult, Device, RunOptions, Status};

type CheckFn = fn(&Profile, &Inputs, RunOptions) -> Vec<CheckResult>;

/// Every passive check, in report order.
pub const PASSIVE: &[(&str, CheckFn)] = &[
    ("gpu.count", gpu_count),
    ("gpu.driver", gpu_driver),
    ("gpu.visible", gpu_visible),
    ("gpu.persistence", gpu_persistence),
    ("gpu.ecc_mode", gpu_ecc_mode),
    ("gpu.ecc_errors", gpu_ecc_errors),
    ("gpu.row_remap", gpu_row_remap),
    ("gpu.xid", gpu_xid),
    ("gpu.throttle", gpu_throttle),
    ("gpu.pcie_link", gpu_pcie_link),
    ("gpu.pcie_replay", gpu_pcie_replay),
    ("gpu.nvlink", gpu_nvlink),
    ("gpu.processes", gpu_processes),
    ("gpu.clocks", gpu_clocks),
    ("ib.ports", ib_ports),
    ("ib.flaps", ib_flaps),
    ("ib.peermem", ib_peermem),
    ("topology", topology),
    ("host.cpu", host_cpu),
    ("host.memory", host_memory),
    ("host.swap", host_swap),
    ("host.disk", host_disk),
    ("host.nvme", host_nvme),
];

/// Check ids with a one-line description, for `keel check --list`.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        "gpu.count",
        "GPUs on PCI (vendor 0x10de) against the profile's count and model",
    ),
    ("gpu.driver", "NVIDIA driver loaded and NVML answering"),
    (
        "gpu.visible",
        "every GPU on PCI is visible to the driver (else it fell off the bus)",
    ),
    ("gpu.persistence", "persistence mode enabled"),
    (
        "gpu.ecc_mode",
        "ECC enabled, and no mode change pending a reboot",
    ),
    (
        "gpu.ecc_errors",
        "no uncorrectable ECC errors; corrected SRAM and aggregate DRAM counts under thresholds",
    ),
    (
        "gpu.row_remap",
        "no pending row remap or remap failure (pre-Ampere: no retired page pending)",
    ),
    (
        "gpu.xid",
        "XID errors in the kernel log within the window; the fatal set fails, others warn",
    ),
    (
        "gpu.throttle",
        "no hardware slowdown, thermal or power-brake throttling",
    ),
    (
        "gpu.pcie_link",
        "PCIe link at its maximum width (and generation when busy)",
    ),
    (
        "gpu.pcie_replay",
        "PCIe replay counter growth under the threshold",
    ),
    ("gpu.nvlink", "every expected NVLink link active"),
    (
        "gpu.processes",
        "no leftover GPU processes (only with --expect-idle: prolog, epilog)",
    ),
    (
        "gpu.clocks",
        "with no job on the GPU: application clocks at their defaults and the clocks not locked high",
    ),
    (
        "ib.ports",
        "every expected InfiniBand HCA port ACTIVE at the expected rate",
    ),
    (
        "ib.flaps",
        "InfiniBand interfaces losing carrier less often than the flap threshold",
    ),
    ("ib.peermem", "nvidia_peermem loaded for GPUDirect RDMA"),
    (
        "topology",
        "GPU and HCA PCI addresses per NUMA node as the profile expects",
    ),
    ("host.cpu", "sockets, cores and threads per core"),
    (
        "host.memory",
        "physical memory within tolerance of the profile",
    ),
    ("host.swap", "swap disabled where the profile forbids it"),
    ("host.disk", "free space on key mounts"),
    ("host.nvme", "NVMe drive count"),
];

fn unknown(id: &str, code: &str, detail: impl Into<String>) -> Vec<CheckResult> {
    vec![CheckResult::new(id, Status::Unknown, detail).code(code)]
}

fn skip(id: &str, detail: impl Into<String>) -> Vec<CheckResult> {
    vec![CheckResult::new(id, Status::Skip, detail)]
}

/// GPUs the profile expects: its count, else as many as PCI shows.
fn expected_gpus(p: &Profile, m: Option<&Machine>) -> Option<u32> {
    p.gpu.count.or_else(|| m.map(|m| m.gpus.len() as u32))
}

fn gpu_device(g: &GpuReading) -> Device {
    Device {
        gpu: Some(g.index),
        minor: g.minor_number,
        pci: Some(g.pci_bus_id.clone()),
        serial: g.serial.clone(),
        ..Device::default()
    }
}

/// For per-GPU checks: the snapshot, or the result saying why there is
/// none (skip when no GPU is expected, unknown when NVML is missing).
fn snapshot<'a>(
    id: &str,
    p: &Profile,
    inputs: &'a Inputs,
) -> Result<&'a GpuSnapshot, Vec<CheckResult>> {
    let m = inputs.machine.as_ref().ok();
    if expected_gpus(p, m) == Some(0) {
        return Err(skip(id, "no GPU expected on this node"));
    }
    match &inputs.gpu {
        Ok(s) if s.gpus.is_empty() => Err(unknown(id, "NVML_NO_GPUS", "NVML reports no GPU")),
        Ok(s) => Ok(s),
        Err(e) => Err(unknown(id, e.code, e.message.clone())),
    }
}

/// Runs `f` on every GPU of the snapshot.
fn per_gpu(
    id: &str,
    p: &Profile,
    inputs: &Inputs,
    f: impl Fn(&GpuReading) -> CheckResult,
) -> Vec<CheckResult> {
    match snapshot(id, p, inputs) {
        Ok(s) => s.gpus.iter().map(|g| f(g).device(gpu_device(g))).collect(),
        Err(r) => r,
    }
}

fn gpu_count(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.count";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    let found = m.gpus.len() as u32;
    let expected = p.gpu.count.unwrap_or(found);
    if expected == 0 && found == 0 {
        return skip(ID, "no GPU expected on this node");
    }
    let r = CheckResult::new(ID, Status::Pass, "")
        .value(f64::from(found), "GPUs")
        .threshold(format!("= {expected}"));
    if found < expected {
        return vec![CheckResult {
            status: Status::Fail,
            detail: format!("{found} GPUs on PCI, expected {expected}"),
            ..r
        }
        .code("GPU_MISSING")];
    }
    if found > expected {
        return vec![CheckResult {
            status: Status::Warn,
            detail: format!("{found} GPUs on PCI, expected {expected}"),
            ..r
        }
        .code("GPU_UNEXPECTED")];
    }
    if let Some(model) = &p.gpu.model {
        let names: Vec<String> = match &inputs.gpu {
            Ok(s) if !s.gpus.is_empty() => s.gpus.iter().filter_map(|g| g.name.clone()).collect(),
            _ => m.gpus.iter().filter_map(|g| g.model.clone()).collect(),
        };
        if let Some(bad) = names.iter().find(|n| !n.contains(model.as_str())) {
            return vec![CheckResult {
                status: Status::Fail,
                detail: format!("GPU model {bad:?}, expected {model:?}"),
                ..r
            }
            .code("GPU_MODEL_MISMATCH")];
        }
    }
    vec![CheckResult {
        detail: format!("{found} GPUs on PCI"),
        ..r
    }]
}

fn gpu_driver(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.driver";
    match snapshot(ID, p, inputs) {
        Ok(s) => vec![CheckResult::new(
            ID,
            Status::Pass,
            format!(
                "driver {}, NVML {}, {} GPUs",
                s.driver_version.as_deref().unwrap_or("?"),
                s.nvml_version.as_deref().unwrap_or("?"),
                s.gpus.len()
            ),
        )],
        Err(r) => r,
    }
}

fn gpu_visible(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.visible";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    let snap = match snapshot(ID, p, inputs) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let seen: BTreeSet<String> = snap
        .gpus
        .iter()
        .map(|g| g.pci_bus_id.to_ascii_lowercase())
        .collect();
    // NVML counted devices it could not open for a reason other than a
    // lost GPU (no permission, a job's device cgroup): a GPU missing from
    // its list may be one of those, so that says nothing about its health.
    let not_permitted: Vec<&keel_gpu::Unopened> =
        snap.unopened.iter().filter(|u| !u.lost).collect();
    let mut out = Vec::new();
    for g in &m.gpus {
        let pci = g.pci.to_string();
        if !seen.contains(&pci) {
            let result = match not_permitted.first() {
                Some(u) => CheckResult::new(
                    ID,
                    Status::Unknown,
                    format!(
                        "GPU at {pci} is on PCI but not among the GPUs NVML opened, and NVML could not open {} device(s) (device {}: {}): cannot tell whether it fell off the bus",
                        not_permitted.len(),
                        u.index,
                        u.error
                    ),
                )
                .code("GPU_NOT_OPENED"),
                None => CheckResult::new(
                    ID,
                    Status::Fail,
                    format!(
                        "GPU at {pci} is on PCI but not visible to the driver: fell off the bus"
                    ),
                )
                .code("GPU_FELL_OFF_BUS"),
            };
            out.push(result.device(Device {
                gpu: Some(g.index as u32),
                minor: g.minor,
                pci: Some(pci),
                ..Device::default()
            }));
        }
    }
    if out.is_empty() {
        out.push(CheckResult::new(
            ID,
            Status::Pass,
            format!("all {} GPUs on PCI are visible to the driver", m.gpus.len()),
        ));
    }
    out
}

fn gpu_persistence(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.persistence";
    per_gpu(ID, p, inputs, |g| match g.persistence_mode {
        Some(true) => CheckResult::new(ID, Status::Pass, "persistence mode on"),
        Some(false) if p.gpu.require_persistence => {
            CheckResult::new(ID, Status::Warn, "persistence mode off").code("PERSISTENCE_OFF")
        }
        Some(false) => CheckResult::new(
            ID,
            Status::Pass,
            "persistence mode off (allowed by the profile)",
        ),
        None => CheckResult::new(ID, Status::Unknown, "persistence mode could not be read")
            .code("NVML_FIELD_UNREADABLE"),
    })
}

fn gpu_ecc_mode(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.ecc_mode";
    per_gpu(ID, p, inputs, |g| match (g.ecc_enabled, g.ecc_pending) {
        (Some(false), _) if p.gpu.require_ecc => {
            CheckResult::new(ID, Status::Fail, "ECC is disabled").code("ECC_DISABLED")
        }
        (Some(cur), Some(pending)) if cur != pending => CheckResult::new(
            ID,
            Status::Warn,
            format!(
                "ECC mode changes to {} at the next reboot",
                if pending { "on" } else { "off" }
            ),
        )
        .code("ECC_MODE_PENDING"),
        (Some(cur), _) => CheckResult::new(
            ID,
            Status::Pass,
            if cur {
                "ECC on"
            } else {
                "ECC off (allowed by the profile)"
            },
        ),
        (None, _) => CheckResult::new(ID, Status::Unknown, "ECC mode could not be read")
            .code("NVML_FIELD_UNREADABLE"),
    })
}

fn gpu_ecc_errors(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.ecc_errors";
    per_gpu(ID, p, inputs, |g| {
        let e = &g.ecc;
        let all = [
            e.volatile_sram_uncorrected,
            e.volatile_dram_uncorrected,
            e.aggregate_sram_corrected,
            e.aggregate_dram_corrected,
            e.aggregate_dram_uncorrected,
        ];
        if all.iter().all(Option::is_none) {
            return CheckResult::new(ID, Status::Unknown, "ECC counters could not be read")
                .code("NVML_FIELD_UNREADABLE");
        }
        let vol_unc = e
            .volatile_sram_uncorrected
            .unwrap_or(0)
            .saturating_add(e.volatile_dram_uncorrected.unwrap_or(0));
        let evidence = format!(
            "volatile uncorrected SRAM={} DRAM={}; aggregate corrected SRAM={} DRAM={}, uncorrected DRAM={}",
            opt(e.volatile_sram_uncorrected),
            opt(e.volatile_dram_uncorrected),
            opt(e.aggregate_sram_corrected),
            opt(e.aggregate_dram_corrected),
            opt(e.aggregate_dram_uncorrected)
        );
        if vol_unc > 0 {
            return CheckResult::new(
                ID,
                Status::Fail,
                format!("{vol_unc} uncorrectable ECC errors since driver load"),
            )
            .code("ECC_UNCORRECTABLE")
            .value(vol_unc as f64, "errors")
            .threshold("= 0")
            .evidence(evidence);
        }
        if let Some(sram) = e
            .aggregate_sram_corrected
            .filter(|v| *v >= p.gpu.ecc_sram_corrected_fail)
        {
            return CheckResult::new(ID, Status::Fail, format!("{sram} corrected SRAM errors"))
                .code("ECC_SRAM_CORRECTED")
                .value(sram as f64, "errors")
                .threshold(format!("< {}", p.gpu.ecc_sram_corrected_fail))
                .evidence(evidence);
        }
        let dram = e
            .aggregate_dram_corrected
            .unwrap_or(0)
            .saturating_add(e.aggregate_dram_uncorrected.unwrap_or(0));
        if dram >= p.gpu.ecc_dram_aggregate_fail {
            return CheckResult::new(ID, Status::Fail, format!("{dram} aggregate DRAM errors"))
                .code("ECC_DRAM_AGGREGATE")
                .value(dram as f64, "errors")
                .threshold(format!("< {}", p.gpu.ecc_dram_aggregate_fail))
                .evidence(evidence);
        }
        CheckResult::new(ID, Status::Pass, "no uncorrectable ECC errors")
            .value(vol_unc as f64, "errors")
            .threshold("= 0")
            .better(false)
            .evidence(evidence)
    })
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "?".to_owned(), |x| x.to_string())
}

fn gpu_row_remap(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.row_remap";
    per_gpu(ID, p, inputs, |g| {
        match (g.remapped_rows, g.retired_pages_pending) {
            (Some(r), _) => {
                let ev = format!(
                    "remapped rows: correctable={} uncorrectable={} pending={} failure={}",
                    r.correctable, r.uncorrectable, r.pending, r.failure
                );
                if r.failure {
                    CheckResult::new(
                        ID,
                        Status::Fail,
                        "row remapping failed: the GPU has run out of spare rows",
                    )
                    .code("ROW_REMAP_FAILURE")
                    .evidence(ev)
                } else if r.pending {
                    CheckResult::new(
                        ID,
                        Status::Fail,
                        "a row remap is pending: reset the GPU or reboot",
                    )
                    .code("ROW_REMAP_PENDING")
                    .evidence(ev)
                } else {
                    CheckResult::new(
                        ID,
                        Status::Pass,
                        format!(
                            "{} rows remapped, none pending",
                            r.correctable.saturating_add(r.uncorrectable)
                        ),
                    )
                    .value(f64::from(r.uncorrectable), "rows")
                    .evidence(ev)
                }
            }
            (None, Some(true)) => {
                CheckResult::new(ID, Status::Fail, "retired pages are pending a reboot")
                    .code("RETIRED_PAGES_PENDING")
            }
            (None, Some(false)) => CheckResult::new(ID, Status::Pass, "no retired page pending"),
            (None, None) => {
                CheckResult::new(ID, Status::Unknown, "row remapping could not be read")
                    .code("NVML_FIELD_UNREADABLE")
            }
        }
    })
}

/// `0000:07:00.0` -> `0000:07:00` (the driver prints XIDs without function).
fn pci_no_function(pci: &str) -> String {
    pci.rsplit_once('.')
        .map_or(pci, |(a, _)| a)
        .to_ascii_lowercase()
}

fn gpu_xid(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.xid";
    let m = inputs.machine.as_ref().ok();
    if expected_gpus(p, m) == Some(0) {
        return skip(ID, "no GPU expected on this node");
    }
    let log = match &inputs.host.kernel_log {
        Ok(l) => l,
        Err(e) => return unknown(ID, "KERNEL_LOG_UNREADABLE", e.clone()),
    };
    let Some(now) = inputs.host.uptime_s else {
        return unknown(
            ID,
            "UPTIME_UNREADABLE",
            "/proc/uptime could not be read: no time window for XIDs",
        );
    };
    let since = now - p.xid.window_hours * 3600.0;
    // (pci, code) -> (count, last line)
    let mut seen: BTreeMap<(String, u32), (u32, String)> = BTreeMap::new();
    for rec in log {
        if (rec.usec as f64) / 1e6 < since {
            continue;
        }
        if let Some(x) = crate::kmsg::parse_xid(&rec.message) {
            let e = seen.entry((x.pci, x.code)).or_insert((0, String::new()));
            e.0 += 1;
            e.1 = rec.message.clone();
        }
    }
    let window = format!("{} h", p.xid.window_hours);
    if seen.is_empty() {
        return vec![
            CheckResult::new(ID, Status::Pass, format!("no XID in the last {window}"))
                .value(0.0, "XIDs")
                .threshold(format!("none fatal in {window}")),
        ];
    }
    let index_of = |pci: &str| -> (Option<u32>, Option<String>) {
        if let Ok(s) = &inputs.gpu {
            if let Some(g) = s
                .gpus
                .iter()
                .find(|g| pci_no_function(&g.pci_bus_id) == pci)
            {
                return (Some(g.index), Some(g.pci_bus_id.clone()));
            }
        }
        if let Some(m) = m {
            if let Some(g) = m
                .gpus
                .iter()
                .find(|g| pci_no_function(&g.pci.to_string()) == pci)
            {
                return (Some(g.index as u32), Some(g.pci.to_string()));
            }
        }
        (None, Some(pci.to_owned()))
    };
    let boot = inputs.host.boot_id.clone().unwrap_or_else(|| "?".into());
    seen.into_iter()
        .map(|((pci, code), (count, last))| {
            let fatal = p.xid.fail.contains(&code);
            let (gpu, full_pci) = index_of(&pci);
            CheckResult::new(
                ID,
                if fatal { Status::Fail } else { Status::Warn },
                format!(
                    "XID {code} ({}) {count} time(s) in the last {window}",
                    xid_name(code)
                ),
            )
            .code(if fatal { "XID_FATAL" } else { "XID" })
            .value(f64::from(code), "xid")
            .device(Device {
                gpu,
                pci: full_pci,
                ..Device::default()
            })
            .evidence(last)
            .evidence(format!("boot {boot}"))
        })
        .collect()
}

/// Short meanings of common XIDs (NVIDIA's XID catalogue).
pub fn xid_name(code: u32) -> &'static str {
    match code {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup",
        48 => "double-bit ECC error",
        56 | 57 => "display engine or memory error",
        58 => "unstable video memory",
        62 | 68 | 69 => "internal micro-controller or engine error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapper failure",
        73 => "NVENC error",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        80 => "corrupted data sent to GPU",
        81 => "VGA subsystem error",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP error",
        _ => "see NVIDIA's XID catalogue",
    }
}

fn gpu_throttle(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.throttle";
    per_gpu(ID, p, inputs, |g| {
        let Some(mask) = g.throttle_reasons else {
            return CheckResult::new(ID, Status::Unknown, "throttle reasons could not be read")
                .code("NVML_FIELD_UNREADABLE");
        };
        let names = throttle::names(mask).join(",");
        let ev = format!(
            "clocks-event reasons 0x{mask:x} ({})",
            if names.is_empty() { "none" } else { &names }
        );
        if mask & p.gpu.throttle_fail_mask != 0 {
            CheckResult::new(
                ID,
                Status::Fail,
                format!(
                    "throttled: {}",
                    throttle::names(mask & p.gpu.throttle_fail_mask).join(",")
                ),
            )
            .code("THROTTLE_HW")
            .evidence(ev)
        } else if mask & p.gpu.throttle_warn_mask != 0 {
            CheckResult::new(
                ID,
                Status::Warn,
                format!(
                    "throttled: {}",
                    throttle::names(mask & p.gpu.throttle_warn_mask).join(",")
                ),
            )
            .code("THROTTLE_THERMAL")
            .evidence(ev)
        } else {
            CheckResult::new(ID, Status::Pass, "no hardware or thermal throttling").evidence(ev)
        }
    })
}

fn gpu_pcie_link(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.pcie_link";
    per_gpu(ID, p, inputs, |g| {
        let l = &g.pcie;
        let (Some(cw), Some(mw)) = (l.current_width, l.max_width) else {
            return CheckResult::new(ID, Status::Unknown, "PCIe link width could not be read")
                .code("NVML_FIELD_UNREADABLE");
        };
        let want_w = p.gpu.pcie_width.unwrap_or(mw).max(mw);
        let ev = format!(
            "gen {}/{} width x{cw}/x{mw}",
            l.current_gen.map_or("?".into(), |v| v.to_string()),
            l.max_gen.map_or("?".into(), |v| v.to_string())
        );
        if cw < want_w {
            return CheckResult::new(
                ID,
                Status::Fail,
                format!("PCIe link trained at x{cw}, expected x{want_w}"),
            )
            .code("PCIE_WIDTH_DEGRADED")
            .value(f64::from(cw), "lanes")
            .threshold(format!(">= {want_w}"))
            .evidence(ev);
        }
        if let (Some(mg), Some(want)) = (l.max_gen, p.gpu.pcie_gen) {
            if mg < want {
                return CheckResult::new(
                    ID,
                    Status::Fail,
                    format!("PCIe link supports gen {mg}, expected gen {want}"),
                )
                .code("PCIE_GEN_BELOW_SKU")
                .evidence(ev);
            }
        }
        if let (Some(cg), Some(mg)) = (l.current_gen, l.max_gen) {
            // GPUs lower the link generation to save power while idle.
            let idle = g
                .throttle_reasons
                .is_some_and(|t| t & throttle::GPU_IDLE != 0);
            if cg < mg && !idle {
                return CheckResult::new(
                    ID,
                    Status::Warn,
                    format!("PCIe link at gen {cg} while busy, supports gen {mg}"),
                )
                .code("PCIE_GEN_DEGRADED")
                .evidence(ev);
            }
        }
        CheckResult::new(ID, Status::Pass, format!("x{cw} of x{mw}"))
            .value(f64::from(cw), "lanes")
            .evidence(ev)
    })
}

fn gpu_pcie_replay(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.pcie_replay";
    let prev = inputs
        .previous
        .as_ref()
        .filter(|s| s.boot_id.is_some() && s.boot_id == inputs.host.boot_id);
    per_gpu(ID, p, inputs, |g| {
        let Some(now) = g.pcie.replay_counter else {
            return CheckResult::new(ID, Status::Unknown, "PCIe replay counter could not be read")
                .code("NVML_FIELD_UNREADABLE");
        };
        let (growth, since) = match prev.and_then(|s| s.pcie_replay.get(&g.pci_bus_id)) {
            Some(&before) if before <= now => (now - before, "since the last run"),
            _ => (now, "since driver load"),
        };
        let r = CheckResult::new(ID, Status::Pass, format!("{growth} PCIe replays {since}"))
            .value(growth as f64, "replays")
            .threshold(format!("< {}", p.gpu.pcie_replay_warn))
            .better(false)
            .evidence(format!("replay counter {now}"));
        if growth >= p.gpu.pcie_replay_warn {
            CheckResult {
                status: Status::Warn,
                ..r
            }
            .code("PCIE_REPLAY")
        } else {
            r
        }
    })
}

fn gpu_nvlink(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.nvlink";
    if p.gpu.nvlink_links == Some(0) {
        return skip(ID, "the profile expects no NVLink");
    }
    // The node's only GPU (one GPU of a VM, a workstation): NVLink has no
    // peer to connect to.
    let alone = matches!(&inputs.gpu, Ok(s) if s.gpus.len() == 1)
        && inputs.machine.as_ref().map_or(true, |m| m.gpus.len() <= 1);
    per_gpu(ID, p, inputs, |g| {
        let Some(links) = &g.nvlink_active else {
            return match p.gpu.nvlink_links {
                Some(n) => CheckResult::new(
                    ID,
                    Status::Unknown,
                    format!("NVLink state could not be read ({n} links expected)"),
                )
                .code("NVML_FIELD_UNREADABLE"),
                None => CheckResult::new(ID, Status::Skip, "no NVLink reported"),
            };
        };
        if links.is_empty() {
            return CheckResult::new(ID, Status::Skip, "no NVLink reported");
        }
        let active = links.iter().filter(|a| **a).count() as u32;
        if active == 0 && alone && p.gpu.nvlink_links.is_none() {
            // NVML lists every link the part has, up or not; with no other
            // GPU and no count in the profile, none up is not a fault.
            return CheckResult::new(
                ID,
                Status::Skip,
                format!(
                    "the node's only GPU has none of its {} NVLink links active, and the profile gives no link count (set gpu.nvlink_links to check them)",
                    links.len()
                ),
            );
        }
        let expected = p.gpu.nvlink_links.unwrap_or(links.len() as u32);
        let down: Vec<String> = links
            .iter()
            .enumerate()
            .filter(|(_, a)| !**a)
            .map(|(i, _)| i.to_string())
            .collect();
        let r = CheckResult::new(
            ID,
            Status::Pass,
            format!("{active} of {expected} NVLink links active"),
        )
        .value(f64::from(active), "links")
        .threshold(format!(">= {expected}"))
        .better(true);
        if active < expected {
            CheckResult {
                status: Status::Fail,
                ..r
            }
            .code("NVLINK_DOWN")
            .evidence(format!("inactive links: {}", down.join(",")))
        } else {
            r
        }
    })
}

fn gpu_processes(p: &Profile, inputs: &Inputs, opts: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.processes";
    if !opts.expect_idle {
        return skip(
            ID,
            "not checked while jobs may run (use --expect-idle in a prolog or epilog)",
        );
    }
    per_gpu(ID, p, inputs, |g| match &g.processes {
        None => CheckResult::new(ID, Status::Unknown, "GPU processes could not be listed")
            .code("NVML_FIELD_UNREADABLE"),
        Some(ps) if ps.is_empty() => CheckResult::new(ID, Status::Pass, "no process on the GPU"),
        Some(ps) => {
            let pids: Vec<String> = ps.iter().map(|x| x.pid.to_string()).collect();
            CheckResult::new(
                ID,
                Status::Fail,
                format!("{} leftover process(es): pid {}", ps.len(), pids.join(",")),
            )
            .code("GPU_PROCESSES_LEFT")
            .value(ps.len() as f64, "processes")
        }
    })
}

fn gpu_clocks(p: &Profile, inputs: &Inputs, opts: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "gpu.clocks";
    per_gpu(ID, p, inputs, |g| {
        let idle = match &g.processes {
            Some(ps) => ps.is_empty(),
            None => opts.expect_idle,
        };
        if !idle {
            return CheckResult::new(
                ID,
                Status::Skip,
                "a job may be using the GPU: its clocks are the job's",
            );
        }
        let Some(c) = g.clocks else {
            return CheckResult::new(ID, Status::Unknown, "clocks could not be read")
                .code("NVML_FIELD_UNREADABLE");
        };
        let mhz = |v: Option<u32>| v.map_or("unknown".to_owned(), |x| format!("{x}"));
        let ev = format!(
            "current {}/{} MHz, application {}/{} MHz, default {}/{} MHz, max {}/{} MHz (graphics/memory)",
            mhz(c.graphics_mhz),
            mhz(c.memory_mhz),
            mhz(c.app_graphics_mhz),
            mhz(c.app_memory_mhz),
            mhz(c.default_app_graphics_mhz),
            mhz(c.default_app_memory_mhz),
            mhz(c.max_graphics_mhz),
            mhz(c.max_memory_mhz)
        );
        let app = c.app_graphics_mhz.zip(c.app_memory_mhz);
        let default = c.default_app_graphics_mhz.zip(c.default_app_memory_mhz);
        let (Some((ag, am)), Some((dg, dm))) = (app, default) else {
            return CheckResult::new(ID, Status::Unknown, "application clocks could not be read")
                .code("NVML_FIELD_UNREADABLE")
                .evidence(ev);
        };
        if ag < dg || am < dm {
            return CheckResult::new(
                ID,
                Status::Warn,
                format!("application clocks lowered to {ag}/{am} MHz (default {dg}/{dm} MHz)"),
            )
            .code("CLOCKS_LOWERED")
            .evidence(ev);
        }
        if (ag, am) != (dg, dm) {
            return CheckResult::new(
                ID,
                Status::Warn,
                format!(
                    "application clocks left at {ag}/{am} MHz (default {dg}/{dm} MHz) with no job: \
                     a prolog's setting not undone (keel tune reset, nvidia-smi -rac)"
                ),
            )
            .code("CLOCKS_LEFT_SET")
            .evidence(ev);
        }
        // An idle GPU drops its graphics clock far below the application
        // clock within seconds of its last kernel; one held at or above it
        // with no process (for as long as gather watched it) is locked.
        if let (true, Some(cur)) = (crate::gather::clock_held_without_process(g), c.graphics_mhz) {
            let held = inputs
                .clock_watch
                .map(|d| format!(" for {:.1} s", d.as_secs_f64()))
                .unwrap_or_default();
            return CheckResult::new(
                ID,
                Status::Warn,
                format!(
                    "graphics clock {cur} MHz with no process on the GPU{held}: clocks left \
                     locked (keel tune reset, nvidia-smi -rgc)"
                ),
            )
            .code("CLOCKS_LEFT_LOCKED")
            .evidence(ev);
        }
        let pass = CheckResult::new(ID, Status::Pass, "clocks at their defaults").evidence(ev);
        match inputs.clock_watch {
            Some(d) => pass.evidence(format!(
                "a GPU with no process held its boost clock: read again for {:.1} s until it fell",
                d.as_secs_f64()
            )),
            None => pass,
        }
    })
}

fn ib_hcas(m: &Machine) -> Vec<&keel_topo::machine::Hca> {
    m.hcas
        .iter()
        .filter(|h| h.link_layer() == Some("InfiniBand"))
        .collect()
}

/// Why sysfs may list no HCA whatever the hardware: the InfiniBand core
/// driver is not loaded, or the loaded modules are unknown. `None` when the
/// driver is loaded (an empty list is then a finding).
fn ib_driver_missing(inputs: &Inputs) -> Option<String> {
    match &inputs.host.modules {
        Ok(mods) if mods.iter().any(|x| x == "ib_core") => None,
        Ok(_) => Some("the ib_core module is not loaded".to_owned()),
        Err(e) => Some(format!("the loaded modules are unknown ({e})")),
    }
}

fn ib_ports(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "ib.ports";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    let hcas = ib_hcas(m);
    let expected = p.infiniband.hcas.unwrap_or(hcas.len() as u32);
    if expected == 0 && hcas.is_empty() {
        return skip(ID, "no InfiniBand expected on this node");
    }
    if hcas.is_empty() {
        // No HCA at all: without the InfiniBand core driver sysfs lists
        // none, present or not. Only a loaded driver makes it a finding.
        if let Some(why) = ib_driver_missing(inputs) {
            return vec![CheckResult::new(
                ID,
                Status::Unknown,
                format!(
                    "no InfiniBand HCA in sysfs (expected {expected}) and {why}: cannot tell missing hardware from a missing driver"
                ),
            )
            .code("IB_DRIVER_MISSING")];
        }
    }
    let mut out = Vec::new();
    if (hcas.len() as u32) < expected {
        out.push(
            CheckResult::new(
                ID,
                Status::Fail,
                format!("{} InfiniBand HCAs, expected {expected}", hcas.len()),
            )
            .code("IB_HCA_MISSING")
            .value(hcas.len() as f64, "HCAs")
            .threshold(format!("= {expected}")),
        );
    }
    for h in hcas {
        for port in &h.ports {
            let dev = Device {
                hca: Some(h.name.clone()),
                port: Some(port.port),
                pci: h.pci.map(|a| a.to_string()),
                ..Device::default()
            };
            let ev = format!(
                "state {} phys {} rate {}",
                port.state.as_deref().unwrap_or("?"),
                port.phys_state.as_deref().unwrap_or("?"),
                port.rate.as_deref().unwrap_or("?")
            );
            let r = match (port.state.as_deref(), port.rate_gbps) {
                (None, _) => CheckResult::new(ID, Status::Unknown, "port state could not be read")
                    .code("SYSFS_UNREADABLE"),
                (Some(s), _) if s != "ACTIVE" => {
                    CheckResult::new(ID, Status::Fail, format!("port is {s}")).code("IB_PORT_DOWN")
                }
                (Some(_), Some(rate)) => match p.infiniband.rate_gbps {
                    Some(want) if rate + 0.01 < want => CheckResult::new(
                        ID,
                        Status::Fail,
                        format!("port runs at {rate} Gb/s, expected {want} Gb/s"),
                    )
                    .code("IB_RATE_LOW")
                    .value(rate, "Gb/s")
                    .threshold(format!(">= {want}")),
                    want => CheckResult::new(ID, Status::Pass, format!("ACTIVE at {rate} Gb/s"))
                        .value(rate, "Gb/s")
                        .better(true)
                        .threshold(want.map_or_else(|| "ACTIVE".to_owned(), |w| format!(">= {w}"))),
                },
                (Some(_), None) => {
                    CheckResult::new(ID, Status::Unknown, "port rate could not be read")
                        .code("SYSFS_UNREADABLE")
                }
            };
            out.push(r.device(dev).evidence(ev));
        }
    }
    out
}

fn ib_flaps(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "ib.flaps";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    let hcas = ib_hcas(m);
    if hcas.is_empty() && p.infiniband.hcas.unwrap_or(0) == 0 {
        return skip(ID, "no InfiniBand expected on this node");
    }
    let log = match &inputs.host.kernel_log {
        Ok(l) => l,
        Err(e) => return unknown(ID, "KERNEL_LOG_UNREADABLE", e.clone()),
    };
    let Some(now) = inputs.host.uptime_s else {
        return unknown(ID, "UPTIME_UNREADABLE", "/proc/uptime could not be read");
    };
    let since = now - p.infiniband.flap_window_hours * 3600.0;
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    for h in &hcas {
        for n in &h.netdevs {
            counts.insert(n.clone(), 0);
        }
    }
    for rec in log {
        if (rec.usec as f64) / 1e6 < since {
            continue;
        }
        if let Some(ifname) = crate::kmsg::parse_lost_carrier(&rec.message) {
            if let Some(c) = counts.get_mut(&ifname) {
                *c += 1;
            }
        }
    }
    let window = format!("{} h", p.infiniband.flap_window_hours);
    let bad: Vec<CheckResult> = counts
        .iter()
        .filter(|(_, c)| **c >= p.infiniband.flap_fail)
        .map(|(ifname, c)| {
            let hca = hcas
                .iter()
                .find(|h| h.netdevs.contains(ifname))
                .map(|h| h.name.clone());
            CheckResult::new(
                ID,
                Status::Fail,
                format!("{ifname} lost carrier {c} times in the last {window}"),
            )
            .code("IB_LINK_FLAPS")
            .value(f64::from(*c), "flaps")
            .threshold(format!("< {}", p.infiniband.flap_fail))
            .device(Device {
                hca,
                ..Device::default()
            })
            .evidence(format!("interface {ifname}"))
        })
        .collect();
    if bad.is_empty() {
        let total: u32 = counts.values().sum();
        return vec![CheckResult::new(
            ID,
            Status::Pass,
            format!("{total} carrier losses on InfiniBand interfaces in the last {window}"),
        )
        .value(f64::from(total), "flaps")
        .threshold(format!("< {} per interface", p.infiniband.flap_fail))];
    }
    bad
}

fn ib_peermem(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "ib.peermem";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    if !p.infiniband.require_peermem || m.gpus.is_empty() || ib_hcas(m).is_empty() {
        return skip(ID, "GPUDirect RDMA needs GPUs and InfiniBand");
    }
    match &inputs.host.modules {
        Err(e) => unknown(ID, "MODULES_UNREADABLE", e.clone()),
        Ok(mods)
            if mods
                .iter()
                .any(|x| x == "nvidia_peermem" || x == "nv_peer_mem") =>
        {
            vec![CheckResult::new(ID, Status::Pass, "nvidia_peermem loaded")]
        }
        Ok(_) => vec![CheckResult::new(
            ID,
            Status::Fail,
            "nvidia_peermem is not loaded: no GPUDirect RDMA",
        )
        .code("PEERMEM_MISSING")],
    }
}

fn topology(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "topology";
    if p.topology.is_empty() {
        return skip(ID, "the profile has no expected layout");
    }
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    // No HCA listed and no driver to list them: only the GPUs' placement
    // can be compared.
    let hcas_unknown = if ib_hcas(m).is_empty() {
        ib_driver_missing(inputs)
    } else {
        None
    };
    let mut out = Vec::new();
    for want in &p.topology {
        let gpus: BTreeSet<String> = m
            .gpus
            .iter()
            .filter(|g| g.numa_node == Some(want.numa_node))
            .map(|g| g.pci.to_string())
            .collect();
        let hcas: BTreeSet<String> = ib_hcas(m)
            .iter()
            .filter(|h| h.numa_node == Some(want.numa_node))
            .filter_map(|h| h.pci.map(|a| a.to_string()))
            .collect();
        let want_g: BTreeSet<String> = want.gpus.iter().map(|s| s.to_ascii_lowercase()).collect();
        let want_h: BTreeSet<String> = want.hcas.iter().map(|s| s.to_ascii_lowercase()).collect();
        if gpus != want_g || (hcas != want_h && hcas_unknown.is_none()) {
            out.push(
                CheckResult::new(
                    ID,
                    Status::Fail,
                    format!(
                        "NUMA node {} has GPUs [{}] and HCAs [{}]",
                        want.numa_node,
                        join(&gpus),
                        join(&hcas)
                    ),
                )
                .code("TOPOLOGY_MISMATCH")
                .threshold(format!(
                    "GPUs [{}] HCAs [{}]",
                    join(&want_g),
                    join(&want_h)
                )),
            );
        }
    }
    if out.is_empty() {
        out.push(match hcas_unknown {
            Some(why) if p.topology.iter().any(|t| !t.hcas.is_empty()) => CheckResult::new(
                ID,
                Status::Unknown,
                format!(
                    "GPUs on all {} NUMA nodes as expected; HCA placement unknown: no HCA in sysfs and {why}",
                    p.topology.len()
                ),
            )
            .code("IB_DRIVER_MISSING"),
            _ => CheckResult::new(
                ID,
                Status::Pass,
                format!(
                    "GPUs and HCAs on all {} NUMA nodes as expected",
                    p.topology.len()
                ),
            ),
        });
    }
    out
}

fn join(s: &BTreeSet<String>) -> String {
    s.iter().cloned().collect::<Vec<_>>().join(",")
}

fn host_cpu(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "host.cpu";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    if m.sockets.is_empty() {
        // The topology files (`physical_package_id`) were unreadable: no
        // count to compare, not a count of zero.
        return unknown(
            ID,
            "SYSFS_UNREADABLE",
            "the CPU topology (sockets and cores) could not be read from sysfs".to_owned(),
        );
    }
    let sockets = m.sockets.len() as u32;
    let cores: u32 = m.sockets.iter().map(|s| s.cores as u32).sum();
    let tpc = m.threads_per_core;
    let seen = format!(
        "{sockets} socket(s), {cores} cores, {} thread(s)/core",
        tpc.map_or("?".into(), |t| t.to_string())
    );
    let mut problems = Vec::new();
    if let Some(w) = p.host.sockets.filter(|w| *w != sockets) {
        problems.push(format!("{sockets} sockets, expected {w}"));
    }
    if let Some(w) = p.host.cores.filter(|w| *w != cores) {
        problems.push(format!("{cores} cores, expected {w}"));
    }
    if let (Some(w), Some(t)) = (p.host.threads_per_core, tpc) {
        if w != t {
            problems.push(format!("{t} threads per core, expected {w}"));
        }
    }
    if problems.is_empty() {
        vec![CheckResult::new(ID, Status::Pass, seen).value(f64::from(cores), "cores")]
    } else {
        vec![CheckResult::new(ID, Status::Fail, problems.join("; "))
            .code("CPU_MISMATCH")
            .value(f64::from(cores), "cores")]
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn host_memory(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "host.memory";
    let Some(total) = inputs.host.mem_total_bytes else {
        return unknown(
            ID,
            "MEMINFO_UNREADABLE",
            "MemTotal could not be read from /proc/meminfo",
        );
    };
    let gib = total as f64 / GIB;
    let r = CheckResult::new(ID, Status::Pass, format!("{gib:.1} GiB"))
        .value((gib * 10.0).round() / 10.0, "GiB")
        .better(true);
    match p.host.memory_gib {
        Some(want) => {
            let min = want * (1.0 - p.host.memory_tolerance_pct / 100.0);
            let r = r.threshold(format!(">= {min:.1}"));
            if gib < min {
                vec![CheckResult {
                    status: Status::Fail,
                    detail: format!("{gib:.1} GiB, expected about {want} GiB"),
                    ..r
                }
                .code("MEMORY_LOW")]
            } else {
                vec![r]
            }
        }
        None => vec![r],
    }
}

fn host_swap(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "host.swap";
    let Some(swap) = inputs.host.swap_total_bytes else {
        return unknown(
            ID,
            "MEMINFO_UNREADABLE",
            "SwapTotal could not be read from /proc/meminfo",
        );
    };
    let gib = swap as f64 / GIB;
    if swap > 0 && !p.host.allow_swap {
        vec![
            CheckResult::new(ID, Status::Warn, format!("{gib:.1} GiB of swap is enabled"))
                .code("SWAP_ENABLED")
                .value(gib, "GiB"),
        ]
    } else {
        vec![CheckResult::new(
            ID,
            Status::Pass,
            if swap == 0 {
                "no swap".to_owned()
            } else {
                format!("{gib:.1} GiB of swap")
            },
        )
        .value(gib, "GiB")]
    }
}

fn host_disk(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "host.disk";
    if p.host.disks.is_empty() {
        return skip(ID, "no mount to check");
    }
    p.host
        .disks
        .iter()
        .map(|d| {
            let dev = Device {
                mount: Some(d.mount.clone()),
                ..Device::default()
            };
            match inputs.host.disk_free.get(&d.mount) {
                None => CheckResult::new(ID, Status::Unknown, "not read").code("DISK_UNREADABLE"),
                Some(Err(e)) => {
                    CheckResult::new(ID, Status::Unknown, e.clone()).code("DISK_UNREADABLE")
                }
                Some(Ok(free)) => {
                    let gib = *free as f64 / GIB;
                    let r = CheckResult::new(ID, Status::Pass, format!("{gib:.1} GiB free"))
                        .value((gib * 10.0).round() / 10.0, "GiB")
                        .threshold(format!(">= {}", d.min_free_gib));
                    if gib < d.min_free_gib {
                        CheckResult {
                            status: Status::Fail,
                            ..r
                        }
                        .code("DISK_FULL")
                    } else {
                        r
                    }
                }
            }
            .device(dev)
        })
        .collect()
}

fn host_nvme(p: &Profile, inputs: &Inputs, _: RunOptions) -> Vec<CheckResult> {
    const ID: &str = "host.nvme";
    let m = match &inputs.machine {
        Ok(m) => m,
        Err(e) => return unknown(ID, "SYSFS_UNREADABLE", e.clone()),
    };
    let found = m.nvme.len() as u32;
    match p.host.nvme {
        None => vec![
            CheckResult::new(ID, Status::Pass, format!("{found} NVMe drives"))
                .value(f64::from(found), "drives"),
        ],
        Some(want) if found < want => vec![CheckResult::new(
            ID,
            Status::Fail,
            format!("{found} NVMe drives, expected {want}"),
        )
        .code("NVME_MISSING")
        .value(f64::from(found), "drives")
        .threshold(format!("= {want}"))],
        Some(want) => vec![
            CheckResult::new(ID, Status::Pass, format!("{found} NVMe drives"))
                .value(f64::from(found), "drives")
                .threshold(format!("= {want}")),
        ],
    }
}
