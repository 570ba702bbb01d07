//! push, ls, verify and pull.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use keel_store::transfer::{self, Fetch, Upload};
use keel_store::{FileEntry, Manifest, StoreError, TransferOptions};

use crate::detect::{self, Framework};
use crate::records::{self, CkptMeta, CkptRef, GenKind};
use crate::{layout, Appended, Ckpt, CkptError, Context};

/// A push: the step, who writes it, and what to record with it.
#[derive(Debug, Clone)]
pub struct PushRequest {
    pub step: u64,
    pub writer: String,
    pub metrics: BTreeMap<String, f64>,
    pub ctx: Context,
}

/// What became of a pushed checkpoint in the latest chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Published {
    /// It is the latest, as generation `generation`.
    Latest { generation: u64 },
    /// Committed, but latest already points at a newer step of this writer.
    NotNewer { latest: Option<CkptRef> },
}

#[derive(Debug, Clone, Serialize)]
pub struct PushReport {
    pub run: String,
    pub checkpoint: CkptRef,
    pub writer: String,
    pub framework: Framework,
    pub files: usize,
    pub bytes: u64,
    /// Bytes sent now (0 when the same checkpoint was already committed).
    pub bytes_uploaded: u64,
    pub already_committed: bool,
    pub manifest: String,
    pub published: Published,
}

/// Which checkpoint a command means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    Latest,
    Step(u64),
}

/// One row of `ls`.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointInfo {
    pub step: u64,
    pub epoch: u64,
    pub writer: String,
    pub time: i64,
    pub host: String,
    pub framework: String,
    pub files: usize,
    pub bytes: u64,
    pub metrics: BTreeMap<String, f64>,
    pub latest: bool,
    /// Whether the latest chain ever pointed at it.
    pub published: bool,
    pub pinned: Option<String>,
}

/// One file's verification result.
#[derive(Debug, Clone, Serialize)]
pub struct FileCheck {
    pub name: String,
    pub size: u64,
    pub ok: bool,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub checkpoint: CkptRef,
    pub files: Vec<FileCheck>,
    pub bytes: u64,
    pub ok: bool,
}

/// A checkpoint that was tried and failed before the one pulled.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub checkpoint: CkptRef,
    pub error: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct PullReport {
    pub checkpoint: CkptRef,
    pub dir: PathBuf,
    pub files: usize,
    pub bytes: u64,
    pub metrics: BTreeMap<String, f64>,
    /// Newer checkpoints that failed verification, newest first.
    pub fell_back_from: Vec<Failure>,
}

fn hash_local(files: &[detect::LocalFile]) -> Result<Vec<FileEntry>, CkptError> {
    use std::io::Read;
    let mut out = Vec::new();
    for f in files {
        let mut h = keel_store::manifest::Hasher::new();
        let mut file = std::fs::File::open(&f.path).map_err(|source| StoreError::LocalRead {
            path: f.path.clone(),
            source,
        })?;
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|source| StoreError::LocalRead {
                    path: f.path.clone(),
                    source,
                })?;
            if n == 0 {
                break;
            }
            size += n as u64;
            h.update(&buf[..n]);
        }
        out.push(FileEntry {
            name: f.name.clone(),
            size,
            sha256: h.finish(),
        });
    }
    Ok(out)
}

/// Where two file lists differ, in a few words.
fn differs(a: &[FileEntry], b: &[FileEntry]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} files here, {} committed", a.len(), b.len()));
    }
    for (x, y) in a.iter().zip(b) {
        if x != y {
            return Some(format!("{} differs", x.name));
        }
    }
    None
}

impl Ckpt {
    /// Uploads a checkpoint directory and commits it: data under a fresh
    /// attempt prefix, a fence check, the manifest created if absent (the
    /// commit point), then a publish into the latest chain.
    pub async fn push(
        &self,
        dir: &Path,
        req: &PushRequest,
        opts: &TransferOptions,
    ) -> Result<PushReport, CkptError> {
        let files = detect::list_files(dir)?;
        if files.is_empty() {
            return Err(CkptError::EmptyCheckpoint {
                path: dir.to_owned(),
            });
        }
        let dir_name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let framework = detect::detect(&files, &dir_name);
        let me = self.acquire(&req.writer, &req.ctx).await?;
        let c = CkptRef {
            step: req.step,
            epoch: me.epoch,
        };
        let manifest_key = layout::manifest_key(c.step, c.epoch);
        let report =
            |m: &Manifest, uploaded: u64, already: bool, published: Published| PushReport {
                run: self.run.clone(),
                checkpoint: c,
                writer: me.writer.clone(),
                framework,
                files: m.files().len(),
                bytes: m.total_bytes(),
                bytes_uploaded: uploaded,
                already_committed: already,
                manifest: manifest_key.clone(),
                published,
            };

        // Committed before (a retry after a crash between commit and
        // publish, or a watch restart): compare, never re-upload.
        if let Some((m, _)) = self.manifest(c).await? {
            let local = hash_local(&files)?;
            if let Some(d) = differs(&local, m.files()) {
                return Err(CkptError::Conflict {
                    checkpoint: c,
                    differs: d,
                });
            }
            let published = self.publish(&me, c, &req.ctx).await?;
            return Ok(report(&m, 0, true, published));
        }

        let attempt = format!("{:016x}", req.ctx.nonce);
        let data = layout::data_prefix(c.step, c.epoch, &attempt);
        let uploads: Vec<Upload> = files
            .iter()
            .map(|f| Upload {
                local: f.path.clone(),
                key: format!("{data}/{}", f.name),
                name: f.name.clone(),
            })
            .collect();
        let entries = transfer::upload_files(&self.store, uploads, opts).await?;
        let meta = CkptMeta {
            version: records::VERSION,
            kind: "checkpoint".into(),
            run: self.run.clone(),
            step: c.step,
            epoch: c.epoch,
            writer: me.writer.clone(),
            attempt,
            data,
            time: req.ctx.now_unix,
            host: req.ctx.host.clone(),
            framework: framework.as_str().into(),
            metrics: req.metrics.clone(),
        };
        let name = format!("{}/step-{}", self.run, c.step);
        let m =
            Manifest::new(name, entries, meta.to_map()).map_err(|source| CkptError::Manifest {
                key: manifest_key.clone(),
                source,
            })?;
        // A writer fenced while it uploaded does not commit.
        self.check_fence(&me).await?;
        match self.put_create(&manifest_key, m.to_json()).await? {
            keel_store::CreateOutcome::Created => {}
            keel_store::CreateOutcome::AlreadyExists => {
                // The same writer pushed the same step at the same time.
                let Some((other, _)) = self.manifest(c).await? else {
                    return Err(CkptError::Contended {
                        what: "the manifest",
                        tries: 1,
                    });
                };
                if let Some(d) = differs(m.files(), other.files()) {
                    return Err(CkptError::Conflict {
                        checkpoint: c,
                        differs: d,
                    });
                }
                let published = self.publish(&me, c, &req.ctx).await?;
                return Ok(report(&other, m.total_bytes(), true, published));
            }
        }
        let published = self.publish(&me, c, &req.ctx).await?;
        Ok(report(&m, m.total_bytes(), false, published))
    }

    async fn publish(
        &self,
        me: &records::WriterRecord,
        c: CkptRef,
        ctx: &Context,
    ) -> Result<Published, CkptError> {
        Ok(
            match self.append(GenKind::Publish, me, Some(c), ctx).await? {
                Appended::Created(r) => Published::Latest {
                    generation: r.generation,
                },
                Appended::NotNewer(r) => Published::NotNewer {
                    latest: r.checkpoint,
                },
            },
        )
    }

    /// The checkpoints a selector means, best first: for `Latest`, the
    /// chain's checkpoints that are still committed (the rest are
    /// fallbacks); for a step, the committed epoch the chain last named,
    /// else the highest.
    pub async fn resolve(&self, sel: Selector) -> Result<Vec<CkptRef>, CkptError> {
        match sel {
            Selector::Latest => {
                let mut out = Vec::new();
                for c in self.chain().await? {
                    let key = layout::manifest_key(c.step, c.epoch);
                    if self.store.head(&key).await?.is_some() {
                        out.push(c);
                    }
                }
                if out.is_empty() {
                    return Err(CkptError::NoCheckpoint {
                        run: self.run.clone(),
                    });
                }
                Ok(out)
            }
            Selector::Step(step) => {
                let chain = self.chain().await?;
                let mut epochs = Vec::new();
                for e in self.store.list_dirs(&format!("ckpt/{step:020}")).await? {
                    if let Some(epoch) = e.strip_prefix('e').and_then(|x| x.parse::<u64>().ok()) {
                        let key = layout::manifest_key(step, epoch);
                        if self.store.head(&key).await?.is_some() {
                            epochs.push(CkptRef { step, epoch });
                        }
                    }
                }
                let pick = chain
                    .iter()
                    .find(|c| epochs.contains(c))
                    .copied()
                    .or_else(|| epochs.iter().max().copied());
                pick.map(|c| vec![c]).ok_or(CkptError::NoSuchStep {
                    run: self.run.clone(),
                    step,
                })
            }
        }
    }

    pub(crate) async fn resolve_one(&self, sel: Selector) -> Result<CkptRef, CkptError> {
        Ok(self.resolve(sel).await?[0])
    }

    /// Every committed checkpoint with its metadata.
    pub async fn list(&self) -> Result<Vec<CheckpointInfo>, CkptError> {
        let chain = self.chain().await?;
        let latest = self.latest().await?;
        let pins: BTreeMap<CkptRef, String> = self
            .pins()
            .await?
            .into_iter()
            .map(|p| (p.checkpoint, p.reason))
            .collect();
        let mut out = Vec::new();
        for c in self.committed().await? {
            let Some((m, meta)) = self.manifest(c).await? else {
                continue;
            };
            out.push(CheckpointInfo {
                step: c.step,
                epoch: c.epoch,
                writer: meta.writer,
                time: meta.time,
                host: meta.host,
                framework: meta.framework,
                files: m.files().len(),
                bytes: m.total_bytes(),
                metrics: meta.metrics,
                latest: latest == Some(c),
                published: chain.contains(&c),
                pinned: pins.get(&c).cloned(),
            });
        }
        Ok(out)
    }

    fn fetches(meta: &CkptMeta, m: &Manifest, dir: Option<&Path>) -> Vec<Fetch> {
        m.files()
            .iter()
            .map(|f| Fetch {
                key: format!("{}/{}", meta.data, f.name),
                expected: f.clone(),
                local: dir.map(|d| d.join(&f.name)),
            })
            .collect()
    }

    /// Reads every byte of a checkpoint and checks it against its manifest.
    pub async fn verify(
        &self,
        sel: Selector,
        opts: &TransferOptions,
    ) -> Result<VerifyReport, CkptError> {
        let c = self.resolve_one(sel).await?;
        self.verify_ref(c, opts).await
    }

    pub async fn verify_ref(
        &self,
        c: CkptRef,
        opts: &TransferOptions,
    ) -> Result<VerifyReport, CkptError> {
        let (m, meta) = self.manifest(c).await?.ok_or(CkptError::NoSuchStep {
            run: self.run.clone(),
            step: c.step,
        })?;
        let results =
            transfer::fetch_files(&self.store, Self::fetches(&meta, &m, None), opts, false).await?;
        let files: Vec<FileCheck> = results
            .into_iter()
            .map(|(f, r)| FileCheck {
                name: f.expected.name,
                size: f.expected.size,
                ok: r.is_ok(),
                error: r.err().map(|e| e.to_string()),
            })
            .collect();
        Ok(VerifyReport {
            checkpoint: c,
            ok: files.iter().all(|f| f.ok),
            bytes: m.total_bytes(),
            files,
        })
    }

    /// Downloads a checkpoint into `dir` (new or empty), verifying every
    /// byte. Files land in a hidden sibling directory that is renamed to
    /// `dir` only once all of them verify. For `Latest`, a checkpoint that
    /// fails verification (or whose data is gone) is reported in
    /// `fell_back_from` and the previous one in the chain is tried, unless
    /// `no_fallback`.
    pub async fn pull(
        &self,
        sel: Selector,
        dir: &Path,
        no_fallback: bool,
        ctx: &Context,
        opts: &TransferOptions,
    ) -> Result<PullReport, CkptError> {
        if let Ok(mut rd) = std::fs::read_dir(dir) {
            if rd.next().is_some() {
                return Err(CkptError::TargetNotEmpty {
                    path: dir.to_owned(),
                });
            }
        } else if dir.exists() {
            return Err(CkptError::NotADirectory {
                path: dir.to_owned(),
            });
        }
        let candidates = self.resolve(sel).await?;
        let mut failures: Vec<Failure> = Vec::new();
        for c in candidates {
            match self.pull_one(c, dir, ctx, opts).await {
                Ok((files, bytes, metrics)) => {
                    return Ok(PullReport {
                        checkpoint: c,
                        dir: dir.to_owned(),
                        files,
                        bytes,
                        metrics,
                        fell_back_from: failures,
                    })
                }
                Err(e) => {
                    let integrity = match &e {
                        CkptError::Store(s) => s.is_integrity() || s.is_not_found(),
                        CkptError::Manifest { .. } | CkptError::NoSuchStep { .. } => true,
                        _ => false,
                    };
                    if !integrity {
                        return Err(e);
                    }
                    if sel != Selector::Latest || no_fallback {
                        return Err(CkptError::Integrity {
                            checkpoint: c,
                            failures: vec![e.to_string()],
                        });
                    }
                    failures.push(Failure {
                        checkpoint: c,
                        error: e.to_string(),
                    });
                }
            }
        }
        Err(CkptError::AllFailed {
            tried: failures
                .iter()
                .map(|f| format!("{}: {}", f.checkpoint, f.error))
                .collect(),
        })
    }

    async fn pull_one(
        &self,
        c: CkptRef,
        dir: &Path,
        ctx: &Context,
        opts: &TransferOptions,
    ) -> Result<(usize, u64, BTreeMap<String, f64>), CkptError> {
        let (m, meta) = self.manifest(c).await?.ok_or(CkptError::NoSuchStep {
            run: self.run.clone(),
            step: c.step,
        })?;
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|source| CkptError::LocalWrite {
            path: parent.clone(),
            source,
        })?;
        let base = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("pull")
            .to_owned();
        let staging = parent.join(format!(".{base}.keel-pull-{:016x}", ctx.nonce));
        std::fs::create_dir(&staging).map_err(|source| CkptError::LocalWrite {
            path: staging.clone(),
            source,
        })?;
        let result = transfer::fetch_files(
            &self.store,
            Self::fetches(&meta, &m, Some(&staging)),
            opts,
            true,
        )
        .await;
        if let Err(e) = result {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e.into());
        }
        if dir.exists() {
            // Checked empty above.
            let _ = std::fs::remove_dir(dir);
        }
        std::fs::rename(&staging, dir).map_err(|source| {
            let _ = std::fs::remove_dir_all(&staging);
            CkptError::LocalWrite {
                path: dir.to_owned(),
                source,
            }
        })?;
        Ok((m.files().len(), m.total_bytes(), meta.metrics))
    }
}
