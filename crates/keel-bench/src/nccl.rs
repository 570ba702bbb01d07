//! NCCL collective benchmarks with nccl-tests' semantics: the same size
//! sweep, counts, timing (host time around `iters` back-to-back launches
//! after `warmup`, divided by `iters`), bandwidth formulas, data check and
//! table.
//!
//! Two ways to run: one process driving several local GPUs
//! ([`Ranks::Local`], `ncclCommInitAll`, every launch inside one NCCL
//! group), or one rank per process ([`Ranks::Launched`], under `srun`):
//! rank 0 makes the NCCL id and hands it out over TCP
//! ([`crate::rendezvous`]), every rank joins with `ncclCommInitRank`, and
//! times and wrong-element counts are combined across ranks with NCCL
//! itself (`-a`: rank 0's, mean, min or max time), so no MPI is needed.

use std::time::Duration;

use keel_cuda::{Comm, Cuda, Device, DeviceBuffer, NcclLibrary, NcclOp, NcclType, Span, Stream};
use serde::Serialize;

use crate::collective::{Collective, Counts};
use crate::data::{self, Pattern, Periodic};
use crate::launch::{self, Launch};
use crate::rendezvous;
use crate::sweep::Sweep;
use crate::{BenchError, Monotonic};

/// How per-rank times become the one reported (`-a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Average {
    Rank0,
    Mean,
    Min,
    Max,
}

impl Average {
    /// nccl-tests' `-a` numbers: 0 rank 0, 1 mean, 2 min, 3 max.
    pub fn from_flag(v: u8) -> Result<Average, String> {
        match v {
            0 => Ok(Average::Rank0),
            1 => Ok(Average::Mean),
            2 => Ok(Average::Min),
            3 => Ok(Average::Max),
            _ => Err(format!("-a {v}: 0 (rank 0), 1 (mean), 2 (min) or 3 (max)")),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NcclRequest {
    pub collective: Collective,
    pub sweep: Sweep,
    pub iters: usize,
    pub warmup: usize,
    /// Check every result element (`-c 1`).
    pub check: bool,
    pub op: NcclOp,
    pub dtype: NcclType,
    pub root: usize,
    pub average: Average,
    /// Pass/fail threshold on the average bus bandwidth, GB/s.
    pub min_busbw: Option<f64>,
}

/// Who takes part.
#[derive(Debug, Clone, PartialEq)]
pub enum Ranks {
    /// This process drives these local GPUs, one rank each.
    Local { gpus: Vec<usize> },
    /// This process is one rank of a launched job.
    Launched {
        launch: Launch,
        /// `HOST:PORT` where rank 0 listens.
        rendezvous: String,
        timeout: Duration,
    },
}

/// What the header says about this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub host: String,
    pub pid: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct NcclReport {
    pub collective: Collective,
    pub nccl_tests_binary: &'static str,
    #[serde(rename = "type")]
    pub dtype: &'static str,
    pub redop: &'static str,
    pub root: i64,
    /// Ranks in the communicator.
    pub ranks: usize,
    /// GPUs driven by this process.
    pub local_gpus: usize,
    /// Whether this process holds rank 0 (only it prints).
    pub is_rank0: bool,
    pub sweep: Sweep,
    pub iters: usize,
    pub warmup: usize,
    pub check: bool,
    pub average: Average,
    pub nccl_version: String,
    pub nccl_library: String,
    pub host: String,
    pub pid: u32,
    pub devices: Vec<RankDevice>,
    pub rows: Vec<Row>,
    /// Wrong elements over all sizes, placements and ranks.
    pub out_of_bounds: u64,
    /// Mean bus bandwidth over every row, out-of-place and in-place, GB/s.
    pub avg_busbw: f64,
    pub min_busbw: Option<f64>,
    /// `min_busbw` met (and no wrong element); `None` without a threshold.
    pub passed: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RankDevice {
    pub rank: usize,
    pub ordinal: usize,
    pub pci_bus_id: String,
    /// `0x07`: the bus number, as nccl-tests prints it.
    pub bus: String,
    pub name: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The size column: bytes of the larger of the send and receive arrays.
    pub bytes: u64,
    /// Elements per rank passed to NCCL.
    pub count: u64,
    #[serde(rename = "type")]
    pub dtype: &'static str,
    pub redop: &'static str,
    pub root: i64,
    pub out_of_place: Placement,
    pub in_place: Placement,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Placement {
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    /// Wrong elements; `None` when not checked.
    pub wrong: Option<u64>,
}

/// The redop column.
pub fn redop_name(c: Collective, op: NcclOp) -> &'static str {
    if c.reduces() {
        data::nccl_op_name(op)
    } else {
        "none"
    }
}

/// The root column: the root for broadcast and reduce, else -1.
pub fn root_column(c: Collective, root: usize) -> i64 {
    if c.rooted() {
        root as i64
    } else {
        -1
    }
}

pub fn validate(req: &NcclRequest, ranks: usize) -> Result<Vec<u64>, BenchError> {
    let sizes = req.sweep.sizes().map_err(BenchError::Invalid)?;
    if req.iters == 0 {
        return Err(BenchError::Invalid("-n must be at least 1".into()));
    }
    if req.collective.rooted() && req.root >= ranks {
        return Err(BenchError::Invalid(format!(
            "-r {} is not a rank: there are {ranks}",
            req.root
        )));
    }
    if req.collective.reduces() && req.op == NcclOp::Avg && !data::is_float(req.dtype) {
        return Err(BenchError::Invalid(format!(
            "-o avg needs a floating-point -d, not {}",
            data::nccl_type_name(req.dtype)
        )));
    }
    if req
        .min_busbw
        .is_some_and(|m| m.is_nan() || m < 0.0 || !m.is_finite())
    {
        return Err(BenchError::Invalid(
            "--min-busbw must be a number of GB/s".into(),
        ));
    }
    Ok(sizes)
}

struct Part {
    rank: usize,
    dev: Device,
    comm: Comm,
    stream: Stream,
    send: DeviceBuffer,
    recv: DeviceBuffer,
}

/// Runs the benchmark.
pub fn run(
    cuda: &Cuda,
    req: &NcclRequest,
    ranks: &Ranks,
    ident: &Identity,
    clock: &dyn Monotonic,
) -> Result<NcclReport, BenchError> {
    let world = match ranks {
        Ranks::Local { gpus } => {
            crate::copy::check_gpus(gpus, cuda.device_count())?;
            gpus.len()
        }
        Ranks::Launched { launch, .. } => launch.world,
    };
    let sizes = validate(req, world)?;
    let max = sizes.iter().copied().max().unwrap_or(0) as usize;
    let nccl = NcclLibrary::load(cuda)?;
    let mut parts = Vec::new();
    match ranks {
        Ranks::Local { gpus } => {
            let devs: Vec<Device> = gpus
                .iter()
                .map(|g| cuda.device(*g))
                .collect::<Result<_, _>>()?;
            let comms = nccl.init_all(&devs)?;
            for (rank, (dev, comm)) in devs.into_iter().zip(comms).enumerate() {
                parts.push(part(rank, dev, comm, max)?);
            }
        }
        Ranks::Launched {
            launch,
            rendezvous: endpoint,
            timeout,
        } => {
            let ordinal = launch::rank_device(launch.local_rank, cuda.device_count())?;
            let dev = cuda.device(ordinal)?;
            let id = if launch.rank == 0 {
                let id = nccl.unique_id()?;
                let listener = rendezvous::bind(endpoint)?;
                rendezvous::serve(&listener, launch.world, &id, *timeout, clock)?;
                id
            } else {
                rendezvous::join(endpoint, launch.rank, launch.world, *timeout, clock)?
            };
            let comm = nccl.init_rank(&dev, launch.world, &id, launch.rank)?;
            parts.push(part(launch.rank, dev, comm, max)?);
        }
    }
    let distributed = world > parts.len();
    let devices = parts
        .iter()
        .map(|p| {
            let info = p.dev.info();
            let bus = info
                .pci_bus_id
                .parse::<keel_topo::PciAddr>()
                .map(|a| format!("0x{:02x}", a.bus))
                .unwrap_or_else(|_| "0x??".into());
            RankDevice {
                rank: p.rank,
                ordinal: info.ordinal,
                pci_bus_id: info.pci_bus_id.clone(),
                bus,
                name: info.name.clone(),
            }
        })
        .collect();

    let elt = req.dtype.size() as u64;
    let mut rows = Vec::new();
    let mut out_of_bounds = 0;
    for size in sizes {
        let counts = req.collective.counts(size, elt, world as u64);
        let mut placements = [None, None];
        for (slot, in_place) in [false, true].into_iter().enumerate() {
            let checkable = !(in_place
                && matches!(req.collective, Collective::AllToAll | Collective::SendRecv));
            let mut wrong = if req.check && checkable {
                Some(check_once(&nccl, &parts, req, world, &counts, in_place)? as f64)
            } else {
                None
            };
            for _ in 0..req.warmup {
                launch_all(&nccl, &parts, req, world, &counts, in_place)?;
            }
            sync(&parts)?;
            let began = clock.now();
            for _ in 0..req.iters {
                launch_all(&nccl, &parts, req, world, &counts, in_place)?;
            }
            sync(&parts)?;
            let mut secs = clock.now().duration_since(began).as_secs_f64() / req.iters as f64;
            if distributed {
                secs = agree_time(&nccl, &parts[0], secs, req.average, world)?;
                if let Some(w) = wrong {
                    wrong = Some(combine(&nccl, &parts[0], w, Combine::Sum)?);
                }
            }
            let (algbw, busbw) = if secs > 0.0 {
                req.collective
                    .bandwidth(counts.param, elt, world as u64, secs)
            } else {
                (0.0, 0.0)
            };
            let wrong = wrong.map(|w| w.round() as u64);
            out_of_bounds += wrong.unwrap_or(0);
            placements[slot] = Some(Placement {
                time_us: secs * 1e6,
                algbw,
                busbw,
                wrong,
            });
        }
        let [Some(out_of_place), Some(in_place)] = placements else {
            return Err(BenchError::Invalid(
                "internal: a placement was not measured".into(),
            ));
        };
        rows.push(Row {
            bytes: req.collective.bytes_column(&counts, elt),
            count: counts.param,
            dtype: data::nccl_type_name(req.dtype),
            redop: redop_name(req.collective, req.op),
            root: root_column(req.collective, req.root),
            out_of_place,
            in_place,
        });
    }
    let avg_busbw = average_busbw(&rows);
    let passed = req
        .min_busbw
        .map(|min| avg_busbw >= min && out_of_bounds == 0);
    Ok(NcclReport {
        collective: req.collective,
        nccl_tests_binary: req.collective.nccl_tests_binary(),
        dtype: data::nccl_type_name(req.dtype),
        redop: redop_name(req.collective, req.op),
        root: root_column(req.collective, req.root),
        ranks: world,
        local_gpus: parts.len(),
        is_rank0: parts.iter().any(|p| p.rank == 0),
        sweep: req.sweep,
        iters: req.iters,
        warmup: req.warmup,
        check: req.check,
        average: req.average,
        nccl_version: nccl.version_string(),
        nccl_library: nccl.path().to_owned(),
        host: ident.host.clone(),
        pid: ident.pid,
        devices,
        rows,
        out_of_bounds,
        avg_busbw,
        min_busbw: req.min_busbw,
        passed,
    })
}

/// The footer's average: every row's out-of-place and in-place busbw.
pub fn average_busbw(rows: &[Row]) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    let sum: f64 = rows
        .iter()
        .map(|r| r.out_of_place.busbw + r.in_place.busbw)
        .sum();
    sum / (2 * rows.len()) as f64
}

fn part(rank: usize, dev: Device, comm: Comm, max: usize) -> Result<Part, BenchError> {
    let stream = dev.stream()?;
    let send = dev.alloc(max)?;
    let recv = dev.alloc(max)?;
    Ok(Part {
        rank,
        dev,
        comm,
        stream,
        send,
        recv,
    })
}

fn sync(parts: &[Part]) -> Result<(), BenchError> {
    for p in parts {
        p.stream.synchronize()?;
    }
    Ok(())
}

/// One collective on every local rank, in one NCCL group.
fn launch_all(
    nccl: &NcclLibrary,
    parts: &[Part],
    req: &NcclRequest,
    world: usize,
    c: &Counts,
    in_place: bool,
) -> Result<(), BenchError> {
    let elt = req.dtype.size();
    let param = c.param as usize;
    let (ty, op) = (req.dtype, req.op);
    nccl.group(|| {
        for p in parts {
            let s = &p.stream;
            let out = if in_place { &p.send } else { &p.recv };
            match req.collective {
                Collective::AllReduce => p.comm.all_reduce(
                    Span::new(&p.send, 0, param),
                    Span::new(out, 0, param),
                    ty,
                    op,
                    s,
                )?,
                Collective::Broadcast => p.comm.broadcast(
                    Span::new(&p.send, 0, param),
                    Span::new(out, 0, param),
                    ty,
                    req.root,
                    s,
                )?,
                Collective::Reduce => p.comm.reduce(
                    Span::new(&p.send, 0, param),
                    Span::new(out, 0, param),
                    ty,
                    op,
                    req.root,
                    s,
                )?,
                Collective::AllGather => {
                    let send = if in_place {
                        Span::new(&p.recv, p.rank * param * elt, param)
                    } else {
                        Span::new(&p.send, 0, param)
                    };
                    p.comm
                        .all_gather(send, Span::new(&p.recv, 0, param * world), ty, s)?
                }
                Collective::ReduceScatter => {
                    let recv = if in_place {
                        Span::new(&p.send, p.rank * param * elt, param)
                    } else {
                        Span::new(&p.recv, 0, param)
                    };
                    p.comm
                        .reduce_scatter(Span::new(&p.send, 0, param * world), recv, ty, op, s)?
                }
                Collective::AllToAll => {
                    for peer in 0..world {
                        p.comm
                            .send(Span::new(&p.send, peer * param * elt, param), ty, peer, s)?;
                        p.comm
                            .recv(Span::new(out, peer * param * elt, param), ty, peer, s)?;
                    }
                }
                Collective::SendRecv => {
                    let next = (p.rank + 1) % world;
                    let prev = (p.rank + world - 1) % world;
                    p.comm.send(Span::new(&p.send, 0, param), ty, next, s)?;
                    p.comm.recv(Span::new(out, 0, param), ty, prev, s)?;
                }
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Sets up known data, runs the collective once, and counts wrong
/// elements on the local ranks.
fn check_once(
    nccl: &NcclLibrary,
    parts: &[Part],
    req: &NcclRequest,
    world: usize,
    c: &Counts,
    in_place: bool,
) -> Result<u64, BenchError> {
    let t = req.dtype;
    let elt = t.size();
    let param = c.param as usize;
    let whole = param * world;
    let pattern = Pattern {
        op: if req.collective.reduces() {
            req.op
        } else {
            NcclOp::Sum
        },
        ranks: world,
    };
    let per = pattern.period();
    let own = |q: usize| Periodic::new(per, 0, move |j| pattern.value(q, j));
    for p in parts {
        let r = p.rank;
        let poison = |buf: &DeviceBuffer, offset: usize, n: usize| {
            p.stream.upload(buf, offset, &vec![0xff; n * elt])
        };
        match req.collective {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce => {
                p.stream.upload(&p.send, 0, &own(r).encode(t, param))?;
                if !in_place {
                    poison(&p.recv, 0, param)?;
                }
            }
            Collective::AllGather => {
                poison(&p.recv, 0, whole)?;
                let at = if in_place {
                    (&p.recv, r * param * elt)
                } else {
                    (&p.send, 0)
                };
                p.stream.upload(at.0, at.1, &own(r).encode(t, param))?;
            }
            Collective::ReduceScatter | Collective::AllToAll => {
                p.stream.upload(&p.send, 0, &own(r).encode(t, whole))?;
                if !in_place {
                    poison(
                        &p.recv,
                        0,
                        if req.collective == Collective::AllToAll {
                            whole
                        } else {
                            param
                        },
                    )?;
                }
            }
            Collective::SendRecv => {
                p.stream.upload(&p.send, 0, &own(r).encode(t, param))?;
                poison(&p.recv, 0, param)?;
            }
        }
    }
    launch_all(nccl, parts, req, world, c, in_place)?;
    sync(parts)?;
    let mut wrong = 0;
    for p in parts {
        let r = p.rank;
        let out = if in_place { &p.send } else { &p.recv };
        let read = |buf: &DeviceBuffer, offset: usize, n: usize| -> Result<Vec<u8>, BenchError> {
            let mut v = vec![0u8; n * elt];
            p.stream.download(buf, offset, &mut v)?;
            Ok(v)
        };
        match req.collective {
            Collective::AllReduce => {
                let want = Periodic::new(per, 0, |j| pattern.reduced(j));
                wrong += data::count_wrong(t, &read(out, 0, param)?, &want);
            }
            Collective::Reduce => {
                if r == req.root {
                    let want = Periodic::new(per, 0, |j| pattern.reduced(j));
                    wrong += data::count_wrong(t, &read(out, 0, param)?, &want);
                }
            }
            Collective::Broadcast => {
                wrong += data::count_wrong(t, &read(out, 0, param)?, &own(req.root));
            }
            Collective::AllGather => {
                let got = read(&p.recv, 0, whole)?;
                for q in 0..world {
                    let chunk = &got[q * param * elt..(q + 1) * param * elt];
                    wrong += data::count_wrong(t, chunk, &own(q));
                }
            }
            Collective::ReduceScatter => {
                let got = if in_place {
                    read(&p.send, r * param * elt, param)?
                } else {
                    read(&p.recv, 0, param)?
                };
                let want = Periodic::new(per, (r * param) as u64, |j| pattern.reduced(j));
                wrong += data::count_wrong(t, &got, &want);
            }
            Collective::AllToAll => {
                let got = read(&p.recv, 0, whole)?;
                for q in 0..world {
                    let chunk = &got[q * param * elt..(q + 1) * param * elt];
                    let want = Periodic::new(per, (r * param) as u64, move |j| pattern.value(q, j));
                    wrong += data::count_wrong(t, chunk, &want);
                }
            }
            Collective::SendRecv => {
                let prev = (r + world - 1) % world;
                wrong += data::count_wrong(t, &read(&p.recv, 0, param)?, &own(prev));
            }
        }
    }
    Ok(wrong)
}

/// How ranks combine one number.
#[derive(Debug, Clone, Copy)]
enum Combine {
    Rank0,
    Sum,
    Min,
    Max,
}

/// The reported time from every rank's (`-a`).
fn agree_time(
    nccl: &NcclLibrary,
    p: &Part,
    secs: f64,
    how: Average,
    world: usize,
) -> Result<f64, BenchError> {
    Ok(match how {
        Average::Rank0 => combine(nccl, p, secs, Combine::Rank0)?,
        Average::Mean => combine(nccl, p, secs, Combine::Sum)? / world as f64,
        Average::Min => combine(nccl, p, secs, Combine::Min)?,
        Average::Max => combine(nccl, p, secs, Combine::Max)?,
    })
}

/// One number agreed by all ranks of a multi-process run (an NCCL
/// all-reduce or broadcast of a float64).
fn combine(nccl: &NcclLibrary, p: &Part, value: f64, how: Combine) -> Result<f64, BenchError> {
    let buf = p.dev.alloc(8)?;
    p.stream.upload(&buf, 0, &value.to_le_bytes())?;
    let one = Span::new(&buf, 0, 1);
    let f64t = NcclType::Float64;
    nccl.group(|| match how {
        Combine::Rank0 => p.comm.broadcast(one, one, f64t, 0, &p.stream),
        Combine::Sum => p.comm.all_reduce(one, one, f64t, NcclOp::Sum, &p.stream),
        Combine::Min => p.comm.all_reduce(one, one, f64t, NcclOp::Min, &p.stream),
        Combine::Max => p.comm.all_reduce(one, one, f64t, NcclOp::Max, &p.stream),
    })?;
    let mut out = [0u8; 8];
    p.stream.download(&buf, 0, &mut out)?;
    Ok(f64::from_le_bytes(out))
}
