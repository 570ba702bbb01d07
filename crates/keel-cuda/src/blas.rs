//! Matrix products through cuBLAS (`cublasGemmEx`: bf16, fp16, tf32, fp32,
//! fp64) and cuBLASLt (fp8 e4m3, which `cublasGemmEx` does not do).
//!
//! Every product is `C = A^T B` in column-major storage ("TN"): `a` holds
//! the `k x m` matrix A^T (each of A's rows contiguous), `b` the `k x n`
//! matrix B, and `c` receives the `m x n` result. TN is the layout FP8
//! requires on Hopper and the one tensor cores read fastest; using it for
//! every type keeps one convention for the caller's reference check.
//!
//! The libraries are opened from the files [`crate::locate`] finds (see
//! [`crate::load`] for why not through cudarc's loader); cudarc supplies the
//! types. Return codes are read as plain integers so that a status value
//! newer than the bindings cannot be misread.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::cublas::sys as cb;
use cudarc::cublaslt::sys as lt;

use crate::driver::{Device, DeviceBuffer, Stream};
use crate::load::{self, Opened};
use crate::locate::{self, Found};
use crate::{Cuda, CudaError, Result};

/// The element types of a benchmark product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmType {
    /// bf16 inputs and output, fp32 accumulation.
    Bf16,
    /// fp16 inputs and output, fp32 accumulation.
    Fp16,
    /// fp32 inputs and output computed on tensor cores in TF32.
    Tf32,
    /// fp32 throughout (no TF32).
    Fp32,
    /// fp64 throughout.
    Fp64,
    /// fp8 e4m3 inputs, bf16 output, fp32 accumulation (cuBLASLt).
    Fp8,
}

impl GemmType {
    /// Bytes per element of A and B.
    pub fn input_bytes(self) -> usize {
        match self {
            GemmType::Bf16 | GemmType::Fp16 => 2,
            GemmType::Tf32 | GemmType::Fp32 => 4,
            GemmType::Fp64 => 8,
            GemmType::Fp8 => 1,
        }
    }

    /// Bytes per element of C.
    pub fn output_bytes(self) -> usize {
        match self {
            GemmType::Bf16 | GemmType::Fp16 | GemmType::Fp8 => 2,
            GemmType::Tf32 | GemmType::Fp32 => 4,
            GemmType::Fp64 => 8,
        }
    }
}

type CublasCreate = unsafe extern "C" fn(*mut cb::cublasHandle_t) -> c_int;
type CublasDestroy = unsafe extern "C" fn(cb::cublasHandle_t) -> c_int;
type CublasSetStream = unsafe extern "C" fn(cb::cublasHandle_t, cb::cudaStream_t) -> c_int;
type CublasSetMathMode = unsafe extern "C" fn(cb::cublasHandle_t, cb::cublasMath_t) -> c_int;
type CublasGetVersion = unsafe extern "C" fn(cb::cublasHandle_t, *mut c_int) -> c_int;
type CublasSetWorkspace = unsafe extern "C" fn(cb::cublasHandle_t, *mut c_void, usize) -> c_int;
type CublasGemmEx = unsafe extern "C" fn(
    cb::cublasHandle_t,
    cb::cublasOperation_t,
    cb::cublasOperation_t,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    cb::cudaDataType,
    c_int,
    *const c_void,
    cb::cudaDataType,
    c_int,
    *const c_void,
    *mut c_void,
    cb::cudaDataType,
    c_int,
    cb::cublasComputeType_t,
    cb::cublasGemmAlgo_t,
) -> c_int;

type LtCreate = unsafe extern "C" fn(*mut lt::cublasLtHandle_t) -> c_int;
type LtDestroy = unsafe extern "C" fn(lt::cublasLtHandle_t) -> c_int;
type LtDescCreate = unsafe extern "C" fn(
    *mut lt::cublasLtMatmulDesc_t,
    lt::cublasComputeType_t,
    lt::cudaDataType_t,
) -> c_int;
type LtDescDestroy = unsafe extern "C" fn(lt::cublasLtMatmulDesc_t) -> c_int;
type LtDescSet = unsafe extern "C" fn(
    lt::cublasLtMatmulDesc_t,
    lt::cublasLtMatmulDescAttributes_t,
    *const c_void,
    usize,
) -> c_int;
type LtLayoutCreate = unsafe extern "C" fn(
    *mut lt::cublasLtMatrixLayout_t,
    lt::cudaDataType_t,
    u64,
    u64,
    i64,
) -> c_int;
type LtLayoutDestroy = unsafe extern "C" fn(lt::cublasLtMatrixLayout_t) -> c_int;
type LtPrefCreate = unsafe extern "C" fn(*mut lt::cublasLtMatmulPreference_t) -> c_int;
type LtPrefDestroy = unsafe extern "C" fn(lt::cublasLtMatmulPreference_t) -> c_int;
type LtPrefSet = unsafe extern "C" fn(
    lt::cublasLtMatmulPreference_t,
    lt::cublasLtMatmulPreferenceAttributes_t,
    *const c_void,
    usize,
) -> c_int;
type LtHeuristic = unsafe extern "C" fn(
    lt::cublasLtHandle_t,
    lt::cublasLtMatmulDesc_t,
    lt::cublasLtMatrixLayout_t,
    lt::cublasLtMatrixLayout_t,
    lt::cublasLtMatrixLayout_t,
    lt::cublasLtMatrixLayout_t,
    lt::cublasLtMatmulPreference_t,
    c_int,
    *mut HeuristicResult,
    *mut c_int,
) -> c_int;
type LtMatmul = unsafe extern "C" fn(
    lt::cublasLtHandle_t,
    lt::cublasLtMatmulDesc_t,
    *const c_void,
    *const c_void,
    lt::cublasLtMatrixLayout_t,
    *const c_void,
    lt::cublasLtMatrixLayout_t,
    *const c_void,
    *const c_void,
    lt::cublasLtMatrixLayout_t,
    *mut c_void,
    lt::cublasLtMatrixLayout_t,
    *const lt::cublasLtMatmulAlgo_t,
    *mut c_void,
    usize,
    lt::cudaStream_t,
) -> c_int;

/// `cublasLtMatmulHeuristicResult_t` with its status read as a plain int
/// (cudarc types it as an enum, which a newer library could overflow).
#[repr(C)]
#[derive(Clone, Copy)]
struct HeuristicResult {
    algo: lt::cublasLtMatmulAlgo_t,
    workspace_size: usize,
    state: c_int,
    waves_count: f32,
    reserved: [c_int; 4],
}

const _: () = assert!(
    std::mem::size_of::<HeuristicResult>()
        == std::mem::size_of::<lt::cublasLtMatmulHeuristicResult_t>()
);

/// Workspace offered to cuBLAS and cuBLASLt (what PyTorch gives them on
/// Hopper).
const LT_WORKSPACE: usize = 32 << 20;

struct CublasApi {
    create: CublasCreate,
    destroy: CublasDestroy,
    set_stream: CublasSetStream,
    set_math_mode: CublasSetMathMode,
    get_version: CublasGetVersion,
    /// `cublasSetWorkspace_v2` (cuBLAS 11.2 and later; absent before).
    set_workspace: Option<CublasSetWorkspace>,
    gemm_ex: CublasGemmEx,
    lt_create: LtCreate,
    lt_destroy: LtDestroy,
    desc_create: LtDescCreate,
    desc_destroy: LtDescDestroy,
    desc_set: LtDescSet,
    layout_create: LtLayoutCreate,
    layout_destroy: LtLayoutDestroy,
    pref_create: LtPrefCreate,
    pref_destroy: LtPrefDestroy,
    pref_set: LtPrefSet,
    heuristic: LtHeuristic,
    matmul: LtMatmul,
    // The libraries stay loaded while the function pointers are in use.
    _blas: Opened,
    _lt: Opened,
}

/// cuBLAS and cuBLASLt, loaded.
#[derive(Clone)]
pub struct BlasLibrary {
    api: Arc<CublasApi>,
}

impl std::fmt::Debug for BlasLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlasLibrary")
            .field("cublas", &self.api._blas.path)
            .field("cublaslt", &self.api._lt.path)
            .finish()
    }
}

const CUBLAS: &str = "cuBLAS";
const CUBLASLT: &str = "cuBLASLt";

fn blas_status(call: &'static str, status: c_int) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    let name = match status {
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        16 => "CUBLAS_STATUS_LICENSE_ERROR",
        _ => "unknown status",
    };
    Err(CudaError::Blas { call, status, name })
}

impl BlasLibrary {
    /// Finds and loads cuBLAS and cuBLASLt (one directory, one major
    /// version the driver supports).
    pub fn load(cuda: &Cuda) -> Result<BlasLibrary> {
        let dirs = locate::search_dirs(cuda.search());
        let pairs = locate::cublas_candidates(&dirs, cuda.driver_version());
        let mut failures = Vec::new();
        for (lt_found, blas_found) in &pairs {
            // cuBLASLt first: cuBLAS needs it and finds it by soname.
            let lt_opened = match load::open(lt_found) {
                Ok(o) => o,
                Err(e) => {
                    failures.push(describe_failure(lt_found, e));
                    continue;
                }
            };
            match load::open(blas_found) {
                Ok(b) => return Self::resolve(b, lt_opened),
                Err(e) => failures.push(describe_failure(blas_found, e)),
            }
        }
        Err(CudaError::Unavailable {
            library: "cuBLAS (libcublas.so and libcublasLt.so)",
            reason: format!(
                "{}; searched {}; install the CUDA toolkit's cuBLAS or PyTorch, or set KEEL_CUDA_LIB_DIR",
                failures.join("; "),
                locate::describe_dirs(&dirs)
            ),
        })
    }

    fn resolve(blas: Opened, lt_lib: Opened) -> Result<BlasLibrary> {
        // SAFETY: each type alias above is the exact C signature of the
        // function of that name in cublas_api.h / cublasLt.h (CUDA 11.8 and
        // later, unchanged through 13.x).
        unsafe {
            let api = CublasApi {
                create: load::function(CUBLAS, &blas, "cublasCreate_v2")?,
                destroy: load::function(CUBLAS, &blas, "cublasDestroy_v2")?,
                set_stream: load::function(CUBLAS, &blas, "cublasSetStream_v2")?,
                set_math_mode: load::function(CUBLAS, &blas, "cublasSetMathMode")?,
                get_version: load::function(CUBLAS, &blas, "cublasGetVersion_v2")?,
                set_workspace: load::function(CUBLAS, &blas, "cublasSetWorkspace_v2").ok(),
                gemm_ex: load::function(CUBLAS, &blas, "cublasGemmEx")?,
                lt_create: load::function(CUBLASLT, &lt_lib, "cublasLtCreate")?,
                lt_destroy: load::function(CUBLASLT, &lt_lib, "cublasLtDestroy")?,
                desc_create: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulDescCreate")?,
                desc_destroy: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulDescDestroy")?,
                desc_set: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulDescSetAttribute")?,
                layout_create: load::function(CUBLASLT, &lt_lib, "cublasLtMatrixLayoutCreate")?,
                layout_destroy: load::function(CUBLASLT, &lt_lib, "cublasLtMatrixLayoutDestroy")?,
                pref_create: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulPreferenceCreate")?,
                pref_destroy: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulPreferenceDestroy")?,
                pref_set: load::function(
                    CUBLASLT,
                    &lt_lib,
                    "cublasLtMatmulPreferenceSetAttribute",
                )?,
                heuristic: load::function(CUBLASLT, &lt_lib, "cublasLtMatmulAlgoGetHeuristic")?,
                matmul: load::function(CUBLASLT, &lt_lib, "cublasLtMatmul")?,
                _blas: blas,
                _lt: lt_lib,
            };
            Ok(BlasLibrary { api: Arc::new(api) })
        }
    }

    /// The file cuBLAS was loaded from.
    pub fn path(&self) -> &str {
        &self.api._blas.path
    }

    /// A handle bound to `device` and `stream`.
    pub fn handle(&self, device: &Device, stream: &Stream) -> Result<GemmHandle> {
        device.bind()?;
        let api = &self.api;
        let mut h: cb::cublasHandle_t = std::ptr::null_mut();
        let mut l: lt::cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: the device's context is current; the out-pointers are
        // valid; the handles are destroyed once, in GemmHandle's Drop.
        unsafe {
            blas_status("cublasCreate", (api.create)(&mut h))?;
            let mut handle = GemmHandle {
                api: self.api.clone(),
                blas: h,
                lt: std::ptr::null_mut(),
                device: device.clone(),
                stream: stream.clone(),
                workspace: device.alloc(LT_WORKSPACE)?,
                version: 0,
            };
            blas_status("cublasLtCreate", (api.lt_create)(&mut l))?;
            handle.lt = l;
            blas_status(
                "cublasSetStream",
                (api.set_stream)(h, stream.raw() as cb::cudaStream_t),
            )?;
            // cublasGemmEx gets the same 32 MiB workspace as cuBLASLt (and
            // as PyTorch gives it on Hopper) instead of cuBLAS's default
            // pool, which rules out some kernels. One stream uses it at a
            // time. Set after the stream: cublasSetStream resets it.
            if let Some(set_workspace) = api.set_workspace {
                let ws = handle.workspace.at("cuBLAS workspace", 0, LT_WORKSPACE)?;
                blas_status(
                    "cublasSetWorkspace",
                    set_workspace(h, ws as *mut c_void, LT_WORKSPACE),
                )?;
            }
            // Default math: fp32 stays fp32 unless TF32 is asked for through
            // the compute type.
            blas_status(
                "cublasSetMathMode",
                (api.set_math_mode)(h, cb::cublasMath_t::CUBLAS_DEFAULT_MATH),
            )?;
            let mut v: c_int = 0;
            blas_status("cublasGetVersion", (api.get_version)(h, &mut v))?;
            handle.version = v;
            Ok(handle)
        }
    }
}

fn describe_failure(found: &Found, e: String) -> String {
    match found {
        Found::Path(_) => e,
        Found::Loader(n) => format!("{n}: not on the dynamic loader's path"),
    }
}

/// cuBLAS and cuBLASLt handles on one GPU and stream.
pub struct GemmHandle {
    api: Arc<CublasApi>,
    blas: cb::cublasHandle_t,
    lt: lt::cublasLtHandle_t,
    device: Device,
    stream: Stream,
    workspace: DeviceBuffer,
    version: c_int,
}

impl std::fmt::Debug for GemmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GemmHandle")
            .field("device", &self.device.info().ordinal)
            .field("cublas_version", &self.version)
            .finish()
    }
}

impl Drop for GemmHandle {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created in BlasLibrary::handle, destroyed once here.
        unsafe {
            if !self.lt.is_null() {
                (self.api.lt_destroy)(self.lt);
            }
            if !self.blas.is_null() {
                (self.api.destroy)(self.blas);
            }
        }
    }
}

impl GemmHandle {
    /// cuBLAS's version number, e.g. 120804 for 12.8.4.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Queues `c = a^T b` (see the module docs for the layout) on the
    /// handle's stream.
    pub fn gemm(
        &self,
        t: GemmType,
        (m, n, k): (usize, usize, usize),
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> Result<()> {
        let ai = t.input_bytes();
        let a_ptr = a.at("gemm input A", 0, k * m * ai)?;
        let b_ptr = b.at("gemm input B", 0, k * n * ai)?;
        let c_ptr = c.at("gemm output C", 0, m * n * t.output_bytes())?;
        let dim = |v: usize| {
            c_int::try_from(v).map_err(|_| CudaError::OutOfBounds {
                what: "gemm dimension (cuBLAS takes 32-bit sizes)",
                needed: v,
                len: c_int::MAX as usize,
            })
        };
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        self.device.bind()?;
        use cb::cublasComputeType_t as C;
        use cb::cudaDataType as D;
        let (dtype, compute) = match t {
            GemmType::Bf16 => (D::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
            GemmType::Fp16 => (D::CUDA_R_16F, C::CUBLAS_COMPUTE_32F),
            GemmType::Tf32 => (D::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_FAST_TF32),
            GemmType::Fp32 => (D::CUDA_R_32F, C::CUBLAS_COMPUTE_32F),
            GemmType::Fp64 => (D::CUDA_R_64F, C::CUBLAS_COMPUTE_64F),
            GemmType::Fp8 => {
                let (major, minor) = self.device.info().compute_capability;
                if (major, minor) < (8, 9) {
                    return Err(CudaError::Unsupported {
                        what: "fp8 matrix multiplication".into(),
                        ordinal: self.device.info().ordinal,
                        name: self.device.info().name.clone(),
                        major,
                        minor,
                    });
                }
                return self.gemm_fp8((m, n, k), a_ptr, b_ptr, c_ptr);
            }
        };
        let (one32, zero32) = (1.0f32, 0.0f32);
        let (one64, zero64) = (1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if t == GemmType::Fp64 {
            (&one64 as *const f64 as _, &zero64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &zero32 as *const f32 as _)
        };
        // SAFETY: the handle is live and bound to this stream; the three
        // device ranges were checked against the buffers' sizes for these
        // dimensions and element sizes; alpha/beta point to host scalars of
        // the compute type's scale type, alive for the call (cuBLAS reads
        // host scalars before returning).
        let status = unsafe {
            (self.api.gemm_ex)(
                self.blas,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                alpha,
                a_ptr as *const c_void,
                dtype,
                ki,
                b_ptr as *const c_void,
                dtype,
                ki,
                beta,
                c_ptr as *mut c_void,
                dtype,
                mi,
                compute,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        blas_status("cublasGemmEx", status)
    }

    fn gemm_fp8(
        &self,
        (m, n, k): (usize, usize, usize),
        a: cudarc::driver::sys::CUdeviceptr,
        b: cudarc::driver::sys::CUdeviceptr,
        c: cudarc::driver::sys::CUdeviceptr,
    ) -> Result<()> {
        let api = &self.api;
        let ws = self.workspace.at("cuBLASLt workspace", 0, LT_WORKSPACE)?;
        let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
        let mut layouts: [lt::cublasLtMatrixLayout_t; 3] = [std::ptr::null_mut(); 3];
        let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
        // SAFETY: every descriptor is created before use and destroyed
        // below whatever happens in between; attribute values point to
        // locals of the attribute's documented type and size; the device
        // pointers were range-checked by the caller; the stream is the
        // handle's.
        let result = unsafe {
            (|| -> Result<()> {
                blas_status(
                    "cublasLtMatmulDescCreate",
                    (api.desc_create)(
                        &mut desc,
                        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        lt::cudaDataType_t::CUDA_R_32F,
                    ),
                )?;
                let trans_a: i32 = cb::cublasOperation_t::CUBLAS_OP_T as i32;
                blas_status(
                    "cublasLtMatmulDescSetAttribute(TRANSA)",
                    (api.desc_set)(
                        desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                        &trans_a as *const i32 as *const c_void,
                        std::mem::size_of::<i32>(),
                    ),
                )?;
                // Hopper's fast FP8 accumulation, as peak figures assume.
                let fast: i8 = 1;
                blas_status(
                    "cublasLtMatmulDescSetAttribute(FAST_ACCUM)",
                    (api.desc_set)(
                        desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                        &fast as *const i8 as *const c_void,
                        1,
                    ),
                )?;
                let e4m3 = lt::cudaDataType_t::CUDA_R_8F_E4M3;
                let bf16 = lt::cudaDataType_t::CUDA_R_16BF;
                let shapes = [
                    (e4m3, k as u64, m as u64, k as i64),
                    (e4m3, k as u64, n as u64, k as i64),
                    (bf16, m as u64, n as u64, m as i64),
                ];
                for (l, (ty, rows, cols, ld)) in layouts.iter_mut().zip(shapes) {
                    blas_status(
                        "cublasLtMatrixLayoutCreate",
                        (api.layout_create)(l, ty, rows, cols, ld),
                    )?;
                }
                blas_status(
                    "cublasLtMatmulPreferenceCreate",
                    (api.pref_create)(&mut pref),
                )?;
                let ws_bytes: u64 = LT_WORKSPACE as u64;
                blas_status(
                    "cublasLtMatmulPreferenceSetAttribute",
                    (api.pref_set)(
                        pref,
                        lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &ws_bytes as *const u64 as *const c_void,
                        std::mem::size_of::<u64>(),
                    ),
                )?;
                let mut found: c_int = 0;
                let mut heuristic = std::mem::MaybeUninit::<HeuristicResult>::zeroed();
                blas_status(
                    "cublasLtMatmulAlgoGetHeuristic",
                    (api.heuristic)(
                        self.lt,
                        desc,
                        layouts[0],
                        layouts[1],
                        layouts[2],
                        layouts[2],
                        pref,
                        1,
                        heuristic.as_mut_ptr(),
                        &mut found,
                    ),
                )?;
                if found < 1 {
                    return Err(CudaError::Blas {
                        call: "cublasLtMatmulAlgoGetHeuristic",
                        status: 15,
                        name: "no fp8 algorithm for this shape",
                    });
                }
                // All-zero is a valid value of every field, so this is
                // initialised whether or not cuBLASLt wrote it.
                let heuristic = heuristic.assume_init();
                let (one, zero) = (1.0f32, 0.0f32);
                blas_status(
                    "cublasLtMatmul",
                    (api.matmul)(
                        self.lt,
                        desc,
                        &one as *const f32 as *const c_void,
                        a as *const c_void,
                        layouts[0],
                        b as *const c_void,
                        layouts[1],
                        &zero as *const f32 as *const c_void,
                        c as *const c_void,
                        layouts[2],
                        c as *mut c_void,
                        layouts[2],
                        &heuristic.algo,
                        ws as *mut c_void,
                        LT_WORKSPACE,
                        self.stream.raw() as lt::cudaStream_t,
                    ),
                )
            })()
        };
        // SAFETY: destroys what was created above, once each.
        unsafe {
            if !pref.is_null() {
                (api.pref_destroy)(pref);
            }
            for l in layouts {
                if !l.is_null() {
                    (api.layout_destroy)(l);
                }
            }
            if !desc.is_null() {
                (api.desc_destroy)(desc);
            }
        }
        result
    }
}
