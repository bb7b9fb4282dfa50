//! The message header: the tables that the payload's handles index into.
//!
//! A message is `[u32 header length][header][payload]`, both postcard.

use serde::{Deserialize, Serialize};

use crate::{Error, Result, SharingStrategy};

#[derive(Serialize, Deserialize, Debug)]
pub(super) struct Header {
    /// Descriptors that ride with the message.
    pub(super) nfds: u32,
    pub(super) segments: Vec<SegmentDesc>,
    pub(super) storages: Vec<StorageDesc>,
}

/// An arena named by the message. Its descriptor is the sender's send description, with a
/// lock on every slot the message names (see `arena`): the message holds them until the
/// receiver has taken its own. The receiver identifies the arena by that descriptor alone.
#[derive(Serialize, Deserialize, Debug)]
pub(super) struct SegmentDesc {
    /// Index of the descriptor (0 and unused in a lane message).
    pub(super) fd: u32,
    /// For a named (file_system) segment, its file name; checked against the descriptor.
    pub(super) name: Option<String>,
    /// In a message that travels in a queue's lane, with no descriptor: the arena's
    /// identity (device, inode), which the receiver looks up among the arenas parked in
    /// that queue's directory (see `channel::lane`), and the tag of the send description
    /// parked there that holds the message's slots (0: none to borrow). None in every other
    /// message.
    pub(super) id: Option<(u64, u64, u64)>,
}

#[derive(Serialize, Deserialize, Debug)]
pub(super) enum StorageDesc {
    Empty(SharingStrategy),
    Slot {
        segment: u32,
        slot: u32,
        len: u64,
    },
    /// A CUDA storage: one device allocation (see `cuda`).
    Device(DeviceDesc),
}

/// A device allocation in a message. Its descriptors (the memory handle when it is one,
/// and a hold on the creator's lease) ride with the message.
#[derive(Serialize, Deserialize, Debug)]
pub(super) struct DeviceDesc {
    pub(super) device: u32,
    /// The creator's id of the allocation: the receive cache's key.
    pub(super) id: (u64, u64),
    /// Bytes of the allocation.
    pub(super) size: u64,
    /// Bytes of the storage in it.
    pub(super) len: u64,
    pub(super) memory: DeviceMemory,
    /// Index of the lease descriptor.
    pub(super) lease: u32,
    /// Handle of the event recorded on the sender's stream at send.
    pub(super) event: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize, Debug)]
pub(super) enum DeviceMemory {
    /// A descriptor (CUDA VMM POSIX-fd handle), by index.
    Fd(u32),
    /// A legacy 64-byte IPC memory handle.
    Ipc(Vec<u8>),
}

/// `[u32 length][header]`, with room for the payload to follow.
pub(super) fn frame(header: &Header, payload_len: usize) -> Result<Vec<u8>> {
    let mut head = Vec::with_capacity(64 + payload_len);
    head.extend_from_slice(&[0u8; 4]);
    let mut head = postcard::to_extend(header, head).map_err(|e| Error::Serialize(e.to_string()))?;
    let n =
        u32::try_from(head.len() - 4).map_err(|_| Error::Serialize("a message header over 4 GiB".into()))?;
    head[..4].copy_from_slice(&n.to_le_bytes());
    Ok(head)
}

/// Splits a message into its header and the offset of its payload.
pub(super) fn parse(message: &[u8]) -> Result<(Header, usize)> {
    let Some(len) = message.first_chunk::<4>() else {
        return Err(Error::invalid(format!("a message of {} bytes has no header", message.len())));
    };
    let n = u32::from_le_bytes(*len) as usize;
    let end = 4usize.checked_add(n).filter(|&e| e <= message.len()).ok_or_else(|| {
        Error::invalid(format!("the header claims {n} bytes, the message has {}", message.len()))
    })?;
    let header: Header = postcard::from_bytes(&message[4..end])
        .map_err(|e| Error::invalid(format!("the message header: {e}")))?;
    Ok((header, end))
}
