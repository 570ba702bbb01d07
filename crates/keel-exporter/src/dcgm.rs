//! dcgm-exporter's metric names and labels, so dashboards and alerts made
//! for it work unchanged: `DCGM_FI_DEV_*` in dcgm-exporter's units (percent,
//! MiB, MHz, millijoules), labels `gpu`, `UUID`, `pci_bus_id`, `device`
//! (`nvidia<index>`, as dcgm-exporter names it), `modelName`, `Hostname`
//! and `DCGM_FI_DRIVER_VERSION`; a GPU held by Slurm jobs has its series
//! once per job with `hpc_job`, as dcgm-exporter's job-mapping directory
//! gives. XIDs as dcgm-exporter gives them (NVIDIA/dcgm-exporter
//! `etc/default-counters.csv`, `internal/pkg/collector/expcollector.go`):
//! `DCGM_FI_DEV_XID_ERRORS`, the value of each GPU's last XID (0 when the
//! kernel log holds none), and `DCGM_EXP_XID_ERRORS_COUNT{xid,
//! window_size_in_ms}`, the XIDs of the last window (5 minutes, `-x`), a
//! single 0 series for a GPU without any. The exporter's own gauges, HCA
//! ports and keel check's lines keep keel's names (dcgm-exporter has none).

use keel_gpu::GpuReading;

use crate::expose::{check_passthrough, expected_metrics, exporter_metrics};
use crate::readings::{Readings, XidWindow};
use crate::text::{Exposition, Kind};

use Kind::{Counter, Gauge};

/// NVML's bus id form: domain in 8 hex digits, uppercase
/// (`00000001:00:00.0`).
fn nvml_bus_id(sysfs: &str) -> String {
    match sysfs.split_once(':') {
        Some((domain, rest)) => format!("{:0>8}:{}", domain, rest).to_ascii_uppercase(),
        None => sysfs.to_ascii_uppercase(),
    }
}

fn sum(values: impl IntoIterator<Item = Option<u64>>) -> Option<u64> {
    values
        .into_iter()
        .flatten()
        .fold(None, |acc, v| Some(acc.unwrap_or(0u64).saturating_add(v)))
}

const MIB: f64 = 1024.0 * 1024.0;

/// The readings under dcgm-exporter's names.
pub fn render(r: &Readings) -> String {
    let mut e = Exposition::new();
    exporter_metrics(&mut e, &r.gpu);
    expected_metrics(&mut e, r);
    let snap = r.gpu.snapshot.as_deref();
    let driver = snap.and_then(|s| s.driver_version.as_deref()).unwrap_or("");
    let window = r.xid_window.as_ref();
    for g in snap.iter().flat_map(|s| s.gpus.iter()) {
        let jobs: Vec<Option<&str>> = match r.jobs.get(&g.index) {
            Some(list) if !list.is_empty() => list.iter().map(|j| Some(j.id.as_str())).collect(),
            _ => vec![None],
        };
        let last_xid = window.map(|w| last_xid(w, g));
        for job in jobs {
            gpu(&mut e, g, driver, &r.hostname, job, last_xid);
        }
    }
    if let Some(w) = window {
        for g in snap.iter().flat_map(|s| s.gpus.iter()) {
            xid_count(&mut e, w, g, driver, &r.hostname);
        }
    }
    let mut out = e.render();
    check_passthrough(&mut out, r);
    out
}

/// The PCI device (`dddd:bb:dd`) the driver names a GPU by in XID lines.
fn xid_device(g: &GpuReading) -> &str {
    g.pci_bus_id
        .rsplit_once('.')
        .map_or(g.pci_bus_id.as_str(), |(head, _)| head)
}

/// The code of the GPU's last XID, 0 when none was logged.
fn last_xid(w: &XidWindow, g: &GpuReading) -> f64 {
    let dev = xid_device(g);
    w.last
        .iter()
        .find(|(pci, _)| pci.eq_ignore_ascii_case(dev))
        .map_or(0.0, |(_, code)| f64::from(*code))
}

fn xid_count(e: &mut Exposition, w: &XidWindow, g: &GpuReading, driver: &str, hostname: &str) {
    let idx = g.index.to_string();
    let device = format!("nvidia{idx}");
    let bus = nvml_bus_id(&g.pci_bus_id);
    let window = w.window_ms.to_string();
    let base: Vec<(&str, &str)> = vec![
        ("gpu", &idx),
        ("UUID", g.uuid.as_deref().unwrap_or("")),
        ("pci_bus_id", &bus),
        ("device", &device),
        ("modelName", g.name.as_deref().unwrap_or("")),
        ("Hostname", hostname),
        ("DCGM_FI_DRIVER_VERSION", driver),
        ("window_size_in_ms", &window),
    ];
    let help =
        "Count of XID errors within user-specified time window (see xid-count-window-size flag).";
    let dev = xid_device(g);
    let mut any = false;
    for x in w.counts.iter().filter(|x| x.pci.eq_ignore_ascii_case(dev)) {
        let code = x.code.to_string();
        let mut l = base.clone();
        l.push(("xid", &code));
        e.add("DCGM_EXP_XID_ERRORS_COUNT", Gauge, help, &l, x.count as f64);
        any = true;
    }
    if !any {
        e.add("DCGM_EXP_XID_ERRORS_COUNT", Gauge, help, &base, 0.0);
    }
}

fn gpu(
    e: &mut Exposition,
    g: &GpuReading,
    driver: &str,
    hostname: &str,
    job: Option<&str>,
    last_xid: Option<f64>,
) {
    let idx = g.index.to_string();
    let device = format!("nvidia{idx}");
    let bus = nvml_bus_id(&g.pci_bus_id);
    let mut l: Vec<(&str, &str)> = vec![
        ("gpu", &idx),
        ("UUID", g.uuid.as_deref().unwrap_or("")),
        ("pci_bus_id", &bus),
        ("device", &device),
        ("modelName", g.name.as_deref().unwrap_or("")),
        ("Hostname", hostname),
        ("DCGM_FI_DRIVER_VERSION", driver),
    ];
    if let Some(j) = job {
        l.push(("hpc_job", j));
    }
    let mut add = |name: &str, kind: Kind, help: &'static str, v: Option<f64>| {
        if let Some(v) = v {
            e.add(name, kind, help, &l, v);
        }
    };
    let f = |v: Option<u32>| v.map(f64::from);
    let u = |v: Option<u64>| v.map(|v| v as f64);
    add(
        "DCGM_FI_DEV_XID_ERRORS",
        Gauge,
        "Value of the last XID error encountered.",
        last_xid,
    );
    add(
        "DCGM_FI_DEV_SM_CLOCK",
        Gauge,
        "SM clock frequency (in MHz).",
        f(g.sm_clock_mhz),
    );
    add(
        "DCGM_FI_DEV_MEM_CLOCK",
        Gauge,
        "Memory clock frequency (in MHz).",
        f(g.memory_clock_mhz),
    );
    add(
        "DCGM_FI_DEV_GPU_TEMP",
        Gauge,
        "GPU temperature (in C).",
        f(g.temperature_c),
    );
    add(
        "DCGM_FI_DEV_MEMORY_TEMP",
        Gauge,
        "Memory temperature (in C).",
        f(g.memory_temperature_c),
    );
    add(
        "DCGM_FI_DEV_POWER_USAGE",
        Gauge,
        "Power draw (in W).",
        g.power_w,
    );
    add(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        Gauge,
        "Enforced power limit (in W).",
        g.power_limit_w,
    );
    add(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        Counter,
        "Total energy consumption since boot (in mJ).",
        u(g.energy_millijoules),
    );
    add(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        Counter,
        "Total number of PCIe retries.",
        u(g.pcie.replay_counter),
    );
    add(
        "DCGM_FI_DEV_PCIE_LINK_GEN",
        Gauge,
        "PCIe link generation.",
        f(g.pcie.current_gen),
    );
    add(
        "DCGM_FI_DEV_PCIE_LINK_WIDTH",
        Gauge,
        "PCIe link width (lanes).",
        f(g.pcie.current_width),
    );
    add(
        "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
        Gauge,
        "Maximum PCIe link generation.",
        f(g.pcie.max_gen),
    );
    add(
        "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
        Gauge,
        "Maximum PCIe link width (lanes).",
        f(g.pcie.max_width),
    );
    add(
        "DCGM_FI_DEV_GPU_UTIL",
        Gauge,
        "GPU utilization (in %).",
        f(g.utilization_gpu_percent),
    );
    add(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        Gauge,
        "Memory utilization (in %).",
        f(g.utilization_memory_percent),
    );
    add(
        "DCGM_FI_DEV_FB_USED",
        Gauge,
        "Framebuffer memory used (in MiB).",
        g.memory_used_bytes.map(|b| (b as f64 / MIB).floor()),
    );
    add(
        "DCGM_FI_DEV_FB_FREE",
        Gauge,
        "Framebuffer memory free (in MiB).",
        g.memory_total_bytes
            .zip(g.memory_used_bytes)
            .map(|(t, used)| (t.saturating_sub(used) as f64 / MIB).floor()),
    );
    add(
        "DCGM_FI_DEV_FB_TOTAL",
        Gauge,
        "Framebuffer memory total (in MiB).",
        g.memory_total_bytes.map(|b| (b as f64 / MIB).floor()),
    );
    add(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        Gauge,
        "Current clock throttle reasons (bit mask).",
        g.throttle_reasons.map(|m| m as f64),
    );
    let c = &g.ecc;
    add(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        Counter,
        "Total number of single-bit volatile ECC errors.",
        u(sum([c.volatile_sram_corrected, c.volatile_dram_corrected])),
    );
    add(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        Counter,
        "Total number of double-bit volatile ECC errors.",
        u(sum([
            c.volatile_sram_uncorrected,
            c.volatile_dram_uncorrected,
        ])),
    );
    add(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        Counter,
        "Total number of single-bit persistent ECC errors.",
        u(sum([
            c.aggregate_sram_corrected,
            c.aggregate_dram_corrected,
        ])),
    );
    add(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        Counter,
        "Total number of double-bit persistent ECC errors.",
        u(sum([
            c.aggregate_sram_uncorrected,
            c.aggregate_dram_uncorrected,
        ])),
    );
    if let Some(rr) = g.remapped_rows {
        add(
            "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
            Counter,
            "Number of remapped rows for correctable errors.",
            Some(f64::from(rr.correctable)),
        );
        add(
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
            Counter,
            "Number of remapped rows for uncorrectable errors.",
            Some(f64::from(rr.uncorrectable)),
        );
        add(
            "DCGM_FI_DEV_ROW_REMAP_FAILURE",
            Gauge,
            "Whether remapping of rows has failed.",
            Some(if rr.failure { 1.0 } else { 0.0 }),
        );
        add(
            "DCGM_FI_DEV_ROW_REMAP_PENDING",
            Gauge,
            "Whether remapping of rows is pending.",
            Some(if rr.pending { 1.0 } else { 0.0 }),
        );
    }
    if let Some(links) = &g.nvlink_errors {
        add(
            "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
            Counter,
            "Total number of NVLink flow-control CRC errors.",
            u(sum(links.iter().map(|l| l.crc_flit))),
        );
        add(
            "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
            Counter,
            "Total number of NVLink data CRC errors.",
            u(sum(links.iter().map(|l| l.crc_data))),
        );
        add(
            "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
            Counter,
            "Total number of NVLink retries.",
            u(sum(links.iter().map(|l| l.replay))),
        );
        add(
            "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
            Counter,
            "Total number of NVLink recovery errors.",
            u(sum(links.iter().map(|l| l.recovery))),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_in_nvml_form() {
        assert_eq!(nvml_bus_id("0001:00:00.0"), "00000001:00:00.0");
        assert_eq!(nvml_bus_id("0000:3b:00.0"), "00000000:3B:00.0");
        assert_eq!(sum([None, None]), None);
        assert_eq!(sum([Some(2), None, Some(3)]), Some(5));
    }
}
