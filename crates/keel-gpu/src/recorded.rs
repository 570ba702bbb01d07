//! Snapshots recorded on real machines (`keel check record --out FILE`),
//! replayed by fixtures and tests.
//!
//! A snapshot file is [`to_json`] of a [`GpuSnapshot`]: pretty JSON with a
//! `version` field ([`SNAPSHOT_VERSION`]). [`parse`] refuses unknown fields
//! and other versions, naming the file.
//!
//! # Recording a fixture on a GPU machine
//!
//! On a node with the NVIDIA driver loaded (the CUDA toolkit is not needed;
//! NVML comes with the driver), as a user that may open `/dev/nvidia*`:
//!
//! ```text
//! keel check record --out gpu.json
//! ```
//!
//! or, from a checkout, without installing keel (the description is the
//! optional argument):
//!
//! ```text
//! cargo run -p keel-gpu --example record -- \
//!     "Azure Standard_ND96isr_H100_v5, idle healthy node, recorded 2025-01" > gpu.json
//! ```
//!
//! Record with no job running unless the fixture is meant to show one, then
//! read the file before committing it: it holds board serial numbers, GPU
//! UUIDs and the PIDs of running GPU processes, which may be replaced by
//! made-up values (say so in `description`). Put it in its own directory
//! under `tests/fixtures/` with a README line saying what machine it comes
//! from: the directories that `tests/fixtures/generate.py` owns are deleted
//! when it runs (their `gpu.json` files are written by that script).

use std::path::{Path, PathBuf};

use crate::{GpuError, GpuProbe, GpuSnapshot, SNAPSHOT_VERSION};

/// A probe that returns a snapshot read from a JSON file.
#[derive(Debug, Clone)]
pub struct RecordedProbe {
    path: PathBuf,
}

impl RecordedProbe {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

impl GpuProbe for RecordedProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        load(&self.path)
    }
}

/// Takes a snapshot from `probe` to be written with [`to_json`]
/// (`keel check record`). `description`, when given, replaces the probe's
/// (NVML gives none).
pub fn record(probe: &dyn GpuProbe, description: Option<String>) -> Result<GpuSnapshot, GpuError> {
    let mut snap = probe.snapshot()?;
    if description.is_some() {
        snap.description = description;
    }
    Ok(snap)
}

/// Reads and validates a snapshot file.
pub fn load(path: &Path) -> Result<GpuSnapshot, GpuError> {
    let text = std::fs::read_to_string(path).map_err(|source| GpuError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text)
}

/// Parses snapshot JSON; `path` only names the source in errors.
pub fn parse(path: &Path, text: &str) -> Result<GpuSnapshot, GpuError> {
    let snap: GpuSnapshot = serde_json::from_str(text).map_err(|e| GpuError::Format {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if snap.version != SNAPSHOT_VERSION {
        return Err(GpuError::Format {
            path: path.to_path_buf(),
            message: format!(
                "version {} is not supported (expected {SNAPSHOT_VERSION})",
                snap.version
            ),
        });
    }
    Ok(snap)
}

/// Writes a snapshot as pretty JSON.
pub fn to_json(snap: &GpuSnapshot) -> String {
    let mut s = serde_json::to_string_pretty(snap).unwrap_or_default();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{EccCounters, GpuProcess, GpuReading, PcieReading, RemappedRows};

    fn full_reading(index: u32) -> GpuReading {
        GpuReading {
            index,
            pci_bus_id: format!("{:04x}:00:00.0", index + 1),
            minor_number: Some(7 - index),
            uuid: Some(format!("GPU-4c5a1e2b-0000-4000-8000-00000000000{index}")),
            serial: Some("1654923012345".into()),
            name: Some("NVIDIA H100 80GB HBM3".into()),
            persistence_mode: Some(true),
            ecc_enabled: Some(true),
            ecc_pending: Some(true),
            ecc: EccCounters {
                volatile_sram_uncorrected: Some(0),
                volatile_dram_uncorrected: Some(0),
                volatile_sram_corrected: Some(3),
                volatile_dram_corrected: Some(12),
                aggregate_sram_uncorrected: Some(0),
                aggregate_dram_uncorrected: Some(1),
                aggregate_sram_corrected: Some(40),
                aggregate_dram_corrected: Some(u64::MAX),
            },
            retired_pages_pending: None,
            remapped_rows: Some(RemappedRows {
                correctable: 1,
                uncorrectable: 0,
                pending: false,
                failure: false,
            }),
            throttle_reasons: Some(0x1 | 0x4),
            pcie: PcieReading {
                current_gen: Some(5),
                max_gen: Some(5),
                current_width: Some(16),
                max_width: Some(16),
                replay_counter: Some(0),
            },
            nvlink_active: Some(vec![true; 18]),
            temperature_c: Some(34),
            power_w: Some(71.243),
            memory_total_bytes: Some(85_520_809_984),
            processes: Some(vec![
                GpuProcess {
                    pid: 4242,
                    used_memory_bytes: Some(1 << 30),
                },
                GpuProcess {
                    pid: 4243,
                    used_memory_bytes: None,
                },
            ]),
            clocks: Some(crate::ClockReading {
                graphics_mhz: Some(345),
                memory_mhz: Some(2619),
                app_graphics_mhz: Some(1980),
                app_memory_mhz: Some(2619),
                default_app_graphics_mhz: Some(1980),
                default_app_memory_mhz: Some(2619),
                max_graphics_mhz: Some(1980),
                max_memory_mhz: Some(2619),
            }),
            utilization_gpu_percent: Some(97),
            utilization_memory_percent: Some(41),
            memory_used_bytes: Some(1 << 30),
            energy_millijoules: Some(123_456_789),
            power_limit_w: Some(700.0),
            memory_temperature_c: Some(41),
            sm_clock_mhz: Some(1980),
            memory_clock_mhz: Some(2619),
            nvlink_errors: Some(vec![
                crate::NvlinkErrors {
                    replay: Some(0),
                    recovery: Some(1),
                    crc_flit: None,
                    crc_data: Some(0),
                };
                18
            ]),
        }
    }

    fn sample() -> GpuSnapshot {
        GpuSnapshot {
            version: SNAPSHOT_VERSION,
            description: Some("test machine".into()),
            driver_version: Some("535.183.01".into()),
            nvml_version: Some("12.535.183.01".into()),
            cuda_driver_version: Some(12020),
            gpus: vec![
                full_reading(0),
                GpuReading {
                    index: 1,
                    pci_bus_id: "0002:00:00.0".into(),
                    ..GpuReading::default()
                },
            ],
            unopened: vec![crate::Unopened {
                index: 2,
                lost: true,
                error: "GPU is lost".into(),
            }],
        }
    }

    fn round_trip(snap: &GpuSnapshot) -> GpuSnapshot {
        match parse(Path::new("round-trip.json"), &to_json(snap)) {
            Ok(back) => back,
            Err(e) => panic!("{e}: {}", to_json(snap)),
        }
    }

    #[test]
    fn snapshots_round_trip() {
        let snap = sample();
        assert_eq!(round_trip(&snap), snap);
        let bare = GpuSnapshot {
            version: SNAPSHOT_VERSION,
            ..GpuSnapshot::default()
        };
        assert_eq!(round_trip(&bare), bare);
    }

    #[test]
    fn unknown_values_are_null_not_zero() {
        let json = to_json(&sample());
        let value: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
        let bare = &value["gpus"][1];
        assert_eq!(bare["uuid"], serde_json::Value::Null);
        assert_eq!(bare["temperature_c"], serde_json::Value::Null);
        assert_eq!(
            bare["ecc"]["volatile_dram_uncorrected"],
            serde_json::Value::Null
        );
        assert_eq!(bare["pcie"]["current_gen"], serde_json::Value::Null);
        assert_eq!(bare["processes"], serde_json::Value::Null);
        assert!(json.ends_with("}\n"));
    }

    fn format_error(text: &str) -> String {
        let path = Path::new("fixtures/odd/gpu.json");
        match parse(path, text) {
            Err(e @ GpuError::Format { .. }) => {
                let GpuError::Format { path: p, message } = &e else {
                    unreachable!()
                };
                assert_eq!(p, path);
                let shown = e.to_string();
                assert!(shown.contains("fixtures/odd/gpu.json"), "{shown}");
                message.clone()
            }
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn parse_rejects_unknown_fields() {
        let mut value = serde_json::to_value(sample()).expect("serialises");
        value["hostname"] = "node-1".into();
        let message = format_error(&value.to_string());
        assert!(message.contains("unknown field `hostname`"), "{message}");

        let mut value = serde_json::to_value(sample()).expect("serialises");
        value["gpus"][0]["pcie"]["link_speed"] = 32.into();
        let message = format_error(&value.to_string());
        assert!(message.contains("unknown field `link_speed`"), "{message}");
    }

    #[test]
    fn parse_rejects_other_versions() {
        for version in [0, 2, 99] {
            let mut value = serde_json::to_value(sample()).expect("serialises");
            value["version"] = version.into();
            let message = format_error(&value.to_string());
            assert!(
                message.contains(&format!("version {version} is not supported")),
                "{message}"
            );
        }
        let mut value = serde_json::to_value(sample()).expect("serialises");
        value.as_object_mut().expect("an object").remove("version");
        let message = format_error(&value.to_string());
        assert!(message.contains("missing field `version`"), "{message}");
    }

    #[test]
    fn parse_rejects_what_is_not_json() {
        let message = format_error("not json");
        assert!(!message.is_empty());
        format_error("");
        format_error("[]");
    }

    #[test]
    fn load_names_a_missing_file() {
        let path = Path::new("/nonexistent/keel/gpu.json");
        match RecordedProbe::new(path).snapshot() {
            Err(e @ GpuError::Read { .. }) => {
                assert!(e.to_string().contains("/nonexistent/keel/gpu.json"), "{e}")
            }
            other => panic!("expected a read error, got {other:?}"),
        }
    }

    #[test]
    fn load_reads_what_to_json_wrote() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("gpu.json");
        std::fs::write(&path, to_json(&sample())).expect("write");
        assert_eq!(RecordedProbe::new(&path).snapshot().ok(), Some(sample()));
    }

    struct Fixed(Result<GpuSnapshot, String>);

    impl GpuProbe for Fixed {
        fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
            self.0
                .clone()
                .map_err(|reason| GpuError::Unavailable { reason })
        }
    }

    #[test]
    fn record_sets_the_description() {
        let probe = Fixed(Ok(GpuSnapshot {
            description: None,
            ..sample()
        }));
        let snap = record(&probe, Some("Azure ND96isr_H100_v5".into())).expect("recorded");
        assert_eq!(snap.description.as_deref(), Some("Azure ND96isr_H100_v5"));
        assert_eq!(snap.gpus, sample().gpus);
        assert_eq!(round_trip(&snap), snap);

        let probe = Fixed(Ok(sample()));
        let snap = record(&probe, None).expect("recorded");
        assert_eq!(snap.description.as_deref(), Some("test machine"));
    }

    #[test]
    fn record_passes_errors_on() {
        let probe = Fixed(Err("no driver".into()));
        assert!(
            matches!(record(&probe, None), Err(GpuError::Unavailable { reason }) if reason == "no driver")
        );
    }

    fn reading() -> impl Strategy<Value = GpuReading> {
        use proptest::option::of;
        let ecc = proptest::collection::vec(of(any::<u64>()), 8).prop_map(|c| EccCounters {
            volatile_sram_uncorrected: c[0],
            volatile_dram_uncorrected: c[1],
            volatile_sram_corrected: c[2],
            volatile_dram_corrected: c[3],
            aggregate_sram_uncorrected: c[4],
            aggregate_dram_uncorrected: c[5],
            aggregate_sram_corrected: c[6],
            aggregate_dram_corrected: c[7],
        });
        let pcie = (
            of(any::<u32>()),
            of(any::<u32>()),
            of(any::<u32>()),
            of(any::<u32>()),
            of(any::<u64>()),
        )
            .prop_map(
                |(current_gen, max_gen, current_width, max_width, replay_counter)| PcieReading {
                    current_gen,
                    max_gen,
                    current_width,
                    max_width,
                    replay_counter,
                },
            );
        let remapped = of(
            (any::<u32>(), any::<u32>(), any::<bool>(), any::<bool>()).prop_map(
                |(correctable, uncorrectable, pending, failure)| RemappedRows {
                    correctable,
                    uncorrectable,
                    pending,
                    failure,
                },
            ),
        );
        let process =
            (any::<u32>(), of(any::<u64>())).prop_map(|(pid, used_memory_bytes)| GpuProcess {
                pid,
                used_memory_bytes,
            });
        let ids = (
            any::<u32>(),
            "[0-9a-f:.]{0,16}",
            of(".*"),
            of(".*"),
            of(".*"),
        );
        let modes = (
            of(any::<bool>()),
            of(any::<bool>()),
            of(any::<bool>()),
            of(any::<bool>()),
        );
        let rest = (
            of(any::<u64>()),
            of(proptest::collection::vec(any::<bool>(), 0..19)),
            of(any::<u32>()),
            of(proptest::num::f64::NORMAL
                | proptest::num::f64::ZERO
                | proptest::num::f64::SUBNORMAL),
            of(any::<u64>()),
            of(proptest::collection::vec(process, 0..4)),
        );
        (ids, modes, ecc, remapped, pcie, rest).prop_map(
            |(
                (index, pci_bus_id, uuid, serial, name),
                (persistence_mode, ecc_enabled, ecc_pending, retired_pages_pending),
                ecc,
                remapped_rows,
                pcie,
                (
                    throttle_reasons,
                    nvlink_active,
                    temperature_c,
                    power_w,
                    memory_total_bytes,
                    processes,
                ),
            )| GpuReading {
                index,
                pci_bus_id,
                minor_number: index.checked_add(1),
                uuid,
                serial,
                name,
                persistence_mode,
                ecc_enabled,
                ecc_pending,
                ecc,
                retired_pages_pending,
                remapped_rows,
                throttle_reasons,
                pcie,
                nvlink_active,
                temperature_c,
                power_w,
                memory_total_bytes,
                processes,
                clocks: None,
                ..GpuReading::default()
            },
        )
    }

    proptest! {
        #[test]
        fn any_snapshot_round_trips(
            description in proptest::option::of(".*"),
            driver_version in proptest::option::of("[0-9.]{1,12}"),
            cuda_driver_version in proptest::option::of(any::<i32>()),
            gpus in proptest::collection::vec(reading(), 0..4),
        ) {
            let snap = GpuSnapshot {
                version: SNAPSHOT_VERSION,
                description,
                nvml_version: driver_version.as_ref().map(|v| format!("12.{v}")),
                driver_version,
                cuda_driver_version,
                gpus,
                unopened: Vec::new(),
            };
            prop_assert_eq!(round_trip(&snap), snap);
        }
    }
}
