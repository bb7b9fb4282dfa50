//! The crate's one error type, and what it carries of a worker's failure.
//!
//! The lowest layer but `util`: every module returns [`Error`], so it imports nothing of
//! theirs. A worker's failure ([`ProcessError`]) is plain data defined here, next to the
//! enum that has it as a case, and the process layer fills it in.

#[cfg(feature = "mpi")]
pub(crate) mod dist;
pub(crate) mod process;

use std::io;
use std::sync::Arc;

// layering: an error names the dtypes it is about (DTypeMismatch, InvalidValue); DType is
// plain data whose one import is this type, for the error of a name that is no dtype.
use crate::DType;

#[cfg(feature = "mpi")]
pub use dist::DistError;
pub use process::{Failure, ProcessError};

/// What went wrong. Variants are stable enough to match on; new ones may be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Shared memory could not be reserved: the filesystem or memory limit is reached.
    #[error(
        "out of shared memory: {requested} bytes requested, {available} bytes available in {place}; \
         free some shared tensors (and the arenas other processes keep for reuse: `trim_arenas()` \
         there), raise the limit (e.g. `docker run --shm-size`), or use the file_descriptor \
         strategy, which is not bounded by /dev/shm"
    )]
    OutOfSharedMemory {
        /// Bytes the allocation asked for.
        requested: u64,
        /// Bytes the system reported as available at the time.
        available: u64,
        /// Where the memory was asked for (`memfd` or a directory such as `/dev/shm`).
        place: String,
    },
    /// Bytes or descriptors received from another process are malformed or point outside
    /// their memory (a peer's message, a worker's report, a received descriptor). Only
    /// what comes from a peer is reported as this.
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// An operation waited longer than its timeout.
    #[error("timed out")]
    Timeout,
    /// Every peer that could send (or receive) is gone.
    #[error("disconnected: every peer of this channel is gone")]
    Disconnected,
    /// A tensor operation got a shape, dimension, index or geometry that does not fit.
    #[error("{op}: {reason}")]
    Shape {
        /// The operation (`narrow`, `reshape`, `SparseTensor::coo`, ...).
        op: &'static str,
        /// The shape of the tensor the operation was given, or asked to make.
        shape: Vec<usize>,
        /// What does not fit.
        reason: String,
    },
    /// An argument that is wrong whatever the tensors: a pool of no workers, a queue
    /// capacity out of range, a size beyond what any allocation can hold.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// The argument (`worker count`, `queue capacity`, `storage size`, ...).
        what: &'static str,
        /// Why it is wrong.
        reason: String,
    },
    /// A tensor's bytes are not valid values of its dtype: a `bool` byte other than 0 or
    /// 1, written through another handle (of another dtype) or by another process.
    #[error("the tensor's bytes are not valid {dtype} values: {reason}")]
    InvalidValue {
        /// The dtype the bytes were read as.
        dtype: DType,
        /// What is wrong with them.
        reason: String,
    },
    /// The element type asked for is not the tensor's.
    #[error("dtype mismatch: the tensor holds {actual}, but {requested} was requested")]
    DTypeMismatch {
        /// The tensor's dtype.
        actual: DType,
        /// The dtype the caller asked for.
        requested: DType,
    },
    /// The operation needs a contiguous tensor; call `.contiguous()` first.
    #[error("the tensor is not contiguous (shape {shape:?}, strides {strides:?}); call .contiguous() first")]
    NotContiguous {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The tensor's strides, in elements.
        strides: Vec<usize>,
    },
    /// The operation is not available on this device (meta tensors have no data).
    #[error("{0}")]
    Device(String),
    /// Host memory for a tensor or a copy could not be allocated.
    #[error("cannot allocate {bytes} bytes of host memory")]
    AllocationFailed {
        /// Bytes the allocation asked for.
        bytes: usize,
    },
    /// A safe zero-copy borrow needs a tensor that nothing else can reach, and this one can
    /// be reached through other handles or processes.
    #[error(
        "the tensor's storage can be reached through {0}, so it cannot be borrowed safely; \
         copy with to_vec/copy_from_slice/fill, or use the unsafe as_slice/as_mut_slice and \
         uphold their contract"
    )]
    NotExclusive(&'static str),
    /// The platform lacks what the operation needs.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A value could not be parsed (a dtype or strategy name, ...).
    #[error("{0}")]
    Parse(String),
    /// Serialization of a value failed.
    #[error("serialization failed: {0}")]
    Serialize(String),
    /// A worker process failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// A distributed operation failed (`tensorshare::dist`, feature `mpi`).
    #[cfg(feature = "mpi")]
    #[error(transparent)]
    Dist(#[from] DistError),
    /// One task of a [`Pool`](crate::Pool) call failed without running: its item or its
    /// function could not be sent to a worker, or its result could not be read back.
    /// The tasks of one chunk share the cause.
    #[error("task {index}: {source}")]
    Task {
        /// The item's index among the items of its call (0 for `apply_async`).
        index: usize,
        /// Why.
        #[source]
        source: Arc<Error>,
    },
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: impl Into<io::Error>) -> Self {
        Error::Io { context: context.into(), source: source.into() }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidMessage(msg.into())
    }

    pub(crate) fn shape(op: &'static str, shape: &[usize], reason: impl Into<String>) -> Self {
        Error::Shape { op, shape: shape.to_vec(), reason: reason.into() }
    }

    pub(crate) fn invalid_argument(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { what, reason: reason.into() }
    }
}

impl From<postcard::Error> for Error {
    fn from(e: postcard::Error) -> Self {
        Error::InvalidMessage(format!("cannot decode: {e}"))
    }
}
