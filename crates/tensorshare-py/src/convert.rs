//! Python values into [`Value`]s and back, in Rust: containers and scalars directly, tensors
//! and arrays as handles to their blocks, anything else pickled by value (with the tensors
//! inside it still as handles), through `tensorshare._reduction`.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tensorshare::{DType, Device, Message, Tensor, TensorKind, Value};

use crate::queue::PyQueue;
use crate::{to_py, Block};

/// Why a value could not be turned into a `Value` directly.
pub(crate) enum Refused {
    /// Nested deeper than [`tensorshare::value::MAX_DEPTH`], holding one list, dict,
    /// pickled object or handle in more than one place (it contains itself, or two places
    /// name it), or holding an object to pickle beside anything it might share (see
    /// [`Seen`]): the caller pickles the whole value instead, whose memo keeps each such
    /// object one object in the receiver, as pickle (and torch.multiprocessing) does.
    Whole,
    /// A Python error (a tensor refused, a helper failed).
    Err(PyErr),
}

impl From<PyErr> for Refused {
    fn from(e: PyErr) -> Refused {
        Refused::Err(e)
    }
}

fn helpers(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("tensorshare._reduction")
}

/// `obj` as a value; a value nested too deeply, or holding an object twice or an object to
/// pickle beside what it might share (see [`Refused::Whole`]), is pickled whole.
pub(crate) fn to_value(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    crate::torch::keeping_moved_memory(|| value_whole(py, obj))
}

fn value_whole(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    let mut seen = Seen::default();
    let mut v = match value_of(py, obj, 0, &mut seen) {
        Ok(v) => v,
        Err(Refused::Whole) => return pickled(py, obj),
        Err(Refused::Err(e)) => return Err(e),
    };
    let Some((deferred, depth)) = seen.deferred.take() else { return Ok(v) };
    // Only the object itself was met: beside it are numbers, strings, bytes and tuples of
    // them, which it cannot share with the receiver's copy of the value.
    if seen.met.len() > 1 {
        return pickled(py, obj);
    }
    let mut p = match pickled_at(py, deferred.bind(py), depth) {
        Ok(p) => Some(p),
        Err(Refused::Whole) => return pickled(py, obj),
        Err(Refused::Err(e)) => return Err(e),
    };
    fill_deferred(&mut v, &mut p);
    Ok(v)
}

/// Where the object [`value_of`] deferred goes: a `Value` no message has (an `Object` with
/// an empty pickle), replaced once the value is known by [`fill_deferred`].
fn deferred_place() -> Value {
    Value::Object { pickle: Vec::new(), tensors: Vec::new() }
}

/// Puts `p` in the place [`deferred_place`] left in `v` (there is one: a value defers one
/// object); `true` once it is there.
fn fill_deferred(v: &mut Value, p: &mut Option<Value>) -> bool {
    match v {
        Value::Object { pickle, .. } if pickle.is_empty() => {
            if let Some(p) = p.take() {
                *v = p;
            }
            true
        }
        Value::List(items) | Value::Tuple(items) => items.iter_mut().any(|i| fill_deferred(i, p)),
        Value::Dict(items) => items.iter_mut().any(|(k, i)| fill_deferred(k, p) || fill_deferred(i, p)),
        _ => false,
    }
}

fn pickled(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    let (pickle, inner): (Vec<u8>, Vec<Bound<'_, PyAny>>) =
        helpers(py)?.call_method1("dumps", (obj,))?.extract()?;
    let mut tensors = Vec::with_capacity(inner.len());
    for t in &inner {
        // Handles only: what the pickler set aside is never pickled again, so no object
        // can send this round in a circle, whatever the pickler was told.
        tensors.push(handle_of(py, t)?.ok_or_else(|| {
            let class = t.get_type().fully_qualified_name().map_or_else(|_| "?".into(), |n| n.to_string());
            PyValueError::new_err(format!(
                "a pickled object named a {class} to send as a handle, which it is not"
            ))
        })?);
    }
    Ok(Value::Object { pickle, tensors })
}

/// `obj` as a handle, when it travels as one: a queue, a pipe end, a torch tensor or a numpy
/// array (over its block, moved or copied into one first when it is elsewhere); `None` for
/// anything else.
fn handle_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Option<Value>> {
    if let Ok(q) = obj.cast::<PyQueue>() {
        return Ok(Some(q.get().value()));
    }
    if let Ok(c) = obj.cast::<crate::pipe::PyConnection>() {
        return Ok(Some(c.get().value(py)?));
    }
    if let Some(api) = crate::torch::api(py)? {
        if let Some(v) = crate::torch::to_tensor(py, api, obj)? {
            return Ok(Some(v));
        }
    }
    // tensorshare.multiprocessing's Queue and SimpleQueue (not JoinableQueue, whose
    // semaphores only travel by pickling) are the queue they wrap.
    let queues = py.import("tensorshare.multiprocessing._queues")?;
    for class in ["Queue", "SimpleQueue"] {
        if obj.get_type().is(&queues.getattr(class)?) {
            let q = obj.getattr("_q")?;
            return Ok(Some(q.cast::<PyQueue>().map_err(PyErr::from)?.get().value()));
        }
    }
    let parts = helpers(py)?.call_method1("array_parts", (obj,))?;
    if !parts.is_none() {
        return Ok(Some(tensor_from_parts(&parts)?));
    }
    Ok(None)
}

/// What one value holds, as far as it has been turned: what pickle's memo would make one
/// object in the receiver, which the value's parts, each turned on its own, would not.
#[derive(Default)]
struct Seen {
    /// The lists, dicts, handles (tensors, arrays, queues, ends) and the object to pickle
    /// met so far, by address (each lives as long as the value being turned, which holds
    /// it). Immutable values (numbers, strings, bytes, tuples) may come twice: a copy of
    /// each is the same to the receiver.
    met: HashSet<usize, BuildHasherDefault<crate::torch::AddressHasher>>,
    /// The one object to pickle met so far, and its depth, pickled only once the whole
    /// value is known (see [`to_value`]): an object may share anything beside it (a model
    /// its weights with a tensor beside it, a list with the value, an optimizer its
    /// parameters with the model beside it), and the whole value is then pickled instead.
    /// Pickled first and thrown away, it could leave behind what its pickling did (a
    /// descriptor torch's or multiprocessing's reductions keep for the receiver).
    deferred: Option<(Py<PyAny>, usize)>,
}

impl Seen {
    /// Notes `obj`; `Whole` when it was met before: a list, dict or pickled object then
    /// arrives as one object in two places, and a tensor as one tensor, as with pickle.
    fn once(&mut self, obj: &Bound<'_, PyAny>) -> Result<(), Refused> {
        if self.met.insert(obj.as_ptr() as usize) {
            Ok(())
        } else {
            Err(Refused::Whole)
        }
    }
}

fn value_of(py: Python<'_>, obj: &Bound<'_, PyAny>, depth: usize, seen: &mut Seen) -> Result<Value, Refused> {
    // `depth` levels above this one: a value here is at level `depth + 1`, at most
    // `MAX_DEPTH`; a pickled object's tensors are one level below it (see `pickled_at`).
    if depth + 1 > tensorshare::value::MAX_DEPTH {
        return Err(Refused::Whole);
    }
    if obj.is_none() {
        return Ok(Value::None);
    }
    if obj.is_exact_instance_of::<PyBool>() {
        return Ok(Value::Bool(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(i) = obj.extract::<i64>() {
            return Ok(Value::Int(i));
        }
        if let Ok(u) = obj.extract::<u64>() {
            return Ok(Value::UInt(u));
        }
        seen.once(obj)?;
        return pickled_at(py, obj, depth);
    }
    if obj.is_exact_instance_of::<PyFloat>() {
        return Ok(Value::Float(obj.extract()?));
    }
    if obj.is_exact_instance_of::<PyString>() {
        // A str with lone surrogates (a file name that is not UTF-8, as `os.fsdecode` gives
        // it) has no UTF-8 form for the wire's string: pickled, as multiprocessing sends it.
        return Ok(match obj.extract::<String>() {
            Ok(s) => Value::Str(s),
            Err(_) => pickled_at(py, obj, depth)?,
        });
    }
    if obj.is_exact_instance_of::<PyBytes>() {
        return Ok(Value::Bytes(obj.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes().to_vec()));
    }
    if obj.is_exact_instance_of::<PyList>() {
        seen.once(obj)?;
        let list = obj.cast::<PyList>().map_err(PyErr::from)?;
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(value_of(py, &item, depth + 1, seen)?);
        }
        return Ok(Value::List(out));
    }
    if obj.is_exact_instance_of::<PyTuple>() {
        let tuple = obj.cast::<PyTuple>().map_err(PyErr::from)?;
        let mut out = Vec::with_capacity(tuple.len());
        for item in tuple.iter() {
            out.push(value_of(py, &item, depth + 1, seen)?);
        }
        return Ok(Value::Tuple(out));
    }
    if obj.is_exact_instance_of::<PyDict>() {
        seen.once(obj)?;
        let dict = obj.cast::<PyDict>().map_err(PyErr::from)?;
        // Its items first, which runs no Python code: converting them may run some (a
        // pickled value's `__reduce__`, a finaliser, another thread while a large tensor is
        // moved), which may change the dict, and pyo3's iterator panics at a change of size.
        let items: Vec<_> = dict.iter().collect();
        let mut out = Vec::with_capacity(items.len());
        for (k, v) in &items {
            out.push((value_of(py, k, depth + 1, seen)?, value_of(py, v, depth + 1, seen)?));
        }
        // As pickle's iteration says it.
        if dict.len() != items.len() {
            return Err(PyRuntimeError::new_err("dictionary changed size during iteration").into());
        }
        return Ok(Value::Dict(out));
    }
    seen.once(obj)?;
    if let Some(v) = handle_of(py, obj)? {
        // A one-way pipe end is an `Object` with the end one level below it.
        if matches!(v, Value::Object { .. }) && depth + 2 > tensorshare::value::MAX_DEPTH {
            return Err(Refused::Whole);
        }
        return Ok(v);
    }
    // A second object to pickle: the two may share a third, or one hold the other.
    if seen.deferred.is_some() {
        return Err(Refused::Whole);
    }
    seen.deferred = Some((obj.clone().unbind(), depth));
    Ok(deferred_place())
}

/// `obj` pickled as an `Object` `depth` levels down: the tensors beside its pickle are one
/// level below it, and a one-way pipe end among them (an `Object` too) has its end one
/// more, so one within two levels of the deepest is refused (the caller pickles a value
/// further up, whole).
fn pickled_at(py: Python<'_>, obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, Refused> {
    if depth + 3 > tensorshare::value::MAX_DEPTH {
        return Err(Refused::Whole);
    }
    Ok(pickled(py, obj)?)
}

/// A tensor from what `_reduction.tensor_parts` says of a torch tensor or a numpy array.
fn tensor_from_parts(parts: &Bound<'_, PyAny>) -> PyResult<Value> {
    #[allow(clippy::type_complexity)]
    let (array, block, dtype, shape, strides, offset, requires_grad, parameter, device): (
        bool,
        Option<Bound<'_, Block>>,
        String,
        Vec<usize>,
        Vec<usize>,
        usize,
        bool,
        bool,
        String,
    ) = parts.extract()?;
    let dtype: DType = dtype.parse().map_err(to_py)?;
    let mut t = match (device.as_str(), block) {
        ("meta", _) => Tensor::try_meta(&shape, dtype).map_err(to_py)?,
        ("cpu", Some(block)) => {
            Tensor::from_storage(block.get().storage.clone(), dtype, &shape, &strides, offset)
                .map_err(to_py)?
        }
        (other, _) => {
            return Err(PyValueError::new_err(format!("a tensor on device {other:?} cannot be sent")))
        }
    };
    t.set_requires_grad(requires_grad).map_err(to_py)?;
    if parameter {
        t.set_kind(TensorKind::Parameter);
    }
    Ok(if array { Value::Array(t) } else { Value::Tensor(t) })
}

/// `value` as a Python object.
pub(crate) fn from_value(py: Python<'_>, value: Value) -> PyResult<Py<PyAny>> {
    Ok(match value {
        Value::None => py.None(),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::UInt(u) => u.into_pyobject(py)?.into_any().unbind(),
        Value::Float(f) => f.into_pyobject(py)?.into_any().unbind(),
        Value::Str(s) => PyString::new(py, &s).into_any().unbind(),
        Value::Bytes(b) => PyBytes::new(py, &b).into_any().unbind(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for v in items {
                list.append(from_value(py, v)?)?;
            }
            list.into_any().unbind()
        }
        Value::Tuple(items) => {
            let items = items.into_iter().map(|v| from_value(py, v)).collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any().unbind()
        }
        Value::Dict(items) => {
            let dict = PyDict::new(py);
            for (k, v) in items {
                dict.set_item(key_of(py, k)?, from_value(py, v)?)?;
            }
            dict.into_any().unbind()
        }
        Value::Tensor(t) => match crate::torch::api(py)? {
            Some(api) => crate::torch::from_tensor(py, api, t)?,
            // torch not imported yet: import it; without torch, a tensor arrives as a numpy array.
            None => match py.import("torch") {
                Ok(_) => match crate::torch::api(py)? {
                    Some(api) => crate::torch::from_tensor(py, api, t)?,
                    None => rebuild(py, t, true)?,
                },
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyImportError>(py) => rebuild(py, t, true)?,
                Err(e) => return Err(e),
            },
        },
        Value::Array(t) => rebuild(py, t, true)?,
        Value::Queue(q) => wrap_queue(py, PyQueue::from_queue(q), "Queue")?,
        Value::SimpleQueue(q) => wrap_queue(py, PyQueue::from_simple(q), "SimpleQueue")?,
        Value::Connection(c) => Py::new(py, crate::pipe::PyConnection::from_connection(c))?.into_any(),
        Value::Object { pickle, tensors } => {
            let inner = tensors.into_iter().map(|v| from_value(py, v)).collect::<PyResult<Vec<_>>>()?;
            helpers(py)?.call_method1("loads", (PyBytes::new(py, &pickle), inner))?.unbind()
        }
    })
}

/// A received dict key as a Python object. A Python key is hashable: a list (a Rust map
/// keyed by a `Vec`) arrives as a tuple, inside a tuple too; a dict (a Rust map keyed by a
/// map, or by an enum variant with content) has no Python form, and is an error that says so.
fn key_of(py: Python<'_>, key: Value) -> PyResult<Py<PyAny>> {
    match key {
        Value::List(items) | Value::Tuple(items) => {
            let items = items.into_iter().map(|v| key_of(py, v)).collect::<PyResult<Vec<_>>>()?;
            Ok(PyTuple::new(py, items)?.into_any().unbind())
        }
        Value::Dict(_) => Err(PyValueError::new_err(
            "a dict key that is a dict (a Rust map keyed by a map, a struct or an enum variant \
             with content) cannot be a key of a Python dict",
        )),
        other => from_value(py, other),
    }
}

/// A received queue as `tensorshare.multiprocessing`'s class of it.
fn wrap_queue(py: Python<'_>, q: PyQueue, class: &str) -> PyResult<Py<PyAny>> {
    let queues = py.import("tensorshare.multiprocessing._queues")?;
    let native = Py::new(py, q)?;
    Ok(queues.getattr("_rebuild")?.call1((queues.getattr(class)?, native))?.unbind())
}

fn rebuild(py: Python<'_>, t: Tensor, array: bool) -> PyResult<Py<PyAny>> {
    // A numpy array views bytes: a meta tensor has none (its storage is empty, whatever its
    // shape), and numpy takes an empty buffer for no buffer at all, so an array made over it
    // would point at nothing. It is refused, whether it came as an array (only a hostile
    // sender makes one) or as a tensor to a process without torch.
    let device = match t.device() {
        Device::Cpu => "cpu",
        Device::Meta => {
            return Err(PyValueError::new_err(format!(
                "a meta tensor of shape {:?} has no data, so it cannot become a numpy array",
                t.shape()
            )))
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "a tensor on {other:?} reached Python, which takes CPU and meta tensors"
            )))
        }
    };
    let block = match crate::torch::block_for(py, t.storage())? {
        (b, false) => b,
        (b, true) => {
            crate::torch::register_block(py, &b)?;
            b
        }
    };
    let args = (
        array,
        block,
        t.dtype().to_string(),
        PyTuple::new(py, t.shape())?,
        PyTuple::new(py, t.strides())?,
        t.storage_offset(),
        t.requires_grad(),
        t.kind() == TensorKind::Parameter,
        device,
    );
    Ok(helpers(py)?.call_method1("rebuild", args)?.unbind())
}

/// `obj` through the whole wire and back, as a receiver in another process would see it
/// (for tests and for checking what a value becomes).
#[pyfunction]
pub(crate) fn roundtrip(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let value = to_value(py, obj)?;
    let value: Value =
        py.detach(move || Message::encode(&value).and_then(Message::decode::<Value>)).map_err(to_py)?;
    from_value(py, value)
}
