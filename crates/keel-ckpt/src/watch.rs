//! `watch`: beside a training job, push each checkpoint once it is
//! complete (the rules in [`crate::detect`]). The watcher keeps no state of
//! its own: a step counts as done once any writer committed it, so a
//! restarted watcher skips what is already in the store.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use keel_store::TransferOptions;

use crate::detect;
use crate::{Ckpt, CkptError, Context, PushReport, PushRequest};

/// One thing a pass did.
#[derive(Debug)]
pub enum WatchEvent {
    /// Pushed and committed.
    Pushed { dir: PathBuf, report: PushReport },
    /// Already committed by some writer: not uploaded.
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
        self.ckpt.acquire(&self.writer, ctx).await?;
        let done = match &mut self.done {
            Some(d) => d,
            None => {
                let steps = self.ckpt.committed().await?.into_iter().map(|c| c.step);
                self.done.insert(steps.collect())
            }
        };
        let mut events = Vec::new();
        for c in detect::completed(&self.root, self.marker.as_deref())? {
            if done.contains(&c.step) {
                continue;
            }
            let committed_elsewhere = !self
                .ckpt
                .store()
                .list_dirs(&format!("ckpt/{:020}", c.step))
                .await?
                .is_empty()
                && self
                    .ckpt
                    .resolve(crate::Selector::Step(c.step))
                    .await
                    .is_ok();
            if committed_elsewhere {
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
