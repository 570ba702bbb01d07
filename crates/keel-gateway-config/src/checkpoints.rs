//! The audit log's signed checkpoints, as configured.

use std::path::PathBuf;

/// Every `every` lines, and when the log is closed, the writer appends a
/// `checkpoint` line holding the head's `seq` and hash and an HMAC-SHA256
/// of them under `key`. The hash chain alone can be rebuilt by anyone who
/// can write the file; a checkpoint cannot be made without the key, so
/// `verify_with_key` detects a log rewritten, re-chained or emptied by
/// someone who does not hold it.
///
/// A log cut back to an earlier checkpoint still verifies on its own: the
/// checkpoints left are good. So after each checkpoint is on disk the
/// writer also replaces `anchor`, a file outside the log (written
/// atomically, mode 0600) holding the latest checkpoint (keel-gateway's `audit::Anchor`);
/// `verify_with_key` given it fails a log that no longer holds that
/// checkpoint, and the gateway refuses to continue such a log at start
/// (the next checkpoint would replace the evidence).
#[derive(Clone)]
pub struct Checkpoints {
    pub key: Vec<u8>,
    pub every: u64,
    /// Where the latest checkpoint is kept outside the log (`None`: not
    /// kept).
    pub anchor: Option<PathBuf>,
}

impl std::fmt::Debug for Checkpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoints")
            .field("key", &"<secret>")
            .field("every", &self.every)
            .field("anchor", &self.anchor)
            .finish()
    }
}
