//! Units keel reads from people: a bandwidth in explicit units.
//!
//! Units: bits per second spell `bit/s` or `bps` (`2300Mbit/s`,
//! `2.3Gbps`, as azcopy's `--cap-mbps` counts), bytes per second spell `B/s`
//! (`280MB/s`, `256MiB/s`, as rclone's `--bwlimit` counts). Prefixes `k M G
//! T` are decimal (powers of 1000), `Ki Mi Gi Ti` binary. A bare number is
//! refused: a cap that is off by a factor of eight is worse than none.
//!
//! A leaf: keel-store paces transfers with it, keel-review checks storage
//! sizing with it, without either pulling in the other.

#![forbid(unsafe_code)]

use std::fmt;

/// A bandwidth that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid bandwidth {input:?}: {reason}")]
pub struct BandwidthError {
    pub input: String,
    pub reason: String,
}

impl keel_error::HasKind for BandwidthError {
    fn kind(&self) -> keel_error::ErrorKind {
        keel_error::ErrorKind::Usage
    }
}

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
    pub fn parse(input: &str) -> Result<Self, BandwidthError> {
        let bad = |reason: &str| BandwidthError {
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
}
