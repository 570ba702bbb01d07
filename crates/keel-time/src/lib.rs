//! Time for keel's libraries, in one place: the clocks they are given
//! (they never read the system's clocks themselves) and the UTC calendar.
//!
//! - [`Clock`] is the wall clock (milliseconds since the Unix epoch), for
//!   what is stamped or reset on calendar boundaries: the registry's
//!   records, the gateway's audit log, access log and quota windows.
//! - [`Monotonic`] is the monotonic clock ([`Instant`]), for durations and
//!   deadlines: health checks, benchmarks, the exporter's scrapes.
//! - [`SystemClock`] is both, reading the system; the binary hands it in.
//!   [`FixedClock`], [`ManualClock`], [`FrozenClock`] and [`SteppedClock`]
//!   are for tests.
//! - [`calendar`] is the proleptic Gregorian calendar in UTC (Howard
//!   Hinnant's `days_from_civil` and `civil_from_days`), RFC 3339 text
//!   and the parsers of the two timestamp shapes keel reads (`sacct`'s
//!   and AWS's).
//!
//! It knows no time zone but UTC, no leap seconds (like Unix time), and
//! no date before year 0 or after 9999 in text it writes into a fixed
//! buffer ([`Stamp`]).

#![forbid(unsafe_code)]

pub mod calendar;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use calendar::{
    civil_from_days, date, date_time, day_end_ms, day_of, days_from_civil, month_end_ms, month_of,
    parse_date_time, parse_rfc3339_secs, rfc3339, rfc3339_secs, Stamp,
};

/// The wall clock: milliseconds since the Unix epoch, from whoever runs
/// the library (the binary passes [`SystemClock`]; tests pass a fixed or
/// manual one).
pub trait Clock: Send + Sync + fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Microseconds since the Unix epoch (by default the milliseconds,
    /// times 1000).
    fn now_us(&self) -> u64 {
        self.now_ms().saturating_mul(1000)
    }
}

/// The monotonic clock, for durations and deadlines, and the waits taken
/// on it.
pub trait Monotonic: Send + Sync + fmt::Debug {
    fn now(&self) -> Instant;

    /// Takes a wait of `d` on this clock and returns how long the caller
    /// really sleeps (`std::thread::sleep(clock.wait(d))`, or tokio's
    /// sleep): `d` itself on the system's clock. A test clock
    /// ([`SteppedClock`]) moves forward by `d` and asks for at most a
    /// millisecond, so deadlines arrive without being waited for.
    fn wait(&self, d: Duration) -> Duration {
        d
    }
}

/// The system's clocks: [`SystemTime`] for [`Clock`] (a time before the
/// epoch reads as the epoch), [`Instant`] for [`Monotonic`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }

    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

impl Monotonic for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A wall clock that always says the same time (tests, reproducible
/// output).
#[derive(Debug, Clone, Copy)]
pub struct FixedClock(pub u64);

impl Clock for FixedClock {
    fn now_ms(&self) -> u64 {
        self.0
    }
}

/// A wall clock that moves only when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(ms: u64) -> Self {
        Self(AtomicU64::new(ms))
    }
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A monotonic clock that never moves: every duration is 0.
#[derive(Debug, Clone, Copy)]
pub struct FrozenClock(pub Instant);

impl Monotonic for FrozenClock {
    fn now(&self) -> Instant {
        self.0
    }
}

/// A monotonic clock that moves only by the waits taken on it and by
/// [`SteppedClock::advance`] (tests): a loop that waits 100 ms a turn sees
/// 100 ms pass each turn while it really sleeps a millisecond.
#[derive(Debug)]
pub struct SteppedClock {
    base: Instant,
    offset_ns: AtomicU64,
}

impl Default for SteppedClock {
    fn default() -> Self {
        SteppedClock {
            base: Instant::now(),
            offset_ns: AtomicU64::new(0),
        }
    }
}

impl SteppedClock {
    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.offset_ns.fetch_add(ns, Ordering::SeqCst);
    }

    /// How far the clock has moved since it was made.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.offset_ns.load(Ordering::SeqCst))
    }
}

impl Monotonic for SteppedClock {
    fn now(&self) -> Instant {
        self.base + self.elapsed()
    }

    fn wait(&self, d: Duration) -> Duration {
        self.advance(d);
        d.min(Duration::from_millis(1))
    }
}

/// Milliseconds since the epoch of a [`SystemTime`]; `None` before the
/// epoch.
pub fn unix_ms(t: SystemTime) -> Option<u64> {
    t.duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stepped_clock_moves_by_its_waits() {
        let c = SteppedClock::default();
        let t0 = c.now();
        assert_eq!(c.wait(Duration::from_secs(30)), Duration::from_millis(1));
        assert_eq!(c.wait(Duration::from_micros(10)), Duration::from_micros(10));
        c.advance(Duration::from_secs(2));
        assert_eq!(c.now() - t0, Duration::from_micros(32_000_010));
        assert_eq!(
            SystemClock.wait(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn manual_clock_moves_when_told() {
        let c = ManualClock::new(5);
        assert_eq!(c.now_ms(), 5);
        c.advance(10);
        assert_eq!(c.now_ms(), 15);
        assert_eq!(c.now_us(), 15_000);
        c.set(1);
        assert_eq!(c.now_ms(), 1);
    }

    #[test]
    fn system_clock_micros_agree_with_millis() {
        let us = SystemClock.now_us();
        let ms = SystemClock.now_ms();
        assert!(ms >= us / 1000, "{ms} {us}");
        assert!(unix_ms(UNIX_EPOCH) == Some(0));
        assert_eq!(
            unix_ms(UNIX_EPOCH - std::time::Duration::from_secs(1)),
            None
        );
    }
}
