//! The message header: the tables that the payload's handles index into.
//!
//! A message is `[u32 header length][header][payload]`, both postcard.

use serde::de::{DeserializeSeed, Deserializer, Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, SharingStrategy};

#[derive(Serialize, Deserialize, Debug, Default)]
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
#[cfg(test)]
pub(super) fn parse(message: &[u8]) -> Result<(Header, usize)> {
    let mut header = Header::default();
    let end = parse_into(message, &mut header)?;
    Ok((header, end))
}

/// Reads a message's header into `into`, whose lists keep their room (a receiver reuses one
/// header from message to message), and returns the offset of the payload. Reads what a
/// `Header` deserialized by postcard reads, and refuses what it refuses.
pub(super) fn parse_into(message: &[u8], into: &mut Header) -> Result<usize> {
    let Some(len) = message.first_chunk::<4>() else {
        return Err(Error::invalid(format!("a message of {} bytes has no header", message.len())));
    };
    let n = u32::from_le_bytes(*len) as usize;
    let end = 4usize.checked_add(n).filter(|&e| e <= message.len()).ok_or_else(|| {
        Error::invalid(format!(
            "the header claims {n} bytes after its 4-byte length, more than the {} left in the message",
            message.len() - 4
        ))
    })?;
    let mut de = postcard::Deserializer::from_bytes(&message[4..end]);
    HeaderInto(into).deserialize(&mut de).map_err(|e| Error::invalid(format!("the message header: {e}")))?;
    Ok(end)
}

/// Deserializes a `Header` (a struct of three fields, in order) into an existing one.
struct HeaderInto<'a>(&'a mut Header);

const FIELDS: &[&str] = &["nfds", "segments", "storages"];

impl<'de> DeserializeSeed<'de> for HeaderInto<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_struct("Header", FIELDS, self)
    }
}

impl<'de> Visitor<'de> for HeaderInto<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("struct Header")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let missing = |i| A::Error::invalid_length(i, &"struct Header with 3 elements");
        let h = self.0;
        h.nfds = seq.next_element()?.ok_or_else(|| missing(0))?;
        seq.next_element_seed(ListInto(&mut h.segments))?.ok_or_else(|| missing(1))?;
        seq.next_element_seed(ListInto(&mut h.storages))?.ok_or_else(|| missing(2))?;
        Ok(())
    }
}

/// Deserializes a sequence into an existing `Vec`, emptied first.
struct ListInto<'a, T>(&'a mut Vec<T>);

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for ListInto<'_, T> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for ListInto<'_, T> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        self.0.clear();
        // No room is made ahead from the length a peer claims: each element read takes at
        // least a byte of the message.
        while let Some(x) = seq.next_element()? {
            self.0.push(x);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn strategy() -> impl Strategy<Value = SharingStrategy> {
        prop_oneof![Just(SharingStrategy::FileDescriptor), Just(SharingStrategy::FileSystem)]
    }

    fn header() -> impl Strategy<Value = Header> {
        let segment =
            (any::<u32>(), proptest::option::of("[a-z_0-9]{0,12}"), any::<Option<(u64, u64, u64)>>())
                .prop_map(|(fd, name, id)| SegmentDesc { fd, name, id });
        let storage =
            prop_oneof![
                strategy().prop_map(StorageDesc::Empty),
                (any::<u32>(), any::<u32>(), any::<u64>())
                    .prop_map(|(segment, slot, len)| StorageDesc::Slot { segment, slot, len }),
            ];
        (any::<u32>(), proptest::collection::vec(segment, 0..4), proptest::collection::vec(storage, 0..6))
            .prop_map(|(nfds, segments, storages)| Header { nfds, segments, storages })
    }

    /// A message whose header is `bytes` (and no payload).
    fn framed(bytes: &[u8]) -> Vec<u8> {
        let mut m = (bytes.len() as u32).to_le_bytes().to_vec();
        m.extend_from_slice(bytes);
        m
    }

    /// `bytes` as a header read into `into`: refused exactly when postcard's own `Header`
    /// refuses them, else the header postcard reads.
    fn read_as_postcard_does(bytes: &[u8], mut into: Header) -> Result<(), TestCaseError> {
        let theirs = postcard::from_bytes::<Header>(bytes);
        let ours = parse_into(&framed(bytes), &mut into);
        match theirs {
            Ok(h) => {
                prop_assert!(ours.is_ok(), "postcard reads {:?}, refused: {:?}", h, ours);
                prop_assert_eq!(format!("{into:?}"), format!("{h:?}"));
            }
            Err(e) => prop_assert!(ours.is_err(), "postcard refuses ({e}), read as {into:?}"),
        }
        Ok(())
    }

    proptest! {
        /// What postcard's own `Header` reads, read into a header that held another.
        #[test]
        fn a_header_read_into_a_used_one_is_what_postcard_reads(h in header(), old in header()) {
            let bytes = postcard::to_allocvec(&h).unwrap();
            let mut into = old;
            prop_assert_eq!(parse_into(&framed(&bytes), &mut into).unwrap(), 4 + bytes.len());
            prop_assert_eq!(format!("{into:?}"), format!("{h:?}"));
        }

        /// Any bytes: refused exactly when postcard refuses them, else the same header.
        #[test]
        fn any_bytes_are_refused_or_read_as_postcard_does(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            old in header(),
        ) {
            read_as_postcard_does(&bytes, old)?;
        }
    }

    proptest! {
        /// A header with one byte changed or cut short: refused exactly when postcard refuses
        /// it, else the same header.
        #[test]
        fn a_damaged_header_is_refused_or_read_as_postcard_does(
            h in header(),
            at in any::<proptest::sample::Index>(),
            byte in any::<u8>(),
            cut in any::<bool>(),
        ) {
            let mut bytes = postcard::to_allocvec(&h).unwrap();
            let i = at.index(bytes.len());
            if cut {
                bytes.truncate(i);
            } else {
                bytes[i] = byte;
            }
            read_as_postcard_does(&bytes, Header::default())?;
        }
    }

    /// Bytes that postcard refuses in each part of a header, and a length past the message.
    #[test]
    fn truncated_or_bad_headers_are_refused() {
        let h = Header {
            nfds: 1,
            segments: vec![SegmentDesc { fd: 0, name: Some("x".into()), id: None }],
            storages: vec![StorageDesc::Slot { segment: 0, slot: 3, len: 64 }],
        };
        let bytes = postcard::to_allocvec(&h).unwrap();
        for cut in 0..bytes.len() {
            let mut into = Header::default();
            assert!(parse_into(&framed(&bytes[..cut]), &mut into).is_err(), "cut at {cut}");
        }
        let mut long = framed(&bytes);
        long[..4].copy_from_slice(&(bytes.len() as u32 + 1).to_le_bytes());
        let err = parse_into(&long, &mut Header::default()).unwrap_err().to_string();
        let (claimed, left) = (bytes.len() + 1, long.len() - 4);
        assert!(
            err.contains(&format!("claims {claimed} bytes after its 4-byte length, more than the {left}")),
            "{err}"
        );
    }
}
