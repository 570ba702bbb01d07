//! The GPU probe behind a deadline. One thread of its own calls the probe
//! (at most one call at a time); a scrape asks for a fresh snapshot and
//! waits for it until the deadline, then goes on with the last good one,
//! marked stale. A probe call that hangs therefore holds up no scrape for
//! longer than the deadline (and only the first: later scrapes see that
//! the same call is still running and do not wait), and no more threads
//! pile up behind it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_gpu::{GpuError, GpuProbe, GpuSnapshot};
use tokio::sync::watch;

use crate::readings::{GpuState, ProbeFailure};
use crate::Monotonic;

#[derive(Debug, Clone, Default)]
struct Latest {
    /// Answers so far (each call's, good or not).
    seq: u64,
    good: Option<(Instant, Arc<GpuSnapshot>)>,
    /// The last answer's error, `None` when it was a snapshot.
    error: Option<ProbeFailure>,
}

/// Calls a probe on its own thread on request.
#[derive(Debug, Clone)]
pub struct Sampler {
    ask: SyncSender<()>,
    latest: watch::Receiver<Latest>,
    clock: Arc<dyn Monotonic>,
    /// `seq + 1` of the answer count during which a scrape already waited
    /// out its deadline: the call in progress hangs, and later scrapes do
    /// not wait for it again.
    hung: Arc<AtomicU64>,
}

impl Sampler {
    /// Starts the probe's thread. It ends when every `Sampler` clone is
    /// dropped (after its current call returns).
    pub fn start(
        probe: Box<dyn GpuProbe + Send>,
        clock: Arc<dyn Monotonic>,
    ) -> std::io::Result<Self> {
        // Capacity 1: requests made while a call is running fold into one.
        let (ask, asked) = sync_channel::<()>(1);
        let (tx, latest) = watch::channel(Latest::default());
        let c = clock.clone();
        std::thread::Builder::new()
            .name("keel-exporter-gpu".into())
            .spawn(move || {
                while asked.recv().is_ok() {
                    let answer = probe.snapshot();
                    let at = c.now();
                    tx.send_modify(|l| {
                        l.seq += 1;
                        match answer {
                            Ok(s) => {
                                l.good = Some((at, Arc::new(s)));
                                l.error = None;
                            }
                            Err(e) => {
                                l.error = Some(match e {
                                    GpuError::Unavailable { .. } => ProbeFailure::Unavailable,
                                    GpuError::Timeout { .. } => ProbeFailure::Timeout,
                                    _ => ProbeFailure::Error,
                                });
                                // No driver any more: nothing to show.
                                if matches!(e, GpuError::Unavailable { .. }) {
                                    l.good = None;
                                }
                            }
                        }
                    });
                }
            })?;
        Ok(Self {
            ask,
            latest,
            clock,
            hung: Arc::new(AtomicU64::new(0)),
        })
    }

    /// A fresh reading if the probe answers within `deadline`, else the last
    /// good one marked stale.
    pub async fn sample(&self, deadline: Duration) -> GpuState {
        let mut rx = self.latest.clone();
        let seq = rx.borrow_and_update().seq;
        let asked = match self.ask.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) => true,
            Err(TrySendError::Disconnected(())) => false,
        };
        let hung = self.hung.load(Ordering::Relaxed) == seq + 1;
        let fresh = asked
            && !hung
            && tokio::time::timeout(deadline, rx.wait_for(|l| l.seq > seq))
                .await
                .is_ok_and(|r| r.is_ok());
        if asked && !fresh && !hung {
            self.hung.store(seq + 1, Ordering::Relaxed);
        }
        let l = rx.borrow().clone();
        let now = self.clock.now();
        let error = if fresh {
            l.error
        } else {
            Some(ProbeFailure::Timeout)
        };
        GpuState {
            age_s: l
                .good
                .as_ref()
                .map(|(at, _)| now.saturating_duration_since(*at).as_secs_f64()),
            stale: l.good.is_some() && error.is_some(),
            snapshot: l.good.map(|(_, s)| s),
            error,
        }
    }
}
