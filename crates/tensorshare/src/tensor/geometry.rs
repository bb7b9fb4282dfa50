//! Shape arithmetic, and the bounds check that every tensor, made here or received,
//! passes: the number of elements and the byte size fit, and every element a view
//! addresses lies in its storage.

use crate::{DType, Error, Result};

/// Strides of a contiguous (row-major) tensor of `shape`, in elements.
pub(crate) fn contiguous_strides(shape: &[usize]) -> super::Dims {
    let mut strides = super::Dims::from(shape);
    let mut acc = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// `a * b` in the arithmetic of `shape`, as an error instead of an overflow.
fn checked_mul(a: usize, b: usize, shape: &[usize], what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::shape("size", shape, format!("{what} of shape {shape:?} overflows usize")))
}

/// Number of elements of `shape`, or an error if it overflows.
pub(crate) fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| checked_mul(acc, d, shape, "the number of elements"))
}

/// Byte size of a tensor of `shape`, or an error if it overflows or exceeds `isize::MAX`
/// (the most any allocation, or a Rust slice, can hold).
pub(crate) fn byte_len(shape: &[usize], dtype: DType) -> Result<usize> {
    let len = checked_mul(checked_numel(shape)?, dtype.size(), shape, "the byte size")?;
    if len > isize::MAX as usize {
        return Err(Error::shape(
            "size",
            shape,
            format!("a {dtype} tensor of shape {shape:?} would need {len} bytes, more than any allocation can hold"),
        ));
    }
    Ok(len)
}

/// Checks that a view with this geometry stays inside a storage of `storage_len` bytes.
/// Every tensor, made here or received, passes this, so element addresses computed from
/// shape, strides and offset are always in bounds; so is the address of the first element
/// of a view without elements (it is formed, never read), which may be one past the end.
pub(crate) fn check_bounds(
    storage_len: usize,
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Result<()> {
    if shape.len() != strides.len() {
        return Err(Error::shape(
            "from_storage",
            shape,
            format!("shape {shape:?} and strides {strides:?} have different lengths"),
        ));
    }
    byte_len(shape, dtype)?;
    let out_of_bounds = |needs: &dyn std::fmt::Display| {
        Error::shape(
            "from_storage",
            shape,
            format!(
                "a {dtype} view of shape {shape:?}, strides {strides:?} and offset {offset} needs {needs} bytes, \
                 its storage has {storage_len}"
            ),
        )
    };
    if checked_numel(shape)? == 0 {
        return match offset.checked_mul(dtype.size()) {
            Some(start) if start <= storage_len => Ok(()),
            Some(start) => Err(out_of_bounds(&start)),
            None => Err(Error::shape("from_storage", shape, "the tensor's offset overflows")),
        };
    }
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(strides) {
        let span = checked_mul(d - 1, s, shape, "the extent")?;
        last = last
            .checked_add(span)
            .ok_or_else(|| Error::shape("from_storage", shape, "the tensor's extent overflows"))?;
    }
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(dtype.size()))
        .ok_or_else(|| Error::shape("from_storage", shape, "the tensor's extent overflows"))?;
    if end > storage_len {
        return Err(out_of_bounds(&end));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{DType, Storage, Tensor};

    #[test]
    fn views_without_elements_start_inside_their_storage() {
        let s = Storage::new(16);
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 4).is_ok(), "one past the end");
        let e = Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 5).unwrap_err();
        assert!(e.to_string().contains("needs 20 bytes"), "{e}");
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 1 << 62).is_err());
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0, 3], &[1, 1], usize::MAX).is_err());
        assert!(Tensor::from_storage(s, DType::U8, &[1 << 63], &[0], 0).is_err(), "more bytes than isize");
        // Views cut from an empty tensor keep its offset, however large their strides.
        let t = Tensor::zeros(&[1 << 40, 0, 1 << 40], DType::U8);
        let v = t.select(0, (1 << 40) - 1).unwrap().narrow(1, (1 << 40) - 2, 1).unwrap();
        assert_eq!((v.shape(), v.storage_offset()), (&[0, 1][..], 0));
        assert!(v.to_vec::<u8>().unwrap().is_empty());
    }

    #[test]
    fn from_storage_checks_bounds() {
        let s = Storage::new(16);
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[2, 2], &[2, 1], 0).is_ok());
        let e = Tensor::from_storage(s.clone(), DType::F32, &[2, 2], &[2, 1], 1).unwrap_err();
        assert!(e.to_string().contains("needs 20 bytes"), "{e}");
        assert!(Tensor::from_storage(s, DType::F32, &[2, usize::MAX], &[2, 2], 0).is_err());
    }
}
