//! Byte sizes as users type them: `8`, `1K`, `256M`, `1G`, `256MiB`
//! (binary units, as nccl-tests reads `-b`/`-e`).

/// Parses a size; `K`, `M`, `G`, `T` (any case, optionally followed by
/// `iB` or `B`) are powers of 1024.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    let bad = || format!("{s:?} is not a size (bytes, or a number with K, M, G or T)");
    if num.is_empty() {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// `268435456` -> `256 MiB`, `1000` -> `1000 B`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024 && v.is_multiple_of(1024) && u + 1 < UNITS.len() {
        v /= 1024;
        u += 1;
    }
    format!("{v} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (s, v) in [
            ("8", 8),
            ("1K", 1024),
            ("1k", 1024),
            ("256M", 256 << 20),
            ("256MiB", 256 << 20),
            ("1G", 1 << 30),
            ("2GB", 2 << 30),
            ("1T", 1 << 40),
            (" 64 ", 64),
        ] {
            assert_eq!(parse_size(s), Ok(v), "{s}");
        }
        for s in ["", "M", "1.5G", "-1", "1X", "1 G", "99999999999999999999"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(human(256 << 20), "256 MiB");
        assert_eq!(human(1000), "1000 B");
        assert_eq!(human(3 << 30), "3 GiB");
    }
}
