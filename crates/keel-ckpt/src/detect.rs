//! Reading a checkpoint directory as the framework wrote it: which
//! framework it was, which files it holds, and (for `watch`) which
//! checkpoints under a training job's output directory are complete.
//!
//! Completion rules, one per framework (../shared reference facts):
//! - PyTorch DCP (and torchtitan `step-<N>/`): the directory holds
//!   `.metadata`, which DCP writes last.
//! - Megatron-LM: `latest_checkpointed_iteration.txt` names iteration N;
//!   `iter_<N:07>/` and every older `iter_*` are complete.
//! - DeepSpeed: `latest` names a tag `global_step<N>`; that tag's directory
//!   and every older `global_step*` are complete.
//! - A marker the user names (`--marker COMPLETE`): a directory holding a
//!   file of that name is complete.
//!
//! A step number is the trailing digits of the directory name (`step-100`,
//! `iter_0000100`, `global_step100`, `checkpoint-100`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::CkptError;

/// What wrote a checkpoint, as far as its files tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Framework {
    PytorchDcp,
    Megatron,
    Deepspeed,
    Safetensors,
    Unknown,
}

impl Framework {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PytorchDcp => "pytorch-dcp",
            Self::Megatron => "megatron",
            Self::Deepspeed => "deepspeed",
            Self::Safetensors => "safetensors",
            Self::Unknown => "unknown",
        }
    }
}

/// A file of a checkpoint: its path and its name relative to the
/// checkpoint directory (`/`-separated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    pub path: PathBuf,
    pub name: String,
    pub size: u64,
}

/// Every regular file under `dir` (following symlinks to files, refusing
/// symlinks to directories), sorted by name.
pub fn list_files(dir: &Path) -> Result<Vec<LocalFile>, CkptError> {
    let meta = std::fs::metadata(dir).map_err(|source| CkptError::LocalDir {
        path: dir.to_owned(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(CkptError::NotADirectory {
            path: dir.to_owned(),
        });
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out)?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn walk(dir: &Path, rel: &str, out: &mut Vec<LocalFile>) -> Result<(), CkptError> {
    let read = std::fs::read_dir(dir).map_err(|source| CkptError::LocalDir {
        path: dir.to_owned(),
        source,
    })?;
    for entry in read {
        let entry = entry.map_err(|source| CkptError::LocalDir {
            path: dir.to_owned(),
            source,
        })?;
        let path = entry.path();
        let Some(fname) = entry.file_name().to_str().map(str::to_owned) else {
            return Err(CkptError::BadFileName { path });
        };
        if fname.contains('\\') {
            return Err(CkptError::BadFileName { path });
        }
        let name = if rel.is_empty() {
            fname.clone()
        } else {
            format!("{rel}/{fname}")
        };
        let ft = entry.file_type().map_err(|source| CkptError::LocalDir {
            path: path.clone(),
            source,
        })?;
        if ft.is_dir() {
            walk(&path, &name, out)?;
            continue;
        }
        let meta = std::fs::metadata(&path).map_err(|source| CkptError::LocalDir {
            path: path.clone(),
            source,
        })?;
        if meta.is_dir() {
            return Err(CkptError::SymlinkedDir { path });
        }
        if !meta.is_file() {
            return Err(CkptError::NotAFile { path });
        }
        out.push(LocalFile {
            path,
            name,
            size: meta.len(),
        });
    }
    Ok(())
}

/// Which framework wrote the files (names relative to the checkpoint).
pub fn detect(files: &[LocalFile], dir_name: &str) -> Framework {
    let base = |n: &str| n.rsplit('/').next().unwrap_or(n).to_owned();
    let names: Vec<String> = files.iter().map(|f| base(&f.name)).collect();
    if names.iter().any(|n| n == ".metadata") || names.iter().any(|n| n.ends_with(".distcp")) {
        return Framework::PytorchDcp;
    }
    if names
        .iter()
        .any(|n| n.ends_with("_model_states.pt") || n.ends_with("_optim_states.pt"))
        || dir_name.starts_with("global_step")
    {
        return Framework::Deepspeed;
    }
    if files
        .iter()
        .any(|f| f.name.starts_with("mp_rank_") && f.name.ends_with(".pt"))
        || dir_name.starts_with("iter_")
    {
        return Framework::Megatron;
    }
    if names.iter().any(|n| n.ends_with(".safetensors")) {
        return Framework::Safetensors;
    }
    Framework::Unknown
}

/// The step a directory name carries in its trailing digits.
pub fn step_of(dir_name: &str) -> Option<u64> {
    let digits: String = dir_name
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    if digits.is_empty() || digits.len() > 20 {
        return None;
    }
    digits.parse().ok()
}

/// A complete checkpoint found under a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub dir: PathBuf,
    pub step: u64,
    /// Which rule said it is complete.
    pub rule: &'static str,
}

/// The complete checkpoints directly under `root`, by step (one per step:
/// the first rule that finds it wins).
pub fn completed(root: &Path, marker: Option<&str>) -> Result<Vec<Completed>, CkptError> {
    let read = std::fs::read_dir(root).map_err(|source| CkptError::LocalDir {
        path: root.to_owned(),
        source,
    })?;
    let mut dirs: Vec<(String, PathBuf, u64)> = Vec::new();
    for entry in read {
        let entry = entry.map_err(|source| CkptError::LocalDir {
            path: root.to_owned(),
            source,
        })?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') || !entry.path().is_dir() {
            continue;
        }
        if let Some(step) = step_of(&name) {
            dirs.push((name, entry.path(), step));
        }
    }
    let mut found: BTreeMap<u64, Completed> = BTreeMap::new();
    let mut add = |dir: &PathBuf, step: u64, rule: &'static str| {
        found.entry(step).or_insert_with(|| Completed {
            dir: dir.clone(),
            step,
            rule,
        });
    };
    // Megatron's tracker: iterations up to the one it names.
    if let Some(n) = read_tracker(&root.join("latest_checkpointed_iteration.txt")) {
        for (name, path, step) in &dirs {
            if name.starts_with("iter_") && *step <= n {
                add(path, *step, "megatron tracker");
            }
        }
    }
    // DeepSpeed's `latest`: tags up to the one it names.
    if let Some(tag) = read_text(&root.join("latest")) {
        if let Some(n) = step_of(tag.trim()) {
            for (name, path, step) in &dirs {
                if name.starts_with("global_step") && *step <= n {
                    add(path, *step, "deepspeed latest");
                }
            }
        }
    }
    for (_, path, step) in &dirs {
        if path.join(".metadata").is_file() {
            add(path, *step, "dcp .metadata");
        }
        if let Some(m) = marker {
            if path.join(m).is_file() {
                add(path, *step, "marker");
            }
        }
    }
    Ok(found.into_values().collect())
}

fn read_text(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

fn read_tracker(p: &Path) -> Option<u64> {
    read_text(p)?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(root: &Path, rel: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, rel).expect("write");
    }

    fn detect_dir(files: &[&str], dir_name: &str) -> Framework {
        let d = tempfile::tempdir().expect("tmp");
        for f in files {
            touch(d.path(), f);
        }
        detect(&list_files(d.path()).expect("list"), dir_name)
    }

    #[test]
    fn frameworks() {
        assert_eq!(
            detect_dir(&["__0_0.distcp", "__1_0.distcp", ".metadata"], "step-10"),
            Framework::PytorchDcp
        );
        assert_eq!(
            detect_dir(&["mp_rank_00/model_optim_rng.pt"], "iter_0000100"),
            Framework::Megatron
        );
        assert_eq!(
            detect_dir(&["mp_rank_00_000/model_optim_rng.pt"], "x"),
            Framework::Megatron
        );
        assert_eq!(
            detect_dir(
                &[
                    "mp_rank_00_model_states.pt",
                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"
                ],
                "global_step100"
            ),
            Framework::Deepspeed
        );
        assert_eq!(
            detect_dir(
                &[
                    "model-00001-of-00002.safetensors",
                    "model.safetensors.index.json"
                ],
                "checkpoint-5"
            ),
            Framework::Safetensors
        );
        assert_eq!(detect_dir(&["weights.bin"], "x"), Framework::Unknown);
    }

    #[test]
    fn steps_from_names() {
        assert_eq!(step_of("step-100"), Some(100));
        assert_eq!(step_of("iter_0000100"), Some(100));
        assert_eq!(step_of("global_step7"), Some(7));
        assert_eq!(step_of("checkpoint-5"), Some(5));
        assert_eq!(step_of("final"), None);
    }

    #[test]
    fn completion_rules() {
        let d = tempfile::tempdir().expect("tmp");
        let r = d.path();
        touch(r, "step-10/.metadata");
        touch(r, "step-10/__0_0.distcp");
        touch(r, "step-20/__0_0.distcp"); // still being written
        touch(r, "iter_0000100/mp_rank_00/model_optim_rng.pt");
        touch(r, "iter_0000200/mp_rank_00/model_optim_rng.pt");
        touch(r, "iter_0000300/mp_rank_00/model_optim_rng.pt");
        std::fs::write(r.join("latest_checkpointed_iteration.txt"), "200\n").expect("w");
        touch(r, "global_step5/mp_rank_00_model_states.pt");
        touch(r, "global_step6/mp_rank_00_model_states.pt");
        std::fs::write(r.join("latest"), "global_step5").expect("w");
        touch(r, "ckpt-7/COMPLETE");
        touch(r, "ckpt-8/model.safetensors");
        let steps = |marker| -> Vec<(u64, &'static str)> {
            completed(r, marker)
                .expect("completed")
                .into_iter()
                .map(|c| (c.step, c.rule))
                .collect()
        };
        assert_eq!(
            steps(None),
            [
                (5, "deepspeed latest"),
                (10, "dcp .metadata"),
                (100, "megatron tracker"),
                (200, "megatron tracker")
            ]
        );
        assert!(steps(Some("COMPLETE")).contains(&(7, "marker")));
    }

    #[test]
    fn missing_and_non_directories() {
        let e = list_files(Path::new("/nonexistent/keel")).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/keel"), "{e}");
        let f = tempfile::NamedTempFile::new().expect("tmp");
        let e = list_files(f.path()).expect_err("file");
        assert!(matches!(e, CkptError::NotADirectory { .. }), "{e}");
    }
}
