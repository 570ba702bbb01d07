//! The limiter that enforces a bandwidth cap (keel-units' [`Bandwidth`],
//! in explicit units) across every transfer of a process.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

pub use keel_units::{Bandwidth, BandwidthError};

/// A pacer shared by all transfers of a process (clone the `Arc`). A
/// transfer asks for its bytes before it moves them; each request gets the
/// next slot of `bytes / cap` seconds on one timeline and returns when its
/// slot ends, so bytes are released no faster than the cap however many
/// transfers ask at once. The timeline may lag behind the clock by at most
/// [`Limiter::SLACK`]: the time a transfer spends reading and hashing
/// between two requests is not lost, but a long pause is not saved up
/// either.
#[derive(Debug)]
pub struct Limiter {
    rate: Option<Bandwidth>,
    /// When the bytes granted so far will have gone out at the cap.
    next: Mutex<Option<Instant>>,
}

impl Limiter {
    /// A limiter with no cap: `acquire` returns at once.
    pub fn unlimited() -> Self {
        Self {
            rate: None,
            next: Mutex::new(None),
        }
    }

    pub fn new(cap: Bandwidth) -> Self {
        Self {
            rate: Some(cap),
            next: Mutex::new(None),
        }
    }

    /// How far the timeline may fall behind the clock.
    pub const SLACK: Duration = Duration::from_millis(100);

    pub fn cap(&self) -> Option<Bandwidth> {
        self.rate
    }

    /// Waits until `bytes` may be sent (or received) within the cap.
    pub async fn acquire(&self, bytes: u64) {
        let Some(rate) = self.rate else { return };
        let cost = Duration::from_secs_f64(bytes as f64 / rate.bytes_per_sec());
        let end = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let floor = now.checked_sub(Self::SLACK).unwrap_or(now);
            let start = match *next {
                Some(t) if t > floor => t,
                _ => floor,
            };
            let end = start + cost;
            *next = Some(end);
            end
        };
        tokio::time::sleep_until(end).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn limiter_holds_the_rate_across_tasks() {
        let l = std::sync::Arc::new(Limiter::new(Bandwidth::from_bytes_per_sec(1_000_000.0)));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let l = l.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..50 {
                    l.acquire(10_000).await;
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        // 2 MB at 1 MB/s: 2 s, less at most the slack.
        let took = start.elapsed().as_secs_f64();
        assert!((1.9..=2.01).contains(&took), "{took}");
    }

    #[tokio::test(start_paused = true)]
    async fn work_between_requests_is_not_lost() {
        // One transfer that spends 8 ms on each part between requests (reading
        // and hashing) still moves at the cap, not at cap minus its work.
        let l = Limiter::new(Bandwidth::from_bytes_per_sec(1_000_000.0));
        let start = Instant::now();
        for _ in 0..100 {
            l.acquire(30_000).await;
            tokio::time::sleep(Duration::from_millis(8)).await;
        }
        let took = start.elapsed().as_secs_f64();
        assert!((2.85..=3.02).contains(&took), "{took}");
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_never_waits() {
        let l = Limiter::unlimited();
        let start = Instant::now();
        l.acquire(u64::MAX / 2).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}
