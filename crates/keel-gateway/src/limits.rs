//! Request and token limits per key or team, exact under concurrency.
//!
//! A request names one or more scopes (`key:ID`, `team:NAME`), each with a
//! `LimitSet`. Admission reserves one request and an estimate of its tokens
//! in every scope at once, or in none: all checks and increments happen
//! under one lock (in process) or in one Lua script (Redis, shared by
//! replicas). When the response's `usage` arrives the reservation is
//! settled to the real count; a failed request is refunded its tokens.
//! Minute windows start at a scope's first request and last 60 s; day and
//! month quotas follow the UTC calendar of the injected clock.
//!
//! Both stores hold every count, reservation and limit to at most
//! [`MAX_COUNT`] (2^53 - 1, the largest integer Redis's Lua numbers hold
//! exactly), so they give the same answer for the same request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::clock::{day_end_ms, day_of, month_end_ms, month_of, Clock};
use crate::config::LimitSet;
use crate::error::GatewayError;
use crate::redis::RedisClient;

pub const WINDOW_MS: u64 = 60_000;

/// The largest count, reservation or limit the limiter keeps (2^53 - 1):
/// larger numbers are taken as this one, in process and in Redis alike.
pub const MAX_COUNT: u64 = (1 << 53) - 1;

fn cap(v: u64) -> u64 {
    v.min(MAX_COUNT)
}

/// A limit set with every limit held to [`MAX_COUNT`].
fn capped(l: &LimitSet) -> LimitSet {
    LimitSet {
        requests_per_minute: l.requests_per_minute.map(cap),
        tokens_per_minute: l.tokens_per_minute.map(cap),
        tokens_per_day: l.tokens_per_day.map(cap),
        tokens_per_month: l.tokens_per_month.map(cap),
    }
}

/// One counter set and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `key:<id>` or `team:<name>`; shared, not copied, per request.
    pub name: Arc<str>,
    pub limits: LimitSet,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Requests or tokens per minute: 429.
    Rate,
    /// Tokens per day or month: 403.
    Quota,
}

/// What the `x-ratelimit-*` headers say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateInfo {
    pub limit_requests: Option<u64>,
    pub remaining_requests: u64,
    pub reset_requests_ms: u64,
    pub limit_tokens: Option<u64>,
    pub remaining_tokens: u64,
    pub reset_tokens_ms: u64,
}

/// What a reservation took, to settle or refund later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub scopes: Vec<Scope>,
    pub tokens: u64,
    window_starts: Vec<u64>,
    day: u64,
    month: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Admitted {
        reservation: Reservation,
        info: RateInfo,
    },
    Refused {
        refusal: Refusal,
        retry_after_ms: u64,
        info: RateInfo,
    },
}

/// Counters of one scope as they stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub window_start_ms: u64,
    pub requests: u64,
    pub tokens: u64,
    pub day_tokens: u64,
    pub month_tokens: u64,
}

/// In-process counters, or Redis when `redis_url` is set.
#[derive(Debug, Clone)]
pub enum Limiter {
    Local(Arc<LocalLimiter>),
    Redis(Arc<RedisLimiter>),
}

#[derive(Debug, thiserror::Error)]
#[error("limit store unavailable: {0}")]
pub struct LimitError(pub String);

impl Limiter {
    pub fn local(clock: Arc<dyn Clock>) -> Self {
        Limiter::Local(Arc::new(LocalLimiter {
            clock,
            counters: Mutex::new(HashMap::new()),
        }))
    }

    pub fn redis(url: &str, clock: Arc<dyn Clock>) -> Result<Self, GatewayError> {
        Ok(Limiter::Redis(Arc::new(RedisLimiter {
            client: RedisClient::new(url)?,
            clock,
        })))
    }

    /// Reserves one request and `tokens` (held to [`MAX_COUNT`]) in every
    /// scope, or in none.
    pub async fn reserve(&self, scopes: &[Scope], tokens: u64) -> Result<Admission, LimitError> {
        let tokens = cap(tokens);
        match self {
            Limiter::Local(l) => Ok(l.reserve(scopes, tokens)),
            // Boxed: the Redis exchange's state would otherwise make
            // every request's future larger, local limits or not.
            Limiter::Redis(r) => Box::pin(r.reserve(scopes, tokens)).await,
        }
    }

    /// Settles a reservation to `actual` tokens (0 refunds it).
    pub async fn settle(&self, res: &Reservation, actual: u64) -> Result<(), LimitError> {
        let actual = cap(actual);
        if actual == res.tokens {
            return Ok(());
        }
        match self {
            Limiter::Local(l) => {
                l.settle(res, actual);
                Ok(())
            }
            Limiter::Redis(r) => Box::pin(r.settle(res, actual)).await,
        }
    }

    pub async fn usage(&self, scope: &str) -> Result<Usage, LimitError> {
        match self {
            Limiter::Local(l) => Ok(l.usage(scope)),
            Limiter::Redis(r) => r.usage(scope).await,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counter {
    window_start: u64,
    requests: u64,
    tokens: u64,
    day: u64,
    day_tokens: u64,
    month: u64,
    month_tokens: u64,
}

impl Counter {
    fn roll(&mut self, now: u64) {
        if self.requests == 0 && self.tokens == 0 || now >= self.window_start + WINDOW_MS {
            self.window_start = now;
            self.requests = 0;
            self.tokens = 0;
        }
        if self.day != day_of(now) {
            self.day = day_of(now);
            self.day_tokens = 0;
        }
        if self.month != month_of(now) {
            self.month = month_of(now);
            self.month_tokens = 0;
        }
    }
}

/// The limit checks shared by both stores: given the counters of each
/// scope, the refusal (quota before rate) and how long to wait.
fn judge(scopes: &[Scope], counters: &[Counter], tokens: u64, now: u64) -> Option<(Refusal, u64)> {
    let mut quota = None::<u64>;
    let mut rate = None::<u64>;
    for (s, c) in scopes.iter().zip(counters) {
        let l = &capped(&s.limits);
        if l.tokens_per_day
            .is_some_and(|m| c.day_tokens.saturating_add(tokens) > m)
        {
            quota = Some(quota.unwrap_or(0).max(day_end_ms(now) - now));
        }
        if l.tokens_per_month
            .is_some_and(|m| c.month_tokens.saturating_add(tokens) > m)
        {
            quota = Some(quota.unwrap_or(0).max(month_end_ms(now) - now));
        }
        let reset = (c.window_start + WINDOW_MS).saturating_sub(now);
        if l.requests_per_minute
            .is_some_and(|m| c.requests.saturating_add(1) > m)
            || l.tokens_per_minute
                .is_some_and(|m| c.tokens.saturating_add(tokens) > m)
        {
            rate = Some(rate.unwrap_or(0).max(reset));
        }
    }
    match (quota, rate) {
        (Some(q), _) => Some((Refusal::Quota, q)),
        (None, Some(r)) => Some((Refusal::Rate, r)),
        (None, None) => None,
    }
}

/// The headers' view: the scope with the least left.
fn rate_info(scopes: &[Scope], counters: &[Counter], now: u64) -> RateInfo {
    let mut info = RateInfo::default();
    let mut best_r = u64::MAX;
    let mut best_t = u64::MAX;
    for (s, c) in scopes.iter().zip(counters) {
        let reset = (c.window_start + WINDOW_MS).saturating_sub(now);
        if let Some(m) = s.limits.requests_per_minute {
            let left = m.saturating_sub(c.requests);
            if left < best_r {
                best_r = left;
                info.limit_requests = Some(m);
                info.remaining_requests = left;
                info.reset_requests_ms = reset;
            }
        }
        if let Some(m) = s.limits.tokens_per_minute {
            let left = m.saturating_sub(c.tokens);
            if left < best_t {
                best_t = left;
                info.limit_tokens = Some(m);
                info.remaining_tokens = left;
                info.reset_tokens_ms = reset;
            }
        }
    }
    info
}

#[derive(Debug)]
pub struct LocalLimiter {
    clock: Arc<dyn Clock>,
    counters: Mutex<HashMap<Arc<str>, Counter>>,
}

impl LocalLimiter {
    fn reserve(&self, scopes: &[Scope], tokens: u64) -> Admission {
        let now = self.clock.now_ms();
        let mut map = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        let mut cs: Vec<Counter> = scopes
            .iter()
            .map(|s| {
                let c = match map.get_mut(&*s.name) {
                    Some(c) => c,
                    None => map.entry(s.name.clone()).or_default(),
                };
                c.roll(now);
                *c
            })
            .collect();
        if let Some((refusal, retry_after_ms)) = judge(scopes, &cs, tokens, now) {
            return Admission::Refused {
                refusal,
                retry_after_ms,
                info: rate_info(scopes, &cs, now),
            };
        }
        for (s, c) in scopes.iter().zip(cs.iter_mut()) {
            c.requests = cap(c.requests.saturating_add(1));
            c.tokens = cap(c.tokens.saturating_add(tokens));
            c.day_tokens = cap(c.day_tokens.saturating_add(tokens));
            c.month_tokens = cap(c.month_tokens.saturating_add(tokens));
            if let Some(m) = map.get_mut(&*s.name) {
                *m = *c;
            }
        }
        Admission::Admitted {
            info: rate_info(scopes, &cs, now),
            reservation: Reservation {
                scopes: scopes.to_vec(),
                tokens,
                window_starts: cs.iter().map(|c| c.window_start).collect(),
                day: day_of(now),
                month: month_of(now),
            },
        }
    }

    fn settle(&self, res: &Reservation, actual: u64) {
        let mut map = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        let adj = |v: &mut u64| *v = cap(v.saturating_add(actual).saturating_sub(res.tokens));
        for (s, start) in res.scopes.iter().zip(&res.window_starts) {
            let Some(c) = map.get_mut(&*s.name) else {
                continue;
            };
            if c.window_start == *start {
                adj(&mut c.tokens);
            }
            if c.day == res.day {
                adj(&mut c.day_tokens);
            }
            if c.month == res.month {
                adj(&mut c.month_tokens);
            }
        }
    }

    fn usage(&self, scope: &str) -> Usage {
        let now = self.clock.now_ms();
        let map = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        let mut c = map.get(scope).copied().unwrap_or_default();
        if c.requests > 0 || c.tokens > 0 {
            c.roll(now);
        }
        Usage {
            window_start_ms: c.window_start,
            requests: c.requests,
            tokens: c.tokens,
            day_tokens: if c.day == day_of(now) {
                c.day_tokens
            } else {
                0
            },
            month_tokens: if c.month == month_of(now) {
                c.month_tokens
            } else {
                0
            },
        }
    }
}

/// Limits shared through Redis: one Lua script per admission and per
/// settlement, so replicas never overshoot together. Minute windows use the
/// Redis server's clock; day and month keys the gateway's.
#[derive(Debug)]
pub struct RedisLimiter {
    client: RedisClient,
    clock: Arc<dyn Clock>,
}

/// Every argument is checked before the first write, and every sum is held
/// to MAX (2^53 - 1), so no write can fail half-way or store a number
/// that is not an integer.
const RESERVE_LUA: &str = r#"
local MAX = 9007199254740991
local function int(v, lo)
  local x = tonumber(v)
  if (not x) or x ~= math.floor(x) or x < lo or x > MAX then
    return redis.error_reply('keel: argument out of range: ' .. string.sub(tostring(v), 1, 32))
  end
  return x
end
local function cap(v) if v > MAX then return MAX end return v end
local args = {}
for i = 1, #ARGV do
  local x = int(ARGV[i], -1)
  if type(x) == 'table' then return x end
  args[i] = x
end
local tokens, dttl, mttl, n = args[1], args[2], args[3], args[4]
if tokens < 0 or dttl < 0 or mttl < 0 or n < 0 or #ARGV ~= 4 + 4*n or #KEYS ~= 3*n then
  return redis.error_reply('keel: malformed reservation')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local quota, rate = -1, -1
local st, rq, tk, dt, mt = {}, {}, {}, {}, {}
for i = 1, n do
  local hk, dk, mk = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
  local b = 4 + 4*(i-1)
  local rpm, tpm, tpd, tpmo = args[b+1], args[b+2], args[b+3], args[b+4]
  local h = redis.call('HMGET', hk, 's', 'r', 't')
  local s, r, k = tonumber(h[1]), cap(tonumber(h[2]) or 0), cap(tonumber(h[3]) or 0)
  if (not s) or now >= s + 60000 then s = now; r = 0; k = 0 end
  local d = cap(tonumber(redis.call('GET', dk) or '0') or 0)
  local m = cap(tonumber(redis.call('GET', mk) or '0') or 0)
  st[i], rq[i], tk[i], dt[i], mt[i] = s, r, k, d, m
  if tpd >= 0 and d + tokens > tpd then quota = math.max(quota, dttl) end
  if tpmo >= 0 and m + tokens > tpmo then quota = math.max(quota, mttl) end
  if (rpm >= 0 and r + 1 > rpm) or (tpm >= 0 and k + tokens > tpm) then rate = math.max(rate, s + 60000 - now) end
end
local out = {}
if quota >= 0 then out[1] = 2; out[2] = quota
elseif rate >= 0 then out[1] = 1; out[2] = rate
else
  out[1] = 0; out[2] = 0
  for i = 1, n do
    local hk, dk, mk = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
    rq[i] = cap(rq[i] + 1); tk[i] = cap(tk[i] + tokens)
    redis.call('HSET', hk, 's', st[i], 'r', rq[i], 't', tk[i])
    redis.call('PEXPIREAT', hk, st[i] + 120000)
    redis.call('SET', dk, cap(dt[i] + tokens), 'PX', dttl + 86400000)
    redis.call('SET', mk, cap(mt[i] + tokens), 'PX', mttl + 86400000)
  end
end
out[3] = now
for i = 1, n do
  table.insert(out, st[i]); table.insert(out, rq[i]); table.insert(out, tk[i])
end
return out
"#;

/// Like the reservation, checks its arguments before the first write and
/// holds each counter within 0..=MAX.
const SETTLE_LUA: &str = r#"
local MAX = 9007199254740991
local delta = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
if (not delta) or delta ~= math.floor(delta) or delta < -MAX or delta > MAX
   or (not n) or n < 0 or #ARGV ~= 2 + n or #KEYS ~= 3*n then
  return redis.error_reply('keel: malformed settlement')
end
local function adj(v)
  if v < 0 then return 0 end
  if v > MAX then return MAX end
  return v
end
for i = 1, n do
  local hk, dk, mk = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
  local s = redis.call('HGET', hk, 's')
  if s and tonumber(s) == tonumber(ARGV[2+i]) then
    local v = adj((tonumber(redis.call('HGET', hk, 't')) or 0) + delta)
    redis.call('HSET', hk, 't', v)
  end
  for _, key in ipairs({dk, mk}) do
    local v = redis.call('GET', key)
    if v then redis.call('SET', key, adj((tonumber(v) or 0) + delta), 'KEEPTTL') end
  end
end
return 0
"#;

const USAGE_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 's', 'r', 't')
local s, r, k = tonumber(h[1]) or 0, tonumber(h[2]) or 0, tonumber(h[3]) or 0
if now >= s + 60000 then r = 0; k = 0 end
return {s, r, k, tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(redis.call('GET', KEYS[3]) or '0')}
"#;

fn keys_for(scope: &str, day: u64, month: u64) -> [String; 3] {
    [
        format!("keel:w:{{{scope}}}"),
        format!("keel:d:{{{scope}}}:{day}"),
        format!("keel:m:{{{scope}}}:{month}"),
    ]
}

fn lim(v: Option<u64>) -> String {
    v.map_or("-1".into(), |v| cap(v).to_string())
}

impl RedisLimiter {
    /// Checks the store answers (at start, so a bad `redis_url` fails
    /// loudly instead of refusing every request).
    pub async fn ping(&self) -> Result<(), GatewayError> {
        self.client.ping().await.map_err(|e| GatewayError::Redis {
            url: self.client.url().to_owned(),
            reason: e.to_string(),
        })
    }

    async fn reserve(&self, scopes: &[Scope], tokens: u64) -> Result<Admission, LimitError> {
        let now = self.clock.now_ms();
        let (day, month) = (day_of(now), month_of(now));
        let mut keys = Vec::new();
        let mut args = vec![
            tokens.to_string(),
            (day_end_ms(now) - now).to_string(),
            (month_end_ms(now) - now).to_string(),
            scopes.len().to_string(),
        ];
        for s in scopes {
            keys.extend(keys_for(&s.name, day, month));
            let l = s.limits;
            args.extend([
                lim(l.requests_per_minute),
                lim(l.tokens_per_minute),
                lim(l.tokens_per_day),
                lim(l.tokens_per_month),
            ]);
        }
        let out = self
            .client
            .eval_ints(RESERVE_LUA, &keys, &args)
            .await
            .map_err(|e| LimitError(e.to_string()))?;
        if out.len() != 3 + 3 * scopes.len() {
            return Err(LimitError(format!(
                "unexpected reply of {} values",
                out.len()
            )));
        }
        let rnow = out[2] as u64;
        let counters: Vec<Counter> = (0..scopes.len())
            .map(|i| Counter {
                window_start: out[3 + 3 * i] as u64,
                requests: out[4 + 3 * i] as u64,
                tokens: out[5 + 3 * i] as u64,
                ..Counter::default()
            })
            .collect();
        let info = rate_info(scopes, &counters, rnow);
        Ok(match out[0] {
            0 => Admission::Admitted {
                info,
                reservation: Reservation {
                    scopes: scopes.to_vec(),
                    tokens,
                    window_starts: counters.iter().map(|c| c.window_start).collect(),
                    day,
                    month,
                },
            },
            k => Admission::Refused {
                refusal: if k == 2 {
                    Refusal::Quota
                } else {
                    Refusal::Rate
                },
                retry_after_ms: out[1].max(0) as u64,
                info,
            },
        })
    }

    async fn settle(&self, res: &Reservation, actual: u64) -> Result<(), LimitError> {
        // Both are at most MAX_COUNT, so the difference fits.
        let delta = actual as i64 - res.tokens as i64;
        let mut keys = Vec::new();
        let mut args = vec![delta.to_string(), res.scopes.len().to_string()];
        for (s, start) in res.scopes.iter().zip(&res.window_starts) {
            keys.extend(keys_for(&s.name, res.day, res.month));
            args.push(start.to_string());
        }
        self.client
            .eval_ints(SETTLE_LUA, &keys, &args)
            .await
            .map(|_| ())
            .map_err(|e| LimitError(e.to_string()))
    }

    async fn usage(&self, scope: &str) -> Result<Usage, LimitError> {
        let now = self.clock.now_ms();
        let keys = keys_for(scope, day_of(now), month_of(now));
        let v = self
            .client
            .eval_ints(USAGE_LUA, &keys, &[])
            .await
            .map_err(|e| LimitError(e.to_string()))?;
        let g = |i: usize| v.get(i).copied().unwrap_or(0).max(0) as u64;
        Ok(Usage {
            window_start_ms: g(0),
            requests: g(1),
            tokens: g(2),
            day_tokens: g(3),
            month_tokens: g(4),
        })
    }
}

/// `1s`, `59.5s`, `6m0s`: durations as OpenAI's reset headers write them.
#[cfg(test)]
pub fn reset_header(ms: u64) -> String {
    reset_text(ms, &mut [0; 48]).to_owned()
}

/// A duration as OpenAI's reset headers write it (`1s`, `59.5s`,
/// `6m0s`), as a header value, without a temporary string.
pub fn reset_header_value(ms: u64) -> Option<http::HeaderValue> {
    http::HeaderValue::from_str(reset_text(ms, &mut [0; 48])).ok()
}

fn reset_text(ms: u64, buf: &mut [u8; 48]) -> &str {
    use std::io::Write;
    let mut w = &mut buf[..];
    let _ = if ms >= 60_000 {
        write!(w, "{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    } else if ms.is_multiple_of(1000) {
        write!(w, "{}s", ms / 1000)
    } else {
        // Milliseconds as a decimal fraction, trailing zeros dropped.
        let mut frac = ms % 1000;
        let mut digits = 3;
        while frac.is_multiple_of(10) {
            frac /= 10;
            digits -= 1;
        }
        write!(w, "{}.{:0digits$}s", ms / 1000, frac)
    };
    let left = w.len();
    let len = buf.len() - left;
    std::str::from_utf8(&buf[..len]).unwrap_or("")
}

/// Whole seconds to wait, at least 1.
pub fn retry_after_s(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn scope(name: &str, l: LimitSet) -> Scope {
        Scope {
            name: name.into(),
            limits: l,
        }
    }

    fn admitted(a: &Admission) -> bool {
        matches!(a, Admission::Admitted { .. })
    }

    #[tokio::test]
    async fn requests_and_tokens_per_minute() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let l = Limiter::local(clock.clone());
        let s = [scope(
            "key:a",
            LimitSet {
                requests_per_minute: Some(3),
                tokens_per_minute: Some(100),
                ..LimitSet::default()
            },
        )];
        let a = l.reserve(&s, 40).await.expect("ok");
        let Admission::Admitted { reservation, info } = a else {
            panic!("{a:?}")
        };
        assert_eq!((info.remaining_requests, info.remaining_tokens), (2, 60));
        assert!(admitted(&l.reserve(&s, 40).await.expect("ok")));
        // 80 reserved: 40 more would be 120.
        let r = l.reserve(&s, 40).await.expect("ok");
        assert!(
            matches!(
                r,
                Admission::Refused {
                    refusal: Refusal::Rate,
                    retry_after_ms: 60_000,
                    ..
                }
            ),
            "{r:?}"
        );
        // Settling the first to 10 tokens frees 30.
        l.settle(&reservation, 10).await.expect("ok");
        assert!(admitted(&l.reserve(&s, 40).await.expect("ok")));
        // Now 3 requests: the 4th is refused whatever its tokens.
        assert!(!admitted(&l.reserve(&s, 0).await.expect("ok")));
        clock.advance(60_000);
        assert!(admitted(&l.reserve(&s, 100).await.expect("ok")));
    }

    #[tokio::test]
    async fn quotas_reset_on_period_boundaries() {
        // 2026-01-31T23:59:00Z: the day and the month end in a minute.
        let clock = Arc::new(ManualClock::new(1_769_903_940_000));
        let l = Limiter::local(clock.clone());
        let day = [scope(
            "team:ml",
            LimitSet {
                tokens_per_day: Some(100),
                ..LimitSet::default()
            },
        )];
        let month = [scope(
            "key:m",
            LimitSet {
                tokens_per_month: Some(100),
                ..LimitSet::default()
            },
        )];
        assert!(admitted(&l.reserve(&day, 100).await.expect("ok")));
        assert!(admitted(&l.reserve(&month, 100).await.expect("ok")));
        let r = l.reserve(&day, 1).await.expect("ok");
        assert!(
            matches!(
                r,
                Admission::Refused {
                    refusal: Refusal::Quota,
                    retry_after_ms: 60_000,
                    ..
                }
            ),
            "{r:?}"
        );
        clock.advance(59_999);
        assert!(!admitted(&l.reserve(&day, 1).await.expect("ok")));
        assert!(!admitted(&l.reserve(&month, 1).await.expect("ok")));
        clock.advance(1); // 2026-02-01T00:00:00Z
        assert!(admitted(&l.reserve(&day, 100).await.expect("ok")));
        assert!(admitted(&l.reserve(&month, 100).await.expect("ok")));
        assert_eq!(l.usage("team:ml").await.expect("ok").day_tokens, 100);
        // A day later the day quota is back, the month's is not.
        clock.advance(86_400_000);
        assert!(admitted(&l.reserve(&day, 1).await.expect("ok")));
        let r = l.reserve(&month, 1).await.expect("ok");
        let Admission::Refused {
            refusal: Refusal::Quota,
            retry_after_ms,
            ..
        } = r
        else {
            panic!("{r:?}")
        };
        assert_eq!(retry_after_ms, 27 * 86_400_000, "until 2026-03-01");
    }

    #[tokio::test]
    async fn a_huge_reservation_is_refused_and_never_wraps_the_counters() {
        let l = Limiter::local(Arc::new(ManualClock::new(1_000_000)));
        let s = [scope(
            "key:a",
            LimitSet {
                tokens_per_day: Some(100),
                ..LimitSet::default()
            },
        )];
        let Admission::Admitted { reservation, .. } = l.reserve(&s, 90).await.expect("ok") else {
            panic!("90 of 100 is admitted")
        };
        l.settle(&reservation, 90).await.expect("ok");
        // 90 + (u64::MAX - 8) would wrap to 81 and pass a plain sum.
        for tokens in [u64::MAX - 8, u64::MAX] {
            let r = l.reserve(&s, tokens).await.expect("ok");
            assert!(
                matches!(
                    r,
                    Admission::Refused {
                        refusal: Refusal::Quota,
                        ..
                    }
                ),
                "{tokens}: {r:?}"
            );
        }
        assert_eq!(l.usage("key:a").await.expect("ok").day_tokens, 90);
    }

    #[tokio::test]
    async fn counts_and_limits_are_held_to_max_count() {
        let l = Limiter::local(Arc::new(ManualClock::new(1_000_000)));
        let s = [scope(
            "key:a",
            LimitSet {
                requests_per_minute: Some(10),
                tokens_per_month: Some(u64::MAX),
                ..LimitSet::default()
            },
        )];
        let Admission::Admitted { reservation, .. } = l.reserve(&s, u64::MAX).await.expect("ok")
        else {
            panic!("no token limit below MAX_COUNT")
        };
        assert_eq!(reservation.tokens, MAX_COUNT);
        let u = l.usage("key:a").await.expect("ok");
        assert_eq!((u.tokens, u.month_tokens), (MAX_COUNT, MAX_COUNT));
        // The month's limit is MAX_COUNT too: full.
        assert!(!admitted(&l.reserve(&s, 1).await.expect("ok")));
        l.settle(&reservation, u64::MAX).await.expect("ok");
        assert_eq!(l.usage("key:a").await.expect("ok").tokens, MAX_COUNT);
        l.settle(&reservation, 7).await.expect("ok");
        assert_eq!(l.usage("key:a").await.expect("ok").tokens, 7);
    }

    /// The reservation script refuses arguments it cannot count exactly
    /// before it writes anything (a real Redis: `scripts/services/redis`).
    #[tokio::test]
    #[ignore = "needs Redis: scripts/test starts one"]
    async fn the_scripts_check_their_arguments_before_the_first_write() {
        let c = RedisClient::new(&keel_testkit::serve::redis_url()).expect("client");
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_nanos();
        let keys = keys_for(&format!("test:args:{}:{t}", std::process::id()), 1, 1).to_vec();
        let limits = ["10", "-1", "-1", "-1"].map(String::from);
        for tokens in [
            "100000000000000000",
            "-5",
            "1.5",
            "many",
            "9007199254740992",
        ] {
            let mut args = vec![tokens.to_owned(), "1000".into(), "1000".into(), "1".into()];
            args.extend(limits.iter().cloned());
            let r = c.eval_ints(RESERVE_LUA, &keys, &args).await;
            assert!(
                matches!(&r, Err(crate::redis::RedisError::Server(m)) if m.contains("out of range") || m.contains("malformed")),
                "{tokens}: {r:?}"
            );
            for k in &keys {
                let n = c
                    .eval_ints(
                        "return redis.call('EXISTS', KEYS[1])",
                        std::slice::from_ref(k),
                        &[],
                    )
                    .await
                    .expect("exists");
                assert_eq!(n, vec![0], "{tokens}: {k} was written");
            }
        }
        let r = c
            .eval_ints(SETTLE_LUA, &keys, &["1e17".into(), "1".into(), "0".into()])
            .await;
        assert!(r.is_err(), "{r:?}");
        let mut args = vec![
            MAX_COUNT.to_string(),
            "1000".into(),
            "1000".into(),
            "1".into(),
        ];
        args.extend(limits.iter().cloned());
        let out = c
            .eval_ints(RESERVE_LUA, &keys, &args)
            .await
            .expect("admitted");
        assert_eq!((out[0], out[5]), (0, MAX_COUNT as i64));
        let out = c
            .eval_ints(RESERVE_LUA, &keys, &args)
            .await
            .expect("admitted");
        assert_eq!(out[5], MAX_COUNT as i64, "held to MAX_COUNT, not a float");
    }

    #[tokio::test]
    async fn all_scopes_or_none() {
        let l = Limiter::local(Arc::new(ManualClock::new(5)));
        let both = [
            scope(
                "key:a",
                LimitSet {
                    requests_per_minute: Some(10),
                    ..LimitSet::default()
                },
            ),
            scope(
                "team:t",
                LimitSet {
                    requests_per_minute: Some(1),
                    ..LimitSet::default()
                },
            ),
        ];
        assert!(admitted(&l.reserve(&both, 0).await.expect("ok")));
        assert!(!admitted(&l.reserve(&both, 0).await.expect("ok")));
        assert_eq!(
            l.usage("key:a").await.expect("ok").requests,
            1,
            "refusal charged nothing"
        );
    }

    #[test]
    fn concurrent_clients_never_exceed() {
        let l = Arc::new(LocalLimiter {
            clock: Arc::new(ManualClock::new(1)),
            counters: Mutex::default(),
        });
        let s = [scope(
            "key:a",
            LimitSet {
                requests_per_minute: Some(1000),
                tokens_per_minute: Some(7000),
                ..LimitSet::default()
            },
        )];
        let admitted: usize = std::thread::scope(|t| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    t.spawn(|| {
                        (0..200)
                            .filter(|_| matches!(l.reserve(&s, 10), Admission::Admitted { .. }))
                            .count()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        assert_eq!(admitted, 700);
        assert_eq!(l.usage("key:a").tokens, 7000);
    }

    #[test]
    fn headers() {
        assert_eq!(reset_header(1000), "1s");
        assert_eq!(reset_header(59_500), "59.5s");
        assert_eq!(reset_header(360_000), "6m0s");
        for ms in (0..200_000)
            .step_by(7)
            .chain([1, 10, 100, 1001, 1010, 1100, 59_999, u64::MAX])
        {
            let old = if ms >= 60_000 {
                format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
            } else if ms.is_multiple_of(1000) {
                format!("{}s", ms / 1000)
            } else {
                let s = format!("{:.3}", ms as f64 / 1000.0);
                format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
            };
            assert_eq!(reset_header(ms), old, "{ms}");
            assert_eq!(
                reset_header_value(ms)
                    .expect("a header value")
                    .to_str()
                    .ok(),
                Some(old.as_str())
            );
        }
        assert_eq!(retry_after_s(1), 1);
        assert_eq!(retry_after_s(60_000), 60);
    }
}
