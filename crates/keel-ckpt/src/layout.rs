//! Where everything lives under `<url>/<run>/` (docs/ckpt.md has the whole
//! protocol). Steps and generations are zero-padded to 20 digits (any
//! `u64`) and epochs to 10, so listing order is numeric order.

use crate::CkptError;

/// The manifest (commit record) of a checkpoint, relative to the run.
pub fn manifest_key(step: u64, epoch: u64) -> String {
    format!("{}/manifest.json", ckpt_dir(step, epoch))
}

/// The directory of one checkpoint (a step as written by one writer epoch).
pub fn ckpt_dir(step: u64, epoch: u64) -> String {
    format!("ckpt/{step:020}/e{epoch:010}")
}

/// Where one push attempt puts its data files.
pub fn data_prefix(step: u64, epoch: u64, attempt: &str) -> String {
    format!("{}/data/{attempt}", ckpt_dir(step, epoch))
}

pub fn writer_key(epoch: u64) -> String {
    format!("writers/{epoch:010}.json")
}

pub fn generation_key(generation: u64) -> String {
    format!("latest/{generation:020}.json")
}

pub fn pin_key(step: u64, epoch: u64) -> String {
    format!("pins/{step:020}-e{epoch:010}.json")
}

/// The record of a removed pin, unique per removal.
pub fn unpin_key(step: u64, epoch: u64, time: i64, nonce: u64) -> String {
    format!("unpins/{step:020}-e{epoch:010}-{time}-{nonce:016x}.json")
}

/// Parses `ckpt/<step>/e<epoch>/manifest.json`.
pub fn parse_manifest_key(key: &str) -> Option<(u64, u64)> {
    let rest = key.strip_prefix("ckpt/")?;
    let mut it = rest.split('/');
    let step = it.next()?;
    let epoch = it.next()?.strip_prefix('e')?;
    (it.next()? == "manifest.json" && it.next().is_none()).then_some(())?;
    Some((parse_padded(step, 20)?, parse_padded(epoch, 10)?))
}

/// Parses `ckpt/<step>/e<epoch>/data/<attempt>/...` into step, epoch and
/// attempt.
pub fn parse_data_key(key: &str) -> Option<(u64, u64, &str)> {
    let rest = key.strip_prefix("ckpt/")?;
    let mut it = rest.splitn(5, '/');
    let step = parse_padded(it.next()?, 20)?;
    let epoch = parse_padded(it.next()?.strip_prefix('e')?, 10)?;
    (it.next()? == "data").then_some(())?;
    let attempt = it.next()?;
    it.next()?;
    Some((step, epoch, attempt))
}

/// `latest/<generation>.json` or `writers/<epoch>.json` -> the number.
pub fn parse_numbered(key: &str, dir: &str, width: usize) -> Option<u64> {
    let name = key.strip_prefix(dir)?.strip_prefix('/')?;
    parse_padded(name.strip_suffix(".json")?, width)
}

fn parse_padded(s: &str, width: usize) -> Option<u64> {
    (s.len() == width && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// Run names: 1-128 of `A-Z a-z 0-9 . _ -`, not starting with `.`.
pub fn check_run(run: &str) -> Result<(), CkptError> {
    let ok = !run.is_empty()
        && run.len() <= 128
        && !run.starts_with('.')
        && run
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(CkptError::BadRun {
            run: run.to_owned(),
            reason: "use 1-128 letters, digits, `.`, `_` and `-`, not starting with `.`".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_numerically_and_parse_back() {
        let a = manifest_key(9, 1);
        let b = manifest_key(10, 1);
        assert!(a < b, "{a} {b}");
        assert_eq!(a, "ckpt/00000000000000000009/e0000000001/manifest.json");
        assert_eq!(parse_manifest_key(&a), Some((9, 1)));
        assert_eq!(
            parse_manifest_key(&manifest_key(u64::MAX, 7)),
            Some((u64::MAX, 7))
        );
        assert_eq!(parse_manifest_key("ckpt/9/e1/manifest.json"), None);
        let d = format!("{}/x/y.bin", data_prefix(5, 2, "a1"));
        assert_eq!(parse_data_key(&d), Some((5, 2, "a1")));
        assert_eq!(parse_data_key(&manifest_key(5, 2)), None);
        assert_eq!(parse_numbered(&generation_key(12), "latest", 20), Some(12));
        assert_eq!(parse_numbered(&writer_key(3), "writers", 10), Some(3));
        assert!(generation_key(9) < generation_key(10));
    }

    #[test]
    fn run_names() {
        for ok in ["llama-70b", "run_1.2", "A"] {
            assert!(check_run(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "a/b", "a b", "x?y", &"x".repeat(129)] {
            assert!(check_run(bad).is_err(), "{bad}");
        }
    }
}
