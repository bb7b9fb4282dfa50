//! Building a sparse tensor from its parts, checked: shapes, dtypes, index ranges, and for
//! the compressed layouts that the compressed indices rise from 0 to nnz. A COO tensor
//! knows whether it is coalesced.

use super::{SparseLayout, SparseTensor};
use crate::{DType, Error, Result, Tensor};

/// The constructor of `layout`, as errors name it.
fn op_of(layout: SparseLayout) -> &'static str {
    match layout {
        SparseLayout::Coo => "SparseTensor::coo",
        SparseLayout::Csr => "SparseTensor::csr",
        SparseLayout::Csc => "SparseTensor::csc",
        SparseLayout::Bsr => "SparseTensor::bsr",
        SparseLayout::Bsc => "SparseTensor::bsc",
    }
}

fn index_values(t: &Tensor, what: &str, op: &'static str, size: &[usize]) -> Result<Vec<i64>> {
    if t.dtype() != DType::I64 {
        return Err(Error::shape(op, size, format!("{what} must be int64, got {}", t.dtype())));
    }
    t.to_vec::<i64>()
}

pub(super) fn check_range(
    v: &[i64],
    bound: usize,
    what: &str,
    op: &'static str,
    size: &[usize],
) -> Result<()> {
    if let Some(bad) = v.iter().find(|&&x| x < 0 || x as u64 >= bound as u64) {
        return Err(Error::shape(op, size, format!("{what} holds {bad}, outside 0..{bound}")));
    }
    Ok(())
}

impl SparseTensor {
    /// A COO tensor: `indices` is `[sparse_dims, nnz]` (int64), `values` is
    /// `[nnz, dense dims...]`, `size` is the sparse dims followed by the dense dims.
    pub fn coo(indices: Tensor, values: Tensor, size: &[usize]) -> Result<SparseTensor> {
        const OP: &str = "SparseTensor::coo";
        if indices.ndim() != 2 {
            return Err(Error::shape(
                OP,
                size,
                format!("COO indices must be 2-D, got shape {:?}", indices.shape()),
            ));
        }
        let (sparse_dims, nnz) = (indices.shape()[0], indices.shape()[1]);
        if values.ndim() == 0 || values.shape()[0] != nnz {
            return Err(Error::shape(
                OP,
                size,
                format!(
                    "COO values must have {nnz} rows (one per index column), got shape {:?}",
                    values.shape()
                ),
            ));
        }
        // values.ndim() >= 1 (checked above); an absurd sparse_dims (an index tensor of shape
        // [huge, 0]) must not overflow.
        if sparse_dims.checked_add(values.ndim() - 1) != Some(size.len())
            || values.shape()[1..] != size[sparse_dims..]
        {
            return Err(Error::shape(
                OP,
                size,
                format!(
                    "COO size {size:?} does not match {sparse_dims} sparse dims and values of shape {:?}",
                    values.shape()
                ),
            ));
        }
        let idx = index_values(&indices, "COO indices", OP, size)?;
        for d in 0..sparse_dims {
            check_range(&idx[d * nnz..(d + 1) * nnz], size[d], &format!("COO indices row {d}"), OP, size)?;
        }
        // Coalesced: coordinates strictly increasing in row-major order (sorted, no repeats).
        let idx = &idx;
        let coord = |j: usize| (0..sparse_dims).map(move |d| idx[d * nnz + j]);
        let coalesced = (1..nnz).all(|j| coord(j - 1).lt(coord(j)));
        Ok(SparseTensor {
            layout: SparseLayout::Coo,
            size: size.to_vec(),
            indices: vec![indices],
            values,
            coalesced,
        })
    }

    /// A CSR matrix of `size` `[rows, cols]`.
    pub fn csr(
        crow_indices: Tensor,
        col_indices: Tensor,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        SparseTensor::compressed(SparseLayout::Csr, crow_indices, col_indices, values, size)
    }

    /// A CSC matrix of `size` `[rows, cols]`.
    pub fn csc(
        ccol_indices: Tensor,
        row_indices: Tensor,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        SparseTensor::compressed(SparseLayout::Csc, ccol_indices, row_indices, values, size)
    }

    /// A BSR matrix of `size` `[rows, cols]`, values `[nnz, block_rows, block_cols]`.
    pub fn bsr(
        crow_indices: Tensor,
        col_indices: Tensor,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        SparseTensor::compressed(SparseLayout::Bsr, crow_indices, col_indices, values, size)
    }

    /// A BSC matrix of `size` `[rows, cols]`, values `[nnz, block_rows, block_cols]`.
    pub fn bsc(
        ccol_indices: Tensor,
        row_indices: Tensor,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        SparseTensor::compressed(SparseLayout::Bsc, ccol_indices, row_indices, values, size)
    }

    /// Builds and checks any layout from its parts (as `parts()` returns them).
    pub fn from_parts(
        layout: SparseLayout,
        mut indices: Vec<Tensor>,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        match (layout, indices.len()) {
            (SparseLayout::Coo, 1) => SparseTensor::coo(indices.remove(0), values, size),
            (SparseLayout::Coo, n) => Err(Error::shape(
                "SparseTensor::from_parts",
                size,
                format!("a COO tensor has 1 index tensor, not {n}"),
            )),
            (_, 2) => {
                let plain = indices.remove(1);
                let compressed = indices.remove(0);
                SparseTensor::compressed(layout, compressed, plain, values, size)
            }
            (_, n) => Err(Error::shape(
                "SparseTensor::from_parts",
                size,
                format!("a {layout:?} tensor has 2 index tensors, not {n}"),
            )),
        }
    }

    fn compressed(
        layout: SparseLayout,
        compressed: Tensor,
        plain: Tensor,
        values: Tensor,
        size: &[usize],
    ) -> Result<SparseTensor> {
        let op = op_of(layout);
        if size.len() != 2 {
            return Err(Error::shape(op, size, format!("a {layout:?} tensor is 2-D, got size {size:?}")));
        }
        let (block_rows, block_cols) = match layout {
            SparseLayout::Bsr | SparseLayout::Bsc => {
                if values.ndim() != 3 {
                    return Err(Error::shape(
                        op,
                        size,
                        format!(
                            "{layout:?} values must be [nnz, block_rows, block_cols], got {:?}",
                            values.shape()
                        ),
                    ));
                }
                (values.shape()[1], values.shape()[2])
            }
            _ => (1, 1),
        };
        if block_rows == 0 || block_cols == 0 || size[0] % block_rows != 0 || size[1] % block_cols != 0 {
            return Err(Error::shape(
                op,
                size,
                format!("blocks of {block_rows}x{block_cols} do not tile a {}x{} matrix", size[0], size[1]),
            ));
        }
        let (rows, cols) = (size[0] / block_rows, size[1] / block_cols);
        let by_rows = matches!(layout, SparseLayout::Csr | SparseLayout::Bsr);
        let (outer, inner) = if by_rows { (rows, cols) } else { (cols, rows) };
        let Some(n_compressed) = outer.checked_add(1) else {
            return Err(Error::shape(
                op,
                size,
                format!("a {layout:?} tensor of size {size:?} has too many rows or columns"),
            ));
        };
        if compressed.ndim() != 1 || compressed.shape()[0] != n_compressed {
            return Err(Error::shape(
                op,
                size,
                format!(
                    "{layout:?} compressed indices must have shape [{n_compressed}], got {:?}",
                    compressed.shape()
                ),
            ));
        }
        if plain.ndim() != 1 {
            return Err(Error::shape(
                op,
                size,
                format!("{layout:?} plain indices must be 1-D, got {:?}", plain.shape()),
            ));
        }
        let nnz = plain.shape()[0];
        if values.ndim() == 0 || values.shape()[0] != nnz {
            return Err(Error::shape(
                op,
                size,
                format!("{layout:?} values must have {nnz} entries, got shape {:?}", values.shape()),
            ));
        }
        if matches!(layout, SparseLayout::Csr | SparseLayout::Csc) && values.ndim() != 1 {
            return Err(Error::shape(
                op,
                size,
                format!("{layout:?} values must be 1-D, got {:?}", values.shape()),
            ));
        }
        let c = index_values(&compressed, "compressed indices", op, size)?;
        if c[0] != 0 || c[outer] != nnz as i64 || c.windows(2).any(|w| w[0] > w[1]) {
            return Err(Error::shape(
                op,
                size,
                format!("{layout:?} compressed indices must rise from 0 to nnz ({nnz}), got {c:?}"),
            ));
        }
        check_range(&index_values(&plain, "plain indices", op, size)?, inner, "plain indices", op, size)?;
        Ok(SparseTensor {
            layout,
            size: size.to_vec(),
            indices: vec![compressed, plain],
            values,
            coalesced: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i64s(v: &[i64]) -> Tensor {
        Tensor::from_slice(v, &[v.len()]).unwrap()
    }

    #[test]
    fn coo_round_trips_to_dense_and_knows_coalescing() {
        let idx = Tensor::from_vec(vec![0i64, 1, 1, 2, 0, 2], &[2, 3]).unwrap();
        let vals = Tensor::from_vec(vec![3.0f32, 4.0, 5.0], &[3]).unwrap();
        let s = SparseTensor::coo(idx, vals.clone(), &[2, 3]).unwrap();
        assert!(s.is_coalesced());
        assert_eq!(s.to_dense().unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0, 3.0, 4.0, 0.0, 5.0]);
        let unsorted = Tensor::from_vec(vec![1i64, 0, 0, 2, 0, 2], &[2, 3]).unwrap();
        assert!(!SparseTensor::coo(unsorted, vals.clone(), &[2, 3]).unwrap().is_coalesced());
        let out_of_range = Tensor::from_vec(vec![0i64, 1, 5, 0, 0, 0], &[2, 3]).unwrap();
        assert!(SparseTensor::coo(out_of_range, vals, &[2, 3]).is_err());
    }

    #[test]
    fn compressed_layouts_check_and_densify() {
        // [[1, 0], [0, 2]]
        let v = Tensor::from_vec(vec![1i32, 2], &[2]).unwrap();
        let csr = SparseTensor::csr(i64s(&[0, 1, 2]), i64s(&[0, 1]), v.clone(), &[2, 2]).unwrap();
        let csc = SparseTensor::csc(i64s(&[0, 1, 2]), i64s(&[0, 1]), v.clone(), &[2, 2]).unwrap();
        assert_eq!(csr.to_dense().unwrap().to_vec::<i32>().unwrap(), vec![1, 0, 0, 2]);
        assert!(csr.to_dense().unwrap().equal(&csc.to_dense().unwrap()));
        assert!(SparseTensor::csr(i64s(&[0, 2, 1]), i64s(&[0, 1]), v.clone(), &[2, 2]).is_err());
        assert!(SparseTensor::csr(i64s(&[0, 1]), i64s(&[0, 1]), v, &[2, 2]).is_err());
        // One 2x2 block at block (0, 1) of a 2x4 matrix.
        let blocks = Tensor::from_vec(vec![1i32, 2, 3, 4], &[1, 2, 2]).unwrap();
        let bsr = SparseTensor::bsr(i64s(&[0, 1]), i64s(&[1]), blocks.clone(), &[2, 4]).unwrap();
        assert_eq!(bsr.to_dense().unwrap().to_vec::<i32>().unwrap(), vec![0, 0, 1, 2, 0, 0, 3, 4]);
        let bsc = SparseTensor::bsc(i64s(&[0, 0, 1]), i64s(&[0]), blocks.clone(), &[2, 4]).unwrap();
        assert!(bsc.to_dense().unwrap().equal(&bsr.to_dense().unwrap()));
        assert!(SparseTensor::bsr(i64s(&[0, 1]), i64s(&[1]), blocks, &[3, 4]).is_err());
    }
}
