//! [`Device`]: where a tensor's data lives. Plain data, below the layers that hold data
//! (storage, tensor, cuda), so each of them can name it.

use serde::{Deserialize, Serialize};

/// Where a tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory (private or shared).
    Cpu,
    /// No data at all: shape and dtype only (torch's meta device).
    Meta,
    /// A CUDA device, by ordinal.
    Cuda(u32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Meta => f.write_str("meta"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
