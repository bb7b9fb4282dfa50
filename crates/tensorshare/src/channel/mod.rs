//! Channels between processes: [`Queue`], [`SimpleQueue`], [`pipe`] / [`Connection`], over
//! AF_UNIX SOCK_SEQPACKET sockets with descriptors passed alongside (SCM_RIGHTS).

mod control;
mod err;
mod fd;
mod frame;
mod outbox;
mod pipe;
mod queue;
pub(crate) mod socket;

pub use err::SendError;
pub use fd::SharedFd;
pub use frame::MAX_MESSAGE_ENV;
pub use pipe::{pipe, Connection};
pub use queue::{Queue, SimpleQueue};

/// Holds the queue registry's lock (see `process::atfork`).
pub(crate) fn fork_guards(out: &mut Vec<Box<dyn std::any::Any>>) {
    queue::fork_guards(out);
}
