//! GEMM throughput and correctness through cuBLAS.
//!
//! Per GPU (all selected GPUs at once, one thread each, as a burn test
//! loads a node):
//!
//! 1. Correctness: a small non-square product (`CHECK_DIMS`) of fresh
//!    random inputs, output poisoned with NaN first, compared with a
//!    float64 CPU product of the same (rounded) inputs by relative
//!    Frobenius error against the type's tolerance.
//! 2. Throughput: the large product on random inputs (never zeros). After
//!    warm-up, one product is timed to size a repetition (enough products
//!    back to back to last about [`REPETITION_MS`]); `iters` repetitions
//!    are queued back to back, as a training step keeps the GPU busy, with
//!    a CUDA event between each: TFLOPS = 2 m n k x products / time of
//!    each repetition. The GPU never waits for the host between them, so
//!    the figure is the sustained rate (warm, at its power limit), not
//!    that of bursts with the GPU idle in between.
//! 3. Corruption: then `iters` more products, each output copied back and
//!    compared byte for byte with the timed ones' (cuBLAS is
//!    deterministic on one GPU, so any difference is a fault, as gpu-burn
//!    checks).
//!
//! `duration` makes it a burn test: repetitions until that much time has
//! passed, each output copied back and compared as it completes (the GPU
//! waits for the copy and comparison between repetitions, so its TFLOPS
//! read higher than a sustained run's).

use std::time::Duration;

use keel_cuda::{Cuda, GemmType};
use serde::Serialize;

use crate::data;
use crate::peaks;
use crate::stats::Summary;
use crate::{BenchError, Monotonic};

/// The small correctness problem (m, n, k): not square, multiples of 16
/// (FP8's requirement), small enough for a quick CPU reference.
pub const CHECK_DIMS: (usize, usize, usize) = (320, 192, 256);

/// Target length of one timed repetition.
pub const REPETITION_MS: f64 = 25.0;

#[derive(Debug, Clone, PartialEq)]
pub struct GemmRequest {
    pub gpus: Vec<usize>,
    pub dtype: GemmType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Timed repetitions (ignored when `duration` is set).
    pub iters: usize,
    /// Untimed products before timing.
    pub warmup: usize,
    /// Repeat until this much time has passed.
    pub duration: Option<Duration>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GemmReport {
    pub dtype: &'static str,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub gpus: Vec<GpuGemm>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuGemm {
    pub gpu: usize,
    pub name: String,
    pub pci_bus_id: String,
    pub cublas_version: i32,
    /// TFLOPS per repetition.
    pub tflops: Summary,
    /// Datasheet dense peak for this GPU and type, when the model is known.
    pub peak_tflops: Option<f64>,
    /// Median TFLOPS over the peak.
    pub fraction_of_peak: Option<f64>,
    pub repetitions: usize,
    pub products_per_repetition: usize,
    /// Repetitions whose output differed from the first's.
    pub mismatched_repetitions: usize,
    pub check: SmallCheck,
    /// Seconds spent timing (the burn).
    pub seconds: f64,
    /// Correct and consistent.
    pub passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SmallCheck {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub relative_error: f64,
    pub tolerance: f64,
    pub passed: bool,
}

pub fn type_name(t: GemmType) -> &'static str {
    match t {
        GemmType::Bf16 => "bf16",
        GemmType::Fp16 => "fp16",
        GemmType::Tf32 => "tf32",
        GemmType::Fp32 => "fp32",
        GemmType::Fp64 => "fp64",
        GemmType::Fp8 => "fp8",
    }
}

pub fn parse_type(s: &str) -> Result<GemmType, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => GemmType::Bf16,
        "fp16" | "f16" | "half" => GemmType::Fp16,
        "tf32" => GemmType::Tf32,
        "fp32" | "f32" | "float" => GemmType::Fp32,
        "fp64" | "f64" | "double" => GemmType::Fp64,
        "fp8" | "e4m3" | "fp8e4m3" => GemmType::Fp8,
        _ => {
            return Err(format!(
                "unknown GEMM type {s:?}; one of bf16, fp16, tf32, fp32, fp64, fp8"
            ))
        }
    })
}

/// Floating-point operations of one product.
pub fn flops(m: usize, n: usize, k: usize) -> f64 {
    2.0 * m as f64 * n as f64 * k as f64
}

/// TFLOPS for `products` products of (m, n, k) in `ms` milliseconds.
pub fn tflops(dims: (usize, usize, usize), products: usize, ms: f64) -> f64 {
    flops(dims.0, dims.1, dims.2) * products as f64 / (ms * 1e-3) / 1e12
}

/// How many products make one repetition of about REPETITION_MS, given
/// one took `one_ms`.
pub fn products_per_repetition(one_ms: f64) -> usize {
    if one_ms.is_nan() || one_ms <= 0.0 {
        return 1;
    }
    ((REPETITION_MS / one_ms).ceil() as usize).clamp(1, 1000)
}

pub fn validate(req: &GemmRequest, device_count: usize) -> Result<(), BenchError> {
    crate::copy::check_gpus(&req.gpus, device_count)?;
    for (flag, v) in [("--m", req.m), ("--n", req.n), ("--k", req.k)] {
        if v == 0 || v > i32::MAX as usize {
            return Err(BenchError::Invalid(format!(
                "{flag} {v} must be between 1 and {}",
                i32::MAX
            )));
        }
    }
    if req.dtype == GemmType::Fp8
        && (!req.m.is_multiple_of(16) || !req.n.is_multiple_of(16) || !req.k.is_multiple_of(16))
    {
        return Err(BenchError::Invalid(format!(
            "fp8 needs --m, --n and --k to be multiples of 16 (got {} {} {})",
            req.m, req.n, req.k
        )));
    }
    if req.duration.is_none() && req.iters == 0 {
        return Err(BenchError::Invalid("--iters must be at least 1".into()));
    }
    if req.duration.is_some_and(|d| d.is_zero()) {
        return Err(BenchError::Invalid("--duration must be positive".into()));
    }
    Ok(())
}

/// Runs the GEMM benchmark on every selected GPU at once.
pub fn run(
    cuda: &Cuda,
    req: &GemmRequest,
    clock: &dyn Monotonic,
) -> Result<GemmReport, BenchError> {
    validate(req, cuda.device_count())?;
    let blas = keel_cuda::BlasLibrary::load(cuda)?;
    let results: Vec<Result<GpuGemm, BenchError>> = std::thread::scope(|s| {
        let handles: Vec<_> = req
            .gpus
            .iter()
            .map(|&g| {
                let blas = &blas;
                (g, s.spawn(move || one_gpu(cuda, blas, req, g, clock)))
            })
            .collect();
        handles
            .into_iter()
            .map(|(g, h)| h.join().unwrap_or(Err(BenchError::Panicked { gpu: g })))
            .collect()
    });
    let gpus = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(GemmReport {
        dtype: type_name(req.dtype),
        m: req.m,
        n: req.n,
        k: req.k,
        gpus,
    })
}

fn one_gpu(
    cuda: &Cuda,
    blas: &keel_cuda::BlasLibrary,
    req: &GemmRequest,
    g: usize,
    clock: &dyn Monotonic,
) -> Result<GpuGemm, BenchError> {
    let t = req.dtype;
    let dev = cuda.device(g)?;
    let info = dev.info().clone();
    let stream = dev.stream()?;
    let handle = blas.handle(&dev, &stream)?;
    let seed = 0x6765_6d6d ^ ((g as u64) << 32);

    // 1. The small product against float64 on the CPU.
    let (cm, cn, ck) = CHECK_DIMS;
    let (a_bytes, a_vals) = data::gemm_input(t, ck * cm, seed ^ 1, true);
    let (b_bytes, b_vals) = data::gemm_input(t, ck * cn, seed ^ 2, true);
    let (a, b, c) = (
        dev.alloc(a_bytes.len())?,
        dev.alloc(b_bytes.len())?,
        dev.alloc(cm * cn * t.output_bytes())?,
    );
    stream.upload(&a, 0, &a_bytes)?;
    stream.upload(&b, 0, &b_bytes)?;
    stream.upload(&c, 0, &vec![0xff; c.len()])?;
    handle.gemm(t, (cm, cn, ck), &a, &b, &c)?;
    let mut out = vec![0u8; c.len()];
    stream.download(&c, 0, &mut out)?;
    let got: Vec<f64> = out
        .chunks_exact(t.output_bytes())
        .map(|e| data::gemm_output(t, e))
        .collect();
    let want = data::reference_gemm(&a_vals, &b_vals, CHECK_DIMS);
    let rel = data::relative_error(&got, &want);
    let tol = data::gemm_tolerance(t);
    let check = SmallCheck {
        m: cm,
        n: cn,
        k: ck,
        relative_error: rel,
        tolerance: tol,
        passed: rel <= tol,
    };
    drop((a, b, c));

    // 2. The large product.
    let dims = (req.m, req.n, req.k);
    let (a_bytes, _) = data::gemm_input(t, req.k * req.m, seed ^ 3, false);
    let (b_bytes, _) = data::gemm_input(t, req.k * req.n, seed ^ 4, false);
    let (a, b, c) = (
        dev.alloc(a_bytes.len())?,
        dev.alloc(b_bytes.len())?,
        dev.alloc(req.m * req.n * t.output_bytes())?,
    );
    stream.upload(&a, 0, &a_bytes)?;
    stream.upload(&b, 0, &b_bytes)?;
    drop((a_bytes, b_bytes));
    stream.upload(&c, 0, &vec![0xff; c.len()])?;
    for _ in 0..req.warmup {
        handle.gemm(t, dims, &a, &b, &c)?;
    }
    stream.synchronize()?;
    let one = crate::copy::time_runs(&dev, &stream, 0, 1, || handle.gemm(t, dims, &a, &b, &c))?;
    let per_rep = products_per_repetition(one[0]);

    let mut first: Option<Vec<u8>> = None;
    let mut current = vec![0u8; c.len()];
    let mut rates = Vec::new();
    let mut mismatched = 0;
    let mut compare = |current: &Vec<u8>| match &first {
        None => first = Some(current.clone()),
        Some(f) => {
            if f != current {
                mismatched += 1;
            }
        }
    };
    let began = clock.now();
    match req.duration {
        None => {
            let events = (0..=req.iters)
                .map(|_| dev.event())
                .collect::<Result<Vec<_>, _>>()?;
            stream.record(&events[0])?;
            for e in &events[1..] {
                for _ in 0..per_rep {
                    handle.gemm(t, dims, &a, &b, &c)?;
                }
                stream.record(e)?;
            }
            for w in events.windows(2) {
                rates.push(tflops(dims, per_rep, w[0].elapsed_ms(&w[1])? as f64));
            }
            stream.download(&c, 0, &mut current)?;
            compare(&current);
            for _ in 0..req.iters {
                handle.gemm(t, dims, &a, &b, &c)?;
                stream.download(&c, 0, &mut current)?;
                compare(&current);
            }
        }
        Some(d) => {
            let (start, end) = (dev.event()?, dev.event()?);
            loop {
                stream.record(&start)?;
                for _ in 0..per_rep {
                    handle.gemm(t, dims, &a, &b, &c)?;
                }
                stream.record(&end)?;
                let ms = start.elapsed_ms(&end)? as f64;
                rates.push(tflops(dims, per_rep, ms));
                stream.download(&c, 0, &mut current)?;
                compare(&current);
                if clock.now().duration_since(began) >= d {
                    break;
                }
            }
        }
    }
    let seconds = clock.now().duration_since(began).as_secs_f64();
    // The output of a product on random inputs is not all NaN (poison left
    // unwritten) -- part of "correct" too.
    let written = first.as_ref().is_some_and(|f| {
        f.chunks_exact(t.output_bytes())
            .all(|e| data::gemm_output(t, e).is_finite())
    });
    let tflops = Summary::of(&rates)
        .ok_or_else(|| BenchError::Invalid("a GEMM repetition took no measurable time".into()))?;
    let peak = peaks::for_name(&info.name).and_then(|p| p.tflops(t));
    Ok(GpuGemm {
        gpu: g,
        name: info.name,
        pci_bus_id: info.pci_bus_id,
        cublas_version: handle.version(),
        peak_tflops: peak,
        fraction_of_peak: peak.map(|p| tflops.median / p),
        tflops,
        repetitions: rates.len(),
        products_per_repetition: per_rep,
        mismatched_repetitions: mismatched,
        passed: check.passed && mismatched == 0 && written,
        check,
        seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> GemmRequest {
        GemmRequest {
            gpus: vec![0],
            dtype: GemmType::Bf16,
            m: 8192,
            n: 8192,
            k: 8192,
            iters: 10,
            warmup: 5,
            duration: None,
        }
    }

    #[test]
    fn arithmetic() {
        assert_eq!(flops(8192, 8192, 8192), 2.0 * 8192f64.powi(3));
        // 8192^3 bf16 in 1.4 ms: about 785 TFLOPS.
        let t = tflops((8192, 8192, 8192), 1, 1.4);
        assert!((t - 785.36).abs() < 0.01, "{t}");
        assert_eq!(tflops((1000, 1000, 1000), 10, 20.0), 1.0);
        assert_eq!(products_per_repetition(1.4), 18);
        assert_eq!(products_per_repetition(100.0), 1);
        assert_eq!(products_per_repetition(0.001), 1000);
        assert_eq!(products_per_repetition(0.0), 1);
    }

    #[test]
    fn types_parse() {
        for (s, t) in [
            ("bf16", GemmType::Bf16),
            ("FP16", GemmType::Fp16),
            ("tf32", GemmType::Tf32),
            ("fp32", GemmType::Fp32),
            ("fp64", GemmType::Fp64),
            ("fp8", GemmType::Fp8),
        ] {
            assert_eq!(parse_type(s), Ok(t));
            assert_eq!(parse_type(type_name(t)), Ok(t));
        }
        assert!(parse_type("int8").expect_err("no").contains("one of bf16"));
    }

    #[test]
    fn requests_are_checked() {
        assert!(validate(&req(), 1).is_ok());
        for (r, needle) in [
            (GemmRequest { m: 0, ..req() }, "--m 0 must be between 1"),
            (
                GemmRequest {
                    k: 1 << 40,
                    ..req()
                },
                "--k 1099511627776",
            ),
            (
                GemmRequest {
                    dtype: GemmType::Fp8,
                    n: 100,
                    ..req()
                },
                "multiples of 16",
            ),
            (GemmRequest { iters: 0, ..req() }, "--iters"),
            (
                GemmRequest {
                    duration: Some(Duration::ZERO),
                    ..req()
                },
                "--duration",
            ),
            (
                GemmRequest {
                    gpus: vec![1],
                    ..req()
                },
                "GPU 1 does not exist",
            ),
        ] {
            let e = validate(&r, 1).expect_err(needle);
            assert!(e.to_string().contains(needle), "{e}");
        }
        // Duration mode needs no iteration count.
        assert!(validate(
            &GemmRequest {
                iters: 0,
                duration: Some(Duration::from_secs(1)),
                ..req()
            },
            1
        )
        .is_ok());
    }

    #[test]
    fn the_cpu_reference_is_what_the_gpu_must_match() {
        // The check's reference on its own inputs: a bf16 rounding of the
        // exact product stays within the bf16 tolerance, a transposed
        // product does not.
        let (m, n, k) = (32, 16, 64);
        let (_, a) = data::gemm_input(GemmType::Bf16, k * m, 1, true);
        let (_, b) = data::gemm_input(GemmType::Bf16, k * n, 2, true);
        let want = data::reference_gemm(&a, &b, (m, n, k));
        let rounded: Vec<f64> = want
            .iter()
            .map(|v| half::bf16::from_f64(*v).to_f64())
            .collect();
        assert!(data::relative_error(&rounded, &want) < data::gemm_tolerance(GemmType::Bf16));
        let wrong = data::reference_gemm(&b[..k * n], &a[..k * m], (n, m, k));
        assert!(data::relative_error(&wrong, &want) > 0.5);
    }
}
