//! Where the CUDA libraries are. Pure apart from listing directories and
//! asking whether files exist: the environment arrives as a [`SearchEnv`]
//! (the binary builds it from the process environment and the config).
//!
//! Directories are searched in this order, each once:
//!
//! 1. the explicit directory (`KEEL_CUDA_LIB_DIR`, config `bench.cuda_lib_dir`);
//! 2. `LD_LIBRARY_PATH`, in order;
//! 3. Python installs' `site-packages/nvidia/*/lib` (where PyTorch's and
//!    CuPy's wheels put cuBLAS and NCCL): `$VIRTUAL_ENV`, `$CONDA_PREFIX`,
//!    the install of each `python3` on `PATH` (`DIR/../lib`: a virtual
//!    environment or conda prefix that is on `PATH` but not activated),
//!    `~/.local/lib/python3*`, `/usr/local/lib/python3*`,
//!    `/usr/lib/python3*` (both `site-packages` and `dist-packages`,
//!    newest Python first);
//! 4. `/usr/local/cuda/lib64`, then `/usr/local/cuda-*/lib64`, newest first.
//!
//! Then the dynamic loader's own path (`ld.so.cache`: distribution packages
//! such as `libnccl2`). The CUDA driver (`libcuda.so.1`) belongs to the
//! NVIDIA driver install and is only taken from the loader's path or the
//! explicit directory: `/usr/local/cuda` holds a stub `libcuda.so` that
//! must never be loaded.

use std::cmp::Ordering;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// What the library search may look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchEnv {
    /// Explicit directory searched first (`KEEL_CUDA_LIB_DIR`).
    pub lib_dir: Option<PathBuf>,
    /// `LD_LIBRARY_PATH` as set.
    pub ld_library_path: Option<OsString>,
    /// `VIRTUAL_ENV`.
    pub virtual_env: Option<PathBuf>,
    /// `CONDA_PREFIX`.
    pub conda_prefix: Option<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
    /// `PATH`: the install a `python3` found there belongs to is searched
    /// like an activated environment.
    pub path: Option<OsString>,
    /// The file system root for the system-wide places (`/usr/lib`,
    /// `/usr/local`): `/` on a real machine, a directory in tests.
    pub system_root: PathBuf,
}

impl Default for SearchEnv {
    fn default() -> Self {
        Self {
            lib_dir: None,
            ld_library_path: None,
            virtual_env: None,
            conda_prefix: None,
            home: None,
            path: None,
            system_root: PathBuf::from("/"),
        }
    }
}

impl SearchEnv {
    /// Reads the variables through `get` (the binary passes the process
    /// environment); `lib_dir` overrides `KEEL_CUDA_LIB_DIR` when given.
    pub fn from_env(get: &dyn Fn(&str) -> Option<OsString>, lib_dir: Option<PathBuf>) -> Self {
        let path = |k: &str| get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self {
            lib_dir: lib_dir.or_else(|| path("KEEL_CUDA_LIB_DIR")),
            ld_library_path: get("LD_LIBRARY_PATH").filter(|v| !v.is_empty()),
            virtual_env: path("VIRTUAL_ENV"),
            conda_prefix: path("CONDA_PREFIX"),
            home: path("HOME"),
            path: get("PATH").filter(|v| !v.is_empty()),
            system_root: PathBuf::from("/"),
        }
    }

    fn sys(&self, rel: &str) -> PathBuf {
        self.system_root.join(rel)
    }
}

/// The directories searched, in order, existing ones only, each once.
pub fn search_dirs(env: &SearchEnv) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = &env.lib_dir {
        dirs.push(d.clone());
    }
    if let Some(p) = &env.ld_library_path {
        dirs.extend(std::env::split_paths(p).filter(|d| !d.as_os_str().is_empty()));
    }
    let mut pythons: Vec<PathBuf> = Vec::new();
    if let Some(v) = &env.virtual_env {
        pythons.push(v.join("lib"));
    }
    if let Some(c) = &env.conda_prefix {
        pythons.push(c.join("lib"));
    }
    if let Some(p) = &env.path {
        for bin in std::env::split_paths(p) {
            // `.../venv/bin/python3` -> `.../venv/lib`; relative PATH
            // entries are skipped (they depend on the current directory).
            if bin.is_absolute() && bin.join("python3").is_file() {
                if let Some(prefix) = bin.parent() {
                    pythons.push(prefix.join("lib"));
                }
            }
        }
    }
    if let Some(h) = &env.home {
        pythons.push(h.join(".local/lib"));
    }
    pythons.push(env.sys("usr/local/lib"));
    pythons.push(env.sys("usr/lib"));
    for lib in pythons {
        for py in subdirs_newest_first(&lib, "python3") {
            for packages in ["site-packages", "dist-packages"] {
                let nvidia = py.join(packages).join("nvidia");
                let mut found: Vec<PathBuf> = sorted_subdirs(&nvidia)
                    .into_iter()
                    .map(|d| d.join("lib"))
                    .collect();
                found.retain(|d| d.is_dir());
                dirs.extend(found);
            }
        }
    }
    dirs.push(env.sys("usr/local/cuda/lib64"));
    dirs.extend(
        subdirs_newest_first(&env.sys("usr/local"), "cuda-")
            .into_iter()
            .map(|d| d.join("lib64")),
    );
    let mut seen = Vec::new();
    dirs.retain(|d| {
        if !d.is_dir() || seen.contains(d) {
            return false;
        }
        seen.push(d.clone());
        true
    });
    dirs
}

/// Subdirectories of `dir` whose name starts with `prefix`, highest version
/// first (`python3.12` before `python3.9`, `cuda-12.4` before `cuda-11.8`).
fn subdirs_newest_first(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found: Vec<(Vec<u32>, PathBuf)> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let rest = name.strip_prefix(prefix)?;
                let version = version_key(rest);
                e.path().is_dir().then(|| (version, e.path()))
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    found.sort_by(|a, b| match b.0.cmp(&a.0) {
        Ordering::Equal => a.1.cmp(&b.1),
        o => o,
    });
    found.into_iter().map(|(_, p)| p).collect()
}

fn sorted_subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect(),
        Err(_) => Vec::new(),
    };
    found.sort();
    found
}

/// `"12.4"` -> `[12, 4]`, `".11"` -> `[11]`; non-numbers sort lowest.
fn version_key(s: &str) -> Vec<u32> {
    s.split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Where a library will be loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// This file.
    Path(PathBuf),
    /// This name, through the dynamic loader's own search path.
    Loader(String),
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Path(p) => write!(f, "{}", p.display()),
            Found::Loader(n) => write!(f, "{n} (dynamic loader path)"),
        }
    }
}

/// The first of `names` in the first directory that has one of them, then
/// the names themselves for the dynamic loader, in order.
pub fn candidates(dirs: &[PathBuf], names: &[&str]) -> Vec<Found> {
    let mut out: Vec<Found> = dirs
        .iter()
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .filter(|p| p.is_file())
        .map(Found::Path)
        .collect();
    out.extend(names.iter().map(|n| Found::Loader((*n).to_owned())));
    out
}

/// cuBLAS and cuBLASLt from one directory and one major version, the
/// newest major the driver supports first; then loader names.
pub fn cublas_candidates(dirs: &[PathBuf], driver_version: i32) -> Vec<(Found, Found)> {
    let majors: Vec<i32> = [13, 12, 11]
        .into_iter()
        .filter(|m| driver_version >= m * 1000)
        .collect();
    let mut out = Vec::new();
    for d in dirs {
        for m in &majors {
            let lt = d.join(format!("libcublasLt.so.{m}"));
            let blas = d.join(format!("libcublas.so.{m}"));
            if lt.is_file() && blas.is_file() {
                out.push((Found::Path(lt), Found::Path(blas)));
            }
        }
    }
    for m in &majors {
        out.push((
            Found::Loader(format!("libcublasLt.so.{m}")),
            Found::Loader(format!("libcublas.so.{m}")),
        ));
    }
    out
}

/// NCCL's file names: the runtime name every package ships, then the
/// development symlink.
pub const NCCL_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// The driver in the explicit directory, if it has one.
pub fn driver_in_lib_dir(env: &SearchEnv) -> Option<PathBuf> {
    let d = env.lib_dir.as_ref()?;
    ["libcuda.so.1", "libcuda.so"]
        .iter()
        .map(|n| d.join(n))
        .find(|p| p.is_file())
}

/// The directories searched, for error messages.
pub fn describe_dirs(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "no directory (none of the usual places exists)".into();
    }
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, b"").expect("write");
    }

    #[test]
    fn search_order_and_python_globs() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        let venv = root.join("venv");
        let home = root.join("home");
        for p in [
            "explicit/libnccl.so.2",
            "ld1/x",
            "venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
            "venv/lib/python3.11/site-packages/nvidia/cublas/lib/libcublas.so.12",
            "venv/lib/python3.11/site-packages/nvidia/cublas/include/x",
            "home/.local/lib/python3.10/site-packages/nvidia/cu13/lib/libcublas.so.13",
            // PyTorch's environment, on PATH but not activated.
            "opt/torch/.venv/bin/python3",
            "opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcublas.so.13",
            "opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
            // A PATH entry without python3 adds nothing.
            "opt/tools/bin/x",
            "opt/tools/lib/python3.12/site-packages/nvidia/nccl/lib/x",
            "usr/local/lib/python3.9/dist-packages/nvidia/nccl/lib/x",
            "usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/x",
            "usr/lib/python3/dist-packages/nvidia/cublas/lib/x",
            "usr/local/cuda/lib64/x",
            "usr/local/cuda-11.8/lib64/x",
            "usr/local/cuda-12.4/lib64/x",
            "usr/local/cuda-12.10/lib64/x",
        ] {
            touch(&root.join(p));
        }
        let env = SearchEnv {
            lib_dir: Some(root.join("explicit")),
            ld_library_path: Some(
                format!(
                    "{}::{}:{}",
                    root.join("ld1").display(),
                    root.join("missing").display(),
                    root.join("explicit").display()
                )
                .into(),
            ),
            virtual_env: Some(venv),
            conda_prefix: None,
            home: Some(home),
            path: Some(
                format!(
                    "relative/bin:{}:{}",
                    root.join("opt/tools/bin").display(),
                    root.join("opt/torch/.venv/bin").display(),
                )
                .into(),
            ),
            system_root: root.to_path_buf(),
        };
        let dirs: Vec<String> = search_dirs(&env)
            .iter()
            .map(|d| {
                d.strip_prefix(root)
                    .expect("under root")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(
            dirs,
            [
                "explicit",
                "ld1",
                "venv/lib/python3.11/site-packages/nvidia/cublas/lib",
                "venv/lib/python3.11/site-packages/nvidia/nccl/lib",
                "opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib",
                "opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib",
                "home/.local/lib/python3.10/site-packages/nvidia/cu13/lib",
                "usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib",
                "usr/local/lib/python3.9/dist-packages/nvidia/nccl/lib",
                "usr/lib/python3/dist-packages/nvidia/cublas/lib",
                "usr/local/cuda/lib64",
                "usr/local/cuda-12.10/lib64",
                "usr/local/cuda-12.4/lib64",
                "usr/local/cuda-11.8/lib64",
            ]
        );
    }

    #[test]
    fn from_env_reads_only_what_it_is_given() {
        let env = SearchEnv::from_env(
            &|k| match k {
                "KEEL_CUDA_LIB_DIR" => Some("/opt/cuda-libs".into()),
                "LD_LIBRARY_PATH" => Some("".into()),
                "HOME" => Some("/home/u".into()),
                "PATH" => Some("/opt/torch/.venv/bin:/usr/bin".into()),
                _ => None,
            },
            None,
        );
        assert_eq!(env.lib_dir.as_deref(), Some(Path::new("/opt/cuda-libs")));
        assert_eq!(env.ld_library_path, None);
        assert_eq!(env.home.as_deref(), Some(Path::new("/home/u")));
        assert_eq!(
            env.path.as_deref(),
            Some(std::ffi::OsStr::new("/opt/torch/.venv/bin:/usr/bin"))
        );
        let flag = SearchEnv::from_env(&|_| Some("/x".into()), Some("/flag".into()));
        assert_eq!(flag.lib_dir.as_deref(), Some(Path::new("/flag")));
    }

    #[test]
    fn cublas_pairs_follow_the_driver() {
        let t = tempfile::tempdir().expect("tempdir");
        let a = t.path().join("a");
        let b = t.path().join("b");
        for p in [
            "a/libcublas.so.13",
            "a/libcublasLt.so.13",
            "a/libcublas.so.12",
            "b/libcublas.so.12",
            "b/libcublasLt.so.12",
        ] {
            touch(&t.path().join(p));
        }
        let dirs = vec![a.clone(), b.clone()];
        let on_13 = cublas_candidates(&dirs, 13000);
        assert_eq!(
            on_13[0],
            (
                Found::Path(a.join("libcublasLt.so.13")),
                Found::Path(a.join("libcublas.so.13"))
            )
        );
        // a has no libcublasLt.so.12: the 12 pair comes from b.
        assert_eq!(on_13[1].1, Found::Path(b.join("libcublas.so.12")));
        let on_12 = cublas_candidates(&dirs, 12040);
        assert_eq!(on_12[0].1, Found::Path(b.join("libcublas.so.12")));
        assert_eq!(
            on_12[1..],
            [
                (
                    Found::Loader("libcublasLt.so.12".into()),
                    Found::Loader("libcublas.so.12".into())
                ),
                (
                    Found::Loader("libcublasLt.so.11".into()),
                    Found::Loader("libcublas.so.11".into())
                )
            ]
        );
    }

    #[test]
    fn nccl_candidates_then_loader_names() {
        let t = tempfile::tempdir().expect("tempdir");
        touch(&t.path().join("libnccl.so.2"));
        let c = candidates(&[t.path().to_path_buf()], NCCL_NAMES);
        assert_eq!(
            c,
            [
                Found::Path(t.path().join("libnccl.so.2")),
                Found::Loader("libnccl.so.2".into()),
                Found::Loader("libnccl.so".into())
            ]
        );
    }
}
