//! The two hash chains: alias history and the audit log.
//!
//! Each event's hash is SHA-256 over a domain line, the previous event's
//! hash (64 zeros for the first) and the event's canonical encoding: a JSON
//! object with the fields in a fixed order (declared below), compact, as
//! `serde_json` writes it. The sequence number is part of the encoding, so
//! a removed or reordered event breaks the chain as surely as an edited
//! one; the newest hash of each chain is also kept in the `meta` table, so
//! a removed tail shows too.

use serde::Serialize;

use keel_store::manifest::Hasher;

/// The hash before the first event.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[derive(Serialize)]
pub(crate) struct AliasRecord<'a> {
    pub seq: i64,
    pub time_ms: i64,
    pub actor: &'a str,
    pub model: &'a str,
    pub alias: &'a str,
    pub action: &'a str,
    pub old_version: Option<i64>,
    pub new_version: Option<i64>,
    pub reason: &'a str,
}

#[derive(Serialize)]
pub(crate) struct AuditRecord<'a> {
    pub seq: i64,
    pub time_ms: i64,
    pub actor: &'a str,
    pub action: &'a str,
    pub target: &'a str,
    pub detail: &'a str,
}

/// The chain hash of one event.
pub(crate) fn link<T: Serialize>(domain: &str, prev_hash: &str, record: &T) -> String {
    let mut h = Hasher::new();
    h.update(domain.as_bytes());
    h.update(b"\n");
    h.update(prev_hash.as_bytes());
    h.update(b"\n");
    h.update(&serde_json::to_vec(record).unwrap_or_default());
    h.finish().hex()
}

pub(crate) const ALIAS_DOMAIN: &str = "keel-alias-history-v1";
pub(crate) const AUDIT_DOMAIN: &str = "keel-audit-log-v1";

/// Which chain or record a problem is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChainName {
    AliasHistory,
    AuditLog,
    /// The current state (aliases, version files) against the chains.
    State,
}

impl ChainName {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AliasHistory => "alias history",
            Self::AuditLog => "audit log",
            Self::State => "registry state",
        }
    }
}

/// The first broken link of a chain, or a state that the chains do not
/// explain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Break {
    pub chain: ChainName,
    /// The event's sequence number (0 for state problems).
    pub seq: i64,
    pub what: String,
}

/// What `audit verify` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChainReport {
    pub alias_events: u64,
    pub audit_events: u64,
    pub alias_head: String,
    pub audit_head: String,
    pub versions_checked: u64,
    /// Every problem, the first broken link of each chain first.
    pub breaks: Vec<Break>,
}

impl ChainReport {
    pub fn ok(&self) -> bool {
        self.breaks.is_empty()
    }
}
