//! The Prometheus text exposition format (version 0.0.4): families in the
//! order they were first named, each with one `# HELP` and `# TYPE` before
//! its samples, label values escaped. Families without samples are left
//! out, so a reading that could not be taken leaves no series.

use std::collections::HashMap;
use std::fmt::Write as _;

/// The Content-Type of [`Exposition::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The Content-Type of [`to_openmetrics`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The text format turned into OpenMetrics 1.0: a counter family is named
/// without its `_total` suffix in `# HELP` and `# TYPE` (its samples keep
/// it), and the exposition ends with `# EOF`. Every counter keel exposes
/// ends in `_total` and no gauge does.
pub fn to_openmetrics(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for line in text.lines() {
        let meta = line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name.strip_suffix("_total").unwrap_or(name));
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out.push_str("# EOF\n");
    out
}

/// Whether `line` is a sample line of the text format: a metric name, an
/// optional `{...}` label set and a value.
pub fn is_sample_line(line: &str) -> bool {
    let Some((head, value)) = line.rsplit_once(' ') else {
        return false;
    };
    let value_ok = matches!(value, "NaN" | "+Inf" | "-Inf") || value.parse::<f64>().is_ok();
    let name_end = head.find('{').unwrap_or(head.len());
    let name = &head[..name_end];
    let labels_ok = name_end == head.len()
        || (head.ends_with('}') && !head[name_end + 1..head.len() - 1].contains('\n'));
    value_ok
        && labels_ok
        && !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

#[derive(Debug)]
struct Family {
    name: String,
    help: &'static str,
    kind: Kind,
    samples: String,
}

/// Samples grouped by family, rendered at the end.
#[derive(Debug, Default)]
pub struct Exposition {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one sample. The first sample of a name fixes its help and type.
    pub fn add(
        &mut self,
        name: &str,
        kind: Kind,
        help: &'static str,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        let i = match self.index.get(name) {
            Some(i) => *i,
            None => {
                self.families.push(Family {
                    name: name.to_owned(),
                    help,
                    kind,
                    samples: String::new(),
                });
                self.index.insert(name.to_owned(), self.families.len() - 1);
                self.families.len() - 1
            }
        };
        let s = &mut self.families[i].samples;
        s.push_str(name);
        if !labels.is_empty() {
            s.push('{');
            for (n, (k, v)) in labels.iter().enumerate() {
                if n > 0 {
                    s.push(',');
                }
                s.push_str(k);
                s.push_str("=\"");
                escape_into(s, v);
                s.push('"');
            }
            s.push('}');
        }
        s.push(' ');
        push_value(s, value);
        s.push('\n');
    }

    /// The families that have samples, in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out =
            String::with_capacity(self.families.iter().map(|f| f.samples.len() + 128).sum());
        for f in self.families.iter().filter(|f| !f.samples.is_empty()) {
            let kind = match f.kind {
                Kind::Gauge => "gauge",
                Kind::Counter => "counter",
            };
            let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
            let _ = writeln!(out, "# TYPE {} {kind}", f.name);
            out.push_str(&f.samples);
        }
        out
    }
}

/// Escapes a label value: backslash, double quote and line feed.
pub fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn push_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        let _ = write!(out, "{}", v as i64);
    } else {
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_names_counter_families_without_total_and_ends_with_eof() {
        let mut e = Exposition::new();
        e.add("x_joules_total", Kind::Counter, "X.", &[("gpu", "0")], 5.0);
        e.add("y_bytes", Kind::Gauge, "Y.", &[], 1.0);
        assert_eq!(
            to_openmetrics(&e.render()),
            "# HELP x_joules X.\n# TYPE x_joules counter\nx_joules_total{gpu=\"0\"} 5\n\
             # HELP y_bytes Y.\n# TYPE y_bytes gauge\ny_bytes 1\n# EOF\n"
        );
    }

    #[test]
    fn sample_lines() {
        for ok in [
            "a 1",
            "a_b:c{x=\"1\",y=\"a b\"} -2.5e3",
            "a NaN",
            "a{} +Inf",
        ] {
            assert!(is_sample_line(ok), "{ok}");
        }
        for bad in [
            "a",
            "1a 1",
            "a{x=\"1\" 1",
            "a one",
            "a-b 1",
            " 1",
            "a{x=\"1\"} ",
        ] {
            assert!(!is_sample_line(bad), "{bad}");
        }
    }

    #[test]
    fn families_are_contiguous_and_values_formatted() {
        let mut e = Exposition::new();
        e.add("a_bytes", Kind::Gauge, "A.", &[("gpu", "0")], 1.0);
        e.add("b_total", Kind::Counter, "B.", &[], 2.5);
        e.add(
            "a_bytes",
            Kind::Gauge,
            "ignored",
            &[("gpu", "1"), ("x", "q\"\\\n")],
            f64::NAN,
        );
        e.add("c", Kind::Gauge, "C.", &[], f64::INFINITY);
        assert_eq!(
            e.render(),
            "# HELP a_bytes A.\n# TYPE a_bytes gauge\na_bytes{gpu=\"0\"} 1\n\
             a_bytes{gpu=\"1\",x=\"q\\\"\\\\\\n\"} NaN\n\
             # HELP b_total B.\n# TYPE b_total counter\nb_total 2.5\n\
             # HELP c C.\n# TYPE c gauge\nc +Inf\n"
        );
    }
}
