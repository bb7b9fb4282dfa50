//! The simulated device: "device memory" is a memfd mapped in each process that holds it,
//! exported as a descriptor exactly as CUDA VMM exports a POSIX-fd handle, so everything
//! above the driver layer (handles on the wire, the receive cache, leases, relays, dead
//! consumers) runs unchanged on machines without a GPU. Work is synchronous: a copy is
//! done when its call returns, so every event is complete as soon as it is recorded.
//!
//! Selected with `TENSORSHARE_CUDA_DRIVER=simulated` (two devices) or `simulated:N`.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::driver::{Export, IpcBytes, Mapped, Mem};
use crate::shm::Segment;
use crate::{Error, Result, SharingStrategy};

const EVENT_MAGIC: &[u8; 8] = b"TSSIMEV1";

pub(crate) struct Sim {
    devices: u32,
    events: AtomicU64,
    /// Registered host ranges (start, length), so that registering one twice or an
    /// overlapping one fails as it does with the driver.
    registered: Mutex<BTreeMap<u64, usize>>,
}

impl Sim {
    pub(crate) fn new(devices: u32) -> Sim {
        Sim { devices, events: AtomicU64::new(1), registered: Mutex::new(BTreeMap::new()) }
    }

    /// Records a page-locked host range: the simulated device copies from any host memory
    /// alike, so registering is bookkeeping, checked as the driver checks it.
    pub(crate) fn host_register(&self, ptr: u64, len: usize) -> Result<()> {
        let mut r = crate::util::lock(&self.registered);
        let end = ptr.checked_add(len as u64).filter(|_| len > 0 && ptr % 4096 == 0);
        let Some(end) = end else {
            return Err(Error::Device(format!(
                "cuMemHostRegister of {len} bytes at {ptr:#x}: invalid range"
            )));
        };
        let before = r.range(..end).next_back().map(|(&s, &l)| s + l as u64);
        if before.is_some_and(|e| e > ptr) {
            return Err(Error::Device(format!(
                "cuMemHostRegister of {len} bytes at {ptr:#x}: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
            )));
        }
        r.insert(ptr, len);
        Ok(())
    }

    pub(crate) fn host_unregister(&self, ptr: u64) {
        crate::util::lock(&self.registered).remove(&ptr);
    }

    /// Copies `len` bytes of a host storage at `src` to the simulated allocation at `dst`,
    /// with the crate's atomic copies (other handles may write the storage meanwhile).
    ///
    /// # Safety
    /// `dst..dst + len` must lie in a live simulated allocation that nothing else in this
    /// process accesses during the call, `src..src + len` in one host storage's bytes.
    pub(crate) unsafe fn copy_from_storage(&self, dst: u64, src: *const u8, len: usize) {
        if len == 0 {
            return;
        }
        // SAFETY: the destination range is a live mapping that nothing else here touches
        // meanwhile (the caller's contract); the source is storage bytes, read word by
        // word with atomic loads.
        unsafe { crate::atomic_bytes::load(src, std::slice::from_raw_parts_mut(dst as *mut u8, len)) };
    }

    pub(crate) fn device_count(&self) -> u32 {
        self.devices
    }

    pub(crate) fn alloc(&self, len: usize) -> Result<Mapped> {
        let seg = Segment::create(len.max(1), SharingStrategy::FileDescriptor)?;
        let (ptr, size) = (seg.as_ptr() as u64, seg.len());
        Ok(Mapped { mem: Mem::Sim(seg), ptr, size })
    }

    pub(crate) fn export(&self, mem: &Mem) -> Result<Export> {
        let Mem::Sim(seg) = mem else { return Err(foreign()) };
        let fd = seg.fd().try_clone_to_owned().map_err(|e| Error::io("dup of a simulated allocation", e))?;
        Ok(Export::Fd(Arc::new(fd)))
    }

    pub(crate) fn import_fd(&self, fd: &OwnedFd, size: usize) -> Result<Mapped> {
        let fd = fd.as_fd().try_clone_to_owned().map_err(|e| Error::io("dup of a received allocation", e))?;
        let seg = Segment::from_fd(fd, size)?;
        let (ptr, size) = (seg.as_ptr() as u64, seg.len());
        Ok(Mapped { mem: Mem::Sim(seg), ptr, size })
    }

    /// Copies `len` bytes from `src` to `dst`, both addresses in this process.
    ///
    /// # Safety
    /// Both ranges must lie in live mappings (a simulated allocation or host memory) and
    /// must not overlap.
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, len: usize) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
    }

    /// Writes `count` copies of `pattern` from `dst`.
    ///
    /// # Safety
    /// `count * pattern.len()` bytes from `dst` must lie in a live simulated allocation.
    pub(crate) unsafe fn memset(&self, dst: u64, pattern: &[u8], count: usize) {
        let (p, total) = (dst as *mut u8, count * pattern.len());
        if total == 0 {
            return;
        }
        // One copy of the pattern, then the filled prefix doubled until the range is full.
        // SAFETY: every write lies in dst..dst + total (the caller's contract), and each copy
        // reads the already written prefix into the disjoint range right after it.
        unsafe {
            std::ptr::copy_nonoverlapping(pattern.as_ptr(), p, pattern.len());
            let mut done = pattern.len();
            while done < total {
                let n = done.min(total - done);
                std::ptr::copy_nonoverlapping(p, p.add(done), n);
                done += n;
            }
        }
    }

    pub(crate) fn event_create(&self) -> (u64, IpcBytes) {
        let serial = self.events.fetch_add(1, Ordering::Relaxed);
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(EVENT_MAGIC);
        handle[8..12].copy_from_slice(&rustix::process::getpid().as_raw_nonzero().get().to_le_bytes());
        handle[16..24].copy_from_slice(&serial.to_le_bytes());
        (serial, handle)
    }

    pub(crate) fn event_open(&self, handle: &IpcBytes) -> Result<u64> {
        if &handle[..8] != EVENT_MAGIC {
            return Err(Error::invalid("an event handle that no simulated device made"));
        }
        Ok(u64::from_le_bytes(handle[16..24].try_into().expect("8 bytes")))
    }
}

fn foreign() -> Error {
    Error::Device("an allocation of another driver reached the simulated device".into())
}
