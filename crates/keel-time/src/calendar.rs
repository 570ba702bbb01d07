//! The proleptic Gregorian calendar in UTC, as Unix time counts it (no
//! leap seconds): days since 1970-01-01 to and from civil dates (Howard
//! Hinnant's algorithms, <https://howardhinnant.github.io/date_algorithms.html>),
//! RFC 3339 text, and the parsers of the timestamps keel reads.

/// Milliseconds in a day.
const DAY_MS: u64 = 86_400_000;

/// The civil date (year, month 1-12, day 1-31) of a day counted from
/// 1970-01-01 (Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    // 1..=31 and 1..=12 by construction.
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Days since 1970-01-01 of a civil date (Hinnant's `days_from_civil`).
/// The month is 1-12; a day past the month's end counts on into the next
/// (callers check ranges).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since the epoch (UTC) of a time in milliseconds.
pub fn day_of(ms: u64) -> u64 {
    ms / DAY_MS
}

/// Months since January 1970 (UTC) of a time in milliseconds.
pub fn month_of(ms: u64) -> u64 {
    let (y, m, _) = civil_from_days(day_index(ms));
    (y as u64 - 1970) * 12 + (u64::from(m) - 1)
}

/// Milliseconds at which the day containing `ms` ends.
pub fn day_end_ms(ms: u64) -> u64 {
    (day_of(ms) + 1) * DAY_MS
}

/// Milliseconds at which the month containing `ms` ends.
pub fn month_end_ms(ms: u64) -> u64 {
    let (y, m, _) = civil_from_days(day_index(ms));
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    days_from_civil(ny, nm, 1) as u64 * DAY_MS
}

fn day_index(ms: u64) -> i64 {
    // u64 milliseconds are at most 2^64 / 86.4e6 ≈ 2.1e11 days.
    day_of(ms) as i64
}

/// `YYYY-MM-DD`, `HH`, `MM`, `SS` of a time in whole seconds.
fn split_secs(secs: i64) -> (i64, u32, u32, i64) {
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    (y, m, d, secs.rem_euclid(86_400))
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a time in milliseconds since the epoch
/// (before it too), as the registry and the gateway's records show time.
pub fn rfc3339(ms: impl Into<i128>) -> String {
    let ms: i128 = ms.into();
    let secs = i64::try_from(ms.div_euclid(1000)).unwrap_or(i64::MAX);
    let milli = ms.rem_euclid(1000);
    let (y, m, d, s) = split_secs(secs);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{milli:03}Z",
        s / 3600,
        s % 3600 / 60,
        s % 60
    )
}

/// `YYYY-MM-DDTHH:MM:SSZ` for Unix seconds.
pub fn rfc3339_secs(secs: i64) -> String {
    let mut t = date_time(secs);
    t.push('Z');
    t
}

/// `YYYY-MM-DDTHH:MM:SS` (no zone: the form `sacct` reads and writes)
/// for Unix seconds.
pub fn date_time(secs: i64) -> String {
    let (y, m, d, s) = split_secs(secs);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        s / 3600,
        s % 3600 / 60,
        s % 60
    )
}

/// `YYYY-MM-DD` of Unix seconds.
pub fn date(secs: i64) -> String {
    let (y, m, d, _) = split_secs(secs);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM-DDTHH:MM:SS` (sacct's format) as seconds since the epoch,
/// read as UTC; `None` for anything else (`Unknown`, `None`, a date out
/// of range). A leap second (`:60`) counts as the next second.
pub fn parse_date_time(s: &str) -> Option<i64> {
    let b = s.trim().as_bytes();
    if b.len() != 19 {
        return None;
    }
    fields(b)
}

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds, as AWS's metadata writes
/// it) as seconds since the epoch.
pub fn parse_rfc3339_secs(s: &str) -> Option<i64> {
    let b = s.trim().as_bytes();
    if b.len() != 20 || b[19] != b'Z' {
        return None;
    }
    fields(&b[..19])
}

/// The 19 bytes `YYYY-MM-DDTHH:MM:SS` as seconds since the epoch.
fn fields(b: &[u8]) -> Option<i64> {
    if b.len() != 19
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| {
        let part = &b[r];
        part.iter()
            .all(u8::is_ascii_digit)
            .then(|| std::str::from_utf8(part).ok()?.parse::<i64>().ok())
            .flatten()
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    // In range: checked above.
    let days = days_from_civil(y, mo as u32, d as u32);
    Some(days * 86_400 + h * 3600 + mi * 60 + se)
}

/// An RFC 3339 UTC time written into a fixed buffer, for per-request log
/// lines (no allocation, no formatting machinery).
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
        let (y, m, d) = civil_from_days(day_index(ms));
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
        put(5, u64::from(m), 2);
        put(8, u64::from(d), 2);
        put(11, s / 3600, 2);
        put(14, (s / 60) % 60, 2);
        put(17, s % 60, 2);
        put(20, ms % 1000, 3);
        let len = match extra_us {
            Some(us) => {
                put(23, u64::from(us), 3);
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
    use proptest::prelude::*;

    /// Days from 1970-01-01 to January 1st of `y`, counted year by year
    /// with the Gregorian leap rule: a reference that shares nothing with
    /// Hinnant's eras.
    fn days_to_year(y: i64) -> i64 {
        let leaps_before = |y: i64| {
            let p = y - 1;
            p.div_euclid(4) - p.div_euclid(100) + p.div_euclid(400)
        };
        365 * (y - 1970) + leaps_before(y) - leaps_before(1970)
    }

    fn is_leap(y: i64) -> bool {
        (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
    }

    fn month_len(y: i64, m: u32) -> u32 {
        match m {
            2 if is_leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        }
    }

    #[test]
    fn known_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(days_from_civil(2000, 2, 29), 11_016);
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(rfc3339(0u64), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123i64), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_714_564_800_000u64), "2024-05-01T12:00:00.000Z");
        assert_eq!(rfc3339(-1i64), "1969-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_secs(1_767_323_045), "2026-01-02T03:04:05Z");
        assert_eq!(date_time(1_767_323_045), "2026-01-02T03:04:05");
        assert_eq!(date(1_767_323_045), "2026-01-02");
        assert_eq!(parse_date_time("2026-01-02T03:04:05"), Some(1_767_323_045));
        assert_eq!(
            parse_rfc3339_secs("2026-01-02T03:04:05Z"),
            Some(1_767_323_045)
        );
        assert_eq!(parse_rfc3339_secs("2026-01-02T03:04:05"), None);
        assert_eq!(parse_date_time("Unknown"), None);
        assert_eq!(parse_date_time("2026-13-02T03:04:05"), None);
        assert_eq!(parse_date_time("2026-+1-02T03:04:05"), None);
    }

    #[test]
    fn quota_windows() {
        // 2026-01-31T23:59:59.999Z
        let t = 1_769_903_999_999;
        assert_eq!(rfc3339(t), "2026-01-31T23:59:59.999Z");
        assert_eq!(month_end_ms(t), t + 1);
        assert_eq!(day_end_ms(t), t + 1);
        assert_eq!(month_of(t) + 1, month_of(t + 1));
        assert_eq!(rfc3339(month_end_ms(t + 1)), "2026-03-01T00:00:00.000Z");
        assert_eq!(month_of(0), 0);
        assert_eq!(
            Stamp::micros(t * 1000 + 42).as_str(),
            "2026-01-31T23:59:59.999042Z"
        );
        assert_eq!(Stamp::micros(0).as_str(), "1970-01-01T00:00:00.000000Z");
    }

    proptest! {
        #[test]
        fn days_round_trip(days in -1_000_000_000i64..1_000_000_000) {
            let (y, m, d) = civil_from_days(days);
            prop_assert!((1..=12).contains(&m));
            prop_assert!(d >= 1 && d <= month_len(y, m));
            prop_assert_eq!(days_from_civil(y, m, d), days);
        }

        #[test]
        fn dates_round_trip(y in -100_000i64..100_000, m in 1u32..=12, d in 1u32..=31) {
            let d = d.min(month_len(y, m));
            prop_assert_eq!(civil_from_days(days_from_civil(y, m, d)), (y, m, d));
        }

        #[test]
        fn new_year_agrees_with_counting_leap_years(y in -100_000i64..100_000) {
            prop_assert_eq!(days_from_civil(y, 1, 1), days_to_year(y));
        }

        #[test]
        fn the_next_day_is_the_next_date(days in -10_000_000i64..10_000_000) {
            let (y, m, d) = civil_from_days(days);
            let next = civil_from_days(days + 1);
            let want = if d < month_len(y, m) {
                (y, m, d + 1)
            } else if m < 12 {
                (y, m + 1, 1)
            } else {
                (y + 1, 1, 1)
            };
            prop_assert_eq!(next, want);
        }

        #[test]
        fn text_round_trips(secs in 0i64..253_402_300_800) {
            // Years 1970 to 9999, the range of four-digit years.
            prop_assert_eq!(parse_date_time(&date_time(secs)), Some(secs));
            prop_assert_eq!(parse_rfc3339_secs(&rfc3339_secs(secs)), Some(secs));
            let ms = secs as u64 * 1000 + (secs as u64 % 1000);
            let stamp = Stamp::millis(ms);
            prop_assert_eq!(stamp.as_str().to_owned(), rfc3339(ms));
            prop_assert_eq!(&rfc3339(ms)[..19], &date_time(secs)[..]);
        }

        #[test]
        fn month_windows_hold_their_time(ms in 0u64..253_402_300_800_000) {
            let end = month_end_ms(ms);
            prop_assert!(end > ms);
            prop_assert_eq!(month_of(end), month_of(ms) + 1);
            prop_assert_eq!(month_of(end - 1), month_of(ms));
            prop_assert_eq!(day_end_ms(ms) % DAY_MS, 0);
            prop_assert!(day_end_ms(ms) > ms && day_end_ms(ms) - ms <= DAY_MS);
        }
    }
}
