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
//! machine-check error, one sent with `kill`) goes to the disposition that was there before.
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
//! freed (`registry`, each entry a seqlock over its fields) and a few atomics, and makes
//! only system calls (`fstat`, `mmap`, `gettid`, `sched_yield` through rustix;
//! `sigaction`, `pthread_sigmask`, `sigpending` and `raise` through libc, all
//! async-signal-safe).

mod registry;

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};

use registry::recover;
pub(crate) use registry::{register, Guard};

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

/// The thread (its tid) that is calling the previous handler, and how deep its stack was
/// then: ours entered again on that thread, deeper, means that handler called ours back,
/// and passing the signal on again would never end. Process-wide atomics rather than
/// thread-locals, whose first use in a library loaded with dlopen may allocate. Should two
/// threads chain at once, one overwrites the other, and that thread's loop is caught at its
/// next turn.
static CHAIN_TID: AtomicI32 = AtomicI32::new(0);
static CHAIN_SP: AtomicUsize = AtomicUsize::new(0);
/// The thread for which the previous handler left SIGBUS pending (raised it again, as
/// Python's faulthandler does, to be delivered once handlers return): if that signal comes
/// back to ours, the previous handler has had it once already.
static PASSED_TID: AtomicI32 = AtomicI32::new(0);

fn tid() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// An address in the current stack frame (the stack grows down on every Linux target).
#[inline(always)]
fn stack_depth() -> usize {
    let marker = 0u8;
    std::ptr::addr_of!(marker) as usize
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
    // one): it has had it, and passing it on again would go round for ever. Nested inside
    // that handler's call, ours runs deeper on the stack than `chain` did; a handler that
    // left with siglongjmp never returned to clear the mark, and a later signal runs higher.
    let me = tid();
    let looped = CHAIN_TID.load(Ordering::Acquire) == me && stack_depth() < CHAIN_SP.load(Ordering::Acquire);
    let passed = PASSED_TID.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok();
    if looped || (passed && !recurs(code)) {
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
    // SAFETY: an all-zero sigset_t is a valid (empty) set, filled in below.
    let mut saved: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: pthread_sigmask is async-signal-safe; `prev.sa_mask` is a valid signal set and
    // `saved` a set to fill.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &prev.sa_mask, &mut saved) };
    let me = tid();
    CHAIN_SP.store(stack_depth(), Ordering::Release);
    CHAIN_TID.store(me, Ordering::Release);
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
    let _ = CHAIN_TID.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Relaxed);
    // SAFETY: sigpending and pthread_sigmask are async-signal-safe; `pending` is a valid set
    // to fill, and `saved` the mask saved above.
    unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        // (A SIGBUS pending for the whole process, sent meanwhile, counts too: it then ends
        // the process as the default would if it reaches this thread's handler.)
        if libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, sig) == 1 {
            PASSED_TID.store(me, Ordering::Release);
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

/// Set to `0` to keep tensorshare from installing its SIGBUS handler when a process maps a
/// named segment (a program whose own signal handling must stay untouched: a runtime that
/// embeds it, a crash reporter). A cut named segment then ends a process that touches it,
/// as in torch. [`crate::segments::guard_sigbus`] still installs it on request.
pub const SIGBUS_HANDLER_ENV: &str = "TENSORSHARE_SIGBUS_HANDLER";

/// Whether the handler may be installed on its own (see [`SIGBUS_HANDLER_ENV`]).
fn wanted() -> bool {
    static WANTED: crate::util::Lazy<bool> = crate::util::Lazy::new();
    *WANTED.get_or_make(|| std::env::var(SIGBUS_HANDLER_ENV).map_or(true, |v| v.trim() != "0"))
}

/// Puts the handler in place, unless it already is.
///
/// The first time, over whatever is there (Rust's own handler, Python's faulthandler), which
/// becomes the one every other SIGBUS goes to. After that, on its own (`over_handler` false)
/// only where the disposition is no handler (default, or ignored: someone reset it): another
/// library's handler may have saved ours as its previous one and pass SIGBUS on to it, and
/// putting ours on top of it would make the two pass each signal back and forth.
/// `over_handler` is for a handler known not to pass it on (see `guard_sigbus`).
pub(crate) fn install(over_handler: bool) -> crate::Result<()> {
    install_io(over_handler)
        .map_err(|e| crate::Error::io("installing the SIGBUS handler for named segments", e))
}

fn install_io(over_handler: bool) -> std::io::Result<()> {
    if !over_handler && !wanted() {
        return Ok(());
    }
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
