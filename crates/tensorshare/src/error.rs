//! The crate's one error type.

use std::io;

/// What went wrong. Variants are stable enough to match on; new ones may be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Shared memory could not be reserved: the filesystem or memory limit is reached.
    #[error(
        "out of shared memory: {requested} bytes requested, {available} bytes available in {place}; \
         free some shared tensors, raise the limit (e.g. `docker run --shm-size`), or use the \
         file_descriptor strategy, which is not bounded by /dev/shm"
    )]
    OutOfSharedMemory {
        /// Bytes the allocation asked for.
        requested: u64,
        /// Bytes the system reported as available at the time.
        available: u64,
        /// Where the memory was asked for (`memfd` or a directory such as `/dev/shm`).
        place: String,
    },
    /// A message received from another process is malformed or points outside its memory.
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// An operation waited longer than its timeout.
    #[error("timed out")]
    Timeout,
    /// Every peer that could send (or receive) is gone.
    #[error("disconnected: every peer of this channel is gone")]
    Disconnected,
    /// A tensor operation got arguments that do not fit the tensor.
    #[error("{0}")]
    Shape(String),
    /// The element type asked for is not the tensor's.
    #[error("dtype mismatch: the tensor holds {actual}, but {requested} was requested")]
    DTypeMismatch {
        /// The tensor's dtype.
        actual: crate::DType,
        /// The dtype the caller asked for.
        requested: crate::DType,
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
    // Upward, for a reason: the crate has one error type, and a worker's failure is one of
    // its cases.
    Process(#[from] crate::process::ProcessError),
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

    pub(crate) fn shape(msg: impl Into<String>) -> Self {
        Error::Shape(msg.into())
    }
}

impl From<postcard::Error> for Error {
    fn from(e: postcard::Error) -> Self {
        Error::InvalidMessage(format!("cannot decode: {e}"))
    }
}
