//! The data benchmarks run on: random matrices for GEMM (never zeros),
//! deterministic patterns for collectives whose results are known exactly,
//! element encodings, and the comparison that counts wrong elements.

use keel_cuda::{GemmType, NcclOp, NcclType};

/// splitmix64: fast, seedable, good enough to make matrices that are not
/// zeros and not a pattern the hardware could shortcut.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Decodes an fp8 e4m3 byte.
pub fn e4m3_to_f64(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f64;
    let v = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * v
}

/// `n` random elements of a GEMM input type, as bytes, and (when
/// `values`) their exact values. Magnitudes are in [1/8, 16) for fp8 and
/// at most 1 otherwise; no element is zero.
pub fn gemm_input(t: GemmType, n: usize, seed: u64, values: bool) -> (Vec<u8>, Vec<f64>) {
    let mut rng = Rng::new(seed);
    let mut bytes = Vec::with_capacity(n * t.input_bytes());
    let mut vals = Vec::with_capacity(if values { n } else { 0 });
    for _ in 0..n {
        let v = match t {
            GemmType::Fp8 => {
                let r = rng.next_u64();
                // Sign, exponent field 4..=10 (2^-3 up to 2^3 x 1.875), any mantissa:
                // never zero, never NaN.
                let b = (((r & 1) as u8) << 7)
                    | (((4 + (r >> 1) % 7) as u8) << 3)
                    | ((r >> 8) & 7) as u8;
                bytes.push(b);
                e4m3_to_f64(b)
            }
            _ => {
                let mut x = rng.next_unit();
                if x == 0.0 {
                    x = 0.5;
                }
                encode_float(t.input_bytes(), matches!(t, GemmType::Bf16), x, &mut bytes)
            }
        };
        if values {
            vals.push(v);
        }
    }
    (bytes, vals)
}

/// Appends `x` rounded to a float of `size` bytes (2: fp16, or bf16 when
/// `bf16`), returning the rounded value.
fn encode_float(size: usize, bf16: bool, x: f64, out: &mut Vec<u8>) -> f64 {
    match (size, bf16) {
        (2, true) => {
            let h = half::bf16::from_f64(x);
            out.extend_from_slice(&h.to_bits().to_le_bytes());
            h.to_f64()
        }
        (2, false) => {
            let h = half::f16::from_f64(x);
            out.extend_from_slice(&h.to_bits().to_le_bytes());
            h.to_f64()
        }
        (4, _) => {
            let f = x as f32;
            out.extend_from_slice(&f.to_le_bytes());
            f as f64
        }
        _ => {
            out.extend_from_slice(&x.to_le_bytes());
            x
        }
    }
}

/// Decodes a GEMM output element (`bytes.len() == t.output_bytes()`).
pub fn gemm_output(t: GemmType, bytes: &[u8]) -> f64 {
    match t {
        GemmType::Bf16 | GemmType::Fp8 => {
            half::bf16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f64()
        }
        GemmType::Fp16 => half::f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f64(),
        GemmType::Tf32 | GemmType::Fp32 => {
            f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64
        }
        GemmType::Fp64 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[..8]);
            f64::from_le_bytes(b)
        }
    }
}

/// `c = a^T b` in float64 (a: k x m, b: k x n, column-major), the
/// reference for the small correctness problem.
pub fn reference_gemm(a: &[f64], b: &[f64], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for j in 0..n {
        let bj = &b[j * k..(j + 1) * k];
        for i in 0..m {
            let ai = &a[i * k..(i + 1) * k];
            c[i + j * m] = ai.iter().zip(bj).map(|(x, y)| x * y).sum();
        }
    }
    c
}

/// `||got - want|| / ||want||` (Frobenius); infinite if anything is not a
/// number.
pub fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    let mut num = 0.0;
    let mut den = 0.0;
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// The largest relative error the small GEMM check accepts per type: the
/// inputs' and output's rounding, with margin (TF32 keeps 10 mantissa
/// bits, bf16 8, fp16 11).
pub fn gemm_tolerance(t: GemmType) -> f64 {
    match t {
        GemmType::Fp64 => 1e-12,
        GemmType::Fp32 => 1e-5,
        GemmType::Tf32 => 5e-3,
        GemmType::Fp16 => 5e-3,
        GemmType::Bf16 | GemmType::Fp8 => 1e-2,
    }
}

/// nccl-tests' type names (`-d`).
pub fn nccl_type_name(t: NcclType) -> &'static str {
    match t {
        NcclType::Int8 => "int8",
        NcclType::Uint8 => "uint8",
        NcclType::Int32 => "int32",
        NcclType::Uint32 => "uint32",
        NcclType::Int64 => "int64",
        NcclType::Uint64 => "uint64",
        NcclType::Float16 => "half",
        NcclType::Float32 => "float",
        NcclType::Float64 => "double",
        NcclType::Bfloat16 => "bfloat16",
    }
}

pub fn nccl_op_name(o: NcclOp) -> &'static str {
    match o {
        NcclOp::Sum => "sum",
        NcclOp::Prod => "prod",
        NcclOp::Max => "max",
        NcclOp::Min => "min",
        NcclOp::Avg => "avg",
    }
}

pub fn is_float(t: NcclType) -> bool {
    matches!(
        t,
        NcclType::Float16 | NcclType::Float32 | NcclType::Float64 | NcclType::Bfloat16
    )
}

/// Appends `v` as one element of `t` (integers wrap as the GPU's would).
pub fn encode(t: NcclType, v: f64, out: &mut Vec<u8>) {
    match t {
        NcclType::Int8 => out.push((v as i64) as i8 as u8),
        NcclType::Uint8 => out.push((v as i64) as u8),
        NcclType::Int32 => out.extend_from_slice(&((v as i64) as i32).to_le_bytes()),
        NcclType::Uint32 => out.extend_from_slice(&((v as i64) as u32).to_le_bytes()),
        NcclType::Int64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        NcclType::Uint64 => out.extend_from_slice(&((v as i64) as u64).to_le_bytes()),
        NcclType::Float16 => {
            encode_float(2, false, v, out);
        }
        NcclType::Bfloat16 => {
            encode_float(2, true, v, out);
        }
        NcclType::Float32 => {
            encode_float(4, false, v, out);
        }
        NcclType::Float64 => {
            encode_float(8, false, v, out);
        }
    }
}

/// Reads one element of `t`.
pub fn decode(t: NcclType, b: &[u8]) -> f64 {
    let mut w = [0u8; 8];
    w[..t.size()].copy_from_slice(&b[..t.size()]);
    match t {
        NcclType::Int8 => b[0] as i8 as f64,
        NcclType::Uint8 => b[0] as f64,
        NcclType::Int32 => i32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        NcclType::Uint32 => u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        NcclType::Int64 => i64::from_le_bytes(w) as f64,
        NcclType::Uint64 => u64::from_le_bytes(w) as f64,
        NcclType::Float16 => half::f16::from_bits(u16::from_le_bytes([w[0], w[1]])).to_f64(),
        NcclType::Bfloat16 => half::bf16::from_bits(u16::from_le_bytes([w[0], w[1]])).to_f64(),
        NcclType::Float32 => f32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64,
        NcclType::Float64 => f64::from_le_bytes(w),
    }
}

/// The collective data pattern: what rank `q` holds at index `j`, chosen
/// so that every reduction is exact in every type for realistic rank
/// counts. Sum, min, max and avg use `1 + (j + 3q) mod 7`; prod uses 2 on
/// exactly one rank per index and 1 elsewhere, so every product is 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pattern {
    pub op: NcclOp,
    pub ranks: usize,
}

impl Pattern {
    /// Values repeat with this period in the index.
    pub fn period(&self) -> usize {
        match self.op {
            NcclOp::Prod => self.ranks.max(1),
            _ => 7,
        }
    }

    pub fn value(&self, q: usize, j: u64) -> f64 {
        match self.op {
            NcclOp::Prod => {
                if (j + q as u64).is_multiple_of(self.ranks.max(1) as u64) {
                    2.0
                } else {
                    1.0
                }
            }
            _ => (1 + (j + 3 * q as u64) % 7) as f64,
        }
    }

    /// The reduction over all ranks at index `j`.
    pub fn reduced(&self, j: u64) -> f64 {
        let vals = (0..self.ranks).map(|q| self.value(q, j));
        match self.op {
            NcclOp::Sum => vals.sum(),
            NcclOp::Prod => vals.product(),
            NcclOp::Max => vals.fold(f64::MIN, f64::max),
            NcclOp::Min => vals.fold(f64::MAX, f64::min),
            NcclOp::Avg => vals.sum::<f64>() / self.ranks as f64,
        }
    }
}

/// A periodic sequence of expected values: `at(i) = table[(start + i) %
/// len]`.
#[derive(Debug, Clone)]
pub struct Periodic {
    table: Vec<f64>,
    start: u64,
}

impl Periodic {
    /// `f` sampled over one period starting at index `start`.
    pub fn new(period: usize, start: u64, f: impl Fn(u64) -> f64) -> Self {
        Periodic {
            table: (0..period as u64).map(f).collect(),
            start,
        }
    }

    pub fn at(&self, i: u64) -> f64 {
        self.table[((self.start + i) % self.table.len() as u64) as usize]
    }

    /// `count` elements encoded as `t`.
    pub fn encode(&self, t: NcclType, count: usize) -> Vec<u8> {
        let p = self.table.len();
        let mut one = Vec::with_capacity(p * t.size());
        for i in 0..p as u64 {
            encode(t, self.at(i), &mut one);
        }
        let mut out = Vec::with_capacity(count * t.size());
        let full = count / p;
        for _ in 0..full {
            out.extend_from_slice(&one);
        }
        out.extend_from_slice(&one[..(count % p) * t.size()]);
        out
    }
}

/// How far a float result may be from the exact value, relative (NCCL
/// sums in the element type, in an order of its choosing).
pub fn nccl_tolerance(t: NcclType) -> f64 {
    match t {
        NcclType::Float16 => 2e-3,
        NcclType::Bfloat16 => 1.6e-2,
        NcclType::Float32 => 1e-6,
        NcclType::Float64 => 1e-12,
        _ => 0.0,
    }
}

/// Elements of `got` (type `t`) that differ from `want`.
pub fn count_wrong(t: NcclType, got: &[u8], want: &Periodic) -> u64 {
    let size = t.size();
    let tol = nccl_tolerance(t);
    // Integers compare after the same wrap-around the GPU does.
    let target = |v: f64| {
        if is_float(t) {
            v
        } else {
            let mut b = Vec::with_capacity(8);
            encode(t, v, &mut b);
            decode(t, &b)
        }
    };
    let targets = Periodic {
        table: want.table.iter().map(|v| target(*v)).collect(),
        start: want.start,
    };
    got.chunks_exact(size)
        .enumerate()
        .filter(|(i, b)| {
            let g = decode(t, b);
            let w = targets.at(*i as u64);
            !(g == w || (g.is_finite() && (g - w).abs() <= tol * w.abs()))
        })
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_inputs_are_never_zero_and_round_trip() {
        for t in [
            GemmType::Bf16,
            GemmType::Fp16,
            GemmType::Tf32,
            GemmType::Fp32,
            GemmType::Fp64,
            GemmType::Fp8,
        ] {
            let (bytes, vals) = gemm_input(t, 4096, 7, true);
            assert_eq!(bytes.len(), 4096 * t.input_bytes());
            assert!(vals.iter().all(|v| *v != 0.0 && v.is_finite()), "{t:?}");
            if t != GemmType::Fp8 {
                assert!(vals.iter().all(|v| v.abs() <= 1.0), "{t:?}");
            } else {
                assert!(vals.iter().all(|v| (0.125..16.0).contains(&v.abs())));
            }
            // Same seed, same data; different seed, different data.
            assert_eq!(gemm_input(t, 4096, 7, false).0, bytes);
            assert_ne!(gemm_input(t, 4096, 8, false).0, bytes);
        }
        assert_eq!(e4m3_to_f64(0x38), 1.0);
        assert_eq!(e4m3_to_f64(0xC0), -2.0);
        assert_eq!(e4m3_to_f64(0x7E), 448.0);
        assert_eq!(e4m3_to_f64(0x01), 2f64.powi(-9));
    }

    #[test]
    fn reference_product_and_error() {
        // a^T (k=2, m=2) and b (k=2, n=1).
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [5.0, 6.0];
        assert_eq!(reference_gemm(&a, &b, (2, 1, 2)), vec![17.0, 39.0]);
        assert_eq!(relative_error(&[17.0, 39.0], &[17.0, 39.0]), 0.0);
        assert!(relative_error(&[f64::NAN, 39.0], &[17.0, 39.0]).is_infinite());
        let e = relative_error(&[18.0, 39.0], &[17.0, 39.0]);
        assert!((e - 1.0 / (17.0f64 * 17.0 + 39.0 * 39.0).sqrt()).abs() < 1e-15);
    }

    #[test]
    fn encodings_round_trip() {
        for t in [
            NcclType::Int8,
            NcclType::Uint8,
            NcclType::Int32,
            NcclType::Uint32,
            NcclType::Int64,
            NcclType::Uint64,
            NcclType::Float16,
            NcclType::Float32,
            NcclType::Float64,
            NcclType::Bfloat16,
        ] {
            for v in [1.0, 2.0, 7.0, 56.0, 100.0] {
                let mut b = Vec::new();
                encode(t, v, &mut b);
                assert_eq!(b.len(), t.size());
                assert_eq!(decode(t, &b), v, "{t:?} {v}");
            }
        }
        let mut b = Vec::new();
        encode(NcclType::Int8, 200.0, &mut b);
        assert_eq!(decode(NcclType::Int8, &b), -56.0);
        assert!(decode(NcclType::Float32, &[0xff; 4]).is_nan());
    }

    #[test]
    fn patterns_reduce_exactly() {
        let p = Pattern {
            op: NcclOp::Sum,
            ranks: 4,
        };
        assert_eq!(p.value(0, 0), 1.0);
        assert_eq!(p.value(1, 0), 4.0);
        // Ranks 0..4 at index 0: 1, 4, 7, 3.
        assert_eq!(p.reduced(0), 15.0);
        for op in [
            NcclOp::Sum,
            NcclOp::Prod,
            NcclOp::Max,
            NcclOp::Min,
            NcclOp::Avg,
        ] {
            for ranks in [1, 2, 3, 8, 16] {
                let p = Pattern { op, ranks };
                let per = p.period() as u64;
                for j in 0..50u64 {
                    assert_eq!(p.reduced(j), p.reduced(j + per), "{op:?} {ranks}");
                    for q in 0..ranks {
                        assert_eq!(p.value(q, j), p.value(q, j + per));
                        assert!(p.value(q, j) >= 1.0);
                    }
                }
                if op == NcclOp::Prod {
                    assert!((0..50).all(|j| p.reduced(j) == 2.0));
                }
            }
        }
    }

    #[test]
    fn periodic_encoding_and_wrong_counts() {
        let p = Pattern {
            op: NcclOp::Sum,
            ranks: 2,
        };
        let want = Periodic::new(p.period(), 5, |j| p.reduced(j));
        for t in [
            NcclType::Float32,
            NcclType::Bfloat16,
            NcclType::Int8,
            NcclType::Float64,
        ] {
            let mut bytes = want.encode(t, 20);
            assert_eq!(bytes.len(), 20 * t.size());
            assert_eq!(decode(t, &bytes), p.reduced(5));
            assert_eq!(count_wrong(t, &bytes, &want), 0, "{t:?}");
            // Two wrong elements: one with a high bit flipped, one garbage.
            bytes[4 * t.size() - 1] ^= 0x40;
            for b in &mut bytes[10 * t.size()..11 * t.size()] {
                *b = 0xff;
            }
            assert_eq!(count_wrong(t, &bytes, &want), 2, "{t:?}");
        }
        // bf16 within its tolerance is right.
        let avg = Pattern {
            op: NcclOp::Avg,
            ranks: 3,
        };
        let want = Periodic::new(avg.period(), 0, |j| avg.reduced(j));
        let bytes = want.encode(NcclType::Bfloat16, 14);
        assert_eq!(count_wrong(NcclType::Bfloat16, &bytes, &want), 0);
    }
}
