//! The collectives and nccl-tests' arithmetic for them: element counts per
//! message size, algorithm bandwidth and bus bandwidth.
//!
//! For a size S in bytes and element size e, `count = S / e`. All-reduce,
//! broadcast, reduce and send/recv move `count` elements. All-gather,
//! reduce-scatter and all-to-all split the array across the n ranks: each
//! rank's part is `count / n` rounded down to a multiple of 16 bytes, and
//! the array is that part times n (the size nccl-tests prints).
//!
//! `algbw = S / time` with S the whole array (for all-gather,
//! reduce-scatter and all-to-all: part x n x e), in GB/s with 1 GB = 1e9
//! bytes. `busbw = algbw x factor`: 2(n-1)/n for all-reduce; (n-1)/n for
//! all-gather, reduce-scatter and all-to-all; 1 for broadcast, reduce and
//! send/recv.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    #[serde(rename = "alltoall")]
    AllToAll,
    #[serde(rename = "sendrecv")]
    SendRecv,
}

/// Element counts for one message size, as nccl-tests' `getCollByteCount`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Elements each rank sends from.
    pub send: u64,
    /// Elements each rank receives into.
    pub recv: u64,
    /// The count passed to NCCL (and to the bandwidth formula).
    pub param: u64,
    /// In place: where the send data starts in the receive buffer, per rank
    /// index, in elements (all-gather).
    pub send_inplace_offset: u64,
    /// In place: where the receive data starts in the send buffer, per rank
    /// index, in elements (reduce-scatter).
    pub recv_inplace_offset: u64,
}

impl Collective {
    pub const ALL: [Collective; 7] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllToAll,
        Collective::SendRecv,
    ];

    /// The name on keel's command line.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllToAll => "alltoall",
            Collective::SendRecv => "sendrecv",
        }
    }

    /// The nccl-tests binary that measures the same thing.
    pub fn nccl_tests_binary(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce_perf",
            Collective::AllGather => "all_gather_perf",
            Collective::ReduceScatter => "reduce_scatter_perf",
            Collective::Broadcast => "broadcast_perf",
            Collective::Reduce => "reduce_perf",
            Collective::AllToAll => "alltoall_perf",
            Collective::SendRecv => "sendrecv_perf",
        }
    }

    /// Whether the reduction operation (`-o`) applies.
    pub fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// Whether the root (`-r`) applies.
    pub fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }

    /// Whether the whole array is split across ranks (S = part x ranks).
    pub fn split(self) -> bool {
        matches!(
            self,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll
        )
    }

    /// Bus bandwidth factor for `ranks` ranks.
    pub fn bus_factor(self, ranks: u64) -> f64 {
        let n = ranks as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce | Collective::SendRecv => 1.0,
        }
    }

    /// Counts for a message of `bytes` of elements of `elt` bytes over
    /// `ranks` ranks.
    pub fn counts(self, bytes: u64, elt: u64, ranks: u64) -> Counts {
        let count = bytes / elt;
        if self.split() {
            // nccl-tests: (count / nranks) & -(16 / eltSize): each part a
            // whole number of 16-byte units.
            let align = (16 / elt).max(1);
            let part = count / ranks / align * align;
            let whole = part * ranks;
            match self {
                Collective::AllGather => Counts {
                    send: part,
                    recv: whole,
                    param: part,
                    send_inplace_offset: part,
                    recv_inplace_offset: 0,
                },
                Collective::ReduceScatter => Counts {
                    send: whole,
                    recv: part,
                    param: part,
                    send_inplace_offset: 0,
                    recv_inplace_offset: part,
                },
                _ => Counts {
                    send: whole,
                    recv: whole,
                    param: part,
                    send_inplace_offset: 0,
                    recv_inplace_offset: 0,
                },
            }
        } else {
            Counts {
                send: count,
                recv: count,
                param: count,
                send_inplace_offset: 0,
                recv_inplace_offset: 0,
            }
        }
    }

    /// The size column: the larger of the send and receive arrays, bytes.
    pub fn bytes_column(self, c: &Counts, elt: u64) -> u64 {
        c.send.max(c.recv) * elt
    }

    /// `(algbw, busbw)` in GB/s for `param` elements in `seconds`.
    pub fn bandwidth(self, param: u64, elt: u64, ranks: u64, seconds: f64) -> (f64, f64) {
        let mut bytes = (param * elt) as f64;
        if self.split() {
            bytes *= ranks as f64;
        }
        let algbw = bytes / 1.0e9 / seconds;
        (algbw, algbw * self.bus_factor(ranks))
    }
}

impl std::str::FromStr for Collective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.to_ascii_lowercase().replace(['_', '-'], "");
        Collective::ALL
            .into_iter()
            .find(|c| c.name().replace('-', "") == norm)
            .ok_or_else(|| {
                format!(
                    "unknown collective {s:?}; one of {}",
                    Collective::ALL.map(|c| c.name()).join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Collective::*;

    /// Hand-computed: (collective, ranks, bytes, elt, seconds) ->
    /// (size column, param count, algbw, busbw).
    #[test]
    fn bandwidth_table() {
        type Case = (Collective, u64, u64, u64, f64, u64, u64, f64, f64);
        #[rustfmt::skip]
        let table: &[Case] = &[
            // The sample row of the NDv4 seed: 2 GiB all-reduce, 16 ranks,
            // 21495 us (printed 99.91 and 187.33: the time was rounded).
            (AllReduce, 16, 2147483648, 4, 21495e-6, 2147483648, 536870912, 99.906_194, 187.324_114),
            // all-reduce: busbw = algbw * 2(n-1)/n.
            (AllReduce, 1, 1_000_000_000, 4, 1.0, 1_000_000_000, 250_000_000, 1.0, 0.0),
            (AllReduce, 2, 1_000_000_000, 4, 1.0, 1_000_000_000, 250_000_000, 1.0, 1.0),
            (AllReduce, 4, 1_000_000_000, 2, 0.5, 1_000_000_000, 500_000_000, 2.0, 3.0),
            (AllReduce, 8, 1_000_000_000, 4, 0.01, 1_000_000_000, 250_000_000, 100.0, 175.0),
            // all-gather: S = part * n; busbw = algbw * (n-1)/n.
            (AllGather, 2, 1_000_000_000, 4, 1.0, 1_000_000_000, 125_000_000, 1.0, 0.5),
            (AllGather, 4, 1_000_000_000, 4, 1.0, 1_000_000_000, 62_500_000, 1.0, 0.75),
            (AllGather, 8, 1_000_000_000, 4, 0.1, 1_000_000_000, 31_250_000, 10.0, 8.75),
            // 3 ranks: 1e9/4 = 250e6 elements, /3 = 83_333_333, down to a
            // multiple of 4 elements (16 bytes) = 83_333_332.
            (AllGather, 3, 1_000_000_000, 4, 1.0, 999_999_984, 83_333_332, 0.999_999_984, 0.666_666_656),
            (ReduceScatter, 8, 1_000_000_000, 4, 0.1, 1_000_000_000, 31_250_000, 10.0, 8.75),
            (ReduceScatter, 2, 64, 2, 1e-6, 64, 16, 0.064, 0.032),
            (AllToAll, 8, 1_000_000_000, 4, 0.1, 1_000_000_000, 31_250_000, 10.0, 8.75),
            (AllToAll, 4, 1 << 20, 8, 1e-3, 1 << 20, 32768, 1.048_576, 0.786_432),
            // broadcast, reduce, send/recv: factor 1.
            (Broadcast, 8, 1_000_000_000, 4, 0.1, 1_000_000_000, 250_000_000, 10.0, 10.0),
            (Reduce, 4, 1_000_000_000, 8, 0.2, 1_000_000_000, 125_000_000, 5.0, 5.0),
            (SendRecv, 2, 1_000_000_000, 1, 0.04, 1_000_000_000, 1_000_000_000, 25.0, 25.0),
            // Tiny split messages round to nothing (nccl-tests prints 0).
            (AllGather, 8, 8, 4, 1e-5, 0, 0, 0.0, 0.0),
        ];
        for &(c, n, bytes, elt, secs, size_col, param, algbw, busbw) in table {
            let counts = c.counts(bytes, elt, n);
            assert_eq!(counts.param, param, "{c:?} n={n} bytes={bytes}");
            assert_eq!(
                c.bytes_column(&counts, elt),
                size_col,
                "{c:?} n={n} bytes={bytes}"
            );
            let (a, b) = c.bandwidth(counts.param, elt, n, secs);
            assert!(
                (a - algbw).abs() < 1e-5,
                "{c:?} n={n}: algbw {a} != {algbw}"
            );
            assert!(
                (b - busbw).abs() < 1e-5,
                "{c:?} n={n}: busbw {b} != {busbw}"
            );
        }
    }

    #[test]
    fn bus_factors_for_every_collective_and_rank_count() {
        for n in [1u64, 2, 3, 4, 8, 16, 64] {
            let nf = n as f64;
            for c in Collective::ALL {
                let want = match c {
                    AllReduce => 2.0 * (nf - 1.0) / nf,
                    AllGather | ReduceScatter | AllToAll => (nf - 1.0) / nf,
                    _ => 1.0,
                };
                assert_eq!(c.bus_factor(n), want, "{c:?} {n}");
            }
        }
        assert_eq!(AllReduce.bus_factor(8), 1.75);
        assert_eq!(AllGather.bus_factor(4), 0.75);
    }

    #[test]
    fn in_place_offsets() {
        let ag = AllGather.counts(1024, 4, 4);
        assert_eq!((ag.send, ag.recv, ag.send_inplace_offset), (64, 256, 64));
        let rs = ReduceScatter.counts(1024, 4, 4);
        assert_eq!((rs.send, rs.recv, rs.recv_inplace_offset), (256, 64, 64));
        let ar = AllReduce.counts(1024, 4, 4);
        assert_eq!((ar.send, ar.recv, ar.param), (256, 256, 256));
    }

    #[test]
    fn names_parse() {
        for c in Collective::ALL {
            assert_eq!(c.name().parse::<Collective>(), Ok(c));
        }
        assert_eq!("all_reduce".parse::<Collective>(), Ok(AllReduce));
        assert_eq!("AllGather".parse::<Collective>(), Ok(AllGather));
        assert_eq!("all-to-all".parse::<Collective>(), Ok(AllToAll));
        let e = "allsum".parse::<Collective>().expect_err("unknown");
        assert!(e.contains("all-reduce, all-gather"), "{e}");
    }
}
