//! `watch`: beside a training job, push each checkpoint once it is
//! complete (the rules in [`crate::detect`]). The watcher keeps no state of
//! its own: a step this writer committed is done, so a restarted watcher
//! skips what is already in the store. A step an earlier writer committed
//! is skipped too when the local files are no newer than that commit (they
//! are what it uploaded, left on the node); files written after it are a
//! retrained step (a job that fell back to an older checkpoint and trained
//! that step again) and are pushed as this writer's.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use keel_store::TransferOptions;

use crate::detect;
use crate::{Ckpt, CkptError, CkptRef, Context, PushReport, PushRequest};

/// When the newest file of a checkpoint directory was last modified, in
/// seconds since the Unix epoch (`None`: no file, or no time readable).
fn newest_mtime(dir: &Path) -> Result<Option<i64>, CkptError> {
    let mut newest = None;
    for f in detect::list_files(dir)? {
        let Ok(m) = std::fs::metadata(&f.path).and_then(|m| m.modified()) else {
            return Ok(None);
        };
        let t = match m.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(_) => 0,
        };
        newest = Some(newest.map_or(t, |n: i64| n.max(t)));
    }
    Ok(newest)
}

/// One thing a pass did.
#[derive(Debug)]
pub enum WatchEvent {
    /// Pushed and committed.
    Pushed { dir: PathBuf, report: PushReport },
    /// Already committed, by this writer or (from these very files) by an
    /// earlier one: not uploaded.
    Skipped { dir: PathBuf, step: u64 },
    /// The push failed; it is retried on the next pass.
    Failed {
        dir: PathBuf,
        step: u64,
        error: CkptError,
    },
}

#[derive(Debug)]
pub struct Watcher {
    ckpt: Ckpt,
    root: PathBuf,
    marker: Option<String>,
    writer: String,
    done: Option<BTreeSet<u64>>,
}

impl Watcher {
    pub fn new(ckpt: Ckpt, root: &Path, marker: Option<String>, writer: String) -> Self {
        Self {
            ckpt,
            root: root.to_owned(),
            marker,
            writer,
            done: None,
        }
    }

    /// One pass: finds complete checkpoints and pushes those no writer has
    /// committed, oldest first. A fenced writer ends the watch (`Err`).
    pub async fn pass(
        &mut self,
        ctx: &Context,
        opts: &TransferOptions,
    ) -> Result<Vec<WatchEvent>, CkptError> {
        if !self.root.is_dir() {
            return Err(CkptError::NotADirectory {
                path: self.root.clone(),
            });
        }
        // Fenced writers stop here, before reading anything else.
        let me = self.ckpt.acquire(&self.writer, ctx).await?;
        let done = match &mut self.done {
            Some(d) => d,
            None => {
                let steps = self
                    .ckpt
                    .committed()
                    .await?
                    .into_iter()
                    .filter(|c| c.epoch == me.epoch)
                    .map(|c| c.step);
                self.done.insert(steps.collect())
            }
        };
        let mut events = Vec::new();
        for c in detect::completed(&self.root, self.marker.as_deref())? {
            if done.contains(&c.step) {
                continue;
            }
            let mine = CkptRef {
                step: c.step,
                epoch: me.epoch,
            };
            let skip = if self.ckpt.is_committed(mine).await? {
                // Committed by this writer from another process.
                true
            } else {
                match self.ckpt.resolve(crate::Selector::Step(c.step)).await {
                    Ok(refs) => match self.ckpt.manifest(refs[0]).await? {
                        Some((_, meta)) => newest_mtime(&c.dir)?.is_some_and(|t| t <= meta.time),
                        None => false,
                    },
                    Err(CkptError::NoSuchStep { .. }) => false,
                    Err(e) => return Err(e),
                }
            };
            if skip {
                done.insert(c.step);
                events.push(WatchEvent::Skipped {
                    dir: c.dir,
                    step: c.step,
                });
                continue;
            }
            let req = PushRequest {
                step: c.step,
                writer: self.writer.clone(),
                metrics: Default::default(),
                ctx: Context {
                    nonce: ctx.nonce ^ c.step.rotate_left(17),
                    ..ctx.clone()
                },
            };
            match self.ckpt.push(&c.dir, &req, opts).await {
                Ok(report) => {
                    done.insert(c.step);
                    events.push(WatchEvent::Pushed { dir: c.dir, report });
                }
                Err(e @ CkptError::Fenced { .. }) => return Err(e),
                Err(error) => events.push(WatchEvent::Failed {
                    dir: c.dir,
                    step: c.step,
                    error,
                }),
            }
        }
        Ok(events)
    }
}

/// How [`Watcher::run`] paces its passes.
#[derive(Debug, Clone, Copy)]
pub enum Pace {
    /// One pass, then return.
    Once,
    /// A pass, then a wait of this long, until told to stop or a pass
    /// fails as a whole.
    Every(std::time::Duration),
}

impl Watcher {
    /// Passes as `pace` says, each event to `on_event` (which returns
    /// `false` to stop after this pass), taking a fresh [`Context`] from
    /// `ctx` for each pass. Returns whether any push failed; a pass that
    /// fails as a whole (a fenced writer, the directory gone) ends the
    /// watch with its error.
    pub async fn run(
        &mut self,
        pace: Pace,
        ctx: impl Fn() -> Context,
        opts: &TransferOptions,
        mut on_event: impl FnMut(WatchEvent) -> bool,
    ) -> Result<WatchSummary, CkptError> {
        let mut sum = WatchSummary::default();
        loop {
            let mut go_on = true;
            for ev in self.pass(&ctx(), opts).await? {
                match &ev {
                    WatchEvent::Pushed { .. } => sum.pushed += 1,
                    WatchEvent::Skipped { .. } => sum.skipped += 1,
                    WatchEvent::Failed { .. } => sum.failed += 1,
                }
                go_on &= on_event(ev);
            }
            sum.passes += 1;
            match pace {
                Pace::Every(d) if go_on => tokio::time::sleep(d).await,
                _ => return Ok(sum),
            }
        }
    }
}

/// What a [`Watcher::run`] did, in counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchSummary {
    pub passes: u64,
    pub pushed: u64,
    pub skipped: u64,
    pub failed: u64,
}
