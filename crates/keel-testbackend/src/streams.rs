//! Long SSE streams at scale, for `scripts/bench-streams` and the gateway's
//! concurrency tests: a streaming backend that holds thousands of streams
//! on one thread, and a load generator that keeps N streams open through a
//! proxy and measures what the proxy adds.
//!
//! The backend answers `POST /v1/chat/completions` (and `/v1/completions`)
//! with `"stream": true` as OpenAI's server-sent events: after a time to
//! first token, one token every interval (each drawn at random from a
//! range, seeded per stream), a count of tokens drawn from a range and
//! capped at the request's `max_tokens`/`max_completion_tokens`, then the
//! usage chunk when `stream_options.include_usage` asked for it, then
//! `data: [DONE]`. Each token's text is `SEQ@SENT_US ` (the first token's
//! `0@SENT_US@ARRIVED_US `): its number in the stream, the wall-clock
//! microsecond the backend sent it (and when the request arrived), so that
//! the client can subtract the backend's own time from what it sees, and
//! check that every token came, in order. The text is what every gateway
//! passes on unchanged (some rebuild the chunk around it).
//!
//! `hold_until = Some(n)` holds every stream after its first token until
//! `n` streams have sent theirs: no stream can end before `n` are open at
//! once, so a test knows they were concurrent without timing anything.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

/// Microseconds since the Unix epoch, now (the wall clock both processes
/// of a benchmark share).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A small, fast, seedable generator (SplitMix64).
#[derive(Debug, Clone, Copy)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next() % (hi - lo + 1)
        }
    }
}

/// How the backend streams.
#[derive(Debug, Clone)]
pub struct BackendOptions {
    /// From the request's arrival to the first token.
    pub ttft: Duration,
    /// Between two tokens: uniform in this range.
    pub interval: (Duration, Duration),
    /// Tokens a stream: uniform in this range, capped at the request's
    /// `max_tokens`.
    pub tokens: (u32, u32),
    /// Hold every stream after its first token until this many streams
    /// have sent theirs.
    pub hold_until: Option<usize>,
    /// Seed of the streams' draws.
    pub seed: u64,
}

impl Default for BackendOptions {
    fn default() -> Self {
        Self {
            ttft: Duration::from_millis(200),
            interval: (Duration::from_millis(250), Duration::from_millis(500)),
            tokens: (50, 500),
            hold_until: None,
            seed: 1,
        }
    }
}

/// The streaming backend's state, shared by its connections.
#[derive(Debug)]
pub struct Backend {
    opts: BackendOptions,
    /// Streams started (their draws' seeds).
    started: AtomicU64,
    /// Streams whose first token was sent.
    first_sent: AtomicUsize,
    /// Woken when `first_sent` reaches `hold_until`.
    release: Arc<Notify>,
    /// Streams that sent their last event.
    finished: AtomicU64,
    /// Tokens reported in usage chunks (prompt and completion), summed.
    usage_reported: AtomicU64,
    /// Completion tokens sent.
    tokens_sent: AtomicU64,
}

impl Backend {
    pub fn new(opts: BackendOptions) -> Arc<Self> {
        Arc::new(Self {
            opts,
            started: AtomicU64::new(0),
            first_sent: AtomicUsize::new(0),
            release: Arc::new(Notify::new()),
            finished: AtomicU64::new(0),
            usage_reported: AtomicU64::new(0),
            tokens_sent: AtomicU64::new(0),
        })
    }

    /// Streams started so far.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }
    /// Streams that sent their last event.
    pub fn finished(&self) -> u64 {
        self.finished.load(Ordering::Relaxed)
    }
    /// Prompt plus completion tokens of every usage chunk sent.
    pub fn usage_reported(&self) -> u64 {
        self.usage_reported.load(Ordering::Relaxed)
    }
    /// Completion tokens sent.
    pub fn tokens_sent(&self) -> u64 {
        self.tokens_sent.load(Ordering::Relaxed)
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<StreamBody> {
        let arrived = now_us();
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        if method == Method::GET {
            return match path.as_str() {
                "/health" | "/v1/models" => json(
                    StatusCode::OK,
                    r#"{"status":"ok","object":"list","data":[{"id":"m","object":"model"}]}"#,
                ),
                _ => json(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#),
            };
        }
        if method != Method::POST || !path.ends_with("/completions") {
            return json(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#);
        }
        let Ok(body) = Limited(req.into_body()).collect(1 << 20).await else {
            return json(StatusCode::PAYLOAD_TOO_LARGE, r#"{"error":"body"}"#);
        };
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let max = ["max_tokens", "max_completion_tokens"]
            .iter()
            .filter_map(|k| v.get(*k).and_then(Value::as_u64))
            .max();
        let stream = v.get("stream").and_then(Value::as_bool) == Some(true);
        let usage = v
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        // A quarter of the body's bytes: any number will do, as long as
        // the usage chunk says it.
        let prompt = (body.len() as u64).div_ceil(4);
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        let mut rng = Rng(self.opts.seed ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let (lo, hi) = self.opts.tokens;
        let mut total = rng.range(u64::from(lo), u64::from(hi));
        if let Some(m) = max {
            total = total.min(m);
        }
        let total = total as u32;
        if !stream {
            self.finished.fetch_add(1, Ordering::Relaxed);
            self.tokens_sent
                .fetch_add(u64::from(total), Ordering::Relaxed);
            self.usage_reported
                .fetch_add(prompt + u64::from(total), Ordering::Relaxed);
            let text: String = (0..total).map(|i| format!("{i} ")).collect();
            return json(
                StatusCode::OK,
                &format!(
                    r#"{{"id":"cmpl-{n}","object":"chat.completion","created":1,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{total},"total_tokens":{}}}}}"#,
                    prompt + u64::from(total)
                ),
            );
        }
        let first = Instant::now() + self.opts.ttft;
        let body = StreamBody::Tokens(Box::new(TokenStream {
            sleep: Box::pin(tokio::time::sleep_until(first)),
            hold: None,
            held: false,
            arrived,
            next: 0,
            total,
            rng,
            usage,
            prompt,
            id: n,
            done: false,
            backend: self,
        }));
        let mut r = Response::new(body);
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r.headers_mut().insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        r
    }
}

/// A request body read up to a size.
struct Limited(Incoming);

impl Limited {
    async fn collect(mut self, max: usize) -> Result<Bytes, ()> {
        let mut out = BytesMut::new();
        while let Some(f) = self.0.frame().await {
            let f = f.map_err(|_| ())?;
            if let Ok(d) = f.into_data() {
                if out.len() + d.len() > max {
                    return Err(());
                }
                out.extend_from_slice(&d);
            }
        }
        Ok(out.freeze())
    }
}

fn json(status: StatusCode, body: &str) -> Response<StreamBody> {
    let mut r = Response::new(StreamBody::Full(Some(Bytes::copy_from_slice(
        body.as_bytes(),
    ))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The backend's response body: a whole one, or a stream of tokens.
#[derive(Debug)]
pub enum StreamBody {
    Full(Option<Bytes>),
    Tokens(Box<TokenStream>),
}

/// One stream's tokens, sent as their times come.
#[derive(Debug)]
pub struct TokenStream {
    backend: Arc<Backend>,
    sleep: Pin<Box<Sleep>>,
    hold: Option<Pin<Box<OwnedNotified>>>,
    /// Waiting to pass the hold before the next token.
    held: bool,
    arrived: u64,
    next: u32,
    total: u32,
    rng: Rng,
    usage: bool,
    prompt: u64,
    id: u64,
    done: bool,
}

impl TokenStream {
    /// Ready once the streams held after their first token may go on.
    fn poll_hold(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(n) = self.backend.opts.hold_until else {
            return Poll::Ready(());
        };
        loop {
            if self.backend.first_sent.load(Ordering::Acquire) >= n {
                self.hold = None;
                return Poll::Ready(());
            }
            match &mut self.hold {
                None => {
                    let mut w = Box::pin(self.backend.release.clone().notified_owned());
                    w.as_mut().enable();
                    self.hold = Some(w);
                }
                Some(w) => {
                    ready!(w.as_mut().poll(cx));
                    self.hold = None;
                }
            }
        }
    }

    fn interval(&mut self) -> Duration {
        let (lo, hi) = self.backend.opts.interval;
        Duration::from_micros(self.rng.range(lo.as_micros() as u64, hi.as_micros() as u64))
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.held {
            ready!(self.poll_hold(cx));
            self.held = false;
            let at = Instant::now() + self.interval();
            self.sleep.as_mut().reset(at);
        }
        ready!(self.sleep.as_mut().poll(cx));
        let b = &self.backend;
        let mut s = String::with_capacity(256);
        let sent = now_us();
        if self.next < self.total {
            let last = self.next + 1 == self.total;
            let text = if self.next == 0 {
                format!("0@{sent}@{} ", self.arrived)
            } else {
                format!("{}@{sent} ", self.next)
            };
            s.push_str(&format!(
                "data: {{\"id\":\"chatcmpl-{}\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":{}}}]}}\n\n",
                self.id,
                if last { "\"stop\"" } else { "null" }
            ));
            b.tokens_sent.fetch_add(1, Ordering::Relaxed);
            if self.next == 0 {
                let n = b.first_sent.fetch_add(1, Ordering::AcqRel) + 1;
                if Some(n) == b.opts.hold_until {
                    b.release.notify_waiters();
                }
                self.held = b.opts.hold_until.is_some();
            }
            self.next += 1;
        }
        if self.next >= self.total {
            if self.usage {
                let total = self.prompt + u64::from(self.total);
                s.push_str(&format!(
                    "data: {{\"id\":\"chatcmpl-{}\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{total}}}}}\n\n",
                    self.id, self.prompt, self.total
                ));
                b.usage_reported.fetch_add(total, Ordering::Relaxed);
            }
            s.push_str("data: [DONE]\n\n");
            b.finished.fetch_add(1, Ordering::Relaxed);
            self.done = true;
        } else {
            let at = Instant::now() + self.interval();
            self.sleep.as_mut().reset(at);
        }
        Poll::Ready(Some(Bytes::from(s)))
    }
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            StreamBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            StreamBody::Tokens(t) => t.poll_next(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            StreamBody::Full(b) => b.is_none(),
            StreamBody::Tokens(t) => t.done,
        }
    }
}

/// Serves the streaming backend on `listener` until the task is dropped.
pub async fn serve_backend(listener: TcpListener, backend: Arc<Backend>) {
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(a) => a,
            Err(_) => {
                // Out of file descriptors, say: try again shortly.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let b = backend.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let b = b.clone();
                async move { Ok::<_, Infallible>(b.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}

/// What the load generator does.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Where the proxy (or the backend, directly) listens.
    pub addr: SocketAddr,
    /// The request's path (`/v1/chat/completions`).
    pub path: String,
    /// Headers besides `host`, `content-type` and `content-length`.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The request body (a streamed chat completion).
    pub body: Bytes,
    /// Streams held open at once.
    pub streams: usize,
    /// New streams opened a second at most.
    pub open_per_s: u32,
    /// After all streams are open, how long tokens are measured; at its
    /// end the streams still open are closed.
    pub window: Duration,
    /// Open a new stream when one ends (until the window ends); without,
    /// exactly `streams` are opened and the run ends when all have ended.
    pub replace: bool,
    /// Source addresses the connections are spread over (none: the
    /// system's choice).
    pub sources: Vec<IpAddr>,
    /// A stream that sends nothing for this long is cut.
    pub idle: Duration,
}

/// What one stream came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Response status (0: no response).
    pub status: u16,
    /// Tokens received.
    pub tokens: u32,
    /// Every token came in order (0, 1, 2, ...).
    pub in_order: bool,
    /// `data: [DONE]` came.
    pub done: bool,
    /// A usage chunk came.
    pub usage: bool,
    /// It was still open when the run ended.
    pub open_at_end: bool,
}

/// The raw measurements of a run, in microseconds.
#[derive(Debug, Default)]
pub struct Measured {
    /// Each stream's time to first token minus the backend's own wait
    /// (request there and back through the path).
    pub ttft_path: Vec<u32>,
    /// The same for the streams opened inside the window (while the N
    /// streams were held, replacing ones that ended), not while they were
    /// being opened at the open rate.
    pub ttft_window: Vec<u32>,
    /// Each token inside the window: received minus sent.
    pub delay: Vec<u32>,
    /// Each gap between two tokens inside the window: the client's gap
    /// minus the backend's (negative: the second came sooner).
    pub gap_excess: Vec<i32>,
    pub outcomes: Vec<Outcome>,
    /// Most streams open (response head received, not ended) at once.
    pub peak_open: usize,
    /// Connections that could not be made, by error.
    pub errors: BTreeMap<String, u64>,
    /// Tokens received inside the window.
    pub window_tokens: u64,
    /// When the window began and ended (wall clock, µs).
    pub window: (u64, u64),
}

#[derive(Debug, Default)]
struct Shared {
    measured: Mutex<Measured>,
    open: AtomicUsize,
    /// Start and end of the window (µs; 0 while unknown).
    window_start: AtomicU64,
    window_end: AtomicU64,
}

impl Shared {
    fn in_window(&self, t: u64) -> bool {
        let s = self.window_start.load(Ordering::Relaxed);
        let e = self.window_end.load(Ordering::Relaxed);
        s != 0 && t >= s && (e == 0 || t < e)
    }
}

/// One stream's reader state: the SSE lines not yet complete and the
/// last token seen.
#[derive(Debug, Default)]
struct Reader {
    carry: Vec<u8>,
    expect: u32,
    in_order: bool,
    done: bool,
    usage: bool,
    /// (sent, received) of the last token.
    last: Option<(u64, u64)>,
    /// The backend's wait before its first token (µs), when known.
    first: Option<(u64, u64)>,
    delay: Vec<u32>,
    gaps: Vec<i32>,
}

fn digits(b: &[u8]) -> (u64, usize) {
    let mut v = 0u64;
    let mut i = 0;
    while i < b.len() && b[i].is_ascii_digit() {
        v = v.wrapping_mul(10).wrapping_add(u64::from(b[i] - b'0'));
        i += 1;
    }
    (v, i)
}

impl Reader {
    fn new() -> Self {
        Self {
            in_order: true,
            ..Self::default()
        }
    }

    fn line(&mut self, line: &[u8], received: u64, shared: &Shared) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data.starts_with(b"[DONE]") {
            self.done = true;
            return;
        }
        if find(data, b"\"usage\":{").is_some() {
            self.usage = true;
        }
        let key = b"\"content\":\"";
        let Some(at) = find(data, key) else {
            return;
        };
        let rest = &data[at + key.len()..];
        let (seq, n) = digits(rest);
        if n == 0 || rest.get(n) != Some(&b'@') {
            // Not one of this backend's tokens (an empty first delta).
            return;
        }
        let rest = &rest[n + 1..];
        let (sent, m) = digits(rest);
        if seq as u32 != self.expect {
            self.in_order = false;
        }
        self.expect = seq as u32 + 1;
        if seq == 0 && rest.get(m) == Some(&b'@') {
            let (arrived, _) = digits(&rest[m + 1..]);
            self.first = Some((arrived, sent));
        }
        if shared.in_window(received) {
            self.delay
                .push(received.saturating_sub(sent).min(u64::from(u32::MAX)) as u32);
            if let Some((ps, pr)) = self.last {
                let client = received as i64 - pr as i64;
                let backend = sent as i64 - ps as i64;
                self.gaps.push(
                    (client - backend).clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32,
                );
            }
        }
        self.last = Some((sent, received));
    }

    fn push(&mut self, chunk: &[u8], received: u64, shared: &Shared) {
        self.carry.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(i) = self.carry[start..].iter().position(|b| *b == b'\n') {
            let end = start + i;
            let line = self.carry[start..end].to_vec();
            let line = line.strip_suffix(b"\r").unwrap_or(&line);
            self.line(line, received, shared);
            start = end + 1;
        }
        self.carry.drain(..start);
        if self.carry.len() > 1 << 20 {
            self.carry.clear();
        }
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// One stream: connect (from `source`), send, read to the end.
async fn one_stream(
    opts: Arc<LoadOptions>,
    source: Option<IpAddr>,
    shared: Arc<Shared>,
    sent_at: u64,
) -> Outcome {
    let mut out = Outcome::default();
    let err = |shared: &Shared, what: String| {
        *shared
            .measured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .errors
            .entry(what)
            .or_default() += 1;
    };
    let connect = async {
        let sock = if opts.addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }?;
        if let Some(src) = source {
            sock.bind(SocketAddr::new(src, 0))?;
        }
        let s = sock.connect(opts.addr).await?;
        s.set_nodelay(true)?;
        Ok::<_, std::io::Error>(s)
    };
    let sock = match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            err(&shared, format!("connect: {}", e.kind()));
            return out;
        }
        Err(_) => {
            err(&shared, "connect: timed out".into());
            return out;
        }
    };
    let Ok((mut sender, conn)) =
        hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(sock)).await
    else {
        err(&shared, "handshake".into());
        return out;
    };
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::new(Full::new(opts.body.clone()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = match opts.path.parse() {
        Ok(u) => u,
        Err(_) => {
            err(&shared, "bad path".into());
            return out;
        }
    };
    let h = req.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&opts.addr.to_string()) {
        h.insert(http::header::HOST, v);
    }
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (k, v) in &opts.headers {
        h.insert(k.clone(), v.clone());
    }
    let resp = match tokio::time::timeout(Duration::from_secs(60), sender.send_request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            err(&shared, format!("request: {e}"));
            conn.abort();
            return out;
        }
        Err(_) => {
            err(&shared, "request: no response head in 60 s".into());
            conn.abort();
            return out;
        }
    };
    out.status = resp.status().as_u16();
    let mut body = resp.into_body();
    if out.status != 200 {
        let _ = tokio::time::timeout(Duration::from_secs(5), body.collect()).await;
        conn.abort();
        return out;
    }
    let open = shared.open.fetch_add(1, Ordering::Relaxed) + 1;
    {
        let mut m = shared.measured.lock().unwrap_or_else(|p| p.into_inner());
        m.peak_open = m.peak_open.max(open);
    }
    let mut r = Reader::new();
    let mut ttft = None;
    /// Counts the stream as closed however its future ends (the run's
    /// end drops it while it waits).
    struct Open(Arc<Shared>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.open.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _open = Open(shared.clone());
    loop {
        match tokio::time::timeout(opts.idle, body.frame()).await {
            Ok(Some(Ok(f))) => {
                let Ok(d) = f.into_data() else { continue };
                let t = now_us();
                r.push(&d, t, &shared);
                let mut first = None;
                if ttft.is_none() {
                    if let Some((arrived, sent)) = r.first {
                        // The client's whole wait minus the backend's own.
                        let total = t.saturating_sub(sent_at);
                        let backend = sent.saturating_sub(arrived);
                        let v = total.saturating_sub(backend).min(u64::from(u32::MAX)) as u32;
                        ttft = Some(v);
                        first = Some(v);
                    }
                }
                // Recorded as they come: a stream still open when the
                // run ends is dropped where it waits.
                if first.is_some() || !r.delay.is_empty() || !r.gaps.is_empty() {
                    let mut m = shared.measured.lock().unwrap_or_else(|p| p.into_inner());
                    m.ttft_path.extend(first);
                    if shared.in_window(sent_at) {
                        m.ttft_window.extend(first);
                    }
                    m.window_tokens += r.delay.len() as u64;
                    m.delay.append(&mut r.delay);
                    m.gap_excess.append(&mut r.gaps);
                }
            }
            Ok(None) => break,
            Ok(Some(Err(_))) | Err(_) => break,
        }
    }
    conn.abort();
    out.tokens = r.expect;
    out.in_order = r.in_order;
    out.done = r.done;
    out.usage = r.usage;
    out
}

/// Runs the load: opens streams at `open_per_s` until `streams` are open,
/// then (with `replace`) keeps that many open for `window`, opening a new
/// one whenever one ends; without `replace`, opens `streams` and waits for
/// all to end. Returns what was measured.
pub async fn run_load(opts: LoadOptions) -> Measured {
    let opts = Arc::new(opts);
    let shared = Arc::new(Shared::default());
    let mut tasks = tokio::task::JoinSet::new();
    let mut opened = 0usize;
    let mut next_source = 0usize;
    let mut outcomes = Vec::new();
    let per = Duration::from_secs_f64(1.0 / f64::from(opts.open_per_s.max(1)));
    let mut tick = tokio::time::interval(per);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut window_end: Option<Instant> = None;
    let spawn = |tasks: &mut tokio::task::JoinSet<Outcome>, next_source: &mut usize| {
        let src = if opts.sources.is_empty() {
            None
        } else {
            *next_source = (*next_source + 1) % opts.sources.len();
            Some(opts.sources[*next_source])
        };
        tasks.spawn(one_stream(opts.clone(), src, shared.clone(), now_us()));
    };
    loop {
        let live = tasks.len();
        let want_more = if opts.replace {
            window_end.is_none_or(|e| Instant::now() < e)
        } else {
            opened < opts.streams
        };
        if window_end.is_none() && opened >= opts.streams && opts.replace {
            // Every stream has been opened once: the window starts now,
            // as the last of them is opened.
            shared.window_start.store(now_us(), Ordering::Relaxed);
            window_end = Some(Instant::now() + opts.window);
        }
        if !want_more && live == 0 {
            break;
        }
        let end = async {
            match window_end {
                Some(e) => tokio::time::sleep_until(e).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tick.tick(), if want_more && live < opts.streams => {
                spawn(&mut tasks, &mut next_source);
                opened += 1;
            }
            Some(r) = tasks.join_next(), if live > 0 => {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
            }
            _ = end, if opts.replace => {
                break;
            }
        }
    }
    shared.window_end.store(now_us(), Ordering::Relaxed);
    // The streams still open are counted as such, not as cut (a task
    // that ended before the abort keeps its outcome).
    tasks.abort_all();
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(o) => outcomes.push(o),
            Err(e) if e.is_cancelled() => outcomes.push(Outcome {
                open_at_end: true,
                ..Outcome::default()
            }),
            Err(_) => {}
        }
    }
    let mut m = std::mem::take(&mut *shared.measured.lock().unwrap_or_else(|p| p.into_inner()));
    m.outcomes = outcomes;
    m.window = (
        shared.window_start.load(Ordering::Relaxed),
        shared.window_end.load(Ordering::Relaxed),
    );
    m
}

/// The q-quantile (0..=1) of sorted values.
pub fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len() - 1);
    Some(sorted[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_in_order_across_split_chunks() {
        let shared = Shared::default();
        shared.window_start.store(1, Ordering::Relaxed);
        let mut r = Reader::new();
        let s = "data: {\"choices\":[{\"delta\":{\"content\":\"0@100@40 \"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"1@300 \"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\ndata: [DONE]\n\n";
        let b = s.as_bytes();
        r.push(&b[..30], 150, &shared);
        r.push(&b[30..90], 150, &shared);
        r.push(&b[90..], 320, &shared);
        assert_eq!(r.expect, 2);
        assert!(r.in_order && r.done && r.usage);
        assert_eq!(r.first, Some((40, 100)));
        assert_eq!(r.delay, [50, 20]);
        assert_eq!(r.gaps, [170 - 200]);
        let mut r = Reader::new();
        r.push(b"data: {\"content\":\"1@5 \"}\n", 10, &shared);
        assert!(!r.in_order, "a stream must start at token 0");
    }

    #[test]
    fn draws_stay_in_range() {
        let mut g = Rng(3);
        for _ in 0..1000 {
            let v = g.range(5, 9);
            assert!((5..=9).contains(&v));
        }
        assert_eq!(g.range(4, 4), 4);
    }
}
