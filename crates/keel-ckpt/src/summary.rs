//! What the commands report about their work: a transfer's totals and
//! rate, and the details of a committed checkpoint.

use std::time::Duration;

use keel_store::Bandwidth;
use serde::Serialize;

use crate::{Ckpt, CkptError, CkptMeta, CkptRef};

/// Bytes, files, time and rate of one transfer (a push, pull or verify).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TransferSummary {
    pub bytes: u64,
    pub files: usize,
    /// Seconds, to the millisecond.
    pub duration_s: f64,
    /// Bytes a second over the whole transfer; 0 when it took no time.
    pub throughput_bytes_per_s: f64,
    /// The bandwidth cap it ran under, if any.
    pub cap_bytes_per_s: Option<f64>,
}

impl TransferSummary {
    pub fn new(bytes: u64, files: usize, took: Duration, cap: Option<Bandwidth>) -> Self {
        let s = took.as_secs_f64();
        TransferSummary {
            bytes,
            files,
            duration_s: (s * 1000.0).round() / 1000.0,
            throughput_bytes_per_s: if s > 0.0 {
                (bytes as f64 / s).round()
            } else {
                0.0
            },
            cap_bytes_per_s: cap.map(|c| c.bytes_per_sec()),
        }
    }
}

/// A committed checkpoint's size and who wrote it (from its manifest).
#[derive(Debug, Clone)]
pub struct Details {
    pub bytes: u64,
    pub files: usize,
    pub meta: CkptMeta,
}

impl Ckpt {
    /// The latest checkpoint and its details; the details are `None`
    /// when `latest` names a checkpoint whose manifest is gone.
    pub async fn latest_details(&self) -> Result<Option<(CkptRef, Option<Details>)>, CkptError> {
        let Some(c) = self.latest().await? else {
            return Ok(None);
        };
        let details = self.manifest(c).await?.map(|(m, meta)| Details {
            bytes: m.total_bytes(),
            files: m.files().len(),
            meta,
        });
        Ok(Some((c, details)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_rounds_its_time_and_has_no_rate_without_time() {
        let s = TransferSummary::new(3_000_000, 4, Duration::from_micros(1_500_400), None);
        assert_eq!(s.duration_s, 1.5);
        assert_eq!(s.throughput_bytes_per_s, 1_999_467.0);
        assert_eq!(s.cap_bytes_per_s, None);
        let z = TransferSummary::new(10, 1, Duration::ZERO, None);
        assert_eq!(z.throughput_bytes_per_s, 0.0);
    }
}
