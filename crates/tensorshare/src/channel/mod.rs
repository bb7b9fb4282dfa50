//! Channels between processes: [`Queue`], [`SimpleQueue`], [`pipe`] / [`Connection`], over
//! AF_UNIX SOCK_SEQPACKET sockets with descriptors passed alongside (SCM_RIGHTS).

#[cfg(feature = "mpi")]
mod any_queue;
mod awake;
mod control;
mod err;
mod fd;
mod feed;
mod forked;
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
/// queue). For a process that leaves by `_exit`, which drops nothing, after
/// [`adopt_forked_queues`].
pub fn flush_queues() {
    queue_core::flush_all();
}

/// Called in a child forked with queues in hand (a raw `fork`, Python's fork start method):
/// from now on its puts on those queues go through an outbox of this process's own, so that
/// `put` on an unbounded queue never waits here either, as in the process that made the
/// queue. In return the child calls [`flush_queues`] before it leaves by `_exit`, or what
/// still waits in its outbox is lost. Without the call, such a child writes each value
/// directly, waiting for room, and may leave right after a put (a child of this child has
/// not called it, whatever this one did). The Python package's processes call both.
pub fn adopt_forked_queues() {
    forked::adopt_forked();
}

/// Ends the current window of every idle lane of this process's queues, so that what those
/// windows hold is given back now rather than at the next quiet wait (see `lane`).
pub(crate) fn close_idle_lanes() {
    queue_core::close_idle_lanes();
}

/// At the start of every receive: what the last message borrowed is settled (its
/// descriptors closed, which makes room for this one's), and the receive is refused, before
/// it takes a message, when the descriptors kept for finishing one cannot be made whole
/// (see `shm::fd_reserve`).
fn ready_to_receive() -> crate::Result<()> {
    crate::arena::settle();
    crate::shm::fd_reserve::ready()
}
