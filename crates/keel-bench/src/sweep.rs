//! The message sizes of a collective benchmark, as nccl-tests steps them:
//! from `-b` to `-e` inclusive, multiplying by `-f` when it is above 1,
//! else adding `-i` bytes.

use serde::Serialize;

/// nccl-tests' defaults: 32 MiB only, step 1 MiB.
pub const DEFAULT_MIN: u64 = 32 << 20;
pub const DEFAULT_MAX: u64 = 32 << 20;
pub const DEFAULT_STEP: u64 = 1 << 20;

/// More sizes than this is a typo (`-i 1` up to 1G), not a benchmark.
pub const MAX_SIZES: usize = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sweep {
    pub min_bytes: u64,
    pub max_bytes: u64,
    /// `-f`: multiply by this when above 1.
    pub factor: u64,
    /// `-i`: add this when the factor is 1.
    pub step_bytes: u64,
}

impl Default for Sweep {
    fn default() -> Self {
        Self {
            min_bytes: DEFAULT_MIN,
            max_bytes: DEFAULT_MAX,
            factor: 1,
            step_bytes: DEFAULT_STEP,
        }
    }
}

impl Sweep {
    /// The sizes, or why the sweep is invalid.
    pub fn sizes(&self) -> Result<Vec<u64>, String> {
        if self.min_bytes > self.max_bytes {
            return Err(format!(
                "-b {} is larger than -e {}",
                self.min_bytes, self.max_bytes
            ));
        }
        if self.factor == 0 {
            return Err("-f must be at least 1".into());
        }
        let multiply = self.factor > 1;
        if multiply && self.min_bytes == 0 {
            return Err("-b 0 with -f above 1 never grows; start at 1 byte or more".into());
        }
        if !multiply && self.step_bytes == 0 && self.min_bytes < self.max_bytes {
            return Err("-i 0 with -f 1 never reaches -e".into());
        }
        let mut sizes = Vec::new();
        let mut size = self.min_bytes;
        loop {
            sizes.push(size);
            if sizes.len() > MAX_SIZES {
                return Err(format!(
                    "the sweep from {} to {} bytes has more than {MAX_SIZES} sizes; use a larger -i or -f",
                    self.min_bytes, self.max_bytes
                ));
            }
            let next = if multiply {
                size.checked_mul(self.factor)
            } else {
                size.checked_add(self.step_bytes)
            };
            match next {
                Some(n) if n <= self.max_bytes && n != size => size = n,
                _ => break,
            }
        }
        Ok(sizes)
    }

    /// `step: 2(factor)` / `step: 1048576(bytes)` as nccl-tests' header
    /// says it.
    pub fn describe_step(&self) -> String {
        if self.factor > 1 {
            format!("{}(factor)", self.factor)
        } else {
            format!("{}(bytes)", self.step_bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep(min: u64, max: u64, factor: u64, step: u64) -> Result<Vec<u64>, String> {
        Sweep {
            min_bytes: min,
            max_bytes: max,
            factor,
            step_bytes: step,
        }
        .sizes()
    }

    #[test]
    fn factor_sweeps() {
        assert_eq!(sweep(8, 128, 2, 0), Ok(vec![8, 16, 32, 64, 128]));
        // -e is a bound, not a size that must appear.
        assert_eq!(sweep(8, 100, 2, 0), Ok(vec![8, 16, 32, 64]));
        assert_eq!(sweep(1, 1000, 10, 0), Ok(vec![1, 10, 100, 1000]));
        let big = sweep(8, 1 << 30, 2, 0).expect("sweep");
        assert_eq!(big.len(), 28);
        assert_eq!(big.last(), Some(&(1 << 30)));
    }

    #[test]
    fn step_sweeps_and_single_sizes() {
        assert_eq!(
            sweep(0, 3 << 20, 1, 1 << 20),
            Ok(vec![0, 1 << 20, 2 << 20, 3 << 20])
        );
        assert_eq!(sweep(100, 350, 1, 100), Ok(vec![100, 200, 300]));
        assert_eq!(sweep(64, 64, 1, 0), Ok(vec![64]));
        assert_eq!(Sweep::default().sizes(), Ok(vec![32 << 20]));
        assert_eq!(sweep(u64::MAX - 1, u64::MAX, 2, 0), Ok(vec![u64::MAX - 1]));
    }

    #[test]
    fn invalid_sweeps() {
        for (s, needle) in [
            (sweep(128, 8, 2, 0), "larger than -e"),
            (sweep(0, 8, 2, 0), "never grows"),
            (sweep(8, 64, 1, 0), "never reaches"),
            (sweep(8, 64, 0, 1), "at least 1"),
            (sweep(1, 1 << 30, 1, 1), "more than 10000 sizes"),
        ] {
            let e = s.expect_err(needle);
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn step_descriptions() {
        let mut s = Sweep::default();
        assert_eq!(s.describe_step(), "1048576(bytes)");
        s.factor = 2;
        assert_eq!(s.describe_step(), "2(factor)");
    }
}
