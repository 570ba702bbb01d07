//! Datasheet peaks per GPU model: dense (no sparsity) matrix throughput
//! per data type, HBM bandwidth. The GEMM benchmark reports its TFLOPS as
//! a fraction of these; an unknown model has no fraction (`null`), never
//! a guess.

use keel_cuda::GemmType;
use serde::Serialize;

/// Dense peaks of one GPU model, TFLOPS (tensor cores where the type has
/// them; fp32 is the non-tensor rate) and GB/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Peaks {
    pub model: &'static str,
    pub bf16: f64,
    pub fp16: f64,
    pub tf32: f64,
    pub fp32: f64,
    pub fp64: f64,
    pub fp8: Option<f64>,
    pub hbm_gbs: Option<f64>,
}

impl Peaks {
    pub fn tflops(&self, t: GemmType) -> Option<f64> {
        match t {
            GemmType::Bf16 => Some(self.bf16),
            GemmType::Fp16 => Some(self.fp16),
            GemmType::Tf32 => Some(self.tf32),
            GemmType::Fp32 => Some(self.fp32),
            GemmType::Fp64 => Some(self.fp64),
            GemmType::Fp8 => self.fp8,
        }
    }
}

const H100_SXM: Peaks = Peaks {
    model: "H100 SXM5",
    bf16: 989.4,
    fp16: 989.4,
    tf32: 494.7,
    fp32: 66.9,
    fp64: 66.9,
    fp8: Some(1978.9),
    hbm_gbs: Some(3350.0),
};

/// (substring of the driver's name, peaks), most specific first.
const TABLE: &[(&str, Peaks)] = &[
    (
        "H200 NVL",
        Peaks {
            model: "H200 NVL",
            bf16: 835.5,
            fp16: 835.5,
            tf32: 417.5,
            fp32: 60.0,
            fp64: 60.0,
            fp8: Some(1670.5),
            hbm_gbs: Some(4800.0),
        },
    ),
    (
        "H200",
        Peaks {
            model: "H200 SXM",
            hbm_gbs: Some(4800.0),
            ..H100_SXM
        },
    ),
    (
        "H100 NVL",
        Peaks {
            model: "H100 NVL",
            bf16: 835.5,
            fp16: 835.5,
            tf32: 417.5,
            fp32: 60.0,
            fp64: 60.0,
            fp8: Some(1670.5),
            hbm_gbs: Some(3900.0),
        },
    ),
    (
        "H100 PCIe",
        Peaks {
            model: "H100 PCIe",
            bf16: 756.5,
            fp16: 756.5,
            tf32: 378.0,
            fp32: 51.2,
            fp64: 51.2,
            fp8: Some(1513.0),
            hbm_gbs: Some(2000.0),
        },
    ),
    ("H100 80GB HBM3", H100_SXM),
    ("H100 SXM", H100_SXM),
    (
        "A100-SXM4-80GB",
        Peaks {
            model: "A100 SXM4 80GB",
            bf16: 312.0,
            fp16: 312.0,
            tf32: 156.0,
            fp32: 19.5,
            fp64: 19.5,
            fp8: None,
            hbm_gbs: Some(2039.0),
        },
    ),
    (
        "A100-SXM4-40GB",
        Peaks {
            model: "A100 SXM4 40GB",
            bf16: 312.0,
            fp16: 312.0,
            tf32: 156.0,
            fp32: 19.5,
            fp64: 19.5,
            fp8: None,
            hbm_gbs: Some(1555.0),
        },
    ),
    (
        "A100 80GB PCIe",
        Peaks {
            model: "A100 PCIe 80GB",
            bf16: 312.0,
            fp16: 312.0,
            tf32: 156.0,
            fp32: 19.5,
            fp64: 19.5,
            fp8: None,
            hbm_gbs: Some(1935.0),
        },
    ),
    (
        "A100-PCIE-40GB",
        Peaks {
            model: "A100 PCIe 40GB",
            bf16: 312.0,
            fp16: 312.0,
            tf32: 156.0,
            fp32: 19.5,
            fp64: 19.5,
            fp8: None,
            hbm_gbs: Some(1555.0),
        },
    ),
];

/// The peaks for a GPU by the name the driver gives it (`NVIDIA H100 80GB
/// HBM3`, `NVIDIA H200`, `NVIDIA A100-SXM4-40GB`).
pub fn for_name(name: &str) -> Option<&'static Peaks> {
    TABLE
        .iter()
        .find(|(needle, _)| name.contains(needle))
        .map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_by_driver_name() {
        for (name, model, bf16) in [
            ("NVIDIA H100 80GB HBM3", "H100 SXM5", Some(989.4)),
            ("NVIDIA H200", "H200 SXM", Some(989.4)),
            ("NVIDIA H200 NVL", "H200 NVL", Some(835.5)),
            ("NVIDIA H100 NVL", "H100 NVL", Some(835.5)),
            ("NVIDIA H100 PCIe", "H100 PCIe", Some(756.5)),
            ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB", Some(312.0)),
            ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB", Some(312.0)),
            ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", Some(312.0)),
        ] {
            let p = for_name(name).expect(name);
            assert_eq!(p.model, model);
            assert_eq!(p.tflops(GemmType::Bf16), bf16);
        }
        assert_eq!(for_name("NVIDIA GeForce RTX 4090"), None);
        assert_eq!(
            for_name("NVIDIA A100-SXM4-40GB").and_then(|p| p.tflops(GemmType::Fp8)),
            None
        );
        assert_eq!(
            for_name("NVIDIA H200").and_then(|p| p.tflops(GemmType::Fp8)),
            Some(1978.9)
        );
    }
}
