//! keel's test model servers as a library: the long-stream backend and
//! load generator of `scripts/bench-streams` ([`streams`]), shared with
//! the gateway's concurrency tests. The general test backend is the
//! `keel-testbackend` binary (src/main.rs).

#![forbid(unsafe_code)]

pub mod streams;
