//! Checkpoints on object storage: crash-consistent, verified, fenced.
//!
//! A run's checkpoints live under `<url>/<run>/` (see `layout` and
//! docs/ckpt.md):
//! - data goes first, under a key unique to the push attempt, so no push
//!   ever overwrites data a manifest names;
//! - the manifest (a keel-store [`Manifest`], metadata in `predicate.keel`)
//!   is created last with create-if-absent: it is the commit point, and
//!   data without a manifest is never a checkpoint;
//! - `latest` is a chain of create-only generation records: a writer reads
//!   the highest generation g and creates g+1 only if its checkpoint is
//!   newer, so two racing writers never move it backwards;
//! - writers hold epochs (create-only `writers/<epoch>.json`); a new writer
//!   takes the next epoch and writes a fence record into the chain, after
//!   which an older epoch can neither commit nor publish.
//!
//! [`Ckpt`] does push, latest, ls, verify, pull with fallback, gc and
//! pin/unpin; [`detect`] reads framework layouts; [`watch`] pushes
//! completed checkpoints as they appear. It does not sign anything and does
//! not print, exit, or read the environment or the wall clock: time, host
//! and a random nonce come in a [`Context`].

#![forbid(unsafe_code)]

pub mod detect;
mod gc;
pub mod layout;
mod ops;
pub mod records;
mod summary;
pub mod watch;

use std::path::PathBuf;

use keel_store::{CreateOutcome, Manifest, ManifestError, Store, StoreError};

pub use detect::Framework;
pub use gc::{GcPolicy, GcReport, Order};
pub use ops::{
    CheckpointInfo, Failure, FileCheck, Published, PullReport, PushReport, PushRequest, Selector,
    VerifyReport,
};
pub use records::{CkptMeta, CkptRef, GenKind, GenRecord, PinRecord, UnpinRecord, WriterRecord};
pub use summary::{Details, TransferSummary};

/// What a library call needs from the world: the time, this host's name,
/// and a random number for attempt ids.
#[derive(Debug, Clone)]
pub struct Context {
    /// Seconds since the Unix epoch.
    pub now_unix: i64,
    pub host: String,
    pub nonce: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("invalid run name {run:?}: {reason}")]
    BadRun { run: String, reason: String },
    #[error("invalid writer name {writer:?}: {reason}")]
    BadWriter { writer: String, reason: String },
    #[error("cannot read directory {path}")]
    LocalDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path} is neither a file nor a directory")]
    NotAFile { path: PathBuf },
    #[error("{path} is a symbolic link to a directory; only links to files are followed")]
    SymlinkedDir { path: PathBuf },
    #[error("{path}: file name is not UTF-8 or contains a backslash")]
    BadFileName { path: PathBuf },
    #[error("{path} holds no files")]
    EmptyCheckpoint { path: PathBuf },
    #[error("cannot write {path}")]
    LocalWrite {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} exists and is not empty; pull into a new or empty directory")]
    TargetNotEmpty { path: PathBuf },
    #[error("malformed manifest {key}")]
    Manifest {
        key: String,
        #[source]
        source: ManifestError,
    },
    #[error("malformed record {key}: {message}")]
    Record { key: String, message: String },
    #[error(
        "writer {writer:?} (epoch {epoch}) is fenced: writer {by:?} took over the run with epoch {by_epoch}; \
         this writer can no longer commit or publish"
    )]
    Fenced {
        writer: String,
        epoch: u64,
        by: String,
        by_epoch: u64,
    },
    #[error("run {run:?} has no checkpoint")]
    NoCheckpoint { run: String },
    #[error("run {run:?} has no committed checkpoint at step {step}")]
    NoSuchStep { run: String, step: u64 },
    #[error("{checkpoint} is already committed with different content ({differs})")]
    Conflict {
        checkpoint: CkptRef,
        differs: String,
    },
    #[error("{checkpoint} failed verification: {}", failures.join("; "))]
    Integrity {
        checkpoint: CkptRef,
        failures: Vec<String>,
    },
    #[error("every committed checkpoint failed: {}", tried.join("; "))]
    AllFailed { tried: Vec<String> },
    #[error("gave up after {tries} tries: {what} kept changing under us")]
    Contended { what: &'static str, tries: u32 },
    #[error("{checkpoint} is not pinned")]
    NotPinned { checkpoint: CkptRef },
    #[error("{checkpoint} was deleted (by gc) while it was being pinned")]
    DeletedWhilePinning { checkpoint: CkptRef },
}

impl CkptError {
    pub fn store(&self) -> Option<&StoreError> {
        match self {
            Self::Store(s) => Some(s),
            _ => None,
        }
    }
}

/// How often to retry a create that lost its race before giving up.
const MAX_TRIES: u32 = 64;

/// One run's checkpoints in a store.
#[derive(Debug, Clone)]
pub struct Ckpt {
    store: Store,
    run: String,
}

/// Whether a publish moved latest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Appended {
    Created(GenRecord),
    /// Latest already points at this checkpoint or a newer one of the same
    /// epoch.
    NotNewer(GenRecord),
}

fn record<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, CkptError> {
    serde_json::from_slice(bytes).map_err(|e| CkptError::Record {
        key: key.to_owned(),
        message: e.to_string(),
    })
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).unwrap_or_default();
    b.push(b'\n');
    b
}

/// Writer names: 1-200 printable ASCII characters, no spaces.
pub fn check_writer(writer: &str) -> Result<(), CkptError> {
    if writer.is_empty() || writer.len() > 200 || !writer.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(CkptError::BadWriter {
            writer: writer.to_owned(),
            reason: "use 1-200 printable ASCII characters without spaces".into(),
        });
    }
    Ok(())
}

impl Ckpt {
    pub fn new(store: &Store, run: &str) -> Result<Self, CkptError> {
        layout::check_run(run)?;
        Ok(Self {
            store: store.sub(run),
            run: run.to_owned(),
        })
    }

    pub fn run(&self) -> &str {
        &self.run
    }

    /// The store rooted at the run.
    pub fn store(&self) -> &Store {
        &self.store
    }

    async fn put_create(&self, key: &str, data: Vec<u8>) -> Result<CreateOutcome, CkptError> {
        Ok(self.store.create(key, data.into()).await?)
    }

    // ----- writers and fencing -----

    /// Every writer record, by epoch.
    pub async fn writers(&self) -> Result<Vec<WriterRecord>, CkptError> {
        let mut out = Vec::new();
        for o in self.store.list("writers").await? {
            if layout::parse_numbered(&o.key, "writers", 10).is_none() {
                continue;
            }
            let Some(b) = self.store.get_opt(&o.key).await? else {
                continue;
            };
            let r: WriterRecord = record(&o.key, &b)?;
            out.push(r);
        }
        out.sort_by_key(|r| r.epoch);
        Ok(out)
    }

    /// The epoch `writer` holds: its own if it holds the newest one, a new
    /// one if it never held any. A writer whose epoch was superseded is
    /// fenced for good. Taking a new epoch also writes a fence record into
    /// the latest chain, the point from which older epochs cannot publish.
    pub async fn acquire(&self, writer: &str, ctx: &Context) -> Result<WriterRecord, CkptError> {
        check_writer(writer)?;
        for _ in 0..MAX_TRIES {
            let all = self.writers().await?;
            let top = all.last().cloned();
            if let Some(mine) = all.iter().find(|r| r.writer == writer) {
                let top = top.unwrap_or_else(|| mine.clone());
                if top.epoch == mine.epoch {
                    return Ok(mine.clone());
                }
                return Err(CkptError::Fenced {
                    writer: writer.to_owned(),
                    epoch: mine.epoch,
                    by: top.writer,
                    by_epoch: top.epoch,
                });
            }
            let epoch = top.as_ref().map_or(1, |t| t.epoch + 1);
            let rec = WriterRecord {
                version: records::VERSION,
                epoch,
                writer: writer.to_owned(),
                host: ctx.host.clone(),
                time: ctx.now_unix,
            };
            match self
                .put_create(&layout::writer_key(epoch), json(&rec))
                .await?
            {
                CreateOutcome::Created => {
                    self.append(GenKind::Fence, &rec, None, ctx).await?;
                    return Ok(rec);
                }
                CreateOutcome::AlreadyExists => continue,
            }
        }
        Err(CkptError::Contended {
            what: "writer records",
            tries: MAX_TRIES,
        })
    }

    /// Fails with `Fenced` if a newer epoch than `me` exists.
    async fn check_fence(&self, me: &WriterRecord) -> Result<(), CkptError> {
        let all = self.writers().await?;
        match all.last() {
            Some(top) if top.epoch > me.epoch => Err(CkptError::Fenced {
                writer: me.writer.clone(),
                epoch: me.epoch,
                by: top.writer.clone(),
                by_epoch: top.epoch,
            }),
            _ => Ok(()),
        }
    }

    // ----- the latest chain -----

    /// Generation numbers present, ascending.
    pub async fn generations(&self) -> Result<Vec<u64>, CkptError> {
        let mut g: Vec<u64> = self
            .store
            .list("latest")
            .await?
            .iter()
            .filter_map(|o| layout::parse_numbered(&o.key, "latest", 20))
            .collect();
        g.sort_unstable();
        Ok(g)
    }

    pub async fn generation(&self, g: u64) -> Result<Option<GenRecord>, CkptError> {
        let key = layout::generation_key(g);
        match self.store.get_opt(&key).await? {
            Some(b) => Ok(Some(record(&key, &b)?)),
            None => Ok(None),
        }
    }

    /// The highest generation record.
    pub async fn top(&self) -> Result<Option<GenRecord>, CkptError> {
        match self.generations().await?.last() {
            Some(g) => self.generation(*g).await,
            None => Ok(None),
        }
    }

    /// What `latest` resolves to (without checking the data).
    pub async fn latest(&self) -> Result<Option<CkptRef>, CkptError> {
        Ok(self.top().await?.and_then(|r| r.checkpoint))
    }

    /// Appends a record to the chain: reads the top generation g and
    /// creates g+1, unless a newer epoch already wrote (fenced) or, for a
    /// publish, the top already is this checkpoint or a newer one of the
    /// same epoch.
    async fn append(
        &self,
        kind: GenKind,
        me: &WriterRecord,
        checkpoint: Option<CkptRef>,
        ctx: &Context,
    ) -> Result<Appended, CkptError> {
        for _ in 0..MAX_TRIES {
            let top = self.top().await?;
            if let Some(t) = &top {
                if t.epoch > me.epoch {
                    return Err(CkptError::Fenced {
                        writer: me.writer.clone(),
                        epoch: me.epoch,
                        by: t.writer.clone(),
                        by_epoch: t.epoch,
                    });
                }
                if let (GenKind::Publish, Some(mine)) = (kind, checkpoint) {
                    // Within one epoch latest only moves to higher steps. A
                    // fence record of this epoch does not count: the new
                    // writer may resume from an older step.
                    if t.epoch == me.epoch && t.kind == GenKind::Publish {
                        if let Some(cur) = t.checkpoint {
                            if cur.step >= mine.step {
                                return Ok(Appended::NotNewer(t.clone()));
                            }
                        }
                    }
                }
            }
            let generation = top.as_ref().map_or(1, |t| t.generation + 1);
            let rec = GenRecord {
                version: records::VERSION,
                generation,
                kind,
                epoch: me.epoch,
                writer: me.writer.clone(),
                checkpoint: match kind {
                    GenKind::Publish => checkpoint,
                    GenKind::Fence => top.and_then(|t| t.checkpoint),
                },
                time: ctx.now_unix,
            };
            match self
                .put_create(&layout::generation_key(generation), json(&rec))
                .await?
            {
                CreateOutcome::Created => return Ok(Appended::Created(rec)),
                CreateOutcome::AlreadyExists => continue,
            }
        }
        Err(CkptError::Contended {
            what: "latest generations",
            tries: MAX_TRIES,
        })
    }

    /// The checkpoints the chain has pointed at, newest first, each once.
    pub async fn chain(&self) -> Result<Vec<CkptRef>, CkptError> {
        let mut out: Vec<CkptRef> = Vec::new();
        for g in self.generations().await?.into_iter().rev() {
            if let Some(r) = self.generation(g).await? {
                if let Some(c) = r.checkpoint {
                    if !out.contains(&c) {
                        out.push(c);
                    }
                }
            }
        }
        Ok(out)
    }

    // ----- manifests -----

    /// A checkpoint's manifest and metadata, or `None` if not committed.
    pub async fn manifest(&self, c: CkptRef) -> Result<Option<(Manifest, CkptMeta)>, CkptError> {
        Ok(self.manifest_bytes(c).await?.map(|(_, m, meta)| (m, meta)))
    }

    /// [`Ckpt::manifest`] with the manifest's bytes as stored.
    pub(crate) async fn manifest_bytes(
        &self,
        c: CkptRef,
    ) -> Result<Option<(bytes::Bytes, Manifest, CkptMeta)>, CkptError> {
        let key = layout::manifest_key(c.step, c.epoch);
        let Some(b) = self.store.get_opt(&key).await? else {
            return Ok(None);
        };
        let m = Manifest::from_json(&b).map_err(|source| CkptError::Manifest {
            key: key.clone(),
            source,
        })?;
        let meta = CkptMeta::from_map(&m.metadata).map_err(|message| CkptError::Record {
            key: key.clone(),
            message: format!("predicate.keel: {message}"),
        })?;
        if meta.step != c.step || meta.epoch != c.epoch {
            return Err(CkptError::Record {
                key,
                message: format!(
                    "says step {} epoch {}, stored as step {} epoch {}",
                    meta.step, meta.epoch, c.step, c.epoch
                ),
            });
        }
        Ok(Some((b, m, meta)))
    }

    /// Every committed checkpoint (a manifest exists), by step then epoch.
    pub async fn committed(&self) -> Result<Vec<CkptRef>, CkptError> {
        let mut out = Vec::new();
        for step_dir in self.store.list_dirs("ckpt").await? {
            let Ok(step) = step_dir.parse::<u64>() else {
                continue;
            };
            for e in self.store.list_dirs(&format!("ckpt/{step_dir}")).await? {
                let Some(epoch) = e.strip_prefix('e').and_then(|x| x.parse::<u64>().ok()) else {
                    continue;
                };
                if self
                    .store
                    .head(&layout::manifest_key(step, epoch))
                    .await?
                    .is_some()
                {
                    out.push(CkptRef { step, epoch });
                }
            }
        }
        out.sort();
        Ok(out)
    }

    // ----- pins -----

    pub async fn pins(&self) -> Result<Vec<PinRecord>, CkptError> {
        let mut out = Vec::new();
        for o in self.store.list("pins").await? {
            if let Some(b) = self.store.get_opt(&o.key).await? {
                out.push(record::<PinRecord>(&o.key, &b)?);
            }
        }
        Ok(out)
    }

    pub async fn pin(
        &self,
        sel: Selector,
        reason: &str,
        ctx: &Context,
    ) -> Result<PinRecord, CkptError> {
        let c = self.resolve_one(sel).await?;
        self.pin_committed(c, reason, ctx).await
    }

    /// Pins exactly this checkpoint (step and epoch).
    pub async fn pin_ref(
        &self,
        c: CkptRef,
        reason: &str,
        ctx: &Context,
    ) -> Result<PinRecord, CkptError> {
        if !self.is_committed(c).await? {
            return Err(CkptError::NoSuchStep {
                run: self.run.clone(),
                step: c.step,
            });
        }
        self.pin_committed(c, reason, ctx).await
    }

    pub(crate) async fn is_committed(&self, c: CkptRef) -> Result<bool, CkptError> {
        let key = layout::manifest_key(c.step, c.epoch);
        Ok(self.store.head(&key).await?.is_some())
    }

    /// Pins a checkpoint that was committed a moment ago.
    async fn pin_committed(
        &self,
        c: CkptRef,
        reason: &str,
        ctx: &Context,
    ) -> Result<PinRecord, CkptError> {
        let rec = PinRecord {
            version: records::VERSION,
            checkpoint: c,
            reason: reason.to_owned(),
            host: ctx.host.clone(),
            time: ctx.now_unix,
        };
        let key = layout::pin_key(c.step, c.epoch);
        self.store.put(&key, json(&rec).into()).await?;
        // The pin's half of the handshake with gc, which deletes the
        // manifest and then looks for a pin: written the pin, look for the
        // manifest. One of the two sees the other, so a checkpoint is never
        // both pinned and deleted.
        if !self.is_committed(c).await? {
            self.store.delete(&key).await?;
            return Err(CkptError::DeletedWhilePinning { checkpoint: c });
        }
        Ok(rec)
    }

    /// Removes a pin, first recording why (a create-only `unpins/` record
    /// holding the removed pin), so pins never vanish without a trace.
    pub async fn unpin(
        &self,
        sel: Selector,
        reason: &str,
        ctx: &Context,
    ) -> Result<UnpinRecord, CkptError> {
        let c = self.resolve_one(sel).await?;
        let key = layout::pin_key(c.step, c.epoch);
        let Some(bytes) = self.store.get_opt(&key).await? else {
            return Err(CkptError::NotPinned { checkpoint: c });
        };
        let pin: PinRecord = record(&key, &bytes)?;
        let rec = UnpinRecord {
            version: records::VERSION,
            checkpoint: c,
            reason: reason.to_owned(),
            host: ctx.host.clone(),
            time: ctx.now_unix,
            pin,
        };
        self.store
            .create(
                &layout::unpin_key(c.step, c.epoch, ctx.now_unix, ctx.nonce),
                json(&rec).into(),
            )
            .await?;
        self.store.delete(&key).await?;
        Ok(rec)
    }
}

impl keel_error::HasKind for CkptError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Store(s) => keel_error::HasKind::kind(s),
            Self::BadRun { .. }
            | Self::BadWriter { .. }
            | Self::NotADirectory { .. }
            | Self::NotAFile { .. }
            | Self::SymlinkedDir { .. }
            | Self::BadFileName { .. }
            | Self::EmptyCheckpoint { .. }
            | Self::TargetNotEmpty { .. }
            | Self::NotPinned { .. } => K::Usage,
            Self::LocalDir { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                K::Usage
            }
            Self::LocalDir { .. } | Self::LocalWrite { .. } | Self::Contended { .. } => K::Io,
            Self::Manifest { .. } | Self::Record { .. } => K::Input,
            Self::Fenced { .. }
            | Self::Conflict { .. }
            | Self::Integrity { .. }
            | Self::AllFailed { .. } => K::Failed,
            Self::NoCheckpoint { .. }
            | Self::NoSuchStep { .. }
            | Self::DeletedWhilePinning { .. } => K::Unavailable,
        }
    }
}

/// The kind of an error of this crate, or of the object store under it.
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; CkptError; keel_store::error_kind)
}
