//! Request parsing on arbitrary bytes: routes, OpenAI bodies, OIP input
//! tensors (drift features), drift baselines, the SSE filter, and audit
//! lines. None may panic. The proptests in
//! keel-gateway (`request::tests`, `proxy::tests`) run the same parsers in CI.
#![no_main]

use libfuzzer_sys::fuzz_target;

use keel_gateway::parts::SseFilter;
use keel_gateway::parts::{parse_openai, route};

fuzz_target!(|data: &[u8]| {
    for field in ["messages", "prompt", "input"] {
        let _ = parse_openai(&bytes::Bytes::copy_from_slice(data), field);
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = route(&http::Method::GET, s);
        let _ = route(&http::Method::POST, s);
    }
    let split = data.first().map_or(1, |b| *b as usize % 17 + 1);
    for strip in [false, true] {
        let mut f = SseFilter::new(strip);
        for c in data.chunks(split) {
            let _ = f.push(c);
        }
        let _ = f.finish();
    }
    let _ = keel_gateway::audit::verify(data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let inputs = keel_gateway::parts::oip_inputs(&v);
        assert!(inputs.0.len() <= keel_gateway::parts::MAX_INPUT_FEATURES);
        if let Ok(f) = serde_json::from_value(v) {
            let _ = keel_gateway::drift_baseline::Baseline::check(f, "m");
        }
    }
});
