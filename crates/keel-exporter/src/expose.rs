//! Readings to text: keel's metric names ([`render`]) or dcgm-exporter's
//! ([`crate::dcgm::render`]). Pure: the same readings give the same text.
//! A reading that is `None` leaves no sample.

use keel_gpu::{GpuReading, GpuSnapshot};

use crate::readings::{GpuState, Readings};
use crate::text::{Exposition, Kind};

use Kind::{Counter, Gauge};

/// The clocks-event reasons exposed, in bit order.
pub const THROTTLE_REASONS: &[(u64, &str)] = &[
    (keel_gpu::throttle::GPU_IDLE, "gpu_idle"),
    (
        keel_gpu::throttle::APPLICATIONS_CLOCKS_SETTING,
        "applications_clocks_setting",
    ),
    (keel_gpu::throttle::SW_POWER_CAP, "sw_power_cap"),
    (keel_gpu::throttle::HW_SLOWDOWN, "hw_slowdown"),
    (keel_gpu::throttle::SYNC_BOOST, "sync_boost"),
    (
        keel_gpu::throttle::SW_THERMAL_SLOWDOWN,
        "sw_thermal_slowdown",
    ),
    (
        keel_gpu::throttle::HW_THERMAL_SLOWDOWN,
        "hw_thermal_slowdown",
    ),
    (
        keel_gpu::throttle::HW_POWER_BRAKE_SLOWDOWN,
        "hw_power_brake_slowdown",
    ),
];

/// keel's own names (`keel_gpu_*`, `keel_hca_*`, `keel_exporter_*`, and
/// keel check's `keel_check_*` passed through).
pub fn render(r: &Readings) -> String {
    let mut e = Exposition::new();
    exporter_metrics(&mut e, &r.gpu);
    expected_metrics(&mut e, r);
    if let Some(snap) = &r.gpu.snapshot {
        gpu_metrics(&mut e, snap);
        xid_metrics(&mut e, r, Some(snap));
    } else {
        xid_metrics(&mut e, r, None);
    }
    job_metrics(&mut e, r);
    hca_metrics(&mut e, r);
    let mut out = e.render();
    check_passthrough(&mut out, r);
    out
}

pub(crate) fn exporter_metrics(e: &mut Exposition, g: &GpuState) {
    e.add(
        "keel_exporter_gpu_up",
        Gauge,
        "1 when GPU readings are exposed (fresh or the last good ones), 0 when the probe never answered with a snapshot.",
        &[],
        if g.snapshot.is_some() { 1.0 } else { 0.0 },
    );
    e.add(
        "keel_exporter_gpu_stale",
        Gauge,
        "1 when the GPU probe did not answer this scrape within the deadline or failed, and the last good readings are shown.",
        &[],
        if g.stale { 1.0 } else { 0.0 },
    );
    if let Some(age) = g.age_s {
        e.add(
            "keel_exporter_gpu_readings_age_seconds",
            Gauge,
            "Seconds since the GPU readings shown were taken.",
            &[],
            age,
        );
    }
    if let Some(f) = g.error {
        e.add(
            "keel_exporter_gpu_probe_error",
            Gauge,
            "1 with the reason when the GPU probe's last answer was an error.",
            &[("reason", f.label())],
            1.0,
        );
    }
}

/// The GPU count the node's SKU profile expects, when the exporter knows
/// it: shown whether or not NVML answers, so a node that boots short of a
/// GPU, or whose GPUs cannot be read at all, is measured against it.
pub(crate) fn expected_metrics(e: &mut Exposition, r: &Readings) {
    if let Some(x) = &r.expected {
        e.add(
            "keel_gpu_devices_expected",
            Gauge,
            "GPUs the node's SKU profile says it has (exporter.sku or exporter.gpus, else Azure's vmSize).",
            &[("sku", &x.sku)],
            f64::from(x.gpus),
        );
    }
}

fn ratio(p: u32) -> f64 {
    f64::from(p) / 100.0
}

fn b(v: bool) -> f64 {
    if v {
        1.0
    } else {
        0.0
    }
}

fn gpu_metrics(e: &mut Exposition, snap: &GpuSnapshot) {
    e.add(
        "keel_gpu_devices",
        Gauge,
        "GPUs NVML counts, those it could not open included.",
        &[],
        (snap.gpus.len() + snap.unopened.len()) as f64,
    );
    for u in &snap.unopened {
        let idx = u.index.to_string();
        e.add(
            "keel_gpu_lost",
            Gauge,
            "1 for a GPU NVML counts but says is lost (fell off the bus), 0 for one it could not open for another reason.",
            &[("gpu", &idx)],
            b(u.lost),
        );
    }
    let driver = snap.driver_version.as_deref().unwrap_or("");
    for g in &snap.gpus {
        gpu(e, g, driver);
    }
}

fn gpu(e: &mut Exposition, g: &GpuReading, driver: &str) {
    let idx = g.index.to_string();
    let uuid = g.uuid.as_deref().unwrap_or("");
    let l: &[(&str, &str)] = &[("gpu", &idx), ("uuid", uuid)];
    e.add(
        "keel_gpu_info",
        Gauge,
        "1 for each GPU NVML opened, with its PCI address, model and driver version.",
        &cat(
            l,
            &[
                ("pci_bus_id", &g.pci_bus_id),
                ("model", g.name.as_deref().unwrap_or("")),
                ("driver_version", driver),
            ],
        ),
        1.0,
    );
    macro_rules! opt {
        ($name:expr, $kind:expr, $help:expr, $v:expr) => {
            if let Some(v) = $v {
                e.add($name, $kind, $help, l, v);
            }
        };
    }
    opt!("keel_gpu_utilization_ratio", Gauge,
        "Fraction of the last sample period (1/6 s to 1 s) in which a kernel ran (NVML utilization rates).",
        g.utilization_gpu_percent.map(ratio));
    opt!(
        "keel_gpu_memory_utilization_ratio",
        Gauge,
        "Fraction of the last sample period in which device memory was read or written.",
        g.utilization_memory_percent.map(ratio)
    );
    opt!(
        "keel_gpu_memory_used_bytes",
        Gauge,
        "Device memory in use (reserved memory included).",
        g.memory_used_bytes.map(|v| v as f64)
    );
    opt!(
        "keel_gpu_memory_total_bytes",
        Gauge,
        "Device memory in all.",
        g.memory_total_bytes.map(|v| v as f64)
    );
    opt!(
        "keel_gpu_power_watts",
        Gauge,
        "Power draw as NVML reports it (a 1 s average, instantaneous on A100).",
        g.power_w
    );
    opt!(
        "keel_gpu_power_limit_watts",
        Gauge,
        "Power limit the driver enforces.",
        g.power_limit_w
    );
    opt!(
        "keel_gpu_energy_joules_total",
        Counter,
        "Energy used since the driver loaded.",
        g.energy_millijoules.map(|mj| mj as f64 / 1000.0)
    );
    opt!(
        "keel_gpu_temperature_celsius",
        Gauge,
        "GPU die temperature.",
        g.temperature_c.map(f64::from)
    );
    opt!(
        "keel_gpu_memory_temperature_celsius",
        Gauge,
        "Device memory (HBM) temperature.",
        g.memory_temperature_c.map(f64::from)
    );
    opt!(
        "keel_gpu_sm_clock_hertz",
        Gauge,
        "Streaming multiprocessor clock.",
        g.sm_clock_mhz.map(|m| f64::from(m) * 1e6)
    );
    opt!(
        "keel_gpu_memory_clock_hertz",
        Gauge,
        "Memory clock.",
        g.memory_clock_mhz.map(|m| f64::from(m) * 1e6)
    );
    opt!(
        "keel_gpu_persistence_mode",
        Gauge,
        "1 when persistence mode is on.",
        g.persistence_mode.map(b)
    );
    opt!(
        "keel_gpu_ecc_enabled",
        Gauge,
        "1 when ECC is on.",
        g.ecc_enabled.map(b)
    );
    if let Some(mask) = g.throttle_reasons {
        for (bit, name) in THROTTLE_REASONS {
            e.add(
                "keel_gpu_throttle_reason",
                Gauge,
                "1 when NVML reports this clocks-event (throttle) reason active.",
                &cat(l, &[("reason", name)]),
                b(mask & bit != 0),
            );
        }
    }
    let c = &g.ecc;
    for (v, counter, location, kind) in [
        (
            c.volatile_sram_uncorrected,
            "volatile",
            "sram",
            "uncorrected",
        ),
        (
            c.volatile_dram_uncorrected,
            "volatile",
            "dram",
            "uncorrected",
        ),
        (c.volatile_sram_corrected, "volatile", "sram", "corrected"),
        (c.volatile_dram_corrected, "volatile", "dram", "corrected"),
        (
            c.aggregate_sram_uncorrected,
            "aggregate",
            "sram",
            "uncorrected",
        ),
        (
            c.aggregate_dram_uncorrected,
            "aggregate",
            "dram",
            "uncorrected",
        ),
        (c.aggregate_sram_corrected, "aggregate", "sram", "corrected"),
        (c.aggregate_dram_corrected, "aggregate", "dram", "corrected"),
    ] {
        if let Some(v) = v {
            e.add(
                "keel_gpu_ecc_errors_total",
                Counter,
                "ECC errors by type and location; volatile since the driver loaded, aggregate over the GPU's life.",
                &cat(l, &[("counter", counter), ("location", location), ("type", kind)]),
                v as f64,
            );
        }
    }
    opt!(
        "keel_gpu_retired_pages_pending",
        Gauge,
        "1 when retired pages wait for a reboot (before Ampere).",
        g.retired_pages_pending.map(b)
    );
    if let Some(r) = g.remapped_rows {
        e.add(
            "keel_gpu_remapped_rows",
            Gauge,
            "Memory rows remapped, by the error that caused it (Ampere and later).",
            &cat(l, &[("type", "correctable")]),
            f64::from(r.correctable),
        );
        e.add(
            "keel_gpu_remapped_rows",
            Gauge,
            "",
            &cat(l, &[("type", "uncorrectable")]),
            f64::from(r.uncorrectable),
        );
        e.add(
            "keel_gpu_row_remap_pending",
            Gauge,
            "1 when a row remap waits for a GPU reset.",
            l,
            b(r.pending),
        );
        e.add(
            "keel_gpu_row_remap_failure",
            Gauge,
            "1 when a row remap failed (the GPU needs service).",
            l,
            b(r.failure),
        );
    }
    let p = &g.pcie;
    opt!(
        "keel_gpu_pcie_replays_total",
        Counter,
        "PCIe replays since the driver loaded.",
        p.replay_counter.map(|v| v as f64)
    );
    opt!(
        "keel_gpu_pcie_link_width",
        Gauge,
        "PCIe link width in lanes now.",
        p.current_width.map(f64::from)
    );
    opt!(
        "keel_gpu_pcie_link_max_width",
        Gauge,
        "Widest PCIe link the GPU and its slot support.",
        p.max_width.map(f64::from)
    );
    opt!(
        "keel_gpu_pcie_link_generation",
        Gauge,
        "PCIe generation of the link now.",
        p.current_gen.map(f64::from)
    );
    opt!(
        "keel_gpu_pcie_link_max_generation",
        Gauge,
        "Highest PCIe generation the GPU and its slot support.",
        p.max_gen.map(f64::from)
    );
    if let Some(links) = &g.nvlink_active {
        for (i, active) in links.iter().enumerate() {
            let link = i.to_string();
            e.add(
                "keel_gpu_nvlink_active",
                Gauge,
                "1 when the NVLink link is active.",
                &cat(l, &[("link", &link)]),
                b(*active),
            );
        }
    }
    if let Some(links) = &g.nvlink_errors {
        for (i, errs) in links.iter().enumerate() {
            let link = i.to_string();
            for (v, kind) in [
                (errs.replay, "replay"),
                (errs.recovery, "recovery"),
                (errs.crc_flit, "crc_flit"),
                (errs.crc_data, "crc_data"),
            ] {
                if let Some(v) = v {
                    e.add(
                        "keel_gpu_nvlink_errors_total",
                        Counter,
                        "NVLink data-link errors since the driver loaded, by link and type.",
                        &cat(l, &[("link", &link), ("type", kind)]),
                        v as f64,
                    );
                }
            }
        }
    }
    opt!(
        "keel_gpu_processes",
        Gauge,
        "Compute processes on the GPU.",
        g.processes.as_ref().map(|p| p.len() as f64)
    );
}

/// The GPU index whose PCI address the driver's `dddd:bb:dd` names.
pub(crate) fn gpu_of_pci<'a>(snap: Option<&'a GpuSnapshot>, pci: &str) -> Option<&'a GpuReading> {
    let snap = snap?;
    snap.gpus.iter().find(|g| {
        g.pci_bus_id
            .rsplit_once('.')
            .map(|(head, _)| head)
            .is_some_and(|head| head.eq_ignore_ascii_case(pci))
    })
}

fn xid_metrics(e: &mut Exposition, r: &Readings, snap: Option<&GpuSnapshot>) {
    e.add(
        "keel_exporter_kernel_log_readable",
        Gauge,
        "1 when the kernel log (/dev/kmsg) could be read for XIDs.",
        &[],
        b(r.xids.is_some()),
    );
    for x in r.xids.iter().flatten() {
        let g = gpu_of_pci(snap, &x.pci);
        let idx = g.map(|g| g.index.to_string()).unwrap_or_default();
        let uuid = g.and_then(|g| g.uuid.as_deref()).unwrap_or("");
        let code = x.code.to_string();
        e.add(
            "keel_gpu_xid_errors_total",
            Counter,
            "NVIDIA XID errors in the kernel log since boot (as far back as the log reaches), by GPU and XID code.",
            &[("gpu", &idx), ("uuid", uuid), ("pci", &x.pci), ("xid", &code)],
            x.count as f64,
        );
    }
}

fn job_metrics(e: &mut Exposition, r: &Readings) {
    let uuid_of = |i: u32| {
        r.gpu
            .snapshot
            .as_ref()
            .and_then(|s| s.gpus.iter().find(|g| g.index == i))
            .and_then(|g| g.uuid.clone())
            .unwrap_or_default()
    };
    for (gpu, jobs) in &r.jobs {
        let idx = gpu.to_string();
        let uuid = uuid_of(*gpu);
        for j in jobs {
            e.add(
                "keel_gpu_job_info",
                Gauge,
                "1 for each Slurm job that holds the GPU (its processes' cgroup or environment, or the job-mapping directory).",
                &[
                    ("gpu", &idx),
                    ("uuid", &uuid),
                    ("slurm_job", &j.id),
                    ("user", j.user.as_deref().unwrap_or("")),
                    ("partition", j.partition.as_deref().unwrap_or("")),
                ],
                1.0,
            );
        }
    }
    for j in &r.idle {
        let l: &[(&str, &str)] = &[
            ("slurm_job", &j.job),
            ("user", j.user.as_deref().unwrap_or("")),
            ("partition", j.partition.as_deref().unwrap_or("")),
        ];
        e.add(
            "keel_job_gpu_idle_seconds_total",
            Counter,
            "GPU-seconds this exporter saw the job's GPUs below the idle threshold.",
            l,
            j.idle_gpu_seconds,
        );
        e.add(
            "keel_job_gpu_observed_seconds_total",
            Counter,
            "GPU-seconds this exporter saw the job hold GPUs.",
            l,
            j.observed_gpu_seconds,
        );
        e.add("keel_job_gpu_idle", Gauge,
            "1 when every GPU of the job has been below the idle threshold for the policy's idle_minutes.", l, b(j.idle));
    }
}

fn hca_metrics(e: &mut Exposition, r: &Readings) {
    e.add(
        "keel_exporter_hca_readable",
        Gauge,
        "1 when /sys/class/infiniband could be listed (a node without HCAs has no ports).",
        &[],
        b(r.hca_ports.is_some()),
    );
    for p in r.hca_ports.iter().flatten() {
        let port = p.port.to_string();
        let l: &[(&str, &str)] = &[("hca", &p.hca), ("port", &port)];
        e.add(
            "keel_hca_port_info",
            Gauge,
            "1 for each HCA port, with its state, physical state and link layer.",
            &[
                ("hca", &p.hca),
                ("port", &port),
                ("state", p.state.as_deref().unwrap_or("")),
                ("phys_state", p.phys_state.as_deref().unwrap_or("")),
                ("link_layer", p.link_layer.as_deref().unwrap_or("")),
            ],
            1.0,
        );
        if let Some(s) = &p.state {
            e.add(
                "keel_hca_port_active",
                Gauge,
                "1 when the port's state is ACTIVE.",
                l,
                b(s == "ACTIVE"),
            );
        }
        if let Some(g) = p.rate_gbps {
            e.add(
                "keel_hca_port_rate_bytes_per_second",
                Gauge,
                "The port's link rate.",
                l,
                g * 1e9 / 8.0,
            );
        }
        for (name, v) in &p.counters {
            e.add(
                "keel_hca_port_errors_total",
                Counter,
                "The port's error counters (sysfs counters/), by counter name.",
                &[("hca", &p.hca), ("port", &port), ("counter", name)],
                *v as f64,
            );
        }
    }
}

/// keel check's textfile, its `keel_check_*` lines only.
pub(crate) fn check_passthrough(out: &mut String, r: &Readings) {
    let Some(check) = &r.check else { return };
    let ok = check.is_ok();
    out.push_str("# HELP keel_exporter_check_readable 1 when keel check's textfile could be read.\n# TYPE keel_exporter_check_readable gauge\n");
    out.push_str(if ok {
        "keel_exporter_check_readable 1\n"
    } else {
        "keel_exporter_check_readable 0\n"
    });
    if let Ok(text) = check {
        // Only keel check's own, well-formed lines: a damaged file must not
        // make the whole scrape unparseable.
        for line in text.lines() {
            let meta = line
                .strip_prefix("# HELP ")
                .or_else(|| line.strip_prefix("# TYPE "));
            let ok = match meta {
                Some(rest) => rest.starts_with("keel_check_") && !rest.ends_with("_total"),
                None => line.starts_with("keel_check_") && crate::text::is_sample_line(line),
            };
            if ok {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

fn cat<'a>(l: &[(&'a str, &'a str)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v = l.to_vec();
    v.extend_from_slice(extra);
    v
}
