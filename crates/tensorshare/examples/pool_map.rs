//! A process pool: `map` over tensors in shared memory. The workers write their inputs in
//! place (the parent sees it) and return new tensors.
//!
//! `cargo run --release --example pool_map`

use tensorshare::{DType, Pool, Tensor};

fn main() -> tensorshare::Result<()> {
    tensorshare::init();
    let mut pool = Pool::new(2)?;
    let inputs: Vec<Tensor> = (0..8)
        .map(|i| {
            let mut t = Tensor::zeros(&[4, 4], DType::F32);
            t.share_memory()?;
            t.fill(i as f32)?;
            Ok(t)
        })
        .collect::<tensorshare::Result<_>>()?;
    let sums = pool.map(
        |mut t: Tensor| {
            let s: f32 = t.to_vec::<f32>().unwrap().iter().sum();
            t.fill(-1.0f32).unwrap(); // in place, in the parent's memory
            s
        },
        inputs.clone(),
    )?;
    println!("sums computed by the pool: {sums:?}");
    assert!(inputs.iter().all(|t| t.to_vec::<f32>().unwrap().iter().all(|v| *v == -1.0)));
    println!("and every input was overwritten in place by the workers (pids {:?})", pool.pids());
    Ok(())
}
