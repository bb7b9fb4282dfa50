//! The README's quick tour, as a program: a shared tensor, a view of it, a queue, a worker
//! that writes through what it received, and the parent that sees the writes.
//!
//! `cargo run --release --example quickstart`

use tensorshare::{spawn, DType, Queue, Tensor};

fn main() -> tensorshare::Result<()> {
    tensorshare::init(); // first line of main: a worker runs its job here and exits
    let mut x = Tensor::zeros(&[5, 5], DType::F32);
    x.share_memory()?; // in place; x.is_shared() is now true
    let col = x.narrow(1, 1, 1)?; // a view of the same memory
    let q: Queue<(Tensor, Tensor)> = Queue::new()?;
    let mut ctx = spawn(
        |_rank: usize, q: Queue<(Tensor, Tensor)>| {
            let (mut x, _col) = q.get().unwrap();
            x.fill(4.0f32).unwrap(); // the parent sees this
        },
        q.clone(),
        1,
    )?;
    q.put((x.clone(), col))?;
    ctx.join(None)?; // Ok(true) when all are done; Err(ProcessError) on failure
    assert!(x.to_vec::<f32>()?.iter().all(|v| *v == 4.0));
    println!("the worker's writes are visible in the parent: x = 4 everywhere");
    Ok(())
}
