//! The CUDA driver through cudarc: devices and their primary contexts,
//! streams, timing events, device memory, pinned host memory and copies.
//!
//! [`Cuda::open`] is the gate: it checks that cudarc can find the driver
//! library (`is_culib_present`) and that the driver is new enough for the
//! bindings before the first real call, so no cudarc path can panic on a
//! missing library or symbol afterwards.
//!
//! Copies are asynchronous on a [`Stream`]. Host memory is only handed out
//! as a slice after the context is synchronised ([`HostBuffer::as_slice`]),
//! so no Rust reference to it can coexist with a copy in flight.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::safe::{CudaContext, CudaEvent, CudaStream};
use cudarc::driver::sys::{self, CUdevice_attribute, CUdeviceptr, CUevent_flags};

use crate::locate::{self, SearchEnv};
use crate::{CudaError, Result, MIN_DRIVER_VERSION};

/// The driver's name and description of an error code.
fn describe(e: DriverError) -> (String, String) {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as i32));
    let message = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "no description".into());
    (name, message)
}

pub(crate) fn driver_err(call: &'static str, e: DriverError) -> CudaError {
    let (name, message) = describe(e);
    CudaError::Driver {
        call,
        name,
        message,
    }
}

/// The CUDA driver, loaded and initialised, with at least one GPU.
#[derive(Debug, Clone)]
pub struct Cuda {
    driver_version: i32,
    device_count: usize,
    search: SearchEnv,
}

const DRIVER: &str = "the CUDA driver (libcuda.so.1)";

impl Cuda {
    /// Loads the driver and initialises it.
    ///
    /// [`CudaError::Unavailable`] when the library is not there, the driver
    /// is older than [`MIN_DRIVER_VERSION`], `cuInit` fails (no device, a
    /// stub library, a driver/library mismatch) or there is no GPU.
    pub fn open(search: &SearchEnv) -> Result<Cuda> {
        if let Some(p) = locate::driver_in_lib_dir(search) {
            crate::load::preload_forever(&p).map_err(|reason| CudaError::Unavailable {
                library: DRIVER,
                reason,
            })?;
        }
        // SAFETY: only tries to dlopen the driver's names and closes again;
        // no CUDA function is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable {
                library: DRIVER,
                reason: "libcuda.so.1 is not on the dynamic loader's path (is the NVIDIA driver installed? \
                         KEEL_CUDA_LIB_DIR may name the directory that holds it)"
                    .into(),
            });
        }
        let mut version: i32 = 0;
        // SAFETY: the library is present (checked above), so cudarc's loader
        // finds it; cuDriverGetVersion exists in every driver and writes one
        // int through a valid pointer.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        r.result()
            .map_err(|e| unavailable_from("cuDriverGetVersion", e))?;
        if version < MIN_DRIVER_VERSION {
            return Err(CudaError::Unavailable {
                library: DRIVER,
                reason: format!(
                    "the driver supports CUDA {}, keel needs CUDA {} or newer",
                    version_string(version),
                    version_string(MIN_DRIVER_VERSION)
                ),
            });
        }
        result::init().map_err(|e| unavailable_from("cuInit", e))?;
        let count =
            result::device::get_count().map_err(|e| unavailable_from("cuDeviceGetCount", e))?;
        if count <= 0 {
            return Err(CudaError::Unavailable {
                library: DRIVER,
                reason: "the driver sees no GPU".into(),
            });
        }
        Ok(Cuda {
            driver_version: version,
            device_count: count as usize,
            search: search.clone(),
        })
    }

    /// The CUDA version the driver supports, e.g. 13000 for 13.0.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    pub fn device_count(&self) -> usize {
        self.device_count
    }

    /// Where the other libraries are searched for.
    pub fn search(&self) -> &SearchEnv {
        &self.search
    }

    /// Opens GPU `ordinal` (its primary context, the one PyTorch and NCCL
    /// use too).
    pub fn device(&self, ordinal: usize) -> Result<Device> {
        if ordinal >= self.device_count {
            return Err(CudaError::NoSuchDevice {
                ordinal,
                count: self.device_count,
            });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        let name = ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))?;
        let memory = ctx
            .total_mem()
            .map_err(|e| driver_err("cuDeviceTotalMem", e))?;
        let mut bus = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is 32 bytes and its length is passed; the driver
        // writes a NUL-terminated string into it.
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) }
            .result()
            .map_err(|e| driver_err("cuDeviceGetPCIBusId", e))?;
        // SAFETY: the driver NUL-terminated it within the buffer.
        let pci = unsafe { CStr::from_ptr(bus.as_ptr()) }
            .to_string_lossy()
            .to_ascii_lowercase();
        Ok(Device {
            info: DeviceInfo {
                ordinal,
                name,
                pci_bus_id: pci,
                compute_capability: (major, minor),
                multiprocessors: sms,
                memory_bytes: memory as u64,
            },
            ctx,
        })
    }
}

fn unavailable_from(call: &'static str, e: DriverError) -> CudaError {
    let (name, message) = describe(e);
    CudaError::Unavailable {
        library: DRIVER,
        reason: format!("{call}: {name} ({message})"),
    }
}

/// `12040` -> `12.4`.
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// What the driver says about a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Lowercase, as sysfs writes it: `0000:07:00.0`.
    pub pci_bus_id: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    pub memory_bytes: u64,
}

/// One GPU and its primary context.
#[derive(Debug, Clone)]
pub struct Device {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
}

impl Device {
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Makes this GPU's context current on the calling thread (NCCL and
    /// cuBLAS use the current context).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("cuCtxSetCurrent", e))
    }

    pub fn stream(&self) -> Result<Stream> {
        let s = self
            .ctx
            .new_stream()
            .map_err(|e| driver_err("cuStreamCreate", e))?;
        Ok(Stream { inner: s })
    }

    /// A timing event.
    pub fn event(&self) -> Result<Event> {
        let e = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_err("cuEventCreate", e))?;
        Ok(Event { inner: e })
    }

    /// `bytes` of device memory (uninitialised).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.bind()?;
        // SAFETY: the context is current; the pointer is freed exactly once,
        // in DeviceBuffer's Drop, with the same context current.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| driver_err("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// `bytes` of page-locked host memory (`cuMemHostAlloc`, portable, not
    /// write-combined), zero-filled here so that every page is touched by
    /// the calling thread: allocate on a thread pinned to the GPU's NUMA
    /// node and the pages live on that node.
    pub fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        self.bind()?;
        // SAFETY: the context is current; flags are a valid combination; the
        // pointer is freed exactly once, in HostBuffer's Drop.
        let ptr = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| driver_err("cuMemHostAlloc", e))? as *mut u8;
        // SAFETY: the allocation is at least `bytes` long and not shared yet.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(HostBuffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// Whether this GPU can read and write `peer`'s memory directly.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        let mut can = 0;
        // SAFETY: both handles come from the driver; one int is written.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device()) }
            .result()
            .map_err(|e| driver_err("cuDeviceCanAccessPeer", e))?;
        Ok(can != 0)
    }

    /// Lets this GPU's context access `peer`'s memory (already enabled is
    /// fine).
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        self.bind()?;
        // SAFETY: this context is current and the peer context is live (we
        // hold an Arc to it).
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            other => Err(driver_err("cuCtxEnablePeerAccess", DriverError(other))),
        }
    }

    /// Waits for all work on this GPU's context.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(|e| driver_err("cuCtxSynchronize", e))
    }
}

/// Device memory; freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address `offset` bytes in, checked to leave room for
    /// `bytes`.
    pub(crate) fn at(
        &self,
        what: &'static str,
        offset: usize,
        bytes: usize,
    ) -> Result<CUdeviceptr> {
        let needed = offset.saturating_add(bytes);
        if needed > self.bytes {
            return Err(CudaError::OutOfBounds {
                what,
                needed,
                len: self.bytes,
            });
        }
        Ok(self.ptr + offset as CUdeviceptr)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Errors on free cannot be reported from drop; cudarc records them
        // on the context.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by cuMemAlloc in this context, freed once.
        self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// Page-locked host memory; freed on drop.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain memory owned by this value; the raw pointer is
// only dereferenced through methods that synchronise first, and the context
// handle it holds is thread-safe (cudarc's CudaContext is Send + Sync).
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The contents, after every copy queued in the context has finished.
    pub fn as_slice(&self) -> Result<&[u8]> {
        self.ctx
            .synchronize()
            .map_err(|e| driver_err("cuCtxSynchronize", e))?;
        // SAFETY: `bytes` valid bytes, initialised at allocation. No copy
        // into this buffer is in flight after the synchronisation, and none
        // can be queued while the slice lives: copies into host memory take
        // `&mut HostBuffer`. Copies out of it only read.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) })
    }

    /// The contents for writing, after every copy queued in the context has
    /// finished.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.ctx
            .synchronize()
            .map_err(|e| driver_err("cuCtxSynchronize", e))?;
        // SAFETY: as above; `&mut self` excludes any other borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) })
    }

    fn at(&self, what: &'static str, bytes: usize) -> Result<*mut c_void> {
        if bytes > self.bytes {
            return Err(CudaError::OutOfBounds {
                what,
                needed: bytes,
                len: self.bytes,
            });
        }
        Ok(self.ptr as *mut c_void)
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.synchronize());
        // SAFETY: allocated by cuMemHostAlloc, freed once, nothing in flight.
        self.ctx
            .record_err(unsafe { result::free_host(self.ptr as *mut c_void) });
    }
}

/// A CUDA event with timing.
#[derive(Debug)]
pub struct Event {
    inner: CudaEvent,
}

impl Event {
    /// Milliseconds between `self` (recorded first) and `end`; waits for
    /// `end` to complete.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        end.inner
            .synchronize()
            .map_err(|e| driver_err("cuEventSynchronize", e))?;
        self.inner
            .elapsed_ms(&end.inner)
            .map_err(|e| driver_err("cuEventElapsedTime", e))
    }
}

/// A non-blocking stream on one GPU.
#[derive(Debug, Clone)]
pub struct Stream {
    inner: Arc<CudaStream>,
}

impl Stream {
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.inner.cu_stream()
    }

    fn bind(&self) -> Result<()> {
        self.inner
            .context()
            .bind_to_thread()
            .map_err(|e| driver_err("cuCtxSetCurrent", e))
    }

    pub fn record(&self, event: &Event) -> Result<()> {
        event
            .inner
            .record(&self.inner)
            .map_err(|e| driver_err("cuEventRecord", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e))
    }

    /// Queues a copy of the first `bytes` of `src` to `dst` (copy engine).
    pub fn copy_h2d(&self, dst: &DeviceBuffer, src: &HostBuffer, bytes: usize) -> Result<()> {
        let d = dst.at("host-to-device copy", 0, bytes)?;
        let s = src.at("host-to-device copy", bytes)?;
        self.bind()?;
        // SAFETY: both ranges are inside live allocations (checked); the
        // host memory is pinned and stays alive until the buffer's Drop,
        // which synchronises first.
        unsafe { sys::cuMemcpyHtoDAsync_v2(d, s, bytes, self.raw()) }
            .result()
            .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))
    }

    /// Queues a copy of the first `bytes` of `src` to `dst`.
    pub fn copy_d2h(&self, dst: &mut HostBuffer, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        let s = src.at("device-to-host copy", 0, bytes)?;
        let d = dst.at("device-to-host copy", bytes)?;
        self.bind()?;
        // SAFETY: as copy_h2d; `&mut` means no slice of the host memory is
        // alive, and as_slice synchronises before making a new one.
        unsafe { sys::cuMemcpyDtoHAsync_v2(d, s, bytes, self.raw()) }
            .result()
            .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))
    }

    /// Queues a copy between two buffers of this GPU.
    pub fn copy_d2d(&self, dst: &DeviceBuffer, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        let d = dst.at("device-to-device copy", 0, bytes)?;
        let s = src.at("device-to-device copy", 0, bytes)?;
        self.bind()?;
        // SAFETY: both ranges are inside live device allocations.
        unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, bytes, self.raw()) }
            .result()
            .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))
    }

    /// Queues a copy from `src` (on one GPU) to `dst` (on another).
    pub fn copy_peer(&self, dst: &DeviceBuffer, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        let d = dst.at("peer copy", 0, bytes)?;
        let s = src.at("peer copy", 0, bytes)?;
        self.bind()?;
        // SAFETY: both ranges are inside live allocations of the contexts
        // passed alongside them.
        unsafe {
            result::memcpy_peer_async(dst.ctx.cu_ctx(), d, src.ctx.cu_ctx(), s, bytes, self.raw())
        }
        .map_err(|e| driver_err("cuMemcpyPeerAsync", e))
    }

    /// Copies `data` into `dst` at `offset` and waits.
    pub fn upload(&self, dst: &DeviceBuffer, offset: usize, data: &[u8]) -> Result<()> {
        let d = dst.at("upload", offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the device range is checked; `data` outlives the copy
        // because the stream is synchronised before returning.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(d, data.as_ptr() as *const c_void, data.len(), self.raw())
        }
        .result()
        .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
        self.synchronize()
    }

    /// Copies `out.len()` bytes from `src` at `offset` into `out` and waits.
    pub fn download(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        let s = src.at("download", offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the device range is checked; `out` is exclusively borrowed
        // until the stream is synchronised below.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, s, out.len(), self.raw())
        }
        .result()
        .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
        self.synchronize()
    }
}
