//! How tensors (and `Value`s) cross [`to_value`](super::to_value) and
//! [`from_value`](super::from_value) untouched: while one of those runs on this thread, a
//! tensor serializes as a newtype struct named [`TOKEN`] holding its index in a table here,
//! and deserializes by taking its entry back.

use std::cell::RefCell;

use super::Value;

/// The name of the newtype struct a bridged value travels as.
pub(crate) const TOKEN: &str = "$tensorshare::Value";

thread_local! {
    static TABLE: RefCell<Option<Vec<Option<Value>>>> = const { RefCell::new(None) };
}

/// An open bridge on this thread; the previous one (a conversion inside a conversion) is
/// back when this is dropped.
pub(crate) struct Bridge {
    saved: Option<Vec<Option<Value>>>,
}

impl Bridge {
    pub(crate) fn open() -> Bridge {
        Bridge { saved: TABLE.with(|t| t.replace(Some(Vec::new()))) }
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
        table.push(Some(make()));
        i64::try_from(table.len() - 1).ok()
    })
}

/// Takes entry `index` back out of the open bridge.
pub(crate) fn take(index: i64) -> Option<Value> {
    let i = usize::try_from(index).ok()?;
    TABLE.with(|t| t.borrow_mut().as_mut()?.get_mut(i)?.take())
}

/// Reads a bridged value's index.
pub(crate) struct IndexVisitor;

impl serde::de::Visitor<'_> for IndexVisitor {
    type Value = i64;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a tensor")
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<i64, E> {
        Ok(v)
    }
}
