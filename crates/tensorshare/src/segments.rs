//! Named shared-memory segments as files (the file_system strategy): where they live, how
//! much room is left, and the tools behind `tensorshare shm ls` and `tensorshare shm gc`.
//!
//! A named segment is called `tensorshare_<root>_<creator>_<random>` in [`shm_dir`], where
//! `<root>` is the pid of the process that founded its cleanup group: once every process of
//! the group is gone, its files are removed by the group's cleaner; [`gc`] removes the files
//! of groups that have no live process left, should a cleaner not have done it.

//!
//! Linux cannot seal a named file, so another process can truncate one under its readers.
//! The pages it cut off then read as zeros instead of raising SIGBUS, through a handler
//! that mapping a named segment installs (see the README's threat model); [`guard_sigbus`]
//! puts it back on top of a SIGBUS handler installed later.

pub use crate::shm::{available_bytes, gc, list, shm_dir, SegmentInfo, SHM_DIR_ENV};

/// Puts tensorshare's SIGBUS handler in place again, on top of whatever handler is
/// installed now, which it calls for every SIGBUS that is not a cut named segment.
///
/// Mapping a named segment installs the handler, and each later mapping checks that it is
/// still there. A program that installs a SIGBUS handler of its own after that, one that
/// does not pass the signal on, calls this once its handler is in place so that touching a
/// named segment another process cut short keeps reading zeros instead of ending the
/// process. (The Python package does it for torch's DataLoader workers.)
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) when `sigaction` fails.
pub fn guard_sigbus() -> crate::Result<()> {
    crate::shm::guard_sigbus()
}
