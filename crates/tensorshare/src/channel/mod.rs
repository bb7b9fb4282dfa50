//! Channels between processes: [`Queue`], [`SimpleQueue`], [`pipe`] / [`Connection`], over
//! AF_UNIX SOCK_SEQPACKET sockets with descriptors passed alongside (SCM_RIGHTS).

#[cfg(feature = "mpi")]
mod any_queue;
mod awake;
mod control;
mod err;
mod fd;
mod feed;
mod frame;
mod lane;
mod outbox;
mod pipe;
mod queue;
mod queue_core;
mod queue_lane;
pub(crate) mod socket;

#[cfg(feature = "mpi")]
pub(crate) use any_queue::AnyQueue;
pub use err::SendError;
pub use fd::SharedFd;
pub(crate) use frame::Outgoing;
pub use frame::MAX_MESSAGE_ENV;
pub use pipe::{pipe, Connection};
pub use queue::{Queue, SimpleQueue};

/// In a forked worker, before its job: forgets the queues its parent had, whose sockets the
/// worker does not keep (see `process::fork`); a queue it receives is then its own.
pub(crate) fn forget_after_fork() {
    queue_core::forget_registry();
}

/// Waits until every value this process put on a queue is written out to it, while another
/// process could still read it (as dropping a queue's last handle in a process does for that
/// queue). A process that leaves by `_exit` drops nothing: a child of a raw `fork` that put
/// values on an inherited queue calls this first, or what waits in its outbox is lost
/// (Python's `multiprocessing` children do, through tensorshare's package).
pub fn flush_queues() {
    queue_core::flush_all();
}

/// Ends the current window of every idle lane of this process's queues, so that what those
/// windows hold is given back now rather than at the next quiet wait (see `lane`).
pub(crate) fn close_idle_lanes() {
    queue_core::close_idle_lanes();
}
