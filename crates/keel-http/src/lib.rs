//! The one hardened HTTP/1.1 server foundation of keel's listeners: the
//! model registry (`keel model serve`), the GPU exporter (`keel exporter`),
//! `keel run`'s metrics endpoint, and the gateway's connections (`keel
//! serve`, which keeps its own accept loop for TLS but takes its places,
//! deadlines and per-connection service from here).
//!
//! What it owns:
//! - **Places** ([`Places`]): connections served at once, in all and per
//!   client (an IPv4 address, or an IPv6 /64: [`client_of`]). A connection
//!   over a limit is answered 503 at once and closed, never left unseen in
//!   the listen queue. Connections that have not authenticated hold at most
//!   `max_connections - reserved` places; when a new connection finds no
//!   place, the oldest unauthenticated connection waiting for a request
//!   head gives up its own (closed), so slow heads without a credential
//!   cannot keep a client with one out.
//! - **Deadlines** ([`Guarded`]): a request head must arrive within the
//!   header timeout, a kept-alive connection waits at most the idle
//!   timeout, a write that makes no progress for the write timeout ends
//!   the connection, and a connection lives at most its lifetime (its
//!   request in flight answered with `Connection: close`).
//! - **A head size cap** (hyper's buffer: a longer head is answered 431).
//! - **Graceful drain** at shutdown ([`serve`]).
//! - **Bearer tokens by hash** ([`TokenHash`]): the SHA-256 of a token is
//!   configured, and a presented token is hashed and compared in constant
//!   time.
//!
//! What it does not do: routing, TLS (the gateway's loop does the
//! handshake and hands the stream to [`Guarded`]), API keys, roles or JWTs
//! (each server's own), bodies (each server caps its own), logging beyond
//! `tracing` events. A server marks a response as coming from an
//! authenticated client with the [`Authenticated`] extension; nothing else
//! about its requests is known here.

#![forbid(unsafe_code)]

mod bearer;
mod client;
mod conn;
pub mod machine;
mod places;
mod serve;

pub use bearer::{bearer_token, same_digest, sha256_hex, BadTokenHash, TokenHash};
pub use client::client_of;
pub use conn::{Authenticated, ConnFuture, ConnService, Deadlines, Guarded, InFlight, Tracked};
pub use places::{Place, Places, Refused};
pub use serve::{busy_answer, serve, Limits, ServeOptions};
