//! keel-cuda on a real GPU. Ignored by default (`scripts/test` skips test
//! binaries named `gpu`); on a GPU machine:
//! `cargo nextest run --run-ignored all -E 'binary(=gpu)'`.

use keel_cuda::{BlasLibrary, Cuda, GemmType, NcclLibrary, NcclOp, NcclType, SearchEnv, Span};

fn cuda() -> Cuda {
    let search = SearchEnv::from_env(&|k: &str| std::env::var_os(k), None);
    Cuda::open(&search).expect("a CUDA driver and GPU")
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn driver_devices_and_copies_round_trip() {
    let cuda = cuda();
    assert!(cuda.driver_version() >= keel_cuda::MIN_DRIVER_VERSION);
    let dev = cuda.device(0).expect("GPU 0");
    let info = dev.info();
    assert!(!info.name.is_empty());
    assert_eq!(
        info.pci_bus_id.matches(':').count(),
        2,
        "{}",
        info.pci_bus_id
    );
    assert!(info.memory_bytes > 1 << 30);
    let s = dev.stream().expect("stream");
    let n = 64 << 20;
    let mut host = dev.alloc_host(n).expect("pinned");
    for (i, b) in host.as_mut_slice().expect("host").iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let (a, b) = (dev.alloc(n).expect("a"), dev.alloc(n).expect("b"));
    s.copy_h2d(&a, &host, n).expect("h2d");
    s.copy_d2d(&b, &a, n).expect("d2d");
    let want = host.as_slice().expect("host").to_vec();
    host.as_mut_slice().expect("host").fill(0);
    s.copy_d2h(&mut host, &b, n).expect("d2h");
    assert!(host.as_slice().expect("host") == want.as_slice());
    // Out-of-range copies are refused before the GPU sees them.
    let small = dev.alloc(16).expect("small");
    assert!(s.copy_d2d(&small, &a, 17).is_err());
    let (e0, e1) = (dev.event().expect("e"), dev.event().expect("e"));
    s.record(&e0).expect("record");
    s.copy_d2d(&b, &a, n).expect("d2d");
    s.record(&e1).expect("record");
    assert!(e0.elapsed_ms(&e1).expect("elapsed") > 0.0);
    assert!(matches!(
        cuda.device(cuda.device_count()),
        Err(keel_cuda::CudaError::NoSuchDevice { .. })
    ));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cublas_multiplies() {
    let cuda = cuda();
    let blas = BlasLibrary::load(&cuda).expect("cuBLAS");
    let dev = cuda.device(0).expect("GPU 0");
    let s = dev.stream().expect("stream");
    let h = blas.handle(&dev, &s).expect("handle");
    assert!(h.version() > 11000, "{}", h.version());
    // c = a^T b with a^T = [[1,2],[3,4]] (k=2 rows, m=2 columns,
    // column-major: a = [1,3,2,4]) and b = [[5],[6]]: c = [1*5+3*6, 2*5+4*6].
    let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (a, b, c) = (
        dev.alloc(16).expect("a"),
        dev.alloc(8).expect("b"),
        dev.alloc(8).expect("c"),
    );
    s.upload(&a, 0, &f(&[1.0, 3.0, 2.0, 4.0])).expect("up");
    s.upload(&b, 0, &f(&[5.0, 6.0])).expect("up");
    h.gemm(GemmType::Fp32, (2, 1, 2), &a, &b, &c).expect("gemm");
    let mut out = [0u8; 8];
    s.download(&c, 0, &mut out).expect("down");
    let got = [
        f32::from_le_bytes([out[0], out[1], out[2], out[3]]),
        f32::from_le_bytes([out[4], out[5], out[6], out[7]]),
    ];
    assert_eq!(got, [23.0, 34.0]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nccl_all_reduce_on_every_local_gpu() {
    let cuda = cuda();
    let nccl = NcclLibrary::load(&cuda).expect("NCCL");
    assert!(nccl.version() > 21000, "{}", nccl.version());
    let devs: Vec<_> = (0..cuda.device_count())
        .map(|g| cuda.device(g).expect("GPU"))
        .collect();
    let comms = nccl.init_all(&devs).expect("communicators");
    let n = devs.len() as f32;
    let bufs: Vec<_> = devs
        .iter()
        .map(|d| {
            let s = d.stream().expect("stream");
            let buf = d.alloc(4 * 1024).expect("buf");
            let data: Vec<u8> = (0..1024).flat_map(|i| (i as f32).to_le_bytes()).collect();
            s.upload(&buf, 0, &data).expect("up");
            (s, buf)
        })
        .collect();
    nccl.group(|| {
        for (c, (s, b)) in comms.iter().zip(&bufs) {
            c.all_reduce(
                Span::new(b, 0, 1024),
                Span::new(b, 0, 1024),
                NcclType::Float32,
                NcclOp::Sum,
                s,
            )?;
        }
        Ok(())
    })
    .expect("all-reduce");
    for (s, b) in &bufs {
        let mut out = vec![0u8; 4 * 1024];
        s.download(b, 0, &mut out).expect("down");
        let v = f32::from_le_bytes([out[40], out[41], out[42], out[43]]);
        assert_eq!(v, 10.0 * n);
    }
}
