//! What a creator keeps of its device allocations once it no longer uses them: those that
//! other processes or messages still hold (*draining*, until their lease pipe hangs up),
//! and free ones kept for reuse by new CUDA tensors, within bounds. [`collect`] reclaims,
//! [`empty_cache`] gives the free ones back to the driver, [`memory_stats`] counts.

use std::os::fd::OwnedFd;
use std::sync::{Mutex, MutexGuard};

use rustix::event::{PollFd, PollFlags};

use super::alloc::AllocId;
use super::driver::{backend, Backend, Export, Mapped};

/// What the creator keeps of an allocation that it no longer uses but others still hold.
pub(super) struct Draining {
    pub(super) device: u32,
    pub(super) id: AllocId,
    pub(super) mapped: Mapped,
    pub(super) read: OwnedFd,
    pub(super) export: Option<Export>,
}

/// A free allocation kept for reuse: nothing in any process refers to it any more.
pub(super) struct Free {
    pub(super) device: u32,
    pub(super) mapped: Mapped,
    pub(super) export: Option<Export>,
}

/// Free allocations kept for reuse, in bytes, before the oldest are released.
const CACHE_BYTES: usize = 1 << 30;
/// ... and in number (each may keep a descriptor).
const CACHE_COUNT: usize = 256;

pub(super) struct Registry {
    /// Bytes of this process's allocations in use here or held elsewhere.
    pub(super) allocated: usize,
    pub(super) draining: Vec<Draining>,
    /// Oldest first.
    free: std::collections::VecDeque<Free>,
    free_bytes: usize,
}

pub(super) fn registry() -> MutexGuard<'static, Registry> {
    static R: Mutex<Registry> = Mutex::new(Registry {
        allocated: 0,
        draining: Vec::new(),
        free: std::collections::VecDeque::new(),
        free_bytes: 0,
    });
    crate::util::lock(&R)
}

impl Registry {
    /// An allocation nobody refers to any more: kept for reuse, and what the bounds push out
    /// returned for release.
    pub(super) fn retire(&mut self, f: Free) -> Vec<Free> {
        self.allocated = self.allocated.saturating_sub(f.mapped.size);
        self.free_bytes += f.mapped.size;
        self.free.push_back(f);
        let mut out = Vec::new();
        while self.free_bytes > CACHE_BYTES || self.free.len() > CACHE_COUNT {
            let Some(old) = self.free.pop_front() else { break };
            self.free_bytes -= old.mapped.size;
            out.push(old);
        }
        out
    }

    /// A free allocation on `device` that fits `len` without wasting more than half.
    pub(super) fn reuse(&mut self, device: u32, len: usize) -> Option<Free> {
        let fits = |f: &Free| {
            f.device == device
                && f.mapped.size >= len
                && (f.mapped.size / 2 <= len || f.mapped.size <= 2 << 20)
        };
        let i = self.free.iter().rposition(fits)?;
        let f = self.free.remove(i)?;
        self.free_bytes -= f.mapped.size;
        self.allocated += f.mapped.size;
        Some(f)
    }
}

pub(super) fn release_all(b: &Backend, out: Vec<Free>) {
    for f in out {
        b.release(f.device, f.mapped.mem);
    }
}

/// Reclaims the allocations this process made, no longer uses, and that no other process
/// or message holds any more (their holders dropped them, exited or were killed): they
/// join the cache of free allocations that new CUDA tensors reuse (see [`empty_cache`]).
/// Returns the bytes reclaimed. Runs on its own at every CUDA allocation.
pub fn collect() -> usize {
    match backend() {
        Ok(b) => collect_with(b),
        Err(_) => 0,
    }
}

pub(super) fn collect_with(b: &Backend) -> usize {
    let done: Vec<Draining> = {
        let mut r = registry();
        if r.draining.is_empty() {
            return 0;
        }
        let gone: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> =
                r.draining.iter().map(|d| PollFd::new(&d.read, PollFlags::IN)).collect();
            let ts = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
            if rustix::event::poll(&mut fds, Some(&ts)).unwrap_or(0) == 0 {
                return 0;
            }
            fds.iter().map(|f| f.revents().contains(PollFlags::HUP)).collect()
        };
        let all = std::mem::take(&mut r.draining);
        let (done, keep): (Vec<_>, Vec<_>) = all.into_iter().zip(gone).partition(|(_, g)| *g);
        r.draining = keep.into_iter().map(|(d, _)| d).collect();
        done.into_iter().map(|(d, _)| d).collect()
    };
    let mut reclaimed = 0;
    for d in done {
        reclaimed += d.mapped.size;
        let out = registry().retire(Free { device: d.device, mapped: d.mapped, export: d.export });
        release_all(b, out); // `d.read` closes here
    }
    reclaimed
}

/// Gives every free allocation kept for reuse back to the driver (torch's
/// `torch.cuda.empty_cache()`); returns the bytes released.
pub fn empty_cache() -> usize {
    let Ok(b) = backend() else { return 0 };
    collect_with(b);
    let out: Vec<Free> = {
        let mut r = registry();
        r.free_bytes = 0;
        r.free.drain(..).collect()
    };
    let n = out.iter().map(|f| f.mapped.size).sum();
    release_all(b, out);
    n
}

/// Memory of this process's device allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Bytes allocated by this process and not yet freed.
    pub allocated: usize,
    /// Of those, bytes this process no longer uses but keeps for other holders.
    pub held_for_others: usize,
    /// Allocations kept for other holders.
    pub held_allocations: usize,
    /// Bytes of free allocations kept for reuse (not counted in `allocated`).
    pub cached: usize,
}

/// This process's device memory, as [`collect`] last left it.
pub fn memory_stats() -> MemoryStats {
    let r = registry();
    MemoryStats {
        allocated: r.allocated,
        held_for_others: r.draining.iter().map(|d| d.mapped.size).sum(),
        held_allocations: r.draining.len(),
        cached: r.free_bytes,
    }
}
