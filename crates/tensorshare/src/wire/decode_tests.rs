//! Decoding messages whose handles lie: each is refused with a clear error.

use super::*;
use crate::{DType, Tensor};

/// `message` with its header changed by `f`.
fn edited(message: &[u8], f: impl FnOnce(&mut header::Header)) -> Vec<u8> {
    let (mut h, body) = header::parse(message).unwrap();
    f(&mut h);
    let mut out = header::frame(&h, message.len() - body).unwrap();
    out.extend_from_slice(&message[body..]);
    out
}

fn fds(msg: &crate::wire::Encoded) -> Vec<OwnedFd> {
    msg.borrowed_fds().iter().map(|f| f.try_clone_to_owned().unwrap()).collect()
}

/// A message whose table names one slot twice: with one length it is one storage (held
/// once, given back once), with two it is refused.
#[test]
fn a_slot_named_twice_is_one_storage_and_two_lengths_are_refused() {
    let a = Tensor::empty_shared(&[16], DType::F32).unwrap();
    let b = Tensor::empty_shared(&[16], DType::F32).unwrap();
    let msg = crate::wire::encode(&(a, b)).unwrap(); // the tensors go: the message holds
    let first = |h: &header::Header| match &h.storages[0] {
        StorageDesc::Slot { segment, slot, len } => (*segment, *slot, *len),
        _ => panic!("a slot"),
    };
    let same = edited(&msg.bytes, |h| {
        let (segment, slot, len) = first(h);
        h.storages[1] = StorageDesc::Slot { segment, slot, len };
    });
    let (x, y): (Tensor, Tensor) = decode(&same, fds(&msg), false).unwrap();
    assert!(x.storage().ptr_eq(y.storage()), "one slot, one storage");
    drop((x, y));
    let two = edited(&msg.bytes, |h| {
        let (segment, slot, len) = first(h);
        h.storages[1] = StorageDesc::Slot { segment, slot, len: len / 2 };
    });
    let err = decode::<(Tensor, Tensor)>(&two, fds(&msg), false).unwrap_err();
    assert!(err.to_string().contains("two lengths"), "{err}");
}

/// A value whose serialization names a shared tensor and then panics: the encoding context
/// it leaves is emptied, so the next message of the thread names only its own storages.
struct PanicsAfter(Tensor);

impl serde::Serialize for PanicsAfter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let _ = self.0.serialize(s);
        panic!("a Serialize impl that panics midway");
    }
}

#[test]
fn a_serialization_that_panics_leaves_the_next_message_its_own_context() {
    let named = Tensor::empty_shared(&[8], DType::F32).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::wire::encode(&PanicsAfter(named.clone()))
    }));
    assert!(panicked.is_err());
    assert!(!crate::wire::encoding(), "no message is being encoded");
    let other = Tensor::full(&[4], 3.0f32);
    let msg = crate::wire::encode(&other).unwrap();
    let (h, _) = header::parse(&msg.bytes).unwrap();
    assert_eq!((h.storages.len(), h.segments.len(), msg.fds.len()), (1, 1, 1), "only its own");
    let back: Tensor = decode(&msg.bytes, fds(&msg), false).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![3.0; 4]);
}

/// A value whose serialization encodes another message: that encode is refused, and the
/// outer message is whole.
struct EncodesInside(Tensor);

impl serde::Serialize for EncodesInside {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let inner = crate::wire::encode(&Tensor::full(&[2], 1.0f32));
        assert!(inner.is_err_and(|e| e.to_string().contains("while encoding another")));
        self.0.serialize(s)
    }
}

#[test]
fn an_encode_inside_an_encode_is_refused_and_the_outer_message_is_whole() {
    let msg = crate::wire::encode(&EncodesInside(Tensor::full(&[3], 5.0f32))).unwrap();
    let back: Tensor = decode(&msg.bytes, fds(&msg), false).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![5.0; 3]);
    assert!(!crate::wire::encoding());
}

/// A message refused part way (one whose header is wrong, one whose storage lies about
/// its length once its arena is resolved) leaves nothing in the thread's decoding lists:
/// the next message, of a tensor in another arena, decodes as if it came first.
#[test]
fn a_refused_message_leaves_the_next_one_clean_lists() {
    let a = Tensor::full(&[5], 2.0f32);
    let msg = crate::wire::encode(&(a.clone(), a)).unwrap();
    let mut short = fds(&msg);
    short.pop();
    assert!(decode::<(Tensor, Tensor)>(&msg.bytes, short, false).is_err());
    let lying = edited(&msg.bytes, |h| {
        if let StorageDesc::Slot { len, .. } = &mut h.storages[0] {
            *len = u64::MAX;
        }
    });
    assert!(decode::<(Tensor, Tensor)>(&lying, fds(&msg), false).is_err());
    // Far larger: a slot of another size class, in another arena.
    let b = Tensor::full(&[6000], 4.0f32);
    let msg = crate::wire::encode(&b).unwrap();
    let back: Tensor = decode(&msg.bytes, fds(&msg), false).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![4.0; 6000]);
}
