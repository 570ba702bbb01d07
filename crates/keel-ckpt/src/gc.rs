//! Retention: which committed checkpoints to keep, deleting the rest
//! commit record first, and cleaning data that no manifest names.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::records::CkptRef;
use crate::{layout, Ckpt, CkptError, Context};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    Min,
    Max,
}

/// What to keep. Checkpoints that no rule keeps are deleted; with no rule
/// at all, every committed checkpoint is kept and only orphaned data goes.
/// The latest checkpoint, any newer one (committed and perhaps being
/// published as latest right now) and pinned ones are always kept.
#[derive(Debug, Clone, Default)]
pub struct GcPolicy {
    pub keep_last: Option<usize>,
    /// Keep the `n` best by a metric.
    pub keep_best: Option<(usize, String, Order)>,
    /// Keep steps that are multiples of `m`.
    pub keep_every: Option<u64>,
    /// Data of uncommitted pushes younger than this many seconds is left
    /// alone: the push may still be running.
    pub grace_secs: i64,
}

impl GcPolicy {
    fn any_rule(&self) -> bool {
        self.keep_last.is_some() || self.keep_best.is_some() || self.keep_every.is_some()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Kept {
    pub checkpoint: CkptRef,
    pub reasons: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Removed {
    pub checkpoint: CkptRef,
    pub objects: usize,
    pub bytes: u64,
}

/// Data left by a push that never committed (or lost its commit race).
#[derive(Debug, Clone, Serialize)]
pub struct Orphan {
    pub prefix: String,
    pub objects: usize,
    pub bytes: u64,
    /// Too recent to delete: the push may still be running.
    pub in_grace: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct GcReport {
    pub applied: bool,
    pub kept: Vec<Kept>,
    pub deleted: Vec<Removed>,
    pub orphans: Vec<Orphan>,
    /// Bytes deleted (or that would be, in a dry run).
    pub bytes_freed: u64,
}

impl Ckpt {
    /// Plans (and with `apply`, carries out) a garbage collection.
    pub async fn gc(
        &self,
        policy: &GcPolicy,
        apply: bool,
        ctx: &Context,
    ) -> Result<GcReport, CkptError> {
        let committed = self.list().await?;
        let latest = self.latest().await?;
        let mut reasons: BTreeMap<CkptRef, Vec<String>> = BTreeMap::new();
        let mut keep = |c: CkptRef, why: String| reasons.entry(c).or_default().push(why);
        let refs: Vec<CkptRef> = committed
            .iter()
            .map(|i| CkptRef {
                step: i.step,
                epoch: i.epoch,
            })
            .collect();
        for (i, c) in committed.iter().zip(&refs) {
            if Some(*c) == latest {
                keep(*c, "latest".into());
            }
            // Committed after latest was read, or committed and not yet
            // published: a push is perhaps moving latest to it now.
            if latest.is_none_or(|l| *c > l) {
                keep(*c, "newer than latest".into());
            }
            if let Some(r) = &i.pinned {
                keep(*c, format!("pinned: {r}"));
            }
            if !policy.any_rule() {
                keep(*c, "no retention rule given".into());
            }
            if let Some(m) = policy.keep_every {
                if m > 0 && c.step % m == 0 {
                    keep(*c, format!("every {m}"));
                }
            }
        }
        if let Some(k) = policy.keep_last {
            for c in refs.iter().rev().take(k) {
                keep(*c, format!("last {k}"));
            }
        }
        if let Some((b, metric, order)) = &policy.keep_best {
            let mut scored: Vec<(f64, CkptRef)> = committed
                .iter()
                .zip(&refs)
                .filter_map(|(i, c)| i.metrics.get(metric).map(|v| (*v, *c)))
                .filter(|(v, _)| v.is_finite())
                .collect();
            scored.sort_by(|a, b| a.0.total_cmp(&b.0));
            if *order == Order::Max {
                scored.reverse();
            }
            for (_, c) in scored.into_iter().take(*b) {
                keep(c, format!("best {b} by {metric}"));
            }
        }

        // One listing of everything under ckpt/: data objects by attempt.
        let objects = self.store.list("ckpt").await?;
        let mut by_ckpt: BTreeMap<CkptRef, Vec<(String, u64)>> = BTreeMap::new();
        let mut by_attempt: BTreeMap<(CkptRef, String), (usize, u64, i64)> = BTreeMap::new();
        for o in &objects {
            let key = o.key.clone();
            if let Some((step, epoch)) = layout::parse_manifest_key(&key) {
                by_ckpt
                    .entry(CkptRef { step, epoch })
                    .or_default()
                    .push((key, o.size));
            } else if let Some((step, epoch, attempt)) = layout::parse_data_key(&key) {
                let c = CkptRef { step, epoch };
                by_ckpt.entry(c).or_default().push((key.clone(), o.size));
                let e = by_attempt
                    .entry((c, attempt.to_owned()))
                    .or_insert((0, 0, i64::MIN));
                e.0 += 1;
                e.1 += o.size;
                e.2 = e.2.max(o.modified_unix);
            }
        }

        let mut report = GcReport {
            applied: apply,
            kept: Vec::new(),
            deleted: Vec::new(),
            orphans: Vec::new(),
            bytes_freed: 0,
        };
        let mut live_attempts: BTreeSet<(CkptRef, String)> = BTreeSet::new();
        for c in &refs {
            let Some((manifest, _, meta)) = self.manifest_bytes(*c).await? else {
                continue;
            };
            live_attempts.insert((*c, meta.attempt.clone()));
            if let Some(r) = reasons.get(c) {
                report.kept.push(Kept {
                    checkpoint: *c,
                    reasons: r.clone(),
                });
                continue;
            }
            let data = format!("{}/", meta.data);
            let mut objects: Vec<(String, u64)> = by_ckpt
                .get(c)
                .map(|v| {
                    v.iter()
                        .filter(|(k, _)| k.starts_with(&data))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            let bytes: u64 = objects.iter().map(|(_, s)| s).sum();
            if apply {
                // The commit record first: from here on this is not a
                // checkpoint, whatever happens to the data. Then gc's half
                // of the handshake with `pin` (which writes its pin, then
                // looks for the manifest): deleted the manifest, look for a
                // pin. A pin made meanwhile puts the manifest back, exactly
                // as it was, and keeps the checkpoint.
                let mkey = layout::manifest_key(c.step, c.epoch);
                let pkey = layout::pin_key(c.step, c.epoch);
                let pinned = self.store.head(&pkey).await?.is_some() || {
                    self.store.delete(&mkey).await?;
                    let pinned = self.store.head(&pkey).await?.is_some();
                    if pinned {
                        self.store.create(&mkey, manifest).await?;
                    }
                    pinned
                };
                if pinned {
                    report.kept.push(Kept {
                        checkpoint: *c,
                        reasons: vec!["pinned during gc".into()],
                    });
                    continue;
                }
                for (k, _) in &objects {
                    self.store.delete(k).await?;
                }
            }
            objects.push((layout::manifest_key(c.step, c.epoch), 0));
            report.bytes_freed += bytes;
            report.deleted.push(Removed {
                checkpoint: *c,
                objects: objects.len(),
                bytes,
            });
        }

        // Saturates: a grace period longer than all of time keeps every
        // orphan, a negative one keeps none.
        let cutoff = ctx.now_unix.saturating_sub(policy.grace_secs);
        for ((c, attempt), (n, bytes, newest)) in by_attempt {
            if live_attempts.contains(&(c, attempt.clone())) {
                continue;
            }
            let prefix = layout::data_prefix(c.step, c.epoch, &attempt);
            let in_grace = newest > cutoff;
            if apply && !in_grace {
                for o in objects
                    .iter()
                    .filter(|o| o.key.starts_with(&format!("{prefix}/")))
                {
                    self.store.delete(&o.key).await?;
                }
            }
            if !in_grace {
                report.bytes_freed += bytes;
            }
            report.orphans.push(Orphan {
                prefix,
                objects: n,
                bytes,
                in_grace,
            });
        }
        Ok(report)
    }
}
