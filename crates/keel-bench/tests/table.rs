//! The nccl-tests table, pinned: the layout scripts parse.

use keel_bench::collective::Collective;
use keel_bench::nccl::{average_busbw, Average, NcclReport, Placement, RankDevice, Row};
use keel_bench::sweep::Sweep;
use keel_bench::table;

fn placement(c: Collective, bytes: u64, ranks: u64, us: f64, wrong: Option<u64>) -> Placement {
    let counts = c.counts(bytes, 4, ranks);
    let (algbw, busbw) = c.bandwidth(counts.param, 4, ranks, us * 1e-6);
    Placement {
        time_us: us,
        algbw,
        busbw,
        wrong,
    }
}

fn report(c: Collective, ranks: u64, min_busbw: Option<f64>, check: bool) -> NcclReport {
    let sweep = Sweep {
        min_bytes: 8,
        max_bytes: 2 << 30,
        factor: 8,
        step_bytes: 1 << 20,
    };
    let times = [9.87, 10.12, 14.5, 48.3, 260.4, 1984.0, 15876.0, 21495.0];
    let rows: Vec<Row> = sweep
        .sizes()
        .expect("sweep")
        .into_iter()
        .zip(times)
        .map(|(bytes, us)| {
            let counts = c.counts(bytes, 4, ranks);
            let wrong = check.then_some(0);
            Row {
                bytes: c.bytes_column(&counts, 4),
                count: counts.param,
                dtype: "float",
                redop: keel_bench::nccl::redop_name(c, keel_cuda::NcclOp::Sum),
                root: keel_bench::nccl::root_column(c, 0),
                out_of_place: placement(c, bytes, ranks, us, wrong),
                in_place: placement(c, bytes, ranks, us * 0.98, wrong),
            }
        })
        .collect();
    let avg = average_busbw(&rows);
    NcclReport {
        collective: c,
        nccl_tests_binary: c.nccl_tests_binary(),
        dtype: "float",
        redop: keel_bench::nccl::redop_name(c, keel_cuda::NcclOp::Sum),
        root: keel_bench::nccl::root_column(c, 0),
        ranks: ranks as usize,
        local_gpus: 2,
        is_rank0: true,
        sweep,
        iters: 20,
        warmup: 1,
        check,
        average: Average::Mean,
        nccl_version: "2.27.3".into(),
        nccl_library: "/usr/lib/x86_64-linux-gnu/libnccl.so.2".into(),
        host: "node01".into(),
        pid: 4242,
        devices: (0..2)
            .map(|r| RankDevice {
                rank: r,
                ordinal: r,
                pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + r * 0x1a),
                bus: format!("0x{:02x}", 0x18 + r * 0x1a),
                name: "NVIDIA H100 80GB HBM3".into(),
            })
            .collect(),
        rows,
        out_of_bounds: 0,
        avg_busbw: avg,
        passed: min_busbw.map(|m| avg >= m),
        min_busbw,
    }
}

#[test]
fn all_reduce_table() {
    insta::assert_snapshot!(table::render(&report(
        Collective::AllReduce,
        16,
        None,
        true
    )));
}

#[test]
fn all_gather_table_with_a_threshold_and_no_check() {
    insta::assert_snapshot!(table::render(&report(
        Collective::AllGather,
        8,
        Some(400.0),
        false
    )));
}

#[test]
fn broadcast_root_column() {
    let r = report(Collective::Broadcast, 2, Some(0.001), true);
    let text = table::render(&r);
    let first = text.lines().find(|l| !l.starts_with('#')).expect("a row");
    assert_eq!(
        first,
        "           8             2     float    none       0     9.87    0.00    0.00      0     9.67    0.00    0.00      0"
    );
    assert!(text.contains("# Avg bus bandwidth    : "));
    assert!(text.trim_end().ends_with("OK\n#"));
}
