//! The decoder against random and mutated messages: every outcome is a value or an error,
//! never a panic, a hang or an out-of-bounds view. A mutated message can only add holds
//! (the descriptors it carries hold its slots), so other tests would not feel it; it is still
//! a test binary of its own, so that its many arenas are counted nowhere else.

use std::os::fd::OwnedFd;

use proptest::prelude::*;
use tensorshare::{raw, DType, Error, NestedTensor, SparseTensor, Tensor};

type Payload = (Tensor, Vec<Tensor>, String, Option<SparseTensor>, Option<NestedTensor>);

fn sample() -> Payload {
    let base = Tensor::from_vec((0..24).map(|v| v as f32).collect(), &[4, 6]).unwrap();
    let big = Tensor::zeros(&[5 << 20], DType::U8); // a one-slot arena of its own
    let idx = Tensor::from_vec(vec![0i64, 1, 1, 0], &[2, 2]).unwrap();
    let sp = SparseTensor::coo(idx, Tensor::from_vec(vec![1i32, 2], &[2]).unwrap(), &[2, 2]).unwrap();
    let nt =
        NestedTensor::from_tensors(&[Tensor::ones(&[2, 2], DType::I16), Tensor::ones(&[1, 2], DType::I16)])
            .unwrap();
    (
        base.clone(),
        vec![base.t().unwrap(), base.narrow(1, 2, 3).unwrap(), big],
        "x".into(),
        Some(sp),
        Some(nt),
    )
}

/// Reads every element of everything decoded, so an out-of-bounds view would fault.
fn touch(p: &Payload) -> usize {
    let mut n = p.0.to_bytes().map(|b| b.len()).unwrap_or(0);
    for t in &p.1 {
        n += t.to_bytes().map(|b| b.len()).unwrap_or(0);
    }
    if let Some(s) = &p.3 {
        n += s.values().to_bytes().map(|b| b.len()).unwrap_or(0);
    }
    if let Some(nt) = &p.4 {
        n += nt.unbind().iter().map(|t| t.to_bytes().map(|b| b.len()).unwrap_or(0)).sum::<usize>();
    }
    n
}

fn dup(fds: &[OwnedFd]) -> Vec<OwnedFd> {
    fds.iter().map(|f| f.try_clone().unwrap()).collect()
}

#[test]
fn a_valid_message_decodes() {
    let (bytes, fds) = raw::encode(&sample()).unwrap();
    let back: Payload = raw::decode(&bytes, dup(&fds)).unwrap();
    assert!(back.0.equal(&sample().0));
    assert_eq!(touch(&back), touch(&sample()));
}

#[test]
fn missing_and_extra_descriptors_are_invalid() {
    let (bytes, fds) = raw::encode(&sample()).unwrap();
    assert!(fds.len() >= 2, "storages of several size classes: several arenas");
    let short = fds[1..].iter().map(|f| f.try_clone().unwrap()).collect();
    let err = raw::decode::<Payload>(&bytes, short).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
    let mut extra = dup(&fds);
    extra.push(rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap());
    assert!(matches!(raw::decode::<Payload>(&bytes, extra), Err(Error::InvalidMessage(_))));
    // Descriptors swapped: a segment that is not an arena, or one too small.
    let mut swapped = dup(&fds);
    swapped.reverse();
    let r = raw::decode::<Payload>(&bytes, swapped);
    assert!(r.is_err() || r.is_ok_and(|p| touch(&p) > 0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        match raw::decode::<Payload>(&bytes, Vec::new()) {
            Ok(p) => { touch(&p); }
            Err(e) => prop_assert!(matches!(e, Error::InvalidMessage(_)), "{}", e),
        }
    }

    #[test]
    fn mutated_messages_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let (bytes, fds) = raw::encode(&sample()).unwrap();
        let mut bytes = bytes;
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(p) = raw::decode::<Payload>(&bytes, dup(&fds)) {
            touch(&p);
        }
    }

    #[test]
    fn truncated_messages_are_invalid(cut in 0usize..400) {
        let (bytes, fds) = raw::encode(&sample()).unwrap();
        let cut = cut.min(bytes.len() - 1);
        let r = raw::decode::<Payload>(&bytes[..cut], dup(&fds));
        prop_assert!(matches!(r, Err(Error::InvalidMessage(_))));
    }
}
