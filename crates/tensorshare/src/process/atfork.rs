//! Makes tensorshare's own locks safe across `fork`: the forking thread takes them all
//! before the fork and releases them after, in the parent and in the child, so the child
//! never finds one held by a thread that does not exist there.

use std::any::Any;
use std::cell::RefCell;

thread_local! {
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

extern "C" fn prepare() {
    // Each layer registered its own locks (see `util::fork`).
    let guards = crate::util::fork::take_all();
    HELD.with(|h| *h.borrow_mut() = guards);
}

extern "C" fn release() {
    HELD.with(|h| h.borrow_mut().clear());
}

/// Registers the handlers (once per process).
pub(crate) fn register() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain extern "C" functions that take and drop guards of
        // tensorshare's static mutexes on the forking thread.
        unsafe { libc::pthread_atfork(Some(prepare), Some(release), Some(release)) };
    });
}
