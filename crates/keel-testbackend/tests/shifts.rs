//! The shifted-output modes: exact shares of empty answers, `length`
//! finishes and 500s, in non-overlapping runs, streamed or not, switched
//! at run time.

use keel_testkit::serve::TestBackend;
use serde_json::{json, Value};

/// (empty answers, `length` finishes, 500s) over `n` chat requests.
fn tally(b: &TestBackend, n: usize, stream: bool) -> (usize, usize, usize) {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream});
    let (mut empty, mut length, mut errors) = (0, 0, 0);
    for _ in 0..n {
        let r = b.request("POST", "/v1/chat/completions", body.to_string().as_bytes());
        if r.status == 500 {
            errors += 1;
            continue;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        let (text, finish) = if stream {
            let mut text = String::new();
            let mut finish = String::new();
            for line in r.text().lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(c) = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                {
                    text.push_str(c);
                }
                if let Some(f) = v
                    .pointer("/choices/0/finish_reason")
                    .and_then(Value::as_str)
                {
                    finish = f.to_owned();
                }
            }
            (text, finish)
        } else {
            let v = r.json();
            assert_eq!(
                v["usage"]["completion_tokens"].as_u64() == Some(0),
                v["choices"][0]["message"]["content"] == ""
            );
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        };
        empty += usize::from(text.is_empty());
        length += usize::from(finish == "length");
    }
    (empty, length, errors)
}

#[test]
fn shifted_outputs_come_in_exact_shares() {
    let b = TestBackend::start(&[
        "--empty-percent",
        "20",
        "--length-percent",
        "10",
        "--error-percent",
        "5",
    ]);
    assert_eq!(tally(&b, 200, false), (40, 20, 10));
    assert_eq!(tally(&b, 100, true), (20, 10, 5));
    b.control(json!({"empty_percent": 0, "error_percent": 50, "length_percent": 0}));
    assert_eq!(tally(&b, 100, false), (0, 0, 50));
    b.control(json!({"error_percent": 0}));
    assert_eq!(tally(&b, 100, false), (0, 0, 0));
}
