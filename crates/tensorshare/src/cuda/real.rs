//! The CUDA driver, loaded at run time through cudarc's `sys` bindings.
//!
//! Allocations use the virtual memory management API (cuMemCreate with a POSIX-fd
//! shareable handle type), so an allocation travels as a file descriptor over SCM_RIGHTS
//! like a memfd, and an importer's mapping keeps the physical memory alive by itself. On a
//! device without VMM or POSIX-fd handles, cuMemAlloc plus the legacy 64-byte IPC memory
//! handle is the fallback. Every call runs in the device's primary context, and the work of
//! this crate goes on one non-blocking stream per device.

use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use super::driver::{Export, IpcBytes, Mapped, Mem};
use crate::{Error, Result};

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
    /// Loads the driver and initialises it, or says why it cannot.
    pub(crate) fn load() -> Result<Real> {
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
        Ok(Real { devices: (0..n.max(0)).map(|_| OnceLock::new()).collect() })
    }

    pub(crate) fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn state(&self, dev: u32) -> Result<&DeviceState> {
        let cell = self.devices.get(dev as usize).ok_or_else(|| {
            Error::Device(format!(
                "cuda:{dev} does not exist: this machine has {} CUDA devices",
                self.devices.len()
            ))
        })?;
        let st = cell.get_or_init(|| open_device(dev).map_err(|e| e.to_string()));
        let st = st.as_ref().map_err(|e| Error::Device(e.clone()))?;
        // SAFETY: the context was retained in `open_device` and is never released.
        check(unsafe { sys::cuCtxSetCurrent(st.ctx) }, "cuCtxSetCurrent")?;
        Ok(st)
    }

    pub(crate) fn stream(&self, dev: u32) -> Result<u64> {
        Ok(self.state(dev)?.stream as u64)
    }

    pub(crate) fn alloc(&self, dev: u32, len: usize) -> Result<Mapped> {
        let st = self.state(dev)?;
        let len = len.max(1);
        match st.granularity {
            Some(g) => {
                let size = len.div_ceil(g).checked_mul(g).ok_or_else(|| {
                    Error::invalid_argument(
                        "allocation size",
                        format!("{len} bytes overflow when rounded up"),
                    )
                })?;
                let prop = alloc_prop(dev);
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: prop is a fully initialised property struct; handle is written.
                check(unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }, "cuMemCreate")?;
                map_handle(dev, handle, size)
            }
            None => {
                let mut ptr: sys::CUdeviceptr = 0;
                // SAFETY: writes one device pointer; the context is current.
                check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
                Ok(Mapped { mem: Mem::Legacy { ptr, imported: false }, ptr, size: len })
            }
        }
    }

    pub(crate) fn export(&self, dev: u32, mem: &Mem) -> Result<Export> {
        self.state(dev)?;
        match mem {
            Mem::Vmm { handle, .. } => {
                let mut fd: c_int = -1;
                // SAFETY: for the POSIX-fd handle type the driver writes an int descriptor
                // through the pointer.
                check(
                    unsafe {
                        sys::cuMemExportToShareableHandle(
                            (&mut fd as *mut c_int).cast::<c_void>(),
                            *handle,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            0,
                        )
                    },
                    "cuMemExportToShareableHandle",
                )?;
                if fd < 0 {
                    return Err(Error::Device("cuMemExportToShareableHandle gave no descriptor".into()));
                }
                // SAFETY: the driver made a new descriptor that nothing else owns.
                Ok(Export::Fd(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) })))
            }
            Mem::Legacy { ptr, imported: false } => {
                // SAFETY: CUipcMemHandle is 64 plain bytes; zero is a valid value to overwrite.
                let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                // SAFETY: ptr is the base of a cuMemAlloc allocation of this process.
                check(unsafe { sys::cuIpcGetMemHandle(&mut h, *ptr) }, "cuIpcGetMemHandle")?;
                Ok(Export::Ipc(h.reserved.map(|c| c as u8)))
            }
            Mem::Legacy { imported: true, .. } => {
                // A legacy handle is not re-exported: the importer sends the handle it got.
                Err(Error::Device("an imported legacy IPC allocation has no handle of its own".into()))
            }
            Mem::Sim(_) => Err(Error::Device("a simulated allocation reached the CUDA driver".into())),
        }
    }

    pub(crate) fn import_fd(&self, dev: u32, fd: &OwnedFd, size: usize) -> Result<Mapped> {
        use std::os::fd::AsRawFd;
        self.state(dev)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for the POSIX-fd type the "OS handle" argument is the descriptor number
        // itself, cast to a pointer; the driver does not take ownership of it.
        check(
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as isize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            },
            "cuMemImportFromShareableHandle",
        )?;
        map_handle(dev, handle, size)
    }

    pub(crate) fn import_ipc(&self, dev: u32, bytes: &IpcBytes, size: usize) -> Result<Mapped> {
        self.state(dev)?;
        let h = sys::CUipcMemHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: h is a 64-byte handle; the driver validates it and writes one pointer.
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(Mapped { mem: Mem::Legacy { ptr, imported: true }, ptr, size })
    }

    /// Gives back this process's claim; errors are ignored (this runs in drops, and the
    /// driver frees everything at exit anyway).
    pub(crate) fn release(&self, dev: u32, mem: Mem) {
        let Ok(st) = self.state(dev) else { return };
        // SAFETY: each arm releases what the matching allocation or import made, once: `mem`
        // is consumed. Pending work on our stream is finished first, so nothing queued by
        // this process still touches the memory.
        unsafe {
            let _ = sys::cuStreamSynchronize(st.stream);
            match mem {
                Mem::Vmm { handle, ptr, size } => {
                    let _ = sys::cuMemUnmap(ptr, size);
                    let _ = sys::cuMemAddressFree(ptr, size);
                    let _ = sys::cuMemRelease(handle);
                }
                Mem::Legacy { ptr, imported: false } => {
                    let _ = sys::cuMemFree_v2(ptr);
                }
                Mem::Legacy { ptr, imported: true } => {
                    let _ = sys::cuIpcCloseMemHandle(ptr);
                }
                Mem::Sim(_) => {}
            }
        }
    }

    /// Host to device; the host buffer may be reused when this returns.
    pub(crate) fn htod(&self, dev: u32, dst: u64, src: &[u8]) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: src is a live host slice of src.len() bytes; the caller checked that the
        // device range lies in one allocation. The stream is synchronised before return,
        // so the host buffer is no longer read afterwards.
        unsafe {
            check(
                sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), st.stream),
                "cuMemcpyHtoDAsync",
            )?;
            check(sys::cuStreamSynchronize(st.stream), "cuStreamSynchronize")
        }
    }

    /// Device to host, complete when this returns.
    pub(crate) fn dtoh(&self, dev: u32, dst: &mut [u8], src: u64) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: dst is a live, exclusively borrowed host slice; the caller checked the
        // device range; the stream is synchronised before the borrow ends.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), st.stream),
                "cuMemcpyDtoHAsync",
            )?;
            check(sys::cuStreamSynchronize(st.stream), "cuStreamSynchronize")
        }
    }

    /// Queues `count` copies of a 1-, 2- or 4-byte pattern from `dst`.
    pub(crate) fn memset(&self, dev: u32, dst: u64, pattern: &[u8], count: usize) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: device addresses only, checked by the caller.
        let r = unsafe {
            match *pattern {
                [a] => sys::cuMemsetD8Async(dst, a, count, st.stream),
                [a, b] => sys::cuMemsetD16Async(dst, u16::from_ne_bytes([a, b]), count, st.stream),
                [a, b, c, d] => {
                    sys::cuMemsetD32Async(dst, u32::from_ne_bytes([a, b, c, d]), count, st.stream)
                }
                _ => return Err(Error::Device(format!("no device memset of {}-byte values", pattern.len()))),
            }
        };
        check(r, "cuMemsetAsync")
    }

    pub(crate) fn synchronize(&self, dev: u32) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: the stream belongs to this process's context.
        check(unsafe { sys::cuStreamSynchronize(st.stream) }, "cuStreamSynchronize")
    }

    pub(crate) fn event_create(&self, dev: u32) -> Result<(u64, IpcBytes)> {
        self.state(dev)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle; interprocess events need DISABLE_TIMING, set.
        check(unsafe { sys::cuEventCreate(&mut ev, flags) }, "cuEventCreate")?;
        // SAFETY: CUipcEventHandle is 64 plain bytes.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: ev is the interprocess event made above.
        if let Err(e) = check(unsafe { sys::cuIpcGetEventHandle(&mut h, ev) }, "cuIpcGetEventHandle") {
            // SAFETY: ev was made above and is not used after this.
            unsafe { sys::cuEventDestroy_v2(ev) };
            return Err(e);
        }
        Ok((ev as u64, h.reserved.map(|c| c as u8)))
    }

    pub(crate) fn event_open(&self, dev: u32, bytes: &IpcBytes) -> Result<u64> {
        self.state(dev)?;
        let h = sys::CUipcEventHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the driver validates the handle and writes one event.
        check(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, "cuIpcOpenEventHandle")?;
        Ok(ev as u64)
    }

    pub(crate) fn event_record(&self, dev: u32, ev: u64) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: ev is an event of this process (made or opened here, not destroyed).
        check(unsafe { sys::cuEventRecord(ev as sys::CUevent, st.stream) }, "cuEventRecord")
    }

    pub(crate) fn event_wait(&self, dev: u32, ev: u64) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: as in event_record.
        check(unsafe { sys::cuStreamWaitEvent(st.stream, ev as sys::CUevent, 0) }, "cuStreamWaitEvent")
    }

    pub(crate) fn event_synchronize(&self, dev: u32, ev: u64) -> Result<()> {
        self.state(dev)?;
        // SAFETY: as in event_record.
        check(unsafe { sys::cuEventSynchronize(ev as sys::CUevent) }, "cuEventSynchronize")
    }

    pub(crate) fn event_query(&self, dev: u32, ev: u64) -> Result<bool> {
        self.state(dev)?;
        // SAFETY: as in event_record.
        let r = unsafe { sys::cuEventQuery(ev as sys::CUevent) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|()| true)
    }

    pub(crate) fn event_destroy(&self, dev: u32, ev: u64) {
        if self.state(dev).is_ok() {
            // SAFETY: ev is ours and is not used after this; pending records complete first
            // (the driver defers the release).
            unsafe { sys::cuEventDestroy_v2(ev as sys::CUevent) };
        }
    }
}

fn location(dev: u32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev as c_int }
}

fn alloc_prop(dev: u32) -> sys::CUmemAllocationProp {
    // SAFETY: the property struct is plain C data for which all-zero is the documented
    // "unset" value of every field.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = location(dev);
    prop
}

/// Reserves an address range, maps `handle` there and enables access from `dev`; on any
/// failure everything made so far, the handle included, is released.
fn map_handle(dev: u32, handle: sys::CUmemGenericAllocationHandle, size: usize) -> Result<Mapped> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: each call gets initialised arguments; on failure the steps already taken are
    // undone in reverse order and `handle` is released exactly once.
    unsafe {
        if let Err(e) = check(sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0), "cuMemAddressReserve") {
            let _ = sys::cuMemRelease(handle);
            return Err(e);
        }
        if let Err(e) = check(sys::cuMemMap(ptr, size, 0, handle, 0), "cuMemMap") {
            let _ = sys::cuMemAddressFree(ptr, size);
            let _ = sys::cuMemRelease(handle);
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: location(dev),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        if let Err(e) = check(sys::cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess") {
            let _ = sys::cuMemUnmap(ptr, size);
            let _ = sys::cuMemAddressFree(ptr, size);
            let _ = sys::cuMemRelease(handle);
            return Err(e);
        }
    }
    Ok(Mapped { mem: Mem::Vmm { handle, ptr, size }, ptr, size })
}

fn open_device(dev: u32) -> Result<DeviceState> {
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
    let vmm = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) != 0
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
