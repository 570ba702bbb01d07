//! Copy bandwidth: host-to-device and device-to-host with pinned host
//! memory on the GPU's own NUMA node, device-to-device inside one GPU
//! (HBM), and GPU-to-GPU peer copies.
//!
//! Each GPU is measured in turn on a thread of its own, pinned to the CPUs
//! of the GPU's NUMA node before it allocates anything: the pinned host
//! buffer is then first touched (zero-filled, then filled with data) by a
//! thread on that node and lives there. Every copy is one copy-engine
//! transfer of the whole buffer, timed with CUDA events around it; warm-up
//! runs are discarded; the result is the median and spread of the rest.
//!
//! Bandwidth is bytes / time with 1 GB = 1e9 bytes. Host-to-device,
//! device-to-host and peer copies count the buffer once. Device-to-device
//! counts it twice (read and write), as CUDA's bandwidthTest and
//! nvbandwidth do, so it compares with the HBM figure.

use keel_cuda::{Cuda, Device, DeviceBuffer, Stream};
use keel_topo::Machine;
use serde::Serialize;

use crate::affinity::{self, Placement};
use crate::data::Rng;
use crate::stats::Summary;
use crate::BenchError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyRequest {
    /// CUDA device ordinals to measure.
    pub gpus: Vec<usize>,
    /// Bytes per copy.
    pub bytes: usize,
    /// Timed runs per measurement.
    pub iters: usize,
    /// Discarded runs before them.
    pub warmup: usize,
    /// Also measure every ordered pair of GPUs.
    pub peer: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct CopyReport {
    pub bytes: usize,
    pub iters: usize,
    pub warmup: usize,
    pub gpus: Vec<GpuCopy>,
    pub peer: Vec<PeerCopy>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuCopy {
    pub gpu: usize,
    pub name: String,
    pub pci_bus_id: String,
    /// The GPU's NUMA node, when sysfs gives it.
    pub numa_node: Option<u32>,
    /// The CPUs the measuring thread was pinned to (cpulist).
    pub cpus: Option<String>,
    /// Whether the thread was pinned (false: no placement known, or the
    /// job's cpuset forbids those CPUs; see `note`).
    pub pinned: bool,
    pub note: Option<String>,
    /// GB/s.
    pub h2d_gbs: Summary,
    pub d2h_gbs: Summary,
    /// GB/s counting bytes read plus bytes written.
    pub d2d_gbs: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeerCopy {
    pub src: usize,
    pub dst: usize,
    /// Whether the GPUs can access each other directly (NVLink or PCIe
    /// P2P); without it the driver stages through host memory.
    pub p2p: bool,
    pub gbs: Summary,
}

/// GB/s for `bytes` in `ms` milliseconds.
pub fn gbs(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e6)
}

/// Times `op` on `stream` with events, `warmup + iters` times, returning
/// the timed runs' milliseconds.
pub(crate) fn time_runs(
    dev: &Device,
    stream: &Stream,
    warmup: usize,
    iters: usize,
    mut op: impl FnMut() -> Result<(), keel_cuda::CudaError>,
) -> Result<Vec<f64>, BenchError> {
    let (start, end) = (dev.event()?, dev.event()?);
    let mut out = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        stream.record(&start)?;
        op()?;
        stream.record(&end)?;
        let ms = start.elapsed_ms(&end)? as f64;
        if i >= warmup {
            out.push(ms);
        }
    }
    Ok(out)
}

fn summary(bytes: f64, ms: &[f64]) -> Result<Summary, BenchError> {
    let rates: Vec<f64> = ms.iter().map(|m| gbs(bytes, *m)).collect();
    Summary::of(&rates).ok_or_else(|| BenchError::Invalid("a copy took no measurable time".into()))
}

pub fn validate(req: &CopyRequest, device_count: usize) -> Result<(), BenchError> {
    if req.bytes == 0 {
        return Err(BenchError::Invalid("--size must be at least 1 byte".into()));
    }
    if req.iters == 0 {
        return Err(BenchError::Invalid("--iters must be at least 1".into()));
    }
    check_gpus(&req.gpus, device_count)
}

/// Every ordinal exists and appears once.
pub fn check_gpus(gpus: &[usize], device_count: usize) -> Result<(), BenchError> {
    if gpus.is_empty() {
        return Err(BenchError::Invalid("no GPU selected".into()));
    }
    for (i, g) in gpus.iter().enumerate() {
        if *g >= device_count {
            return Err(BenchError::Invalid(format!(
                "GPU {g} does not exist: the CUDA driver sees {device_count} GPU(s) (0-{})",
                device_count.saturating_sub(1)
            )));
        }
        if gpus[..i].contains(g) {
            return Err(BenchError::Invalid(format!("GPU {g} is listed twice")));
        }
    }
    Ok(())
}

/// Runs the copy benchmark.
pub fn run(
    cuda: &Cuda,
    machine: Option<&Machine>,
    req: &CopyRequest,
) -> Result<CopyReport, BenchError> {
    validate(req, cuda.device_count())?;
    let mut gpus = Vec::new();
    for &g in &req.gpus {
        let result = std::thread::scope(|s| {
            s.spawn(|| one_gpu(cuda, machine, req, g))
                .join()
                .map_err(|_| BenchError::Panicked { gpu: g })
        })??;
        gpus.push(result);
    }
    let peer = if req.peer && req.gpus.len() > 1 {
        peers(cuda, req)?
    } else {
        Vec::new()
    };
    Ok(CopyReport {
        bytes: req.bytes,
        iters: req.iters,
        warmup: req.warmup,
        gpus,
        peer,
    })
}

fn one_gpu(
    cuda: &Cuda,
    machine: Option<&Machine>,
    req: &CopyRequest,
    g: usize,
) -> Result<GpuCopy, BenchError> {
    let dev = cuda.device(g)?;
    let info = dev.info().clone();
    let Placement { numa_node, cpus } = affinity::placement(machine, &info.pci_bus_id);
    let (pinned, note) = match &cpus {
        Some(c) => match affinity::pin_current_thread(c) {
            Ok(()) => (true, None),
            Err(e) => (
                false,
                Some(format!(
                    "{e}: {}",
                    std::error::Error::source(&e)
                        .map(|s| s.to_string())
                        .unwrap_or_default()
                )),
            ),
        },
        None => (
            false,
            Some("the GPU's NUMA node is unknown (sysfs): host memory was not placed".into()),
        ),
    };
    let stream = dev.stream()?;
    // Allocated after pinning: the pages are touched first from here.
    let mut host = dev.alloc_host(req.bytes)?;
    fill_random(host.as_mut_slice()?, g as u64);
    let dbuf = dev.alloc(req.bytes)?;
    let dbuf2 = dev.alloc(req.bytes)?;
    let n = req.bytes;
    let h2d = time_runs(&dev, &stream, req.warmup, req.iters, || {
        stream.copy_h2d(&dbuf, &host, n)
    })?;
    let mut d2h_ms = Vec::with_capacity(req.iters);
    {
        let (start, end) = (dev.event()?, dev.event()?);
        for i in 0..req.warmup + req.iters {
            stream.record(&start)?;
            stream.copy_d2h(&mut host, &dbuf, n)?;
            stream.record(&end)?;
            let ms = start.elapsed_ms(&end)? as f64;
            if i >= req.warmup {
                d2h_ms.push(ms);
            }
        }
    }
    let d2d = time_runs(&dev, &stream, req.warmup, req.iters, || {
        stream.copy_d2d(&dbuf2, &dbuf, n)
    })?;
    Ok(GpuCopy {
        gpu: g,
        name: info.name,
        pci_bus_id: info.pci_bus_id,
        numa_node,
        cpus: cpus.map(|c| c.to_list()),
        pinned,
        note,
        h2d_gbs: summary(n as f64, &h2d)?,
        d2h_gbs: summary(n as f64, &d2h_ms)?,
        d2d_gbs: summary(2.0 * n as f64, &d2d)?,
    })
}

/// Random bytes (never a buffer of zeros).
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut rng = Rng::new(0x6b65_656c ^ seed);
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = rng.next_u64().to_le_bytes();
    let len = rest.len();
    rest.copy_from_slice(&last[..len]);
}

fn peers(cuda: &Cuda, req: &CopyRequest) -> Result<Vec<PeerCopy>, BenchError> {
    let devs: Vec<Device> = req
        .gpus
        .iter()
        .map(|g| cuda.device(*g))
        .collect::<Result<_, _>>()?;
    let mut bufs: Vec<(DeviceBuffer, DeviceBuffer)> = Vec::new();
    for (d, g) in devs.iter().zip(&req.gpus) {
        let src = d.alloc(req.bytes)?;
        let mut data = vec![0u8; req.bytes];
        fill_random(&mut data, 100 + *g as u64);
        d.stream()?.upload(&src, 0, &data)?;
        bufs.push((src, d.alloc(req.bytes)?));
    }
    let mut out = Vec::new();
    for (i, a) in devs.iter().enumerate() {
        let stream = a.stream()?;
        for (j, b) in devs.iter().enumerate() {
            if i == j {
                continue;
            }
            let p2p = a.can_access_peer(b)? && b.can_access_peer(a)?;
            if p2p {
                a.enable_peer_access(b)?;
                b.enable_peer_access(a)?;
            }
            let src = &bufs[i].0;
            let dst = &bufs[j].1;
            let ms = time_runs(a, &stream, req.warmup, req.iters, || {
                stream.copy_peer(dst, src, req.bytes)
            })?;
            out.push(PeerCopy {
                src: req.gpus[i],
                dst: req.gpus[j],
                p2p,
                gbs: summary(req.bytes as f64, &ms)?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked() {
        let ok = CopyRequest {
            gpus: vec![0, 1],
            bytes: 1 << 20,
            iters: 5,
            warmup: 1,
            peer: true,
        };
        assert!(validate(&ok, 2).is_ok());
        for (req, n, needle) in [
            (
                CopyRequest {
                    bytes: 0,
                    ..ok.clone()
                },
                2,
                "--size",
            ),
            (
                CopyRequest {
                    iters: 0,
                    ..ok.clone()
                },
                2,
                "--iters",
            ),
            (
                CopyRequest {
                    gpus: vec![2],
                    ..ok.clone()
                },
                2,
                "GPU 2 does not exist: the CUDA driver sees 2 GPU(s) (0-1)",
            ),
            (
                CopyRequest {
                    gpus: vec![0, 0],
                    ..ok.clone()
                },
                2,
                "listed twice",
            ),
            (
                CopyRequest {
                    gpus: vec![],
                    ..ok.clone()
                },
                2,
                "no GPU",
            ),
        ] {
            let e = validate(&req, n).expect_err(needle);
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn random_fill_and_rates() {
        let mut b = vec![0u8; 1001];
        fill_random(&mut b, 1);
        assert!(b.iter().filter(|x| **x == 0).count() < 20);
        assert_eq!(gbs(1e9, 1000.0), 1.0);
        assert_eq!(gbs(256.0 * 1048576.0, 5.0), 53.687_091_2);
    }
}
