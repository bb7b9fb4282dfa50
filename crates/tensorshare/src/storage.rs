//! [`Storage`]: the reference-counted bytes under tensors, private (heap) or shared (a
//! block of an arena in shared memory).

use std::sync::Arc;

#[cfg(feature = "cuda")]
mod pinned;
mod private;
mod volatile;

use crate::arena::{self, Slot};
use crate::util::Lazy;
use crate::{get_sharing_strategy, Error, Result, SharingStrategy};
use private::{dangling, PrivateBuf};

/// Alignment of every storage's first byte.
pub const ALIGN: usize = 64;

/// Where shared bytes live.
#[derive(Debug)]
pub(crate) enum Shared {
    /// A zero-byte shared storage: nothing to map, valid under both strategies.
    Empty(SharingStrategy),
    /// A slot of an arena.
    Slot(Slot),
    /// A device allocation of its own.
    #[cfg(feature = "cuda")]
    // Sideways, for a reason: a CUDA allocation is the other kind of memory a storage can
    // stand on (`cuda` is a memory provider beside `shm`, behind its feature).
    Device(Box<crate::cuda::Allocation>),
}

pub(crate) struct Inner {
    len: usize,
    /// Present for storages born private. Kept after `share_memory` when other handles
    /// might still be reading it, and freed with the storage.
    private: Option<PrivateBuf>,
    /// The shared memory of a storage made in it (or received).
    born: Option<Shared>,
    /// The shared memory a private storage moved into (`share_memory`), published at once:
    /// a `OnceLock` would make a child forked while another thread sets it wait for good
    /// on its next `share_memory` (see `util::lazy`).
    moved: Lazy<Shared>,
    /// Whether the receive cache knows this storage (set on its first send).
    pub(crate) cached: std::sync::atomic::AtomicBool,
}

impl Inner {
    fn shared(&self) -> Option<&Shared> {
        self.born.as_ref().or_else(|| self.moved.get())
    }
}

// SAFETY: the raw pointers in `PrivateBuf` and the arena mapping are plain memory owned by
// this storage, not tied to any thread.
unsafe impl Send for Inner {}
// SAFETY: as above. Concurrent access to the bytes is governed as documented on `Storage`.
unsafe impl Sync for Inner {}

/// Reference-counted bytes, private to this process or shared with others.
///
/// Clones are handles to the same bytes. A shared storage is one block of a shared-memory
/// arena; every process that received it maps the same pages, and writes through any
/// handle, in any process, are seen through all of them.
///
/// # Memory given back
/// Dropping the last handle of a shared storage frees its slot at once in the process that
/// made it (another process that still holds it keeps it, through a lock the kernel drops
/// when that process lets go or dies). Arenas of small storages are kept for reuse; a large
/// storage's arena is kept only within bounds (1 GiB and 8 arenas in all, none larger than
/// 256 MiB, none idle past 5 s at the next allocation or free; a receiver keeps such arenas
/// mapped up to 512 MiB), so dropping a big tensor gives its memory back.
/// [`crate::trim_arenas`] lets go of everything free.
///
/// # Aliasing
/// Like torch, tensorshare lets many handles (clones, views, other processes) reach the
/// same bytes. The safe ways to read and write them (a tensor's `to_vec`, `fill`,
/// `copy_from_slice`, the atomic view [`crate::AtomicView`], [`Storage::to_bytes`]) are
/// free of data races whatever other handles do at the same time: they copy with atomic
/// word accesses, so the worst a concurrent writer causes is a mix of old and new values.
/// Zero-copy borrows of the bytes are `unsafe` (see [`crate::Tensor::as_slice`]). For
/// meaningful values the program still orders its accesses: a message on a queue orders
/// everything before `put` before everything after the matching `get`.
///
/// # Layout
/// A host storage's first byte is 64-byte aligned and its memory comes in whole 64-byte
/// chunks (a private buffer, or an arena slot), so the aligned 8-byte word around any of
/// its bytes lies in its own allocation or mapping. (A storage received in an arena whose
/// header a peer forged may be misaligned; tensors refuse to view it.)
#[derive(Clone)]
pub struct Storage {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage").field("len", &self.inner.len).field("shared", &self.inner.shared()).finish()
    }
}

impl Storage {
    /// A private, zeroed storage of `len` bytes.
    ///
    /// # Panics
    /// If the memory cannot be allocated (as `vec!`); [`Storage::try_new`] returns an error
    /// instead.
    pub fn new(len: usize) -> Storage {
        Storage::try_new(len).unwrap_or_else(|e| panic!("Storage::new({len}): {e}"))
    }

    /// A private, zeroed storage of `len` bytes, or an error if that much memory cannot be
    /// allocated.
    pub fn try_new(len: usize) -> Result<Storage> {
        Ok(Storage {
            inner: Arc::new(Inner {
                len,
                private: Some(PrivateBuf::zeroed(len)?),
                born: None,
                moved: Lazy::new(),
                cached: Default::default(),
            }),
        })
    }

    /// A shared storage of `len` bytes under the current strategy, zeroed.
    pub fn new_shared(len: usize) -> Result<Storage> {
        Ok(Storage::zeroed(Storage::empty_shared_with(len, get_sharing_strategy())?))
    }

    /// `s`, a storage just made (no other handle), with its bytes set to zero.
    fn zeroed(s: Storage) -> Storage {
        // SAFETY: `s` is fresh, so no other handle exists to read or write its bytes
        // meanwhile; `len` bytes are in bounds.
        unsafe { std::ptr::write_bytes(s.as_mut_ptr(), 0, s.len()) };
        s
    }

    /// [`Storage::new_shared`], or `None` where making it would wait for another thread (the
    /// allocator busy making an arena) or start a process (a `file_system` cleanup group's
    /// cleaner, the first time): for bindings that hold a lock other threads need, such as
    /// Python's GIL, and let go of it only to wait. Not part of the API.
    #[doc(hidden)]
    pub fn new_shared_now(len: usize) -> Result<Option<Storage>> {
        Ok(Storage::empty_shared_now(len)?.map(Storage::zeroed))
    }

    /// [`Storage::new_shared_now`] with unspecified contents, as
    /// [`Storage::empty_shared_with`]'s: for a caller that writes every byte next, or hands
    /// out uninitialised memory (Python's `empty_shared`), and need not pay for zeroing a
    /// large block. Not part of the API.
    #[doc(hidden)]
    pub fn empty_shared_now(len: usize) -> Result<Option<Storage>> {
        if len == 0 {
            return Storage::new_shared(0).map(Some);
        }
        let Some(slot) = arena::allocate_now(len, get_sharing_strategy())? else { return Ok(None) };
        Ok(Some(Storage::from_shared(len, Shared::Slot(slot))))
    }

    /// A shared storage of `len` bytes under `strategy`, with unspecified contents (zero,
    /// or what an earlier storage left in a reused block).
    pub fn empty_shared_with(len: usize, strategy: SharingStrategy) -> Result<Storage> {
        Ok(Storage::from_shared(len, alloc_shared(len, strategy)?))
    }

    pub(crate) fn from_shared(len: usize, shared: Shared) -> Storage {
        Storage {
            inner: Arc::new(Inner {
                len,
                private: None,
                born: Some(shared),
                moved: Lazy::new(),
                cached: Default::default(),
            }),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the storage has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Whether the bytes live in shared memory.
    pub fn is_shared(&self) -> bool {
        self.inner.shared().is_some()
    }

    /// The strategy of a shared storage (None for a private or a device storage).
    pub fn sharing_strategy(&self) -> Option<SharingStrategy> {
        match self.inner.shared()? {
            Shared::Empty(s) => Some(*s),
            Shared::Slot(b) => Some(if b.arena().segment().name().is_some() {
                SharingStrategy::FileSystem
            } else {
                SharingStrategy::FileDescriptor
            }),
            #[cfg(feature = "cuda")]
            Shared::Device(_) => None,
        }
    }

    /// Where the bytes are: the host, or the CUDA device of a device storage.
    pub fn device(&self) -> crate::Device {
        match self.inner.shared() {
            #[cfg(feature = "cuda")]
            Some(Shared::Device(a)) => crate::Device::Cuda(a.device),
            _ => crate::Device::Cpu,
        }
    }

    /// Moves the bytes into shared memory (one copy), for every handle of this storage.
    /// Does nothing if the storage is already shared.
    ///
    /// A write that another thread makes through a clone while the copy runs can be lost
    /// (it lands in the bytes left behind), as in torch: move a storage before handing
    /// clones to writers. (Atomic views find the bytes again at each operation, so theirs
    /// follow the move; only those made during the copy can be lost.)
    pub fn share_memory(&self) -> Result<()> {
        self.share_memory_with(get_sharing_strategy())
    }

    /// [`Storage::share_memory`] with an explicit strategy.
    pub fn share_memory_with(&self, strategy: SharingStrategy) -> Result<()> {
        if self.is_shared() {
            return Ok(());
        }
        let shared = alloc_shared(self.len(), strategy)?;
        if let Shared::Slot(b) = &shared {
            // SAFETY: the private buffer has len bytes and lives as long as self; the block
            // has at least len bytes. Both are storage memory (64-byte aligned, whole
            // chunks). Other handles may write the private bytes meanwhile: the copy is
            // atomic, word by word.
            unsafe { crate::atomic_bytes::copy(self.as_ptr(), b.as_mut_ptr(), self.len()) };
        }
        // Another thread may have shared it meanwhile; then ours is dropped and freed.
        let _ = self.inner.moved.set(shared);
        Ok(())
    }

    /// The address of the first byte, to read through. Stable for a shared storage; for a
    /// private one it changes once, when the storage is moved into shared memory. For a
    /// device storage, the device address: not for the host to read or write. Other
    /// handles and processes may write these bytes at any time (see the crate's memory
    /// model).
    pub fn as_ptr(&self) -> *const u8 {
        self.as_mut_ptr()
    }

    /// [`Storage::as_ptr`], to write through. Every handle reaches the same bytes, so this
    /// takes `&self`, as `UnsafeCell::get` does: what may be written when is the memory
    /// model's business, not the borrow's.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        match self.inner.shared() {
            Some(Shared::Slot(b)) => b.as_mut_ptr(),
            #[cfg(feature = "cuda")]
            Some(Shared::Device(a)) => a.ptr as *mut u8,
            Some(Shared::Empty(_)) => dangling().as_ptr(),
            None => match &self.inner.private {
                Some(p) => p.ptr.as_ptr(),
                None => dangling().as_ptr(),
            },
        }
    }

    /// The address of the first byte, as a number: equal for two handles exactly when they
    /// see the same memory (torch's `data_ptr`).
    pub fn data_ptr(&self) -> usize {
        self.as_ptr() as usize
    }

    /// Whether two handles are the same storage.
    pub fn ptr_eq(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// How many handles of this storage exist in this process: its clones, the tensors
    /// viewing it, and what holds one of those (an export to another library, a value being
    /// sent). A snapshot, which other threads may change at once; for diagnostics and tests
    /// ("did the other library let go?"), not for deciding who may touch the bytes.
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A copy of the bytes (for a device storage, copied from the device).
    ///
    /// # Panics
    /// If the copy from a device fails (a broken CUDA context); use
    /// [`Storage::try_to_bytes`] to get that as an error.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.try_to_bytes().unwrap_or_else(|e| panic!("Storage::to_bytes: {e}"))
    }

    /// A copy of the bytes; fails when a device storage cannot be copied, or when the copy
    /// cannot be allocated.
    pub fn try_to_bytes(&self) -> Result<Vec<u8>> {
        #[cfg(feature = "cuda")]
        if let Some(Shared::Device(a)) = self.inner.shared() {
            return crate::cuda::storage_bytes(a, self.len());
        }
        let mut out = Vec::new();
        out.try_reserve_exact(self.len()).map_err(|_| Error::AllocationFailed { bytes: self.len() })?;
        out.resize(self.len(), 0);
        // SAFETY: as_ptr points to the len host bytes of this storage (64-byte aligned,
        // whole chunks), which live as long as self. Other handles may write them meanwhile:
        // the copy is atomic, word by word.
        unsafe { crate::atomic_bytes::load(self.as_ptr(), &mut out) };
        Ok(out)
    }

    /// The file name of the named segment holding a file_system storage.
    pub fn segment_name(&self) -> Option<String> {
        match self.inner.shared()? {
            Shared::Slot(b) => b.arena().segment().name().map(str::to_owned),
            _ => None,
        }
    }

    pub(crate) fn shared(&self) -> Option<&Shared> {
        self.inner.shared()
    }

    pub(crate) fn from_inner(inner: Arc<Inner>) -> Storage {
        Storage { inner }
    }
}

fn alloc_shared(len: usize, strategy: SharingStrategy) -> Result<Shared> {
    if len == 0 {
        return Ok(Shared::Empty(strategy));
    }
    Ok(Shared::Slot(arena::allocate(len, strategy)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_storage_is_zeroed_and_aligned() {
        let s = Storage::new(100);
        assert_eq!(s.as_ptr() as usize % ALIGN, 0);
        assert!(s.to_bytes().iter().all(|b| *b == 0));
        assert!(!s.is_shared());
    }

    #[test]
    fn share_memory_keeps_bytes_and_is_seen_by_every_handle() {
        let s = Storage::new(10);
        // SAFETY: 10 bytes, one handle.
        unsafe { std::ptr::copy_nonoverlapping([1u8, 2, 3].as_ptr(), s.as_mut_ptr(), 3) };
        let other = s.clone();
        s.share_memory().unwrap();
        assert!(other.is_shared());
        assert_eq!(&other.to_bytes()[..4], &[1, 2, 3, 0]);
        assert_eq!(other.data_ptr(), s.data_ptr());
        assert_eq!(s.as_ptr() as usize % ALIGN, 0);
    }

    #[test]
    fn empty_storage_is_valid_under_both_strategies() {
        assert_eq!(Storage::new(0).as_ptr() as usize % ALIGN, 0, "aligned like any storage");
        for st in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
            let s = Storage::empty_shared_with(0, st).unwrap();
            assert_eq!(s.as_ptr() as usize % ALIGN, 0, "aligned like any storage");
            assert!(s.is_shared());
            assert_eq!(s.sharing_strategy(), Some(st));
            assert!(s.to_bytes().is_empty());
        }
    }
}
