//! Device memory through the driver: allocations (VMM with a POSIX-fd handle, or the
//! legacy cuMemAlloc), their export and import, release, and copies and memsets on this
//! crate's stream.

use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{check, Real};
use crate::cuda::driver::{Export, IpcBytes, Mapped, Mem};
use crate::{Error, Result};

impl Real {
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
        let _current = self.state(dev)?;
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
            Mem::Legacy { .. } if !self.legacy_ipc => Err(Error::Device(format!(
                "cuda:{dev} has no CUDA VMM with POSIX-fd handles, so its memory could travel only as \
                 a legacy IPC handle, which the receiver's driver opens without checking it (a forged \
                 one can crash the receiver); set {}=cuda-legacy-ipc in every process to share it \
                 anyway",
                crate::cuda::DRIVER_ENV
            ))),
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
        let _current = self.state(dev)?;
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
        if !self.legacy_ipc {
            return Err(Error::invalid(format!(
                "a legacy CUDA IPC memory handle arrived, and this process does not open them: the \
                 driver opens one without checking it (set {}=cuda-legacy-ipc to accept them)",
                crate::cuda::DRIVER_ENV
            )));
        }
        let _current = self.state(dev)?;
        let h = sys::CUipcMemHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: h is 64 bytes and the driver writes one pointer. It does not check what the
        // bytes say (a forged handle can make it read out of bounds); this runs only in a
        // process whose environment opted in to legacy handles (`legacy_ipc`, checked above),
        // as the crate's documentation of that setting says.
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
        // The claimed size is the sender's word: the allocation's own range bounds it.
        let (mut base, mut real): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: ptr was opened just above in the current context; writes one pointer and
        // one size.
        let r =
            check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut real, ptr) }, "cuMemGetAddressRange");
        let fits = r.as_ref().is_ok_and(|()| base == ptr && real >= size);
        if !fits {
            // SAFETY: ptr was opened above, is not used after this, and is closed once.
            unsafe { sys::cuIpcCloseMemHandle(ptr) };
            r?;
            return Err(Error::invalid(format!(
                "a legacy IPC allocation was claimed as {size} bytes at {ptr:#x}; its range is {real} bytes \
                 from {base:#x}"
            )));
        }
        Ok(Mapped { mem: Mem::Legacy { ptr, imported: true }, ptr, size: real })
    }

    /// Gives back this process's claim; errors are ignored (this runs in drops, and the
    /// driver frees everything at exit anyway).
    pub(crate) fn release(&self, dev: u32, mem: Mem) {
        let Ok(_current) = self.state(dev) else { return };
        // SAFETY: each arm releases what the matching allocation or import made, once: `mem`
        // is consumed. Pending work on every stream of the context is finished first (not
        // only on ours: torch's kernels, or another library's, may still read a tensor that
        // was let go; the driver's unmap does not wait for them), so nothing this process
        // queued still touches the memory.
        unsafe {
            let _ = sys::cuCtxSynchronize();
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
        // SAFETY: src is a live host slice of src.len() bytes, borrowed for the call.
        unsafe { self.htod_raw(dev, dst, src.as_ptr(), src.len()) }
    }

    /// Host to device from `len` bytes at `src`; the host bytes are no longer read when this
    /// returns.
    ///
    /// # Safety
    /// `src..src + len` must be host memory mapped for the whole call (the caller checked
    /// the device range).
    pub(crate) unsafe fn htod_raw(&self, dev: u32, dst: u64, src: *const u8, len: usize) -> Result<()> {
        let st = self.state(dev)?;
        // SAFETY: the host range is mapped for the call (the caller's contract) and the
        // device range lies in one allocation. The stream is synchronised before return,
        // so the host bytes are no longer read afterwards.
        unsafe {
            check(sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, st.stream), "cuMemcpyHtoDAsync")?;
            check(sys::cuStreamSynchronize(st.stream), "cuStreamSynchronize")
        }
    }

    /// Page-locks `len` host bytes at `ptr` for every context (`CU_MEMHOSTREGISTER_PORTABLE`).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped in this process until [`Real::host_unregister`].
    pub(crate) unsafe fn host_register(&self, ptr: u64, len: usize) -> Result<()> {
        // A context must be current; device 0's will do, the registration is portable.
        let _current = self.state(0)?;
        // SAFETY: the range is mapped (the caller's contract) and stays so until it is
        // unregistered; the driver only locks its pages and records it.
        check(
            unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE) },
            "cuMemHostRegister",
        )
    }

    /// Undoes [`Real::host_register`]; errors are ignored (this runs in drops).
    pub(crate) fn host_unregister(&self, ptr: u64) {
        if let Ok(_current) = self.state(0) {
            // SAFETY: ptr is the start of a range registered by host_register and not yet
            // unregistered (a registration is dropped once); copies from it are synchronous,
            // so none is still reading it.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
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
}

fn location(dev: u32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev as c_int }
}

pub(super) fn alloc_prop(dev: u32) -> sys::CUmemAllocationProp {
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
