//! Promises of queues and sharing that users rely on, between real processes: a queue in
//! flight is held, `try_put` on room is no timeout, a sent tensor is shared in place.

use std::time::Duration;

use tensorshare::{spawn, DType, Error, Queue, Tensor};

tensorshare::enable_test_workers!();

/// A queue travelling inside a message counts as held: the parent drops every handle but
/// its own and waits in `get` while the worker's arguments (a 64 MiB tensor and the queue)
/// are still on their way; the worker's value arrives instead of `Disconnected`.
#[test]
fn a_queue_in_flight_is_held() {
    for _ in 0..5 {
        let q: Queue<u32> = Queue::new().unwrap();
        let blob = Tensor::zeros(&[64 << 20], DType::U8);
        let mut ctx =
            spawn(|_rank, (_blob, q): (Tensor, Queue<u32>)| q.put(7).unwrap(), (blob, q.clone()), 1).unwrap();
        assert_eq!(q.get().unwrap(), 7);
        assert_eq!(ctx.join(None), Ok(true));
    }
}

/// `try_put` and `put_timeout(v, 0)` succeed whenever there is room, the unbounded queue
/// always having some.
#[test]
fn try_put_on_a_queue_with_room_is_no_timeout() {
    let q: Queue<u32> = Queue::new().unwrap();
    q.try_put(1).unwrap();
    q.put_timeout(2, Duration::ZERO).unwrap();
    let b: Queue<u32> = Queue::with_capacity(1).unwrap();
    b.try_put(3).unwrap();
    assert!(matches!(b.try_put(4), Err(Error::Timeout)));
    assert_eq!((q.get().unwrap(), q.get().unwrap(), b.get().unwrap()), (1, 2, 3));
}

/// Hogwild code that forgets `share_memory()`: the sent tensor becomes shared in place, so
/// the worker's writes reach the parent's tensor and its views.
#[test]
fn a_private_tensor_sent_to_a_worker_is_shared_in_place() {
    let weights = Tensor::zeros(&[8], DType::F32);
    let view = weights.narrow(0, 4, 4).unwrap();
    assert!(!weights.is_shared());
    let mut ctx = spawn(
        |_rank, mut w: Tensor| {
            w.fill(4.0f32).unwrap();
        },
        weights.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(weights.is_shared());
    assert_eq!(weights.to_vec::<f32>().unwrap(), vec![4.0; 8]);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![4.0; 4]);
}
