//! The active tier: results of `keel bench ... --json` (host-device and
//! peer copies, HBM, GEMM, NCCL all-reduce) judged against the SKU
//! profile's thresholds. The benchmarks themselves run in a job or an
//! epilog (they load the GPUs for minutes); `keel check --bench FILE`
//! turns their JSON into check results that drain, merge and alert like
//! the passive ones.
//!
//! The JSON is read by field name, not through keel-bench's types, so this
//! crate does not link CUDA.

use serde_json::Value;

use crate::profile::{ActiveExpect, Profile};
use crate::{CheckResult, Device, Status, Tier};

#[derive(Debug, thiserror::Error)]
pub enum BenchInputError {
    #[error("{origin} is not `keel bench --json` output: {reason}")]
    NotBench { origin: String, reason: String },
}

fn active(r: CheckResult) -> CheckResult {
    CheckResult {
        tier: Tier::Active,
        ..r
    }
}

/// Fails below `fail`, warns below `fail * warn_factor`, passes above.
fn judge(
    id: &str,
    value: f64,
    unit: &str,
    fail: Option<f64>,
    warn_factor: f64,
    what: &str,
) -> CheckResult {
    let r = CheckResult::new(id, Status::Pass, format!("{what} {value:.1} {unit}"))
        .value(round(value), unit)
        .better(true);
    match fail {
        Some(f) if value < f => CheckResult {
            status: Status::Fail,
            detail: format!("{what} {value:.1} {unit}, below {f} {unit}"),
            ..r
        }
        .threshold(format!(">= {f}"))
        .code("BENCH_BELOW_THRESHOLD"),
        Some(f) if value < f * warn_factor => CheckResult {
            status: Status::Warn,
            detail: format!(
                "{what} {value:.1} {unit}, within {:.0}% of the {f} {unit} floor",
                (warn_factor - 1.0) * 100.0
            ),
            ..r
        }
        .threshold(format!(">= {:.1}", f * warn_factor))
        .code("BENCH_NEAR_THRESHOLD"),
        Some(f) => r.threshold(format!(">= {f}")),
        None => r,
    }
}

fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn gpu_device(doc: &Value) -> Device {
    Device {
        gpu: doc["gpu"].as_u64().map(|g| g as u32),
        pci: doc["pci_bus_id"].as_str().map(str::to_owned),
        ..Device::default()
    }
}

fn median(v: &Value) -> Option<f64> {
    v["median"].as_f64()
}

/// Check results for one `keel bench --json` document. `origin` names it
/// in errors.
pub fn from_bench(
    profile: &Profile,
    origin: &str,
    doc: &Value,
) -> Result<Vec<CheckResult>, BenchInputError> {
    let bad = |reason: &str| BenchInputError::NotBench {
        origin: origin.to_owned(),
        reason: reason.to_owned(),
    };
    if doc["version"].as_u64() != Some(1) {
        return Err(bad("no \"version\": 1"));
    }
    let a: &ActiveExpect = &profile.active;
    let wf = a.warn_factor;
    let mut out = Vec::new();
    match doc["command"].as_str() {
        Some("bench copy") => {
            let gpus = doc["gpus"]
                .as_array()
                .ok_or_else(|| bad("no \"gpus\" array"))?;
            for g in gpus {
                let dev = gpu_device(g);
                for (id, key, fail, what) in [
                    ("bench.h2d", "h2d_gbs", a.h2d_gbps, "host to device"),
                    ("bench.d2h", "d2h_gbs", a.d2h_gbps, "device to host"),
                ] {
                    let v = median(&g[key]).ok_or_else(|| bad(&format!("no {key}.median")))?;
                    let mut r = judge(id, v, "GB/s", fail, wf, what);
                    if g["pinned"] == Value::Bool(false) {
                        r = r.evidence(format!(
                            "thread not pinned to the GPU's NUMA node: {}",
                            g["note"].as_str().unwrap_or("")
                        ));
                    }
                    out.push(active(r.device(dev.clone())));
                }
                let v = median(&g["d2d_gbs"]).ok_or_else(|| bad("no d2d_gbs.median"))?;
                out.push(active(
                    judge(
                        "bench.hbm",
                        v / 1000.0,
                        "TB/s",
                        a.hbm_tbps,
                        wf,
                        "device to device",
                    )
                    .device(dev),
                ));
            }
            for p in doc["peer"].as_array().into_iter().flatten() {
                let v = median(&p["gbs"]).ok_or_else(|| bad("no peer gbs.median"))?;
                let (src, dst) = (
                    p["src"].as_u64().unwrap_or(0),
                    p["dst"].as_u64().unwrap_or(0),
                );
                let r = judge(
                    "bench.peer",
                    v,
                    "GB/s",
                    a.peer_gbps,
                    wf,
                    &format!("GPU {src} -> GPU {dst}"),
                );
                let r = if p["p2p"] == Value::Bool(false) {
                    r.evidence("no direct peer access: staged through host memory")
                } else {
                    r
                };
                out.push(active(r.device(Device {
                    gpu: Some(src as u32),
                    ..Device::default()
                })));
            }
        }
        Some("bench gemm") => {
            let dtype = doc["dtype"].as_str().unwrap_or("?");
            let gpus = doc["gpus"]
                .as_array()
                .ok_or_else(|| bad("no \"gpus\" array"))?;
            for g in gpus {
                let dev = gpu_device(g);
                let tflops = median(&g["tflops"]).ok_or_else(|| bad("no tflops.median"))?;
                let mismatched = g["mismatched_repetitions"].as_u64().unwrap_or(0);
                let small_ok = g["check"]["passed"].as_bool().unwrap_or(false);
                let r = if mismatched > 0 {
                    CheckResult::new("bench.gemm", Status::Fail, format!("{mismatched} {dtype} GEMM repetitions differed from the first: silent data corruption under load"))
                        .code("GEMM_MISMATCH")
                        .value(round(tflops), "TFLOPS")
                } else if !small_ok {
                    CheckResult::new(
                        "bench.gemm",
                        Status::Fail,
                        format!(
                            "{dtype} GEMM is wrong: relative error {} above {}",
                            g["check"]["relative_error"], g["check"]["tolerance"]
                        ),
                    )
                    .code("GEMM_WRONG")
                    .value(round(tflops), "TFLOPS")
                } else {
                    let fail = if dtype == "bf16" {
                        a.gemm_bf16_tflops
                    } else {
                        None
                    };
                    let mut r = judge(
                        "bench.gemm",
                        tflops,
                        "TFLOPS",
                        fail,
                        wf,
                        &format!("{dtype} GEMM"),
                    );
                    if let Some(f) = g["fraction_of_peak"].as_f64() {
                        r = r.evidence(format!("{:.0}% of the datasheet peak", f * 100.0));
                    }
                    r
                };
                out.push(active(r.device(dev)));
            }
        }
        Some("bench nccl") => {
            let collective = doc["collective"].as_str().unwrap_or("?");
            let rows = doc["rows"]
                .as_array()
                .ok_or_else(|| bad("no \"rows\" array"))?;
            let ranks = doc["ranks"].as_u64().unwrap_or(0);
            let wrong = doc["out_of_bounds"].as_u64().unwrap_or(0);
            // The largest message: the figure thresholds are quoted for.
            let last = rows
                .iter()
                .max_by_key(|r| r["bytes"].as_u64().unwrap_or(0))
                .ok_or_else(|| bad("no row"))?;
            let busbw = last["out_of_place"]["busbw"]
                .as_f64()
                .ok_or_else(|| bad("no out_of_place.busbw"))?;
            let bytes = last["bytes"].as_u64().unwrap_or(0);
            let r = if wrong > 0 {
                CheckResult::new(
                    "bench.nccl",
                    Status::Fail,
                    format!("{collective}: {wrong} wrong elements"),
                )
                .code("NCCL_WRONG")
            } else {
                let fail = if collective == "all-reduce" && ranks == u64::from(a.allreduce_ranks) {
                    a.allreduce_busbw_gbps
                } else {
                    None
                };
                judge(
                    "bench.nccl",
                    busbw,
                    "GB/s",
                    fail,
                    wf,
                    &format!("{collective} bus bandwidth on {ranks} ranks at {bytes} bytes"),
                )
            };
            out.push(active(r));
        }
        Some(other) => {
            return Err(bad(&format!(
                "command {other:?} is not a benchmark keel check reads"
            )))
        }
        None => return Err(bad("no \"command\"")),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn copy_doc(h2d: f64) -> Value {
        let s = |m: f64| json!({"n": 10, "median": m, "min": m, "max": m, "spread_pct": 0.0});
        json!({"version": 1, "command": "bench copy", "bytes": 1 << 28, "iters": 10, "warmup": 2,
            "gpus": [{"gpu": 0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0001:00:00.0", "numa_node": 0,
                      "cpus": "0-47", "pinned": true, "note": null, "h2d_gbs": s(h2d), "d2h_gbs": s(52.0), "d2d_gbs": s(2900.0)}],
            "peer": []})
    }

    #[test]
    fn copy_thresholds_fail_warn_pass() {
        let p = crate::profile::load("nd96isr_h100_v5", None).expect("profile");
        let status = |h2d| from_bench(&p, "t", &copy_doc(h2d)).expect("results")[0].status;
        assert_eq!(status(40.0), Status::Fail);
        assert_eq!(status(49.0), Status::Warn);
        assert_eq!(status(53.0), Status::Pass);
        let r = from_bench(&p, "t", &copy_doc(53.0)).expect("results");
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| x.tier == Tier::Active));
        assert_eq!(r[2].id, "bench.hbm");
        assert_eq!(r[2].value, Some(2.9));
    }

    #[test]
    fn foreign_documents_are_refused() {
        let p = crate::profile::load("generic", None).expect("profile");
        assert!(from_bench(&p, "x.json", &json!({"version": 1, "command": "topo show"})).is_err());
        assert!(from_bench(&p, "x.json", &json!({"hello": 1})).is_err());
    }
}
