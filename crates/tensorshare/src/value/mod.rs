//! [`Value`]: the cross-language value, what a Rust process and a Python process exchange
//! through one [`Queue`].
//!
//! A Python process using the `tensorshare` package puts and gets Python values; on the wire
//! they are `Value`s, so a Rust process with a `Queue<Value>` (or a `SimpleQueue<Value>`, or
//! a `Connection<Value>`) on the other end sees them, and what it puts reaches Python as the
//! matching Python value. The mapping (the README's "Rust and Python" has the table):
//!
//! | Python | `Value` |
//! |---|---|
//! | `None`, `bool`, `int` (in i64's range), `float`, `str`, `bytes` | `None`, `Bool`, `Int`, `Float`, `Str`, `Bytes` |
//! | `int` in [2^63, 2^64) (a Rust `u64` beyond i64) | `UInt` |
//! | `list`, `tuple`, `dict` | `List`, `Tuple`, `Dict` (pairs, in insertion order) |
//! | `torch.Tensor` (also `Parameter`, `requires_grad`) | `Tensor` |
//! | `numpy.ndarray` | `Array` |
//! | a tensorshare queue | `Queue`, `SimpleQueue` |
//! | an end of a tensorshare `Pipe()` | `Connection` |
//! | anything else (a lambda, a class instance, an `int` beyond u64 or below i64) | `Object`: pickled by value, tensors inside it travel beside the pickle as handles |
//!
//! Tensors travel as handles into shared memory, as everywhere in tensorshare: the receiver,
//! Rust or Python, maps the sender's memory.

use serde::{Deserialize, Serialize};

use crate::{Connection, Queue, SimpleQueue, Tensor};

pub(crate) mod bridge;
mod de;
mod ser;

pub use de::{from_value, DeError};
pub use ser::{to_value, SerError};

/// How deeply values may nest in a message: a peer cannot make a receiver overflow its
/// stack with a value nested a million levels deep.
pub const MAX_DEPTH: usize = 256;

/// A value of the cross-language wire: see the [module](self) docs for the mapping to Python.
/// A received value nests at most [`MAX_DEPTH`] levels; a deeper one is a bad message.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(remote = "Value")]
pub enum Value {
    /// Python's `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` that fits in i64 (one in [2^63, 2^64) is a `UInt`; a bigger one, or one
    /// below i64, travels as an `Object`).
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes`.
    Bytes(
        #[serde(serialize_with = "ser_bytes", deserialize_with = "crate::wire::bytes::deserialize")] Vec<u8>,
    ),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `dict`: its items, in order.
    Dict(Vec<(Value, Value)>),
    /// A tensor, a `torch.Tensor` in Python.
    Tensor(Tensor),
    /// A tensor that is a `numpy.ndarray` in Python.
    Array(Tensor),
    /// A queue whose values are `Value`s.
    Queue(Queue<Value>),
    /// A simple queue whose values are `Value`s.
    SimpleQueue(SimpleQueue<Value>),
    /// A Python object pickled by value (cloudpickle), opaque to Rust: `pickle` refers to
    /// `tensors` by index (a persistent id), so the tensors inside it still travel as handles.
    Object {
        /// The pickle.
        #[serde(serialize_with = "ser_bytes", deserialize_with = "crate::wire::bytes::deserialize")]
        pickle: Vec<u8>,
        /// The tensors and arrays it holds, in the order its persistent ids name them.
        tensors: Vec<Value>,
    },
    /// One end of a pipe whose values are `Value`s (an end of Python's `Pipe()`).
    Connection(Connection<Value>),
    /// An `int` in [2^63, 2^64): beyond `Int`, within `u64` (a Rust `u64` such as a hash or
    /// a seed). Senders write an integer that fits an `Int` as an `Int`; a received `UInt`
    /// of any size is that number.
    UInt(u64),
}

thread_local! {
    /// How deeply the `Value` being read (`DEPTH`) and the one being written (`WRITING`) on
    /// this thread are nested at the moment.
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static WRITING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One level of a nested value being read or written, counted in `counter` while it lives.
struct Level(&'static std::thread::LocalKey<std::cell::Cell<usize>>);

impl Level {
    /// Enters a level: the new depth, counted until the `Level` is dropped.
    fn enter(counter: &'static std::thread::LocalKey<std::cell::Cell<usize>>) -> (Level, usize) {
        let depth = counter.with(|c| {
            c.set(c.get() + 1);
            c.get()
        });
        (Level(counter), depth)
    }
}

impl Drop for Level {
    fn drop(&mut self) {
        self.0.with(|c| c.set(c.get() - 1));
    }
}

impl Serialize for Value {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        // Inside `to_value`, a `Value` field stays what it is.
        if let Some(index) = bridge::put(|| self.clone()) {
            return s.serialize_newtype_struct(bridge::TOKEN, &index);
        }
        // A value no receiver would read (see `MAX_DEPTH`) is refused by its sender.
        let (_level, depth) = Level::enter(&WRITING);
        if depth > MAX_DEPTH {
            return Err(crate::wire::ser_error(format!(
                "a value nested deeper than {MAX_DEPTH} levels (no receiver would read it)"
            )));
        }
        Value::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Value, D::Error> {
        let (_level, depth) = Level::enter(&DEPTH);
        if depth > MAX_DEPTH {
            return Err(crate::wire::de_error(format!("a value nested deeper than {MAX_DEPTH} levels")));
        }
        // Inside `from_value`, a `Value` field takes whatever is there.
        if bridge::active() {
            return bridge::receive(d);
        }
        Value::deserialize(d)
    }
}

fn ser_bytes<S: serde::Serializer>(b: &[u8], s: S) -> std::result::Result<S::Ok, S::Error> {
    crate::wire::bytes::Bytes(b).serialize(s)
}

impl Value {
    /// The value under `key` of a `Dict` whose keys are strings; `None` when there is none
    /// or this is not a `Dict`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => {
                items.iter().find(|(k, _)| matches!(k, Value::Str(s) if s == key)).map(|(_, v)| v)
            }
            _ => None,
        }
    }

    /// The tensor of a `Tensor` or an `Array`.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) | Value::Array(t) => Some(t),
            _ => None,
        }
    }

    /// The integer of an `Int`, or of a `UInt` within `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::UInt(u) => i64::try_from(*u).ok(),
            _ => None,
        }
    }

    /// The integer of a `UInt`, or of an `Int` that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            Value::UInt(u) => Some(*u),
            _ => None,
        }
    }

    /// The number of a `Float`, or of an `Int` or a `UInt` as a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            Value::UInt(u) => Some(*u as f64),
            _ => None,
        }
    }

    /// The text of a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a `List` or a `Tuple`.
    pub fn as_slice(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// A `Dict` with string keys, from `(key, value)` pairs.
    pub fn dict<K: Into<String>>(items: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Dict(items.into_iter().map(|(k, v)| (Value::Str(k.into()), v)).collect())
    }
}

macro_rules! from_impls {
    ($($t:ty => $v:ident $(as $cast:ty)?),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Value {
                Value::$v(x $(as $cast)?)
            }
        }
    )*};
}

from_impls! {
    bool => Bool, i64 => Int, i32 => Int as i64, u32 => Int as i64, f64 => Float,
    f32 => Float as f64, String => Str, Tensor => Tensor,
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::Str(s.to_owned())
    }
}

impl From<Vec<Value>> for Value {
    fn from(v: Vec<Value>) -> Value {
        Value::List(v)
    }
}

impl From<()> for Value {
    fn from(_: ()) -> Value {
        Value::None
    }
}
