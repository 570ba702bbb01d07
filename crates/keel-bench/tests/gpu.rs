//! keel-bench's procedures on a real GPU. Ignored by default
//! (`scripts/test` skips test binaries named `gpu`); on a GPU machine:
//! `cargo nextest run --run-ignored all -E 'binary(=gpu)'`.

use std::time::Duration;

use keel_bench::collective::Collective;
use keel_bench::copy::CopyRequest;
use keel_bench::gemm::GemmRequest;
use keel_bench::nccl::{Average, Identity, NcclRequest, Ranks};
use keel_bench::sweep::Sweep;
use keel_bench::SystemClock;
use keel_cuda::{Cuda, GemmType, NcclOp, NcclType, SearchEnv};

fn cuda() -> Cuda {
    let search = SearchEnv::from_env(&|k: &str| std::env::var_os(k), None);
    Cuda::open(&search).expect("a CUDA driver and GPU")
}

fn machine() -> Option<keel_topo::Machine> {
    keel_topo::read_machine(&keel_topo::Root::new("/")).ok()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn copies_measure_plausible_bandwidth() {
    let cuda = cuda();
    let gpus: Vec<usize> = (0..cuda.device_count().min(2)).collect();
    let m = machine();
    let r = keel_bench::copy::run(
        &cuda,
        m.as_ref(),
        &CopyRequest {
            gpus: gpus.clone(),
            bytes: 64 << 20,
            iters: 5,
            warmup: 2,
            peer: true,
        },
    )
    .expect("copy benchmark");
    assert_eq!(r.gpus.len(), gpus.len());
    for g in &r.gpus {
        // PCIe Gen3 x16 and up; HBM well above PCIe.
        assert!(g.h2d_gbs.median > 5.0, "{g:?}");
        assert!(g.d2h_gbs.median > 5.0, "{g:?}");
        assert!(g.d2d_gbs.median > 100.0, "{g:?}");
    }
    assert_eq!(r.peer.len(), gpus.len() * (gpus.len() - 1));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_is_correct_and_consistent_for_every_type() {
    let cuda = cuda();
    let (major, minor) = cuda.device(0).expect("GPU 0").info().compute_capability;
    let mut types = vec![
        GemmType::Bf16,
        GemmType::Fp16,
        GemmType::Tf32,
        GemmType::Fp32,
        GemmType::Fp64,
    ];
    if (major, minor) >= (8, 9) {
        types.push(GemmType::Fp8);
    }
    for t in types {
        let r = keel_bench::gemm::run(
            &cuda,
            &GemmRequest {
                gpus: vec![0],
                dtype: t,
                m: 2048,
                n: 1024,
                k: 4096,
                iters: 3,
                warmup: 2,
                duration: None,
            },
            &SystemClock,
        )
        .expect("gemm");
        let g = &r.gpus[0];
        assert!(g.check.passed, "{t:?}: {:?}", g.check);
        assert_eq!(g.mismatched_repetitions, 0, "{t:?}");
        assert!(g.passed && g.tflops.median > 1.0, "{t:?}: {g:?}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_burn_runs_for_its_duration() {
    let cuda = cuda();
    let r = keel_bench::gemm::run(
        &cuda,
        &GemmRequest {
            gpus: vec![0],
            dtype: GemmType::Bf16,
            m: 4096,
            n: 4096,
            k: 4096,
            iters: 0,
            warmup: 2,
            duration: Some(Duration::from_secs(2)),
        },
        &SystemClock,
    )
    .expect("burn");
    assert!(r.gpus[0].seconds >= 2.0 && r.gpus[0].passed);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_collective_checks_clean_on_local_gpus() {
    let cuda = cuda();
    let gpus: Vec<usize> = (0..cuda.device_count()).collect();
    for c in Collective::ALL {
        for (dtype, op) in [
            (NcclType::Float32, NcclOp::Sum),
            (NcclType::Bfloat16, NcclOp::Sum),
            (NcclType::Float16, NcclOp::Prod),
            (NcclType::Int32, NcclOp::Max),
            (NcclType::Float64, NcclOp::Avg),
        ] {
            let req = NcclRequest {
                collective: c,
                sweep: Sweep {
                    min_bytes: 8,
                    max_bytes: 1 << 20,
                    factor: 16,
                    step_bytes: 0,
                },
                iters: 3,
                warmup: 1,
                check: true,
                op,
                dtype,
                root: 0,
                average: Average::Mean,
                min_busbw: None,
            };
            let r = keel_bench::nccl::run(
                &cuda,
                &req,
                &Ranks::Local { gpus: gpus.clone() },
                &Identity {
                    host: "test".into(),
                    pid: 1,
                },
                &SystemClock,
            )
            .expect("nccl");
            assert_eq!(r.out_of_bounds, 0, "{c:?} {dtype:?} {op:?}");
            // 8 B to 1 MiB by 16: 8, 128, 2048, 32768, 524288.
            assert_eq!(r.rows.len(), 5);
        }
    }
}
