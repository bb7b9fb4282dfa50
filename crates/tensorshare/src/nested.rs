//! [`NestedTensor`]: tensors whose first dimension differs, packed in one buffer (torch's
//! jagged layout): the buffer plus each component's size and offset.

use crate::tensor::contiguous_strides;
use crate::{DType, Error, Result, Tensor};

/// Components of equal trailing shape and dtype, different lengths, one contiguous buffer.
#[derive(Clone, Debug)]
pub struct NestedTensor {
    pub(crate) buffer: Tensor,
    pub(crate) sizes: Vec<Vec<usize>>,
    pub(crate) offsets: Vec<usize>,
}

impl NestedTensor {
    /// Packs `tensors` (same dtype, same number of dimensions ≥ 1, same sizes after the
    /// first) into one private buffer.
    pub fn from_tensors(tensors: &[Tensor]) -> Result<NestedTensor> {
        const OP: &str = "NestedTensor::from_tensors";
        let first = tensors
            .first()
            .ok_or_else(|| Error::shape(OP, &[], "a nested tensor needs at least one component"))?;
        if first.ndim() == 0 {
            return Err(Error::shape(
                OP,
                first.shape(),
                "nested tensor components must have at least one dimension",
            ));
        }
        for (i, t) in tensors.iter().enumerate() {
            if t.dtype() != first.dtype() || t.ndim() != first.ndim() || t.shape()[1..] != first.shape()[1..]
            {
                return Err(Error::shape(
                    OP,
                    t.shape(),
                    format!(
                        "component {i} is {} {:?}, component 0 is {} {:?}: only the first dimension may differ",
                        t.dtype(),
                        t.shape(),
                        first.dtype(),
                        first.shape()
                    ),
                ));
            }
        }
        let total =
            tensors.iter().try_fold(0usize, |acc, t| acc.checked_add(t.numel())).ok_or_else(|| {
                Error::shape(
                    OP,
                    first.shape(),
                    "the components of a nested tensor have too many elements in all",
                )
            })?;
        let buffer = Tensor::try_zeros(&[total], first.dtype())?;
        let mut offsets = Vec::with_capacity(tensors.len());
        let mut at = 0;
        for t in tensors {
            offsets.push(at);
            let mut dst = buffer.narrow(0, at, t.numel())?.reshape(t.shape())?;
            t.copy_into(&mut dst)?;
            at += t.numel();
        }
        Ok(NestedTensor { buffer, sizes: tensors.iter().map(|t| t.shape().to_vec()).collect(), offsets })
    }

    /// Rebuilds a nested tensor from its parts, checking that each component fits the
    /// buffer.
    pub fn from_parts(buffer: Tensor, sizes: Vec<Vec<usize>>, offsets: Vec<usize>) -> Result<NestedTensor> {
        const OP: &str = "NestedTensor::from_parts";
        if buffer.ndim() != 1 || !buffer.is_contiguous() {
            return Err(Error::shape(
                OP,
                buffer.shape(),
                "a nested tensor's buffer must be 1-D and contiguous",
            ));
        }
        if sizes.len() != offsets.len() || sizes.is_empty() {
            return Err(Error::shape(
                OP,
                buffer.shape(),
                "a nested tensor needs one offset per component, and a component",
            ));
        }
        for (size, &off) in sizes.iter().zip(&offsets) {
            let n = crate::tensor::checked_numel(size)?;
            if size.is_empty()
                || size[1..] != sizes[0][1..]
                || off.checked_add(n).is_none_or(|e| e > buffer.numel())
            {
                return Err(Error::shape(
                    OP,
                    size,
                    format!(
                        "nested component of size {size:?} at offset {off} does not fit a buffer of {} elements",
                        buffer.numel()
                    ),
                ));
            }
        }
        Ok(NestedTensor { buffer, sizes, offsets })
    }

    /// The components again, as views of the buffer.
    pub fn unbind(&self) -> Vec<Tensor> {
        self.sizes
            .iter()
            .zip(&self.offsets)
            .map(|(size, &off)| {
                let n = size.iter().product();
                // Construction checked that every component fits the buffer.
                self.buffer
                    .narrow(0, off, n)
                    .and_then(|t| t.reshape(size))
                    .expect("component fits its buffer")
            })
            .collect()
    }

    /// Number of components.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Whether there are no components (never true: construction needs one).
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buffer.dtype()
    }

    /// The buffer holding every component.
    pub fn buffer(&self) -> &Tensor {
        &self.buffer
    }

    /// Each component's shape.
    pub fn sizes(&self) -> &[Vec<usize>] {
        &self.sizes
    }

    /// Each component's strides (contiguous).
    pub fn strides(&self) -> Vec<Vec<usize>> {
        self.sizes.iter().map(|s| contiguous_strides(s).into_vec()).collect()
    }

    /// Each component's first element in the buffer.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Moves the buffer into shared memory.
    pub fn share_memory(&mut self) -> Result<()> {
        self.buffer.share_memory().map(|_| ())
    }

    /// Whether the buffer is in shared memory.
    pub fn is_shared(&self) -> bool {
        self.buffer.is_shared()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbind_gives_the_components_back() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let b = Tensor::from_vec(vec![5.0f32, 6.0], &[1, 2]).unwrap();
        let n = NestedTensor::from_tensors(&[a.clone(), b.clone()]).unwrap();
        let parts = n.unbind();
        assert!(parts[0].equal(&a) && parts[1].equal(&b));
        assert_eq!(n.offsets(), &[0, 4]);
        let c = Tensor::zeros(&[2, 3], DType::F32);
        assert!(NestedTensor::from_tensors(&[a, c]).is_err());
    }
}
