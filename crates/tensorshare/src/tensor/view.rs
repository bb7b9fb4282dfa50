//! Views: new geometry over the same storage.

use super::{checked_numel, contiguous_strides, Dims, Tensor};
use crate::{Error, Result};

impl Tensor {
    /// Moves the first element of a view that was just cut out of `self`'s geometry by
    /// `steps` strides of `stride` elements. A view without elements keeps its offset: it
    /// addresses nothing, its base's offset is known to be in bounds, and the move, made of
    /// strides of empty dimensions, might not even fit in usize.
    fn move_offset(&mut self, steps: usize, stride: usize) {
        if !self.shape.contains(&0) {
            // Not empty: the new first element is an element of the base view, whose address
            // is in bounds (check_bounds), so neither the product nor the sum overflows.
            self.offset += steps * stride;
        }
    }

    fn check_dim(&self, dim: usize, op: &'static str) -> Result<()> {
        if dim >= self.ndim() {
            return Err(Error::shape(
                op,
                &self.shape,
                format!(
                    "dimension {dim} is out of range for a tensor of {} dimensions (shape {:?})",
                    self.ndim(),
                    self.shape
                ),
            ));
        }
        Ok(())
    }

    /// The elements `start..start + len` along `dim`, as a view.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.check_dim(dim, "narrow")?;
        let size = self.shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::shape(
                "narrow",
                &self.shape,
                format!("{start}..{start}+{len} is out of range for dimension {dim} of size {size}"),
            ));
        }
        let mut t = self.clone();
        t.shape[dim] = len;
        t.move_offset(start, self.strides[dim]);
        Ok(t)
    }

    /// The slice at `index` along `dim`, as a view with that dimension removed.
    pub fn select(&self, dim: usize, index: usize) -> Result<Tensor> {
        self.check_dim(dim, "select")?;
        if index >= self.shape[dim] {
            return Err(Error::shape(
                "select",
                &self.shape,
                format!("index {index} is out of range for dimension {dim} of size {}", self.shape[dim]),
            ));
        }
        let mut t = self.clone();
        t.shape.remove(dim);
        t.strides.remove(dim);
        t.move_offset(index, self.strides[dim]);
        Ok(t)
    }

    /// Swaps two dimensions, as a view.
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.check_dim(dim0, "transpose")?;
        self.check_dim(dim1, "transpose")?;
        let mut t = self.clone();
        t.shape.swap(dim0, dim1);
        t.strides.swap(dim0, dim1);
        Ok(t)
    }

    /// The transpose of a 2-D tensor, as a view.
    pub fn t(&self) -> Result<Tensor> {
        if self.ndim() != 2 {
            return Err(Error::shape(
                "t",
                &self.shape,
                format!("needs a 2-D tensor, this one has shape {:?}", self.shape),
            ));
        }
        self.transpose(0, 1)
    }

    /// Reorders the dimensions: dimension `i` of the result is `dims[i]` of this tensor.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let n = self.ndim();
        let mut seen = vec![false; n];
        if dims.len() != n || dims.iter().any(|&d| d >= n || std::mem::replace(&mut seen[d], true)) {
            return Err(Error::shape(
                "permute",
                &self.shape,
                format!("{dims:?} is not a permutation of the {n} dimensions of shape {:?}", self.shape),
            ));
        }
        let mut t = self.clone();
        t.shape = dims.iter().map(|&d| self.shape[d]).collect();
        t.strides = dims.iter().map(|&d| self.strides[d]).collect();
        Ok(t)
    }

    /// Adds a dimension of size one at `dim`, as a view.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.ndim() {
            return Err(Error::shape(
                "unsqueeze",
                &self.shape,
                format!("dimension {dim} is out of range for a tensor of {} dimensions", self.ndim()),
            ));
        }
        let mut t = self.clone();
        // The stride of a dimension of size one never moves an address, so saturating is
        // harmless (it happens only next to an empty dimension).
        let stride = self.strides.get(dim).map(|&s| s.saturating_mul(self.shape[dim])).unwrap_or(1);
        t.shape.insert(dim, 1);
        t.strides.insert(dim, stride);
        Ok(t)
    }

    /// The same elements with another shape: a view when the strides allow it (as torch's
    /// `view`), otherwise a contiguous copy (as torch's `reshape`).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let n = checked_numel(shape)?;
        if n != self.numel() {
            return Err(Error::shape(
                "reshape",
                &self.shape,
                format!(
                    "shape {shape:?} has {n} elements, the tensor (shape {:?}) has {}",
                    self.shape,
                    self.numel()
                ),
            ));
        }
        if let Some(strides) = view_strides(&self.shape, &self.strides, shape) {
            let mut t = self.clone();
            t.shape = shape.into();
            t.strides = strides;
            return Ok(t);
        }
        self.contiguous()?.reshape(shape)
    }

    /// Whether [`Tensor::reshape`] to `shape` would be a view (no copy).
    pub fn can_view_as(&self, shape: &[usize]) -> bool {
        checked_numel(shape).ok() == Some(self.numel())
            && view_strides(&self.shape, &self.strides, shape).is_some()
    }

    /// This tensor if it is contiguous, otherwise a contiguous private copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            return self.to_cpu()?.to_device(self.device);
        }
        self.check_cpu()?;
        let mut t = Tensor::try_zeros(&self.shape, self.dtype)?;
        t.requires_grad = self.requires_grad;
        t.kind = self.kind;
        self.copy_into(&mut t)?;
        Ok(t)
    }
}

/// Strides that let `new` view the elements of (`old`, `old_strides`) in row-major order,
/// if they exist (torch's `computeStride`): each run of old dimensions that is contiguous
/// within itself may be split or merged freely.
fn view_strides(old: &[usize], old_strides: &[usize], new: &[usize]) -> Option<Dims> {
    if old.is_empty() || old.contains(&0) {
        return Some(contiguous_strides(new));
    }
    let mut new_strides = Dims::from(new);
    let mut view_d = new.len() as isize - 1;
    let mut chunk_base = *old_strides.last()?;
    let mut tensor_numel = 1usize;
    let mut view_numel = 1usize;
    for d in (0..old.len()).rev() {
        tensor_numel *= old[d];
        let chunk_ends = d == 0 || (old[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base);
        if chunk_ends {
            while view_d >= 0 && (view_numel < tensor_numel || new[view_d as usize] == 1) {
                new_strides[view_d as usize] = view_numel * chunk_base;
                view_numel *= new[view_d as usize];
                view_d -= 1;
            }
            if view_numel != tensor_numel {
                return None;
            }
            if d > 0 {
                chunk_base = old_strides[d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    (view_d == -1).then_some(new_strides)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn arange(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n as i64).collect(), shape).unwrap()
    }

    #[test]
    fn narrow_select_transpose() {
        let t = arange(&[3, 4]);
        assert_eq!(t.narrow(1, 1, 2).unwrap().to_vec::<i64>().unwrap(), vec![1, 2, 5, 6, 9, 10]);
        assert_eq!(t.select(1, 3).unwrap().to_vec::<i64>().unwrap(), vec![3, 7, 11]);
        let tt = t.t().unwrap();
        assert_eq!(tt.shape(), &[4, 3]);
        assert!(!tt.is_contiguous());
        assert_eq!(tt.to_vec::<i64>().unwrap()[..4], [0, 4, 8, 1]);
        assert!(t.narrow(1, 3, 2).unwrap_err().to_string().contains("out of range"));
        assert!(t.select(2, 0).unwrap_err().to_string().contains("dimension 2"));
    }

    #[test]
    fn reshape_is_a_view_when_possible() {
        let t = arange(&[2, 3, 4]);
        let r = t.reshape(&[6, 4]).unwrap();
        assert!(r.storage().ptr_eq(t.storage()));
        // A transposed tensor cannot be flattened without a copy.
        let tt = t.transpose(0, 2).unwrap();
        assert!(!tt.can_view_as(&[24]));
        let flat = tt.reshape(&[24]).unwrap();
        assert!(!flat.storage().ptr_eq(t.storage()));
        assert_eq!(flat.to_vec::<i64>().unwrap(), tt.to_vec::<i64>().unwrap());
        // But splitting a dimension of it is a view.
        assert!(tt.can_view_as(&[2, 2, 3, 2]));
        assert!(t.reshape(&[5]).is_err());
    }

    #[test]
    fn permute_rejects_non_permutations() {
        let t = Tensor::zeros(&[2, 3], DType::U8);
        assert!(t.permute(&[0, 0]).is_err());
        assert!(t.permute(&[1]).is_err());
        assert_eq!(t.permute(&[1, 0]).unwrap().shape(), &[3, 2]);
    }
}
