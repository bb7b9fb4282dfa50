//! [`from_value`]: a [`Value`] as any `Deserialize` type, tensors kept as tensors.

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};

use super::{bridge, Value};
use crate::{Error, Result};

/// `value` as a `T`, reading it the way [`to_value`](super::to_value) writes: a struct from
/// a `Dict` keyed by field names, a `Vec` from a `List` or a `Tuple`, an `Option` from `None`
/// or the value, an enum from its variant's name (`Str`) or a `Dict` of one item. A tensor
/// field takes a `Tensor` or an `Array` as it is; a `Value` field takes whatever is there;
/// both (and queue fields) in every shape serde reads, an internally tagged or untagged enum
/// and a flattened struct included.
/// A mismatch is [`Error::InvalidMessage`], saying what was expected, what came, and where
/// (`at batches[1].labels[0]: invalid type: ...`: dict keys and list positions from the top;
/// inside an untagged or internally tagged enum, which serde reads from a buffer, from
/// there).
pub fn from_value<T: DeserializeOwned>(value: Value) -> Result<T> {
    let _bridge = bridge::Bridge::open();
    T::deserialize(ValueDeserializer(value)).map_err(|e| Error::InvalidMessage(e.to_string()))
}

/// A deserialization error: its text, and where in the value it happened.
#[derive(Debug)]
pub struct DeError {
    msg: String,
    /// Dict keys (`name`, or `[key]` for keys that are not strings) and list positions
    /// (`[i]`), innermost first.
    path: Vec<String>,
}

impl DeError {
    fn new(msg: String) -> DeError {
        DeError { msg, path: Vec::new() }
    }

    /// The error, one level further out: inside `segment` of the value around it.
    fn at(mut self, segment: String) -> DeError {
        self.path.push(segment);
        self
    }
}

impl std::fmt::Display for DeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            return f.write_str(&self.msg);
        }
        f.write_str("at ")?;
        for (i, seg) in self.path.iter().rev().enumerate() {
            if i > 0 && !seg.starts_with('[') {
                f.write_str(".")?;
            }
            f.write_str(seg)?;
        }
        write!(f, ": {}", self.msg)
    }
}

/// How a dict key reads in an error's path.
fn key_segment(k: &Value) -> String {
    match k {
        Value::Str(s) => s.clone(),
        Value::Int(i) => format!("[{i}]"),
        Value::UInt(u) => format!("[{u}]"),
        Value::Bool(b) => format!("[{b}]"),
        other => format!("[{}]", kind(other)),
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: std::fmt::Display>(msg: T) -> DeError {
        DeError::new(msg.to_string())
    }

    /// A newtype where something else was expected is, while a conversion is open, a bridged
    /// value that serde buffered (see `bridge::marker`): said as what it is.
    fn invalid_type(unexpected: de::Unexpected<'_>, expected: &dyn de::Expected) -> DeError {
        if unexpected == de::Unexpected::NewtypeStruct && bridge::active() {
            return DeError::new(format!(
                "a tensor, an array, a queue, a pickled object or a pipe's end where {expected} was expected"
            ));
        }
        DeError::new(format!("invalid type: {unexpected}, expected {expected}"))
    }
}

type R<T> = std::result::Result<T, DeError>;

fn kind(v: &Value) -> &'static str {
    v.kind()
}

impl Value {
    /// What this is, in words ("a tensor", "a dict"), for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) | Value::UInt(_) => "an int",
            Value::Float(_) => "a float",
            Value::Str(_) => "a str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Dict(_) => "a dict",
            Value::Tensor(_) => "a tensor",
            Value::Array(_) => "an array",
            Value::Queue(_) => "a Queue",
            Value::SimpleQueue(_) => "a SimpleQueue",
            Value::Object { .. } => {
                "a pickled Python object (which Rust cannot read: a Python int outside i64 and u64, a set, \
                 an instance of a class, a numpy scalar, ...; the Python value that holds one may be \
                 pickled whole, so convert such items before sending, e.g. int(x) of a numpy scalar)"
            }
            Value::Connection(_) => "a pipe's end",
        }
    }
}

struct ValueDeserializer(Value);

impl ValueDeserializer {
    /// The value as what it is to serde. A tensor, an array, a queue, a pickled object or a
    /// pipe's end has no serde shape: `bridged` (`deserialize_any`, which serde also buffers
    /// values with, for a tagged or untagged enum or a flattened struct) hands it over as a
    /// bridge's marker, which a tensor or `Value` field takes back from the buffer; else (a
    /// field of another type, which cannot take it) it is an error naming both.
    fn plain<'de, V: Visitor<'de>>(self, visitor: V, bridged: bool) -> R<V::Value> {
        match self.0 {
            Value::None => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(b),
            Value::Int(i) => visitor.visit_i64(i),
            Value::UInt(u) => visitor.visit_u64(u),
            Value::Float(f) => visitor.visit_f64(f),
            Value::Str(s) => visitor.visit_string(s),
            Value::Bytes(b) => visitor.visit_byte_buf(b),
            Value::List(items) | Value::Tuple(items) => {
                let len = items.len();
                let mut seq = Seq(items.into_iter().enumerate());
                let out = visitor.visit_seq(&mut seq)?;
                if seq.0.len() != 0 {
                    return Err(de::Error::invalid_length(len, &"fewer elements"));
                }
                Ok(out)
            }
            Value::Dict(items) => visitor.visit_map(Map { items: items.into_iter(), value: None }),
            other if bridged => match bridge::marker(other) {
                Ok(marker) => visitor.visit_newtype_struct(marker),
                Err(other) => {
                    Err(DeError::new(format!("{} where {} was expected", kind(&other), Expected(&visitor))))
                }
            },
            other => Err(DeError::new(format!("{} where {} was expected", kind(&other), Expected(&visitor)))),
        }
    }
}

/// Deserializer methods for types that read one shape: the value as it is, never a marker.
macro_rules! plain {
    ($($method:ident $(($($arg:ident: $ty:ty),*))?;)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($($arg: $ty,)*)? visitor: V) -> R<V::Value> {
            $($(let _ = $arg;)*)?
            self.plain(visitor, false)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for ValueDeserializer {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.plain(visitor, true)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        drop(self);
        visitor.visit_unit()
    }

    plain! {
        deserialize_bool; deserialize_i8; deserialize_i16; deserialize_i32; deserialize_i64;
        deserialize_i128; deserialize_u8; deserialize_u16; deserialize_u32; deserialize_u64;
        deserialize_u128; deserialize_f32; deserialize_f64; deserialize_char; deserialize_str;
        deserialize_string; deserialize_bytes; deserialize_byte_buf; deserialize_unit;
        deserialize_unit_struct(name: &'static str); deserialize_seq; deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize); deserialize_map;
        deserialize_struct(name: &'static str, fields: &'static [&'static str]); deserialize_identifier;
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        match self.0 {
            Value::None => visitor.visit_none(),
            other => visitor.visit_some(ValueDeserializer(other)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> R<V::Value> {
        if name == bridge::TOKEN {
            let index = bridge::put(|| self.0).ok_or_else(|| DeError::new("no conversion is open".into()))?;
            return visitor.visit_i64(index);
        }
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> R<V::Value> {
        match self.0 {
            Value::Str(s) => visitor.visit_enum(s.into_deserializer()),
            Value::Dict(mut items) if items.len() == 1 => {
                let (k, v) = items.pop().expect("one item");
                match k {
                    Value::Str(variant) => visitor.visit_enum(Enum { variant, value: v }),
                    other => {
                        Err(DeError::new(format!("an enum variant named by {}, not a str", kind(&other))))
                    }
                }
            }
            other => Err(DeError::new(format!(
                "{} where an enum (a variant's name, or a dict of one item) was expected",
                kind(&other)
            ))),
        }
    }
}

struct Expected<'a, V>(&'a V);

impl<'de, V: Visitor<'de>> std::fmt::Display for Expected<'_, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.expecting(f)
    }
}

struct Seq(std::iter::Enumerate<std::vec::IntoIter<Value>>);

impl<'de> de::SeqAccess<'de> for Seq {
    type Error = DeError;
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> R<Option<T::Value>> {
        match self.0.next() {
            Some((i, v)) => {
                seed.deserialize(ValueDeserializer(v)).map(Some).map_err(|e| e.at(format!("[{i}]")))
            }
            None => Ok(None),
        }
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Map {
    items: std::vec::IntoIter<(Value, Value)>,
    /// The value of the key last read, and the key as an error's path says it.
    value: Option<(Value, String)>,
}

impl<'de> de::MapAccess<'de> for Map {
    type Error = DeError;
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> R<Option<K::Value>> {
        match self.items.next() {
            Some((k, v)) => {
                let at = key_segment(&k);
                self.value = Some((v, at.clone()));
                seed.deserialize(ValueDeserializer(k)).map(Some).map_err(|e| e.at(at))
            }
            None => Ok(None),
        }
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> R<V::Value> {
        let (v, at) =
            self.value.take().ok_or_else(|| DeError::new("a map value asked for before its key".into()))?;
        seed.deserialize(ValueDeserializer(v)).map_err(|e| e.at(at))
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

struct Enum {
    variant: String,
    value: Value,
}

impl<'de> de::EnumAccess<'de> for Enum {
    type Error = DeError;
    type Variant = ValueDeserializer;
    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> R<(V::Value, ValueDeserializer)> {
        let name = seed.deserialize(self.variant.into_deserializer())?;
        Ok((name, ValueDeserializer(self.value)))
    }
}

impl<'de> de::VariantAccess<'de> for ValueDeserializer {
    type Error = DeError;
    fn unit_variant(self) -> R<()> {
        match self.0 {
            Value::None => Ok(()),
            other => Err(DeError::new(format!("{} for a variant without content", kind(&other)))),
        }
    }
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> R<T::Value> {
        seed.deserialize(self)
    }
    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> R<V::Value> {
        self.plain(visitor, false)
    }
    fn struct_variant<V: Visitor<'de>>(self, _fields: &'static [&'static str], visitor: V) -> R<V::Value> {
        self.plain(visitor, false)
    }
}
