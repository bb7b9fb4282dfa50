//! Device allocations, one per storage, and their leases.
//!
//! An allocation is exported whole and alone (never a larger cached block around it), so
//! a consumer can reach exactly the storage it was sent.
//!
//! Lifetime without pinning: the first time an allocation is sent, its creator makes a
//! *lease pipe*. The creator keeps the read end; every holder elsewhere (a process that
//! received the storage, a message in flight, a relay to a third process) holds a write
//! end, which travels with each message next to the memory handle. The kernel closes a
//! write end when its holder drops the storage, exits, is killed, or when an unread message
//! is destroyed with its socket; once no write end is left the read end reports a hang-up,
//! and the creator frees the memory. Until then the creator keeps it, even after dropping
//! its own tensors, so no consumer ever reads freed memory.
//!
//! What the creator keeps once it no longer uses an allocation (for other holders, or free
//! for reuse) is `cache`'s.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rustix::event::{PollFd, PollFlags};

use super::cache::{collect_with, registry, release_all, Draining, Free};
use super::driver::{backend, Export, Mapped, Mem};
use crate::{Error, Result};

/// An allocation's identity in every process: chosen by its creator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct AllocId {
    pub(crate) origin: u64,
    pub(crate) serial: u64,
}

impl AllocId {
    fn fresh() -> AllocId {
        static ORIGIN: OnceLock<u64> = OnceLock::new();
        static SERIAL: AtomicU64 = AtomicU64::new(1);
        let origin = *ORIGIN.get_or_init(|| {
            let mut b = [0u8; 8];
            crate::util::random_bytes(&mut b);
            u64::from_le_bytes(b) | 1
        });
        AllocId { origin, serial: SERIAL.fetch_add(1, Ordering::Relaxed) }
    }
}

/// The lease pipe of an allocation made here.
struct LeasePipe {
    read: OwnedFd,
    /// This process's own hold while it has the storage.
    write: Arc<OwnedFd>,
}

enum Lease {
    /// Made here; the pipe exists once the allocation has been sent.
    Creator(Option<LeasePipe>),
    /// Received: this process's hold on the creator's allocation.
    Holder(Arc<OwnedFd>),
}

struct State {
    export: Option<Export>,
    lease: Lease,
}

/// A device allocation mapped in this process: the memory under one CUDA storage.
pub(crate) struct Allocation {
    pub(crate) device: u32,
    pub(crate) id: AllocId,
    /// Device address of the first byte, in this process.
    pub(crate) ptr: u64,
    /// Bytes mapped (the storage may use fewer).
    pub(crate) size: usize,
    mem: Option<Mem>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation").field("device", &self.device).field("size", &self.size).finish()
    }
}

/// Whether `fd` is a write end of the pipe whose read end is `read`.
fn is_write_end_of(fd: &OwnedFd, read: &OwnedFd) -> bool {
    let (Ok(a), Ok(b)) = (rustix::fs::fstat(fd), rustix::fs::fstat(read)) else { return false };
    let write_only = rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f.contains(rustix::fs::OFlags::WRONLY));
    a.st_dev == b.st_dev && a.st_ino == b.st_ino && write_only
}

/// Whether every write end of a lease pipe is closed.
fn hung_up(read: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(read, PollFlags::IN)];
    let ts = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
        && fds[0].revents().contains(PollFlags::HUP)
}

impl Allocation {
    /// A new allocation of at least `len` bytes on `device`; contents unspecified.
    pub(crate) fn new(device: u32, len: usize) -> Result<Allocation> {
        let b = backend()?;
        b.check_device(device)?;
        collect_with(b);
        let reused = registry().reuse(device, len);
        let (mapped, export) = match reused {
            Some(f) => (f.mapped, f.export),
            None => {
                let mapped = b.alloc(device, len)?;
                registry().allocated += mapped.size;
                (mapped, None)
            }
        };
        // A fresh id even for a reused allocation: no receiver may take it for the old one.
        Ok(Allocation {
            device,
            id: AllocId::fresh(),
            ptr: mapped.ptr,
            size: mapped.size,
            mem: Some(mapped.mem),
            state: Mutex::new(State { export, lease: Lease::Creator(None) }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        crate::util::lock(&self.state)
    }

    /// The memory handle and a hold on the lease, to travel in a message.
    pub(crate) fn wire_parts(&self) -> Result<(Export, Arc<OwnedFd>)> {
        let mut st = self.state();
        let export = match &st.export {
            Some(e) => e.clone(),
            None => {
                let mem = self.mem.as_ref().ok_or_else(|| Error::Device("a released allocation".into()))?;
                let b = backend()?;
                let e = b.export(self.device, mem)?;
                if b.keeps_exports() {
                    st.export = Some(e.clone());
                }
                e
            }
        };
        let lease = match &mut st.lease {
            Lease::Holder(w) => w.clone(),
            Lease::Creator(Some(p)) => p.write.clone(),
            Lease::Creator(pipe @ None) => {
                let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .map_err(|e| Error::io("pipe for a CUDA allocation's lease", e))?;
                let write = Arc::new(write);
                *pipe = Some(LeasePipe { read, write: write.clone() });
                write
            }
        };
        Ok((export, lease))
    }

    /// Builds this process's view of an allocation named by a message: the creator's own
    /// allocation coming back (still kept for other holders), or an import.
    pub(crate) fn receive(
        device: u32,
        id: AllocId,
        size: usize,
        export: Export,
        lease: OwnedFd,
    ) -> Result<Allocation> {
        let b = backend()?;
        let back = {
            let mut r = registry();
            let i = r.draining.iter().position(|d| d.id == id);
            i.map(|i| r.draining.swap_remove(i))
        };
        if let Some(d) = back {
            let msg = if d.device != device || d.mapped.size != size {
                Some(format!(
                    "a message names this process's allocation of {} bytes on cuda:{} as {size} bytes on cuda:{device}",
                    d.mapped.size, d.device
                ))
            } else if !is_write_end_of(&lease, &d.read) {
                // Kept as this process's hold and sent on as others' holds: it must be one.
                Some("a message names this process's allocation with a lease that is not its own".into())
            } else {
                None
            };
            if let Some(msg) = msg {
                registry().draining.push(d);
                return Err(Error::invalid(msg));
            }
            return Ok(Allocation {
                device,
                id,
                ptr: d.mapped.ptr,
                size: d.mapped.size,
                mem: Some(d.mapped.mem),
                state: Mutex::new(State {
                    export: d.export,
                    lease: Lease::Creator(Some(LeasePipe { read: d.read, write: Arc::new(lease) })),
                }),
            });
        }
        let mapped = b.import(device, &export, size)?;
        if mapped.size < size {
            b.release(device, mapped.mem);
            return Err(Error::invalid(format!(
                "a received allocation maps fewer bytes than the {size} claimed"
            )));
        }
        Ok(Allocation {
            device,
            id,
            ptr: mapped.ptr,
            size,
            mem: Some(mapped.mem),
            state: Mutex::new(State {
                export: b.keeps_exports().then_some(export),
                lease: Lease::Holder(Arc::new(lease)),
            }),
        })
    }

    /// Checks that `off..off + len` lies in the allocation and returns its device address.
    pub(crate) fn range(&self, off: usize, len: usize) -> Result<u64> {
        match off.checked_add(len) {
            Some(end) if end <= self.size => Ok(self.ptr + off as u64),
            _ => Err(Error::invalid_argument(
                "device range",
                format!("bytes {off}..{off}+{len} are outside an allocation of {} bytes", self.size),
            )),
        }
    }

    /// Copies `dst.len()` bytes at `off` to the host.
    pub(crate) fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.range(off, dst.len())?;
        // SAFETY: `range` checked that the bytes lie in this live allocation.
        unsafe { backend()?.dtoh(self.device, dst, src) }
    }

    /// Copies host bytes to `off`.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        let dst = self.range(off, src.len())?;
        // SAFETY: `range` checked that the bytes lie in this live allocation.
        unsafe { backend()?.htod(self.device, dst, src) }
    }

    /// Copies `len` bytes of a host storage at `src` to `off`, straight from the storage's
    /// pages (by DMA when they are pinned).
    ///
    /// # Safety
    /// `src..src + len` must lie in one host storage's bytes, live for the call.
    pub(crate) unsafe fn write_from_storage(&self, off: usize, src: *const u8, len: usize) -> Result<()> {
        let dst = self.range(off, len)?;
        // SAFETY: `range` checked that the device bytes lie in this live allocation; the
        // host range is the caller's contract.
        unsafe { backend()?.htod_from_storage(self.device, dst, src, len) }
    }

    /// Writes `count` copies of a 1-, 2- or 4-byte `pattern` at `off`.
    pub(crate) fn memset(&self, off: usize, pattern: &[u8], count: usize) -> Result<()> {
        let len = count.checked_mul(pattern.len()).ok_or_else(|| {
            Error::invalid_argument("memset length", format!("{count} values overflow usize"))
        })?;
        let dst = self.range(off, len)?;
        // SAFETY: `range` checked that the bytes lie in this live allocation.
        unsafe { backend()?.memset(self.device, dst, pattern, count) }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        // In a forked child the driver is unusable: leave the memory to the parent.
        let Ok(b) = backend() else { return };
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|p| p.into_inner()),
            State { export: None, lease: Lease::Creator(None) },
        );
        match state.lease {
            Lease::Holder(_) => b.release(self.device, mem), // the lease closes with `state`
            Lease::Creator(None) => {
                let mapped = Mapped { mem, ptr: self.ptr, size: self.size };
                let out = registry().retire(Free { device: self.device, mapped, export: state.export });
                release_all(b, out);
            }
            Lease::Creator(Some(LeasePipe { read, write })) => {
                drop(write);
                let mapped = Mapped { mem, ptr: self.ptr, size: self.size };
                if hung_up(&read) {
                    let out = registry().retire(Free { device: self.device, mapped, export: state.export });
                    release_all(b, out);
                } else {
                    registry().draining.push(Draining {
                        device: self.device,
                        id: self.id,
                        mapped,
                        read,
                        export: state.export,
                    });
                }
            }
        }
    }
}
