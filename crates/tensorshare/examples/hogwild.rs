//! Hogwild: several processes train one linear model whose parameters live in shared
//! memory, each updating them lock-free through the atomic view (torch's mnist_hogwild,
//! on a synthetic regression task). The loss falls.
//!
//! `cargo run --release --example hogwild`

use tensorshare::{spawn, DType, Tensor};

const DIM: usize = 32;

/// A small deterministic generator, so the example needs no extra crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The model to learn: y = <w*, x>.
fn truth() -> Vec<f32> {
    (0..DIM).map(|i| ((i as f32) * 0.37).sin()).collect()
}

fn sample(rng: &mut Rng, w: &[f32]) -> (Vec<f32>, f32) {
    let x: Vec<f32> = (0..DIM).map(|_| rng.next()).collect();
    let y = x.iter().zip(w).map(|(a, b)| a * b).sum();
    (x, y)
}

fn loss(params: &Tensor) -> f32 {
    let w = params.to_vec::<f32>().unwrap();
    let (truth, mut rng) = (truth(), Rng(12345));
    let n = 1000;
    (0..n)
        .map(|_| {
            let (x, y) = sample(&mut rng, &truth);
            let p: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum();
            (p - y) * (p - y)
        })
        .sum::<f32>()
        / n as f32
}

fn train(rank: usize, (params, steps): (Tensor, usize)) {
    let view = params.atomic::<f32>().unwrap();
    let (truth, mut rng) = (truth(), Rng(0x9E3779B97F4A7C15 ^ rank as u64));
    let lr = 0.002;
    for _ in 0..steps {
        let (x, y) = sample(&mut rng, &truth);
        let y = y + 0.1 * rng.next(); // noisy labels
        let w = view.to_vec();
        let err: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() - y;
        let grad: Vec<f32> = x.iter().map(|xi| -lr * err * xi).collect();
        view.add_slice(&grad); // no lock: each element's addition is atomic
    }
}

fn main() -> tensorshare::Result<()> {
    tensorshare::init();
    let mut params = Tensor::zeros(&[DIM], DType::F32);
    params.share_memory()?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).max(2);
    println!("loss before training: {:.4}", loss(&params));
    let mut last = loss(&params);
    for epoch in 1..=5 {
        spawn(train, (params.clone(), 300), workers)?.join(None)?;
        let now = loss(&params);
        println!("loss after epoch {epoch} ({workers} processes, 300 steps each): {now:.5}");
        assert!(now < last, "the shared parameters did not improve");
        last = now;
    }
    Ok(())
}
