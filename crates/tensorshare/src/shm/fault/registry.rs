//! The registered named segments: a lock-free list of entries, never freed, that the SIGBUS
//! handler reads (see the parent module), and the replacement of a cut segment's pages.

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;
use std::sync::atomic::{
    fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};

use rustix::mm::{MapFlags, ProtFlags};

use crate::{Error, Result};

/// One registered segment. Entries are leaked and reused, never freed, so that the handler
/// can walk the list at any moment.
struct Entry {
    /// Taken by the registration that fills the entry (its only writer).
    used: AtomicBool,
    /// Even when the fields below are consistent; odd while their writer changes them.
    seq: AtomicU32,
    /// First byte of the mapping; 0 when the entry names no segment.
    start: AtomicUsize,
    /// Length of the mapping in bytes, rounded up to whole pages.
    len: AtomicUsize,
    /// The segment's descriptor, open as long as the mapping.
    fd: AtomicI32,
    /// Offset from which the mapping is already private zeros (`len` while it is all file).
    /// Only lowered, by one handler at a time (`recovering`), so no page is replaced twice.
    zeros_from: AtomicUsize,
    /// The process whose handler is replacing part of this mapping (its `fork::stamp`), 0
    /// when none. A stamp not this process's was left by a handler in an ancestor this
    /// process was forked from, on a thread that does not exist here: it holds nothing.
    recovering: AtomicU64,
    next: AtomicPtr<Entry>,
}

static HEAD: AtomicPtr<Entry> = AtomicPtr::new(ptr::null_mut());
/// The page size, set by the first registration (before any entry can be found).
static PAGE: AtomicUsize = AtomicUsize::new(0);
/// A registered segment: unregistered when dropped, which must happen before the mapping is
/// unmapped.
pub(crate) struct Guard {
    entry: &'static Entry,
}

/// Registers the mapping `start..start + len` of the named segment open as `fd`, installing
/// the handler the first time.
///
/// The caller keeps `fd` open and the range mapped until the returned guard is dropped.
pub(crate) fn register(start: *const u8, len: usize, fd: BorrowedFd<'_>) -> Result<Guard> {
    super::install(false)?;
    // Set here, not when the handler is installed: segments are registered even where it is
    // not (see `SIGBUS_HANDLER_ENV`), so that `guard_sigbus` covers them later.
    let page = rustix::param::page_size();
    PAGE.store(page, Ordering::Relaxed);
    let len =
        len.checked_next_multiple_of(page).ok_or_else(|| Error::invalid("a segment length overflows"))?;
    let entry = claim();
    write(entry, start as usize, len, rustix::fd::AsRawFd::as_raw_fd(&fd));
    Ok(Guard { entry })
}

impl Drop for Guard {
    fn drop(&mut self) {
        // A handler may be finishing a replacement in this range on another thread only if
        // that thread was touching the segment, which it cannot do once the segment is
        // dropped; wait all the same, so that the entry never changes under a handler.
        while self.entry.recovering.load(Ordering::Acquire) == crate::util::fork::stamp() {
            rustix::thread::sched_yield();
        }
        write(self.entry, 0, 0, -1);
        self.entry.used.store(false, Ordering::Release);
    }
}

/// A free entry, taken for this registration: a reused one or a new one pushed on the list.
fn claim() -> &'static Entry {
    let mut cur = HEAD.load(Ordering::Acquire);
    while !cur.is_null() {
        // SAFETY: entries are leaked (`Box::leak` below) and never freed, so every pointer on
        // the list stays valid for the rest of the process.
        let e: &'static Entry = unsafe { &*cur };
        if e.used.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            return e;
        }
        cur = e.next.load(Ordering::Acquire);
    }
    let e: &'static Entry = Box::leak(Box::new(Entry {
        used: AtomicBool::new(true),
        seq: AtomicU32::new(0),
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        fd: AtomicI32::new(-1),
        zeros_from: AtomicUsize::new(0),
        recovering: AtomicU64::new(0),
        next: AtomicPtr::new(ptr::null_mut()),
    }));
    let mut head = HEAD.load(Ordering::Acquire);
    loop {
        e.next.store(head, Ordering::Relaxed);
        match HEAD.compare_exchange_weak(
            head,
            ptr::from_ref(e).cast_mut(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return e,
            Err(h) => head = h,
        }
    }
}

/// Sets an entry's fields as one step for readers (the seqlock's writer side). Only the
/// registration that claimed the entry writes it.
fn write(e: &Entry, start: usize, len: usize, fd: RawFd) {
    e.seq.fetch_add(1, Ordering::Relaxed);
    fence(Ordering::Release);
    e.start.store(start, Ordering::Relaxed);
    e.len.store(len, Ordering::Relaxed);
    e.fd.store(fd, Ordering::Relaxed);
    e.zeros_from.store(len, Ordering::Relaxed);
    e.seq.fetch_add(1, Ordering::Release);
}

/// The entry whose range holds `addr`, with its start, length and descriptor, read
/// consistently.
///
/// An entry whose fields are being written (an odd sequence, or one that moved during the
/// read) is skipped: it is being registered or unregistered, so its segment is not yet handed
/// out or already dropped, and no access can be faulting in it. So the handler never waits
/// for a writer, not even for one a fork left behind in the middle of `write`.
fn find(addr: usize) -> Option<(&'static Entry, usize, usize, RawFd)> {
    let mut cur = HEAD.load(Ordering::Acquire);
    while !cur.is_null() {
        // SAFETY: as in `claim`, entries live for the rest of the process.
        let e: &'static Entry = unsafe { &*cur };
        let s1 = e.seq.load(Ordering::Acquire);
        if s1 % 2 == 0 {
            let (start, len, fd) = (
                e.start.load(Ordering::Relaxed),
                e.len.load(Ordering::Relaxed),
                e.fd.load(Ordering::Relaxed),
            );
            fence(Ordering::Acquire);
            if e.seq.load(Ordering::Relaxed) == s1 && start != 0 && addr >= start && addr - start < len {
                return Some((e, start, len, fd));
            }
        }
        cur = e.next.load(Ordering::Acquire);
    }
    None
}

/// Replaces the cut part of the segment that holds `addr` with private zeros. False when
/// `addr` is in no registered segment or the replacement failed: the fault is not ours to
/// mend.
pub(super) fn recover(addr: usize) -> bool {
    let Some((e, start, len, fd)) = find(addr) else { return false };
    let page = PAGE.load(Ordering::Relaxed);
    let me = crate::util::fork::stamp();
    loop {
        let holder = e.recovering.load(Ordering::Relaxed);
        // 0, or a stamp left by a forked-from ancestor: free. This process's stamp: another
        // of its threads is replacing pages of this segment; wait for it.
        if holder != me
            && e.recovering.compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed).is_ok()
        {
            break;
        }
        rustix::thread::sched_yield();
    }
    // SAFETY: `fd` is the descriptor of the segment that holds `addr`; the segment keeps it
    // open as long as it is registered, and it is registered (and cannot be dropped) while
    // this thread, which faulted on an access to it, is inside the access.
    let size = rustix::fs::fstat(unsafe { BorrowedFd::borrow_raw(fd) }).map(|st| st.st_size);
    let done = match size {
        Ok(size) => {
            let cut = usize::try_from(size).unwrap_or(0).checked_next_multiple_of(page).unwrap_or(len);
            let fault = (addr - start) / page * page;
            let from = cut.min(fault);
            let to = e.zeros_from.load(Ordering::Relaxed);
            if from < to {
                // SAFETY: `start + from .. start + to` lies inside this process's mapping of
                // the segment (`from < to <= len`, page-aligned), which nothing unmaps while
                // this thread faults in it, and which holds only bytes other processes may
                // write: no Rust object of this process relies on their values. Private zero
                // pages take the place of its pages at the same addresses, so every pointer
                // into the range stays valid. Those pages are cut off the file, or (when the
                // fault came before the end of the file: the file was grown again, or a hole
                // could not be filled) they still hold the file's bytes, which this process
                // stops seeing: as if a peer had written zeros there.
                let r = unsafe {
                    rustix::mm::mmap_anonymous(
                        (start + from) as *mut c_void,
                        to - from,
                        ProtFlags::READ | ProtFlags::WRITE,
                        MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
                    )
                };
                if r.is_ok() {
                    e.zeros_from.store(from, Ordering::Relaxed);
                }
                r.is_ok()
            } else {
                // Another thread replaced this page since the fault: retry the access.
                true
            }
        }
        Err(_) => false,
    };
    e.recovering.store(0, Ordering::Release);
    done
}
