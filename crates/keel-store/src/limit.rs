//! A bandwidth cap in explicit units and the limiter that enforces it
//! across every transfer of a process.
//!
//! Units: bits per second spell `bit/s` or `bps` (`2300Mbit/s`,
//! `2.3Gbps`, as azcopy's `--cap-mbps` counts), bytes per second spell `B/s`
//! (`280MB/s`, `256MiB/s`, as rclone's `--bwlimit` counts). Prefixes `k M G
//! T` are decimal (powers of 1000), `Ki Mi Gi Ti` binary. A bare number is
//! refused: a cap that is off by a factor of eight is worse than none.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::StoreError;

/// A rate, kept in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidth {
    bytes_per_sec: f64,
}

impl Bandwidth {
    pub fn from_bytes_per_sec(bytes_per_sec: f64) -> Self {
        Self { bytes_per_sec }
    }

    pub fn bytes_per_sec(self) -> f64 {
        self.bytes_per_sec
    }

    pub fn bits_per_sec(self) -> f64 {
        self.bytes_per_sec * 8.0
    }

    /// Parses `2300Mbit/s`, `2300Mbps`, `280MB/s`, `256MiB/s`, `1.5Gbit/s`.
    pub fn parse(input: &str) -> Result<Self, StoreError> {
        let bad = |reason: &str| StoreError::BadBandwidth {
            input: input.to_owned(),
            reason: reason.to_owned(),
        };
        let s = input.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| {
                bad("a unit is required: bits (`2300Mbit/s`, `2300Mbps`) or bytes (`280MB/s`)")
            })?;
        let (num, unit) = s.split_at(split);
        let value: f64 = num
            .parse()
            .map_err(|_| bad("expected a number followed by a unit"))?;
        let unit = unit.trim();
        let (mult, rest) = match unit.as_bytes() {
            [b'K' | b'k', b'i', ..] => (1024f64, &unit[2..]),
            [b'M', b'i', ..] => (1024f64.powi(2), &unit[2..]),
            [b'G', b'i', ..] => (1024f64.powi(3), &unit[2..]),
            [b'T', b'i', ..] => (1024f64.powi(4), &unit[2..]),
            [b'k' | b'K', ..] => (1e3, &unit[1..]),
            [b'M', ..] => (1e6, &unit[1..]),
            [b'G', ..] => (1e9, &unit[1..]),
            [b'T', ..] => (1e12, &unit[1..]),
            [b'm', ..] => {
                return Err(bad(
                    "`m` is milli: write `Mbit/s` for megabits or `MB/s` for megabytes",
                ))
            }
            _ => (1.0, unit),
        };
        let per_byte = match rest {
            "bit/s" | "bps" | "b/s" | "bits/s" => 1.0 / 8.0,
            "B/s" | "Bps" | "byte/s" | "bytes/s" => 1.0,
            "" => {
                return Err(bad(
                    "a unit is required: bits (`2300Mbit/s`, `2300Mbps`) or bytes (`280MB/s`)",
                ))
            }
            _ => {
                return Err(bad(
                    "unknown unit: use bit/s or bps for bits, B/s for bytes, with k M G T or Ki Mi Gi Ti",
                ))
            }
        };
        let bytes_per_sec = value * mult * per_byte;
        if !(bytes_per_sec.is_finite() && bytes_per_sec >= 1.0) {
            return Err(bad("must be at least 1 B/s"));
        }
        Ok(Self { bytes_per_sec })
    }
}

impl fmt::Display for Bandwidth {
    /// `2300 Mbit/s (287.5 MB/s)`: both units, decimal prefixes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = self.bits_per_sec();
        let (b, bu) = scale(bits);
        let (y, yu) = scale(self.bytes_per_sec);
        write!(f, "{b} {bu}bit/s ({y} {yu}B/s)")
    }
}

fn scale(v: f64) -> (String, &'static str) {
    let units = [("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)];
    let mut pick = units[0];
    for u in units {
        if v >= u.1 {
            pick = u;
        }
    }
    let x = v / pick.1;
    let s = if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round())
    } else {
        format!("{x:.1}")
    };
    (s, pick.0)
}

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

    fn bps(input: &str) -> f64 {
        Bandwidth::parse(input)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .bytes_per_sec()
    }

    #[test]
    fn units() {
        assert_eq!(bps("2300Mbit/s"), 2300e6 / 8.0);
        assert_eq!(bps("2300Mbps"), 2300e6 / 8.0);
        assert_eq!(bps("2300 Mb/s"), 2300e6 / 8.0);
        assert_eq!(bps("280MB/s"), 280e6);
        assert_eq!(bps("280MBps"), 280e6);
        assert_eq!(bps("256MiB/s"), 256.0 * 1024.0 * 1024.0);
        assert_eq!(bps("1.5Gbit/s"), 1.5e9 / 8.0);
        assert_eq!(bps("10kB/s"), 10e3);
        assert_eq!(bps("10KiB/s"), 10240.0);
        for bad in [
            "2300",
            "2300m",
            "2300mb/s",
            "MB/s",
            "0MB/s",
            "1.2.3MB/s",
            "5 furlongs",
        ] {
            assert!(Bandwidth::parse(bad).is_err(), "{bad}");
        }
        let e = Bandwidth::parse("2300").expect_err("bare").to_string();
        assert!(e.contains("unit is required"), "{e}");
    }

    #[test]
    fn display_shows_both_units() {
        assert_eq!(
            Bandwidth::parse("2300Mbit/s").expect("parse").to_string(),
            "2.3 Gbit/s (287.5 MB/s)"
        );
        assert_eq!(
            Bandwidth::parse("280MB/s").expect("parse").to_string(),
            "2.2 Gbit/s (280 MB/s)"
        );
    }

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
