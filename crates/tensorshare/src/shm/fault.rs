//! No SIGBUS from a named segment that another process cut short.
//!
//! A named (file_system) segment is a file that Linux cannot seal: any process that can open
//! it can truncate it, and the kernel then takes the cut pages out of every mapping, so that
//! the next access of one of them raises SIGBUS in whichever process touches it, creator or
//! receiver. A memfd is sealed against that; a named file cannot be.
//!
//! This module turns such a fault into zeros. Each mapped named segment is registered here
//! (its address range and its descriptor), and a SIGBUS handler that the first registration
//! installs looks up the faulting address. When it lies in a registered segment, the handler
//! asks the file its size and maps private zero pages, in place, over the part of the
//! segment from the cut (or from the faulting page, if that comes first) to its end; the
//! access is then retried and succeeds. From then on this process reads and writes its own
//! zeros there: what it sees is what a peer could have written, and no memory goes away.
//! Any other SIGBUS (another mapping, a machine-check error, one sent with `kill`) goes to
//! the handler that was installed before, or kills the process as it would have without
//! this one.
//!
//! The handler is async-signal-safe: it reads a lock-free list of entries that are never
//! freed (each entry a seqlock over its fields), and makes three system calls (`fstat`,
//! `mmap`, `sched_yield`) directly through rustix.

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::OnceLock;

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
    /// The process whose handler is replacing part of this mapping, 0 when none. A pid not
    /// this process's was left by a handler in the parent this process forked from, on a
    /// thread that does not exist here: it holds nothing.
    recovering: AtomicI32,
    next: AtomicPtr<Entry>,
}

static HEAD: AtomicPtr<Entry> = AtomicPtr::new(ptr::null_mut());
static PAGE: AtomicUsize = AtomicUsize::new(0);
/// The SIGBUS disposition before ours: where every fault that is not ours goes.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();

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
    install()?;
    let page = PAGE.load(Ordering::Relaxed);
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
        while self.entry.recovering.load(Ordering::Acquire) == pid() {
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
        recovering: AtomicI32::new(0),
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
fn find(addr: usize) -> Option<(&'static Entry, usize, usize, RawFd)> {
    let mut cur = HEAD.load(Ordering::Acquire);
    while !cur.is_null() {
        // SAFETY: as in `claim`, entries live for the rest of the process.
        let e: &'static Entry = unsafe { &*cur };
        // A writer is normal code on another thread (this thread faulted on a data access,
        // not inside `write`), so an odd sequence ends soon; give up on the entry after a
        // while all the same, never waiting without end inside a signal handler.
        for _ in 0..10_000 {
            let s1 = e.seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                rustix::thread::sched_yield();
                continue;
            }
            let (start, len, fd) = (
                e.start.load(Ordering::Relaxed),
                e.len.load(Ordering::Relaxed),
                e.fd.load(Ordering::Relaxed),
            );
            fence(Ordering::Acquire);
            if e.seq.load(Ordering::Relaxed) != s1 {
                continue;
            }
            if start != 0 && addr >= start && addr - start < len {
                return Some((e, start, len, fd));
            }
            break;
        }
        cur = e.next.load(Ordering::Acquire);
    }
    None
}

/// Replaces the cut part of the segment that holds `addr` with private zeros. False when
/// `addr` is in no registered segment or the replacement failed: the fault is not ours to
/// mend.
fn recover(addr: usize) -> bool {
    let Some((e, start, len, fd)) = find(addr) else { return false };
    let page = PAGE.load(Ordering::Relaxed);
    let me = pid();
    loop {
        let holder = e.recovering.load(Ordering::Relaxed);
        // 0, or a pid left by a forked-from parent: free. This process's pid: another of its
        // threads is replacing pages of this segment; wait for it.
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
                // this thread faults in it. Its pages are beyond the end of the file or the
                // one that faulted, so they hold nothing any more; private zero pages take
                // their place at the same addresses, and every reference into the range
                // stays valid.
                let r = unsafe {
                    rustix::mm::mmap_anonymous(
                        (start + from) as *mut c_void,
                        to - from,
                        ProtFlags::READ | ProtFlags::WRITE,
                        MapFlags::PRIVATE | MapFlags::FIXED,
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

fn pid() -> i32 {
    rustix::process::getpid().as_raw_nonzero().get()
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo to a handler installed with SA_SIGINFO.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Only a fault on an address (not a signal sent by a process, nor a hardware error) can
    // be a cut segment.
    if code == libc::BUS_ADRERR && recover(addr) {
        return;
    }
    chain(sig, info, ctx);
}

/// Hands a SIGBUS that is not ours to what was installed before, or restores the default
/// action so that the retried access, or the signal raised again, ends the process as it
/// would have without this handler.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let Some(prev) = PREVIOUS.get() else { return default(sig, info) };
    let h = prev.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        return default(sig, info);
    }
    if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: a handler installed with SA_SIGINFO has this signature; it is called as
        // the kernel would have called it, with the same arguments.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a handler installed without SA_SIGINFO has this signature.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
}

fn default(sig: libc::c_int, info: *mut libc::siginfo_t) {
    // SAFETY: a zeroed sigaction with SIG_DFL is a valid disposition; sigaction and raise are
    // async-signal-safe.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, ptr::null_mut());
        // A fault recurs when the access is retried; a signal that was sent does not.
        if (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

/// Installs the handler once per process (a forked child inherits it).
fn install() -> Result<()> {
    INSTALLED
        .get_or_init(|| {
            PAGE.store(rustix::param::page_size(), Ordering::Relaxed);
            // SAFETY: `act` is a complete sigaction for a handler with the SA_SIGINFO
            // signature; `old` receives the previous disposition, kept before the new
            // handler can run (it is published before `sigaction` returns, and a SIGBUS of
            // ours can only come from a segment registered after this).
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut act.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, ptr::null(), &mut old) != 0 {
                    return Err(format!("sigaction: {}", std::io::Error::last_os_error()));
                }
                let _ = PREVIOUS.set(old);
                if libc::sigaction(libc::SIGBUS, &act, ptr::null_mut()) != 0 {
                    return Err(format!("sigaction: {}", std::io::Error::last_os_error()));
                }
            }
            Ok(())
        })
        .clone()
        .map_err(|e| Error::io("installing the SIGBUS handler for named segments", std::io::Error::other(e)))
}
