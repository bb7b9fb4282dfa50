//! What a failed send gives back: the value, and why (crossbeam-channel's `SendError<T>`).

use crate::Error;

/// A value that was not sent, given back with the reason: [`Error::Timeout`] (no room in
/// time), [`Error::Disconnected`] (nobody left to receive it), or another error (the value
/// could not be encoded, the system refused). Converts into [`Error`], so `?` works in a
/// function returning [`crate::Result`].
pub struct SendError<T> {
    value: T,
    error: Error,
}

impl<T> SendError<T> {
    pub(crate) fn new(value: T, error: Error) -> SendError<T> {
        SendError { value, error }
    }

    /// The value that was not sent.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// The value and the reason.
    pub fn into_parts(self) -> (T, Error) {
        (self.value, self.error)
    }

    /// Why the value was not sent.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// Whether there was no room before the deadline.
    pub fn is_timeout(&self) -> bool {
        matches!(self.error, Error::Timeout)
    }

    /// Whether nobody is left to receive.
    pub fn is_disconnected(&self) -> bool {
        matches!(self.error, Error::Disconnected)
    }
}

impl<T> std::fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendError").field("error", &self.error).finish_non_exhaustive()
    }
}

impl<T> std::fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (the value was not sent)", self.error)
    }
}

impl<T> std::error::Error for SendError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<SendError<T>> for Error {
    fn from(e: SendError<T>) -> Error {
        e.error
    }
}
