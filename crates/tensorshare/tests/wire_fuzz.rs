//! The decoder against random and mutated messages: every outcome is a value or an error,
//! never a panic, a hang or an out-of-bounds view. (Its own test binary: mutated slot
//! numbers may release counts of slots this process holds, which other tests would feel.)

use std::os::fd::OwnedFd;

use proptest::prelude::*;
use tensorshare::{wire, DType, Error, NestedTensor, SparseTensor, Tensor};

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

fn dup(fds: &[std::os::fd::BorrowedFd<'_>]) -> Vec<OwnedFd> {
    fds.iter().map(|f| f.try_clone_to_owned().unwrap()).collect()
}

#[test]
fn a_valid_message_decodes() {
    let msg = wire::encode(&sample()).unwrap();
    let back: Payload = wire::decode(&msg.to_vec(), dup(&msg.fds())).unwrap();
    assert!(back.0.equal(&sample().0));
    assert_eq!(touch(&back), touch(&sample()));
}

#[test]
fn missing_and_extra_descriptors_are_invalid() {
    let msg = wire::encode(&sample()).unwrap();
    let fds = dup(&msg.fds());
    assert!(fds.len() >= 2, "storages of several size classes: several arenas");
    let short = fds[1..].iter().map(|f| f.try_clone().unwrap()).collect();
    let err = wire::decode::<Payload>(&msg.to_vec(), short).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
    let mut extra = dup(&msg.fds());
    extra.push(rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap());
    assert!(matches!(wire::decode::<Payload>(&msg.to_vec(), extra), Err(Error::InvalidMessage(_))));
    // Descriptors swapped: a segment that is not an arena, or one too small.
    let mut swapped = dup(&msg.fds());
    swapped.reverse();
    let r = wire::decode::<Payload>(&msg.to_vec(), swapped);
    assert!(r.is_err() || r.is_ok_and(|p| touch(&p) > 0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        match wire::decode::<Payload>(&bytes, Vec::new()) {
            Ok(p) => { touch(&p); }
            Err(e) => prop_assert!(matches!(e, Error::InvalidMessage(_)), "{}", e),
        }
    }

    #[test]
    fn mutated_messages_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let msg = wire::encode(&sample()).unwrap();
        let mut bytes = msg.to_vec();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(p) = wire::decode::<Payload>(&bytes, dup(&msg.fds())) {
            touch(&p);
        }
    }

    #[test]
    fn truncated_messages_are_invalid(cut in 0usize..400) {
        let msg = wire::encode(&sample()).unwrap();
        let bytes = msg.to_vec();
        let cut = cut.min(bytes.len() - 1);
        let r = wire::decode::<Payload>(&bytes[..cut], dup(&msg.fds()));
        prop_assert!(matches!(r, Err(Error::InvalidMessage(_))));
    }
}
