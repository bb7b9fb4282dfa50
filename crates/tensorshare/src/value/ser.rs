//! [`to_value`]: any `Serialize` value as a [`Value`], tensors kept as tensors.

use serde::ser::{self, Serialize};

use super::{bridge, Value};
use crate::{Error, Result};

/// `value` as a [`Value`], the shape a Python process sees: a struct becomes a `Dict` keyed
/// by field names, a tuple a `Tuple`, a `Vec` a `List`, a map a `Dict`, `Option::None` and
/// `()` `None`, an enum's unit variant its name as a `Str`, and any other variant a `Dict` of
/// one item, its name to its content. Tensors (and `Value`s inside the value) stay what they
/// are. An integer beyond the range of `i64` is an error (Python would get it, but the
/// wire's `Int` is 64 bits).
pub fn to_value<T: Serialize + ?Sized>(value: &T) -> Result<Value> {
    let _bridge = bridge::Bridge::open();
    value.serialize(ValueSerializer).map_err(|e| Error::Serialize(e.0))
}

/// A serialization error (its text).
#[derive(Debug)]
pub struct SerError(String);

impl std::fmt::Display for SerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SerError {}

impl ser::Error for SerError {
    fn custom<T: std::fmt::Display>(msg: T) -> SerError {
        SerError(msg.to_string())
    }
}

type R = std::result::Result<Value, SerError>;

struct ValueSerializer;

thread_local! {
    /// How many levels the value being made is nested at, under its top.
    static LEVELS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// `value` as the `Value` nested `levels` deeper than the one being made: an error, before
/// `value` is looked at, where it would be nested deeper than [`MAX_DEPTH`](super::MAX_DEPTH)
/// (no receiver reads such a message, and a value nested a million levels deep would have
/// overflowed the stack).
fn child<T: Serialize + ?Sized>(value: &T, levels: usize) -> R {
    struct Back(usize);
    impl Drop for Back {
        fn drop(&mut self) {
            LEVELS.with(|l| l.set(self.0));
        }
    }
    let before = LEVELS.with(|l| l.get());
    let now = before.saturating_add(levels);
    if now >= super::MAX_DEPTH {
        return Err(SerError(format!(
            "a value nested deeper than {} levels (no receiver would read it)",
            super::MAX_DEPTH
        )));
    }
    LEVELS.with(|l| l.set(now));
    let _back = Back(before);
    value.serialize(ValueSerializer)
}

/// An integer as the wire holds it: an `Int` where it fits, else a `UInt` where it fits.
fn int<T: TryInto<i64> + TryInto<u64> + std::fmt::Display + Copy>(v: T) -> R {
    if let Ok(i) = v.try_into() {
        return Ok(Value::Int(i));
    }
    v.try_into().map(Value::UInt).map_err(|_| {
        SerError(format!(
            "the integer {v} is outside the range of i64 and of u64, which the wire's Int and UInt hold \
             (send a larger one as a str, or as bytes)"
        ))
    })
}

fn variant(name: &str, content: Value) -> Value {
    Value::Dict(vec![(Value::Str(name.to_owned()), content)])
}

impl ser::Serializer for ValueSerializer {
    type Ok = Value;
    type Error = SerError;
    type SerializeSeq = Seq;
    type SerializeTuple = Seq;
    type SerializeTupleStruct = Seq;
    type SerializeTupleVariant = Seq;
    type SerializeMap = Map;
    type SerializeStruct = Map;
    type SerializeStructVariant = Map;

    fn serialize_bool(self, v: bool) -> R {
        Ok(Value::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> R {
        int(v)
    }
    fn serialize_i16(self, v: i16) -> R {
        int(v)
    }
    fn serialize_i32(self, v: i32) -> R {
        int(v)
    }
    fn serialize_i64(self, v: i64) -> R {
        int(v)
    }
    fn serialize_i128(self, v: i128) -> R {
        int(v)
    }
    fn serialize_u8(self, v: u8) -> R {
        int(v)
    }
    fn serialize_u16(self, v: u16) -> R {
        int(v)
    }
    fn serialize_u32(self, v: u32) -> R {
        int(v)
    }
    fn serialize_u64(self, v: u64) -> R {
        int(v)
    }
    fn serialize_u128(self, v: u128) -> R {
        int(v)
    }
    fn serialize_f32(self, v: f32) -> R {
        Ok(Value::Float(f64::from(v)))
    }
    fn serialize_f64(self, v: f64) -> R {
        Ok(Value::Float(v))
    }
    fn serialize_char(self, v: char) -> R {
        Ok(Value::Str(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> R {
        Ok(Value::Str(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> R {
        Ok(Value::Bytes(v.to_vec()))
    }
    fn serialize_none(self) -> R {
        Ok(Value::None)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> R {
        value.serialize(self)
    }
    fn serialize_unit(self) -> R {
        Ok(Value::None)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> R {
        Ok(Value::None)
    }
    fn serialize_unit_variant(self, _name: &'static str, _index: u32, variant: &'static str) -> R {
        Ok(Value::Str(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, name: &'static str, value: &T) -> R {
        if name == bridge::TOKEN {
            // A tensor or a Value, handed over through the bridge by its index.
            let index = match value.serialize(ValueSerializer)? {
                Value::Int(i) => i,
                _ => return Err(SerError("a malformed bridged value".into())),
            };
            return bridge::take(index).ok_or_else(|| SerError("a bridged value taken twice".into()));
        }
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        name: &'static str,
        value: &T,
    ) -> R {
        Ok(variant(name, child(value, 1)?))
    }
    fn serialize_seq(self, len: Option<usize>) -> std::result::Result<Seq, SerError> {
        Ok(Seq { items: Vec::with_capacity(len.unwrap_or(0).min(4096)), kind: SeqKind::List })
    }
    fn serialize_tuple(self, len: usize) -> std::result::Result<Seq, SerError> {
        Ok(Seq { items: Vec::with_capacity(len.min(4096)), kind: SeqKind::Tuple })
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> std::result::Result<Seq, SerError> {
        self.serialize_tuple(len)
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> std::result::Result<Seq, SerError> {
        Ok(Seq { items: Vec::with_capacity(len.min(4096)), kind: SeqKind::Variant(variant) })
    }
    fn serialize_map(self, len: Option<usize>) -> std::result::Result<Map, SerError> {
        Ok(Map { items: Vec::with_capacity(len.unwrap_or(0).min(4096)), key: None, variant: None })
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> std::result::Result<Map, SerError> {
        Ok(Map { items: Vec::with_capacity(len.min(4096)), key: None, variant: None })
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> std::result::Result<Map, SerError> {
        Ok(Map { items: Vec::with_capacity(len.min(4096)), key: None, variant: Some(variant) })
    }
}

enum SeqKind {
    List,
    Tuple,
    Variant(&'static str),
}

#[doc(hidden)]
pub struct Seq {
    items: Vec<Value>,
    kind: SeqKind,
}

impl Seq {
    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        let levels = if matches!(self.kind, SeqKind::Variant(_)) { 2 } else { 1 };
        self.items.push(child(value, levels)?);
        Ok(())
    }
    fn done(self) -> R {
        Ok(match self.kind {
            SeqKind::List => Value::List(self.items),
            SeqKind::Tuple => Value::Tuple(self.items),
            SeqKind::Variant(name) => variant(name, Value::Tuple(self.items)),
        })
    }
}

impl ser::SerializeSeq for Seq {
    type Ok = Value;
    type Error = SerError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        self.push(value)
    }
    fn end(self) -> R {
        self.done()
    }
}

impl ser::SerializeTuple for Seq {
    type Ok = Value;
    type Error = SerError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        self.push(value)
    }
    fn end(self) -> R {
        self.done()
    }
}

impl ser::SerializeTupleStruct for Seq {
    type Ok = Value;
    type Error = SerError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        self.push(value)
    }
    fn end(self) -> R {
        self.done()
    }
}

impl ser::SerializeTupleVariant for Seq {
    type Ok = Value;
    type Error = SerError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        self.push(value)
    }
    fn end(self) -> R {
        self.done()
    }
}

#[doc(hidden)]
pub struct Map {
    items: Vec<(Value, Value)>,
    key: Option<Value>,
    variant: Option<&'static str>,
}

impl Map {
    fn done(self) -> R {
        let dict = Value::Dict(self.items);
        Ok(match self.variant {
            Some(name) => variant(name, dict),
            None => dict,
        })
    }
    fn field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> std::result::Result<(), SerError> {
        let levels = if self.variant.is_some() { 2 } else { 1 };
        self.items.push((Value::Str(key.to_owned()), child(value, levels)?));
        Ok(())
    }
}

impl ser::SerializeMap for Map {
    type Ok = Value;
    type Error = SerError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> std::result::Result<(), SerError> {
        self.key = Some(child(key, 1)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> std::result::Result<(), SerError> {
        let key = self.key.take().ok_or_else(|| SerError("a map value without its key".into()))?;
        self.items.push((key, child(value, 1)?));
        Ok(())
    }
    fn end(self) -> R {
        self.done()
    }
}

impl ser::SerializeStruct for Map {
    type Ok = Value;
    type Error = SerError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> std::result::Result<(), SerError> {
        self.field(key, value)
    }
    fn end(self) -> R {
        self.done()
    }
}

impl ser::SerializeStructVariant for Map {
    type Ok = Value;
    type Error = SerError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> std::result::Result<(), SerError> {
        self.field(key, value)
    }
    fn end(self) -> R {
        self.done()
    }
}
