//! How tensors, storages, sparse and nested tensors serialize: inside a message as handles
//! into the message's storage table, anywhere else by value.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::bytes::{ByteBuf, Bytes};
use crate::tensor::{contiguous_strides, Dims};
use crate::{DType, Device, NestedTensor, SparseLayout, SparseTensor, Storage, Tensor, TensorKind};

// layering: inside value::to_value and from_value, a tensor crosses untouched through the
// value layer's bridge (which holds Values), not through the codec.
use crate::value::{bridge, Value};

#[derive(Deserialize)]
struct Meta {
    dtype: DType,
    shape: Dims,
    strides: Dims,
    offset: usize,
    requires_grad: bool,
    kind: TensorKind,
    device: Device,
}

/// `Meta` as it is written: the same fields, borrowed from the tensor (a slice serializes
/// as a `Vec` does), so that encoding a tensor copies none of its geometry.
#[derive(Serialize)]
struct MetaOut<'a> {
    dtype: DType,
    shape: &'a [usize],
    strides: &'a [usize],
    offset: usize,
    requires_grad: bool,
    kind: TensorKind,
    device: Device,
}

#[derive(Serialize)]
enum TensorOut<'a> {
    /// In a message: index of the storage in the message's table.
    Handle { storage: u32, meta: MetaOut<'a> },
    /// Anywhere else: the elements, row-major.
    Value { data: Bytes<'a>, meta: MetaOut<'a> },
    /// No data (meta device).
    NoData { meta: MetaOut<'a> },
}

#[derive(Deserialize)]
enum TensorIn {
    Handle { storage: u32, meta: Meta },
    Value { data: ByteBuf, meta: Meta },
    NoData { meta: Meta },
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Inside `value::to_value`, the tensor stays a tensor.
        if let Some(index) = bridge::put(|| Value::Tensor(self.clone())) {
            return s.serialize_newtype_struct(bridge::TOKEN, &index);
        }
        let meta = |strides, offset| MetaOut {
            dtype: self.dtype,
            shape: &self.shape,
            strides,
            offset,
            requires_grad: self.requires_grad,
            kind: self.kind,
            device: self.device,
        };
        match self.device {
            Device::Meta => TensorOut::NoData { meta: meta(&self.strides, 0) }.serialize(s),
            Device::Cpu | Device::Cuda(_) if super::encoding() => {
                let storage = super::encode_storage(&self.storage).map_err(super::ser_error)?;
                TensorOut::Handle { storage, meta: meta(&self.strides, self.offset) }.serialize(s)
            }
            Device::Cpu | Device::Cuda(_) => {
                let data = self.to_bytes().map_err(super::ser_error)?;
                let strides = contiguous_strides(&self.shape);
                TensorOut::Value { data: Bytes(&data), meta: meta(&strides, 0) }.serialize(s)
            }
        }
    }
}

fn build(storage: Storage, m: Meta) -> crate::Result<Tensor> {
    if m.requires_grad && !m.dtype.is_float() {
        return Err(crate::Error::invalid(format!("a {} tensor cannot require gradients", m.dtype)));
    }
    if storage.device() != m.device {
        return Err(crate::Error::invalid(format!(
            "a tensor on {} names a storage on {}",
            m.device,
            storage.device()
        )));
    }
    let mut t = Tensor::from_storage_owned(storage, m.dtype, m.shape, m.strides, m.offset)
        .map_err(|e| crate::Error::invalid(format!("tensor handle: {e}")))?;
    t.requires_grad = m.requires_grad;
    t.kind = m.kind;
    Ok(t)
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Tensor, D::Error> {
        // Inside `value::from_value`, a tensor field takes the tensor (or array) there.
        if bridge::active() {
            return match bridge::receive(d)? {
                Value::Tensor(t) | Value::Array(t) => Ok(t),
                other => Err(super::de_error(format!("{} where a tensor was expected", other.kind()))),
            };
        }
        let t = match TensorIn::deserialize(d)? {
            TensorIn::Handle { storage, meta } => {
                if meta.device == Device::Meta {
                    return Err(super::de_error("a storage handle for a tensor on the meta device"));
                }
                super::decode_storage(storage).and_then(|st| build(st, meta))
            }
            TensorIn::Value { data, meta } => {
                let storage = Storage::new(data.0.len());
                // SAFETY: the fresh private storage has exactly data.len() bytes.
                unsafe { std::ptr::copy_nonoverlapping(data.0.as_ptr(), storage.as_mut_ptr(), data.0.len()) };
                let n = crate::tensor::checked_numel(&meta.shape).map_err(super::de_error)?;
                if n.checked_mul(meta.dtype.size()) != Some(data.0.len()) {
                    return Err(super::de_error(format!(
                        "a {} tensor of shape {:?} with {} bytes of data",
                        meta.dtype,
                        meta.shape,
                        data.0.len()
                    )));
                }
                let device = meta.device;
                let meta =
                    Meta { strides: contiguous_strides(&meta.shape), offset: 0, device: Device::Cpu, ..meta };
                match device {
                    Device::Cpu => build(storage, meta),
                    Device::Meta => Err(crate::Error::invalid("a tensor on the meta device with data")),
                    #[cfg(feature = "cuda")]
                    Device::Cuda(_) => build(storage, meta).and_then(|t| t.to_device(device)),
                    #[cfg(not(feature = "cuda"))]
                    Device::Cuda(i) => Err(crate::Error::Device(format!(
                        "a tensor on cuda:{i} arrived, but this build has no CUDA support (feature `cuda`)"
                    ))),
                }
            }
            TensorIn::NoData { meta } => {
                if meta.device != Device::Meta {
                    return Err(super::de_error("a cpu tensor without data"));
                }
                let mut t = Tensor::try_meta_strided(&meta.shape, &meta.strides, meta.dtype)
                    .map_err(super::de_error)?;
                t.requires_grad = meta.requires_grad && meta.dtype.is_float();
                t.kind = meta.kind;
                Ok(t)
            }
        };
        t.map_err(super::de_error)
    }
}

#[derive(Serialize)]
enum StorageOut<'a> {
    Handle(u32),
    Value(Bytes<'a>),
}

#[derive(Deserialize)]
enum StorageIn {
    Handle(u32),
    Value(ByteBuf),
}

impl Serialize for Storage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if super::encoding() {
            StorageOut::Handle(super::encode_storage(self).map_err(super::ser_error)?).serialize(s)
        } else {
            StorageOut::Value(Bytes(&self.try_to_bytes().map_err(super::ser_error)?)).serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Storage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Storage, D::Error> {
        match StorageIn::deserialize(d)? {
            StorageIn::Handle(i) => super::decode_storage(i).map_err(super::de_error),
            StorageIn::Value(b) => {
                let s = Storage::new(b.0.len());
                // SAFETY: the fresh private storage has exactly b.len() bytes.
                unsafe { std::ptr::copy_nonoverlapping(b.0.as_ptr(), s.as_mut_ptr(), b.0.len()) };
                Ok(s)
            }
        }
    }
}

#[derive(Serialize, Deserialize)]
struct SparseRepr {
    layout: SparseLayout,
    size: Vec<usize>,
    indices: Vec<Tensor>,
    values: Tensor,
}

impl Serialize for SparseTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        SparseRepr {
            layout: self.layout,
            size: self.size.clone(),
            indices: self.indices.clone(),
            values: self.values.clone(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for SparseTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SparseTensor, D::Error> {
        let r = SparseRepr::deserialize(d)?;
        SparseTensor::from_parts(r.layout, r.indices, r.values, &r.size).map_err(super::de_error)
    }
}

#[derive(Serialize, Deserialize)]
struct NestedRepr {
    buffer: Tensor,
    sizes: Vec<Vec<usize>>,
    offsets: Vec<usize>,
}

impl Serialize for NestedTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        NestedRepr { buffer: self.buffer.clone(), sizes: self.sizes.clone(), offsets: self.offsets.clone() }
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for NestedTensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<NestedTensor, D::Error> {
        let r = NestedRepr::deserialize(d)?;
        NestedTensor::from_parts(r.buffer, r.sizes, r.offsets).map_err(super::de_error)
    }
}
