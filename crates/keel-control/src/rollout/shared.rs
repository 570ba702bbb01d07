//! Rollouts shared by the gateway replicas through Redis
//! (`registry.rollout_store = "redis"`, the Redis of `limits.redis_url`).
//!
//! - **One state.** A model's rollout is one record in Redis
//!   (`keel:rollout:rec:MODEL`, a hash of the record's JSON, the same as a
//!   state file's entry, and a revision number). Every change is a
//!   compare-and-set on the revision (one Lua script), so two replicas
//!   never both move a rollout from the same state: the second is told
//!   the rollout changed under it (HTTP 409) and nothing of its change is
//!   kept. `start`, `pause`, `abort` and `status` work on any replica and
//!   read or change that record.
//! - **One driver.** A replica drives a rollout's steps (its analysis,
//!   its new weights, its alias changes) only while it holds the model's
//!   lease (`keel:rollout:lease:MODEL`, `SET NX PX registry.rollout_lease_ms`,
//!   renewed every third of it). Every replica tries to take a free lease
//!   while a rollout needs a driver, so when the driver dies (`kill -9`)
//!   another one takes over within the lease plus one sync period, reads
//!   the record and goes on at the same step, with the step's samples so
//!   far. A driver writes its verdicts only while it still holds the lease
//!   (checked in the same script as the revision).
//! - **One weight.** Every replica reads the record every sync period
//!   (a fifth of the lease, 100 ms to 1 s) and applies its canary weight:
//!   the step's weight while in progress or paused, 0 after an abort, 100
//!   after a promotion until its own follower routes the stable alias to
//!   the promoted version, then 0.
//! - **Pooled samples.** Each replica pushes the samples it took of the
//!   stable and canary deployments into Redis lists per rollout, step and
//!   deployment (`keel:rollout:samples:ID:STEP:DEPLOYMENT:MODEL`, at most
//!   [`keel_gateway::MAX_SAMPLES`] each, kept a day), tagged with the
//!   step whose weight it applied when it served them; the driver analyses
//!   every replica's samples of the step.
//!
//! Audit events are written by the replica that made the change, in its
//! own audit log.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_canary::analysis::{FinishReason, Sample};
use keel_canary::rollout::{Action, Phase};
use serde_json::{json, Map, Value};

use super::{audit, lock, note_end, record, run_from_record, Record, RolloutError, Rollouts, Run};
use keel_gateway::redis::{RedisClient, RedisError, Reply};
use keel_gateway::Gateway;

/// What a replica needs to share its rollouts.
#[derive(Debug)]
pub(super) struct Shared {
    redis: RedisClient,
    /// This replica's id in leases and in `status` (`driver`).
    pub(super) replica: String,
    lease_ms: u64,
    /// The models this replica drives now.
    driving: Mutex<HashSet<String>>,
    /// Per model, the rollout id and step whose weight this replica
    /// applied last: the samples it takes are pushed under them.
    pub(super) applied: Mutex<HashMap<String, (String, usize)>>,
    /// Whether the last read of Redis failed (logged once per run).
    failing: AtomicBool,
}

/// Sets a record if its revision is still the expected one (and, for a
/// driver, while it holds the lease). KEYS: record, lease. ARGV: the
/// expected revision, the record's JSON, the replica that must hold the
/// lease (empty: none). Returns the new revision, -1 when the revision
/// moved, -2 when the lease is not the replica's.
const CAS: &str = r"
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return -2 end
local rev = tonumber(redis.call('HGET', KEYS[1], 'rev') or '0')
if rev ~= tonumber(ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], 'rev', rev + 1, 'doc', ARGV[2])
return rev + 1
";

/// Takes a free lease or renews one's own. KEYS: lease. ARGV: replica,
/// milliseconds. Returns 1 when the replica holds it.
const LEASE: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// Gives a lease back if it is the replica's. KEYS: lease. ARGV: replica.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// Appends samples, keeps the newest ARGV[1] and the list for ARGV[2] ms.
const PUSH: &str = r"
redis.call('RPUSH', KEYS[1], unpack(ARGV, 3))
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// How long pooled samples are kept after their last push.
const SAMPLES_TTL_MS: u64 = 24 * 3600 * 1000;
/// Samples pushed in one script call (Lua's `unpack` has a stack limit).
const PUSH_BATCH: usize = 1000;
/// An ended rollout whose first alias-change try left no answer this long
/// (its replica died before it) is tried by the driver.
const ORPHANED_CHANGE_MS: u64 = 30_000;

fn rec_key(model: &str) -> String {
    format!("keel:rollout:rec:{model}")
}

fn lease_key(model: &str) -> String {
    format!("keel:rollout:lease:{model}")
}

fn samples_key(model: &str, id: &str, step: usize, deployment: &str) -> String {
    format!("keel:rollout:samples:{id}:{step}:{deployment}:{model}")
}

/// One sample as a line: error, latency, completion tokens, finish
/// reason (`s`, `l`, `o`), answer characters, streamed, stream aborted,
/// output mean; `-` for an unknown value.
pub(super) fn encode(s: &Sample) -> String {
    fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
        v.map_or_else(|| "-".to_owned(), |v| v.to_string())
    }
    let fin = s.finish_reason.map(|f| match f {
        FinishReason::Stop => "s",
        FinishReason::Length => "l",
        FinishReason::Other => "o",
    });
    format!(
        "{}|{}|{}|{}|{}|{}|{}|{}",
        u8::from(s.error),
        opt(s.latency_ms),
        opt(s.completion_tokens),
        opt(fin),
        opt(s.answer_chars),
        u8::from(s.streamed),
        u8::from(s.stream_aborted),
        opt(s.output_mean)
    )
}

/// [`encode`]'s line back; `None` for anything else.
pub(super) fn decode(line: &str) -> Option<Sample> {
    let f: Vec<&str> = line.split('|').collect();
    let [e, lat, tok, fin, chars, streamed, aborted, mean] = f[..] else {
        return None;
    };
    fn opt<T: std::str::FromStr>(s: &str) -> Option<Option<T>> {
        if s == "-" {
            Some(None)
        } else {
            s.parse().ok().map(Some)
        }
    }
    let flag = |s: &str| match s {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    };
    let finish_reason = match fin {
        "-" => None,
        "s" => Some(FinishReason::Stop),
        "l" => Some(FinishReason::Length),
        "o" => Some(FinishReason::Other),
        _ => return None,
    };
    let finite = |v: Option<f64>| v.is_none_or(f64::is_finite);
    let latency_ms = opt::<f64>(lat)?;
    let output_mean = opt::<f64>(mean)?;
    if !finite(latency_ms) || !finite(output_mean) {
        return None;
    }
    Some(Sample {
        error: flag(e)?,
        latency_ms,
        completion_tokens: opt(tok)?,
        finish_reason,
        answer_chars: opt(chars)?,
        streamed: flag(streamed)?,
        stream_aborted: flag(aborted)?,
        output_mean,
    })
}

fn store_err(e: RedisError) -> RolloutError {
    RolloutError::Store {
        reason: e.to_string(),
    }
}

impl Shared {
    pub(super) fn new(url: &str, replica: &str, lease_ms: u64) -> Result<Self, RolloutError> {
        let redis = RedisClient::new(url).map_err(|e| RolloutError::Store {
            reason: e.to_string(),
        })?;
        Ok(Shared {
            redis,
            replica: replica.to_owned(),
            lease_ms,
            driving: Mutex::new(HashSet::new()),
            applied: Mutex::new(HashMap::new()),
            failing: AtomicBool::new(false),
        })
    }

    /// How often every replica reads the records.
    fn sync_every(&self) -> Duration {
        Duration::from_millis((self.lease_ms / 5).clamp(100, 1000))
    }

    async fn eval(&self, script: &str, keys: &[&str], args: &[&str]) -> Result<Reply, RedisError> {
        let n = keys.len().to_string();
        let mut argv: Vec<&[u8]> = vec![b"EVAL", script.as_bytes(), n.as_bytes()];
        argv.extend(keys.iter().map(|k| k.as_bytes()));
        argv.extend(args.iter().map(|a| a.as_bytes()));
        match self.redis.command(&argv).await? {
            Reply::Error(e) => Err(RedisError::Server(e)),
            r => Ok(r),
        }
    }

    async fn int(&self, script: &str, keys: &[&str], args: &[&str]) -> Result<i64, RedisError> {
        match self.eval(script, keys, args).await? {
            Reply::Int(i) => Ok(i),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    /// The record of `model` and its revision.
    async fn get(&self, model: &str) -> Result<Option<(u64, Vec<u8>)>, RedisError> {
        let key = rec_key(model);
        match self
            .redis
            .command(&[b"HMGET", key.as_bytes(), b"rev", b"doc"])
            .await?
        {
            Reply::Array(Some(items)) => match &items[..] {
                [Reply::Bulk(Some(rev)), Reply::Bulk(Some(doc))] => {
                    let rev = std::str::from_utf8(rev)
                        .ok()
                        .and_then(|r| r.parse().ok())
                        .ok_or_else(|| {
                            RedisError::Protocol("a revision that is not a number".into())
                        })?;
                    Ok(Some((rev, doc.clone())))
                }
                [Reply::Bulk(None), Reply::Bulk(None)] => Ok(None),
                other => Err(RedisError::Protocol(format!("{other:?}"))),
            },
            Reply::Error(e) => Err(RedisError::Server(e)),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    /// Takes or renews `model`'s lease; whether this replica holds it.
    async fn acquire(&self, model: &str) -> Result<bool, RedisError> {
        let ms = self.lease_ms.to_string();
        Ok(self
            .int(LEASE, &[&lease_key(model)], &[&self.replica, &ms])
            .await?
            == 1)
    }

    async fn release(&self, model: &str) {
        let _ = self
            .int(RELEASE, &[&lease_key(model)], &[&self.replica])
            .await;
    }

    /// The replica holding `model`'s lease.
    async fn holder(&self, model: &str) -> Result<Option<String>, RedisError> {
        let key = lease_key(model);
        match self.redis.command(&[b"GET", key.as_bytes()]).await? {
            Reply::Bulk(b) => Ok(b.map(|b| String::from_utf8_lossy(&b).into_owned())),
            Reply::Error(e) => Err(RedisError::Server(e)),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    async fn push_samples(&self, key: &str, samples: &[Sample]) -> Result<(), RedisError> {
        let cap = keel_gateway::MAX_SAMPLES.to_string();
        let ttl = SAMPLES_TTL_MS.to_string();
        for chunk in samples.chunks(PUSH_BATCH) {
            let lines: Vec<String> = chunk.iter().map(encode).collect();
            let mut args: Vec<&str> = vec![&cap, &ttl];
            args.extend(lines.iter().map(String::as_str));
            self.int(PUSH, &[key], &args).await?;
        }
        Ok(())
    }

    async fn samples(&self, key: &str) -> Result<Vec<Sample>, RedisError> {
        match self
            .redis
            .command(&[b"LRANGE", key.as_bytes(), b"0", b"-1"])
            .await?
        {
            Reply::Array(Some(items)) => Ok(items
                .into_iter()
                .filter_map(|r| match r {
                    Reply::Bulk(Some(b)) => std::str::from_utf8(&b).ok().and_then(decode),
                    _ => None,
                })
                .collect()),
            Reply::Array(None) => Ok(Vec::new()),
            Reply::Error(e) => Err(RedisError::Server(e)),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    async fn count(&self, key: &str) -> Result<u64, RedisError> {
        match self.redis.command(&[b"LLEN", key.as_bytes()]).await? {
            Reply::Int(n) => Ok(n.max(0) as u64),
            Reply::Error(e) => Err(RedisError::Server(e)),
            other => Err(RedisError::Protocol(format!("{other:?}"))),
        }
    }

    async fn drop_step(&self, model: &str, id: &str, step: usize, deployments: &[String]) {
        for d in deployments {
            let key = samples_key(model, id, step, d);
            let _ = self.redis.command(&[b"DEL", key.as_bytes()]).await;
        }
    }
}

/// The stable and canary deployments of a run, its id and step.
fn tags(r: &Run) -> (String, usize, String, String) {
    (
        r.rollout.id.clone(),
        r.rollout.step,
        format!("v{}", r.stable_version),
        format!("v{}", r.canary_version),
    )
}

impl Rollouts {
    pub(super) fn shared(&self) -> Option<&Shared> {
        self.0.shared.as_ref()
    }

    /// Reads `model`'s record from Redis into the cached run (same
    /// identity, new contents when the revision moved); `None` when the
    /// model has no rollout.
    pub(super) async fn pull(
        &self,
        model: &str,
    ) -> Result<Option<Arc<std::sync::Mutex<Run>>>, RolloutError> {
        let Some(sh) = self.shared() else {
            return Ok(self.run(model).ok());
        };
        let got = sh.get(model).await.map_err(store_err)?;
        let Some((rev, doc)) = got else {
            lock(&self.0.runs).remove(model);
            return Ok(None);
        };
        let cached = lock(&self.0.runs).get(model).cloned();
        if let Some(c) = &cached {
            if lock(c).rev == rev {
                return Ok(cached);
            }
        }
        let rec: Record = serde_json::from_slice(&doc).map_err(|e| RolloutError::Store {
            reason: format!("the rollout record of model {model:?} is not what keel writes: {e}"),
        })?;
        let mut run = run_from_record(rec).map_err(|reason| RolloutError::Store { reason })?;
        run.rev = rev;
        match cached {
            Some(c) => {
                *lock(&c) = run;
                Ok(Some(c))
            }
            None => {
                let a = Arc::new(Mutex::new(run));
                lock(&self.0.runs).insert(model.to_owned(), a.clone());
                Ok(Some(a))
            }
        }
    }

    /// Writes `run` to Redis if its revision is still the one it was read
    /// at (and, `as_driver`, while this replica holds the lease); `false`
    /// when another change came first (nothing is written).
    pub(super) async fn push(
        &self,
        run: &Arc<Mutex<Run>>,
        as_driver: bool,
    ) -> Result<bool, RolloutError> {
        let Some(sh) = self.shared() else {
            self.save();
            return Ok(true);
        };
        let (model, rev, doc) = {
            let r = lock(run);
            let doc = serde_json::to_string(&record(&r)).unwrap_or_default();
            (r.model.clone(), r.rev, doc)
        };
        let fence = if as_driver { sh.replica.as_str() } else { "" };
        let rev_s = rev.to_string();
        let n = sh
            .int(
                CAS,
                &[&rec_key(&model), &lease_key(&model)],
                &[&rev_s, &doc, fence],
            )
            .await
            .map_err(store_err)?;
        if n < 0 {
            return Ok(false);
        }
        lock(run).rev = n as u64;
        Ok(true)
    }

    /// [`Rollouts::push`] for an operator's change: a lost race is
    /// [`RolloutError::Changed`].
    pub(super) async fn commit(&self, run: &Arc<Mutex<Run>>) -> Result<(), RolloutError> {
        if self.push(run, false).await? {
            return Ok(());
        }
        let model = lock(run).model.clone();
        // The cache holds the change that was not made: read the record again.
        if let Some(c) = lock(&self.0.runs).get(&model) {
            lock(c).rev = u64::MAX;
        }
        let _ = self.pull(&model).await;
        Err(RolloutError::Changed { model })
    }

    /// What `status` adds with a shared store: the driving replica and the
    /// step's pooled samples.
    pub(super) async fn shared_status(&self, run: &Arc<Mutex<Run>>, s: &mut Value) {
        let Some(sh) = self.shared() else {
            return;
        };
        let (model, (id, step, sv, cv)) = {
            let r = lock(run);
            (r.model.clone(), tags(&r))
        };
        let driver = sh.holder(&model).await.ok().flatten();
        let stable = sh.count(&samples_key(&model, &id, step, &sv)).await.ok();
        let canary = sh.count(&samples_key(&model, &id, step, &cv)).await.ok();
        s["store"] = "redis".into();
        s["driver"] = json!(driver);
        s["samples"] = json!({"stable": stable, "canary": canary});
    }

    /// Pushes this replica's samples of `model` taken since the last time,
    /// under the step it applied.
    async fn flush(&self, gw: &Gateway, model: &str, stable: &str, canary: &str) {
        let Some(sh) = self.shared() else {
            return;
        };
        let Some(windows) = gw.samples().take(model) else {
            return;
        };
        let Some((id, step)) = lock(&sh.applied).get(model).cloned() else {
            return;
        };
        for (d, w) in windows {
            if (d == stable || d == canary) && !w.samples.is_empty() {
                if let Err(e) = sh
                    .push_samples(&samples_key(model, &id, step, &d), &w.samples)
                    .await
                {
                    tracing::warn!(model = %model, error = %e, "the rollout's samples could not be pooled in Redis");
                }
            }
        }
    }

    /// Every replica's loop: applies every rollout's weight, pools its
    /// samples, and takes the lease of a rollout that needs a driver.
    pub(super) async fn sync(self, gw: Gateway) {
        let Some(sh) = self.shared() else {
            return;
        };
        let mut tick = tokio::time::interval(sh.sync_every());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for f in self.0.follows.clone() {
                self.sync_one(&gw, &f).await;
            }
        }
    }

    async fn sync_one(&self, gw: &Gateway, f: &crate::registry_follow::Follow) {
        let Some(sh) = self.shared() else {
            return;
        };
        let model = &f.model;
        let run = match self.pull(model).await {
            Ok(r) => {
                if sh.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("the rollouts' Redis answers again");
                }
                r
            }
            Err(e) => {
                if !sh.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %super::chain(&e), "cannot read the rollouts in Redis: the canary weights stay as they are");
                }
                return;
            }
        };
        let Some(run) = run else {
            if f.canary_percent.swap(0, Ordering::SeqCst) != 0 {
                self.0.wake.notify_one();
            }
            gw.samples().unwatch(model);
            return;
        };
        let (phase, weight, pending, canary_version, (id, step, sv, cv)) = {
            let r = lock(&run);
            (
                r.rollout.phase,
                r.rollout.weight(),
                r.registry_pending,
                r.canary_version,
                tags(&r),
            )
        };
        let want = match phase {
            Phase::Progressing | Phase::Paused => weight,
            Phase::Aborted => 0,
            Phase::Promoted => {
                if pending || f.applied_stable.load(Ordering::SeqCst) != canary_version {
                    100
                } else {
                    0
                }
            }
        };
        // The samples served under the weight applied so far, then the
        // record's weight and step.
        self.flush(gw, model, &sv, &cv).await;
        if phase == Phase::Progressing {
            gw.samples().watch(model);
            lock(&sh.applied).insert(model.clone(), (id, step));
        } else {
            gw.samples().unwatch(model);
            lock(&sh.applied).remove(model);
        }
        if f.canary_percent.swap(want, Ordering::SeqCst) != want {
            self.0.wake.notify_one();
        }
        let needs_driver = matches!(phase, Phase::Progressing | Phase::Paused) || pending;
        if needs_driver && !lock(&sh.driving).contains(model) {
            self.try_drive(gw, model).await;
        }
    }

    /// Takes `model`'s lease if it is free and drives the rollout.
    pub(super) async fn try_drive(&self, gw: &Gateway, model: &str) {
        let Some(sh) = self.shared() else {
            return;
        };
        if lock(&sh.driving).contains(model) {
            return;
        }
        match sh.acquire(model).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(model = %model, error = %e, "cannot take the rollout's lease");
                return;
            }
        }
        if !lock(&sh.driving).insert(model.to_owned()) {
            return;
        }
        let me = self.clone();
        let gw = gw.clone();
        let model = model.to_owned();
        tokio::spawn(async move {
            me.drive_shared(&gw, &model).await;
            if let Some(sh) = me.shared() {
                lock(&sh.driving).remove(&model);
                sh.release(&model).await;
            }
        });
    }

    /// The driver's loop, while this replica holds `model`'s lease.
    async fn drive_shared(&self, gw: &Gateway, model: &str) {
        let Some(sh) = self.shared() else {
            return;
        };
        let Ok(Some(run)) = self.pull(model).await else {
            return;
        };
        let (interval_s, phase) = {
            let r = lock(&run);
            (r.interval_s, r.rollout.phase)
        };
        tracing::info!(model = %model, replica = %sh.replica, "this replica drives the rollout");
        {
            let r = lock(&run);
            let mut m = Map::new();
            m.insert("replica".into(), sh.replica.clone().into());
            m.insert("phase".into(), json!(phase));
            m.insert("step".into(), r.rollout.step.into());
            m.insert("weight".into(), r.rollout.weight().into());
            audit(gw, "rollout_drive", &r, m);
        }
        // A replica taking over checks the aliases first, as a gateway
        // restarting does.
        if matches!(phase, Phase::Progressing | Phase::Paused) {
            if let Err(why) = self.check_aliases(&run).await {
                let stopped = {
                    let mut r = lock(&run);
                    match r.rollout.stop(&why) {
                        Ok(reason) => {
                            r.end_reason = Some(reason.clone());
                            r.ended_ms = Some(gw.now_ms());
                            Some(reason)
                        }
                        Err(_) => None,
                    }
                };
                if let Some(reason) = stopped {
                    if self.push(&run, true).await.unwrap_or(false) {
                        let r = lock(&run);
                        let mut m = Map::new();
                        m.insert("weight".into(), 0.into());
                        m.insert("reason".into(), reason.clone().into());
                        audit(gw, "rollout_stop", &r, m);
                        tracing::warn!(model = %model, %reason, "rollout stopped: its aliases changed");
                    }
                }
                return;
            }
        }
        let every = Duration::from_secs(interval_s.max(1));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut renew = tokio::time::interval(Duration::from_millis(sh.lease_ms / 3));
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut wait = Duration::from_secs(1);
        let mut next_try = tokio::time::Instant::now();
        loop {
            let analyse = tokio::select! {
                _ = tick.tick() => true,
                _ = renew.tick() => false,
            };
            match sh.acquire(model).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(model = %model, replica = %sh.replica, "this replica lost the rollout's lease: another drives it");
                    return;
                }
                // Redis unreachable: the lease may lapse; try again.
                Err(_) => continue,
            }
            let run = match self.pull(model).await {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(_) => continue,
            };
            let (phase, pending, tried, ended_ms) = {
                let r = lock(&run);
                (
                    r.rollout.phase,
                    r.registry_pending,
                    r.registry.is_some(),
                    r.ended_ms,
                )
            };
            match phase {
                Phase::Aborted | Phase::Promoted => {
                    if !pending {
                        return;
                    }
                    let orphaned = ended_ms
                        .is_none_or(|t| gw.now_ms().saturating_sub(t) >= ORPHANED_CHANGE_MS);
                    if (tried || orphaned) && tokio::time::Instant::now() >= next_try {
                        let action = {
                            let r = lock(&run);
                            let reason = r.end_reason.clone().unwrap_or_default();
                            if phase == Phase::Aborted {
                                Action::Abort { reason }
                            } else {
                                Action::Promote { reason }
                            }
                        };
                        if self.try_change_alias(gw, &run, &action).await {
                            return;
                        }
                        next_try = tokio::time::Instant::now() + wait;
                        wait = (wait * 2).min(super::MAX_RETRY_WAIT);
                    }
                    continue;
                }
                Phase::Paused => continue,
                Phase::Progressing if !analyse => continue,
                Phase::Progressing => {}
            }
            let (id, step, sv, cv) = tags(&lock(&run));
            self.flush(gw, model, &sv, &cv).await;
            let stable = sh.samples(&samples_key(model, &id, step, &sv)).await;
            let canary = sh.samples(&samples_key(model, &id, step, &cv)).await;
            let (Ok(stable), Ok(canary)) = (stable, canary) else {
                continue;
            };
            let action = {
                let mut r = lock(&run);
                r.stable = stable;
                r.canary = canary;
                let Run {
                    rollout,
                    stable,
                    canary,
                    ..
                } = &mut *r;
                let action = rollout.on_interval(stable, canary);
                note_end(&mut r, &action);
                if matches!(action, Action::Abort { .. } | Action::Promote { .. }) {
                    r.ended_ms = Some(gw.now_ms());
                }
                action
            };
            // Kept only if no one changed the rollout meanwhile (an
            // operator's pause or abort wins) and the lease is still ours.
            match self.push(&run, true).await {
                Ok(true) => {}
                _ => {
                    let _ = self.pull(model).await;
                    continue;
                }
            }
            {
                let r = lock(&run);
                if let Some(v) = r.rollout.verdicts.last() {
                    let mut m = Map::new();
                    m.insert("step".into(), v.step.into());
                    m.insert("weight".into(), v.weight.into());
                    m.insert("interval".into(), v.interval.into());
                    m.insert("decision".into(), json!(v.decision));
                    m.insert(
                        "checks".into(),
                        v.analysis
                            .checks
                            .iter()
                            .map(|c| Value::String(c.to_string()))
                            .collect(),
                    );
                    audit(gw, "rollout_verdict", &r, m);
                }
            }
            if let Action::SetWeight { .. } = action {
                let new_step = lock(&run).rollout.step;
                lock(&sh.applied).insert(model.to_owned(), (id.clone(), new_step));
                sh.drop_step(model, &id, step, &[sv, cv]).await;
            }
            self.act(gw, &run, action).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_survive_their_lines_and_bad_lines_are_none() {
        let full = Sample {
            error: false,
            latency_ms: Some(0.289_6),
            completion_tokens: Some(17),
            finish_reason: Some(FinishReason::Length),
            answer_chars: Some(40),
            streamed: true,
            stream_aborted: true,
            output_mean: Some(-1.5e-7),
        };
        let empty = Sample::failed(3.0);
        for s in [full, empty] {
            assert_eq!(decode(&encode(&s)), Some(s), "{}", encode(&s));
        }
        assert_eq!(encode(&empty), "1|3|-|-|-|0|0|-");
        for bad in [
            "",
            "1|3|-|-|-|0|0",
            "2|3|-|-|-|0|0|-",
            "0|NaN|-|-|-|0|0|-",
            "0|1|-|x|-|0|0|-",
            "0|1|-1|-|-|0|0|-",
        ] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
