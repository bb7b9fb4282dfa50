//! [`SparseTensor::to_dense`]. The indices are read and checked again here: in shared
//! memory another process may have changed them since construction, and they decide
//! where bytes are written.

use super::build::check_range;
use super::{SparseLayout, SparseTensor};
use crate::tensor::contiguous_strides;
use crate::{Error, Result, Tensor};

impl SparseTensor {
    /// The dense tensor. A COO tensor with repeated coordinates is an error (torch would
    /// sum them), and so is a size too large to allocate.
    pub fn to_dense(&self) -> Result<Tensor> {
        let dtype = self.values.dtype();
        let esize = dtype.size();
        // Checks that the dense size's element count and byte size fit, so the dense
        // offsets computed below (of in-range indices) fit too.
        let dense = Tensor::try_zeros(&self.size, dtype)?;
        let dstrides = contiguous_strides(&self.size);
        let vals = self.values.to_bytes()?;
        let out = dense.storage().as_mut_ptr();
        let put = |dense_elem: usize, value_elem: usize, n: usize| {
            // SAFETY: dense_elem..+n indexes the fresh dense tensor (indices were range-checked
            // just below), value_elem..+n indexes `vals` (numel of values). The dense tensor
            // is private and no handle of it but `dense` exists yet: nothing else touches it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    vals.as_ptr().add(value_elem * esize),
                    out.add(dense_elem * esize),
                    n * esize,
                )
            }
        };
        // The indices are read again and checked again: in shared memory another process
        // may have changed them since construction, and they decide where bytes are written.
        match self.layout {
            SparseLayout::Coo => {
                let idx = self.indices[0].to_vec::<i64>()?;
                let sparse_dims = self.indices[0].shape()[0];
                let nnz = self.nnz();
                for d in 0..sparse_dims {
                    check_range(
                        &idx[d * nnz..(d + 1) * nnz],
                        self.size[d],
                        &format!("COO indices row {d}"),
                        "to_dense",
                        &self.size,
                    )?;
                }
                let row: usize = self.size[sparse_dims..].iter().product();
                let mut seen = std::collections::HashSet::new();
                for j in 0..nnz {
                    let at: usize = (0..sparse_dims).map(|d| idx[d * nnz + j] as usize * dstrides[d]).sum();
                    if !seen.insert(at) {
                        return Err(Error::shape(
                            "to_dense",
                            &self.size,
                            "the COO tensor has repeated coordinates; coalesce it first",
                        ));
                    }
                    put(at, j * row, row);
                }
            }
            layout => {
                let c = self.indices[0].to_vec::<i64>()?;
                let p = self.indices[1].to_vec::<i64>()?;
                let (br, bc) = match layout {
                    SparseLayout::Bsr | SparseLayout::Bsc => (self.values.shape()[1], self.values.shape()[2]),
                    _ => (1, 1),
                };
                let by_rows = matches!(layout, SparseLayout::Csr | SparseLayout::Bsr);
                let (outer, inner) = if by_rows {
                    (self.size[0] / br, self.size[1] / bc)
                } else {
                    (self.size[1] / bc, self.size[0] / br)
                };
                if c.len() != outer + 1
                    || c[0] != 0
                    || c[outer] != p.len() as i64
                    || c.windows(2).any(|w| w[0] > w[1])
                {
                    return Err(Error::shape(
                        "to_dense",
                        &self.size,
                        format!("{layout:?} compressed indices changed since construction: {c:?}"),
                    ));
                }
                check_range(&p, inner, "plain indices", "to_dense", &self.size)?;
                for o in 0..c.len() - 1 {
                    for (k, &plain) in p.iter().enumerate().take(c[o + 1] as usize).skip(c[o] as usize) {
                        let (r, col) = if by_rows { (o, plain as usize) } else { (plain as usize, o) };
                        for i in 0..br {
                            put((r * br + i) * dstrides[0] + col * bc, (k * br + i) * bc, bc);
                        }
                    }
                }
            }
        }
        Ok(dense)
    }
}

#[cfg(test)]
mod shared_index_tests {
    use super::*;

    #[test]
    fn to_dense_rechecks_indices_changed_after_construction() {
        let mut idx = Tensor::from_vec(vec![0i64, 1], &[1, 2]).unwrap();
        idx.share_memory().unwrap();
        let vals = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
        let s = SparseTensor::coo(idx.clone(), vals, &[2]).unwrap();
        // Another holder of the shared index tensor writes an index out of range.
        idx.narrow(1, 1, 1).unwrap().fill(1i64 << 40).unwrap();
        let err = s.to_dense().unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }
}
