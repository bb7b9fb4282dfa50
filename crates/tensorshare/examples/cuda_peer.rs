//! A Rust process on a GPU beside a PyTorch one, through one pair of tensorshare queues: the
//! CUDA tensors it makes reach Python as torch CUDA tensors over the same device memory, and
//! the ones Python makes with `tensorshare.empty_shared(..., device="cuda")` reach it as
//! `Tensor`s on `Device::Cuda`, which it reads and writes in place. The test of both
//! directions is `crates/tensorshare-py/tests/test_torch_cuda.py`.
//!
//! Python starts it (feature `cuda`):
//!
//! ```python
//! requests, answers = mp.Queue(), mp.Queue()
//! peer = tensorshare.popen(["target/debug/examples/cuda_peer"], (requests, answers))
//! requests.put("make")          # answers {"x": ..., "column": ..., "halves": ..., "flags": ...}
//! requests.put({"check": {...}}) # answers what it read, having written 9.0 over "x"
//! requests.put(None)            # it exits
//! ```

use serde::{Deserialize, Serialize};
use tensorshare::value::{from_value, to_value};
use tensorshare::{cuda, DType, Device, Message, Queue, Result, Tensor, Value};

/// What this process makes on the GPU for Python.
#[derive(Serialize)]
struct Made {
    /// 2 × 3 of 1.5.
    x: Tensor,
    /// Column 1 of `x`, a strided view of the same allocation.
    column: Tensor,
    halves: Tensor,
    flags: Tensor,
}

/// What Python sends to be checked: its own CUDA tensors.
#[derive(Deserialize)]
struct Check {
    /// Written over with 9.0 here, so that Python sees the write.
    x: Tensor,
    column: Tensor,
    bhalves: Tensor,
}

/// What this process found, back to Python.
#[derive(Serialize)]
struct Found {
    devices: Vec<String>,
    x: Vec<f32>,
    column: Vec<f32>,
    column_strides: Vec<usize>,
    one_allocation: bool,
    bhalves: Vec<f32>,
}

fn make() -> Result<Made> {
    let gpu = Device::Cuda(0);
    let mut x = Tensor::empty_on(&[2, 3], DType::F32, gpu)?;
    x.fill(1.5f32)?;
    let mut halves = Tensor::empty_on(&[4], DType::F16, gpu)?;
    halves.fill(half::f16::from_f32(0.5))?;
    let mut flags = Tensor::empty_on(&[3], DType::Bool, gpu)?;
    flags.fill(true)?;
    let column = x.select(1, 1)?;
    Ok(Made { x, column, halves, flags })
}

fn check(value: Value) -> Result<Value> {
    let c: Check = from_value(value)?;
    let found = Found {
        devices: [&c.x, &c.column, &c.bhalves].iter().map(|t| t.device().to_string()).collect(),
        x: c.x.to_vec::<f32>()?,
        column: c.column.to_vec::<f32>()?,
        column_strides: c.column.strides().to_vec(),
        one_allocation: c.x.storage().ptr_eq(c.column.storage()),
        bhalves: c.bhalves.to_vec::<half::bf16>()?.into_iter().map(f32::from).collect(),
    };
    let mut x = c.x.clone();
    x.fill(9.0f32)?;
    // The fill is queued on this process's stream; Python reads `x` once it has the answer,
    // which does not carry `x`, so the fill must be done first.
    cuda::synchronize(x.device())?;
    to_value(&found)
}

fn main() -> Result<()> {
    tensorshare::init();
    // SAFETY: tensorshare.popen passed these descriptors to this process for this message,
    // and nothing else here owns them; the variable is read once, while this process has one
    // thread (`init` starts none), so nothing reads the environment as it is changed.
    let handoff = unsafe { Message::from_env("TENSORSHARE_HANDOFF") }?;
    let (requests, answers): (Queue<Value>, Queue<Value>) = from_value(handoff.decode()?)?;
    loop {
        let request = requests.get()?;
        let answer = match &request {
            Value::None => return Ok(()),
            Value::Str(s) if s == "make" => to_value(&make()?)?,
            _ => match request.get("check") {
                Some(c) => check(c.clone())?,
                None => Value::Str(format!("unknown request {request:?}")),
            },
        };
        answers.put(answer).map_err(|e| e.into_parts().1)?;
    }
}
