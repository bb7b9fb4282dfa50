//! [`SharedFd`]: any descriptor, carried inside a message (SCM_RIGHTS), for what the
//! library's own channels do not cover (a plain pipe, a file, an eventfd).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::wire::{self, FdSource};

/// A descriptor that travels in messages: the receiver gets its own descriptor for the
/// same open file. Clones share one descriptor in this process.
#[derive(Clone, Debug)]
pub struct SharedFd(Arc<OwnedFd>);

impl SharedFd {
    /// Wraps a descriptor.
    pub fn new(fd: OwnedFd) -> SharedFd {
        SharedFd(Arc::new(fd))
    }

    /// The descriptor, if this is its only handle in the process.
    pub fn into_owned(self) -> Result<OwnedFd, SharedFd> {
        Arc::try_unwrap(self.0).map_err(SharedFd)
    }
}

impl AsFd for SharedFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Serialize for SharedFd {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if !wire::encoding() {
            return Err(wire::ser_error("a descriptor can only travel inside a tensorshare message"));
        }
        wire::encode_fd(FdSource::Fd(self.0.clone())).map_err(wire::ser_error)?.serialize(s)
    }
}

impl<'de> Deserialize<'de> for SharedFd {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SharedFd, D::Error> {
        let i = u32::deserialize(d)?;
        Ok(SharedFd::new(wire::decode_fd(i).map_err(wire::de_error)?))
    }
}
