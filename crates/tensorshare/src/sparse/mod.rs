//! [`SparseTensor`]: COO and compressed (CSR, CSC, BSR, BSC) sparse tensors, made of dense
//! index and value tensors, so they share and travel part by part.
//!
//! Here: the type and its parts. `build`: the constructors and their checks. `dense`:
//! `to_dense`, which checks the indices again.

mod build;
mod dense;

use serde::{Deserialize, Serialize};

use crate::{Result, Tensor};

/// The layout of a sparse tensor (torch's `torch.sparse_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SparseLayout {
    /// Coordinate list: `indices` `[sparse_dims, nnz]`, `values` `[nnz, dense dims...]`.
    Coo,
    /// Compressed rows: `crow_indices` `[rows + 1]`, `col_indices` `[nnz]`, `values` `[nnz]`.
    Csr,
    /// Compressed columns: `ccol_indices` `[cols + 1]`, `row_indices` `[nnz]`.
    Csc,
    /// Block compressed rows: values `[nnz, block_rows, block_cols]`.
    Bsr,
    /// Block compressed columns: values `[nnz, block_rows, block_cols]`.
    Bsc,
}

/// A sparse tensor. Index tensors are `int64`.
#[derive(Clone, Debug)]
pub struct SparseTensor {
    pub(crate) layout: SparseLayout,
    pub(crate) size: Vec<usize>,
    /// COO: `[indices]`; compressed: `[compressed_indices, plain_indices]`.
    pub(crate) indices: Vec<Tensor>,
    pub(crate) values: Tensor,
    pub(crate) coalesced: bool,
}

impl SparseTensor {
    /// The layout.
    pub fn layout(&self) -> SparseLayout {
        self.layout
    }

    /// The dense size.
    pub fn size(&self) -> &[usize] {
        &self.size
    }

    /// The values.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// The index tensors: `[indices]` for COO, `[compressed, plain]` otherwise.
    pub fn index_tensors(&self) -> &[Tensor] {
        &self.indices
    }

    /// Number of stored entries (blocks for BSR/BSC).
    pub fn nnz(&self) -> usize {
        self.values.shape()[0]
    }

    /// Whether a COO tensor's coordinates are sorted without repeats (always true for the
    /// compressed layouts).
    pub fn is_coalesced(&self) -> bool {
        self.coalesced
    }

    /// Moves indices and values into shared memory.
    pub fn share_memory(&mut self) -> Result<()> {
        for t in &mut self.indices {
            t.share_memory()?;
        }
        self.values.share_memory()?;
        Ok(())
    }

    /// Whether indices and values are all in shared memory.
    pub fn is_shared(&self) -> bool {
        self.indices.iter().all(Tensor::is_shared) && self.values.is_shared()
    }
}
