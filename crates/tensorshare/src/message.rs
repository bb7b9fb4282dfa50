//! [`Message`]: a value as the bytes and descriptors that carry it, for transports that are
//! not tensorshare's own channels.
//!
//! A queue, a pipe and a process argument already carry values; this is for the rest: a
//! foreign runtime's process launcher that passes descriptors itself (Python's
//! `multiprocessing` hands a child its descriptors through `pass_fds` or its fork server, and
//! the Python package uses this to send a queue to a child that way), or a socket of your
//! own. The bytes are the wire format described in the README's "Wire format"; the
//! descriptors must reach the receiver in the same order (SCM_RIGHTS, inheritance, a
//! `pidfd_getfd`), as descriptors for the same open files.
//!
//! A message is self-contained: the slots of shared memory it names are held through its own
//! descriptors, so its sender may exit, and a message that is never decoded gives them back
//! when its descriptors close. Decoding checks every handle, as receiving does: a replayed,
//! duplicated or forged message is an error or adds holds, never undefined behaviour.

use std::os::fd::OwnedFd;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// A value turned into bytes plus the descriptors that travel with them.
#[derive(Debug)]
pub struct Message {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Message {
    /// `value` as a message. Tensors become handles to shared memory (a private storage is
    /// moved into shared memory first, in place, as sending it on a queue would).
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Message> {
        let msg = crate::wire::encode(value)?;
        let fds = msg
            .borrowed_fds()
            .iter()
            .map(|f| f.try_clone_to_owned().map_err(|e| Error::io("dup a message's descriptor", e)))
            .collect::<Result<_>>()?;
        Ok(Message { bytes: msg.bytes, fds })
    }

    /// A message received by other means: its bytes and its descriptors, in order.
    pub fn from_parts(bytes: Vec<u8>, fds: Vec<OwnedFd>) -> Message {
        Message { bytes, fds }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The descriptors, in the order the bytes name them.
    pub fn fds(&self) -> &[OwnedFd] {
        &self.fds
    }

    /// The bytes and the descriptors.
    pub fn into_parts(self) -> (Vec<u8>, Vec<OwnedFd>) {
        (self.bytes, self.fds)
    }

    /// The value back, checked as a received message is ([`Error::InvalidMessage`] when it
    /// is malformed); this process takes its own holds on what it keeps.
    pub fn decode<T: DeserializeOwned>(self) -> Result<T> {
        crate::wire::decode(&self.bytes, self.fds, false)
    }
}
