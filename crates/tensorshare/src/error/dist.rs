//! [`DistError`]: how a distributed operation (`tensorshare::dist`, feature `mpi`) failed.
//!
//! Plain data: the `dist` layer fills it in, and [`Error`](crate::Error) carries it.

/// Why a distributed operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// This process cannot use `dist` now: `dist::init` was not called, its session ended,
    /// this is another thread than the one that called it, or this process is no MPI rank
    /// (a tensorshare worker, a fork). The text says which, and what to do.
    #[error("tensorshare::dist is not initialised here: {0}")]
    NotInitialized(String),
    /// A rank of this node went away while this one waited on it or sent to it: its process
    /// exited or was killed, or it left the process group after a failure of its own. The
    /// process group is unusable afterwards: every later call returns this error again.
    #[error("rank {rank} (pid {pid} on node {node}, {host}) is gone during {during}: it exited, was killed, or left the process group after a failure")]
    RankGone {
        /// The rank that went away.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// Its node's index.
        node: usize,
        /// Its node's host name.
        host: String,
        /// The operation that noticed it (`all_reduce`, `recv from rank 2`, ...).
        during: String,
    },
    /// The ranks did not call the same collective with the same arguments: another
    /// operation, root, dtype or shape. Every rank gets this error and the process group
    /// stays usable.
    #[error("{op}: rank {rank} called {theirs}, but rank {other} called {ours}")]
    Mismatch {
        /// The collective this rank called, as in `all_reduce (sum)`.
        op: String,
        /// A rank whose call differs.
        rank: usize,
        /// What that rank called (`all_reduce (sum) of an f64 tensor of shape [4, 4]`).
        theirs: String,
        /// A rank it differs from.
        other: usize,
        /// What that rank called.
        ours: String,
    },
    /// A rank could not take part in a collective (its tensor is on another device, its
    /// dtype cannot be reduced, its shared memory ran out, ...). Every rank gets this error
    /// and the process group stays usable.
    #[error("{op}: rank {rank} could not take part: {reason}")]
    Refused {
        /// The collective.
        op: String,
        /// The rank that could not take part.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// A message between ranks was malformed, or a step of a collective failed after the
    /// ranks had agreed on it; this rank left the process group, so that its peers get an
    /// error instead of waiting for it.
    #[error("{0}")]
    Broken(String),
}
