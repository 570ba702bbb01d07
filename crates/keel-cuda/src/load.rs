//! Opening shared libraries and looking up functions, with errors instead of
//! panics.
//!
//! cudarc's own loaders try a fixed list of names through the dynamic
//! loader's search path and panic when none loads or a symbol is missing.
//! That list has no `libnccl.so.2` (the only name NCCL's packages and
//! wheels install) and no `libcublas.so.13` with CUDA 12 bindings, and the
//! loader's path does not include Python's `nvidia/*/lib` folders. So
//! keel-cuda opens cuBLAS, cuBLASLt and NCCL itself, from the exact files
//! [`crate::locate`] found, and resolves every function it will call up
//! front: a missing one is [`CudaError::MissingSymbol`] before any call.

use std::path::Path;

use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_NOW};
use libloading::Library;

use crate::locate::Found;
use crate::CudaError;

/// An open library and where it came from.
#[derive(Debug)]
pub(crate) struct Opened {
    pub lib: Library,
    pub path: String,
}

/// Opens `found` with `RTLD_NOW | RTLD_GLOBAL`: every dependency resolved
/// now (a broken install fails here, not mid-benchmark), and its symbols
/// visible to libraries opened after it (cuBLAS finds the cuBLASLt opened
/// before it by its soname).
pub(crate) fn open(found: &Found) -> Result<Opened, String> {
    let (target, path): (&std::ffi::OsStr, String) = match found {
        Found::Path(p) => (p.as_os_str(), p.display().to_string()),
        Found::Loader(n) => (n.as_ref(), n.clone()),
    };
    // SAFETY: loading a library runs its initialisers. The files opened
    // here are the CUDA libraries keel looked for by name (cuBLAS,
    // cuBLASLt, NCCL); their initialisers only set up their own state.
    let lib = unsafe { UnixLibrary::open(Some(target), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
        // libloading's message is "dlopen failed"; the loader's own text
        // (file, reason) is its source.
        match std::error::Error::source(&e) {
            Some(s) => s.to_string(),
            None => format!("{path}: {e}"),
        }
    })?;
    Ok(Opened {
        lib: Library::from(lib),
        path,
    })
}

/// Opens the first candidate that loads; the error lists every failure.
pub(crate) fn open_first(library: &'static str, found: &[Found]) -> Result<Opened, CudaError> {
    let mut tried = Vec::new();
    for f in found {
        match open(f) {
            Ok(o) => return Ok(o),
            Err(e) => tried.push(match f {
                Found::Path(_) => e,
                // The loader's "cannot open shared object file" for a bare
                // name just means "not installed there".
                Found::Loader(n) => format!("{n}: not on the dynamic loader's path"),
            }),
        }
    }
    Err(CudaError::Unavailable {
        library,
        reason: tried.join("; "),
    })
}

/// Looks up `symbol` in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the `extern "C"` function pointer type matching the C
/// declaration of `symbol` in the library's header.
pub(crate) unsafe fn function<F: Copy>(
    library: &'static str,
    opened: &Opened,
    symbol: &'static str,
) -> Result<F, CudaError> {
    // SAFETY: the caller guarantees F matches the symbol's C type; the
    // pointer is copied out and stays valid while `opened.lib` is alive,
    // which every table guarantees by owning it.
    unsafe { opened.lib.get::<F>(symbol.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| CudaError::MissingSymbol {
            library,
            path: opened.path.clone(),
            symbol,
        })
}

/// Makes a library's symbols globally visible for the rest of the process
/// (used for the driver in an explicit directory, so that cudarc's loader,
/// which asks for `libcuda.so.1` by name, gets this file).
pub(crate) fn preload_forever(path: &Path) -> Result<(), String> {
    let o = open(&Found::Path(path.to_path_buf()))?;
    // Never unloaded: cudarc keeps its own handle for the process lifetime
    // and this one must outlive the first cudarc call.
    std::mem::forget(o.lib);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_files_and_symbols_are_errors() {
        let t = tempfile::tempdir().expect("tempdir");
        let not_elf = t.path().join("libnccl.so.2");
        std::fs::write(&not_elf, b"not a library").expect("write");
        let err = open_first(
            "NCCL",
            &[
                Found::Path(not_elf.clone()),
                Found::Loader("libkeel-does-not-exist.so.7".into()),
            ],
        )
        .expect_err("nothing loads");
        let msg = err.to_string();
        assert!(err.is_unavailable(), "{msg}");
        assert!(msg.starts_with("NCCL is unavailable: "), "{msg}");
        assert!(msg.contains(&not_elf.display().to_string()), "{msg}");
        assert!(
            msg.contains("libkeel-does-not-exist.so.7: not on the dynamic loader's path"),
            "{msg}"
        );

        // A real library that is not NCCL: every symbol lookup fails cleanly.
        let libm = open_first("NCCL", &[Found::Loader("libm.so.6".into())]).expect("libm loads");
        type F = unsafe extern "C" fn(*mut i32) -> i32;
        // SAFETY: the lookup fails; nothing is called.
        let err = unsafe { function::<F>("NCCL", &libm, "ncclGetVersion") }
            .expect_err("libm has no NCCL");
        assert_eq!(
            err.to_string(),
            "NCCL at libm.so.6 lacks the function ncclGetVersion: it is too old or not NCCL"
        );
    }
}
