//! The audit log: append-only JSON lines, each carrying the SHA-256 of the
//! line before it, so removing, reordering or editing any line breaks the
//! chain that `verify` (and `keel serve audit verify`) checks.
//!
//! A line is `{"seq":N,"prev":"<hex>","event":...,"ts":"...",...,"hash":"<hex>"}`
//! where `hash` is the SHA-256 of the line's text without its `,"hash":...`
//! suffix. Verification reads `seq` and `prev` wherever they are, so the
//! order of the other keys is free. Requests queue their event as data;
//! one thread, off the request path, serialises, numbers, chains and
//! writes them in batches every few milliseconds.
//! Prompts and completions are recorded only when configured.

pub use crate::config::Checkpoints;
use std::fs::OpenOptions;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::batch::Batcher;
use crate::error::GatewayError;
use crate::keys::hex;

pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const SUFFIX_LEN: usize = ",\"hash\":\"\"}".len() + 64;

/// Something to record: the writer thread, off the request path, asks it
/// for the text of one JSON object (with `ts`, without `seq` or `prev`).
pub trait Event: Send + 'static {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error>;
}

/// An event built as a JSON object (the admin API's, reloads, stops).
impl Event for Map<String, Value> {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        serde_json::to_writer(out, self)
    }
}

/// An event queued for the writer, and who waits for it to be on disk.
type Queued = (Box<dyn Event>, Option<tokio::sync::oneshot::Sender<bool>>);

/// A running audit log.
#[derive(Debug)]
pub struct AuditLog {
    batcher: Batcher<Queued>,
    path: PathBuf,
    sync: bool,
}

impl std::fmt::Debug for dyn Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("audit event")
    }
}

/// Makes one chained line from an event, the text of a JSON object:
/// `(line, hash)`.
pub fn chain_line(seq: u64, prev: &str, event: &str) -> (String, String) {
    let fields = event
        .trim()
        .strip_prefix('{')
        .and_then(|e| e.strip_suffix('}'))
        .unwrap_or("")
        .trim();
    let mut body = String::with_capacity(event.len() + prev.len() + 120);
    body.push_str("{\"seq\":");
    body.push_str(crate::digits::decimal(seq, &mut [0; 20]));
    body.push_str(",\"prev\":\"");
    body.push_str(prev);
    body.push('"');
    if !fields.is_empty() {
        body.push(',');
        body.push_str(fields);
    }
    // The hash covers the line without its hash field: `body` closed.
    let mut h = Sha256::new();
    h.update(body.as_bytes());
    h.update(b"}");
    let hash = hex(&h.finalize());
    body.push_str(",\"hash\":\"");
    body.push_str(&hash);
    body.push_str("\"}");
    (body, hash)
}

/// What a chain check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub entries: u64,
    pub last_hash: String,
    /// `recovered` events: places where the gateway, starting after a
    /// crash, set an incomplete last line aside.
    pub recoveries: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct ChainBroken {
    pub line: u64,
    pub reason: String,
}

/// Why a log does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A line was edited, removed, reordered or is not an audit line.
    #[error(transparent)]
    Broken(#[from] ChainBroken),
    /// The last line has no newline: a write cut short by a crash. Every
    /// line before it verifies (`intact` is their report); the gateway
    /// sets such a tail aside when it next starts.
    #[error("incomplete final line (crash): {bytes} bytes after line {}", intact.entries)]
    IncompleteTail { intact: VerifyReport, bytes: u64 },
}

/// Checks every line's hash and its link to the line before. A blank line
/// is not an audit line (keel never writes one), here and when the
/// gateway opens the log.
pub fn verify(mut r: impl BufRead) -> Result<VerifyReport, VerifyError> {
    let mut prev = GENESIS.to_owned();
    let mut n = 0u64;
    let mut recoveries = 0u64;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let read = r.read_until(b'\n', &mut buf).map_err(|e| ChainBroken {
            line: n + 1,
            reason: format!("cannot read: {e}"),
        })?;
        if read == 0 {
            break;
        }
        if buf.last() != Some(&b'\n') {
            return Err(VerifyError::IncompleteTail {
                intact: VerifyReport {
                    entries: n,
                    last_hash: prev,
                    recoveries,
                },
                bytes: buf.len() as u64,
            });
        }
        n += 1;
        let broken = |reason: String| ChainBroken { line: n, reason };
        let line =
            std::str::from_utf8(&buf[..buf.len() - 1]).map_err(|_| broken("not UTF-8".into()))?;
        let (seq, p, hash) = check_line(line).map_err(broken)?;
        if seq != n {
            return Err(broken(format!(
                "sequence number {seq}, expected {n}: lines missing or reordered"
            ))
            .into());
        }
        if p != prev {
            return Err(
                broken("does not follow the line before it (prev hash differs)".into()).into(),
            );
        }
        if line.contains("\"event\":\"recovered\"") {
            recoveries += 1;
        }
        prev = hash;
    }
    Ok(VerifyReport {
        entries: n,
        last_hash: prev,
        recoveries,
    })
}

/// What a keyed check found: the chain, and how much of it the
/// checkpoints' MACs vouch for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedReport {
    pub chain: VerifyReport,
    /// Checkpoints whose MAC matched.
    pub checkpoints: u64,
    /// Lines up to and including the last good checkpoint.
    pub signed_through: u64,
    /// The checkpoint line the anchor records, found in the log with its
    /// MAC (`None` without an anchor).
    pub anchored: Option<u64>,
}

/// `verify`, and every `checkpoint` line's MAC checked under `key`: a
/// checkpoint whose MAC does not match, or whose head is not the line
/// before it, breaks the chain there. With `anchor` (the latest
/// checkpoint as kept outside the log), a log that does not hold that
/// checkpoint, line for line, is broken: cut back to an earlier
/// checkpoint, or rewritten.
pub fn verify_with_key(
    mut r: impl BufRead,
    key: &[u8],
    anchor: Option<&Anchor>,
) -> Result<KeyedReport, VerifyError> {
    let mut all = Vec::new();
    r.read_to_end(&mut all).map_err(|e| ChainBroken {
        line: 1,
        reason: format!("cannot read: {e}"),
    })?;
    let chain = verify(all.as_slice())?;
    let (mut checkpoints, mut signed_through) = (0, 0);
    let mut anchored = None;
    if let Some(a) = anchor {
        if checkpoint_mac(key, a.covers_seq, &a.covers_hash) != a.mac {
            return Err(ChainBroken {
                line: 0,
                reason: "the anchor's MAC does not match: it was not written with this key".into(),
            }
            .into());
        }
        if a.checkpoint_seq() > chain.entries {
            return Err(ChainBroken {
                line: chain.entries,
                reason: format!(
                    "the log ends at line {} but its anchor records a checkpoint at line {}: lines were cut off",
                    chain.entries,
                    a.checkpoint_seq()
                ),
            }
            .into());
        }
    }
    let mut prev = (0u64, GENESIS.to_owned());
    for (i, line) in all.split(|&b| b == b'\n').enumerate() {
        let n = i as u64 + 1;
        if n > chain.entries {
            break;
        }
        // Verified above: UTF-8, JSON, with seq and hash.
        let line = std::str::from_utf8(line).unwrap_or("");
        let (_, _, hash) = check_line(line).map_err(|reason| ChainBroken { line: n, reason })?;
        if line.contains("\"event\":\"checkpoint\"") {
            let body = &line[..line.len() - SUFFIX_LEN];
            let v: Value = serde_json::from_str(&format!("{body}}}")).unwrap_or(Value::Null);
            let broken = |reason: &str| ChainBroken {
                line: n,
                reason: reason.to_owned(),
            };
            let cs = v.get("covers_seq").and_then(Value::as_u64);
            let ch = v.get("covers_hash").and_then(Value::as_str);
            let mac = v.get("mac").and_then(Value::as_str);
            let (Some(cs), Some(ch), Some(mac)) = (cs, ch, mac) else {
                return Err(broken("checkpoint without covers_seq, covers_hash and mac").into());
            };
            if (cs, ch) != (prev.0, prev.1.as_str()) {
                return Err(broken("checkpoint does not cover the line before it").into());
            }
            if checkpoint_mac(key, cs, ch) != mac {
                return Err(broken(
                    "checkpoint MAC does not match: the lines up to here were rewritten, or the key is not the log's",
                )
                .into());
            }
            checkpoints += 1;
            signed_through = n;
            if anchor.is_some_and(|a| {
                (a.covers_seq, a.covers_hash.as_str(), a.mac.as_str()) == (cs, ch, mac)
            }) {
                anchored = Some(n);
            }
        }
        if let Some(a) = anchor.filter(|a| a.checkpoint_seq() == n && anchored != Some(n)) {
            return Err(ChainBroken {
                line: n,
                reason: format!(
                    "line {n} is not the checkpoint the anchor records (covering line {} with hash {}): the log was rewritten",
                    a.covers_seq,
                    a.covers_hash
                ),
            }
            .into());
        }
        prev = (n, hash);
    }
    Ok(KeyedReport {
        chain,
        checkpoints,
        signed_through,
        anchored,
    })
}

/// One line's own integrity: `(seq, prev, hash)`.
fn check_line(line: &str) -> Result<(u64, String, String), String> {
    if line.is_empty() {
        return Err("blank line: not an audit line".into());
    }
    if line.len() < SUFFIX_LEN + 2 || !line.is_char_boundary(line.len() - SUFFIX_LEN) {
        return Err("not an audit line".into());
    }
    let (body, suffix) = line.split_at(line.len() - SUFFIX_LEN);
    let hash = suffix
        .strip_prefix(",\"hash\":\"")
        .and_then(|s| s.strip_suffix("\"}"))
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or("no hash at the end of the line")?;
    let body = format!("{body}}}");
    if hex(&Sha256::digest(body.as_bytes())) != hash {
        return Err("hash does not match the line's content: edited".into());
    }
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("not JSON: {e}"))?;
    let seq = v.get("seq").and_then(Value::as_u64).ok_or("no seq")?;
    let prev = v.get("prev").and_then(Value::as_str).ok_or("no prev")?;
    Ok((seq, prev.to_owned(), hash.to_owned()))
}

/// How the log is opened.
#[derive(Debug, Clone, Default)]
pub struct AuditOptions {
    /// A group that may read the log: the file is then 0640 and owned by
    /// that group. `None`: 0600, its owner only.
    pub group: Option<u32>,
    /// Now, as Unix milliseconds: the time of a `recovered` event.
    pub now_ms: u64,
    /// Signed checkpoints of the chain's head.
    pub checkpoints: Option<Checkpoints>,
    /// `audit.sync`: callers of `record_synced` wait until their line is
    /// written and `fdatasync`ed.
    pub sync: bool,
}

/// The latest checkpoint, kept outside the log: the checkpoint line is
/// line `covers_seq + 1` and carries exactly these fields.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Anchor {
    /// The format's version (1).
    pub version: u32,
    pub covers_seq: u64,
    pub covers_hash: String,
    pub mac: String,
}

/// The largest anchor file read (a real one is some 200 bytes).
const MAX_ANCHOR_BYTES: u64 = 4096;

impl Anchor {
    /// The checkpoint line's own sequence number.
    pub fn checkpoint_seq(&self) -> u64 {
        self.covers_seq.saturating_add(1)
    }

    /// Reads an anchor file (`Ok(None)` when there is none).
    pub fn read(path: &Path) -> Result<Option<Anchor>, GatewayError> {
        let bytes = match keel_fs::read_regular(path, MAX_ANCHOR_BYTES) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(GatewayError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let malformed = |reason: String| GatewayError::Malformed {
            what: "audit anchor",
            path: path.to_owned(),
            reason,
        };
        let a: Anchor = serde_json::from_slice(&bytes)
            .map_err(|e| malformed(format!("not an audit anchor: {e}")))?;
        if a.version != 1 {
            return Err(malformed(format!(
                "version {} (this keel reads 1)",
                a.version
            )));
        }
        Ok(Some(a))
    }

    fn write(&self, path: &Path) -> Result<(), keel_fs::FsError> {
        let mut text = serde_json::to_vec(self).unwrap_or_default();
        text.push(b'\n');
        keel_fs::write_atomic(path, &text, 0o600)
    }
}

/// The MAC a checkpoint carries for a head `(seq, hash)`.
pub fn checkpoint_mac(key: &[u8], seq: u64, hash: &str) -> String {
    use hmac::Mac;
    let mut m = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(format!("keel-audit-checkpoint-v1\n{seq}\n{hash}").as_bytes());
    hex(&m.finalize().into_bytes())
}

fn checkpoint_event(key: &[u8], seq: u64, hash: &str) -> String {
    format!(
        "{{\"event\":\"checkpoint\",\"covers_seq\":{seq},\"covers_hash\":\"{hash}\",\"mac\":\"{}\"}}",
        checkpoint_mac(key, seq, hash)
    )
}

/// The tail of a log as the writer will continue it.
struct Tail {
    seq: u64,
    prev: String,
    /// Where the last complete line ends (bytes).
    complete: u64,
}

/// Reads backwards from the end for the last complete line: bytes after
/// the last newline are an incomplete line (a crash mid-write).
fn read_tail(f: &mut std::fs::File, path: &Path) -> Result<Tail, GatewayError> {
    use std::io::{Read, Seek, SeekFrom};
    let rerr = |source| GatewayError::Read {
        path: path.to_owned(),
        source,
    };
    let len = f.metadata().map_err(rerr)?.len();
    // Bytes from `pos` to the end, read in growing chunks from the back.
    let mut pos = len;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = 64u64 << 10;
    loop {
        // The last newline, then the one before it.
        let last_nl = buf.iter().rposition(|&b| b == b'\n');
        if let Some(end) = last_nl {
            let before = buf[..end].iter().rposition(|&b| b == b'\n');
            if before.is_some() || pos == 0 {
                let start = before.map_or(0, |i| i + 1);
                let line =
                    std::str::from_utf8(&buf[start..end]).map_err(|_| GatewayError::Malformed {
                        what: "audit log",
                        path: path.to_owned(),
                        reason: "last line: not UTF-8".into(),
                    })?;
                let (seq, _, hash) = check_line(line).map_err(|reason| GatewayError::Malformed {
                    what: "audit log",
                    path: path.to_owned(),
                    reason: format!(
                        "last line: {reason} (`keel serve audit verify` says where the chain breaks)"
                    ),
                })?;
                return Ok(Tail {
                    seq,
                    prev: hash,
                    complete: pos + end as u64 + 1,
                });
            }
        } else if pos == 0 {
            // No complete line at all.
            return Ok(Tail {
                seq: 0,
                prev: GENESIS.to_owned(),
                complete: 0,
            });
        }
        let step = chunk.min(pos);
        pos -= step;
        let mut more = vec![0u8; step as usize];
        f.seek(SeekFrom::Start(pos)).map_err(rerr)?;
        f.read_exact(&mut more).map_err(rerr)?;
        more.extend_from_slice(&buf);
        buf = more;
        chunk = chunk.saturating_mul(2);
    }
}

/// Moves an incomplete last line (bytes `from..` of the log) to a file of
/// its own beside the log and cuts the log after its last complete line.
/// Returns what the `recovered` event records.
fn set_aside_tail(
    f: &std::fs::File,
    path: &Path,
    from: u64,
    mode: u32,
) -> Result<Map<String, Value>, GatewayError> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let rerr = |source| GatewayError::Read {
        path: path.to_owned(),
        source,
    };
    let mut r = f;
    let mut bytes = Vec::new();
    r.seek(SeekFrom::Start(from)).map_err(rerr)?;
    r.read_to_end(&mut bytes).map_err(rerr)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "audit.jsonl".into());
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let (aside, mut out) = (0u32..)
        .find_map(|i| {
            let p = dir.join(match i {
                0 => format!("{name}.incomplete-{from}"),
                _ => format!("{name}.incomplete-{from}.{i}"),
            });
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&p)
            {
                Ok(f) => Some(Ok((p, f))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                Err(source) => Some(Err(GatewayError::Write { path: p, source })),
            }
        })
        .expect("an unused name")?;
    let werr = |p: &Path| {
        let p = p.to_owned();
        move |source| GatewayError::Write { path: p, source }
    };
    out.write_all(&bytes)
        .and_then(|()| out.sync_all())
        .map_err(werr(&aside))?;
    keel_fs::sync_dir(dir).map_err(werr(dir))?;
    f.set_len(from)
        .and_then(|()| f.sync_all())
        .map_err(werr(path))?;
    let mut m = Map::new();
    m.insert("event".into(), "recovered".into());
    m.insert(
        "reason".into(),
        "incomplete last line (a crash mid-write) set aside".into(),
    );
    m.insert("discarded_bytes".into(), (bytes.len() as u64).into());
    m.insert(
        "discarded_sha256".into(),
        hex(&Sha256::digest(&bytes)).into(),
    );
    m.insert("moved_to".into(), aside.display().to_string().into());
    Ok(m)
}

impl AuditLog {
    /// Opens (or creates) the log, continuing the chain of what is there.
    /// A log whose last complete line is not a valid audit line is
    /// refused. An incomplete last line (a crash mid-write) is moved to
    /// `<log>.incomplete-<offset>` beside it and the chain continues with
    /// a `recovered` event that records its size and SHA-256.
    pub fn open(path: &Path, opts: &AuditOptions) -> Result<Self, GatewayError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let werr = |source| GatewayError::Write {
            path: path.to_owned(),
            source,
        };
        let mode = if opts.group.is_some() { 0o640 } else { 0o600 };
        let file = OpenOptions::new()
            .read(true)
            .create(true)
            .append(true)
            .mode(mode)
            .open(path)
            .map_err(werr)?;
        // An existing log is brought to the mode and group too.
        if let Some(g) = opts.group {
            rustix::fs::fchown(&file, None, Some(rustix::fs::Gid::from_raw(g)))
                .map_err(|e| werr(e.into()))?;
        }
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(werr)?;
        let tail = read_tail(&mut file.try_clone().map_err(werr)?, path)?;
        let len = file.metadata().map_err(werr)?.len();
        let recovered = if tail.complete < len {
            let mut m = set_aside_tail(&file, path, tail.complete, mode)?;
            m.insert("ts".into(), crate::clock::rfc3339(opts.now_ms).into());
            m.insert("after_seq".into(), tail.seq.into());
            Some(m)
        } else {
            None
        };
        let (mut seq, mut prev) = (tail.seq, tail.prev);
        let checkpoints = opts.checkpoints.clone();
        // A log shorter than its anchor lost lines since the gateway last
        // wrote it: continuing would replace the anchor, the evidence.
        if let Some(anchor_path) = checkpoints.as_ref().and_then(|c| c.anchor.as_deref()) {
            if let Some(a) = Anchor::read(anchor_path)? {
                if a.checkpoint_seq() > seq {
                    return Err(GatewayError::Malformed {
                        what: "audit log",
                        path: path.to_owned(),
                        reason: format!(
                            "it ends at line {seq} but its anchor {} records a checkpoint at line {}: lines were cut off. `keel serve audit verify --key KEYFILE` says more; move the log and the anchor aside to start a new one",
                            anchor_path.display(),
                            a.checkpoint_seq()
                        ),
                    });
                }
            }
        }
        // The last line a checkpoint covers (itself included).
        let mut signed = seq;
        let mut file = file;
        let mut buf = Vec::with_capacity(64 << 10);
        let mut text = Vec::with_capacity(1024);
        let shown = path.to_owned();
        let sync = opts.sync;
        let mut waiters = Vec::new();
        let batcher = Batcher::spawn_with("keel-audit", !sync, move |batch: Vec<Queued>, last| {
            // The whole batch is built first and written with one call, so
            // only whole lines reach the file: a crash between two writes
            // of a buffered writer could leave half a line.
            buf.clear();
            waiters.clear();
            for (ev, waiter) in batch {
                waiters.extend(waiter);
                text.clear();
                if let Err(err) = ev.write_json(&mut text) {
                    tracing::error!(error = %err, "audit event not serialisable");
                    continue;
                }
                let Ok(ev) = std::str::from_utf8(&text) else {
                    tracing::error!("audit event not UTF-8");
                    continue;
                };
                seq += 1;
                let (line, hash) = chain_line(seq, &prev, ev);
                prev = hash;
                buf.extend_from_slice(line.as_bytes());
                buf.push(b'\n');
            }
            let mut anchor = None;
            if let Some(c) = &checkpoints {
                if seq > 0 && (seq - signed >= c.every || (last && seq > signed)) {
                    let ev = checkpoint_event(&c.key, seq, &prev);
                    anchor = c.anchor.as_deref().map(|p| {
                        let a = Anchor {
                            version: 1,
                            covers_seq: seq,
                            covers_hash: prev.clone(),
                            mac: checkpoint_mac(&c.key, seq, &prev),
                        };
                        (p, a)
                    });
                    seq += 1;
                    let (line, hash) = chain_line(seq, &prev, &ev);
                    prev = hash;
                    signed = seq;
                    buf.extend_from_slice(line.as_bytes());
                    buf.push(b'\n');
                }
            }
            let mut failed = file.write_all(&buf).err();
            // The anchor moves only once its checkpoint is on disk: an
            // anchor ahead of the log would read as lines cut off.
            if let (Some((anchor_path, a)), None) = (&anchor, &failed) {
                let kept = file.sync_data().map_err(|e| e.to_string()).and_then(|()| {
                    a.write(anchor_path).map_err(|e| {
                        let mut s = e.to_string();
                        let mut src = std::error::Error::source(&e);
                        while let Some(x) = src {
                            s.push_str(&format!(": {x}"));
                            src = x.source();
                        }
                        s
                    })
                });
                if let Err(error) = kept {
                    tracing::error!(path = %anchor_path.display(), %error, "audit anchor not written; verify --key will report the checkpoints up to the last anchor written");
                }
            }
            if last {
                if let Err(e) = file.sync_all() {
                    failed.get_or_insert(e);
                }
            } else if !waiters.is_empty() && failed.is_none() {
                if let Err(e) = file.sync_data() {
                    failed.get_or_insert(e);
                }
            }
            for w in waiters.drain(..) {
                let _ = w.send(failed.is_none());
            }
            // A write that failed (a full disk, say) is reported once per
            // batch: the lines are lost and `audit verify` will find the
            // chain broken there.
            if let Some(e) = failed {
                tracing::error!(path = %shown.display(), error = %e, "audit log write failed; lines were lost");
            }
            if buf.capacity() > 4 << 20 {
                buf = Vec::with_capacity(64 << 10);
            }
        })
        .map_err(werr)?;
        let log = Self {
            batcher,
            path: path.to_owned(),
            sync,
        };
        if let Some(m) = recovered {
            tracing::warn!(path = %path.display(), "audit log ended in an incomplete line (a crash mid-write): set aside, chain continued with a recovered event");
            log.record(m);
        }
        Ok(log)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues an event (a JSON object once serialised by the writer
    /// thread; `ts` should be in it, `seq` and `prev` must not).
    pub fn record(&self, event: impl Event) {
        if self.batcher.push((Box::new(event), None)).is_err() {
            tracing::error!(path = %self.path.display(), "audit log already closed; an event was not recorded");
        }
    }

    /// Whether the log was opened with `sync`.
    pub fn syncs(&self) -> bool {
        self.sync
    }

    /// Queues an event and wakes the writer; the answer is `true` once
    /// its line is written and synced to disk, `false` if that failed or
    /// the log is closed.
    pub fn record_synced(&self, event: impl Event) -> tokio::sync::oneshot::Receiver<bool> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Err((_, tx)) = self.batcher.push_now((Box::new(event), Some(tx))) {
            tracing::error!(path = %self.path.display(), "audit log already closed; an event was not recorded");
            if let Some(tx) = tx {
                let _ = tx.send(false);
            }
        }
        rx
    }

    /// Writes everything queued, syncs the file and stops the writer.
    pub fn close(&self) {
        self.batcher.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(i: u64) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("event".into(), "request".into());
        m.insert("n".into(), i.into());
        m
    }

    /// An event whose serialisation fails.
    struct Broken;
    impl Event for Broken {
        fn write_json(&self, _: &mut Vec<u8>) -> Result<(), serde_json::Error> {
            Err(serde::de::Error::custom("broken on purpose"))
        }
    }

    #[test]
    fn an_event_that_does_not_serialise_leaves_no_gap_in_the_chain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&p, &AuditOptions::default()).expect("open");
        log.record(ev(1));
        log.record(Broken);
        log.record(ev(2));
        log.close();
        let text = std::fs::read_to_string(&p).expect("read");
        assert_eq!(verify(text.as_bytes()).expect("valid").entries, 2);
        assert!(text
            .lines()
            .nth(1)
            .expect("second line")
            .contains("\"n\":2"));
    }

    #[test]
    fn chain_survives_restart_and_catches_tampering() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        for round in 0..2 {
            let log = AuditLog::open(&p, &AuditOptions::default()).expect("open");
            for i in 0..5 {
                log.record(ev(round * 10 + i));
            }
            log.close();
        }
        let text = std::fs::read_to_string(&p).expect("read");
        let r = verify(text.as_bytes()).expect("valid");
        assert_eq!(r.entries, 10);

        let lines: Vec<&str> = text.lines().collect();
        let edited = text.replacen("\"n\":3", "\"n\":4", 1);
        let line = |e: VerifyError| match e {
            VerifyError::Broken(b) => b.line,
            other => panic!("not a broken chain: {other}"),
        };
        assert_eq!(line(verify(edited.as_bytes()).expect_err("edited")), 4);
        let dropped: String = lines
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        assert_eq!(line(verify(dropped.as_bytes()).expect_err("dropped")), 3);
        let truncated: String = lines[..9].iter().map(|l| format!("{l}\n")).collect();
        assert!(
            verify(truncated.as_bytes()).is_ok(),
            "a cut tail is only detectable against a kept last hash"
        );
        let garbage = format!("{text}not json\n");
        assert_eq!(line(verify(garbage.as_bytes()).expect_err("garbage")), 11);
    }

    fn write_log(p: &Path, n: u64) -> String {
        let log = AuditLog::open(p, &AuditOptions::default()).expect("open");
        for i in 0..n {
            log.record(ev(i));
        }
        log.close();
        std::fs::read_to_string(p).expect("read")
    }

    #[test]
    fn an_incomplete_last_line_is_set_aside_and_the_chain_continues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let text = write_log(&p, 3);
        let third = text.lines().nth(2).expect("line 3");
        let torn = &third[..third.len() / 2];
        std::fs::write(&p, format!("{text}{torn}")).expect("tear");

        // `verify` tells a crash from tampering.
        match verify(std::fs::read(&p).expect("read").as_slice()) {
            Err(VerifyError::IncompleteTail { intact, bytes }) => {
                assert_eq!(intact.entries, 3);
                assert_eq!(bytes, torn.len() as u64);
            }
            other => panic!("expected an incomplete tail: {other:?}"),
        }

        let opts = AuditOptions {
            now_ms: 1_700_000_000_000,
            ..AuditOptions::default()
        };
        let log = AuditLog::open(&p, &opts).expect("a torn tail does not stop the gateway");
        log.record(ev(9));
        log.close();
        let after = std::fs::read_to_string(&p).expect("read");
        let r = verify(after.as_bytes()).expect("the chain verifies");
        assert_eq!((r.entries, r.recoveries), (5, 1));
        let rec: Value = serde_json::from_str(after.lines().nth(3).expect("line 4")).expect("json");
        assert_eq!(rec["event"], "recovered");
        assert_eq!(rec["after_seq"], 3);
        assert_eq!(rec["discarded_bytes"], torn.len() as u64);
        assert_eq!(
            rec["discarded_sha256"],
            hex(&Sha256::digest(torn.as_bytes()))
        );
        let aside = dir
            .path()
            .join(format!("audit.jsonl.incomplete-{}", text.len()));
        assert_eq!(rec["moved_to"], aside.display().to_string());
        assert_eq!(std::fs::read_to_string(&aside).expect("aside"), torn);
        assert!(after.starts_with(&text), "the intact lines are untouched");
    }

    #[test]
    fn a_log_that_is_all_incomplete_starts_a_new_chain_after_a_recovered_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        std::fs::write(&p, "{\"seq\":1,\"pr").expect("write");
        let log = AuditLog::open(&p, &AuditOptions::default()).expect("open");
        log.close();
        let r = verify(std::fs::read(&p).expect("read").as_slice()).expect("verifies");
        assert_eq!((r.entries, r.recoveries), (1, 1));
    }

    #[test]
    fn open_and_verify_agree_about_blank_and_edited_last_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let text = write_log(&p, 2);
        for bad in [format!("{text}\n"), text.replacen("\"n\":1", "\"n\":7", 1)] {
            std::fs::write(&p, &bad).expect("write");
            assert!(matches!(
                verify(bad.as_bytes()),
                Err(VerifyError::Broken(ChainBroken { line: 2 | 3, .. }))
            ));
            let e = AuditLog::open(&p, &AuditOptions::default()).expect_err("refused");
            assert!(e.to_string().contains("last line"), "{e}");
        }
        // A blank line in the middle: verify finds it (open reads the tail).
        let mid = text.replacen('\n', "\n\n", 1);
        assert!(matches!(
            verify(mid.as_bytes()),
            Err(VerifyError::Broken(ChainBroken { line: 2, .. }))
        ));
    }

    #[test]
    fn the_log_is_readable_by_its_owner_only_even_when_it_was_not() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        write_log(&p, 1);
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode(&p), 0o600);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        write_log(&p, 1);
        assert_eq!(mode(&p), 0o600);
        // With a group (this process's own, which it may always set).
        let gid = rustix::process::getegid().as_raw();
        let log = AuditLog::open(
            &p,
            &AuditOptions {
                group: Some(gid),
                ..AuditOptions::default()
            },
        )
        .expect("open");
        log.close();
        assert_eq!(mode(&p), 0o640);
    }

    #[test]
    fn a_batch_larger_than_any_buffer_reaches_the_file_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&p, &AuditOptions::default()).expect("open");
        let big = "x".repeat(200 << 10);
        for i in 0..4 {
            let mut m = ev(i);
            m.insert("body".into(), big.clone().into());
            log.record(m);
        }
        log.close();
        let text = std::fs::read(&p).expect("read");
        assert_eq!(verify(text.as_slice()).expect("whole").entries, 4);
    }

    #[test]
    fn checkpoints_sign_the_head_and_catch_a_rechained_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let key = b"0123456789abcdef0123456789abcdef".to_vec();
        let opts = AuditOptions {
            checkpoints: Some(Checkpoints {
                key: key.clone(),
                every: 3,
                anchor: None,
            }),
            ..AuditOptions::default()
        };
        let log = AuditLog::open(&p, &opts).expect("open");
        for i in 0..7 {
            log.record(ev(i));
            log.batcher.drain(std::time::Duration::from_secs(2));
        }
        log.close();
        let text = std::fs::read_to_string(&p).expect("read");
        let r = verify_with_key(text.as_bytes(), &key, None).expect("verifies");
        // 7 events, a checkpoint after the 3rd, the 6th (with the first
        // checkpoint counted: after line 3 and line 7) and at close.
        assert_eq!(r.checkpoints, 3, "{text}");
        assert_eq!(r.signed_through, r.chain.entries);

        // Someone without the key edits a line and re-chains every line
        // after it: the chain verifies, the checkpoints do not.
        let mut prev = GENESIS.to_owned();
        let mut forged = String::new();
        for (i, l) in text.lines().enumerate() {
            let mut v: Map<String, Value> = serde_json::from_str(l).expect("json");
            for k in ["seq", "prev", "hash"] {
                v.remove(k);
            }
            if v.get("n") == Some(&Value::from(1)) {
                v.insert("n".into(), 100.into());
            }
            // A careful forger also points each checkpoint at the new
            // hashes; only the MAC is then left to catch it.
            if v.contains_key("covers_hash") {
                v.insert("covers_hash".into(), prev.clone().into());
            }
            let (line, hash) = chain_line(
                i as u64 + 1,
                &prev,
                &serde_json::to_string(&v).expect("json"),
            );
            prev = hash;
            forged.push_str(&line);
            forged.push('\n');
        }
        assert!(
            verify(forged.as_bytes()).is_ok(),
            "the bare chain cannot tell"
        );
        match verify_with_key(forged.as_bytes(), &key, None) {
            Err(VerifyError::Broken(b)) => assert!(b.reason.contains("MAC"), "{b}"),
            other => panic!("expected a MAC failure: {other:?}"),
        }
        // Another key.
        assert!(verify_with_key(text.as_bytes(), b"another key", None).is_err());
        // An emptied log has no checkpoint at all.
        let r = verify_with_key(&b""[..], &key, None).expect("empty verifies");
        assert_eq!(r.checkpoints, 0);
    }

    /// Issue 44 (E9): a log cut right after its first of several
    /// checkpoints still verifies on its checkpoints alone; the anchor
    /// kept outside the log catches the cut, and the gateway will not
    /// continue such a log.
    #[test]
    fn the_anchor_catches_a_log_cut_back_to_an_early_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let anchor = dir.path().join("audit.anchor");
        let key = b"0123456789abcdef0123456789abcdef".to_vec();
        let opts = AuditOptions {
            checkpoints: Some(Checkpoints {
                key: key.clone(),
                every: 3,
                anchor: Some(anchor.clone()),
            }),
            ..AuditOptions::default()
        };
        let log = AuditLog::open(&p, &opts).expect("open");
        for i in 0..7 {
            log.record(ev(i));
            log.batcher.drain(std::time::Duration::from_secs(2));
        }
        log.close();
        let text = std::fs::read_to_string(&p).expect("read");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&anchor)
            .expect("anchor")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let a = Anchor::read(&anchor).expect("read").expect("an anchor");
        let r = verify_with_key(text.as_bytes(), &key, Some(&a)).expect("verifies");
        assert_eq!(r.anchored, Some(r.chain.entries), "{text}");
        // Cut after the first checkpoint (line 4).
        let cut: String = text.lines().take(4).map(|l| format!("{l}\n")).collect();
        let r = verify_with_key(cut.as_bytes(), &key, None).expect("alone it verifies");
        assert_eq!((r.checkpoints, r.signed_through), (1, 4));
        match verify_with_key(cut.as_bytes(), &key, Some(&a)) {
            Err(VerifyError::Broken(b)) => {
                assert!(b.reason.contains("lines were cut off"), "{b}")
            }
            other => panic!("expected the cut to be found: {other:?}"),
        }
        // An anchor made without the key.
        let mut forged = a.clone();
        forged.mac = "00".repeat(32);
        assert!(verify_with_key(text.as_bytes(), &key, Some(&forged)).is_err());
        // The gateway refuses to continue the cut log (its next
        // checkpoint would replace the anchor).
        std::fs::write(&p, &cut).expect("cut");
        let e = AuditLog::open(&p, &opts).expect_err("cut log refused");
        assert!(e.to_string().contains("audit log"), "{e}");
        let shown = format!("{e:?}");
        assert!(shown.contains("lines were cut off"), "{shown}");
    }

    #[tokio::test]
    async fn a_synced_record_is_on_disk_when_its_answer_comes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("audit.jsonl");
        let opts = AuditOptions {
            sync: true,
            ..AuditOptions::default()
        };
        let log = AuditLog::open(&p, &opts).expect("open");
        assert!(log.syncs());
        for i in 0..20 {
            // Long after the 20 ms batching would have written it.
            log.record(ev(1000 + i));
            assert!(log.record_synced(ev(i)).await.expect("answer"), "synced");
            let text = std::fs::read_to_string(&p).expect("read");
            assert!(
                text.contains(&format!("\"n\":{i}}}")) || text.contains(&format!("\"n\":{i},")),
                "line {i} is in the file when its answer comes"
            );
        }
        log.close();
        assert!(!log.record_synced(ev(99)).await.unwrap_or(false), "closed");
    }
}
