//! nccl-tests' text output, column for column: the header, one row per
//! size with out-of-place and in-place time, algbw, busbw and wrong
//! elements, and the footer (`# Out of bounds values : 0 OK`,
//! `# Avg bus bandwidth    : X`). Scripts that parse nccl-tests output
//! parse this.

use crate::nccl::{NcclReport, Placement, Row};

/// C's `%g`: six significant digits, trailing zeros removed, exponent form
/// below 1e-4 and from 1e6.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let sci = format!("{x:.5e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..6).contains(&exp) {
        let m = strip_zeros(mantissa);
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{m}e{sign}{:02}", exp.abs())
    } else {
        let decimals = (5 - exp).max(0) as usize;
        strip_zeros(&format!("{x:.decimals$}"))
    }
}

fn strip_zeros(s: &str) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s.to_owned()
    }
}

/// The time column: `%7.0f` from 10 ms, `%7.1f` from 100 us, else `%7.2f`.
pub fn fmt_time(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:>7.0}")
    } else if us >= 100.0 {
        format!("{us:>7.1}")
    } else {
        format!("{us:>7.2}")
    }
}

fn placement(p: &Placement) -> String {
    let wrong = match p.wrong {
        Some(w) => format!("{:>5}", fmt_g(w as f64)),
        None => format!("{:>5}", "N/A"),
    };
    format!(
        "  {}  {:>6.2}  {:>6.2}  {wrong}",
        fmt_time(p.time_us),
        p.algbw,
        p.busbw
    )
}

/// One table row.
pub fn row(r: &Row) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}",
        r.bytes,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        placement(&r.out_of_place),
        placement(&r.in_place)
    )
}

/// The whole output of one run, as nccl-tests prints it on rank 0.
pub fn render(rep: &NcclReport) -> String {
    let mut out = Vec::new();
    out.push(format!(
        "# nThread 1 nGpus {} minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0",
        rep.local_gpus,
        rep.sweep.min_bytes,
        rep.sweep.max_bytes,
        rep.sweep.describe_step(),
        rep.warmup,
        rep.iters,
        u8::from(rep.check)
    ));
    out.push("#".into());
    out.push("# Using devices".into());
    for d in &rep.devices {
        out.push(format!(
            "#  Rank {:>2} Group  0 Pid {:>6} on {:>10} device {:>2} [{}] {}",
            d.rank, rep.pid, rep.host, d.ordinal, d.bus, d.name
        ));
    }
    out.push("#".into());
    out.push(format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place",
        "", "", "", "", ""
    ));
    out.push(format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    ));
    out.push(format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    ));
    for r in &rep.rows {
        out.push(row(r));
    }
    out.push(format!(
        "# Out of bounds values : {} {}",
        rep.out_of_bounds,
        if rep.out_of_bounds == 0 {
            "OK"
        } else {
            "FAILED"
        }
    ));
    let verdict = match rep.min_busbw {
        Some(min) if rep.avg_busbw >= min => " OK",
        Some(_) => " FAILED",
        None => "",
    };
    out.push(format!(
        "# Avg bus bandwidth    : {}{verdict}",
        fmt_g(rep.avg_busbw)
    ));
    out.push("#".into());
    let mut s: String = out
        .into_iter()
        .map(|l| l.trim_end().to_owned())
        .collect::<Vec<_>>()
        .join("\n");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_g() {
        for (x, s) in [
            (0.0, "0"),
            (187.33, "187.33"),
            (187.324972, "187.325"),
            (1.0, "1"),
            (0.5, "0.5"),
            (123456.0, "123456"),
            (1234567.0, "1.23457e+06"),
            (0.0001, "0.0001"),
            (0.00001234, "1.234e-05"),
            (99.999999, "100"),
            (999999.5, "1e+06"),
            (-2.5, "-2.5"),
        ] {
            assert_eq!(fmt_g(x), s, "{x}");
        }
    }

    #[test]
    fn time_column() {
        assert_eq!(fmt_time(9.87), "   9.87");
        assert_eq!(fmt_time(123.45), "  123.5");
        assert_eq!(fmt_time(21495.0), "  21495");
    }
}
