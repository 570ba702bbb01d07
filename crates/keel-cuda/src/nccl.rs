//! NCCL: unique ids, communicators (one process driving several GPUs, or
//! one rank per process) and the collectives nccl-tests measures.
//!
//! `libnccl.so.2` is opened from the file [`crate::locate`] finds (cudarc's
//! loader never asks for that name); cudarc supplies the types. Calls are
//! asynchronous on the given stream; buffers are given with byte offsets
//! that are checked against their sizes before NCCL sees them.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use cudarc::nccl::sys as nc;

use crate::driver::{Device, DeviceBuffer, Stream};
use crate::load::{self, Opened};
use crate::locate;
use crate::{Cuda, CudaError, Result};

const NCCL: &str = "NCCL (libnccl.so.2)";

/// NCCL's element types (`-d` in nccl-tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NcclType {
    Int8,
    Uint8,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Float16,
    Float32,
    Float64,
    Bfloat16,
}

impl NcclType {
    pub fn size(self) -> usize {
        match self {
            NcclType::Int8 | NcclType::Uint8 => 1,
            NcclType::Float16 | NcclType::Bfloat16 => 2,
            NcclType::Int32 | NcclType::Uint32 | NcclType::Float32 => 4,
            NcclType::Int64 | NcclType::Uint64 | NcclType::Float64 => 8,
        }
    }

    fn raw(self) -> nc::ncclDataType_t {
        use nc::ncclDataType_t as T;
        match self {
            NcclType::Int8 => T::ncclInt8,
            NcclType::Uint8 => T::ncclUint8,
            NcclType::Int32 => T::ncclInt32,
            NcclType::Uint32 => T::ncclUint32,
            NcclType::Int64 => T::ncclInt64,
            NcclType::Uint64 => T::ncclUint64,
            NcclType::Float16 => T::ncclFloat16,
            NcclType::Float32 => T::ncclFloat32,
            NcclType::Float64 => T::ncclFloat64,
            NcclType::Bfloat16 => T::ncclBfloat16,
        }
    }
}

/// Reduction operations (`-o`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NcclOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl NcclOp {
    fn raw(self) -> nc::ncclRedOp_t {
        use nc::ncclRedOp_t as O;
        match self {
            NcclOp::Sum => O::ncclSum,
            NcclOp::Prod => O::ncclProd,
            NcclOp::Max => O::ncclMax,
            NcclOp::Min => O::ncclMin,
            NcclOp::Avg => O::ncclAvg,
        }
    }
}

type Ty = nc::ncclDataType_t;
type Op = nc::ncclRedOp_t;
type CommT = nc::ncclComm_t;
type StreamT = nc::cudaStream_t;

struct NcclApi {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut nc::ncclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut CommT, c_int, nc::ncclUniqueId, c_int) -> c_int,
    comm_init_all: unsafe extern "C" fn(*mut CommT, c_int, *const c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(CommT) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, Ty, Op, CommT, StreamT) -> c_int,
    broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, Ty, c_int, CommT, StreamT) -> c_int,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        Ty,
        Op,
        c_int,
        CommT,
        StreamT,
    ) -> c_int,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, Ty, CommT, StreamT) -> c_int,
    reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, Ty, Op, CommT, StreamT) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, Ty, c_int, CommT, StreamT) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, Ty, c_int, CommT, StreamT) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    lib: Opened,
}

/// NCCL, loaded.
#[derive(Clone)]
pub struct NcclLibrary {
    api: Arc<NcclApi>,
    version: i32,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.api.lib.path)
            .field("version", &self.version)
            .finish()
    }
}

impl NcclLibrary {
    /// Finds and loads NCCL.
    pub fn load(cuda: &Cuda) -> Result<NcclLibrary> {
        let dirs = locate::search_dirs(cuda.search());
        let found = locate::candidates(&dirs, locate::NCCL_NAMES);
        let lib = load::open_first(NCCL, &found).map_err(|e| match e {
            CudaError::Unavailable { library, reason } => CudaError::Unavailable {
                library,
                reason: format!(
                    "{reason}; searched {}; install NCCL (libnccl2, or PyTorch's nvidia-nccl wheel) or set KEEL_CUDA_LIB_DIR",
                    locate::describe_dirs(&dirs)
                ),
            },
            other => other,
        })?;
        // SAFETY: each signature is the C declaration in nccl.h (2.12 and
        // later), with ncclResult_t read as int.
        let api = unsafe {
            NcclApi {
                get_version: load::function(NCCL, &lib, "ncclGetVersion")?,
                get_unique_id: load::function(NCCL, &lib, "ncclGetUniqueId")?,
                comm_init_rank: load::function(NCCL, &lib, "ncclCommInitRank")?,
                comm_init_all: load::function(NCCL, &lib, "ncclCommInitAll")?,
                comm_destroy: load::function(NCCL, &lib, "ncclCommDestroy")?,
                get_error_string: load::function(NCCL, &lib, "ncclGetErrorString")?,
                all_reduce: load::function(NCCL, &lib, "ncclAllReduce")?,
                broadcast: load::function(NCCL, &lib, "ncclBroadcast")?,
                reduce: load::function(NCCL, &lib, "ncclReduce")?,
                all_gather: load::function(NCCL, &lib, "ncclAllGather")?,
                reduce_scatter: load::function(NCCL, &lib, "ncclReduceScatter")?,
                send: load::function(NCCL, &lib, "ncclSend")?,
                recv: load::function(NCCL, &lib, "ncclRecv")?,
                group_start: load::function(NCCL, &lib, "ncclGroupStart")?,
                group_end: load::function(NCCL, &lib, "ncclGroupEnd")?,
                lib,
            }
        };
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (api.get_version)(&mut version) };
        let api = Arc::new(api);
        check(&api, "ncclGetVersion", r)?;
        Ok(NcclLibrary { api, version })
    }

    /// NCCL's version code, e.g. 22703 for 2.27.3.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// `2.27.3`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
        }
    }

    pub fn path(&self) -> &str {
        &self.api.lib.path
    }

    /// A new unique id (rank 0 makes it and hands it to the others).
    pub fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte struct.
        let r = unsafe { (self.api.get_unique_id)(&mut id) };
        check(&self.api, "ncclGetUniqueId", r)?;
        Ok(id.internal.map(|b| b as u8))
    }

    /// Joins the communicator `id` as `rank` of `nranks`, on `device`.
    /// Blocks until every rank has joined.
    pub fn init_rank(
        &self,
        device: &Device,
        nranks: usize,
        id: &[u8; 128],
        rank: usize,
    ) -> Result<Comm> {
        device.bind()?;
        let id = nc::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: CommT = std::ptr::null_mut();
        // SAFETY: the device's context is current (NCCL uses the current
        // device); the id is passed by value as nccl.h declares.
        let r = unsafe { (self.api.comm_init_rank)(&mut comm, nranks as c_int, id, rank as c_int) };
        check(&self.api, "ncclCommInitRank", r)?;
        Ok(Comm {
            raw: comm,
            api: self.api.clone(),
            device: device.clone(),
        })
    }

    /// One communicator per device, all in this process.
    pub fn init_all(&self, devices: &[Device]) -> Result<Vec<Comm>> {
        let list: Vec<c_int> = devices.iter().map(|d| d.info().ordinal as c_int).collect();
        let mut comms: Vec<CommT> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one handle per device in `list`.
        let r = unsafe {
            (self.api.comm_init_all)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr())
        };
        check(&self.api, "ncclCommInitAll", r)?;
        Ok(comms
            .into_iter()
            .zip(devices)
            .map(|(raw, d)| Comm {
                raw,
                api: self.api.clone(),
                device: d.clone(),
            })
            .collect())
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (needed when
    /// one thread drives several GPUs, and for send/recv pairs). The group
    /// is ended even if `f` fails.
    pub fn group<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        // SAFETY: no arguments.
        check(&self.api, "ncclGroupStart", unsafe {
            (self.api.group_start)()
        })?;
        let out = f();
        // SAFETY: no arguments; pairs the start above.
        let end = check(&self.api, "ncclGroupEnd", unsafe { (self.api.group_end)() });
        let out = out?;
        end?;
        Ok(out)
    }
}

fn check(api: &NcclApi, call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString takes any code and returns a static,
    // NUL-terminated string (or null, handled).
    let message = unsafe {
        let p = (api.get_error_string)(code);
        if p.is_null() {
            "no description".to_owned()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(CudaError::Nccl {
        call,
        code,
        message,
    })
}

/// One rank's communicator; destroyed on drop.
pub struct Comm {
    raw: CommT,
    api: Arc<NcclApi>,
    device: Device,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it are not concurrent; Comm's methods take &self but keel drives each
// communicator from one thread at a time (documented on the type).
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("device", &self.device.info().ordinal)
            .finish()
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created by ncclCommInitRank/All, destroyed once.
        unsafe { (self.api.comm_destroy)(self.raw) };
    }
}

/// A buffer, a byte offset into it, and an element count.
#[derive(Debug, Clone, Copy)]
pub struct Span<'a> {
    pub buf: &'a DeviceBuffer,
    pub offset: usize,
    pub count: usize,
}

impl<'a> Span<'a> {
    pub fn new(buf: &'a DeviceBuffer, offset: usize, count: usize) -> Self {
        Self { buf, offset, count }
    }

    fn ptr(&self, what: &'static str, ty: NcclType) -> Result<*mut c_void> {
        let bytes = self.count.saturating_mul(ty.size());
        Ok(self.buf.at(what, self.offset, bytes)? as *mut c_void)
    }
}

impl Comm {
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn stream(s: &Stream) -> StreamT {
        s.raw() as StreamT
    }

    /// `count` elements of `send` reduced into `recv` on every rank.
    pub fn all_reduce(
        &self,
        send: Span,
        recv: Span,
        ty: NcclType,
        op: NcclOp,
        s: &Stream,
    ) -> Result<()> {
        let (sp, rp) = (
            send.ptr("ncclAllReduce send", ty)?,
            recv.ptr("ncclAllReduce recv", ty)?,
        );
        // SAFETY: both ranges are checked for `count` elements; the stream
        // belongs to this communicator's device.
        let r = unsafe {
            (self.api.all_reduce)(
                sp,
                rp,
                recv.count,
                ty.raw(),
                op.raw(),
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclAllReduce", r)
    }

    pub fn broadcast(
        &self,
        send: Span,
        recv: Span,
        ty: NcclType,
        root: usize,
        s: &Stream,
    ) -> Result<()> {
        let (sp, rp) = (
            send.ptr("ncclBroadcast send", ty)?,
            recv.ptr("ncclBroadcast recv", ty)?,
        );
        // SAFETY: as all_reduce.
        let r = unsafe {
            (self.api.broadcast)(
                sp,
                rp,
                recv.count,
                ty.raw(),
                root as c_int,
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclBroadcast", r)
    }

    pub fn reduce(
        &self,
        send: Span,
        recv: Span,
        ty: NcclType,
        op: NcclOp,
        root: usize,
        s: &Stream,
    ) -> Result<()> {
        let (sp, rp) = (
            send.ptr("ncclReduce send", ty)?,
            recv.ptr("ncclReduce recv", ty)?,
        );
        // SAFETY: as all_reduce.
        let r = unsafe {
            (self.api.reduce)(
                sp,
                rp,
                recv.count,
                ty.raw(),
                op.raw(),
                root as c_int,
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclReduce", r)
    }

    /// `send.count` elements from each rank; `recv` holds `send.count *
    /// ranks` (the caller sizes it so).
    pub fn all_gather(&self, send: Span, recv: Span, ty: NcclType, s: &Stream) -> Result<()> {
        let (sp, rp) = (
            send.ptr("ncclAllGather send", ty)?,
            recv.ptr("ncclAllGather recv", ty)?,
        );
        // SAFETY: as all_reduce; recv was checked for its full count.
        let r = unsafe {
            (self.api.all_gather)(sp, rp, send.count, ty.raw(), self.raw, Self::stream(s))
        };
        check(&self.api, "ncclAllGather", r)
    }

    /// `recv.count` elements to each rank from `send` (`recv.count *
    /// ranks` elements).
    pub fn reduce_scatter(
        &self,
        send: Span,
        recv: Span,
        ty: NcclType,
        op: NcclOp,
        s: &Stream,
    ) -> Result<()> {
        let (sp, rp) = (
            send.ptr("ncclReduceScatter send", ty)?,
            recv.ptr("ncclReduceScatter recv", ty)?,
        );
        // SAFETY: as all_gather.
        let r = unsafe {
            (self.api.reduce_scatter)(
                sp,
                rp,
                recv.count,
                ty.raw(),
                op.raw(),
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclReduceScatter", r)
    }

    pub fn send(&self, send: Span, ty: NcclType, peer: usize, s: &Stream) -> Result<()> {
        let sp = send.ptr("ncclSend", ty)?;
        // SAFETY: as all_reduce.
        let r = unsafe {
            (self.api.send)(
                sp,
                send.count,
                ty.raw(),
                peer as c_int,
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclSend", r)
    }

    pub fn recv(&self, recv: Span, ty: NcclType, peer: usize, s: &Stream) -> Result<()> {
        let rp = recv.ptr("ncclRecv", ty)?;
        // SAFETY: as all_reduce.
        let r = unsafe {
            (self.api.recv)(
                rp,
                recv.count,
                ty.raw(),
                peer as c_int,
                self.raw,
                Self::stream(s),
            )
        };
        check(&self.api, "ncclRecv", r)
    }
}
