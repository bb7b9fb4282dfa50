//! Named shared-memory segments as files (the file_system strategy): where they live, how
//! much room is left, and the tools behind `tensorshare shm ls` and `tensorshare shm gc`.
//!
//! A named segment is called `tensorshare_<root>_<creator>_<random>` in [`shm_dir`], where
//! `<root>` names its cleanup group: the pid of the process that founded it (or a number
//! above any pid, when a live group of another pid namespace has that pid): once every
//! process of the group is gone, its files are removed by the group's cleaner; [`gc`], and
//! the founding of any later group, remove the files of groups that have no live process
//! left, should a cleaner not have done it.

//!
//! Linux cannot seal a named file, so another process can truncate one under its readers.
//! The pages it cut off then read as zeros instead of raising SIGBUS, through a handler
//! that mapping a named segment installs (see the README's threat model; set
//! [`SIGBUS_HANDLER_ENV`] to `0` to keep it out); [`guard_sigbus`] puts it back on top of a
//! SIGBUS handler installed later.

pub use crate::shm::{available_bytes, gc, list, shm_dir, SegmentInfo, SHM_DIR_ENV, SIGBUS_HANDLER_ENV};

/// Puts tensorshare's SIGBUS handler in place again, on top of whatever handler is
/// installed now, which it calls for every SIGBUS that is not a cut named segment.
///
/// Mapping the first named segment installs the handler. A SIGBUS handler installed after
/// that takes its place; one that calls the handler it found keeps named segments covered,
/// one that does not (torch's DataLoader workers install such a one) ends the process when
/// it touches a named segment another process cut short. Call this once such a handler is
/// in place. Not on top of a handler that passes SIGBUS on to tensorshare's: each would
/// pass the signal to the other, which tensorshare's handler stops by ending the process as
/// the default would. (The Python package calls this for torch's DataLoader workers.)
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) when `sigaction` fails.
pub fn guard_sigbus() -> crate::Result<()> {
    crate::shm::guard_sigbus()
}

/// The root of the cleanup group that a worker started now should join (pass it in the
/// worker's environment as `TENSORSHARE_SHM_GROUP`), founding one under the file_system
/// strategy if this process has none yet; `None` when this process uses no named segments.
/// For launchers of their own, such as the Python package's spawn and forkserver contexts:
/// tensorshare's own workers get it without asking.
#[doc(hidden)]
pub fn group_for_workers() -> crate::Result<Option<i32>> {
    crate::shm::group::for_workers()
}

/// Removes the names of the named segments this process made (their memory lives on in
/// whoever holds them: nobody opens one by name). For a process about to leave without
/// running its exit handlers, such as a Python child that ends in `os._exit`: tensorshare's
/// own workers do it themselves.
#[doc(hidden)]
pub fn unlink_own_names() {
    crate::arena::unlink_own_names()
}
