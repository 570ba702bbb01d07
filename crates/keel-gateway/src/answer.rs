//! What the gateway reads from a backend's answer as it passes: token
//! usage, the answer's length and finish reason, an OIP model's output
//! mean, and the SSE filter that does the same for a stream event by
//! event (and removes the usage chunk the gateway asked for on the
//! client's behalf).

use bytes::Bytes;
use serde_json::Value;

/// Token counts a response reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt: u64,
    pub completion: u64,
}

impl TokenUsage {
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.completion)
    }
}

/// `usage` of an OpenAI-style response object, if it has one.
pub fn usage_of(v: &Value) -> Option<TokenUsage> {
    let u = v.get("usage")?.as_object()?;
    let prompt = u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
    let completion = u.get("completion_tokens").and_then(Value::as_u64);
    let total = u.get("total_tokens").and_then(Value::as_u64);
    let completion = completion.unwrap_or_else(|| total.unwrap_or(prompt).saturating_sub(prompt));
    Some(TokenUsage { prompt, completion })
}

/// `usage` of a whole JSON response body, read without building the
/// rest of the document.
pub fn usage_of_body(body: &[u8]) -> Option<TokenUsage> {
    summary_of_body(body).and_then(|s| s.usage)
}

/// What the canary analysis reads from an answer: its usage, the first
/// choice's finish reason and the non-whitespace characters of its text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AnswerSummary {
    pub usage: Option<TokenUsage>,
    pub finish_reason: Option<keel_canary::analysis::FinishReason>,
    pub answer_chars: Option<u32>,
}

/// `usage`, the first choice's finish reason and text length of a whole
/// JSON response body, in one pass that builds none of the rest of the
/// document.
pub fn summary_of_body(body: &[u8]) -> Option<AnswerSummary> {
    #[derive(serde::Deserialize)]
    struct U {
        prompt_tokens: Option<u64>,
        completion_tokens: Option<u64>,
        total_tokens: Option<u64>,
    }
    #[derive(serde::Deserialize)]
    struct Message<'a> {
        #[serde(borrow)]
        content: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Choice<'a> {
        #[serde(borrow)]
        message: Option<Message<'a>>,
        #[serde(borrow)]
        text: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        finish_reason: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct R<'a> {
        usage: Option<U>,
        #[serde(borrow)]
        choices: Option<Vec<Choice<'a>>>,
    }
    let r = serde_json::from_slice::<R>(body).ok()?;
    let usage = r.usage.map(|u| {
        let prompt = u.prompt_tokens.unwrap_or(0);
        let completion = u
            .completion_tokens
            .unwrap_or_else(|| u.total_tokens.unwrap_or(prompt).saturating_sub(prompt));
        TokenUsage { prompt, completion }
    });
    let first = r.choices.and_then(|c| c.into_iter().next());
    let (finish_reason, answer_chars) = match first {
        Some(c) => {
            let text = c.message.and_then(|m| m.content).or(c.text);
            (
                c.finish_reason
                    .map(|f| keel_canary::analysis::FinishReason::parse(&f)),
                Some(text.map_or(0, |t| visible_chars(&t))),
            )
        }
        None => (None, None),
    };
    Some(AnswerSummary {
        usage,
        finish_reason,
        answer_chars,
    })
}

/// Values of an OIP output tensor the canary analysis reads at most: a
/// larger tensor's mean is that of its first values.
pub const MAX_OUTPUT_VALUES: u32 = 4096;

/// The mean of the first output tensor's numeric values in an OIP v2
/// inference response (`{"outputs": [{"data": [...]}, ...]}`), flat or
/// nested, reading at most [`MAX_OUTPUT_VALUES`] of them and keeping none
/// of the document; `None` for a body that is not such a response or an
/// output with no number (`BYTES` tensors).
pub fn oip_output_mean(body: &[u8]) -> Option<f64> {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    #[derive(Default)]
    struct Acc {
        sum: f64,
        n: u32,
    }
    /// Adds the numbers of a value (an array, nested arrays) to `Acc`.
    struct Values<'a>(&'a mut Acc);
    impl<'de> DeserializeSeed<'de> for Values<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Values<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("tensor data")
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
            if self.0.n < MAX_OUTPUT_VALUES && v.is_finite() {
                self.0.sum += v;
                self.0.n += 1;
            }
            Ok(())
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
            self.visit_f64(v as f64)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
            self.visit_f64(v as f64)
        }
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let acc = self.0;
            loop {
                if acc.n >= MAX_OUTPUT_VALUES {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(());
                }
                if seq.next_element_seed(Values(acc))?.is_none() {
                    return Ok(());
                }
            }
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(())
        }
    }
    /// One output object: only its `data` is read.
    struct Output<'a>(&'a mut Acc);
    impl<'de> DeserializeSeed<'de> for Output<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Output<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an output tensor")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if k == "data" {
                    map.next_value_seed(Values(&mut *self.0))?;
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(())
        }
    }
    /// `outputs`: the first one read, the others skipped.
    struct Outputs<'a>(&'a mut Acc);
    impl<'de> DeserializeSeed<'de> for Outputs<'_> {
        type Value = bool;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
            d.deserialize_seq(self)
        }
    }
    impl<'de> Visitor<'de> for Outputs<'_> {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of output tensors")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            let first = seq.next_element_seed(Output(self.0))?.is_some();
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    /// The response: only `outputs` is read.
    struct Response<'a>(&'a mut Acc);
    impl<'de> Visitor<'de> for Response<'_> {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an inference response")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            let mut found = false;
            while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if k == "outputs" && !found {
                    found = map.next_value_seed(Outputs(&mut *self.0))?;
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    let mut acc = Acc::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de.deserialize_map(Response(&mut acc)).ok()?;
    de.end().ok()?;
    (found && acc.n > 0).then(|| acc.sum / f64::from(acc.n))
}

/// Non-whitespace characters of `s`.
pub fn visible_chars(s: &str) -> u32 {
    s.chars()
        .filter(|c| !c.is_whitespace())
        .count()
        .try_into()
        .unwrap_or(u32::MAX)
}

/// The longest unfinished event a stream holds (an OpenAI chunk is well
/// under a kilobyte).
pub const MAX_PENDING_EVENT: usize = 256 << 10;

/// Splits an SSE stream into events as bytes arrive, forwarding each whole
/// event at once; reads `usage` from the events that carry it, and drops
/// the usage-only chunk (and any `usage` field) when `strip_usage`.
#[derive(Debug, Default)]
pub struct SseFilter {
    buf: Vec<u8>,
    strip_usage: bool,
    pub usage: Option<TokenUsage>,
    pub done: bool,
    pub events: u64,
    /// Bytes of generated text seen (`choices[].delta.content`,
    /// `choices[].text`): the basis of an estimate when a stream ends
    /// without a usage chunk.
    pub content_bytes: u64,
    /// Non-whitespace characters of the first choice's text.
    pub answer_chars: u32,
    /// The first choice's finish reason, once an event carried one.
    pub finish_reason: Option<keel_canary::analysis::FinishReason>,
}

impl SseFilter {
    pub fn new(strip_usage: bool) -> Self {
        Self {
            strip_usage,
            ..Self::default()
        }
    }

    /// Takes a chunk; returns the bytes to forward now. An unfinished
    /// event longer than [`MAX_PENDING_EVENT`] is forwarded as it is, not
    /// read, so what a stream holds stays bounded whatever the backend
    /// sends.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.buf.extend_from_slice(chunk);
        // Read in place: the buffer is taken out for the loop and put back.
        let buf = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some((end, sep)) = find_event_end(&buf[start..]) {
            let next = start + end + sep;
            let ev = &buf[start..next];
            match self.event(ev) {
                Pass::Whole => out.extend_from_slice(ev),
                Pass::Replaced(r) => out.extend_from_slice(&r),
            }
            start = next;
        }
        self.buf = buf;
        self.buf.drain(..start);
        if self.buf.len() > MAX_PENDING_EVENT {
            out.append(&mut self.buf);
        }
        out
    }

    /// [`push`](Self::push) for a chunk the filter may hand on as it is:
    /// when nothing is held from before and every event in the chunk
    /// passes unchanged (a backend sends an event a chunk), the chunk's
    /// own bytes go on, not a copy.
    pub fn push_bytes(&mut self, chunk: Bytes) -> Bytes {
        if !self.buf.is_empty() {
            return Bytes::from(self.push(&chunk));
        }
        let mut out: Option<Vec<u8>> = None;
        let mut start = 0;
        while let Some((end, sep)) = find_event_end(&chunk[start..]) {
            let next = start + end + sep;
            let ev = &chunk[start..next];
            match (self.event(ev), &mut out) {
                (Pass::Whole, None) => {}
                (Pass::Whole, Some(o)) => o.extend_from_slice(ev),
                (Pass::Replaced(r), Some(o)) => o.extend_from_slice(&r),
                (Pass::Replaced(r), o @ None) => {
                    let mut v = Vec::with_capacity(chunk.len());
                    v.extend_from_slice(&chunk[..start]);
                    v.extend_from_slice(&r);
                    *o = Some(v);
                }
            }
            start = next;
        }
        let mut passed = match out {
            None => chunk.slice(..start),
            Some(o) => Bytes::from(o),
        };
        if start < chunk.len() {
            self.buf.extend_from_slice(&chunk[start..]);
            if self.buf.len() > MAX_PENDING_EVENT {
                let mut all = Vec::from(passed);
                all.append(&mut self.buf);
                passed = Bytes::from(all);
            }
        }
        passed
    }

    /// The end of the stream: whatever incomplete event is left goes out
    /// as it is.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Reads one whole event; says what of it to pass on.
    fn event(&mut self, ev: &[u8]) -> Pass {
        use memchr::memmem::Finder;
        use std::sync::LazyLock;
        static DONE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new("[DONE]"));
        static CONTENT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new("\"content\""));
        static TEXT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new("\"text\""));
        static FINISH: LazyLock<Finder<'static>> =
            LazyLock::new(|| Finder::new("\"finish_reason\""));
        static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new("\"usage\""));
        self.events += 1;
        let has = |f: &Finder<'_>| f.find(ev).is_some();
        if has(&DONE) && is_done(ev) {
            self.done = true;
        }
        if has(&CONTENT) || has(&TEXT) || has(&FINISH) {
            let c = content_of(ev);
            self.content_bytes += c.bytes;
            self.answer_chars = self.answer_chars.saturating_add(c.chars);
            if c.finish_reason.is_some() {
                self.finish_reason = c.finish_reason;
            }
        }
        if !has(&USAGE) {
            return Pass::Whole;
        }
        let text = String::from_utf8_lossy(ev);
        let mut kept = String::new();
        let mut changed = false;
        for line in text.split_inclusive('\n') {
            let data = line
                .strip_prefix("data:")
                .map(|d| d.trim())
                .filter(|d| d.starts_with('{'));
            let Some(data) = data else {
                kept.push_str(line);
                continue;
            };
            let Ok(mut v) = serde_json::from_str::<Value>(data) else {
                kept.push_str(line);
                continue;
            };
            if let Some(u) = usage_of(&v) {
                self.usage = Some(u);
                if self.strip_usage {
                    changed = true;
                    let no_choices = v
                        .get("choices")
                        .and_then(Value::as_array)
                        .is_none_or(|c| c.is_empty());
                    if no_choices {
                        continue;
                    }
                    if let Some(o) = v.as_object_mut() {
                        o.remove("usage");
                    }
                    kept.push_str("data: ");
                    kept.push_str(&v.to_string());
                    kept.push('\n');
                    continue;
                }
            }
            kept.push_str(line);
        }
        if !changed {
            Pass::Whole
        } else if kept.lines().any(|l| l.starts_with("data:")) {
            Pass::Replaced(kept.into_bytes())
        } else {
            Pass::Replaced(Vec::new())
        }
    }
}

/// What of an event the filter passes on.
enum Pass {
    /// The event as it came.
    Whole,
    /// These bytes instead (none: the event is dropped).
    Replaced(Vec<u8>),
}

/// Whether an event holds the stream's end marker (`data: [DONE]` or
/// `data:[DONE]`).
fn is_done(ev: &[u8]) -> bool {
    memchr::memmem::find(ev, b"data: [DONE]").is_some()
        || memchr::memmem::find(ev, b"data:[DONE]").is_some()
}

/// What one SSE event's `data:` lines carry of the answer.
#[derive(Default)]
struct Content {
    /// Bytes of generated text (every choice).
    bytes: u64,
    /// Non-whitespace characters of the first choice's text.
    chars: u32,
    /// The first choice's finish reason.
    finish_reason: Option<keel_canary::analysis::FinishReason>,
}

/// Generated text and finish reason in one SSE event's `data:` lines.
fn content_of(ev: &[u8]) -> Content {
    #[derive(serde::Deserialize)]
    struct Delta<'a> {
        #[serde(borrow)]
        content: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Choice<'a> {
        #[serde(default)]
        index: u32,
        #[serde(borrow)]
        delta: Option<Delta<'a>>,
        #[serde(borrow)]
        text: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        finish_reason: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Chunk<'a> {
        #[serde(borrow)]
        choices: Option<Vec<Choice<'a>>>,
    }
    let mut c = Content::default();
    for line in ev.split(|b| *b == b'\n') {
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            continue;
        };
        for ch in chunk.choices.unwrap_or_default() {
            let text = ch.delta.and_then(|d| d.content).or(ch.text);
            if let Some(t) = &text {
                c.bytes += t.len() as u64;
                if ch.index == 0 {
                    c.chars = c.chars.saturating_add(visible_chars(t));
                }
            }
            if ch.index == 0 {
                if let Some(f) = ch.finish_reason {
                    c.finish_reason = Some(keel_canary::analysis::FinishReason::parse(&f));
                }
            }
        }
    }
    c
}

/// End of the first event: (offset of its blank line, separator length).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    for i in memchr::memchr_iter(b'\n', b) {
        if b.get(i + 1) == Some(&b'\n') {
            return Some((i, 2));
        }
        if i >= 1 && b[i - 1] == b'\r' && b.get(i + 1..i + 3) == Some(b"\r\n") {
            return Some((i - 1, 4));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_bodies() {
        let b = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(
            usage_of_body(b),
            Some(TokenUsage {
                prompt: 3,
                completion: 4
            })
        );
        assert_eq!(
            usage_of_body(br#"{"usage":{"prompt_tokens":5,"total_tokens":5}}"#),
            Some(TokenUsage {
                prompt: 5,
                completion: 0
            })
        );
        assert_eq!(usage_of_body(br#"{"usage":null}"#), None);
        assert_eq!(usage_of_body(b"not json"), None);
    }

    #[test]
    fn oip_output_means_read_the_first_output_only_and_a_bounded_part() {
        let body = br#"{"model_name":"m","id":"1","outputs":[{"name":"o0","shape":[4],"datatype":"FP32","data":[1.0,2,3.5,-0.5]},{"name":"o1","data":[100]}],"parameters":{"x":[1]}}"#;
        assert_eq!(oip_output_mean(body), Some(1.5));
        // Nested data, keys in any order.
        let body = br#"{"outputs":[{"data":[[1,2],[3,4]],"name":"o","shape":[2,2]}]}"#;
        assert_eq!(oip_output_mean(body), Some(2.5));
        // Only the first MAX_OUTPUT_VALUES values count.
        let mut data: Vec<f64> = vec![1.0; MAX_OUTPUT_VALUES as usize];
        data.extend([1000.0; 10]);
        let body = serde_json::json!({"outputs": [{"data": data}]}).to_string();
        assert_eq!(oip_output_mean(body.as_bytes()), Some(1.0));
        // No number, no outputs, not JSON, an OpenAI answer: unknown.
        for b in [
            &br#"{"outputs":[{"datatype":"BYTES","data":["a","b"]}]}"#[..],
            br#"{"outputs":[]}"#,
            br#"{"error":"no"}"#,
            b"not json",
            br#"{"outputs":[{"data":[1]}]} trailing"#,
            br#"{"choices":[{"message":{"content":"hi"}}]}"#,
        ] {
            assert_eq!(oip_output_mean(b), None, "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn answer_summaries_from_bodies() {
        use keel_canary::analysis::FinishReason;
        let b = br#"{"choices":[{"message":{"content":" a b\n c "},"finish_reason":"length"},{"message":{"content":"xxxx"}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        assert_eq!(
            summary_of_body(b),
            Some(AnswerSummary {
                usage: Some(TokenUsage {
                    prompt: 3,
                    completion: 4
                }),
                finish_reason: Some(FinishReason::Length),
                answer_chars: Some(3),
            })
        );
        // An empty answer is 0 characters, not unknown; a completion's
        // `text` counts too; no choices at all is unknown.
        let b = br#"{"choices":[{"message":{"content":""},"finish_reason":"stop"}]}"#;
        let s = summary_of_body(b).expect("summary");
        assert_eq!(
            (s.usage, s.finish_reason, s.answer_chars),
            (None, Some(FinishReason::Stop), Some(0))
        );
        let b = r#"{"choices":[{"text":"héllo","finish_reason":"content_filter"}]}"#.as_bytes();
        let s = summary_of_body(b).expect("summary");
        assert_eq!(
            (s.finish_reason, s.answer_chars),
            (Some(FinishReason::Other), Some(5))
        );
        assert_eq!(
            summary_of_body(br#"{"data":[]}"#).map(|s| s.answer_chars),
            Some(None)
        );
        assert_eq!(summary_of_body(b"not json"), None);
    }

    #[test]
    fn sse_answer_length_and_finish_reason() {
        use keel_canary::analysis::FinishReason;
        let mut f = SseFilter::new(false);
        for ev in [
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ab \"}}]}\n\n",
            "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"zzzz\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"c\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
        ] {
            f.push(ev.as_bytes());
        }
        assert_eq!(
            (f.answer_chars, f.finish_reason, f.done),
            (3, Some(FinishReason::Length), false)
        );
        f.push(b"data: [DONE]\n\n");
        assert!(f.done);
    }

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
        "data: [DONE]\n\n"
    );

    fn run(strip: bool, split: usize) -> (String, SseFilter) {
        let mut f = SseFilter::new(strip);
        let mut out = Vec::new();
        for c in STREAM.as_bytes().chunks(split) {
            out.extend(f.push(c));
        }
        out.extend(f.finish());
        (String::from_utf8(out).expect("utf8"), f)
    }

    /// The first event end in `b`, one byte at a time: what
    /// `find_event_end` finds with memchr.
    fn event_end_by_bytes(b: &[u8]) -> Option<(usize, usize)> {
        (0..b.len()).find_map(|i| {
            if b[i..].starts_with(b"\n\n") {
                Some((i, 2))
            } else if b[i..].starts_with(b"\r\n\r\n") {
                Some((i, 4))
            } else {
                None
            }
        })
    }

    proptest::proptest! {
        #[test]
        fn event_ends_are_found_where_a_byte_scan_finds_them(
            b in proptest::collection::vec(proptest::sample::select(vec![b'\n', b'\r', b'x']), 0..40),
        ) {
            proptest::prop_assert_eq!(find_event_end(&b), event_end_by_bytes(&b));
        }

        #[test]
        fn sse_filter_never_panics_and_passes_streams_without_usage_unchanged(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            split in 1usize..64,
            strip in proptest::prelude::any::<bool>(),
        ) {
            let mut f = SseFilter::new(strip);
            let mut out = Vec::new();
            for c in data.chunks(split) {
                out.extend(f.push(c));
            }
            out.extend(f.finish());
            if !data.windows(7).any(|w| w == b"\"usage\"") {
                proptest::prop_assert_eq!(out, data);
            }
        }

        #[test]
        fn push_bytes_passes_on_what_push_does(
            events in proptest::collection::vec(proptest::sample::select(vec![
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ab \"}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{\"content\":\"c\"}}],\"usage\":null}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
                "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\r\n\r\n",
                ": keep-alive\n\n",
                "data: [DONE]\n\n",
                "data: {\"x\":",
                "\n",
            ]), 0..12),
            cuts in proptest::collection::vec(0usize..400, 0..6),
            strip in proptest::prelude::any::<bool>(),
        ) {
            let data = events.concat().into_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.push(0);
            cuts.push(data.len());
            cuts.sort_unstable();
            let (mut a, mut b) = (SseFilter::new(strip), SseFilter::new(strip));
            let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
            for w in cuts.windows(2) {
                let chunk = &data[w[0]..w[1]];
                out_a.extend(a.push(chunk));
                out_b.extend_from_slice(&b.push_bytes(Bytes::copy_from_slice(chunk)));
            }
            out_a.extend(a.finish());
            out_b.extend(b.finish());
            proptest::prop_assert_eq!(out_a, out_b);
            proptest::prop_assert_eq!(
                (a.usage, a.done, a.events, a.content_bytes, a.answer_chars, a.finish_reason),
                (b.usage, b.done, b.events, b.content_bytes, b.answer_chars, b.finish_reason)
            );
        }

        #[test]
        fn push_bytes_passes_on_what_push_does_for_any_bytes(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            split in 1usize..64,
            strip in proptest::prelude::any::<bool>(),
        ) {
            let (mut a, mut b) = (SseFilter::new(strip), SseFilter::new(strip));
            let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
            for c in data.chunks(split) {
                out_a.extend(a.push(c));
                out_b.extend_from_slice(&b.push_bytes(Bytes::copy_from_slice(c)));
            }
            out_a.extend(a.finish());
            out_b.extend(b.finish());
            proptest::prop_assert_eq!(out_a, out_b);
            proptest::prop_assert_eq!((a.usage, a.done, a.events), (b.usage, b.done, b.events));
        }

        #[test]
        fn audit_verify_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = crate::audit::verify(&data[..]);
        }
    }

    #[test]
    fn whole_events_that_pass_unchanged_are_handed_on_without_a_copy() {
        let mut f = SseFilter::new(true);
        let chunk = Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
        );
        let out = f.push_bytes(chunk.clone());
        assert_eq!(out.as_ptr(), chunk.as_ptr(), "the chunk's own bytes");
        assert_eq!(out.len(), chunk.len());
        // An unfinished event after whole ones: the whole ones go on, the
        // rest is held.
        let out = f.push_bytes(Bytes::from_static(b"data: [DONE]\n\ndata: {"));
        assert_eq!(&out[..], b"data: [DONE]\n\n");
        assert!(f.done);
        assert_eq!(f.finish(), b"data: {");
        assert_eq!(f.events, 3);
    }

    #[test]
    fn an_unfinished_event_is_held_only_up_to_its_cap() {
        let mut f = SseFilter::new(false);
        let mut out = f.push(b"data: {\"a\":1}\n\n");
        assert_eq!(out, b"data: {\"a\":1}\n\n");
        // A backend that never ends its event: held up to the cap, then
        // passed on as it is, never growing past it.
        let piece = vec![b'x'; 64 << 10];
        let mut passed = 0;
        for _ in 0..64 {
            out = f.push(&piece);
            passed += out.len();
            assert!(f.buf.len() <= MAX_PENDING_EVENT + piece.len());
        }
        passed += f.finish().len();
        assert_eq!(passed, 64 * piece.len(), "every byte is forwarded once");
    }

    #[test]
    fn sse_usage_read_and_stripped() {
        for split in [1, 7, 1000] {
            let (out, f) = run(false, split);
            assert_eq!(out, STREAM);
            assert_eq!(
                f.usage,
                Some(TokenUsage {
                    prompt: 3,
                    completion: 2
                })
            );
            assert!(f.done);
            let (out, f) = run(true, split);
            assert!(!out.contains("prompt_tokens"), "{out}");
            assert!(out.contains("\"content\":\"b\""));
            assert!(out.ends_with("data: [DONE]\n\n"));
            assert_eq!(f.usage.map(|u| u.total()), Some(5));
        }
    }
}
