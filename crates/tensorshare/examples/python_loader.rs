//! A Rust data loader feeding a PyTorch training loop in another process, through one pair
//! of tensorshare queues: the batches Python's torch sees alias the memory this process
//! filled, and Python's requests arrive here as Rust structs.
//!
//! Python starts it (see `crates/tensorshare-py/examples/train_from_rust.py`):
//!
//! ```python
//! requests, batches = mp.Queue(), mp.Queue(maxsize=8)
//! loader = tensorshare.popen(["target/release/examples/python_loader"], (requests, batches))
//! requests.put({"batches": 100, "batch_size": 64, "seed": 0})
//! for _ in range(100):
//!     batch = batches.get()   # {"index": 0, "images": tensor, "labels": tensor, ...}
//! ```
//!
//! A request `{"check": {...}}` instead has this process check a value Python built (views,
//! every dtype, nested containers), write into one of its tensors, and answer with what it
//! found: the test of both directions (`crates/tensorshare-py/tests/test_rust_peer.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tensorshare::value::{from_value, to_value};
use tensorshare::{DType, Message, Queue, Result, Tensor, Value};

/// What Python asks for: a dict with these keys.
#[derive(Deserialize)]
struct Request {
    batches: u64,
    batch_size: usize,
    seed: u64,
}

/// One batch, a dict of tensors in Python.
#[derive(Serialize)]
struct Batch {
    index: u64,
    images: Tensor,
    labels: Tensor,
    mask: Tensor,
    scale_f16: Tensor,
    scale_bf16: Tensor,
}

/// What Python sends to be checked.
#[derive(Deserialize)]
struct Check {
    /// A strided view (a column of a matrix): its elements are read through its strides.
    column: Tensor,
    halves: Tensor,
    bhalves: Tensor,
    flags: Tensor,
    /// A numpy array, doubled in place here so that Python sees the write.
    array: Tensor,
    names: Vec<String>,
    pairs: Vec<(String, i64)>,
    nested: BTreeMap<String, Vec<f64>>,
    maybe: Option<i64>,
    /// Integers a Rust `u64` holds, up to 2**64 - 1 (a hash, a seed).
    hashes: Vec<u64>,
}

/// What this process found, back to Python.
#[derive(Serialize)]
struct Found {
    column: Vec<f32>,
    column_strides: Vec<usize>,
    halves: Vec<f32>,
    bhalves: Vec<f32>,
    flags: Vec<bool>,
    dtypes: Vec<String>,
    names: Vec<String>,
    pair_sum: i64,
    nested_len: usize,
    maybe: Option<i64>,
    /// Each of `hashes` with its lowest bit flipped, made here.
    hashes_flipped: Vec<u64>,
    made_here: Tensor,
}

fn check(value: Value) -> Result<Value> {
    let c: Check = from_value(value)?;
    let mut array = c.array.clone();
    let doubled: Vec<f64> = array.to_vec::<f64>()?.into_iter().map(|x| 2.0 * x).collect();
    array.copy_from_slice(&doubled)?;
    let found = Found {
        column: c.column.to_vec::<f32>()?,
        column_strides: c.column.strides().to_vec(),
        halves: c.halves.to_vec::<half::f16>()?.into_iter().map(f32::from).collect(),
        bhalves: c.bhalves.to_vec::<half::bf16>()?.into_iter().map(f32::from).collect(),
        flags: c.flags.to_vec::<bool>()?,
        dtypes: [&c.column, &c.halves, &c.bhalves, &c.flags, &c.array]
            .iter()
            .map(|t| t.dtype().to_string())
            .collect(),
        names: c.names,
        pair_sum: c.pairs.iter().map(|(_, v)| v).sum(),
        nested_len: c.nested.values().map(Vec::len).sum(),
        maybe: c.maybe,
        hashes_flipped: c.hashes.iter().map(|h| h ^ 1).collect(),
        made_here: Tensor::from_vec(vec![1.5f32, 2.5, 3.5], &[3])?,
    };
    to_value(&found)
}

fn batch(index: u64, batch_size: usize, seed: u64) -> Result<Batch> {
    let mut images = Tensor::empty_shared(&[batch_size, 3, 32, 32], DType::F32)?;
    images.fill((seed + index) as f32)?;
    let labels: Vec<i64> = (0..batch_size as u64).map(|k| ((seed + index + k) % 10) as i64).collect();
    let mask: Vec<bool> = (0..batch_size).map(|k| k % 2 == 0).collect();
    Ok(Batch {
        index,
        images,
        labels: Tensor::from_vec(labels, &[batch_size])?,
        mask: Tensor::from_vec(mask, &[batch_size])?,
        scale_f16: Tensor::from_vec(vec![half::f16::from_f32(0.5); batch_size], &[batch_size])?,
        scale_bf16: Tensor::from_vec(vec![half::bf16::from_f32(0.25); batch_size], &[batch_size])?,
    })
}

fn main() -> Result<()> {
    tensorshare::init();
    // SAFETY: tensorshare.popen passed these descriptors to this process for this message,
    // and nothing else here owns them; the variable is read once, while this process has one
    // thread (`init` starts none), so nothing reads the environment as it is changed.
    let handoff = unsafe { Message::from_env("TENSORSHARE_HANDOFF") }?;
    let (requests, batches): (Queue<Value>, Queue<Value>) = from_value(handoff.decode()?)?;
    loop {
        let request = requests.get()?;
        if matches!(request, Value::None) {
            return Ok(());
        }
        if let Some(c) = request.get("check") {
            let answer = check(c.clone())?;
            batches.put(answer).map_err(|e| e.into_parts().1)?;
            continue;
        }
        let r: Request = from_value(request)?;
        for index in 0..r.batches {
            let value = to_value(&batch(index, r.batch_size, r.seed)?)?;
            batches.put(value).map_err(|e| e.into_parts().1)?;
        }
        batches.put(Value::Str("done".into())).map_err(|e| e.into_parts().1)?;
    }
}
