//! A node's report: the JSON document, the one-line summary and the
//! Prometheus textfile form.

use serde::{Deserialize, Serialize};

use crate::{overall, CheckResult, Status};

/// The JSON report version (`keel check --json`).
pub const REPORT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub version: u32,
    pub host: String,
    /// The SKU profile used.
    pub sku: String,
    /// How it was chosen: `flag`, `imds`, `gpus`, `generic`.
    pub sku_source: String,
    pub status: Status,
    /// `<host> | Healthy` or `<host> | ERROR: <check>: <detail>`.
    pub summary: String,
    pub duration_ms: f64,
    pub results: Vec<CheckResult>,
}

impl Report {
    pub fn new(
        host: String,
        sku: String,
        sku_source: String,
        results: Vec<CheckResult>,
        duration_ms: f64,
    ) -> Self {
        let status = overall(&results);
        let summary = summary_line(&host, &results);
        Report {
            version: REPORT_VERSION,
            host,
            sku,
            sku_source,
            status,
            summary,
            duration_ms,
            results,
        }
    }

    /// The first result with the overall status: what drains the node.
    pub fn worst(&self) -> Option<&CheckResult> {
        self.results.iter().find(|r| r.status == self.status)
    }
}

/// `<host> | Healthy`, or the first failing (then unknown, then warning)
/// check: `<host> | ERROR: gpu.ecc_errors: GPU 3 (0004:00:00.0): 2
/// uncorrectable ECC errors since driver load`.
pub fn summary_line(host: &str, results: &[CheckResult]) -> String {
    let status = overall(results);
    let word = match status {
        Status::Fail => "ERROR",
        Status::Unknown => "UNKNOWN",
        Status::Warn => "WARNING",
        Status::Pass | Status::Skip => return format!("{host} | Healthy"),
    };
    let worst: Vec<&CheckResult> = results.iter().filter(|r| r.status == status).collect();
    let first = worst[0];
    let mut s = format!("{host} | {word}: {}: {}", first.id, describe(first));
    if worst.len() > 1 {
        s.push_str(&format!(" (+{} more)", worst.len() - 1));
    }
    s
}

/// `GPU 3 (0004:00:00.0): detail`.
pub fn describe(r: &CheckResult) -> String {
    match r
        .device
        .as_ref()
        .map(|d| d.label())
        .filter(|l| !l.is_empty())
    {
        Some(l) => format!("{l}: {}", r.detail),
        None => r.detail.clone(),
    }
}

/// The report in Prometheus text exposition format, for node_exporter's
/// textfile collector. `now_unix` is the time of the run.
pub fn prometheus(report: &Report, now_unix: f64) -> String {
    let mut s = String::new();
    s.push_str("# HELP keel_check_status Result of a keel health check: 0 pass, 1 warn, 2 fail, 3 unknown, -1 skip.\n");
    s.push_str("# TYPE keel_check_status gauge\n");
    for r in &report.results {
        let v = match r.status {
            Status::Pass => 0,
            Status::Warn => 1,
            Status::Fail => 2,
            Status::Unknown => 3,
            Status::Skip => -1,
        };
        s.push_str(&format!("keel_check_status{{{}}} {v}\n", labels(report, r)));
    }
    s.push_str(
        "# HELP keel_check_value Value measured by a keel health check, in the unit label.\n",
    );
    s.push_str("# TYPE keel_check_value gauge\n");
    for r in &report.results {
        if let Some(v) = r.value {
            let unit = r.unit.as_deref().unwrap_or("");
            s.push_str(&format!(
                "keel_check_value{{{},unit=\"{}\"}} {v}\n",
                labels(report, r),
                escape(unit)
            ));
        }
    }
    let overall = match report.status {
        Status::Pass | Status::Skip => 0,
        Status::Warn => 1,
        Status::Fail => 2,
        Status::Unknown => 3,
    };
    s.push_str(
        "# HELP keel_check_overall Overall node health: 0 ok, 1 warning, 2 critical, 3 unknown.\n",
    );
    s.push_str("# TYPE keel_check_overall gauge\n");
    s.push_str(&format!(
        "keel_check_overall{{host=\"{}\",sku=\"{}\"}} {overall}\n",
        escape(&report.host),
        escape(&report.sku)
    ));
    s.push_str("# HELP keel_check_duration_seconds Time the passive tier took.\n");
    s.push_str("# TYPE keel_check_duration_seconds gauge\n");
    s.push_str(&format!(
        "keel_check_duration_seconds {}\n",
        report.duration_ms / 1000.0
    ));
    s.push_str("# HELP keel_check_last_run_timestamp_seconds When keel check last ran.\n");
    s.push_str("# TYPE keel_check_last_run_timestamp_seconds gauge\n");
    s.push_str(&format!(
        "keel_check_last_run_timestamp_seconds {now_unix}\n"
    ));
    s
}

fn labels(report: &Report, r: &CheckResult) -> String {
    let mut l = format!(
        "check=\"{}\",host=\"{}\"",
        escape(&r.id),
        escape(&report.host)
    );
    if let Some(d) = &r.device {
        let label = d.label();
        if !label.is_empty() {
            l.push_str(&format!(",device=\"{}\"", escape(&label)));
        }
    }
    if let Some(c) = &r.code {
        l.push_str(&format!(",code=\"{}\"", escape(c)));
    }
    l
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
