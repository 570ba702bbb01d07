//! keel's inference gateway: in front of OpenAI-compatible servers (vLLM,
//! llama.cpp server, TGI) and Open Inference Protocol v2 servers (KServe,
//! Triton), it authenticates every call (API keys stored as SHA-256
//! hashes, optional JWT), applies role-based access, enforces request and
//! token limits exactly (in process or shared through Redis), routes by
//! weight with pinning, mirroring, fallback, retries and circuit breakers,
//! streams responses chunk by chunk, and records Prometheus metrics,
//! access logs and a hash-chained audit log. It speaks HTTP or HTTPS to
//! backends and JWKS URLs (rustls: system roots, a private CA, an optional
//! client certificate) and can serve its listeners over HTTPS.
//!
//! It is the data plane: it owns the request path and its state. It does
//! not read the process environment (but for the system's trusted roots,
//! which rustls-native-certs finds as OpenSSL does) or the wall clock (a
//! `Clock` is injected), print, or exit; it does not train or register
//! models; it knows deployments by backend URL. Its control plane
//! (keel-control: following the registry, rollouts, drift actions)
//! drives it through [`control`]: routing in, samples out.

// The data plane's parts, private: what other crates use is re-exported
// below, grouped by who uses it.
mod access;
mod answer;
pub mod audit;
mod auth;
mod batch;
mod body;
mod budget;
mod clock;
pub mod control;
mod digits;
mod drift;
mod error;
mod fnv;
mod gateway;
pub mod keys;
mod limits;
mod metrics;
mod pool;
mod proxy;
pub mod redis;
mod request;
mod samples;
mod server;
mod stream;
mod tls;
mod traffic;

/// The configuration (keel-gateway-config), where it always was.
pub use keel_gateway_config as config;
pub use keel_gateway_config::{drift_baseline, drift_features};

// Running a gateway: build it, serve its listeners, reload it.
pub use config::GatewayConfig;
pub use error::{ApiError, GatewayError};
pub use gateway::{Gateway, GatewayOptions, Listener, ReloadFn, WeakGateway};
pub use server::{connection_cap, run, serve, Listeners, ServeOptions};

// What a gateway hands out and is handed: its clock, its access records
// (and the batching thread that writes them off the request path), its
// limiter, samples and drift windows.
pub use access::{access_line, AccessInfo, AccessRecord, AccessSink, RequestId};
pub use batch::Batcher;
pub use clock::{rfc3339, Clock, ManualClock};
pub use drift::DriftBook;
pub use limits::Limiter;
pub use samples::{SampleBook, MAX_SAMPLES};
pub use tls::{provider as tls_provider, UpstreamTlsFiles};

/// The request path's pieces, for this crate's benchmark
/// (`benches/request_path.rs`), integration tests and fuzz target
/// (`fuzz/fuzz_targets/request.rs`): not an API.
#[doc(hidden)]
pub mod parts {
    pub use crate::answer::{usage_of_body, SseFilter};
    pub use crate::drift::{oip_inputs, MAX_INPUT_FEATURES};
    pub use crate::limits::{Admission, Refusal, Scope};
    pub use crate::metrics::{Metrics, RequestLabels};
    pub use crate::request::{parse_openai, prompt_field, route, Route, ROUTES};
}

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; GatewayError, config::ConfigError, drift_baseline::BaselineError)
}
