//! What a queue's outbox feeder does besides writing: waiting for a gate, waiting out the
//! kernel's cap on descriptors in flight, and what it tells later puts when it gives up.

use std::time::Duration;

use super::outbox::Gate;
use crate::Error;

/// Why a feeder gave up: every record put after is refused with it.
#[derive(Clone)]
pub(super) enum FeedError {
    /// No process that could read is left.
    Disconnected,
    /// The feeder could not start.
    NoThread,
    /// This process could not write a record (it could not spill it, or the system refused
    /// it): what was being done, and the OS error.
    Failed(String, Option<i32>),
}

impl FeedError {
    pub(super) fn failed(e: &Error) -> FeedError {
        match e {
            Error::Io { context, source } => FeedError::Failed(context.clone(), source.raw_os_error()),
            other => FeedError::Failed(other.to_string(), None),
        }
    }
}

/// The next wait before the feeder tries again a record the kernel refused with
/// `ETOOMANYREFS`, after waiting `last` (zero at first): 1 ms, doubling up to 50 ms.
///
/// The kernel caps the descriptors a user has in flight in Unix sockets at its
/// RLIMIT_NOFILE (unless it has CAP_SYS_RESOURCE): a record that carries descriptors is
/// refused while too many wait to be received, in any socket of the user, and goes once
/// readers have taken some. No readiness tells when, hence a timed wait. Only records that
/// may wait in the outbox wait for this; a direct send (a pipe, a worker's arguments, the put
/// of a forked child that has not adopted its queues) fails with the error instead, since its
/// reader may be the very process its sender is about to start.
pub(super) fn crowded_backoff(last: Duration) -> Duration {
    (last * 2).clamp(Duration::from_millis(1), Duration::from_millis(50))
}

/// Waits until `gate` (if any) opens; false if no reader is left meanwhile. The lane
/// messages it waits for are taken within microseconds by a consumer at work, so it looks
/// often at first, then less and less.
///
/// `abandoned`: the queue's last handle is gone with nobody left to read (asked each nap).
pub(super) fn wait_for(
    gate: Option<&Gate>,
    alive: &(dyn Fn() -> bool + Send + Sync),
    abandoned: &dyn Fn() -> bool,
) -> bool {
    let Some(gate) = gate else { return true };
    let mut nap = Duration::from_micros(20);
    let mut next_check = std::time::Instant::now() + Duration::from_millis(50);
    while !gate() {
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
        if abandoned() {
            return false;
        }
        if std::time::Instant::now() >= next_check {
            if !alive() {
                return false;
            }
            next_check = std::time::Instant::now() + Duration::from_millis(50);
        }
    }
    true
}
