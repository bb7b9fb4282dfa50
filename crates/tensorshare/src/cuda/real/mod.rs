//! The CUDA driver, loaded at run time through cudarc's `sys` bindings.
//!
//! Allocations use the virtual memory management API (cuMemCreate with a POSIX-fd
//! shareable handle type), so an allocation travels as a file descriptor over SCM_RIGHTS
//! like a memfd, and an importer's mapping keeps the physical memory alive by itself. On a
//! device without VMM or POSIX-fd handles, cuMemAlloc plus the legacy 64-byte IPC memory
//! handle is the fallback. Every call runs in the device's primary context, and the work of
//! this crate goes on one non-blocking stream per device.
//!
//! Here: loading the driver and each device's context and stream. `memory`: allocations,
//! their export and import, copies. `events`: interprocess events.

use std::ffi::{c_int, CStr};
use std::ops::Deref;
use std::sync::OnceLock;

use cudarc::driver::sys;

mod events;
mod memory;

use crate::{Error, Result};
use memory::alloc_prop;

/// Oldest driver API this module calls into (11.3: VMM, IPC events, POSIX-fd handles).
const MIN_DRIVER: c_int = 11030;

struct DeviceState {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    /// VMM with POSIX-fd handles: allocation granularity; None: the legacy path.
    granularity: Option<usize>,
}

// SAFETY: a CUcontext and a CUstream are driver handles usable from any thread (the driver
// serialises access to them); this struct only stores them.
unsafe impl Send for DeviceState {}
// SAFETY: as above.
unsafe impl Sync for DeviceState {}

pub(crate) struct Real {
    devices: Vec<OnceLock<std::result::Result<DeviceState, String>>>,
    /// Legacy IPC memory handles are made and opened (`cuda-legacy-ipc` in the driver
    /// variable), and used on every device, VMM or not. Otherwise a device without VMM
    /// allocates with cuMemAlloc but shares nothing: the driver opens a legacy handle from a
    /// message's bytes without checking them, so that takes the program's consent.
    pub(super) legacy_ipc: bool,
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut msg: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
    let known = unsafe { sys::cuGetErrorString(r, &mut msg) } == sys::CUresult::CUDA_SUCCESS;
    let text = if known && !msg.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    } else {
        "unknown error".to_owned()
    };
    Err(Error::Device(format!("CUDA {what} failed: {r:?} ({text})")))
}

impl Real {
    /// Loads the driver and initialises it, or says why it cannot. `legacy_ipc`: allocate
    /// with cuMemAlloc and share legacy IPC handles on every device (see the field).
    pub(crate) fn load(legacy_ipc: bool) -> Result<Real> {
        // SAFETY: probing for the library has no precondition; it is what keeps every later
        // call from panicking inside cudarc when no driver is installed.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Device(
                "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine, or \
                 it is not on the library path)"
                    .into(),
            ));
        }
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        check(unsafe { sys::cuDriverGetVersion(&mut version) }, "cuDriverGetVersion")?;
        if version < MIN_DRIVER {
            return Err(Error::Device(format!(
                "the CUDA driver supports API {version}, tensorshare needs {MIN_DRIVER} or newer"
            )));
        }
        // SAFETY: cuInit takes flags 0 and may be called more than once.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        Ok(Real { devices: (0..n.max(0)).map(|_| OnceLock::new()).collect(), legacy_ipc })
    }

    pub(crate) fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// Device `dev`'s state, with its primary context current in this thread until the
    /// returned guard goes (then the context that was current before is current again).
    fn state(&self, dev: u32) -> Result<Current<'_>> {
        let cell = self.devices.get(dev as usize).ok_or_else(|| {
            Error::Device(format!(
                "cuda:{dev} does not exist: this machine has {} CUDA devices",
                self.devices.len()
            ))
        })?;
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle (null when none is current in this thread).
        check(unsafe { sys::cuCtxGetCurrent(&mut prev) }, "cuCtxGetCurrent")?;
        // (Opening the device makes its context current: the guard undoes that too, also
        // when opening fails.)
        let mut current = Current { st: None, prev };
        let st = cell.get_or_init(|| open_device(dev, self.legacy_ipc).map_err(|e| e.to_string()));
        let st = st.as_ref().map_err(|e| Error::Device(e.clone()))?;
        // SAFETY: the context was retained in `open_device` and is never released.
        check(unsafe { sys::cuCtxSetCurrent(st.ctx) }, "cuCtxSetCurrent")?;
        current.st = Some(st);
        Ok(current)
    }

    pub(crate) fn stream(&self, dev: u32) -> Result<u64> {
        let st = self.state(dev)?;
        Ok(st.stream as u64)
    }

    /// The device's free and total memory in bytes, device-wide.
    pub(crate) fn mem_get_info(&self, dev: u32) -> Result<(u64, u64)> {
        let _current = self.state(dev)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two usizes, for the device of the current context (set by `state`).
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn synchronize(&self, dev: u32) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: the stream belongs to this process's context.
        check(unsafe { sys::cuStreamSynchronize(st.stream) }, "cuStreamSynchronize")
    }
}

/// A device's state while its context is current in this thread (see [`Real::state`]). torch
/// and every CUDA runtime program take the calling thread's current context for their current
/// device (`cudaGetDevice`), so a call into tensorshare leaves it as it found it: without
/// that, making or receiving a tensor on `cuda:1` moved a program's later work to `cuda:1`.
#[must_use = "the device's context is current only while this guard lives"]
struct Current<'a> {
    /// `None` only while the guard is being made (it then restores `prev` alone).
    st: Option<&'a DeviceState>,
    /// The context current in this thread before (null: none).
    prev: sys::CUcontext,
}

impl Deref for Current<'_> {
    type Target = DeviceState;

    fn deref(&self) -> &DeviceState {
        self.st.expect("a guard handed out holds its device's state")
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if self.st.is_some_and(|st| st.ctx == self.prev) {
            return;
        }
        // SAFETY: `prev` is what the driver reported as current in this thread when the guard
        // was made (a context of this process, or null for none); cuCtxSetCurrent takes
        // either, and answers an error (ignored: this runs in a drop) for a context its owner
        // has destroyed since.
        let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
    }
}

fn open_device(dev: u32, legacy_ipc: bool) -> Result<DeviceState> {
    let mut d: sys::CUdevice = 0;
    // SAFETY: writes one device handle.
    check(unsafe { sys::cuDeviceGet(&mut d, dev as c_int) }, "cuDeviceGet")?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: retains the primary context (kept for the life of the process).
    check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, d) }, "cuDevicePrimaryCtxRetain")?;
    // SAFETY: ctx was just retained.
    check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
    let attr = |a: sys::CUdevice_attribute| -> c_int {
        let mut v: c_int = 0;
        // SAFETY: writes one int; an unknown attribute is an error, read as "not supported".
        if unsafe { sys::cuDeviceGetAttribute(&mut v, a, d) } != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        v
    };
    let vmm = !legacy_ipc
        && attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) != 0
        && attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
            != 0;
    let granularity = if vmm {
        let prop = alloc_prop(dev);
        let mut g: usize = 0;
        // SAFETY: prop is initialised; writes one usize.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        (r == sys::CUresult::CUDA_SUCCESS && g > 0).then_some(g)
    } else {
        None
    };
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one stream handle in the current (primary) context.
    check(
        unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    )?;
    Ok(DeviceState { ctx, stream, granularity })
}
