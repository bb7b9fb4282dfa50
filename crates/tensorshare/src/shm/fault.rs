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
//! zeros there, and no memory goes away under it. Any other SIGBUS (another mapping, a
//! machine-check error, one sent with `kill`) goes to the disposition that was there before,
//! as if this handler did not exist.
//!
//! A handler that another library installs later takes the place of this one. If it calls
//! the one it found with the same arguments, named segments stay covered. If it does not
//! (torch's DataLoader workers install such a one; Python's faulthandler reports the fault
//! and raises the signal again, which is no longer a fault), a cut segment ends the process.
//! A registration puts this handler back only where the disposition was reset to the
//! default: on top of a handler that passes signals to it, the two would pass each signal
//! back and forth. `guard_sigbus` puts it back on top of a handler known not to pass SIGBUS
//! on. Should two handlers pass a signal round all the same, the second time it reaches this
//! one ends the process as the default would.
//!
//! The handler is async-signal-safe: it reads a lock-free list of entries that are never
//! freed (each entry a seqlock over its fields), two thread-local flags (const-initialised,
//! no destructor: plain thread-local storage) and makes only system calls (`fstat`, `mmap`,
//! `getpid`, `sched_yield` through rustix; `sigaction`, `pthread_sigmask`, `sigpending` and
//! `raise` through libc, all async-signal-safe).

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicUsize, Ordering};

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
/// The SIGBUS disposition found when this handler was last put in place: where every signal
/// that is not ours goes. Each is leaked, so that a handler running while another
/// registration replaces it still reads a valid one; there is one per time some other code
/// took SIGBUS over.
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(ptr::null_mut());
/// A default disposition, made before the handler can run, for PREVIOUS to point at once a
/// handler installed with SA_RESETHAND has been called (the handler cannot allocate).
static DEFAULT: AtomicPtr<libc::sigaction> = AtomicPtr::new(ptr::null_mut());
/// Whether this process (or the one it was forked from) ever installed the handler: from
/// then on another handler may have saved ours as the one it passes SIGBUS on to.
static EVER: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set on a thread while it calls the previous handler: entering ours again then means
    /// that handler called ours back, and passing the signal on again would never end.
    static CHAINING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set when the previous handler left SIGBUS pending for this thread (raised it again,
    /// as Python's faulthandler does, to be delivered once handlers return): if that signal
    /// comes back to ours, the previous handler has had it once already.
    static PASSED_ON: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

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
    install(false).map_err(|e| Error::io("installing the SIGBUS handler for named segments", e))?;
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
    // The handler below ours passed the signal back to ours (it saved ours as its previous
    // one): it has had it, and passing it on again would go round for ever.
    if CHAINING.get() || (PASSED_ON.replace(false) && !recurs(code)) {
        return die(sig, code);
    }
    chain(sig, info, ctx);
}

/// Whether a SIGBUS with this code comes back when the handler returns: the faulting
/// access is retried. Any other (sent by a process, or an asynchronous machine-check
/// report) is delivered once.
fn recurs(code: libc::c_int) -> bool {
    matches!(code, libc::BUS_ADRALN | libc::BUS_ADRERR | libc::BUS_OBJERR | libc::BUS_MCEERR_AR)
}

/// Hands a SIGBUS that is not ours to the disposition that was there before, doing what the
/// kernel would have done with it.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo.
    let code = unsafe { (*info).si_code };
    let prev = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: a non-null PREVIOUS points at a leaked sigaction, valid for ever.
    let Some(prev) = (unsafe { prev.as_ref() }) else { return die(sig, code) };
    let h = prev.sa_sigaction;
    if h == libc::SIG_IGN && !recurs(code) {
        return; // ignored, as before
    }
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // The default ends the process; so does a fault while ignored (the kernel forces
        // the default on a fault it cannot deliver).
        return die(sig, code);
    }
    if prev.sa_flags & libc::SA_RESETHAND != 0 {
        // The kernel would have reset that disposition to the default before calling it:
        // so does the chain (ours stays in place).
        PREVIOUS.store(DEFAULT.load(Ordering::Relaxed), Ordering::Release);
    }
    // SAFETY: pthread_sigmask is async-signal-safe; `prev.sa_mask` is a valid signal set.
    let mut saved: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &prev.sa_mask, &mut saved) };
    CHAINING.set(true);
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
    CHAINING.set(false);
    // SAFETY: sigpending and pthread_sigmask are async-signal-safe; `pending` is a valid set
    // to fill, and `saved` the mask saved above.
    unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        if libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, sig) == 1 {
            PASSED_ON.set(true);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, ptr::null_mut());
    }
}

/// Ends the process with `sig` as the default action would: a fault recurs when the access
/// is retried, any other signal is raised again (blocked while this handler runs, it is
/// delivered when the handler returns).
fn die(sig: libc::c_int, code: libc::c_int) {
    // SAFETY: a zeroed sigaction with SIG_DFL is a valid disposition; sigaction and raise are
    // async-signal-safe.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, ptr::null_mut());
        if !recurs(code) {
            libc::raise(sig);
        }
    }
}

/// Puts the handler in place, unless it already is.
///
/// The first time, over whatever is there (Rust's own handler, Python's faulthandler), which
/// becomes the one every other SIGBUS goes to. After that, on its own (`over_handler` false)
/// only where the disposition is no handler (default, or ignored: someone reset it): another
/// library's handler may have saved ours as its previous one and pass SIGBUS on to it, and
/// putting ours on top of it would make the two pass each signal back and forth.
/// `over_handler` is for a handler known not to pass it on (see `guard_sigbus`).
pub(crate) fn install(over_handler: bool) -> std::io::Result<()> {
    let ours = on_sigbus as *const () as libc::sighandler_t;
    // SAFETY: a query of the current disposition into a zeroed sigaction.
    let current = unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, ptr::null(), &mut cur) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        cur
    };
    if current.sa_sigaction == ours {
        return Ok(());
    }
    let no_handler = current.sa_sigaction == libc::SIG_DFL || current.sa_sigaction == libc::SIG_IGN;
    if EVER.load(Ordering::Acquire) && !over_handler && !no_handler {
        return Ok(());
    }
    PAGE.store(rustix::param::page_size(), Ordering::Relaxed);
    if DEFAULT.load(Ordering::Acquire).is_null() {
        // SAFETY: all zeros is SIG_DFL with no flags and an empty mask.
        let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
        let _ = DEFAULT.compare_exchange(
            ptr::null_mut(),
            Box::leak(Box::new(dfl)),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
    // Published before ours can run, so that a signal that comes between the swap below and
    // the end of this function is passed to what was there.
    PREVIOUS.store(Box::leak(Box::new(current)), Ordering::Release);
    EVER.store(true, Ordering::Release);
    // SAFETY: `act` is a complete sigaction for a handler with the SA_SIGINFO signature;
    // `old` receives the disposition it replaces, in the same step.
    let old = unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = ours;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut act.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        old
    };
    // The disposition changed between the query and the swap (another thread, another
    // library): pass signals to what the swap replaced, unless that is ours, installed by
    // another thread meanwhile, which must never be its own previous.
    if old.sa_sigaction != current.sa_sigaction && old.sa_sigaction != ours {
        PREVIOUS.store(Box::leak(Box::new(old)), Ordering::Release);
    }
    Ok(())
}
