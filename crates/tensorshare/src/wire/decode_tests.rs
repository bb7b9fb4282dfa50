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
