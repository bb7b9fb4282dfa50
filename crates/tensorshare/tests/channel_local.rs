//! Queues, pipes and the wire inside one process (threads): message boundaries, timeouts,
//! hang-ups, aliasing through the receive cache, large messages.

use std::time::Duration;

use tensorshare::raw;
use tensorshare::{pipe, DType, Error, NestedTensor, Queue, SimpleQueue, SparseTensor, Storage, Tensor};

/// As in torch: sending a private tensor moves its storage into shared memory in place,
/// for every handle, so that the sender's clones and views see what the receiver writes.
#[test]
fn a_private_tensor_that_is_sent_becomes_shared_in_place() {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let t = Tensor::full(&[4], 2.0f32);
    let view = t.narrow(0, 1, 2).unwrap();
    q.put(t.clone()).unwrap();
    let mut r = q.get().unwrap();
    assert!(t.is_shared() && view.is_shared());
    assert!(r.storage().ptr_eq(t.storage()));
    r.fill(5.0f32).unwrap();
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![5.0, 5.0]);
}

#[test]
fn a_shared_tensor_and_its_views_alias_after_a_round_trip() {
    let q: Queue<(Tensor, Tensor, Storage)> = Queue::new().unwrap();
    let mut x = Tensor::zeros(&[3, 3], DType::I64);
    x.share_memory().unwrap();
    let col = x.narrow(1, 2, 1).unwrap();
    q.put((x.clone(), col, x.storage().clone())).unwrap();
    let (rx, mut rcol, rs) = q.get().unwrap();
    // Coming back to the process that made it: the very same storage.
    assert!(rx.storage().ptr_eq(x.storage()));
    assert!(rs.ptr_eq(x.storage()));
    rcol.fill(7i64).unwrap();
    assert_eq!(x.to_vec::<i64>().unwrap(), vec![0, 0, 7, 0, 0, 7, 0, 0, 7]);
}

#[test]
fn a_storage_received_twice_is_one_storage() {
    let q: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    let t = Tensor::full(&[8], 1u8);
    // One message, two tensors on one storage: one storage, one descriptor.
    let (bytes, fds) = raw::encode(&(t.clone(), t.narrow(0, 2, 3).unwrap())).unwrap();
    assert_eq!(fds.len(), 1);
    // The message carries a memfd: decoding it without is an invalid message.
    let err = raw::decode::<(Tensor, Tensor)>(&bytes, Vec::new()).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
    drop(fds);
    q.put((t.clone(), t.narrow(0, 2, 3).unwrap())).unwrap();
    let (whole, part) = q.get().unwrap();
    assert!(whole.storage().ptr_eq(part.storage()));
    let q: Queue<Tensor> = Queue::new().unwrap();
    q.put(t.clone()).unwrap();
    let first = q.get().unwrap();
    q.put(first.clone()).unwrap();
    let second = q.get().unwrap();
    assert!(first.storage().ptr_eq(second.storage()));
}

#[test]
fn capacity_bounds_put_and_timeouts_are_errors() {
    let q: Queue<u32> = Queue::with_capacity(2).unwrap();
    q.put(1).unwrap();
    q.put(2).unwrap();
    let other = q.clone(); // another handle that could take: put waits, then times out
                           // A failed put gives the value back.
    let e = q.put_timeout(3, Duration::from_millis(50)).unwrap_err();
    assert!(e.is_timeout() && matches!(e.error(), Error::Timeout));
    assert_eq!(e.into_inner(), 3);
    let e = q.try_put(4).unwrap_err();
    assert!(e.is_timeout());
    assert_eq!(e.into_inner(), 4);
    assert_eq!(other.get().unwrap(), 1);
    q.put(3).unwrap();
    assert_eq!(q.get().unwrap(), 2);
    assert_eq!(q.get().unwrap(), 3);
    assert!(matches!(other.get_timeout(Duration::from_millis(30)), Err(Error::Timeout)));
    assert_eq!(other.try_get().unwrap(), None);
}

#[test]
fn a_queue_alone_in_the_world_is_disconnected_when_empty() {
    let q: SimpleQueue<String> = SimpleQueue::new().unwrap();
    q.put("last words".to_string()).unwrap();
    assert_eq!(q.get().unwrap(), "last words");
    assert!(matches!(q.get(), Err(Error::Disconnected)));
    assert!(matches!(q.try_get(), Err(Error::Disconnected)));
}

#[test]
fn many_producer_threads_messages_never_interleave() {
    let q: Queue<Vec<u32>> = Queue::with_capacity(8).unwrap();
    std::thread::scope(|s| {
        for p in 0..4u32 {
            let q = q.clone();
            s.spawn(move || {
                for i in 0..200u32 {
                    // Some messages are far larger than a socket record.
                    let len = if i % 50 == 0 { 100_000 } else { 10 };
                    q.put(vec![p * 1000 + i; len]).unwrap();
                }
            });
        }
        let mut seen = std::collections::HashMap::new();
        for _ in 0..800 {
            let v = q.get().unwrap();
            assert!(v.iter().all(|x| *x == v[0]), "a message mixed with another");
            let (p, i) = (v[0] / 1000, v[0] % 1000);
            let last = seen.insert(p, i);
            assert!(last.is_none_or(|l| l < i), "one producer's messages arrive in order");
        }
    });
}

#[test]
fn pipe_hang_up_is_disconnected() {
    let (a, b) = pipe::<(String, Tensor)>().unwrap();
    a.send(("x".into(), Tensor::ones(&[2], DType::F64))).unwrap();
    let (s, t) = b.recv().unwrap();
    assert_eq!(s, "x");
    assert_eq!(t.to_vec::<f64>().unwrap(), vec![1.0, 1.0]);
    assert!(!b.poll(Duration::from_millis(10)).unwrap());
    assert!(matches!(b.recv_timeout(Duration::from_millis(10)), Err(Error::Timeout)));
    drop(a);
    assert!(matches!(b.recv(), Err(Error::Disconnected)));
}

#[test]
fn a_send_to_a_full_pipe_times_out_with_its_value_back_and_nothing_sent() {
    let (a, b) = pipe::<Vec<u8>>().unwrap();
    let mut sent = 0usize;
    let back = loop {
        match a.send_timeout(vec![sent as u8; 16 << 10], Duration::from_millis(10)) {
            Ok(()) => sent += 1,
            Err(e) => break e.into_parts(),
        }
        assert!(sent < 100_000, "a pipe nobody reads never fills");
    };
    assert!(matches!(back.1, Error::Timeout), "{:?}", back.1);
    assert_eq!(back.0, vec![sent as u8; 16 << 10], "the value comes back whole");
    // Room made: the value goes, after every message before it, each once.
    assert_eq!(b.recv().unwrap()[0], 0);
    a.send_timeout(back.0, Duration::from_secs(60)).unwrap();
    for i in 1..=sent {
        assert_eq!(b.recv().unwrap(), vec![i as u8; 16 << 10]);
    }
    assert!(!b.poll(Duration::ZERO).unwrap());
}

#[test]
fn a_send_while_asked_to_stop_gives_its_value_back_with_nothing_sent() {
    let (a, b) = pipe::<Vec<u8>>().unwrap();
    let mut sent = 0usize;
    while a.send_timeout(vec![1; 16 << 10], Duration::from_millis(10)).is_ok() {
        sent += 1;
        assert!(sent < 100_000, "a pipe nobody reads never fills");
    }
    // A large value (its bytes in a memfd) waits, asked three times, then is stopped.
    let mut asked = 0;
    let (back, e) = a
        .send_while(vec![2; 1 << 20], Duration::from_millis(5), || {
            asked += 1;
            asked < 3
        })
        .unwrap_err()
        .into_parts();
    assert!(matches!(e, Error::Timeout), "{e:?}");
    assert_eq!((asked, back.len()), (3, 1 << 20));
    // Room made meanwhile: the send goes through, after everything before it.
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        for _ in 0..=sent {
            got.push(b.recv().unwrap());
        }
        got
    });
    a.send_while(back, Duration::from_millis(5), || true).unwrap();
    let got = reader.join().unwrap();
    assert!(got[..sent].iter().all(|m| m == &vec![1; 16 << 10]));
    assert_eq!(got[sent], vec![2; 1 << 20]);
}

/// Bytes whose serializations are counted.
#[derive(serde::Deserialize)]
struct Counted(Vec<u8>);

static SERIALIZED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl serde::Serialize for Counted {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        SERIALIZED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.serialize(s)
    }
}

#[test]
fn a_send_while_waiting_makes_its_message_once() {
    let (a, _b) = pipe::<Counted>().unwrap();
    let mut sent = 0usize;
    while a.send_timeout(Counted(vec![1; 16 << 10]), Duration::from_millis(10)).is_ok() {
        sent += 1;
        assert!(sent < 100_000, "a pipe nobody reads never fills");
    }
    let before = SERIALIZED.load(std::sync::atomic::Ordering::Relaxed);
    let mut asked = 0;
    let stopped = a.send_while(Counted(vec![2; 1 << 20]), Duration::from_millis(5), || {
        asked += 1;
        asked < 4
    });
    assert!(stopped.is_err() && asked == 4);
    assert_eq!(
        SERIALIZED.load(std::sync::atomic::Ordering::Relaxed) - before,
        1,
        "made once, sent in four slices"
    );
}

#[test]
fn sparse_and_nested_tensors_travel_part_by_part() {
    let q: Queue<(SparseTensor, NestedTensor)> = Queue::new().unwrap();
    let idx = Tensor::from_vec(vec![0i64, 1, 1, 0], &[2, 2]).unwrap();
    let vals = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let sp = SparseTensor::coo(idx, vals, &[2, 2]).unwrap();
    let nt =
        NestedTensor::from_tensors(&[Tensor::ones(&[1, 3], DType::I32), Tensor::zeros(&[2, 3], DType::I32)])
            .unwrap();
    q.put((sp.clone(), nt.clone())).unwrap();
    let (rsp, rnt) = q.get().unwrap();
    assert!(rsp.is_shared() && rnt.is_shared());
    assert!(rsp.to_dense().unwrap().equal(&sp.to_dense().unwrap()));
    for (a, b) in rnt.unbind().iter().zip(nt.unbind()) {
        assert!(a.equal(&b));
    }
}

#[test]
fn outside_a_message_tensors_serialize_by_value() {
    let t = Tensor::from_vec(vec![1i16, 2, 3, 4, 5, 6], &[2, 3]).unwrap().t().unwrap();
    let bytes = postcard::to_allocvec(&t).unwrap();
    let back: Tensor = postcard::from_bytes(&bytes).unwrap();
    assert!(back.equal(&t));
    assert!(!back.is_shared());
    let meta = Tensor::meta(&[2, 2], DType::BF16);
    let back: Tensor = postcard::from_bytes(&postcard::to_allocvec(&meta).unwrap()).unwrap();
    assert!(back.equal(&meta));
}
