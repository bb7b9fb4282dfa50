//! How tensors (and `Value`s) cross [`to_value`](super::to_value) and
//! [`from_value`](super::from_value) untouched: while one of those runs on this thread, a
//! tensor serializes as a newtype struct named [`TOKEN`] holding its index in a table here,
//! and deserializes by taking its entry back.
//!
//! serde reads some shapes (an internally tagged or untagged enum, a flattened struct) by
//! buffering the value first through `deserialize_any`, which knows nothing of tensors. There a
//! tensor, an array, a queue or a pickled object is buffered as a marker (see [`Marker`]): a
//! newtype holding a one-item map from this bridge's key to its index; [`receive`] knows the
//! marker again and clones its entry (an untagged enum may read the buffer once per variant
//! it tries).

use std::cell::RefCell;
use std::hash::{BuildHasher, Hasher};

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use super::Value;

/// The name of the newtype struct a bridged value travels as.
pub(crate) const TOKEN: &str = "$tensorshare::Value";

/// The values of one open bridge, and the key of its markers once one is made.
struct Table {
    entries: Vec<Option<Value>>,
    key: Option<String>,
}

thread_local! {
    static TABLE: RefCell<Option<Table>> = const { RefCell::new(None) };
}

/// An open bridge on this thread; the previous one (a conversion inside a conversion) is
/// back when this is dropped.
pub(crate) struct Bridge {
    saved: Option<Table>,
}

impl Bridge {
    pub(crate) fn open() -> Bridge {
        Bridge { saved: TABLE.with(|t| t.replace(Some(Table { entries: Vec::new(), key: None }))) }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let table = TABLE.with(|t| t.replace(self.saved.take()));
        drop(table);
    }
}

/// Whether a bridge is open on this thread.
pub(crate) fn active() -> bool {
    TABLE.with(|t| t.borrow().is_some())
}

/// Puts the value `make` makes into the open bridge; its index, or `None` when no bridge is
/// open (and then `make` is not called).
pub(crate) fn put(make: impl FnOnce() -> Value) -> Option<i64> {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let table = t.as_mut()?;
        table.entries.push(Some(make()));
        i64::try_from(table.entries.len() - 1).ok()
    })
}

/// Takes entry `index` back out of the open bridge.
pub(crate) fn take(index: i64) -> Option<Value> {
    let i = usize::try_from(index).ok()?;
    TABLE.with(|t| t.borrow_mut().as_mut()?.entries.get_mut(i)?.take())
}

/// A copy of entry `index` of the open bridge, which stays.
fn copy(index: i64) -> Option<Value> {
    let i = usize::try_from(index).ok()?;
    TABLE.with(|t| t.borrow().as_ref()?.entries.get(i)?.clone())
}

/// Puts `value` into the open bridge as a marker (see [`Marker`]): a value that only a
/// bridged reader takes (a tensor, an array, a queue, a pickled object, a pipe's end), as
/// `deserialize_any` hands it to a visitor. `value` back when no bridge is open.
pub(crate) fn marker(value: Value) -> Result<Marker, Value> {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let Some(table) = t.as_mut() else { return Err(value) };
        // The key of the bridge's markers: the token and a random number drawn for this
        // bridge (`RandomState` takes its keys from the operating system's randomness), so
        // that no map in a received value passes for a marker.
        let key = table
            .key
            .get_or_insert_with(|| {
                let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
                format!("{TOKEN}#{random:016x}")
            })
            .clone();
        let Ok(index) = i64::try_from(table.entries.len()) else { return Err(value) };
        table.entries.push(Some(value));
        Ok(Marker { key, index: Some(index) })
    })
}

/// Whether `k` is the key of the open bridge's markers.
fn is_key(k: &str) -> bool {
    TABLE.with(|t| t.borrow().as_ref().and_then(|t| t.key.as_deref()) == Some(k))
}

/// A bridged value as serde's buffer holds it (see [`marker`]): a map of one item, the
/// bridge's key to the value's index.
pub(crate) struct Marker {
    key: String,
    index: Option<i64>,
}

impl<'de> Deserializer<'de> for Marker {
    type Error = super::DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_map(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl<'de> MapAccess<'de> for Marker {
    type Error = super::DeError;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        if self.index.is_none() {
            return Ok(None);
        }
        seed.deserialize(de::value::StrDeserializer::new(&self.key)).map(Some)
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Self::Error> {
        let index = self.index.take().ok_or_else(|| de::Error::custom("a marker's value asked for twice"))?;
        seed.deserialize(de::value::I64Deserializer::new(index))
    }
}

/// The value a bridged reader (a tensor, a queue or a `Value` being deserialized while a
/// bridge is open) finds: the one handed over by its index, a marker's copy, or any other
/// value as a `Value` (for a `Value` field buffered by serde; a tensor field refuses it).
pub(crate) fn receive<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    d.deserialize_newtype_struct(TOKEN, Received)
}

struct Received;

impl<'de> Visitor<'de> for Received {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a value")
    }

    /// Only the deserializer of `from_value` reads a bridged newtype as its index.
    fn visit_i64<E: de::Error>(self, index: i64) -> Result<Value, E> {
        take(index).ok_or_else(|| E::custom("a bridged value taken twice"))
    }

    /// serde's buffer (or another deserializer): whatever value is there.
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Buffered)
    }
}

/// A value buffered by serde, read back as a `Value`; a marker, as the value it stands for.
struct Buffered;

/// One item of a buffered sequence or map.
struct Item(Value);

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Item, D::Error> {
        d.deserialize_any(Buffered).map(Item)
    }
}

impl<'de> Visitor<'de> for Buffered {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(i64::try_from(v).map_or(Value::UInt(v), Value::Int))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::Bytes(v.to_vec()))
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Value, E> {
        Ok(Value::Bytes(v))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Buffered)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Buffered)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(Item(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
        while let Some((Item(k), Item(v))) = map.next_entry()? {
            items.push((k, v));
        }
        if let [(Value::Str(k), Value::Int(index))] = items.as_slice() {
            if is_key(k) {
                return copy(*index).ok_or_else(|| de::Error::custom("a marker of no bridged value"));
            }
        }
        Ok(Value::Dict(items))
    }
}
