//! A test model server for keel's gateway tests and benchmarks (never
//! shipped): OpenAI-compatible (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings`, `/v1/models`, SSE streaming with the usage chunk when
//! asked) and Open Inference Protocol v2 (`/v2/health/*`,
//! `/v2/models/{m}[/versions/{v}][/ready|/infer]`).
//!
//! ```text
//! keel-testbackend [--listen ADDR] [--name NAME] [--latency-ms N] [--tokens N]
//!                  [--chunk-delay-ms N] [--mode ok|error|unavailable|ratelimit|hang]
//!                  [--usage asked|always|never] [--threads N]
//!                  [--length-fields F1,F2,...]
//!                  [--empty-percent P] [--length-percent P] [--error-percent P]
//!                  [--oip-shift X]
//!                  [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
//! ```
//!
//! With `--tls-cert` and `--tls-key` (PEM) it serves HTTPS (TLS 1.2 and
//! 1.3, ALPN `http/1.1`); `--tls-client-ca` makes it require a client
//! certificate issued by that CA. It prints `listening on ADDR` once bound. At run time `POST /_control`
//! with `{"mode": ..., "latency_ms": ..., "healthy": ..., "tokens": ...}`
//! changes its behaviour and `GET /_stats` counts what it was sent. Prompt
//! tokens are a quarter of the prompt's text bytes, rounded up, plus one
//! per number or boolean (the same rule keel uses to estimate) plus a
//! quarter of the bytes of the fields a chat template renders (`tools`,
//! `functions`, `documents`, `chat_template`, `chat_template_kwargs`);
//! completion tokens are `min(max_tokens, --tokens)` for each of the `n`
//! (or `best_of`) choices, `max_tokens` being the larger of `max_tokens`
//! and `max_completion_tokens`. With `--length-fields` it reads those
//! fields instead, the first one present deciding, as llama.cpp's server
//! reads `n_predict`, then `max_completion_tokens`, then `max_tokens`
//! (`n_predict,max_completion_tokens,max_tokens`, the order of the real
//! server's aliases, docs/serve.md "Tested against real servers"): -1, or
//! none of them, is no limit (`--tokens` a choice), and a value below -1
//! is refused with 400, as the real server refuses it.
//! Mode `unavailable` answers 503 with `Retry-After: 120`, `ratelimit` 429
//! with `Retry-After: 2`, `error` 500.
//!
//! Shifted outputs, for canary tests, each on exactly P of every 100
//! completions in the order they arrive (a different run of them for each,
//! so they overlap as little as they can): `--empty-percent` answers with
//! no text and no completion tokens, `--length-percent` ends the answer
//! with finish reason `length`, `--error-percent` answers 500. Slower
//! answers are `--latency-ms`; longer or shorter ones `--tokens`. All are
//! also `/_control` keys (`empty_percent`, `length_percent`,
//! `error_percent`).
//!
//! An OIP inference answers one `FP32` output `output0` with one value per
//! input: `1.0 + (7k + j mod 10) / 10` for input j of the k-th inference,
//! so that each answer's mean varies between 1.0 and 1.9; `--oip-shift X`
//! (`/_control` key `oip_shift`) adds X to every value.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

#[derive(Debug)]
struct State {
    name: String,
    mode: Mutex<String>,
    usage: String,
    latency_ms: AtomicU64,
    chunk_delay_ms: AtomicU64,
    tokens: AtomicU64,
    /// The length fields read, in order (empty: OpenAI's two).
    length_fields: Vec<String>,
    healthy: AtomicBool,
    counter: AtomicU64,
    completions: AtomicU64,
    empty_percent: AtomicU64,
    length_percent: AtomicU64,
    error_percent: AtomicU64,
    /// The bits of the f64 added to OIP output values.
    oip_shift: AtomicU64,
    oip_infers: AtomicU64,
    stats: Mutex<BTreeMap<String, u64>>,
}

#[derive(Debug)]
enum TBody {
    Full(Option<Bytes>),
    Chan(mpsc::Receiver<Bytes>),
}

impl Body for TBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            TBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            TBody::Chan(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }
}

fn reply(status: StatusCode, v: Value) -> Response<TBody> {
    let mut r = Response::new(TBody::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// The bytes of the top-level fields a chat template renders, as sent.
fn tools_bytes(body: &[u8]) -> u64 {
    use serde_json::value::RawValue;
    serde_json::from_slice::<BTreeMap<String, &RawValue>>(body).map_or(0, |m| {
        [
            "tools",
            "functions",
            "documents",
            "chat_template",
            "chat_template_kwargs",
        ]
        .iter()
        .filter_map(|k| m.get(*k))
        .map(|r| r.get().len() as u64)
        .sum()
    })
}

/// The words of OpenAI's message format, which keel's estimate does not
/// count (its `FORMAT_KEYS`, `FORMAT_ROLES` and `FORMAT_TYPES`).
const FORMAT_KEYS: [&str; 24] = [
    "role",
    "content",
    "name",
    "type",
    "text",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "id",
    "function",
    "arguments",
    "image_url",
    "url",
    "detail",
    "input_audio",
    "data",
    "format",
    "refusal",
    "audio",
    "file",
    "file_id",
    "filename",
    "file_data",
    "reasoning_content",
];
const FORMAT_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];
const FORMAT_TYPES: [&str; 6] = [
    "text",
    "image_url",
    "input_audio",
    "file",
    "function",
    "refusal",
];

/// A quarter of the prompt's text bytes (every string and object key but
/// the message format's words), rounded up; one per number or boolean
/// (keel's estimate, kept the same on purpose).
fn estimate_tokens(v: &Value) -> u64 {
    fn walk(v: &Value, key: &str, bytes: &mut u64, ids: &mut u64, depth: u32) {
        if depth > 64 {
            *bytes += v.to_string().len() as u64;
            return;
        }
        match v {
            Value::String(s) if key == "role" && FORMAT_ROLES.contains(&s.as_str()) => {}
            Value::String(s) if key == "type" && FORMAT_TYPES.contains(&s.as_str()) => {}
            Value::String(s) => *bytes += s.len() as u64,
            Value::Number(_) | Value::Bool(_) => *ids += 1,
            Value::Array(a) => a.iter().for_each(|x| walk(x, "", bytes, ids, depth + 1)),
            Value::Object(o) => {
                for (k, x) in o {
                    if !FORMAT_KEYS.contains(&k.as_str()) {
                        *bytes += k.len() as u64;
                    }
                    walk(x, k, bytes, ids, depth + 1);
                }
            }
            Value::Null => {}
        }
    }
    let (mut bytes, mut ids) = (0, 0);
    walk(v, "", &mut bytes, &mut ids, 0);
    bytes.div_ceil(4) + ids
}

impl State {
    fn count(&self, key: &str) {
        *self
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_owned())
            .or_default() += 1;
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<TBody> {
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        match (&method, path.as_str()) {
            (&Method::GET, "/health" | "/v2/health/live" | "/v2/health/ready") => {
                self.count("health");
                return if self.healthy.load(Ordering::Relaxed) {
                    reply(StatusCode::OK, json!({"status": "ok"}))
                } else {
                    reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        json!({"error": "unhealthy"}),
                    )
                };
            }
            (&Method::GET, "/_stats") => {
                let s = self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
                return reply(StatusCode::OK, json!({"name": self.name, "counts": s}));
            }
            (&Method::POST, "/_control") => {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if let Some(m) = v.get("mode").and_then(Value::as_str) {
                    *self.mode.lock().unwrap_or_else(|p| p.into_inner()) = m.to_owned();
                }
                if let Some(l) = v.get("latency_ms").and_then(Value::as_u64) {
                    self.latency_ms.store(l, Ordering::Relaxed);
                }
                if let Some(t) = v.get("tokens").and_then(Value::as_u64) {
                    self.tokens.store(t, Ordering::Relaxed);
                }
                for (k, a) in [
                    ("empty_percent", &self.empty_percent),
                    ("length_percent", &self.length_percent),
                    ("error_percent", &self.error_percent),
                ] {
                    if let Some(p) = v.get(k).and_then(Value::as_u64) {
                        a.store(p.min(100), Ordering::Relaxed);
                    }
                }
                if let Some(x) = v.get("oip_shift").and_then(Value::as_f64) {
                    self.oip_shift.store(x.to_bits(), Ordering::Relaxed);
                }
                if let Some(h) = v.get("healthy").and_then(Value::as_bool) {
                    self.healthy.store(h, Ordering::Relaxed);
                }
                if v.get("reset").and_then(Value::as_bool) == Some(true) {
                    self.stats.lock().unwrap_or_else(|p| p.into_inner()).clear();
                }
                return reply(StatusCode::OK, json!({"ok": true}));
            }
            _ => {}
        }
        self.count(&path);
        let mode = self.mode.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match mode.as_str() {
            "error" => {
                return reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({"error": "test backend in error mode"}),
                )
            }
            "unavailable" => {
                let mut r = reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    json!({"error": "test backend unavailable"}),
                );
                r.headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("120"));
                return r;
            }
            "ratelimit" => {
                let mut r = reply(
                    StatusCode::TOO_MANY_REQUESTS,
                    json!({"error": "test backend rate limited"}),
                );
                r.headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("2"));
                return r;
            }
            "hang" => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            _ => {}
        }
        let latency = self.latency_ms.load(Ordering::Relaxed);
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            self.count(&format!("model:{m}"));
        }
        let max = if self.length_fields.is_empty() {
            ["max_completion_tokens", "max_tokens"]
                .iter()
                .filter_map(|k| v.get(*k).and_then(Value::as_u64))
                .max()
        } else {
            let first = self
                .length_fields
                .iter()
                .find_map(|k| v.get(k).filter(|x| !x.is_null()).map(|x| (k, x)));
            // llama.cpp's hard limit on n_predict and its aliases: -1 to
            // i32::MAX.
            if let Some((k, x)) = first {
                if x.as_i64().is_some_and(|n| n < -1) {
                    return reply(
                        StatusCode::BAD_REQUEST,
                        json!({"error": {"code": 400, "type": "invalid_request_error", "message": format!("Field '{k}': Value must be between -1 <= value <= 2147483647, but got {x}")}}),
                    );
                }
            }
            first.and_then(|(_, x)| x.as_u64())
        };
        let per_choice = max.map_or(self.tokens.load(Ordering::Relaxed), |m| {
            m.min(self.tokens.load(Ordering::Relaxed))
        });
        let choices = ["n", "best_of"]
            .iter()
            .filter_map(|k| v.get(*k).and_then(Value::as_u64))
            .max()
            .unwrap_or(1)
            .clamp(1, 128);
        let completion = per_choice * choices;
        let model = v.get("model").cloned().unwrap_or(json!("test"));
        match (&method, path.as_str()) {
            (&Method::GET, "/v1/models") => reply(
                StatusCode::OK,
                json!({"object": "list", "data": [{"id": "test", "object": "model", "owned_by": self.name}]}),
            ),
            (&Method::POST, "/v1/chat/completions" | "/v1/completions") => {
                let chat = path == "/v1/chat/completions";
                // The k-th of every 100 completions; each shift takes its
                // own run of them.
                let c = self.completions.fetch_add(1, Ordering::Relaxed) % 100;
                let hit = |a: &AtomicU64, offset: u64| {
                    (c + 100 - offset) % 100 < a.load(Ordering::Relaxed)
                };
                if hit(&self.error_percent, 67) {
                    self.count("shift:error");
                    return reply(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        json!({"error": "test backend error share"}),
                    );
                }
                let empty = hit(&self.empty_percent, 0);
                let finish = if hit(&self.length_percent, 33) {
                    "length"
                } else {
                    "stop"
                };
                let (per_choice, completion) = if empty {
                    self.count("shift:empty");
                    (0, 0)
                } else {
                    (per_choice, completion)
                };
                let prompt = estimate_tokens(
                    v.get(if chat { "messages" } else { "prompt" })
                        .unwrap_or(&Value::Null),
                ) + tools_bytes(&body).div_ceil(4);
                let usage = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
                let text = "tok ".repeat(per_choice as usize);
                if v.get("stream").and_then(Value::as_bool) == Some(true) {
                    let asked = v
                        .pointer("/stream_options/include_usage")
                        .and_then(Value::as_bool)
                        == Some(true);
                    if asked {
                        self.count("include_usage");
                    }
                    let send_usage = match self.usage.as_str() {
                        "always" => true,
                        "never" => false,
                        _ => asked,
                    };
                    return self.stream(
                        n,
                        chat,
                        model,
                        completion,
                        finish,
                        send_usage.then_some(usage),
                    );
                }
                let choice = |i: u64| {
                    if chat {
                        json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
                    } else {
                        json!({"index": i, "text": text, "finish_reason": finish})
                    }
                };
                let mut body = json!({
                    "id": format!("cmpl-{n}"),
                    "object": if chat { "chat.completion" } else { "text_completion" },
                    "created": 0,
                    "model": model,
                    "system_fingerprint": self.name,
                    "choices": (0..choices).map(choice).collect::<Vec<_>>(),
                });
                if self.usage != "never" {
                    body["usage"] = usage;
                }
                reply(StatusCode::OK, body)
            }
            (&Method::POST, "/v1/embeddings") => {
                let prompt = estimate_tokens(v.get("input").unwrap_or(&Value::Null));
                reply(
                    StatusCode::OK,
                    json!({"object": "list", "model": model, "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}], "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}),
                )
            }
            (m, p) if p.starts_with("/v2/models/") => {
                let rest: Vec<&str> = p["/v2/models/".len()..].split('/').collect();
                let name = rest.first().copied().unwrap_or("");
                match (m, rest.last().copied()) {
                    (&Method::GET, Some("ready")) => {
                        reply(StatusCode::OK, json!({"name": name, "ready": true}))
                    }
                    (&Method::POST, Some("infer")) => {
                        let Some(inputs) = v.get("inputs").and_then(Value::as_array) else {
                            return reply(StatusCode::BAD_REQUEST, json!({"error": "no inputs"}));
                        };
                        let k = self.oip_infers.fetch_add(1, Ordering::Relaxed);
                        let shift = f64::from_bits(self.oip_shift.load(Ordering::Relaxed));
                        let data: Vec<f64> = (0..inputs.len() as u64)
                            .map(|j| 1.0 + ((7 * k + j) % 10) as f64 / 10.0 + shift)
                            .collect();
                        reply(
                            StatusCode::OK,
                            json!({"model_name": name, "id": v.get("id"), "outputs": [{"name": "output0", "shape": [inputs.len()], "datatype": "FP32", "data": data}], "parameters": {"backend": self.name}}),
                        )
                    }
                    (&Method::GET, _) => reply(
                        StatusCode::OK,
                        json!({"name": name, "versions": ["1"], "platform": "keel-testbackend", "inputs": [], "outputs": []}),
                    ),
                    _ => reply(StatusCode::NOT_FOUND, json!({"error": "not found"})),
                }
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                json!({"error": format!("no route {method} {path}")}),
            ),
        }
    }

    fn stream(
        &self,
        n: u64,
        chat: bool,
        model: Value,
        completion: u64,
        finish: &'static str,
        usage: Option<Value>,
    ) -> Response<TBody> {
        let (tx, rx) = mpsc::channel::<Bytes>(4);
        let delay = Duration::from_millis(self.chunk_delay_ms.load(Ordering::Relaxed));
        let id = format!("cmpl-{n}");
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        tokio::spawn(async move {
            let ev = |v: Value| Bytes::from(format!("data: {v}\n\n"));
            let choice = |content: Option<&str>, finish: Option<&str>| {
                if chat {
                    json!({"index": 0, "delta": content.map_or(json!({}), |c| json!({"content": c})), "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": content.unwrap_or(""), "finish_reason": finish})
                }
            };
            let chunk = |choices: Value| json!({"id": id, "object": object, "created": 0, "model": model, "choices": choices});
            if chat {
                let first = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]);
                if tx.send(ev(chunk(first))).await.is_err() {
                    return;
                }
            }
            for _ in 0..completion {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                if tx
                    .send(ev(chunk(json!([choice(Some("tok "), None)]))))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx
                .send(ev(chunk(json!([choice(None, Some(finish))]))))
                .await;
            if let Some(u) = usage {
                let mut c = chunk(json!([]));
                c["usage"] = u;
                let _ = tx.send(ev(c)).await;
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(TBody::Chan(rx));
        r.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("text/event-stream"),
        );
        r.headers_mut()
            .insert("cache-control", http::HeaderValue::from_static("no-cache"));
        r
    }
}

/// The server side of `--tls-cert`, `--tls-key` and `--tls-client-ca`.
fn tls_config(cert: &str, key: &str, client_ca: Option<&str>) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .unwrap_or_else(|e| die(&format!("--tls-cert {cert}: {e}")));
    let key =
        PrivateKeyDer::from_pem_file(key).unwrap_or_else(|e| die(&format!("--tls-key {key}: {e}")));
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|e| die(&e.to_string()));
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(ca)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .unwrap_or_else(|e| die(&format!("--tls-client-ca {ca}: {e}")));
            for c in certs {
                roots
                    .add(c)
                    .unwrap_or_else(|e| die(&format!("--tls-client-ca {ca}: {e}")));
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .unwrap_or_else(|e| die(&format!("--tls-client-ca {ca}: {e}")));
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut cfg = builder
        .with_single_cert(chain, key)
        .unwrap_or_else(|e| die(&format!("--tls-cert/--tls-key: {e}")));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
}

async fn serve_connection<I>(io: I, st: Arc<State>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let st = st.clone();
        async move { Ok::<_, Infallible>(st.handle(req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

/// A percentage from the command line, at most 100.
fn percent(p: u64) -> u64 {
    if p > 100 {
        die(&format!("{p} is not a percentage (0 to 100)"));
    }
    p
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:0".to_owned();
    let mut st = State {
        name: "backend".into(),
        mode: Mutex::new("ok".into()),
        usage: "asked".into(),
        latency_ms: AtomicU64::new(0),
        chunk_delay_ms: AtomicU64::new(0),
        tokens: AtomicU64::new(16),
        length_fields: Vec::new(),
        healthy: AtomicBool::new(true),
        counter: AtomicU64::new(0),
        completions: AtomicU64::new(0),
        empty_percent: AtomicU64::new(0),
        length_percent: AtomicU64::new(0),
        error_percent: AtomicU64::new(0),
        oip_shift: AtomicU64::new(0f64.to_bits()),
        oip_infers: AtomicU64::new(0),
        stats: Mutex::new(BTreeMap::new()),
    };
    let mut threads = 0usize;
    let (mut tls_cert, mut tls_key, mut tls_client_ca) = (None, None, None);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| die(&format!("{a} needs a value")))
        };
        let num = |v: String| {
            v.parse::<u64>()
                .unwrap_or_else(|_| die(&format!("{a}: {v:?} is not a number")))
        };
        match a.as_str() {
            "--listen" => listen = val(),
            "--name" => st.name = val(),
            "--latency-ms" => st.latency_ms = AtomicU64::new(num(val())),
            "--chunk-delay-ms" => st.chunk_delay_ms = AtomicU64::new(num(val())),
            "--tokens" => st.tokens = AtomicU64::new(num(val())),
            "--mode" => st.mode = Mutex::new(val()),
            "--usage" => st.usage = val(),
            "--length-fields" => st.length_fields = val().split(',').map(str::to_owned).collect(),
            "--threads" => threads = num(val()) as usize,
            "--empty-percent" => st.empty_percent = AtomicU64::new(percent(num(val()))),
            "--length-percent" => st.length_percent = AtomicU64::new(percent(num(val()))),
            "--error-percent" => st.error_percent = AtomicU64::new(percent(num(val()))),
            "--oip-shift" => {
                let v = val();
                let x = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .unwrap_or_else(|| die(&format!("{a}: {v:?} is not a number")));
                st.oip_shift = AtomicU64::new(x.to_bits());
            }
            "--tls-cert" => tls_cert = Some(val()),
            "--tls-key" => tls_key = Some(val()),
            "--tls-client-ca" => tls_client_ca = Some(val()),
            "-h" | "--help" => {
                println!("keel-testbackend [--listen ADDR] [--name NAME] [--latency-ms N] [--tokens N] [--chunk-delay-ms N] [--mode ok|error|unavailable|ratelimit|hang] [--usage asked|always|never] [--threads N] [--length-fields F1,F2,...] [--empty-percent P] [--length-percent P] [--error-percent P] [--oip-shift X] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]");
                return;
            }
            _ => die(&format!("unknown argument {a}")),
        }
    }
    let tls = match (&tls_cert, &tls_key) {
        (Some(c), Some(k)) => Some(tls_config(c, k, tls_client_ca.as_deref())),
        (None, None) if tls_client_ca.is_none() => None,
        _ => die("--tls-cert and --tls-key go together (and --tls-client-ca needs them)"),
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        rt.worker_threads(threads);
    }
    let rt = rt
        .enable_all()
        .build()
        .unwrap_or_else(|e| die(&format!("runtime: {e}")));
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(&listen)
            .await
            .unwrap_or_else(|e| die(&format!("bind {listen}: {e}")));
        let addr = l.local_addr().unwrap_or_else(|e| die(&e.to_string()));
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
        let st = Arc::new(st);
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            let st = st.clone();
            match &tls {
                None => {
                    tokio::spawn(serve_connection(s, st));
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        // A failed or stalled handshake closes the connection.
                        let hs = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(s));
                        if let Ok(Ok(s)) = hs.await {
                            serve_connection(s, st).await;
                        }
                    });
                }
            }
        }
    });
}

fn die(msg: &str) -> ! {
    eprintln!("keel-testbackend: {msg}");
    std::process::exit(64)
}
