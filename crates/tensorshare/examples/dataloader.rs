//! A minimal DataLoader: workers build batches into shared memory and put them on a
//! bounded queue; the training loop takes them. No batch is copied on the way.
//!
//! `cargo run --release --example dataloader`

use serde::{Deserialize, Serialize};
use tensorshare::{spawn, DType, Queue, Tensor};

#[derive(Serialize, Deserialize)]
struct Batch {
    index: usize,
    images: Tensor,
    labels: Tensor,
}

fn load(rank: usize, (q, workers, batches): (Queue<Option<Batch>>, usize, usize)) -> tensorshare::Result<()> {
    for index in (rank..batches).step_by(workers) {
        // Made where it will be read: in shared memory.
        let mut images = Tensor::empty_shared(&[32, 3, 64, 64], DType::U8)?;
        images.fill(index as u8)?;
        let labels = Tensor::from_vec((0..32).map(|i| (index * 32 + i) as i64).collect(), &[32])?;
        q.put(Some(Batch { index, images, labels }))?;
    }
    Ok(q.put(None)?)
}

fn main() -> tensorshare::Result<()> {
    tensorshare::init();
    let (workers, batches) = (2, 100);
    let q: Queue<Option<Batch>> = Queue::with_capacity(2 * workers)?;
    let mut ctx = spawn(load, (q.clone(), workers, batches), workers)?;
    let (mut seen, mut done) = (0, 0);
    while done < workers {
        match q.get()? {
            None => done += 1,
            Some(b) => {
                // Read in place, without a copy. SAFETY: the worker wrote the batch before
                // `put` (the queue orders that before our `get`) and gave its handles away
                // with it; nothing else writes this batch while we read it.
                let images = unsafe { b.images.as_slice::<u8>()? };
                assert!(images.iter().all(|p| *p == b.index as u8));
                assert_eq!(b.labels.to_vec::<i64>()?[0], (b.index * 32) as i64);
                seen += 1;
            }
        }
    }
    ctx.join(None)?;
    println!("trained on {seen} batches from {workers} worker processes");
    Ok(())
}
