//! Wall-clock time, injected: quotas reset on calendar boundaries and the
//! audit log stamps entries, but the library never reads the clock itself.

use std::sync::atomic::{AtomicU64, Ordering};

/// Milliseconds since the Unix epoch, from whoever runs the gateway.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> u64;
}

/// A clock that only moves when told to: for tests.
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

/// Days since the epoch (UTC) of a time in milliseconds.
pub fn day_of(ms: u64) -> u64 {
    ms / 86_400_000
}

/// Months since January 1970 (UTC) of a time in milliseconds.
pub fn month_of(ms: u64) -> u64 {
    let (y, m, _) = civil_from_days(day_of(ms) as i64);
    (y as u64 - 1970) * 12 + (m as u64 - 1)
}

/// Milliseconds at which the day containing `ms` ends.
pub fn day_end_ms(ms: u64) -> u64 {
    (day_of(ms) + 1) * 86_400_000
}

/// Milliseconds at which the month containing `ms` ends.
pub fn month_end_ms(ms: u64) -> u64 {
    let (y, m, _) = civil_from_days(day_of(ms) as i64);
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    days_from_civil(ny, nm, 1) as u64 * 86_400_000
}

/// Howard Hinnant's civil-from-days: (year, month 1-12, day 1-31).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// RFC 3339 UTC with milliseconds, for logs.
pub fn rfc3339(ms: u64) -> String {
    Stamp::millis(ms).as_str().to_owned()
}

/// An RFC 3339 UTC time written into a fixed buffer, for the per-request
/// log lines (no allocation, no formatting machinery).
#[derive(Clone, Copy)]
pub struct Stamp {
    buf: [u8; 27],
    len: usize,
}

impl Stamp {
    /// `YYYY-MM-DDTHH:MM:SS.mmmZ`; years past 9999 are clamped to 9999.
    pub fn millis(ms: u64) -> Self {
        Self::write(ms, None)
    }

    /// `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
    pub fn micros(us: u64) -> Self {
        Self::write(us / 1000, Some((us % 1000) as u32))
    }

    fn write(ms: u64, extra_us: Option<u32>) -> Self {
        let (y, m, d) = civil_from_days(day_of(ms) as i64);
        let s = (ms / 1000) % 86_400;
        let mut buf = [0u8; 27];
        let mut put = |at: usize, v: u64, width: usize| {
            let mut v = v;
            for i in (0..width).rev() {
                buf[at + i] = b'0' + (v % 10) as u8;
                v /= 10;
            }
        };
        put(0, y.clamp(0, 9999) as u64, 4);
        put(5, m as u64, 2);
        put(8, d as u64, 2);
        put(11, s / 3600, 2);
        put(14, (s / 60) % 60, 2);
        put(17, s % 60, 2);
        put(20, ms % 1000, 3);
        let len = match extra_us {
            Some(us) => {
                put(23, us as u64, 3);
                27
            }
            None => 24,
        };
        for (at, c) in [
            (4, b'-'),
            (7, b'-'),
            (10, b'T'),
            (13, b':'),
            (16, b':'),
            (19, b'.'),
        ] {
            buf[at] = c;
        }
        buf[len - 1] = b'Z';
        Self { buf, len }
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever written.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl std::fmt::Debug for Stamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar() {
        // 2026-01-31T23:59:59.999Z
        let t = 1_769_903_999_999;
        assert_eq!(rfc3339(t), "2026-01-31T23:59:59.999Z");
        assert_eq!(month_end_ms(t), t + 1);
        assert_eq!(day_end_ms(t), t + 1);
        assert_eq!(month_of(t) + 1, month_of(t + 1));
        assert_eq!(rfc3339(month_end_ms(t + 1)), "2026-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(month_of(0), 0);
        assert_eq!(
            Stamp::micros(t * 1000 + 42).as_str(),
            "2026-01-31T23:59:59.999042Z"
        );
        assert_eq!(Stamp::micros(0).as_str(), "1970-01-01T00:00:00.000000Z");
    }

    #[test]
    fn stamps_agree_with_a_formatter() {
        // Every day boundary for 500 years, and odd times within days.
        for day in (0..500 * 366).step_by(7) {
            let ms = day * 86_400_000 + (day * 7_919_113) % 86_400_000;
            let (y, m, d) = civil_from_days(day_of(ms) as i64);
            let s = (ms / 1000) % 86_400;
            let want = format!(
                "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
                s / 3600,
                (s / 60) % 60,
                s % 60,
                ms % 1000
            );
            assert_eq!(rfc3339(ms), want);
        }
    }
}
