//! The supervisor's Prometheus metrics, rendered from a snapshot (text
//! exposition format 0.0.4, `keel_run_` names, as the gateway names its
//! own `keel_` metrics).

use std::fmt::Write as _;

use crate::goodput::Goodput;

/// What the supervisor knows now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub job: String,
    /// `start-up`, `training`, `checkpoint save`, `draining`.
    pub phase: &'static str,
    pub heartbeats: u64,
    pub commits: u64,
    pub last_commit_step: Option<u64>,
    pub resumed_step: Option<u64>,
    /// The hang timeout in force, seconds.
    pub hang_timeout_s: f64,
    /// Since the last heartbeat, seconds.
    pub silent_s: f64,
    /// The job's earlier attempts.
    pub goodput: Goodput,
}

fn escape(v: &str) -> String {
    v.chars()
        .take(128)
        .flat_map(|c| match c {
            '\\' => vec!['\\', '\\'],
            '"' => vec!['\\', '"'],
            '\n' => vec!['\\', 'n'],
            c => vec![c],
        })
        .collect()
}

/// Renders the snapshot.
pub fn render(s: &Snapshot) -> String {
    let job = escape(&s.job);
    let mut o = String::new();
    let mut one = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(o, "{name}{{job=\"{job}\"}} {value}");
    };
    one(
        "keel_run_heartbeats_total",
        "counter",
        "Heartbeats seen from the trainer in this attempt.",
        s.heartbeats.to_string(),
    );
    one(
        "keel_run_commits_total",
        "counter",
        "Checkpoints pushed and committed in this attempt.",
        s.commits.to_string(),
    );
    if let Some(step) = s.last_commit_step {
        one(
            "keel_run_last_commit_step",
            "gauge",
            "The step of the last checkpoint committed in this attempt.",
            step.to_string(),
        );
    }
    if let Some(step) = s.resumed_step {
        one(
            "keel_run_resumed_step",
            "gauge",
            "The step this attempt resumed from.",
            step.to_string(),
        );
    }
    one(
        "keel_run_hang_timeout_seconds",
        "gauge",
        "The hang timeout in force.",
        format!("{:.3}", s.hang_timeout_s),
    );
    one(
        "keel_run_seconds_since_heartbeat",
        "gauge",
        "Seconds since the last heartbeat (or the start).",
        format!("{:.3}", s.silent_s),
    );
    let _ = writeln!(
        o,
        "# HELP keel_run_phase The phase the trainer is in (1 for the current one).\n# TYPE keel_run_phase gauge"
    );
    for p in ["start-up", "training", "checkpoint save", "draining"] {
        let v = u8::from(p == s.phase);
        let _ = writeln!(o, "keel_run_phase{{job=\"{job}\",phase=\"{p}\"}} {v}");
    }
    let g = &s.goodput;
    let _ = writeln!(
        o,
        "# HELP keel_run_goodput_seconds Where the wall time of the job's earlier attempts went.\n# TYPE keel_run_goodput_seconds gauge"
    );
    for (bucket, ms) in [
        ("queue", g.queue_ms),
        ("preflight", g.preflight_ms),
        ("restore", g.restore_ms),
        ("checkpoint_stall", g.stall_ms),
        ("lost", g.lost_ms),
        ("productive", g.productive_ms),
    ] {
        #[allow(clippy::cast_precision_loss)]
        let secs = ms as f64 / 1000.0;
        let _ = writeln!(
            o,
            "keel_run_goodput_seconds{{job=\"{job}\",bucket=\"{bucket}\"}} {secs:.3}"
        );
    }
    if let Some(r) = g.ettr {
        let _ = writeln!(
            o,
            "# HELP keel_run_effective_training_time_ratio Productive over wall time of the earlier attempts.\n# TYPE keel_run_effective_training_time_ratio gauge\nkeel_run_effective_training_time_ratio{{job=\"{job}\"}} {r:.4}"
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_once_with_the_job_label() {
        let s = Snapshot {
            job: "42\"x".into(),
            phase: "training",
            heartbeats: 7,
            commits: 2,
            last_commit_step: Some(200),
            resumed_step: None,
            hang_timeout_s: 12.5,
            silent_s: 0.25,
            goodput: Goodput {
                productive_ms: 1500,
                ettr: Some(0.75),
                ..Goodput::default()
            },
        };
        let text = render(&s);
        assert!(
            text.contains("keel_run_heartbeats_total{job=\"42\\\"x\"} 7\n"),
            "{text}"
        );
        assert!(text.contains("keel_run_last_commit_step{job=\"42\\\"x\"} 200\n"));
        assert!(!text.contains("keel_run_resumed_step"));
        assert!(text.contains("keel_run_phase{job=\"42\\\"x\",phase=\"training\"} 1\n"));
        assert!(text.contains("keel_run_phase{job=\"42\\\"x\",phase=\"start-up\"} 0\n"));
        assert!(text.contains("bucket=\"productive\"} 1.500\n"));
        assert!(text.contains("keel_run_effective_training_time_ratio{job=\"42\\\"x\"} 0.7500\n"));
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).expect("name");
            assert_eq!(
                text.matches(&format!("# TYPE {name} ")).count(),
                1,
                "{name}"
            );
        }
    }
}
