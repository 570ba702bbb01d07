//! The access log's side of a request: its id (the `x-request-id`
//! header), what the log reads from a response, the record handed to a
//! sink, and the JSON line in the shape of the `tracing` events around it.

use std::sync::Arc;

use http::{HeaderValue, Method};

/// What the access log layer reads from a response.
#[derive(Debug, Clone, Default)]
pub struct AccessInfo {
    pub request_id: RequestId,
    pub route: &'static str,
    pub key: Option<Arc<str>>,
    pub model: Option<Arc<str>>,
    pub deployment: Option<Arc<str>>,
    pub stream: bool,
}

/// A request's id: 16 hex digits, kept inline (it goes into two headers
/// and two log lines).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestId {
    hex: [u8; 16],
    len: u8,
}

impl RequestId {
    pub fn new(n: u64) -> Self {
        let mut hex = [0u8; 16];
        crate::digits::hex_into(&n.to_be_bytes(), &mut hex);
        Self { hex, len: 16 }
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.hex[..self.len as usize]).unwrap_or("")
    }

    pub fn header_value(&self) -> HeaderValue {
        HeaderValue::from_bytes(&self.hex[..self.len as usize])
            .unwrap_or(HeaderValue::from_static(""))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Takes one access-log record.
pub type AccessSink = Arc<dyn Fn(AccessRecord) + Send + Sync>;

/// One answered request as the access log records it.
#[derive(Debug, Clone)]
pub struct AccessRecord {
    /// When the response was handed to the connection.
    pub at: std::time::SystemTime,
    pub method: Method,
    pub status: u16,
    pub duration_ms: f64,
    pub info: AccessInfo,
}

/// Hands one record to the sink, or without one writes it as a `tracing`
/// event (target `keel::access`).
pub fn emit_access(sink: Option<&AccessSink>, r: AccessRecord) {
    match sink {
        Some(sink) => sink(r),
        None => {
            let info = &r.info;
            tracing::info!(
                target: "keel::access",
                request_id = %info.request_id,
                method = %r.method,
                route = info.route,
                status = r.status,
                duration_ms = r.duration_ms,
                key = info.key.as_deref().unwrap_or("-"),
                model = info.model.as_deref().unwrap_or("-"),
                deployment = info.deployment.as_deref().unwrap_or("-"),
                stream = info.stream,
                "request"
            )
        }
    }
}

/// One access-log line in the shape of the JSON `tracing` events around
/// it: `{"timestamp":..,"level":"INFO","fields":{"message":"request",..},"target":"keel::access"}`,
/// ending in a newline.
pub fn access_line(r: &AccessRecord, out: &mut Vec<u8>) {
    #[derive(serde::Serialize)]
    struct Fields<'a> {
        message: &'static str,
        request_id: &'a str,
        method: &'a str,
        route: &'static str,
        status: u16,
        duration_ms: f64,
        key: &'a str,
        model: &'a str,
        deployment: &'a str,
        stream: bool,
    }
    #[derive(serde::Serialize)]
    struct Line<'a> {
        timestamp: &'a str,
        level: &'static str,
        fields: Fields<'a>,
        target: &'static str,
    }
    let us =
        r.at.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
    let stamp = crate::clock::Stamp::micros(us);
    let i = &r.info;
    let line = Line {
        timestamp: stamp.as_str(),
        level: "INFO",
        fields: Fields {
            message: "request",
            request_id: i.request_id.as_str(),
            method: r.method.as_str(),
            route: i.route,
            status: r.status,
            duration_ms: r.duration_ms,
            key: i.key.as_deref().unwrap_or("-"),
            model: i.model.as_deref().unwrap_or("-"),
            deployment: i.deployment.as_deref().unwrap_or("-"),
            stream: i.stream,
        },
        target: "keel::access",
    };
    let start = out.len();
    if serde_json::to_writer(&mut *out, &line).is_err() {
        out.truncate(start);
        return;
    }
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::Duration;

    #[test]
    fn access_lines_have_the_shape_of_the_tracing_events() {
        let i = AccessInfo {
            request_id: RequestId::new(0xff),
            route: "/v1/chat/completions",
            key: Some("key_1".into()),
            model: Some("chat \"x\"".into()),
            deployment: None,
            stream: true,
        };
        let t = std::time::UNIX_EPOCH + Duration::from_micros(1_780_000_000_123_456);
        let r = AccessRecord {
            at: t,
            method: Method::POST,
            status: 429,
            duration_ms: 1.5,
            info: i,
        };
        let mut line = b"before\n".to_vec();
        access_line(&r, &mut line);
        let line = line.strip_prefix(b"before\n").expect("appended");
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        let v: serde_json::Value = serde_json::from_slice(line).expect("one JSON object");
        assert_eq!(v["timestamp"], "2026-05-28T20:26:40.123456Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], "keel::access");
        assert_eq!(
            v["fields"],
            json!({"message": "request", "request_id": "00000000000000ff", "method": "POST",
                   "route": "/v1/chat/completions", "status": 429, "duration_ms": 1.5,
                   "key": "key_1", "model": "chat \"x\"", "deployment": "-", "stream": true})
        );
    }
}
