//! Merging per-node reports into a fleet view: failing nodes, and
//! outliers that pass their thresholds but sit well below the fleet median
//! for the same SKU and metric, or a GPU below its siblings in one node.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::report::{describe, Report};
use crate::Status;

#[derive(Debug, Clone, Serialize)]
pub struct Fleet {
    pub version: u32,
    pub nodes: usize,
    /// Node count per overall status.
    pub by_status: BTreeMap<String, usize>,
    /// Nodes that are not healthy, worst first.
    pub unhealthy: Vec<NodeLine>,
    pub outliers: Vec<Outlier>,
    /// The fraction below the median that makes an outlier.
    pub outlier_fraction: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeLine {
    pub host: String,
    pub sku: String,
    pub status: Status,
    pub summary: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Outlier {
    pub host: String,
    pub sku: String,
    pub check: String,
    pub device: Option<String>,
    pub value: f64,
    pub unit: Option<String>,
    pub median: f64,
    /// How far below the median, as a fraction (0.15 = 15% below).
    pub below: f64,
    /// `fleet` (against the same SKU across nodes) or `siblings` (against
    /// the other devices of the same node).
    pub against: &'static str,
    pub detail: String,
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Merges reports. `fraction` is the outlier threshold (0.10: more than 10%
/// below the median).
pub fn merge(reports: &[Report], fraction: f64) -> Fleet {
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    for r in reports {
        *by_status.entry(r.status.as_str().to_owned()).or_default() += 1;
    }
    let mut unhealthy: Vec<NodeLine> = reports
        .iter()
        .filter(|r| !matches!(r.status, Status::Pass | Status::Skip))
        .map(|r| NodeLine {
            host: r.host.clone(),
            sku: r.sku.clone(),
            status: r.status,
            summary: r.summary.clone(),
        })
        .collect();
    unhealthy.sort_by(|a, b| b.status.cmp(&a.status).then_with(|| a.host.cmp(&b.host)));

    // Values where higher is better, from results that passed or warned.
    let usable = |res: &crate::CheckResult| {
        res.higher_is_better == Some(true)
            && matches!(res.status, Status::Pass | Status::Warn)
            && res.value.is_some()
    };
    let mut pools: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for r in reports {
        for res in r.results.iter().filter(|x| usable(x)) {
            pools
                .entry((r.sku.clone(), res.id.clone()))
                .or_default()
                .extend(res.value);
        }
    }
    let medians: BTreeMap<(String, String), f64> = pools
        .into_iter()
        .filter(|(_, v)| v.len() >= 3)
        .filter_map(|(k, mut v)| median(&mut v).map(|m| (k, m)))
        .collect();

    let mut outliers = Vec::new();
    for r in reports {
        let mut siblings: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for res in r.results.iter().filter(|x| usable(x)) {
            if res.device.as_ref().and_then(|d| d.gpu).is_some() {
                siblings
                    .entry(res.id.clone())
                    .or_default()
                    .extend(res.value);
            }
        }
        let sib_medians: BTreeMap<String, f64> = siblings
            .into_iter()
            .filter(|(_, v)| v.len() >= 3)
            .filter_map(|(k, mut v)| median(&mut v).map(|m| (k, m)))
            .collect();
        for res in r.results.iter().filter(|x| usable(x)) {
            let Some(value) = res.value else { continue };
            let device = res
                .device
                .as_ref()
                .map(|d| d.label())
                .filter(|l| !l.is_empty());
            let mut push = |median: f64, against: &'static str| {
                if median > 0.0 && value < median * (1.0 - fraction) {
                    outliers.push(Outlier {
                        host: r.host.clone(),
                        sku: r.sku.clone(),
                        check: res.id.clone(),
                        device: device.clone(),
                        value,
                        unit: res.unit.clone(),
                        median,
                        below: ((median - value) / median * 1000.0).round() / 1000.0,
                        against,
                        detail: describe(res),
                    });
                }
            };
            if let Some(&m) = medians.get(&(r.sku.clone(), res.id.clone())) {
                push(m, "fleet");
            }
            if res.device.as_ref().and_then(|d| d.gpu).is_some() {
                if let Some(&m) = sib_medians.get(&res.id) {
                    push(m, "siblings");
                }
            }
        }
    }
    outliers.sort_by(|a, b| {
        b.below
            .total_cmp(&a.below)
            .then_with(|| a.host.cmp(&b.host))
    });
    Fleet {
        version: 1,
        nodes: reports.len(),
        by_status,
        unhealthy,
        outliers,
        outlier_fraction: fraction,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CheckResult, Device};

    fn node(host: &str, values: &[f64]) -> Report {
        let results = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                CheckResult::new("bench.h2d", Status::Pass, format!("{v} GB/s"))
                    .value(*v, "GB/s")
                    .better(true)
                    .device(Device {
                        gpu: Some(i as u32),
                        ..Device::default()
                    })
            })
            .collect();
        Report::new(
            host.into(),
            "nd96isr_h100_v5".into(),
            "flag".into(),
            results,
            1.0,
        )
    }

    #[test]
    fn fleet_and_sibling_outliers() {
        let reports = vec![
            node("a", &[50.0, 51.0, 50.5, 50.2]),
            node("b", &[50.3, 50.1, 49.9, 50.0]),
            node("c", &[50.0, 40.0, 50.0, 50.4]),
        ];
        let f = merge(&reports, 0.10);
        assert_eq!(f.nodes, 3);
        assert!(f.unhealthy.is_empty());
        let found: Vec<(&str, Option<&str>, &str)> = f
            .outliers
            .iter()
            .map(|o| (o.host.as_str(), o.device.as_deref(), o.against))
            .collect();
        assert_eq!(
            found,
            [
                ("c", Some("GPU 1"), "fleet"),
                ("c", Some("GPU 1"), "siblings")
            ]
        );
        assert!((f.outliers[0].below - 0.2).abs() < 0.01);
    }

    #[test]
    fn failing_nodes_are_listed_worst_first() {
        let mut bad = node("z", &[50.0]);
        bad.results.push(
            CheckResult::new("gpu.ecc_errors", Status::Fail, "2 uncorrectable")
                .code("ECC_UNCORRECTABLE"),
        );
        let bad = Report::new(bad.host, bad.sku, bad.sku_source, bad.results, 1.0);
        let f = merge(&[node("a", &[50.0]), bad], 0.1);
        assert_eq!(f.unhealthy.len(), 1);
        assert_eq!(
            f.unhealthy[0].summary,
            "z | ERROR: gpu.ecc_errors: 2 uncorrectable"
        );
    }
}
