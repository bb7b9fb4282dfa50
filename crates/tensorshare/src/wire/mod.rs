//! The codec: values into messages and back. It knows no sockets (see `channel` for how
//! messages travel).
//!
//! A message is bytes plus a table of descriptors. The bytes are `[u32 header length]
//! [header][payload]`, both postcard. The payload is the value itself, in which every
//! tensor and storage is a handle: an index into the header's table of storages, each a
//! slot of an arena in the header's table of segments, and each segment one descriptor of
//! the table. A message is self-contained: its sender may exit as soon as it is sent.
//!
//! Holds: the descriptor of each arena is the sender's send description, on which the
//! message's slots are locked (see `arena`), so the message holds them as long as the
//! descriptor lives; the receiver takes its own holds before it lets the message go, or,
//! receiving from a queue or a pipe, borrows the message's until it next receives or waits
//! (see `arena::borrow`). A
//! message can therefore only give up what it carried, and a replayed, duplicated or forged
//! message can only add holds. Everything read from a message is checked before use.

pub(crate) mod bytes;
mod cache;
mod decode;
mod encode;
mod header;
mod repr;

use std::cell::RefCell;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

pub(crate) use cache::release_cached_mappings;
pub(crate) use decode::{decode, decode_fd, decode_lane};
pub(crate) use encode::{encode, encode_fd, encode_for_lane};

/// Something whose descriptor a message carries; kept alive until the message is sent.
pub(crate) enum FdSource {
    Fd(Arc<OwnedFd>),
    Owned(OwnedFd),
}

impl FdSource {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            FdSource::Fd(f) => f.as_fd(),
            FdSource::Owned(f) => f.as_fd(),
        }
    }
}

thread_local! {
    static ENCODING: RefCell<encode::EncodeCtx> = RefCell::new(encode::EncodeCtx::default());
    static DECODING: RefCell<Option<decode::DecodeCtx>> = const { RefCell::new(None) };
    /// Why the value being encoded or decoded was refused: postcard keeps only that a custom
    /// error happened, so the first reason is kept here for the error the caller sees.
    static REASON: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// A serde error that keeps its reason (see `REASON`). The reason of an
/// `Error::InvalidMessage` is its text without its prefix, which the error the caller sees
/// adds again.
pub(crate) fn de_error<E: serde::de::Error>(msg: impl std::fmt::Display) -> E {
    let text = msg.to_string();
    let text = match text.strip_prefix("invalid message: ") {
        Some(rest) => rest.to_owned(),
        None => text,
    };
    note_reason(&text);
    E::custom(text)
}

/// A serde error that keeps its reason (see `REASON`).
pub(crate) fn ser_error<E: serde::ser::Error>(msg: impl std::fmt::Display) -> E {
    note_reason(&msg);
    E::custom(msg)
}

fn note_reason(msg: &dyn std::fmt::Display) {
    REASON.with(|r| {
        r.borrow_mut().get_or_insert_with(|| msg.to_string());
    });
}

/// The recorded reason, if any, else postcard's own text; and forgets it.
fn reason(e: postcard::Error) -> String {
    REASON.with(|r| r.borrow_mut().take()).unwrap_or_else(|| e.to_string())
}

fn forget_reason() {
    REASON.with(|r| r.borrow_mut().take());
}

/// A value turned into a message, not yet sent: its bytes and the descriptors that must
/// travel with them.
#[derive(Default)]
pub(crate) struct Encoded {
    /// The message's bytes (empty while `unframed` holds them; see [`Encoded::framed`]).
    pub(crate) bytes: Vec<u8>,
    pub(crate) fds: Vec<FdSource>,
    /// The same message in a queue lane's form, when asked for and it fits one.
    pub(crate) lane: Option<LaneForm>,
    /// A message with a lane form: its header and payload, framed into `bytes` only if the
    /// lane does not take it (most of the time it does, and the framing would be wasted).
    unframed: Option<(header::Header, Vec<u8>)>,
}

/// A message for a queue's lane (see `channel::lane`): its bytes name every arena by its
/// identity and carry no descriptor; what holds its slots is each arena's send
/// description (the same as in the descriptor form), which the lane parks.
pub(crate) struct LaneForm {
    pub(crate) bytes: Vec<u8>,
    pub(crate) arenas: Vec<LaneArena>,
}

/// An arena a lane message names: the send description its slots are locked on, that
/// description's tag (see `Arena::send_hold`), its identity and, for a named segment, its
/// name.
pub(crate) struct LaneArena {
    pub(crate) desc: Arc<OwnedFd>,
    pub(crate) tag: u64,
    pub(crate) id: crate::shm::FileId,
    pub(crate) name: Option<String>,
}

/// How a lane message's receiver reaches the arenas it names: those the queue's directory
/// has shown it (`known`), a descriptor of one from there (`fetch`, which checks that the
/// descriptor is that arena), and the send description parked there under a tag, whose
/// holds it borrows (`via`; None when it cannot have it, and it then locks the slots
/// itself).
pub(crate) trait LaneArenas {
    fn known(&self, id: crate::shm::FileId) -> bool;
    fn fetch(&self, id: crate::shm::FileId) -> crate::Result<OwnedFd>;
    fn via(&self, id: crate::shm::FileId, tag: u64) -> Option<Arc<OwnedFd>>;
}

impl Encoded {
    /// A message of `bytes` alone.
    pub(crate) fn bytes_only(bytes: Vec<u8>) -> Encoded {
        Encoded { bytes, fds: Vec::new(), lane: None, unframed: None }
    }

    /// The message with its bytes framed: what is sent through a socket.
    pub(crate) fn framed(mut self) -> crate::Result<Encoded> {
        if let Some((header, payload)) = self.unframed.take() {
            self.bytes = header::frame(&header, payload.len())?;
            self.bytes.extend_from_slice(&payload);
        }
        Ok(self)
    }

    /// The descriptors, in table order.
    pub(crate) fn borrowed_fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(FdSource::fd).collect()
    }
}

/// Whether a value is being encoded into a message on this thread (tensors then serialize
/// as handles, otherwise by value).
pub(crate) fn encoding() -> bool {
    // Borrowed for writing: the context is being written to (adding a storage or a
    // descriptor, which asks nothing of this), or the value is serialized already and the
    // message is being finished (see `encode`).
    ENCODING.with(|c| c.try_borrow().is_ok_and(|c| c.active))
}

pub(crate) use decode::decode_storage;
pub(crate) use encode::encode_storage;

/// `value` as plain bytes, by value: tensors carry their elements, and what only travels
/// with descriptors (queues, pipes) refuses to go. What `dist` sends between nodes.
#[cfg(feature = "mpi")]
pub(crate) fn to_value_bytes<T: serde::Serialize + ?Sized>(value: &T) -> crate::Result<Vec<u8>> {
    if encoding() {
        return Err(crate::Error::Serialize("a value serialized by value while encoding a message".into()));
    }
    forget_reason();
    postcard::to_allocvec(value).map_err(|e| crate::Error::Serialize(reason(e)))
}

/// Bytes made by [`to_value_bytes`] (in another process) back into a value, checked as a
/// message is: a tensor handle or a descriptor in them is an error.
#[cfg(feature = "mpi")]
pub(crate) fn from_value_bytes<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> crate::Result<T> {
    forget_reason();
    postcard::from_bytes(bytes)
        .map_err(|e| crate::Error::InvalidMessage(format!("cannot decode: {}", reason(e))))
}
