//! The small JSON records of the protocol. Each carries `version`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const VERSION: u32 = 1;

/// A checkpoint: a step as committed by one writer epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CkptRef {
    pub step: u64,
    pub epoch: u64,
}

impl std::fmt::Display for CkptRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {} (writer epoch {})", self.step, self.epoch)
    }
}

/// `writers/<epoch>.json`: who holds an epoch. Created, never changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterRecord {
    pub version: u32,
    pub epoch: u64,
    pub writer: String,
    pub host: String,
    pub time: i64,
}

/// What a generation record says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GenKind {
    /// A writer made its checkpoint the latest.
    Publish,
    /// A new writer epoch began; latest stays where it was.
    Fence,
}

/// `latest/<generation>.json`: one step of the latest pointer's history.
/// Created (if absent), never changed; the highest generation is the
/// current latest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenRecord {
    pub version: u32,
    pub generation: u64,
    pub kind: GenKind,
    /// The epoch of the writer that created this record.
    pub epoch: u64,
    pub writer: String,
    /// What `latest` resolves to from this generation on.
    pub checkpoint: Option<CkptRef>,
    pub time: i64,
}

/// `pins/<step>-e<epoch>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRecord {
    pub version: u32,
    pub checkpoint: CkptRef,
    pub reason: String,
    pub host: String,
    pub time: i64,
}

/// `unpins/<step>-e<epoch>-<time>.json`: a removed pin, why and by whom;
/// created once, never changed, so removing a pin leaves a trail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpinRecord {
    pub version: u32,
    pub checkpoint: CkptRef,
    pub reason: String,
    pub host: String,
    pub time: i64,
    /// The pin that was removed.
    pub pin: PinRecord,
}

/// Checkpoint metadata, stored in the manifest as `predicate.keel`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CkptMeta {
    pub version: u32,
    pub kind: String,
    pub run: String,
    pub step: u64,
    pub epoch: u64,
    pub writer: String,
    /// The push attempt whose data the manifest names.
    pub attempt: String,
    /// Data keys are `<data>/<file name>`, relative to the run.
    pub data: String,
    /// Seconds since the Unix epoch, when the push began.
    pub time: i64,
    pub host: String,
    pub framework: String,
    pub metrics: BTreeMap<String, f64>,
}

impl CkptMeta {
    pub fn to_map(&self) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        }
    }

    pub fn from_map(m: &serde_json::Map<String, serde_json::Value>) -> Result<Self, String> {
        serde_json::from_value(serde_json::Value::Object(m.clone())).map_err(|e| e.to_string())
    }
}
