//! Where a request goes: models map to weighted deployments (blue/green,
//! canary), a header pins one, a share is mirrored to a shadow, and a
//! fallback chain names smaller models for when the primary cannot serve.
//! Each backend has a circuit breaker and a health flag fed by active
//! probes; retries draw on a budget so a failing fleet is not hammered.
//!
//! Time here is monotonic (`Instant`), passed in so the state machines are
//! tested without sleeping.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::{CircuitConfig, GatewayConfig, Protocol};
use crate::proxy::BackendUrl;

/// One backend server (a URL), shared by every deployment and config
/// generation that names it, so its circuit and health survive reloads.
#[derive(Debug)]
pub struct Backend {
    pub url: BackendUrl,
    pub healthy: AtomicBool,
    fails: AtomicU32,
    oks: AtomicU32,
    probing: AtomicBool,
    circuit: Mutex<Circuit>,
}

impl Backend {
    pub fn new(url: BackendUrl, cfg: &CircuitConfig) -> Self {
        Self {
            url,
            healthy: AtomicBool::new(true),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            circuit: Mutex::new(Circuit::new(cfg.clone())),
        }
    }

    fn circuit(&self) -> std::sync::MutexGuard<'_, Circuit> {
        self.circuit.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// May a request go to this backend now (healthy, circuit letting it)?
    /// A half-open circuit lets one trial request through.
    pub fn try_acquire(&self, now: Instant) -> Option<Permit> {
        if !self.healthy.load(Ordering::Relaxed) {
            return None;
        }
        self.circuit().allow(now)
    }

    /// Counts one attempt's result for `who` (the caller's identity).
    pub fn record(
        &self,
        now: Instant,
        ok: bool,
        retry_after: Option<Duration>,
        permit: Permit,
        who: &Arc<str>,
    ) {
        self.circuit().record(now, ok, retry_after, permit, who);
    }

    /// Whether an answer with this status counts against the circuit.
    pub fn is_failure(&self, status: u16) -> bool {
        self.circuit().is_failure(status)
    }

    /// When an open circuit lets a trial through again.
    pub fn open_until(&self, now: Instant) -> Option<Instant> {
        self.circuit().open_until(now)
    }

    pub fn state(&self, now: Instant) -> &'static str {
        self.circuit().state_name(now)
    }

    /// Gives back a half-open trial that ended without a result (the
    /// client went away), so the next request can be the trial.
    pub fn release_trial(&self) {
        self.circuit().release();
    }

    /// Marks the backend as having a probe task (true the first time).
    pub fn start_probing(&self) -> bool {
        !self.probing.swap(true, Ordering::Relaxed)
    }

    /// One probe result: `unhealthy_after` failures in a row mark it down,
    /// `healthy_after` successes mark it up.
    pub fn probe_result(&self, ok: bool, unhealthy_after: u32, healthy_after: u32) {
        if ok {
            self.fails.store(0, Ordering::Relaxed);
            let n = self.oks.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= healthy_after {
                self.healthy.store(true, Ordering::Relaxed);
            }
        } else {
            self.oks.store(0, Ordering::Relaxed);
            let n = self.fails.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= unhealthy_after {
                self.healthy.store(false, Ordering::Relaxed);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum CState {
    Closed,
    Open { until: Instant },
    HalfOpen { trial_out: bool },
}

/// A circuit breaker: failures (connection errors, timeouts and the
/// statuses in `failure_statuses`) over a sliding window of one-second
/// buckets; open for `trip_s` once at least `min_requests` were seen and
/// the failure ratio reached `failure_ratio`, or at once for as long as a
/// failure's `Retry-After` says (up to `max_retry_after_s`); in either
/// case only when the failures in the window came from at least
/// `min_identities` callers, so that one caller's input cannot open it for
/// everyone. Then one trial request decides between closed and open.
#[derive(Debug)]
pub struct Circuit {
    cfg: CircuitConfig,
    state: CState,
    buckets: VecDeque<(Instant, u32, u32)>,
    /// Callers whose requests failed, with their last failure, newest
    /// last; at most `MAX_FAILING` of them.
    failing: VecDeque<(Arc<str>, Instant)>,
}

/// How many failing callers a circuit remembers (at least the most
/// `min_identities` allows).
const MAX_FAILING: usize = 16;

/// What let a request through a circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// The circuit was closed.
    Closed,
    /// The one trial of a half-open circuit.
    Trial,
}

impl Circuit {
    pub fn new(cfg: CircuitConfig) -> Self {
        Self {
            cfg,
            state: CState::Closed,
            buckets: VecDeque::new(),
            failing: VecDeque::new(),
        }
    }

    /// Whether an answer with this status counts as a failure.
    pub fn is_failure(&self, status: u16) -> bool {
        self.cfg.failure_statuses.contains(&status)
    }

    /// Notes `who` failed now; returns how many callers failed within the
    /// window.
    fn failed_by(&mut self, now: Instant, who: &Arc<str>, window: Duration) -> usize {
        if let Some(i) = self.failing.iter().position(|(w, _)| w == who) {
            self.failing.remove(i);
        }
        self.failing.push_back((who.clone(), now));
        while self.failing.len() > MAX_FAILING {
            self.failing.pop_front();
        }
        self.failing
            .retain(|(_, t)| now.saturating_duration_since(*t) < window);
        self.failing.len()
    }

    pub fn allow(&mut self, now: Instant) -> Option<Permit> {
        match self.state {
            CState::Closed => Some(Permit::Closed),
            CState::Open { until } if now >= until => {
                self.state = CState::HalfOpen { trial_out: true };
                Some(Permit::Trial)
            }
            CState::Open { .. } => None,
            CState::HalfOpen { trial_out: false } => {
                self.state = CState::HalfOpen { trial_out: true };
                Some(Permit::Trial)
            }
            CState::HalfOpen { trial_out: true } => None,
        }
    }

    /// Counts a result. Only the trial's result decides a half-open
    /// circuit: a request let through before the trip, ending while the
    /// trial is out, is not counted.
    pub fn record(
        &mut self,
        now: Instant,
        ok: bool,
        retry_after: Option<Duration>,
        permit: Permit,
        who: &Arc<str>,
    ) {
        let trip = Duration::from_secs_f64(self.cfg.trip_s);
        let most = Duration::from_secs_f64(self.cfg.max_retry_after_s);
        let open_for = |ra: Option<Duration>| trip.max(ra.unwrap_or_default().min(most));
        match self.state {
            CState::HalfOpen { .. } if permit == Permit::Closed => return,
            CState::HalfOpen { .. } => {
                if ok {
                    self.state = CState::Closed;
                    self.buckets.clear();
                } else {
                    self.state = CState::Open {
                        until: now + open_for(retry_after),
                    };
                }
                return;
            }
            CState::Open { .. } => return,
            CState::Closed => {}
        }
        let window = Duration::from_secs(self.cfg.window_s);
        while self
            .buckets
            .front()
            .is_some_and(|b| now.duration_since(b.0) >= window)
        {
            self.buckets.pop_front();
        }
        match self.buckets.back_mut() {
            Some(b) if now.duration_since(b.0) < Duration::from_secs(1) => {
                if ok {
                    b.1 += 1
                } else {
                    b.2 += 1
                }
            }
            _ => self.buckets.push_back((now, ok as u32, (!ok) as u32)),
        }
        if ok {
            return;
        }
        let callers = self.failed_by(now, who, window);
        if callers < self.cfg.min_identities as usize {
            return;
        }
        // A backend that says when to come back is believed at once.
        if let Some(ra) = retry_after {
            self.state = CState::Open {
                until: now + open_for(Some(ra)),
            };
            return;
        }
        let (oks, fails) = self
            .buckets
            .iter()
            .fold((0u32, 0u32), |a, b| (a.0 + b.1, a.1 + b.2));
        let total = oks + fails;
        if total >= self.cfg.min_requests && fails as f64 >= self.cfg.failure_ratio * total as f64 {
            self.state = CState::Open { until: now + trip };
        }
    }

    pub fn release(&mut self) {
        if self.state == (CState::HalfOpen { trial_out: true }) {
            self.state = CState::HalfOpen { trial_out: false };
        }
    }

    pub fn open_until(&self, now: Instant) -> Option<Instant> {
        match self.state {
            CState::Open { until } if until > now => Some(until),
            _ => None,
        }
    }

    pub fn state_name(&self, now: Instant) -> &'static str {
        match self.state {
            CState::Closed => "closed",
            CState::Open { until } if until > now => "open",
            CState::Open { .. } | CState::HalfOpen { .. } => "half-open",
        }
    }
}

/// A deployment of a model: a backend and the model name it knows.
/// Cloning shares the strings (each request takes a few).
#[derive(Debug, Clone)]
pub struct Deployment {
    pub name: Arc<str>,
    pub backend_model: Arc<str>,
    pub weight: u32,
    pub backend: Arc<Backend>,
    pub health_path: Arc<str>,
    /// `name` as a response header value, when it can be one.
    pub name_header: Option<http::HeaderValue>,
}

#[derive(Debug)]
pub struct ModelRoute {
    pub name: Arc<str>,
    /// `name` as a response header value, when it can be one.
    pub name_header: Option<http::HeaderValue>,
    pub protocol: Protocol,
    /// Serving deployments (the mirror target excluded).
    pub deployments: Vec<Deployment>,
    /// Every deployment, for the pin header.
    pub all: Vec<Deployment>,
    pub fallback: Vec<String>,
    pub mirror: Option<(Deployment, f64)>,
    total_weight: u64,
    /// Indices of `deployments` by weight, heaviest first (ties in
    /// configuration order).
    by_weight: Vec<usize>,
}

/// One place a request may be sent.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub model: Arc<str>,
    pub model_header: Option<http::HeaderValue>,
    pub deployment: Deployment,
    pub fallback: bool,
}

/// A small, lock-free random source (splitmix64 over a counter) seeded by
/// the caller.
#[derive(Debug)]
pub struct Rng(AtomicU64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(AtomicU64::new(seed))
    }
    pub fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Retries allowed: `min` per 10 s plus `ratio` of the requests seen in
/// the last 10 s.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min: u32,
    window: Mutex<VecDeque<(Instant, u32, u32)>>,
}

impl RetryBudget {
    pub fn new(ratio: f64, min: u32) -> Self {
        Self {
            ratio,
            min,
            window: Mutex::new(VecDeque::new()),
        }
    }

    fn bump(&self, now: Instant, req: u32, retry: u32) -> (u32, u32) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        while w
            .front()
            .is_some_and(|b| now.duration_since(b.0) >= Duration::from_secs(10))
        {
            w.pop_front();
        }
        match w.back_mut() {
            Some(b) if now.duration_since(b.0) < Duration::from_secs(1) => {
                b.1 += req;
                b.2 += retry;
            }
            _ => w.push_back((now, req, retry)),
        }
        w.iter().fold((0, 0), |a, b| (a.0 + b.1, a.1 + b.2))
    }

    pub fn record_request(&self, now: Instant) {
        self.bump(now, 1, 0);
    }

    /// Takes one retry from the budget if there is one.
    #[cfg(test)]
    pub fn try_retry(&self, now: Instant) -> bool {
        if self.has_retry(now) {
            self.bump(now, 0, 1);
            true
        } else {
            false
        }
    }

    /// Whether a retry is available, without taking it.
    pub fn has_retry(&self, now: Instant) -> bool {
        let (reqs, retries) = self.bump(now, 0, 0);
        (retries as f64) < self.min as f64 + self.ratio * reqs as f64
    }

    pub fn take_retry(&self, now: Instant) {
        self.bump(now, 0, 1);
    }
}

/// The routing table of one configuration generation.
#[derive(Debug)]
pub struct Traffic {
    pub models: HashMap<String, Arc<ModelRoute>>,
    pub backends: HashMap<String, Arc<Backend>>,
}

impl Traffic {
    /// Builds the table, reusing the backends (with their circuit and
    /// health state) of `previous` that are still named.
    pub fn build(cfg: &GatewayConfig, previous: Option<&Traffic>) -> Self {
        let mut backends: HashMap<String, Arc<Backend>> = HashMap::new();
        let mut models = HashMap::new();
        for m in &cfg.models {
            let mut all = Vec::new();
            for d in &m.deployments {
                let b = backends
                    .entry(d.url.clone())
                    .or_insert_with(|| {
                        previous
                            .and_then(|p| p.backends.get(&d.url).cloned())
                            .unwrap_or_else(|| {
                                Arc::new(Backend::new(
                                    BackendUrl::parse(&d.url).expect("validated"),
                                    &cfg.traffic.circuit,
                                ))
                            })
                    })
                    .clone();
                all.push(Deployment {
                    name: Arc::from(d.name.as_str()),
                    backend_model: Arc::from(d.model.as_str()),
                    weight: d.weight,
                    backend: b,
                    health_path: Arc::from(d.health_path.as_str()),
                    name_header: http::HeaderValue::from_str(&d.name).ok(),
                });
            }
            let mirror_name = m.mirror.as_ref().map(|mi| mi.deployment.as_str());
            let deployments: Vec<Deployment> = all
                .iter()
                .filter(|d| Some(&*d.name) != mirror_name)
                .cloned()
                .collect();
            let mirror = m.mirror.as_ref().and_then(|mi| {
                all.iter()
                    .find(|d| *d.name == *mi.deployment)
                    .map(|d| (d.clone(), mi.percent))
            });
            let total_weight = deployments.iter().map(|d| d.weight as u64).sum();
            let mut by_weight: Vec<usize> = (0..deployments.len()).collect();
            by_weight.sort_by_key(|&i| std::cmp::Reverse(deployments[i].weight));
            models.insert(
                m.name.clone(),
                Arc::new(ModelRoute {
                    name: Arc::from(m.name.as_str()),
                    name_header: http::HeaderValue::from_str(&m.name).ok(),
                    protocol: m.protocol,
                    deployments,
                    all,
                    fallback: m.fallback.clone(),
                    mirror,
                    total_weight,
                    by_weight,
                }),
            );
        }
        Self { models, backends }
    }

    /// Where to try, in order: the pinned deployment alone; else a weighted
    /// pick among the primary's deployments, then its others by weight,
    /// then each fallback model the same way. Deployments the caller cannot
    /// use now (circuit open, unhealthy) are filtered when tried.
    pub fn candidates(
        &self,
        model: &ModelRoute,
        pin: Option<&str>,
        rng: &Rng,
    ) -> Result<Vec<Candidate>, String> {
        if let Some(p) = pin {
            let d = model.all.iter().find(|d| *d.name == *p).ok_or_else(|| {
                format!(
                    "model {:?} has no deployment {:?}",
                    model.name,
                    crate::error::reflect(p)
                )
            })?;
            return Ok(vec![Candidate {
                model: model.name.clone(),
                model_header: model.name_header.clone(),
                deployment: d.clone(),
                fallback: false,
            }]);
        }
        let fallbacks = model.fallback.iter().filter_map(|f| self.models.get(f));
        let n = model.deployments.len()
            + fallbacks
                .clone()
                .map(|m| m.deployments.len())
                .sum::<usize>();
        let mut out = Vec::with_capacity(n);
        push_weighted(&mut out, model, rng, false);
        for fm in fallbacks {
            push_weighted(&mut out, fm, rng, true);
        }
        Ok(out)
    }
}

/// A weighted pick among the model's deployments, then the others by
/// weight.
fn push_weighted(out: &mut Vec<Candidate>, m: &ModelRoute, rng: &Rng, fallback: bool) {
    let push = |out: &mut Vec<Candidate>, d: &Deployment| {
        out.push(Candidate {
            model: m.name.clone(),
            model_header: m.name_header.clone(),
            deployment: d.clone(),
            fallback,
        })
    };
    let mut first = None;
    if m.total_weight > 0 {
        let mut x = (rng.unit() * m.total_weight as f64) as u64;
        first = m.deployments.iter().position(|d| {
            if x < d.weight as u64 {
                true
            } else {
                x -= d.weight as u64;
                false
            }
        });
    }
    if let Some(i) = first {
        push(out, &m.deployments[i]);
    }
    for &i in &m.by_weight {
        if Some(i) != first {
            push(out, &m.deployments[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CircuitConfig {
        CircuitConfig {
            window_s: 10,
            min_requests: 4,
            failure_ratio: 0.5,
            trip_s: 5.0,
            min_identities: 1,
            ..CircuitConfig::default()
        }
    }

    fn who(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    use Permit::{Closed, Trial};

    #[test]
    fn circuit_opens_half_opens_and_closes() {
        let t0 = Instant::now();
        let mut c = Circuit::new(cfg());
        for i in 0..3 {
            assert_eq!(c.allow(t0), Some(Closed));
            c.record(t0, i == 0, None, Closed, &who("a"));
        }
        assert_eq!(
            c.state_name(t0),
            "closed",
            "3 requests are below min_requests"
        );
        c.record(t0, false, None, Closed, &who("a"));
        assert_eq!(c.state_name(t0), "open");
        assert_eq!(c.allow(t0 + Duration::from_secs(4)), None);
        let t5 = t0 + Duration::from_secs(5);
        assert_eq!(c.allow(t5), Some(Trial), "one trial after the trip");
        assert_eq!(c.allow(t5), None, "only one");
        c.record(t5, false, None, Trial, &who("a"));
        assert_eq!(c.allow(t5 + Duration::from_secs(1)), None);
        let t10 = t5 + Duration::from_secs(5);
        assert_eq!(c.allow(t10), Some(Trial));
        c.record(t10, true, None, Trial, &who("a"));
        assert_eq!(c.state_name(t10), "closed");
        assert_eq!(c.allow(t10), Some(Closed));
    }

    #[test]
    fn only_the_trial_decides_or_frees_a_half_open_circuit() {
        let t0 = Instant::now();
        let mut c = Circuit::new(cfg());
        c.record(t0, false, Some(Duration::from_secs(5)), Closed, &who("a"));
        let t5 = t0 + Duration::from_secs(5);
        assert_eq!(c.allow(t5), Some(Trial));
        // A request let through before the trip ends while the trial is out:
        // neither its success nor its failure decides.
        c.record(t5, true, None, Closed, &who("a"));
        c.record(t5, false, None, Closed, &who("a"));
        assert_eq!(c.state_name(t5), "half-open");
        assert_eq!(c.allow(t5), None, "the trial is still out");
        c.record(t5, true, None, Trial, &who("a"));
        assert_eq!(c.state_name(t5), "closed");
    }

    #[test]
    fn retry_after_is_honoured_up_to_its_cap() {
        let t0 = Instant::now();
        let mut c = Circuit::new(cfg());
        c.record(t0, false, Some(Duration::from_secs(20)), Closed, &who("a"));
        assert_eq!(c.allow(t0 + Duration::from_secs(19)), None);
        assert_eq!(c.allow(t0 + Duration::from_secs(20)), Some(Trial));
        // 300 s asked for, 30 s (max_retry_after_s) kept.
        let mut c = Circuit::new(cfg());
        c.record(t0, false, Some(Duration::from_secs(300)), Closed, &who("a"));
        assert_eq!(c.allow(t0 + Duration::from_secs(29)), None);
        assert_eq!(c.allow(t0 + Duration::from_secs(30)), Some(Trial));
    }

    #[test]
    fn one_callers_failures_do_not_open_the_circuit_alone() {
        let t0 = Instant::now();
        let cfg = CircuitConfig {
            min_identities: 2,
            ..cfg()
        };
        let mut c = Circuit::new(cfg.clone());
        for _ in 0..20 {
            c.record(t0, false, None, Closed, &who("mallory"));
        }
        c.record(
            t0,
            false,
            Some(Duration::from_secs(10)),
            Closed,
            &who("mallory"),
        );
        assert_eq!(c.state_name(t0), "closed", "one caller, however often");
        c.record(t0, false, None, Closed, &who("alice"));
        assert_eq!(c.state_name(t0), "open", "two callers failed");
        // A second caller's failure that has left the window does not count.
        let mut c = Circuit::new(cfg.clone());
        c.record(t0, false, None, Closed, &who("alice"));
        let later = t0 + Duration::from_secs(10);
        for _ in 0..5 {
            c.record(later, false, None, Closed, &who("mallory"));
        }
        assert_eq!(c.state_name(later), "closed");
        // Which answers count is configured; 500 and 429 are not by default.
        assert!(c.is_failure(503) && c.is_failure(502) && c.is_failure(504));
        assert!(!c.is_failure(500) && !c.is_failure(429));
        let mut c = Circuit::new(CircuitConfig {
            min_identities: 16,
            ..cfg
        });
        for i in 0..15 {
            c.record(t0, false, None, Closed, &who(&format!("caller-{i}")));
        }
        assert_eq!(c.state_name(t0), "closed");
        c.record(t0, false, None, Closed, &who("caller-15"));
        assert_eq!(c.state_name(t0), "open", "16 callers");
    }

    #[test]
    fn old_failures_leave_the_window() {
        let t0 = Instant::now();
        let mut c = Circuit::new(cfg());
        for _ in 0..3 {
            c.record(t0, false, None, Closed, &who("a"));
        }
        let later = t0 + Duration::from_secs(11);
        c.record(later, false, None, Closed, &who("a"));
        assert_eq!(c.state_name(later), "closed");
    }

    #[test]
    fn retry_budget() {
        let t0 = Instant::now();
        let b = RetryBudget::new(0.5, 1);
        assert!(b.try_retry(t0));
        assert!(!b.try_retry(t0));
        for _ in 0..4 {
            b.record_request(t0);
        }
        assert!(b.try_retry(t0));
        assert!(b.try_retry(t0));
        assert!(!b.try_retry(t0));
        assert!(b.try_retry(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn candidates_are_the_pick_then_the_rest_by_weight_then_the_fallback() {
        let text = r#"
[auth]
keys_file = "k"
[[models]]
name = "m"
fallback = ["small"]
[[models.deployments]]
name = "a"
url = "http://127.0.0.1:1"
weight = 10
[[models.deployments]]
name = "b"
url = "http://127.0.0.1:2"
weight = 60
[[models.deployments]]
name = "c"
url = "http://127.0.0.1:3"
weight = 30
[[models]]
name = "small"
[[models.deployments]]
name = "s"
url = "http://127.0.0.1:4"
"#;
        let c = GatewayConfig::from_toml(text, std::path::Path::new("/")).expect("config");
        let t = Traffic::build(&c, None);
        let m = t.models["m"].clone();
        let rng = Rng::new(7);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..200 {
            let c = t.candidates(&m, None, &rng).expect("ok");
            let names: Vec<(&str, &str, bool)> = c
                .iter()
                .map(|c| (&*c.model, &*c.deployment.name, c.fallback))
                .collect();
            let (first, rest) = (names[0].1, &names[1..]);
            firsts.insert(first.to_owned());
            let by_weight: Vec<(&str, &str, bool)> = ["b", "c", "a"]
                .into_iter()
                .filter(|d| *d != first)
                .map(|d| ("m", d, false))
                .chain([("small", "s", true)])
                .collect();
            assert_eq!(rest, by_weight.as_slice());
            assert_eq!(
                c[0].model_header.as_ref().map(|h| h.as_bytes()),
                Some(&b"m"[..])
            );
        }
        assert_eq!(
            firsts.len(),
            3,
            "every deployment is picked first sometimes"
        );
    }

    #[test]
    fn weighted_pick_is_within_tolerance() {
        let text = r#"
[auth]
keys_file = "k"
[[models]]
name = "m"
[[models.deployments]]
name = "blue"
url = "http://127.0.0.1:1"
weight = 80
[[models.deployments]]
name = "green"
url = "http://127.0.0.1:2"
weight = 20
"#;
        let c = GatewayConfig::from_toml(text, std::path::Path::new("/")).expect("config");
        let t = Traffic::build(&c, None);
        let m = t.models["m"].clone();
        let rng = Rng::new(42);
        let n = 10_000;
        let blue = (0..n)
            .filter(|_| {
                t.candidates(&m, None, &rng).expect("ok")[0]
                    .deployment
                    .name
                    .as_ref()
                    == "blue"
            })
            .count();
        // Binomial(10000, 0.8): sd 40; 5 sd either side.
        assert!((7800..=8200).contains(&blue), "{blue}");
        let c = t.candidates(&m, Some("green"), &rng).expect("ok");
        assert_eq!(c.len(), 1);
        assert!(t.candidates(&m, Some("nope"), &rng).is_err());
    }
}
