//! Prometheus metrics, labelled by route template (never the raw path),
//! model, deployment and key id, rendered in the text exposition format
//! on the separate metrics listener.

use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Histogram bucket bounds in seconds: fine below a millisecond, where
/// gateway overhead lives, and up to a minute, where generations do.
pub const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; 18],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| s <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Series by the hash of their label values; a hit allocates nothing.
type Series<T> = HashMap<u64, Vec<(Box<[String]>, Arc<T>)>, BuildHasherDefault<Prehashed>>;

/// The map's keys are hashes already: passed through as they are.
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Debug)]
struct Family<T> {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    series: RwLock<Series<T>>,
}

/// FNV-1a over the values, each followed by a 0xff (which no UTF-8 text
/// contains), so that `["ab", "c"]` and `["a", "bc"]` differ. Collisions
/// only cost a comparison: series with one hash are told apart by value.
fn label_hash(values: &[&str]) -> u64 {
    let mut h = crate::fnv::Fnv::default();
    for v in values {
        h.write(v.as_bytes());
        h.write(&[0xff]);
    }
    h.finish()
}

fn same(a: &[String], b: &[&str]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

impl<T: Default> Family<T> {
    fn new(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Self {
        Self {
            name,
            help,
            labels,
            series: RwLock::default(),
        }
    }

    /// Runs `f` on the series for `values`, made on first use.
    fn with<R>(&self, values: &[&str], f: impl FnOnce(&T) -> R) -> R {
        self.with_hashed(label_hash(values), values, f)
    }

    /// [`Family::with`] for values whose [`label_hash`] is `h` (families
    /// with the same label values share it). A series that exists is used
    /// under the read lock, without touching its reference count.
    fn with_hashed<R>(&self, h: u64, values: &[&str], f: impl FnOnce(&T) -> R) -> R {
        debug_assert_eq!(values.len(), self.labels.len());
        debug_assert_eq!(h, label_hash(values));
        {
            let r = self.series.read().unwrap_or_else(|p| p.into_inner());
            if let Some((_, s)) = r
                .get(&h)
                .and_then(|v| v.iter().find(|(k, _)| same(k, values)))
            {
                return f(s);
            }
        }
        let mut w = self.series.write().unwrap_or_else(|p| p.into_inner());
        let v = w.entry(h).or_default();
        if let Some((_, s)) = v.iter().find(|(k, _)| same(k, values)) {
            return f(s);
        }
        let s = Arc::new(T::default());
        let out = f(&s);
        v.push((values.iter().map(|x| (*x).to_owned()).collect(), s));
        out
    }

    /// Every series, sorted by labels, for rendering.
    fn rows(&self) -> Vec<(Box<[String]>, Arc<T>)> {
        let series = self.series.read().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<_> = series.values().flatten().cloned().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        rows
    }

    fn label_text(&self, values: &[String], extra: Option<(&str, &str)>) -> String {
        let mut s = String::new();
        for (k, v) in self.labels.iter().zip(values) {
            if !s.is_empty() {
                s.push(',');
            }
            let _ = write!(s, "{k}=\"{}\"", escape(v));
        }
        if let Some((k, v)) = extra {
            if !s.is_empty() {
                s.push(',');
            }
            let _ = write!(s, "{k}=\"{v}\"");
        }
        s
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Family<AtomicU64> {
    fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} counter",
            self.name, self.help, self.name
        );
        for (k, v) in self.rows() {
            let k = &k;
            let _ = writeln!(
                out,
                "{}{{{}}} {}",
                self.name,
                self.label_text(k, None),
                v.load(Ordering::Relaxed)
            );
        }
    }
}

impl Family<Histogram> {
    fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} histogram",
            self.name, self.help, self.name
        );
        for (k, h) in self.rows() {
            let k = &k;
            let mut cum = 0;
            for (i, b) in BUCKETS.iter().enumerate() {
                cum += h.counts[i].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{}_bucket{{{}}} {cum}",
                    self.name,
                    self.label_text(k, Some(("le", &b.to_string())))
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{}_bucket{{{}}} {count}",
                self.name,
                self.label_text(k, Some(("le", "+Inf")))
            );
            let l = self.label_text(k, None);
            let _ = writeln!(
                out,
                "{}_sum{{{l}}} {}",
                self.name,
                h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
            );
            let _ = writeln!(out, "{}_count{{{l}}} {count}", self.name);
        }
    }
}

/// Every metric the gateway keeps.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<AtomicU64>,
    duration: Family<Histogram>,
    backend: Family<Histogram>,
    overhead: Family<Histogram>,
    tokens: Family<AtomicU64>,
    errors: Family<AtomicU64>,
    retries: Family<AtomicU64>,
    fallbacks: Family<AtomicU64>,
    mirrored: Family<AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The labels of one finished request.
#[derive(Debug, Clone, Copy)]
pub struct RequestLabels<'a> {
    pub route: &'a str,
    pub model: &'a str,
    pub deployment: &'a str,
    pub key: &'a str,
    pub code: u16,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            requests: Family::new(
                "keel_requests_total",
                "Requests answered.",
                &["route", "model", "deployment", "key", "code"],
            ),
            duration: Family::new(
                "keel_request_duration_seconds",
                "Time from request to the end of the response.",
                &["route", "model", "deployment"],
            ),
            backend: Family::new(
                "keel_backend_duration_seconds",
                "Time spent waiting on the backend.",
                &["route", "model", "deployment"],
            ),
            overhead: Family::new(
                "keel_gateway_overhead_seconds",
                "Gateway overhead: total time minus backend time.",
                &["route", "model", "deployment"],
            ),
            tokens: Family::new(
                "keel_tokens_total",
                "Tokens by direction (in: prompt, out: completion).",
                &["direction", "model", "deployment", "key"],
            ),
            errors: Family::new(
                "keel_errors_total",
                "Refused or failed requests by kind.",
                &["route", "kind"],
            ),
            retries: Family::new(
                "keel_retries_total",
                "Requests sent again to another deployment.",
                &["model"],
            ),
            fallbacks: Family::new(
                "keel_fallbacks_total",
                "Requests served by a fallback model.",
                &["model", "fallback"],
            ),
            mirrored: Family::new(
                "keel_mirrored_requests_total",
                "Requests copied to a shadow deployment (never charged).",
                &["model", "deployment", "outcome"],
            ),
        }
    }

    pub fn request(&self, l: RequestLabels<'_>, total: Duration, backend: Option<Duration>) {
        let mut buf = [0u8; 20];
        let code = crate::digits::decimal(l.code.into(), &mut buf);
        self.requests
            .with(&[l.route, l.model, l.deployment, l.key, code], |c| {
                c.fetch_add(1, Ordering::Relaxed)
            });
        let dl = [l.route, l.model, l.deployment];
        let h = label_hash(&dl);
        self.duration.with_hashed(h, &dl, |s| s.observe(total));
        if let Some(b) = backend {
            self.backend.with_hashed(h, &dl, |s| s.observe(b));
            self.overhead
                .with_hashed(h, &dl, |s| s.observe(total.saturating_sub(b)));
        }
    }

    pub fn tokens(&self, model: &str, deployment: &str, key: &str, prompt: u64, completion: u64) {
        self.tokens.with(&["in", model, deployment, key], |c| {
            c.fetch_add(prompt, Ordering::Relaxed)
        });
        self.tokens.with(&["out", model, deployment, key], |c| {
            c.fetch_add(completion, Ordering::Relaxed)
        });
    }

    pub fn error(&self, route: &str, kind: &str) {
        self.errors
            .with(&[route, kind], |c| c.fetch_add(1, Ordering::Relaxed));
    }

    pub fn retry(&self, model: &str) {
        self.retries
            .with(&[model], |c| c.fetch_add(1, Ordering::Relaxed));
    }

    pub fn fallback(&self, model: &str, fallback: &str) {
        self.fallbacks
            .with(&[model, fallback], |c| c.fetch_add(1, Ordering::Relaxed));
    }

    pub fn mirrored(&self, model: &str, deployment: &str, outcome: &str) {
        self.mirrored.with(&[model, deployment, outcome], |c| {
            c.fetch_add(1, Ordering::Relaxed)
        });
    }

    /// The text exposition, followed by per-backend gauges
    /// (`(backend, healthy, circuit_open)`).
    pub fn render(&self, backends: &[(String, bool, bool)]) -> String {
        let mut out = String::new();
        self.requests.render(&mut out);
        self.duration.render(&mut out);
        self.backend.render(&mut out);
        self.overhead.render(&mut out);
        self.tokens.render(&mut out);
        self.errors.render(&mut out);
        self.retries.render(&mut out);
        self.fallbacks.render(&mut out);
        self.mirrored.render(&mut out);
        out.push_str("# HELP keel_backend_healthy Whether active probes find the backend healthy.\n# TYPE keel_backend_healthy gauge\n");
        for (b, h, _) in backends {
            let _ = writeln!(
                out,
                "keel_backend_healthy{{backend=\"{}\"}} {}",
                escape(b),
                *h as u8
            );
        }
        out.push_str("# HELP keel_backend_circuit_open Whether the backend's circuit breaker is open.\n# TYPE keel_backend_circuit_open gauge\n");
        for (b, _, o) in backends {
            let _ = writeln!(
                out,
                "keel_backend_circuit_open{{backend=\"{}\"}} {}",
                escape(b),
                *o as u8
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders() {
        let m = Metrics::new();
        let l = RequestLabels {
            route: "/v1/chat/completions",
            model: "chat",
            deployment: "blue",
            key: "key_1",
            code: 200,
        };
        m.request(l, Duration::from_millis(3), Some(Duration::from_millis(2)));
        m.tokens("chat", "blue", "key_1", 5, 7);
        let t = m.render(&[("http://b\"".into(), true, false)]);
        assert!(t.contains("keel_requests_total{route=\"/v1/chat/completions\",model=\"chat\",deployment=\"blue\",key=\"key_1\",code=\"200\"} 1"), "{t}");
        assert!(t.contains("keel_gateway_overhead_seconds_bucket{route=\"/v1/chat/completions\",model=\"chat\",deployment=\"blue\",le=\"0.001\"} 1"), "{t}");
        assert!(t.contains("keel_tokens_total{direction=\"out\",model=\"chat\",deployment=\"blue\",key=\"key_1\"} 7"));
        assert!(t.contains("keel_backend_healthy{backend=\"http://b\\\"\"} 1"));
    }

    #[test]
    fn series_are_told_apart_by_their_values() {
        let f: Family<AtomicU64> = Family::new("t", "t", &["a", "b"]);
        f.with(&["ab", "c"], |c| c.fetch_add(1, Ordering::Relaxed));
        f.with(&["a", "bc"], |c| c.fetch_add(2, Ordering::Relaxed));
        f.with(&["ab", "c"], |c| c.fetch_add(4, Ordering::Relaxed));
        assert_ne!(label_hash(&["ab", "c"]), label_hash(&["a", "bc"]));
        let rows: Vec<(Vec<String>, u64)> = f
            .rows()
            .into_iter()
            .map(|(k, v)| (k.to_vec(), v.load(Ordering::Relaxed)))
            .collect();
        assert_eq!(
            rows,
            vec![
                (vec!["a".to_owned(), "bc".to_owned()], 2),
                (vec!["ab".to_owned(), "c".to_owned()], 5)
            ]
        );
    }
}
