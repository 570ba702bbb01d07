//! Sets of small integer ids (CPUs, NUMA nodes) in the kernel's list and mask
//! formats.
//!
//! The list format is what `/sys/devices/system/cpu/online` and
//! `Cpus_allowed_list` use (`0-23,48-71`); the mask format is what Slurm's
//! `--cpu-bind=mask_cpu:` expects (hex, most significant nibble first, no
//! separators) and, with comma-separated 32-bit groups, what `Cpus_allowed`
//! prints.

use std::collections::BTreeSet;
use std::fmt;

/// The largest id accepted when parsing. The kernel's `NR_CPUS` tops out at
/// 8192; this bound only exists so that malformed input such as
/// `0-4294967295` is an error rather than an enormous allocation.
pub const MAX_ID: u32 = 65_535;

/// Why a list or mask could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdSetError {
    #[error("{0:?} is not a number")]
    NotANumber(String),
    #[error("range {start}-{end} is reversed")]
    Reversed { start: u32, end: u32 },
    #[error("id {0} is larger than {MAX_ID}")]
    TooLarge(u64),
    #[error("{0:?} is not a hexadecimal mask")]
    BadMask(String),
}

/// An ordered set of ids. Used for CPU sets and NUMA node sets.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdSet(BTreeSet<u32>);

/// A set of logical CPU ids.
pub type CpuSet = IdSet;
/// A set of NUMA node ids.
pub type NodeSet = IdSet;

impl IdSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses the kernel list format: `0-3,8,10-11`. Whitespace around the
    /// whole string (the trailing newline of a sysfs file) is ignored; an
    /// empty string is the empty set (a memory-only NUMA node has no CPUs).
    pub fn parse_list(s: &str) -> Result<Self, IdSetError> {
        let s = s.trim();
        let mut set = BTreeSet::new();
        if s.is_empty() {
            return Ok(Self(set));
        }
        for part in s.split(',') {
            let part = part.trim();
            // The kernel also accepts `0-31:2/8` (stride groups) on input, but
            // never prints it; reading it here would be guessing.
            let (start, end) = match part.split_once('-') {
                Some((a, b)) => (parse_id(a)?, parse_id(b)?),
                None => {
                    let id = parse_id(part)?;
                    (id, id)
                }
            };
            if start > end {
                return Err(IdSetError::Reversed { start, end });
            }
            set.extend(start..=end);
        }
        Ok(Self(set))
    }

    /// Parses a hex mask, either plain (`ffffff000000`, optionally with `0x`)
    /// or in the kernel's comma-separated 32-bit groups
    /// (`00000000,00ffffff`).
    pub fn parse_mask(s: &str) -> Result<Self, IdSetError> {
        let s = s.trim();
        let digits: String = s
            .strip_prefix("0x")
            .or_else(|| s.strip_prefix("0X"))
            .unwrap_or(s)
            .chars()
            .filter(|c| *c != ',')
            .collect();
        if digits.is_empty() {
            return Err(IdSetError::BadMask(s.to_owned()));
        }
        let mut set = BTreeSet::new();
        for (pos, c) in digits.chars().rev().enumerate() {
            let nibble = c
                .to_digit(16)
                .ok_or_else(|| IdSetError::BadMask(s.to_owned()))?;
            for bit in 0..4u32 {
                if nibble & (1 << bit) != 0 {
                    let id = pos as u64 * 4 + u64::from(bit);
                    if id > u64::from(MAX_ID) {
                        return Err(IdSetError::TooLarge(id));
                    }
                    set.insert(id as u32);
                }
            }
        }
        Ok(Self(set))
    }

    /// The kernel list format, shortest form: `0-3,8,10-11`. The empty set
    /// is the empty string.
    pub fn to_list(&self) -> String {
        let mut out = String::new();
        let mut iter = self.0.iter().copied().peekable();
        while let Some(start) = iter.next() {
            let mut end = start;
            while iter.peek() == Some(&(end + 1)) {
                end += 1;
                iter.next();
            }
            if !out.is_empty() {
                out.push(',');
            }
            if start == end {
                out.push_str(&start.to_string());
            } else {
                out.push_str(&format!("{start}-{end}"));
            }
        }
        out
    }

    /// The hex mask Slurm's `--cpu-bind=mask_cpu:` takes: lowercase, most
    /// significant nibble first, no `0x`, no leading zeros. The empty set is
    /// `0`.
    pub fn to_mask(&self) -> String {
        let Some(&max) = self.0.iter().next_back() else {
            return "0".to_owned();
        };
        let nibbles = max as usize / 4 + 1;
        let mut values = vec![0u8; nibbles];
        for &id in &self.0 {
            values[id as usize / 4] |= 1 << (id % 4);
        }
        values
            .iter()
            .rev()
            .map(|v| char::from_digit(u32::from(*v), 16).unwrap_or('0'))
            .collect()
    }

    pub fn insert(&mut self, id: u32) -> bool {
        self.0.insert(id)
    }
    pub fn contains(&self, id: u32) -> bool {
        self.0.contains(&id)
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = u32> + '_ {
        self.0.iter().copied()
    }
    pub fn first(&self) -> Option<u32> {
        self.0.first().copied()
    }
    pub fn is_subset(&self, other: &IdSet) -> bool {
        self.0.is_subset(&other.0)
    }
    pub fn intersects(&self, other: &IdSet) -> bool {
        !self.0.is_disjoint(&other.0)
    }
    pub fn intersection(&self, other: &IdSet) -> IdSet {
        Self(self.0.intersection(&other.0).copied().collect())
    }
    pub fn union(&self, other: &IdSet) -> IdSet {
        Self(self.0.union(&other.0).copied().collect())
    }
}

impl FromIterator<u32> for IdSet {
    fn from_iter<T: IntoIterator<Item = u32>>(iter: T) -> Self {
        Self(iter.into_iter().collect())
    }
}

impl fmt::Display for IdSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_list())
    }
}

impl fmt::Debug for IdSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdSet({:?})", self.to_list())
    }
}

impl serde::Serialize for IdSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_list())
    }
}

fn parse_id(s: &str) -> Result<u32, IdSetError> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(IdSetError::NotANumber(s.to_owned()));
    }
    let v: u64 = s
        .parse()
        .map_err(|_| IdSetError::NotANumber(s.to_owned()))?;
    if v > u64::from(MAX_ID) {
        return Err(IdSetError::TooLarge(v));
    }
    Ok(v as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(list: &str) -> IdSet {
        IdSet::parse_list(list).expect("valid list")
    }

    #[test]
    fn list_round_trip_examples() {
        for (input, canonical) in [
            ("0-23", "0-23"),
            ("0-3,8,10-11\n", "0-3,8,10-11"),
            ("5,4,3", "3-5"),
            ("", ""),
            ("48-63,176-191", "48-63,176-191"),
            ("7", "7"),
        ] {
            assert_eq!(set(input).to_list(), canonical, "input {input:?}");
        }
    }

    #[test]
    fn masks_match_the_ndv4_tuning_notes() {
        // NUMA node layout of Standard_ND96asr_v4 (4 x 24 cores).
        assert_eq!(set("0-23").to_mask(), "ffffff");
        assert_eq!(set("24-47").to_mask(), "ffffff000000");
        assert_eq!(set("48-71").to_mask(), "ffffff000000000000");
        assert_eq!(set("72-95").to_mask(), "ffffff000000000000000000");
        assert_eq!(IdSet::new().to_mask(), "0");
        assert_eq!(set("0").to_mask(), "1");
        assert_eq!(set("4").to_mask(), "10");
    }

    #[test]
    fn kernel_grouped_masks_parse() {
        assert_eq!(
            IdSet::parse_mask("00000000,00ffffff").map(|s| s.to_list()),
            Ok("0-23".into())
        );
        assert_eq!(
            IdSet::parse_mask("0xff000000").map(|s| s.to_list()),
            Ok("24-31".into())
        );
        assert_eq!(
            IdSet::parse_mask("3\n").map(|s| s.to_list()),
            Ok("0-1".into())
        );
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert_eq!(
            IdSet::parse_list("a-b"),
            Err(IdSetError::NotANumber("a".into()))
        );
        assert_eq!(
            IdSet::parse_list("5-3"),
            Err(IdSetError::Reversed { start: 5, end: 3 })
        );
        assert_eq!(
            IdSet::parse_list("0-4294967295"),
            Err(IdSetError::TooLarge(4294967295))
        );
        assert_eq!(
            IdSet::parse_list("1,,2"),
            Err(IdSetError::NotANumber(String::new()))
        );
        assert_eq!(
            IdSet::parse_list("-1"),
            Err(IdSetError::NotANumber(String::new()))
        );
        assert_eq!(
            IdSet::parse_list("+1"),
            Err(IdSetError::NotANumber("+1".into()))
        );
        assert_eq!(
            IdSet::parse_mask("xyz"),
            Err(IdSetError::BadMask("xyz".into()))
        );
        assert_eq!(
            IdSet::parse_mask(""),
            Err(IdSetError::BadMask(String::new()))
        );
    }

    fn any_set() -> impl Strategy<Value = IdSet> {
        proptest::collection::btree_set(0u32..1024, 0..300).prop_map(IdSet)
    }

    proptest! {
        #[test]
        fn list_format_round_trips(s in any_set()) {
            prop_assert_eq!(IdSet::parse_list(&s.to_list()), Ok(s));
        }

        #[test]
        fn mask_format_round_trips(s in any_set()) {
            prop_assert_eq!(IdSet::parse_mask(&s.to_mask()), Ok(s.clone()));
            let with_prefix = format!("0x{}", s.to_mask());
            prop_assert_eq!(IdSet::parse_mask(&with_prefix), Ok(s));
        }

        #[test]
        fn mask_has_one_bit_per_cpu(s in any_set()) {
            let bits: u32 = s.to_mask().chars().map(|c| c.to_digit(16).map_or(0, u32::count_ones)).sum();
            prop_assert_eq!(bits as usize, s.len());
        }

        #[test]
        fn parsers_never_panic(input in "[0-9a-fx,\\- ]{0,40}") {
            let _ = IdSet::parse_list(&input);
            let _ = IdSet::parse_mask(&input);
        }

        #[test]
        fn contiguous_range_is_one_run(start in 0u32..1000, len in 1u32..24) {
            let s: IdSet = (start..start + len).collect();
            let expected = if len == 1 { start.to_string() } else { format!("{}-{}", start, start + len - 1) };
            prop_assert_eq!(s.to_list(), expected);
        }
    }
}
