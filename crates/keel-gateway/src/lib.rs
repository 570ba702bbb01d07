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

pub mod access;
pub mod answer;
pub mod audit;
pub mod auth;
pub mod batch;
pub mod body;
pub mod budget;
pub mod clock;
pub mod control;
pub mod digits;
pub mod drift;
pub mod error;
pub mod fnv;
pub mod gateway;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod pool;
pub mod proxy;
pub mod redis;
pub mod request;
pub mod samples;
pub mod server;
pub mod stream;
pub mod tls;
pub mod traffic;

/// The configuration (keel-gateway-config), where it always was.
pub use keel_gateway_config as config;
pub use keel_gateway_config::{drift_baseline, drift_features};

pub use clock::{Clock, ManualClock};
pub use config::GatewayConfig;
pub use error::{ApiError, GatewayError};
pub use gateway::{Gateway, GatewayOptions, Listener, ReloadFn, WeakGateway};
pub use server::{run, serve, Listeners, ServeOptions};

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; GatewayError, config::ConfigError, drift_baseline::BaselineError)
}
