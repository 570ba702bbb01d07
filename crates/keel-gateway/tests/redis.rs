//! Limits shared through a real Redis (`scripts/services/redis start`):
//! exact under concurrency, settled and refunded, quotas reset by the
//! injected clock. Two gateway processes sharing it: crates/keel/tests.

mod common;

use std::sync::Arc;

use common::*;
use keel_gateway::config::LimitSet;
use keel_gateway::parts::{Admission, Refusal, Scope};
use keel_gateway::Limiter;
use keel_gateway::ManualClock;
use serde_json::json;

fn unique(name: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_nanos();
    format!("test:{name}:{}:{t}", std::process::id())
}

fn admitted(a: &Admission) -> bool {
    matches!(a, Admission::Admitted { .. })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Redis: scripts/test starts one"]
async fn concurrent_reservations_are_exact() {
    let url = keel_testkit::serve::redis_url();
    let l = Arc::new(
        Limiter::redis(&url, Arc::new(ManualClock::new(1_767_225_600_000))).expect("limiter"),
    );
    let s = Scope {
        name: unique("exact").into(),
        limits: LimitSet {
            requests_per_minute: Some(500),
            tokens_per_minute: Some(2_345),
            ..LimitSet::default()
        },
    };
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (l, s) = (l.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            for _ in 0..20 {
                if admitted(
                    &l.reserve(std::slice::from_ref(&s), 10)
                        .await
                        .expect("redis"),
                ) {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    assert_eq!(total, 234, "floor(2345 / 10) admitted, no more");
    let u = l.usage(&s.name).await.expect("usage");
    assert_eq!((u.requests, u.tokens), (234, 2340));
}

#[tokio::test]
#[ignore = "needs Redis: scripts/test starts one"]
async fn settle_refund_and_quota_reset_through_redis() {
    let url = keel_testkit::serve::redis_url();
    // 2026-01-31T23:59:00Z
    let clock = Arc::new(ManualClock::new(1_769_903_940_000));
    let l = Limiter::redis(&url, clock.clone()).expect("limiter");
    let s = [Scope {
        name: unique("quota").into(),
        limits: LimitSet {
            tokens_per_day: Some(100),
            tokens_per_month: Some(250),
            ..LimitSet::default()
        },
    }];
    let a = l.reserve(&s, 60).await.expect("redis");
    let Admission::Admitted { reservation, .. } = a else {
        panic!("{a:?}")
    };
    assert!(!admitted(&l.reserve(&s, 60).await.expect("redis")));
    l.settle(&reservation, 20).await.expect("settle");
    assert!(
        admitted(&l.reserve(&s, 60).await.expect("redis")),
        "20 + 60 fits"
    );
    let r = l.reserve(&s, 30).await.expect("redis");
    let Admission::Refused {
        refusal: Refusal::Quota,
        retry_after_ms,
        ..
    } = r
    else {
        panic!("{r:?}")
    };
    assert_eq!(retry_after_ms, 60_000);
    let a = l.reserve(&s, 0).await.expect("redis");
    let Admission::Admitted {
        reservation: zero, ..
    } = a
    else {
        panic!("{a:?}")
    };
    l.settle(&zero, 0).await.expect("no-op");
    clock.advance(60_000); // 2026-02-01: new day and new month
    let a = l.reserve(&s, 100).await.expect("redis");
    let Admission::Admitted { reservation, .. } = a else {
        panic!("{a:?}")
    };
    l.settle(&reservation, 0).await.expect("refund");
    assert_eq!(
        l.usage(&s[0].name).await.expect("usage").day_tokens,
        0,
        "refunded"
    );
    clock.advance(86_400_000);
    for _ in 0..2 {
        assert!(admitted(&l.reserve(&s, 100).await.expect("redis")));
        clock.advance(86_400_000);
    }
    let r = l.reserve(&s, 100).await.expect("redis");
    assert!(
        matches!(
            r,
            Admission::Refused {
                refusal: Refusal::Quota,
                ..
            }
        ),
        "month quota 250: {r:?}"
    );
}

#[tokio::test]
async fn an_unreachable_redis_fails_closed() {
    let l = Limiter::redis("redis://127.0.0.1:1", Arc::new(ManualClock::new(0))).expect("limiter");
    let s = [Scope {
        name: "x".into(),
        limits: LimitSet {
            requests_per_minute: Some(1),
            ..LimitSet::default()
        },
    }];
    assert!(l.reserve(&s, 1).await.is_err());
}

/// `redis://user:password@` authenticates as that ACL user (`AUTH user
/// password`), not as the default user with the password alone.
#[tokio::test]
#[ignore = "needs Redis: scripts/test starts one"]
async fn a_url_with_a_user_authenticates_as_that_acl_user() {
    let url = keel_testkit::serve::redis_url();
    let admin = keel_gateway::redis::RedisClient::new(&url).expect("client");
    let user = unique("acl").replace(':', "-");
    let set = admin
        .command(&[
            b"ACL",
            b"SETUSER",
            user.as_bytes(),
            b"reset",
            b"on",
            b">pa:ss@1",
            b"~*",
            b"+@all",
        ])
        .await
        .expect("ACL SETUSER");
    assert!(
        matches!(set, keel_gateway::redis::Reply::Simple(_)),
        "{set:?}"
    );
    let host = url
        .rsplit('@')
        .next()
        .expect("url")
        .trim_start_matches("redis://");
    let good = format!("redis://{user}:pa%3Ass%401@{host}");
    keel_gateway::redis::RedisClient::new(&good)
        .expect("client")
        .ping()
        .await
        .expect("the ACL user authenticates");
    // The same password for the default user (which has none or another).
    let bad = format!("redis://nobody:pa%3Ass%401@{host}");
    assert!(keel_gateway::redis::RedisClient::new(&bad)
        .expect("client")
        .ping()
        .await
        .is_err());
    admin
        .command(&[b"ACL", b"DELUSER", user.as_bytes()])
        .await
        .expect("ACL DELUSER");
}

/// A `max_tokens` too large for Redis's Lua numbers (about 1e17 and up),
/// on a key with a request limit and no token limit: in-process and Redis
/// limits give the same answers and counts, and settlement keeps working.
#[test]
#[ignore = "needs Redis: scripts/test starts one"]
fn huge_max_tokens_get_the_same_answers_in_process_and_through_redis() {
    let b = TestBackend::start(&["--tokens", "8"]);
    let redis = keel_testkit::serve::redis_url();
    let mut seen = Vec::new();
    for store in [String::new(), format!("redis_url = \"{redis}\"\n")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (id, key) = add_key(dir.path(), &unique("huge"), &["user"], None);
        let cfg = format!(
            "{}[limits]\n{store}[limits.default]\nrequests_per_minute = 10\n{}",
            head(dir.path()),
            model("chat", "", &[("blue", b.url(), 1)])
        );
        let g = Running::start(dir.path(), &cfg);
        let mut answers = Vec::new();
        for max_tokens in [json!(100_000_000_000_000_000u64), json!(u64::MAX), json!(8)] {
            let mut body = chat_body("chat");
            body["max_tokens"] = max_tokens;
            let r = g.chat(&key, body);
            answers.push((r.status, r.json()["usage"]["total_tokens"].clone()));
        }
        let u = g.usage(&format!("key:{id}"));
        answers.push((0, json!([u["requests"].clone(), u["tokens"].clone()])));
        g.stop();
        seen.push(answers);
    }
    assert_eq!(seen[0], seen[1], "in process, then Redis");
    assert_eq!(
        seen[0],
        vec![
            (200, json!(10)),
            (200, json!(10)),
            (200, json!(10)),
            (0, json!([3, 20]))
        ],
        "each settled to its 2 + 8 tokens, but the second reservation met a \
         count held at MAX_COUNT (10 + MAX_COUNT saturates), so settling it \
         left 10 for the first two together"
    );
}
