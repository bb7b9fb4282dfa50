//! The kernel's cap on descriptors in flight, between real processes: values that carry
//! descriptors wait for readers instead of failing, as values that find no room do.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
use tensorshare::{spawn, DType, Queue, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// How many values wait in the queue at once: more than the descriptor limit set below,
/// fewer than its socket holds, so that the cap, not the room, is what refuses them.
const VALUES: usize = 160;
const LIMIT: u64 = 64;

/// A process without CAP_SYS_RESOURCE may have at most RLIMIT_NOFILE descriptors in flight
/// in Unix sockets (`sendmsg` fails with ETOOMANYREFS beyond it). Every value here carries
/// its arena's descriptor (tensors over the lane's bound keep the socket), so the 65th put
/// on an unbounded queue with nobody reading yet used to fail. Now it waits in the outbox
/// until readers take some, and all of them arrive, in order. Starting a worker meanwhile
/// fails at once (its arguments carry descriptors too, and cannot wait), and hangs nothing.
/// (In a helper process, whose capabilities and limit are its own.)
#[test]
fn values_over_the_cap_on_descriptors_in_flight_wait_for_readers() {
    common::isolated_with(
        |_rank, ()| {
            let mut caps = capabilities(None).expect("capget");
            caps.effective -= CapabilitySet::SYS_RESOURCE | CapabilitySet::SYS_ADMIN;
            set_capabilities(None, caps).expect("capset: dropping CAP_SYS_RESOURCE");
            let q: Queue<Tensor> = Queue::new().unwrap();
            // 128 KiB each, made (and their arenas opened) before the limit drops.
            let values: Vec<Tensor> = (0..VALUES)
                .map(|i| {
                    let mut t = Tensor::empty_shared(&[32 << 10], DType::F32).unwrap();
                    t.fill(i as f32).unwrap();
                    t
                })
                .collect();
            let before = getrlimit(Resource::Nofile);
            setrlimit(Resource::Nofile, Rlimit { current: Some(LIMIT), maximum: before.maximum }).unwrap();
            for (i, t) in values.into_iter().enumerate() {
                if let Err(e) = q.put(t) {
                    panic!("put {i} failed: {}", e.error());
                }
            }
            // A worker's arguments (the queue's descriptors) cannot wait for a reader: the
            // reader would be that worker. Its start fails at once, saying why.
            let refused =
                spawn(|_rank, q: Queue<Tensor>| drop(q.get()), q.clone(), 1).err().map(|e| e.to_string());
            assert!(refused.as_ref().is_some_and(|e| e.contains("os error 109")), "{refused:?}");
            for i in 0..VALUES {
                let t = q.get().unwrap();
                assert_eq!(t.to_vec::<f32>().unwrap()[..2], [i as f32; 2], "value {i}");
            }
            setrlimit(Resource::Nofile, before).unwrap();
        },
        (),
    );
}
