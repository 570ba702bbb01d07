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

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, BufWriter, Write};
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

/// A running audit log.
#[derive(Debug)]
pub struct AuditLog {
    batcher: Batcher<Box<dyn Event>>,
    path: PathBuf,
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
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct ChainBroken {
    pub line: u64,
    pub reason: String,
}

/// Checks every line's hash and its link to the line before.
pub fn verify(r: impl BufRead) -> Result<VerifyReport, ChainBroken> {
    let mut prev = GENESIS.to_owned();
    let mut n = 0u64;
    for line in r.lines() {
        n += 1;
        let broken = |reason: String| ChainBroken { line: n, reason };
        let line = line.map_err(|e| broken(format!("cannot read: {e}")))?;
        let (seq, p, hash) = check_line(&line).map_err(broken)?;
        if seq != n {
            return Err(broken(format!(
                "sequence number {seq}, expected {n}: lines missing or reordered"
            )));
        }
        if p != prev {
            return Err(broken(
                "does not follow the line before it (prev hash differs)".into(),
            ));
        }
        prev = hash;
    }
    Ok(VerifyReport {
        entries: n,
        last_hash: prev,
    })
}

/// One line's own integrity: `(seq, prev, hash)`.
fn check_line(line: &str) -> Result<(u64, String, String), String> {
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

impl AuditLog {
    /// Opens (or creates) the log, continuing the chain of what is there.
    /// A log whose last line is not a valid audit line is refused.
    pub fn open(path: &Path) -> Result<Self, GatewayError> {
        let (mut seq, mut prev) = (0u64, GENESIS.to_owned());
        match std::fs::File::open(path) {
            Ok(f) => {
                let mut last = None;
                for line in BufReader::new(f).lines() {
                    let line = line.map_err(|source| GatewayError::Read {
                        path: path.to_owned(),
                        source,
                    })?;
                    if !line.is_empty() {
                        last = Some(line);
                    }
                }
                if let Some(l) = last {
                    let (s, _, h) = check_line(&l).map_err(|reason| GatewayError::Malformed {
                        what: "audit log",
                        path: path.to_owned(),
                        reason: format!("last line: {reason}"),
                    })?;
                    (seq, prev) = (s, h);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(GatewayError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        }
        let werr = |source| GatewayError::Write {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(werr)?;
        let mut w = BufWriter::with_capacity(64 << 10, file);
        let mut text = Vec::with_capacity(1024);
        let mut failed: Option<std::io::Error> = None;
        let shown = path.to_owned();
        let batcher = Batcher::spawn("keel-audit", move |batch: Vec<Box<dyn Event>>, last| {
            for ev in batch {
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
                if let Err(e) = w
                    .write_all(line.as_bytes())
                    .and_then(|()| w.write_all(b"\n"))
                {
                    failed.get_or_insert(e);
                }
            }
            if let Err(e) = w.flush() {
                failed.get_or_insert(e);
            }
            if last {
                if let Err(e) = w.get_ref().sync_all() {
                    failed.get_or_insert(e);
                }
            }
            // A write that failed (a full disk, say) is reported once per
            // batch: the lines are lost and `audit verify` will find the
            // chain broken there.
            if let Some(e) = failed.take() {
                tracing::error!(path = %shown.display(), error = %e, "audit log write failed; lines were lost");
            }
        })
        .map_err(werr)?;
        Ok(Self {
            batcher,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues an event (a JSON object once serialised by the writer
    /// thread; `ts` should be in it, `seq` and `prev` must not).
    pub fn record(&self, event: impl Event) {
        if self.batcher.push(Box::new(event)).is_err() {
            tracing::error!(path = %self.path.display(), "audit log already closed; an event was not recorded");
        }
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
        let log = AuditLog::open(&p).expect("open");
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
            let log = AuditLog::open(&p).expect("open");
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
        assert_eq!(verify(edited.as_bytes()).expect_err("edited").line, 4);
        let dropped: String = lines
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        assert_eq!(verify(dropped.as_bytes()).expect_err("dropped").line, 3);
        let truncated: String = lines[..9].iter().map(|l| format!("{l}\n")).collect();
        assert!(
            verify(truncated.as_bytes()).is_ok(),
            "a cut tail is only detectable against a kept last hash"
        );
        let garbage = format!("{text}not json\n");
        assert_eq!(verify(garbage.as_bytes()).expect_err("garbage").line, 11);
    }
}
